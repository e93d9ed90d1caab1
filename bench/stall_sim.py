"""How the latency model's stall guards pay: a simulation, no model, a few seconds of CPU.

A CPU-like verification cost curve (16 ms a step, +1.1 ms a row, a 3 ms step at 7 rows, a little
per context token), probed once as the engine probes; then 400 rounds in which a budget rule picks
the tree size that maximises S(n) / (T + predicted C(n)) — S a saturating expected-accepted curve —
and the model observes the size's true cost (3% noise). In rounds 20–59 a quarter of the
verifications stall 2–12× (another process; a browser drawing on the same cores). Reported, mean
over 20 seeds: true tokens/s of rounds 100–399, mean tree size there, and the median over seeds of
the worst row count's relative prediction error after the last round.

    python bench/stall_sim.py        # guards on (the default) against a plain running average
"""

from __future__ import annotations

import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from transformers import LlamaConfig  # noqa: E402

from bastion.hardware import HardwareSpec, ModelSpec  # noqa: E402
from bastion.latency import LatencyModel  # noqa: E402

OVERHEAD_S = 0.006  # draft + bookkeeping of a round


def truth(s: int, c: int) -> float:
    return 0.016 + 0.0011 * (s - 1) + (0.003 if s >= 7 else 0.0) + 2e-6 * c


def accepted(s: int) -> float:
    return 1 + 1.3 * (1 - 0.6 ** (s - 1))


def model(guards: bool) -> LatencyModel:
    cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True)
    lm = LatencyModel(ModelSpec.from_config(cfg), HardwareSpec("sim", 160e9, 34e9))
    if not guards:
        lm.shape_step, lm.shape_relax, lm.robust_fit = float("inf"), 0.0, False
    lm.observe_many([(s, 300, truth(s, 300)) for s in list(range(1, 17)) + [32, 64]], anchor=True)
    return lm


def run(guards: bool, seed: int, stalls: bool = True) -> tuple[float, float, float]:
    rng, lm = random.Random(seed), model(guards)
    tokens = seconds = 0.0
    sizes = []
    for r in range(400):
        c = 300 + 3 * r
        s = max(range(1, 12), key=lambda n: accepted(n) / (OVERHEAD_S + lm.predict(n, c)))
        t = truth(s, c) * (1 + rng.gauss(0, 0.03))
        if stalls and 20 <= r < 60 and rng.random() < 0.25:
            t *= rng.uniform(2, 12)
        lm.observe(s, c, t)
        if r >= 100:
            tokens, seconds = tokens + accepted(s), seconds + OVERHEAD_S + truth(s, c)
            sizes.append(s)
    worst = max(abs(lm.predict(n, c) / truth(n, c) - 1) for n in range(1, 12))
    return tokens / seconds, statistics.mean(sizes), worst


def main() -> None:
    for stalls in (True, False):
        for guards in (False, True):
            res = [run(guards, seed, stalls) for seed in range(20)]
            print(f"{'stalls' if stalls else 'quiet ':6s} {'guards' if guards else 'plain ':6s}  "
                  f"tok/s {statistics.mean(r[0] for r in res):5.1f}  tree {statistics.mean(r[1] for r in res):.2f}  "
                  f"worst error at the end {statistics.median(r[2] for r in res):.0%}")


if __name__ == "__main__":
    main()
