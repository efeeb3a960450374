"""The operating system confines a candidate, not only the static rules (dice_ray/verify/confine.py).

With ``verify.static_rules=false`` a candidate has ``open``, ``os``, ``socket`` and ``subprocess`` at hand;
Landlock (files, TCP, signals) and seccomp (sockets, processes, programs) must still refuse what a worker
never needs, and the verdict must say what was refused.  Compile-only mode runs a candidate's Python on the
CPU in three places: the module (at ``load``, NVRTC compiling its kernels), ``ModelNew(*get_init_inputs())``
on the CPU, and ``forward`` in the dry run on meta tensors (launches checked, not run): each is confined.
Honest candidates stay ``ok``.  The GPU side is the ``gpu``-marked test at the end.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

import pytest

from _verify_sources import HONEST, RELU_REF, mutate
from dice_ray.config import RewardConfig, VerifyConfig
from dice_ray.tasks.loaders import load_tasks
from dice_ray.tasks.task import Task
from dice_ray.verify.sandbox import confine
from dice_ray.verify.verifier import Verifier

TASK = Task("test/relu", "relu", 1, RELU_REF)
LIMITS = dict(mode="compile_only", compile_timeout_s=10.0, run_timeout_s=10.0)
LIBS = confine.load_libraries()
LANDLOCK_ABI = 0 if isinstance(LIBS["landlockpy"], str) else LIBS["landlockpy"].abi_version()
HAS_SECCOMP = not isinstance(LIBS["pyseccomp"], str)
needs_landlock = pytest.mark.skipif(LANDLOCK_ABI < 1, reason="this kernel has no Landlock")
needs_seccomp = pytest.mark.skipif(not HAS_SECCOMP, reason="libseccomp.so.2 not found")
ESCAPE = f"/tmp/dice-ray-confine-escape-{os.getpid()}.txt"

#: what a candidate tries (module-level code), the layer that refuses it, and what the verdict's reason names
CASES = {
    "read_outside": ("open('/etc/passwd').read()", "landlock", "reading '/etc/passwd' refused (Landlock"),
    "write_outside": (f"open({ESCAPE!r}, 'w').write('x')", "landlock", f"writing {ESCAPE!r} refused (Landlock"),
    "unix_socket": ("import socket\nsocket.socket(socket.AF_UNIX, socket.SOCK_STREAM)", "seccomp",
                    "socket(AF_UNIX) refused (seccomp"),
    "ip_socket": ("import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)", "seccomp",
                  "socket(AF_INET) refused (seccomp"),
    "fork": ("import os\nif os.fork() == 0:\n    os._exit(0)", "seccomp", "os.fork() refused (seccomp"),
    "exec": ("import os\nos.execv('/bin/true', ['true'])", "seccomp", "exec of '/bin/true' refused (seccomp"),
}


@pytest.fixture(scope="module")
def unguarded():
    """Static rules off: only the worker's confinement stands between a candidate and the machine."""
    with Verifier(VerifyConfig(static_rules=False, **LIMITS), RewardConfig()) as v:
        yield v


def verify(v: Verifier, src: str, label: str):
    verdict = v.verify(TASK, src, label)
    print(f"{label}: {verdict.verdict} {verdict.reason[:300]!r}")
    return verdict


@pytest.mark.parametrize("case", sorted(CASES))
def test_static_rules_off_the_os_still_refuses(unguarded, case):
    code, layer, says = CASES[case]
    if (layer == "landlock" and LANDLOCK_ABI < 1) or (layer == "seccomp" and not HAS_SECCOMP):
        pytest.skip(f"{layer} is not available here")
    verdict = verify(unguarded, mutate("import torch\n", f"import torch\n{code}\n"), case)
    assert verdict.verdict == "crash" and verdict.reward == 0.0, verdict.reason
    assert verdict.reason.startswith(f"sandbox: {says}"), verdict.reason
    assert not os.path.exists(ESCAPE)


@needs_landlock
@pytest.mark.parametrize("where", ["module", "init", "forward"])
def test_each_place_candidate_code_runs_on_the_cpu_is_confined(unguarded, where):
    """The module at load, ModelNew's constructor on the CPU and forward in the dry run (meta tensors)."""
    read = "open('/etc/passwd').read()"
    if where == "module":
        src = mutate("import torch\n", f"import torch\n{read}\n")
    elif where == "init":
        src = mutate("        super().__init__()\n", f"        super().__init__()\n        {read}\n")
    else:
        src = mutate("        x = x.contiguous()\n", f"        {read}\n        x = x.contiguous()\n")
    verdict = verify(unguarded, src, where)
    assert verdict.verdict == "crash", verdict.reason
    assert verdict.reason.startswith("sandbox: reading '/etc/passwd' refused (Landlock"), verdict.reason
    assert ("dry run" in verdict.reason) == (where == "forward")


@needs_landlock
@needs_seccomp
def test_a_worker_forked_by_the_fork_server_is_confined_too(unguarded):
    """Replacements and spares are forked from the fork server (torch imported, no thread running): each confines
    itself at its start as a cold worker does, its own folder writable, the fork server's not readable."""
    crash = mutate("import torch\n", "import torch\nimport os\nos._exit(3)\n")
    assert verify(unguarded, crash, "exit").verdict == "crash"
    assert unguarded.wait_for_spares(120) < 120
    assert verify(unguarded, crash, "exit again").verdict == "crash"  # the ready spare takes over
    worker = next(iter(unguarded._idle.queue))
    assert worker.forked and worker.info["confinement"]["landlock"].startswith(f"ABI {LANDLOCK_ABI}: ")
    zygote_log = os.path.join(unguarded._zygote.workdir, "zygote.log")
    for case in ("read_outside", "unix_socket"):
        code, _, says = CASES[case]
        verdict = verify(unguarded, mutate("import torch\n", f"import torch\n{code}\n"), f"forked {case}")
        assert verdict.verdict == "crash" and verdict.reason.startswith(f"sandbox: {says}"), verdict.reason
    verdict = verify(unguarded, mutate("import torch\n", f"import torch\nopen({zygote_log!r}).read()\n"), "zygote")
    assert verdict.verdict == "crash" and "refused (Landlock" in verdict.reason, verdict.reason
    assert verify(unguarded, HONEST, "honest").verdict == "ok"


@pytest.mark.skipif(LANDLOCK_ABI < 6, reason="Landlock scopes signals from ABI 6 on")
def test_no_signals_to_other_processes(unguarded):
    """The verifier and the other workers are out of reach (os.kill(pid, 0) only asks whether it may)."""
    verdict = verify(unguarded, mutate("import torch\n", "import torch\nimport os\nos.kill(os.getppid(), 0)\n"), "kill")
    assert verdict.verdict == "crash", verdict.reason
    assert verdict.reason.startswith(f"sandbox: os.kill({os.getpid()}, 0) refused (Landlock"), verdict.reason


def test_what_a_worker_needs_still_works(unguarded):
    """Its private folder (read, write, list, remove), threads (clone with CLONE_THREAD), its own process's
    files under /proc, Python modules imported lazily, the pipes to the verifier (every verdict)."""
    probe = mutate("import torch\n", (
        "import torch\nimport os, threading, json, tempfile\n"
        "open('mine.txt', 'w').write('x')\nassert open('mine.txt').read() == 'x' and 'mine.txt' in os.listdir('.')\n"
        "os.remove('mine.txt')\nwith tempfile.NamedTemporaryFile() as f: f.write(b'y')\n"
        "t = threading.Thread(target=lambda: None)\nt.start()\nt.join()\n"
        "assert 'VmRSS' in open('/proc/self/status').read()\n"
        "import xml.dom.minidom\n"
    ))
    assert verify(unguarded, probe, "needs").verdict == "ok"
    if LANDLOCK_ABI >= 1 and HAS_SECCOMP:
        status = unguarded.stats()["confinement"]
        assert status["landlock"].startswith(f"ABI {LANDLOCK_ABI}: ") and status["seccomp"].startswith("libseccomp: ")


def test_every_builtin_solution_is_still_ok_compile_only():
    """109 honest candidates (static rules on, as in training): module, constructor and dry run, confined."""
    tasks = [t for t in load_tasks("builtin").tasks if t.solution_src]
    with Verifier(VerifyConfig(**LIMITS), RewardConfig()) as v:
        verdicts = v.verify_many([(t, t.solution_src, t.task_id) for t in tasks])
        status = v.stats()["confinement"]
    bad = [(r.candidate_id, r.verdict, r.reason[:300]) for r in verdicts if r.verdict != "ok"]
    assert not bad, bad
    assert len(verdicts) >= 100 and set(status) == {"landlock", "seccomp"}, status


def test_a_start_that_fails_under_landlock_turns_it_off_for_later_workers(caplog):
    """A machine whose CUDA driver needs a path the policy does not give (cuInit failing with error 304 until the
    worker's /proc entry was writable, seen on an H200 machine) costs one worker's start, not the verifier: the
    workers started after it run without Landlock (seccomp still on), the job waiting for one goes to them, and
    the reason is logged once.  The failure is simulated: a malformed extra read path breaks the policy."""
    with caplog.at_level(logging.WARNING, logger="dice_ray.verify.sandbox.confine"), \
            Verifier(VerifyConfig(static_rules=False, fork_server=False, **LIMITS), RewardConfig()) as v:
        assert verify(v, HONEST, "before").verdict == "ok"
        v._settings["sandbox_read_paths"] = 7  # not a list: Confinement.restrict_files raises in the next start
        assert verify(v, mutate("import torch\n", "import torch\nimport os\nos._exit(3)\n"), "exit").verdict == "crash"
        verdict = verify(v, HONEST, "after")  # its worker failed to start; the job went to the next one
        assert verdict.verdict == "ok", verdict.reason
        assert v._settings["landlock"] is False and "stage 'imports'" in v._settings["landlock_off"]
        status = v.stats()["confinement"]
        assert status["landlock"].startswith("not applied: a worker's start failed under it"), status
        if HAS_SECCOMP:
            assert status["seccomp"].startswith("libseccomp: ")
    lines = [r.getMessage() for r in caplog.records if "landlock not applied" in r.getMessage()]
    assert len(lines) == 1 and "the workers started after it run without it" in lines[0], lines


# -- without the kernel's support: said once, the rest still works -------------------------------------
class _NoLandlock:
    """landlockpy on a kernel without Landlock (its abi_version() is 0 there)."""

    @staticmethod
    def abi_version() -> int:
        return 0


def test_a_kernel_without_landlock_is_said_once(monkeypatch, caplog, tmp_path):
    monkeypatch.setattr(confine, "load_libraries",
                        lambda: {"landlockpy": _NoLandlock, "pyseccomp": "libseccomp.so.2 not found (test)"})
    monkeypatch.setattr(confine, "_logged", set())
    box = confine.Confinement(str(tmp_path), gpu=False)
    assert box.restrict_files().startswith("not applied: this kernel has no Landlock")
    assert box.restrict_syscalls() == "not applied: libseccomp.so.2 not found (test)"
    assert box.policy is None and box.refusal() is None  # nothing applied, nothing refused
    with caplog.at_level(logging.WARNING, logger="dice_ray.verify.sandbox.confine"):
        for _ in range(3):
            confine.log_status_once(box.status)
    lines = sorted(r.getMessage() for r in caplog.records)
    assert len(lines) == 2 and "landlock not applied" in lines[0] and "seccomp not applied" in lines[1], lines
    off = confine.Confinement(str(tmp_path), gpu=False, landlock=False, seccomp=False)
    assert off.status == {"landlock": "off (verify.landlock=false)", "seccomp": "off (verify.seccomp=false)"}


def test_the_file_policy_reads_python_and_the_package_not_the_project_folder(tmp_path):
    """Read-only: the interpreter's and the packages' folders, this dice_ray package, not the folder holding it
    (a project folder may hold .env files); read-write: the private folder only."""
    policy = confine.file_policy(str(tmp_path), gpu=False)
    package = os.path.dirname(os.path.realpath(confine.__file__ + "/../.."))  # dice_ray/ (confine: verify/sandbox/)
    assert policy.allows(os.path.join(package, "verify", "confine.py"), write=False)
    assert policy.allows(threading.__file__, write=False) and policy.allows(pytest.__file__, write=False)
    assert not policy.allows(os.path.join(package, "verify", "confine.py"), write=True)
    assert policy.allows(str(tmp_path / "x"), write=True) and policy.allows("/dev/null", write=True)
    assert not policy.allows("/etc/passwd", write=False) and not policy.allows("/tmp/x", write=True)
    root = os.path.dirname(package)
    if not any(root == p or root.startswith(p + "/") for p in map(os.path.realpath, (sys.prefix, sys.base_prefix))):
        assert not policy.allows(os.path.join(root, "pyproject.toml"), write=False)


# -- on a GPU ---------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_confined_gpu_worker_verifies_honest_candidates_and_refuses_escapes():
    """A GPU worker under Landlock from its start (CUDA's context, NVRTC, the kernel preload and the self-test
    under it) and seccomp after: honest candidates correct and timed, escapes refused (static rules off)."""
    tasks = {t.task_id: t for t in load_tasks("builtin").tasks}
    cfg = VerifyConfig(mode="gpu", workers=1, spare_workers=1, static_rules=False, timing_trials=5)
    with Verifier(cfg, RewardConfig(), device=0) as v:
        for task_id in ("builtin/L1/relu", "builtin/L1/softmax", "builtin/L1/matmul"):
            verdict = v.verify(tasks[task_id], tasks[task_id].solution_src, task_id)
            assert verdict.verdict == "ok" and verdict.correct and verdict.speedup, verdict.reason
        status = v.stats()["confinement"]
        print(status)
        if LANDLOCK_ABI >= 1:
            assert status["landlock"].startswith(f"ABI {LANDLOCK_ABI}: ") and "devices" in status["landlock"]
            verdict = v.verify(TASK, mutate("import torch\n", "import torch\nopen('/etc/passwd').read()\n"), "read")
            assert verdict.verdict == "crash" and verdict.reason.startswith("sandbox: reading"), verdict.reason
        if HAS_SECCOMP:
            assert status["seccomp"].startswith("libseccomp: "), status
            verdict = v.verify(TASK, mutate("import torch\n", "import torch\nimport socket\nsocket.socket()\n"), "sock")
            assert verdict.verdict == "crash" and verdict.reason.startswith("sandbox: socket("), verdict.reason
        verdict = v.verify(tasks["builtin/L1/relu"], tasks["builtin/L1/relu"].solution_src, "after")
        assert verdict.verdict == "ok" and verdict.correct, verdict.reason
