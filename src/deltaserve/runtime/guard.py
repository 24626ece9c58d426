"""The parity guard: before an accelerator serves a session, its logits are compared with the CPU's.

Once per session, on the first real prompt: the prompt's first `PROBE_MAX` tokens are prefilled on
the accelerator and on the CPU reference, and the last (up to) `COMPARE` positions are compared.
Accepted when every compared position has cosine similarity >= `COS_MIN` and at least `ARGMAX_MIN`
of them agree on the argmax. A rejection is a fallback to the CPU. The verdict is cached on disk by
(model file sha256, deltaserve version, device name); `revalidate=True` forces a new comparison.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

import torch

from deltaserve.version import __version__
from deltaserve.cachedir import cache_root
from deltaserve.engine.forward import Forward

PROBE_MAX = 512
COMPARE = 64
COS_MIN = 0.999
ARGMAX_MIN = 0.90


def cache_dir() -> Path:
    return cache_root() / "guard"


def compare(device_logits: torch.Tensor, cpu_logits: torch.Tensor) -> tuple[float, float]:
    """(minimum cosine similarity over positions, fraction of positions whose argmax agrees)."""
    a, b = device_logits.float().cpu(), cpu_logits.float().cpu()
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean()
    return float(cos.min()), float(agree)


class ParityGuard:
    def __init__(self, revalidate: bool = False, directory: Path | None = None):
        self.revalidate = revalidate
        self.directory = directory

    def _path(self, sha: str, device_name: str) -> Path:
        safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in device_name)
        return (self.directory or cache_dir()) / f"{sha[:32]}-{__version__}-{safe}.json"

    def __call__(self, backend, host, prompt: list[int], say: Callable[[str], None]) -> str | None:
        """Compare `backend`'s logits for `prompt` with the CPU reference of `host`: None when the accelerator is
        accepted, else the reason for the fallback. Every verdict is said through `say`. An AcceleratorFailure
        raised while probing propagates (the caller falls back on it too)."""
        device_name = getattr(backend, "device_name", backend.name)
        sha = host.sha256()
        path = self._path(sha, device_name)
        if not self.revalidate and path.exists():
            try:
                v = json.loads(path.read_text())
                say(f"[deltaserve] parity guard: cached verdict for {device_name}: "
                            f"{'accepted' if v['accepted'] else 'rejected'} (min cosine {v['min_cos']:.6f}, "
                            f"argmax agreement {v['argmax']:.0%}, {path})")
                return None if v["accepted"] else f"the CPU-parity guard rejected {device_name} (cached verdict)"
            except (ValueError, KeyError, OSError):
                pass  # an unreadable verdict is decided again
        probe = prompt[:PROBE_MAX]
        t0 = time.perf_counter()
        state = backend.new_state(len(probe))
        device_logits = backend.prefill(state, probe, all_logits=True)[-COMPARE:]
        if hasattr(backend, "guard_logits"):
            device_logits = backend.guard_logits(device_logits)
        del state
        ref = Forward(host.config, host.weights, "cpu")
        ref_state = ref.new_state(len(probe))
        cpu_logits = ref.prefill(ref_state, probe, all_logits=True)[-COMPARE:]
        min_cos, agree = compare(device_logits, cpu_logits)
        accepted = min_cos >= COS_MIN and agree >= ARGMAX_MIN
        verdict = {"accepted": accepted, "min_cos": min_cos, "argmax": agree, "positions": int(cpu_logits.shape[0]),
                   "probe_tokens": len(probe), "device": device_name, "version": __version__, "sha256": sha,
                   "seconds": round(time.perf_counter() - t0, 3)}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(verdict, indent=1))
        except OSError:
            pass
        say(f"[deltaserve] parity guard on {device_name}: {'accepted' if accepted else 'REJECTED'} "
                    f"(min cosine {min_cos:.6f} >= {COS_MIN}? argmax agreement {agree:.0%} >= {ARGMAX_MIN:.0%}? "
                    f"over {cpu_logits.shape[0]} positions)")
        if accepted:
            return None
        return (f"the CPU-parity guard rejected {device_name}: min cosine {min_cos:.6f} (needs {COS_MIN}), "
                f"argmax agreement {agree:.0%} (needs {ARGMAX_MIN:.0%})")
