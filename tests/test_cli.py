"""The `lorafleet` entry point: help, version, and usage errors."""
from __future__ import annotations

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
