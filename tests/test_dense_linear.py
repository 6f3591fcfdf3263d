"""runtime.models.dense: the CPU base GEMM on oneDNN matches a float64 product, other dtypes keep
F.linear bit for bit; benchmarks/cpu_gemm.py checks both kernels and times them."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from benchmarks import cpu_gemm
from runtime.models import dense
from runtime.models.dense import dense_linear


@pytest.mark.parametrize("rows", [(0,), (1,), (11,), (2, 5)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("out_features", [40, 1024])  # a small weight (F.linear) and one of 2^18 elements (oneDNN)
def test_float32_matches_a_float64_product(rows, with_bias, out_features):
    gen = torch.Generator().manual_seed(sum(rows) + with_bias)
    x, w = torch.randn(*rows, 256, generator=gen), torch.randn(out_features, 256, generator=gen)
    b = torch.randn(out_features, generator=gen) if with_bias else None
    y = dense_linear(x, w, b)
    want = x.double() @ w.double().T + (0 if b is None else b.double())
    assert y.dtype == torch.float32 and y.shape == (*rows, out_features)
    if want.numel():
        assert ((y.double() - want).abs().max() / want.abs().max()).item() < 1e-6


def test_small_weights_stay_on_f_linear_and_large_ones_take_onednn(monkeypatch):
    calls = []
    onednn = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *args: calls.append(args[1].numel()) or onednn(*args))
    gen = torch.Generator().manual_seed(3)
    small, large = torch.randn(1023, 256, generator=gen), torch.randn(1024, 256, generator=gen)
    x = torch.randn(5, 256, generator=gen)
    assert torch.equal(dense_linear(x, small), F.linear(x, small))
    dense_linear(x, large)
    assert calls == ([1 << 18] if dense.ONEDNN_LINEAR else [])


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_other_dtypes_are_f_linear(dtype):
    gen = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(9, 32, generator=gen).to(dtype), torch.randn(24, 32, generator=gen).to(dtype), torch.randn(24, generator=gen).to(dtype)
    assert torch.equal(dense_linear(x, w, b), F.linear(x, w, b))


def test_without_onednn_it_is_f_linear(monkeypatch):
    monkeypatch.setattr(dense, "ONEDNN_LINEAR", False)
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(11, 64, generator=gen), torch.randn(96, 64, generator=gen)
    assert torch.equal(dense.dense_linear(x, w), F.linear(x, w))


def test_the_script_checks_and_times_both_kernels(tmp_path, capsys):
    out = tmp_path / "gemm.json"
    assert cpu_gemm.main(["--hidden", "64", "--layers", "1", "--rows", "1,3", "--rounds", "1", "--json", str(out)]) == 0
    rows = capsys.readouterr().out.splitlines()[2:]
    assert [r.split()[0] for r in rows] == ["1", "3"] and all(r.endswith("x") for r in rows)
    report = json.loads(out.read_text())
    assert [r["rows"] for r in report["results"]] == [1, 3] and report["onednn"] == dense.ONEDNN_LINEAR
    assert all(r["dense_linear_ms"] > 0 and r["f_linear_ms"] > 0 and r["ratio"] > 0 for r in report["results"])


def test_the_script_refuses_a_wrong_kernel(monkeypatch, capsys):
    monkeypatch.setattr(cpu_gemm, "dense_linear", lambda x, w: F.linear(x, w) * 1.001)
    assert cpu_gemm.main(["--hidden", "64", "--layers", "1", "--rows", "2", "--rounds", "1"]) == 1
    assert "differ from the float64 product" in capsys.readouterr().err
