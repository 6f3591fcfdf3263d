"""A Hugging Face Hub id given where lorafleet wants a local folder (vLLM downloads it; lorafleet
reads local folders only): the "no such folder" error says so and how to download it, for the
base model and for an adapter, and stays as it was for a path that is not a Hub id."""
from __future__ import annotations

from pathlib import Path

import pytest

from runtime.hub_hint import hub_id_in
from runtime.lora.adapter import AdapterError, check_adapter_folder
from runtime.models.hf_config import ModelConfigError, load_model_config

HINT = "lorafleet reads local folders only and downloads nothing: if 'meta-llama/Llama-3.2-1B' is a Hugging Face Hub id, " \
       "download it first (`hf download meta-llama/Llama-3.2-1B --local-dir DIR`, huggingface_hub's CLI) and give DIR"


@pytest.mark.parametrize("path, repo", [
    ("meta-llama/Llama-3.2-1B", "meta-llama/Llama-3.2-1B"),
    ("Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct"),
    ("llama", None),                    # one name: a folder here
    ("/models/llama-3.2-1b", None),     # absolute, outside the current directory
    ("models/llama/3b", None),          # three names
    ("../meta-llama/Llama-3.2-1B", None),
    ("~/Llama-3.2-1B", None),
])  # fmt: skip
def test_which_paths_read_as_hub_ids(path: str, repo: str | None) -> None:
    assert hub_id_in(path) == repo


def test_an_absolute_path_under_the_current_directory_reads_as_what_was_typed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`lorafleet serve` makes --lora-modules paths absolute before it reads them."""
    monkeypatch.chdir(tmp_path)
    assert hub_id_in(tmp_path / "org" / "sql-lora") == "org/sql-lora"


def test_a_missing_model_folder_named_like_a_hub_id_says_how_to_get_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelConfigError) as err:
        load_model_config("meta-llama/Llama-3.2-1B")
    assert str(err.value) == f"meta-llama/Llama-3.2-1B: no such folder (a HF checkpoint folder with config.json); {HINT}"
    with pytest.raises(ModelConfigError) as err:
        load_model_config(tmp_path / "nope")
    assert str(err.value) == f"{tmp_path / 'nope'}: no such folder (a HF checkpoint folder with config.json)"


def test_a_missing_adapter_folder_named_like_a_hub_id_says_how_to_get_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    typed = tmp_path / "meta-llama" / "Llama-3.2-1B"  # as serve passes it on: made absolute
    with pytest.raises(AdapterError) as err:
        check_adapter_folder(typed)
    assert str(err.value) == f"{typed}: adapter folder does not exist; {HINT}"
    with pytest.raises(AdapterError) as err:
        check_adapter_folder(tmp_path / "nope")
    assert str(err.value) == f"{tmp_path / 'nope'}: adapter folder does not exist"


@pytest.mark.parametrize("command", ["merge", "quantize"])
def test_merge_and_quantize_say_it_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], command: str) -> None:
    from runtime.cli import main

    monkeypatch.chdir(tmp_path)
    adapter = ["--adapter", str(tmp_path)] if command == "merge" else []
    assert main([command, "--model", "meta-llama/Llama-3.2-1B", *adapter, "--out", str(tmp_path / "out")]) == 2
    assert HINT in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
