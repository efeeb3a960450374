"""The trials stage: what the sandboxed worker does with a job (correctness, ablation, precision, timing).

``harness.py`` (:class:`~dice_ray.verify.trials.harness.Harness`) runs a job's stages; its parts, one concept a
module: source execution (``execution.py``) under the import guard (``import_guard.py``) with the load_inline
stand-in (``inline_loader.py``), the reference (``reference.py``), the correctness trials
(``correctness_trials.py``), the kernel ablation (``ablation.py``), the precision check (``precision.py``),
compile-only's dry run (``dry_run.py``), the timing stage (``timing_stage.py``) and the self-test
(``self_test.py``).  What they use: the outcomes (``outcome.py``), launch counting (``launches.py``,
``inline_launches.py``), the op recorder (``op_recorder.py``), host reads and their replay (``host_reads.py``),
meta standing for the GPU (``meta_device.py``), output comparison (``correctness.py``, ``mismatch_kernel.py``),
the reference's facts (``reference_facts.py``), timed windows (``timing.py``, ``gpu_spin.py``), values
(``values.py``), torch settings (``torch_state.py``) and bindings made at import (``bound.py``).

Reads the candidate and rules stages only (and :mod:`dice_ray.launch`, the fast format's run time); the sandbox
runs it, nothing here knows the worker process.
"""
