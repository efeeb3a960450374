"""Shared test set-up: the `gpu` marker skips cleanly without a CUDA GPU; paths to shared data; a local Ray cluster
shared by the modules that need no cluster of their own; no test joins a Ray cluster the suite did not start.

Every Ray cluster a test uses is the suite's own: the modules whose tests need no cluster of their own join one local
cluster shared by the session (:func:`ray_head`, through ``_helpers.joined_ray``: a Ray job of their own, whose actors
and placement groups end when they leave); the others start theirs (``ray.init(address="local", ...)``, a multi-node
``cluster_utils.Cluster``, ``ray start --head`` with a temp dir of its own) or the code under test does
(:func:`dice_ray.cluster.ray_start.start_ray`). A plain ``ray.init()`` would join the cluster a ``ray start`` left on
the machine, another user's or session's on a shared one; ``RAY_ADDRESS`` exported in the shell is dropped for the
session (a test that needs one sets it itself)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DICE_DATA = Path(os.environ.get("DICE_DATA_DIR", REPO.parent / "shared" / "data" / "dice"))


def _has_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


_EXIT_STATUS: list[int] = []


def pytest_configure(config):
    os.environ.pop("RAY_ADDRESS", None)  # dice-ray train / eval in-process and in child processes: their own cluster


def pytest_sessionfinish(session, exitstatus):
    _EXIT_STATUS.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """End the test process with pytest's own exit status once everything is reported, skipping the
    interpreter's teardown: native threads that Ray, gRPC and torch leave in the process once segfaulted
    in it after every test had passed (exit 139 after "1013 passed", stop 36's fresh-user trial, with no
    test at fault), which would turn a green suite red.  Nothing is lost: reports, caches and plugins'
    files are written by now."""
    if _EXIT_STATUS and not os.environ.get("DICE_RAY_TEST_TEARDOWN"):  # set it to debug the teardown
        import sys

        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT_STATUS[-1])


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def dice_data() -> Path:
    """The folder of DICE's JSON task files (skips when absent)."""
    if not DICE_DATA.is_dir():
        pytest.skip(f"DICE data not found at {DICE_DATA}")
    return DICE_DATA


@pytest.fixture(scope="session")
def sft_cache(request, tmp_path_factory) -> Path:
    """The ``sft.cache_dir`` of tests/test_resume_exact.py's ``dice-ray train`` run, so its warm start (same tasks,
    model, SFT config and seed: one content hash) is trained once a machine: pytest's cache folder (kept across
    sessions), or a folder of this session under ``-p no:cacheprovider``."""
    cache = getattr(request.config, "cache", None)
    return cache.mkdir("dice-ray-sft") if cache is not None else tmp_path_factory.mktemp("dice-ray-sft")


_RAY_HEAD = """
import sys
import ray

ray.init(address="local", num_cpus=2, num_gpus=0, include_dashboard=False, log_to_driver=False)
print("gcs_address", ray.get_runtime_context().gcs_address, flush=True)
sys.stdin.read()  # until the session closes it, or ends
ray.shutdown()
"""


@pytest.fixture(scope="session")
def ray_head(tmp_path_factory):
    """The GCS address of a local Ray cluster (2 CPUs, no GPU) shared by the test modules that need no cluster of
    their own; they join it with ``_helpers.joined_ray``. Starting a local head takes ~5 s (more on loaded cores),
    joining one well under a second. The head is a ``ray.init(address="local")`` in a process of its own, so that
    between its users this process is no Ray driver (tests check that code under test started no Ray, and
    ``dice-ray train`` in-process starts its own cluster); it ends with the session (or when this process dies: its
    stdin closes)."""
    log = tmp_path_factory.mktemp("ray-head") / "head.log"
    with open(log, "w") as err:
        head = subprocess.Popen([sys.executable, "-c", _RAY_HEAD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=err, text=True)
    try:
        line = ""
        while line is not None and not line.startswith("gcs_address "):
            line = head.stdout.readline() or None
        if line is None:
            head.wait(timeout=60)
            pytest.fail(f"the shared Ray head did not start (exit {head.returncode}):\n{log.read_text()[-3000:]}")
        yield line.split()[1]
    finally:
        head.stdin.close()  # the head shuts its cluster down
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait()
