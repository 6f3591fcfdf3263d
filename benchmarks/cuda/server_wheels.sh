#!/usr/bin/env bash
# Wheels of the HTTP server's packages that the GPU image lacks, for its Python (3.12, x86_64 Linux),
# so that benchmarks/cuda/run_all.sh's serve_http step can run there: the image has torch, triton,
# transformers, peft, httpx, anyio, h11, click, prometheus-client and pyyaml, but no fastapi,
# starlette, uvicorn or pydantic (read on the image, 2026-11-30). Run this where pip can reach an
# index, then carry DIR (default: .whl at the repository root, ignored by git) to the GPU machine;
# run_all.sh installs them from there, offline, into its work folder. The versions are the ones the
# test suite runs with here; change them together.
# Usage: benchmarks/cuda/server_wheels.sh [DIR]
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
dir=${1:-$root/.whl}
py=${PYTHON:-python3}
mkdir -p "$dir"
"$py" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dir" \
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
  annotated-doc==0.0.7 typing-inspection==0.4.5 typing-extensions==4.16.0 opentelemetry-api==1.45.2
echo "wheels in $dir ($(du -sh "$dir" | cut -f1)); carry it to the GPU machine with the repository"
