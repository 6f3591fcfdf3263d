"""`lorafleet merge`: bake one LoRA adapter into the base weights, verify against the dynamic path.

    lorafleet merge --model BASE --adapter ADAPTER --out MERGED [--dtype D] [--force]
                    [--no-verify] [--verify-threshold X] [--verify-tokens N] [--device D]
                    [--adapter-name NAME] [--requantize | --no-requantize]

The merged folder is a plain HF checkpoint (loads with transformers and with
`lorafleet serve --model MERGED`), plus ``lorafleet_merge.json`` (sources, hashes,
scales, dtype, time, verification figures). A merged model serves ONE adapter: every
request gets that adapter's behaviour, so other adapters' requests must not be sent to it.

Exit status: 0 merged (and verified); 1 verification below the threshold (nothing
written); 2 bad input (missing/mismatched adapter, DoRA, existing or unwritable output, a merged
value that does not fit --dtype,
no tokenizer to verify with, --verify-tokens too long for the model); 3 an unexpected
error (with its traceback; nothing written); 130 interrupted by Ctrl-C, 143 / 129 by
SIGTERM / SIGHUP (nothing written: the staging folder is removed). A signal that arrives
while the finished output is being renamed into place (and, with --force, while the previous
one is deleted) is held; the run completes (exit 0) and says so on stderr. Ctrl-C while the
report is printed, after that, exits 130 saying the output is written and complete.
"""
from __future__ import annotations

import argparse
import sys
import traceback

from runtime.config import ConfigError
from runtime.lora.adapter import AdapterError
from runtime.merge.merge_job import DEFAULT_THRESHOLD, MergeOptions, VerificationFailed, run_merge
from runtime.merge.merger import MergeError
from runtime.merge.staging import OutputPathError
from runtime.merge.verify import DEFAULT_NEW_TOKENS
from runtime.models.hf_config import ModelConfigError
from runtime.models.loader import DTYPES, CheckpointError

from runtime.tokenizer import TokenizerError

INPUT_ERRORS = (AdapterError, MergeError, OutputPathError, ModelConfigError, CheckpointError, ConfigError, TokenizerError)
VERIFY_DEVICES = ("auto", "cpu", "cuda", "npu")


EXIT_STATUS = """exit status:
  0    merged (and verified)
  1    verification below --verify-threshold (nothing written)
  2    bad input (adapter, model, output folder, --dtype range, tokenizer, --verify-tokens)
  3    an unexpected error (with its traceback; nothing written)
  130  interrupted by Ctrl-C; 143 / 129 by SIGTERM / SIGHUP (nothing written)"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EXIT_STATUS
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--model", required=True, metavar="DIR", help="base HF checkpoint folder (float, or int8 from `lorafleet quantize`)")
    parser.add_argument("--adapter", required=True, metavar="DIR", help="PEFT LoRA adapter folder (validated exactly as serving does)")
    parser.add_argument("--out", required=True, metavar="DIR", help="new folder for the merged checkpoint; must not exist (see --force)")
    parser.add_argument("--dtype", choices=list(DTYPES), default=None,
                        help="dtype of the written float tensors (default: the base's dtype, from its config.json or, where that names none or 'auto', the dtype its weights are stored in; float32 for an int8 base). The merge itself is float32")
    parser.add_argument("--force", action="store_true", help="replace an existing --out folder, only if it is empty or an earlier lorafleet merge/quantize output (never an input, nor one inside/around an input)")
    parser.add_argument("--no-verify", dest="verify", action="store_false",
                        help="skip the comparison with the dynamic path (base + adapter)")
    parser.add_argument("--verify-threshold", type=float, default=None, metavar="X",
                        help=f"fail (and write nothing) when greedy-token agreement is below X (default {DEFAULT_THRESHOLD})")
    parser.add_argument("--verify-tokens", type=int, default=None, metavar="N",
                        help=f"tokens decoded per verification prompt (default {DEFAULT_NEW_TOKENS})")
    parser.add_argument("--device", choices=VERIFY_DEVICES, default=None,
                        help="where verification runs the two models, in float32 (default cpu; auto: cuda, npu, then cpu). "
                             "The merge itself always runs on the CPU")  # fmt: skip
    parser.add_argument("--adapter-name", default=None, metavar="NAME", help="name recorded in the manifest (default: the adapter folder's name)")
    parser.add_argument("--requantize", dest="requantize", action=argparse.BooleanOptionalAction, default=None,
                        help="int8 base only: requantize the merged weights to int8 (default) or, with --no-requantize, write float")


def _listed(flags: list[str]) -> str:
    """Flags as a sentence names them: ``A``, ``A and B``, ``A, B and C``."""
    return flags[0] if len(flags) == 1 else f"{', '.join(flags[:-1])} and {flags[-1]}"


def run(args: argparse.Namespace) -> int:
    if not args.verify:
        unused = [flag for flag, value in (("--verify-threshold", args.verify_threshold), ("--verify-tokens", args.verify_tokens),
                                           ("--device", args.device)) if value is not None]  # fmt: skip
        if unused:
            print(f"lorafleet merge: error: {_listed(unused)} {'applies' if len(unused) == 1 else 'apply'} only to verification, "
                  "which --no-verify skips", file=sys.stderr)  # fmt: skip
            return 2
    opts = MergeOptions(
        model=args.model, adapter=args.adapter, out=args.out, dtype=args.dtype, force=args.force, verify=args.verify,
        threshold=DEFAULT_THRESHOLD if args.verify_threshold is None else args.verify_threshold, adapter_name=args.adapter_name,
        requantize=args.requantize, new_tokens=DEFAULT_NEW_TOKENS if args.verify_tokens is None else args.verify_tokens,
        device=args.device or "cpu",
    )  # fmt: skip
    if opts.new_tokens < 1:
        print("lorafleet merge: error: --verify-tokens must be >= 1", file=sys.stderr)
        return 2
    try:
        result = run_merge(opts)
    except INPUT_ERRORS as err:
        print(f"lorafleet merge: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"lorafleet merge: interrupted; nothing was written to {args.out}", file=sys.stderr)
        return 130
    except VerificationFailed as err:
        print(err.result.report)
        print(f"lorafleet merge: error: verification failed; nothing was written to {args.out}. "
              "Lower --verify-threshold or pass --no-verify to keep such a merge.", file=sys.stderr)  # fmt: skip
        return 1
    except Exception:  # noqa: BLE001 - a bug or an environment failure: not "verification failed" (1)
        traceback.print_exc()
        print(f"lorafleet merge: error: unexpected failure (traceback above); nothing was written to {args.out}", file=sys.stderr)
        return 3
    try:
        if result.report:
            print(result.report)
        else:
            print("verification skipped (--no-verify)")
        s = result.summary
        print(f"merged {s.modules_merged} modules of adapter {result.manifest['adapter']['name']} "
              f"(version {result.manifest['adapter']['version']}) into {result.out} ({s.total_bytes / 2**20:.1f} MiB, {', '.join(s.files)})")  # fmt: skip
    except KeyboardInterrupt:  # while reporting: the output is written and complete
        print(f"lorafleet merge: interrupted after {result.out} was written (it is complete)", file=sys.stderr)
        return 130
    return 0
