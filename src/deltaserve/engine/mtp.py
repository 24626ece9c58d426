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

The drafts' vocabulary: a draft step's head over all 248,320 tokens is most of its cost (the 0.8B: a third of the
model's weights, read once per draft). Drafts are drawn from the head's first DELTASERVE_DRAFT_VOCAB rows (32,768:
a byte-level BPE numbers its tokens in the order of its merges, the most frequent first) and the end-of-sequence
ids (`draft_head`): a row view of the file's blocks, nothing copied. Which tokens are drafted changes only how many
drafts are accepted, never a token of the output (the trunk verifies each).
"""

from __future__ import annotations

import torch

from deltaserve import settings
from deltaserve.errors import DeltaserveError
from deltaserve.formats.config import HybridConfig
from deltaserve.engine import layers as L
from deltaserve.kernels.linear import Linear, StackedLinear, row_view
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


def draft_vocab() -> int:
    """DELTASERVE_DRAFT_VOCAB as a count (0: the whole head)."""
    text = settings.current().draft_vocab
    if not text.isdigit():
        raise DeltaserveError(f"DELTASERVE_DRAFT_VOCAB must be a whole number of tokens (0: the whole vocabulary), "
                              f"got {text!r}")
    return int(text)


def draft_head(head: Linear, keep: int, ends: tuple[int, ...]) -> tuple[Linear, torch.Tensor | None]:
    """The head's rows the drafts are drawn from: the first `keep` and the end-of-sequence ids past them, as views
    of its weight; and the token id of each of its rows (None: the whole head, where `keep` covers it or its
    weight has no row view)."""
    if keep <= 0 or keep >= head.out_features:
        return head, None
    extra = sorted({int(e) for e in ends if keep <= e < head.out_features})
    try:
        parts = [row_view(head, 0, keep)] + [row_view(head, e, e + 1) for e in extra]
    except ValueError:
        return head, None
    sub = StackedLinear(parts, fuse=False) if extra else parts[0]
    return sub, torch.tensor(list(range(keep)) + extra, dtype=torch.long)


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
        self.keep = draft_vocab()
        self.head, self.ids = draft_head(self.w.head, self.keep, config.eos_token_ids)
        self.vocab = self.w.head.out_features
        self.why = "drafts through torch ops"
        if one_call:
            try:
                block = Weights(self.w.embed, [self.w.layer], self.w.head_norm, self.head)
                self.program = TokenProgram(config, block)
                self.why = "drafts in one native call per step"
            except NotNative as e:
                self.why = f"drafts through torch ops (native call not used: {e})"
        self.why += f"; {self.vocabulary}"

    @property
    def vocabulary(self) -> str:
        """What the drafts are drawn from, for the route line."""
        if self.ids is None:
            return f"drafts over the whole head ({self.vocab:,} tokens)"
        n = int(self.ids.numel())
        return (f"drafts over {n:,} of the head's {self.vocab:,} tokens (its first {self.keep:,} rows and the "
                f"end-of-sequence ids: DELTASERVE_DRAFT_VOCAB)")

    def token(self, index: int) -> int:
        """The token id of a draft logit's index."""
        return index if self.ids is None else int(self.ids[index])

    def full(self, logits: torch.Tensor) -> torch.Tensor:
        """A draft's logits over the whole vocabulary (-inf for the tokens not drafted): for a grammar's mask."""
        if self.ids is None:
            return logits
        out = torch.full((self.vocab,), float("-inf"))
        out[self.ids] = logits
        return out

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
        return (self.head(g).float()[0] if logits else None), g[0].float()

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
