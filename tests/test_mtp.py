"""Speculative decoding with the model's own MTP block (issue 33): the block read from GGUF and HF directories, the
verification chain and its rollback against a plain decode, and the session's output with drafts against its
output without them (greedy token for token, sampled in distribution)."""

from __future__ import annotations

import functools
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import deltaserve
from deltaserve.engine.host import load_host
from deltaserve.errors import DeltaserveError
from deltaserve.runtime import capacity as cap
from deltaserve.runtime.backend import CPUBackend
from deltaserve.session import resident
from tests.fixtures import models as fx

PROMPT = [5, 17, 42, 99, 3, 8, 77, 12, 64, 31]


@pytest.fixture(scope="module")
def mtp_files():
    """The dense and the MoE fixture with an MTP block: HF directories and their GGUFs (f32: the torch route; q8_0:
    the native one-call route)."""
    return {"dense": {"hf": fx.hf_dir("hybrid_mtp"), "f32": fx.gguf_path("hybrid_mtp", "f32"),
                      "q8_0": fx.gguf_path("hybrid_mtp", "q8_0")},
            "moe": {"hf": fx.hf_dir("moe_mtp"), "q8_0": fx.gguf_path("moe_mtp", "q8_0")}}


@pytest.fixture(scope="module")
def models(mtp_files):
    cache: dict = {}

    def get(kind: str, form: str):
        if (kind, form) not in cache:
            cache[kind, form] = deltaserve.load(mtp_files[kind][form])
        return cache[kind, form]
    return get


def forward_of(path):
    backend = CPUBackend(load_host(path))
    backend.start()
    return backend.forward


def test_the_mtp_block_reads_the_same_from_the_hf_directory_and_from_its_gguf(mtp_files):
    for kind in ("dense", "moe"):
        hf, gg = load_host(mtp_files[kind]["hf"], "exact"), load_host(mtp_files[kind]["q8_0" if kind == "moe" else "f32"],
                                                                      "exact")
        a, b = hf.weights.mtp, gg.weights.mtp
        assert a is not None and b is not None
        # the zero-centred norms become 1 + w on both roads (HF: on read; GGUF: in the converter)
        for name in ("enorm", "hnorm", "head_norm"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        tol = 0.02 if kind == "moe" else 0.0  # the MoE GGUF is q8_0
        x = torch.randn(3, 2 * hf.config.hidden_size, generator=torch.Generator().manual_seed(1))
        assert torch.allclose(a.eh_proj(x), b.eh_proj(x), atol=tol + 1e-5)
        assert torch.allclose(a.layer.attn_norm, b.layer.attn_norm)
        assert (a.layer.moe is not None) == (kind == "moe")


def test_inspect_says_whether_a_file_carries_an_mtp_block(mtp_files):
    def said(path) -> str:
        out = subprocess.run([sys.executable, "-m", "deltaserve", "inspect", str(path)], capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        return next(line for line in out.stdout.splitlines() if line.startswith("MTP block"))

    assert said(mtp_files["moe"]["q8_0"]).startswith("MTP block: yes (nextn: one full-attention block with an MoE FFN")
    assert said(fx.gguf_path("hybrid", "f32")).startswith("MTP block: no")


@pytest.mark.parametrize("form", ["q8_0", "f32"])
def test_a_verification_chain_gives_each_row_the_logits_of_a_plain_decode(mtp_files, form, request):
    if form == "q8_0":  # the same bits on the decode tiles; the chain's rows on the GEMM agree to rounding (below)
        request.getfixturevalue("batch_invariant")
    f = forward_of(mtp_files["dense"][form])
    plain_state = f.new_state(64)
    logits = f.prefill(plain_state, PROMPT)
    tokens, plain = [], []
    for _ in range(5):
        tokens.append(int(logits.argmax()))
        logits = f.decode(plain_state, tokens[-1])
        plain.append(logits)
    state = f.new_state(64)
    f.prefill(state, PROMPT)
    rows = f.verify(state, tokens, f.new_snapshots(4))
    assert state.length == len(PROMPT) + 5
    for j in range(5):
        if form == "q8_0":  # the native chain: each row through the very products a one-row decode runs
            assert torch.equal(rows[j], plain[j]), j
        else:
            assert torch.allclose(rows[j], plain[j], atol=1e-5), j


def test_a_verification_chain_on_the_block_gemm_agrees_with_a_plain_decode_to_rounding(mtp_files):
    """By default a chain of 3 or more rows takes the block GEMM (routes.decode_gemm_rows): the same integer sums as
    the decode tiles, the scales applied in another order."""
    from deltaserve.kernels import routes

    n = routes.decode_gemm_rows()  # 3 on the VNNI build, 6 on AVX2's: a chain of n rows takes the GEMM
    assert 0 < n <= 7
    f = forward_of(mtp_files["dense"]["q8_0"])
    plain_state = f.new_state(64)
    logits = f.prefill(plain_state, PROMPT)
    tokens, plain = [], []
    for _ in range(n):
        tokens.append(int(logits.argmax()))
        logits = f.decode(plain_state, tokens[-1])
        plain.append(logits)
    state = f.new_state(64)
    f.prefill(state, PROMPT)
    rows = f.verify(state, tokens, f.new_snapshots(n - 1))
    assert not all(torch.equal(rows[j], plain[j]) for j in range(n))  # another kernel than the one-row decode's
    for j in range(n):
        assert torch.allclose(rows[j], plain[j], atol=1e-4, rtol=1e-4), j
        assert int(rows[j].argmax()) == int(plain[j].argmax())


@pytest.mark.parametrize("form", ["q8_0", "f32"])
def test_rolling_back_after_every_rejection_position_leaves_the_states_of_a_plain_decode(mtp_files, form):
    f = forward_of(mtp_files["dense"][form])
    k = 4
    chain = [11, 200, 37, 5, 90]  # the sampled token, then k drafts
    for kept in range(1, k + 2):
        state, ref = f.new_state(64), f.new_state(64)
        f.prefill(state, PROMPT)
        f.prefill(ref, PROMPT)
        snaps = f.new_snapshots(k)
        f.verify(state, chain, snaps)
        f.rollback(state, snaps, kept, k + 1)
        for t in chain[:kept]:
            f.decode(ref, t)
        assert state.length == ref.length == len(PROMPT) + kept
        for i in state.ssm:
            assert torch.allclose(state.ssm[i], ref.ssm[i], rtol=1e-5, atol=1e-5), (kept, i)
            assert torch.allclose(state.conv[i], ref.conv[i], rtol=1e-5, atol=1e-5), (kept, i)
        for i, (kc, vc) in state.kv.items():
            assert torch.allclose(kc[:, :state.length], ref.kv[i][0][:, :ref.length], rtol=1e-5, atol=1e-5)
            assert torch.allclose(vc[:, :state.length], ref.kv[i][1][:, :ref.length], rtol=1e-5, atol=1e-5)
        # and the next token from there is the plain decode's: to f32 rounding (the rows verified together and one at a
        # time sum their products in other orders: the logits' largest difference 1.1e-5 with torch's row steps,
        # 1.9e-5 with the native ones, the states' 2e-6)
        assert torch.allclose(f.decode(state, 7), f.decode(ref, 7), atol=5e-5)


def drafting(model, most: int, **kw):
    """A session that drafts `most` tokens every step it may (no adaptation, never given up): the verification and
    rollback paths run at every step whatever the random block's drafts are worth."""
    model.host.draft_policy = None  # what other tests' sessions measured on this model is not this test's
    s = model.session(mtp=most, quiet=True, **kw)
    if s._policy is not None:
        s._policy.choose = lambda room: min(most, room)
        s._policy.record_step = lambda *a: None
    return s


def turns(model, mtp, temperature=0.0, seed=None, max_tokens=48):
    """Two turns of one conversation (the second extends the first), and the session."""
    s = drafting(model, mtp) if mtp else model.session(mtp=mtp, quiet=True)
    first = s.generate(PROMPT, max_tokens=max_tokens, temperature=temperature, seed=seed)
    second = s.generate(PROMPT + first.tokens + [9, 10, 11], max_tokens=max_tokens, temperature=temperature,
                        seed=seed)
    return first, second, s


@pytest.mark.parametrize("kind,form", [("dense", "q8_0"), ("dense", "hf"), ("moe", "q8_0"), ("moe", "hf")])
def test_greedy_output_is_identical_with_and_without_mtp(models, kind, form):
    model = models(kind, form)
    plain = turns(model, 0)
    assert plain[2]._policy is None
    for most in (1, 4):
        first, second, s = turns(model, most)
        assert s._policy is not None and s.state.mtp is not None
        assert first.tokens == plain[0].tokens and second.tokens == plain[1].tokens
        assert second.start == "extend" and second.reused == plain[1].reused
        assert first.drafted > 0  # it drafted (the random block's drafts are mostly refused: every rollback ran)


class OracleDrafts:
    """A drafter that knows the plain continuation and lies at chosen offsets: the session's accept, mismatch and
    rollback paths at every position, whatever the random MTP block would have drafted."""

    def __init__(self, continuation: list[int], prompt_len: int, wrong_every: int):
        self.continuation, self.prompt_len, self.wrong_every = continuation, prompt_len, wrong_every
        self.calls = 0

    def __call__(self, session, state, token, k, constraint, stop_ids):
        self.calls += 1
        at = state.length + 1 - self.prompt_len  # the continuation index of the first draft
        out = []
        for j in range(k):
            if at + j >= len(self.continuation):
                break
            t = self.continuation[at + j]
            if self.wrong_every and (at + j) % self.wrong_every == 0:
                t = (t + 1) % 300
            out.append(t)
        return out


@pytest.mark.parametrize("wrong_every", [0, 2, 3, 7])
def test_drafts_the_model_agrees_with_are_kept_and_the_others_rolled_back(models, monkeypatch, wrong_every):
    model = models("dense", "q8_0")
    s0 = model.session(mtp=0, quiet=True)
    plain = s0.generate(PROMPT, max_tokens=40)
    oracle = OracleDrafts(plain.tokens, len(PROMPT), wrong_every)
    monkeypatch.setattr(resident.Session, "_draft", lambda self, *a: oracle(self, *a))
    s = drafting(model, 4)
    turn = s.generate(PROMPT, max_tokens=40)
    assert turn.tokens == plain.tokens
    assert turn.drafted > 0
    if wrong_every == 0:  # all right: each verification of 4 drafts keeps them all and adds its own next token
        assert turn.accepted == turn.drafted
        assert oracle.calls <= math.ceil(40 / 5) + 1
    else:
        assert 0 < turn.accepted < turn.drafted
    # what the state holds is what the turn decided, and the next turn extends it with the plain logits
    assert s.held == PROMPT + turn.tokens[:-1]
    follow_up = s.held + [turn.tokens[-1], 3]
    nxt, ref = s.generate(follow_up, max_tokens=8), s0.generate(follow_up, max_tokens=8)
    assert nxt.tokens == ref.tokens and nxt.start == "extend"


def test_sampling_with_drafts_keeps_the_models_distribution(models, monkeypatch):
    """At temperature 1, drafts that are always the model's most likely token: the second token's frequencies over
    many seeds against its exact probabilities (a chi-square test at p = 0.001), and each seed's tokens equal to the
    plain loop's (one draw per token from the same logits)."""
    model = models("dense", "q8_0")
    f = forward_of(fx.gguf_path("hybrid_mtp", "q8_0"))

    def greedy_drafts(self, state, token, k, constraint, stop_ids):
        return [int(f.prefill(f.new_state(64), list(self.held) + [token]).argmax())]

    monkeypatch.setattr(resident.Session, "_draft", greedy_drafts)
    s = drafting(model, 1)
    s0 = model.session(mtp=0, quiet=True)
    counts: dict[int, dict[int, int]] = {}
    n = 240
    for seed in range(n):
        t = s.generate(PROMPT, max_tokens=3, temperature=1.0, seed=seed)
        assert t.tokens == s0.generate(PROMPT, max_tokens=3, temperature=1.0, seed=seed).tokens
        counts.setdefault(t.tokens[0], {}).setdefault(t.tokens[1], 0)
        counts[t.tokens[0]][t.tokens[1]] += 1
    assert s._policy.drafted > 0 and s._policy.accepted > 0
    # the most frequent first token: its second-token distribution against softmax of the plain logits
    first = max(counts, key=lambda t: sum(counts[t].values()))
    seen = counts[first]
    total = sum(seen.values())
    ref = f.new_state(64)
    f.prefill(ref, PROMPT)
    p = torch.softmax(f.decode(ref, first).double(), -1)
    order = sorted(range(p.numel()), key=lambda t: -float(p[t]))
    bins, rest_p, rest_n = [], 0.0, 0
    for t in order:  # bins of expected count >= 5, the tail pooled
        e = float(p[t]) * total
        if e >= 5:
            bins.append((e, seen.get(t, 0)))
        else:
            rest_p += float(p[t])
            rest_n += seen.get(t, 0)
    bins.append((rest_p * total, rest_n))
    chi2 = sum((o - e) ** 2 / e for e, o in bins if e > 0)
    dof = len(bins) - 1
    # the 0.999 quantile of chi-square by the Wilson-Hilferty approximation
    z = 3.09
    limit = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3 if dof > 0 else 10.8
    assert chi2 < limit, (chi2, limit, dof, total)


@pytest.mark.parametrize("form", ["q8_0", "hf"], ids=["native", "torch"])
def test_drafts_from_the_heads_first_rows_leave_every_answer_unchanged(mtp_files, monkeypatch, form):
    """DELTASERVE_DRAFT_VOCAB: the drafts come from the head's first N rows and the end-of-sequence ids (a row view:
    a draft step no longer reads the whole head). The answers, free and structured, are token for token the plain
    ones, which use tokens past N; every draft is one of the N (or an end id); the route says it."""
    monkeypatch.setenv("DELTASERVE_DRAFT_VOCAB", "100")
    model = deltaserve.load(mtp_files["dense"][form])
    seen: list[int] = []
    real = resident.Session._draft

    def spy(self, *a):
        drafts = real(self, *a)
        seen.extend(drafts)
        return drafts

    monkeypatch.setattr(resident.Session, "_draft", spy)
    plain = turns(model, 0)
    first, second, s = turns(model, 3)
    assert first.tokens == plain[0].tokens and second.tokens == plain[1].tokens
    assert any(t >= 100 for t in plain[0].tokens + plain[1].tokens)  # the answers reach past the drafted rows
    ends = set(model.config.eos_token_ids)
    assert seen and all(t < 100 or t in ends for t in seen)
    mtp = s.backend.forward.mtp
    vocab = model.config.vocab_size
    assert f"drafts over {100 + len([e for e in ends if 100 <= e < vocab])} of the head's {vocab:,} tokens" in mtp.why
    g = torch.randn(1, model.config.hidden_size, generator=torch.Generator().manual_seed(4))
    assert torch.allclose(mtp.head(g).float(), mtp.w.head(g).float()[:, mtp.ids], atol=1e-4)  # the rows are the ids'
    assert [mtp.token(i) for i in range(98, len(mtp.ids))] == [98, 99] + sorted(e for e in ends if 100 <= e < vocab)
    fmt = {"type": "json_object"}
    a = model.session(mtp=0, quiet=True).generate(PROMPT, max_tokens=40, response_format=fmt)
    b = drafting(model, 3).generate(PROMPT, max_tokens=40, response_format=fmt)
    assert a.tokens == b.tokens and a.finish_reason == b.finish_reason and b.drafted > 0


def test_a_draft_vocabulary_that_is_not_a_count_is_refused_by_name(mtp_files, monkeypatch):
    monkeypatch.setenv("DELTASERVE_DRAFT_VOCAB", "lots")
    with pytest.raises(DeltaserveError, match="DELTASERVE_DRAFT_VOCAB must be a whole number of tokens"):
        deltaserve.load(mtp_files["dense"]["q8_0"]).session(mtp=2, quiet=True)


def test_a_structured_answer_is_the_same_with_drafts(models):
    model = models("dense", "q8_0")
    fmt = {"type": "json_object"}
    a = model.session(mtp=0, quiet=True).generate(PROMPT, max_tokens=40, response_format=fmt)
    s = drafting(model, 3)
    b = s.generate(PROMPT, max_tokens=40, response_format=fmt)
    assert b.drafted > 0
    assert a.tokens == b.tokens and a.finish_reason == b.finish_reason


def test_the_mtp_switch_is_checked_and_said(models, capsys):
    model = models("dense", "q8_0")
    with pytest.raises(DeltaserveError, match="mtp must be a count"):
        model.session(mtp=-1)
    s = model.session(mtp=0)
    assert s._policy is None and s.drafting_stats() is None
    s = model.session(mtp=12)
    assert s._policy.most == 7 and any("at most 8 rows" in n for n in s.notices)
    plain = deltaserve.load(fx.gguf_path("hybrid", "f32"))
    s = plain.session(mtp=3)
    assert s._policy is None and any("carries no MTP block" in n for n in s.notices)
    assert plain.session()._policy is None  # nothing asked, nothing carried: nothing said
    capsys.readouterr()


def test_the_capacity_plan_counts_the_drafting_buffers(models):
    model = models("dense", "q8_0")
    c = model.config
    s = drafting(model, 4)
    s.generate(PROMPT, max_tokens=2)
    extra = cap.speculative_bytes(c, s.capacity, 4)
    assert extra == s.capacity * 2 * c.num_kv_heads * c.head_dim * 4 + 4 * c.recurrent_state_bytes()
    assert s._plan(s.capacity).speculative == extra
    assert "MTP drafting" in s._plan(s.capacity).arithmetic()
    assert s._snaps is not None and s._snaps.nbytes == 4 * c.recurrent_state_bytes()
    assert model.session(mtp=0, quiet=True)._plan(4096).speculative == 0


def test_run_says_the_drafts_in_its_stats_line(mtp_files):
    out = subprocess.run([sys.executable, "-m", "deltaserve", "run", str(mtp_files["dense"]["q8_0"]), "--raw",
                          "-p", "hello there", "-n", "24", "--mtp", "2"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    stats = next(line for line in out.stderr.splitlines() if line.startswith("[stats]"))
    assert ", MTP accepted " in stats and " draft" in stats
    assert "[deltaserve] MTP: drafting up to 2 tokens" in out.stderr
    bad = subprocess.run([sys.executable, "-m", "deltaserve", "run", str(mtp_files["dense"]["q8_0"]), "--raw",
                          "-p", "hi", "--mtp", "-1"], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "--mtp takes a count" in bad.stderr and "Traceback" not in bad.stderr


@functools.lru_cache(maxsize=None)
def llama_cpp_mtp_gguf() -> tuple[Path, Path]:
    """The conformance model (real vocabulary, an irregular layer pattern) with an MTP block drawn beside it, and
    that directory converted by llama.cpp's own convert_hf_to_gguf.py with its MTP block (no --no-mtp)."""
    from tests import test_gguf_conformance as conf

    script = conf.llama_cpp_converter()
    root = conf.model_dir().parent / f"{conf.model_dir().name}-mtp"
    hf = root / "hf"
    out = root / f"by-llama.cpp-{conf.llama_cpp_python_version()}-f32.gguf"
    with fx._locked(root / "build"):
        if not (hf / ".complete").exists():
            shutil.rmtree(hf, ignore_errors=True)
            shutil.copytree(conf.hf_dir(), hf)
            (hf / ".complete").unlink(missing_ok=True)
            fx.add_mtp(hf, 71)
            (hf / ".complete").write_text("ok")
        if not out.exists():
            part = out.with_suffix(".part")
            env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
            proc = subprocess.run([sys.executable, str(script), str(hf), "--outfile", str(part), "--outtype", "f32"],
                                  capture_output=True, text=True, timeout=900, env=env, cwd=script.parent)
            assert proc.returncode == 0 and part.exists(), (proc.stdout + proc.stderr)[-4000:]
            os.replace(part, out)
    return hf, out


def test_llama_cpps_converter_writes_the_mtp_block_as_deltaserve_reads_it_from_the_checkpoint():
    hf, gg = llama_cpp_mtp_gguf()
    from_gguf, from_hf = load_host(gg, "exact"), load_host(hf, "exact")
    assert from_gguf.config.num_layers == from_hf.config.num_layers == 6  # the MTP block is not a trunk layer
    a, b = from_gguf.weights.mtp, from_hf.weights.mtp
    assert a is not None and b is not None
    for name in ("enorm", "hnorm", "head_norm"):
        assert torch.allclose(getattr(a, name), getattr(b, name)), name
    x = torch.randn(2, 2 * from_hf.config.hidden_size, generator=torch.Generator().manual_seed(3))
    assert torch.allclose(a.eh_proj(x), b.eh_proj(x), atol=1e-5)
    assert torch.allclose(a.layer.mixer.qkv(x[:, :64]), b.layer.mixer.qkv(x[:, :64]), atol=1e-5)
    # and greedy decoding of that file is the same with drafts and without
    model = deltaserve.load(gg)
    ids = list(range(1000, 1012))
    plain = model.session(mtp=0, quiet=True).generate(ids, max_tokens=32)
    drafted = drafting(model, 3).generate(ids, max_tokens=32)
    assert drafted.tokens == plain.tokens and drafted.drafted > 0


def test_serve_drafts_and_says_so_in_health_and_metrics(mtp_files):
    import httpx

    from tests.server_proc import ServerProcess

    with ServerProcess(mtp_files["dense"]["q8_0"], "--slots", "2", "--mtp", "2") as server:
        body = {"messages": [{"role": "user", "content": "tell me something"}], "max_tokens": 24, "temperature": 0}
        first = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
        assert first.status_code == 200, first.text
        again = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
        assert again.json()["choices"][0]["message"] == first.json()["choices"][0]["message"]
        health = httpx.get(server.url + "/health", timeout=30).json()
        mtp = [slot["mtp"] for slot in health["slots"]]
        assert all(m is not None and m["most"] == 2 for m in mtp)
        assert sum(m["drafted"] for m in mtp) > 0
        metrics = httpx.get(server.url + "/metrics", timeout=30).text
        drafted = sum(float(line.split()[-1]) for line in metrics.splitlines()
                      if line.startswith("deltaserve_slot_mtp_drafted_tokens{"))
        assert drafted == sum(m["drafted"] for m in mtp)
        assert "MTP: drafting up to 2 tokens" in server.stderr
    with ServerProcess(mtp_files["dense"]["q8_0"], "--slots", "1", "--mtp", "0") as server:
        assert httpx.get(server.url + "/health", timeout=30).json()["slots"][0]["mtp"] is None


def test_a_separate_mtp_file_drafts_for_its_model_and_a_wrong_one_is_refused(tmp_path):
    """llama.cpp's converter with --mtp writes the block alone (mtp-*.gguf); `--draft FILE` / load(draft=) uses it
    with a model file that carries none."""
    from tests import test_gguf_conformance as conf

    hf, with_block = llama_cpp_mtp_gguf()
    script = conf.llama_cpp_converter()
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
    proc = subprocess.run([sys.executable, str(script), str(hf), "--outfile", str(tmp_path / "draft.gguf"),
                           "--outtype", "f32", "--mtp"], capture_output=True, text=True, timeout=900, env=env,
                          cwd=script.parent)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    # the same trunk without the block: the conformance test's conversion (--no-mtp) of the directory this one copies
    files = {"--mtp": tmp_path / "draft.gguf", "--no-mtp": conf.llama_cpp_gguf()}
    trunk_only = load_host(files["--no-mtp"])
    assert trunk_only.weights.mtp is None
    paired = load_host(files["--no-mtp"], draft=files["--mtp"])
    assert paired.weights.mtp is not None and paired.weights.mtp.embed is paired.weights.embed  # one copy
    whole = load_host(with_block)
    x = torch.randn(2, 2 * whole.config.hidden_size, generator=torch.Generator().manual_seed(4))
    assert torch.allclose(paired.weights.mtp.eh_proj(x), whole.weights.mtp.eh_proj(x), atol=1e-5)
    ids = list(range(2000, 2010))
    a = drafting(deltaserve.load(files["--no-mtp"], draft=files["--mtp"]), 2).generate(ids, max_tokens=16)
    b = deltaserve.load(with_block).session(mtp=0, quiet=True).generate(ids, max_tokens=16)
    assert a.tokens == b.tokens and a.drafted > 0
    with pytest.raises(DeltaserveError, match="is not a draft for this model"):
        load_host(fx.gguf_path("hybrid_mtp", "f32"), draft=files["--mtp"])
    out = subprocess.run([sys.executable, "-m", "deltaserve", "run", str(fx.gguf_path("hybrid", "f32")), "--draft",
                          str(files["--mtp"]), "--raw", "-p", "hi"], capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "is not a draft for this model" in out.stderr and "Traceback" not in out.stderr


def test_the_policy_takes_the_draft_count_that_measured_fastest_and_gives_up_drafts_that_do_not_pay():
    from deltaserve.session.drafting import OFF_AFTER, DraftPolicy

    p = DraftPolicy(3)
    for k, tokens, seconds in ((3, 4, 0.010), (2, 3, 0.010), (1, 2, 0.010), (0, 1, 0.004)):
        assert p.choose(100) == k  # each count measured once, the most drafts first
        p.record_step(k, tokens, seconds)
    assert p.choose(100) == 3 and p.choose(2) == 2  # 400 tokens/s with 3 drafts; the room bounds it
    for _ in range(30):  # the text turns unpredictable: a step with drafts now makes one token
        for k in (1, 2, 3):
            p.record_step(k, 1, 0.010)
    assert p.choose(100) == 0  # plain steps: 250 tokens/s, against ~100 with drafts
    while p.steps < OFF_AFTER:
        p.choose(100)
    p.record_step(0, 1, 0.004)
    assert p.off and "tokens/s without drafts" in p.why_off()
    learned = DraftPolicy.learned_from(p, 3)
    assert learned.off and learned.rate == p.rate
    assert not DraftPolicy.learned_from(DraftPolicy(2), 3).off
