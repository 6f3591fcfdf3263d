"""Parse a HF ``config.json`` into a frozen ``ModelConfig`` for the Llama-family decoder.

Supported ``model_type``: llama, qwen2, mistral. Everything the decoder cannot honour
is a ``ModelConfigError`` naming the file and the field; nothing is silently ignored.
Left out of config.json, ``num_key_value_heads`` (llama: num_attention_heads, mistral 8,
qwen2 32), ``rms_norm_eps`` (1e-6 for all three), ``rope_theta``, ``tie_word_embeddings``,
``hidden_act`` and ``sliding_window`` take transformers' default for the model type; the size
fields are required.

Rope: both layouts are read: transformers 4.x (``rope_theta`` + ``rope_scaling``) and
transformers 5.x (``rope_parameters`` holding ``rope_type``, the scaling fields and
usually ``rope_theta``; a ``rope_theta`` missing there is taken from the top level, else
10000, as transformers does; a ``rope_theta`` inside ``rope_scaling`` likewise wins over the
top-level one). When both layouts are present they must agree, on the scaling and on the theta
each yields; an empty one (``{}`` or null) does not count, as in transformers (``rope_scaling or
rope_parameters``). Supported rope types: default, ``linear``, ``llama3``. A llama3 scaling without
``original_max_position_embeddings`` (in the rope dict or at the top level) takes
``max_position_embeddings``, as transformers 5 does (``standardize_rope_params``; 4.x refused it).

Sliding window (mistral; qwen2 with ``use_sliding_window`` in the layers that use it): the
decoder runs full causal attention, which equals sliding-window attention as long as a
sequence is no longer than the window. So ``max_model_len`` is capped to the window instead
of ignoring it; ``ModelConfig.max_model_len`` is that cap. As in transformers, a mistral or
qwen2 config.json without a ``sliding_window`` key gets the default window of 4096; only
``"sliding_window": null`` means full attention. Which qwen2 layers slide follows transformers'
Qwen2Config: ``layer_types`` if given, else the layers from ``max_window_layers`` (default 28)
on; when none does, there is no window (and no cap). Llama has no sliding window: a
``sliding_window`` key in its config.json is not read, as transformers does not read it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from runtime.hub_hint import hub_download_hint

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
SILU_NAMES = ("silu", "swish")  # transformers' ACT2FN: both are x * sigmoid(x)
# transformers' default sliding_window of MistralConfig and Qwen2Config (checked with
# transformers 5.24.0), used when their config.json has no sliding_window key.
DEFAULT_SLIDING_WINDOW = 4096
QWEN2_MAX_WINDOW_LAYERS = 28  # transformers' Qwen2Config default: layers from this index on use the window
DEFAULT_ROPE_THETA = 10000.0  # transformers' RotaryEmbeddingConfigMixin.default_theta (llama, qwen2, mistral)
DEFAULT_RMS_NORM_EPS = 1e-6  # transformers' LlamaConfig, MistralConfig and Qwen2Config default (5.24.0, as 4.x)
# transformers' num_key_value_heads for a config.json without the key: MistralConfig's 8, Qwen2Config's 32;
# LlamaConfig's is None, which (as an explicit null in any of the three) means num_attention_heads.
DEFAULT_KV_HEADS = {"mistral": 8, "qwen2": 32}


class ModelConfigError(ValueError):
    """config.json describes a model this decoder cannot run; the message names file and field."""


@dataclass(frozen=True)
class RopeScaling:
    """``rope_type`` linear: positions divided by ``factor``. llama3: frequency-dependent (see rope.py)."""

    rope_type: str
    factor: float
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None


@dataclass(frozen=True)
class ModelConfig:
    name: str  # base-model id (the checkpoint folder's name); part of prefix-cache keys
    path: str
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    vocab_size: int
    attention_bias: bool  # q/k/v carry a bias (qwen2 always; llama with attention_bias; mistral never)
    o_proj_bias: bool  # llama's attention_bias also puts a bias on o_proj
    mlp_bias: bool  # gate/up/down carry a bias (llama with mlp_bias; qwen2 and mistral never)
    sliding_window: int | None  # honoured by capping max_model_len to it
    torch_dtype: str | None  # the checkpoint's own dtype, informational

    @property
    def max_model_len(self) -> int:
        """Longest sequence the decoder computes exactly (see module docstring)."""
        if self.sliding_window is not None:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Read ``model_dir/config.json``; errors name the file and field."""
    folder = Path(model_dir)
    if folder.is_file():
        raise ModelConfigError(f"{folder}: is a file; give the checkpoint folder that holds config.json ({folder.parent})")
    if not folder.is_dir():
        raise ModelConfigError(f"{folder}: no such folder (a HF checkpoint folder with config.json){hub_download_hint(folder)}")
    path = folder / "config.json"
    if not path.is_file():
        hint = (" It holds adapter_config.json: this is a LoRA adapter, not a base model; give its base model here "
                "(lorafleet serve takes the adapter as --lora-modules NAME=PATH, lorafleet merge as --adapter PATH)") \
            if (folder / "adapter_config.json").is_file() else ""
        raise ModelConfigError(f"{path}: missing (a HF checkpoint folder needs config.json).{hint}")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ModelConfigError(f"{path}: invalid JSON: {err}") from err
    if not isinstance(raw, dict):
        raise ModelConfigError(f"{path}: expected a JSON object")
    return parse_model_config(raw, path)


def parse_model_config(raw: Mapping[str, Any], path: Path) -> ModelConfig:
    f = _Fields(raw, path)
    model_type = f.get("model_type", str)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelConfigError(f"{path}: model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    act = raw.get("hidden_act", "silu")
    if act not in SILU_NAMES:
        raise ModelConfigError(f"{path}: hidden_act {act!r} is not supported (the decoder uses SwiGLU with silu, "
                               f"hidden_act {' or '.join(map(repr, SILU_NAMES))})")
    # pretraining_tp is not read: transformers 5 ignores it, and 4.x only split each projection's GEMM into
    # pretraining_tp slices and summed or concatenated them, the same products.
    hidden = f.get("hidden_size", int)
    heads = f.get("num_attention_heads", int)
    kv_heads, kv_origin = _kv_heads(raw, model_type, heads)
    if isinstance(kv_heads, bool) or not isinstance(kv_heads, int) or kv_heads <= 0 or heads % kv_heads:
        raise ModelConfigError(f"{path}: num_key_value_heads={kv_heads!r}{kv_origin} must divide num_attention_heads={heads}")
    head_dim = raw.get("head_dim") or hidden // heads
    if not isinstance(head_dim, int) or head_dim % 2:
        raise ModelConfigError(f"{path}: head_dim={head_dim!r} must be an even integer")
    max_pos = f.get("max_position_embeddings", int)  # (before the rope: llama3 may default to it)
    theta, scaling = _parse_rope(raw, path)
    # Only LlamaAttention reads attention_bias (q/k/v and o); Qwen2Attention always has q/k/v biases and
    # MistralAttention never has any, whatever their config.json says.
    llama_bias = model_type == "llama" and bool(raw.get("attention_bias", False))
    # Likewise only LlamaMLP reads mlp_bias (gate/up/down); Qwen2MLP and MistralMLP never have a bias.
    mlp_bias = model_type == "llama" and bool(raw.get("mlp_bias", False))
    attention_bias = model_type == "qwen2" or llama_bias
    return ModelConfig(
        name=path.parent.resolve().name,
        path=str(path.parent),
        model_type=model_type,
        hidden_size=hidden,
        intermediate_size=f.get("intermediate_size", int),
        num_hidden_layers=f.get("num_hidden_layers", int),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(f.get("rms_norm_eps", (int, float), DEFAULT_RMS_NORM_EPS)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        vocab_size=f.get("vocab_size", int),
        attention_bias=attention_bias,
        o_proj_bias=llama_bias,
        mlp_bias=mlp_bias,
        sliding_window=_sliding_window(raw, model_type, path),
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
    )


def _kv_heads(raw: Mapping[str, Any], model_type: str, heads: int) -> tuple[Any, str]:
    """num_key_value_heads as transformers reads it, and a note for an error when it is not config.json's own:
    a missing key is the model type's default (``DEFAULT_KV_HEADS``; mistral 8, not num_attention_heads),
    a null one num_attention_heads."""
    if "num_key_value_heads" not in raw and model_type in DEFAULT_KV_HEADS:
        return DEFAULT_KV_HEADS[model_type], f" (config.json has no num_key_value_heads: transformers' {model_type} default)"
    value = raw.get("num_key_value_heads")
    return (heads, "") if value is None else (value, "")


def _sliding_window(raw: Mapping[str, Any], model_type: str, path: Path) -> int | None:
    if model_type not in ("mistral", "qwen2"):
        return None  # LlamaAttention has no window, whatever its config.json says
    if model_type == "qwen2":
        if not raw.get("use_sliding_window", False):
            return None  # qwen2 stores a window but only uses it with use_sliding_window
        layer_types = raw.get("layer_types")
        if layer_types is not None:
            if not isinstance(layer_types, list):
                raise ModelConfigError(f"{path}: layer_types must be a list of 'full_attention' / 'sliding_attention', got {layer_types!r}")
            slides = "sliding_attention" in layer_types
        else:
            first = raw.get("max_window_layers", QWEN2_MAX_WINDOW_LAYERS)
            if not isinstance(first, int) or isinstance(first, bool):
                raise ModelConfigError(f"{path}: max_window_layers={first!r} must be an integer")
            slides = first < int(raw.get("num_hidden_layers", 0))
        if not slides:
            return None  # every layer attends in full (transformers' Qwen2Config layer_types)
    # For mistral and qwen2 a missing key is not "no window": transformers' MistralConfig and
    # Qwen2Config then use their default window; only an explicit null means full attention.
    window = raw.get("sliding_window", DEFAULT_SLIDING_WINDOW)
    if window is None:
        return None
    if not isinstance(window, int) or window <= 0:
        raise ModelConfigError(f"{path}: sliding_window={window!r} must be a positive integer or null")
    return window


def _parse_rope(raw: Mapping[str, Any], path: Path) -> tuple[float, RopeScaling | None]:
    params = raw.get("rope_parameters")
    legacy = raw.get("rope_scaling")
    if params is not None and not isinstance(params, dict):
        raise ModelConfigError(f"{path}: rope_parameters must be an object or null, got {params!r}")
    if params:  # an empty rope_parameters is transformers' ``rope_scaling or rope_parameters`` losing to rope_scaling
        nested = sorted(k for k, v in params.items() if isinstance(v, dict))
        if nested:
            raise ModelConfigError(f"{path}: rope_parameters per layer type ({', '.join(nested)}) is not supported")
        # transformers 5.x layout. rope_theta may also sit at the top level next to it: transformers
        # then copies it in (rope_parameters.setdefault("rope_theta", rope_theta)), else its default.
        theta = _layout_theta(params, raw)
        scaling = _rope_scaling(params, "rope_parameters", path, raw)
        # transformers takes rope_scaling over rope_parameters when both are given (an empty one is
        # not: ``rope_scaling or rope_parameters``): they must agree, on the theta each yields too.
        if legacy and (_rope_scaling(legacy, "rope_scaling", path, raw) != scaling or _layout_theta(legacy, raw) != theta):
            raise ModelConfigError(
                f"{path}: rope_parameters and rope_scaling disagree ({params!r} vs {legacy!r}, rope_theta "
                f"{theta!r} vs {_layout_theta(legacy, raw)!r}); keep one of them"
            )
    else:  # transformers 4.x layout (or neither); a rope_theta inside rope_scaling wins over the top-level one, as in transformers
        scaling = _rope_scaling(legacy, "rope_scaling", path, raw)
        theta = _layout_theta(legacy, raw)
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise ModelConfigError(f"{path}: rope_theta={theta!r} must be a positive number")
    partial = raw.get("partial_rotary_factor")  # null, as absent, is full rotary in transformers (it sets nothing)
    if partial is not None and partial != 1.0:
        raise ModelConfigError(f"{path}: partial_rotary_factor={partial!r} is not supported (only 1.0: rope on the whole head)")
    return float(theta), scaling


def _layout_theta(rope: Any, raw: Mapping[str, Any]) -> Any:
    """The rope_theta one rope layout (``rope_parameters`` or ``rope_scaling``, a dict or None) yields:
    its own ``rope_theta``, else the top-level one, else the default (transformers'
    ``rope_parameters.setdefault("rope_theta", rope_theta)``)."""
    top = raw.get("rope_theta", DEFAULT_ROPE_THETA)
    return rope.get("rope_theta", top) if isinstance(rope, dict) else top


def _rope_scaling(scaling_src: Any, field: str, path: Path, raw: Mapping[str, Any]) -> RopeScaling | None:
    """The scaling described by ``rope_parameters`` or ``rope_scaling`` (``field``); None = plain rope.

    llama3: an ``original_max_position_embeddings`` at the top level of config.json is the one
    transformers 5 uses (``standardize_rope_params`` gives it priority), where 4.x read the one in
    ``field``: taken when ``field`` has none, refused when the two differ. With neither,
    ``max_position_embeddings`` (transformers 5's ``setdefault``)."""
    if scaling_src is None:
        return None
    if not isinstance(scaling_src, dict):
        raise ModelConfigError(f"{path}: {field} must be an object or null, got {scaling_src!r}")
    if scaling_src.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelConfigError(f"{path}: {field}.partial_rotary_factor={scaling_src['partial_rotary_factor']!r} is not supported "
                               "(only 1.0: rope on the whole head)")
    rope_type = scaling_src.get("rope_type", scaling_src.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelConfigError(
            f"{path}: {field}.rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return None
    factor = scaling_src.get("factor")
    if not isinstance(factor, (int, float)) or factor <= 0:
        raise ModelConfigError(f"{path}: {field}.factor={factor!r} must be a positive number for rope_type {rope_type!r}")
    if rope_type == "linear":
        return RopeScaling("linear", float(factor))
    top_len = raw.get("original_max_position_embeddings")
    if top_len is not None:
        inner = scaling_src.get("original_max_position_embeddings")
        if inner is not None and inner != top_len:
            raise ModelConfigError(
                f"{path}: original_max_position_embeddings={top_len!r} (top level) and {field}.original_max_position_embeddings="
                f"{inner!r} disagree: transformers 5 uses the top-level one, 4.x the one in {field}; keep one of them"
            )
        scaling_src = {**scaling_src, "original_max_position_embeddings": top_len}
    elif "original_max_position_embeddings" not in scaling_src:
        scaling_src = {**scaling_src, "original_max_position_embeddings": raw.get("max_position_embeddings")}
    needed = ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in needed if not isinstance(scaling_src.get(k), (int, float))]
    if missing:
        raise ModelConfigError(f"{path}: {field} of rope_type 'llama3' needs {', '.join(missing)}")
    if scaling_src["high_freq_factor"] <= scaling_src["low_freq_factor"]:
        raise ModelConfigError(f"{path}: {field}.high_freq_factor must exceed low_freq_factor")
    return RopeScaling(
        "llama3",
        float(factor),
        float(scaling_src["low_freq_factor"]),
        float(scaling_src["high_freq_factor"]),
        int(scaling_src["original_max_position_embeddings"]),
    )


class _Fields:
    """Required, typed fields of config.json."""

    def __init__(self, raw: Mapping[str, Any], path: Path) -> None:
        self.raw, self.path = raw, path

    def get(self, key: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
        """``raw[key]``, checked: of type ``kind`` and positive. Absent: ``default`` where one is given
        (transformers' default for the field), else an error."""
        if key not in self.raw:
            if default is not None:
                return default
            raise ModelConfigError(f"{self.path}: required field {key!r} is missing")
        value = self.raw[key]
        if isinstance(value, bool) or not isinstance(value, kind):
            raise ModelConfigError(f"{self.path}: field {key!r} has the wrong type: {value!r}")
        if isinstance(value, (int, float)) and value <= 0:
            raise ModelConfigError(f"{self.path}: field {key!r} must be positive, got {value!r}")
        return value
