"""Alignment losses on the fused LM head (fk-align) side by side with Liger Kernel, TRL's eager loss and
torch.compile of it.

Each case is one loss at one head shape and token count, bf16, the LM head trainable, timed
forward+backward (``loss.backward()`` into the hidden states and the head): wall time (``ms``)
and the GPU's time alone (``gpu_ms``, ``bench.time_ms(gpu_only=True)``), and peak memory above
what was allocated before the call (returned gradients included).

Losses (TRL 1.16's definitions; ``N`` tokens in sequences of ``SEQ`` = 1024, the first quarter of
each a prompt that is not scored, each sequence ending at a random length in [SEQ/2, SEQ]):

- ``dpo``: DPO, ``loss_type="sigmoid"``, beta 0.1, on sequence sums, reference-free (the same
  computation as TRL's precomputed reference log-probabilities, which are constants here);
  ``N / SEQ / 2`` pairs, chosen sequences first.
- ``cpo``: CPO, ``"sigmoid"``, beta 0.1, sums, plus the chosen sequences' NLL (``cpo_alpha=1``).
- ``simpo``: SimPO (TRL's CPO with ``loss_type="simpo"``, ``cpo_alpha=0``), beta 2, gamma 0.5, on
  mean log-probabilities per scored token.
- ``orpo``: ORPO, beta 0.1, means, NLL of the chosen sequences plus the odds-ratio term.
- ``kto``: KTO, ``loss_type="kto"``, sums, unpaired (every other sequence desirable), no reference
  model and no KL estimate (both 0). beta is ``KTO_BETA`` = 1e-4, not TRL's 0.1: without a
  reference, beta times a sum of some 500 log-probabilities near -12 would saturate the sigmoid (every
  loss 0 or 1, every gradient 0), which costs the same but checks nothing.
- ``grpo``: GRPO, ``loss_type="dapo"`` at the token level, ``N / SEQ`` completions, one advantage
  each, ``epsilon_low=0.2``, ``epsilon_high=0.28``, ``beta=0.04`` with the reference's per-token
  log-probabilities given, off-policy (old per-token log-probabilities given: the current ones
  plus noise, so that some ratios are clipped); no entropy computed.
- ``jsd``: distillation, generalized JSD with beta 0.5, temperature 1, batchmean over scored
  tokens (TRL's GKD ``generalized_jsd_loss``), a frozen teacher head as wide as the student's.

Shapes: the LM heads of Llama-3-8B (H=4096, V=128256) for every loss, and of Qwen2.5-7B (H=3584,
V=151936) for ``dpo``, ``grpo`` and ``jsd`` (one loss of each kind: the preference losses share one
path in every provider; ``--every-head``: every loss on both), at 8192 tokens (``--tokens 4096
8192``: both counts, each adding a compilation of Liger's chunk functions per loss and head, as
its full-batch tensors change shape).

Providers:

- ``fk``: ``fk.align.fused_linear_{dpo,cpo,orpo,kto,grpo}_loss``, ``fused_linear_distill``, defaults.
- ``liger``: ``liger_kernel.chunked_loss``'s ``LigerFusedLinear{DPO,CPO,SimPO,ORPO,KTO,GRPO,JSD}Loss``
  with their defaults (``compiled=True``; chunks of one pair, one sequence, one completion, 1024
  tokens for JSD) and the arguments that make them compute the same loss (:func:`liger_losses`).
  Before the cases, :func:`check_liger_arguments` runs each (``compiled=False``) in fp32 on a
  small head, where it must equal eager's loss and gradients to 1e-4: the arguments match.
  Liger's backward reads its upstream gradient on the host (a synchronization): it has no
  GPU-only time, and its wall time stands.
- ``eager``: TRL's formula on the full logits, ``F.linear(h, w).float()`` (Hugging Face upcasts
  the logits for its loss): the reference. Every provider's loss and gradients (``dh``, ``dW``)
  are checked against it (``check`` rows) before it is timed; a disagreement beyond bf16's
  tolerance raises, except Liger's JSD (:data:`NOT_ENFORCED`), which takes the log-softmax of the
  bf16 logits in bf16 and is a few percent off: recorded only.
- ``trl``: for ``jsd``, TRL 1.16's own fused head of its ``DistillationTrainer``
  (``trl.trainer.distillation_trainer._chunked_divergence_loss``: its Triton kernel over tiles of
  the scored positions' logits, the student's gradient from its backward), with the completion
  mask ``target != -100`` and TRL's mean over those positions; the other losses have no standalone
  fused function in TRL (their trainers build it into the model's forward).
- ``torch.compile``: of the eager function (``dynamic=False``), at the largest token count of
  each loss and head only (with ``--tokens``: a compilation per shape would take most of the run).

A provider that is not installed, or a peer that fails, is a row with a ``status``; one that runs
out of memory too. The record is written after each case.

FLOPs (multiply-adds of the head's matmuls, times 2), and the floor: ``tflops`` and
``matmul_fraction`` count the minimum any implementation must do, at the bf16 matmul ceiling
measured in the same run (from the wall time, as bench_flce.py). The minimum is one pass:
``6 N H V`` (the logits, then ``dh`` and ``dW`` from their gradient) for every loss but ``jsd``,
whose teacher adds ``2 N H_t V``. ``N`` is every token, scored or not, for the preference losses
(every provider computes every row's logits there), and the scored tokens for ``grpo`` and
``jsd`` (:data:`SCORED_FLOOR`: a token outside the mask, or without a label, adds nothing to the
loss or its gradient; fk leaves those rows out, as TRL's ``jsd`` does). A preference loss can be
done in one pass by holding each pair in one chunk (Liger does); GRPO at the token level needs
only each token's own values. What each provider does: fk 6 N H V for
``dpo``/``cpo``/``simpo``/``orpo``/``kto`` over every token (one pass: chunks of whole pairs, whole
sequences for ``kto``; here the default budget, 1 GiB, holds two of the four pairs: two chunks,
``dW`` summed in bf16), 6 N H V for ``grpo`` (one pass over tokens) and 6 N H V + 2 N H_t V for
``jsd``, both over the scored tokens only (``skip_ignored``); Liger 6 N H V for the preference
losses and ``kto`` (``torch.func.grad_and_value`` per chunk), 8 N H V for ``grpo`` (its selective
log-prob recomputes the logits in its backward), 6 N H V + 2 N H_t V for ``jsd``, both over every
token; TRL's ``jsd`` 6 N H V + 2 N H_t V over the scored tokens; eager and torch.compile the one
pass, with the full logits.

Run on a GPU:  python benchmarks/bench_align.py --out benchmarks/results       (10 cases: about 6 minutes on an
               H200, most of it compiling Liger's chunk functions and the eager losses, 10 of each)
In two calls:  python benchmarks/bench_align.py --losses dpo cpo simpo orpo
               python benchmarks/bench_align.py --losses kto grpo jsd --merge   (keeps the other losses' rows)
Redraw plots:  python benchmarks/bench_align.py --plot benchmarks/results/align.json
Try on a CPU:  python benchmarks/bench_align.py --tiny --out /tmp/align      (tiny head, Triton's interpreter)
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # the --tiny CPU run: fk's kernels in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fk.align import (
    fused_linear_cpo_loss,
    fused_linear_distill,
    fused_linear_dpo_loss,
    fused_linear_grpo_loss,
    fused_linear_kto_loss,
    fused_linear_orpo_loss,
)
from fk.core import bench

NAME = "align"
IGNORE = -100
SEQ = 1024
"""Tokens per sequence (a DPO pair holds two, a GRPO completion one)."""
HEAD_START_MS = 25.0
"""The GPU-only timing's head start: fk's host path at 8192 tokens (chunk loops, several launches
each) may take more than half of the default 5 ms."""
LOSS_TOLERANCE = 2e-2
"""Largest difference from eager's loss, relative to max(|eager's loss|, 0.1), that agrees (bf16)."""
GRAD_TOLERANCE = 5e-2
"""Largest norm of the gradients' difference from eager's, relative to eager's, that agrees (bf16)."""
NOT_ENFORCED = {("liger", "jsd"): "Liger's JSD takes the log-softmax of the bf16 logits in bf16"}
"""Checks recorded but not enforced, and why: Liger's JSD loss is 4% (V=2048) to 15% (V=16384) off
the fp32 one in bf16 on a CPU, and equal to it in fp32 (:func:`check_liger_arguments`)."""
ARGUMENT_TOLERANCE = 1e-4
"""Largest relative error of Liger's losses and gradients from eager's in fp32 (the arguments match)."""

DPO_BETA, CPO_BETA, ORPO_BETA = 0.1, 0.1, 0.1
SIMPO_BETA, SIMPO_GAMMA = 2.0, 0.5
KTO_BETA = 1e-4
GRPO_BETA, GRPO_EPS_LOW, GRPO_EPS_HIGH = 0.04, 0.2, 0.28
JSD_BETA = 0.5
LIGER_JSD_CHUNK = 1024

Fn = Callable[..., torch.Tensor]
Inputs = tuple[torch.Tensor, ...]


class Head(NamedTuple):
    """An LM head's shape (the teacher's, for ``jsd``, is the same)."""

    name: str
    hidden: int
    vocab: int


LLAMA = Head("llama-3-8b", 4096, 128256)
QWEN = Head("qwen2.5-7b", 3584, 151936)
TINY = Head("tiny", 64, 512)
TOKENS = (8192,)
QWEN_LOSSES = ("dpo", "grpo", "jsd")


# --- 1. The eager losses: TRL's formulas on the full fp32 logits -----------------------------------


def _logps(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probabilities of ``target`` (0 where ignored) and the mask of scored tokens."""
    logits = F.linear(hidden, weight).float()
    scored = target != IGNORE
    picked = logits.gather(-1, torch.where(scored, target, 0).unsqueeze(-1)).squeeze(-1)
    return torch.where(scored, picked - logits.logsumexp(-1), 0.0), scored


def _pair_sums(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, mean: bool
) -> tuple[torch.Tensor, ...]:
    """(chosen, rejected) sequence log-probabilities (sums, or means per scored token), and the
    chosen sequences' NLL per scored token."""
    logps, scored = _logps(hidden, weight, target)
    sums, counts = logps.sum(-1), scored.sum(-1)
    chosen_sums, _ = sums.chunk(2)
    nll = -chosen_sums.sum() / counts.chunk(2)[0].sum().clamp(min=1)
    seq = sums / counts.clamp(min=1) if mean else sums
    chosen, rejected = seq.chunk(2)
    return chosen, rejected, nll


def eager_dpo(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    chosen, rejected, _ = _pair_sums(hidden, weight, target, mean=False)
    return -F.logsigmoid(DPO_BETA * (chosen - rejected)).mean()


def eager_cpo(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    chosen, rejected, nll = _pair_sums(hidden, weight, target, mean=False)
    return -F.logsigmoid(CPO_BETA * (chosen - rejected)).mean() + nll


def eager_simpo(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    chosen, rejected, _ = _pair_sums(hidden, weight, target, mean=True)
    return -F.logsigmoid(SIMPO_BETA * (chosen - rejected - SIMPO_GAMMA / SIMPO_BETA)).mean()


def eager_orpo(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    chosen, rejected, nll = _pair_sums(hidden, weight, target, mean=True)
    log_odds = (chosen - rejected) - (torch.log1p(-torch.exp(chosen)) - torch.log1p(-torch.exp(rejected)))
    return nll - ORPO_BETA * F.logsigmoid(log_odds).mean()


def eager_kto(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, desirable: torch.Tensor
) -> torch.Tensor:
    logps, _ = _logps(hidden, weight, target)
    logratios = logps.sum(-1)  # no reference model, KL estimate 0
    losses = torch.where(desirable, 1 - torch.sigmoid(KTO_BETA * logratios), 1 - torch.sigmoid(-KTO_BETA * logratios))
    return losses.mean()


def eager_grpo(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor,
               advantages: torch.Tensor, old: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:  # fmt: skip
    logps, _ = _logps(hidden, weight, ids)  # every completion token (mask only weights them), as TRL
    coef_1 = torch.exp(logps - old)
    coef_2 = torch.clamp(coef_1, 1 - GRPO_EPS_LOW, 1 + GRPO_EPS_HIGH)
    a = advantages.unsqueeze(1)
    per_token = -torch.min(coef_1 * a, coef_2 * a) + GRPO_BETA * (torch.exp(ref - logps) - (ref - logps) - 1)
    m = mask.float()
    return (per_token * m).sum() / m.sum().clamp(min=1.0)  # dapo: over the batch's completion tokens


def eager_jsd(student_hidden: torch.Tensor, student_weight: torch.Tensor, teacher_hidden: torch.Tensor,
              teacher_weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:  # fmt: skip
    student = F.log_softmax(F.linear(student_hidden, student_weight).float(), dim=-1)
    with torch.no_grad():
        teacher = F.log_softmax(F.linear(teacher_hidden, teacher_weight).float(), dim=-1)
    mixture = torch.logsumexp(torch.stack([student + math.log1p(-JSD_BETA), teacher + math.log(JSD_BETA)]), dim=0)
    kl_teacher = F.kl_div(mixture, teacher, reduction="none", log_target=True)
    kl_student = F.kl_div(mixture, student, reduction="none", log_target=True)
    jsd = JSD_BETA * kl_teacher + (1 - JSD_BETA) * kl_student
    scored = target != IGNORE
    return torch.where(scored.unsqueeze(-1), jsd, 0.0).sum() / scored.sum().clamp(min=1)


# --- 2. fk ----------------------------------------------------------------------------------------


def fk_dpo(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return fused_linear_dpo_loss(hidden, weight, target, beta=DPO_BETA, loss_type="sigmoid").loss


def fk_cpo(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return fused_linear_cpo_loss(hidden, weight, target, beta=CPO_BETA, loss_type="sigmoid", cpo_alpha=1.0).loss


def fk_simpo(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return fused_linear_cpo_loss(hidden, weight, target, beta=SIMPO_BETA, loss_type="simpo",
                                 simpo_gamma=SIMPO_GAMMA, cpo_alpha=0.0).loss  # fmt: skip


def fk_orpo(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return fused_linear_orpo_loss(hidden, weight, target, beta=ORPO_BETA).loss


def fk_kto(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, desirable: torch.Tensor) -> torch.Tensor:
    return fused_linear_kto_loss(hidden, weight, target, desirable, beta=KTO_BETA, loss_type="kto").loss


def fk_grpo(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor,
            advantages: torch.Tensor, old: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:  # fmt: skip
    return fused_linear_grpo_loss(hidden, weight, ids, mask, advantages, old_per_token_logps=old,
                                  ref_per_token_logps=ref, beta=GRPO_BETA, epsilon_low=GRPO_EPS_LOW,
                                  epsilon_high=GRPO_EPS_HIGH, loss_type="dapo", return_entropy=False).loss  # fmt: skip


def fk_jsd(student_hidden: torch.Tensor, student_weight: torch.Tensor, teacher_hidden: torch.Tensor,
           teacher_weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:  # fmt: skip
    return fused_linear_distill(student_hidden, student_weight, teacher_hidden, teacher_weight, target, loss="jsd",
                                beta=JSD_BETA, temperature=1.0, weight_soft_loss=1.0, weight_hard_loss=0.0)  # fmt: skip


# --- 3. Liger Kernel's chunked losses, with the arguments that compute the same loss ---------------


def liger_losses(compiled: bool = True) -> dict[str, Fn]:
    """Loss name -> a function of the same inputs as the eager one, on Liger Kernel 0.8.5's
    ``liger_kernel.chunked_loss`` (raises ``ImportError`` without it). Chunk sizes are Liger's
    defaults. How the arguments match fk's and TRL's:

    - DPO: ``use_ref_model=False`` (reference log-probabilities 0), ``average_log_prob=False``
      (sums), ``compute_nll_loss=False``, ``loss_type="sigmoid"``, beta; its loss is the sum over
      pairs over the number of pairs: the mean.
    - CPO: ``average_log_prob=False`` (sums), ``compute_nll_loss=True`` with ``alpha=1`` (its NLL
      is the chosen tokens' summed NLL over their count, fk's ``cpo_alpha * nll``),
      ``label_smoothing=0``, beta.
    - SimPO: its ``average_log_prob`` is the base's default True (means), ``gamma`` is TRL's
      ``simpo_gamma`` (``beta * (c - r) - gamma``), ``compute_nll_loss=False`` (TRL's SimPO has
      ``cpo_alpha=0``; the module's default would add the NLL).
    - ORPO: means (the base's default), ``compute_nll_loss=True``, alpha 1 (the base's), beta.
    - KTO: ``use_ref_model=False``, ``kl=None`` (0), ``average_log_prob=False`` (sums), beta; the
      desirable flags as ``preference_labels``; its loss sums over the batch and divides by its size.
    - GRPO: ``loss_type="dapo"``, ``importance_sampling_level="token"``, the same epsilons and
      beta, ``use_ref_model=True`` with ``ref_per_token_logps`` given (so no reference head runs),
      ``old_per_token_logps``, the completion mask as ``attention_mask``, temperature 1.
    - JSD: ``weight_hard_loss=0``, ``weight_soft_loss=1`` (its defaults are 0.5 and 0.5; TRL's GKD
      has no hard loss), beta 0.5, temperature 1; 2-D inputs (tokens, hidden) and labels (its
      masking and batchmean over scored tokens are fk's and TRL's).
    """
    from liger_kernel.chunked_loss import (
        LigerFusedLinearCPOLoss,
        LigerFusedLinearDPOLoss,
        LigerFusedLinearGRPOLoss,
        LigerFusedLinearJSDLoss,
        LigerFusedLinearKTOLoss,
        LigerFusedLinearORPOLoss,
        LigerFusedLinearSimPOLoss,
    )

    dpo = LigerFusedLinearDPOLoss(beta=DPO_BETA, compute_nll_loss=False, compiled=compiled, use_ref_model=False,
                                  average_log_prob=False, loss_type="sigmoid")  # fmt: skip
    cpo = LigerFusedLinearCPOLoss(beta=CPO_BETA, alpha=1.0, label_smoothing=0.0, compute_nll_loss=True,
                                  compiled=compiled, average_log_prob=False)  # fmt: skip
    simpo = LigerFusedLinearSimPOLoss(beta=SIMPO_BETA, alpha=1.0, compute_nll_loss=False, compiled=compiled,
                                      gamma=SIMPO_GAMMA)  # fmt: skip
    orpo = LigerFusedLinearORPOLoss(beta=ORPO_BETA, compute_nll_loss=True, compiled=compiled)
    kto = LigerFusedLinearKTOLoss(beta=KTO_BETA, compiled=compiled, use_ref_model=False, average_log_prob=False)
    grpo = LigerFusedLinearGRPOLoss(beta=GRPO_BETA, compiled=compiled, use_ref_model=True, epsilon_low=GRPO_EPS_LOW,
                                    epsilon_high=GRPO_EPS_HIGH, loss_type="dapo", importance_sampling_level="token",
                                    temperature=1.0)  # fmt: skip
    jsd = LigerFusedLinearJSDLoss(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=JSD_BETA, temperature=1.0,
                                  compiled=compiled, chunk_size=LIGER_JSD_CHUNK)  # fmt: skip

    def flat(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(-1, t.shape[-1]) if t.is_floating_point() else t.reshape(-1)

    return {
        "dpo": lambda h, w, t: dpo(w, h, t)[0],
        "cpo": lambda h, w, t: cpo(w, h, t)[0],
        "simpo": lambda h, w, t: simpo(w, h, t)[0],
        "orpo": lambda h, w, t: orpo(w, h, t)[0],
        "kto": lambda h, w, t, d: kto(h, w, t, preference_labels=d)[0],
        "grpo": lambda h, w, ids, m, a, old, ref: grpo(
            h, w, ids, m, a, ref_per_token_logps=ref, old_per_token_logps=old
        )[0],
        "jsd": lambda sh, sw, th, tw, t: jsd(flat(sh), sw, flat(th), tw, flat(t)),
    }


# --- 4. Inputs, floors and the table of losses ----------------------------------------------------


def _sequences(head: Head, tokens: int, seq: int, device: str, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """(hidden (B, T, H) bf16 requiring grad, weight (V, H) bf16 requiring grad, labels (B, T), the
    mask of scored tokens: not the prompt (the first quarter), not the padding)."""
    n_seqs = tokens // seq
    hidden = (torch.randn(n_seqs, seq, head.hidden, device=device, generator=gen) * 0.5).to(torch.bfloat16)
    weight = (torch.randn(head.vocab, head.hidden, device=device, generator=gen) * head.hidden**-0.5).to(torch.bfloat16)
    labels = torch.randint(0, head.vocab, (n_seqs, seq), device=device, generator=gen)
    # Sequence i and sequence i + B/2 (a pair's chosen and rejected ones) end at the same position:
    # reference-free sums of different lengths would differ by hundreds, a saturated sigmoid.
    lengths = torch.randint(seq // 2, seq + 1, ((n_seqs + 1) // 2,), device=device, generator=gen).repeat(2)[:n_seqs]
    position = torch.arange(seq, device=device)
    scored = (position >= seq // 4) & (position < lengths.unsqueeze(1))
    return hidden.requires_grad_(), weight.requires_grad_(), labels, scored


def preference_inputs(head: Head, tokens: int, seq: int, device: str, gen: torch.Generator) -> Inputs:
    hidden, weight, labels, scored = _sequences(head, tokens, seq, device, gen)
    return hidden, weight, torch.where(scored, labels, IGNORE)


def kto_inputs(head: Head, tokens: int, seq: int, device: str, gen: torch.Generator) -> Inputs:
    hidden, weight, target = preference_inputs(head, tokens, seq, device, gen)
    desirable = torch.arange(hidden.shape[0], device=device) % 2 == 0
    return hidden, weight, target, desirable


def grpo_inputs(head: Head, tokens: int, seq: int, device: str, gen: torch.Generator) -> Inputs:
    hidden, weight, ids, mask = _sequences(head, tokens, seq, device, gen)
    advantages = torch.randn(hidden.shape[0], device=device, generator=gen)
    with torch.no_grad():  # the sampling policy's and the reference's log-probabilities: near the current ones
        current, _ = _logps(hidden, weight, ids)
    old = current + 0.2 * torch.randn(current.shape, device=device, generator=gen)
    ref = current + 0.2 * torch.randn(current.shape, device=device, generator=gen)
    return hidden, weight, ids, mask.long(), advantages, old, ref


def jsd_inputs(head: Head, tokens: int, seq: int, device: str, gen: torch.Generator) -> Inputs:
    hidden, weight, target = preference_inputs(head, tokens, seq, device, gen)
    teacher_hidden = (torch.randn(hidden.shape, device=device, generator=gen) * 0.5).to(torch.bfloat16)
    teacher_weight = (torch.randn(weight.shape, device=device, generator=gen) * head.hidden**-0.5).to(torch.bfloat16)
    return hidden, weight, teacher_hidden, teacher_weight, target


class Loss(NamedTuple):
    """One loss: how to build its inputs (the first two need gradients), and each provider's function."""

    name: str
    inputs: Callable[[Head, int, int, str, torch.Generator], Inputs]
    eager: Fn
    fk: Fn
    floor_passes: int  # the floor in units of 2 N H V: 3 (one pass with gradients); 4 with jsd's teacher


LOSSES = {
    "dpo": Loss("dpo", preference_inputs, eager_dpo, fk_dpo, 3),
    "cpo": Loss("cpo", preference_inputs, eager_cpo, fk_cpo, 3),
    "simpo": Loss("simpo", preference_inputs, eager_simpo, fk_simpo, 3),
    "orpo": Loss("orpo", preference_inputs, eager_orpo, fk_orpo, 3),
    "kto": Loss("kto", kto_inputs, eager_kto, fk_kto, 3),
    "grpo": Loss("grpo", grpo_inputs, eager_grpo, fk_grpo, 3),
    "jsd": Loss("jsd", jsd_inputs, eager_jsd, fk_jsd, 4),
}
PROVIDERS = ("eager", "fk", "liger", "trl", "torch.compile")
"""In the order each case runs them: eager first, as every other provider is checked against it."""
PEERS = ("liger", "trl", "torch.compile", "eager")


SCORED_FLOOR = ("grpo", "jsd")
"""The losses whose floor counts the scored tokens only (see the module docstring)."""


def scored_tokens(loss: str, inputs: Inputs) -> int:
    """The tokens ``inputs`` score: GRPO's mask, JSD's labels not ignored."""
    return int(inputs[3].sum()) if loss == "grpo" else int((inputs[-1] != IGNORE).sum())


def floor_flops(loss: Loss, head: Head, tokens: int, scored: int) -> int:
    """The floor's FLOPs: 6 N H V (+ 2 N H_t V for the teacher of ``jsd``), N every token, or the
    ``scored`` ones for :data:`SCORED_FLOOR` (see the module docstring)."""
    n = scored if loss.name in SCORED_FLOOR else tokens
    return 2 * loss.floor_passes * n * head.hidden * head.vocab


class Case(NamedTuple):
    loss: str
    head: Head
    tokens: int
    seq: int


def cases(losses: Sequence[str], tokens: Sequence[int], every_head: bool, tiny: bool) -> list[Case]:
    """The cases of a run: every loss on the Llama head, those of ``QWEN_LOSSES`` (every one with
    ``every_head``) on the Qwen head, at each token count; --tiny: the tiny head at 128 tokens."""
    if tiny:
        return [Case(name, TINY, 128, 32) for name in losses]
    on_qwen = [name for name in losses if every_head or name in QWEN_LOSSES]
    return [Case(name, head, n, SEQ) for head, names in ((LLAMA, losses), (QWEN, on_qwen)) for name in names
            for n in sorted(tokens)]  # fmt: skip


# --- 5. Measuring ---------------------------------------------------------------------------------


class Disagreement(AssertionError):
    """A provider's loss or gradients are not the reference's: the run stops."""


def _grads_after(fn: Fn, inputs: Inputs) -> tuple[float, list[torch.Tensor]]:
    """(loss, gradients of the first two inputs) of one forward+backward."""
    for t in inputs[:2]:
        t.grad = None
    loss = fn(*inputs)
    loss.backward()
    grads = [t.grad.float() for t in inputs[:2]]  # type: ignore[union-attr]
    for t in inputs[:2]:
        t.grad = None
    return float(loss.item()), grads


def _check(case: Case, provider: str, got: tuple[float, list[torch.Tensor]], want: tuple[float, list[torch.Tensor]],
           reference: str) -> dict[str, float]:  # fmt: skip
    """The loss' and the gradients' relative errors from the reference's; raises beyond the tolerances."""
    loss_err = abs(got[0] - want[0]) / max(abs(want[0]), 0.1)
    grad_err = max(float((g - w).norm() / w.norm().clamp(min=1e-30)) for g, w in zip(got[1], want[1], strict=True))
    enforced = (provider, case.loss) not in NOT_ENFORCED
    if enforced and not (loss_err <= LOSS_TOLERANCE and grad_err <= GRAD_TOLERANCE):
        raise Disagreement(f"{case.loss} at {case.head.name}, {case.tokens} tokens: {provider} disagrees with "
                           f"{reference}: loss {got[0]} vs {want[0]} (error {loss_err:.3g}), gradients' relative "
                           f"error {grad_err:.3g}")  # fmt: skip
    return {"loss_value": got[0], "loss_err": loss_err, "grad_err": grad_err, "enforced": enforced}


def check_liger_arguments(losses: Sequence[str], device: str) -> None:
    """Liger's losses (``compiled=False``) against the eager ones in fp32 on a small head, where they
    must agree to :data:`ARGUMENT_TOLERANCE`: the arguments compute the same loss (bf16 leaves
    room for a constant factor's worth of error in a small loss, fp32 does not)."""
    liger = liger_losses(compiled=False)
    head, tokens, seq = Head("small", 128, 2048), 512, 128
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # (fp32 matmuls, not TF32: both sides the same)
    try:
        _check_arguments(liger, losses, head, tokens, seq, device)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    print(f"Liger's arguments checked in fp32: {', '.join(losses)}")


def _check_arguments(liger: dict[str, Fn], losses: Sequence[str], head: Head, tokens: int, seq: int,
                     device: str) -> None:  # fmt: skip
    for name in losses:
        inputs = LOSSES[name].inputs(head, tokens, seq, device, torch.Generator(device=device).manual_seed(7))
        fp32 = tuple(t.detach().float().requires_grad_(i < 2) if t.is_floating_point() else t
                     for i, t in enumerate(inputs))  # fmt: skip
        want, got = _grads_after(LOSSES[name].eager, fp32), _grads_after(liger[name], fp32)
        errors = [abs(got[0] - want[0]) / max(abs(want[0]), 0.1)]
        errors += [float((g - w).norm() / w.norm().clamp(min=1e-30)) for g, w in zip(got[1], want[1], strict=True)]
        if max(errors) > ARGUMENT_TOLERANCE:
            raise Disagreement(f"{name}: Liger's loss in fp32 is not eager's: loss {got[0]} vs {want[0]}, "
                               f"relative errors (loss, dh, dW) {errors}")  # fmt: skip


def _time_one(call: Callable[[], None], grads: list[torch.Tensor], rep: int, label: str) -> dict[str, float]:
    """``ms`` (wall), ``gpu_ms`` (the GPU's work alone, where the call does not synchronize) and
    ``peak_mb`` of ``call`` on a GPU; ``ms`` alone on the CPU."""
    if not torch.cuda.is_available():
        return {"ms": bench.cpu_time_ms(call, warmup=0, rep=rep, grad_to_none=grads)}
    out = {"ms": bench.time_ms(call, warmup=2, rep=rep, grad_to_none=grads)}
    try:
        out["gpu_ms"] = bench.time_ms(call, warmup=0, rep=rep, grad_to_none=grads, gpu_only=True,
                                      head_start_ms=HEAD_START_MS)  # fmt: skip
    except RuntimeError as error:  # Liger's backward reads its upstream gradient on the host
        print(f"{label}: no GPU-only time ({error})")
    for t in grads:
        t.grad = None
    out["peak_mb"] = bench.peak_memory_bytes(call) / 2**20
    return out


def measure(record: bench.BenchRecord, matmul_tflops: float | None, case: Case, functions: dict[str, Fn | str],
            rep: int) -> None:  # fmt: skip
    """Check every provider against eager (raising :class:`Disagreement`), then time it and measure
    its memory; rows into ``record``. A peer that fails or any provider that runs out of memory
    gets a status row instead."""
    loss = LOSSES[case.loss]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(case.tokens + case.head.vocab + case.head.hidden)
    inputs = loss.inputs(case.head, case.tokens, case.seq, device, gen)
    grads = list(inputs[:2])
    where = {"loss": case.loss, "model": case.head.name, "hidden": case.head.hidden, "vocab": case.head.vocab,
             "tokens": case.tokens, "seq": case.seq}  # fmt: skip
    scored = scored_tokens(case.loss, inputs) if case.loss in SCORED_FLOOR else case.tokens
    flops = floor_flops(loss, case.head, case.tokens, scored)
    reference: tuple[float, list[torch.Tensor]] | None = None
    reference_name = ""
    for provider, fn in functions.items():
        label = f"{case.loss} {case.head.name} {case.tokens}: {provider}"
        if isinstance(fn, str):
            record.add(table="time", provider=provider, status=fn, **where)
            continue

        def call(fn: Fn = fn) -> None:
            fn(*inputs).backward()

        try:
            got = _grads_after(fn, inputs)  # also the first call: compilation and autotuning happen here
            if reference is None:  # eager, the first provider (or the first that fits in memory)
                reference, reference_name = got, provider
            record.add(table="check", provider=provider, reference=reference_name, **where,
                       **_check(case, provider, got, reference, reference_name))  # fmt: skip
            del got
            timing = _time_one(call, grads, rep, label)
            achieved = bench.tflops(flops, timing["ms"])
            record.add(table="time", provider=provider, **where, rep=rep, tflops=achieved,
                       **({"matmul_fraction": bench.fraction(achieved, matmul_tflops)} if matmul_tflops else {}),
                       **timing)  # fmt: skip
        except torch.OutOfMemoryError:
            record.add(table="time", provider=provider, status="out of memory", **where)
            print(f"{label}: out of memory")
        except Disagreement:
            raise
        except Exception as error:  # a peer's failure is a row; fk's and eager's stop the run
            if provider in ("fk", "eager"):
                raise
            first_line = str(error).strip().splitlines()[0][:200] if str(error).strip() else ""
            record.add(table="time", provider=provider, status=f"failed: {type(error).__name__}: {first_line}",
                       **where)  # fmt: skip
            print(f"{label}: failed: {error!r}")
        finally:
            for t in grads:
                t.grad = None
            if device == "cuda":
                torch.cuda.empty_cache()


def trl_jsd(tiny: bool) -> Fn | str:
    """TRL's own fused JSD (its DistillationTrainer's), or why it does not run."""
    if tiny:
        return "skipped: --tiny runs fk and eager only"
    try:
        from trl.trainer.distillation_trainer import _chunked_divergence_loss
    except ImportError as error:
        return f"not available: {error}"

    def jsd(student_hidden: torch.Tensor, student_weight: torch.Tensor, teacher_hidden: torch.Tensor,
            teacher_weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:  # fmt: skip
        loss, _entropy, _count = _chunked_divergence_loss(student_hidden, teacher_hidden, student_weight,
                                                          teacher_weight, target != -100, JSD_BETA)  # fmt: skip
        return loss

    return jsd


def providers(loss: str, wanted: Sequence[str], tiny: bool, compile_here: bool) -> dict[str, Fn | str]:
    """Provider -> its function for ``loss``, or why it does not run (a status row)."""
    spec = LOSSES[loss]
    found: dict[str, Fn | str] = {}
    for name in PROVIDERS:
        if name not in wanted:
            continue
        if name == "eager":
            found[name] = spec.eager
        elif name == "fk":
            found[name] = spec.fk
        elif name == "liger":
            try:
                liger = liger_losses()[loss]
                found[name] = "skipped: --tiny runs fk and eager only" if tiny else liger
            except ImportError as error:
                found[name] = f"not available: {error}"
        elif name == "trl":
            if loss == "jsd":  # (TRL's other fused heads are built into its trainers' model forward)
                found[name] = trl_jsd(tiny)
        elif tiny:
            found[name] = "skipped: --tiny runs fk and eager only"
        elif not compile_here:
            found[name] = "skipped: compiled at the largest token count only"
        else:
            found[name] = torch.compile(spec.eager, dynamic=False)
    return found


def run(losses: Sequence[str], wanted: Sequence[str], tokens: Sequence[int], every_head: bool, tiny: bool, rep: int,
        out: Path, previous: bench.BenchRecord | None = None) -> bench.BenchRecord:  # fmt: skip
    """Every case of ``losses``; the record (with ``previous``'s rows of the other losses, where
    given) is written to ``out`` after each case."""
    record = bench.BenchRecord(NAME, notes=(
        f"bf16, LM head trainable, forward+backward; sequences of {SEQ if not tiny else 32} tokens; floor: 6 N H V "
        "FLOPs (jsd: + 2 N H_t V) at the bf16 matmul ceiling, N every token (grpo, jsd: the scored ones); eager: "
        "TRL's formula on fp32 logits"))  # fmt: skip
    if previous is not None:
        record = merge_record(record, previous, losses)
    matmul = None
    if torch.cuda.is_available():
        ceilings = bench.measure_ceilings()
        record.ceilings = ceilings.as_dict()
        matmul = ceilings.matmul_tflops
        print(f"ceilings: copy {ceilings.copy_tbps:.2f} TB/s, bf16 matmul {ceilings.matmul_tflops:.0f} TFLOP/s")
        # Each eager loss compiles once per shape and Liger's chunk functions once per loss and head,
        # without a reset between cases (it would make Liger compile again at each token count);
        # past dynamo's limit of 8 compilations per function, it would run them eagerly.
        config = torch._dynamo.config
        limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
        setattr(config, limit, max(getattr(config, limit), 64))
    if "liger" in wanted and not tiny:
        with contextlib.suppress(ImportError):  # (without Liger: its status rows say so)
            check_liger_arguments(losses, "cuda" if torch.cuda.is_available() else "cpu")
    todo = cases(losses, tokens, every_head, tiny)
    largest = {(c.loss, c.head): max(d.tokens for d in todo if (d.loss, d.head) == (c.loss, c.head)) for c in todo}
    for case in bench.progress(todo, desc=NAME):
        began = time.perf_counter()
        found = providers(case.loss, wanted, tiny, compile_here=case.tokens == largest[(case.loss, case.head)])
        measure(record, matmul, case, found, rep)
        print(f"{case.loss} {case.head.name} {case.tokens}: {time.perf_counter() - began:.1f} s")
        record.to_json(out / f"{NAME}.json")  # what is measured so far, if a later case fails
    return record


def merge_record(new: bench.BenchRecord, old: bench.BenchRecord, losses: Sequence[str]) -> bench.BenchRecord:
    """``new`` with ``old``'s rows of the losses it did not run (:func:`fk.core.bench.merge_records`)."""
    return bench.merge_records(new, old, lambda row: str(row.get("loss")), losses)


# --- 6. Tables and plots (pure Python: they run without a GPU) ------------------------------------


def _time(row: dict[str, Any], gpu: bool) -> float:
    return float(row["gpu_ms"] if gpu else row["ms"])


def _by_case(record: bench.BenchRecord, table: str) -> dict[tuple[str, str, int], dict[str, dict[str, Any]]]:
    out: dict[tuple[str, str, int], dict[str, dict[str, Any]]] = {}
    for row in record.rows:
        if row.get("table") == table and (table != "time" or "ms" in row):
            out.setdefault((row["loss"], row["model"], row["tokens"]), {})[row["provider"]] = row
    order = list(LOSSES)
    return dict(sorted(out.items(), key=lambda kv: (order.index(kv[0][0]) if kv[0][0] in order else 99, kv[0][1:])))


def time_table(record: bench.BenchRecord) -> list[dict[str, Any]]:
    """Per case: fk's times and share of the floor, each peer's time over fk's (GPU-only times where
    both have one, else wall times), and fk's speedup over the fastest peer."""
    table = []
    for (loss, model, tokens), rows in _by_case(record, "time").items():
        fk = rows.get("fk")
        if fk is None:
            continue
        line: dict[str, Any] = {"loss": loss, "model": model, "tokens": tokens, "fk ms": fk["ms"]}
        if "gpu_ms" in fk:
            line["fk GPU ms"] = fk["gpu_ms"]
        if "matmul_fraction" in fk:
            line["fk matmul%"] = 100 * fk["matmul_fraction"]
        ratios = {}
        for peer in PEERS:
            if peer in rows:
                gpu = "gpu_ms" in fk and "gpu_ms" in rows[peer]
                ratios[peer] = _time(rows[peer], gpu) / _time(fk, gpu)
                line[f"{peer} ms"] = rows[peer]["ms"]
                line[f"x {peer}"] = ratios[peer]
        if ratios:
            best = min(ratios, key=lambda p: ratios[p])
            line["speedup"], line["fastest peer"] = ratios[best], best
        table.append(line)
    return table


def memory_table(record: bench.BenchRecord) -> list[dict[str, Any]]:
    """Per case: each provider's peak memory (MB), and fk's over Liger's."""
    table = []
    for (loss, model, tokens), rows in _by_case(record, "time").items():
        if "fk" not in rows or "peak_mb" not in rows["fk"]:
            continue
        line: dict[str, Any] = {"loss": loss, "model": model, "tokens": tokens}
        for provider in ("fk", *PEERS):
            if "peak_mb" in rows.get(provider, {}):
                line[f"{provider} MB"] = rows[provider]["peak_mb"]
        if "liger MB" in line:
            line["fk / liger"] = line["fk MB"] / line["liger MB"]
        table.append(line)
    return table


TIME_COLUMNS = ["loss", "model", "tokens", "fk ms", "fk GPU ms", "fk matmul%", "liger ms", "trl ms", "torch.compile ms",
                "eager ms", "x liger", "x trl", "x torch.compile", "x eager", "speedup", "fastest peer"]  # fmt: skip
MEMORY_COLUMNS = ["loss", "model", "tokens", "fk MB", "liger MB", "trl MB", "torch.compile MB", "eager MB",
                  "fk / liger"]  # fmt: skip


def summary(record: bench.BenchRecord) -> str:
    """Markdown for docs/benchmarks.md: times ("x peer": the peer's time over fk's, GPU-only where
    both have one; "speedup": over the fastest peer) and peak memory."""
    times = time_table(record)
    parts = [bench.markdown_table(times, TIME_COLUMNS, skip_absent=True)] if times else []
    memory = memory_table(record)
    if memory:
        parts.append("Peak memory (MB above the inputs, gradients included):\n\n"
                     + bench.markdown_table(memory, MEMORY_COLUMNS, skip_absent=True))  # fmt: skip
    missing = sorted({f"{r['provider']} ({r['status']})" for r in record.rows if "status" in r
                      and not r["status"].startswith("skipped: compiled")})  # fmt: skip
    if missing:
        parts.append("Not measured: " + "; ".join(missing) + ".")
    return "\n\n".join(parts)


def plots(record: bench.BenchRecord, out: Path) -> list[Path]:
    """TFLOP/s (the floor's FLOPs over the wall time) per loss and provider, at each head's largest
    token count, against the matmul ceiling."""
    rows = [r for r in record.rows if r.get("table") == "time" and "tflops" in r]
    if not rows:
        return []
    largest = {m: max(r["tokens"] for r in rows if r["model"] == m) for m in {r["model"] for r in rows}}
    subset = bench.BenchRecord(record.name, record.environment, record.ceilings,
                               [r for r in rows if r["tokens"] == largest[r["model"]]], record.notes)  # fmt: skip
    path = bench.plot(
        subset, x="loss", y="tflops", facet="model", path=out / f"{NAME}.png",
        title=f"alignment losses on the LM head, bf16, forward+backward ({record.environment.get('gpu')})",
        ylabel="TFLOP/s (floor FLOPs / time)", hline=record.ceilings.get("matmul_tflops"),
        hline_label="bf16 matmul ceiling",
    )  # fmt: skip
    return [path]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--losses", nargs="+", choices=list(LOSSES), default=list(LOSSES))
    parser.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS),
                        help="eager always runs: it is the reference")  # fmt: skip
    parser.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS),
                        help=f"token counts, multiples of 2 x {SEQ} (default: 8192)")  # fmt: skip
    parser.add_argument("--every-head", action="store_true", help="every loss on the Qwen head too")
    parser.add_argument("--rep", type=int, help="timed calls per measurement (default 5; --tiny 2)")
    parser.add_argument("--tiny", action="store_true", help="a tiny head, fk and eager only (CPU allowed)")
    parser.add_argument("--merge", action="store_true", help="keep the rows of the other losses of the record at --out")
    parser.add_argument("--plot", type=Path, help="only redraw the plots (and print the tables) from this JSON record")
    parser.add_argument("--plot-dir", type=Path, default=Path("docs/assets/benchmarks"))
    args = parser.parse_args()
    if args.plot:
        record = bench.BenchRecord.from_json(args.plot)
        plots(record, args.plot_dir)
        print(summary(record))
        return
    if not torch.cuda.is_available() and not args.tiny:
        parser.error("the benchmark needs a CUDA GPU; on a CPU run it with --tiny")
    rep = args.rep or (2 if args.tiny else 5)
    wanted = list(dict.fromkeys(["eager", *args.providers]))
    path = args.out / f"{NAME}.json"
    previous = bench.BenchRecord.from_json(path) if args.merge and path.exists() else None
    if any(n <= 0 or n % (2 * SEQ) for n in args.tokens):
        parser.error(f"--tokens must be positive multiples of {2 * SEQ} (pairs of {SEQ}-token sequences)")
    record = run(args.losses, wanted, args.tokens, args.every_head, args.tiny, rep, args.out, previous)
    print(f"record: {record.to_json(path)}")
    try:
        drawn = plots(record, args.out if args.tiny else args.plot_dir)
        print("plots: " + ", ".join(map(str, drawn)) if drawn else "no plots: nothing was measured")
    except ImportError:
        print("matplotlib is not installed: no plots")
    print(summary(record))


if __name__ == "__main__":
    main()
