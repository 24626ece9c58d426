"""Prometheus text exposition of the server's counters and histograms (no client library needed)."""

from __future__ import annotations

import threading


class Metrics:
    TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
    DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

    def __init__(self):
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, str], int] = {}    # (endpoint, status) -> count
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.generated_tokens = 0
        self.hist = {"ttft": self._empty(self.TTFT_BUCKETS), "duration": self._empty(self.DURATION_BUCKETS)}

    @staticmethod
    def _empty(buckets):
        return {"buckets": buckets, "counts": [0] * len(buckets), "sum": 0.0, "count": 0}

    def request(self, endpoint: str, status: int) -> None:
        with self._lock:
            key = (endpoint, str(status))
            self.requests[key] = self.requests.get(key, 0) + 1

    def tokens(self, prompt: int, cached: int, generated: int) -> None:
        with self._lock:
            self.prompt_tokens += prompt
            self.cached_tokens += cached
            self.generated_tokens += generated

    def observe(self, name: str, seconds: float) -> None:
        with self._lock:
            h = self.hist[name]
            for i, b in enumerate(h["buckets"]):
                if seconds <= b:
                    h["counts"][i] += 1
            h["sum"] += seconds
            h["count"] += 1

    def render(self, queue_depth: int, busy_slots: int, slots: int) -> str:
        with self._lock:
            out = ["# HELP deltaserve_requests_total Requests answered, by endpoint and status.",
                   "# TYPE deltaserve_requests_total counter"]
            for (endpoint, status), n in sorted(self.requests.items()):
                out.append(f'deltaserve_requests_total{{endpoint="{endpoint}",status="{status}"}} {n}')
            for name, value, text in (
                    ("prompt_tokens", self.prompt_tokens, "Prompt tokens of completed generations."),
                    ("cached_tokens", self.cached_tokens, "Prompt tokens a session reused instead of prefilling."),
                    ("generated_tokens", self.generated_tokens, "Tokens generated.")):
                out += [f"# HELP deltaserve_{name}_total {text}", f"# TYPE deltaserve_{name}_total counter",
                        f"deltaserve_{name}_total {value}"]
            for name, text in (("ttft", "Time to first token."), ("duration", "Request duration.")):
                h = self.hist[name]
                metric = f"deltaserve_{'time_to_first_token' if name == 'ttft' else 'request_duration'}_seconds"
                out += [f"# HELP {metric} {text}", f"# TYPE {metric} histogram"]
                for b, c in zip(h["buckets"], h["counts"]):
                    out.append(f'{metric}_bucket{{le="{b}"}} {c}')
                out += [f'{metric}_bucket{{le="+Inf"}} {h["count"]}', f"{metric}_sum {h['sum']:.6f}",
                        f"{metric}_count {h['count']}"]
            out += ["# HELP deltaserve_queue_depth Requests waiting for a slot.", "# TYPE deltaserve_queue_depth gauge",
                    f"deltaserve_queue_depth {queue_depth}",
                    "# HELP deltaserve_busy_slots Slots running a generation.", "# TYPE deltaserve_busy_slots gauge",
                    f"deltaserve_busy_slots {busy_slots}",
                    "# HELP deltaserve_slots Resident sessions.", "# TYPE deltaserve_slots gauge",
                    f"deltaserve_slots {slots}"]
            return "\n".join(out) + "\n"
