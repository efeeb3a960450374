"""The sandbox stage: the worker process that runs the trials, and its parent side.

``runner.py`` (:class:`~dice_ray.verify.sandbox.runner.WorkerProcess`, the parent side: spawn, the stage
protocol, timeouts, the GPU gate) starts ``worker.py`` (the sandboxed process, which runs
:class:`~dice_ray.verify.trials.harness.Harness`) cold or forked from the fork server ``zygote.py``; they talk in
``protocol.py``'s frames.  The worker's confinement: its environment and private folder (``environment.py``),
its rlimits (``rlimits.py``), what the kernel enforces (``confine.py``: Landlock, seccomp); its start-up loads
CUDA kernels without running them (``kernel_preload.py``).

Reads the candidate, rules and trials stages (the worker runs the trials); the verifier drives it.
"""
