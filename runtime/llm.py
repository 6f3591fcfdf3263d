"""Offline API: ``LLM(model, adapters={...}).generate(prompts, params, adapter=[...])``.

Runs every prompt through one ``LLMEngine`` with continuous batching, so a mixed list
of adapters is served in shared steps, and returns results in the order of the prompts.

A request that fails in the engine (its adapter's files could not be read, non-finite
logits) makes ``generate`` raise ``GenerationError`` once every prompt has finished; the
error carries all results, so the good ones are not lost. ``raise_on_error=False`` returns
the results instead, failures with ``finish_reason == "error"`` and ``error`` set.

``LLM`` holds the model, the KV cache and a loader thread: ``close()`` (or ``with LLM(...)
as llm:``) releases them at once instead of whenever the garbage collector runs.
"""
from __future__ import annotations

import numbers
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

from runtime.config import EngineConfig
from runtime.engine import LLMEngine, check_adapter_name
from runtime.lora.adapter import check_adapter_folder, check_adapter_path_type
from runtime.progress_bar import ProgressBar
from runtime.request import SamplingParams, TokenLogprobs
from runtime.shutdown_seconds import check_shutdown_seconds

Prompt = Union[str, Sequence[int]]


@dataclass(frozen=True)
class CompletionResult:
    text: str
    token_ids: tuple[int, ...]
    finish_reason: Optional[str]
    adapter: Optional[str]
    prompt_token_ids: tuple[int, ...] = ()
    error: Optional[str] = None
    logprobs: Optional[tuple[TokenLogprobs, ...]] = None  # one per token id, with SamplingParams(logprobs=k)
    prompt_logprobs: Optional[tuple[Optional[TokenLogprobs], ...]] = None  # one per prompt token (None first), with prompt_logprobs=k


class GenerationError(RuntimeError):
    """Some requests of a ``generate`` call failed; ``results`` holds every prompt's result, in order."""

    def __init__(self, results: list[CompletionResult]) -> None:
        failed = [(i, r) for i, r in enumerate(results) if r.finish_reason == "error"]
        lines = "; ".join(f"prompts[{i}] (adapter {r.adapter!r}): {r.error}" for i, r in failed[:3])
        more = f"; and {len(failed) - 3} more" if len(failed) > 3 else ""
        super().__init__(f"{len(failed)} of {len(results)} requests failed: {lines}{more} "
                         "(generate(..., raise_on_error=False) returns the results instead)")  # fmt: skip
        self.results = results

    def __reduce__(self) -> tuple[type, tuple[list[CompletionResult]]]:
        # Rebuilt from the results, not from the message (Exception's default): a GenerationError
        # raised in a worker process (multiprocessing, concurrent.futures, Ray) reaches the caller.
        return (GenerationError, (self.results,))


class LLM:
    """One base model plus named LoRA adapters, for batch generation in-process.

    ``device``: "auto" (the default, as for ``lorafleet serve``) picks cuda, then npu, then cpu.
    ``adapters``: name -> PEFT adapter folder; names and folders are checked before the model
    loads, the adapters' contents once it has (a ValueError starting ``adapters[name]`` or naming the file;
    a folder given as neither a str nor an ``os.PathLike``: a TypeError, as from ``register_adapter``).
    One call at a time: calls from several threads take turns (``close()`` waits for a running
    ``generate()``); for concurrent serving use ``AsyncLLMEngine``.
    """

    def __init__(
        self,
        model: str,
        adapters: Optional[Mapping[str, str]] = None,
        device: str = "auto",
        dtype: str = "float32",
        **engine_config: Any,
    ) -> None:
        folders = _check_adapters(adapters)  # before the model loads: a typo must not cost a model load
        # from_dict rejects unknown keys with the list of known ones.
        config = EngineConfig.from_dict({"model": str(model), "device": device, "dtype": dtype, **engine_config})
        self.engine = LLMEngine(config)
        try:
            for name, path in folders.items():
                self.engine.register_adapter(name, path)
        except BaseException:
            self.engine.close()  # a half-built LLM must not keep the model and the loader thread alive
            raise
        self._next_id = 0
        self._turn = threading.Lock()  # one call into the engine at a time
        self._closed = False

    def close(self, timeout: Optional[float] = None) -> None:
        """Release the engine (model weights, KV cache, adapter loader thread), as ``LLMEngine.close``.

        ``timeout``: how long to wait for an adapter read from disk still running (None, the
        default, or ``math.inf``: until it ends). A read cannot be interrupted: one still going
        then (a hung network mount) is left to the loader's daemon thread, which cannot hold the
        process's exit, with a WARNING; the model and KV cache are released either way. It must be
        None or a number of seconds >= 0, else ValueError and nothing is closed. Waits for a
        ``generate`` running in another thread first (one call at a time)."""
        if timeout is not None:
            check_shutdown_seconds(timeout=timeout)  # before the wait for a running call: a typo must not wait for it
        with self._turn:
            self._closed = True
            self.engine.close(timeout)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("LLM: closed; create a new LLM")

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def register_adapter(self, name: str, path: Union[str, os.PathLike[str]]) -> None:
        """Serve the PEFT adapter at ``path`` as ``name`` (a new version of it if the name exists);
        ``path`` neither a str nor an ``os.PathLike``: a TypeError."""
        check_adapter_path_type(path)  # before str(): None is no folder named "None"
        with self._turn:
            self._check_open()
            self.engine.register_adapter(name, str(path))

    def unregister_adapter(self, name: str) -> None:
        """Stop serving ``name``: later requests for it raise ``UnknownAdapterError`` (none are in flight
        between ``generate`` calls)."""
        with self._turn:
            self._check_open()
            self.engine.unregister_adapter(name)

    def generate(
        self,
        prompts: Union[Prompt, Sequence[Prompt]],
        params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        adapter: Union[str, None, Sequence[Optional[str]]] = None,
        raise_on_error: bool = True,
        use_tqdm: Optional[bool] = None,
    ) -> list[CompletionResult]:
        """Generate for every prompt; ``params`` and ``adapter`` are one value or a list with one per prompt.

        Raises ``GenerationError`` (holding every result) if any request failed, unless
        ``raise_on_error`` is False. A request that can never be served (too long, an unknown
        adapter, a bad parameter) is a ``ValueError`` naming it (``prompts[i]: ...``) before any
        runs: none of the batch is generated. ``use_tqdm``: a progress bar on stderr, one step per
        finished prompt (as vLLM's ``LLM.generate``); None (the default): only when stderr is a terminal.
        """
        if not isinstance(raise_on_error, bool):
            raise ValueError(f"raise_on_error: expected True or False, got {raise_on_error!r}")
        if use_tqdm is not None and not isinstance(use_tqdm, bool):
            raise ValueError(f"use_tqdm: expected True, False or None, got {use_tqdm!r}")
        with self._turn:
            self._check_open()
            return self._generate(prompts, params, adapter, raise_on_error, use_tqdm)

    def _generate(
        self,
        prompts: Union[Prompt, Sequence[Prompt]],
        params: Union[SamplingParams, Sequence[SamplingParams], None],
        adapter: Union[str, None, Sequence[Optional[str]]],
        raise_on_error: bool,
        use_tqdm: Optional[bool],
    ) -> list[CompletionResult]:
        batch = _as_prompt_list(prompts)
        n = len(batch)
        param_list = _broadcast(params if params is not None else SamplingParams(), n, "params", SamplingParams, "a SamplingParams")
        adapter_list = _broadcast(adapter, n, "adapter", (str, type(None)), "an adapter name (str) or None")
        # Every prompt is checked before any is added, so a refused batch leaves no trace: no
        # request queued and aborted, no seed drawn, no adapter read started, nothing in the metrics.
        checked = []
        for i, (prompt, p, a) in enumerate(zip(batch, param_list, adapter_list)):
            try:
                checked.append(self.engine.check_request(f"llm-{self._next_id + i}", prompt, p, a))
            except ValueError as err:
                raise type(err)(f"prompts[{i}]: {err}") from err
        self._next_id += n
        ids: list[str] = []
        try:
            for request in checked:
                ids.append(request.request_id)  # before it is added: an interrupt right after the add still aborts it below
                self.engine.add_checked(request)
            results: dict[str, CompletionResult] = {}
            wanted = set(ids)
            with ProgressBar(n, "generate", "prompt", enabled=use_tqdm) as bar:
                while len(results) < n:
                    for out in self.engine.step():
                        if out.finished and out.request_id in wanted:
                            bar.update(1)
                            results[out.request_id] = CompletionResult(
                                text=out.text,
                                token_ids=out.token_ids,
                                finish_reason=out.finish_reason,
                                adapter=out.adapter.name if out.adapter is not None else None,
                                prompt_token_ids=out.prompt_token_ids,
                                error=out.error,
                                logprobs=out.logprobs,
                                prompt_logprobs=out.prompt_logprobs,
                            )
        except BaseException:
            for request_id in ids:  # leave the engine clean for the next call (nobody reads their outputs)
                self.engine.abort(request_id)
            self.engine.drop_pending(ids)  # their abort outputs, and final outputs a failed step had already made
            raise
        ordered = [results[r] for r in ids]
        if raise_on_error and any(r.finish_reason == "error" for r in ordered):
            raise GenerationError(ordered)
        return ordered


def _check_adapters(adapters: Optional[Mapping[str, Any]]) -> dict[str, str]:
    """``adapters={name: folder}`` as name -> folder (str), every name and folder checked as far as
    that needs no model and no file read (``check_adapter_name``, ``check_adapter_path_type``,
    ``check_adapter_folder``); an error (a TypeError for a name that is no str or a folder that is
    no str or path, else a ValueError) starts with ``adapters[name]``."""
    if adapters is None:
        return {}
    if not isinstance(adapters, Mapping):
        raise ValueError(f"adapters: expected a mapping of name -> adapter folder, got {type(adapters).__name__}")
    folders = {}
    for name, path in adapters.items():
        try:
            check_adapter_name(name)
            check_adapter_path_type(path)
            check_adapter_folder(Path(path))
        except (ValueError, TypeError) as err:
            raise type(err)(f"adapters[{name!r}]: {err}") from None
        folders[name] = str(path)
    return folders


def _as_prompt_list(prompts: Union[Prompt, Sequence[Prompt]]) -> list[Prompt]:
    """A string, a list of token ids, or a list/tuple of those; anything else (a number, None,
    bytes, a dict, a set) is a ValueError rather than being iterated into something else."""
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts: expected a string, a list of token ids, or a list of those, got {type(prompts).__name__}")
    items = list(prompts)
    if items and all(_is_token_id(t) for t in items):
        return [[int(t) for t in items]]  # one pre-tokenised prompt (numpy integers become ints)
    if any(_is_token_id(t) for t in items):
        first = next(i for i, t in enumerate(items) if not _is_token_id(t))
        raise ValueError(f"prompts: a list of token ids must hold integers only; item {first} is {type(items[first]).__name__} "
                         f"(several prompts: pass a list of strings or of token-id lists)")  # fmt: skip
    for i, item in enumerate(items):
        if not isinstance(item, (str, list, tuple)):
            raise ValueError(f"prompts[{i}]: expected a string or a list of token ids, got {type(item).__name__}")
        if not isinstance(item, str):
            items[i] = [int(t) if _is_token_id(t) else t for t in item]  # the engine says which id is wrong
    return items


def _is_token_id(value: object) -> bool:
    """An integer (numpy's too), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _broadcast(value: Any, n: int, name: str, kind: Any, what: str) -> list[Any]:
    """One ``value`` for every prompt, or a list/tuple with one per prompt."""
    if isinstance(value, kind):
        return [value] * n
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name}: expected {what} or a list of them (one per prompt), got {type(value).__name__}")
    values = list(value)
    if len(values) != n:
        raise ValueError(f"{name}: got {len(values)} values for {n} prompts")
    for i, v in enumerate(values):
        if not isinstance(v, kind):
            raise ValueError(f"{name}[{i}]: expected {what}, got {type(v).__name__}")
    return values
