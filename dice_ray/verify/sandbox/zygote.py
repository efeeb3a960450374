"""A fork server for sandbox workers: torch and the harness imported once, each worker forked from it.

A cold worker spends most of its ~8 s start importing torch; a worker forked from this process
(``python -m dice_ray.verify.sandbox.zygote SOCKET_FD``, started with the workers' clean environment)
starts with those imports done and only initialises CUDA, so a crash costs about a second (the
idea of Android's zygote and Python's ``multiprocessing`` forkserver).  The zygote never touches
CUDA, so forking it is safe.

Protocol on a Unix socket: the verifier sends one JSON request ``{"workdir", "settings"}`` with two
file descriptors (the worker's request-read and result-write pipe ends); the zygote forks a child
that forks the worker, passes its pid up and exits; the zygote reaps that child and answers
``{"pid": worker_pid}``.  The
double fork makes the worker an orphan, which Linux re-parents to the verifier process (it sets
``PR_SET_CHILD_SUBREAPER``), so the verifier can ``waitpid`` it and read how it died.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from typing import Any

__all__ = ["Zygote", "ZygoteError"]

_PR_SET_CHILD_SUBREAPER = 36


class ZygoteError(RuntimeError):
    """The fork server could not start or did not answer (callers fall back to a cold start)."""


class Zygote:
    """Client side: starts the fork server and asks it for workers (thread-safe).

    Raises:
        ZygoteError: the platform cannot do this (no ``prctl`` subreaper or ``send_fds``).
    """

    def __init__(self) -> None:
        from dice_ray.verify.sandbox.environment import clean_env, private_dir

        if not sys.platform.startswith("linux") or not hasattr(socket, "send_fds"):
            raise ZygoteError("the fork server needs Linux and socket.send_fds")
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            raise ZygoteError(f"prctl(PR_SET_CHILD_SUBREAPER) failed: errno {ctypes.get_errno()}")
        self.workdir = private_dir("zygote")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with open(os.path.join(self.workdir, "zygote.log"), "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "dice_ray.verify.sandbox.zygote", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                cwd=self.workdir, env=clean_env(self.workdir), start_new_session=True,
            )
        theirs.close()
        self.sock = ours
        self.lock = threading.Lock()

    def spawn(self, workdir: str, settings: dict[str, Any], fds: tuple[int, int], timeout_s: float = 60.0) -> int:
        """Fork a worker serving on ``fds`` (its request-read, result-write pipe ends) in ``workdir``;
        returns its pid (a child of this process, by re-parenting).

        Raises:
            ZygoteError: the zygote died or did not answer within ``timeout_s`` (s).
        """
        request = json.dumps({"workdir": workdir, "settings": settings}).encode()
        with self.lock:
            try:
                self.sock.settimeout(timeout_s)
                socket.send_fds(self.sock, [len(request).to_bytes(4, "big") + request], list(fds))
                reply = self.sock.recv(1 << 12)
            except OSError as e:
                raise ZygoteError(f"fork server failed: {e}") from None
        if not reply:
            raise ZygoteError(f"fork server exited (code {self.proc.poll()})")
        pid = int(json.loads(reply)["pid"])
        if pid <= 0:
            raise ZygoteError("fork server could not fork")
        return pid

    def close(self) -> None:
        """Stop the fork server (running workers are not affected) and remove its folder.  It is killed
        rather than asked: it holds nothing to save, and one still importing torch would read the closed
        socket only seconds later."""
        try:
            self.sock.close()
        finally:
            self.proc.kill()
            self.proc.wait()
            shutil.rmtree(self.workdir, ignore_errors=True)


def _recv_request(sock: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    data, fds, _, _ = socket.recv_fds(sock, 1 << 20, 2)
    if not data:
        return None
    size = int.from_bytes(data[:4], "big")
    body = data[4:]
    while len(body) < size:
        chunk = sock.recv(size - len(body))
        if not chunk:
            return None
        body += chunk
    return json.loads(body), fds


def _become_worker(sock: socket.socket, request: dict[str, Any], fds: list[int]) -> None:
    """In the forked worker: own session, private folder and log, then serve (never returns)."""
    from dice_ray.verify.sandbox import worker

    sock.close()
    os.setsid()
    workdir = request["workdir"]
    os.chdir(workdir)
    os.environ.update(HOME=workdir, TMPDIR=workdir)
    tempfile.tempdir = None
    log = os.open(os.path.join(workdir, "worker.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    code = 2
    try:
        code = worker.main([str(fds[0]), str(fds[1]), json.dumps({**request["settings"], "forked": True})])
    finally:
        sys.stdout.flush()
        os._exit(code)


def main(argv: list[str]) -> int:
    """Serve fork requests on the socket whose descriptor is ``argv[0]`` (see the module docstring) until it closes;
    returns 0."""
    sock = socket.socket(fileno=int(argv[0]))
    import torch  # noqa: F401 - the point of the zygote: imported once, before any fork

    from dice_ray import launch  # noqa: F401
    from dice_ray.verify.sandbox import confine, rlimits, worker  # noqa: F401
    from dice_ray.verify.trials import harness, op_recorder  # noqa: F401

    confine.load_libraries()  # landlockpy, pyseccomp (which runs ldconfig to find libseccomp): once, here
    op_recorder.warm_imports()  # torch's lazy imports (dispatch modes): seconds a worker no longer spends

    try:  # NVRTC and the driver bindings (loading them does not initialise CUDA)
        from cuda.bindings import driver, nvrtc  # noqa: F401
    except ImportError:
        pass
    gc.collect()
    gc.freeze()  # what it imported: a forked worker's collections never walk it (~300k objects, 127 ms a full one)

    while True:
        got = _recv_request(sock)
        if got is None:
            return 0
        request, fds = got
        pid_r, pid_w = os.pipe()
        middle = os.fork()
        if middle == 0:
            os.close(pid_r)
            pid = os.fork()
            if pid == 0:
                os.close(pid_w)
                _become_worker(sock, request, fds)
            os.write(pid_w, str(pid).encode())
            os._exit(0)
        os.close(pid_w)
        os.waitpid(middle, 0)  # the worker is re-parented to the verifier before it hears the pid
        pid = int(os.read(pid_r, 64) or b"-1")
        os.close(pid_r)
        for fd in fds:
            os.close(fd)
        sock.sendall(json.dumps({"pid": pid}).encode())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
