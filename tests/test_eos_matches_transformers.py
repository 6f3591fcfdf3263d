"""Where a greedy generation ends, against transformers' ``generate`` on the same tiny checkpoint
whose tokenizer has no eos, so that only the model's configs name one. transformers 5 builds the
generation config ``generate`` uses from ``generation_config.json`` when there is one (without an
``eos_token_id``: no eos), else from config.json's own keys: LlamaConfig's default eos (2), which
``model.config`` shows when config.json has none, never stops it."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime.request import SamplingParams
from tests.engine_helpers import make_engine, run_alone

PROMPT = [5, 6, 7]
NEW_TOKENS = 6


def _checkpoint(src: Path, dst: Path, likely: int, config_eos: int | None, generation: str) -> Path:
    """A copy of ``src`` whose tokenizer has no eos, config.json's eos_token_id ``config_eos`` (None:
    no key), ``generation``: "none" (no generation_config.json) or "without_eos" (one without
    eos_token_id); token ``likely``'s LM-head row is made large, so greedy decoding emits it."""
    shutil.copytree(src, dst)
    tok = json.loads((dst / "tokenizer_config.json").read_text())
    tok.pop("eos_token")
    (dst / "tokenizer_config.json").write_text(json.dumps(tok))
    cfg = {k: v for k, v in json.loads((dst / "config.json").read_text()).items() if k != "eos_token_id"}
    (dst / "config.json").write_text(json.dumps(cfg if config_eos is None else {**cfg, "eos_token_id": config_eos}))
    if generation == "none":
        (dst / "generation_config.json").unlink()
    else:
        gen = {k: v for k, v in json.loads((dst / "generation_config.json").read_text()).items() if k not in ("eos_token_id", "_from_model_config")}
        (dst / "generation_config.json").write_text(json.dumps(gen))
    weights = load_file(str(dst / "model.safetensors"))
    weights["lm_head.weight"][likely] = weights["lm_head.weight"].max(0).values * 5
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("likely, config_eos, generation, stops", [
    (257, 257, "without_eos", False),  # lorafleet stopped on config.json's eos, which transformers' generate does not read then
    (2, None, "none", False),  # no eos_token_id anywhere: LlamaConfig's default 2 stops nothing
    (257, 257, "none", True),  # no generation_config.json: config.json's eos stops both
], ids=["generation_config_without_eos", "no_eos_anywhere", "config_json_eos"])
def test_greedy_generation_ends_where_transformers_does(tmp_path, tiny_llama_dir, likely, config_eos, generation, stops):
    from transformers import AutoModelForCausalLM

    model = _checkpoint(tiny_llama_dir, tmp_path / "model", likely, config_eos, generation)
    ref_model = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    with torch.no_grad():
        ids = torch.tensor([PROMPT])
        ref = ref_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    want = ref[0, len(PROMPT):].tolist()
    engine = make_engine(model)
    try:
        out = run_alone(engine, "r", PROMPT, SamplingParams(max_tokens=NEW_TOKENS, temperature=0), None)
    finally:
        engine.close()
    assert list(out.token_ids) == want
    assert want[0] == likely and (want == [likely]) == stops and out.finish_reason == ("stop" if stops else "length")
