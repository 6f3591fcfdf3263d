"""Every `lorafleet ...` command line in README.md, docs/*.md and the Makefile goes through the real
argparse parser of its subcommand: a renamed or dropped flag, or a documented value the flag's
choices refuse, fails here instead of on an operator's terminal.

Two forms are checked:
- command lines (a line of a code block that starts with ``lorafleet``, ``$(BIN)/lorafleet``, with
  backslash or folded-YAML continuation lines): parsed whole, Makefile variables replaced by their
  ``?=`` defaults;
- inline spans (`` `lorafleet serve --device auto|cpu ...` ``): placeholders such as ``DIR``,
  ``[...]`` and ``a|b`` are prose, so each ``--flag`` must exist, and each ``a|b|c`` value of a flag
  with choices must be one of them.
Flags written alone in backticks in README's "Serve your own model" section must be serve's.
"""
from __future__ import annotations

import argparse
import importlib
import re
import shlex
from pathlib import Path
from typing import NoReturn

import pytest

from runtime.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "Makefile"]
COMMAND_LINE = re.compile(r"^(?:\$\(BIN\)/)?lorafleet (" + "|".join(COMMANDS) + r")\b(.*)$")
INLINE = re.compile(r"`lorafleet (" + "|".join(COMMANDS) + r")\b([^`]*)`")
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)(?:[ =]([\w.-]+(?:\|[\w.-]+)+))?")


class RaisingParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors raise (with argparse's message) instead of exiting."""

    def error(self, message: str) -> NoReturn:
        raise ValueError(message)


def parser_for(command: str) -> argparse.ArgumentParser:
    """The subcommand's own parser, built as ``runtime.cli.main`` builds it."""
    parser = RaisingParser(prog=f"lorafleet {command}")
    importlib.import_module(f"runtime.commands.{command}").add_arguments(parser)
    return parser


def make_defaults(text: str) -> dict[str, str]:
    return dict(re.findall(r"^(\w+) \?= (\S+)$", text, flags=re.M))


def command_lines(path: Path) -> list[tuple[str, str, str]]:
    """(where, command, arguments) for each command line in ``path``."""
    text = path.read_text(encoding="utf-8")
    variables = make_defaults(text) if path.name == "Makefile" else {}
    lines = text.splitlines()
    found = []
    for i, line in enumerate(lines):
        match = COMMAND_LINE.match(line.strip().removeprefix("$ "))
        if match is None:
            continue
        rest, previous = match.group(2), line
        for more in lines[i + 1:]:  # a shell line ending in a backslash, or YAML's folded (>-) lines of flags
            if not (previous.endswith("\\") or more.strip().startswith("--")):
                break
            rest, previous = rest.removesuffix("\\") + " " + more.strip(), more
        rest = re.sub(r"\$\((\w+)\)", lambda m: variables.get(m.group(1), m.group(0)), rest.split(" #")[0])
        found.append((f"{path.relative_to(ROOT)}:{i + 1}", match.group(1), rest))
    return found


def inline_spans(path: Path) -> list[tuple[str, str, str]]:
    text = path.read_text(encoding="utf-8")
    return [(f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}", m.group(1), m.group(2)) for m in INLINE.finditer(text)]


def inline_problems(command: str, rest: str) -> list[str]:
    """Flags of ``rest`` the parser lacks, and ``a|b`` values outside a flag's choices."""
    options = {s: a for a in parser_for(command)._actions for s in a.option_strings}
    problems = []
    for flag, alternatives in FLAG.findall(rest):
        action = options.get(flag)
        if action is None:
            problems.append(f"no flag {flag}")
        elif alternatives and action.choices is not None:
            problems += [f"{flag} {value}: not one of {list(action.choices)}" for value in alternatives.split("|") if value not in action.choices]
    return problems


def test_documented_command_lines_parse() -> None:
    lines = [found for path in SOURCES for found in command_lines(path)]
    assert len(lines) >= 4  # README's serve example, scale-out's two, the Makefile's run target
    failures = []
    for where, command, rest in lines:
        try:
            parser_for(command).parse_args(shlex.split(rest))
        except ValueError as err:
            failures.append(f"{where}: lorafleet {command}{rest}: {err}")
    assert not failures, "\n".join(failures)


def test_documented_inline_commands_name_real_flags_and_choices() -> None:
    spans = [found for path in SOURCES for found in inline_spans(path)]
    assert len(spans) >= 10
    failures = [f"{where}: `lorafleet {command}{rest}`: {problem}" for where, command, rest in spans for problem in inline_problems(command, rest)]
    assert not failures, "\n".join(failures)


def test_readme_serve_flags_are_serve_flags() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Serve your own model", 1)[1].split("\n## ", 1)[0]
    spans = re.findall(r"`([^`\n]*)`", section)
    assert any("--max-num-batched-tokens" in s for s in spans)
    failures = [f"`{span}`: {problem}" for span in spans if span.startswith("--") for problem in inline_problems("serve", span)]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("rest, problem", [(" --max-lora 8", "no flag --max-lora"), (" --device cpu|gpu", "--device gpu: not one of")])
def test_the_inline_check_finds_a_wrong_flag_or_value(rest: str, problem: str) -> None:
    assert any(problem in p for p in inline_problems("serve", rest))
