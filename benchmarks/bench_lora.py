"""LoRA MLP, QKV and O forward+backward side by side: fk.lora against PEFT eager, on the same modules.

Llama-3.1-8B layer shapes (hidden 4096, intermediate 14336, 32 query / 8 key-value heads of 128),
r=16, alpha=32, bf16 base weights (frozen), inputs that require grad, at 4096 and 16384 tokens,
LoRA dropout 0 and 0.05, LoRA weights in bf16 and in fp32 (fp32 is what ``peft.get_peft_model``
gives a bf16 model by default: ``autocast_adapter_dtype=True``). PEFT's LoRA layers are injected into plain modules
that compute as Hugging Face's LlamaMLP / LlamaAttention projections
(``peft.inject_adapter_in_model``); the ``fk`` rows run the same modules after ``fk.lora.patch``.
Forward+backward time, FLOP rate against the bf16 matmul ceiling measured in the same run, and
peak memory. FLOPs counted: the base matmuls only, forward and the input gradient
(``4 * tokens * sum(in * out)``); the LoRA branch is under 1% of that at r=16.

``--dora`` runs the same with DoRA adapters (PEFT ``use_dora=True``; record ``lora_dora.json``). Its
floor ("fk floor%") is the base matmuls' FLOPs, twice with dropout (PEFT's DoRA then computes
``F.linear(dropout(x), W)`` beside the base output, and its input gradient), at the matmul ceiling
plus one read of each bf16 base weight (the norm of ``W + s B A``, every forward) at the copy
bandwidth (:func:`dora_floor_work`); with dropout cuBLAS's time for both sets of products is taken in
one call, as the row runs them (a run that long is slower: :func:`_against_ceilings`).

``--qlora`` runs the same on 4-bit base weights (QLoRA; record ``lora_qlora.json``): each base linear
a bitsandbytes ``Linear4bit`` (NF4, nested absmax, blocksize 64, bf16 compute) under PEFT's LoRA
layer for it, against fk. The floor of a case ("fk floor%": the floor's time over fk's) is its base
matmuls' FLOPs at the bf16 matmul ceiling plus the dequantization of each of its 4-bit weights
twice (the forward's base matmul, and the backward's input gradient: QLoRA keeps no dequantized
weight), each reading the packed codes and the scales and writing the bf16 weight, at the copy
bandwidth; both ceilings are measured in the same run (``fk.core.bench.floor_ms``).

``--dora --qlora``: DoRA adapters on those 4-bit bases (record ``lora_dora_qlora.json``); the floor is
DoRA's FLOPs with the two dequantizations of each weight (the norm reads the forward's).

Every floor's base matmuls take the faster of their FLOPs at the matmul ceiling and cuBLAS's own time
for the layer's products (:func:`base_gemm_ms`, each row's ``gemm_ms``). The ceilings and ``gemm_ms``
are timed as the rows are, with the GPU idle before each call: back to back a large matmul runs about
12% slower (``experiments/matmul_ceiling_modes``), so records whose rows have no ``gemm_ms`` (their
ceilings timed back to back) read their floors about that much too lax.

Run on a GPU:  python benchmarks/bench_lora.py --out benchmarks/results/lora.json
               python benchmarks/bench_lora.py --qlora          (benchmarks/results/lora_qlora.json)
Try on a CPU:  python benchmarks/bench_lora.py --qlora --tiny --out /tmp/lora   (tiny shapes; fk in
               Triton's interpreter, PEFT on bitsandbytes' CPU backend: checks every code path)
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

if not torch.cuda.is_available():  # the --tiny CPU run: fk's kernels in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fk.core import bench
from fk.hf import training

NAME = "lora"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCKS = ("mlp", "qkv", "o")
ADAPTER_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


class Shape(NamedTuple):
    """The sizes of a decoder layer's projections."""

    hidden: int
    inter: int
    heads: int
    kv_heads: int
    head_dim: int


LLAMA = Shape(hidden=4096, inter=14336, heads=32, kv_heads=8, head_dim=128)
"""Llama-3.1-8B's."""
TINY = Shape(hidden=64, inter=128, heads=4, kv_heads=2, head_dim=16)
"""--tiny's: every input width a multiple of the 4-bit blocksize (bitsandbytes 0.50's CPU dequantization
is wrong for some others: fk-lora's tests/test_qlora.py)."""
HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = LLAMA

QUANT_TYPE, QUANT_BLOCKSIZE = training.QLORA_QUANT_TYPE, training.QLORA_BLOCKSIZE
NESTED_BLOCKSIZE = 256
"""--qlora's base weights (``fk.hf.training.quantize_4bit``'s): NF4 in blocks of 64, the absmax quantized
again in blocks of 256 (bitsandbytes' ``compress_statistics=True``), as QLoRA's paper and Hugging
Face's usual config."""


class _MLP(nn.Module):
    """Hugging Face's LlamaMLP."""

    def __init__(self, shape: Shape = LLAMA) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(shape.hidden, shape.inter, bias=False)
        self.up_proj = nn.Linear(shape.hidden, shape.inter, bias=False)
        self.down_proj = nn.Linear(shape.inter, shape.hidden, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class _Attention(nn.Module):
    """The four projections of Hugging Face's LlamaAttention (the attention itself is not timed)."""

    def __init__(self, shape: Shape = LLAMA) -> None:
        super().__init__()
        self.q_proj = nn.Linear(shape.hidden, shape.heads * shape.head_dim, bias=False)
        self.k_proj = nn.Linear(shape.hidden, shape.kv_heads * shape.head_dim, bias=False)
        self.v_proj = nn.Linear(shape.hidden, shape.kv_heads * shape.head_dim, bias=False)
        self.o_proj = nn.Linear(shape.heads * shape.head_dim, shape.hidden, bias=False)


def _lora_model(
    block: str, dropout: float, rank: int, alpha: int, adapter_dtype: torch.dtype, dora: bool = False,
    *, shape: Shape = LLAMA, qlora: bool = False,
) -> nn.Module:  # fmt: skip
    import peft

    torch.manual_seed(0)
    base = _MLP(shape) if block == "mlp" else _Attention(shape)
    targets = ["gate_proj", "up_proj", "down_proj"] if block == "mlp" else ["q_proj", "k_proj", "v_proj", "o_proj"]
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets,
                             init_lora_weights=False, use_dora=dora)  # fmt: skip
    if qlora:  # each nn.Linear made a bitsandbytes Linear4bit, quantized on the GPU
        training.quantize_4bit(base, targets, compute_dtype=torch.bfloat16, device=DEVICE)
    model = peft.inject_adapter_in_model(config, base)
    model = model.to(device=DEVICE, dtype=torch.bfloat16).train()  # (4-bit weights are uint8: not cast)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)  # (DoRA's lora_magnitude_vector too)
        if "lora_" in name:
            p.data = p.data.to(adapter_dtype)
    return model


def _call(model: nn.Module, block: str) -> Callable[[torch.Tensor], list[torch.Tensor]]:
    if block == "mlp":
        return lambda x: [model(x)]
    attn: Any = model
    if block == "qkv":
        return lambda x: [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)]
    return lambda x: [attn.o_proj(x)]


def _projections(block: str, shape: Shape) -> list[tuple[int, int]]:
    """(in, out) features of each base linear of ``block``."""
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    return {"mlp": [(shape.hidden, shape.inter)] * 2 + [(shape.inter, shape.hidden)],
            "qkv": [(shape.hidden, q), (shape.hidden, kv), (shape.hidden, kv)],
            "o": [(q, shape.hidden)]}[block]  # fmt: skip


def _flops(block: str, tokens: int, shape: Shape = LLAMA) -> float:
    """The base matmuls' FLOPs of a forward and its input gradient: ``4 * tokens * sum(in * out)``."""
    return 4.0 * tokens * sum(k * n for k, n in _projections(block, shape))


def base_products(block: str, tokens: int, shape: Shape = LLAMA, *, fused: bool) -> list[tuple[int, int, int, str]]:
    """``(m, k, n, layout)`` of each base matmul of ``block``'s forward and input gradient, as a layer
    runs them with its weight ``W[n, k]``: ``x[m, k] @ W.T`` ("nt"), then ``dy[m, n] @ W`` ("nn");
    with ``fused``, the projections that share an input (gate and up; q, k and v) as one product."""
    projections = _projections(block, shape)
    if fused and block in ("mlp", "qkv"):
        shared = projections[:2] if block == "mlp" else projections
        projections = [(shared[0][0], sum(n for _, n in shared)), *projections[len(shared) :]]
    forward = [(tokens, k, n, "nt") for k, n in projections]
    input_gradient = [(tokens, n, k, "nn") for k, n in projections]
    return forward + input_gradient


def base_gemm_times(block: str, tokens: int, shape: Shape = LLAMA, rep: int = 20, sets: int = 1) -> dict[str, float]:
    """cuBLAS's GPU time (ms) for :func:`base_products`, one product a projection ("separate") and the
    projections that share an input in one ("fused"): random bf16 operands in the layer's layouts,
    timed as the rows are (``bench.time_ms(gpu_only=True)``: L2 flushed and the GPU idle before each
    call, so the products start on the clocks a row's do). ``sets`` runs the products that many times
    in the call, each set with inputs of its own and the same weights (DoRA with dropout: ``x`` and
    the dropped ``x``, and their gradients). Needs CUDA."""
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    times = {}
    for name in ("separate", "fused"):
        operands = []
        products = base_products(block, tokens, shape, fused=name == "fused")
        weights = []
        for _, k, n, layout in products:
            if layout == "nt":  # x @ W.T, W stored [n, k]
                weights.append(torch.randn(n, k, device="cuda", generator=gen).bfloat16().t())
            else:  # dy @ W, W stored [k, n] here (its rows are dy's columns)
                weights.append(torch.randn(k, n, device="cuda", generator=gen).bfloat16())
        for _ in range(sets):
            for (m, k, _, _), b in zip(products, weights, strict=True):
                operands.append((torch.randn(m, k, device="cuda", generator=gen).bfloat16(), b))

        def run(pairs: list[tuple[torch.Tensor, torch.Tensor]] = operands) -> None:
            for a, b in pairs:
                torch.matmul(a, b)

        times[name] = bench.time_ms(run, warmup=5, rep=rep, gpu_only=True)
        del operands, weights
        torch.cuda.empty_cache()
    return times


def base_gemm_ms(block: str, tokens: int, shape: Shape = LLAMA, sets: int = 1) -> float:
    """The faster of :func:`base_gemm_times`: what cuBLAS needs for ``block``'s base products (``sets``
    of them in one call)."""
    return min(base_gemm_times(block, tokens, shape, sets=sets).values())


def dequantization_bytes(block: str, shape: Shape = LLAMA) -> int:
    """Bytes one dequantization of each of ``block``'s 4-bit weights moves at least: the packed codes
    (half a byte an element), the uint8 absmax of each block and the fp32 scale of each nested block
    read, the bf16 weight written."""
    total = 0
    for k, n in _projections(block, shape):
        blocks = math.ceil(n * k / QUANT_BLOCKSIZE)
        total += math.ceil(n * k / 2) + blocks + 4 * math.ceil(blocks / NESTED_BLOCKSIZE) + 2 * n * k
    return total


def _timing(forward_backward: Callable[[], None], leaves: list[torch.Tensor], rep: int) -> dict[str, float]:
    """``ms`` (wall), ``gpu_ms`` (the GPU's work alone) and ``peak_mb`` on a GPU; ``ms`` alone on the CPU."""
    if DEVICE == "cpu":
        return {"ms": bench.cpu_time_ms(forward_backward, warmup=1, rep=rep, grad_to_none=leaves)}
    ms = bench.time_ms(forward_backward, warmup=5, rep=rep, grad_to_none=leaves)
    try:  # a LoRA block's host path takes milliseconds
        gpu_ms = bench.time_ms(forward_backward, warmup=5, rep=rep, grad_to_none=leaves, gpu_only=True,
                               head_start_ms=25.0)  # fmt: skip
    except RuntimeError:  # some host paths were longer than the head start hides (a busy host): once more, longer
        gpu_ms = bench.time_ms(forward_backward, warmup=5, rep=rep, grad_to_none=leaves, gpu_only=True,
                               head_start_ms=100.0)  # fmt: skip
    for t in leaves:
        t.grad = None
    peak = bench.peak_memory_bytes(forward_backward)
    for t in leaves:
        t.grad = None
    return {"ms": ms, "gpu_ms": gpu_ms, "peak_mb": peak / 2**20}


DORA_FLOOR = (
    "floor: base matmul FLOPs of forward and input gradient (twice with dropout: PEFT's DoRA multiplies "
    "the dropped input by the base weight too) at the matmul ceiling + one read of each bf16 base weight "
    "(its norm) at the copy bandwidth"
)

DORA_TWICE_FLOOR = (
    "DoRA with dropout: cuBLAS's time for both sets of products run in one call (each row's "
    "gemm_twice_ms: a run that long is slower than two each started idle, experiments/"
    "dora_dropout_gemm_floor), the ceiling's time scaled by its ratio to twice gemm_ms"
)


def dora_floor_work(block: str, tokens: int, dropout: float, shape: Shape = LLAMA) -> tuple[float, int]:
    """(FLOPs, bytes) a DoRA case must do at least, with PEFT's semantics: the base matmuls of the
    forward and the input gradient, twice with dropout (PEFT's DoRA then multiplies the dropped
    input by the base weight too, ``F.linear(dropout(x), W)``, and its input gradient follows), and
    the forward's read of each bf16 base weight for the norm ``||W + s B A||`` (2 bytes an element)."""
    products = 2 if dropout > 0 else 1
    return products * _flops(block, tokens, shape), sum(2 * k * n for k, n in _projections(block, shape))


GEMM_FLOOR = (
    "the base products' time is the faster of their FLOPs at the matmul ceiling and cuBLAS's own time "
    "for them (each row's gemm_ms: the layer's products in its layouts, fused by shared input where "
    "faster); the ceilings and gemm_ms are timed as the rows are, with the GPU idle before each call "
    "(back to back a large matmul runs about 12% slower: experiments/matmul_ceiling_modes)"
)


DROPOUT_FLOOR = (
    "with dropout, + each adapter's byte mask, written by the forward and read by the backward, at "
    "the copy bandwidth (drawing the masks, which must be torch's for PEFT's semantics, is Philox "
    "compute the floor does not count; no dropped input is counted: fk draws the masks inside its "
    "forward kernel and never writes one outside DoRA)"
)
PEFT_MASKS_FLOOR = (
    "with dropout, + the bytes of PEFT's dropout masks (the issue's 'same masks': per adapter, "
    "torch.native_dropout on the input in the adapter's dtype, after a cast of x where that differs, "
    "writing the dropped input and its byte mask; the dropped input read for A's product; the mask "
    "read in the backward) at the copy bandwidth"
)
"""The dropout's share of the floor in the records before 2026-11-28T12:41 (while fk drew its masks
with ``torch.native_dropout``); ``--refloor`` replaces it by :data:`DROPOUT_FLOOR`."""


def dropout_bytes(block: str, tokens: int, shape: Shape = LLAMA) -> int:
    """Bytes PEFT-identical dropout masks cost a case at least: each adapter's byte mask over its
    input ``[tokens, in]``, written once and read once (2 bytes an element, whatever the adapter's
    dtype: an fp32 product needs no fp32 copy of bf16 ``x``). Since fk draws torch's masks in its own
    kernel (``fk.lora.torch_dropout``), the dropped input that ``torch.native_dropout`` writes and
    ``A``'s product reads back is no longer part of any case's least work; the Philox numbers
    behind each mask are compute, which the floor does not count."""
    return sum(tokens * k * 2 for k, _ in _projections(block, shape))


def _against_ceilings(ceilings: bench.Ceilings | None, block: str, tokens: int, shape: Shape, qlora: bool,
                      ms: float, dora: bool = False, dropout: float = 0.0, gemm_ms: float | None = None,
                      gemm_twice_ms: float | None = None) -> dict[str, float]:  # fmt: skip
    """A row's share of what the ceilings allow: ``floor_ms`` and ``floor_fraction`` (the floor's time
    over ``ms``): the base matmuls' FLOPs at the matmul ceiling (DoRA's, :func:`dora_floor_work`), or
    where faster cuBLAS's own time for those products (``gemm_ms``, :func:`base_gemm_ms`; twice for
    DoRA with dropout), plus at the copy bandwidth the dequantizations of 4-bit weights and DoRA's
    read of each weight, and with dropout :func:`dropout_bytes`; dense LoRA also ``tflops`` and
    ``matmul_fraction``. Nothing without ceilings (the CPU).

    DoRA with dropout runs its products twice, back to back in one call, and a run of products that
    long is slower than two calls each started on an idle GPU (the MLP at 16384 tokens: 32.2 ms
    against twice 14.5; ``experiments/dora_dropout_gemm_floor``). Where the row has cuBLAS's time for
    both sets in one call (``gemm_twice_ms``, :func:`base_gemm_ms` with ``sets=2``), that time
    stands for twice ``gemm_ms``, and the ceiling's time (a short product's, started idle) is
    scaled by the same ratio: the ceiling is not kept up over the row's length either."""
    if ceilings is None:
        return {}
    flops, nbytes = dora_floor_work(block, tokens, dropout, shape) if dora else (_flops(block, tokens, shape), 0)
    if qlora:  # each 4-bit weight dequantized twice (forward, dx); DoRA's norm reads the forward's
        nbytes = 2 * dequantization_bytes(block, shape)
    if dropout > 0:
        nbytes += dropout_bytes(block, tokens, shape)
    matmul_ms = bench.floor_ms(ceilings, flops=flops)
    if gemm_ms is not None:
        sets = 2 if dora and dropout > 0 else 1
        sustained = gemm_twice_ms / (2 * gemm_ms) if sets == 2 and gemm_twice_ms is not None else 1.0
        matmul_ms = min(matmul_ms, sets * gemm_ms) * sustained
    floor = bench.floor_ms(ceilings, nbytes=nbytes) + matmul_ms
    shares = {"floor_ms": floor, "floor_fraction": floor / ms}
    if qlora or dora:
        return shares
    achieved = bench.tflops(_flops(block, tokens, shape), ms)
    return {"tflops": achieved, "matmul_fraction": bench.fraction(achieved, ceilings.matmul_tflops), **shares}


def refloor(record: bench.BenchRecord) -> bench.BenchRecord:
    """``record`` with every row's floor fields recomputed from the run's ceilings and times by
    :func:`_against_ceilings` (the measurements untouched), and the floor's description in its notes:
    for records from before a change to the floor's accounting (``--refloor``)."""
    ceilings = bench.Ceilings(**record.ceilings)
    for row in record.rows:
        if "ms" in row and "block" in row:
            row.update(_against_ceilings(ceilings, row["block"], row["tokens"], LLAMA, "qlora" in row, row["ms"],
                                         row.get("dora", False), row["dropout"], row.get("gemm_ms"),
                                         row.get("gemm_twice_ms")))  # fmt: skip
    if DROPOUT_FLOOR not in record.notes:
        recomputed = (
            f"{DROPOUT_FLOOR} (floors recomputed on {time.strftime('%Y-%m-%d')} from this run's ceilings and times)"
        )
        if PEFT_MASKS_FLOOR in record.notes:
            record.notes = record.notes.replace(PEFT_MASKS_FLOOR, recomputed)
        else:
            record.notes += f"; {recomputed}"
    return record


def measure(record: bench.BenchRecord, ceilings: bench.Ceilings | None, block: str, tokens: int, dropout: float,
            rank: int, alpha: int, rep: int, adapter: str, dora: bool = False, *, shape: Shape = LLAMA,
            qlora: bool = False, gemm_ms: float | None = None, gemm_twice_ms: float | None = None) -> None:  # fmt: skip
    import fk.lora

    model = _lora_model(block, dropout, rank, alpha, ADAPTER_DTYPES[adapter], dora, shape=shape, qlora=qlora)
    fn = _call(model, block)
    gen = torch.Generator(device=DEVICE).manual_seed(tokens)
    x = torch.randn(tokens, shape.hidden, device=DEVICE, dtype=torch.bfloat16, generator=gen).requires_grad_()
    with torch.no_grad():
        dys = [torch.randn_like(o) for o in fn(x)]
    leaves = [x, *(p for p in model.parameters() if p.requires_grad)]

    def forward_backward() -> None:
        torch.autograd.backward(fn(x), dys)

    # Sanity (dropout 0): the patched modules compute what PEFT's do, bf16 rounding apart.
    if dropout == 0:
        with torch.no_grad():
            want = fn(x)
            fk.lora.patch(model)
            got = fn(x)
            fk.lora.unpatch(model)
        for g, w in zip(got, want, strict=True):
            err = (g.float() - w.float()).abs().max().item() / max(w.float().abs().max().item(), 1e-6)
            if err > 0.05:
                raise AssertionError(f"fk disagrees with PEFT ({block}, {tokens} tokens): relative error {err}")

    twice = gemm_twice_ms if dora and dropout > 0 else None
    for provider in ("peft", "fk"):
        if provider == "fk":
            report = fk.lora.patch(model)
            if report.skipped:
                raise AssertionError(f"fk.lora left {block}'s layers to PEFT: {report.skipped}")
        timing = _timing(forward_backward, leaves, rep)
        record.add(
            provider=provider, block=block, tokens=tokens, dropout=dropout, adapter=adapter, mode="fwd+bwd",
            **timing, **_against_ceilings(ceilings, block, tokens, shape, qlora, timing["ms"], dora, dropout, gemm_ms,
                                          twice),
            **({"gemm_ms": gemm_ms} if gemm_ms is not None else {}),
            **({"gemm_twice_ms": twice} if twice is not None else {}),
            **({"dora": True} if dora else {}), **({"qlora": QUANT_TYPE} if qlora else {}),
        )  # fmt: skip
    fk.lora.unpatch(model)


def record_path(out: Path, dora: bool = False, qlora: bool = False) -> Path:
    """The JSON record ``out`` names: ``out`` itself, or inside a directory ``lora.json`` (with DoRA
    adapters ``lora_dora.json``, on 4-bit bases ``lora_qlora.json``, both ``lora_dora_qlora.json``)."""
    if out.is_dir() or not out.suffix:
        return out / f"{NAME}{'_dora' if dora else ''}{'_qlora' if qlora else ''}.json"
    return out


def run(tokens: list[int], dropouts: list[float], adapters: list[str], out: Path, rep: int, rank: int,
        alpha: int, dora: bool = False, *, qlora: bool = False, tiny: bool = False) -> bench.BenchRecord:  # fmt: skip
    shape = TINY if tiny else LLAMA
    layer = (f"tiny layer shapes {tuple(shape)} (TINY CHECK, not a measurement)" if tiny
             else "Llama-3.1-8B layer shapes")  # fmt: skip
    base = (f"4-bit base (bitsandbytes Linear4bit: {QUANT_TYPE}, nested absmax, blocksize {QUANT_BLOCKSIZE}, bf16 "
            "compute; PEFT's lora.bnb.Linear4bit)" if qlora else "bf16 base (frozen)")  # fmt: skip
    accounting = ("floor: base matmul FLOPs of forward and input gradient (DoRA with dropout: twice) at the matmul "
                  "ceiling + two dequantizations of each weight at the copy bandwidth" if qlora and dora
                  else "floor: base matmul FLOPs of forward and input gradient at the matmul ceiling + two "
                  "dequantizations of each weight at the copy bandwidth" if qlora
                  else DORA_FLOOR if dora else "floor: base matmul FLOPs of forward and input gradient at the "
                  "matmul ceiling")  # fmt: skip
    record = bench.BenchRecord(
        NAME,
        notes=(f"{layer}, {'DoRA, ' if dora else ''}r={rank}, alpha={alpha}, {base}, LoRA weights "
               f"in {' and '.join(adapters)}; {accounting}; {GEMM_FLOOR}; {DROPOUT_FLOOR}"
               f"{f'; {DORA_TWICE_FLOOR}' if dora and any(d > 0 for d in dropouts) else ''}"),
    )  # fmt: skip
    ceilings, gemm_ms, gemm_twice_ms = None, {}, {}
    if DEVICE == "cuda":  # all timed as the rows are (the GPU idle before each call)
        ceilings = bench.measure_ceilings(gpu_only=True)
        record.ceilings = ceilings.as_dict()
        print(f"ceilings: copy {ceilings.copy_tbps:.2f} TB/s, bf16 matmul {ceilings.matmul_tflops:.0f} TFLOP/s")
        gemm_ms = {(b, t): base_gemm_ms(b, t, shape) for b in BLOCKS for t in tokens}
        if dora and any(d > 0 for d in dropouts):  # (see _against_ceilings)
            gemm_twice_ms = {(b, t): base_gemm_ms(b, t, shape, sets=2) for b in BLOCKS for t in tokens}
    cases = [(b, t, d, a) for a in adapters for b in BLOCKS for t in tokens for d in dropouts]
    for block, t, d, a in bench.progress(cases, desc=NAME):
        measure(record, ceilings, block, t, d, rank, alpha, rep, a, dora, shape=shape, qlora=qlora,
                gemm_ms=gemm_ms.get((block, t)), gemm_twice_ms=gemm_twice_ms.get((block, t)))  # fmt: skip
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    out.parent.mkdir(parents=True, exist_ok=True)
    record.to_json(out)
    return record


def speedups(record: bench.BenchRecord) -> list[dict[str, object]]:
    """fk against PEFT eager per (DoRA, 4-bit base, adapter dtype, block, tokens, dropout): speed
    (PEFT ms / fk ms), fk's share of the matmul ceiling or of the floor, and the memory ratio.
    Records from before the adapter axis had bf16 adapters."""
    table = []

    def key(r: dict[str, Any]) -> tuple[bool, str, str, str, int, float]:
        return (r.get("dora", False), r.get("qlora", ""), r.get("adapter", "bf16"), r["block"], r["tokens"], r["dropout"])  # fmt: skip

    keys = sorted({key(r) for r in record.rows}, key=lambda k: (k[0], k[1], k[2], BLOCKS.index(k[3]), k[4], k[5]))
    for dora, qlora, adapter, block, tokens, dropout in keys:
        rows = {r["provider"]: r for r in record.rows if key(r) == (dora, qlora, adapter, block, tokens, dropout)}
        fk, peft = rows["fk"], rows["peft"]
        table.append({
            **({"dora": True} if dora else {}), **({"qlora": qlora} if qlora else {}), "adapter": adapter,
            "block": block, "tokens": tokens, "dropout": dropout, "fk ms": fk["ms"], "peft ms": peft["ms"],
            "x peft": peft["ms"] / fk["ms"],
            **({"fk matmul%": 100 * fk["matmul_fraction"]} if "matmul_fraction" in fk else {}),
            **({"fk floor%": 100 * fk["floor_fraction"]} if "floor_fraction" in fk else {}),
            **({"fk GPU floor%": 100 * fk["floor_ms"] / fk["gpu_ms"]} if "floor_ms" in fk and "gpu_ms" in fk else {}),
            **({"fk MB": fk["peak_mb"], "peft MB": peft["peak_mb"], "memory / peft": fk["peak_mb"] / peft["peak_mb"]}
               if "peak_mb" in fk else {}),
            **({"fk GPU ms": fk["gpu_ms"], "GPU x peft": peft["gpu_ms"] / fk["gpu_ms"]} if "gpu_ms" in fk else {}),
        })  # fmt: skip
    return table


COLUMNS = [
    "dora",
    "qlora",
    "adapter",
    "block",
    "tokens",
    "dropout",
    "fk ms",
    "peft ms",
    "x peft",
    "fk matmul%",
    "fk floor%",
    "fk GPU floor%",
    "fk GPU ms",
    "GPU x peft",
    "fk MB",
    "peft MB",
    "memory / peft",
]


def summary(record: bench.BenchRecord) -> str:
    """The markdown table for docs/benchmarks.md ("x peft": PEFT's time over fk's; "GPU x peft": the
    same of the GPU work alone, ``bench.time_ms(gpu_only=True)``; "fk floor%" the floor's time over
    fk's wall time, "fk GPU floor%" over its GPU time)."""
    return bench.markdown_table(speedups(record), COLUMNS, skip_absent=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None,
                        help="the JSON record to write (a directory gets lora.json, lora_dora.json or "
                             "lora_qlora.json inside; default benchmarks/results/)")  # fmt: skip
    parser.add_argument("--tokens", type=int, nargs="+", help="token counts (default 4096 16384; --tiny 64)")
    parser.add_argument("--dropout", type=float, nargs="+", default=[0.0, 0.05])
    parser.add_argument("--adapters", nargs="+", default=list(ADAPTER_DTYPES), choices=list(ADAPTER_DTYPES),
                        help="dtypes of the LoRA weights")  # fmt: skip
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--alpha", type=int, default=32)
    parser.add_argument("--rep", type=int, help="timed calls per measurement (default 20; --tiny 2)")
    parser.add_argument("--dora", action="store_true", help="DoRA adapters (PEFT use_dora=True)")
    parser.add_argument("--qlora", action="store_true",
                        help=f"4-bit base weights (bitsandbytes {QUANT_TYPE}, nested, blocksize {QUANT_BLOCKSIZE})")  # fmt: skip
    parser.add_argument("--tiny", action="store_true", help="tiny layer shapes (runs on a CPU: checks the code paths)")
    parser.add_argument("--summary", type=Path, help="only print the table of this JSON record")
    parser.add_argument("--refloor", type=Path, nargs="+",
                        help="only recompute these records' floors from their ceilings and times (rewritten in place)")  # fmt: skip
    args = parser.parse_args()
    if args.refloor:
        for path in args.refloor:
            refloor(bench.BenchRecord.from_json(path)).to_json(path)
            print(f"floors recomputed: {path}")
        return
    if args.summary:
        record = bench.BenchRecord.from_json(args.summary)
    else:
        if DEVICE == "cpu" and not args.tiny:
            parser.error("the benchmark needs a CUDA GPU; on a CPU run it with --tiny")
        tokens = args.tokens or ([64] if args.tiny else [4096, 16384])
        rep = args.rep or (2 if args.tiny else 20)
        out = record_path(args.out or Path("benchmarks/results"), args.dora, args.qlora)
        record = run(tokens, args.dropout, args.adapters, out, rep, args.rank, args.alpha, args.dora,
                     qlora=args.qlora, tiny=args.tiny)  # fmt: skip
        print(f"record: {out}")
    if "matmul_tflops" in record.ceilings:
        print(f"bf16 matmul ceiling {record.ceilings['matmul_tflops']:.0f} TFLOP/s ({record.environment.get('gpu')})")
    print(summary(record))


if __name__ == "__main__":
    main()
