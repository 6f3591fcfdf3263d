#!/usr/bin/env bash
# GPU verification in one go (< 10 minutes on an H200): the `cuda`-marked tests, the
# capability probe, the LoRA op benchmark, and the serving benchmark (lorafleet vs the same
# engine without adapters vs transformers+PEFT on the GPU). Every result lands in OUTDIR as JSON:
#
#   OUTDIR/pytest_cuda.xml   junit of `pytest -m cuda`      OUTDIR/pytest_cuda.json  its summary
#   OUTDIR/probe.json        `lorafleet probe --device cuda --json`
#   OUTDIR/lora_ops.json     `benchmarks/lora_ops.py --device cuda --json`
#   OUTDIR/serve/            `benchmarks/serve.py --device cuda` (summary.json and plots)
#   OUTDIR/status.json       exit code and seconds of each step (a failed step does not stop the rest)
#   OUTDIR/*.log             their console output
#
# Usage: benchmarks/cuda/run_all.sh OUTDIR      (PYTHON=... to pick the interpreter)
# Runs real kernels: TRITON_INTERPRET is removed from the environment, never set.
# Needs torch, triton, transformers, peft, pytest (the GPU image has them); no server modules.
set -u -o pipefail

if [ $# -ne 1 ]; then
  echo "usage: $0 OUTDIR" >&2
  exit 2
fi
OUT=$(mkdir -p "$1" && cd "$1" && pwd)
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PY=${PYTHON:-python3}
unset TRITON_INTERPRET
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
cd "$ROOT"

STEPS=()
step() {  # step NAME TIMEOUT_S COMMAND...: run, log, record rc and duration
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  echo "== $name: $*" >&2
  timeout "$limit" "$@" > >(tee "$OUT/$name.log") 2>&1
  local rc=$?
  STEPS+=("\"$name\": {\"rc\": $rc, \"seconds\": $((SECONDS - start)), \"timeout_s\": $limit}")
  echo "== $name: rc=$rc in $((SECONDS - start)) s" >&2
}

step pytest_cuda 240 "$PY" -m pytest -m cuda -o addopts="" -q -p no:cacheprovider --continue-on-collection-errors \
  --junitxml="$OUT/pytest_cuda.xml" tests
"$PY" - "$OUT/pytest_cuda.xml" "$OUT/pytest_cuda.json" <<'PYEOF'
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
if not src.is_file():
    dst.write_text(json.dumps({"error": f"{src} was not written"}))
    sys.exit(0)
cases = []
for case in ET.parse(src).getroot().iter("testcase"):
    outcome = "passed"
    for tag in ("failure", "error", "skipped"):
        node = case.find(tag)
        if node is not None:
            outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
            message = (node.get("message") or "")[:500]
            break
    else:
        message = ""
    cases.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                  "seconds": float(case.get("time") or 0), "message": message})
counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "error", "skipped")}
dst.write_text(json.dumps({"counts": counts, "cases": cases}, indent=2))
PYEOF

# `lorafleet` may not be on PATH when the project is not pip-installed; the module is the same CLI.
step probe 90 bash -c "\"$PY\" -m runtime.cli probe --device cuda --json > \"$OUT/probe.json\""

step lora_ops 300 "$PY" benchmarks/lora_ops.py --device cuda --json "$OUT/lora_ops.json"

# Never run yet (no GPU was lent to the sessions that wrote it): sizes are a guess for one H200.
step serve 300 "$PY" benchmarks/serve.py --out "$OUT/serve" --device cuda --num-requests 96 --adapters 16 --popularity zipf \
  --alpha 1 --rate 8 --input-len 16,64 --output-len 32,128 --hidden 2048 --layers 8 --max-loras 16 --repeats 2 \
  --baselines no-adapter,peft --sweep-adapters 16,500 --sweep-rates ''

{
  echo "{"
  for i in "${!STEPS[@]}"; do
    sep=","; [ "$i" -eq $((${#STEPS[@]} - 1)) ] && sep=""
    echo "  ${STEPS[$i]}$sep"
  done
  echo "}"
} > "$OUT/status.json"
cat "$OUT/status.json"
