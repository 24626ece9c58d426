"""Speculative decoding with the model's own multi-token-prediction (MTP) block.

Every Qwen3.5 checkpoint ships one MTP block (`engine/weights.py: MtpWeights`). Drafting: the block reads the
next token's embedding and the trunk's hidden row (after the final norm) at the position before it, and predicts
the token after: row p pairs token x_p with the trunk's h_{p-1} (llama.cpp's qwen35 MTP, vLLM's Qwen3.5 MTP); a
further draft pairs the draft token with the block's own output row. Its attention has a KV cache of its own, one
entry per position, written from real trunk rows as the trunk advances (`MtpCache`) and from draft rows while
drafting (overwritten later).

Verification: the trunk runs the sampled token and the k drafts as one chain of k+1 rows (`Forward.verify`: every
weight read once for all of them, the rows' attention causal among themselves, the DeltaNet conv and delta rule in
row order) and keeps the DeltaNet states after each row but the last in `Snapshots`. Accepting m drafts keeps rows
0..m: the state after row m is one of the snapshots (or the live state when all k were accepted), copied back, and
the KV cache needs nothing (positions past the length are never read). No second forward pass.
"""

from __future__ import annotations

import torch

from deltaserve.formats.config import HybridConfig
from deltaserve.engine import layers as L
from deltaserve.engine.native_token import NotNative, TokenProgram
from deltaserve.engine.state import Checkpoint
from deltaserve.engine.weights import Weights


# rows of one catch-up: pending rows past this are written at once (a prefill's), never held in memory
FLUSH_ROWS = 8


class MtpCache:
    """The MTP block's state for one sequence: its KV cache (one attention layer) and what it has not yet written.

    Entries below `written` hold the block's rows for the trunk's real tokens and hidden rows. `tokens` are the
    trunk's tokens at positions written.. trunk_len-1 and `hidden` the trunk's rows at positions written-1 ..
    trunk_len-1 (row 0 is h_{written-1}: zeros where it is unknown, as at position 0 or after the trunk state was
    restored from elsewhere), so entry p is written from (tokens[p - written], hidden[p - written])."""

    def __init__(self, config: HybridConfig, capacity: int, device: torch.device):
        c = config
        shape = (c.num_kv_heads, capacity, c.head_dim)
        self.kv = {0: (torch.zeros(shape, device=device), torch.zeros(shape, device=device))}
        self.conv: dict = {}
        self.ssm: dict = {}
        self.capacity, self.device, self.kv_dtype = capacity, torch.device(device), torch.float32
        self.hidden_size = c.hidden_size
        self.written = 0
        self.trunk_len = 0
        self.tokens: list[int] = []
        self.hidden = torch.zeros(1, c.hidden_size, device=device)

    def resync(self, start: int) -> None:
        """The trunk now holds `start` positions that this cache did not follow: entries from `start` on are written
        from here, the row before it unknown (zeros)."""
        self.written = self.trunk_len = min(start, self.capacity)
        self.tokens = []
        self.hidden = torch.zeros(1, self.hidden_size, device=self.device)

    def append(self, start: int, ids: list[int], hidden: torch.Tensor) -> None:
        """The trunk advanced over `ids` at positions start.. with these hidden rows."""
        if start != self.trunk_len:
            self.resync(start)
        self.tokens += ids
        self.hidden = torch.cat([self.hidden, hidden.float().reshape(len(ids), -1)])
        self.trunk_len = start + len(ids)

    def truncate(self, length: int) -> None:
        """The trunk went back to `length` positions (a rejected draft's rows dropped)."""
        if length < self.written:
            self.resync(length)
            return
        self.tokens = self.tokens[:length - self.written]
        self.hidden = self.hidden[:length - self.written + 1]
        self.trunk_len = length

    def take_over(self, other: "MtpCache") -> None:
        """What `other` (a smaller state's cache) holds, into this one."""
        n = min(other.written, self.capacity)
        for mine, theirs in zip(self.kv[0], other.kv[0]):
            mine[:, :n].copy_(theirs[:, :n])
        self.written, self.trunk_len = n, min(other.trunk_len, self.capacity)
        self.tokens, self.hidden = list(other.tokens), other.hidden.clone()


class Snapshots:
    """The DeltaNet states after each row of a verify chain but the last, for up to `rows` drafts: a checkpoint's
    conv and ssm per DeltaNet layer (no KV: a rollback never needs it), allocated once per sequence and refilled by
    every verification."""

    def __init__(self, config: HybridConfig, rows: int, device: torch.device):
        self.rows = [Checkpoint.empty(config, 0, torch.device(device), torch.float32) for _ in range(rows)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * 4 for s in self.rows for t in list(s.conv.values()) + list(s.ssm.values()))


class MtpHead:
    """The MTP block's forward on one device: the catch-up of its cache and the draft steps. Native (one
    ds_decode_tokens call on the block as a one-layer model) where the trunk's one-call decode runs, else torch."""

    def __init__(self, config: HybridConfig, weights: Weights, device: torch.device, one_call: bool,
                 attention_dtype: torch.dtype):
        self.config = config
        self.w = weights.mtp
        self.device = device
        self.attention_dtype = attention_dtype
        self.program: TokenProgram | None = None
        self.why = "drafts through torch ops"
        if one_call:
            try:
                block = Weights(self.w.embed, [self.w.layer], self.w.head_norm, self.w.head)
                self.program = TokenProgram(config, block)
                self.why = "drafts in one native call per step"
            except NotNative as e:
                self.why = f"drafts through torch ops (native call not used: {e})"

    def new_cache(self, capacity: int) -> MtpCache:
        return MtpCache(self.config, capacity, self.device)

    def _inputs(self, ids: list[int], hidden: torch.Tensor) -> torch.Tensor:
        w, eps = self.w, self.config.rms_norm_eps
        e = w.embed.lookup(torch.tensor(ids, dtype=torch.long, device=self.device)).float().reshape(len(ids), -1)
        x = torch.cat([L.rms_norm(e, w.enorm, eps), L.rms_norm(hidden.float(), w.hnorm, eps)], dim=-1)
        return w.eh_proj(x).float().contiguous()

    @torch.inference_mode()
    def rows(self, cache: MtpCache, start: int, ids: list[int], hidden: torch.Tensor,
             logits: bool) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Entries start..start+n-1 of the cache from (ids, hidden) rows; the last row's logits [vocab] (None without
        `logits`) and its output row [hidden_size] (normed: the next draft step's hidden)."""
        n = len(ids)
        if start + n > cache.capacity:
            raise ValueError(f"MTP rows to position {start + n} do not fit a cache of {cache.capacity}")
        x = self._inputs(ids, hidden)
        if self.program is not None and n <= TokenProgram.MAX_BATCH:
            out = torch.empty(n, self.config.hidden_size)
            if n > 1:  # the catch-up rows without the head (its product over the vocabulary for one row only)
                self.program.rows(x[:-1].clone(), [cache] * (n - 1), list(range(start, start + n - 1)), chain=True,
                                  hidden=out[:-1], logits=False)
            last = torch.empty(1, self.config.hidden_size)
            row = self.program.rows(x[-1:].clone(), [cache], [start + n - 1], hidden=last, logits=logits)
            return (row[0] if row is not None else None), last[0]
        c, w, eps = self.config, self.w, self.config.rms_norm_eps
        rope = L.rope_tables(torch.arange(start, start + n, device=self.device), c.rotary_dim, c.rope_theta)

        def attention(i, h, mw):
            return L.attention_mixer(h, mw, c, *cache.kv[0], start, rope, 512, self.attention_dtype)

        x = L.layer_loop(x, [w.layer], eps, attention, None)
        g = L.rms_norm(x[-1:], w.head_norm, eps)
        return (w.head(g).float()[0] if logits else None), g[0].float()

    def flush(self, cache: MtpCache) -> None:
        """Write every pending entry (positions written..trunk_len-1), no draft."""
        if cache.tokens:
            n = len(cache.tokens)
            for lo in range(0, n, 2048):  # a long prefill's rows in pieces, as the trunk's
                hi = min(lo + 2048, n)
                self.rows(cache, cache.written + lo, cache.tokens[lo:hi], cache.hidden[lo:hi], logits=False)
            cache.written = cache.trunk_len
            cache.tokens = []
            cache.hidden = cache.hidden[-1:]

    def follow(self, cache: MtpCache, start: int, ids: list[int], hidden: torch.Tensor) -> None:
        """The trunk advanced: remember its rows, and write them now where many are pending."""
        cache.append(start, ids, hidden)
        if len(cache.tokens) > FLUSH_ROWS:
            self.flush(cache)

    def first(self, cache: MtpCache, token: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first draft step for `token`, which takes position trunk_len: the pending entries and its own row
        in one call. The logits of the token after it, and the block's output row."""
        p = cache.trunk_len
        if p + 1 > cache.capacity:
            raise ValueError(f"no room to draft at position {p} of {cache.capacity}")
        ids = cache.tokens + [int(token)]
        logits, out = self.rows(cache, cache.written, ids, cache.hidden, logits=True)
        # entries below p are final; p's (the sampled token with the trunk's row before it) too, but the trunk has not
        # fed that token yet: p stays pending, written again with the rows the verification appends
        cache.written, cache.tokens, cache.hidden = p, [], cache.hidden[-1:]
        return logits, out

    def next(self, cache: MtpCache, pos: int, token: int, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A further draft step: `token` (the previous draft) at `pos` with the block's previous output row."""
        return self.rows(cache, pos, [int(token)], out[None], logits=True)
