"""The phase scheduler: DICE's BiC-RL curriculum, kernel infilling first, end-to-end after.

DICE (arXiv 2602.11715) trains 20 steps of infilling then 100 end-to-end, prompts ordered from
single operators to fused models, and warns that a transition too abrupt makes the model forget.
dice-ray decides the share of infilling prompts (the *infill fraction*) step by step:

* ``phase.schedule="gated"`` (default): infilling until a measured figure of the recent infilling
  steps (``phase.gate_metric``, mean over ``phase.gate_window`` steps) reaches ``phase.gate_threshold``,
  or at ``phase.infill_steps`` at the latest; then a linear ramp over ``phase.ramp_steps`` down to
  ``phase.final_infill_fraction``. While ramping or end-to-end, when the end-to-end reward (mean over
  the window) falls below ``phase.collapse_ratio`` of its best windowed mean so far, the infill
  fraction goes back up one ramp step and holds until that reward recovers.
* ``phase.schedule="fixed"``: ``phase.infill_steps`` of infilling, then the same ramp (DICE's step counts).

Each change is a :class:`Decision` naming the figure that caused it. Figures reach the scheduler
through :meth:`PhaseSchedule.observe` (the driver posts every step's record); the decision for step
``t`` reads only the figures of steps ``<= t - 1 - lag`` (``lag`` = ``rl.max_staleness``: the steps an
asynchronous run draws ahead), so it does not depend on when a record arrived and a resumed run
decides exactly as the run it continues. Each phase draws its prompts from its own task pool (DICE:
infilling from its infilling file, end-to-end from its end-to-end file; one pool serves both where
the tasks are not split), in curriculum order: levels ascending, shuffled within a level each epoch.

:class:`PhaseSchedule` is the plain logic (tested on its own); :data:`PhaseSchedulerActor` is the
named Ray actor that owns it during a run, so ``dice-ray status`` can read it from outside.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import asdict, dataclass, field

import ray

from dice_ray.config import PhaseConfig

SCHEDULER_NAME = "dice-ray-phase-scheduler"
NAMESPACE = "dice-ray"
PHASES = ("infill", "e2e")


@dataclass(frozen=True)
class PromptRequest:
    """One prompt of a step: which task, which phase ("infill" or "e2e"), and its sampling seed."""

    request_id: str
    task_id: str
    phase: str
    seed: int


@dataclass(frozen=True)
class Decision:
    """A change of the curriculum, with the figure that caused it.

    Attributes:
        step: the RL step whose prompts it first applies to.
        action: ``leave-infill`` (the gate opened), ``ramp-done`` (end-to-end reached), ``collapse`` (the
            end-to-end reward fell: infilling raised and held), ``recover`` (it came back: the ramp goes on),
            ``no-infill`` (no task can be infilled: end-to-end from the start).
        infill_fraction: the infill fraction from this step on.
        reason: one line for the console, e.g. ``compile_rate 0.62 (mean of steps 3-4) >= 0.5``.
        metric, value, threshold: the figure, its value and the bar it was held to (None when a step count decided).
    """

    step: int
    action: str
    infill_fraction: float
    reason: str
    metric: str | None = None
    value: float | None = None
    threshold: float | None = None


@dataclass
class CurriculumState:
    """The curriculum's state when the next step is drawn (a checkpoint saves it; ``--resume`` restores it).

    Attributes:
        stage: ``infill``, ``ramp`` or ``e2e``.
        fraction: the infill fraction of the last step drawn.
        holding: the end-to-end reward collapsed: the fraction holds until it recovers.
        decisions: every :class:`Decision` so far, as dicts.
    """

    stage: str = "infill"
    fraction: float = 1.0
    holding: bool = False
    decisions: list[dict] = field(default_factory=list)


class TaskPool:
    """One phase's tasks in curriculum order: levels ascending, shuffled within a level, reshuffled each epoch.

    Args:
        tasks: ``[(task_id, level), ...]``.
        seed: seeds the shuffles. salt: tells pools of one run apart.
    """

    def __init__(self, tasks: list[tuple[str, int]], seed: int, salt: int):
        self.tasks, self.seed, self.salt = list(tasks), seed, salt
        self.epoch, self.position = 0, 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[str]:
        rng = random.Random((self.seed * 100003 + epoch) * 31 + self.salt)
        return [tid for _, _, tid in sorted((level, rng.random(), tid) for tid, level in self.tasks)]

    def draw(self) -> str:
        """The next task id (a new epoch, reshuffled, after the last)."""
        if self.position >= len(self._order):
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._epoch_order(self.epoch)
        self.position += 1
        return self._order[self.position - 1]

    def get_state(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def set_state(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._epoch_order(self.epoch)


class PhaseSchedule:
    """Decides, per RL step, the infill fraction and which prompts are infilling / end-to-end.

    Args:
        infill_tasks: ``[(task_id, level), ...]`` that can be posed as infilling (a scaffold to cut); may be empty.
        e2e_tasks: ``[(task_id, level), ...]`` posed end-to-end.
        cfg: the :class:`~dice_ray.config.PhaseConfig`.
        prompts_per_step: prompts a step.
        seed: seeds the pools' shuffles and the sampling seeds.
        lag: steps drawn ahead of the newest figures (``rl.max_staleness``); the decision for step ``t`` reads
            the figures of steps ``<= t - 1 - lag``.

    Raises:
        ValueError: no training tasks, or a negative ``lag``.
    """

    def __init__(self, infill_tasks: list[tuple[str, int]], e2e_tasks: list[tuple[str, int]], cfg: PhaseConfig,
                 prompts_per_step: int, seed: int, lag: int = 0):
        if not infill_tasks and not e2e_tasks:
            raise ValueError("phase scheduler: no training tasks")
        if lag < 0:
            raise ValueError(f"phase scheduler: lag={lag} must be >= 0")
        self.cfg, self.prompts_per_step, self.seed, self.lag = cfg, prompts_per_step, seed, lag
        self.pools = {"infill": TaskPool(infill_tasks, seed, 1), "e2e": TaskPool(e2e_tasks, seed, 2)}
        self.step = 0
        self.curriculum = CurriculumState()
        self.figures: dict[int, dict] = {}  # step -> {phase: {metric: value}}, from observe()

    # ---- the figures ------------------------------------------------------------------------------------
    def observe(self, record: dict) -> None:
        """Take a step's figures: ``record["step"]`` and ``record["by_phase"]`` (``{phase: {"reward_mean",
        "compile_rate", "correct_rate", "prompts"}}``, :func:`dice_ray.cluster.step_record.step_record`). A step seen
        before is ignored (a resumed run may post it again)."""
        step, by_phase = record.get("step"), record.get("by_phase")
        if isinstance(step, int) and isinstance(by_phase, dict):
            self.figures.setdefault(step, by_phase)

    def _series(self, before: int, phase: str, metric: str) -> list[tuple[int, float]]:
        """``(step, value)`` of ``metric`` over ``phase``'s prompts, for the visible steps ``< before``."""
        out = []
        for s in sorted(k for k in self.figures if k < before):
            value = (self.figures[s].get(phase) or {}).get(metric)
            if isinstance(value, (int, float)):
                out.append((s, float(value)))
        return out

    def gate_metric(self, before: int) -> str:
        """The figure the gate reads: ``phase.gate_metric``; ``auto``: the infilling correct rate once a GPU
        verifier measures one, else the compile rate."""
        metric = self.cfg.gate_metric
        if metric == "auto":
            metric = "correct_rate" if self._series(before, "infill", "correct_rate") else "compile_rate"
        return metric

    # ---- the curriculum -----------------------------------------------------------------------------------
    @property
    def ramp_delta(self) -> float:
        """How much the infill fraction falls a ramp step."""
        return (1.0 - self.cfg.final_infill_fraction) / (self.cfg.ramp_steps + 1)

    def _decide(self, step: int) -> Decision | None:
        """Advance the curriculum to ``step``; the decision taken, if any."""
        c, cur = self.cfg, self.curriculum
        visible = step - self.lag  # figures of steps < visible
        if cur.stage == "infill":
            if not self.pools["infill"].tasks:
                return self._enter(step, "e2e", c.final_infill_fraction, "no-infill",
                                   "no training task can be posed as infilling")
            if c.schedule == "gated":
                metric = self.gate_metric(visible)
                recent = self._series(visible, "infill", metric)[-c.gate_window:]
                if len(recent) == c.gate_window:
                    value = statistics.fmean(v for _, v in recent)
                    if value >= c.gate_threshold:
                        return self._leave(step, f"{metric} {value:.2f} (mean of steps {recent[0][0]}-{recent[-1][0]}) "
                                                 f">= phase.gate_threshold={c.gate_threshold}", metric, value,
                                           c.gate_threshold)
            if step >= c.infill_steps:
                return self._leave(step, f"phase.infill_steps={c.infill_steps} reached")
            return None
        if c.schedule == "gated" and c.collapse_ratio > 0:
            decision = self._collapse_check(step, visible)
            if decision is not None or cur.holding:
                return decision
        if cur.stage == "ramp":
            fraction = max(c.final_infill_fraction, cur.fraction - self.ramp_delta)
            if fraction <= c.final_infill_fraction + 1e-9:
                return self._enter(step, "e2e", c.final_infill_fraction, "ramp-done",
                                   f"infill fraction down to phase.final_infill_fraction={c.final_infill_fraction}")
            cur.fraction = fraction
        return None

    def _collapse_check(self, step: int, visible: int) -> Decision | None:
        """Hold or raise infilling while the end-to-end reward has collapsed (windowed mean below
        ``collapse_ratio`` of its best windowed mean so far); release it when the reward recovers."""
        c, cur = self.cfg, self.curriculum
        series = [v for _, v in self._series(visible, "e2e", "reward_mean")]
        if len(series) < c.gate_window:
            return None
        means = [statistics.fmean(series[i - c.gate_window:i]) for i in range(c.gate_window, len(series) + 1)]
        now, best = means[-1], max(means)
        bar = c.collapse_ratio * best
        if not cur.holding and best > 0 and now < bar:
            cur.holding = True
            fraction = min(1.0, cur.fraction + self.ramp_delta)
            return self._enter(step, "ramp", fraction, "collapse",
                               f"e2e reward_mean {now:.2f} < phase.collapse_ratio={c.collapse_ratio} x best {best:.2f}",
                               "e2e_reward_mean", now, bar)
        if cur.holding and now >= bar:
            cur.holding = False
            return self._record(Decision(step, "recover", cur.fraction, f"e2e reward_mean {now:.2f} >= "
                                         f"{c.collapse_ratio} x best {best:.2f}: the ramp goes on",
                                         "e2e_reward_mean", now, bar))
        return None

    def _leave(self, step: int, reason: str, metric: str | None = None, value: float | None = None,
               threshold: float | None = None) -> Decision:
        if self.cfg.ramp_steps == 0:
            return self._enter(step, "e2e", self.cfg.final_infill_fraction, "leave-infill", reason, metric, value,
                               threshold)
        return self._enter(step, "ramp", 1.0 - self.ramp_delta, "leave-infill", reason, metric, value, threshold)

    def _enter(self, step: int, stage: str, fraction: float, action: str, reason: str, metric: str | None = None,
               value: float | None = None, threshold: float | None = None) -> Decision:
        self.curriculum.stage, self.curriculum.fraction = stage, fraction
        return self._record(Decision(step, action, fraction, reason, metric, value, threshold))

    def _record(self, decision: Decision) -> Decision:
        self.curriculum.decisions.append(asdict(decision))
        return decision

    # ---- the batches ------------------------------------------------------------------------------------
    def next_batch(self) -> StepPlan:
        """The next step's prompts; advances the step, the curriculum and the pools' positions.

        The first ``round(fraction * prompts_per_step)`` prompts are infilling (none without infilling tasks),
        the rest end-to-end; each drawn from its phase's pool (the other pool when one is empty).
        """
        step = self.step
        decision = self._decide(step)
        target = self.curriculum.fraction if self.pools["infill"].tasks else 0.0
        n_infill = round(target * self.prompts_per_step) if self.pools["e2e"].tasks else self.prompts_per_step
        requests = []
        for i in range(self.prompts_per_step):
            phase = "infill" if i < n_infill else "e2e"
            requests.append(PromptRequest(f"s{step}-p{i}", self.pools[phase].draw(), phase,
                                          self.seed * 1_000_003 + step * 1000 + i))
        self.step += 1
        return StepPlan(step, target, self.curriculum.stage, requests, decision)

    def get_state(self) -> dict:
        """A JSON-able snapshot for checkpoints and ``dice-ray status``: the step, the pools' positions, the
        curriculum (stage, infill fraction, holding, decisions) and the figures observed."""
        return {"step": self.step, "pools": {p: pool.get_state() for p, pool in self.pools.items()},
                "curriculum": asdict(self.curriculum), "figures": {str(k): v for k, v in self.figures.items()},
                "phase": self.curriculum.stage, "infill_fraction": self.curriculum.fraction}

    def set_state(self, state: dict) -> None:
        """Restore a snapshot taken by :meth:`get_state` (resume).

        Raises:
            KeyError: a snapshot without the keys :meth:`get_state` writes (a checkpoint of an older dice-ray).
        """
        self.step = state["step"]
        for phase, pool in self.pools.items():
            pool.set_state(state["pools"][phase])
        self.curriculum = CurriculumState(**state["curriculum"])
        self.figures = {int(k): v for k, v in state["figures"].items()}


@dataclass(frozen=True)
class StepPlan:
    """One step as the scheduler drew it.

    Attributes:
        step: the RL step.
        infill_target: the curriculum's infill fraction (the share actually sampled is the share of ``requests``
            whose phase is ``infill``: they differ by rounding, or when no task can be infilled).
        stage: ``infill``, ``ramp`` or ``e2e``.
        requests: the step's prompts.
        decision: the curriculum change made for this step, if any (:class:`Decision`).
    """

    step: int
    infill_target: float
    stage: str
    requests: list[PromptRequest]
    decision: Decision | None = None

    @property
    def infill_fraction(self) -> float:
        """The share of the step's prompts that are infilling."""
        return sum(r.phase == "infill" for r in self.requests) / max(len(self.requests), 1)


@ray.remote(num_cpus=0)
class PhaseSchedulerActor:
    """Named Ray actor owning a :class:`PhaseSchedule` for the run (``dice-ray status`` reads it).

    ``resuming``: the run restores a checkpoint; until :meth:`set_state` its status says so (``restoring``)
    instead of showing the fresh schedule's step 0.
    """

    def __init__(self, infill_tasks: list[tuple[str, int]], e2e_tasks: list[tuple[str, int]], cfg: PhaseConfig,
                 prompts_per_step: int, seed: int, lag: int = 0, resuming: bool = False):
        self.schedule = PhaseSchedule(infill_tasks, e2e_tasks, cfg, prompts_per_step, seed, lag)
        self.last_report: dict = {}
        self.restoring = resuming

    def next_batch(self) -> StepPlan:
        return self.schedule.next_batch()

    def get_state(self) -> dict:
        return self.schedule.get_state()

    def set_state(self, state: dict) -> None:
        self.schedule.set_state(state)
        self.restoring = False

    def observe(self, record: dict) -> None:
        """A step's figures for the curriculum (:meth:`PhaseSchedule.observe`), posted before its checkpoint so that
        the checkpoint's curriculum state holds them."""
        self.schedule.observe(record)

    def report(self, record: dict) -> None:
        """A finished step's whole record (times included): ``dice-ray status`` shows it; its figures feed the
        curriculum if :meth:`observe` did not have them yet."""
        self.schedule.observe(record)
        self.last_report = record

    def status(self) -> dict:
        state = self.schedule.get_state()
        state.pop("figures")
        decisions = state["curriculum"]["decisions"]
        return {"schedule": state, "last_decision": decisions[-1] if decisions else None,
                "last_step": self.last_report, "restoring": self.restoring}
