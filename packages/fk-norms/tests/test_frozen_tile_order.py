"""The backward without parameter gradients of RMSNorm and LayerNorm takes the row tiles of narrow
rows last first (``BACKWARD_FROZEN.narrow_reverse_tiles``): both orders against the float64
references, on the GPU where there is one, else in Triton's interpreter."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType

import pytest
import torch

from fk.core import testing
from fk.core.testing import DTYPES, dtype_name
from fk.norms import layer_norm, layer_norm_ref, rms_norm, rms_norm_ref

EPS = 1e-5
WIDTH = 300  # a narrow row (up to BACKWARD_FROZEN.narrow_cols)


def _frozen_programs_and_tile_rows(module: ModuleType, device: str) -> tuple[int, int]:
    """(programs of the frozen backward's grid, rows of its tiles) at WIDTH, for a capped grid."""
    if module.__name__.endswith("rms_norm"):
        programs = module.dw_partial_rows(1 << 30, WIDTH, torch.device(device), compute_dw=False)
        return programs, module._bwd_tiling(WIDTH, compute_dw=False).rows_per_tile
    programs = module.partial_rows(1 << 30, WIDTH, torch.device(device), compute_dw=False, compute_db=False)
    return programs, module._bwd_tiling(WIDTH, keeps_partials=False, compute_dw=False).rows_per_tile


OPS: dict[str, tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor], int]] = {
    # name: (fk, reference, parameters after x)
    "rms_norm": (lambda x, w: rms_norm(x, w, EPS), lambda x, w: rms_norm_ref(x, w, EPS), 1),
    "layer_norm": (lambda x, w, b: layer_norm(x, w, b, EPS), lambda x, w, b: layer_norm_ref(x, w, b, EPS), 2),
}


@pytest.mark.parametrize("reverse", [True, False], ids=["last_tile_first", "first_tile_first"])
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_frozen_backward_takes_the_tiles_in_either_order(
    device: str, dtype: torch.dtype, op: str, reverse: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every program of the grid gets two row tiles or more and the last tile is partial: an
    # off-by-one in the reversed order drops or repeats rows.
    module = importlib.import_module(f"fk.norms.{op}")  # (fk.norms.<op> is the function)
    monkeypatch.setattr(module, "BACKWARD_FROZEN", module.BACKWARD_FROZEN._replace(narrow_reverse_tiles=reverse))
    programs, tile_rows = _frozen_programs_and_tile_rows(module, device)
    fk_fn, ref_fn, n_params = OPS[op]
    x = testing.random_tensor(((2 * programs + 1) * tile_rows - 1, WIDTH), dtype, device, seed=13, requires_grad=True)
    params = [testing.random_tensor((WIDTH,), dtype, device, seed=14 + i, offset=1.0 - i) for i in range(n_params)]
    testing.compare_with_reference(fk_fn, ref_fn, [x, *params], arg_names=["x", "weight", "bias"][: 1 + n_params])
