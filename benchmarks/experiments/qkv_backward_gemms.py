"""The q/k/v projections' backward at the e2e benchmark's shape (8192 tokens, hidden 2048, q 2048,
k and v 512 each, bf16), GPU time of each piece (triton.testing.do_bench, L2 flushed, median):

- ``dx``: as fk.hf.projections computes it now (three matmuls, the 2nd and 3rd accumulating into
  the first's output through ``addmm_``), and as one matmul over the concatenated gradients and
  weights (``torch.cat`` of the gradients and of the weights included);
- ``dW``: three ``dy_i^T x`` matmuls, and one over the concatenated gradients;
- each single matmul alone, to see which one costs what.

Run on a GPU:  python benchmarks/experiments/qkv_backward_gemms.py   (output: qkv_backward_gemms_h200.txt)
"""

from __future__ import annotations

import torch
import triton


def bench(fn: object) -> float:
    return triton.testing.do_bench(fn, rep=300, return_mode="median") * 1e3  # type: ignore[arg-type]


def main() -> None:
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    n, hidden, outs = 8192, 2048, (2048, 512, 512)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    ws = [torch.randn(o, hidden, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02 for o in outs]
    dys = [torch.randn(n, o, device="cuda", dtype=torch.bfloat16, generator=g) for o in outs]

    def dx_three() -> torch.Tensor:
        dx = torch.mm(dys[2], ws[2])
        dx.addmm_(dys[1], ws[1])
        return dx.addmm_(dys[0], ws[0])

    def dx_one() -> torch.Tensor:
        return torch.mm(torch.cat(dys, dim=1), torch.cat(ws, dim=0))

    def dw_three() -> list[torch.Tensor]:
        return [torch.mm(dy.t(), x) for dy in dys]

    def dw_one() -> torch.Tensor:
        return torch.mm(torch.cat(dys, dim=1).t(), x)

    dy_cat, w_cat = torch.cat(dys, dim=1), torch.cat(ws, dim=0)
    acc = torch.mm(dys[0], ws[0])
    rows = [
        ("dx: three matmuls (now)", dx_three),
        ("dx: cat + one matmul", dx_one),
        ("dx: one matmul, operands already concatenated", lambda: torch.mm(dy_cat, w_cat)),
        ("dW: three matmuls (now)", dw_three),
        ("dW: cat + one matmul", dw_one),
        ("dW: one matmul, gradients already concatenated", lambda: torch.mm(dy_cat.t(), x)),
        ("cat of the three gradients", lambda: torch.cat(dys, dim=1)),
        ("cat of the three weights", lambda: torch.cat(ws, dim=0)),
    ]
    for i, name in enumerate("qkv"):
        rows.append((f"dx_{name} = dy_{name} W_{name}", lambda i=i: torch.mm(dys[i], ws[i])))
        rows.append((f"dx += dy_{name} W_{name} (addmm_)", lambda i=i: acc.addmm_(dys[i], ws[i])))
        rows.append((f"dW_{name} = dy_{name}^T x", lambda i=i: torch.mm(dys[i].t(), x)))
    torch.testing.assert_close(dx_three().float(), dx_one().float(), rtol=2e-2, atol=2e-1)
    for name, fn in rows:
        print(f"{name:50s} {bench(fn):8.1f} us")


if __name__ == "__main__":
    main()
