"""What the sandboxed worker does with one job: the candidate loaded, the reference checked, trials, timing.

Runs inside :mod:`dice_ray.verify.sandbox.worker` (never in the verifier's own process).  Stages follow
KernelBench's ``eval.py`` (seeded ``Model`` and ``ModelNew`` from ``get_init_inputs()``, several
input trials, allclose) and ``timing.py`` (CUDA events, L2 flush, warm-up), as small typed steps,
with the run-time anti-cheat rules added.  :class:`Harness` runs a job's stages in order; each concept is a
part of it in its own module:

* ``load``: the candidate's module executed (:mod:`~dice_ray.verify.trials.execution`; NVRTC compiles here)
  under the import guard (:mod:`~dice_ray.verify.trials.import_guard`), a load_inline candidate with its
  prebuilt extensions (:mod:`~dice_ray.verify.trials.inline_loader`);
* ``reference``: the task's reference loaded, built and checked on trial 0, its facts measured
  (:class:`~dice_ray.verify.trials.reference.ReferenceRuns`, :mod:`~dice_ray.verify.trials.reference_facts`);
* ``run``: the correctness trials (:class:`~dice_ray.verify.trials.correctness_trials.CorrectnessTrials`):
  every candidate call launches >= 1 kernel of the candidate (``no-kernel-launch``,
  :mod:`~dice_ray.verify.trials.launches`), its aten ops are seen by a dispatch mode (``forward-torch-op``,
  :mod:`~dice_ray.verify.trials.op_recorder`), inputs compared with a pristine copy (``input-mutation``),
  outputs plain tensors (``output-type``) on NaN-poisoned free memory; the kernel ablation in the second trial
  (``kernel-not-used``, :class:`~dice_ray.verify.trials.ablation.KernelAblation`); fp32 outputs against a float64
  run of the reference in trial 0 (``precision-downgrade``, :class:`~dice_ray.verify.trials.precision.PrecisionCheck`);
  in compile-only mode the dry run instead (:class:`~dice_ray.verify.trials.dry_run.DryRun`);
* ``timing`` and ``check``: windows of calls timed by CUDA events, large speedups audited, the timed calls'
  outputs compared (``timing-audit``, :class:`~dice_ray.verify.trials.timing_stage.TimingStage`).

The worker verifies a built-in candidate at start (:class:`~dice_ray.verify.trials.self_test.SelfTest`).
Failures are typed (:mod:`~dice_ray.verify.trials.outcome`: :class:`JobResult`), not recognised by matching
exception text, except the CUDA-error probe that decides whether the worker must be replaced (``fatal``).
"""

from __future__ import annotations

import gc
from typing import Any, Callable

import torch

from dice_ray import launch
from dice_ray.verify.candidate.nvrtc import CompileError
from dice_ray.verify.trials import bound, gpu_spin, inline_launches, mismatch_kernel, torch_state
from dice_ray.verify.trials.ablation import KernelAblation
from dice_ray.verify.trials.correctness_trials import CorrectnessTrials
from dice_ray.verify.trials.dry_run import DryRun
from dice_ray.verify.trials.execution import (check_load_cuda_source, exec_inline, exec_source, inline_stand_in,
                                              standing_in)
from dice_ray.verify.trials.inline_loader import InlineLoadError
from dice_ray.verify.trials.outcome import JobResult, ReferenceError_, RuleBroken, error_text, in_candidate_lines
from dice_ray.verify.trials.precision import PrecisionCheck
from dice_ray.verify.trials.reference import ReferenceRuns
from dice_ray.verify.trials.reference_facts import ReferenceFacts
from dice_ray.verify.trials.self_test import SelfTest
from dice_ray.verify.trials.timing_stage import TimingStage
from dice_ray.verify.trials.values import seed_all

__all__ = ["Harness"]


class Harness(ReferenceRuns, DryRun, CorrectnessTrials, KernelAblation, PrecisionCheck, TimingStage, SelfTest):
    """Runs jobs in the worker.

    Args:
        mode: ``"gpu"`` or ``"compile_only"``.
        device: CUDA ordinal (gpu mode).
        settings: the worker's settings (VerifyConfig fields as a dict).

    Attributes:
        dev: the torch device jobs run on (``cuda:<device>``, or the CPU in compile-only mode).
        flush: a buffer of twice the L2 size the timed windows zero (GPU mode), else None.
        jobs: jobs run so far.
        input_seed: the current job's base seed of its inputs (``job["input_seed"]``).
    """

    def __init__(self, mode: str, device: int | None, settings: dict[str, Any]):
        self.mode = mode
        self.device = device
        self.settings = settings
        self.flush: torch.Tensor | None = None
        self.jobs = 0
        self.input_seed = int(settings["seed"])  # a job's own: job["input_seed"] (Verifier.input_seed)
        if mode == "gpu":
            assert device is not None
            self.dev = torch.device("cuda", device)
            l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 * 2**20) or 64 * 2**20
            self.flush = torch.empty(int(2 * l2) // 4, dtype=torch.int32, device=self.dev)
            mismatch_kernel.warm(device)  # the output checks' kernels, in the worker's set-up, not a job
            gpu_spin.for_device(device)  # the timed windows' spin, likewise
        else:
            self.dev = torch.device("cpu")
        self._torch_state = torch_state.save()
        if settings.get("static_rules", True):
            launch.configure(source_check=check_load_cuda_source)

    def _restore_torch_state(self) -> None:
        """Put back the torch settings saved at start (:mod:`~dice_ray.verify.trials.torch_state`)."""
        torch_state.restore(self._torch_state)

    def cuda_healthy(self) -> bool:
        """False when the CUDA context holds a sticky error (the worker must be replaced)."""
        if self.mode != "gpu":
            return True
        try:
            from cuda.bindings import driver

            (err,) = driver.cuCtxSynchronize()  # an error code, not torch's exception (tens of ms to build after a fault)
            if err != driver.CUresult.CUDA_SUCCESS:
                return False
            t = torch.ones(1, device=self.dev)
            return float((t + 1).item()) == 2.0
        except Exception:  # noqa: BLE001
            return False

    def run(self, job: dict[str, Any], stage: Callable[..., Any]) -> JobResult:
        """Verify one candidate; ``stage(name, **extra)`` is called at each stage boundary ("load",
        "reference", "run", "timing", "check") so the parent can take the GPU gate and apply that
        stage's time limit.  The reference facts (:mod:`~dice_ray.verify.trials.reference_facts`) travel
        through it: ``stage("reference")`` may return ``{"reference_facts": {...}}`` (the parent's go:
        known facts, then the reference runs once), and a job that measured them passes them on as
        ``stage("run", reference_facts={...})``, before its candidate's model is built.  Never raises
        for a bad candidate or reference."""
        result = JobResult("crash")
        self._error_at: float | None = None  # when the candidate's forward raised (_trial)
        self._host_reads: list[tuple] = []  # the last recorded call's host reads (OpRecorder), replayed by _ablate
        self._read_outputs: Any = None  # that call's outputs when it read the host and they are small (_ablate)
        self._stand_in: Any = None  # a load_inline candidate's torch.utils.cpp_extension (its __init__ may call it)
        try:
            result = self._run(job, stage)
        except RuleBroken as e:
            result = JobResult("cheat", compiled=True, reason=e.message, rule=e.rule)
        except ReferenceError_ as e:
            result = JobResult("invalid_input", compiled=True, reason=e.message, rule=e.rule)
        except (Exception, SystemExit) as e:  # noqa: BLE001 - sys.exit() in a candidate is its crash, not the worker's
            result = JobResult("crash", compiled=True, reason=error_text(e))
        finally:
            t_cleanup = bound.perf()
            launch.configure(dry_run=False)
            try:
                self._restore_torch_state()
            except Exception:  # noqa: BLE001
                result.fatal = True
        if not self.cuda_healthy():
            result.fatal = True
            if result.verdict == "ok":
                result = JobResult("crash", compiled=True, reason="CUDA context broken after the run", fatal=True)
            else:
                result.reason = f"{result.reason}\n(sticky CUDA error: worker replaced)".strip()
        self.jobs += 1
        if self._error_at is not None and result.parts_s is not None:
            result.parts_s["run.after_raise"] = round(bound.perf() - self._error_at, 5)
        if result.fatal:
            return result  # the worker exits: nothing to collect
        gc.collect(1 if self.jobs % 50 else 2)  # a full collection costs ~0.15 s with torch loaded
        if self.mode == "gpu":
            try:
                torch.cuda.empty_cache()
            except Exception:  # noqa: BLE001
                result.fatal = True
        result.parts_s = {**(result.parts_s or {}), "cleanup": round(bound.perf() - t_cleanup, 5)}
        return result

    def _run(self, job: dict[str, Any], stage: Callable[..., Any]) -> JobResult:
        # the inputs' seeds: the Verifier's secret (a candidate that knew them could compute its answers ahead)
        self.input_seed = int(job.get("input_seed", self.settings["seed"]))
        if job.get("reference_only"):
            return self._reference_only(job, stage)
        s = self.settings
        guarded = bool(s.get("static_rules", True))
        # 1. load: execute the candidate module (this is where NVRTC compiles)
        stage("load")
        try:
            if job.get("inline"):  # the load_inline format: prebuilt extensions (trials.inline_loader)
                self._stand_in = inline_stand_in(job["inline"])
                cand = exec_inline(job["candidate_src"], job["inline"], guarded, self._stand_in)
            else:
                inline_launches.reset()  # an earlier candidate's extensions no longer count as launches
                cand = exec_source(job["candidate_src"], "<candidate>", guarded)
        except RuleBroken as e:
            return JobResult("cheat", reason=e.message, rule=e.rule)
        except CompileError as e:
            return JobResult("compile_error", reason=error_text(in_candidate_lines(e, job["candidate_src"]), 6000))
        except SyntaxError as e:
            return JobResult("compile_error", reason=f"Python syntax error: {e}")
        except (Exception, SystemExit) as e:  # noqa: BLE001 - sys.exit() at import: the candidate's crash
            return JobResult("crash", reason=f"executing the candidate module raised {error_text(e)}")
        if not isinstance(cand.get("ModelNew"), type):
            return JobResult("compile_error", compiled=True, reason="the candidate defines no class ModelNew",
                             rule="no-modelnew")
        refs = {k: set(v) for k, v in job.get("kernel_refs", {}).items()}
        unknown = self._unknown_kernels(refs, cand, None)
        if unknown is not None:
            return unknown

        # 2. reference: module, init inputs; the torch flags and the GPU as the job found them (the candidate
        # module ran at load: a flag it set or a kernel it left running would change what the reference computes)
        go = stage("reference")
        ref, init_inputs = self._load_reference(job["reference_src"])
        if self.mode == "compile_only":
            on_meta = self._reference_on_meta(ref, init_inputs)  # in the reference stage: its hang is its own
            stage("run")
            return self._compile_only(cand, init_inputs, refs, on_meta)
        facts = go.get("reference_facts") if isinstance(go, dict) else None
        return self._gpu(cand, ref, init_inputs, refs, stage, job["reference_src"],
                         None if facts is None else ReferenceFacts.from_dict(facts))

    def _model_new(self, cand: dict[str, Any], init_inputs: list, refs: dict[str, set[str]]) -> Any | JobResult:
        """The candidate's ``ModelNew(*init_inputs)``, seeded with ``settings["seed"]``, built on the job's device
        (GPU mode: under it and moved there; compile-only mode: on the CPU, as it is), then the kernel names its
        launch code uses checked against it (:meth:`_unknown_kernels`, the ``self.*`` holders included).

        Returns:
            The model, or the JobResult that ends the job: ``crash`` (the constructor or the move raised) or
            ``compile_error`` (a ``load_inline`` call of ``__init__`` that does not match the built extensions, or
            rule ``unknown-kernel``).
        Raises:
            RuleBroken: a run-time rule the constructor broke.
        """
        seed_all(self.settings["seed"])
        try:
            with standing_in(self._stand_in):  # self.ext = load_inline(...) in __init__ loads a prebuilt extension
                if self.mode == "gpu":
                    with self.dev:
                        model = cand["ModelNew"](*init_inputs).to(self.dev)
                else:
                    model = cand["ModelNew"](*init_inputs)
        except RuleBroken:
            raise
        except InlineLoadError as e:  # a load_inline call in __init__ that does not match the extensions built
            return JobResult("compile_error", reason=error_text(e, 6000))
        except Exception as e:  # noqa: BLE001
            return JobResult("crash", compiled=True, reason=f"ModelNew(*get_init_inputs()) raised {error_text(e)}")
        unknown = self._unknown_kernels(refs, cand, model)
        return model if unknown is None else unknown

    @staticmethod
    def _unknown_kernels(refs: dict[str, set[str]], ns: dict[str, Any], model: Any) -> JobResult | None:
        """The ``unknown-kernel`` check: each kernel the launch code calls (``refs``: ``{holder: kernel names}``,
        the static rules' ``kernel_refs``) must be one its holder compiled.  A holder is a name of the candidate's
        module ``ns`` or ``self.<attr>`` of ``model`` (skipped while ``model`` is None, before it is built).

        Returns:
            A ``compile_error`` JobResult (rule ``unknown-kernel``) naming every holder that is not a ``load_cuda``
            module and every name it lacks, or None when all are found.
        """
        problems = []
        for holder, names in refs.items():
            if holder.startswith("self."):
                if model is None:
                    continue
                mod = getattr(model, holder[5:], None)
            else:
                mod = ns.get(holder)
            if not isinstance(mod, launch.KernelModule):
                problems.append(f"{holder} is not a load_cuda module")
                continue
            missing = sorted(n for n in names if not mod.has_kernel(n) and n not in dir(mod))
            if missing:
                problems.append(f"{holder}.{', '.join(missing)}: no such kernel; compiled kernels: {mod.kernel_names}")
        if not problems:
            return None
        return JobResult("compile_error", compiled=True, reason="; ".join(problems), rule="unknown-kernel")

    def _gpu(self, cand: dict, ref: dict, init_inputs: list, refs: dict[str, set[str]],
             stage: Callable[..., Any], reference_src: str, facts: ReferenceFacts | None) -> JobResult:
        """The GPU stages of a job; ``facts``: the reference's, from an earlier job (None: measured here
        and passed on with the ``run`` stage's announcement)."""
        s = self.settings
        ref_model, inputs0, ref_mutates, expected0, learnt = self._reference_on_trial0(ref, init_inputs, facts)
        seeds = [self.input_seed + 1 + i for i in range(s["correctness_trials"])]  # trial 0's is inputs0's

        stage("run", **({} if learnt is facts else {"reference_facts": learnt.to_dict()}))
        facts = learnt
        model = self._model_new(cand, init_inputs, refs)
        if isinstance(model, JobResult):
            return model
        notes: list[str] = []
        for n, (label, make) in enumerate(self._trials(ref, seeds, inputs0, reference_src, notes)):
            if n:
                stage("run")  # between trials: a worker waiting to time goes first (runner.GpuGate)
            failed = self._trial(model, ref_model, make, label, ref_mutates, precision=facts if n == 0 else None,
                                 notes=notes, expected=expected0 if n == 0 else None, ablate=n == 1)
            expected0 = None
            if failed is not None:
                return failed
        notes.insert(0, f"{len(seeds)} seeded trials correct")
        bound.synchronize(self.device)
        if not s.get("self_test_timing", True):
            return JobResult("ok", compiled=True, correct=True, reason="; ".join(notes + ["self-test: timing skipped"]))

        stage("timing")
        t = self._measure(ref, ref_model, model, ref_mutates, stage)
        if isinstance(t, JobResult):
            return t
        notes.append(t.pop("note"))
        return JobResult("ok", compiled=True, correct=True, reason="; ".join(notes), **t)
