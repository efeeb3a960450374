"""SDAR groups of several prompts decoded in one batch (``sample_ids_batch`` / ``sample_groups``): each group gets
what it gets alone (its own seed, its own prompt length: left padding never attended, its own RoPE positions), rows
and whole groups ending early, the no-cache path, task groups (infill and end-to-end prompts) and the rollout
worker's ``generate``; bad input. CPU, fp32: the same tokens and unmask steps, log-probs within 1e-5 (batched GEMMs
and padded attention sum in another order). The CUDA-graph replay of a batch: tests/test_policy_gpu.py."""

from __future__ import annotations

import pytest
import torch

from dice_ray.cluster.rollout import GroupRollout, RolloutWorker
from dice_ray.cluster.scheduler import PromptRequest
from dice_ray.config import ModelConfig, SamplingConfig
from dice_ray.policy.model import KVCache
from dice_ray.policy.policy import DiffusionPolicy
from dice_ray.policy.sampler import draw_tokens, sample_group, sample_groups, sample_ids, sample_ids_batch
from dice_ray.policy.task_sampling import sample_task_group, sample_task_groups
from dice_ray.tasks.loaders import load_tasks

TINY = ModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=8, max_position_embeddings=512, block_size=4)
LP_TOL = 1e-5
CONFIGS = {
    "dynamic": SamplingConfig(max_new_tokens=24, remasking="dynamic", threshold=0.5, temperature=1.0),
    "static2-tempered": SamplingConfig(max_new_tokens=24, remasking="static", steps_per_block=2, temperature=0.7,
                                       top_k=20, top_p=0.9),
    "greedy": SamplingConfig(max_new_tokens=24, remasking="dynamic", threshold=0.9, temperature=0.0),
}


@pytest.fixture(scope="module")
def policy():
    pol = DiffusionPolicy.build(TINY, seed=0)
    with torch.no_grad():
        pol.model.model.norm.weight.mul_(40.0)  # confident: dynamic remasking unmasks several tokens a step
    return pol


def _prompts(policy, lengths=(11, 3, 17, 6)) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    special = max(policy.pad_id, policy.mask_id, policy.eos_id)
    return [torch.randint(special + 1, policy.tokenizer.vocab_size, (n,), generator=gen).tolist() for n in lengths]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _same(got, want, tol=LP_TOL):
    """``got`` and ``want`` are (responses, steps, logprobs) of one group: equal tokens and steps, close log-probs."""
    assert got[0] == want[0] and got[1] == want[1]
    assert max((abs(x - y) for r, s in zip(got[2], want[2]) for x, y in zip(r, s)), default=0.0) < tol


@pytest.mark.parametrize("G", [1, 3])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_batched_groups_equal_each_group_alone(policy, name, G):
    cfg, prompts, seeds = CONFIGS[name], _prompts(policy), [3, 1, 4, 1]  # two groups share a seed: still their own
    per, stats = sample_ids_batch(policy, prompts, G, cfg, [_gen(s) for s in seeds])
    assert len(per) == len(prompts) and stats.num_samples == len(prompts) * G
    assert stats.prompt_tokens == sum(map(len, prompts)) and stats.new_tokens == len(prompts) * G * 24
    for prompt, seed, got in zip(prompts, seeds, per):
        alone = sample_ids(policy, prompt, G, cfg, _gen(seed))
        _same(got, alone[:3])
        assert all(len(r) == 24 for r in got[0]) and policy.mask_id not in sum(got[0], [])
    if name == "dynamic":
        assert any(s == 0 for resp in per for row in resp[1] for s in row[1:4])  # parallel unmasking happened


def test_a_group_does_not_depend_on_its_batch_mates(policy):
    cfg, prompts = CONFIGS["dynamic"], _prompts(policy)
    full, _ = sample_ids_batch(policy, prompts, 2, cfg, [_gen(10 + i) for i in range(4)])
    pair, _ = sample_ids_batch(policy, [prompts[3], prompts[0]], 2, cfg, [_gen(13), _gen(10)])  # other order, fewer
    _same(pair[0], full[3])
    _same(pair[1], full[0])


def _eos_ending_some_rows(policy, prompts, G, cfg, seeds):
    """An ``<|eos|>`` stand-in that ends some rows in their 2nd block while others go on: a token drawn in block 2
    of some row and in none of another row's first two blocks."""
    policy.eos_id = -1
    per, _ = sample_ids_batch(policy, prompts, G, cfg, [_gen(s) for s in seeds])
    rows = [r for resp, _, _ in per for r in resp]
    return next(t for r in rows for t in r[4:8] if any(t not in other[:8] for other in rows))


def test_rows_and_whole_groups_ending_early(policy):
    cfg, prompts, seeds, G = CONFIGS["dynamic"], _prompts(policy), [5, 6, 7, 8], 3
    eos = policy.eos_id
    try:
        policy.eos_id = _eos_ending_some_rows(policy, prompts, G, cfg, seeds)
        per, stats = sample_ids_batch(policy, prompts, G, cfg, [_gen(s) for s in seeds])
        lengths = [[len(r) for r in resp] for resp, _, _ in per]
        assert min(map(min, lengths)) < 24 and max(map(max, lengths)) == 24  # some rows ended, others went on
        for prompt, seed, got in zip(prompts, seeds, per):
            _same(got, sample_ids(policy, prompt, G, cfg, _gen(seed))[:3])
        assert stats.new_tokens == sum(map(sum, lengths))
        # a whole group that ends before the others: alone it stops, in the batch it idles without drawing
        ended = [i for i, ls in enumerate(lengths) if max(ls) < 24]
        if not ended:  # make one: the group whose rows all end soonest, alone in a batch with a long-running one
            pytest.skip("no group ended as a whole with this stand-in")
        i = ended[0]
        j = next(k for k, ls in enumerate(lengths) if max(ls) == 24)
        pair, _ = sample_ids_batch(policy, [prompts[i], prompts[j]], G, cfg, [_gen(seeds[i]), _gen(seeds[j])])
        _same(pair[0], per[i])
        _same(pair[1], per[j])
    finally:
        policy.eos_id = eos


def test_a_whole_group_ending_first_keeps_the_others_draws(policy):
    """Group 0 ends in its first block (every token is the stand-in eos under greedy decoding), group 1 decodes on
    at temperature 1: its draws are those it makes alone (group 0 stops drawing, its generator is not consulted)."""
    cfg = CONFIGS["dynamic"]
    prompts = _prompts(policy, (9, 4))
    eos = policy.eos_id
    try:
        policy.eos_id = -1
        first = sample_ids(policy, prompts[0], 2, cfg, _gen(0))[0]
        policy.eos_id = first[0][0]  # row 0 of group 0 ends in block 1
        per, _ = sample_ids_batch(policy, prompts, 2, cfg, [_gen(0), _gen(1)])
        assert len(per[0][0][0]) == 4
        for prompt, seed, got in zip(prompts, (0, 1), per):
            _same(got, sample_ids(policy, prompt, 2, cfg, _gen(seed))[:3])
    finally:
        policy.eos_id = eos


def test_batch_without_the_kv_cache_matches_the_cached_batch(policy):
    cfg, prompts = CONFIGS["static2-tempered"], _prompts(policy)
    cached, a = sample_ids_batch(policy, prompts, 2, cfg, [_gen(i) for i in range(4)])
    plain, b = sample_ids_batch(policy, prompts, 2, cfg, [_gen(i) for i in range(4)], kv_cache=False)
    for got, want in zip(plain, cached):
        _same(got, want, tol=1e-4)
    assert b.forwards == a.forwards - 1  # no prefill forward without a cache


def test_sample_groups_rollouts_and_their_share_of_the_batch(policy):
    cfg = CONFIGS["dynamic"]
    texts = ["def relu(x):\n    return x\n", "import torch\n", "class Model(nn.Module):\n    pass  # a longer one\n"]
    assert len({len(policy.encode(t)) for t in texts}) == 3
    groups = sample_groups(policy, texts, 2, cfg, [1, 2, 3])
    for text, seed, group in zip(texts, (1, 2, 3), groups):
        alone = sample_group(policy, text, 2, cfg, seed)
        assert [r.response_ids for r in group] == [r.response_ids for r in alone]
        assert [r.unmask_step for r in group] == [r.unmask_step for r in alone]
        assert [r.text for r in group] == [r.text for r in alone] and group[0].prompt_ids == policy.encode(text)
        assert group.stats.num_samples == 2 and group.stats.prompt_tokens == len(policy.encode(text))
        assert group.stats.new_tokens == sum(len(r.response_ids) for r in group)
    # the batch's wall time, shared by rows: equal shares (equal G), one forward count
    assert len({g.stats.seconds for g in groups}) == 1 and groups[0].stats.seconds > 0
    assert len({g.stats.forwards for g in groups}) == 1


def test_task_groups_batch_infill_and_end_to_end_prompts():
    """SDAR keeps the infill scaffold in its prompt, so infill and end-to-end groups share a batch; each equals
    ``sample_task_group`` alone, candidates included, in the items' order."""
    policy = DiffusionPolicy.build(TINY, seed=0)
    tasks = load_tasks("builtin").tasks[:2]
    cfg = SamplingConfig(max_new_tokens=8, temperature=1.0, max_batch_rows=4)  # 2 groups of 2 a batch: 2 batches
    items = [(tasks[0], "infill", 4), (tasks[1], "e2e", 5), (tasks[0], "e2e", 6), (tasks[1], "infill", 7)]
    got = sample_task_groups(policy, items, "compact", "source", 2, cfg)
    assert len(got) == 4
    for (task, phase, seed), (group, candidates) in zip(items, got):
        alone, want = sample_task_group(policy, task, phase, "compact", "source", 2, cfg, seed)
        assert [r.response_ids for r in group] == [r.response_ids for r in alone]
        assert [r.unmask_step for r in group] == [r.unmask_step for r in alone]
        assert candidates == want and group[0].prompt_ids == alone[0].prompt_ids
    # one group a batch (0 or 1, or a cap below G) gives the same groups
    for cap in (0, 1):
        one = sample_task_groups(policy, items, "compact", "source", 2, cfg.model_copy(update={"max_batch_rows": cap}))
        assert [[r.response_ids for r in g] for g, _ in one] == [[r.response_ids for r in g] for g, _ in got]


def _worker(policy, cfg: SamplingConfig):
    worker = object.__new__(RolloutWorker.__ray_actor_class__)  # the actor's class in this process, without Ray
    worker.policy, worker.sampling_cfg, worker.template, worker.granularity = policy, cfg, "compact", "source"
    worker.free_cache, worker.device, worker.version, worker.calls = False, "cpu", 3, 0
    return worker


def test_worker_generate_batches_a_calls_requests():
    policy = DiffusionPolicy.build(TINY, seed=0)
    tasks = {t.task_id: t for t in load_tasks("builtin").tasks[:3]}
    ids = list(tasks)
    requests = [PromptRequest(f"r{i}", ids[i % 3], "infill" if i % 2 else "e2e", 100 + i) for i in range(5)]
    cfg = SamplingConfig(max_new_tokens=8, temperature=1.0)
    batched = _worker(policy, cfg.model_copy(update={"max_batch_rows": 6})).generate(requests, 2, tasks)  # 3 a batch
    single = _worker(policy, cfg.model_copy(update={"max_batch_rows": 0})).generate(requests, 2, tasks)
    assert [g.request for g in batched] == requests
    for a, b in zip(batched, single):
        assert isinstance(a, GroupRollout) and a.weights_version == 3
        assert [r.response_ids for r in a.rollouts] == [r.response_ids for r in b.rollouts]
        assert a.candidates == b.candidates and a.tokens == b.tokens == sum(len(r.response_ids) for r in a.rollouts)
        assert a.seconds > 0
    with pytest.raises(KeyError):
        _worker(policy, cfg).generate([PromptRequest("x", "no-such-task", "e2e", 0)], 2, tasks)


def test_kv_cache_expand_repeats_each_row_of_a_preallocated_batch():
    cache = KVCache(capacity=4)
    cache.keys[0] = torch.arange(2.0)[:, None, None, None].expand(2, 1, 4, 1).clone()
    cache.values[0] = cache.keys[0] + 10
    cache.expand(3)
    assert cache.keys[0][:, 0, 0, 0].tolist() == [0, 0, 0, 1, 1, 1]
    assert cache.values[0][:, 0, 0, 0].tolist() == [10, 10, 10, 11, 11, 11]
    plain = KVCache()
    plain.keys[0] = torch.zeros(2, 1, 3, 1)
    with pytest.raises(ValueError, match="cache batch is 2"):
        plain.expand(2)


def test_draw_tokens_one_generator_a_group():
    logits = torch.randn(2, 4, 9).repeat(3, 1, 1)  # three groups of 2 rows, the same logits
    whole, _ = draw_tokens(logits, 1.0, None, None, torch.Generator().manual_seed(1))
    parts, _ = draw_tokens(logits, 1.0, None, None, [torch.Generator().manual_seed(1), None,
                                                     torch.Generator().manual_seed(1)])
    assert torch.equal(parts[:2], whole[:2]) and torch.equal(parts[4:], whole[:2])  # each group's own draws
    assert torch.equal(parts[2:4], logits[2:4].argmax(-1))  # a group that draws nothing: its most likely tokens
    with pytest.raises(ValueError, match="generators"):
        draw_tokens(logits, 1.0, None, None, [torch.Generator()] * 4)


def test_batched_sampling_rejects_bad_input(policy):
    cfg = SamplingConfig(max_new_tokens=8)
    with pytest.raises(ValueError, match="prompts: must not be empty"):
        sample_ids_batch(policy, [], 2, cfg, [])
    with pytest.raises(ValueError, match="prompt_ids: must not be empty"):
        sample_ids_batch(policy, [[5, 6], []], 2, cfg, [_gen(0), _gen(1)])
    with pytest.raises(ValueError, match="num_samples"):
        sample_ids_batch(policy, [[5, 6]], 0, cfg, [_gen(0)])
    with pytest.raises(ValueError, match="generators"):
        sample_ids_batch(policy, [[5, 6], [7]], 2, cfg, [_gen(0)])
    with pytest.raises(ValueError, match="max_position_embeddings"):
        sample_ids_batch(policy, [[5] * 10, [5] * 500], 1, cfg.model_copy(update={"max_new_tokens": 16}),
                         [_gen(0), _gen(1)])
    with pytest.raises(ValueError, match="seeds"):
        sample_groups(policy, ["a", "b"], 2, cfg, [1])
    with pytest.raises(ValueError, match="prompt_ids: must not be empty"):
        sample_groups(policy, ["a", ""], 2, cfg, [1, 2])
    with pytest.raises(ValueError, match="max_batch_rows"):
        SamplingConfig(max_batch_rows=-1)


def test_bidirectional_families_keep_one_group_a_batch():
    from _helpers import TINY_FAMILY_SHAPE

    pol = DiffusionPolicy.build(ModelConfig(family="llada", **TINY_FAMILY_SHAPE), seed=1)
    cfg = SamplingConfig(max_new_tokens=8, temperature=1.0)
    with pytest.raises(ValueError, match="SDAR block decoding only"):
        sample_ids_batch(pol, [[5, 6]], 2, cfg, [_gen(0)])
    groups = sample_groups(pol, ["def f(x):\n", "import torch\n"], 2, cfg, [1, 2])
    for text, seed, group in zip(["def f(x):\n", "import torch\n"], (1, 2), groups):
        assert [r.response_ids for r in group] == [r.response_ids for r in sample_group(pol, text, 2, cfg, seed)]
