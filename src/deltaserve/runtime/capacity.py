"""The capacity plan: add up what a call needs, compare it with the measured free memory, refuse with the arithmetic.

Nothing is allocated before a plan fits. Where several prefill plans exist (rows per prefill call,
attention query rows), the first that fits is taken and the ones passed over are named.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deltaserve.engine.state import kv_position_bytes, kv_type_name  # noqa: F401 - kv_position_bytes: inspect's
from deltaserve.errors import CapacityError
from deltaserve.formats.config import HybridConfig

MiB = 1 << 20
KiB = 1 << 10
CPU_OVERHEAD = 256 * MiB    # interpreter, torch runtime, allocator slack
CUDA_OVERHEAD = 512 * MiB   # CUDA context, cuBLAS workspaces, allocator slack


@dataclass(frozen=True)
class PrefillPlan:
    """How a long span is prefilled: `rows` tokens per forward call, attention scores `query_rows` at a time."""

    rows: int
    query_rows: int

    @property
    def label(self) -> str:
        return f"prefill {self.rows} rows x attention {self.query_rows} query rows"


@dataclass(frozen=True)
class Memory:
    free: int
    total: int
    source: str  # e.g. "cpu: MemAvailable" or "cuda:0: mem_get_info"


def cpu_memory() -> Memory:
    info = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, value = line.split(":", 1)
                info[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    total = info.get("MemTotal", 0)
    free = info.get("MemAvailable", info.get("MemFree", 0))
    # a cgroup limit (containers) is the real ceiling when it is lower
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            raw = open(path).read().strip()
            limit = int(raw) if raw != "max" else 0
        except (OSError, ValueError):
            continue
        if 0 < limit < total:
            used_path = path.replace("memory.max", "memory.current").replace("limit_in_bytes", "usage_in_bytes")
            try:
                used = int(open(used_path).read().strip())
            except (OSError, ValueError):
                used = 0
            return Memory(min(free, max(limit - used, 0)), limit, "cpu: cgroup limit")
    return Memory(free, total, "cpu: MemAvailable")


# Attention queries go 64 at a time while the memory allows: a query block's arithmetic then has the same shape
# wherever a prefill was cut (the engine loop cuts prompts at multiples of 64 from their start), so a prompt fed in
# chunks between other sequences' decode steps gives the same bits as fed whole.
PREFILL_PLANS = (PrefillPlan(2048, 64), PrefillPlan(512, 64), PrefillPlan(128, 32), PrefillPlan(64, 8))


def workspace_bytes(c: HybridConfig, plan: PrefillPlan, positions: int) -> int:
    """Peak transient memory of one prefill call of `plan.rows` tokens with `positions` in the cache (f32)."""
    r = plan.rows
    # activations live at once in a layer: residual, normed input, mixer projections, MLP gate/up, outputs
    widest_mixer = max(3 * c.conv_dim + 2 * c.value_dim,                 # qkv, conv window, z, output
                       3 * c.num_attention_heads * c.head_dim + 4 * c.num_kv_heads * c.head_dim)
    # an MoE layer: the router's logits and probabilities, each (row, expert) pair's output (k rows of hidden) and its
    # gate, up and SwiGLU (3 x the expert's width each: the native call's buffer), the routed sum in one more row
    k = c.num_experts_per_tok
    moe = (2 * c.num_experts + 4 * k + c.hidden_size + k * (c.hidden_size + 3 * c.moe_intermediate_size)
           if c.is_moe else 0)
    per_row = 4 * c.hidden_size + widest_mixer + 3 * c.ffn_size + moe
    activations = r * per_row * 4
    # chunked delta rule: per value head, [chunk x chunk] systems and [chunk x d] solves for every chunk
    chunks = -(-r // 64)
    nv, dk, dv = c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    delta = nv * chunks * 64 * (5 * 64 + 4 * dk + 4 * dv) * 4
    # attention scores (+ mask) for query_rows queries over all positions
    scores = c.num_attention_heads * min(plan.query_rows, r) * positions * (4 + 1)
    logits = c.vocab_size * 4 * 2
    return activations + delta + scores + logits


@dataclass
class Plan:
    weights: int
    positions: int
    kv_per_position: int
    kv_dtype: str
    state: int
    workspace: int
    overhead: int
    memory: Memory
    prefill: PrefillPlan
    passed_over: list[str] = field(default_factory=list)
    resident: int = 0  # weights already in this memory (not counted again)
    speculative: int = 0  # speculative decoding's buffers: the MTP block's KV and the rollback snapshots

    @property
    def kv(self) -> int:
        return self.positions * self.kv_per_position

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.state + self.workspace + self.overhead + self.speculative

    @property
    def fits(self) -> bool:
        return self.total <= self.memory.free

    def arithmetic(self) -> str:
        weights = f"weights {mib(self.weights)} MiB"
        if self.resident and not self.weights:
            weights += f" (the {mib(self.resident)} MiB loaded are resident already)"
        return (f"{weights} + KV {mib(self.kv)} MiB ({self.positions} positions x "
                f"{kib(self.kv_per_position)} KiB {self.kv_dtype}) + state {mib(self.state)} MiB + "
                + (f"MTP drafting {mib(self.speculative)} MiB + " if self.speculative else "") +
                f"workspace {mib(self.workspace)} MiB + overhead {mib(self.overhead)} MiB = {mib(self.total)} MiB, "
                f"against {mib(self.memory.free)} MiB free of {mib(self.memory.total)} MiB ({self.memory.source})")

    def describe(self) -> str:
        lines = [self.arithmetic(), f"prefill plan: {self.prefill.label}"]
        if self.passed_over:
            lines.append("passed over: " + "; ".join(self.passed_over))
        return "\n".join(lines)


def speculative_bytes(c: HybridConfig, positions: int, drafts: int) -> int:
    """What drafting up to `drafts` tokens with the MTP block adds to a state of `positions`: the block's KV cache
    (one attention layer's, f32) and a copy of the recurrent and conv state per draft (the rollback points)."""
    if drafts <= 0:
        return 0
    return positions * 2 * c.num_kv_heads * c.head_dim * 4 + drafts * c.recurrent_state_bytes()


def mib(n: int) -> int:
    return int(round(n / MiB))


def kib(n: int) -> str:
    v = n / KiB
    return f"{v:.0f}" if v == int(v) else f"{v:.1f}"


def plan(c: HybridConfig, positions: int, memory: Memory, weights: int = 0, overhead: int = CPU_OVERHEAD,
         kv_dtype_bytes: int = 4, plans: tuple[PrefillPlan, ...] = PREFILL_PLANS, resident: int = 0,
         speculative: int = 0, kv_type: str | None = None) -> Plan:
    """The first prefill plan whose total fits `memory.free`, or CapacityError carrying the arithmetic.

    `weights` counts weights not yet resident; `resident` names those already loaded (for the message);
    `speculative`: the bytes speculative decoding adds for this state (see `speculative_bytes`); `kv_type`: the KV
    cache's type (engine/state.py: KV_TYPES; None: `kv_dtype_bytes` a value, 4 f32 and 2 f16).
    """
    if kv_type is not None:
        kv_name = kv_type_name(kv_type)
        kv_per_pos = kv_position_bytes(c, kv_name)
    else:
        kv_per_pos = c.kv_bytes_per_position(kv_dtype_bytes)
        kv_name = {4: "f32", 2: "f16"}.get(kv_dtype_bytes, f"{kv_dtype_bytes}-byte")
    passed: list[str] = []
    last: Plan | None = None
    for p in plans:
        candidate = Plan(weights, positions, kv_per_pos, kv_name, c.recurrent_state_bytes(),
                         workspace_bytes(c, p, positions), overhead, memory, p, list(passed), resident, speculative)
        if candidate.fits:
            return candidate
        passed.append(f"{p.label} needs {mib(candidate.total)} MiB")
        last = candidate
    assert last is not None
    err = CapacityError(f"the plan for {positions} positions does not fit: {last.arithmetic()}")
    err.refused = passed  # what each prefill plan tried needed
    raise err
