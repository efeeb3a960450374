"""Plan before launch (``dice-ray train --dry-run``, :mod:`dice_ray.cluster.plan`): placement, per-GPU memory
estimates and their refusals, on CPU without any Ray actor.

Tolerances: the learner's model states equal DeepSpeed's own estimators within 1 % (the formula is theirs); the
activation estimate is within 15 % of the bytes autograd keeps on a tiny fp32 policy on CPU (every estimator and
family), after adding what CPU's composite RMSNorm keeps and CUDA's fused kernel does not.
"""

from __future__ import annotations

import math
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _helpers import saved_activation_bytes
from dice_ray.cluster import plan as plan_mod
from dice_ray.cluster.memory_estimate import (
    GIB,
    count_params,
    deepspeed_model_states,
    group_activations,
    model_shape,
    model_states,
    rollout_batch_rows,
    rollout_estimate,
    scoring_states,
)
from dice_ray.cluster.plan import Capacity, capacity_from_nodes, make_plan
from dice_ray.config import DiceConfig, ModelConfig, load_config

REPO = Path(__file__).resolve().parents[1]
CLUSTER_8B = REPO / "configs" / "cluster-8b.yaml"
EIGHT_GPU = REPO / "configs" / "8gpu.yaml"


@pytest.fixture(autouse=True)
def _no_cluster_here(monkeypatch):
    """No Ray address and no local GPU: the capacity is what each test gives."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(plan_mod, "local_gpus", lambda: None)


def _main(capsys, *args) -> tuple[int, str, str]:
    import ray

    from dice_ray.cli import main

    try:
        rc = main([str(a) for a in args])
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    assert not ray.is_initialized(), "the plan started Ray"
    return rc, out.out, " ".join(out.err.split())


def _stated_command(preset: Path) -> list[str]:
    """The ``dice-ray train ... --dry-run ...`` line a preset's header states its cluster with."""
    line = next(ln for ln in preset.read_text().splitlines() if "dice-ray train" in ln and "--dry-run" in ln)
    argv = shlex.split(line.lstrip("# "))
    assert argv[:2] == ["dice-ray", "train"], line
    return argv[2:]


# ---- the refusals ------------------------------------------------------------------------------------------


def test_an_8b_learner_on_one_80gib_rank_is_refused(capsys):
    rc, out, err = _main(capsys, "train", "--config", CLUSTER_8B, "--dry-run", "--cluster-gpus", 16, "--gpus-per-node",
                         8, "--gpu-memory-gib", 80, "cluster.learner_ranks=1")
    assert rc == 2
    assert re.search(r"error: the plan does not fit: learner \(1 rank, ZeRO-3\) needs (\d+\.\d) GiB a GPU", err), err
    assert "a GPU holds 80.0 GiB" in err and len(err.splitlines()) == 1
    assert "DOES NOT FIT" in out and "verdict: does not fit" in out
    needs = float(re.search(r"needs (\d+\.\d) GiB", err).group(1))
    assert needs > 137  # ZeRO-3's 18 bytes a parameter of 8.19 B parameters alone


def test_model_states_that_do_not_fit_one_rank_name_the_ranks_that_would(capsys):
    """A short group (the activations small): the learner's own states exceed the GPU, and the hint names the
    ZeRO-3 ranks that fit."""
    rc, _, err = _main(capsys, "train", "--config", CLUSTER_8B, "--dry-run", "--cluster-gpus", 16, "--gpu-memory-gib",
                       80, "--prompt-tokens", 128, "cluster.learner_ranks=1", "rl.num_generations=2",
                       "sampling.max_new_tokens=64", "rl.beta=0", "cluster.micro_batch_tokens=0")
    assert rc == 2
    assert "learner (1 rank, ZeRO-3) needs" in err and "optimizer 91.5" in err, err
    ranks = int(re.search(r"cluster.learner_ranks=(\d+) cluster.zero_stage=3 would fit", err).group(1))
    rc, out, _ = _main(capsys, "train", "--config", CLUSTER_8B, "--dry-run", "--cluster-gpus", 16, "--gpu-memory-gib",
                       80, "--prompt-tokens", 128, f"cluster.learner_ranks={ranks}", "rl.num_generations=2",
                       "sampling.max_new_tokens=64", "rl.beta=0", "cluster.micro_batch_tokens=0",
                       "cluster.num_rollout_workers=1", "cluster.num_verifiers=1")
    assert rc == 0 and "verdict: fits" in out


def test_a_micro_batch_of_many_groups_names_its_budget(capsys):
    whole = "cluster.learner_rows_per_chunk=0"  # whole groups a backward (the preset scores one sample at a time)
    rc, _, err = _main(capsys, "train", "--config", CLUSTER_8B, "--dry-run", "--cluster-gpus", 16, "--gpu-memory-gib",
                       140.4, "--prompt-tokens", 128, "rl.num_generations=2", "sampling.max_new_tokens=64", whole)
    assert rc == 2 and "are those of 21 groups a micro-batch (cluster.micro_batch_tokens=8192" in err, err
    assert "(cluster.learner_rows_per_chunk)" in err
    rc, out, _ = _main(capsys, "train", "--config", CLUSTER_8B, "--dry-run", "--cluster-gpus", 16, "--gpu-memory-gib",
                       140.4, "--prompt-tokens", 128, "rl.num_generations=2", "sampling.max_new_tokens=64", whole,
                       "cluster.gradient_checkpointing=true")
    assert rc == 0 and "gradient checkpointing: one group" in out


def test_train_without_dry_run_refuses_before_anything_starts(tmp_path, capsys, monkeypatch):
    from dice_ray.cluster import trainer as trainer_mod

    monkeypatch.setattr(trainer_mod, "Trainer", lambda *a, **k: pytest.fail("a Trainer was made"))
    rc, out, err = _main(capsys, "train", "--config", CLUSTER_8B, "--cluster-gpus", 16, "--gpu-memory-gib", 80,
                         f"run_dir={tmp_path}", "cluster.learner_ranks=1")
    assert rc == 2 and "learner (1 rank, ZeRO-3) needs" in err and "DOES NOT FIT" in out
    assert not any(tmp_path.iterdir())


def test_train_that_fits_goes_on_and_says_so(capsys, monkeypatch):
    from dice_ray.cluster import trainer as trainer_mod

    ran = []
    monkeypatch.setattr(trainer_mod, "train", lambda *a, **k: ran.append(a))
    rc, out, _ = _main(capsys, "train", "--config", EIGHT_GPU, "--cluster-gpus", 8, "--gpu-memory-gib", 140.4)
    assert rc == 0 and ran and out.startswith("plan: fits (given: 8 GPU(s)")
    rc, out, _ = _main(capsys, "train")  # this machine's capacity: no GPU, every role on CPU, as train runs them
    assert rc == 0 and len(ran) == 2 and out.startswith("plan: fits")
    if not torch.cuda.is_available():
        assert out.startswith("plan: fits (every role on CPU; this machine, no GPU")


def test_too_few_gpus_of_a_given_cluster_are_refused(capsys):
    rc, out, err = _main(capsys, "train", "--config", CLUSTER_8B, "--dry-run", "--cluster-gpus", 8, "--gpu-memory-gib",
                         140.4)
    assert rc == 2 and "the roles ask 16 GPU(s)" in err and "8 actor(s) find no room on the cluster's 8 GPU(s)" in err
    assert "NO ROOM" in out


def test_a_running_cluster_short_of_gpus_only_warns():
    """An autoscaler may still add nodes to a running cluster: fewer GPUs than asked is a warning there."""
    cfg = load_config(CLUSTER_8B)
    plan = make_plan(cfg, Capacity([8], int(140.4 * GIB), "Ray cluster", live=True))
    assert plan.fits is True and not plan.problems
    assert plan.warnings and "the cluster has 8 GPU(s) now and the roles ask 16" in plan.warnings[0]


def test_roles_sharing_a_gpu_must_sum_on_it(capsys):
    preset = REPO / "configs" / "h200.yaml"
    rc, out, _ = _main(capsys, "train", "--config", preset, "--dry-run", "--cluster-gpus", 1, "--gpu-memory-gib", 140.4)
    assert rc == 0 and "verdict: fits: 1 of 1 GPU(s) used" in out
    assert re.search(r"n0:0: learner 0.25 \(.*\) \+ verifier 0.5 \(63.2\) \+ rollout 0.25 \(.*\) = ", out), out
    rc, out, err = _main(capsys, "train", "--config", preset, "--dry-run", "--cluster-gpus", 1, "--gpu-memory-gib",
                         140.4, "verify.gpu_memory_fraction=0.99")
    assert rc == 2 and "GPU n0:0 holds learner (1 rank, ZeRO-2), rollout worker, verifier" in err, err
    assert "a GPU holds 140.4 GiB: lower verify.gpu_memory_fraction" in err


def test_spread_deals_rollout_workers_and_verifiers_over_the_nodes():
    def where(mode):
        cfg = load_config(None, ["cluster.learner_gpus=1", "cluster.rollout_gpus=1", "cluster.num_rollout_workers=2",
                                 "cluster.num_verifiers=2", f"cluster.placement={mode}"])
        plan = make_plan(cfg, Capacity([4, 4], int(80 * GIB), "given"))
        return {r.name: [g.node for g in r.placed] for r in plan.roles}

    assert where("pack") == {"learner": [0], "rollout": [0, 0], "verifier": [0, 1]}  # first fit, node 0 first
    assert where("spread") == {"learner": [0], "rollout": [0, 1], "verifier": [0, 1]}


def test_colocated_rollout_shares_the_learner_gpus_one_phase_at_a_time(capsys):
    """Colocated, the workers sit on their ranks' GPUs (none of their own) and a GPU holds the larger of the learning
    phase and the sampling phase, not their sum: a GPU too small for both at once holds them colocated, and the same
    roles sharing it by fractions (both resident) do not fit."""
    common = ["sampling.max_new_tokens=4096", "rl.num_generations=16", "cluster.num_verifiers=1",
              "verify.mode=compile_only"]
    colocated = load_config(None, [*common, "cluster.colocate_rollout=true", "cluster.learner_gpus=1",
                                   "cluster.rollout_gpus=0.5", "cluster.learner_ranks=2", "cluster.num_rollout_workers=2"])
    plan = make_plan(colocated, Capacity([2], int(80 * GIB), "given"))
    learner, rollout = plan.roles[0], plan.roles[1]
    assert rollout.colocated and [g.index for g in rollout.placed] == [g.index for g in learner.placed] == [0, 1]
    gpu = learner.placed[0]
    learning, sampling = plan.phases(gpu)
    lc, rc_ = learner.estimate.components, rollout.estimate.components
    assert learning == learner.per_gpu + rc_["weights"] + rc_["runtime"]
    assert sampling == rollout.per_gpu + lc["runtime"]
    both = learner.per_gpu + rollout.per_gpu
    assert plan.used(gpu) == max(learning, sampling) < both
    moved = lc["weights"] + lc["gradients"] + lc["optimizer"]
    assert learner.estimate.host == moved and any("go to CPU memory" in n for n in learner.estimate.notes)
    between = (max(learning, sampling) + both) / 2 / GIB
    # colocated: fits a GPU smaller than both at once
    rc, out, err = _main(capsys, "train", "--dry-run", "--cluster-gpus", 2, "--gpu-memory-gib", f"{between:.2f}", *common,
                         "cluster.colocate_rollout=true", "cluster.learner_gpus=1", "cluster.rollout_gpus=0.5",
                         "cluster.learner_ranks=2", "cluster.num_rollout_workers=2")
    assert rc == 0, err
    assert "placement: the learner's ranks one PACK group; rollout workers in the learner's bundles" in out
    assert re.search(r"n0:0: learner 1 \(.*\) \+ rollout 0.5 \(.*\) = learning .*, sampling .* \(colocated: one "
                     r"phase at a time\), peak", out), out
    assert "n0:0-1 (learner's)" in out
    # the same GPU, the learner and a worker both resident (fractions, no colocation): does not fit
    rc, out, err = _main(capsys, "train", "--dry-run", "--cluster-gpus", 1, "--gpu-memory-gib", f"{between:.2f}", *common,
                         "cluster.learner_gpus=0.5", "cluster.rollout_gpus=0.5")
    assert rc == 2 and "GPU n0:0 holds learner (1 rank, ZeRO-0), rollout worker" in err, err


# ---- the presets and the default ---------------------------------------------------------------------------


@pytest.mark.parametrize("preset", [CLUSTER_8B, EIGHT_GPU], ids=lambda p: p.stem)
def test_presets_fit_the_cluster_their_header_states(preset, capsys):
    argv = _stated_command(preset)
    assert argv[argv.index("--config") + 1] == f"configs/{preset.name}"
    argv[argv.index("--config") + 1] = str(preset)
    rc, out, err = _main(capsys, "train", *argv)
    assert rc == 0, err
    assert "verdict: fits" in out and "DOES NOT FIT" not in out
    for role in ("learner (", "rollout worker", "verifier"):
        assert role in out
    used = int(re.search(r"verdict: fits: (\d+) of (\d+) GPU", out).group(1))
    assert used == int(argv[argv.index("--cluster-gpus") + 1])  # every GPU of the stated cluster has a role


def test_cluster_8b_learns_on_8_zero3_ranks_of_one_node(capsys):
    cfg = load_config(CLUSTER_8B)
    assert (cfg.cluster.learner_ranks, cfg.cluster.zero_stage) == (8, 3)
    plan = make_plan(cfg, Capacity([8, 8], int(140.4 * GIB), "given"))
    learner = plan.roles[0]
    assert {g.node for g in learner.placed} == {0} and len({g.index for g in learner.placed}) == 8


def test_8gpu_preset_is_the_sdar_1_7b_size():
    shape = model_shape(load_config(EIGHT_GPU).model)
    assert shape.family == "sdar" and abs(shape.params / 1e9 - 1.72) < 0.01


def test_the_default_config_is_accepted_and_names_each_role(capsys):
    rc, out, err = _main(capsys, "train", "--dry-run")
    assert rc == 0, err
    if not torch.cuda.is_available():  # what train does on this machine: 2 compile-only verifiers, all on CPU
        assert "verdict: fits (every role on CPU)" in out and out.count("CPU, not checked") == 3 and "2 x CPU" in out
    for role in ("learner (1 rank, ZeRO-0)", "rollout worker", "verifier"):
        assert role in out
    rc, out, _ = _main(capsys, "train", "--dry-run", "--cluster-gpus", 8, "--gpu-memory-gib", 80)
    assert rc == 0 and "verdict: fits" in out and "8 x 1" in out  # a verifier a GPU


def test_a_cluster_without_gpus_runs_every_role_on_cpu(capsys):
    rc, out, _ = _main(capsys, "train", "--config", EIGHT_GPU, "--dry-run", "--cluster-gpus", 0)
    assert rc == 0 and "verdict: fits (every role on CPU)" in out and out.count("CPU, not checked") == 3


def test_jobs_train_has_the_dry_run(tmp_path):
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([sys.executable, str(REPO / "jobs" / "train.py"), "--config", str(CLUSTER_8B), "--dry-run",
                          "--cluster-gpus", "16", "--gpu-memory-gib", "80", "cluster.learner_ranks=1"],
                         capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert run.returncode == 2 and "learner (1 rank, ZeRO-3) needs" in run.stderr, run.stderr[-2000:]


# ---- bad input ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("args, says", [
    (["cluster.learner_ranks=0"], "error: config: cluster.learner_ranks: Input should be greater than or equal to 1"),
    (["cluster.zero_stage=4"], "cluster.zero_stage: Input should be less than or equal to 3"),
    (["--gpu-memory-gib", "0"], "error: --gpu-memory-gib must be > 0, got 0"),
    (["--cluster-gpus", "-1"], "error: --cluster-gpus must be >= 0, got -1"),
    (["--gpus-per-node", "8"], "error: --gpus-per-node needs --cluster-gpus"),
    (["--prompt-tokens", "0"], "error: --prompt-tokens must be >= 1, got 0"),
])
def test_a_bad_value_is_one_clear_line(args, says, capsys):
    rc, out, err = _main(capsys, "train", "--dry-run", *args)
    assert rc == 2 and says in err and len(err.splitlines()) == 1, err
    assert "verdict" not in out


# ---- the estimates -----------------------------------------------------------------------------------------


def _shape(params: int, largest: int, dtype_bytes: int = 2):
    from dice_ray.cluster.memory_estimate import ModelShape

    return ModelShape("sdar", 4096, 12288, 36, 32, 8, 128, 151936, False, dtype_bytes, params, largest, 32768, 4, "t")


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("ranks, nodes", [(1, 1), (8, 1), (16, 2)])
@pytest.mark.parametrize("offload", [False, True])
def test_model_states_equal_deepspeeds_estimators(stage, ranks, nodes, offload):
    shape = _shape(8_190_735_360, 151936 * 4096)
    mine = model_states(shape, stage, ranks, offload)
    ds = deepspeed_model_states(shape, stage, ranks // nodes, nodes, offload)
    assert ds is not None
    assert abs(mine["weights"] + mine["gradients"] + mine["optimizer"] - ds) <= 0.01 * ds


def test_deepspeed_has_no_estimator_for_stages_0_and_1_nor_fp32():
    assert deepspeed_model_states(_shape(10**9, 10**8), 1, 8, 1, False) is None
    assert deepspeed_model_states(_shape(10**9, 10**8, dtype_bytes=4), 3, 8, 1, False) is None


@pytest.mark.parametrize("family, shape", [
    ("sdar", dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                  num_key_value_heads=8, head_dim=128, tie_word_embeddings=False)),
    ("sdar", dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)),
    ("llada", dict(hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)),
    ("dream", dict(hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)),
])
def test_parameter_count_equals_the_built_model(family, shape):
    from dice_ray.policy.families import build_model

    cfg = ModelConfig(family=family, **shape)
    with torch.device("meta"):
        model = build_model(cfg, 151936, 0)
    built = sum(p.numel() for p in model.parameters())  # tied weights are one parameter
    assert count_params(family, cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers,
                        cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, 151936,
                        cfg.tie_word_embeddings) == built


def test_a_readable_checkpoint_gives_its_exact_size(tmp_path):
    from dice_ray.policy.policy import DiffusionPolicy

    from _helpers import TINY_FAMILY_SHAPE

    policy = DiffusionPolicy.build(ModelConfig(**TINY_FAMILY_SHAPE, tie_word_embeddings=False))
    policy.save_checkpoint(tmp_path / "ckpt")
    shape = model_shape(ModelConfig(path=str(tmp_path / "ckpt"), dtype="bfloat16"))
    assert shape.params == policy.num_parameters() and shape.source == str(tmp_path / "ckpt" / "config.json")
    assert (shape.hidden, shape.layers, shape.vocab, shape.dtype_bytes) == (32, 2, policy.tokenizer.vocab_size, 2)


def test_an_unreadable_model_path_falls_back_to_the_keys_and_says_so():
    shape = model_shape(load_config(CLUSTER_8B).model)
    assert "not readable here" in shape.source and shape.vocab == 151936
    assert abs(shape.params / 1e9 - 8.19) < 0.01  # SDAR-8B / Qwen3-8B


@pytest.mark.parametrize("family, est, kv_heads", [
    ("sdar", "tracerl", 2), ("sdar", "tracerl", 4), ("sdar", "coupled", 2), ("sdar", "diffu_grpo", 2),
    ("llada", "tracerl", 2), ("llada", "coupled", 2), ("dream", "diffu_grpo", 2),
])
def test_activation_estimate_matches_what_autograd_keeps(family, est, kv_heads):
    """Bytes of the tensors autograd saves while scoring one group (parameters excluded), against
    :func:`group_activations` (less the logits' transient part, plus CPU's RMSNorm extra)."""
    from dice_ray.policy.logprobs import response_logprobs
    from dice_ray.policy.policy import DiffusionPolicy

    G, P, R = 4, 24, 32
    mc = ModelConfig(family=family, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=kv_heads, head_dim=16, max_position_embeddings=512)
    cfg = DiceConfig(model=mc, rl={"num_generations": G, "logprob_estimator": est}, sampling={"max_new_tokens": R})
    policy = DiffusionPolicy.build(mc)
    gen = torch.Generator().manual_seed(0)
    prompt, response = torch.randint(10, 200, (P,), generator=gen), torch.randint(10, 200, (G, R), generator=gen)
    steps = torch.arange(R).remainder(mc.block_size) if family == "sdar" else torch.arange(R)
    saved = saved_activation_bytes(policy.model, lambda: response_logprobs(
        est, policy.model, prompt, response, steps.expand(G, R).clone(), torch.ones(G, R, dtype=torch.bool),
        mc.block_size, policy.mask_id, seed=1, canvas_len=R))
    shape = model_shape(cfg.model)
    want, _ = group_activations(cfg, shape, P)
    n = scoring_states(cfg, shape)
    want -= math.ceil(G * R / n) * shape.vocab * 6  # logits alive during one pass only: not saved for backward
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    if est == "diffu_grpo":
        tokens = (G if family == "sdar" else 1) * (P + R)
    else:
        tokens = P + G * R * (1 + n) if family == "sdar" else n * G * (P + R)
    cpu_norm = 2 * h + (q + kv if family == "sdar" else 0)  # composite RMSNorm: the normalized input, too
    want += tokens * (shape.layers * cpu_norm + h) * shape.dtype_bytes
    got = saved
    assert abs(want - got) <= 0.15 * got, (want, got)


def test_capacity_of_a_running_cluster_from_its_nodes():
    head = {"Alive": True, "Resources": {"CPU": 8.0}}
    gpu = {"Alive": True, "Resources": {"CPU": 192.0, "GPU": 8.0, "accelerator_type:H100": 1.0}}
    gone = {"Alive": False, "Resources": {"GPU": 8.0}}
    cap = capacity_from_nodes([head, gpu, gpu, gone])
    assert cap.nodes == [8, 8] and cap.gpu_bytes == int(79.6 * GIB) and cap.live
    odd = {"Alive": True, "Resources": {"GPU": 4.0, "accelerator_type:A100": 1.0}}  # 40 or 80 GB: unknown
    assert capacity_from_nodes([odd]).gpu_bytes is None
    assert capacity_from_nodes([odd], gpu_memory_gib=80).gpu_bytes == 80 * GIB
    assert capacity_from_nodes([head]).nodes == []


def test_rollout_kv_cache_counts_the_sampling_batch_it_holds():
    """SDAR workers decode a call's groups up to sampling.max_batch_rows rows a batch: the KV cache planned is that
    batch's (whole groups, at least one, at most a call's groups: a step's prompts or an evaluation's tasks)."""
    base = ["rl.prompts_per_step=16", "rl.num_generations=8", "eval.train_tasks=0", "eval.heldout_tasks=0"]

    def kv(*extra):
        cfg = load_config(None, [*base, *extra])
        est = rollout_estimate(cfg, model_shape(cfg.model), 512)
        return est.components["kv_cache"], rollout_batch_rows(cfg)[0], est.notes

    one, rows, _ = kv("sampling.max_batch_rows=0")
    assert rows == 8 and kv("sampling.max_batch_rows=1")[0] == kv("sampling.max_batch_rows=5")[0] == one  # one group
    full, rows, notes = kv("sampling.max_batch_rows=128")
    assert rows == 128 and full == 16 * one
    assert any("128 rows, 16 group(s) of 8 (rl.prompts_per_step=16, sampling.max_batch_rows=128)" in n for n in notes)
    assert kv("sampling.max_batch_rows=100")[:2] == (12 * one, 96)  # whole groups: 12 of 8
    assert kv("sampling.max_batch_rows=1000")[:2] == (16 * one, 128)  # no more than a step's 16 groups
    # an evaluation call can be the larger batch: 6 held-out tasks x 32 samples
    assert kv("sampling.max_batch_rows=1000", "eval.heldout_tasks=6", "eval.heldout_samples=32")[1] == 192
    # LLaDA / Dream decode one group at a time and keep no cache
    assert kv("sampling.max_batch_rows=128", "model.family=llada")[0] == 0
