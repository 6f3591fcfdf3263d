"""Load a HF checkpoint's weights from safetensors: single file or sharded index.

Accepted layouts: ``model.safetensors``, or ``model.safetensors.index.json`` whose
``weight_map`` names the shard of every tensor (where both are there, ``model.safetensors``
is read and the index is not, as transformers' ``from_pretrained`` does; a config.json
``transformers_weights`` naming another file, which transformers would load instead, is a
``CheckpointError``); a shard entry must be a relative path
inside the checkpoint folder (no absolute path, no ``..``; where a symlink points does not
matter, as in the HF hub cache), and a shard that is not a readable safetensors file is a
``CheckpointError`` naming it. Pickled weights (``*.bin``, ``*.pt``,
``*.pth``) are refused and never opened. Every expected tensor must be present with
the shape ``ModelConfig`` implies, and in a float checkpoint (no ``quantization_config``)
stored as a float dtype; a missing, misshapen, integer or unexpected tensor is a
``CheckpointError`` naming the tensor and the file (and, where the names sit under another
prefix than ``model.``, which one). Weights are cast to the compute dtype on the way in;
a finite weight that the cast would turn into inf (a bfloat16 or float32 checkpoint beyond
float16's 65504, served in float16) is a ``CheckpointError``.

int8 weight-only checkpoints (``quantization_config.quant_method`` =
``lorafleet-int8-wo`` in config.json, format in ``runtime/quant/int8.py``): each of the
seven projections is read as an ``Int8Weight`` (int8 codes ``<name>`` [out, in] +
float32 ``<name>_scale`` [out]) and stays int8 in memory; every other tensor is float
and cast to the compute dtype as usual. Any other ``quantization_config`` is refused.

Names: those of transformers' ``*ForCausalLM`` (``model.layers.0...``, ``lm_head.weight``). A
base-model save (``LlamaModel.save_pretrained``, AutoModel) stores the decoder's tensors without
the ``model.`` prefix (``layers.0...``, ``embed_tokens.weight``, ``norm.weight``) and no LM head;
as transformers' ``from_pretrained`` does, the prefix is added (``causal_lm_names``), so such a
checkpoint loads where its embeddings are tied; untied, the missing ``lm_head.weight`` (which
transformers would initialise at random) is a ``CheckpointError`` that says why. A tensor stored
both with and without the prefix is a ``CheckpointError``.

Tolerated extras: ``*.rotary_emb.inv_freq`` (a buffer older checkpoints saved; we
recompute it from the config) and ``lm_head.weight`` when embeddings are tied, if it
equals ``model.embed_tokens.weight`` (HF uses the embedding matrix then, and so do we).
A tied ``lm_head.weight`` that differs is a ``CheckpointError``: transformers 5 then
unties the two and uses it as the head, so which matrix computes the logits is the
checkpoint's call, not ours.
"""
from __future__ import annotations

import json
import math
from pathlib import Path, PurePath
from typing import Any, Iterable

import torch
from safetensors import safe_open
from torch import Tensor

from runtime.models.hf_config import ModelConfig
from runtime.quant.int8 import Int8Weight, QuantizationConfigError, is_quantized_projection, quantization_scheme, scale_name

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BASE_MODEL_PREFIX = "model."  # transformers' base_model_prefix of LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM
BASE_MODEL_MODULES = ("embed_tokens.", "layers.", "norm.")  # what LlamaModel (Qwen2Model, MistralModel) holds
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


class CheckpointError(ValueError):
    """The checkpoint's weights are missing, misshapen or in a refused format; names file + tensor."""


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not supported; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape, for every tensor the decoder needs."""
    h, inter, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
                p + "mlp.gate_proj.weight": (inter, h),
                p + "mlp.up_proj.weight": (inter, h),
                p + "mlp.down_proj.weight": (h, inter),
            }
        )
        if cfg.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,), p + "self_attn.v_proj.bias": (kv,)})
        if cfg.o_proj_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if cfg.mlp_bias:
            shapes.update({p + "mlp.gate_proj.bias": (inter,), p + "mlp.up_proj.bias": (inter,), p + "mlp.down_proj.bias": (h,)})
    return shapes


def checkpoint_quantization(model_dir: str | Path) -> dict | None:
    """The checkpoint's quantization scheme from config.json (None = float weights); CheckpointError if unsupported."""
    path = Path(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: cannot read: {err}") from err
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    try:
        scheme = quantization_scheme(raw, path)
    except QuantizationConfigError as err:
        raise CheckpointError(str(err)) from err
    legacy = Path(model_dir) / "quantize_config.json"  # AutoGPTQ's file, from before quantization_config lived in config.json
    if scheme is None and legacy.is_file():
        raise CheckpointError(
            f"{legacy}: a GPTQ-style quantized checkpoint (its settings in quantize_config.json, not in config.json's "
            "quantization_config) is not supported; lorafleet loads float weights or its own int8 scheme (`lorafleet quantize`)"
        )
    return None if scheme is None else dict(scheme)


def quantized_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """``expected_shapes`` plus a ``<projection>.weight_scale`` [out] for every quantized projection."""
    shapes = expected_shapes(cfg)
    for name, shape in list(shapes.items()):
        if is_quantized_projection(name):
            shapes[scale_name(name)] = (shape[0],)
    return shapes


def weight_files(model_dir: str | Path) -> dict[str, Path]:
    """Tensor name -> safetensors file that holds it (the single file, else from the index)."""
    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    single = root / "model.safetensors"
    explicit = _explicit_weights(root)
    chosen = single.name if single.is_file() else index.name
    if explicit is not None and explicit != chosen:
        raise CheckpointError(
            f"{root / 'config.json'}: transformers_weights={explicit!r} names the weights file transformers loads, but "
            f"lorafleet reads {chosen} and does not follow transformers_weights: make {explicit!r} the checkpoint's "
            f"model.safetensors (or model.safetensors.index.json) and drop the field"
        )
    if single.is_file():  # first, as in transformers: a model.safetensors beside an index is what it loads
        return {name: single for name in _keys(single)}
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise CheckpointError(f"{index}: not a valid safetensors index (needs a 'weight_map' object): {err}") from err
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: 'weight_map' must map tensor names to shard files")
        files = {name: _shard_path(root, index, name, shard) for name, shard in weight_map.items()}
        for name, shard in files.items():
            if not shard.is_file():
                raise CheckpointError(f"{index}: tensor {name!r} lives in shard {shard.name}, which is missing")
        return files
    pickled = sorted(p.name for p in root.glob("*") if p.suffix in PICKLE_SUFFIXES)
    if pickled:
        raise CheckpointError(
            f"{root}: only pickled weights found ({', '.join(pickled)}); they are refused and never unpickled. "
            "Convert the checkpoint to safetensors (model.safetensors)."
        )
    raise CheckpointError(f"{root}: no model.safetensors or model.safetensors.index.json")


def causal_lm_name(stored: str) -> str:
    """The ``*ForCausalLM`` name of a tensor stored as ``stored``: a decoder name without
    the ``model.`` prefix (``layers.0...``, ``embed_tokens.weight``, ``norm.weight``: a base model's
    own, ``LlamaModel``'s) gets it; every other name is its own."""
    return BASE_MODEL_PREFIX + stored if stored.startswith(BASE_MODEL_MODULES) else stored


def causal_lm_names(files: dict[str, Path]) -> dict[str, str]:
    """Tensor name as ``*ForCausalLM`` names it -> the name stored in the checkpoint, for every tensor of
    ``files`` (stored name -> file). A decoder tensor stored without the ``model.`` prefix (a base-model
    save: ``layers.0...``, ``embed_tokens.weight``, ``norm.weight``) gets it, as transformers'
    ``from_pretrained`` adds ``base_model_prefix`` where the key is the model's only with it; every other
    name is its own. A tensor stored under both names is a CheckpointError (which one transformers
    loads is not ours to guess)."""
    names: dict[str, str] = {}
    for stored in files:
        name = causal_lm_name(stored)
        if name in names:
            first, second = sorted((names[name], stored))
            raise CheckpointError(f"{files[stored]}: tensor {name} is stored twice, as {first} and as {second}; keep one of them")
        names[name] = stored
    return names


def _explicit_weights(root: Path) -> Any:
    """config.json's ``transformers_weights`` (the weights file transformers' ``from_pretrained`` loads
    in place of model.safetensors / its index), or None; an unreadable config.json is reported elsewhere."""
    try:
        raw = json.loads((root / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return raw.get("transformers_weights") if isinstance(raw, dict) else None


def _shard_path(root: Path, index: Path, name: str, shard: object) -> Path:
    """``root / shard`` for one ``weight_map`` entry; refused if the entry leaves the checkpoint folder.

    Judged on the entry as written (absolute, or any ``..`` part), not on where a symlink
    points: the HF hub cache keeps every shard as a link into a blobs folder outside.
    """
    entry = f"{index}: weight_map[{name!r}] = {shard!r}"
    if not isinstance(shard, str) or not shard:
        raise CheckpointError(f"{entry}: must be a shard file name (a non-empty string)")
    rel = PurePath(shard)
    if rel.is_absolute() or ".." in rel.parts:
        raise CheckpointError(f"{entry}: points outside the checkpoint folder {root}; shards must lie inside it")
    return root / rel


def _keys(path: Path) -> list[str]:
    try:
        with safe_open(str(path), framework="pt") as f:
            return list(f.keys())
    except Exception as err:  # safetensors raises several error types for a corrupt file; re-raise with the file named
        raise CheckpointError(f"{path}: not a readable safetensors file: {err}") from err


def check_checkpoint(cfg: ModelConfig, model_dir: str | Path) -> tuple[dict[str, Path], dict[str, tuple[int, ...]]]:
    """The checkpoint's tensors against ``config.json``, from the files' headers alone (no tensor
    is read): every tensor the config implies is there, in the shard the index names, with the
    shape the config implies (stored as a float dtype, unless config.json names the int8 scheme),
    and nothing else is (bar the tolerated extras). Returns
    (stored name -> file, ``*ForCausalLM`` name -> shape; ``causal_lm_names`` links the two);
    a CheckpointError names the file and the tensor otherwise."""
    files = weight_files(model_dir)
    stored = causal_lm_names(files)
    quantized = checkpoint_quantization(model_dir) is not None
    shapes = quantized_shapes(cfg) if quantized else expected_shapes(cfg)
    missing = [n for n in shapes if n not in stored]
    if missing:
        where = sorted({str(p) for p in files.values()}) or [str(model_dir)]
        raise CheckpointError(f"{', '.join(where)}: missing tensor(s) {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}"
                              f"{_prefix_hint(files, missing)}")
    unexpected = [stored[n] for n in stored if n not in shapes and not _tolerated(n, cfg)]
    if unexpected:
        raise CheckpointError(f"{files[unexpected[0]]}: unexpected tensor(s) {', '.join(sorted(unexpected)[:8])} for a {cfg.model_type} of this config")
    causal_name = {s: n for n, s in stored.items()}
    for path, names in _by_file(files, [stored[n] for n in shapes]).items():
        with _open(path) as f:
            held = set(f.keys())
            absent = [n for n in names if n not in held]
            if absent:  # only an index can claim a tensor for a file that lacks it
                raise CheckpointError(
                    f"{path}: tensor {absent[0]} is not in this shard (model.safetensors.index.json names it)"
                )
            for name in names:
                tensor = f.get_slice(name)
                got = tuple(tensor.get_shape())
                want = shapes[causal_name[name]]
                if got != want:
                    raise CheckpointError(f"{path}: tensor {name} has shape {got}, config.json implies {want}")
                stored_dtype = tensor.get_dtype()  # safetensors' name: F32, BF16, F16, F8_E4M3, ... I8, U8, I32, BOOL
                if not quantized and not stored_dtype.startswith(("F", "BF")):
                    raise CheckpointError(
                        f"{path}: tensor {name} is stored as {stored_dtype}; config.json has no quantization_config, so every "
                        "weight must be float (int8 codes without their scales would be cast to float as if they were weights)"
                    )
    return files, shapes


def base_dtype(cfg: ModelConfig, files: dict[str, Path]) -> str | None:
    """The base's dtype, as merge and quantize default their output to it: config.json's
    ``torch_dtype`` (or ``dtype``) where it names one of ``DTYPES``, else (absent, or ``"auto"``,
    transformers' word for "as stored") the one its weights are stored in (``_stored_float_dtype``)."""
    return cfg.torch_dtype if cfg.torch_dtype in DTYPES else _stored_float_dtype(files)


def _stored_float_dtype(files: dict[str, Path]) -> str | None:
    """The dtype most of the checkpoint's float weights (by element count, so float32 norms
    beside bfloat16 matrices do not decide) are stored in, from the headers ("float32",
    "bfloat16" or "float16"); None if it holds no float tensor of those."""
    names = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
    counts: dict[str, int] = {}
    for path, group in _by_file(files, files).items():
        with _open(path) as f:
            for name in group:
                tensor = f.get_slice(name)
                stored = names.get(tensor.get_dtype())
                if stored is not None:
                    counts[stored] = counts.get(stored, 0) + math.prod(tensor.get_shape())
    return max(counts, key=counts.__getitem__) if counts else None


def _open(path: Path) -> Any:
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as err:  # SafetensorError and friends: a truncated or garbled file (size is checked at open)
        raise CheckpointError(f"{path}: not a readable safetensors file: {err}") from err


def load_weights(
    cfg: ModelConfig, model_dir: str | Path, dtype: torch.dtype, device: torch.device
) -> dict[str, Tensor | Int8Weight]:
    """Check names and shapes first (from headers), then read every tensor cast to ``dtype``.

    For an int8 checkpoint the projections come back as ``Int8Weight`` (codes stay int8,
    scales float32), keyed by their ``.weight`` name; their ``_scale`` tensors are folded in.
    """
    files, shapes = check_checkpoint(cfg, model_dir)
    check_tied_head(cfg, files)
    quantized = checkpoint_quantization(model_dir) is not None
    stored = causal_lm_names(files)
    causal_name = {s: n for n, s in stored.items()}
    raw: dict[str, Tensor] = {}
    for path, names in _by_file(files, [stored[n] for n in shapes]).items():
        with _open(path) as f:
            for name in names:
                raw[causal_name[name]] = f.get_tensor(name)
                if quantized:
                    check_quantized_tensor(causal_name[name], raw[causal_name[name]], path, stored_as=name)
    out: dict[str, Tensor | Int8Weight] = {}
    for name, tensor in raw.items():
        if quantized and is_quantized_projection(name):
            out[name] = Int8Weight(tensor.contiguous(), raw[scale_name(name)].contiguous()).to(device)
        elif not (quantized and name.endswith("_scale") and is_quantized_projection(name[: -len("_scale")])):
            out[name] = _cast(stored[name], tensor, files[stored[name]], dtype, device)
    return out


def _cast(name: str, tensor: Tensor, path: Path, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``tensor`` in ``dtype`` on ``device``; a CheckpointError where the cast narrows the range (bfloat16 or
    float32 weights served in float16, max 65504) and a finite weight becomes inf: every logit would be NaN."""
    cast = tensor.to(device=device, dtype=dtype)
    narrows = tensor.is_floating_point() and torch.finfo(dtype).max < torch.finfo(tensor.dtype).max
    if narrows and bool(torch.isinf(cast).any()):
        if bool(torch.isfinite(tensor).all()):  # (an inf stored as such is the checkpoint's own)
            wider = "bfloat16 or float32" if dtype == torch.float16 else "float32"
            raise CheckpointError(
                f"{path}: tensor {name} holds values up to {float(tensor.abs().max()):.4g}, beyond {str(dtype).removeprefix('torch.')}'s "
                f"range ({torch.finfo(dtype).max:.6g}): they would become inf; serve this checkpoint in {wider} (--dtype)"
            )
    return cast


def check_tied_head(cfg: ModelConfig, files: dict[str, Path]) -> None:
    """A checkpoint with tied embeddings may also store ``lm_head.weight``, but only as a copy of the
    embedding: transformers 5 unties the two when they differ (``torch.equal``) and computes the
    logits with ``lm_head.weight``, where the tied head here is the embedding matrix. Reads the two
    tensors (``check_checkpoint`` reads headers only); serving, merge and quantize all call it."""
    stored = causal_lm_names(files)
    if not cfg.tie_word_embeddings or "lm_head.weight" not in stored:
        return
    tensors = {}
    for name in ("lm_head.weight", "model.embed_tokens.weight"):
        with _open(files[stored[name]]) as f:
            tensors[name] = f.get_tensor(stored[name])
    head, embed = tensors["lm_head.weight"], tensors["model.embed_tokens.weight"]
    same = head.shape == embed.shape and (torch.equal(head, embed) if head.dtype == embed.dtype else torch.equal(head.float(), embed.float()))
    if not same:  # (the float copies only for mixed dtypes: a large vocabulary's head is hundreds of MB)
        raise CheckpointError(
            f"{files['lm_head.weight']}: tensor lm_head.weight differs from model.embed_tokens.weight, but config.json has "
            "tie_word_embeddings=true (the LM head is the embedding matrix); transformers 5 then unties them and uses "
            "lm_head.weight. Set tie_word_embeddings to false in config.json to use it, or drop it from the checkpoint"
        )


def check_quantized_tensor(name: str, tensor: Tensor, path: Path, stored_as: str | None = None) -> None:
    """One tensor of an int8 checkpoint: projection codes int8 in -127..127, their scales float32,
    finite and > 0, everything else float. Serving (``load_weights``) and merge (which dequantizes
    ``q * s`` itself) both call it, so neither takes a tensor the other refuses.

    ``name``: the ``*ForCausalLM`` name, which says what the tensor is; ``stored_as``: its name in
    the file (``causal_lm_names``; a base-model save's lacks the ``model.`` prefix), for the messages."""
    shown = stored_as or name
    if is_quantized_projection(name):
        want = torch.int8
    elif name.endswith("_scale") and is_quantized_projection(name[: -len("_scale")]):
        want = torch.float32
    else:
        if not tensor.is_floating_point():
            raise CheckpointError(f"{path}: tensor {shown} is {tensor.dtype}; only the projections of an int8 checkpoint are integer")
        return
    if tensor.dtype != want:
        raise CheckpointError(f"{path}: tensor {shown} is {tensor.dtype}; the int8 weight-only format stores it as {want}")
    # Contents too: a hand-edited or corrupted file would otherwise give NaN or zeroed rows silently.
    if want == torch.int8 and bool((tensor == -128).any()):
        raise CheckpointError(f"{path}: tensor {shown} holds code -128; the int8 weight-only format uses -127..127")
    if want == torch.float32 and not bool((torch.isfinite(tensor) & (tensor > 0)).all()):
        raise CheckpointError(f"{path}: tensor {shown} holds a scale that is not a finite positive number")


def _prefix_hint(files: dict[str, Path], missing: list[str]) -> str:
    """For a missing-tensor error: where the checkpoint is a base-model save without the LM head its
    untied config needs, or names the embedding under another prefix than transformers' ``*ForCausalLM``
    (``model.embed_tokens.weight``; a base-model save's ``embed_tokens.weight`` is read as that), say so;
    '' otherwise."""
    if "embed_tokens.weight" in files and "lm_head.weight" in missing:
        return (" (its tensors carry no 'model.' prefix: a base-model save (AutoModel, LlamaModel.save_pretrained), which has no "
                "LM head; config.json has tie_word_embeddings=false, so transformers would initialise lm_head.weight at random. "
                "Save the model with its LM head, from AutoModelForCausalLM)")
    found = next((n for n in files if n.endswith("embed_tokens.weight") and n not in ("model.embed_tokens.weight", "embed_tokens.weight")), None)
    if found is None:
        return ""
    prefix = found[: -len("embed_tokens.weight")]
    return (f" (its tensors are named {prefix!r}..., where a causal LM checkpoint names them 'model.'...; save it with "
            "AutoModelForCausalLM's save_pretrained, after PEFT's merge_and_unload() where it wraps an adapter)")


def _tolerated(name: str, cfg: ModelConfig) -> bool:
    return name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and cfg.tie_word_embeddings)


def _by_file(files: dict[str, Path], names: Iterable[str]) -> dict[Path, list[str]]:
    grouped: dict[Path, list[str]] = {}
    for name in names:
        grouped.setdefault(files[name], []).append(name)
    return grouped
