"""End-to-end DPO, KTO, GRPO and RLOO through TRL: stock, TRL with ``use_liger_kernel=True``, and fk.

The model: bench_e2e.py's (``fk.hf.training``): a ``LlamaForCausalLM`` shaped like Llama-3.2-1B
(hidden 2048, 16 layers, vocabulary 128256, tied embeddings), random init (seed 0), bf16 weights,
SDPA attention; the tokenizer ``fk.hf.training.word_tokenizer`` over its whole vocabulary (text of
``n`` words is ``n`` tokens; nothing is downloaded). The data: random words (one seed), every
prompt and completion of the same length. TRL's defaults otherwise (bf16 autocast, gradient
checkpointing, AdamW), except the learning rate (``--lr``, as bench_e2e.py) and one log a step.

- ``dpo``: ``trl.DPOTrainer``, its default loss (``sigmoid``, beta 0.1), a reference model of the
  same weights (a second copy, run without gradient every step); a step: 2 pairs of a 512-token
  prompt and two 1536-token answers (4 sequences of 2048 tokens; 6144 of the 8192 scored);
- ``kto``: ``trl.KTOTrainer``, its default loss (``kto``, beta 0.1, with its KL estimate), a
  reference copy as DPO's; a step: 4 sequences of a 512-token prompt and a 1536-token completion,
  desirable and undesirable in turn (8192 tokens, 6144 scored), and TRL's 4 mismatched KL
  sequences, whose log-probabilities the policy and the reference compute without gradient;
- ``grpo``: ``trl.GRPOTrainer``, its default loss (``dapo``, no KL term); a step: 2 prompts of 896
  tokens, 8 completions each (TRL's default) sampled by ``model.generate`` (TRL's transformers
  path: temperature 1, no top-k or top-p) to exactly 128 tokens (``min_new_tokens``), scored by a
  reward that differs within a group (the share of even token ids): 16,384 tokens, 2048 of them
  scored. The completions are short so that generation, a few hundred small kernels a token,
  stays a minority of the step;
- ``rloo``: ``trl.RLOOTrainer``, its loss (the clipped ratio of each completion's log-probability)
  with beta 0 (no KL penalty in the reward, so no reference model: TRL builds one from a model path,
  which this in-memory model has not); a step as GRPO's.

:data:`SIZES` holds these; ``--tiny`` takes :data:`TINY_SIZES` and the tiny model.

Providers, each in its own process:

- ``stock``: TRL as it is: its loss on its own fused LM head (per-token log-probabilities in chunks,
  without the full logits);
- ``liger``: the same with ``use_liger_kernel=True``. In TRL 1.16 that is Liger's RMSNorm, RoPE and
  SwiGLU on the policy (transformers' ``apply_liger_kernel`` when training starts); the loss stays
  TRL's, which refuses Liger's fused linear cross entropy for these trainers and calls no Liger
  loss. The worker checks that Liger's modules are in place after training;
- ``fk``: ``fk.hf.align_trainer(trainer)``: the policy patched by ``fk.hf.apply``, the loss computed
  by ``fk.align.fused_linear_dpo_loss`` / ``fused_linear_kto_loss`` / ``fused_linear_grpo_loss`` /
  ``fused_linear_rloo_loss`` on the fused head. The worker
  checks that fk's loss computed every step's loss (a count of its calls with gradient).

Measured per (trainer, provider), as bench_e2e.py does (``fk.core.bench.run_worker``,
``round_order``, ``merge_rounds``): ``--rounds`` rounds, odd ones in reverse provider order, each
``--warmup`` steps then ``--steps`` timed ones; a step is timed between two synchronizations, from
the Trainer's ``on_step_begin`` to its ``on_step_end`` (for GRPO and RLOO the generation and scoring,
then forward, backward, optimizer step); tokens/s from the median of all rounds' timed steps, its
tokens TRL's count (DPO: the Trainer's non-padding ``num_input_tokens_seen``; GRPO and RLOO: prompt
and completion tokens; KTO: as DPO); peak memory ``torch.cuda.max_memory_allocated`` over the timed
steps. For GRPO and RLOO, the
generation and scoring (TRL's ``_generate_and_score_completions``, timed between synchronizations)
are also left out, giving the training part alone: ``train tokens/s`` (the same tokens over the
median step without them) and its ``train peak`` (the peak counter reset when they end). DPO's and
KTO's first-step losses are compared with stock's (:data:`FIRST_LOSS_TOLERANCE`): the same weights,
batch and reference. Later steps are recorded, not compared: from random init at this learning rate a
step's bf16 rounding changes the next steps' losses by tens of percent, for Liger as for fk. GRPO's
and RLOO's are not comparable: each provider samples its own completions (the patched kernels round
differently in bf16, and one changed probability changes the samples).

Run on a GPU:  python benchmarks/bench_align_e2e.py --out benchmarks/results
Try on a CPU:  python benchmarks/bench_align_e2e.py --tiny --out /tmp/align_e2e   (tiny model, Triton's interpreter)
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

if not torch.cuda.is_available():  # the --tiny CPU run: fk's kernels in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fk.core import bench
from fk.hf import training

NAME = "align_e2e"
PROVIDERS = ("stock", "liger", "fk")
TRAINERS = ("dpo", "kto", "grpo", "rloo")
PREFERENCE = ("dpo", "kto")
"""The trainers with a reference copy of the policy, whose first-step losses are compared."""
GENERATING = ("grpo", "rloo")
"""The trainers that sample their completions each step: compared by the step's training part."""
FIRST_LOSS_TOLERANCE = 0.1
"""Largest absolute difference from stock's first DPO (KTO) loss that counts as agreeing. Stock's
is log 2 (KTO's 1/2): policy and reference are one model; another provider's moves by beta/2
(beta/4) times the margin its kernels' bf16 rounding puts between policy and reference, a sum over
the 3072 scored tokens of differences of ~0.01 nats each (~0.5 at random signs: ~0.03 at beta
0.1). An error in the loss (a token shifted, a sum or a sign wrong) moves the margin by hundreds
of nats."""
WORKER_TIMEOUT_S = 300
FK_LOSSES = {"dpo": "fused_linear_dpo_loss", "kto": "fused_linear_kto_loss", "grpo": "fused_linear_grpo_loss",
             "rloo": "fused_linear_rloo_loss"}  # fmt: skip
"""The fk.align function that computes each trainer's loss under fk."""


class Sizes(NamedTuple):
    """The lengths and batch of one trainer's steps."""

    prompt: int  # tokens of a prompt
    completion: int  # tokens of a completion (DPO: of the chosen one, and of the rejected one)
    batch: int  # DPO: pairs a step (two sequences each); KTO: sequences a step; GRPO, RLOO: completions a step
    generations: int = 1  # GRPO, RLOO: completions of a prompt (GRPO's default num_generations is 8)


SIZES = {
    "dpo": Sizes(prompt=512, completion=1536, batch=2),
    "kto": Sizes(prompt=512, completion=1536, batch=4),
    "grpo": Sizes(prompt=896, completion=128, batch=16, generations=8),
    "rloo": Sizes(prompt=896, completion=128, batch=16, generations=8),
}
TINY_SIZES = {
    "dpo": Sizes(prompt=4, completion=12, batch=1),
    "kto": Sizes(prompt=4, completion=12, batch=2),
    "grpo": Sizes(prompt=6, completion=4, batch=4, generations=2),
    "rloo": Sizes(prompt=6, completion=4, batch=4, generations=2),
}
"""Few tokens: each of fk's kernel launches runs one program per row in Triton's interpreter."""


# ---------------------------------------------------------------------------------------- the worker


class StepClock:
    """Times each training step and, within it, the generation and scoring; peak memory of the
    timed steps, and of their part without generation (CUDA only). Steps before ``warmup`` are not
    kept."""

    def __init__(self, warmup: int, tokens_seen: Callable[[], int]) -> None:
        self.warmup, self.tokens_seen = warmup, tokens_seen
        self.cuda = torch.cuda.is_available()
        self.step_seconds: list[float] = []
        self.generation_seconds: list[float] = []
        self.tokens: list[int] = []
        self.peak = self.train_peak = 0
        self._start = self._generation = 0.0
        self._seen = 0
        self._step = 0

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def begin(self) -> None:
        self._sync()
        if self.cuda and self._step == self.warmup:
            torch.cuda.reset_peak_memory_stats()
        self._generation = 0.0
        self._start = time.perf_counter()

    def end(self) -> None:
        self._sync()
        seconds = time.perf_counter() - self._start
        seen = self.tokens_seen()
        if self._step >= self.warmup:
            self.step_seconds.append(seconds)
            self.generation_seconds.append(self._generation)
            self.tokens.append(seen - self._seen)
            if self.cuda:
                self.train_peak = max(self.train_peak, torch.cuda.max_memory_allocated())
                self.peak = max(self.peak, self.train_peak)
        self._seen = seen
        self._step += 1

    def timed_generation(self, generate: Callable[..., Any]) -> Callable[..., Any]:
        """``generate`` timed between synchronizations; its peak memory goes into the step's, and
        the counter restarts after it for the training part's."""

        def timed(*args: Any, **kwargs: Any) -> Any:
            self._sync()
            start = time.perf_counter()
            out = generate(*args, **kwargs)
            self._sync()
            self._generation += time.perf_counter() - start
            if self.cuda and self._step >= self.warmup:
                self.peak = max(self.peak, torch.cuda.max_memory_allocated())
                torch.cuda.reset_peak_memory_stats()
            return out

        return timed


def _callback(clock: StepClock) -> Any:
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            clock.begin()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            clock.end()

    return Clock()


def even_token_share(completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    """GRPO's and RLOO's reward: the share of even token ids in each completion (it differs within a group)."""
    return [sum(1 - token % 2 for token in ids) / max(len(ids), 1) for ids in completion_ids]


def _words(gen: torch.Generator, vocab: int, n: int) -> str:
    """``n`` random words of :func:`fk.hf.training.word_tokenizer` (no special token among them)."""
    return " ".join(f"t{int(i)}" for i in torch.randint(3, vocab, (n,), generator=gen))


def _dataset(trainer: str, vocab: int, rows: int, prompt: int, completion: int) -> Any:
    import datasets

    gen = torch.Generator().manual_seed(1)
    if trainer == "dpo":
        columns = {"prompt": [], "chosen": [], "rejected": []}
        for _ in range(rows):
            columns["prompt"].append(_words(gen, vocab, prompt))
            columns["chosen"].append(_words(gen, vocab, completion))
            columns["rejected"].append(_words(gen, vocab, completion))
        return datasets.Dataset.from_dict(columns)
    if trainer == "kto":  # desirable and undesirable in turn
        return datasets.Dataset.from_dict({
            "prompt": [_words(gen, vocab, prompt) for _ in range(rows)],
            "completion": [_words(gen, vocab, completion) for _ in range(rows)],
            "label": [i % 2 == 0 for i in range(rows)],
        })  # fmt: skip
    return datasets.Dataset.from_dict({"prompt": [_words(gen, vocab, prompt) for _ in range(rows)]})


def liger_modules(model: torch.nn.Module) -> dict[str, int]:
    """How many modules of ``model`` run a Liger Kernel forward, by Liger's class (its instance
    patch binds ``forward`` on each module), and ``rope``: 1 where transformers' Llama calls
    Liger's rotary function."""
    counts: dict[str, int] = {}
    for module in model.modules():
        forward = module.__dict__.get("forward")
        func = getattr(forward, "__func__", forward)
        if func is not None and getattr(func, "__module__", "").startswith("liger_kernel"):
            name = func.__qualname__.split(".")[0]
            counts[name] = counts.get(name, 0) + 1
    from transformers.models.llama import modeling_llama

    counts["rope"] = int(modeling_llama.apply_rotary_pos_emb.__module__.startswith("liger_kernel"))
    return counts


def _count_calls(module: Any, name: str) -> list[int]:
    """Count the calls of ``module.name`` made with gradient enabled (training steps)."""
    calls = [0]
    fn = getattr(module, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            calls[0] += 1
        return fn(*args, **kwargs)

    setattr(module, name, counted)
    return calls


def _trainer(job: dict[str, Any], model: torch.nn.Module, output_dir: str) -> Any:
    """TRL's trainer for ``job`` (its data, config and, for DPO and KTO, a reference copy of the model)."""
    import trl

    kind, shape = job["trainer"], training.SHAPES[job["shape"]]
    prompt, completion, batch = job["prompt"], job["completion"], job["batch"]
    steps = job["warmup"] + job["steps"]
    cuda = torch.cuda.is_available()
    common = dict(
        output_dir=output_dir, per_device_train_batch_size=batch, max_steps=steps, learning_rate=job["lr"],
        logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True, seed=0, use_cpu=not cuda,
        use_liger_kernel=job["provider"] == "liger", dataloader_num_workers=0,
    )  # fmt: skip
    tokenizer = training.word_tokenizer(shape.vocab)
    if kind in PREFERENCE:
        reference = training.build_model(shape, dtype=torch.bfloat16, device=model.device, seed=0,
                                         max_positions=prompt + completion + 8)  # fmt: skip
        data = _dataset(kind, shape.vocab, steps * batch, prompt, completion)
        config_class, trainer_class = (trl.DPOConfig, trl.DPOTrainer) if kind == "dpo" else (trl.KTOConfig,
                                                                                            trl.KTOTrainer)  # fmt: skip
        config = config_class(**common, max_length=None, include_num_input_tokens_seen="non_padding")
        return trainer_class(model=model, ref_model=reference.eval(), args=config, train_dataset=data,
                             processing_class=tokenizer)  # fmt: skip
    config_class, trainer_class = (trl.GRPOConfig, trl.GRPOTrainer) if kind == "grpo" else (trl.RLOOConfig,
                                                                                             trl.RLOOTrainer)  # fmt: skip
    config = config_class(**common, num_generations=job["generations"], max_completion_length=completion,
                          generation_kwargs={"min_new_tokens": completion}, beta=0.0)  # fmt: skip
    data = _dataset(kind, shape.vocab, steps * batch // job["generations"], prompt, completion)
    return trainer_class(model=model, reward_funcs=even_token_share, args=config, train_dataset=data,
                         processing_class=tokenizer)  # fmt: skip


def worker(job: dict[str, Any]) -> dict[str, Any]:
    """One (trainer, provider): build the model and TRL's trainer, take fk's loss for ``fk``,
    train ``warmup + steps`` steps, and check that the provider's kernels did the work."""
    import fk.align
    import fk.hf

    if job["provider"] == "liger" and importlib.util.find_spec("liger_kernel") is None:
        raise ImportError("liger-kernel is not installed (pip install liger-kernel==0.8.5)")
    kind, provider = job["trainer"], job["provider"]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = training.SHAPES[job["shape"]]
    model = training.build_model(shape, dtype=torch.bfloat16, device=device, seed=0,
                                 max_positions=job["prompt"] + job["completion"] + 8)  # fmt: skip
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = _trainer(job, model, output_dir)
        if provider == "fk":
            fk.hf.align_trainer(trainer)
            if trainer.__dict__.get("_fk_align") != kind:
                raise RuntimeError(f"fk.hf.align_trainer left {type(trainer).__name__}'s loss stock (see its warning)")
        calls = _count_calls(fk.align, FK_LOSSES[kind])
        clock = StepClock(job["warmup"], lambda: int(trainer.state.num_input_tokens_seen))
        trainer.add_callback(_callback(clock))
        if kind in GENERATING:
            trainer._generate_and_score_completions = clock.timed_generation(trainer._generate_and_score_completions)
        trainer.train()
    steps = job["warmup"] + job["steps"]
    if calls[0] != (steps if provider == "fk" else 0):
        raise RuntimeError(f"{FK_LOSSES[kind]} computed {calls[0]} of {steps} steps' losses under {provider}")
    liger = liger_modules(trainer.model)
    if (provider == "liger") != any(liger.values()):
        raise RuntimeError(f"Liger Kernel's modules under {provider}: {liger}")
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    train_seconds = [s - g for s, g in zip(clock.step_seconds, clock.generation_seconds, strict=True)]
    gib = (lambda b: b / 2**30) if clock.cuda else (lambda b: None)
    return {
        "losses": losses, "step_seconds": clock.step_seconds, "train_seconds": train_seconds,
        "generation_seconds": clock.generation_seconds, "tokens_per_step": statistics.mean(clock.tokens),
        "peak_gib": gib(clock.peak), "train_peak_gib": gib(clock.train_peak),
        "fk_loss_calls": calls[0], "liger_modules": {k: v for k, v in liger.items() if v},
        "patched": {k: v for k, v in fk.hf.patched_modules(trainer.model).items() if v},
    }  # fmt: skip


# ---------------------------------------------------------------------------------------- the parent


def merge_trainer_rounds(outs: list[dict[str, Any]]) -> dict[str, Any]:
    """:func:`fk.core.bench.merge_rounds` of the whole steps, and of their training part alone
    (``train_*``: the steps without generation and scoring, their peak)."""
    merged = bench.merge_rounds(outs)
    train = bench.merge_rounds([{**out, "step_seconds": out["train_seconds"], "peak_gib": out["train_peak_gib"]}
                                for out in outs])  # fmt: skip
    for name in ("tokens_per_s", "median_step_ms", "peak_gib", "round_tokens_per_s"):
        merged[f"train_{name}"] = train[name]
    generation = sum(sum(out["generation_seconds"]) for out in outs)
    merged["generation_share"] = generation / sum(sum(out["step_seconds"]) for out in outs)
    return merged


def run(args: argparse.Namespace) -> bench.BenchRecord:
    shape_name = "tiny" if args.tiny else "llama-3.2-1b"
    shape = training.SHAPES[shape_name]
    order = [provider for _, provider in bench.round_order(args.providers, args.rounds)]
    jobs = [(kind, provider) for kind in args.trainers for provider in order]
    timed: dict[tuple[str, str], list[dict[str, Any]]] = {}
    results: dict[tuple[str, str], dict[str, Any]] = {}
    for kind, provider in bench.progress(jobs, desc=NAME):
        key = (kind, provider)
        if "skipped" in results.get(key, {}) or "failed" in results.get(key, {}):  # no more rounds
            continue
        job = {"trainer": kind, "provider": provider, "shape": shape_name, "steps": args.steps, "warmup": args.warmup,
               "lr": args.lr, **args.sizes[kind]._asdict()}  # fmt: skip
        out = bench.run_worker(__file__, job, WORKER_TIMEOUT_S)
        if "skipped" in out or "failed" in out:
            results[key] = out
            print(f"{kind} {provider}: {bench.worker_status(out)}", file=sys.stderr)
        else:
            timed.setdefault(key, []).append(out)
            results[key] = merge_trainer_rounds(timed[key])
    sizes = "; ".join(f"{kind}: {', '.join(f'{k} {v}' for k, v in args.sizes[kind]._asdict().items())}"
                      for kind in TRAINERS)  # fmt: skip
    notes = [
        "TRL's DPOTrainer (loss sigmoid, a reference copy of the policy), KTOTrainer (loss kto with its KL "
        "estimate, a reference copy), GRPOTrainer (loss dapo, beta 0, completions sampled by model.generate to "
        "exactly the completion length) and RLOOTrainer (beta 0, completions as GRPO's)",
        f"LlamaForCausalLM shaped as {shape_name} ({shape.describe()}), random init, bf16 weights, SDPA attention",
        f"TRL's defaults (bf16 autocast, gradient checkpointing, AdamW) but lr {args.lr} and a log a step",
        f"{sizes} (DPO's batch: pairs; KTO's: sequences; GRPO's and RLOO's: completions)",
        f"{args.rounds} rounds of {args.steps} timed steps after {args.warmup}, odd rounds in reverse provider order",
        "tokens/s: TRL's token count over the median of all timed steps; GRPO's and RLOO's train tokens/s and train peak: "
        "without the generation and scoring",
        "liger: use_liger_kernel=True (Liger's RMSNorm, RoPE and SwiGLU; TRL's own loss); fk: fk.hf.align_trainer",
        "peak memory: torch.cuda.max_memory_allocated",
    ]
    record = bench.BenchRecord(NAME, notes="; ".join(notes))
    if torch.cuda.is_available() and not args.tiny:
        record.ceilings = bench.measure_ceilings().as_dict()
    for kind, provider in dict.fromkeys(jobs):
        out = results[kind, provider]
        common = {"trainer": kind, "provider": provider, "model": shape_name, **args.sizes[kind]._asdict()}
        if "skipped" in out or "failed" in out:
            record.add(**common, status=bench.worker_status(out))
            continue
        stock = results.get((kind, "stock"), {}).get("losses")
        record.add(
            **common, status="ok", tokens_per_step=out["tokens_per_step"], tokens_per_s=out["tokens_per_s"],
            round_tokens_per_s=out["round_tokens_per_s"], median_step_ms=out["median_step_ms"], peak_gib=out["peak_gib"],
            train_tokens_per_s=out["train_tokens_per_s"], train_median_step_ms=out["train_median_step_ms"],
            train_peak_gib=out["train_peak_gib"], generation_share=out["generation_share"], losses=out["losses"],
            first_loss_diff=abs(out["losses"][0] - stock[0]) if kind in PREFERENCE and stock else None,
            fk_loss_calls=out["fk_loss_calls"], liger_modules=out["liger_modules"], patched=out["patched"],
        )  # fmt: skip
    return record


def merge_record(new: bench.BenchRecord, old: bench.BenchRecord, trainers: list[str]) -> bench.BenchRecord:
    """``new`` with the rows of ``old`` of the trainers it did not run (:func:`fk.core.bench.merge_records`)."""
    return bench.merge_records(new, old, lambda row: row["trainer"], trainers)


# ------------------------------------------------------------------------------------------- output


def table(record: bench.BenchRecord) -> list[dict[str, Any]]:
    """One line per (trainer, provider): speed and memory, against stock and Liger of the same trainer."""
    runs = {(r["trainer"], r["provider"]): r for r in record.rows}
    lines = []
    for (kind, provider), r in runs.items():
        line: dict[str, Any] = {"trainer": kind, "provider": provider}
        if r.get("status") != "ok":
            line["status"] = bench.status_line(r.get("status", ""))
            lines.append(line)
            continue
        line.update({"tokens/s": r["tokens_per_s"], "peak GiB": r["peak_gib"]})
        if kind in GENERATING:
            line.update({"train tokens/s": r["train_tokens_per_s"], "train peak GiB": r["train_peak_gib"],
                         "generation share": r["generation_share"]})  # fmt: skip
        for peer in ("stock", "liger"):
            p = runs.get((kind, peer))
            if peer == provider or p is None or p.get("status") != "ok":
                continue
            speed = "train_tokens_per_s" if kind in GENERATING else "tokens_per_s"
            line[f"x {peer}"] = r[speed] / p[speed]
            if r["peak_gib"] and p["peak_gib"]:
                line[f"memory / {peer}"] = r["peak_gib"] / p["peak_gib"]
        diff = r.get("first_loss_diff")
        line["first loss"] = r["losses"][0] if kind in PREFERENCE and r.get("losses") else None
        line["first loss vs stock"] = None if provider == "stock" else diff
        line["status"] = "ok" if diff is None or diff <= FIRST_LOSS_TOLERANCE else "LOSS DIFFERS"
        lines.append(line)
    return lines


COLUMNS = ["trainer", "provider", "tokens/s", "train tokens/s", "generation share", "x stock", "x liger", "peak GiB",
           "train peak GiB", "memory / stock", "memory / liger", "first loss", "first loss vs stock", "status"]  # fmt: skip


def summary(record: bench.BenchRecord) -> str:
    """Markdown for docs/benchmarks.md ("x peer": tokens/s over the peer's, for GRPO and RLOO of the training
    part; "memory / peer": peak over the peer's; "first loss": DPO's and KTO's loss at the first
    step, and its absolute difference from stock's)."""
    return bench.markdown_table(table(record), COLUMNS, skip_absent=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--tiny", action="store_true", help="the tiny model, a few tokens, 2 steps (CPU allowed)")
    parser.add_argument("--trainers", nargs="+", choices=TRAINERS, default=list(TRAINERS))
    bench.add_round_options(parser, PROVIDERS)
    args = parser.parse_args()
    if args.worker:
        bench.worker_main(worker, args.worker, args.result)
        return 0
    bench.fill_defaults(args, bench.ROUND_DEFAULTS)
    args.sizes = TINY_SIZES if args.tiny else SIZES
    if not torch.cuda.is_available() and not args.tiny:
        parser.error("the benchmark needs a CUDA GPU; on a CPU run it with --tiny")
    record = run(args)
    path = args.out / f"{NAME}.json"
    if args.merge and path.exists():
        record = merge_record(record, bench.BenchRecord.from_json(path), args.trainers)
    print(f"record: {record.to_json(path)}")
    print(summary(record))
    bad = [r for r in table(record) if r["status"] == "LOSS DIFFERS" or r["status"].startswith("failed")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
