"""One compiler process under hard limits: a compile bomb ends as ``timeout`` or ``limit``, never a hang.

:func:`run_limited` runs a compiler in its own process group with a wall-clock limit (the group is killed) and
``RLIMIT_CPU`` / ``RLIMIT_AS`` / ``RLIMIT_FSIZE`` set by a tiny exec wrapper (never ``preexec_fn``, which is
unsafe from threads).  :data:`INTERNAL_ERROR` tells a compiler that crashed from one that refused the source.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["INTERNAL_ERROR", "MAX_LOG", "clip", "run_limited"]

#: the most characters of a compiler's log kept (:func:`clip`)
MAX_LOG = 20_000
#: a compiler that crashed rather than refused the source (g++ 12 on a precompiled header used at another ``-O``
#: level: a segmentation fault in its IPA pass, measured): not the candidate's fault, never cached
INTERNAL_ERROR = re.compile(r"internal compiler error|died due to signal|terminated program|Segmentation fault")
#: the exec wrapper setting the compiler's rlimits (run with ``python -S -E -c``): CPU s, address space and file size
LIMIT_WRAPPER = (
    "import os,resource,sys\n"
    "c,a,f=(int(x) for x in sys.argv[1:4])\n"
    "c and resource.setrlimit(resource.RLIMIT_CPU,(c,c+5))\n"
    "a and resource.setrlimit(resource.RLIMIT_AS,(a,a))\n"
    "f and resource.setrlimit(resource.RLIMIT_FSIZE,(f,f))\n"
    "resource.setrlimit(resource.RLIMIT_CORE,(0,0))\n"
    "os.execvp(sys.argv[4],sys.argv[4:])\n"
)


def clip(text: str, limit: int = MAX_LOG) -> str:
    """``text`` cut to ``limit`` characters (its head and tail kept)."""
    if len(text) <= limit:
        return text
    return text[: limit // 2] + f"\n...[{len(text) - limit} characters cut]...\n" + text[-limit // 2:]



def run_limited(cmd: list[str], cwd: Path, *, timeout_s: float, cpu_s: int, memory_bytes: int,
                file_bytes: int) -> tuple[str, str, float]:
    """Run ``cmd`` in ``cwd`` (its own process group, a minimal environment, output to
    ``cwd/log.txt``) under a wall-clock limit and rlimits.

    Returns:
        ``(kind, log, seconds)``: kind ``"ok"``, ``"compile_error"`` (non-zero exit), ``"timeout"``
        (wall clock: the group was killed) or ``"limit"`` (CPU time, file size or memory); the
        log clipped to :data:`MAX_LOG` characters, with a last line saying which limit.
    """
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(cwd), "TMPDIR": str(cwd),
           "LANG": "C", "LC_ALL": "C"}
    if shutil.which(cmd[0], path=env["PATH"]) is None:
        return "compile_error", (f"compiler not found: {cmd[0]} (the load_inline format needs a CUDA toolkit's nvcc and "
                                 "g++: set CUDA_HOME or put nvcc on PATH)"), 0.0
    log = cwd / "log.txt"
    t0 = time.perf_counter()
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-S", "-E", "-c", LIMIT_WRAPPER, str(cpu_s), str(memory_bytes),
                                 str(file_bytes), *cmd], cwd=cwd, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
        timed_out = False
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            rc = proc.wait()
    try:  # the group may still hold children (cicc, cc1plus) after nvcc died: end them
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if timed_out:  # a verifier that is a child subreaper (dice_ray.verify.sandbox.zygote) inherits the orphans: reap
        reap_until = time.monotonic() + 2.0
        while time.monotonic() < reap_until:
            try:
                if os.waitpid(-proc.pid, os.WNOHANG)[0] == 0:
                    time.sleep(0.02)
            except ChildProcessError:
                break
    seconds = time.perf_counter() - t0
    with open(log, "rb") as f:
        text = clip(f.read(MAX_LOG * 4).decode(errors="replace"))
    if timed_out:
        return "timeout", f"{text}\n[killed: the compiler ran past its {timeout_s:g} s wall-clock limit]", seconds
    if rc == 0:
        return "ok", text, seconds
    sig = -rc if rc < 0 else (rc - 128 if rc > 128 else 0)
    if sig in (signal.SIGXCPU, signal.SIGKILL):
        return "limit", (f"{text}\n[killed by signal {signal.Signals(sig).name}: the compiler's CPU time limit "
                         f"({cpu_s} s) or memory]"), seconds
    if sig == signal.SIGXFSZ:
        return "limit", f"{text}\n[killed: the compiler's file size limit ({file_bytes // 2**20} MiB)]", seconds
    lowered = text.lower()
    if any(w in lowered for w in ("out of memory", "virtual memory exhausted", "cannot allocate memory",
                                  "std::bad_alloc", "memory allocation failure")):
        return "limit", f"{text}\n[the compiler ran out of its memory limit ({memory_bytes / 2**30:g} GiB)]", seconds
    return "compile_error", text, seconds

