"""`lorafleet merge` against PEFT's merge_and_unload, transformers, the dynamic path, and bad inputs."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime.cli import main as cli_main
from runtime.lora.adapter import AdapterError, load_adapter
from runtime.merge.merge_job import MergeOptions, VerificationFailed, run_merge
from runtime.merge.merger import lora_delta, module_weight_name
from runtime.merge.verify import prompt_ids, trace
from runtime.models.hf_config import load_model_config
from runtime.models.llama import lora_targets
from runtime.quant.int8 import dequantize_int8, is_quantized_projection, quantize_int8
from tests.fixtures.tiny_models import build_adapter, build_tiny_model


def merge(base: Path, adapter: Path, out: Path, **kw) -> None:  # type: ignore[no-untyped-def]
    run_merge(MergeOptions(model=str(base), adapter=str(adapter), out=str(out), progress=False, **{"verify": False, **kw}))


def adapter_of(base: Path, path: Path, name: str = "x"):  # type: ignore[no-untyped-def]
    cfg = load_model_config(base)
    return load_adapter(path, name, lora_targets(cfg), num_layers=cfg.num_hidden_layers, max_lora_rank=64)


@pytest.mark.parametrize("name", ["a", "b", "c", "d", "e"])  # rank 4, all attention, rank 16 MLP-only, rsLoRA, rank_pattern + alpha_pattern
def test_merged_weights_match_peft_merge_and_unload(name: str, tiny_llama_dir: Path, tiny_adapters: dict[str, Path], tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    merge(tiny_llama_dir, tiny_adapters[name], tmp_path / "m")
    ours = load_file(str(tmp_path / "m" / "model.safetensors"))
    base = load_file(str(tiny_llama_dir / "model.safetensors"))
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)
    ref = PeftModel.from_pretrained(hf, str(tiny_adapters[name])).merge_and_unload().state_dict()
    assert set(ours) == set(base)
    changed = 0
    for key, t in ours.items():
        torch.testing.assert_close(t, ref[key], rtol=1e-5, atol=1e-6, msg=f"{key}")
        changed += not torch.equal(t, base[key])
    assert changed == len(adapter_of(tiny_llama_dir, tiny_adapters[name]).modules)  # exactly the targeted modules moved


def test_merged_greedy_equals_dynamic_path_and_loads_with_transformers(tiny_llama_dir: Path, tiny_adapters: dict[str, Path], tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "merged_e"
    merge(tiny_llama_dir, tiny_adapters["e"], out)
    adapter = adapter_of(tiny_llama_dir, tiny_adapters["e"])
    prompts = prompt_ids(tiny_llama_dir)[:4]
    dynamic = trace(tiny_llama_dir, adapter, prompts, new_tokens=12)
    merged = trace(out, None, prompts, new_tokens=12)  # free-running greedy on the merged model
    assert torch.equal(merged.tokens, dynamic.tokens)
    base_only = trace(tiny_llama_dir, None, prompts, new_tokens=12)
    assert not torch.equal(base_only.tokens, dynamic.tokens)  # the adapter matters, so equality above means something
    hf_merged = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    hf_dynamic = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32), str(tiny_adapters["e"])).eval()
    ids = torch.tensor([prompts[0]])
    with torch.no_grad():
        a = hf_merged.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False)[0, ids.shape[1]:]
        b = hf_dynamic.generate(input_ids=ids, max_new_tokens=12, min_new_tokens=12, do_sample=False)[0, ids.shape[1]:]
    assert a.tolist() == b.tolist() == dynamic.tokens[0].tolist()


def test_an_adapter_trained_on_the_bare_decoder_merges_as_peft_merges_it(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """An adapter PEFT trained on ``LlamaModel`` (keys ``base_model.model.layers...``, its targets matched
    against ``layers.N...``) merges into the ``*ForCausalLM`` checkpoint's ``model.layers...`` tensors:
    the weights are PEFT's merge_and_unload on the decoder, the LM head and embeddings untouched, and
    greedy decoding on the merged model equals the engine serving the adapter unmerged."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path = build_adapter(tiny_llama_dir, tmp_path / "decoder", r=4, seed=23, bare_decoder=True,
                         target_modules=r"layers\.\d+\.(self_attn\.(q_proj|v_proj)|mlp\.down_proj)", rank_pattern={"down_proj": 8})
    out = tmp_path / "merged"
    merge(tiny_llama_dir, path, out)
    ours = load_file(str(out / "model.safetensors"))
    base = load_file(str(tiny_llama_dir / "model.safetensors"))
    decoder = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).model
    ref = {f"model.{k}": v for k, v in PeftModel.from_pretrained(decoder, str(path)).merge_and_unload().state_dict().items()}
    assert set(ours) == set(base)
    moved = {key for key in ours if not torch.equal(ours[key], base[key])}
    assert moved == {module_weight_name(layer, module) for layer, module in adapter_of(tiny_llama_dir, path).modules} and moved
    for key in moved:
        torch.testing.assert_close(ours[key], ref[key], rtol=1e-5, atol=1e-6, msg=key)
    prompts = prompt_ids(tiny_llama_dir)[:4]
    dynamic = trace(tiny_llama_dir, adapter_of(tiny_llama_dir, path), prompts, new_tokens=12)
    assert torch.equal(trace(out, None, prompts, new_tokens=12).tokens, dynamic.tokens)
    assert not torch.equal(trace(tiny_llama_dir, None, prompts, new_tokens=12).tokens, dynamic.tokens)  # the adapter matters


def test_cli_merge_verifies_and_writes_a_traceable_manifest(tiny_llama_dir: Path, tiny_adapters: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "m"
    rc = cli_main(["merge", "--model", str(tiny_llama_dir), "--adapter", str(tiny_adapters["d"]), "--out", str(out), "--adapter-name", "legal-v2"])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert "PASS" in printed and "merged, float32  <- written" in printed and "100.00% (128/128)" in printed
    manifest = json.loads((out / "lorafleet_merge.json").read_text())
    adapter = adapter_of(tiny_llama_dir, tiny_adapters["d"])
    assert manifest["adapter"]["name"] == "legal-v2" and manifest["adapter"]["version"] == adapter.version
    assert manifest["adapter"]["use_rslora"] is True
    assert manifest["adapter"]["scales"]["model.layers.0.self_attn.q_proj"] == pytest.approx(16 / 8**0.5)
    assert manifest["base"]["id"] == tiny_llama_dir.name and len(manifest["base"]["weights_sha256"]) == 64
    assert manifest["output"]["dtype"] == "float32" and manifest["verification"]["rows"]["merged, float32"]["greedy_agreement"] == 1.0
    assert manifest["created_utc"].endswith("+00:00")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (tiny_llama_dir / name).read_bytes()


def test_bf16_output_is_the_float32_merge_cast_once(tiny_llama_dir: Path, tiny_adapters: dict[str, Path], tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    merge(tiny_llama_dir, tiny_adapters["b"], tmp_path / "m", dtype="bfloat16")
    ours = load_file(str(tmp_path / "m" / "model.safetensors"))
    base = load_file(str(tiny_llama_dir / "model.safetensors"))
    adapter = adapter_of(tiny_llama_dir, tiny_adapters["b"])
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)
    peft_merged = PeftModel.from_pretrained(hf, str(tiny_adapters["b"])).merge_and_unload().state_dict()
    for (layer, module) in adapter.modules:
        name = module_weight_name(layer, module)
        assert torch.equal(ours[name], (base[name] + lora_delta(adapter, layer, module)).to(torch.bfloat16))
        # and PEFT's float32 merge, rounded to bf16, within one bf16 step (2^-8 relative) of it
        torch.testing.assert_close(ours[name].float(), peft_merged[name].to(torch.bfloat16).float(), rtol=2**-8, atol=1e-6)
    assert json.loads((tmp_path / "m" / "config.json").read_text())["dtype"] == "bfloat16"


def test_sharded_base_gives_a_sharded_output_with_an_index(tiny_adapters: dict[str, Path], tiny_llama_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    sharded_base = build_tiny_model(tmp_path / "sharded_base", "llama", seed=0, max_shard_size="100KB")
    assert (sharded_base / "model.safetensors.index.json").is_file()
    out = tmp_path / "m"
    run_merge(MergeOptions(model=str(sharded_base), adapter=str(tiny_adapters["a"]), out=str(out), verify=False, progress=False, max_shard_bytes=100_000))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and not (out / "model.safetensors").exists()
    single = tmp_path / "single"
    merge(tiny_llama_dir, tiny_adapters["a"], single)
    hf_sharded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).state_dict()
    for key, t in load_file(str(single / "model.safetensors")).items():
        assert torch.equal(hf_sharded[key], t), key


def test_each_shard_is_saved_once_full_so_memory_holds_one_shard(tiny_adapters: dict[str, Path], tiny_llama_dir: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A shard goes to disk as soon as the next tensor would overflow it, not after the whole model
    has been read: a 140 GB model must not need 140 GB of memory to merge."""
    from runtime.merge import merger

    read: list[str] = []
    read_when_saved: list[int] = []
    real_read, real_save = merger._read_float, merger._save

    def reading(*args):  # type: ignore[no-untyped-def]
        for name, tensor in real_read(*args):
            read.append(name)
            yield name, tensor

    def saving(shard, path):  # type: ignore[no-untyped-def]
        read_when_saved.append(len(read))
        real_save(shard, path)

    monkeypatch.setattr(merger, "_read_float", reading)
    monkeypatch.setattr(merger, "_save", saving)
    out = tmp_path / "m"
    run_merge(MergeOptions(model=str(tiny_llama_dir), adapter=str(tiny_adapters["a"]), out=str(out), verify=False, progress=False, max_shard_bytes=100_000))
    assert len(read_when_saved) > 2 and read_when_saved == sorted(read_when_saved) and read_when_saved[0] < len(read)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert shards == sorted(p.name for p in out.glob("*.safetensors"))
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]


def test_merging_is_single_tenant(tiny_llama_dir: Path, tiny_adapters: dict[str, Path], tmp_path: Path) -> None:
    """A model merged for adapter A serves B's requests wrongly: A's delta is baked into every request."""
    merged_a = tmp_path / "merged_a"
    merge(tiny_llama_dir, tiny_adapters["a"], merged_a)
    b = adapter_of(tiny_llama_dir, tiny_adapters["b"], "b")
    prompts = prompt_ids(tiny_llama_dir)[:4]
    b_dynamic = trace(tiny_llama_dir, b, prompts, new_tokens=8)
    b_on_merged_a = trace(merged_a, b, prompts, new_tokens=8, forced=b_dynamic.tokens)  # B's LoRA on top of base+A
    plain_merged_a = trace(merged_a, None, prompts, new_tokens=8, forced=b_dynamic.tokens)  # or no LoRA at all
    for wrong in (b_on_merged_a, plain_merged_a):
        assert float((wrong.logits - b_dynamic.logits).abs().max()) > 0.1
        assert not torch.equal(wrong.logits.argmax(-1), b_dynamic.tokens)


# ---- int8 base: dequantize -> merge -> requantize --------------------------------------


@pytest.fixture(scope="module")
def int8_base(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("q") / "q8"
    assert cli_main(["quantize", "--model", str(tiny_llama_dir), "--out", str(out)]) == 0
    return out


def test_int8_merge_requantizes_and_reports_every_error_source(int8_base: Path, tiny_adapters: dict[str, Path], tiny_llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "mq"
    result = run_merge(MergeOptions(model=str(int8_base), adapter=str(tiny_adapters["e"]), out=str(out), threshold=0.5, progress=False))
    labels = [r.label for r in result.rows]
    assert labels == ["dynamic: int8 base + float LoRA", "merged, float32", "merged, requantized int8"]
    figs = {r.label: r.figures for r in result.rows}
    assert all(torch.isfinite(torch.tensor([f.max_abs, f.mean_abs, f.agreement])).all() for f in figs.values())
    # Same math as the reference, only float rounding differs:
    assert figs["dynamic: int8 base + float LoRA"].max_abs < 1e-3 and figs["merged, float32"].max_abs < 1e-3
    # Requantizing moves every weight by up to s'/2: its error is shown, and it is the written row.
    requant = figs["merged, requantized int8"]
    assert requant.max_abs > 10 * figs["merged, float32"].max_abs and requant.mean_abs > figs["merged, float32"].mean_abs
    assert [r.written for r in result.rows] == [False, False, True]
    assert "merged, requantized int8  <- written" in result.report
    assert json.loads((out / "lorafleet_merge.json").read_text())["verification"]["rows"]["merged, requantized int8"]["max_abs_logit_diff"] == requant.max_abs
    # The written codes are quantize(dequantize(q) + delta): new scales, never codes + float delta.
    written, source = load_file(str(out / "model.safetensors")), load_file(str(int8_base / "model.safetensors"))
    adapter = adapter_of(tiny_llama_dir, tiny_adapters["e"])
    for (layer, module) in adapter.modules:
        name = module_weight_name(layer, module)
        expected = quantize_int8(dequantize_int8(source[name], source[name + "_scale"]) + lora_delta(adapter, layer, module))
        assert torch.equal(written[name], expected.q) and torch.equal(written[name + "_scale"], expected.scale)
        assert not torch.equal(written[name + "_scale"], source[name + "_scale"])
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "lorafleet-int8-wo"


def test_int8_merge_no_requantize_writes_float_that_transformers_loads(int8_base: Path, tiny_adapters: dict[str, Path], tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    out = tmp_path / "mf"
    merge(int8_base, tiny_adapters["a"], out, requantize=False)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    sd = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).state_dict()
    assert all(t.is_floating_point() for t in sd.values())
    assert all(k in sd for k in load_file(str(out / "model.safetensors")) if is_quantized_projection(k))


def test_the_int8_verification_scratch_is_named_after_the_output(int8_base: Path, tiny_adapters: dict[str, Path], tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """A run killed while verifying leaves its scratch folder; the next run into --out names only
    folders called after --out (it was called after the staging folder, so never named)."""
    import tempfile

    from runtime.merge import merge_job, staging

    made = []
    real = tempfile.TemporaryDirectory

    def recording(*args, **kwargs):  # type: ignore[no-untyped-def]
        scratch = real(*args, **kwargs)
        made.append(Path(scratch.name))
        return scratch

    monkeypatch.setattr(merge_job.tempfile, "TemporaryDirectory", recording)
    out = tmp_path / "mq"
    run_merge(MergeOptions(model=str(int8_base), adapter=str(tiny_adapters["e"]), out=str(out), threshold=0.0, progress=False))
    assert len(made) == 1 and made[0].parent == tmp_path and made[0].name.startswith(".mq.verify-")
    made[0].mkdir()  # as a killed run would leave it
    assert staging.leftover_scratch(out) == [made[0]]


def test_verification_below_threshold_fails_and_writes_nothing(int8_base: Path, tiny_adapters: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The tiny random model has near-tied logits, so requantization flips some greedy tokens (measured 120/128).
    rc = cli_main(["merge", "--model", str(int8_base), "--adapter", str(tiny_adapters["e"]), "--out", str(tmp_path / "mq"), "--verify-threshold", "1.0"])
    captured = capsys.readouterr()
    assert rc == 1 and "FAIL" in captured.out and "nothing was written" in captured.err
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(VerificationFailed):
        run_merge(MergeOptions(model=str(int8_base), adapter=str(tiny_adapters["e"]), out=str(tmp_path / "mq"), threshold=1.0, progress=False))
    assert list(tmp_path.iterdir()) == []


# ---- bad inputs: clear error, exit 2, nothing left behind --------------------------------


def _cli(base: Path, adapter: Path, out: Path, *extra: str) -> int:
    return cli_main(["merge", "--model", str(base), "--adapter", str(adapter), "--out", str(out), "--no-verify", *extra])


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_missing_adapter(tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "out_parent").mkdir()
    assert _cli(tiny_llama_dir, tmp_path / "nope", tmp_path / "out_parent" / "m") == 2
    assert f"{tmp_path / 'nope'}: adapter folder does not exist" in capsys.readouterr().err
    assert list((tmp_path / "out_parent").iterdir()) == []


def test_adapter_for_another_base_is_refused(tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    other = build_tiny_model(tmp_path / "qwen_small", "qwen2", seed=3, hidden_size=32, intermediate_size=64)
    wrong = build_adapter(other, tmp_path / "wrong", r=4, target_modules=["q_proj", "v_proj"], seed=1)
    (tmp_path / "o").mkdir()
    assert _cli(tiny_llama_dir, wrong, tmp_path / "o" / "m") == 2
    err = capsys.readouterr().err
    assert "adapter_model.safetensors: tensor base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight has shape [4, 32]" in err
    assert "in_features=64" in err and list((tmp_path / "o").iterdir()) == []


def test_adapter_for_a_deeper_base_names_the_layer_count(tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Same widths, more layers: the error says so, not that target_modules failed to select the tensor."""
    deeper = build_tiny_model(tmp_path / "deeper", "llama", seed=3, num_hidden_layers=4)
    wrong = build_adapter(deeper, tmp_path / "wrong", r=4, target_modules=["q_proj"], seed=1)
    (tmp_path / "o").mkdir()
    assert _cli(tiny_llama_dir, wrong, tmp_path / "o" / "m") == 2
    err = capsys.readouterr().err
    assert "tensor base_model.model.model.layers.2.self_attn.q_proj.lora_A.weight is for layer 2, but the base has 2 layers" in err
    assert "not selected by target_modules" not in err and list((tmp_path / "o").iterdir()) == []


def test_hand_edited_shape_and_dora_are_refused(tiny_llama_dir: Path, tiny_adapters: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    edited = _copy(tiny_adapters["a"], tmp_path / "edited")
    tensors = load_file(str(edited / "adapter_model.safetensors"))
    key = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
    tensors[key] = torch.randn(40, 4)
    save_file(tensors, str(edited / "adapter_model.safetensors"))
    (tmp_path / "o").mkdir()
    assert _cli(tiny_llama_dir, edited, tmp_path / "o" / "m") == 2
    assert f"tensor {key} has shape [40, 4]" in capsys.readouterr().err
    dora = _copy(tiny_adapters["a"], tmp_path / "dora")
    cfg = json.loads((dora / "adapter_config.json").read_text())
    cfg["use_dora"] = True
    (dora / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(AdapterError, match=r"adapter_config\.json: use_dora=True is not supported"):
        merge(tiny_llama_dir, dora, tmp_path / "o" / "m")
    assert list((tmp_path / "o").iterdir()) == []


def test_existing_output_and_force(tiny_llama_dir: Path, tiny_adapters: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "m"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert _cli(tiny_llama_dir, tiny_adapters["a"], out) == 2
    assert "already exists; choose a new folder or pass --force" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    # --force replaces only an empty folder or an earlier lorafleet output, never someone's files.
    assert _cli(tiny_llama_dir, tiny_adapters["a"], out, "--force") == 2
    assert "holds files that lorafleet did not write" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    (out / "keep.txt").unlink()
    assert _cli(tiny_llama_dir, tiny_adapters["a"], out, "--force") == 0  # empty folder
    first = (out / "model.safetensors").read_bytes()
    assert _cli(tiny_llama_dir, tiny_adapters["c"], out, "--force") == 0  # an earlier merge output
    assert (out / "lorafleet_merge.json").is_file() and (out / "model.safetensors").read_bytes() != first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no staging or old folders left
    # An earlier output with someone's files added since (a note, a folder of notes): refused, and they stay.
    (out / "myfile.txt").write_text("mine")
    (out / "notes").mkdir()
    (out / "notes" / "todo.txt").write_text("important")
    capsys.readouterr()
    assert _cli(tiny_llama_dir, tiny_adapters["a"], out, "--force") == 2
    err = capsys.readouterr().err
    assert "holds files that lorafleet did not write (myfile.txt, notes/, notes/todo.txt)" in err, err
    assert (out / "myfile.txt").read_text() == "mine" and (out / "notes" / "todo.txt").read_text() == "important"
    written = json.loads((out / "lorafleet_merge.json").read_text())["files_written"]
    assert set(written) == {p.relative_to(out).as_posix() for p in out.rglob("*")} - {"lorafleet_merge.json", "myfile.txt", "notes", "notes/todo.txt"}


@pytest.mark.parametrize("where", ["model", "inside_model", "inside_adapter", "above_adapter"])
def test_force_never_writes_over_or_around_inputs(where: str, tiny_llama_dir: Path, tiny_adapters: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = _copy(tiny_llama_dir, tmp_path / "base")
    adapter = tmp_path / "ads" / "a"
    adapter.parent.mkdir()
    _copy(tiny_adapters["a"], adapter)
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    out = {"model": base, "inside_model": base / "sub", "inside_adapter": adapter / "m", "above_adapter": adapter.parent}[where]
    assert _cli(base, adapter, out, "--force") == 2
    assert "input" in capsys.readouterr().err
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before


def test_read_only_output_path(tiny_llama_dir: Path, tiny_adapters: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # An output path under a regular file cannot be written by anyone, root included.
    (tmp_path / "a_file").write_text("x")
    assert _cli(tiny_llama_dir, tiny_adapters["a"], tmp_path / "a_file" / "m") == 2
    assert "is not a folder" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


def test_read_only_output_folder(tiny_llama_dir: Path, tiny_adapters: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """As root, in a child without the capabilities that let root write anywhere (setpriv drops
    CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from its bounding set), where chmod 0o555 binds."""
    import shutil
    import subprocess
    import sys

    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        if os.geteuid() != 0:
            rc, err = _cli(tiny_llama_dir, tiny_adapters["a"], ro / "m"), capsys.readouterr().err
        else:
            setpriv = shutil.which("setpriv")
            if setpriv is None:
                pytest.skip("runs as root without util-linux's setpriv: nothing here can make chmod 0o555 bind")
            args = ["merge", "--model", str(tiny_llama_dir), "--adapter", str(tiny_adapters["a"]), "--out", str(ro / "m"), "--no-verify"]
            proc = subprocess.run([setpriv, "--bounding-set", "-dac_override,-dac_read_search", "--", sys.executable, "-m", "runtime.cli", *args],
                                  capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[1])  # fmt: skip
            rc, err = proc.returncode, proc.stderr
        assert rc == 2, err
        assert f"{ro / 'm'}: cannot write into {ro}" in err
        assert list(ro.iterdir()) == []
    finally:
        ro.chmod(0o755)


def test_requantize_option_on_a_float_base_is_an_error(tiny_llama_dir: Path, tiny_adapters: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _cli(tiny_llama_dir, tiny_adapters["a"], tmp_path / "m", "--no-requantize") == 2
    assert "--no-requantize" in capsys.readouterr().err and not (tmp_path / "m").exists()
    with pytest.raises(SystemExit) as exc:
        cli_main(["merge", "--model", str(tiny_llama_dir), "--out", str(tmp_path / "m")])  # --adapter missing
    assert exc.value.code == 2
