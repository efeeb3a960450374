"""Operating-system limits of the verifier's worker process: rlimits and its environment.

Applied by the worker to itself (:func:`apply_limits`) after torch and CUDA are initialised and before the
first candidate runs; the parent builds the worker's environment with :func:`clean_env` (secrets stripped,
private HOME/TMPDIR).  What the kernel confines (Landlock, seccomp) is :mod:`dice_ray.verify.confine`.

* ``RLIMIT_CORE`` 0, ``RLIMIT_FSIZE`` (largest file), ``RLIMIT_AS`` in compile-only workers
  (not with CUDA: the driver reserves terabytes of virtual address space), ``RLIMIT_CPU`` per job
  (:func:`set_cpu_budget`, a backstop under the parent's wall-clock timeouts).
  ``RLIMIT_NPROC`` is not used: it counts every process of the user and root ignores it (the seccomp
  filter refuses new processes instead).
"""

from __future__ import annotations

import getpass
import os
import re
import shutil
import tempfile
import resource
from pathlib import Path

__all__ = ["apply_limits", "clean_env", "private_dir", "set_cpu_budget", "sweep_private_dirs"]

_PRIVATE = re.compile(r"dice-ray-(?:worker|zygote)-(\d+)-\w+")

#: Environment variables a worker keeps (everything else, tokens and keys included, is dropped).
ENV_KEEP = (
    "PATH", "LANG", "LC_ALL", "LD_LIBRARY_PATH", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "CUDA_HOME",
    "CUDA_PATH", "NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES", "NCCL_NVLS_ENABLE",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS", "VIRTUAL_ENV", "OMP_NUM_THREADS",
)


def _user() -> str:
    """This process's user name (``uid<N>`` where the user database has none)."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return f"uid{os.getuid()}"


def clean_env(workdir: str) -> dict[str, str]:
    """The worker's environment: :data:`ENV_KEEP` from ours, HOME/TMPDIR = ``workdir``, a
    PYTHONPATH that finds this ``dice_ray`` package first, and LOGNAME/USER (``getpass.getuser()``,
    which torch calls when it imports ``torch._dynamo``, reads them before the user database,
    ``/etc/passwd``, which Landlock keeps from the worker)."""
    env = {k: os.environ[k] for k in ENV_KEEP if k in os.environ}
    env["LOGNAME"] = env["USER"] = _user()
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
