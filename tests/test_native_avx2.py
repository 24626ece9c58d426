"""The native DeltaNet kernels and the one-call decode follow the torch versions (engine/layers.py, the torch decode).

They run wherever the library holds the kernel (`native.has`): the prefill's delta rule and conv are
deltanet_avx512.c's on an AVX512-VNNI build and deltanet_avx2.c's on an AVX2 one (an AMD EPYC Zen 3), so the same tests
cover both; the decode's DeltaNet step (deltanet.c) and the one-call decode (decode.c) on the file's own blocks are the
same on both (with products.c's products: rows_avx2.c's or tiles_avx512.c's).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from deltaserve.engine import layers
from deltaserve.kernels import native


def need(*symbols: str) -> None:
    missing = [s for s in symbols if not native.has(s)]
    if missing:
        pytest.skip(f"{', '.join(missing)} not in this machine's native library ({native.status()[1]})")


def heads(g: torch.Generator, t: int, h: int, dk: int, dv: int):
    q = layers.l2_normalize(torch.randn(t, h, dk, generator=g)) * dk ** -0.5
    k = layers.l2_normalize(torch.randn(t, h, dk, generator=g))
    return q, k, torch.randn(t, h, dv, generator=g)


def test_the_native_delta_rule_follows_the_stepwise_rule_at_the_real_head_size_through_fast_and_no_decay():
    need("ds_delta_rule")
    g = torch.Generator().manual_seed(3)
    h, dk, dv = 4, 128, 128  # the real heads (dk = dv = 128); 4 of them
    for t, scale in ((1, 1.0), (3, 1.0), (130, 1.0), (200, 6.0)):
        q, k, v = heads(g, t, h, dk, dv)
        decay = -torch.rand(t, h, generator=g) * scale  # log decays; 6: the state forgets within a few tokens
        decay[:, 0] = 0.0  # a head that never decays
        decay[t // 2:, 1] = -90.0  # and one whose decay underflows to zero half way
        beta = torch.rand(t, h, generator=g)
        start = torch.randn(h, dk, dv, generator=g) * 0.3
        ours_state, step_state = start.clone(), start.clone()
        ours = native.delta_rule(q, k, v, decay, beta, ours_state)
        want = torch.stack([layers.delta_rule_step(q[i], k[i], v[i], decay[i], beta[i], step_state) for i in range(t)])
        assert torch.allclose(ours, want, atol=2e-5, rtol=1e-4), (t, (ours - want).abs().max().item())
        assert torch.allclose(ours_state, step_state, atol=2e-5, rtol=1e-4), (t, (ours_state - step_state).abs().max())


def test_the_native_delta_rule_takes_value_sizes_in_multiples_of_32_and_leaves_others_to_torch_untouched():
    need("ds_delta_rule")
    g = torch.Generator().manual_seed(4)
    q, k, v = heads(g, 9, 2, 6, 96)  # a small even key size, three 32-column groups of values
    decay, beta = -torch.rand(9, 2, generator=g), torch.rand(9, 2, generator=g)
    a, b = torch.zeros(2, 6, 96), torch.zeros(2, 6, 96)
    ours = native.delta_rule(q, k, v, decay, beta, a)
    want = layers.delta_rule_chunked(q, k, v, decay, beta, b)
    assert torch.allclose(ours, want, atol=1e-5, rtol=1e-4) and torch.allclose(a, b, atol=1e-5, rtol=1e-4)
    untouched = torch.ones(2, 6, 48)
    assert native.delta_rule(q, k, v[..., :48], decay, beta, untouched) is None and bool((untouched == 1).all())


@pytest.mark.parametrize("channels", [48, 37, 300])  # a multiple of the vector width, and not; blocks of 128 and a part
def test_the_native_causal_conv_follows_the_torch_conv_over_spans_shorter_and_longer_than_its_window(channels):
    """... on rows that lie apart too (the qkv columns of the DeltaNet's wider in-projection output, read in place)."""
    need("ds_causal_conv")
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(channels, 4, generator=g)
    state_ours, state_torch = torch.randn(3, channels, generator=g), None
    state_torch = state_ours.clone()
    for t, wide in ((1, 0), (2, 0), (5, 0), (64, 0), (3, 11), (64, 9)):
        x = (torch.randn(t, channels + wide, generator=g) * 8)[:, wide // 2:wide // 2 + channels]  # SiLU's tails
        x[0, :3] = torch.tensor([-200.0, 200.0, 0.0])[:min(3, channels)]
        assert x.is_contiguous() == (wide == 0)
        ours = layers.causal_conv(x, state_ours, weight, native=True)
        want = layers.causal_conv(x, state_torch, weight, native=False)
        assert torch.allclose(ours, want, atol=1e-5, rtol=1e-5), (t, (ours - want).abs().max().item())
        assert torch.equal(state_ours, state_torch), t


@pytest.mark.parametrize("order", ["grouped", "tiled"])
def test_the_native_deltanet_step_follows_the_torch_step_on_either_head_order(order):
    need("ds_deltanet_step")
    g = torch.Generator().manual_seed(6)
    nk, dk, nv, dv, kc = 2, 32, 4, 48, 4
    cfg = SimpleNamespace(linear_num_key_heads=nk, linear_key_head_dim=dk, linear_num_value_heads=nv,
                          linear_value_head_dim=dv, value_head_order=order, rms_norm_eps=1e-6)
    c = 2 * nk * dk + nv * dv
    w = SimpleNamespace(conv=torch.randn(c, kc, generator=g) * 0.5, a_neg=-torch.rand(nv, generator=g) * 4,
                        dt_bias=torch.randn(nv, generator=g), norm=torch.rand(dv, generator=g) + 0.5)
    conv_ours, ssm_ours = torch.randn(kc - 1, c, generator=g), torch.randn(nv, dk, dv, generator=g) * 0.3
    conv_torch, ssm_torch = conv_ours.clone(), ssm_ours.clone()
    for step in range(6):
        qkv, z = torch.randn(c, generator=g) * 3, torch.randn(nv * dv, generator=g) * 3
        b, a = torch.randn(nv, generator=g) * 3, torch.randn(nv, generator=g) * 3
        if step == 1:
            a[0] = 30.0  # softplus past its linear threshold
        ours = native.deltanet_step(qkv, z, b, a, w, cfg, conv_ours, ssm_ours)
        mixed = layers.causal_conv(qkv[None], conv_torch, w.conv)
        q, k, v = layers._deltanet_heads(mixed, cfg)
        beta, decay = torch.sigmoid(b), w.a_neg * F.softplus(a + w.dt_bias)
        o = layers.delta_rule_step(q[0], k[0], v[0], decay, beta, ssm_torch)
        want = layers.gated_rms_norm(o, z.reshape(nv, dv), w.norm, cfg.rms_norm_eps).reshape(-1)
        assert torch.allclose(ours, want, atol=1e-5, rtol=1e-4), (step, (ours - want).abs().max().item())
        assert torch.allclose(conv_ours, conv_torch) and torch.allclose(ssm_ours, ssm_torch, atol=1e-5, rtol=1e-4)


# ---- the one-call decode on the file's own blocks (products.c's; int8 tables: test_fast_weights) ------------------

def blocks_everywhere(m, mixed: bool):
    """A loaded float model's weights with every projection and the head as the file's own blocks would be: Q8_0
    (gguf's own quantizer), or, `mixed`, stacks of several types as a quantized file has them: the MLP's up part
    and the attention output Q4_0, the DeltaNet z part F16 (where products.c multiplies F16), its beta part F32."""
    import dataclasses

    import gguf
    import numpy as np

    from deltaserve.engine.weights import AttentionWeights, Embedding, LayerWeights, Weights
    from deltaserve.kernels.linear import BlockLinear, DenseLinear, StackedLinear

    def one(w: torch.Tensor, kind: str):
        w = w.float().contiguous()
        if kind == "F32":
            return DenseLinear(w)
        data = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType[kind])
        return BlockLinear([(kind, torch.from_numpy(np.ascontiguousarray(data).view(np.uint8)))], w.shape[1])

    f16 = "F16" if native.library().blk_kind(1) else "Q8_0"

    def q(lin, kinds=()):
        if isinstance(lin, StackedLinear):
            parts = torch.split(lin.dense(), list(lin.sizes))
            kinds = kinds if mixed and kinds else ("Q8_0",) * len(parts)
            return StackedLinear([one(p, k) for p, k in zip(parts, kinds)])
        return one(lin.dense(), kinds[0] if mixed and kinds else "Q8_0")

    w = m.host.weights
    layers = []
    for lw in w.layers:
        mx = lw.mixer
        if isinstance(mx, AttentionWeights):
            mixer = dataclasses.replace(mx, qkv=q(mx.qkv), o=q(mx.o, ("Q4_0",)))
        else:
            mixer = dataclasses.replace(mx, in_proj=q(mx.in_proj, ("Q8_0", f16, "F32", "Q8_0")), out=q(mx.out))
        layers.append(LayerWeights(lw.attn_norm, lw.post_norm, mixer, q(lw.gate_up, ("Q8_0", "Q4_0")), q(lw.down)))
    head = q(w.lm_head)
    return Weights(Embedding(head), layers, w.final_norm, head)


def block_products(monkeypatch):
    """test_fast_weights' TorchProducts on BlockLinear's products: the activations of a block of 32 rounded one
    int8 step the other way move the output by d * W[:, k], d the f16-rounded step Q8_0/Q4_0 products use."""
    from deltaserve.kernels.linear import BlockLinear
    from tests.test_fast_weights import TorchProducts

    products = TorchProducts.__new__(TorchProducts)
    products.calls, products.inject = None, {}
    original = BlockLinear.__call__

    def call(lin, x):
        y = original(lin, x)
        if products.calls is None or not any(kind in ("Q8_0", "Q4_0") for kind, _ in lin.segments):
            return y  # (an F16 product quantizes nothing)
        x2 = x.reshape(-1, lin.in_features).float()
        moves = products.inject.get(len(products.calls), ())
        products.calls.append(x2.clone())
        if moves:
            y = y.clone()
            for row, k, dq in moves:
                amax = x2[row, k // 32 * 32:k // 32 * 32 + 32].abs().amax()
                d = (amax / 127).half().float()  # the block's int8 step, as activations.c keeps it
                y.view(-1, lin.out_features)[row] += dq * d * lin.dense()[:, k]
        return y

    monkeypatch.setattr(BlockLinear, "__call__", call)
    return products


@pytest.mark.parametrize("source,mixed", [("hf", False), ("gguf", False), ("gguf", True)])
def test_the_one_call_decode_on_the_files_blocks_follows_the_torch_decode_on_either_head_order_and_mixed_stacks(
        source, mixed, monkeypatch):
    """The envelope of test_fast_weights' int8-table version: both routes run products.c's products on the same
    blocks, so they differ only where an activation sits within float noise of a rounding tie."""
    need("ds_decode_tokens")
    import deltaserve
    from deltaserve.engine.forward import Forward
    from tests.fixtures import models as fx
    from tests.test_fast_weights import assert_within_the_envelope, ids_for, step_on_both_routes

    m = deltaserve.load(fx.hf_dir("hybrid") if source == "hf" else fx.gguf_path("hybrid", "f32"), cache=False)
    f = Forward(m.config, blocks_everywhere(m, mixed))
    program, route = f.token_program()
    assert program is not None and route.startswith("one native call per decoded token"), route
    ids = ids_for(m, n=24)
    products = block_products(monkeypatch)
    st = f.new_state(40)
    steps = [step_on_both_routes(f, products, [st], [t], monkeypatch) for t in ids]
    trio = [f.new_state(40) for _ in range(3)]  # batches of 1, 2 and 3 sequences at different positions
    steps.append(step_on_both_routes(f, products, trio[:1], ids[:1], monkeypatch))
    steps += [step_on_both_routes(f, products, trio[:2], [t, ids[-1 - i]], monkeypatch) for i, t in enumerate(ids[:6])]
    steps += [step_on_both_routes(f, products, trio, [t, t, ids[i]], monkeypatch) for i, t in enumerate(ids[6:12])]
    assert st.length == len(ids) and [s.length for s in trio] == [13, 12, 6]
    assert_within_the_envelope(steps)


def test_the_one_call_decode_on_blocks_says_why_it_does_not_take_a_projection():
    need("ds_decode_tokens")
    import deltaserve
    from deltaserve.engine.forward import Forward
    from deltaserve.kernels.linear import DenseLinear, Int8Linear
    from tests.fixtures import models as fx

    m = deltaserve.load(fx.gguf_path("hybrid", "f32"), cache=False)
    w = blocks_everywhere(m, mixed=False)
    assert Forward(m.config, w).token_program()[0] is not None
    down = w.layers[1].down
    w.layers[1].down = DenseLinear(down.dense().bfloat16())  # no product of the one call reads bf16 rows
    program, why = Forward(m.config, w).token_program()
    assert program is None and why == ("decode through torch ops (native token decode not used: "
                                       "a bfloat16 projection is not the file's own blocks)"), why
    w.layers[1].down = Int8Linear.from_float(down.dense())  # an int8 table: tables_avx512.c's products, where they run
    program, why = Forward(m.config, w).token_program()
    if native.status()[0]:
        assert program is not None, why
    else:
        assert program is None and why.startswith("decode through torch ops (native token decode not used: an int8 "
                                                   "table (the int8 tables' kernels do not run here: "), why


def test_on_a_trained_q4_k_m_file_the_one_call_decode_on_its_blocks_is_the_torch_decode_to_float_noise():
    """K-quant stacks (Q4_K with Q6_K parts, a Q6_K head) as llama.cpp's quantizer mixes them. Their activation
    scales are f32 (amax / 127: no f16 rounding to absorb float noise, as Q8_0's has), so the two routes differ by
    more than ties alone; measured: mean |one call - torch| 4.3e-3 where the file's own error (torch decode against
    the f32 model) is 0.099, and the same argmax at every position."""
    need("ds_decode_tokens")
    import deltaserve
    from deltaserve.demo import DEMO_FILE
    from deltaserve.engine.forward import Forward
    from deltaserve.kernels.linear import BlockLinear
    from tests.test_fast_weights import demo_by_llama_cpp

    m = deltaserve.load(demo_by_llama_cpp("Q4_K_M", "q4_k_m"), weights="blocks", cache=False)
    assert {getattr(lw.gate_up.fused, "block_kind", None) for lw in m.host.weights.layers} >= {"Q4_K"}
    assert isinstance(m.host.weights.lm_head, BlockLinear)
    ref = deltaserve.load(DEMO_FILE, weights="exact", cache=False)
    ids = ref.tokenizer.encode("<|im_start|>user\nMy locker code is 4821. What is 12 + 9?<|im_end|>\n"
                               "<|im_start|>assistant\n21.<|im_end|>\n")
    want = ref.logits(ids)
    runs = []
    for one_call in (True, False):
        f = Forward(m.config, m.host.weights, one_call=one_call)
        if one_call:
            assert f.token_program()[0] is not None, f.token_program()[1]
        st = f.new_state(len(ids))
        runs.append(torch.stack([f.decode(st, t) for t in ids]))
    ours, theirs = runs
    own = (theirs - want).abs().mean().item()
    assert (ours - theirs).abs().mean().item() <= 0.1 * own, ((ours - theirs).abs().mean().item(), own)
    assert ((ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()) >= 0.97


# the tests a Zen 3 (AVX2, FMA, F16C; no AVX512) runs its kernels by: this file's, and the MoE decode's against
# transformers and torch on the file's blocks
AVX2_ROUTE_TESTS = ["tests/test_native_avx2.py",
                    "tests/test_file_blocks.py::test_the_block_gemm_takes_the_types_with_a_scale_every_16_from_their_expanded_rows",
                    "tests/test_file_blocks.py::test_a_long_prefills_tokens_pass_the_panels_in_blocks_and_each_row_comes_out_as_if_alone",
                    "tests/test_file_blocks.py::test_the_default_weights_are_the_files_own_blocks_with_or_without_amx",
                    "tests/test_file_blocks.py::test_each_of_1_to_16_rows_on_the_decode_products_gets_its_one_row_bits_"
                    "and_gguf_values_times_its_rounded_row",
                    "tests/test_file_blocks.py::test_a_prefill_takes_the_block_gemm_where_it_beats_torchs_f32_gemm_on_exact_chunks"] + [
    "tests/test_file_blocks.py::test_the_block_gemm_is_the_files_values_times_activations_rounded_as_llama_cpp_rounds_them_"
    f"whatever_the_shape[{out}-{rows}-{kind}]" for kind in ("Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q4_1", "IQ4_NL")
    for rows, out in ((7, 33), (40, 100))] + [
    f"tests/test_moe.py::test_{name}" for name in (
        "token_by_token_decode_matches_transformers", "one_prefill_matches_transformers",
        "the_one_call_decode_is_the_torch_decode_to_rounding_ties_and_a_batch_is_each_sequence_alone",
        "llama_quantizes_files_are_no_farther_from_f32_than_llama_cpp_on_the_same_files")]
AVX2_ENV = {"DELTASERVE_ISA": "avx2", "DELTASERVE_AMX": "off", "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2",
            "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def test_an_avx512_machine_builds_the_avx2_route_a_zen_3_takes_and_its_kernels_pass_their_tests():
    """DELTASERVE_ISA=avx2 builds the library for AVX2 alone and hides AVX512 and AMX from the route decisions; on an
    AVX512 machine (where the suite would not touch those kernels otherwise) the AVX2 build's kernels pass this
    file's tests and the MoE decode's, in a pytest of its own (the settings are read once a process)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    if not native.status()[0]:
        pytest.skip("this machine's library is the AVX2 route already: the suite runs its kernels")
    if os.environ.get("DELTASERVE_ISA"):
        pytest.skip("the suite runs on a chosen route already")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, **AVX2_ENV}
    probe = ("from deltaserve.kernels import native; print(native.portable()[1], native.has('ds_gemm_blocks'), "
             "sorted(f for f in native.cpu_flags() if f.startswith(('avx512', 'amx'))))")
    out = subprocess.run([sys.executable, "-c", probe], env=env, cwd=root, capture_output=True, text=True, timeout=600)
    assert out.stdout.split("\n")[0] == "AVX2 True []", out.stderr[-800:]  # its GEMM too (the K-quants)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "not avx2_route",
                          *AVX2_ROUTE_TESTS], env=env, cwd=root, capture_output=True, text=True, timeout=1200)
    tail = run.stdout[-3000:]
    assert run.returncode == 0, tail
    passed = int(tail.rsplit(" passed", 1)[0].split()[-1])
    assert passed >= 20 and " failed" not in tail, tail
