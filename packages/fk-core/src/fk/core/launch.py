"""Launch sizing for row-wise kernels (norms, activations, losses over the last dimension).

A row-wise kernel processes a ``[rows, cols]`` matrix. It either holds a whole row (or several
narrow rows) in one tile, or, for rows wider than its largest tile, loops over column tiles.
:func:`row_tiling` picks the tile and the number of warps; :func:`persistent_grid` sizes a grid of
programs that stride over the rows (one or a few waves across the GPU's multiprocessors), which is
what kernels that accumulate per-program partial sums (weight gradients) want.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

MAX_TILE_ELEMENTS = 1 << 16
"""The largest tile (elements) a row-wise fk kernel holds at once; wider rows loop."""


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for launch grids. Plain Python on purpose: ``triton.cdiv`` is a constexpr
    function whose host-side call costs microseconds, on a path where every microsecond shows."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (and >= 1)."""
    return 1 << max(0, (int(n) - 1).bit_length())


def dot_size(n: int) -> int:
    """``n`` padded for a dimension of a ``tl.dot`` operand: the next power of two, and at least 16
    (the smallest inner and output size Triton's MMAs take). A LoRA rank ``r`` becomes the
    ``BLOCK_RANK`` of fk-lora's kernels this way (16 for r = 1..16, 32 for 17..32, ...)."""
    return max(16, next_power_of_2(n))


@dataclass(frozen=True)
class RowTiling:
    """How a row-wise kernel covers a ``[rows, cols]`` matrix.

    block_cols: columns in a tile, a power of two.
    looped: True when one row needs several column tiles (the kernel loops over them).
    rows_per_tile: rows processed together in one tile (:func:`row_tiling` gives 1 when ``looped``;
        :func:`looped_rows_tiling` several).
    num_warps: warps per program.
    """

    block_cols: int
    looped: bool
    rows_per_tile: int
    num_warps: int


def row_tiling(
    n_cols: int,
    *,
    max_block_cols: int = 8192,
    min_tile_elements: int = 2048,
    elements_per_warp: int = 512,
    max_warps: int = 16,
    min_warps: int = 1,
    allow_loop: bool = True,
    name: str = "input",
) -> RowTiling:
    """Choose a tile for rows of ``n_cols`` elements.

    Rows up to ``max_block_cols`` wide fit in one tile; narrow rows are grouped so that a tile has
    at least ``min_tile_elements`` elements (enough loads in flight to keep memory busy), with one
    warp per ``elements_per_warp`` elements of the tile (at least ``min_warps``, at most
    ``max_warps``). Wider
    rows loop over tiles of ``max_block_cols`` columns, or raise a ``ValueError`` naming ``name``
    when the kernel cannot loop (``allow_loop=False``): never a silent wrong answer.
    """
    if n_cols < 1:
        raise ValueError(f"{name} must have at least one column, got {n_cols}")
    max_block_cols = min(next_power_of_2(max_block_cols), MAX_TILE_ELEMENTS)
    block = next_power_of_2(n_cols)
    looped = block > max_block_cols
    if looped:
        if not allow_loop:
            raise ValueError(f"{name} has rows of {n_cols} elements; this kernel handles at most {max_block_cols}")
        block = max_block_cols
    rows = 1 if looped else max(1, min_tile_elements // block)
    num_warps = max(min_warps, _num_warps(block * rows, elements_per_warp, max_warps))
    return RowTiling(block_cols=block, looped=looped, rows_per_tile=rows, num_warps=num_warps)


def looped_rows_tiling(
    block_cols: int, rows_per_tile: int, *, elements_per_warp: int, max_warps: int = 16
) -> RowTiling:
    """A looped tiling that takes ``rows_per_tile`` rows at a time, in column tiles of
    ``block_cols`` (a power of two), with one warp per ``elements_per_warp`` elements of the
    ``[rows_per_tile, block_cols]`` tile (at most ``max_warps``). For a kernel whose looped path
    keeps a per-program partial row updated once per column tile: several rows a tile divide
    those updates (fk.norms' RMSNorm and LayerNorm backwards)."""
    if block_cols < 1 or block_cols & (block_cols - 1):
        raise ValueError(f"block_cols must be a power of two, got {block_cols}")
    num_warps = _num_warps(block_cols * rows_per_tile, elements_per_warp, max_warps)
    return RowTiling(block_cols=block_cols, looped=True, rows_per_tile=rows_per_tile, num_warps=num_warps)


def _num_warps(tile_elements: int, elements_per_warp: int, max_warps: int) -> int:
    return max(1, min(max_warps, tile_elements // elements_per_warp))


@functools.cache
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def multiprocessor_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; a small fixed number elsewhere.

    Off the GPU (Triton's interpreter runs programs one after another) the count only decides how
    work is split, so 4 keeps partial-sum buffers small while still testing several programs.
    """
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _multiprocessors(index)


def persistent_grid(n_work: int, device: torch.device, programs_per_multiprocessor: int = 1) -> int:
    """Programs for a grid that strides over ``n_work`` items: at most a few per multiprocessor."""
    return max(1, min(n_work, multiprocessor_count(device) * programs_per_multiprocessor))


def column_strip_grid(
    n_rows: int, n_cols: int, block_rows: int, block_cols: int, device: torch.device, programs_per_sm: int
) -> tuple[int, int]:
    """(row groups P, column strips) of a reduction grid whose programs each own a strip of
    ``block_cols`` columns and every P-th tile of ``block_rows`` rows, writing one partial row per
    sum (P rows): about ``programs_per_sm`` programs per multiprocessor in all, never more row groups
    than row tiles."""
    strips = cdiv(n_cols, block_cols)
    groups = cdiv(multiprocessor_count(device) * programs_per_sm, strips)
    return max(1, min(groups, cdiv(n_rows, block_rows))), strips


def reduction_splits(row_blocks: int, steps: int, device: torch.device, programs_per_sm: int) -> tuple[int, int]:
    """(steps a range, ranges) of a grid of ``row_blocks`` x ranges whose programs each own a block of
    rows and one range of the ``steps`` steps of a reduction (fp32 partials a range where there are
    several): ranges are added until the grid has about ``programs_per_sm`` programs per
    multiprocessor, never more ranges than steps, at least one."""
    wanted = programs_per_sm * multiprocessor_count(device)
    per_range = cdiv(steps, min(steps, max(1, cdiv(wanted, row_blocks))))
    return per_range, cdiv(steps, per_range)


def row_reduction_grid(
    n_rows: int, tiling: RowTiling, device: torch.device, programs_per_sm: int, looped_programs_per_sm: int
) -> int:
    """Programs of a persistent grid over the row tiles of ``tiling``, which is also the number of
    rows of the fp32 partial-sum buffers a weight-gradient reduction allocates. Looped (wide-row)
    kernels take their own, usually smaller, count per multiprocessor."""
    per_sm = looped_programs_per_sm if tiling.looped else programs_per_sm
    return persistent_grid(cdiv(n_rows, tiling.rows_per_tile), device, per_sm)


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a ``[rows, t.shape[-1]]`` view with unit column stride, copied only when it must be.

    Any row stride is kept (rows sliced from a wider buffer, or stride 0 from ``expand``): that is
    what a kernel needs to *read* ``t``. For a tensor a kernel writes, use :func:`writable_rows`.
    """
    rows = t.reshape(-1, t.shape[-1])
    if rows.shape[1] > 1 and rows.stride(1) != 1:
        rows = rows.contiguous()
    return rows


def writable_rows(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` as a ``[rows, t.shape[-1]]`` view a kernel may write in place, or None if there is none.

    The view must share ``t``'s memory (no copy), have unit column stride, and rows that do not
    overlap (no two elements of ``t`` in one memory location).
    """
    n_cols = t.shape[-1]
    try:
        rows = t.view(-1, n_cols)
    except RuntimeError:  # not expressible as a view of [rows, n_cols]
        return None
    if n_cols > 1 and rows.stride(1) != 1:
        return None
    if rows.shape[0] > 1 and rows.stride(0) < n_cols:
        return None
    return rows
