"""The timing stage: reference and candidate timed in windows on fresh inputs, large speedups audited, the
timed calls' outputs checked.

Windows of ``k..2k-1`` calls (sizes secret) long enough that host jitter does not matter, fresh inputs every
call (:mod:`dice_ray.verify.trials.timing`); every timed call must launch one of the candidate's kernels
(``no-kernel-launch``); the timed calls' outputs are compared with the reference's (caching, batch-and-skip,
deferring work and behaving differently once timed give ``incorrect``; compared after the timing stage, in the
shared ``check`` stage, by :class:`TimedOutputChecks`), and speedups above ``audit_speedup`` are re-timed by the
host clock: ``timing-audit``.
"""

from __future__ import annotations

import os
import random
from typing import Any, Callable

import torch

from dice_ray.verify.trials import bound, launches, timing
from dice_ray.verify.trials.correctness import count_mismatches_batch, flatten_outputs
from dice_ray.verify.trials.outcome import JobResult, RuleBroken
from dice_ray.verify.trials.values import check_output_types, clone

__all__ = ["TimedOutputChecks", "TimingStage"]

_STAGE_BUDGET_FRACTION = 0.3  # timing of one side may use this share of run_timeout_s
_CHECK_ALL_BYTES = 64 * 2**20  # outputs up to this size: _CHECKED_CALLS and window ends checked; larger: output_checks
_CHECKED_CALLS = 64  # timed calls (besides each window's last) whose outputs are checked, drawn in secret
_WINDOW_OUTPUT_BYTES = 2**30  # a timed window's outputs (alive until checked) stay under this
_KEPT_OUTPUT_BYTES = 512 * 2**20  # checked timed outputs kept for the shared check stage; beyond, compared at once


class TimingStage:
    """The timing stage of a job, a part of :class:`~dice_ray.verify.trials.harness.Harness`.

    Reads the harness's ``settings`` (``timing_trials``, ``warmup``, ``run_timeout_s``, ``timing_window_ms``,
    ``input_pool_mib``, ``output_checks``, ``audit_speedup``, ``audit_factor``, ``compile_baseline``),
    ``device`` / ``dev``, ``flush`` and ``input_seed``; calls its ``_inputs``
    (:class:`~dice_ray.verify.trials.reference.ReferenceRuns`) and ``_tolerances``.
    """

    def _measure(self, ref: dict, ref_model: Any, model: Any, ref_mutates: bool,
                 stage: Callable[..., Any]) -> dict[str, Any] | JobResult:
        """Time reference and candidate on one :class:`~dice_ray.verify.trials.timing.InputSchedule`,
        audit large speedups, then (stage ``check``: the GPU shared again) compare the timed
        calls' outputs with the reference's (:class:`TimedOutputChecks`); returns the JobResult
        fields or a failing JobResult.

        Raises:
            RuleBroken: ``no-kernel-launch`` (a call launched no candidate kernel), ``timing-audit``.
        """
        s, dev = self.settings, self.dev
        assert self.flush is not None
        base = self.input_seed + 1000
        pool_bytes = int(s.get("input_pool_mib", 1024) * 2**20)
        warmup = max(1, s["warmup"])
        make = lambda seed: self._inputs(ref, seed, dev)  # noqa: E731
        start = bound.perf()
        # the call-time probe: 3 one-call windows a side after a warm-up one (the median resists one slow window)
        probe = timing.InputSchedule(make, base - 4, 4, pool_bytes)
        t0 = bound.perf()
        p = timing.time_calls(ref_model, model, probe, {"reference": [1] * 4, "candidate": [1] * 4}, 1, self.flush,
                              self.device, ref_mutates=ref_mutates)
        per_call = (bound.perf() - t0) / 8  # host seconds of one call in its own window (either side)
        call_ms = {k: timing.spread_stats(p.per_call[k])[0] for k in ("reference", "candidate")}
        in_bytes = timing.input_bytes(probe(1))
        with torch.no_grad():
            out_bytes = timing.input_bytes(flatten_outputs(ref_model(*[clone(x) for x in probe(1)])))
        del probe
        limit = min(pool_bytes // max(in_bytes, 1), _WINDOW_OUTPUT_BYTES // max(2 * out_bytes, 1))
        window_ms = float(s.get("timing_window_ms", 0.0))
        k = {side: timing.calls_per_window(ms, window_ms, (limit + 1) // 2) for side, ms in call_ms.items()}
        budget = s["run_timeout_s"] * _STAGE_BUDGET_FRACTION
        trials = max(3, min(s["timing_trials"], int(budget / max(1.5 * max(k.values()) * per_call, 1e-6))))
        warmup = -(-warmup // min(k.values()))  # warm-up windows: at least `warmup` calls a side
        secret = random.Random(os.urandom(8))  # window sizes and checked calls: unknowable to the candidate
        sizes = {side: timing.window_sizes(n, warmup + trials, secret) for side, n in k.items()}
        spans = [max(r, c) for r, c in zip(sizes["reference"], sizes["candidate"])]
        calls = sum(spans)
        schedule = timing.InputSchedule(make, base, calls, pool_bytes)
        firsts = [sum(spans[:w]) for w in range(len(spans))]
        ends = {j0 + n - 1 for j0, n in zip(firsts, sizes["candidate"])}  # each candidate window's last call
        cand_calls = [j0 + i for j0, n in zip(firsts, sizes["candidate"]) for i in range(n)]
        if out_bytes <= _CHECK_ALL_BYTES:  # each window's last call (deferred work) and a secret sample
            checked = ends | set(secret.sample(cand_calls, min(len(cand_calls), _CHECKED_CALLS)))
        else:
            n = min(len(cand_calls) - 1, int(s.get("output_checks", 5)))
            checked = {cand_calls[-1], *secret.sample(cand_calls[:-1], n)}
        counts = [launches.count()]
        parts = {"probe": bound.perf() - start, "check": 0.0}

        def launched(side: str, j: int) -> None:
            if side != "candidate":
                counts[0] = launches.count()
                return
            if launches.count() == counts[0]:
                raise RuleBroken("no-kernel-launch", f"timed call {j} of ModelNew.forward launched no kernel")
            counts[0] = launches.count()

        checks = TimedOutputChecks(self._tolerances(), lambda j: f"timed call {j} (inputs of seed {base + j})")

        def check(j: int, ref_out: Any, out: Any, inputs: list[Any]) -> None:
            t_check = bound.perf()
            try:
                checks.add(j, ref_out, out, inputs)
            finally:
                counts[0] = launches.count()  # the comparison kernels are not the candidate's launches
                parts["check"] += bound.perf() - t_check

        t_windows = bound.perf()
        try:
            times = timing.time_calls(ref_model, model, schedule, sizes, warmup, self.flush, self.device, check,
                                      checked, ref_mutates, self._compiled(ref_model, schedule(0)), each_call=launched)
        except _Mismatch as e:
            return JobResult("incorrect", compiled=True, correct=False, reason=str(e))
        parts["fill"] = schedule.fill_s
        parts["windows"] = bound.perf() - t_windows - parts["fill"] - parts["check"]
        parts["gpu"] = 1e-3 * sum(t * n for side, v in times.per_call.items()
                                  for t, n in zip(v, sizes["candidate" if side == "candidate" else "reference"][warmup:]))
        parts.update({f"windows.{k}": v for k, v in times.host_s.items()})
        t_rest = bound.perf()
        net = {side: timing.spread_stats([max(t, 1e-6) for t in v]) for side, v in times.per_call.items()}
        (ref_ms, ref_spread), (cand_ms, cand_spread) = net["reference"], net["candidate"]
        speedup = ref_ms / max(cand_ms, 1e-6)
        timed = {side: v[warmup:] for side, v in sizes.items()}
        note = (f"candidate {cand_ms:.4f} ms (IQR {cand_spread:.0%}), reference {ref_ms:.4f} ms (IQR {ref_spread:.0%}), "
                f"speedup {speedup:.3f}x over {trials} timed windows a side of "
                f"{min(timed['reference'])}-{max(timed['reference'])} reference and "
                f"{min(timed['candidate'])}-{max(timed['candidate'])} candidate calls on {schedule.slots} input slots "
                f"(stream-ordered end events; windows whose work outlasted the stream, timed to the device-wide "
                f"synchronize: {times.outlasted.get('reference', 0)} reference, {times.outlasted.get('candidate', 0)} "
                f"candidate; windows the host was still queuing when the GPU reached them, left out while half are clean: "
                f"{times.host_bound.get('reference', 0)} reference, {times.host_bound.get('candidate', 0)} candidate), "
                f"{len(checked)} outputs checked")
        if speedup > s.get("audit_speedup", 10.0):
            audit = {side: v[warmup: warmup + min(trials, 10)] for side, v in sizes.items()}
            ref_wall, _ = timing.spread_stats(timing.wall_times(ref_model, schedule, audit["reference"], self.flush,
                                                                self.device))
            cand_wall, _ = timing.spread_stats(timing.wall_times(model, schedule, audit["candidate"], self.flush,
                                                                 self.device))
            wall_speedup = ref_wall / max(cand_wall, 1e-6)
            factor = s.get("audit_factor", 3.0)
            if speedup > factor * wall_speedup:
                raise RuleBroken("timing-audit", f"CUDA events give {speedup:.1f}x but the host wall clock {wall_speedup:.1f}x "
                                 f"(reference {ref_wall:.4f} ms, candidate {cand_wall:.4f} ms a call): more than {factor:g}x apart")
            note += f"; audit: wall-clock speedup {wall_speedup:.1f}x"
        parts["audit"] = bound.perf() - t_rest
        del schedule
        stage("check")
        t_check = bound.perf()
        try:
            wrong, n_checked = checks.wrong()
        except _Mismatch as e:
            return JobResult("incorrect", compiled=True, correct=False, reason=str(e))
        parts["check"] += bound.perf() - t_check
        if wrong:
            j, n = wrong[0]
            return JobResult("incorrect", compiled=True, correct=False,
                             reason=f"timed call {j} (inputs of seed {base + j}): {n} elements differ from the "
                             f"reference's; {len(wrong)} of {n_checked} checked timed calls wrong")
        fields = {"speedup": speedup, "ref_ms": ref_ms, "candidate_ms": cand_ms, "ref_spread": ref_spread,
                  "candidate_spread": cand_spread, "note": note,
                  "parts_s": {f"timing.{k}": round(v, 5) for k, v in parts.items()}}
        if "baseline" in net:
            compiled_ms = net["baseline"][0]
            fields.update(compiled_ref_ms=compiled_ms, speedup_compiled=compiled_ms / max(cand_ms, 1e-6))
            fields["note"] += f"; torch.compile reference {compiled_ms:.4f} ms"
        return fields

    def _compiled(self, ref_model: Any, example: list[Any]) -> Callable[..., Any] | None:
        """``torch.compile(reference)`` when ``compile_baseline`` is on, compiled and warmed here
        (outside any timed window); None when off or when it fails to compile."""
        if not self.settings.get("compile_baseline"):
            return None
        try:
            compiled = torch.compile(ref_model)
            with torch.no_grad():
                compiled(*[clone(x) for x in example])
            bound.synchronize(self.device)
            return compiled
        except Exception:  # noqa: BLE001 - the baseline is a report, never a verdict
            return None


class _Mismatch(Exception):
    """A timed call's output differs from the reference's (verdict ``incorrect``)."""


def _shares_memory(outputs: list[Any], inputs: list[Any]) -> bool:
    """Whether a tensor of ``outputs`` lives in the storage of a tensor of ``inputs``."""
    held = {x.untyped_storage().data_ptr() for x in inputs if isinstance(x, torch.Tensor)}
    return any(isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() in held for o in outputs)


class TimedOutputChecks:
    """The timed calls' outputs to compare with the reference's, kept and compared in batches.

    :meth:`add` keeps a pair (no GPU work, so the exclusive timing stage spends nothing on it)
    until ``keep_bytes`` of outputs are held; then the held pairs are compared at once
    (:func:`~dice_ray.verify.trials.correctness.count_mismatches_batch`: a few kernels, no sync).
    :meth:`wrong` compares the rest and reads every count with one sync: the harness calls it in
    the shared ``check`` stage, after the timing stage.

    Args:
        tolerances: ``rtol``, ``atol``, ``half_rtol``, ``half_atol`` (VerifyConfig fields).
        describe: ``j -> str`` naming timed call ``j`` in a reason (its inputs' seed).
        keep_bytes: outputs (candidate's and reference's) held before a batch is compared (bytes).
    """

    def __init__(self, tolerances: dict[str, float], describe: Callable[[int], str],
                 keep_bytes: int = _KEPT_OUTPUT_BYTES):
        self.tolerances = tolerances
        self.describe = describe
        self.keep_bytes = keep_bytes
        self._pending: list[tuple[int, Any, Any]] = []
        self._held = 0
        self._counts: list[tuple[list[int], torch.Tensor]] = []

    def add(self, j: int, ref_out: Any, out: Any, inputs: list[Any] = ()) -> None:
        """Keep timed call ``j``'s outputs for comparison; compare at once when an output shares
        memory with ``inputs`` (a pool slot whose values change before the check stage).

        Raises:
            RuleBroken: ``output-type`` (an output is not a plain Tensor).
            _Mismatch: a batch compared now has a structure, shape or dtype mismatch.
        """
        check_output_types(out)
        self._pending.append((j, ref_out, out))
        self._held += sum(timing.input_bytes(flatten_outputs(o)) for o in (ref_out, out))
        if self._held > self.keep_bytes or _shares_memory([*flatten_outputs(ref_out), *flatten_outputs(out)], inputs):
            self._compare()

    def _compare(self) -> None:
        if not self._pending:
            return
        calls = [j for j, _, _ in self._pending]
        counts = count_mismatches_batch([(out, ref) for _, ref, out in self._pending], **self.tolerances)
        self._pending, self._held = [], 0
        if isinstance(counts, tuple):
            i, reason = counts
            raise _Mismatch(f"{self.describe(calls[i])}: {reason}")
        self._counts.append((calls, counts))

    def wrong(self) -> tuple[list[tuple[int, int]], int]:
        """Compare what is held and read every count (one sync).

        Returns:
            ``([(call, failing elements), ...] for the wrong calls in call order, calls checked)``.
        Raises:
            _Mismatch: a structure, shape or dtype mismatch.
        """
        self._compare()
        if not self._counts:
            return [], 0
        calls = [j for js, _ in self._counts for j in js]
        counts = torch.cat([c.to(self._counts[0][1].device) for _, c in self._counts]).tolist()
        return sorted((j, n) for j, n in zip(calls, counts) if n), len(calls)
