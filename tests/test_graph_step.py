"""The decode step a CUDA graph records (engine/graph.py): the eager step's math with the token and its position in
device tensors and attention over the whole cache, masked. On the CPU it runs eagerly against the eager decode;
tests/test_cuda.py records and replays it on a GPU."""

from __future__ import annotations

import torch

import deltaserve
from deltaserve.engine.forward import Forward
from deltaserve.engine.graph import StaticStep, graphs_enabled


def replay_as_eager(f: Forward, eager, static) -> None:
    """The recorded step (StaticStep on `static`) and the eager decode (on `eager`) fed the same greedy tokens to
    the last position of the cache: each step's logits within 1e-4 and the same argmax."""
    step = StaticStep(f, static)
    tok = 5
    with torch.inference_mode():
        for _ in range(static.capacity - static.length):  # to the last position: no position after it to mask
            want = f.decode(eager, tok)
            step.set(tok, static.length)
            got = step.run()
            static.length += 1
            assert (got - want).abs().max().item() < 1e-4 and int(got.argmax()) == int(want.argmax())
            tok = int(want.argmax())


def test_the_recorded_step_is_the_eager_decode_step_at_every_position(hybrid_gguf):
    m = deltaserve.load(hybrid_gguf, device="cpu")
    f = Forward(m.config, m.host.weights, native=False, one_call=False)  # the torch path the graph records
    prompt = list(range(40, 71))
    eager, static = f.new_state(48), f.new_state(48)
    f.prefill(eager, prompt)
    f.prefill(static, prompt)
    replay_as_eager(f, eager, static)
    for i, (k, v) in eager.kv.items():
        assert torch.allclose(static.kv[i][0], k, atol=1e-5) and torch.allclose(static.kv[i][1], v, atol=1e-5)
    for i in eager.ssm:
        assert torch.allclose(static.ssm[i], eager.ssm[i], atol=1e-5)
        assert torch.allclose(static.conv[i], eager.conv[i], atol=1e-6)


def test_graphs_are_for_cuda_devices_and_only_when_the_environment_asks_for_them(monkeypatch):
    monkeypatch.delenv("DELTASERVE_CUDA_GRAPH", raising=False)
    assert not graphs_enabled(torch.device("cuda"))  # not yet recorded on a GPU: off unless asked for
    monkeypatch.setenv("DELTASERVE_CUDA_GRAPH", "on")
    assert graphs_enabled(torch.device("cuda")) and not graphs_enabled(torch.device("cpu"))
