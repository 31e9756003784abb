"""fk.lora.quant: the Triton dequantizer of bitsandbytes' 4-bit (NF4, FP4, nested absmax) and int8
weights against its plain-PyTorch reference, bit for bit; the reference against the formats'
definitions and, where bitsandbytes is installed, against bitsandbytes' own dequantization."""

from __future__ import annotations

import importlib.util
import inspect

import pytest
import torch

from fk.core import backend, testing
from fk.core.testing import DTYPES, dtype_name
from fk.lora import quant
from fk.lora.quant import (
    FP4_VALUES,
    INT8_SCALE,
    NF4_CODE,
    NestedAbsmax,
    QuantizedWeight,
    code_table,
    dequantize,
    dequantize_ref,
    dequantize_rows,
    dequantize_together,
    from_bnb,
    quantize_ref,
)

HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None

# (N, K): N * K odd (a padded last byte), K not a multiple of any blocksize (blocks span rows),
# and one row narrower than a block.
SHAPES = [(17, 100), (5, 33), (3, 7), (64, 128)]
BLOCKSIZES = [32, 64, 128, 256, 4096]


def _weight(shape: tuple[int, int], device: str, seed: int = 0) -> torch.Tensor:
    return testing.random_tensor(shape, torch.float32, device, seed=seed)


def _expected(ref32: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The kernel's output in ``dtype`` given the fp32 values: rounded to nearest, except that
    Triton's interpreter rounds fp32 -> bf16 toward zero (a GPU rounds to nearest)."""
    if dtype == torch.bfloat16 and ref32.device.type == "cpu" and backend.INTERPRETER_ON:
        return (ref32.view(torch.int32) & -65536).view(torch.float32).to(dtype)
    return ref32.to(dtype)


def test_code_books_are_bitsandbytes_constants() -> None:
    # The fp32 literals of bitsandbytes' CUDA kernels (dDequantizeNF4, dDequantizeFP4Tree).
    nf4 = torch.tensor(NF4_CODE, dtype=torch.float32)
    assert torch.equal(code_table("nf4", torch.device("cpu")), nf4)
    fp4 = torch.tensor([0.0, 5.208333333e-03, 0.66666667, 1.0, 0.33333333, 0.5, 0.16666667, 0.25])
    assert torch.equal(code_table("fp4", torch.device("cpu")), torch.cat([fp4, -fp4]))
    assert len(FP4_VALUES) == 8 and max(FP4_VALUES) == 12.0
    assert float(torch.tensor(1 / 127, dtype=torch.float32)) == INT8_SCALE


@pytest.mark.parametrize("nested", [False, True], ids=["absmax", "nested"])
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_reference_reconstructs_within_half_a_code_step(quant_type: str, nested: bool) -> None:
    w = _weight((17, 100), "cpu")
    q = quantize_ref(w, quant_type, 64, nested=nested)
    code = code_table(quant_type, torch.device("cpu")).sort().values
    half_step = float((code[1:] - code[:-1]).max()) / 2
    scales = w.reshape(-1).abs().max()
    err = (dequantize_ref(q, dtype=torch.float32) - w).abs().max()
    slack = 0.05 if nested else 1e-6  # the nested absmax is itself quantized (8 bits)
    assert err <= (half_step + slack) * scales


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("blocksize", BLOCKSIZES)
@pytest.mark.parametrize("nested", [False, True], ids=["absmax", "nested"])
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_4bit_kernel_equals_reference_bit_for_bit(
    device: str, quant_type: str, nested: bool, blocksize: int, shape: tuple[int, int]
) -> None:
    q = quantize_ref(_weight(shape, device), quant_type, blocksize, nested=nested, nested_blocksize=4)
    want = dequantize_ref(q, dtype=torch.float32)
    assert torch.equal(dequantize(q, dtype=torch.float32), want)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
@pytest.mark.parametrize("quant_type", ["nf4", "fp4", "int8"])
def test_output_dtype_is_the_fp32_value_rounded_once(device: str, quant_type: str, dtype: torch.dtype) -> None:
    q = quantize_ref(_weight((17, 100), device, seed=1), quant_type, 64, nested=quant_type != "int8")
    want32 = dequantize_ref(q, dtype=torch.float32)
    got = dequantize(q, dtype=dtype)
    assert got.dtype == dtype
    assert torch.equal(got, _expected(want32, dtype))
    if not backend.INTERPRETER_ON or dtype != torch.bfloat16:
        assert torch.equal(dequantize_ref(q, dtype=dtype), got)


@pytest.mark.parametrize("shape", [(17, 100), (1, 1), (33, 257)], ids=str)
def test_int8_kernel_equals_reference_bit_for_bit(device: str, shape: tuple[int, int]) -> None:
    q = quantize_ref(_weight(shape, device, seed=2), "int8")
    want = dequantize_ref(q, dtype=torch.float32)
    assert torch.equal(dequantize(q, dtype=torch.float32), want)
    # bitsandbytes' definition: (CB * SCB) * fp32(1/127), each product rounded to fp32.
    assert torch.equal(want, (q.data.float() * q.absmax[:, None]) * torch.tensor(1 / 127, dtype=torch.float32))


@pytest.mark.parametrize("quant_type", ["nf4", "int8"])
def test_tiles_of_rows_into_a_reused_buffer_equal_the_whole(device: str, quant_type: str) -> None:
    n, k = 23, 33  # K odd: a tile that starts at an odd row starts in the middle of a byte
    q = quantize_ref(_weight((n, k), device, seed=3), quant_type, 64, nested=quant_type == "nf4")
    whole = dequantize(q, dtype=torch.float32)
    buffer = torch.full((8, k + 7), 7.0, device=device)
    tile = buffer[:, 2 : 2 + k]  # row stride k + 7
    for start in range(0, n, 5):
        stop = min(n, start + 5)
        buffer.fill_(7.0)
        got = dequantize_rows(q, start, stop, out=tile[: stop - start])
        assert got.data_ptr() == tile.data_ptr()
        assert torch.equal(got, whole[start:stop])
        assert torch.equal(dequantize_ref(q, start, stop, torch.float32), whole[start:stop])
        written = torch.zeros_like(buffer, dtype=torch.bool)
        written[: stop - start, 2 : 2 + k] = True
        assert bool((buffer[~written] == 7.0).all())  # nothing outside the tile
    assert dequantize_rows(q, 4, 4).shape == (0, k)


@pytest.mark.parametrize("launch", [(16, 8), (64, 64), (8, 2)], ids=str)
@pytest.mark.parametrize("blocksize", [32, 128])
def test_4bit_rows_across_programs_and_runs(
    device: str, blocksize: int, launch: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Small tiles (elements a program, the longest run): many programs, runs shorter than a block
    # and rows that start in the middle of a byte, a run and a tile (K = 33 is odd).
    monkeypatch.setattr(quant, "LAUNCH_4BIT", quant.Launch4bit(*launch, num_warps=1))
    n, k = 13, 33
    q = quantize_ref(_weight((n, k), device, seed=4), "nf4", blocksize, nested=True, nested_blocksize=3)
    whole = dequantize_ref(q, dtype=torch.float32)
    assert torch.equal(dequantize(q, dtype=torch.float32), whole)
    for start, stop in [(0, 1), (1, 2), (3, 8), (7, 13), (12, 13)]:
        out = torch.full((stop - start + 1, k), 7.0, device=device)  # one row more than written
        got = dequantize_rows(q, start, stop, out=out[: stop - start])
        assert torch.equal(got, whole[start:stop])
        assert bool((out[-1] == 7.0).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=dtype_name)
@pytest.mark.parametrize("launch", [(16, 8), (64, 64), (8, 2)], ids=str)
def test_16bit_rows_as_pairs_and_not(
    device: str, dtype: torch.dtype, launch: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A 16-bit output starting on an even element is written two values a word (PAIRS, with
    # LAUNCH_4BIT_PAIRS), one starting on an odd element, or an odd count, value by value: both
    # give the fp32 value rounded once, across many programs and runs (K = 34 and 33).
    monkeypatch.setattr(quant, "LAUNCH_4BIT", quant.Launch4bit(*launch, num_warps=1))
    monkeypatch.setattr(quant, "LAUNCH_4BIT_PAIRS", quant.Launch4bit(*launch, num_warps=2))
    for k in (34, 33):
        q = quantize_ref(_weight((13, k), device, seed=5), "nf4", 32, nested=True, nested_blocksize=3)
        whole = _expected(dequantize_ref(q, dtype=torch.float32), dtype)
        assert torch.equal(dequantize(q, dtype=dtype), whole)
        for start, stop in [(0, 1), (1, 2), (3, 8), (7, 13), (12, 13)]:
            out = torch.full((stop - start + 1, k), 7.0, device=device, dtype=dtype)  # one row more than written
            got = dequantize_rows(q, start, stop, out=out[: stop - start])
            assert torch.equal(got, whole[start:stop]), (k, start, stop)
            assert bool((out[-1] == 7.0).all())


def test_pairs_are_taken_only_where_words_line_up(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    out = torch.empty(4, 6, dtype=torch.bfloat16, device=device)
    assert quant._as_words(out, 0, 24) is None or quant.LAUNCH_4BIT_PAIRS is not None  # None: not taken
    monkeypatch.setattr(quant, "LAUNCH_4BIT_PAIRS", quant.Launch4bit(64, 32, num_warps=1))
    assert quant._as_words(out, 0, 24) is not None
    assert quant._as_words(out, 1, 24) is None  # odd first element
    assert quant._as_words(out, 0, 23) is None  # odd count
    assert quant._as_words(out.reshape(-1)[1:23], 0, 22) is None  # not word-aligned
    assert quant._as_words(out.float(), 0, 24) is None  # fp32: value by value


def _4bit_kernel_types(names: list[str], pairs: bool) -> dict[str, str]:
    """Triton types of a 4-bit kernel's arguments for NF4 with a nested absmax, bf16 out."""

    def kind(name: str) -> str:
        base = name.removesuffix("_ptr").rstrip("0123456789").rstrip("_")
        if base == "out":
            return "*i32" if pairs else "*bf16"
        if base in ("data", "absmax"):
            return "*u8"
        if base in ("code", "code2", "absmax2", "offset"):
            return "*fp32"
        return "constexpr" if name.isupper() else "i32"  # first, n_out, n_bytes, tiles

    return {name: kind(name) for name in names}


@pytest.mark.parametrize("kernel", ["_dequantize_4bit_kernel", "_dequantize_4bit_three_kernel"])
@pytest.mark.parametrize("pairs", [True, False], ids=["pairs", "interleaved"])
def test_4bit_kernels_store_and_load_vectors(kernel: str, pairs: bool) -> None:
    # Compiled for an H100/H200 (no GPU needed) at their launches for NF4, blocksize 64, nested, bf16
    # out: every store of W is 16 bytes a thread (st.global.v4), and the code bytes load 8 or more
    # at a time. Triton vectorizes a masked access only where it can prove the mask's bounds are
    # multiples of the vector: a byte bound (first + n_out + 1) // 2 made the pairs kernel's stores
    # 4 bytes a thread and its loads one byte (INDEX.md#qlora_dequant_fused).
    fn = getattr(quant, kernel)
    names = list(inspect.signature(getattr(fn, "fn", fn)).parameters)
    runs, run = quant._runs(64, quant._launch_4bit(pairs))
    constexprs = {"BLOCKSIZE": 64, "BLOCKSIZE2": 256, "NESTED": True, "RUNS": runs, "RUN": run, "PAIRS": pairs,
                  "BF16": True}  # fmt: skip
    counts = testing.compile_kernel(
        "fk.lora.quant", kernel, _4bit_kernel_types(names, pairs), constexprs,
        num_warps=quant._launch_4bit(pairs).num_warps,
    ).memory_instructions  # fmt: skip
    stores = {op: n for op, n in counts.items() if op.startswith("st.")}
    assert stores and all(op.startswith("st.global.v4") for op in stores), counts
    assert any(op.startswith(("ld.global.v2", "ld.global.v4")) for op in counts), counts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_name)
def test_together_equals_each_alone(device: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    # Up to three 4-bit weights of one format in one launch (small tiles: every weight spans several
    # programs); a fourth of that format, weights of other formats and an int8 one, alone; each result
    # a new tensor equal to dequantize's.
    monkeypatch.setattr(quant, "LAUNCH_4BIT", quant.Launch4bit(64, 32, num_warps=1))
    monkeypatch.setattr(quant, "LAUNCH_4BIT_PAIRS", quant.Launch4bit(64, 32, num_warps=1))
    launches = []
    three = quant._dequantize_4bit_three_kernel
    monkeypatch.setattr(quant, "_dequantize_4bit_three_kernel", _Recording(three, launches))
    nf4 = [quantize_ref(_weight((n, 40), device, seed=n), "nf4", 32, nested=True, nested_blocksize=3)
           for n in (13, 5, 7, 3)]  # fmt: skip
    other = [
        quantize_ref(_weight((6, 40), device, seed=8), "fp4", 32, nested=True, nested_blocksize=3),
        quantize_ref(_weight((6, 40), device, seed=9), "nf4", 64, nested=True, nested_blocksize=3),
        quantize_ref(_weight((6, 40), device, seed=10), "int8"),
    ]
    qs = [nf4[0], other[0], nf4[1], other[2], nf4[2], other[1], nf4[3]]
    got = dequantize_together(qs, dtype=dtype)
    assert len(got) == len(qs)
    for q, w in zip(qs, got, strict=True):
        assert torch.equal(w, dequantize(q, dtype=dtype))
        assert w.is_contiguous() and w.shape == q.shape
    assert len({w.data_ptr() for w in got}) == len(qs)
    if quant.uses_kernel(nf4[0].data):  # nf4[0], nf4[1], nf4[2] in one launch (13, 5, 7 rows of 40: 9 + 4 + 5 tiles)
        assert launches == [(18,)]
    for pair in ([nf4[1], nf4[3]], [nf4[0]]):  # two together (no third), and one alone
        assert all(
            torch.equal(w, dequantize(q, dtype=dtype))
            for q, w in zip(pair, dequantize_together(pair, dtype=dtype), strict=True)
        )
    assert dequantize_together([]) == []
    with pytest.raises(TypeError, match=r"qs\[1\]"):
        dequantize_together([nf4[0], torch.zeros(3)])  # type: ignore[list-item]


class _Recording:
    """A Triton kernel that records the grid of each launch."""

    def __init__(self, kernel: object, grids: list[object]) -> None:
        self.kernel, self.grids = kernel, grids

    def __getitem__(self, grid: object) -> object:
        self.grids.append(grid)
        return self.kernel[grid]  # type: ignore[index]


def test_nested_absmax_rounds_product_and_sum_apart(device: str) -> None:
    # absmax = code2 * absmax2 + offset with code2 = absmax2 = 1 + 2^-12 and offset = -1: the product
    # 1 + 2^-11 + 2^-24 rounds (a tie, to even) to 1 + 2^-11, so absmax is 2^-11; one fused
    # multiply-add would give 2^-11 + 2^-24.
    one_plus = 1.0 + 2.0**-12
    code2 = torch.full((256,), one_plus, device=device)
    nested = NestedAbsmax(torch.full((1,), one_plus, device=device), code2, 256, torch.full((1,), -1.0, device=device))
    data = torch.full((2,), 0xFF, dtype=torch.uint8, device=device)  # code index 15: NF4's 1.0
    q = QuantizedWeight("nf4", data, (1, 4), torch.zeros(1, dtype=torch.uint8, device=device), 64, nested)
    want = torch.full((1, 4), 2.0**-11, device=device)
    assert torch.equal(dequantize_ref(q, dtype=torch.float32), want)
    assert torch.equal(dequantize(q, dtype=torch.float32), want)


def test_from_bnb_reads_bitsandbytes_attributes_without_bitsandbytes() -> None:
    # A stand-in with the attributes of Params4bit and its QuantState (nested), and of Int8Params.
    class State:
        pass

    q = quantize_ref(_weight((6, 40), "cpu", seed=4), "fp4", 32, nested=True)
    assert q.nested is not None
    state, state2 = State(), State()
    state.__dict__.update(
        absmax=q.absmax, shape=torch.Size([6, 40]), code=code_table("fp4", q.device), blocksize=32,
        quant_type="fp4", dtype=torch.float16, offset=q.nested.offset.reshape(()), state2=state2,
    )  # fmt: skip
    state2.__dict__.update(absmax=q.nested.absmax, code=q.nested.code, blocksize=q.nested.blocksize)
    packed = q.data.clone().reshape(-1, 2).view(torch.bfloat16)  # quant_storage bf16 (FSDP): the same bytes
    packed.quant_state = state  # type: ignore[attr-defined]
    read = from_bnb(packed)
    assert read.dtype == torch.float16 and read.quant_type == "fp4" and read.blocksize == 32
    assert torch.equal(dequantize_ref(read, dtype=torch.float32), dequantize_ref(q, dtype=torch.float32))

    layer = State()
    layer.weight = q8 = quantize_ref(_weight((5, 9), "cpu", seed=5), "int8").data.clone()  # type: ignore[attr-defined]
    q8.SCB = torch.rand(5) + 0.5  # type: ignore[attr-defined]
    q8.has_fp16_weights = False  # type: ignore[attr-defined]
    read8 = from_bnb(layer)
    assert read8.quant_type == "int8" and read8.data.data_ptr() == q8.data_ptr()


def _bad(q: QuantizedWeight, **changes: object) -> None:
    fields = {**q.__dict__, **changes}
    QuantizedWeight(**fields)  # type: ignore[arg-type]


def test_bad_input_names_the_argument() -> None:
    q = quantize_ref(_weight((6, 40), "cpu"), "nf4", 64)
    qn = quantize_ref(_weight((6, 40), "cpu"), "nf4", 64, nested=True)
    with pytest.raises(ValueError, match="quant_type"):
        _bad(q, quant_type="nf3")
    with pytest.raises(TypeError, match="data must have dtype in \\(uint8\\)"):
        _bad(q, data=q.data.to(torch.int8))
    with pytest.raises(ValueError, match="data must have 120 elements"):
        _bad(q, data=q.data[:-1])
    with pytest.raises(ValueError, match="absmax must have 4 elements"):
        _bad(q, absmax=q.absmax[:-1])
    with pytest.raises(TypeError, match="absmax must have dtype in \\(uint8\\)"):
        _bad(q, nested=qn.nested)
    with pytest.raises(ValueError, match="blocksize must be >= 2"):
        _bad(q, blocksize=0)
    with pytest.raises(ValueError, match="blocksize must be a power of two"):
        _bad(q, blocksize=48)
    with pytest.raises(ValueError, match="shape"):
        _bad(q, shape=(240,))
    assert qn.nested is not None
    with pytest.raises(ValueError, match=r"nested\.code must have 256 elements"):
        _bad(qn, nested=NestedAbsmax(qn.nested.absmax, qn.nested.code[:16], 256, qn.nested.offset))
    with pytest.raises(ValueError, match="stop must be <= out_features \\(6\\)"):
        dequantize_rows(q, 0, 7)
    with pytest.raises(ValueError, match="stop must be >= 3"):
        dequantize_rows(q, 3, 2)
    with pytest.raises(ValueError, match="out must have shape \\(2, 40\\)"):
        dequantize_rows(q, 0, 2, out=torch.empty(2, 41))
    with pytest.raises(TypeError, match="out must have dtype"):
        dequantize(q, out=torch.empty(6, 40, dtype=torch.float64))
    with pytest.raises(TypeError, match="dtype must be one of"):
        dequantize(q, dtype=torch.int32)
    with pytest.raises(TypeError, match="q must be a QuantizedWeight"):
        dequantize(q.data)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="layer_or_weight"):
        from_bnb(object())
    with pytest.raises(TypeError, match="layer_or_weight must be a bitsandbytes 4-bit or 8-bit weight"):
        from_bnb(torch.zeros(3, 3))
    repacked = q.data.clone()
    repacked.quant_state = type("S", (), {"packing_format_for_cpu": True})()  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="packing_format_for_cpu"):
        from_bnb(repacked)
    unquantized = torch.zeros(3, 3)
    unquantized.SCB, unquantized.has_fp16_weights = None, False  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="not quantized yet"):
        from_bnb(unquantized)


def test_reference_path_without_the_interpreter_gives_the_reference() -> None:
    testing.run_on_reference_path(
        "import torch\n"
        "from fk.lora.quant import dequantize, dequantize_ref, quantize_ref\n"
        "q = quantize_ref(torch.randn(9, 70), 'fp4', 32, nested=True)\n"
        "assert torch.equal(dequantize(q, dtype=torch.bfloat16), dequantize_ref(q, dtype=torch.bfloat16))\n"
        "print('ok')\n"
    )


def test_compiles_without_graph_breaks(device: str) -> None:
    # Under torch.compile the reference's torch ops run (traced); the values are the same.
    q = quantize_ref(_weight((17, 100), device, seed=9), "nf4", 64, nested=True)
    x = _weight((3, 100), device, seed=10)
    compiled = torch.compile(lambda x: x @ dequantize_rows(q, 2, 9, dtype=torch.float32).T, fullgraph=True)
    assert torch.equal(compiled(x), x @ dequantize(q, dtype=torch.float32)[2:9].T)


# --- against bitsandbytes (skipped where it is not installed) ---------------------------------

needs_bnb = pytest.mark.skipif(not HAS_BNB, reason="bitsandbytes is not installed (extra fk-lora[qlora])")


@needs_bnb
@pytest.mark.parametrize("shape", [(17, 100), (5, 33)], ids=str)
@pytest.mark.parametrize("blocksize", [64, 256])
@pytest.mark.parametrize("nested", [False, True], ids=["absmax", "nested"])
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_4bit_equals_bitsandbytes_dequantize_4bit(
    device: str, quant_type: str, nested: bool, blocksize: int, shape: tuple[int, int]
) -> None:
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnb_f

    testing.require_bitsandbytes_4bit(device)
    w = _weight(shape, "cpu", seed=6).to(torch.bfloat16)
    param = bnb.nn.Params4bit(
        w, requires_grad=False, quant_type=quant_type, blocksize=blocksize, compress_statistics=nested
    ).to(device)
    q = from_bnb(param)
    assert q.dtype == torch.bfloat16 and (q.nested is not None) == nested
    want = {}
    for dtype in (torch.float32, torch.bfloat16):  # bitsandbytes' CUDA kernels, or its CPU backend
        param.quant_state.dtype = dtype
        want[dtype] = bnb_f.dequantize_4bit(param.data, param.quant_state)
        assert torch.equal(dequantize_ref(q, dtype=dtype), want[dtype])
    assert torch.equal(dequantize(q, dtype=torch.float32), want[torch.float32])
    assert torch.equal(dequantize(q, dtype=torch.bfloat16), _expected(want[torch.float32], torch.bfloat16))


@needs_bnb
@pytest.mark.parametrize("storage", [torch.uint8, torch.bfloat16], ids=dtype_name)
def test_linear4bit_layer_reads_as_bitsandbytes_dequantizes_it(device: str, storage: torch.dtype) -> None:
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnb_f

    testing.require_bitsandbytes_4bit(device)
    layer = bnb.nn.Linear4bit(64, 12, bias=False, quant_type="nf4", quant_storage=storage)
    layer.weight = bnb.nn.Params4bit(
        _weight((12, 64), "cpu", seed=7), requires_grad=False, quant_type="nf4", quant_storage=storage
    )
    layer = layer.to(device)
    want = bnb_f.dequantize_4bit(layer.weight.data, layer.weight.quant_state)
    assert torch.equal(dequantize(from_bnb(layer), dtype=torch.float32), want.float())


@needs_bnb
@pytest.mark.parametrize("shape", [(17, 100), (1, 5)], ids=str)
def test_int8_equals_bitsandbytes_int8_vectorwise_dequant(device: str, shape: tuple[int, int]) -> None:
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnb_f

    layer = bnb.nn.Linear8bitLt(shape[1], shape[0], bias=False, has_fp16_weights=False)
    layer.weight = bnb.nn.Int8Params(_weight(shape, "cpu", seed=8).half(), requires_grad=False, has_fp16_weights=False)
    layer = layer.to(device)
    q = from_bnb(layer)
    want = bnb_f.int8_vectorwise_dequant(layer.weight.data, layer.weight.SCB)
    assert torch.equal(dequantize(q, dtype=torch.float32), want)
    assert torch.equal(dequantize_ref(q, dtype=torch.float32), want)
