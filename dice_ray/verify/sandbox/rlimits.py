"""Operating-system limits the worker sets on itself: rlimits.

Applied by the worker to itself (:func:`apply_limits`) after torch and CUDA are initialised and before the
first candidate runs.  Its environment is :mod:`dice_ray.verify.sandbox.environment`; what the kernel confines
(Landlock, seccomp) is :mod:`dice_ray.verify.sandbox.confine`.

* ``RLIMIT_CORE`` 0, ``RLIMIT_FSIZE`` (largest file), ``RLIMIT_AS`` in compile-only workers
  (not with CUDA: the driver reserves terabytes of virtual address space), ``RLIMIT_CPU`` per job
  (:func:`set_cpu_budget`, a backstop under the parent's wall-clock timeouts).
  ``RLIMIT_NPROC`` is not used: it counts every process of the user and root ignores it (the seccomp
  filter refuses new processes instead).
"""

from __future__ import annotations

import resource

__all__ = ["apply_limits", "set_cpu_budget"]


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

