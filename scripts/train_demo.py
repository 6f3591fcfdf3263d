#!/usr/bin/env python3
"""Train the bundled demo: a tiny Llama base that echoes text, and PEFT LoRA adapters on it.

Prompt ``"<text> =>"``, continuation ``" <task(text)><eos>"``. The base learns the identity
(echo); each adapter, trained on the frozen base, learns its own transformation
(``runtime.demo.TASKS``). Training is teacher-forced with the loss only on continuation tokens.

    python scripts/train_demo.py --out runtime/demo_assets   # full run: rebuilds the bundled demo
    python scripts/train_demo.py --quick --out /tmp/demo      # smoke run (~1 min, low accuracy)

``--out`` has no default: the bundled demo (runtime/demo_assets) is replaced only when it is
named. An existing non-empty ``--out`` that does not look like an earlier output of this
script (a ``base/`` folder, plus at most ``adapters/`` and a README.md) is refused unless
``--force`` is given. A run writes ``base/`` and ``adapters/<task>/`` there, replacing files of
the same names and leaving anything else alone.

Deterministic for a given --seed, thread count and torch build. Uses 2 threads by default
because the reference machine has 2 CPU cores.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from eval_demo import greedy_hf  # noqa: E402  (scripts/ is sys.path[0] when run as a script)
from runtime.demo import BASE_TASK, CHAT_TEMPLATE, TASKS, expected_continuation, held_out_texts, make_prompt, random_text  # noqa: E402

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
# Characters the tokenizer knows; anything else maps to <unk>.
CHARSET = " =>" + "0123456789" + "abcdefghijklmnopqrstuvwxyz" + "ABCDEFGHIJKLMNOPQRSTUVWXYZ" + ".,!?'-:;"
BASE_NAME = "lorafleet-demo-base"  # written into adapter_config.json instead of a local path


@dataclass(frozen=True)
class BaseShape:
    hidden: int = 192
    layers: int = 4
    heads: int = 6
    intermediate: int = 512


@dataclass(frozen=True)
class AdapterSpec:
    """One LoRA adapter: its task, rank, alpha and target modules."""

    task: str
    rank: int
    alpha: int
    targets: tuple[str, ...]
    steps: int
    lr: float


@dataclass(frozen=True)
class Phase:
    steps: int
    lr: float
    batch: int
    warmup: int


ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
# Different ranks and target sets on purpose: the demo itself exercises mixed-rank batches.
# upper/rot13 are per-character maps on top of echo's copy pattern, so values + MLP suffice
# (upper at rank 4 on q/v alone plateaued at loss ~0.28 in 400 steps);
# reverse must move attention (read input position n-1-j at output step j), so it gets q/k too.
ADAPTERS = (
    AdapterSpec("upper", rank=4, alpha=8, targets=("v_proj", "o_proj", "up_proj", "down_proj"), steps=600, lr=5e-3),
    AdapterSpec("reverse", rank=16, alpha=32, targets=ATTENTION + MLP, steps=900, lr=3e-3),
    AdapterSpec("rot13", rank=8, alpha=16, targets=("v_proj", "o_proj") + MLP, steps=500, lr=4e-3),
)


def build_tokenizer():
    """A character-level ``tokenizers`` tokenizer (WordLevel over single characters, <bos> prepended)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {tok: i for i, tok in enumerate([PAD, BOS, EOS, UNK, *CHARSET])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Every character (spaces included) is its own pre-token; Fuse joins them back without separators.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, vocab[BOS])])
    tok.add_special_tokens([PAD, BOS, EOS, UNK])
    return tok


def save_tokenizer(tok, out: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK,
        model_max_length=128, clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(out)
    # transformers 5 writes its own class name; the portable name loads in 4.x and 5.x alike.
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("backend", None)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["add_bos_token"] = False  # tokenizer.json's post-processor already prepends <bos>
    config["chat_template"] = CHAT_TEMPLATE  # chat completions: the last user message as "<text> =>"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def build_base(shape: BaseShape, vocab_size: int, tok):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.heads,
        max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
        bos_token_id=tok.token_to_id(BOS), eos_token_id=tok.token_to_id(EOS), pad_token_id=tok.token_to_id(PAD),
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


class Batcher:
    """Generates teacher-forcing batches for one task; labels are -100 outside the continuation."""

    def __init__(self, tok, task: str, seed: int, min_len: int, max_len: int, mixed_case: float, drop_bos: float):
        self.tok, self.task = tok, task
        self.rng = random.Random(seed)
        self.min_len, self.max_len, self.mixed_case, self.drop_bos = min_len, max_len, mixed_case, drop_bos
        self.pad, self.eos = tok.token_to_id(PAD), tok.token_to_id(EOS)

    def example(self) -> tuple[list[int], list[int]]:
        text = random_text(self.rng, self.min_len, self.max_len, mixed_case=self.rng.random() < self.mixed_case)
        prompt = self.tok.encode(make_prompt(text)).ids
        # Sometimes without <bos>, so the demo works whether or not a runtime prepends it.
        if self.rng.random() < self.drop_bos:
            prompt = prompt[1:]
        cont = self.tok.encode(expected_continuation(self.task, text), add_special_tokens=False).ids + [self.eos]
        return prompt + cont, [-100] * len(prompt) + cont

    def batch(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = [self.example() for _ in range(size)]
        width = max(len(ids) for ids, _ in rows)
        # Right padding: with causal attention, pads after a row never influence that row.
        ids = torch.tensor([i + [self.pad] * (width - len(i)) for i, _ in rows])
        labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in rows])
        return ids, labels


def lr_at(step: int, phase: Phase) -> float:
    """Linear warmup, then cosine decay to 10% of the peak."""
    if step < phase.warmup:
        return phase.lr * (step + 1) / phase.warmup
    progress = (step - phase.warmup) / max(1, phase.steps - phase.warmup)
    return phase.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(model, batcher: Batcher, phase: Phase, label: str, t0: float, log_every: int) -> None:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=phase.lr, betas=(0.9, 0.98), weight_decay=0.01)
    model.train()
    running = None
    for step in range(phase.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, phase)
        ids, labels = batcher.batch(phase.batch)
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        running = loss.item() if running is None else 0.9 * running + 0.1 * loss.item()
        if step % log_every == 0 or step == phase.steps - 1:
            print(f"[{label}] step {step + 1:5d}/{phase.steps}  loss {running:.4f}  lr {lr_at(step, phase):.2e}  "
                  f"elapsed {time.time() - t0:6.1f}s", flush=True)
    model.eval()


def accuracy(model, tok, task: str, texts: list[str]) -> float:
    outs = greedy_hf(model, tok, [make_prompt(t) for t in texts], max_new=max(map(len, texts)) + 3)
    return sum(o.strip() == TASKS[task](t) for o, t in zip(outs, texts)) / len(texts)


def fix_adapter_config(folder: Path) -> None:
    """Replace the base model path PEFT recorded (a local path) with a descriptive name.

    PEFT's auto-generated model card (README.md) repeats that path and says nothing else, so it goes.
    """
    (folder / "README.md").unlink(missing_ok=True)
    path = folder / "adapter_config.json"
    cfg = json.loads(path.read_text())
    cfg["base_model_name_or_path"] = BASE_NAME
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


# What a folder this script wrote holds at its top level (README.md: the bundled demo's hand-written notes).
OUTPUT_ENTRIES = {"base", "adapters", "README.md"}


def is_previous_output(out: Path) -> bool:
    """True if ``out`` looks like an earlier output of this script: a ``base/`` folder, and nothing at the top
    level but ``base/``, ``adapters/`` and README.md."""
    names = {p.name for p in out.iterdir()}
    return (out / "base").is_dir() and names <= OUTPUT_ENTRIES


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked: a refused invocation exits 2 with a one-line error, before any work."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None,
                        help="output folder (required; no default, so a run never replaces the bundled demo by accident: "
                             "pass --out runtime/demo_assets to rebuild it). It gets base/ and adapters/<task>/, "
                             "overwriting files of the same names")  # fmt: skip
    parser.add_argument("--force", action="store_true",
                        help="write into an existing non-empty --out even if it does not look like an earlier output of "
                             "this script (base/, adapters/, README.md only)")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="tiny smoke run: few steps, low accuracy")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--base-steps", type=int, default=None, help="override base training steps")
    parser.add_argument("--adapter-steps-scale", type=float, default=1.0, help="multiply every adapter's steps")
    parser.add_argument("--only", nargs="*", default=None, help="train only these adapters (base is always trained)")
    parser.add_argument("--base-from", type=Path, default=None,
                        help="reuse the base checkpoint in this folder instead of training one (it is copied to OUT/base)")
    parser.add_argument("--eval-count", type=int, default=100, help="held-out strings per task for the end check")
    args = parser.parse_args(argv)
    if args.out is None:
        hint = " (a smoke run: use a scratch folder such as /tmp/demo)" if args.quick else " (runtime/demo_assets to rebuild the bundled demo)"
        parser.error(f"--out is required{hint}")
    if args.out.exists():
        if not args.out.is_dir():
            parser.error(f"--out {args.out}: exists and is not a folder")
        if not args.force and any(args.out.iterdir()) and not is_previous_output(args.out):
            parser.error(f"--out {args.out}: a non-empty folder that train_demo.py did not write (a run writes base/ and "
                         f"adapters/ there, replacing files of the same names); choose another folder or pass --force")  # fmt: skip
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t0 = time.time()
    from peft import LoraConfig, get_peft_model

    tok = build_tokenizer()
    shape = BaseShape()
    base_phase = Phase(steps=args.base_steps or (60 if args.quick else 800), lr=3e-3, batch=48, warmup=60)
    scale = args.adapter_steps_scale * (0.08 if args.quick else 1.0)
    specs = [s for s in ADAPTERS if args.only is None or s.task in args.only]
    log_every = 10 if args.quick else 50

    base_dir = args.out / "base"
    base_dir.mkdir(parents=True, exist_ok=True)
    if args.base_from is not None:
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM.from_pretrained(args.base_from)
        print(f"base: loaded from {args.base_from}", flush=True)
    else:
        model = build_base(shape, tok.get_vocab_size(), tok)
        n_params = sum(p.numel() for p in model.parameters())
        print(f"base: {n_params / 1e6:.2f} M params {shape}; vocab {tok.get_vocab_size()}; "
              f"threads {args.threads}", flush=True)
        batcher = Batcher(tok, BASE_TASK, args.seed, 3, 24, mixed_case=0.4, drop_bos=0.2)
        train(model, batcher, base_phase, "base", t0, log_every)
    model.save_pretrained(base_dir, safe_serialization=True)
    save_tokenizer(tok, base_dir)
    model.generation_config.save_pretrained(base_dir)
    timings = {"base": time.time() - t0}
    print(f"[base] saved to {base_dir}  ({timings['base']:.1f}s)", flush=True)

    for p in model.parameters():
        p.requires_grad_(False)
    for spec in specs:
        n = ADAPTERS.index(spec)  # seeds depend on the adapter, not on which subset --only picked
        start = time.time()
        torch.manual_seed(args.seed + 100 + n)
        config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=list(spec.targets),
                            lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
        peft_model = get_peft_model(copy.deepcopy(model), config)
        phase = Phase(steps=max(10, int(spec.steps * scale)), lr=spec.lr, batch=48, warmup=30)
        batcher = Batcher(tok, spec.task, args.seed + 1 + n, 3, 24, mixed_case=0.25, drop_bos=0.2)
        train(peft_model, batcher, phase, spec.task, t0, log_every)
        folder = args.out / "adapters" / spec.task
        peft_model.save_pretrained(folder, safe_serialization=True)
        fix_adapter_config(folder)
        timings[spec.task] = time.time() - start
        print(f"[{spec.task}] r={spec.rank} targets={','.join(spec.targets)} saved to {folder} "
              f"({timings[spec.task]:.1f}s)", flush=True)

    train_time = time.time() - t0
    print(f"training time: {train_time:.1f}s ({train_time / 60:.1f} min) on {args.threads} threads", flush=True)

    texts = held_out_texts(args.eval_count)
    print(f"quick held-out check ({args.eval_count} strings of 5-20 chars, greedy exact match):")
    print(f"  base    {accuracy(model, tok, BASE_TASK, texts):6.1%}")
    from peft import PeftModel

    for spec in specs:
        adapted = PeftModel.from_pretrained(model, args.out / "adapters" / spec.task)
        print(f"  {spec.task:7s} {accuracy(adapted, tok, spec.task, texts):6.1%}", flush=True)
        model = adapted.unload()
    total = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    print(f"assets: {total / 1e6:.2f} MB under {args.out}; total time {time.time() - t0:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
