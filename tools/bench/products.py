"""One decode-shaped product (one activation row) on random blocks of each type, held in the caches: how fast
the decode products (kernels/c/products.c) turn a type's blocks into sums, apart from the memory (a decode step reads
its weights from memory; a type whose product runs below the memory's speed here is compute-bound there too).

    python -m tools.bench.products IQ1_S IQ2_XXS Q4_K [--rows 4096 --cols 2048 --threads 2]

Prints, per type, the median of 30 products: ms, and the weights' GB/s. The blocks' bytes are random (every byte
pattern is a valid block of these types) with each block's leading f16 scale set small (MXFP4's e8m0 one to 2^-4);
where a type keeps its scale elsewhere (the K-quants) the sums may not be finite, which does not change the work.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main(argv=None) -> None:
    import numpy as np
    import torch
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from deltaserve.kernels.linear import BlockLinear

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("types", nargs="+")
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    rng = np.random.default_rng(0)
    for name in a.types:
        per, size = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
        raw = rng.integers(0, 256, (a.rows, a.cols // per * size), dtype=np.uint8)
        if name == "MXFP4":  # its first byte is the block's e8m0 scale: 2^(123 - 127), a normal f32 (0 is 2^-127,
            raw.reshape(a.rows, -1, size)[:, :, 0] = 123  # a subnormal one, whose arithmetic is ~100x slower)
        else:
            raw.reshape(a.rows, -1, size)[:, :, 0:2] = (0, 0x2C)  # f16 0.0625
        lin = BlockLinear([(name, torch.from_numpy(raw))], a.cols)
        x = torch.randn(1, a.cols)
        lin(x)
        times = []
        for _ in range(30):
            t0 = time.perf_counter()
            lin(x)
            times.append(time.perf_counter() - t0)
        s = statistics.median(times)
        print(f"{name:8s} {raw.nbytes / 2**20:7.1f} MiB {s * 1e3:7.3f} ms {raw.nbytes / s / 1e9:6.1f} GB/s", flush=True)


if __name__ == "__main__":
    main()
