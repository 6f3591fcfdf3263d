"""`lorafleet serve`: the OpenAI-compatible HTTP server."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import socket
import sys
from pathlib import Path
from typing import Any

from runtime.config import ConfigError
from runtime.distributed.launcher import DEFAULT_REGISTRY_DIR  # stdlib imports only: ray is imported when --ray runs
from runtime.lora.registry import first_of

log = logging.getLogger("lorafleet.serve")
DEMO_MODEL_NAME = "lorafleet-demo"
GRACEFUL_SHUTDOWN_S = 30  # uvicorn: how long connections may stay open after SIGTERM
ENGINE_DRAIN_S = 25.0  # in-flight requests may run this long after SIGTERM; then the engine fails them (a 503 / stream error event)
# (a step still running then gets async_engine.STEP_GRACE_S more; DrainingServer checks that both end inside uvicorn's window)
ENGINE_SHUTDOWN_S = 5.0  # shutting the engine down when uvicorn stopped without starting a drain (e.g. it failed to start)


def add_arguments(p: argparse.ArgumentParser) -> None:
    # Every default is None so that only flags actually given override the --config file; the boolean
    # ones take a --no- form too, so that a flag can turn off what the file turns on.
    p.add_argument("--config", metavar="FILE", help="YAML file with the same keys as these flags; flags override it; relative paths in it "
                                     "are taken from the current directory")
    p.add_argument("--model", metavar="DIR", help="HF checkpoint folder (default: the bundled demo model and its adapters)")
    # vLLM's `vllm serve MODEL`: taken only to be refused with the flag to use (load_settings).
    p.add_argument("positional_model", nargs="?", help=argparse.SUPPRESS)
    p.add_argument("--lora-modules", nargs="+", action="extend", metavar="SPEC", help='adapters to serve: name=path, or JSON {"name":..., "path":..., "base_model_name":...}')
    p.add_argument("--device", choices=["auto", "cpu", "cuda", "npu"], help="auto picks cuda, then npu, then cpu (default auto)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="weights and compute dtype (default float32)")
    p.add_argument("--host", metavar="HOST", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, metavar="PORT", help="listen port (default 8000; 0: any free port, which the start-up log names; not with --ray)")
    p.add_argument("--served-model-name", metavar="NAME", help="the base model's name in the API (default: the checkpoint's name)")
    p.add_argument("--max-loras", type=int, metavar="N", help="distinct adapters in one step (device slots; default 8)")
    p.add_argument("--max-lora-rank", type=int, metavar="R", help="largest adapter rank accepted (default 64)")
    p.add_argument("--max-cpu-loras", type=int, metavar="N", help="adapters kept in host memory, at least --max-loras (default: max(32, --max-loras), "
                                                                "or no count of its own with --max-cpu-lora-bytes alone)")
    p.add_argument("--max-cpu-lora-bytes", metavar="SIZE", help="bound on the host memory those adapters' weights take: 512M, 2G (binary "
                   "units) or bytes; with --max-cpu-loras both bounds hold. An adapter larger than it is refused when loaded. Unset, "
                   "only --max-cpu-loras bounds the host tier")
    p.add_argument("--lora-pool-rows", type=int, metavar="N", help="device rank-rows per target slice (default: --max-loras x --max-lora-rank)")
    p.add_argument("--max-num-seqs", type=int, metavar="N", help="running sequences per step (default 64)")
    p.add_argument("--max-num-batched-tokens", type=int, metavar="N", help="tokens per step (prefill chunks + decodes), at least --max-num-seqs so every running sequence "
                   "decodes each step (default: max(256, --max-num-seqs) on the cpu, where smaller steps run faster; max(2048, --max-num-seqs) "
                   "on a GPU or NPU)")
    p.add_argument("--max-model-len", type=int, metavar="N", help="longest prompt + output, in tokens (default: the model's limit)")
    p.add_argument("--block-size", type=int, metavar="N", help="tokens per KV block (default 16)")
    p.add_argument("--num-kv-blocks", type=int, metavar="N", help="KV blocks of --block-size tokens (default: enough for --max-num-seqs sequences of "
                                                    "--max-model-len tokens, capped by --kv-cache-mb)")
    p.add_argument("--kv-cache-mb", type=int, metavar="MIB", help="KV memory cap in MiB that sizes the pool (default 1024); not with --num-kv-blocks")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, help="reuse KV blocks across requests of the same adapter version: a shared system "
                   "prompt, the n choices of one prompt (computed once, even when they arrive together) (default off)")
    p.add_argument("--seed", type=int, metavar="N", help="default sampling seed (default 0)")
    p.add_argument("--cpu-gemm", choices=["auto", "onednn", "mkl"],
                   help="--device cpu, float32: the base GEMM kernel. onednn packs the large projections for oneDNN, mkl keeps "
                        "them plain on torch's F.linear (MKL); auto (the default) is onednn wherever torch has it. On an Intel CPU mkl "
                        "can be faster for small models or a single stream (docs/benchmarks.md). Other devices and dtypes take only auto; "
                        "an int8 checkpoint runs its projections int8, so the choice there is the untied LM head's only "
                        "(refused when the head is tied)")
    p.add_argument("--enable-adapter-admin", action=argparse.BooleanOptionalAction, help="expose /v1/load_lora_adapter and /v1/unload_lora_adapter "
                                                                                        "(default off)")
    p.add_argument("--adapter-root", action="append", metavar="DIR", help="folder admin-loaded adapters must live in (repeatable)")
    p.add_argument("--api-key", metavar="KEY", help="require 'Authorization: Bearer KEY' on every route but /health (at least 8 characters; "
                                      "api_key in --config keeps it out of `ps`)")
    p.add_argument("--max-request-bytes", type=int, metavar="N", help="largest request body in bytes, at least 1024 (default 1048576, 1 MiB)")
    p.add_argument("--metrics-max-adapters", type=int, metavar="N", help="adapters with /metrics series of their own, the first N to get a request; "
                   "the others share adapter=\"__other__\" (default 100: each adapter adds ~80 lines, and rendering ~8 us a line holds up serving)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="the least severe log lines written (default info)")
    p.add_argument("--ray", action=argparse.BooleanOptionalAction, help="run as a Ray Serve application (needs the 'ray' extra; default off)")
    p.add_argument("--num-replicas", type=int, metavar="N", help="Ray Serve replicas (default 1; more need --ray, and 1 without it is the single server)")
    p.add_argument("--ray-address", metavar="ADDRESS", help="with --ray: join an existing Ray cluster (e.g. 'auto'); default: $RAY_ADDRESS's cluster when "
                                        "it is set, else start a local one")
    p.add_argument("--registry-dir", metavar="DIR", help=f"with --ray: folder for the shared adapter registry manifest (default: ./{DEFAULT_REGISTRY_DIR}, in the working directory)")


def _flag_values(args: argparse.Namespace) -> dict[str, Any]:
    """The flags as config keys. A model given as vLLM takes it, ``lorafleet serve MODEL``, is refused
    naming the flag (argparse's "unrecognized arguments" came under 24 lines of usage)."""
    stray = getattr(args, "positional_model", None)
    if stray is not None:
        raise ConfigError(f"{stray!r}: the model is given as --model {stray} (lorafleet serve takes no positional argument)")
    return {k: v for k, v in vars(args).items() if k not in ("config", "positional_model")}


def _demo_paths() -> tuple[str | None, dict[str, str]]:
    try:
        from runtime.demo import demo_adapters, demo_model_dir
    except ImportError:
        return None, {}
    try:
        return str(demo_model_dir()), {name: str(path) for name, path in demo_adapters().items()}
    except FileNotFoundError:
        return None, {}


def load_settings(args: argparse.Namespace) -> Any:
    from runtime.server.serve_config import (LoRAModule, build_settings, check_adapter_names, check_overridden_file_types, load_yaml,
                                             normalize_keys)  # fmt: skip

    file_values = load_yaml(args.config) if args.config else {}
    flags = normalize_keys(_flag_values(args), "flags")
    check_overridden_file_types(file_values, flags)  # the file's own types, also where a flag replaces the value
    demo_model, demo_adapters = _demo_paths()
    settings = build_settings(file_values, flags, demo_model)
    if settings.uses_demo:
        given = {m.name for m in settings.lora_modules}
        extra = tuple(LoRAModule(n, p) for n, p in demo_adapters.items() if n not in given)
        settings = dataclasses.replace(settings, lora_modules=extra + settings.lora_modules)
        if settings.server.served_model_name is None:  # the demo checkpoint's folder is just "base"
            settings = dataclasses.replace(settings, server=dataclasses.replace(settings.server, served_model_name=DEMO_MODEL_NAME))
    if settings.server.served_model_name is not None:  # known now (else build_engine checks against the checkpoint's name)
        check_adapter_names(settings.lora_modules, settings.server.served_model_name)
    return settings


def _mb(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def build_engine(settings: Any) -> Any:
    """Create the async engine and register the configured adapters (validated, all or nothing),
    after ``check_before_loading``."""
    check_before_loading(settings)
    return load_engine(settings)


def check_before_loading(settings: Any) -> None:
    """What needs no weights loaded, checked before the model loads (minutes for a large one), so
    that a mistyped path is one line at once, as for ``LLM`` and ``--ray``: the model folder (its
    config.json, the safetensors files it names: headers only, and its tokenizer.json), the adapter
    names against the base model's, and each adapter folder's shape."""
    from runtime.lora.adapter import check_adapter_folder
    from runtime.models.hf_config import load_model_config
    from runtime.models.loader import weight_files
    from runtime.server.serve_config import check_base_model_names
    from runtime.tokenizer import tokenizer_file

    model_name = load_model_config(settings.engine.model).name
    weight_files(settings.engine.model)
    tokenizer_file(settings.engine.model)
    if settings.lora_modules:
        check_base_model_names(settings.lora_modules, settings.server.served_model_name, model_name)
        for module in settings.lora_modules:
            check_adapter_folder(Path(module.path))


def load_engine(settings: Any) -> Any:
    """The async engine with the configured adapters registered (all or nothing): the model's
    weights read (and on the cpu packed) and every adapter read."""
    from runtime.async_engine import AsyncLLMEngine

    engine = AsyncLLMEngine(settings.engine)
    try:
        for module in settings.lora_modules:
            engine.register_adapter(module.name, module.path)
    except BaseException:
        engine.shutdown()
        raise
    return engine


def _admin_line(server: Any) -> str:
    if not server.enable_adapter_admin:
        return "off"
    if not server.adapter_roots:
        return "on, unload only: loading by path is off without --adapter-root"
    return f"on, loads from {', '.join(str(r) for r in server.adapter_roots)}"


def _adapters_line(adapters: Any, shown: int = 10) -> str:
    """Each adapter as name@version r=rank, the first ``shown`` only (``first_of``): with thousands
    the line would pass log shippers' line limits (2000 adapters: 62 KB)."""
    listed = first_of([f"{a.name}@{a.version} r={a.max_rank}" for a in adapters], shown)
    return listed if len(adapters) <= shown else f"{len(adapters)}: {listed}"


def _gemm_note(asked: str, config: Any, *, quantized: bool = False, tied_head: bool = False) -> str:
    """The cpu backend's float32 GEMM (and whether auto chose it); nothing elsewhere. An int8
    checkpoint (``quantized``) runs its projections int8 whatever the choice: the GEMM is then its
    untied LM head's only, and with the head tied to the embedding there is none to name."""
    if config.cpu_gemm == "auto" or config.dtype != "float32":  # not the cpu backend, or a dtype the choice does not touch
        return ""
    if quantized and tied_head:
        return ""
    kernel = {"onednn": "oneDNN on packed weights", "mkl": "MKL (F.linear)"}[config.cpu_gemm]
    return f", {'untied LM head ' if quantized else ''}float32 GEMM {kernel}" + (" (auto for this CPU; --cpu-gemm to choose)" if asked == "auto" else "")


def _dtype_note(settings: Any, core: Any) -> str:
    """``dtype X`` and, for an int8 checkpoint (``lorafleet quantize``), that its projections run int8,
    then the float32 GEMM in effect (``_gemm_note``)."""
    from runtime.models.loader import checkpoint_quantization

    quantized = checkpoint_quantization(settings.engine.model) is not None
    note = f"dtype {settings.engine.dtype}" + (", projections int8 (weight-only checkpoint)" if quantized else "")
    return note + _gemm_note(settings.engine.cpu_gemm, core.config, quantized=quantized, tied_head=core.runner.model_config.tie_word_embeddings)


def host_tier_line(config: Any) -> str:
    """The host tier's bounds as the start-up summary states them: adapters, bytes of their
    weights, or both (``EngineConfig.host_tier_size``, ``max_cpu_lora_bytes``)."""
    from runtime.byte_size import format_byte_size

    entries, size = config.host_tier_size, config.max_cpu_lora_bytes
    if size is None:
        return f"at most {entries} adapters (--max-cpu-loras)"
    weights = f"{format_byte_size(size)} ({size} bytes) of adapter weights"
    return f"at most {entries} adapters and {weights}" if entries is not None else f"at most {weights}; adapters not counted"


def summary(settings: Any, engine: Any) -> str:
    core = engine.engine
    mem = core.runner.memory_report()
    pool_tokens = core.runner.num_kv_blocks * core.runner.block_size
    lines = [
        f"model      {settings.engine.model}{'  (bundled demo)' if settings.uses_demo else ''}; requests name it "
        f"{settings.server.served_model_name or engine.model_name!r} (\"model\" field, GET /v1/models)",
        f"device     {core.runner.device} (backend {core.backend_name}{', chosen by --device auto' if settings.engine.device == 'auto' else ''}), "
        + _dtype_note(settings, core),
        f"adapters   {_adapters_line(engine.adapters())}",
        f"memory     weights {_mb(mem.get('weights_bytes', 0))}, KV cache {_mb(mem.get('kv_cache_bytes', 0))}, adapter pool {_mb(mem.get('lora_pool_bytes', 0))}",
        f"limits     max_loras={settings.engine.max_loras} max_lora_rank={settings.engine.max_lora_rank} max_num_seqs={settings.engine.max_num_seqs} "
        f"max_num_batched_tokens={core.config.max_num_batched_tokens} max_model_len={engine.max_model_len}",  # the budget as resolved for the device
        f"host tier  {host_tier_line(core.config)}",
        f"kv pool    {core.runner.num_kv_blocks} blocks x {core.runner.block_size} tokens = {pool_tokens} tokens"
        + (f" (one request: at most {pool_tokens} of prompt + output)" if pool_tokens < engine.max_model_len else ""),
        f"admin      {_admin_line(settings.server)}; api key {'required' if settings.server.api_key else 'not set'}",
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        settings = load_settings(args)
    except (ConfigError, ValueError, OSError) as err:
        print(f"lorafleet serve: {one_line_error(err)}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if settings.ray:
        from runtime.distributed.launcher import run_ray

        return run_ray(settings)
    import uvicorn

    from runtime.server.app import create_app
    from runtime.server.draining_server import DrainingServer

    # Bind first: a busy port or a bad --host is found in a moment, not after the model has loaded.
    try:
        sock = bind_socket(settings.server.host, settings.server.port)
    except OSError as err:
        print(f"lorafleet serve: cannot listen on {settings.server.host}:{settings.server.port}: {err.strerror or err}", file=sys.stderr)
        return 2
    try:
        check_before_loading(settings)
        log.info("%s", loading_line(settings))
        engine = load_engine(settings)
    except (ConfigError, ValueError, RuntimeError, OSError) as err:
        sock.close()
        print(f"lorafleet serve: {one_line_error(err)}", file=sys.stderr)
        return 2
    previous = {sig: signal.signal(sig, _exit_after_drain) for sig in (signal.SIGTERM, signal.SIGINT)}
    server = None
    try:
        app = create_app(engine, settings.server)
        host, port = sock.getsockname()[:2]  # the real port when --port 0 asked for any free one
        log.info("lorafleet serving on %s\n%s", _url(host, port), summary(settings, engine))
        config = uvicorn.Config(app, host=settings.server.host, port=port, log_level=settings.log_level,
                                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
        server = DrainingServer(config, engine, drain_s=ENGINE_DRAIN_S)
        server.run(sockets=[sock])
    except SystemExit as stop:
        if stop.code != 0:
            raise
    finally:
        sock.close()
        drain = server.drain if server is not None else None
        if drain is not None:
            drain.join()
        else:
            log.info("lorafleet serve: HTTP server stopped; shutting down the engine")
            engine.shutdown(timeout=ENGINE_SHUTDOWN_S)
        log.log(*stopped_line(engine))
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def loading_line(settings: Any, replicas: int | None = None) -> str:
    """The line said before the engine is built, which can take minutes (the weights read, cast and
    on the cpu packed, every adapter read): what loads, with the size of the checkpoint's safetensors
    files (only stat'ed; left out when there are none here, e.g. a model only a remote Ray cluster
    has), and where. With ``replicas`` (``--ray``), it says that each replica loads it."""
    try:
        files = list(Path(settings.engine.model).glob("*.safetensors"))
        size = f" ({sum(f.stat().st_size for f in files) / 2**20:.1f} MiB of weights)" if files else ""
    except OSError:  # a dangling shard link, a folder it may not read: the load says what is wrong
        size = ""
    count = len(settings.lora_modules)
    adapters = f" and {count} adapter{'s' if count != 1 else ''}" if count else ""
    what = f"{settings.engine.model}{size}{adapters} on --device {settings.engine.device}, dtype {settings.engine.dtype}"
    start = "loading" if replicas is None else f"starting Ray Serve with {replicas} replica{'s' if replicas != 1 else ''}, each loading"
    return f"lorafleet serve: {start} {what}; 'serving on' follows once they are ready"


def stopped_line(engine: Any) -> tuple[int, str]:
    """``lorafleet serve``'s last log line (level, text), once the engine's shutdown returned: both
    stopped, or something still held the engine's lock (a step, or another call: ``abandoned_holder``)
    and shutdown abandoned the engine (``AsyncLLMEngine.step_abandoned``; the engine was not closed,
    and the process exits without it)."""
    if engine.step_abandoned:
        return logging.WARNING, f"lorafleet serve: HTTP server stopped; the engine was abandoned, not closed: {engine.abandoned_holder} was still running"
    return logging.INFO, "lorafleet serve: HTTP server and engine stopped"


def one_line_error(err: BaseException) -> str:
    """A start-up error for the terminal: an OSError (a path component longer than the file system
    allows, a folder it may not read) as ``path: reason``, anything else as its message."""
    if isinstance(err, OSError) and err.filename is not None:
        return f"{err.filename}: {err.strerror or err}"
    return str(err)


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (not listening yet; uvicorn listens on it), as
    uvicorn binds: SO_REUSEADDR, IPv6 when the host has a colon. Raises OSError (busy port,
    an address this machine does not have, a name that does not resolve)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _exit_after_drain(signum: int, frame: Any) -> None:
    """SIGTERM/SIGINT handler in force outside uvicorn's own (start-up, and after it returns).

    uvicorn drains in-flight requests on SIGTERM, then re-raises the signal with the
    handler that was installed before it started. With Python's default handler that
    kills the process before ``engine.shutdown()`` runs; this one ends the process
    through ``SystemExit(0)`` instead, so the ``finally`` shuts the engine down.
    """
    raise SystemExit(0)
