"""Checkpoint loading and the base decoder vs transformers: rope scaling, tied embeddings,
mistral, sharded checkpoints, dtypes, KV sizing, and the errors for what we cannot honour."""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from backends import get_backend
from runtime.config import ConfigError, EngineConfig
from runtime.lora.adapter import load_adapter
from runtime.model_runner import ModelRunner, SeqStep
from runtime.models.hf_config import ModelConfigError, RopeScaling, load_model_config
from runtime.models.loader import CheckpointError, load_weights
from tests.fixtures.tiny_models import build_tiny_model

LEN, CHUNK, BLOCK = 40, 8, 8


def runner_for(model_dir: Path, **overrides) -> ModelRunner:
    values = dict(model=str(model_dir), device="cpu", dtype="float32", max_loras=2, max_lora_rank=16, num_kv_blocks=8, block_size=BLOCK)
    values.update(overrides)
    return ModelRunner(EngineConfig(**values), get_backend("cpu"))


def chunked_logits(runner: ModelRunner, ids: list[int], slot: int = -1) -> torch.Tensor:
    """Prefill ``ids`` in chunks of CHUNK; logits at the end of every chunk, [LEN / CHUNK, vocab]."""
    table = list(range(-(-len(ids) // BLOCK)))
    out = [runner.execute([SeqStep(ids[s : s + CHUNK], s, table, slot)]) for s in range(0, len(ids), CHUNK)]
    return torch.cat(out)


def hf_logits(model_dir: Path, ids: list[int], dtype=torch.float32) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    return logits[CHUNK - 1 :: CHUNK]


def prompt(seed: int = 0) -> list[int]:
    return torch.randint(0, 256, (LEN,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_rel(ours: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    err = ((ours - ref).abs().amax(-1) / ref.abs().amax(-1)).max()
    assert err < tol, f"relative error {err:.2e}"


ROPE_CASES = {
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32, "rope_theta": 10000.0},  # fmt: skip
}


@pytest.mark.parametrize("rope", sorted(ROPE_CASES))
def test_rope_scaling_matches_transformers(tmp_path, rope):
    scaled = build_tiny_model(tmp_path / rope, "llama", seed=5, rope_parameters=dict(ROPE_CASES[rope]))
    plain = build_tiny_model(tmp_path / "plain", "llama", seed=5)
    assert load_model_config(scaled).rope_scaling.rope_type == rope
    ids = prompt()
    ours = chunked_logits(runner_for(scaled), ids)
    assert_rel(ours, hf_logits(scaled, ids), 1e-4)
    # the scaling must matter at these positions, or this test would prove nothing
    unscaled = chunked_logits(runner_for(plain), ids)
    assert ((ours - unscaled).abs().amax(-1) / unscaled.abs().amax(-1))[-1] > 1e-3


def test_legacy_rope_scaling_layout(tmp_path):
    """transformers 4.x layout: top-level rope_theta + rope_scaling {"type": ...}."""
    path = build_tiny_model(tmp_path / "m", "llama", seed=2)
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("rope_parameters")
    cfg.update(rope_theta=5000.0, rope_scaling={"type": "linear", "factor": 2.0})
    (path / "config.json").write_text(json.dumps(cfg))
    parsed = load_model_config(path)
    assert parsed.rope_theta == 5000.0 and parsed.rope_scaling.rope_type == "linear" and parsed.rope_scaling.factor == 2.0


def test_rope_parameters_without_theta_inside_matches_transformers(tmp_path):
    """rope_parameters carries the scaling but rope_theta sits at the top level (or nowhere):
    the scaling must still apply, with theta from the top level, else transformers' default 10000."""
    path = build_tiny_model(tmp_path / "m", "llama", seed=5)
    cfg = json.loads((path / "config.json").read_text())
    scaling = {"rope_type": "llama3", "factor": 8, "low_freq_factor": 1, "high_freq_factor": 4, "original_max_position_embeddings": 32}
    cfg.update(rope_theta=5000, rope_parameters=dict(scaling))
    (path / "config.json").write_text(json.dumps(cfg))
    parsed = load_model_config(path)
    assert parsed.rope_theta == 5000.0
    assert parsed.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 32)
    ids = prompt()
    assert_rel(chunked_logits(runner_for(path), ids), hf_logits(path, ids), 1e-4)

    cfg.pop("rope_theta")
    (path / "config.json").write_text(json.dumps(cfg))
    parsed = load_model_config(path)
    assert parsed.rope_theta == 10000.0 and parsed.rope_scaling.rope_type == "llama3"


def test_rope_theta_inside_legacy_rope_scaling_matches_transformers(tmp_path):
    """A rope_theta inside rope_scaling is the one transformers uses (it wins over the top-level
    one, as inside rope_parameters); it was read from the top level, else 10000."""
    path = build_tiny_model(tmp_path / "m", "llama", seed=5)
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("rope_parameters")
    cfg.update(rope_theta=10000.0, rope_scaling={"type": "linear", "factor": 2.0, "rope_theta": 50.0})
    (path / "config.json").write_text(json.dumps(cfg))
    assert load_model_config(path).rope_theta == 50.0
    ids = prompt()
    assert_rel(chunked_logits(runner_for(path), ids), hf_logits(path, ids), 1e-4)
    cfg.pop("rope_theta")  # and with no top-level rope_theta at all
    (path / "config.json").write_text(json.dumps(cfg))
    assert load_model_config(path).rope_theta == 50.0


def test_llama3_top_level_original_max_position_embeddings(tmp_path):
    """transformers 5 takes a top-level original_max_position_embeddings over the one in the rope
    dict (4.x read the rope dict's); it was ignored: read when the rope dict has none, refused when they differ."""
    path = build_tiny_model(tmp_path / "m", "llama", seed=5)
    cfg = json.loads((path / "config.json").read_text())
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "rope_theta": 10000.0}
    cfg.update(rope_parameters=dict(llama3), original_max_position_embeddings=8)
    (path / "config.json").write_text(json.dumps(cfg))
    assert load_model_config(path).rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8)
    ids = prompt()
    assert_rel(chunked_logits(runner_for(path), ids), hf_logits(path, ids), 1e-4)
    cfg["rope_parameters"]["original_max_position_embeddings"] = 8  # the same in both places is fine
    (path / "config.json").write_text(json.dumps(cfg))
    assert load_model_config(path).rope_scaling.original_max_position_embeddings == 8
    cfg["rope_parameters"]["original_max_position_embeddings"] = 32
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError, match=r"config\.json: original_max_position_embeddings=8 \(top level\) and "
                                               r"rope_parameters\.original_max_position_embeddings=32 disagree"):
        load_model_config(path)


def edit_config(path: Path, change: dict, drop: tuple[str, ...] = ()) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(change)
    for key in drop:
        cfg.pop(key, None)
    (path / "config.json").write_text(json.dumps(cfg))


def test_llama3_without_original_max_position_embeddings_matches_transformers(tmp_path):
    """llama3 scaling with no original_max_position_embeddings anywhere: transformers 5 takes
    max_position_embeddings (standardize_rope_params' setdefault) and loads the model; it was refused."""
    path = build_tiny_model(tmp_path / "m", "llama", seed=5)
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "rope_theta": 10000.0}
    edit_config(path, {"rope_parameters": llama3})
    assert load_model_config(path).rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 256)  # max_position_embeddings
    ids = prompt()
    assert_rel(chunked_logits(runner_for(path), ids), hf_logits(path, ids), 1e-4)
    edit_config(path, {"rope_parameters": {**llama3, "low_freq_factor": None}})  # the other fields stay required
    with pytest.raises(ModelConfigError, match=r"config\.json: rope_parameters of rope_type 'llama3' needs low_freq_factor"):
        load_model_config(path)


def test_empty_rope_parameters_beside_rope_scaling_matches_transformers(tmp_path):
    """"rope_parameters": {} next to a rope_scaling: transformers takes ``rope_scaling or rope_parameters``,
    so the scaling applies; it was refused as a disagreement between the two."""
    path = build_tiny_model(tmp_path / "m", "llama", seed=5)
    edit_config(path, {"rope_parameters": {}, "rope_scaling": {"rope_type": "linear", "factor": 4.0}, "rope_theta": 5000.0})
    parsed = load_model_config(path)
    assert parsed.rope_scaling == RopeScaling("linear", 4.0) and parsed.rope_theta == 5000.0
    ids = prompt()
    assert_rel(chunked_logits(runner_for(path), ids), hf_logits(path, ids), 1e-4)


def test_conflicting_rope_parameters_and_rope_scaling_is_an_error(tmp_path):
    path = build_tiny_model(tmp_path / "m", "llama", seed=2)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(rope_parameters={"rope_type": "linear", "factor": 2.0}, rope_scaling={"rope_type": "linear", "factor": 4.0})
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError, match=r"config\.json: rope_parameters and rope_scaling disagree"):
        load_model_config(path)
    cfg["rope_scaling"] = {"type": "linear", "factor": 2.0}  # the same scaling in both layouts is fine
    (path / "config.json").write_text(json.dumps(cfg))
    assert load_model_config(path).rope_scaling == RopeScaling("linear", 2.0)
    # The same scaling but another theta: transformers takes rope_scaling's (here the top-level 10000), not 50.
    cfg.update(rope_theta=10000.0, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 50.0})
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError, match=r"config\.json: rope_parameters and rope_scaling disagree .*rope_theta 50\.0 vs 10000\.0"):
        load_model_config(path)
    cfg.update(rope_parameters=[1, 2], rope_scaling=None)
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError, match=r"config\.json: rope_parameters must be an object or null"):
        load_model_config(path)


@pytest.mark.parametrize("rope_type", ["yarn", "dynamic", "longrope"])
def test_unknown_rope_type_is_a_clear_error(tmp_path, rope_type):
    path = build_tiny_model(tmp_path / "m", "llama", seed=2)
    cfg = json.loads((path / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": rope_type, "factor": 2.0, "rope_theta": 10000.0}
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError, match=rf"config\.json.*rope_type '{rope_type}' is not supported.*linear, llama3"):
        runner_for(path)


def test_tied_embeddings_and_mistral_match_transformers(tmp_path):
    ids = prompt(1)
    tied = build_tiny_model(tmp_path / "tied", "llama", seed=3, tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(str(tied / "model.safetensors"))
    assert_rel(chunked_logits(runner_for(tied), ids), hf_logits(tied, ids), 1e-4)
    mistral = build_tiny_model(tmp_path / "mistral", "mistral", seed=4)
    assert_rel(chunked_logits(runner_for(mistral), ids), hf_logits(mistral, ids), 1e-4)


def test_tied_embeddings_with_a_distinct_lm_head_is_refused(tmp_path):
    """tie_word_embeddings=true but the checkpoint also stores an lm_head.weight: a copy of the embedding
    loads (tied, as before); a different one is what transformers 5 computes the logits with (it unties
    them), where the tied head here is the embedding: refused, naming the tensor and the field."""
    path = build_tiny_model(tmp_path / "tied", "llama", seed=3, tie_word_embeddings=True)
    ids = prompt(1)
    rewrite(path, lambda t: t.__setitem__("lm_head.weight", t["model.embed_tokens.weight"].clone()))
    assert_rel(chunked_logits(runner_for(path), ids), hf_logits(path, ids), 1e-4)
    rewrite(path, lambda t: t.__setitem__("lm_head.weight", torch.randn(t["model.embed_tokens.weight"].shape, generator=torch.Generator().manual_seed(9))))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor lm_head\.weight differs from model\.embed_tokens\.weight, "
                                              r"but config\.json has tie_word_embeddings=true"):
        runner_for(path)


def test_qwen2_biases_are_loaded(tiny_qwen2_dir):
    ids = prompt(2)
    tensors = load_file(str(tiny_qwen2_dir / "model.safetensors"))
    assert tensors["model.layers.0.self_attn.q_proj.bias"].abs().sum() > 0
    assert_rel(chunked_logits(runner_for(tiny_qwen2_dir), ids), hf_logits(tiny_qwen2_dir, ids), 1e-4)


def test_mistral_attention_bias_is_not_read(tmp_path):
    """MistralAttention has no biases whatever config.json says: attention_bias=true on a mistral made the
    loader demand q/k/v/o biases, and biases in the checkpoint were added where transformers drops them."""
    path = build_tiny_model(tmp_path / "m", "mistral", seed=4)
    cfg = json.loads((path / "config.json").read_text())
    cfg["attention_bias"] = True
    (path / "config.json").write_text(json.dumps(cfg))
    assert not load_model_config(path).attention_bias and not load_model_config(path).o_proj_bias
    ids = prompt(2)
    assert_rel(chunked_logits(runner_for(path), ids), hf_logits(path, ids), 1e-4)
    rewrite(path, lambda t: t.update({f"model.layers.0.self_attn.{n}_proj.bias": torch.randn(size) for n, size in
                                      (("q", 64), ("k", 32), ("v", 32), ("o", 64))}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor\(s\) model\.layers\.0\.self_attn\.k_proj\.bias"):
        runner_for(path)


def test_sliding_window_caps_max_model_len(tmp_path):
    path = build_tiny_model(tmp_path / "m", "mistral", seed=4, sliding_window=64)
    runner = runner_for(path)
    assert runner.max_model_len == 64
    with pytest.raises(ValueError, match="max_model_len=64"):
        runner.execute([SeqStep([1], 64, list(range(8)))])
    with pytest.raises(ConfigError, match=r"max_model_len: 128 exceeds the model's limit 64 \(the sliding window"):
        runner_for(path, max_model_len=128)


@pytest.mark.parametrize(
    "model_type, change, window",
    [
        ("mistral", {}, 4096),  # no sliding_window key: transformers' MistralConfig default
        ("mistral", {"sliding_window": None}, None),  # explicit null: full attention
        ("qwen2", {"use_sliding_window": True, "max_window_layers": 0}, 4096),
        ("qwen2", {"use_sliding_window": True, "max_window_layers": 1}, 4096),  # layer 1 on slides
        ("qwen2", {"use_sliding_window": True}, None),  # max_window_layers 28 >= the layers: every layer in full
        ("qwen2", {"use_sliding_window": True, "layer_types": ["full_attention", "sliding_attention"]}, 4096),
        ("qwen2", {"use_sliding_window": True, "max_window_layers": 0, "sliding_window": None}, None),
        ("qwen2", {"use_sliding_window": False, "max_window_layers": 0}, None),
        ("llama", {}, None),  # LlamaConfig has no sliding window at all
        ("llama", {"sliding_window": 16}, None),  # not even when its config.json has the key
    ],
)
def test_sliding_window_default_follows_transformers(tmp_path, model_type, change, window):
    """The cap applies where transformers' attention slides: every mistral layer, the qwen2 layers its
    layer_types mark (by default those from max_window_layers on), no llama layer."""
    from transformers import AutoConfig

    path = build_tiny_model(tmp_path / "m", model_type, seed=4)
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("sliding_window", None)
    cfg.pop("layer_types", None)  # as saved, computed from the builder's settings: let the change decide
    cfg.update(change, max_position_embeddings=8192)
    (path / "config.json").write_text(json.dumps(cfg))
    parsed = load_model_config(path)
    hf = AutoConfig.from_pretrained(str(path))
    layer_types = getattr(hf, "layer_types", None) or ["sliding_attention" if model_type == "mistral" else "full_attention"] * hf.num_hidden_layers
    slides = model_type != "llama" and getattr(hf, "sliding_window", None) is not None and "sliding_attention" in layer_types
    assert cfg["num_hidden_layers"] == 2 and parsed.sliding_window == window == (hf.sliding_window if slides else None)
    assert parsed.max_model_len == (window or 8192)


def test_sharded_checkpoint_loads(tmp_path, tiny_llama_dir):
    sharded = build_tiny_model(tmp_path / "sharded", "llama", seed=0, max_shard_size="30KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert not (sharded / "model.safetensors").exists()
    cfg = load_model_config(sharded)
    from_shards = load_weights(cfg, sharded, torch.float32, torch.device("cpu"))
    single = load_weights(cfg, tiny_llama_dir, torch.float32, torch.device("cpu"))
    assert from_shards.keys() == single.keys()
    assert all(torch.equal(from_shards[k], single[k]) for k in single)
    ids = prompt(3)
    assert_rel(chunked_logits(runner_for(sharded), ids), hf_logits(sharded, ids), 1e-4)


def test_single_file_beside_an_index_is_what_loads(tmp_path):
    """A folder with both model.safetensors and model.safetensors.index.json (other weights in each):
    transformers loads model.safetensors; the index was read instead."""
    path = build_tiny_model(tmp_path / "both", "llama", seed=0, max_shard_size="30KB")
    other = build_tiny_model(tmp_path / "other", "llama", seed=7)
    shutil.copy(other / "model.safetensors", path / "model.safetensors")
    assert (path / "model.safetensors.index.json").is_file()
    ids = prompt(3)
    ours = chunked_logits(runner_for(path), ids)
    assert_rel(ours, hf_logits(path, ids), 1e-4)
    assert_rel(ours, chunked_logits(runner_for(other), ids), 1e-6)


def test_transformers_weights_naming_another_file_is_refused(tmp_path):
    """config.json's transformers_weights makes transformers load that file instead of model.safetensors;
    it was ignored (other weights, no error). Naming the file lorafleet reads anyway is fine."""
    path = build_tiny_model(tmp_path / "m", "llama", seed=0)
    other = build_tiny_model(tmp_path / "other", "llama", seed=7)
    shutil.copy(other / "model.safetensors", path / "weights-b.safetensors")
    cfg = json.loads((path / "config.json").read_text())
    cfg["transformers_weights"] = "model.safetensors"
    (path / "config.json").write_text(json.dumps(cfg))
    ids = prompt(3)
    assert_rel(chunked_logits(runner_for(path), ids), hf_logits(path, ids), 1e-4)
    cfg["transformers_weights"] = "weights-b.safetensors"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config\.json: transformers_weights='weights-b\.safetensors' names the weights file "
                                              r"transformers loads, but lorafleet reads model\.safetensors"):
        runner_for(path)


@pytest.mark.parametrize("dtype, tol", [("bfloat16", 5e-2), ("float16", 1e-2)])
def test_half_dtypes_agree_with_float32(tiny_llama_dir, dtype, tol):
    ids = prompt(4)
    runner = runner_for(tiny_llama_dir, dtype=dtype)
    assert runner.kv_caches[0].dtype == getattr(torch, dtype)
    assert_rel(chunked_logits(runner, ids), chunked_logits(runner_for(tiny_llama_dir), ids), tol)


# ---- errors --------------------------------------------------------------------------------


def rewrite(path: Path, fn) -> None:
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    fn(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def test_missing_tensor_is_named(tmp_path):
    path = build_tiny_model(tmp_path / "m", "llama", seed=0)
    rewrite(path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*missing tensor\(s\) model\.layers\.1\.mlp\.up_proj\.weight"):
        runner_for(path)


def test_misshapen_tensor_is_named(tmp_path):
    path = build_tiny_model(tmp_path / "m", "llama", seed=0)
    rewrite(path, lambda t: t.__setitem__("model.layers.0.self_attn.k_proj.weight", torch.randn(16, 64)))
    with pytest.raises(CheckpointError, match=r"k_proj\.weight has shape \(16, 64\), config\.json implies \(32, 64\)"):
        runner_for(path)


def test_unexpected_tensor_is_named(tmp_path):
    path = build_tiny_model(tmp_path / "m", "llama", seed=0)
    rewrite(path, lambda t: t.__setitem__("model.layers.0.mlp.extra.weight", torch.randn(2, 2)))
    with pytest.raises(CheckpointError, match=r"unexpected tensor\(s\) model\.layers\.0\.mlp\.extra\.weight"):
        runner_for(path)


def test_pickled_checkpoint_is_refused(tmp_path):
    path = build_tiny_model(tmp_path / "m", "llama", seed=0)
    (path / "model.safetensors").rename(path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin.*never unpickled"):
        runner_for(path)


def sharded(tmp_path: Path) -> tuple[Path, Path, dict]:
    path = build_tiny_model(tmp_path / "m", "llama", seed=0, max_shard_size="30KB")
    index_file = path / "model.safetensors.index.json"
    return path, index_file, json.loads(index_file.read_text())


def load(path: Path) -> dict:
    return load_weights(load_model_config(path), path, torch.float32, torch.device("cpu"))


UP = "model.layers.1.mlp.up_proj.weight"


@pytest.mark.parametrize(
    "entry, why",
    [
        ("../outside.safetensors", "points outside the checkpoint folder"),
        ("sub/../../outside.safetensors", "points outside the checkpoint folder"),
        ("ABSOLUTE", "points outside the checkpoint folder"),
        (3, "must be a shard file name"),
    ],
)
def test_index_entry_outside_the_checkpoint_is_refused(tmp_path, entry, why):
    path, index_file, index = sharded(tmp_path)
    outside = tmp_path / "outside.safetensors"
    shutil.copy(path / index["weight_map"][UP], outside)  # a real shard there: only the path check can refuse it
    (path / "sub").mkdir()
    entry = str(outside) if entry == "ABSOLUTE" else entry
    index["weight_map"][UP] = entry
    index_file.write_text(json.dumps(index))
    pattern = rf"{re.escape(str(index_file))}: weight_map\['{re.escape(UP)}'\] = {re.escape(repr(entry))}: {why}"
    with pytest.raises(CheckpointError, match=pattern):
        load(path)


def test_index_shards_in_a_subfolder_or_symlinked_elsewhere_load(tmp_path, tiny_llama_dir):
    """Inside the folder means the index's path, not where a symlink points: the HF hub cache
    keeps snapshots/<rev>/<shard> as a link to ../../blobs/<sha>."""
    path, index_file, index = sharded(tmp_path)
    first, second = sorted(set(index["weight_map"].values()))[:2]
    (path / "sub").mkdir()
    (path / first).rename(path / "sub" / first)
    index["weight_map"] = {n: f"sub/{s}" if s == first else s for n, s in index["weight_map"].items()}
    index_file.write_text(json.dumps(index))
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    (path / second).rename(blobs / second)
    (path / second).symlink_to(Path("..") / "blobs" / second)
    weights, single = load(path), load(tiny_llama_dir)
    assert weights.keys() == single.keys() and all(torch.equal(weights[k], single[k]) for k in single)


@pytest.mark.parametrize("keep", [0.5, 5])
def test_corrupt_shard_is_named(tmp_path, keep):
    path, _, index = sharded(tmp_path)
    shard = path / index["weight_map"][UP]
    os.truncate(shard, int(shard.stat().st_size * keep) if keep < 1 else keep)
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(shard))}: not a readable safetensors file"):
        load(path)


def test_index_naming_the_wrong_shard_is_named(tmp_path):
    path, index_file, index = sharded(tmp_path)
    wrong = next(s for s in index["weight_map"].values() if s != index["weight_map"][UP])
    index["weight_map"][UP] = wrong
    index_file.write_text(json.dumps(index))
    pattern = rf"{re.escape(str(path / wrong))}: tensor {re.escape(UP)} is not in this shard \(model\.safetensors\.index\.json names it\)"
    with pytest.raises(CheckpointError, match=pattern):
        load(path)


@pytest.mark.parametrize(
    "change, pattern",
    [
        ({"model_type": "gpt2"}, r"model_type 'gpt2' is not supported"),
        ({"hidden_act": "gelu"}, r"hidden_act 'gelu'"),
        ({"num_key_value_heads": 3}, r"num_key_value_heads=3"),
        ({"hidden_size": None}, r"field 'hidden_size'"),
        ({"partial_rotary_factor": 0.5}, r"partial_rotary_factor=0\.5 is not supported"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25}},
         r"rope_parameters\.partial_rotary_factor=0\.25 is not supported"),
    ],
)
def test_config_the_model_cannot_honour(tmp_path, change, pattern):
    path = build_tiny_model(tmp_path / "m", "llama", seed=0)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(change)
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError, match=rf"config\.json: .*{pattern}"):
        load_model_config(path)


# ---- KV sizing, LoRA slots, memory ---------------------------------------------------------


def test_kv_blocks_default_and_cap(tiny_llama_dir):
    runner = runner_for(tiny_llama_dir, num_kv_blocks=None, max_num_seqs=3, max_model_len=100)
    assert runner.num_kv_blocks == 3 * 13  # ceil(100 / 8) blocks per sequence
    per_block = runner.kv_bytes_per_block()
    assert per_block == 2 * 2 * 16 * 4 * BLOCK * 2  # K+V x Hkv x D x fp32 x block x layers
    assert runner.kv_caches[0].shape == (2, 3 * 13 * BLOCK, 2, 16)
    capped = runner_for(tiny_llama_dir, num_kv_blocks=None, max_num_seqs=100000, kv_cache_mb=1)
    assert capped.num_kv_blocks == (1 << 20) // per_block
    report = capped.memory_report()
    assert report["kv_cache_bytes"] == capped.num_kv_blocks * per_block
    assert report["weights_bytes"] == sum(t.numel() * 4 for t in load_file(str(tiny_llama_dir / "model.safetensors")).values())
    assert report["lora_pool_bytes"] > 0


def test_a_kv_cap_below_one_sequence_is_refused_before_the_weights_load(tmp_path, tiny_llama_dir, monkeypatch):
    """A model whose limit (max_position_embeddings) is far beyond what the default or given kv_cache_mb
    holds is refused from config.json alone, naming both ways out: the weights are not read first
    (minutes for a large checkpoint), and the message says what to raise or lower, and to how much."""
    path = tmp_path / "long"
    shutil.copytree(tiny_llama_dir, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["max_position_embeddings"] = 1 << 22
    (path / "config.json").write_text(json.dumps(cfg))

    def no_weights(*args, **kwargs):
        raise AssertionError("the weights were loaded before the KV pool was sized")

    monkeypatch.setattr("runtime.model_runner.load_weights", no_weights)
    per_block = 2 * 2 * 16 * 4 * BLOCK * 2  # K+V x Hkv x D x fp32 x block x layers: 4 KiB, 256 blocks a MiB
    need_mb = -(-((1 << 22) // BLOCK) * per_block // (1 << 20))
    with pytest.raises(ConfigError, match=re.escape(
            f"kv_cache_mb: 1 MiB holds 256 KV blocks (2048 tokens), fewer than one sequence of max_model_len={1 << 22} (the model's limit) "
            f"needs ({(1 << 22) // BLOCK} blocks); raise --kv-cache-mb to at least {need_mb} or lower --max-model-len to at most 2048")):
        runner_for(path, num_kv_blocks=None, kv_cache_mb=1)
    with pytest.raises(ConfigError, match=r"kv_cache_mb: 1024 MiB \(the default\) holds 262144 KV blocks \(2097152 tokens\), "
                       r"fewer than one sequence of max_model_len=2097160 needs \(262145 blocks\); raise --kv-cache-mb to at least 1025 or"):
        runner_for(path, num_kv_blocks=None, max_model_len=2097160)  # one block more than the default 1 GiB holds
    with pytest.raises(AssertionError, match="weights were loaded"):  # a pool that fits goes on to read the weights
        runner_for(path, num_kv_blocks=None, kv_cache_mb=1, max_model_len=2048)


def test_write_adapter_sets_per_slice_ranks_and_clear(tiny_llama_dir, tiny_adapters):
    runner = runner_for(tiny_llama_dir)
    adapter = load_adapter(tiny_adapters["a"], "a", runner.lora_targets(), num_layers=2, max_lora_rank=16)  # q, v at rank 4
    runner.write_adapter(1, adapter, row_start=16)
    ranks = {(layer, name): w.host_rank[1] for layer, name, w in runner.model.all_slices()}
    assert ranks[(0, "q_proj")] == 4 and ranks[(1, "v_proj")] == 4
    assert ranks[(0, "k_proj")] == 0 and ranks[(1, "down_proj")] == 0
    ids = prompt(5)
    with_lora = chunked_logits(runner, ids, slot=1)
    runner.clear_slot(1)
    assert all(w.host_rank[1] == 0 for _, _, w in runner.model.all_slices())
    torch.testing.assert_close(chunked_logits(runner, ids, slot=1), chunked_logits(runner, ids, slot=-1), rtol=0, atol=0)
    assert not torch.allclose(with_lora, chunked_logits(runner, ids, slot=-1))
    with pytest.raises(ValueError, match=r"slot 2 is out of range 0\.\.1"):
        runner.write_adapter(2, adapter, 0)


def test_model_path_mistakes_get_a_hint(tmp_path: Path, tiny_llama_dir: Path, tiny_adapters) -> None:
    """A file instead of the folder, a folder that does not exist, and an adapter folder given as the model."""
    with pytest.raises(ModelConfigError, match=rf"config\.json: is a file; give the checkpoint folder that holds config\.json \({tiny_llama_dir}\)"):
        load_model_config(tiny_llama_dir / "config.json")
    with pytest.raises(ModelConfigError, match="nope: no such folder"):
        load_model_config(tmp_path / "nope")
    with pytest.raises(ModelConfigError, match="this is a LoRA adapter, not a base model; .*--lora-modules NAME=PATH, lorafleet merge as --adapter PATH"):
        load_model_config(tiny_adapters["a"])
    from runtime.lora.adapter import AdapterError

    with pytest.raises(AdapterError, match=r"adapter_config\.json: is a file; give the adapter folder"):
        load_adapter(tiny_adapters["a"] / "adapter_config.json", "a", {}, num_layers=1, max_lora_rank=8)


def test_engine_config_refuses_kv_cache_mb_with_num_kv_blocks() -> None:
    """kv_cache_mb only sizes the pool when num_kv_blocks is not given; LLM / EngineConfig took both
    and ignored the cap (serve already refused the pair)."""
    from runtime.config import DEFAULT_KV_CACHE_MB, ConfigError, EngineConfig

    with pytest.raises(ConfigError, match="kv_cache_mb: only sizes the KV pool"):
        EngineConfig(model="m", num_kv_blocks=4000, kv_cache_mb=1)
    assert EngineConfig(model="m").kv_cache_cap_mb == DEFAULT_KV_CACHE_MB
    assert EngineConfig(model="m", kv_cache_mb=8).kv_cache_cap_mb == 8
    assert EngineConfig(model="m", num_kv_blocks=4).kv_cache_mb is None


@pytest.mark.parametrize("model_type, heads, kv_heads", [("mistral", 16, 8), ("llama", 4, 4), ("qwen2", 32, 32)])
def test_missing_num_key_value_heads_takes_transformers_default(tmp_path, model_type, heads, kv_heads):
    """A config.json without num_key_value_heads: transformers' MistralConfig defaults to 8 kv heads and
    Qwen2Config to 32, LlamaConfig to num_attention_heads. Taking num_attention_heads for every type
    refused a mistral checkpoint transformers loads (k_proj "has shape (32, 64), config.json implies (64, 64)")."""
    path = build_tiny_model(tmp_path / "m", model_type, seed=4, num_attention_heads=heads, num_key_value_heads=kv_heads)
    cfg = json.loads((path / "config.json").read_text())
    del cfg["num_key_value_heads"]
    (path / "config.json").write_text(json.dumps(cfg))
    assert load_model_config(path).num_key_value_heads == kv_heads
    ids = prompt(2)
    assert_rel(chunked_logits(runner_for(path), ids), hf_logits(path, ids), 1e-4)


def test_missing_num_key_value_heads_default_that_does_not_divide_is_named(tmp_path):
    """qwen2's default of 32 kv heads with 4 query heads: refused, saying where the 32 comes from."""
    path = build_tiny_model(tmp_path / "m", "qwen2", seed=4)
    cfg = json.loads((path / "config.json").read_text())
    del cfg["num_key_value_heads"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError, match=r"num_key_value_heads=32 \(config\.json has no num_key_value_heads: "
                                               r"transformers' qwen2 default\) must divide num_attention_heads=4"):
        load_model_config(path)


def test_llama_mlp_bias_is_honoured(tmp_path):
    """LlamaMLP's gate/up/down carry a bias with mlp_bias=true: loaded and added (it was refused)."""
    path = build_tiny_model(tmp_path / "m", "llama", seed=4, mlp_bias=True)
    assert load_file(str(path / "model.safetensors"))["model.layers.1.mlp.down_proj.bias"].abs().sum() > 0
    assert load_model_config(path).mlp_bias
    ids = prompt(2)
    assert_rel(chunked_logits(runner_for(path), ids), hf_logits(path, ids), 1e-4)
    rewrite(path, lambda t: t.pop("model.layers.0.mlp.up_proj.bias"))
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) model\.layers\.0\.mlp\.up_proj\.bias"):
        runner_for(path)


@pytest.mark.parametrize("model_type", ["qwen2", "mistral"])
def test_mlp_bias_is_not_read_where_transformers_does_not(tmp_path, model_type):
    """Qwen2MLP and MistralMLP have no bias whatever config.json says: mlp_bias=true there was refused."""
    path = build_tiny_model(tmp_path / "m", model_type, seed=4)
    cfg = json.loads((path / "config.json").read_text())
    cfg["mlp_bias"] = True
    (path / "config.json").write_text(json.dumps(cfg))
    assert not load_model_config(path).mlp_bias
    ids = prompt(2)
    assert_rel(chunked_logits(runner_for(path), ids), hf_logits(path, ids), 1e-4)


@pytest.mark.parametrize("change", [{"hidden_act": "swish"}, {"pretraining_tp": 2}])
def test_swish_and_pretraining_tp_load_as_transformers_computes_them(tmp_path, change):
    """hidden_act 'swish' is silu in transformers' ACT2FN, and pretraining_tp changes no product (transformers 5
    does not read it; 4.x split the GEMMs and summed the slices): both were refused."""
    path = build_tiny_model(tmp_path / "m", "llama", seed=4)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(change)
    (path / "config.json").write_text(json.dumps(cfg))
    ids = prompt(2)
    assert_rel(chunked_logits(runner_for(path), ids), hf_logits(path, ids), 1e-4)


def strip_model_prefix(path: Path, prefix: str = "") -> None:
    """Rename the checkpoint's ``model.*`` tensors to ``prefix + *``: with prefix "" the names
    ``LlamaModel.save_pretrained`` writes (``embed_tokens.weight``, ``layers.0...``, ``norm.weight``)."""
    rewrite(path, lambda t: t.update({prefix + k[len("model."):]: t.pop(k) for k in [k for k in t if k.startswith("model.")]}))


@pytest.mark.parametrize("missing, prefix, says", [
    ("lm_head", "", r"its tensors carry no 'model\.' prefix: a base-model save .*which has no LM head; config\.json "
                    r"has tie_word_embeddings=false, so transformers would initialise lm_head\.weight at random"),
    ("model.embed_tokens", "base_model.model.model.", r"its tensors are named 'base_model\.model\.model\.'\.\.\.")])
def test_checkpoint_under_another_prefix_gets_a_hint(tmp_path, missing, prefix, says):
    """A PEFT model saved without merge_and_unload: every tensor was reported missing, with no word on why.
    A base-model save (names without 'model.') of an untied model lacks the LM head, which transformers
    would fill with random numbers: refused, saying so."""
    path = build_tiny_model(tmp_path / "m", "llama", seed=0)
    strip_model_prefix(path, prefix)
    if prefix == "":
        rewrite(path, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match=rf"missing tensor\(s\) {re.escape(missing)}\.weight.*\({says}"):
        runner_for(path)


def test_base_model_save_with_tied_embeddings_matches_transformers(tmp_path):
    """A base-model save (LlamaModel.save_pretrained: no 'model.' prefix, no lm_head) of a model with tied
    embeddings: transformers' from_pretrained adds the prefix and ties the head, and so do serving and
    merge now (the merged checkpoint carries the causal-LM names); it was refused as missing every tensor."""
    from runtime.cli import main as cli_main
    from tests.fixtures.tiny_models import build_adapter

    causal = build_tiny_model(tmp_path / "causal", "llama", seed=3, tie_word_embeddings=True)
    base = tmp_path / "base"
    shutil.copytree(causal, base)
    strip_model_prefix(base)
    assert "layers.0.self_attn.q_proj.weight" in load_file(str(base / "model.safetensors"))
    ids = prompt(1)
    ours = chunked_logits(runner_for(base), ids)
    assert_rel(ours, hf_logits(base, ids), 1e-4)
    assert_rel(ours, chunked_logits(runner_for(causal), ids), 1e-5)  # (not bitwise: the shorter names move the data's alignment)
    adapter = build_adapter(causal, tmp_path / "adapter", r=4, target_modules=["q_proj", "down_proj"], seed=11)
    for src in (causal, base):
        assert cli_main(["merge", "--model", str(src), "--adapter", str(adapter), "--out", str(tmp_path / f"merged-{src.name}"), "--no-verify"]) == 0
    merged = {src: load_file(str(tmp_path / f"merged-{src}" / "model.safetensors")) for src in ("causal", "base")}
    assert merged["base"].keys() == merged["causal"].keys()
    assert all(torch.equal(merged["base"][k], merged["causal"][k]) for k in merged["causal"])


def test_int8_base_model_save_loads_and_merges_as_its_causal_lm_save(tmp_path):
    """An int8 checkpoint (``lorafleet quantize``) saved without the 'model.' prefix: the prefix was
    added to look tensors up, but each tensor's kind was judged by its stored name, so every
    ``layers.N...proj.weight`` code tensor was refused as 'int8, only the projections are integer'
    in serving and merge. Now it loads and merges as the same checkpoint with the prefix."""
    from runtime.cli import main as cli_main
    from runtime.commands.quantize import quantize_checkpoint
    from tests.fixtures.tiny_models import build_adapter

    causal = build_tiny_model(tmp_path / "causal", "llama", seed=3, tie_word_embeddings=True)
    quantize_checkpoint(str(causal), str(tmp_path / "q8"), progress=False)
    base = tmp_path / "q8base"
    shutil.copytree(tmp_path / "q8", base)
    strip_model_prefix(base)
    assert load_file(str(base / "model.safetensors"))["layers.0.self_attn.q_proj.weight"].dtype == torch.int8
    ids = prompt(1)
    assert_rel(chunked_logits(runner_for(base), ids), chunked_logits(runner_for(tmp_path / "q8"), ids), 1e-5)
    adapter = build_adapter(causal, tmp_path / "adapter", r=4, target_modules=["q_proj", "down_proj"], seed=11)
    for src in ("q8", "q8base"):
        assert cli_main(["merge", "--model", str(tmp_path / src), "--adapter", str(adapter), "--out", str(tmp_path / f"m-{src}"), "--no-verify"]) == 0
    merged = {src: load_file(str(tmp_path / f"m-{src}" / "model.safetensors")) for src in ("q8", "q8base")}
    assert merged["q8base"].keys() == merged["q8"].keys()
    assert all(torch.equal(merged["q8base"][k], merged["q8"][k]) for k in merged["q8"])


def test_tensor_stored_with_and_without_the_model_prefix_is_refused(tmp_path):
    path = build_tiny_model(tmp_path / "m", "llama", seed=0)
    rewrite(path, lambda t: t.__setitem__("norm.weight", t["model.norm.weight"] * 2))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor model\.norm\.weight is stored twice, as model\.norm\.weight "
                                              r"and as norm\.weight; keep one of them"):
        runner_for(path)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral"])
def test_explicit_head_dim_matches_transformers(tmp_path, model_type):
    """head_dim given in config.json and not hidden_size / num_attention_heads (32, not 16): q/k/v/o shapes,
    rope and the 1/sqrt(head_dim) scale all follow it, as in transformers."""
    path = build_tiny_model(tmp_path / "m", model_type, seed=4, head_dim=32)
    assert load_model_config(path).head_dim == 32 != 64 // 4
    ids = prompt(2)
    assert_rel(chunked_logits(runner_for(path), ids), hf_logits(path, ids), 1e-4)


def test_weight_beyond_float16_range_is_refused_under_float16(tmp_path):
    """A float32 weight of 1e5 served in float16 became inf, and every logit NaN, without a word."""
    path = build_tiny_model(tmp_path / "m", "llama", seed=0)
    rewrite(path, lambda t: t["model.layers.1.post_attention_layernorm.weight"].__setitem__(3, 1e5))
    runner_for(path, dtype="bfloat16")  # in range there
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor model\.layers\.1\.post_attention_layernorm\.weight "
                                              r"holds values up to 1e\+05, beyond float16's range \(65504\)"):
        runner_for(path, dtype="float16")


def test_null_partial_rotary_factor_is_full_rotary(tmp_path):
    """"partial_rotary_factor": null at the top level sets nothing in transformers (rope on the whole head);
    it was refused as "other than 1.0"."""
    path = build_tiny_model(tmp_path / "m", "llama", seed=4)
    cfg = json.loads((path / "config.json").read_text())
    cfg["partial_rotary_factor"] = None
    (path / "config.json").write_text(json.dumps(cfg))
    ids = prompt(2)
    assert_rel(chunked_logits(runner_for(path), ids), hf_logits(path, ids), 1e-4)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral"])
def test_missing_rms_norm_eps_takes_transformers_default(tmp_path, model_type):
    """A config.json without rms_norm_eps: transformers' LlamaConfig, Qwen2Config and MistralConfig
    default it to 1e-6 and load the model; it was refused as a missing required field."""
    path = build_tiny_model(tmp_path / "m", model_type, seed=4, rms_norm_eps=0.5)
    edit_config(path, {}, drop=("rms_norm_eps",))
    assert load_model_config(path).rms_norm_eps == 1e-6
    ids = prompt(2)
    assert_rel(chunked_logits(runner_for(path), ids), hf_logits(path, ids), 1e-4)
