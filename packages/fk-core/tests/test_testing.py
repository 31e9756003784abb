"""The tolerance harness must pass good implementations and fail wrong ones."""

from __future__ import annotations

import pytest
import torch

from fk.core import testing


def softmax_ref(x: torch.Tensor) -> torch.Tensor:
    compute = torch.promote_types(x.dtype, torch.float32)
    return torch.softmax(x.to(compute), dim=-1).to(x.dtype)


def softmax_good(x: torch.Tensor) -> torch.Tensor:
    # The correctly rounded result moved by one unit in the last place: the most a careful kernel
    # (another summation order, say) is off by. Built from the float64 softmax, not from float32
    # arithmetic, so that it is as good on every CPU: on CI's, a float32 exp/sum/divide softmax
    # was off by 5e-5 relative in one row, which no PyTorch kernel at float32 is.
    y = torch.softmax(x.double(), dim=-1).to(x.dtype)
    one_ulp_up = torch.nextafter(y.detach(), torch.full_like(y, float("inf")))
    return y + (one_ulp_up - y.detach())


def softmax_wrong_scale(x: torch.Tensor) -> torch.Tensor:
    return (torch.softmax(x.float(), dim=-1) * 1.03).to(x.dtype)


def softmax_low_precision(x: torch.Tensor) -> torch.Tensor:
    # Accumulating in the input dtype: visibly worse than PyTorch at fp16/bf16.
    e = torch.exp(x - x.max(-1, keepdim=True).values)
    total = torch.zeros_like(e[..., :1])
    for i in range(e.shape[-1]):
        total = total + e[..., i : i + 1]
    return e / total


def softmax_lost_row(x: torch.Tensor) -> torch.Tensor:
    y = softmax_ref(x).clone()
    y[-1] = 0
    return y


@pytest.mark.parametrize("dtype", testing.DTYPES, ids=testing.dtype_name)
def test_good_implementation_passes(dtype: torch.dtype) -> None:
    x = testing.random_tensor((9, 300), dtype, "cpu", seed=0, scale=3, requires_grad=True)
    result = testing.compare_with_reference(softmax_good, softmax_ref, [x])
    assert result.names == ["output0", "grad of arg0"]


@pytest.mark.parametrize("wrong", [softmax_wrong_scale, softmax_lost_row])
@pytest.mark.parametrize("dtype", testing.DTYPES, ids=testing.dtype_name)
def test_wrong_implementation_fails(wrong, dtype: torch.dtype) -> None:
    x = testing.random_tensor((9, 300), dtype, "cpu", seed=1, scale=3, requires_grad=True)
    with pytest.raises(AssertionError, match="max error"):
        testing.compare_with_reference(wrong, softmax_ref, [x])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=testing.dtype_name)
def test_low_precision_accumulation_fails(dtype: torch.dtype) -> None:
    x = testing.random_tensor((4, 2000), dtype, "cpu", seed=2, scale=0.1)
    with pytest.raises(AssertionError, match="max error"):
        testing.compare_with_reference(softmax_low_precision, softmax_ref, [x])


def test_nan_fails() -> None:
    x = testing.random_tensor((3, 10), torch.float32, "cpu", seed=3)
    with pytest.raises(AssertionError):
        testing.compare_with_reference(lambda t: softmax_ref(t) * float("nan"), softmax_ref, [x])


def test_missing_gradient_fails() -> None:
    x = testing.random_tensor((3, 10), torch.float32, "cpu", seed=4, requires_grad=True)
    w = testing.random_tensor((10,), torch.float32, "cpu", seed=5, requires_grad=True)

    def ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * w

    def detached_w(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * w.detach()

    with pytest.raises(AssertionError, match="grad of w"):
        testing.compare_with_reference(detached_w, ref, [x, w], arg_names=["x", "w"])


@pytest.mark.parametrize("layout", testing.LAYOUTS)
def test_with_layout_keeps_values(layout: str) -> None:
    x = testing.random_tensor((5, 7), torch.float32, "cpu", seed=6, requires_grad=True)
    y = testing.with_layout(x, layout)
    assert torch.equal(y, x.detach())
    assert y.requires_grad and y.is_leaf
    assert y.is_contiguous() == (layout == "contiguous")


def test_random_tensor_is_reproducible_and_nonzero() -> None:
    a = testing.random_tensor((100,), torch.bfloat16, "cpu", seed=7)
    b = testing.random_tensor((100,), torch.bfloat16, "cpu", seed=7)
    assert torch.equal(a, b)
    assert (a != 0).all()


@pytest.mark.parametrize(
    ("layout", "q_shape", "k_shape"), [("bhsd", (2, 4, 5, 8), (2, 1, 5, 8)), ("bshd", (2, 5, 4, 8), (2, 5, 1, 8))]
)
def test_attention_qk_shapes_and_seeds(layout: str, q_shape: tuple[int, ...], k_shape: tuple[int, ...]) -> None:
    q, k = testing.attention_qk(2, 5, 4, 1, 8, torch.float16, "cpu", layout, seed=3)
    assert (q.shape, k.shape) == (q_shape, k_shape) and q.dtype == k.dtype == torch.float16
    assert q.is_leaf and q.requires_grad and k.is_leaf and k.requires_grad
    assert torch.equal(q, testing.random_tensor(q_shape, torch.float16, "cpu", seed=3))
    assert torch.equal(k, testing.random_tensor(k_shape, torch.float16, "cpu", seed=4))


@pytest.mark.parametrize("layout", testing.LAYOUTS)
def test_compare_passes_inputs_in_their_layout(layout: str) -> None:
    x = testing.with_layout(testing.random_tensor((6, 9), torch.float32, "cpu", seed=8, requires_grad=True), layout)
    seen: list[tuple[int, ...]] = []

    def spy(t: torch.Tensor) -> torch.Tensor:
        seen.append(t.stride())
        return softmax_ref(t)

    testing.compare_with_reference(spy, softmax_ref, [x], baseline_fn=softmax_ref)
    assert seen == [x.stride()]


def test_copy_with_strides_keeps_a_row_strided_view() -> None:
    x = testing.with_layout(testing.random_tensor((4, 5), torch.float32, "cpu", seed=9), "row_strided")
    y = testing.copy_with_strides(x)
    assert y.stride() == x.stride() and torch.equal(y, x)
    assert y.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


def test_copy_with_strides_keeps_an_expanded_view() -> None:
    x = testing.random_tensor((1, 5), torch.float32, "cpu", seed=10).expand(4, 5)
    y = testing.copy_with_strides(x)
    assert y.stride() == (0, 1) and torch.equal(y, x)


def test_run_on_reference_path() -> None:
    testing.run_on_reference_path("import os; assert os.environ['TRITON_INTERPRET'] == '0'; print('ok')")
    with pytest.raises(AssertionError, match="reference-path run failed"):
        testing.run_on_reference_path("print('not ok')")


def test_compile_kernel_reads_memory_instructions_registers_and_spills() -> None:
    # fk.core.reduce's column sums, compiled for Hopper without a GPU: the fp32 partials' tile read
    # as vectors (ld.global.v4 here), the sums written; its registers within what a thread may have,
    # and no spills at this tile.
    signature = {"partials_ptr": "*fp32", "out0_ptr": "*bf16", "out1_ptr": "*bf16", "n_rows": "i32", "n_cols": "i32",
                 "BLOCK_ROWS": "", "BLOCK_COLS": ""}  # fmt: skip
    compiled = testing.compile_kernel(
        "fk.core.reduce", "_sum_rows_kernel", signature, {"BLOCK_ROWS": 8, "BLOCK_COLS": 256}, num_warps=4
    )
    counts = compiled.memory_instructions
    assert counts and all(op.startswith(("ld.global", "st.global")) for op in counts), counts
    assert any(op.startswith("ld.global.v") for op in counts), counts
    assert any(op.startswith("st.global") for op in counts), counts
    assert 16 <= compiled.registers <= 255 and compiled.spill_bytes == 0, compiled
    # No tl.dot there: no matrix multiply-accumulate among its barriers and shared-memory accesses.
    assert not any("mma" in op for op in compiled.sync_and_mma), compiled.sync_and_mma
    # A 16 x 1024 fp32 accumulator on one warp (512 values a thread) cannot stay in registers.
    huge = testing.compile_kernel(
        "fk.core.reduce", "_sum_rows_kernel", signature, {"BLOCK_ROWS": 16, "BLOCK_COLS": 1024}, num_warps=1
    )
    assert huge.spill_bytes > 1024, huge
    with pytest.raises(AssertionError, match=r"compiling fk\.core\.reduce\.no_such_kernel failed"):
        testing.compile_kernel("fk.core.reduce", "no_such_kernel", {}, {}, num_warps=4)


def test_assert_compile_matches_eager(device: str) -> None:
    x = testing.random_tensor((4, 6), torch.float32, device, seed=11, requires_grad=True)
    testing.assert_compile_matches_eager(lambda t: (softmax_ref(t) * t).sum(), [x])
    unused = testing.random_tensor((3,), torch.float32, device, seed=12, requires_grad=True)
    with pytest.raises(AssertionError, match="input 1 got no gradient"):
        testing.assert_compile_matches_eager(lambda t, u: (t * 2).sum(), [x, unused])


def test_allocation_sizes_sees_each_buffer() -> None:
    sizes = testing.allocation_sizes(lambda: (torch.empty(1000), torch.empty(1000)))
    assert testing.count_buffers(sizes, 4000, "cpu") == 2, sizes
    assert testing.count_buffers(sizes, 4004, "cpu") == 0, sizes


def test_count_buffers_models_the_cuda_caching_allocator() -> None:
    """Small requests (at most 1 MiB) show up at their size rounded to 512 bytes, large ones as a
    block up to 1 MiB larger; sizes are only compared, so no GPU is needed."""
    mib = 1 << 20
    small = [512, 1024, 1536]
    assert testing.count_buffers(small, 1000, "cuda") == 1  # 1000 rounds to 1024 only
    assert testing.count_buffers(small, 100, "cuda") == 1
    assert testing.count_buffers(small, 2000, "cuda") == 0
    large = [3 * mib, 3 * mib + mib // 2, 4 * mib + 512]
    assert testing.count_buffers(large, 3 * mib, "cuda") == 2  # exact, or handed over whole
    assert testing.count_buffers(large, 4 * mib + 512, "cuda") == 1


def test_require_bitsandbytes_4bit_gives_the_module_or_skips() -> None:
    import importlib.util

    try:
        bnb = testing.require_bitsandbytes_4bit("cpu")
    except pytest.skip.Exception as skipped:
        assert "bitsandbytes" in str(skipped)
        return
    assert importlib.util.find_spec("bitsandbytes") is not None and bnb.__name__ == "bitsandbytes"
