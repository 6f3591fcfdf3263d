"""`lorafleet bench`: replay a synthetic multi-adapter workload and print a summary table.

In-process by default: a random Llama and random PEFT adapters are written to
--workdir (reused across runs). With --url it streams the workload from a running
`lorafleet serve` (or another OpenAI-compatible server) instead. The workload names its
adapters lora-0000, lora-0001, ...; the server must serve adapters of those names, or
--adapter-names maps them onto the names it does serve (the adapter with the most requests
onto the first name, and so on), or --base-fraction 1 sends every request to the base.
Over HTTP the adapter pool counters (swaps, cache hits) are not measured: read them from
the server's /metrics.
benchmarks/serve.py runs the full suite with baselines and plots.

Off the CPU (cuda, npu, or auto resolving to either) the timed in-process run follows one
untimed run of the same requests, all arriving at once: the first launch of each Triton
kernel variant compiles it, which on an H200 made single steps of the first run take 0.7-1.6 s.
The CPU backend compiles nothing and starts timing at once.

Everything that can be checked before the run is (flags, the workload file, the engine
configuration, the backend and its capability limits, --json's folder, and that --json names no
existing file unless --force), before any synthetic weights are written. With --url the server's model list (GET /v1/models) is read before any
request is sent, and the run is refused when a model name a request would use (each adapter,
after --adapter-names; the base; --base-model) is not served, or when a request may not fit
its model card's max_model_len. Prompts are counted by the server's own tokenizer through its
POST /tokenize (lorafleet's and vLLM's route), one call per distinct prompt. A server without
that route gets a bound instead: at most one token per UTF-8 byte plus PROMPT_SPECIAL_TOKENS
(2: a BOS and a leading word marker), an upper bound for character-level, byte-level BPE and
SentencePiece tokenizers but about three times a subword tokenizer's count of the workload's
random words; --no-length-check skips the check for such a server whose tokenizer packs
several characters per token. A card without max_model_len is not checked. A flag the chosen
mode would ignore is an error, not a no-op.

Exit codes: 0 every request succeeded; 1 the run finished but some requests failed (the
first distinct errors are printed to stderr); 2 bad input or setup (an invalid or ignored
flag, an unreadable workload, an unavailable device, a server that cannot be reached), with
one line `lorafleet bench: <flag or file>: <reason>` on stderr; 130 stopped with Ctrl-C (no
summary or --json written).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

from runtime.bench.machine import describe as describe_machine
from runtime.bench.workload import given_flags
from runtime.file_mode import new_file_mode

EXIT_OK, EXIT_REQUESTS_FAILED, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130  # 130: 128 + SIGINT, as a shell reports Ctrl-C
DEFAULT_WORKDIR = Path.home() / ".cache" / "lorafleet-bench"
SHOWN_ERRORS = 3  # distinct request errors printed when some requests fail
LONG_REPLAY_S = 60.0  # arrivals spread over at least this long get a notice before the run (the bar alone looks stuck)

EPILOG = """\
exit codes:
  0  every request succeeded
  1  the run finished but some requests failed (the first distinct errors go to stderr)
  2  bad input or setup: an invalid flag, a flag the chosen mode ignores, an unreadable
     workload file, an unavailable device, a server that cannot be reached, a server that
     does not serve a model the workload names, a request that may not fit the server's
     max_model_len; no request is sent to the server (only GET /v1/models)
  130  stopped with Ctrl-C: no summary or --json written

with --url: GET URL/v1/models must list every model the workload sends to. The generated
workload names its adapters lora-0000, lora-0001, ...: serve adapters of those names, or map
them onto the served ones with --adapter-names (e.g. against `lorafleet serve`'s demo:
--adapter-names upper,reverse,rot13), or send every request to the base with --base-fraction 1.
Every request's prompt + output must fit the card's max_model_len; prompts are counted by the
server's POST /tokenize, or as one token per byte plus 2 where it has none (an upper bound;
--no-length-check skips this).
"""

# Flags that only the in-process engine uses: with --url the server's own settings apply.
ENGINE_FLAGS = ("--device", "--dtype", "--hidden", "--layers", "--max-loras", "--max-cpu-loras", "--max-cpu-lora-bytes", "--workdir")
URL_ONLY_FLAGS = ("--base-model", "--api-key", "--adapter-names", "--no-length-check")
# For a server without POST /tokenize, prompt tokens are bounded by one per UTF-8 byte plus this many
# (a BOS and SentencePiece's leading word marker; see the module docstring).
PROMPT_SPECIAL_TOKENS = 2
# A generated prompt's words are 2 to 6 lowercase letters joined by single spaces (runtime/bench/workload.py):
# W words take at most 7 * W - 1 bytes. Used only to suggest an --input-len that fits.
MAX_WORD_BYTES = 7


class SetupError(Exception):
    """Bad input or setup, found before or instead of the run: ``<where>: <reason>``, exit 2."""

    def __init__(self, where: str, reason: str) -> None:
        super().__init__(reason if reason.startswith((f"{where} ", f"{where}:")) else f"{where}: {reason}")


def parse_names(text: str) -> tuple[str, ...]:
    """``--adapter-names``: comma-separated, distinct, non-empty names."""
    names = tuple(n.strip() for n in text.split(","))
    if not all(names):
        raise ValueError(f"expected comma-separated adapter names like upper,reverse,rot13, got {text!r}")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"each name at most once (one served adapter per workload adapter); repeated: {', '.join(repeated)}")
    return names


def add_arguments(p: argparse.ArgumentParser) -> None:
    from runtime.bench.workload import Given, _arg_type, add_spec_arguments
    from runtime.byte_size import parse_byte_size

    p.formatter_class = argparse.RawDescriptionHelpFormatter  # keep the epilog's lines
    p.epilog = EPILOG
    add_spec_arguments(p)
    engine = "; not with --url"
    p.add_argument("--device", choices=["auto", "cpu", "cuda", "npu"], default="cpu", action=Given,
                   help=f"engine device; auto picks cuda, then npu, then cpu{engine} (default: %(default)s)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32", action=Given,
                   help=f"weights and compute dtype{engine} (default: %(default)s)")
    p.add_argument("--hidden", type=int, metavar="N", default=512, action=Given, help=f"synthetic model hidden size{engine} (default: %(default)s)")
    p.add_argument("--layers", type=int, metavar="N", default=4, action=Given, help=f"synthetic model layers{engine} (default: %(default)s)")
    p.add_argument("--max-loras", type=int, metavar="N", default=8, action=Given, help=f"distinct adapters in one step (device slots){engine} (default: %(default)s)")
    p.add_argument("--max-cpu-loras", type=int, metavar="N", default=None, action=Given,
                   help=f"host-tier adapters, at least --max-loras{engine} (default: max(32, --max-loras), or none with --max-cpu-lora-bytes alone)")
    p.add_argument("--max-cpu-lora-bytes", metavar="SIZE", type=_arg_type(parse_byte_size), default=None, action=Given,
                   help=f"host-tier bound in bytes of adapter weights, e.g. 512M, 2G (binary units) or bytes; with --max-cpu-loras both hold{engine} "
                        "(default: none, only --max-cpu-loras bounds the host tier)")
    p.add_argument("--workdir", metavar="DIR", default=str(DEFAULT_WORKDIR), action=Given,
                   help=f"where the synthetic model and adapters are written, and reused by later runs{engine} (default: %(default)s)")
    p.add_argument("--workload", metavar="FILE",
                   help="replay this JSONL workload (python -m runtime.bench.workload --out FILE) instead of generating one; "
                        "the workload flags above are then refused (default: generate from them)")  # fmt: skip
    p.add_argument("--url", metavar="URL", help="benchmark a running `lorafleet serve` (or another OpenAI-compatible server) at this URL, its root "
                                 "(http://HOST:PORT, without the /v1 an OpenAI client's base_url ends in), instead of an "
                                 "in-process engine. Before any request is sent, GET URL/v1/models must list every model the workload "
                                 "uses: the base, and its adapters lora-0000, lora-0001, ... (or the --adapter-names they map onto); "
                                 "and each request's prompt + output must fit the card's max_model_len. Otherwise exit 2 "
                                 "(default: in-process)")  # fmt: skip
    p.add_argument("--base-model", metavar="NAME", action=Given, help="with --url: the served base model's name (default: the /v1/models entry with "
                                                      "parent null, else the first entry)")  # fmt: skip
    p.add_argument("--api-key", metavar="KEY", action=Given, help="with --url: the server's bearer key (default: none)")
    p.add_argument("--adapter-names", type=_arg_type(parse_names), metavar="NAME,NAME,...", action=Given,
                   help="with --url: send the workload's adapters as these served adapters, one name per adapter: the adapter "
                        "with the most requests goes to the first name, the next to the second, and so on (ties: lora-0000 "
                        "first). Sets --adapters to the number of names (giving another --adapters, or a --workload with "
                        "another number of adapters, is an error). E.g. --adapter-names upper,reverse,rot13 for the demo "
                        "server (default: the workload's own names, lora-0000, ...)")  # fmt: skip
    p.add_argument("--no-length-check", action="store_true",
                   help="with --url: do not refuse requests that may exceed the server's max_model_len. The check counts "
                        "prompts with the server's POST /tokenize; a server without it gets one token per prompt byte plus "
                        f"{PROMPT_SPECIAL_TOKENS}, an upper bound several times a subword tokenizer's count (default: checked)")  # fmt: skip
    p.add_argument("--slo-ttft", type=float, metavar="SECONDS", default=2.0, help="SLO on time to first token, seconds (default: %(default)s)")
    p.add_argument("--slo-tpot", type=float, metavar="SECONDS", default=0.5, help="SLO on time per output token, seconds (default: %(default)s)")
    p.add_argument("--json", metavar="PATH", help="also write the workload spec and the full summary as JSON here; an existing file "
                                                  "is refused unless --force (default: not written)")  # fmt: skip
    p.add_argument("--force", action="store_true", help="let --json replace an existing file, never the --workload file (default: refuse an existing file)")


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except SetupError as err:
        print(f"lorafleet bench: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:  # Ctrl-C: one line, not the engine threads' tracebacks; nothing was written
        print("\nlorafleet bench: interrupted; no summary or --json written", file=sys.stderr)
        return EXIT_INTERRUPTED


def _ignored_flags(args: argparse.Namespace) -> list[str]:
    """One line per typed flag that this combination of flags would ignore."""
    from runtime.bench.workload import ignored_spec_flags

    given = given_flags(args)
    problems = ignored_spec_flags(args)
    if args.url:
        problems += [f"{f}: not used with --url (the server's own settings apply)" for f in ENGINE_FLAGS if f in given]
    else:
        problems += [f"{f}: only used with --url" for f in URL_ONLY_FLAGS if f in given or (f == "--no-length-check" and args.no_length_check)]
    if args.url and args.adapter_names and not args.workload:
        if "--adapters" in given and args.adapters != len(args.adapter_names):
            problems.append(f"--adapter-names: gives {len(args.adapter_names)} names but --adapters is {args.adapters}; give one name "
                            "per adapter, or drop --adapters (it defaults to the number of names)")  # fmt: skip
        if args.popularity == "identical" and len(args.adapter_names) > 1 and args.base_fraction < 1:
            problems.append(f"--adapter-names: gives {len(args.adapter_names)} names but --popularity identical sends every request to "
                            "one adapter; give one name, or another --popularity")  # fmt: skip
    return problems


def check_output_file(path_text: str, flag: str = "--json", force: bool = False, inputs: Sequence[str] = ()) -> Path:
    """A file path that can be written: not a folder, in a folder that exists and is writable;
    not an existing file unless ``force``, and never one of ``inputs`` (the file being read)."""
    path = Path(path_text)
    folder = path.parent
    if path.is_dir():
        raise SetupError(f"{flag} {path_text}", "is a folder; give a file path")
    if path.exists():
        for given in inputs:
            if Path(given).exists() and path.samefile(given):
                raise SetupError(f"{flag} {path_text}", f"is the input file {given}; write elsewhere")
        if not force:
            raise SetupError(f"{flag} {path_text}", "already exists; choose a new file or pass --force to replace it")
    if not folder.is_dir():
        raise SetupError(f"{flag} {path_text}", f"{folder} is a file, not a folder" if folder.exists() else f"folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise SetupError(f"{flag} {path_text}", f"folder {folder} is not writable")
    return path


SYNTHETIC_PROMPT_SPECIAL_TOKENS = 1  # the synthetic model's byte-level tokenizer puts a bos in front, nothing else


def _check_fits(args: argparse.Namespace, workload: Any, max_model_len: int) -> None:
    """Every request's prompt + output fits the synthetic model's context. Its tokenizer is
    byte-level without merges: a prompt is its UTF-8 bytes + the bos."""
    def need(r: Any) -> int:
        return len(r.prompt.encode()) + SYNTHETIC_PROMPT_SPECIAL_TOKENS + r.output_tokens

    worst = max(workload.requests, key=lambda r: (need(r), -r.index))
    if need(worst) > max_model_len:
        over = sum(1 for r in workload.requests if need(r) > max_model_len)
        where = f"--workload {args.workload}" if args.workload else "--input-len/--output-len"
        raise SetupError(where, f"{over} of {len(workload.requests)} requests do not fit the synthetic model's max_model_len {max_model_len}: "
                                f"request {worst.index} needs {need(worst)} tokens (a {len(worst.prompt.encode())}-byte prompt on its byte-level "
                                f"tokenizer, its bos, and {worst.output_tokens} output tokens); use shorter prompts or outputs")  # fmt: skip


def check_workdir(path_text: str) -> None:
    """The folder the synthetic model and adapters are written to (and reused from) is a folder
    that can be written, or can be created under the nearest folder that exists. Nothing is
    created here: a refused run writes nothing."""
    flag = f"--workdir {path_text}"
    path = Path(path_text).absolute()
    try:
        existing = next(p for p in (path, *path.parents) if p.exists() or p.is_symlink())
        if existing.is_symlink() and not existing.exists():
            raise SetupError(flag, f"{existing} is a symlink to nothing")
        if not existing.is_dir():
            raise SetupError(flag, "is a file, not a folder" if existing == path else f"cannot be created: {existing} is a file")
    except OSError as err:  # e.g. a parent folder this user may not enter
        raise SetupError(flag, f"cannot be checked: {err.strerror or err}") from None
    if not os.access(existing, os.W_OK | os.X_OK):
        raise SetupError(flag, "is not writable" if existing == path else f"cannot be created: {existing} is not writable")


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


def _damaged_cache_errors() -> tuple[type[Exception], ...]:
    from runtime.lora.adapter import AdapterError
    from runtime.models.hf_config import ModelConfigError
    from runtime.models.loader import CheckpointError

    return CheckpointError, ModelConfigError, AdapterError


def _damaged_cache(args: argparse.Namespace, err: Exception) -> SetupError:
    """The synthetic model or an adapter that an earlier run left in --workdir does not load (a
    truncated file, an edited config): say which, and how to get fresh ones."""
    return SetupError(f"--workdir {args.workdir}", f"a file an earlier run left there does not load ({err}); delete it, or the "
                                                   "whole folder, and the next run writes it again")  # fmt: skip


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
    from runtime.byte_size import format_byte_size
    from runtime.capabilities import CapabilityError, check_adapter, check_engine_config
    from runtime.config import ConfigError

    try:
        shape = LlamaShape.sized(args.hidden, args.layers)
    except ValueError as err:
        raise SetupError("--layers" if args.layers < 1 else "--hidden", str(err)) from None
    try:
        # Bytes alone leave the entries uncounted (EngineConfig.host_tier_size): no default count then.
        bytes_alone = args.max_cpu_lora_bytes is not None and args.max_cpu_loras is None
        host_cpu_loras = None if bytes_alone else host_tier_size(args.max_loras, args.max_cpu_loras)
    except ValueError as err:  # "--max-cpu-loras N is below --max-loras M: ..."
        raise SetupError("--max-cpu-loras", str(err)) from None
    ranks = sorted(set(workload.spec.ranks) | set(workload.adapter_ranks.values()))
    _check_fits(args, workload, shape.max_position_embeddings)
    check_workdir(args.workdir)
    setup = BenchSetup(Path(args.workdir), shape, args.device, args.dtype, args.max_loras, host_cpu_loras,
                       max_lora_rank=max(64, *ranks), slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot,
                       max_cpu_lora_bytes=args.max_cpu_lora_bytes)  # fmt: skip
    flag_of = {"device": "--device", "dtype": "--dtype", "max_loras": "--max-loras", "max_cpu_loras": "--max-cpu-loras",
               "max_cpu_lora_bytes": "--max-cpu-lora-bytes", "max_lora_rank": _ranks_source(args)}  # fmt: skip
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
    largest = shape.adapter_nbytes(max(ranks), setup.targets)
    if args.max_cpu_lora_bytes is not None and largest > args.max_cpu_lora_bytes:  # the engine would refuse it at registration
        raise SetupError("--max-cpu-lora-bytes", f"the workload's rank-{max(ranks)} adapters take {format_byte_size(largest)} ({largest} bytes) each, "
                                                 f"more than the whole host tier may hold ({args.max_cpu_lora_bytes} bytes); raise it or lower {_ranks_source(args)}")
    config = config.for_backend(backend_name)  # the device's default step budget, recorded in --json's setup block
    setup = dataclasses.replace(setup, max_num_batched_tokens=config.max_num_batched_tokens)
    try:
        check_engine_config(config, backend_name)
    except CapabilityError as err:
        text = str(err)
        where = next((flag for key, flag in flag_of.items() if f"{key}=" in text), "--dtype" if "dtype '" in text else f"--device {args.device}")
        raise SetupError(where, text) from None
    return setup


def _check_url(args: argparse.Namespace) -> tuple[str, list[dict[str, Any]]]:
    """The base model's name and the server's model cards, once the server answered its model list."""
    from urllib.parse import urlsplit, urlunsplit

    try:
        parts = urlsplit(args.url)
    except ValueError as err:  # e.g. an unclosed [IPv6 bracket
        raise SetupError(f"--url {args.url}", str(err)) from None
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise SetupError(f"--url {args.url}", "expected http://HOST:PORT or https://HOST:PORT")
    if parts.path.rstrip("/").endswith("/v1"):  # an OpenAI client's base_url: every route would get a second /v1
        root = urlunsplit(parts._replace(path=parts.path.rstrip("/").removesuffix("/v1")))
        raise SetupError(f"--url {args.url}", f"give the server's root, without /v1 (bench adds /v1/models, /v1/completions and "
                                              f"/tokenize itself): --url {root}")
    try:
        import httpx
    except ImportError as err:
        raise SetupError("--url", f"needs the httpx package, which failed to import ({err}); pip install httpx") from None
    from runtime.bench.replay import base_model_of, served_models

    try:
        cards = served_models(args.url, args.api_key)
    except httpx.HTTPStatusError as err:
        hint = {401: " (check --api-key)" if args.api_key else " (the server wants a key: pass --api-key)",
                404: " (is this a lorafleet/OpenAI-compatible server?)"}.get(err.response.status_code, "")  # fmt: skip
        raise SetupError(f"--url {args.url}", f"{err}{hint}") from None
    except httpx.HTTPError as err:
        raise SetupError(f"--url {args.url}", f"{type(err).__name__}: {err or 'no detail'}") from None
    except (httpx.InvalidURL, ValueError) as err:
        raise SetupError(f"--url {args.url}", str(err)) from None
    return args.base_model or base_model_of(cards), cards


def _adapter_mapping(args: argparse.Namespace, workload: Any) -> dict[str, str]:
    """--adapter-names as workload adapter -> served name: by request count, most first; ties in
    the workload's order (lora-0000 first). Refuses a count other than the workload's adapters,
    and a workload in which no request names an adapter (the flag would do nothing)."""
    names = args.adapter_names
    adapters = list(workload.adapter_ranks)
    if len(names) != len(adapters):  # a generated workload has len(names) adapters unless --adapters said otherwise (refused earlier)
        raise SetupError("--adapter-names", f"gives {len(names)} names but --workload {args.workload} has {len(adapters)} adapters "
                                            f"({', '.join(adapters[:4])}{', ...' if len(adapters) > 4 else ''}); give one name per adapter")  # fmt: skip
    counts = {a: 0 for a in adapters}
    for r in workload.requests:
        if r.adapter is not None:
            counts[r.adapter] += 1
    if not any(counts.values()):
        why = f"--base-fraction {args.base_fraction:g}" if not args.workload else f"--workload {args.workload}"
        raise SetupError("--adapter-names", f"not used: every request names the base model ({why})")
    by_popularity = sorted(adapters, key=lambda a: (-counts[a], adapters.index(a)))
    return dict(zip(by_popularity, names))


def _models_text(cards: list[dict[str, Any]]) -> str:
    from runtime.bench.replay import base_model_of

    base = base_model_of(cards)
    ids = [str(c["id"]) for c in cards]
    shown = [f"{i} (base)" if i == base else i for i in ids[:8]]
    return ", ".join(shown) + (f", ... ({len(ids)} in all)" if len(ids) > 8 else "")


def _check_served(args: argparse.Namespace, workload: Any, mapping: dict[str, str], base: str, cards: list[dict[str, Any]]) -> list[Any]:
    """The requests as they will be sent (adapters renamed by ``mapping``), once every model name
    they use is served and each fits its card's max_model_len (see PROMPT_SPECIAL_TOKENS)."""
    from dataclasses import replace

    served = {str(c["id"]): c for c in cards}
    where_url = f"--url {args.url}"
    if args.base_model and args.base_model not in served:
        raise SetupError(f"--base-model {args.base_model}", f"not served by {args.url} (GET /v1/models lists: {_models_text(cards)})")
    unserved_names = [n for n in (args.adapter_names or ()) if n not in served]
    if unserved_names:
        raise SetupError("--adapter-names", f"{', '.join(unserved_names)}: not served by {args.url} (GET /v1/models lists: "
                                            f"{_models_text(cards)})")  # fmt: skip
    if args.adapter_names and base in args.adapter_names:
        raise SetupError("--adapter-names", f"{base} is the base model, not an adapter; name served adapters only")
    requests = [replace(r, adapter=mapping.get(r.adapter, r.adapter)) if r.adapter is not None else r for r in workload.requests]
    used: list[str] = []
    for r in requests:
        if r.adapter is not None and r.adapter not in used:
            used.append(r.adapter)
    missing = sorted(a for a in used if a not in served)
    if missing:
        offered = [str(c["id"]) for c in cards if c["id"] != base and c.get("parent", base) is not None]
        n = len(workload.adapter_ranks)
        if not offered:
            fix = "the server lists no adapters: load some, or pass --base-fraction 1 to send every request to the base (without --adapters, --ranks, --popularity, --alpha)"
        elif args.workload:
            fix = (f"map them onto served adapters with --adapter-names {','.join(offered[:n])}" if len(offered) >= n else
                   f"it has {len(offered)} adapters for the workload's {n}: write a workload with --adapters {len(offered)} and pass "
                   f"--adapter-names {','.join(offered)}")  # fmt: skip
        else:
            fix = f"{_adapter_names_fix(args, offered, n)}, or pass --base-fraction 1 (without --adapters, --ranks, --popularity, --alpha)"
        raise SetupError(where_url, f"does not serve the adapter{'s' if len(missing) > 1 else ''} {', '.join(missing[:4])}"
                                    f"{', ...' if len(missing) > 4 else ''} that the workload's requests name (GET /v1/models lists: "
                                    f"{_models_text(cards)}); {fix}")  # fmt: skip
    if not args.no_length_check:
        check_lengths(args, requests, base, served)
    return requests


def _adapter_names_fix(args: argparse.Namespace, offered: list[str], n: int) -> str:
    """The --adapter-names that maps a generated workload of ``n`` adapters onto the served ones
    (``offered``), worded so that the command it gives works: one name with --popularity identical
    (every request uses one adapter), else as many as are served, up to ``n``. --adapter-names sets
    the number of adapters, so an --adapters the user typed is named only where the names change it
    (it would then refuse the names)."""
    names = offered[:1] if args.popularity == "identical" else offered[:n]
    fix = f"map them onto served adapters with --adapter-names {','.join(names)}"
    if "--adapters" in given_flags(args) and args.adapters != len(names):
        fix += f" in place of --adapters {args.adapters}"
    return fix


def check_lengths(args: argparse.Namespace, requests: list[Any], base: str, served: dict[str, dict[str, Any]]) -> None:
    """Every request's prompt + output must fit the max_model_len its model's card gives (``args``:
    url, api_key, workload, and input_len/output_len as (lo, hi) pairs; a SetupError otherwise). Prompts
    are counted by the server's POST /tokenize when it has one (exact), else bounded by one token
    per byte plus PROMPT_SPECIAL_TOKENS."""
    from runtime.bench.replay import prompt_token_counts

    if not any(type(served[r.adapter or base].get("max_model_len")) is int for r in requests):
        return  # cards without max_model_len (an OpenAI-style server): nothing to check against
    exact = prompt_token_counts(args.url, base, [r.prompt for r in requests], args.api_key)
    too_long = []  # (tokens over the limit, request, prompt tokens or bound, limit, model)
    for r in requests:
        model = r.adapter or base
        limit = served[model].get("max_model_len")
        if type(limit) is not int or limit < 1:  # a card without one: not checked
            continue
        prompt = exact[r.prompt] if exact is not None else len(r.prompt.encode()) + PROMPT_SPECIAL_TOKENS
        if prompt + r.output_tokens > limit:
            too_long.append((prompt + r.output_tokens - limit, r, prompt, limit, model))
    if not too_long:
        return
    _, r, prompt, limit, model = max(too_long, key=lambda t: (t[0], -t[1].index))
    where = f"--workload {args.workload}" if args.workload else "--input-len/--output-len"
    if args.workload:
        fix = "write a workload with shorter prompts or outputs (python -m runtime.bench.workload --input-len / --output-len)"
    else:
        (in_lo, _), (_, out_hi) = args.input_len, args.output_len  # parsed: the workload was generated from them
        words = (limit - PROMPT_SPECIAL_TOKENS + 1 - out_hi) // MAX_WORD_BYTES  # most words that always fit
        fix = (f"lower --input-len (prompt words) or --output-len; e.g. --input-len {min(in_lo, words)},{words} always fits with "
               f"--output-len up to {out_hi}" if words >= 1 else f"lower --output-len (its maximum {out_hi} leaves no room for a prompt)")  # fmt: skip
    if exact is not None:  # the suggestion comes from the byte bound: it fits wherever that bound holds (character-level, byte-level BPE, SentencePiece)
        raise SetupError(where, f"{len(too_long)} of {len(requests)} requests do not fit the server's max_model_len (prompt + output); "
                                f"the furthest over, request {r.index}, has a {prompt}-token prompt (counted by the server's /tokenize) "
                                f"+ {r.output_tokens} output tokens > {limit} for {model}: {fix}")  # fmt: skip
    raise SetupError(where,
                     f"{len(too_long)} of {len(requests)} requests may not fit the server's max_model_len (prompt + output); the "
                     f"furthest over, request {r.index}, has a {prompt - PROMPT_SPECIAL_TOKENS}-byte prompt (counted as up to {prompt} "
                     f"tokens) + {r.output_tokens} output tokens > {limit} for {model}: {fix}, or pass --no-length-check if the "
                     "server's tokenizer packs several characters per token")  # fmt: skip


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


def duration_text(seconds: float) -> str:
    """``seconds`` for people: "45 s", "12 min", "3.5 h", "2.1 days"."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def _run(args: argparse.Namespace) -> int:
    import asyncio

    from runtime.progress_bar import ProgressBar

    problems = _ignored_flags(args)
    if problems:
        for line in problems:
            print(f"lorafleet bench: {line}", file=sys.stderr)
        return EXIT_BAD_INPUT
    for flag, value in (("--slo-ttft", args.slo_ttft), ("--slo-tpot", args.slo_tpot)):
        if not 0 < value < float("inf"):
            raise SetupError(flag, f"must be a positive number of seconds, got {value}")
    if args.force and not args.json:
        raise SetupError("--force", "only applies to --json, which was not given")
    json_path = check_output_file(args.json, force=args.force, inputs=[args.workload] if args.workload else []) if args.json else None
    if args.url and args.adapter_names and not args.workload and "--adapters" not in given_flags(args):
        args.adapters = len(args.adapter_names)  # one adapter per name (a different --adapters was refused above)
    workload = _load_workload(args)
    if args.url:
        mapping = _adapter_mapping(args, workload) if args.adapter_names else {}
        base, cards = _check_url(args)
        requests = _check_served(args, workload, mapping, base, cards)
        setup = None
    else:
        setup = _check_engine(args, workload)

    from runtime.bench.replay import replay_http
    from runtime.bench.suite import full_warmup_device, prepare, run_lorafleet
    from runtime.bench.summary import fairness, summarize, table, ttft_by_adapter
    from runtime.capabilities import CapabilityError
    from runtime.config import ConfigError
    from runtime.torch_threads import in_fresh_thread
    from backends import BackendUnavailable

    damaged_cache_errors = _damaged_cache_errors()
    if setup is not None:
        used = len({r.adapter for r in workload.requests if r.adapter is not None})
        print(f"preparing the synthetic model and the {used} adapters the requests use in {setup.workdir} (reused by later runs)...",
              file=sys.stderr, flush=True)  # fmt: skip
        # Not on this thread: its OpenMP team would slow the engine's steps (runtime/torch_threads.py).
        try:
            model_dir, adapters = in_fresh_thread(prepare)(workload, setup)
        except OSError as err:  # a read-only or pseudo file system, a full disk: what the up-front check cannot see
            raise SetupError(f"--workdir {args.workdir}", f"cannot write the synthetic weights: {err.strerror or err}") from None
        device = full_warmup_device(setup.device)
        if device is not None:
            print(f"warming up on {device}: one untimed run of the {len(workload.requests)} requests, all at once "
                  "(each kernel variant compiles on its first launch)...", file=sys.stderr, flush=True)
            try:
                run_lorafleet(workload.all_at_once(), setup, model_dir, adapters, label="warm-up")
            except (ConfigError, CapabilityError, BackendUnavailable) as err:
                raise SetupError("engine setup", f"{type(err).__name__}: {err}") from None
            except damaged_cache_errors as err:
                raise _damaged_cache(args, err) from None
    if workload.arrival_span_s >= LONG_REPLAY_S:
        hint = "" if args.workload else "; a higher --rate shortens it"
        print(f"the requests arrive over {duration_text(workload.arrival_span_s)}, so the run takes at least that long "
              f"(Ctrl-C stops it{hint})", file=sys.stderr, flush=True)
    bar = ProgressBar(len(workload.requests), "requests", "req")
    try:
        if setup is None:
            result = asyncio.run(replay_http(args.url, base, requests, "lorafleet-http", args.api_key, progress=bar.update))
        else:
            try:
                result = run_lorafleet(workload, setup, model_dir, adapters, progress=bar.update)
            except (ConfigError, CapabilityError, BackendUnavailable) as err:  # checked above; the engine has the last word
                raise SetupError("engine setup", f"{type(err).__name__}: {err}") from None
            except damaged_cache_errors as err:
                raise _damaged_cache(args, err) from None
    finally:
        bar.close()
    summary = summarize(result, args.slo_ttft, args.slo_tpot)
    summary["fairness"] = fairness(ttft_by_adapter(result.records))
    spec = workload.spec
    where = (f"against {args.url} (base model {base})" if setup is None else
             f"in-process on {setup.device} ({setup.dtype}; synthetic llama, hidden {setup.shape.hidden_size} x {setup.shape.num_hidden_layers} "
             f"layers; max_loras {setup.max_loras})")  # fmt: skip
    arrivals = "all at once" if spec.rate <= 0 else f"at {spec.rate:g}/s"
    print(f"{len(workload.requests)} requests, arriving {arrivals}, {where}: {summary['prompt_tokens']} prompt and "
          f"{summary['output_tokens']} output tokens in {summary['wall_s']:.1f} s; tok/s = output tokens / that time")
    print(table([summary]))
    print(f"SLO: share of requests with TTFT <= {args.slo_ttft:g} s and TPOT <= {args.slo_tpot:g} s (--slo-ttft, --slo-tpot)")
    fair = summary["fairness"]
    if fair is not None and fair["ratio"] is not None:
        print(f"fairness: p99 TTFT of the least popular adapter / the most popular = {fair['ratio']:.2f} "
              f"({', '.join(fair['least_popular'][:3])}{', ...' if len(fair['least_popular']) > 3 else ''} / {', '.join(fair['most_popular'])})")
    if summary["cache"]["device_hit_rate"] is not None:
        print(f"adapter device hit rate {summary['cache']['device_hit_rate']:.2f}, swaps {summary['adapter_swaps']}")
    elif args.url:
        print("adapter swaps and cache hits: not measured over HTTP (see the server's /metrics)")
    if json_path is not None:
        spec_block = {"spec": workload.spec.__dict__, **({"adapter_names": mapping} if args.url and mapping else {})}
        if setup is None:
            ran = {"url": args.url, "base_model": base}
        else:
            ran = {"device": setup.device, "dtype": setup.dtype, "hidden_size": setup.shape.hidden_size, "layers": setup.shape.num_hidden_layers,
                   "max_loras": setup.max_loras, "max_cpu_loras": setup.max_cpu_loras, "max_cpu_lora_bytes": setup.max_cpu_lora_bytes,
                   "max_lora_rank": setup.max_lora_rank,
                   "max_num_seqs": setup.max_num_seqs, "max_num_batched_tokens": setup.max_num_batched_tokens,
                   "workdir": str(setup.workdir)}  # fmt: skip
        # The machine only for an in-process run: over --url the server's machine is not known here.
        machine_block = {} if setup is None else {"machine": describe_machine()}
        _write_json(json_path, {"workload": spec_block, "setup": ran, **machine_block, "summary": summary})
        print(f"wrote {json_path}")
    _report_failures(result.records)
    return EXIT_OK if summary["requests_failed"] == 0 else EXIT_REQUESTS_FAILED
