"""Group advantages and the clipped policy loss, against values computed by hand."""

import pytest
import torch

from dice_ray.rl.advantages import group_advantages
from dice_ray.rl.loss import clipped_policy_loss


def test_group_advantages_zscore_and_dropped_groups():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [2.0, 0.0, 1.0, 1.0]])
    out = group_advantages(rewards, scale_rewards=True)
    assert out.keep.tolist() == [True, False, True]
    assert out.num_dropped == 1
    assert torch.allclose(out.advantages[0], torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-5)
    assert torch.all(out.advantages[1] == 0)
    std = torch.tensor([2.0, 0.0, 1.0, 1.0]).std(unbiased=False)
    assert torch.allclose(out.advantages[2], (torch.tensor([2.0, 0.0, 1.0, 1.0]) - 1.0) / std, atol=1e-5)


def test_group_advantages_unscaled_is_centred_only():
    out = group_advantages(torch.tensor([[3.0, 1.0]]), scale_rewards=False)
    assert out.advantages.tolist() == [[1.0, -1.0]]


@pytest.mark.parametrize("bad", [torch.zeros(4), torch.zeros(2, 1), torch.tensor([[0.0, float("nan")]])])
def test_group_advantages_rejects_bad_rewards(bad):
    with pytest.raises(ValueError):
        group_advantages(bad)


def test_clipped_loss_matches_ppo_by_hand():
    lp = torch.tensor([[0.0, -1.0], [-0.5, -0.5]], requires_grad=True)
    old = torch.tensor([[-0.5, -1.0], [0.0, -0.5]])
    adv = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[True, True], [True, False]])
    loss, stats = clipped_policy_loss(lp, old, adv, mask, epsilon=0.2)
    r = torch.exp(torch.tensor([0.5, 0.0, -0.5]))
    # seq 0: tokens (r0, adv 1) clipped to 1.2, (r=1) ; seq 1: one token r=e^-0.5, adv -1 -> max(-r, -0.8)
    seq0 = -(min(r[0], 1.2) + 1.0) / 2
    seq1 = -min(-r[2], -0.8)
    assert loss.item() == pytest.approx(float((seq0 + seq1) / 2), rel=1e-5)
    loss.backward()
    assert lp.grad[0, 0] == 0  # clipped token gives no gradient
    assert lp.grad[1, 1] == 0  # masked token gives no gradient
    assert stats.clip_fraction == pytest.approx(2 / 3)


def test_k3_kl_is_zero_at_reference_and_positive_elsewhere():
    lp = torch.tensor([[-1.0, -2.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    _, same = clipped_policy_loss(lp, lp, torch.zeros(1), mask, beta=0.1, ref_logprobs=lp)
    _, diff = clipped_policy_loss(lp, lp, torch.zeros(1), mask, beta=0.1, ref_logprobs=lp - 0.3)
    assert same.kl == pytest.approx(0.0)
    assert diff.kl > 0
    with pytest.raises(ValueError):
        clipped_policy_loss(lp, lp, torch.zeros(1), mask, beta=0.1)


@pytest.mark.parametrize("drop", [True, False])
def test_trainer_drops_flat_groups_unless_told_to_keep_them(drop):
    """``rl.drop_flat_groups``: a group whose rewards are all equal goes to the learner only when it is False (then
    with advantage 0), and the step's dropped count says so."""
    from types import SimpleNamespace

    from dice_ray.cluster.rollout import GroupRollout
    from dice_ray.cluster.trainer import Trainer
    from dice_ray.config import DiceConfig, ModelConfig, SamplingConfig
    from dice_ray.policy.policy import DiffusionPolicy
    from dice_ray.policy.sampler import sample_group

    pol = DiffusionPolicy.build(ModelConfig(), seed=0)
    rollouts = sample_group(pol, "__global__ void k(){}", 2, SamplingConfig(max_new_tokens=8), seed=1)
    groups = [GroupRollout(request=None, rollouts=list(rollouts), candidates=["", ""], tokens=0, seconds=0.0,
                           weights_version=0) for _ in range(2)]
    sent = []
    trainer = SimpleNamespace(
        cfg=DiceConfig.model_validate({"rl": {"num_generations": 2, "drop_flat_groups": drop}}),
        learner=SimpleNamespace(train_step=SimpleNamespace(remote=lambda batch: batch)),
        pipeline=SimpleNamespace(submit=lambda stage, refs, start: sent.append(refs[0]) or "flight"))
    verdicts = [SimpleNamespace(reward=r) for r in (1.0, 0.0, 0.0, 0.0)]  # group 0 has a signal, group 1 is flat
    flight, dropped = Trainer.learn(trainer, groups, verdicts)
    assert flight == "flight" and dropped == (1 if drop else 0)
    assert len(sent[0]) == (1 if drop else 2)
    assert sent[0][0].advantages.tolist() == [1.0, -1.0]
    if not drop:
        assert sent[0][1].advantages.tolist() == [0.0, 0.0]
