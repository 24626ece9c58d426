#!/usr/bin/env bash
# Issue 17 ("the demo model learns one tool"): train the demo model with tool round trips on one CUDA GPU, several
# configurations at once, each exported, checked and evaluated (evaluate.py: the held-out single-turn, recall,
# think-auto and tool sets, through deltaserve on the CPU), in about 5 minutes of wall time in all (DEADLINE_S=350
# bounds every step).
#
#   bash scripts/demo/gpu_train.sh                      # on the GPU machine, repository root; results in $OUT
#   GPU_TRAIN_SMOKE=1 PYTHON=.venv/bin/python bash scripts/demo/gpu_train.sh   # CPU, a few steps each (pipeline check)
#
# Configurations (CONFIGS, default "ft-a ft-b scratch"), all with --no-install (the repository's files stay as they
# are) and a --minutes budget for the training loop (TRAIN_MINUTES, default 3.25):
#   ft-a     fine-tune of the shipped src/deltaserve/data/demo-qwen35.gguf: lr 2e-4, batch 64, 30 % tool dialogs
#   ft-b     the same, bolder: lr 5e-4, 40 % tool dialogs
#   scratch  the whole model from scratch (the script's tokenizer, which is the shipped one when `tokenizers` learns
#            the same merges; the log says), lr 1e-3, batch 64, 30 % tool dialogs after the copying/adding curriculum
# Why these: the CPU attempt (tools_finetune_attempt.json) ran 300 steps at a 4e-4 peak with --batch-tokens 8192, so
# its ~1000-token tool samples came 7-8 to a batch and filled 57 % of the steps while being 25 % of the samples,
# on a learning rate re-warmed to 8x the shipped model's last; too few steps to learn two calls or `add`, too much
# tool pressure to keep repeat/reverse/recall. Here: no token cap (tool batches are as full as the others, so the
# tool share of the steps is the tool share of the samples), 70 % replay of the exact corpus mix the shipped model
# ends on, lower peaks, and thousands of steps of 64 samples (launch-bound steps: a bigger batch costs ~nothing).
#
# Returns in $OUT (8 files): per configuration NAME.json (config, training log, teacher-forced checks, evaluation
# with failures, greedy ids for tests/data/demo_hf_check.json) and NAME-f16.gguf (or -f32 when f16 changed answers),
# summary.txt, logs.txt. Needs torch (CUDA), transformers, tokenizers, jinja2, safetensors, numpy, and gguf (wheels
# in .whl/, installed to /tmp/site as scripts/gpu_check.sh does). Threads: each job one trainer process (2 torch
# threads) and DATA_WORKERS sampling processes; the evaluations one thread per process (EVAL_JOBS each).
set -uo pipefail
cd "$(dirname "$0")/../.."
T0=$(date +%s)
PY=${PYTHON:-python3}
if ls .whl/*.whl >/dev/null 2>&1 && ! "$PY" -c "import gguf" 2>/dev/null; then  # only gguf is needed here
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/gguf-*.whl
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD/src:$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export DELTASERVE_DEVICE=cpu   # deltaserve's evaluation on the CPU, as the shipped numbers were measured
OUT=${OUT:-/tmp/gpu_train_out}
WORK=${WORK:-/tmp/gpu_train}
mkdir -p "$OUT" "$WORK"
SMOKE=${GPU_TRAIN_SMOKE:-0}
CONFIGS=${CONFIGS:-"ft-a ft-b scratch"}
if [ "$SMOKE" = 1 ]; then
  DEVICE=${DEVICE:-cpu}; MINUTES=${TRAIN_MINUTES:-0.5}; MAX_STEPS=${MAX_STEPS:-4}; CHECK_EVERY=${CHECK_EVERY:-1000}
  DATA_WORKERS=${DATA_WORKERS:-1}; EVAL_JOBS=${EVAL_JOBS:-1}; DEADLINE_S=${DEADLINE_S:-1800}
  EXTRA="--plan-after 3 --batch 8"; EVAL_EXTRA="--limit 8"
else
  DEVICE=${DEVICE:-cuda}; MINUTES=${TRAIN_MINUTES:-3.25}; MAX_STEPS=${MAX_STEPS:-20000}; CHECK_EVERY=${CHECK_EVERY:-400}
  DATA_WORKERS=${DATA_WORKERS:-4}; EVAL_JOBS=${EVAL_JOBS:-4}; DEADLINE_S=${DEADLINE_S:-350}
  EXTRA=""; EVAL_EXTRA=""
fi
BASE=$WORK/base.gguf
[ "${COLLECT_ONLY:-0}" = 1 ] || cp src/deltaserve/data/demo-qwen35.gguf "$BASE"

args_for() {
  case "$1" in
    ft-a) echo --finetune "$BASE" --lr 2e-4 --warmup 100 --batch 64 --tools-frac 0.3 --tool-weights 3,2,2.5,2.5 ;;
    ft-b) echo --finetune "$BASE" --lr 5e-4 --warmup 100 --batch 64 --tools-frac 0.4 --tool-weights 3,2,2.5,2.5 ;;
    ft-c) echo --finetune "${FT_C_BASE:-$BASE}" --lr 3e-4 --warmup 60 --batch 64 --tools-frac 0.4 --tool-weights 2,5,2,2 ;;
    ft-d) echo --finetune "${FT_C_BASE:-$BASE}" --lr 2e-4 --warmup 60 --batch 64 --tools-frac 0.35 --tool-weights 3,3,2.5,2.5 ;;
    scratch) echo --lr 1e-3 --warmup 100 --batch 64 --tools-frac 0.3 --tools-from 0.22 --tool-weights 3,2,2.5,2.5 ;;
    *) echo "unknown configuration $1" >&2; return 1 ;;
  esac
}

{
  echo "== gpu_train.sh $(date -u +%FT%TZ) smoke=$SMOKE device=$DEVICE minutes=$MINUTES configs: $CONFIGS"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PY" -c "import torch, transformers, tokenizers, importlib.util as u; print('torch', torch.__version__, 'cuda', \
torch.version.cuda, 'available', torch.cuda.is_available(), '| transformers', transformers.__version__, \
'| tokenizers', tokenizers.__version__, '| fla', u.find_spec('fla') is not None, 'causal_conv1d', \
u.find_spec('causal_conv1d') is not None)"
  nproc
} 2>&1 | tee "$WORK/env.txt"

# deltaserve's native CPU kernels are compiled once per machine: now, while the models train
rm -f "$WORK/native.done"
( OMP_NUM_THREADS=1 "$PY" -c "import deltaserve; s = deltaserve.load().session(quiet=True); \
print(s.chat([{'role': 'user', 'content': 'Hi'}], max_tokens=4).text)" > "$WORK/native.txt" 2>&1
  touch "$WORK/native.done" ) &
wait_native() { local i; for i in $(seq 120); do [ -e "$WORK/native.done" ] && return; sleep 1; done; }

run_one() {  # NAME: train (exports, greedy check), then evaluate; everything in $WORK/NAME, log in $WORK/NAME.log
  local name=$1 dir=$WORK/$1
  local left=$(( DEADLINE_S - ($(date +%s) - T0) ))
  rm -rf "$dir"; mkdir -p "$dir"
  # shellcheck disable=SC2046
  OMP_NUM_THREADS=2 MKL_NUM_THREADS=2 timeout -k 5 $(( left - 20 )) "$PY" scripts/demo/train.py --out "$dir" \
    --device "$DEVICE" --minutes "$MINUTES" --steps "$MAX_STEPS" --check-every "$CHECK_EVERY" --threads 2 \
    --data-workers "$DATA_WORKERS" --no-install --skip-eval $(args_for "$name") $EXTRA > "$dir.log" 2>&1
  echo "train.py exit $?" >> "$dir.log"
  local type gguf
  type=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1])).get('installed_type','f16'))" \
         "$dir/training_log.json" 2>/dev/null || echo f16)
  gguf=$dir/demo-qwen35-$type.gguf
  [ -f "$gguf" ] || { echo "no $gguf" >> "$dir.log"; return; }
  wait_native
  left=$(( DEADLINE_S - ($(date +%s) - T0) ))
  OMP_NUM_THREADS=1 timeout -k 5 $(( left > 20 ? left : 20 )) "$PY" scripts/demo/evaluate.py "$gguf" \
    --jobs "$EVAL_JOBS" --json "$dir/eval.json" --failures 5 $EVAL_EXTRA >> "$dir.log" 2>&1
  echo "evaluate.py exit $?" >> "$dir.log"
}
if [ "${COLLECT_ONLY:-0}" != 1 ]; then  # COLLECT_ONLY=1: only gather what $WORK holds
  pids=()
  for name in $CONFIGS; do
    run_one "$name" &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p"; done
fi

# collect: NAME.json + NAME-TYPE.gguf per configuration, summary.txt, logs.txt
"$PY" - "$WORK" "$OUT" $CONFIGS <<'EOF' | tee "$WORK/summary.txt"
import json, shutil, sys
from pathlib import Path

work, out, names = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
SHIPPED = {"single": 0.963265306122449, "recall": 0.9416666666666667, "auto": 0.9, "n_single": 245, "n_recall": 120}
rows = []
for name in names:
    d = work / name
    rec = {"name": name}
    try:
        log = json.loads((d / "training_log.json").read_text())
    except (OSError, ValueError):
        log = None
    try:
        ev = json.loads((d / "eval.json").read_text())
    except (OSError, ValueError):
        ev = None
    try:
        check = json.loads((d / "demo_hf_check.json").read_text())
    except (OSError, ValueError):
        check = None
    if log is not None:
        log["eval"] = {k: v for k, v in ev.items() if k != "failures"} if ev else None
        rec["training_log"] = log
    rec["eval_failures"] = ev.get("failures") if ev else None
    rec["hf_check"] = check
    (out / f"{name}.json").write_text(json.dumps(rec, indent=1) + "\n")
    if log is not None:
        t = log.get("installed_type", "f16")
        g = d / f"demo-qwen35-{t}.gguf"
        if g.exists():
            shutil.copyfile(g, out / f"{name}-{t}.gguf")
    row = {"name": name}
    if log:
        row.update(steps=log.get("train_steps"), train_min=log.get("train_wall_s", 0) / 60,
                   tools=log.get("train_tool_samples"), samples=log.get("train_samples"),
                   agree=log.get("hf_check_agreement"), tok_same=log.get("tokenizer_same_as_shipped"),
                   lastcheck=(log.get("checks") or [{}])[-1], wait=log.get("data_wait_s"),
                   phases={k: round(v) for k, v in (log.get("phases_s") or {}).items()})
    if ev:
        tc, ta = ev["tools"]["calls"], ev["tools"]["answers_from_results"]
        row.update(single=ev["single_turn"]["accuracy"], recall=ev["recall_3plus_turns"]["accuracy"],
                   auto=ev["think_auto_single_turn"]["accuracy"], calls=tc["accuracy"], answers=ta["accuracy"],
                   calls_by={k: v["accuracy"] for k, v in tc["by_kind"].items()},
                   answers_by={k: v["accuracy"] for k, v in ta["by_kind"].items()},
                   by_kind={k: v["accuracy"] for k, v in ev["single_turn"]["by_kind"].items()})
        ds = round((row["single"] - SHIPPED["single"]) * SHIPPED["n_single"])
        dr = round((row["recall"] - SHIPPED["recall"]) * SHIPPED["n_recall"])
        row["keeps"] = ds >= 0 and dr >= 0 and not ev.get("limit")
        row["delta_items"] = f"single {ds:+d}/245, recall {dr:+d}/120"
        if ev.get("limit"):
            row["delta_items"] = f"QUICK CHECK on ~{ev['limit']} items a set, not scores"
        row["eval_s"] = ev.get("wall_s")
    rows.append(row)

print("== summary (shipped model: single 0.963, recall 0.942, think-auto 0.900, tool calls 0.050, answers 0.000)")
for r in rows:
    if "single" not in r:
        print(f"{r['name']}: NO EVALUATION (see logs.txt); trained steps {r.get('steps')}")
        continue
    print(f"{r['name']}: single {r['single']:.3f} recall {r['recall']:.3f} think-auto {r['auto']:.3f} | "
          f"tool calls {r['calls']:.3f} answers {r['answers']:.3f} | " +
          (r["delta_items"] if "QUICK" in r["delta_items"] else
           f"{r['delta_items']} vs shipped -> {'KEEPS' if r['keeps'] else 'loses'} scores"))
    print("    calls " + ", ".join(f"{k} {v:.2f}" for k, v in r["calls_by"].items()) + "; answers " +
          ", ".join(f"{k} {v:.2f}" for k, v in r["answers_by"].items()))
    print("    single " + ", ".join(f"{k} {v:.2f}" for k, v in r["by_kind"].items()))
    print(f"    {r.get('steps')} steps in {r.get('train_min', 0):.1f} min, {r.get('samples')} samples "
          f"({r.get('tools')} tool), data wait {r.get('wait') or 0:.0f} s, transformers/deltaserve greedy agreement "
          f"{r.get('agree')}, tokenizer = shipped: {r.get('tok_same')}")
    print(f"    seconds: {r.get('phases')}, evaluation {r.get('eval_s') or 0:.0f}")
ok = [r for r in rows if r.get("keeps")]
if ok:
    best = max(ok, key=lambda r: r["calls"] + r["answers"])
    print(f"best that keeps the scores: {best['name']} (tool calls {best['calls']:.3f}, answers {best['answers']:.3f})")
else:
    print("no configuration keeps both scores")
EOF
cp "$WORK/summary.txt" "$OUT/summary.txt"
{
  cat "$WORK/env.txt"
  for name in $CONFIGS; do echo; echo "======== $name"; cat "$WORK/$name.log" 2>/dev/null; done
  echo; echo "======== native kernel build"; cat "$WORK/native.txt" 2>/dev/null
} > "$OUT/logs.txt"
echo "wall $(( $(date +%s) - T0 )) s; files in $OUT:"
ls -la "$OUT"
