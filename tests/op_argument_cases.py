"""Arguments every backend's LoRA ops must refuse (runtime/lora/op_arguments.py), as one table
the per-backend tests run through their own ``apply``."""
from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from runtime.lora.batch_meta import LoRABatchMeta

ROW_SLOTS = [0, 1, 2, 3, 0, 1, 2, 3]  # eight rows over four slots


def assert_bad_arguments_refused(apply: Callable[..., None], x: torch.Tensor, y: torch.Tensor, workspace: torch.Tensor, decode_only: bool) -> None:
    """``apply(x, y, meta, offsets, workspace)`` over weights with four slots and one slice at
    offset 0, with ``len(ROW_SLOTS)`` rows: each bad argument is a ValueError naming it."""
    def meta(slots: list[int]) -> LoRABatchMeta:
        return LoRABatchMeta.build(slots, "cpu", decode_only=decode_only)

    rows, width = y.shape
    rank = workspace.shape[2]
    cases: list[tuple[dict[str, Any], str]] = [
        (dict(meta=meta(ROW_SLOTS[:4])), f"meta has 4 token rows, the activations have {rows}"),  # the rest got no LoRA
        (dict(meta=meta([7] + ROW_SLOTS[1:])), "meta uses slot 7, the weights have only 4 slots"),  # was a bare IndexError
        (dict(offsets=[2.5]), r"slice_offsets must be integers >= 0, got \(2.5,\)"),  # was a bare TypeError
        (dict(offsets=[True]), r"slice_offsets must be integers >= 0, got \(True,\)"),  # was column 1
        (dict(y=torch.zeros(1, width, dtype=y.dtype).expand(rows, width)), "y's rows share memory"),
        (dict(workspace=torch.zeros(1, 1, rank).expand(1, rows, rank)), "out's elements share memory"),
    ]
    for change, message in cases:
        args = dict(x=x, y=y.clone(), meta=meta(ROW_SLOTS), offsets=[0], workspace=workspace) | change
        with pytest.raises(ValueError, match=message):
            apply(args["x"], args["y"], args["meta"], args["offsets"], args["workspace"])


GOOD_SLOTS = [0, 1, -1, 3, 0, 1, 2, 3]  # the same rows with one on the base model


def assert_good_arguments_applied(apply: Callable[..., None], weights: Any, x: torch.Tensor, y: torch.Tensor, workspace: torch.Tensor,
                                  decode_only: bool, offset: int, tolerance: float) -> None:
    """The call ``assert_bad_arguments_refused`` varies, with good arguments, at slice offset ``offset``
    over ``GOOD_SLOTS``: each row gets its own slot's update (float64 reference), the base-model row and
    the columns outside the slice keep their bits."""
    from tests.emulation.lora_grid import expected_float64

    got = y.clone()
    apply(x, got, LoRABatchMeta.build(GOOD_SLOTS, "cpu", decode_only=decode_only), [offset], workspace)
    want = expected_float64(x, y, weights, GOOD_SLOTS, [offset])
    torch.testing.assert_close(got.double(), want, atol=tolerance, rtol=tolerance)
    base_row = GOOD_SLOTS.index(-1)
    assert torch.equal(got[base_row], y[base_row]) and torch.equal(got[:, :offset], y[:, :offset])
    assert not torch.equal(got, y)
