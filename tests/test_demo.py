"""The bundled demo (runtime/demo_assets): valid HF/PEFT folders, and each adapter does its own job.

Routing check: one mixed batch [base, reverse, rot13, upper, base, ...] of held-out strings;
a row served with the wrong adapter (or none) shows up as the wrong transformation.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from runtime.demo import (
    BASE_TASK,
    TASKS,
    demo_adapters,
    demo_model_dir,
    expected_continuation,
    held_out_texts,
    make_prompt,
)

N_PER_TASK = 12
MAX_LEN = 14  # short held-out strings keep max_tokens (and CI time) small
MIN_ACCURACY = 0.9
EXPECTED_ADAPTERS = {"upper", "reverse", "rot13"}


@pytest.fixture(scope="module")
def mixed_rows() -> list[tuple[str, str]]:
    """(task, text) rows, tasks interleaved so every batch mixes adapters and the base."""
    texts = held_out_texts(N_PER_TASK, seed=777, min_len=5, max_len=MAX_LEN)
    tasks = [BASE_TASK, *sorted(EXPECTED_ADAPTERS)]
    return [(tasks[(i + j) % len(tasks)], text) for i, text in enumerate(texts) for j in range(len(tasks))]


def per_task_accuracy(rows: list[tuple[str, str]], outputs: list[str]) -> dict[str, float]:
    hits: dict[str, list[bool]] = {}
    for (task, text), out in zip(rows, outputs, strict=True):
        hits.setdefault(task, []).append(out.strip() == expected_continuation(task, text).strip())
    return {task: sum(h) / len(h) for task, h in hits.items()}


def test_demo_helpers_find_the_shipped_assets():
    base = demo_model_dir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (base / name).is_file(), base / name
    adapters = demo_adapters()
    assert set(adapters) == EXPECTED_ADAPTERS
    assert set(adapters) <= set(TASKS)
    total = sum(f.stat().st_size for f in base.parent.rglob("*") if f.is_file())
    assert total <= 20 * 1024 * 1024, f"demo assets are {total / 1e6:.1f} MB"


def test_adapters_have_mixed_ranks_and_targets_and_no_local_paths():
    configs = {name: json.loads((path / "adapter_config.json").read_text()) for name, path in demo_adapters().items()}
    ranks = {name: cfg["r"] for name, cfg in configs.items()}
    targets = {name: frozenset(cfg["target_modules"]) for name, cfg in configs.items()}
    assert len(set(ranks.values())) == len(ranks), ranks
    assert len(set(targets.values())) == len(targets), targets
    for name, cfg in configs.items():
        base_ref = cfg.get("base_model_name_or_path") or ""
        assert not Path(base_ref).is_absolute() and "/tmp" not in base_ref and "/work" not in base_ref, (name, base_ref)


def test_tokenizer_json_is_character_level_with_bos():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(demo_model_dir() / "tokenizer.json"))
    cfg = json.loads((demo_model_dir() / "tokenizer_config.json").read_text())
    ids = tok.encode("Hi there =>").ids
    assert ids[0] == tok.token_to_id(cfg["bos_token"])
    assert len(ids) == 1 + len("Hi there =>")
    assert tok.decode(ids[1:]) == "Hi there =>"


def test_assets_load_and_route_through_transformers_and_peft(mixed_rows):
    """Independent check: the folders are standard HF/PEFT, and PEFT's mixed batch reproduces the tasks."""
    from peft import PeftModel
    from tokenizers import Tokenizer
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    base = LlamaForCausalLM.from_pretrained(demo_model_dir(), dtype=torch.float32).eval()
    tok = Tokenizer.from_file(str(demo_model_dir() / "tokenizer.json"))
    adapters = demo_adapters()
    names = sorted(adapters)
    model = PeftModel.from_pretrained(base, adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapters[name], adapter_name=name)
    model.eval()

    eos = tok.token_to_id("<eos>")
    outputs = [""] * len(mixed_rows)
    groups: dict[int, list[int]] = {}
    encoded = [tok.encode(make_prompt(text)).ids for _, text in mixed_rows]
    for i, ids in enumerate(encoded):
        groups.setdefault(len(ids), []).append(i)  # equal lengths: no padding needed
    with torch.no_grad():
        for rows in groups.values():
            ids = torch.tensor([encoded[i] for i in rows])
            names_for_rows = ["__base__" if mixed_rows[i][0] == BASE_TASK else mixed_rows[i][0] for i in rows]
            for _ in range(MAX_LEN + 2):
                nxt = model(input_ids=ids, adapter_names=names_for_rows).logits[:, -1].argmax(-1)
                ids = torch.cat([ids, nxt[:, None]], dim=1)
            for j, i in enumerate(rows):
                new = ids[j, len(encoded[i]):].tolist()
                outputs[i] = tok.decode(new[: new.index(eos)] if eos in new else new)
    accuracy = per_task_accuracy(mixed_rows, outputs)
    assert all(acc >= MIN_ACCURACY for acc in accuracy.values()), accuracy


def test_lorafleet_serves_the_demo_with_each_row_on_its_own_adapter(mixed_rows):
    """The shipped demo through the ordinary loader and adapter validator, one mixed batch."""
    from runtime.llm import LLM
    from runtime.request import SamplingParams

    llm = LLM(
        str(demo_model_dir()), adapters={name: str(path) for name, path in demo_adapters().items()}, device="cpu"
    )
    outputs = llm.generate(
        [make_prompt(text) for _, text in mixed_rows],
        SamplingParams(max_tokens=MAX_LEN + 2, temperature=0.0),
        adapter=[None if task == BASE_TASK else task for task, _ in mixed_rows],
    )
    accuracy = per_task_accuracy(mixed_rows, [o.text for o in outputs])
    assert set(accuracy) == {BASE_TASK} | EXPECTED_ADAPTERS
    assert all(acc >= MIN_ACCURACY for acc in accuracy.values()), accuracy


def test_shipped_adapters_pass_the_runtime_validator():
    """Same validator as user adapters: runtime.lora.adapter.load_adapter against the base's targets."""
    from runtime.lora.adapter import load_adapter
    from runtime.models.hf_config import load_model_config
    from runtime.models.llama import lora_targets

    cfg = load_model_config(demo_model_dir())
    targets = lora_targets(cfg)
    seen_ranks = set()
    for name, path in demo_adapters().items():
        adapter = load_adapter(path, name, targets, num_layers=cfg.num_hidden_layers, max_lora_rank=64)
        assert adapter.modules, name
        seen_ranks.add(adapter.max_rank)
        config = json.loads((path / "adapter_config.json").read_text())
        assert adapter.max_rank == config["r"]
        assert {module for _, module in adapter.modules} == set(config["target_modules"])
    assert len(seen_ranks) == len(EXPECTED_ADAPTERS)
