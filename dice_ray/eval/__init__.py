"""Benchmark evaluation (``dice-ray eval``) and dataset curation (``dice-ray curate``).

* :mod:`dice_ray.eval.metrics`: KernelBench's metrics (compiled %, correct %, fast_p, geomean
  speedup) and pass@k (Chen et al. 2021), per level and overall;
* :mod:`dice_ray.eval.report`: ``results.json``, ``results.md`` and ``results.png``;
* :mod:`dice_ray.eval.run`: candidates from a policy or a solutions folder, verified;
* :mod:`dice_ray.eval.curate`: the subset of tasks whose reference solution is fast enough.
"""
