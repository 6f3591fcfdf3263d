"""One `lorafleet merge` run: validate inputs, write into a staging folder, verify, publish.

Order (nothing is written before every input check has passed; nothing is published
before verification has passed):

1. base config (+ its quantization scheme), the adapter through the serving validator
   (``load_adapter``: shapes vs the base, DoRA and other unsupported features refused),
   output path checks (``staging.check_output``);
2. ``write_checkpoint`` into the staging folder (see merger.py for the math);
3. verification (verify.py) against the float dynamic reference, float base + float LoRA.
   With an int8 base that float base is the dequantized base ``q * s``, the float model the
   int8 checkpoint stands for, so each row isolates its own error source:

       dynamic: int8 base + float LoRA   int8 GEMM rounding only
       merged, float                     the float merge (+ the output dtype's rounding)
       merged, requantized int8          + requantizing W + delta onto a new int8 grid

4. manifest, then the staging folder is renamed to ``--out``.
"""
from __future__ import annotations

import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from backends import availability, resolve_name
from runtime.hub_hint import hub_download_hint
from runtime.lora.adapter import LoRAAdapter, load_adapter
from runtime.merge.manifest import MERGE_MANIFEST, base_record, merge_manifest, write_manifest
from runtime.merge.merger import DEFAULT_MAX_SHARD_BYTES, DTYPE_NAMES, MergeError, MergeSpec, WriteSummary, weights_sha256, write_checkpoint
from runtime.merge.report import ReportRow, format_report
from runtime.merge.staging import StagedOutput, check_output
from runtime.merge.verify import DEFAULT_NEW_TOKENS, VERIFY_PROMPTS, compare, prompt_ids, trace
from runtime.models.hf_config import load_model_config
from runtime.models.llama import lora_targets
from runtime.models.loader import DTYPES, base_dtype, check_checkpoint, check_tied_head, checkpoint_quantization
from runtime.quant.int8 import QUANTIZATION_CONFIG
from runtime.tokenizer import TokenizerError

MERGE_MAX_RANK = 4096  # merging has no slot pool, so no serving rank limit; this only bounds absurd configs
DEFAULT_THRESHOLD = 0.99


@dataclass(frozen=True)
class MergeOptions:
    model: str
    adapter: str
    out: str
    dtype: str | None = None  # None = the base checkpoint's dtype: config.json's, else its float tensors' (float32 for an int8 base)
    force: bool = False
    verify: bool = True
    threshold: float = DEFAULT_THRESHOLD
    adapter_name: str | None = None  # None = the adapter folder's name
    requantize: bool | None = None  # int8 base only; None = requantize
    new_tokens: int = DEFAULT_NEW_TOKENS
    device: str = "cpu"
    max_shard_bytes: int | None = None
    progress: bool = True


@dataclass(frozen=True)
class MergeResult:
    out: Path
    summary: WriteSummary
    rows: tuple[ReportRow, ...]
    report: str  # empty when verification was skipped
    passed: bool
    manifest: dict[str, Any]


class VerificationFailed(RuntimeError):
    """The merged output disagrees with the dynamic path more than the threshold allows; nothing was published."""

    def __init__(self, result: MergeResult) -> None:
        super().__init__(result.report)
        self.result = result


def run_merge(opts: MergeOptions) -> MergeResult:
    if not 0.0 <= opts.threshold <= 1.0:
        raise MergeError(f"--verify-threshold: {opts.threshold} must be between 0 and 1")
    model_dir = Path(opts.model)
    if not model_dir.is_dir():
        raise MergeError(f"{opts.model}: {'is not a folder' if model_dir.exists() else 'base model folder does not exist' + hub_download_hint(model_dir)}")
    cfg = load_model_config(model_dir)
    source_q = checkpoint_quantization(model_dir)
    if source_q is None and opts.requantize is not None:
        raise MergeError(
            f"--{'' if opts.requantize else 'no-'}requantize: {opts.model} is a float checkpoint; the option applies only to an "
            "int8 base (to get an int8 merged model, run `lorafleet quantize` on the merged output)"
        )
    requantize = source_q is not None and opts.requantize is not False
    files, _ = check_checkpoint(cfg, model_dir)  # names and shapes against config.json, as serving checks them
    check_tied_head(cfg, files)  # and a stored head that a tied config would hide: serving refuses it too
    name = opts.adapter_name or Path(opts.adapter).resolve().name
    adapter = load_adapter(opts.adapter, name, lora_targets(cfg), num_layers=cfg.num_hidden_layers, max_lora_rank=MERGE_MAX_RANK)
    dtype = DTYPES[_output_dtype(opts.dtype, base_dtype(cfg, files), source_q is not None)]
    out = check_output(opts.out, [opts.model, opts.adapter], opts.force)
    device = _verification_device(opts.device) if opts.verify else opts.device
    prompts = _verification_prompts(model_dir, opts.new_tokens, cfg.max_model_len) if opts.verify else []
    spec = MergeSpec(model_dir, adapter, dtype, quantize_output=requantize, max_shard_bytes=opts.max_shard_bytes or DEFAULT_MAX_SHARD_BYTES)
    staged = StagedOutput(out, opts.force)
    with staged as tmp:
        summary = write_checkpoint(spec, tmp, progress=opts.progress)
        rows: tuple[ReportRow, ...] = ()
        report = ""
        if opts.verify:
            rows = _verify(opts, spec, adapter, tmp, source_q is not None, prompts, device, out)
            reference = f"float base{' (dequantized int8)' if source_q else ''} + float LoRA, dynamic path; " \
                        f"{len(VERIFY_PROMPTS)} prompts x {opts.new_tokens} tokens, teacher-forced"  # fmt: skip
            report = format_report(reference, rows, opts.threshold)
        written = next((r for r in rows if r.written), None)
        passed = written is None or written.figures.agreement >= opts.threshold
        verification: dict[str, Any] = {"skipped": True}
        if rows:
            verification = {"threshold": opts.threshold, "passed": passed, "prompts": len(VERIFY_PROMPTS), "new_tokens": opts.new_tokens,
                             "rows": {r.label: r.figures.as_dict() for r in rows}}  # fmt: skip
        output = {"dtype": DTYPE_NAMES[dtype], "quantization": dict(QUANTIZATION_CONFIG) if requantize else None,
                  "flow": _flow(source_q is not None, requantize), "files": list(summary.files)}  # fmt: skip
        _say(opts, "hashing the base weights for the manifest")
        manifest = merge_manifest(base_record(cfg.name, model_dir, weights_sha256(model_dir), source_q), adapter, output, verification)
        result = MergeResult(out, summary, rows, report, passed, manifest)
        if not passed:
            raise VerificationFailed(result)
        write_manifest(tmp, MERGE_MANIFEST, manifest)
        staged.publish()
    return result


def _flow(source_quantized: bool, requantize: bool) -> str:
    if not source_quantized:
        return "float merge: W' = W + scale * B @ A in float32, cast to dtype"
    if requantize:
        return "dequantize (q * s) -> merge in float32 -> requantize to int8 (new per-output-channel scales)"
    return "dequantize (q * s) -> merge in float32 -> write float"


def _output_dtype(asked: str | None, checkpoint_dtype: str | None, source_quantized: bool) -> str:
    if asked is not None:
        if asked not in DTYPES:
            raise MergeError(f"--dtype: {asked!r} is not one of {', '.join(DTYPES)}")
        return asked
    if not source_quantized and checkpoint_dtype in DTYPES:
        return str(checkpoint_dtype)
    return "float32"


def _say(opts: MergeOptions, message: str) -> None:
    """A progress line on stderr for the stages without a progress bar (each loads or reads a whole model)."""
    if opts.progress:
        print(f"{message} ...", file=sys.stderr, flush=True)


def _verification_device(name: str) -> str:
    """The backend verification runs on (``auto``: cuda, npu, then cpu); an unavailable one is a MergeError."""
    try:
        resolved = resolve_name(name)
    except ValueError as err:
        raise MergeError(f"--device: {err}") from err
    ok, reason = availability(resolved)
    if not ok:
        raise MergeError(f"--device {name}: {reason}")
    return resolved


def _verification_prompts(model_dir: Path, new_tokens: int, max_positions: int) -> list[list[int]]:
    """The verification prompts as token ids, checked before anything is written: the base needs a
    tokenizer, and the longest prompt plus ``new_tokens`` must fit the model's positions."""
    try:
        prompts = prompt_ids(model_dir)
    except TokenizerError as err:
        raise MergeError(f"verification needs the base's tokenizer: {err}; pass --no-verify to merge without it") from err
    longest = max(len(p) for p in prompts)
    if longest + new_tokens > max_positions:
        raise MergeError(f"--verify-tokens {new_tokens}: with the longest verification prompt ({longest} tokens) it exceeds the "
                         f"model's {max_positions} positions; use at most {max_positions - longest}")  # fmt: skip
    return prompts


def _verify(opts: MergeOptions, spec: MergeSpec, adapter: LoRAAdapter, written: Path, source_quantized: bool,
            prompts: list[list[int]], device: str, out: Path) -> tuple[ReportRow, ...]:  # fmt: skip
    dtype_name = DTYPE_NAMES[spec.dtype]

    def run(what: str, model: Path, with_adapter: bool, forced: torch.Tensor | None = None):  # type: ignore[no-untyped-def]
        _say(opts, f"verifying on {device}: {what}, {len(prompts)} prompts x {opts.new_tokens} tokens")
        return trace(model, adapter if with_adapter else None, prompts, opts.new_tokens, forced, device)

    if not source_quantized:
        ref = run("reference (base + adapter, dynamic path)", spec.model_dir, True)
        return (ReportRow(f"merged, {dtype_name}", compare(ref, run("merged checkpoint", written, False, ref.tokens)), written=True),)
    # Scratch checkpoints live next to the output (same disk) and are removed on exit; named after --out,
    # so that a run killed meanwhile leaves a folder the next run into --out names (staging.leftover_scratch).
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.verify-", dir=out.parent) as scratch_root:
        scratch = Path(scratch_root)
        dequantized = scratch / "dequantized-base"
        dequantized.mkdir()
        _say(opts, f"writing a float32 dequantized copy of the int8 base for the reference (scratch: {scratch})")
        write_checkpoint(MergeSpec(spec.model_dir, None, torch.float32, quantize_output=False), dequantized, progress=False)
        ref = run("reference (dequantized base + adapter, dynamic path)", dequantized, True)
        rows = [ReportRow("dynamic: int8 base + float LoRA", compare(ref, run("int8 base + adapter, dynamic path", spec.model_dir, True, ref.tokens)), written=False)]
        for requant in (False, True):
            if requant == spec.quantize_output:
                path = written
            else:
                path = scratch / ("merged-requantized" if requant else "merged-float")
                path.mkdir()
                _say(opts, f"writing the {'requantized' if requant else 'float'} merge variant for comparison (scratch)")
                write_checkpoint(MergeSpec(spec.model_dir, adapter, spec.dtype, quantize_output=requant), path, progress=False)
            label = "merged, requantized int8" if requant else f"merged, {dtype_name}"
            rows.append(ReportRow(label, compare(ref, run(label, path, False, ref.tokens)), written=requant == spec.quantize_output))
    return tuple(rows)
