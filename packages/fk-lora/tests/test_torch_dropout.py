"""fk.lora.torch_dropout: Philox against its published known answers, the kernels' mask tiles against
the plain-PyTorch reference (on the GPU where there is one, else in the interpreter), the word
threshold against the float comparison, and, on a GPU, every mask against ``torch.native_dropout``'s."""

from __future__ import annotations

import pytest
import torch

from fk.core import testing
from fk.lora import torch_dropout
from fk.lora.torch_dropout import Draw, keep_mask, keep_ref, keep_threshold, philox_ref, reserve


def test_philox_matches_its_known_answers() -> None:
    # Random123's kat_vectors for philox4x32-10: (counter words, key words) -> output words.
    cases = [
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
         (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
    ]  # fmt: skip

    def int64(low: int, high: int) -> torch.Tensor:  # two 32-bit words as one int64 (two's complement)
        value = low | high << 32
        return torch.tensor([value - 2**64 if value >= 2**63 else value])

    for (c0, c1, c2, c3), (k0, k1), want in cases:
        counter, subsequence = int64(c0, c1), int64(c2, c3)
        got = philox_ref(k0 | k1 << 32, counter, subsequence)
        assert [int(w) for w in got] == list(want)


@pytest.mark.parametrize("vec", [4, 8])
@pytest.mark.parametrize(
    ("n", "threads", "counter", "seed"),
    [
        (8, 256, 0, 0),
        (4104, 96, 7, 12345678901234567890),
        (20000, 512, 2**32 - 3, 2**40 + 5),
        (65536, 8192, 40, 67280421310721),
    ],
)
def test_kernel_masks_match_reference(device: str, vec: int, n: int, threads: int, counter: int, seed: int) -> None:
    # Several iterations a thread (n > threads * vec), a counter crossing 2**32 (the carry into its
    # high word), seeds above 2**63.
    for p_keep in (0.95, 0.5, 0.1):
        draw = Draw(seed, counter, threads, vec, p_keep)
        want = keep_ref(n, draw)
        got = keep_mask(n, draw, device).cpu()
        assert torch.equal(got, want), f"{(got != want).sum()} of {n} differ"
        assert abs(want.float().mean().item() - p_keep) < 4 / n**0.5 + 0.01


def test_every_draw_field_counts() -> None:
    # A test that can fail: each field of a draw moves the mask.
    draw = Draw(1234, 8, 64, 8, 0.5)
    base = keep_ref(4096, draw)
    for changed in (draw._replace(seed=1235), draw._replace(counter=9), draw._replace(threads=32),
                    draw._replace(vec=4), draw._replace(p_keep=0.4)):  # fmt: skip
        assert not torch.equal(keep_ref(4096, changed), base), changed


@pytest.mark.parametrize("p_keep", [0.95, 0.9, 0.75, 0.5, 0.1, 1 - 1e-9, 1e-9])
def test_keep_threshold_is_the_float_comparison(p_keep: float) -> None:
    # The kernels keep a word w when w < keep_threshold(p): the float comparison's boundary, exactly.
    t = keep_threshold(p_keep)
    words = torch.tensor([0, max(t - 2, 0), t - 1, t, t + 1, 2**32 - 1], dtype=torch.int64).clamp(0, 2**32 - 1)
    uniform = (words.to(torch.float32).double() * 2.0**-32 + 2.0**-33).float()
    assert torch.equal(words < t, uniform < torch.tensor(p_keep, dtype=torch.float32))


def test_reserve_refuses_what_it_cannot_replicate(device: str) -> None:
    x = torch.ones(64, 32, dtype=torch.bfloat16, device=device)
    if device != "cuda":  # torch's CPU dropout is another generator altogether
        assert reserve(x, [0.1]) is None
        return
    assert reserve(x.t(), [0.1]) is None  # not contiguous
    assert reserve(torch.ones(2 * 1000 + 1, dtype=torch.bfloat16, device=device)[1:], [0.1]) is None  # 2-byte aligned
    assert reserve(torch.ones(101, dtype=torch.bfloat16, device=device), [0.1]) is None  # size odd: V = 1
    (draw,) = reserve(torch.ones(1004, dtype=torch.bfloat16, device=device), [0.1]) or [None]
    assert draw is not None and draw.vec == 4  # 4 divides 1004, 8 does not


def _torch_masks(x: torch.Tensor, ps: list[float], seed: int) -> tuple[list[torch.Tensor], int, torch.Tensor]:
    generator = torch.cuda.default_generators[x.device.index or 0]
    generator.manual_seed(seed)
    masks = [torch.native_dropout(x, p, True)[1] for p in ps]
    return masks, generator.get_offset(), torch.rand(100, device=x.device)


@pytest.mark.parametrize(
    "shape", [(4096, 4096), (2, 513, 1000), (100, 4096), (3, 8), (1 << 22,)], ids=lambda s: "x".join(map(str, s))
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_masks_are_torchs(device: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    # fk's masks, and the generator after them, against torch.native_dropout's three calls in a row
    # (which PEFT's q, k and v make): capped and uncapped grids, both vector sizes, small sizes.
    if device != "cuda":
        pytest.skip("torch's CUDA masks need a GPU")
    torch_dropout._replicated_vector_size.cache_clear()  # each case with the one-time check on its first draw
    x = torch.randn(shape, device=device).to(dtype)
    ps = [0.05, 0.1, 0.3]
    want, want_offset, want_next = _torch_masks(x, ps, 1234)
    generator = torch.cuda.default_generators[x.device.index or 0]
    generator.manual_seed(1234)
    draws = reserve(x, ps)
    assert draws is not None
    got = [keep_mask(x.numel(), d, x.device).view(shape) for d in draws]
    assert generator.get_offset() == want_offset
    assert torch.equal(torch.rand(100, device=device), want_next)  # what follows draws the same numbers
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(g, w), f"mask {i}: {(g != w).sum()} of {g.numel()} differ"


def test_misaligned_input_takes_vector_size_4(device: str) -> None:
    if device != "cuda":
        pytest.skip("torch's CUDA masks need a GPU")
    x = torch.randn(4096 * 1024 + 4, device=device).bfloat16()[4:]  # 8-byte aligned: torch's V = 4
    want, want_offset, _ = _torch_masks(x, [0.1], 7)
    torch.cuda.default_generators[x.device.index or 0].manual_seed(7)
    (draw,) = reserve(x, [0.1]) or [None]
    assert draw is not None and draw.vec == 4
    assert torch.equal(keep_mask(x.numel(), draw, x.device), want[0])
    assert torch.cuda.default_generators[x.device.index or 0].get_offset() == want_offset


def test_replicates_puts_the_generator_back(device: str) -> None:
    # The one-time check draws with torch and with fk, then leaves the generator where it found it:
    # the first mask fk draws afterwards is still the one PEFT would draw.
    if device != "cuda":
        pytest.skip("torch's CUDA masks need a GPU")
    torch_dropout._replicated_vector_size.cache_clear()
    generator = torch.cuda.default_generators[torch.cuda.current_device()]
    generator.manual_seed(3)
    torch.rand(10, device=device)  # an offset other than 0
    before = generator.get_offset()
    assert torch_dropout.replicates(torch.device("cuda", torch.cuda.current_device()), torch.bfloat16) in (4, 8)
    assert generator.get_offset() == before


def test_replicates_does_not_remember_an_offset_it_could_not_check_at(monkeypatch: pytest.MonkeyPatch) -> None:
    # At an offset not a multiple of 4 the check cannot run: that call says 0 and remembers nothing
    # (a remembered 0 would send every later draw of the process to torch.native_dropout).
    class Generator:
        def get_offset(self) -> int:
            return 6

    monkeypatch.setattr(torch_dropout, "_generator", lambda device: Generator())
    torch_dropout._replicated_vector_size.cache_clear()
    assert torch_dropout.replicates(torch.device("cuda", 0), torch.bfloat16) == 0
    assert torch_dropout._replicated_vector_size.cache_info().currsize == 0


@pytest.mark.parametrize(
    "specialized", [{}, {"seed": 1}, {"seed": 1, "counter": 1}], ids=["none", "seed", "seed_counter"]
)
def test_mask_kernel_compiles_with_arguments_of_one(specialized: dict[str, int]) -> None:
    """Triton passes an integer argument equal to 1 as a constant (a Python int in the kernel): a seed
    of 1 (``torch.manual_seed(1)``) once failed to compile on a GPU (``seed.to``). Compiled for sm_90
    on the CPU with those arguments specialized so."""
    signature = {"out_ptr": "*i1", "seed": "i64", "counter": "i64", "threads": "i32", "threshold": "i64",
                 "n_groups": "i32", "VEC": "", "BLOCK": ""}  # fmt: skip
    compiled = testing.compile_kernel(
        "fk.lora.torch_dropout", "_keep_mask_kernel", signature, {"VEC": 8, "BLOCK": 256, **specialized}, num_warps=4
    )
    assert compiled.spill_bytes == 0
