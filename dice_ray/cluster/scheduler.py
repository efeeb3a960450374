"""The phase scheduler: DICE's BiC-RL curriculum, kernel infilling first, end-to-end after.

DICE (arXiv 2602.11715) trains 20 steps of infilling then 100 end-to-end, prompts ordered from
single operators to fused models. dice-ray moves between the phases with a linear ramp of the
infill fraction (no abrupt switch) and owns the data order, so a resumed run sees the same prompts.

:class:`PhaseSchedule` is the plain logic (tested on its own); :data:`PhaseSchedulerActor` is the
named Ray actor that owns it during a run, so ``dice-ray status`` can read it from outside.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

import ray

from dice_ray.config import PhaseConfig

SCHEDULER_NAME = "dice-ray-phase-scheduler"
NAMESPACE = "dice-ray"


@dataclass(frozen=True)
class PromptRequest:
    """One prompt of a step: which task, which phase ("infill" or "e2e"), and its sampling seed."""

    request_id: str
    task_id: str
    phase: str
    seed: int


@dataclass
class ScheduleState:
    """Everything needed to resume the curriculum exactly: step, data position, epoch."""

    step: int = 0
    epoch: int = 0
    position: int = 0


class PhaseSchedule:
    """Decides, per RL step, the infill fraction and which prompts are infill / end-to-end.

    Args:
        task_ids: training tasks as ``[(task_id, level, can_infill), ...]``; a task without an infill
            scaffold (no reference solution) is always prompted end-to-end.
        cfg: the :class:`~dice_ray.config.PhaseConfig`.
        prompts_per_step: prompts a step.
        seed: seeds the per-epoch shuffle (within a level; levels go in order: the curriculum).

    Raises:
        ValueError: no training tasks.
    """

    def __init__(self, task_ids: list[tuple[str, int, bool]], cfg: PhaseConfig, prompts_per_step: int, seed: int):
        if not task_ids:
            raise ValueError("phase scheduler: no training tasks")
        self.task_ids = [(tid, level) for tid, level, _ in task_ids]
        self.can_infill = {tid: ok for tid, _, ok in task_ids}
        self.cfg = cfg
        self.prompts_per_step = prompts_per_step
        self.seed = seed
        self.state = ScheduleState()
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[str]:
        rng = random.Random(self.seed * 100003 + epoch)
        keyed = [(level, rng.random(), tid) for tid, level in self.task_ids]
        return [tid for _, _, tid in sorted(keyed)]

    def infill_fraction(self, step: int) -> float:
        """Share of a step's prompts that are infilling, in [0, 1]: 1 for ``infill_steps``, then a
        linear ramp over ``ramp_steps`` down to ``final_infill_fraction``."""
        c = self.cfg
        if step < c.infill_steps:
            return 1.0
        if c.ramp_steps == 0:
            return c.final_infill_fraction
        t = min(1.0, (step - c.infill_steps + 1) / (c.ramp_steps + 1))
        return 1.0 + t * (c.final_infill_fraction - 1.0)

    def phase_name(self, step: int) -> str:
        """"infill", "ramp" or "e2e" for ``step``."""
        f = self.infill_fraction(step)
        if f >= 1.0:
            return "infill"
        if step >= self.cfg.infill_steps + self.cfg.ramp_steps:
            return "e2e"
        return "ramp"

    def next_batch(self) -> tuple[int, float, str, list[PromptRequest]]:
        """The next step's prompts; advances the step and the data position.

        Returns:
            (step, infill fraction, phase name, requests). The first ``round(f * prompts_per_step)`` requests
            are infilling, the rest end-to-end.
        """
        step = self.state.step
        frac = self.infill_fraction(step)
        n_infill = round(frac * self.prompts_per_step)
        requests = []
        for i in range(self.prompts_per_step):
            if self.state.position >= len(self._order):
                self.state.epoch += 1
                self.state.position = 0
                self._order = self._epoch_order(self.state.epoch)
            tid = self._order[self.state.position]
            self.state.position += 1
            phase = "infill" if i < n_infill and self.can_infill[tid] else "e2e"
            requests.append(
                PromptRequest(
                    request_id=f"s{step}-p{i}", task_id=tid, phase=phase, seed=self.seed * 1_000_003 + step * 1000 + i
                )
            )
        self.state.step += 1
        return step, frac, self.phase_name(step), requests

    def get_state(self) -> dict:
        """A JSON-able snapshot for checkpoints and ``dice-ray status``."""
        step = self.state.step
        return {**asdict(self.state), "infill_fraction": self.infill_fraction(step), "phase": self.phase_name(step)}

    def set_state(self, state: dict) -> None:
        """Restore a snapshot taken by :meth:`get_state` (resume)."""
        self.state = ScheduleState(step=state["step"], epoch=state["epoch"], position=state["position"])
        self._order = self._epoch_order(self.state.epoch)


@ray.remote(num_cpus=0)
class PhaseSchedulerActor:
    """Named Ray actor owning a :class:`PhaseSchedule` for the run (``dice-ray status`` reads it).

    ``resuming``: the run restores a checkpoint; until :meth:`set_state` its status says so (``restoring``)
    instead of showing the fresh schedule's step 0.
    """

    def __init__(self, task_ids: list[tuple[str, int, bool]], cfg: PhaseConfig, prompts_per_step: int, seed: int,
                 resuming: bool = False):
        self.schedule = PhaseSchedule(task_ids, cfg, prompts_per_step, seed)
        self.last_report: dict = {}
        self.restoring = resuming

    def next_batch(self):
        return self.schedule.next_batch()

    def get_state(self) -> dict:
        return self.schedule.get_state()

    def set_state(self, state: dict) -> None:
        self.schedule.set_state(state)
        self.restoring = False

    def report(self, metrics: dict) -> None:
        """The driver posts each step's metrics here, for ``dice-ray status``."""
        self.last_report = metrics

    def status(self) -> dict:
        return {"schedule": self.schedule.get_state(), "last_step": self.last_report, "restoring": self.restoring}
