"""Row chunks of the learner (issue 42, ``cluster.learner_rows_per_chunk``): a group scored in chunks of its rows,
one forward + backward a chunk with gradient accumulation, takes the whole group's loss and gradients (every
parameter), for every estimator, with the k3 KL term, on the block-diffusion family (SDAR) and on LLaDA / Dream
infill groups (suffix and span trace); a DeepSpeed ``Learner.train_step`` (ZeRO-2 on CPU, gloo) takes the same
update; a wrong chunk weight is caught; the memory estimate scales with a chunk's rows."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import dice_ray.rl.loss as loss_module
from dice_ray.cluster.learner import Learner, TrainGroup, make_train_group, plan_step, row_chunks
from dice_ray.config import DiceConfig, ModelConfig, RLConfig, SamplingConfig, load_config
from dice_ray.policy.logprobs import ESTIMATORS, response_logprobs
from dice_ray.policy.policy import DiffusionPolicy
from dice_ray.rl.loss import LossStats, clipped_policy_loss, merge_chunk_stats
from _helpers import HANG_S, TINY_FAMILY_SHAPE, PlainEngine, joined_ray, saved_activation_bytes
from _helpers import one_torch_thread  # noqa: F401 (autouse: one torch thread)

REPO = Path(__file__).resolve().parents[1]
MAX_NEW = 16  # LLaDA / Dream infill spans grow 4 -> 16 (block_size 4)
CHUNKS = (1, 2, 3)  # of groups of 5 and 4 rows: uneven last chunks, and groups with fewer chunks than the step
STATS = ("loss", "clip_fraction", "kl", "ratio_mean")


class GradEngine(PlainEngine):
    """:class:`PlainEngine` (SGD) that keeps a copy of every parameter's gradient at each optimizer step, and counts
    the backwards and where the accumulation boundary was set."""

    def __init__(self, module, optimizer):
        super().__init__(module, optimizer)
        self.grads: list[list[torch.Tensor]] = []
        self.boundaries: list[bool] = []
        self._boundary = False

    def set_gradient_accumulation_boundary(self, flag):
        self._boundary = flag

    def backward(self, loss, scale_wrt_gas=False):
        self.boundaries.append(self._boundary)
        super().backward(loss)

    def step(self):
        self.grads.append([torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
                           for p in self.module.parameters()])
        super().step()


# ---- groups -----------------------------------------------------------------------------------------------------


def _sdar_policy(seed: int = 0) -> DiffusionPolicy:
    pol = DiffusionPolicy.build(ModelConfig(family="sdar", **TINY_FAMILY_SHAPE), seed=seed)
    with torch.no_grad():  # sharpen the random model: log-probs that depend on the state, ratios that clip
        pol.model.model.norm.weight.mul_(8.0)
    return pol


def _sdar_groups(pol: DiffusionPolicy) -> list[TrainGroup]:
    """Two SDAR groups of 5 and 4 samples (prompts and responses of different lengths, padded rows), behaviour
    log-probs the policy's TraceRL ones plus noise (ratios away from 1: some clip)."""
    gen = torch.Generator().manual_seed(3)
    bs, vocab = pol.block_size, pol.tokenizer.vocab_size
    out = []
    for G, P, blocks in ((5, 7, 3), (4, 5, 2)):
        R = blocks * bs
        ids = torch.randint(5, vocab, (P + G * R,), generator=gen)
        ids = torch.where(ids == pol.mask_id, ids + 1, ids)
        steps = torch.rand(G, blocks, bs, generator=gen).argsort(-1).view(G, R)  # a permutation a block
        mask = torch.ones(G, R, dtype=torch.bool)
        mask[1, R - 3:] = False  # a shorter response (its block's other tokens keep their steps)
        mask[G - 1, R - bs:] = False  # a padded block
        adv = torch.linspace(1.0, -1.2, G)
        prompt, resp = ids[:P], ids[P:].view(G, R)
        with torch.no_grad():
            blp = response_logprobs("tracerl", pol.model, prompt, resp, steps, mask, bs, pol.mask_id)
        blp = torch.where(mask, blp + 0.4 * torch.randn(G, R, generator=gen), torch.zeros_like(blp))
        out.append(TrainGroup(prompt, resp, steps, mask, blp, adv))
    return out


def _infill_policy(family: str, seed: int = 1) -> DiffusionPolicy:
    """A tiny LLaDA / Dream policy whose eos logit is raised (spans end at random places, some after growing)."""
    pol = DiffusionPolicy.build(ModelConfig(family=family, **TINY_FAMILY_SHAPE), seed=seed)
    bias = torch.zeros(pol.tokenizer.vocab_size)
    bias[pol.eos_id] = 5.0
    pol.model.lm_head.register_forward_hook(lambda module, inputs, out: out + bias.to(out.dtype))
    return pol


def _infill_groups(family: str) -> list[TrainGroup]:
    """Two infill groups (5 and 4 samples) the sampler drew between a task's prefix and suffix: suffix_ids and a
    span trace (span_lens) come along."""
    from dice_ray.policy.sampler import infill_group
    from dice_ray.tasks.loaders import load_tasks
    from dice_ray.tasks.prompts import infill_context

    pol = _infill_policy(family)
    cfg = SamplingConfig(max_new_tokens=MAX_NEW, temperature=1.0, remasking="static", steps_per_block=2)
    out = []
    for n, (task, seed) in zip((5, 4), ((0, 2), (1, 5))):
        before, after = infill_context(load_tasks("builtin").tasks[task])
        group = infill_group(pol, before, after, n, cfg, seed=seed)
        g = make_train_group(group[0].prompt_ids, list(group), torch.linspace(1.0, -1.2, n))
        g.behaviour_logprobs = torch.where(g.mask, g.behaviour_logprobs + 0.3 * torch.randn(g.mask.shape,
                                           generator=torch.Generator().manual_seed(seed)), 0.0)
        assert g.suffix_ids.numel() and g.span_lens.numel()
        out.append(g)
    return out


# ---- the learner without Ray or DeepSpeed ----------------------------------------------------------------------


def _step(family: str, estimator: str, rows_per_chunk: int, groups: list[TrainGroup]):
    """Two PPO epochs of ``Learner.train_step`` on ``groups`` in one micro-batch (SGD; the KL term on): its stats,
    each epoch's gradients, the weights after, and the engine (backwards, boundaries)."""
    pol = _sdar_policy() if family == "sdar" else _infill_policy(family)
    ref = (_sdar_policy(seed=7) if family == "sdar" else _infill_policy(family, seed=7)).model.requires_grad_(False)
    learner = object.__new__(Learner.__ray_actor_class__)
    learner.cfg = DiceConfig(
        model=ModelConfig(family=family, **TINY_FAMILY_SHAPE),
        rl=RLConfig(logprob_estimator=estimator, seed=3, beta=0.05, ppo_epochs=2, epsilon=0.2),
        sampling=SamplingConfig(max_new_tokens=MAX_NEW),
        cluster={"micro_batch_tokens": 10**6, "learner_rows_per_chunk": rows_per_chunk},
    )
    learner.policy = SimpleNamespace(block_size=pol.block_size, mask_id=pol.mask_id)
    engine = GradEngine(pol.model, torch.optim.SGD(pol.model.parameters(), lr=0.5))
    learner.device, learner.engine, learner.ref_model, learner.step_count = torch.device("cpu"), engine, ref, 0
    out = learner.train_step(groups)
    return out, engine.grads, [p.detach().clone() for p in pol.model.parameters()], engine


def _max_rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """Largest difference of two lists of tensors, relative to the largest magnitude among them."""
    scale = max(float(t.abs().max()) for t in a)
    return max(float((x - y).abs().max()) for x, y in zip(a, b)) / scale


def _assert_same_update(whole, chunked, what: str) -> None:
    (out0, grads0, w0, _), (out1, grads1, w1, _) = whole, chunked
    for key in STATS:
        assert out1[key] == pytest.approx(out0[key], rel=1e-5, abs=1e-7), (what, key, out0[key], out1[key])
    assert out1["groups"] == out0["groups"] and out1["tokens"] == out0["tokens"]
    assert len(grads1) == len(grads0) == 2
    for epoch, (g0, g1) in enumerate(zip(grads0, grads1)):
        assert all(t.shape == u.shape for t, u in zip(g0, g1))
        err = _max_rel(g0, g1)
        assert err < 1e-5, f"{what}: epoch {epoch + 1}'s gradients differ by {err:.2e} of their largest"
    assert _max_rel(w0, w1) < 1e-5, what


CASES = [("sdar", e) for e in ESTIMATORS] + [("llada", e) for e in ESTIMATORS] + [("dream", "tracerl"),
                                                                                    ("dream", "coupled")]


@pytest.mark.parametrize("family, estimator", CASES)
def test_chunked_groups_take_the_whole_groups_loss_and_gradients(family, estimator):
    groups = _sdar_groups(_sdar_policy()) if family == "sdar" else _infill_groups(family)
    whole = _step(family, estimator, 0, groups)
    out, grads, _, engine = whole
    assert out["row_chunks"] == 1 and len(engine.boundaries) == 2  # one backward an epoch: the micro-batch
    assert out["kl"] > 0 and out["loss"] != 0.0 and max(float(g.abs().max()) for g in grads[0]) > 0
    if estimator == "tracerl" or family == "sdar":
        assert out["clip_fraction"] > 0  # the clip is exercised (behaviour log-probs off the policy's, or epoch 2)
    for rows in CHUNKS:
        chunked = _step(family, estimator, rows, groups)
        n = len(row_chunks(5, rows))
        assert chunked[0]["row_chunks"] == n and chunked[3].boundaries == ([False] * (n - 1) + [True]) * 2
        _assert_same_update(whole, chunked, f"{family}/{estimator}, {rows} row(s) a chunk")


def test_a_wrong_chunk_weight_is_caught(monkeypatch):
    """The comparison above fails when a chunk's loss is its own rows' mean (not the group's share)."""
    groups = _sdar_groups(_sdar_policy())
    whole = _step("sdar", "tracerl", 0, groups)

    def chunk_mean(*args, num_sequences=None, **kwargs):
        return clipped_policy_loss(*args, **kwargs)

    monkeypatch.setattr(loss_module, "clipped_policy_loss", chunk_mean)
    wrong = _step("sdar", "tracerl", 2, groups)
    with pytest.raises(AssertionError):
        _assert_same_update(whole, wrong, "a chunk weighted as a group")


def test_chunk_rows_score_as_in_the_whole_group():
    """A row's log-probs do not depend on the chunk it is scored in (the coupled mask is the group's)."""
    pol = _sdar_policy()
    g = _sdar_groups(pol)[0]
    for est in ESTIMATORS:
        args = (est, pol.model, g.prompt_ids, g.response_ids, g.unmask_step, g.mask, pol.block_size, pol.mask_id)
        with torch.no_grad():
            whole = response_logprobs(*args, seed=11)
            parts = torch.cat([response_logprobs(*args, seed=11, rows=r) for r in row_chunks(5, 2)])
        torch.testing.assert_close(parts, whole, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="rows"):
        response_logprobs(*args, rows=slice(3, 3))
    with pytest.raises(ValueError, match="rows"):
        response_logprobs(*args, rows=slice(0, 4, 2))


def test_loss_of_chunks_sums_to_the_groups_and_stats_merge():
    gen = torch.Generator().manual_seed(0)
    G, R = 5, 6
    lp, blp, ref = (torch.randn(G, R, generator=gen) - 3 for _ in range(3))
    adv, mask = torch.randn(G, generator=gen), torch.rand(G, R, generator=gen) > 0.3
    mask[2] = False  # a row with no token
    whole, ws = clipped_policy_loss(lp, blp, adv, mask, beta=0.1, ref_logprobs=ref)
    parts = [clipped_policy_loss(lp[r], blp[r], adv[r], mask[r], beta=0.1, ref_logprobs=ref[r], num_sequences=G)
             for r in row_chunks(G, 2)]
    assert float(sum(p[0] for p in parts)) == pytest.approx(float(whole), rel=1e-6)
    merged = merge_chunk_stats([p[1] for p in parts])
    for key in STATS:
        assert getattr(merged, key) == pytest.approx(getattr(ws, key), rel=1e-6, abs=1e-7)
    assert merged.tokens == ws.tokens == int(mask.sum())
    with pytest.raises(ValueError, match="num_sequences"):
        clipped_policy_loss(lp, blp, adv, mask, num_sequences=G - 1)
    with pytest.raises(ValueError, match="no chunk"):
        merge_chunk_stats([])
    assert merge_chunk_stats([LossStats(0.0, 0.0, 0.0, 0.0, 0)]).ratio_mean == 0.0


def test_row_chunks_and_the_plan():
    assert row_chunks(5, 2) == [slice(0, 2), slice(2, 4), slice(4, 5)]
    assert row_chunks(4, 0) == row_chunks(4, 4) == row_chunks(4, 9) == [slice(0, 4)]
    with pytest.raises(ValueError):
        row_chunks(0, 1)
    with pytest.raises(ValueError):
        row_chunks(3, -1)
    groups = _sdar_groups(_sdar_policy())
    shares = plan_step(groups, 3, 0, rows_per_chunk=2)  # every rank, the padding one too, takes 3 backwards
    assert [s.chunks for s in shares] == [3, 3, 3] and all(s.rows_per_chunk == 2 for s in shares)
    assert plan_step(groups, 1, 0)[0].chunks == 1
    with pytest.raises(ValueError, match="rows_per_chunk"):
        plan_step(groups, 1, 0, rows_per_chunk=-1)
    with pytest.raises(ValueError):
        load_config(None, ["cluster.learner_rows_per_chunk=-1"])


# ---- DeepSpeed (ZeRO-2 on CPU, gloo) ------------------------------------------------------------------------------

_DEEPSPEED_STEPS = r"""
import sys, torch
from dice_ray.cluster.learner import Learner
from dice_ray.config import load_config
from dice_ray.policy.policy import DiffusionPolicy

groups = torch.load(sys.argv[1], weights_only=False)
shape = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=2",
         "model.num_attention_heads=4", "model.num_key_value_heads=2", "model.head_dim=8"]
results = {}
for zero in (0, 2):
    for rows in (0, 2):
        cfg = load_config(None, shape + ["rl.logprob_estimator=tracerl", "rl.beta=0.05", "rl.learning_rate=1e-3",
                                         "rl.max_grad_norm=1000", f"cluster.zero_stage={zero}",
                                         "cluster.micro_batch_tokens=0", f"cluster.learner_rows_per_chunk={rows}"])
        learner = object.__new__(Learner.__ray_actor_class__)  # the actor's class in this process, without Ray
        learner.cfg, learner.rank, learner.world_size, learner.use_gpu = cfg, 0, 1, False
        learner.device = torch.device("cpu")
        learner.policy = DiffusionPolicy.from_config(cfg.model)
        learner.engine = learner.ref_model = learner.weight_group = None
        learner.step_count, learner.warm_started = 0, False
        learner.init_engine()
        outs = [learner.train_step(groups) for _ in range(2)]  # the second step's AdamW moments hold the first's
        weights = [p.detach().clone() for p in learner.engine.module.parameters()]
        results[(zero, rows)] = (outs, weights)
torch.save(results, sys.argv[2])
"""


def test_deepspeed_train_step_takes_the_same_update_chunked(tmp_path):
    """Two ``Learner.train_step`` calls through DeepSpeed (ZeRO-0 and ZeRO-2, gloo, one rank; two micro-batches of
    a group each, the KL reference on): 2 rows a chunk (3 and 2 backwards a group) give the whole groups' losses,
    gradient norms and weights."""
    pol = _sdar_policy()
    groups_path, out_path = tmp_path / "groups.pt", tmp_path / "out.pt"
    torch.save(_sdar_groups(pol), groups_path)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR",
                                                            "LOCAL_RANK")}
    env |= {"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", _DEEPSPEED_STEPS, str(groups_path), str(out_path)], env=env,
                          capture_output=True, text=True, timeout=HANG_S, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = torch.load(out_path, weights_only=False)
    start = [p.detach() for p in DiffusionPolicy.from_config(load_config(None, [
        "model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=2",
        "model.num_attention_heads=4", "model.num_key_value_heads=2", "model.head_dim=8"]).model).model.parameters()]
    for zero in (0, 2):
        (outs0, w0), (outs1, w1) = results[(zero, 0)], results[(zero, 2)]
        assert [o["row_chunks"] for o in outs1] == [3, 3] and [o["micro_batches"] for o in outs1] == [2, 2]
        for o0, o1 in zip(outs0, outs1):
            for key in STATS:
                assert o1[key] == pytest.approx(o0[key], rel=1e-5, abs=1e-7), (zero, key)
            assert o0["grad_norm"] > 0 and o1["grad_norm"] == pytest.approx(o0["grad_norm"], rel=1e-5), zero
        moved = max(float((a - b).abs().max()) for a, b in zip(w0, start))
        assert moved > 1e-4, "the steps should move the weights"
        diff = max(float((a - b).abs().max()) for a, b in zip(w0, w1))
        # AdamW's first step is nearly lr x sign(grad): the gradient norms above check the loss's scale, the weights
        # its direction; 1 % of a step (lr 1e-3) leaves room for an element whose gradient is near AdamW's eps
        assert diff < 1e-5, f"ZeRO-{zero}: chunked weights differ from the whole group's by {diff:.2e}"


@pytest.mark.slow
def test_two_gloo_ranks_chunked_take_the_one_rank_whole_group_update(ray_head):
    """2 DeepSpeed ranks (ZeRO-2, gloo, Ray actors) scoring 2 rows a chunk take the update 1 rank takes on whole
    groups: 5 groups of 5 and 4 rows over 2 ranks, one a micro-batch (3 on each rank, one of them padding), 3
    backwards each (a group of 4 rows has 2 chunks: its micro-batch's third backward is a zero-weight one)."""
    ray = pytest.importorskip("ray")
    from dice_ray.cluster.learner import LearnerGroup, learner_env

    pol = _sdar_policy()
    groups = (_sdar_groups(pol) * 3)[:5]
    shape = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=2",
             "model.num_attention_heads=4", "model.num_key_value_heads=2", "model.head_dim=8"]

    def group(ranks: int, zero: int, rows: int) -> LearnerGroup:
        cfg = load_config(None, shape + ["rl.logprob_estimator=coupled", "rl.beta=0.01", "rl.seed=5",
                                         f"cluster.zero_stage={zero}", f"cluster.learner_ranks={ranks}",
                                         "cluster.micro_batch_tokens=100", f"cluster.learner_rows_per_chunk={rows}"])
        return LearnerGroup(cfg, use_gpu=False, num_threads=1, env=learner_env(False))

    with joined_ray(ray_head):
        one, two = group(1, 2, 0), group(2, 2, 2)  # ZeRO-2 both: its reported norm differs from ZeRO-0's in ~1e-5
        ray.get([one.init_engine.remote(), two.init_engine.remote()])
        s1, s2 = ray.get([one.train_step.remote(groups), two.train_step.remote(groups)])
        assert s2["ranks"] == 2 and s2["row_chunks"] == 3 and s1["row_chunks"] == 1 and s2["micro_batches"] == 3
        assert s1["groups"] == s2["groups"] == 5 and s1["tokens"] == s2["tokens"]
        for key in STATS:
            assert s2[key] == pytest.approx(s1[key], rel=1e-5, abs=1e-7), key
        assert s1["grad_norm"] > 0 and s2["grad_norm"] == pytest.approx(s1["grad_norm"], rel=1e-5)
        w1, w2 = ray.get([one.weights_ref(), two.weights_ref()])
        assert max(float((w1[k] - w2[k]).abs().max()) for k in w1) < 1e-5
        for g in (one, two):
            g.shutdown()


# ---- the memory estimate --------------------------------------------------------------------------------------


@pytest.mark.parametrize("family, est", [("sdar", "tracerl"), ("sdar", "coupled"), ("llada", "tracerl"),
                                         ("sdar", "diffu_grpo")])
def test_activation_estimate_of_a_chunk_matches_what_autograd_keeps(family, est):
    """Bytes autograd saves while scoring one row chunk (2 of 4 rows) against :func:`group_activations` with
    ``cluster.learner_rows_per_chunk=2``, as tests/test_plan.py checks a whole group; and the estimate of a chunk
    is the one of a group of that many rows."""
    from dice_ray.cluster.memory_estimate import group_activations, model_shape, scoring_states

    G, P, R, rows = 4, 24, 32, 2
    mc = ModelConfig(family=family, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
    cfg = DiceConfig(model=mc, rl={"num_generations": G, "logprob_estimator": est}, sampling={"max_new_tokens": R},
                     cluster={"learner_rows_per_chunk": rows})
    policy = DiffusionPolicy.build(mc)
    gen = torch.Generator().manual_seed(0)
    prompt, response = torch.randint(10, 200, (P,), generator=gen), torch.randint(10, 200, (G, R), generator=gen)
    steps = torch.arange(R).remainder(mc.block_size) if family == "sdar" else torch.arange(R)
    saved = saved_activation_bytes(policy.model, lambda: response_logprobs(
        est, policy.model, prompt, response, steps.expand(G, R).clone(), torch.ones(G, R, dtype=torch.bool),
        mc.block_size, policy.mask_id, seed=1, canvas_len=R, rows=slice(0, rows)))
    shape = model_shape(cfg.model)
    want, what = group_activations(cfg, shape, P)
    fewer = DiceConfig(model=mc, rl={"num_generations": rows, "logprob_estimator": est}, sampling={"max_new_tokens": R})
    assert want == group_activations(fewer, shape, P)[0]  # a chunk of 2 rows costs what a group of 2 does
    assert want < group_activations(cfg.model_copy(update={"cluster": cfg.cluster.model_copy(
        update={"learner_rows_per_chunk": 0})}), shape, P)[0]
    assert f"{rows} of {G} rows" in what
    n = scoring_states(cfg, shape)
    want -= math.ceil(rows * R / n) * shape.vocab * 6  # logits alive during one pass only
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    if est == "diffu_grpo":
        tokens = (rows if family == "sdar" else 1) * (P + R)
    else:
        tokens = P + rows * R * (1 + n) if family == "sdar" else n * rows * (P + R)
    cpu_norm = 2 * h + (q + kv if family == "sdar" else 0)
    want += tokens * (shape.layers * cpu_norm + h) * shape.dtype_bytes
    got = saved
    assert abs(want - got) <= 0.15 * got, (want, got)


@pytest.mark.parametrize("preset, over, says", [
    ("cluster-8b", ["sampling.max_new_tokens=4096"], "a row chunk of 1 of a group's 16 samples x "
     "sampling.max_new_tokens=4096, and ZeRO does not split it) leave no room: lower sampling.max_new_tokens"),
    ("8gpu", ["cluster.learner_rows_per_chunk=4"], "a row chunk of 4 of a group's 16 samples x sampling.max_new_tokens="
     "4096, and ZeRO does not split it) leave no room: lower cluster.learner_rows_per_chunk"),
])
def test_the_dry_run_names_the_chunk_when_it_does_not_fit(preset, over, says, capsys, monkeypatch):
    """DICE's 4096 tokens at 8B do not fit one sample a backward; 4 samples a backward of DICE's shape do not fit at
    1.7B: the refusal names the chunk and what to lower."""
    import dice_ray.cluster.plan as plan_mod
    from dice_ray.cli import main

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(plan_mod, "local_gpus", lambda: None)
    try:
        rc = main(["train", "--config", str(REPO / "configs" / f"{preset}.yaml"), "--dry-run", "--cluster-gpus", "16",
                   "--gpus-per-node", "8", "--gpu-memory-gib", "140.4", *over])
    except SystemExit as e:
        rc = e.code
    err = " ".join(capsys.readouterr().err.split())
    assert rc == 2 and says in err, err


# ---- benchmarks/learner_throughput.py --rows-per-chunk ------------------------------------------------------------


def test_benchmark_rows_per_chunk_options(capsys):
    from _helpers import load_benchmark

    bench = load_benchmark("learner_throughput")
    assert bench.parse_args(["--device", "cpu", "--tiny"]).rows_per_chunk == [2]
    args = bench.parse_args(["--device", "cpu", "--micro-batch", "4"])  # its old name
    assert args.rows_per_chunk == [4] and args.rows == 4
    assert bench.parse_args(["--device", "cpu", "--rows-per-chunk", "0,8,1"]).rows_per_chunk == [0, 8, 1]
    for bad in ("-1", "a", "2,2"):
        with pytest.raises(SystemExit):
            bench.parse_args(["--device", "cpu", "--rows-per-chunk", bad])
        assert "--rows-per-chunk" in capsys.readouterr().err
