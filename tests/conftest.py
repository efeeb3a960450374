"""Shared test set-up: the `gpu` marker skips cleanly without a CUDA GPU; paths to shared data; no test joins a Ray
cluster it did not start.

Every Ray cluster a test uses is its own: fixtures call ``ray.init(address="local", ...)`` (a plain ``ray.init()`` joins
the cluster a ``ray start`` left on the machine, another user's or session's on a shared one), the code under test
starts a private one (:func:`dice_ray.cluster.ray_start.start_ray`), and ``RAY_ADDRESS`` exported in the shell is
dropped for the session (a test that needs one sets it itself)."""

from __future__ import annotations

import os
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
