"""Baseline (c): transformers + PEFT mixed-adapter ``generate(adapter_names=...)``.

Requests are taken in arrival order in batches of ``batch_size`` (PEFT batches
statically: a batch runs until its longest request is done). Each batch is
left-padded, every row generates exactly its own ``output_tokens`` (``min_new_tokens``
= ``max_new_tokens`` = the batch maximum; shorter rows' extra tokens are not counted).
Throughput = useful output tokens / wall time, after an untimed warm-up: one 2-token batch, or
with ``full_warmup`` the whole run once (what the engine gets off the CPU, where both stacks
have per-shape costs on first use, e.g. cuDNN's SDPA plans).
Arrival times are not replayed: this is the offline (all-requests-ready) throughput of
the peer.
"""
from __future__ import annotations

import multiprocessing
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from runtime.bench.replay import ReplayResult, RequestRecord


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def run_peft(model_dir: str | Path, adapters: Mapping[str, Path], requests: Sequence[Any], batch_size: int = 8, label: str = "transformers+peft",
             device: str = "cpu", dtype: str = "float32", full_warmup: bool = False) -> ReplayResult:  # fmt: skip
    """transformers + PEFT mixed-adapter ``generate`` in static batches of ``batch_size``, in ``dtype``
    (the same as the engine it is compared with); ``full_warmup``: the untimed warm-up is the whole run."""
    try:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as err:
        raise RuntimeError(f"the PEFT baseline needs transformers and peft (pip install 'lorafleet[test]'): {err}") from err
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    tok.padding_side = "left"
    if dtype not in DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=DTYPES[dtype]).to(device)
    used = sorted({r.adapter for r in requests if r.adapter is not None})
    model: Any = base
    if used:
        model = PeftModel.from_pretrained(base, str(adapters[used[0]]), adapter_name=used[0])
        for name in used[1:]:
            model.load_adapter(str(adapters[name]), adapter_name=name)
    model.eval()
    ordered = sorted(requests, key=lambda r: r.arrival_s)

    def generate(batch: Sequence[Any], n_new: int) -> int:
        """One static batch through ``generate``; the tokens it produced per row."""
        enc = tok([r.prompt for r in batch], return_tensors="pt", padding=True).to(device)
        kwargs: dict[str, Any] = dict(max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False, pad_token_id=tok.pad_token_id)
        if used:
            kwargs["adapter_names"] = [r.adapter or "__base__" for r in batch]
        generated = model.generate(**enc, **kwargs).shape[1] - enc["input_ids"].shape[1]
        if device != "cpu":
            torch.cuda.synchronize()
        return int(generated)

    batches = [ordered[i : i + batch_size] for i in range(0, len(ordered), batch_size)]
    with torch.inference_mode():  # untimed warm-up (first-call initialisation), as the engine's process is warm too
        for batch in batches if full_warmup else batches[:1]:
            generate(batch, max(r.output_tokens for r in batch) if full_warmup else 2)
    prompt_tokens = {r.index: len(tok(r.prompt)["input_ids"]) for r in ordered}  # counted for the report, outside the timed span
    records: list[RequestRecord] = []
    start = time.perf_counter()
    with torch.inference_mode():
        for batch in batches:
            generated = generate(batch, max(r.output_tokens for r in batch))
            t1 = time.perf_counter()
            for r in batch:
                # Counted as generated: a row gets its own output length only if generate really produced that many.
                rec = RequestRecord(r.index, r.adapter, r.arrival_s, prompt_tokens=prompt_tokens[r.index],
                                    output_tokens=min(r.output_tokens, generated))  # fmt: skip
                rec.latency = t1 - start
                records.append(rec)
    return ReplayResult(label, records, time.perf_counter() - start)


def run_peft_in_subprocess(model_dir: str | Path, adapters: Mapping[str, Path], requests: Sequence[Any], batch_size: int = 8,
                           label: str = "transformers+peft", device: str = "cpu", dtype: str = "float32",
                           full_warmup: bool = False) -> ReplayResult:  # fmt: skip
    """``run_peft`` in a freshly spawned process, so transformers' allocations and threads
    do not stay in the benchmark's process: engine runs after an in-process PEFT run were
    measured up to ~25% slower than before it (docs/benchmarks.md, "Serving benchmark")."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(run_peft, (str(model_dir), dict(adapters), list(requests), batch_size, label, device, dtype, full_warmup))
