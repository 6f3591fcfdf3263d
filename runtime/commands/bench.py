"""`lorafleet bench`: replay a synthetic multi-adapter workload and print a summary table.

In-process by default: a random Llama and random PEFT adapters are written to
--workdir (reused across runs). With --url it streams the workload from a running
`lorafleet serve` instead; the server must have adapters named like the workload's
(lora-0000, lora-0001, ...), or use --base-fraction 1 so every request names the base.
Over HTTP the adapter pool counters (swaps, cache hits) are not measured: read them from
the server's /metrics.
benchmarks/serve.py runs the full suite with baselines and plots.

Everything that can be checked before the run is (flags, the workload file, the engine
configuration, the backend and its capability limits, the server's model list, --json's
folder), before any synthetic weights are written. A flag the chosen mode would ignore is an
error, not a no-op.

Exit codes: 0 every request succeeded; 1 the run finished but some requests failed (the
first distinct errors are printed to stderr); 2 bad input or setup (an invalid or ignored
flag, an unreadable workload, an unavailable device, a server that cannot be reached), with
one line `lorafleet bench: <flag or file>: <reason>` on stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from runtime.file_mode import new_file_mode

EXIT_OK, EXIT_REQUESTS_FAILED, EXIT_BAD_INPUT = 0, 1, 2
DEFAULT_WORKDIR = Path.home() / ".cache" / "lorafleet-bench"
SHOWN_ERRORS = 3  # distinct request errors printed when some requests fail

EPILOG = """\
exit codes:
  0  every request succeeded
  1  the run finished but some requests failed (the first distinct errors go to stderr)
  2  bad input or setup: an invalid flag, a flag the chosen mode ignores, an unreadable
     workload file, an unavailable device, a server that cannot be reached
"""

# Flags that only the in-process engine uses: with --url the server's own settings apply.
ENGINE_FLAGS = ("--device", "--dtype", "--hidden", "--layers", "--max-loras", "--max-cpu-loras", "--workdir")
URL_ONLY_FLAGS = ("--base-model", "--api-key")


class SetupError(Exception):
    """Bad input or setup, found before or instead of the run: ``<where>: <reason>``, exit 2."""

    def __init__(self, where: str, reason: str) -> None:
        super().__init__(reason if reason.startswith((f"{where} ", f"{where}:")) else f"{where}: {reason}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from runtime.bench.workload import Given, add_spec_arguments

    p.formatter_class = argparse.RawDescriptionHelpFormatter  # keep the epilog's lines
    p.epilog = EPILOG
    add_spec_arguments(p)
    engine = "; not with --url"
    p.add_argument("--device", choices=["auto", "cpu", "cuda", "npu"], default="cpu", action=Given,
                   help=f"engine device; auto picks cuda, then npu, then cpu{engine} (default: %(default)s)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32", action=Given,
                   help=f"weights and compute dtype{engine} (default: %(default)s)")
    p.add_argument("--hidden", type=int, default=512, action=Given, help=f"synthetic model hidden size{engine} (default: %(default)s)")
    p.add_argument("--layers", type=int, default=4, action=Given, help=f"synthetic model layers{engine} (default: %(default)s)")
    p.add_argument("--max-loras", type=int, default=8, action=Given, help=f"distinct adapters in one step (device slots){engine} (default: %(default)s)")
    p.add_argument("--max-cpu-loras", type=int, default=None, action=Given,
                   help=f"host-tier adapters, at least --max-loras{engine} (default: max(32, --max-loras))")
    p.add_argument("--workdir", default=str(DEFAULT_WORKDIR), action=Given,
                   help=f"where the synthetic model and adapters are written, and reused by later runs{engine} (default: %(default)s)")
    p.add_argument("--workload", metavar="FILE",
                   help="replay this JSONL workload (python -m runtime.bench.workload --out FILE) instead of generating one; "
                        "the workload flags above are then refused (default: generate from them)")  # fmt: skip
    p.add_argument("--url", help="benchmark a running `lorafleet serve` at this URL instead of an in-process engine (default: in-process)")
    p.add_argument("--base-model", action=Given, help="with --url: the served base model's name (default: the first entry of /v1/models)")
    p.add_argument("--api-key", action=Given, help="with --url: the server's bearer key (default: none)")
    p.add_argument("--slo-ttft", type=float, default=2.0, help="SLO on time to first token, seconds (default: %(default)s)")
    p.add_argument("--slo-tpot", type=float, default=0.5, help="SLO on time per output token, seconds (default: %(default)s)")
    p.add_argument("--json", metavar="PATH", help="also write the workload spec and the full summary as JSON here (default: not written)")


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except SetupError as err:
        print(f"lorafleet bench: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT


def _ignored_flags(args: argparse.Namespace) -> list[str]:
    """One line per typed flag that this combination of flags would ignore."""
    from runtime.bench.workload import SPEC_FLAGS, given_flags

    given = given_flags(args)
    problems = []
    if args.workload:
        problems += [f"{f}: not used with --workload (the file fixes every request); drop it, or write a new workload "
                     "with python -m runtime.bench.workload" for f in SPEC_FLAGS.values() if f in given]  # fmt: skip
    elif "--alpha" in given and args.popularity != "zipf":
        problems.append(f"--alpha: only used with --popularity zipf, not {args.popularity}")
    if args.url:
        problems += [f"{f}: not used with --url (the server's own settings apply)" for f in ENGINE_FLAGS if f in given]
    else:
        problems += [f"{f}: only used with --url" for f in URL_ONLY_FLAGS if f in given]
    return problems


def _check_json_path(path_text: str) -> Path:
    path = Path(path_text)
    folder = path.parent
    if path.is_dir():
        raise SetupError(f"--json {path_text}", "is a folder; give a file path")
    if not folder.is_dir():
        raise SetupError(f"--json {path_text}", f"folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise SetupError(f"--json {path_text}", f"folder {folder} is not writable")
    return path


def _write_json(path: Path, data: Any) -> None:
    """Write via a temporary file in the same folder and a rename: never a half-written file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, new_file_mode())  # as a plain open() would create it (mkstemp: 0600)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(data, indent=2, default=str))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _load_workload(args: argparse.Namespace) -> Any:
    from runtime.bench.workload import Workload, generate, spec_from_args

    if args.workload:
        try:
            return Workload.load(args.workload)
        except OSError as err:
            raise SetupError(f"--workload {args.workload}", err.strerror or str(err)) from None
        except ValueError as err:  # "FILE: line N: what is wrong"
            raise SetupError(args.workload, str(err)) from None
    try:
        return generate(spec_from_args(args))
    except ValueError as err:  # the message starts with the flag
        where, _, why = str(err).partition(": ")
        raise SetupError(where, why) from None


def _ranks_source(args: argparse.Namespace) -> str:
    return f"--workload {args.workload}" if args.workload else "--ranks"


def _check_engine(args: argparse.Namespace, workload: Any) -> Any:
    """The BenchSetup, once its engine config, backend and capability limits are known to be fine."""
    from types import SimpleNamespace

    import backends
    from runtime.bench.suite import BenchSetup, engine_config, host_tier_size
    from runtime.bench.synthetic import LlamaShape
    from runtime.capabilities import CapabilityError, check_adapter, check_engine_config
    from runtime.config import ConfigError

    try:
        shape = LlamaShape.sized(args.hidden, args.layers)
    except ValueError as err:
        raise SetupError("--layers" if args.layers < 1 else "--hidden", str(err)) from None
    try:
        host_cpu_loras = host_tier_size(args.max_loras, args.max_cpu_loras)
    except ValueError as err:  # "--max-cpu-loras N is below --max-loras M: ..."
        raise SetupError("--max-cpu-loras", str(err)) from None
    ranks = sorted(set(workload.spec.ranks) | set(workload.adapter_ranks.values()))
    setup = BenchSetup(Path(args.workdir), shape, args.device, args.dtype, args.max_loras, host_cpu_loras,
                       max_lora_rank=max(64, *ranks), slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot)  # fmt: skip
    flag_of = {"device": "--device", "dtype": "--dtype", "max_loras": "--max-loras", "max_cpu_loras": "--max-cpu-loras",
               "max_lora_rank": _ranks_source(args)}  # fmt: skip
    try:
        config = engine_config(setup, setup.workdir / "model")
    except ConfigError as err:  # "key: reason"
        key, _, why = str(err).partition(": ")
        raise SetupError(flag_of[key], why) if key in flag_of else SetupError("engine config", str(err)) from None
    try:
        backend_name = backends.resolve_name(config.device)
    except ValueError as err:
        raise SetupError("--device", str(err)) from None
    ok, reason = backends.availability(backend_name)
    if not ok:
        raise SetupError("--device", reason)
    # The same checks the engine makes when it starts and when it loads each adapter.
    for rank in ranks:
        modules = {(0, target): SimpleNamespace(rank=rank) for target in setup.targets}
        name = next((n for n, r in sorted(workload.adapter_ranks.items()) if r == rank), f"rank-{rank}")
        try:
            check_adapter(SimpleNamespace(name=name, modules=modules), backend_name)
        except CapabilityError as err:
            raise SetupError(_ranks_source(args), str(err)) from None
    try:
        check_engine_config(config, backend_name)
    except CapabilityError as err:
        text = str(err)
        where = next((flag for key, flag in flag_of.items() if f"{key}=" in text), "--dtype" if "dtype '" in text else f"--device {args.device}")
        raise SetupError(where, text) from None
    return setup


def _check_url(args: argparse.Namespace) -> str:
    """The base model's name, once the server answered its model list."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(args.url)
    except ValueError as err:  # e.g. an unclosed [IPv6 bracket
        raise SetupError(f"--url {args.url}", str(err)) from None
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise SetupError(f"--url {args.url}", "expected http://HOST:PORT or https://HOST:PORT")
    try:
        import httpx
    except ImportError as err:
        raise SetupError("--url", f"needs the httpx package, which failed to import ({err}); pip install httpx") from None
    from runtime.bench.replay import served_base_model

    try:
        served = served_base_model(args.url, args.api_key)
    except httpx.HTTPStatusError as err:
        hint = {401: " (check --api-key)" if args.api_key else " (the server wants a key: pass --api-key)",
                404: " (is this a lorafleet/OpenAI-compatible server?)"}.get(err.response.status_code, "")  # fmt: skip
        raise SetupError(f"--url {args.url}", f"{err}{hint}") from None
    except httpx.HTTPError as err:
        raise SetupError(f"--url {args.url}", f"{type(err).__name__}: {err or 'no detail'}") from None
    except (httpx.InvalidURL, ValueError) as err:
        raise SetupError(f"--url {args.url}", str(err)) from None
    return args.base_model or served


def _report_failures(records: Any) -> None:
    failed = [r for r in records if r.error is not None]
    if not failed:
        return
    counts: dict[str, int] = {}
    for r in failed:
        counts[r.error] = counts.get(r.error, 0) + 1
    shown = list(counts.items())[:SHOWN_ERRORS]
    print(f"lorafleet bench: {len(failed)} of {len(records)} requests failed; "
          f"{'the' if len(counts) <= SHOWN_ERRORS else f'the first {SHOWN_ERRORS} of {len(counts)}'} distinct errors:", file=sys.stderr)  # fmt: skip
    for error, n in shown:
        print(f"  {' '.join(str(error).split())[:300]} ({n} request{'s' if n != 1 else ''})", file=sys.stderr)


def _run(args: argparse.Namespace) -> int:
    import asyncio

    from tqdm import tqdm

    problems = _ignored_flags(args)
    if problems:
        for line in problems:
            print(f"lorafleet bench: {line}", file=sys.stderr)
        return EXIT_BAD_INPUT
    for flag, value in (("--slo-ttft", args.slo_ttft), ("--slo-tpot", args.slo_tpot)):
        if not 0 < value < float("inf"):
            raise SetupError(flag, f"must be a positive number of seconds, got {value}")
    json_path = _check_json_path(args.json) if args.json else None
    workload = _load_workload(args)
    if args.url:
        base = _check_url(args)
        setup = None
    else:
        setup = _check_engine(args, workload)

    from runtime.bench.replay import replay_http
    from runtime.bench.suite import prepare, run_lorafleet
    from runtime.bench.summary import summarize, table
    from runtime.capabilities import CapabilityError
    from runtime.config import ConfigError
    from runtime.torch_threads import in_fresh_thread
    from backends import BackendUnavailable

    bar = tqdm(total=len(workload.requests), desc="requests", unit="req")
    try:
        if setup is None:
            result = asyncio.run(replay_http(args.url, base, workload.requests, "lorafleet-http", args.api_key, progress=bar.update))
        else:
            bar.set_description("preparing synthetic weights")
            # Not on this thread: its OpenMP team would slow the engine's steps (runtime/torch_threads.py).
            model_dir, adapters = in_fresh_thread(prepare)(workload, setup)
            bar.set_description("requests")
            try:
                result = run_lorafleet(workload, setup, model_dir, adapters, progress=bar.update)
            except (ConfigError, CapabilityError, BackendUnavailable) as err:  # checked above; the engine has the last word
                raise SetupError("engine setup", f"{type(err).__name__}: {err}") from None
    finally:
        bar.close()
    summary = summarize(result, args.slo_ttft, args.slo_tpot)
    print(table([summary]))
    if summary["cache"]["device_hit_rate"] is not None:
        print(f"adapter device hit rate {summary['cache']['device_hit_rate']:.2f}, swaps {summary['adapter_swaps']}")
    elif args.url:
        print("adapter swaps and cache hits: not measured over HTTP (see the server's /metrics)")
    if json_path is not None:
        _write_json(json_path, {"workload": {"spec": workload.spec.__dict__}, "summary": summary})
        print(f"wrote {json_path}")
    _report_failures(result.records)
    return EXIT_OK if summary["requests_failed"] == 0 else EXIT_REQUESTS_FAILED
