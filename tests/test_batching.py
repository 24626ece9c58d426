"""Sessions sharing a backend batch their decode steps: the same tokens as alone, weights read once per step."""

from __future__ import annotations

import threading

from deltaserve.runtime.backend import CPUBackend


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


def test_with_a_compute_thread_every_forward_of_every_session_runs_on_it_and_answers_stay_the_same(hybrid_model):
    import torch

    from deltaserve.kernels.cpu import serial_here
    from deltaserve.runtime.compute import ComputeThread

    prompts = [[5, 6, 7, 8, 9 + i] for i in range(3)]
    want = [hybrid_model.generate(p, max_tokens=12).tokens for p in prompts]
    compute = ComputeThread(name="test-compute")
    backend = CPUBackend(hybrid_model.host)
    backend.use_compute_thread(compute)
    backend.enable_batching()
    forward = backend.forward
    seen: set[str] = set()
    for name in ("prefill", "decode", "decode_batch", "new_state"):
        original = getattr(forward, name)

        def spy(*args, _original=original, **kwargs):
            seen.add(threading.current_thread().name)
            return _original(*args, **kwargs)
        setattr(forward, name, spy)
    sessions = [hybrid_model.session(backend=backend, quiet=True) for _ in prompts]
    got, threads_in_slot = [None] * len(prompts), []
    barrier = threading.Barrier(len(prompts))

    def run(i):
        serial_here()
        threads_in_slot.append(torch.get_num_threads())
        barrier.wait()
        got[i] = sessions[i].generate(prompts[i], max_tokens=12).tokens

    threads = [threading.Thread(target=run, args=(i,), name=f"slot-{i}") for i in range(len(prompts))]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert got == want
    assert seen == {"test-compute"}
    assert threads_in_slot == [1] * len(prompts)  # the slots' own torch ops run without a team
    assert compute.run(torch.get_num_threads) == torch.get_num_threads()  # the compute thread keeps its threads
    compute.close()


def test_an_error_inside_the_compute_thread_reaches_the_caller_and_the_thread_goes_on():
    from deltaserve.runtime.compute import ComputeThread

    compute = ComputeThread()
    try:
        compute.run(lambda: 1 / 0)
        raise AssertionError("the error did not reach the caller")
    except ZeroDivisionError:
        pass
    assert compute.run(lambda a, b: a + b, 2, 3) == 5
    compute.close()


def test_the_server_takes_a_compute_thread_for_large_model_files_unless_told(tmp_path, hybrid_gguf):
    from argparse import Namespace

    from deltaserve.frontends.server.app import COMPUTE_THREAD_MIN_BYTES, wants_compute_thread

    big = tmp_path / "big.gguf"
    with open(big, "wb") as f:
        f.truncate(COMPUTE_THREAD_MIN_BYTES)  # sparse: the size is what counts
    assert wants_compute_thread(Namespace(model=str(big), compute_thread="auto"))
    assert not wants_compute_thread(Namespace(model=str(hybrid_gguf), compute_thread="auto"))
    assert not wants_compute_thread(Namespace(model=None, compute_thread="auto"))  # the demo model
    assert wants_compute_thread(Namespace(model=str(hybrid_gguf), compute_thread="on"))
    assert not wants_compute_thread(Namespace(model=str(big), compute_thread="off"))
