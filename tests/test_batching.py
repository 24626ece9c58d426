"""Sessions sharing a backend batch their decode steps: the same tokens as alone, weights read once per step."""

from __future__ import annotations

import threading

from deltaserve.engine.backend import CPUBackend


def test_concurrent_sessions_batch_their_decode_steps_and_answer_as_if_alone(hybrid_model):
    tok = hybrid_model.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": f"story number {i}"}],
                                                  add_generation_prompt=True, enable_thinking=False))
               for i in range(4)]
    want = [hybrid_model.generate(p, max_tokens=20).tokens for p in prompts]
    backend = CPUBackend(hybrid_model.host)
    backend.enable_batching()
    sessions = [hybrid_model.session(backend=backend, quiet=True) for _ in prompts]
    got = [None] * len(prompts)
    barrier = threading.Barrier(len(prompts))

    def run(i):
        barrier.wait()
        got[i] = sessions[i].generate(prompts[i], max_tokens=20).tokens

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert got == want
    b = backend.batcher
    assert b.batched_rows > b.batches, (b.batched_rows, b.batches)  # steps really shared forwards


def test_a_lone_session_on_a_batching_backend_does_not_wait_for_company(hybrid_model):
    backend = CPUBackend(hybrid_model.host)
    backend.enable_batching()
    s = hybrid_model.session(backend=backend, quiet=True)
    t = s.generate([5, 6, 7, 8, 9], max_tokens=30)
    assert t.tokens == hybrid_model.generate([5, 6, 7, 8, 9], max_tokens=30).tokens
    assert backend.batcher.batches == backend.batcher.batched_rows  # batches of one
