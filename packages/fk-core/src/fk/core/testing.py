"""Test helpers shared by every fk package (import from tests only; needs pytest and hypothesis).

The tolerance rule
------------------
An fk kernel is compared with the float64 evaluation of its PyTorch reference. Its error may be at
most ``factor`` times the error that PyTorch itself makes at the same dtype (the reference
evaluated on the low-precision inputs, which upcasts to fp32 inside and rounds its result to the
dtype), plus a floor of a few units in the last place of the dtype scaled by the magnitude of the
result::

    max|fk - ref64| <= factor * max|torch_at_dtype - ref64| + floor[dtype] * max|ref64| + 1e-12

That bound is tight enough to catch a wrong formula, a missing term, a lost row or a wrong
accumulation dtype, and loose enough for a different (equally good) summation order. On the CPU,
under Triton's interpreter, 16-bit results get one more unit in the last place
(:data:`INTERPRETER_CAST_SLACK`): the interpreter rounds casts to fp16/bf16 toward zero.
:func:`compare_with_reference` applies it to the outputs and to the gradients of every input that
requires one; ``tests/test_testing.py`` in fk-core shows that it fails on wrong implementations.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from fk.core import backend

DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)
"""The floating dtypes every kernel is tested in."""

FLOOR: dict[torch.dtype, float] = {torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}
"""Error floor per dtype, relative to the largest reference value: about two units in the last place
(fp32: enough for a different summation order)."""

INTERPRETER_CAST_SLACK: dict[torch.dtype, float] = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}
"""Added to the default floor for a 16-bit result on the CPU while Triton's interpreter is on: the
interpreter rounds fp32 -> fp16/bf16 casts toward zero where a GPU rounds to nearest, which costs a
kernel's result up to one more unit in the last place (one unit relative to the largest value)."""

AWKWARD_WIDTHS: tuple[int, ...] = (1, 3, 17, 100, 257, 1000, 4097)
"""Row widths that are not powers of two (and 1): they exercise masks and tile edges."""

WIDE_WIDTHS: tuple[int, ...] = (16385, 65536)
"""Row widths wider than one tile: they exercise looped paths."""

AWKWARD_ROWS: tuple[int, ...] = (1, 7, 33)
"""Row counts: one row, and counts that do not divide the rows handled per program."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def random_tensor(
    shape: Sequence[int],
    dtype: torch.dtype,
    device: str | torch.device,
    *,
    seed: int,
    scale: float = 1.0,
    offset: float = 0.0,
    requires_grad: bool = False,
) -> torch.Tensor:
    """Normal random values (``offset + scale * N(0, 1)``), drawn in fp32 on the CPU from ``seed``.

    Drawing on the CPU makes a test's data the same on every machine; the values are then cast to
    ``dtype`` and moved to ``device``. Never zeros: they hide unwritten outputs.
    """
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(tuple(shape), generator=gen, dtype=torch.float32) * scale + offset
    out = values.to(dtype=dtype, device=device)
    return out.requires_grad_(requires_grad)


def random_head(
    rows: Sequence[int],
    vocab: int,
    hidden: int,
    dtype: torch.dtype,
    device: str | torch.device,
    *,
    seed: int,
    bias: bool = False,
    weight_scale: float = 2.0,
) -> list[torch.Tensor | None]:
    """A trainable LM head's inputs, each requiring grad: hidden states ``(*rows, hidden)`` (seed
    ``seed``), the weight ``(vocab, hidden)`` of scale ``weight_scale / sqrt(hidden)`` (``seed + 1``:
    logits of spread about ``weight_scale``) and, with ``bias``, a ``(vocab,)`` bias (``seed + 2``;
    else None)."""
    h = random_tensor((*rows, hidden), dtype, device, seed=seed, requires_grad=True)
    w = random_tensor((vocab, hidden), dtype, device, seed=seed + 1, scale=hidden**-0.5 * weight_scale,
                      requires_grad=True)  # fmt: skip
    b = random_tensor((vocab,), dtype, device, seed=seed + 2, requires_grad=True) if bias else None
    return [h, w, b]


def attention_qk(
    batch: int,
    seq: int,
    n_q: int,
    n_k: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str | torch.device,
    layout: str,
    *,
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random q (``n_q`` heads) and k (``n_k`` heads) of one attention layer, leaves that require grad.

    ``layout="bhsd"``: ``(batch, heads, seq, head_dim)``; ``"bshd"``: ``(batch, seq, heads, head_dim)``.
    q is drawn from ``seed`` and k from ``seed + 1`` (see :func:`random_tensor`).
    """

    def shape(heads: int) -> tuple[int, ...]:
        return (batch, heads, seq, head_dim) if layout == "bhsd" else (batch, seq, heads, head_dim)

    q = random_tensor(shape(n_q), dtype, device, seed=seed, requires_grad=True)
    k = random_tensor(shape(n_k), dtype, device, seed=seed + 1, requires_grad=True)
    return q, k


def with_layout(tensor: torch.Tensor, layout: str) -> torch.Tensor:
    """The same values as ``tensor`` in another memory layout (a leaf, keeping ``requires_grad``).

    ``"contiguous"``: as given. ``"row_strided"``: rows are a slice of a wider buffer (last stride 1,
    row stride > width), as views of a fused projection are. ``"transposed"``: the last dimension
    is not contiguous (a transposed buffer).
    """
    requires_grad = tensor.requires_grad
    data = tensor.detach()
    if layout == "contiguous":
        out = data.clone()
    elif layout == "row_strided":
        width = data.shape[-1]
        wide = torch.empty(*data.shape[:-1], width + 13, dtype=data.dtype, device=data.device)
        wide.normal_()
        wide[..., :width] = data
        out = wide[..., :width]
    elif layout == "transposed":
        if data.ndim < 2:
            raise ValueError("layout 'transposed' needs a tensor of at least 2 dimensions")
        out = data.transpose(-1, -2).contiguous().transpose(-1, -2)
    else:
        raise ValueError(f"layout must be 'contiguous', 'row_strided' or 'transposed', got {layout!r}")
    return out.requires_grad_(requires_grad)


LAYOUTS: tuple[str, ...] = ("contiguous", "row_strided", "transposed")


def max_abs_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``max|actual - expected|`` in float64 (``inf`` where either has a NaN or inf it should not)."""
    # On the reference's device: a GPU takes milliseconds where a CPU copy of a training-sized
    # tensor took seconds (14 test workers share the GPU machine's 16 cores).
    diff = (actual.detach().to(expected.device, torch.float64) - expected.detach().double()).abs()
    if diff.numel() == 0:
        return 0.0
    if not torch.isfinite(diff).all():
        return math.inf
    return float(diff.max())


def floor_of(dtype: torch.dtype, device: torch.device | str) -> float:
    """The error floor of a result rounded to ``dtype`` on ``device`` (:data:`FLOOR`; on the CPU with
    Triton's interpreter on, plus :data:`INTERPRETER_CAST_SLACK`). A result kept in fp32 but computed
    in bf16 (under autocast) takes bf16's."""
    floor = FLOOR.get(dtype, FLOOR[torch.float32])
    if torch.device(device).type == "cpu" and backend.INTERPRETER_ON:
        floor += INTERPRETER_CAST_SLACK.get(dtype, 0.0)
    return floor


def assert_close(
    actual: torch.Tensor,
    reference: torch.Tensor,
    baseline: torch.Tensor,
    *,
    name: str,
    factor: float = 2.0,
    floor: float | None = None,
    atol: float = 1e-12,
) -> None:
    """Check ``actual`` against the float64 ``reference`` with the module's tolerance rule.

    ``baseline`` is PyTorch's own result at ``actual.dtype``; its error sets the bound. ``atol``
    replaces the tiny absolute term for results that are pure cancellation (a gradient that is
    exactly zero in exact arithmetic): there the error scales with the cancelling terms, not
    with the result.
    """
    if actual.shape != reference.shape:
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != reference {tuple(reference.shape)}")
    if floor is None:
        floor = floor_of(actual.dtype, actual.device)
    magnitude = float(reference.detach().double().abs().max()) if reference.numel() else 0.0
    err = max_abs_error(actual, reference)
    base_err = max_abs_error(baseline, reference)
    bound = factor * (0.0 if math.isinf(base_err) else base_err) + floor * magnitude + atol
    if not err <= bound:
        raise AssertionError(
            f"{name} ({dtype_name(actual.dtype)}): max error {err:.3e} > bound {bound:.3e} "
            f"(PyTorch at this dtype: {base_err:.3e}, |reference| up to {magnitude:.3e})"
        )


@dataclass
class Comparison:
    """What :func:`compare_with_reference` compared: names and errors, for reports."""

    names: list[str]
    errors: list[float]


def _as_tuple(out: Any) -> tuple[torch.Tensor, ...]:
    if isinstance(out, torch.Tensor):
        return (out,)
    return tuple(o for o in out if isinstance(o, torch.Tensor))


def copy_with_strides(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` with the same sizes, strides and storage offset, in fresh memory.

    ``clone()`` keeps strides only for dense tensors: a row-strided view (rows that are slices of
    a wider buffer) would come back contiguous, and a test that meant to pass strided input would
    silently pass a contiguous one.
    """
    if t.numel() == 0:
        return t.detach().clone()
    extent = t.storage_offset() + 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    # Copy the storage span the view covers (gaps included), then view it the same way: this also
    # keeps overlapping layouts (stride 0, as from expand) that an element-wise copy cannot write.
    buffer = t.detach().as_strided((extent,), (1,), 0).clone()
    return buffer.as_strided(t.shape, t.stride(), t.storage_offset())


def _clone_args(args: Sequence[Any], dtype: torch.dtype | None, device: torch.device | None) -> list[Any]:
    """Fresh leaves with the same values (optionally cast / moved), keeping requires_grad.

    Copies made without a cast or a move keep the memory layout of the original (strided inputs
    stay strided).
    """
    out: list[Any] = []
    for a in args:
        if isinstance(a, torch.Tensor):
            b = a.detach()
            if dtype is not None and b.is_floating_point():
                b = b.to(dtype)
            if device is not None:
                b = b.to(device)
            if dtype is None and device is None:
                b = copy_with_strides(b)
            out.append(b.requires_grad_(a.requires_grad))
        else:
            out.append(a)
    return out


def _run(fn: Callable[..., Any], args: Sequence[Any], grad_seed: int) -> tuple[tuple[torch.Tensor, ...], list[Any]]:
    outputs = _as_tuple(fn(*args))
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    grads: list[Any] = []
    differentiable = [o for o in outputs if o.requires_grad]
    if leaves and differentiable:
        grad_outs = [
            random_tensor(o.shape, torch.float32, "cpu", seed=grad_seed + i).to(dtype=o.dtype, device=o.device)
            for i, o in enumerate(differentiable)
        ]
        grads = list(torch.autograd.grad(differentiable, leaves, grad_outs, allow_unused=True))
    return outputs, grads


def compare_with_reference(
    fk_fn: Callable[..., Any],
    ref_fn: Callable[..., Any],
    args: Sequence[Any],
    *,
    baseline_fn: Callable[..., Any] | None = None,
    factor: float = 2.0,
    floors: dict[torch.dtype, float] | None = None,
    atols: dict[torch.dtype, float] | None = None,
    grad_seed: int = 1234,
    arg_names: Sequence[str] | None = None,
) -> Comparison:
    """Compare ``fk_fn(*args)`` and its gradients with ``ref_fn`` evaluated in float64.

    ``args`` are the inputs as the test wants them (dtype, device, layout); tensors with
    ``requires_grad`` get gradients checked (random upstream gradients, the same for all three
    runs). ``ref_fn`` runs on float64 copies on the device of ``args`` (a GPU computes float64 to
    IEEE rules as the CPU does, and is much faster at training shapes); ``baseline_fn`` (default ``ref_fn``) runs on
    copies of ``args`` as given and sets the error bound. A gradient that fk returns as None where
    the reference has one (or the reverse) fails. ``floors`` and ``atols`` override the relative
    floor and the absolute term per dtype (see :func:`assert_close`).
    """
    baseline_fn = baseline_fn or ref_fn
    floors = floors or {}
    atols = atols or {}
    fk_out, fk_grads = _run(fk_fn, _clone_args(args, None, None), grad_seed)
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
    ref_out, ref_grads = _run(ref_fn, _clone_args(args, torch.float64, device), grad_seed)
    base_out, base_grads = _run(baseline_fn, _clone_args(args, None, None), grad_seed)
    if len(fk_out) != len(ref_out):
        raise AssertionError(f"fk returned {len(fk_out)} tensors, the reference {len(ref_out)}")
    if len(fk_grads) != len(ref_grads):
        raise AssertionError(f"fk gave {len(fk_grads)} gradients, the reference {len(ref_grads)} (lost autograd?)")
    all_names = list(arg_names) if arg_names else [f"arg{i}" for i in range(len(args))]
    if len(all_names) != len(args):
        raise ValueError(f"arg_names has {len(all_names)} names for {len(args)} args")
    leaf_names = [n for n, a in zip(all_names, args, strict=True) if isinstance(a, torch.Tensor) and a.requires_grad]
    names: list[str] = []
    errors: list[float] = []
    pairs = [(f"output{i}", a, r, b) for i, (a, r, b) in enumerate(zip(fk_out, ref_out, base_out, strict=True))]
    pairs += [(f"grad of {n}", a, r, b) for n, a, r, b in zip(leaf_names, fk_grads, ref_grads, base_grads, strict=True)]
    for name, actual, ref, base in pairs:
        if (actual is None) != (ref is None):
            raise AssertionError(f"{name}: fk gives {actual is not None}, the reference gives {ref is not None}")
        if actual is None:
            continue
        if actual.dtype != base.dtype:
            raise AssertionError(f"{name}: dtype {actual.dtype}, expected {base.dtype}")
        assert_close(
            actual,
            ref,
            base,
            name=name,
            factor=factor,
            floor=floors.get(actual.dtype),
            atol=atols.get(actual.dtype, 1e-12),
        )
        names.append(name)
        errors.append(max_abs_error(actual, ref))
    return Comparison(names, errors)


def assert_compile_matches_eager(
    loss: Callable[..., torch.Tensor],
    inputs: Sequence[torch.Tensor],
    *,
    grad_rtol: float | None = None,
    grad_atol: float | None = None,
    bf16_rounding: bool = False,
) -> None:
    """``torch.compile(loss, fullgraph=True)`` traces without a graph break, and its value and its
    gradients with respect to ``inputs`` (leaves that require grad) equal eager mode's.

    The gradients are compared at ``torch.testing.assert_close``'s defaults for their dtype unless
    ``grad_rtol``/``grad_atol`` say otherwise: for an op whose eager path sums in another order
    than its traced one (in chunks, say), by design.

    ``bf16_rounding=True``: the traced code is plain PyTorch with bf16 intermediates (an
    ``autograd.Function`` under autocast, say), which Inductor may round at other points than eager
    (an ``addmm`` unfused into a matmul and an addition rounds twice). The value and each gradient
    are then compared to within ``2**-5`` of the largest magnitude of eager's value or gradient: a
    few bf16 roundings of each term a gradient sums (fk-lora's ``dx`` sums five projections' bf16
    terms; on an H200 one element differed by ``2**-5.98`` of the largest)."""
    torch._dynamo.reset()
    for t in inputs:
        t.grad = None
    compiled = torch.compile(loss, fullgraph=True)
    compiled_value = compiled(*inputs)
    compiled_value.backward()
    got = [t.grad.clone() if t.grad is not None else None for t in inputs]
    for t in inputs:
        t.grad = None
    eager_value = loss(*inputs)
    eager_value.backward()
    # The value is the caller's reduction of fk's outputs, which Inductor may sum in another order:
    # equal up to summation differences (fk's own results are compared exactly, through the
    # gradients). fp32: 1e-4 relative; bf16/fp16: torch.testing's defaults for the dtype.
    wide = compiled_value.dtype in (torch.float32, torch.float64)
    rtol, atol = (1e-4, 1e-6) if wide else (None, None)
    if bf16_rounding:
        rtol, atol = 0.0, 2**-5 * float(eager_value.detach().abs())
    torch.testing.assert_close(
        compiled_value.detach(), eager_value.detach(), rtol=rtol, atol=atol, msg=lambda m: f"value: {m}"
    )
    for i, (g, t) in enumerate(zip(got, inputs, strict=True)):
        assert g is not None and t.grad is not None, f"input {i} got no gradient"
        rtol, atol = (0.0, 2**-5 * float(t.grad.abs().max())) if bf16_rounding else (grad_rtol, grad_atol)
        torch.testing.assert_close(
            g, t.grad, rtol=rtol, atol=atol, msg=functools.partial("gradient of input {}: {}".format, i)
        )


def rows_reaching(monkeypatch: Any, module: ModuleType, name: str) -> list[int]:
    """Wrap ``module.name`` (with pytest's ``monkeypatch``, undone after the test) so that each call
    records the row count of its first argument: how many rows reached an op. Returns that list."""
    rows: list[int] = []
    fn = getattr(module, name)

    def counted(first: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        rows.append(first.shape[0])
        return fn(first, *args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return rows


def run_on_reference_path(code: str) -> None:
    """Run ``code`` in a fresh interpreter with Triton's interpreter off and no GPU visible (the
    path a CPU-only user gets: the plain PyTorch reference); it must print ``ok`` last."""
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "0", "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0 or out.stdout.strip().splitlines()[-1:] != ["ok"]:
        raise AssertionError(f"reference-path run failed:\nstdout:\n{out.stdout}\nstderr:\n{out.stderr}")


_PTX_SCRIPT = """
import collections, importlib, json, re, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource
module, kernel, signature, constexprs, num_warps, capability = json.loads(sys.argv[1])
fn = getattr(importlib.import_module(module), kernel)
names = list(signature)
types, attrs = {}, {}
for i, name in enumerate(names):
    if name in constexprs:
        types[name] = "constexpr"
        continue
    ty = signature[name]
    if isinstance(ty, list):  # a tuple argument: its elements' types (JSON has no tuples)
        types[name] = tuple(ty)
        paths = {(i, j): t for j, t in enumerate(ty)}
    else:
        types[name] = ty
        paths = {(i,): ty}
    attrs.update({path: [["tt.divisibility", 16]] for path, t in paths.items() if t[0] in "*iu"})
source = ASTSource(
    fn=fn,
    signature=types,
    constexprs={(names.index(name),): value for name, value in constexprs.items()},
    attrs=attrs,
)
compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32), options={"num_warps": num_warps})
ptx = compiled.asm["ptx"]
with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
    f.write(ptx)
    f.flush()
    arch = f"sm_{capability}a" if capability == 90 else f"sm_{capability}"
    ptxas = subprocess.run([get_ptxas(capability).path, f"-arch={arch}", "-v", f.name, "-o", "/dev/null"],
                           capture_output=True, text=True)
    if ptxas.returncode:  # (its own words: a bare CalledProcessError hid them, 2026-11-29)
        sys.exit(f"ptxas exited with {ptxas.returncode}: {ptxas.stderr or ptxas.stdout}")
    usage = ptxas.stderr
print(json.dumps({
    "memory_instructions": collections.Counter(re.findall(r"\\b(?:ld|st)\\.global(?:\\.[a-zA-Z0-9_:]+)*", ptx)),
    "sync_and_mma": collections.Counter(
        re.findall(r"\\b(?:bar\\.sync|ld\\.shared|st\\.shared|ldmatrix|stmatrix|mma\\.sync|wgmma\\.mma_async)\\b", ptx)),
    "registers": int(re.search(r"Used (\\d+) registers", usage).group(1)),
    "spill_bytes": int(re.search(r"(\\d+) bytes spill stores", usage).group(1)),
    "shared_bytes": compiled.metadata.shared,
}))
"""


@dataclass(frozen=True)
class CompiledKernel:
    """What :func:`compile_kernel` reads off a Triton kernel compiled for an NVIDIA GPU."""

    memory_instructions: dict[str, int]
    """How often each global load and store instruction (``ld.global.v4.b32``, ``st.global.b16``,
    ...) occurs in its PTX."""
    sync_and_mma: dict[str, int]
    """How often each barrier (``bar.sync``), shared-memory access (``ld.shared``, ``st.shared``,
    ``ldmatrix``, ``stmatrix``) and matrix multiply-accumulate (``mma.sync``, ``wgmma.mma_async``)
    occurs in its PTX: the layout conversions and tensor-core work of a kernel with ``tl.dot``."""
    registers: int
    """Registers a thread (ptxas)."""
    spill_bytes: int
    """Bytes a thread spilled to local memory (ptxas' spill stores)."""
    shared_bytes: int
    """Shared memory a program takes (Triton's pipeline buffers and layout conversions; a launch
    needing more than the device's, 227 KB on Hopper, fails with ``OutOfResources``)."""


def compile_kernel(
    module: str,
    kernel: str,
    signature: dict[str, str | tuple[str, ...]],
    constexprs: dict[str, Any],
    *,
    num_warps: int,
    capability: int = 90,
) -> CompiledKernel:
    """The Triton kernel ``module.kernel`` compiled for an NVIDIA GPU of compute ``capability`` (90:
    Hopper), and what its code says: its global loads and stores (for tests that they stay
    vectorized, which Triton decides from what it can prove about masks and offsets), its registers
    and its spills. No GPU is needed: Triton's own compiler and ptxas run in a fresh interpreter with
    Triton's interpreter off. ``signature`` gives every argument's Triton type (``"*bf16"``,
    ``"i32"``, a tuple of them for a tuple argument; anything for the names in ``constexprs``);
    pointers are taken as 16-byte aligned and integers as multiples of 16, as Triton specializes
    them at launch (a width of 32768: yes; of 1000: no, which can change the code)."""
    import json

    arguments = json.dumps([module, kernel, signature, constexprs, num_warps, capability])
    try:
        out = run_python("-c", _PTX_SCRIPT, arguments, interpret=False)
    except AssertionError as exc:
        raise AssertionError(f"compiling {module}.{kernel} failed:\n{exc}") from None
    return CompiledKernel(**json.loads(out.strip().splitlines()[-1]))


# --- scripts -----------------------------------------------------------------------------------


def load_script(path: str | os.PathLike[str]) -> ModuleType:
    """The module of the Python file at ``path`` (a benchmark script, which is not a package), run
    under the file's stem as its name, with its folder on ``sys.path`` (a script may import its
    neighbours, as bench_memory.py does bench_e2e.py); for tests of ``benchmarks/*.py``."""
    import importlib.util
    import sys

    path = Path(path)
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path} as a module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_python(*args: str, timeout_s: float = 300.0, interpret: bool | None = None) -> str:
    """Run ``python *args`` (a script and its options, or ``-m module ...``) in a fresh interpreter
    that imports what this process imports (its ``sys.path``), with Triton's interpreter on where
    there is no GPU (or as ``interpret`` says); its standard output. An exit status other than 0
    fails with the run's output."""
    import subprocess
    import sys

    if interpret is None:
        interpret = not torch.cuda.is_available()
    env = {**os.environ, "TRITON_INTERPRET": "1" if interpret else "0", "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout_s,
                         check=False)  # fmt: skip
    if out.returncode != 0:
        raise AssertionError(f"python {' '.join(args)[:200]} exited with {out.returncode}:\nstdout:\n{out.stdout}\n"
                             f"stderr:\n{out.stderr[-5000:]}")  # fmt: skip
    return out.stdout


# --- peers ------------------------------------------------------------------------------------


@functools.cache
def _bitsandbytes_backend_on(device: str, kind: str) -> bool:
    """Whether bitsandbytes runs ``kind`` (``"4bit"``: quantizes to NF4; ``"int8"``: a quantized
    ``Linear8bitLt``'s forward, LLM.int8()'s product) on ``device``."""
    import bitsandbytes as bnb

    try:
        if kind == "4bit":
            bnb.functional.quantize_4bit(torch.ones(64, device=device), blocksize=64, quant_type="nf4")
        else:
            layer = bnb.nn.Linear8bitLt(4, 4, bias=False, has_fp16_weights=False).to(device).eval()
            layer(torch.ones(2, 4, dtype=torch.float16, device=device))
    except (RuntimeError, NotImplementedError, ValueError):
        return False
    return True


def _require_bitsandbytes(device: str, kind: str, what: str) -> Any:
    import pytest

    bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed (extra fk-lora[qlora])")
    if not _bitsandbytes_backend_on(device, kind):
        pytest.skip(f"bitsandbytes {bnb.__version__} has no {what} backend for {device}")
    return bnb


def with_random_lora_b(peft_model: torch.nn.Module, scale: float = 0.1) -> Any:
    """``peft_model`` with every ``lora_B`` parameter drawn from torch's generator times ``scale``
    (PEFT starts them at zero, which would hide the LoRA branch's output and most of its
    gradients), in training mode."""
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn_like(param) * scale)
    return peft_model.train()


def seeded_loss_and_grads(
    model: torch.nn.Module, x: torch.Tensor, seed: int, *, with_input: bool = False
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``mean(model(x)^2)`` in fp32, with torch's generator seeded by ``seed`` first (so dropout
    masks replay), and its gradients: of ``x`` first when ``with_input``, then of every parameter
    that requires grad."""
    torch.manual_seed(seed)
    loss = model(x).float().square().mean()
    params = [p for p in model.parameters() if p.requires_grad]
    return loss.detach(), list(torch.autograd.grad(loss, [x, *params] if with_input else params))


def require_bitsandbytes_4bit(device: str) -> Any:
    """The ``bitsandbytes`` module where it is installed and has a 4-bit backend for ``device`` (its
    CPU one, or its CUDA library on a GPU); otherwise the calling test is skipped, naming what is
    missing. (QLoRA tests compare fk.lora with bitsandbytes' own layers on the test device.)"""
    return _require_bitsandbytes(device, "4bit", "4-bit")


def require_bitsandbytes_int8(device: str) -> Any:
    """:func:`require_bitsandbytes_4bit` for bitsandbytes' LLM.int8() layer (``Linear8bitLt``)."""
    return _require_bitsandbytes(device, "int8", "LLM.int8() (Linear8bitLt)")


# --- several processes ------------------------------------------------------------------------


def run_distributed(
    fn: Callable[..., None],
    *args: Any,
    world_size: int = 2,
    timeout_s: float = 120.0,
    backend: str = "gloo",
    start_method: str | None = None,
) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes joined in a gloo process
    group (the default group), as CPU CI tests multi-GPU logic; returns when every process has
    finished and re-raises the first error (with its traceback) as an exception here. With
    ``backend="nccl"`` the group is NCCL's and process ``rank`` computes on GPU ``rank`` (its
    current device), for GPU tests of several GPUs.

    On a Linux machine without CUDA the processes are forked from this one (no second import of
    torch and Triton, and ``fn`` may be any function); elsewhere they are spawned and ``fn`` must be
    importable (a module-level function of a test module is). A CUDA machine spawns because a
    process whose autograd engine has run on a GPU (an earlier test) cannot fork safely.
    ``start_method="spawn"`` spawns on a CPU machine too: for ``fn`` that lets a library raise
    torch's thread count (accelerate's Trainer on CPU does), where a forked child's OpenMP, whose
    thread pool the parent's earlier tests started, waits forever (MKL's vectorized cos under
    LlamaRotaryEmbedding hung so in CI, 2026-11-27). Each
    runs torch with one thread (the CI has two cores). A collective that does not pair up across
    the ranks fails after ``timeout_s`` instead of hanging. ``fn`` passes results back through
    files (e.g. ``torch.save`` into a test's ``tmp_path``).
    """
    import sys
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        store = f"file://{tmp}/store"
        method = start_method or ("fork" if sys.platform == "linux" and not torch.cuda.is_available() else "spawn")
        # A spawned process imports fn's module by name, from this process' sys.path: under pytest's
        # importlib mode a test module ("meta.tests.test_x") is not on it, so its root goes there.
        root = _module_root(fn) if method == "spawn" else None
        added = [root] if root is not None and root not in sys.path else []
        sys.path[:0] = added
        try:
            mp.start_processes(_distributed_worker, args=(fn, args, world_size, store, timeout_s, backend),
                               nprocs=world_size, start_method=method)  # fmt: skip
        finally:
            for path in added:
                sys.path.remove(path)


def _module_root(fn: Callable[..., Any]) -> str | None:
    """The folder from which ``fn``'s module imports by its dotted name (None where unknown)."""
    import sys

    file = getattr(sys.modules.get(fn.__module__), "__file__", None)
    if file is None:
        return None
    return str(Path(file).resolve().parents[fn.__module__.count(".")])


def _distributed_worker(
    rank: int,
    fn: Callable[..., None],
    args: tuple[Any, ...],
    world_size: int,
    store: str,
    timeout_s: float,
    backend: str,
) -> None:
    import datetime

    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend, init_method=store, rank=rank, world_size=world_size, timeout=timeout)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


# --- allocations ------------------------------------------------------------------------------

CUDA_ALLOCATION_GRANULE = 512
"""CUDA's caching allocator rounds every block up to a multiple of 512 bytes."""

CUDA_UNSPLIT_SLACK = 1 << 20
"""The caching allocator hands over a cached block of its large pool whole (without splitting it)
when less than 1 MiB would remain, so a large buffer may show up as a block up to this many bytes
larger. Requests of at most this size come from the small pool, whose blocks are always split, so
they show up at exactly their rounded size."""


def allocation_sizes(fn: Callable[[], Any]) -> list[int]:
    """Bytes of every allocation made while ``fn`` runs (host and device), seen by the profiler.

    Each allocation is counted once, by the op that makes it (``self_*`` memory: an op's children
    are not counted again), so two buffers of one size show up twice.

    On CUDA the matmul libraries' workspaces are allocated first (cuBLAS and cuBLASLt allocate
    theirs through PyTorch's allocator at their first call in a process): otherwise the first
    matmul ``fn`` runs would report its output and a workspace as one allocation, and whether it
    does would depend on which test ran first in the process.
    """
    from torch.profiler import ProfilerActivity, profile

    if torch.cuda.is_available():
        a = torch.ones(8, 8, device="cuda")
        torch.mm(a, a)  # cuBLAS
        torch.addmm(a[0], a, a)  # cuBLASLt (the bias epilogue)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, profile_memory=True) as prof:
        fn()
    sizes = []
    for event in prof.events():
        for field in ("self_cpu_memory_usage", "self_device_memory_usage"):
            size = getattr(event, field, 0) or 0
            if size > 0:
                sizes.append(size)
    return sizes


def count_buffers(sizes: Sequence[int], n_bytes: int, device: str | torch.device) -> int:
    """How many of the allocations ``sizes`` (from :func:`allocation_sizes`) hold a buffer of
    ``n_bytes`` bytes: exactly that size on the CPU; on CUDA, rounded up to the allocator's granule
    (small-pool requests of at most 1 MiB), or a cached block up to :data:`CUDA_UNSPLIT_SLACK`
    larger (large-pool requests). On CUDA, small sizes less than 512 bytes apart are told apart only
    if they round to different granules: tests choose sizes that do."""
    if torch.device(device).type != "cuda":
        return sum(s == n_bytes for s in sizes)
    low = -(-n_bytes // CUDA_ALLOCATION_GRANULE) * CUDA_ALLOCATION_GRANULE
    if low <= CUDA_UNSPLIT_SLACK:
        return sum(s == low for s in sizes)
    return sum(low <= s < low + CUDA_UNSPLIT_SLACK for s in sizes)


# --- hypothesis strategies ----------------------------------------------------------------------


def strategies() -> Any:
    """Namespace of hypothesis strategies for fk property tests (imports hypothesis lazily)."""
    from hypothesis import strategies as st

    class _Strategies:
        dtypes = st.sampled_from(DTYPES)
        layouts = st.sampled_from(LAYOUTS)

        @staticmethod
        def rows(max_rows: int = 40) -> Any:
            return st.integers(min_value=1, max_value=max_rows)

        @staticmethod
        def widths(max_width: int = 5000) -> Any:
            return st.one_of(st.integers(min_value=1, max_value=max_width), st.sampled_from(AWKWARD_WIDTHS))

        @staticmethod
        def leading_shapes(max_dims: int = 3, max_size: int = 6) -> Any:
            return st.lists(st.integers(min_value=1, max_value=max_size), min_size=1, max_size=max_dims)

    return _Strategies
