"""benchmarks/packed_weights.py: packed and unpacked engines stepped in turn, tokens compared."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from benchmarks import packed_weights
from runtime.bench.workload import add_spec_arguments, generate, spec_from_args
from runtime.models import dense

pytestmark = pytest.mark.skipif(not dense.PACKED_WEIGHTS, reason="this torch cannot pack weights for oneDNN")

# Hidden 512, one layer: the smallest benchmark llama whose four projections are all packed
# (the o projection, 512 x 512, is exactly ONEDNN_MIN_WEIGHT elements).
ARGS = ["--num-requests", "3", "--adapters", "2", "--input-len", "2,4", "--output-len", "3,5", "--hidden", "512", "--layers", "1",
        "--rounds", "2", "--seed", "7"]


@pytest.mark.parametrize("float32_onednn", [True, False])  # the engine packs float32 itself (auto), or the script does
def test_both_engines_generate_the_same_tokens_and_the_report_adds_up(tmp_path: Path, capsys, monkeypatch, float32_onednn) -> None:
    monkeypatch.setattr(dense, "FLOAT32_ONEDNN", float32_onednn)
    monkeypatch.setattr(dense, "ONEDNN_MIN_WEIGHT", 1 << 17)  # the LM head (300 x 512) packed too: the plain engine unpacks it
    left_packed = []  # per round: the plain engine's weights still packed after unpack (none may be)
    real_unpack = packed_weights.unpack

    def unpack_and_count(engine):
        n = real_unpack(engine)
        model = engine.runner.model
        left_packed.append(sum(lin.weight.is_mkldnn for layer in model.layers for lin in layer.projections.values()) + model.lm_head.is_mkldnn)
        return n

    monkeypatch.setattr(packed_weights, "unpack", unpack_and_count)
    out = tmp_path / "packed.json"
    assert packed_weights.main(ARGS + ["--workdir", str(tmp_path / "w"), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["engine_float32"] == ("onednn" if float32_onednn else "mkl") and report["machine"]["cores"] >= 1
    parser = argparse.ArgumentParser()
    add_spec_arguments(parser)
    spec_args, _ = parser.parse_known_args(ARGS)
    wanted = sum(r.output_tokens for r in generate(spec_from_args(spec_args)).requests)  # every request runs to its length
    assert len(report["rounds"]) == 2
    for r in report["rounds"]:
        assert r["packed_weights"] == 5 and r["same_tokens"] and r["tokens"] == wanted
        assert r["packed_tokens_per_s"] > 0 and r["plain_tokens_per_s"] > 0 and r["packed_over_plain"] > 0
    assert left_packed == [0, 0]  # "packed" had 5 on any CPU (forced), "plain" none
    assert "packed / plain, stepped in turn (median of 2 rounds)" in capsys.readouterr().out


def test_different_tokens_are_reported_and_exit_1(tmp_path: Path, monkeypatch, capsys) -> None:
    real_unpack = packed_weights.unpack

    def unpack_and_break(engine):  # the plain engine's weights scaled: its tokens change
        n = real_unpack(engine)
        for layer in engine.runner.model.layers:
            for lin in layer.projections.values():
                lin.weight = lin.weight * torch.linspace(-3, 3, lin.weight.shape[1])
        return n

    monkeypatch.setattr(packed_weights, "unpack", unpack_and_break)
    assert packed_weights.main(ARGS + ["--rounds", "1", "--workdir", str(tmp_path / "w")]) == 1
    assert "generated different tokens" in capsys.readouterr().err


@pytest.mark.skipif(not dense.PACKED_BFLOAT16, reason="this CPU (or torch) has no native bfloat16 in oneDNN: bf16 weights stay plain")
def test_bfloat16_engines_are_compared_too(tmp_path: Path) -> None:
    out = tmp_path / "packed.json"
    assert packed_weights.main(ARGS + ["--rounds", "1", "--dtype", "bfloat16", "--workdir", str(tmp_path / "w"), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["dtype"] == "bfloat16" and report["rounds"][0]["packed_weights"] == 4 and report["rounds"][0]["same_tokens"]


def test_bfloat16_without_native_support_is_refused(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(packed_weights, "PACKED_BFLOAT16", False)
    assert packed_weights.main(ARGS + ["--dtype", "bfloat16", "--workdir", str(tmp_path / "w")]) == 2
    assert "no native bfloat16" in capsys.readouterr().err


def test_the_step_budget_reaches_both_engines_and_the_report(tmp_path: Path) -> None:
    out = tmp_path / "packed.json"
    assert packed_weights.main(ARGS + ["--rounds", "1", "--max-num-batched-tokens", "40", "--workdir", str(tmp_path / "w"), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["max_num_batched_tokens"] == 40
    assert packed_weights.main(ARGS + ["--rounds", "1", "--workdir", str(tmp_path / "w"), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["max_num_batched_tokens"] == 256  # the engine's CPU default, resolved


@pytest.mark.parametrize("flags, message", [(["--max-num-batched-tokens", "0"], "at least 1"), (["--rate", "2"], "every request runs at once")])
def test_bad_or_ignored_flags_are_refused(tmp_path: Path, flags: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        packed_weights.main(ARGS + flags + ["--workdir", str(tmp_path / "w")])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_a_model_with_nothing_to_pack_is_refused(tmp_path: Path, capsys) -> None:
    args = [a if a != "512" else "128" for a in ARGS]  # hidden 128: every projection below ONEDNN_MIN_WEIGHT
    assert packed_weights.main(args + ["--rounds", "1", "--workdir", str(tmp_path / "w")]) == 2
    assert "the two engines are the same, nothing to compare" in capsys.readouterr().err
