"""The resident session: one model on one backend, one decode state that outlives a call.

A turn that extends what the state holds prefills only the new suffix; a checkpoint taken before
the generation header lets a re-rendered history or a regenerate resume cheaply; the state grows by
doubling under a capacity plan; an accelerator that fails is left for the CPU, loudly, and the turn
is replayed there. See shared/design/session.md for the contract.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from contextlib import contextmanager
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from deltaserve.runtime import capacity as cap
from deltaserve.runtime.backend import AcceleratorFailure, Backend, CPUBackend
from deltaserve.runtime.engine import Blocking, Cancelled, Prefill, PrefillDone, Rows
from deltaserve.engine.state import Checkpoint, DecodeState, kv_torch_dtype, kv_type_for, kv_type_of
from deltaserve.engine.weights import trim_heap
from deltaserve.errors import BackendError, CapacityError, DeltaserveError
from deltaserve.session.decoding import DecodeLoop, TOKEN_ROWS  # noqa: F401 - TOKEN_ROWS: the session's name for it
from deltaserve.session.drafting import DraftPolicy
from deltaserve.session.forks import fork_turn
from deltaserve.session.driver import PreparedTurn, check_prompt
from deltaserve.session.driver import run as run_prepared
from deltaserve.session.grammar import CompiledFormat, compile_format
from deltaserve.session.sampling import SamplingParams
from deltaserve.session.store import read_state, write_state
from deltaserve.session.turns import Content, Reasoning, TurnRequest, ask, stop_ids
from deltaserve.session import thinking
from deltaserve.text.toolcalls import ToolCall
from deltaserve import settings

MIN_CAPACITY = 4096
TRIM_AFTER = 64  # prefilled tokens after which a turn hands freed heap memory back (malloc_trim: 3-6 ms)
PREFILL_ENV = "DELTASERVE_PREFILL_TOKENS"  # deltaserve.settings
FALLBACK_PREFIX = "[deltaserve] accelerator failure"

# on_token(token_id, text): called once per generated token with the text it completes (possibly "",
# while a UTF-8 character or a possible stop string is incomplete); a last call (None, text) hands out
# what was held back. Returning False cancels the turn.
OnToken = Callable[["int | None", str], "bool | None"]


@dataclass
class Timings:
    prefill_s: float = 0.0
    ttft_s: float = 0.0
    decode_s: float = 0.0


@dataclass
class Turn:
    """What one turn did."""

    tokens: list[int]
    text: str
    reused: int
    prefilled: int
    prompt_tokens: int
    finish_reason: str            # "stop" | "length" | "cancelled" | "tool_calls" (a chat turn that called tools)
    context_capped: bool
    backend: str
    start: str                    # "extend" | "checkpoint" | "store" | "reset" | "replay" (after a fallback)
    timings: Timings = field(default_factory=Timings)
    replayed: int = 0             # tokens run again on the CPU after a fallback in this turn (prompt and answer)
    reasoning: str | None = None  # what a chat turn reasoned before its answer (None: the prompt opened no reasoning)
    tool_calls: list[ToolCall] = field(default_factory=list)  # the calls a chat turn with tools made (text: the rest)
    drafted: int = 0              # tokens the MTP block drafted in this turn
    accepted: int = 0             # of them, those the model's own verification kept
    # a turn whose prompt opened a thought (session/thinking.py): the thought's tokens the model wrote, why it ended
    # ("model", "budget", "loop_guard", "unclosed"; None: no thought), and the tokens the turn inserted (the bridge
    # and the closing) and of the closing's markup (those and a `</think>` the model wrote)
    reasoning_tokens: int = 0
    reasoning_ended: str | None = None
    inserted_tokens: int = 0
    closing_tokens: int = 0
    logprobs: Any = None          # session/logprobs.Recorder: the tokens' log-probabilities, where they were asked for
    forks: list = field(default_factory=list)  # the other choices of a turn of n > 1 (session/forks.py), each a Turn
    schema_error: str | None = None  # finish_reason "schema_violation": what the answer breaks of its schema (turns.py)

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def generated(self) -> int:
        return len(self.tokens)

    @property
    def answer_tokens(self) -> int:
        """The tokens after the thought and its closing (all of them where the prompt opened no thought)."""
        return len(self.tokens) - self.reasoning_tokens - self.closing_tokens

    @property
    def prefill_tok_s(self) -> float:
        return self.prefilled / self.timings.prefill_s if self.timings.prefill_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        steps = max(len(self.tokens) - 1, 0)
        return steps / self.timings.decode_s if self.timings.decode_s > 0 else 0.0


def grown_capacity(positions: int, current: int, min_capacity: int, context: int) -> int:
    """The capacity a state grows to for a turn of `positions`: `min_capacity` doubled until it holds the
    turn (never below double the current one), clamped to the context. A one-call state
    (`min_capacity == 0`) is sized to the call exactly."""
    if min_capacity == 0:
        return positions
    capacity = max(min_capacity, 2 * current)
    while capacity < positions:
        capacity *= 2
    return max(min(capacity, context), positions)


class Session(DecodeLoop):
    """One resident decode state over a host model. Not thread-safe across turns: one turn at a time
    (a lock enforces it)."""

    def __init__(self, host, backend: Backend | None = None, *, context: int | None = None,
                 one_call: bool = False, guard=None, quiet: bool = False, plan_memory=None,
                 plan_positions: int | None = None, thinking_default: bool | None = None, notice: str | None = None,
                 store=None, label: str | None = None, log_prefills: bool = False, mtp: int | None = None,
                 loop_guard: bool | None = None, kv_type: str | None = None):
        self.host = host
        # the KV cache's type (engine/state.py: KV_TYPES; None: the default, f16), checked before anything is built
        self.kv_type = kv_type_for(host.config, kv_type)
        self.kv_dtype = kv_torch_dtype(self.kv_type)
        if mtp is not None and (isinstance(mtp, bool) or not isinstance(mtp, int) or mtp < 0):
            raise DeltaserveError(f"mtp must be a count of draft tokens >= 0 (0: off), got {mtp!r}")
        self.mtp_asked = mtp
        # a name for this session's lines (a server's "slot 1"), and whether each batched prefill's stats line is
        # printed (a server's log) or only kept (prefill_lines)
        self.label = label
        self.log_prefills = log_prefills
        # the conversation state store (deltaserve.session.store.StateStore) this session saves its checkpoints to and
        # restores from, shared with the other slots; None: the session keeps only its own
        self.store = store
        self.thinking_default = thinking_default  # enable_thinking when a chat turn does not say (None: the template's)
        # whether a thought that repeats itself is closed (session/thinking.py; None: DELTASERVE_LOOP_GUARD, on)
        self.loop_guard = settings.current().loop_guard if loop_guard is None else bool(loop_guard)
        self.tokenizer = host.tokenizer
        declared = host.config.context_length
        if context is not None and context < 1:
            raise DeltaserveError(f"the context must be at least 1 position, got {context}")
        self.context = min(context, declared) if context else declared
        self.min_capacity = 0 if one_call else MIN_CAPACITY
        # a one-call session takes no checkpoint: nothing resumes from it (its state is a recurrent layer's
        # whole matrix and more, ~20 MiB on the 0.8B shape, of the 300 MiB a `deltaserve run` may add to the file)
        self.one_call = one_call
        self.notices: list[str] = list(getattr(host.config, "notices", ()))  # the model file's (said at its load)
        self.quiet = quiet
        if notice:  # why the backend is not the one asked for, said before anything else
            self.say(notice)
        if context is not None and context > declared:
            self.say(f"[deltaserve] a context of {context} positions was asked for and the model declares {declared}: "
                     f"serving {declared}")
        self._lock = threading.Lock()
        self.partition: str | None = None  # whose conversation the state holds (None: the single tenant's)
        self.held: list[int] = []
        self.state: DecodeState | None = None
        self.capacity = 0
        self.allocations = 0
        self._checkpoint: Checkpoint | None = None
        self._checkpoint_tokens: tuple[int, ...] = ()
        self._checkpoint_stored = False  # handed to the store (then it is the store's: never written into)
        self._resume: tuple[tuple[int, ...], Checkpoint] | None = None  # a state read by restore(path), not yet used
        self._guard = guard
        self._plan_memory = plan_memory  # tests inject a Memory; None measures the backend
        self.per_token = settings.current().prefill_tokens
        # no batched prefill plan fitted the device's free memory when the state was last sized: each prefill asks
        # again whether one fits now (it is decided per prefill, never for good)
        self._one_token = False
        self._replayed = 0  # tokens replayed on the CPU in the current turn
        self.replays = 0  # fallbacks that replayed a turn's tokens, since the session started
        self.batched_prefills = 0
        self.image_prefills = 0  # prefills that encoded and fed images
        self._images: dict[int, object] = {}  # a turn's images, by their first placeholder id
        self._recorder = None  # a turn's log-probabilities (session/logprobs.Recorder), when asked for
        self._forks = None  # a turn's other choices (session/forks.Forks), when n > 1 were asked for
        self.prefill_lines: deque[str] = deque(maxlen=16)  # the last batched prefills, one stats line each
        self.turns = 0
        if self.per_token:
            self.say(f"[deltaserve] {PREFILL_ENV}=on: prompts prefill one token at a time, not batched")
        self.im_start = self.tokenizer.im_start_id
        self.stop_ids = stop_ids(self.tokenizer, host.config)
        if guard is not None and backend is not None and backend.accelerator:
            host.sha256()  # the guard's cache key, computed now: never inside the first turn's time to first token
        self._policy: DraftPolicy | None = None  # speculative decoding with the file's MTP block (None: off)
        self._turn_drafts = (0, 0)  # the last turn's drafted and accepted tokens
        self._snaps = None
        self.backend = self._start(backend or CPUBackend(host), plan_positions)
        self._policy = self._drafting()

    # -- notices ----------------------------------------------------------------------------------
    def say(self, line: str) -> None:
        """Print a route decision once to stderr (named by the session's label) and keep it, in order. A fallback
        is printed even by a quiet session: it is never silent."""
        self.notices.append(line)
        if not self.quiet or line.startswith(FALLBACK_PREFIX):
            self._print(line)

    def _print(self, line: str) -> None:
        if self.label:
            line = line.replace("[deltaserve] ", f"[deltaserve] [{self.label}] ", 1) if line.startswith("[deltaserve] ") \
                else f"[{self.label}] {line}"
        print(line, file=sys.stderr, flush=True)

    def _start(self, backend: Backend, plan_positions: int | None) -> Backend:
        try:
            if backend.accelerator and plan_positions:
                # before a byte is uploaded: weights + the call's state against the device's free memory.
                # A refusal is an error (CapacityError), never a fallback.
                memory = self._plan_memory if self._plan_memory is not None else backend.memory()
                cap.plan(self.host.config, min(plan_positions, self.context), memory,
                         weights=self.host.weights.nbytes, overhead=backend.overhead, kv_type=self.kv_type)
            backend.start()
        except AcceleratorFailure as e:
            self._say_fallback(str(e))
            backend = backend.fallback()
            backend.start()
        self.say(f"Backend: {backend.describe(self.kv_type)} [{self.host.config.describe()}]")
        return backend

    def _say_fallback(self, reason: str) -> None:
        self.say(f"{FALLBACK_PREFIX}, falling back to CPU: {reason}")

    @property
    def on_accelerator(self) -> bool:
        return self.backend.accelerator

    @property
    def checkpoint_length(self) -> int:
        return len(self._checkpoint_tokens) if self._checkpoint is not None else 0

    # -- capacity ---------------------------------------------------------------------------------
    def _memory(self):
        return self._plan_memory if self._plan_memory is not None else self.backend.memory()

    def _plan(self, capacity: int) -> cap.Plan:
        memory = self._memory()
        if self.state is not None:  # the old state is freed before the new one is allocated
            memory = type(memory)(memory.free + self.state.nbytes, memory.total, memory.source)
        p = cap.plan(self.host.config, capacity, memory, weights=0, overhead=self.backend.overhead,
                     resident=self.host.weights.nbytes, speculative=self._speculative_bytes(capacity),
                     kv_type=self.kv_type)
        if p.passed_over:
            self.say(f"[deltaserve] prefill plan for {capacity} positions: {'; '.join(p.passed_over)}; "
                     f"using {p.prefill.label}")
        return p

    def _reserve(self, positions: int) -> bool:
        """Make the state hold `positions`; True when it was (re)allocated (what it held is gone)."""
        if self.state is not None and positions <= self.capacity:
            return False
        capacity = grown_capacity(positions, self.capacity, self.min_capacity, self.context)
        try:
            p = self._plan(capacity)  # on the CPU a refusal is an error, never a fallback
        except CapacityError as e:
            if not self.backend.accelerator:
                raise
            p = self._plan_one_token(capacity, getattr(e, "refused", []))  # the state fits, no batched prefill
            if p is None:  # a resident session that must grow and has no room on the device goes on on the CPU
                self._move_to_cpu(f"the state cannot grow to {capacity} positions on the device: {e}",
                                  allocate=False)
                p = self._plan(capacity)
        self._one_token = p.prefill.rows == 1 and not self.per_token
        self.held = []
        self._drop_checkpoint()
        self.state = None
        while True:
            try:
                self.state = self.backend.new_state(capacity, p.prefill, self.kv_dtype)
                break
            except AcceleratorFailure as e:
                self._move_to_cpu(str(e), allocate=False)
        self.capacity = capacity
        self.allocations += 1
        self._attach_drafting()
        return True

    def _plan_one_token(self, capacity: int, refused: list[str]) -> cap.Plan | None:
        """The plan of a state whose prefills go one token at a time (the smallest workspace), with a notice naming
        what each refused batched plan needed; None when even that does not fit."""
        memory = self._memory()
        if self.state is not None:
            memory = type(memory)(memory.free + self.state.nbytes, memory.total, memory.source)
        try:
            p = cap.plan(self.host.config, capacity, memory, weights=0, overhead=self.backend.overhead,
                         resident=self.host.weights.nbytes, plans=(cap.PrefillPlan(1, 1),), kv_type=self.kv_type)
        except CapacityError:
            return None
        if not self.per_token:
            self.say(f"[deltaserve] no batched prefill plan fits {capacity} positions on {self.backend.name} "
                     f"({'; '.join(refused)}): prefilling one token at a time there, asking again at each "
                     f"prefill ({p.arithmetic()})")
        return p

    def _batched_fits_again(self) -> bool:
        """Whether a batched prefill plan fits the state's capacity in the memory free now (a state sized for one
        token at a time asks at each prefill): if so the state takes that plan's rows, and it is said."""
        memory = self._memory()
        memory = type(memory)(memory.free + self.state.nbytes, memory.total, memory.source)
        try:
            p = cap.plan(self.host.config, self.capacity, memory, weights=0, overhead=self.backend.overhead,
                         resident=self.host.weights.nbytes, kv_type=self.kv_type)
        except CapacityError:
            return False
        self.state.prefill_rows, self.state.query_rows = p.prefill.rows, p.prefill.query_rows
        self._one_token = False
        self.say(f"[deltaserve] a batched prefill fits {self.capacity} positions on {self.backend.name} again: "
                 f"{p.prefill.label} ({p.arithmetic()})")
        return True

    def _drop_checkpoint(self) -> None:
        self._checkpoint = None
        self._checkpoint_tokens = ()
        self._checkpoint_stored = False

    def _move_to_cpu(self, reason: str, allocate: bool = True) -> None:
        self._say_fallback(reason)
        if self.backend.accelerator:
            self._plan_memory = None  # an injected memory stood for the device's: the CPU's is measured
            self._one_token = False
        self.backend = self.backend.fallback()
        self.backend.start()
        self.say(f"Backend: {self.backend.describe(self.kv_type)} [after the fallback]")
        self.held = []
        self._drop_checkpoint()
        self.state = None
        if allocate:
            p = self._plan(self.capacity)
            self.state = self.backend.new_state(self.capacity, p.prefill, self.kv_dtype)
            self.allocations += 1

    # -- where a prompt starts --------------------------------------------------------------------
    def checkpoint_position(self, prompt: Sequence[int]) -> int:
        """Just before the prompt's last <|im_start|> (its generation header), else before its last token."""
        if self.im_start is not None:
            for i in range(len(prompt) - 1, 0, -1):
                if prompt[i] == self.im_start:
                    return i
        return len(prompt) - 1

    def _where_to_start(self, prompt: Sequence[int]) -> tuple[str, int]:
        """("extend", len(held)) when the prompt strictly extends what the state holds; ("checkpoint", n) when
        the checkpoint (n tokens) is a proper prefix of it; else ("reset", 0)."""
        n = len(self.held)
        if 0 < n < len(prompt) and list(prompt[:n]) == self.held:
            return "extend", n
        ck = self._checkpoint_tokens
        if self._checkpoint is not None and 0 < len(ck) < len(prompt) and tuple(prompt[:len(ck)]) == ck:
            return "checkpoint", len(ck)
        return "reset", 0

    def reusable(self, prompt: Sequence[int], partition: str | None = None) -> int:
        """How many of `prompt`'s tokens a turn (of `partition`) would not prefill again from what this session
        holds."""
        return self._where_to_start(prompt)[1] if partition == self.partition else 0

    def _decide_start(self, prompt: list[int]):
        """(kind, reused) as `_where_to_start` says, the state restored or reset to match (a coroutine: the store's
        read of a saved state runs off the engine loop's thread)."""
        kind, n = self._where_to_start(prompt)
        if self._resume is not None:  # a state read from a file: kept apart until a turn uses it (any reallocation
            tokens, ck = self._resume  # before that turn drops what the state held, not this)
            if n < len(tokens) < len(prompt) and tuple(prompt[:len(tokens)]) == tokens:
                self._resume = None
                return self._restore_stored(tokens, ck, "checkpoint")
        if self.store is not None:
            found = yield Blocking(self.store.take, (prompt, n, kind == "reset", self.partition))
            if found is not None:
                return self._restore_stored(*found)
        if kind == "checkpoint":
            ck = self._checkpoint_tokens
            try:
                self.backend.restore(self.state, self._checkpoint, _common_prefix(self.held, ck))
            except AcceleratorFailure as e:
                self._move_to_cpu(f"the device checkpoint would not restore: {e}")
                return "reset", 0
            except Exception as e:  # noqa: BLE001 - a half-restored state and its checkpoint are never reused
                self._forget()
                raise BackendError(f"the checkpoint of {len(ck)} tokens would not restore: "
                                   f"{type(e).__name__}: {e}") from e
            self.held = list(ck)
        elif kind == "reset":
            self._reset_in_place()
        return kind, n

    def _restore_stored(self, tokens: tuple[int, ...], ck: Checkpoint, kind: str = "store") -> tuple[str, int]:
        """Restore a stored state into this session's state (a copy: the store's stays as it is; a KV cache saved in
        another type is converted to this session's, and it is said)."""
        self._say_kv_conversion(ck, len(tokens))
        try:
            self.backend.restore(self.state, ck, _common_prefix(self.held, tokens))
        except AcceleratorFailure as e:
            self._move_to_cpu(f"a stored state would not restore on the device: {e}")
            return "reset", 0
        except Exception as e:  # noqa: BLE001 - a half-restored state is never reused
            self._forget()
            raise BackendError(f"a stored state of {len(tokens)} tokens would not restore: "
                               f"{type(e).__name__}: {e}") from e
        self.held = list(tokens)
        self._checkpoint, self._checkpoint_tokens, self._checkpoint_stored = ck, tuple(tokens), True
        return kind, len(tokens)

    def _reset_in_place(self) -> None:
        try:
            self.backend.reset(self.state)
        except AcceleratorFailure as e:
            self._move_to_cpu(f"the device state would not reset: {e}")
        self.held = []

    # -- feeding tokens -----------------------------------------------------------------------------
    def _feed(self, seq: list[int], start: int, ck_at: int | None):
        """Advance the state from holding seq[:start] to holding seq (a coroutine of engine work); the logits at the
        last position, and the position the feed really started from (0 after a fallback replay).

        Crossing `ck_at` saves a checkpoint there. An accelerator failure moves the session to the CPU
        and replays all of `seq` there. A cancel (the client left) keeps what was fed and raises `Cancelled`. Any
        other failure clears `held` and the checkpoint and raises.
        """
        while True:
            try:
                with self._or_forget(f"the forward failed at position {start}"):
                    logits = yield from self._feed_on_backend(seq, start, ck_at)
                self.held = seq
                return logits, start
            except Cancelled:
                if self.state is not None:  # the engine feeds whole chunks: what the state holds is exact
                    self.held = list(seq[:self.state.length])
                raise
            except AcceleratorFailure as e:
                self._move_to_cpu(str(e))
                self._replayed += len(seq)  # all of it runs again on the CPU
                self.replays += 1
                self.say(f"[deltaserve] replaying {len(seq)} tokens on the CPU after the fallback")
                start = 0

    @contextmanager
    def _or_forget(self, what: str):
        """Work on the state that may leave it half-valid: on a failure the state is forgotten (never reused) and the
        error raised, ours as it is, any other as a BackendError saying `what`: its type and text. An accelerator's
        failure passes untouched (the caller moves to the CPU)."""
        try:
            yield
        except (AcceleratorFailure, Cancelled):
            raise
        except DeltaserveError:
            self._forget()
            raise
        except Exception as e:  # noqa: BLE001 - a half-valid state is never reused
            self._forget()
            raise BackendError(f"{what}: {type(e).__name__}: {e}") from e

    def _forget(self) -> None:
        self.held = []
        self._drop_checkpoint()
        if self.state is not None:
            self.state.length = 0

    def _feed_on_backend(self, seq: list[int], start: int, ck_at: int | None):
        self.held = []  # until the feed completes, what the state holds is not trusted
        state = self.state
        if state.length != start:
            raise BackendError(f"internal: the state holds {state.length} positions, expected {start}")
        cut = ck_at if ck_at is not None and start <= ck_at < len(seq) and ck_at > 0 else None
        if cut is not None and cut > start:
            yield from self._span(seq[start:cut])
        if cut is not None and tuple(seq[:cut]) != self._checkpoint_tokens:
            if self.store is not None:  # kept by the store once the turn ends: its own buffers, never refilled
                self._checkpoint = self.backend.save(state, None, exact=True)
            else:
                self._checkpoint = self.backend.save(state, self._checkpoint)
            self._checkpoint_tokens = tuple(seq[:cut])
            self._checkpoint_stored = False
        return (yield from self._span(seq[cut if cut is not None else start:]))

    def _image_rows(self, tokens: list[int]):
        """A span's ids with its images' placeholder ids as the image token, and their `ImageSpan` (the images
        encoded now: only those whose rows this span feeds); (tokens, None) for text."""
        vocab = self.host.config.vocab_size
        if max(tokens) < vocab:
            return tokens, None
        vision = self.host.vision
        if vision is None:
            raise DeltaserveError("this prompt holds image tokens and the model has no vision encoder")
        line = f"[deltaserve] vision tower: {vision.encoder.route()}"
        if line not in self.notices:
            self.say(line)
        real, images = [], []
        for i, t in enumerate(tokens):
            if t < vocab:
                real.append(t)
                continue
            real.append(vision.image_token_id)
            if i == 0 or tokens[i - 1] < vocab:  # an image's first token: which image it is
                image = self._images.get(t)
                if image is None:
                    raise DeltaserveError("the prompt holds an image this turn was not given (one an earlier turn "
                                          "sent, whose state is no longer held): send the image again")
                images.append(image.image)
        return real, vision.span(real, images, self.state.length + self.state.rope_delta)

    def _span(self, tokens: list[int]):
        """Feed a span at the state's position (a coroutine of engine work): the batched path for more than one token
        (the engine loop cuts it into chunks between other sequences' steps), image rows whole, else one token at a
        time. The last position's logits."""
        tokens, images = self._image_rows(tokens)
        if images is not None:  # image rows go through the prefill, whatever their count
            start = self.state.length
            done: PrefillDone = yield Prefill(self.backend, self.state, tokens, images=images)
            self.batched_prefills += 1
            self.image_prefills += 1
            self.prefill_lines.append(f"prefill with images: {len(tokens)} tokens ({images.embeds.shape[0]} of them "
                                      f"image patches) in {done.seconds * 1000:.0f} ms, from position {start}")
            if self.log_prefills:
                self._print(f"[deltaserve] {self.prefill_lines[-1]}")
            return done.logits
        rows = self._recorder.on_rows if self._recorder is not None and self._recorder.echo else None  # logprobs
        if len(tokens) > 1 and not self.per_token and (not self._one_token or self._batched_fits_again()):
            state, start = self.state, self.state.length
            done = yield Prefill(self.backend, state, tokens, fit=self._chunk_fit, rows=rows)
            ms = done.seconds * 1000
            self.batched_prefills += 1
            chunks = f"{done.calls} chunks, " if done.calls > 1 else ""
            self.prefill_lines.append(
                f"batched prefill: {len(tokens)} tokens in {ms:.0f} ms ({len(tokens) / max(ms, 1e-6) * 1000:.1f} tok/s, "
                f"{chunks}chunk {state.prefill_rows} rows, attention {state.query_rows} query rows, from position {start})")
            if self.log_prefills:
                self._print(f"[deltaserve] {self.prefill_lines[-1]}")
            return done.logits
        logits = None
        for t in tokens:
            logits = (yield Rows(self.backend, self.state, [t]))[-1]
            if rows is not None:  # log-probabilities: this row scores the prompt's next token
                rows(logits[None], self.state.length - 1)
        return logits

    def _chunk_fit(self) -> int:
        """Asked by the engine loop before each prefill chunk: the rows a forward call may take in the memory free
        now. The state's plan goes one chunk size down (said) where its own no longer fits, back up where a larger
        one fits again; 0 (said once) where no batched plan fits: that chunk goes one token at a time."""
        if self._plan_memory is None and not self.backend.accelerator:
            return self.state.prefill_rows  # the CPU's plan was checked at allocation; a CPU refusal is an error
        memory = self._memory()
        memory = type(memory)(memory.free + self.state.nbytes, memory.total, memory.source)
        try:
            p = cap.plan(self.host.config, self.capacity, memory, weights=0, overhead=self.backend.overhead,
                         resident=self.host.weights.nbytes, kv_type=self.kv_type)
        except CapacityError as e:
            if not self._one_token:
                self._one_token = True
                self.say(f"[deltaserve] no batched prefill plan fits {self.capacity} positions on {self.backend.name} "
                         f"now ({'; '.join(getattr(e, 'refused', []))}): prefilling one token at a time there, "
                         f"asking again at each chunk")
            return 0
        if (p.prefill.rows, p.prefill.query_rows) != (self.state.prefill_rows, self.state.query_rows) or self._one_token:
            self.state.prefill_rows, self.state.query_rows = p.prefill.rows, p.prefill.query_rows
            self._one_token = False
            self.say(f"[deltaserve] prefill plan for {self.capacity} positions on {self.backend.name} at this chunk: "
                     f"{p.prefill.label} ({p.arithmetic()})")
        return p.prefill.rows

    # -- a turn -----------------------------------------------------------------------------------
    def generate(self, prompt_ids: Sequence[int], max_tokens: int = 256, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, min_p: float | None = None,
                 repetition_penalty: float = 1.0, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                 seed: int | None = None, stop: Sequence[str | int] | None = None,
                 on_token: OnToken | None = None, response_format=None, keep_end: bool = False,
                 images: Sequence = (), cancel: threading.Event | None = None, partition: str | None = None,
                 thinking_budget: int | None = None, thinking_message: str | None = None, logprobs=None,
                 forks=None) -> Turn:
        """One turn from raw prompt ids. `response_format` (OpenAI's: {"type": "json_object"} or {"type":
        "json_schema", "json_schema": {"schema": {...}}}, or a `grammar.CompiledFormat`) constrains every generated
        token from the first one to the grammar (deltaserve.session.grammar); the turn ends ("stop") when it is complete.

        `keep_end`: the turn's checkpoint is the state after its last fed token (what `held` is when it ends), not the
        one before the prompt's generation header: for a conversation that continues from exactly what the state
        holds (the Responses API's previous_response_id), whose next prompt extends this one's tokens and answer.

        `images` (deltaserve.vision.inputs.ImageInput): the images whose placeholder ids the prompt holds
        (`TurnRequest.encode` writes them); those the state does not hold yet are encoded and prefilled in place.

        The turn runs as a sequence of the engine loop (runtime/engine.py), which batches its forwards with the other
        sequences' and cuts its prefill into chunks between their steps. `cancel`: an event whose setting ends the turn
        at its next step ("cancelled"; what was fed stays held). `partition`: whose conversation this is (a tenant, a
        cache salt): a state held or stored for another partition is never reused for it.

        A prompt that leaves the model inside a thought (session/thinking.py): `thinking_budget` thinking tokens at
        most (None: unlimited; 0: the thought closed at once), after which the turn writes the closing
        (`thinking_message`, a bridge sentence, then `</think>` and a blank line) and the answer runs under its own
        `max_tokens`; the loop guard (`loop_guard`) closes a thought that repeats itself the same way.

        `logprobs` (session/logprobs.Recorder): each generated token's log-probability (and its top tokens') is
        recorded there; with its `echo`, the prompt's too, from the prefill's rows (the whole prompt is prefilled:
        rows a state already holds have no logits to give). `forks` (session/forks.Forks): n - 1 more choices, forks
        of the state after the prompt decoded beside this one (the Turn's `forks`)."""
        params = SamplingParams(temperature, top_k, top_p, min_p, repetition_penalty, presence_penalty,
                                frequency_penalty, seed)
        grammar = self.compile_format(response_format)
        with self._lock:
            self._images = {im.ids(self.host.config.vocab_size, 1)[0]: im for im in images}
            self._recorder, self._forks = logprobs, forks
            try:
                self._enter_partition(partition)
                turn = self._turn(list(int(t) for t in prompt_ids), max_tokens, params, stop, on_token, grammar,
                                  keep_end, (thinking_budget, thinking_message))
                try:
                    done = self.backend.engine.drive(turn, cancel, self.label)
                except BaseException:
                    if forks is not None:
                        forks.abandon()
                    raise
                if forks is not None:  # n > 1: the other choices, as their sequences end (session/forks.py)
                    done.forks = [fork_turn(done, r, forks.limited, Turn) for r in forks.wait()]
                return done
            finally:
                self._forks = None
                self._images = {}
                self._recorder = None

    def compile_format(self, response_format) -> CompiledFormat | None:
        """`response_format` compiled for this model's tokenizer (cached per schema); None for text / absent. A
        schema the engine cannot compile raises grammar.GrammarError (a DeltaserveError naming the problem)."""
        return compile_format(self.tokenizer, response_format, self.host.config.vocab_size, self.stop_ids)

    def render(self, messages, enable_thinking: bool | None = None, tools=None) -> tuple[list[int], bool]:
        """The prompt ids of a conversation rendered with the model's chat template (generation header added),
        and whether it leaves the model reasoning. `enable_thinking` None: the model's default. `tools`: the
        functions offered (OpenAI's list), rendered by the template. As `chat` renders them (`turns.ask`)."""
        request = ask(messages, tools, enable_thinking=enable_thinking, image_files=True)
        prompt = request.prompt(self.tokenizer, self.thinking_default)
        return request.encode(prompt, self.tokenizer, self.host.vision if request.images else None,
                              self.host.config.vocab_size), prompt.thinking

    def chat(self, messages, max_tokens: int = 256, enable_thinking: bool | None = None,
             on_token: OnToken | None = None, on_reasoning: Callable[[str], None] | None = None,
             response_format=None, tools=None, tool_choice=None, parallel_tool_calls: bool = True,
             on_event: Callable[[Any], None] | None = None, **sampling) -> Turn:
        """Render `messages` with the model's template and run a turn, through the one turn pipeline every
        frontend uses (`session.turns`). The Turn's `text` is the answer alone (no template markup); what the
        model reasoned first is in `reasoning`. `on_token` sees the answer's text, `on_reasoning` the reasoning's,
        `on_event` every event (`turns.Reasoning`, `Content`, `CallStart`, `CallArguments`, `Finish`), as they
        stream.

        With a `response_format` (see `generate`) the answer is constrained: thinking is off for the turn unless
        `enable_thinking=True` asks for it, and then the grammar starts after the thought's closing (bound the thought
        with `thinking_budget`). Only the answer is ever constrained. `thinking_budget=0` renders thinking off.

        Images: a message's content may hold image parts ({"type": "image", "image": a PIL image, bytes or a path},
        or OpenAI's {"type": "image_url", "image_url": {"url": "data:..."}}) on a model with a vision encoder (an HF
        checkpoint directory with model.visual.*). Each is encoded once, when its rows are first prefilled; a later
        turn that extends the conversation prefills only its new text (deltaserve.vision.inputs).

        `tools` (OpenAI's list of functions) are offered through the template; the calls the model writes come
        back parsed in `turn.tool_calls` (`text.toolcalls`: offered functions only, arguments typed by their
        schemas), the rest of the answer in `text`, and `finish_reason` is "tool_calls". `tool_choice`: "auto"
        (default), "none" (the tools are not rendered and nothing is parsed), "required" or {"type": "function",
        "function": {"name": N}} (enforced by a grammar, thinking off); `parallel_tool_calls` False: at most one
        call (enforced). A `response_format` with tools on "auto": the answer is calls or JSON of the format. A
        call the budget cut is dropped (never content). Assistant messages may carry `tool_calls` (arguments as
        JSON strings or objects, or the ToolCalls of an earlier turn) and `tool` messages the results; several or
        late system messages are merged, in order, into the leading one."""
        enable_thinking = thinking.rendered_thinking(enable_thinking, sampling.get("thinking_budget"))
        request = ask(messages, tools, tool_choice, parallel_tool_calls, response_format, enable_thinking,
                      image_files=True)
        prompt = request.prompt(self.tokenizer, self.thinking_default)
        ids = request.encode(prompt, self.tokenizer, self.host.vision if request.images else None,
                             self.host.config.vocab_size)
        return self.run_turn(request, ids, prompt.thinking, max_tokens, on_token, on_reasoning, on_event, **sampling)

    def run_turn(self, request: TurnRequest, prompt_ids: Sequence[int], thinking: bool, max_tokens: int = 256,
                 on_token: OnToken | None = None, on_reasoning: Callable[[str], None] | None = None,
                 on_event: Callable[[Any], None] | None = None, **sampling) -> Turn:
        """A chat turn already rendered (`request.prompt(...)`: its ids, and whether it leaves the model reasoning),
        run through the turn driver (session/driver.py) as `chat` runs it: for a caller that needed the ids first
        (`run` plans its memory from their count). `on_token(None, text)` sees the answer's text, `on_reasoning` the
        reasoning's, `on_event` every event."""
        grammar = request.grammar(self.tokenizer, self.host.config.vocab_size, self.stop_ids)

        def on(e) -> bool | None:
            if on_event is not None:
                on_event(e)
            if isinstance(e, Reasoning) and on_reasoning is not None:
                on_reasoning(e.text)
            elif isinstance(e, Content) and on_token is not None:
                return on_token(None, e.text)
            return None

        return run_prepared(self, PreparedTurn(list(prompt_ids), thinking, request, grammar), max_tokens,
                          on_event=on, **sampling)

    def _enter_partition(self, partition: str | None) -> None:
        """A turn of another partition than what the state holds: nothing held or checkpointed is reused for it."""
        if partition != self.partition:
            if self.held or self._checkpoint is not None:
                self.held = []
                self._drop_checkpoint()
                self._resume = None
            self.partition = partition

    def _turn(self, prompt: list[int], max_tokens: int, params: SamplingParams, stop, on_token,
              grammar: CompiledFormat | None = None, keep_end: bool = False, think=(None, None)):
        """One turn, as a coroutine of engine work (runtime/engine.py): returns its Turn. `think`: the thinking budget
        and bridge sentence (session/thinking.py)."""
        t0 = time.perf_counter()
        n = len(prompt)
        self._replayed = 0
        # an image's placeholder ids: this turn's images, or earlier ones the state holds (_image_rows says where not)
        check_prompt(prompt, self.host.config.vocab_size, self.context,
                     images=bool(self._images) or (max(prompt, default=0) >= self.host.config.vocab_size
                                                   and self.host.vision is not None))
        if max_tokens < 1:
            raise DeltaserveError(f"max_tokens must be at least 1, got {max_tokens}")
        stop_ids, stop_texts = set(self.stop_ids), []
        for s in stop or ():
            (stop_ids.add(int(s)) if isinstance(s, int) else stop_texts.append(str(s)))
        # [thinking] a prompt that opens a thought: its budget and loop guard (the answer's own max_tokens after it)
        thought = thinking.start(self, prompt, max_tokens, *think, stop_ids, grammar is not None)
        want = max_tokens if thought is None else thought.own_bound
        budget = min(want, self.context - n)
        limited = budget < want

        try:
            self.backend.bind_thread()
        except AcceleratorFailure as e:
            self._move_to_cpu(str(e), allocate=self.state is not None)
        self._reserve(n + budget)
        if self._guard is not None and self.backend.accelerator:
            guard, self._guard = self._guard, None  # once per session
            try:
                rejection = guard(self.backend, self.host,
                                  [t for t in prompt if t < self.host.config.vocab_size], self.say)
            except AcceleratorFailure as e:
                rejection = f"the parity probe failed: {e}"
            if rejection is not None:
                self._move_to_cpu(rejection)
        start_kind, start = yield from self._decide_start(prompt)
        if self._recorder is not None and self._recorder.echo:  # log-probabilities of the prompt: all of it prefilled
            self._recorder.start_prompt(prompt)
            if start > 0:
                self._reset_in_place()
                start_kind, start = "reset", 0

        prefill_t0 = time.perf_counter()
        try:
            logits, start = yield from self._feed(prompt, start,
                                                  None if self.one_call or keep_end else self.checkpoint_position(prompt))
        except Cancelled:  # the client left while the prompt prefilled: what was fed is held, nothing generated
            self._store_checkpoint()
            return Turn(tokens=[], text="", reused=start, prefilled=len(self.held) - start, prompt_tokens=n,
                        finish_reason="cancelled", context_capped=False, backend=self.backend.name, start=start_kind,
                        timings=Timings(prefill_s=time.perf_counter() - prefill_t0), replayed=self._replayed)
        prefill_s = time.perf_counter() - prefill_t0
        if not bool(torch.isfinite(logits).all()):  # NaN or inf weights: never an answer sampled from garbage
            self._forget()
            raise BackendError(f"the model gave non-finite logits (NaN or infinity) for a prompt of {n} tokens: "
                               f"its weights are likely corrupt ({self.host.path.name})")
        if start == 0:
            start_kind = "reset"
        if self._forks is not None and len(self._forks):  # n > 1: the state after the prompt forked (session/forks.py)
            self._forks.start(self, prompt, logits, budget, limited, params, stop_ids, stop_texts, t0, grammar,
                              lambda child: thinking.start(child, prompt, max_tokens, *think, stop_ids,
                                                           grammar is not None))

        try:
            tokens, text, finish, ttft, decode_s = yield from self._decode(prompt, logits, budget, params, stop_ids,
                                                                           stop_texts, on_token, t0, grammar, thought)
        finally:
            if keep_end and not self.one_call:
                self._checkpoint_end()
            self._store_checkpoint()
        self.turns += 1
        if n - start >= TRIM_AFTER:  # a long prefill's transients back to the OS (kept, they pile up per length)
            trim_heap()
        if self._replayed:  # what ran: the prompt from its start (on the CPU after the fallback), nothing reused
            start, start_kind = 0, "replay"
        capped = finish == "length" and (limited if thought is None else self.context - n < thought.own_bound)
        if capped:
            self.say(f"[deltaserve] the context of {self.context} positions cut the answer at {len(tokens)} tokens "
                     f"(max_tokens {max_tokens}, prompt {n})")
        turn = Turn(
            tokens=tokens, text=text, reused=start, prefilled=n - start, prompt_tokens=n,
            finish_reason=finish, context_capped=capped,
            backend=self.backend.name, start=start_kind,
            timings=Timings(prefill_s=prefill_s, ttft_s=ttft, decode_s=decode_s), replayed=self._replayed,
            drafted=self._turn_drafts[0], accepted=self._turn_drafts[1])
        if thought is not None:  # [thinking] what the thought was; a loop the guard closed is logged, by slot
            thought.report(turn)
            if thought.notice() is not None and not self.quiet:
                self._print(thought.notice())
        return turn

    def _checkpoint_end(self) -> None:
        """The state as it stands (all of `held`) as the checkpoint: its own buffers, handed to the store."""
        if self.state is None or not self.held or self.state.length != len(self.held):
            return  # a failed or cancelled-before-anything turn: nothing trustworthy to keep
        if tuple(self.held) == self._checkpoint_tokens:
            return
        try:
            with self._or_forget(f"the state of {len(self.held)} tokens would not copy"):
                self._checkpoint = self.backend.save(self.state, None, exact=True)
        except AcceleratorFailure as e:  # the turn stands; the next one finds no copy and prefills (or falls back)
            self.say(f"[deltaserve] the state after the turn was not kept: {e}")
            return
        self._checkpoint_tokens = tuple(self.held)
        self._checkpoint_stored = False

    def _store_checkpoint(self) -> None:
        """Hand this turn's checkpoint (before its generation header) to the store, once: when the slot is taken
        for another conversation, this one resumes from there."""
        if self.store is not None and self._checkpoint is not None and not self._checkpoint_stored:
            self._checkpoint_stored = True
            self.store.put(self._checkpoint_tokens, self._checkpoint, partition=self.partition)

    # -- a conversation's state in a file ---------------------------------------------------------------
    def save(self, path) -> int:
        """Write the conversation's checkpoint (the state before the last prompt's generation header, and the
        tokens it covers) to `path`, atomically; the tokens it covers. A later session of the same model
        `restore`s it and its next turn prefills only what follows."""
        with self._lock:
            if self._checkpoint is None and self._resume is not None:  # restored and not yet used: save it again
                write_state(Path(path), *self._resume, self.host.sha256())
                return len(self._resume[0])
            if self._checkpoint is None:
                raise DeltaserveError("nothing to save: the session holds no checkpoint yet (it is taken by a chat "
                                      "turn, before the generation header)")
            write_state(Path(path), self._checkpoint_tokens, self._checkpoint, self.host.sha256())
            return len(self._checkpoint_tokens)

    def restore(self, path) -> int:
        """Take the state saved by `save` as this session's checkpoint; the tokens it covers. A file for another
        model or deltaserve version, truncated or corrupt, raises StateFileError (a DeltaserveError) and changes
        nothing."""
        tokens, ck = read_state(Path(path), self.host.config, self.host.sha256())
        if self._say_kv_conversion(ck, len(tokens), Path(path).name):
            ck = ck.with_kv(self.kv_dtype)
        with self._lock:
            self._resume = (tokens, ck)
            if self.store is not None:
                self.store.put(tokens, ck)
            return len(tokens)

    def _say_kv_conversion(self, ck: Checkpoint, tokens: int, name: str | None = None) -> bool:
        """Whether `ck` holds its KV cache in another type than this session's; if so, say that it is converted."""
        if not ck.kv or ck.kv_dtype == self.kv_dtype:
            return False
        self.say(f"[deltaserve] the saved state of {tokens} tokens{' in ' + name if name else ''} holds its KV cache "
                 f"in {kv_type_of(ck.kv_dtype)}: converted to this session's {self.kv_type} on restore")
        return True

    def reset(self) -> None:
        """Forget the conversation (state reset in place, checkpoint dropped)."""
        with self._lock:
            if self.state is not None:
                self._reset_in_place()
            self._drop_checkpoint()
            self._resume = None


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
