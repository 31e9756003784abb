"""Benchmark toolkit shared by the ``benchmarks/bench_*.py`` scripts.

Each script runs fk kernels and their peers (Liger Kernel, ``torch.compile``, eager PyTorch, Cut
Cross Entropy) side by side in one process, on one GPU, and writes one JSON record and a few plots.
This module holds the parts they share. The method:

Timing (:func:`time_ms`, :func:`time_stats_ms`)
    The function is called ``warmup`` times first, so Triton compilation, autotuning,
    ``torch.compile`` tracing and the caching allocator's first allocations happen outside the
    measurement; then the GPU is synchronized. Each of the ``rep`` timed calls sits between its own
    pair of CUDA events recorded on the current stream, so Python between calls is not counted.
    Python inside a call is, where the GPU waits for it: a call whose host path (argument checks,
    autograd, kernel launches) outlasts its GPU work measures the host (narrow rows, small
    batches). ``gpu_only=True`` measures the GPU alone: a spin kernel of :data:`HOST_HEAD_START_MS`
    runs before each call's start event, so the host has queued the whole call by the time the GPU
    reaches it (calls whose host path took over half of it are dropped; over a fifth dropped
    raises). Before each call, and outside its event pair, a 256 MiB scratch buffer is
    overwritten to evict the L2 cache (50 MiB on an H100), so every call starts with cold caches,
    as a kernel inside a training step does; tensors listed in ``grad_to_none`` get
    ``.grad = None`` there too, so forward+backward benchmarks allocate fresh gradients each time
    instead of accumulating. The GPU is synchronized once after the last event,
    and the median over the repetitions is reported (p20/p80/min are available): the median ignores
    the occasional call slowed by clock changes or other work on the machine.
    :func:`graph_time_us`, for tuning tools, replays calls captured in a CUDA graph instead: GPU
    work only, back to back, warm caches.

Ceilings (:func:`measure_ceilings`)
    Achieved bandwidth and FLOP rate only mean something next to what the same GPU reaches in the
    same run, under the same clocks and driver: :func:`copy_bandwidth_tbps` times a device-to-device
    copy of 1 GiB of random bytes, :func:`matmul_tflops` an ``n x n`` bf16 matmul on random data.
    Those are practical ceilings, not the datasheet's numbers. Time them as the rows they bound are
    timed: back to back a large matmul runs about 12% slower on an H200 than with the GPU idle
    before each call (its clocks recover: ``benchmarks/experiments/matmul_ceiling_modes``), so a
    benchmark timing ``gpu_only`` rows measures its ceilings with ``gpu_only=True`` as well.

Accounting (:func:`tbps`, :func:`tflops`, :func:`fraction`)
    A kernel's bandwidth counts the bytes it must move at minimum: every input read once and every
    output written once (the copy ceiling likewise counts the bytes read plus the bytes written).
    FLOPs count a multiply-add as two. The benchmark script states what it counted for each op.

Records (:class:`BenchRecord`, :func:`environment`, :func:`plot`, :func:`markdown_table`)
    One JSON file per benchmark holds the environment (GPU, versions; no host name), the ceilings,
    and one row per measurement. Plots and tables are drawn from the record, so they can be redrawn
    later without a GPU.

Training runs in fresh processes (:func:`run_worker`, :func:`round_order`, :func:`merge_rounds`)
    An end-to-end benchmark runs each provider in its own interpreter (a peer's patch can change
    classes for the whole process, and each run should find the GPU's memory empty), in rounds
    whose odd ones reverse the providers' order, so that each provider sits as often early as late
    while the GPU's clocks and temperature drift. A round's timed steps merge into one median.

Only ``torch`` is imported at module level; matplotlib is imported inside :func:`plot`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence, Sized
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

__all__ = [
    "ROUND_DEFAULTS",
    "BenchRecord",
    "Ceilings",
    "TimeStats",
    "add_round_options",
    "copy_bandwidth_tbps",
    "cpu_time_ms",
    "environment",
    "fill_defaults",
    "floor_ms",
    "fraction",
    "graph_time_us",
    "markdown_table",
    "matmul_tflops",
    "max_relative_diff",
    "measure_ceilings",
    "merge_rounds",
    "peak_memory_bytes",
    "plot",
    "progress",
    "round_order",
    "run_worker",
    "tbps",
    "tflops",
    "time_ms",
    "time_stats_ms",
    "worker_main",
    "worker_status",
]

T = TypeVar("T")

L2_FLUSH_BYTES: int = 256 * 2**20
"""Size of the scratch buffer overwritten before each timed call; several times any GPU's L2."""

PEER_PACKAGES: tuple[str, ...] = ("liger-kernel", "cut-cross-entropy", "transformers", "peft", "trl", "bitsandbytes")
"""Distributions of the peers compared against; their versions go into :func:`environment`."""

FK_PACKAGES: tuple[str, ...] = ("fk-core", "fk-norms", "fk-rope", "fk-glu", "fk-flce", "fk-lora", "fk-align", "fk-hf")
"""The fk distributions whose installed versions go into :func:`environment`."""

_flush_buffers: dict[int, torch.Tensor] = {}


# --------------------------------------------------------------------------------------------- timing


def _require_cuda(what: str) -> None:
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"{what} needs a CUDA GPU, but torch.cuda.is_available() is False "
            f"(torch {torch.__version__}, built for CUDA {torch.version.cuda}); run benchmarks on a GPU machine"
        )


def _flush_buffer() -> torch.Tensor:
    """The L2 scratch buffer of the current CUDA device, allocated on first use and kept."""
    index = torch.cuda.current_device()
    buf = _flush_buffers.get(index)
    if buf is None:
        buf = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=torch.device("cuda", index))
        _flush_buffers[index] = buf
    return buf


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    """Quantile ``q`` in [0, 1] of ascending values, interpolating linearly between neighbours."""
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


@dataclass(frozen=True)
class TimeStats:
    """Summary of ``n`` timed calls, in milliseconds."""

    median: float
    p20: float
    p80: float
    min: float
    n: int

    @classmethod
    def from_samples(cls, samples_ms: Sequence[float]) -> TimeStats:
        if not samples_ms:
            raise ValueError("need at least one sample")
        s = sorted(samples_ms)
        return cls(median=_quantile(s, 0.5), p20=_quantile(s, 0.2), p80=_quantile(s, 0.8), min=s[0], n=len(s))


def _clear_grads(tensors: Sequence[torch.Tensor] | None) -> None:
    if tensors:
        for t in tensors:
            t.grad = None


HOST_HEAD_START_MS = 5.0
"""GPU time spent spinning before each call timed with ``gpu_only=True`` (see the module docstring)."""


def time_stats_ms(
    fn: Callable[[], object],
    *,
    warmup: int = 25,
    rep: int = 100,
    flush_l2: bool = True,
    grad_to_none: Sequence[torch.Tensor] | None = None,
    gpu_only: bool = False,
    head_start_ms: float = HOST_HEAD_START_MS,
) -> TimeStats:
    """Time ``fn()`` on the current CUDA device and stream; see the module docstring for the method.

    ``fn`` takes no arguments; whatever it returns is dropped. ``warmup`` untimed calls come first,
    then ``rep`` calls, each between its own pair of CUDA events. With ``flush_l2``, a 256 MiB buffer
    is overwritten before each call (outside the events). Tensors in ``grad_to_none`` get
    ``.grad = None`` before every call. With ``gpu_only``, the GPU's time alone, without the
    host's (``fn`` must not synchronize with the GPU; ``head_start_ms`` must exceed twice the
    host time of a call). Raises ``RuntimeError`` when CUDA is
    unavailable, and with ``gpu_only`` when the host path of a call is too long to be hidden.
    """
    _require_cuda("time_stats_ms")
    if warmup < 0 or rep < 1:
        raise ValueError(f"need warmup >= 0 and rep >= 1, got warmup={warmup}, rep={rep}")
    for _ in range(warmup):
        _clear_grads(grad_to_none)
        fn()
    flush = _flush_buffer() if flush_l2 else None
    head_start = _spin_cycles(head_start_ms) if gpu_only else 0
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(rep)]
    host_ms: list[float] = []
    torch.cuda.synchronize()
    for start, end in events:
        _clear_grads(grad_to_none)
        if flush is not None:
            flush.zero_()
        if head_start:
            torch.cuda._sleep(head_start)
        start.record()
        began = time.perf_counter()
        fn()
        host_ms.append(1e3 * (time.perf_counter() - began))
        end.record()
        if head_start:  # the next head start begins only once this call has run: no overlap between calls
            end.synchronize()
    torch.cuda.synchronize()
    samples = [start.elapsed_time(end) for start, end in events]
    if gpu_only:  # drop the calls whose host path may not have been hidden (a garbage collection, say)
        samples = [ms for ms, host in zip(samples, host_ms, strict=True) if host < 0.5 * head_start_ms]
        if len(samples) < 0.8 * rep:
            raise RuntimeError(
                f"gpu_only: the host path of {rep - len(samples)} of {rep} calls took over half the "
                f"{head_start_ms} ms head start, too long for their GPU time to be the GPU's alone"
            )
    return TimeStats.from_samples(samples)


_cycles_per_ms: dict[int, float] = {}


def _spin_cycles(ms: float) -> int:
    """Cycles of ``torch.cuda._sleep`` that last about ``ms`` on the current device (measured once)."""
    index = torch.cuda.current_device()
    if index not in _cycles_per_ms:
        probe = 10_000_000
        torch.cuda._sleep(probe // 10)  # warm up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(probe)
        end.record()
        end.synchronize()
        _cycles_per_ms[index] = probe / max(start.elapsed_time(end), 1e-3)
    return int(ms * _cycles_per_ms[index])


def time_ms(
    fn: Callable[[], object],
    *,
    warmup: int = 25,
    rep: int = 100,
    flush_l2: bool = True,
    grad_to_none: Sequence[torch.Tensor] | None = None,
    gpu_only: bool = False,
    head_start_ms: float = HOST_HEAD_START_MS,
) -> float:
    """Median milliseconds of ``fn()``; the same measurement as :func:`time_stats_ms`."""
    stats = time_stats_ms(fn, warmup=warmup, rep=rep, flush_l2=flush_l2, grad_to_none=grad_to_none,
                          gpu_only=gpu_only, head_start_ms=head_start_ms)  # fmt: skip
    return stats.median


def cpu_time_ms(
    fn: Callable[[], object], *, warmup: int = 0, rep: int = 2, grad_to_none: Sequence[torch.Tensor] | None = None
) -> float:
    """Median wall milliseconds of ``fn()`` on the CPU, ``warmup`` untimed calls first (a benchmark's
    ``--tiny`` run, which checks its code paths in Triton's interpreter: no CUDA events, no L2
    flush). Tensors in ``grad_to_none`` get ``.grad = None`` before every call, as in :func:`time_ms`."""
    if warmup < 0 or rep < 1:
        raise ValueError(f"need warmup >= 0 and rep >= 1, got warmup={warmup}, rep={rep}")
    samples = []
    for i in range(warmup + rep):
        _clear_grads(grad_to_none)
        began = time.perf_counter()
        fn()
        if i >= warmup:
            samples.append(1e3 * (time.perf_counter() - began))
    return statistics.median(samples)


def graph_time_us(fn: Callable[[], object], *, calls: int = 20, replays: int = 5) -> float:
    """GPU microseconds per call of ``fn()``, captured ``calls`` times in one CUDA graph and replayed.

    For tuning kernels whose GPU time is shorter than their host path: the replays launch no
    Python, so the GPU work alone counts, back to back and with warm caches (no L2 flush, unlike
    :func:`time_ms`). ``fn`` must be capturable: no host synchronization, no allocation whose size
    changes between calls. It runs 3 times before the capture (compilation, the caching allocator)
    and once after it. Raises ``RuntimeError`` when CUDA is unavailable.
    """
    _require_cuda("graph_time_us")
    if calls < 1 or replays < 1:
        raise ValueError(f"need calls >= 1 and replays >= 1, got calls={calls}, replays={replays}")
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (calls * replays)


def fresh_compile(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compile(fn, dynamic=False)`` after ``torch._dynamo.reset()``: a fresh compilation for
    one benchmark case. Without the reset, the compilations of every case share ``fn``'s code
    object, and once they pass dynamo's recompile limit (8) it silently runs ``fn`` eagerly: a
    "torch.compile" column that times eager code."""
    torch._dynamo.reset()
    return torch.compile(fn, dynamic=False)


def peak_memory_bytes(fn: Callable[[], object]) -> int:
    """Peak CUDA memory of one call of ``fn()``, in bytes above what was allocated before the call.

    The GPU is synchronized and the peak counter reset, ``fn()`` runs once, and the result is
    ``torch.cuda.max_memory_allocated() - memory_allocated_before``: every tensor the call allocates
    counts at its high-water mark (temporaries, activations saved for backward, gradients, and the
    returned tensors, which are still referenced when the peak is read); memory that already existed
    (inputs, weights, the allocator's cached but free blocks) does not. Sizes are the caching
    allocator's rounded block sizes. Run ``fn`` beforehand (e.g. time it first) when it compiles or
    autotunes, since Triton's autotuner allocates scratch memory on the first call, and clear
    ``.grad`` of leaf tensors beforehand so a backward pass allocates its gradients afresh.
    Raises ``RuntimeError`` when CUDA is unavailable.
    """
    _require_cuda("peak_memory_bytes")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del out
    return max(0, peak - before)


# ------------------------------------------------------------------------------------------- ceilings


def _cuda_device(device: torch.device | str | int | None) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"device must be a CUDA device, got {dev}")
    return dev


def _time_on(
    device: torch.device, make: Callable[[torch.device], Callable[[], object]], gpu_only: bool = False
) -> float:
    """Median ms of the function ``make(device)`` builds (:func:`time_ms`, with ``gpu_only``); its
    tensors are freed (and uncached) afterwards."""
    with torch.cuda.device(device):
        ms = time_ms(make(device), gpu_only=gpu_only)
        torch.cuda.empty_cache()
    return ms


def _copy(nbytes: int) -> Callable[[torch.device], Callable[[], object]]:
    def make(device: torch.device) -> Callable[[], object]:
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        return lambda: dst.copy_(src)

    return make


def _matmul(n: int, dtype: torch.dtype) -> Callable[[torch.device], Callable[[], object]]:
    def make(device: torch.device) -> Callable[[], object]:
        a = torch.randn(n, n, dtype=dtype, device=device)
        b = torch.randn(n, n, dtype=dtype, device=device)
        c = torch.empty(n, n, dtype=dtype, device=device)
        return lambda: torch.matmul(a, b, out=c)

    return make


def copy_bandwidth_tbps(
    nbytes: int = 2**30, device: torch.device | str | int | None = None, *, gpu_only: bool = False
) -> float:
    """Device-to-device copy bandwidth in TB/s (10**12 bytes/s) of ``nbytes`` random bytes.

    Counts the bytes read plus the bytes written (``2 * nbytes``) over the median copy time; with
    ``gpu_only``, each copy timed after the GPU idled (:func:`time_ms`).
    """
    _require_cuda("copy_bandwidth_tbps")
    if nbytes < 1:
        raise ValueError(f"nbytes must be positive, got {nbytes}")
    return tbps(2 * nbytes, _time_on(_cuda_device(device), _copy(nbytes), gpu_only))


def matmul_tflops(
    n: int = 8192,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str | int | None = None,
    *,
    gpu_only: bool = False,
) -> float:
    """Matmul throughput in TFLOP/s of an ``n x n`` by ``n x n`` product of random ``dtype`` matrices.

    Counts ``2 * n**3`` FLOPs over the median time; the output buffer is allocated once. With
    ``gpu_only``, each product timed after the GPU idled (:func:`time_ms`): the rate of a product
    that starts on recovered clocks, as the rows of a ``gpu_only`` benchmark do.
    """
    _require_cuda("matmul_tflops")
    if n < 1:
        raise ValueError(f"n must be positive, got {n}")
    return tflops(2 * n**3, _time_on(_cuda_device(device), _matmul(n, dtype), gpu_only))


@dataclass(frozen=True)
class Ceilings:
    """Practical ceilings measured in the current run: copy bandwidth (TB/s) and bf16 matmul (TFLOP/s)."""

    copy_tbps: float
    matmul_tflops: float

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


def measure_ceilings(device: torch.device | str | int | None = None, *, gpu_only: bool = False) -> Ceilings:
    """Measure :class:`Ceilings` with the defaults of :func:`copy_bandwidth_tbps` and :func:`matmul_tflops`,
    timed as ``gpu_only`` says (for a benchmark whose rows are timed ``gpu_only``)."""
    return Ceilings(
        copy_tbps=copy_bandwidth_tbps(device=device, gpu_only=gpu_only),
        matmul_tflops=matmul_tflops(device=device, gpu_only=gpu_only),
    )


# ----------------------------------------------------------------------------------------- accounting


def _check_ms(ms: float) -> None:
    if not ms > 0:
        raise ValueError(f"time must be positive, got {ms} ms")


def tbps(nbytes: float, ms: float) -> float:
    """TB/s (10**12 bytes per second) for ``nbytes`` moved in ``ms`` milliseconds."""
    _check_ms(ms)
    return nbytes / (ms * 1e-3) / 1e12


def tflops(flops: float, ms: float) -> float:
    """TFLOP/s (10**12 FLOPs per second) for ``flops`` done in ``ms`` milliseconds."""
    _check_ms(ms)
    return flops / (ms * 1e-3) / 1e12


def floor_ms(ceilings: Ceilings, *, nbytes: float = 0.0, flops: float = 0.0) -> float:
    """The least time, in ms, of a call that must move ``nbytes`` (read plus written) and do
    ``flops``, one after the other: the bytes at the copy bandwidth and the FLOPs at the matmul
    ceiling, both measured in the same run (a QLoRA matmul: its weight's dequantization, then the
    matmul)."""
    if nbytes < 0 or flops < 0 or not (ceilings.copy_tbps > 0 and ceilings.matmul_tflops > 0):
        raise ValueError(f"need nbytes, flops >= 0 and positive ceilings, got {nbytes}, {flops}, {ceilings}")
    return nbytes / (ceilings.copy_tbps * 1e9) + flops / (ceilings.matmul_tflops * 1e9)


def fraction(achieved: float, ceiling: float) -> float:
    """``achieved / ceiling``, e.g. 0.8 for a kernel reaching 80% of copy bandwidth."""
    if not ceiling > 0:
        raise ValueError(f"ceiling must be positive, got {ceiling}")
    return achieved / ceiling


# -------------------------------------------------------------------------------------------- records


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _source_version() -> str | None:
    """The ``VERSION`` of the checkout fk.core runs from (packages/fk-core/src/fk/core/ under the
    checkout's root), or None when it is installed rather than run from a checkout."""
    from pathlib import Path

    here = Path(__file__).resolve().parents
    if here[2].name != "src" or here[3].name != "fk-core":  # installed, not a checkout
        return None
    version_file = here[5] / "VERSION"
    try:
        return version_file.read_text().strip() or None
    except OSError:
        return None


def environment() -> dict[str, Any]:
    """What a result depends on: GPU, versions of Python, torch, Triton, the peers and fk; UTC time.

    Holds no host name. Packages that are not installed map to ``None``; ``fk_source`` is the
    checkout's ``VERSION`` when fk runs from one (e.g. on ``PYTHONPATH``, as on the GPU machines),
    else None.
    """
    try:
        import triton

        triton_version: str | None = triton.__version__
    except ImportError:
        triton_version = None
    cuda = torch.cuda.is_available()
    return {
        "gpu": torch.cuda.get_device_name() if cuda else "cpu",
        "gpu_count": torch.cuda.device_count() if cuda else 0,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "peers": {name: _dist_version(name) for name in PEER_PACKAGES},
        "fk": {name: _dist_version(name) for name in FK_PACKAGES},
        "fk_source": _source_version(),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),
    }


def _json_default(value: object) -> object:
    if isinstance(value, torch.Size):
        return list(value)
    return str(value)  # torch.dtype, torch.device, Path, ...


@dataclass
class BenchRecord:
    """One benchmark's results: environment, ceilings and one row per measurement.

    Each row is a flat dict with at least ``provider`` (e.g. ``"fk"``, ``"liger"``, ``"torch.compile"``)
    plus whatever the benchmark measured: shape parameters, ``mode``, ``ms``, ``tbps``, ``peak_mb``...
    ``environment`` defaults to :func:`environment` at construction time.
    """

    name: str
    environment: dict[str, Any] = field(default_factory=environment)
    ceilings: dict[str, float] = field(default_factory=dict)
    rows: list[dict[str, Any]] = field(default_factory=list)
    notes: str = ""

    def add(self, **fields: Any) -> dict[str, Any]:
        """Append a row (must include ``provider``) and return it."""
        if "provider" not in fields:
            raise ValueError("a row needs a 'provider' field")
        self.rows.append(fields)
        return fields

    def subset(self, **match: Any) -> BenchRecord:
        """The same record with only the rows whose fields equal ``match`` (for one plot or table)."""
        rows = [r for r in self.rows if all(r.get(k) == v for k, v in match.items())]
        return BenchRecord(self.name, self.environment, self.ceilings, rows, self.notes)

    def to_json(self, path: str | os.PathLike[str]) -> Path:
        """Write the record as indented JSON with sorted keys, creating parent directories."""
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True, default=_json_default)
        out.write_text(text + "\n", encoding="utf-8")
        return out

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> BenchRecord:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        return cls(
            name=data["name"],
            environment=data.get("environment", {}),
            ceilings=data.get("ceilings", {}),
            rows=data.get("rows", []),
            notes=data.get("notes", ""),
        )


def merge_records(
    new: BenchRecord, old: BenchRecord, case: Callable[[dict[str, Any]], str], ran: Iterable[str]
) -> BenchRecord:
    """``new`` with the rows of ``old`` whose ``case(row)`` is not among the cases ``new`` ``ran``
    (those first), and a note per earlier call of which cases come from it: for a benchmark that
    takes longer than one GPU call may last, run in parts. Each kept row carries the date of the
    call that measured it (``measured_utc``: its own, where an earlier merge set it, else ``old``'s),
    so that merging again keeps every row's provenance."""
    done = set(ran)
    kept = [{"measured_utc": old.environment.get("date_utc", "?"), **row} for row in old.rows if case(row) not in done]
    calls: dict[str, set[str]] = {}
    for row in kept:
        calls.setdefault(row["measured_utc"], set()).add(case(row))
    for date, cases in sorted(calls.items()):
        new.notes += f"; {', '.join(sorted(cases))}: from the call of {date}"
    new.rows = kept + new.rows
    return new


def _unique(values: Iterable[T]) -> list[T]:
    """Distinct values in order of first appearance."""
    seen: list[T] = []
    for v in values:
        if v not in seen:
            seen.append(v)
    return seen


def plot(
    record: BenchRecord,
    *,
    x: str,
    y: str,
    series: str = "provider",
    facet: str | None = None,
    path: str | os.PathLike[str],
    title: str | None = None,
    logx: bool = False,
    ylabel: str | None = None,
    hline: float | None = None,
    hline_label: str | None = None,
) -> Path:
    """Line plot of ``y`` against ``x`` with one line per value of ``series``, saved as a PNG.

    With ``facet``, one subplot per value of that field, side by side, sharing the y axis. ``hline``
    draws a dashed horizontal line on every subplot (e.g. the copy-bandwidth ceiling). Rows without
    ``x`` or ``y`` (or with ``None`` there, e.g. a provider that ran out of memory) are skipped.
    Creates parent directories and returns the path.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in record.rows if r.get(x) is not None and r.get(y) is not None]
    if not rows:
        raise ValueError(f"no row of {record.name!r} has both {x!r} and {y!r}")
    facets: list[Any] = _unique(r.get(facet) for r in rows) if facet else [None]
    names: list[Any] = _unique(r.get(series) for r in rows)

    fig, axes = plt.subplots(1, len(facets), figsize=(5 * len(facets), 4), squeeze=False, sharey=True)
    try:
        for ax, fval in zip(axes[0], facets, strict=True):
            for name in names:
                pts = [(r[x], r[y]) for r in rows if r.get(series) == name and (facet is None or r.get(facet) == fval)]
                if not pts:
                    continue
                with contextlib.suppress(TypeError):  # mixed x types: keep the order of the rows
                    pts.sort(key=lambda p: p[0])
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=str(name))
            if hline is not None:
                ax.axhline(hline, color="grey", linestyle="--", linewidth=1, label=hline_label)
            if logx:
                ax.set_xscale("log", base=2)
            if facet is not None:
                ax.set_title(f"{facet}={fval}")
            ax.set_xlabel(x)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize="small")
        axes[0][0].set_ylabel(ylabel or y)
        fig.suptitle(title if title is not None else record.name)
        fig.tight_layout()
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=120)
    finally:
        plt.close(fig)
    return out


def run_probe(
    parser: argparse.ArgumentParser,
    check: Callable[[str], None],
    body: Callable[[argparse.Namespace, float], None],
    argv: Sequence[str] | None = None,
) -> None:
    """The main of a probe in ``benchmarks/experiments`` that checks its kernels before timing them:
    ``--check`` (added to ``parser``) runs ``check(device)`` alone (on the CPU, in Triton's
    interpreter, where there is no GPU); otherwise ``check("cuda")``, then the environment and the
    copy bandwidth (TB/s) are printed and ``body(args, copy)`` runs."""
    parser.add_argument("--check", action="store_true", help="tiny shapes, no timing (runs in the interpreter)")
    args = parser.parse_args(argv)
    if args.check:
        check("cuda" if torch.cuda.is_available() else "cpu")
        return
    check("cuda")
    print(environment())
    copy = copy_bandwidth_tbps()
    print(f"copy {copy:.2f} TB/s")
    body(args, copy)


# ------------------------------------------------------------------------ runs in fresh processes


ROUND_DEFAULTS: dict[str, tuple[int, int]] = {"steps": (10, 2), "warmup": (3, 1), "rounds": (2, 1)}
"""The defaults of :func:`add_round_options`' counts: on the GPU, and with ``--tiny``."""


def add_round_options(parser: argparse.ArgumentParser, providers: Sequence[str]) -> None:
    """The options of a benchmark that trains each provider in rounds of fresh processes:
    ``--providers``; ``--steps``, ``--warmup`` and ``--rounds`` (left unset, :func:`fill_defaults`
    gives them :data:`ROUND_DEFAULTS`); ``--lr``; ``--merge`` (for :func:`merge_records`); and the
    hidden ``--worker`` and ``--result`` by which :func:`run_worker` starts the script."""
    parser.add_argument("--providers", nargs="+", choices=providers, default=list(providers))
    what = {"steps": "timed steps", "warmup": "steps before timing", "rounds": "timed rounds of every provider"}
    for name, (full, tiny) in ROUND_DEFAULTS.items():
        parser.add_argument(f"--{name}", type=int, help=f"{what[name]} (default {full}; --tiny {tiny})")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--merge", action="store_true",
                        help="keep the rows of the record already at --out of the cases this call does not run")  # fmt: skip
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)


def fill_defaults(args: argparse.Namespace, defaults: Mapping[str, tuple[Any, Any]]) -> None:
    """Set each option of ``defaults`` that was left unset (None) to its first value, or with
    ``args.tiny`` to its second."""
    for name, (full, tiny) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else full)


def round_order(providers: Sequence[str], rounds: int) -> list[tuple[int, str]]:
    """(round, provider) in the order they run: even rounds in ``providers``' order, odd ones reversed."""
    return [(r, p) for r in range(rounds) for p in (providers if r % 2 == 0 else providers[::-1])]


def merge_rounds(outs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One case's timed rounds as one result. Each round gives ``step_seconds`` (its timed steps),
    ``tokens_per_step`` and ``peak_gib`` (None off CUDA), and may give ``host_seconds`` and
    ``gc_seconds`` (per step, the host's time to issue it and the garbage collector's in it:
    :class:`fk.hf.training.RunResult`'s): tokens/s from the median of every round's steps, each
    round's own tokens/s and step times (ms, in order: where rounds disagree they show whether a few
    steps or all of them were slow) and, where given, its host and collector times, the largest
    peak; the other fields from the first round."""
    steps = [s for out in outs for s in out["step_seconds"]]
    median = statistics.median(steps)
    tokens = outs[0]["tokens_per_step"]
    peaks = [out["peak_gib"] for out in outs if out["peak_gib"] is not None]
    per_step_ms = {f"round_{name}_ms": [[round(1e3 * s, 3) for s in out[f"{name}_seconds"]] for out in outs]
                   for name in ("step", "host", "gc") if all(f"{name}_seconds" in out for out in outs)}  # fmt: skip
    return {
        **outs[0], "tokens_per_s": tokens / median, "median_step_ms": 1e3 * median, "peak_gib": max(peaks, default=None),
        "round_tokens_per_s": [tokens / statistics.median(out["step_seconds"]) for out in outs], **per_step_ms,
    }  # fmt: skip


def max_relative_diff(values: Sequence[float], reference: Sequence[float] | None) -> float | None:
    """The largest ``|value - reference| / |reference|`` of two equally long series (a provider's
    per-step losses against stock's), or None where there is no reference of that length."""
    if not reference or len(reference) != len(values):
        return None
    return max(abs(a - b) / max(abs(b), 1e-6) for a, b in zip(values, reference, strict=True))


def worker_status(out: Mapping[str, Any]) -> str:
    """How a run that gave no measurement ended: ``skipped: why`` or ``failed: why``."""
    return f"skipped: {out['skipped']}" if "skipped" in out else f"failed: {out['failed']}"


def status_line(status: Any, width: int = 80) -> str:
    """A run's status (:func:`worker_status`) in a table cell: its first line, or, where it holds a
    traceback, ``failed:`` and the traceback's last line (the exception), cut to ``width``."""
    lines = [line.strip() for line in str(status).strip().splitlines() if line.strip()]
    if not lines:
        return ""
    first = lines[0]
    if len(lines) > 1 and first.startswith("failed:"):
        first = f"failed: {lines[-1]}"
    return first[:width]


def run_worker(script: str | os.PathLike[str], job: Mapping[str, Any], timeout_s: float) -> dict[str, Any]:
    """Run ``python script --worker JSON --result PATH`` in a fresh interpreter (the script calls
    :func:`worker_main` there) and return the JSON it wrote; ``{"failed": why}`` with the end of
    its output where it exited with an error, wrote nothing or ran past ``timeout_s``."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, str(Path(script).resolve()), "--worker", json.dumps(job), "--result", str(result)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"failed": f"timed out after {timeout_s:g} s"}
        if proc.returncode != 0 or not result.exists():
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
            return {"failed": f"exit status {proc.returncode}: " + "\n".join(tail)}
        out: dict[str, Any] = json.loads(result.read_text())
        return out


def worker_main(
    worker: Callable[[dict[str, Any]], dict[str, Any]], job_json: str, result: str | os.PathLike[str]
) -> None:
    """The worker side of :func:`run_worker`: ``worker(job)`` written as JSON to ``result``; an
    ``ImportError`` (a peer that is not installed) is written as ``{"skipped": why}``."""
    try:
        out = worker(json.loads(job_json))
    except ImportError as exc:
        out = {"skipped": f"{type(exc).__name__}: {exc}"}
    Path(result).write_text(json.dumps(out))


# --------------------------------------------------------------------------------------- run output


def _format_elapsed(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s"


def progress(iterable: Iterable[T], total: int | None = None, desc: str = "") -> Generator[T, None, None]:
    """Yield the items of ``iterable`` while showing ``[desc] done/total elapsed`` on stderr.

    On a terminal the line is redrawn in place after each item; otherwise only the final line is
    written. The final line ends with a newline, also when the loop is left early.
    """
    if total is None and isinstance(iterable, Sized):
        total = len(iterable)
    stream = sys.stderr
    tty = stream.isatty()
    prefix = f"[{desc}] " if desc else ""
    start = time.perf_counter()
    done = 0

    def line() -> str:
        count = f"{done}/{total}" if total is not None else f"{done}"
        return f"{prefix}{count} {_format_elapsed(time.perf_counter() - start)}"

    if tty:
        stream.write("\r" + line())
        stream.flush()
    try:
        for item in iterable:
            yield item
            done += 1
            if tty:
                stream.write("\r" + line())
                stream.flush()
    finally:
        stream.write("\n" if tty else line() + "\n")
        stream.flush()


def _format_cell(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if value == 0:
            return "0"
        magnitude = math.floor(math.log10(abs(float(f"{value:.3g}"))))  # of the rounded value: 99.96 -> 100
        if magnitude >= 2:  # 123.4 -> "123", 12345.6 -> "12346": no exponent for big numbers
            return f"{value:.0f}"
        if magnitude >= -3:  # three significant digits in fixed notation: 1.23, 0.0123
            return f"{value:.{2 - magnitude}f}"
        return f"{value:.2e}"
    return str(value).replace("|", "\\|")


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str], *, skip_absent: bool = False) -> str:
    """A Markdown table of ``columns`` from ``rows``; floats to three significant digits.

    Missing values are blank; columns holding only numbers are right-aligned. With ``skip_absent``,
    a column that no row has is left out (records written before a benchmark gained a column).
    """
    if skip_absent:
        columns = [c for c in columns if any(c in r for r in rows)]
    cells = [[_format_cell(r.get(c)) for c in columns] for r in rows]
    numeric = [
        all(_is_number(r.get(c)) or r.get(c) is None for r in rows) and any(r.get(c) is not None for r in rows)
        for c in columns
    ]
    widths = [max([len(c), 3, *(len(row[i]) for row in cells)]) for i, c in enumerate(columns)]

    def fmt(values: Sequence[str]) -> str:
        padded = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric, strict=True)]
        return "| " + " | ".join(padded) + " |"

    rule = (
        "| "
        + " | ".join("-" * (w - 1) + ":" if num else "-" * w for w, num in zip(widths, numeric, strict=True))
        + " |"
    )
    return "\n".join([fmt(list(columns)), rule, *(fmt(row) for row in cells)])
