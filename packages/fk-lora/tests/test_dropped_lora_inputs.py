"""fk.lora.dropped_lora_inputs: the dropout's forward in one pass (masks drawn as torch draws them,
``xa_t = f_t (x * m_t) A_t^T``) against float64 and the reference masks (the Triton kernel on the
GPU where there is one, else in the interpreter), and, on a GPU, fk.lora's forward taking it with
PEFT's masks."""

from __future__ import annotations

import pytest
import torch

from fk.core import testing
from fk.core.testing import dtype_name
from fk.lora import dropped_lora_inputs as module
from fk.lora import projection
from fk.lora.dropped_lora_inputs import DroppedInput, dropped_inputs_apply, dropped_lora_inputs, dropped_lora_inputs_ref
from fk.lora.masked_low_rank import masked
from fk.lora.projection import Settings, lora_input_products
from fk.lora.torch_dropout import Draw, keep_mask

PS = (0.05, 0.3, 0.5)


def _terms(k: int, ranks: list[int], dtype: torch.dtype, device: str, vec: int, threads: int = 96) -> list[DroppedInput]:  # fmt: skip
    terms = []
    for i, r in enumerate(ranks):
        p = PS[i % 3]
        lora_a = testing.random_tensor((r, k), dtype, device, seed=10 * i + 1)
        terms.append(DroppedInput(lora_a, Draw(2**63 + 977 * i, 8 + 40 * i, threads, vec, 1 - p), 1 / (1 - p)))
    return terms


def _check(x: torch.Tensor, terms: list[DroppedInput], dropped_in: torch.dtype | None = None) -> None:
    xas, masks = dropped_lora_inputs(x, terms, dropped_in)
    want_xas, want_masks = dropped_lora_inputs_ref(x, terms)
    for i, (xa, mask, want_xa, want_mask, term) in enumerate(zip(xas, masks, want_xas, want_masks, terms, strict=True)):  # fmt: skip
        assert mask.dtype == torch.bool and torch.equal(mask.cpu(), want_mask.cpu()), f"mask {i}"
        assert xa.dtype == term.lora_a.dtype and xa.shape == (x.shape[0], term.lora_a.shape[0])
        # PEFT's expression: f x (in the dtype it drops in, then cast to A's as autocast casts it), then the matmul
        dropped = masked(x.to(dropped_in or x.dtype), want_mask.to(x.device), term.factor).to(term.lora_a.dtype)
        testing.assert_close(xa, want_xa, torch.mm(dropped, term.lora_a.t()), name=f"xa[{i}]")


@pytest.mark.parametrize(("m", "k"), [(1, 8), (37, 264), (130, 520), (70, 1000)])
@pytest.mark.parametrize("vec", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=dtype_name)
def test_matches_reference(device: str, dtype: torch.dtype, vec: int, m: int, k: int) -> None:
    # q, k and v: ranks that differ and are not multiples of 16; few threads, so that rows span
    # several of torch's iterations.
    x = testing.random_tensor((m, k), dtype, device, seed=0)
    _check(x, _terms(k, [16, 8, 33], dtype, device, vec))


@pytest.mark.parametrize(("m", "k"), [(1, 8), (37, 264), (70, 1000)])
@pytest.mark.parametrize("a_dtype", [torch.float16, torch.bfloat16], ids=dtype_name)
def test_fp32_input_beside_16_bit_lora_as(device: str, a_dtype: torch.dtype, m: int, k: int) -> None:
    # Under autocast on fp32 hidden states (peft.prepare_model_for_kbit_training): the masks drawn
    # as on fp32 (vector size 4), f (x * m) cast to A's dtype, the products in A's dtype.
    x = testing.random_tensor((m, k), torch.float32, device, seed=0)
    _check(x, _terms(k, [16, 8, 33], a_dtype, device, 4))


@pytest.mark.parametrize(("m", "k"), [(1, 8), (37, 264), (70, 1000)])
def test_16_bit_input_dropped_in_fp32(device: str, m: int, k: int) -> None:
    # Under autocast with fp32 LoRA weights (PEFT's default) on bf16 hidden states: PEFT drops x cast
    # to fp32 (fp32's masks, vector size 4), autocast casts f (x * m) to bf16 for the product.
    x = testing.random_tensor((m, k), torch.bfloat16, device, seed=0)
    _check(x, _terms(k, [16, 8, 33], torch.bfloat16, device, 4), dropped_in=torch.float32)


def test_split_k_and_launches_of_three(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # K split into ranges (partial sums), and five projections in launches of three and two.
    monkeypatch.setattr(module, "LAUNCH", {r: module.LaunchParams(32, 64, 4, 64) for r in (16, 32, 64)})
    x = testing.random_tensor((70, 520), torch.bfloat16, device, seed=0)
    _check(x, _terms(520, [16, 8, 16, 4, 16], torch.bfloat16, device, 8))


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32], ids=dtype_name)
def test_each_mask_and_factor_counts(device: str, x_dtype: torch.dtype) -> None:
    # A test that can fail: another draw's mask, or a dropped factor, moves the product (fp32 x:
    # the factor applied before the cast to A's dtype, where a 16-bit x has it after the product).
    x = testing.random_tensor((129, 256), x_dtype, device, seed=0)
    terms = _terms(256, [16, 16], torch.bfloat16, device, 8 if x_dtype == torch.bfloat16 else 4)
    (xa, _), _ = dropped_lora_inputs(x, terms)
    xas_other, _ = dropped_lora_inputs_ref(x, [terms[0]._replace(draw=terms[1].draw)])
    xas_no_factor, _ = dropped_lora_inputs_ref(x, [terms[0]._replace(factor=1.0)])
    for wrong in (xas_other[0], xas_no_factor[0]):
        assert (xa.double() - wrong).abs().max() > 1e-2


def test_applies_only_where_it_can(device: str) -> None:
    x = testing.random_tensor((64, 256), torch.bfloat16, device, seed=0)
    a = testing.random_tensor((16, 256), torch.bfloat16, device, seed=1)
    assert dropped_inputs_apply(x, [a, a])
    assert not dropped_inputs_apply(x.float(), [a.float()])  # fp32: IEEE dots would cost more than the pass saves
    assert dropped_inputs_apply(x.float(), [a, a])  # fp32 x, 16-bit A's: autocast
    assert not dropped_inputs_apply(x.float(), [a, a.half()])  # A's in two dtypes
    assert not dropped_inputs_apply(x.half(), [a])  # 16-bit x unlike the A's
    assert not dropped_inputs_apply(x, [a.float()])  # A in another dtype
    assert not dropped_inputs_apply(x[:, :200], [a[:, :200]])  # not contiguous
    assert not dropped_inputs_apply(x[:, :252].contiguous(), [a[:, :252]])  # K not a multiple of 8
    assert not dropped_inputs_apply(x, [testing.random_tensor((65, 256), torch.bfloat16, device, seed=2)])  # rank
    assert not dropped_inputs_apply(x.reshape(4, 16, 256), [a])  # not 2-D


@pytest.mark.parametrize(
    ("x_dtype", "drawn_in"),
    [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32), (torch.bfloat16, torch.float32)],
    ids=["bf16", "fp32", "bf16_dropped_in_fp32"],
)
@pytest.mark.parametrize("tokens", [16, 4096])
def test_lora_input_products_draws_torchs_masks(
    device: str, tokens: int, x_dtype: torch.dtype, drawn_in: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    # fk.lora's forward takes the kernel on a GPU: q, k and v's masks are three torch.native_dropout
    # calls' (the generator left where they leave it), their products PEFT's to bf16 rounding. fp32:
    # the hidden states of peft.prepare_model_for_kbit_training under bf16 autocast, fp32 LoRA
    # weights (PEFT drops the fp32 input; autocast casts it and A to bf16 for the product). bf16
    # dropped in fp32: bf16 hidden states, fp32 LoRA weights (PEFT casts x to fp32, then drops it).
    if device != "cuda":
        pytest.skip("torch's CUDA masks need a GPU (on the CPU fk draws with torch.native_dropout)")
    x2 = testing.random_tensor((tokens, 512), x_dtype, device, seed=0)
    lora_as = [testing.random_tensor((16, 512), drawn_in, device, seed=i + 1) for i in range(3)]
    settings = [Settings(2.0, p, drawn_in) for p in PS]
    generator = torch.cuda.default_generators[x2.device.index or 0]
    generator.manual_seed(5)
    dropped = [torch.native_dropout(x2.to(drawn_in), p, True) for p in PS]
    want_offset = generator.get_offset()
    generator.manual_seed(5)
    calls = []
    real = module._launch
    monkeypatch.setattr(module, "_launch", lambda *args, **kwargs: calls.append(1) or real(*args, **kwargs))
    with torch.autocast("cuda", dtype=torch.bfloat16):  # (HF Trainer's bf16=True)
        xas, masks, A_cs, _ = lora_input_products(x2, x2.bfloat16(), lora_as, settings)
    assert calls == [1] and generator.get_offset() == want_offset
    for i, ((d, want_mask), xa, mask, a) in enumerate(zip(dropped, xas, masks, lora_as, strict=True)):
        assert torch.equal(mask, want_mask), f"mask {i}"
        assert xa.dtype == A_cs[i].dtype == torch.bfloat16
        want = d.bfloat16().double() @ a.bfloat16().double().t()
        testing.assert_close(xa, want, torch.mm(d.bfloat16(), a.bfloat16().t()), name=f"xa[{i}]")


def test_one_pass_takes_the_products_the_kernel_forms(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The kernel forms d(x2 in the dropout dtype), rounded to c (bf16 here), times A in c. That is
    # lora_input_product's product where every A is in c, as fk's fused functions pass them under
    # autocast (cast, autocast itself off): fp32 hidden states (peft.prepare_model_for_kbit_training),
    # or bf16 ones dropped in fp32 (PEFT's fp32 adapters). Called under autocast to c, A's of other
    # dtypes are cast to c too. An fp32 A outside autocast has an fp32 product: not the kernel's.
    monkeypatch.setattr(projection, "reserve", lambda x, ps, drawn_as=None: [(p, drawn_as) for p in ps])
    x2 = testing.random_tensor((16, 64), torch.float32, device, seed=0)  # (on Triton's path: a GPU, or the interpreter)
    a = testing.random_tensor((8, 64), torch.float32, device, seed=1)

    def draws(x2: torch.Tensor, lora_a: torch.Tensor, drawn_in: torch.dtype | None = None) -> object:
        settings = [Settings(1.0, 0.1, drawn_in or x2.dtype)]
        return projection._one_pass_draws(x2, x2.to(torch.bfloat16), [lora_a], [lora_a.bfloat16()], settings)

    bf16_x, bf16_a = x2.bfloat16(), a.bfloat16()
    # as the fused functions call it (A's in c, autocast off)
    assert draws(x2, bf16_a) == [(0.1, None)]  # fp32 hidden states, drawn on them
    assert draws(bf16_x, bf16_a, torch.float32) == [(0.1, torch.float32)]  # drawn as on x cast to fp32
    assert draws(bf16_x, bf16_a) == [(0.1, None)]  # all in bf16
    assert draws(bf16_x, bf16_a, torch.float16) is None  # (no such PEFT cast)
    # fp32 A's outside autocast: fp32 products
    assert draws(x2, a) is None and draws(bf16_x, a) is None and draws(bf16_x, a, torch.float32) is None
    with torch.autocast(device, dtype=torch.float16):
        assert draws(x2, a) is None  # (autocast to another dtype than c)
    with torch.autocast(device, dtype=torch.bfloat16):
        assert draws(x2, a) == draws(bf16_x, a) == [(0.1, None)]
        assert draws(bf16_x, a, torch.float32) == [(0.1, torch.float32)]


def test_keep_mask_is_the_kernels_mask(device: str) -> None:
    # The whole-mask kernel (fk.lora.torch_dropout.keep_mask, which replicates() compares with torch)
    # and this kernel's tiles draw the same mask.
    x = testing.random_tensor((48, 1024), torch.float16, device, seed=0)
    (term,) = _terms(1024, [16], torch.float16, device, 8, threads=512)
    _, (mask,) = dropped_lora_inputs(x, [term])
    assert torch.equal(mask.flatten(), keep_mask(x.numel(), term.draw, device))


@pytest.mark.parametrize(("x_dtype", "dropped_in_fp32"), [("bf16", False), ("fp32", True), ("bf16", True)])
@pytest.mark.parametrize("rank", [16, 32, 64])
def test_kernel_compiles_without_spills(rank: int, x_dtype: str, dropped_in_fp32: bool) -> None:
    # Compiled for sm_90 on the CPU at the table's launch, three projections, x in bf16 or fp32, the
    # dropout drawn in x's dtype or in fp32 (under autocast: masks of vector size 4, f x rounded to
    # bf16 for the products): their products on the warpgroup MMAs, nothing spilled (the Philox
    # words sit beside the accumulators).
    params = module.LAUNCH[rank]
    signature = {
        "x_ptr": f"*{x_dtype}", "a_ptrs": ["*bf16"] * 3, "a_row_strides": ["i32"] * 3, "mask_ptrs": ["*i1"] * 3,
        "seeds": ["u64"] * 3, "counters": ["i64"] * 3, "thresholds": ["i64"] * 3, "ranks": ["i32"] * 3,
        "rank_starts": ["i32"] * 3, "factors": ["fp32"] * 3, "out_ptr": "*fp32", "threads": "i32", "n_rows": "i32",
        "n_cols": "i32", "out_row_stride": "i32", "cols_per_split": "i32", "N_TERMS": "", "SCALE_FIRST": "", "VEC": "",
        "PARTIALS": "", "BLOCK_ROWS": "", "BLOCK_COLS": "", "BLOCK_RANK": "",
    }  # fmt: skip
    constexprs = {"N_TERMS": 3, "SCALE_FIRST": dropped_in_fp32, "VEC": 4 if dropped_in_fp32 else 8,
                  "PARTIALS": True, "BLOCK_ROWS": params.block_rows, "BLOCK_COLS": params.block_cols,
                  "BLOCK_RANK": rank}  # fmt: skip
    compiled = testing.compile_kernel("fk.lora.dropped_lora_inputs", "_dropped_lora_inputs_kernel", signature,
                                      constexprs, num_warps=params.num_warps)  # fmt: skip
    assert compiled.spill_bytes == 0, compiled
    assert compiled.sync_and_mma.get("wgmma.mma_async", 0) > 0, compiled
