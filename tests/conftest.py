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
