"""The route table (kernels/routes.py) is the one place a product's kernel is decided, and the C is laid out by role
with one build per instruction-set level (kernels/library.py): the products take the route the table gives,
`inspect` prints the table, every kernel it names is a file of kernels/c/, each level is found by its sources'
hash and loaded where no compiler is, and the C's comments hold no measurements (docs/kernels.md does)."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deltaserve.kernels import library, native, routes
from deltaserve.kernels.linear import BlockLinear

ROOT = Path(__file__).resolve().parents[1]
CDIR = library.CDIR


def test_a_product_on_the_files_blocks_takes_the_route_the_table_gives_for_its_rows():
    """Each row count of a Q4_K and an IQ4_XS tensor (a K-quant and a type without a tile of its own on AVX2) and
    of a Q8_0 down projection runs what routes.blocks says, and the table changes only where its thresholds are."""
    from tests.test_file_blocks import random_blocks

    c = routes.capabilities()
    for kind in ("Q4_K", "IQ4_XS", "Q8_0"):
        lin = BlockLinear([(kind, torch.from_numpy(random_blocks(kind, 40, 512, seed=3)))], 512)
        lin.int8_activations = kind != "Q8_0"
        for rows in (1, routes.block_rows(), routes.block_rows() + 1, 70):
            with routes.recording() as ran:
                y = lin(torch.randn(rows, 512))
            assert ran == [routes.blocks(kind, rows, lin.int8_activations)] and y.shape == (rows, 40), (kind, rows)
        ranges = routes.table_rows([("blocks", kind, 512)])
        starts = {r.first for r in ranges if r.weights == "blocks"}
        multi = c.multi and c.vnni512 and kind in routes.MULTI_512  # the many-row tiles from 3 rows
        assert starts <= {1, routes.block_rows() + 1} | ({3} if multi else set()), ranges  # the table's thresholds
        if c.blocks:
            decode = [r for r in ranges if r.weights == "blocks" and r.route.family == "blocks"]
            assert decode[0].first == 1 and decode[-1].last == routes.block_rows(), ranges
            assert [r.route.kernel for r in decode][1:] == (["multi_tile (tiles_avx512.c)"] if multi else []), ranges


def test_q6_k_products_of_3_to_16_rows_take_the_many_row_tiles_and_the_one_call_decode_keeps_its_gemm():
    """On the 512-bit build Q6_K products of 3 to 16 rows take the many-row tiles (each row's sum the one it gets
    alone: tests/test_file_blocks.py checks the bits); Q4_K's, Q5_K's and Q8_0's stay on the pair tiles and the AVX2
    build on its rows. The one-call decode takes the GEMM from decode_gemm_rows() as before, and the many-row tiles
    only where DELTASERVE_BATCH_INVARIANT=on keeps every row count on the decode products."""
    base = dataclasses.replace(routes.capabilities(), vnni512=True, multi=True, blocks=True, one_call=True, amx=False,
                               prefill="auto", gemm_any=frozenset(routes.GEMM_KINDS), batch_invariant=False)
    multi = "multi_tile (tiles_avx512.c)"
    for kind in ("Q4_K", "Q5_K", "Q6_K", "Q8_0"):
        kernels = [routes.blocks(kind, n, True, base).kernel for n in range(1, routes.GEMV_ROWS + 1)]
        assert kernels == ["tiles_avx512"] * 2 + [multi if kind == "Q6_K" else "tiles_avx512"] * (routes.GEMV_ROWS - 2)
        avx2 = dataclasses.replace(base, vnni512=False, multi=False)
        assert {routes.blocks(kind, n, True, avx2).kernel for n in range(1, routes.GEMV_ROWS + 1)} == {"rows_avx2"}
        steps = [routes.decode_step(kind, n, base) for n in range(1, routes.TABLE_ROWS + 1)]
        assert [s.family for s in steps] == ["blocks"] * 2 + ["gemm"] * (routes.TABLE_ROWS - 2), kind
        invariant = dataclasses.replace(base, batch_invariant=True)
        steps = [routes.decode_step(kind, n, invariant).kernel for n in range(1, routes.TABLE_ROWS + 1)]
        assert steps == ["tiles_avx512"] * 2 + [multi if kind == "Q6_K" else "tiles_avx512"] * (routes.TABLE_ROWS - 2)


def test_with_batch_invariance_the_one_call_decode_never_takes_the_gemm(batch_invariant):
    """DELTASERVE_BATCH_INVARIANT=on (the fixture) takes the one-call decode's GEMM away: every row count of a call
    on the decode products (tests/test_batching.py checks the bits)."""
    assert routes.decode_gemm_rows() == 0
    assert all(routes.decode_step("Q4_K", n).family == "blocks" for n in range(1, routes.TABLE_ROWS + 1))


def test_an_override_changes_the_capabilities_for_its_block_only_and_refuses_a_name_it_does_not_have():
    before = routes.capabilities()
    with routes.override(amx=True, int8_exact=False) as c:
        assert c.amx and not c.int8_exact and routes.chunk_dtype("Q4_K") == torch.bfloat16
        assert routes.attention_dtype("cpu", False) == torch.bfloat16
    assert routes.capabilities() == before
    with pytest.raises(TypeError, match="no capabilities called"):
        with routes.override(avx1024=True):
            pass


def test_every_kernel_the_table_names_is_a_file_of_kernels_c():
    """On either build (the 512-bit tiles or the AVX2 rows; the GEMM's two tiles), every block type's decode and
    many-row kernels, the one-call decode's, the int8 tables' and the vision attention's are files of kernels/c/."""
    names = set()
    for vnni in (True, False):
        c = dataclasses.replace(routes.capabilities(), vnni512=vnni, blocks=True, tables=True, one_call=True,
                                amx=False, prefill="auto", gemm_fast=frozenset(routes.GEMM_KINDS),
                                gemm_any=frozenset(routes.GEMM_KINDS), attention_bf16=True, attention_f32=True)
        for kind in routes.PRODUCT_TYPES:
            for rows in (1, 64):
                names |= {routes.blocks(kind, rows, True, c).kernel, routes.decode_step(kind, rows, c).kernel}
        names |= {routes.table(1, 32, True, "cpu", c).kernel, routes.decode_step("F32", 1, c).kernel,
                  routes.vision_attention("bf16", 72, "cpu", c), routes.vision_attention("f32", 72, "cpu", c)}
    files = {re.search(r"\((\w+\.c)\)", n)[1] if "(" in n else n + ".c" for n in names
             if not n.startswith(("chunks_", "torch"))}
    assert files == {"tiles_avx512.c", "rows_avx2.c", "products.c", "gemm_avx512.c", "gemm_avx2.c", "decode.c",
                     "tables_avx512.c", "attention_vision_avx512.c", "attention_vision_avx2.c"}, files
    assert all((CDIR / f).is_file() for f in files), files


def test_inspect_prints_the_route_table_of_the_models_own_weights():
    from tests.fixtures import models as fx

    out = subprocess.run([sys.executable, "-m", "deltaserve", "inspect", str(fx.gguf_path("hybrid", "q8_0"))],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-600:]
    lines = out.stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("routes ("))
    c = routes.capabilities()
    assert (f"{c.build} build" if c.build else "none") in lines[head]
    rows = [line.split() for line in lines[head + 1:] if line.startswith("  blocks ")]
    assert {r[1] for r in rows} == {"Q8_0"}
    for r in rows:  # "blocks Q8_0 rows 1-16 tiles_avx512, activations int8/32"
        first = int(r[3].split("-")[0].rstrip("+"))
        assert " ".join(r[4:]) == f"{routes.blocks('Q8_0', first).kernel}, activations {routes.blocks('Q8_0', first).dtype}"
    assert any(line.startswith("  one call ") for line in lines[head:]) == c.one_call


FLAGS = {  # /proc/cpuinfo's flags of the CPUs the levels are for (the ones they test)
    "zen3": {"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe"},
    "cascadelake": {"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe", "avx512f", "avx512bw", "avx512cd",
                    "avx512dq", "avx512vl", "avx512_vnni"},
}
FLAGS["zen4"] = FLAGS["cascadelake"] | {"avx512_bf16", "gfni", "avx512vbmi"}
FLAGS["sapphirerapids"] = FLAGS["zen4"] | {"amx_bf16", "amx_tile"}


def test_each_cpu_loads_the_best_level_its_flags_run_and_a_named_level_is_the_only_one(monkeypatch):
    monkeypatch.delenv("DELTASERVE_ISA", raising=False)  # the suite may run under a named level (test_native_avx2)
    names = {cpu: [v.name for v in library.candidates(flags)] for cpu, flags in FLAGS.items()}
    assert names == {"zen3": ["x86-64-v3", "native"], "cascadelake": ["avx512-vnni", "x86-64-v3", "native"],
                     "zen4": ["avx512-bf16", "avx512-vnni", "x86-64-v3", "native"],
                     "sapphirerapids": ["avx512-bf16", "avx512-vnni", "x86-64-v3", "native"]}
    assert [v.name for v in library.candidates({"avx2", "fma", "f16c"})] == ["native"]  # a VM hiding BMI: -march=native
    monkeypatch.setenv("DELTASERVE_ISA", "avx2")
    assert [v.name for v in library.candidates(FLAGS["zen4"])] == ["x86-64-v3"]


def test_each_level_compiles_every_file_of_kernels_c():
    """Every C file compiles for every level (a file for another instruction set compiles to nothing), whatever
    this CPU: an edit that breaks a level's build is found on any machine (the level this process loads is built
    whole by the library already)."""
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        pytest.skip("no C compiler")
    sources = [str(s) for s in library.sources()]
    runs = {}
    for v in (v for v in library.VARIANTS if v is not library.loaded()[0]):
        for exact in (True, False):  # the files on the blocks are built without contraction, the others with it
            files = [s for s in sources if (Path(s).name in library.EXACT) == exact]
            runs[(v.name, exact)] = subprocess.Popen(
                [cc, "-fsyntax-only", "-fopenmp", *v.march, f"-I{CDIR}", "-Werror=implicit",
                 *(["-ffp-contract=off"] if exact else []), *files], stderr=subprocess.PIPE, text=True)
    for key, run in runs.items():
        err = run.communicate(timeout=300)[1]
        assert run.returncode == 0, (key, err[-1500:])


def test_a_shared_cache_serves_a_machine_without_a_compiler_and_refuses_another_build(tmp_path):
    """The level's library this process loaded, put in another cache directory as a fleet's build would be: a
    process there with no working compiler loads it, compiling nothing; a library under that name whose build
    information names other sources is refused, with the reason."""
    v, path = library.loaded()
    cc = shutil.which(os.environ.get("CC", "cc"))
    if v is None or v is library.NATIVE or cc is None:
        pytest.skip(f"no level's library here, or no compiler ({library.why_not()})")
    shared = tmp_path / "native"
    shared.mkdir()
    shutil.copy(path, shared / path.name)
    probe = ("from deltaserve.kernels import library; v, p = library.loaded(); "
             "print(v.name if v else None, p, library.why_not())")
    env = {**os.environ, "DELTASERVE_CACHE_DIR": str(tmp_path), "CC": "false"}  # DELTASERVE_ISA kept: the same level
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    assert out.stdout.split()[:2] == [v.name, str(shared / path.name)], out.stdout + out.stderr[-800:]
    assert "compiling" not in out.stderr
    other = tmp_path / "other.c"  # a library of this ABI built from other sources
    other.write_text(f'int ds_abi_version(void) {{ return {library.ABI}; }}\n'
                     f'const char *ds_build_info(void) {{ return "{v.name} 000000000000"; }}\n')
    subprocess.run([cc, "-shared", "-fPIC", str(other), "-o", str(shared / path.name)], check=True)
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    assert out.stdout.startswith("None None ") and "is another build" in out.stdout, out.stdout + out.stderr[-800:]


def test_the_c_is_split_by_role_and_its_comments_carry_no_measurements():
    """The largest C file stays under 1,200 lines, and a comment says what and why: the numbers measured when a
    choice was made are docs/kernels.md's, not the code's (where the next change would leave them stale)."""
    sizes = {p.name: len(p.read_text().splitlines()) for p in CDIR.glob("*.[ch]")}
    assert max(sizes.values()) < 1200, sizes
    measured = re.compile(r"\d[\d.]*\s?(?:ms|us|GB/s|GMAC/s|GFLOP/s|GOP/s|tok/s|G weights/s)\b|\d+(?:\.\d+)?x (?:faster|"
                          r"slower)|20\d\d-\d\d-\d\d")
    found = []
    for p in sorted(CDIR.glob("*.[ch]")):
        for comment in re.findall(r"/\*.*?\*/", p.read_text(), re.S):
            found += [f"{p.name}: {m}" for m in measured.findall(comment)]
    assert not found, found
