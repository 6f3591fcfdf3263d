"""Engine configuration: frozen dataclasses; unknown keys and bad values are errors naming the key."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, fields
from typing import Any, Mapping

DTYPES = ("float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda", "npu")
DEFAULT_KV_CACHE_MB = 1024  # the KV memory cap when neither num_kv_blocks nor kv_cache_mb is given
DEFAULT_HOST_LORAS = 32  # host-tier adapters when max_cpu_loras is not given (or max_loras, if more)
# The step token budget when max_num_batched_tokens is not given. On the CPU smaller steps are faster even for one long
# prompt: a step's activations (rows x intermediate) stay in cache instead of being faulted in fresh each step. On the
# 2-core dev machine (docs/benchmarks.md, "Step token budget on the CPU") 256 against 1024 took the 48-request burst
# 1.05-1.12x faster in turn (hidden 512 / 1024) and one ~950-token prompt 1.17x / 1.37x / 1.11x (hidden 512 / 1024 /
# 2048) against 2048; 128 was no faster than 256, 512 within 2% of it. GPUs and NPUs keep 2048 (not measured there).
DEFAULT_BATCHED_TOKENS = 2048
CPU_BATCHED_TOKENS = 256
CPU_GEMMS = ("auto", "onednn", "mkl")  # cpu_gemm's values (runtime.models.dense.float32_packed reads them)


class ConfigError(ValueError):
    """A configuration key is unknown or its value is invalid; the message names the key."""


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to start.

    model:                  HF checkpoint folder (config.json + safetensors)
    device:                 auto | cpu | cuda | npu (auto: cuda, then npu, then cpu)
    dtype:                  float32 | bfloat16 | float16 (compute and weight dtype)
    max_loras:              distinct adapters in one step (= device slots)
    max_lora_rank:          largest rank accepted at adapter load
    max_cpu_loras:          host-tier LRU capacity (adapters), at least max_loras; None = max(32, max_loras),
                            or no entry bound when max_cpu_lora_bytes is given (``host_tier_size``)
    max_cpu_lora_bytes:     host-tier bound in bytes of adapter tensors (their A and B matrices), alone or with
                            max_cpu_loras (both then hold); None = no byte bound. An adapter larger than it
                            is refused when it is registered (``AdapterPool.check_fits_host``)
    lora_pool_rows:         device rank-rows per target slice; None = max_loras * max_lora_rank.
                            Adapters take only their own rank's rows, so a smaller value
                            still fits many low-rank adapters.
    max_num_seqs:           running sequences per step
    max_num_batched_tokens: token budget of one step (prefill chunks + decodes); None = max(2048, max_num_seqs)
                            on cuda/npu, max(256, max_num_seqs) on the cpu (``for_backend``, CPU_BATCHED_TOKENS),
                            so every running sequence's decode fits in a step. A given budget below
                            max_num_seqs is accepted here (at most that many sequences decode in a step,
                            oldest first, the others wait holding their KV blocks; tests and step
                            benchmarks use it to force contention); ``lorafleet serve`` refuses it
                            (``check_every_decode_fits``).
    max_model_len:          longest prompt + output; None = the model's limit (max_position_embeddings, capped to its sliding window if it has one)
    block_size:             tokens per KV block
    num_kv_blocks:          KV blocks in the pool; None = enough for max_num_seqs full-length sequences, capped by kv_cache_mb
    kv_cache_mb:            cap on KV memory when num_kv_blocks is None; None = DEFAULT_KV_CACHE_MB (1024); with num_kv_blocks it is refused
    enable_prefix_caching:  reuse full KV blocks across requests of the same (base, adapter, version)
    seed:                   seed for sampling when a request gives none
    cpu_gemm:               auto | onednn | mkl: the cpu backend's float32 base GEMM. onednn packs the large
                            projections for oneDNN, mkl keeps them plain on F.linear (MKL's sgemm), auto is
                            onednn wherever torch has oneDNN (``for_backend`` spells it out; mkl can be faster
                            for small models or one stream on Intel CPUs: runtime/models/dense.py). Other dtypes
                            and devices ignore the choice, so only auto is accepted with them. An int8 checkpoint runs its
                            projections int8: the choice is then its untied LM head's only, and refused
                            when the head is tied (``model_runner.check_cpu_gemm_applies``).
    """

    model: str
    device: str = "auto"
    dtype: str = "float32"
    max_loras: int = 8
    max_lora_rank: int = 64
    max_cpu_loras: int | None = None
    max_cpu_lora_bytes: int | None = None
    lora_pool_rows: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_mb: int | None = None
    enable_prefix_caching: bool = False
    seed: int = 0
    cpu_gemm: str = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.model, (str, os.PathLike)) or not str(self.model):
            raise ConfigError(f"model: expected a checkpoint folder (a path), got {self.model!r}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype: {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.device not in DEVICES:
            raise ConfigError(f"device: {self.device!r} is not one of {', '.join(DEVICES)}")
        if self.cpu_gemm not in CPU_GEMMS:
            raise ConfigError(f"cpu_gemm: {self.cpu_gemm!r} is not one of {', '.join(CPU_GEMMS)}")
        positive = ("max_loras", "max_lora_rank", "max_num_seqs", "block_size")
        for name in positive:
            _check_int(name, getattr(self, name), minimum=1)
        for name in ("max_num_batched_tokens", "max_cpu_loras", "max_cpu_lora_bytes", "lora_pool_rows", "max_model_len", "num_kv_blocks",
                     "kv_cache_mb"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), minimum=1)
        if self.num_kv_blocks is not None and self.kv_cache_mb is not None:
            raise ConfigError("kv_cache_mb: only sizes the KV pool when num_kv_blocks is not given; drop one of them")
        _check_int("seed", self.seed, minimum=0)
        if self.seed >= 2**64:  # the sampler folds seeds to 64 bits: 2**64 would silently draw as seed 0 does
            raise ConfigError(f"seed: must be below 2**64 (as a request's seed), got {self.seed}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ConfigError(f"enable_prefix_caching: expected true or false, got {self.enable_prefix_caching!r}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ConfigError(f"max_cpu_loras: {self.max_cpu_loras} is below max_loras={self.max_loras}; the host tier must hold every device adapter")
        if self.lora_pool_rows is not None and self.lora_pool_rows < self.max_lora_rank:
            raise ConfigError(f"lora_pool_rows: {self.lora_pool_rows} cannot hold one adapter of max_lora_rank={self.max_lora_rank}")

    def for_backend(self, backend_name: str) -> "EngineConfig":
        """This config with the defaults that depend on the backend filled in (the backend's
        ``name``: cpu, cuda, npu): ``max_num_batched_tokens``, when not given, is
        max(CPU_BATCHED_TOKENS, max_num_seqs) on the cpu and max(DEFAULT_BATCHED_TOKENS,
        max_num_seqs) elsewhere (every running sequence's decode fits a step). A given value is kept. ``cpu_gemm`` auto
        becomes this CPU's choice (onednn or mkl) on the cpu in float32; off it, and with another
        dtype, only auto is accepted (and kept)."""
        config = self
        if self.cpu_gemm != "auto" and self.dtype != "float32":
            raise ConfigError(f"cpu_gemm: {self.cpu_gemm!r} chooses the float32 GEMM; with dtype {self.dtype} it would change nothing: leave it at auto")
        if backend_name == "cpu" and self.cpu_gemm == "auto" and self.dtype == "float32":
            from runtime.models.dense import float32_packed  # torch: imported only when a backend is known

            config = config.replace(cpu_gemm="onednn" if float32_packed("auto") else "mkl")
        elif backend_name == "cpu" and self.cpu_gemm == "onednn":
            from runtime.models.dense import why_onednn_cannot_pack

            why = why_onednn_cannot_pack()
            if why is not None:  # packing would silently leave every weight on F.linear, i.e. mkl
                raise ConfigError(f"cpu_gemm: 'onednn' packs float32 weights for oneDNN, but {why}: use auto or mkl")
        elif backend_name != "cpu" and self.cpu_gemm != "auto":
            raise ConfigError(f"cpu_gemm: {self.cpu_gemm!r} chooses the cpu backend's float32 GEMM; this engine runs on {backend_name}: leave it at auto")
        if config.max_num_batched_tokens is not None:
            return config
        floor = CPU_BATCHED_TOKENS if backend_name == "cpu" else DEFAULT_BATCHED_TOKENS
        return config.replace(max_num_batched_tokens=max(floor, config.max_num_seqs))

    @property
    def kv_cache_cap_mb(self) -> int:
        """The KV memory cap that sizes the pool when num_kv_blocks is None."""
        return self.kv_cache_mb if self.kv_cache_mb is not None else DEFAULT_KV_CACHE_MB

    @property
    def host_tier_size(self) -> int | None:
        """Adapters the host tier holds: max_cpu_loras; when it is not given, max(32, max_loras), or None
        (no entry bound) when max_cpu_lora_bytes bounds the tier instead: an operator who sizes it in
        bytes for thousands of small adapters would otherwise meet the default 32 first."""
        if self.max_cpu_loras is not None:
            return self.max_cpu_loras
        return None if self.max_cpu_lora_bytes is not None else max(DEFAULT_HOST_LORAS, self.max_loras)

    @property
    def pool_rows(self) -> int:
        return self.lora_pool_rows if self.lora_pool_rows is not None else self.max_loras * self.max_lora_rank

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown config key(s): {', '.join(unknown)}; known keys: {', '.join(sorted(known))}")
        if "model" not in values:
            raise ConfigError("model: required")
        return cls(**dict(values))

    def replace(self, **changes: Any) -> "EngineConfig":
        return dataclasses.replace(self, **changes)


def check_every_decode_fits(config: EngineConfig) -> None:
    """``lorafleet serve``'s rule: a given step budget C = max_num_batched_tokens is at least
    S = max_num_seqs, so one step can decode every running sequence (one token each). With
    C < S only C of them decode in a step, oldest first; the rest stall holding their KV
    blocks, and the scheduler's fairness bound (which assumes C >= S) does not hold. The
    defaults never fall below S (``for_backend``)."""
    budget, seqs = config.max_num_batched_tokens, config.max_num_seqs
    if budget is not None and budget < seqs:
        raise ConfigError(
            f"max_num_batched_tokens: {budget} is below max_num_seqs={seqs}: a step could decode only {budget} of {seqs} running "
            f"sequences and the others would stall holding their KV blocks; raise it to at least {seqs} or lower max_num_seqs"
        )


def check_host_tier_counted(config: EngineConfig) -> None:
    """The Ray application's rule: each replica's host tier has an entry bound. Serve's adapter
    affinity (``serve.multiplexed(max_num_models_per_replica=...)``) counts the adapters a replica
    holds and needs that count, so ``max_cpu_lora_bytes`` alone, which leaves the entries
    uncounted (``host_tier_size`` None), is refused rather than given Serve a made-up number."""
    if config.host_tier_size is None:
        raise ConfigError(
            "max_cpu_lora_bytes: under --ray give max_cpu_loras (--max-cpu-loras) too: Serve routes by the number of adapters each "
            "replica holds, so the host tier needs an entry bound besides the byte bound (both then hold)"
        )


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name}: expected an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{name}: must be >= {minimum}, got {value}")
