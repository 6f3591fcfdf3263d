"""Read and validate a PEFT LoRA adapter folder against the base model, before allocating anything.

Folder: ``adapter_config.json`` + ``adapter_model.safetensors``. ``adapter_model.bin``
(pickle) is refused and never opened. Tensor keys look like
``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight``; shapes are
A ``[r, in]`` and B ``[out, r]``. An adapter trained on the bare decoder (``LlamaModel``,
``AutoModel``: no LM head) has no inner ``model.``: ``base_model.model.layers.3...``; it applies to
the ``*ForCausalLM``'s decoder unchanged and is read like the others, its module paths being the
ones PEFT matched when it was trained (``layers.3.self_attn.q_proj``), as a base-model checkpoint
loads (``loader.causal_lm_name``).

Per targeted module (PEFT semantics; ``path`` = ``model.layers.{i}.{self_attn|mlp}.{name}``, without
``model.`` for an adapter trained on the bare decoder):

    r     = rank_pattern[k]  for the first key k with re.match(rf"(.*\\.)?({k})$", path), else r
    alpha = alpha_pattern[k] likewise, else lora_alpha
    scale = alpha / sqrt(r) if use_rslora else alpha / r
    delta(x) = scale * (x @ A^T) @ B^T

``target_modules``: a list matches a module when ``path == t`` or ``path`` ends with
``"." + t``; a string is a regex that must ``fullmatch`` the path (``"all-linear"``: every
linear layer but the LM head). As in PEFT, list entries that match nothing are logged and
skipped, and only a list that matches nothing at all is refused. ``layers_to_transform``
(int or list) restricts the layers of the modules a list entry matches by suffix (an entry
equal to the whole path bypasses it, as in PEFT); the layer index is the number after the
first ``layers_pattern`` match (a regex fragment, PEFT's ``{pattern}.<index>.``), or after
the first dotted name when there is no pattern. ``exclude_modules`` (list or regex) removes modules.

Refused, because PEFT's forward differs from the formula above: DoRA and the other LoRA
variants (``_REFUSED_IF_TRUTHY``), and an ``init_lora_weights`` of PiSSA, OLoRA, CorDA or
LoftQ, with which PEFT rewrites the base weights on load (``W - scale * B0 A0``) before
adding the adapter. Tensor keys with PEFT's ``.default`` adapter-name infix
(``lora_A.default.weight``) are read like the plain ones, as PEFT reads them.

Files are read from their resolved paths (``resolved_files``: resolved once), opened with no symlink
followed on the way (``symlink_free_open``), so what is read is what a check of those paths
(``approve_files``) approved, even if a symlink is swapped in after it; the bytes parsed are the bytes
hashed into ``version``.

Validation order: files (and their sizes, before reading them) -> JSON -> config fields -> safetensors header
(dtypes, shapes, byte ranges; the decoder's naming) -> targets -> tensor names, shapes and ranks -> tensor values (NaN/Inf). Every failure
is an ``AdapterError`` naming the file and the key or tensor.

``version``: the first 12 hex digits of sha256 over the canonical (sorted-key) config
JSON, then, per tensor in name order, its name, dtype and raw bytes.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Callable, Mapping, Sequence

import torch
from torch import Tensor

from runtime.hub_hint import hub_download_hint
from runtime.lora.symlink_free_open import NotRegularFileError, SymlinkInPathError, open_symlink_free
from runtime.models.loader import BASE_MODEL_PREFIX, causal_lm_name

logger = logging.getLogger(__name__)

PEFT_DEFAULT_R = 8  # peft.LoraConfig.r's default, for a config without the key
PEFT_DEFAULT_LORA_ALPHA = 8  # peft.LoraConfig.lora_alpha's default: an adapter_config.json without the key means 8, not r
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILES = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")
KEY_PREFIX = "base_model.model."
MODULE_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
                 "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}  # fmt: skip
# Modules of a Llama-family model that exist but cannot carry LoRA here (the last part of their path).
UNSUPPORTED_MODULES = ("lm_head", "embed_tokens")
SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
# Size limits checked before a file is read, so a huge file cannot take the process's memory:
MAX_CONFIG_BYTES = 16 * 2**20  # adapter_config.json (a real one is a few KiB, rank_pattern included)
MAX_HEADER_BYTES = 100_000_000  # a safetensors header: the safetensors library's own limit
_TENSOR_KEY = re.compile(r"^base_model\.model\.(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
# Config fields that change the math; a non-default value we cannot honour is refused.
_REFUSED_IF_TRUTHY = ("use_dora", "lora_bias", "layer_replication", "target_parameters", "trainable_token_indices",
                      "alora_invocation_tokens", "use_qalora", "use_bdlora", "arrow_config", "kasa_config",
                      "monteclora_config")  # fmt: skip
# The ``.default`` adapter-name infix PEFT reads in a saved key (``...lora_A.default.weight``).
_DEFAULT_INFIX = re.compile(r"\.lora_([AB])\.default\.weight$")


class AdapterError(ValueError):
    """The adapter cannot be served; the message names the file and the key or tensor."""


class AdapterPathError(AdapterError):
    """The adapter's files are not where they were approved to be read from (outside the allowed
    folders, or a symlink swapped into their path after the check): refused, nothing of them read."""


@dataclass(frozen=True)
class LoRAModule:
    """One targeted linear: ``delta(x) = scale * (x @ lora_a^T) @ lora_b^T``."""

    rank: int
    scale: float
    lora_a: Tensor  # [r, in] float32
    lora_b: Tensor  # [out, r] float32


@dataclass(frozen=True)
class LoRAAdapter:
    name: str
    version: str
    path: str
    modules: Mapping[tuple[int, str], LoRAModule]  # (layer index, module name) -> weights
    max_rank: int
    r: int
    lora_alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...] | str
    rank_pattern: Mapping[str, int] = field(default_factory=dict)
    alpha_pattern: Mapping[str, float] = field(default_factory=dict)
    base_model_name_or_path: str | None = None
    files: tuple[str, ...] = ()  # its folder, config and weights, symlinks resolved, as read (``resolved_files``)

    @property
    def nbytes(self) -> int:
        """Bytes of its A and B matrices (what it holds in the host tier; ``max_cpu_lora_bytes``)."""
        return sum(t.numel() * t.element_size() for m in self.modules.values() for t in (m.lora_a, m.lora_b))


def resolved_files(folder: str | Path) -> tuple[str, ...]:
    """``folder`` and the files ``load_adapter`` reads in it, symlinks resolved (nothing is
    opened): a re-read from disk checks where they resolve now before reading them."""
    return tuple(str(p.resolve()) for p in (Path(folder), Path(folder) / CONFIG_FILE, Path(folder) / WEIGHTS_FILE))


def files_within(roots: Sequence[str | Path]) -> Callable[[Path, tuple[str, ...]], None]:
    """An ``approve_files`` for ``load_adapter``: the folder and every file it reads, resolved
    (``resolved_files``), must be one of ``roots`` (resolved) or lie under one, else
    ``AdapterPathError``, whose message quotes no resolved path. A pure comparison of path strings:
    the files are then opened along exactly these paths, with no symlink followed."""
    resolved = [Path(r).resolve() for r in roots]

    def approve(folder: Path, files: tuple[str, ...]) -> None:
        for what, f in zip(("the folder", CONFIG_FILE, WEIGHTS_FILE), files):
            p = Path(f)
            if not any(p == r or r in p.parents for r in resolved):
                raise AdapterPathError(f"{folder}: {what} resolves outside every --adapter-root as the loader opens it (a "
                                       "symlink changed since the path was checked?); refused, nothing of it was read")
    return approve


def check_adapter_path_type(path: object) -> None:
    """TypeError unless ``path`` can name an adapter folder: a ``str`` or an ``os.PathLike``
    (turned into a string, None would be looked up as a folder named "None")."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"adapter folder: expected a str or os.PathLike, got {type(path).__name__}")


def check_adapter_folder(root: Path) -> tuple[Path, Path]:
    """The checks on ``root``'s shape that need no file read: a folder holding ``CONFIG_FILE`` and
    ``WEIGHTS_FILE`` as regular files (pickled weights alone are refused). Returns their paths."""
    if root.is_file():
        raise AdapterError(f"{root}: is a file; give the adapter folder that holds {CONFIG_FILE} ({root.parent})")
    if not root.is_dir():
        raise AdapterError(f"{root}: adapter folder does not exist{hub_download_hint(root)}")
    config_path, weights_path = root / CONFIG_FILE, root / WEIGHTS_FILE
    for needed in (config_path, weights_path):
        if needed.exists() and not needed.is_file():  # a folder, a FIFO (reading one would block), a device
            raise AdapterError(f"{needed}: not a regular file (a PEFT adapter folder needs {needed.name} as a file)")
    if not config_path.is_file():
        raise AdapterError(f"{config_path}: missing (a PEFT adapter folder needs {CONFIG_FILE})")
    if not weights_path.is_file():
        pickled = [p for p in PICKLE_FILES if (root / p).is_file()]
        if pickled:
            raise AdapterError(
                f"{root / pickled[0]}: pickled adapter weights are refused and never unpickled; "
                f"save the adapter with safe_serialization=True to get {WEIGHTS_FILE}"
            )
        raise AdapterError(f"{weights_path}: missing (a PEFT adapter folder needs {WEIGHTS_FILE})")
    return config_path, weights_path


def load_adapter(
    path: str | Path,
    name: str,
    targets: Mapping[str, tuple[int, int]],
    *,
    num_layers: int,
    max_lora_rank: int,
    approve_files: Callable[[Path, tuple[str, ...]], None] | None = None,
) -> LoRAAdapter:
    """Validate and read the PEFT adapter at ``path`` (see module docstring).

    ``targets``: module name -> (in, out), from ``ModelRunner.lora_targets()``;
    ``num_layers`` and ``max_lora_rank`` are keyword-only so they cannot be swapped.
    ``approve_files(path, files)``: called with the folder and its files resolved once
    (``resolved_files``) before any of them is opened; it raises to refuse them (``files_within``).
    The files are then read along exactly those paths, no symlink followed: a symlink swapped into
    them after the check is an ``AdapterPathError``, nothing of them read. The recorded ``files``
    are those paths.
    """
    root = Path(path)
    config_path, weights_path = check_adapter_folder(root)
    files = resolved_files(root)
    if approve_files is not None:
        approve_files(root, files)
    raw = _read_config(config_path, files[1])
    cfg = _parse_config(raw, config_path)
    header, data_start, blob = _read_safetensors(weights_path, files[2], max_weights_bytes(targets, num_layers, max_lora_rank), max_lora_rank,
                                                 _declared_rank_note(cfg, config_path, max_lora_rank))
    header = _without_default_infix(header, weights_path)
    decoder_root = _decoder_root(header, weights_path)
    modules = _resolve_modules(cfg, config_path, targets, num_layers, decoder_root)
    plan = _check_tensors(header, weights_path, modules, targets, cfg, max_lora_rank, num_layers, decoder_root)
    tensors = _decode_tensors(header, data_start, blob, weights_path)
    built: dict[tuple[int, str], LoRAModule] = {}
    for key, (rank, scale, a_name, b_name) in plan.items():
        built[key] = LoRAModule(rank, scale, tensors[a_name], tensors[b_name])
    return LoRAAdapter(
        name=name,
        version=_version(raw, header, data_start, blob),
        path=str(root),
        modules=built,
        max_rank=max(m.rank for m in built.values()),
        r=cfg.r,
        lora_alpha=cfg.lora_alpha,
        use_rslora=cfg.use_rslora,
        target_modules=cfg.target_modules,
        rank_pattern=dict(cfg.rank_pattern),
        alpha_pattern=dict(cfg.alpha_pattern),
        base_model_name_or_path=raw.get("base_model_name_or_path"),
        files=files,
    )


# ---- config ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Config:
    r: int
    lora_alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...] | str
    rank_pattern: Mapping[str, int]
    alpha_pattern: Mapping[str, float]
    layers_to_transform: tuple[int, ...] | None
    exclude_modules: tuple[str, ...] | str | None
    layers_pattern: tuple[str, ...] = ()


def _open_checked(path: Path, resolved: str) -> BinaryIO:
    """``path`` opened along ``resolved`` (its path resolved when it was checked), no symlink
    followed (``open_symlink_free``); errors name ``path``, as the loader's others do."""
    try:
        return open_symlink_free(resolved)
    except SymlinkInPathError:
        raise AdapterPathError(f"{path}: a symlink was put into its path after the path was checked; refused, nothing of it was read") from None
    except NotRegularFileError:
        raise AdapterError(f"{path}: not a regular file (a PEFT adapter folder needs {path.name} as a file)") from None
    except OSError as err:  # missing (removed since the checks), unreadable: named as the caller gave it
        raise OSError(err.errno, err.strerror, str(path)) from None


def _read_bounded(path: Path, resolved: str, limit: int, what: str) -> bytes:
    """The bytes of ``path`` (read along ``resolved``: ``_open_checked``), refused (an AdapterError)
    without reading them when it holds more than ``limit``; a file that grows meanwhile is read only
    up to ``limit + 1`` bytes and refused too."""
    with _open_checked(path, resolved) as f:
        size = os.fstat(f.fileno()).st_size
        data = f.read(limit + 1) if size <= limit else b""
    if size > limit or len(data) > limit:
        raise AdapterError(f"{path}: {max(size, len(data))} bytes, larger than {what} ({limit} bytes)")
    return data


def _read_config(path: Path, resolved: str) -> dict[str, Any]:
    try:
        raw = json.loads(_read_bounded(path, resolved, MAX_CONFIG_BYTES, "an adapter config can be").decode())
    except json.JSONDecodeError as err:
        raise AdapterError(f"{path}: invalid JSON: {err}") from err
    except UnicodeDecodeError as err:
        raise AdapterError(f"{path}: not UTF-8 text: {err}") from err
    if not isinstance(raw, dict):
        raise AdapterError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return raw


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def rewrites_base(init_lora_weights: Any) -> bool:
    """True for the ``init_lora_weights`` values with which PEFT's loader rewrites each targeted
    base weight to a residual (``peft.tuners.lora.layer.LoraLayer.update_layer``): "pissa",
    "pissa_niter_<n>", "corda...", "olora" (any case) and "loftq"."""
    if not isinstance(init_lora_weights, str):
        return False
    value = init_lora_weights.lower()
    return value.startswith(("pissa", "corda")) or value in ("olora", "loftq")


def _parse_config(raw: dict[str, Any], path: Path) -> _Config:
    peft_type = raw.get("peft_type")
    if peft_type != "LORA":
        raise AdapterError(f"{path}: peft_type is {peft_type!r}; only 'LORA' adapters are supported")
    init = raw.get("init_lora_weights")
    if rewrites_base(init):
        raise AdapterError(
            f"{path}: init_lora_weights={init!r} is not supported: with it PEFT rewrites each targeted base weight to "
            "W - scale * B0 A0 (B0 A0 from the base's own SVD or QR, or its quantization error) when it loads the adapter, "
            "so the adapter is only right over that rewritten base. Convert it to a plain LoRA first: PEFT's "
            "save_pretrained(..., path_initial_model_for_weight_conversion=<the adapter as first initialised>) "
            "writes one that applies to the original base (its rank doubles)")
    for key in _REFUSED_IF_TRUTHY:
        if key == "use_dora" and raw.get(key):
            from runtime.capabilities import unsupported_quote  # the matrix is read only to word this refusal

            raise AdapterError(f"{path}: use_dora={raw[key]!r} is not supported: DoRA changes the math lorafleet serves: "
                               f"{unsupported_quote('dora')}")
        if raw.get(key):
            raise AdapterError(f"{path}: {key}={raw[key]!r} is not supported: {key} changes the math lorafleet serves")
    if raw.get("fan_in_fan_out"):  # PEFT's LoRA Linear resets it to False with a warning (it is for GPT-2's Conv1D)
        logger.warning("%s: fan_in_fan_out=%r is for Conv1D layers; every target here is a Linear layer, so it is read as "
                       "false, as PEFT does", path, raw["fan_in_fan_out"])
    if raw.get("modules_to_save"):
        raise AdapterError(f"{path}: modules_to_save={raw['modules_to_save']!r} is not supported: full module copies cannot be served per request")
    bias = raw.get("bias", "none")
    if bias != "none":
        raise AdapterError(f"{path}: bias={bias!r} is not supported; only 'none'")
    r = raw.get("r", PEFT_DEFAULT_R)
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise AdapterError(f"{path}: r must be a positive integer, got {r!r}")
    alpha = raw.get("lora_alpha", PEFT_DEFAULT_LORA_ALPHA)  # what PEFT's LoraConfig uses when the key is absent
    if not _is_number(alpha):
        raise AdapterError(f"{path}: lora_alpha must be a finite number, got {alpha!r}")
    use_rslora = raw.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise AdapterError(f"{path}: use_rslora must be true or false, got {use_rslora!r}")
    rank_pattern = raw.get("rank_pattern") or {}
    alpha_pattern = raw.get("alpha_pattern") or {}
    for key, pattern, ok in (("rank_pattern", rank_pattern, lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0),
                             ("alpha_pattern", alpha_pattern, _is_number)):  # fmt: skip
        if not isinstance(pattern, dict):
            raise AdapterError(f"{path}: {key} must be an object, got {pattern!r}")
        for k, v in pattern.items():
            if not ok(v):
                raise AdapterError(f"{path}: {key}[{k!r}]={v!r} is not a valid value")
            _compile(k, path, key)
    targets = raw.get("target_modules")
    if targets == "all-linear":  # PEFT's shorthand: every linear layer except the output layer
        targets = list(MODULE_PARENT)
    if isinstance(targets, str):
        _compile(targets, path, "target_modules")
        target_modules: tuple[str, ...] | str = targets
    elif isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets):
        target_modules = tuple(sorted(set(targets)))
    else:
        raise AdapterError(f"{path}: target_modules must be a non-empty list of names or a regex string, got {targets!r}")
    layers = raw.get("layers_to_transform")
    layers_t: tuple[int, ...] | None = None
    if layers is not None and layers != []:
        if isinstance(target_modules, str):
            raise AdapterError(f"{path}: layers_to_transform cannot be combined with a regex target_modules (PEFT refuses it too)")
        items = [layers] if isinstance(layers, int) else layers
        if not isinstance(items, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in items):
            raise AdapterError(f"{path}: layers_to_transform must be an int or a list of ints, got {layers!r}")
        pattern = raw.get("layers_pattern")
        if pattern is None or pattern == "" or pattern == []:
            layers_pattern: tuple[str, ...] = ()
        elif isinstance(pattern, str):
            layers_pattern = (pattern,)
        elif isinstance(pattern, list) and all(isinstance(x, str) for x in pattern):
            layers_pattern = tuple(pattern)
        else:
            raise AdapterError(f"{path}: layers_pattern must be a string or a list of strings, got {pattern!r}")
        for x in layers_pattern:
            _compile(x, path, "layers_pattern")
        layers_t = tuple(items)
    exclude = raw.get("exclude_modules")
    exclude_t: tuple[str, ...] | str | None = None
    if isinstance(exclude, str):
        _compile(exclude, path, "exclude_modules")
        exclude_t = exclude
    elif isinstance(exclude, list) and all(isinstance(e, str) for e in exclude):
        exclude_t = tuple(exclude) or None
    elif exclude is not None:
        raise AdapterError(f"{path}: exclude_modules must be a list or a regex string, got {exclude!r}")
    # rank_pattern's values are checked against max_lora_rank per module (_check_tensors): a key that
    # matches no targeted module is ignored, as PEFT ignores it, whatever its value.
    return _Config(r, float(alpha), use_rslora, target_modules, dict(rank_pattern), {k: float(v) for k, v in alpha_pattern.items()}, layers_t,
                   exclude_t, layers_pattern if layers_t is not None else ())


def _compile(pattern: str, path: Path, key: str) -> re.Pattern[str]:
    try:
        return re.compile(pattern)
    except re.error as err:
        raise AdapterError(f"{path}: {key} {pattern!r} is not a valid regex: {err}") from err


def _pattern_key(keys: Any, module_path: str) -> str | None:
    """PEFT's ``get_pattern_key``: the first key that matches the end of ``module_path`` at a dot boundary."""
    for key in keys:
        if re.match(rf"(.*\.)?({key})$", module_path):
            return key
    return None


# ---- targets -----------------------------------------------------------------------------


def _decoder_root(header: Mapping[str, Any], path: Path) -> str:
    """The prefix of the decoder's module paths in the model the adapter was trained on: ``"model."``
    for a ``*ForCausalLM`` (keys ``base_model.model.model.layers...``), ``""`` for the bare decoder
    (``LlamaModel``, ``AutoModel``: ``base_model.model.layers...``), whose names a base-model
    checkpoint has too (``loader.causal_lm_name`` tells them apart). Keys of both kinds are refused."""
    bare = sorted(k for k in header if k.startswith(KEY_PREFIX) and causal_lm_name(k[len(KEY_PREFIX):]) != k[len(KEY_PREFIX):])
    if not bare:
        return BASE_MODEL_PREFIX
    prefixed = sorted(k for k in header if k.startswith(KEY_PREFIX + BASE_MODEL_PREFIX))
    if prefixed:
        raise AdapterError(f"{path}: tensor {bare[0]} is named as on a bare decoder (LlamaModel, no 'model.' after 'base_model.model.'), "
                           f"tensor {prefixed[0]} as on a *ForCausalLM; an adapter is trained on one model, so its keys take one form")
    return ""


def _module_path(layer: int, name: str, root: str) -> str:
    """A LoRA target's module path in the model trained on (``root``: ``_decoder_root``)."""
    return f"{root}layers.{layer}.{MODULE_PARENT[name]}.{name}"


def _all_module_paths(num_layers: int, root: str) -> list[str]:
    """Every named module of a Llama-family CausalLM (``root`` "model."), or of its bare decoder
    (``root`` "": no LM head), as PEFT walks them."""
    paths = [f"{root}embed_tokens", f"{root}layers", f"{root}norm", f"{root}rotary_emb"]
    if root:
        paths = [root.rstrip(".")] + paths + ["lm_head"]
    for i in range(num_layers):
        p = f"{root}layers.{i}"
        paths += [p, f"{p}.self_attn", f"{p}.mlp", f"{p}.input_layernorm", f"{p}.post_attention_layernorm", f"{p}.mlp.act_fn"]
        paths += [_module_path(i, n, root) for n in MODULE_PARENT]
    return paths


def _excluded(cfg: _Config, module_path: str) -> bool:
    if cfg.exclude_modules is None:
        return False
    if isinstance(cfg.exclude_modules, str):
        return re.fullmatch(cfg.exclude_modules, module_path) is not None
    return any(module_path == e or module_path.endswith("." + e) for e in cfg.exclude_modules)


def _layer_index(cfg: _Config, module_path: str) -> int | None:
    """PEFT's layer index of a module: the number after the first ``layers_pattern`` match, or,
    without a pattern, after the first dotted name (``model.layers.3.mlp.up_proj`` -> 3)."""
    if not cfg.layers_pattern:
        match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", module_path)
    else:
        match = None
        for pattern in cfg.layers_pattern:
            match = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", module_path)
            if match is not None:
                break
    return int(match.group("idx")) if match is not None else None


def _selected(cfg: _Config, module_path: str) -> bool:
    """Whether PEFT puts LoRA on ``module_path`` (``peft.tuners.tuners_utils.check_target_module_exists``)."""
    if _excluded(cfg, module_path):
        return False
    if isinstance(cfg.target_modules, str):
        return re.fullmatch(cfg.target_modules, module_path) is not None
    if module_path in cfg.target_modules:
        return True  # named in full: layers_to_transform does not apply
    if not any(module_path.endswith("." + t) for t in cfg.target_modules):
        return False
    if cfg.layers_to_transform is None:
        return True
    return _layer_index(cfg, module_path) in cfg.layers_to_transform


def _resolve_modules(cfg: _Config, path: Path, targets: Mapping[str, tuple[int, int]], num_layers: int, root: str) -> list[tuple[int, str]]:
    """(layer, module) pairs the adapter targets, or an error naming the offending target; module
    paths as in the model it was trained on (``root``: ``_decoder_root``)."""
    if cfg.layers_to_transform is not None:
        bad = [i for i in cfg.layers_to_transform if not 0 <= i < num_layers]
        if bad:
            raise AdapterError(f"{path}: layers_to_transform {bad} are outside the model's {num_layers} layers")
    known = _all_module_paths(num_layers, root)
    if isinstance(cfg.target_modules, tuple):
        unmatched = []
        for t in cfg.target_modules:
            hits = [p for p in known if p == t or p.endswith("." + t)]
            if not hits:
                unmatched.append(t)
            _refuse_unsupported([p for p in hits if _selected(cfg, p)], path, f"target_modules entry {t!r}", targets)
        if len(unmatched) == len(cfg.target_modules):
            raise AdapterError(f"{path}: target_modules: no entry is a module of this model ({', '.join(map(repr, unmatched))}); "
                               f"LoRA targets are {', '.join(targets)}")
        if unmatched:  # PEFT skips them too, and refuses only a list of which nothing matches
            logger.warning("%s: target_modules entries %s match no module of this model; the adapter is read without them, as PEFT does",
                           path, ", ".join(map(repr, unmatched)))
    else:
        hits = [p for p in known if re.fullmatch(cfg.target_modules, p)]
        if not hits:
            raise AdapterError(f"{path}: target_modules regex {cfg.target_modules!r} matches no module of this model")
        _refuse_unsupported([p for p in hits if _selected(cfg, p)], path, f"target_modules regex {cfg.target_modules!r}", targets)
    chosen = []
    for layer in range(num_layers):
        for name in MODULE_PARENT:
            mp = _module_path(layer, name, root)
            if _selected(cfg, mp):
                if name not in targets:
                    raise AdapterError(f"{path}: target module {mp} is not a LoRA target of this model ({', '.join(targets)})")
                chosen.append((layer, name))
    if not chosen:
        raise AdapterError(f"{path}: target_modules / layers_to_transform / layers_pattern / exclude_modules select no module of this model")
    return chosen


def _refuse_unsupported(hits: list[str], path: Path, what: str, targets: Mapping[str, tuple[int, int]]) -> None:
    for hit in sorted(hits):
        leaf = hit.rsplit(".", 1)[-1]
        if leaf in UNSUPPORTED_MODULES:
            raise AdapterError(f"{path}: {what} selects {hit}, which lorafleet cannot serve LoRA on (supported: {', '.join(targets)})")
        if leaf not in MODULE_PARENT:
            raise AdapterError(f"{path}: {what} selects {hit}, which is not a linear layer LoRA can target (supported: {', '.join(targets)})")


# ---- safetensors -------------------------------------------------------------------------


def max_weights_bytes(targets: Mapping[str, tuple[int, int]], num_layers: int, max_lora_rank: int) -> int:
    """The most tensor data an adapter of this model can hold: A ``[r, in]`` and B ``[out, r]`` for
    every LoRA target in every layer, at ``max_lora_rank``, in the widest dtype read (float64)."""
    widest = max(dtype.itemsize for dtype in SAFETENSORS_DTYPES.values())
    return widest * max_lora_rank * num_layers * sum(d_in + d_out for d_in, d_out in targets.values())


def _declared_rank_note(cfg: _Config, config_path: Path, max_lora_rank: int) -> str:
    """The largest rank ``adapter_config.json`` declares (``r`` or a ``rank_pattern`` value), worded as
    ``_check_tensors`` words a module's rank above ``max_lora_rank``, or "" when none is above it.

    The size bound (``max_weights_bytes``) refuses a file with more tensor data than every target at
    ``max_lora_rank`` could hold before any module's rank is read; its usual cause is such a rank,
    and this note names it and the flag that takes it instead of bytes alone."""
    declared = [("r", cfg.r)] + [(f"rank_pattern[{k!r}]", v) for k, v in cfg.rank_pattern.items()]
    source, rank = max(declared, key=lambda item: item[1])
    if rank <= max_lora_rank:
        return ""
    return (f"{config_path.name} {source} is {rank}, above max_lora_rank={max_lora_rank}, the largest rank the engine was started for "
            f"(lorafleet serve --max-lora-rank {rank}, or LLM(..., max_lora_rank={rank}), takes it)")


def _read_safetensors(path: Path, resolved: str, max_data_bytes: int, max_lora_rank: int, rank_note: str = "") -> tuple[dict[str, Any], int, bytes]:
    """Parse and check the header (size, JSON, byte ranges); returns (tensor entries, data offset, file bytes).
    The file is read once, along ``resolved`` (``_open_checked``); everything after parses those bytes.

    Sizes are checked before the bytes are read: a header over ``MAX_HEADER_BYTES``, or more
    tensor data than ``max_data_bytes`` (``max_weights_bytes``), is refused unread; that refusal
    leads with ``rank_note`` (``_declared_rank_note``) when the config declares a rank above the limit."""
    with _open_checked(path, resolved) as f:
        size = os.fstat(f.fileno()).st_size
        blob = f.read(8)
        if len(blob) < 8:
            raise AdapterError(f"{path}: truncated safetensors file ({len(blob)} bytes, no header)")
        (header_len,) = struct.unpack("<Q", blob)
        if header_len > MAX_HEADER_BYTES:
            raise AdapterError(f"{path}: safetensors header of {header_len} bytes, larger than the {MAX_HEADER_BYTES} bytes safetensors allows")
        if size - 8 - header_len > max_data_bytes:
            lead = f"{rank_note}; its " if rank_note else ""
            raise AdapterError(f"{path}: {lead}{size - 8 - header_len} bytes of tensor data, more than an adapter of this model can hold "
                               f"({max_data_bytes} bytes: every LoRA target in every layer at max_lora_rank={max_lora_rank}, in float64)")
        blob += f.read(header_len + max_data_bytes)  # a file grown since fstat is cut short at the limit
    if 8 + header_len > len(blob):
        raise AdapterError(f"{path}: truncated safetensors file: header claims {header_len} bytes, file has {len(blob) - 8}")
    try:
        header = json.loads(blob[8 : 8 + header_len])
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise AdapterError(f"{path}: corrupt safetensors header: {err}") from err
    if not isinstance(header, dict):
        raise AdapterError(f"{path}: corrupt safetensors header: not a JSON object")
    header.pop("__metadata__", None)
    data_start = 8 + header_len
    data_len = len(blob) - data_start
    for name, entry in header.items():
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
            raise AdapterError(f"{path}: tensor {name}: corrupt header entry {entry!r}")
        # Type-check the entry before using it, so a hostile header is an AdapterError, never a
        # TypeError/ValueError/RuntimeError from the arithmetic below (found by the adapter fuzz).
        if not isinstance(entry["dtype"], str) or entry["dtype"] not in SAFETENSORS_DTYPES:
            raise AdapterError(f"{path}: tensor {name}: dtype {entry['dtype']!r} is not supported ({', '.join(SAFETENSORS_DTYPES)})")
        if not isinstance(entry["shape"], list) or not all(_is_count(d) for d in entry["shape"]):
            raise AdapterError(f"{path}: tensor {name}: shape {entry['shape']!r} is not a list of non-negative integers")
        offsets = entry["data_offsets"]
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets) or offsets[0] > offsets[1]:
            raise AdapterError(f"{path}: tensor {name}: data_offsets {offsets!r} is not a [start, end] pair with 0 <= start <= end")
        start, end = offsets
        itemsize = torch.tensor([], dtype=SAFETENSORS_DTYPES[entry["dtype"]]).element_size()
        if end > data_len:
            raise AdapterError(f"{path}: truncated safetensors file: tensor {name} needs bytes up to {end}, the file has {data_len}")
        if end - start != math.prod(entry["shape"]) * itemsize:
            raise AdapterError(f"{path}: tensor {name}: {end - start} bytes do not fit shape {entry['shape']} of {entry['dtype']}")
    return header, data_start, blob


def _without_default_infix(header: dict[str, Any], path: Path) -> dict[str, Any]:
    """The header with ``lora_A.default.weight`` keys renamed ``lora_A.weight`` (PEFT reads both)."""
    renamed: dict[str, Any] = {}
    for name, entry in header.items():
        plain = _DEFAULT_INFIX.sub(r".lora_\1.weight", name)
        if plain in renamed:
            raise AdapterError(f"{path}: tensor {plain} is stored twice, with and without the '.default' adapter-name infix")
        renamed[plain] = entry
    return renamed


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _check_tensors(
    header: Mapping[str, Any],
    path: Path,
    modules: list[tuple[int, str]],
    targets: Mapping[str, tuple[int, int]],
    cfg: _Config,
    max_lora_rank: int,
    num_layers: int,
    root: str,
) -> dict[tuple[int, str], tuple[int, float, str, str]]:
    """Names and shapes against the base; returns (layer, module) -> (rank, scale, A name, B name).
    ``root``: the decoder's prefix in the model trained on (``_decoder_root``)."""
    expected: dict[str, tuple[int, str, str]] = {}
    for layer, name in modules:
        for ab in "AB":
            expected[f"{KEY_PREFIX}{_module_path(layer, name, root)}.lora_{ab}.weight"] = (layer, name, ab)
    extra = sorted(set(header) - set(expected))
    beyond = [(e, int(m.group(1))) for e in extra if (m := _TENSOR_KEY.match(e)) and int(m.group(1)) >= num_layers]
    if beyond:  # same widths, more layers: an adapter for another model, which target_modules has nothing to do with
        tensor, layer = min(beyond, key=lambda b: b[1])
        raise AdapterError(f"{path}: tensor {tensor} is for layer {layer}, but the base has {num_layers} layers: "
                           "the adapter was trained on another model")
    if extra:
        hint = " (not selected by target_modules)" if any(_TENSOR_KEY.match(e) for e in extra) else ""
        raise AdapterError(f"{path}: unexpected tensor {extra[0]}{hint}" + (f" and {len(extra) - 1} more" if len(extra) > 1 else ""))
    missing = [n for n in expected if n not in header]
    if missing:
        raise AdapterError(f"{path}: missing tensor {missing[0]}" + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
                           + _shallower_note(header, [expected[n][0] for n in missing], num_layers))
    plan = {}
    for layer, name in modules:
        mp = _module_path(layer, name, root)
        a_name, b_name = f"{KEY_PREFIX}{mp}.lora_A.weight", f"{KEY_PREFIX}{mp}.lora_B.weight"
        a_shape, b_shape = list(header[a_name]["shape"]), list(header[b_name]["shape"])
        rk = _pattern_key(cfg.rank_pattern, mp)
        ak = _pattern_key(cfg.alpha_pattern, mp)
        rank = cfg.rank_pattern[rk] if rk is not None else cfg.r
        alpha = cfg.alpha_pattern[ak] if ak is not None else cfg.lora_alpha
        d_in, d_out = targets[name]
        if len(a_shape) != 2 or a_shape[1] != d_in:
            raise AdapterError(f"{path}: tensor {a_name} has shape {a_shape}; the base {name} has in_features={d_in}, so A must be [r, {d_in}]")
        if len(b_shape) != 2 or b_shape[0] != d_out:
            raise AdapterError(f"{path}: tensor {b_name} has shape {b_shape}; the base {name} has out_features={d_out}, so B must be [{d_out}, r]")
        if a_shape[0] != b_shape[1]:
            raise AdapterError(f"{path}: tensors {a_name} and {b_name} disagree on the rank ({a_shape[0]} vs {b_shape[1]})")
        if a_shape[0] != rank:
            source = f"rank_pattern[{rk!r}]" if rk is not None else "r"
            raise AdapterError(f"{path}: tensor {a_name} has rank {a_shape[0]} but adapter_config.json {source} says {rank}")
        if rank > max_lora_rank:
            raise AdapterError(f"{path}: {mp} has rank {rank}, above max_lora_rank={max_lora_rank}, the largest rank the engine was "
                               f"started for (lorafleet serve --max-lora-rank {rank}, or LLM(..., max_lora_rank={rank}), takes it)")
        scale = alpha / math.sqrt(rank) if cfg.use_rslora else alpha / rank
        plan[(layer, name)] = (rank, scale, a_name, b_name)
    return plan


def _shallower_note(header: Mapping[str, Any], missing_layers: list[int], num_layers: int) -> str:
    """For missing tensors that are exactly those past the header's last layer (an adapter trained on
    a model with fewer layers), a note saying so; "" for any other gap, a damaged or partial file."""
    present = [int(m.group(1)) for name in header if (m := _TENSOR_KEY.match(name))]
    if not present or min(missing_layers) <= max(present):
        return ""
    top = max(present)
    held = "layer 0" if top == 0 else f"layers 0-{top}"
    return (f": it has tensors for {held} only and the base has {num_layers} layers: the adapter was trained on a model with fewer "
            "layers (or with a layers_to_transform that adapter_config.json does not give)")


def _decode_tensors(header: Mapping[str, Any], data_start: int, blob: bytes, path: Path) -> dict[str, Tensor]:
    """float32 host tensors; NaN/Inf is an error naming the tensor."""
    out: dict[str, Tensor] = {}
    for name, entry in header.items():
        start, end = entry["data_offsets"]
        raw = bytearray(blob[data_start + start : data_start + end])
        t = torch.frombuffer(raw, dtype=SAFETENSORS_DTYPES[entry["dtype"]]) if raw else torch.empty(0)
        t = t.reshape(entry["shape"]).float()
        if not torch.isfinite(t).all():
            raise AdapterError(f"{path}: tensor {name} contains NaN or Inf")
        out[name] = t
    return out


def _version(raw: Mapping[str, Any], header: Mapping[str, Any], data_start: int, blob: bytes) -> str:
    h = hashlib.sha256(json.dumps(raw, sort_keys=True, separators=(",", ":")).encode())
    for name in sorted(header):
        entry = header[name]
        start, end = entry["data_offsets"]
        h.update(name.encode() + b"\0" + entry["dtype"].encode() + b"\0")
        h.update(blob[data_start + start : data_start + end])
    return h.hexdigest()[:12]
