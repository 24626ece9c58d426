"""The parity guard: before an accelerator serves a session, its logits are compared with the CPU's.

Once per session, on the first real prompt: the prompt's first `PROBE_MAX` tokens are prefilled on
the accelerator and on the CPU reference, and the last (up to) `COMPARE` positions are compared.
Accepted when every compared position has cosine similarity >= `COS_MIN` and at least `ARGMAX_MIN`
of them agree on the argmax. A rejection is a fallback to the CPU. The verdict is cached on disk by what could
change it: the model file's sha256, deltaserve's and torch's versions, and the device's identity (a GPU's name, UUID,
driver and CUDA versions); a cached verdict is said with its age, and one older than `max_age` seconds
(--guard-max-age, a day by default) is decided again; `revalidate=True` forces a new comparison.
"""

from __future__ import annotations

import hashlib
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


MAX_AGE = 24 * 3600  # seconds a cached verdict is trusted (--guard-max-age)


def _age(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds:.0f} s"


class ParityGuard:
    def __init__(self, revalidate: bool = False, directory: Path | None = None, max_age: float = MAX_AGE):
        self.revalidate = revalidate
        self.directory = directory
        self.max_age = max_age

    def _path(self, sha: str, device_name: str, identity: str) -> Path:
        safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in device_name)
        key = hashlib.sha256(f"{identity}|torch {torch.__version__}".encode()).hexdigest()[:12]
        return (self.directory or cache_dir()) / f"{sha[:32]}-{__version__}-{safe}-{key}.json"

    def __call__(self, backend, host, prompt: list[int], say: Callable[[str], None]) -> str | None:
        """Compare `backend`'s logits for `prompt` with the CPU reference of `host`: None when the accelerator is
        accepted, else the reason for the fallback. Every verdict is said through `say`. An AcceleratorFailure
        raised while probing propagates (the caller falls back on it too)."""
        device_name = getattr(backend, "device_name", backend.name)
        identity = getattr(backend, "device_identity", device_name)
        sha = host.sha256()
        path = self._path(sha, device_name, identity)
        if not self.revalidate and path.exists():
            try:
                v = json.loads(path.read_text())
                age = max(time.time() - float(v["time"]), 0.0)
                if age <= self.max_age:
                    say(f"[deltaserve] parity guard: cached verdict for {device_name} from {_age(age)} ago: "
                        f"{'accepted' if v['accepted'] else 'rejected'} (min cosine {v['min_cos']:.6f}, "
                        f"argmax agreement {v['argmax']:.0%}; torch {torch.__version__}, {identity}; {path})")
                    return None if v["accepted"] else f"the CPU-parity guard rejected {device_name} (cached verdict)"
                say(f"[deltaserve] parity guard: the cached verdict for {device_name} is {_age(age)} old, more than "
                    f"{_age(self.max_age)} (--guard-max-age): probing again")
            except (ValueError, KeyError, TypeError, OSError):
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
                   "probe_tokens": len(probe), "device": device_name, "identity": identity, "torch": torch.__version__,
                   "version": __version__, "sha256": sha, "seconds": round(time.perf_counter() - t0, 3),
                   "time": time.time()}
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
