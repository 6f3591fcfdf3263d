"""`lorafleet serve` settings: one key set for flags and the --config YAML file.

Precedence: built-in defaults < the YAML file < command-line flags. Unknown keys and
bad values are errors that name the key. Keys may be written with dashes or underscores.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

import yaml

from runtime.byte_size import parse_byte_size
from runtime.config import ConfigError, EngineConfig, check_every_decode_fits, check_host_tier_counted
from runtime.server.options import ADAPTER_NAME_RULE, ServerOptions, is_adapter_name

ENGINE_KEYS = (
    "model", "device", "dtype", "max_loras", "max_lora_rank", "max_cpu_loras", "max_cpu_lora_bytes", "lora_pool_rows",
    "max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size", "num_kv_blocks",
    "kv_cache_mb", "enable_prefix_caching", "seed", "cpu_gemm",
)
SERVER_KEYS = ("host", "port", "served_model_name", "enable_adapter_admin", "api_key", "adapter_root", "max_request_bytes", "metrics_max_adapters")
OTHER_KEYS = ("lora_modules", "log_level", "ray", "num_replicas", "ray_address", "registry_dir")
ALL_KEYS = ENGINE_KEYS + SERVER_KEYS + OTHER_KEYS
NULLABLE_KEYS = ("served_model_name", "api_key", "ray_address", "registry_dir")  # null: not set, as their default
# Every key's type in a --config file: key -> (types, what to say, null allowed). Flags are typed by argparse.
_INT, _STR, _BOOL = ((int,), "an integer"), ((str,), "a string"), ((bool,), "true or false")
KEY_TYPES: dict[str, tuple[tuple[type, ...], str, bool]] = {
    **{k: (*_INT, False) for k in ("max_loras", "max_lora_rank", "max_num_seqs", "max_num_batched_tokens", "block_size", "seed", "port",
                                   "max_request_bytes", "metrics_max_adapters", "num_replicas")},
    **{k: (*_INT, True) for k in ("max_cpu_loras", "lora_pool_rows", "max_model_len", "num_kv_blocks", "kv_cache_mb")},
    **{k: (*_STR, False) for k in ("model", "device", "dtype", "host", "log_level", "cpu_gemm")},
    **{k: (*_STR, True) for k in NULLABLE_KEYS},
    **{k: (*_BOOL, False) for k in ("enable_prefix_caching", "enable_adapter_admin", "ray")},
    "adapter_root": ((str, list), "a folder or a list of folders", True),
    "max_cpu_lora_bytes": ((int, str), "a size such as 2G, 512M or a number of bytes", True),
    "lora_modules": ((list,), "a list of adapters", True),
}  # fmt: skip
# Keys whose values in effect no later check would catch with a wrong type (the others get range
# checks that name the key): checked by type on the merged settings too.
TYPED_KEYS = ("host", "served_model_name", "api_key", "enable_adapter_admin", "ray_address", "registry_dir")


@dataclass(frozen=True)
class LoRAModule:
    name: str
    path: str
    base_model_name: str | None = None


@dataclass(frozen=True)
class ServeSettings:
    engine: EngineConfig
    server: ServerOptions
    lora_modules: tuple[LoRAModule, ...]
    log_level: str
    uses_demo: bool
    ray: bool = False
    num_replicas: int = 1
    ray_address: str | None = None
    registry_dir: str | None = None


def normalize_keys(values: Mapping[str, Any], source: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    spelled: dict[str, Any] = {}
    for key, value in values.items():
        norm = str(key).replace("-", "_")
        if norm not in ALL_KEYS:
            raise ConfigError(f"{source}: unknown key {key!r}; known keys: {', '.join(ALL_KEYS)}")
        if norm in out:  # max_loras and max-loras: one would silently win
            raise ConfigError(f"{source}: {spelled[norm]!r} and {key!r} both set {norm}; keep one")
        out[norm], spelled[norm] = value, key
    return out


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (plain YAML keeps the last
    one and drops the other without a word)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        if not isinstance(node, yaml.MappingNode):  # e.g. ``!!map 8000``: the safe loader's own error names it
            return super().construct_mapping(node, deep=deep)
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                hash(key)
            except TypeError:
                continue  # the safe loader's own error says so, below
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} is given twice; keep one", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_yaml(path: str) -> dict[str, Any]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError(f"--config {path}: cannot read: {err.strerror}") from err
    except UnicodeDecodeError as err:
        raise ConfigError(f"--config {path}: not UTF-8 text (byte {err.start}: {err.reason})") from err
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"--config {path}: not valid YAML: {err}") from err
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of keys to values, got {type(data).__name__}")
    return normalize_keys(data, f"--config {path}")


# Keys whose value is a secret: an error names the type it got, never the value (errors go to stderr and logs).
SECRET_KEYS = ("api_key",)
_TYPE_WORDS = {bool: "true or false", int: "an integer", float: "a number", list: "a list", dict: "a mapping"}


def _wrong_type(key: str, value: Any) -> Optional[str]:
    """``expected X, got V`` when ``value`` is not of ``key``'s type (``KEY_TYPES``), else None.
    For ``SECRET_KEYS``, V is the value's type in words, not the value."""
    kinds, expected, nullable = KEY_TYPES[key]
    wrong_bool = isinstance(value, bool) and bool not in kinds  # YAML true is no integer here
    if (value is None and not nullable) or (value is not None and (wrong_bool or not isinstance(value, kinds))):
        got = _TYPE_WORDS.get(type(value), type(value).__name__) if key in SECRET_KEYS else repr(value)
        return f"expected {expected}, got {got}"
    return None


def check_types(merged: Mapping[str, Any]) -> None:
    """Refuse a value of the wrong type for ``TYPED_KEYS``, naming the key (``enable_adapter_admin:
    "false"`` is a string, and would be true; ``api_key: 12345678`` an int)."""
    for key in TYPED_KEYS:
        why = _wrong_type(key, merged[key]) if key in merged else None
        if why:
            raise ConfigError(f"{key}: {why}")


def check_overridden_file_types(file_values: Mapping[str, Any], flag_values: Mapping[str, Any]) -> None:
    """A --config value of the wrong type is an error even where a flag replaces it: the file is
    wrong, and would be used the day the flag is dropped (values in effect get their full checks
    later, in ``build_settings``)."""
    for key, value in file_values.items():
        why = _wrong_type(key, value) if flag_values.get(key) is not None and key in KEY_TYPES else None
        if why:
            raise ConfigError(f"{key}: {why} in the --config file (a flag overrides it, but the file's value must be right too)")


def adapter_roots(value: Any) -> list[str]:
    """``adapter_root``: one folder or a list of folders (every one a string)."""
    roots = [value] if isinstance(value, str) else (value or [])
    if not isinstance(roots, list) or not all(isinstance(r, str) for r in roots):
        raise ConfigError(f"adapter_root: expected a folder or a list of folders, got {value!r}")
    return roots


def check_adapter_name(name: str) -> None:
    """The admin route's rule for names (``options.ADAPTER_NAME_PATTERN``), at start-up: a name it
    refuses could not be hot-updated or unloaded there, and some (a lone surrogate) broke
    ``GET /v1/models`` for every caller."""
    if not is_adapter_name(name):
        raise ConfigError(f"lora_modules: adapter name {name!r} must be {ADAPTER_NAME_RULE} (as /v1/load_lora_adapter requires)")


def check_adapter_names(modules: "tuple[LoRAModule, ...]", served_name: str) -> None:
    """Refuse an adapter named like the served base model: a request's ``model`` is matched
    against the base first, so the adapter could never be reached (and /v1/models would list
    the name twice)."""
    for module in modules:
        if module.name == served_name:
            raise ConfigError(
                f"lora_modules: adapter {module.name!r} has the served base model's name, so requests for it would reach the base; "
                "rename the adapter or set another --served-model-name"
            )


def check_base_model_names(modules: "tuple[LoRAModule, ...]", served_model_name: str | None, model_name: str) -> None:
    """Refuse an adapter named like the served base (``check_adapter_names``), and one whose
    declared ``base_model_name`` is neither the served name nor the checkpoint's."""
    served = served_model_name or model_name
    check_adapter_names(modules, served)
    for module in modules:
        if module.base_model_name is not None and module.base_model_name not in (served, model_name):
            raise ConfigError(f"lora_modules: adapter {module.name!r} declares base_model_name {module.base_model_name!r}, but the served base is {served!r}")


def absolute_folder(path: str) -> str:
    """``path`` made absolute against the folder serve starts in, symlinks kept (Path.absolute):
    ``GET /v1/models`` shows every adapter's ``root`` absolute, as it does for admin-loaded ones, and
    a Ray replica reads the folder that was meant whatever folder it runs in. A release
    symlink (``current -> rev1``) stays one, so a re-read still follows where it points."""
    return str(Path(path).absolute())


def parse_lora_module(spec: Any) -> LoRAModule:
    """``name=path``, a JSON object string, or a mapping with name/path/base_model_name; the path
    is made absolute (``absolute_folder``)."""
    if isinstance(spec, str) and spec.lstrip().startswith("{"):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as err:
            raise ConfigError(f"lora_modules: {spec!r} is not valid JSON: {err.msg}") from err
    if isinstance(spec, Mapping):
        unknown = set(spec) - {"name", "path", "base_model_name"}
        if unknown:
            raise ConfigError(f"lora_modules: unknown field(s) {sorted(unknown)} in {dict(spec)}")
        if not spec.get("name") or not spec.get("path"):
            raise ConfigError(f"lora_modules: {dict(spec)} needs both 'name' and 'path'")
        if not all(isinstance(v, str) for k, v in spec.items() if not (k == "base_model_name" and v is None)):
            raise ConfigError(f"lora_modules: name, path and base_model_name must be strings, got {dict(spec)}")
        return LoRAModule(spec["name"], absolute_folder(spec["path"]), spec.get("base_model_name"))
    if isinstance(spec, str) and "=" in spec:
        name, path = spec.split("=", 1)
        if name and path:
            return LoRAModule(name, absolute_folder(path))
    raise ConfigError(f"lora_modules: {spec!r} is not 'name=path' or a JSON object with name and path")


def build_settings(file_values: Mapping[str, Any], flag_values: Mapping[str, Any], demo_model: str | None) -> ServeSettings:
    merged = {**file_values, **{k: v for k, v in flag_values.items() if v is not None}}
    check_types(merged)
    specs = merged.get("lora_modules") or []
    if not isinstance(specs, list):
        raise ConfigError(f"lora_modules: expected a list of adapters ('name=path' strings or mappings), got {specs!r}")
    modules = tuple(parse_lora_module(m) for m in specs)
    for module in modules:
        check_adapter_name(module.name)
    names = [m.name for m in modules]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(f"lora_modules: adapter name(s) given twice: {', '.join(dupes)}")
    if isinstance(merged.get("model"), str) and not merged["model"].strip():
        # e.g. --model "$MODEL" with MODEL unset: serving the demo instead would answer with the wrong model
        raise ConfigError("model: empty; give the model's folder (or leave model out to serve the bundled demo)")
    if isinstance(merged.get("host"), str) and not merged["host"].strip():
        # e.g. --host "$HOST" with HOST unset: an empty host binds every interface, not the default 127.0.0.1
        raise ConfigError("host: empty; give an address (e.g. 127.0.0.1, or 0.0.0.0 for every interface), or leave it out for 127.0.0.1")
    if isinstance(merged.get("served_model_name"), str) and not merged["served_model_name"].strip():
        raise ConfigError("served_model_name: empty; give a name, or leave it out to use the model folder's name")
    uses_demo = merged.get("model") is None
    if uses_demo:
        if demo_model is None:
            raise ConfigError("model: no --model given and the bundled demo model is not installed")
        merged["model"] = demo_model
    if merged.get("max_cpu_lora_bytes") is not None:
        try:
            merged["max_cpu_lora_bytes"] = parse_byte_size(merged["max_cpu_lora_bytes"])
        except ValueError as err:
            raise ConfigError(f"max_cpu_lora_bytes: {err}") from None
    engine = EngineConfig.from_dict({k: merged[k] for k in ENGINE_KEYS if k in merged})
    check_every_decode_fits(engine)
    roots = adapter_roots(merged.get("adapter_root"))
    if roots and not merged.get("enable_adapter_admin"):
        raise ConfigError("adapter_root: only used by the adapter admin routes; add --enable-adapter-admin (or 'enable_adapter_admin: true'), or drop it")
    server_kwargs = {k: merged[k] for k in ("host", "port", "served_model_name", "enable_adapter_admin", "api_key", "max_request_bytes", "metrics_max_adapters")
                     if k in merged}
    port = server_kwargs.get("port", 8000)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ConfigError(f"port: expected 0..65535, got {port!r}")
    max_bytes = server_kwargs.get("max_request_bytes", 1 << 20)
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1024:
        raise ConfigError(f"max_request_bytes: expected an integer >= 1024, got {max_bytes!r}")
    metrics_max = server_kwargs.get("metrics_max_adapters", 0)
    if isinstance(metrics_max, bool) or not isinstance(metrics_max, int) or metrics_max < 0:
        raise ConfigError(f"metrics_max_adapters: expected an integer >= 0, got {metrics_max!r}")
    for root in roots:
        if not Path(root).is_dir():
            raise ConfigError(f"adapter_root: {root!r} is not a directory")
    server = ServerOptions(adapter_roots=tuple(Path(r).resolve() for r in roots), **server_kwargs)
    if server.api_key is not None and len(server.api_key) < 8:
        raise ConfigError("api_key: use at least 8 characters")
    log_level = str(merged.get("log_level", "info")).lower()
    if log_level not in ("debug", "info", "warning", "error"):
        raise ConfigError(f"log_level: {log_level!r} is not one of debug, info, warning, error")
    num_replicas = merged.get("num_replicas", 1)
    if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
        raise ConfigError(f"num_replicas: expected an integer >= 1, got {num_replicas!r}")
    ray = merged.get("ray", False)
    if not isinstance(ray, bool):
        raise ConfigError(f"ray: expected true or false, got {ray!r}")
    # num_replicas: 1 is what a single server is anyway; anything else needs Ray.
    ray_only = [k for k in ("num_replicas", "ray_address", "registry_dir") if merged.get(k) is not None and not (k == "num_replicas" and merged[k] == 1)]
    if ray_only and not ray:
        raise ConfigError(f"{ray_only[0]}: only used by a Ray Serve deployment; add --ray (or 'ray: true'), or drop it")
    if ray:
        check_host_tier_counted(engine)
    return ServeSettings(
        engine=engine,
        server=server,
        lora_modules=modules,
        log_level=log_level,
        uses_demo=uses_demo,
        ray=ray,
        num_replicas=num_replicas,
        ray_address=merged.get("ray_address"),
        registry_dir=merged.get("registry_dir"),
    )
