"""Every tensor type llama.cpp's quantizer writes for these models loads (issue 30): files made by llama-quantize
itself (each a mix of types, as the downloads are), and a file holding every remaining type (the 1- to 3-bit IQ
types llama-quantize makes only with an importance matrix, NVFP4) as random blocks; our logits against llama.cpp's on
the same files and against transformers' f32 model. The dequantization itself is tested bit for bit against
gguf.quants in tests/test_quant.py."""

from __future__ import annotations

import functools
from collections import Counter

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader

import deltaserve
from deltaserve.frontends.cli import main as cli
from tests import llama_oracle as oracle
from tests.gguf_edit import rewrite
from tests.fixtures import models as fx
from tests.test_moe import by_llama_quantize, decode_all, oracle_model, prompt

oracle.require()

# llama-quantize presets that need no importance matrix, each with the types it must leave in the MoE fixture's file
PRESETS = {"Q5_1": {"Q5_1"}, "Q3_K_M": {"Q3_K", "Q4_K"}, "IQ4_XS": {"IQ4_XS"}, "IQ3_S": {"IQ3_S"},
           "MXFP4_MOE": {"MXFP4"}, "Q4_1": {"Q4_1"}, "TQ2_0": {"TQ2_0"}}


@functools.lru_cache(maxsize=None)
def reference(ids: tuple) -> torch.Tensor:
    with torch.no_grad():
        return oracle_model()(input_ids=torch.tensor([list(ids)])).logits[0].float()


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_a_llama_quantize_preset_loads_and_is_no_farther_from_f32_than_llama_cpp(preset):
    path = by_llama_quantize(preset)
    m = deltaserve.load(path, cache=False)
    types = Counter(t.type for t in m.host.tensor_summary)
    assert PRESETS[preset] <= set(types), types
    assert "one native call per decoded token" in m.session(quiet=True).notices[-1]
    ids = prompt(48, seed=21)
    want = reference(tuple(ids))
    for n_batch, mine in ((256, m.logits(ids)), (1, decode_all(m, ids[:16]))):
        theirs = torch.from_numpy(oracle.logits(path, ids[:mine.shape[0]], n_ctx=256, n_batch=n_batch))
        theirs = theirs[:, :mine.shape[1]]
        w = want[:mine.shape[0]]
        d_mine, d_theirs = (mine - w).abs().mean().item(), (theirs - w).abs().mean().item()
        assert d_mine <= 1.1 * d_theirs, (preset, n_batch, d_mine, d_theirs)


# every type no preset above leaves in a file: the tensor it takes (the MoE fixture's, rows of 256) and its scale's
# byte offsets in a block (set to small finite values, so that random blocks make a usable model)
RETYPED = {"blk.0.attn_qkv.weight": T.IQ2_XXS, "blk.0.ssm_out.weight": T.IQ1_S, "blk.0.attn_gate.weight": T.IQ2_XS,
           "blk.2.attn_qkv.weight": T.IQ2_S, "blk.3.attn_qkv.weight": T.IQ3_XXS, "blk.2.ssm_out.weight": T.IQ1_M,
           "blk.3.ssm_out.weight": T.NVFP4, "blk.1.attn_output.weight": T.TQ1_0, "blk.4.attn_output.weight": T.Q2_K,
           "blk.2.attn_gate.weight": T.Q5_0, "blk.3.attn_gate.weight": T.IQ4_NL}


def random_blocks(qtype: T, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    small = np.array([0x1C00], dtype=np.uint16).view(np.uint8)  # f16 2^-8
    if qtype == T.IQ1_M:  # its f16 in the top nibbles of four scale words: 2^-8 = 0x1C00
        for j, nib in enumerate((0x0, 0x0, 0xC, 0x1)):
            raw[:, 49 + 2 * j] = (raw[:, 49 + 2 * j] & 0x0F) | (nib << 4)
    elif qtype == T.NVFP4:  # four e4m3 scales: 2^-3 .. 2^-1 (times the values' 0.5)
        raw[:, 0:4] = rng.integers(0x20, 0x30, size=(raw.shape[0], 4), dtype=np.uint8)
    else:
        at = {T.Q2_K: 80, T.TQ1_0: 52}.get(qtype, 0)
        raw[:, at:at + 2] = small
        if qtype == T.Q2_K:
            raw[:, 82:84] = small
    return raw.reshape(rows, -1)


@functools.lru_cache(maxsize=None)
def every_remaining_type():
    src = by_llama_quantize("Q8_0")
    out = src.with_name("model-every-remaining-type.gguf")
    if not out.exists():
        rng = np.random.default_rng(3)
        shapes = {t.name: tuple(int(s) for s in reversed(t.shape)) for t in GGUFReader(src).tensors}
        replace = {name: (qtype, random_blocks(qtype, int(np.prod(shapes[name][:-1])), shapes[name][-1], rng))
                   for name, qtype in RETYPED.items()}
        rewrite(src, out, replace=replace)
    return out


def test_a_file_with_every_remaining_type_reads_as_llama_cpp_reads_it(capsys):
    """Our logits and llama.cpp's on the same file stay together where the retyped tensors move both far from the
    Q8_0 file they came from: a type read wrong would move ours elsewhere."""
    path, base = every_remaining_type(), by_llama_quantize("Q8_0")
    m = deltaserve.load(path, cache=False)
    assert {t.type for t in m.host.tensor_summary} >= {q.name for q in RETYPED.values()}
    ids = prompt(40, seed=23)
    mine = m.logits(ids)
    theirs, before = (torch.from_numpy(oracle.logits(p, ids, n_ctx=256, n_batch=256))[:, :mine.shape[1]]
                      for p in (path, base))
    assert torch.isfinite(mine).all()
    moved, apart = (theirs - before).abs().mean().item(), (mine - theirs).abs().mean().item()
    assert apart <= 0.1 * moved, (apart, moved)
    assert cli(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("tensor types: "))
    for q in RETYPED.values():
        assert f"{q.name} " in line, line
    assert m.session(quiet=True).notices[-1].count("one native call per decoded token") == 1


OTHER_TYPES = [t for t in ("Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S",
                           "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0", "MXFP4", "NVFP4")]


@pytest.mark.parametrize("kind", OTHER_TYPES)
def test_blocks_c_reads_every_other_type_bit_for_bit_and_multiplies_its_values_as_llama_cpp_does(kind):
    """dequant.c's dequantization of these types (deq_row_more) against gguf.quants, bit for bit; their products
    (each row expanded once to int8 values with a scale per 16, times activations int8 per block of 32 as llama.cpp
    quantizes them for these types) against that arithmetic in float64, each row its own, for decode and batches."""
    from deltaserve.kernels import linear as L
    from deltaserve.kernels import native, routes
    from tests.test_file_blocks import quantized_activations
    from tests.test_quant import random_raw

    if not native.portable()[0]:
        pytest.skip(f"products.c does not run here: {native.portable()[1]}")
    block = gguf.GGML_QUANT_SIZES[T[kind]][0]
    # rows of 512 (whole groups of 8 blocks) and, for blocks of 32, of 608 (the last 3 blocks past the groups)
    for rows, cols in ((37, 512), (37, 608)) if block == 32 else ((37, 512),):
        raw = random_raw(T[kind], (rows, cols), seed=len(kind))
        block, size = gguf.GGML_QUANT_SIZES[T[kind]]
        blocks = raw.reshape(-1, size)
        if kind == "MXFP4":  # e8m0 scales of 2^-8 .. 2^1 (a random byte reaches 2^126: compared in test_quant.py)
            blocks[:, 0] = np.random.default_rng(1).integers(120, 130, blocks.shape[0], dtype=np.uint8)
        elif kind == "NVFP4":
            blocks[:, 0:4] = np.random.default_rng(1).integers(0x20, 0x48, (blocks.shape[0], 4), dtype=np.uint8)
        with np.errstate(all="ignore"):
            want = gguf.quants.dequantize(raw, T[kind]).reshape(rows, cols)
        out = torch.empty(rows, cols)
        assert native.dequant(L.GGUF_TYPES[kind], torch.from_numpy(raw), cols, out)
        assert np.array_equal(out.numpy().view(np.uint32), want.view(np.uint32))
        if native.has("ds_dequant_bf16"):  # the prefill's bf16 chunks: those values rounded as torch rounds them
            got = torch.full((rows, cols), float("nan"), dtype=torch.bfloat16)
            assert native.dequant_bf16(L.GGUF_TYPES[kind], torch.from_numpy(raw), cols, got)
            assert torch.equal(got.view(torch.int16), torch.from_numpy(want).bfloat16().view(torch.int16))
        lin = L.BlockLinear([(kind, torch.from_numpy(raw))], cols)
        w = torch.from_numpy(want).double()
        assert w.isfinite().all()
        g = torch.Generator().manual_seed(4)
        for m in (1, 3, 16):
            x = torch.randn(m, cols, generator=g)
            with routes.recording() as ran:
                y = lin(x)
            assert ran == [routes.blocks(kind, m)] and ran[0].family == "blocks"
            claimed = quantized_activations(x, "Q8_0") @ w.t()
            assert ((y - claimed).norm(dim=1) / claimed.norm(dim=1)).max().item() < 1e-5, (kind, m)
            exact = x.double() @ w.t()
            assert ((y - exact).norm(dim=1) / exact.norm(dim=1)).max().item() < 0.02, (kind, m)
            for i in range(m):
                assert torch.equal(lin(x[i:i + 1])[0], y[i]), (kind, m, i)


@pytest.mark.parametrize("preset", ["Q5_0", "IQ4_NL"])
def test_a_dense_model_quantized_by_llama_cpp_to_a_preset_is_no_farther_from_f32_than_llama_cpp(preset):
    """The same on a dense fixture ("deep": rows of 96, so llama-quantize keeps 32-value blocks)."""
    src = fx.gguf_path("deep", "f32")
    path = src.with_name(f"model-{preset}-by-llama.cpp.gguf")
    if not path.exists():
        tmp = path.with_suffix(".part")
        assert oracle.quantize(src, tmp, preset) == 0
        tmp.replace(path)
    m = deltaserve.load(path, cache=False)
    assert preset in {t.type for t in m.host.tensor_summary}
    ids = torch.randint(0, m.tokenizer.vocab_size, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        want = fx.load_hf_model("deep")(input_ids=torch.tensor([ids])).logits[0].float()
    for n_batch, mine in ((256, m.logits(ids)), (1, decode_all(m, ids[:16]))):
        theirs = torch.from_numpy(oracle.logits(path, ids[:mine.shape[0]], n_ctx=256, n_batch=n_batch))
        w = want[:mine.shape[0]]
        d_mine, d_theirs = (mine - w).abs().mean().item(), (theirs[:, :mine.shape[1]] - w).abs().mean().item()
        assert d_mine <= 1.1 * d_theirs, (preset, n_batch, d_mine, d_theirs)
