#!/usr/bin/env python3
"""Held-out exact-match accuracy of the bundled demo, per adapter and for the base.

Every held-out string (5-20 characters, drawn with a seed training never uses) is sent
once per task, all tasks mixed in the same batches, with greedy decoding. A row is correct
when its continuation, whitespace-trimmed, equals the task's transformation of the input.
Exit status 1 when any task is below the 90% target.

    python scripts/eval_demo.py                      # transformers + PEFT (independent reference)
    python scripts/eval_demo.py --engine lorafleet   # runtime.llm.LLM, one mixed batch
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from runtime.demo import BASE_TASK, TASKS, expected_continuation, held_out_texts, make_prompt  # noqa: E402

PEFT_BASE = "__base__"  # PEFT's adapter_names value for "no adapter" rows


@torch.no_grad()
def greedy_hf(model, tokenizer, prompts: list[str], max_new: int, adapter_names: list[str] | None = None) -> list[str]:
    """Greedy continuations (decoded, EOS excluded) with a transformers/PEFT model, no KV cache.

    Prompts of equal token length form one batch, so no padding or attention mask is needed;
    ``adapter_names`` (PEFT mixed-batch inference) gives each row its own adapter.
    """
    eos = tokenizer.token_to_id("<eos>")
    encoded = [tokenizer.encode(p).ids for p in prompts]
    out = [""] * len(prompts)
    groups: dict[int, list[int]] = {}
    for i, ids in enumerate(encoded):
        groups.setdefault(len(ids), []).append(i)
    for rows in groups.values():
        ids = torch.tensor([encoded[i] for i in rows])
        extra = {} if adapter_names is None else {"adapter_names": [adapter_names[i] for i in rows]}
        new: list[list[int]] = [[] for _ in rows]
        done = [False] * len(rows)
        for _ in range(max_new):
            nxt = model(input_ids=ids, **extra).logits[:, -1].argmax(-1)
            for j, t in enumerate(nxt.tolist()):
                if not done[j]:
                    done[j] = t == eos
                    if not done[j]:
                        new[j].append(t)
            if all(done):
                break
            ids = torch.cat([ids, nxt[:, None]], dim=1)
        for j, i in enumerate(rows):
            out[i] = tokenizer.decode(new[j])
    return out


def run_hf(assets: Path, rows: list[tuple[str, str]], max_new: int) -> list[str]:
    from peft import PeftModel
    from tokenizers import Tokenizer
    from transformers import LlamaForCausalLM

    base = LlamaForCausalLM.from_pretrained(assets / "base", dtype=torch.float32).eval()
    tokenizer = Tokenizer.from_file(str(assets / "base" / "tokenizer.json"))
    names = sorted(p.name for p in (assets / "adapters").iterdir() if p.is_dir())
    model = PeftModel.from_pretrained(base, assets / "adapters" / names[0], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(assets / "adapters" / name, adapter_name=name)
    model.eval()
    adapter_names = [PEFT_BASE if task == BASE_TASK else task for task, _ in rows]
    return greedy_hf(model, tokenizer, [make_prompt(t) for _, t in rows], max_new, adapter_names)


def run_lorafleet(assets: Path, rows: list[tuple[str, str]], max_new: int) -> list[str]:
    try:
        from runtime.llm import LLM
        from runtime.request import SamplingParams
    except ImportError as exc:
        raise SystemExit(f"--engine lorafleet needs runtime.llm.LLM and runtime.request.SamplingParams: {exc}")
    adapters = {p.name: p for p in sorted((assets / "adapters").iterdir()) if p.is_dir()}
    llm = LLM(str(assets / "base"), adapters={k: str(v) for k, v in adapters.items()}, device="cpu")
    outputs = llm.generate(
        [make_prompt(t) for _, t in rows],
        SamplingParams(max_tokens=max_new, temperature=0.0),
        adapter=[None if task == BASE_TASK else task for task, _ in rows],
    )
    return [o.text for o in outputs]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--assets", type=Path, default=REPO / "runtime" / "demo_assets", help="demo assets folder")
    parser.add_argument("--engine", choices=("hf", "lorafleet"), default="hf",
                        help="hf: transformers + PEFT mixed batch; lorafleet: runtime.llm.LLM")
    parser.add_argument("--count", type=int, default=200, help="held-out strings per task")
    parser.add_argument("--seed", type=int, default=20240917, help="held-out seed (training uses others)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--show", type=int, default=3, help="print this many failures per task")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    texts = held_out_texts(args.count, seed=args.seed)
    tasks = [BASE_TASK] + sorted(p.name for p in (args.assets / "adapters").iterdir() if p.is_dir())
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise SystemExit(f"{args.assets / 'adapters'}: no task definition for adapter(s) {unknown} in runtime/demo.py")
    # Interleave tasks so every batch mixes adapters: [base, reverse, rot13, upper, base, ...].
    rows = [(task, text) for text in texts for task in tasks]
    max_new = max(map(len, texts)) + 3
    start = time.time()
    outs = (run_hf if args.engine == "hf" else run_lorafleet)(args.assets, rows, max_new)
    elapsed = time.time() - start

    print(f"engine {args.engine}: {len(texts)} held-out strings (5-20 chars, seed {args.seed}) x {len(tasks)} tasks, "
          f"greedy, {elapsed:.1f}s")
    print(f"{'task':10s} {'exact match':>12s}")
    worst = 1.0
    for task in tasks:
        results = [(text, out) for (t, text), out in zip(rows, outs) if t == task]
        wrong = [(text, out) for text, out in results if out.strip() != expected_continuation(task, text).strip()]
        acc = 1 - len(wrong) / len(results)
        worst = min(worst, acc)
        print(f"{task:10s} {acc:11.1%}")
        for text, out in wrong[: args.show]:
            print(f"    {text!r} -> {out!r} (want {expected_continuation(task, text)!r})")
    return 0 if worst >= 0.9 else 1


if __name__ == "__main__":
    sys.exit(main())
