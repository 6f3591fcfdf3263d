"""benchmarks/cuda/run_all.sh's plumbing, with a stand-in interpreter (no GPU needed): every step
runs within the budget, OUTDIR holds a few flat files (a remote runner returns only a few),
status.json is valid after each step, and steps past the budget are skipped, not cut mid-way."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "cuda" / "run_all.sh"
DOCS = ROOT / "docs" / "benchmarks.md"


# How the stand-in answers `-c "import fastapi, uvicorn"`: installed, missing, or importable only
# from WORKDIR/site (where run_all.sh installs the carried wheels) when PYTHONPATH names it.
HAS_FASTAPI, NO_FASTAPI, FASTAPI_FROM_SITE = "exit 0", "exit 1", 'case ":$PYTHONPATH:" in *":{work}/site:"*) exit 0;; esac; exit 1'


def _fake_python(tmp_path: Path, work: Path, failing_step: str = "", junit: str = "", fastapi: str = HAS_FASTAPI) -> Path:
    """Records its arguments (in ``calls`` as words, in ``argv`` quoted for ``shlex.split``); runs inline scripts (`-`) with the real interpreter; serve.py writes a summary;
    exits 1 when called with ``failing_step`` among its arguments; pytest writes ``junit`` as its report when given;
    answers the fastapi import check as ``fastapi`` says; every other `-c` check fails."""
    fake = tmp_path / "fakepy"
    if junit:
        (tmp_path / "junit.xml").write_text(junit)
    fake.write_text(f"""#!/bin/bash
echo "$@" >> {tmp_path}/calls
printf '%q ' "$@" >> {tmp_path}/argv; echo >> {tmp_path}/argv
for a in "$@"; do [ -n "{failing_step}" ] && [ "$a" = "{failing_step}" ] && exit 1; done
for a in "$@"; do case "$a" in --junitxml=*) [ -f {tmp_path}/junit.xml ] && cp {tmp_path}/junit.xml "${{a#--junitxml=}}";; esac; done
if [ "$1" = "-" ]; then exec {sys.executable} "$@"; fi
if [ "$1" = "-c" ]; then case "$2" in *fastapi*) {fastapi.format(work=work)};; esac; exit 1; fi
for a in "$@"; do [ "$a" = benchmarks/serve.py ] && mkdir -p {work}/serve && echo '{{"ok": 1}}' > {work}/serve/summary.json; done
for a in "$@"; do [ "$a" = --spawn-server ] && mkdir -p {work}/serve_http && echo '{{"ok": 1}}' > {work}/serve_http/summary.json; done
sleep 1
""")
    fake.chmod(0o755)
    return fake


def _run(tmp_path: Path, budget: int, want_rc: int = 0, failing_step: str = "", junit: str = "", fastapi: str = HAS_FASTAPI,
         wheels: tuple[str, ...] = ()) -> tuple[Path, Path]:
    out, work = tmp_path / "out", tmp_path / "work"
    wheel_dir = tmp_path / "wheels"  # never the checkout's own .whl
    wheel_dir.mkdir()
    for name in wheels:
        (wheel_dir / name).write_text("")
    env = {**os.environ, "PYTHON": str(_fake_python(tmp_path, work, failing_step, junit, fastapi)), "WORKDIR": str(work),
           "RUN_ALL_BUDGET_S": str(budget), "SERVER_WHEELS": str(wheel_dir)}
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run(["bash", str(SCRIPT), str(out)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == want_rc, done.stderr
    return out, work


def test_every_step_runs_and_outdir_stays_small_and_flat(tmp_path: Path):
    out, work = _run(tmp_path, budget=540)
    files = sorted(p.name for p in out.iterdir())
    assert files == ["probe.json", "pytest_cuda.json", "results.tar.gz", "serve_http_summary.json", "serve_summary.json", "status.json"]  # the stand-in writes no JSON of its own
    assert all(p.is_file() for p in out.iterdir()) and len(files) <= 8
    status = json.loads((out / "status.json").read_text())
    assert list(status["steps"]) == ["probe", "pytest_cuda", "lora_ops", "step_times", "serve", "serve_http"]
    assert all(s["rc"] == 0 and s["timeout_s"] <= 540 for s in status["steps"].values())
    with tarfile.open(out / "results.tar.gz") as tar:
        names = tar.getnames()
    assert {"logs/probe.log", "logs/pytest_cuda.log", "logs/lora_ops.log", "logs/step_times.log", "logs/serve.log", "serve/summary.json",
            "logs/serve_http.log", "serve_http/summary.json"} <= set(names)
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
    assert ran and skipped and ran + skipped == ["probe", "pytest_cuda", "lora_ops", "step_times", "serve", "serve_http"]
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


def test_the_http_step_runs_the_spawned_server_replay_on_the_serving_workload(tmp_path: Path):
    _, work = _run(tmp_path, budget=540)
    calls = (tmp_path / "calls").read_text().splitlines()
    serve = next(line for line in calls if "benchmarks/serve.py" in line and "--spawn-server" not in line)
    http = next(line for line in calls if "--spawn-server" in line)
    workload = lambda line: line.split("--num-requests", 1)[1].split("--baselines")[0]  # noqa: E731
    assert workload(http) == workload(serve)  # the same requests, model and limits as the serve step
    assert f"--workdir {work}/weights" in http and "--baselines none" in http and "--device cuda" in http
    assert not any("pip install" in line for line in calls)  # fastapi was there: nothing installed


def test_without_fastapi_or_wheels_the_http_step_is_skipped_and_the_run_incomplete(tmp_path: Path):
    out, _ = _run(tmp_path, budget=540, want_rc=1, fastapi=NO_FASTAPI)
    steps = json.loads((out / "status.json").read_text())["steps"]
    assert steps["serve_http"]["rc"] is None and "server_wheels.sh" in steps["serve_http"]["skipped"]
    assert all(steps[name]["rc"] == 0 for name in ("probe", "pytest_cuda", "lora_ops", "step_times", "serve"))
    assert "--spawn-server" not in (tmp_path / "calls").read_text()


def test_carried_wheels_are_installed_offline_for_the_http_step_only(tmp_path: Path):
    _, work = _run(tmp_path, budget=540, fastapi=FASTAPI_FROM_SITE, wheels=("fastapi-0-py3-none-any.whl", "uvicorn-0-py3-none-any.whl"))
    calls = (tmp_path / "calls").read_text().splitlines()
    install = next(line for line in calls if "-m pip install" in line)
    assert "--no-index" in install and f"--target {work}/site" in install and install.endswith("uvicorn-0-py3-none-any.whl")
    assert any("--spawn-server" in line for line in calls)  # importable from WORKDIR/site: the step ran


def _script_argv(tmp_path: Path) -> dict[str, list[str]]:
    """The arguments run_all.sh passed to each Python entry point in a run with the stand-in (``_run``),
    exactly as bash expanded them, keyed by entry point (the HTTP step's serve.py as ``serve_http``)."""
    calls = {}
    for line in (tmp_path / "argv").read_text().splitlines():
        argv = shlex.split(line)
        if argv[:3] == ["-m", "runtime.cli", "probe"]:
            calls["probe"] = argv[3:]
        elif argv and argv[0].startswith("benchmarks/"):
            name = Path(argv[0]).stem
            calls["serve_http" if "--spawn-server" in argv else name] = argv[1:]
    return calls


def _flags(argv: list[str], drop: tuple[str, ...] = ()) -> dict[str, str]:
    """``--flag value`` pairs (a flag followed by another flag, or last, maps to ''), without ``drop``."""
    pairs = {}
    for i, word in enumerate(argv):
        if word.startswith("--"):
            value = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else ""
            pairs[word] = value
    return {k: v for k, v in pairs.items() if k not in drop}


def test_the_docs_quote_the_serving_command_the_script_runs(tmp_path: Path):
    """docs/benchmarks.md's NVIDIA section quotes "the command in benchmarks/cuda/run_all.sh": the same flags
    and values (its --out and --workdir folders aside). It once lacked --max-num-batched-tokens 1024, so the
    quoted command ran the engine's GPU default, 2048 tokens a step, not the measured run's 1024."""
    _run(tmp_path, budget=540)
    script = _script_argv(tmp_path)["serve"]
    text = DOCS.read_text()
    heading = "### Serving benchmark (`benchmarks/serve.py --device cuda`, the command in `benchmarks/cuda/run_all.sh`)"
    assert heading in text
    block: list[str] = []
    for line in text.split(heading, 1)[1].splitlines()[1:]:
        if line.startswith("    "):
            block.append(line.strip().rstrip("\\"))
        elif block:  # the first code block after the heading ends
            break
    quoted = shlex.split(" ".join(block))
    assert quoted[0] == "benchmarks/serve.py"
    paths = ("--out", "--workdir")
    assert _flags(quoted[1:], paths) == _flags(script, paths)


class _FlagsAccepted(Exception):
    """Raised where an entry point would start its real work: every flag and combination passed its checks."""


def _stop(*args, **kwargs):
    raise _FlagsAccepted


def test_every_python_entry_point_accepts_the_flags_the_script_passes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Each Python step gets the exact arguments the script passes (recorded by the stand-in) and runs all its
    argument checks, with the cuda device reported available, up to the point where it would build weights or a
    backend: a renamed flag, a refused combination or value fails here rather than on a lent GPU."""
    _run(tmp_path, budget=540)
    calls = _script_argv(tmp_path)
    assert set(calls) == {"probe", "lora_ops", "step_times", "serve", "serve_http"}
    assert all("--device" in argv and argv[argv.index("--device") + 1] == "cuda" for argv in calls.values())
    budget = {name: calls[name][calls[name].index("--max-num-batched-tokens") + 1] for name in ("step_times", "serve")}
    assert budget["step_times"] == budget["serve"], budget  # step_times profiles the serving step's steps
    monkeypatch.chdir(ROOT)

    import backends
    from runtime import cli

    monkeypatch.setattr(backends, "availability", _stop)  # probe: past argument parsing, it asks for the device
    with pytest.raises(_FlagsAccepted):
        cli.main(["probe", *calls["probe"]])

    from benchmarks import lora_ops, serve, step_times

    monkeypatch.setattr(lora_ops, "get_backend", _stop)
    with pytest.raises(_FlagsAccepted):
        lora_ops.main(calls["lora_ops"])

    available = lambda name: (True, "")  # noqa: E731
    for module, name, prepare in ((step_times, "step_times", (step_times.suite, "prepare")), (serve, "serve", (serve, "prepare")),
                                  (serve, "serve_http", (serve, "prepare"))):  # fmt: skip
        monkeypatch.setattr(module, "availability", available)
        monkeypatch.setattr(*prepare, _stop)  # where the weights would be built
        monkeypatch.setattr(sys, "argv", [module.__file__, *calls[name]])
        with pytest.raises(_FlagsAccepted):
            module.main()
