"""The defaults `lorafleet serve --help`, README.md and docs/*.md state for serve's flags are the
ones the code applies: ``build_settings`` with nothing given (and ``EngineConfig.for_backend`` for
the step budget). Two forms are checked:

- a literal: ``(default X)`` or ``; default X`` in a flag's help, and ```--flag`` ... default X``
  within one clause of a doc (``1 MiB`` read as 1048576; ``off``/``on`` as false/true);
- a rule ``max(N, --flag)``: N is the default when ``--flag`` is 1 (``--max-loras``: the host tier;
  ``--max-num-seqs``: the step budget, on the cpu when the text says so, else on a GPU).

A default changed in the code, or in one of those texts, fails here until the others say so.
Defaults given in words (``the model's limit``) are not checked.
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any, Callable

import pytest

from runtime.commands import serve
from runtime.server.serve_config import ServeSettings, build_settings

ROOT = Path(__file__).resolve().parents[1]
# merging.md's flags are lorafleet merge's (its --device defaults to cpu), not serve's.
DOCS = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "merging.md")]
HELP_LITERAL = re.compile(r"(?:^|\(|; )default:? ([\w.]+(?: MiB)?)(?=[;,:)]|$)")
DOC_LITERAL = re.compile(r"`(--[a-z][a-z0-9-]*)`[^.;`]{0,50}?\bdefault:? `?([\w.]+(?: MiB)?)(?![\w.(])")  # not a rule's max(
RULE = re.compile(r"max\((\d+), `?(--[a-z][a-z0-9-]*)`?\)(?=([^;]{0,16}))")  # the words after it say "on the cpu"
WORDS = {"off": False, "on": True}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lorafleet serve")
    serve.add_arguments(p)
    return p


def flags() -> dict[str, argparse.Action]:
    return {s: a for a in parser()._actions for s in a.option_strings if s.startswith("--") and not s.startswith("--no-")}


def settings(**given: Any) -> ServeSettings:
    return build_settings({}, given, demo_model=str(ROOT / "runtime" / "demo_assets" / "base"))


def applied(dest: str) -> Any:
    """What serve applies for ``dest`` when nothing is given."""
    s = settings()
    if dest == "kv_cache_mb":
        return s.engine.kv_cache_cap_mb
    for source in (s.engine, s.server, s):
        if hasattr(source, dest):
            return getattr(source, dest)
    raise KeyError(dest)


# Each rule's flag -> its default with that flag at 1, on the cpu or not.
RULES: dict[str, Callable[[bool], int]] = {
    "--max-loras": lambda cpu: settings(max_loras=1).engine.host_tier_size,
    "--max-num-seqs": lambda cpu: settings(max_num_seqs=1).engine.for_backend("cpu" if cpu else "cuda").max_num_batched_tokens,
}


def literal(text: str) -> Any:
    if text in WORDS:
        return WORDS[text]
    if text.endswith(" MiB"):
        return int(float(text.removesuffix(" MiB")) * 2**20)
    return int(text) if text.isdigit() else text


def literal_problem(flag: str, stated: str) -> str | None:
    action = flags().get(flag)
    if action is None:
        return None  # another command's flag (test_documented_commands checks the names)
    real = applied(action.dest)
    return None if literal(stated) == real else f"{flag}: says default {stated!r}, serve applies {real!r}"


def rule_problem(n: str, flag: str, after: str) -> str | None:
    if flag not in RULES:
        return f"max({n}, {flag}): no rule known for {flag} (add it to RULES)"
    cpu = "cpu" in after.lower()
    real = RULES[flag](cpu)
    return None if int(n) == real else f"max({n}, {flag}){after}: the default at {flag} 1 is {real}{' on the cpu' if cpu else ''}"


def help_problems() -> list[str]:
    problems = []
    for flag, action in flags().items():
        text = " ".join((action.help or "").split())
        problems += [p for stated in HELP_LITERAL.findall(text) if (p := literal_problem(flag, stated))]
        problems += [p for n, f, after in RULE.findall(text) if (p := rule_problem(n, f, after))]
    return problems


def doc_problems(text: str, where: str) -> list[str]:
    text = " ".join(text.split())
    problems = [f"{where}: {p}" for flag, stated in DOC_LITERAL.findall(text) if (p := literal_problem(flag, stated))]
    return problems + [f"{where}: {p}" for n, flag, after in RULE.findall(text) if (p := rule_problem(n, flag, after))]


def test_serve_help_states_the_applied_defaults() -> None:
    checked = [a for a in flags().values() if HELP_LITERAL.search(" ".join((a.help or "").split()))]
    assert len(checked) >= 16  # --device, --dtype, --host, --port, --max-loras, ... (the pattern still finds them)
    assert help_problems() == []


def test_the_docs_state_serve_s_applied_defaults() -> None:
    texts = {path.name: path.read_text(encoding="utf-8") for path in DOCS}
    found = [m for text in texts.values() for m in (*DOC_LITERAL.findall(" ".join(text.split())), *RULE.findall(" ".join(text.split())))]
    assert len(found) >= 6  # README's host tier and step budget rules, api.md's and security.md's literals, scale-out's rule
    failures = [p for name, text in texts.items() for p in doc_problems(text, name)]
    assert failures == []


@pytest.mark.parametrize("text, problem", [
    ("`--max-request-bytes`, default 2 MiB", "--max-request-bytes: says default '2 MiB'"),
    ("`--metrics-max-adapters` adapters (default 10", "--metrics-max-adapters: says default '10'"),
    ("default max(16, `--max-loras`)", "max(16, --max-loras)"),
    ("max(2048, `--max-num-seqs`) on the cpu", "max(2048, --max-num-seqs) on the cpu"),
])
def test_the_check_finds_a_wrong_default(text: str, problem: str) -> None:
    assert any(problem in p for p in doc_problems(text, "x.md"))
