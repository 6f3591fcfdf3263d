"""`lorafleet` command line: serve | probe | bench | merge | quantize.

Each subcommand lives in ``runtime/commands/<name>.py`` and exposes
``add_arguments(parser)`` and ``run(args) -> int``. Modules are imported only
when their subcommand runs, so `lorafleet probe` never imports the server stack.
"""
from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "serve": "Serve a base model and its LoRA adapters over an OpenAI-compatible HTTP API.",
    "probe": "Check every capability the backend declares in capability_matrix.yaml on this machine.",
    "bench": "Run the serving benchmark on a synthetic multi-adapter workload.",
    "merge": "Bake one LoRA adapter into the base weights and verify the result.",
    "quantize": "Write an int8 weight-only (per-output-channel) copy of a checkpoint.",
}


def version() -> str:
    """The installed package's version (``pip install -e .`` included); "unknown" when run from a bare tree."""
    from importlib.metadata import PackageNotFoundError, version as dist_version

    try:
        return dist_version("lorafleet")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lorafleet", description="Serve many LoRA adapters over one base model.")
    parser.add_argument("--version", action="version", version=f"lorafleet {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text in COMMANDS.items():
        sub.add_parser(name, help=help_text, description=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv:  # no command is a usage error (exit 2), like an unknown one
        parser.print_help(sys.stderr)
        return 2
    if argv[0] in ("-h", "--help", "--version"):
        parser.parse_args(argv[:1])  # prints help or the version and exits 0
    if argv[0] not in COMMANDS:
        parser.print_usage(sys.stderr)
        print(f"lorafleet: unknown command {argv[0]!r}; choose one of: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    name, rest = argv[0], argv[1:]
    module = importlib.import_module(f"runtime.commands.{name}")
    sub = argparse.ArgumentParser(prog=f"lorafleet {name}", description=COMMANDS[name])
    module.add_arguments(sub)
    args = sub.parse_args(rest)
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
