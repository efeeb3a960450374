"""The worker's environment and private folders: secrets stripped, HOME and TMPDIR its own, swept when orphaned.

The parent builds the worker's environment with :func:`clean_env` (only :data:`ENV_KEEP` of its own, private
HOME/TMPDIR) and its private folder with :func:`private_dir`; :func:`sweep_private_dirs` removes the folders of
verifiers that were killed.  The worker's limits are :mod:`dice_ray.verify.sandbox.rlimits`; what the kernel
confines (Landlock, seccomp) is :mod:`dice_ray.verify.sandbox.confine`.
"""

from __future__ import annotations

import getpass
import os
import re
import shutil
import tempfile
from pathlib import Path

__all__ = ["ENV_KEEP", "PRIVATE_DIR", "clean_env", "private_dir", "sweep_private_dirs"]

#: the name of a :func:`private_dir` folder; group 1 is its owner's process id
PRIVATE_DIR = re.compile(r"dice-ray-(?:worker|zygote)-(\d+)-\w+")

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
    root = str(Path(__file__).resolve().parents[3])  # the folder holding this dice_ray package
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
        m = PRIVATE_DIR.fullmatch(path.name)
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
