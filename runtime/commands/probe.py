"""`lorafleet probe`: run every capability verifier of one backend on this machine.

Prints one row per capability of the backend's matrix section: what is declared,
what the verifier found (pass / fail / skipped with the reason) and its figures.
Exit status (``EXIT_STATUS``, also in ``--help``): 0 when every declared capability
verifies, 1 when one fails, 2 when the matrix is unreadable (or the arguments are
wrong), 3 when the device is absent, so nothing could be checked.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import backends
from runtime.capabilities import Capability, CapabilityMatrixError, load_matrix

DEVICES = ("auto", *backends.NAMES)
OK, FAILED, MATRIX_UNREADABLE, DEVICE_ABSENT = 0, 1, 2, 3
EXIT_STATUS = f"""exit status:
  {OK}  every capability the backend declares verified on this machine (skipped: not applicable)
  {FAILED}  a declared capability failed its check
  {MATRIX_UNREADABLE}  the capability matrix is unreadable or malformed (with --json: {{"ok": false, "error": ...}}),
     or the arguments are wrong
  {DEVICE_ABSENT}  the device is absent: one line says why, nothing was checked"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EXIT_STATUS
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--device", choices=DEVICES, default="auto",
                        help="backend to probe; auto picks cuda, then npu, then cpu (default auto)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--matrix", metavar="PATH", default=None,
                        help="capability matrix whose entries the verifiers check (default: runtime/capability_matrix.yaml, in a checkout a "
                             "symlink to the repo root's capability_matrix.yaml); a candidate file is checked against itself: "
                             "serve and the adapter loader (the dora row's refusal) always read the default one")


def _declared(entry: Capability) -> str:
    if not entry.supported:
        return "no"
    return "yes, with fallback" if entry.fallback is not None else "yes"


def _one_line_reason(name: str, reason: str) -> str:
    return reason if reason.startswith(f"{name}:") else f"{name}: {reason}"


def run(args: argparse.Namespace) -> int:
    try:
        matrix = load_matrix(args.matrix)
    except CapabilityMatrixError as err:
        print(f"lorafleet probe: {err}", file=sys.stderr)
        if args.json:
            print(json.dumps({"ok": False, "error": str(err), "matrix": args.matrix}))
        return MATRIX_UNREADABLE
    name = backends.resolve_name(args.device)
    available, reason = backends.availability(name)
    if not available:
        line = _one_line_reason(name, " ".join(reason.split()))
        if args.json:
            print(json.dumps({"device": name, "available": False, "reason": line, "ok": False}))
        else:
            print(line)
        return DEVICE_ABSENT
    from runtime.verifiers import run_all  # imports torch-heavy modules only when probing

    results = run_all(name, matrix, progress=_progress_to(sys.stderr))
    rows = []
    declared = matrix.capabilities(name)
    for capability, result in results.items():
        entry = matrix.entry(name, capability) if capability in declared else None  # None: the matrix leaves it out
        rows.append({
            "capability": capability,
            "declared": _declared(entry) if entry is not None else "missing",
            "status": result.status,
            "detail": result.detail,
            "metrics": dict(result.metrics),
            "verified_on": entry.verified_on.how if entry is not None else "-",
        })
    ok = all(r["status"] != "fail" for r in rows)
    if args.json:
        print(json.dumps({"device": name, "available": True, "matrix": str(matrix.path), "ok": ok, "results": rows}, default=_jsonable))
    else:
        _print_table(name, str(matrix.path), rows)
        failed = [r["capability"] for r in rows if r["status"] == "fail"]
        print(f"\n{name}: {'all declared capabilities verified' if ok else 'FAILED: ' + ', '.join(failed)}")
    return OK if ok else FAILED


def _progress_to(stream: Any) -> Any:
    """A ``run_all`` progress callback: one line per verifier on stderr (on a terminal, one line
    overwritten in place), so stdout keeps only the table or the JSON."""
    tty = stream.isatty()

    def report(i: int, n: int, capability: str) -> None:
        line = f"probing {i}/{n}: {capability}"
        if tty:
            stream.write(f"\r\x1b[K{line}")
            if i == n:
                stream.write("\n")
        else:
            stream.write(line + "\n")
        stream.flush()

    return report


def _jsonable(value: Any) -> Any:
    return str(value)


def _print_table(name: str, path: str, rows: list[dict[str, Any]]) -> None:
    print(f"lorafleet probe --device {name}  (matrix: {path})\n")
    headers = ("capability", "declared", "verified", "ms", "detail")
    table = [(r["capability"], r["declared"], r["status"], f"{r['metrics'].get('verifier_ms', 0):.0f}", r["detail"]) for r in rows]
    widths = [max(len(h), *(len(row[i]) for row in table)) for i, h in enumerate(headers[:-1])]
    print("  ".join(h.ljust(w) for h, w in zip(headers[:-1], widths)) + "  " + headers[-1])
    for row in table:
        print("  ".join(c.ljust(w) for c, w in zip(row[:-1], widths)) + "  " + row[-1])
