"""scripts/train_demo.py's command-line checks: the refusals that keep a run from replacing the bundled
demo or writing into an unrelated folder. Only ``parse_args`` is called, so no test can start training
(or write into runtime/demo_assets) even if a check regresses."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"


@pytest.fixture(scope="module")
def train_demo():
    sys.path.insert(0, str(SCRIPTS))  # the script imports eval_demo as a sibling module
    try:
        spec = importlib.util.spec_from_file_location("train_demo_under_test", SCRIPTS / "train_demo.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(SCRIPTS))
    yield module
    sys.modules.pop("train_demo_under_test", None)


def _refused(train_demo, argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """parse_args(argv) exits 2; returns its one-line error message."""
    with pytest.raises(SystemExit) as exc:
        train_demo.parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert len(errors) == 1 and err.endswith(errors[0] + "\n"), err  # usage, then exactly one error line
    return errors[0]


def test_help_states_out_has_no_default(train_demo, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        train_demo.parse_args(["--help"])
    assert exc.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "required; no default" in help_text and "runtime/demo_assets" in help_text and "--force" in help_text


@pytest.mark.parametrize("argv", [[], ["--quick"], ["--quick", "--seed", "7"], ["--force"]])
def test_out_is_required(train_demo, argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert "--out is required" in _refused(train_demo, argv, capsys)


def test_out_that_is_a_file_is_refused(train_demo, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "a_file"
    target.write_text("x")
    for extra in ([], ["--force"]):
        assert "not a folder" in _refused(train_demo, ["--quick", "--out", str(target), *extra], capsys)
    assert target.read_text() == "x"


def test_unrelated_non_empty_folder_needs_force(train_demo, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "mine"
    (out / "base").mkdir(parents=True)
    (out / "notes.txt").write_text("keep me")  # not something train_demo writes
    message = _refused(train_demo, ["--quick", "--out", str(out)], capsys)
    assert "did not write" in message and "--force" in message
    assert train_demo.parse_args(["--quick", "--out", str(out), "--force"]).force  # --force lets it through
    assert sorted(p.name for p in out.iterdir()) == ["base", "notes.txt"]  # parsing wrote nothing


def test_accepted_outputs(train_demo, tmp_path: Path) -> None:
    """A new folder, an empty one, and one shaped like an earlier train_demo output need no --force."""
    new = tmp_path / "new"
    empty = tmp_path / "empty"
    empty.mkdir()
    previous = tmp_path / "previous"
    (previous / "base").mkdir(parents=True)
    (previous / "base" / "config.json").write_text("{}")
    (previous / "adapters" / "upper").mkdir(parents=True)
    (previous / "README.md").write_text("notes")
    for out in (new, empty, previous):
        args = train_demo.parse_args(["--quick", "--out", str(out)])
        assert args.out == out and args.quick and not args.force
    assert not new.exists()  # parsing creates nothing


def test_bundled_demo_counts_as_previous_output(train_demo) -> None:
    """Rebuilding the shipped assets takes only --out runtime/demo_assets (it is this script's output)."""
    assert train_demo.is_previous_output(ROOT / "runtime" / "demo_assets")
