"""CI-size load test: 32 concurrent clients for 10 s against a real `lorafleet serve` subprocess.

Mixed streaming / non-streaming, completions / chat, every adapter and the base, mixed
lengths, some with stop strings that fire. Nothing may fail or hang, every greedy output
must equal its single-request reference, and the server must be idle afterwards.
"""
from __future__ import annotations

from pathlib import Path

import httpx

from benchmarks.load import ServeProcess, is_idle, load_test, server_flags

CLIENTS, DURATION_S, REQUEST_TIMEOUT_S = 32, 10.0, 120.0
# A leak of one KV cache or one adapter copy per request would be far above this after
# hundreds of requests; allocator noise after warm-up is a few MiB.
RSS_GROWTH_LIMIT = 100 * 2**20


def test_load_32_clients_nothing_lost(tiny_llama_dir: Path, tiny_adapters: dict[str, Path], tmp_path: Path) -> None:
    with ServeProcess(tiny_llama_dir, tiny_adapters, tmp_path / "serve.log", server_flags(CLIENTS)) as server:
        base = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]
        report = load_test(server.url, server.pid, base, sorted(tiny_adapters), CLIENTS, DURATION_S, REQUEST_TIMEOUT_S)
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    print(report.table())
    errors = [o.error for o in report.outcomes if o.status != "ok"]
    assert report.count("failed") == 0 and report.count("hung") == 0, errors[:5]
    assert report.count("ok") >= CLIENTS  # every client finished at least one request
    assert report.failures == []
    assert report.mismatched == [], report.mismatched[:5]
    assert report.server_finished == len(report.outcomes)  # the server's books agree: nothing lost or doubled
    assert 0 < report.streamed < len(report.outcomes)
    assert report.stop_fired > 0  # stop strings really ended some outputs
    assert is_idle(report.idle_after), report.idle_after
    assert report.rss_after - report.rss_before < RSS_GROWTH_LIMIT
    assert server.returncode == 0 and not server.killed, server.log_tail()


def test_flags_the_run_would_ignore_are_refused(capsys) -> None:
    """--lora without --model was dropped (the tiny model's adapters ran); 0 clients or seconds meant the default."""
    import pytest

    from benchmarks.load import main

    for argv, message in ((["--lora", "a=/x"], "--lora: only used with --model"), (["--clients", "0"], "--clients must be > 0"),
                          (["--duration", "0"], "--duration must be > 0")):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
