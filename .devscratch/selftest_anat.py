import time, sys, os, json
T0 = time.perf_counter()
import torch
from dice_ray import launch
from dice_ray.config import VerifyConfig
from dice_ray.verify.harness import Harness
from dice_ray.verify import harness as H
t_imp = time.perf_counter()
torch.cuda.set_device(0); torch.cuda.init(); torch.cuda.set_per_process_memory_fraction(0.15, 0)
launch.configure(compile_only=False); launch._context(0)
t_cuda = time.perf_counter()
settings = {**VerifyConfig().model_dump(), "mode": "gpu", "device": 0, "gpu_memory_fraction": 0.15, "forked": True}
h = Harness("gpu", 0, settings)
t_h = time.perf_counter()
log = []
def wrap(obj, name):
    f = getattr(obj, name)
    def g(*a, **k):
        t0 = time.perf_counter()
        try: return f(*a, **k)
        finally: log.append((name, round(1e3 * (time.perf_counter() - t0), 1)))
    setattr(obj, name, g)
for n in ("_poison_free_memory", "_call_candidate", "cuda_healthy", "_check_reference", "_inputs", "_check_precision", "_compare", "_trial"):
    wrap(h, n)
for rep in range(2):
    log.clear(); marks = []
    t0 = time.perf_counter()
    r = h.self_test(lambda s: marks.append((s, time.perf_counter())), timing=False)
    t1 = time.perf_counter()
    marks.append(("end", t1))
    st = {a: round(1e3 * (tb - ta), 1) for (a, ta), (b, tb) in zip(marks, marks[1:])}
    t2 = time.perf_counter(); h.collect(); t3 = time.perf_counter()
    print(json.dumps({"rep": rep, "self_test_ms": round(1e3 * (t1 - t0), 1), "stages": st, "collect_ms": round(1e3*(t3-t2),1), "calls": log, "r": r[:80]}))
print(json.dumps({"import_ms": round(1e3*(t_imp-T0)), "cuda_ms": round(1e3*(t_cuda-t_imp)), "harness_init_ms": round(1e3*(t_h-t_cuda))}))
from dice_ray.verify import sandbox
t4 = time.perf_counter(); sandbox.apply_limits(file_size_mib=64, address_space_gib=None); sandbox.install_seccomp(); print("limits+seccomp ms", round(1e3*(time.perf_counter()-t4),1))
