"""fk.core: what two or more fk kernel packages share.

- ``fk.core.backend``: which path runs for a tensor (compiled Triton, interpreter, reference).
- ``fk.core.launch``: tile and grid sizing for row-wise kernels.
- ``fk.core.validate``: input checks that name the argument, run before any launch.
- ``fk.core.ops``: ``torch.library`` registration so ``torch.compile(fullgraph=True)`` traces fk ops.
- ``fk.core.forward``: give one module another ``forward`` by swapping its class (fk.hf, fk.lora).
- ``fk.core.testing``: reference comparison, awkward sizes, hypothesis strategies (tests only).
- ``fk.core.bench``: timing, peak memory, hardware ceilings, JSON records and plots (benchmarks only).
- ``fk.core.vendor``: ``python -m fk.core.vendor <package> --into <dir>`` copies a kernel package
  and fk.core into another project's tree.

This file imports nothing on purpose: ``fk.core.pytest_plugin`` must be able to switch Triton's
interpreter on before anything imports Triton.
"""
