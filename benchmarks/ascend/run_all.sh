#!/usr/bin/env bash
# Ascend NPU verification run, the counterpart of the CUDA script: hardware tests, the
# capability probe and the LoRA op benchmark, in one go, results as files in OUTDIR.
#
#   benchmarks/ascend/run_all.sh OUTDIR
#
# Needs torch_npu + the CANN toolkit + an Ascend device. If CANN's environment is not
# loaded yet, the toolkit's set_env.sh is sourced (ASCEND_SET_ENV, default
# /usr/local/Ascend/ascend-toolkit/set_env.sh) with `set -u` off while it runs: a vendor script
# may append to a variable such as PYTHONPATH or LD_LIBRARY_PATH without checking that it is set. Writes:
#   env.json                 torch / torch_npu versions, device name
#   npu_tests.xml / .log     pytest -m "npu or emulated" on the Ascend test files
#   npu_tests.json           their outcomes counted: hardware (tests/test_ascend_npu.py) and emulated
#   probe.json               lorafleet probe --device npu --json
#   lora_ops.json / .log     benchmarks/lora_ops.py --device npu
#   summary.json             exit status of each part
# Each part runs under `timeout` (ASCEND_PART_TIMEOUT_S seconds, default 1800; rc 124 when it ran
# past it), so a hung device op costs one part, not the whole run.
# Exits non-zero when any part failed; every part runs regardless. The tests count as failed
# (tests_rc 3) when no hardware test passed: without a usable device they all skip, the emulated
# ones pass, and pytest exits 0, which verifies nothing on the device.
set -u -o pipefail

OUT=${1:?usage: benchmarks/ascend/run_all.sh OUTDIR}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
# PYTHON=..., else the .venv `make` builds, else python3 (an Ascend image's own interpreter)
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON; elif [ -x "$ROOT/.venv/bin/python" ]; then PY=$ROOT/.venv/bin/python; else PY=python3; fi
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$ROOT"

PART_TIMEOUT_S=${ASCEND_PART_TIMEOUT_S:-1800}
part() { timeout --kill-after=30 "$PART_TIMEOUT_S" "$@"; }

SET_ENV=${ASCEND_SET_ENV:-/usr/local/Ascend/ascend-toolkit/set_env.sh}
if [ -z "${ASCEND_TOOLKIT_HOME:-}" ] && [ -f "$SET_ENV" ]; then
  set +u  # a vendor script: under -u its first unset variable would end this run before any part ran
  # shellcheck disable=SC1090
  source "$SET_ENV"
  set -u
fi

part "$PY" - > "$OUT/env.json" <<'PYEOF'
import json, platform
info = {"python": platform.python_version()}
try:
    import torch, torch_npu
    info.update(torch=torch.__version__, torch_npu=torch_npu.__version__,
                npu_available=torch.npu.is_available(),
                device=torch.npu.get_device_name() if torch.npu.is_available() else None)
except (ImportError, OSError, RuntimeError) as err:  # recorded; the tests below report it again
    info["import_error"] = f"{type(err).__name__}: {err}"
print(json.dumps(info, indent=2))
PYEOF

part "$PY" -m pytest -p no:cacheprovider -q -m "npu or emulated" \
  tests/test_ascend_npu.py tests/test_ascend_emulated.py \
  --junitxml="$OUT/npu_tests.xml" > "$OUT/npu_tests.log" 2>&1
tests_rc=$?
"$PY" - "$OUT/npu_tests.xml" "$OUT/npu_tests.json" <<'PYEOF'
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
if not src.is_file():
    dst.write_text(json.dumps({"error": f"{src} was not written (see npu_tests.log)"}))
    sys.exit(3)
counts = {kind: {"passed": 0, "failed": 0, "error": 0, "skipped": 0} for kind in ("hardware", "emulated")}
for case in ET.parse(src).getroot().iter("testcase"):
    where = case.get("classname") or case.get("name") or ""  # a module-level skip has only a name
    kind = "hardware" if where.startswith("tests.test_ascend_npu") else "emulated"
    tag = next((t for t in ("failure", "error", "skipped") if case.find(t) is not None), None)
    counts[kind][{"failure": "failed", "error": "error", "skipped": "skipped", None: "passed"}[tag]] += 1
dst.write_text(json.dumps(counts, indent=2))
if counts["hardware"]["passed"] == 0:
    print(f"npu tests: no hardware test passed ({counts['hardware']}); is an Ascend device visible, with torch_npu and CANN?", file=sys.stderr)
    sys.exit(3)
PYEOF
guard_rc=$?
[ "$tests_rc" -eq 0 ] && [ "$guard_rc" -ne 0 ] && tests_rc=$guard_rc

part "$PY" -m runtime.cli probe --device npu --json > "$OUT/probe.json" 2> "$OUT/probe.err"
probe_rc=$?

part "$PY" benchmarks/lora_ops.py --device npu --json "$OUT/lora_ops.json" > "$OUT/lora_ops.log" 2>&1
bench_rc=$?

cat > "$OUT/summary.json" <<JSON
{"tests_rc": $tests_rc, "probe_rc": $probe_rc, "bench_rc": $bench_rc, "date": "$(date -u +%Y-%m-%dT%H:%M:%SZ)"}
JSON
cat "$OUT/summary.json"
[ "$tests_rc" -eq 0 ] && [ "$probe_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
