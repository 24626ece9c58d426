"""Every environment variable deltaserve reads, declared once: its name, meaning, values and default, and the
command-line flag that says the same where there is one. The process reads them once, into `current()` (a frozen
`Settings`); no other module reads the environment for them, and none on a hot path (a matrix product reads a
field of the object it was handed, not os.environ). `reload()` reads them again (tests that change the
environment call it).

One name, one meaning: DELTASERVE_PREFILL is the prefill's chunk format; the session's one-token-at-a-time prefill
(a debugging aid) is DELTASERVE_PREFILL_TOKENS.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

OFF_WORDS = ("0", "off", "no", "false")
ON_WORDS = ("1", "on", "yes", "true")


@dataclass(frozen=True)
class Variable:
    name: str
    default: str
    meaning: str
    flag: str | None = None


VARIABLES: dict[str, Variable] = {v.name: v for v in (
    Variable("DELTASERVE_DEVICE", "auto", "where a session runs when no --device is given: auto (a CUDA GPU when one is "
             "visible, else the CPU), cpu, cuda, cuda:N", "--device"),
    Variable("DELTASERVE_WEIGHTS", "fast", "how weights are held: fast (the file's own blocks, or int8 tables where "
             "they win), blocks, tables, exact (f32 copies)"),
    Variable("DELTASERVE_PREFILL", "auto", "the format of a prefill's dequantized chunks: auto (the route's), f32, "
             "bf16, int8"),
    Variable("DELTASERVE_PREFILL_TOKENS", "off", "on: a session prefills prompts one token at a time, not batched "
             "(a debugging aid; said in the route line)"),
    Variable("DELTASERVE_ACTIVATIONS", "int8", "the decode products' activations: int8 (per block, as llama.cpp's) "
             "or f32"),
    Variable("DELTASERVE_AMX", "on", "off: a Xeon with AMX takes the route of a CPU without it (to measure a Zen's "
             "route there)"),
    Variable("DELTASERVE_ISA", "auto", "the build of the C kernels this process loads: auto (the best level this CPU "
             "runs), avx512-bf16, avx512-vnni, x86-64-v3 (or avx2), native (-march=native); a level named is taken "
             "as this CPU's, its missing instructions hidden from every route decision: avx2 runs an AMD EPYC Zen 3's "
             "route on an AVX512 machine (with ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 for torch's own)"),
    Variable("DELTASERVE_NATIVE", "on", "off: the C kernels and the C tokenizer are not built or loaded (the torch "
             "and tokenizers fallbacks run, and say so)"),
    Variable("DELTASERVE_VISION", "auto", "the vision tower's products: auto (bf16 where the CPU multiplies bf16 "
             "natively: AVX512-BF16 or AMX; else f32), f32 (exact weights, as transformers computes), bf16"),
    Variable("DELTASERVE_DRAFT_VOCAB", "32768", "the MTP drafts' vocabulary: the head's first N rows (a byte-level "
             "BPE's ids run from the most frequent merges) and the end-of-sequence ids; 0: the whole head (a draft "
             "step then reads all of it: a third of the 0.8B's weights)"),
    Variable("DELTASERVE_BATCH_INVARIANT", "off", "on: a decode step's products take the same kernels whatever the "
             "number of sequences in it, so a sequence's logits are the same bits alone or among others (decode of 3 "
             "or more sequences at once runs on the decode tiles, not the faster GEMM)"),
    Variable("DELTASERVE_CUDA_GRAPH", "off", "on: a CUDA session records its decode step as a CUDA graph and replays "
             "it"),
    Variable("DELTASERVE_LOOP_GUARD", "on", "off: a thought that repeats itself is not closed early (the loop "
             "guard, session/thinking.py)", "--loop-guard"),
    Variable("DELTASERVE_API_KEY", "", "the bearer token `serve` requires (empty: none)", "--api-key"),
    Variable("DELTASERVE_API_KEYS_FILE", "", "a file of the bearer tokens `serve` accepts, one a line (KEY or NAME "
             "KEY), each a tenant of its own (empty: none)", "--api-keys-file"),
    Variable("DELTASERVE_DATA_DIR", "", "where users' data is kept (`chat --resume` conversations; empty: "
             "$XDG_DATA_HOME/deltaserve or ~/.local/share/deltaserve), apart from the caches", "--data-dir"),
    Variable("DELTASERVE_DEBUG", "", "set: an internal error shows its traceback instead of one line"),
    Variable("DELTASERVE_CACHE_DIR", "", "where built kernels, checked verdicts and bench models are kept (empty: "
             "$XDG_CACHE_HOME/deltaserve or ~/.cache/deltaserve)"),
)}


def _on(value: str) -> bool:
    return value.strip().lower() in ON_WORDS


def _not_off(value: str) -> bool:
    return value.strip().lower() not in OFF_WORDS


@dataclass(frozen=True)
class Settings:
    device: str
    weights: str
    prefill: str
    prefill_tokens: bool
    activations: str
    amx: bool
    isa: str             # "auto" or a build level's name (kernels/library.py checks it)
    native: bool
    cuda_graph: bool
    batch_invariant: bool
    loop_guard: bool
    vision: str
    draft_vocab: str
    api_key: str | None
    api_keys_file: str | None
    debug: bool
    cache_dir: str | None
    data_dir: str | None
    compiler: str        # $CC (not ours: the C compiler the kernels are built with)
    xdg_cache_home: str  # $XDG_CACHE_HOME (not ours)
    xdg_data_home: str   # $XDG_DATA_HOME (not ours)


def read(environ=None) -> Settings:
    env = os.environ if environ is None else environ

    def get(name: str) -> str:
        return env.get(name, VARIABLES[name].default)

    return Settings(
        device=get("DELTASERVE_DEVICE").strip() or "auto",
        weights=get("DELTASERVE_WEIGHTS").strip() or "fast",
        prefill=get("DELTASERVE_PREFILL").strip().lower() or "auto",
        prefill_tokens=_on(get("DELTASERVE_PREFILL_TOKENS")),
        activations=get("DELTASERVE_ACTIVATIONS").strip() or "int8",
        amx=get("DELTASERVE_AMX").strip().lower() != "off",
        isa=get("DELTASERVE_ISA").strip().lower() or "auto",
        native=_not_off(get("DELTASERVE_NATIVE")),
        cuda_graph=_on(get("DELTASERVE_CUDA_GRAPH")),
        batch_invariant=_on(get("DELTASERVE_BATCH_INVARIANT")),
        loop_guard=_not_off(get("DELTASERVE_LOOP_GUARD")),
        vision=get("DELTASERVE_VISION").strip().lower() or "auto",
        draft_vocab=get("DELTASERVE_DRAFT_VOCAB").strip(),
        api_key=get("DELTASERVE_API_KEY") or None,
        api_keys_file=get("DELTASERVE_API_KEYS_FILE") or None,
        debug=bool(get("DELTASERVE_DEBUG")),
        cache_dir=get("DELTASERVE_CACHE_DIR") or None,
        data_dir=get("DELTASERVE_DATA_DIR") or None,
        compiler=env.get("CC") or "cc",
        xdg_cache_home=env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
        xdg_data_home=env.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share"),
    )


_lock = threading.Lock()
_current: list[Settings] = []


def current() -> Settings:
    """The settings as the process read them (once; `reload` reads them again)."""
    if not _current:
        with _lock:
            if not _current:
                _current.append(read())
    return _current[0]


def reload() -> Settings:
    with _lock:
        _current[:] = [read()]
    return _current[0]
