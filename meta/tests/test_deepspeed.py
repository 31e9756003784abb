"""fk-patched tiny Llamas trained under DeepSpeed ZeRO-2 and ZeRO-3, stock and fk under the same
config: per-step losses and the head's whole gradient equal, and fk's fused loss ran (no logits).

Cases: ZeRO-2 and ZeRO-3, CPU offload of the optimizer (and, for ZeRO-3, of the parameters) or
none, tied and untied heads, a model built under ``deepspeed.zero.Init``, PEFT LoRA, gradient
checkpointing (reentrant and not), each through the engine ``deepspeed.initialize`` returns; and
ZeRO-2 and ZeRO-3 through the ``transformers`` Trainer's ``deepspeed=`` config (accelerate's
DeepSpeed path) with :class:`fk.hf.FkCallback`. Under ZeRO-3 the head's weight is an empty
partition outside its module's call: fk's loss runs inside the head's hooks
(:mod:`fk.hf.sharding_hooks`).

On a CPU machine (CI) the processes join a gloo group, DeepSpeed runs on its CPU accelerator, the
models are fp32, fk's kernels run in Triton's interpreter, and 2 processes run (a partition of
one process is the whole tensor: 2 test the sharding). On a GPU machine the same cases run in bf16
on an NCCL group of 1 GPU, then of 2 where there are (``nox -s gpu``). Each world size starts its
processes once and runs every case there (starting them and DeepSpeed's engines is the expensive
part), once per session even under pytest-xdist (the first worker to ask runs them; the others
read its results). Skipped where DeepSpeed is not installed.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import fk.hf
from fk.core import testing

deepspeed = pytest.importorskip("deepspeed")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

sys.path.insert(0, str(Path(__file__).parent))
from test_hf_trainer_fsdp import fused_losses  # noqa: E402

VOCAB, BATCH, SEQ, STEPS = 128, 4, 16, 3
CUDA = torch.cuda.is_available()
WORLDS = ((1, 2) if torch.cuda.device_count() >= 2 else (1,)) if CUDA else (2,)
LOSS_TOL: dict[str, Any] = {"rtol": 2e-2, "atol": 2e-2} if CUDA else {"rtol": 1e-5, "atol": 1e-5}
GRAD_TOL: dict[str, Any] = {"rtol": 5e-2, "atol": 2e-3} if CUDA else {"rtol": 1e-4, "atol": 1e-6}

# name -> how the case is built: ZeRO stage, CPU offload, tied embeddings, zero.Init, PEFT LoRA,
# gradient checkpointing ("reentrant" / "non_reentrant"), through the Trainer.
CASES: dict[str, dict[str, Any]] = {
    "zero2": {"stage": 2},
    "zero2_tied": {"stage": 2, "tied": True},
    "zero2_offload": {"stage": 2, "offload": True},
    "zero3": {"stage": 3},
    "zero3_tied": {"stage": 3, "tied": True},
    "zero3_offload": {"stage": 3, "offload": True},
    "zero3_offload_tied": {"stage": 3, "offload": True, "tied": True},
    "zero3_init_tied": {"stage": 3, "zero_init": True, "tied": True},
    "zero3_lora": {"stage": 3, "lora": True},
    "zero3_checkpointing": {"stage": 3, "checkpointing": "non_reentrant"},
    "zero3_checkpointing_reentrant": {"stage": 3, "checkpointing": "reentrant", "tied": True},
    "trainer_zero2": {"stage": 2, "trainer": True},
    "trainer_zero3_offload": {"stage": 3, "offload": True, "trainer": True},
}


def ds_config(stage: int, *, offload: bool = False, micro_batch: int | str = "auto", lr: float | str = "auto") -> dict:
    """A DeepSpeed config: ZeRO ``stage``, AdamW in PyTorch (``torch_adam``: no DeepSpeed op to
    build), bf16 on a GPU; ``offload`` moves the optimizer states (and, for ZeRO-3, the parameters)
    to the CPU."""
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:  # partition every parameter (the default keeps those under 100k elements whole, on every rank)
        zero["stage3_param_persistence_threshold"] = 0
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1, "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.0, "torch_adam": True}},
        "zero_force_ds_cpu_optimizer": False, "bf16": {"enabled": CUDA},
    }  # fmt: skip


def _llama_config(case: dict[str, Any]) -> Any:
    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=case.get("tied", False),
    )  # fmt: skip


def _model(case: dict[str, Any], patched: bool, config: dict[str, Any]) -> Any:
    torch.manual_seed(0)
    if case.get("zero_init"):
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = transformers.LlamaForCausalLM(_llama_config(case))
    else:
        model = transformers.LlamaForCausalLM(_llama_config(case))
    if case.get("checkpointing"):
        use_reentrant = case["checkpointing"] == "reentrant"
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    if case.get("lora"):
        targets = ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
        model = peft.get_peft_model(model, lora)
    if patched and not case.get("trainer"):
        fk.hf.apply(model)
    return model.train()


def _tokens(world: int, rank: int) -> torch.Tensor:
    """``[STEPS, BATCH / world, SEQ]``: this rank's rows of each step's batch (every row scores
    SEQ - 1 tokens, so the mean over ranks is the mean over the batch)."""
    ids = torch.randint(0, VOCAB, (STEPS, BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    rows = BATCH // world
    return ids[:, rank * rows : (rank + 1) * rows]


def _head_weight(model: Any) -> torch.Tensor:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    weight: torch.Tensor = base.lm_head.weight
    return weight


def _mean_over_ranks(value: torch.Tensor) -> float:
    value = value.detach().float().clone()
    if dist.get_world_size() > 1:
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return float(value)


def _train_engine(case: dict[str, Any], patched: bool, world: int, rank: int) -> dict[str, Any]:
    """STEPS steps through ``deepspeed.initialize``'s engine: the losses (mean over ranks), whether
    every forward skipped the logits, the head's whole gradient after the first backward (None
    when frozen), and how many elements the head's weight held (ZeRO-3: 0 when not gathered) in
    each backward of the first layer's MLP."""
    config = ds_config(case["stage"], offload=case.get("offload", False), micro_batch=BATCH // world, lr=1e-2)
    model = _model(case, patched, config)
    engine, *_ = deepspeed.initialize(model=model, config=config)
    device = engine.device
    head_in_backward: list[int] = []
    base = engine.module.get_base_model() if case.get("lora") else engine.module
    base.model.layers[0].mlp.register_full_backward_hook(
        lambda *_: head_in_backward.append(_head_weight(engine.module).numel())
    )
    losses, skipped, head_grad = [], True, None
    for ids in _tokens(world, rank).to(device):
        out = engine(input_ids=ids, labels=ids)
        engine.backward(out.loss)
        if not losses:
            grad = deepspeed.utils.safe_get_full_grad(_head_weight(engine.module))
            head_grad = None if grad is None else grad.detach().float().cpu().clone()
        engine.step()
        losses.append(_mean_over_ranks(out.loss))
        skipped = skipped and out.logits is None
    engine.destroy()
    return {"losses": losses, "skipped": skipped, "head_grad": head_grad, "head_in_backward": head_in_backward}


def _train_trainer(case: dict[str, Any], patched: bool, world: int, rank: int, out_dir: Path) -> dict[str, Any]:
    """STEPS steps of the ``transformers`` Trainer with ``deepspeed=`` (accelerate's DeepSpeed path),
    fk through :class:`fk.hf.FkCallback`: the losses it logged, and whether fk's fused loss ran."""
    rows = [{"input_ids": ids, "labels": ids.clone()} for ids in _tokens(1, 0).reshape(-1, SEQ)]
    config = ds_config(case["stage"], offload=case.get("offload", False))
    args = transformers.TrainingArguments(
        output_dir=str(out_dir / f"trainer{rank}"), per_device_train_batch_size=BATCH // world, max_steps=STEPS,
        logging_steps=1, learning_rate=1e-2, weight_decay=0.0, lr_scheduler_type="constant", report_to=[],
        save_strategy="no", disable_tqdm=True, deepspeed=config, bf16=CUDA, use_cpu=not CUDA, seed=0,
        dataloader_drop_last=True,
    )  # fmt: skip
    with fused_losses() as fused:
        callbacks = [fk.hf.FkCallback()] if patched else []
        trainer = transformers.Trainer(model=_model(case, patched, config), args=args, train_dataset=rows,
                                       callbacks=callbacks)  # fmt: skip
        trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return {"losses": losses, "skipped": len(fused) == STEPS, "head_grad": None}


def _worker(rank: int, world: int, out_dir: Path) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")  # (read by accelerate; the group exists)
    results = {}
    for name, case in CASES.items():
        for patched in (False, True):
            run = _train_trainer(case, patched, world, rank, out_dir) if case.get("trainer") else None
            results[name, patched] = run or _train_engine(case, patched, world, rank)
    torch.save(results, out_dir / f"rank{rank}.pt")


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"world{w}")
def ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict[Any, Any]]:
    from filelock import FileLock  # (a dependency of huggingface_hub, so of transformers)

    world: int = request.param
    shared = tmp_path_factory.getbasetemp()
    shared = shared.parent if "PYTEST_XDIST_WORKER" in os.environ else shared  # (the session's, under xdist)
    out_dir = shared / f"deepspeed_world{world}"
    with FileLock(str(out_dir) + ".lock"):
        if not (out_dir / "done").exists():
            out_dir.mkdir(exist_ok=True)
            backend = "nccl" if CUDA else "gloo"
            # (spawned: the Trainer cases let accelerate raise torch's thread count, which hangs a forked child)
            testing.run_distributed(_worker, out_dir, world_size=world, timeout_s=300, backend=backend,
                                    start_method="spawn")  # fmt: skip
            (out_dir / "done").touch()
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(world)]


@pytest.mark.parametrize("name", list(CASES))
def test_fk_matches_stock_under_deepspeed(ranks: list[dict[Any, Any]], name: str) -> None:
    fk_run, stock_run = ranks[0][name, True], ranks[0][name, False]
    assert fk_run["skipped"], "fk's fused loss did not run (the patched forward took the logits path)"
    assert not stock_run["skipped"]
    assert len(fk_run["losses"]) == STEPS
    torch.testing.assert_close(torch.tensor(fk_run["losses"]), torch.tensor(stock_run["losses"]), **LOSS_TOL)
    assert all(r[name, True]["losses"] == fk_run["losses"] for r in ranks)  # every rank saw the same means
    case = CASES[name]
    if case.get("trainer"):
        return
    # ZeRO-3 gathers the head's weight for its own backward only, for fk's loss as for stock's logits
    # (a loss that read the weight outside the head's call would hold it through every layer's backward).
    assert fk_run["head_in_backward"] == stock_run["head_in_backward"]
    assert len(fk_run["head_in_backward"]) == STEPS
    if case.get("lora"):
        assert fk_run["head_grad"] is None and stock_run["head_grad"] is None  # the frozen head has none
        return
    assert fk_run["head_grad"] is not None and stock_run["head_grad"] is not None
    assert fk_run["head_grad"].abs().sum() > 0
    torch.testing.assert_close(fk_run["head_grad"], stock_run["head_grad"], **GRAD_TOL)
