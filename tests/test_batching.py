"""The engine loop owns generation: sessions' turns are its sequences; their decode rows share forwards, a long
prompt is cut into chunks between the others' steps, a cancelled sequence's rows are gone at the next step, and each
sequence answers as it would alone."""

from __future__ import annotations

import threading

import pytest
import torch

from deltaserve.runtime.backend import CPUBackend
from deltaserve.runtime.engine import CHUNK, EngineLoop


@pytest.fixture(scope="module")
def mtp_model():
    import deltaserve
    from tests.fixtures import models as fx

    return deltaserve.load(fx.gguf_path("hybrid_mtp", "q8_0"))  # the native one-call route, an MTP block


def _prompts(model, n, words=1):
    tok = model.tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": f"story number {i} " + "go on " * words}],
                                               add_generation_prompt=True, enable_thinking=False))
            for i in range(n)]


def _sessions(model, n, threaded=True):
    engine = EngineLoop(threaded=threaded, name="test-engine")
    backend = CPUBackend(model.host)
    backend.use_engine(engine)
    sessions = [model.session(backend=backend, quiet=True) for _ in range(n)]
    for i, s in enumerate(sessions):
        s.label = "ab"[i] if n <= 2 else f"s{i}"  # the engine's log names each sequence by its session's label
    return engine, sessions


def _together(sessions, prompts, **kw):
    """Each session's turn started from a thread of its own at once; their Turns."""
    got = [None] * len(prompts)
    barrier = threading.Barrier(len(prompts))

    def run(i):
        barrier.wait()
        got[i] = sessions[i].generate(prompts[i], **kw)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    [t.start() for t in threads]
    [t.join() for t in threads]
    return got


def test_concurrent_sessions_decode_their_rows_in_one_forward_and_answer_as_if_alone(hybrid_model):
    prompts = _prompts(hybrid_model, 4)
    want = [hybrid_model.generate(p, max_tokens=20).tokens for p in prompts]
    engine, sessions = _sessions(hybrid_model, 4)
    engine.record()
    got = [t.tokens for t in _together(sessions, prompts, max_tokens=20)]
    assert got == want
    together = [len(rows) for kind, rows, _ in engine.stats.log if kind == "rows"]
    assert max(together) == 4, together  # the four sequences' decode rows in one step
    steps_of_four = [e for e in engine.stats.log if e[0] == "rows" and len(e[1]) == 4]
    assert all(calls == 1 for _, _, calls in steps_of_four)  # ... and in one forward call
    assert engine.stats.rows["decode"] == sum(len(w) - 1 for w in want)
    engine.close()


def test_a_lone_session_runs_its_turn_inline_on_the_calling_thread(hybrid_model):
    s = hybrid_model.session(quiet=True)
    seen = set()
    forward = s.backend.forward
    original = forward.run_rows

    def spy(runs):
        seen.add(threading.current_thread().name)
        return original(runs)

    forward.run_rows = spy
    try:
        t = s.generate([5, 6, 7, 8, 9], max_tokens=10)
    finally:
        del forward.run_rows
    assert t.tokens == hybrid_model.generate([5, 6, 7, 8, 9], max_tokens=10).tokens
    assert seen == {threading.current_thread().name}


def test_with_a_threaded_loop_every_forward_of_every_session_runs_on_its_thread(hybrid_model):
    prompts = [[5, 6, 7, 8, 9 + i] for i in range(3)]
    want = [hybrid_model.generate(p, max_tokens=12).tokens for p in prompts]
    engine, sessions = _sessions(hybrid_model, 3)
    forward = sessions[0].backend.forward
    seen: set[str] = set()
    originals = {name: getattr(forward, name) for name in ("prefill", "run_rows", "new_state")}
    for name, original in originals.items():
        def spy(*args, _original=original, **kwargs):
            seen.add(threading.current_thread().name)
            return _original(*args, **kwargs)
        setattr(forward, name, spy)
    try:
        got = [t.tokens for t in _together(sessions, prompts, max_tokens=12)]
    finally:
        for name in originals:
            delattr(forward, name)
    assert got == want
    assert seen == {"test-engine"}
    engine.close()


def test_a_long_prompt_runs_a_few_layers_a_step_with_the_others_decode_rows_between(hybrid_model):
    """While one sequence decodes, another's long prompt goes in chunks of CHUNK tokens (the same cuts as alone), each
    chunk a few layers a step with the decoding sequence's row between; both answers are the same as alone."""
    long = [(37 * i) % 500 + 10 for i in range(700)]
    short = [5, 6, 7, 8, 9]
    want_long = hybrid_model.generate(long, max_tokens=3).tokens
    want_short = hybrid_model.generate(short, max_tokens=40).tokens
    engine, (a, b) = _sessions(hybrid_model, 2)
    engine.step_s = 1e-6  # one layer a step while another decodes
    engine.record()
    started = threading.Event()
    out = {}

    def decode_first():
        out["short"] = a.generate(short, max_tokens=40, on_token=lambda tid, text: started.set())

    t = threading.Thread(target=decode_first)
    t.start()
    started.wait(30)
    out["long"] = b.generate(long, max_tokens=3)
    t.join()
    assert out["short"].tokens == want_short and out["long"].tokens == want_long
    log = list(engine.stats.log)
    chunks = [e[2] for e in log if e[0] == "prefill" and e[1] == "b"]
    assert chunks[:2] == [CHUNK, 700 - 1 - CHUNK], chunks  # the span before the checkpoint, as alone cuts it
    first = log.index(("prefill", "b", CHUNK))
    slices = [i for i, e in enumerate(log[:first + 1]) if e[0] == "layers" and e[1] == "b"]
    layers = hybrid_model.config.num_layers
    assert len(slices) == layers and all(log[i][2] == 1 for i in slices)  # the chunk's layers one a step
    between = [any(e[0] == "rows" and ("a", 1) in e[1] for e in log[i + 1:j]) for i, j in zip(slices, slices[1:])]
    assert all(between), log  # the decoding sequence's row between every two of them
    engine.close()


def test_a_cancelled_sequence_has_no_rows_in_the_step_after_its_cancel(hybrid_model):
    engine, (a, b) = _sessions(hybrid_model, 2)
    engine.record()
    cancel = threading.Event()
    count = {"a": 0}

    def on_token(tid, text):
        count["a"] += 1
        if count["a"] == 3:
            cancel.set()

    out = {}
    ta = threading.Thread(target=lambda: out.setdefault("a", a.generate([5, 6, 7], max_tokens=200, stop=[],
                                                                        on_token=on_token, cancel=cancel)))
    tb = threading.Thread(target=lambda: out.setdefault("b", b.generate([8, 9, 10], max_tokens=30, stop=[])))
    ta.start(), tb.start()
    ta.join(), tb.join()
    assert out["a"].finish_reason == "cancelled" and len(out["a"].tokens) == 3
    assert out["b"].generated == 30
    assert engine.stats.cancelled == 1
    log = list(engine.stats.log)
    at = log.index(("cancelled", "a"))
    assert not any(e[0] == "rows" and any(who == "a" for who, _ in e[1]) for e in log[at:])  # none of a's rows after
    assert any(e[0] == "rows" and any(who == "b" for who, _ in e[1]) for e in log[at:])  # b goes on
    assert a.held == [5, 6, 7] + out["a"].tokens[:-1]  # what was fed stays held: the next turn extends it
    again = a.generate([5, 6, 7] + out["a"].tokens + [11], max_tokens=2)
    assert again.start == "extend" and again.reused == 3 + 2
    engine.close()


def test_a_client_gone_during_a_long_prefill_stops_it_after_the_chunk_under_way(hybrid_model):
    """A chunk's layers are never left half done (the state is consistent only between chunks): the prompt stops at
    the end of the chunk under way, and what was fed is held."""
    long = [(37 * i) % 500 + 10 for i in range(3 * CHUNK)]
    engine, (a, b) = _sessions(hybrid_model, 2)
    engine.step_s = 1e-6
    engine.record()
    cancel = threading.Event()
    started = threading.Event()
    seen = {"layers": 0}
    original = engine._prefill_layers

    def counting(seq, deadline):  # a few layers into the first chunk, its client leaves
        if seq.label == "a":
            seen["layers"] += 1
            if seen["layers"] == 3:
                cancel.set()
        return original(seq, deadline)

    engine._prefill_layers = counting
    t = threading.Thread(target=lambda: b.generate([5, 6, 7], max_tokens=400, stop=[],
                                                   on_token=lambda tid, text: started.set()))
    t.start()
    started.wait(30)
    turn = a.generate(long, max_tokens=5, cancel=cancel)
    t.join()
    assert turn.finish_reason == "cancelled" and turn.tokens == []
    assert [e[2] for e in engine.stats.log if e[0] == "prefill" and e[1] == "a"] == [CHUNK]  # that chunk, no other
    assert a.held == long[:CHUNK]  # what was fed is held: a retry prefills only the rest
    retry = a.generate(long, max_tokens=2)
    assert retry.reused == CHUNK and retry.tokens == hybrid_model.generate(long, max_tokens=2).tokens
    engine.close()


def test_drafts_of_several_sequences_are_verified_in_one_forward(mtp_model):
    """Two sessions drafting with the MTP block at once: their verification chains run as rows of one native call,
    and each answer is the same as without drafts."""
    engine = EngineLoop(threaded=True, name="test-engine")
    backend = CPUBackend(mtp_model.host)
    backend.use_engine(engine)
    sessions = [mtp_model.session(backend=backend, quiet=True, mtp=2) for _ in range(2)]
    for s in sessions:
        s._policy.choose = lambda room: min(2, room)  # always draft: the mechanism, not the policy
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12]]
    want = [mtp_model.session(quiet=True, mtp=0).generate(p, max_tokens=24, stop=[]).tokens for p in prompts]
    engine.record()
    got = [t.tokens for t in _together(sessions, prompts, max_tokens=24, stop=[])]
    assert got == want
    mixed = [e for e in engine.stats.log if e[0] == "rows" and len(e[1]) == 2 and all(n > 1 for _, n in e[1])]
    assert mixed, list(engine.stats.log)  # both sequences' token + drafts in one step
    assert all(calls == 1 for _, rows, calls in mixed if sum(n for _, n in rows) <= backend.max_rows)
    assert engine.stats.rows["verify"] > 0
    engine.close()


def test_an_error_inside_the_loop_thread_reaches_the_caller_and_the_thread_goes_on():
    engine = EngineLoop(threaded=True)
    with pytest.raises(ZeroDivisionError):
        engine.call(lambda: 1 / 0)
    assert engine.call(lambda a, b: a + b, 2, 3) == 5
    engine.close()


def test_a_sequence_that_fails_fails_alone_and_the_loop_serves_the_next(hybrid_model):
    engine, (a, b) = _sessions(hybrid_model, 2)
    with pytest.raises(Exception):
        a.generate([hybrid_model.config.vocab_size + 5], max_tokens=3)  # an id past the vocabulary: refused
    assert b.generate([5, 6, 7], max_tokens=3).tokens == hybrid_model.generate([5, 6, 7], max_tokens=3).tokens
    engine.close()


def test_the_server_takes_a_thread_for_its_engine_loop_for_large_model_files_unless_told(tmp_path, hybrid_gguf):
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


def test_prefill_chunks_at_granule_boundaries_give_the_same_bits_as_the_whole_prompt():
    """On the file's own blocks (the native products), a prompt cut at multiples of the granule gives the same bits as
    fed whole, the tail taken along with the last chunk as the loop takes it. (On f32 weights torch's GEMM picks its
    blocking by the row count: the same within rounding, not bit for bit.)"""
    import deltaserve
    from deltaserve.engine.forward import Forward
    from tests.fixtures import models as fx

    model = deltaserve.load(fx.gguf_path("hybrid", "q8_0"))
    f = Forward(model.config, model.host.weights)
    ids = [(1000 + 37 * i) % 600 for i in range(300)]
    whole = f.new_state(512)
    a = f.prefill(whole, ids)
    for cuts in ([64, 128, 192], [128, 192], [64]):
        cut = f.new_state(512)
        for lo, hi in zip([0] + cuts, cuts + [len(ids)]):
            b = f.prefill(cut, ids[lo:hi])
        assert torch.equal(a, b), cuts
        assert torch.equal(f.decode(whole, 7), f.decode(cut, 7))
        whole = f.new_state(512)
        f.prefill(whole, ids)


def _rows_alone_and_together(model):
    from deltaserve.engine.forward import Forward

    f = Forward(model.config, model.host.weights)
    prompts = [[5 + i, 17, 42 + i, 99, 3] for i in range(4)]

    def states():
        out = []
        for p in prompts:
            st = f.new_state(64)
            f.prefill(st, p)
            out.append(st)
        return out

    alone = [f.run_rows([(st, [7], None)])[0][0] for st in states()]
    together, calls = f.run_rows([(st, [7], None) for st in states()])
    assert calls == 1
    return alone, together


def test_with_batch_invariance_a_row_gets_the_same_bits_alone_or_among_others(batch_invariant):
    import deltaserve
    from tests.fixtures import models as fx

    alone, together = _rows_alone_and_together(deltaserve.load(fx.gguf_path("hybrid", "q8_0")))
    assert all(torch.equal(a, b) for a, b in zip(alone, together))


def test_with_batch_invariance_greedy_sequences_on_k_quant_blocks_decode_the_same_bits_together_as_alone(
        batch_invariant):
    """Four sequences of a Q4_K_M file (llama.cpp's quantization of the demo model: Q4_K and Q6_K blocks) decode
    greedily six steps, each alone and all four in one call a step: the same tokens and logits bit for bit. Their
    Q6_K products of 4 rows run on the many-row tiles of the 512-bit build (each row summed as one row alone), the
    Q4_K ones on the pair tiles (AVX2: its rows)."""
    import deltaserve
    from deltaserve.engine.forward import Forward
    from deltaserve.kernels import routes
    from tests.test_fast_weights import demo_by_llama_cpp

    model = deltaserve.load(demo_by_llama_cpp("Q4_K_M", "q4_k_m"), cache=False)
    f = Forward(model.config, model.host.weights)
    c = routes.capabilities()
    if c.vnni512 and c.multi:
        assert routes.decode_step("Q6_K", 4).kernel == "multi_tile (tiles_avx512.c)"
        assert routes.decode_step("Q4_K", 4).kernel == "tiles_avx512"
    prompts = [[5 + i, 17, 42 + 3 * i, 99, 3 + i] for i in range(4)]

    def greedy(group):
        states, toks, logits = [], [], [[] for _ in group]
        for p in group:
            st = f.new_state(32)
            toks.append(int(f.prefill(st, p).argmax()))
            states.append(st)
        for _ in range(6):
            out, calls = f.run_rows([(st, [t], None) for st, t in zip(states, toks)])
            assert calls == 1
            for i, o in enumerate(out):
                logits[i].append(o[0])
            toks = [int(o[0].argmax()) for o in out]
        return [torch.stack(rows) for rows in logits]

    together = greedy(prompts)
    alone = [greedy([p])[0] for p in prompts]
    for a, b in zip(alone, together):
        assert torch.equal(a.argmax(-1), b.argmax(-1)) and torch.equal(a, b)


def test_by_default_four_rows_take_the_block_gemm_and_agree_with_one_row_to_rounding():
    import deltaserve
    from deltaserve.kernels import routes
    from tests.fixtures import models as fx

    if routes.decode_gemm_rows() > 4:
        pytest.skip(f"this build takes the GEMM from {routes.decode_gemm_rows()} rows")
    assert routes.decode_step("Q8_0", 4).family == "gemm" and routes.decode_step("Q8_0", 1).family == "blocks"
    alone, together = _rows_alone_and_together(deltaserve.load(fx.gguf_path("hybrid", "q8_0")))
    assert not all(torch.equal(a, b) for a, b in zip(alone, together))  # another kernel than the lone row's
    for a, b in zip(alone, together):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4) and int(a.argmax()) == int(b.argmax())


def test_a_device_that_loses_memory_between_chunks_goes_one_plan_down_at_the_next_chunk(hybrid_model):
    """The prefill plan is checked against the memory free at each chunk (the seed's rule): a device whose free memory
    drops mid-prompt takes the next smaller plan there, says so, and the turn stays on it (no fallback)."""
    import uuid

    from deltaserve.runtime import capacity as cap
    from deltaserve.runtime.backend import FaultyBackend

    engine = EngineLoop(threaded=True, name="test-engine")
    backend = FaultyBackend(hybrid_model.host, device_name=f"chunks-{uuid.uuid4().hex[:8]}")
    backend.use_engine(engine)
    a, b = (hybrid_model.session(backend=backend, quiet=True) for _ in range(2))
    a.label, b.label = "a", "b"
    engine.step_s = 1e-6
    long = [(37 * i) % 500 + 10 for i in range(3 * CHUNK)]
    b.generate([5, 6, 7], max_tokens=2)  # both states allocated (4096 positions each) before the measured turn
    a.generate([8, 9], max_tokens=1)

    def total(plan):
        return cap.plan(hybrid_model.config, 4096, cap.Memory(1 << 40, 1 << 40, "t"), overhead=backend.overhead,
                        plans=(plan,)).total

    big, small = total(cap.PREFILL_PLANS[0]), total(cap.PREFILL_PLANS[1])
    assert small < big
    forward = backend.forward
    original = forward.prefill_steps
    seen = {"chunks": 0}

    def prefill_steps(state, tokens):
        if state is a.state:
            seen["chunks"] += 1
            if seen["chunks"] == 1:  # during the first chunk a neighbour takes memory: only the smaller plan fits
                backend.memory_bytes = (big + small) // 2 + b.state.nbytes
        return original(state, tokens)

    forward.prefill_steps = prefill_steps
    started = threading.Event()
    try:
        t = threading.Thread(target=lambda: b.generate([5, 6, 7, 11], max_tokens=80, stop=[],
                                                       on_token=lambda tid, text: started.set()))
        t.start()
        started.wait(30)
        turn = a.generate(long, max_tokens=2)
        t.join()
    finally:
        del forward.prefill_steps
        backend.memory_bytes = None
    assert a.on_accelerator and turn.backend == backend.name and seen["chunks"] > 2
    said = [n for n in a.notices if "at this chunk" in n]
    assert len(said) == 1 and cap.PREFILL_PLANS[1].label in said[0], a.notices
    assert a.state.prefill_rows == cap.PREFILL_PLANS[1].rows
    assert turn.tokens == hybrid_model.session(device="cpu", quiet=True).generate(long, max_tokens=2).tokens
    engine.close()


def test_a_prompt_is_fed_at_every_step_while_many_sequences_decode(hybrid_model):
    """Fair both ways: while four sequences decode, a waiting prompt gets layers in every step (never starved by the
    decodes), and every step still runs the decodes' rows first (never starved by the prompt)."""
    engine, sessions = _sessions(hybrid_model, 5)
    engine.step_s = 1e-6
    engine.record()
    decoders, prompter = sessions[:4], sessions[4]
    started = threading.Barrier(5)
    out = {}

    def decode(i):
        started.wait()
        out[i] = decoders[i].generate([5 + i, 6, 7], max_tokens=80, stop=[])

    threads = [threading.Thread(target=decode, args=(i,)) for i in range(4)]
    [t.start() for t in threads]
    started.wait()
    while engine.stats.rows["decode"] < 8:  # the four are decoding
        threading.Event().wait(0.005)
    long = [(37 * i) % 500 + 10 for i in range(CHUNK)]
    turn = prompter.generate(long, max_tokens=1)
    [t.join() for t in threads]
    log = list(engine.stats.log)
    mine = [i for i, e in enumerate(log) if e[0] == "layers" and e[1] == prompter.label]
    assert len(mine) >= hybrid_model.config.num_layers and turn.prefilled == len(long)
    for i, j in zip(mine, mine[1:]):  # between two of its steps: one step's rows, the decoders'
        between = [e for e in log[i + 1:j] if e[0] != "prefill"]
        assert len(between) == 1 and between[0][0] == "rows" and len(between[0][1]) >= 1, between
    engine.close()
