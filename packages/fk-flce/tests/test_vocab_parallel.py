"""Vocabulary-parallel fused linear cross entropy on 2 gloo processes (CPU, Triton's interpreter),
and on 2 GPUs with NCCL (``gpu``: this file run under ``torchrun --nproc-per-node 2``), against the
single-process loss on the full head: float64 reference and fk's own fused loss.

The two processes run every case once (one process group for the whole module: starting them is
the expensive part) and save what they computed; the tests compare it here, on the CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from fk.core import testing
from fk.flce import (
    linear_cross_entropy,
    linear_cross_entropy_ref,
    vocab_parallel_linear_cross_entropy,
    vocab_parallel_linear_cross_entropy_ref,
)

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

N, H = 37, 16
WORLD = 2

# name -> (vocabulary size, shard layout, keyword arguments of the loss). Layouts: "equal" (rank
# order, no offsets given), "uneven" (60 and 41 rows, with vocab_start_index/vocab_size) and
# "dtensor" (a DTensor weight sharded Shard(0): 51 and 50 rows).
CASES: dict[str, tuple[int, str, dict[str, Any]]] = {
    "mean_bias": (96, "equal", {"bias": True}),
    "chunks_smoothing": (96, "equal", {"label_smoothing": 0.1, "memory_budget": 8 * 48 * 4}),
    "z_loss_softcap_sum": (96, "equal", {"lse_square_scale": 1e-2, "softcap": 3.0, "reduction": "sum"}),
    "none_chunks": (96, "equal", {"reduction": "none", "bias": True, "memory_budget": 8 * 48 * 4}),
    "shift_num_items": (96, "equal", {"shift": True, "num_items_in_batch": 50.0, "label_smoothing": 0.2}),
    "frozen_weight": (96, "equal", {"frozen": True}),
    "uneven": (101, "uneven", {"label_smoothing": 0.1, "lse_square_scale": 1e-3}),
    "dtensor": (101, "dtensor", {"bias": True}),
    "bf16": (96, "equal", {"dtype": torch.bfloat16}),
}
TEST_OPTIONS = ("bias", "frozen", "dtype")  # keys of CASES that are not options of the loss


def _data(vocab: int, dtype: torch.dtype, shift: bool) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(vocab)
    shape = (N, H) if not shift else (1, N, H)
    h = torch.randn(shape, generator=g).to(dtype)
    w = (torch.randn(vocab, H, generator=g) * 0.5).to(dtype)
    b = torch.randn(vocab, generator=g).to(dtype)
    y = torch.randint(0, vocab, shape[:-1], generator=g)
    y.view(-1)[::5] = -100
    return h, w, b, y


def _rows(vocab: int, layout: str, rank: int) -> slice:
    if layout == "uneven":
        return slice(0, 60) if rank == 0 else slice(60, vocab)
    per = -(-vocab // WORLD)
    return slice(rank * per, min(vocab, (rank + 1) * per))


def _loss_kwargs(kw: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in kw.items() if k not in TEST_OPTIONS}


def _run_case(rank: int, vocab: int, layout: str, kw: dict[str, Any], device: str) -> dict[str, torch.Tensor | None]:
    h, w, b, y = (t.to(device) for t in _data(vocab, kw.get("dtype", torch.float32), kw.get("shift", False)))
    rows = _rows(vocab, layout, rank)
    h.requires_grad_()
    weight: Any = w[rows].clone().requires_grad_(not kw.get("frozen", False))
    bias: Any = b[rows].clone().requires_grad_() if kw.get("bias") else None
    extra: dict[str, Any] = {}
    if layout == "uneven":
        extra = {"vocab_start_index": rows.start, "vocab_size": vocab}
    elif layout == "dtensor":
        from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

        mesh = init_device_mesh(torch.device(device).type, (WORLD,))
        weight = torch.nn.Parameter(distribute_tensor(w, mesh, [Shard(0)]))
        bias = torch.nn.Parameter(distribute_tensor(b, mesh, [Shard(0)])) if bias is not None else None
    loss = vocab_parallel_linear_cross_entropy(h, weight, y, bias, **_loss_kwargs(kw), **extra)
    (loss.sum() if loss.ndim else loss).backward()

    def local(t: Any) -> torch.Tensor | None:
        return None if t is None or t.grad is None else (t.grad.to_local() if hasattr(t.grad, "to_local") else t.grad)

    return {"loss": loss.detach().cpu(), "dh": h.grad, "dw": local(weight), "db": local(bias)}


def _checks(rank: int, device: str) -> dict[str, Any]:
    """The cases that are not loss-and-gradient comparisons."""
    out: dict[str, Any] = {}
    # The reference itself (fp64, differentiable collectives) against the single-process reference.
    h, w, _, y = (t.to(device) for t in _data(96, torch.float64, False))
    rows = _rows(96, "equal", rank)
    h.requires_grad_()
    wr = w[rows].clone().requires_grad_()
    opts: dict[str, Any] = {"label_smoothing": 0.1, "lse_square_scale": 1e-2, "softcap": 3.0}
    loss = vocab_parallel_linear_cross_entropy_ref(h, wr, y, **opts).loss
    loss.backward()
    out["reference"] = {"loss": loss.detach(), "dh": h.grad, "dw": wr.grad}
    # A label outside the whole vocabulary, unchecked (a GPU's default): NaN loss for that token only.
    y_bad = y.clone()
    y_bad[3] = 96
    with mock.patch.dict(os.environ, {"FK_CHECK_LABELS": "0"}):
        out["outside"] = vocab_parallel_linear_cross_entropy(h.detach().float(), wr.detach().float(), y_bad,
                                                             reduction="none")  # fmt: skip
    out["label_errors"] = _label_errors(h.detach().float(), wr.detach().float(), y, rank)
    errors = []
    for call in (
        lambda: vocab_parallel_linear_cross_entropy(h.float(), wr.float(), y, vocab_size=96),
        lambda: vocab_parallel_linear_cross_entropy(h.float(), wr.float(), y, vocab_start_index=90, vocab_size=96),
        lambda: vocab_parallel_linear_cross_entropy(
            h.float(), wr.float(), y, class_weight=torch.ones(48, device=device)
        ),
        lambda: vocab_parallel_linear_cross_entropy(h.float(), wr.float(), y, return_accuracy=True),
    ):
        try:
            call()
            errors.append("no error")
        except (ValueError, NotImplementedError) as e:
            errors.append(f"{type(e).__name__}: {e}")
    out["errors"] = errors
    return out


def _label_errors(h: torch.Tensor, wr: torch.Tensor, y: torch.Tensor, rank: int) -> list[str]:
    """What each call with labels checked (FK_CHECK_LABELS=1: on GPUs too) raised, or "no error".
    The range is the whole vocabulary [0, 96) (or the ``vocab_size`` given), not the rank's shard."""
    other = 95 if rank == 0 else 0  # a label of the other rank's shard: fine
    cases: list[tuple[torch.Tensor, dict[str, Any]]] = [
        (y.clone().index_fill_(0, torch.tensor([3], device=y.device), 96), {}),
        (y.clone().index_fill_(0, torch.tensor([4], device=y.device), -1), {}),
        (y.clone().index_fill_(0, torch.tensor([5], device=y.device), 2**40), {}),
        (y.clone().index_fill_(0, torch.tensor([6], device=y.device), other), {}),
        (y.clone().reshape(1, N).index_fill_(1, torch.tensor([7], device=y.device), 96), {"shift": True}),
        (y.clone().reshape(1, N).index_fill_(1, torch.tensor([0], device=y.device), 96), {"shift": True}),
        (y.clone().index_fill_(0, torch.tensor([8], device=y.device), 100),
         {"vocab_start_index": 48 * rank, "vocab_size": 101}),
        (y.clone().index_fill_(0, torch.tensor([9], device=y.device), 101),
         {"vocab_start_index": 48 * rank, "vocab_size": 101}),
    ]  # fmt: skip
    errors = []
    with mock.patch.dict(os.environ, {"FK_CHECK_LABELS": "1"}):
        for target, kw in cases:
            hidden = h.reshape(1, N, H) if kw.get("shift") else h
            try:
                vocab_parallel_linear_cross_entropy(hidden, wr, target, **kw)
                errors.append("no error")
            except ValueError as e:
                errors.append(str(e))
    return errors


def _worker(rank: int, world: int, out_dir: Path, device: str = "cpu") -> None:
    results = {name: _run_case(rank, vocab, layout, kw, device) for name, (vocab, layout, kw) in CASES.items()}
    results.update(_checks(rank, device))
    torch.save(results, out_dir / f"rank{rank}.pt")


@pytest.fixture(scope="module", params=["gloo", pytest.param("nccl", marks=pytest.mark.gpu)])
def ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """What each rank computed: 2 forked gloo processes on the CPU, or 2 GPUs under torchrun (NCCL)."""
    out_dir = tmp_path_factory.mktemp("vocab_parallel")
    if request.param == "gloo":
        testing.run_distributed(_worker, out_dir, world_size=WORLD)
    else:
        if torch.cuda.device_count() < WORLD:
            pytest.skip(f"needs {WORLD} GPUs")
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(WORLD),
            __file__,
            str(out_dir),
        ]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=False)
        assert out.returncode == 0, f"stdout:\n{out.stdout}\nstderr:\n{out.stderr[-5000:]}"
    return [torch.load(out_dir / f"rank{r}.pt", map_location="cpu") for r in range(WORLD)]


def _expected(vocab: int, kw: dict[str, Any], fn: Any, dtype: torch.dtype) -> dict[str, torch.Tensor | None]:
    h, w, b, y = _data(vocab, kw.get("dtype", torch.float32), kw.get("shift", False))
    h, w, b = (t.to(dtype).requires_grad_() for t in (h, w, b))
    w.requires_grad_(not kw.get("frozen", False))
    opts = _loss_kwargs(kw)
    if fn is linear_cross_entropy_ref:
        opts.pop("memory_budget", None)
    out = fn(h, w, y, b if kw.get("bias") else None, **opts)
    loss = out.loss if fn is linear_cross_entropy_ref else out
    (loss.sum() if loss.ndim else loss).backward()
    return {"loss": loss.detach(), "dh": h.grad, "dw": w.grad, "db": b.grad}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_single_process(ranks: list[dict[str, Any]], name: str) -> None:
    vocab, layout, kw = CASES[name]
    low = kw.get("dtype", torch.float32) != torch.float32
    ref = _expected(vocab, kw, linear_cross_entropy_ref, torch.float64)
    fused = _expected(vocab, kw, linear_cross_entropy, kw.get("dtype", torch.float32))
    tol = {"rtol": 2e-2, "atol": 2e-2} if low else {"rtol": 1e-5, "atol": 1e-5}
    for rank, result in enumerate(ranks):
        got = result[name]
        rows = _rows(vocab, layout, rank)
        for key in ("loss", "dh", "dw", "db"):
            want, single = ref[key], fused[key]
            if key in ("dw", "db") and want is not None:
                want, single = want[rows], single[rows]  # type: ignore[index]
            if (key == "dw" and kw.get("frozen")) or (key == "db" and not kw.get("bias")):
                assert got[key] is None, f"rank {rank}: {key} should not be computed"
                continue
            assert got[key] is not None and want is not None and single is not None, f"rank {rank}: no {key}"
            scale = max(1.0, float(want.abs().max()))
            torch.testing.assert_close(got[key].double(), want, rtol=tol["rtol"], atol=tol["atol"] * scale,
                                       msg=lambda m, k=key, r=rank: f"rank {r} {k} vs fp64: {m}")  # fmt: skip
            torch.testing.assert_close(got[key].double(), single.double(), rtol=tol["rtol"], atol=tol["atol"] * scale,
                                       msg=lambda m, k=key, r=rank: f"rank {r} {k} vs fk: {m}")  # fmt: skip


def test_reference_matches_single_process_reference(ranks: list[dict[str, Any]]) -> None:
    h, w, _, y = _data(96, torch.float64, False)
    h.requires_grad_()
    w.requires_grad_()
    loss = linear_cross_entropy_ref(h, w, y, label_smoothing=0.1, lse_square_scale=1e-2, softcap=3.0).loss
    loss.backward()
    assert w.grad is not None
    for rank, result in enumerate(ranks):
        got = result["reference"]
        torch.testing.assert_close(got["loss"], loss.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got["dh"], h.grad, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got["dw"], w.grad[_rows(96, "equal", rank)], rtol=1e-12, atol=1e-12)


def test_label_outside_vocabulary_is_nan_for_that_token(ranks: list[dict[str, Any]]) -> None:
    for result in ranks:
        loss = result["outside"]
        assert torch.isnan(loss[3]) and torch.isfinite(loss[torch.arange(N) != 3]).all()


def test_label_outside_the_whole_vocabulary_raises_naming_position(ranks: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(ranks):
        assert result["label_errors"] == [
            "target[3] = 96 is outside [0, 96) and is not ignore_index (-100)",
            "target[4] = -1 is outside [0, 96) and is not ignore_index (-100)",
            f"target[5] = {2**40} is outside [0, 96) and is not ignore_index (-100)",
            "no error",  # another rank's label
            "target[0, 7] = 96 is outside [0, 96) and is not ignore_index (-100)",  # shift: as passed
            "no error",  # shift: the first label is never scored
            "no error",  # inside the given vocab_size
            "target[9] = 101 is outside [0, 101) and is not ignore_index (-100)",
        ], f"rank {rank}"


def test_errors_name_the_argument(ranks: list[dict[str, Any]]) -> None:
    errors = ranks[0]["errors"]
    assert errors[0].startswith("ValueError") and "vocab_start_index and vocab_size" in errors[0]
    assert errors[1].startswith("ValueError") and "[90, 138)" in errors[1]
    assert errors[2].startswith("NotImplementedError") and "class_weight" in errors[2]
    assert errors[3].startswith("NotImplementedError") and "return_accuracy" in errors[3]


def test_needs_an_initialized_process_group() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"torch\.distributed initialized"):
        vocab_parallel_linear_cross_entropy(torch.randn(4, H), torch.randn(8, H), torch.zeros(4, dtype=torch.long))


if __name__ == "__main__":  # under torchrun: on GPUs with NCCL (see the ``ranks`` fixture), else gloo on the CPU
    gpus = torch.cuda.is_available()
    where = f"cuda:{os.environ['LOCAL_RANK']}" if gpus else "cpu"
    if gpus:
        torch.cuda.set_device(where)
    dist.init_process_group("nccl" if gpus else "gloo")
    try:
        _worker(dist.get_rank(), dist.get_world_size(), Path(sys.argv[1]), where)
    finally:
        dist.destroy_process_group()
