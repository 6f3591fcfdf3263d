"""The verification table `lorafleet merge` prints.

One row per candidate output, each against the same float reference (see verify.py):

    reference: float base + float LoRA (dynamic path), 8 prompts x 16 tokens, teacher-forced
    output                               max |dlogit|   mean |dlogit|   greedy agreement
    dynamic: int8 base + float LoRA          1.2e-06         2.0e-07   100.00% (128/128)
    merged, float32                          ...
    merged, requantized int8  <- written     ...
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from runtime.merge.verify import Figures


@dataclass(frozen=True)
class ReportRow:
    label: str
    figures: Figures
    written: bool  # this row is the checkpoint written to --out (the one the threshold checks)


def format_report(reference: str, rows: Sequence[ReportRow], threshold: float) -> str:
    width = max(len(r.label) + (12 if r.written else 0) for r in rows)
    lines = [f"reference: {reference}", f"{'output':<{width}}  {'max |dlogit|':>12}  {'mean |dlogit|':>13}  greedy agreement"]
    for r in rows:
        label = r.label + ("  <- written" if r.written else "")
        f = r.figures
        lines.append(f"{label:<{width}}  {f.max_abs:>12.3e}  {f.mean_abs:>13.3e}  {100 * f.agreement:6.2f}% ({f.agreed}/{f.positions})")
    checked = next(r for r in rows if r.written)
    verdict = "PASS" if checked.figures.agreement >= threshold else "FAIL"
    lines.append(f"{verdict}: greedy agreement {100 * checked.figures.agreement:.2f}% of the written output vs threshold {100 * threshold:.2f}%")
    return "\n".join(lines)
