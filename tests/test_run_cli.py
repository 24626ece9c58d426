"""`deltaserve run` prints what transformers' greedy generate produces; sampling is reproducible by seed."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
import subprocess
import sys

import pytest
import torch

import deltaserve
from deltaserve.errors import DeltaserveError
from deltaserve.session.sampling import Sampler, SamplingParams


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deltaserve.frontends.cli", *args], capture_output=True, text=True, timeout=300)


def transformers_greedy(oracle, tokenizer, ids: list[int], n: int) -> str:
    with torch.no_grad():
        out = oracle.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                              eos_token_id=sorted(tokenizer.stop_ids), pad_token_id=tokenizer.pad_id)
    new = out[0, len(ids):].tolist()
    new = [t for t in new if t not in tokenizer.stop_ids]
    return tokenizer.decode(new)


@pytest.mark.parametrize("source", ["gguf", "hf"])
def test_run_prints_exactly_what_transformers_greedy_generate_produces(source, hybrid_gguf, hybrid_hf_dir, hybrid_oracle):
    path = hybrid_gguf if source == "gguf" else hybrid_hf_dir
    model = deltaserve.load(path)
    prompt = "The quick brown fox said hello to the"
    want = transformers_greedy(hybrid_oracle, model.tokenizer, model.tokenizer.encode(prompt), 40)
    proc = run_cli("run", str(path), "--raw", "-p", prompt, "-n", "40", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == want + "\n"
    stats = [line for line in proc.stderr.splitlines() if line.startswith("[stats]")]
    assert len(stats) == 1
    for needle in ("prompt", "prefill", "tok/s", "decode", "load"):
        assert needle in stats[0]


def test_run_with_the_chat_template_matches_transformers_on_the_rendered_prompt(hybrid_gguf, hybrid_oracle):
    model = deltaserve.load(hybrid_gguf)
    text = model.tokenizer.apply_chat_template([{"role": "user", "content": "Say something."}],
                                               add_generation_prompt=True, enable_thinking=False)
    want = transformers_greedy(hybrid_oracle, model.tokenizer, model.tokenizer.encode(text), 24)
    proc = run_cli("run", str(hybrid_gguf), "--chat", "--think", "off", "-p", "Say something.", "-n", "24")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == want + "\n"


def test_several_prompts_with_chat_are_one_conversation_whose_later_turns_prefill_only_what_was_added(
        hybrid_gguf, hybrid_oracle):
    model = deltaserve.load(hybrid_gguf)
    tok = model.tokenizer
    users = ["Say something.", "And then?", "Once more."]
    history, want = [], []
    for u in users:  # transformers' greedy answer to each turn, the history carrying its own answers
        history.append({"role": "user", "content": u})
        ids = tok.encode(tok.apply_chat_template(history, add_generation_prompt=True, enable_thinking=False))
        want.append(transformers_greedy(hybrid_oracle, tok, ids, 12))
        history.append({"role": "assistant", "content": want[-1]})
    proc = run_cli("run", str(hybrid_gguf), "--chat", "--think", "off", "-n", "12",
                   *[x for u in users for x in ("-p", u)])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "".join(f"> {u}\n{w}\n" for u, w in zip(users, want))
    stats = [line for line in proc.stderr.splitlines() if line.startswith("[stats] turn")]
    assert len(stats) == 3 and "reused 0," in stats[0]
    for line in stats[1:]:
        reused = int(line.split("reused ")[1].split(",")[0])
        prefilled = int(line.split("prefilled ")[1].split(",")[0])
        prompt = int(line.split("prompt ")[1].split(" ")[0])
        assert reused > 0 and reused + prefilled == prompt


def test_several_prompts_as_raw_text_are_refused_in_one_line():
    proc = run_cli("run", "--raw", "-p", "a", "-p", "b")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "2 prompts given" in proc.stderr and "--raw" in proc.stderr


def test_every_verb_has_help():
    verbs = ("run", "chat", "serve", "convert", "inspect", "bench")
    with ThreadPoolExecutor(len(verbs)) as pool:  # six processes at once: each is mostly the interpreter's start
        procs = list(pool.map(lambda verb: run_cli(verb, "--help"), verbs))
    for verb, proc in zip(verbs, procs):
        assert proc.returncode == 0 and "usage: deltaserve " + verb in proc.stdout, (verb, proc.stderr[-500:])


def test_inspect_prints_the_config_and_every_tensor_type(hybrid_gguf):
    proc = run_cli("inspect", str(hybrid_gguf))
    assert proc.returncode == 0, proc.stderr
    assert "4 layers (3 Gated DeltaNet, 1 gated attention: [3])" in proc.stdout
    assert "blk.0.ssm_conv1d.weight" in proc.stdout and "F32" in proc.stdout


def test_a_seed_reproduces_a_sampled_generation(hybrid_model):
    ids = hybrid_model.tokenizer.encode("Once upon a time")
    kw = dict(max_tokens=30, temperature=0.9, top_k=50, top_p=0.95, min_p=0.01, seed=1234)
    a = hybrid_model.generate(ids, **kw).tokens
    b = hybrid_model.generate(ids, **kw).tokens
    c = hybrid_model.generate(ids, **dict(kw, seed=99)).tokens
    assert a == b and a != c


def test_top_k_one_is_greedy_and_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, 3.0])
    assert Sampler(SamplingParams(temperature=1.0, top_k=1, seed=0))(logits, [], []) == 4
    probs = torch.softmax(logits, -1)
    # the top two (ids 4, 0) hold more than 0.8 of the mass: only they may come out
    assert probs[4] + probs[0] > 0.8
    seen = {Sampler(SamplingParams(temperature=1.0, top_p=0.8, seed=s))(logits, [], []) for s in range(200)}
    assert seen == {0, 4}
    seen = {Sampler(SamplingParams(temperature=1.0, min_p=0.3, seed=s))(logits, [], []) for s in range(200)}
    assert seen == {0, 4}  # p(0) / p(4) = e^-1 = 0.37 stays; p(1) / p(4) = e^-2 = 0.14 falls under 0.3


def test_greedy_takes_argmax_s_token_the_first_of_equal_best_and_a_nan_as_argmax_does():
    g = torch.Generator().manual_seed(3)
    for row in (torch.randn(248320, generator=g), torch.tensor([1.0, 5.0, 2.0, 5.0]),
                torch.tensor([1.0, float("nan"), 7.0, float("nan")]), torch.full((9,), -3.0)):
        want = int(torch.argmax(row))
        assert Sampler(SamplingParams())(row, [], []) == want
        assert Sampler(SamplingParams())(row[None, :], [], []) == want  # a batch's [1, V] row
        # the penalised path (its row copied, nothing seen, so nothing changed) picks the same way
        assert Sampler(SamplingParams(repetition_penalty=1.5))(row.clone(), [], []) == want


def test_repetition_penalty_follows_the_hf_rule():
    logits = torch.tensor([2.0, 1.9, -1.0])
    # id 0 seen: 2.0 / 1.5 = 1.33 < 1.9, so greedy picks id 1
    assert Sampler(SamplingParams(repetition_penalty=1.5))(logits, [0], []) == 1
    assert Sampler(SamplingParams())(logits, [0], []) == 0


def test_invalid_sampling_parameters_are_refused_by_name():
    with pytest.raises(DeltaserveError, match="top_p"):
        SamplingParams(top_p=1.5)


def test_a_vanishing_temperature_or_top_p_samples_the_most_likely_token_not_nan():
    """Issue 32, item 6: temperature 1e-38 and top_p 5e-324 sampled "probability tensor contains inf/nan" (a 500
    with the exception's text sent to the client)."""
    logits = torch.randn(248_320, generator=torch.Generator().manual_seed(3))
    best = int(logits.argmax())
    for params in (SamplingParams(temperature=1e-38), SamplingParams(temperature=5e-324),
                   SamplingParams(temperature=1.0, top_p=5e-324), SamplingParams(temperature=1e-38, top_p=5e-324),
                   SamplingParams(temperature=1e-30, top_k=5, min_p=1.0)):
        assert [Sampler(params)(logits, [1, 2], []) for _ in range(3)] == [best] * 3, params
