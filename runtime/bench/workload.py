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
import random
from dataclasses import asdict, dataclass, field
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
        if self.num_requests < 1 or self.num_adapters < 1:
            raise ValueError("num_requests and num_adapters must be >= 1")
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
        """JSONL: a header line with the spec and adapter ranks, then one line per request."""
        with open(path, "w") as f:
            f.write(json.dumps({"spec": asdict(self.spec), "adapter_ranks": self.adapter_ranks}) + "\n")
            for r in self.requests:
                f.write(json.dumps(asdict(r)) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "Workload":
        lines = Path(path).read_text().splitlines()
        if not lines:
            raise ValueError(f"{path}: empty workload file")
        head = json.loads(lines[0])
        spec_values = dict(head["spec"])
        for key in ("ranks", "input_len", "output_len"):
            spec_values[key] = tuple(spec_values[key])
        requests = tuple(WorkloadRequest(**json.loads(line)) for line in lines[1:] if line.strip())
        return cls(WorkloadSpec(**spec_values), dict(head["adapter_ranks"]), requests)


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


def add_spec_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--adapters", type=int, default=8, help="number of adapters")
    p.add_argument("--popularity", choices=POPULARITIES, default="zipf")
    p.add_argument("--alpha", type=float, default=1.0, help="zipf exponent")
    p.add_argument("--ranks", default="8,16,32,64", help="comma-separated rank set")
    p.add_argument("--rate", type=float, default=4.0, help="mean arrivals per second (<= 0: all at once)")
    p.add_argument("--cv", type=float, default=1.0, help="inter-arrival coefficient of variation (1 = Poisson)")
    p.add_argument("--input-len", default="8,32", help="prompt words lo,hi")
    p.add_argument("--output-len", default="8,32", help="output tokens lo,hi")
    p.add_argument("--base-fraction", type=float, default=0.0, help="share of requests with no adapter")
    p.add_argument("--seed", type=int, default=0)


def spec_from_args(a: argparse.Namespace) -> WorkloadSpec:
    def pair(text: str) -> tuple[int, int]:
        lo, hi = (int(x) for x in text.split(","))
        return lo, hi

    return WorkloadSpec(
        num_requests=a.num_requests, num_adapters=a.adapters, popularity=a.popularity, alpha=a.alpha,
        ranks=tuple(int(r) for r in a.ranks.split(",")), rate=a.rate, cv=a.cv,
        input_len=pair(a.input_len), output_len=pair(a.output_len), base_fraction=a.base_fraction, seed=a.seed,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_spec_arguments(p)
    p.add_argument("--out", required=True, help="JSONL file to write")
    a = p.parse_args()
    w = generate(spec_from_args(a))
    w.save(a.out)
    print(f"wrote {len(w.requests)} requests over {len(w.adapter_ranks)} adapters to {a.out}")


if __name__ == "__main__":
    main()
