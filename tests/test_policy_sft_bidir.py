"""SFT of the bidirectional families (LLaDA, Dream): LLaDA's masked-diffusion loss, padding, Dream's shift, resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dice_ray.cli import main
from dice_ray.config import ModelConfig, SamplingConfig, SFTConfig
from dice_ray.policy.families import logit_shift
from dice_ray.policy.model import forward_hidden, token_logits
from dice_ray.policy.policy import DiffusionPolicy
from dice_ray.policy.sampler import sample_masked_ids
from dice_ray.policy.sft_batches import tokenize_pairs
from dice_ray.policy.sft_loss import diffusion_loss, masked_diffusion_loss
from dice_ray.policy.sft_run import SFTRun
from dice_ray.policy.sft_warm_start import warm_start

from _helpers import TINY_FAMILY_SHAPE

TINY = TINY_FAMILY_SHAPE
PAIRS = [  # prompts and targets of different lengths: every batch is padded
    ("Reference: relu\nCUDA:\n", "y[i] = fmaxf(x[i], 0.f);\n"),
    ("Reference: tanh of the input tensor\nCUDA:\n", "y[i] = tanhf(x[i]);\n"),
    ("Ref: add\n", "y[i] = a[i] + b[i]; // elementwise sum of a and b\n"),
]


def _policy(family: str, seed: int = 0, layers: int = 2) -> DiffusionPolicy:
    return DiffusionPolicy.build(ModelConfig(family=family, **dict(TINY, num_hidden_layers=layers)), seed=seed)


def _recall(policy: DiffusionPolicy, items: list[tuple[list[int], list[int]]]) -> float:
    """Share of target tokens (up to the first ``eos``: decoding stops there) that greedy whole-response decoding
    reproduces at their positions, the canvas as long as the padded target."""
    hit = total = 0
    for p, t in items:
        cfg = SamplingConfig(max_new_tokens=len(t), temperature=0.0, remasking="static", steps_per_block=4)
        (resp,), *_ = sample_masked_ids(policy, [p], cfg, torch.Generator().manual_seed(0))
        t = t[: t.index(policy.eos_id) + 1]
        hit += sum(a == b for a, b in zip(resp, t))
        total += len(t)
    return hit / total


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_sft_memorizes_the_responses(family):
    policy = _policy(family)
    items = tokenize_pairs(policy, PAIRS)
    before = _recall(policy, items)
    cfg = SFTConfig(steps=250, batch_size=3, learning_rate=1e-2, warmup_steps=5, target_loss=None, log_every=25)
    run = SFTRun(policy, PAIRS, cfg, seed=0)
    losses = [run.train_step()["loss"] for _ in range(cfg.steps)]
    policy.model.eval()
    first, last = sum(losses[:10]) / 10, sum(losses[-25:]) / 25
    assert last < 0.25 * first, (first, last)
    after = _recall(policy, items)
    assert before < 0.2 and after > 0.9, (before, after)


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("complementary", [True, False])
def test_padded_batch_gives_each_item_its_own_loss(family, complementary):
    policy = _policy(family, seed=1)
    items = tokenize_pairs(policy, PAIRS)
    assert len({len(p) for p, _ in items}) == 3 and len({len(t) for _, t in items}) == 3  # padding on both sides
    gen = torch.Generator().manual_seed(7)
    batch, n = diffusion_loss(policy, items, gen, complementary)
    gen = torch.Generator().manual_seed(7)  # items alone draw, in turn, what the batch drew
    alone = [diffusion_loss(policy, [it], gen, complementary) for it in items]
    assert abs(batch.item() - sum(v.item() for v, _ in alone) / len(items)) < 1e-5
    assert n == sum(k for _, k in alone)
    if complementary:
        assert n == sum(len(t) for _, t in items)  # every response token a target once
    # per item, with fixed masks and ratios: the batch's entries equal each item's alone
    masks = [torch.arange(len(t)) % 3 == 0 for _, t in items]
    t = torch.tensor([0.3, 0.6, 0.9])
    per_item = masked_diffusion_loss(policy, items, masks, t)
    for i, it in enumerate(items):
        assert abs(per_item[i].item() - masked_diffusion_loss(policy, [it], masks[i : i + 1], t[i : i + 1]).item()) < 1e-5


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_loss_equals_a_hand_computed_one(family):
    """One-layer model, fixed mask and t: Dream's loss reads the logits one position left, LLaDA's in place."""
    policy = _policy(family, layers=1)
    policy.model.eval()
    (p, r), = tokenize_pairs(policy, PAIRS[:1])
    mask = torch.tensor([j % 2 == 0 or j == len(r) - 1 for j in range(len(r))])
    t = 0.37
    got = masked_diffusion_loss(policy, [(p, r)], [mask], torch.tensor([t]))
    resp = torch.tensor(r)
    seq = torch.cat([torch.tensor(p), torch.where(mask, policy.mask_id, resp)])
    n = seq.numel()
    with torch.no_grad():
        logits = token_logits(policy.model, forward_hidden(policy.model, seq[None], torch.arange(n),
                                                           torch.ones(n, n, dtype=torch.bool))[0], policy.mask_id)

    def hand(shift: int) -> float:
        at = len(p) + torch.nonzero(mask).squeeze(1) - shift
        return F.cross_entropy(logits[at], resp[mask], reduction="sum").item() / t / len(r)

    expected = hand(logit_shift(family))
    assert got.item() == pytest.approx(expected, rel=1e-5)
    assert abs(hand(1 - logit_shift(family)) - expected) > 1e-2  # the other alignment gives another value
    got.sum().backward()  # differentiable
    assert policy.model.model.embed_tokens.weight.grad.abs().sum() > 0


def test_bad_masks_and_ratios_are_refused():
    policy = _policy("llada")
    items = tokenize_pairs(policy, PAIRS[:1])
    good = [torch.zeros(len(items[0][1]), dtype=torch.bool)]
    with pytest.raises(ValueError, match=r"t: mask ratios must lie in \(0, 1\]"):
        masked_diffusion_loss(policy, items, good, torch.tensor([0.0]))
    with pytest.raises(ValueError, match="masks"):
        masked_diffusion_loss(policy, items, [good[0][:-1]], torch.tensor([0.5]))
    with pytest.raises(ValueError, match="family"):
        masked_diffusion_loss(_policy("sdar"), items, good, torch.tensor([0.5]))


def test_plain_run_saves_and_resumes_a_llada_run(tmp_path):
    cfg = SFTConfig(steps=4, batch_size=2, learning_rate=1e-2, warmup_steps=1, target_loss=None, log_every=1)
    straight = SFTRun(_policy("llada"), PAIRS, cfg, seed=0)
    a = [straight.train_step() for _ in range(4)]
    first = SFTRun(_policy("llada"), PAIRS, cfg, seed=0)
    b = [first.train_step() for _ in range(2)]
    first.save(tmp_path / "ckpt", {"key": "k"})
    second = SFTRun(_policy("llada", seed=1), PAIRS, cfg, seed=5)  # all of it restored from the folder
    assert second.load(tmp_path / "ckpt") == {"key": "k"}
    b += [second.train_step() for _ in range(2)]
    assert second.finished and second.step == 4
    assert [r["loss"] for r in a] == [r["loss"] for r in b] and [r["lr"] for r in a] == [r["lr"] for r in b]
    for k, v in straight.policy.state_dict().items():
        assert torch.equal(second.policy.state_dict()[k], v), k


def test_warm_start_trains_and_caches_a_dream_policy(tmp_path):
    cfg = SFTConfig(steps=3, batch_size=2, target_loss=None, log_every=1, cache_dir=str(tmp_path))
    policy = _policy("dream")
    before = policy.model.model.embed_tokens.weight.detach().clone()
    report = warm_start(policy, PAIRS, cfg, seed=0)
    assert report.steps == 3 and not report.cache_hit
    assert not torch.equal(before, policy.model.model.embed_tokens.weight)
    again = _policy("dream")
    assert warm_start(again, PAIRS, cfg, seed=0).cache_hit
    for k, v in policy.state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "sft_metrics.jsonl").read_text().splitlines()]


def test_dice_ray_sft_resumes_a_llada_run_through_deepspeed(tmp_path, capsys, monkeypatch):
    """``dice-ray sft`` with model.family=llada: 2 steps, a crash, --resume for 2 more == 4 straight steps."""
    args = ["--data", "builtin", "model.family=llada", "model.hidden_size=32", "model.intermediate_size=64",
            "model.num_hidden_layers=1", "model.num_attention_heads=2", "model.num_key_value_heads=1",
            "model.head_dim=16", "tasks.max_tasks=2", "sft.batch_size=2", "sft.warmup_steps=1",
            "sft.learning_rate=1e-2", "sft.log_every=1", "sft.num_threads=1", "sft.target_loss=null",
            "sft.steps=4", "sft.checkpoint_every=2"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main(["sft", "--out", str(straight), *args]) == 0
    real_step = SFTRun.train_step

    def crash_after_step_2(self):
        if self.step == 2:  # the checkpoint at step 2 is written
            raise KeyboardInterrupt
        return real_step(self)

    monkeypatch.setattr(SFTRun, "train_step", crash_after_step_2)
    with pytest.raises(KeyboardInterrupt):
        main(["sft", "--out", str(resumed), *args])
    monkeypatch.setattr(SFTRun, "train_step", real_step)
    capsys.readouterr()
    assert main(["sft", "--out", str(resumed), "--resume"]) == 0
    assert json.loads(capsys.readouterr().out)["resumed_from"] == 2
    ma, mb = _metrics(straight), _metrics(resumed)
    assert [r["step"] for r in mb] == [1, 2, 3, 4]
    assert [r["loss"] for r in ma] == [r["loss"] for r in mb]
    pa, pb = DiffusionPolicy.load(straight), DiffusionPolicy.load(resumed)
    assert pa.family == pb.family == "llada"
    for name, value in pa.state_dict().items():
        assert torch.equal(pb.state_dict()[name], value), name
