"""The sandboxed worker process: ``python -m dice_ray.verify.sandbox.worker FD_IN FD_OUT SETTINGS_JSON``.

Started by :class:`dice_ray.verify.sandbox.runner.WorkerProcess` with a stripped environment and a private
temporary folder as cwd.  It confines its file access with Landlock before anything else (before torch and
CUDA start threads: :mod:`dice_ray.verify.sandbox.confine`), imports torch, initialises CUDA (GPU mode), verifies a
known-good candidate, applies its limits (:mod:`dice_ray.verify.sandbox.rlimits`) and the seccomp filter (on every
thread, once nothing trusted is left to set up), says ``ready``, then serves jobs one at a time until told to
exit (at each stage of a job it waits for the parent's go: see ``runner.GpuGate``), the pipe closes, or a job leaves the CUDA context broken (then it waits to be ended and the
parent starts a new one).  stdout/stderr go to a log file in the temporary folder, never to the protocol
pipe, so a candidate that prints cannot forge messages.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback
from typing import Any


def main(argv: list[str]) -> int:
    """Serve jobs (see the module docstring); ``argv``: the request-read and result-write pipe descriptors and the
    settings as JSON.  Returns the exit status (2: the start failed; 0: the parent went away)."""
    started = time.monotonic()
    fd_in, fd_out, settings = int(argv[0]), int(argv[1]), json.loads(argv[2])
    from dice_ray.verify.sandbox.protocol import FrameReader, ProtocolError, write_frame

    mode, device = settings["mode"], settings.get("device")
    reader = FrameReader(fd_in)

    waited = [0.0]  # seconds stage() waited for the parent's go: at the boot's end, its wait for the GPU gate

    def stage(name: str, **extra: Any) -> dict[str, Any]:
        """Announce a stage (with ``extra`` fields: the reference facts a job measured) and wait for the
        parent's go (it may first take the GPU gate); returns the go message (the reference stage's
        carries the reference facts when the parent knows them)."""
        asked = time.monotonic()
        write_frame(fd_out, {"type": "stage", "stage": name, **extra})
        while True:
            try:
                reply = reader.read(None)
            except ProtocolError:
                os._exit(0)  # the parent is gone
            if reply is not None and reply.get("op") == "go":
                waited[0] += time.monotonic() - asked
                return reply
            if reply is None or reply.get("op") == "exit":
                os._exit(0)

    try:
        from dice_ray.verify.sandbox.confine import Confinement

        # Landlock first: it covers this thread and the threads and processes started after it, and torch and
        # CUDA start threads (a CUDA host callback runs candidate code on one); seccomp waits for the set-up
        box = Confinement(os.getcwd(), gpu=mode == "gpu", landlock=settings.get("landlock", True),
                          seccomp=settings.get("seccomp", True), extra_read=settings.get("sandbox_read_paths", ()),
                          landlock_off=settings.get("landlock_off"))
        box.restrict_files()
        import torch

        from dice_ray import launch
        from dice_ray.verify.sandbox import rlimits
        from dice_ray.verify.trials.harness import Harness

        phases = {"imports": time.monotonic() - started}
        preload = None
        if mode == "gpu":
            # the GPU gate, shared, from here to the self-test: making a context and loading kernels beside
            # another worker's timing stage moved its speedups by up to 40 % (one H200, stop 22); each part
            # below announces "setup" again, so a waiting timing stage goes first between parts
            stage("setup")
            torch.cuda.set_device(device)
            torch.cuda.init()
            torch.cuda.set_per_process_memory_fraction(settings["gpu_memory_fraction"], device)
            launch.configure(compile_only=False)
            launch._context(device)  # retain torch's primary context, current on this thread
        else:
            launch.configure(compile_only=True, arch=settings["arch"])
        phases["cuda_init"] = time.monotonic() - started
        if mode == "gpu" and settings.get("preload_kernels", True):  # loads kernels, runs none
            from dice_ray.verify.sandbox.kernel_preload import preload_kernels

            stage("setup")
            preload = preload_kernels(device, between=lambda: stage("setup"))
            phases["preload"] = time.monotonic() - started
            stage("setup")
        harness = Harness(mode, device, settings)
        # warms NVRTC, torch's dispatch paths, CUDA kernels (gated stages); a forked replacement skips the
        # timing stage (the verifier's cold workers checked that path; it would hold the GPU alone ~70 ms)
        selftest = harness.self_test(stage, timing=not settings.get("forked", False))
        phases["self_test"] = time.monotonic() - started
        phases["gate_wait"] = waited[0]  # of the phases' time, waiting for the GPU gate (not cumulative)
        if not selftest.startswith("ok"):  # a worker that fails a known-good candidate would fail them all
            write_frame(fd_out, {"type": "failed", "error": f"self-test: the built-in relu candidate got {selftest} "
                                 f"(the toolchain or the settings are broken: verify.arch={settings.get('arch')!r}, "
                                 f"mode {mode})"})
            return 2
        stage("limits")  # the GPU gate goes back: nothing below runs on the GPU
        gc.collect()  # the self-test's garbage (it may hold GPU memory), then everything into the permanent
        gc.freeze()  # generation: a full collection (every 50 jobs, under the gate) took 127 ms with torch, now ~0
        limits = rlimits.apply_limits(
            file_size_mib=settings["file_size_mib"],
            address_space_gib=settings["cpu_address_space_gib"] if mode == "compile_only" else None,
        )
        box.restrict_syscalls()  # sockets, processes, exec: nothing trusted needs them any more
        box.watch()  # what a candidate tries, for the verdict's reason
    except Exception:  # noqa: BLE001
        write_frame(fd_out, {"type": "failed", "error": traceback.format_exc()[-4000:]})
        return 2
    info = {"pid": os.getpid(), "mode": mode, "device": device, "limits": limits, "confinement": box.status,
            "torch": torch.__version__, "self_test": selftest, "boot_phases_s": {k: round(v, 3) for k, v in phases.items()},
            "gc_frozen": gc.get_freeze_count(), "preload": preload}
    if mode == "gpu":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["arch"] = launch.target_arch()
    write_frame(fd_out, {"type": "ready", "info": info})
    while True:
        try:
            msg = reader.read(None)
        except ProtocolError:
            return 0
        if msg is None or msg.get("op") == "exit":
            sys.stdout.flush()
            os._exit(0)  # skip interpreter teardown (seconds with torch loaded)
        if msg.get("op") != "job":
            continue
        rlimits.set_cpu_budget(msg.get("cpu_budget_s", 600.0))
        sys.stdout.flush()
        sys.stderr.flush()
        os.ftruncate(1, 0)  # the log (stdout and stderr) holds this job's output only
        os.lseek(1, 0, os.SEEK_SET)

        box.forget()
        try:
            result = harness.run(msg, stage).to_dict()
            if result["verdict"] in ("crash", "invalid_input"):
                refused = box.refusal()  # "sandbox: reading '/etc/passwd' refused (Landlock: ...)"
                if refused:
                    result["reason"] = f"{refused}; {result['reason']}"
        except Exception:  # noqa: BLE001 - harness.run catches candidate errors; this is the worker's own
            result = {"verdict": "crash", "compiled": True, "fatal": True,
                      "reason": f"verifier worker error: {traceback.format_exc()[-1500:]}"}
        if result.get("fatal") and mode == "gpu":
            try:  # what this process holds until it exits (host-side counters: no CUDA call)
                result["gpu_reserved_mib"] = round(torch.cuda.memory_reserved(device) / 2**20, 1)
            except Exception:  # noqa: BLE001
                pass
        result["type"] = "result"
        write_frame(fd_out, result)
        if result.get("fatal"):
            # a broken CUDA context cannot be trusted: the parent starts a new worker and stops this one
            # (SIGSTOP); it ends it when told (the parent's exit, or its pipe closing) or kills it, in the
            # verifier's idle time when it can (runner.WorkerProcess.suspend)
            sys.stdout.flush()
            while True:
                try:
                    msg = reader.read(None)
                except ProtocolError:
                    break
                if msg is None or msg.get("op") == "exit":
                    break
            os._exit(3)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
