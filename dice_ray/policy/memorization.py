"""Measure the SFT warm start: does the tiny policy reproduce its training solutions well enough to compile?

    python -m dice_ray.policy.memorization [--pairs 40] [--samples 4] [--steps N] [--no-cache]

Trains (or loads from the SFT cache) a policy on ``--pairs`` (prompt, target) pairs of the built-in suite,
then samples each prompt greedily and ``--samples`` times at temperature 1.0 (dynamic remasking, the RL
rollout setting) and reports, per decoding mode: exact-match rate, mean similarity (difflib ratio), the
share with similarity >= 0.9 and, when NVRTC is available (``dice_ray.verify.candidate.nvrtc.compile_cuda``), the share
whose CUDA source compiles. Pairs come from ``dice_ray.tasks.prompts.sft_pairs`` when it exists, else from
:func:`fallback_pairs`.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import time
from pathlib import Path

from dice_ray.config import ModelConfig, SamplingConfig, SFTConfig
from dice_ray.policy.policy import DiffusionPolicy
from dice_ray.policy.sampler import sample_group
from dice_ray.policy.sft import warm_start

BUILTIN_DIR = Path(__file__).resolve().parents[1] / "tasks" / "builtin"
_OPEN = 'cuda_source = r"""\n'


def fallback_pairs(limit: int | None = None) -> list[tuple[str, str]]:
    """(prompt, target) pairs built straight from ``dice_ray/tasks/builtin/*/{reference,solution}.py``.

    Alternates an infill pair (target: the CUDA source between ``cuda_source = r\"\"\"`` and the closing
    quotes) and an end-to-end pair (target: the whole solution), task by task.
    """
    pairs: list[tuple[str, str]] = []
    for d in sorted(BUILTIN_DIR.iterdir()) if BUILTIN_DIR.is_dir() else []:
        ref, sol = d / "reference.py", d / "solution.py"
        if not (ref.is_file() and sol.is_file()):
            continue
        r, s = ref.read_text(), sol.read_text()
        a = s.find(_OPEN)
        if a < 0:
            continue
        a += len(_OPEN)
        b = s.index('"""', a)
        head = f"# Task: {d.name}\n# Reference PyTorch model:\n{r}\n"
        infill = f"# Write the CUDA source of this solution:\n{s[:a]}<|fill|>{s[b:]}\n# CUDA source:\n"
        pairs.append((head + infill, s[a:b]))
        pairs.append((head + "# Write a ModelNew with CUDA kernels (dice_ray.launch.load_cuda):\n", s))
    return pairs[:limit] if limit else pairs


def task_pairs(limit: int | None = None) -> tuple[list[tuple[str, str]], str]:
    """Pairs from ``dice_ray.tasks.prompts.sft_pairs`` over the built-in suite, else :func:`fallback_pairs`.

    Returns (pairs, source description).
    """
    try:
        from dice_ray.tasks.loaders import load_tasks
        from dice_ray.tasks.prompts import sft_pairs
    except ImportError:
        return fallback_pairs(limit), "fallback_pairs (dice_ray.tasks.prompts not available)"
    tasks = load_tasks("builtin").tasks
    if limit:  # an even spread over the suite (short elementwise to long fused), both phases of each task
        per = max(1, len(sft_pairs(tasks[0])))
        n = max(1, min(len(tasks), limit // per))
        tasks = [tasks[round(i * (len(tasks) - 1) / max(1, n - 1))] for i in range(n)]
    pairs = [p for t in tasks for p in sft_pairs(t)]
    return (pairs[:limit] if limit else pairs), "dice_ray.tasks.prompts.sft_pairs"


def cuda_of(text: str) -> str:
    """The CUDA source of a completion: the ``cuda_source`` string of a full solution, else the text."""
    m = re.search(r'cuda_source = r"""\n(.*?)"""', text, re.S)
    return m.group(1) if m else text


def _compiler():
    try:
        from dice_ray.launch import target_arch
        from dice_ray.verify.candidate.nvrtc import CompileError, compile_cuda

        arch = target_arch()
        compile_cuda('extern "C" __global__ void k(float* x) { x[0] = 1.f; }', arch)
    except Exception:
        return None

    def compiles(src: str) -> bool:
        try:
            compile_cuda(src, arch)
            return True
        except CompileError:
            return False

    return compiles


def measure(
    policy: DiffusionPolicy, pairs: list[tuple[str, str]], samples: int, max_new_tokens: int, seed: int = 0
) -> dict:
    """Reproduction figures of greedy and temperature-1 sampling on ``pairs`` (see module doc)."""
    compiles = _compiler()
    out = {}
    for mode, temp, n in (("greedy", 0.0, 1), ("t1", 1.0, samples)):
        cfg = SamplingConfig(max_new_tokens=max_new_tokens, temperature=temp, remasking="dynamic", threshold=0.9)
        exact = near = comp = total = mixed = 0
        sim_sum = tok = secs = 0.0
        for i, (prompt, target) in enumerate(pairs):
            group = sample_group(policy, prompt, n, cfg, seed=seed + i)
            tok += group.stats.new_tokens
            secs += group.stats.seconds
            outcomes = set()
            for r in group:
                sim = difflib.SequenceMatcher(None, r.text, target, autojunk=False).ratio()
                total += 1
                exact += r.text == target
                near += sim >= 0.9
                sim_sum += sim
                ok = compiles(cuda_of(r.text)) if compiles is not None else r.text == target
                comp += ok
                outcomes.add(ok)
            mixed += len(outcomes) > 1
        out[mode] = {
            "samples": total,
            "exact": exact / total,
            "near_0.9": near / total,
            "mean_similarity": sim_sum / total,
            "compile": comp / total if compiles is not None else None,
            # groups whose samples disagree on compiling (on exact match without NVRTC): RL's learning signal
            "mixed_groups": mixed / len(pairs),
            "tokens_per_s": tok / max(secs, 1e-9),
        }
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=40)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--target-loss", type=float, default=None)
    ap.add_argument("--no-cache", action="store_true", help="train into a fresh temporary cache folder")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    pairs, source = task_pairs(args.pairs)
    policy = DiffusionPolicy.build(ModelConfig(), seed=args.seed)
    upd = {k: v for k, v in (("steps", args.steps), ("learning_rate", args.lr), ("batch_size", args.batch_size),
                                          ("target_loss", args.target_loss)) if v is not None}
    if args.no_cache:
        import tempfile

        upd["cache_dir"] = tempfile.mkdtemp(prefix="dice-sft-")
    sft_cfg = SFTConfig(**upd)
    p_len = [len(policy.encode(p)) for p, _ in pairs]
    t_len = [len(policy.encode(t)) for _, t in pairs]
    print(f"{len(pairs)} pairs from {source}; prompt tokens {min(p_len)}-{max(p_len)} "
          f"(mean {sum(p_len) / len(p_len):.0f}), target tokens {min(t_len)}-{max(t_len)} "
          f"(mean {sum(t_len) / len(t_len):.0f}); {policy.num_parameters()} params")
    report = warm_start(policy, pairs, sft_cfg, seed=args.seed)
    print(f"SFT: {report.steps} steps, final loss {report.final_loss:.4f}, {report.seconds:.1f} s, "
          f"cache_hit={report.cache_hit}")
    print("losses:", [(s, round(v, 4)) for s, v in report.losses])
    t = time.perf_counter()
    figures = measure(policy, pairs, args.samples, args.max_new_tokens, seed=args.seed)
    print(json.dumps(figures, indent=2))
    print(f"measured in {time.perf_counter() - t:.1f} s")


if __name__ == "__main__":
    main()
