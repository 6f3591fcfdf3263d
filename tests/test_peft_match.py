"""Whole-model check: ModelRunner on the cpu backend vs transformers + PEFT's mixed-adapter batch.

PEFT's ``adapter_names=[..., "__base__", ...]`` forward is the independent reference:
logits within 1e-4 relative in float32, greedy 16-token generations identical.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backends import get_backend
from runtime.config import EngineConfig
from runtime.lora.adapter import load_adapter
from runtime.model_runner import ModelRunner, SeqStep

ORDER = ["a", "b", None, "c", "a", "d", None, "e"]  # None = base model
MAX_RANK = 16
BLOCK = 8
BLOCKS_PER_SEQ = 6  # 48 tokens per sequence
PROMPT_LEN = 11
NEW_TOKENS = 16


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per row: max |ours - ref| / max |ref|."""
    return (ours - ref).abs().amax(-1) / ref.abs().amax(-1)


def make_runner(model_dir: Path, adapters: dict[str, Path], dtype: str = "float32") -> tuple[ModelRunner, dict[str, int]]:
    config = EngineConfig(model=str(model_dir), device="cpu", dtype=dtype, max_loras=8, max_lora_rank=MAX_RANK,
                          num_kv_blocks=len(ORDER) * BLOCKS_PER_SEQ, block_size=BLOCK, max_num_batched_tokens=256)  # fmt: skip
    runner = ModelRunner(config, get_backend("cpu"))
    slots = {}
    for slot, (name, path) in enumerate(sorted(adapters.items())):
        adapter = load_adapter(path, name, runner.lora_targets(), num_layers=runner.model_config.num_hidden_layers, max_lora_rank=MAX_RANK)
        runner.write_adapter(slot, adapter, row_start=slot * MAX_RANK)
        slots[name] = slot
    return runner, slots


def peft_model(model_dir: Path, adapters: dict[str, Path]):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    names = sorted(adapters)
    model = PeftModel.from_pretrained(base, str(adapters[names[0]]), adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(str(adapters[name]), adapter_name=name)
    return model.eval()


def peft_names(order: list[str | None]) -> list[str]:
    return [n if n is not None else "__base__" for n in order]


def table(seq: int) -> list[int]:
    return list(range(seq * BLOCKS_PER_SEQ, (seq + 1) * BLOCKS_PER_SEQ))


def random_prompts(n: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n, length), generator=torch.Generator().manual_seed(seed))


def prefill_chunked(runner: ModelRunner, slots: dict[str, int], order, prompts: torch.Tensor, chunks: list[int]) -> list[torch.Tensor]:
    """Prefill every sequence in len(chunks) steps; returns each step's logits [B, vocab] (last token of each chunk)."""
    out, start = [], 0
    for size in chunks:
        steps = [SeqStep(prompts[b, start : start + size].tolist(), start, table(b), slots[n] if n else -1)
                 for b, n in enumerate(order)]  # fmt: skip
        out.append(runner.execute(steps))
        start += size
    return out


def greedy(runner: ModelRunner, slots: dict[str, int], order, prompts: torch.Tensor) -> torch.Tensor:
    """Prefill in one step, then NEW_TOKENS - 1 decode steps; argmax each time. Returns [B, NEW_TOKENS]."""
    b, length = prompts.shape
    lora = [slots[n] if n else -1 for n in order]
    logits = runner.execute([SeqStep(prompts[i].tolist(), 0, table(i), lora[i]) for i in range(b)])
    tokens = [logits.argmax(-1)]
    for step in range(NEW_TOKENS - 1):
        pos = length + step
        logits = runner.execute([SeqStep([int(tokens[-1][i])], pos, table(i), lora[i]) for i in range(b)])
        tokens.append(logits.argmax(-1))
    return torch.stack(tokens, dim=1)


@pytest.fixture(scope="module")
def tiny_mha(tmp_path_factory):
    """A llama without GQA (q/k/v of one width) and adapters a-e with one rank and scale on every
    module they target: the CPU backend's batched q/k/v (and gate/up) expand serves them."""
    from safetensors.torch import load_file, save_file

    from runtime.bench.synthetic import ATTENTION, LlamaShape, build_random_adapter, build_random_llama

    root = tmp_path_factory.mktemp("mha")
    shape = LlamaShape(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                       vocab_size=300, max_position_embeddings=128)  # fmt: skip
    model_dir = build_random_llama(root / "model", shape, seed=3)
    every = ATTENTION + ("gate_proj", "up_proj", "down_proj")
    adapters = {}
    for i, (name, rank) in enumerate(zip("abcde", (4, 8, 16, 8, 4))):
        path = build_random_adapter(root / name, shape, rank, seed=40 + i, targets=every if i % 2 == 0 else ATTENTION)
        weights = load_file(str(path / "adapter_model.safetensors"))  # B * 25: deltas large enough to change tokens
        save_file({k: v * 25 if "lora_B" in k else v for k, v in weights.items()}, str(path / "adapter_model.safetensors"))
        adapters[name] = path
    return model_dir, adapters


@pytest.fixture(scope="module", params=["llama", "qwen2", "llama_mha"])
def setup(request, tiny_llama_dir, tiny_adapters, tiny_qwen2_dir, tiny_qwen2_adapters, tiny_mha):
    model_dir, adapters = {"llama": (tiny_llama_dir, tiny_adapters), "qwen2": (tiny_qwen2_dir, tiny_qwen2_adapters), "llama_mha": tiny_mha}[request.param]
    runner, slots = make_runner(model_dir, adapters)
    return model_dir, adapters, runner, slots, peft_model(model_dir, adapters)


def test_mha_model_takes_the_batched_expand(tiny_mha):
    """The llama_mha case above really exercises the one-baddbmm q/k/v and gate/up expand."""
    from backends.reference import SlotViews

    runner, slots = make_runner(*tiny_mha)
    prefill_chunked(runner, slots, ORDER, random_prompts(len(ORDER), PROMPT_LEN, seed=9), [4, 1])
    fused = [lin.slices for layer in runner.model.layers for lin in layer.projections.values() if len(lin.slices) > 1]
    batched = {len(ws): sum(v.b_block is not None for v in SlotViews.cache_for(ws).values()) for ws in fused}
    assert batched.get(3, 0) > 0 and batched.get(2, 0) > 0, batched  # q/k/v and gate/up


def test_mixed_batch_logits_match_peft(setup):
    _, _, runner, slots, ref_model = setup
    prompts = random_prompts(len(ORDER), PROMPT_LEN, seed=1)
    # chunked prefill: 4 + 5 + 1 + 1 tokens; the last two chunks are decode-only steps
    chunks = [4, 5, 1, 1]
    ours = prefill_chunked(runner, slots, ORDER, prompts, chunks)
    with torch.no_grad():
        ref = ref_model(input_ids=prompts, adapter_names=peft_names(ORDER)).logits.float()
    ends = torch.tensor(chunks).cumsum(0) - 1
    for logits, end in zip(ours, ends.tolist()):
        err = rel_err(logits, ref[:, end])
        assert err.max() < 1e-4, f"position {end}: relative errors per row {err.tolist()}"


def test_greedy_generation_matches_peft(setup):
    _, _, runner, slots, ref_model = setup
    prompts = random_prompts(len(ORDER), PROMPT_LEN, seed=2)
    ours = greedy(runner, slots, ORDER, prompts)
    with torch.no_grad():
        ref = ref_model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), adapter_names=peft_names(ORDER),
                                 max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
    ref_new = ref[:, PROMPT_LEN:]
    assert ref_new.shape == (len(ORDER), NEW_TOKENS)
    assert torch.equal(ours, ref_new), f"ours {ours.tolist()}\nPEFT {ref_new.tolist()}"
    # Base rows with the same prompt as an adapter row would not test much: prompts differ per row,
    # and the generations must not collapse to one sequence either.
    assert len({tuple(r) for r in ours.tolist()}) > len(ORDER) // 2


@pytest.mark.skipif(not __import__("runtime.models.dense", fromlist=["x"]).PACKED_WEIGHTS, reason="this torch cannot pack weights for oneDNN")
def test_logits_and_greedy_generation_match_peft_on_packed_weights(setup, monkeypatch):
    """Benchmark-sized and real models store their projections packed for oneDNN (``pack_weight``)
    and run them in chunks of ``ONEDNN_MAX_ROWS`` rows. Forced here on the tiny models, with
    chunks of 7 rows so that prompt steps take several, the same bounds hold."""
    from runtime.models import dense

    model_dir, adapters, _, _, ref_model = setup
    monkeypatch.setattr(dense, "FLOAT32_ONEDNN", True)  # cpu_gemm auto packs float32 (where torch has oneDNN)
    monkeypatch.setattr(dense, "ONEDNN_MIN_WEIGHT", 0)
    monkeypatch.setattr(dense, "ONEDNN_MAX_ROWS", 7)
    runner, slots = make_runner(model_dir, adapters)
    assert all(lin.weight.is_mkldnn for layer in runner.model.layers for lin in layer.projections.values())
    assert runner.model.lm_head.is_mkldnn != runner.model_config.tie_word_embeddings  # a tied head stays plain
    rows = []
    onednn = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *args: rows.append(args[0].shape[0]) or onednn(*args))
    test_mixed_batch_logits_match_peft((model_dir, adapters, runner, slots, ref_model))
    test_greedy_generation_matches_peft((model_dir, adapters, runner, slots, ref_model))
    assert rows and set(rows) <= set(range(dense.PACKED_MIN_ROWS, 8)) and max(rows) == 7  # packed calls, 4-7 rows each


def test_where_mkl_is_preferred_the_model_keeps_float32_weights_plain_and_matches_peft(setup, monkeypatch):
    """With ``FLOAT32_ONEDNN`` off (auto as under cpu_gemm mkl) no float32 projection is packed, whatever its size,
    and every GEMM is F.linear's: the PEFT bounds hold there too."""
    from runtime.models import dense

    model_dir, adapters, _, _, ref_model = setup
    monkeypatch.setattr(dense, "FLOAT32_ONEDNN", False)
    monkeypatch.setattr(dense, "ONEDNN_MIN_WEIGHT", 0)  # every weight large enough to be packed, were it allowed
    calls = []
    onednn = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *args: calls.append(1) or onednn(*args))
    runner, slots = make_runner(model_dir, adapters)
    assert not any(lin.weight.is_mkldnn for layer in runner.model.layers for lin in layer.projections.values())
    assert not runner.model.lm_head.is_mkldnn
    test_mixed_batch_logits_match_peft((model_dir, adapters, runner, slots, ref_model))
    test_greedy_generation_matches_peft((model_dir, adapters, runner, slots, ref_model))
    assert not calls


def test_steps_reach_the_ops_grouped_by_adapter(setup, monkeypatch):
    """The runner orders sequences by slot, so the ops see one run of adapter rows (base rows last)."""
    _, _, runner, slots, _ = setup
    seen = []
    real_apply = runner.backend.lora.apply

    def spy(x, y, weights, meta, offsets, workspace):
        seen.append(meta)
        return real_apply(x, y, weights, meta, offsets, workspace)

    monkeypatch.setattr(runner.backend.lora, "apply", spy)
    prefill_chunked(runner, slots, ORDER, random_prompts(len(ORDER), PROMPT_LEN, seed=8), [5, 1])
    assert seen and all(m.first_row == 0 for m in seen), [m.first_row for m in seen]
    assert {m.num_tokens for m in seen} == {5 * len(ORDER), len(ORDER)}


def test_every_adapter_row_differs_from_base(setup):
    _, adapters, runner, slots, _ = setup
    order = [None] + sorted(adapters)
    prompt = random_prompts(1, PROMPT_LEN, seed=3).expand(len(order), -1)
    logits = runner.execute([SeqStep(prompt[i].tolist(), 0, table(i), slots[n] if n else -1) for i, n in enumerate(order)])
    for i, name in enumerate(order[1:], start=1):
        assert rel_err(logits[i], logits[0]) > 1e-2, f"adapter {name} row equals the base row"


def test_permuting_the_batch_leaves_rows_unchanged(setup):
    _, _, runner, slots, _ = setup
    prompts = random_prompts(len(ORDER), PROMPT_LEN, seed=4)
    first = prefill_chunked(runner, slots, ORDER, prompts, [7, 3, 1])
    perm = torch.randperm(len(ORDER), generator=torch.Generator().manual_seed(5)).tolist()
    second = prefill_chunked(runner, slots, [ORDER[p] for p in perm], prompts[perm], [7, 3, 1])
    for a, b in zip(first, second):
        torch.testing.assert_close(b, a[perm], rtol=1e-5, atol=1e-5)


def test_bfloat16_agrees_with_float32(tiny_llama_dir, tiny_adapters):
    prompts = random_prompts(len(ORDER), PROMPT_LEN, seed=6)
    results = {}
    for dtype in ("float32", "bfloat16"):
        runner, slots = make_runner(tiny_llama_dir, tiny_adapters, dtype)
        results[dtype] = prefill_chunked(runner, slots, ORDER, prompts, [8, 3])
    for hi, lo in zip(results["float32"], results["bfloat16"]):
        assert lo.dtype == torch.float32
        err = rel_err(lo, hi)
        # bf16 keeps 8 mantissa bits (rel. step 2^-8 = 0.4%); a few layers of rounding stay within a few %.
        assert err.max() < 5e-2, f"bf16 vs fp32 relative errors {err.tolist()}"


def test_memory_report_counts_the_float32_copies_of_a_bfloat16_pool(tiny_llama_dir, tiny_adapters):
    """The CPU ops run a bf16 pool's LoRA on float32 copies of the slots in use: the memory report
    counts them while they are held (0 for a float32 pool, which they read in place), a write to the
    pool included until the next call on the projection drops the copies it made stale."""
    prompts = random_prompts(len(ORDER), PROMPT_LEN, seed=7)
    for dtype in ("float32", "bfloat16"):
        runner, slots = make_runner(tiny_llama_dir, tiny_adapters, dtype)
        assert runner.memory_report()["lora_copies_bytes"] == 0
        prefill_chunked(runner, slots, ORDER, prompts, [PROMPT_LEN])
        report = runner.memory_report()
        if dtype == "float32":
            assert report["lora_copies_bytes"] == 0
            continue
        # Five adapters in use, each slice's A and B rows at their rank in float32: more than the
        # pool's bf16 rows they copy, less than twice the whole pool (which has room for 8 at rank 16).
        def bf16_bytes(names) -> int:
            return sum(w.host_rank[slots[n]] * (w.in_features + w.out_features) * 2 for _, _, w in runner.model.all_slices() for n in names)

        assert 2 * bf16_bytes(slots) <= report["lora_copies_bytes"] < 2 * report["lora_pool_bytes"]
        adapter = load_adapter(tiny_adapters["a"], "a", runner.lora_targets(), num_layers=runner.model_config.num_hidden_layers, max_lora_rank=MAX_RANK)
        runner.write_adapter(slots["a"], adapter, row_start=slots["a"] * MAX_RANK)
        assert runner.memory_report()["lora_copies_bytes"] == report["lora_copies_bytes"]  # held until the next call
        prefill_chunked(runner, slots, ["a", None], prompts[:2], [PROMPT_LEN])
        # The write's rows were a's own: its copies were dropped and made again at the same size, the
        # other adapters' kept (tests/test_reference_ops.py -k "outlive or random_writes" checks which).
        assert runner.memory_report()["lora_copies_bytes"] == report["lora_copies_bytes"]


@pytest.mark.skipif(not __import__("runtime.models.dense", fromlist=["x"]).PACKED_BFLOAT16, reason="no native bfloat16 in oneDNN here: bf16 weights stay plain")
def test_bfloat16_on_packed_weights_agrees_with_plain_bfloat16_and_float32(tiny_llama_dir, tiny_adapters, monkeypatch):
    """Where the CPU runs bf16 natively, bf16 projections are stored packed too (forced here on the
    tiny model, in 4-7-row calls): its logits stay as close to float32 as plain bf16's, and to
    plain bf16's within bf16 rounding."""
    from runtime.models import dense

    prompts = random_prompts(len(ORDER), PROMPT_LEN, seed=7)
    results = {}
    for name, dtype in (("float32", "float32"), ("plain", "bfloat16")):
        runner, slots = make_runner(tiny_llama_dir, tiny_adapters, dtype)
        results[name] = prefill_chunked(runner, slots, ORDER, prompts, [8, 3])
    monkeypatch.setattr(dense, "ONEDNN_MIN_WEIGHT", 0)
    monkeypatch.setattr(dense, "ONEDNN_MAX_ROWS", 7)
    runner, slots = make_runner(tiny_llama_dir, tiny_adapters, "bfloat16")
    assert all(lin.weight.is_mkldnn and lin.weight.dtype == torch.bfloat16 for layer in runner.model.layers for lin in layer.projections.values())
    rows = []
    onednn = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *args: rows.append(args[0].shape[0]) or onednn(*args))
    results["packed"] = prefill_chunked(runner, slots, ORDER, prompts, [8, 3])
    assert rows and set(rows) <= set(range(dense.PACKED_MIN_ROWS, 8))
    for hi, plain, packed in zip(results["float32"], results["plain"], results["packed"]):
        assert packed.dtype == torch.float32
        assert rel_err(packed, hi).max() < 5e-2 and rel_err(packed, plain).max() < 1e-2  # (bit-identical on this machine)
        assert rel_err(packed, hi).max() <= 2 * rel_err(plain, hi).max() + 1e-2


def test_an_adapter_trained_on_the_bare_decoder_matches_peft(tiny_llama_dir, tmp_path):
    """PEFT on ``LlamaModel`` (``AutoModel``: no LM head) saves ``base_model.model.layers...`` (no inner
    ``model.``) and matches its targets against ``layers.N...`` paths. Such an adapter was refused as
    "unexpected tensor"; it now serves the ForCausalLM's decoder as PEFT's decoder + the checkpoint's
    LM head compute: logits within 1e-4, greedy tokens equal. The regex target matches the
    decoder's own paths only (``model.layers...`` would not fullmatch it)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.fixtures.tiny_models import build_adapter

    path = build_adapter(tiny_llama_dir, tmp_path / "decoder", r=4, seed=21, bare_decoder=True,
                         target_modules=r"layers\.\d+\.(self_attn\.(q_proj|v_proj)|mlp\.up_proj)", rank_pattern={"up_proj": 8})
    runner, slots = make_runner(tiny_llama_dir, {"x": path})
    causal = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    decoder = PeftModel.from_pretrained(causal.model, str(path)).eval()  # the model it was trained on

    def reference_logits(ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return causal.lm_head(decoder(input_ids=ids).last_hidden_state).float()

    prompts = random_prompts(2, PROMPT_LEN, seed=10)
    order = ["x", "x"]
    (ours,) = prefill_chunked(runner, slots, order, prompts, [PROMPT_LEN])
    err = rel_err(ours, reference_logits(prompts)[:, -1])
    assert err.max() < 1e-4, f"relative errors per row {err.tolist()}"
    tokens = greedy(runner, slots, order, prompts)
    ref = prompts
    for _ in range(NEW_TOKENS):
        ref = torch.cat([ref, reference_logits(ref)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(tokens, ref[:, PROMPT_LEN:]), f"ours {tokens.tolist()}\nPEFT {ref[:, PROMPT_LEN:].tolist()}"
    assert not torch.equal(tokens, greedy(runner, slots, [None, None], prompts))  # the adapter changes the tokens
