"""Train the embedded demo model end to end: corpus -> tokenizer -> tiny Qwen3.5 -> HF dir -> GGUF -> evaluation.

    .venv/bin/python scripts/demo/train.py --out /tmp/demo-build

writes the HF checkpoint and GGUFs under --out, installs the chosen GGUF as
src/deltaserve/data/demo-qwen35.gguf, and writes scripts/demo/training_log.{json,png} and
tests/data/demo_hf_check.json (transformers' greedy answers for the shipped-model test).

Training matches inference token for token: every sample is one conversation cut after a user turn,
rendered with the model's chat template exactly as `Session.chat` renders it (the real Qwen3.5
template, add_generation_prompt=True, enable_thinking=False: earlier assistant turns appear without a
think block, the last header ends in `<think>\n\n</think>\n\n`), encoded with deltaserve's tokenizer,
followed by the answer's ids and `<|im_end|>`. The loss is on assistant tokens only: the final answer
(the inference-exact target) and, as auxiliary signal, the earlier assistant answers of the history.
A tenth of the samples end in the thinking-auto header (`enable_thinking` unset: `<think>\n`), whose
target is `\n</think>\n\n` + answer, so `deltaserve run --chat` with its default also answers.

Tools (a fine-tune of the shipped weights, one torch thread because the machine is shared):

    git show 2ed0015:src/deltaserve/data/demo-qwen35.gguf > /tmp/demo-base.gguf
    .venv/bin/python scripts/demo/train.py --out /tmp/demo-build --finetune /tmp/demo-base.gguf --steps 480 \
        --tools-frac 0.25 --batch-tokens 8192 --lr 4e-4 --warmup 30 --threads 1 --check-every 120 --no-install

starts from that GGUF's weights (its tokenizer must be the one this script trains), mixes the old corpus (the full
mix) with tool round trips (corpus.ToolMaker: get_weather and add offered alone or together, one or two calls, the
tool messages, the answer; or tools offered and a message none answers), each one sequence with the loss on the
calls and on the answer, and adds the tool dialogs to the teacher-forced checks. --no-install leaves the shipped
files alone until evaluate.py's numbers say the model keeps its scores. The first attempt did not
(tools_finetune_attempt.json).

On a CUDA GPU (scripts/demo/gpu_train.sh runs several configurations at once): --device cuda trains there in f32
(the export, transformers' greedy record and the evaluation stay on the CPU); --minutes M fits the number of steps,
and so the learning-rate schedule, to M minutes of training loop from the seconds a step takes (at most --steps);
--data-workers N draws the samples in N forked processes, since a GPU step outruns one core's sampling (each pool of
samples from its own seeded generator: a stream of its own, deterministic for a seed, not the one-process stream
above). Without them the script runs as it always has.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
for p in (str(ROOT), str(ROOT / "src"), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import tokenizers  # noqa: E402
from tokenizers import Regex, pre_tokenizers, trainers  # noqa: E402

import corpus as C  # noqa: E402
from deltaserve.formats.convert import balanced_sections  # noqa: E402
from deltaserve.text.tokenizer import QWEN35_PRETOKENIZE_REGEX, Tokenizer  # noqa: E402
from tests.fixtures.tokenizers import _add_qwen35_tokens, _bpe, _qwen35_layout, save_hf_tokenizer  # noqa: E402

TEMPLATE = ROOT / "tests" / "data" / "qwen3_5_chat_template.jinja"
INSTALL = ROOT / "src" / "deltaserve" / "data" / "demo-qwen35.gguf"
HF_CHECK = ROOT / "tests" / "data" / "demo_hf_check.json"
THINK_AUTO_PREFIX = "\n</think>\n\n"

# ------------------------------------------------------------------------------------------------
# Tokenizer


def tokenizer_texts(seed: int, n: int) -> list[str]:
    """Text the BPE is trained on: conversation contents plus the role words the template writes."""
    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        turns = C.training_conversation(rng)
        for t in turns:
            texts += [t.user, t.answer]
    texts += ["user\n", "assistant\n", "system\n", "\n\n"] * 200
    # the words the model repeats and reverses, often enough to be one token each
    texts += [f"{w} " for w in sorted(set(C.WORDS + C.COLOURS))] * 100
    return texts


def train_tokenizer(seed: int, bpe_size: int) -> tokenizers.Tokenizer:
    """A Qwen3.5-layout byte-level BPE whose merges never join a space to what follows it.

    The BPE is learned with spaces split off (Qwen split, then whitespace isolated), then given the
    plain Qwen3.5 pipeline. The Qwen split keeps " pen" as one pre-token, but with no merge joining
    "Ġ" to a letter it encodes as "Ġ" + "pen": a word the user typed mid-sentence and the same word
    opening an answer are the same token, so repeating, reversing and recalling are exact copies.
    """
    tok = tokenizers.Tokenizer(_bpe())
    _qwen35_layout(tok)
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN35_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.Split(Regex(r"\s+"), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    trainer = trainers.BpeTrainer(vocab_size=bpe_size, min_frequency=2, show_progress=False, special_tokens=[],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(tokenizer_texts(seed, 20_000), trainer=trainer)
    _qwen35_layout(tok)
    _add_qwen35_tokens(tok, tok.get_vocab_size(with_added_tokens=False))
    return tok


# ------------------------------------------------------------------------------------------------
# Samples: token ids + loss weights, exactly as inference renders them


class Encoder:
    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.im_end = tok.im_end_id
        self.header = tok.encode("<|im_start|>assistant\n")
        self.cache: dict[str, list[int]] = {}

    def prompt_ids(self, messages: list[dict], thinking: bool | None = False) -> list[int]:
        text = self.tok.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=thinking)
        return self.tok.encode(text)

    def target_ids(self, answer: str, thinking: bool | None = False) -> list[int]:
        text = answer if thinking is False else THINK_AUTO_PREFIX + answer
        return self.tok.encode(text) + [self.im_end]

    def tool_prompt_ids(self, messages: list[dict], tools) -> list[int]:
        text = self.tok.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False,
                                            tools=list(tools))
        return self.tok.encode(text)

    def tool_sample(self, d: C.ToolDialog):
        """(ids, weights, prompt length) of one tool round trip, thinking off. With calls: the whole round trip in
        one sequence (the user's message, the model's calls, the tool messages, the answer), weights 1 on the calls
        (with their <|im_end|>: exactly what the model generates after the first generation header) and on the
        answer. Without: the answer after the user's message."""
        first = self.tool_prompt_ids(d.messages("call"), d.tools)
        target = self.target_ids(d.answer)
        if not d.calls:
            return first + target, [0.0] * len(first) + [1.0] * len(target), len(first)
        full = self.tool_prompt_ids(d.messages("answer"), d.tools)
        if full[:len(first)] != first:
            raise RuntimeError("a tool round trip's rendering does not extend its first prompt")
        end = full.index(self.im_end, len(first))
        w = [0.0] * len(full) + [1.0] * len(target)
        for q in range(len(first), end + 1):
            w[q] = 1.0
        return full + target, w, len(first)

    def sample(self, turns: list[C.Turn], thinking: bool | None = False, aux: bool = True):
        """(ids, weights): weights 1 on the targets (the last answer; earlier answers too when `aux`)."""
        msgs = C.messages_of(turns)[:-1]
        prompt = self.prompt_ids(msgs, thinking)
        target = self.target_ids(turns[-1].answer, thinking)
        ids = prompt + target
        w = [0.0] * len(prompt) + [1.0] * len(target)
        if aux and len(turns) > 1:
            h = self.header
            i = 0
            n = len(prompt)
            while i < n:
                if prompt[i:i + len(h)] == h:
                    j = i + len(h)
                    if j < n and prompt[j] == self.tok.think_start_id:  # the final generation header
                        break
                    k = j
                    while k < n and prompt[k] != self.im_end:
                        k += 1
                    for q in range(j, min(k + 1, n)):
                        w[q] = 1.0
                    i = k
                i += 1
        return ids, w, len(prompt)


# ------------------------------------------------------------------------------------------------
# Training data stream


# single-turn samples: cheap, and dense in the skills that need learning
SINGLE_KINDS = ("add", "repeat", "reverse", "fact", "unknown", "greet", "thanks", "help", "other")
SINGLE_WEIGHTS = (4.0, 2.0, 2.0, 0.5, 0.3, 0.3, 0.2, 0.2, 0.6)
PHASES = (0.08, 0.22)  # curriculum boundaries, as fractions of the steps


def _single(rng: random.Random, kinds, weights) -> list[C.Turn]:
    kind = rng.choices(kinds, weights=weights)[0]
    mk = C.Maker(rng, "train")
    return [mk.unknown(rng.choice(C.SLOTS)) if kind == "unknown" else mk.single(kind)]


def _recall(rng: random.Random, gaps) -> list[C.Turn]:
    turns, scored = C.recall_conversation(rng, "train", min_gap=rng.choice(gaps))
    return turns[: scored[0] + 1] if rng.random() < 0.8 else turns


# the skills between the facts of a dense conversation, and how often each comes up
DENSE_SKILLS = ("add", "repeat", "reverse", "greet", "thanks", "help", "other", "filler")
DENSE_WEIGHTS = (4.0, 2.0, 2.0, 0.4, 0.4, 0.2, 0.8, 0.5)


def dense_conversation(rng: random.Random) -> list[C.Turn]:
    """5-10 turns: facts stated, asked for again 1-9 turns later (several times), with skills and
    "never told" questions in between. The loss is on every answer, so one sample carries several
    recalls at several distances instead of one."""
    mk = C.Maker(rng, "train")
    n = rng.randint(5, 10)
    slots = list(C.SLOTS)
    rng.shuffle(slots)
    known: dict[str, str] = {}
    turns: list[C.Turn] = []
    for i in range(n):
        last = i == n - 1
        r = rng.random()
        free = [s for s in slots if s.key not in known]
        if known and r < (0.65 if last else 0.45):
            key = rng.choice(sorted(known))
            turns.append(mk.recall(C.SLOT_BY_KEY[key], known[key]))
        elif free and r < 0.72:
            t = mk.fact(free[0])
            known[free[0].key] = t.meta["value"]
            turns.append(t)
        elif free and r < 0.78:
            turns.append(mk.unknown(rng.choice(free)))
        else:
            turns.append(mk.single(rng.choices(DENSE_SKILLS, weights=DENSE_WEIGHTS)[0]))
    return turns


def train_conversation(rng: random.Random, progress: float) -> list[C.Turn]:
    """One training conversation, by a curriculum. Mixed from the start, the copying skills form
    slowly; alone they form in a hundred or two steps. So: first copying alone (repeat, reverse, a
    fact asked right after it was stated), then adding joins, then the full mix: single turns, the
    corpus's 1-6 turn conversations and dense 5-10 turn conversations with several recalls each."""
    r = rng.random()
    if progress < PHASES[0]:
        if r < 0.7:
            return _single(rng, ("repeat", "reverse"), (1, 1))
        return _recall(rng, (1,))
    if progress < PHASES[1]:
        if r < 0.35:
            return _single(rng, ("add",), (1,))
        if r < 0.5:
            return _single(rng, ("repeat", "reverse"), (1, 1))
        if r < 0.8:
            return _recall(rng, (1, 2, 3))
        return _single(rng, SINGLE_KINDS, SINGLE_WEIGHTS)
    if r < 0.25:
        return _single(rng, SINGLE_KINDS, SINGLE_WEIGHTS)
    if r < 0.3:
        return C.training_conversation(rng)
    return dense_conversation(rng)


def make_pool(enc: Encoder, rng: random.Random, n: int, progress: float, batch: int, batch_tokens: int | None,
              p_auto: float, p_tools: float, tools_from: float = 0.0, tool_weights=None):
    """`n` samples drawn with `rng` at curriculum `progress`, sorted by length, cut into batches (at most `batch`
    samples and `batch_tokens` padded tokens each), the batches shuffled. Returns (batches, keys, tool samples)."""
    pool = []
    keys: set[tuple] = set()
    tools = 0
    for _ in range(n):
        if p_tools and progress >= tools_from and rng.random() < p_tools:
            tm = C.ToolMaker(rng, "train")
            d = tm.dialog() if tool_weights is None else tm.dialog(tool_weights)
            keys.add(("tool", d.user, tuple(d.results)))
            pool.append(enc.tool_sample(d))
            tools += 1
            continue
        turns = train_conversation(rng, progress)
        thinking = None if rng.random() < p_auto else False
        for k in range(1, len(turns) + 1):
            keys.add(C.conversation_key(turns[:k]))
        pool.append(enc.sample(turns, thinking))
    pool.sort(key=lambda s: len(s[0]))
    if batch_tokens:  # at most `batch` samples and `batch_tokens` padded tokens per batch
        batches, cur = [], []
        for smp in pool:
            if cur and (len(cur) >= batch or (len(cur) + 1) * len(smp[0]) > batch_tokens):
                batches.append(cur)
                cur = []
            cur.append(smp)
        batches += [cur] if cur else []
    else:
        batches = [pool[i:i + batch] for i in range(0, len(pool), batch)]
    rng.shuffle(batches)
    return batches, keys, tools


def pad_batch(b, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(len(s[0]) for s in b)
    ids = torch.full((len(b), T), pad_id, dtype=torch.long)
    w = torch.zeros((len(b), T))
    for r, (x, wt, _) in enumerate(b):
        ids[r, :len(x)] = torch.tensor(x)
        w[r, :len(x)] = torch.tensor(wt)
    return ids, w


class Batches:
    """Deterministic batches: draw `pool` samples, sort by length, cut into batches, shuffle them."""

    def __init__(self, enc: Encoder, seed: int, batch: int, total_steps: int, pool_batches: int = 32,
                 p_auto: float = 0.1, p_tools: float = 0.0, batch_tokens: int | None = None,
                 progress_from: float = 0.0, tools_from: float = 0.0, tool_weights=None):
        self.enc, self.rng, self.batch, self.pool_batches, self.p_auto = enc, random.Random(seed), batch, pool_batches, p_auto
        self.p_tools, self.batch_tokens, self.progress_from = p_tools, batch_tokens, progress_from
        self.tools_from, self.tool_weights = tools_from, tool_weights
        self.tool_samples = 0
        self.total_steps = total_steps
        self.refills = 0
        self.queue: list[list[tuple]] = []
        self.keys: set[tuple] = set()
        self.tokens = 0
        self.samples = 0

    def _progress(self, k: int) -> float:
        return self.progress_from + k * self.pool_batches / max(1, self.total_steps)

    def _refill(self) -> None:
        progress = self._progress(self.refills)
        self.refills += 1
        batches, keys, tools = make_pool(self.enc, self.rng, self.batch * self.pool_batches, progress, self.batch,
                                         self.batch_tokens, self.p_auto, self.p_tools, self.tools_from,
                                         self.tool_weights)
        self.keys |= keys
        self.tool_samples += tools
        self.queue.extend(batches)

    def next(self, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.queue:
            self._refill()
        b = self.queue.pop()
        self.tokens += sum(len(s[0]) for s in b)
        self.samples += len(b)
        return pad_batch(b, pad_id)

    def close(self) -> None:
        pass


def pool_rng(seed: int, k: int) -> random.Random:
    """The generator of pool k when pools are drawn by worker processes (each pool its own stream)."""
    return random.Random(f"demo-pool:{seed}:{k}")


def _pool_worker(wid: int, n_workers: int, q, total_steps, stop, enc: Encoder, seed: int, batch: int,
                 pool_batches: int, p_auto: float, p_tools: float, batch_tokens, progress_from: float,
                 tools_from: float, tool_weights, pad_id: int) -> None:
    """One data process: pools wid, wid + n, wid + 2n, ... padded to numpy arrays, in order, onto its queue."""
    import numpy as np

    parent = os.getppid()
    q.cancel_join_thread()  # exit without flushing what the trainer will not read
    k = wid
    while not stop.is_set() and os.getppid() == parent:  # a killed trainer leaves no sampler behind
        progress = progress_from + k * pool_batches / max(1, total_steps.value)
        batches, keys, tools = make_pool(enc, pool_rng(seed, k), batch * pool_batches, progress, batch, batch_tokens,
                                         p_auto, p_tools, tools_from, tool_weights)
        arrays = []
        for b in batches:
            T = max(len(s[0]) for s in b)
            ids = np.full((len(b), T), pad_id, dtype=np.int64)
            w = np.zeros((len(b), T), dtype=np.float32)
            for r, (x, wt, _) in enumerate(b):
                ids[r, :len(x)] = x
                w[r, :len(x)] = wt
            arrays.append((ids, w, sum(len(s[0]) for s in b)))
        while not stop.is_set() and os.getppid() == parent:
            try:
                q.put((k, arrays, keys, tools), timeout=0.5)
                break
            except Exception:  # queue.Full
                continue
        k += n_workers


class ParallelBatches(Batches):
    """The same kind of stream, drawn by `workers` forked processes: pool k comes from `pool_rng(seed, k)` (so the
    stream is deterministic for a seed whatever the number of workers, but not the stream `Batches` draws) and the
    pools are taken in order k = 0, 1, 2, ... Start it before CUDA is initialised (the workers are forked)."""

    def __init__(self, enc: Encoder, seed: int, batch: int, total_steps: int, workers: int, pad_id: int,
                 **kw):
        import multiprocessing as mp

        super().__init__(enc, seed, batch, total_steps, **kw)
        ctx = mp.get_context("fork")
        self.seed, self.n_workers = seed, workers
        self._total = ctx.Value("l", int(total_steps))
        self._stop = ctx.Event()
        self._queues = [ctx.Queue(maxsize=2) for _ in range(workers)]
        self._procs = [ctx.Process(target=_pool_worker, daemon=True,
                                   args=(i, workers, self._queues[i], self._total, self._stop, enc, seed, batch,
                                         self.pool_batches, self.p_auto, self.p_tools, self.batch_tokens,
                                         self.progress_from, self.tools_from, self.tool_weights, pad_id))
                       for i in range(workers)]
        for p in self._procs:
            p.start()
        self.wait_s = 0.0  # time the trainer waited for data

    @property
    def total_steps(self) -> int:
        return self._total.value if hasattr(self, "_total") else self._total_init

    @total_steps.setter
    def total_steps(self, v: int) -> None:
        if hasattr(self, "_total"):
            self._total.value = int(v)
        else:
            self._total_init = int(v)

    def _refill(self) -> None:
        import queue as _queue

        k = self.refills
        t = time.time()
        while True:
            try:
                got, arrays, keys, tools = self._queues[k % self.n_workers].get(timeout=1.0)
                break
            except _queue.Empty:
                if not self._procs[k % self.n_workers].is_alive():
                    raise RuntimeError(f"data worker {k % self.n_workers} died "
                                       f"(exit code {self._procs[k % self.n_workers].exitcode})") from None
        self.wait_s += time.time() - t
        assert got == k, (got, k)
        self.refills += 1
        self.keys |= keys
        self.tool_samples += tools
        self.queue.extend(arrays)

    def next(self, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.queue:
            self._refill()
        ids, w, ntok = self.queue.pop()
        self.tokens += ntok
        self.samples += ids.shape[0]
        return torch.from_numpy(ids), torch.from_numpy(w)

    def close(self) -> None:
        self._stop.set()
        for p in self._procs:
            p.join(timeout=2)
            if p.is_alive():
                p.terminate()


def weighted_loss(logits: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy at the positions whose *target* token has weight > 0."""
    lg = logits[:, :-1].float()
    tgt = ids[:, 1:]
    wt = w[:, 1:]
    ce = torch.nn.functional.cross_entropy(lg.reshape(-1, lg.shape[-1]), tgt.reshape(-1), reduction="none")
    return (ce * wt.reshape(-1)).sum() / wt.sum().clamp(min=1.0)


# ------------------------------------------------------------------------------------------------
# Teacher-forced check (all answer tokens argmax-correct == greedy exact match)


def tf_items(enc: Encoder, seed: int, tools: bool = False):
    """Teacher-forced check items: 12 single turns of each kind, 60 recalls 3+ turns after the fact."""
    single = C.single_turn_eval(seed, 12)
    recall = C.recall_eval(seed + 1, 60)
    items = []
    for t in single:
        ids, w, n = enc.sample([t], False, aux=False)
        items.append((t.kind, ids, [p for p in range(n, len(ids)) if w[p] > 0]))
    for turns, scored in recall:
        ids, w, n = enc.sample(turns[: scored[0] + 1], False, aux=False)
        items.append(("recall", ids, [p for p in range(n, len(ids)) if w[p] > 0]))
    if tools:
        for d in C.tool_eval(seed + 2, 6):
            ids, w, n = enc.tool_sample(d)
            items.append(("tool_" + d.kind, ids, [p for p in range(n, len(ids)) if w[p] > 0]))
    return items


@torch.no_grad()
def tf_accuracy(model, items, pad_id: int) -> dict[str, float]:
    model.eval()
    ok: dict[str, list[int]] = {}
    for i in range(0, len(items), 32):
        chunk = items[i:i + 32]
        T = max(len(x[1]) for x in chunk)
        ids = torch.full((len(chunk), T), pad_id, dtype=torch.long)
        for r, (_, x, _) in enumerate(chunk):
            ids[r, :len(x)] = torch.tensor(x)
        dev = next(model.parameters()).device
        pred = model(input_ids=ids.to(dev)).logits.argmax(-1).cpu()  # one copy to the host per chunk
        for r, (kind, x, positions) in enumerate(chunk):
            good = all(int(pred[r, p - 1]) == x[p] for p in positions)
            ok.setdefault(kind, []).append(int(good))
    model.train()
    return {k: sum(v) / len(v) for k, v in ok.items()}


# ------------------------------------------------------------------------------------------------
# Model


def make_config(args, vocab: int, eos: int, pad: int):
    from transformers import Qwen3_5TextConfig

    hd = args.head_dim
    layer_types = ["full_attention" if (i + 1) % args.attn_every == 0 else "linear_attention" for i in range(args.layers)]
    return Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=args.hidden, intermediate_size=args.inter, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=hd,
        linear_num_key_heads=args.lin_heads, linear_key_head_dim=args.lin_head_dim,
        linear_num_value_heads=args.lin_heads, linear_value_head_dim=args.lin_head_dim,
        linear_conv_kernel_dim=4, layer_types=layer_types, max_position_embeddings=2048,
        tie_word_embeddings=True, eos_token_id=eos, pad_token_id=pad, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": balanced_sections(hd // 8), "mrope_interleaved": True},
    )


def lr_at(step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


# ------------------------------------------------------------------------------------------------
# transformers' greedy answers, recorded for the shipped-model test


def hf_check_conversations(seed: int, count: int) -> list[list[C.Turn]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count // 2):
        turns, _ = C.recall_conversation(rng, "eval", 3)
        out.append(turns)
    mk = C.Maker(rng, "eval")
    for kind in ("greet", "add", "reverse", "other", "repeat", "thanks", "fact"):
        if len(out) >= count:
            break
        out.append([mk.single(kind)])
    return out


@torch.no_grad()
def transformers_greedy(model, enc: Encoder, convs: list[list[C.Turn]], max_tokens: int = 32) -> list[dict]:
    """Per conversation, per turn: the prompt (rendered with the model's own earlier answers) and
    transformers' greedy ids (stop token excluded)."""
    model.eval()
    tok = enc.tok
    stops = sorted(tok.stop_ids)
    records = []
    for turns in convs:
        history: list[dict] = []
        rec = {"users": [t.user for t in turns], "expected": [t.answer for t in turns], "turns": []}
        for t in turns:
            history.append({"role": "user", "content": t.user})
            prompt = enc.prompt_ids(history, False)
            out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                                 eos_token_id=stops, pad_token_id=tok.pad_id)
            new = [int(x) for x in out[0, len(prompt):].tolist()]
            cut = next((i for i, x in enumerate(new) if x in tok.stop_ids), len(new))
            ids = new[:cut]
            text = tok.decode(ids)
            rec["turns"].append({"prompt_ids": prompt, "ids": ids, "text": text})
            history.append({"role": "assistant", "content": text})
        records.append(rec)
    return records


# ------------------------------------------------------------------------------------------------


def plot(log: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in log["losses"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r["loss"] for r in log["losses"]], label="train loss (assistant tokens)")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    if log.get("checks"):
        ax2 = ax.twinx()
        for key, style in (("single", "g.-"), ("recall", "m.-")):
            ax2.plot([c["step"] for c in log["checks"]], [c[key] for c in log["checks"]], style,
                     label=f"teacher-forced exact ({key})")
        ax2.set_ylim(0, 1.02)
        ax2.set_ylabel("exact answers")
        ax2.legend(loc="center right")
    ax.legend(loc="upper right")
    where = "GPU" if str(log["config"].get("device", "cpu")).startswith("cuda") else "CPU"
    what = "fine-tuned" if log["config"].get("finetune") else "trained"
    ax.set_title(f"demo-qwen35: {log['config']['params'] / 1e6:.2f}M params, {what} {log['train_wall_s'] / 60:.1f} "
                 f"min on {where}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def load_gguf_weights(model, path: Path) -> None:
    """Start from a demo GGUF's weights: its tensors renamed back to transformers' names, the GGUF conventions
    undone (norms stored as 1 + w, ssm_a = -exp(A_log), the conv kernel squeezed; the demo has as many value
    heads as key heads, so no head reordering). F16 matrices come back as they were stored."""
    from deltaserve.formats.gguf import read_gguf
    from deltaserve.formats.hf import _HF_LAYER_MAP
    from deltaserve.formats.source import GGUFSource

    src = GGUFSource(read_gguf(path))
    back = {g: (h, how) for h, (g, how) in _HF_LAYER_MAP.items()}
    want = model.state_dict()
    sd = {}
    for name in sorted(src.names()):
        t = src.dense(name).float()
        if name == "token_embd.weight":
            hf, how = "model.embed_tokens.weight", None
        elif name == "output_norm.weight":
            hf, how = "model.norm.weight", "plus_one"
        elif name == "output.weight":
            hf, how = "lm_head.weight", None
        else:
            _, i, suffix = name.split(".", 2)
            h, how = back[suffix]
            hf = f"model.layers.{i}.{h}"
        if how == "plus_one":
            t = t - 1.0
        elif how == "neg_exp":
            t = torch.log(-t)
        t = t.reshape(want[hf].shape)
        sd[hf] = t
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [m for m in missing if m != "lm_head.weight"]  # tied to the embeddings
    if missing or unexpected:
        raise RuntimeError(f"{path}: tensors missing {missing}, unexpected {unexpected}")


class StepBudget:
    """Fits the number of steps (and so the learning-rate schedule, which `lr_at` reads from args.steps) to a
    wall-time budget: from `first` steps on, and every `every` steps after, the seconds a step takes (measured over
    the last 100-150 steps, the teacher-forced checks excluded and costed apart) set the total so the loop ends
    within the budget. The total may grow while the schedule is in its first 40 % (the cosine has not moved much),
    and only shrink after; never past --steps."""

    def __init__(self, seconds: float, max_steps: int, check_every: int, first: int = 20, every: int = 50):
        self.seconds, self.max_steps, self.check_every = seconds, max_steps, check_every
        self.first, self.every = first, every
        self.marks: list[tuple[int, float]] = []  # (steps done, loop seconds without checks)
        self.plans: list[dict] = []

    def mark(self, done: int, busy_s: float) -> None:
        self.marks.append((done, busy_s))

    def due(self, done: int) -> bool:
        return done == self.first or (done > self.first and (done - self.first) % self.every == 0)

    def plan(self, done: int, total: int, elapsed_s: float, busy_s: float, check_s: float) -> int:
        base = [m for m in self.marks if m[0] <= done - 1]
        old = [m for m in base if m[0] <= done - 100]
        s0, t0 = (old[-1] if old else (base[min(len(base) - 1, 1)] if base else (0, 0.0)))
        if done - s0 <= 0:
            return total
        rate = (busy_s - t0) / (done - s0)
        remaining = self.seconds - elapsed_s
        more = (remaining - check_s) / (rate + check_s / max(1, self.check_every))
        new = min(self.max_steps, max(done, done + int(more)))
        if new > total and done > 0.4 * total:
            new = total
        if abs(new - total) <= max(1, 0.01 * total) and new >= done:
            new = total
        new = max(new, done)
        if new != total:
            self.plans.append({"at_step": done, "s_per_step": rate, "elapsed_s": elapsed_s, "steps": new})
            print(f"  budget: {rate * 1000:.0f} ms/step, {remaining:.0f} s left -> {new} steps (was {total})",
                  flush=True)
        return new


def train(args, enc: Encoder, tok: Tokenizer, vocab: int, out: Path):
    from transformers import Qwen3_5ForCausalLM

    device = torch.device(args.device)
    bkw = dict(p_tools=args.tools_frac, batch_tokens=args.batch_tokens, progress_from=1.0 if args.finetune else 0.0,
               tools_from=args.tools_from, tool_weights=args.tool_weights)
    if args.data_workers:  # forked before CUDA is initialised
        batches = ParallelBatches(enc, args.seed + 1, args.batch, args.steps, args.data_workers, tok.pad_id, **bkw)
    else:
        batches = Batches(enc, args.seed + 1, args.batch, args.steps, **bkw)
    cfg = make_config(args, vocab, tok.im_end_id, tok.pad_id)
    model = Qwen3_5ForCausalLM(cfg)
    if args.finetune:
        load_gguf_weights(model, args.finetune)
        model.tie_weights()
        print(f"fine-tuning from {args.finetune}", flush=True)
    model.to(device)
    model.train()
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.2f}M params, layers {cfg.layer_types}, device {device}", flush=True)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    okw = {"fused": True} if device.type == "cuda" else {}
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                            **okw)

    checks_items = tf_items(enc, 7001, tools=args.tools_frac > 0)
    log: dict = {"config": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                            "params": params, "vocab_rows": vocab, "tokens": tok.vocab_size,
                            "layer_types": cfg.layer_types},
                 "losses": [], "checks": []}
    budget = None
    if args.minutes:
        budget = StepBudget(args.minutes * 60, args.steps, args.check_every, first=args.plan_after)
    t0 = time.time()
    check_s = 0.0       # seconds spent in checks
    last_check = 0.0    # the last check's seconds
    ema = None

    def check(step_done: int) -> None:
        nonlocal check_s, last_check
        tc = time.time()
        acc = tf_accuracy(model, checks_items, tok.pad_id)
        singles = [v for k, v in acc.items() if k != "recall" and not k.startswith("tool_")]
        acc["single"] = sum(singles) / len(singles)
        log["checks"].append({"step": step_done, **acc, "elapsed_s": 0.0 if step_done == 0 else time.time() - t0})
        print(f"  check @ {step_done}: " + ", ".join(f"{k} {v:.3f}" for k, v in acc.items()), flush=True)
        last_check = time.time() - tc
        check_s += last_check

    if args.finetune:
        check(0)
    step = 0
    while step < args.steps:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args)
        ids, w = batches.next(tok.pad_id)
        if device.type == "cuda":  # pinned (cached) host buffers: the copy does not wait for the GPU
            ids = ids.pin_memory().to(device, non_blocking=True)
            w = w.pin_memory().to(device, non_blocking=True)
        logits = model(input_ids=ids).logits
        loss = weighted_loss(logits, ids, w)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        lt = loss.detach().double()  # the EMA in float64 on the device: no host sync per step
        ema = lt if ema is None else 0.95 * ema + 0.05 * lt
        if budget is not None:
            done = step + 1
            if done == 5 or budget.due(done):
                busy = time.time() - t0 - check_s
                budget.mark(done, busy)
                if budget.due(done):
                    new = budget.plan(done, args.steps, time.time() - t0, busy, last_check)
                    if new != args.steps:
                        args.steps = new
                        batches.total_steps = new
        if step % 10 == 0 or step == args.steps - 1:
            lv = float(lt)
            log["losses"].append({"step": step, "loss": lv, "ema": float(ema), "lr": lr_at(step, args),
                                  "grad_norm": float(gn), "elapsed_s": time.time() - t0})
            if step % 50 == 0:
                el = time.time() - t0
                print(f"step {step:5d} loss {lv:.4f} ema {float(ema):.4f} lr {lr_at(step, args):.2e} "
                      f"gn {float(gn):.2f} T {ids.shape[1]} tok/s {batches.tokens / max(el, 1e-9):.0f} "
                      f"elapsed {el / 60:.1f} min", flush=True)
        if (step + 1) % args.check_every == 0 or step == args.steps - 1:
            check(step + 1)
        step += 1
    batches.close()
    train_s = time.time() - t0
    log["train_wall_s"] = train_s
    log["train_steps"] = step
    log["train_tokens"] = batches.tokens
    log["train_samples"] = batches.samples
    log["train_tool_samples"] = batches.tool_samples
    log["train_pools"] = batches.refills
    log["final_loss_ema"] = None if ema is None else float(ema)
    if budget is not None:
        log["budget"] = {"minutes": args.minutes, "plans": budget.plans, "check_s": check_s}
        log["config"]["steps_max"] = budget.max_steps
        log["config"]["steps"] = step  # what ran, and what lr_at's schedule was fitted to
    if isinstance(batches, ParallelBatches):
        log["data_wait_s"] = batches.wait_s
    print(f"trained {step} steps in {train_s / 60:.1f} min ({batches.samples} samples, {batches.tool_samples} with "
          f"tools, {batches.tokens} tokens)", flush=True)

    return model, log, batches


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--steps", type=int, default=2100)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--min-lr-frac", type=float, default=0.05)
    ap.add_argument("--weight-decay", type=float, default=0.05)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--attn-every", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--lin-heads", type=int, default=4)
    ap.add_argument("--lin-head-dim", type=int, default=64)
    ap.add_argument("--bpe-size", type=int, default=1200)
    ap.add_argument("--threads", type=int, default=2,
                    help="torch CPU threads (default 2; use 1 when the box is busy: batched triangular solves stall "
                         "with 2 threads on a loaded 2-core machine)")
    ap.add_argument("--check-every", type=int, default=250)
    ap.add_argument("--finetune", type=Path, default=None,
                    help="start from this demo GGUF's weights (same shape and tokenizer) instead of from scratch")
    ap.add_argument("--tools-frac", type=float, default=0.0,
                    help="the fraction of samples that are tool round trips (corpus.ToolMaker)")
    ap.add_argument("--batch-tokens", type=int, default=None,
                    help="at most this many padded tokens per batch (long tool prompts make smaller batches)")
    ap.add_argument("--tools-from", type=float, default=0.0,
                    help="tool round trips only from this point of the curriculum on (a fraction of the steps; "
                         "from scratch, 0.22 keeps them out of the copying and adding phases)")
    ap.add_argument("--tool-weights", type=lambda v: tuple(float(x) for x in v.split(",")), default=None,
                    help="weights of the tool dialog kinds weather,weather2,add,plain (default corpus.ToolMaker's)")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda: where the model trains")
    ap.add_argument("--minutes", type=float, default=None,
                    help="a wall-time budget for the training loop: after a few steps the seconds a step takes set "
                         "the number of steps (at most --steps) and so the learning-rate schedule")
    ap.add_argument("--plan-after", type=int, default=20, help=argparse.SUPPRESS)
    ap.add_argument("--data-workers", type=int, default=0,
                    help="draw the samples in this many worker processes (a GPU step outruns one core's sampling); "
                         "0 (default): in the training process, the stream the shipped model was trained on")
    ap.add_argument("--tf32", action="store_true", help="CUDA: TF32 matrix products (default: full f32)")
    ap.add_argument("--type", default="f16", choices=["f16", "f32"], help="the GGUF type to install")
    ap.add_argument("--no-install", action="store_true", help="leave the repo's files alone")
    ap.add_argument("--skip-eval", action="store_true")
    ap.add_argument("--export-only", action="store_true",
                    help="skip training: reuse OUT/hf and OUT/training_log.json from an earlier run")
    args = ap.parse_args()

    t_start = time.time()
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)  # the decays underflow; denormal arithmetic is ~100x slower on CPU
    if args.device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: torch sees no CUDA device")
        torch.backends.cuda.matmul.allow_tf32 = args.tf32
        torch.backends.cudnn.allow_tf32 = args.tf32
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    out = args.out
    hf = out / "hf"
    out.mkdir(parents=True, exist_ok=True)

    import transformers

    transformers.logging.set_verbosity_error()
    from transformers import Qwen3_5ForCausalLM

    # 1. tokenizer
    raw_tok = train_tokenizer(args.seed, args.bpe_size)
    template = TEMPLATE.read_text(encoding="utf-8")
    save_hf_tokenizer(raw_tok, hf, template)
    tok = Tokenizer.from_hf_dir(hf)
    n_tokens = raw_tok.get_vocab_size(with_added_tokens=True)
    vocab = -(-n_tokens // 64) * 64
    print(f"tokenizer: {n_tokens} tokens ({args.bpe_size} BPE), embedding rows {vocab}", flush=True)
    enc = Encoder(tok)
    from deltaserve.formats.source import open_model

    def same_tokenizer(path: Path) -> bool:
        base = open_model(path).tokenizer
        return base.vocab_size == tok.vocab_size and all(
            base.token_bytes(i) == tok.token_bytes(i) for i in range(tok.vocab_size)) and base.merges() == tok.merges()

    if args.finetune:  # the same tokenizer, or the weights mean nothing
        if os.environ.get("DEMO_TRAIN_TEST_BASE_TOKENIZER") or not same_tokenizer(args.finetune):
            # another `tokenizers` release may learn other merges: take the base GGUF's tokenizer as it is
            print(f"note: the trained tokenizer is not {args.finetune}'s (seed {args.seed}, --bpe-size "
                  f"{args.bpe_size}); using that file's tokenizer", flush=True)
            raw_tok = open_model(args.finetune).tokenizer.backend
            save_hf_tokenizer(raw_tok, hf, template)
            tok = Tokenizer.from_hf_dir(hf)
            n_tokens = raw_tok.get_vocab_size(with_added_tokens=True)
            vocab = -(-n_tokens // 64) * 64
            enc = Encoder(tok)
            if not same_tokenizer(args.finetune):
                raise SystemExit(f"{args.finetune}: its tokenizer does not survive a round trip through an HF dir")
    same_as_shipped = same_tokenizer(INSTALL) if INSTALL.exists() else None
    print(f"tokenizer identical to the shipped model's: {same_as_shipped}", flush=True)

    if args.export_only:
        model = Qwen3_5ForCausalLM.from_pretrained(hf, dtype=torch.float32)
        log = json.loads((out / "training_log.json").read_text())
        batches = Batches(enc, args.seed + 1, args.batch, args.steps, p_tools=args.tools_frac,
                          batch_tokens=args.batch_tokens, progress_from=1.0 if args.finetune else 0.0,
                          tools_from=args.tools_from, tool_weights=args.tool_weights)
        pools = log.get("train_pools", -(-log["train_samples"] // (args.batch * batches.pool_batches)))
        for k in range(pools):  # the same conversations, for the overlap check
            if args.data_workers:
                batches.rng = pool_rng(args.seed + 1, k)
                batches.total_steps = log.get("train_steps", args.steps)
            batches._refill()
    else:
        t_train = time.time()
        model, log, batches = train(args, enc, tok, vocab, out)
        log["phases_s"] = {"before_training": t_train - t_start, "training": time.time() - t_train}
        model.cpu()  # export, the greedy check and the evaluation run on the CPU, in f32
        log["tokenizer_same_as_shipped"] = same_as_shipped
        model.save_pretrained(hf)
        (out / "training_log.json").write_text(json.dumps(log, indent=1))

    phases = log.setdefault("phases_s", {})
    t_phase = time.time()

    def phase(name: str) -> None:
        nonlocal t_phase
        phases[name] = time.time() - t_phase
        t_phase = time.time()

    # 4. disjointness of the held-out sets from everything trained on
    import evaluate as E

    single, recall = E.eval_sets()
    overlap_single = sum(1 for t in single if C.conversation_key([t]) in batches.keys)
    overlap_recall = sum(1 for turns, _ in recall if C.conversation_key(turns) in batches.keys)
    prefix_recall = sum(1 for turns, sc in recall if C.conversation_key(turns[: sc[0] + 1]) in batches.keys)
    t_single, t_recall = E.eval_sets(E.TEST_SINGLE_SEED, E.TEST_PER_KIND, E.TEST_RECALL_SEED, E.TEST_RECALL_COUNT)
    overlap_single += sum(1 for t in t_single if C.conversation_key([t]) in batches.keys)
    overlap_recall += sum(1 for turns, _ in t_recall if C.conversation_key(turns) in batches.keys)
    prefix_recall += sum(1 for turns, sc in t_recall if C.conversation_key(turns[: sc[0] + 1]) in batches.keys)
    log["overlap"] = {"single": overlap_single, "recall": overlap_recall, "recall_prefix": prefix_recall,
                      "checked": "evaluate.py's sets and the test sets against every trained conversation prefix"}
    print(f"held-out overlap with training conversations: {log['overlap']}", flush=True)
    phase("save_and_overlap")

    # 5. export
    model.eval()
    model.config.use_cache = True
    save_hf_tokenizer(raw_tok, hf, template)
    from deltaserve.formats.convert import convert

    ggufs = {}
    for t in ("f16", "f32"):
        ggufs[t] = convert(hf, out / f"demo-qwen35-{t}.gguf", t)
        print(f"wrote {ggufs[t]} ({ggufs[t].stat().st_size / 1e6:.2f} MB)", flush=True)
    phase("export")

    # 6. transformers' greedy answers, and deltaserve's on both GGUFs
    import deltaserve

    convs = hf_check_conversations(4242, 10)
    records = transformers_greedy(model, enc, convs)
    phase("transformers_greedy")
    agree = {}
    for t, path in ggufs.items():
        m = deltaserve.load(path)
        same = 0
        total = 0
        for rec in records:
            s = m.session(quiet=True)
            for turn in rec["turns"]:
                got = s.generate(turn["prompt_ids"], max_tokens=32)
                same += int(got.tokens == turn["ids"])
                total += 1
        agree[t] = f"{same}/{total}"
    log["hf_check_agreement"] = agree
    phase("deltaserve_agreement")
    print(f"deltaserve vs transformers greedy (turns identical): {agree}", flush=True)
    check = {"about": "transformers greedy ids (f32 HF model at training time) for the shipped demo GGUF's test",
             "max_tokens": 32, "conversations": records, "deltaserve_agreement": agree}

    install_type = args.type
    if agree.get(install_type) != agree.get("f32"):
        print(f"note: {install_type} changes answers vs f32; installing f32", flush=True)
        install_type = "f32"
    log["installed_type"] = install_type

    # 7. evaluation through deltaserve
    if not args.skip_eval:
        res = E.evaluate(ggufs[install_type], out / "eval.json")
        log["eval"] = {k: v for k, v in res.items() if k != "failures"}
        phase("evaluation")
    log["total_wall_s"] = time.time() - t_start
    (out / "training_log.json").write_text(json.dumps(log, indent=1))
    (out / "demo_hf_check.json").write_text(json.dumps(check, indent=None, separators=(",", ":")) + "\n")
    if not args.no_install:
        INSTALL.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ggufs[install_type], INSTALL)
        HF_CHECK.write_text(json.dumps(check, indent=None, separators=(",", ":")) + "\n")
        (HERE / "training_log.json").write_text(json.dumps(log, indent=1) + "\n")
        plot(log, HERE / "training_log.png")
        print(f"installed {INSTALL} ({install_type}, {INSTALL.stat().st_size / 1e6:.2f} MB)", flush=True)
    else:
        try:
            plot(log, out / "training_log.png")
        except ImportError as e:  # matplotlib is a test extra
            print(f"no plot: {e}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
