"""`lorafleet probe`: passes on cpu, one clear line for an absent device, fails on a false matrix."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import backends
from runtime.capabilities import DEFAULT_MATRIX_PATH, load_matrix
from runtime.cli import main

MATRIX = load_matrix()


def test_probe_cpu_passes_and_explains_every_row(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["probe", "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    n = len(MATRIX.capabilities("cpu"))  # progress, one line per verifier as it starts, on stderr only
    assert captured.err.splitlines() == [f"probing {i}/{n}: {c}" for i, c in enumerate(MATRIX.capabilities("cpu"), 1)]
    assert "probing" not in out
    for capability in MATRIX.capabilities("cpu"):
        entry = MATRIX.entry("cpu", capability)
        line = next(l for l in out.splitlines() if l.startswith(capability + " "))
        if entry.verified_on.how == "not applicable":  # nothing can ask for it here: skipped, never a pass
            assert " skipped " in line and "not applicable" in line and entry.note in line, line
            continue
        assert " pass " in line, line
        if not entry.supported:
            assert entry.note in line and "refused" in line  # the reason it is declared unsupported, and that it was refused
        else:
            assert "max err" in line or "refused" in line, line  # error figures are shown
    assert "cpu: all declared capabilities verified" in out


@pytest.mark.parametrize("device", ["cuda", "npu"])
def test_probe_absent_device_prints_one_line_and_fails(device: str, capsys: pytest.CaptureFixture[str]) -> None:
    available, reason = backends.availability(device)
    if available:
        pytest.skip(f"{device} is present on this machine")
    assert main(["probe", "--device", device]) == 3  # absent: distinct from a failed capability (1)
    out = capsys.readouterr().out.strip()
    assert out.count("\n") == 0 and out.startswith(f"{device}:"), out
    assert " ".join(reason.split()) in out


def test_probe_absent_device_via_the_console_script_has_no_traceback() -> None:
    if backends.availability("npu")[0]:
        pytest.skip("npu is present on this machine")
    proc = subprocess.run([sys.executable, "-m", "runtime.cli", "probe", "--device", "npu", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3
    assert "Traceback" not in proc.stderr + proc.stdout
    report = json.loads(proc.stdout)
    assert report["available"] is False and report["reason"].startswith("npu:") and "torch_npu" in report["reason"]


def test_probe_fails_on_a_false_declaration(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = yaml.safe_load(DEFAULT_MATRIX_PATH.read_text())
    data["cpu"]["dtypes"]["limits"]["dtypes"].append("float64")  # the engine has no float64 mode
    data["cpu"]["max_rank"]["limits"]["max_rank"] = 100000  # beyond what the op rows declare: inconsistent
    data["cpu"]["lora_ops_segment"]["limits"]["dtypes"].append("int8")
    path = tmp_path / "false_matrix.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    assert main(["probe", "--device", "cpu", "--json", "--matrix", str(path)]) == 1
    report = json.loads(capsys.readouterr().out)
    status = {r["capability"]: r for r in report["results"]}
    assert report["ok"] is False
    assert status["dtypes"]["status"] == "fail" and "float64" in status["dtypes"]["detail"]
    assert status["lora_ops_segment"]["status"] == "fail" and "int8" in status["lora_ops_segment"]["detail"]
    assert status["max_rank"]["status"] == "fail" and "100000" in status["max_rank"]["detail"]
    assert status["paged_attention"]["status"] == "pass"  # the rest still verifies


def test_probe_unreadable_matrix_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["probe", "--device", "cpu", "--matrix", str(tmp_path / "missing.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "missing.yaml" in err


def test_probe_unreadable_matrix_with_json_prints_a_json_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("cpu: [\n")
    for path in (bad, tmp_path / "missing.yaml"):
        assert main(["probe", "--device", "cpu", "--json", "--matrix", str(path)]) == 2
        report = json.loads(capsys.readouterr().out)
        assert report["ok"] is False and report["matrix"] == str(path) and str(path) in report["error"]


def test_probe_help_lists_the_exit_codes() -> None:
    from runtime.commands.probe import DEVICE_ABSENT, FAILED, MATRIX_UNREADABLE, OK

    proc = subprocess.run([sys.executable, "-m", "runtime.cli", "probe", "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0
    status = proc.stdout[proc.stdout.index("exit status:"):]
    for code, words in ((OK, "verified"), (FAILED, "failed"), (MATRIX_UNREADABLE, "matrix is unreadable"), (DEVICE_ABSENT, "device is absent")):
        assert f"  {code}  " in status and words in status, status
    assert len({OK, FAILED, MATRIX_UNREADABLE, DEVICE_ABSENT}) == 4


def test_probe_fails_on_a_matrix_that_leaves_capabilities_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A candidate matrix with only some capabilities printed "all declared capabilities verified"."""
    data = yaml.safe_load(DEFAULT_MATRIX_PATH.read_text())
    for backend in ("cpu", "cuda", "npu"):
        data[backend] = {k: v for k, v in data[backend].items() if k in ("paged_attention", "prefix_caching")}
    path = tmp_path / "partial.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    assert main(["probe", "--device", "cpu", "--json", "--matrix", str(path)]) == 1
    status = {r["capability"]: r for r in json.loads(capsys.readouterr().out)["results"]}
    assert status["prefix_caching"]["status"] == "pass"
    assert status["max_rank"]["status"] == "fail" and "not declared" in status["max_rank"]["detail"]


def test_probe_int8_check_compares_the_quantizer_with_the_float_weight(monkeypatch: pytest.MonkeyPatch) -> None:
    """It compared the int8 path with the dequantized codes only: a quantizer writing all-zero codes passed."""
    import runtime.quant.capability as capability
    from runtime.quant.int8 import Int8Weight
    from runtime.verifiers import VERIFIERS

    assert VERIFIERS["quantized_base_int8"]("cpu").status == "pass"
    monkeypatch.setattr(capability, "quantize_int8", lambda w: Int8Weight(torch.zeros(w.shape, dtype=torch.int8), torch.ones(w.shape[0])))
    result = VERIFIERS["quantized_base_int8"]("cpu")
    assert result.status == "fail" and "quantize_int8" in result.detail


@pytest.mark.parametrize("capability", ["dtypes", "lora_ops_segment", "paged_attention", "max_rank", "multi_slice_expand", "prefix_caching",
                                        "mixed_ranks", "quantized_base_int8"])  # fmt: skip
def test_an_unsupported_declaration_passes_only_through_the_runtime_s_own_refusal(tmp_path: Path, capability: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default refusal check called require(), which refuses every unsupported entry: it could
    not fail. It now asks the gate the runtime itself runs; with that gate silenced, it fails."""
    import runtime.capabilities as capabilities
    from runtime.verifiers import VERIFIERS

    data = yaml.safe_load(DEFAULT_MATRIX_PATH.read_text())
    data["cpu"][capability]["supported"] = False
    path = tmp_path / "unsupported.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    matrix = load_matrix(path)
    result = VERIFIERS[capability]("cpu", matrix)
    assert result.status == "pass" and f"[cpu.{capability}]" in result.metrics["refusal"], result
    for gate in ("check_engine_config", "check_adapter", "require"):
        monkeypatch.setattr(capabilities, gate, lambda *args, **kwargs: [])
    monkeypatch.setattr("runtime.verifiers.result.require", lambda *args, **kwargs: None)
    assert VERIFIERS[capability]("cpu", matrix).status == "fail"


def test_probe_op_checks_see_weights_rewritten_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend that kept computing with a slot's old weights after a hot update into the same rows
    passed the probe: the reference backend's float32 copies of a bfloat16 pool, made blind to writes."""
    import backends.reference as reference
    from runtime.verifiers import VERIFIERS

    assert VERIFIERS["lora_ops_segment"]("cpu").status == "pass"
    monkeypatch.setattr(reference, "_data_stamp", lambda weights: ((), ()))  # the copies never learn of a write
    result = VERIFIERS["lora_ops_segment"]("cpu")
    assert result.status == "fail" and "slots rewritten" in result.detail, result.detail[:300]


@pytest.mark.parametrize("modules, says", [
    (["q_proj", "lm_head"], "declares target module(s) lm_head, which the adapter loader never accepts"),
    (["q_proj", "v_proj"], None),  # a subset: the others are refused by the gate, as declared
])  # fmt: skip
def test_probe_checks_the_declared_target_modules_against_the_loader_and_the_gate(tmp_path: Path, modules: list[str], says: str | None) -> None:
    """No check read target_modules: a matrix listing lm_head (which the loader always refuses) verified."""
    from runtime.verifiers import VERIFIERS

    data = yaml.safe_load(DEFAULT_MATRIX_PATH.read_text())
    for capability in ("lora_ops_segment", "lora_ops_per_token"):
        data["cpu"][capability]["limits"]["target_modules"] = modules
    path = tmp_path / "targets.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    result = VERIFIERS["lora_ops_segment"]("cpu", load_matrix(path))
    if says is None:
        assert result.status == "pass" and "target modules: 2 admitted, 5 refused" in result.detail, result.detail[-200:]
    else:
        assert result.status == "fail" and says in result.detail, result.detail


@pytest.mark.parametrize("edit, capability", [
    (lambda cpu: (cpu["max_rank"]["limits"].update(max_rank=32), cpu["prefix_caching"].update(supported=False)), "prefix_caching"),
    (lambda cpu: (cpu["dtypes"]["limits"].update(dtypes=["bfloat16", "float16"]), cpu["prefix_caching"].update(supported=False)), "prefix_caching"),
    (lambda cpu: cpu["dtypes"]["limits"].update(dtypes=["bfloat16", "float16"]), "max_rank"),
])  # fmt: skip
def test_the_probe_s_engine_configs_stay_within_the_section(tmp_path: Path, edit, capability: str) -> None:  # type: ignore[no-untyped-def]
    """The refusal and max_rank checks built a default config (float32, max_lora_rank 64): on a
    section without float32 or with a smaller max_rank, another gate refused it first."""
    from runtime.verifiers import VERIFIERS

    data = yaml.safe_load(DEFAULT_MATRIX_PATH.read_text())
    edit(data["cpu"])
    path = tmp_path / "section.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    result = VERIFIERS[capability]("cpu", load_matrix(path))
    assert result.status == "pass", result.detail


def test_the_int8_quantizer_check_holds_for_a_correct_quantizer_on_any_seed() -> None:
    """Its bound had less slack than float32's rounding of q * s: 135 of 20,000 seeds failed."""
    import backends
    from runtime.quant.capability import check_int8_base

    backend = backends.get_backend("cpu")
    for seed in range(300):
        check_int8_base(backend, dtypes=(torch.float32,), seed=seed)
