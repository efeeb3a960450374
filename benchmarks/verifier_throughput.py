"""Verifier throughput on the built-in suite: candidates/s end to end through one Verifier, by kind.

Builds candidates from every built-in task: the honest solution, an incorrect variant (each kernel
skips its first thread), a non-compiling variant, crashing variants (a null-pointer store) and
cheating variants (a try/except fallback to PyTorch), and verifies them all through one Verifier
(its sandbox workers share one GPU; compile-only without a GPU). Also prints the repeatability of
one measured speedup (coefficient of variation over 5 repeats).

It also verifies a few of DICE's ``load_inline`` records (``--dice-data``) cold and from the build
cache, builds one with torch's own ``load_inline`` (KernelBench's path), and prints the fast path's
advantage per candidate over each.

With ``--pool 1,2,4,8`` it instead measures the Ray verifier pool
(:class:`~dice_ray.cluster.verifier_pool.VerifierPool`, one actor a GPU; N compile-only CPU actors
without GPUs) on the same candidates, one pool size after another in one run, and prints
candidates/s for each size and its ratio to one actor (targets: >= 1.9x at 2 GPUs, >= 7.5x at 8).

Before each timed round the verifier stays idle until its spares are ready (they start in its idle
time, as between RL steps); the line of each round says how long that took and how many of its
crashes found no ready spare.  Before the first round the verifier measures each task's reference
facts (two reference runs and a float64 one, :mod:`dice_ray.verify.trials.reference_facts`) with
``Verifier.prepare``, as the trainer has it do at start while the learner warm-starts; the line says
how long that took.  With ``--no-prepare`` the first round's jobs measure them instead, as they would
without that call (each round's line counts the jobs that came with them).

    python benchmarks/verifier_throughput.py [--workers 0] [--spare-workers N] [--spares-timeout-s S] [--timing-window-ms MS]
        [--crash-every 4] [--cheat-every 3] [--repeats 5] [--inline 3] [--torch-inline 1] [--dice-data DIR]
        [--tasks N] [--rounds R] [--crash-cost] [--no-prepare] [--json OUT]
    python benchmarks/verifier_throughput.py --pool 1,2[,4,8] [--copies K] [--tasks N] [--workers 0] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import time
from collections import Counter
from pathlib import Path

from pydantic import ValidationError

from dice_ray.config import RewardConfig, VerifyConfig
from dice_ray.tasks.loaders import load_tasks
from dice_ray.verify.verifier import Verifier

#: DICE infilling records that verify ok on an H200 (tests/test_verify_inline_gpu.py)
INLINE_RECORDS = (617, 3890, 136, 6180)
KERNEL_OPEN = re.compile(r'(extern\s+"C"\s+__global__[^{]*\{)')


def variants(src: str) -> dict[str, str]:
    """Honest, incorrect, non-compiling and crashing versions of one fast-format solution."""
    return {
        "correct": src,
        "incorrect": KERNEL_OPEN.sub(r"\1 if (blockIdx.x == 0 && threadIdx.x == 0) return;", src),
        "compile_error": KERNEL_OPEN.sub(r"\1 int dice_ray_bench = ;", src, count=1),
        "crash": KERNEL_OPEN.sub(r"\1 *(volatile int*)0 = 1;", src, count=1),
        "cheat": src.replace("    def forward(self, ", "    def _forward(self, ", 1).replace(
            "class ModelNew(nn.Module):\n",
            "class ModelNew(nn.Module):\n    def forward(self, *args):\n        try:\n            return self._forward(*args)\n"
            "        except RuntimeError:\n            return args[0]\n\n", 1),
    }


EXPECT = {"correct": "ok", "incorrect": "incorrect", "compile_error": "compile_error", "crash": "crash", "cheat": "cheat"}
"""The verdict each kind of variant must get on a GPU."""
TARGETS = {2: (1.9, "issue 6"), 8: (7.5, "issue 8")}
"""Pool size -> (least throughput ratio to one actor, where it is asked for)."""


def expected_verdict(kind: str, mode: str) -> str:
    """The verdict a variant of ``kind`` (a key of :data:`EXPECT`) must get in verifier ``mode``
    (``"gpu"`` or ``"compile_only"``): compile-only mode cannot run kernels, so the incorrect and
    crashing variants pass there."""
    if mode == "compile_only" and kind in ("incorrect", "crash"):
        return "ok"
    return EXPECT[kind]


def build_jobs(tasks: list, crash_every: int, cheat_every: int, round_: int = 0) -> list[tuple]:
    """``[(task, kind, source), ...]``: for each task its honest, incorrect and non-compiling variants,
    a crashing one every ``crash_every`` tasks and a cheating one every ``cheat_every`` tasks (0: none).
    Round ``round_ > 0`` marks each first kernel with a comment naming the round, so its sources are
    new to every compile cache (a repeated batch costs what a fresh one does)."""
    jobs = []
    for i, t in enumerate(tasks):
        src = KERNEL_OPEN.sub(rf"\1 /* benchmark round {round_} */", t.solution_src, count=1) if round_ else t.solution_src
        v = variants(src)
        kinds = ["correct", "incorrect", "compile_error"] + (["crash"] if crash_every and i % crash_every == 0 else []) + (
            ["cheat"] if cheat_every and i % cheat_every == 0 else [])
        jobs += [(t, kind, v[kind]) for kind in kinds]
    return jobs


def parse_pool_sizes(text: str) -> list[int]:
    """``--pool 1,2,4`` -> ``[1, 2, 4]`` (sorted, unique).

    Raises:
        argparse.ArgumentTypeError: an entry is not an integer >= 1, or 1 (the baseline of the
            ratios) is missing.
    """
    try:
        sizes = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"--pool must be comma-separated integers, got {text!r}") from None
    if not sizes or sizes[0] < 1:
        raise argparse.ArgumentTypeError(f"--pool sizes must be integers >= 1, got {text!r}")
    if sizes[0] != 1:
        raise argparse.ArgumentTypeError(f"--pool must include 1 (the baseline of the ratios), got {text!r}")
    return sizes


def verify_config(args: argparse.Namespace) -> VerifyConfig:
    """The verifier config of the flags (``--workers``, ``--spare-workers``, ``--timing-window-ms``,
    ``--no-preload-kernels``, ``--no-landlock``).

    Raises:
        pydantic.ValidationError: a value out of the config's range (e.g. ``--spare-workers -1``).
    """
    extra = {} if args.timing_window_ms is None else {"timing_window_ms": args.timing_window_ms}
    if args.spare_workers is not None:
        extra["spare_workers"] = args.spare_workers
    if args.no_preload_kernels:
        extra["preload_kernels"] = False
    if args.no_landlock:
        extra["landlock"] = False
    return VerifyConfig(workers=args.workers, **extra)


def pool_scaling(args: argparse.Namespace, jobs: list[tuple], cfg: VerifyConfig) -> dict:
    """Throughput of the Ray verifier pool at each size in ``args.pool`` on the same batch.

    Connects to ``RAY_ADDRESS`` or starts a local Ray cluster (``num_gpus`` from
    ``torch.cuda.device_count()``). For each size N: a pool of N verifier actors (1 GPU each; with no
    GPU, N compile-only CPU actors), waits until all serve, warms every actor's sandbox workers with
    an untimed batch, then times ``args.copies`` copies of ``jobs`` end to end through
    ``VerifierPool.verify_batch``. Sizes over the cluster's GPU count are skipped.

    Returns:
        ``{"gpus", "mode", "candidates", "sizes": {N: {...}}, "skipped", "targets", "ok"}``; ``ok`` is
        False when a candidate lacks exactly one verdict or gets an unexpected kind.
    """
    import ray
    import torch

    from dice_ray.cluster.verifier_pool import VerifierPool, actor_workers

    if not ray.is_initialized():
        if os.environ.get("RAY_ADDRESS"):
            ray.init(log_to_driver=False)
        else:
            ray.init(address="local", num_gpus=torch.cuda.device_count(), include_dashboard=False, log_to_driver=False)
    gpus = int(ray.cluster_resources().get("GPU", 0))
    per_gpu = 1.0 if gpus else 0.0
    sizes = [n for n in args.pool if not gpus or n <= gpus]
    skipped = [n for n in args.pool if n not in sizes]
    for n in skipped:
        print(f"pool N={n}: skipped, only {gpus} GPU(s) present")
    items = [(f"{task.task_id}:{kind}:{c}", task, src, kind) for c in range(args.copies) for task, kind, src in jobs]
    warm_task = jobs[0][0]
    print(f"pool mode: {gpus} GPU(s), {'one verifier actor a GPU' if gpus else 'compile-only CPU actors'}, "
          f"{len(items)} candidates ({len(jobs)} x {args.copies}), sizes {sizes}")
    out: dict = {"gpus": gpus, "candidates": len(items), "copies": args.copies, "sizes": {}, "skipped": skipped}
    ok = True
    for n in sizes:
        # an actor call's own stage limits, plus the wait for its GPU gate behind its other workers
        workers = actor_workers(cfg, gpu=bool(gpus))
        call_timeout = cfg.compile_timeout_s + (3 + workers) * cfg.run_timeout_s + 60
        pool = VerifierPool.remote(cfg, RewardConfig(), n, per_gpu, call_timeout, None, f"bench-{n}")
        try:
            t_boot = time.perf_counter()
            status = ray.get(pool.status.remote())
            while status["serving"] < n:
                if time.perf_counter() - t_boot > 900:
                    raise RuntimeError(f"pool N={n}: {status['serving']} of {n} actors serving after 900 s: {status['errors']}")
                time.sleep(0.2)
                status = ray.get(pool.status.remote())
            warm = [(f"warm-{i}", warm_task, warm_task.solution_src) for i in range(n * status["capacity_per_actor"])]
            ray.get(pool.verify_batch.remote(warm))  # every actor's sandbox workers booted
            boot_s = time.perf_counter() - t_boot
            before = ray.get(pool.status.remote())
            t0 = time.perf_counter()
            verdicts = ray.get(pool.verify_batch.remote([(cid, task, src) for cid, task, src, _ in items]))
            seconds = time.perf_counter() - t0
            after = ray.get(pool.status.remote())
        finally:
            handles = ray.get(pool.actors.remote())
            ray.get(pool.close.remote())
            for h in handles:
                ray.kill(h, no_restart=True)
            ray.kill(pool)
        ids = [v.candidate_id for v in verdicts]
        one_each = ids == [cid for cid, *_ in items] and after["completed"] - before["completed"] == len(items) \
            and after["submitted"] - before["submitted"] == len(items)
        mode = after["mode"]
        got = Counter((kind, v.verdict) for (*_, kind), v in zip(items, verdicts))
        wrong = [(cid, kind, v.verdict, v.reason[:160]) for (cid, _, _, kind), v in zip(items, verdicts)
                 if v.verdict != expected_verdict(kind, v.mode)]
        restarts = sum(a["restarts"] for a in after["actors"])
        ok = ok and one_each and not wrong
        rate = len(items) / seconds
        out["mode"] = mode
        out["sizes"][n] = {"seconds": seconds, "candidates_per_s": rate, "boot_and_warm_s": boot_s,
                           "one_verdict_each": one_each, "unexpected": wrong, "actor_restarts": restarts,
                           "capacity_per_actor": after["capacity_per_actor"],
                           "verdicts": {f"{k}->{v}": c for (k, v), c in got.items()}}
        print(f"  N={n}: {len(items)} candidates in {seconds:.1f} s = {rate:.2f} candidates/s "
              f"(booted and warmed in {boot_s:.1f} s; {after['capacity_per_actor']} in flight an actor); "
              f"one verdict each: {'yes' if one_each else 'NO'}; unexpected verdicts {len(wrong)}; actor restarts {restarts}")
        for w in wrong[:10]:
            print("     ", w)
    base = out["sizes"][1]["candidates_per_s"]
    for n, row in out["sizes"].items():
        row["ratio"] = row["candidates_per_s"] / base
    print(f"pool scaling ({out.get('mode')}; candidates/s, ratio to N=1): " + " | ".join(
        f"N={n} {row['candidates_per_s']:.2f} ({row['ratio']:.2f}x)" for n, row in out["sizes"].items()))
    out["targets"] = {}
    for n, (least, issue) in TARGETS.items():
        row = out["sizes"].get(n)
        met = None if row is None or out.get("mode") != "gpu" else row["ratio"] >= least
        out["targets"][n] = {"least": least, "issue": issue, "met": met}
        state = "not run" if row is None else ("n/a (compile-only)" if met is None else ("met" if met else "NOT met"))
        print(f"  target >= {least}x at N={n}: {state}" + (f" ({row['ratio']:.2f}x)" if row else ""))
    out["ok"] = ok
    return out


def inline_path(args: argparse.Namespace, fast_rate: float) -> dict:
    """Per-candidate cost of the ``load_inline`` path on DICE infilling records: verified cold (an
    empty build cache; the first also builds the shared precompiled header), then again (cache hit).
    Prints the ratio of the fast path's throughput to it."""
    import tempfile

    from dice_ray.tasks.task import Task

    path = Path(args.dice_data) / "kernel_infilling_evaluation.json"
    if not path.exists():
        print(f"load_inline path: skipped ({path} not found)")
        return {}
    records = {r["id"]: r for r in json.loads(path.read_text())}
    chosen = [records[i] for i in INLINE_RECORDS if i in records][: args.inline]
    with tempfile.TemporaryDirectory() as cache:
        cfg = VerifyConfig(workers=1, inline_cache_dir=cache, compile_timeout_s=300.0)
        with Verifier(cfg, RewardConfig()) as v:
            cold, hit = [], []
            for r in chosen:
                task = Task(f"dice/{r['id']}", str(r["id"]), 1, r["pytorch_code"])
                first = v.verify(task, r["cuda_code"], f"inline-{r['id']}")
                again = v.verify(task, r["cuda_code"], f"inline-{r['id']}-again")
                cold.append(first.seconds)
                hit.append(again.seconds)
                print(f"  load_inline {task.task_id}: {first.verdict}, cold {first.seconds:.1f} s "
                      f"(load {first.stage_seconds.get('load', 0):.1f} s), cache hit {again.seconds:.2f} s")
    torch_s = [_torch_load_inline_seconds(r["cuda_code"]) for r in chosen[: args.torch_inline]]
    later = statistics.median(cold[1:]) if len(cold) > 1 else cold[0]
    builder_stats = getattr(v, "_inline_builder", None)
    if builder_stats is not None:
        print("  build stats:", {k: round(x, 2) if isinstance(x, float) else x for k, x in builder_stats.stats().items()})
    print(f"load_inline path: first candidate {cold[0]:.1f} s (builds the shared precompiled header), "
          f"median of the rest {later:.1f} s, cache hit {statistics.median(hit):.2f} s; fast path "
          f"{fast_rate:.1f} candidates/s = {later * fast_rate:.0f}x the per-candidate load_inline rate")
    out = {"cold_s": cold, "hit_s": hit, "ratio": later * fast_rate, "torch_load_inline_s": torch_s}
    if torch_s:
        t = statistics.median(torch_s)
        out["ratio_vs_torch_load_inline"] = t * fast_rate
        print(f"torch.utils.cpp_extension.load_inline (KernelBench's path, empty extensions folder): {t:.1f} s a "
              f"candidate; fast path = {t * fast_rate:.0f}x its rate")
    return out


def _torch_load_inline_seconds(candidate_src: str) -> float:
    """Wall seconds for a fresh interpreter to execute a load_inline candidate module with torch's own
    ``load_inline`` and an empty ``TORCH_EXTENSIONS_DIR`` (how KernelBench builds each candidate)."""
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "candidate.py"
        src.write_text(candidate_src)
        env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(Path(d) / "ext")}
        t0 = time.perf_counter()
        subprocess.run([sys.executable, str(src)], cwd=d, env=env, check=True, capture_output=True, timeout=900)
        return time.perf_counter() - t0


def crash_cost(verifier: Verifier, tasks: list, args: argparse.Namespace, jobs: list[tuple], verdicts: list,
               mix_s: float) -> dict:
    """Time the batch once more without its crashing candidates (sources new to the caches) and print
    what a crash cost: ``(mix_s - that round's seconds) / crashes a round``; and the rate the faults
    alone allow: a round's candidates over (the crash-free seconds + crashes x the median
    ``run.until_raise``, the wait for a fault's error).

    Args:
        jobs, verdicts: every timed round's ``(task, kind, source)`` and verdicts, in order.
        mix_s: median seconds of the timed rounds (with their crashes) after the first, whose jobs came with their
            references' facts (measured in round 1) as the crash-free round's do; of the only round when there is one.

    Returns:
        The figures printed (seconds, ms, candidates/s), ``{}`` when no crash was timed.
    """
    crashes = sum(1 for _, kind, _ in jobs if kind == "crash") // args.rounds
    if not crashes:
        return {}
    free = build_jobs(tasks, 0, args.cheat_every, args.rounds)
    spares_idle(verifier, args.spares_timeout_s)  # as before every timed round
    gate0 = verifier.stats()["gpu_gate_s"]
    t0 = time.perf_counter()
    got = verifier.verify_many([(task, src, f"{task.task_id}:{kind}:free") for task, kind, src in free])
    free_s = time.perf_counter() - t0
    gate = {k: round(v, 3) for k, v in gate_since(verifier, gate0).items()}
    unexpected = sum(v.verdict != expected_verdict(kind, verifier.mode) for (_, kind, _), v in zip(free, got))
    faults = [v.stage_seconds["run.until_raise"] for (_, kind, _), v in zip(jobs, verdicts)
              if kind == "crash" and "run.until_raise" in v.stage_seconds]
    fault_s = statistics.median(faults) if faults else None
    free_speedup = {task.task_id: v.speedup for (task, kind, _), v in zip(free, got) if kind == "correct" and v.speedup}
    drift = speedup_drift([(v.speedup, free_speedup[task.task_id]) for (task, kind, _), v in zip(jobs, verdicts)
                           if kind == "correct" and v.speedup and task.task_id in free_speedup])
    figures = {"crashes_a_round": crashes, "mix_s": round(mix_s, 3), "crash_free_s": round(free_s, 3),
               "crash_free_per_s": round(len(free) / free_s, 2), "per_crash_ms": round(1e3 * (mix_s - free_s) / crashes, 1),
               "fault_ms": round(1e3 * fault_s, 1) if fault_s else None,
               "fault_bound_per_s": round((len(free) + crashes) / (free_s + crashes * fault_s), 2) if fault_s else None,
               "unexpected": unexpected, "speedup_drift": drift, "crash_free_gpu_gate_s": gate}
    print(f"crash cost: the batch without its {crashes} crashing candidate{'s' * (crashes != 1)} took {free_s:.1f} s "
          f"({figures['crash_free_per_s']:.2f} candidates/s, {unexpected} unexpected verdicts) against {mix_s:.1f} s with "
          f"them: {figures['per_crash_ms']:.0f} ms a crash" + (
              f"; a fault's error came {figures['fault_ms']:.0f} ms after the call (median), so the faults alone "
              f"allow at most {figures['fault_bound_per_s']:.2f} candidates/s at this crash share" if fault_s else
              " (compile-only: crashing candidates compile and pass, nothing faults or restarts, so this is the "
              "rounds' noise, not a cost)"))
    if gate:
        print(gate_line("the crash-free round", gate, free_s))
    if drift:
        print(f"speedups timed beside crashes against the same task's in the crash-free round ({drift['pairs']} pairs): "
              f"median |change| {drift['median_pct']:.1f} %, 90th percentile {drift['p90_pct']:.1f} %, "
              f"{drift['over_10pct']} changed by more than 10 %")
    return figures


def gate_since(verifier: Verifier, before: dict[str, float]) -> dict[str, float]:
    """Seconds ``verifier``'s GPU gate spent in each state (exclusive, draining, shared, idle) since
    ``before`` (an earlier ``stats()["gpu_gate_s"]``)."""
    return {k: v - before[k] for k, v in verifier.stats()["gpu_gate_s"].items()}


def gate_line(what: str, gate: dict[str, float], seconds: float) -> str:
    """``GPU gate over <what>: exclusive 8.2 s (60%), ...``: each state's seconds and share of ``seconds``."""
    return f"GPU gate over {what}: " + ", ".join(f"{k} {v:.1f} s ({v / seconds:.0%})" for k, v in gate.items())


def speedup_drift(pairs: list[tuple[float, float]]) -> dict:
    """How far speedups measured under one load moved from the same candidates' under another.

    Args:
        pairs: ``(speedup, the same task's speedup in the other round)``, both > 0.

    Returns:
        ``{"pairs", "median_pct", "p90_pct", "over_10pct"}``: the median and 90th percentile of
        ``|a / b - 1|`` in percent and how many pairs moved by more than 10 %; ``{}`` without pairs.
    """
    if not pairs:
        return {}
    changes = sorted(abs(a / b - 1) * 100 for a, b in pairs)
    return {"pairs": len(changes), "median_pct": round(statistics.median(changes), 2),
            "p90_pct": round(changes[min(len(changes) - 1, int(0.9 * len(changes)))], 2),
            "over_10pct": sum(c > 10 for c in changes)}


def spares_idle(verifier: Verifier, timeout_s: float) -> float:
    """Leave ``verifier`` idle until its spares are ready (they start only then, as between RL steps,
    while the policy samples) or ``timeout_s`` (s) passed; returns the seconds it was idle."""
    return verifier.wait_for_spares(timeout_s) if verifier.mode == "gpu" else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--workers", type=int, default=0, help="sandbox workers of the Verifier (verify.workers; 0: auto)")
    ap.add_argument("--spare-workers", type=int, default=None,
                    help="warm sandbox workers kept ready to replace one after a crash (verify.spare_workers; "
                         "None: the config's)")
    ap.add_argument("--spares-timeout-s", type=float, default=300.0,
                    help="before each round the verifier stays idle until its spares are ready (as between RL steps) "
                         "or this many seconds passed; the time is printed")
    ap.add_argument("--timing-window-ms", type=float, default=None,
                    help="verify.timing_window_ms (None: the config's; 0: one call a timed window)")
    ap.add_argument("--no-landlock", action="store_true",
                    help="workers without Landlock (verify.landlock=false; seccomp stays): what the file confinement "
                         "costs worker starts and throughput, run beside a plain run on the same machine")
    ap.add_argument("--no-preload-kernels", action="store_true",
                    help="verify.preload_kernels=false: workers load kernels lazily, under the GPU gate (for comparison)")
    ap.add_argument("--crash-every", type=int, default=4, help="one crashing candidate every N tasks (0: none; a crash's fault stalls the whole GPU ~170 ms on an H200)")
    ap.add_argument("--cheat-every", type=int, default=3, help="one cheating candidate every N tasks (0: none)")
    ap.add_argument("--repeats", type=int, default=5,
                    help="verifications of each --cov-tasks task for the speedup's CoV (GPU only)")
    ap.add_argument("--inline", type=int, default=3, help="DICE load_inline records for the per-candidate cost of that path (GPU only; 0: off)")
    ap.add_argument("--dice-data", default=os.environ.get("DICE_DATA_DIR", str(Path(__file__).resolve().parents[2] / "shared" / "data" / "dice")),
                    help="folder with DICE's kernel_infilling_evaluation.json (env DICE_DATA_DIR)")
    ap.add_argument("--torch-inline", type=int, default=1,
                    help="of the --inline records, how many are also built with torch's own load_inline, as KernelBench "
                         "does (0: off)")
    ap.add_argument("--cov-tasks", default="relu,softmax,matmul", help="tasks whose speedup is repeated (names)")
    ap.add_argument("--tasks", type=int, default=0, help="use the first N built-in tasks (0: all)")
    ap.add_argument("--pool", type=parse_pool_sizes, default=None,
                    help="measure the Ray verifier pool at these sizes instead, e.g. 1,2,4,8 (must include 1)")
    ap.add_argument("--copies", type=int, default=1, help="pool mode: the candidate batch repeated K times")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time the batch this many times (sources new to the compile caches each round) and quote "
                         "the median candidates/s: the figure moves 10-20 %% from run to run on a shared machine")
    ap.add_argument("--crash-cost", action="store_true",
                    help="then time one round without the crashing candidates, in the same Verifier, and print what "
                         "each crash cost (the rounds' median seconds less that round's, over the crashes) and the "
                         "throughput the crashes' faults alone allow")
    ap.add_argument("--no-prepare", action="store_true",
                    help="skip Verifier.prepare before the first round: its jobs then measure each task's reference "
                         "facts themselves (for comparison; the trainer prepares them at start)")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()

    bad = [f"{flag} must be >= {least}, got {value}" for flag, value, least in (
        ("--rounds", args.rounds, 1), ("--workers", args.workers, 0), ("--spare-workers", args.spare_workers, 0),
        ("--tasks", args.tasks, 0), ("--crash-every", args.crash_every, 0), ("--cheat-every", args.cheat_every, 0),
        ("--repeats", args.repeats, 0), ("--inline", args.inline, 0), ("--torch-inline", args.torch_inline, 0),
        ("--copies", args.copies, 1), ("--spares-timeout-s", args.spares_timeout_s, 0))
        if value is not None and not value >= least]  # NaN fails too
    if args.crash_cost and not args.crash_every:
        bad.append("--crash-cost needs crashing candidates (--crash-every N >= 1)")
    if bad:
        ap.error("; ".join(bad))

    try:
        cfg = verify_config(args)
    except ValidationError as e:
        ap.error("; ".join(f"--{str(err['loc'][0]).replace('_', '-')} (verify.{'.'.join(map(str, err['loc']))}): "
                           f"{err['msg']}" for err in e.errors()))
    tasks = [t for t in load_tasks("builtin").tasks if t.solution_format == "fast"]
    tasks = tasks[: args.tasks] if args.tasks else tasks
    jobs = build_jobs(tasks, args.crash_every, args.cheat_every)
    if args.pool:
        figures = pool_scaling(args, jobs, cfg)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(figures, f, indent=1)
        raise SystemExit(0 if figures["ok"] else 1)
    verifier = Verifier(cfg, RewardConfig())
    print(f"mode={verifier.mode} workers={verifier.workers} tasks={len(tasks)} candidates={len(jobs)}"
          + (f" a round, {args.rounds} rounds" if args.rounds > 1 else "") + "; spares: " + (
              f"{verifier.spare_workers}{' (auto)' if cfg.spare_workers is None else ''}, started in the verifier's "
              "idle time" if verifier.mode == "gpu" else
              f"at most {verifier.spare_workers} (compile-only), from the first replacement"))
    verifier.verify_many([(tasks[0], tasks[0].solution_src, "warm")] * verifier.workers)  # workers booted
    prepared = {} if args.no_prepare else verifier.prepare(tasks)
    if prepared:
        print("reference facts before the batch (Verifier.prepare, as at a training run's start): "
              + (prepared["skipped"] if "skipped" in prepared else
                 f"{prepared['measured']} measured, {prepared['known']} known, {len(prepared['failed'])} failed, "
                 f"in {prepared['seconds']:.2f} s"))
    rates, round_s, idle_s, all_jobs, verdicts = [], [], [], [], []
    gate: Counter = Counter()  # the GPU gate's seconds in each state, over the timed rounds only
    for r in range(args.rounds):
        round_jobs = build_jobs(tasks, args.crash_every, args.cheat_every, r) if r else jobs
        idle_s.append(spares_idle(verifier, args.spares_timeout_s))
        restarts0, promoted0, facts0 = verifier.restarts, verifier.promoted, verifier.stats()["reference_facts_used"]
        gate0 = verifier.stats()["gpu_gate_s"]
        t0 = time.perf_counter()
        verdicts += verifier.verify_many([(task, src, f"{task.task_id}:{kind}:{r}") for task, kind, src in round_jobs])
        seconds = time.perf_counter() - t0
        gate.update(gate_since(verifier, gate0))
        round_s.append(seconds)
        all_jobs += round_jobs
        rates.append(len(round_jobs) / seconds)
        after = verifier.stats()
        spares = (f", {verifier.promoted - promoted0} of them found no ready spare; before it the verifier was idle "
                  f"{idle_s[-1]:.1f} s while its spares started; {after['suspended']} crashed workers wait, "
                  f"stopped, to be killed in idle time, holding {after['suspended_mib']:.0f} MiB; {after['reference_facts_used'] - facts0} jobs "
                  f"reached their reference stage with its facts known" if verifier.mode == "gpu" else "")
        print(f"end to end{f' (round {r + 1})' if args.rounds > 1 else ''}: {len(round_jobs)} candidates in {seconds:.1f} s "
              f"= {rates[-1]:.2f} candidates/s ({verifier.restarts - restarts0} worker replacements{spares})")
    rate = statistics.median(rates)
    if args.rounds > 1:
        print(f"median of {args.rounds} rounds: {rate:.2f} candidates/s (range {min(rates):.2f}-{max(rates):.2f})")
    busy = sum(round_s) + sum(idle_s[1:])
    if verifier.mode == "gpu" and args.rounds > 1:
        print(f"back to back, counting the idle time the spares took to start between rounds: "
              f"{len(all_jobs) / busy:.2f} candidates/s ({len(all_jobs)} in {busy:.1f} s)")
    jobs = all_jobs
    got = Counter()
    wrong = []
    per_kind: dict[str, list[float]] = {}
    for (task, kind, _), verdict in zip(jobs, verdicts):
        got[(kind, verdict.verdict)] += 1
        per_kind.setdefault(kind, []).append(verdict.seconds)
        if verdict.verdict != expected_verdict(kind, verifier.mode):
            wrong.append((task.task_id, kind, verdict.verdict, verdict.reason[:160]))
    print("by kind of candidate:")
    for kind, secs in per_kind.items():
        kind_stages: dict[str, list[float]] = {}
        for (_, k, _), verdict in zip(jobs, verdicts):
            for name, sec in verdict.stage_seconds.items():
                if k == kind and (kind != "correct" or not name.startswith("timing.")):  # correct: the line below
                    kind_stages.setdefault(name, []).append(sec)
        parts = ", ".join(f"{n} {statistics.median(v) * 1000:.0f}/{sum(v):.1f}" for n, v in kind_stages.items())
        print(f"  {kind:14s} n={len(secs):3d}{' (all rounds)' if args.rounds > 1 else ''} median latency {statistics.median(secs)*1000:8.1f} ms; stages (median ms, "
              f"sum s): {parts or 'none (refused by the static rules before any worker stage)'}")
    if not gate:
        print("GPU gate: none (compile-only: nothing runs on a GPU)")
    else:
        print(gate_line("the batch", gate, sum(round_s)))
    print("verdicts (kind of candidate -> verdict: count): " + ", ".join(f"{k}->{v}: {n}" for (k, v), n in got.items()))
    print(f"unexpected verdicts: {len(wrong)}" + ("" if verifier.mode == "gpu" else
          " (compile-only: kernels are compiled, not run, so incorrect and crashing candidates are expected to pass)"))
    for w in wrong[:20]:
        print("   ", w)

    stages: dict[str, list[float]] = {}
    for (_, kind, _), verdict in zip(jobs, verdicts):
        if kind == "correct":
            for name, sec in verdict.stage_seconds.items():
                stages.setdefault(name, []).append(sec)
    st = verifier.stats()
    forked = st["boot_s_forked"]
    boots = ", ".join(f"{kind} {statistics.median(v):.2f} s" for kind, v in (("cold", st["boot_s_cold"]), ("forked", forked)) if v)
    gated = st["boot_gate_s_forked"]
    if gated:
        boots += (f" (its start held the GPU gate {statistics.median(g for g, _ in gated) * 1000:.0f} ms in parts of "
                  f"at most {statistics.median(p for _, p in gated) * 1000:.0f} ms)")
    print(f"workers: {st['workers']}, replaced {st['restarts']}; boot median: {boots or 'none'}; jobs waited "
          f"{st['ready_wait_s']:.1f} s in all for workers to boot (the warm-up before the timed batch included)")
    if st["forked_boot_phases_s"]:
        phases = st["forked_boot_phases_s"]
        keys = [k for k in phases[0] if k != "gate_wait"]
        waits = [p["gate_wait"] for p in phases if "gate_wait" in p]
        print("forked worker boot, median s from spawn to end of: " + ", ".join(
            f"{k} {statistics.median(p.get(k, 0.0) for p in phases):.2f}" for k in keys)
            + (f"; of it waiting for the GPU gate {statistics.median(waits):.2f}" if waits else ""))
    print("honest candidates, median a stage" + (" (timing.* are the timing stage's parts)" if gate else "") + ": "
          + ", ".join(f"{k} {statistics.median(v) * 1000:.1f} ms" for k, v in stages.items()))

    # the crash-free round's references have their facts (measured in round 1): compared with the rounds that had them too
    cost = crash_cost(verifier, tasks, args, jobs, verdicts, statistics.median(round_s[1:] or round_s)) if args.crash_cost else {}

    repeat: dict[str, list[float]] = {}
    if verifier.mode != "gpu" or not args.repeats:
        print("repeatability: skipped (" + ("--repeats 0)" if args.repeats == 0 else "compile-only: nothing is timed)"))
    else:
        for name in args.cov_tasks.split(","):
            task = next(t for t in tasks if t.name.endswith(name))
            runs = [verifier.verify(task, task.solution_src, "repeat") for _ in range(args.repeats)]
            speedups = repeat[task.task_id] = [v.speedup for v in runs if v.speedup is not None]
            if len(speedups) < len(runs):
                print(f"repeatability ({task.task_id}): verdicts {[v.verdict for v in runs]}, no speedup for some")
                continue
            mean = statistics.fmean(speedups)
            cov = statistics.pstdev(speedups) / mean if mean else float("nan")
            print(f"repeatability ({task.task_id}, reference {statistics.median(v.ref_ms for v in runs):.4f} ms, "
                  f"{args.repeats} repeats): speedups {['%.3f' % x for x in speedups]} CoV {cov:.2%}")
    verifier.close()
    inline_costs = inline_path(args, rate) if verifier.mode == "gpu" and args.inline else {}
    if verifier.mode != "gpu" and args.inline:
        print("load_inline path: skipped (compile-only: its per-candidate cost is measured on a GPU)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"mode": verifier.mode, "candidates": len(jobs), "seconds": sum(round_s), "candidates_per_s": rate,
                       "rounds": rates, "idle_before_rounds_s": idle_s,
                       "verdicts": {f"{k}->{v}": n for (k, v), n in got.items()}, "unexpected": wrong,
                       "repeat_speedups": repeat, "inline": inline_costs, "stage_medians_s": {k: statistics.median(v) for k, v in stages.items()},
                       "gpu_gate_s": dict(gate), "crash_cost": cost, "prepared": prepared},
                      f, indent=1)


if __name__ == "__main__":
    main()
