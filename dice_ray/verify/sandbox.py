"""Operating-system limits of the verifier's worker process.

Applied by the worker to itself (:func:`apply_limits`, :func:`install_seccomp`) after torch and
CUDA are initialised and before the first candidate runs; the parent builds the worker's
environment with :func:`clean_env` (secrets stripped, private HOME/TMPDIR).

* ``RLIMIT_CORE`` 0, ``RLIMIT_FSIZE`` (largest file), ``RLIMIT_AS`` in compile-only workers
  (not with CUDA: the driver reserves terabytes of virtual address space), ``RLIMIT_CPU`` per job
  (:func:`set_cpu_budget`, a backstop under the parent's wall-clock timeouts).
* A seccomp-BPF filter (x86-64 Linux): ``fork``/``vfork``/``execve``/``execveat``/``ptrace``
  and ``clone`` without ``CLONE_THREAD`` fail with EPERM (threads still work), ``clone3`` with
  ENOSYS (glibc then falls back to ``clone``), and IPv4/IPv6 ``socket`` with EPERM.
  ``RLIMIT_NPROC`` is not used: it counts every process of the user and root ignores it.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import tempfile
import platform
import resource
import struct
import sys
from pathlib import Path

__all__ = ["apply_limits", "clean_env", "install_seccomp", "private_dir", "set_cpu_budget", "sweep_private_dirs"]

_PRIVATE = re.compile(r"dice-ray-(?:worker|zygote)-(\d+)-\w+")

#: Environment variables a worker keeps (everything else, tokens and keys included, is dropped).
ENV_KEEP = (
    "PATH", "LANG", "LC_ALL", "LD_LIBRARY_PATH", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "CUDA_HOME",
    "CUDA_PATH", "NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES", "NCCL_NVLS_ENABLE",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS", "VIRTUAL_ENV", "OMP_NUM_THREADS",
)


def clean_env(workdir: str) -> dict[str, str]:
    """The worker's environment: :data:`ENV_KEEP` from ours, HOME/TMPDIR = ``workdir``, and a
    PYTHONPATH that finds this ``dice_ray`` package first."""
    env = {k: os.environ[k] for k in ENV_KEEP if k in os.environ}
    root = str(Path(__file__).resolve().parents[2])
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env.update(
        HOME=workdir, TMPDIR=workdir, PYTHONPATH=os.pathsep.join([root, *extra]), PYTHONNOUSERSITE="1",
        PYTHONDONTWRITEBYTECODE="1", PYTHONUNBUFFERED="1", PYTHONHASHSEED="0",
    )
    env.setdefault("OMP_NUM_THREADS", "2")
    return env


def private_dir(kind: str) -> str:
    """A new private folder ``dice-ray-<kind>-<pid>-*`` in the temporary folder for a worker or the
    fork server (``kind``: ``"worker"`` or ``"zygote"``), tagged with this process's id so that
    :func:`sweep_private_dirs` can remove it once this process is gone."""
    return tempfile.mkdtemp(prefix=f"dice-ray-{kind}-{os.getpid()}-")


def sweep_private_dirs() -> int:
    """Remove the :func:`private_dir` folders whose owning process is dead (a verifier killed with
    SIGKILL, as Ray kills an actor, cannot remove its own); returns how many were removed.  Folders
    of live processes, and of processes this user cannot signal, are left alone."""
    removed = 0
    root = Path(tempfile.gettempdir())
    for path in root.glob("dice-ray-*-*-*"):
        m = _PRIVATE.fullmatch(path.name)
        if m is None or not path.is_dir():
            continue
        try:
            os.kill(int(m.group(1)), 0)
            continue  # the owner is alive
        except ProcessLookupError:
            pass
        except (PermissionError, OverflowError):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed += not path.exists()
    return removed


def _set(limit: int, soft: int, hard: int | None = None) -> None:
    cur_soft, cur_hard = resource.getrlimit(limit)
    hard = cur_hard if hard is None else hard
    if cur_hard != resource.RLIM_INFINITY:
        soft = min(soft, cur_hard) if soft != resource.RLIM_INFINITY else cur_hard
        hard = min(hard, cur_hard) if hard != resource.RLIM_INFINITY else cur_hard
    resource.setrlimit(limit, (soft, hard))


def apply_limits(*, file_size_mib: float, address_space_gib: float | None) -> list[str]:
    """Set RLIMIT_CORE=0, RLIMIT_FSIZE and (when given and > 0) RLIMIT_AS on this process.

    Returns:
        The limits applied, as ``"NAME=value"`` strings (reported in the worker's hello).
    """
    done = []
    _set(resource.RLIMIT_CORE, 0, 0)
    done.append("core=0")
    fsize = int(file_size_mib * 2**20)
    _set(resource.RLIMIT_FSIZE, fsize, fsize)
    done.append(f"fsize={file_size_mib:g}MiB")
    if address_space_gib:
        cap = int(address_space_gib * 2**30)
        _set(resource.RLIMIT_AS, cap, cap)
        done.append(f"as={address_space_gib:g}GiB")
    return done


def set_cpu_budget(seconds: float) -> None:
    """Allow this process ``seconds`` more CPU time (soft RLIMIT_CPU; SIGXCPU ends it past that)."""
    used = resource.getrusage(resource.RUSAGE_SELF)
    total = used.ru_utime + used.ru_stime
    _set(resource.RLIMIT_CPU, int(total + seconds) + 1)


# --- seccomp ------------------------------------------------------------------------------------
_LD_W_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
_ALLOW, _ERRNO = 0x7FFF0000, 0x00050000
_EPERM, _ENOSYS = 1, 38
_AUDIT_ARCH_X86_64 = 0xC000003E
_CLONE_THREAD = 0x00010000
_NR = {"clone": 56, "fork": 57, "vfork": 58, "execve": 59, "execveat": 322, "clone3": 435, "ptrace": 101,
       "socket": 41}


def _program() -> bytes:
    """The BPF program (see the module docstring), assembled with symbolic jump targets."""
    prog: list[tuple[int, str | int, str | int, int]] = [
        (_LD_W_ABS, 0, 0, 4),  # arch
        (_JEQ, 0, "allow", _AUDIT_ARCH_X86_64),
        (_LD_W_ABS, 0, 0, 0),  # syscall number
        (_JGE, "eperm", 0, 0x40000000),  # x32 ABI
        (_JEQ, "enosys", 0, _NR["clone3"]),
        (_JEQ, "eperm", 0, _NR["fork"]),
        (_JEQ, "eperm", 0, _NR["vfork"]),
        (_JEQ, "eperm", 0, _NR["execve"]),
        (_JEQ, "eperm", 0, _NR["execveat"]),
        (_JEQ, "eperm", 0, _NR["ptrace"]),
        (_JEQ, "socket", 0, _NR["socket"]),
        (_JEQ, 0, "allow", _NR["clone"]),
        (_LD_W_ABS, 0, 0, 16),  # clone flags (args[0], low word)
        (_JSET, "allow", "eperm", _CLONE_THREAD),
        ("socket", 0, 0, 0),
        (_LD_W_ABS, 0, 0, 16),  # socket domain
        (_JEQ, "eperm", 0, 2),  # AF_INET
        (_JEQ, "eperm", 0, 10),  # AF_INET6
        ("allow", 0, 0, 0),
        (_RET, 0, 0, _ALLOW),
        ("eperm", 0, 0, 0),
        (_RET, 0, 0, _ERRNO | _EPERM),
        ("enosys", 0, 0, 0),
        (_RET, 0, 0, _ERRNO | _ENOSYS),
    ]
    labels, code = {}, []
    for ins in prog:
        if isinstance(ins[0], str):
            labels[ins[0]] = len(code)
        else:
            code.append(ins)
    out = b""
    for pc, (op, jt, jf, k) in enumerate(code):
        jt = labels[jt] - pc - 1 if isinstance(jt, str) else jt
        jf = labels[jf] - pc - 1 if isinstance(jf, str) else jf
        out += struct.pack("HBBI", op, jt, jf, k)
    return out


def install_seccomp() -> str:
    """Install the filter on every thread of this process (irreversible).

    Returns:
        ``"seccomp"`` when installed, else a short reason it was not (not x86-64 Linux, refused).
    """
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return f"seccomp not installed: {sys.platform}/{platform.machine()}"
    libc = ctypes.CDLL(None, use_errno=True)
    code = _program()
    buf = ctypes.create_string_buffer(code, len(code))

    class _Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = _Fprog(len(code) // 8, ctypes.addressof(buf))
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        return f"seccomp not installed: no_new_privs errno {ctypes.get_errno()}"
    libc.syscall.restype = ctypes.c_long
    # seccomp(SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC, &prog)
    if libc.syscall(ctypes.c_long(317), ctypes.c_uint(1), ctypes.c_uint(1), ctypes.byref(fprog)) == 0:
        return "seccomp"
    if libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) == 0:  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER (this thread)
        return "seccomp(thread)"
    return f"seccomp not installed: errno {ctypes.get_errno()}"
