"""fk on 2 GPUs: stock vs fk-patched training under FSDP2 and DDP, and vocabulary-parallel LCE.

Training (``--only train``): a Llama shaped like Llama-3.2-1B (hidden 2048, 16 layers, 32 heads,
8 KV heads, MLP 8192, vocabulary 128256, tied embeddings), random init from one seed, fp32 master
weights, AdamW, the same random batches on every run (``--batch`` sequences of ``--seq`` tokens
per GPU). Runs, each from the same initial weights:

- ``fsdp2 stock`` / ``fsdp2 fk``: ``fully_shard`` on every layer and the root (fk.hf's
  ``fully_shard_causal_lm``), ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``;
- ``fsdp2-head stock`` / ``fsdp2-head fk``: the same, with the tied embedding and head sharded as
  one group of their own (``fully_shard([embed_tokens, lm_head])``: fk's loss runs inside that
  group's hooks);
- ``ddp stock`` / ``ddp fk``: ``DistributedDataParallel``, bf16 autocast;
- ``1 gpu fk``: rank 0 alone on the whole batch (both ranks' sequences), bf16 autocast.

Each records tokens/s (whole batch over the median step time after ``--warmup`` steps), peak
memory per GPU (the largest over the ranks), the loss of every step (averaged over the ranks)
and whether the fused loss ran (``fused_loss``: the patched forward skipped the logits).
The summary compares fk with stock under the same wrapper (losses within bf16 tolerance, speed,
memory) and fk on 2 GPUs with fk on 1 (DDP: the same arithmetic up to summation order; FSDP2:
bf16 parameters instead of autocast, so within bf16 tolerance).

Vocabulary-parallel LCE (``--only vocab``): ``fk.flce.vocab_parallel_linear_cross_entropy`` with
the head's rows split over the 2 GPUs against ``fk.flce.linear_cross_entropy`` on one GPU with the
whole head, bf16, forward+backward time, peak memory, and the largest difference of the loss, dh
and each rank's dW rows from the single-GPU ones.

On 2 GPUs:    torchrun --nproc-per-node 2 benchmarks/bench_distributed.py --out benchmarks/results
CPU check:    TRITON_INTERPRET=1 torchrun --nproc-per-node 2 benchmarks/bench_distributed.py --tiny --out /tmp/x
              (gloo, a tiny Llama, a few steps: exercises every code path; writes distributed-tiny.json)
Without torchrun (``nox -s bench``), the script starts itself under torchrun when 2 GPUs are
visible, and skips otherwise.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fk.core import bench

NAME = "distributed"
LLAMA_1B = {
    "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 131072, "rope_theta": 500000.0,
    "tie_word_embeddings": True,
}  # fmt: skip
TINY = {
    "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 64, "tie_word_embeddings": True,
}  # fmt: skip
KINDS = ("fsdp2", "fsdp2-head", "ddp")  # the wrappers of the training runs
VOCAB_SHAPE = (8192, 2048, 128256)  # tokens, hidden, vocabulary of the vocabulary-parallel timing
TINY_VOCAB_SHAPE = (64, 16, 96)


def _rank() -> int:
    return dist.get_rank()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def _max_over_ranks(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak_mb(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else 0.0


# --- training -------------------------------------------------------------------------------------


def _initial_model(config: dict[str, Any], device: torch.device) -> Any:
    """The fp32 model every run starts from, kept on the CPU: random init from one seed on
    ``device`` (fast; the same on every rank), then moved."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**config)).train()
    return model.to("cpu")


def _batches(config: dict[str, Any], steps: int, batch: int, seq: int, world: int) -> torch.Tensor:
    """(steps, world * batch, seq) token ids, the same on every rank (each takes its rows)."""
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, config["vocab_size"], (steps, world * batch, seq), generator=gen)


def _train(model: Any, ids: torch.Tensor, rows: slice, device: torch.device, autocast: bool,
           warmup: int, reduce_losses: bool = True) -> dict[str, Any]:  # fmt: skip
    """AdamW steps on ``rows`` of each batch: per-step losses (averaged over the ranks when
    ``reduce_losses``), the median step time after ``warmup``, the peak memory."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    losses, times, fused = [], [], True
    _reset_peak(device)
    for step in range(ids.shape[0]):
        batch = ids[step, rows].to(device)
        if reduce_losses:
            _sync(device)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            out = model(input_ids=batch, labels=batch)
        loss = out.loss
        fused = fused and out.logits is None
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if reduce_losses:
            _sync(device)
        elif device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
        loss = loss.detach().float()
        if reduce_losses:
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        losses.append(float(loss))
    timed = times[warmup:] or times
    return {"losses": losses, "step_s": statistics.median(timed), "peak_mb": _peak_mb(device), "fused": fused}


def _setup(kind: str, model: Any, device: torch.device) -> tuple[Any, bool]:
    """The model wrapped for ``kind`` and whether it trains under bf16 autocast."""
    from fk.hf.distributed import fully_shard_causal_lm

    if kind.startswith("fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))  # the CPU's with --tiny, even beside a GPU
        return fully_shard_causal_lm(model, mp_policy=policy, separate_head=kind == "fsdp2-head", mesh=mesh), False
    ids = [device.index] if device.type == "cuda" else None
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids), True


def run_training(record: bench.BenchRecord, config: dict[str, Any], device: torch.device, args: Any) -> None:
    import fk.hf

    world, rank = dist.get_world_size(), _rank()
    steps = args.warmup + args.steps
    ids = _batches(config, steps, args.batch, args.seq, world)
    rows = slice(rank * args.batch, (rank + 1) * args.batch)
    initial = _initial_model(config, device)
    tokens = world * args.batch * args.seq  # per step, all ranks
    for kind in KINDS:
        for provider in ("stock", "fk"):
            model = copy.deepcopy(initial).to(device)
            if provider == "fk":
                fk.hf.apply(model)
            wrapped, autocast = _setup(kind, model, device)
            out = _train(wrapped, ids, rows, device, autocast, args.warmup)
            peak = _max_over_ranks(out["peak_mb"], device)
            record.add(kind="train", provider=f"{kind} {provider}", gpus=world, tokens_per_step=tokens,
                       step_ms=1e3 * out["step_s"], tokens_per_s=tokens / out["step_s"], peak_mb=peak,
                       losses=out["losses"], fused_loss=out["fused"])  # fmt: skip
            if rank == 0:
                print(
                    f"{kind} {provider}: {tokens / out['step_s']:.0f} tokens/s, {peak:.0f} MB, losses {out['losses']}"
                )
            del model, wrapped
            _reset_peak(device)
    # fk on one GPU, on the whole batch (rank 0; the other ranks wait).
    if rank == 0:
        model = copy.deepcopy(initial).to(device)
        fk.hf.apply(model)
        out = _train(model, ids, slice(None), device, True, args.warmup, reduce_losses=False)
        record.add(kind="train", provider="1 gpu fk", gpus=1, tokens_per_step=tokens, step_ms=1e3 * out["step_s"],
                   tokens_per_s=tokens / out["step_s"], peak_mb=out["peak_mb"], losses=out["losses"],
                   fused_loss=out["fused"])  # fmt: skip
        print(f"1 gpu fk: {tokens / out['step_s']:.0f} tokens/s, {out['peak_mb']:.0f} MB, losses {out['losses']}")
        del model
        _reset_peak(device)
    dist.barrier()


# --- vocabulary-parallel LCE ----------------------------------------------------------------------


def _time_ms(fn: Callable[[], object], device: torch.device, rep: int, collective: bool) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(rep):
        if collective:
            _sync(device)
        elif device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def run_vocab_parallel(record: bench.BenchRecord, shape: tuple[int, int, int], device: torch.device, rep: int) -> None:
    from fk.flce import linear_cross_entropy, vocab_parallel_linear_cross_entropy

    tokens, hidden, vocab = shape
    world, rank = dist.get_world_size(), _rank()
    gen = torch.Generator().manual_seed(2)
    dtype = torch.bfloat16
    h = (torch.randn(tokens, hidden, generator=gen) * 0.5).to(device, dtype).requires_grad_()
    w_full = (torch.randn(vocab, hidden, generator=gen) * hidden**-0.5).to(device, dtype).requires_grad_()
    t = torch.randint(0, vocab, (tokens,), generator=gen).to(device)
    t[::17] = -100
    per = -(-vocab // world)
    rows = slice(rank * per, min(vocab, (rank + 1) * per))
    w = w_full.detach()[rows].clone().requires_grad_()
    start = rows.start

    def parallel() -> torch.Tensor:
        loss: torch.Tensor = vocab_parallel_linear_cross_entropy(h, w, t, vocab_start_index=start, vocab_size=vocab)
        loss.backward()
        return loss

    loss_vp = parallel()
    assert h.grad is not None and w.grad is not None
    dh_vp, dw_vp = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    _reset_peak(device)
    ms_vp = _time_ms(parallel, device, rep, collective=True)
    peak_vp = _max_over_ranks(_peak_mb(device), device)
    h.grad = w.grad = None

    def single() -> torch.Tensor:
        loss: torch.Tensor = linear_cross_entropy(h, w_full, t)
        loss.backward()
        return loss

    loss_1 = single()  # every rank: its own reference for its rows of dW
    assert h.grad is not None and w_full.grad is not None
    dh_1, dw_1 = h.grad.clone(), w_full.grad[rows].clone()
    errors = {
        "loss_err": abs(loss_vp.item() - loss_1.item()),
        "dh_err": float((dh_vp.float() - dh_1.float()).abs().max()),
        "dw_err": float((dw_vp.float() - dw_1.float()).abs().max()) if dw_1.numel() else 0.0,
    }
    errors = {k: _max_over_ranks(v, device) for k, v in errors.items()}
    dh_scale, dw_scale = float(dh_1.float().abs().max()), float(dw_1.float().abs().max())
    h.grad = w_full.grad = None
    ms_1 = peak_1 = 0.0
    if rank == 0:
        _reset_peak(device)
        ms_1 = _time_ms(single, device, rep, collective=False)
        peak_1 = _peak_mb(device)
    dist.barrier()
    common = {"kind": "vocab", "tokens": tokens, "hidden": hidden, "vocab": vocab}
    record.add(provider="fk 1 gpu", gpus=1, ms=ms_1, peak_mb=peak_1, **common)
    record.add(provider="fk vocab-parallel", gpus=world, ms=ms_vp, peak_mb=peak_vp, dh_scale=dh_scale,
               dw_scale=dw_scale, **errors, **common)  # fmt: skip
    if rank == 0:
        print(f"vocab-parallel LCE {shape}: {ms_vp:.2f} ms on {world} GPUs vs {ms_1:.2f} ms on 1; {errors}")


# --- summary --------------------------------------------------------------------------------------


def _loss_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def train_table(record: bench.BenchRecord) -> list[dict[str, object]]:
    rows = {r["provider"]: r for r in record.rows if r["kind"] == "train"}
    one = rows.get("1 gpu fk")
    table = []
    for kind in KINDS:
        stock, fk = rows.get(f"{kind} stock"), rows.get(f"{kind} fk")
        if stock is None or fk is None:
            continue
        line: dict[str, object] = {
            "wrapper": kind, "GPUs": fk["gpus"], "tokens/step": fk["tokens_per_step"],
            "stock tokens/s": stock["tokens_per_s"], "fk tokens/s": fk["tokens_per_s"],
            "fk / stock": fk["tokens_per_s"] / stock["tokens_per_s"],
            "stock MB/GPU": stock["peak_mb"], "fk MB/GPU": fk["peak_mb"],
            "max loss diff fk vs stock": _loss_diff(fk["losses"], stock["losses"]),
        }  # fmt: skip
        if one is not None:
            line["max loss diff fk 2 vs 1 GPU"] = _loss_diff(fk["losses"], one["losses"])
        table.append(line)
    return table


TRAIN_COLUMNS = ["wrapper", "GPUs", "tokens/step", "stock tokens/s", "fk tokens/s", "fk / stock", "stock MB/GPU",
                 "fk MB/GPU", "max loss diff fk vs stock", "max loss diff fk 2 vs 1 GPU"]  # fmt: skip
VOCAB_COLUMNS = ["provider", "gpus", "tokens", "hidden", "vocab", "ms", "peak_mb", "loss_err", "dh_err", "dw_err"]


def summary(record: bench.BenchRecord) -> str:
    """Markdown for docs/benchmarks.md: training (fk / stock: fk's tokens/s over stock's) and the
    vocabulary-parallel loss against one GPU; the per-step losses are in the JSON record."""
    parts = []
    train = train_table(record)
    if train:
        parts.append(bench.markdown_table(train, TRAIN_COLUMNS))
    vocab = [r for r in record.rows if r["kind"] == "vocab"]
    if vocab:
        parts.append(bench.markdown_table(vocab, VOCAB_COLUMNS))
    return "\n\n".join(parts)


# --- main -----------------------------------------------------------------------------------------


def _relaunch_under_torchrun() -> int:
    """Not started by torchrun (``nox -s bench``): start 2 processes with it when 2 GPUs are
    visible, else skip."""
    if torch.cuda.device_count() < 2:
        print("bench_distributed: needs 2 GPUs (or --tiny under torchrun on CPU): skipped")
        return 0
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", __file__, *sys.argv[1:]]
    return subprocess.run(command, check=False).returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--only", choices=("train", "vocab"))
    parser.add_argument("--tiny", action="store_true", help="CPU and gloo, a tiny model: checks every code path")
    parser.add_argument("--batch", type=int, help="sequences per GPU (default 4; tiny 2)")
    parser.add_argument("--seq", type=int, help="tokens per sequence (default 2048; tiny 16)")
    parser.add_argument("--steps", type=int, help="timed steps (default 10; tiny 2)")
    parser.add_argument("--warmup", type=int, help="untimed first steps (default 3; tiny 0)")
    parser.add_argument("--rep", type=int, default=10, help="repetitions of the vocabulary-parallel timing")
    args = parser.parse_args()
    if "RANK" not in os.environ:
        return _relaunch_under_torchrun()
    for key, full, tiny in (("batch", 4, 2), ("seq", 2048, 16), ("steps", 10, 2), ("warmup", 3, 0)):
        if getattr(args, key) is None:
            setattr(args, key, tiny if args.tiny else full)
    if args.tiny:
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    notes = ("bf16 training (FSDP2 MixedPrecisionPolicy bf16/fp32, DDP autocast), AdamW; "
             "vocab: bf16 forward+backward, the same tokens on every GPU")  # fmt: skip
    record = bench.BenchRecord(NAME, notes=notes + ("; TINY CPU CHECK, not a measurement" if args.tiny else ""))
    if not args.tiny and _rank() == 0:
        record.ceilings = bench.measure_ceilings(device).as_dict()
    try:
        if args.only in (None, "train"):
            run_training(record, TINY if args.tiny else LLAMA_1B, device, args)
        if args.only in (None, "vocab"):
            run_vocab_parallel(
                record, TINY_VOCAB_SHAPE if args.tiny else VOCAB_SHAPE, device, 2 if args.tiny else args.rep
            )
        if _rank() == 0:
            path = record.to_json(args.out / (f"{NAME}-tiny.json" if args.tiny else f"{NAME}.json"))
            print(summary(record))
            print(f"written: {path}")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
