"""S-LoRA / Punica-style synthetic workloads, saved as JSONL so every system sees the same requests.

A workload is a list of requests, each with an arrival time, an adapter (or none),
its rank, a prompt and an output length. Parameters:

- ``num_adapters`` and ``popularity``: ``identical`` (every request uses adapter 0),
  ``distinct`` (request i uses adapter i mod n), ``uniform``, or ``zipf`` with ``alpha``
  (P(adapter k) proportional to 1 / (k+1)^alpha);
- ``ranks``: each adapter's rank, drawn once from this set;
- arrivals: a Gamma process with mean rate ``rate`` (req/s) and coefficient of
  variation ``cv`` (cv = 1 is Poisson; cv > 1 is burstier); ``rate <= 0`` means all at t=0;
- input / output lengths: uniform integers in ``[lo, hi]``;
- ``base_fraction``: share of requests that name no adapter;
- ``seed``: everything above is reproducible.

Prompts are made of random lowercase words so every tokenizer accepts them; the
output length is enforced with ``ignore_eos`` by the drivers.
"""
from __future__ import annotations

import argparse
import json
import math
import random
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Sequence

POPULARITIES = ("identical", "distinct", "uniform", "zipf")
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


@dataclass(frozen=True)
class WorkloadSpec:
    num_requests: int = 64
    num_adapters: int = 8
    popularity: str = "zipf"
    alpha: float = 1.0
    ranks: tuple[int, ...] = (8, 16, 32, 64)
    rate: float = 4.0
    cv: float = 1.0
    input_len: tuple[int, int] = (8, 32)
    output_len: tuple[int, int] = (8, 32)
    base_fraction: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.popularity not in POPULARITIES:
            raise ValueError(f"popularity: {self.popularity!r} is not one of {', '.join(POPULARITIES)}")
        for name in ("num_requests", "num_adapters"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("alpha", "rate", "cv"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name}: must be a finite number, got {getattr(self, name)}")
        if self.alpha < 0:
            raise ValueError(f"alpha: must be >= 0, got {self.alpha} (0 is uniform popularity; a negative exponent would make the "
                             "last adapter the most popular)")  # fmt: skip
        if self.cv <= 0:
            raise ValueError(f"cv: must be > 0, got {self.cv}")
        if not 0.0 <= self.base_fraction <= 1.0:
            raise ValueError(f"base_fraction: must be in [0, 1], got {self.base_fraction}")
        for name in ("input_len", "output_len"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name}: need 1 <= lo <= hi, got {(lo, hi)}")
        if not self.ranks or min(self.ranks) < 1:
            raise ValueError(f"ranks: need positive ranks, got {self.ranks}")


@dataclass(frozen=True)
class WorkloadRequest:
    index: int
    arrival_s: float
    adapter: str | None
    rank: int | None
    prompt: str
    input_words: int
    output_tokens: int


@dataclass(frozen=True)
class Workload:
    spec: WorkloadSpec
    adapter_ranks: dict[str, int]
    requests: tuple[WorkloadRequest, ...] = field(default_factory=tuple)

    def save(self, path: str | Path) -> None:
        """JSONL: a header line with the spec, the adapter ranks and the number of request lines
        that follow (so a file cut short is caught on load), then one line per request."""
        header = {"spec": asdict(self.spec), "adapter_ranks": self.adapter_ranks, "request_lines": len(self.requests)}
        with open(path, "w") as f:
            f.write(json.dumps(header) + "\n")
            for r in self.requests:
                f.write(json.dumps(asdict(r)) + "\n")

    @property
    def arrival_span_s(self) -> float:
        """Seconds from t=0 to the last request's arrival: a replay takes at least this long."""
        return max((r.arrival_s for r in self.requests), default=0.0)

    def all_at_once(self) -> "Workload":
        """The same requests, every one arriving at t=0 (an offline run)."""
        return replace(self, requests=tuple(replace(r, arrival_s=0.0) for r in self.requests))

    @classmethod
    def load(cls, path: str | Path) -> "Workload":
        """Read a file written by :meth:`save`. A malformed file is a ``ValueError`` that names the
        file, the line and what is wrong or missing; an unreadable one is the ``OSError``."""
        lines = Path(path).read_text().splitlines()
        if not lines or not lines[0].strip():
            raise ValueError(f"{path}: empty workload file (expected a JSONL header line with 'spec' and 'adapter_ranks', "
                             "then one line per request, as Workload.save writes)")
        head = _json_object(path, 1, lines[0], "the header")
        missing = [k for k in ("spec", "adapter_ranks") if k not in head]
        if missing:
            raise ValueError(f"{path}: line 1: the header lacks {' and '.join(map(repr, missing))} "
                             f"(has: {', '.join(map(repr, head)) or 'nothing'}); is this a workload file written by Workload.save?")
        spec = _spec_from_header(path, head["spec"])
        adapter_ranks = head["adapter_ranks"]
        if not isinstance(adapter_ranks, dict) or not all(
                isinstance(k, str) and type(v) is int and v >= 1 for k, v in adapter_ranks.items()):  # fmt: skip
            raise ValueError(f"{path}: line 1: adapter_ranks: expected an object of adapter name -> positive integer rank, got {adapter_ranks!r:.200}")
        requests = []
        first_line: dict[int, int] = {}  # request index -> the line that has it
        for n, line in enumerate(lines[1:], start=2):
            if not line.strip():
                continue
            request = _request_from_line(path, n, line, adapter_ranks)
            if request.index in first_line:  # replays name requests by index: two would collide in one run
                raise ValueError(f"{path}: line {n}: index: {request.index} is already the index of line {first_line[request.index]}")
            first_line[request.index] = n
            requests.append(request)
        requests = tuple(requests)
        if not requests:
            raise ValueError(f"{path}: no requests after the header line")
        expected = head.get("request_lines")  # absent in files written before it was recorded
        if expected is not None and (type(expected) is not int or expected != len(requests)):
            raise ValueError(f"{path}: the header says {expected!r} request lines follow, found {len(requests)}: the file was cut short "
                             "or edited; regenerate it, or set 'request_lines' in the header to the number of requests you kept")  # fmt: skip
        return cls(spec, dict(adapter_ranks), requests)


def _json_object(path: str | Path, n: int, line: str, what: str) -> dict:
    try:
        value = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: line {n}: {what} is not JSON ({err})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: line {n}: {what} must be a JSON object, got {type(value).__name__}")
    return value


def _spec_from_header(path: str | Path, raw: object) -> WorkloadSpec:
    known = {f.name: f for f in fields(WorkloadSpec)}
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: line 1: spec must be a JSON object, got {type(raw).__name__}")
    unknown, missing = sorted(set(raw) - set(known)), sorted(set(known) - set(raw))
    if unknown or missing:
        parts = ([f"unknown key(s) {', '.join(unknown)}"] if unknown else []) + ([f"missing key(s) {', '.join(missing)}"] if missing else [])
        raise ValueError(f"{path}: line 1: spec: {'; '.join(parts)}")
    values = dict(raw)
    for key in ("ranks", "input_len", "output_len"):
        if not isinstance(values[key], list) or not all(type(v) is int for v in values[key]) or (key != "ranks" and len(values[key]) != 2):
            want = "a list of integers" if key == "ranks" else "a list of two integers [lo, hi]"
            raise ValueError(f"{path}: line 1: spec.{key}: expected {want}, got {values[key]!r}")
        values[key] = tuple(values[key])
    for key in ("num_requests", "num_adapters", "seed"):
        if type(values[key]) is not int:
            raise ValueError(f"{path}: line 1: spec.{key}: expected an integer, got {values[key]!r}")
    for key in ("alpha", "rate", "cv", "base_fraction"):
        if type(values[key]) not in (int, float):
            raise ValueError(f"{path}: line 1: spec.{key}: expected a number, got {values[key]!r}")
    try:
        return WorkloadSpec(**values)
    except ValueError as err:
        raise ValueError(f"{path}: line 1: spec.{err}") from None


def _request_from_line(path: str | Path, n: int, line: str, adapter_ranks: dict[str, int]) -> WorkloadRequest:
    raw = _json_object(path, n, line, "the request")
    names = [f.name for f in fields(WorkloadRequest)]
    unknown, missing = sorted(set(raw) - set(names)), [k for k in names if k not in raw]
    if unknown or missing:
        parts = ([f"unknown key(s) {', '.join(unknown)}"] if unknown else []) + ([f"missing key(s) {', '.join(missing)}"] if missing else [])
        raise ValueError(f"{path}: line {n}: request: {'; '.join(parts)}")
    bad = None
    if type(raw["index"]) is not int:
        bad = f"index: expected an integer, got {raw['index']!r}"
    elif type(raw["arrival_s"]) not in (int, float) or not 0 <= raw["arrival_s"] < math.inf:
        bad = f"arrival_s: expected a number >= 0, got {raw['arrival_s']!r}"
    elif raw["adapter"] is not None and not isinstance(raw["adapter"], str):  # a list or object is unhashable: not a lookup
        bad = f"adapter: expected an adapter name (a string) or null, got {raw['adapter']!r:.80}"
    elif raw["adapter"] is not None and raw["adapter"] not in adapter_ranks:
        bad = f"adapter: {raw['adapter']!r} is not in the header's adapter_ranks"
    elif raw["rank"] != (adapter_ranks[raw["adapter"]] if raw["adapter"] is not None else None):
        want = f"{adapter_ranks[raw['adapter']]}, its adapter's rank in the header" if raw["adapter"] is not None else "null (no adapter)"
        bad = f"rank: expected {want}, got {raw['rank']!r}"
    elif not isinstance(raw["prompt"], str) or not raw["prompt"]:
        bad = f"prompt: expected a non-empty string, got {raw['prompt']!r:.80}"
    elif type(raw["output_tokens"]) is not int or raw["output_tokens"] < 1:
        bad = f"output_tokens: expected an integer >= 1, got {raw['output_tokens']!r}"
    if bad is not None:
        raise ValueError(f"{path}: line {n}: {bad}")
    return WorkloadRequest(**raw)


def adapter_name(k: int) -> str:
    return f"lora-{k:04d}"


def _choose_adapter(spec: WorkloadSpec, rng: random.Random, i: int, weights: Sequence[float]) -> int:
    if spec.popularity == "identical":
        return 0
    if spec.popularity == "distinct":
        return i % spec.num_adapters
    if spec.popularity == "uniform":
        return rng.randrange(spec.num_adapters)
    return rng.choices(range(spec.num_adapters), weights=weights)[0]


def generate(spec: WorkloadSpec) -> Workload:
    """Draw the workload. Each quantity has its own random stream seeded from ``seed``, so two
    specs that differ only in the adapter set (``num_adapters``, ``popularity``, ``alpha``,
    ``ranks``) get the same arrivals, base rows, prompts and output lengths: an adapter-count
    sweep then compares the same requests."""

    def stream(what: str) -> random.Random:
        return random.Random(f"{spec.seed}:{what}")

    rank_rng, arrival_rng, base_rng, adapter_rng, prompt_rng, output_rng = (
        stream(w) for w in ("ranks", "arrivals", "base", "adapters", "prompts", "outputs")
    )
    ranks = {adapter_name(k): rank_rng.choice(spec.ranks) for k in range(spec.num_adapters)}
    weights = [1.0 / (k + 1) ** spec.alpha for k in range(spec.num_adapters)]
    shape = 1.0 / spec.cv**2  # Gamma inter-arrivals: mean 1/rate, CV = cv
    t = 0.0
    requests = []
    for i in range(spec.num_requests):
        if spec.rate > 0 and i > 0:
            t += arrival_rng.gammavariate(shape, 1.0 / (shape * spec.rate))
        use_base = base_rng.random() < spec.base_fraction
        k = _choose_adapter(spec, adapter_rng, i, weights)
        words = prompt_rng.randint(*spec.input_len)
        prompt = " ".join("".join(prompt_rng.choice(_LETTERS) for _ in range(prompt_rng.randint(2, 6))) for _ in range(words))
        name = None if use_base else adapter_name(k)
        requests.append(WorkloadRequest(i, round(t, 6), name, None if name is None else ranks[name], prompt, words, output_rng.randint(*spec.output_len)))
    return Workload(spec, ranks, tuple(requests))


class Given(argparse.Action):
    """``store``, and remember the flag in ``namespace.given_flags``: the default stays the
    effective value (and shows in --help), yet a caller can tell a flag the user typed from one
    left at its default, and refuse a typed flag that its mode would ignore."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        given = set(getattr(namespace, "given_flags", None) or ())
        given.add(next((o for o in self.option_strings if o.startswith("--")), self.option_strings[0]))  # also for an abbreviation
        namespace.given_flags = given


def given_flags(args: argparse.Namespace) -> set[str]:
    """The flags (long names) the user typed, of those added with ``action=Given``."""
    return set(getattr(args, "given_flags", None) or ())


def parse_ranks(text: str) -> tuple[int, ...]:
    try:
        ranks = tuple(int(r) for r in text.split(","))
    except ValueError:
        raise ValueError(f"expected comma-separated integer ranks like 8,16,32, got {text!r}") from None
    return ranks


def parse_pair(text: str) -> tuple[int, int]:
    parts = text.split(",")
    try:
        lo, hi = (int(x) for x in parts)
    except ValueError:
        raise ValueError(f"expected two comma-separated integers lo,hi like 8,32, got {text!r}") from None
    return lo, hi


def _arg_type(parse):  # type: ignore[no-untyped-def]
    """argparse keeps an ArgumentTypeError's message (a ValueError's becomes 'invalid ... value')."""

    def convert(text: str):  # type: ignore[no-untyped-def]
        try:
            return parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    convert.__name__ = parse.__name__
    return convert


# WorkloadSpec field -> the flag that sets it
SPEC_FLAGS = {"num_requests": "--num-requests", "num_adapters": "--adapters", "popularity": "--popularity", "alpha": "--alpha",
              "ranks": "--ranks", "rate": "--rate", "cv": "--cv", "input_len": "--input-len", "output_len": "--output-len",
              "base_fraction": "--base-fraction", "seed": "--seed"}  # fmt: skip


def add_spec_arguments(p: argparse.ArgumentParser) -> None:
    """The workload flags. Defaults are WorkloadSpec's; each flag records its explicit use (``given_flags``)."""
    d = WorkloadSpec()
    p.add_argument("--num-requests", type=int, metavar="N", default=d.num_requests, action=Given, help="requests in the workload (default: %(default)s)")
    p.add_argument("--adapters", type=int, metavar="N", default=d.num_adapters, action=Given, help="number of adapters; not with --popularity identical (default: %(default)s)")
    p.add_argument("--popularity", choices=POPULARITIES, default=d.popularity, action=Given,
                   help="which adapter each request uses: identical (all adapter 0), distinct (round robin), uniform, or zipf "
                        "(see --alpha) (default: %(default)s)")  # fmt: skip
    p.add_argument("--alpha", type=float, metavar="X", default=d.alpha, action=Given, help="zipf exponent; only with --popularity zipf (default: %(default)s)")
    p.add_argument("--ranks", type=_arg_type(parse_ranks), metavar="R,R,...", default=",".join(map(str, d.ranks)), action=Given,
                   help="comma-separated rank set; each adapter's rank is drawn from it (default: %(default)s)")
    p.add_argument("--rate", type=float, metavar="X", default=d.rate, action=Given, help="mean arrivals per second; <= 0: all at once (default: %(default)s)")
    p.add_argument("--cv", type=float, metavar="X", default=d.cv, action=Given, help="inter-arrival coefficient of variation; 1 = Poisson; only with --rate above 0 (default: %(default)s)")
    p.add_argument("--input-len", type=_arg_type(parse_pair), metavar="LO,HI", default=",".join(map(str, d.input_len)), action=Given,
                   help="prompt words, uniform in lo,hi (default: %(default)s)")
    p.add_argument("--output-len", type=_arg_type(parse_pair), metavar="LO,HI", default=",".join(map(str, d.output_len)), action=Given,
                   help="output tokens, uniform in lo,hi (default: %(default)s)")
    p.add_argument("--base-fraction", type=float, metavar="X", default=d.base_fraction, action=Given,
                   help="share of requests that name no adapter; at 1 the adapter flags are refused (default: %(default)s)")
    p.add_argument("--seed", type=int, metavar="N", default=d.seed, action=Given, help="seed of every random draw (default: %(default)s)")


def spec_from_args(a: argparse.Namespace) -> WorkloadSpec:
    """The WorkloadSpec of parsed ``add_spec_arguments`` flags. A bad value is a ValueError that
    starts with the flag's name (``--cv: must be > 0, got 0.0``)."""
    def value(field_name: str, parse=None):  # type: ignore[no-untyped-def]
        v = getattr(a, "adapters" if field_name == "num_adapters" else field_name)
        if parse is not None and isinstance(v, str):  # argparse converts; a hand-made Namespace may hold the text
            try:
                v = parse(v)
            except ValueError as err:
                raise ValueError(f"{SPEC_FLAGS[field_name]}: {err}") from None
        return v

    try:
        return WorkloadSpec(
            num_requests=value("num_requests"), num_adapters=value("num_adapters"), popularity=value("popularity"), alpha=value("alpha"),
            ranks=value("ranks", parse_ranks), rate=value("rate"), cv=value("cv"), input_len=value("input_len", parse_pair),
            output_len=value("output_len", parse_pair), base_fraction=value("base_fraction"), seed=value("seed"),
        )
    except ValueError as err:
        name, sep, why = str(err).partition(":")
        if sep and name in SPEC_FLAGS:
            raise ValueError(f"{SPEC_FLAGS[name]}:{why}") from None
        raise


def ignored_spec_flags(a: argparse.Namespace) -> list[str]:
    """One line per typed workload flag that the other flags make meaningless (it would change no
    request): a mistake to report, not a no-op to run with. With a workload file (``a.workload``,
    where the parser has it) that is every one of them."""
    given = given_flags(a)
    if getattr(a, "workload", None):
        return [f"{f}: not used with --workload (the file fixes every request); drop it, or write a new workload "
                "with python -m runtime.bench.workload" for f in SPEC_FLAGS.values() if f in given]  # fmt: skip
    problems = []
    if "--alpha" in given and a.popularity != "zipf":
        problems.append(f"--alpha: only used with --popularity zipf, not {a.popularity}")
    if "--cv" in given and a.rate <= 0:
        problems.append(f"--cv: only used with arrivals at a --rate above 0 (at {a.rate:g} every request arrives at once)")
    if a.base_fraction > 1:
        return []  # out of range: spec_from_args says so, naming --base-fraction, not the adapter flags it would blame
    if a.base_fraction == 1:
        problems += [f"{f}: no request uses an adapter with --base-fraction {a.base_fraction:g}"
                     for f in ("--adapters", "--popularity", "--alpha", "--ranks") if f in given and not (f == "--alpha" and a.popularity != "zipf")]
    elif "--adapters" in given and a.popularity == "identical":
        problems.append("--adapters: with --popularity identical every request uses the one adapter")
    elif "--adapters" in given and a.adapters == 1:
        problems += [f"{f}: with --adapters 1 every request that uses an adapter uses the one adapter" for f in ("--popularity", "--alpha")
                     if f in given and not (f == "--alpha" and a.popularity != "zipf")]  # fmt: skip
    return problems


def offline_spec_problems(a: argparse.Namespace) -> list[str]:
    """``ignored_spec_flags``, plus ``--rate`` and ``--cv`` when typed: for scripts that submit every
    request before the first step, where arrival times are not used."""
    return ignored_spec_flags(a) + [f"{flag}: every request runs at once here (offline); arrival times are not used"
                                    for flag in ("--rate", "--cv") if flag in given_flags(a)]  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_spec_arguments(p)
    p.add_argument("--out", required=True, metavar="FILE", help="JSONL file to write; an existing file is refused unless --force")
    p.add_argument("--force", action="store_true", help="replace an existing --out file")
    a = p.parse_args()
    ignored = ignored_spec_flags(a)
    if ignored:
        p.error("; ".join(ignored))
    from runtime.commands.bench import SetupError, check_output_file  # here: that module imports this one

    try:
        out = check_output_file(a.out, "--out", force=a.force)
    except SetupError as err:
        p.error(str(err))
    try:
        w = generate(spec_from_args(a))
    except ValueError as err:
        p.error(str(err))
    w.save(out)
    used = {r.adapter for r in w.requests if r.adapter is not None}
    base = sum(1 for r in w.requests if r.adapter is None)
    print(f"wrote {len(w.requests)} requests to {a.out}: {len(used)} of the {len(w.adapter_ranks)} adapters used"
          + (f", {base} on the base model" if base else ""))


if __name__ == "__main__":
    main()
