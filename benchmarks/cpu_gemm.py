"""The CPU base GEMM, three ways: ``dense_linear`` on a packed weight (oneDNN), oneDNN on the plain
weight, and ``F.linear`` (MKL's sgemm). The engine runs the first or the third
(``EngineConfig.cpu_gemm`` onednn or mkl; auto is onednn wherever torch has it,
``runtime.models.dense.FLOAT32_ONEDNN``); the header says which ``auto`` runs.

    python benchmarks/cpu_gemm.py [--hidden 512] [--layers 4] [--rows 1,11,32,64,128,512] [--rounds 5] \
        [--dtype float32|bfloat16] [--json FILE]

The projections of the benchmark llama (``--hidden``, ``--layers``; intermediate 2 x hidden, as
``runtime.bench.synthetic.LlamaShape.sized``): per layer the fused q/k/v, o, the fused gate/up and
down, random, in ``--dtype``. For each row count, one pass calls every projection once on random
[rows, in] inputs; the three kernels run in turn, in an order that rotates from pass to pass, and
the median of ``--rounds`` passes is printed with the ratios. Each is first checked against a
float64 product of the same (rounded) inputs: relative error below 1e-5 in float32, below 1e-2 in
bfloat16 (whose results keep 8 bits); a disagreement exits 1.

- ``packed``: ``dense_linear`` on ``pack_weight(w, float32=True)``: oneDNN on weights in its blocked
  layout, for weights of at least ``ONEDNN_MIN_WEIGHT`` elements, in chunks of at most
  ``ONEDNN_MAX_ROWS`` rows (on any CPU: forced where the engine would keep float32 plain);
- ``plain``: oneDNN on ``w`` for such float32 weights and at most ``ONEDNN_MAX_ROWS`` rows,
  ``F.linear`` otherwise (a path ``dense_linear`` took until 2026-12-02, kept here for comparison
  with earlier tables);
- ``F.linear``.

Where torch has no oneDNN linear, or a weight is smaller, all three are ``F.linear`` and the
ratios are 1 by construction; the header says which. In bfloat16 a plain weight is always
``F.linear`` (``dense_linear`` packs bf16 weights only where the CPU runs bf16 natively, and then
only packed ones take oneDNN), so ``plain`` and ``F.linear`` are the same kernel there.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.bench.machine import describe as describe_machine  # noqa: E402
from runtime.models import dense  # noqa: E402
from runtime.models.dense import ONEDNN_LINEAR, ONEDNN_MAX_ROWS, ONEDNN_MIN_WEIGHT, PACKED_BFLOAT16, PACKED_WEIGHTS, dense_linear, pack_weight  # noqa: E402

Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
DTYPES = {"float32": (torch.float32, 1e-5), "bfloat16": (torch.bfloat16, 1e-2)}  # dtype, largest relative error accepted


def projections(hidden: int, layers: int, gen: torch.Generator, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    inter = 2 * hidden
    shapes = [(3 * hidden, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter)]
    return [(torch.randn(out, inp, generator=gen) / inp**0.5).to(dtype) for _ in range(layers) for out, inp in shapes]


def worst_relative_error(linear: Linear, weights: Sequence[torch.Tensor], plain: Sequence[torch.Tensor], rows: int, gen: torch.Generator) -> float:
    """``linear`` on ``weights`` against the float64 product with the ``plain`` weights they stand for."""
    worst = 0.0
    for w, p in zip(weights, plain):
        x = torch.randn(rows, p.shape[1], generator=gen).to(p.dtype)
        want = x.double() @ p.double().T
        worst = max(worst, ((linear(x, w).double() - want).abs().max() / want.abs().max()).item())
    return worst


def plain_onednn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """oneDNN on the plain weight for a large float32 weight and at most ``ONEDNN_MAX_ROWS`` rows,
    ``F.linear`` otherwise (``dense_linear``'s plain-weight path before 2026-12-02)."""
    if ONEDNN_LINEAR and torch.backends.mkldnn.enabled and w.dtype == torch.float32 and w.numel() >= ONEDNN_MIN_WEIGHT and x.shape[0] <= ONEDNN_MAX_ROWS:
        return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    return F.linear(x, w)


def one_pass_ms(linear: Linear, weights: Sequence[torch.Tensor], inputs: dict[int, torch.Tensor]) -> float:
    start = time.perf_counter()
    for w in weights:
        linear(inputs[w.shape[1]], w)
    return (time.perf_counter() - start) * 1000


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rows", default="1,11,32,64,128,512", help="rows per GEMM, comma separated (default: %(default)s; above "
                   f"{ONEDNN_MAX_ROWS} the plain column is F.linear, the packed one takes chunks)")
    p.add_argument("--rounds", type=int, default=5, help="passes per kernel and row count; the median is printed (default: %(default)s)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="weights and inputs (default: %(default)s)")
    p.add_argument("--json", help="also write the results here")
    a = p.parse_args(argv)
    dtype, tolerance = DTYPES[a.dtype]
    try:
        row_counts = [int(r) for r in a.rows.split(",")]
    except ValueError:
        p.error(f"--rows: expected comma-separated integers, got {a.rows!r}")
    if a.hidden < 1 or a.layers < 1 or a.rounds < 1 or any(r < 1 for r in row_counts):
        p.error("--hidden, --layers, --rounds and every --rows count must be at least 1")
    gen = torch.Generator().manual_seed(0)
    weights = projections(a.hidden, a.layers, gen, dtype)
    kernels: dict[str, tuple[Linear, list[torch.Tensor]]] = {
        "packed": (dense_linear, [pack_weight(w, float32=True) for w in weights]), "plain": (plain_onednn, weights), "F.linear": (F.linear, weights)}
    errors = {name: worst_relative_error(fn, ws, weights, 7, gen) for name, (fn, ws) in kernels.items()}
    bad = {name: err for name, err in errors.items() if not err < tolerance}
    if bad:
        print(f"the kernels differ from the float64 product by more than {tolerance:g} (relative): {bad}", file=sys.stderr)
        return 1
    large = sum(w.numel() >= ONEDNN_MIN_WEIGHT for w in weights)
    packed = sum(w.is_mkldnn for w in kernels["packed"][1])
    if not ONEDNN_LINEAR:
        kernel_name = "F.linear: this torch has no oneDNN linear"
    elif dtype == torch.bfloat16:
        kernel_name = (f"oneDNN for the {packed} packed weights of >= {ONEDNN_MIN_WEIGHT} elements, F.linear otherwise" if PACKED_BFLOAT16
                       else "F.linear: this CPU has no native bfloat16 in oneDNN, so bf16 weights stay plain")  # fmt: skip
    else:
        kernel_name = (f"oneDNN (torch.ops.mkldnn._linear_pointwise) for the {large} weights of >= {ONEDNN_MIN_WEIGHT} elements "
                       f"({packed} packed; plain ones up to {ONEDNN_MAX_ROWS} rows), F.linear otherwise")
    engine_kernel = "packed" if any(pack_weight(w).is_mkldnn for w in weights) else "F.linear"  # what the engine's default stores
    print(f"{len(weights)} projections, hidden {a.hidden}, {a.layers} layers, {a.dtype}, {torch.get_num_threads()} threads; "
          f"packed / plain = {kernel_name}; the engine runs {engine_kernel} (cpu_gemm auto)")
    print(f"{'rows':>6} {'packed ms':>10} {'plain ms':>9} {'F.linear ms':>12} {'plain / packed':>15} {'F.linear / packed':>18}")
    results = []
    names = list(kernels)
    for rows in row_counts:
        inputs = {k: torch.randn(rows, k, generator=gen).to(dtype) for k in {w.shape[1] for w in weights}}
        for fn, ws in kernels.values():
            one_pass_ms(fn, ws, inputs)  # warm-up
        times: dict[str, list[float]] = {name: [] for name in kernels}
        for round_ in range(a.rounds):
            for name in names[round_ % 3 :] + names[: round_ % 3]:  # rotate which goes first
                times[name].append(one_pass_ms(*kernels[name], inputs))
        med = {name: statistics.median(t) for name, t in times.items()}
        results.append({"rows": rows, "packed_ms": round(med["packed"], 3), "plain_ms": round(med["plain"], 3),
                        "f_linear_ms": round(med["F.linear"], 3), "plain_over_packed": round(med["plain"] / med["packed"], 3),
                        "f_linear_over_packed": round(med["F.linear"] / med["packed"], 3)})
        print(f"{rows:>6} {med['packed']:>10.2f} {med['plain']:>9.2f} {med['F.linear']:>12.2f} {med['plain'] / med['packed']:>14.2f}x "
              f"{med['F.linear'] / med['packed']:>17.2f}x")
    if a.json:
        Path(a.json).write_text(json.dumps({"hidden": a.hidden, "layers": a.layers, "dtype": a.dtype, "threads": torch.get_num_threads(),
                                            "onednn": ONEDNN_LINEAR, "packed_weights": PACKED_WEIGHTS, "onednn_weights": large,
                                            "packed": packed, "engine_kernel": engine_kernel, "machine": describe_machine(), "relative_error": errors,
                                            "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
