"""The adapter loader reads its files along the paths it resolved and checked, with no symlink
followed: a symlink swapped in between the check and the read is refused, nothing of it read.

The race is made deterministic by doing the swap inside the loader's own ``resolved_files``,
right after the paths were resolved (the check) and before any file is opened (the use)."""
from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest

import runtime.lora.adapter as adapter_module
from runtime.lora.adapter import CONFIG_FILE, WEIGHTS_FILE, AdapterError, load_adapter
from runtime.lora.symlink_free_open import SYMLINK_FREE, NotRegularFileError, SymlinkInPathError, open_symlink_free
from runtime.models.hf_config import load_model_config
from runtime.models.llama import lora_targets

pytestmark = pytest.mark.skipif(not SYMLINK_FREE, reason="no O_NOFOLLOW / dir_fd here: the declared fallback opens plainly")

SECRET = '{"peft_type": "TOPSECRET-hunter2"}'


@pytest.fixture(scope="module")
def targets(tiny_llama_dir):
    return lora_targets(load_model_config(tiny_llama_dir))


def swap_after_resolving(monkeypatch, swap) -> None:
    """Run ``swap()`` once the loader has resolved its paths, before it opens anything."""
    resolve = adapter_module.resolved_files

    def resolve_then_swap(folder):
        files = resolve(folder)
        swap()
        return files

    monkeypatch.setattr(adapter_module, "resolved_files", resolve_then_swap)


@pytest.mark.parametrize("swapped", ["config file", "folder"])
def test_a_symlink_swapped_in_after_the_check_is_not_followed(swapped, tmp_path, tiny_adapters, targets, monkeypatch) -> None:
    """The config file (or the whole folder) swapped for a symlink to a file (a folder) outside:
    the loader used to read it, and its parse error quoted it; now it is refused unread."""
    folder = shutil.copytree(tiny_adapters["a"], tmp_path / "root" / "ad")
    outside = shutil.copytree(tiny_adapters["a"], tmp_path / "outside")
    (outside / "secret.json").write_text(SECRET)
    (outside / CONFIG_FILE).write_text(SECRET)

    def swap() -> None:
        if swapped == "config file":
            (folder / CONFIG_FILE).unlink()
            (folder / CONFIG_FILE).symlink_to(outside / "secret.json")
        else:
            folder.rename(folder.with_name("moved-away"))
            folder.symlink_to(outside)

    swap_after_resolving(monkeypatch, swap)
    with pytest.raises(AdapterError) as info:
        load_adapter(folder, "x", targets, num_layers=2, max_lora_rank=64)
    message = str(info.value)
    assert "TOPSECRET" not in message and "nothing of it was read" in message and "symlink" in message, message
    assert isinstance(info.value, adapter_module.AdapterPathError)


def test_the_files_read_are_the_ones_approved_and_recorded(tmp_path, tiny_adapters, targets) -> None:
    """``approve_files`` sees the resolved folder and files before anything is opened, and a
    refusal reads nothing; a symlinked weights file inside the folder is read where it points."""
    folder = shutil.copytree(tiny_adapters["a"], tmp_path / "root" / "ad")
    (folder / WEIGHTS_FILE).rename(tmp_path / "root" / "shared.safetensors")
    (folder / WEIGHTS_FILE).symlink_to(Path("..") / "shared.safetensors")
    seen = []
    adapter = load_adapter(folder, "x", targets, num_layers=2, max_lora_rank=64, approve_files=lambda f, files: seen.append((f, files)))
    real = tmp_path.resolve() / "root"
    assert seen == [(folder, (str(real / "ad"), str(real / "ad" / CONFIG_FILE), str(real / "shared.safetensors")))]
    assert adapter.files == seen[0][1]
    within = adapter_module.files_within([tmp_path / "root" / "ad"])  # the shared weights lie outside this "root"
    with pytest.raises(adapter_module.AdapterPathError, match=f"{WEIGHTS_FILE} resolves outside every --adapter-root"):
        load_adapter(folder, "x", targets, num_layers=2, max_lora_rank=64, approve_files=within)


def test_open_symlink_free(tmp_path) -> None:
    real = tmp_path.resolve()
    (real / "d").mkdir()
    (real / "d" / "f").write_bytes(b"data")
    with open_symlink_free(str(real / "d" / "f")) as f:
        assert f.read() == b"data"
    (real / "link-d").symlink_to(real / "d")
    (real / "d" / "link-f").symlink_to(real / "d" / "f")
    for through in (real / "link-d" / "f", real / "d" / "link-f"):
        with pytest.raises(SymlinkInPathError):
            open_symlink_free(str(through))
    os.mkfifo(real / "d" / "fifo")  # would block a plain open for reading
    for odd in (real / "d" / "fifo", real / "d"):
        with pytest.raises(NotRegularFileError):
            open_symlink_free(str(odd))
    with pytest.raises(FileNotFoundError):
        open_symlink_free(str(real / "d" / "missing"))
    assert stat.S_ISFIFO(os.stat(real / "d" / "fifo").st_mode)
