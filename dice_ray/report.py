"""Run reports: the curves of a run directory's ``metrics.jsonl`` as a PNG (matplotlib)."""

from __future__ import annotations

import json
from pathlib import Path

PANELS = [
    ("reward_mean", "reward (mean)"),
    ("compile_rate", "compile rate"),
    ("correct_rate", "correct rate"),
    ("cheat_rate", "cheat rate"),
    ("speedup_geomean", "speedup (geomean)"),
    ("infill_fraction", "infill fraction"),
    ("loss", "policy loss"),
    ("step_seconds", "step time (s)"),
]


def read_metrics(run_dir: str | Path) -> list[dict]:
    """Step records of ``RUN_DIR/metrics.jsonl`` (a run still going is fine: a torn last line is skipped).

    Raises:
        FileNotFoundError: the run directory has no ``metrics.jsonl``.
    """
    path = Path(run_dir) / "metrics.jsonl"
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def plot_curves(records: list[dict], out_png: str | Path, title: str = "") -> Path:
    """Write a grid of per-step curves (one panel a metric in :data:`PANELS`) to ``out_png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 4, figsize=(16, 6.5))
    steps = [r["step"] for r in records]
    for ax, (key, label) in zip(axes.flat, PANELS):
        ys = [r.get(key) for r in records]
        pts = [(s, y) for s, y in zip(steps, ys) if isinstance(y, (int, float))]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o")
        else:
            ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes, color="grey")
        ax.set_title(label)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    out = Path(out_png)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
