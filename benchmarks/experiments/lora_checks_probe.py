"""Host time of the checks a patched PEFT LoRA module runs at every call, against those of a
given earlier commit: ``fk.lora.patching._call_parts`` (is the module still plain LoRA) and the
argument checks on what it returns (``_check_parts``, and since c66c159 ``_module_parts``).

Pure Python on CPU tensors (a tiny LlamaForCausalLM with PEFT LoRA on q/k/v/o/gate/up/down); the
earlier ``patching.py`` is read from git and loaded beside the current one. timeit, the best of 7
rounds of 20000 calls.

Run anywhere:  python benchmarks/experiments/lora_checks_probe.py [--before c0c6b7d]
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import timeit
from pathlib import Path
from typing import Any

import peft
import torch
import transformers

from fk.lora import lora, patching


def _load_old_patching(commit: str) -> Any:
    source = subprocess.run(
        ["git", "show", f"{commit}:packages/fk-lora/src/fk/lora/patching.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = Path(tempfile.mkdtemp()) / "old_patching.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("old_patching", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["old_patching"] = module  # (dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


def _us(fn: Any, n: int = 20000) -> float:
    return min(timeit.repeat(fn, number=n, repeat=7)) / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", default="c0c6b7d", help="the commit whose checks to compare with")
    args = parser.parse_args()
    old = _load_old_patching(args.before)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=64)  # fmt: skip
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    lora_config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    model = peft.get_peft_model(base, lora_config)  # fp32 adapters on a bf16 model: PEFT's default
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    parts = patching._call_parts(q_proj, x)
    assert not isinstance(parts, str) and tuple(parts) == tuple(old._call_parts(q_proj, x))
    print(f"# {sys.platform}, torch {torch.__version__}, peft {peft.__version__}; before = {args.before}")
    print(f"_call_parts per call:     before {_us(lambda: old._call_parts(q_proj, x)):5.1f} us, "
          f"now {_us(lambda: patching._call_parts(q_proj, x)):5.1f} us")  # fmt: skip
    print(f"checks per projection:    _check_parts {_us(lambda: lora._check_parts('', x, parts)):5.1f} us, "
          f"_module_parts {_us(lambda: lora._module_parts('', x, parts)):5.1f} us")  # fmt: skip


if __name__ == "__main__":
    main()
