"""#33's throughput target against its floor, in one process pair: bench_memory.py's throughput step
(Llama-3.2-1B shape, DeepSpeed ZeRO-3 without offload, bf16, 4 x 2048 tokens a GPU) taking turns
with the same step at 1 x 64 tokens a GPU (next to no compute: the same all-gathers, hooks,
reduce-scatters and optimizer step; zero3_step_floor's floor), on one engine, so that the spread
between processes (up to 30% in zero3_step_floor) cancels out of their ratio. Rank 0 prints the
medians of the full and the floor step, their ratio (the full step's time over its floor's), and
every time.

Run on 2 GPUs:  torchrun --standalone --nproc-per-node 2 benchmarks/experiments/zero3_floor_ab.py PROVIDER [ROUNDS]
(PROVIDER: stock, fk, liger, or a zero3_step_probe.py variant; ROUNDS: pairs of steps, default 12)
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from zero3_step_probe import build  # benchmarks/experiments/

FULL, FLOOR = (2048, 4), (64, 1)  # (tokens a sequence, sequences a GPU)
WARMUP = 2  # steps of each shape before the timed ones


def main() -> None:
    provider = sys.argv[1]
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 12
    _, step, rank = build(provider, FULL[1])
    times: dict[tuple[int, int], list[float]] = {FULL: [], FLOOR: []}
    i = 0
    for r in range(WARMUP + rounds):
        for shape in (FULL, FLOOR) if r % 2 == 0 else (FLOOR, FULL):  # alternating which goes first
            seconds = step(i, *shape)
            i += 1
            if r >= WARMUP:
                times[shape].append(seconds)
    if rank == 0:
        full, floor = (statistics.median(times[s]) for s in (FULL, FLOOR))
        print(f"{provider}: full step ({FULL[1]} x {FULL[0]} tokens a GPU) median {1e3 * full:.1f} ms, "
              f"floor step ({FLOOR[1]} x {FLOOR[0]}) median {1e3 * floor:.1f} ms, full / floor {full / floor:.3f}")  # fmt: skip
        for shape, values in times.items():
            print(f"  {shape[1]} x {shape[0]}: {[round(1e3 * t, 1) for t in values]}")


if __name__ == "__main__":
    main()
