"""Where does fk's peak memory on GLM-4 (bench_e2e.py --family glm4) exceed Liger's?

GLM-4 at the Llama-3.2-1B shape, bf16, full fine-tune, 4 x 2048 tokens, AdamW: the peak of
``torch.cuda.max_memory_allocated()`` over 2 steps after 1 warm-up, and the bytes held for the
backward at the end of a forward (``fk.hf.training``'s ``measure_saved``), for stock, Liger (its
GLM-4 defaults) and fk with all switches, then with one switch off at a time. One process per
provider (Liger patches classes globally).

Run on a GPU:  python benchmarks/experiments/glm4_memory.py
"""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from fk.hf import training

SWITCH_SETS = {"fk": {}, "fk qkv off": {"qkv": False}, "fk swiglu off": {"swiglu": False},
               "fk rms_norm off": {"rms_norm": False}, "fk flce off": {"flce": False}}  # fmt: skip


def one(provider: str) -> dict[str, float]:
    if provider == "liger":
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

        MODEL_TYPE_TO_APPLY_LIGER_FN["glm4"]()
    model = training.build_model(training.SHAPES["llama-3.2-1b"], dtype=torch.bfloat16, device="cuda", seed=0,
                                 max_positions=2048, model_type="glm4")  # fmt: skip
    if provider.startswith("fk"):
        import fk.hf

        fk.hf.apply(model, **SWITCH_SETS[provider])
    corpus = training.MarkovCorpus(128256, active=1024, branching=4)
    r = training.train(model, corpus, steps=3, warmup=1, batch=4, seq=2048, lr=1e-4, measure_saved=True)
    return {"peak_gib": (r.peak_bytes or 0) / 2**30, "saved_gib": (r.saved_bytes or 0) / 2**30,
            "tokens_per_s": r.tokens_per_s}  # fmt: skip


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--one":
        print(json.dumps(one(sys.argv[2])))
        return
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'provider':16} {'peak GiB':>9} {'saved GiB':>10} {'tokens/s':>9}")
    for provider in ("stock", "liger", *SWITCH_SETS):
        out = subprocess.run([sys.executable, __file__, "--one", provider], capture_output=True, text=True)
        if out.returncode:
            print(f"{provider:16} failed: {out.stderr.strip().splitlines()[-1]}")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{provider:16} {r['peak_gib']:9.2f} {r['saved_gib']:10.2f} {r['tokens_per_s']:9.0f}", flush=True)


if __name__ == "__main__":
    main()
