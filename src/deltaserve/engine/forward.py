"""The hybrid's forward over a decode state: a batched prefill of a span, and a one-token decode."""

from __future__ import annotations

import time
from typing import Sequence

import torch

from deltaserve.model.config import HybridConfig
from deltaserve.model.weights import AttentionWeights, Weights
from deltaserve.engine import layers as L
from deltaserve.engine.compute import keep_freed_memory
from deltaserve.engine.native_token import TokenProgram
from deltaserve.engine.state import DecodeState
from deltaserve.engine.threads import ThreadGovernor


NATIVE_DECODE = True  # a one-token decode in one native call where the model qualifies (tests compare both)


class Forward:
    """The forward of one host model on one device. Stateless itself: all sequence state is in a DecodeState."""

    def __init__(self, config: HybridConfig, weights: Weights, device: torch.device | str = "cpu",
                 attention_dtype: torch.dtype | None = None):
        self.config = config
        self.weights = weights
        self.device = torch.device(device)
        if self.device.type == "cpu":
            keep_freed_memory()  # temporaries reused, not faulted in again on every product (see compute.py)
        # prefill attention matmuls: f32 when any weight is f32 (the exact path), else bf16 like the linears
        self.attention_dtype = attention_dtype or (torch.float32 if weights.has_f32_linears() else torch.bfloat16)
        self.query_rows = 512    # attention queries per score matrix (a prefill-plan knob)
        self.prefill_rows = 2048  # tokens per forward call of a long prefill (a prefill-plan knob)
        self._token: tuple[TokenProgram | None, str] | None = None
        self.governor: ThreadGovernor | None = None  # the native decode's thread count, measured (threads.py)

    def token_program(self) -> tuple[TokenProgram | None, str]:
        """The native one-call decode for this model, built once (None where it does not qualify), and the
        route it gives, in words."""
        if self._token is None:
            self._token = TokenProgram.build(self.config, self.weights) if self.device.type == "cpu" else \
                (None, "decode through torch ops")
        return self._token

    def use_plan(self, rows: int, query_rows: int) -> None:
        self.prefill_rows, self.query_rows = rows, query_rows

    def new_state(self, capacity: int, kv_dtype: torch.dtype = torch.float32) -> DecodeState:
        return DecodeState(self.config, capacity, self.device, kv_dtype)

    def _ids(self, tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
        if isinstance(tokens, torch.Tensor):
            return tokens.to(self.device, torch.long).reshape(-1)
        return torch.tensor(list(tokens), dtype=torch.long, device=self.device)

    @torch.inference_mode()
    def _run(self, state: DecodeState, ids: torch.Tensor, chunked: bool, all_logits: bool) -> torch.Tensor:
        c, w = self.config, self.weights
        t = int(ids.numel())
        start = state.length
        if t == 0:
            raise ValueError("a forward needs at least one token")
        if start + t > state.capacity:
            raise ValueError(f"{start + t} positions do not fit a decode state of {state.capacity}")
        if int(ids.max()) >= c.vocab_size or int(ids.min()) < 0:
            raise ValueError(f"token id out of range 0..{c.vocab_size - 1}")
        x = w.embed.lookup(ids)
        positions = torch.arange(start, start + t, device=self.device)
        rope = L.rope_tables(positions, c.rotary_dim, c.rope_theta)
        eps = c.rms_norm_eps
        for i, lw in enumerate(w.layers):
            h = L.rms_norm(x, lw.attn_norm, eps)
            if isinstance(lw.mixer, AttentionWeights):
                k_cache, v_cache = state.kv[i]
                h = L.attention_mixer(h, lw.mixer, c, k_cache, v_cache, start, rope, self.query_rows,
                                      self.attention_dtype)
            else:
                h = L.deltanet_mixer(h, lw.mixer, c, state.conv[i], state.ssm[i], chunked)
            x = x + h
            x = x + L.mlp(L.rms_norm(x, lw.post_norm, eps), lw.gate_up, lw.down)
        state.length = start + t
        if not all_logits:
            x = x[-1:]
        return w.lm_head(L.rms_norm(x, w.final_norm, eps)).float()

    def prefill(self, state: DecodeState, tokens, all_logits: bool = False) -> torch.Tensor:
        """Feed a span at the state's current position through the chunked path.
        Returns logits [T, vocab] when `all_logits`, else the last position's [vocab]."""
        ids = self._ids(tokens)
        pieces = [self._run(state, ids[i:i + self.prefill_rows], chunked=True, all_logits=all_logits)
                  for i in range(0, ids.numel(), self.prefill_rows)]
        return torch.cat(pieces) if all_logits else pieces[-1][0]

    def decode(self, state: DecodeState, token: int) -> torch.Tensor:
        """One token through the recurrent path. Returns logits [vocab]."""
        program = self._native([state])
        if program is not None:
            return self._governed(program, [state], self._checked([state], [token]))[0]
        return self._run(state, self._ids([token]), chunked=False, all_logits=False)[0]

    def _native(self, states: list[DecodeState]) -> TokenProgram | None:
        """The one-call native decode where it takes these states (a CPU, a model that qualifies, f32 states, at
        most TokenProgram.MAX_BATCH of them), else None."""
        if not NATIVE_DECODE or self.device.type != "cpu" or len(states) > TokenProgram.MAX_BATCH:
            return None
        program = self.token_program()[0]
        return program if program is not None and all(program.takes(st) for st in states) else None

    def _governed(self, program: TokenProgram, states: list[DecodeState], tokens: list[int]) -> torch.Tensor:
        """The native decode on the thread count the governor picks, timed for it (see threads.py)."""
        most = torch.get_num_threads()
        if self.governor is None or self.governor.most != most:
            self.governor = ThreadGovernor(most)
        t0 = time.perf_counter()
        logits = program.decode(states, tokens, self.governor.threads())
        self.governor.record(time.perf_counter() - t0, len(states))
        return logits

    def _checked(self, states: list[DecodeState], tokens) -> list[int]:
        """The tokens as ints, once every state has room for one more position and every id is in the vocabulary."""
        for st in states:
            if st.length + 1 > st.capacity:
                raise ValueError(f"{st.length + 1} positions do not fit a decode state of {st.capacity}")
        ids = [int(t) for t in tokens]
        if any(not 0 <= t < self.config.vocab_size for t in ids):
            raise ValueError(f"token id out of range 0..{self.config.vocab_size - 1}")
        return ids

    @torch.inference_mode()
    def decode_batch(self, states: list[DecodeState], tokens: list[int]) -> torch.Tensor:
        """One token for each of B sequences at once: every weight is read once for the whole batch.
        Returns logits [B, vocab]; each state advances by one position."""
        c, w = self.config, self.weights
        b = len(states)
        if b != len(tokens) or b == 0:
            raise ValueError(f"{b} states for {len(tokens)} tokens")
        checked = self._checked(states, tokens)
        program = self._native(states)
        if program is not None:
            return self._governed(program, states, checked)
        ids = self._ids(checked)
        starts = [st.length for st in states]
        x = w.embed.lookup(ids)
        rope = L.rope_tables(torch.tensor(starts, device=self.device), c.rotary_dim, c.rope_theta)
        eps = c.rms_norm_eps
        for i, lw in enumerate(w.layers):
            h = L.rms_norm(x, lw.attn_norm, eps)
            if isinstance(lw.mixer, AttentionWeights):
                h = L.attention_mixer_batch(h, lw.mixer, c, [st.kv[i] for st in states], starts, rope)
            else:
                mixed = L.deltanet_decode_native(h, lw.mixer, c, [(st.conv[i], st.ssm[i]) for st in states]) \
                    if L.NATIVE_STEP else None
                if mixed is None:
                    conv = torch.stack([st.conv[i] for st in states])
                    mixed = L.deltanet_mixer_batch(h, lw.mixer, c, conv, [st.ssm[i] for st in states])
                    for j, st in enumerate(states):
                        st.conv[i].copy_(conv[j])
                h = mixed
            x = x + h
            x = x + L.mlp(L.rms_norm(x, lw.post_norm, eps), lw.gate_up, lw.down)
        for st in states:
            st.length += 1
        return w.lm_head(L.rms_norm(x, w.final_norm, eps)).float()

    def prefill_per_token(self, state: DecodeState, tokens, all_logits: bool = False) -> torch.Tensor:
        """The same span one token at a time (the comparison path)."""
        ids = self._ids(tokens)
        rows = [self._run(state, ids[i:i + 1], chunked=False, all_logits=False)[0] for i in range(ids.numel())]
        return torch.stack(rows) if all_logits else rows[-1]
