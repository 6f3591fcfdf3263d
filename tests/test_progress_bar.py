"""The progress of `lorafleet bench`, `merge`, `quantize` and ``LLM.generate(use_tqdm=True)``:
tqdm's bar on a terminal; on anything else (a CI log, ``2> file``, a pipe) plain lines, one
per tenth of the total, since every ``\\r`` redraw of a bar stays in such a log."""
from __future__ import annotations

import io
from pathlib import Path

import pytest

from runtime.progress_bar import ProgressBar, tenth


class FakeStream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_not_a_terminal_gets_one_plain_line_per_tenth() -> None:
    stream = FakeStream(tty=False)
    with ProgressBar(200, "requests", "req", stream=stream) as bar:
        for _ in range(200):
            bar.update()
    text = stream.getvalue()
    assert "\r" not in text and "\x1b" not in text
    lines = text.splitlines()
    assert lines == [f"requests: {20 * i}/200 req ({10 * i}%)" for i in range(11)]


def test_not_a_terminal_few_items_big_steps_and_an_early_close() -> None:
    stream = FakeStream(tty=False)
    bar = ProgressBar(3, "merge", "tensor", stream=stream)
    bar.update()
    bar.update(2)
    bar.close()
    bar.close()
    assert stream.getvalue().splitlines() == ["merge: 0/3 tensor (0%)", "merge: 1/3 tensor (33%)", "merge: 3/3 tensor (100%)"]
    stream = FakeStream(tty=False)
    bar = ProgressBar(100, "requests", "req", stream=stream)
    for _ in range(25):  # interrupted (Ctrl-C) at 25: the close says how far it got
        bar.update()
    bar.close()
    assert stream.getvalue().splitlines()[-2:] == ["requests: 20/100 req (20%)", "requests: 25/100 req (25%)"]


def test_a_terminal_keeps_the_redrawn_bar() -> None:
    stream = FakeStream(tty=True)
    with ProgressBar(5, "write", "tensor", stream=stream) as bar:
        for _ in range(5):
            bar.update()
    assert "\r" in stream.getvalue() and "5/5" in stream.getvalue()


@pytest.mark.parametrize("tty", [True, False])
def test_enabled_false_writes_nothing_and_none_means_only_on_a_terminal(tty: bool) -> None:
    for enabled, expected in [(False, False), (None, tty)]:
        stream = FakeStream(tty=tty)
        with ProgressBar(4, "generate", "prompt", stream=stream, enabled=enabled) as bar:
            bar.update(4)
        assert (stream.getvalue() != "") is expected


def test_tenth_is_the_whole_tenths_reached() -> None:
    assert [tenth(d, 7) for d in range(8)] == [0, 1, 2, 4, 5, 7, 8, 10]
    assert tenth(0, 0) == 10 and tenth(12, 10) == 10


def test_merge_writes_no_carriage_returns_to_a_file(tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`lorafleet quantize 2> log` (capsys' stderr is no terminal) wrote tqdm's \\r redraws to the log."""
    from runtime.commands.quantize import quantize_checkpoint

    quantize_checkpoint(str(tiny_llama_dir), str(tmp_path / "q8"))
    err = capsys.readouterr().err
    assert "\r" not in err
    assert [line for line in err.splitlines() if line.startswith("write: ")][-1].endswith("(100%)"), err
