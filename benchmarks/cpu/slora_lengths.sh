#!/usr/bin/env bash
# The serving benchmark on S-LoRA's length ranges (prompts and outputs of 8-512 tokens), CPU,
# hidden 512, 16 zipf adapters in 16 slots, against no adapters and transformers + PEFT
# (about 8 minutes on 2 cores; run_all.sh keeps to short sequences to stay within 10 minutes).
# Usage: benchmarks/cpu/slora_lengths.sh OUTDIR
set -euo pipefail
out=${1:?usage: benchmarks/cpu/slora_lengths.sh OUTDIR}
root=$(cd "$(dirname "$0")/../.." && pwd)
py=${PYTHON:-$root/.venv/bin/python}
mkdir -p "$out"
"$py" "$root/benchmarks/serve.py" --out "$out" --num-requests 48 --adapters 16 --popularity zipf --alpha 1 \
  --rate 4 --input-len 2,100 --output-len 8,512 --hidden 512 --layers 4 --max-loras 16 --repeats 2 \
  --baselines no-adapter,peft --sweep-adapters '' --sweep-rates '' --ranks 8,16 | tee "$out/serve.txt"
echo "results in $out"
