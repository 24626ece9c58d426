"""`deltaserve run | chat | serve | convert | inspect | bench | pull | list | rm | kernels`.

Every error a user can cause prints one line and exits non-zero; a traceback only with DELTASERVE_DEBUG=1.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from pathlib import Path

from deltaserve.api import MAX_AGE as GUARD_MAX_AGE
from deltaserve.api import __version__
from deltaserve.api import DEFAULT_KV_TYPE, KV_TYPES
from deltaserve.api import plural
from deltaserve.errors import DeltaserveError
from deltaserve.session.turns import ask
from deltaserve.frontends.common import (load_model, loop_guard, resolve_model, sampling_kwargs, thinking,
                                         thinking_kwargs, thought_words)
from deltaserve.frontends import kernels, models
from deltaserve.api import settings


def positive_int(text: str) -> int:
    """argparse type: a whole number of at least 1 (a usage error, not a silent fallback, otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a number of seconds over 0 (a usage error, not a silent fallback, otherwise)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number over 0, got {text}")
    return value


def budget_arg(text: str) -> int:
    """argparse type: a thinking budget in tokens (-1: unlimited, 0: thinking off)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of tokens, got {text!r}") from None
    if value < -1:
        raise argparse.ArgumentTypeError(f"must be -1 (unlimited), 0 (thinking off) or more, got {value}")
    return value


def size_arg(text: str) -> int:
    """argparse type: a size in bytes, with an optional K/M/G/T suffix (powers of 1024)."""
    from deltaserve.api import parse_size

    try:
        return parse_size(text)
    except DeltaserveError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


MODEL_HELP = ("a Qwen3.5 GGUF file (a split one's first part) or HF directory, or a Hugging Face Hub repository "
              "OWNER/REPO[:QUANT], downloaded into its cache (see `deltaserve pull -h`)")


def _add_model(p: argparse.ArgumentParser, required: bool = False) -> None:
    if required:
        p.add_argument("model", help=MODEL_HELP)
    else:
        p.add_argument("model", nargs="?", default=None, help=MODEL_HELP + " (default: the embedded demo model)")


def _add_kv_type(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-type", choices=list(KV_TYPES), default=DEFAULT_KV_TYPE,
                   help=f"the attention layers' KV cache type (default {DEFAULT_KV_TYPE}; f32 is exact at twice the "
                        "bytes of f16 and bf16; q8_0, llama.cpp's blocks of 32 int8 values and an f16 scale, takes "
                        "34/64 of f16's)")


def _add_runtime(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto",
                   help="auto (CUDA when visible, else CPU), cpu, cuda, cuda:N (faulty[:STAGE] is a test device)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="CPU threads (default: 1 for a model too small to split, else the cores this process may use)")
    p.add_argument("--ctx", type=positive_int, default=None,
                   help="context positions to allow (default and most: the model's declared context)")
    p.add_argument("--mtp", type=int, default=None, metavar="N",
                   help="speculative decoding with the file's MTP block: at most N draft tokens a step (default: on, "
                        "adaptive, where the file carries one; 0: off)")
    p.add_argument("--draft", default=None, metavar="FILE",
                   help="the model's MTP block in a file of its own (mtp-*.gguf, llama.cpp's converter with --mtp)")
    p.add_argument("--mmproj", default=None, metavar="FILE",
                   help="the vision encoder of a GGUF model: llama.cpp's projector file (mmproj-*.gguf, its converter "
                        "with --mmproj); an HF directory carries its own")
    _add_kv_type(p)
    p.add_argument("--revalidate", action="store_true", help="run the accelerator parity guard even if a verdict is cached")
    p.add_argument("--guard-max-age", type=float, default=GUARD_MAX_AGE, metavar="SECONDS",
                   help="trust a cached parity verdict this long (default a day); an older one is decided again")


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", "--max-tokens", type=positive_int, default=256, help="most tokens to generate (default 256)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the K most likely tokens (default: all)")
    p.add_argument("--top-p", type=float, default=None,
                   help="sample among the most likely tokens whose probabilities add up to P (default: all)")
    p.add_argument("--min-p", type=float, default=None,
                   help="leave out tokens less likely than P times the most likely one (default: none)")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divide the logits of tokens already in the context by this (default 1.0: none)")
    p.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")


def _add_think(p: argparse.ArgumentParser) -> None:
    p.add_argument("--think", choices=["on", "off", "auto"], default="auto",
                   help="thinking in the chat template (default auto: the model's own default; off for the "
                        "embedded demo model); reasoning is kept apart from the answer")
    p.add_argument("--loop-guard", choices=["on", "off"], default=None,
                   help="close a thought that repeats itself (the same run of tokens 3 times in a row, over 64 tokens "
                        "or more) as a spent thinking budget closes it (default on: $DELTASERVE_LOOP_GUARD)")


def _add_think_budget(p: argparse.ArgumentParser) -> None:
    p.add_argument("--think-budget", type=budget_arg, default=None, metavar="N",
                   help="think N tokens at most, then close the thought (</think>) and answer under -n/--max-tokens "
                        "of its own (default -1: unlimited; 0: thinking off)")
    p.add_argument("--think-budget-message", default=None, metavar="TEXT",
                   help="a sentence written before the closing when the budget (or the loop guard) closes a thought, "
                        "e.g. \"I have to answer from what I have thought so far.\" (default: none)")


# ---------------------------------------------------------------------------------------------
# run
# ---------------------------------------------------------------------------------------------

def _stream(_tid, piece: str) -> None:
    """on_token for the CLI: each decoded piece to stdout as it comes."""
    if piece:
        sys.stdout.write(piece)
        sys.stdout.flush()


def _show(reasoning: str, content: str) -> None:
    """A chat answer streams to stdout; what the model reasons before it goes to stderr, kept apart."""
    if reasoning:
        sys.stderr.write(reasoning)
        sys.stderr.flush()
    if content:
        sys.stdout.write(content)
        sys.stdout.flush()


def _json_schema_format(path: str | None) -> dict | None:
    """`--json-schema FILE`: the JSON schema in FILE as an OpenAI response_format (None without the flag)."""
    if not path:
        return None
    import json
    from pathlib import Path

    try:
        schema = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise DeltaserveError(f"--json-schema {path}: not a readable JSON file: {e}") from None
    if not isinstance(schema, dict):
        raise DeltaserveError(f"--json-schema {path}: expected a JSON schema object, got {type(schema).__name__}")
    return {"type": "json_schema", "json_schema": {"name": Path(path).stem, "schema": schema, "strict": True}}


def cmd_run(a) -> int:
    prompts = a.prompt or []
    response_format = _json_schema_format(getattr(a, "json_schema", None))
    if len(prompts) > 1 and a.chat is False:
        raise DeltaserveError(f"{len(prompts)} prompts given: several -p are the turns of one conversation and "
                              "need the chat template (leave out --raw)")
    model = load_model(a)
    load_s = model.load_seconds
    if a.chat is None:  # neither --chat nor --raw: a model that carries a chat template is a chat model
        a.chat = bool(model.tokenizer.chat_template)
        if a.chat:
            print("[deltaserve] the model carries a chat template: the prompt goes in as a user message "
                  "(--raw sends it as plain text)", file=sys.stderr)
        elif len(prompts) > 1:
            raise DeltaserveError(f"{len(prompts)} prompts given: several -p are the turns of one conversation and "
                                  "this model carries no chat template (pass --chat to use ChatML)")
    images = getattr(a, "image", None) or []
    if images and not a.chat:
        raise DeltaserveError("--image needs the chat template (leave out --raw)")
    if len(prompts) > 1:
        return _run_turns(a, model, prompts, load_s, response_format, images)
    text = prompts[0] if prompts else None
    if text is None:
        if sys.stdin.isatty():
            raise DeltaserveError("no prompt: pass -p TEXT (or pipe text on stdin)")
        text = sys.stdin.read()
    messages = ([{"role": "system", "content": a.system}] if a.system else []) + \
        [{"role": "user", "content": _with_images(text, images)}]
    if a.chat:  # rendered once by the turn pipeline (session.turns): its ids plan the memory, then the turn runs
        request = ask(messages, response_format=response_format, enable_thinking=thinking(a), image_files=True)
        prompt = request.prompt(model.tokenizer, model.thinking_default)
        ids = request.encode(prompt, model.tokenizer, model.host.vision if request.images else None,
                             model.config.vocab_size)
    else:
        ids = model.tokenizer.encode(text)
    context = min(a.ctx or model.config.context_length, model.config.context_length)
    most = a.max_tokens + (a.think_budget + 16 if a.think_budget is not None and a.think_budget > 0 else 0)
    positions = len(ids) + min(most, max(context - len(ids), 0))
    session = model.session(context=a.ctx, device=a.device, one_call=True, plan_positions=positions,
                            revalidate=a.revalidate, guard_max_age=a.guard_max_age, mtp=mtp_arg(a),
                            loop_guard=loop_guard(a))
    if a.chat:
        turn = session.run_turn(request, ids, prompt.thinking, a.max_tokens, on_token=_stream,
                                on_reasoning=lambda r: _show(r, ""), **sampling_kwargs(a), **thinking_kwargs(a))
    else:
        turn = session.generate(ids, max_tokens=a.max_tokens, on_token=lambda t, piece: _show("", piece),
                                response_format=response_format, **sampling_kwargs(a), **thinking_kwargs(a))
    print(flush=True)
    capped = " (cut by the context)" if turn.context_capped else ""
    for line in session.prefill_lines:
        print(line, file=sys.stderr)
    print(f"[stats] prompt {plural(turn.prompt_tokens, 'token')}, prefill {turn.prefill_tok_s:.1f} tok/s, "
          f"decode {turn.decode_tok_s:.1f} tok/s ({plural(turn.generated, 'token')}{thought_said(turn)}, "
          f"{turn.finish_reason}{capped}), "
          f"TTFT {turn.timings.ttft_s * 1000:.0f} ms{drafts_said(session, turn)}, load {load_s:.2f} s, "
          f"backend {turn.backend}", file=sys.stderr)
    return 0


def thought_said(turn) -> str:
    """The stats line's thinking and answer tokens, apart, where the prompt opened a thought."""
    words = thought_words(turn)
    return f": {words}" if words else ""


def mtp_arg(a) -> int | None:
    n = getattr(a, "mtp", None)
    if n is not None and n < 0:
        raise DeltaserveError(f"--mtp takes a count of draft tokens >= 0 (0: off), got {n}")
    return n


def drafts_said(session, turn) -> str:
    """The stats line's speculative part, where the session drafts: how many drafts the model kept."""
    if getattr(session, "_policy", None) is None:
        return ""
    rate = f" ({100 * turn.acceptance:.0f} %)" if turn.drafted else ""
    return f", MTP accepted {turn.accepted} of {plural(turn.drafted, 'draft')}{rate}"


def _with_images(text: str, images: list[str]):
    """A user message's content: the text, or the images (files) and then the text."""
    if not images:
        return text
    return [{"type": "image", "image": path} for path in images] + [{"type": "text", "text": text}]


def _run_turns(a, model, prompts: list[str], load_s: float, response_format: dict | None = None,
               images: list[str] | None = None) -> int:
    """Several -p: the user turns of one conversation on one resident session, each reply streamed,
    each turn's reuse said on stderr (a later turn prefills only what the history added)."""
    session = model.session(context=a.ctx, device=a.device, revalidate=a.revalidate, guard_max_age=a.guard_max_age,
                            mtp=mtp_arg(a), loop_guard=loop_guard(a))
    messages = [{"role": "system", "content": a.system}] if a.system else []
    for k, text in enumerate(prompts, 1):
        messages.append({"role": "user", "content": _with_images(text, images if k == 1 else None)})
        print(f"> {text}", flush=True)
        turn = session.chat(messages, max_tokens=a.max_tokens, enable_thinking=thinking(a), on_token=_stream,
                            on_reasoning=lambda r: _show(r, ""), response_format=response_format, **sampling_kwargs(a),
                            **thinking_kwargs(a))
        print(flush=True)
        messages.append({"role": "assistant", "content": turn.text})
        for line in session.prefill_lines:
            print(line, file=sys.stderr)
        session.prefill_lines.clear()
        replay = f", replayed {turn.replayed} on the CPU after a fallback" if turn.replayed else ""
        print(f"[stats] turn {k}: prompt {plural(turn.prompt_tokens, 'token')}, reused {turn.reused}, prefilled {turn.prefilled}{replay}, "
              f"TTFT {turn.timings.ttft_s * 1000:.0f} ms, decode {turn.decode_tok_s:.1f} tok/s ({plural(turn.generated, 'token')}"
              f"{thought_said(turn)}, {turn.finish_reason}){drafts_said(session, turn)}" + (f", load {load_s:.2f} s" if k == 1 else "")
              + f", backend {turn.backend}",
              file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------------------------
# convert / inspect
# ---------------------------------------------------------------------------------------------

def cmd_convert(a) -> int:
    from deltaserve.api import convert

    t0 = time.perf_counter()
    out = convert(a.hf_dir, a.out, a.type, progress=(lambda m: print(m, file=sys.stderr)) if a.verbose else None)
    print(f"wrote {out} ({os.path.getsize(out) / (1 << 20):.1f} MiB, {a.type}) in {time.perf_counter() - t0:.1f} s")
    return 0


def cmd_inspect(a) -> int:
    from deltaserve.api import capacity
    from deltaserve.api import cpu_memory
    from deltaserve.api import load_host
    from deltaserve.api import route_table
    from deltaserve.api import saved_state_bytes

    host = load_host(resolve_model(a.model), mmproj=getattr(a, "mmproj", None))
    c = host.config
    print(f"model: {host.path} ({host.format}, {host.file_bytes / (1 << 20):.1f} MiB)")
    print(f"arch: {c.arch}, {c.num_layers} layers ({len(c.deltanet_layers)} Gated DeltaNet, "
          f"{len(c.attention_layers)} gated attention: {list(c.attention_layers)})")
    for k, v in c.to_dict().items():
        if k not in ("layer_types", "arch"):
            print(f"  {k}: {v:.6g}" if isinstance(v, float) else f"  {k}: {v}")
    tok = host.tokenizer
    print(f"tokenizer: {tok.vocab_size} tokens, stop ids {sorted(tok.stop_ids)}, "
          f"chat template: {'from the file' if tok.chat_template else 'built-in ChatML'}")
    print(f"weights in memory: {host.weights.nbytes / (1 << 20):.1f} MiB ({host.weight_mode} mode)")
    if c.is_moe:
        w = host.weights
        print(f"experts: {c.num_experts} routed experts of {c.moe_intermediate_size} in each of the {c.num_layers} "
              f"layers, {c.num_experts_per_tok} a token, and a shared expert of {c.shared_expert_intermediate_size}; "
              f"weights read per token: {w.active_nbytes / (1 << 20):.1f} MiB of the {w.nbytes / (1 << 20):.1f} MiB "
              f"({100 * w.active_nbytes / max(w.nbytes, 1):.1f} %)")
    mtp = host.weights.mtp
    if mtp is not None:
        own = [n for n, same in (("embedding", mtp.embed is host.weights.embed), ("head", mtp.head is host.weights.lm_head))
               if not same]
        print(f"MTP block: yes (nextn: one full-attention block{' with an MoE FFN' if c.is_moe else ''}, "
              f"{host.weights.mtp_nbytes / (1 << 20):.1f} MiB of its own; "
              f"{'its own ' + ' and '.join(own) if own else 'the trunk embedding and head'}): speculative decoding "
              f"drafts with it (--mtp N, 0 off)")
    else:
        print("MTP block: no (the file carries no nextn tensors: decoding without drafts)")
    try:
        vision = host.vision
    except DeltaserveError as e:
        print(f"vision encoder: refused ({e})")
    else:
        if vision is not None:
            vc = vision.encoder.config
            print(f"vision encoder: yes ({'--mmproj ' + host.mmproj.name if host.mmproj else 'model.visual.*'}: "
                  f"{vc.depth} blocks of {vc.hidden_size}, patch {vc.patch_size}, merge {vc.spatial_merge_size}, "
                  f"{vision.encoder.parameters_bytes() / (1 << 20):.1f} MiB): images are read; "
                  f"{vision.encoder.route()}")
        else:
            print("vision encoder: no (images need an HF checkpoint directory with model.visual.*, or --mmproj FILE)")
    for line in route_table(host):
        print(line)
    kv_type = getattr(a, "kv_type", None) or DEFAULT_KV_TYPE
    per_type = ", ".join(f"{t} {capacity.kv_position_bytes(c, t) / 1024:.1f} KiB" for t in KV_TYPES)
    print(f"KV cache: {capacity.kv_position_bytes(c, kv_type) / 1024:.1f} KiB per position ({kv_type}; by type: "
          f"{per_type}); recurrent + conv state: {c.recurrent_state_bytes() / (1 << 20):.2f} MiB")
    print("one saved conversation state (serve's state store, chat --resume): "
          f"{c.recurrent_state_bytes() / (1 << 20):.2f} MiB recurrent + "
          f"{capacity.kv_position_bytes(c, kv_type) / 1024:.1f} KiB per position it covers ("
          + ", ".join(f"{n}: {saved_state_bytes(c, n, kv_type=kv_type) / (1 << 20):.1f} MiB"
                      for n in (1024, 4096, 32768) if n <= c.context_length) + ")")
    by_type: dict[str, int] = {}
    for t in host.tensor_summary:
        by_type[t.type] = by_type.get(t.type, 0) + t.nbytes
    print("tensor types: " + ", ".join(f"{k} {v / (1 << 20):.1f} MiB" for k, v in
                                       sorted(by_type.items(), key=lambda kv: -kv[1])))
    print(f"tensors ({len(host.tensor_summary)}, {sum(t.nbytes for t in host.tensor_summary) / (1 << 20):.1f} MiB stored):")
    for t in host.tensor_summary:
        print(f"  {t.name:40s} {t.type:8s} {str(t.shape):16s} {t.nbytes / 1024:10.1f} KiB")
    if a.ctx:
        positions = min(a.ctx, c.context_length)
        if a.ctx > c.context_length:
            print(f"--ctx {a.ctx} is above the model's declared context of {c.context_length}: "
                  f"planning {c.context_length} positions")
        try:
            p = capacity.plan(c, positions, cpu_memory(), weights=host.weights.nbytes, kv_type=kv_type)
            print(f"capacity plan for {positions} positions: fits\n  " + p.describe().replace("\n", "\n  "))
            left = max(p.memory.free - p.total, 0)
            print(f"  state store (serve --state-ram default, 2 slots): {left // 4 / (1 << 20):.0f} MiB of the "
                  f"{left / (1 << 20):.0f} MiB left, about {left // 4 // saved_state_bytes(c, positions, kv_type=kv_type)} saved "
                  f"states of {positions} positions")
        except DeltaserveError as e:
            print(f"capacity plan for {positions} positions: REFUSED\n  {e}")
            return 1
    return 0


def cmd_bench(a) -> int:
    """The benchmarks live in the repository's tools/ (outside the wheel) and are their own program (`python -m
    tools.bench.run`, which imports this package, never the reverse): they need a checkout and the test extras,
    and say so in one line when either is missing. The flags were checked here; the program parses them again."""
    import subprocess

    root = Path(__file__).resolve().parents[3]
    if not (root / "tools" / "bench" / "run.py").exists():
        raise DeltaserveError("deltaserve bench runs from a checkout of the repository (its tools/bench is not part "
                              "of the installed package): clone it and pip install -e '.[test]' there")
    argv = a.argv[a.argv.index("bench") + 1:]
    env = dict(os.environ)  # the child's environment: this one, the checkout first on its path
    env["PYTHONPATH"] = os.pathsep.join([str(root)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return subprocess.call([sys.executable, "-m", "tools.bench.run", *argv], env=env)


# ---------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deltaserve", description="Resident-session inference for Qwen3.5 hybrid models.")
    p.add_argument("--version", action="version", version=f"deltaserve {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    r = sub.add_parser("run", help="one prompt, streamed, then a stats line",
                       description="Run one prompt on a one-call session and stream the answer (with --chat and "
                                   "several -p: the turns of one conversation on one resident session).")
    _add_model(r)
    r.add_argument("-p", "--prompt", action="append", default=None,
                   help="the prompt text (default: read stdin); with --chat, give -p again for each later user "
                        "turn of one conversation on one resident session")
    mode = r.add_mutually_exclusive_group()
    mode.add_argument("--chat", action="store_true", default=None,
                      help="the prompt as a user message in the model's chat template (the default for a model "
                           "whose file carries a template)")
    mode.add_argument("--raw", dest="chat", action="store_false", help="the prompt as plain text, no chat template")
    r.add_argument("--system", default=None, help="a system message (chat only)")
    r.add_argument("--image", action="append", default=None, metavar="FILE",
                   help="an image the (first) prompt asks about; give it again for more (chat only, a checkpoint "
                        "with a vision encoder: an HF directory holding model.visual.*)")
    r.add_argument("--json-schema", default=None, metavar="FILE",
                   help="constrain the answer to the JSON schema in FILE (structured outputs: it parses and "
                        "validates whatever the weights; thinking is off for the turn unless --think on, and then the "
                        "schema starts after the thought)")
    _add_think(r)
    _add_think_budget(r)
    _add_sampling(r)
    _add_runtime(r)
    r.set_defaults(func=cmd_run)

    c = sub.add_parser("chat", help="an interactive conversation on one resident session",
                       description="Chat with a model; the decode state stays resident between turns.")
    _add_model(c)
    c.add_argument("--system", default=None, help="a system message")
    _add_think(c)
    _add_think_budget(c)

    def chat_name(text: str) -> str:
        try:
            return importlib.import_module("deltaserve.frontends.repl").check_name(text)
        except DeltaserveError as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix(f"--resume {text!r}: ")) from None

    c.add_argument("--resume", type=chat_name, default=None, metavar="NAME",
                   help="keep this conversation and its decode state under NAME (in the data directory's chats/), "
                        "saved after every turn; a later --resume NAME with the same model goes on where it "
                        "stopped without prefilling it again (a NAME not saved yet starts a new conversation). "
                        "The saved system message and thinking setting apply unless --system or --think on|off "
                        "is given")
    _add_sampling(c)
    _add_runtime(c)
    c.add_argument("--data-dir", default=settings.current().data_dir, metavar="DIR",
                   help="where --resume keeps its conversations (default: $DELTASERVE_DATA_DIR, else "
                        "$XDG_DATA_HOME/deltaserve): users' data, apart from the cache directory")
    c.set_defaults(func=lambda a: importlib.import_module("deltaserve.frontends.repl").main(a))

    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server",
                       description="Serve a model over an OpenAI-compatible HTTP API on resident sessions.")
    _add_model(s)
    s.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8080, help="TCP port (default 8080; 0 picks a free one)")
    s.add_argument("--slots", type=positive_int, default=2, help="resident sessions (default 2)")
    s.add_argument("--queue", type=int, default=16, help="requests that may wait for a slot (default 16)")
    s.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="require this bearer token; give it several times for several tenants, each key's "
                        "conversations, cached prefixes and stored responses its own (default: $DELTASERVE_API_KEY)")
    s.add_argument("--api-keys-file", default=settings.current().api_keys_file, metavar="FILE",
                   help="more keys, one a line (KEY, or NAME KEY to name its tenant; # comments); every key a tenant")
    s.add_argument("--responses-ram", type=size_arg, default=64 << 20, metavar="SIZE",
                   help="RAM for stored responses (/v1/responses store), the oldest of a tenant's leaving first when "
                        "its equal share is full (default 64M)")
    s.add_argument("--max-tokens-limit", type=positive_int, default=None, metavar="N",
                   help="the most tokens one answer may take (default: the context): a request's max_tokens (or "
                        "max_output_tokens) above it is clamped to it and the answer says so (max_tokens_clamped, "
                        "the x-deltaserve-max-tokens header); an answer the context cuts says context_capped")
    s.add_argument("--max-body", type=int, default=4 << 20, help="largest request body in bytes")
    s.add_argument("--max-messages", type=int, default=512, help="most messages in one request")
    s.add_argument("--max-image-pixels", type=positive_int, default=16_777_216, metavar="N",
                   help="largest image a request may send, in pixels (width x height, default 16777216), checked "
                        "from its header before it is decoded")
    s.add_argument("--max-images", type=positive_int, default=8, metavar="N",
                   help="most images in one request (default 8)")
    s.add_argument("--max-image-pixels-total", type=positive_int, default=33_554_432, metavar="N",
                   help="most pixels of one request's images together (default 33554432, two 4096x4096 images), "
                        "added up from their headers before any is decoded")
    s.add_argument("--allow-image-urls", action="store_true",
                   help="fetch http(s) image links in requests (at most 20 MiB within 10 s in all, public addresses "
                        "only, each redirect checked); off: images come as data URLs only")
    s.add_argument("--allow-private-image-urls", action="store_true",
                   help="with --allow-image-urls: links to loopback, private and link-local addresses are fetched too "
                        "(off: refused, so that a request cannot reach what only this host reaches)")
    s.add_argument("--compile-timeout", type=positive_float, default=10.0, metavar="S",
                   help="a response_format or tool schema still compiling after S seconds is stopped and the request "
                        "refused with a 400 (default 10); schemas compile in a process of their own, stopped too "
                        "when the client leaves")
    s.add_argument("--model-name", default=None, help="the model id reported by /v1/models (default: the file's "
                                                       "name, or the OWNER/REPO[:QUANT] it was named by)")
    s.add_argument("--no-webui", dest="webui", action="store_false",
                   help="no chat page at / (by default the server answers GET / with a chat page for a browser: "
                        "plain HTML and JavaScript from this server alone, conversations kept in the browser)")
    s.add_argument("--allowed-hosts", default=None, metavar="NAMES",
                   help="Host names to answer to besides loopback ones, comma-separated ('*.example.com' for the "
                        "names under one, '*' for any; default: on a loopback bind only localhost, 127.0.0.1 and "
                        "[::1], which keeps web pages on other sites out; on any other bind any name)")
    s.add_argument("--cors-origin", action="append", default=None, metavar="ORIGIN",
                   help="let web pages on ORIGIN (e.g. https://app.example.com; '*' for any) call the API from a "
                        "browser (CORS); give it once per origin (default: none, a page on another origin is refused "
                        "by the browser)")
    s.add_argument("--request-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="seconds a request's head, and then its body, have to arrive whole (default 30): a "
                        "client that stalls is answered 408 and its connection closed")
    s.add_argument("--max-connections", type=positive_int, default=None, metavar="N",
                   help="connections kept open at most; past it the oldest that has not sent a whole request is "
                        "closed (default: what the open-file limit leaves room for, at most 4096)")
    _add_think(s)
    s.add_argument("--reasoning-budget", type=budget_arg, default=-1, metavar="N",
                   help="the thinking budget of a request that names none (llama.cpp's flag): N tokens at most, then "
                        "the thought is closed and the answer runs under max_tokens of its own (default -1: "
                        "unlimited; 0: thinking off)")
    s.add_argument("--reasoning-budget-message", default="", metavar="TEXT",
                   help="a sentence written before the closing when a budget or the loop guard closes a thought "
                        "(llama.cpp's flag; a request's reasoning_budget_message wins; default: none)")
    s.add_argument("--reasoning-effort-budgets", default=None, metavar="LEVEL=N,...",
                   help="the thinking budget of each reasoning_effort level (default none=0, minimal=128, low=512, "
                        "medium=2048, high=8192, xhigh=32768; -1: unlimited)")
    s.add_argument("--state-ram", type=size_arg, default=None, metavar="SIZE",
                   help="RAM for saved conversation states beyond the slots, e.g. 2G (default: a quarter of the "
                        "memory left after the slots' plan; 0: none)")
    s.add_argument("--prefill-log", choices=["on", "off"], default="on",
                   help="log each batched prefill's stats line, named by its slot (default on; the counts are in "
                        "/metrics and /health either way)")
    s.add_argument("--state-dir", default=None, metavar="DIR",
                   help="keep saved conversation states on disk here too, across restarts")
    s.add_argument("--state-disk", type=size_arg, default=None, metavar="SIZE",
                   help="disk for saved states in --state-dir (default: half the free space there, at most 64G)")
    s.add_argument("--compute-thread", choices=["on", "off", "auto"], default="auto",
                   help="give the engine loop a thread of its own that runs every forward (auto: for model files of "
                        "64 MiB and more, where a forward is long against a thread hand-off; off: the slots' threads "
                        "step it in turn)")
    s.add_argument("--step-ms", type=float, default=None, metavar="MS",
                   help="the engine loop's step while sequences decode: their rows, then a waiting prompt's layers "
                        "for the rest of MS milliseconds (default 200: a streaming client's longest gap while "
                        "another's long prompt prefills; smaller: shorter gaps and a slower long prompt)")
    s.add_argument("--replicas", type=positive_int, default=None, metavar="N",
                   help="run N replicas of this server on Ray Serve behind one endpoint, each conversation routed to "
                        "the replica holding its state, all sharing --state-dir (needs deltaserve[ray]; on one "
                        "machine a local Ray instance on loopback)")
    s.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="with --replicas: join the Ray cluster at ADDR (e.g. auto, or HEAD:6379 of `ray start "
                        "--head`) instead of starting a local Ray instance")
    _add_runtime(s)
    s.set_defaults(func=lambda a: importlib.import_module(
        "deltaserve.frontends.ray" if a.replicas or a.ray_address else "deltaserve.frontends.server.app").main(a))

    v = sub.add_parser("convert", help="HF Qwen3.5 directory -> GGUF",
                       description="Convert an HF Qwen3.5 directory to a GGUF file llama.cpp loads.")
    v.add_argument("hf_dir", help="an HF Qwen3.5 directory (config.json, safetensors, tokenizer files)")
    v.add_argument("out", help="the GGUF file to write (its directory must exist)")
    v.add_argument("--type", choices=["f32", "f16", "bf16", "q8_0"], default="f16",
                   help="tensor type of the weight matrices (default f16; norms stay f32)")
    v.add_argument("-v", "--verbose", action="store_true", help="say each tensor as it is written")
    v.set_defaults(func=cmd_convert)

    i = sub.add_parser("inspect", help="print the config, tensors, the route table and (with --ctx) the capacity plan",
                       description="Describe a model file: config, tensor types and sizes, the route table of its "
                                   "products on this CPU (each product's kernel by its rows), capacity plan.")
    _add_model(i)
    i.add_argument("--ctx", type=positive_int, default=None,
                   help="plan memory for this many positions (at most the declared context)")
    i.add_argument("--mmproj", default=None, metavar="FILE", help="a projector GGUF to describe with the model")
    _add_kv_type(i)
    i.set_defaults(func=cmd_inspect)

    b = sub.add_parser("bench", help="benchmarks against llama.cpp and transformers",
                       description="Run the benchmarks and write their results to a new directory (or --out).")
    b.add_argument("what", nargs="?", default="all", choices=["all", "session", "speed", "chat", "threads", "conversations", "replicas",
                                                      "sizes", "moe", "quants", "grammar", "mtp", "responses",
                                                      "vision", "serve", "context"],
                   help="which benchmark (default all)")
    b.add_argument("--out", default=None, help="where results go (default: a new directory bench-WHAT-TIME/ here; "
                                                "the committed results are benchmarks/, written only when named)")
    b.add_argument("--kind", default="bf16", help="weight format of the session benchmark's model (default bf16)")
    b.add_argument("--layers", type=int, default=None, help="fewer layers than the real shape (default: all)")
    b.add_argument("--turns", type=int, default=20, help="turns of the session benchmark (default 20)")
    b.add_argument("--max-tokens", type=int, default=24, help="tokens generated per turn (default 24)")
    b.add_argument("--threads", type=positive_int, default=2, help="CPU threads for every engine (default 2)")
    b.add_argument("--repeats", type=int, default=3, help="repetitions; medians are reported (default 3)")
    b.add_argument("--quick", action="store_true", help="a smaller, faster run")
    b.add_argument("--presets", default=None, help="bench quants: these llama-quantize presets alone (A,B,...)")
    b.add_argument("--depths", default="4096,16384",
                   help="bench context: prompt depths in tokens, e.g. 4K,16K,32K,64K (default 4096,16384)")
    b.add_argument("--kv-type", default="f32,f16",
                   help="bench context: deltaserve's KV cache types to run, a comma list (default f32,f16)")
    b.add_argument("--llama-kv-type", default="f16,q8_0",
                   help="bench context: llama.cpp's cache types to run, f16 and/or q8_0, or none (default f16,q8_0)")
    b.add_argument("--model", default=None, metavar="FILE",
                   help="bench context: the GGUF file both engines run (default: the 0.8B shape's Q8_0 bench file)")
    b.set_defaults(func=cmd_bench)
    models.add_commands(sub, _add_model, positive_int)
    kernels.add_commands(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    a.argv = list(sys.argv[1:] if argv is None else argv)
    if not getattr(a, "command", None):
        parser.print_help()
        return 2
    def command():
        models.resolve_args(a)  # a Hub name becomes its files in the cache, before anything reads MODEL
        return a.func(a)

    return run_command(command)


def run_command(fn) -> int:
    """A command's exit status; its errors as one line each (never a traceback to a user)."""
    try:
        return int(fn() or 0)
    except DeltaserveError as e:
        print(f"deltaserve: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("deltaserve: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as e:  # noqa: BLE001 - never a traceback to a user
        if settings.current().debug:
            raise
        print(f"deltaserve: internal error: {type(e).__name__}: {e} (DELTASERVE_DEBUG=1 shows the traceback)",
              file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
