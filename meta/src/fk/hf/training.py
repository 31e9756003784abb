"""Train a Llama-architecture model from random init on a synthetic corpus, and measure it.

Shared by the training demo (``python -m fk.hf.demo``) and the end-to-end benchmark
(``benchmarks/bench_e2e.py``), so both build, feed and step the model the same way:

- :class:`ModelShape` and :data:`SHAPES`: the model sizes used (``tiny`` for a CPU run through
  Triton's interpreter, ``demo`` for the GPU demo, ``llama-3.2-1b``, ``llama-3.1-8b`` and
  ``llama-3.2-3b`` for the benchmarks);
- :func:`build_model`: a ``LlamaForCausalLM`` from random init (one seed, one set of weights),
  optionally wrapped as a PEFT LoRA model (r=16, alpha=32, all seven linear projections), on
  4-bit bases for QLoRA (:func:`quantize_4bit`);
- :class:`MarkovCorpus`: a deterministic token stream with structure a model can learn, so the
  loss visibly falls (nothing is downloaded);
- :func:`train`: AdamW steps (fused where available), each one timed, with CUDA's peak memory on a
  GPU and the bytes held for backward on CPU;
- :func:`word_tokenizer`: a tokenizer over a model's whole vocabulary, built on the spot, for the
  trainers that need a processing class (TRL's; nothing downloaded);
- vision-language models (Gemma 3, Qwen2.5-VL) with a text model of a shape, and their batches with
  images: :mod:`fk.hf.vision_language`.

Importing this module imports torch only; ``transformers`` (and ``peft`` for LoRA, ``bitsandbytes``
for QLoRA) when a model is built, ``tokenizers`` when a tokenizer is.
"""

from __future__ import annotations

import contextlib
import gc
import math
import statistics
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from fk.hf import vision_language

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Every linear projection of a Llama layer: the LoRA adapters go on all seven."""


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a Llama-architecture model (``transformers.LlamaConfig``'s fields)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tie_word_embeddings: bool = True

    def config(self, max_positions: int = 8192, model_type: str = "llama") -> Any:
        """The ``LlamaConfig`` (Llama 3's RMSNorm epsilon and rope theta; default rope scaling), or
        the config of another ``model_type`` with the same fields (its other settings its defaults,
        and its own rotary settings where it keeps one per kind of layer, as Gemma 4), with
        :data:`MOE_FIELDS` and :data:`FAMILY_FIELDS`; for a vision-language family
        (:data:`fk.hf.vision_language.FAMILIES`), its config with a text model of this shape."""
        from transformers import CONFIG_MAPPING

        if model_type in vision_language.FAMILIES:  # (the text model is of this shape)
            family = vision_language.FAMILIES[model_type]
            text = self.config(max_positions, family.text_type)
            return family.build(text, tiny=self.hidden < vision_language.TINY_BELOW)
        config_class: Any = CONFIG_MAPPING[model_type]  # (a config class of Llama's fields)
        fields = dict(
            vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.intermediate,
            num_hidden_layers=self.layers, num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
            head_dim=self.head_dim, tie_word_embeddings=self.tie_word_embeddings, rms_norm_eps=1e-5,
            max_position_embeddings=max_positions, rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
            bos_token_id=None, eos_token_id=None, pad_token_id=None,
        )  # fmt: skip
        fields.update({name: size(self) for name, size in MOE_FIELDS.get(model_type, {}).items()})
        fields.update(FAMILY_FIELDS.get(model_type, {}))
        default_rope = getattr(config_class(), "rope_parameters", None)
        if isinstance(default_rope, dict) and all(isinstance(v, dict) for v in default_rope.values()):
            del fields["rope_parameters"]  # (one per kind of layer, as Gemma 4's: the family's own)
        return config_class(**fields)

    def parameters(self) -> int:
        """How many parameters the model has (the tied head counted once), without building it."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        layer = self.hidden * (2 * q + 2 * kv) + 3 * self.hidden * self.intermediate + 2 * self.hidden
        head = 0 if self.tie_word_embeddings else self.vocab * self.hidden
        return self.vocab * self.hidden + self.layers * layer + self.hidden + head

    def describe(self) -> str:
        return (
            f"hidden {self.hidden}, intermediate {self.intermediate}, {self.layers} layers, "
            f"{self.heads}/{self.kv_heads} heads of {self.head_dim}, vocab {self.vocab}, "
            f"{'tied' if self.tie_word_embeddings else 'untied'} embeddings, {_millions(self.parameters())} parameters"
        )


def _expert_size(shape: ModelShape) -> int:
    """A quarter of the dense intermediate size, a multiple of 8 (grouped matmuls need 16-byte strides)."""
    return max(8, shape.intermediate // 32 * 8)


MOE_FIELDS: dict[str, dict[str, Callable[[ModelShape], int]]] = {
    # 8 experts of a quarter of the dense intermediate size, 2 a token: the MLP's parameters twice
    # the dense model's, its FLOPs half (the defaults, 32 to 128 experts, make a 1B shape 5-20B).
    "gpt_oss": {"num_local_experts": lambda s: 8, "num_experts_per_tok": lambda s: 2,
                "intermediate_size": _expert_size},
    "qwen3_moe": {"num_experts": lambda s: 8, "num_experts_per_tok": lambda s: 2,
                  "moe_intermediate_size": _expert_size},
    # Llama 4: one routed expert a token beside a shared one of the same size (its release's layout).
    "llama4_text": {"num_local_experts": lambda s: 8, "num_experts_per_tok": lambda s: 1,
                    "intermediate_size": _expert_size, "intermediate_size_mlp": lambda s: s.intermediate},
}  # fmt: skip
"""The expert fields of the mixture-of-experts families ``ModelShape.config`` builds, from the shape."""

FAMILY_FIELDS: dict[str, dict[str, Any]] = {
    # Gemma 4 without its per-layer input embeddings: a second vocabulary-sized table, 256 wide for
    # every layer (1.1B parameters at 16 layers), that the shape does not count.
    "gemma4_text": {"hidden_size_per_layer_input": 0},
}
"""Other settings of a family's config that ``ModelShape.config`` builds."""


def _millions(n: int) -> str:
    return f"{n / 1e6:.0f}M" if n >= 10**7 else f"{n / 1e6:.2g}M"


SHAPES: dict[str, ModelShape] = {
    # Small enough that a few dozen steps run in seconds in Triton's interpreter on a CPU.
    "tiny": ModelShape(hidden=64, intermediate=176, layers=2, heads=4, kv_heads=2, head_dim=16, vocab=512),
    # tiny with an intermediate size that is a multiple of the 4-bit blocksize (64): for QLoRA on a CPU,
    # where bitsandbytes 0.50 dequantizes some other widths wrongly (fk-lora's tests/test_qlora.py).
    "tiny-qlora": ModelShape(hidden=64, intermediate=192, layers=2, heads=4, kv_heads=2, head_dim=16, vocab=512),
    # Llama-3.2-1B's layer and vocabulary with 4 layers: the logits dominate memory.
    "demo": ModelShape(hidden=2048, intermediate=8192, layers=4, heads=32, kv_heads=8, head_dim=64, vocab=128256),
    # Llama-3.2-1B (tied embeddings, as released).
    "llama-3.2-1b": ModelShape(
        hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8, head_dim=64, vocab=128256
    ),
    # Llama-3.1-8B (untied embeddings, as released): bench_e2e's QLoRA at an 8B shape (--shape).
    "llama-3.1-8b": ModelShape(
        hidden=4096,
        intermediate=14336,
        layers=32,
        heads=32,
        kv_heads=8,
        head_dim=128,
        vocab=128256,
        tie_word_embeddings=False,
    ),
    # Llama-3.2-3B (tied embeddings, as released): the memory benchmark's ZeRO-3 offload scenario.
    "llama-3.2-3b": ModelShape(
        hidden=3072, intermediate=8192, layers=28, heads=24, kv_heads=8, head_dim=128, vocab=128256
    ),
}


def build_model(
    shape: ModelShape,
    *,
    dtype: torch.dtype,
    device: str | torch.device,
    seed: int = 0,
    lora: bool = False,
    qlora: bool = False,
    qlora_recipe: bool = False,
    lora_dropout: float | None = None,
    max_positions: int = 8192,
    model_type: str = "llama",
) -> torch.nn.Module:
    """A ``LlamaForCausalLM`` of ``shape`` from random init (transformers' own initialization),
    built directly on ``device`` in ``dtype``, in training mode; or the causal LM of another
    ``model_type`` with the same sizes (its class in transformers' causal-LM registry; for a family
    of :data:`fk.hf.vision_language.FAMILIES`, its image-text-to-text class: feed it
    :func:`fk.hf.vision_language.image_inputs`).

    The same ``seed`` gives the same weights. With ``lora``, it is wrapped by
    ``peft.get_peft_model`` with r=16, alpha=32, no dropout, on all seven linear projections of
    every layer (:data:`LORA_TARGETS`); the base (embedding, norms, head) is frozen, and the
    adapters are kept in PEFT's default dtype (fp32 next to a bf16 base). With ``qlora`` (which
    implies ``lora``), the seven projections of every layer are first made 4-bit
    (:func:`quantize_4bit`), so PEFT puts its bitsandbytes LoRA layers on them; the embedding,
    norms and head stay in ``dtype``. ``qlora_recipe`` (which implies ``qlora``) prepares the model
    as PEFT's and the QLoRA paper's examples do: ``peft.prepare_model_for_kbit_training`` (without
    gradient checkpointing) casts the embedding, norms and head to fp32 (so the hidden states are
    fp32; train it under bf16 autocast: :func:`train`'s ``autocast``) before the adapters are added,
    with LoRA dropout 0.05. ``lora_dropout`` sets the adapters' dropout (default: 0, or the
    recipe's :data:`RECIPE_LORA_DROPOUT`). Raises ``ImportError`` with an install hint when peft (or,
    for ``qlora``, bitsandbytes) is missing.
    """
    import transformers
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    qlora = qlora or qlora_recipe
    peft = _import_peft() if lora or qlora else None
    names = (
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
        if model_type in vision_language.FAMILIES
        else MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    )
    causal_lm = getattr(transformers, names[model_type])
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model: torch.nn.Module = causal_lm(shape.config(max_positions, model_type))
    finally:
        torch.set_default_dtype(previous)
    if qlora:
        quantize_4bit(model, LORA_TARGETS, compute_dtype=dtype)
    if peft is not None and qlora_recipe:
        model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    if peft is not None:
        dropout = lora_dropout if lora_dropout is not None else RECIPE_LORA_DROPOUT if qlora_recipe else 0.0
        config = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=dropout, target_modules=list(LORA_TARGETS))
        with warnings.catch_warnings():  # peft 0.21 calls a transformers 5 method that warns of its rename
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            model = peft.get_peft_model(model, config)
    return model.train()


RECIPE_LORA_DROPOUT = 0.05
"""LoRA dropout of :func:`build_model`'s ``qlora_recipe`` (the QLoRA paper's for 7B and 13B models, and
the usual one of PEFT's and TRL's LoRA examples)."""

QLORA_QUANT_TYPE, QLORA_BLOCKSIZE = "nf4", 64
"""QLoRA's 4-bit format (its paper's, and Hugging Face's usual ``BitsAndBytesConfig``): NF4 in blocks
of 64, the absmax quantized again (bitsandbytes' nested quantization, ``compress_statistics``, in
blocks of 256)."""


def quantize_4bit(
    model: torch.nn.Module,
    names: Iterable[str],
    *,
    compute_dtype: torch.dtype,
    device: str | torch.device | None = None,
) -> int:
    """Replace each ``nn.Linear`` of ``model`` whose attribute name is in ``names`` by a bitsandbytes
    ``Linear4bit`` of its weight (:data:`QLORA_QUANT_TYPE`, ``compute_dtype`` compute), quantized on
    ``device`` (default: the weight's), and flag ``model`` as transformers flags a model loaded in
    4 bits (PEFT reads ``is_loaded_in_4bit`` to choose its bitsandbytes LoRA layers). Returns how
    many were replaced."""
    try:
        import bitsandbytes as bnb
    except ImportError as exc:
        raise ImportError("QLoRA needs bitsandbytes, which is not installed: pip install fk-lora[qlora]") from exc
    wanted = set(names)
    replaced = 0
    for parent in list(model.modules()):
        for name, linear in list(parent.named_children()):
            if name not in wanted or type(linear) is not torch.nn.Linear:
                continue
            target = linear.weight.device if device is None else device
            layer = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                      compute_dtype=compute_dtype, quant_type=QLORA_QUANT_TYPE,
                                      device="meta")  # fmt: skip
            layer.weight = bnb.nn.Params4bit(linear.weight.data.to("cpu", compute_dtype), requires_grad=False,
                                             quant_type=QLORA_QUANT_TYPE, blocksize=QLORA_BLOCKSIZE,
                                             compress_statistics=True)  # fmt: skip
            if linear.bias is not None:
                layer.bias = torch.nn.Parameter(linear.bias.data.to("cpu"), requires_grad=False)
            setattr(parent, name, layer.to(target))  # (Params4bit quantizes as it moves there)
            replaced += 1
    setattr(model, "is_loaded_in_4bit", True)  # noqa: B010 (an attribute PEFT reads, not the module's own)
    return replaced


def _import_peft() -> Any:
    try:
        import peft
    except ImportError as exc:
        raise ImportError(
            "LoRA needs peft, which is not installed: pip install peft (fk.lora is tested with peft 0.21)"
        ) from exc
    return peft


def make_optimizer(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters; ``fused=True`` on CUDA (one kernel for all of them)."""
    params = [p for p in model.parameters() if p.requires_grad]
    fused = bool(params) and params[0].is_cuda
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, fused=fused)


class MarkovCorpus:
    """A deterministic token stream a language model can learn: a random sparse Markov chain.

    Only the first ``active`` token ids occur. Each has ``branching`` successors, drawn once from
    ``seed``; each next token is one of its current token's successors, uniformly. A model first
    learns which tokens occur (loss from ``ln(vocab)`` towards ``ln(active)``), then the
    transitions, down to the chain's entropy ``ln(branching)`` (:attr:`floor`). :meth:`batch`
    depends only on the seed and the step, so every run sees the same tokens.
    """

    def __init__(self, vocab: int, active: int = 1024, branching: int = 4, seed: int = 0) -> None:
        if not 0 < active <= vocab or branching < 1:
            raise ValueError(f"need 0 < active <= vocab and branching >= 1, got {active}, {vocab}, {branching}")
        self.active, self.branching, self.seed = active, branching, seed
        gen = torch.Generator().manual_seed(seed)
        self.successors = torch.randint(0, active, (active, branching), generator=gen)

    @property
    def floor(self) -> float:
        """The chain's entropy per token: the lowest loss a model can reach (nats)."""
        return math.log(self.branching)

    def batch(self, step: int, batch: int, seq: int) -> torch.Tensor:
        """``[batch, seq]`` token ids for training step ``step`` (int64, on CPU)."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step + 1)
        choices = torch.randint(0, self.branching, (seq, batch), generator=gen)
        tokens = torch.empty(seq, batch, dtype=torch.long)
        tokens[0] = torch.randint(0, self.active, (batch,), generator=gen)
        for t in range(1, seq):
            tokens[t] = self.successors[tokens[t - 1], choices[t]]
        return tokens.t().contiguous()


def word_tokenizer(vocab: int) -> Any:
    """A ``transformers.PreTrainedTokenizerFast`` over ``vocab`` tokens: ``<pad>`` (0), ``<unk>``
    (1), ``</s>`` (2, ends a sequence), then the words ``t3`` ... ``t{vocab-1}`` (word ``ti`` is token
    ``i``). Text is split at whitespace and nothing is added around it, so a text of ``n`` words is
    ``n`` tokens, and any token id decodes. (The special tokens are no prefix of a word: the
    tokenizer cuts them out of a text wherever they occur.)"""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = ["<pad>", "<unk>", "</s>"]
    words = {**{token: i for i, token in enumerate(specials)}, **{f"t{i}": i for i in range(len(specials), vocab)}}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", unk_token="<unk>", eos_token="</s>"
    )


@contextlib.contextmanager
def saved_for_backward(model: torch.nn.Module) -> Iterator[list[int]]:
    """Count the bytes of the tensors autograd keeps for the backward pass while the block runs.

    Yields a one-element list that holds the count: each distinct storage is counted once, and the
    model's parameters (saved by reference, they cost nothing extra) are not counted. This is the
    activation memory of a training step on any device (on CPU, where CUDA's peak is not available);
    it leaves out transient buffers that live within one operation (stock's fp32 logits in the
    loss's backward, for instance).
    """
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set()
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in params and ptr not in seen:
            seen.add(ptr)
            total[0] += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield total


@dataclass
class RunResult:
    """What :func:`train` measured: one entry per step."""

    losses: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    host_seconds: list[float] = field(default_factory=list)
    """Per step, the host's time to issue it: from the step's start until its last operation is
    queued, before the loss is read. Far below :attr:`step_seconds`, the step waited on the device;
    close to it, on the host (or on a synchronization inside the step)."""
    gc_seconds: list[float] = field(default_factory=list)
    """Per step, the time Python's garbage collector ran during it (``gc.callbacks``)."""
    tokens_per_step: int = 0
    warmup: int = 0
    """Leading steps left out of :attr:`tokens_per_s` (compilation, autotuning, first allocations)."""
    peak_bytes: int | None = None
    """``torch.cuda.max_memory_allocated()`` over the steps after the warm-up (weights, gradients,
    optimizer states and activations); None on CPU."""
    saved_bytes: int | None = None
    """The most bytes held for backward in one step (see :func:`saved_for_backward`), when measured."""
    logits_returned: bool = True
    """Whether the forward returned logits (a fused loss, as fk.hf's or Liger's, returns none)."""

    @property
    def median_step_s(self) -> float:
        timed = self.step_seconds[self.warmup :] or self.step_seconds
        return statistics.median(timed)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.median_step_s


def train(
    model: torch.nn.Module,
    corpus: MarkovCorpus,
    *,
    steps: int,
    batch: int,
    seq: int,
    lr: float,
    warmup: int = 0,
    measure_saved: bool = False,
    optimizer: torch.optim.Optimizer | None = None,
    first_step: int = 0,
    steps_iter: Callable[[Iterable[int]], Iterable[int]] | None = None,
    autocast: torch.dtype | None = None,
    inputs: Callable[[torch.Tensor], dict[str, torch.Tensor]] | None = None,
) -> RunResult:
    """Run ``steps`` training steps of ``model`` on ``corpus`` and measure each.

    A step: forward with ``labels=input_ids`` (the model shifts them), backward, AdamW step
    (:func:`make_optimizer`, unless ``optimizer`` is given), gradients set to None. Each step is
    timed wall-clock between two device synchronizations (so host overhead counts, as it does in
    training); :attr:`RunResult.tokens_per_s` is from the median of the steps after ``warmup``.
    On CUDA the peak-memory counter is reset after the warm-up steps. ``measure_saved`` also counts
    the bytes held for backward (:func:`saved_for_backward`). ``steps_iter`` wraps the step range
    (a progress bar); ``first_step`` picks the corpus batches (step ``first_step + i``). ``autocast``:
    the forward runs under ``torch.autocast`` to that dtype (HF Trainer's ``bf16=True``). ``inputs``
    makes the model's inputs from a batch of tokens (made before the step's clock starts; default:
    ``input_ids`` and ``labels`` the tokens; :func:`fk.hf.vision_language.image_inputs` for a
    vision-language model). Each step
    also records the host's time to issue it and the garbage collector's time in it
    (:attr:`RunResult.host_seconds`, :attr:`RunResult.gc_seconds`): where step times vary, they
    say whether the host or the device varied.
    """
    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    opt = optimizer if optimizer is not None else make_optimizer(model, lr)
    result = RunResult(tokens_per_step=batch * seq, warmup=min(warmup, max(steps - 1, 0)))
    saved = 0
    indices: Iterable[int] = range(steps)
    collector = _GcClock()
    gc.callbacks.append(collector)
    try:
        for i in steps_iter(indices) if steps_iter is not None else indices:
            if cuda and i == result.warmup:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            tokens = corpus.batch(first_step + i, batch, seq)
            feed = {"input_ids": tokens, "labels": tokens} if inputs is None else inputs(tokens)
            feed = {name: value.to(device, non_blocking=True) for name, value in feed.items()}
            _sync(device)
            start, gc_before = time.perf_counter(), collector.seconds
            casting = torch.autocast(device.type, dtype=autocast) if autocast is not None else contextlib.nullcontext()
            with saved_for_backward(model) if measure_saved else contextlib.nullcontext([0]) as held, casting:
                out = model(**feed)
            loss, result.logits_returned = out.loss, out.logits is not None
            del out
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            result.host_seconds.append(time.perf_counter() - start)
            value = loss.item()  # synchronizes
            _sync(device)
            result.step_seconds.append(time.perf_counter() - start)
            result.gc_seconds.append(collector.seconds - gc_before)
            result.losses.append(value)
            saved = max(saved, held[0])
    finally:
        gc.callbacks.remove(collector)
    if cuda:
        result.peak_bytes = torch.cuda.max_memory_allocated()
    if measure_saved:
        result.saved_bytes = saved
    return result


class _GcClock:
    """A ``gc.callbacks`` entry that sums the seconds Python's garbage collector runs."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._began = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._began


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
