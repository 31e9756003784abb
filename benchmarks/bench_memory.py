"""Memory under DeepSpeed ZeRO-3: the longest sequence that trains, and throughput on 2 GPUs.

Two scenarios, each run for the providers of ``bench_e2e.py`` (``stock``; ``liger``: Liger
Kernel's Llama patch before the model is built; ``fk``: ``fk.hf.apply``; ``fk-lowmem``: fk with
``fk.hf.loss_options(memory_budget=384 MiB, accum_dtype=bf16)``), each provider in processes of
its own (``torch.distributed.run``, one process per GPU):

- ``offload`` (the seed scenario): a Llama-3.2-3B-shaped model (``fk.hf.training.SHAPES``: hidden
  3072, 28 layers, vocabulary 128256, tied embeddings; 3.2B parameters, whose fp32 master weights,
  Adam states and gradients take about 16 bytes a parameter of CPU memory), random init, full
  fine-tune, bf16, ZeRO-3 with the optimizer and the parameters offloaded to the CPU, non-reentrant
  gradient checkpointing on every layer, batch 1 per GPU. The longest sequence that trains without
  running out of GPU memory: lengths from ``--start`` (8192) doubling up to ``--max-seq``
  (131072) until one fails, then bisected down to ``--granule`` (2048) tokens; each length trains
  one step, timed (tokens/s over all GPUs; peak ``max_memory_allocated`` over the ranks). A length that runs out
  of memory is caught in the process, which goes on with a shorter one; where it cannot (a rank
  hangs or the engine breaks), the process is started again with what was learned. The search
  stops at ``--budget-s`` seconds a provider: the result is then the longest length that trained,
  with the shortest that failed as its bound (``bounded_by``; none: no length failed).
- ``throughput``: the Llama-3.2-1B shape, ZeRO-3 without offload, bf16, ``--batch`` x ``--seq``
  tokens per GPU, ``--steps`` timed steps after 2, in ``--rounds`` rounds (a process each; even
  rounds in the providers' order, odd ones reversed): tokens/s from the median of all rounds' timed
  steps (and each round's own), peak memory per GPU, and the per-step losses of the first round,
  compared with stock's (bf16 tolerance). On the 2-GPU H200 machine the step is bound by ZeRO-3's
  all-gathers, whose time varies from one process to the next (an fk step measured 254 ms in one
  run and 356 ms in another: ``experiments/INDEX.md#zero3_step_probe``), hence the rounds.

The optimizer is PyTorch's AdamW (DeepSpeed's ``torch_adam``; on the CPU under offload); with
``--cpu-adam``, DeepSpeed's ``DeepSpeedCPUAdam`` (a C++ op DeepSpeed compiles at its first use).

On a GPU machine:  python benchmarks/bench_memory.py --scenario offload --world 1 --out benchmarks/results
                   python benchmarks/bench_memory.py --scenario throughput --world 2 --rounds 2 --merge
Try on a CPU:      python benchmarks/bench_memory.py --tiny --out /tmp/memory   (tiny model, gloo,
                   DeepSpeed's CPU accelerator, Triton's interpreter; ``--simulate-oom-above N``
                   makes lengths above N fail as out of memory, to exercise the search)
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

if not torch.cuda.is_available():  # the --tiny CPU run: fk's kernels in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_e2e import LOSS_TOLERANCE, is_oom, patch_after_build, patch_before_build

from fk.core import bench
from fk.hf import training

NAME = "memory"
PROVIDERS = ("stock", "liger", "fk", "fk-lowmem")
SCENARIOS = ("offload", "throughput")
SHAPE = {"offload": "llama-3.2-3b", "throughput": "llama-3.2-1b"}
COLLECTIVE_TIMEOUT_S = 300
"""A collective that does not pair up (one rank ran out of memory, the other waits) fails after this."""


def next_seq(lo: int | None, hi: int | None, start: int, granule: int, cap: int | None = None) -> int | None:
    """The next length to try, given the longest that trained (``lo``) and the shortest that failed
    (``hi``): ``start`` first, then doubling (up to ``cap``) until one fails, then the midpoint
    rounded to ``granule``; None when ``hi - lo`` is one granule or less, ``cap`` trained, or
    ``start`` already failed."""
    if lo is None:
        return start if hi is None else None
    if hi is None:
        return None if lo == cap else min(2 * lo, cap or 2 * lo)
    mid = (lo + hi) // 2 // granule * granule
    return mid if lo < mid < hi else None


def ds_config(job: dict[str, Any]) -> dict[str, Any]:
    """ZeRO-3, bf16; under ``offload`` the optimizer and the parameters on the CPU."""
    cuda = torch.cuda.is_available()
    zero: dict[str, Any] = {"stage": 3}
    if job["scenario"] == "offload":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": cuda}
        zero["offload_param"] = {"device": "cpu", "pin_memory": cuda}
    params = {"lr": job["lr"], "weight_decay": 0.0, "torch_adam": not job["cpu_adam"]}
    return {
        "train_micro_batch_size_per_gpu": job["batch"], "gradient_accumulation_steps": 1, "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": params}, "zero_force_ds_cpu_optimizer": False,
        "bf16": {"enabled": True}, "steps_per_print": 10**9,
    }  # fmt: skip


# ---------------------------------------------------------------------------------------- the worker


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _max_over_ranks(value: float) -> float:
    import torch.distributed as dist

    t = torch.tensor([value], device="cuda" if torch.cuda.is_available() else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _train_steps(engine: Any, corpus: training.MarkovCorpus, job: dict[str, Any], seq: int, steps: int) -> dict:
    """``steps`` steps of ``job["batch"]`` x ``seq`` tokens per rank: each step's seconds (between
    two synchronizations), loss (rank 0's), and the peak memory over the ranks (GiB, from the
    first step on; None on CPU)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    if job.get("simulate_oom_above") and seq > job["simulate_oom_above"]:
        raise torch.OutOfMemoryError(f"simulated: {seq} > --simulate-oom-above {job['simulate_oom_above']}")
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    seconds, losses, logits = [], [], True
    for step in range(steps):
        rows = corpus.batch(step, job["batch"] * world, seq)[rank * job["batch"] : (rank + 1) * job["batch"]]
        tokens = rows.to(engine.device)
        _sync()
        start = time.perf_counter()
        out = engine(input_ids=tokens, labels=tokens)
        engine.backward(out.loss)
        engine.step()
        losses.append(float(out.loss))
        logits = out.logits is not None
        del out
        _sync()
        seconds.append(_max_over_ranks(time.perf_counter() - start))
    peak = _max_over_ranks(torch.cuda.max_memory_allocated() / 2**30) if torch.cuda.is_available() else None
    return {"seconds": seconds, "losses": losses, "peak_gib": peak, "logits_returned": logits}


def _recover() -> None:
    """After running out of memory mid-step: drop what the failed step left (the caller's frames
    are gone), so that the next, shorter length starts from the same memory."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def worker(job: dict[str, Any], result: Path) -> None:
    """Under ``torch.distributed.run``: build, patch and wrap one provider's model, then run the
    job's scenario. Rank 0 appends one JSON line per event to ``result`` (``trying`` before each
    length, then its outcome), so that the parent knows what a process that died was doing."""
    import deepspeed

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo",
                               timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))  # fmt: skip
    rank = int(os.environ["RANK"])

    def emit(**event: Any) -> None:
        if rank == 0:
            with result.open("a") as f:
                f.write(json.dumps(event) + "\n")

    shape = training.SHAPES[job["shape"]]
    patch_before_build(job["provider"], "llama")
    # (max_positions: the default rotary embedding computes its tables per call, for any length)
    model: Any = training.build_model(shape, dtype=torch.bfloat16, device="cuda" if cuda else "cpu", seed=0,
                                      max_positions=1 << 20)  # fmt: skip
    patched = patch_after_build(job["provider"], model)
    if job["scenario"] == "offload":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine, *_ = deepspeed.initialize(model=model, config=ds_config(job))
    corpus = training.MarkovCorpus(shape.vocab, active=1024 if shape.vocab >= 4096 else 32, branching=4)
    emit(event="ready", patched=patched)
    if job["scenario"] == "throughput":
        out = _train_steps(engine, corpus, job, job["seq"], WARMUP["throughput"] + job["steps"])
        emit(event="throughput", **out)
        return
    lo, hi = job["lo"], job["hi"]
    while time.time() < job["deadline"]:
        seq = next_seq(lo, hi, job["start"], job["granule"], job["max_seq"])
        if seq is None:
            break
        emit(event="trying", seq=seq)
        try:
            out = _train_steps(engine, corpus, job, seq, WARMUP["offload"] + 1)  # (one step)
        except (torch.OutOfMemoryError, RuntimeError) as exc:
            if not is_oom(exc):
                raise
            emit(event="oom", seq=seq, error=str(exc).splitlines()[0][:200])
            hi = seq
            _recover()
            continue
        emit(event="ok", seq=seq, **out)
        lo = seq


# ---------------------------------------------------------------------------------------- the parent


def _launch(job: dict[str, Any], timeout_s: float) -> tuple[list[dict[str, Any]], str | None]:
    """Run :func:`worker` for ``job`` on ``job["world"]`` processes; its events, and why it ended
    early (None: it finished)."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "events.jsonl"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(job["world"]),
               str(Path(__file__).resolve()), "--worker", json.dumps(job), "--result", str(result)]  # fmt: skip
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
            failure = None
            if proc.returncode != 0:
                lines = (proc.stdout + proc.stderr).strip().splitlines()
                errors = [line for line in lines if "Error" in line and "elastic" not in line] or lines[-3:]
                failure = f"exit status {proc.returncode}: {errors[-1][:300]}"
        except subprocess.TimeoutExpired:
            failure = f"timed out after {timeout_s:.0f} s"
        events = [json.loads(line) for line in result.read_text().splitlines()] if result.exists() else []
    return events, failure


def search(base: dict[str, Any], provider: str) -> dict[str, Any]:
    """The ``offload`` scenario for one provider: every length tried, the longest that trained, and
    the tokens/s and peak memory there."""
    deadline = time.time() + base["budget_s"]
    lo = hi = None
    trials: list[dict[str, Any]] = []
    patched, failure = None, None
    while time.time() < deadline and next_seq(lo, hi, base["start"], base["granule"], base["max_seq"]) is not None:
        job = {**base, "provider": provider, "lo": lo, "hi": hi, "deadline": deadline}
        events, failure = _launch(job, deadline - time.time() + 90)
        patched = next((e["patched"] for e in events if e["event"] == "ready"), patched)
        for e in events:
            if e["event"] == "ok":
                lo = e["seq"]
                trials.append({"seq": e["seq"], "status": "ok", **_speed(e, base, e["seq"])})
            elif e["event"] == "oom":
                hi = e["seq"]
                trials.append({"seq": e["seq"], "status": "oom", "error": e["error"]})
        tried = [e["seq"] for e in events if e["event"] == "trying"]
        unfinished = tried[-1] if tried and tried[-1] not in (lo, hi) else None
        if failure is None:
            break
        if failure.startswith("timed out"):  # the budget ran out during a length: not a failure of that length
            if unfinished is not None:
                trials.append({"seq": unfinished, "status": "timeout", "error": failure})
            break
        if unfinished is None:  # it died outside a length: building or wrapping the model, or at its end
            if not trials:
                return {"status": f"failed: {failure}", "trials": trials}
            break
        hi = unfinished  # the process died at this length (out of memory, a hung rank): count it as failed
        trials.append({"seq": unfinished, "status": "oom", "error": f"process ended: {failure[:300]}"})
    best = next((t for t in trials if t["status"] == "ok" and t["seq"] == lo), None)
    return {"status": "ok" if best else "failed: no length trained", "longest_seq": lo, "bounded_by": hi,
            "patched": patched, "trials": trials, **({k: best[k] for k in ("tokens_per_s", "peak_gib")} if best else {})}  # fmt: skip


WARMUP = {"offload": 0, "throughput": 2}
"""Steps before the timed ones, per scenario (offload: each length trains one step, timed: near the
longest length one step of a 3B model takes a minute; the first length absorbs the engine's
first-step work)."""


def _speed(event: dict[str, Any], base: dict[str, Any], seq: int) -> dict[str, Any]:
    """Tokens/s over every GPU from the median timed step of a worker's event, and what else it measured."""
    tokens = base["batch"] * seq * base["world"]
    timed = event["seconds"][WARMUP[base["scenario"]] :]
    return {"tokens_per_s": tokens / statistics.median(timed), "peak_gib": event["peak_gib"],
            "losses": event["losses"], "logits_returned": event["logits_returned"]}  # fmt: skip


def throughput(base: dict[str, Any], provider: str) -> dict[str, Any]:
    """One round of ``provider``'s throughput run: its result, with the timed steps' seconds and the
    tokens a step (over every GPU) for :func:`fk.core.bench.merge_rounds`."""
    events, failure = _launch({**base, "provider": provider}, base["budget_s"] + 120)
    done = next((e for e in events if e["event"] == "throughput"), None)
    if done is None:
        return {"status": f"failed: {failure}"}
    patched = next((e["patched"] for e in events if e["event"] == "ready"), None)
    return {"status": "ok", "patched": patched, **_speed(done, base, base["seq"]),
            "step_seconds": done["seconds"][WARMUP["throughput"] :],
            "tokens_per_step": base["batch"] * base["seq"] * base["world"]}  # fmt: skip


def _one_result(outs: list[dict[str, Any]]) -> dict[str, Any]:
    """A provider's rounds as one result: the first that did not succeed, else (throughput) the
    rounds merged: tokens/s from the median of all their timed steps, and each round's own."""
    failed = next((out for out in outs if out["status"] != "ok"), None)
    if failed is not None or len(outs) == 1:
        return failed or outs[0]
    merged = bench.merge_rounds(outs)
    return {**merged, "rounds": len(outs)}


def run(args: argparse.Namespace) -> bench.BenchRecord:
    record = bench.BenchRecord(NAME, notes=(
        "DeepSpeed ZeRO-3, bf16, random init, providers each in their own processes (one per GPU); "
        f"offload: {SHAPE['offload'] if not args.tiny else 'tiny'} shape, optimizer and parameters offloaded "
        "to the CPU, non-reentrant gradient checkpointing, the row's batch per GPU, lengths from the row's start "
        "doubling up to its max_seq then bisected to its granule tokens, one timed step each, "
        "the row's budget_s seconds a provider; "
        f"throughput: {SHAPE['throughput'] if not args.tiny else 'tiny'} shape, no offload, "
        "the row's batch x seq tokens per GPU, its steps timed steps after 2 in each of its rounds "
        "(alternating order; median of all); "
        f"optimizer: {'DeepSpeedCPUAdam' if args.cpu_adam else 'torch AdamW (torch_adam)'}; "
        "peak: torch.cuda.max_memory_allocated, the largest over the ranks"))  # fmt: skip
    base = {"scenario": args.scenario, "world": args.world, "shape": "tiny" if args.tiny else SHAPE[args.scenario],
            "batch": args.batch, "seq": args.seq, "steps": args.steps, "start": args.start, "granule": args.granule,
            "max_seq": args.max_seq, "budget_s": args.budget_s, "lr": 1e-5, "cpu_adam": args.cpu_adam,
            "simulate_oom_above": args.simulate_oom_above}  # fmt: skip
    outs: dict[str, list[dict[str, Any]]] = {}
    order = bench.round_order(args.providers, args.rounds)  # (throughput: rounds in alternating order)
    for _, provider in bench.progress(order, desc=f"{NAME} {args.scenario} x{args.world}"):
        if provider == "liger" and importlib.util.find_spec("liger_kernel") is None:
            out: dict[str, Any] = {"status": "skipped: liger-kernel is not installed (pip install liger-kernel==0.8.5)"}
        else:
            out = search(base, provider) if args.scenario == "offload" else throughput(base, provider)
        outs.setdefault(provider, []).append(out)
    for provider in args.providers:
        out = _one_result(outs[provider])
        trials = out.pop("trials", [])
        # Each row keeps the settings it ran with: a merged record holds rows of several calls.
        settings = (
            {"budget_s": args.budget_s, "start": args.start, "max_seq": args.max_seq, "granule": args.granule}
            if args.scenario == "offload"
            else {"seq": args.seq, "steps": args.steps, "rounds": args.rounds}
        )
        row = record.add(kind=args.scenario, scenario=args.scenario, world=args.world, provider=provider,
                         model=base["shape"], batch=args.batch, **{**settings, **out})  # fmt: skip
        for trial in trials:
            record.add(kind="trial", scenario=args.scenario, world=args.world, provider=provider, **trial)
        print(f"{provider}: {row['status']}", file=sys.stderr)
    stock = next((r for r in record.rows if r.get("kind") == "throughput" and r["provider"] == "stock"), None)
    for r in record.subset(kind="throughput").rows:
        if stock is not None and "losses" in r and "losses" in stock:
            r["loss_rel_diff"] = bench.max_relative_diff(r["losses"], stock["losses"])
    return record


def _case(row: dict[str, Any]) -> str:
    return f"{row['scenario']} {row['world']} {row['provider']}"


def table(record: bench.BenchRecord) -> list[dict[str, Any]]:
    """One line per (scenario, GPUs, provider), against stock and Liger of the same scenario and GPUs."""
    runs = {(r["scenario"], r["world"], r["provider"]): r for r in record.rows if r.get("kind") in SCENARIOS}
    lines = []
    for (scenario, world, provider), r in runs.items():
        line: dict[str, Any] = {"scenario": scenario, "GPUs": world, "provider": provider}
        if r["status"] != "ok":
            lines.append({**line, "status": bench.status_line(r["status"])})
            continue
        if scenario == "offload":
            bound = f" (< {r['bounded_by']})" if r.get("bounded_by") else " (no length failed)"
            line["longest seq"] = f"{r['longest_seq']}{bound}"
        line.update({"tokens/s": r.get("tokens_per_s"), "peak GiB": r.get("peak_gib")})
        for peer in ("stock", "liger"):
            p = runs.get((scenario, world, peer))
            if peer == provider or p is None or p["status"] != "ok":
                continue
            if scenario == "offload":
                line[f"seq / {peer}"] = r["longest_seq"] / p["longest_seq"]
            else:
                line[f"x {peer}"] = r["tokens_per_s"] / p["tokens_per_s"]
        diff = r.get("loss_rel_diff")
        line["status"] = "LOSS DIFFERS" if diff is not None and diff > LOSS_TOLERANCE else "ok"
        lines.append(line)
    return lines


COLUMNS = ["scenario", "GPUs", "provider", "longest seq", "seq / stock", "seq / liger", "tokens/s", "x stock",
           "x liger", "peak GiB", "status"]  # fmt: skip


def summary(record: bench.BenchRecord) -> str:
    return bench.markdown_table(table(record), COLUMNS, skip_absent=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--scenario", choices=SCENARIOS, default="offload")
    parser.add_argument("--world", type=int, default=1, help="GPUs (processes)")
    parser.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS))
    parser.add_argument("--tiny", action="store_true", help="the tiny model on CPU (or GPU), short lengths")
    parser.add_argument("--batch", type=int, help="sequences per GPU (offload default 1; throughput 4)")
    parser.add_argument("--seq", type=int, help="throughput: tokens per sequence (default 2048; --tiny 32)")
    parser.add_argument("--steps", type=int, help="throughput: timed steps (default 8; --tiny 1)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="throughput: rounds of every provider, a process each, in alternating order")  # fmt: skip
    parser.add_argument("--start", type=int, help="offload: first length tried (default 8192; --tiny 16)")
    parser.add_argument("--granule", type=int, help="offload: bisection resolution (default 2048; --tiny 8)")
    parser.add_argument("--max-seq", type=int, help="offload: longest length tried (default 131072; --tiny 256)")
    parser.add_argument("--budget-s", type=float, default=200.0, help="seconds a provider (the search stops after)")
    parser.add_argument("--cpu-adam", action="store_true", help="DeepSpeedCPUAdam instead of torch's AdamW")
    parser.add_argument("--simulate-oom-above", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--merge", action="store_true", help="keep the other (scenario, GPUs, provider) rows at --out")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker), args.result)
        return 0
    tiny = args.tiny
    defaults = {"batch": (1 if args.scenario == "offload" else 4, 1), "seq": (2048, 32), "steps": (8, 1),
                "start": (8192, 16), "granule": (2048, 8), "max_seq": (131072, 256)}  # fmt: skip
    for name, (default, small) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, small if tiny else default)
    if args.rounds < 1 or (args.rounds > 1 and args.scenario != "throughput"):
        parser.error("--rounds must be >= 1, and more than 1 only with --scenario throughput")
    if args.simulate_oom_above and not tiny:
        parser.error("--simulate-oom-above is for --tiny runs")
    if not torch.cuda.is_available() and not tiny:
        parser.error("the benchmark needs a CUDA GPU; on a CPU run it with --tiny")
    if torch.cuda.is_available() and args.world > torch.cuda.device_count():
        parser.error(f"--world {args.world}: only {torch.cuda.device_count()} GPU(s) visible")
    record = run(args)
    path = args.out / f"{NAME}{'-tiny' if tiny else ''}.json"
    if args.merge and path.exists():
        ran = [f"{args.scenario} {args.world} {p}" for p in args.providers]
        record = bench.merge_records(record, bench.BenchRecord.from_json(path), _case, ran)
    print(f"record: {record.to_json(path)}")
    print(summary(record))
    bad = [line for line in table(record) if line["status"] != "ok" and not line["status"].startswith("skipped")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
