import sys, time, collections
import torch
from dice_ray.config import VerifyConfig
from dice_ray.tasks.loaders import load_tasks
from dice_ray.verify import harness as H, timing as T, gpu_spin
from dice_ray.verify.rules import check_candidate
cfg = VerifyConfig()
settings = {**cfg.model_dump(), "mode": "gpu", "device": 0, "gpu_memory_fraction": 0.3}
h = H.Harness("gpu", 0, settings)
h.self_test()
log = []
P = time.perf_counter
def wrap(mod, name, tag):
    f = getattr(mod, name)
    def g(*a, **k):
        t0 = P(); r = f(*a, **k); log.append((tag, t0, P())); return r
    setattr(mod, name, g)
wrap(T, "_zero", "zero"); wrap(T, "_synchronize", "sync"); wrap(T, "_query", "query")
rec_n = [0]
orig_rec = T._record
def rec(ev):
    t0 = P(); orig_rec(ev); log.append(("rec", t0, P()))
T._record = rec
orig_for = gpu_spin.for_device
def for_device(d):
    s = orig_for(d)
    def spin(c):
        t0 = P(); s(c); log.append(("spin", t0, P()))
    return spin
T.gpu_spin = type("M", (), {"for_device": staticmethod(for_device)})
tasks = {t.name.split("/")[-1]: t for t in load_tasks("builtin").tasks if t.solution_format == "fast"}
for name in sys.argv[1:]:
    t = tasks[name]
    rep = check_candidate(t.solution_src)
    job = {"task_id": t.task_id, "reference_src": t.reference_src, "candidate_src": t.solution_src,
           "kernel_refs": {k: sorted(v) for k, v in rep.kernel_refs.items()}, "cpu_budget_s": 600}
    h.run(job, lambda s: None)
    for rep_i in range(2):
        log.clear()
        t0 = P(); r = h.run(job, lambda s: None).to_dict(); t1 = P()
        # transitions: previous event end -> this event start (host gap), and each event's own duration
        gaps = collections.defaultdict(list); durs = collections.defaultdict(list)
        seq = []
        for (a, s0, e0), (b, s1, e1) in zip(log, log[1:]):
            gaps[f"{a}->{b}"].append(1e3 * (s1 - e0))
        for a, s0, e0 in log:
            durs[a].append(1e3 * (e0 - s0))
        print(f"{name}: wall {1e3*(t1-t0):.1f} ms, timing_s {r.get('timing_s')}")
        print("   durations (count, sum ms, median us):", {k: (len(v), round(sum(v), 2), round(1e3 * sorted(v)[len(v)//2], 1)) for k, v in durs.items()})
        print("   gaps (count, sum ms, median us):", {k: (len(v), round(sum(v), 2), round(1e3 * sorted(v)[len(v)//2], 1)) for k, v in gaps.items()})
        print("   ", r["reason"][-600:])
