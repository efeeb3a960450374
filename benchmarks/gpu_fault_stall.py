"""What one crashing candidate costs everyone on its GPU: the floor under verifier throughput with crashes.

Victim processes (``--victims``, default 1) each loop a ~50 us kernel with a synchronize after each
(as a timing worker's windows do). Other processes, one after another, launch a kernel that stores
through a null pointer (one thread, or every thread of a full grid), reads a wild address, or calls ``__trap()``, and wait for
the error; then processes that start a CUDA context and run their first ops (what a replacement
sandbox worker does after a crash), and processes that load the verifier's kernels by a CUDA graph
capture (``dice_ray.verify.sandbox.kernel_preload``, part of a starting worker's set-up, which holds the GPU
gate shared since the speedups timed beside one were seen to move). For each it prints how long the process waited for its error
(or its set-up) and the victim's longest iteration meanwhile, against the victim's median.

Measured on one H200 (2026-12-01): an illegal address took 147-156 ms to report and stalled the
victims 144-153 ms, whatever the grid and with 1 or 5 victims; ``__trap()`` took 1.3-1.5 s to
report but stalled the victims 13-57 ms; a new context took 296-320 ms and its first ops 219-251 ms
(lazy kernel loading), the victims' longest iteration 1.5-2.4 ms; a kernel preload took 343-362 ms,
the victims' longest iteration 0.66-1.85 ms. So every faulting candidate costs about 150 ms of the
whole GPU's time, whatever the verifier does; at 7 % crashing candidates that alone is 4 s of a
392-candidate batch (``verifier_throughput.py``). Nor does the stall grow with the victims' kernels
or the faulting process's memory (2026-12-01, 3 victims): 146-185 ms with victims multiplying 2 GiB
(``--victim-mib 2048``, 3.5 ms iterations), 108-146 ms with 8 GiB held by the faulting process
(``--fault-mib 8192``). Three victims sharing the GPU took 0.52 ms an iteration for a ~50 us kernel
and its synchronize: processes take turns on the GPU in time slices.

    python benchmarks/gpu_fault_stall.py [--device 0] [--victims 1] [--victim-mib 64] [--fault-mib 1]
        [--contexts 2] [--json OUT]

Without a GPU it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

FAULT_SOURCE = r"""
extern "C" __global__ void fault(int mode, unsigned long long wild) {
    bool first = blockIdx.x == 0 && threadIdx.x == 0;
    if (mode == 0) { *(volatile int*)0 = 1; }                                   // every thread: null store
    else if (mode == 1 && first) { __trap(); }
    else if (mode == 2 && first) { if (*(volatile int*)wild == 12345) *(volatile int*)8 = 1; }  // wild read
}
"""
WILD = 0x7F0000000000
#: (label, mode of FAULT_SOURCE, blocks (0: SMs x 8), threads a block)
CASES = (("null store, 1 thread", 0, 1, 1), ("null store, full grid", 0, 0, 256),
         ("wild read, 1 thread", 2, 1, 1), ("__trap(), 1 thread", 1, 1, 1))


def longest_iteration_ms(starts: np.ndarray, ends: np.ndarray, a: float, b: float) -> float | None:
    """Longest victim iteration (ms) that overlaps ``[a, b]`` (monotonic seconds); None when none does.

    Args:
        starts, ends: ``[n]`` float64, monotonic seconds each iteration started and ended.
    """
    hit = (ends >= a) & (starts <= b)
    return float(((ends - starts)[hit]).max() * 1e3) if hit.any() else None


def _victim(path: str, stop: str, device: int, mib: int, alloc: int) -> None:
    import torch

    torch.cuda.set_device(device)
    x = torch.ones(mib << 18, device="cuda")  # 64 MiB: ~50 us a multiply on an H100/H200
    for _ in range(20):
        x.mul_(1.0)
    torch.cuda.synchronize()
    Path(path + ".ready").touch()
    starts, ends = [], []
    while not os.path.exists(stop):
        t0 = time.monotonic()
        if alloc:  # as a sandbox worker between jobs: its memory from the driver (cudaMalloc) and back (cudaFree)
            x = x * 1.0
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        else:
            x.mul_(1.0)
        torch.cuda.synchronize()
        starts.append(t0)
        ends.append(time.monotonic())
    np.save(path, np.array([starts, ends]))


def _fault(mode: int, blocks: int, threads: int, device: int, mib: int) -> None:
    import torch

    from dice_ray.launch import load_cuda

    torch.cuda.set_device(device)
    held = torch.ones(max(mib, 1) << 18, device="cuda")  # memory the faulting context holds
    held.add_(1)
    torch.cuda.synchronize()
    kernels = load_cuda(FAULT_SOURCE)
    blocks = blocks or torch.cuda.get_device_properties(device).multi_processor_count * 8
    t0 = time.monotonic()
    try:
        kernels.fault(grid=blocks, block=threads, args=(mode, WILD))
        torch.cuda.synchronize()
        error = "none"
    except Exception as e:  # noqa: BLE001 - the error is what is measured
        error = f"{type(e).__name__}: {str(e).splitlines()[0][:90]}"
    print(json.dumps({"from": t0, "to": time.monotonic(), "error": error, "blocks": blocks}), flush=True)
    os._exit(0)  # a broken context: no teardown


def _context(device: int) -> None:
    import torch

    t0 = time.monotonic()
    torch.cuda.set_device(device)
    torch.ones(1 << 20, device="cuda").mul_(2).sum().item()
    t1 = time.monotonic()
    a = torch.randn(256, 256, device="cuda")
    (torch.softmax(a, -1) @ a).double().isfinite().all().item()
    print(json.dumps({"from": t0, "set_up": t1, "to": time.monotonic()}), flush=True)
    os._exit(0)


def _preload(device: int) -> None:
    import torch

    from dice_ray.verify.sandbox.kernel_preload import preload_kernels

    torch.cuda.set_device(device)
    torch.ones(1, device="cuda").add_(1)
    torch.cuda.synchronize()
    time.sleep(0.2)  # the context's own set-up is over: only the preload is in the window
    t0 = time.monotonic()
    got = preload_kernels(device)
    print(json.dumps({"from": t0, "to": time.monotonic(), "error": got.get("error", "none"), "preload": got}), flush=True)
    os._exit(0)


def _child(*args: str) -> dict:
    """Run this file as a child process ``args``; its last JSON line, with ``exited``: when the process had
    exited (monotonic s; a faulted one's CUDA context is torn down at its exit)."""
    r = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, timeout=300)
    exited = time.monotonic()
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        raise RuntimeError(f"{args[0]} child failed (exit {r.returncode}): {r.stderr[-800:]}")
    return {**json.loads(lines[-1]), "exited": exited}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--device", type=int, default=0, help="CUDA ordinal every process uses")
    ap.add_argument("--contexts", type=int, default=2, help="new-context children to time (and as many kernel preloads)")
    ap.add_argument("--victims", type=int, default=1,
                    help="victim processes looping at once (a verifier runs several sandbox workers on its GPU)")
    ap.add_argument("--victim-mib", type=int, default=64,
                    help="tensor each victim multiplies in place (MiB): 64 is ~50 us a kernel, 2048 ~1.5 ms")
    ap.add_argument("--victim-alloc", action="store_true",
                    help="each victim iteration also takes its memory from the driver and gives it back (cudaMalloc/"
                         "cudaFree through torch's allocator, as a sandbox worker does around each job)")
    ap.add_argument("--fault-mib", type=int, default=1,
                    help="GPU memory the faulting process holds when it faults (MiB; a sandbox worker holds GBs)")
    ap.add_argument("--json", help="write the figures here (without a GPU: why they are missing)")
    args = ap.parse_args()
    bad = [f"{flag} must be >= {least}, got {value}" for flag, value, least in
           (("--victims", args.victims, 1), ("--victim-mib", args.victim_mib, 1), ("--fault-mib", args.fault_mib, 1),
            ("--contexts", args.contexts, 0), ("--device", args.device, 0)) if value < least]
    if bad:
        ap.error("; ".join(bad))
    import torch

    if not torch.cuda.is_available():
        print("gpu_fault_stall: skipped (no GPU: nothing can fault)")
        if args.json:
            Path(args.json).write_text(json.dumps({"skipped": "no GPU"}))
        return
    with tempfile.TemporaryDirectory() as d:
        stop = os.path.join(d, "stop")
        paths = [os.path.join(d, f"victim{i}.npy") for i in range(args.victims)]
        victims = [subprocess.Popen([sys.executable, __file__, "victim", p, stop, str(args.device),
                                     str(args.victim_mib), str(int(args.victim_alloc))]) for p in paths]
        deadline = time.monotonic() + 120
        while not all(os.path.exists(p + ".ready") for p in paths):
            if any(v.poll() is not None for v in victims) or time.monotonic() > deadline:
                raise RuntimeError("a victim process did not start")
            time.sleep(0.05)
        rows = []
        for label, mode, blocks, threads in CASES:
            rows.append({"case": label, **_child("fault", str(mode), str(blocks), str(threads), str(args.device),
                                                      str(args.fault_mib))})
            time.sleep(0.5)
        for i in range(args.contexts):
            rows.append({"case": f"new context {i + 1}", **_child("context", str(args.device))})
            time.sleep(0.5)
        for i in range(args.contexts):
            rows.append({"case": f"kernel preload {i + 1}", **_child("preload", str(args.device))})
            time.sleep(0.5)
        Path(stop).touch()
        for v in victims:
            v.wait(timeout=60)
        loops = [np.load(p) for p in paths]
    median = float(np.median(np.concatenate([e - s for s, e in loops])) * 1e3)
    print(f"{args.victims} victim(s): {sum(len(s) for s, _ in loops)} iterations, median {median:.3f} ms (kernel + synchronize)")
    for row in rows:
        each = [longest_iteration_ms(s, e, row["from"], row["to"]) for s, e in loops]
        row["victim_longest_ms"] = longest = max((x for x in each if x is not None), default=None)
        victim = f"victim's longest iteration {longest:.2f} ms" if longest is not None else "the victim ran nothing then"
        row["wait_ms"] = (row.get("set_up", row["to"]) - row["from"]) * 1e3
        if "set_up" in row:
            row["first_ops_ms"] = (row["to"] - row["set_up"]) * 1e3
            print(f"  {row['case']:24s} set-up {row['wait_ms']:7.1f} ms, first ops {row['first_ops_ms']:6.1f} ms; {victim}")
        elif "preload" in row:
            print(f"  {row['case']:24s} capture {row['wait_ms']:7.1f} ms ({row['preload']}); {victim}")
        else:
            # iterations begun after the error (the one the fault stalled is counted above)
            after = [(s[s >= row["to"]], e[s >= row["to"]]) for s, e in loops]
            gone = [longest_iteration_ms(s, e, row["to"], row["exited"]) for s, e in after]
            row["exit_ms"] = (row["exited"] - row["to"]) * 1e3
            row["exit_victim_longest_ms"] = max((x for x in gone if x is not None), default=None)
            print(f"  {row['case']:24s} error after {row['wait_ms']:7.1f} ms ({row['error']}); {victim}; its exit "
                  f"{row['exit_ms']:.1f} ms, the victim's longest iteration meanwhile {row['exit_victim_longest_ms']} ms")
    stalls = [r["victim_longest_ms"] for r in rows if "illegal" in r.get("error", "") and r["victim_longest_ms"]]
    if stalls:
        print(f"every illegal-address fault stalled the other processes {min(stalls):.0f}-{max(stalls):.0f} ms: "
              "the GPU time one such crashing candidate costs the whole verifier")
    if args.json:
        Path(args.json).write_text(json.dumps({"victims": args.victims, "victim_median_ms": median, "rows": rows}, indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "victim":
        _victim(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]))
    elif len(sys.argv) > 1 and sys.argv[1] == "fault":
        _fault(*(int(a) for a in sys.argv[2:7]))
    elif len(sys.argv) > 1 and sys.argv[1] == "context":
        _context(int(sys.argv[2]))
    elif len(sys.argv) > 1 and sys.argv[1] == "preload":
        _preload(int(sys.argv[2]))
    else:
        main()
