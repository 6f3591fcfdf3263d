"""benchmarks/cuda/run_all.sh's plumbing, with a stand-in interpreter (no GPU needed): every step
runs within the budget, OUTDIR holds a few flat files (a remote runner returns only a few),
status.json is valid after each step, and steps past the budget are skipped, not cut mid-way."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "cuda" / "run_all.sh"


def _fake_python(tmp_path: Path, work: Path, failing_step: str = "", junit: str = "") -> Path:
    """Records its arguments; runs inline scripts (`-`) with the real interpreter; serve.py writes a summary;
    exits 1 when called with ``failing_step`` among its arguments; pytest writes ``junit`` as its report when given."""
    fake = tmp_path / "fakepy"
    if junit:
        (tmp_path / "junit.xml").write_text(junit)
    fake.write_text(f"""#!/bin/bash
echo "$@" >> {tmp_path}/calls
for a in "$@"; do [ -n "{failing_step}" ] && [ "$a" = "{failing_step}" ] && exit 1; done
for a in "$@"; do case "$a" in --junitxml=*) [ -f {tmp_path}/junit.xml ] && cp {tmp_path}/junit.xml "${{a#--junitxml=}}";; esac; done
if [ "$1" = "-" ]; then exec {sys.executable} "$@"; fi
if [ "$1" = "-c" ]; then exit 1; fi
for a in "$@"; do [ "$a" = benchmarks/serve.py ] && mkdir -p {work}/serve && echo '{{"ok": 1}}' > {work}/serve/summary.json; done
sleep 1
""")
    fake.chmod(0o755)
    return fake


def _run(tmp_path: Path, budget: int, want_rc: int = 0, failing_step: str = "", junit: str = "") -> tuple[Path, Path]:
    out, work = tmp_path / "out", tmp_path / "work"
    env = {**os.environ, "PYTHON": str(_fake_python(tmp_path, work, failing_step, junit)), "WORKDIR": str(work), "RUN_ALL_BUDGET_S": str(budget)}
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run(["bash", str(SCRIPT), str(out)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == want_rc, done.stderr
    return out, work


def test_every_step_runs_and_outdir_stays_small_and_flat(tmp_path: Path):
    out, work = _run(tmp_path, budget=540)
    files = sorted(p.name for p in out.iterdir())
    assert files == ["probe.json", "pytest_cuda.json", "results.tar.gz", "serve_summary.json", "status.json"]  # the stand-in writes no JSON of its own
    assert all(p.is_file() for p in out.iterdir()) and len(files) <= 8
    status = json.loads((out / "status.json").read_text())
    assert list(status["steps"]) == ["probe", "pytest_cuda", "lora_ops", "step_times", "serve"]
    assert all(s["rc"] == 0 and s["timeout_s"] <= 540 for s in status["steps"].values())
    with tarfile.open(out / "results.tar.gz") as tar:
        names = tar.getnames()
    assert {"logs/probe.log", "logs/pytest_cuda.log", "logs/lora_ops.log", "logs/step_times.log", "logs/serve.log", "serve/summary.json"} <= set(names)
    calls = (tmp_path / "calls").read_text()
    assert "tests/test_cuda_kernels.py tests/test_capabilities.py" in calls  # not the whole tests/ tree
    assert f"--workdir {work}/weights" in calls and "--dtype bfloat16" in calls
    step_times = next(line for line in calls.splitlines() if "benchmarks/step_times.py" in line)
    assert f"--workdir {work}/weights" in step_times and f"--json {out}/step_times.json" in step_times  # shares serve's weights
    assert json.loads((out / "pytest_cuda.json").read_text())["error"].startswith(str(work))  # no junit from the stand-in


def test_steps_past_the_budget_are_skipped_and_recorded(tmp_path: Path):
    out, _ = _run(tmp_path, budget=37, want_rc=1)  # an incomplete run is not a success
    steps = json.loads((out / "status.json").read_text())["steps"]
    ran = [name for name, s in steps.items() if s.get("rc") == 0]
    skipped = [name for name, s in steps.items() if s.get("skipped") == "budget spent"]
    assert ran and skipped and ran + skipped == ["probe", "pytest_cuda", "lora_ops", "step_times", "serve"]
    assert all(s["timeout_s"] <= 37 - 15 for name, s in steps.items() if name in ran)


def test_a_failed_step_makes_the_run_fail_but_the_others_still_run(tmp_path: Path):
    out, _ = _run(tmp_path, budget=540, want_rc=1, failing_step="benchmarks/lora_ops.py")
    steps = json.loads((out / "status.json").read_text())["steps"]
    assert steps["lora_ops"]["rc"] == 1 and steps["serve"]["rc"] == 0 and steps["probe"]["rc"] == 0


def _junit(*outcomes: str) -> str:
    cases = "".join(f'<testcase classname="t" name="c{i}">' + ("<skipped message='no GPU'/>" if o == "skipped" else "") + "</testcase>"
                    for i, o in enumerate(outcomes))
    return f"<testsuites><testsuite>{cases}</testsuite></testsuites>"


def test_a_run_where_every_cuda_test_skipped_fails(tmp_path: Path):
    """A CPU-only torch skips every cuda test and pytest exits 0: that is no verification."""
    out, _ = _run(tmp_path, budget=540, want_rc=1, junit=_junit("skipped", "skipped"))
    assert json.loads((out / "pytest_cuda.json").read_text())["counts"] == {"passed": 0, "failed": 0, "error": 0, "skipped": 2}


def test_a_run_where_cuda_tests_passed_succeeds(tmp_path: Path):
    out, _ = _run(tmp_path, budget=540, junit=_junit("passed", "skipped"))
    assert json.loads((out / "pytest_cuda.json").read_text())["counts"]["passed"] == 1
