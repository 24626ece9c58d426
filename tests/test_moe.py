"""The MoE sibling (qwen35moe, issue 29) computes what transformers' Qwen3_5MoeForCausalLM computes, from the HF
directory and from GGUF files (ours and llama.cpp's converter's), chooses the same experts, reads only the chosen
experts in the native decode, stays as close to f32 as llama.cpp on llama-quantize's Q8_0 and Q4_K_M, and holds the
session's contract (suffix-only prefill, the state store across a restart, serve with two slots).

The fixture (tests/fixtures/models.py "moe"): 16 experts, 4 a token, a shared expert, layers [DeltaNet, attention,
DeltaNet, DeltaNet, attention], an untied head, widths of 256 (so llama-quantize's K-quants take every tensor).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import openai
import pytest
import torch
import torch.nn.functional as F

import deltaserve
from deltaserve.engine import layers as L
from deltaserve.engine.forward import Forward
from deltaserve.formats.gguf import read_gguf
from deltaserve.frontends.cli import main as cli
from tests import llama_oracle as oracle
from tests.fixtures import models as fx
from tests.server_proc import ServerProcess

TOL = 2e-3
NAME = "moe"


@functools.lru_cache(maxsize=None)
def oracle_model():
    return fx.load_hf_model(NAME)


@functools.lru_cache(maxsize=None)
def ours(source: str):
    path = fx.hf_dir(NAME) if source == "hf" else fx.gguf_path(NAME, source)
    return deltaserve.load(path)


def prompt(length: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(77 + seed)
    return torch.randint(0, ours("hf").tokenizer.vocab_size, (length,), generator=g).tolist()


@functools.lru_cache(maxsize=None)
def reference_logits(length: int) -> torch.Tensor:
    with torch.no_grad():
        return oracle_model()(input_ids=torch.tensor([prompt(length)])).logits[0].float()


def assert_matches(got: torch.Tensor, want: torch.Tensor, tol: float = TOL) -> None:
    diff = (got - want).abs().max().item()
    assert diff <= tol, f"max |logit difference| {diff:.2e} > {tol}"
    assert torch.equal(got.argmax(-1), want.argmax(-1)), "argmax differs"


@functools.lru_cache(maxsize=None)
def by_llama_quantize(ftype: str):
    """Our f32 GGUF of the fixture quantized by llama.cpp's own llama-quantize (in a child process)."""
    oracle.require()
    src = fx.gguf_path(NAME, "f32")
    out = src.with_name(f"model-{ftype}-by-llama.cpp.gguf")
    if not out.exists():
        tmp = out.with_suffix(".part")
        assert oracle.quantize(src, tmp, ftype) == 0
        tmp.replace(out)
    return out


def decode_all(model, ids: list[int], one_call: bool = True) -> torch.Tensor:
    f = Forward(model.config, model.host.weights, one_call=one_call)
    st = f.new_state(len(ids) + 1)
    return torch.stack([f.decode(st, t) for t in ids])


# -- the forward against transformers ----------------------------------------------------------------------------

def test_the_fixture_is_an_moe_model_with_an_irregular_layer_pattern_and_spread_logits():
    c = ours("hf").config
    assert (c.arch, c.num_experts, c.num_experts_per_tok, c.is_moe) == ("qwen35moe", 16, 4, True)
    assert c.attention_layers == (1, 4) and not c.tie_word_embeddings
    assert 0.3 < reference_logits(150).std().item() < 1.5


@pytest.mark.parametrize("source", ["hf", "f32"])
@pytest.mark.parametrize("length", [1, 65, 150])
def test_one_prefill_matches_transformers(source, length):
    assert_matches(ours(source).logits(prompt(length)), reference_logits(length))


@pytest.mark.parametrize("source", ["hf", "f32"])
def test_token_by_token_decode_matches_transformers(source):
    assert_matches(decode_all(ours(source), prompt(40)), reference_logits(40)[:40])


def test_the_experts_chosen_for_every_token_are_those_transformers_chooses(monkeypatch):
    """Every layer's top 4 of 16 for every token, against transformers' router (ties aside: a differing choice is
    allowed only where the two probabilities it swaps are within 1e-5)."""
    theirs, mine = [], []
    router = type(oracle_model().model.layers[0].mlp.gate)
    original = router.forward

    def record_theirs(self, hidden):
        logits, scores, indices = original(self, hidden)
        theirs.append((torch.softmax(logits.float(), -1), indices))
        return logits, scores, indices

    monkeypatch.setattr(router, "forward", record_theirs)
    reference = L.route

    def record_mine(x, router_linear, top_k):
        weights, experts = reference(x, router_linear, top_k)
        mine.append(experts)
        return weights, experts

    monkeypatch.setattr(L, "route", record_mine)
    ids = prompt(120, seed=3)
    with torch.no_grad():
        oracle_model()(input_ids=torch.tensor([ids]))
    ours("f32").logits(ids)
    assert len(theirs) == len(mine) == ours("f32").config.num_layers
    for layer, ((probs, want), got) in enumerate(zip(theirs, mine)):
        for t in range(len(ids)):
            a, b = set(want[t].tolist()), set(got[t].tolist())
            if a != b:
                kth = probs[t].sort(descending=True).values
                assert (kth[3] - kth[4]).abs().item() < 1e-5, (layer, t, sorted(a), sorted(b))


def test_experts_stored_one_tensor_each_under_the_multimodal_prefix_load_the_same_model(tmp_path):
    """The same weights as transformers' fused experts, written as one tensor per expert
    (`model.language_model.layers.N.mlp.experts.E.gate_proj.weight`) under Qwen3_5MoeForConditionalGeneration's
    prefix: the logits are the fused directory's."""
    from safetensors.torch import load_file, save_file

    src = fx.hf_dir(NAME)
    tensors = load_file(src / "model.safetensors")
    out = {}
    for name, t in tensors.items():
        new = name if name == "lm_head.weight" else name.replace("model.", "model.language_model.", 1)
        if name.endswith("mlp.experts.gate_up_proj"):
            ff = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[new.replace("gate_up_proj", f"{e}.gate_proj.weight")] = t[e, :ff].contiguous()
                out[new.replace("gate_up_proj", f"{e}.up_proj.weight")] = t[e, ff:].contiguous()
        elif name.endswith("mlp.experts.down_proj"):
            for e in range(t.shape[0]):
                out[new.replace("down_proj", f"{e}.down_proj.weight")] = t[e].contiguous()
        else:
            out[new] = t
    d = tmp_path / "per-expert"
    d.mkdir()
    save_file(out, d / "model.safetensors")
    text = json.loads((src / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({"architectures": ["Qwen3_5MoeForConditionalGeneration"],
                                               "model_type": "qwen3_5_moe", "text_config": text,
                                               "tie_word_embeddings": False}))
    for f in src.iterdir():
        if f.name not in ("config.json", "model.safetensors") and f.is_file():
            shutil.copy(f, d / f.name)
    ids = prompt(65)
    got = deltaserve.load(d, cache=False).logits(ids)
    assert (got - ours("hf").logits(ids)).abs().max().item() <= 1e-5
    assert_matches(got, reference_logits(65))


# -- GGUF: our converter, llama.cpp's converter, llama.cpp itself --------------------------------------------------

def test_our_converter_writes_llama_cpps_moe_tensors_and_metadata():
    f = read_gguf(fx.gguf_path(NAME, "f32"))
    assert f.arch == "qwen35moe"
    m = f.metadata
    assert (m["qwen35moe.expert_count"], m["qwen35moe.expert_used_count"], m["qwen35moe.expert_feed_forward_length"],
            m["qwen35moe.expert_shared_feed_forward_length"]) == (16, 4, 256, 256)
    t = f.tensors
    assert t["blk.0.ffn_gate_exps.weight"].shape == t["blk.0.ffn_up_exps.weight"].shape == (16, 256, 256)
    assert t["blk.0.ffn_down_exps.weight"].shape == (16, 256, 256)
    assert t["blk.0.ffn_gate_inp.weight"].shape == (16, 256) and t["blk.0.ffn_gate_inp.weight"].qtype.name == "F32"
    assert t["blk.0.ffn_gate_inp_shexp.weight"].qtype.name == "F32"
    assert "blk.0.ffn_gate.weight" not in t and "blk.0.ffn_gate_shexp.weight" in t
    q8 = read_gguf(fx.gguf_path(NAME, "q8_0")).tensors
    assert q8["blk.0.ffn_gate_exps.weight"].qtype.name == "Q8_0" and q8["blk.0.ffn_gate_inp.weight"].qtype.name == "F32"


def route_margins(model, ids: list[int], monkeypatch) -> torch.Tensor:
    """Per position, the smallest gap over the layers between the k-th and the (k+1)-th router probability: where it
    is within an engine's f32 rounding (1e-4), two engines may choose differently, and the recurrent state carries
    the difference to every later position."""
    gaps = []
    reference = L.route

    def record(x, router_linear, top_k):
        p = torch.softmax(router_linear(x).float(), -1).sort(-1, descending=True).values
        gaps.append(p[:, top_k - 1] - p[:, top_k])
        return reference(x, router_linear, top_k)

    monkeypatch.setattr(L, "route", record)
    logits = model.logits(ids)
    monkeypatch.undo()
    return torch.stack(gaps).min(0).values, logits


def test_llama_cpp_reads_our_moe_file_and_agrees_up_to_the_first_router_tie(monkeypatch):
    oracle.require()
    path = fx.gguf_path(NAME, "f32")
    ids = prompt(100, seed=5)
    gaps, mine = route_margins(ours("f32"), ids, monkeypatch)
    theirs = torch.from_numpy(oracle.logits(path, ids, n_ctx=256, n_batch=256))[:, :mine.shape[1]]
    ties = (gaps < 1e-4).nonzero().flatten().tolist()
    cut = ties[0] if ties else len(ids)
    assert cut >= 15, f"a router tie at position {cut}: choose another prompt"
    assert_matches(mine[:cut], theirs[:cut])


@functools.lru_cache(maxsize=None)
def converted_by_llama_cpp():
    """A small random MoE model with the real vocabulary (llama.cpp's converter recognises the pre-tokenizer by
    hashing a tokenization) converted by llama.cpp's own convert_hf_to_gguf.py; the HF directory beside it."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    from tests.fixtures.tokenizers import real_qwen35_tokenizer, save_hf_tokenizer
    from tests.test_gguf_conformance import llama_cpp_converter, llama_cpp_python_version

    script = llama_cpp_converter()
    layer_types = ["full_attention", "linear_attention", "linear_attention", "full_attention"]
    spec = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                linear_num_key_heads=2, linear_key_head_dim=16, linear_num_value_heads=4, linear_value_head_dim=16,
                max_position_embeddings=4096, tie_word_embeddings=False, num_experts=16, num_experts_per_tok=4,
                moe_intermediate_size=32, shared_expert_intermediate_size=48, layer_types=layer_types)
    root = fx.fixtures_dir() / ("moe-by-llama.cpp-" + fx.hashlib.sha256(json.dumps(
        [fx.FIXTURE_VERSION, spec, llama_cpp_python_version()], sort_keys=True).encode()).hexdigest()[:10])
    hf, out = root / "hf", root / "by-llama.cpp-f32.gguf"
    if out.exists():
        return hf, out
    with fx._locked(out):
        if not out.exists():
            tok = real_qwen35_tokenizer()
            vocab = -(-tok.get_vocab_size(with_added_tokens=True) // 64) * 64 + 64
            cfg = Qwen3_5MoeTextConfig(**spec, vocab_size=vocab, eos_token_id=tok.token_to_id("<|im_end|>"),
                                       pad_token_id=tok.token_to_id("<|endoftext|>"),
                                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                        "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 2],
                                                        "mrope_interleaved": True})
            torch.manual_seed(61)
            model = Qwen3_5MoeForCausalLM(cfg).eval()
            fx._randomize(model, 61, False)
            model.save_pretrained(hf)
            save_hf_tokenizer(tok, hf, fx.chat_template())
            part = out.with_suffix(".part")
            env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
            proc = subprocess.run([sys.executable, str(script), str(hf), "--outfile", str(part), "--outtype", "f32",
                                   "--no-mtp"], capture_output=True, text=True, timeout=900, env=env,
                                  cwd=script.parent)
            assert proc.returncode == 0 and part.exists(), (proc.stdout + proc.stderr)[-4000:]
            os.replace(part, out)
    return hf, out


def test_a_file_from_llama_cpps_converter_loads_and_matches_transformers():
    from transformers import AutoModelForCausalLM

    hf, path = converted_by_llama_cpp()
    model = deltaserve.load(path, cache=False)
    assert model.config.arch == "qwen35moe" and model.config.attention_layers == (0, 3)
    ids = torch.randint(0, 248_044, (70,), generator=torch.Generator().manual_seed(9)).tolist()
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()(
            input_ids=torch.tensor([ids])).logits[0].float()
    assert_matches(model.logits(ids), want)
    assert_matches(decode_all(model, ids[:20]), want[:20])


@pytest.mark.parametrize("ftype", ["Q8_0", "Q4_K_M"])
def test_llama_quantizes_files_are_no_farther_from_f32_than_llama_cpp_on_the_same_files(ftype):
    """Mean |logit - transformers' f32| of a prefill and of a token-by-token decode, ours against llama.cpp's on the
    file llama-quantize made (Q4_K_M: Q4_K experts, Q6_K down projections in some layers)."""
    path = by_llama_quantize(ftype)
    m = deltaserve.load(path, cache=False)
    types = {t.name: t.type for t in m.host.tensor_summary}
    assert types["blk.0.ffn_gate_exps.weight"] == ("Q8_0" if ftype == "Q8_0" else "Q4_K")
    assert m.session(quiet=True).notices[-1].count("one native call per decoded token") == 1
    ids = prompt(100, seed=11)
    with torch.no_grad():
        want = oracle_model()(input_ids=torch.tensor([ids])).logits[0].float()
    for n_batch, mine in ((256, m.logits(ids)), (1, decode_all(m, ids))):
        theirs = torch.from_numpy(oracle.logits(path, ids, n_ctx=256, n_batch=n_batch))[:, :mine.shape[1]]
        d_mine, d_theirs = (mine - want).abs().mean().item(), (theirs - want).abs().mean().item()
        assert d_mine <= 1.1 * d_theirs, (ftype, n_batch, d_mine, d_theirs)


# -- the native decode --------------------------------------------------------------------------------------------

def test_a_prefill_runs_each_layers_routed_experts_in_one_native_call(monkeypatch):
    """Every MoE layer's experts of a prefill chunk in one call of moe.c's grouped products (ds_moe_experts), each
    pair (token, expert) once, the call also summing each token's choices (its `y`), the layers' pair buffers one
    (reused from layer to layer, not made anew)."""
    from deltaserve.kernels import native

    m = deltaserve.load(by_llama_quantize("Q4_K_M"), cache=False)
    calls, real = [], native.moe_experts

    def spy(experts, hidden, uniq, first, count, x, rows, weights, out, slot=None, y=None, ws=None):
        calls.append((int(count.sum()), int(uniq.numel()), x.shape[0], None if y is None else tuple(y.shape),
                      out.data_ptr(), None if ws is None else ws.data_ptr()))
        return real(experts, hidden, uniq, first, count, x, rows, weights, out, slot, y, ws)

    monkeypatch.setattr(native, "moe_experts", spy)
    m.logits(prompt(100, seed=6))
    c = m.config
    assert [call[:4] for call in calls] == [(100 * c.num_experts_per_tok, calls[i][1], 100, (100, c.hidden_size))
                                            for i in range(c.num_layers)]
    assert all(0 < call[1] <= c.num_experts for call in calls)
    assert len({call[4] for call in calls}) == 1 and len({call[5] for call in calls}) == 1, calls


def test_the_one_call_decode_is_the_torch_decode_to_rounding_ties_and_a_batch_is_each_sequence_alone():
    """Both routes run products.c's products on the same blocks; they part only where an activation sits within float
    noise of an int8 rounding tie (then the recurrent state carries the step on), as for the dense models
    (tests/test_native_avx2.py): far below the file's own error, the same argmax nearly everywhere."""
    m = deltaserve.load(by_llama_quantize("Q4_K_M"), cache=False)
    ids = prompt(48, seed=2)
    native, torch_ops = decode_all(m, ids), decode_all(m, ids, one_call=False)
    with torch.no_grad():
        want = oracle_model()(input_ids=torch.tensor([ids])).logits[0].float()
    own = (torch_ops - want).abs().mean().item()
    assert (native - torch_ops).abs().mean().item() <= 0.1 * own
    assert (native.argmax(-1) == torch_ops.argmax(-1)).float().mean().item() >= 0.97
    f = Forward(m.config, m.host.weights)
    assert f.token_program()[1].startswith("one native call per decoded token")
    trio = [f.new_state(16) for _ in range(3)]
    for j, st in enumerate(trio):  # three sequences at different positions
        f.prefill(st, ids[:3 + 2 * j])
    nxt = [ids[10], ids[11], ids[12]]
    batched = f.decode_batch(trio, nxt)
    for j in range(3):
        st = f.new_state(16)
        f.prefill(st, ids[:3 + 2 * j])
        assert torch.allclose(batched[j], f.decode(st, nxt[j]), rtol=1e-5, atol=1e-5), j


def test_an_expert_the_router_did_not_choose_is_never_read_by_the_native_decode(tmp_path, monkeypatch):
    """Every expert a token's route leaves out, in every layer, NaN'd in a copy of the file: the one-call decode of
    that token gives the same logits as on the intact file (a NaN read anywhere would reach them)."""
    src = by_llama_quantize("Q8_0")
    ids = prompt(6, seed=4)
    chosen: list[set] = []
    reference = L.route

    def record(x, router_linear, top_k):
        weights, experts = reference(x, router_linear, top_k)
        chosen.append(set(experts[-1].tolist()))
        return weights, experts

    intact = deltaserve.load(src, cache=False)
    f = Forward(intact.config, intact.host.weights, one_call=False)
    st = f.new_state(8)
    f.prefill(st, ids[:-1])
    monkeypatch.setattr(L, "route", record)
    f.decode(st, ids[-1])  # the torch decode: each layer's route of the last token
    monkeypatch.undo()
    assert len(chosen) == intact.config.num_layers
    copy = tmp_path / "unchosen-nan.gguf"
    shutil.copy(src, copy)
    gguf = read_gguf(copy)
    offsets = {}
    base = np.frombuffer(gguf.buf, np.uint8, 1).__array_interface__["data"][0]
    for name, t in gguf.tensors.items():
        offsets[name] = (t.data.__array_interface__["data"][0] - base, t.shape, t.nbytes)
    del gguf
    raw = np.memmap(copy, dtype=np.uint8, mode="r+")
    nan_f16 = np.array([0x7E00], dtype=np.uint16).view(np.uint8)
    for layer, keep in enumerate(chosen):
        for proj in ("gate", "up", "down"):
            at, shape, nbytes = offsets[f"blk.{layer}.ffn_{proj}_exps.weight"]
            per_expert = nbytes // shape[0]
            for e in range(shape[0]):
                if e in keep:
                    continue
                blocks = raw[at + e * per_expert: at + (e + 1) * per_expert].reshape(-1, 34)
                blocks[:, :2] = nan_f16  # every Q8_0 block's scale
    raw.flush()
    del raw

    def last_logits(path):  # the earlier tokens prefilled on the intact file, the last one decoded on `path`'s
        m = deltaserve.load(path, cache=False)
        g = Forward(m.config, m.host.weights)
        s = g.new_state(8)
        Forward(intact.config, intact.host.weights).prefill(s, ids[:-1])
        return g.decode(s, ids[-1]), g.token_program()[1]

    want, _ = last_logits(src)
    got, route = last_logits(copy)
    assert route.startswith("one native call per decoded token")
    assert torch.isfinite(got).all() and torch.equal(got, want)


# -- the session's contract and the server -------------------------------------------------------------------------

def chat_turn(session, history: list[dict], text: str, max_tokens: int = 8):
    history.append({"role": "user", "content": text})
    turn = session.chat(history, max_tokens=max_tokens, temperature=0, enable_thinking=False)
    history.append({"role": "assistant", "content": turn.text})
    return turn


def test_an_moe_conversation_prefills_only_its_new_turns_and_resumes_from_the_store_after_a_restart(tmp_path):
    """On the f32 file, whose products are exact whatever rows a call takes, so that a resumed turn's tokens are
    compared with a fresh prefill's exactly (on quantized blocks a suffix of a few rows and a whole prompt take
    different products, tiles and the GEMM, as on the dense models)."""
    from deltaserve.session.store import StateStore

    model = ours("f32")

    def store():
        return StateStore(model.config, ram_bytes=64 << 20, directory=tmp_path, disk_bytes=64 << 20,
                          model_sha256=model.host.sha256())

    first = store()
    s = model.session(quiet=True, store=first)
    history: list[dict] = []
    chat_turn(s, history, "one two three")
    prompt_before = model.render(history[:-1], False)[0]
    turn = chat_turn(s, history, "four five six")
    whole = model.render(history[:-1], False)[0]
    checkpoint = max(i for i, t in enumerate(prompt_before) if t == model.tokenizer.im_start_id)
    assert turn.reused >= checkpoint and turn.prefilled == len(whole) - turn.reused  # before its generation header
    assert turn.tokens == model.generate(whole, max_tokens=8).tokens
    assert first.flush()
    first.close()

    restarted = store()  # a new process sees only the directory
    s2 = model.session(quiet=True, store=restarted)
    turn = chat_turn(s2, history, "seven eight")
    whole = model.render(history[:-1], False)[0]
    assert turn.start == "store" and turn.reused > 0 and turn.prefilled == len(whole) - turn.reused
    assert turn.tokens == model.generate(whole, max_tokens=8).tokens


def test_serve_answers_two_moe_conversations_at_once_as_each_alone_and_says_the_route(tmp_path):
    import threading

    path = by_llama_quantize("Q4_K_M")
    model = deltaserve.load(path, cache=False)
    histories = {c: [{"role": "user", "content": f"conversation {c} starts here"}] for c in range(2)}
    with ServerProcess(path, "--slots", "2", "--state-dir", str(tmp_path)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        answers: dict = {}

        def ask(c):
            r = client.chat.completions.create(model=path.stem, messages=histories[c], max_tokens=10, temperature=0)
            answers[c] = (r.choices[0].message.content, r.usage)

        threads = [threading.Thread(target=ask, args=(c,)) for c in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for c in range(2):
            alone = model.session(quiet=True).chat(histories[c], max_tokens=10, temperature=0)
            assert answers[c][0] == alone.text, c
        assert "qwen35moe hybrid MoE" in server.stderr and "4 of 16 experts" in server.stderr
        histories[0] += [{"role": "assistant", "content": answers[0][0]}, {"role": "user", "content": "and then?"}]
        r = client.chat.completions.create(model=path.stem, messages=histories[0], max_tokens=10, temperature=0)
        assert r.usage.prompt_tokens_details.cached_tokens > 0


def test_inspect_shows_the_experts_and_the_weights_a_token_reads(capsys):
    import re

    assert cli(["inspect", str(by_llama_quantize("Q4_K_M")), "--ctx", "4096"]) == 0
    out = capsys.readouterr().out
    assert "arch: qwen35moe" in out and "experts: 16 routed experts of 256" in out and "4 a token" in out
    read, total = (float(v) for v in re.search(r"weights read per token: ([\d.]+) MiB of the ([\d.]+) MiB", out).groups())
    # the oracle, from the file's tensors as gguf reads them: every tensor, less the 12 of 16 experts a token skips
    # and all of the (untied) embedding table but the token's row
    import gguf

    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(str(by_llama_quantize("Q4_K_M"))).tensors}
    assert "output.weight" in tensors
    want = sum(tensors.values()) - sum(n * 12 // 16 for name, n in tensors.items() if "_exps" in name)
    vocab = deltaserve.load(by_llama_quantize("Q4_K_M"), cache=False).config.vocab_size
    want -= tensors["token_embd.weight"] - tensors["token_embd.weight"] // vocab
    assert abs(read - want / (1 << 20)) < 0.06 and abs(total - sum(tensors.values()) / (1 << 20)) < 0.06
    assert "capacity plan for 4096 positions: fits" in out


@pytest.mark.parametrize("weights", ["exact", "tables"])
def test_the_gathered_experts_a_device_decodes_with_compute_the_moe_block(weights):
    """A device's decode step gathers each (row, expert) pair's weights by index (no host synchronisation, so that a
    CUDA graph records it: layers.moe_gathered). Checked here on the CPU with what a device holds (dense weights, or
    int8 tables) against the routed experts written out in float64 from the same weights."""
    m = deltaserve.load(fx.gguf_path(NAME, "q8_0"), weights=weights, cache=False)
    lw = m.host.weights.layers[2]
    x = torch.randn(3, m.config.hidden_size, generator=torch.Generator().manual_seed(8))
    weights_, experts = L.route(x, lw.moe.router, lw.moe.top_k)

    def swiglu(gate_up, down, v):
        gate, up = gate_up.dense().double().split(gate_up.sizes)
        return down.dense().double() @ (F.silu(gate @ v) * (up @ v))

    shared = L.mlp(x, lw.gate_up, lw.down).double()  # the shared expert: the MLP's own products
    want = torch.stack([sum(w * swiglu(*lw.moe.expert(int(e)), x[t].double()) for w, e in zip(weights_[t], experts[t]))
                        + torch.sigmoid(x[t].double() @ lw.moe.shared_gate.double()) * shared[t] for t in range(3)])
    got = L.moe_gathered(x, lw.moe, lw.gate_up, lw.down).double()
    assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()


# -- bench moe's decode floor ------------------------------------------------------------------------------------

def test_the_decode_floor_counts_each_layers_weights_with_the_routed_experts_at_top_k_of_n_plus_its_state():
    """bench moe's floor (the bytes a decoded token must read, from the file alone) on the fixture's f32 GGUF,
    against transformers' parameter counts: per layer its parameters x 4 bytes with the routed experts' at 4 of 16,
    plus a DeltaNet layer's f32 state and conv window read and written, or an attention layer's f16 K and V up to
    the position; the head (untied here) and the final norm fixed, the embedding not."""
    from tools.bench.moe import decode_floor

    model, position = oracle_model(), 100
    cfg = model.config
    floor = decode_floor(fx.gguf_path(NAME, "f32"), position)
    share = cfg.num_experts_per_tok / cfg.num_experts
    conv_channels = (2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim
                     + cfg.linear_num_value_heads * cfg.linear_value_head_dim)
    state = 2 * 4 * (cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
                     + (cfg.linear_conv_kernel_dim - 1) * conv_channels)
    kv = 2 * 2 * cfg.num_key_value_heads * cfg.head_dim * position
    assert len(floor["layers"]) == cfg.num_hidden_layers
    for i, layer in enumerate(model.model.layers):
        params = sum(p.numel() * (share if ".experts." in name else 1.0) for name, p in layer.named_parameters())
        extra = state if cfg.layer_types[i] == "linear_attention" else kv
        assert floor["layers"][i] == pytest.approx(4 * params + extra, rel=1e-9), i
    assert floor["fixed"] == 4 * (model.lm_head.weight.numel() + model.model.norm.weight.numel())


def test_bench_moe_sets_its_floor_by_the_highest_bandwidth_and_gives_each_rounds_own_ratio(tmp_path):
    from tools.bench import moe
    from tools.bench.peers import median

    def engine(pp: tuple, tg: tuple) -> dict:
        runs = [{"load_s": 1.0, "pp": p, "tg": t, "peak_rss": 1 << 30, "route": "r"} for p, t in zip(pp, tg)]
        return {"load_s": 1.0, "pp": median(pp), "tg": median(tg), "peak_rss": 1 << 30, "runs": runs}

    # round 2 of llama.cpp ran on a slower host: its own ratio stands apart from the others
    rows = [{"kind": "Q4_K_M", "layers": 4, "file_bytes": 1 << 31, "llama.cpp": engine((100, 100), (20, 20)),
             "deltaserve": engine((300, 300), (30, 30))},
            {"kind": "Q4_K_M", "layers": 8, "file_bytes": 1 << 32, "llama.cpp": engine((50, 50), (10, 8)),
             "deltaserve": engine((150, 150), (15, 15))}]
    r = {"command": "deltaserve bench moe", "threads": 2, "cpu": "x", "pp": 512, "tg": 128, "shape": "35B-A3B",
         "layers": [4, 8], "full_layers": 40, "date": "d", "rows": rows, "read_bandwidth_runs": [20e9, 25e9, 22e9],
         "decode_bytes": {"Q4_K_M": {"layers": [40e6] * 4, "fixed": 400e6}}}
    r["full"] = {"Q4_K_M": {e: {w: moe.extrapolate({row["layers"]: row[e][w] for row in rows}) for w in ("pp", "tg")}
                            for e in ("llama.cpp", "deltaserve")}}
    r["rounds"] = {"Q4_K_M": {w: [d / l for d, l in zip(moe.per_round(rows, "deltaserve", w),
                                                         moe.per_round(rows, "llama.cpp", w))] for w in ("pp", "tg")}}
    r["floor"] = moe.ceilings(r)
    f = r["floor"]["Q4_K_M"]
    assert f["read_bandwidth"] == 25e9 and f["per_layer_ms"] == pytest.approx(1.6)  # 40 MB at 25 GB/s
    # llama.cpp (medians 20 and 9 tok/s): 1/9 - 1/20 s over 4 layers, at 40 layers 0.6 s a token. The floor: 16 ms
    # fixed + 40 x 1.6 = 80 ms, 12.5 tok/s: 7.5x llama.cpp's is the most any engine could show here
    assert f["full"] == pytest.approx(12.5) and f["ratio_ceiling"] == pytest.approx(7.5)
    assert f["of_floor"]["deltaserve"] == pytest.approx(1.6 / (1e3 * (1 / 15 - 1 / 30) / 4))
    # each round's own 40-layer ratio: round 2's llama.cpp decode at 8 layers was slower
    tg = r["rounds"]["Q4_K_M"]["tg"]
    assert tg[0] == pytest.approx(1.5) and tg[1] > tg[0]  # 3 tok/s at 40 layers against 2, then against less
    text = moe.write_report(r, tmp_path).read_text()
    assert "25.0 GB/s, the highest of 3 measurements in the run (20.0-25.0 GB/s)" in text
    assert "| Q4_K_M | 38.1 | 381 | 1.60 | 9.55x | 5.21x | 12.50 | 7.50x |" in text
    assert "tg 1.50x, " in text


def test_bench_moe_takes_peak_rss_and_load_to_the_full_layers_as_it_takes_the_files_size(tmp_path):
    """A process's peak RSS is the file it maps plus what it allocates (a fixed ~400 MiB): 1.20x a 2 GiB 4-layer
    file, ~1.02x at 40 layers, where the file is 20 GiB; load time likewise by the line through the two counts."""
    from tools.bench import moe

    def engine(load: float, rss_mib: int) -> dict:
        return {"load_s": load, "pp": 100.0, "tg": 10.0, "peak_rss": rss_mib << 20, "runs": []}

    rows = [{"kind": "Q4_K_M", "layers": 4, "file_bytes": 2 << 30, "llama.cpp": engine(2.0, 3500),
             "deltaserve": engine(0.1, 2048 + 400)},
            {"kind": "Q4_K_M", "layers": 8, "file_bytes": 4 << 30, "llama.cpp": engine(4.0, 7000),
             "deltaserve": engine(0.1, 4096 + 400)}]
    ours, theirs = moe.memory_at_full(rows, "deltaserve"), moe.memory_at_full(rows, "llama.cpp")
    assert ours["file_bytes"] == 20 << 30 and ours["peak_rss"] == (20480 + 400) << 20
    assert ours["rss_over_file"] == pytest.approx(20880 / 20480) and ours["load_s"] == pytest.approx(0.1)
    assert theirs["peak_rss"] == 35000 << 20 and theirs["load_s"] == pytest.approx(20.0)
    r = {"command": "c", "threads": 2, "cpu": "x", "pp": 512, "tg": 128, "shape": "35B-A3B", "layers": [4, 8],
         "full_layers": 40, "date": "d", "rows": rows,
         "full": {"Q4_K_M": {e: {"pp": moe.extrapolate({4: 100.0, 8: 50.0}), "tg": moe.extrapolate({4: 10.0, 8: 5.0}),
                                 "memory": moe.memory_at_full(rows, e)} for e in ("llama.cpp", "deltaserve")}}}
    text = moe.write_report(r, tmp_path).read_text()
    assert "| Q4_K_M | deltaserve | 20480 MiB | 20880 MiB | 1.02x | 0.10 | 0.01x |" in text
    assert "| Q4_K_M | llama.cpp | 20480 MiB | 35000 MiB | 1.71x | 20.00 | 1.00x |" in text
