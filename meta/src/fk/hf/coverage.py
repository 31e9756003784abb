"""Which model types of the installed transformers fk.hf patches, checked on tiny random models.

``python -m fk.hf.coverage --out docs/models.md`` builds a tiny random model (the default config
built again with 2 layers, hidden size 64, vocabulary 300 and the other sizes of :data:`SMALL`, so
that the sizes a config derives follow them, and a layer of every kind) of every type in
transformers' causal-LM, image-text-to-text and sequence-to-sequence LM registries (a causal LM
of a composite config's text model on its text config; an encoder-decoder's text batch goes to its
encoder, the labels to its decoder), patches a copy with :func:`fk.hf.apply`, and compares the loss and
every gradient of a text-only batch with the stock model's, in fp32 on the CPU (with
``TRITON_INTERPRET=1``, fk's kernels run in Triton's interpreter). It writes one row per type: the
block kinds patched and what stayed stock and why; a type transformers cannot build small, or whose
stock model does not run on text alone, is listed as such. ``meta/tests/test_hf_registry.py`` runs
the same check for every type.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import inspect
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from fk.hf.probe import relative_error

SMALL: dict[str, int] = {
    "num_hidden_layers": 2, "num_layers": 2, "n_layer": 2, "hidden_size": 64, "n_embd": 64, "d_model": 64,
    "intermediate_size": 128, "ffn_dim": 128, "n_inner": 128, "d_ff": 128, "num_attention_heads": 4, "n_head": 4,
    "num_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 300, "max_position_embeddings": 128,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64, "num_experts": 4, "num_local_experts": 4,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1,
    "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
    "sliding_window": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
    "linear_value_head_dim": 16, "depth": 2, "embed_dim": 64, "out_hidden_size": 64, "n_group": 2, "topk_group": 1,
    "index_n_heads": 4, "index_head_dim": 16, "index_topk": 8, "vocab_size_per_layer_input": 300,
    "hidden_size_per_layer_input": 16, "num_kv_shared_layers": 0, "shared_experts_intermediate_size": 64, "n_groups": 2,
    "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4, "decoder_attention_heads": 4,
    "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "decoder_vocab_size": 300,
    "unpadded_vocab_size": 300, "moe_hidden_size": 32, "dense_intermediate_size": 128,
    "shared_intermediate_size": 64, "moe_shared_expert_intermediate_size": 64, "hidden_size_global": 64,
    "encoder_hash_byte_group_vocab": 300, "cross_attn_k": 1, "projector_hidden_size": 64, "merged_hidden_size": 256,
    "projection_hidden_dim": 64, "projection_dim": 64, "text_hidden_size": 64, "vision_hidden_size": 64,
    "image_token_embed_dim": 64, "num_embeddings": 64, "adapter_out_dim": 64, "base_channels": 32,
    "latent_channels": 16, "codebook_size": 64,
}  # fmt: skip
"""Config attributes set where a default config has them (ints only), to make every model tiny."""
SPECIAL_TOKENS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id")
VOCAB, SEQ = SMALL["vocab_size"], 12
TOLERANCE = 1e-4
FLOOR = 1e-5
"""A tensor agrees when ``‖fk - stock‖ <= TOLERANCE ‖stock‖ + FLOOR G`` (fp32), ``G`` the largest
gradient norm of the model: a wrong block is off by order 1; rounding in fp32, even through a
recurrent model's long sums, by under 1e-5; the floor lets a gradient that is zero but for
rounding (an attention key's bias: softmax does not see it) differ by rounding."""
MAX_PARAMETERS = 20_000_000
"""A model larger than this with the shrunken config is not built (its config did not shrink)."""


def tiny_config(model_type: str, every_kind: bool = True) -> Any:
    """transformers' default config of ``model_type`` made tiny (:func:`_shrunk`; ``every_kind``: see
    :func:`_layer_lists`)."""
    from transformers import CONFIG_MAPPING

    return _shrunk(CONFIG_MAPPING[model_type](), every_kind)


def _get(config: Any, name: str) -> Any:
    try:
        return getattr(config, name, None)
    except Exception:  # a per-layer attribute of a heterogeneous config raises on a global read:
        # its global value is the layers' default (see :func:`_per_layer_overrides`)
        read_global = getattr(config, "_getattr_without_heterogeneous_validation", None)
        try:
            return read_global(name, None) if read_global is not None else None
        except Exception:
            return None


def _per_layer_overrides(config: Any) -> dict[int, dict[str, Any]]:
    """A heterogeneous config's overrides of its global values, by layer index (transformers'
    ``per_layer_config``: DOTS-3 Note's sliding layers have heads and ranks of their own); empty
    for any other config."""
    spec = vars(config).get("_heterogeneity_spec")
    return {int(i): dict(values) for i, values in (getattr(spec, "per_layer_overrides", None) or {}).items()}


def _set(config: Any, name: str, value: Any) -> None:
    with contextlib.suppress(Exception):  # a read-only property: the default stays
        setattr(config, name, value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _small_values(config: Any) -> dict[str, int]:
    """:data:`SMALL`'s values of the attributes ``config`` holds as ints, then :func:`_unset_sizes`
    and :func:`_dependent_sizes`."""
    small = {name: value for name, value in SMALL.items() if _is_int(_get(config, name))}
    small.update({name: value for name, value in _unset_sizes(config).items() if name not in small})
    small.update(_dependent_sizes(config, small))
    return small


def _unset_sizes(config: Any) -> dict[str, int]:
    """Sizes ``config``'s class declares and its default leaves None though the modeling code reads
    them: ``head_dim`` (hidden size over heads), ``num_key_value_heads`` (the head count) and, where
    there are experts, ``num_experts_per_tok``; the experts' counts, routed and shared, where only
    their size is set (dots1)."""
    unset = {"head_dim": SMALL["hidden_size"] // SMALL["num_attention_heads"],
             "num_key_value_heads": SMALL["num_attention_heads"]}  # fmt: skip
    counts = ("num_experts", "num_local_experts", "n_routed_experts")
    sized_experts = _is_int(_get(config, "moe_intermediate_size"))
    if sized_experts:
        unset.update({name: SMALL[name] for name in (*counts, "n_shared_experts")})
    if sized_experts or any(_is_int(_get(config, name)) for name in counts):
        unset["num_experts_per_tok"] = SMALL["num_experts_per_tok"]
    declared = _declared(type(config))
    return {name: value for name, value in unset.items() if name in declared and _get(config, name) is None}


def _dependent_sizes(config: Any, small: dict[str, int]) -> dict[str, int]:
    """Sizes that must follow the others (``small``), where ``config``'s default ties them so:
    multi-head latent attention's ``qk_head_dim`` (the sum of its two parts), its ``head_dim`` (the
    rotary part's, where the default has them equal) and its key-value heads (one a head, likewise);
    Mamba-2's ``head_dim`` (its heads span the expanded width); a partial rotary ``rotary_dim`` (half
    the head)."""
    dependent = {}
    latent = _is_int(_get(config, "kv_lora_rank"))
    rope_dim = _get(config, "qk_rope_head_dim")
    if _is_int(rope_dim) and _get(config, "head_dim") == rope_dim:
        dependent["head_dim"] = SMALL["qk_rope_head_dim"]
    if latent and _get(config, "num_key_value_heads") == _get(config, "num_attention_heads"):
        dependent["num_key_value_heads"] = SMALL["num_attention_heads"]
    if _is_int(_get(config, "qk_head_dim")) and "qk_nope_head_dim" in small and "qk_rope_head_dim" in small:
        dependent["qk_head_dim"] = small["qk_nope_head_dim"] + small["qk_rope_head_dim"]
    heads, head_dim, expand = (_get(config, name) for name in ("num_heads", "head_dim", "expand"))
    if all(_is_int(v) for v in (heads, head_dim, expand)) and heads * head_dim == expand * _get(config, "hidden_size"):
        dependent["head_dim"] = expand * SMALL["hidden_size"] // SMALL["num_heads"]
    if _is_int(_get(config, "rotary_dim")):
        dependent["rotary_dim"] = SMALL["hidden_size"] // SMALL["num_attention_heads"] // 2
    return dependent


def _layer_lists(config: Any, layers: Any, every_kind: bool, small: dict[str, Any]) -> dict[str, Any]:
    """``config``'s per-layer lists longer than ``layers``, cut: the kinds of layer
    (``layer_types``, ``layers_block_type``) with ``every_kind`` to the first layer of each kind, in
    order, and the layers after the first until there are ``layers`` (so that every kind is built: a
    hybrid model's attention, Gemma's global layers), with ``num_hidden_layers`` raised to the
    kinds' count where there are more kinds; else, and lists of layer indices (``mlp_only_layers``),
    to their first ``layers``. A heterogeneous config's per-layer overrides follow the layers kept,
    their sizes made small as the config's own (``small``, else :data:`SMALL`)."""
    if not _is_int(layers):
        return {}
    cut: dict[str, Any] = {}
    kept = list(range(layers))
    for name in ("layer_types", "layers_block_type"):
        kinds = _get(config, name)
        if not isinstance(kinds, list) or len(kinds) <= layers:
            continue
        firsts = sorted({kind: i for i, kind in reversed(list(enumerate(kinds)))}.values()) if every_kind else []
        rest = [i for i in range(len(kinds)) if i not in firsts][: max(layers - len(firsts), 0)]
        kept = sorted(firsts + rest)
        cut[name] = [kinds[i] for i in kept]
        layers = len(cut[name])
    value = _get(config, "mlp_only_layers")
    if isinstance(value, list) and len(value) > layers:
        cut["mlp_only_layers"] = value[:layers]
    if cut and layers != _get(config, "num_hidden_layers"):
        cut["num_hidden_layers"] = layers
    overrides = _per_layer_overrides(config)
    if overrides:
        sizes = {**SMALL, **small}
        cut["per_layer_config"] = {
            new: {name: sizes[name] if name in sizes and _is_int(value) else value
                  for name, value in overrides[old].items()}
            for new, old in enumerate(kept) if old in overrides
        }  # fmt: skip
    return cut


def _declared(cls: type) -> set[str]:
    """The arguments a config class takes: its dataclass fields, else its ``__init__``'s parameters."""
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    return set(inspect.signature(cls).parameters)


def _shrunk(config: Any, every_kind: bool = True) -> Any:
    """``config`` made tiny. Built again by its class with :func:`_small_values` and its layer lists
    cut (:func:`_layer_lists`), those it takes as arguments, so that what it derives from them
    follows (multi-head latent attention's ``head_dim`` from ``qk_rope_head_dim``); the others set
    where the class left them at their default (a value it derives is not set over); the default's
    sub-configs, and what it holds beyond its class's own attributes, carried over (a parent config
    sets some on its sub-configs after building them). Where the class does not build so, every
    value is set on the default instead. Then special token ids are moved inside the vocabulary, and
    each sub-config is made tiny the same way."""
    small: dict[str, Any] = dict(_small_values(config))
    layers = small.get("num_hidden_layers", _get(config, "num_hidden_layers"))
    small.update(_layer_lists(config, layers, every_kind, small))
    taken = _declared(type(config)) | {"per_layer_config"}  # (every config takes that, into its kwargs)
    try:
        rebuilt = type(config)(**{name: value for name, value in small.items() if name in taken})
    except Exception:  # (a class that does not build from these): each set on the default
        rebuilt = None
    for name, value in small.items():
        if rebuilt is None or (name not in taken and _get(rebuilt, name) == _get(config, name)):
            _set(rebuilt if rebuilt is not None else config, name, value)  # (not derived by the class)
    if rebuilt is not None:
        subs = getattr(rebuilt, "sub_configs", {})
        for name, value in vars(config).items():  # what a parent config set on this one (and its sub-configs)
            if name not in vars(rebuilt) or name in subs:
                _set(rebuilt, name, value)
        config = rebuilt
    for name in SPECIAL_TOKENS:
        value = _get(config, name)
        if isinstance(value, int) and value >= VOCAB:
            _set(config, name, 1)
        elif isinstance(value, list):
            _set(config, name, [v if v < VOCAB else 1 for v in value])
    if getattr(config, "is_encoder_decoder", False) and _get(config, "decoder_start_token_id") is None:
        _set(config, "decoder_start_token_id", 0)  # (T5's checkpoints start the decoder at its pad token, 0)
    rope = _get(config, "rope_parameters")
    # Qwen-VL: rotary sections of head_dim / 2 (Qwen2-VL's default config has none, and its model
    # falls back to full-size ones; its class names the key among those it validates apart).
    takes_sections = "mrope_section" in getattr(type(config), "ignore_keys_at_rope_validation", ())
    if isinstance(rope, dict) and (isinstance(rope.get("mrope_section"), list) or takes_sections):
        heads, hidden = _get(config, "num_attention_heads"), _get(config, "hidden_size")
        head_dim = _get(config, "head_dim") or (hidden // heads if heads and hidden else 16)
        half = int(head_dim * rope.get("partial_rotary_factor", 1.0)) // 2  # (GLM-4V-MoE rotates half of each head)
        _set(config, "rope_parameters", {**rope, "mrope_section": [half - 2 * (half // 3), half // 3, half // 3]})
    for name in getattr(config, "sub_configs", {}):  # text, vision, audio, ... configs
        sub = _get(config, name)
        if sub is not None and hasattr(sub, "to_dict"):
            _set(config, name, _shrunk(sub, every_kind))
    return config


@dataclass
class Row:
    """What :func:`check` found for one model type."""

    model_type: str
    status: str
    """``"patched"`` (loss and gradients equal stock's), ``"nothing patched"``, ``"mismatch"``,
    ``"fk raised"``, or ``"not checked"`` (transformers could not build or run it small, or two stock runs differ)."""
    patched: dict[str, int] = field(default_factory=dict)
    stock: dict[str, str] = field(default_factory=dict)
    detail: str = ""


def registries() -> dict[str, dict[str, str]]:
    """transformers' causal-LM, image-text-to-text and sequence-to-sequence LM registries: model
    type -> class name."""
    from transformers.models.auto import modeling_auto

    return {
        "causal_lm": dict(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
        "image_text_to_text": dict(modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES),
        "seq2seq_lm": dict(modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES),
    }


def _build(model_type: str, registry: str) -> Any:
    """The tiny model, with a layer of every kind where its class builds that (:func:`_layer_lists`:
    some tie weights across two layers of a kind, or need sizes their default leaves unset for a
    kind), else with its first layers."""
    try:
        return _built(model_type, registry, every_kind=True)
    except Exception:
        return _built(model_type, registry, every_kind=False)


def _built(model_type: str, registry: str, every_kind: bool) -> Any:
    import transformers

    cls = getattr(transformers, registries()[registry][model_type])
    config = tiny_config(model_type, every_kind)
    text_config = getattr(config, "sub_configs", {}).get("text_config")
    if text_config is not None and getattr(cls, "config_class", None) is text_config:  # (as the Auto classes do)
        config = config.get_text_config()  # a causal LM of a composite config's text model
    with torch.device("meta"):  # counted first: a config that does not shrink stays unbuilt
        size = sum(p.numel() for p in cls._from_config(config).parameters())
    if size > MAX_PARAMETERS:
        raise ValueError(f"{size / 1e6:.0f}M parameters with the shrunken config: not tiny")
    torch.manual_seed(0)
    model = cls._from_config(config)
    with torch.no_grad():  # norm weights away from their init (zeros or ones), so that they matter
        for name, param in model.named_parameters():
            if "norm" in name.rpartition(".")[0].rpartition(".")[2].lower():
                param.add_(0.2 * torch.randn_like(param))
    return model.float().train()


def _loss_and_grads(
    model: Any, ids: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    import random

    import numpy as np

    torch.manual_seed(1)  # the same dropout masks (and numpy's random attention blocks: BigBird) for both models
    random.seed(1)
    np.random.seed(1)
    out = model(input_ids=ids, labels=labels, use_cache=False)
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), grads


def check(model_type: str, registry: str = "causal_lm") -> Row:
    """Build ``model_type`` tiny, patch a copy, compare loss and gradients with stock's."""
    import fk.hf

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            stock = _build(model_type, registry)
            ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(0))
            labels = ids.clone()
            labels[0, :3] = -100
            want, want_grads = _loss_and_grads(stock, ids, labels)
            patched = copy.deepcopy(stock)
            patched.zero_grad(set_to_none=True)
            again = copy.deepcopy(patched)  # (to tell a model whose stock runs differ from a mismatch)
        except Exception as e:
            return Row(model_type, "not checked", detail=f"{type(e).__name__}: {str(e)[:160]}")
        try:
            report = fk.hf.apply(patched)
            got, got_grads = _loss_and_grads(patched, ids, labels)
        except Exception as e:
            return Row(model_type, "fk raised", detail=f"{type(e).__name__}: {str(e)[:300]}")
    counts = {k: v for k, v in report.items() if v}
    row = Row(model_type, "patched" if counts else "nothing patched", counts, dict(report.stock))
    if got_grads.keys() != want_grads.keys():
        row.status, row.detail = (
            "mismatch",
            f"gradients of other parameters: {sorted(got_grads.keys() ^ want_grads.keys())}",
        )
        return row
    differs = _first_difference(got, got_grads, want, want_grads)
    if differs is not None and _first_difference(*_loss_and_grads(again, ids, labels), want, want_grads) is not None:
        return Row(model_type, "not checked", detail="stock is not deterministic: two stock runs differ")
    if differs is not None:
        row.status, row.detail = "mismatch", differs
    return row


def _first_difference(got: torch.Tensor, got_grads: dict[str, torch.Tensor], want: torch.Tensor,
                      want_grads: dict[str, torch.Tensor]) -> str | None:  # fmt: skip
    """The first of the loss and the gradients that does not agree (see :data:`FLOOR`), or None."""
    scale = max((float(g.double().norm()) for g in want_grads.values()), default=0.0)
    pairs = {"loss": (got, want), **{n: (got_grads[n], g) for n, g in want_grads.items()}}
    for name, (a, b) in pairs.items():
        error = float((a.double() - b.double()).norm())
        if not error <= TOLERANCE * float(b.double().norm()) + FLOOR * scale:  # (NaN fails too)
            return f"{name}: relative error {relative_error(a, b):.1e}"
    return None


def markdown(rows: dict[str, list[Row]]) -> str:
    import transformers

    lines = [
        "# Model coverage",
        "",
        f"Generated by `python -m fk.hf.coverage` with transformers {transformers.__version__} and torch "
        f"{torch.__version__}: every model type of transformers' causal-LM, image-text-to-text and sequence-to-sequence LM registries, "
        "built tiny and random (2 layers, or one of each kind where there are more kinds; hidden size 64), patched with `fk.hf.apply`, loss and every gradient "
        "of a text-only batch compared with the stock model's in fp32 on the CPU (fk's kernels in Triton's "
        "interpreter). `meta/tests/test_hf_registry.py` asserts the same for every type.",
        "",
    ]
    for registry, found in rows.items():
        patched = [r for r in found if r.status == "patched"]
        lines += [f"## {registry}", "", f"{len(patched)} of {len(found)} types patched with loss and gradients "
                  f"equal to stock's; {sum(r.status == 'not checked' for r in found)} not checked (not buildable small, or stock not deterministic); "
                  f"{sum(r.status in ('mismatch', 'fk raised') for r in found)} mismatches or fk errors.", "",
                  "| model type | status | patched | left stock (why) |", "| --- | --- | --- | --- |"]  # fmt: skip
        for r in found:
            what = ", ".join(f"{k} {v}" for k, v in r.patched.items())
            why = "; ".join(f"{k} ({v})" for k, v in r.stock.items()) or r.detail
            lines.append(f"| {r.model_type} | {r.status} | {what} | {why.replace('|', '/')} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the markdown page here (default: print it)")
    parser.add_argument("--types", nargs="*", help="only these model types")
    args = parser.parse_args(argv)
    import transformers

    transformers.logging.set_verbosity_error()
    rows = {name: [check(t, name) for t in sorted(types) if not args.types or t in args.types]
            for name, types in registries().items()}  # fmt: skip
    page = markdown(rows)
    if args.out:
        with open(args.out, "w") as f:
            f.write(page)
    else:
        print(page)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
