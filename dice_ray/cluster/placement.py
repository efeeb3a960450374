"""Where the actors of a run's roles go: the Ray placement groups of the learner's ranks, the rollout workers and the
verifiers (``cluster.placement``, ``cluster.colocate_rollout``, ``cluster.placement_timeout_s``).

- **Learner ranks**: one group, a bundle ``{"GPU": cluster.learner_gpus}`` a rank, always PACK (as few nodes as
  possible: the ranks' gradient reductions). Reserved first, so the whole GPUs it asks are taken before the other
  roles' fractions.
- **Rollout workers**: one group, a bundle ``{"GPU": cluster.rollout_gpus, "CPU": 1}`` a worker, PACK or SPREAD by
  ``cluster.placement``. A worker is scheduled into its own bundle (Ray's ``PlacementGroupSchedulingStrategy`` with
  its bundle index), so Ray restarts a crashed worker in the same bundle: a restart never moves it.
- **Colocated** (``cluster.colocate_rollout``): no rollout group. Worker i goes in the learner's bundle
  ``i mod learner_ranks`` and asks ``rollout_gpus`` of it; each rank asks what its workers leave
  (:attr:`~dice_ray.config.ClusterConfig.colocated_learner_share`), so the shares sum within the bundle and both
  sit on the rank's GPU. The learner frees that GPU while its workers sample (:mod:`dice_ray.cluster.offload`).
- **Verifiers**: the pool resizes at run time and a Ray placement group cannot grow or shrink, so a verifier slot
  gets a group of its own, one bundle ``{"GPU": cluster.verifier_gpus, "CPU": 1}``, made with the slot and removed
  when it retires (:class:`~dice_ray.cluster.verifier_pool.VerifierPool`). That is ``pack``. For ``spread`` there is
  no group: Ray scores a group's lone bundle by best fit under every strategy (its bundle scheduling policies use a
  least-resource scorer for the first bundle whatever the strategy, ``src/ray/raylet/scheduling/policy/
  bundle_scheduling_policy.{h,cc}``), so groups of one bundle pile onto the fullest node that fits, PACK or SPREAD
  alike; the verifier actor asks Ray's own ``"SPREAD"`` actor scheduling strategy instead, which deals actors over
  the nodes that fit. A verifier is one actor and Ray places an actor's resources on one node, so it never
  straddles nodes either way.
- **No GPU** (a role on CPU, or no GPU in the cluster): no group, the actor asks ``num_gpus=0`` as before (with
  ``spread``, Ray's ``"SPREAD"`` actor strategy); ``dice-ray train`` on a laptop asks Ray for what it always did.

Every group the trainer makes is awaited (``ready``) for ``cluster.placement_timeout_s``; one that cannot be placed
by then is removed and raises :class:`PlacementTimeout`, naming the role, its bundles, the strategy and the
cluster's total and free resources.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from dice_ray.config import DiceConfig

PLACEMENT_TIMEOUT_S = 900.0
"""Default wait (s) for a placement group where no config gives ``cluster.placement_timeout_s`` (``dice-ray sft``'s
ranks, a pool made without a cluster config)."""
STRATEGIES = {"pack": "PACK", "spread": "SPREAD"}
"""Ray's strategy of the rollout workers' group (and the verifiers' scheduling) for each ``cluster.placement``."""


class PlacementTimeout(RuntimeError):
    """A role's placement group was not placed in time; the message names the role, its bundles, the strategy and
    the cluster's total and free resources."""


def _resources(res: dict) -> str:
    keep = {k: v for k, v in res.items() if k in ("CPU", "GPU") or k.startswith("accelerator_type")}
    return ", ".join(f"{k} {v:g}" for k, v in sorted(keep.items())) or "none"


def unplaced(role: str, bundles: list[dict], strategy: str, timeout_s: float) -> PlacementTimeout:
    """The error of ``role``'s request (``bundles`` under ``strategy``) not placed within ``timeout_s`` seconds, with
    the cluster's total and free resources (read now)."""
    shown = bundles if len(bundles) <= 4 else f"{len(bundles)} x {bundles[0]}"
    return PlacementTimeout(
        f"{role}: no placement for {shown} ({strategy}) within {timeout_s:g} s (cluster.placement_timeout_s); the "
        f"cluster has {_resources(ray.cluster_resources())}, free {_resources(ray.available_resources())}: give it "
        "more GPUs or nodes, or ask less (cluster.*_gpus, learner_ranks, num_rollout_workers, num_verifiers)")


def reserve(role: str, bundles: list[dict], strategy: str, timeout_s: float) -> PlacementGroup:
    """A placement group of ``bundles`` under ``strategy`` (Ray's ``PACK``, ``SPREAD``, ...), awaited until placed.

    Args:
        role: names the role in the error.
        bundles: one resource dict a bundle (``{"GPU": 1}``).
        strategy: Ray's placement strategy.
        timeout_s: how long to wait for Ray to place every bundle (s).

    Returns:
        the placed group.

    Raises:
        PlacementTimeout: not placed within ``timeout_s`` (the group is removed first).
    """
    group = placement_group(bundles, strategy=strategy)
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        raise unplaced(role, bundles, strategy, timeout_s) from None
    return group


@dataclass
class RolePlacement:
    """How the actors of one role are placed: a placement group (or none) and each actor's Ray options.

    Attributes:
        role: the role's name (``learner``, ``rollout``, ``verifier``), for errors and the start-up line.
        gpus: GPUs each actor asks (``num_gpus``).
        cpus: CPUs each actor asks (``num_cpus``), one per actor.
        group: the placement group the actors go in; None: plain actors.
        bundle_of: each actor's bundle index in ``group``.
        bundles: the group's bundles (empty without a group).
        strategy: the group's strategy, or with no group Ray's actor scheduling strategy (``"SPREAD"``) or None
            (Ray's default).
        owned: ``remove`` removes the group (False for colocated rollout workers: the group is the learner's).
    """

    role: str
    gpus: list[float]
    cpus: list[float]
    group: PlacementGroup | None = None
    bundle_of: list[int] = field(default_factory=list)
    bundles: list[dict] = field(default_factory=list)
    strategy: str | None = None
    owned: bool = True

    @property
    def colocated(self) -> bool:
        """The actors sit in another role's group (the learner's)."""
        return self.group is not None and not self.owned

    def options(self, i: int) -> dict:
        """Ray ``.options(...)`` of actor ``i``: its GPU and CPU asks, in its bundle when there is a group.

        Raises:
            IndexError: ``i`` is not an actor of the role.
        """
        opts: dict = {"num_gpus": self.gpus[i], "num_cpus": self.cpus[i]}
        if self.group is not None:
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                self.group, placement_group_bundle_index=self.bundle_of[i])
        elif self.strategy is not None:
            opts["scheduling_strategy"] = self.strategy
        return opts

    def remove(self) -> None:
        """Remove the group if this role owns it (its actors still in it are killed by Ray); idempotent."""
        if self.group is not None and self.owned:
            remove_placement_group(self.group)
            self.owned = False

    def describe(self) -> str:
        """``2 x 1 GPU, PACK group`` and the like, for the start-up line."""
        n = len(self.gpus)
        ask = f"{self.gpus[0]:g} GPU" if n and self.gpus[0] else "CPU"
        if self.colocated:
            return f"{n} x {ask} in the learner's bundles (colocated)"
        if self.group is not None:
            return f"{n} x {ask}, {self.strategy} group"
        return f"{n} x {ask}" + (f", {self.strategy} scheduling" if self.strategy else "")


def learner_placement(cfg: DiceConfig, use_gpu: bool, timeout_s: float | None = None) -> RolePlacement:
    """The learner ranks' placement: on GPUs one PACK group (a bundle of ``cluster.learner_gpus`` a rank; each rank
    asks all of it, or with ``cluster.colocate_rollout`` what its rollout workers leave), awaited; on CPU plain
    actors asking no GPU.

    Raises:
        ValueError: ``use_gpu`` with ``cluster.learner_gpus`` of 0.
        PlacementTimeout: the group was not placed within ``timeout_s`` (default ``cluster.placement_timeout_s``).
    """
    c = cfg.cluster
    n = c.learner_ranks
    if not use_gpu:
        return RolePlacement("learner", [0.0] * n, [0.0] * n)
    if not c.learner_gpus:
        raise ValueError("cluster.learner_gpus must be > 0 for a GPU learner")
    bundles = [{"GPU": c.learner_gpus} for _ in range(n)]
    group = reserve("learner", bundles, "PACK", c.placement_timeout_s if timeout_s is None else timeout_s)
    share = c.colocated_learner_share if c.colocate_rollout else c.learner_gpus
    return RolePlacement("learner", [share] * n, [0.0] * n, group, list(range(n)), bundles, "PACK")


def rollout_placement(cfg: DiceConfig, on_gpu: bool, learner: RolePlacement,
                      timeout_s: float | None = None) -> RolePlacement:
    """The rollout workers' placement (see the module docstring).

    Args:
        cfg: the run's config (``cluster.num_rollout_workers``, ``rollout_gpus``, ``placement``,
            ``colocate_rollout``).
        on_gpu: the cluster has GPUs (else every worker runs on CPU).
        learner: the learner's placement (:func:`learner_placement`), whose bundles colocated workers share.
        timeout_s: wait for the workers' own group (default ``cluster.placement_timeout_s``).

    Raises:
        PlacementTimeout: the workers' group was not placed in time.
    """
    c = cfg.cluster
    n = c.num_rollout_workers
    if on_gpu and c.colocate_rollout and learner.group is not None:
        ranks = len(learner.bundles)
        return RolePlacement("rollout", [c.rollout_gpus] * n, [0.0] * n, learner.group, [i % ranks for i in range(n)],
                             learner.bundles, learner.strategy, owned=False)
    if not (on_gpu and c.rollout_gpus > 0):
        return RolePlacement("rollout", [0.0] * n, [0.0] * n,
                             strategy="SPREAD" if c.placement == "spread" else None)
    strategy = STRATEGIES[c.placement]
    bundles = [{"GPU": c.rollout_gpus, "CPU": 1} for _ in range(n)]
    group = reserve("rollout workers", bundles, strategy, c.placement_timeout_s if timeout_s is None else timeout_s)
    return RolePlacement("rollout", [c.rollout_gpus] * n, [1.0] * n, group, list(range(n)), bundles, strategy)


def verifier_placement(gpus: float, placement: str) -> RolePlacement:
    """One verifier slot's placement (``placement``: ``cluster.placement``): with ``gpus`` > 0 and ``pack`` a new
    group of one bundle ``{"GPU": gpus, "CPU": 1}`` (not awaited: the pool awaits it without blocking its loop,
    ``group.ready()``, and removes it when the slot retires); with ``spread`` no group and Ray's ``"SPREAD"`` actor
    strategy (why: the module docstring); CPU verifiers ask for nothing (with ``spread``, ``"SPREAD"``).

    Raises:
        ValueError: ``placement`` is not ``pack`` or ``spread``.
    """
    if placement not in STRATEGIES:
        raise ValueError(f"cluster.placement must be 'pack' or 'spread', got {placement!r}")
    if gpus > 0 and placement == "pack":
        bundles = [{"GPU": gpus, "CPU": 1}]
        return RolePlacement("verifier", [gpus], [1.0], placement_group(bundles, strategy="PACK"), [0], bundles, "PACK")
    spread = "SPREAD" if placement == "spread" else None
    return RolePlacement("verifier", [gpus], [1.0 if gpus > 0 else 0.0], strategy=spread)


def describe(learner: RolePlacement, rollout: RolePlacement, verifier_gpus: float, placement: str) -> str:
    """The start-up line's text: each role's asks and groups."""
    if verifier_gpus <= 0:
        ver = "CPU"
    elif placement == "pack":
        ver = f"{verifier_gpus:g} GPU, a PACK group each"
    else:
        ver = f"{verifier_gpus:g} GPU, SPREAD scheduling"
    return (f"learner {learner.describe()}; rollout {rollout.describe()}; verifiers {ver}"
            + ("; the learner's states go to CPU memory while the rollout workers sample" if rollout.colocated else ""))
