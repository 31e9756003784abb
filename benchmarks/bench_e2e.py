"""End-to-end training: a Llama-3.2-1B-shaped model, stock Hugging Face, Liger Kernel and fk.

The model: ``transformers.LlamaForCausalLM`` shaped like Llama-3.2-1B (hidden 2048, intermediate
8192, 16 layers, 32 query / 8 key-value heads of 64, vocabulary 128256, tied embeddings), random
init (one seed), bf16 weights, SDPA attention, trained on a synthetic Markov-chain corpus
(``fk.hf.training``, shared with the demo) with AdamW (``fused=True``), 4 x 2048 tokens a step.
``--shape`` builds another of ``fk.hf.training.SHAPES`` instead (``llama-3.1-8b``: Llama-3.1-8B's
sizes, untied head) and ``--layers`` another layer count; each row records its shape as ``model``,
and ``--merge`` keeps the rows of other shapes. ``--family`` builds another model type's causal LM
at that shape; a vision-language one of ``fk.hf.vision_language.FAMILIES`` (``gemma3``,
``qwen2_5_vl``) gets its released vision tower and trains with one image in each sequence, about an
eighth of its tokens (``fk.hf.vision_language.image_inputs``; the image out of the loss, counted in
tokens/s).
Four modes: ``full`` (every weight trained), ``lora`` (``peft.get_peft_model``, r=16, alpha=32,
no dropout, on q, k, v, o, gate, up and down projections; PEFT's default fp32 adapters; the base
frozen), ``qlora`` (the same on 4-bit bases: those seven projections of every layer made
bitsandbytes ``Linear4bit``, NF4 in blocks of 64 with nested absmax, bf16 compute, by
``fk.hf.training.quantize_4bit``; the embedding, norms and head bf16; no
``prepare_model_for_kbit_training``, for every provider alike) and ``qlora-recipe`` (QLoRA as PEFT's
and the QLoRA paper's examples train it: the same 4-bit bases, ``prepare_model_for_kbit_training``
casting the embedding, norms and head to fp32, LoRA dropout 0.05, every step's forward under bf16
autocast, as HF Trainer's ``bf16=True`` runs it); ``lora-recipe`` is ``lora`` trained as HF
Trainer's ``bf16=True`` with PEFT's and TRL's LoRA examples train it (the bf16 model, PEFT's fp32
adapters, LoRA dropout 0.05, the forward under bf16 autocast). ``qlora``, ``qlora-recipe`` and
``lora-recipe`` run when asked for (``--modes qlora qlora-recipe lora-recipe``); the default is
``full`` and ``lora``. Providers, each in its own
subprocess (Liger patches transformers' classes globally):

- ``stock``: the model as transformers builds it;
- ``liger``: ``liger_kernel.transformers.apply_liger_kernel_to_llama()`` before the model is built
  (RMSNorm, RoPE, SwiGLU, fused linear cross entropy: its defaults);
- ``fk``: ``fk.hf.apply(model)`` on the built model (on the PEFT model in ``lora`` and ``qlora``
  modes, which fuses the LoRA layers with fk.lora too, on their 4-bit bases in ``qlora`` and
  ``qlora-recipe``);
- ``fk-lowmem``: the same, plus ``fk.hf.loss_options(model, memory_budget=384 << 20,
  accum_dtype=torch.bfloat16)``: the fused loss in chunks of logits, for less memory.

Measured per (mode, provider), in ``--rounds`` rounds: each round runs every provider once, in its
own process, ``--warmup`` steps then ``--steps`` timed ones (each step between two
``torch.cuda.synchronize()``: forward, backward, optimizer step, ``zero_grad``; host overhead
counts, as in training); odd rounds run the providers in reverse order, so that each provider's
runs sit as often early as late in the benchmark (the GPU's clocks and temperature drift over a
run; one round in a fixed order gave records whose ratios moved by several percent). tokens/s is
from the median of all rounds' timed steps; the record keeps each round's tokens/s too, and
per step its time, the host's time to issue it and the garbage collector's in it
(``round_step_ms``, ``round_host_ms``, ``round_gc_ms``). Peak
memory: ``torch.cuda.max_memory_allocated()`` over the timed steps (weights, gradients, optimizer
states and activations), the largest of the rounds. After all rounds, in one more process per
(mode, provider), the largest batch of 2048-token sequences that fits: batch sizes from
``BATCHES`` (above 4) are tried in increasing order, one warm-up and one timed step each, until
one runs out of memory (``torch.OutOfMemoryError``), the list ends, or ``--search-seconds`` have
passed (then the result is a lower bound, marked ``>=``); the allocator's cache is emptied
between sizes. The searches come last so that their large batches heat no timed round. The
per-step losses of each provider (first round) are compared with stock's (same weights and
batches): they must agree to bf16's tolerance (the demo's).

Run on a GPU:  python benchmarks/bench_e2e.py --out benchmarks/results
Redraw plots:  python benchmarks/bench_e2e.py --plot benchmarks/results/e2e.json
Try on a CPU:  python benchmarks/bench_e2e.py --tiny --out /tmp/e2e       (tiny model, Triton's interpreter)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

if not torch.cuda.is_available():  # the --tiny CPU run: fk's kernels in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fk.core import bench
from fk.hf import training
from fk.hf import vision_language as fk_vision_language

NAME = "e2e"
PROVIDERS = ("stock", "liger", "fk", "fk-lowmem")
LOWMEM_LOSS_OPTIONS = {"memory_budget": 384 << 20, "accum_dtype": torch.bfloat16}
"""fk-lowmem: fk with the fused loss in 384 MiB chunks of logits, the head's gradient summed in bf16."""
MODES = ("full", "lora", "qlora", "qlora-recipe", "lora-recipe")
QLORA_MODES = ("qlora", "qlora-recipe")
DEFAULT_MODES = ("full", "lora")
DEFAULT_SHAPE = "llama-3.2-1b"
"""The model's sizes unless ``--shape`` says otherwise (a row without ``model`` ran at it)."""
BATCHES = (4, 6, 8, 12, 16, 20, 24, 32, 40, 48, 64, 80, 96)
"""Batch sizes (sequences of ``--seq`` tokens) the largest-batch search tries, in this order."""
LOSS_TOLERANCE = 2e-2
"""Largest relative difference from stock's per-step loss that counts as agreeing (bf16; see fk.hf.demo)."""
WORKER_TIMEOUT_S = 420


# ---------------------------------------------------------------------------------------- the worker


def patch_before_build(provider: str, family: str) -> None:
    """Liger's patch of ``family``'s classes (its defaults); ``ImportError`` (the run is skipped)
    where Liger has none for the family."""
    if provider == "liger":
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

        if family not in MODEL_TYPE_TO_APPLY_LIGER_FN:
            raise ImportError(f"Liger Kernel has no patch for {family}")
        MODEL_TYPE_TO_APPLY_LIGER_FN[family]()


def patch_after_build(provider: str, model: torch.nn.Module) -> dict[str, int]:
    if not provider.startswith("fk"):
        return {}
    import fk.hf

    counts: dict[str, int] = fk.hf.apply(model)
    if provider == "fk-lowmem":
        fk.hf.loss_options(model, **LOWMEM_LOSS_OPTIONS)
    return counts


def _fallback_log() -> list[str]:
    """Messages fk.lora logs when a LoRA module takes PEFT's path instead of the fused one."""
    import logging

    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    logging.getLogger("fk.lora").addHandler(Collect())
    return messages


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` is running out of GPU memory (the allocator's error, or cuBLAS failing to allocate)."""
    text = str(exc)
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in text.lower() or "ALLOC_FAILED" in text


def search_max_batch(
    model: torch.nn.Module,
    corpus: training.MarkovCorpus,
    opt: torch.optim.Optimizer,
    job: dict[str, Any],
    autocast: torch.dtype | None,
    inputs: Callable[[torch.Tensor], dict[str, torch.Tensor]] | None = None,
) -> tuple[list[dict[str, Any]], str]:
    """Try the batch sizes of :data:`BATCHES` above ``job["batch"]`` in order; the rows of those that
    fit (tokens/s of the second step, peak memory), and why the search stopped: ``"oom"``,
    ``"list"`` (every size fitted) or ``"time"``."""
    rows: list[dict[str, Any]] = []
    start = time.perf_counter()
    for batch in (b for b in BATCHES if b > job["batch"]):
        if time.perf_counter() - start > job["search_seconds"]:
            return rows, "time"
        torch.cuda.empty_cache()
        try:
            r = training.train(model, corpus, steps=2, warmup=1, batch=batch, seq=job["seq"], lr=job["lr"],
                               optimizer=opt, first_step=1000, autocast=autocast, inputs=inputs)  # fmt: skip
        except (torch.OutOfMemoryError, RuntimeError) as exc:
            if not is_oom(exc):
                raise
            opt.zero_grad(set_to_none=True)
            return rows, "oom"
        rows.append({"batch": batch, "tokens_per_s": r.tokens_per_s, "peak_gib": (r.peak_bytes or 0) / 2**30})
    return rows, "list"


def worker(job: dict[str, Any]) -> dict[str, Any]:
    """One (mode, provider): build, patch, then train ``warmup + steps`` steps (``job["phase"]`` is
    ``"timed"``) or search the largest batch (``"search"``)."""
    provider, mode = job["provider"], job["mode"]
    lora, qlora, recipe = mode in ("lora", "lora-recipe", *QLORA_MODES), mode in QLORA_MODES, mode == "qlora-recipe"
    autocast = torch.bfloat16 if mode.endswith("-recipe") else None
    dropout = training.RECIPE_LORA_DROPOUT if mode.endswith("-recipe") else None
    shape = model_shape(job["shape"], job["mode"], job["layers"])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    fallbacks = _fallback_log()
    patch_before_build(provider, job["family"])
    model = training.build_model(shape, dtype=torch.bfloat16, device=device, seed=0, lora=lora,
                                 qlora=qlora, qlora_recipe=recipe, lora_dropout=dropout, max_positions=job["seq"],
                                 model_type=job["family"])  # fmt: skip
    patched = patch_after_build(provider, model)
    corpus = training.MarkovCorpus(shape.vocab, active=1024 if shape.vocab >= 4096 else 32, branching=4)
    opt = training.make_optimizer(model, job["lr"])
    vision_language = job["family"] in fk_vision_language.FAMILIES
    inputs = functools.partial(fk_vision_language.image_inputs, model.config) if vision_language else None
    if job["phase"] == "search":
        rows, stopped = search_max_batch(model, corpus, opt, job, autocast, inputs)
        return {"search": rows, "search_stopped": stopped}
    r = training.train(model, corpus, steps=job["warmup"] + job["steps"], warmup=job["warmup"], batch=job["batch"],
                       seq=job["seq"], lr=job["lr"], optimizer=opt, autocast=autocast, inputs=inputs)  # fmt: skip
    return {
        "losses": r.losses, "step_seconds": r.step_seconds[r.warmup :], "host_seconds": r.host_seconds[r.warmup :],
        "gc_seconds": r.gc_seconds[r.warmup :], "tokens_per_step": r.tokens_per_step,
        "peak_gib": None if r.peak_bytes is None else r.peak_bytes / 2**30, "logits_returned": r.logits_returned,
        "patched": patched, "fallbacks": sorted(set(fallbacks)),
        "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
    }  # fmt: skip


# ---------------------------------------------------------------------------------------- the parent


def _available(provider: str, mode: str) -> str | None:
    """Why ``provider`` cannot run ``mode`` here (a missing package), or None."""
    if provider == "liger" and importlib.util.find_spec("liger_kernel") is None:
        return "liger-kernel is not installed (pip install liger-kernel==0.8.5)"
    if mode in ("lora", "lora-recipe", *QLORA_MODES) and importlib.util.find_spec("peft") is None:
        return "peft is not installed (pip install peft)"
    if mode in QLORA_MODES and importlib.util.find_spec("bitsandbytes") is None:
        return "bitsandbytes is not installed (pip install fk-lora[qlora])"
    return None


def shape_for(shape_name: str, mode: str) -> str:
    """The shape a ``mode`` runs at: ``tiny``'s QLoRA runs at ``tiny-qlora`` (widths that are whole
    4-bit blocks, which bitsandbytes' CPU dequantization needs)."""
    return "tiny-qlora" if shape_name == "tiny" and mode in QLORA_MODES else shape_name


def model_shape(shape_name: str, mode: str, layers: int | None) -> training.ModelShape:
    """The :class:`fk.hf.training.ModelShape` a ``mode`` runs at, with ``layers`` layers if given."""
    shape = training.SHAPES[shape_for(shape_name, mode)]
    return shape if layers is None else dataclasses.replace(shape, layers=layers)


def model_label(shape_name: str, mode: str, layers: int | None) -> str:
    """A row's ``model``: the shape's name, and its layer count where ``--layers`` changed it."""
    name = shape_for(shape_name, mode)
    return name if layers is None else f"{name} ({layers} layers)"


def run(args: argparse.Namespace) -> bench.BenchRecord:
    shape_name = "tiny" if args.tiny else args.shape
    shape = model_shape(shape_name, "full", args.layers)
    base = {"shape": shape_name, "layers": args.layers, "batch": args.batch, "seq": args.seq, "steps": args.steps, "warmup": args.warmup,
            "lr": args.lr, "search_seconds": args.search_seconds}  # fmt: skip
    search = torch.cuda.is_available() and args.search_seconds > 0
    order = [provider for _, provider in bench.round_order(args.providers, args.rounds)]
    cases = [(family, mode) for family in args.family for mode in args.modes]
    jobs = [(family, mode, provider, "timed") for family, mode in cases for provider in order]
    jobs += [(family, mode, provider, "search") for family, mode in cases for provider in args.providers if search]
    timed: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    results: dict[tuple[str, str, str], dict[str, Any]] = {}
    for family, mode, provider, phase in bench.progress(jobs, desc=NAME):
        key = (family, mode, provider)
        earlier = results.get(key, {})
        if "skipped" in earlier or "failed" in earlier:  # no more rounds, no search
            continue
        why = _available(provider, mode)
        job = {**base, "family": family, "mode": mode, "provider": provider, "phase": phase}
        out = {"skipped": why} if why else bench.run_worker(__file__, job, WORKER_TIMEOUT_S)
        if "skipped" in out or "failed" in out:
            results[key] = out
            print(f"{family} {mode} {provider} ({phase}): {bench.worker_status(out)}", file=sys.stderr)
        elif phase == "timed":
            timed.setdefault(key, []).append(out)
            results[key] = bench.merge_rounds(timed[key])
        else:
            results[key].update(out)
    # The parent touches the GPU only now, so the workers had all of its memory.
    record = bench.BenchRecord(
        NAME,
        notes=(f"the causal LM of each family (llama: LlamaForCausalLM) shaped as {shape_name} ({shape.describe()}), random init, bf16 weights, SDPA attention (eager where the family has no SDPA: gpt_oss), "
               f"mixture-of-experts families with the experts of fk.hf.training.MOE_FIELDS (8 experts of intermediate/4; "
               f"gpt_oss and qwen3_moe 2 a token, llama4_text 1 beside its shared expert), "
               f"gemma4_text without per-layer input embeddings and with its own rotary settings (fk.hf.training.FAMILY_FIELDS), "
               f"vision-language families (fk.hf.vision_language.FAMILIES) with their text model of this shape and their released "
               f"vision tower (qwen2_5_vl: Qwen2.5-VL-3B's, 32 blocks of 1280, 3-D rotary sections 1/4, 3/8, 3/8 of half a head; "
               f"gemma3: Gemma 3 4B's SigLIP, 27 blocks of 1152), every weight of both trained, one image a sequence "
               f"(fk.hf.vision_language.image_inputs: at 2048 tokens 256 image tokens, 448 x 448 pixels for qwen2_5_vl, 896 x 896 for gemma3; "
               f"out of the loss, counted in tokens/s), "
               f"AdamW (fused on CUDA), {args.batch} x {args.seq} tokens a step, {args.rounds} rounds of "
               f"{args.steps} timed steps after {args.warmup} (odd rounds in reverse provider order), tokens/s "
               f"from the median of all timed steps; lora: PEFT r=16, alpha=32, q/k/v/o/gate/up/down, fp32 adapters; "
               f"qlora: the same on bitsandbytes NF4 bases (blocksize 64, nested absmax, bf16 compute); "
               f"qlora-recipe: qlora after peft.prepare_model_for_kbit_training (embedding, norms, head fp32), "
               f"LoRA dropout {training.RECIPE_LORA_DROPOUT}, the forward under bf16 autocast; "
               f"lora-recipe: lora with LoRA dropout {training.RECIPE_LORA_DROPOUT}, the forward under bf16 autocast; "
               f"peak memory: torch.cuda.max_memory_allocated; max batch: sizes {', '.join(map(str, BATCHES))} "
               f"of {args.seq} tokens tried in order in one more process after the rounds"),
    )  # fmt: skip
    if torch.cuda.is_available() and not args.tiny:
        record.ceilings = bench.measure_ceilings().as_dict()
    for family, mode, provider in dict.fromkeys((family, mode, provider) for family, mode, provider, _ in jobs):
        out = results[family, mode, provider]
        common = {
            "family": family,
            "mode": mode,
            "provider": provider,
            "model": model_label(shape_name, mode, args.layers),
            "seq": args.seq,
        }
        if "skipped" in out or "failed" in out:
            record.add(kind="run", **common, batch=args.batch, status=bench.worker_status(out))
            continue
        stock = results.get((family, mode, "stock"), {}).get("losses")
        largest = max(out.get("search", []), key=lambda row: row["batch"], default=None)
        record.add(
            kind="run", **common, batch=args.batch, status="ok", tokens_per_s=out["tokens_per_s"],
            round_tokens_per_s=out["round_tokens_per_s"], round_step_ms=out["round_step_ms"],
            round_host_ms=out["round_host_ms"], round_gc_ms=out["round_gc_ms"],
            median_step_ms=out["median_step_ms"],
            peak_gib=out["peak_gib"], losses=out["losses"],
            loss_rel_diff=bench.max_relative_diff(out["losses"], stock), logits_returned=out["logits_returned"],
            patched=out["patched"], fallbacks=out["fallbacks"], trainable_params=out["trainable_params"],
            max_batch=(largest or {"batch": args.batch})["batch"] if "search" in out else None,
            max_batch_tokens_per_s=(largest or out)["tokens_per_s"] if "search" in out else None,
            search_stopped=out.get("search_stopped"),
        )  # fmt: skip
        record.add(kind="batch", **common, batch=args.batch, tokens_per_s=out["tokens_per_s"], peak_gib=out["peak_gib"])
        for row in out.get("search", []):
            record.add(kind="batch", **common, **row)
    return record


def _case(row: dict[str, Any]) -> tuple[str, ...]:
    """A row's (family, mode), and ``at <model>`` for a model other than :data:`DEFAULT_SHAPE`; rows
    of records from before ``--family`` are Llama's, from before ``--shape`` at the default shape."""
    family, mode, model = row.get("family", "llama"), row["mode"], row.get("model", DEFAULT_SHAPE)
    return (family, mode) if model == DEFAULT_SHAPE else (family, mode, f"at {model}")


def merge_record(
    new: bench.BenchRecord, old: bench.BenchRecord, modes: list[str], families: tuple[str, ...] = ("llama",),
    shape_name: str = DEFAULT_SHAPE, layers: int | None = None,
) -> bench.BenchRecord:  # fmt: skip
    """``new`` with the rows of ``old`` whose (family, mode, model) it did not run
    (:func:`fk.core.bench.merge_records`)."""
    ran = {" ".join(_case({"family": f, "mode": m, "model": model_label(shape_name, m, layers)}))
           for f in families for m in modes}  # fmt: skip
    return bench.merge_records(new, old, lambda row: " ".join(_case(row)), ran)


# ------------------------------------------------------------------------------------------- output


def table(record: bench.BenchRecord) -> list[dict[str, Any]]:
    """One line per (family, mode, provider): speed and memory, against stock and Liger of the same
    family and mode."""
    runs = {(_case(r), r["provider"]): r for r in record.rows if r.get("kind") == "run"}
    lines = []
    for (case, provider), r in runs.items():
        line: dict[str, Any] = {"family": case[0], "model": r.get("model", DEFAULT_SHAPE), "mode": case[1],
                                "provider": provider}  # fmt: skip
        if r.get("status") != "ok":
            line["status"] = bench.status_line(r.get("status", ""))
            lines.append(line)
            continue
        line.update({"tokens/s": r["tokens_per_s"], "peak GiB": r["peak_gib"]})
        for peer in ("stock", "liger"):
            p = runs.get((case, peer))
            if peer != provider and p is not None and p.get("status") == "ok":
                line[f"x {peer}"] = r["tokens_per_s"] / p["tokens_per_s"]
                if r["peak_gib"] and p["peak_gib"]:
                    line[f"memory / {peer}"] = r["peak_gib"] / p["peak_gib"]
        if r.get("max_batch") is not None:
            bound = ">=" if r.get("search_stopped") in ("time", "list") else ""
            line["max batch"] = f"{bound}{r['max_batch']}"
            line["tokens/s at max batch"] = r.get("max_batch_tokens_per_s")
        diff = r.get("loss_rel_diff")
        line["loss vs stock"] = None if provider == "stock" else diff
        line["status"] = "ok" if diff is None or diff <= LOSS_TOLERANCE else "LOSS DIFFERS"
        lines.append(line)
    return lines


COLUMNS = ["family", "model", "mode", "provider", "tokens/s", "x stock", "x liger", "peak GiB", "memory / stock", "memory / liger",
           "max batch", "tokens/s at max batch", "loss vs stock", "status"]  # fmt: skip


def summary(record: bench.BenchRecord) -> str:
    """Markdown for docs/benchmarks.md ("x peer": tokens/s over the peer's; "loss vs stock": the
    largest relative difference of a step's loss)."""
    return bench.markdown_table(table(record), COLUMNS)


def plots(record: bench.BenchRecord, out: Path) -> list[Path]:
    """Tokens/s and peak memory against the batch size, per provider, one panel per mode: each line
    ends at the largest batch that fitted."""
    batches = record.subset(kind="batch")
    batches.rows = [
        r for r in batches.rows if _case(r)[0] == "llama" and len(_case(r)) == 2
    ]  # Llama at the default shape
    if not batches.rows:
        return []
    gpu = record.environment.get("gpu")
    drawn = [bench.plot(batches, x="batch", y="tokens_per_s", facet="mode", path=out / f"{NAME}_tokens_per_s.png",
                        title=f"Llama-3.2-1B shape, training tokens/s by batch ({gpu})", ylabel="tokens/s")]  # fmt: skip
    if any(r.get("peak_gib") is not None for r in batches.rows):  # CUDA only
        drawn.append(bench.plot(batches, x="batch", y="peak_gib", facet="mode", path=out / f"{NAME}_memory.png",
                                title=f"Llama-3.2-1B shape, peak memory by batch ({gpu})", ylabel="GiB (max allocated)"))  # fmt: skip
    return drawn


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--plot", type=Path, help="only redraw the plots (and print the table) from this JSON record")
    parser.add_argument("--plot-dir", type=Path, default=Path("docs/assets/benchmarks"))
    parser.add_argument("--tiny", action="store_true", help="the tiny model, 2 x 32 tokens, 2 steps (CPU allowed)")
    parser.add_argument("--shape", choices=[n for n in training.SHAPES if not n.startswith("tiny")], default=DEFAULT_SHAPE,
                        help=f"the model's sizes (fk.hf.training.SHAPES; default {DEFAULT_SHAPE})")  # fmt: skip
    parser.add_argument("--layers", type=int, help="build the shape with this many layers (default: the shape's)")
    bench.add_round_options(parser, PROVIDERS)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(DEFAULT_MODES))
    parser.add_argument("--batch", type=int, help="sequences per step (default 4; --tiny 2)")
    parser.add_argument("--seq", type=int, help="tokens per sequence (default 2048; --tiny 32)")
    parser.add_argument("--search-seconds", type=float, default=45.0,
                        help="time for the largest-batch search per provider and mode (0: no search)")  # fmt: skip
    parser.add_argument("--family", nargs="+", default=["llama"],
                        help="model types to build with the benchmark's shape (default llama; Liger runs where it has a patch)")  # fmt: skip
    args = parser.parse_args()
    if args.worker:
        bench.worker_main(worker, args.worker, args.result)
        return 0
    if args.plot:
        record = bench.BenchRecord.from_json(args.plot)
        plots(record, args.plot_dir)
        print(summary(record))
        return 0
    bench.fill_defaults(args, {**bench.ROUND_DEFAULTS, "batch": (4, 2), "seq": (2048, 32)})
    if not torch.cuda.is_available() and not args.tiny:
        parser.error("the benchmark needs a CUDA GPU; on a CPU run it with --tiny")
    record = run(args)
    if args.merge and (args.out / f"{NAME}.json").exists():
        old = bench.BenchRecord.from_json(args.out / f"{NAME}.json")
        shape_name = "tiny" if args.tiny else args.shape
        record = merge_record(record, old, args.modes, tuple(args.family), shape_name, args.layers)
    path = record.to_json(args.out / f"{NAME}.json")
    print(f"record: {path}")
    try:
        drawn = plots(record, args.plot_dir if not args.tiny else args.out)
        print("plots: " + ", ".join(map(str, drawn)) if drawn else "no plots: nothing was measured")
    except ImportError:
        print("matplotlib is not installed: no plots")
    print(summary(record))
    bad = [r for r in table(record) if r["status"] == "LOSS DIFFERS" or r["status"].startswith("failed")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
