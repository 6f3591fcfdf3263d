"""The Ascend backend on CPU, against an emulation of torch_npu's documented op semantics.

Everything here is "emulated": it checks the arguments the backend builds for
``npu_grouped_matmul`` / ``npu_batch_gather_matmul_`` (the emulation rejects what the
docs forbid), the plain-torch fallback, where each declared fallback triggers, and
the import-error message. Nothing here has run on Ascend hardware.
"""
from __future__ import annotations

import ast
import zlib
import importlib.util
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from backends import availability as registry_availability
from backends import get_backend
from backends.ascend.backend import AscendBackend
from backends.ascend.import_guard import TorchNpuImportError
from backends.ascend.soc import SocFamily, classify
from backends.reference import ReferenceLoRAOps
from runtime.backend_api import apply_lora
from runtime.lora.batch_meta import LoRABatchMeta
from tests.emulation.lora_grid import POPULARITY, TOLERANCE, expected_float64, make_weights, token_slots
from tests.emulation.whole_model import greedy_tokens, greedy_trace
from tests.emulation.torch_npu_ops import EmulatedTorchNpuOps, NpuOpError
from tests.op_argument_cases import assert_bad_arguments_refused, assert_good_arguments_applied

pytestmark = pytest.mark.emulated

A2 = "Ascend910B2"
ASCEND_SRC = Path(__file__).resolve().parents[1] / "backends" / "ascend"


def seeded(*key) -> torch.Generator:
    """A generator seeded from the test's parameters (stable across runs, distinct per case)."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def emulated_backend(soc: str = A2) -> tuple[AscendBackend, EmulatedTorchNpuOps]:
    """The backend over an emulation enforcing the limits of ``soc``'s product line."""
    family = classify(soc)
    ops = EmulatedTorchNpuOps(chip=family.value if family is not SocFamily.OTHER else "atlas_a2")
    return AscendBackend(device="cpu", npu_ops=ops, soc_name=soc), ops


def run_both(backend, weights, slots, decode_only, dtype, gen, offsets=None):
    """(ascend result, reference-ops result, float64 expectation) for one step."""
    offsets = offsets or [sum(w.out_features for w in weights[:i]) for i in range(len(weights))]
    width = offsets[-1] + weights[-1].out_features
    t = len(slots)
    x = torch.randn(t, weights[0].in_features, generator=gen).to(dtype)
    y0 = torch.randn(t, width, generator=gen).to(dtype)
    meta = LoRABatchMeta.build(slots, "cpu", decode_only=decode_only)
    max_rank = max(w.max_rank for w in weights)
    # Garbage in the workspace: entries beyond a row's rank must never be read.
    ws_a = torch.randn(len(weights), t, max_rank, generator=gen)
    ws_b = ws_a.clone()
    y_npu, y_ref = y0.clone(), y0.clone()
    backend.lora.apply(x, y_npu, weights, meta, offsets, ws_a)
    apply_lora(ReferenceLoRAOps(), x, y_ref, weights, meta, offsets, ws_b)
    return y_npu, y_ref, expected_float64(x, y0, weights, slots, offsets)


def assert_close(y_npu, y_ref, y64, dtype):
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(y_npu.double(), y64, atol=tol, rtol=tol)
    torch.testing.assert_close(y_npu.double(), y_ref.double(), atol=tol, rtol=tol)


# Three slices (q/k/v-like widths), eight slots at mixed ranks, one slot absent from slice 1.
DIMS = [(32, 32), (32, 16), (32, 48)]
RANKS = [
    [16, 8, 32, 16, 4, 32, 16, 8],
    [16, 0, 32, 16, 4, 32, 0, 8],
    [16, 8, 32, 16, 4, 32, 16, 8],
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("popularity", POPULARITY)
def test_emulated_prefill_grouped_matmul_matches_reference(dtype, popularity):
    gen = seeded((str(dtype), popularity))
    backend, ops = emulated_backend()
    weights = make_weights(DIMS, RANKS, dtype, "cpu", gen)
    slots = token_slots(popularity, 24, 8, gen)
    y_npu, y_ref, y64 = run_both(backend, weights, slots, decode_only=False, dtype=dtype, gen=gen)
    assert_close(y_npu, y_ref, y64, dtype)
    assert ops.calls["npu_grouped_matmul"] > 0
    assert backend.fallbacks.counts == {}, "Atlas A2 takes fp16/bf16/fp32 grouped matmul: no fallback is declared"


def test_emulated_prefill_one_call_per_rank_bucket():
    gen = torch.Generator().manual_seed(1)
    backend, ops = emulated_backend()
    weights = make_weights([(32, 32)], [[16, 8, 16, 8, 32]], torch.float32, "cpu", gen)
    slots = [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, -1]
    y_npu, y_ref, y64 = run_both(backend, weights, slots, decode_only=False, dtype=torch.float32, gen=gen)
    assert_close(y_npu, y_ref, y64, torch.float32)
    # ranks {8, 16, 32}: three buckets, each one shrink and one expand call; no padding.
    assert ops.calls["npu_grouped_matmul"] == 6
    assert sorted(ops.groups_per_call) == [1, 1, 2, 2, 2, 2]


def test_emulated_prefill_splits_beyond_128_segments():
    gen = torch.Generator().manual_seed(2)
    backend, ops = emulated_backend()
    n_slots = 130
    weights = make_weights([(16, 16)], [[4] * n_slots], torch.float32, "cpu", gen)
    slots = list(range(n_slots)) + [-1, 5, 129]
    y_npu, y_ref, y64 = run_both(backend, weights, slots, decode_only=False, dtype=torch.float32, gen=gen)
    assert_close(y_npu, y_ref, y64, torch.float32)
    assert ops.groups_per_call == [128, 2, 128, 2]  # shrink split, then expand split


@pytest.mark.parametrize("popularity", POPULARITY)
def test_emulated_decode_fused_and_torch_path_match_reference(popularity):
    """fp16 on A2: ranks 16/32 go to the fused op, ranks 8/4 to the torch path, in one step."""
    gen = seeded(popularity)
    backend, ops = emulated_backend()
    weights = make_weights(DIMS, RANKS, torch.float16, "cpu", gen)
    slots = token_slots(popularity, 16, 8, gen)
    y_npu, y_ref, y64 = run_both(backend, weights, slots, decode_only=True, dtype=torch.float16, gen=gen)
    assert_close(y_npu, y_ref, y64, torch.float16)
    used_ranks = {w.host_rank[s] for w in weights for s in slots if s >= 0}
    assert (ops.calls["npu_batch_gather_matmul"] > 0) == bool(used_ranks & {16, 32})
    assert ("decode:rank" in backend.fallbacks.counts) == bool(used_ranks & {4, 8})


@pytest.mark.parametrize(
    "dtype, rank, fused, reason",
    [
        (torch.float16, 16, True, None),
        (torch.float16, 128, True, None),
        (torch.bfloat16, 16, False, "decode:dtype"),
        (torch.float32, 16, False, "decode:dtype"),
        (torch.float16, 8, False, "decode:rank"),
        (torch.float16, 24, False, "decode:rank"),
        (torch.float16, 256, False, "decode:rank"),
    ],
)
def test_emulated_decode_fallback_triggers_exactly_where_declared(dtype, rank, fused, reason):
    gen = torch.Generator().manual_seed(rank)
    backend, ops = emulated_backend()
    weights = make_weights([(32, 32), (32, 16)], [[rank, rank], [rank, rank]], dtype, "cpu", gen)
    slots = [0, 1, -1, 1, 0]
    y_npu, y_ref, y64 = run_both(backend, weights, slots, decode_only=True, dtype=dtype, gen=gen)
    assert_close(y_npu, y_ref, y64, dtype)
    assert ops.calls["npu_batch_gather_matmul"] == (2 if fused else 0)  # one per slice (one rank bucket)
    assert backend.fallbacks.counts == ({} if fused else {reason: 2})


def test_emulated_decode_slice_as_wide_as_y_falls_back():
    """Docs: H2 < y_column. A lone slice filling y takes the torch path (conservative reading)."""
    gen = torch.Generator().manual_seed(3)
    backend, ops = emulated_backend()
    weights = make_weights([(32, 32)], [[16, 16]], torch.float16, "cpu", gen)
    y_npu, y_ref, y64 = run_both(backend, weights, [0, 1, -1], decode_only=True, dtype=torch.float16, gen=gen)
    assert_close(y_npu, y_ref, y64, torch.float16)
    assert ops.calls["npu_batch_gather_matmul"] == 0
    assert backend.fallbacks.counts == {"decode:slice-width": 1}


def test_emulated_decode_splits_more_than_32_slots_and_refuses_odd_y_widths():
    """AddLora (the kernel under npu_batch_gather_matmul) takes at most 32 weights per call and a
    y width that is a multiple of 16: 40 rank-16 slots run as 32 + 8 per slice, and a slice in a
    y 40 wide takes the torch path."""
    gen = torch.Generator().manual_seed(5)
    backend, ops = emulated_backend()
    weights = make_weights([(32, 32), (32, 16)], [[16] * 40, [16] * 40], torch.float16, "cpu", gen)
    slots = list(range(40)) + [-1, 3, 39]
    y_npu, y_ref, y64 = run_both(backend, weights, slots, decode_only=True, dtype=torch.float16, gen=gen)
    assert_close(y_npu, y_ref, y64, torch.float16)
    assert ops.calls["npu_batch_gather_matmul"] == 4 and backend.fallbacks.counts == {}
    backend, ops = emulated_backend()
    weights = make_weights([(32, 32), (32, 8)], [[16, 16], [16, 16]], torch.float16, "cpu", gen)
    y_npu, y_ref, y64 = run_both(backend, weights, [0, 1, -1], decode_only=True, dtype=torch.float16, gen=gen)
    assert_close(y_npu, y_ref, y64, torch.float16)
    assert ops.calls["npu_batch_gather_matmul"] == 0
    assert backend.fallbacks.counts == {"decode:y-width-multiple-16": 1, "decode:hidden-multiple-16": 1}


def test_emulated_decode_strided_y_takes_the_torch_path():
    """AddLora adds into y's own buffer with rows y_column apart, so a y that is a column window of
    a wider tensor (strided rows) goes to the declared torch path, and the emulation refuses it."""
    gen = torch.Generator().manual_seed(8)
    backend, ops = emulated_backend()
    weights = make_weights([(32, 32), (32, 16)], [[16, 16], [16, 16]], torch.float16, "cpu", gen)
    slots = [0, 1, -1, 1, 0]
    x = torch.randn(5, 32, generator=gen).half()
    wide = torch.randn(5, 64, generator=gen).half()
    y = wide[:, :48]
    assert not y.is_contiguous()
    y0, outside = y.clone(), wide[:, 48:].clone()
    meta = LoRABatchMeta.build(slots, "cpu", decode_only=True)
    backend.lora.apply(x, y, weights, meta, [0, 32], torch.randn(2, 5, 16, generator=gen))
    want = expected_float64(x, y0, weights, slots, [0, 32])
    torch.testing.assert_close(y.double(), want, atol=TOLERANCE[torch.float16], rtol=TOLERANCE[torch.float16])
    assert torch.equal(wide[:, 48:], outside)
    assert ops.calls["npu_batch_gather_matmul"] == 0
    assert backend.fallbacks.counts == {"decode:y-not-contiguous": 2}


def test_emulated_fallback_logged_once_per_reason(caplog):
    gen = torch.Generator().manual_seed(4)
    backend, _ = emulated_backend()
    weights = make_weights([(32, 32), (32, 16)], [[8, 8], [8, 8]], torch.float16, "cpu", gen)
    with caplog.at_level(logging.WARNING, logger="lorafleet.backends.ascend"):
        for _ in range(3):
            run_both(backend, weights, [0, 1], decode_only=True, dtype=torch.float16, gen=gen)
    assert backend.fallbacks.counts == {"decode:rank": 6}
    assert [r.getMessage().count("decode:rank") for r in caplog.records] == [1]
    # The once-state belongs to the backend object: a new backend logs again.
    other, _ = emulated_backend()
    with caplog.at_level(logging.WARNING, logger="lorafleet.backends.ascend"):
        run_both(other, weights, [0, 1], decode_only=True, dtype=torch.float16, gen=gen)
    assert len(caplog.records) == 2


@pytest.mark.parametrize("decode_only", [False, True])
@pytest.mark.parametrize("popularity", POPULARITY)
def test_emulated_torch_path_matches_reference(decode_only, popularity):
    """A SoC the docs do not cover (A3 name): every call takes the torch path, and no op is used."""
    gen = seeded((decode_only, popularity))
    backend, ops = emulated_backend(soc="Ascend910_9392")
    weights = make_weights(DIMS, RANKS, torch.float32, "cpu", gen)
    slots = token_slots(popularity, 20, 8, gen)
    y_npu, y_ref, y64 = run_both(backend, weights, slots, decode_only=decode_only, dtype=torch.float32, gen=gen)
    assert_close(y_npu, y_ref, y64, torch.float32)
    assert sum(ops.calls.values()) == 0
    if any(s >= 0 for s in slots):
        assert set(backend.fallbacks.counts) == {"decode:soc" if decode_only else "prefill:soc"}


def test_emulated_310p_prefill_falls_back_where_n_is_not_a_multiple_of_16():
    gen = torch.Generator().manual_seed(5)
    backend, ops = emulated_backend(soc="Ascend310P3")
    weights = make_weights([(32, 48)], [[8, 16]], torch.float16, "cpu", gen)
    y_npu, y_ref, y64 = run_both(backend, weights, [0, 1, 1, -1, 0], decode_only=False, dtype=torch.float16, gen=gen)
    assert_close(y_npu, y_ref, y64, torch.float16)
    # shrink: rank 8 (N=8) falls back, rank 16 runs; expand: N=48 runs for both buckets.
    assert ops.calls["npu_grouped_matmul"] == 3
    assert backend.fallbacks.counts == {"prefill:n-multiple-16": 1}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_emulated_310p_prefill_in_other_dtypes_takes_the_torch_path(dtype):
    """310P's grouped matmul takes fp16 only: the emulation refuses other dtypes, and the backend never sends them."""
    gen = torch.Generator().manual_seed(7)
    backend, ops = emulated_backend(soc="Ascend310P3")
    with pytest.raises(NpuOpError, match="Atlas 310P"):
        ops.npu_grouped_matmul([torch.randn(4, 32, dtype=dtype)], [torch.randn(1, 32, 16, dtype=dtype)], split_item=2,
                               group_type=0, group_list=torch.tensor([4]))  # fmt: skip
    weights = make_weights([(32, 48)], [[16, 16]], dtype, "cpu", gen)
    y_npu, y_ref, y64 = run_both(backend, weights, [0, 1, 1, -1, 0], decode_only=False, dtype=dtype, gen=gen)
    assert_close(y_npu, y_ref, y64, dtype)
    assert ops.calls["npu_grouped_matmul"] == 0 and set(backend.fallbacks.counts) == {"prefill:dtype"}


@pytest.mark.parametrize("soc", ["Ascend310P3", "Ascend310B1", "Ascend910A", "Ascend910ProB"])
def test_engine_refuses_bfloat16_on_a_chip_without_it_and_serves_float16(soc, tiny_llama_dir, monkeypatch):
    """bf16 on a product line whose docs mark it unsupported is refused at engine start, with the
    dtype to use instead, before any weight is read; float16 still builds an engine there. An A2
    or A3 keeps bf16 (the whole-model bf16 test above runs on an A2)."""
    from runtime.capabilities import CapabilityError
    from runtime.config import EngineConfig
    from runtime.engine import LLMEngine
    from runtime.model_runner import ModelRunner

    backend, _ = emulated_backend(soc=soc)
    built = []
    monkeypatch.setattr(ModelRunner, "__init__", lambda self, *a, **k: built.append(a) or (_ for _ in ()).throw(RuntimeError("stop")))
    with pytest.raises(CapabilityError, match=f"dtype bfloat16 is not supported on this device: {soc} has no bfloat16.*--dtype float16"):
        LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="bfloat16"), backend=backend)
    assert built == []  # refused before the runner (and its weights)
    with pytest.raises(RuntimeError, match="stop"):
        LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float16"), backend=backend)
    assert len(built) == 1
    assert emulated_backend(soc="Ascend910B2")[0].dtype_problem("bfloat16") is None
    assert emulated_backend(soc="Ascend910_9391")[0].dtype_problem("bfloat16") is None


def test_emulated_apply_lora_reaches_the_fused_op_and_split_calls_take_the_torch_path():
    """runtime apply_lora hands x and y to the backend's fused apply (npu_batch_gather_matmul);
    separate shrink/expand calls cannot use the fused op and take the declared torch path."""
    gen = torch.Generator().manual_seed(6)
    weights = make_weights(DIMS, RANKS, torch.float16, "cpu", gen)
    slots = [0, 2, -1, 5, 3]
    x = torch.randn(5, 32, generator=gen).half()
    y0 = torch.randn(5, 96, generator=gen).half()
    meta = LoRABatchMeta.build(slots, "cpu", decode_only=True)
    want = expected_float64(x, y0, weights, slots, [0, 32, 48])

    y_ref = y0.clone()
    apply_lora(ReferenceLoRAOps(), x, y_ref, weights, meta, [0, 32, 48], torch.randn(3, 5, 32, generator=gen))

    backend, ops = emulated_backend()
    y = y0.clone()
    apply_lora(backend.lora, x, y, weights, meta, [0, 32, 48], torch.randn(3, 5, 32, generator=gen))
    assert_close(y, y_ref, want, torch.float16)
    assert ops.calls["npu_batch_gather_matmul"] > 0
    assert "decode:split-call" not in backend.fallbacks.counts

    backend, ops = emulated_backend()
    y = y0.clone()
    h = torch.randn(3, 5, 32, generator=gen)
    backend.lora.shrink(x, weights, meta, h)
    backend.lora.expand(h, weights, meta, y, [0, 32, 48])
    assert_close(y, y_ref, want, torch.float16)
    assert sum(ops.calls.values()) == 0
    assert backend.fallbacks.counts == {"decode:split-call": 2}


def test_emulated_mismatched_dtype_is_a_clear_error():
    gen = torch.Generator().manual_seed(7)
    backend, _ = emulated_backend()
    weights = make_weights([(32, 32)], [[16]], torch.float16, "cpu", gen)
    meta = LoRABatchMeta.build([0], "cpu")
    with pytest.raises(ValueError, match="x is torch.float32 but slice 0's a_rows are torch.float16"):
        backend.lora.apply(torch.randn(1, 32), torch.randn(1, 32), weights, meta, [0], torch.zeros(1, 1, 16))


@pytest.mark.parametrize("decode_only", [False, True])
def test_emulated_ops_refuse_what_they_cannot_honour(decode_only):
    """As the cuda launchers: a batch description for other rows than the activations (prefill gave
    the extra rows no LoRA), a slot the weights lack (a bare IndexError), offsets that are not
    integers (2.5: a bare TypeError; True: column 1), and outputs whose rows share memory (a
    broadcast workspace gave wrong sums in prefill) are errors that name the argument."""
    gen = torch.Generator().manual_seed(11)
    backend, _ = emulated_backend()
    weights = make_weights([(32, 32)], [[16, 16, 16, 16]], torch.float16, "cpu", gen)
    x, y, ws = torch.randn(8, 32).half(), torch.randn(8, 48).half(), torch.zeros(1, 8, 16)
    assert_bad_arguments_refused(lambda x_, y_, meta_, offsets, ws_: backend.lora.apply(x_, y_, weights, meta_, offsets, ws_), x, y, ws, decode_only)
    # The same call with good arguments runs, and gives every row its own update.
    assert_good_arguments_applied(lambda x_, y_, meta_, offsets, ws_: backend.lora.apply(x_, y_, weights, meta_, offsets, ws_),
                                  weights, x, y, ws, decode_only, 16, TOLERANCE[torch.float16])  # fmt: skip


def test_emulated_whole_model_greedy_matches_cpu_backend(tiny_llama_dir, tiny_adapters):
    """ModelRunner on the emulated Ascend backend (grouped matmul prefill, torch-path decode)
    produces the cpu backend's greedy tokens exactly, in fp32, over a mixed-adapter batch."""
    backend, ops = emulated_backend()
    ours = greedy_tokens(tiny_llama_dir, tiny_adapters, "cpu", backend)
    assert torch.equal(ours, greedy_tokens(tiny_llama_dir, tiny_adapters, "cpu", get_backend("cpu")))
    assert ops.calls["npu_grouped_matmul"] > 0


@pytest.mark.parametrize("dtype, mantissa_bits, atol", [("float16", 10, 0.05), ("bfloat16", 7, 0.2)])
def test_emulated_whole_model_in_half_precision_stays_close_to_the_cpu_backend(tiny_llama_dir, tiny_adapters, dtype, mantissa_bits, atol):
    """fp16 (fused decode op, grouped prefill) and bf16 (grouped prefill, torch decode), fed the
    cpu backend's tokens: logits within the dtype's rounding (cpu bf16 vs fp32 differs by ~0.1 on
    this model), and the same argmax wherever the cpu's top two logits are more than 4 rounding
    steps apart (near-ties may go either way: the ops round at other points than torch's)."""
    backend, ops = emulated_backend()
    cpu_tokens, cpu_logits = greedy_trace(tiny_llama_dir, tiny_adapters, "cpu", get_backend("cpu"), dtype)
    ours, our_logits = greedy_trace(tiny_llama_dir, tiny_adapters, "cpu", backend, dtype, forced=cpu_tokens)
    torch.testing.assert_close(our_logits, cpu_logits, rtol=0.0, atol=atol)
    top2 = cpu_logits.topk(2, dim=-1).values
    step = 2.0 ** (torch.floor(torch.log2(top2[..., 0].abs().clamp_min(1e-6))) - mantissa_bits)
    clear = (top2[..., 0] - top2[..., 1]) > 4 * step
    assert int(clear.sum()) >= clear.numel() // 2
    assert torch.equal(ours[clear], cpu_tokens[clear])
    assert ops.calls["npu_grouped_matmul"] > 0
    if dtype == "float16":
        assert ops.calls["npu_batch_gather_matmul"] > 0  # the fused decode op ran inside the model


# ------------------------------------------------------------------ the emulation itself
def test_emulation_enforces_documented_limits():
    ops = EmulatedTorchNpuOps()
    x = torch.randn(6, 32)
    w = torch.randn(2, 32, 16)
    gl = torch.tensor([2, 6], dtype=torch.int64)
    (out,) = ops.npu_grouped_matmul([x], [w], group_list=gl, split_item=2, group_type=0, group_list_type=0)
    torch.testing.assert_close(out, torch.cat([x[:2] @ w[0], x[2:] @ w[1]]))
    bad = {
        "last cumsum": dict(group_list=torch.tensor([2, 5], dtype=torch.int64)),
        "non-decreasing": dict(group_list=torch.tensor([4, 2], dtype=torch.int64)),
        "int64": dict(group_list=torch.tensor([2, 6], dtype=torch.int32)),
        "length 1": dict(group_list=torch.tensor([6], dtype=torch.int64), group_list_type=1, w=w[:1]),
        "split_item": dict(split_item=0),
    }
    for what, kw in bad.items():
        args = dict(group_list=gl, split_item=2, group_type=0, group_list_type=0) | kw
        weight = args.pop("w", w)
        with pytest.raises(NpuOpError):
            ops.npu_grouped_matmul([x], [weight], **args)
    with pytest.raises(NpuOpError, match="1..128"):
        ops.npu_grouped_matmul([x] * 129, [w] * 129, group_list=gl, split_item=2, group_type=0)
    with pytest.raises(NpuOpError, match="dtypes"):
        ops.npu_grouped_matmul([x.half()], [w], group_list=gl, split_item=2, group_type=0)
    with pytest.raises(NpuOpError, match="must not be transposed"):  # "x不支持转置"
        ops.npu_grouped_matmul([torch.randn(32, 6).t()], [w], group_list=gl, split_item=2, group_type=0)

    y = torch.randn(4, 64).half()
    xb = torch.randn(4, 32).half()
    wa = torch.randn(2, 1, 16, 32).half()
    wb = torch.randn(2, 1, 48, 16).half()
    idx = torch.tensor([0, -1, 1, 0], dtype=torch.int32)
    y0 = y.clone()
    ops.npu_batch_gather_matmul_(y, xb, wb, idx, wa, layer_idx=0, scale=0.5, y_offset=8, y_slice_size=48)
    want = y0.float().clone()
    for b, w_i in enumerate(idx.tolist()):
        if w_i >= 0:
            want[b, 8:56] += 0.5 * (xb[b].float() @ wa[w_i, 0].float().t()) @ wb[w_i, 0].float().t()
    torch.testing.assert_close(y.float(), want, atol=2e-2, rtol=2e-2)
    assert torch.equal(y[1], y0[1]) and torch.equal(y[:, :8], y0[:, :8])
    rejects = [
        dict(input=y.float()),  # fp16 only
        dict(weight_a=torch.randn(2, 1, 8, 32).half(), weight_b=torch.randn(2, 1, 48, 8).half()),  # R < 16
        dict(indices=idx.long()),  # int32 only
        dict(y_slice_size=64, y_offset=0, weight_b=torch.randn(2, 1, 64, 16).half()),  # H2 == y_column
        dict(layer_idx=1),
        dict(input=torch.randn(4, 72).half()),  # AddLora: y_column a multiple of 16
        dict(weight_a=torch.randn(33, 1, 16, 32).half(), weight_b=torch.randn(33, 1, 48, 16).half()),  # AddLora: W <= 32
        dict(y_slice_size=-1),  # -1 means y_column (64), above H2 (48)
        dict(input=torch.randn(4, 80).half()[:, :64]),  # AddLora adds into input's buffer, rows y_column apart
    ]
    base = dict(input=y, x=xb, weight_b=wb, indices=idx, weight_a=wa, layer_idx=0, scale=1.0, y_offset=8, y_slice_size=48)
    for kw in rejects:
        with pytest.raises(NpuOpError):
            ops.npu_batch_gather_matmul_(**(base | kw))
    with pytest.raises(NpuOpError, match="Atlas A2 only"):  # its page: "支持的型号: Atlas A2"
        EmulatedTorchNpuOps(chip="atlas_inference_310p").npu_batch_gather_matmul_(**base)


# ------------------------------------------------------------------ import and code review
@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="torch_npu is installed here")
def test_emulated_import_error_is_one_clear_line():
    ok, reason = AscendBackend.availability()
    assert not ok
    assert reason.startswith("npu backend needs torch_npu and the CANN toolkit: ModuleNotFoundError: ")
    assert "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in reason and "\n" not in reason
    assert registry_availability("npu") == (ok, reason)
    with pytest.raises(TorchNpuImportError) as err:
        AscendBackend()
    assert str(err.value) == reason


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="torch_npu is installed here")
def test_emulated_probe_npu_prints_one_line_and_fails():
    proc = subprocess.run(
        [sys.executable, "-m", "runtime.cli", "probe", "--device", "npu"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 3  # device absent (lorafleet probe --help: exit status)
    assert "npu backend needs torch_npu and the CANN toolkit" in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr


IMPORT_EVERY_MODULE = """
import importlib, pkgutil, sys
import backends
imported, failed = 0, []
for package in ("runtime", "backends"):
    for info in pkgutil.walk_packages(importlib.import_module(package).__path__, package + "."):
        try:
            importlib.import_module(info.name)
            imported += 1
        except ImportError:  # an optional dependency missing here (fastapi, triton, ray...)
            failed.append(info.name)
backends.resolve_name("cpu"), backends.availability("cpu"), backends.get_backend("cpu")
print("torch_npu" in sys.modules, imported, " ".join(failed))
"""


def test_importing_runtime_and_backends_never_imports_torch_npu(tmp_path):
    """Every module of runtime/ and backends/, and choosing the cpu backend, leave torch_npu alone.
    A stand-in torch_npu that imports cleanly is first on the path, so a guarded eager import
    (``try: import torch_npu except ImportError``) is caught too, not only a bare one: without the
    stand-in such an import fails quietly here and the check could not see it."""
    (tmp_path / "torch_npu").mkdir()
    (tmp_path / "torch_npu" / "__init__.py").write_text("")
    # Where torch_npu is installed, torch's device-backend autoload imports it in `import torch`
    # itself, whatever lorafleet does; switched off, the check is about lorafleet's imports alone.
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", PYTHONPATH=os.pathsep.join([str(tmp_path), root]))
    out = subprocess.run([sys.executable, "-c", IMPORT_EVERY_MODULE], capture_output=True, text=True, timeout=300, check=True,
                         env=env, cwd=root)  # fmt: skip
    npu_imported, modules, *failed = out.stdout.split()
    assert npu_imported == "False"
    assert int(modules) >= 50, out.stdout  # the walk reached the modules (failed: those an optional dependency kept out)
    probe = subprocess.run([sys.executable, "-c", "import torch_npu, sys; print(torch_npu.__file__)"], capture_output=True,
                           text=True, timeout=120, check=True, env=env, cwd=root)  # fmt: skip
    assert probe.stdout.strip().startswith(str(tmp_path))  # the stand-in is what an import would find


FORBIDDEN_CALLS = {"cpu", "item", "numpy", "tolist"}
FACTORIES = {"tensor", "zeros", "ones", "empty", "full", "arange", "randn", "rand", "eye", "linspace"}


def test_code_review_ascend_source_has_no_host_reads_and_creates_tensors_on_device():
    files = sorted(ASCEND_SRC.glob("*.py"))
    assert {p.name for p in files} >= {"backend.py", "lora_ops.py", "grouped_matmul.py", "batch_gather.py", "torch_path.py"}
    problems = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            attr = node.func.attr
            where = f"{path.name}:{node.lineno}"
            if attr in FORBIDDEN_CALLS:
                problems.append(f"{where} calls .{attr}()")
            if attr in {"to", "copy_"} and any(isinstance(a, ast.Constant) and a.value == "cpu" for a in node.args):
                problems.append(f"{where} moves a tensor to the cpu")
            is_torch = isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
            if is_torch and attr in FACTORIES and not any(k.arg == "device" for k in node.keywords):
                problems.append(f"{where} torch.{attr}(...) without device=")
    assert problems == []


def test_no_visible_device_is_a_clear_error(monkeypatch):
    """torch_npu's get_device_name asserts ("Invalid device id") when no device is visible."""
    from types import SimpleNamespace

    from backends.ascend import import_guard

    def no_device(device=None):
        raise AssertionError("Invalid device id")

    monkeypatch.setattr(import_guard, "import_torch_npu", lambda: SimpleNamespace(npu=SimpleNamespace(get_device_name=no_device)))
    with pytest.raises(RuntimeError, match=r"cannot read the name of device cpu .*AssertionError: Invalid device id.*visible"):
        AscendBackend(device="cpu", npu_ops=EmulatedTorchNpuOps())  # "npu" is a device type only once torch_npu is imported


# ---- benchmarks/ascend/run_all.sh's plumbing, with a stand-in interpreter (no device needed) ----

ASCEND_SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "ascend" / "run_all.sh"


def _junit(*cases: tuple[str, str, str]) -> str:
    """(classname, name, outcome) per test case, outcome passed | skipped, as pytest's junit XML writes them."""
    body = "".join(f'<testcase classname="{c}" name="{n}">' + ("<skipped message='no device'/>" if o == "skipped" else "")
                   + "</testcase>" for c, n, o in cases)
    return f"<testsuites><testsuite>{body}</testsuite></testsuites>"


def _run_ascend_script(tmp_path: Path, junit: str | None, env_changes: dict[str, str | None] | None = None) -> tuple[int, Path]:
    """Run the script with PYTHON set to a stand-in that runs inline scripts given arguments (the junit
    summary) with the real interpreter, copies ``junit`` (if given) to pytest's --junitxml path, and
    succeeds at everything else (env.json's inline script, which would import torch, prints {}).
    ``env_changes``: variables to set, or with None to unset, on top of the default environment."""
    if junit is not None:
        (tmp_path / "junit.xml").write_text(junit)
    fake = tmp_path / "fakepy"
    fake.write_text(f"""#!/bin/bash
for a in "$@"; do case "$a" in --junitxml=*) [ -f {tmp_path}/junit.xml ] && cp {tmp_path}/junit.xml "${{a#--junitxml=}}";; esac; done
if [ -n "${{FAKE_HANG:-}}" ] && [[ " $* " == *" $FAKE_HANG "* ]]; then exec sleep 60; fi
if [ "$1" = "-" ] && [ $# -gt 1 ]; then exec {sys.executable} "$@"; fi
if [ "$1" = "-" ]; then cat > /dev/null; echo '{{}}'; fi
exit 0
""")
    fake.chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": str(fake), "ASCEND_TOOLKIT_HOME": "/nonexistent"}
    for key, value in (env_changes or {}).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    done = subprocess.run(["bash", str(ASCEND_SCRIPT), str(out)], env=env, capture_output=True, text=True, timeout=120)
    return done.returncode, out


def test_ascend_script_a_hung_part_times_out_and_the_others_still_run(tmp_path: Path) -> None:
    """The tests part hangs (the stand-in sleeps on pytest's arguments): it is stopped after
    ASCEND_PART_TIMEOUT_S with rc 124, the probe and the benchmark still run, and the run fails."""
    junit = _junit(("tests.test_ascend_npu", "test_a", "passed"))
    rc, out = _run_ascend_script(tmp_path, junit, {"ASCEND_PART_TIMEOUT_S": "2", "FAKE_HANG": "pytest"})
    summary = json.loads((out / "summary.json").read_text())
    assert rc != 0 and summary["tests_rc"] == 124 and summary["probe_rc"] == 0 and summary["bench_rc"] == 0, summary


@pytest.mark.parametrize("hardware, rc", [("skipped", 3), ("passed", 0), (None, 3)])
def test_ascend_script_fails_when_no_hardware_test_passed(tmp_path: Path, hardware: str | None, rc: int) -> None:
    """Without a device every hardware test skips (here: the module-level skip, as pytest records it) while
    the emulated ones pass, and pytest exits 0: the run must not count that as verified. No junit at all
    (pytest killed) fails too."""
    import json

    cases = [("tests.test_ascend_emulated", "test_emulated_prefill", "passed")]
    if hardware == "skipped":
        cases.append(("", "tests.test_ascend_npu", "skipped"))
    elif hardware == "passed":
        cases += [("tests.test_ascend_npu", "test_npu_more_than_128_segments", "passed"), ("tests.test_ascend_npu", "test_npu_x", "skipped")]
    code, out = _run_ascend_script(tmp_path, None if hardware is None else _junit(*cases))
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["tests_rc"], summary["probe_rc"], summary["bench_rc"]) == (rc, 0, 0)
    assert code == (0 if rc == 0 else 1)
    counts = json.loads((out / "npu_tests.json").read_text())
    if hardware is None:
        assert "was not written" in counts["error"]
    else:
        assert counts["hardware"]["passed"] == (1 if hardware == "passed" else 0) and counts["emulated"]["passed"] == 1


def test_ascend_script_survives_a_toolkit_set_env_that_reads_unset_variables(tmp_path: Path) -> None:
    """Without CANN's environment loaded the script sources the toolkit's set_env.sh, a vendor script that
    may append to PYTHONPATH and LD_LIBRARY_PATH whether or not they are set. Under the script's `set -u`
    the first unset one ended the run there, before any part ran and with no summary.json. (PYTHONPATH
    is the one unset here: LD_LIBRARY_PATH may be what this interpreter needs to start.)"""
    import json

    set_env = tmp_path / "set_env.sh"
    set_env.write_text(f"""export LD_LIBRARY_PATH=/nonexistent/lib64:$LD_LIBRARY_PATH
export PYTHONPATH=/nonexistent/python/site-packages:$PYTHONPATH
touch {tmp_path}/sourced
""")
    junit = _junit(("tests.test_ascend_npu", "test_npu_more_than_128_segments", "passed"))
    code, out = _run_ascend_script(tmp_path, junit, {"ASCEND_TOOLKIT_HOME": None, "ASCEND_SET_ENV": str(set_env), "PYTHONPATH": None})
    assert (tmp_path / "sourced").is_file()
    summary = json.loads((out / "summary.json").read_text())
    assert (code, summary["tests_rc"], summary["probe_rc"], summary["bench_rc"]) == (0, 0, 0, 0)
