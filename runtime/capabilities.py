"""The capability matrix: load and validate ``capability_matrix.yaml``, gate configs and adapters.

Each backend section declares, per capability, whether it is supported, the limits of
its primary implementation, and an optional declared fallback with its own limits.
Gating answers every question one of three ways:

    request within the primary limits                -> nothing to say
    outside them, within the declared fallback's     -> a ``Decision`` (logged once by a ``Gate``)
    outside both, or capability unsupported          -> ``CapabilityError`` quoting the matrix entry

A rank ``r`` is within limits when ``min_rank <= r <= max_rank`` and ``r % rank_granularity == 0``.
Nothing unsupported runs silently: every refusal names the matrix file and the entry.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Iterable, Mapping

import yaml

from runtime.config import EngineConfig

SCHEMA_VERSION = 1
BACKEND_SECTIONS = ("cpu", "cuda", "npu")
# runtime/capability_matrix.yaml is a symlink to the repo-root file, so a checkout reads the
# one source of truth and a wheel (which copies the link's content) still ships the matrix.
DEFAULT_MATRIX_PATH = Path(__file__).with_name("capability_matrix.yaml")
# "not applicable": an unsupported capability nothing on the backend can ask for (probe: skipped).
VERIFIED_HOW = ("hardware", "triton-interpreter", "emulated op semantics", "cpu", "unverified", "not applicable")
ENTRY_KEYS = ("supported", "limits", "implementation", "fallback", "note", "verified_on")
FALLBACK_KEYS = ("when", "implementation", "limits")
VERIFIED_KEYS = ("how", "where", "date")
# Capabilities whose primary limits constrain the LoRA op paths an adapter will use.
LORA_OP_CAPABILITIES = ("lora_ops_segment", "lora_ops_per_token")

_LOG = logging.getLogger(__name__)


class CapabilityMatrixError(ValueError):
    """The matrix file is missing or malformed; the message names the file and the key."""


class CapabilityError(ValueError):
    """A config or adapter asks for something the backend does not support; quotes the matrix."""


# ---------------------------------------------------------------------------------------
# Data model


@dataclass(frozen=True)
class Limits:
    """Declared limits (None = not declared / no limit beyond memory)."""

    dtypes: tuple[str, ...] | None = None
    min_rank: int | None = None
    max_rank: int | None = None
    rank_granularity: int | None = None
    max_adapters_per_batch: int | None = None
    max_rows_per_launch: int | None = None
    max_groups_per_call: int | None = None
    max_slices_per_launch: int | None = None
    target_modules: tuple[str, ...] | None = None

    def rank_violation(self, rank: int) -> str | None:
        """Why ``rank`` is outside these limits, or None when it is inside."""
        lo = self.min_rank if self.min_rank is not None else 1
        gran = self.rank_granularity if self.rank_granularity is not None else 1
        if rank < lo or (self.max_rank is not None and rank > self.max_rank) or rank % gran:
            hi = self.max_rank if self.max_rank is not None else "unbounded"
            step = f" in steps of {gran}" if gran != 1 else ""
            return f"rank {rank} is outside {lo}..{hi}{step}"
        return None

    def dtype_violation(self, dtype: str) -> str | None:
        if self.dtypes is not None and dtype not in self.dtypes:
            return f"dtype {dtype!r} is not one of {', '.join(self.dtypes)}"
        return None

    def module_violation(self, module_name: str) -> str | None:
        if self.target_modules is not None and module_name not in self.target_modules:
            return f"target module {module_name!r} is not one of {', '.join(self.target_modules)}"
        return None

    def admissible_ranks(self) -> list[int]:
        """Every rank these limits admit (ascending)."""
        lo = self.min_rank if self.min_rank is not None else 1
        hi = self.max_rank if self.max_rank is not None else lo
        gran = self.rank_granularity if self.rank_granularity is not None else 1
        return [r for r in range(lo, hi + 1) if r % gran == 0]


@dataclass(frozen=True)
class Fallback:
    when: str
    implementation: str
    limits: Limits


@dataclass(frozen=True)
class VerifiedOn:
    how: str
    where: str
    date: str


@dataclass(frozen=True)
class Capability:
    """One (backend, capability) entry of the matrix."""

    backend: str
    name: str
    supported: bool
    limits: Limits
    implementation: str
    fallback: Fallback | None
    note: str
    verified_on: VerifiedOn
    source: str  # the matrix file, for messages
    raw: Mapping[str, Any] = field(repr=False, compare=False, default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.backend}.{self.name}"

    def quote(self) -> str:
        """The entry as written in the matrix (without implementation/verified_on), for messages."""
        shown = {k: self.raw[k] for k in ("supported", "limits", "fallback", "note") if k in self.raw}
        text = yaml.safe_dump(shown, default_flow_style=True, sort_keys=False, width=1_000_000).strip()
        return f"{Path(self.source).name} [{self.key}]: {text}"


@dataclass(frozen=True)
class CapabilityMatrix:
    path: Path
    schema_version: int
    sections: Mapping[str, Mapping[str, Capability]]

    @property
    def backends(self) -> tuple[str, ...]:
        return tuple(self.sections)

    def capabilities(self, backend: str) -> tuple[str, ...]:
        return tuple(self._section(backend))

    def all_capabilities(self) -> tuple[str, ...]:
        names: dict[str, None] = {}
        for section in self.sections.values():
            names.update(dict.fromkeys(section))
        return tuple(names)

    def entry(self, backend: str, capability: str) -> Capability:
        section = self._section(backend)
        if capability not in section:
            raise CapabilityMatrixError(f"{self.path}: {backend}.{capability}: no such capability in the matrix")
        return section[capability]

    def _section(self, backend: str) -> Mapping[str, Capability]:
        if backend not in self.sections:
            raise CapabilityMatrixError(f"{self.path}: no section {backend!r}; sections: {', '.join(self.sections)}")
        return self.sections[backend]


@dataclass(frozen=True)
class Decision:
    """A declared fallback applied because a primary limit is not met."""

    backend: str
    capability: str
    reason: str
    fallback: str
    quote: str

    @property
    def message(self) -> str:
        return f"{self.backend}: {self.reason}; using the declared fallback: {self.fallback} ({self.quote})"


# ---------------------------------------------------------------------------------------
# Loading and schema validation


def load_matrix(path: str | Path | None = None) -> CapabilityMatrix:
    """Read and validate the matrix (default: ``capability_matrix.yaml`` at the repo root)."""
    path = Path(path) if path is not None else DEFAULT_MATRIX_PATH
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise CapabilityMatrixError(f"{path}: cannot read the capability matrix: {err.strerror or err}") from err
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise CapabilityMatrixError(f"{path}: not valid YAML: {err}") from err
    return _parse(path, data)


def _parse(path: Path, data: Any) -> CapabilityMatrix:
    def fail(key: str, msg: str) -> CapabilityMatrixError:
        return CapabilityMatrixError(f"{path}: {key}: {msg}")

    if not isinstance(data, dict):
        raise fail("(top level)", "expected a mapping with schema_version and one section per backend")
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise fail("schema_version", f"expected {SCHEMA_VERSION}, got {version!r}")
    unknown = sorted(set(data) - {"schema_version", *BACKEND_SECTIONS})
    if unknown:
        raise fail(unknown[0], f"unknown top-level key; sections are {', '.join(BACKEND_SECTIONS)}")
    sections: dict[str, Mapping[str, Capability]] = {}
    for backend in BACKEND_SECTIONS:
        section = data.get(backend)
        if not isinstance(section, dict) or not section:
            raise fail(backend, "missing section (a mapping of capability -> entry)")
        sections[backend] = MappingProxyType(
            {name: _parse_entry(path, backend, str(name), entry, fail) for name, entry in section.items()}
        )
    first = BACKEND_SECTIONS[0]
    for backend in BACKEND_SECTIONS[1:]:
        missing = sorted(set(sections[first]) ^ set(sections[backend]))
        if missing:
            raise fail(f"{backend}.{missing[0]}", f"every section must list the same capabilities ({first} and {backend} differ)")
    return CapabilityMatrix(path=path, schema_version=version, sections=MappingProxyType(sections))


def _parse_entry(path: Path, backend: str, name: str, entry: Any, fail: Any) -> Capability:
    key = f"{backend}.{name}"
    if not isinstance(entry, dict):
        raise fail(key, "expected a mapping")
    missing = [k for k in ENTRY_KEYS if k not in entry]
    if missing:
        raise fail(f"{key}.{missing[0]}", "required key is missing")
    unknown = sorted(set(entry) - set(ENTRY_KEYS))
    if unknown:
        raise fail(f"{key}.{unknown[0]}", f"unknown key; allowed: {', '.join(ENTRY_KEYS)}")
    if not isinstance(entry["supported"], bool):
        raise fail(f"{key}.supported", f"expected true or false, got {entry['supported']!r}")
    for text_key in ("implementation", "note"):
        if not isinstance(entry[text_key], str) or not entry[text_key].strip():
            raise fail(f"{key}.{text_key}", "expected a non-empty string")
    limits = _parse_limits(entry["limits"], f"{key}.limits", fail)
    fallback = None
    if entry["fallback"] is not None:
        fb = entry["fallback"]
        if not isinstance(fb, dict) or sorted(fb) != sorted(FALLBACK_KEYS):
            raise fail(f"{key}.fallback", f"expected null or a mapping with exactly {', '.join(FALLBACK_KEYS)}")
        for text_key in ("when", "implementation"):
            if not isinstance(fb[text_key], str) or not fb[text_key].strip():
                raise fail(f"{key}.fallback.{text_key}", "expected a non-empty string")
        fallback = Fallback(fb["when"], fb["implementation"], _parse_limits(fb["limits"], f"{key}.fallback.limits", fail))
    vo = entry["verified_on"]
    if not isinstance(vo, dict) or sorted(vo) != sorted(VERIFIED_KEYS):
        raise fail(f"{key}.verified_on", f"expected a mapping with exactly {', '.join(VERIFIED_KEYS)}")
    if vo["how"] not in VERIFIED_HOW:
        raise fail(f"{key}.verified_on.how", f"{vo['how']!r} is not one of: {', '.join(VERIFIED_HOW)}")
    date = str(vo["date"])
    if len(date) != 10 or date[4] != "-" or date[7] != "-" or not date.replace("-", "").isdigit():
        raise fail(f"{key}.verified_on.date", f"expected YYYY-MM-DD, got {vo['date']!r}")
    if not entry["supported"] and fallback is not None:
        raise fail(f"{key}.fallback", "an unsupported capability cannot declare a fallback")
    if entry["supported"] and vo["how"] == "not applicable":
        raise fail(f"{key}.verified_on.how", "'not applicable' is only for a capability declared unsupported")
    return Capability(
        backend=backend,
        name=name,
        supported=entry["supported"],
        limits=limits,
        implementation=entry["implementation"],
        fallback=fallback,
        note=entry["note"],
        verified_on=VerifiedOn(str(vo["how"]), str(vo["where"]), date),
        source=str(path),
        raw=MappingProxyType(dict(entry)),
    )


_POSITIVE_INT = ("min_rank", "max_rank", "rank_granularity", "max_groups_per_call")
_OPTIONAL_INT = ("max_adapters_per_batch", "max_rows_per_launch", "max_slices_per_launch")
_STR_LISTS = ("dtypes", "target_modules")
LIMIT_KEYS = _STR_LISTS + _POSITIVE_INT + _OPTIONAL_INT


def _parse_limits(raw: Any, key: str, fail: Any) -> Limits:
    import torch  # only to check that dtype names are real torch dtypes

    if not isinstance(raw, dict):
        raise fail(key, "expected a mapping (use {} for none)")
    unknown = sorted(set(raw) - set(LIMIT_KEYS))
    if unknown:
        raise fail(f"{key}.{unknown[0]}", f"unknown limit; allowed: {', '.join(LIMIT_KEYS)}")
    values: dict[str, Any] = {}
    for name in _STR_LISTS:
        if name in raw:
            items = raw[name]
            if not isinstance(items, list) or not items or not all(isinstance(i, str) for i in items):
                raise fail(f"{key}.{name}", "expected a non-empty list of names")
            values[name] = tuple(items)
    for i, dt in enumerate(values.get("dtypes", ())):
        if not isinstance(getattr(torch, dt, None), torch.dtype):
            raise fail(f"{key}.dtypes[{i}]", f"{dt!r} is not a torch dtype name")
    for name in _POSITIVE_INT + _OPTIONAL_INT:
        if name not in raw:
            continue
        v = raw[name]
        if v is None and name in _OPTIONAL_INT:
            values[name] = None
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise fail(f"{key}.{name}", f"expected a positive integer{' or null' if name in _OPTIONAL_INT else ''}, got {v!r}")
        values[name] = v
    limits = Limits(**values)
    if limits.min_rank is not None and limits.max_rank is not None and limits.min_rank > limits.max_rank:
        raise fail(f"{key}.min_rank", f"{limits.min_rank} exceeds max_rank {limits.max_rank}")
    gran = limits.rank_granularity
    if gran is not None:
        for name in ("min_rank", "max_rank"):
            v = getattr(limits, name)
            if v is not None and v % gran:
                raise fail(f"{key}.{name}", f"{v} is not a multiple of rank_granularity {gran}")
    return limits


# ---------------------------------------------------------------------------------------
# Gating


def require(capability: str, backend_name: str, matrix: CapabilityMatrix | None = None) -> Capability:
    """The entry of a capability the caller is about to use; ``CapabilityError`` if unsupported."""
    entry = (matrix or load_matrix()).entry(backend_name, capability)
    if not entry.supported:
        raise CapabilityError(f"{backend_name}: {capability} is not supported: {entry.note} ({entry.quote()})")
    return entry


def unsupported_quote(capability: str, matrix: CapabilityMatrix | None = None) -> str:
    """The matrix entries that declare ``capability`` unsupported, quoted for a refusal raised where
    the backend is not known (adapter parsing refuses DoRA for every backend): one quote naming
    every such backend when their entries read the same, else one quote per backend. Never
    raises: an unreadable matrix gives a pointer to the file and the entry instead."""
    try:
        m = matrix or load_matrix()
        entries = [m.entry(b, capability) for b in m.backends if capability in m.sections[b]]
    except CapabilityMatrixError as err:
        return f"see {DEFAULT_MATRIX_PATH.name} [<backend>.{capability}] (unreadable here: {err})"
    refused = [e for e in entries if not e.supported]
    if not refused:
        return f"{Path(m.path).name}: no backend declares {capability} unsupported"
    bodies = {e.quote().split("]: ", 1)[1] for e in refused}
    if len(bodies) == 1:
        keys = ", ".join(e.key for e in refused)
        return f"{refused[0].note} ({Path(refused[0].source).name} [{keys}]: {bodies.pop()})"
    return "; ".join(f"{e.note} ({e.quote()})" for e in refused)


def _apply(entry: Capability, violation: str | None, fallback_violation: str | None) -> Decision | None:
    """An error quoting the entry when it is declared unsupported (the caller is about to use
    it, whatever its limits); None when the primary limits are met; else the declared fallback,
    or an error quoting the entry."""
    if not entry.supported:
        raise CapabilityError(f"{entry.backend}: {entry.name} is not supported: {entry.note} ({entry.quote()})")
    if violation is None:
        return None
    if entry.fallback is not None and fallback_violation is None:
        return Decision(entry.backend, entry.name, f"{entry.name}: {violation}", entry.fallback.implementation, entry.quote())
    why = f"{violation} and no declared fallback admits it" if entry.fallback is not None else violation
    raise CapabilityError(f"{entry.backend}: {entry.name}: {why} ({entry.quote()})")


def check_engine_config(config: EngineConfig, backend_name: str, matrix: CapabilityMatrix | None = None) -> list[Decision]:
    """Check dtype, max_lora_rank, max_loras, token budget and prefix caching against the backend's row.

    Every engine uses the dtypes, max_rank, paged_attention, both LoRA op schedules and the
    multi-slice expand (q/k/v and gate/up are fused projections): one declared unsupported
    refuses the config, whatever its limits."""
    m = matrix or load_matrix()
    decisions: list[Decision] = []
    require("multi_slice_expand", backend_name, m)

    def gate(entry: Capability, violation: str | None, fb_violation: str | None = None) -> None:
        decision = _apply(entry, violation, fb_violation)
        if decision is not None:
            decisions.append(decision)

    gate(m.entry(backend_name, "dtypes"), m.entry(backend_name, "dtypes").limits.dtype_violation(config.dtype))
    for cap in (*LORA_OP_CAPABILITIES, "paged_attention"):
        entry = m.entry(backend_name, cap)
        fb = entry.fallback.limits.dtype_violation(config.dtype) if entry.fallback else None
        gate(entry, entry.limits.dtype_violation(config.dtype), fb)
    max_rank = m.entry(backend_name, "max_rank")
    top = max_rank.limits.max_rank
    gate(max_rank, f"max_lora_rank={config.max_lora_rank} exceeds max_rank {top}" if top is not None and config.max_lora_rank > top else None)
    for cap in LORA_OP_CAPABILITIES:
        entry = m.entry(backend_name, cap)
        cap_n = entry.limits.max_adapters_per_batch
        if cap_n is not None and config.max_loras > cap_n:
            gate(entry, f"max_loras={config.max_loras} exceeds max_adapters_per_batch {cap_n}")
        rows = entry.limits.max_rows_per_launch
        if rows is not None and config.max_num_batched_tokens > rows:
            gate(entry, f"max_num_batched_tokens={config.max_num_batched_tokens} exceeds max_rows_per_launch {rows}")
    if config.enable_prefix_caching:
        require("prefix_caching", backend_name, m)
    return decisions


def check_adapter(adapter: Any, backend_name: str, matrix: CapabilityMatrix | None = None) -> list[Decision]:
    """Check an adapter's ranks, target modules and DoRA flag against the backend's row.

    ``adapter`` needs ``.name`` and ``.modules: {(layer, module_name): module with .rank}``;
    an optional truthy ``.use_dora`` asks for DoRA.
    """
    m = matrix or load_matrix()
    name = getattr(adapter, "name", "?")
    if getattr(adapter, "use_dora", False):
        entry = m.entry(backend_name, "dora")
        if not entry.supported:
            raise CapabilityError(f"{backend_name}: adapter {name!r} uses DoRA, which is not supported: {entry.note} ({entry.quote()})")
    decisions: dict[str, Decision] = {}
    ranks = sorted({int(module.rank) for module in adapter.modules.values()})
    module_names = sorted({module_name for (_layer, module_name) in adapter.modules})

    def gate(entry: Capability, violation: str | None, fb_violation: str | None = None) -> None:
        if violation is not None:
            violation = f"adapter {name!r}: {violation}"
        decision = _apply(entry, violation, fb_violation)
        if decision is not None:
            decisions.setdefault(decision.reason, decision)

    for cap in LORA_OP_CAPABILITIES:
        entry = m.entry(backend_name, cap)
        for module_name in module_names:
            fb = entry.fallback.limits.module_violation(module_name) if entry.fallback else None
            gate(entry, entry.limits.module_violation(module_name), fb)
    max_rank = m.entry(backend_name, "max_rank")
    for rank in ranks:
        gate(max_rank, max_rank.limits.rank_violation(rank))
        for cap in LORA_OP_CAPABILITIES:
            entry = m.entry(backend_name, cap)
            fb = entry.fallback.limits.rank_violation(rank) if entry.fallback else None
            gate(entry, entry.limits.rank_violation(rank), fb)
    if len(ranks) > 1:
        mixed = m.entry(backend_name, "mixed_ranks")
        gate(mixed, None if mixed.supported else f"modules of different ranks {ranks}")
    return list(decisions.values())


class Gate:
    """Gating for one engine: the caller owns it, and with it the log-once state.

    Each fallback decision (capability + reason) is logged the first time this gate
    sees it; refusals raise ``CapabilityError`` every time.
    """

    def __init__(self, backend_name: str, matrix: CapabilityMatrix | None = None, logger: logging.Logger | None = None) -> None:
        self.backend_name = backend_name
        self.matrix = matrix or load_matrix()
        self.logger = logger or _LOG
        self._logged: set[tuple[str, str]] = set()
        self.matrix.entry(backend_name, "dtypes")  # unknown backend -> error now, not at first use

    def check_engine_config(self, config: EngineConfig) -> list[Decision]:
        return self._log_once(check_engine_config(config, self.backend_name, self.matrix))

    def check_device_dtype(self, backend: Any, dtype: str) -> None:
        """Refuse ``dtype`` where this very device lacks it (``backend.dtype_problem``, optional):
        the matrix row holds for the backend, a chip of it may hold less."""
        problem = getattr(backend, "dtype_problem", None)
        why = problem(dtype) if problem is not None else None
        if why:
            raise CapabilityError(f"{self.backend_name}: dtype {dtype} is not supported on this device: {why}")

    def check_adapter(self, adapter: Any) -> list[Decision]:
        return self._log_once(check_adapter(adapter, self.backend_name, self.matrix))

    def require(self, capability: str) -> Capability:
        return require(capability, self.backend_name, self.matrix)

    def _log_once(self, decisions: Iterable[Decision]) -> list[Decision]:
        out = list(decisions)
        for d in out:
            key = (d.capability, d.reason)
            if key not in self._logged:
                self._logged.add(key)
                self.logger.warning("%s", d.message)
        return out
