"""PEFT adapter reader: every bad input gets a specific error naming the file and key/tensor.

Good adapters: scales and ranks agree with PEFT's own LoRA layers (rank_pattern,
alpha_pattern, rsLoRA), regex target_modules and layers_to_transform are honoured,
and the version is a content hash.
"""
from __future__ import annotations

import json
import os
import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime.lora.adapter import AdapterError, load_adapter
from runtime.models.hf_config import load_model_config
from runtime.models.llama import lora_targets
from tests.fixtures.tiny_models import build_adapter

KEY = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


@pytest.fixture(scope="module")
def targets(tiny_llama_dir):
    return lora_targets(load_model_config(tiny_llama_dir))


def load(path, targets, max_lora_rank=64, num_layers=2):
    return load_adapter(path, "x", targets, num_layers=num_layers, max_lora_rank=max_lora_rank)


@pytest.fixture
def copy_of(tmp_path, tiny_adapters):
    def make(name: str = "a") -> Path:
        dst = tmp_path / f"copy_{name}"
        shutil.copytree(tiny_adapters[name], dst)
        return dst

    return make


def edit_config(path: Path, **changes) -> None:
    cfg_path = path / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(changes)
    cfg_path.write_text(json.dumps(cfg))


def edit_tensors(path: Path, fn) -> None:
    file = path / "adapter_model.safetensors"
    tensors = load_file(str(file))
    fn(tensors)
    save_file(tensors, str(file))


def expect(path: Path, targets, *fragments: str, **kw) -> AdapterError:
    with pytest.raises(AdapterError) as info:
        load(path, targets, **kw)
    msg = str(info.value)
    for frag in fragments:
        assert frag in msg, f"{frag!r} not in error: {msg}"
    return info.value


# ---- files ---------------------------------------------------------------------------------


def test_missing_folder(tmp_path, targets):
    expect(tmp_path / "nope", targets, "nope", "does not exist")


def test_missing_config(copy_of, targets):
    path = copy_of()
    (path / "adapter_config.json").unlink()
    expect(path, targets, "adapter_config.json", "missing")


def test_missing_weights(copy_of, targets):
    path = copy_of()
    (path / "adapter_model.safetensors").unlink()
    expect(path, targets, "adapter_model.safetensors", "missing")


@pytest.mark.parametrize("name", ["adapter_config.json", "adapter_model.safetensors"])
@pytest.mark.parametrize("kind", ["folder", "fifo"])
def test_a_file_that_is_not_a_regular_file_is_named_not_called_missing(copy_of, targets, name, kind):
    path = copy_of()
    (path / name).unlink()
    if kind == "folder":
        (path / name).mkdir()
    else:
        os.mkfifo(path / name)  # never opened: reading a FIFO would block the loader
    expect(path, targets, name, "not a regular file")


def test_broken_json(copy_of, targets):
    path = copy_of()
    (path / "adapter_config.json").write_text('{"r": 4, "peft_type": "LORA",')
    expect(path, targets, "adapter_config.json", "invalid JSON")


def test_truncated_safetensors(copy_of, targets):
    path = copy_of()
    file = path / "adapter_model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - 100])
    expect(path, targets, "adapter_model.safetensors", "truncated", "lora_")


def test_truncated_safetensors_header(copy_of, targets):
    path = copy_of()
    file = path / "adapter_model.safetensors"
    file.write_bytes(file.read_bytes()[:50])
    expect(path, targets, "adapter_model.safetensors", "truncated")


def test_weights_larger_than_any_adapter_of_the_model_are_refused_before_they_are_read(copy_of, targets):
    """Tensor data beyond what every target in every layer at max_lora_rank can hold (in float64, the
    widest dtype) is refused from the file's size. Before, the whole file was read into memory first:
    a multi-gigabyte file (a full checkpoint saved under the adapter's name, a sparse file) could
    take the server's memory, and bytes past the last tensor were read and then ignored."""
    path = copy_of()
    file = path / "adapter_model.safetensors"
    legit = file.stat().st_size
    max_data = 8 * 64 * 2 * sum(i + o for i, o in targets.values())  # float64, max_lora_rank 64, 2 layers
    os.truncate(file, legit + max_data)  # sparse: the tensors stay valid, then zeros
    expect(path, targets, "adapter_model.safetensors", "bytes of tensor data", "max_lora_rank=64")
    os.truncate(file, legit)
    assert load(path, targets).modules  # the file as written still loads


def test_an_oversized_config_is_refused_before_it_is_read(copy_of, targets):
    path = copy_of()
    config = path / "adapter_config.json"
    with config.open("a") as f:
        f.write(" " * 17 * 2**20)  # valid JSON still: whitespace after the object
    expect(path, targets, "adapter_config.json", "larger than")


class _MarksIfUnpickled:
    """Unpickling this creates a file: proof that the loader never unpickles."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_only_bin_is_refused_and_never_unpickled(copy_of, targets, tmp_path):
    path = copy_of()
    (path / "adapter_model.safetensors").unlink()
    marker = tmp_path / "unpickled"
    (path / "adapter_model.bin").write_bytes(pickle.dumps(_MarksIfUnpickled(marker)))
    expect(path, targets, "adapter_model.bin", "never unpickled")
    assert not marker.exists()


# ---- config fields -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes, fragments",
    [
        ({"peft_type": "IA3"}, ["peft_type", "IA3"]),
        ({"use_dora": True}, ["use_dora", "DoRA"]),
        ({"modules_to_save": ["lm_head"]}, ["modules_to_save", "lm_head"]),
        ({"bias": "all"}, ["bias", "'all'"]),
        ({"arrow_config": {"top_k": 2}}, ["arrow_config"]),
        ({"kasa_config": {"k": 1}}, ["kasa_config"]),
        ({"monteclora_config": {"n": 1}}, ["monteclora_config"]),
        # Every other config field that changes the math (runtime/lora/adapter.py's _REFUSED_IF_TRUTHY), listed
        # here rather than read from that tuple, so that dropping one from it fails a case.
        ({"lora_bias": True}, ["lora_bias=True", "changes the math"]),
        ({"layer_replication": [[0, 2]]}, ["layer_replication", "changes the math"]),
        ({"target_parameters": ["mlp.experts.gate_up_proj"]}, ["target_parameters", "changes the math"]),
        ({"trainable_token_indices": [1, 2]}, ["trainable_token_indices", "changes the math"]),
        ({"alora_invocation_tokens": [5, 6]}, ["alora_invocation_tokens", "changes the math"]),
        ({"use_qalora": True}, ["use_qalora=True", "changes the math"]),
        ({"use_bdlora": {"nblocks": 2}}, ["use_bdlora", "changes the math"]),
        ({"r": 0}, ["r must be a positive integer"]),
        ({"lora_alpha": "big"}, ["lora_alpha"]),
        ({"target_modules": ["foo_proj", "bar_proj"]}, ["target_modules", "'bar_proj', 'foo_proj'", "no entry is a module"]),
        ({"target_modules": ["q_proj", "lm_head"]}, ["lm_head", "cannot serve"]),
        ({"target_modules": ["embed_tokens"]}, ["model.embed_tokens", "cannot serve"]),
        ({"target_modules": r".*\.nothing_here"}, ["regex", "matches no module"]),
        ({"target_modules": r".*input_layernorm"}, ["input_layernorm", "not a linear"]),
        ({"target_modules": "q_proj("}, ["not a valid regex"]),
        ({"layers_to_transform": [5]}, ["layers_to_transform", "[5]"]),
        ({"target_modules": r".*q_proj", "layers_to_transform": [0]}, ["layers_to_transform", "regex"]),
        ({"layers_pattern": "blocks", "layers_to_transform": [0]}, ["layers_pattern", "select no module"]),
        ({"layers_pattern": 3, "layers_to_transform": [0]}, ["layers_pattern", "string"]),
        ({"rank_pattern": {"q_proj": 128}}, ["rank_pattern['q_proj'] says 128"]),
        ({"use_rslora": "yes"}, ["use_rslora"]),
    ],
)
def test_bad_config_fields(copy_of, targets, changes, fragments):
    path = copy_of()
    edit_config(path, **changes)
    expect(path, targets, "adapter_config.json", *fragments)


def test_config_not_an_object(copy_of, targets):
    path = copy_of()
    (path / "adapter_config.json").write_text("[1, 2]")
    expect(path, targets, "adapter_config.json", "JSON object")


# ---- tensors -------------------------------------------------------------------------------


def test_shape_mismatch_with_base(copy_of, targets):
    path = copy_of()
    edit_tensors(path, lambda t: t.__setitem__(KEY, torch.randn(4, 32)))
    expect(path, targets, "adapter_model.safetensors", KEY, "in_features=64")


def test_b_shape_mismatch_with_base(copy_of, targets):
    path = copy_of()
    key_b = KEY.replace("lora_A", "lora_B")
    edit_tensors(path, lambda t: t.__setitem__(key_b, torch.randn(48, 4)))
    expect(path, targets, key_b, "out_features=64")


def test_rank_disagrees_with_config(copy_of, targets):
    path = copy_of()
    edit_config(path, r=5, lora_alpha=10)
    expect(path, targets, "adapter_model.safetensors", "rank 4", "says 5")


def test_rank_disagrees_between_a_and_b(copy_of, targets):
    path = copy_of()
    edit_tensors(path, lambda t: t.__setitem__(KEY, torch.randn(3, 64)))
    expect(path, targets, KEY, "disagree on the rank")


def test_rank_above_max_lora_rank(tiny_adapters, targets):
    expect(tiny_adapters["c"], targets, "rank 16", "max_lora_rank=8", max_lora_rank=8)
    # and it says what to change (vLLM's default max_lora_rank is 16, lorafleet's 64: r=128 adapters meet this)
    expect(tiny_adapters["c"], targets, "(lorafleet serve --max-lora-rank 16, or LLM(..., max_lora_rank=16), takes it)", max_lora_rank=8)


def test_a_rank_far_above_max_lora_rank_is_named_as_the_rank_not_as_file_size(tiny_adapters, targets):
    """Adapter "c" (r=16) under max_lora_rank=2 holds more tensor data than the size bound allows
    (every target at rank 2 in float64), so the file is refused before any module's rank is read.
    That refusal used to speak only of bytes ("933888 bytes of tensor data, more than an adapter of
    this model can hold"): the demo's rank-16 adapter under --max-lora-rank 4, or an r=256 float32
    adapter under the default 64, got no word on the rank or on --max-lora-rank."""
    err = expect(tiny_adapters["c"], targets, "adapter_config.json r is 16, above max_lora_rank=2",
                 "(lorafleet serve --max-lora-rank 16, or LLM(..., max_lora_rank=16), takes it)", max_lora_rank=2)
    assert "bytes of tensor data" in str(err)  # it is still the size bound that refused it, unread


def test_a_rank_pattern_key_for_no_targeted_module_is_ignored_as_peft_ignores_it(copy_of, targets):
    """Adapter "a" targets q_proj and v_proj at rank 4: a rank_pattern entry for gate_proj changes
    no module's rank, whatever its value (it was refused when above max_lora_rank)."""
    path = copy_of()
    edit_config(path, rank_pattern={"gate_proj": 128})
    adapter = load(path, targets, max_lora_rank=8)
    assert {m.rank for m in adapter.modules.values()} == {4} and adapter.max_rank == 4
    edit_config(path, rank_pattern={"q_proj": 128})  # one it does apply to: its tensors must say 128
    expect(path, targets, "rank_pattern['q_proj'] says 128", max_lora_rank=8)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nan_inf_weights(copy_of, targets, bad):
    path = copy_of()

    def poison(t):
        t[KEY] = t[KEY].clone()
        t[KEY][1, 3] = bad

    edit_tensors(path, poison)
    expect(path, targets, "adapter_model.safetensors", KEY, "NaN or Inf")


def test_missing_tensor(copy_of, targets):
    path = copy_of()
    edit_tensors(path, lambda t: t.pop(KEY))
    expect(path, targets, "adapter_model.safetensors", "missing tensor", KEY)


def test_an_adapter_of_a_shallower_model_says_so(copy_of, targets):
    """An adapter whose tensors stop short of the base's last layer (trained on a model with fewer
    layers: a 16-layer model's on a 32-layer one) got only "missing tensor ...layers.1... and 1 more",
    which reads as a damaged file; the deeper case already said "trained on another model"."""
    path = copy_of()  # "a": q_proj and v_proj in both layers of the tiny llama
    edit_tensors(path, lambda t: [t.pop(k) for k in [k for k in t if ".layers.1." in k]])
    expect(path, targets, "missing tensor base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight and 3 more",
           "it has tensors for layer 0 only and the base has 2 layers: the adapter was trained on a model with fewer layers "
           "(or with a layers_to_transform that adapter_config.json does not give)")
    lone = copy_of("b")  # one tensor missing among the others: no such claim
    edit_tensors(lone, lambda t: t.pop(KEY))
    assert "fewer layers" not in str(expect(lone, targets, "missing tensor", KEY))


def test_extra_tensor(copy_of, targets):
    path = copy_of()
    extra = "base_model.model.model.layers.1.mlp.up_proj.lora_A.weight"
    edit_tensors(path, lambda t: t.__setitem__(extra, torch.randn(4, 64)))
    expect(path, targets, "unexpected tensor", extra)


def test_target_module_the_model_lacks(copy_of, targets):
    """The model exposes only q/k/v/o targets: an adapter on the MLP is refused by name."""
    path = copy_of("c")
    attn_only = {k: v for k, v in targets.items() if k.endswith(("q_proj", "k_proj", "v_proj", "o_proj"))}
    expect(path, attn_only, "not a LoRA target")


# ---- good adapters: PEFT semantics ---------------------------------------------------------


def peft_ranks_and_scales(base_dir: Path, adapter_dir: Path, bare_decoder: bool = False) -> dict[tuple[int, str], tuple[int, float]]:
    """PEFT's (rank, scale) per adapted module; ``bare_decoder``: on the model's decoder alone (``LlamaModel``)."""
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir))
    model = PeftModel.from_pretrained(base.model if bare_decoder else base, str(adapter_dir), adapter_name="x")
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and "x" in module.r:
            m = re.search(r"layers\.(\d+)\.\w+\.(\w+)$", name)
            assert m is not None, name
            out[(int(m.group(1)), m.group(2))] = (module.r["x"], float(module.scaling["x"]))
    return out


@pytest.mark.parametrize("name", ["a", "b", "c", "d", "e"])
def test_ranks_and_scales_match_peft(tiny_llama_dir, tiny_adapters, targets, name):
    adapter = load(tiny_adapters[name], targets)
    ref = peft_ranks_and_scales(tiny_llama_dir, tiny_adapters[name])
    ours = {k: (m.rank, m.scale) for k, m in adapter.modules.items()}
    assert ours.keys() == ref.keys()
    for key, (rank, scale) in ref.items():
        assert ours[key][0] == rank, key
        assert ours[key][1] == pytest.approx(scale, rel=1e-12), key
    assert adapter.max_rank == max(r for r, _ in ref.values())


def test_weights_are_the_files_tensors(tiny_adapters, targets):
    adapter = load(tiny_adapters["e"], targets)
    tensors = load_file(str(tiny_adapters["e"] / "adapter_model.safetensors"))
    m = adapter.modules[(1, "down_proj")]
    assert m.rank == 12 and m.lora_a.dtype == torch.float32
    assert torch.equal(m.lora_a, tensors["base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"].float())
    assert torch.equal(m.lora_b, tensors["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"].float())
    assert m.lora_b.abs().sum() > 0  # init_lora_weights=False: B is random


def test_regex_target_modules_and_layers_to_transform(tiny_llama_dir, tmp_path, targets):
    regex = build_adapter(tiny_llama_dir, tmp_path / "regex", r=4, target_modules=r"model\.layers\.1\.(self_attn\.k_proj|mlp\.up_proj)", seed=3)
    assert set(load(regex, targets).modules) == {(1, "k_proj"), (1, "up_proj")}
    assert set(load(regex, targets).modules) == set(peft_ranks_and_scales(tiny_llama_dir, regex))
    layered = build_adapter(tiny_llama_dir, tmp_path / "layered", r=4, target_modules=["v_proj", "down_proj"], seed=4, layers_to_transform=[0])
    assert set(load(layered, targets).modules) == {(0, "v_proj"), (0, "down_proj")}
    assert set(load(layered, targets).modules) == set(peft_ranks_and_scales(tiny_llama_dir, layered))


def test_version_is_a_content_hash(copy_of, tiny_adapters, targets):
    first = load(tiny_adapters["a"], targets)
    assert re.fullmatch(r"[0-9a-f]{12}", first.version)
    same = copy_of("a")
    assert load(same, targets).version == first.version
    edit_tensors(same, lambda t: t.__setitem__(KEY, t[KEY] + 1e-3))
    assert load(same, targets).version != first.version
    renamed_alpha = copy_of("b")
    edit_config(renamed_alpha, lora_alpha=3)
    assert load(renamed_alpha, targets).version != load(tiny_adapters["b"], targets).version


def test_a_config_without_lora_alpha_means_peft_s_default(copy_of, targets, tiny_llama_dir):
    """PEFT reads a missing lora_alpha as LoraConfig's default (8), not as r: scale = 8 / r."""
    import peft

    path = copy_of("a")
    cfg = json.loads((path / "adapter_config.json").read_text())
    del cfg["lora_alpha"]
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    adapter = load(path, targets)
    assert adapter.lora_alpha == peft.LoraConfig().lora_alpha == 8
    module = next(iter(adapter.modules.values()))
    assert module.scale == pytest.approx(8 / cfg["r"])


# ---- PEFT config variants: read as PEFT reads them, or refused -----------------------------


@pytest.mark.parametrize("init", ["pissa", "pissa_niter_4", "olora", "OLoRA", "corda", "loftq"])
def test_inits_that_rewrite_the_base_are_refused(copy_of, targets, init):
    """With these, PEFT's loader turns each targeted base weight into a residual W - scale * B0 A0
    before adding the adapter, so serving the adapter over the plain base would be silently wrong."""
    path = copy_of()
    edit_config(path, init_lora_weights=init)
    expect(path, targets, "adapter_config.json", f"init_lora_weights={init!r}", "rewrites", "path_initial_model_for_weight_conversion")


@pytest.mark.parametrize("init", [True, False, "gaussian", "eva", "orthogonal", "mica", "lora_ga"])
def test_inits_that_leave_the_base_alone_load(copy_of, targets, tiny_adapters, init):
    path = copy_of()
    edit_config(path, init_lora_weights=init)
    plain = load(tiny_adapters["a"], targets)
    got = load(path, targets)
    assert got.modules.keys() == plain.modules.keys()
    assert all(torch.equal(got.modules[k].lora_b, plain.modules[k].lora_b) for k in plain.modules)


def test_rewriting_inits_are_the_ones_peft_rewrites_the_base_for(tiny_llama_dir):
    """The refused list agrees with PEFT: a PiSSA / OLoRA adapter changes the base layer's weight
    when PEFT creates it; a gaussian one does not."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from runtime.lora.adapter import rewrites_base

    def base_changes(init) -> bool:
        model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)
        before = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
        peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=init))
        return not torch.equal(peft_model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight, before)

    for init in ("pissa", "olora", "gaussian", True):
        assert base_changes(init) == rewrites_base(init), init


def test_fan_in_fan_out_on_linear_layers_is_read_as_false_like_peft(copy_of, targets, tiny_adapters, tiny_llama_dir, caplog):
    path = copy_of()
    edit_config(path, fan_in_fan_out=True)
    with caplog.at_level("WARNING", logger="runtime.lora.adapter"):
        got = load(path, targets)
    assert "fan_in_fan_out" in caplog.text and "read as false" in caplog.text
    plain = load(tiny_adapters["a"], targets)
    assert all(torch.equal(got.modules[k].lora_a, plain.modules[k].lora_a) for k in plain.modules)
    assert {k: (m.rank, m.scale) for k, m in got.modules.items()} == peft_ranks_and_scales(tiny_llama_dir, path)


def test_default_adapter_name_infix_in_keys(copy_of, targets, tiny_adapters):
    """PEFT reads ``lora_A.default.weight`` like ``lora_A.weight``; so does lorafleet. Both at once is refused."""
    path = copy_of()
    edit_tensors(path, lambda t: t.update({k.replace(".weight", ".default.weight"): t.pop(k) for k in list(t)}))
    got, plain = load(path, targets), load(tiny_adapters["a"], targets)
    assert got.modules.keys() == plain.modules.keys()
    assert all(torch.equal(got.modules[k].lora_b, plain.modules[k].lora_b) for k in plain.modules)
    both = copy_of("b")
    edit_tensors(both, lambda t: t.__setitem__(KEY.replace(".weight", ".default.weight"), t[KEY].clone()))
    expect(both, targets, "stored twice", "'.default'")


def test_full_path_target_bypasses_layers_to_transform(tiny_llama_dir, tmp_path, targets):
    """PEFT applies layers_to_transform only to suffix matches: a target named in full is always adapted."""
    path = build_adapter(tiny_llama_dir, tmp_path / "full", r=4, target_modules=["model.layers.0.self_attn.q_proj", "v_proj"], seed=5,
                         layers_to_transform=[1])
    got = set(load(path, targets).modules)
    assert got == {(0, "q_proj"), (1, "v_proj")}
    assert got == set(peft_ranks_and_scales(tiny_llama_dir, path))


@pytest.mark.parametrize("pattern", ["layers", "model.layers", ["blocks", "layers"]])
def test_layers_pattern_is_matched_like_peft(tiny_llama_dir, tmp_path, targets, pattern):
    path = build_adapter(tiny_llama_dir, tmp_path / "pattern", r=4, target_modules=["k_proj", "up_proj"], seed=6, layers_to_transform=[1],
                         layers_pattern=pattern)
    got = set(load(path, targets).modules)
    assert got == {(1, "k_proj"), (1, "up_proj")}
    assert got == set(peft_ranks_and_scales(tiny_llama_dir, path))


def test_an_excluded_unsupported_target_is_not_refused(tiny_llama_dir, tmp_path, targets):
    path = build_adapter(tiny_llama_dir, tmp_path / "excl", r=4, target_modules=["q_proj", "lm_head"], seed=7, exclude_modules=["lm_head"])
    got = set(load(path, targets).modules)
    assert got == {(0, "q_proj"), (1, "q_proj")}
    assert got == set(peft_ranks_and_scales(tiny_llama_dir, path))


@pytest.mark.parametrize("config", [
    dict(target_modules=["q_proj", "v_proj", "down_proj"], rank_pattern={"layers.1.mlp.down_proj": 12}, alpha_pattern={"v_proj": 3.0}),
    dict(target_modules=["k_proj", "up_proj"], layers_to_transform=[1], layers_pattern="layers"),
    dict(target_modules=["q_proj", "v_proj"], exclude_modules=r"layers\.0\.self_attn\.v_proj"),
], ids=["patterns", "layers_pattern", "exclude_regex"])
def test_an_adapter_trained_on_the_bare_decoder_is_read_as_peft_reads_it(tiny_llama_dir, tmp_path, targets, config):
    """PEFT on ``LlamaModel`` (``AutoModel``) names the tensors ``base_model.model.layers...`` and matches
    targets, patterns and exclusions against ``layers.N...`` paths. Such an adapter was refused as
    "unexpected tensor"; it now selects the modules, ranks and scales PEFT gives it on that model, and
    its weights are the file's. (tests/test_peft_match.py checks its logits and tokens.)"""
    path = build_adapter(tiny_llama_dir, tmp_path / "decoder", r=4, seed=9, bare_decoder=True, **config)
    assert next(iter(load_file(str(path / "adapter_model.safetensors")))).startswith("base_model.model.layers.")
    got = load(path, targets)
    assert {k: (m.rank, m.scale) for k, m in got.modules.items()} == peft_ranks_and_scales(tiny_llama_dir, path, bare_decoder=True)
    layer, name = next(iter(got.modules))
    parent = "mlp" if name.endswith(("up_proj", "down_proj", "gate_proj")) else "self_attn"
    tensors = load_file(str(path / "adapter_model.safetensors"))
    assert torch.equal(got.modules[(layer, name)].lora_b, tensors[f"base_model.model.layers.{layer}.{parent}.{name}.lora_B.weight"])


def test_an_adapter_trained_on_the_bare_decoder_is_refused_as_the_others_are(tiny_llama_dir, tmp_path, targets):
    """Its refusals name its own tensors and paths: keys of both forms, the embedding as a target, more layers than the base."""
    path = build_adapter(tiny_llama_dir, tmp_path / "decoder", r=4, target_modules=["q_proj"], seed=10, bare_decoder=True)
    mixed = Path(shutil.copytree(path, tmp_path / "mixed"))
    edit_tensors(mixed, lambda t: t.__setitem__(KEY.replace("layers.0", "layers.1").replace("q_proj", "v_proj"), torch.zeros(4, 64)))
    expect(mixed, targets, "adapter_model.safetensors", "base_model.model.layers.0.self_attn.q_proj.lora_A.weight", "bare decoder",
           "base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight", "*ForCausalLM")
    embedding = Path(shutil.copytree(path, tmp_path / "embedding"))
    edit_config(embedding, target_modules=["q_proj", "embed_tokens"])
    expect(embedding, targets, "adapter_config.json", "selects embed_tokens", "cannot serve LoRA on")
    deeper = Path(shutil.copytree(path, tmp_path / "deeper"))
    edit_tensors(deeper, lambda t: t.update({k.replace("layers.1", "layers.2"): v.clone() for k, v in t.items() if "layers.1" in k}))
    expect(deeper, targets, "base_model.model.layers.2.self_attn.q_proj.lora_A.weight", "the base has 2 layers", "another model")


def test_hand_written_config_shorthands(copy_of, targets, tiny_adapters, tiny_llama_dir, tmp_path, caplog):
    """A literal "all-linear", a missing r (PEFT's default 8) and an entry that matches nothing
    (skipped with a warning, as PEFT skips it) read as PEFT reads them."""
    every = build_adapter(tiny_llama_dir, tmp_path / "every", r=8, target_modules="all-linear", seed=8, lora_alpha=16)
    edit_config(every, target_modules="all-linear")
    del_r = json.loads((every / "adapter_config.json").read_text())
    del del_r["r"]
    (every / "adapter_config.json").write_text(json.dumps(del_r))
    got = load(every, targets)
    assert len(got.modules) == 2 * 7 and got.r == 8
    assert {k: (m.rank, m.scale) for k, m in got.modules.items()} == peft_ranks_and_scales(tiny_llama_dir, every)
    extra = copy_of()
    cfg = json.loads((extra / "adapter_config.json").read_text())
    edit_config(extra, target_modules=list(cfg["target_modules"]) + ["c_attn"])
    with caplog.at_level("WARNING", logger="runtime.lora.adapter"):
        assert load(extra, targets).modules.keys() == load(tiny_adapters["a"], targets).modules.keys()
    assert "'c_attn'" in caplog.text


def test_an_engine_refuses_weights_its_dtype_cannot_hold(copy_of, tiny_llama_dir):
    """A weight beyond float16's range would be inf in a float16 slot, and every request on the
    adapter would end in non-finite logits: a float16 engine refuses it at load, naming the tensor;
    float32 and bfloat16 engines (float32's range) take it."""
    from tests.engine_helpers import make_engine

    folder = copy_of()

    def enlarge(tensors):
        key = next(k for k in sorted(tensors) if "lora_B" in k)
        tensors[key] = tensors[key].clone()
        tensors[key][0, 0] = -7.0e4

    edit_tensors(folder, enlarge)
    with pytest.raises(AdapterError, match=r"layer \d+ \w+ lora_B has a value of magnitude 7e\+04, beyond float16's largest value \(65504\).*--dtype bfloat16 or float32"):
        make_engine(tiny_llama_dir, dtype="float16").register_adapter("big", str(folder))
    for dtype in ("float32", "bfloat16"):
        make_engine(tiny_llama_dir, dtype=dtype).register_adapter("big", str(folder))


def test_the_adapter_records_the_folder_it_was_read_from(copy_of, targets) -> None:
    """``LoRAAdapter.path`` held the decoder's key prefix ("model."), not the folder: a local
    variable named for the folder was reused for it."""
    path = copy_of("a")
    assert load(path, targets).path == str(path)
