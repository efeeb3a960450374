"""Kernel-enforced confinement of the verifier's worker: the files it may touch, the calls it may make.

The static rules (:mod:`dice_ray.verify.rules`) read a candidate's source; below them the operating
system refuses what a worker never needs, whatever the source (``verify.static_rules=false``, or a way
around the rules):

* **Landlock** (kernel docs, Documentation/userspace-api/landlock.rst;
  https://docs.kernel.org/userspace-api/landlock.html), through ``landlockpy``: files are read only below
  the paths of :func:`file_policy` (Python, its packages, system libraries, the CUDA toolkit and driver,
  the inline build cache, ``verify.sandbox_read_paths``) and written only in the worker's private
  folder; character devices only those listed (``/dev/null``..., a GPU worker's ``/dev/nvidia*``); TCP
  bind/connect (ABI 4) and signals to processes outside the worker (ABI 6: the verifier, other workers)
  are refused.  Applied by :meth:`Confinement.restrict_files` first thing in the worker, before torch and
  CUDA start threads: a Landlock domain covers the thread that enforces it and what that thread starts
  later, never threads already running (ABI 8's TSYNC aside), and CUDA's threads run host callbacks.
  The worker's trusted set-up (imports, CUDA context, NVRTC, kernel preload, self-test) runs under it.
* **seccomp** (seccomp(2)), through ``pyseccomp`` (ctypes over the system's libseccomp.so.2): the calls
  of :data:`REFUSED_SYSCALLS` fail with EPERM, ``clone`` without ``CLONE_THREAD`` too (threads still
  start), ``clone3`` with ENOSYS (glibc then falls back to ``clone``).  Applied by
  :meth:`Confinement.restrict_syscalls` once the set-up is done, on every thread of the worker
  (``SECCOMP_FILTER_FLAG_TSYNC``), before the first candidate runs.  Pipes already open (the worker's
  protocol with its parent, :mod:`dice_ray.verify.sandbox.protocol`) keep working: only new sockets are refused.

A refused call fails with an error (EACCES from Landlock, EPERM from seccomp), so the candidate sees an
exception and the job a ``crash``; :meth:`Confinement.refusal` names what was refused, from what a Python
audit hook (PEP 578, :meth:`Confinement.watch`) saw the candidate try, for the verdict's reason.

Where the kernel (or the library) lacks a layer, :attr:`Confinement.status` says so; the worker reports it
in its ``ready`` info and the verifier logs it once (:func:`log_status_once`).
"""

from __future__ import annotations

import collections
import errno
import functools
import glob
import logging
import os
import sys
import sysconfig
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from dice_ray.verify.sandbox.environment import PRIVATE_DIR

__all__ = ["Confinement", "FilePolicy", "REFUSED_SYSCALLS", "file_policy", "give_up_landlock", "load_libraries",
           "log_status_once"]

log = logging.getLogger(__name__)

# -- what the worker may touch: the one place these paths are listed ------------------------------------
#: Read-only below each (files read and run, folders listed), where it exists, besides Python's own folders
#: (:func:`_python_paths`).  A path that is a link is resolved when the rule is made (Landlock rules hold inodes).
SYSTEM_READ: tuple[str, ...] = (
    "/usr",  # system libraries, locales, the CUDA toolkit (/usr/local/cuda), the driver's libraries
             # (/usr/lib/x86_64-linux-gnu, /usr/local/nvidia), ldconfig (ctypes.util.find_library runs it)
    "/lib", "/lib64",  # the loader and libc where they are not links into /usr
    "/etc/ld.so.cache",  # dlopen's index of libraries
    "/etc/localtime",  # the time zone (time.localtime)
    "/sys",  # CPU topology (OpenMP, os.cpu_count), PCI and NUMA facts (the CUDA driver, NVML)
    "/proc/cpuinfo", "/proc/meminfo", "/proc/stat", "/proc/sys",  # CPU and memory facts, kernel settings
    "/proc/driver/nvidia",  # the GPU driver's parameters (libcuda reads them)
    "/run/nvidia-persistenced",  # NVML looks for the persistence daemon's socket
)
#: Read-write besides the private folder: the worker's own /proc entry (resolved to /proc/<pid> when the rule is
#: made, so it covers the worker and its threads, /proc/<pid>/task/<tid>, not other processes).  glibc and the CUDA
#: driver read its maps, status and fds, and cuInit() names its threads by writing /proc/self/task/<tid>/comm: without
#: that it fails with error 304, CUDA_ERROR_OPERATING_SYSTEM (seen on an H200 machine; NVIDIA/OpenShell#710).
OWN_PROC = "/proc/self"
#: Read-write character devices of every worker (ioctl allowed).
DEVICES: tuple[str, ...] = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
#: Read-write GPU devices of a GPU worker (ioctl allowed): /dev/nvidiactl, /dev/nvidia0..., /dev/nvidia-uvm,
#: /dev/nvidia-uvm-tools, /dev/nvidia-modeset, /dev/nvidia-caps/.  CUDA opens most of them when it makes the
#: context (before seccomp, under Landlock); files opened before a restriction keep their access.
GPU_DEVICES = "/dev/nvidia*"
# Not listed, so refused: /dev/shm (shared by every process: a candidate could leave an answer there for a later
# one), /tmp outside the private folder, /etc (passwd, the host's configuration), /proc/<other pid>, $HOME.

#: Calls refused with EPERM once the set-up is done, with what each would give a candidate.
REFUSED_SYSCALLS: dict[str, str] = {
    "socket": "a socket of any family: network, Unix, netlink",
    "socketpair": "a pair of Unix sockets",
    "fork": "a new process", "vfork": "a new process",
    "execve": "running a program", "execveat": "running a program",
    "ptrace": "another process's memory and registers",
    "process_vm_readv": "another process's memory", "process_vm_writev": "another process's memory",
    "pidfd_getfd": "another process's open files",
    "io_uring_setup": "io_uring, whose requests (sockets, files) seccomp cannot see",
    "unshare": "new namespaces", "setns": "another process's namespaces",
    "bpf": "kernel programs", "perf_event_open": "performance counters of other processes",
    "init_module": "kernel modules (root)", "finit_module": "kernel modules (root)",
    "kexec_load": "a new kernel (root)", "reboot": "rebooting (root)",
    "keyctl": "the kernel's key rings", "add_key": "the kernel's key rings",
}
_CLONE_THREAD = 0x00010000

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def _real(path: str) -> str:
    return os.path.realpath(path)


def _below(path: str, roots: Iterable[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


@dataclass(frozen=True)
class FilePolicy:
    """The worker's file access under Landlock (paths resolved, existing when made).

    Attributes:
        read: read-only below each: files read and run, folders listed.
        write: everything below each but running programs: the worker's private folder, its own /proc entry.
        devices: character devices read, written and ioctl'd.
    """

    read: tuple[str, ...]
    write: tuple[str, ...]
    devices: tuple[str, ...] = ()

    def allows(self, path: str, write: bool) -> bool:
        """Whether the policy lets ``path`` (relative to the current folder) be opened for writing
        (``write``) or reading: the check :meth:`Confinement.refusal` uses to say what Landlock refused."""
        p = _real(path)
        return _below(p, self.devices) or _below(p, self.write) or (not write and _below(p, self.read))


def _python_paths() -> list[str]:
    """Where the worker imports from: the interpreter's prefixes, its library folders, and every ``sys.path``
    entry except the current folder, the private folders of workers and the fork server, and the folder
    holding this ``dice_ray`` checkout (only the package itself is read: a project folder may hold anything,
    ``.env`` files too)."""
    package = Path(__file__).resolve().parents[2]  # this dice_ray package
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    paths = set(prefixes) | {v for k, v in sysconfig.get_paths().items() if k in ("stdlib", "platstdlib", "purelib", "platlib")}
    skip = {_real(os.getcwd()), _real(str(package.parent))}
    for entry in sys.path:  # the fork server's folder is its sys.path[0] (python -m), hence a forked worker's
        if entry and _real(entry) not in skip and not PRIVATE_DIR.fullmatch(os.path.basename(entry)):
            paths.add(entry)
    if not _below(str(package), (_real(p) for p in prefixes)):
        paths.add(str(package))
    return sorted(paths)


def file_policy(workdir: str, *, gpu: bool, extra_read: Iterable[str] = ()) -> FilePolicy:
    """The worker's :class:`FilePolicy`: read-only :data:`SYSTEM_READ`, Python's folders, the folders of
    ``LD_LIBRARY_PATH``, ``CUDA_HOME``, ``CUDA_PATH`` and ``extra_read`` (``verify.sandbox_read_paths``, the
    inline build cache); read-write ``workdir`` and :data:`OWN_PROC`; devices :data:`DEVICES` and, when ``gpu``, :data:`GPU_DEVICES`.
    Paths that do not exist are left out (a rule needs an inode)."""
    env = [*os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep), os.environ.get("CUDA_HOME", ""),
           os.environ.get("CUDA_PATH", "")]
    read = [*SYSTEM_READ, *_python_paths(), *env, *extra_read]
    devices = [*DEVICES, *(sorted(glob.glob(GPU_DEVICES)) if gpu else [])]

    def existing(paths: Iterable[str]) -> tuple[str, ...]:
        return tuple(dict.fromkeys(_real(p) for p in paths if p and os.path.exists(p)))

    return FilePolicy(read=existing(read), write=existing([workdir, OWN_PROC]), devices=existing(devices))


# -- the audit hook's events: what a candidate tried -----------------------------------------------------
#: Python audit events (PEP 578) of file operations: (event, index of the path argument, writes?)
_FILE_EVENTS: dict[str, tuple[int, bool | None]] = {
    "open": (0, None),  # None: the flags (argument 2) say
    "os.listdir": (0, False), "os.scandir": (0, False),
    "os.mkdir": (0, True), "os.remove": (0, True), "os.rmdir": (0, True), "os.rename": (1, True),
    "os.link": (1, True), "os.symlink": (1, True), "os.truncate": (0, True),
}
_PROCESS_EVENTS = {"os.fork": "os.fork()", "os.forkpty": "os.forkpty()", "os.exec": "exec of {0!r}",
                   "os.posix_spawn": "posix_spawn of {0!r}", "os.system": "os.system({0!r})",
                   "subprocess.Popen": "subprocess {1!r}", "socket.__new__": "socket({1})"}
_SIGNAL_EVENTS = {"os.kill": "os.kill({0}, {1})", "os.killpg": "os.killpg({0}, {1})"}


def _family(value: Any) -> str:
    import socket

    try:
        return socket.AddressFamily(value).name
    except ValueError:
        return f"family {value}"


class Confinement:
    """The worker's confinement, applied in two steps (see the module docstring).

    Args:
        workdir: the worker's private folder (read-write).
        gpu: a GPU worker (the GPU's device files are allowed).
        landlock: apply Landlock (``verify.landlock``).
        seccomp: apply the seccomp filter (``verify.seccomp``).
        extra_read: more read-only paths (``verify.sandbox_read_paths``, the inline build cache).
        landlock_off: why Landlock is off though configured on (:func:`give_up_landlock`), for :attr:`status`.

    Attributes:
        status: ``{"landlock": ..., "seccomp": ...}``, each a short sentence: what was applied, or why not.
        policy: the :class:`FilePolicy` (None until :meth:`restrict_files`).

    The libraries are imported here (:func:`load_libraries`), before anything is restricted.
    """

    def __init__(self, workdir: str, *, gpu: bool, landlock: bool = True, seccomp: bool = True,
                 extra_read: Iterable[str] = (), landlock_off: str | None = None):
        self.workdir = workdir
        self.gpu = gpu
        self.extra_read = extra_read  # read when the policy is made: not at all with Landlock off
        self.status: dict[str, str] = {}
        self.policy: FilePolicy | None = None
        self._landlock: Any = None
        self._seccomp: Any = None
        self._seen: collections.deque[tuple[str, tuple[Any, ...]]] = collections.deque(maxlen=64)
        self._landlock_on = self._seccomp_on = self._signals_scoped = False
        libs = load_libraries()
        for layer, on, key in (("landlock", landlock, "landlockpy"), ("seccomp", seccomp, "pyseccomp")):
            if layer == "landlock" and landlock_off:
                self.status[layer] = f"not applied: {landlock_off}"
            elif not on:
                self.status[layer] = f"off (verify.{layer}=false)"
            elif isinstance(libs[key], str):
                self.status[layer] = f"not applied: {libs[key]}"
        self._landlock = libs["landlockpy"] if landlock and not isinstance(libs["landlockpy"], str) else None
        self._seccomp = libs["pyseccomp"] if seccomp and not isinstance(libs["pyseccomp"], str) else None

    # -- Landlock ----------------------------------------------------------------------------------------
    def restrict_files(self) -> str:
        """Enforce the file policy (and the TCP and signal scopes) on this thread and every thread and process
        it starts later (irreversible).  Call it before other threads exist.

        Returns:
            ``status["landlock"]``: ``"ABI n: ..."`` when applied, else why not (no Landlock in the kernel:
            Linux < 5.13, or not in the boot's ``lsm=`` list; landlockpy missing; a refused call).
        """
        ll = self._landlock
        if ll is None:
            return self.status["landlock"]
        abi = ll.abi_version()
        if abi < 1:
            self.status["landlock"] = "not applied: this kernel has no Landlock (Linux >= 5.13 with landlock in lsm=)"
            return self.status["landlock"]
        self.policy = file_policy(self.workdir, gpu=self.gpu, extra_read=self.extra_read)
        fs, AccessFS = ll.fs_for_abi(abi), ll.AccessFS
        file_rights = AccessFS.EXECUTE | AccessFS.WRITE_FILE | AccessFS.READ_FILE | AccessFS.TRUNCATE | AccessFS.IOCTL_DEV
        read = AccessFS.READ_FILE | AccessFS.READ_DIR | AccessFS.EXECUTE
        device = AccessFS.READ_FILE | AccessFS.WRITE_FILE | AccessFS.TRUNCATE | AccessFS.IOCTL_DEV
        rules = ([(p, read) for p in self.policy.read] + [(p, fs & ~AccessFS.EXECUTE) for p in self.policy.write]
                 + [(p, device) for p in self.policy.devices])
        try:
            with ll.Ruleset(handled_fs=fs, handled_net=ll.net_for_abi(abi), scoped=ll.scope_for_abi(abi)) as rs:
                for path, rights in rules:
                    if not os.path.isdir(path):
                        rights &= file_rights  # a file's rule takes only file rights (EINVAL otherwise)
                    try:
                        rs.allow_path(path, rights)
                    except OSError:
                        continue  # gone since the policy was made, or not a path Landlock takes: stays refused
                rs.restrict()
        except OSError as e:
            self.status["landlock"] = f"not applied: {type(e).__name__}: {e}"
            return self.status["landlock"]
        self._landlock_on, self._signals_scoped = True, abi >= 6
        refused = [what for what, since in (("TCP", 4), ("signals to other processes", 6)) if abi >= since]
        self.status["landlock"] = (f"ABI {abi}: read-only {len(self.policy.read)} paths, read-write "
                                   f"{', '.join(self.policy.write)}, {len(self.policy.devices)} devices"
                                   + (f"; {' and '.join(refused)} refused" if refused else ""))
        return self.status["landlock"]

    # -- seccomp -----------------------------------------------------------------------------------------
    def restrict_syscalls(self) -> str:
        """Install the seccomp filter on every thread of this process (irreversible): :data:`REFUSED_SYSCALLS`
        and ``clone`` without ``CLONE_THREAD`` fail with EPERM, ``clone3`` with ENOSYS.

        Returns:
            ``status["seccomp"]``: ``"libseccomp: ..."`` when installed, else why not.
        """
        sc = self._seccomp
        if sc is None:
            return self.status["seccomp"]
        try:
            flt = sc.SyscallFilter(sc.ALLOW)
            eperm = sc.ERRNO(errno.EPERM)
            refused = []
            for name in REFUSED_SYSCALLS:
                try:
                    flt.add_rule(eperm, name)
                    refused.append(name)
                except (OSError, ValueError):
                    continue  # not a call of this architecture
            flt.add_rule(eperm, "clone", sc.Arg(0, sc.MASKED_EQ, _CLONE_THREAD, 0))
            flt.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
            flt.set_attr(sc.Attr.CTL_TSYNC, 1)
            flt.load()
        except OSError as e:
            self.status["seccomp"] = f"not applied: {type(e).__name__}: {e}"
            return self.status["seccomp"]
        self._seccomp_on = True
        self.status["seccomp"] = f"libseccomp: {', '.join(refused)} and clone of a process refused"
        return self.status["seccomp"]

    # -- what was refused --------------------------------------------------------------------------------
    def watch(self) -> None:
        """Remember the file, process and socket operations Python code attempts from now on (a Python audit
        hook, PEP 578: it cannot be removed; it only records the last 64)."""
        seen, watched = self._seen, {*_FILE_EVENTS, *_PROCESS_EVENTS, *_SIGNAL_EVENTS}

        def hook(event: str, args: tuple[Any, ...]) -> None:
            if event in watched:
                seen.append((event, args[1:] if event == "socket.__new__" else args))

        sys.addaudithook(hook)

    def forget(self) -> None:
        """Drop what :meth:`watch` recorded (call before each job)."""
        self._seen.clear()

    def refusal(self) -> str | None:
        """``"sandbox: <what> refused (<layer>: <why>)"`` for the last recorded operation that the confinement
        refuses (Landlock: a path outside :attr:`policy`; seccomp: every socket, new process and program), or
        None.  Forgets what was recorded."""
        seen = list(self._seen)
        self._seen.clear()
        for event, args in reversed(seen):
            why = self._describe(event, args)
            if why is not None:
                return f"sandbox: {why}"
        return None

    def _describe(self, event: str, args: tuple[Any, ...]) -> str | None:
        if event in _PROCESS_EVENTS:
            if not self._seccomp_on:
                return None
            if event == "socket.__new__":
                what = f"socket({_family(args[0]) if args else '?'})"
                return f"{what} refused (seccomp: no sockets in the worker)"
            return f"{_PROCESS_EVENTS[event].format(*args, None, None)[:200]} refused (seccomp: no new processes or programs)"
        if not self._landlock_on or self.policy is None:
            return None
        if event in _SIGNAL_EVENTS:
            own = os.getpid() if event == "os.kill" else os.getpgrp()
            if not self._signals_scoped or args[0] in (0, own):
                return None
            return f"{_SIGNAL_EVENTS[event].format(*args)} refused (Landlock: no signals to other processes)"
        at, write = _FILE_EVENTS[event]
        path = args[at] if len(args) > at else None
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        if not isinstance(path, str):
            return None  # a file descriptor: opened earlier
        if write is None:
            flags = args[2] if len(args) > 2 and isinstance(args[2], int) else 0
            write = bool(flags & _WRITE_FLAGS)
        try:
            if self.policy.allows(path, write):
                return None
        except OSError:
            return None
        if write:
            return f"writing {path!r} refused (Landlock: the worker writes only in its private folder)"
        return f"reading {path!r} refused (Landlock: not below the worker's read-only paths)"


@functools.cache
def load_libraries() -> dict[str, Any]:
    """Import ``landlockpy`` and ``pyseccomp`` once: ``{"landlockpy": module or why not, "pyseccomp": ...}`` (a
    str says why not).  pyseccomp finds libseccomp.so.2 by running ``ldconfig -p`` when imported, so this runs
    before anything is restricted; the fork server calls it, so its workers find both loaded."""
    out: dict[str, Any] = {}
    try:
        import landlockpy

        out["landlockpy"] = landlockpy
    except ImportError as e:
        out["landlockpy"] = f"landlockpy is not installed ({e})"
    try:
        import pyseccomp

        out["pyseccomp"] = pyseccomp
    except ImportError as e:
        out["pyseccomp"] = f"pyseccomp is not installed ({e})"
    except (RuntimeError, OSError) as e:  # RuntimeError("Unable to find libseccomp")
        out["pyseccomp"] = f"libseccomp.so.2 not found ({e})"
    return out


#: stages of a worker's start whose failure under Landlock turns it off (:func:`give_up_landlock`): the imports
#: (before the first stage) and the CUDA set-up; a failing self-test is a toolchain or settings fault
_SETUP_STAGES = ("", "setup")


def give_up_landlock(settings: dict[str, Any], stage: str, error: str) -> bool:
    """After a worker's start failed in ``stage`` with ``error``: when it ran under Landlock and failed in its
    imports or CUDA set-up (:data:`_SETUP_STAGES`), the workers started later with ``settings`` (the verifier's
    dict, shared by its workers and sent to the fork server with each) start without Landlock: a driver or a
    machine that needs a path :func:`file_policy` does not give costs one worker's start, not the verifier,
    and says why once in the log and in each later worker's ``confinement`` status.  seccomp still applies.

    Returns:
        Whether Landlock was turned off now.
    """
    if stage not in _SETUP_STAGES or not settings.get("landlock", True):
        return False
    line = error.strip().splitlines()[-1][:300] if error.strip() else "no error text"
    settings["landlock_off"] = (f"a worker's start failed under it (stage {stage or 'imports'!r}: {line}), so the "
                                "workers started after it run without it")
    settings["landlock"] = False
    log_status_once({"landlock": f"not applied: {settings['landlock_off']}"})  # the later workers' status: one line
    return True


_logged: set[str] = set()
_logged_lock = threading.Lock()


def log_status_once(status: dict[str, str] | None) -> None:
    """Log a warning, once per process for each distinct text, when a worker's confinement ``status``
    (:attr:`Confinement.status`, from its ``ready`` info) says a layer was not applied."""
    for layer, text in (status or {}).items():
        if text.startswith("not applied"):
            line = f"verifier worker: {layer} {text}; the other limits still apply"
            with _logged_lock:
                if line in _logged:
                    continue
                _logged.add(line)
            log.warning(line)
