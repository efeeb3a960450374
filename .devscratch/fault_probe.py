"""How long a GPU fault, a new CUDA context, and a context teardown stall another process's kernels."""
import json, os, subprocess, sys, time

def victim(path, seconds):
    import torch
    a = torch.ones(16 << 20, device="cuda")
    for _ in range(20):
        a.mul_(1.0)
    torch.cuda.synchronize()
    ts = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.monotonic()
        a.mul_(1.0)
        torch.cuda.synchronize()
        ts.append((t0, time.monotonic()))
    json.dump(ts, open(path, "w"))

FAULT_SRC = r'''
extern "C" __global__ void k(int mode, unsigned long long wild) {
  if (mode == 0) { *(volatile int*)0 = 1; }
  else if (mode == 1) { if (blockIdx.x == 0 && threadIdx.x == 0) *(volatile int*)0 = 1; }
  else if (mode == 2) { *(volatile int*)wild = 1; }
  else if (mode == 3) { if (threadIdx.x == 0 && blockIdx.x == 0) __trap(); }
  else if (mode == 4) { volatile int x = *(volatile int*)wild; if (x == 12345) *(int*)8 = x; }
}
'''

def fault(mode, blocks, threads):
    import torch, cupy
    torch.cuda.init(); x = torch.ones(4, device="cuda"); torch.cuda.synchronize()
    kern = cupy.RawKernel(FAULT_SRC, "k")
    t0 = time.monotonic()
    kern((blocks,), (threads,), (cupy.int32(mode), cupy.uint64(0x7f0000000000)))
    try:
        cupy.cuda.runtime.deviceSynchronize()
        err = "none"
    except Exception as e:
        err = str(e)[:80]
    t1 = time.monotonic()
    print(json.dumps({"launch": t0, "reported": t1, "report_ms": (t1 - t0) * 1e3, "err": err}), flush=True)
    os._exit(0)

def ctx():
    t0 = time.monotonic()
    import torch
    t1 = time.monotonic()
    torch.cuda.init(); x = torch.ones(1 << 20, device="cuda"); y = (x * 2).sum(); torch.cuda.synchronize()
    t2 = time.monotonic()
    z = torch.softmax(torch.randn(256, 256, device="cuda"), -1) @ torch.randn(256, 256, device="cuda"); torch.cuda.synchronize()
    t3 = time.monotonic()
    print(json.dumps({"import": t1, "ctx_start": t1, "ctx_done": t2, "lazy_done": t3, "ctx_ms": (t2 - t1) * 1e3, "lazy_ms": (t3 - t2) * 1e3}), flush=True)
    os._exit(0)

def stall(ts, a, b):
    """Longest victim iteration (ms) overlapping [a, b], and the median iteration overall."""
    inside = [(e - s) * 1e3 for s, e in ts if e >= a and s <= b]
    return max(inside) if inside else 0.0

def main():
    out = sys.argv[2] if len(sys.argv) > 2 else "."
    vpath = os.path.join(out, "victim.json")
    events = []
    for with_victim in (False, True):
        v = subprocess.Popen([sys.executable, __file__, "victim", vpath, "75"]) if with_victim else None
        time.sleep(8 if with_victim else 0)
        cases = [(0, 1, 1), (0, 1056, 256), (3, 1, 1), (4, 1, 1)] if not with_victim else [(0, 1, 1), (0, 1056, 256), (3, 1, 1), (3, 1056, 256), (4, 1, 1), (4, 1056, 256)]
        for mode, b, t in cases:
            r = subprocess.run([sys.executable, __file__, "fault", str(mode), str(b), str(t)], capture_output=True, text=True)
            line = [l for l in r.stdout.splitlines() if l.startswith("{")]
            ev = json.loads(line[-1]) if line else {"err": r.stderr[-300:]}
            ev.update(kind="fault", mode=mode, blocks=b, threads=t, victim=with_victim, exited=time.monotonic())
            events.append(ev); time.sleep(1.0)
        if with_victim:
            for i in range(3):
                r = subprocess.run([sys.executable, __file__, "ctx"], capture_output=True, text=True)
                line = [l for l in r.stdout.splitlines() if l.startswith("{")]
                ev = json.loads(line[-1]) if line else {"err": r.stderr[-300:]}
                ev.update(kind="ctx", exited=time.monotonic()); events.append(ev); time.sleep(1.0)
            v.wait()
    ts = json.load(open(vpath))
    med = sorted((e - s) * 1e3 for s, e in ts)[len(ts) // 2]
    print(f"victim median iteration {med:.3f} ms over {len(ts)}")
    for ev in events:
        if ev["kind"] == "fault":
            s = stall(ts, ev["launch"], ev["reported"]) if ev.get("victim") and "launch" in ev else None
            t = stall(ts, ev["reported"], ev["exited"]) if ev.get("victim") and "launch" in ev else None
            print(f"fault mode={ev['mode']} grid={ev['blocks']}x{ev['threads']} victim={ev['victim']}: report {ev.get('report_ms', -1):.1f} ms "
                  f"({ev.get('err')}); victim longest iteration during fault {s} ms, during teardown {t} ms")
        else:
            s = stall(ts, ev["ctx_start"], ev["ctx_done"]) if "ctx_start" in ev else None
            l = stall(ts, ev["ctx_done"], ev["lazy_done"]) if "ctx_start" in ev else None
            print(f"ctx: create {ev.get('ctx_ms', -1):.1f} ms, lazy {ev.get('lazy_ms', -1):.1f} ms; victim longest during create {s} ms, during lazy {l} ms")

if __name__ == "__main__":
    if sys.argv[1] == "victim": victim(sys.argv[2], float(sys.argv[3]))
    elif sys.argv[1] == "fault": fault(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
    elif sys.argv[1] == "ctx": ctx()
    else: main()
