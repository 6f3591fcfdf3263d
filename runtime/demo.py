"""The bundled demo: where its assets live, and what each of its adapters does.

The demo is a ~2 M parameter Llama base that echoes its input, plus PEFT LoRA
adapters that each transform it (see ``runtime/demo_assets/README.md``).
Prompt format: ``"<text> =>"``; the model continues with ``" <transformed text>"``
and then its end-of-sequence token. ``scripts/train_demo.py`` trains the assets,
``scripts/eval_demo.py`` measures them, and both use the task definitions here so
training, evaluation and tests agree on one meaning of each task.
"""
from __future__ import annotations

import codecs
import random
from pathlib import Path
from typing import Callable

ASSETS_DIR = Path(__file__).resolve().parent / "demo_assets"
BASE_TASK = "base"
PROMPT_SUFFIX = " =>"

# task name -> transformation of the input text; "base" is the un-adapted model.
TASKS: dict[str, Callable[[str], str]] = {
    BASE_TASK: lambda text: text,
    "upper": str.upper,
    "reverse": lambda text: text[::-1],
    "rot13": lambda text: codecs.encode(text, "rot13"),
}

# The demo's chat template: the last message, which must be the user's, in the prompt format
# above (the demo models know no roles or turns), so chat completions work on it too.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% set last = messages[-1] %}"
    "{% if last['role'] != 'user' %}{{ raise_exception('the demo model transforms the last message, which must be a user message') }}{% endif %}"
    "{{ last['content'] }}" + PROMPT_SUFFIX
)

LOWER = "abcdefghijklmnopqrstuvwxyz"
DIGITS = "0123456789"


class DemoAssetsMissing(FileNotFoundError):
    """The demo weights are not installed next to this module."""


def demo_model_dir() -> Path:
    """Folder of the demo base checkpoint (HF format: config.json, model.safetensors, tokenizer.json)."""
    base = ASSETS_DIR / "base"
    if not (base / "config.json").is_file() or not (base / "model.safetensors").is_file():
        raise DemoAssetsMissing(
            f"demo base model not found: {base} needs config.json and model.safetensors; "
            "reinstall lorafleet or run `python scripts/train_demo.py --out runtime/demo_assets`"
        )
    return base


def demo_adapters() -> dict[str, Path]:
    """Adapter name -> PEFT folder (adapter_config.json + adapter_model.safetensors), sorted by name."""
    root = ASSETS_DIR / "adapters"
    found = {
        p.name: p
        for p in sorted(root.iterdir() if root.is_dir() else [])
        if (p / "adapter_config.json").is_file() and (p / "adapter_model.safetensors").is_file()
    }
    if not found:
        raise DemoAssetsMissing(
            f"no demo adapters found under {root} (each needs adapter_config.json and "
            "adapter_model.safetensors); reinstall lorafleet or run scripts/train_demo.py"
        )
    return found


def make_prompt(text: str) -> str:
    """The prompt the demo models were trained on: ``"hello world =>"``."""
    return text + PROMPT_SUFFIX


def expected_continuation(task: str, text: str) -> str:
    """What a correct model generates after ``make_prompt(text)`` (before its EOS): ``" " + f(text)``."""
    if task not in TASKS:
        raise KeyError(f"unknown demo task {task!r}; known: {', '.join(TASKS)}")
    return " " + TASKS[task](text)


def random_text(rng: random.Random, min_len: int, max_len: int, mixed_case: bool = False) -> str:
    """Words of lowercase letters (sometimes digits) joined by single spaces, min_len..max_len chars.

    No leading, trailing or double spaces, so the strings survive whitespace-normalising
    comparisons unchanged. ``mixed_case`` flips each letter to uppercase with probability 1/2.
    """
    length = rng.randint(min_len, max_len)
    chars: list[str] = []
    while len(chars) < length:
        at_word_start = not chars or chars[-1] == " "
        if not at_word_start and len(chars) < length - 1 and rng.random() < 0.18:
            chars.append(" ")
        else:
            chars.append(rng.choice(DIGITS) if rng.random() < 0.08 else rng.choice(LOWER))
    text = "".join(chars)
    if mixed_case:
        text = "".join(c.upper() if rng.random() < 0.5 else c for c in text)
    return text


def held_out_texts(count: int, seed: int = 20240917, min_len: int = 5, max_len: int = 20) -> list[str]:
    """Evaluation strings, drawn with a seed that training never uses."""
    rng = random.Random(seed)
    return [random_text(rng, min_len, max_len) for _ in range(count)]
