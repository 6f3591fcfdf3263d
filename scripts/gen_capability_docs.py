#!/usr/bin/env python3
"""Render capability_matrix.yaml as markdown between the README's capability-matrix markers.

    python scripts/gen_capability_docs.py          # rewrite the README section
    python scripts/gen_capability_docs.py --check  # exit 1 when the README is out of date

Only the text between ``<!-- capability-matrix:start -->`` and
``<!-- capability-matrix:end -->`` is touched.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a plain script from a checkout

from runtime.capabilities import Capability, CapabilityMatrix, Limits, load_matrix  # noqa: E402

START, END = "<!-- capability-matrix:start -->", "<!-- capability-matrix:end -->"
README = ROOT / "README.md"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _limits(limits: Limits) -> str:
    parts = []
    if limits.dtypes:
        parts.append("dtypes " + ", ".join(limits.dtypes))
    if limits.min_rank is not None or limits.max_rank is not None:
        step = f" step {limits.rank_granularity}" if (limits.rank_granularity or 1) != 1 else ""
        parts.append(f"rank {limits.min_rank or 1}..{limits.max_rank if limits.max_rank is not None else 'any'}{step}")
    for key, label in (("max_adapters_per_batch", "adapters/batch"), ("max_rows_per_launch", "rows/launch"),
                       ("max_groups_per_call", "groups/call"), ("max_slices_per_launch", "slices/launch")):
        value = getattr(limits, key)
        if value is not None:
            parts.append(f"{label} <= {value}")
    if limits.target_modules:
        parts.append("modules " + ", ".join(limits.target_modules))
    return "; ".join(parts) or "-"


def _row(entry: Capability) -> str:
    supported = "yes" if entry.supported else "**no**"
    fallback = "-"
    if entry.fallback is not None:
        fallback = f"when {entry.fallback.when}: {entry.fallback.implementation} ({_limits(entry.fallback.limits)})"
    vo = entry.verified_on
    cells = (f"`{entry.name}`", supported, _limits(entry.limits), entry.implementation, fallback, entry.note,
             f"{vo.how}, {vo.date}")
    return "| " + " | ".join(_cell(c) for c in cells) + " |"


def render(matrix: CapabilityMatrix) -> str:
    """The markdown for every backend section of the matrix (without the markers)."""
    lines = [f"Schema version {matrix.schema_version}. `lorafleet probe --device X` re-checks a backend on this machine.", ""]
    for backend in matrix.backends:
        lines += [f"### `{backend}`", "",
                  "| capability | supported | limits | implementation | fallback | note | verified on |",
                  "|---|---|---|---|---|---|---|"]
        lines += [_row(matrix.entry(backend, cap)) for cap in matrix.capabilities(backend)]
        lines.append("")
    return "\n".join(lines)


def splice(readme_text: str, body: str, readme_path: Path = README) -> str:
    """Replace what lies between the markers with ``body``."""
    if readme_text.count(START) != 1 or readme_text.count(END) != 1:
        raise SystemExit(f"{readme_path}: expected exactly one {START} and one {END}")
    head, rest = readme_text.split(START)
    _, tail = rest.split(END)
    return f"{head}{START}\n{body}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="do not write; exit 1 if the README is out of date")
    parser.add_argument("--matrix", type=Path, default=None, help="matrix file (default: capability_matrix.yaml)")
    parser.add_argument("--readme", type=Path, default=README, help="README to update (default: README.md)")
    args = parser.parse_args(argv)
    current = args.readme.read_text(encoding="utf-8")
    wanted = splice(current, render(load_matrix(args.matrix)), args.readme)
    if args.check:
        if current != wanted:
            print(f"{args.readme}: the capability-matrix section is out of date; run python scripts/gen_capability_docs.py", file=sys.stderr)
            return 1
        return 0
    if current != wanted:
        args.readme.write_text(wanted, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
