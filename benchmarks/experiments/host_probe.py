"""Host time per call: a bare Triton launch and its parts, fk's ops against Liger's and stock
PyTorch's, and the modules of one decoder layer of bench_e2e.py's model, stock and fk-patched.

Each case is called several times while the GPU spins on a sleep kernel, so the queue never drains
and only the host is timed; the median over 7 such rounds is printed in microseconds per call. The
calls per round are few enough that their launches fit in the GPU's queue (about a thousand): a
full queue blocks the host until the sleep ends, which shows as sleep/calls, about 3000 us. "fwd" is
the forward with autograd recording, "fwd+bwd" adds ``backward`` of the output(s).

``lora`` times bench_lora.py's LoRA blocks (Llama-3.1-8B shapes, 4096 tokens, fp32 adapters),
PEFT and fk; ``syncs`` runs them, and one training step of bench_e2e.py's model (full and LoRA,
fk-patched), under ``torch.cuda.set_sync_debug_mode("warn")`` and prints where the host waited
for the GPU.

Run on a GPU:  python benchmarks/experiments/host_probe.py [triton|ops|layer|lora|syncs ...]
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

CALLS, ROUNDS = 50, 7


def host_us(fn: Callable[[], Any], calls: int = CALLS) -> float:
    fn()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(ROUNDS):
        torch.cuda._sleep(int(3e8))  # ~0.15 s of GPU spin, longer than the calls take to enqueue
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(rounds)


def show(name: str, fn: Callable[[], Any], calls: int = CALLS) -> None:
    print(f"{name:58s} {host_us(fn, calls):8.1f} us", flush=True)


@triton.jit
def _noop_kernel(a, b, c, d, n_rows, n_cols, stride_a, stride_b, eps, A: tl.constexpr, B: tl.constexpr):
    if tl.program_id(0) < 0:  # never true: the kernel only has to be launched
        tl.store(a, tl.load(b) + tl.load(c) + tl.load(d) + n_rows + n_cols + stride_a + stride_b + eps)


def probe_triton() -> None:
    from triton.runtime import driver

    x = [torch.empty(64, 64, device="cuda") for _ in range(4)]
    args = (*x, 64, 64, 64, 64, 1e-6)
    compiled = _noop_kernel[(1,)](*args, A=1, B=2, num_warps=4)
    show("torch: x.add_(1) (one ATen launch)", lambda: x[0].add_(1))
    show("torch: torch.empty(64, 64)", lambda: torch.empty(64, 64, device="cuda"))
    show("triton: kernel[grid](...) (11 args, 2 constexpr)", lambda: _noop_kernel[(1,)](*args, A=1, B=2, num_warps=4))
    device = driver.active.get_current_device()
    show("triton part: driver.get_current_device()", driver.active.get_current_device)
    show("triton part: driver.get_current_stream(device)", lambda: driver.active.get_current_stream(device))
    binder = _noop_kernel.device_caches[device][4]
    show("triton part: binder(*args) (specialization)", lambda: binder(*args, A=1, B=2, num_warps=4))
    stream = driver.active.get_current_stream(device)
    run, function, meta = compiled.run, compiled.function, compiled.packed_metadata
    full = (*args, 1, 2)
    show(
        "triton: compiled.run(...) (launcher alone)",
        lambda: run(1, 1, 1, stream, function, meta, None, None, None, *full),
    )


def probe_ops() -> None:
    import fk.glu
    import fk.norms
    import fk.rope

    liger: dict[str, Any] = {}
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
        from liger_kernel.transformers.rope import liger_rotary_pos_emb

        liger = {"rms": LigerRMSNormFunction.apply, "swiglu": LigerSiLUMulFunction.apply, "rope": liger_rotary_pos_emb}
    except ImportError:
        print("liger-kernel not installed: its rows are left out")
    dev, bf16 = "cuda", torch.bfloat16
    x = torch.randn(8192, 2048, device=dev, dtype=bf16, requires_grad=True)
    res = torch.randn(8192, 2048, device=dev, dtype=bf16, requires_grad=True)
    w = torch.ones(2048, device=dev, dtype=bf16, requires_grad=True)
    gate = torch.randn(8192, 8192, device=dev, dtype=bf16, requires_grad=True)
    up = torch.randn(8192, 8192, device=dev, dtype=bf16, requires_grad=True)
    q = torch.randn(4, 2048, 32, 64, device=dev, dtype=bf16).transpose(1, 2).requires_grad_()
    k = torch.randn(4, 2048, 8, 64, device=dev, dtype=bf16).transpose(1, 2).requires_grad_()
    cos = torch.randn(1, 2048, 64, device=dev, dtype=bf16)
    sin = torch.randn(1, 2048, 64, device=dev, dtype=bf16)

    def torch_rms(x: torch.Tensor) -> torch.Tensor:  # Hugging Face's LlamaRMSNorm forward
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)
        return w * h.to(x.dtype)

    def torch_rope(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        def rot(t: torch.Tensor) -> torch.Tensor:
            return torch.cat((-t[..., 32:], t[..., :32]), dim=-1)

        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * c + rot(q) * s, k * c + rot(k) * s

    cases: dict[str, dict[str, Callable[[], Any]]] = {
        "rms_norm": {
            "fk": lambda: fk.norms.rms_norm(x, w, 1e-5),
            "liger": lambda: liger["rms"](x, w, 1e-5, 0.0, "llama", True),
            "torch (HF eager)": lambda: torch_rms(x),
        },
        "fused_add_rms_norm": {
            "fk": lambda: fk.norms.fused_add_rms_norm(x, res, w, 1e-5),
            "torch (add + HF eager)": lambda: (torch_rms(x + res), x + res),
        },
        "swiglu": {
            "fk": lambda: fk.glu.swiglu(gate, up),
            "liger": lambda: liger["swiglu"](gate, up),
            "torch (HF eager)": lambda: torch.nn.functional.silu(gate) * up,
        },
        "rope (q, k)": {
            "fk": lambda: fk.rope.apply_rotary_pos_emb(q, k, cos, sin),
            "liger": lambda: liger["rope"](q, k, cos, sin),
            "torch (HF eager)": lambda: torch_rope(q, k),
        },
    }
    for op, providers in cases.items():
        for provider, fn in providers.items():
            if provider == "liger" and not liger:
                continue
            show(f"{op} {provider}: fwd", fn)

            def fwd_bwd(fn: Callable[[], Any] = fn) -> None:
                out = fn()
                outs = out if isinstance(out, tuple) else (out,)
                torch.autograd.backward([o for o in outs], [torch.ones_like(o) for o in outs])

            show(f"{op} {provider}: fwd+bwd", fwd_bwd, calls=10)


def probe_layer() -> None:
    import fk.hf
    from fk.hf import training

    shape = dataclasses.replace(training.SHAPES["llama-3.2-1b"], layers=1)
    models = {}
    for provider in ("stock", "fk"):
        model = training.build_model(shape, dtype=torch.bfloat16, device="cuda", seed=0, max_positions=2048)
        if provider == "fk":
            fk.hf.apply(model)
        models[provider] = model
    x = torch.randn(4, 2048, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    positions = torch.arange(2048, device="cuda")[None].expand(4, -1)
    for provider, model in models.items():
        layer = model.model.layers[0]
        embeddings = model.model.rotary_emb(x, positions)
        parts: dict[str, Callable[[], Any]] = {
            "input_layernorm": lambda layer=layer: layer.input_layernorm(x),
            "self_attn": lambda layer=layer, e=embeddings: layer.self_attn(
                x, position_embeddings=e, attention_mask=None
            )[0],
            "mlp": lambda layer=layer: layer.mlp(x),
            "decoder layer": lambda layer=layer, e=embeddings: layer(x, position_embeddings=e, attention_mask=None),
            "rotary_emb": lambda model=model: model.model.rotary_emb(x, positions)[0],
        }
        for name, fn in parts.items():
            show(f"{provider} {name}: fwd", fn, calls=5)
    with torch.no_grad():
        for provider, model in models.items():
            layer = model.model.layers[0]
            embeddings = model.model.rotary_emb(x, positions)
            show(
                f"{provider} decoder layer: fwd, no_grad",
                lambda e=embeddings, layer=layer: layer(x, position_embeddings=e),
                calls=5,
            )


def _lora_cases() -> Any:
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    import bench_lora

    for block in bench_lora.BLOCKS:
        for dropout in (0.0, 0.05):
            model = bench_lora._lora_model(block, dropout, 16, 32, torch.float32)
            fn = bench_lora._call(model, block)
            x = torch.randn(4096, bench_lora.HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            with torch.no_grad():
                dys = [torch.randn_like(o) for o in fn(x)]

            def fwd_bwd(fn: Callable[..., Any] = fn, x: torch.Tensor = x, dys: list[torch.Tensor] = dys) -> None:
                torch.autograd.backward(fn(x), dys)

            yield f"{block} dropout {dropout}", model, fwd_bwd


def probe_lora() -> None:
    import fk.lora

    for name, model, fwd_bwd in _lora_cases():
        show(f"lora {name} peft: fwd+bwd", fwd_bwd, calls=5)
        fk.lora.patch(model)
        show(f"lora {name} fk: fwd+bwd", fwd_bwd, calls=5)


def _syncs(name: str, fn: Callable[[], Any]) -> None:
    import traceback
    import warnings

    fn()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            sites = []

            def showwarning(message: Any, *args: Any, **kwargs: Any) -> None:
                frames = [f for f in traceback.extract_stack()[:-1] if "warnings" not in f.filename]
                ours = [
                    f"{f.filename.split('/src/')[-1]}:{f.lineno} {f.name}" for f in frames if "/src/fk/" in f.filename
                ]
                last = " <- ".join(f"{f.filename.split('/')[-1]}:{f.lineno} {f.name}" for f in reversed(frames[-2:]))
                sites.append(f"{str(message)[:70]}  [{' <- '.join(reversed(ours[-3:])) or last}]")

            warnings.showwarning = showwarning
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    print(f"{name}: {len(sites)} synchronizing calls", flush=True)
    for site in dict.fromkeys(sites):
        print(f"    {site}")


def probe_syncs() -> None:
    import fk.hf
    import fk.lora
    from fk.hf import training

    for name, model, fwd_bwd in _lora_cases():
        fk.lora.patch(model)
        _syncs(f"lora {name} fk fwd+bwd", fwd_bwd)
    for lora in (False, True):
        model = training.build_model(
            dataclasses.replace(training.SHAPES["llama-3.2-1b"], layers=2), dtype=torch.bfloat16, device="cuda",
            seed=0, lora=lora, max_positions=2048,
        )  # fmt: skip
        fk.hf.apply(model)
        opt = training.make_optimizer(model, 1e-4)
        tokens = torch.randint(0, 128256, (4, 2048), device="cuda")

        def step(model: Any = model, opt: Any = opt, tokens: torch.Tensor = tokens) -> None:
            model(input_ids=tokens, labels=tokens).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        _syncs(f"e2e {'lora' if lora else 'full'} fk step (forward, backward, optimizer)", step)


if __name__ == "__main__":
    import torch.version

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    for what in sys.argv[1:] or ["triton", "ops", "layer"]:
        {"triton": probe_triton, "ops": probe_ops, "layer": probe_layer, "lora": probe_lora, "syncs": probe_syncs}[
            what
        ]()
