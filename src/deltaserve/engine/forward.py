"""The hybrid's forward over a decode state: a batched prefill of a span, and a one-token decode."""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

from deltaserve.formats.config import HybridConfig
from deltaserve.engine.weights import Weights
from deltaserve.engine import layers as L
from deltaserve.kernels import routes
from deltaserve.kernels.cpu import cpu_stall_seconds, keep_freed_memory
from deltaserve.engine.native_token import TokenProgram
from deltaserve.engine.state import DecodeState
from deltaserve.engine.graph import GraphDecoder, graphs_enabled
from deltaserve.engine.mtp import MtpHead, Snapshots
from deltaserve.kernels.cpu import ThreadGovernor


class Forward:
    """The forward of one host model on one device. Stateless itself: all sequence state is in a DecodeState
    (its prefill plan included: the rows a long prefill takes per call and the attention's query rows).

    `native`: DeltaNet's one-token step, its conv and its prefill delta rule on the native kernel (a CPU forward,
    where the kernel runs; each call falls back to torch where it cannot take its tensors). `one_call`: a decode
    step of a model whose projections all qualify runs as one native call (`TokenProgram`). Tests turn either off
    to compare the routes."""

    def __init__(self, config: HybridConfig, weights: Weights, device: torch.device | str = "cpu",
                 attention_dtype: torch.dtype | None = None, native: bool = True, one_call: bool = True):
        self.config = config
        self.weights = weights
        self.device = torch.device(device)
        cpu = self.device.type == "cpu"
        if cpu:
            keep_freed_memory()  # temporaries reused, not faulted in again on every product (see kernels/cpu.py)
        self.native = native and cpu
        self.one_call = one_call and cpu
        # prefill attention matmuls: f32 when any weight is f32 (the exact path), or on a CPU without AMX tiles; else
        # bf16 (routes.attention_dtype)
        self.attention_dtype = attention_dtype or routes.attention_dtype(self.device.type, weights.has_f32_linears())
        self._token: tuple[TokenProgram | None, str] | None = None
        self.governor: ThreadGovernor | None = None  # the native decode's thread count, measured (kernels/cpu.py)
        # one sequence's decode step on a CUDA device: replayed as a CUDA graph (engine/graph.py)
        self.graphs = GraphDecoder(self) if graphs_enabled(self.device) else None
        # the file's MTP block, for speculative decoding (engine/mtp.py); a state with an MtpCache attached has its
        # cache follow every position the trunk feeds
        self.mtp = MtpHead(config, weights, self.device, self.one_call, self.attention_dtype) \
            if weights.mtp is not None else None

    def token_program(self) -> tuple[TokenProgram | None, str]:
        """The native one-call decode for this model, built once (None where it does not qualify), and the
        route it gives, in words."""
        if self._token is None:
            self._token = TokenProgram.build(self.config, self.weights) if self.device.type == "cpu" else \
                (None, "decode through torch ops" + (", replayed as one CUDA graph per token" if self.graphs else ""))
        return self._token

    def new_state(self, capacity: int, kv_dtype: torch.dtype = torch.float32, prefill_rows: int = 2048,
                  query_rows: int = 64) -> DecodeState:
        return DecodeState(self.config, capacity, self.device, kv_dtype, prefill_rows, query_rows)

    def _ids(self, tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
        if isinstance(tokens, torch.Tensor):
            return tokens.to(self.device, torch.long).reshape(-1)
        return torch.tensor(list(tokens), dtype=torch.long, device=self.device)

    def _layers(self, x: torch.Tensor, attention: Callable, deltanet: Callable) -> torch.Tensor:
        """The trunk through the one layer loop (`layers.layer_loop`)."""
        return L.layer_loop(x, self.weights.layers, self.config.rms_norm_eps, attention, deltanet)

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        return self.weights.lm_head(self._normed(x)).float()

    def _normed(self, x: torch.Tensor) -> torch.Tensor:
        return L.rms_norm(x, self.weights.final_norm, self.config.rms_norm_eps)

    def _follow(self, state: DecodeState, start: int, ids: list[int], hidden: torch.Tensor) -> None:
        """The state's MTP cache (where one is attached) follows the positions the trunk just fed."""
        if getattr(state, "mtp", None) is not None and self.mtp is not None:
            self.mtp.follow(state.mtp, start, ids, hidden)

    def _run(self, state: DecodeState, ids: torch.Tensor, chunked: bool, all_logits: bool,
             snaps: list | None = None, hidden_only: bool = False, images=None) -> torch.Tensor:
        """A span of one sequence from the state's position. `snaps` (the recurrent path): the DeltaNet states after
        each row but the last are copied into them (a verification's rollback points). `hidden_only`: the rows after
        the final norm instead of logits. `images`: embeddings in place of the image tokens' rows and the span's 3-D
        rotary positions (deltaserve.vision.span.ImageSpan); the state's rope_delta moves to where they leave the
        text."""
        steps = self._run_steps(state, ids, chunked, all_logits, snaps, hidden_only, images)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    def _run_steps(self, state: DecodeState, ids: torch.Tensor, chunked: bool, all_logits: bool,
                   snaps: list | None = None, hidden_only: bool = False, images=None):
        """`_run` a layer at a time: a generator that yields after each layer and returns what `_run` returns. The state
        is consistent only once it has returned (its length moves then; the layers before the one it stopped at have
        fed the span): the engine loop runs other sequences' rows between its layers, never abandons it midway."""
        c = self.config
        t, start = int(ids.numel()), state.length
        if t == 0:
            raise ValueError("a forward needs at least one token")
        if start + t > state.capacity:
            raise ValueError(f"{start + t} positions do not fit a decode state of {state.capacity}")
        id_list = ids.tolist()
        self._check_ids(id_list)
        with torch.inference_mode():
            if images is not None:
                rope = L.mrope_tables(images.positions.to(self.device), c.rotary_dim, c.rope_theta, c.mrope_section)
            else:
                rope = L.rope_tables(torch.arange(start, start + t, device=self.device) + state.rope_delta,
                                     c.rotary_dim, c.rope_theta)
            x = self.weights.embed.lookup(ids)
            if images is not None:
                x = images.placed(x, ids)

        def attention(i, h, mw):
            k_cache, v_cache = state.kv[i]
            return L.attention_mixer(h, mw, c, k_cache, v_cache, start, rope, state.query_rows, self.attention_dtype)

        def deltanet(i, h, mw):
            return L.deltanet_mixer(h, mw, c, state.conv[i], state.ssm[i], chunked, self.native,
                                    snaps=[(s.conv[i], s.ssm[i]) for s in snaps] if snaps else None)

        eps, buffers = c.rms_norm_eps, {}
        for i, lw in enumerate(self.weights.layers):
            with torch.inference_mode(), L.scratch(buffers):
                x = L.layer(i, lw, x, eps, attention, deltanet)
            if i + 1 < len(self.weights.layers):
                yield i
        with torch.inference_mode():
            state.length = start + t
            if images is not None:
                state.rope_delta = images.next_position - state.length
            if hidden_only:
                return self._normed(x)
            if getattr(state, "mtp", None) is not None and self.mtp is not None:
                normed = self._normed(x)
                self._follow(state, start, id_list, normed)
                return self.weights.lm_head(normed if all_logits else normed[-1:]).float()
            return self._head(x if all_logits else x[-1:])

    def hidden_rows(self, state: DecodeState, tokens) -> torch.Tensor:
        """A span fed as `prefill` feeds it, returning every row after the final norm [T, hidden] (what an MTP block
        reads: scripts/demo/train_mtp.py trains one on them)."""
        ids, rows = self._ids(tokens), state.prefill_rows
        return torch.cat([self._run(state, ids[i:i + rows], chunked=True, all_logits=True, hidden_only=True)
                          for i in range(0, ids.numel(), rows)])

    def new_snapshots(self, rows: int) -> Snapshots:
        return Snapshots(self.config, rows, self.device)

    def verify(self, state: DecodeState, tokens: list[int], snaps: Snapshots | None) -> torch.Tensor:
        """The sampled token and its drafts as one chain from the state's position: logits [T, vocab], every weight
        read once for all T rows; the DeltaNet states after rows 0..T-2 land in `snaps` (see `rollback`). The state
        advances by T."""
        t = len(tokens)
        if state.length + t > state.capacity:
            raise ValueError(f"{state.length + t} positions do not fit a decode state of {state.capacity}")
        if snaps is not None and len(snaps.rows) < t - 1:
            raise ValueError(f"{len(snaps.rows)} snapshots for {t} rows")
        ids = [int(x) for x in tokens]
        self._check_ids(ids)
        rows = snaps.rows[:t - 1] if snaps is not None else None
        program = self._native([state])
        if program is not None and t <= TokenProgram.MAX_BATCH:
            start = state.length
            x = self.weights.embed.lookup(torch.tensor(ids)).reshape(t, -1).float().clone()
            hidden = torch.empty(t, self.config.hidden_size)
            logits = program.rows(x, [state] * t, list(range(start, start + t)), torch.get_num_threads(),
                                  chain=True, snaps=rows, hidden=hidden,
                                  rope=list(range(start + state.rope_delta, start + state.rope_delta + t))
                                  if state.rope_delta else None)
            state.length = start + t
            self._follow(state, start, ids, hidden)
            return logits
        return self._run(state, self._ids(ids), chunked=False, all_logits=True, snaps=rows)

    @staticmethod
    def rollback(state: DecodeState, snaps: Snapshots, kept: int, rows: int) -> None:
        """After a verification of `rows` rows from position P, keep rows 0..kept-1: the DeltaNet states after row
        kept-1 (a snapshot, or the live state when every row is kept), the length P + kept. The KV cache needs
        nothing: positions past the length are never read."""
        if kept >= rows:
            return
        snap = snaps.rows[kept - 1]
        for i, t in state.conv.items():
            t.copy_(snap.conv[i])
        for i, t in state.ssm.items():
            t.copy_(snap.ssm[i])
        state.length -= rows - kept
        if getattr(state, "mtp", None) is not None:
            state.mtp.truncate(state.length)

    def prefill(self, state: DecodeState, tokens, all_logits: bool = False,
                images=None) -> torch.Tensor:
        """Feed a span at the state's current position through the chunked path, `state.prefill_rows` tokens per
        call. Returns logits [T, vocab] when `all_logits`, else the last position's [vocab]. `images`: the span's
        image embeddings and 3-D positions (`ImageSpan`, for a span that holds image tokens)."""
        ids, rows = self._ids(tokens), state.prefill_rows
        if images is None:
            pieces = [self._run(state, ids[i:i + rows], chunked=True, all_logits=all_logits)
                      for i in range(0, ids.numel(), rows)]
        else:
            pieces = [self._run(state, ids[i:i + rows], chunked=True, all_logits=all_logits,
                                images=images.rows(i, min(i + rows, ids.numel()), ids))
                      for i in range(0, ids.numel(), rows)]
        return torch.cat(pieces) if all_logits else pieces[-1][0]

    def prefill_steps(self, state: DecodeState, tokens):
        """`prefill` a layer at a time: a generator that yields after each layer of each call of `state.prefill_rows`
        tokens and returns the last position's logits [vocab] (see `_run_steps`: the engine loop runs other sequences'
        rows between its layers)."""
        ids, rows = self._ids(tokens), state.prefill_rows
        logits = None
        for i in range(0, ids.numel(), rows):
            logits = yield from self._run_steps(state, ids[i:i + rows], chunked=True, all_logits=False)
        return logits[0]

    def decode(self, state: DecodeState, token: int) -> torch.Tensor:
        """One token through the recurrent path. Returns logits [vocab]."""
        return self.decode_batch([state], [token])[0]

    @torch.inference_mode()
    def run_rows(self, runs: list) -> tuple[list[torch.Tensor], int]:
        """Rows of several sequences through the recurrent path. Each run (state, tokens, snapshots or None) feeds
        its tokens at its state's position, in order: one token is a decode step, more a verification chain (its
        snapshots receive the DeltaNet states after each row but the last, as `verify`). Returns each run's logits
        [len(tokens), vocab] and the forward calls it took. On the native decode every weight is read once per call
        for all its rows: calls of at most MAX_BATCH rows, runs in order, a run never split across calls. Elsewhere
        the one-token runs go as one batch (`decode_batch`) and each longer run as `verify` runs it."""
        if not runs:
            return [], 0
        for st, toks, _ in runs:
            if not toks:
                raise ValueError("a run needs at least one token")
            if st.length + len(toks) > st.capacity:
                raise ValueError(f"{st.length + len(toks)} positions do not fit a decode state of {st.capacity}")
            if sum(1 for other, _, _ in runs if other is st) > 1:
                raise ValueError("a state has two runs in one step")
        program = self._native([st for st, _, _ in runs])
        most = TokenProgram.MAX_BATCH
        if program is None or any(len(toks) > most for _, toks, _ in runs):
            return self._rows_on_torch(runs)
        out: list[torch.Tensor | None] = [None] * len(runs)
        groups, current, rows = [], [], 0
        for j, (_, toks, _) in enumerate(runs):
            if current and rows + len(toks) > most:
                groups.append(current)
                current, rows = [], 0
            current.append(j)
            rows += len(toks)
        groups.append(current)
        for group in groups:
            states, pos, ids, snaps, rope = [], [], [], [], []
            for j in group:
                st, toks, sn = runs[j]
                ids_j = [int(t) for t in toks]
                self._check_ids(ids_j)
                for r, t in enumerate(ids_j):
                    states.append(st)
                    pos.append(st.length + r)
                    ids.append(t)
                    snaps.append(sn.rows[r] if sn is not None and r < len(ids_j) - 1 else None)
                    rope.append(st.length + st.rope_delta + r)
            following = [j for j in group if getattr(runs[j][0], "mtp", None) is not None] if self.mtp else []
            hidden = torch.empty(len(ids), self.config.hidden_size) if following else None
            logits = self._governed(program, states, ids, hidden, pos=pos, snaps=snaps,
                                    rope=rope if any(st.rope_delta for st in states) else None)
            at = 0
            for j in group:
                st, toks, _ = runs[j]
                n, start = len(toks), st.length
                st.length = start + n
                if j in following:
                    self._follow(st, start, [int(t) for t in toks], hidden[at:at + n])
                out[j] = logits[at:at + n]
                at += n
        return out, len(groups)

    def _rows_on_torch(self, runs: list) -> tuple[list[torch.Tensor], int]:
        out: list[torch.Tensor | None] = [None] * len(runs)
        singles = [j for j, (_, toks, _) in enumerate(runs) if len(toks) == 1]
        calls = 0
        if singles:
            logits = self.decode_batch([runs[j][0] for j in singles], [runs[j][1][0] for j in singles])
            for k, j in enumerate(singles):
                out[j] = logits[k:k + 1]
            calls += 1
        for j, (st, toks, sn) in enumerate(runs):
            if len(toks) > 1:
                out[j] = self.verify(st, list(toks), sn)
                calls += 1
        return out, calls

    def _native(self, states: list[DecodeState]) -> TokenProgram | None:
        """The one-call native decode where it takes these states (a CPU, a model that qualifies, states whose KV
        caches it reads, all of one type, at most TokenProgram.MAX_BATCH of them), else None."""
        if not self.one_call or len(states) > TokenProgram.MAX_BATCH or len({st.kv_dtype for st in states}) > 1:
            return None
        program = self.token_program()[0]
        return program if program is not None and all(program.takes(st) for st in states) else None

    def _check_ids(self, ids: list[int]) -> None:
        vocab = self.config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"token id out of range 0..{vocab - 1}")

    def _governed(self, program: TokenProgram, states: list[DecodeState], tokens: list[int],
                  hidden: torch.Tensor | None = None, pos: list[int] | None = None, snaps: list | None = None,
                  rope: list[int] | None = None) -> torch.Tensor:
        """The native decode on the thread count the governor picks, timed for it (see kernels/cpu.py). With `pos`,
        the rows as `run_rows` lays them out (runs of one state; the states' lengths are the caller's to move)."""
        most = torch.get_num_threads()
        if self.governor is None or self.governor.most != most:
            self.governor = ThreadGovernor(most)

        def call(threads: int) -> torch.Tensor:
            if pos is None:
                return program.decode(states, tokens, threads, hidden)
            x = self.weights.embed.lookup(torch.tensor(tokens)).reshape(len(tokens), -1).float().clone()
            return program.rows(x, states, pos, threads, snaps=snaps, hidden=hidden, rope=rope)

        if self.governor.most == 1:
            return call(1)
        s0, t0 = cpu_stall_seconds(), time.perf_counter()
        logits = call(self.governor.threads())
        t1, s1 = time.perf_counter(), cpu_stall_seconds()
        self.governor.record(t1 - t0, len(states), None if s0 is None or s1 is None else s1 - s0)
        return logits

    @torch.inference_mode()
    def decode_batch(self, states: list[DecodeState], tokens: list[int]) -> torch.Tensor:
        """One token for each of B sequences at once: every weight is read once for the whole batch.
        Returns logits [B, vocab]; each state advances by one position."""
        c = self.config
        b = len(states)
        if b != len(tokens) or b == 0:
            raise ValueError(f"{b} states for {len(tokens)} tokens")
        for st in states:
            if st.length + 1 > st.capacity:
                raise ValueError(f"{st.length + 1} positions do not fit a decode state of {st.capacity}")
        ids = [int(t) for t in tokens]
        self._check_ids(ids)
        program = self._native(states)
        if program is not None:
            following = [j for j, st in enumerate(states) if getattr(st, "mtp", None) is not None] \
                if self.mtp is not None else []
            hidden = torch.empty(b, c.hidden_size) if following else None
            logits = self._governed(program, states, ids, hidden)
            for j in following:
                self._follow(states[j], states[j].length - 1, [ids[j]], hidden[j:j + 1])
            return logits
        if b == 1 and self.graphs is not None and not states[0].rope_delta:  # one sequence on a CUDA device: the graph
            return self.graphs.decode(states[0], ids[0])[None]
        if b == 1:  # one sequence: the span path with one token (its recurrent step)
            return self._run(states[0], self._ids(ids), chunked=False, all_logits=False)
        starts = [st.length for st in states]
        rope = L.rope_tables(torch.tensor([st.length + st.rope_delta for st in states], device=self.device),
                             c.rotary_dim, c.rope_theta)

        def attention(i, h, mw):
            return L.attention_mixer_batch(h, mw, c, [st.kv[i] for st in states], starts, rope)

        def deltanet(i, h, mw):
            mixed = L.deltanet_decode_native(h, mw, c, [(st.conv[i], st.ssm[i]) for st in states]) \
                if self.native else None
            if mixed is None:
                conv = torch.stack([st.conv[i] for st in states])
                mixed = L.deltanet_mixer_batch(h, mw, c, conv, [st.ssm[i] for st in states])
                for j, st in enumerate(states):
                    st.conv[i].copy_(conv[j])
            return mixed

        x = self._layers(self.weights.embed.lookup(self._ids(ids)), attention, deltanet)
        normed = self._normed(x)
        for j, st in enumerate(states):
            st.length += 1
            self._follow(st, st.length - 1, [ids[j]], normed[j:j + 1])
        return self.weights.lm_head(normed).float()
