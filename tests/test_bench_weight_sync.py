"""benchmarks/weight_sync.py on CPU: the real learner and rollout worker actors, gloo broadcast and object store
pushes at the tiny size, with the equality check; and that the check fails when a push moves nothing."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest
import ray
import torch

from _helpers import joined_ray

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "weight_sync.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_weight_sync", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # the actor-side functions are shipped by value from it (_by_value)
    spec.loader.exec_module(mod)
    return mod


bench = _load()


def _holder(seed: int):
    """A stand-in actor holding a tiny module as a rollout worker does (``policy.model``)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    return types.SimpleNamespace(policy=types.SimpleNamespace(model=model))


def test_compare_weights_finds_every_kind_of_difference():
    a, b = _holder(0), _holder(0)
    ref = bench._fingerprint(a, None)
    assert len(ref["tensors"]) == bench.FETCHED and len(ref["sums"]) == 6
    assert bench.compare_weights(ref, bench._fingerprint(b, list(ref["tensors"]))) == []
    # one element of one tensor changed: a fetched tensor differs by value, or a sum differs
    with torch.no_grad():
        b.policy.model[2].weight[1, 3] += 0.5
    diff = bench.compare_weights(ref, bench._fingerprint(b, list(ref["tensors"])))
    assert any(d.startswith("2.weight") for d in diff), diff
    # a perturbation (the benchmark's learner-step stand-in) changes every tensor
    bench._perturb(b, seed=1)
    diff = bench.compare_weights(ref, bench._fingerprint(b, list(ref["tensors"])))
    assert {d.split(":")[0] for d in diff} >= set(ref["sums"]), diff
    # a worker whose model lacks a tensor
    del ref["sums"]["1.bias"]
    assert any("tensor names differ" in d for d in bench.compare_weights(bench._fingerprint(a, None), {**ref, "tensors": {}}))


def test_modes_parse_and_reject_bad_lists():
    assert bench.parse_modes("object_store, broadcast,object_store") == ["object_store", "broadcast"]
    for bad in ("", "nccl", "broadcast,auto"):
        with pytest.raises(argparse.ArgumentTypeError, match="comma-separated list"):
            bench.parse_modes(bad)
    with pytest.raises(ValueError, match="must be one of"):
        bench.model_config("gpt2", False)


@pytest.fixture(scope="module")
def ray_cpu(ray_head):
    with joined_ray(ray_head):  # 2 CPUs, no GPU
        yield


def test_benchmark_cpu_both_modes_sync_and_report(ray_cpu, tmp_path):
    out = tmp_path / "ws.json"
    result = bench.main(["--model", "tiny", "--modes", "broadcast,object_store", "--repeats", "1",
                         "--bucket-mb", "1", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert result["model"] == "tiny" and result["cluster_gpus"] == 0
    b, o = result["modes"]["broadcast"], result["modes"]["object_store"]
    assert b["backend"] == "gloo" and o["backend"] is None
    payload = result["payload_bytes"]
    assert payload > 3 * 2**20  # the tiny policy: ~0.9 M fp32 parameters
    # 1 MiB buckets: several of them, holding the payload plus at most 15 alignment bytes a tensor
    assert b["buckets"] >= 3 and payload <= b["broadcast_bytes"] < payload + 16 * b["tensors_compared"]
    assert o["buckets"] is None
    for r in (b, o):
        assert len(r["seconds"]) == 1 and r["median_s"] == r["seconds"][0] > 0
        assert r["gb_per_s"] == pytest.approx(payload / r["median_s"] / 1e9)
        assert r["tensors_compared"] >= 20
    assert result["object_store_over_broadcast"] == pytest.approx(o["median_s"] / b["median_s"])


class _NoSync:
    """A weight sync that moves nothing (what the equality check must catch)."""

    def push(self, version: int) -> dict:
        return {"mode": "broadcast", "seconds": 1e-3, "bytes": 0, "buckets": 0, "restarts": 0}


def test_a_push_that_moves_nothing_fails_loudly(ray_cpu):
    cfg = bench.bench_config("tiny", 0, 1, 1.0, 0)
    learner, workers, _ = bench.build_actors(cfg, 0)
    try:
        # fresh actors hold the same seeded init: equal, so the pre-push check refuses to go on
        assert bench.check_synced(learner, workers) >= 20
        with pytest.raises(bench.SyncMismatch, match="already holds the learner's weights"):
            bench.check_synced(learner, workers, expect_equal=False)
        with pytest.raises(bench.SyncMismatch, match="does not hold the learner's weights"):
            bench.bench_mode("broadcast", _NoSync(), learner, workers, repeats=1, seed=3)
    finally:
        learner.shutdown()
        for w in workers:
            ray.kill(w)
