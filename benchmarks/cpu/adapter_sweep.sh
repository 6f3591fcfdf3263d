#!/usr/bin/env bash
# The 16 -> 500 adapter sweep (zipf alpha 1, max_loras 8) on a backlog of 384 requests, CPU,
# hidden 512: run_all.sh's sweep replays its 48-request burst, which is mostly ramp-up and
# drain; this one measures a backlogged engine (about 3 minutes on 2 cores).
# Usage: benchmarks/cpu/adapter_sweep.sh OUTDIR
set -euo pipefail
out=${1:?usage: benchmarks/cpu/adapter_sweep.sh OUTDIR}
root=$(cd "$(dirname "$0")/../.." && pwd)
py=${PYTHON:-$root/.venv/bin/python}
mkdir -p "$out"
"$py" "$root/benchmarks/serve.py" --out "$out" --num-requests 48 --adapters 16 --popularity zipf --alpha 1 \
  --rate 4 --input-len 8,16 --output-len 16,32 --hidden 512 --layers 4 --max-loras 8 --repeats 3 \
  --baselines none --sweep-adapters 16,500 --sweep-requests 384 --sweep-rates '' --ranks 8,16 | tee "$out/serve.txt"
echo "results in $out"
