"""Placement of the roles (:mod:`dice_ray.cluster.placement`, issue 42 section 3): the config keys and their checks,
then a real Ray cluster of two fake nodes with 2 GPUs each (``ray.cluster_utils.Cluster``: GPUs declared, none
touched; every actor here is a probe or a compile-only verifier, none makes a CUDA context) where the groups are built
from the config, the actors land in their bundles, PACK and SPREAD differ, a request that cannot be placed fails with
the role named, restarts keep their bundle, the verifier pool makes and removes a group a slot, and shutdown removes
every group."""

from __future__ import annotations

import time

import pytest
from pydantic import ValidationError

from dice_ray.config import DiceConfig, load_config

# ---- the config ------------------------------------------------------------------------------------------------


def test_placement_is_pack_unless_spread_is_asked():
    c = DiceConfig().cluster
    assert (c.placement, c.colocate_rollout, c.placement_timeout_s) == ("pack", False, 900.0)
    assert load_config(None, ["cluster.placement=spread"]).cluster.placement == "spread"
    with pytest.raises(ValidationError, match="cluster.placement"):
        load_config(None, ["cluster.placement=ring"])
    with pytest.raises(ValidationError, match="placement_timeout_s"):
        load_config(None, ["cluster.placement_timeout_s=0"])


COLOCATED = ["cluster.colocate_rollout=true", "cluster.learner_gpus=1", "cluster.rollout_gpus=0.25"]


@pytest.mark.parametrize("overrides, says", [
    (["cluster.colocate_rollout=true"], "needs cluster.learner_gpus > 0 and cluster.rollout_gpus > 0"),
    (["cluster.colocate_rollout=true", "cluster.learner_gpus=1"], "rollout_gpus=0"),
    (["cluster.colocate_rollout=true", "cluster.learner_gpus=2", "cluster.rollout_gpus=0.5"], "learner_gpus <= 1"),
    ([*COLOCATED, "cluster.rollout_gpus=0.5", "cluster.num_rollout_workers=2"],
     r"2 rollout worker\(s\) a learner bundle .* x cluster.rollout_gpus=0.5 = 1 must stay below cluster.learner_gpus=1"),
    ([*COLOCATED, "rl.max_staleness=1"], "needs rl.max_staleness=0"),
    ([*COLOCATED, "model.dtype=bfloat16"], "zero_stage=0 needs model.dtype=float32"),
])
def test_colocation_refuses_what_cannot_share_a_gpu(overrides, says):
    with pytest.raises(ValidationError, match=says):
        load_config(None, overrides)


def test_colocated_shares_sum_within_the_learners_bundle():
    c = load_config(None, [*COLOCATED, "cluster.num_rollout_workers=3", "cluster.learner_ranks=2"]).cluster
    assert c.colocated_rollouts_per_rank == 2 and c.colocated_learner_share == 0.5
    # rounded down to Ray's 1e-4: 1 - 3 x 0.1 is 0.7 in floats a hair over or under, never above the bundle
    c = load_config(None, [*COLOCATED, "cluster.rollout_gpus=0.1", "cluster.num_rollout_workers=3"]).cluster
    assert c.colocated_learner_share == 0.7 and c.colocated_learner_share + 3 * 0.1 <= 1.0 + 1e-9
    # accepted with ZeRO >= 1 in bf16 (DeepSpeed offloads its own master copies there)
    load_config(None, [*COLOCATED, "model.dtype=bfloat16", "cluster.zero_stage=2"])


# ---- a Ray cluster of two fake 2-GPU nodes -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_nodes():
    """Two Ray nodes on this machine, 2 CPUs and 2 (declared) GPUs each; yields ``ray``."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 2, "include_dashboard": False})
    cluster.add_node(num_cpus=2, num_gpus=2)
    ray.init(address=cluster.address, namespace="dice-ray-test-placement", log_to_driver=False)
    cluster.wait_for_nodes()
    yield ray
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture
def nodes(two_nodes):
    """``two_nodes`` for one test, with every group it left behind removed after it (a failing test leaks none into
    the next)."""
    yield two_nodes
    from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group

    for hex_id, group in placement_group_table().items():
        if group["state"] != "REMOVED":
            remove_placement_group(PlacementGroup(two_nodes.PlacementGroupID(bytes.fromhex(hex_id))))


def _probe_class(ray):
    @ray.remote(num_cpus=0)
    class Probe:
        """Says where it runs; touches no GPU."""

        def where(self) -> tuple[str, tuple, int]:
            import os

            return ray.get_runtime_context().get_node_id(), tuple(ray.get_gpu_ids()), os.getpid()

    return Probe


def _nodes_of(group) -> list[str]:
    from ray.util.placement_group import placement_group_table

    table = placement_group_table(group)
    return [table["bundles_to_node_id"][i] for i in range(len(table["bundles"]))]


def _state(group) -> str:
    from ray.util.placement_group import placement_group_table

    return placement_group_table(group)["state"]


def _all_free(ray, timeout_s: float = 60.0) -> None:
    """Wait until every GPU and CPU is free again (a removed group gives its resources back asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        free = ray.available_resources()
        if free.get("GPU", 0) == 4 and free.get("CPU", 0) == 4:
            return
        time.sleep(0.2)
    raise AssertionError(f"resources still taken: {ray.available_resources()}")


def _cfg(*overrides: str) -> DiceConfig:
    return load_config(None, ["cluster.placement_timeout_s=60", *overrides])


@pytest.mark.slow
@pytest.mark.parametrize("mode, strategy, n_nodes", [("pack", "PACK", 1), ("spread", "SPREAD", 2)])
def test_rollout_workers_land_in_their_bundles_packed_or_spread(nodes, mode, strategy, n_nodes):
    from dice_ray.cluster.placement import learner_placement, rollout_placement

    ray = nodes
    _all_free(ray)
    cfg = _cfg(f"cluster.placement={mode}", "cluster.rollout_gpus=1", "cluster.num_rollout_workers=2")
    learner = learner_placement(cfg, use_gpu=False)  # a CPU learner: no group, nothing asked
    assert learner.group is None and learner.options(0) == {"num_gpus": 0.0, "num_cpus": 0.0}
    rollout = rollout_placement(cfg, on_gpu=True, learner=learner)
    assert rollout.bundles == [{"GPU": 1.0, "CPU": 1}] * 2 and rollout.strategy == strategy
    assert _state(rollout.group) == "CREATED"
    probe = _probe_class(ray)
    actors = [probe.options(**rollout.options(i)).remote() for i in range(2)]
    where = ray.get([a.where.remote() for a in actors], timeout=60)
    bundle_nodes = _nodes_of(rollout.group)
    assert [w[0] for w in where] == bundle_nodes, "each worker sits on its own bundle's node"
    assert len(set(bundle_nodes)) == n_nodes
    assert all(len(w[1]) == 1 for w in where) and len({(w[0], w[1]) for w in where}) == 2, "one GPU each, not shared"
    rollout.remove()
    assert _state(rollout.group) == "REMOVED"
    with pytest.raises(ray.exceptions.RayActorError):  # its actors go with it
        ray.get(actors[0].where.remote(), timeout=60)


@pytest.mark.slow
def test_colocated_workers_share_their_learner_ranks_gpus(nodes):
    from dice_ray.cluster.placement import learner_placement, rollout_placement

    ray = nodes
    _all_free(ray)
    cfg = _cfg(*COLOCATED, "cluster.learner_ranks=2", "cluster.num_rollout_workers=3")
    learner = learner_placement(cfg, use_gpu=True)
    assert learner.bundles == [{"GPU": 1.0}] * 2 and learner.strategy == "PACK"
    assert len(set(_nodes_of(learner.group))) == 1, "the learner's ranks pack onto one node"
    rollout = rollout_placement(cfg, on_gpu=True, learner=learner)
    assert rollout.colocated and rollout.group is learner.group and rollout.bundle_of == [0, 1, 0]
    assert learner.gpus == [0.5, 0.5] and rollout.gpus == [0.25] * 3  # 0.5 + 2 x 0.25 = the bundle's 1 GPU
    probe = _probe_class(ray)
    ranks = [probe.options(**learner.options(i)).remote() for i in range(2)]
    workers = [probe.options(**rollout.options(i)).remote() for i in range(3)]
    at_rank = ray.get([a.where.remote() for a in ranks], timeout=60)
    at_worker = ray.get([a.where.remote() for a in workers], timeout=60)
    assert at_rank[0][:2] != at_rank[1][:2], "the two ranks hold different GPUs"
    for i, w in enumerate(at_worker):
        assert w[:2] == at_rank[i % 2][:2], f"worker {i} shares rank {i % 2}'s node and GPU"
    rollout.remove()  # the group is the learner's: the workers' placement leaves it
    assert _state(learner.group) == "CREATED"
    learner.remove()
    assert _state(learner.group) == "REMOVED"


@pytest.mark.slow
def test_a_restarted_worker_comes_back_in_its_bundle(nodes):
    from dice_ray.cluster.placement import learner_placement, rollout_placement

    ray = nodes
    _all_free(ray)
    cfg = _cfg("cluster.placement=spread", "cluster.rollout_gpus=1", "cluster.num_rollout_workers=2")
    rollout = rollout_placement(cfg, on_gpu=True, learner=learner_placement(cfg, use_gpu=False))
    worker = _probe_class(ray).options(**rollout.options(1), max_restarts=1).remote()
    node, gpus, pid = ray.get(worker.where.remote(), timeout=60)
    ray.kill(worker, no_restart=False)
    deadline = time.monotonic() + 120
    again = (node, gpus, pid)
    while again[2] == pid:  # the kill lands asynchronously: wait for the new process
        assert time.monotonic() < deadline, "the worker did not come back"
        try:
            again = ray.get(worker.where.remote(), timeout=30)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            time.sleep(0.2)
    assert again[:2] == (node, gpus) and node == _nodes_of(rollout.group)[1]
    rollout.remove()


@pytest.mark.slow
@pytest.mark.parametrize("overrides, role, strategy", [
    (["cluster.rollout_gpus=1", "cluster.num_rollout_workers=5"], "rollout workers", "PACK"),
    (["cluster.rollout_gpus=1", "cluster.num_rollout_workers=5", "cluster.placement=spread"], "rollout workers",
     "SPREAD"),
    (["cluster.learner_gpus=2", "cluster.learner_ranks=3"], "learner", "PACK"),
])
def test_a_request_that_cannot_be_placed_names_the_role(nodes, overrides, role, strategy):
    from ray.util.placement_group import placement_group_table

    from dice_ray.cluster.placement import PlacementTimeout, learner_placement, rollout_placement

    ray = nodes
    _all_free(ray)
    cfg = load_config(None, ["cluster.placement_timeout_s=2", "cluster.num_rollout_workers=1", *overrides])
    learner = None
    with pytest.raises(PlacementTimeout) as err:
        learner = learner_placement(cfg, use_gpu=bool(cfg.cluster.learner_gpus))
        rollout_placement(cfg, on_gpu=True, learner=learner)
    msg = str(err.value)
    assert msg.startswith(f"{role}: no placement for ") and f"({strategy}) within 2 s (cluster.placement_timeout_s)" in msg
    assert "the cluster has CPU 4, GPU 4, free CPU" in msg
    assert "'GPU'" in msg
    if learner is not None:
        learner.remove()
    assert all(g["state"] == "REMOVED" for g in placement_group_table().values()), "a group left behind"


@pytest.mark.slow
def test_trainer_shutdown_removes_the_groups(nodes, tmp_path):
    from dice_ray.cluster.placement import learner_placement, rollout_placement
    from dice_ray.cluster.trainer import Trainer

    ray = nodes
    _all_free(ray)
    for overrides in (["cluster.rollout_gpus=0.5", "cluster.learner_gpus=1"], [*COLOCATED]):
        cfg = _cfg(*overrides)
        trainer = Trainer(cfg, tmp_path / "run")
        trainer.learner_placement = learner_placement(cfg, use_gpu=True)
        trainer.rollout_placement = rollout_placement(cfg, on_gpu=True, learner=trainer.learner_placement)
        groups = {trainer.learner_placement.group, trainer.rollout_placement.group}
        assert len(groups) == (1 if cfg.cluster.colocate_rollout else 2)
        trainer.shutdown()  # a set-up stopped after the placements: no actor yet
        assert all(_state(g) == "REMOVED" for g in groups)
        _all_free(ray)


# ---- the verifier pool: a group a slot ---------------------------------------------------------------------------


@pytest.mark.slow
def test_verifier_slots_make_and_remove_their_groups(nodes):
    """pack: a one-bundle group a GPU verifier, made with the slot, removed when it retires and when the pool closes; a
    slot that cannot be placed fails naming it (compile-only verifiers: no CUDA here, though Ray grants them GPUs)."""
    from ray.util.placement_group import placement_group_table

    from _helpers import wait_for_pool
    from dice_ray.cluster.verifier_pool import VerifierPool
    from dice_ray.config import ClusterConfig, RewardConfig, VerifyConfig

    ray = nodes
    _all_free(ray)

    def state(hex_id):
        return placement_group_table()[hex_id]["state"]

    cc = ClusterConfig(placement_timeout_s=5)
    pool = VerifierPool.remote(VerifyConfig(workers=1), RewardConfig(), 1, 2.0, 120.0, cc)
    try:
        status = wait_for_pool(pool, lambda s: s["serving"] == 1, what="1 serving verifier", timeout=180)
        first = status["actors"][0]["group"]
        assert first is not None and state(first) == "CREATED"
        assert placement_group_table()[first]["bundles"] == {0: {"GPU": 2.0, "CPU": 1.0}}
        # 3 slots of 2 GPUs on 4 GPUs: the third cannot be placed, fails naming itself, and leaves no group
        ray.get(pool.scale.remote(3))
        status = wait_for_pool(pool, lambda s: s["serving"] == 2 and s["errors"], what="2 serving, 1 failed",
                               timeout=180)
        assert any(e.startswith("verifier actor 2: no placement for [{'GPU': 2.0, 'CPU': 1}] (PACK group) within 5 s")
                   for e in status["errors"]), status["errors"]
        failed = next(r for r in status["retired"] if r["index"] == 2)
        assert failed["state"] == "failed" and state(failed["group"]) == "REMOVED"
        second = next(a["group"] for a in status["actors"] if a["index"] == 1)
        assert state(second) == "CREATED" and second != first
        # scale down: the drained slot's group goes once it retires
        ray.get(pool.scale.remote(1))
        status = wait_for_pool(pool, lambda s: len(s["actors"]) == 1 and len(s["retired"]) == 2, what="1 retired",
                               timeout=180)
        gone = next(r["group"] for r in status["retired"] if r["state"] == "retired")
        kept = status["actors"][0]["group"]
        assert state(gone) == "REMOVED" and state(kept) == "CREATED"
        ray.get(pool.close.remote())
        assert state(kept) == "REMOVED"
    finally:
        ray.kill(pool)
    _all_free(ray)


@pytest.mark.slow
def test_spread_verifiers_take_rays_spread_scheduling_and_no_group(nodes):
    from ray.util.placement_group import placement_group_table

    from _helpers import wait_for_pool
    from dice_ray.cluster.placement import verifier_placement
    from dice_ray.cluster.verifier_pool import VerifierPool
    from dice_ray.config import ClusterConfig, RewardConfig, VerifyConfig

    ray = nodes
    _all_free(ray)
    p = verifier_placement(1.0, "spread")
    assert p.group is None and p.options(0) == {"num_gpus": 1.0, "num_cpus": 1.0, "scheduling_strategy": "SPREAD"}
    assert verifier_placement(0.0, "pack").options(0) == {"num_gpus": 0.0, "num_cpus": 0.0}  # CPU: asks nothing
    with pytest.raises(ValueError, match="cluster.placement must be 'pack' or 'spread'"):
        verifier_placement(1.0, "ring")
    before = set(placement_group_table())
    pool = VerifierPool.remote(VerifyConfig(workers=1), RewardConfig(), 2, 1.0, 120.0,
                               ClusterConfig(placement="spread"))
    try:
        status = wait_for_pool(pool, lambda s: s["serving"] == 2, what="2 serving verifiers", timeout=180)
        assert [a["group"] for a in status["actors"]] == [None, None] and set(placement_group_table()) == before
        assert all(len(a["gpu"]) == 1 for a in status["actors"])
        ray.get(pool.close.remote())
    finally:
        ray.kill(pool)
