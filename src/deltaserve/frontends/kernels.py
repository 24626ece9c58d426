"""`deltaserve kernels`: the native kernels built for this CPU's level, for levels named, or for every level at once
(what a wheel's kernels/lib/ or a fleet's shared cache directory holds, so that no machine compiles), and which build
this process loads."""

from __future__ import annotations


def add_commands(sub) -> None:
    """The kernels command on the CLI's subparsers."""
    k = sub.add_parser("kernels", help="build the native kernels: for this CPU, for named levels, or every level",
                       description="Build the native C kernels (kernels/c/) once per instruction-set level: the level "
                                   "this CPU loads (no option), the levels named (--isa), or every level (--all). A "
                                   "machine loads the best level its CPU runs from the package's prebuilt "
                                   "directory or the cache (DELTASERVE_CACHE_DIR) without compiling.")
    k.add_argument("--all", action="store_true",
                   help="every level (avx512-bf16, avx512-vnni, x86-64-v3): a fleet's or a wheel's set")
    k.add_argument("--isa", action="append", default=None, metavar="LEVEL",
                   help="a level to build (repeatable): avx512-bf16, avx512-vnni, x86-64-v3 (avx2), native")
    k.add_argument("--out", default=None, metavar="DIR",
                   help="where the libraries go (default: the cache's native/ directory; a package's kernels/lib/ "
                        "is where a wheel carries them)")
    k.set_defaults(func=cmd_kernels)


def cmd_kernels(a) -> int:
    from deltaserve.api import build_kernels, kernel_levels, kernel_loaded

    if a.all or a.isa:
        for name, path in build_kernels(None if a.all else a.isa, a.out):
            print(f"{name}: {path}")
    elif a.out:
        runs = [name for name, _, runs in kernel_levels() if runs]
        for name, path in build_kernels(runs[:1], a.out):
            print(f"{name}: {path}")
    print("levels (best first; * this CPU runs it):")
    for name, cpus, runs in kernel_levels():
        print(f"  {'*' if runs else ' '} {name:<12} {cpus}")
    print(f"this process loads: {kernel_loaded()}")
    return 0
