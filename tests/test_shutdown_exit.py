"""A process whose helper thread is stuck holding the engine lock exits once shutdown gave up on it.

``AsyncLLMEngine.shutdown`` gives up on an engine lock holder that will not let go (a hung device)
and returns. But the holder's thread was a ``ThreadPoolExecutor``'s (an adapter install in the
engine's admission helpers, a ``/metrics`` render on the event loop's default executor, an admin
route's load in ``AdminWorkers``), and the interpreter joins every such thread at exit: the process
(``lorafleet serve`` after its drain) never exited. They are daemon threads now
(``runtime/daemon_executor.py``). One process holds the three cases, each on an engine of its own,
so that one start-up covers them; it prints the threads the interpreter would join at exit, which
name the culprit should it hang.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

STUCK_HOLDERS_SCRIPT = """
import asyncio, sys, threading
import httpx
from runtime.async_engine import AsyncLLMEngine
from runtime.config import EngineConfig
from runtime.engine import LLMEngine
from runtime.server.app import create_app
from runtime.server.options import ServerOptions

class StuckEngine(LLMEngine):
    '''Its adapter install or its snapshot, once armed, never returns (a hung device): called under
    the engine lock, it holds that lock for good.'''
    def __init__(self, config):
        self.armed, self.holding = None, threading.Event()
        super().__init__(config)

    def _stuck(self, what):
        if self.armed == what:
            self.holding.set()
            threading.Event().wait()

    def install_adapter(self, adapter, path):
        self._stuck("install")
        return super().install_adapter(adapter, path)

    def snapshot(self):
        self._stuck("snapshot")
        return super().snapshot()

def engine():
    inner = StuckEngine(EngineConfig(model=model, device="cpu", dtype="float32", max_loras=2, max_lora_rank=16, max_cpu_loras=2,
                                     max_num_seqs=4, max_model_len=96, block_size=8, num_kv_blocks=32, max_num_batched_tokens=32))
    return inner, AsyncLLMEngine(None, engine=inner)

def in_a_daemon_thread(coroutine):
    threading.Thread(target=asyncio.run, args=(coroutine,), daemon=True).start()

async def http(app, path, body=None):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        await (client.get(path) if body is None else client.post(path, json=body))

model, adapter = sys.argv[1], sys.argv[2]
cases = {}

inner, install = engine()  # an install in the engine's own helper threads (register_adapter_async)
inner.armed = "install"
in_a_daemon_thread(install.register_adapter_async("a", adapter))
cases["install"] = (inner, install)

inner, scraped = engine()  # a /metrics render
app = create_app(scraped)
inner.armed = "snapshot"
in_a_daemon_thread(http(app, "/metrics"))
cases["metrics"] = (inner, scraped)

inner, loaded = engine()  # an admin route's load
app = create_app(loaded, ServerOptions(enable_adapter_admin=True, adapter_roots=(__import__("pathlib").Path(adapter).parent,)))
inner.armed = "install"
in_a_daemon_thread(http(app, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": adapter}))
cases["admin"] = (inner, loaded)

for name, (inner, engine) in cases.items():
    assert inner.holding.wait(60), name
    engine.shutdown(0.05, 0.05)
    print(name, "gave up on:", engine.abandoned_holder, flush=True)
# What the interpreter joins at exit: non-daemon threads, and every ThreadPoolExecutor's threads
# (daemon or not: their exit hook joins them all). Read from the executors' private registry, only to say why a run hung.
from concurrent.futures import thread as executor_threads
joined = [t for t in threading.enumerate() if not t.daemon and t is not threading.main_thread()] + list(executor_threads._threads_queues)
print("threads joined at exit:", sorted(t.name for t in joined if t.is_alive()), flush=True)
"""


def test_a_process_whose_helper_thread_is_stuck_holding_the_engine_lock_exits_after_shutdown(tiny_llama_dir: Path, tiny_adapters) -> None:
    repo = Path(__file__).resolve().parents[1]
    try:
        done = subprocess.run([sys.executable, "-c", STUCK_HOLDERS_SCRIPT, str(tiny_llama_dir), str(tiny_adapters["a"])],
                              cwd=repo, capture_output=True, text=True, timeout=90)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"the process did not exit after shutdown: {err.stdout!r}")
    assert done.returncode == 0, done.stderr[-2000:]
    for case, holder in (("install", "an adapter load"), ("metrics", "a snapshot"), ("admin", "an adapter load")):
        assert f"{case} gave up on: {holder}" in done.stdout, (done.stdout, done.stderr[-2000:])
    assert "threads joined at exit: []" in done.stdout, done.stdout
