#!/usr/bin/env bash
# CPU benchmarks in one go (about 8 minutes on 2 cores): the LoRA op benchmark, the base GEMM, decode attention, the serving
# benchmark with baselines, sweeps and plots (hidden 512: max_loras 8 and 16; hidden 1024: max_loras 16,
# offline comparisons and the online replay, no sweeps), packed vs plain base weights in the engine, and engine
# throughput at hidden 512 and 1024.
# Usage: benchmarks/cpu/run_all.sh OUTDIR
set -euo pipefail
out=${1:?usage: benchmarks/cpu/run_all.sh OUTDIR}
root=$(cd "$(dirname "$0")/../.." && pwd)
py=${PYTHON:-$root/.venv/bin/python}
mkdir -p "$out"
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "host: $(uname -m), $(nproc) cores, $(free -g | awk '/Mem:/{print $2}') GiB"
  echo "cpu: $(PYTHONPATH="$root" "$py" -c "from runtime.bench.machine import cpu_model; print(cpu_model())")"
  echo "float32 GEMM (cpu_gemm auto): $(PYTHONPATH="$root" "$py" -c "from runtime.models.dense import float32_packed; print('onednn' if float32_packed('auto') else 'mkl')")"
  "$py" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'threads', torch.get_num_threads())"
} > "$out/env.txt"
cat "$out/env.txt"
echo "== LoRA ops (cpu)"
"$py" "$root/benchmarks/lora_ops.py" --device cpu --json "$out/lora_ops.json" | tee "$out/lora_ops.txt"
echo "== base GEMM (cpu): packed weights (oneDNN), plain weights, F.linear (MKL), hidden 512 and 1024; bfloat16 at hidden 512"
"$py" "$root/benchmarks/cpu_gemm.py" --json "$out/cpu_gemm.json" | tee "$out/cpu_gemm.txt"
"$py" "$root/benchmarks/cpu_gemm.py" --hidden 1024 --rows 1,11,32,128 --json "$out/cpu_gemm_h1024.json" | tee "$out/cpu_gemm_h1024.txt"
"$py" "$root/benchmarks/cpu_gemm.py" --dtype bfloat16 --rows 1,4,11,32,128,512 --json "$out/cpu_gemm_bf16.json" | tee "$out/cpu_gemm_bf16.txt"
echo "== decode attention (cpu): one padded group vs cache-sized groups"
"$py" "$root/benchmarks/decode_attention.py" --json "$out/decode_attention.json" | tee "$out/decode_attention.txt"
echo "== serving benchmark (cpu)"
"$py" "$root/benchmarks/serve.py" --out "$out/serve" --num-requests 48 --adapters 16 --popularity zipf --alpha 1 \
  --rate 4 --input-len 8,16 --output-len 16,32 --hidden 512 --layers 4 --max-loras 8 --repeats 3 \
  --loop-requests 12 --sweep-adapters 16,100,500 --sweep-rates 2,4,8 --ranks 8,16 | tee "$out/serve.txt"
echo "== serving benchmark (cpu), every adapter of the workload fitting one step (max_loras 16)"
"$py" "$root/benchmarks/serve.py" --out "$out/serve-ml16" --workdir "$out/serve/weights" --num-requests 48 --adapters 16 \
  --popularity zipf --alpha 1 --rate 4 --input-len 8,16 --output-len 16,32 --hidden 512 --layers 4 --max-loras 16 \
  --repeats 3 --baselines no-adapter,peft --sweep-adapters '' --sweep-rates '' --ranks 8,16 | tee "$out/serve-ml16.txt"
echo "== serving benchmark (cpu), hidden 1024, max_loras 16, no sweeps"
"$py" "$root/benchmarks/serve.py" --out "$out/serve-h1024" --workdir "$out/serve/weights" --num-requests 48 --adapters 16 \
  --popularity zipf --alpha 1 --rate 4 --input-len 8,16 --output-len 16,32 --hidden 1024 --layers 4 --max-loras 16 \
  --repeats 3 --baselines no-adapter,peft --sweep-adapters '' --sweep-rates '' --ranks 8,16 | tee "$out/serve-h1024.txt"
echo "== packed vs plain base weights (cpu): two engines stepped in turn on the serving step's burst, hidden 512, 16 adapters"
"$py" "$root/benchmarks/packed_weights.py" --workdir "$out/serve/weights" --num-requests 48 --adapters 16 --popularity zipf --alpha 1 \
  --input-len 8,16 --output-len 16,32 --ranks 8,16 --json "$out/packed_weights.json" | tee "$out/packed_weights.txt"
echo "== engine throughput (cpu), hidden 512 and 1024"
ratios='import json, sys; [print(k, v) for k, v in json.load(open(sys.argv[1])).items() if k.startswith("ratio")]'
"$py" "$root/benchmarks/engine_throughput.py" --rounds 5 --out "$out/engine_throughput.json" > /dev/null
"$py" -c "$ratios" "$out/engine_throughput.json" | tee "$out/engine_throughput.txt"
"$py" "$root/benchmarks/engine_throughput.py" --hidden 1024 --out "$out/engine_throughput_h1024.json" > /dev/null
"$py" -c "$ratios" "$out/engine_throughput_h1024.json" | tee "$out/engine_throughput_h1024.txt"
echo "results in $out"
