"""SIGTERM to a real `lorafleet serve` under load: in-flight requests finish (or, when the
drain is cut short by a second signal, end cleanly with a broken stream); the process
exits with status 0 in bounded time; no request hangs."""
from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import httpx
import pytest

from benchmarks.load import Job, ServeProcess, make_client, metrics_gauges, send

IN_FLIGHT = 12
REQUEST_TIMEOUT_S = 90.0
EXIT_TIMEOUT_S = 60.0


def refused(url: str) -> bool:
    try:
        httpx.get(f"{url}/health", timeout=2)
    except httpx.ConnectError:
        return True
    except httpx.HTTPError:
        return False
    return False


@pytest.mark.parametrize("forced", [False, True], ids=["drain", "drain-cut-short"])
def test_sigterm_during_load(forced: bool, tiny_llama_dir: Path, tiny_adapters: dict[str, Path], tmp_path: Path) -> None:
    adapters = {n: tiny_adapters[n] for n in ("a", "b")}
    # 4 running at a time and 200 tokens each: the 12 requests take several seconds even
    # on an idle machine, so the signal always finds some running and some waiting.
    flags = ["--max-num-seqs", "4", "--num-kv-blocks", "256", "--block-size", "16", "--max-model-len", "256"]
    with ServeProcess(tiny_llama_dir, adapters, tmp_path / "serve.log", flags) as server:
        base = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]
        models = [base, "a", "b"]
        jobs = [Job("chat" if i % 4 == 3 else "completion", models[i % 3], f"request {i} before shutdown", 200, i % 2 == 0, ignore_eos=True)
                for i in range(IN_FLIGHT)]

        async def scenario() -> list:
            async with make_client(server.url, IN_FLIGHT + 2) as client:
                tasks = [asyncio.create_task(send(client, job, i, REQUEST_TIMEOUT_S)) for i, job in enumerate(jobs)]
                deadline = time.monotonic() + 30
                while (await asyncio.to_thread(metrics_gauges, server.url))["lorafleet_requests_waiting"] < 1:
                    done = [t.result() for t in tasks if t.done()]
                    assert time.monotonic() < deadline and not done, f"no request waiting; finished: {done[:3]}"
                    await asyncio.sleep(0.05)
                server.terminate()
                if forced:
                    # Once uvicorn stops accepting (it is draining) and requests are still
                    # running, a second signal tells it to stop waiting for them.
                    while not await asyncio.to_thread(refused, server.url):
                        await asyncio.sleep(0.02)
                    assert not all(t.done() for t in tasks)
                    server.proc.send_signal(signal.SIGINT)
                return await asyncio.gather(*tasks)

        outcomes = asyncio.run(scenario())
        assert server.wait(EXIT_TIMEOUT_S) == 0, server.log_tail()
        assert refused(server.url)
    statuses = [o.status for o in outcomes]
    assert "hung" not in statuses, [o.error for o in outcomes]
    if forced:
        assert "failed" in statuses  # the cut-short drain really broke some streams
    else:
        # A graceful drain finishes every request that was already in flight.
        assert statuses == ["ok"] * IN_FLIGHT, [o.error for o in outcomes if o.status != "ok"]
    for o in outcomes:
        if o.status == "ok":
            assert o.finish_reason in ("stop", "length") and len(o.token_ids) == o.completion_tokens
        else:  # cut short: the stream or connection broke, it did not hang or answer garbage
            assert "ProtocolError" in o.error or "ReadError" in o.error or "RemoteProtocolError" in o.error or "HTTP 5" in o.error, o.error
    assert not server.killed
