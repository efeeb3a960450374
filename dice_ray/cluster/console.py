"""What the driver prints: the step table's columns and rows, and one readable line (not a dict repr) for each
report an actor or the run gives (warm start, learner, evaluations, curriculum decisions, summary, outputs)."""

from __future__ import annotations

import math
import shlex
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from dice_ray.config import DEEPSPEED_OPS_DIR

COLUMNS = [
    ("step", 4, "{:d}"), ("phase", 6, "{}"), ("infill", 6, "{:.2f}"), ("reward", 6, "{:.3f}"), ("±std", 4, "{:.2f}"),
    ("compile", 7, "{:.0%}"), ("correct", 7, "{:.0%}"), ("cheat", 5, "{:.0%}"), ("speedup", 7, "{:.2f}x"),
    ("drop", 4, "{:d}"), ("loss", 8, "{:+.1e}"), ("sec", 5, "{:.1f}"),
]  # 80 columns with the spaces between: an 80-column terminal shows a row on one line


def describe_warm_start(report: dict, steps_max: int, target_loss: float | None) -> str:
    """One line for the console from the learner's warm-start report (:class:`~dice_ray.policy.sft_warm_start.SFTReport`
    as a dict: ``steps``, ``final_loss`` (nats a masked token), ``seconds``, ``cache_hit``, ``cache_key``,
    ``num_pairs``, ``losses`` as ``[(step, loss), ...]``), e.g. ``658 SFT steps on 176 pairs in 24.0 s, loss
    6.36 -> 0.068; stopped at step 658 of 800: loss below sft.target_loss=0.08; cached as 2efde44e0b59``."""
    key = str(report.get("cache_key", ""))[:12]
    final = report.get("final_loss")
    if report.get("cache_hit"):
        loss = f", final loss {final:.3f}" if isinstance(final, float) and math.isfinite(final) else ""
        return f"from the SFT cache ({key}): {report.get('num_pairs')} (prompt, solution) pairs{loss}"
    losses = report.get("losses") or []
    line = (f"{report.get('steps')} SFT steps on {report.get('num_pairs')} (prompt, solution) pairs in "
            f"{report.get('seconds', 0.0):.1f} s")
    if len(losses) > 1:
        line += f", loss {losses[0][1]:.2f} -> {losses[-1][1]:.3f}"
    elif losses:  # one logged step: no trend to show
        line += f", loss {losses[0][1]:.3f}"
    if report.get("steps", 0) < steps_max:
        line += f"; stopped at step {report.get('steps')} of {steps_max}: loss below sft.target_loss={target_loss}"
    return f"{line}; cached as {key}" if key else line


#: a ``deepspeed.initialize`` this slow (s) is named on the learner line (the first run builds DeepSpeed's ops)
SLOW_DEEPSPEED_S = 5.0


def describe_learner(info: dict) -> str:
    """One line for the console from the learner's ``init_engine`` report (``family``, ``model``, ``params``,
    ``zero_stage``, ``backend``, ``ranks``, ``device``, ``seconds``; ``fused_kernels`` named when not empty,
    ``fused_kernels_off``, why ``auto`` left them off on a GPU, and ``deepspeed_seconds``, named when
    ``deepspeed.initialize`` took :data:`SLOW_DEEPSPEED_S` or more: it builds its ops the first time; and
    ``offload_seconds``, the first offload of a colocated learner's states, when not None), e.g.
    ``sdar policy, 0.55 M params, built, warm-started by SFT; DeepSpeed ZeRO-0 over gloo, 1 rank(s) on cpu; ready in
    1.3 s`` (on a GPU with Liger: ``... on cuda:0, fused kernels: swiglu, rope (Liger); ready in ...``)."""
    return (f"{info.get('family')} policy, {info.get('params', 0) / 1e6:.2f} M params, {info.get('model')}; "
            f"DeepSpeed ZeRO-{info.get('zero_stage')} over {info.get('backend')}, {info.get('ranks')} rank(s) on "
            f"{info.get('device')}"
            + (f", fused kernels: {', '.join(info['fused_kernels'])} (Liger)" if info.get("fused_kernels") else "")
            + (f", fused kernels off (cluster.fused_kernels=auto: {info['fused_kernels_off']})"
               if info.get("fused_kernels_off") else "")
            + f"; ready in {info.get('seconds', 0.0):.1f} s"
            + (f"; its states go to CPU memory while the rollout workers sample (cluster.colocate_rollout; "
               f"{info['offload_seconds']:.1f} s)" if info.get("offload_seconds") is not None else "")
            + (f" (DeepSpeed's set-up {info['deepspeed_seconds']:.1f} s of it: it builds its ops on first use, then "
               f"caches them in {DEEPSPEED_OPS_DIR})" if info.get("deepspeed_seconds", 0.0) >= SLOW_DEEPSPEED_S
               else ""))


def describe_heldout(out: dict) -> str:
    """One line from :meth:`~dice_ray.cluster.evaluation.Evaluations.heldout`'s ``{phase: {"candidates", "tasks", "compile_rate",
    "ok_rate", "correct_rate", "compile_only"}}``, e.g. ``infill: 8 candidates (4 held-out tasks), 25.0% compile, 12.5% ok, correctness
    not measured (compile-only verifier); e2e: ...`` (on a GPU verifier ``... (nothing compiled)`` when no
    candidate compiled, ``... (none reached the correctness check)`` when those that compiled failed before it,
    e.g. a launch of a kernel the module does not define)."""
    parts = []
    for phase, fig in out.items():
        correct = fig.get("correct_rate")
        why = ("compile-only verifier" if fig.get("compile_only") else
               "nothing compiled" if not fig.get("compile_rate") else "none reached the correctness check")
        said = f"{correct:.1%} correct" if correct is not None else f"correctness not measured ({why})"
        n = fig.get("tasks")
        tasks = f" ({n} held-out task{'' if n == 1 else 's'})" if n else ""
        ok = f", {fig['ok_rate']:.1%} ok" if fig.get("ok_rate") is not None else ""  # none in an older run's eval_start.json
        parts.append(f"{phase}: {fig.get('candidates')} candidates{tasks}, {fig.get('compile_rate', 0.0):.1%} compile"
                     f"{ok}, {said}")
    return "; ".join(parts) or "no eligible task"


def describe_train_eval(out: dict) -> str:
    """One line from :meth:`~dice_ray.cluster.evaluation.Evaluations.train`, e.g. ``infill: reward 0.62 over 32 candidates (8 tasks), 66% compile;
    e2e: ...``."""
    return "; ".join(f"{phase}: reward {f['reward_mean']:.3f} over {f['candidates']} candidates ({f['tasks']} tasks), "
                     f"{f['compile_rate']:.0%} compile" for phase, f in out.items()) or "no task"


def describe_summary(summary: dict) -> str:
    """Two lines for the console from the run's summary (what ``summary.json`` holds; the held-out lines are
    printed before it), e.g. ``10 steps (phases infill, ramp, e2e), 332.9 s with the warm start and held-out
    evaluations, verifier compile-only`` (a resumed run: ``12 steps (...), 2 of them in this run, resumed at step
    10: 35.0 s with the final held-out evaluation, ...``) / ``reward 0.391 -> 0.016; last step: compile 2%, correct n/a, cheat 0%,
    speedup n/a; 47 groups dropped (...)``, and when the last step's verdict counts are known a third line,
    ``last step's verdicts: compile_error 43, ok 21``."""
    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.0%}"

    final = summary.get("final") or {}
    first_last = summary.get("reward_mean_first_last") or [None, None]
    order = {"infill": 0, "ramp": 1, "e2e": 2}
    phases = ", ".join(sorted(summary.get("phases_seen") or [], key=lambda p: order.get(p, 3)))
    speedup = final.get("speedup_geomean")
    resumed, steps, seconds = summary.get("resumed_at_step"), summary.get("steps"), summary.get("seconds", 0.0)
    ran = f"{steps} steps (phases {phases or 'none'}), "
    evaluated = summary.get("heldout_end") is not None  # None: no held-out task, or eval.heldout_tasks=0
    if resumed is None:
        ran += f"{seconds:.1f} s with the warm start" + (" and held-out evaluations" if evaluated else "")
    else:  # the warm start and the first held-out evaluation belong to the first run
        ran += f"{steps - resumed} of them in this run, resumed at step {resumed}: {seconds:.1f} s" \
               + (" with the final held-out evaluation" if evaluated else "")
    lines = [
        f"{ran}, verifier "
        f"{'compile-only' if summary.get('verifier_mode') == 'compile_only' else summary.get('verifier_mode')}",
        (f"reward {first_last[0]:.3f} -> {first_last[1]:.3f}; " if None not in first_last else "")
        + f"last step: compile {pct(final.get('compile_rate'))}, correct {pct(final.get('correct_rate'))}, cheat "
        f"{pct(final.get('cheat_rate'))}, speedup {'n/a' if speedup is None else f'{speedup:.2f}x'}; "
        f"{summary.get('groups_dropped_total', 0)} groups dropped (all rewards equal: no advantage)",
    ]
    learned = describe_learning(summary.get("train_start"), summary.get("train_end"))
    if learned:
        lines.append(learned)
    verdicts = final.get("verdicts")
    if verdicts:  # a last line: what the rates above are made of
        lines.append("last step's verdicts: " + ", ".join(f"{k} {n}" for k, n in sorted(verdicts.items(), key=lambda kv: -kv[1])))
    return "\n".join(lines)


def describe_learning(start: dict | None, end: dict | None) -> str | None:
    """One line on the reward of the fixed training prompts at the run's start and end, each phase (None without
    both evaluations), e.g. ``training prompts, reward at start -> end: infill 0.41 -> 0.62 (up), e2e 0.12 -> 0.30
    (up)``."""
    if not start or not end:
        return None
    parts = []
    for phase in (p for p in ("infill", "e2e") if p in start and p in end):
        a, b = start[phase]["reward_mean"], end[phase]["reward_mean"]
        a, b = round(a, 3), round(b, 3)  # the direction of what is printed: 0.4223 -> 0.4220 is "same", not "down"
        parts.append(f"{phase} {a:.3f} -> {b:.3f} ({'up' if b > a else 'down' if b < a else 'same'})")
    return "training prompts, reward at start -> end: " + ", ".join(parts) if parts else None


def describe_outputs(run_dir: Path, tasks_spec: str, heldout: bool) -> str:
    """The run's last console line: what its folder holds, the ``dice-ray eval`` command of its policy (``--split
    heldout`` when tasks were held out: the ones it did not train on) and the ``dice-ray report`` command."""
    return (f"[bold]outputs[/] run directory {run_dir}: config.yaml, metrics.jsonl, summary.json, eval_start.json, "
            f"curves.png, checkpoints/ (each with its policy: dice-ray eval --tasks {escape(shlex.quote(tasks_spec))} "
            + ("--split heldout " if heldout else "")  # the tasks it did not train on
            + f"--model {run_dir}); a Markdown summary and "
            f"plots: dice-ray report {run_dir}")


class StepTable:
    """The step table on ``console``: the verifier's mode line, a header of :data:`COLUMNS`, one row a step, and a
    curriculum decision's line between rows."""

    def __init__(self, console: Console):
        self.console = console
        self._mode: str | None = None
        self._header_due = False

    def header(self) -> None:
        """Ask for the header: printed before the first row, under the verifier's mode line (which the first
        row's record names)."""
        self._header_due = True

    def decision(self, decision) -> None:
        """One line a curriculum decision (:class:`~dice_ray.cluster.scheduler.Decision`), with its figure. The target
        it sets (``infill_target``) is a share of prompts; the table's ``infill`` is the share a step drew."""
        self.console.print(f"[bold]curriculum[/] step {decision.step}: {decision.action}, infill target "
                           f"{decision.infill_fraction:.2f}: {escape(decision.reason)}", highlight=False)

    def row(self, rec: dict) -> None:
        """One row of :data:`COLUMNS` (``infill``: the share of prompts the step drew for infilling; ``drop``: groups
        dropped), after a line naming the verifier's mode whenever it differs from the previous row's."""
        mode = rec["verifier_mode"]
        if mode != self._mode:
            self._mode = mode
            self.console.print("verifier compile-only: compile rate and dry runs, no values or times measured"
                               if mode == "compile_only" else f"verifier {mode}", style="dim", highlight=False)
        if self._header_due:
            self._header_due = False
            self.console.print(" ".join(f"{name:>{w}}" for name, w, _ in COLUMNS), style="bold")
        values = {
            "step": rec["step"], "phase": rec["phase"], "infill": rec["infill_fraction"], "reward": rec["reward_mean"],
            "±std": rec["reward_std"], "compile": rec["compile_rate"], "correct": rec["correct_rate"],
            "cheat": rec["cheat_rate"], "speedup": rec["speedup_geomean"], "drop": rec["groups_dropped"],
            "loss": rec["loss"], "sec": rec["step_seconds"],
        }
        cells = []
        for name, w, fmt in COLUMNS:
            v = values[name]
            cells.append(f"{'n/a' if v is None else fmt.format(v):>{w}}")
        self.console.print(" ".join(cells))

@contextmanager
def waiting(console: Console, what: str) -> Iterator[None]:
    """Say what the run waits for: a spinner with ``what`` on a terminal; elsewhere (a log, ``ray job logs``) the
    line ``what ...`` once, so a log does not go silent while actors start (~10-20 s on a 2-core machine)."""
    if console.is_terminal:
        with console.status(what):
            yield
    else:
        console.print(f"{what} ...")
        yield
