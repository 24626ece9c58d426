"""The server's Prometheus metrics, on prometheus_client, in a registry of each server's own."""

from __future__ import annotations

import threading

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest


class Metrics:
    TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
    DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
    CONTENT_TYPE = CONTENT_TYPE_LATEST

    def __init__(self):
        # a registry per server, never the process-wide default: several servers may live in one process
        self.registry = reg = CollectorRegistry()
        self._render_lock = threading.Lock()
        # prometheus_client names a counter `x` and exposes it as x_total
        self.requests = Counter("deltaserve_requests", "Requests answered, by endpoint and status.",
                                ["endpoint", "status"], registry=reg)
        self.prompt_tokens = Counter("deltaserve_prompt_tokens", "Prompt tokens of completed generations.",
                                     registry=reg)
        self.cached_tokens = Counter("deltaserve_cached_tokens", "Prompt tokens a session reused instead of prefilling.",
                                     registry=reg)
        self.generated_tokens = Counter("deltaserve_generated_tokens", "Tokens generated.", registry=reg)
        self.hist = {
            "ttft": Histogram("deltaserve_time_to_first_token_seconds", "Time to first token.",
                              buckets=self.TTFT_BUCKETS, registry=reg),
            "duration": Histogram("deltaserve_request_duration_seconds", "Request duration.",
                                  buckets=self.DURATION_BUCKETS, registry=reg),
        }
        self.queue_depth = Gauge("deltaserve_queue_depth", "Requests waiting for a slot.", registry=reg)
        self.busy_slots = Gauge("deltaserve_busy_slots", "Slots running a generation.", registry=reg)
        self.slots = Gauge("deltaserve_slots", "Resident sessions.", registry=reg)
        self.store_states = Gauge("deltaserve_state_store_states", "Saved conversation states, by tier.", ["tier"],
                                  registry=reg)
        self.store_bytes = Gauge("deltaserve_state_store_bytes", "Bytes the saved states take, by tier.", ["tier"],
                                 registry=reg)
        self.store_budget = Gauge("deltaserve_state_store_budget_bytes", "The state store's budget, by tier.",
                                  ["tier"], registry=reg)
        # the store counts for itself (several sessions feed it); these report its counts at each scrape
        self.store_events = Gauge("deltaserve_state_store_events", "State store events since start: hits, misses, "
                                  "restores_ram, restores_disk, evictions_ram, evictions_disk, refused_files, "
                                  "writes, write_errors.", ["event"], registry=reg)
        self.slot_prefills = Gauge("deltaserve_slot_batched_prefills", "Batched prefills a slot ran since start.",
                                   ["slot"], registry=reg)
        self.slot_replays = Gauge("deltaserve_slot_replays", "Turns a slot replayed on the CPU after a fallback.",
                                  ["slot"], registry=reg)
        self.slot_drafted = Gauge("deltaserve_slot_mtp_drafted_tokens", "Tokens a slot drafted with the MTP block "
                                  "since start.", ["slot"], registry=reg)
        self.slot_accepted = Gauge("deltaserve_slot_mtp_accepted_tokens", "Drafted tokens the model's verification "
                                   "kept, since start.", ["slot"], registry=reg)
        self.slot_accelerator = Gauge("deltaserve_slot_on_accelerator", "1 while a slot runs on an accelerator.",
                                      ["slot"], registry=reg)
        # the engine loop's own counts (runtime/engine.py), set at each scrape
        self.engine_rows = Gauge("deltaserve_engine_rows", "Rows the engine loop's forwards carried since start, by "
                                 "kind: decode (a sequence's next token), verify (a token and its drafts), prefill "
                                 "(prompt tokens).", ["kind"], registry=reg)
        self.engine_steps = Gauge("deltaserve_engine_steps", "Steps of the engine loop since start.", registry=reg)
        self.engine_forwards = Gauge("deltaserve_engine_forwards", "Forward calls the engine loop made since start.",
                                     registry=reg)
        self.engine_gap = Gauge("deltaserve_engine_token_gap_seconds", "Time between two decode steps of a sequence, "
                                "over the last 4096 gaps: p50, p99, max.", ["quantile"], registry=reg)
        self.engine_queue_wait = Gauge("deltaserve_engine_queue_wait_seconds", "Time from a sequence's submission to "
                                       "its first step, median of the last 1024.", registry=reg)
        self.store_saved_tokens = Gauge("deltaserve_state_store_tokens_not_prefilled",
                                        "Prompt tokens restored from the state store instead of prefilled.",
                                        registry=reg)

    def slot_counts(self, slots) -> None:
        """Each slot's counts since start, set at a scrape: its batched prefills, its replays after a fallback,
        whether it is on an accelerator. `slots`: (index, session) pairs."""
        with self._render_lock:
            for i, session in slots:
                self.slot_prefills.labels(slot=str(i)).set(session.batched_prefills)
                self.slot_replays.labels(slot=str(i)).set(session.replays)
                mtp = session.drafting_stats()
                self.slot_drafted.labels(slot=str(i)).set(mtp["drafted"] if mtp else 0)
                self.slot_accepted.labels(slot=str(i)).set(mtp["accepted"] if mtp else 0)
                self.slot_accelerator.labels(slot=str(i)).set(int(session.on_accelerator))

    def engine_counts(self, snap: dict) -> None:
        """The engine loop's counts (`EngineStats.snapshot()`), set at a scrape."""
        with self._render_lock:
            for kind, n in snap["rows"].items():
                self.engine_rows.labels(kind=kind).set(n)
            self.engine_steps.set(snap["steps"])
            self.engine_forwards.set(snap["forwards"])
            for q, v in snap["token_gap_s"].items():
                self.engine_gap.labels(quantile=q).set(v or 0)
            self.engine_queue_wait.set(snap["queue_wait_s"]["p50"] or 0)

    def request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def tokens(self, prompt: int, cached: int, generated: int) -> None:
        self.prompt_tokens.inc(prompt)
        self.cached_tokens.inc(cached)
        self.generated_tokens.inc(generated)

    def observe(self, name: str, seconds: float) -> None:
        self.hist[name].observe(seconds)

    def render(self, queue_depth: int, busy_slots: int, slots: int, store: dict | None = None) -> bytes:
        """The exposition (text format, served as CONTENT_TYPE), the gauges set to the pool's and the state
        store's state now (`store`: StateStore.snapshot())."""
        with self._render_lock:  # two scrapes at once each show the state they set
            self.queue_depth.set(queue_depth)
            self.busy_slots.set(busy_slots)
            self.slots.set(slots)
            if store is not None:
                for tier in ("ram", "disk"):
                    self.store_states.labels(tier=tier).set(store[tier]["states"])
                    self.store_bytes.labels(tier=tier).set(store[tier]["bytes"])
                    self.store_budget.labels(tier=tier).set(store[tier]["budget"])
                events = {"hits": store["hits"], "misses": store["misses"], "refused_files": store["refused_files"],
                          "writes": store["writes"], "write_errors": store["write_errors"]}
                events.update({f"restores_{k}": v for k, v in store["restores"].items()})
                events.update({f"evictions_{k}": v for k, v in store["evictions"].items()})
                for k, v in events.items():
                    self.store_events.labels(event=k).set(v)
                self.store_saved_tokens.set(store["tokens_not_prefilled"])
            return generate_latest(self.registry)
