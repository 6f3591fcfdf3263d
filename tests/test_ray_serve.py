"""Scale-out on a real local Ray Serve: two replicas of the tiny llama, adapter-affinity routing.

Ray is started once for the module (2 CPUs, no dashboard). The CI-size tests share one
application; the 20-adapter test (marked slow) deploys its own.
"""
from __future__ import annotations

import asyncio
import json
import random
import shutil
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from runtime.async_engine import AsyncLLMEngine, EngineDeadError  # noqa: E402
from runtime.config import EngineConfig  # noqa: E402
from runtime.distributed import application  # noqa: E402
from runtime.distributed.application import NAMESPACE, REPLICA_DEPLOYMENT, ScaleOutConfig, deploy, stop  # noqa: E402
from runtime.distributed.manifest import ManifestError  # noqa: E402
from runtime.distributed.replica_set import ReplicaSetEngine  # noqa: E402
from runtime.request import SamplingParams  # noqa: E402
from runtime.server.options import ServerOptions  # noqa: E402
from tests.fixtures.tiny_models import build_adapter  # noqa: E402
from tests.server_harness import free_port, wait_until  # noqa: E402

pytestmark = pytest.mark.ray

PROMPTS = ["the quick brown fox", "hello there", "one two three four five", "a b c"]
HIT_LOCATIONS = ("device", "host")


def engine_config(model_dir: Path, **overrides: Any) -> EngineConfig:
    values = dict(model=str(model_dir), device="cpu", dtype="float32", max_loras=2, max_lora_rank=16,
                  max_cpu_loras=2, max_num_seqs=8, max_model_len=96, block_size=8, num_kv_blocks=96)
    values.update(overrides)
    return EngineConfig(**values)


def reference_outputs(config: EngineConfig, adapters: dict[str, Path], cases: list[tuple[str | None, str]], max_tokens: int) -> dict:
    """Greedy token ids from one AsyncLLMEngine run directly (the single-server reference)."""
    engine = AsyncLLMEngine(config.replace(max_cpu_loras=max(len(adapters), config.max_loras)))
    for name, path in adapters.items():
        engine.register_adapter(name, str(path))

    async def one(adapter: str | None, prompt: str) -> tuple[int, ...]:
        last = None
        async for out in engine.generate(f"ref-{adapter}-{prompt}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), adapter):
            last = out
        return last.token_ids

    async def run_all() -> dict:
        return {case: await one(*case) for case in cases}

    try:
        return asyncio.run(run_all())
    finally:
        engine.shutdown()


def complete(url: str, model: str, prompt: str, max_tokens: int, timeout: float = 60.0) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=timeout)


def token_ids(response: httpx.Response) -> tuple[int, ...]:
    assert response.status_code == 200, response.text
    return tuple(response.json()["choices"][0]["token_ids"])


def replica_actor_names(app_name: str) -> list[str]:
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if app_name in a["name"] and REPLICA_DEPLOYMENT in a["name"])


def running_replicas(app_name: str) -> int:
    app = serve.status().applications.get(app_name)
    if app is None or REPLICA_DEPLOYMENT not in app.deployments:
        return 0
    return app.deployments[REPLICA_DEPLOYMENT].replica_states.get("RUNNING", 0)


def registry(cfg: ScaleOutConfig) -> Any:
    return ray.get_actor(cfg.registry_name, namespace=NAMESPACE)


def driver_engine(cfg: ScaleOutConfig, routing: str) -> ReplicaSetEngine:
    """A ReplicaSetEngine in the test process over the app's replicas (same replicas, chosen routing)."""
    engine = ReplicaSetEngine(serve.get_deployment_handle(REPLICA_DEPLOYMENT, cfg.app_name), registry(cfg), cfg.engine.model, "tiny", 96, routing=routing)
    return engine


def routed_hit_rate(cfg: ScaleOutConfig, routing: str, names: list[str], n: int, seed: int, gap_s: float = 0.15) -> float:
    """Send n sequential greedy requests over ``names``; share served by a replica already holding the adapter.

    ``gap_s`` between requests: Serve's routers learn which replica holds which adapter
    from replica reports (every 0.1 s); tiny-model requests take ~10 ms, far shorter
    than any real request, so without a gap the router would route on stale holdings.
    """
    engine = driver_engine(cfg, routing)
    locations: list[str] = []
    engine.add_observer(lambda m: locations.append(m.adapter_location))
    rng = random.Random(seed)

    async def run() -> None:
        for i in range(n):
            async for _ in engine.generate(f"{routing}-{seed}-{i}", PROMPTS[i % len(PROMPTS)], SamplingParams(max_tokens=2), rng.choice(names)):
                pass
            await asyncio.sleep(gap_s)

    asyncio.run(run())
    assert len(locations) == n
    return sum(loc in HIT_LOCATIONS for loc in locations) / n


@pytest.mark.parametrize(
    ("available", "device", "options"),
    [
        ({"cuda", "npu", "cpu"}, "cuda", {"num_gpus": 1}),
        ({"npu", "cpu"}, "npu", {"resources": {"NPU": 1}}),
        ({"cpu"}, "cpu", {"num_cpus": 1}),
    ],
)
def test_auto_device_is_resolved_before_replicas_reserve_resources(monkeypatch, available, device, options) -> None:
    """--device auto (the default) resolves like a single server (cuda, then npu, then cpu);
    each replica then reserves that device and its engine runs on it. No Ray needed."""
    import backends

    monkeypatch.setattr(backends, "availability", lambda name: (name in available, f"{name}: test"))
    cfg = ScaleOutConfig(engine=EngineConfig(model="m"), server=ServerOptions(), num_replicas=1, registry_dir="unused")
    assert cfg.engine.device == "auto"
    assert cfg.replica_device == device
    assert cfg.replica_actor_options() == options
    assert cfg.replica_engine() == cfg.engine.replace(device=device)
    explicit = ScaleOutConfig(**{**cfg.__dict__, "replica_resources": {"num_cpus": 0}})
    assert explicit.replica_actor_options() == {"num_cpus": 0}


def test_serve_timeouts_outlast_the_drain_and_a_hung_replica_is_given_up_soon() -> None:
    """Serve force-killed replicas 10 s into a shutdown, before the drain ended; and gave a hung
    replica's health check 30 s (x3 failures) before replacing it. No Ray needed."""
    cfg = ScaleOutConfig(engine=EngineConfig(model="m", device="cpu"), server=ServerOptions(), num_replicas=2, registry_dir="unused")
    ingress = application.build(cfg)._bound_deployment
    replica = next(arg for arg in ingress.init_args if isinstance(arg, serve.Application))._bound_deployment
    ingress_cfg, replica_cfg = ingress._deployment_config, replica._deployment_config
    assert application.DRAIN_S + application.DRAIN_MARGIN_S <= replica_cfg.graceful_shutdown_timeout_s < ingress_cfg.graceful_shutdown_timeout_s
    assert replica_cfg.health_check_period_s == application.HEALTH_CHECK_PERIOD_S
    assert replica_cfg.health_check_timeout_s == application.HEALTH_CHECK_TIMEOUT_S <= 5


def test_a_drain_with_the_step_grace_must_end_inside_the_replicas_graceful_shutdown(monkeypatch) -> None:
    """A replica's engine gives a step still running at the drain's end STEP_GRACE_S more before it
    fails that step's requests; nothing checked that drain + grace ends before Serve kills the
    replica (its graceful shutdown timeout), as DrainingServer checks uvicorn's window. Now build
    (DRAIN_S) and drain (its drain_s, before it begins anything) check it. No Ray needed."""
    from runtime.async_engine import STEP_GRACE_S

    too_long = application.REPLICA_GRACEFUL_SHUTDOWN_S - STEP_GRACE_S
    cfg = ScaleOutConfig(engine=EngineConfig(model="m", device="cpu"), server=ServerOptions(), num_replicas=1, registry_dir="unused")
    began: list[str] = []
    monkeypatch.setattr(application.serve, "get_app_handle", lambda name: began.append(name))
    with pytest.raises(ValueError, match="graceful shutdown timeout"):
        application.drain(cfg, too_long)
    assert began == [], "the drain began"
    application.build(cfg)  # DRAIN_S fits
    monkeypatch.setattr(application, "DRAIN_S", too_long)
    with pytest.raises(ValueError, match="graceful shutdown timeout"):
        application.build(cfg)
    with pytest.raises(ValueError, match="DRAIN_MARGIN_S"):
        application.check_shutdown_timeouts(1.0, step_grace_s=application.DRAIN_MARGIN_S)


def test_the_ingress_checks_a_drain_it_is_asked_for_directly() -> None:
    """``drain`` checked its drain_s, but the ingress's ``begin_shutdown(drain_s)``, a Serve handle
    method a script can call without ``drain``, took any drain_s: it refused new requests and told
    the registry to drain for longer than Serve lets a replica live. Now it refuses such a drain_s
    with the same ValueError, before it begins anything. No Ray needed."""
    from types import SimpleNamespace

    from runtime.async_engine import STEP_GRACE_S
    from runtime.distributed.ingress import LoraIngress

    drains: list[float] = []

    async def begin_drain(drain_s: float) -> None:
        drains.append(drain_s)

    ingress = SimpleNamespace(engine=SimpleNamespace(shutting_down=False), registry=SimpleNamespace(begin_drain=SimpleNamespace(remote=begin_drain)))
    ingress.engine.begin_shutdown = lambda: setattr(ingress.engine, "shutting_down", True)
    too_long = application.REPLICA_GRACEFUL_SHUTDOWN_S - STEP_GRACE_S
    with pytest.raises(ValueError, match="graceful shutdown timeout"):
        asyncio.run(LoraIngress.begin_shutdown(ingress, too_long))
    assert (ingress.engine.shutting_down, drains) == (False, []), "the shutdown began"
    asyncio.run(LoraIngress.begin_shutdown(ingress, 1.0))
    assert (ingress.engine.shutting_down, drains) == (True, [1.0])


def test_log_level_reaches_serves_own_logs(monkeypatch) -> None:
    """--log-level warning quieted lorafleet's loggers but not Serve's INFO lines (two per request). No Ray needed."""
    cfg = ScaleOutConfig(engine=EngineConfig(model="m", device="cpu"), server=ServerOptions(), num_replicas=2, registry_dir="unused",
                         log_level="warning")  # fmt: skip
    ingress = application.build(cfg)._bound_deployment
    replica = next(arg for arg in ingress.init_args if isinstance(arg, serve.Application))._bound_deployment
    for deployment in (ingress, replica):
        assert deployment._deployment_config.logging_config["log_level"] == "WARNING"
    started = {}
    monkeypatch.setattr(application.serve, "start", lambda **kw: started.update(kw))
    monkeypatch.setattr(application, "serve_http_address", lambda: (cfg.server.host, cfg.server.port))
    application.start_serve(cfg)
    assert started["logging_config"] == {"log_level": "WARNING"}


def test_a_config_built_directly_gets_serves_step_budget_check() -> None:
    """``lorafleet serve`` refuses max_num_batched_tokens below max_num_seqs; a ScaleOutConfig built
    directly (a RayService, a script) skipped that and deployed replicas whose decodes stall. No Ray needed."""
    from runtime.config import ConfigError

    starved = EngineConfig(model="m", device="cpu", max_num_seqs=8, max_num_batched_tokens=4)
    with pytest.raises(ConfigError, match="max_num_batched_tokens: 4 is below max_num_seqs=8"):
        ScaleOutConfig(engine=starved, server=ServerOptions(), num_replicas=1, registry_dir="unused")
    ScaleOutConfig(engine=starved.replace(max_num_batched_tokens=8), server=ServerOptions(), num_replicas=1, registry_dir="unused")


def test_serve_says_the_step_budget_problem_once(tmp_path, capsys) -> None:
    """The launcher's settings check it before the config is built: one message, exit 2. No Ray needed."""
    from runtime.cli import main

    code = main(["serve", "--ray", "--model", str(tmp_path), "--max-num-seqs", "8", "--max-num-batched-tokens", "4"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("is below max_num_seqs=8") == 1, err


@pytest.fixture(scope="module")
def ray_session():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def adapter_root(tiny_adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ray_adapter_root")
    for name, path in tiny_adapters.items():
        shutil.copytree(path, root / name)
    return root


@pytest.fixture(scope="module")
def app(ray_session, tiny_llama_dir: Path, tiny_adapters: dict[str, Path], adapter_root: Path, tmp_path_factory: pytest.TempPathFactory):
    initial = {n: tiny_adapters[n] for n in ("a", "b", "c", "d")}
    cfg = ScaleOutConfig(
        engine=engine_config(tiny_llama_dir),
        server=ServerOptions(port=free_port(), enable_adapter_admin=True, adapter_roots=(adapter_root.resolve(),)),
        num_replicas=2,
        registry_dir=str(tmp_path_factory.mktemp("registry")),
        app_name="lorafleet-ci",
        replica_resources={"num_cpus": 0},
        initial_adapters=tuple((n, str(p)) for n, p in initial.items()),
    )
    deploy(cfg)
    yield cfg, f"http://127.0.0.1:{cfg.server.port}", initial
    stop(cfg)


def test_greedy_outputs_equal_single_server(app, tiny_llama_dir: Path) -> None:
    cfg, url, adapters = app
    adapter_cases = [(name, PROMPTS[i % len(PROMPTS)]) for i, name in enumerate(adapters)]
    cases = [(None, prompt) for _, prompt in adapter_cases] + adapter_cases
    expected = reference_outputs(cfg.engine, adapters, cases, max_tokens=6)
    models = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
    base = models[0]["id"]
    assert sorted(m["id"] for m in models[1:]) == sorted(adapters)
    for adapter, prompt in cases:
        assert token_ids(complete(url, adapter or base, prompt, 6)) == expected[(adapter, prompt)], (adapter, prompt)
    # Adapters change the greedy output (a weak one may not within 6 tokens), so the equality is not vacuous.
    assert sum(expected[(name, prompt)] != expected[(None, prompt)] for name, prompt in adapter_cases) >= 2


def test_a_client_that_stops_reading_a_stream_loses_nothing(app) -> None:
    """Through Serve's proxy, the ingress (``read_ahead``) and a replica, a client that reads one
    chunk, then nothing while the rest is generated, then the rest, reads the whole reply."""
    _, url, _ = app
    whole = complete(url, "a", PROMPTS[1], 60).json()["choices"][0]["text"]
    body = {"model": "a", "prompt": PROMPTS[1], "max_tokens": 60, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        events = [next(line for line in lines if line.startswith("data: "))]
        time.sleep(1.0)  # the replica generates the rest meanwhile
        events += [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]", events[-3:]
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == whole


def test_replicas_draw_different_seeds_for_unseeded_requests(app) -> None:
    """Both replicas run with the app's seed 0 in their config, yet each derives its own engine
    seed (``replica_seed``): with the same seed, unseeded choices came back in identical pairs."""
    cfg, _, _ = app
    handle = serve.get_deployment_handle(REPLICA_DEPLOYMENT, cfg.app_name)
    seen: dict[str, int] = {}
    for _ in range(200):
        info = handle.describe.remote().result(timeout_s=30)
        seen[info["replica_id"]] = info["seed"]
        assert info["log_level"] == cfg.log_level.upper()  # --log-level reaches lorafleet's loggers in the actor (Ray's default: WARNING)
        if len(seen) == 2:
            break
    assert len(seen) == 2, seen
    assert len(set(seen.values())) == 2 and cfg.engine.seed not in seen.values(), seen


def test_affinity_hit_rate_well_above_adapter_blind(app) -> None:
    cfg, _, adapters = app
    names = sorted(adapters)  # 4 adapters, 2 replicas with room for 2 each
    blind = routed_hit_rate(cfg, "adapter_blind", names, n=32, seed=1)
    affinity = routed_hit_rate(cfg, "affinity", names, n=32, seed=2)
    print(f"adapter hit rate: affinity {affinity:.2f}, adapter-blind {blind:.2f}")
    assert affinity >= 0.75, (affinity, blind)
    assert affinity >= blind + 0.2, (affinity, blind)


def test_metrics_carry_replica_and_adapter_labels(app) -> None:
    cfg, url, _ = app
    token_ids(complete(url, "a", PROMPTS[1], 2))
    ok = wait_until(lambda: httpx.get(f"{url}/metrics", timeout=10).text.count('lorafleet_adapter_host_entries{replica="') == 2, timeout_s=10)
    text = httpx.get(f"{url}/metrics", timeout=10).text
    assert ok, text
    assert 'lorafleet_adapter_loads_total{adapter="a",replica="' in text or 'lorafleet_adapter_loads{adapter="a",replica="' in text
    assert 'lorafleet_requests_total{adapter="a",finish_reason="length"}' in text


def test_admin_load_reaches_both_replicas(app, adapter_root: Path, tiny_adapters: dict[str, Path]) -> None:
    cfg, url, _ = app
    resp = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "e", "lora_path": str(adapter_root / "e")}, timeout=60)
    assert resp.status_code == 200, resp.text
    version = resp.json()["version"]
    entry = next(e for e in ray.get(registry(cfg).state.remote())["entries"] if e["name"] == "e")
    assert entry["within"] == [str(r) for r in cfg.server.adapter_roots]  # every replica's read is confined as the validating one's
    live = ray.get(registry(cfg).live_replicas.remote())
    assert len(live) == 2
    for rid, status in live.items():  # the admin call returned only after every live replica applied it
        assert status["snapshot"]["registered"].get("e") == version, rid
    expected = reference_outputs(cfg.engine, {"e": tiny_adapters["e"]}, [("e", PROMPTS[2])], max_tokens=6)[("e", PROMPTS[2])]
    # Adapter-blind routing from the driver spreads requests; keep going until both replicas served "e".
    engine = driver_engine(cfg, "adapter_blind")
    outputs: list[tuple[int, ...]] = []

    async def once(i: int) -> None:
        async for out in engine.generate(f"e-{i}", PROMPTS[2], SamplingParams(max_tokens=6, ignore_eos=True), "e"):
            last = out
        outputs.append(last.token_ids)

    def served_by_both() -> bool:
        live = ray.get(registry(cfg).live_replicas.remote())
        return all((s["snapshot"] or {}).get("adapters", {}).get("e", {}).get("requests", 0) > 0 for s in live.values())  # None: no report yet

    for i in range(40):
        asyncio.run(once(i))
        if i % 4 == 3 and wait_until(served_by_both, timeout_s=1.0):
            break
    assert served_by_both()
    assert set(outputs) == {expected}
    # The same name with a bad path is refused with the single server's status.
    bad = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/etc"}, timeout=30)
    assert bad.status_code == 403


def test_killed_replica_requests_complete_or_fail_retryably(app) -> None:
    cfg, url, _ = app
    names = replica_actor_names(cfg.app_name)
    assert len(names) == 2

    async def one(client: httpx.AsyncClient, i: int) -> tuple[int, str]:
        body = {"model": "abcd"[i % 4], "prompt": PROMPTS[i % 4], "max_tokens": 40, "ignore_eos": True, "temperature": 0 if i % 2 else 0.8, "seed": i}
        resp = await client.post(f"{url}/v1/completions", json=body)
        return resp.status_code, resp.text

    async def scenario() -> list[tuple[int, str]]:
        async with httpx.AsyncClient(timeout=httpx.Timeout(120.0)) as client:
            tasks = [asyncio.create_task(one(client, i)) for i in range(8)]
            await asyncio.sleep(1.0)  # requests are in flight on both replicas
            ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
            return await asyncio.wait_for(asyncio.gather(*tasks), timeout=150)

    results = asyncio.run(scenario())
    print("after killing a replica, statuses:", sorted(status for status, _ in results))
    for status, text in results:
        assert status == 200 or (status == 503 and "retry" in text), (status, text)
    assert any(status == 200 for status, _ in results)
    assert wait_until(lambda: running_replicas(cfg.app_name) == 2 and len(replica_actor_names(cfg.app_name)) == 2, timeout_s=90, interval_s=1.0)
    assert token_ids(complete(url, "b", PROMPTS[0], 3))


def test_replicas_report_their_sequence_limit(app) -> None:
    cfg, _, _ = app
    info = serve.get_deployment_handle(REPLICA_DEPLOYMENT, cfg.app_name).describe.remote().result(timeout_s=30)
    assert info["max_seq_tokens"] == min(96, 96 * 8)  # max_model_len; the pool (96 blocks x 8) holds more


def test_serve_running_elsewhere_or_a_bad_manifest_refuse_to_start_in_one_line(app, tmp_path: Path) -> None:
    """Serve already runs here (the module's app) with its proxy on the app's port: a deploy on
    another port used to print that port and serve on Serve's. A manifest the registry cannot
    load surfaced as Ray's ActorDiedError with the actor's traceback."""
    cfg, url, _ = app
    elsewhere = ScaleOutConfig(**{**cfg.__dict__, "server": ServerOptions(port=free_port()), "app_name": "lorafleet-elsewhere"})
    with pytest.raises(application.StartError) as refused:
        deploy(elsewhere)
    message = str(refused.value)
    assert f"HTTP proxy on 127.0.0.1:{cfg.server.port}" in message and f"cannot serve on 127.0.0.1:{elsewhere.server.port}" in message
    assert "\n" not in message
    assert "lorafleet-elsewhere" not in serve.status().applications  # nothing deployed
    (tmp_path / "adapters.json").write_text('{"format": 1, "revision": "x", "adapters": {}}')
    corrupt = ScaleOutConfig(**{**cfg.__dict__, "registry_dir": str(tmp_path), "app_name": "lorafleet-corrupt"})
    with pytest.raises(ManifestError) as bad:
        application.start_registry(corrupt)
    assert str(bad.value) == f"{tmp_path / 'adapters.json'}: 'revision' must be a non-negative integer, got 'x'"
    # The app's registry actor keeps its own folder: a start with another one was handed that actor and served its adapters.
    other = ScaleOutConfig(**{**cfg.__dict__, "registry_dir": str(tmp_path / "other")})
    with pytest.raises(application.StartError) as elsewhere_dir:
        application.start_registry(other)
    assert f"still runs on registry_dir {Path(cfg.registry_dir).resolve()}, not {(tmp_path / 'other').resolve()}: pass --registry-dir" in str(elsewhere_dir.value)
    assert token_ids(complete(url, "a", PROMPTS[0], 2))  # the app was left alone


def test_a_registry_actor_of_an_earlier_version_left_running_is_refused_at_start_up(ray_session, tiny_llama_dir: Path, tmp_path: Path) -> None:
    """The registry actor is detached and ``start_registry`` takes a running one (get_if_exists):
    one started by an earlier lorafleet was reused, and every admin load then failed there with a
    TypeError (``register(..., within=...)``), a 500. Now start-up refuses it, naming the call that
    removes it."""
    class RegistryOfAnEarlierVersion:  # here, not at module level: pickled by value (a worker cannot import this test module)
        """The registry actor as lorafleet ran it before ``protocol()`` (and ``register``'s ``within``)."""

        def __init__(self, registry_dir: str) -> None:
            self.registry_dir = registry_dir

        def state(self) -> dict[str, Any]:
            return {"revision": 0, "entries": [], "registry": "old"}

        def folder(self) -> str:
            return str(Path(self.registry_dir).resolve())

        def register(self, name: str, path: str, version: str, max_rank: int) -> dict[str, Any]:
            return {"revision": 1, "previous_version": None, "changed": True, "registry": "old"}

    cfg = ScaleOutConfig(engine=engine_config(tiny_llama_dir), server=ServerOptions(port=free_port()), num_replicas=1,
                         registry_dir=str(tmp_path), app_name="lorafleet-earlier")  # fmt: skip
    earlier = ray.remote(RegistryOfAnEarlierVersion).options(name=cfg.registry_name, namespace=NAMESPACE, lifetime="detached",
                                                            num_cpus=0).remote(cfg.registry_dir)  # fmt: skip
    try:
        ray.get(earlier.state.remote())
        with pytest.raises(application.StartError) as refused:
            application.start_registry(cfg)
        message = str(refused.value)
        assert "runs another lorafleet version (registry protocol 1, this one needs" in message, message
        assert f"ray.kill(ray.get_actor('lorafleet-registry-lorafleet-earlier', namespace='{NAMESPACE}'))" in message and "\n" not in message
    finally:
        ray.kill(earlier)
    current = application.start_registry(cfg)  # once it is gone, this version's actor starts
    try:
        assert application.registry_protocol(current) == application.REGISTRY_PROTOCOL
    finally:
        ray.kill(current)


def test_drain_ends_requests_with_503_and_shuts_every_replica_engine_down(app) -> None:
    """SIGTERM's first step (``application.drain``): requests in flight finish or get a JSON 503
    engine_unavailable (never a plain-text 500 or a cut stream), new ones and /health get that
    503, and the replicas' engines refuse requests. Runs last but one: the next test restarts
    the application."""
    cfg, url, _ = app

    async def one(client: httpx.AsyncClient, i: int) -> tuple[int, Any]:
        body = {"model": "abcd"[i % 4], "prompt": PROMPTS[i % 4], "max_tokens": 70, "ignore_eos": True, "temperature": 0, "stream": i % 2 == 1}
        resp = await client.post(f"{url}/v1/completions", json=body)
        if not body["stream"]:
            return resp.status_code, resp.json()
        events = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", resp.text[-300:]
        return resp.status_code, [json.loads(e) for e in events[:-1]]

    async def scenario() -> tuple[list[tuple[int, Any]], int]:
        async with httpx.AsyncClient(timeout=httpx.Timeout(60.0)) as client:
            tasks = [asyncio.create_task(one(client, i)) for i in range(6)]
            await asyncio.sleep(0.3)
            left = await asyncio.to_thread(application.drain, cfg, 1.0)
            return await asyncio.gather(*tasks), left

    results, left = asyncio.run(scenario())
    print("drained:", [(status, body[-1] if isinstance(body, list) else body.get("error", {}).get("code")) for status, body in results])
    assert left == 0
    for status, body in results:
        if isinstance(body, list):  # a stream: complete, or ended by an error event
            assert status == 200
            errors = [e["error"] for e in body if "error" in e]
            assert errors == [] or (len(errors) == 1 and "error" in body[-1] and errors[0]["code"] == "engine_unavailable"), body[-2:]
        else:
            assert status == 200 or (status == 503 and body["error"]["code"] == "engine_unavailable"), body
    for resp in (httpx.get(f"{url}/health", timeout=10), complete(url, "a", PROMPTS[0], 2)):
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "engine_unavailable", resp.text
    engine = driver_engine(cfg, "adapter_blind")  # straight to the replicas, past the ingress

    async def refused(i: int) -> str:
        with pytest.raises(EngineDeadError) as err:
            async for _ in engine.generate(f"after-drain-{i}", PROMPTS[0], SamplingParams(max_tokens=2), None):
                pass
        return str(err.value)

    messages = {asyncio.run(refused(i)) for i in range(6)}
    assert all("shut" in m for m in messages), messages  # "is shutting down" while it drains, "was shut down" after


def test_registered_set_survives_application_restart(app) -> None:
    cfg, url, _ = app
    before = {m["id"]: m.get("version") for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"][1:]}
    assert "e" in before  # loaded through the admin API earlier in this module
    stop(cfg)  # deletes the application and the registry actor; the manifest stays on disk
    restarted = ScaleOutConfig(**{**cfg.__dict__, "initial_adapters": ()})
    deploy(restarted)
    after = {m["id"]: m.get("version") for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"][1:]}
    assert after == before
    assert token_ids(complete(url, "e", PROMPTS[1], 3))
    unload = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "e"}, timeout=60)
    assert unload.status_code == 200, unload.text
    assert complete(url, "e", PROMPTS[1], 3).status_code == 404


@pytest.mark.slow
def test_twenty_adapters_small_pools(ray_session, tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    root = tmp_path_factory.mktemp("twenty")
    adapters = {f"z{i:02d}": build_adapter(tiny_llama_dir, root / f"z{i:02d}", r=4 + 4 * (i % 3), target_modules=["q_proj", "v_proj", "down_proj"], seed=100 + i) for i in range(20)}
    cfg = ScaleOutConfig(
        engine=engine_config(tiny_llama_dir, max_loras=4, max_cpu_loras=6),  # 2 x 6 < 20 adapters
        server=ServerOptions(port=free_port()),
        num_replicas=2,
        registry_dir=str(tmp_path_factory.mktemp("registry20")),
        app_name="lorafleet-twenty",
        replica_resources={"num_cpus": 0},
        initial_adapters=tuple((n, str(p)) for n, p in adapters.items()),
    )
    deploy(cfg)
    try:
        url = f"http://127.0.0.1:{cfg.server.port}"
        cases = [(name, PROMPTS[i % len(PROMPTS)]) for i, name in enumerate(adapters)]
        expected = reference_outputs(cfg.engine, adapters, cases, max_tokens=5)
        for name, prompt in cases:
            assert token_ids(complete(url, name, prompt, 5)) == expected[(name, prompt)], name
        hot = sorted(adapters)[:10]  # a working set that fits the two pools together, not one
        blind = routed_hit_rate(cfg, "adapter_blind", hot, n=60, seed=3)
        affinity = routed_hit_rate(cfg, "affinity", hot, n=60, seed=4)
        print(f"20 adapters, hit rate: affinity {affinity:.2f}, adapter-blind {blind:.2f}")
        assert affinity >= blind + 0.2, (affinity, blind)
    finally:
        stop(cfg)
