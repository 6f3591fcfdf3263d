"""The capability matrix, its gating, and every (backend, capability) verifier.

The per-capability tests are parametrized straight from capability_matrix.yaml and call
the same verifier functions as `lorafleet probe`. Hardware rows carry the `cuda` / `npu`
markers (selected with `-m cuda` / `-m npu`); without the device they skip with the
probe's one-line reason. The npu row also runs on CPU over the torch_npu op emulation
(marker `emulated`).
"""
from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml

import backends
from runtime.capabilities import (
    CapabilityError,
    CapabilityMatrixError,
    DEFAULT_MATRIX_PATH,
    Gate,
    check_adapter,
    check_engine_config,
    load_matrix,
)
from runtime.config import EngineConfig
from runtime.lora.adapter import LoRAAdapter, LoRAModule
from runtime.verifiers import VERIFIERS, run_all

ROOT = Path(__file__).resolve().parents[1]
MATRIX = load_matrix()
HARDWARE_MARK = {"cuda": pytest.mark.cuda, "npu": pytest.mark.npu}


def _matrix_copy(tmp_path: Path, edit) -> Path:
    """A copy of the real matrix with ``edit(data)`` applied, for false-declaration tests."""
    data = yaml.safe_load(DEFAULT_MATRIX_PATH.read_text())
    edit(data)
    path = tmp_path / "capability_matrix.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _verified(backend_name: str, capability: str, result) -> bool:
    """Pass, or skipped as not applicable where the matrix says so (cuda_graph_safety off cuda)."""
    entry = MATRIX.entry(backend_name, capability)
    if result.status == "skipped" and result.metrics.get("not_applicable"):
        return not entry.supported and entry.verified_on.how == "not applicable"
    return result.status == "pass"


def _adapter(name: str, ranks: dict[tuple[int, str], int], in_f: int = 8, out_f: int = 8) -> LoRAAdapter:
    modules = {k: LoRAModule(r, 2.0 / r, torch.randn(r, in_f), torch.randn(out_f, r)) for k, r in ranks.items()}
    top = max(ranks.values())
    return LoRAAdapter(name=name, version="v1", path="/adapters/" + name, modules=modules, max_rank=top, r=top,
                       lora_alpha=2.0, use_rslora=False, target_modules=tuple(sorted({m for _, m in ranks})))


# ---- every declared capability, through the probe's verifiers ------------------------------

CASES = [
    pytest.param(b, c, marks=[HARDWARE_MARK[b]] if b in HARDWARE_MARK else [], id=f"{b}-{c}")
    for b in MATRIX.backends
    for c in MATRIX.capabilities(b)
]


@pytest.mark.parametrize("backend_name, capability", CASES)
def test_capability_verifies(backend_name: str, capability: str) -> None:
    available, reason = backends.availability(backend_name)
    if not available:
        pytest.skip(reason)
    result = VERIFIERS[capability](backend_name, MATRIX)
    assert _verified(backend_name, capability, result), f"{backend_name}.{capability}: {result.status}: {result.detail}"


@pytest.mark.parametrize("backend_name", [b for b in MATRIX.backends if b != "cpu"])
def test_absent_backend_every_verifier_skips_with_the_probe_reason(backend_name: str) -> None:
    available, reason = backends.availability(backend_name)
    if available:
        pytest.skip(f"{backend_name} is present here; test_capability_verifies covers it")
    results = run_all(backend_name, MATRIX)
    assert set(results) == set(MATRIX.capabilities(backend_name))
    for capability, result in results.items():
        assert (result.status, result.detail) == ("skipped", reason), capability


@pytest.mark.emulated
@pytest.mark.parametrize("capability", MATRIX.capabilities("npu"))
def test_npu_row_verifies_on_emulated_torch_npu_ops(capability: str) -> None:
    """The npu row's verifiers against AscendBackend over the documented-op emulation (CPU tensors)."""
    from tests.emulation.torch_npu_ops import EmulatedTorchNpuOps

    backend = backends.backend_class("npu")(device="cpu", npu_ops=EmulatedTorchNpuOps(), soc_name="Ascend910B2")
    result = VERIFIERS[capability]("npu", MATRIX, backend)
    assert _verified("npu", capability, result), f"{result.status}: {result.detail}"


@pytest.mark.emulated
@pytest.mark.parametrize("soc, chip", [("Ascend310P3", "atlas_inference_310p"), ("Ascend910_93", "atlas_a2")])
@pytest.mark.parametrize("capability", ["lora_ops_segment", "lora_ops_per_token", "mixed_ranks", "multi_slice_expand"])
def test_npu_row_verifies_on_chips_whose_declared_fallback_serves_primary_cases(soc: str, chip: str, capability: str) -> None:
    """On a 310P (fp16 grouped matmul only, no fused decode op) or an A3 (neither op documented) the
    matrix's declared fallback serves cases inside the primary limits: the probe passes there and
    says so, where it failed with "apply_lora took the fallback"."""
    from tests.emulation.torch_npu_ops import EmulatedTorchNpuOps

    backend = backends.backend_class("npu")(device="cpu", npu_ops=EmulatedTorchNpuOps(chip=chip), soc_name=soc)
    result = VERIFIERS[capability]("npu", MATRIX, backend)
    assert result.status == "pass", result.detail
    if capability.startswith("lora_ops"):
        assert f"on {soc} the declared fallback may serve primary cases" in result.detail


@pytest.mark.emulated
@pytest.mark.parametrize("soc, refused", [("Ascend310P3", ["bfloat16"]), ("Ascend910ProB", ["bfloat16"]), ("Ascend910B2", []), ("Ascend910_9391", [])])
def test_npu_dtypes_verifier_checks_the_gate_refuses_what_the_chip_lacks(soc: str, refused: list[str]) -> None:
    """A chip whose product line has no bfloat16 (310P inference cards, the first 910s) passes the
    dtypes check only because the engine's gate refuses bf16 there, and the result names it; an A2
    or A3 runs every declared dtype. On 310P the probe used to run bf16 ops a real card cannot."""
    from tests.emulation.torch_npu_ops import EmulatedTorchNpuOps

    backend = backends.backend_class("npu")(device="cpu", npu_ops=EmulatedTorchNpuOps(), soc_name=soc)
    result = VERIFIERS["dtypes"]("npu", MATRIX, backend)
    assert result.status == "pass", result.detail
    assert list(result.metrics["refused_on_device"]) == refused
    assert sorted(result.metrics["max_err"]) == sorted(set(MATRIX.entry("npu", "dtypes").limits.dtypes) - set(refused))
    if refused:
        assert "refused on this device: bfloat16" in result.detail


@pytest.mark.emulated
def test_dtypes_verifier_fails_when_the_gate_lets_a_lacking_dtype_through(monkeypatch: pytest.MonkeyPatch) -> None:
    """The verifier is not a restatement of dtype_problem: a gate that ignored it is caught."""
    from runtime.capabilities import Gate
    from tests.emulation.torch_npu_ops import EmulatedTorchNpuOps

    monkeypatch.setattr(Gate, "check_device_dtype", lambda self, backend, dtype: None)
    backend = backends.backend_class("npu")(device="cpu", npu_ops=EmulatedTorchNpuOps(), soc_name="Ascend310P3")
    result = VERIFIERS["dtypes"]("npu", MATRIX, backend)
    assert result.status == "fail" and "lets it through" in result.detail


def _emulated_npu():
    from tests.emulation.torch_npu_ops import EmulatedTorchNpuOps

    ops = EmulatedTorchNpuOps()
    return backends.backend_class("npu")(device="cpu", npu_ops=ops, soc_name="Ascend910B2"), ops


@pytest.mark.emulated
def test_npu_op_verifiers_reach_the_primary_ops_and_force_the_fallback() -> None:
    """The primary cases run the torch_npu ops (counted by the emulation) and note no fallback in
    apply_lora; the fallback cases run on a backend forced onto the torch path (no op reachable)."""
    for capability, op in (("lora_ops_per_token", "npu_batch_gather_matmul"), ("lora_ops_segment", "npu_grouped_matmul")):
        backend, ops = _emulated_npu()
        result = VERIFIERS[capability]("npu", MATRIX, backend)
        assert result.status == "pass", result.detail
        assert ops.calls[op] > 0, dict(ops.calls)
        reason = "decode:soc" if capability == "lora_ops_per_token" else "prefill:soc"
        assert f"apply_lora noted {reason}" in result.detail and "primary cases took no fallback" in result.detail, result.detail
        assert all(k in result.metrics["max_err"] for k in ("fallback float16", "fallback bfloat16", "fallback float32"))
        # per-token: ranks outside 16..128 (the fallback's) beside ones inside, in one step; segment: one range, no such case
        assert ("op+fallback" in result.detail) == (capability == "lora_ops_per_token"), result.detail


@pytest.mark.emulated
@pytest.mark.parametrize("capability", ["lora_ops_per_token", "mixed_ranks", "multi_slice_expand"])
def test_npu_fused_decode_op_with_a_wrong_scale_fails_the_probe(monkeypatch: pytest.MonkeyPatch, capability: str) -> None:
    """The audit's npu_fused_scale_bug.patch: weight_b doubled in the fused decode op's weights."""
    import backends.ascend.batch_gather as bg

    bucket_weights = bg.bucket_weights
    monkeypatch.setattr(bg, "bucket_weights", lambda w, slots, rank: (lambda a, b: (a, (2 * b.float()).half()))(*bucket_weights(w, slots, rank)))
    backend, ops = _emulated_npu()
    result = VERIFIERS[capability]("npu", MATRIX, backend)
    assert result.status == "fail" and ops.calls["npu_batch_gather_matmul"] > 0, result.detail


@pytest.mark.emulated
def test_npu_segment_fallback_bug_fails_the_fallback_cases(monkeypatch: pytest.MonkeyPatch) -> None:
    """A wrong prefill torch fallback (expand delta doubled) fails lora_ops_segment's fallback cases,
    which therefore run it (on Atlas A2 every primary case takes npu_grouped_matmul)."""
    import backends.ascend.torch_path as tp

    expand_segments = tp.expand_segments
    monkeypatch.setattr(tp, "expand_segments", lambda h_i, *args: expand_segments(2 * h_i, *args))
    result = VERIFIERS["lora_ops_segment"]("npu", MATRIX, _emulated_npu()[0])
    assert result.status == "fail" and "case 'fallback " in result.detail, result.detail


@pytest.mark.emulated
def test_npu_primary_case_that_silently_falls_back_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """Right numbers from the wrong path: a fused decode op never taken fails lora_ops_per_token."""
    import backends.ascend.batch_gather as bg

    monkeypatch.setattr(bg, "unsupported_reason", lambda *a, **k: ("decode:rank", "patched: never the fused op"))
    result = VERIFIERS["lora_ops_per_token"]("npu", MATRIX, _emulated_npu()[0])
    assert result.status == "fail" and "inside the primary limits, apply_lora took the fallback" in result.detail, result.detail


def test_a_declared_fallback_the_verifier_cannot_force_fails(tmp_path: Path) -> None:
    def add_fallback(d):
        d["cpu"]["lora_ops_segment"]["fallback"] = {"when": "never", "implementation": "none", "limits": {"dtypes": ["float32"]}}

    result = VERIFIERS["lora_ops_segment"]("cpu", load_matrix(_matrix_copy(tmp_path, add_fallback)))
    assert result.status == "fail" and "cannot be verified" in result.detail, result.detail


@dataclass(frozen=True)
class InterpretedCudaBackend:
    """The cuda backend's Triton ops on CPU tensors (TRITON_INTERPRET=1); CudaBackend itself
    insists on a cuda device, so the test assembles the same ops around the CPU device."""

    lora: object
    attention: object
    name: str = "cuda"
    device: torch.device = torch.device("cpu")

    def synchronize(self) -> None:
        return None


# quantized_base_int8: the LoRA half through the Triton kernels; its int8 base matmul is the torch path on CPU tensors.
INTERPRETED_CUDA_CAPABILITIES = ("lora_ops_segment", "lora_ops_per_token", "mixed_ranks", "multi_slice_expand", "dtypes", "max_rank",
                                 "quantized_base_int8")


def test_the_cuda_row_claims_the_interpreter_exactly_where_a_test_runs_it() -> None:
    """An entry that names the Triton interpreter (as how it was verified, or as what CI re-runs
    after a hardware run) is one whose verifier the interpreter test below runs, and each of those
    names it; a hardware claim names the GPU it ran on."""
    for capability in MATRIX.capabilities("cuda"):
        verified = MATRIX.entry("cuda", capability).verified_on
        names_interpreter = verified.how == "triton-interpreter" or "TRITON_INTERPRET=1" in verified.where
        assert names_interpreter == (capability in INTERPRETED_CUDA_CAPABILITIES), (capability, verified)
        if verified.how == "hardware":
            assert "NVIDIA" in verified.where, (capability, verified.where)


@pytest.mark.interpreter
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), reason="needs TRITON_INTERPRET=1 set before triton kernels are defined")
@pytest.mark.parametrize("capability", INTERPRETED_CUDA_CAPABILITIES)
def test_cuda_row_lora_capabilities_verify_in_the_triton_interpreter(capability: str) -> None:
    """The cuda row's op claims, checked by the same verifiers, on the real kernels in the interpreter."""
    from backends.cuda.attention import CudaAttention
    from backends.cuda.backend import CudaLoRAOps

    backend = InterpretedCudaBackend(lora=CudaLoRAOps(), attention=CudaAttention())
    result = VERIFIERS[capability]("cuda", MATRIX, backend)
    assert result.status == "pass", result.detail


# ---- the matrix, the registry and the README agree -----------------------------------------

def test_every_capability_has_a_verifier_and_every_verifier_an_entry() -> None:
    declared = set(MATRIX.all_capabilities())
    assert declared - set(VERIFIERS) == set(), "capabilities without a verifier"
    assert set(VERIFIERS) - declared == set(), "verifiers without a capability_matrix.yaml entry"
    for backend_name in MATRIX.backends:
        assert set(MATRIX.capabilities(backend_name)) == declared, backend_name


def test_required_capabilities_are_declared() -> None:
    required = {"lora_ops_segment", "lora_ops_per_token", "mixed_ranks", "multi_slice_expand", "dtypes", "max_rank",
                "paged_attention", "prefix_caching", "cuda_graph_safety", "quantized_base_int8", "dora"}
    assert required <= set(MATRIX.all_capabilities())
    assert MATRIX.entry("npu", "lora_ops_per_token").fallback is not None
    assert not MATRIX.entry("cpu", "dora").supported


def test_readme_section_is_generated_from_the_matrix() -> None:
    spec = importlib.util.spec_from_file_location("gen_capability_docs", ROOT / "scripts" / "gen_capability_docs.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    readme = (ROOT / "README.md").read_text()
    assert gen.splice(readme, gen.render(MATRIX)) == readme, "run: python scripts/gen_capability_docs.py"
    assert "torch_npu.npu_batch_gather_matmul" in gen.render(MATRIX)


# ---- a false declaration makes the verifiers fail -------------------------------------------

def test_declared_float64_on_cpu_fails_the_dtypes_verifier(tmp_path: Path) -> None:
    path = _matrix_copy(tmp_path, lambda d: d["cpu"]["dtypes"]["limits"]["dtypes"].append("float64"))
    result = VERIFIERS["dtypes"]("cpu", load_matrix(path))
    assert result.status == "fail"
    assert "float64" in result.detail


def test_declared_int8_lora_ops_on_cpu_fails_the_op_verifier(tmp_path: Path) -> None:
    path = _matrix_copy(tmp_path, lambda d: d["cpu"]["lora_ops_segment"]["limits"]["dtypes"].append("int8"))
    result = VERIFIERS["lora_ops_segment"]("cpu", load_matrix(path))
    assert result.status == "fail"
    assert "int8" in result.detail


def test_declared_dora_support_fails(tmp_path: Path) -> None:
    path = _matrix_copy(tmp_path, lambda d: d["cpu"]["dora"].update(supported=True))
    assert VERIFIERS["dora"]("cpu", load_matrix(path)).status == "fail"


# ---- gating: start-up config and adapter load ----------------------------------------------

def test_unsupported_dtype_at_startup_fails_with_the_matrix_words(tmp_path: Path) -> None:
    path = _matrix_copy(tmp_path, lambda d: d["cpu"]["dtypes"]["limits"].update(dtypes=["float32"]))
    with pytest.raises(CapabilityError) as err:
        check_engine_config(EngineConfig(model="m", dtype="bfloat16"), "cpu", load_matrix(path))
    text = str(err.value)
    assert "dtype 'bfloat16' is not one of float32" in text
    assert "[cpu.dtypes]" in text and "dtypes: [float32]" in text


def test_max_lora_rank_above_the_matrix_fails_at_startup() -> None:
    with pytest.raises(CapabilityError) as err:
        check_engine_config(EngineConfig(model="m", max_lora_rank=512), "cpu", MATRIX)
    assert "max_lora_rank=512 exceeds max_rank 256" in str(err.value)
    assert "[cpu.max_rank]" in str(err.value) and MATRIX.entry("cpu", "max_rank").note in str(err.value)


def test_supported_config_passes_without_decisions() -> None:
    assert check_engine_config(EngineConfig(model="m", dtype="bfloat16", enable_prefix_caching=True), "cpu", MATRIX) == []


def test_adapter_above_max_rank_is_refused_at_load() -> None:
    with pytest.raises(CapabilityError) as err:
        check_adapter(_adapter("big", {(0, "q_proj"): 300}), "cpu", MATRIX)
    text = str(err.value)
    assert "adapter 'big': rank 300 is outside 1..256" in text and "[cpu.max_rank]" in text


def test_adapter_with_an_undeclared_target_module_is_refused() -> None:
    with pytest.raises(CapabilityError, match="target module 'lm_head' is not one of"):
        check_adapter(_adapter("head", {(0, "q_proj"): 8, (0, "lm_head"): 8}), "cpu", MATRIX)


def test_prefix_caching_declared_unsupported_refuses_the_config(tmp_path: Path) -> None:
    path = _matrix_copy(tmp_path, lambda d: d["cpu"]["prefix_caching"].update(supported=False))
    with pytest.raises(CapabilityError, match=r"prefix_caching is not supported"):
        check_engine_config(EngineConfig(model="m", enable_prefix_caching=True), "cpu", load_matrix(path))


@pytest.mark.parametrize("capability", ["paged_attention", "lora_ops_segment", "lora_ops_per_token", "multi_slice_expand", "dtypes", "max_rank"])
def test_a_capability_every_engine_uses_declared_unsupported_refuses_the_config(tmp_path: Path, capability: str) -> None:
    """Every engine uses these, so an entry declaring one unsupported refuses the config, whatever
    its limits (the gate used to look at the limits only, and a config within them ran)."""
    path = _matrix_copy(tmp_path, lambda d: d["cpu"][capability].update(supported=False))
    with pytest.raises(CapabilityError, match=rf"{capability} is not supported"):
        check_engine_config(EngineConfig(model="m"), "cpu", load_matrix(path))


def test_an_adapter_on_lora_ops_declared_unsupported_is_refused(tmp_path: Path) -> None:
    path = _matrix_copy(tmp_path, lambda d: d["cpu"]["lora_ops_per_token"].update(supported=False))
    with pytest.raises(CapabilityError, match=r"lora_ops_per_token is not supported"):
        check_adapter(_adapter("a", {(0, "q_proj"): 8}), "cpu", load_matrix(path))


@pytest.mark.parametrize("rank, dtype, fallback", [(16, "float16", False), (128, "float16", False), (8, "float16", True),
                                                   (24, "float16", True), (256, "float16", True), (16, "bfloat16", True)])
def test_npu_per_token_fallback_triggers_exactly_where_declared(rank: int, dtype: str, fallback: bool) -> None:
    decisions = check_engine_config(EngineConfig(model="m", dtype=dtype, max_lora_rank=256), "npu", MATRIX)
    decisions += check_adapter(_adapter("a", {(0, "q_proj"): rank}), "npu", MATRIX)
    assert [d.capability for d in decisions] == (["lora_ops_per_token"] if fallback else [])
    if fallback:
        assert "torch path" in decisions[0].fallback and "[npu.lora_ops_per_token]" in decisions[0].message


def test_gate_logs_each_fallback_once(caplog: pytest.LogCaptureFixture) -> None:
    gate = Gate("npu", MATRIX)
    adapter = _adapter("r8", {(0, "q_proj"): 8, (1, "q_proj"): 8})
    with caplog.at_level(logging.WARNING, logger="runtime.capabilities"):
        first = gate.check_adapter(adapter)
        second = gate.check_adapter(adapter)
    assert len(first) == len(second) == 1
    assert len([r for r in caplog.records if "rank 8" in r.getMessage()]) == 1
    assert len(Gate("npu", MATRIX).check_adapter(adapter)) == 1  # a new gate has its own once-state


def test_dora_adapter_is_refused_quoting_the_reason() -> None:
    class DoraAdapter:
        name, max_rank, use_dora = "d", 8, True
        modules = {(0, "q_proj"): LoRAModule(8, 1.0, torch.randn(8, 4), torch.randn(4, 8))}

    with pytest.raises(CapabilityError, match="per-row norm of W\\+BA"):
        check_adapter(DoraAdapter(), "cuda", MATRIX)


# ---- the matrix file is validated, errors name the file and key ----------------------------

def test_missing_matrix_file_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(CapabilityMatrixError, match=str(tmp_path / "nope.yaml")):
        load_matrix(tmp_path / "nope.yaml")


@pytest.mark.parametrize("edit, key", [
    (lambda d: d["cpu"]["dtypes"]["limits"].update(dtypes=["floatx"]), "cpu.dtypes.limits.dtypes[0]"),
    (lambda d: d["npu"]["max_rank"]["limits"].update(max_rank=0), "npu.max_rank.limits.max_rank"),
    (lambda d: d["cuda"]["dora"].pop("note"), "cuda.dora.note"),
    (lambda d: d["cpu"]["mixed_ranks"].update(colour="red"), "cpu.mixed_ranks.colour"),
    (lambda d: d["cpu"]["dtypes"]["verified_on"].update(how="vibes"), "cpu.dtypes.verified_on.how"),
    (lambda d: d.update(schema_version=2), "schema_version"),
    (lambda d: d.pop("npu"), "npu"),
    (lambda d: d["cuda"].pop("dora"), "cuda.dora"),
])
def test_malformed_matrix_is_refused_naming_the_key(tmp_path: Path, edit, key: str) -> None:
    path = _matrix_copy(tmp_path, edit)
    with pytest.raises(CapabilityMatrixError) as err:
        load_matrix(path)
    assert str(err.value).startswith(f"{path}: {key}:"), str(err.value)


# ---- each check can fail: the bug it guards against, injected, makes it fail ----------------

def _batched_views(monkeypatch: pytest.MonkeyPatch, edit) -> None:
    """Patch backends/reference.py ``SlotViews.build`` so ``edit`` rewrites every slot's views."""
    import backends.reference as ref

    build = ref.SlotViews.build.__func__
    monkeypatch.setattr(ref.SlotViews, "build", classmethod(lambda cls, weights, slot, as_float32=False: edit(build(cls, weights, slot, as_float32))))


@pytest.mark.parametrize("decode_only", [False, True])
def test_equal_width_case_runs_the_batched_expand_on_cpu(decode_only: bool) -> None:
    from runtime.verifiers.lora_ops import batched_expand_case

    backend = backends.get_backend("cpu")
    metrics = batched_expand_case(backend, "float32", [1, 256, 24, 7], seed=3, decode_only=decode_only)
    assert metrics["engine_order_calls"]["baddbmm_"] == 3  # one per one-scale adapter; the last has a scale per slice
    metrics = batched_expand_case(backend, "bfloat16", [1, 256, 24], seed=4, decode_only=decode_only)
    assert metrics["engine_order_calls"]["baddbmm_"] == 2  # bf16 too: the same float32 work on float32 copies


@pytest.mark.parametrize("capability", ["lora_ops_segment", "lora_ops_per_token", "multi_slice_expand"])
def test_wrong_scale_in_the_batched_expand_fails_the_op_verifiers(monkeypatch: pytest.MonkeyPatch, capability: str) -> None:
    import dataclasses

    _batched_views(monkeypatch, lambda v: dataclasses.replace(v, b_scale=2 * v.b_scale) if v.b_block is not None else v)
    result = VERIFIERS[capability]("cpu", MATRIX)
    assert result.status == "fail" and "rows in engine order" in result.detail, result.detail


def test_batched_expand_ignoring_per_slice_scales_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """An adapter whose slices have one rank but different scales must not take the one-scale expand."""
    import dataclasses

    import backends.reference as ref
    from runtime.lora.slice_weights import interleaved_b

    build = ref.SlotViews.build.__func__

    def build_ignoring_scale(cls, weights, slot, as_float32=False):
        v = build(cls, weights, slot, as_float32)
        group = interleaved_b(weights)
        if v.b_block is None and v.a_block is not None and group is not None and len(v.slices) == len(weights) \
                and len({r for _, r, *_ in v.slices}) == 1:
            start = weights[0].host_start[slot]
            return dataclasses.replace(v, b_block=group[start : start + v.rank].transpose(0, 1), b_scale=v.slices[0][4])
        return v

    monkeypatch.setattr(ref.SlotViews, "build", classmethod(build_ignoring_scale))
    result = VERIFIERS["multi_slice_expand"]("cpu", MATRIX)
    assert result.status == "fail" and "rows in engine order" in result.detail, result.detail


def test_batched_expand_not_taken_fails_even_when_the_numbers_are_right(monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses

    _batched_views(monkeypatch, lambda v: dataclasses.replace(v, b_block=None))
    result = VERIFIERS["multi_slice_expand"]("cpu", MATRIX)
    assert result.status == "fail" and "batched expand" in result.detail and "ran 0 times" in result.detail, result.detail


def test_paged_attention_checks_masked_decode_groups_and_several_groups() -> None:
    result = VERIFIERS["paged_attention"]("cpu", MATRIX)
    assert result.status == "pass", result.detail
    assert set(result.metrics["decode_groups"]) == set(MATRIX.entry("cpu", "paged_attention").limits.dtypes)
    assert all(n == 3 for n in result.metrics["decode_groups"].values())  # contexts [3, 6], [9, 11], [14]


@pytest.mark.parametrize("bug", ["no_length_mask", "rows_swapped", "budget_ignored"])
def test_decode_group_bugs_fail_paged_attention(monkeypatch: pytest.MonkeyPatch, bug: str) -> None:
    import dataclasses

    import backends.reference as ref

    if bug == "budget_ignored":
        monkeypatch.setattr(ref.ReferenceAttention, "decode_groups", lambda self, seqs, *a, **k: [seqs] if seqs else [])
    else:
        plan = ref.ReferenceAttention._step_plan

        def broken(self, device, kv_cache, meta):
            groups, chunks = plan(self, device, kv_cache, meta)
            edit = {"no_length_mask": lambda g: dataclasses.replace(g, mask=None),
                    "rows_swapped": lambda g: dataclasses.replace(g, rows=g.rows.flip(0))}[bug]
            return [edit(g) for g in groups], chunks

        monkeypatch.setattr(ref.ReferenceAttention, "_step_plan", broken)
    result = VERIFIERS["paged_attention"]("cpu", MATRIX)
    assert result.status == "fail", result.detail
    if bug == "budget_ignored":
        assert "ran as 1 SDPA group" in result.detail


def test_dora_folder_is_refused_by_the_real_loader_quoting_the_matrix(tmp_path: Path) -> None:
    from runtime.lora.adapter import AdapterError, load_adapter
    from runtime.verifiers.refusals import DORA_LAYERS, DORA_RANK, DORA_TARGETS, write_peft_adapter

    folder = write_peft_adapter(tmp_path / "dora", use_dora=True)
    with pytest.raises(AdapterError) as err:
        load_adapter(folder, "dora", DORA_TARGETS, num_layers=DORA_LAYERS, max_lora_rank=DORA_RANK)
    text = str(err.value)
    assert "use_dora=True is not supported" in text and "DoRA" in text
    assert "capability_matrix.yaml [cpu.dora, cuda.dora, npu.dora]" in text and MATRIX.entry("cuda", "dora").note in text
    result = VERIFIERS["dora"]("cpu", MATRIX)
    assert result.status == "pass" and "load_adapter" in result.detail and "[cpu.dora" in result.metrics["refusal"]


@pytest.mark.parametrize("bug", ["not_refused", "silently_loaded", "message_without_matrix"])
def test_dora_loader_bugs_fail_the_dora_verifier(monkeypatch: pytest.MonkeyPatch, bug: str) -> None:
    import runtime.capabilities as caps
    import runtime.lora.adapter as ad

    if bug in ("not_refused", "silently_loaded"):
        monkeypatch.setattr(ad, "_REFUSED_IF_TRUTHY", tuple(k for k in ad._REFUSED_IF_TRUTHY if k != "use_dora"))
    if bug == "silently_loaded":
        check = ad._check_tensors
        monkeypatch.setattr(ad, "_check_tensors", lambda header, *a: check({k: v for k, v in header.items() if "magnitude" not in k}, *a))
    if bug == "message_without_matrix":
        monkeypatch.setattr(caps, "unsupported_quote", lambda capability, matrix=None: "not implemented")
    result = VERIFIERS["dora"]("cpu", MATRIX)
    assert result.status == "fail", result.detail
    expected = {"not_refused": "does not name DoRA", "silently_loaded": "loaded through", "message_without_matrix": "does not point to the matrix"}
    assert expected[bug] in result.detail, result.detail


@pytest.mark.parametrize("backend_name", ["cpu", "npu"])
def test_cuda_graph_safety_is_not_applicable_off_cuda_not_a_pass(backend_name: str) -> None:
    """No code path asks for cuda_graph_safety off cuda, so there is no refusal a pass could vouch for."""
    entry = MATRIX.entry(backend_name, "cuda_graph_safety")
    assert not entry.supported and entry.verified_on.how == "not applicable"
    backend = None
    if backend_name == "npu":
        from tests.emulation.torch_npu_ops import EmulatedTorchNpuOps

        backend = backends.backend_class("npu")(device="cpu", npu_ops=EmulatedTorchNpuOps(), soc_name="Ascend910B2")
    result = VERIFIERS["cuda_graph_safety"](backend_name, MATRIX, backend)
    assert result.status == "skipped" and result.detail.startswith("not applicable") and entry.note in result.detail


def test_cuda_graph_safety_claimed_verified_off_cuda_fails(tmp_path: Path) -> None:
    path = _matrix_copy(tmp_path, lambda d: d["cpu"]["cuda_graph_safety"]["verified_on"].update(how="cpu"))
    result = VERIFIERS["cuda_graph_safety"]("cpu", load_matrix(path))
    assert result.status == "fail" and "nothing to verify" in result.detail


def test_not_applicable_is_only_for_unsupported_entries(tmp_path: Path) -> None:
    path = _matrix_copy(tmp_path, lambda d: d["cpu"]["dtypes"]["verified_on"].update(how="not applicable"))
    with pytest.raises(CapabilityMatrixError, match=r"cpu\.dtypes\.verified_on\.how: 'not applicable' is only for"):
        load_matrix(path)


# ---- fp32 accumulate: cancelling sums, the tolerance on the result ------------------------------

def _half_precision_row_ranges(monkeypatch: pytest.MonkeyPatch, summed_in_half: bool) -> None:
    """Replace the cpu engine-order path (``apply_row_ranges``) for fp16/bf16 by one that either sums
    in the compute dtype (a running sum over K, then over the rank), or, as the audit's half_accum.py
    does, rounds h and the delta to it (torch's CPU half matmul itself accumulates in float32)."""
    import backends.reference as ref

    original = ref.apply_row_ranges

    def running(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        acc = torch.zeros(a.shape[0], b.shape[1], dtype=a.dtype)
        for k in range(a.shape[1]):
            acc += a[:, k : k + 1] * b[k : k + 1]
        return acc

    def half(x, y, weights, meta, offsets):
        if y.dtype == torch.float32:
            return original(x, y, weights, meta, offsets)
        for k, slot in enumerate(meta.host_seg_slots):
            rows = slice(meta.first_row + meta.host_seg_starts[k], meta.first_row + meta.host_seg_starts[k + 1])
            for w, off in zip(weights, offsets):
                r, s, scale = w.host_rank[slot], w.host_start[slot], w.host_scale[slot]
                if r:
                    a, b = w.a_rows[s : s + r].t(), w.b_rows[s : s + r]
                    delta = running(running(x[rows], a), b) if summed_in_half else (x[rows] @ a) @ b
                    y[rows, off : off + w.out_features] += delta * scale

    monkeypatch.setattr(ref, "apply_row_ranges", half)


@pytest.mark.parametrize("capability", ["lora_ops_segment", "lora_ops_per_token"])
@pytest.mark.parametrize("summed_in_half, case", [(True, "fp32 accumulate"), (False, "fp32 h, cast once")])
def test_half_precision_accumulation_fails_the_op_verifiers(monkeypatch: pytest.MonkeyPatch, capability: str,
                                                            summed_in_half: bool, case: str) -> None:
    import runtime.verifiers.lora_ops as lora_ops

    _half_precision_row_ranges(monkeypatch, summed_in_half)
    # The injected path has no batched expand: leave that claim unchecked for half dtypes, so the
    # accumulation cases are what fails.
    claim = lora_ops.runs_batched_expand
    monkeypatch.setattr(lora_ops, "runs_batched_expand", lambda backend, dtype: dtype == torch.float32 and claim(backend, dtype))
    result = VERIFIERS[capability]("cpu", MATRIX)
    assert result.status == "fail" and f"case '{case} " in result.detail and "rows in engine order" in result.detail, result.detail


# ---- attention: a scale other than SDPA's default -----------------------------------------------

def test_attention_problems_use_a_scale_other_than_the_default() -> None:
    from runtime.verifiers.attention_problem import HEAD_DIM, random_step

    g = torch.Generator().manual_seed(0)
    scales = [random_step([1], [3], [[0]], torch.float32, torch.device("cpu"), g).scale for _ in range(20)]
    assert all(0.3 * HEAD_DIM**-0.5 <= s <= 0.6 * HEAD_DIM**-0.5 for s in scales) and len(set(scales)) == 20


@pytest.mark.parametrize("capability", ["paged_attention", "prefix_caching", "dtypes"])
def test_attention_that_drops_the_callers_scale_fails(monkeypatch: pytest.MonkeyPatch, capability: str) -> None:
    import torch.nn.functional as F

    import backends.reference as ref

    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(ref, "F", type("F", (), {"scaled_dot_product_attention": staticmethod(lambda *a, scale=None, **k: sdpa(*a, **k))}))
    result = VERIFIERS[capability]("cpu", MATRIX)
    assert result.status == "fail" and "paged_attention" in result.detail, result.detail


# ---- cuda_graph_safety's replay check, with an eager stand-in for the graph -----------------------

def _eager_capture(fn):
    """Runs ``fn`` now and again at each "replay": the kernels of a replayed graph read the captured
    device buffers, which an eager re-run also does; host values are whatever the backend kept."""
    fn()
    return fn


class _DeviceSlotOps:
    """The reference ops driven only by the device copy of the slots, as a graph-safe backend is;
    ``stray`` also writes column 0 of y, which belongs to no slice."""

    def __init__(self, stray: bool = False) -> None:
        from backends.reference import ReferenceLoRAOps

        self.ops, self.stray = ReferenceLoRAOps(), stray

    def apply(self, x, y, weights, meta, offsets, workspace):
        from runtime.lora.batch_meta import LoRABatchMeta

        fresh = LoRABatchMeta.build(meta.token_slots.tolist(), x.device, decode_only=meta.decode_only)
        self.ops.apply(x, y, weights, fresh, offsets, workspace)
        if self.stray:
            y[:, 0] += 1


@pytest.mark.parametrize("decode_only", [False, True])
@pytest.mark.parametrize("ops, error", [("device", None), ("host", "exceeds tolerance"), ("stray", "columns outside the slices")])
def test_graph_replay_check_changes_slots_and_checks_untouched_entries(decode_only: bool, ops: str, error: str | None) -> None:
    """Replayed with other adapters in the rows: a backend reading the device slots passes; one that
    keeps the slots it saw at capture (the reference ops plan from the host mirrors) fails, and so
    does a stray write outside the slices."""
    from types import SimpleNamespace

    from backends.reference import ReferenceLoRAOps
    from runtime.verifiers.cuda_graph import check_replay
    from runtime.verifiers.lora_ops import QKV_OUTS
    from runtime.verifiers.lora_problem import build_problem
    from runtime.verifiers.result import VerificationFailure

    lora = {"device": _DeviceSlotOps(), "host": ReferenceLoRAOps(), "stray": _DeviceSlotOps(stray=True)}[ops]
    backend = SimpleNamespace(device=torch.device("cpu"), lora=lora, synchronize=lambda: None)
    p = build_problem(backend.device, torch.float32, [4, 16, 9], QKV_OUTS, 32, seed=5)
    if error is None:
        assert check_replay(backend, p, decode_only, _eager_capture) < 1e-4
    else:
        with pytest.raises(VerificationFailure, match=error):
            check_replay(backend, p, decode_only, _eager_capture)


@pytest.mark.interpreter
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), reason="needs TRITON_INTERPRET=1 set before triton kernels are defined")
def test_graph_replay_check_passes_the_triton_kernels_interpreted() -> None:
    """The kernels read the slots, segments and tiles from device memory, so rewriting those in place
    between capture and replay serves the new adapters (an eager stand-in: no GPU here)."""
    from backends.cuda.attention import CudaAttention
    from backends.cuda.backend import CudaLoRAOps
    from runtime.verifiers.cuda_graph import check_replay
    from runtime.verifiers.lora_ops import QKV_OUTS
    from runtime.verifiers.lora_problem import build_problem

    backend = InterpretedCudaBackend(lora=CudaLoRAOps(), attention=CudaAttention())
    for decode_only in (False, True):
        p = build_problem(backend.device, torch.float32, [4, 16, 9], QKV_OUTS, 32, seed=6)
        assert check_replay(backend, p, decode_only, _eager_capture) < 1e-4


def test_the_engine_runs_the_gates_at_start_and_at_adapter_load(tmp_path: Path, tiny_llama_dir: Path, tiny_adapters, monkeypatch) -> None:
    """The gate functions are tested above; this checks that LLMEngine calls them: a config beyond
    max_rank is refused at start, and an adapter on a module the matrix leaves out at load."""
    import runtime.capabilities as capabilities
    from runtime.engine import LLMEngine

    def config(**overrides) -> EngineConfig:  # type: ignore[no-untyped-def]
        return EngineConfig(model=str(tiny_llama_dir), device="cpu", max_loras=2, max_cpu_loras=4, num_kv_blocks=32, block_size=4, **overrides)

    with pytest.raises(CapabilityError, match=r"max_lora_rank=300 exceeds max_rank 256.*\[cpu.max_rank\]"):
        LLMEngine(config(max_lora_rank=300))
    path = _matrix_copy(tmp_path, lambda d: [d["cpu"][c]["limits"].update(target_modules=["q_proj"]) for c in ("lora_ops_segment", "lora_ops_per_token")])
    monkeypatch.setattr(capabilities, "DEFAULT_MATRIX_PATH", path)
    engine = LLMEngine(config(max_lora_rank=16))
    try:
        with pytest.raises(CapabilityError, match=r"target module 'v_proj' is not one of q_proj"):
            engine.register_adapter("a", str(tiny_adapters["a"]))  # adapter "a" targets q_proj and v_proj
        assert not engine.adapters()
    finally:
        engine.close()
