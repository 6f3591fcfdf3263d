"""LLMEngine: the step loop  schedule -> adapter pool -> model forward -> sample -> outputs.

One ``step()``:
  1. collect finished adapter loads (a failed load finishes its requests with "error");
  2. ``Scheduler.schedule()`` picks prefill chunks + decodes under the token budget,
     holding device slots for their adapters (at most ``max_loras`` per step);
  3. the pool fences the copies of those slots, ``ModelRunner.execute`` runs the step;
  4. one token is sampled per sequence whose chunk reached its end; stop rules and the
     incremental detokenizer produce ``RequestOutput`` deltas;
  5. finished requests release KV blocks, device refs, host demand and registry readers;
     the next step's adapters are prefetched to the device (into free rows, or in place of
     idle residents nobody waits for).

If nothing can run because adapter loads are pending, ``step()`` waits for one (up to 1 s),
or with ``wait_for_loads=False`` returns at once and ``stalled_load_futures()`` says what to
wait on (``AsyncLLMEngine`` waits outside its lock).

Not thread-safe by itself: ``AsyncLLMEngine`` serialises calls with a lock.
"""
from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable, Iterable, NamedTuple, Optional, Sequence as Seq

import torch

from runtime.capabilities import Gate
from runtime.config import EngineConfig
from runtime.detokenizer import IncrementalDetokenizer
from runtime.kv.block_manager import BlockManager
from runtime.kv.prefix_cache import PrefixCache
from runtime.lora.adapter import (AdapterError, AdapterPathError, LoRAAdapter, check_adapter_path_type, files_within, load_adapter,
                                  resolved_files)
from runtime.lora.pool import AdapterCounters, AdapterPool
from runtime.lora.registry import AdapterInfo, AdapterRegistry
from runtime.model_runner import ModelRunner, SeqStep, check_cpu_gemm_applies
from runtime.request import (
    AdapterRef,
    ErrorKind,
    PromptTooLongError,
    RequestOutput,
    RequestRejected,
    SamplingParams,
    Sequence,
    TokenLogprobs,
    UnknownAdapterError,
)
from runtime.sampler import NoToken, Sampler, token_logprobs, token_stop_reason
from runtime.scheduler import Scheduler
from runtime.shutdown_seconds import check_shutdown_seconds
from runtime.stats import BASE_LABEL, OTHER_LABEL, AdapterRequestCounters, RequestMetrics

logger = logging.getLogger(__name__)


@dataclass
class _Live:
    seq: Sequence
    detok: IncrementalDetokenizer
    emitted_tokens: int = 0
    prompt_logprobs: Optional[tuple[Optional[TokenLogprobs], ...]] = None  # built once, when the prompt's are complete
    prompt_token_ids: tuple[int, ...] = ()  # RequestOutput.prompt_token_ids, built once rather than every step

    def prompt_logprobs_out(self) -> Optional[tuple[Optional[TokenLogprobs], ...]]:
        """``RequestOutput.prompt_logprobs``: None for the first token, then one per prompt token."""
        seq = self.seq
        if seq.params.prompt_logprobs is None:
            return None
        if self.prompt_logprobs is None or len(self.prompt_logprobs) != len(seq.prompt_logprobs) + 1:
            self.prompt_logprobs = (None, *seq.prompt_logprobs)
        return self.prompt_logprobs


class CheckedRequest(NamedTuple):
    """A request ``LLMEngine.check_request`` accepted: its prompt ids and adapter version."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    adapter: Optional[AdapterRef]


def _check_range(adapter: LoRAAdapter, path: str, dtype: torch.dtype) -> None:
    """Refuse an adapter whose weights the engine's dtype cannot hold: in float16 a value beyond
    65504 becomes inf in the slot, and every request on the adapter would end in non-finite
    logits. (Adapters are finite float32 when read; bfloat16 reaches 3.39e38, float16 only 65504.)"""
    limit, dtype_name = torch.finfo(dtype).max, str(dtype).removeprefix("torch.")
    if limit >= torch.finfo(torch.float32).max:
        return  # nothing finite in float32 lies beyond it
    for (layer, module), m in sorted(adapter.modules.items()):
        for part, t in (("lora_A", m.lora_a), ("lora_B", m.lora_b)):
            peak = float(t.abs().max()) if t.numel() else 0.0
            if peak > limit:
                raise AdapterError(
                    f"{path}: adapter {adapter.name!r}: layer {layer} {module} {part} has a value of magnitude {peak:.4g}, beyond {dtype_name}'s "
                    f"largest value ({limit:.6g}), the dtype this engine runs in; serve the adapter with --dtype bfloat16 or float32"
                )


def check_adapter_name(name: object) -> None:
    """TypeError unless ``name`` is a ``str`` (as ``check_adapter_path_type`` for the folder);
    ValueError unless it can name an adapter: non-empty, without surrounding spaces, and not one
    of the labels per-adapter metrics reserve."""
    if not isinstance(name, str):
        raise TypeError(f"adapter name: expected a str, got {type(name).__name__}")
    if not name or name != name.strip():
        raise ValueError(f"adapter name: must be a non-empty string without surrounding spaces, got {name!r}")
    if name in (BASE_LABEL, OTHER_LABEL):
        raise ValueError(f"adapter name: {name!r} is reserved (a label of its own in per-adapter metrics)")


class LLMEngine:
    def __init__(self, config: EngineConfig, backend: Any = None) -> None:
        if backend is None:
            from backends import get_backend

            backend = get_backend(config.device)
        self._closed = False  # close() has released the model: requests and adapter changes are refused
        self._close_lock = threading.Lock()  # one close() tears down; a concurrent one waits for it
        self._tearing_down: Optional[int] = None  # the thread in close()'s teardown, while it is (a call from it again raises)
        asked_gemm = config.cpu_gemm
        config = config.for_backend(backend.name)  # the step budget's default depends on the device
        check_cpu_gemm_applies(config, asked_gemm)  # an int8 checkpoint with a tied LM head has no float32 GEMM to choose
        self.config = config
        self.backend = backend
        self.backend_name = backend.name
        # The gate refuses what the matrix does not support and logs each declared fallback once.
        self.gate = Gate(self.backend_name)
        self.gate.check_engine_config(config)
        self.gate.check_device_dtype(backend, config.dtype)  # e.g. bfloat16 on an Atlas 310P card
        self.runner = ModelRunner(config, backend)
        self.tokenizer = self.runner.tokenizer
        self.model_name = self.runner.model_config.name
        self.max_model_len = self.runner.max_model_len
        # The tokenizer's eos, then the generation config's (config.json's where transformers' generate reads it).
        self._eos_ids = tuple(self.tokenizer.eos_token_ids)
        self._vocab_size = self.runner.model_config.vocab_size
        self._warn_tokenizer_vocab()
        self._targets = self.runner.lora_targets()
        self._num_layers = self.runner.model_config.num_hidden_layers
        prefix_cache = PrefixCache(self.model_name) if config.enable_prefix_caching else None
        self.block_manager = BlockManager(self.runner.num_kv_blocks, self.runner.block_size, prefix_cache)
        self.registry = AdapterRegistry()
        element = torch.tensor([], dtype=self.runner.dtype).element_size()
        row_bytes = sum(i + o for i, o in self._targets.values()) * self._num_layers * element
        self.pool = AdapterPool(
            writer=self.runner,
            loader=self._load_registered,
            max_loras=config.max_loras,
            max_cpu_loras=config.host_tier_size,
            max_cpu_lora_bytes=config.max_cpu_lora_bytes,
            pool_rows=config.pool_rows,
            max_lora_rank=config.max_lora_rank,
            row_bytes=row_bytes,
            device=self.runner.device,
        )
        self.scheduler = Scheduler(
            self.block_manager,
            self.pool,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_loras=config.max_loras,
            prefix_seed=prefix_cache.seed if prefix_cache is not None else None,
        )
        # min_tokens masks the eos ids in the logits: only those inside the model's vocabulary can be generated at all.
        self.sampler = Sampler(config.seed, [t for t in self._eos_ids if t < self._vocab_size])
        self._live: dict[str, _Live] = {}
        self._pending: list[RequestOutput] = []
        self._observers: list[Callable[[RequestMetrics], None]] = []
        self._arrivals = itertools.count()
        self._request_counters: dict[str, AdapterRequestCounters] = {}
        self.steps = 0
        self._stalled = False  # the last step found nothing runnable while adapter loads were pending
        self._awaiting_adapter: set[Sequence] = set()  # requests whose adapter is not on host/device yet

    # ---- adapters -------------------------------------------------------------------------
    def load_adapter_files(self, name: str, path: str, *, within: Optional[Seq[str | Path]] = None) -> LoRAAdapter:
        """Read and validate an adapter (no engine state touched; may run outside the engine lock).

        ``within``: folders (the server's ``--adapter-root``) that the folder and the files read
        must resolve into when they are opened, not only when a caller checked the path: else
        ``AdapterPathError``, nothing of them read (``load_adapter``, ``files_within``)."""
        self._check_open()
        check_adapter_name(name)
        check_adapter_path_type(path)
        adapter = load_adapter(
            str(path), name, self._targets, num_layers=self._num_layers, max_lora_rank=self.config.max_lora_rank,
            approve_files=files_within(within) if within is not None else None,
        )
        self.gate.check_adapter(adapter)
        _check_range(adapter, path, self.runner.dtype)
        self.pool.check_fits_host(adapter)  # also here, not only at install: a Ray replica validates with this alone
        return adapter

    def install_adapter(self, adapter: LoRAAdapter, path: str) -> AdapterRef:
        """Make a loaded adapter the current version of its name (hot update if the name exists)."""
        self._check_open()
        ref = AdapterRef(adapter.name, adapter.version)
        self.pool.check_fits_host(adapter)  # before anything changes: one that can never be read into the host tier is refused
        previous = self.registry.register(ref, str(path), adapter.max_rank, adapter.files)
        self.pool.revive(ref)  # same content registered again after an unregister: current, not retired
        self.pool.insert_host(ref, adapter)
        if previous is not None:
            self.pool.retire(previous)
        return ref

    def register_adapter(self, name: str, path: str, *, within: Optional[Seq[str | Path]] = None) -> AdapterRef:
        """``load_adapter_files`` (``within`` as there), then ``install_adapter``."""
        return self.install_adapter(self.load_adapter_files(name, path, within=within), str(path))

    def unregister_adapter(self, name: str) -> None:
        self._check_open()
        self.pool.retire(self.registry.unregister(name))

    def adapters(self) -> list[AdapterInfo]:
        return self.registry.infos()

    def _load_registered(self, ref: AdapterRef) -> LoRAAdapter:
        """Pool loader (runs in the pool's load thread): re-read a registered version from disk.

        Its error reaches the requests of that version, i.e. any API caller: it names the folder
        (as ``GET /v1/models`` does) but never quotes what the files hold, which the server log
        gets instead. Files that now resolve elsewhere than when the version was registered
        are not read at all (a file or the folder swapped for a symlink to one outside
        ``--adapter-root``), with one exception: a version registered through a symlink (``current ->
        rev1``, a release switch or git-sync; never an admin-loaded one, whose path is registered
        resolved) may be re-read from what that symlink points at now, if the files lie in that
        folder; its content must hash to the version as always."""
        try:
            path, files = self.registry.path_of(ref), self.registry.files_of(ref)
        except KeyError:
            raise AdapterError(f"adapter {ref.name!r} (version {ref.version[:12]}) is no longer registered") from None
        try:
            now = resolved_files(path)
            through_symlink = bool(files) and str(Path(path).absolute()) != files[0]  # a pointer meant to move
            repointed = through_symlink and all(Path(now[0]) in Path(f).parents for f in now[1:])
            moved = now != files and not repointed
        except (OSError, RuntimeError, ValueError):  # a symlink loop, or a path no longer usable
            moved = True
        moved_error = AdapterPathError(f"{path}: the adapter's files resolve to other paths than when it was registered (version "
                                       f"{ref.version[:12]}); nothing was read; register it again to serve what is there now")  # fmt: skip
        if files and moved:
            logger.warning("adapter %r (version %s): not re-read from %s: its files resolve elsewhere than %s", ref.name, ref.version[:12], path, files)
            raise moved_error

        def approve(_folder: Path, read: tuple[str, ...]) -> None:  # the loader's own resolution must be the one checked here
            if files and read != now:
                logger.warning("adapter %r (version %s): not re-read from %s: its files moved to %s after the check", ref.name, ref.version[:12], path, read)
                raise moved_error

        try:
            adapter = load_adapter(path, ref.name, self._targets, num_layers=self._num_layers, max_lora_rank=self.config.max_lora_rank,
                                   approve_files=approve)  # fmt: skip
        except AdapterPathError as err:  # refused before anything was read: its message quotes nothing from the files
            if err is not moved_error:
                logger.warning("adapter %r (version %s): not re-read from %s: %s", ref.name, ref.version[:12], path, err)
            raise
        except AdapterError as err:  # it loaded when registered: its files changed (or went) since
            logger.warning("adapter %r (version %s): re-reading %s failed: %s", ref.name, ref.version[:12], path, err)
            raise AdapterError(f"{path}: the adapter changed on disk since it was registered (version {ref.version[:12]}) and no "
                               f"longer loads (the log has why: a WARNING from runtime.engine); register it again to serve the new content") from None
        if adapter.version != ref.version:
            raise AdapterError(
                f"{path}: the adapter changed on disk since it was registered (registered version {ref.version[:12]}, "
                f"found {adapter.version[:12]}); register it again to serve the new content"
            )
        return adapter

    # ---- requests ---------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | Seq[int],
        params: Optional[SamplingParams] = None,
        adapter: Optional[str] = None,
    ) -> None:
        """Validate and queue a request; raises at once for anything that can never be served."""
        self.add_checked(self.check_request(request_id, prompt, params, adapter))

    def check_request(
        self,
        request_id: str,
        prompt: str | Seq[int],
        params: Optional[SamplingParams] = None,
        adapter: Optional[str] = None,
    ) -> CheckedRequest:
        """Every check ``add_request`` makes, with nothing queued or held: raises what it would
        raise. ``add_checked`` then queues the result, as long as nothing was added or
        registered in between (a caller that holds the engine's lock across both: a group of
        requests is checked whole before any of it is queued)."""
        self._check_open()
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id: must be a non-empty string, got {request_id!r}")
        self._refuse_in_flight(request_id)
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params: expected SamplingParams, got {type(params).__name__}")
        for name, ids in (("logit_bias", [t for t, _ in params.logit_bias]), ("stop_token_ids", params.stop_token_ids)):
            outside = [t for t in ids if t >= self._vocab_size]
            if outside:  # the sampler indexes logits with them (logit_bias, min_tokens)
                raise ValueError(f"{name}: token ids {outside[:4]} are outside the model's vocabulary (size {self._vocab_size})")
        if params.min_tokens > 0 and self._holds_back_every_token(params):
            raise ValueError(f"min_tokens: the stop_token_ids and eos ids it holds back cover the whole vocabulary (size {self._vocab_size}); nothing could be sampled")
        if isinstance(prompt, (list, tuple)):  # refused at its length before every id is checked (under the engine's lock)
            self._check_prompt_length(len(prompt), params)
        prompt_ids = self._prompt_ids(prompt)
        n = len(prompt_ids)
        self._check_prompt_length(n, params)
        # One request holds at most the whole pool, prompt + output, like max_model_len: the limit the
        # server's banner and its default max_tokens use. (The last sampled token never gets KV, so the
        # engine could run one token more; one number everywhere is worth that token.)
        pool_tokens = self.block_manager.num_blocks * self.config.block_size
        if n + params.max_tokens > pool_tokens:
            pool = f"the KV pool holds {pool_tokens} tokens ({self.block_manager.num_blocks} num_kv_blocks of {self.config.block_size})"
            if n > pool_tokens or (params.max_tokens > 0 and n == pool_tokens):
                raise RequestRejected(f"prompt: {n} tokens (+ at least 1 of output) do not fit one request, and {pool}")
            raise RequestRejected(f"max_tokens: prompt ({n} tokens) + max_tokens ({params.max_tokens}) = {n + params.max_tokens} tokens, but {pool}")
        ref = self.registry.resolve(adapter) if adapter is not None else None
        return CheckedRequest(request_id, prompt_ids, params, ref)

    def _check_prompt_length(self, n: int, params: SamplingParams) -> None:
        """PromptTooLongError unless a prompt of ``n`` tokens and ``params.max_tokens`` fit max_model_len."""
        if params.max_tokens == 0 and n > self.max_model_len:
            raise PromptTooLongError(f"prompt: {n} tokens; max_model_len is {self.max_model_len}")
        if params.max_tokens > 0 and n >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt: {n} tokens leave no room for output: max_model_len is {self.max_model_len} (prompt + output), "
                f"so a prompt has at most {self.max_model_len - 1}"
            )
        if n + params.max_tokens > self.max_model_len:
            raise PromptTooLongError(
                f"max_tokens: prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceeds max_model_len={self.max_model_len}"
            )

    def _refuse_in_flight(self, request_id: str) -> None:
        """An id stays taken until ``step()`` has returned its final output (an aborted request's
        comes with the next step), so no step returns two requests under one id."""
        if request_id in self._live or any(o.request_id == request_id for o in self._pending):
            raise ValueError(f"request_id: {request_id!r} is already in flight")

    def _holds_back_every_token(self, params: SamplingParams) -> bool:
        """Whether the ids ``min_tokens`` holds back (stop_token_ids, and eos unless ignored) cover the vocabulary."""
        held_back = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self._eos_ids))
        return sum(1 for t in held_back if 0 <= t < self._vocab_size) == self._vocab_size

    def add_checked(self, checked: CheckedRequest) -> None:
        """Queue a request ``check_request`` accepted (see there)."""
        self._check_open()
        request_id, prompt_ids, params, ref = checked
        self._refuse_in_flight(request_id)
        if ref is not None and not self.registry.known(ref):  # unregistered since the check, with no reader left
            raise UnknownAdapterError(f"adapter {ref.name!r}: version {ref.version[:12]} is no longer registered")
        seq = Sequence(
            request_id=request_id,
            arrival_index=next(self._arrivals),
            prompt_token_ids=prompt_ids,
            params=params,
            adapter=ref,
            arrival_time=time.monotonic(),
        )
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        detok = IncrementalDetokenizer(decode, params.stop, prompt_ids, params.include_stop_str_in_output, params.min_tokens)
        readers, demand = (self.registry.readers(ref), self.pool.demand_of(ref)) if ref is not None else (0, 0)
        try:
            if params.max_tokens > 0:  # a prompt-only request samples nothing: no generator, no seed drawn
                self.sampler.add(request_id, params)
            if ref is not None:
                self.registry.acquire(ref)
                seq.adapter_location = self.pool.demand(ref)
                if self.pool.weights_ready(ref):
                    seq.adapter_ready_time = seq.arrival_time
                else:
                    self._awaiting_adapter.add(seq)
            self._live[request_id] = _Live(seq, detok, prompt_token_ids=tuple(seq.prompt_token_ids))
            self.scheduler.add(seq)
        except BaseException:  # Ctrl-C half-way (nothing else raises here): nothing may hold a request that is not queued
            self._undo_add(seq, readers, demand)
            raise

    def _undo_add(self, seq: Sequence, readers: int, demand: int) -> None:
        """Take back whatever ``add_checked`` took for ``seq`` before it was interrupted; ``readers``
        and ``demand``: its adapter's counts before it started."""
        live = self._live.get(seq.request_id)
        if live is not None and live.seq is seq:
            del self._live[seq.request_id]
        self.scheduler.remove(seq)
        self._awaiting_adapter.discard(seq)
        self.sampler.remove(seq.request_id)
        if seq.adapter is not None:
            if self.pool.demand_of(seq.adapter) > demand:
                self.pool.undemand(seq.adapter)
            if self.registry.readers(seq.adapter) > readers:
                self.registry.release(seq.adapter)

    def _warn_tokenizer_vocab(self) -> None:
        """Warn (one line) when the tokenizer has more tokens, added ones included, than the
        model's ``vocab_size``.

        A warning, not a refusal: the mismatch breaks nothing by itself. The model never samples
        an id beyond its vocab, and a prompt is refused (``_prompt_ids``) only if it encodes to
        such an id, so checkpoints that ship unused extra added tokens still serve every other
        prompt.
        """
        size = self.tokenizer.vocab_size
        if size > self._vocab_size:
            logger.warning(
                "%s: the tokenizer has %d tokens (added tokens included) but the model's vocab_size is %d; "
                "prompts that encode to ids >= %d will be refused",
                self.model_name, size, self._vocab_size, self._vocab_size,
            )

    def encode_prompt(self, text: str) -> list[int]:
        """A text prompt's token ids, as ``add_request`` encodes it, each checked to be in the model's
        vocab (ValueError "prompt: ..." otherwise). Reads only the tokenizer: callers may run it
        outside the engine's lock (``AsyncLLMEngine.generate`` does for long prompts)."""
        try:
            ids = self.tokenizer.encode(text)
        except ValueError as err:
            raise ValueError(f"prompt: {err}") from None
        bad = sorted({t for t in ids if not 0 <= t < self._vocab_size})
        if bad:
            raise ValueError(
                f"prompt: encodes to token ids {bad[:4]} outside the model's vocab [0, {self._vocab_size}): "
                f"the checkpoint's tokenizer and model disagree on the vocabulary"
            )
        return ids

    def _prompt_ids(self, prompt: str | Seq[int]) -> list[int]:
        """The prompt's token ids; every id, given or encoded, must be in [0, vocab_size).

        Encoded ids are checked too: an added token beyond the model's vocab would otherwise
        reach the model runner, raise inside ``step()`` and fail every request in flight.
        """
        if isinstance(prompt, str):
            ids = self.encode_prompt(prompt)
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
            bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self._vocab_size]
            if bad:
                raise ValueError(f"prompt: token ids {bad[:4]} are not integers in [0, {self._vocab_size})")
        else:
            raise ValueError(f"prompt: expected a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt: empty (it must have at least one token)")
        return ids

    def abort(self, request_id: str) -> bool:
        """Stop a request and release everything it holds; False if it is not in flight. The
        next step returns its final output (finish_reason "abort"); ``drop_pending`` forgets it
        when nobody is listening any more."""
        live = self._live.get(request_id)
        if live is None:
            return False
        self._finish(live, "abort", None)
        self._pending.append(self._output(live, [], finished=True))
        return True

    def drop_pending(self, request_ids: Seq[str]) -> None:
        """Forget outputs not yet returned for these requests (their caller stopped listening,
        e.g. after a step failed with the requests' final outputs already made)."""
        gone = set(request_ids)
        self._pending = [o for o in self._pending if o.request_id not in gone]

    def fail_all(self, message: str, error_kind: ErrorKind = "engine") -> list[RequestOutput]:
        """Finish every request in flight with finish_reason "error" (engine failure, or "shutdown")."""
        outputs, self._pending = self._pending, []
        for live in list(self._live.values()):
            self._finish(live, "error", message, error_kind)
            outputs.append(self._output(live, [], finished=True))
        return outputs

    def stop_adapter_loads(self) -> list[Any]:
        """No new disk reads of adapters; those queued are cancelled (``AdapterPool.stop_loads``).
        Returns the futures of those still going, for a caller to wait on (``close`` gives up on
        them). For a caller about to ``close``: nothing that needs a read can run any more."""
        self.pool.stop_loads()
        return [future for future in self.pool.load_futures() if not future.done()]

    def stalled_load_futures(self) -> list[Any]:
        """The in-flight adapter loads the last step was stalled on ([] if it ran something)."""
        return self.pool.load_futures() if self._stalled else []

    def has_unfinished(self) -> bool:
        return bool(self._live) or bool(self._pending)

    def add_observer(self, callback: Callable[[RequestMetrics], None]) -> None:
        self._observers.append(callback)

    # ---- the step ----------------------------------------------------------------------------
    def step(self, wait_for_loads: bool = True) -> list[RequestOutput]:
        """One engine step. When nothing can run until an adapter load finishes, it waits for
        one (up to 1 s) unless ``wait_for_loads`` is False: then ``stalled_load_futures`` tells
        the caller what to wait on (AsyncLLMEngine waits without holding its lock).

        If the step raises, the outputs it had made (requests it finished, aborts before it)
        are kept for the next ``step`` or ``fail_all``, so no finished request loses its end."""
        self._check_open()
        outputs, self._pending = self._pending, []
        try:
            return self._step(outputs, wait_for_loads)
        except BaseException:
            self._pending = outputs + self._pending
            raise

    def _step(self, outputs: list[RequestOutput], wait_for_loads: bool) -> list[RequestOutput]:
        for failure in self.pool.poll():
            for live in [l for l in self._live.values() if l.seq.adapter == failure.ref]:
                self._finish(live, "error", failure.message)
                outputs.append(self._output(live, [], finished=True))
        if self._awaiting_adapter:
            now = time.monotonic()
            for seq in [s for s in self._awaiting_adapter if self.pool.weights_ready(s.adapter)]:
                seq.adapter_ready_time = now
                self._awaiting_adapter.discard(seq)
        sched = self.scheduler.schedule()
        self._stalled = not sched.chunks and self.scheduler.has_unfinished() and self.pool.loads_pending
        if not sched.chunks:
            if self._stalled and wait_for_loads:
                self.pool.wait_for_load(timeout=1.0)  # nothing runnable until an adapter arrives
            return outputs
        self.steps += 1
        now = time.monotonic()
        steps: list[SeqStep] = []
        slots: set[int] = set()
        for chunk in sched.chunks:
            seq = chunk.seq
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
            slot = -1
            if seq.adapter is not None:
                slot = self.pool.slot_of(seq.adapter)
                if slot is None:
                    raise AssertionError(f"{seq.request_id}: adapter {seq.adapter} was scheduled without a device slot")
                slots.add(slot)
            tokens = seq.token_ids_between(seq.num_computed, seq.num_computed + chunk.num_tokens)
            score_all = seq.wants_prompt_logits and seq.num_computed < len(seq.prompt_token_ids) - 1
            steps.append(SeqStep(tokens, seq.num_computed, self.block_manager.table(seq.request_id), slot, chunk.sample, score_all))
        self.pool.fence(sorted(slots))
        all_logits = self.runner.execute(steps)
        logits = self._collect_prompt_logprobs(sched.chunks, steps, all_logits)
        sampled = [c.seq for c in sched.chunks if c.sample]
        prompt_only = [s for s in sampled if s.params.max_tokens == 0]  # their prompt is computed (and scored): done
        if prompt_only:
            keep = [i for i, s in enumerate(sampled) if s.params.max_tokens > 0]
            logits, sampled = logits[keep], [sampled[i] for i in keep]
        sampled_params = [s.params for s in sampled]
        histories = [(s.prompt_token_ids, s.output_token_ids) for s in sampled] if any(p.adjusts_logits for p in sampled_params) else None
        tokens = self.sampler.sample(logits, [s.request_id for s in sampled], sampled_params, histories)
        token_logprobs = self.sampler.logprobs(logits, tokens, sampled_params)
        for chunk in sched.chunks:
            seq = chunk.seq
            seq.num_computed += chunk.num_tokens
            if self.block_manager.has_blocks_to_commit(seq.request_id, seq.num_computed):  # the token list only when a block filled
                self.block_manager.commit(seq.request_id, seq.all_token_ids, seq.num_computed)
        now = time.monotonic()
        for seq in prompt_only:
            live = self._live[seq.request_id]
            self._finish(live, "length", None)
            outputs.append(self._output(live, [], finished=True))
        for seq, token, token_lp in zip(sampled, tokens, token_logprobs):
            live = self._live[seq.request_id]
            if isinstance(token, NoToken):  # nothing to sample from in this row
                self._finish(live, "error", token.reason, token.kind)
                outputs.append(self._output(live, [], finished=True))
                continue
            seq.output_token_ids.append(token)
            if token_lp is not None:
                seq.output_logprobs.append(token_lp)
            if seq.first_token_time is None:
                seq.first_token_time = now
            seq.last_token_time = now
            reason = token_stop_reason(token, len(seq.output_token_ids), seq.params, self._eos_ids)
            text_ids = seq.output_token_ids
            if reason == "stop" and not seq.params.include_stop_str_in_output:
                text_ids = text_ids[:-1]  # the stopping token (eos or a stop id) is not part of the text, unless asked for (vLLM)
            live.detok.add_tokens(text_ids)
            if reason is not None:
                live.detok.finish_pending(text_ids)
            if live.detok.stopped:
                reason = "stop"
            if reason is not None:
                self._finish(live, reason, None)
            outputs.append(self._output(live, seq.output_token_ids[live.emitted_tokens :], finished=reason is not None))
            live.emitted_tokens = len(seq.output_token_ids)
        self.pool.prefetch(self.scheduler.waiting_adapters(self.config.max_loras))
        return outputs

    def _collect_prompt_logprobs(self, chunks: Seq[Any], steps: Seq[SeqStep], logits: torch.Tensor) -> torch.Tensor:
        """Record the prompt logprobs of ``score_all`` steps; returns the sampled rows' logits.

        A chunk at positions s .. e-1 of a prompt of P tokens gives row p (position p) the
        entry of prompt token p + 1 for p + 1 < P; the row of position P - 1 is the sampling row."""
        if not any(step.score_all for step in steps):
            return logits
        sample_rows, targets = [], []
        row = 0
        for chunk, step in zip(chunks, steps):
            if step.score_all:
                seq = chunk.seq
                prompt = seq.prompt_token_ids
                for p in range(max(step.start_pos, len(seq.prompt_logprobs)), min(step.end_pos, len(prompt) - 1)):
                    targets.append((seq, row + p - step.start_pos, prompt[p + 1]))  # a recompute skips what it has
            if step.sample:
                sample_rows.append(row + step.logit_rows - 1)
            row += step.logit_rows
        entries = token_logprobs(logits, [t for _, _, t in targets], [s.params.prompt_logprobs for s, _, _ in targets], [r for _, r, _ in targets])
        for (seq, _, _), entry in zip(targets, entries):
            seq.prompt_logprobs.append(entry)
        return logits[sample_rows]

    def _output(self, live: _Live, new_tokens: list[int], finished: bool) -> RequestOutput:
        seq = live.seq
        delta = live.detok.take_delta(finished)
        return RequestOutput(
            request_id=seq.request_id,
            adapter=seq.adapter,
            new_token_ids=tuple(new_tokens),
            new_text=delta,
            token_ids=tuple(seq.output_token_ids),
            text=live.detok.emitted_text,
            finished=finished,
            finish_reason=seq.finish_reason if finished else None,
            error=seq.error,
            error_kind=seq.error_kind,
            prompt_token_ids=live.prompt_token_ids,
            logprobs=tuple(seq.output_logprobs) if seq.params.logprobs is not None else None,
            prompt_logprobs=live.prompt_logprobs_out(),
        )

    def _finish(self, live: _Live, reason: str, error: Optional[str], error_kind: ErrorKind = "engine") -> None:
        seq = live.seq
        seq.finish_reason = reason  # type: ignore[assignment]
        seq.error = error
        seq.error_kind = error_kind if error is not None else None
        seq.finished_time = time.monotonic()
        held = (self.pool.demand_of(seq.adapter), self.registry.readers(seq.adapter)) if seq.adapter is not None else (0, 0)
        try:
            self._release(seq, *held)
        except BaseException as err:
            if not isinstance(err, Exception):  # Ctrl-C half-way (LLM.generate then aborts what is in flight): finish first, so nothing is released twice
                self._release(seq, *held)
            raise
        metrics = RequestMetrics.of(seq)
        key = seq.adapter.name if seq.adapter is not None else ""
        self._request_counters.setdefault(key, AdapterRequestCounters()).record(metrics)
        for observer in self._observers:
            try:
                observer(metrics)
            except Exception:  # noqa: BLE001 - a metrics bug must not fail the request or the engine
                logger.exception("request observer %r failed on %s", observer, seq.request_id)

    def _release(self, seq: Sequence, demand: int, readers: int) -> None:
        """Give back what a finishing ``seq`` holds and take it out of flight. Safe to run again
        after an interruption: its adapter's demand and reader are each given back only while the
        count still has its value from before (``demand``, ``readers``); the rest is idempotent
        (an interruption inside ``scheduler.remove`` or ``undemand`` may still leave part of theirs held)."""
        self.scheduler.remove(seq)
        self._awaiting_adapter.discard(seq)
        if seq.adapter is not None:
            if self.pool.demand_of(seq.adapter) == demand:
                self.pool.undemand(seq.adapter)
            if self.registry.readers(seq.adapter) == readers:
                self.registry.release(seq.adapter)
        self.sampler.remove(seq.request_id)
        self._live.pop(seq.request_id, None)

    # ---- reporting -----------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        pool = self.pool.snapshot()
        per_adapter: dict[str, dict[str, Any]] = {}
        for name, c in self._request_counters.items():
            per_adapter.setdefault(name, {}).update(vars(c))
        for name, c in self.pool.counters.items():
            per_adapter.setdefault(name, {}).update(vars(c))
        cache = self.block_manager.prefix_cache
        return {
            "running": self.scheduler.num_running,
            "waiting": self.scheduler.num_waiting,
            "kv_blocks_total": self.block_manager.num_blocks,
            "kv_blocks_free": self.block_manager.num_free_blocks,
            "kv_block_refcount_total": self.block_manager.total_refcount,
            "preemptions": self.scheduler.num_preemptions,
            "prefix_cache_hit_blocks": cache.hit_blocks if cache is not None else 0,
            "prefix_cache_queried_blocks": cache.queried_blocks if cache is not None else 0,
            "pool": pool,
            "pool_device_bytes_in_use": pool["device_bytes_in_use"],
            "pool_device_bytes_capacity": pool["device_bytes_capacity"],
            "pool_device_bytes_if_padded": pool["device_bytes_if_padded"],
            "host_entries": pool["host_entries"],
            "host_bytes_in_use": pool["host_bytes_in_use"],
            "host_bytes_capacity": pool["host_bytes_capacity"],
            "total_refcounts": {"adapter_demand": pool["total_demand"], "adapter_device_refs": pool["total_device_refs"]},
            "adapters": per_adapter,
            "steps": self.steps,
        }

    def fold_adapter_counters(self, names: Iterable[str]) -> None:
        """Fold the per-adapter counters of those of ``names`` not registered now into one entry,
        ``snapshot()["adapters"]["__other__"]`` (each field summed: no total changes).

        The counter tables are keyed by adapter name, so every name ever served kept an entry
        (~400 bytes, and a row each snapshot copies under the engine lock) through any number of
        load/unload cycles of distinct names. /metrics passes the names it counts under
        ``adapter="__other__"`` already (past its label cap: ``ServerMetrics``), so no exported
        series changes, and the tables keep the labelled adapters, the registered ones and those
        used since the last scrape. A folded name that comes back gets a fresh entry."""
        registered = {info.name for info in self.registry.infos()}
        for name in names:
            if name in registered or name in ("", BASE_LABEL, OTHER_LABEL):
                continue
            for table, empty in ((self._request_counters, AdapterRequestCounters), (self.pool.counters, AdapterCounters)):
                entry = table.pop(name, None)
                if entry is not None:
                    total = table.setdefault(OTHER_LABEL, empty())
                    for f in fields(entry):
                        setattr(total, f.name, getattr(total, f.name) + getattr(entry, f.name))

    def close(self, timeout: Optional[float] = None) -> None:
        """Stop the pool's loader and free the model, KV cache and LoRA buffers now. Idempotent.

        The engine, its pool and their callbacks form reference cycles, so without the
        explicit release their memory (~0.8 GB for the serving benchmark's small model)
        would stay until Python's cycle collector happened to run. Afterwards a request, a
        step or an adapter change is a RuntimeError (as for a closed ``LLM``); ``abort``,
        ``drop_pending``, ``fail_all`` and the reports still answer.

        The loader's queued disk reads are cancelled and the one running is waited for, up to
        ``timeout`` s (None: until it ends; ``AsyncLLMEngine.shutdown`` passes what is left of its
        deadline). A read cannot be interrupted: one still going then (an adapter file on a hung
        network mount) is left to the loader's daemon thread, which cannot hold the process's
        exit, its outcome dropped; a WARNING names it. The model, KV cache and LoRA buffers are
        released either way (the engine object itself, with its host tier of adapters, stays
        referenced by that read until it ends).

        ``timeout`` must be None or a number of seconds >= 0 (``math.inf``: as None), else ValueError
        and nothing is closed (``check_shutdown_seconds``).

        Thread-safe: one call tears down; a call made meanwhile from another thread waits for it,
        so either returns only once the memory is released (or the teardown raised). A call made
        from inside the teardown itself (a callback run by it, in the same thread) would wait for
        itself for ever: it raises RuntimeError instead."""
        if timeout is not None:
            check_shutdown_seconds(timeout=timeout)
            if math.isinf(timeout):
                timeout = None  # a wait for ever: what None means (an infinite one overflows the platform's timeout)
        if self._tearing_down == threading.get_ident():
            raise RuntimeError("LLMEngine.close: called again from inside its own teardown (in the same thread), "
                               "which would wait for itself for ever")
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            self._tearing_down = threading.get_ident()
            try:
                left = self.pool.close(timeout)
                self.runner.release()
            finally:
                self._tearing_down = None
        if left:
            logger.warning("engine closed without waiting for %d adapter read(s) from disk still going after %s s, which cannot be "
                           "interrupted: %s", len(left), timeout, ", ".join(left))

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("LLMEngine: closed; create a new LLMEngine")
