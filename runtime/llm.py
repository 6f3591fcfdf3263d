"""Offline API: ``LLM(model, adapters={...}).generate(prompts, params, adapter=[...])``.

Runs every prompt through one ``LLMEngine`` with continuous batching, so a mixed list
of adapters is served in shared steps, and returns results in the order of the prompts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Union

from runtime.config import EngineConfig
from runtime.engine import LLMEngine
from runtime.request import SamplingParams

Prompt = Union[str, Sequence[int]]


@dataclass(frozen=True)
class CompletionResult:
    text: str
    token_ids: tuple[int, ...]
    finish_reason: Optional[str]
    adapter: Optional[str]
    prompt_token_ids: tuple[int, ...] = ()
    error: Optional[str] = None


class LLM:
    """One base model plus named LoRA adapters, for batch generation in-process."""

    def __init__(
        self,
        model: str,
        adapters: Optional[Mapping[str, str]] = None,
        device: str = "cpu",
        dtype: str = "float32",
        **engine_config: Any,
    ) -> None:
        # from_dict rejects unknown keys with the list of known ones.
        config = EngineConfig.from_dict({"model": str(model), "device": device, "dtype": dtype, **engine_config})
        self.engine = LLMEngine(config)
        for name, path in (adapters or {}).items():
            self.engine.register_adapter(name, str(path))
        self._next_id = 0

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def register_adapter(self, name: str, path: str) -> None:
        self.engine.register_adapter(name, str(path))

    def generate(
        self,
        prompts: Union[Prompt, Sequence[Prompt]],
        params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        adapter: Union[str, None, Sequence[Optional[str]]] = None,
    ) -> list[CompletionResult]:
        """Generate for every prompt; ``params`` and ``adapter`` are one value or one per prompt."""
        batch = _as_prompt_list(prompts)
        n = len(batch)
        param_list = _broadcast(params if params is not None else SamplingParams(), n, "params", SamplingParams)
        adapter_list = _broadcast(adapter, n, "adapter", (str, type(None)))
        ids: list[str] = []
        try:
            for i, (prompt, p, a) in enumerate(zip(batch, param_list, adapter_list)):
                request_id = f"llm-{self._next_id}"
                self._next_id += 1
                try:
                    self.engine.add_request(request_id, prompt, p, a)
                except ValueError as err:
                    raise type(err)(f"prompts[{i}]: {err}") from err
                ids.append(request_id)
            results: dict[str, CompletionResult] = {}
            while len(results) < n:
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = CompletionResult(
                            text=out.text,
                            token_ids=out.token_ids,
                            finish_reason=out.finish_reason,
                            adapter=out.adapter.name if out.adapter is not None else None,
                            prompt_token_ids=out.prompt_token_ids,
                            error=out.error,
                        )
        except BaseException:
            for request_id in ids:  # leave the engine clean for the next call
                self.engine.abort(request_id)
            self.engine.step()  # drains the abort outputs
            raise
        return [results[r] for r in ids]


def _as_prompt_list(prompts: Union[Prompt, Sequence[Prompt]]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) and not isinstance(t, bool) for t in items):
        return [items]  # one pre-tokenised prompt
    for i, item in enumerate(items):
        if not isinstance(item, (str, list, tuple)):
            raise ValueError(f"prompts[{i}]: expected a string or a list of token ids, got {type(item).__name__}")
    return items


def _broadcast(value: Any, n: int, name: str, kind: Any) -> list[Any]:
    if isinstance(value, kind):
        return [value] * n
    values = list(value)
    if len(values) != n:
        raise ValueError(f"{name}: got {len(values)} values for {n} prompts")
    for i, v in enumerate(values):
        if not isinstance(v, kind):
            raise ValueError(f"{name}[{i}]: unexpected type {type(v).__name__}")
    return values
