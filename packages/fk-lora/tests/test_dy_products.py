"""fk.lora's ``s G = s dy B`` and ``dB = s dy^T xa`` from one read of ``dy`` against float64: the Triton
kernel (16-bit ``dy``) on the GPU where there is one, else in the interpreter, and the torch matmuls."""

from __future__ import annotations

import pytest
import torch

from fk.core import testing
from fk.core.backend import uses_kernel
from fk.core.matmul import scaled_mm
from fk.core.testing import DTYPES, dtype_name
from fk.lora import dy_products as module
from fk.lora.dy_products import LaunchParams, dy_products, dy_products_apply, dy_products_ref, kernel_takes


def _operands(m: int, n: int, r: int, dtype: torch.dtype, device: str) -> tuple[torch.Tensor, ...]:
    dy = testing.random_tensor((m, n), dtype, device, seed=1)
    lora_b = testing.random_tensor((n, r), dtype, device, seed=2)
    xa = testing.random_tensor((m, r), dtype, device, seed=3)
    return dy, lora_b, xa


def _check(dy: torch.Tensor, lora_b: torch.Tensor, xa: torch.Tensor, scaling: float, dtype: torch.dtype,
           params: LaunchParams | None = module.LAUNCH) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The results (by the kernel at ``params`` wherever it takes the operands, whatever their size:
    on the GPU too) against float64."""
    gs, db = dy_products(dy, lora_b, xa, scaling, dtype, params)
    want_gs, want_db = dy_products_ref(dy, lora_b, xa, scaling)
    assert gs.dtype == dy.dtype and db.dtype == dtype and gs.is_contiguous() and db.is_contiguous()
    testing.assert_close(gs, want_gs, scaled_mm(dy, lora_b, scaling, dy.dtype), name="s G")
    testing.assert_close(db, want_db, scaled_mm(dy.t(), xa, scaling, dtype), name="dB")
    return gs, db


@pytest.mark.parametrize(("m", "n", "r"), [(1, 1, 1), (5, 130, 8), (70, 1000, 16), (300, 257, 33)])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_matches_reference(device: str, dtype: torch.dtype, m: int, n: int, r: int) -> None:
    dy, lora_b, xa = _operands(m, n, r, dtype, device)
    for grad_dtype in (torch.float32, dtype):
        _check(dy, lora_b, xa, 2.0, grad_dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=dtype_name)
def test_kernel_with_split_columns_and_many_row_blocks(device: str, dtype: torch.dtype) -> None:
    # Small tiles so that the interpreter runs several row blocks (dB's partials) and several
    # column ranges (G's partials); then the table's launch, one range (G stored directly).
    dy, lora_b, xa = _operands(300, 1000, 16, dtype, device)
    assert kernel_takes(dy, lora_b, xa) == uses_kernel(dy)
    _check(dy, lora_b, xa, 0.5, torch.float32, LaunchParams(block_rows=64, block_cols=64, num_warps=4,
                                                             programs_per_sm=16))  # fmt: skip
    _check(dy, lora_b, xa, 0.5, dtype, LaunchParams(block_rows=256, block_cols=128, num_warps=8, programs_per_sm=1))


def test_strided_b_and_xa(device: str) -> None:
    # B and xa as column blocks of stacked tensors (q, k and v's share of a stacked product).
    dy = testing.random_tensor((70, 300), torch.bfloat16, device, seed=1)
    lora_b = testing.random_tensor((300, 48), torch.bfloat16, device, seed=2)[:, 16:32]
    xa = testing.random_tensor((70, 40), torch.bfloat16, device, seed=3)[:, 4:20]
    _check(dy, lora_b, xa, 2.0, torch.float32)


def test_each_operand_and_the_scale_count(device: str) -> None:
    # A test that can fail: B and xa swapped between the products, the scale dropped, or a row
    # block's partial lost all move a result.
    dy, lora_b, xa = _operands(129, 300, 16, torch.bfloat16, device)
    gs, db = dy_products(dy, lora_b, xa, 2.0, torch.float32, LaunchParams(64, 64, 4, 16))
    want_gs, want_db = dy_products_ref(dy, lora_b, xa, 2.0)
    wrong_gs = [want_gs / 2.0, dy.double() @ lora_b.double().flip(0)]
    wrong_db = [want_db / 2.0, 2.0 * (dy[:64].double().t() @ xa[:64].double())]
    for wrong in wrong_gs:
        assert (gs.double() - wrong).abs().max() > 1e-1
    for wrong in wrong_db:
        assert (db.double() - wrong).abs().max() > 1e-1


def test_where_it_applies(device: str) -> None:
    dy, lora_b, xa = _operands(70, 300, 16, torch.bfloat16, device)
    assert kernel_takes(dy, lora_b, xa) == uses_kernel(dy)
    # On a GPU only from MIN_ROWS x MIN_COLS (smaller, the two matmuls were faster); the interpreter
    # takes the kernel at any size, so that the tests run it.
    assert dy_products_apply(dy, lora_b, xa) == (uses_kernel(dy) and device != "cuda")
    big = _operands(module.MIN_ROWS, module.MIN_COLS, 16, torch.bfloat16, device) if device == "cuda" else None
    assert big is None or dy_products_apply(*big)
    assert not kernel_takes(dy.float(), lora_b.float(), xa.float())  # fp32: torch's matmuls
    assert not kernel_takes(dy, lora_b.half(), xa)  # dtypes that differ
    assert not kernel_takes(dy.t().contiguous().t(), lora_b, xa)  # dy not contiguous
    wide_b = testing.random_tensor((300, module.MAX_RANK + 1), torch.bfloat16, device, seed=4)
    wide_xa = testing.random_tensor((70, module.MAX_RANK + 1), torch.bfloat16, device, seed=5)
    assert not kernel_takes(dy, wide_b, wide_xa)
    _check(dy, wide_b, wide_xa, 1.0, torch.float32)  # the torch path gives the same


def test_compile_takes_torch_ops(device: str) -> None:
    dy, lora_b, xa = _operands(37, 300, 16, torch.bfloat16, device)

    def fn(dy: torch.Tensor, lora_b: torch.Tensor, xa: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert not kernel_takes(dy, lora_b, xa)
        return dy_products(dy, lora_b, xa, 2.0, torch.float32)

    gs, db = torch.compile(fn, fullgraph=True)(dy, lora_b, xa)
    want_gs, want_db = dy_products_ref(dy, lora_b, xa, 2.0)
    # (compiled, scaled_mm forms the product in dy's dtype, then scales and casts: no fp32 output)
    testing.assert_close(gs, want_gs, (dy @ lora_b) * 2.0, name="s G")
    testing.assert_close(db, want_db, ((dy.t() @ xa) * 2.0).float(), name="dB")


def test_compiles_for_hopper_without_spills() -> None:
    signature = {"dy_ptr": "*bf16", "b_ptr": "*bf16", "xa_ptr": "*bf16", "g_ptr": "*fp32", "db_ptr": "*fp32",
                 "scaling": "fp32", "n_rows": "i32", "n_cols": "i32", "rank": "i32", "b_row_stride": "i32",
                 "xa_row_stride": "i32", "g_row_stride": "i32", "cols_per_split": "i32", "G_PARTIALS": "",
                 "BLOCK_ROWS": "", "BLOCK_COLS": "", "BLOCK_RANK": ""}  # fmt: skip
    launch = module.LAUNCH
    for rank in (16, 32, 64):
        compiled = testing.compile_kernel(
            "fk.lora.dy_products", "_dy_products_kernel", signature,
            {"G_PARTIALS": True, "BLOCK_ROWS": launch.block_rows, "BLOCK_COLS": launch.block_cols, "BLOCK_RANK": rank},
            num_warps=launch.num_warps,
        )  # fmt: skip
        assert compiled.spill_bytes == 0, (rank, compiled)
        assert compiled.sync_and_mma.get("wgmma.mma_async", 0) > 0, (rank, compiled)


def test_lora_b_grads_forms_what_is_needed(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Both needed: one call of dy_products (one read of dy); one alone: that product only.
    from fk.lora import projection

    dy, lora_b, xa = _operands(70, 300, 16, torch.bfloat16, device)
    calls: list[int] = []
    monkeypatch.setattr(projection, "dy_products", lambda *args: calls.append(1) or dy_products(*args))
    gs, db = projection.lora_b_grads(dy, lora_b, xa, 2.0, torch.float32, True, True)
    assert calls == [1] and gs is not None and db is not None and db.dtype == torch.float32
    only_gs = projection.lora_b_grads(dy, lora_b, xa, 2.0, torch.float32, True, False)
    only_db = projection.lora_b_grads(dy, lora_b, xa, 2.0, torch.float32, False, True)
    assert calls == [1] and only_gs[1] is None and only_db[0] is None
    want_gs, want_db = dy_products_ref(dy, lora_b, xa, 2.0)
    testing.assert_close(only_gs[0], want_gs, scaled_mm(dy, lora_b, 2.0, dy.dtype), name="s G alone")
    testing.assert_close(only_db[1], want_db, scaled_mm(dy.t(), xa, 2.0, torch.float32), name="dB alone")
    assert projection.lora_b_grads(dy, lora_b, xa, 2.0, torch.float32, False, False) == (None, None)
