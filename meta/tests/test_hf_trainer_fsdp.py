"""fk.hf with the ``transformers`` Trainer under FSDP2 (``fsdp=True``, accelerate's FSDP2 path),
patched by :class:`fk.hf.FkCallback` and nothing else: the per-step losses the Trainer logs equal
stock's under the same config (bf16), the model was sharded (FSDP2's ``FSDPModule``), and fk's
fused loss computed every training loss.

GPU only: accelerate falls back to DDP on a CPU (``use_cpu``), so there is no FSDP to test there.
One process per GPU (1, then 2 where there are), each starting once for every case.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import fk.hf
import fk.hf.loss_head
from fk.core import testing

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (FSDP through accelerate)")

VOCAB, BATCH, SEQ, STEPS = 128, 4, 16, 3
WORLDS = (1, 2) if torch.cuda.device_count() >= 2 else (1,)
CASES = {"untied": False, "tied": True}


@contextlib.contextmanager
def fused_losses() -> Iterator[list[bool]]:
    """Within the block, one entry per call of fk.hf's fused causal-LM loss in grad mode (not the
    probe's, under ``torch.no_grad``): the trainer's training losses that fk computed."""
    calls: list[bool] = []
    loss_fn = fk.hf.loss_head.fused_causal_lm_loss

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        if torch.is_grad_enabled():
            calls.append(True)
        return loss_fn(*args, **kwargs)

    fk.hf.loss_head.fused_causal_lm_loss = counted
    try:
        yield calls
    finally:
        fk.hf.loss_head.fused_causal_lm_loss = loss_fn


def _model(tied: bool) -> Any:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tied,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _train(tied: bool, patched: bool, world: int, rank: int, out_dir: Path) -> dict[str, Any]:
    """STEPS Trainer steps under FSDP2 in bf16: the losses it logged, whether fk's fused loss
    computed each training loss, and whether the trained model was an ``FSDPModule``."""
    from torch.distributed.fsdp import FSDPModule

    ids = torch.randint(0, VOCAB, (STEPS * BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    rows = [{"input_ids": row, "labels": row.clone()} for row in ids]
    args = transformers.TrainingArguments(
        output_dir=str(out_dir / f"fsdp{rank}"), per_device_train_batch_size=BATCH // world, max_steps=STEPS,
        logging_steps=1, learning_rate=1e-2, lr_scheduler_type="constant", report_to=[], save_strategy="no",
        disable_tqdm=True, bf16=True, seed=0, dataloader_drop_last=True,
        fsdp=True, fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
    )  # fmt: skip
    with fused_losses() as fused:
        callbacks = [fk.hf.FkCallback()] if patched else []
        trainer = transformers.Trainer(model=_model(tied), args=args, train_dataset=rows, callbacks=callbacks)
        trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    sharded = isinstance(trainer.model_wrapped, FSDPModule) or isinstance(trainer.model, FSDPModule)
    return {"losses": losses, "fused": len(fused) == STEPS, "sharded": sharded}


def _worker(rank: int, world: int, out_dir: Path) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")  # (read by accelerate; the group exists)
    results = {(name, patched): _train(tied, patched, world, rank, out_dir) for name, tied in CASES.items()
               for patched in (False, True)}  # fmt: skip
    torch.save(results, out_dir / f"rank{rank}.pt")


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"world{w}")
def ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict[Any, Any]]:
    world: int = request.param
    out_dir = tmp_path_factory.mktemp(f"fsdp_trainer{world}")
    testing.run_distributed(_worker, out_dir, world_size=world, timeout_s=300, backend="nccl")
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(world)]


@pytest.mark.parametrize("name", list(CASES))
def test_fk_callback_under_trainer_fsdp2_matches_stock(ranks: list[dict[Any, Any]], name: str) -> None:
    fk_run, stock_run = ranks[0][name, True], ranks[0][name, False]
    assert fk_run["sharded"] and stock_run["sharded"], "the Trainer did not shard the model with FSDP2"
    assert fk_run["fused"], "fk's fused loss did not compute every training loss"
    assert not stock_run["fused"]
    assert len(fk_run["losses"]) == STEPS
    torch.testing.assert_close(torch.tensor(fk_run["losses"]), torch.tensor(stock_run["losses"]), rtol=2e-2, atol=2e-2)
