"""A ``lorafleet serve`` child process for a benchmark that replays over HTTP.

``spawned_server(setup, model_dir, adapters, log_path)`` starts the server with the benchmark's
model, adapters and engine limits (the same ``BenchSetup`` its in-process runs use) on a free local
port, waits until ``/health`` answers 200, yields the base URL, and stops the server on the way out
(SIGINT, the server's own graceful shutdown; SIGKILL if it has not exited 30 s later). Its stdout and
stderr go to ``log_path``. A server that exits or never gets ready is a ``ServerStartError`` naming
the log and quoting its last lines, never a hang.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from runtime.bench.suite import BenchSetup

ROOT = Path(__file__).resolve().parents[2]
LOG_TAIL_LINES = 20


class ServerStartError(RuntimeError):
    """The spawned server exited, or did not answer /health in time."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _log_tail(log_path: Path) -> str:
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(lines[-LOG_TAIL_LINES:]) or "(empty log)"


def serve_command(setup: BenchSetup, model_dir: Path, adapters: dict[str, Path], port: int) -> list[str]:
    """The ``lorafleet serve`` command line for ``setup``'s device, dtype and engine limits."""
    cmd = [sys.executable, "-m", "runtime.cli", "serve", "--model", str(Path(model_dir).resolve()),
           "--device", setup.device, "--dtype", setup.dtype, "--host", "127.0.0.1", "--port", str(port),
           "--max-loras", str(setup.max_loras), "--max-lora-rank", str(setup.max_lora_rank), "--max-num-seqs", str(setup.max_num_seqs)]  # fmt: skip
    if setup.max_num_batched_tokens is not None:
        cmd += ["--max-num-batched-tokens", str(setup.max_num_batched_tokens)]
    if setup.max_cpu_loras is not None:
        cmd += ["--max-cpu-loras", str(setup.max_cpu_loras)]
    if setup.max_cpu_lora_bytes is not None:
        cmd += ["--max-cpu-lora-bytes", str(setup.max_cpu_lora_bytes)]
    if adapters:
        cmd += ["--lora-modules", *(f"{name}={Path(path).resolve()}" for name, path in sorted(adapters.items()))]
    return cmd


def _wait_ready(url: str, proc: subprocess.Popen, log_path: Path, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise ServerStartError(f"lorafleet serve exited with status {proc.returncode} before it was ready; "
                                   f"the last lines of {log_path}:\n{_log_tail(log_path)}")  # fmt: skip
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass  # not listening yet
        if time.monotonic() > deadline:
            raise ServerStartError(f"lorafleet serve did not answer {url}/health within {timeout_s:.0f} s; "
                                   f"the last lines of {log_path}:\n{_log_tail(log_path)}")  # fmt: skip
        time.sleep(0.25)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)  # uvicorn's graceful shutdown: the engine closes, the port is released
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)


@contextmanager
def spawned_server(setup: BenchSetup, model_dir: Path, adapters: dict[str, Path], log_path: Path,
                   start_timeout_s: float = 600.0) -> Iterator[str]:  # fmt: skip
    """Yield the base URL (``http://127.0.0.1:PORT``) of a ready ``lorafleet serve`` (module docstring)."""
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log:
        proc = subprocess.Popen(serve_command(setup, model_dir, adapters, port), stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_ready(url, proc, log_path, start_timeout_s)
        yield url
    finally:
        _stop(proc)
