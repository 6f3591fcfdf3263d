"""`lorafleet merge` / `quantize` as a careful user needs them: input problems found before any
weight is written, clear exit codes, nothing left behind on signals or errors, readable files."""
from __future__ import annotations

import os
import shutil
import signal
import stat
import time
from pathlib import Path

import pytest

from runtime.cli import main as cli_main
from runtime.merge import merge_job
from runtime.merge.staging import OutputPathError, StagedOutput, check_output


def _merge(base: Path, adapter: Path, out: Path, *extra: str) -> int:
    return cli_main(["merge", "--model", str(base), "--adapter", str(adapter), "--out", str(out), *extra])


def _publish_over(out: Path) -> None:
    """Stage a new output ("new" in model.safetensors) and publish it over ``out`` with --force."""
    staged = StagedOutput(check_output(out, [], force=True), force=True)
    with staged as tmp:
        (tmp / "model.safetensors").write_bytes(b"new")
        staged.publish()


def _siblings(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir())


def test_verify_tokens_beyond_the_model_is_refused_before_writing(tiny_llama_dir, tiny_adapters, tmp_path, capsys):
    out = tmp_path / "m"
    assert _merge(tiny_llama_dir, tiny_adapters["a"], out, "--verify-tokens", "5000") == 2
    err = capsys.readouterr().err
    assert "--verify-tokens 5000" in err and "positions" in err and "Traceback" not in err
    assert _siblings(out) == []  # not even a staging folder was made


def test_base_without_tokenizer_fails_verification_early_and_merges_with_no_verify(tiny_llama_dir, tiny_adapters, tmp_path, capsys):
    base = tmp_path / "base"
    shutil.copytree(tiny_llama_dir, base)
    (base / "tokenizer.json").unlink()
    out = tmp_path / "m"
    assert _merge(base, tiny_adapters["a"], out) == 2
    err = capsys.readouterr().err
    assert "verification needs the base's tokenizer" in err and "--no-verify" in err
    assert _siblings(out) == ["base"]
    assert _merge(base, tiny_adapters["a"], out, "--no-verify") == 0


@pytest.mark.parametrize("flags, words", [
    (("--verify-threshold", "0.5"), "--verify-threshold applies only to verification"),  # was "--verify-threshold apply only"
    (("--verify-threshold", "0.5", "--device", "cpu"), "--verify-threshold and --device apply only to verification"),
    (("--verify-threshold", "0.5", "--verify-tokens", "4", "--device", "cpu"),
     "--verify-threshold, --verify-tokens and --device apply only to verification"),
])
def test_verification_flags_with_no_verify_are_an_error(tiny_llama_dir, tiny_adapters, tmp_path, capsys, flags, words):
    out = tmp_path / "m"
    assert _merge(tiny_llama_dir, tiny_adapters["a"], out, "--no-verify", *flags) == 2
    err = capsys.readouterr().err
    assert err == f"lorafleet merge: error: {words}, which --no-verify skips\n" and not out.exists()


def test_unavailable_verification_device_is_an_input_error(tiny_llama_dir, tiny_adapters, tmp_path, capsys):
    from backends import availability

    if availability("npu")[0]:
        pytest.skip("an NPU is available here")
    out = tmp_path / "m"
    assert _merge(tiny_llama_dir, tiny_adapters["a"], out, "--device", "npu") == 2
    assert "--device npu" in capsys.readouterr().err and _siblings(out) == []


def test_progress_lines_name_each_verification_stage(tiny_llama_dir, tiny_adapters, tmp_path, capsys):
    assert _merge(tiny_llama_dir, tiny_adapters["a"], tmp_path / "m", "--device", "auto", "--verify-tokens", "2") == 0
    err = capsys.readouterr().err
    for stage in ("verifying on", "reference (base + adapter, dynamic path)", "merged checkpoint", "hashing the base weights"):
        assert stage in err, stage


@pytest.mark.parametrize("raised, code, says", [(RuntimeError("disk on fire"), 3, "unexpected failure"),
                                                 (KeyboardInterrupt(), 130, "interrupted")])
def test_errors_mid_write_leave_nothing_and_have_their_own_exit_code(tiny_llama_dir, tiny_adapters, tmp_path, capsys, monkeypatch, raised, code, says):
    def broken(spec, out_dir, progress=True):  # type: ignore[no-untyped-def]
        (out_dir / "model.safetensors").write_bytes(b"half")
        raise raised

    monkeypatch.setattr(merge_job, "write_checkpoint", broken)
    out = tmp_path / "m"
    assert _merge(tiny_llama_dir, tiny_adapters["a"], out, "--no-verify") == code
    assert says in capsys.readouterr().err and _siblings(out) == []


def test_ctrl_c_inside_the_staging_block_cleans_up(tmp_path, interactive_sigint):
    out = check_output(tmp_path / "m", [], force=False)
    with pytest.raises(KeyboardInterrupt):
        with StagedOutput(out, force=False) as staging:
            (staging / "model.safetensors").write_bytes(b"partial")
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):
                time.sleep(0.001)
            raise AssertionError("SIGINT did not stop the block")
    assert _siblings(out) == [] and signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_signals_the_process_ignores_stay_ignored(tmp_path):
    """`nohup lorafleet merge ... &`: the hangup when the terminal closes must not stop the run."""
    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        out = check_output(tmp_path / "m", [], force=False)
        with StagedOutput(out, force=False) as staging:
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(0.05)
            (staging / "model.safetensors").write_bytes(b"complete")
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, before)


def test_sigterm_inside_the_staging_block_cleans_up_and_restores_the_handler(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    out = check_output(tmp_path / "m", [], force=False)
    with pytest.raises(SystemExit) as exc:
        with StagedOutput(out, force=False) as staging:
            (staging / "model.safetensors").write_bytes(b"partial")
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):  # the handler runs in this thread between two bytecodes
                time.sleep(0.001)
            raise AssertionError("SIGTERM did not stop the block")
    assert exc.value.code == 128 + signal.SIGTERM
    assert _siblings(out) == [] and signal.getsignal(signal.SIGTERM) is before


def test_leftovers_of_a_killed_run_are_named(tiny_llama_dir, tiny_adapters, tmp_path, capsys):
    out = tmp_path / "m"
    (tmp_path / ".m.staging-0123456789ab").mkdir()
    assert _merge(tiny_llama_dir, tiny_adapters["a"], out, "--no-verify") == 0
    assert ".m.staging-0123456789ab" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["merge", "quantize"])
def test_written_weights_get_the_umask_mode(tiny_llama_dir, tiny_adapters, tmp_path, command):
    old = os.umask(0o022)
    try:
        out = tmp_path / "m"
        args = ["--adapter", str(tiny_adapters["a"]), "--no-verify"] if command == "merge" else []
        assert cli_main([command, "--model", str(tiny_llama_dir), "--out", str(out), *args]) == 0
    finally:
        os.umask(old)
    for f in out.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o644, f.name


def test_quantize_force_keeps_foreign_folders(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "q"
    out.mkdir()
    (out / "notes.txt").write_text("important")
    assert cli_main(["quantize", "--model", str(tiny_llama_dir), "--out", str(out), "--force"]) == 2
    assert "holds files that lorafleet did not write" in capsys.readouterr().err and (out / "notes.txt").read_text() == "important"
    # A project folder that merely holds a copied manifest (no list of files) is not an earlier output.
    (out / "lorafleet_merge.json").write_text('{"kind": "merge"}')
    assert cli_main(["quantize", "--model", str(tiny_llama_dir), "--out", str(out), "--force"]) == 2
    assert "does not list the files it wrote" in capsys.readouterr().err and (out / "notes.txt").read_text() == "important"
    (out / "lorafleet_merge.json").write_text('{"files_written": [["notes.txt"]]}')  # not a list of names: refused, no traceback
    assert cli_main(["quantize", "--model", str(tiny_llama_dir), "--out", str(out), "--force"]) == 2
    assert "does not list the files it wrote" in capsys.readouterr().err
    # A quantize output replaced by another: fine; with a file added to it: refused.
    fresh = tmp_path / "q2"
    assert cli_main(["quantize", "--model", str(tiny_llama_dir), "--out", str(fresh)]) == 0
    assert cli_main(["quantize", "--model", str(tiny_llama_dir), "--out", str(fresh), "--force"]) == 0
    (fresh / "train.py").write_text("code")
    assert cli_main(["quantize", "--model", str(tiny_llama_dir), "--out", str(fresh), "--force"]) == 2
    assert "(train.py)" in capsys.readouterr().err and (fresh / "train.py").read_text() == "code"


def test_truncated_base_shard_is_an_input_error(tiny_llama_dir, tiny_adapters, tmp_path, capsys):
    base = tmp_path / "base"
    shutil.copytree(tiny_llama_dir, base)
    shard = base / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    out = tmp_path / "m"
    assert _merge(base, tiny_adapters["a"], out, "--no-verify") == 2
    err = capsys.readouterr().err
    assert "not a readable safetensors file" in err and str(shard) in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base"]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_between_the_two_renames_of_publish_waits_until_the_new_output_is_in_place(tmp_path, monkeypatch, capsys, signum, interactive_sigint):
    from runtime.merge import staging

    out = tmp_path / "m"
    out.mkdir()
    (out / "lorafleet_merge.json").write_text('{"files_written": []}')  # an earlier output, replaced with --force
    real_rename = os.rename
    renames = []

    def rename_then_signal(src, dst):  # SIGTERM arrives right after the old output was moved aside
        real_rename(src, dst)
        renames.append(dst)
        if len(renames) == 1:
            os.kill(os.getpid(), signum)
            time.sleep(0.05)  # were it not held back, the handler would run here, between the renames

    monkeypatch.setattr(staging.os, "rename", rename_then_signal)
    staged = StagedOutput(check_output(out, [], force=True), force=True)
    with staged as tmp:  # the run finishes: the signal came after the point of no return
        (tmp / "model.safetensors").write_bytes(b"new")
        staged.publish()
    assert len(renames) == 2 and f"{signal.Signals(signum).name} arrived while the output was being moved into place" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"] and (out / "model.safetensors").read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # the previous output is gone, no staging left


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_the_previous_output_is_deleted_is_held_too(tmp_path, monkeypatch, capsys, signum, interactive_sigint):
    """With --force the previous output is deleted after the swap; a signal then used to stop the
    deletion half-way (a full copy left in .NAME.old-*) and be reported as "nothing was written"."""
    from runtime.merge import staging

    out = tmp_path / "m"
    out.mkdir()
    (out / "lorafleet_merge.json").write_text('{"files_written": ["model.safetensors"]}')
    (out / "model.safetensors").write_bytes(b"old")
    real_rmtree = shutil.rmtree

    def signal_then_rmtree(path, *args, **kwargs):
        if ".m.old-" in str(path):
            os.kill(os.getpid(), signum)
            time.sleep(0.05)  # were it not held, the handler would raise here, before the deletion
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(staging.shutil, "rmtree", signal_then_rmtree)
    _publish_over(out)
    err = capsys.readouterr().err
    assert f"{signal.Signals(signum).name} arrived while the output was being moved into place; the new output is in place" in err
    assert (out / "model.safetensors").read_bytes() == b"new" and sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # old copy gone


@pytest.mark.parametrize("case", ["added to an earlier output", "appeared", "added between check and rename"])
def test_force_never_replaces_files_that_arrived_while_the_run_wrote(tmp_path, monkeypatch, case):
    """check_output runs before a merge that can take hours: --force checks again when it publishes,
    and once more after moving the old output aside."""
    from runtime.merge import staging

    out = tmp_path / "m"
    if case != "appeared":
        out.mkdir()
        (out / "lorafleet_merge.json").write_text('{"files_written": ["model.safetensors"]}')
        (out / "model.safetensors").write_bytes(b"old")
    staged = StagedOutput(check_output(out, [], force=True), force=True)
    with pytest.raises(OutputPathError, match="lorafleet did not write"):
        with staged as tmp:
            (tmp / "model.safetensors").write_bytes(b"new")
            if case == "appeared":
                out.mkdir()
            if case != "added between check and rename":
                (out / "theirs.txt").write_text("keep me")
            else:
                real_rename = os.rename

                def rename_then_write(src, dst):  # someone writes into the folder right as it is moved aside
                    real_rename(src, dst)
                    if Path(dst).name == "previous":
                        (Path(dst) / "theirs.txt").write_text("keep me")
                        monkeypatch.setattr(staging.os, "rename", real_rename)

                monkeypatch.setattr(staging.os, "rename", rename_then_write)
            staged.publish()
    assert (out / "theirs.txt").read_text() == "keep me" and sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # put back, nothing left


def test_an_output_that_cannot_be_put_back_is_named_not_lost(tmp_path, monkeypatch):
    """Files added as the old output is moved aside, and a new --out made meanwhile: the old output
    cannot go back; the error says where it is (it is never deleted)."""
    from runtime.merge import staging

    out = tmp_path / "m"
    out.mkdir()
    (out / "lorafleet_merge.json").write_text('{"files_written": ["model.safetensors"]}')
    (out / "model.safetensors").write_bytes(b"old")
    real_rename = os.rename

    def rename_then_race(src, dst):
        real_rename(src, dst)
        if Path(dst).name == "previous":
            (Path(dst) / "theirs.txt").write_text("keep me")
            out.mkdir()
            (out / "log.txt").write_text("new")
            monkeypatch.setattr(staging.os, "rename", real_rename)

    monkeypatch.setattr(staging.os, "rename", rename_then_race)
    staged = StagedOutput(check_output(out, [], force=True), force=True)
    with pytest.raises(OutputPathError, match=r"the previous output could not be put back .* and is in .*\.m\.old-.*previous") as err:
        with staged as tmp:
            (tmp / "model.safetensors").write_bytes(b"new")
            staged.publish()
    kept = Path(str(err.value).rsplit(" and is in ", 1)[1])
    assert (kept / "theirs.txt").read_text() == "keep me" and (kept / "model.safetensors").read_bytes() == b"old"
    assert (out / "log.txt").read_text() == "new"


def test_merged_values_beyond_the_output_dtype_are_refused(tiny_llama_dir, tiny_adapters, tmp_path, capsys):
    """A float16 output cannot hold 1e5: merging must not write inf."""
    from safetensors.torch import load_file, save_file

    base = tmp_path / "base"
    shutil.copytree(tiny_llama_dir, base)
    tensors = load_file(str(base / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name][0, 0] = 1e5
    save_file(tensors, str(base / "model.safetensors"))
    out = tmp_path / "m"
    assert _merge(base, tiny_adapters["a"], out, "--no-verify", "--dtype", "float16") == 2
    err = capsys.readouterr().err
    assert f"tensor {name} does not fit float16" in err and not out.exists()


def test_an_output_folder_holding_the_input_is_refused_with_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tmp_path / "model"
    model.mkdir()
    with pytest.raises(OutputPathError, match=r"contains the input .*would delete the input: choose a folder outside it"):
        check_output(tmp_path, [model], force=True)  # even with --force
    monkeypatch.chdir(tmp_path)
    with pytest.raises(OutputPathError, match=r"^--out is empty"):  # "$OUT" unset: Path("") would be the current folder
        check_output("", [model], force=True)
    for current in (".", str(tmp_path), str(tmp_path.parent)):
        with pytest.raises(OutputPathError, match=r"is, or contains, the current folder"):
            check_output(current, [], force=True)


def _rewrite_base(src: Path, dst: Path, change) -> Path:  # type: ignore[no-untyped-def]
    """A copy of the checkpoint ``src`` whose tensors ``change(dict)`` edited in place."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize("case, says", [
    ("missing", "missing tensor(s) model.norm.weight"),
    ("reshaped", "tensor model.layers.0.self_attn.q_proj.weight has shape (1, "),
])  # fmt: skip
def test_a_base_that_does_not_match_its_config_is_refused_before_writing_even_without_verification(tiny_llama_dir, tiny_adapters, tmp_path, capsys, case, says):
    """--no-verify used to write it and exit 0: a missing tensor gave a checkpoint nothing loads,
    a q_proj of one row was broadcast into a full-size (wrong) merged weight that loads everywhere."""
    def change(tensors):  # type: ignore[no-untyped-def]
        if case == "missing":
            del tensors["model.norm.weight"]
        else:
            tensors["model.layers.0.self_attn.q_proj.weight"] = tensors["model.layers.0.self_attn.q_proj.weight"][:1].clone()

    base = _rewrite_base(tiny_llama_dir, tmp_path / "base", change)
    out = tmp_path / "m"
    assert _merge(base, tiny_adapters["a"], out, "--no-verify") == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base"]


def test_a_shard_that_lacks_a_tensor_its_index_names_is_an_input_error(tiny_llama_dir, tiny_adapters, tmp_path, capsys):
    import json

    base = _rewrite_base(tiny_llama_dir, tmp_path / "base", lambda tensors: tensors.pop("model.norm.weight"))
    from safetensors import safe_open

    shard = "model-00001-of-00001.safetensors"  # a model.safetensors beside the index would be read instead of it
    (base / "model.safetensors").rename(base / shard)
    with safe_open(str(tiny_llama_dir / "model.safetensors"), "pt") as f:
        names = {name: shard for name in f.keys()}
    (base / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": names}))
    out = tmp_path / "m"
    assert _merge(base, tiny_adapters["a"], out, "--no-verify") == 2
    err = capsys.readouterr().err
    assert "model.norm.weight is not in this shard" in err and "Traceback" not in err, err


def test_the_default_dtype_is_the_stored_one_when_the_config_names_none(tiny_llama_dir, tiny_adapters, tmp_path):
    """A bf16 checkpoint whose config.json has no torch_dtype was written as float32, twice its size."""
    import json

    from safetensors import safe_open

    base = _rewrite_base(tiny_llama_dir, tmp_path / "base", lambda tensors: tensors.update({k: v.bfloat16() for k, v in tensors.items()}))
    config = json.loads((base / "config.json").read_text())
    config.pop("torch_dtype", None)
    config.pop("dtype", None)
    (base / "config.json").write_text(json.dumps(config))
    out = tmp_path / "m"
    assert _merge(base, tiny_adapters["a"], out, "--no-verify") == 0
    with safe_open(str(next(out.glob("*.safetensors"))), "pt") as f:
        assert {f.get_slice(name).get_dtype() for name in f.keys()} == {"BF16"}


def test_a_previous_output_that_cannot_be_deleted_leaves_the_new_one_in_place_and_says_where(tmp_path, monkeypatch, capsys):
    """With --force, an rmtree of the previous output that failed (EBUSY: NFS files a server still
    reads) was reported as "unexpected failure ... nothing was written" with the new output in place."""
    import errno

    from runtime.merge import staging

    out = tmp_path / "m"
    out.mkdir()
    (out / "lorafleet_merge.json").write_text('{"files_written": ["model.safetensors"]}')
    (out / "model.safetensors").write_bytes(b"old")

    def busy(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        raise OSError(errno.EBUSY, "Device or resource busy", str(path))

    monkeypatch.setattr(staging.shutil, "rmtree", busy)
    _publish_over(out)
    err = capsys.readouterr().err
    left = [p for p in tmp_path.iterdir() if p.name.startswith(".m.old-")]
    assert (out / "model.safetensors").read_bytes() == b"new" and len(left) == 1
    assert "could not be deleted" in err and str(left[0]) in err


@pytest.mark.parametrize("command", ["merge", "quantize"])
def test_a_tied_config_over_a_distinct_stored_head_is_refused_before_writing(tiny_llama_dir, tiny_adapters, tmp_path, capsys, command):
    """tie_word_embeddings=true over a checkpoint whose lm_head.weight is not the embedding: serving refuses it
    (transformers 5 would compute the logits with that head), and merge and quantize wrote it through."""
    import json

    base = tmp_path / "base"
    shutil.copytree(tiny_llama_dir, base)
    config = json.loads((base / "config.json").read_text())
    assert not config.get("tie_word_embeddings")  # the fixture stores its own head
    (base / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    out = tmp_path / "out"
    args = ["--model", str(base), "--out", str(out)] + (["--adapter", str(tiny_adapters["a"]), "--no-verify"] if command == "merge" else [])
    assert cli_main([command, *args]) == 2
    err = capsys.readouterr().err
    assert "tensor lm_head.weight differs from model.embed_tokens.weight" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base"]
