"""Shared test set-up: the `gpu` marker skips cleanly without a CUDA GPU; paths to shared data."""

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
