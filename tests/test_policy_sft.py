"""Masked-diffusion SFT warm start: loss layout, memorization, content-hash cache."""

from __future__ import annotations


import pytest
import torch

from dice_ray.config import ModelConfig, SamplingConfig, SFTConfig
from dice_ray.policy import deepspeed_setup, sft_run, sft_warm_start
from dice_ray.policy.policy import DiffusionPolicy
from dice_ray.policy.sampler import sample_group
from dice_ray.policy.sft_batches import tokenize_pairs
from dice_ray.policy.sft_loss import diffusion_loss
from dice_ray.policy.sft_optim import clip_grad_norm
from dice_ray.policy.sft_run import SFTRun
from dice_ray.policy.sft_warm_start import sft_cache_key, warm_start

TINY = ModelConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, max_position_embeddings=512, block_size=4)
PAIRS = [
    ("Reference: relu\nCUDA source:\n", 'extern "C" __global__ void relu(float* y) { y[0] = 0.f; }\n'),
    ("Reference: tanh\nCUDA source:\n", 'extern "C" __global__ void tanh_k(float* y) { y[0] = tanhf(y[0]); }\n'),
]


def test_tokenize_pairs_pads_targets_with_eos():
    policy = DiffusionPolicy.build(TINY)
    items = tokenize_pairs(policy, PAIRS)
    for (p, t), (prompt, target) in zip(items, PAIRS):
        assert p == policy.encode(prompt)
        n = len(policy.encode(target))
        assert len(t) % 4 == 0 and t[:n] == policy.encode(target) and set(t[n:]) == {policy.eos_id}
    with pytest.raises(ValueError, match=r"pairs\[0\]: the prompt is empty"):
        tokenize_pairs(policy, [("", "x")])


def test_complementary_masks_cover_every_target_token():
    policy = DiffusionPolicy.build(TINY)
    items = tokenize_pairs(policy, PAIRS)
    gen = torch.Generator().manual_seed(0)
    loss, n = diffusion_loss(policy, items, gen, complementary=True)
    assert n == sum(len(t) for _, t in items)  # each response token a target exactly once
    assert torch.isfinite(loss) and loss.item() > 0
    _, n1 = diffusion_loss(policy, items, gen, complementary=False)
    assert len(items) <= n1 < n  # >= 1 masked token a block, not all


def test_warm_start_memorizes_and_caches(tmp_path):
    cfg = SFTConfig(steps=120, batch_size=2, learning_rate=1e-2, warmup_steps=5, target_loss=None,
                    cache_dir=str(tmp_path))
    policy = DiffusionPolicy.build(TINY, seed=0)
    report = warm_start(policy, PAIRS, cfg, seed=0)
    assert not report.cache_hit and report.steps == 120 and report.num_pairs == 2
    assert report.losses[0][1] > 1.0 and report.final_loss < 0.05
    greedy = SamplingConfig(max_new_tokens=64, temperature=0.0)
    for prompt, target in PAIRS:
        (r,) = sample_group(policy, prompt, 1, greedy, seed=0)
        assert r.text == target and r.finished
        assert len(r.response_ids) < 64  # stopped after the block holding <|eos|>

    again = DiffusionPolicy.build(TINY, seed=0)
    hit = warm_start(again, PAIRS, cfg, seed=0)
    assert hit.cache_hit and hit.steps == 0  # loaded, not trained
    assert hit.cache_key == report.cache_key and hit.final_loss == report.final_loss
    for k, v in policy.state_dict().items():
        assert torch.equal(v, again.state_dict()[k])

    fresh = DiffusionPolicy.build(TINY, seed=0)
    keys = {
        sft_cache_key(fresh, PAIRS, cfg, 0),
        sft_cache_key(fresh, PAIRS, cfg, 1),
        sft_cache_key(fresh, PAIRS[:1], cfg, 0),
        sft_cache_key(fresh, PAIRS, cfg.model_copy(update={"learning_rate": 5e-3}), 0),
        sft_cache_key(DiffusionPolicy.build(TINY, seed=1), PAIRS, cfg, 0),
    }
    assert len(keys) == 5  # seed, pairs, SFT config and initial weights all change the key
    assert sft_cache_key(fresh, PAIRS, cfg.model_copy(update={"cache_dir": "/elsewhere"}), 0) == report.cache_key


def test_target_loss_stops_early(tmp_path):
    cfg = SFTConfig(steps=400, batch_size=2, learning_rate=1e-2, warmup_steps=5, target_loss=1.0,
                    cache_dir=str(tmp_path))
    report = warm_start(DiffusionPolicy.build(TINY), PAIRS, cfg, seed=0)
    assert 20 < report.steps < 400 and report.losses[-1][0] == report.steps


def test_warm_start_disabled_and_empty(tmp_path):
    policy = DiffusionPolicy.build(TINY)
    before = policy.state_dict()["model.embed_tokens.weight"].clone()
    r = warm_start(policy, PAIRS, SFTConfig(enabled=False, cache_dir=str(tmp_path)), seed=0)
    assert r.steps == 0 and not r.cache_hit
    assert torch.equal(policy.state_dict()["model.embed_tokens.weight"], before)
    with pytest.raises(ValueError, match="pairs"):
        warm_start(policy, [], SFTConfig(cache_dir=str(tmp_path)), seed=0)


def test_plain_run_resumes_from_its_state_dict_with_accumulation():
    cfg = SFTConfig(steps=3, batch_size=1, gradient_accumulation_steps=2, learning_rate=1e-2, warmup_steps=1,
                    target_loss=None, log_every=1)
    straight = SFTRun(DiffusionPolicy.build(TINY, seed=0), PAIRS, cfg, seed=0)
    a = [straight.train_step() for _ in range(3)]
    first = SFTRun(DiffusionPolicy.build(TINY, seed=0), PAIRS, cfg, seed=0)
    b = [first.train_step() for _ in range(2)]
    state = first.state_dict()
    assert {"model", "optimizer", "scheduler"} <= state.keys()  # the plain path keeps them itself
    second = SFTRun(DiffusionPolicy.build(TINY, seed=1), PAIRS, cfg, seed=5)  # all of it restored
    second.load_state_dict(state)
    b += [second.train_step() for _ in range(1)]
    assert [r["loss"] for r in a] == [r["loss"] for r in b] and [r["lr"] for r in a] == [r["lr"] for r in b]
    assert all(r["tokens"] == sum(len(p) + len(t) for p, t in tokenize_pairs(straight.policy, PAIRS)) for r in a)
    for k, v in straight.policy.state_dict().items():
        assert torch.equal(second.policy.state_dict()[k], v), k


def test_warm_start_stays_off_deepspeed_and_ignores_zero_stage(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the warm start must not make a process group or a DeepSpeed engine")

    monkeypatch.setattr(deepspeed_setup, "init_single_process_group", refuse)
    monkeypatch.setattr(sft_run, "deepspeed_engine", refuse)
    cfg = SFTConfig(steps=2, batch_size=2, target_loss=None, zero_stage=2, cache_dir=str(tmp_path))
    assert warm_start(DiffusionPolicy.build(TINY), PAIRS, cfg, seed=0).steps == 2
    policy = DiffusionPolicy.build(TINY)
    key = sft_cache_key(policy, PAIRS, cfg, 0)
    assert key == sft_cache_key(policy, PAIRS, cfg.model_copy(update={"zero_stage": 0}), 0)
    assert key != sft_cache_key(policy, PAIRS, cfg.model_copy(update={"gradient_accumulation_steps": 2}), 0)


def test_clip_grad_norm_caps_the_joint_norm_like_torch():
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    for p, q in zip(a, b):
        p.grad = torch.randn_like(p) * 3
        q.grad = p.grad.clone()
    norm = clip_grad_norm(a, 1.0)
    ref = torch.nn.utils.clip_grad_norm_(b, 1.0)
    assert norm.item() == pytest.approx(ref.item(), rel=1e-6) and norm.item() > 1.0
    assert torch.stack([p.grad.norm() for p in a]).norm().item() == pytest.approx(1.0, rel=1e-5)
    for p, q in zip(a, b):
        torch.testing.assert_close(p.grad, q.grad)
    before = [p.grad.clone() for p in a]
    clip_grad_norm(a, 10.0)  # under the cap: unchanged
    assert all(torch.equal(p.grad, g) for p, g in zip(a, before))


def test_warm_start_reports_progress_every_log_every_steps(tmp_path):
    """The trainer's console shows the warm start moving (the learner actor prints these lines); the last
    step's line is left to the caller's summary, which an actor's line would otherwise follow on the console."""
    lines: list[str] = []
    cfg = SFTConfig(steps=6, batch_size=2, target_loss=None, log_every=2, cache_dir=str(tmp_path))
    warm_start(DiffusionPolicy.build(TINY), PAIRS, cfg, seed=0, log=lines.append)
    assert [line.split(",")[0] for line in lines] == ["warm start: step 2/6", "warm start: step 4/6"]
    assert all("loss" in line for line in lines)
    lines.clear()
    warm_start(DiffusionPolicy.build(TINY), PAIRS, cfg, seed=0, log=lines.append)  # a cache hit trains nothing
    assert lines == []


def test_warm_start_reports_progress_between_log_every_steps_when_slow(tmp_path, monkeypatch):
    """On loaded cores ``log_every`` steps can take minutes: a line also comes every PROGRESS_EVERY_S, naming
    the step of the loss it shows and the time left if every step runs."""
    monkeypatch.setattr(sft_warm_start, "PROGRESS_EVERY_S", 0.0)  # every step is "slow"
    lines: list[str] = []
    cfg = SFTConfig(steps=5, batch_size=2, target_loss=None, log_every=2, cache_dir=str(tmp_path))
    warm_start(DiffusionPolicy.build(TINY), PAIRS, cfg, seed=0, log=lines.append)
    assert [line.split(",")[0] for line in lines] == [f"warm start: step {i}/5" for i in (1, 2, 3, 4)]
    assert "loss" not in lines[0]  # no window recorded yet
    assert ", loss " in lines[1] and "(step" not in lines[1]  # step 2 is a log_every boundary
    assert "(step 2)" in lines[2]  # step 3 shows step 2's window
    left = [float(line.split(", ~")[1].split(" s left at this pace")[0]) for line in lines]
    assert all(x >= 0 for x in left) and left[-1] <= left[0] + 1.0


_FIRST_ENGINE = """
import os, sys, torch
from dice_ray.policy.deepspeed_setup import deepspeed_initialize, init_single_process_group
init_single_process_group()
model = torch.nn.Linear(4, 4)
engine, *_ = deepspeed_initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                  config={"train_micro_batch_size_per_gpu": 1})
engine.backward(engine(torch.ones(1, 4)).sum())
engine.step()
print("built:", sorted(os.listdir(os.environ["TORCH_EXTENSIONS_DIR"])) if os.path.isdir(os.environ["TORCH_EXTENSIONS_DIR"]) else [])
"""


def test_first_deepspeed_engine_on_cpu_builds_no_op(tmp_path):
    """A CPU machine's first ``deepspeed.initialize`` builds no JIT op: DeepSpeed's shared-memory collective op
    (30-50 s to build on 2 cores, the first run's longest wait) is marked unavailable and gloo reduces."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    env |= {"TORCH_EXTENSIONS_DIR": str(tmp_path / "ops"), "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-c", _FIRST_ENGINE], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "built: []" in proc.stdout, proc.stdout[-2000:]
    assert "built successfully" not in proc.stdout


def test_progress_line_paces_the_time_left_on_the_steps_after_the_first():
    """The set-up and the first step (tokenizing, allocating: seconds on a loaded CPU) do not inflate the time
    left: 20 s to the end of step 1, then 10 steps in 10 s -> 89 steps left at 1 s a step."""
    class Run:
        step, losses = 11, [(10, 4.4681)]

    line = sft_warm_start._progress_line(Run(), 100, 30.0, 10.0)
    assert line == "warm start: step 11/100, loss 4.468 (step 10), 30 s, ~89 s left at this pace"
    assert sft_warm_start._progress_line(Run(), 100, 30.0, None).endswith("~243 s left at this pace")  # the mean of all
    # sft.target_loss usually stops the warm start early: the time left is a bound, and the line says so
    assert sft_warm_start._progress_line(Run(), 100, 30.0, 10.0, 0.1).endswith(
        ", at most ~89 s left at this pace (it stops at loss <= 0.1)")
