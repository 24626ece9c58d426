"""The one-call native decode over an f16 or bf16 KV cache (attention_decode.c's attn_group / attn_merge).

The native decode reads a 16-bit cache in its type: each step's logits follow the torch decode on the same cache
type (which widens the cache to f32 and runs the same math: only the order of the sums differs) at every depth from
1 to 300 (the kernel's two-key steps and its sub-blocks of 32 positions), the cache it writes is the
f32 cache's values rounded as torch rounds them, and its distance from an f32-cache run is the torch decode's. On
the demo model (2 query heads a KV head) and on the `deep` fixture with its three KV heads folded into one (6 query
heads a group: a group of 4 and one of 2 in the kernel's passes, the 27B shape's 6). Rows of several sequences in one
call each read their own cache (bit for bit their decode alone, batch-invariant), and past a chunk of 512 positions
(the chunks' softmax joined) a row still follows the torch decode, bit for bit the same on 1 thread or 8. Bounds measured on these models: native against
torch at most 3.4e-5 (f16) and 6.6e-5 (bf16) over 300 steps of the demo.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import deltaserve
from deltaserve.engine.forward import Forward
from deltaserve.engine.state import DecodeState
from deltaserve.kernels import native
from tests.fixtures import models as fx

pytestmark = pytest.mark.skipif(not native.has("ds_decode_tokens"), reason="no one-call native decode on this CPU")

TYPES = {"f16": torch.float16, "bf16": torch.bfloat16}
BOUND = {"f16": 2e-4, "bf16": 4e-4}  # native against torch on the same cache: measured 3.4e-5, 6.6e-5 (demo)
STEPS = 300


@pytest.fixture(scope="module")
def demo():
    m = deltaserve.load(cache=False)  # the demo model: its file's blocks take the one-call decode
    return m.config, m.host.weights


def one_kv_head(name: str = "deep"):
    """A fixture model with its KV heads folded into one (each attention layer keeps KV head 0's k and v rows), its
    projections as F16 blocks (a type the one-call decode's products take at any width): every query head of a
    layer reads the same cache."""
    import gguf
    import numpy as np

    from deltaserve.engine.weights import AttentionWeights, LayerWeights, Weights
    from deltaserve.kernels.linear import BlockLinear, StackedLinear

    def blocks(w: torch.Tensor) -> BlockLinear:
        data = gguf.quants.quantize(w.float().contiguous().numpy(), gguf.GGMLQuantizationType.F16)
        return BlockLinear([("F16", torch.from_numpy(np.ascontiguousarray(data).view(np.uint8)))], w.shape[1])

    def stack(parts) -> StackedLinear:
        return StackedLinear([blocks(p) for p in parts])

    m = deltaserve.load(fx.gguf_path(name, "f32"), cache=False)
    c, w = m.config, m.host.weights
    hd = c.head_dim
    layers = []
    for lw in w.layers:
        mx = lw.mixer
        if isinstance(mx, AttentionWeights):
            q, k, v = torch.split(mx.qkv.dense(), list(mx.qkv.sizes))
            mx = dataclasses.replace(mx, qkv=stack([q, k[:hd], v[:hd]]), o=blocks(mx.o.dense()))
        else:
            mx = dataclasses.replace(mx, in_proj=stack(torch.split(mx.in_proj.dense(), list(mx.in_proj.sizes))),
                                     out=blocks(mx.out.dense()))
        gate_up = stack(torch.split(lw.gate_up.dense(), list(lw.gate_up.sizes)))
        layers.append(LayerWeights(lw.attn_norm, lw.post_norm, mx, gate_up, blocks(lw.down.dense())))
    return dataclasses.replace(c, num_kv_heads=1), Weights(w.embed, layers, w.final_norm, blocks(w.lm_head.dense()))


@pytest.fixture(scope="module")
def f32_runs():
    """Each model's f32-cache runs (native, torch) over the test's tokens, computed once for both 16-bit types."""
    return {}


@pytest.fixture(scope="module")
def grouped():
    if not native.library().blk_kind(1):
        pytest.skip("this build's products do not take F16 blocks")
    return one_kv_head()


def ids_for(config, n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, config.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(f: Forward, kv_dtype: torch.dtype, ids: list[int]) -> tuple[torch.Tensor, DecodeState]:
    """Every token decoded one step at a time (teacher-forced): the logits of each step, and the state."""
    st = f.new_state(len(ids), kv_dtype=kv_dtype)
    return torch.stack([f.decode(st, t) for t in ids]), st


def clone(f: Forward, st: DecodeState) -> DecodeState:
    out = f.new_state(st.capacity, kv_dtype=st.kv_dtype)
    for i, (k, v) in st.kv.items():
        out.kv[i][0].copy_(k)
        out.kv[i][1].copy_(v)
    for i in st.conv:
        out.conv[i].copy_(st.conv[i])
        out.ssm[i].copy_(st.ssm[i])
    out.length = st.length
    return out


@pytest.mark.parametrize("kv_type", list(TYPES))
@pytest.mark.parametrize("model", ["demo", "grouped"])
def test_a_16_bit_cache_decodes_natively_as_the_torch_decode_on_the_same_cache_at_every_depth_to_300(
        model, kv_type, request, f32_runs):
    config, weights = request.getfixturevalue(model)
    g = config.num_attention_heads // config.num_kv_heads
    assert g == (2 if model == "demo" else 6)
    native_f, torch_f = Forward(config, weights, one_call=True), Forward(config, weights, one_call=False)
    assert native_f.token_program()[0] is not None, native_f.token_program()[1]
    ids = ids_for(config, STEPS)
    dtype = TYPES[kv_type]
    assert native_f._native([native_f.new_state(8, kv_dtype=dtype)]) is not None  # the native decode takes it
    ours, ours_state = run(native_f, dtype, ids)
    theirs, _ = run(torch_f, dtype, ids)
    gap = (ours - theirs).abs().amax(-1)  # each step's (each depth's) largest logit difference
    assert gap.max().item() < BOUND[kv_type], (gap.argmax().item(), gap.max().item())
    # the cache written is the f32 cache's values rounded to the type (the first attention layer's input does not
    # depend on the cache: the same in both runs)
    if model not in f32_runs:
        f32_runs[model] = run(native_f, torch.float32, ids), run(torch_f, torch.float32, ids)[0]
    (exact, exact_state), reference = f32_runs[model]
    first = config.attention_layers[0]
    for j in (0, 1):
        assert ours_state.kv[first][j].dtype == dtype
        assert torch.equal(ours_state.kv[first][j], exact_state.kv[first][j].to(dtype))
    # the type's rounding moves the logits as far from the f32 cache's as it moves the torch decode's
    ours_off, theirs_off = (ours - exact).abs().max().item(), (theirs - reference).abs().max().item()
    assert 0 < ours_off <= 1.1 * theirs_off + BOUND[kv_type], (ours_off, theirs_off)


@pytest.mark.parametrize("kv_type", list(TYPES))
def test_rows_of_several_sequences_in_one_native_call_each_read_their_own_cache(demo, kv_type, batch_invariant):
    config, weights = demo
    f = Forward(config, weights, one_call=True)
    dtype = TYPES[kv_type]
    depths = [1, 9, 120, 300]  # prefilled lengths: each row at its own depth in the same call
    states = []
    for k, n in enumerate(depths):
        st = f.new_state(n + 4, kv_dtype=dtype)
        f.prefill(st, ids_for(config, n, seed=k + 1))
        states.append(st)
    alone = [clone(f, st) for st in states]
    assert f._native(states) is not None
    program = f.token_program()[0]
    for step in range(3):
        tokens = [(7 * step + 11 * k) % config.vocab_size for k in range(len(states))]
        together = program.decode(states, tokens, nthreads=2)
        for k, st in enumerate(alone):
            assert torch.equal(together[k], program.decode([st], [tokens[k]], nthreads=2)[0]), (step, k)
    for st, own in zip(states, alone):
        assert st.length == own.length and all(torch.equal(st.kv[i][j], own.kv[i][j]) for i in st.kv for j in (0, 1))


def test_past_a_chunk_of_512_positions_a_row_follows_the_torch_decode_on_any_thread_count(demo):
    """A row's positions are read in chunks of 512 (tasks shared among the threads), their softmax parts joined:
    at depths 511 to 514 and 1024 to 1026 (one, two, then three chunks, the last from its first position) the logits follow the torch decode,
    and the chunks are the same on 1 thread or 8, so are the logits."""
    config, weights = demo
    f = Forward(config, weights, one_call=True)
    program = f.token_program()[0]
    torch_f = Forward(config, weights, one_call=False)
    for kv_type, dtype in TYPES.items():
        st = f.new_state(1032, kv_dtype=dtype)
        f.prefill(st, ids_for(config, 510, seed=5))
        many, one, reference = st, clone(f, st), clone(f, st)
        for t in range(4):  # depths 511 .. 514 (one, then two chunks)
            a = program.decode([many], [t + 3], nthreads=8)[0]
            assert torch.equal(a, program.decode([one], [t + 3], nthreads=1)[0]), kv_type
            assert (a - torch_f.decode(reference, t + 3)).abs().max().item() < BOUND[kv_type], kv_type
        ids = ids_for(config, 1023 - many.length, seed=6)
        for s in (many, reference):
            f.prefill(s, ids)
        for t in range(3):  # depths 1024 .. 1026 (the third chunk from its first position)
            a = program.decode([many], [t + 3], nthreads=8)[0]
            assert (a - torch_f.decode(reference, t + 3)).abs().max().item() < BOUND[kv_type], kv_type


def test_one_native_call_takes_one_kv_type_and_says_so_when_given_two(demo):
    config, weights = demo
    f = Forward(config, weights, one_call=True)
    program = f.token_program()[0]
    mixed = [f.new_state(8, kv_dtype=torch.float16), f.new_state(8, kv_dtype=torch.float32)]
    assert f._native(mixed) is None and f._native(mixed[:1]) is not None
    before = mixed[0].kv[config.attention_layers[0]][0].clone()
    with pytest.raises(ValueError, match=r"KV caches of .* in one native call"):
        program.decode(mixed, [1, 2])
    assert torch.equal(mixed[0].kv[config.attention_layers[0]][0], before)  # nothing written
    out = f.decode_batch(mixed, [1, 2])  # the torch decode takes a mix
    assert out.shape[0] == 2 and [st.length for st in mixed] == [1, 1]
