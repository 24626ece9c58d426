"""The native DeltaNet kernels and the one-call decode follow the torch versions (engine/layers.py, the torch decode).

They run wherever the library holds the kernel (`native.has`): native.c's on an AVX512-VNNI CPU, native_avx2.c's on
an AVX2 one (an AMD EPYC Zen 3), so the same tests cover both.
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


@pytest.mark.parametrize("channels", [48, 37])  # a multiple of the vector width, and not
def test_the_native_causal_conv_follows_the_torch_conv_over_spans_shorter_and_longer_than_its_window(channels):
    need("ds_causal_conv")
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(channels, 4, generator=g)
    state_ours, state_torch = torch.randn(3, channels, generator=g), None
    state_torch = state_ours.clone()
    for t in (1, 2, 5, 64):
        x = torch.randn(t, channels, generator=g) * 8  # SiLU well into both tails
        x[0, :3] = torch.tensor([-200.0, 200.0, 0.0])[:min(3, channels)]
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
