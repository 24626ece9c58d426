"""Kernels: deltaserve's native CPU kernels (the C in c/, built once per instruction-set level: library.py),
the route table (routes.py) and the linear-layer seam (linear.py)."""
