"""The CUDA route (skipped without a CUDA device): the same forward on the GPU, guarded, matching the CPU."""

from __future__ import annotations


import pytest
import torch

from deltaserve.runtime.backend import CUDABackend
from deltaserve.runtime.guard import ParityGuard
from deltaserve.session import FALLBACK_PREFIX

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_cuda_logits_match_the_cpu_reference(hybrid_model):
    from deltaserve.engine.forward import Forward

    ids = list(range(3, 200))
    cpu = hybrid_model.logits(ids)
    gpu_weights = hybrid_model.host.weights.to("cuda")
    f = Forward(hybrid_model.config, gpu_weights, "cuda")
    got = f.prefill(f.new_state(len(ids)), ids, all_logits=True).cpu()
    assert (got - cpu).abs().max().item() < 2e-3
    assert torch.equal(got.argmax(-1), cpu.argmax(-1))


def test_a_cuda_session_is_guarded_and_answers_like_the_cpu(hybrid_model):
    tok = hybrid_model.tokenizer
    msgs = [{"role": "user", "content": "Tell me about the sea."}]
    prompt = tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True, enable_thinking=False))
    cpu = hybrid_model.session(device="cpu", quiet=True)
    gpu = hybrid_model.session(backend=CUDABackend(hybrid_model.host), guard=ParityGuard(revalidate=True), quiet=True)
    for _ in range(2):
        a, b = cpu.generate(prompt, max_tokens=16), gpu.generate(prompt, max_tokens=16)
        assert a.tokens == b.tokens
    assert gpu.on_accelerator and not any(n.startswith(FALLBACK_PREFIX) for n in gpu.notices)
    assert any("parity guard on" in n and "accepted" in n for n in gpu.notices)
    assert b.start == "checkpoint" and b.backend.startswith("cuda")


def test_a_cuda_session_bound_in_another_thread_still_serves(hybrid_model):
    import threading

    s = hybrid_model.session(backend=CUDABackend(hybrid_model.host), guard=ParityGuard(revalidate=True), quiet=True)
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("turn", s.generate([5, 6, 7, 8], max_tokens=4)))
    t.start()
    t.join()
    assert out["turn"].backend.startswith("cuda")
