"""The CUDA route (skipped without a CUDA device): the same forward on the GPU, guarded, matching the CPU."""

from __future__ import annotations


import pytest
import torch

from deltaserve.runtime.backend import CUDABackend
from deltaserve.runtime.guard import ParityGuard
from deltaserve.session.resident import FALLBACK_PREFIX

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


def _demo_file(name: str):
    """The trained demo model quantized by llama.cpp (built on a CPU machine by the tests that need llama.cpp; a
    GPU run carries it in .fixtures/), or None."""
    from tests.fixtures import models as fx

    path = fx.demo_quantized_path(name)
    return path if path.exists() else None


@pytest.mark.parametrize("name", ["q8_0", "q4_k_m"])
def test_a_quantized_file_serves_on_cuda_and_recalls_like_the_cpu(name):
    """A GGUF of quantized blocks goes to the device (what its products take there), passes the parity guard, and
    the demo conversation's answers are the CPU's, on a resident CUDA session that reuses what it holds."""
    import deltaserve

    path = _demo_file(name)
    if path is None:
        pytest.skip(f"the demo model quantized to {name} by llama.cpp is not built here (needs llama.cpp)")
    model = deltaserve.load(path, cache=False)
    cpu = model.session(device="cpu", quiet=True)
    gpu = model.session(backend=CUDABackend(model.host), guard=ParityGuard(revalidate=True), quiet=True)
    history_cpu, history_gpu = [], []
    for text in ["My locker code is 4821.", "What is 12 + 9?", "What is my locker code?"]:
        answers = []
        for s, h in ((cpu, history_cpu), (gpu, history_gpu)):
            h.append({"role": "user", "content": text})
            turn = s.chat(h, max_tokens=16, temperature=0, enable_thinking=False)
            h.append({"role": "assistant", "content": turn.text})
            answers.append(turn)
        assert answers[1].text == answers[0].text
        assert answers[1].backend.startswith("cuda")
    assert answers[1].reused > 0 and "4821" in answers[1].text
    assert gpu.on_accelerator and not any(n.startswith(FALLBACK_PREFIX) for n in gpu.notices)


def test_a_cuda_state_saved_in_the_store_resumes_a_conversation_in_another_cuda_session(hybrid_model, tmp_path):
    """The store takes a device checkpoint (copied to the host, written to disk); another session restores it onto
    the device and prefills only the new turn, answering as a session that prefilled everything."""
    from deltaserve.session.store import StateStore

    store = StateStore(hybrid_model.config, ram_bytes=64 << 20, directory=tmp_path, disk_bytes=64 << 20,
                       model_sha256=hybrid_model.host.sha256())
    first = hybrid_model.session(backend=CUDABackend(hybrid_model.host), guard=ParityGuard(), quiet=True, store=store)
    history = [{"role": "user", "content": "The sea is wide."}]
    t1 = first.chat(history, max_tokens=8, temperature=0, enable_thinking=False)
    history += [{"role": "assistant", "content": t1.text}, {"role": "user", "content": "And the sky?"}]
    assert store.flush()
    other = hybrid_model.session(backend=CUDABackend(hybrid_model.host), guard=ParityGuard(), quiet=True, store=store)
    t2 = other.chat(history, max_tokens=8, temperature=0, enable_thinking=False)
    alone = hybrid_model.session(backend=CUDABackend(hybrid_model.host), guard=ParityGuard(), quiet=True)
    alone.chat(history[:1], max_tokens=8, temperature=0, enable_thinking=False)  # the same turns, no store
    t3 = alone.chat(history, max_tokens=8, temperature=0, enable_thinking=False)
    assert t2.start == "store" and t2.reused > 0 and t2.backend.startswith("cuda")
    assert t2.tokens == t3.tokens


def test_a_cuda_graph_replays_the_eager_decode_step_for_each_state_and_after_a_restore(hybrid_model):
    from deltaserve.engine.forward import Forward
    from deltaserve.engine.graph import GraphDecoder

    w = hybrid_model.host.weights.to("cuda")
    graphed, eager = Forward(hybrid_model.config, w, "cuda"), Forward(hybrid_model.config, w, "cuda")
    graphed.graphs, eager.graphs = GraphDecoder(graphed), None
    prompt = list(range(3, 40))
    a, b, other = graphed.new_state(96), eager.new_state(96), graphed.new_state(96)
    for f, st in ((graphed, a), (eager, b), (graphed, other)):
        f.prefill(st, prompt)
    ck_a, ck_b = a.checkpoint(), b.checkpoint()
    for rounds in range(2):  # the second round from the restored checkpoint: the same graph, earlier positions
        tok = 7
        for i in range(24):
            x, y = graphed.decode(a, tok), eager.decode(b, tok)
            assert (x - y).abs().max().item() < 1e-3 and int(x.argmax()) == int(y.argmax())
            assert a.length == b.length
            tok = int(y.argmax())
            if i % 6 == 0:
                graphed.decode(other, 11)  # another state's graph in between
        a.restore(ck_a)
        b.restore(ck_b)
    assert graphed.graphs.recorded == 2 and len(graphed.graphs.graphs) == 2
    del other
    import gc

    gc.collect()
    assert len(graphed.graphs.graphs) == 1  # a state's graph goes with it


def test_an_moe_model_on_cuda_matches_the_cpu_and_its_graph_decode_its_eager_one(monkeypatch):
    """qwen35moe on the device: the prefill's experts grouped (layers.moe's loop), a decode step's gathered by index
    (layers.moe_gathered, what a CUDA graph records), both against the CPU's logits of the same f32 file."""
    import deltaserve
    from deltaserve.engine.forward import Forward
    from tests.fixtures import models as fx

    m = deltaserve.load(fx.gguf_path("moe", "f32"), cache=False)
    ids = list(range(3, 120))
    cpu = m.logits(ids)
    weights = m.host.weights.to("cuda")
    f = Forward(m.config, weights, "cuda")
    got = f.prefill(f.new_state(len(ids) + 8), ids, all_logits=True).cpu()
    assert (got - cpu).abs().max().item() < 2e-3 and torch.equal(got.argmax(-1), cpu.argmax(-1))
    monkeypatch.setenv("DELTASERVE_CUDA_GRAPH", "on")
    for graphs in (False, True):
        g = Forward(m.config, weights, "cuda")
        if not graphs:
            g.graphs = None
        st = g.new_state(len(ids) + 8)
        steps = torch.stack([g.decode(st, t) for t in ids[:24]]).cpu()
        assert (steps - cpu[:24]).abs().max().item() < 2e-3, graphs
        assert (g.graphs is not None and g.graphs.recorded == 1) == graphs
