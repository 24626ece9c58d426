"""Install a model that scripts/demo/gpu_train.sh trained (its NAME.json and NAME-f16.gguf from $OUT), as train.py
installs the model it trains without --no-install:

    .venv/bin/python scripts/demo/install_result.py OUT/ft-a.json OUT/ft-a-f16.gguf

writes src/deltaserve/data/demo-qwen35.gguf, tests/data/demo_hf_check.json (transformers' greedy ids recorded at
training time, for the shipped-model test) and scripts/demo/training_log.{json,png}. It refuses a result without an
evaluation or greedy record, or whose GGUF is not the one the log says it installed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
INSTALL = ROOT / "src" / "deltaserve" / "data" / "demo-qwen35.gguf"
HF_CHECK = ROOT / "tests" / "data" / "demo_hf_check.json"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("result", type=Path, help="NAME.json from gpu_train.sh")
    ap.add_argument("gguf", type=Path, help="NAME-f16.gguf (or -f32) from gpu_train.sh")
    a = ap.parse_args()
    rec = json.loads(a.result.read_text())
    log, check = rec.get("training_log"), rec.get("hf_check")
    if not log or not log.get("eval") or not check:
        raise SystemExit(f"{a.result}: no training log with an evaluation, or no greedy record: not installable")
    if log["eval"].get("limit"):
        raise SystemExit(f"{a.result}: evaluated on a subset (--limit, a smoke run): not installable")
    want = log.get("installed_type", "f16")
    if not a.gguf.name.endswith(f"-{want}.gguf"):
        raise SystemExit(f"{a.gguf}: the log says the {want} GGUF is the one to install")
    INSTALL.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(a.gguf, INSTALL)
    HF_CHECK.write_text(json.dumps(check, indent=None, separators=(",", ":")) + "\n")
    (HERE / "training_log.json").write_text(json.dumps(log, indent=1) + "\n")
    try:
        sys.path.insert(0, str(HERE))
        import train

        train.plot(log, HERE / "training_log.png")
    except ImportError as e:
        print(f"training_log.png not redrawn: {e}")
    ev = log["eval"]
    print(f"installed {a.gguf} -> {INSTALL} ({INSTALL.stat().st_size / 1e6:.2f} MB); single "
          f"{ev['single_turn']['accuracy']:.3f}, recall {ev['recall_3plus_turns']['accuracy']:.3f}, tool calls "
          f"{ev['tools']['calls']['accuracy']:.3f}, answers {ev['tools']['answers_from_results']['accuracy']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
