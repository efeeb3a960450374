"""Does the RL teach? The same RL run with learning on (arm ``rl``) and off (arm ``control``), from one warm start.

Issue 40: "from one warm start, runs the same RL config with learning on (arm ``rl``) and with learning off (arm
``control``: same sampling, verification and schedule, no parameter update), for 3 seeds each". Each run is a real
``dice-ray train`` (:class:`~dice_ray.cluster.trainer.Trainer`: the Ray actors, the verifier pool, the DeepSpeed
learner) on the preset of ``--device`` (``configs/learning-cpu.yaml``: compile-only reward on CPU;
``configs/learning-gpu.yaml``: correctness and speedup measured on a GPU), all in one local Ray cluster. The
warm start is shared: ``sft.seed`` is fixed, so the first run trains it and the others load it from the SFT
cache; the RL seed (``rl.seed``: the prompts' order and the samples) changes with ``--seeds``. The control arm
sets ``rl.update_policy=false``: it samples, verifies and walks the curriculum as the ``rl`` arm does, and never
takes a learner step. The presets use the fixed schedule (``phase.schedule=fixed``), so both arms of a seed draw the
same prompts with the same seeds at every step (the gated schedule reads figures, which differ by arm).

For each run: ``reward_start`` / ``reward_end``, the mean reward on a fixed evaluation set of training prompts,
both phases (``eval.train_tasks`` tasks a phase, sampled with fixed seeds apart from the training ones, before
the first step and after the last: the trainer's ``train_start`` / ``train_end``); ``heldout_start`` /
``heldout_end``, the held-out compile rate (correct rate on a GPU) over both phases; ``heldout_ok_start`` /
``heldout_ok_end``, the held-out share of verdicts ``ok`` (a candidate can compile and still miss the kernel its
launch code calls); ``heldout_by_phase``, those rates of each phase; ``curve``, the per-step
training reward; ``computes_end``: the share of the rewarded evaluation samples at the end whose kernels match
their task's solution up to names (:mod:`dice_ray.eval.kernel_match`: not an empty or trivial kernel paid by the
compile-only proxy); ``speedup_start`` / ``speedup_end``, the speedup geomean of the correct evaluation samples
(GPU), and ``correct_start`` / ``correct_end`` their correct rate; ``speedup_geomean_by_phase`` and
``slow_share_by_phase`` (start / end, each phase): the speedup geomean and, with ``--speedup-variants``, the share of
the correct samples that reproduce a task's slower variant (:func:`dice_ray.eval.kernel_match.slower_variant`).
The speedup targets read the end-to-end phase: an infilling prompt's scaffold holds its solution's launch code,
which fixes whether the missing kernel is the fast or the slow one, so only end-to-end samples choose.
The targets of the device (CPU: :data:`TARGETS`; GPU: :data:`GPU_TARGETS`) are checked and printed (exit status 1
when one is missed); ``--json`` prints one JSON object
``{"arms": {"rl": [...], "control": [...]}, ...}`` on stdout; a PNG of both arms' curves and evaluations is
written to ``OUT/learning.png``.

    python benchmarks/learning.py --device cpu --json                 # 3 seeds x 2 arms, compile-only reward
    python benchmarks/learning.py --device cuda --speedup-variants    # GPU: the slower built-in variants in the
                                                                      # warm start, speedups measured
    python benchmarks/learning.py --seeds 0 rl.steps=6                # one seed, a config override
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRESETS = {"cpu": ROOT / "configs" / "learning-cpu.yaml", "cuda": ROOT / "configs" / "learning-gpu.yaml"}
ARMS = ("rl", "control")
#: CPU targets of issue 40: the rl arm's rise on every seed, the control arm's drift, the held-out rate's rise
TARGETS = {"rl_rise": 0.15, "control_drift": 0.05, "heldout_ratio": 1.5, "wall_s": 30 * 60}


def arm_overrides(arm: str, seed: int, out: Path, device: str, variants: bool) -> list[str]:
    """The ``dice-ray train`` overrides of one run: its arm, RL seed and run folder (and, with ``variants``, the
    built-in suite's slower solution variants in the warm start)."""
    over = [f"rl.seed={seed}", f"rl.update_policy={'true' if arm == 'rl' else 'false'}", f"run_dir={out}",
            f"run_name={arm}-seed{seed}"]
    if device == "cpu":
        over.append("verify.mode=compile_only")
    if variants:
        over.append("tasks.solution_variants=true")
    return over


def pooled(figures: dict | None, key: str) -> float | None:
    """The mean of ``key`` over an evaluation's phases, weighted by their candidates (None without figures)."""
    parts = [(f["candidates"], f[key]) for f in (figures or {}).values() if f.get(key) is not None and f["candidates"]]
    total = sum(n for n, _ in parts)
    return sum(n * v for n, v in parts) / total if total else None


def run_entry(summary: dict, records: list[dict], device: str) -> dict:
    """One seed's entry of an arm from its run's summary and step records (see the module docstring)."""
    heldout_key = "correct_rate" if device == "cuda" else "compile_rate"
    return {
        "reward_start": pooled(summary.get("train_start"), "reward_mean"),
        "reward_end": pooled(summary.get("train_end"), "reward_mean"),
        "by_phase": {when: {phase: round(f["reward_mean"], 4) for phase, f in (summary.get(f"train_{when}") or {}).items()}
                     for when in ("start", "end")},
        "heldout_start": pooled(summary.get("heldout_start"), heldout_key),
        "heldout_end": pooled(summary.get("heldout_end"), heldout_key),
        "heldout_ok_start": pooled(summary.get("heldout_start"), "ok_rate"),
        "heldout_ok_end": pooled(summary.get("heldout_end"), "ok_rate"),
        "heldout_by_phase": {when: {phase: {k: f.get(k) for k in ("compile_rate", "ok_rate", "correct_rate")}
                                    for phase, f in (summary.get(f"heldout_{when}") or {}).items()}
                             for when in ("start", "end")},
        "computes_end": pooled(summary.get("train_end"), "computes"),
        "speedup_start": pooled(summary.get("train_start"), "speedup_geomean"),
        "speedup_end": pooled(summary.get("train_end"), "speedup_geomean"),
        "correct_start": pooled(summary.get("train_start"), "correct_rate"),
        "correct_end": pooled(summary.get("train_end"), "correct_rate"),
        **{f"{key}_by_phase": {when: {phase: f.get(key) for phase, f in (summary.get(f"train_{when}") or {}).items()}
                               for when in ("start", "end")}
           for key in ("speedup_geomean", "slow_share")},
        "curve": [r["reward_mean"] for r in records],
        "phases": [r["phase"] for r in records],
        "seconds": summary.get("seconds"),
        "run_dir": summary.get("run_dir"),
    }


#: GPU targets of issue 44: the rl arm's correct rate and speedup rise, the control's do not; with the slower variants
#: in the warm start, the end-to-end speedup geomean at the end >= this times the start
GPU_TARGETS = {"speedup_ratio": 1.3, "control_correct_drift": 0.05, "control_speedup_ratio": 1.1}


def e2e_speedup(entry: dict, when: str) -> float | None:
    """The speedup geomean of the correct end-to-end samples of a run's evaluation at ``when`` (start / end): the phase
    where the policy picks its kernel (an infilling prompt's scaffold, its launch code, fixes which of a task's
    solutions the middle must be, so infilling speedups cannot move)."""
    return entry["speedup_geomean_by_phase"][when].get("e2e")


def check_gpu_targets(result: dict) -> list[tuple[str, bool, str]]:
    """``(target, met, detail)`` of the GPU targets (issue 44): every seed's ``rl`` correct rate and end-to-end speedup
    rise (with ``speedup_variants``: to >= 1.3x the start), and the ``control``'s do not."""
    out = []
    ratio = GPU_TARGETS["speedup_ratio"] if result.get("speedup_variants") else 1.0
    fmt = lambda x: "n/a" if x is None else f"{x:.3f}"  # noqa: E731
    for seed, e in zip(result["seeds"], result["arms"]["rl"]):
        a, b = e["correct_start"], e["correct_end"]
        out.append((f"rl seed {seed}: correct rate rises", a is not None and b is not None and b > a,
                    f"{fmt(a)} -> {fmt(b)}"))
        a, b = e2e_speedup(e, "start"), e2e_speedup(e, "end")
        out.append((f"rl seed {seed}: end-to-end speedup geomean end > {ratio}x start" if ratio > 1 else
                    f"rl seed {seed}: end-to-end speedup geomean rises",
                    a is not None and b is not None and (b >= ratio * a if ratio > 1 else b > a),
                    f"{fmt(a)} -> {fmt(b)}x"))
    for seed, e in zip(result["seeds"], result["arms"]["control"]):
        a, b = e["correct_start"], e["correct_end"]
        drift = GPU_TARGETS["control_correct_drift"]
        out.append((f"control seed {seed}: correct rate rises < {drift}", a is not None and b is not None and b - a < drift,
                    f"{fmt(a)} -> {fmt(b)}"))
        a, b = e2e_speedup(e, "start"), e2e_speedup(e, "end")
        most = GPU_TARGETS["control_speedup_ratio"]
        out.append((f"control seed {seed}: end-to-end speedup geomean end < {most}x start",
                    a is not None and b is not None and b < most * a, f"{fmt(a)} -> {fmt(b)}x"))
    return out


def check_targets(result: dict) -> list[tuple[str, bool, str]]:
    """``(target, met, detail)`` of the device's targets: on a GPU :func:`check_gpu_targets`; on CPU every seed's
    ``rl`` rise, ``control`` drift and held-out rise, and the wall time of all runs."""
    if result["device"] == "cuda":
        return check_gpu_targets(result)
    out = []
    for i, e in enumerate(result["arms"]["rl"]):
        rise = e["reward_end"] - e["reward_start"]
        out.append((f"rl seed {i}: reward_end - reward_start >= {TARGETS['rl_rise']}", rise >= TARGETS["rl_rise"],
                    f"{e['reward_start']:.3f} -> {e['reward_end']:.3f} ({rise:+.3f})"))
        a, b = e["heldout_start"], e["heldout_end"]
        ok = a is not None and b is not None and b > 0 and b >= TARGETS["heldout_ratio"] * a
        out.append((f"rl seed {i}: held-out end > 0 and >= {TARGETS['heldout_ratio']}x start", ok,
                    f"{a if a is None else round(a, 3)} -> {b if b is None else round(b, 3)}"))
    for i, e in enumerate(result["arms"]["control"]):
        drift = e["reward_end"] - e["reward_start"]
        out.append((f"control seed {i}: |reward_end - reward_start| < {TARGETS['control_drift']}",
                    abs(drift) < TARGETS["control_drift"], f"{e['reward_start']:.3f} -> {e['reward_end']:.3f} ({drift:+.3f})"))
    out.append((f"wall time of all runs < {TARGETS['wall_s'] / 60:.0f} min", result["seconds"] < TARGETS["wall_s"],
                f"{result['seconds']:.0f} s"))
    return out


#: steps of the rolling mean drawn over each training-reward curve (a step's reward moves with its task mix)
SMOOTH = 8


def rolling_mean(values: list[float], window: int) -> list[float]:
    """The mean of each value and the ``window - 1`` before it (fewer at the start)."""
    return [sum(values[max(0, i - window + 1): i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(values))]


def plot(result: dict, path: Path) -> Path:
    """Both arms' per-step training reward (one line a seed) and their evaluations at start and end."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    colours = {"rl": "tab:blue", "control": "tab:grey"}
    for arm, entries in result["arms"].items():
        for i, e in enumerate(entries):
            ax1.plot(e["curve"], color=colours[arm], alpha=0.2, linewidth=0.8)
            ax1.plot(rolling_mean(e["curve"], SMOOTH), color=colours[arm], linewidth=1.6,
                     label=f"{arm} ({SMOOTH}-step mean)" if i == 0 else None)
            ax2.plot([0, 1], [e["reward_start"], e["reward_end"]], "o-", color=colours[arm],
                     label=f"{arm}: training prompts" if i == 0 else None)
            if e["heldout_start"] is not None and e["heldout_end"] is not None:
                ax2.plot([0, 1], [e["heldout_start"], e["heldout_end"]], "s--", color=colours[arm], alpha=0.6,
                         label=f"{arm}: held-out rate" if i == 0 else None)
    ax1.set(xlabel="RL step", ylabel="mean reward of the step's samples", title="training reward")
    ax2.set(xticks=[0, 1], xticklabels=["start", "end"], ylabel="reward / rate", title="fixed evaluations")
    for ax in (ax1, ax2):
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_all(device: str, seeds: list[int], out: Path, overrides: list[str], variants: bool, log) -> dict:
    """Every (seed, arm) run in one local Ray cluster; the result object (``arms``, ``seconds``, ...)."""
    import ray

    from dice_ray.cluster.run_folder import new_run_dir
    from dice_ray.cluster.trainer import Trainer
    from dice_ray.config import load_config
    from dice_ray.report import read_metrics

    t0 = time.perf_counter()
    out = out / "runs" / time.strftime("%Y%m%d-%H%M%S")  # the run folders of this invocation
    arms: dict[str, list] = {arm: [] for arm in ARMS}
    try:
        for seed in seeds:
            for arm in ARMS:
                cfg = load_config(PRESETS[device], overrides + arm_overrides(arm, seed, out, device, variants))
                log(f"== {arm}, seed {seed} ==")
                trainer = Trainer(cfg, new_run_dir(cfg))
                try:
                    summary = trainer.run()
                finally:
                    trainer.shutdown()
                arms[arm].append(run_entry(summary, read_metrics(Path(summary["run_dir"])), device))
    finally:
        ray.shutdown()
    return {"device": device, "preset": str(PRESETS[device].relative_to(ROOT)), "overrides": overrides,
            "seeds": seeds, "speedup_variants": variants, "arms": arms, "seconds": time.perf_counter() - t0}


def describe(result: dict) -> str:
    """A table: one row a run, then the targets."""
    rows = [f"{'arm':8} {'seed':>4} {'reward start':>12} {'end':>6} {'rise':>7} {'held-out':>9} {'end':>6} "
            f"{'ok':>6} {'end':>6} {'computes':>8} {'speedup':>8} {'end':>6}"]
    fmt = lambda x, spec=".3f": "n/a" if x is None else format(x, spec)  # noqa: E731
    for arm, entries in result["arms"].items():
        for seed, e in zip(result["seeds"], entries):
            rise = e["reward_end"] - e["reward_start"]
            rows.append(f"{arm:8} {seed:>4} {fmt(e['reward_start']):>12} {fmt(e['reward_end']):>6} {rise:>+7.3f} "
                        f"{fmt(e['heldout_start']):>9} {fmt(e['heldout_end']):>6} {fmt(e['heldout_ok_start']):>6} "
                        f"{fmt(e['heldout_ok_end']):>6} {fmt(e['computes_end'], '.0%'):>8} "
                        f"{fmt(e['speedup_start'], '.2f'):>8} {fmt(e['speedup_end'], '.2f'):>6}")
    if result["device"] == "cuda":  # where the policy picks its kernel: the end-to-end samples
        rows.append(f"{'arm':8} {'seed':>4} {'e2e speedup start':>17} {'end':>6} {'slower variant start':>20} {'end':>6}")
        for arm, entries in result["arms"].items():
            for seed, e in zip(result["seeds"], entries):
                slow = e["slow_share_by_phase"]
                rows.append(f"{arm:8} {seed:>4} {fmt(e2e_speedup(e, 'start'), '.2f'):>17} "
                            f"{fmt(e2e_speedup(e, 'end'), '.2f'):>6} {fmt(slow['start'].get('e2e'), '.0%'):>20} "
                            f"{fmt(slow['end'].get('e2e'), '.0%'):>6}")
    rows.append(f"{len(result['seeds']) * len(ARMS)} runs in {result['seconds']:.0f} s")
    rows += [f"{'met' if ok else 'MISSED':6} {name}: {detail}" for name, ok, detail in check_targets(result)]
    return "\n".join(rows)


def parse_seeds(text: str) -> list[int]:
    """``"0,1,2"`` -> ``[0, 1, 2]``."""
    try:
        seeds = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seeds {text!r}: expected comma-separated integers") from None
    if not seeds or any(s < 0 for s in seeds):
        raise argparse.ArgumentTypeError(f"--seeds {text!r}: expected one or more integers >= 0")
    return seeds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=sorted(PRESETS), default="cpu", help="preset and verifier (default cpu)")
    ap.add_argument("--seeds", type=parse_seeds, default=[0, 1, 2], help="RL seeds (default 0,1,2)")
    ap.add_argument("--speedup-variants", action="store_true",
                    help="warm-start on the built-in slower variants too (tasks.solution_variants): does RL move to the "
                         "faster kernel? (GPU)")
    ap.add_argument("--out", type=Path, default=Path("runs/learning"), help="folder of the runs and the PNG")
    ap.add_argument("--json", action="store_true", help="print the result as one JSON object on stdout")
    ap.add_argument("overrides", nargs="*", help="config overrides (key=value) applied to every run")
    args = ap.parse_args(argv)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("benchmarks/learning.py --device cuda: no GPU visible (torch.cuda.is_available() is False)",
                  file=sys.stderr)
            return 2
    args.out.mkdir(parents=True, exist_ok=True)
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    # the runs' consoles go to stderr, so that --json leaves stdout to the result
    with contextlib.redirect_stdout(sys.stderr):
        result = run_all(args.device, args.seeds, args.out.resolve(), args.overrides, args.speedup_variants, log)
    result["plot"] = str(plot(result, args.out / "learning.png"))
    (args.out / "learning.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result) if args.json else describe(result))
    if args.json:
        log(describe(result))
    missed = [t for t in check_targets(result) if not t[1]]
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
