"""Learning against a control (issue 40): ``benchmarks/learning.py`` at a CI size. A short RL run must raise the reward of
its fixed training prompts, and the same run without policy updates (the control arm) must not move it.

This fails when learning is broken: an advantage of the wrong sign pushes the reward down, a weight sync that moves
nothing leaves the rollout workers (which sample the evaluation) with the warm start's weights, a loss that never
reaches the parameters changes nothing. The control's evaluation repeats its start exactly (same weights, same seeds,
a deterministic compile-only verifier), so any rise of the ``rl`` arm is the learner's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from _helpers import BENCHMARKS

pytestmark = pytest.mark.slow

#: a CI-sized version of configs/learning-cpu.yaml: 8 single-operator tasks (6 trained), 12 steps, a warm start of its own
CI_SIZE = ["tasks.max_tasks=8", "tasks.heldout_fraction=0.25", "rl.steps=12", "rl.prompts_per_step=6",
           "eval.train_tasks=6", "eval.heldout_tasks=2", "eval.samples=4", "eval.heldout_samples=4",
           "sampling.max_new_tokens=128", "cluster.num_verifiers=1"]
#: the least rise of the rl arm's reward on its training prompts (pooled over both phases)
MIN_RISE = 0.1


def test_rl_raises_its_training_reward_and_the_control_does_not(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    cmd = [sys.executable, str(BENCHMARKS / "learning.py"), "--device", "cpu", "--seeds", "0", "--json",
           "--out", str(tmp_path), *CI_SIZE, f"sft.cache_dir={tmp_path / 'sft'}"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode in (0, 1), f"exit {proc.returncode}\n{proc.stderr[-4000:]}"  # 1: a full-size target missed
    result = json.loads(proc.stdout)
    rl, control = result["arms"]["rl"][0], result["arms"]["control"][0]
    log = proc.stderr[-3000:]
    assert control["reward_end"] == control["reward_start"], log  # no update: the same samples, the same verdicts
    assert rl["reward_end"] - rl["reward_start"] >= MIN_RISE, log
    assert len(rl["curve"]) == len(control["curve"]) == 12
    assert (tmp_path / "learning.png").is_file() and (tmp_path / "learning.json").is_file()
