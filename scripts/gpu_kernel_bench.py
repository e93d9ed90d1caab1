"""Time the Triton verification kernels against their torch references on one CUDA GPU.

Prints a markdown table (milliseconds per call, median over repeats, torch.cuda.synchronize()
around every timed loop) and checks that every Triton result equals the reference; exits 1 on a
mismatch. Usage: python scripts/gpu_kernel_bench.py [--iters 20] [--repeats 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bastion.kernels import reference as R  # noqa: E402

NODES = (16, 64, 256)
VOCABS = (49152, 151936)
PREFIX_LEN = 2048


def timed(fn, iters: int, repeats: int) -> float:
    """Median milliseconds per call of ``fn`` (after a warm-up that also triggers compilation)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) * 1000.0 / iters)
    return statistics.median(samples)


def random_tree(n: int, vocab: int, rng: random.Random) -> tuple[list[int], list[int]]:
    parents, tokens, used = [-1], [rng.randrange(vocab)], {}
    for i in range(1, n):
        p = rng.randrange(max(0, i - 6), i) if rng.random() < 0.7 else rng.randrange(i)
        siblings = used.setdefault(p, set())
        tok = rng.randrange(vocab)
        while tok in siblings:
            tok = rng.randrange(vocab)
        siblings.add(tok)
        parents.append(p)
        tokens.append(tok)
    return parents, tokens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to time", file=sys.stderr)
        return 2
    from bastion.kernels import triton_kernels as TK

    dev = torch.device("cuda")
    rows: list[tuple[str, int, str, float, float, bool]] = []
    bench = lambda f: timed(f, args.iters, args.repeats)  # noqa: E731

    gen = torch.Generator(device=dev).manual_seed(0)
    for vocab in VOCABS:
        for n in NODES:
            x = (torch.randn(n, vocab, device=dev, generator=gen) * 3).to(torch.bfloat16)
            thresholds = R.filter_thresholds(x.float() / 0.7, 50, 0.9)
            cases = [("node_choice T=0", 0.0, None), ("node_choice T=0.7", 0.7, None),
                     ("node_choice T=0.7 top-k/p", 0.7, thresholds)]
            for name, temperature, thr in cases:
                ok = torch.equal(TK.node_choice(x, temperature, thr, seed=5, offset=n),
                                 R.node_choice_torch(x, temperature, thr, seed=5, offset=n))
                t_triton = bench(lambda: TK.node_choice(x, temperature, thr, seed=5, offset=n))
                t_torch = bench(lambda: R.node_choice_torch(x, temperature, thr, seed=5, offset=n))
                rows.append((name, n, str(vocab), t_triton, t_torch, ok))
            rows.append(("filter_thresholds (shared pre-pass)", n, str(vocab),
                         float("nan"), bench(lambda: R.filter_thresholds(x.float() / 0.7, 50, 0.9)), True))

    rng = random.Random(0)
    for n in NODES:
        parents, tokens = random_tree(n, 1000, rng)
        picks = [rng.randrange(1000) for _ in range(n)]
        for i in range(1, n):  # let the walk go somewhere: the target often agrees with a child
            if rng.random() < 0.8:
                picks[parents[i]] = tokens[i]
        choices = torch.tensor(picks, device=dev)
        ok = TK.tree_walk(parents, tokens, choices) == R.tree_walk_torch(parents, tokens, choices)
        rows.append(("tree_walk", n, "-", bench(lambda: TK.tree_walk(parents, tokens, choices)),
                     bench(lambda: R.tree_walk_torch(parents, tokens, choices)), ok))
        got = TK.tree_mask(parents, PREFIX_LEN, torch.bfloat16, dev)
        want = R.tree_mask_torch(parents, PREFIX_LEN, torch.bfloat16, dev)
        ok = torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        rows.append((f"tree_mask bf16 prefix {PREFIX_LEN}", n, "-",
                     bench(lambda: TK.tree_mask(parents, PREFIX_LEN, torch.bfloat16, dev)),
                     bench(lambda: R.tree_mask_torch(parents, PREFIX_LEN, torch.bfloat16, dev)), ok))

    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}; ms per call "
          f"(median of {args.repeats} x {args.iters} calls)\n")
    print("| kernel | n | V | triton ms | torch ms | speed-up | equal |")
    print("|---|---:|---:|---:|---:|---:|:---:|")
    for name, n, vocab, t_triton, t_torch, ok in rows:
        speedup = "-" if t_triton != t_triton else f"{t_torch / t_triton:.1f}x"
        triton_ms = "-" if t_triton != t_triton else f"{t_triton:.3f}"
        print(f"| {name} | {n} | {vocab} | {triton_ms} | {t_torch:.3f} | {speedup} | {'yes' if ok else 'NO'} |")
    bad = [r for r in rows if not r[5]]
    if bad:
        print(f"\n{len(bad)} MISMATCH(ES) between triton and torch", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
