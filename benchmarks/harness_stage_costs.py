"""What each verifier stage costs a candidate alone: the floor under a batch's wall time on one GPU.

Runs the sandbox worker's harness (:class:`dice_ray.verify.trials.harness.Harness`) in this process, with no
other worker beside it, over the correct and incorrect variants of the built-in fast-format tasks
(``verifier_throughput.variants``): a warm pass, then a timed pass. Prints, by kind of candidate, the
seconds of each stage summed and at the median (``load``, ``reference``, ``run``, ``timing``,
``check``, and the harness's own ``cleanup`` and ``timing.*`` parts) and the synchronizes a job made.

A batch through a Verifier (``verifier_throughput.py``) cannot take less than these sums on one GPU:
its workers' processes take turns on the GPU (time slices), so their stages do not overlap there.

Measured on one H200 (2026-12-02): a correct candidate 62.7 ms (at the median: timing stage 40.8,
``run`` 9.2, ``check`` 5.0, cleanup 4.1, ``reference`` 2.8), an incorrect one 6.2 ms, the 218 jobs
7.5 s, against 10.4-12.8 s for a crash-free round of ``verifier_throughput.py`` (the same jobs and
146 that fail to compile or are refused statically) through a 6-worker Verifier.

    python benchmarks/harness_stage_costs.py [--device 0] [--json OUT]

Without a GPU it says so and exits 0.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from verifier_throughput import variants  # noqa: E402
from dice_ray.config import VerifyConfig  # noqa: E402
from dice_ray.tasks.loaders import load_tasks  # noqa: E402
from dice_ray.verify.facts_book import FactsBook  # noqa: E402
from dice_ray.verify.rules.check import check_candidate  # noqa: E402
from dice_ray.verify.trials import bound  # noqa: E402
from dice_ray.verify.trials.harness import Harness  # noqa: E402

KINDS = ("correct", "incorrect")


def jobs() -> list[tuple[str, dict]]:
    """``[(kind, job), ...]``: the worker's job dict for each kind of :data:`KINDS` of every fast-format built-in task."""
    out = []
    for task in load_tasks("builtin").tasks:
        if task.solution_format != "fast":
            continue
        for kind, src in variants(task.solution_src).items():
            if kind in KINDS:
                refs = check_candidate(src).kernel_refs
                out.append((kind, {"candidate_src": src, "reference_src": task.reference_src,
                                   "kernel_refs": {k: sorted(v) for k, v in refs.items()}}))
    return out


def run_job(h: Harness, job: dict, syncs: list[int], facts: FactsBook) -> tuple[str, dict[str, float], int]:
    """Verify ``job``; returns its verdict, the seconds of each stage (the worker's stage boundaries; their sum
    under ``total``) and of each harness part (``cleanup``, ``timing.*``), and the synchronizes it made (counted
    in ``syncs[0]``).  ``facts``: the references' facts, kept from the job that measured them and passed to the
    later ones through the stage callback, as a Verifier does (:mod:`dice_ray.verify.facts_book`)."""
    marks = [("pre", time.perf_counter())]
    before = syncs[0]

    key, token = job["reference_src"], object()

    def stage(name: str, reference_facts: dict | None = None) -> dict:
        marks.append((name, time.perf_counter()))
        if reference_facts is not None:  # measured by this job
            facts.keep(key, reference_facts)
        known = facts.claim(key, token, 0.0) if name == "reference" else None  # one job at a time: never waits
        return {} if known is None else {"reference_facts": known}

    result = h.run(job, stage)
    facts.done(key, token)
    marks.append(("end", time.perf_counter()))
    seconds: dict[str, float] = {}
    for (name, t0), (_, t1) in zip(marks, marks[1:]):
        seconds[name] = seconds.get(name, 0.0) + t1 - t0
    seconds.pop("pre", None)
    seconds["total"] = marks[-1][1] - marks[0][1]
    seconds.update(result.parts_s or {})
    return result.verdict, seconds, syncs[0] - before


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no GPU: the stages' costs are GPU figures (nothing measured)")
        return
    h = Harness("gpu", args.device, {**VerifyConfig().model_dump(), "mode": "gpu", "device": args.device})
    syncs = [0]
    synchronize = bound.synchronize

    def counted(*a, **k):
        syncs[0] += 1
        return synchronize(*a, **k)

    bound.synchronize = counted
    work = jobs()
    facts = FactsBook(capacity=len(work))
    for _, job in work:  # warm: NVRTC compiles cached, kernels loaded, the references' facts measured
        run_job(h, job, syncs, facts)
    gc.collect()
    gc.freeze()  # as a worker does after its start-up
    report = {}
    for kind in KINDS:
        rows = [run_job(h, job, syncs, facts) for k, job in work if k == kind]
        stages = sorted({s for _, sec, _ in rows for s in sec} - {"total"})
        report[kind] = {
            "jobs": len(rows),
            "verdicts": {v: sum(r[0] == v for r in rows) for v in sorted({r[0] for r in rows})},
            "seconds": round(sum(sec["total"] for _, sec, _ in rows), 3),
            "syncs_median": statistics.median(n for _, _, n in rows),
            "stage_sum_s": {s: round(sum(sec.get(s, 0.0) for _, sec, _ in rows), 3) for s in stages},
            "stage_median_ms": {s: round(1e3 * statistics.median(sec[s] for _, sec, _ in rows if s in sec), 2)
                                for s in stages},
        }
        r = report[kind]
        print(f"{kind:9s} {r['jobs']} jobs in {r['seconds']:.2f} s ({1e3 * r['seconds'] / r['jobs']:.1f} ms a job, "
              f"{r['syncs_median']:g} synchronizes at the median); verdicts {r['verdicts']}")
        print("  stages, sum s (median ms): " + ", ".join(
            f"{s} {r['stage_sum_s'][s]:.3f} ({r['stage_median_ms'][s]:.2f})" for s in stages))
    total = sum(r["seconds"] for r in report.values())
    print(f"all {sum(r['jobs'] for r in report.values())} jobs alone: {total:.2f} s")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
