import sys, time, json, subprocess, os
def one():
    import torch
    from dice_ray.config import VerifyConfig
    from dice_ray.tasks.loaders import load_tasks
    from dice_ray.verify import harness as H
    from dice_ray.verify.rules import check_candidate
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from benchmarks_variants import variants
    cfg = VerifyConfig()
    settings = {**cfg.model_dump(), "mode": "gpu", "device": 0, "gpu_memory_fraction": 0.3}
    h = H.Harness("gpu", 0, settings)
    h.self_test(timing=False)
    t = [t for t in load_tasks("builtin").tasks if t.solution_format == "fast"][int(sys.argv[2])]
    src = variants(t.solution_src)["crash"]
    rep = check_candidate(src)
    job = {"task_id": t.task_id, "reference_src": t.reference_src, "candidate_src": src,
           "kernel_refs": {k: sorted(v) for k, v in rep.kernel_refs.items()}, "cpu_budget_s": 600}
    log = []
    T0 = time.perf_counter()
    def wrap(obj, name):
        f = getattr(obj, name)
        def g(*a, **k):
            t0 = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                log.append((name, round(1e3 * (t0 - T0), 1), round(1e3 * (time.perf_counter() - t0), 1)))
        setattr(obj, name, g)
    for n in ("_poison_free_memory", "_call_candidate", "cuda_healthy", "_restore_torch_state", "_check_reference", "_inputs"):
        wrap(h, n)
    wrap(H, "_error_text"); wrap(H, "_synchronize")
    r = h.run(job, lambda s: log.append(("stage " + s, round(1e3 * (time.perf_counter() - T0), 1), 0)))
    log.append(("end", round(1e3 * (time.perf_counter() - T0), 1), 0))
    print(json.dumps({"verdict": r.verdict, "fatal": r.fatal, "reason": r.reason[:200], "log": log}))
    os._exit(0)
if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "one":
        one()
    for i in range(4):
        r = subprocess.run([sys.executable, __file__, "one", str(i * 7)], capture_output=True, text=True)
        print(r.stdout[-3000:] or r.stderr[-2000:])
