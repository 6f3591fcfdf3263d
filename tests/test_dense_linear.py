"""runtime.models.dense: the CPU base GEMM on oneDNN matches a float64 product, in float32 and (packed,
where the CPU runs bf16 natively) bfloat16; other dtypes and plain bf16 weights keep F.linear bit for
bit; benchmarks/cpu_gemm.py checks the kernels and times them."""
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
@pytest.mark.parametrize("out_features", [40, 1024])  # a small weight (never packed) and one of 2^18 elements (packable)
@pytest.mark.parametrize("packed", [False, True])
def test_float32_matches_a_float64_product(rows, with_bias, out_features, packed):
    gen = torch.Generator().manual_seed(sum(rows) + with_bias)
    x, w = torch.randn(*rows, 256, generator=gen), torch.randn(out_features, 256, generator=gen)
    b = torch.randn(out_features, generator=gen) if with_bias else None
    y = dense_linear(x, dense.pack_weight(w, float32=True) if packed else w, b)
    want = x.double() @ w.double().T + (0 if b is None else b.double())
    assert y.dtype == torch.float32 and y.shape == (*rows, out_features)
    if want.numel():
        assert ((y.double() - want).abs().max() / want.abs().max()).item() < 1e-6


def test_plain_weights_take_f_linear_and_packed_ones_onednn(monkeypatch):
    calls = []
    onednn = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *args: calls.append(args[0].shape[0]) or onednn(*args))
    gen = torch.Generator().manual_seed(3)
    small, large = torch.randn(1023, 256, generator=gen), torch.randn(1024, 256, generator=gen)
    x = torch.randn(5, 256, generator=gen)
    for w in (small, large):
        assert torch.equal(dense_linear(x, w), F.linear(x, w))  # plain: F.linear, bit for bit, whatever the size
    assert not calls and dense.pack_weight(small, float32=True) is small  # too small to be worth oneDNN's per-call cost
    dense_linear(x, dense.pack_weight(large, float32=True))
    assert calls == ([5] if dense.PACKED_WEIGHTS else [])


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


def test_the_script_checks_and_times_all_three_kernels(tmp_path, capsys):
    out = tmp_path / "gemm.json"
    assert cpu_gemm.main(["--hidden", "64", "--layers", "1", "--rows", "1,3", "--rounds", "1", "--json", str(out)]) == 0
    rows = capsys.readouterr().out.splitlines()[2:]
    assert [r.split()[0] for r in rows] == ["1", "3"] and all(r.endswith("x") for r in rows)
    report = json.loads(out.read_text())
    assert [r["rows"] for r in report["results"]] == [1, 3] and report["onednn"] == dense.ONEDNN_LINEAR
    assert all(r[k] > 0 for r in report["results"] for k in ("packed_ms", "plain_ms", "f_linear_ms", "plain_over_packed", "f_linear_over_packed"))
    assert report["packed"] == 0  # hidden 64: every weight is below ONEDNN_MIN_WEIGHT


@pytest.mark.skipif(not dense.PACKED_WEIGHTS, reason="this torch cannot pack weights for oneDNN")
def test_the_script_times_packed_weights_in_chunks(tmp_path, monkeypatch):
    calls = []
    onednn = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *args: calls.append((args[0].shape[0], args[1].is_mkldnn)) or onednn(*args))
    out = tmp_path / "gemm.json"
    assert cpu_gemm.main(["--hidden", "256", "--layers", "1", "--rows", "5,130", "--rounds", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["packed"] == report["onednn_weights"] == 1  # gate/up, 1024 x 256 = 2^18; the others are smaller
    # packed: the error check's 7 rows, 5 rows, 130 rows only as 126 + 4; plain: oneDNN on the plain tensor up to 128 rows
    assert {rows for rows, packed in calls if packed} == {7, 5, 126, 4} and {rows for rows, packed in calls if not packed} == {7, 5}


@pytest.mark.skipif(not dense.PACKED_WEIGHTS, reason="this torch cannot pack weights for oneDNN")
@pytest.mark.parametrize("float32_onednn", [True, False])
def test_the_script_packs_on_any_cpu_and_names_the_engines_kernel(tmp_path, monkeypatch, capsys, float32_onednn):
    monkeypatch.setattr(dense, "FLOAT32_ONEDNN", float32_onednn)  # False: as auto would be without oneDNN
    out = tmp_path / "gemm.json"
    assert cpu_gemm.main(["--hidden", "256", "--layers", "1", "--rows", "5", "--rounds", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["packed"] == 1  # the packed column is packed either way (forced)
    assert report["engine_kernel"] == ("packed" if float32_onednn else "F.linear")
    assert f"the engine runs {'packed' if float32_onednn else 'F.linear'} (cpu_gemm auto)" in capsys.readouterr().out


@pytest.mark.skipif(not dense.PACKED_BFLOAT16, reason="this CPU (or torch) has no native bfloat16 in oneDNN: bf16 weights stay plain")
def test_the_script_times_packed_bfloat16_weights(tmp_path, monkeypatch, capsys):
    calls = _onednn_calls(monkeypatch)
    out = tmp_path / "gemm.json"
    assert cpu_gemm.main(["--hidden", "256", "--layers", "1", "--rows", "2", "--rounds", "1", "--dtype", "bfloat16", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["dtype"] == "bfloat16" and report["packed"] == 1 and 0 < report["relative_error"]["packed"] < 1e-2
    assert {c[0] for c in calls} == {7, 4}  # only the packed gate/up: the error check's 7 rows, 2 rows padded to 4
    assert "bfloat16" in capsys.readouterr().out.splitlines()[0]


def test_the_script_refuses_a_wrong_kernel(monkeypatch, capsys):
    monkeypatch.setattr(cpu_gemm, "dense_linear", lambda x, w: F.linear(x, w) * 1.001)
    assert cpu_gemm.main(["--hidden", "64", "--layers", "1", "--rows", "2", "--rounds", "1"]) == 1
    assert "differ from the float64 product" in capsys.readouterr().err


def _onednn_calls(monkeypatch) -> list:
    calls: list = []
    onednn = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *args: calls.append(args[0].shape) or onednn(*args))
    return calls


@pytest.mark.skipif(not dense.PACKED_WEIGHTS, reason="this torch cannot pack weights for oneDNN")
@pytest.mark.parametrize("bias_kind", ["strided", "column", "scalar", "one"])
def test_a_bias_that_is_not_one_contiguous_vector_takes_f_linear(bias_kind, monkeypatch):
    """The oneDNN op reads the bias's memory as if contiguous: a strided bias gave sums off by ~5,
    a 0-d one read past its storage, a [1] one raised. Such biases go to F.linear, on the packed
    weight's plain values."""
    calls = _onednn_calls(monkeypatch)
    gen = torch.Generator().manual_seed(4)
    x, w = torch.randn(6, 256, generator=gen), torch.randn(1024, 256, generator=gen)
    bias = {"strided": torch.randn(2048, generator=gen)[::2], "column": torch.randn(1024, 4, generator=gen)[:, 1],
            "scalar": torch.tensor(0.5), "one": torch.randn(1, generator=gen)}[bias_kind]  # fmt: skip
    assert torch.equal(dense_linear(x, dense.pack_weight(w, float32=True), bias), F.linear(x, w, bias)) and not calls


def test_gradients_and_a_switched_off_onednn_take_f_linear(monkeypatch):
    calls = _onednn_calls(monkeypatch)
    gen = torch.Generator().manual_seed(6)
    x, w = torch.randn(4, 256, generator=gen), torch.randn(1024, 256, generator=gen)
    xg = x.clone().requires_grad_()
    dense_linear(xg, w).sum().backward()
    assert torch.allclose(xg.grad, w.sum(0).expand(4, 256), rtol=1e-5, atol=1e-4) and not calls
    with torch.backends.mkldnn.flags(enabled=False):
        assert torch.equal(dense_linear(x, w), F.linear(x, w)) and not calls
    assert torch.equal(dense_linear(x, w), F.linear(x, w)) and not calls  # a plain weight never takes oneDNN


needs_packing = pytest.mark.skipif(not dense.PACKED_WEIGHTS, reason="this torch cannot pack weights for oneDNN")


@needs_packing
@pytest.mark.parametrize("rows", [(0,), (1,), (3,), (1, 2), (4,), (37,), (128,), (129,), (300,), (3, 50)])  # 0-300 rows, 1-3 dims
@pytest.mark.parametrize("with_bias", [False, True])
def test_a_packed_weight_matches_a_float64_product_in_chunks_of_128_rows(rows, with_bias, monkeypatch):
    calls = _onednn_calls(monkeypatch)
    gen = torch.Generator().manual_seed(10 + sum(rows) + with_bias)
    x, w = torch.randn(*rows, 256, generator=gen), torch.randn(1024, 256, generator=gen)
    b = torch.randn(1024, generator=gen) if with_bias else None
    packed = dense.pack_weight(w)
    assert packed.is_mkldnn and packed.shape == w.shape and torch.equal(packed.to_dense(), w)
    y = dense_linear(x, packed, b)
    want = x.double() @ w.double().T + (0 if b is None else b.double())
    assert y.dtype == torch.float32 and y.shape == (*rows, 1024)
    if want.numel():
        assert ((y.double() - want).abs().max() / want.abs().max()).item() < 1e-6
    n = x.numel() // 256
    want_calls = {0: [0], 1: [4], 3: [4], 2: [4], 4: [4], 37: [37], 128: [128], 129: [125, 4], 300: [128, 128, 44], 150: [128, 22]}[n]
    assert [c[0] for c in calls] == want_calls  # 4 to 128 rows a call: 1-3 rows padded, a short tail takes rows from the call before


@needs_packing
@pytest.mark.parametrize("n", [129, 130, 131, 132, 255, 256, 257, 259, 1000])
def test_packed_calls_cover_the_rows_in_4_to_128_row_pieces(n):
    sizes = dense.packed_call_rows(n)
    assert sum(sizes) == n and all(dense.PACKED_MIN_ROWS <= s <= dense.ONEDNN_MAX_ROWS for s in sizes) and len(sizes) == -(-n // 128)


def test_only_weights_onednn_would_take_are_packed():
    gen = torch.Generator().manual_seed(11)
    large = torch.randn(1024, 256, generator=gen)
    for weight in (torch.randn(1023, 256, generator=gen), large.double(), large.half(), large.clone().requires_grad_(),
                   torch.randn(1023, 256, generator=gen).bfloat16()):
        assert dense.pack_weight(weight) is weight
    with torch.backends.mkldnn.flags(enabled=False):
        assert dense.pack_weight(large) is large
        assert dense.pack_weight(large.bfloat16()).layout == torch.strided
    assert dense.pack_weight(large).is_mkldnn
    bf16 = dense.pack_weight(large.bfloat16())
    assert bf16.is_mkldnn == dense.PACKED_BFLOAT16 and bf16.dtype == torch.bfloat16  # packed only where oneDNN runs bf16 natively


@pytest.mark.skipif(not dense.PACKED_BFLOAT16, reason="this CPU (or torch) has no native bfloat16 in oneDNN: bf16 weights stay plain")
@pytest.mark.parametrize("rows", [(1,), (3,), (11,), (2, 5), (129,), (300,)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_a_packed_bfloat16_weight_matches_a_float64_product_like_f_linear(rows, with_bias, monkeypatch):
    """bf16 keeps 8 bits: the packed product of the rounded operands is within bf16's rounding of
    the float64 one (and as close as F.linear's), in 4-128-row calls like float32's."""
    calls = _onednn_calls(monkeypatch)
    gen = torch.Generator().manual_seed(20 + sum(rows) + with_bias)
    x, w = torch.randn(*rows, 256, generator=gen).bfloat16(), torch.randn(1024, 256, generator=gen).bfloat16()
    b = torch.randn(1024, generator=gen).bfloat16() if with_bias else None
    packed = dense.pack_weight(w)
    assert packed.is_mkldnn and torch.equal(packed.to_dense(), w)
    y = dense_linear(x, packed, b)
    want = x.double() @ w.double().T + (0 if b is None else b.double())
    assert y.dtype == torch.bfloat16 and y.shape == (*rows, 1024)
    err = ((y.double() - want).abs() / want.abs().max()).max().item()
    f_linear = ((F.linear(x, w, b).double() - want).abs() / want.abs().max()).max().item()
    assert err < 2**-8 and err <= 2 * f_linear + 2**-10
    n = x.numel() // 256
    assert [c[0] for c in calls] == {1: [4], 3: [4], 11: [11], 10: [10], 129: [125, 4], 300: [128, 128, 44]}[n]


@pytest.mark.skipif(not dense.PACKED_BFLOAT16, reason="this CPU (or torch) has no native bfloat16 in oneDNN: bf16 weights stay plain")
def test_a_plain_bfloat16_weight_stays_on_f_linear(monkeypatch):
    """Only packed bf16 weights take oneDNN: on a plain one the op timed no faster than F.linear."""
    calls = _onednn_calls(monkeypatch)
    gen = torch.Generator().manual_seed(21)
    x, w = torch.randn(9, 256, generator=gen).bfloat16(), torch.randn(1024, 256, generator=gen).bfloat16()
    assert torch.equal(dense_linear(x, w), F.linear(x, w)) and not calls


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_bias_of_another_dtype_gets_f_linears_error(packed, dtype, monkeypatch):
    """A bf16 bias on a float32 weight, or a float32 one on a bf16 weight (which the oneDNN op would take)."""
    if packed and not (dense.PACKED_WEIGHTS and (dtype == torch.float32 or dense.PACKED_BFLOAT16)):
        pytest.skip("this torch (or CPU) cannot pack such weights for oneDNN")
    calls = _onednn_calls(monkeypatch)
    gen = torch.Generator().manual_seed(13)
    x, w = torch.randn(5, 256, generator=gen).to(dtype), torch.randn(1024, 256, generator=gen).to(dtype)
    bias = torch.randn(1024, generator=gen).to(torch.float32 if dtype == torch.bfloat16 else torch.bfloat16)
    with pytest.raises(RuntimeError) as want:
        F.linear(x, w, bias)
    with pytest.raises(RuntimeError) as got:
        dense_linear(x, dense.pack_weight(w) if packed else w, bias)
    assert str(got.value) == str(want.value) and not calls


@needs_packing
@pytest.mark.parametrize("case", ["switched_off", "gradient", "strided_bias", "float64_x"])
def test_a_packed_weight_falls_back_to_f_linear_on_its_plain_values(case, monkeypatch):
    """Where the oneDNN op cannot take the call, the packed weight is unpacked for it: the result
    is F.linear's on the original weight, bit for bit (and gradients still reach x)."""
    calls = _onednn_calls(monkeypatch)
    gen = torch.Generator().manual_seed(12)
    x, w = torch.randn(5, 256, generator=gen), torch.randn(1024, 256, generator=gen)
    bias = torch.randn(2048, generator=gen)[::2] if case == "strided_bias" else None
    packed = dense.pack_weight(w)
    if case == "switched_off":
        with torch.backends.mkldnn.flags(enabled=False):
            assert torch.equal(dense_linear(x, packed), F.linear(x, w))
    elif case == "gradient":
        xg = x.clone().requires_grad_()
        dense_linear(xg, packed).sum().backward()
        assert torch.allclose(xg.grad, w.sum(0).expand(5, 256), rtol=1e-5, atol=1e-4)
    elif case == "strided_bias":
        assert torch.equal(dense_linear(x, packed, bias), F.linear(x, w, bias))
    else:
        with pytest.raises(RuntimeError):
            dense_linear(x.double(), packed)  # F.linear of float64 x by the float32 weight: torch's own dtype error
    assert not calls


@pytest.mark.parametrize("float32_onednn", [True, False])
def test_cpu_gemm_says_whether_float32_is_packed(float32_onednn, monkeypatch):
    """onednn packs, mkl keeps plain, auto follows FLOAT32_ONEDNN (wherever torch has oneDNN)."""
    monkeypatch.setattr(dense, "FLOAT32_ONEDNN", float32_onednn)
    assert dense.float32_packed("auto") == float32_onednn
    assert dense.float32_packed("onednn") and not dense.float32_packed("mkl")
    with pytest.raises(ValueError, match="cpu_gemm: 'blas' is not one of auto, onednn, mkl"):
        dense.float32_packed("blas")


def test_auto_packs_float32_wherever_torch_has_onednn():
    import importlib.util

    spec = importlib.util.spec_from_file_location("dense_as_loaded", dense.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # the constant as the module sets it, not the fixture's
    assert module.FLOAT32_ONEDNN == module.PACKED_WEIGHTS  # only where pack_weight can pack at all


@pytest.mark.parametrize("cause", ["no packing op", "onednn switched off"])
def test_onednn_that_could_not_pack_is_refused_and_auto_becomes_mkl(cause, monkeypatch):
    """Where pack_weight would leave every weight plain (a torch without _reorder_linear_weight, or
    oneDNN switched off in the process), an explicit cpu_gemm onednn is refused with the reason,
    not accepted and run on F.linear under an "oneDNN on packed weights" banner; auto resolves to
    mkl, what actually runs."""
    from runtime.config import ConfigError, EngineConfig

    if cause == "no packing op":
        monkeypatch.setattr(dense, "PACKED_WEIGHTS", False)
        monkeypatch.setattr(dense, "FLOAT32_ONEDNN", False)
        reason = "this torch build cannot pack weights for oneDNN"
    else:
        monkeypatch.setattr(dense, "PACKED_WEIGHTS", True)
        monkeypatch.setattr(dense, "FLOAT32_ONEDNN", True)
        monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
        reason = "oneDNN is switched off in this process"
    with pytest.raises(ConfigError, match=f"cpu_gemm: 'onednn' packs float32 weights for oneDNN, but {reason}.*: use auto or mkl"):
        EngineConfig(model="m", cpu_gemm="onednn").for_backend("cpu")
    assert EngineConfig(model="m").for_backend("cpu").cpu_gemm == "mkl"
    assert EngineConfig(model="m", cpu_gemm="mkl").for_backend("cpu").cpu_gemm == "mkl"


@pytest.mark.skipif(not dense.PACKED_WEIGHTS, reason="this torch cannot pack weights for oneDNN")
def test_onednn_is_accepted_where_it_packs():
    from runtime.config import EngineConfig

    assert EngineConfig(model="m", cpu_gemm="onednn").for_backend("cpu").cpu_gemm == "onednn"
    assert EngineConfig(model="m").for_backend("cpu").cpu_gemm == ("onednn" if dense.FLOAT32_ONEDNN else "mkl")


@pytest.mark.parametrize("rows", [(1,), (11,), (128,), (129,), (2, 5)])
def test_where_mkl_is_preferred_float32_stays_plain_on_f_linear(rows, monkeypatch):
    """With cpu_gemm mkl (``float32=False``), or auto without oneDNN (FLOAT32_ONEDNN off): float32 weights are not packed
    and every call is F.linear's, bit for bit, at every row count; bf16 packing and an explicit
    ``float32=True`` (cpu_gemm onednn) are unaffected."""
    monkeypatch.setattr(dense, "FLOAT32_ONEDNN", False)
    calls = _onednn_calls(monkeypatch)
    gen = torch.Generator().manual_seed(20 + sum(rows))
    x, w, b = torch.randn(*rows, 256, generator=gen), torch.randn(1024, 256, generator=gen), torch.randn(1024, generator=gen)
    assert dense.pack_weight(w) is w and dense.pack_weight(w, float32=False) is w
    assert torch.equal(dense_linear(x, w, b), F.linear(x, w, b)) and not calls
    if dense.PACKED_WEIGHTS:
        packed = dense.pack_weight(w, float32=True)
        assert packed.is_mkldnn and torch.equal(packed.to_dense(), w)
        y = dense_linear(x, packed, b)
        assert calls and ((y.double() - F.linear(x.double(), w.double(), b.double())).abs().max() / y.abs().max()).item() < 1e-6
        assert dense.pack_weight(w.bfloat16()).is_mkldnn == dense.PACKED_BFLOAT16
        assert dense.pack_weight(w.bfloat16(), float32=False).is_mkldnn == dense.PACKED_BFLOAT16  # cpu_gemm leaves bf16 alone


def test_float32_true_does_not_pack_what_cannot_be_packed():
    gen = torch.Generator().manual_seed(21)
    for weight in (torch.randn(1023, 256, generator=gen), torch.randn(1024, 256, generator=gen).double(),
                   torch.randn(1024, 256, generator=gen).requires_grad_()):
        assert dense.pack_weight(weight, float32=True) is weight
