"""benchmarks/rollout_throughput.py and benchmarks/learner_throughput.py on CPU at a tiny size, the sampler's
no-KV-cache baseline path, and the learner benchmark's cache-safe gradient checkpointing."""

from __future__ import annotations

import importlib.util
import json
import os
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dice_ray.config import ModelConfig, SamplingConfig
from dice_ray.policy.logprobs import response_logprobs
from dice_ray.policy.model import block_mask
from dice_ray.policy.policy import DiffusionPolicy
from dice_ray.policy.sampler import sample_ids
from dice_ray.rl.loss import clipped_policy_loss
from _helpers import HANG_S

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # learner_throughput imports rollout_throughput by this name
    spec.loader.exec_module(mod)
    return mod


rollout = _load("rollout_throughput")
learner = _load("learner_throughput")


@pytest.mark.parametrize("remasking", ["static", "dynamic"])
def test_sampler_without_kv_cache_matches_cached(remasking):
    policy = DiffusionPolicy.build(ModelConfig(), seed=0)
    with torch.no_grad():
        policy.model.model.norm.weight.mul_(40.0)  # confident: dynamic unmasks several tokens a step
    cfg = SamplingConfig(max_new_tokens=24, remasking=remasking, threshold=0.5, temperature=1.0)
    prompt = list(range(5, 30))
    policy.eos_id = -1
    first, _, _, _ = sample_ids(policy, prompt, 4, cfg, torch.Generator().manual_seed(1))
    # an <|eos|> stand-in that ends a row in its 2nd block while another row lacks it: rows drop mid-decode
    policy.eos_id = next(t for r in first for t in r[4:8] if any(t not in other[:8] for other in first))
    a = sample_ids(policy, prompt, 4, cfg, torch.Generator().manual_seed(1))
    b = sample_ids(policy, prompt, 4, cfg, torch.Generator().manual_seed(1), kv_cache=False)
    lengths = [len(r) for r in a[0]]
    assert min(lengths) < max(lengths)  # some rows stopped while others went on
    assert a[0] == b[0] and a[1] == b[1]
    assert max(abs(x - y) for r, s in zip(a[2], b[2]) for x, y in zip(r, s)) < 1e-4
    assert b[3].forwards == a[3].forwards - 1  # no prefill forward without a cache


def test_agreement_counts_differing_tokens_and_lengths():
    got = rollout.agreement([[1, 2, 3, 4], [5, 6, 7, 8], [1, 1]], [[1, 2, 0, 4], [5, 6, 7, 8, 9, 9], [1, 1]])
    assert got == {"identical_rows": 1, "rows": 3, "differing_tokens": 3, "tokens": 12, "identical": False}
    assert rollout.agreement([[1, 2]], [[1, 2]])["identical"]


def test_random_prompt_avoids_the_mask_token():
    ids = rollout.random_prompt(4000, 8, 3, seed=0)
    assert len(ids) == 4000 and set(ids) == {0, 1, 2, 4, 5, 6, 7}


def test_rollout_benchmark_tiny_cpu(tmp_path, capsys):
    out = tmp_path / "rollout.json"
    rollout.main(["--device", "cpu", "--tiny", "--out", str(out)])
    text = capsys.readouterr().out
    for field in ("tok/s", "peak GiB", "x no-cache", "one-token, no cache", "dynamic, KV cache", "target >= 3x"):
        assert field in text
    assert "not judged on CPU" in text and "NOT met" not in text  # the targets are GPU figures
    res = json.loads(out.read_text())
    assert [m["model"] for m in res["models"]] == ["tiny", "sdar-mini"]
    for m in res["models"]:
        first, second = m["scales"]
        assert [r["sampler"] for r in first["runs"]] == [rollout.NOCACHE, rollout.STATIC, rollout.DYNAMIC]
        assert [r["sampler"] for r in second["runs"]] == [rollout.STATIC, rollout.DYNAMIC]
        for r in first["runs"] + second["runs"]:
            assert r["new_tokens"] == 4 * 8  # batch 4, 8 new tokens, no early <|eos|> stop
            assert r["tokens_per_s"] > 0 and r["speedup_vs_nocache"] > 0 and r["peak_gib"] is None
            assert 1.0 <= r["tokens_per_step"] <= 4.0
        static, nocache = first["runs"][1], first["runs"][0]
        assert static["agreement_vs_one_token_cache"]["identical"]  # reference against itself
        assert nocache["agreement_vs_one_token_cache"]["identical"]  # fp32: cache changes nothing
        assert first["runs"][2]["tokens_per_step"] == pytest.approx(1.0)  # random init: one token a step
        groups = m["groups"]  # --tiny: 3 groups of 2 rows, prompts of different lengths, one at a time vs batched
        assert [r["sampler"] for r in groups["runs"]] == [rollout.ONE_AT_A_TIME, rollout.BATCHED]
        assert groups["groups_per_batch"] == 64 and len(set(groups["prompt_lengths"])) == 3
        assert all(r["new_tokens"] == 3 * 2 * 8 and r["tokens_per_s"] > 0 for r in groups["runs"])
        assert groups["runs"][0]["forwards"] == 3 * groups["runs"][1]["forwards"]  # 3 calls against 1
        assert groups["agreement"]["identical"] and groups["speedup_batched"] > 0  # fp32: the same greedy tokens
    assert "batched / one at a time" in text


def test_attended_pairs_equals_block_mask():
    P, R, bs = 5, 12, 4
    rb = torch.arange(R) // bs + 1
    zp, zr = torch.zeros(P, dtype=torch.long), torch.zeros(R, dtype=torch.long)
    keys_b, keys_c = torch.cat([zp, rb]), torch.zeros(P + R, dtype=torch.long)
    clean = block_mask(rb, zr, keys_b, keys_c).sum()
    noisy = block_mask(rb, zr + 1, torch.cat([keys_b, rb]), torch.cat([keys_c, zr + 1])).sum()
    assert learner.attended_pairs(P, R, bs) == clean == noisy


@pytest.mark.parametrize("mode", ["mlp", "layers"])
def test_layer_checkpointing_keeps_gradients(mode):
    def grads(mode):
        policy = rollout.make_policy("sdar-mini", torch.device("cpu"), 0)
        model = policy.model.train()
        if mode:
            learner.LayerCheckpointing(model, mode)
        g = learner.make_batch(1, 3, 8, 8, 4, 4, model.config.vocab_size, policy.mask_id, 0)[0]
        lp = response_logprobs("tracerl", model, g["prompt_ids"], g["response_ids"], g["unmask_step"], g["mask"], 4,
                               policy.mask_id)
        loss, _ = clipped_policy_loss(lp, g["behaviour_logprobs"], g["advantages"], g["mask"])
        loss.backward()
        return [p.grad for p in model.parameters()]

    ref, got = grads(None), grads(mode)
    assert max(r.abs().max() for r in ref) > 0
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


def test_learner_benchmark_tiny_cpu(tmp_path):
    out = tmp_path / "learner.json"
    # a process group an earlier test left in this process holds its MASTER_PORT: the benchmark picks its own
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    # the tiny default, 2 rows a chunk, then the whole group and 1 row a chunk side by side (the learner's row chunks)
    proc = subprocess.run([sys.executable, str(BENCH / "learner_throughput.py"), "--device", "cpu", "--tiny",
                           "--rows-per-chunk", "2,0,1", "--out", str(out)], check=False, capture_output=True, text=True,
                          timeout=HANG_S, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for field in ("processed tokens", "MFU (6 x", "matmul MFU", "attention", "ZeRO-2", "gloo", "rows/chunk",
                  "s/update over the whole group's"):
        assert field in proc.stdout
    res = json.loads(out.read_text())
    assert res["rows_per_chunk"] == 2 and res["row_chunks"] == 2
    assert res["processed_tokens"] == 2 * 16 + (1 + 4) * 4 * 16  # the prompt a chunk + clean + 4 noisy passes of 4 x 16
    assert res["recomputed_prompt_tokens"] == 16
    runs = res["row_chunk_runs"]
    assert [(k, r["row_chunks"], r["processed_tokens"]) for k, r in runs.items()] == [
        ("2", 2, 352), ("0", 1, 336), ("1", 4, 384)]
    assert all(r["trained_tokens"] == 4 * 16 and math.isfinite(r["first_loss"]) for r in runs.values())
    assert res["trained_tokens"] == 4 * 16
    assert res["zero_stage"] == 2 and res["backend"] == "gloo" and res["grad_ckpt"] == "layers"
    assert res["model_flops"] == 6 * res["params"] * res["processed_tokens"]
    assert 0 < res["mfu"] < 1 and res["seconds"] > 0 and math.isfinite(res["loss"])
    assert res["peak_gib"] is None


@pytest.mark.parametrize("P", [1, 3, 4, 6, 9, 16])
def test_prompt_pairs_equals_block_mask(P):
    from dice_ray.policy.model import prompt_blocks

    pb, z = prompt_blocks(P, 4), torch.zeros(P, dtype=torch.long)
    assert learner.prompt_pairs(P, 4) == int(block_mask(pb, z, pb, z).sum())
