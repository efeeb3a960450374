"""Evaluation reports: ``results.json``, ``results.md`` (a table a level) and ``results.png``.

The JSON holds every candidate's verdict, the metrics of :mod:`dice_ray.eval.metrics`, the
hardware name and the run's settings; the Markdown and the plot are views of it.  In compile-only
mode (no GPU) correctness and speed were not measured: the table prints "not measured" in those
columns and the plot shows only compile rates, with a note saying so.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dice_ray.verify.verdict import Verdict

COMPILE_ONLY_HARDWARE = "cpu (compile-only)"
NOT_MEASURED = "not measured"
_PLOT_PS = [0.0, 0.5, 0.8, 1.0, 1.5, 2.0, 3.0]


def hardware_name(verdicts: Sequence[Verdict]) -> str:
    """The GPU that measured ``verdicts``, or :data:`COMPILE_ONLY_HARDWARE`.

    Verdicts do not carry a device name: when any is ``gpu`` mode, the name of this machine's GPU 0
    is read with nvidia-ml-py (``pynvml``), else ``torch.cuda.get_device_name``; ``"gpu (name
    unknown)"`` when neither answers (e.g. verifiers on another Ray node of a CPU-only driver).
    """
    if not any(v.mode == "gpu" for v in verdicts):
        return COMPILE_ONLY_HARDWARE
    return _nvml_name() or _torch_name() or "gpu (name unknown)"


def _nvml_name() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no NVML library, driver or device
        return None
    return name.decode() if isinstance(name, bytes) else str(name)


def _torch_name() -> str | None:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001 - a broken CUDA install
        return None


def _pct(x: float | None, measured: bool = True) -> str:
    if not measured:
        return NOT_MEASURED
    return "n/a" if x is None else f"{100 * x:.1f}%"


def markdown(result: dict[str, Any]) -> str:
    """The Markdown report of a result dict (the content of ``results.json``): a table a level."""
    metrics = result["metrics"]
    lines = [f"# dice-ray eval: {result['source']}", "",
             f"- tasks: `{result['tasks_spec']}` ({metrics['overall']['tasks']} evaluated)",
             f"- hardware: {result['hardware']}; verifier: {result['verifier']}",
             (f"- samples a task: {result['samples_per_task']}; fast_p, compiled and correct use each task's "
              "first sample (KernelBench), pass@k all samples (Chen et al. 2021)")]
    if not metrics["overall"]["measured"]:
        lines.append("- **compile-only mode: correctness and speed were NOT measured** (no GPU verifier); "
                     "only compile rates are meaningful")
    if result.get("missing"):
        lines.append(f"- {len(result['missing'])} task(s) without a candidate count as failed")
    if result.get("unmatched"):
        lines.append(f"- ignored (no such task): {', '.join(result['unmatched'][:10])}")
    if result.get("skipped"):
        lines.append(f"- {len(result['skipped'])} task(s) skipped (the phase cannot pose them), not counted")
    groups = [(f"Level {lvl}", m) for lvl, m in metrics["levels"].items()] + [("Overall", metrics["overall"])]
    ps = list(metrics["overall"]["fast_p"])
    ks = list(metrics["overall"]["pass_at_k"])
    head = ["", "tasks", "samples", "compiled", "correct", *[f"fast_{p}" for p in ps], "geomean speedup",
            *[f"pass@{k}" for k in ks]]
    lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, m in groups:
        meas = m["measured"]
        geo = m["geomean_speedup"]
        row = [name, str(m["tasks"]), str(m["samples"]), _pct(m["compiled"]), _pct(m["correct"], meas),
               *[_pct(m["fast_p"][p], meas) for p in ps],
               (f"{geo:.2f}x" if geo is not None else "n/a") if meas else NOT_MEASURED,
               *[_pct(m["pass_at_k"][k], meas) if m["pass_at_k"][k] is not None or not meas else "n/a (k > n)"
                 for k in ks]]
        lines.append("| " + " | ".join(row) + " |")
    counts: dict[str, int] = {}
    for c in result["candidates"]:
        counts[c["verdict"]["verdict"]] = counts.get(c["verdict"]["verdict"], 0) + 1
    lines += ["", "Verdicts: " + (", ".join(f"{k} {n}" for k, n in sorted(counts.items())) or "none")]
    if counts.get("ok") and not metrics["overall"]["measured"]:
        lines.append("(compile-only: `ok` means compiled, rule-abiding and dry-run on meta tensors, not run)")
    return "\n".join([*lines, ""])


def _say_all_zero(ax, text: str) -> None:
    """Write ``text`` across the middle of ``ax``: a plot whose every value is 0 would be a blank axes."""
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", wrap=True)


def plot(result: dict[str, Any], out_png: str | Path) -> Path:
    """Save :func:`figure` of ``result`` to ``out_png`` (100 dpi); returns the path."""
    import matplotlib.pyplot as plt

    fig = figure(result)
    out_png = Path(out_png)
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png


def figure(result: dict[str, Any]):
    """A matplotlib Figure of fast_p over p per level (measured), or of compile rates per level (compile-only, each bar
    labelled with its share); when every value is 0 it says so in words rather than show a blank axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dice_ray.eval.metrics import group_metrics

    by_task: dict[str, list[Verdict]] = {}
    for c in result["candidates"]:
        by_task.setdefault(c["task_id"], []).append(Verdict.model_validate(c["verdict"]))
    levels = {t["task_id"]: t["level"] for t in result["tasks"]}
    fig, ax = plt.subplots(figsize=(6, 4))
    metrics = result["metrics"]
    if metrics["overall"]["measured"]:
        groups: dict[str, list[list[Verdict]]] = {}
        for tid, lvl in levels.items():
            groups.setdefault(f"level {lvl}", []).append(by_task.get(tid, []))
        groups["overall"] = [by_task.get(tid, []) for tid in levels]
        for name, samples in groups.items():
            fp = group_metrics(samples, _PLOT_PS, ())["fast_p"]
            ax.plot(_PLOT_PS, [fp[f"{p:g}"] for p in _PLOT_PS], marker="o", label=name,
                    linestyle="--" if name == "overall" else "-")
        ax.set_xlabel("speedup threshold p")
        ax.set_ylabel("fast_p (share of tasks)")
        ax.set_ylim(-0.02, 1.02)  # a fast_p of 0 stays visible on the axis
        ax.legend()
        ax.set_title(f"fast_p on {result['hardware']}")
        if not any(line.get_ydata().any() for line in ax.get_lines()):
            _say_all_zero(ax, "fast_p is 0 at every p: no task had a correct sample (results.md says why)")
    else:
        names = [f"L{lvl}" for lvl in metrics["levels"]] + ["all"]
        vals = [m["compiled"] or 0.0 for m in metrics["levels"].values()] + [metrics["overall"]["compiled"] or 0.0]
        ax.bar_label(ax.bar(names, vals), labels=[f"{v:.0%}" for v in vals])
        ax.set_ylim(0, 1.02)
        ax.set_ylabel("compiled (share of tasks)")
        ax.set_title("compile-only: correctness and speed not measured")
        if not any(vals):
            _say_all_zero(ax, "no task compiled (results.md lists the verdicts)")
    fig.tight_layout()
    return fig


def write_report(result: dict[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """Write ``results.json``, ``results.md`` and ``results.png`` of ``result`` into ``out_dir``.

    Args:
        result: the dict :func:`dice_ray.eval.run.evaluate` builds (``source``, ``tasks_spec``,
            ``hardware``, ``verifier``, ``samples_per_task``, ``tasks``, ``candidates``,
            ``metrics``, ``missing``, ...); JSON-serialisable.

    Returns:
        ``{"json": path, "md": path, "png": path}``.
    Raises:
        OSError: ``out_dir`` cannot be created or written.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "md": out / "results.md", "png": out / "results.png"}
    paths["json"].write_text(json.dumps(result, indent=1))
    paths["md"].write_text(markdown(result))
    plot(result, paths["png"])
    return paths
