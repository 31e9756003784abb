"""The backward with a weight gradient of RMSNorm, FusedAddRMSNorm, LayerNorm and PolyNorm takes
one-tile rows up to a width by its ``BACKWARD_NARROW`` table (``fk.norms.launch_params``): the table
decides the grid and the tiles, and any entry gives the float64 references' values, on the GPU
where there is one, else in Triton's interpreter."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType

import pytest
import torch

from fk.core import testing
from fk.core.testing import DTYPES, dtype_name
from fk.norms import (
    fused_add_rms_norm,
    fused_add_rms_norm_ref,
    layer_norm,
    layer_norm_ref,
    poly_norm,
    poly_norm_ref,
    rms_norm,
    rms_norm_ref,
)
from fk.norms.launch_params import NarrowBackwardParams, narrow_backward

EPS = 1e-5
WIDTH = 300  # not a power of two: the tile holds padded rows
# An entry unlike the committed ones: 5 programs an SM, tiles of 2048 elements (four rows of 300
# columns, padded to 512), one warp per 256 elements.
ODD_ENTRY = NarrowBackwardParams(max_cols=WIDTH, programs_per_sm=5, min_tile=2048, elements_per_warp=256)

OPS: dict[str, tuple[str, Callable[..., object], Callable[..., object], list[str]]] = {
    # name: (module, fk, reference, argument names)
    "rms_norm": ("rms_norm", lambda x, w: rms_norm(x, w, EPS), lambda x, w: rms_norm_ref(x, w, EPS), ["x", "weight"]),
    "fused_add_rms_norm": (
        "rms_norm",
        lambda x, r, w: fused_add_rms_norm(x, r, w, EPS),
        lambda x, r, w: fused_add_rms_norm_ref(x, r, w, EPS),
        ["x", "residual", "weight"],
    ),
    "layer_norm": (
        "layer_norm",
        lambda x, w, b: layer_norm(x, w, b, EPS),
        lambda x, w, b: layer_norm_ref(x, w, b, EPS),
        ["x", "weight", "bias"],
    ),
    "poly_norm": (
        "poly_norm",
        lambda x, w, b: poly_norm(x, w, b, EPS),
        lambda x, w, b: poly_norm_ref(x, w, b, EPS),
        ["x", "weight", "bias"],
    ),
}


def _module(op: str) -> ModuleType:
    return importlib.import_module(f"fk.norms.{OPS[op][0]}")  # (fk.norms.<op> is the function)


def _programs(module: ModuleType, n_rows: int, width: int, device: str) -> int:
    """Programs of the backward's grid with a weight gradient (rows of its partial buffer)."""
    if module.__name__.endswith("rms_norm"):
        return module.dw_partial_rows(n_rows, width, torch.device(device))
    return module.partial_rows(n_rows, width, torch.device(device))


def _rows_per_tile(module: ModuleType, width: int) -> int:
    return module._bwd_tiling(width).rows_per_tile


def test_entries_are_taken_by_width() -> None:
    table = (ODD_ENTRY, ODD_ENTRY._replace(max_cols=4096, programs_per_sm=2))
    assert narrow_backward(1, table) is table[0]
    assert narrow_backward(WIDTH, table) is table[0]
    assert narrow_backward(WIDTH + 1, table) is table[1]
    assert narrow_backward(4097, table) is None
    assert narrow_backward(WIDTH, ()) is None


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm", "poly_norm"])
def test_table_sets_the_grid_and_the_tiles(device: str, op: str, monkeypatch: pytest.MonkeyPatch) -> None:
    module = _module(op)
    monkeypatch.setattr(module, "BACKWARD_NARROW", (ODD_ENTRY._replace(programs_per_sm=1),))
    module._bwd_tiling.cache_clear()
    one_per_sm = _programs(module, 1 << 30, WIDTH, device)
    monkeypatch.setattr(module, "BACKWARD_NARROW", (ODD_ENTRY,))
    module._bwd_tiling.cache_clear()
    assert _programs(module, 1 << 30, WIDTH, device) == 5 * one_per_sm
    assert _rows_per_tile(module, WIDTH) == 4  # 2048 elements of rows padded to 512 columns
    monkeypatch.setattr(module, "BACKWARD_NARROW", (ODD_ENTRY._replace(min_tile=4096),))
    module._bwd_tiling.cache_clear()
    assert _rows_per_tile(module, WIDTH) == 8
    # Wider rows than the table's: BACKWARD's own fields.
    monkeypatch.setattr(module, "BACKWARD_NARROW", (ODD_ENTRY._replace(max_cols=WIDTH - 1),))
    module._bwd_tiling.cache_clear()
    assert _programs(module, 1 << 30, WIDTH, device) == module.BACKWARD.programs_per_sm * one_per_sm
    module._bwd_tiling.cache_clear()


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_any_entry_matches_reference(device: str, dtype: torch.dtype, op: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Every program of the grid gets two row tiles or more and the last tile is partial: a program
    # that drops or repeats a tile, or a partial row summed twice, changes dx or the weight's gradient.
    module = _module(op)
    monkeypatch.setattr(module, "BACKWARD_NARROW", (ODD_ENTRY,))
    module._bwd_tiling.cache_clear()
    programs, tile_rows = _programs(module, 1 << 30, WIDTH, device), _rows_per_tile(module, WIDTH)
    n_rows = (2 * programs + 1) * tile_rows - 1
    _, fk_fn, ref_fn, names = OPS[op]
    x = testing.random_tensor((n_rows, WIDTH), dtype, device, seed=21, requires_grad=True)
    args = [x]
    if op == "fused_add_rms_norm":
        args.append(testing.random_tensor((n_rows, WIDTH), dtype, device, seed=22, requires_grad=True))
    n_params = 1 if op.endswith("rms_norm") else 2
    param_width = 3 if op == "poly_norm" else WIDTH
    for i in range(n_params):
        shape = (1,) if op == "poly_norm" and i == 1 else (param_width,)
        args.append(testing.random_tensor(shape, dtype, device, seed=23 + i, offset=1.0 - i, requires_grad=True))
    try:
        testing.compare_with_reference(fk_fn, ref_fn, args, arg_names=names)
    finally:
        module._bwd_tiling.cache_clear()
