"""The decode state of one sequence: a KV cache per attention layer, conv + recurrent state per DeltaNet layer.

The session grows it (a new, larger one), resets it in place, checkpoints and restores it, without
knowing what a layer holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deltaserve.engine.q8cache import BLOCK, Q8Cache
from deltaserve.errors import DeltaserveError
from deltaserve.formats.config import HybridConfig

# The KV cache's types (--kv-type): the torch dtype a cache is stored in, and its bytes per value. f32 is exact;
# f16 (the default: of the two 16-bit types the closer to the f32 cache, docs/accuracy.md) and bf16 halve the cache
# and the bytes a decode step reads at depth (the one-call native decode reads them in their type, widening in
# registers; the torch attention converts on read); q8_0 (llama.cpp's blocks of 32 int8 values and an f16 scale: 34
# bytes per 32 values) is a Q8Cache (engine/q8cache.py) whose dtype is its values' int8, the torch attention
# dequantizing on read.
KV_TYPES = ("f32", "f16", "bf16", "q8_0")
DEFAULT_KV_TYPE = "f16"
KV_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "q8_0": Q8Cache.dtype}
KV_BYTES_PER_VALUE = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32}


def kv_type_name(kv_type: str | None) -> str:
    """`kv_type` checked against the types that exist (None: DEFAULT_KV_TYPE), or a one-line error naming them."""
    if kv_type is None:
        return DEFAULT_KV_TYPE
    if kv_type not in KV_TYPES:
        raise DeltaserveError(f"unknown KV cache type {kv_type!r}: one of {', '.join(KV_TYPES)}")
    return kv_type


def kv_type_for(config: HybridConfig, kv_type: str | None) -> str:
    """`kv_type` checked as `kv_type_name` and against the model: a q8_0 cache's blocks of 32 values run along
    head_dim, which must be a multiple of 32 (as llama.cpp's); otherwise a one-line error naming it."""
    name = kv_type_name(kv_type)
    if name == "q8_0" and config.head_dim % BLOCK:
        raise DeltaserveError(f"the q8_0 KV cache needs a head_dim that is a multiple of {BLOCK} (its blocks of "
                              f"{BLOCK} values run along it); this model's is {config.head_dim}: use f32, f16 or bf16")
    return name


def kv_torch_dtype(kv_type: str | None) -> torch.dtype:
    """The torch dtype a cache of `kv_type` is stored in (q8_0: torch.int8, its values' type)."""
    return KV_DTYPES[kv_type_name(kv_type)]


def kv_type_of(dtype: torch.dtype) -> str:
    """The KV type name of a cache tensor's dtype."""
    for name, d in KV_DTYPES.items():
        if d == dtype:
            return name
    raise DeltaserveError(f"a KV cache in {dtype} is not one of the types {', '.join(KV_DTYPES)}")


def kv_position_bytes(config: HybridConfig, kv_type: str | None = None) -> int:
    """KV bytes one position costs across all attention layers in `kv_type` (head_dim is a multiple of q8_0's 32)."""
    values = 2 * config.num_kv_heads * config.head_dim * len(config.attention_layers)
    return int(round(values * KV_BYTES_PER_VALUE[kv_type_name(kv_type)]))


def new_kv(shape: tuple[int, ...], dtype: torch.dtype, device, zeros: bool = True):
    """One attention layer's keys or values in the KV type whose torch dtype is `dtype` (q8_0: a Q8Cache)."""
    if dtype == Q8Cache.dtype:
        return Q8Cache.zeros(shape, device) if zeros else Q8Cache.empty(shape, device)
    return (torch.zeros if zeros else torch.empty)(shape, dtype=dtype, device=device)


def kv_as(t, dtype: torch.dtype):
    """A cache tensor (or Q8Cache) in the KV type whose torch dtype is `dtype`: itself when it is already, else
    converted (q8_0 quantized from the values, dequantized to a float type)."""
    if t.dtype == dtype:
        return t
    return Q8Cache.of(t) if dtype == Q8Cache.dtype else t.to(dtype)


class DecodeState:
    """Per-layer state for `capacity` positions on one device.

    `kv[i]` is (k, v) of shape [kv_heads, capacity, head_dim] for attention layer i;
    `conv[i]` is [K-1, conv_dim] and `ssm[i]` is [value_heads, dk, dv] for DeltaNet layer i.
    `length` is the number of positions the state holds.
    """

    def __init__(self, config: HybridConfig, capacity: int, device: torch.device | str = "cpu",
                 kv_dtype: torch.dtype = torch.float32, prefill_rows: int = 2048, query_rows: int = 64):
        if capacity <= 0:
            raise ValueError(f"a decode state needs a positive capacity, got {capacity}")
        if kv_dtype == Q8Cache.dtype:
            kv_type_for(config, "q8_0")
        self.config = config
        self.capacity = capacity
        self.device = torch.device(device)
        self.kv_dtype = kv_dtype
        self.length = 0
        # where the rotary position of the next token stands against its index: 0 for text; after an image (whose
        # tokens advance the 3-D positions by its larger side, not its token count) the difference, negative
        self.rope_delta = 0
        # the prefill plan of this state's session (capacity.py): tokens per forward call of a long prefill, and
        # attention queries per score matrix
        self.prefill_rows, self.query_rows = prefill_rows, query_rows
        # the MTP block's cache (engine/mtp.py: MtpCache) where the session drafts: it follows what this state holds
        self.mtp = None
        c = config
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.conv: dict[int, torch.Tensor] = {}
        self.ssm: dict[int, torch.Tensor] = {}
        for i in range(c.num_layers):
            if c.is_attention(i):
                shape = (c.num_kv_heads, capacity, c.head_dim)
                self.kv[i] = (new_kv(shape, kv_dtype, self.device), new_kv(shape, kv_dtype, self.device))
            else:
                self.conv[i] = torch.zeros((c.conv_kernel - 1, c.conv_dim), dtype=torch.float32, device=self.device)
                self.ssm[i] = torch.zeros((c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim),
                                          dtype=torch.float32, device=self.device)

    @staticmethod
    def bytes_for(config: HybridConfig, capacity: int, kv_dtype_bytes: int = 4, kv_type: str | None = None) -> int:
        """A state's bytes: its KV cache in `kv_type` where given (else `kv_dtype_bytes` a value) and the recurrent
        state."""
        per = kv_position_bytes(config, kv_type) if kv_type is not None else config.kv_bytes_per_position(kv_dtype_bytes)
        return per * capacity + config.recurrent_state_bytes()

    @property
    def nbytes(self) -> int:
        return DecodeState.bytes_for(self.config, self.capacity, kv_type=kv_type_of(self.kv_dtype))

    def reset(self) -> None:
        """Back to position 0 without allocating: recurrent and conv state zeroed (KV needs no zeroing)."""
        for t in self.conv.values():
            t.zero_()
        for t in self.ssm.values():
            t.zero_()
        self.length = 0
        self.rope_delta = 0
        if self.mtp is not None:
            self.mtp.resync(0)

    def checkpoint(self, into: "Checkpoint | None" = None, exact: bool = False) -> "Checkpoint":
        """A copy of the state at its current length. `into`, when given and large enough, is reused; `exact`:
        new buffers of exactly the length (a checkpoint that is kept, not refilled)."""
        n = self.length
        if exact:
            ck = Checkpoint.empty(self.config, max(n, 1), self.device, self.kv_dtype)
        elif into is not None and into.device == self.device and into.kv_capacity >= n and into.config is self.config:
            ck = into
        else:
            # room to grow: the next checkpoint of a conversation is longer, and reuses these buffers
            room = min(self.capacity, max(256, 1 << max(n - 1, 1).bit_length()))
            ck = Checkpoint.empty(self.config, room, self.device, self.kv_dtype)
        for i, (k, v) in self.kv.items():
            ck.kv[i][0][:, :n].copy_(k[:, :n])
            ck.kv[i][1][:, :n].copy_(v[:, :n])
        for i, t in self.conv.items():
            ck.conv[i].copy_(t)
        for i, t in self.ssm.items():
            ck.ssm[i].copy_(t)
        ck.length = n
        ck.rope_delta = self.rope_delta
        return ck

    def restore(self, ck: "Checkpoint", valid_prefix: int = 0) -> None:
        """Return to the checkpoint's position. KV positions below `valid_prefix` are known to be equal
        already (the live state holds the same tokens there) and are not copied again."""
        n = ck.length
        if n > self.capacity:
            raise ValueError(f"a checkpoint of {n} positions does not fit a state of {self.capacity}")
        lo = min(valid_prefix, n)
        for i, (k, v) in self.kv.items():
            k[:, lo:n].copy_(ck.kv[i][0][:, lo:n])
            v[:, lo:n].copy_(ck.kv[i][1][:, lo:n])
        for i, t in self.conv.items():
            t.copy_(ck.conv[i])
        for i, t in self.ssm.items():
            t.copy_(ck.ssm[i])
        self.length = n
        self.rope_delta = ck.rope_delta
        if self.mtp is not None:  # its entries in valid_prefix..n are another conversation's: drafts only, never tokens
            self.mtp.resync(n)


@dataclass
class Checkpoint:
    """A saved copy of a decode state at `length` positions (KV up to `kv_capacity`)."""

    config: HybridConfig
    device: torch.device
    kv_capacity: int
    kv: dict
    conv: dict
    ssm: dict
    length: int = 0
    rope_delta: int = 0

    @classmethod
    def empty(cls, config: HybridConfig, kv_capacity: int, device: torch.device, kv_dtype: torch.dtype) -> "Checkpoint":
        c = config
        kv, conv, ssm = {}, {}, {}
        for i in range(c.num_layers):
            if c.is_attention(i):
                shape = (c.num_kv_heads, kv_capacity, c.head_dim)
                kv[i] = (new_kv(shape, kv_dtype, device, zeros=False), new_kv(shape, kv_dtype, device, zeros=False))
            else:
                conv[i] = torch.empty((c.conv_kernel - 1, c.conv_dim), dtype=torch.float32, device=device)
                ssm[i] = torch.empty((c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim),
                                     dtype=torch.float32, device=device)
        return cls(config, torch.device(device), kv_capacity, kv, conv, ssm)

    @property
    def kv_dtype(self) -> torch.dtype:
        """The type its KV cache is held in (f32 where the model has no attention layer)."""
        for k, _ in self.kv.values():
            return k.dtype
        return torch.float32

    def with_kv(self, dtype: torch.dtype) -> "Checkpoint":
        """This checkpoint with its KV cache converted to `dtype` (itself where it is held in that type already; q8_0
        quantized from the values, or dequantized); the recurrent and conv state are f32 in every type and are
        shared, not copied."""
        if self.kv_dtype == dtype:
            return self
        kv = {i: (kv_as(k, dtype), kv_as(v, dtype)) for i, (k, v) in self.kv.items()}
        return Checkpoint(self.config, self.device, self.kv_capacity, kv, self.conv, self.ssm, self.length,
                          self.rope_delta)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for pair in self.kv.values() for t in pair) + \
            sum(t.nbytes for t in list(self.conv.values()) + list(self.ssm.values()))
