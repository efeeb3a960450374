"""Run reports: a run directory's curves as a PNG (matplotlib) and a Markdown summary (``dice-ray report``).

A run directory (made by ``dice-ray train``) holds ``config.yaml`` (written at set-up),
``metrics.jsonl`` (one JSON record a finished RL step, see :func:`dice_ray.cluster.step_record.step_record`)
and, once the run has ended, ``summary.json``. A run still going has no ``summary.json`` and may have
a partly written last line in ``metrics.jsonl``; both are fine here.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

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
STAGES = [("rollout_seconds", "rollout"), ("verify_seconds", "verify"), ("learn_seconds", "learn"), ("sync_seconds", "weight sync"),
          ("idle_seconds", "idle (nothing in flight)")]  # rl.max_staleness > 0: the first four overlap
BUSY = [("rollout_busy_share", "rollout"), ("verify_busy_share", "verify"), ("learner_busy_share", "learner"),
        ("gpu_busy_share_mean", "GPUs (NVML, mean)"), ("gpu_busy_share_min", "least busy GPU")]
#: written into a run directory by ``dice-ray train`` when a session ends early (Ctrl-C or an error), removed when
#: a session starts: how it ended (``reason``), ``steps_done`` of ``steps``, ``time`` (s since the epoch)
STOPPED_FILE = "stopped.json"
PHASE_COLOURS = {"infill": "tab:blue", "ramp": "tab:orange", "e2e": "tab:green"}
# (record key, label, format) of the Markdown "Rates" table; None values print as n/a
RATES = [
    ("reward_mean", "reward (mean)", "{:.3f}"),
    ("compile_rate", "compile rate", "{:.1%}"),
    ("correct_rate", "correct rate", "{:.1%}"),
    ("cheat_rate", "cheat rate", "{:.1%}"),
    ("speedup_geomean", "speedup (geomean)", "{:.2f}x"),
    ("loss", "policy loss", "{:+.3e}"),
]
CONFIG_KEYS = [
    "run_name", "storage_path", "model.path", "tasks.spec", "tasks.max_tasks", "sft.steps", "rl.steps", "rl.prompts_per_step", "rl.num_generations",
    "rl.learning_rate", "rl.logprob_estimator", "rl.max_staleness", "cluster.learner_ranks", "phase.infill_steps", "phase.ramp_steps",
    "phase.final_infill_fraction", "verify.mode", "cluster.num_rollout_workers", "cluster.num_verifiers", "cluster.fused_kernels",
]


class NotARunDir(ValueError):
    """The folder given is not a ``dice-ray train`` run directory (no ``config.yaml`` nor ``metrics.jsonl``)."""


@dataclass
class Run:
    """What a run directory holds, as read by :func:`load_run`.

    Attributes:
        path: the run directory.
        config: ``config.yaml`` as a plain dict (``{}`` when absent).
        records: the step records of ``metrics.jsonl``, in file order.
        skipped_lines: lines of ``metrics.jsonl`` that were not a whole step record (a run still
            writing leaves at most one: its torn last line).
        summary: ``summary.json``, or None while the run is going (or if it stopped early), a resumed
            session included (the file is then an earlier session's, counting fewer steps than ``records``).
        stopped: ``stopped.json`` (:data:`STOPPED_FILE`): how the last session ended early (``reason``:
            ``interrupted`` or the error's line, ``steps_done``, ``steps``, ``time``), None when it did not or is going.
    """

    path: Path
    config: dict
    records: list[dict]
    skipped_lines: int
    summary: dict | None
    stopped: dict | None = None

    @property
    def name(self) -> str:
        """The run directory's name (also the ``run`` tag of its Ray metrics)."""
        return self.path.resolve().name

    @property
    def state(self) -> str:
        """``finished`` (``summary.json``), ``stopped`` (``stopped.json``: the last session ended early) or
        ``still running`` (neither: going, or its process was killed without a word)."""
        return "finished" if self.summary else "stopped" if self.stopped is not None else "still running"

    @property
    def planned_steps(self) -> int | None:
        """``rl.steps`` of the run's config (None without a config)."""
        return _dotted(self.config, "rl.steps")


def _read_records(path: Path) -> tuple[list[dict], int]:
    records, skipped = [], 0
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            skipped += 1
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int):
            records.append(rec)
        else:
            skipped += 1
    return records, skipped


def read_metrics(run_dir: str | Path) -> list[dict]:
    """Step records of ``RUN_DIR/metrics.jsonl`` (a run still going is fine: a torn last line is skipped).

    Lines that are not a JSON object with an integer ``step`` are skipped.

    Raises:
        FileNotFoundError: the run directory has no ``metrics.jsonl``.
    """
    return _read_records(Path(run_dir) / "metrics.jsonl")[0]


def load_run(run_dir: str | Path) -> Run:
    """Read a run directory: config, step records (torn lines skipped) and summary if the run ended.

    Raises:
        NotARunDir: ``run_dir`` is not a folder, or has neither ``config.yaml`` nor ``metrics.jsonl``,
            or one of its files is unreadable (the message names the file and the reason).
    """
    path = Path(run_dir).expanduser()
    if not path.is_dir():
        raise NotARunDir(f"{run_dir}: not a folder (want a dice-ray run directory)")
    cfg_file, metrics_file, summary_file = path / "config.yaml", path / "metrics.jsonl", path / "summary.json"
    if not cfg_file.is_file() and not metrics_file.is_file():
        runs = sorted(p.name for p in path.iterdir() if p.is_dir() and (p / "metrics.jsonl").is_file())
        inside = (f"; run directories in it: {', '.join(runs[-5:])}{' ...' if len(runs) > 5 else ''} "
                  f"(dice-ray report {Path(run_dir) / runs[-1]})") if runs else ""
        raise NotARunDir(f"{run_dir}: not a dice-ray run directory (no config.yaml nor metrics.jsonl){inside}")
    try:
        config = yaml.safe_load(cfg_file.read_text(encoding="utf-8")) if cfg_file.is_file() else {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        what = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise NotARunDir(f"{cfg_file}: unreadable ({at}{what})") from None
    if not isinstance(config, dict):
        raise NotARunDir(f"{cfg_file}: not a YAML mapping")
    try:
        records, skipped = _read_records(metrics_file) if metrics_file.is_file() else ([], 0)
    except OSError as exc:
        raise NotARunDir(f"{metrics_file}: unreadable ({exc.strerror or exc})") from None
    summary = None
    if summary_file.is_file():
        try:
            summary = json.loads(summary_file.read_text(encoding="utf-8", errors="replace"))
        except (json.JSONDecodeError, RecursionError):
            summary = None  # being written right now: report the run as still going
    if isinstance(summary, dict) and isinstance(summary.get("steps"), int) and summary["steps"] < len(records):
        summary = None  # an earlier session's: a resumed session has written steps since (and has not ended)
    stopped = None
    if (path / STOPPED_FILE).is_file():
        try:
            stopped = json.loads((path / STOPPED_FILE).read_text(encoding="utf-8", errors="replace"))
        except (json.JSONDecodeError, RecursionError):
            stopped = None
    return Run(path, config, records, skipped, summary if isinstance(summary, dict) else None,
               stopped if isinstance(stopped, dict) else None)


def _dotted(d: dict, key: str):
    for part in key.split("."):
        if not isinstance(d, dict):
            return None
        d = d.get(part)
    return d


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _fmt(v, fmt: str) -> str:
    return fmt.format(v) if _num(v) else "n/a"


def _phase_spans(records: list[dict]) -> list[tuple[str, int, int, list[dict]]]:
    """Consecutive runs of one phase: (phase, first step, last step, records)."""
    spans: list[tuple[str, int, int, list[dict]]] = []
    for r in records:
        phase = str(r.get("phase", "?"))
        if spans and spans[-1][0] == phase:
            p, first, _, recs = spans[-1]
            spans[-1] = (p, first, r["step"], recs + [r])
        else:
            spans.append((phase, r["step"], r["step"], [r]))
    return spans


def plot_curves(records: list[dict], out_png: str | Path, title: str = "") -> Path:
    """Write a grid of per-step curves (one panel a metric in :data:`PANELS`) to ``out_png``.

    Phases are shaded (infill blue, ramp orange, end-to-end green); the step-time panel adds the
    stage times of :data:`STAGES` when the records have them. Returns ``out_png`` as a Path.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(2, 4, figsize=(16, 6.5))
    steps = [r["step"] for r in records]
    spans = _phase_spans(records)

    def curve(ax, key, label=None):
        pts = [(s, r.get(key)) for s, r in zip(steps, records) if _num(r.get(key))]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, label=label)
        return bool(pts)

    for ax, (key, label) in zip(axes.flat, PANELS):
        if not curve(ax, key, "total" if key == "step_seconds" else None):
            empty = "no learner update (every group dropped)" if key == "loss" else "not measured"
            ax.text(0.5, 0.5, empty, ha="center", va="center", transform=ax.transAxes, color="grey")
        stage_drawn = [curve(ax, k, name) for k, name in STAGES] if key == "step_seconds" else []
        if any(stage_drawn):
            ax.legend(fontsize=7)
        for phase, first, last, _ in spans:
            ax.axvspan(first - 0.5, last + 0.5, color=PHASE_COLOURS.get(phase, "grey"), alpha=0.08, lw=0)
        if key.endswith("_rate") or key == "infill_fraction":
            ax.set_ylim(-0.03, 1.03)
        ax.set_title(label)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    fig.suptitle(title + ("  (shading: infill blue, ramp orange, end-to-end green)" if spans else ""))
    fig.tight_layout()
    out = Path(out_png)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def markdown_report(run: Run, curves_png: str | None = "curves.png") -> str:
    """The Markdown summary of a run: status, config, progress, phase timeline, rates, stage times, held-out.

    Args:
        run: as read by :func:`load_run`.
        curves_png: path of the curves image relative to the report (None: no image link).

    Returns:
        the report text; a run without ``summary.json`` is marked "(still running)".
    """
    recs = run.records
    lines = [f"# dice-ray run `{run.name}` ({run.state})" if run.state != "finished" else f"# dice-ray run `{run.name}`", ""]
    if run.summary:
        secs = run.summary.get("seconds")
        lines.append("Status: finished" + (f", the last session in {secs / 60:.1f} min" if _num(secs) else "")
                     + " (summary.json).")
    else:
        metrics = run.path / "metrics.jsonl"
        age = f"; last step written {(time.time() - metrics.stat().st_mtime) / 60:.1f} min ago" if metrics.is_file() else ""
        why = ("summary.json is an earlier session's: a resumed session has written steps since" if
               (run.path / "summary.json").is_file() else "no summary.json yet")
        if run.stopped is not None:
            st = run.stopped
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(st["time"])) if _num(st.get("time")) else "?"
            lines.append(f"Status: stopped ({st.get('reason', '?')}) at {when} with {st.get('steps_done', '?')} of "
                         f"{st.get('steps', '?')} steps done ({STOPPED_FILE}); `dice-ray train --resume {run.path}` "
                         "continues it from its last checkpoint.")
        else:
            lines.append(f"Status: still running ({why}{age}). A run whose process was killed also looks like this; "
                         "`dice-ray train --resume RUN_DIR` continues it.")
    lines += ["", f"Run directory: `{run.path}`", ""]
    if curves_png:
        lines += [f"![curves]({curves_png})", ""]

    lines += ["## Config", "", "| key | value |", "|---|---|"]
    for key in CONFIG_KEYS:
        v = _dotted(run.config, key)
        if v is not None:
            lines.append(f"| `{key}` | `{v}` |")
    if not run.config:
        lines.append("| (no config.yaml) | |")

    done, planned = (recs[-1]["step"] + 1 if recs else 0), run.planned_steps
    share = f" ({done / planned:.0%})" if planned else ""
    lines += ["", "## Progress", "", f"- Steps done: **{done}** / {planned if planned else '?'} planned{share}."]
    if recs:
        modes = sorted({str(r.get("verifier_mode")) for r in recs if r.get("verifier_mode")})
        lines.append(f"- Verifier mode: {', '.join(modes) or 'n/a'}.")
        lines.append(f"- Groups dropped (equal rewards): {sum(r.get('groups_dropped') or 0 for r in recs)}.")
    if run.skipped_lines:
        lines.append(f"- Skipped {run.skipped_lines} incomplete line(s) of metrics.jsonl (a step being written).")
    if not recs:
        lines += ["", "No step finished yet."]
        return "\n".join(lines) + "\n"

    lines += ["", "## Phase timeline", "", "| phase | steps | infill fraction | reward (mean over the phase) |", "|---|---|---|---|"]
    for phase, first, last, span in _phase_spans(recs):
        fr = [r.get("infill_fraction") for r in span]
        rw = [r["reward_mean"] for r in span if _num(r.get("reward_mean"))]
        lines.append(f"| {phase} | {first}-{last} ({len(span)}) | {_fmt(fr[0], '{:.2f}')} -> {_fmt(fr[-1], '{:.2f}')} "
                     f"| {_fmt(statistics.fmean(rw) if rw else None, '{:.3f}')} |")

    lines += ["", "## Rates", "", "| figure | first | last | mean | min | max |", "|---|---|---|---|---|---|"]
    for key, label, fmt in RATES:
        steps = [(r.get("step"), r[key]) for r in recs if _num(r.get(key))]
        if not steps:
            lines.append(f"| {label} | n/a | n/a | n/a | n/a | n/a |")
            continue
        vals = [v for _, v in steps]
        # a first or last value from another step than the run's (steps where it was n/a left out) says its step
        ends = [_fmt(v, fmt) + ("" if step == r.get("step") else f" (step {step})")
                for (step, v), r in ((steps[0], recs[0]), (steps[-1], recs[-1]))]
        lines.append(f"| {label} | " + " | ".join(ends + [_fmt(v, fmt) for v in (statistics.fmean(vals), min(vals), max(vals))]) + " |")

    timed = [(k, name, [r[k] for r in recs if _num(r.get(k))]) for k, name in STAGES + [("step_seconds", "whole step")]]
    if any(vals for _, _, vals in timed):
        total = [r["step_seconds"] for r in recs if _num(r.get("step_seconds"))]
        mean_total = statistics.fmean(total) if total else None
        lag = max((r["staleness_max"] for r in recs if _num(r.get("staleness_max"))), default=0)
        lines += ["", "## Step time by stage", ""]
        if lag:
            lines += [f"Asynchronous run (samples up to {lag} learner step(s) stale): a step's rollout and verification "
                      f"started up to {lag} step(s) before the step did, so they may last longer than the step itself "
                      "(a share above 100 %); the busy shares below give how much of each step a stage was in flight.", ""]
        lines += ["| stage | mean s | mean s / mean step |", "|---|---|---|"]
        for _, name, vals in timed:
            if vals:
                m = statistics.fmean(vals)
                lines.append(f"| {name} | {m:.2f} | {_fmt(m / mean_total if mean_total else None, '{:.0%}')} |")
        rates = [(label, [r[key] for r in recs if _num(r.get(key))])
                 for key, label in (("rollout_tokens_per_s", "rollout tokens/s"), ("verifier_throughput", "verdicts/s"))]
        lines += [""] + [f"- Mean {label}: {statistics.fmean(vals):.1f}." for label, vals in rates if vals]
        busy = [(label, [r[key] for r in recs if _num(r.get(key))]) for key, label in BUSY]
        if any(vals for _, vals in busy):
            lines.append("- Mean busy share: " + ", ".join(f"{label} {statistics.fmean(v):.0%}" for label, v in busy if v) + ".")
        lags = [r["staleness_mean"] for r in recs if _num(r.get("staleness_mean"))]
        if lag and lags:
            lines.append(f"- Staleness (learner steps a sample's weights lag): mean {statistics.fmean(lags):.2f}, max {lag}.")

    for key, title in (("train", "Training prompts (fixed seeds)"), ("heldout", "Held-out tasks")):
        lines += _evaluation_table(run.summary or {}, key, title)
    return "\n".join(lines) + "\n"


def _evaluation_table(summary: dict, key: str, title: str) -> list[str]:
    """The Markdown table of a run's start / end evaluations ``{key}_start`` / ``{key}_end`` (reward, compile and
    correct rates by phase), or no line when the summary has none."""
    evaluations = [(w, summary.get(f"{key}_{w}")) for w in ("start", "end")]
    evaluations = [(w, h) for w, h in evaluations if isinstance(h, dict) and h]
    if not evaluations:
        return []
    lines = ["", f"## {title}", "", "| when | phase | candidates | reward | compile rate | correct rate |",
             "|---|---|---|---|---|---|"]
    for when, h in evaluations:
        for phase, fig in h.items():
            if isinstance(fig, dict):
                lines.append(f"| {when} | {phase} | {fig.get('candidates', 'n/a')} | {_fmt(fig.get('reward_mean'), '{:.3f}')} | "
                             f"{_fmt(fig.get('compile_rate'), '{:.1%}')} | {_fmt(fig.get('correct_rate'), '{:.1%}')} |")
    return lines


def write_report(run_dir: str | Path, out: str | Path | None = None) -> tuple[Path, Path, str]:
    """``dice-ray report``: write ``curves.png`` and ``report.md`` of a run directory.

    Args:
        run_dir: the run directory (finished or still going).
        out: folder for the two files (made if missing); default ``run_dir`` itself.

    Returns:
        (curves.png path, report.md path, the Markdown text).

    Raises:
        NotARunDir: ``run_dir`` is not a run directory (see :func:`load_run`).
        OSError: ``out`` cannot be written.
    """
    run = load_run(run_dir)
    out_dir = Path(out).expanduser() if out is not None else run.path
    out_dir.mkdir(parents=True, exist_ok=True)
    png = plot_curves(run.records, out_dir / "curves.png",
                      title=f"dice-ray {run.name}" + ("" if run.state == "finished" else f" ({run.state})"))
    text = markdown_report(run, png.name)
    md = out_dir / "report.md"
    md.write_text(text)
    return png, md, text
