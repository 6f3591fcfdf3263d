"""The `lorafleet` entry point: help, version, and usage errors."""
from __future__ import annotations

import argparse
import importlib

import pytest

from runtime.cli import COMMANDS, main, version


def test_no_command_prints_help_to_stderr_and_exits_2(capsys):
    assert main([]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and all(name in captured.err for name in COMMANDS)


def test_help_and_version_exit_0(capsys):
    for flag in ("-h", "--help"):
        with pytest.raises(SystemExit) as exc:
            main([flag])
        out = capsys.readouterr().out
        assert exc.value.code == 0 and all(name in out for name in COMMANDS)
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"lorafleet {version()}"
    assert version() != "unknown"  # the test environment installs the package (pip install -e .)


def test_unknown_command_names_the_choices(capsys):
    assert main(["serv"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'serv'" in err and "serve" in err


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_command_prints_its_help(name: str, capsys) -> None:
    """`lorafleet NAME --help` exits 0 with the command's usage and description (a stray '%' in a
    flag's help, which argparse formats, would make it a traceback instead)."""
    with pytest.raises(SystemExit) as exc:
        main([name, "--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0 and out.startswith(f"usage: lorafleet {name}") and COMMANDS[name] in out


@pytest.mark.parametrize("name, codes", [("probe", ["0", "1", "2", "3"]), ("bench", ["0", "1", "2", "130"]),
                                         ("merge", ["0", "1", "2", "3", "130"]), ("quantize", ["0", "2", "3", "130"])])
def test_commands_that_exit_with_several_codes_list_them_in_their_help(name: str, codes: list[str], capsys) -> None:
    """Scripts branch on these: each command's --help lists its exit statuses (merge and quantize
    listed them only in their module docstrings)."""
    with pytest.raises(SystemExit):
        main([name, "--help"])
    out = capsys.readouterr().out
    assert "exit status" in out.lower() or "exit codes" in out.lower(), out[-400:]
    listed = out[max(out.lower().find("exit status"), out.lower().find("exit codes")):]
    for code in codes:
        assert f"  {code} " in listed, (code, listed)


def command_parser(name: str) -> argparse.ArgumentParser:
    """`lorafleet NAME`'s parser, as ``main`` builds it."""
    parser = argparse.ArgumentParser(prog=f"lorafleet {name}", description=COMMANDS[name])
    importlib.import_module(f"runtime.commands.{name}").add_arguments(parser)
    return parser


def value_flags(name: str) -> list[argparse.Action]:
    """The flags of `lorafleet NAME` that take a value (not the switches, nor --help)."""
    return [a for a in command_parser(name)._actions if a.option_strings and a.nargs != 0]  # noqa: SLF001


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_flag_that_takes_a_value_names_it_in_a_word(name: str) -> None:
    """A flag without a metavar (or choices) is shown with its name upper-cased: serve's and bench's
    usage lines read `--max-num-batched-tokens MAX_NUM_BATCHED_TOKENS` beside `--adapter-root DIR`."""
    assert [a.option_strings[0] for a in value_flags(name) if a.metavar is None and a.choices is None] == []


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_flag_with_a_default_states_it(name: str) -> None:
    """A flag whose default is a value (not None: the help then says in words what applies) says
    it in its help (probe's --device did not)."""
    silent = [a.option_strings[0] for a in value_flags(name) if a.default is not None and "default" not in (a.help or "")]
    assert silent == []
