"""The KV cache's types (--kv-type): f32 (the default), f16 and bf16 stored in their dtype, q8_0 planned and refused.

The plan's bytes per position per type, the logits of a 16-bit cache against the f32 cache's (the bounds are what was
measured on the fixtures over 2048 positions, teacher-forced: f16 at most 1.0e-3, bf16 at most 6.3e-3), the route line
of a 16-bit cache, and saved states in each type: a round trip, and a restore into another type converted and said.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import deltaserve
from deltaserve.engine.state import KV_TYPES, kv_position_bytes, kv_torch_dtype
from deltaserve.errors import DeltaserveError
from deltaserve.formats.config import HybridConfig
from deltaserve.frontends.cli import main
from deltaserve.runtime import capacity as cap
from deltaserve.session.store import StateStore, read_header, read_state
from tests.fixtures import models as fx

MAX = 6


def chat_turn(session, history: list[dict], text: str):
    history.append({"role": "user", "content": text})
    turn = session.chat(history, max_tokens=MAX, temperature=0, enable_thinking=False)
    history.append({"role": "assistant", "content": turn.text})
    return turn


def test_the_plan_counts_each_kv_types_bytes_a_position_and_the_27b_shape_gives_the_issues_numbers(hybrid_model):
    c = hybrid_model.config
    values = 2 * c.num_kv_heads * c.head_dim * len(c.attention_layers)
    per = {t: kv_position_bytes(c, t) for t in KV_TYPES}
    assert per == {"f32": 4 * values, "f16": 2 * values, "bf16": 2 * values, "q8_0": values // 32 * 34}
    assert per["f32"] == c.kv_bytes_per_position(4)  # the f32 plan is today's, byte for byte
    free = 1 << 30
    for t in KV_TYPES:
        p = cap.plan(c, 2048, cap.Memory(free, free, "test"), kv_type=t)
        assert p.kv == 2048 * per[t] and p.kv_dtype == t and f"KiB {t})" in p.arithmetic()
    # a memory where the f16 cache fits and the f32 one does not (one prefill plan): the type decides
    one = (cap.PREFILL_PLANS[0],)
    f16 = cap.plan(c, 4096, cap.Memory(1 << 40, 1 << 40, "test"), kv_type="f16", plans=one)
    edge = cap.Memory(f16.total, f16.total, "test")
    assert cap.plan(c, 4096, edge, kv_type="f16", plans=one).fits
    with pytest.raises(DeltaserveError, match=f"KV {4096 * per['f32'] >> 20} MiB .* KiB f32"):
        cap.plan(c, 4096, edge, kv_type="f32", plans=one)
    # the 27B shape (16 attention layers of 4 KV heads of 256): 128 KiB a position in f32, 64 in f16, 34 in q8_0
    big = dataclasses.replace(c, num_layers=64, num_kv_heads=4, head_dim=256,
                              layer_types=HybridConfig.layer_types_for(64, 4))
    assert [kv_position_bytes(big, t) >> 10 for t in ("f32", "f16", "q8_0")] == [128, 64, 34]


@pytest.mark.parametrize("name", ["hybrid", "deep"])
def test_a_16_bit_cache_keeps_the_logits_within_the_measured_bound_of_the_f32_caches_and_f16_is_closer(name):
    model = deltaserve.load(fx.gguf_path(name, "f32"))
    f = model._reference_forward()
    n = 512
    ids = torch.randint(0, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(0)).tolist()
    out, states = {}, {}
    for t in ("f32", "f16", "bf16"):
        states[t] = f.new_state(n, kv_dtype=kv_torch_dtype(t))
        out[t] = f.prefill(states[t], ids, all_logits=True)
        assert all(k.dtype == v.dtype == kv_torch_dtype(t) for k, v in states[t].kv.values())
    f16 = (out["f16"] - out["f32"]).abs().max().item()
    bf16 = (out["bf16"] - out["f32"]).abs().max().item()
    assert 0 < f16 < 2e-3 and 0 < bf16 < 1e-2 and f16 < bf16, (f16, bf16)
    # the first attention layer's cache holds the f32 cache's values rounded to its type, nothing else (the later
    # layers' inputs already differ by the earlier ones' rounding)
    first = model.config.attention_layers[0]
    for t in ("f16", "bf16"):
        for j in (0, 1):
            assert torch.equal(states[t].kv[first][j], states["f32"].kv[first][j].to(kv_torch_dtype(t)))


def test_a_16_bit_cache_decodes_through_torch_ops_and_the_route_line_says_so():
    model = deltaserve.load()  # the demo model: its file's blocks take the one-call native decode with an f32 cache
    f32 = next(n for n in model.session(quiet=True).notices if n.startswith("Backend:"))
    assert "one native call per decoded token" in f32 and "KV cache" not in f32
    s = model.session(quiet=True, kv_type="f16")
    line = next(n for n in s.notices if n.startswith("Backend:"))
    assert "decode through torch ops (the f16 KV cache: the one-call native decode reads f32 caches only)" in line
    assert "one native call per decoded token" not in line
    turn = s.generate(model.tokenizer.encode("hello"), max_tokens=4)
    assert turn.generated == 4 and all(k.dtype == torch.float16 for k, _ in s.state.kv.values())


def test_q8_0_and_an_unknown_kv_type_are_refused_in_one_line_naming_the_types(capsys):
    with pytest.raises(DeltaserveError, match="q8_0 KV cache is not built yet: use one of f32, f16, bf16"):
        deltaserve.load(kv_type="q8_0")
    with pytest.raises(DeltaserveError, match="unknown KV cache type 'f8': one of f32, f16, bf16, q8_0"):
        deltaserve.load().session(kv_type="f8")
    assert main(["run", "--kv-type", "q8_0", "-p", "hi", "-n", "1"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "deltaserve: error: the q8_0 KV cache is not built yet: use one of f32, f16, bf16"
    assert main(["inspect", "--kv-type", "q8_0", "--ctx", "1024"]) == 0  # planning it is allowed
    out = capsys.readouterr().out
    assert "--kv-type q8_0: planned only" in out and "x 0.5 KiB q8_0)" in out


@pytest.mark.parametrize("kv_type", ["f32", "f16", "bf16"])
def test_a_saved_state_round_trips_in_its_own_kv_type(hybrid_model, tmp_path, kv_type):
    s = hybrid_model.session(quiet=True, kv_type=kv_type)
    history = []
    chat_turn(s, history, "save me to a file")
    n = s.save(tmp_path / "conv.state")
    meta = read_header(tmp_path / "conv.state")
    assert meta["format"] == "deltaserve-state/4" and meta["kv_type"] == kv_type
    tokens, ck = read_state(tmp_path / "conv.state", hybrid_model.config, hybrid_model.host.sha256())
    for i, (k, v) in s._checkpoint.kv.items():  # the bits saved are the cache's own, in its type
        assert ck.kv[i][0].dtype == kv_torch_dtype(kv_type) and torch.equal(ck.kv[i][0], k[:, :n])
        assert torch.equal(ck.kv[i][1], v[:, :n])
    other = hybrid_model.session(quiet=True, kv_type=kv_type)
    assert other.restore(tmp_path / "conv.state") == n
    turn = chat_turn(other, history, "and go on elsewhere")
    assert turn.start == "checkpoint" and turn.reused == n
    assert not any("converted" in line for line in other.notices)


def test_a_state_saved_in_one_kv_type_is_restored_in_another_only_by_converting_and_it_is_said(hybrid_model, tmp_path):
    s = hybrid_model.session(quiet=True)  # f32
    history = []
    chat_turn(s, history, "save me in f32")
    n = s.save(tmp_path / "conv.state")
    other = hybrid_model.session(quiet=True, kv_type="bf16")
    assert other.restore(tmp_path / "conv.state") == n
    said = [line for line in other.notices if "converted" in line]
    assert said == [f"[deltaserve] the saved state of {n} tokens in conv.state holds its KV cache in f32: converted "
                    "to this session's bf16 on restore"]
    turn = chat_turn(other, history, "go on in bf16")
    assert turn.start == "checkpoint" and turn.reused == n
    assert all(k.dtype == torch.bfloat16 for k, _ in other.state.kv.values())
    # a header that says another type than its tensors are is refused (the type is under the HMAC)
    path = tmp_path / "conv.state"
    data = path.read_bytes()
    head = int.from_bytes(data[:8], "little")
    text = data[8:8 + head].decode().replace('"kv_type":"f32"', '"kv_type":"f16"')
    assert '"kv_type":"f16"' in text
    path.write_bytes(data[:8] + text.encode() + data[8 + head:])
    with pytest.raises(DeltaserveError, match="is not the f16"):
        read_state(path, hybrid_model.config, hybrid_model.host.sha256())


def test_a_stored_state_of_another_kv_type_in_a_shared_store_is_converted_and_said(hybrid_model):
    store = StateStore(hybrid_model.config, ram_bytes=64 << 20, model_sha256=hybrid_model.host.sha256())
    a = hybrid_model.session(quiet=True, store=store)  # f32
    history = []
    chat_turn(a, history, "one")
    a._store_checkpoint()
    b = hybrid_model.session(quiet=True, store=store, kv_type="f16")
    turn = chat_turn(b, history, "two")
    assert turn.reused > 0
    assert any("holds its KV cache in f32: converted to this session's f16 on restore" in line for line in b.notices)
    assert all(k.dtype == torch.float16 for k, _ in b.state.kv.values())
