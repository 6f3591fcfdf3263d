"""Load test of a real `lorafleet serve` process: N concurrent clients for a bounded time.

    python benchmarks/load.py            # CI size: 32 clients for 10 s
    python benchmarks/load.py --full     # full size: 200 concurrent streams for 60 s

The server is the real CLI in a subprocess on 127.0.0.1 (a tiny random Llama with five
PEFT adapters is built unless ``--model`` / ``--lora`` are given). Each client loops
until the deadline over a fixed pool of jobs: completions and chat, streaming and not,
every adapter and the base, prompts of 1..60 characters, max_tokens 2..32, some with a
stop string taken from the job's own stop-free output (so the stop really fires).

Checks, printed as a summary table:
  * every request ends with an answer (ok), an HTTP/SSE error (failed) or not within
    ``--request-timeout`` (hung);
  * every greedy output (text and token ids) equals its single-request reference,
    computed afterwards through the same server one request at a time;
  * afterwards the server is idle: running 0, waiting 0, KV free == total, adapter demand
    and device refs 0 (read from /metrics), and RSS is reported before and after.

The module is also the library ``tests/load`` drives (``ServeProcess``, ``run_load``...).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import httpx

ROOT = Path(__file__).resolve().parents[1]
IDLE_GAUGES = ("lorafleet_requests_running", "lorafleet_requests_waiting", "lorafleet_adapter_demand", "lorafleet_adapter_device_refs")


# ---- the server process --------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def lorafleet_command() -> list[str]:
    """The installed `lorafleet` console script next to this interpreter (else the module's main)."""
    script = Path(sys.executable).parent / "lorafleet"
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from runtime.cli import main; sys.exit(main())"]


class ServeProcess:
    """`lorafleet serve` in a subprocess on 127.0.0.1 and a free port; its log goes to ``log_path``.

    Used as a context manager: waits for /health on entry; on exit sends SIGTERM, waits
    up to ``stop_timeout_s`` and SIGKILLs only as a last resort (reported in ``killed``).
    """

    def __init__(self, model: Path, adapters: dict[str, Path], log_path: Path, extra: Sequence[str] = (),
                 start_timeout_s: float = 120.0, stop_timeout_s: float = 60.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.start_timeout_s, self.stop_timeout_s = start_timeout_s, stop_timeout_s
        self.args = [*lorafleet_command(), "serve", "--model", str(model), "--device", "cpu", "--host", "127.0.0.1",
                     "--port", str(self.port), "--log-level", os.environ.get("LORAFLEET_LOAD_LOG_LEVEL", "warning"), *extra]
        if adapters:
            self.args += ["--lora-modules", *(f"{n}={p}" for n, p in adapters.items())]
        self.proc: subprocess.Popen | None = None
        self.killed = False
        self.returncode: int | None = None

    def __enter__(self) -> "ServeProcess":
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT))
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"lorafleet serve exited with {self.proc.returncode} before serving:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"lorafleet serve did not answer /health in {self.start_timeout_s}s:\n{self.log_tail()}")

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def terminate(self) -> None:
        """SIGTERM: the graceful shutdown path (uvicorn drains, then the engine shuts down)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout_s: float) -> int | None:
        assert self.proc is not None
        try:
            self.returncode = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None
        return self.returncode

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.terminate()
            if self.wait(self.stop_timeout_s) is None:
                self.killed = True
                self.proc.kill()
                self.wait(10)
        self.returncode = self.proc.returncode
        self._log.close()

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""


def rss_bytes(pid: int) -> int:
    """Resident set size of a process (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/{pid}/status has no VmRSS line")


def metrics_gauges(url: str, headers: dict[str, str] | None = None) -> dict[str, float]:
    """Unlabelled gauges from /metrics (name -> value)."""
    text = httpx.get(f"{url}/metrics", headers=headers, timeout=10).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, _, value = line.partition(" ")
            out[name] = float(value)
    return out


def requests_finished(url: str, headers: dict[str, str] | None = None) -> int:
    """Requests the server's engine has finished (any reason), summed over every label."""
    text = httpx.get(f"{url}/metrics", headers=headers, timeout=10).text
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("lorafleet_requests_total{")))


def is_idle(g: dict[str, float]) -> bool:
    """running 0, waiting 0, every KV block free, no adapter demand or device refs."""
    return all(g.get(k, -1) == 0 for k in IDLE_GAUGES) and g.get("lorafleet_kv_blocks_free") == g.get("lorafleet_kv_blocks")


def wait_idle(url: str, timeout_s: float = 30.0, headers: dict[str, str] | None = None) -> dict[str, float]:
    """Poll /metrics until idle; returns the last gauges (check with ``is_idle``)."""
    deadline = time.monotonic() + timeout_s
    g = metrics_gauges(url, headers)
    while not is_idle(g) and time.monotonic() < deadline:
        time.sleep(0.1)
        g = metrics_gauges(url, headers)
    return g


# ---- jobs and requests --------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    """One request shape; clients send jobs from a fixed pool, so each has one reference."""

    kind: str  # "completion" | "chat"
    model: str
    prompt: str
    max_tokens: int
    stream: bool
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def body(self, stream: bool | None = None) -> dict[str, Any]:
        stream = self.stream if stream is None else stream
        b: dict[str, Any] = {"model": self.model, "max_tokens": self.max_tokens, "temperature": 0, "stream": stream,
                             "return_token_ids": True}
        if self.kind == "chat":
            b["messages"] = [{"role": "user", "content": self.prompt}]
        else:
            b["prompt"] = self.prompt
        if self.stop:
            b["stop"] = list(self.stop)
        if self.ignore_eos:
            b["ignore_eos"] = True
        if stream:
            b["stream_options"] = {"include_usage": True}
        return b

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.kind == "chat" else "/v1/completions"


@dataclass
class Outcome:
    job: int
    status: str  # "ok" | "failed" | "hung"
    text: str = ""
    token_ids: tuple[int, ...] = ()
    finish_reason: str | None = None
    completion_tokens: int = 0
    latency_s: float = 0.0
    error: str = ""


class ProtocolError(Exception):
    """The server answered, but not with a complete, well-formed response."""


async def send(client: httpx.AsyncClient, job: Job, index: int, timeout_s: float, stream: bool | None = None) -> Outcome:
    """Send one job; never raises: the outcome says ok / failed / hung."""
    started = time.perf_counter()
    try:
        result = await asyncio.wait_for(_exchange(client, job, stream), timeout_s)
    except asyncio.TimeoutError:
        return Outcome(index, "hung", latency_s=time.perf_counter() - started, error=f"no complete answer in {timeout_s}s")
    except (httpx.HTTPError, ProtocolError, json.JSONDecodeError) as err:
        return Outcome(index, "failed", latency_s=time.perf_counter() - started, error=f"{type(err).__name__}: {err}")
    text, ids, reason, used = result
    return Outcome(index, "ok", text, ids, reason, used, time.perf_counter() - started)


async def _exchange(client: httpx.AsyncClient, job: Job, stream: bool | None) -> tuple[str, tuple[int, ...], str, int]:
    stream = job.stream if stream is None else stream
    if not stream:
        r = await client.post(job.path, json=job.body(False))
        if r.status_code != 200:
            raise ProtocolError(f"HTTP {r.status_code}: {r.text[:300]}")
        data = r.json()
        choice = data["choices"][0]
        text = choice["message"]["content"] if job.kind == "chat" else choice["text"]
        return text, tuple(choice["token_ids"]), choice["finish_reason"], data["usage"]["completion_tokens"]
    parts: list[str] = []
    ids: tuple[int, ...] = ()
    reason, used, done = None, 0, False
    async with client.stream("POST", job.path, json=job.body(True)) as r:
        if r.status_code != 200:
            raise ProtocolError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line:
                continue
            if not line.startswith("data: "):
                raise ProtocolError(f"not an SSE data line: {line[:200]!r}")
            payload = line[len("data: "):]
            if payload == "[DONE]":
                done = True
                break
            data = json.loads(payload)
            if "error" in data:
                raise ProtocolError(f"error event: {data['error']}")
            if data.get("usage"):
                used = data["usage"]["completion_tokens"]
            for choice in data["choices"]:
                parts.append(choice["delta"].get("content") or "" if job.kind == "chat" else choice["text"])
                if choice.get("finish_reason"):
                    reason = choice["finish_reason"]
                    ids = tuple(choice["token_ids"])
    if not done or reason is None:
        raise ProtocolError(f"stream ended without {'[DONE]' if not done else 'a finish_reason'}")
    return "".join(parts), ids, reason, used


def make_client(url: str, connections: int, headers: dict[str, str] | None = None) -> httpx.AsyncClient:
    # Idle connections expire on the client before uvicorn's 5 s keep-alive timeout. With
    # both at 5 s, a request sent on a connection the server is closing that very moment
    # fails with ReadError before it reaches the server (the keep-alive race of RFC 9112
    # 9.6). The full-size run showed 3 such failures in ~3,700 requests before this change.
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections, keepalive_expiry=1.0)
    return httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(None), headers=headers)


async def build_jobs(url: str, base: str, adapters: Sequence[str], n: int, seed: int, timeout_s: float = 60.0) -> list[Job]:
    """A pool of ``n`` jobs over every adapter and the base; a third get a stop string that fires.

    The stop string is two characters from the middle of the job's stop-free greedy output
    (probed here, one request at a time; this also warms the server up).
    """
    rng = random.Random(seed)
    models = [base, *adapters]
    words = "the quick brown fox jumps over a lazy dog while seven adapters share one base model".split()
    jobs = []
    async with make_client(url, 4) as client:
        for i in range(n):
            prompt = " ".join(rng.choice(words) for _ in range(rng.randint(1, 10)))[: rng.randint(1, 60)] or "x"
            job = Job(kind="chat" if i % 5 == 4 else "completion", model=models[i % len(models)], prompt=prompt,
                      max_tokens=rng.choice((2, 4, 8, 16, 24, 32)), stream=i % 2 == 0)
            if i % 3 == 2:
                probe = await send(client, Job(job.kind, job.model, job.prompt, 32, False), i, timeout_s)
                if probe.status != "ok":
                    raise RuntimeError(f"probe request for job {i} failed: {probe.error}")
                text = probe.text
                if len(text) >= 6 and text[len(text) // 2: len(text) // 2 + 2].strip():
                    job = Job(job.kind, job.model, job.prompt, 32, job.stream, (text[len(text) // 2: len(text) // 2 + 2],))
            jobs.append(job)
    return jobs


async def run_load(url: str, jobs: Sequence[Job], clients: int, duration_s: float, timeout_s: float,
                   seed: int = 0, headers: dict[str, str] | None = None) -> tuple[list[Outcome], float]:
    """``clients`` concurrent loops, each sending random jobs until ``duration_s`` has passed.

    Returns (outcomes, wall seconds from start until the last request ended).
    """
    started = time.perf_counter()
    deadline = started + duration_s
    outcomes: list[Outcome] = []

    async def client_loop(k: int, client: httpx.AsyncClient) -> None:
        rng = random.Random(seed * 1000 + k)
        while time.perf_counter() < deadline:
            i = rng.randrange(len(jobs))
            outcomes.append(await send(client, jobs[i], i, timeout_s))

    async with make_client(url, clients + 4, headers) as client:
        await asyncio.gather(*(client_loop(k, client) for k in range(clients)))
    return outcomes, time.perf_counter() - started


async def references(url: str, jobs: Sequence[Job], timeout_s: float, headers: dict[str, str] | None = None) -> list[Outcome]:
    """Each job alone (non-streaming), one at a time: the single-request reference."""
    refs = []
    async with make_client(url, 2, headers) as client:
        for i, job in enumerate(jobs):
            refs.append(await send(client, job, i, timeout_s, stream=False))
    return refs


def mismatches(outcomes: Sequence[Outcome], refs: Sequence[Outcome]) -> list[str]:
    """Ok outcomes whose text, token ids or finish reason differ from their job's reference."""
    bad = []
    for o in outcomes:
        r = refs[o.job]
        if o.status == "ok" and (o.text, o.token_ids, o.finish_reason) != (r.text, r.token_ids, r.finish_reason):
            bad.append(f"job {o.job}: got {o.text!r} {o.token_ids} {o.finish_reason}, reference {r.text!r} {r.token_ids} {r.finish_reason}")
    return bad


# ---- the report ------------------------------------------------------------------------------


@dataclass
class LoadReport:
    clients: int
    duration_s: float
    wall_s: float
    outcomes: list[Outcome]
    mismatched: list[str]
    rss_before: int
    rss_after: int
    idle_after: dict[str, float]
    stop_jobs: int = 0
    streamed: int = 0
    stop_fired: int = 0  # stop jobs whose reference ended on the stop string
    server_finished: int = 0  # requests the engine finished during the load phase (from /metrics)
    failures: list[str] = field(default_factory=list)

    def count(self, status: str) -> int:
        return sum(o.status == status for o in self.outcomes)

    @property
    def tokens(self) -> int:
        return sum(o.completion_tokens for o in self.outcomes if o.status == "ok")

    def latency(self, q: float) -> float:
        lat = sorted(o.latency_s for o in self.outcomes if o.status == "ok")
        if not lat:
            return float("nan")
        return lat[min(len(lat) - 1, int(q * len(lat)))]

    def table(self) -> str:
        g = self.idle_after
        mib = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
        rows = [
            ("clients x duration", f"{self.clients} x {self.duration_s:.0f} s (wall {self.wall_s:.1f} s)"),
            ("requests ok / failed / hung", f"{self.count('ok')} / {self.count('failed')} / {self.count('hung')}"),
            ("streamed / with stop string", f"{self.streamed} of {len(self.outcomes)} requests / {self.stop_jobs} stop jobs in the pool ({self.stop_fired} end on it)"),
            ("outputs != single-request reference", str(len(self.mismatched))),
            ("requests the server finished", f"{self.server_finished} (clients sent {len(self.outcomes)})"),
            ("completion tokens/s", f"{self.tokens / self.wall_s:.1f} ({self.tokens} tokens)"),
            ("latency p50 / p99", f"{self.latency(0.50):.3f} s / {self.latency(0.99):.3f} s"),
            ("server RSS before / after", f"{mib(self.rss_before)} / {mib(self.rss_after)} ({(self.rss_after - self.rss_before) / 2**20:+.1f} MiB)"),
            ("after: running / waiting", f"{g.get('lorafleet_requests_running', -1):.0f} / {g.get('lorafleet_requests_waiting', -1):.0f}"),
            ("after: KV blocks free / total", f"{g.get('lorafleet_kv_blocks_free', -1):.0f} / {g.get('lorafleet_kv_blocks', -1):.0f}"),
            ("after: adapter demand / device refs", f"{g.get('lorafleet_adapter_demand', -1):.0f} / {g.get('lorafleet_adapter_device_refs', -1):.0f}"),
            ("after: adapter pool bytes in use / host entries", f"{g.get('lorafleet_adapter_pool_bytes_in_use', -1):.0f} / {g.get('lorafleet_adapter_host_entries', -1):.0f}"),
            ("after: idle", str(is_idle(g))),
        ]
        width = max(len(k) for k, _ in rows)
        lines = [f"| {'metric'.ljust(width)} | value |", f"|{'-' * (width + 2)}|-------|"]
        lines += [f"| {k.ljust(width)} | {v} |" for k, v in rows]
        return "\n".join(lines)


def load_test(url: str, pid: int, base: str, adapters: Sequence[str], clients: int, duration_s: float,
              timeout_s: float, num_jobs: int = 40, seed: int = 0) -> LoadReport:
    """Build jobs (warm-up), run the load, compute references, wait for idle; returns the report."""
    jobs = asyncio.run(build_jobs(url, base, adapters, num_jobs, seed, timeout_s))
    wait_idle(url)
    rss_before = rss_bytes(pid)
    finished_before = requests_finished(url)
    outcomes, wall = asyncio.run(run_load(url, jobs, clients, duration_s, timeout_s, seed))
    server_finished = requests_finished(url) - finished_before
    refs = asyncio.run(references(url, jobs, timeout_s))
    failures = [f"reference for job {r.job} failed: {r.error}" for r in refs if r.status != "ok"]
    idle = wait_idle(url)
    report = LoadReport(clients, duration_s, wall, outcomes, mismatches(outcomes, refs), rss_before, rss_bytes(pid), idle,
                        stop_jobs=sum(1 for j in jobs if j.stop), streamed=sum(jobs[o.job].stream for o in outcomes),
                        stop_fired=sum(1 for j, r in zip(jobs, refs) if j.stop and r.finish_reason == "stop"),
                        server_finished=server_finished, failures=failures)
    return report


# ---- the command -------------------------------------------------------------------------------


def tiny_setup(root: Path) -> tuple[Path, dict[str, Path]]:
    """The tests' tiny random Llama and its five standard PEFT adapters, written under ``root``."""
    sys.path.insert(0, str(ROOT))
    from tests.fixtures.tiny_models import build_standard_adapters, build_tiny_model

    model = build_tiny_model(root / "model", "llama", seed=0)
    return model, build_standard_adapters(model, root / "adapters")


def server_flags(clients: int) -> list[str]:
    """Engine sizes for the load: every client can run at once; plenty of KV blocks."""
    return ["--max-num-seqs", str(min(256, max(64, clients))), "--max-model-len", "160", "--block-size", "16",
            "--num-kv-blocks", str(max(512, clients * 8)), "--max-loras", "4", "--max-cpu-loras", "8"]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--full", action="store_true", help="full size: 200 clients for 60 s (default: 32 for 10 s)")
    p.add_argument("--clients", type=int, help="concurrent clients (overrides --full)")
    p.add_argument("--duration", type=float, help="seconds of load (overrides --full)")
    p.add_argument("--request-timeout", type=float, default=180.0, help="a request not done in this many seconds counts as hung")
    p.add_argument("--model", type=Path, help="checkpoint folder (default: build the tiny test model)")
    p.add_argument("--lora", nargs="*", default=[], metavar="NAME=PATH", help="adapters (with --model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the figures as JSON here")
    args = p.parse_args(argv)
    if args.lora and args.model is None:
        p.error("--lora: only used with --model (the tiny test model brings its own adapters)")
    bad = next((f"--{name} must be > 0, got {v:g}" for name, v in (("clients", args.clients), ("duration", args.duration)) if v is not None and v <= 0), None)
    if bad:
        p.error(bad)
    if any("=" not in spec or not spec.split("=", 1)[0] or not spec.split("=", 1)[1] for spec in args.lora):
        p.error("--lora: expected NAME=PATH entries")
    clients = args.clients if args.clients is not None else (200 if args.full else 32)
    duration = args.duration if args.duration is not None else (60.0 if args.full else 10.0)
    with tempfile.TemporaryDirectory(prefix="lorafleet-load-") as tmp:
        if args.model is None:
            model, adapters = tiny_setup(Path(tmp))
        else:
            model = args.model
            adapters = dict(spec.split("=", 1) for spec in args.lora)  # type: ignore[misc]
        with ServeProcess(model, {k: Path(v) for k, v in adapters.items()}, Path(tmp) / "serve.log", server_flags(clients)) as server:
            base = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]
            report = load_test(server.url, server.pid, base, list(adapters), clients, duration, args.request_timeout, seed=args.seed)
    print(report.table())
    for line in (report.failures + report.mismatched)[:10]:
        print("  ", line)
    errors = [o.error for o in report.outcomes if o.status != "ok"]
    for e in errors[:10]:
        print("   error:", e)
    if args.json:
        args.json.write_text(json.dumps({"clients": clients, "duration_s": duration, "wall_s": report.wall_s,
                                         "ok": report.count("ok"), "failed": report.count("failed"), "hung": report.count("hung"),
                                         "mismatched": len(report.mismatched), "tokens": report.tokens, "server_finished": report.server_finished,
                                         "p50_s": report.latency(0.5), "p99_s": report.latency(0.99),
                                         "rss_before": report.rss_before, "rss_after": report.rss_after,
                                         "after": report.idle_after}, indent=2))
    healthy = (not errors and not report.mismatched and not report.failures and is_idle(report.idle_after)
               and report.server_finished == len(report.outcomes))
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
