"""Ascend hardware tests (marker ``npu``): the op grid with the real torch_npu operators,
and a whole-model greedy comparison against the cpu backend.

Run where torch_npu, CANN and an Ascend device exist:
    python -m pytest -m npu tests/test_ascend_npu.py
Deselected by default (pyproject addopts) and skipped when the backend is unavailable.
Not yet run: no Ascend machine has been available (see docs/platforms.md).
"""
from __future__ import annotations

import zlib

import pytest
import torch

from backends import get_backend
from backends.ascend.backend import AscendBackend
from runtime.lora.batch_meta import LoRABatchMeta
from tests.emulation.whole_model import greedy_tokens
from tests.emulation.lora_grid import POPULARITY, TOLERANCE, expected_float64, make_weights, token_slots

pytestmark = pytest.mark.npu

_OK, _REASON = AscendBackend.availability()
if not _OK:
    pytest.skip(_REASON, allow_module_level=True)

DIMS = [(64, 64), (64, 32), (64, 96)]
RANKS = [
    [16, 8, 32, 16, 4, 128, 16, 256],
    [16, 0, 32, 16, 4, 128, 0, 256],
    [16, 8, 32, 16, 4, 128, 16, 256],
]


def seeded(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


@pytest.fixture(scope="module")
def backend() -> AscendBackend:
    return AscendBackend()


def run_step(backend, weights, slots, decode_only, dtype, gen, fused_entry):
    offsets = [sum(w.out_features for w in weights[:i]) for i in range(len(weights))]
    width = offsets[-1] + weights[-1].out_features
    t = len(slots)
    x = (torch.randn(t, weights[0].in_features, generator=gen)).to(dtype)
    y0 = torch.randn(t, width, generator=gen).to(dtype)
    meta = LoRABatchMeta.build(slots, backend.device, decode_only=decode_only)
    ws = torch.randn(len(weights), t, max(w.max_rank for w in weights), generator=gen).to(backend.device)
    y = y0.to(backend.device, copy=True)  # y is updated in place; y0 stays the input
    xd = x.to(backend.device)
    if fused_entry:
        backend.lora.apply(xd, y, weights, meta, offsets, ws)
    else:
        h = ws[: len(weights), :t]
        backend.lora.shrink(xd, weights, meta, h)
        backend.lora.expand(h, weights, meta, y, offsets)
    backend.synchronize()
    return y.cpu().double(), expected_float64(x, y0, weights, slots, offsets)


@pytest.mark.parametrize("fused_entry", [True, False])
@pytest.mark.parametrize("decode_only", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("popularity", POPULARITY)
def test_npu_ops_match_float64(backend, popularity, dtype, decode_only, fused_entry):
    if dtype == torch.bfloat16 and backend.dtype_problem("bfloat16"):
        pytest.skip(backend.dtype_problem("bfloat16"))  # the engine refuses bf16 on this chip (tested on CPU)
    gen = seeded(popularity, str(dtype), decode_only, fused_entry)
    weights = make_weights(DIMS, RANKS, dtype, backend.device, gen)
    slots = token_slots(popularity, 40, 8, gen)
    got, want = run_step(backend, weights, slots, decode_only, dtype, gen, fused_entry)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_npu_more_than_128_segments(backend):
    gen = seeded("split")
    weights = make_weights([(64, 32)], [[16] * 130], torch.float16, backend.device, gen)
    slots = list(range(130)) + [-1, 7]
    got, want = run_step(backend, weights, slots, False, torch.float16, gen, True)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_npu_whole_model_greedy_matches_cpu(backend, tiny_llama_dir, tiny_adapters):
    """fp32 greedy tokens on npu equal the cpu backend's, over a mixed-adapter batch."""
    ours = greedy_tokens(tiny_llama_dir, tiny_adapters, "npu", backend)
    assert torch.equal(ours, greedy_tokens(tiny_llama_dir, tiny_adapters, "cpu", get_backend("cpu")))
