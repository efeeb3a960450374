import cProfile, pstats, sys, time, io
import torch
from dice_ray.config import VerifyConfig
from dice_ray.tasks.loaders import load_tasks
from dice_ray.verify.harness import Harness
from dice_ray.verify.rules import check_candidate
cfg = VerifyConfig()
settings = {**cfg.model_dump(), "mode": "gpu", "device": 0, "gpu_memory_fraction": 0.3}
h = Harness("gpu", 0, settings)
print(h.self_test())
tasks = [t for t in load_tasks("builtin").tasks if t.solution_format == "fast"]
n = int(sys.argv[1]) if len(sys.argv) > 1 else 30
jobs = []
for t in tasks[:n]:
    rep = check_candidate(t.solution_src)
    jobs.append({"task_id": t.task_id, "reference_src": t.reference_src, "candidate_src": t.solution_src,
                 "kernel_refs": {k: sorted(v) for k, v in rep.kernel_refs.items()}, "cpu_budget_s": 600})
stages = {}
def stage_cb(name):
    stages.setdefault("marks", []).append((name, time.perf_counter()))
# warm each once
for j in jobs:
    h.run(j, lambda s: None)
pr = cProfile.Profile()
tot = {}
for j in jobs:
    marks = []
    t0 = time.perf_counter()
    pr.enable()
    r = h.run(j, lambda s: marks.append((s, time.perf_counter())))
    pr.disable()
    t1 = time.perf_counter()
    marks.append(("end", t1))
    d = {}
    for (a, ta), (b, tb) in zip(marks, marks[1:]):
        d[a] = d.get(a, 0) + tb - ta
    for k, v in d.items():
        tot.setdefault(k, []).append(v)
    rr = r.to_dict()
    print(f"{j['task_id']:40s} {rr['verdict']:9s} wall {1e3*(t1-t0):6.1f} ms " + " ".join(f"{k} {1e3*v:.1f}" for k, v in d.items())
          + " | " + str({k: round(1e3*v, 1) for k, v in (rr.get('timing_s') or {}).items()}))
    print("    ", (rr.get("reason") or "")[:400])
for k, v in tot.items():
    v = sorted(v); print(f"stage {k}: median {1e3*v[len(v)//2]:.1f} ms sum {sum(v)*1e3:.0f} ms")
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(35); print(s.getvalue())
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("cumtime").print_stats(45); print(s.getvalue())
