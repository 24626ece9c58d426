"""Kernels: deltaserve's native CPU kernel (native.c, built once per machine) and the linear-layer seam."""
