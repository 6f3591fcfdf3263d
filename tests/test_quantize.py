"""int8 weight-only base: the math vs float64, the checkpoint format, loading, LoRA on top, errors.

References: float64 torch for the quantizer and the int8 GEMM; transformers (on the
dequantized weights) for whole-model greedy output; PEFT for LoRA over the int8 base.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from backends import get_backend
from runtime.cli import main as cli_main
from runtime.config import EngineConfig
from runtime.merge.merger import MergeSpec, write_checkpoint
from runtime.model_runner import ModelRunner, SeqStep
from runtime.models.hf_config import load_model_config
from runtime.models.loader import CheckpointError, check_checkpoint
from runtime.quant.int8 import QUANT_METHOD, Int8Weight, dequantize_int8, int8_linear, is_quantized_projection, quantize_int8
from tests.test_peft_match import make_runner, peft_model, rel_err

PROJECTIONS = 7


def _weight(seed: int, rows: int = 48, cols: int = 40) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Rows of very different magnitude: a per-tensor scale would fail the per-row bound below.
    return torch.randn(rows, cols, generator=g) * torch.logspace(-3, 1, rows)[:, None]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_quantize_int8_matches_the_float64_definition(seed: int) -> None:
    w = _weight(seed)
    w[5] = 0.0  # an all-zero row: codes 0, no division by zero
    qw = quantize_int8(w)
    w64 = w.double()
    s64 = w64.abs().amax(1) / 127
    s64[5] = 1.0
    assert qw.q.dtype == torch.int8 and qw.scale.dtype == torch.float32
    torch.testing.assert_close(qw.scale.double(), s64, rtol=1e-6, atol=0)
    expected_q = torch.round(w64 / qw.scale.double()[:, None])
    assert torch.equal(qw.q.double(), expected_q)
    assert int(qw.q.abs().max()) == 127 and int(qw.q[5].abs().max()) == 0
    err = (dequantize_int8(qw.q, qw.scale).double() - w64).abs()
    assert (err <= qw.scale.double()[:, None] / 2 * (1 + 1e-6)).all()  # round-to-nearest bound, per row


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int8_linear_in_range_with_outlier_activations_and_small_scales(dtype: torch.dtype) -> None:
    """An outlier activation (1500) against a small-std weight, and rows with tiny scales: y stays
    finite and close to the float64 reference in every dtype (float16's x @ q^T would be ~1/s
    times larger than y: inf here, and a scale of ~1e-6 flushes to zero in float16)."""
    g = torch.Generator().manual_seed(11)
    w = torch.randn(8, 512, generator=g) * 0.01
    w[6] *= 1e-2  # amax ~ 3e-4: scale ~ 2.5e-6
    w[7] *= 1e-1
    x = torch.randn(4, 512, generator=g)
    x[:, 3] = 1500.0
    qw = quantize_int8(w)
    ref = x.double() @ dequantize_int8(qw.q, qw.scale).double().T
    y = int8_linear(x.to(dtype), qw).double()
    assert torch.isfinite(y).all()
    rel = (y - ref).abs().amax(0) / ref.abs().amax(0)  # per output channel, so tiny rows count as much as big ones
    assert float(rel.max()) < (1e-5 if dtype == torch.float32 else 3e-2), rel


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
def test_int8_linear_equals_x_times_dequantized_weight(dtype: torch.dtype, tol: float) -> None:
    g = torch.Generator().manual_seed(7)
    w, x, b = _weight(3), torch.randn(9, 40, generator=g), torch.randn(48, generator=g)
    qw = quantize_int8(w)
    ref = x.double() @ dequantize_int8(qw.q, qw.scale).double().T + b.double()
    y = int8_linear(x.to(dtype), qw, b.to(dtype))
    assert y.dtype == dtype
    assert float(((y.double() - ref).abs().max()) / ref.abs().max()) < tol
    assert qw.q.dtype == torch.int8  # the codes were cast for the matmul only


def _quantize(base: Path, out: Path, *extra: str) -> int:
    return cli_main(["quantize", "--model", str(base), "--out", str(out), *extra])


@pytest.fixture(scope="module")
def int8_dirs(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(int8 checkpoint from the CLI, float32 dequantized copy of it)."""
    root = tmp_path_factory.mktemp("int8")
    assert _quantize(tiny_llama_dir, root / "q8") == 0
    deq = root / "deq"
    deq.mkdir()
    write_checkpoint(MergeSpec(root / "q8", None, torch.float32, quantize_output=False), deq, progress=False)
    return root / "q8", deq


def test_quantize_cli_writes_the_documented_format(tiny_llama_dir: Path, int8_dirs: tuple[Path, Path]) -> None:
    q8, _ = int8_dirs
    cfg = json.loads((q8 / "config.json").read_text())
    assert cfg["quantization_config"] == {"quant_method": QUANT_METHOD, "bits": 8, "group": "per-output-channel"}
    tensors = load_file(str(q8 / "model.safetensors"))
    base = load_file(str(tiny_llama_dir / "model.safetensors"))
    projections = [n for n in base if is_quantized_projection(n)]
    assert len(projections) == PROJECTIONS * 2
    for name in base:
        if is_quantized_projection(name):
            assert tensors[name].dtype == torch.int8 and tensors[name + "_scale"].dtype == torch.float32
            expected = quantize_int8(base[name])
            assert torch.equal(tensors[name], expected.q) and torch.equal(tensors[name + "_scale"], expected.scale)
        else:
            assert torch.equal(tensors[name], base[name])  # embeddings, norms, lm_head stay float
    manifest = json.loads((q8 / "lorafleet_quantize.json").read_text())
    assert manifest["output"]["quantization"]["quant_method"] == QUANT_METHOD
    assert len(manifest["base"]["weights_sha256"]) == 64
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (q8 / name).read_bytes() == (tiny_llama_dir / name).read_bytes()


def _runner(model: Path) -> ModelRunner:
    return ModelRunner(EngineConfig(model=str(model), device="cpu", max_loras=1, max_lora_rank=8, num_kv_blocks=16,
                                    block_size=8, max_num_batched_tokens=64), get_backend("cpu"))  # fmt: skip


def test_int8_checkpoint_stays_int8_in_memory_and_matches_transformers(int8_dirs: tuple[Path, Path]) -> None:
    from transformers import AutoModelForCausalLM

    q8, deq = int8_dirs
    runner = _runner(q8)
    proj = runner.model.layers[0].projections["qkv_proj"]
    assert isinstance(proj.weight, Int8Weight) and proj.weight.q.dtype == torch.int8
    assert runner.memory_report()["weights_bytes"] < _runner(deq).memory_report()["weights_bytes"]
    hf = AutoModelForCausalLM.from_pretrained(str(deq), dtype=torch.float32).eval()
    prompt = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = hf.generate(prompt, max_new_tokens=12, do_sample=False, min_new_tokens=12)[0, 9:].tolist()
    ours, toks = [], prompt[0].tolist()
    step = SeqStep(toks, 0, [0, 1, 2])
    for i in range(12):
        nxt = int(runner.execute([step]).argmax(-1))
        ours.append(nxt)
        step = SeqStep([nxt], 9 + i, [0, 1, 2])
    assert ours == ref


def test_float_lora_over_int8_base_matches_peft_on_the_dequantized_base(int8_dirs: tuple[Path, Path], tiny_adapters: dict[str, Path]) -> None:
    q8, deq = int8_dirs
    adapters = {k: tiny_adapters[k] for k in ("a", "e")}
    order = ["a", None, "e"]
    runner, slots = make_runner(q8, adapters)
    model = peft_model(deq, adapters)
    prompts = torch.randint(0, 256, (3, 10), generator=torch.Generator().manual_seed(9))
    steps = [SeqStep(prompts[b].tolist(), 0, list(range(b * 6, b * 6 + 6)), slots[n] if n else -1) for b, n in enumerate(order)]
    ours = runner.execute(steps)
    with torch.no_grad():
        ref = model(prompts, adapter_names=[n or "__base__" for n in order]).logits[:, -1]
    assert float(rel_err(ours, ref).max()) < 1e-4
    assert float((ours[0] - ours[1]).abs().max()) > 1e-2  # the adapter row really differs from the base row


def test_unknown_quantization_method_is_refused(tiny_llama_dir: Path, tmp_path: Path) -> None:
    bad = tmp_path / "gptq"
    bad.mkdir()
    for f in tiny_llama_dir.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config\.json: quantization_config\.quant_method 'gptq' is not supported"):
        _runner(bad)


def test_a_legacy_gptq_quantize_config_json_is_refused_by_name(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """Older AutoGPTQ checkpoints keep their settings in quantize_config.json, not in config.json: they
    were refused only as missing float tensors (their qweight/scales names), which did not say why."""
    bad = tmp_path / "old-gptq"
    bad.mkdir()
    for f in tiny_llama_dir.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    (bad / "quantize_config.json").write_text(json.dumps({"bits": 4, "group_size": 128, "desc_act": False}))
    with pytest.raises(CheckpointError, match=r"quantize_config\.json: a GPTQ-style quantized checkpoint .* is not supported"):
        _runner(bad)


def _broken_copy(q8: Path, tmp_path: Path, damage) -> Path:  # type: ignore[no-untyped-def]
    """A copy of the int8 checkpoint whose tensors ``damage(tensors)`` edited in place."""
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in q8.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(q8 / "model.safetensors"))
    damage(tensors)
    save_file(tensors, str(broken / "model.safetensors"))
    return broken


def test_int8_checkpoint_missing_a_scale_names_the_tensor(int8_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    broken = _broken_copy(int8_dirs[0], tmp_path, lambda t: t.pop("model.layers.1.mlp.down_proj.weight_scale"))
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) model\.layers\.1\.mlp\.down_proj\.weight_scale"):
        _runner(broken)


@pytest.mark.parametrize("damage, message", [("nan_scale", "holds a scale that is not a finite positive number"), ("zero_scale", "holds a scale that is not a finite positive number"),
                                             ("code_-128", "holds code -128")])  # fmt: skip
def test_int8_checkpoint_with_bad_contents_names_the_tensor(int8_dirs: tuple[Path, Path], tmp_path: Path, damage: str, message: str) -> None:
    name = "model.layers.0.self_attn.q_proj.weight"

    def edit(tensors: dict) -> None:
        if damage == "code_-128":
            tensors[name][0, 0] = -128
        else:
            tensors[name + "_scale"][2] = float("nan") if damage == "nan_scale" else 0.0

    broken = _broken_copy(int8_dirs[0], tmp_path, edit)
    name += "" if damage == "code_-128" else "_scale"
    with pytest.raises(CheckpointError, match=rf"tensor {name.replace('.', '[.]')} {message}"):
        _runner(broken)


def test_quantize_cli_errors(int8_dirs: tuple[Path, Path], tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    q8, _ = int8_dirs
    assert _quantize(q8, tmp_path / "again") == 2
    assert "already int8" in capsys.readouterr().err
    (tmp_path / "exists").mkdir()
    assert _quantize(tiny_llama_dir, tmp_path / "exists") == 2
    assert "already exists" in capsys.readouterr().err
    assert _quantize(tiny_llama_dir, tiny_llama_dir / "sub", "--force") == 2
    assert "inside the input" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exists"]  # nothing half-written


def test_sharded_int8_checkpoint_keeps_the_index_format(int8_dirs: tuple[Path, Path], tiny_llama_dir: Path, tmp_path: Path) -> None:
    from runtime.commands.quantize import quantize_checkpoint

    out = quantize_checkpoint(str(tiny_llama_dir), str(tmp_path / "sharded"), progress=False, max_shard_bytes=40_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and not (out / "model.safetensors").exists()
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for s in shards for t in load_file(str(out / s)).values()
    )
    with safe_open(str(out / index["weight_map"]["model.layers.0.self_attn.q_proj.weight"]), "pt") as f:
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight").dtype == torch.int8
    single, sharded = _runner(int8_dirs[0]), _runner(out)
    for a, b in zip(single.model.layers, sharded.model.layers):
        for name in a.projections:
            assert torch.equal(a.projections[name].weight.q, b.projections[name].weight.q)
            assert torch.equal(a.projections[name].weight.scale, b.projections[name].weight.scale)
    step = [SeqStep([1, 2, 3, 4], 0, [0])]
    torch.testing.assert_close(single.execute(step), sharded.execute(step), rtol=1e-6, atol=1e-6)


def test_capability_check_passes_on_cpu_and_catches_a_backend_that_drops_lora() -> None:
    from dataclasses import dataclass
    from typing import Any

    from runtime.quant.capability import check_int8_base

    cpu = get_backend("cpu")
    figures = check_int8_base(cpu)
    assert set(figures) == {"rel_err_float32", "rel_err_bfloat16", "rel_err_float16"} and figures["rel_err_float32"] < 1e-5

    @dataclass
    class NoExpand:
        inner: Any

        def shrink(self, *args: Any) -> None:
            self.inner.shrink(*args)

        def expand(self, *args: Any) -> None:  # forgets the delta
            return None

    @dataclass
    class Broken:
        lora: Any
        device: str = "cpu"

        def synchronize(self) -> None:
            return None

    with pytest.raises(AssertionError, match="quantized_base_int8 float32: relative error"):
        check_int8_base(Broken(NoExpand(cpu.lora)))


def test_cpu_gemm_on_an_int8_checkpoint_with_a_tied_lm_head_is_refused(tmp_path: Path) -> None:
    """cpu_gemm picks the kernel of the float32 weights; an int8 checkpoint's projections run int8 whatever it
    says, so it chooses only the kernel of an untied LM head. With the head tied to the embedding there is no
    weight left for it to choose for: onednn and mkl built the same model. An explicit choice is refused there
    (as with another dtype), not ignored; auto stays accepted, and an untied int8 checkpoint keeps the choice."""
    from runtime.config import ConfigError
    from runtime.engine import LLMEngine
    from tests.fixtures.tiny_models import build_tiny_model

    tied = build_tiny_model(tmp_path / "tied", "llama", seed=0, tie_word_embeddings=True)
    assert _quantize(tied, tmp_path / "tied-q8") == 0
    untied = build_tiny_model(tmp_path / "untied", "llama", seed=0)
    assert _quantize(untied, tmp_path / "untied-q8") == 0

    def config(model: Path, cpu_gemm: str) -> EngineConfig:
        return EngineConfig(model=str(model), device="cpu", cpu_gemm=cpu_gemm, max_loras=1, max_lora_rank=8, num_kv_blocks=16, block_size=8)

    for choice in ("onednn", "mkl"):
        with pytest.raises(ConfigError, match=f"cpu_gemm: {choice!r} .*int8.*tied.*would change nothing"):
            LLMEngine(config(tmp_path / "tied-q8", choice))
        for model in (tmp_path / "untied-q8", tied):  # an untied int8 LM head, or a float32 model: the choice applies
            LLMEngine(config(model, choice)).close()
    LLMEngine(config(tmp_path / "tied-q8", "auto")).close()


@pytest.mark.parametrize("named", [{}, {"torch_dtype": "auto"}, {"dtype": "auto"}], ids=["none", "torch_dtype-auto", "dtype-auto"])
def test_quantize_default_dtype_is_the_stored_one_when_config_json_names_none(tmp_path: Path, named: dict) -> None:
    """--dtype's default is "the base's dtype": a bfloat16 checkpoint whose config.json names no dtype, or
    "auto" (transformers' word for the dtype the weights are stored in), keeps its float tensors bfloat16
    (read from the weights, as `lorafleet merge` does), not float32 at twice the size ("auto" gave float32)."""
    from tests.fixtures.tiny_models import build_tiny_model

    base = build_tiny_model(tmp_path / "bf16", "llama", seed=0, dtype=torch.bfloat16)
    cfg = json.loads((base / "config.json").read_text())
    for key in ("dtype", "torch_dtype"):
        cfg.pop(key, None)
    (base / "config.json").write_text(json.dumps({**cfg, **named}))
    assert _quantize(base, tmp_path / "q8") == 0
    tensors = load_file(str(tmp_path / "q8" / "model.safetensors"))
    assert tensors["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert tensors["model.norm.weight"].dtype == torch.bfloat16
    written = json.loads((tmp_path / "q8" / "config.json").read_text())
    assert [written[k] for k in (named or {"torch_dtype": None})] == ["bfloat16"]  # "auto" replaced by the dtype written


def test_integer_tensors_in_a_float_checkpoint_are_refused_not_cast(int8_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    """int8 codes whose quantization_config (and scales) were dropped are not weights: cast to float they
    are W / s, 100-1000x too large. Serving refuses such a checkpoint from the headers, naming the tensor,
    and so does quantize (before anything is written)."""
    broken = _broken_copy(int8_dirs[0], tmp_path, lambda t: [t.pop(n) for n in list(t) if n.endswith("_scale")])
    cfg = json.loads((broken / "config.json").read_text())
    del cfg["quantization_config"]
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor model\.layers\.0\.\S+_proj\.weight is stored as I8; .*float"):
        _runner(broken)
    with pytest.raises(CheckpointError, match=r"is stored as I8"):
        check_checkpoint(load_model_config(broken), broken)


@pytest.mark.parametrize("damage, message", [("negative_scale", "holds a scale that is not a finite positive number"),
                                             ("bf16_scale", "is torch.bfloat16; the int8 weight-only format stores it as torch.float32"),
                                             ("code_-128", "holds code -128")])  # fmt: skip
def test_merge_reads_an_int8_base_with_the_checks_serving_makes(int8_dirs: tuple[Path, Path], tmp_path: Path, damage: str, message: str) -> None:
    """Merge (and the float copy verification writes) dequantize the int8 base themselves: a scale or code
    that serving refuses must be refused there too, not folded into W = q * s (a negative scale flips a
    row's sign, and the requantized output, with fresh valid scales, would then load without complaint)."""
    name = "model.layers.1.mlp.up_proj.weight"

    def edit(tensors: dict) -> None:
        if damage == "code_-128":
            tensors[name][3, 1] = -128
        elif damage == "negative_scale":
            tensors[name + "_scale"][4] *= -1
        else:
            tensors[name + "_scale"] = tensors[name + "_scale"].to(torch.bfloat16)

    broken = _broken_copy(int8_dirs[0], tmp_path, edit)
    name += "" if damage == "code_-128" else "_scale"
    for requantize in (False, True):
        out = tmp_path / f"out-{requantize}"
        out.mkdir()
        with pytest.raises(CheckpointError, match=rf"tensor {name.replace('.', '[.]')} {message}"):
            write_checkpoint(MergeSpec(broken, None, torch.float32, quantize_output=requantize), out, progress=False)


def test_a_row_too_small_for_a_float32_scale_quantizes_to_zero_codes_with_scale_one() -> None:
    """max|W| / 127 underflows float32 for a row of subnormals below ~9e-44: the scale must not come out 0 (the
    loader refuses a scale <= 0, so quantize would write a checkpoint it cannot serve); as for an all-zero row,
    s = 1 and the codes are 0, within the round-to-nearest bound |W - q s| <= s / 2."""
    w = torch.zeros(3, 4)
    w[0, 0], w[1, 2], w[2, 1] = 1e-44, -3e-45, 1e-40
    qw = quantize_int8(w)
    assert bool((qw.scale > 0).all()) and bool(torch.isfinite(qw.scale).all())
    assert qw.scale[:2].tolist() == [1.0, 1.0] and int(qw.q[:2].abs().max()) == 0
    assert int(qw.q[2, 1]) == 127  # a subnormal row whose scale is representable keeps its codes
    assert bool(((dequantize_int8(qw.q, qw.scale).double() - w.double()).abs() <= qw.scale.double()[:, None] / 2).all())


def test_quantize_names_the_hashing_stage_after_the_progress_bar(tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """After the write bar reaches 100% the base's weights are hashed for the manifest: minutes of silence on a
    large model unless a line says so (as `lorafleet merge` does); progress=False prints nothing."""
    from runtime.commands.quantize import quantize_checkpoint

    assert _quantize(tiny_llama_dir, tmp_path / "q8") == 0
    err = capsys.readouterr().err
    assert "hashing the base weights" in err and err.index("hashing the base weights") > err.rindex("write")
    quantize_checkpoint(str(tiny_llama_dir), str(tmp_path / "quiet"), progress=False)
    assert capsys.readouterr().err == ""
