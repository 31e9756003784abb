"""#34: registers and spills of fk's norm kernels at the launches their tables give, compiled for
sm_90 on the CPU (``fk.core.testing.compile_kernel``: Triton's compiler and ptxas, no GPU).

A program's registers decide how many programs an SM holds, and spills move values through local
memory. LayerNorm's forward at 32768 columns (0.85x torch.compile, INDEX.md#norm_forward_wide) was
the question; the backward of LayerNorm and the forwards of RMSNorm ride along for comparison.

Run (no GPU needed):  python benchmarks/experiments/norm_kernel_registers.py   (output: norm_kernel_registers_sm90.txt)
"""

from __future__ import annotations

import importlib

from fk.core import testing

WIDTHS = [1024, 2048, 4096, 8192, 16384, 32768]
LN_FWD = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16", "mean_ptr": "*fp32",
          "rstd_ptr": "*fp32", "n_rows": "i32", "n_cols": "i32", "x_row_stride": "i32", "eps": "fp32",
          "HAS_WEIGHT": "", "HAS_BIAS": "", "BLOCK_COLS": "", "ROWS": ""}  # fmt: skip
LN_FWD_WIDE = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16", "mean_ptr": "*fp32",
               "rstd_ptr": "*fp32", "x_row_stride": "i32", "eps": "fp32", "N_COLS": "", "HAS_WEIGHT": "",
               "HAS_BIAS": "", "BLOCK_COLS": ""}  # fmt: skip
RMS_FWD = {"x_ptr": "*bf16", "residual_ptr": "*bf16", "residual_out_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16",
           "rstd_ptr": "*fp32", "n_rows": "i32", "n_cols": "i32", "x_row_stride": "i32", "residual_row_stride": "i32",
           "residual_out_row_stride": "i32", "eps": "fp32", "offset": "fp32", "HAS_RESIDUAL": "", "HAS_WEIGHT": "",
           "GEMMA": "", "BLOCK_COLS": "", "ROWS": "", "LOOPED": ""}  # fmt: skip
LN_BWD = {"dy_ptr": "*bf16", "x_ptr": "*bf16", "w_ptr": "*bf16", "mean_ptr": "*fp32", "rstd_ptr": "*fp32",
          "dx_ptr": "*bf16", "dw_partial_ptr": "*fp32", "db_partial_ptr": "*fp32", "n_rows": "i32", "n_cols": "i32",
          "dy_row_stride": "i32", "x_row_stride": "i32", "HAS_WEIGHT": "", "COMPUTE_DX": "", "COMPUTE_DW": "",
          "COMPUTE_DB": "", "BLOCK_COLS": "", "ROWS": "", "LOOPED": "", "ACC_2D": "", "PREFETCH": "",
          "REVERSE_TILES": ""}  # fmt: skip


def line(what: str, width: int, tiling: object, compiled: testing.CompiledKernel) -> str:
    return f"{what:28} {width:6}  {tiling}  registers {compiled.registers:3}  spilled {compiled.spill_bytes:4} B"


def main() -> None:
    print("bf16, weight (and bias); compiled for sm_90; registers and spill stores a thread (ptxas -v)")
    ln = importlib.import_module("fk.norms.layer_norm")
    for width in WIDTHS:  # LayerNorm's forward: one tile, or three passes (WIDE_FORWARD)
        t = ln._fwd_tiling(width)
        flags = {"HAS_WEIGHT": True, "HAS_BIAS": True, "BLOCK_COLS": t.block_cols}
        if t.looped:
            compiled = testing.compile_kernel("fk.norms.layer_norm", "_layer_norm_fwd_wide_kernel", LN_FWD_WIDE,
                                              {**flags, "N_COLS": width}, num_warps=t.num_warps)  # fmt: skip
        else:
            compiled = testing.compile_kernel("fk.norms.layer_norm", "_layer_norm_fwd_kernel", LN_FWD,
                                              {**flags, "ROWS": t.rows_per_tile}, num_warps=t.num_warps)  # fmt: skip
        print(line("layer_norm forward", width, t, compiled), flush=True)
    rms = importlib.import_module("fk.norms.rms_norm")
    for width in WIDTHS:
        t = rms._fwd_tiling(width)
        constexprs = {"HAS_RESIDUAL": False, "HAS_WEIGHT": True, "GEMMA": False, "BLOCK_COLS": t.block_cols,
                      "ROWS": t.rows_per_tile, "LOOPED": t.looped}  # fmt: skip
        compiled = testing.compile_kernel("fk.norms.rms_norm", "_rms_norm_fwd_kernel", RMS_FWD, constexprs,
                                          num_warps=t.num_warps)  # fmt: skip
        print(line("rms_norm forward", width, t, compiled), flush=True)
    for trainable in (False, True):
        for width in WIDTHS:
            if trainable and width >= ln.BACKWARD.strips_min_cols:
                continue  # fk.norms.norm_strips' kernels
            keeps = ln._keeps_partials(width, trainable, trainable)
            t = ln._bwd_tiling(width, keeps, trainable)
            one_tile = not t.looped
            constexprs = {
                "HAS_WEIGHT": True, "COMPUTE_DX": True, "COMPUTE_DW": trainable,
                "COMPUTE_DB": trainable and not (t.looped and ln.BACKWARD.looped_db_column_sum),
                "BLOCK_COLS": t.block_cols, "ROWS": t.rows_per_tile, "LOOPED": t.looped,
                "ACC_2D": one_tile and keeps and t.rows_per_tile >= ln.BACKWARD.acc_2d_rows,
                "PREFETCH": one_tile and keeps and t.block_cols <= ln.BACKWARD.prefetch_max_cols,
                "REVERSE_TILES": one_tile and not keeps and width <= ln.BACKWARD_FROZEN.narrow_cols
                and ln.BACKWARD_FROZEN.narrow_reverse_tiles,
            }  # fmt: skip
            compiled = testing.compile_kernel("fk.norms.layer_norm", "_layer_norm_bwd_kernel", LN_BWD, constexprs,
                                              num_warps=t.num_warps)  # fmt: skip
            print(line(f"layer_norm backward {'trainable' if trainable else 'frozen'}", width, t, compiled), flush=True)


if __name__ == "__main__":
    main()
