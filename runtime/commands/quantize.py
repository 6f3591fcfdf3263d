"""`lorafleet quantize`: write an int8 weight-only copy of a float checkpoint.

    lorafleet quantize --model BASE --out QUANTIZED [--dtype D] [--force]

The seven projections of every layer become int8 codes with float32 per-output-channel
scales (format: runtime/quant/int8.py); embeddings, lm_head and norms stay float (``--dtype``,
default the base's: config.json's dtype, else the dtype most of its float weights are stored in). The folder loads with lorafleet (not transformers) and carries
``lorafleet_quantize.json``. Written atomically: a failure, Ctrl-C, SIGTERM or SIGHUP leaves
nothing behind (only SIGKILL can leave a hidden staging folder; the next run names it).
Exit status: 0 written; 2 bad input; 3 an unexpected error (with its traceback); 130
interrupted by Ctrl-C, 143 / 129 by SIGTERM / SIGHUP.
"""
from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

from runtime.hub_hint import hub_download_hint
from runtime.merge.manifest import QUANTIZE_MANIFEST, base_record, quantize_manifest, write_manifest
from runtime.merge.merger import DEFAULT_MAX_SHARD_BYTES, DTYPE_NAMES, MergeError, MergeSpec, weights_sha256, write_checkpoint
from runtime.merge.staging import OutputPathError, StagedOutput, check_output
from runtime.models.hf_config import ModelConfigError, load_model_config
from runtime.models.loader import DTYPES, CheckpointError, base_dtype, check_checkpoint, check_tied_head, checkpoint_quantization
from runtime.quant.int8 import QUANTIZATION_CONFIG


EXIT_STATUS = """exit status:
  0    written
  2    bad input
  3    an unexpected error (with its traceback)
  130  interrupted by Ctrl-C; 143 / 129 by SIGTERM / SIGHUP (nothing left behind)"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EXIT_STATUS
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--model", required=True, metavar="DIR", help="float HF checkpoint folder")
    parser.add_argument("--out", required=True, metavar="DIR", help="new folder for the int8 checkpoint; must not exist (see --force)")
    parser.add_argument("--dtype", choices=list(DTYPES), default=None, help="dtype of the tensors that stay float (default: the base's dtype, from its config.json or, where that names none or 'auto', the dtype its weights are stored in)")
    parser.add_argument("--force", action="store_true", help="replace an existing --out folder, only if it is empty or an earlier lorafleet merge/quantize output (never the input)")


def quantize_checkpoint(model: str, out: str, dtype: str | None = None, force: bool = False, progress: bool = True,
                        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Path:  # fmt: skip
    """Write the int8 copy of ``model`` to ``out`` (see module docstring); returns the output folder."""
    model_dir = Path(model)
    if not model_dir.is_dir():
        raise MergeError(f"{model}: {'is not a folder' if model_dir.exists() else 'model folder does not exist' + hub_download_hint(model_dir)}")
    cfg = load_model_config(model_dir)
    if checkpoint_quantization(model_dir) is not None:
        raise MergeError(f"{model_dir / 'config.json'}: quantization_config says this checkpoint is already int8")
    files, _ = check_checkpoint(cfg, model_dir)  # what serving would refuse is refused before anything is written
    check_tied_head(cfg, files)
    stored = base_dtype(cfg, files)  # config.json's, else the weights' (as `lorafleet merge`)
    name = dtype or (stored if stored in DTYPES else "float32")
    target = check_output(out, [model], force)
    spec = MergeSpec(model_dir, None, DTYPES[name], quantize_output=True, max_shard_bytes=max_shard_bytes)
    staged = StagedOutput(target, force)
    with staged as tmp:
        summary = write_checkpoint(spec, tmp, progress=progress)
        output = {"dtype": DTYPE_NAMES[spec.dtype], "quantization": dict(QUANTIZATION_CONFIG), "files": list(summary.files)}
        if progress:  # reads every weight file of the base again: minutes on a large model, after the bar reached 100%
            print("hashing the base weights for the manifest ...", file=sys.stderr, flush=True)
        write_manifest(tmp, QUANTIZE_MANIFEST, quantize_manifest(base_record(cfg.name, model_dir, weights_sha256(model_dir), None), output))
        staged.publish()
    return target


def run(args: argparse.Namespace) -> int:
    try:
        out = quantize_checkpoint(args.model, args.out, args.dtype, args.force)
    except (MergeError, OutputPathError, ModelConfigError, CheckpointError) as err:
        print(f"lorafleet quantize: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"lorafleet quantize: interrupted; nothing was written to {args.out}", file=sys.stderr)
        return 130
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        print(f"lorafleet quantize: error: unexpected failure (traceback above); nothing was written to {args.out}", file=sys.stderr)
        return 3
    try:
        print(f"wrote int8 weight-only checkpoint to {out}")
    except KeyboardInterrupt:  # while reporting: the output is written and complete
        print(f"lorafleet quantize: interrupted after {out} was written (it is complete)", file=sys.stderr)
        return 130
    return 0
