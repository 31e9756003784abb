"""fk-patched tiny Llamas trained on 2 gloo processes (CPU, Triton's interpreter) under DDP and
FSDP2: per-step losses equal stock under the same wrapper and fk in one process on the whole batch.

FSDP2 cases cover the head in the root's group, the head sharded on its own
(``fully_shard(lm_head)``, where a forward that read ``lm_head.weight`` directly would see a shard),
a tied head sharded with its embedding (``fully_shard([embed_tokens, lm_head])``), a
``MixedPrecisionPolicy`` (bf16 parameters, fp32 reductions) and a PEFT LoRA model. The two
processes run every case once (starting them is the expensive part) and save their losses.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import fk.hf
from fk.core import testing
from fk.hf.distributed import fully_shard_causal_lm

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

VOCAB, BATCH, SEQ, STEPS, WORLD = 128, 4, 16, 2, 2
TOL: dict[str, Any] = {"rtol": 1e-5, "atol": 1e-5}

# name -> how the case is built: wrapper ("ddp"/"fsdp"), fk patched or stock, the head sharded on
# its own, tied embeddings, bf16 mixed precision, PEFT LoRA.
CASES: dict[str, dict[str, Any]] = {}
for _wrapper, _extra in [
    ("ddp", {}),
    ("fsdp", {}),
    ("fsdp", {"tied": True}),
    ("fsdp", {"separate_head": True}),
    ("fsdp", {"separate_head": True, "tied": True}),
    ("fsdp", {"separate_head": True, "mixed": True}),
    ("fsdp", {"lora": True}),
]:
    _name = "_".join([_wrapper, *_extra]) if _extra else _wrapper
    for _fk in (False, True):
        CASES[f"{_name}_{'fk' if _fk else 'stock'}"] = {"wrap": _wrapper, "fk": _fk, **_extra}


def _model(case: dict[str, Any]) -> Any:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=case.get("tied", False),
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).train()
    if case.get("lora"):
        targets = ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]
        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
        model = peft.get_peft_model(model, lora).train()
    if case["fk"]:
        fk.hf.apply(model)
    return model


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (STEPS, BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return ids, ids.clone()  # every sequence scores SEQ - 1 tokens: the ranks' means weigh the same


def _train(model: Any, rows: slice) -> tuple[list[float], bool, torch.Tensor | None]:
    """SGD steps on this rank's rows of each batch: (losses averaged over the ranks, whether the
    logits were skipped, the head's full gradient after the first step, or None when frozen)."""
    ids, labels = _batch()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    losses, skipped, head_grad = [], True, None
    for step in range(STEPS):
        out = model(input_ids=ids[step, rows], labels=labels[step, rows])
        out.loss.backward()
        loss = out.loss.detach().float()
        if dist.is_initialized():
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        losses.append(float(loss))
        skipped = skipped and out.logits is None
        inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
        head = (inner.get_base_model() if hasattr(inner, "get_base_model") else inner).lm_head.weight
        if step == 0 and head.grad is not None:
            grad = head.grad
            head_grad = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().float().clone()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses, skipped, head_grad


def _wrap(model: Any, case: dict[str, Any]) -> Any:
    if case["wrap"] == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if case.get("mixed") else None
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))  # not FSDP2's default: a GPU's, where there is one
    return fully_shard_causal_lm(model, separate_head=case.get("separate_head", False), mp_policy=mixed, mesh=mesh)


def _worker(rank: int, world: int, out_dir: Path) -> None:
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    results = {name: _train(_wrap(_model(case), case), rows) for name, case in CASES.items()}
    torch.save(results, out_dir / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out_dir = tmp_path_factory.mktemp("hf_distributed")
    testing.run_distributed(_worker, out_dir, world_size=WORLD)
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(WORLD)]


@pytest.fixture(scope="module")
def single() -> dict[tuple[bool, bool], tuple[list[float], bool, torch.Tensor | None]]:
    """fk in one process on the whole batch, by (tied, lora)."""
    return {
        (tied, lora): _train(_model({"fk": True, "tied": tied, "lora": lora}), slice(None))
        for tied, lora in [(False, False), (True, False), (False, True)]
    }


@pytest.mark.parametrize("name", [n for n in CASES if n.endswith("_fk")])
def test_fk_matches_stock_and_one_process(ranks: list[dict[str, Any]], single: dict[Any, Any], name: str) -> None:
    case = CASES[name]
    losses, skipped, head_grad = ranks[0][name]
    stock_losses, stock_skipped, stock_head_grad = ranks[0][name.replace("_fk", "_stock")]
    assert skipped, "the fused loss did not run (the patched forward fell back to the logits)"
    assert not stock_skipped
    tol: dict[str, Any] = {"rtol": 2e-2, "atol": 2e-2} if case.get("mixed") else TOL
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(stock_losses), **tol)
    one_losses, _, one_head_grad = single[(case.get("tied", False), case.get("lora", False))]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(one_losses), **tol)
    assert ranks[1][name][0] == losses  # every rank logged the same (all-reduced) losses
    if case.get("lora"):
        assert head_grad is None and stock_head_grad is None  # the frozen head gets no gradient
        return
    assert head_grad is not None and stock_head_grad is not None and one_head_grad is not None
    grad_tol: dict[str, Any] = {"rtol": 2e-2, "atol": 1e-3} if case.get("mixed") else TOL
    torch.testing.assert_close(head_grad, stock_head_grad, **grad_tol)
    torch.testing.assert_close(head_grad, one_head_grad, **grad_tol)


def test_a_sharded_tied_head_outside_its_group_names_the_fix() -> None:
    """Without a process group: a head whose weight reads as a DTensor (as a tied head does when
    only the embedding was sharded) gets a TypeError that says how to shard it, not a wrong loss."""
    from fk.hf.loss_head import fused_causal_lm_loss

    head = torch.nn.Linear(8, 16, bias=False)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("fk.hf.loss_head.is_dtensor", lambda t: True)
        with pytest.raises(TypeError, match=r"fully_shard\(\[model\.model\.embed_tokens, model\.lm_head\]\)"):
            fused_causal_lm_loss(torch.randn(1, 4, 8), head, torch.zeros(1, 4, dtype=torch.long))
