"""Rollout throughput: the dynamic-threshold + KV-cache sampler against the one-token-a-step sampler.

For each model (the project's tiny policy and a random-init SDAR-1.7B-shape model: Qwen3-1.7B's
hidden 2048, 28 layers, 16 query / 8 KV heads, head_dim 128, MLP 6144, vocab 151936, tied embeddings,
block 4, bf16 on a GPU), one random-token prompt and a batch of G samples of it
(:func:`dice_ray.policy.sampler.sample_ids`, greedy), the samplers side by side:

* ``one-token, no cache``: static remasking, one token a step, the prompt and every finished block re-run
  at each step (``kv_cache=False``), the naive baseline;
* ``one-token, KV cache``: the same with the block KV cache (isolates the cache's gain);
* ``dynamic, KV cache``: Fast-dLLM's confidence threshold (every masked token >= threshold, at least one
  a step) with the KV cache: the sampler DICE uses;
* ``dynamic, KV, no graphs`` (on a GPU, at the first scale): the same without CUDA graphs
  (``sampling.cuda_graphs=false``): every kernel of a denoising forward launched from Python, which
  isolates the graphs' gain. The cached samplers above replay CUDA graphs on a GPU (the default).

Each is warmed up, then timed ``--repeats`` times (CUDA-synchronised; the no-cache baseline
``--nocache-repeats`` times, it is slow); figures are medians. Peak GPU memory is
``torch.cuda.max_memory_allocated`` during the run (weights included). ``<|eos|>`` is disabled so every
row decodes all ``--new-tokens`` (random weights would stop rows at random).

``--groups N`` also times a rollout worker's step shape: ``N`` groups of ``--group-size`` rows, prompts of
different lengths (spread over ``--prompt-len / 2 .. --prompt-len``), each group with its own seed, decoded one
group a batch (``groups, one at a time``: what a worker did before ``sampling.max_batch_rows``) and several groups
a batch of up to ``--max-batch-rows`` rows (``groups, batched``: :func:`dice_ray.policy.sampler.sample_ids_batch`,
the prompts left-padded), with the dynamic sampler (greedy); it prints the tokens/s of each and their ratio, and
whether the greedy outputs agree (fp32: identical up to rounding; bf16 rounds batched GEMMs differently).

Random weights predict almost uniformly (top probability ~1/V), so no token reaches the threshold and the
dynamic sampler then unmasks one token a step, exactly the baseline algorithm. ``--logit-scales`` also
runs the models with the final RMSNorm weight multiplied (as tests/test_policy_gpu.py does), which makes
the predictions confident: 1 is the plain random init (dynamic = one token a step), 40 makes them peaked
(the SDAR-1.7B shape then unmasks ~2 tokens a step on an H200; the tiny and mini models stay near 1). A
trained policy lies between; the
``tok/step`` column (mean tokens a row unmasked a denoising step) shows which case a row measured. The
no-cache baseline runs at the first scale only: its cost does not depend on the weights (one token a step,
fixed length). Agreement: greedy outputs of each sampler against ``one-token, KV cache``.

    python benchmarks/rollout_throughput.py [--device cuda] [--models tiny,sdar-1.7b] [--batch 64]
        [--prompt-len 512] [--new-tokens 512] [--threshold 0.9] [--logit-scales 1,40] [--repeats 3]
        [--nocache-repeats 1] [--no-nocache] [--groups 16 --group-size 8 --max-batch-rows 128] [--out rollout.json]
    python benchmarks/rollout_throughput.py --device cpu --tiny     # seconds; what the CPU test runs
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import types
from dataclasses import dataclass
from typing import Any, Callable

import torch

from dice_ray.config import ModelConfig, SamplingConfig
from dice_ray.policy.model import build_model
from dice_ray.policy.policy import DiffusionPolicy
from dice_ray.policy.sampler import sample_ids, sample_ids_batch

#: Qwen3-1.7B's shape (SDAR-1.7B / TraDo-1.7B are built from it); block 4 as DICE
SDAR_1P7B = ModelConfig(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                        num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rope_theta=1e6,
                        tie_word_embeddings=True, block_size=4)
QWEN3_VOCAB = 151936
#: the same code path as sdar-1.7b (stand-in token ids, no tokenizer) at a CPU-test size
SDAR_MINI = ModelConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, block_size=4)
MINI_VOCAB = 1024
MODELS = ("tiny", "sdar-1.7b", "sdar-mini")
NO_EOS = -1  # an id no token has: rows never stop early
TARGET_SPEEDUP = 3.0
TARGET_TOKENS_PER_S = {"sdar-1.7b": 2000.0}

NOCACHE, STATIC, DYNAMIC = "one-token, no cache", "one-token, KV cache", "dynamic, KV cache"
EAGER = "dynamic, KV, no graphs"  # DYNAMIC without CUDA graphs (sampling.cuda_graphs=false), on a GPU only
ONE_AT_A_TIME, BATCHED = "groups, one at a time", "groups, batched"  # --groups: a worker's step, two ways


@dataclass
class Run:
    """Timed runs of one sampler on one model: medians over repeats.

    Attributes:
        sampler: one of the three sampler names.
        tokens_per_s: new tokens (all rows) / median seconds.
        seconds: median wall seconds of one ``sample_ids`` call (s).
        new_tokens: response tokens of the call, all rows.
        forwards: model forward passes of the call (prefill included).
        tokens_per_step: mean tokens a row unmasked a denoising forward.
        peak_gib: ``torch.cuda.max_memory_allocated`` during the call (GiB); None on CPU.
        responses: the greedy response ids of the last repeat (G lists).
    """

    sampler: str
    tokens_per_s: float
    seconds: float
    new_tokens: int
    forwards: int
    tokens_per_step: float
    peak_gib: float | None
    responses: list[list[int]]


def make_policy(name: str, device: torch.device, seed: int) -> DiffusionPolicy:
    """The benchmark's model ``name`` (see :data:`MODELS`), randomly initialised on ``device``.

    bf16 on CUDA, fp32 on CPU. ``tiny`` is the project's default :class:`ModelConfig` with the shipped
    tokenizer; ``sdar-1.7b`` / ``sdar-mini`` use stand-in special ids (``<|mask|>`` = V - 1).

    Raises:
        ValueError: an unknown ``name``.
    """
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    if name == "tiny":
        policy = DiffusionPolicy.build(ModelConfig(dtype=dtype), seed=seed).to(device)
    elif name in ("sdar-1.7b", "sdar-mini"):
        cfg, vocab = (SDAR_1P7B, QWEN3_VOCAB) if name == "sdar-1.7b" else (SDAR_MINI, MINI_VOCAB)
        cfg = cfg.model_copy(update={"dtype": dtype})
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.device(device):
            torch.manual_seed(seed)
            model = build_model(cfg, vocab, pad_id=0)  # built on the device: a 1.7B init on CPU takes minutes
        ids = types.SimpleNamespace(mask_id=vocab - 1, eos_id=vocab - 2, pad_id=0)
        policy = DiffusionPolicy(model, ids, cfg)
    else:
        raise ValueError(f"model {name!r}: must be one of {MODELS}")
    policy.eos_id = NO_EOS
    policy.model.eval()
    return policy


def random_prompt(length: int, vocab: int, mask_id: int, seed: int) -> list[int]:
    """``length`` random token ids in ``[0, vocab)``, none of them ``mask_id``."""
    ids = torch.randint(0, vocab - 1, (length,), generator=torch.Generator().manual_seed(seed))
    return torch.where(ids >= mask_id, ids + 1, ids).tolist()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(call: Callable[[], Any], repeats: int, device: torch.device) -> tuple[float, float | None, Any]:
    """Run ``call`` ``repeats`` times: (median seconds, peak GPU memory in GiB over the runs or None on CPU, the last
    run's result)."""
    secs, peaks, out = [], [], None
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        _sync(device)
        t0 = time.perf_counter()
        out = call()
        _sync(device)
        secs.append(time.perf_counter() - t0)
        if device.type == "cuda":
            peaks.append(torch.cuda.max_memory_allocated(device) / 2**30)
    return statistics.median(secs), max(peaks) if peaks else None, out


def time_sampler(policy: DiffusionPolicy, prompt: list[int], batch: int, cfg: SamplingConfig, kv_cache: bool,
                 repeats: int, warmup_tokens: int, name: str) -> Run:
    """Warm up once (``warmup_tokens`` new tokens), then time ``repeats`` calls of ``sample_ids``."""
    device = policy.device
    warm = cfg.model_copy(update={"max_new_tokens": warmup_tokens})
    sample_ids(policy, prompt, batch, warm, torch.Generator(device=device).manual_seed(0), kv_cache=kv_cache)
    sec, peak, (resp, _, _, stats) = timed(
        lambda: sample_ids(policy, prompt, batch, cfg, torch.Generator(device=device).manual_seed(0), kv_cache=kv_cache),
        repeats, device)
    steps = stats.forwards - (1 if kv_cache else 0)  # denoising forwards (the cached path adds a prefill)
    per_row = stats.new_tokens / batch
    return Run(name, stats.new_tokens / sec, sec, stats.new_tokens, stats.forwards, per_row / max(steps, 1), peak, resp)


def group_prompts(n: int, prompt_len: int, vocab: int, mask_id: int, seed: int) -> list[list[int]]:
    """``n`` random prompts (:func:`random_prompt`) of lengths spread evenly from ``prompt_len`` down to about half."""
    lengths = [max(1, prompt_len - (prompt_len // 2) * i // max(n - 1, 1)) for i in range(n)]
    return [random_prompt(length, vocab, mask_id, seed + 1 + i) for i, length in enumerate(lengths)]


def time_groups(policy: DiffusionPolicy, prompts: list[list[int]], group_size: int, cfg: SamplingConfig,
                per_batch: int, repeats: int, warmup_tokens: int, name: str) -> Run:
    """Warm up once, then time ``repeats`` runs of every group of ``prompts`` (group ``i`` seeded ``i``), decoded
    ``per_batch`` groups a :func:`sample_ids_batch` call; ``responses`` are all groups' rows, in order."""
    device = policy.device

    def run(c: SamplingConfig):
        out, stats = [], []
        for k in range(0, len(prompts), per_batch):
            part = list(range(k, min(k + per_batch, len(prompts))))
            gens = [torch.Generator(device=device).manual_seed(i) for i in part]
            per, st = sample_ids_batch(policy, [prompts[i] for i in part], group_size, c, gens)
            out += [r for resp, _, _ in per for r in resp]
            stats.append(st)
        return out, stats

    run(cfg.model_copy(update={"max_new_tokens": warmup_tokens}))
    sec, peak, (resp, stats) = timed(lambda: run(cfg), repeats, device)
    new = sum(st.new_tokens for st in stats)
    row_steps = sum(st.num_samples * (st.forwards - 1) for st in stats)  # each call: one prefill, then denoising
    return Run(name, new / sec, sec, new, sum(st.forwards for st in stats), new / max(row_steps, 1), peak, resp)


def bench_groups(policy: DiffusionPolicy, args: argparse.Namespace, cfg: SamplingConfig) -> dict:
    """``--groups``: the groups one at a time against batched (see the module docstring); prints both, returns them."""
    V, G = policy.model.config.vocab_size, args.group_size
    prompts = group_prompts(args.groups, args.prompt_len, V, policy.mask_id, args.seed)
    per_batch = max(1, args.max_batch_rows // G)
    print(f"groups: {args.groups} x {G} rows, prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
          f"dynamic greedy; batched: up to {per_batch} group(s) ({per_batch * G} rows) a batch "
          f"(--max-batch-rows {args.max_batch_rows})")
    one = time_groups(policy, prompts, G, cfg, 1, args.repeats, args.warmup_tokens, ONE_AT_A_TIME)
    many = time_groups(policy, prompts, G, cfg, per_batch, args.repeats, args.warmup_tokens, BATCHED)
    agree = agreement(one.responses, many.responses)
    ratio = many.tokens_per_s / one.tokens_per_s
    for run in (one, many):
        print(f"  {run.sampler:22s} {run.tokens_per_s:10.1f} tok/s {run.seconds:9.3f} s {run.forwards:6d} fwd "
              f"{'-' if run.peak_gib is None else f'{run.peak_gib:.2f}':>6} GiB")
    print(f"  batched / one at a time: {ratio:.2f}x; greedy {'identical' if agree['identical'] else 'DIFFER'}: "
          f"{agree['identical_rows']}/{agree['rows']} rows, {agree['differing_tokens']}/{agree['tokens']} tokens differ",
          flush=True)
    runs = [{"sampler": r.sampler, "tokens_per_s": r.tokens_per_s, "seconds": r.seconds, "new_tokens": r.new_tokens,
             "forwards": r.forwards, "tokens_per_step": r.tokens_per_step, "peak_gib": r.peak_gib} for r in (one, many)]
    return {"groups": args.groups, "group_size": G, "max_batch_rows": args.max_batch_rows,
            "groups_per_batch": per_batch, "prompt_lengths": [len(p) for p in prompts], "runs": runs,
            "speedup_batched": ratio, "agreement": agree}


def agreement(ref: list[list[int]], other: list[list[int]]) -> dict:
    """How far ``other``'s greedy outputs are from ``ref``'s: identical rows and differing tokens.

    Positions past the shorter of two rows count as differing.
    """
    rows = sum(a == b for a, b in zip(ref, other))
    total = sum(max(len(a), len(b)) for a, b in zip(ref, other))
    diff = sum(sum(x != y for x, y in zip(a, b)) + abs(len(a) - len(b)) for a, b in zip(ref, other))
    return {"identical_rows": rows, "rows": len(ref), "differing_tokens": diff, "tokens": total,
            "identical": rows == len(ref)}


def bench_model(name: str, args: argparse.Namespace, device: torch.device) -> dict:
    """All samplers at all logit scales on model ``name``; prints its table, returns its JSON record."""
    t0 = time.perf_counter()
    policy = make_policy(name, device, args.seed)
    bs, V = policy.block_size, policy.model.config.vocab_size
    params = policy.num_parameters()
    weights_gib = torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else None
    prompt = random_prompt(args.prompt_len, V, policy.mask_id, args.seed)
    print(f"\n== {name}: {params / 1e6:.1f} M params, vocab {V}, block {bs}, "
          f"{next(policy.model.parameters()).dtype}, built in {time.perf_counter() - t0:.1f} s"
          + (f", weights {weights_gib:.2f} GiB" if weights_gib is not None else "")
          + f"; batch {args.batch}, prompt {args.prompt_len}, {args.new_tokens} new tokens, threshold {args.threshold}",
          flush=True)
    one = SamplingConfig(max_new_tokens=args.new_tokens, remasking="static", steps_per_block=bs, temperature=0.0)
    dyn = SamplingConfig(max_new_tokens=args.new_tokens, remasking="dynamic", threshold=args.threshold,
                         temperature=0.0)
    norm = policy.model.model.norm.weight
    base_norm = norm.detach().clone()
    record = {"model": name, "params": params, "vocab": V, "dtype": str(next(policy.model.parameters()).dtype),
              "weights_gib": weights_gib, "scales": []}
    nocache: Run | None = None
    header = (f"{'scale':>5} {'sampler':22s} {'tok/s':>10} {'median s':>9} {'fwd':>6} {'tok/step':>8} "
              f"{'peak GiB':>8} {'x no-cache':>10} {'x 1-tok':>8}  greedy vs one-token, KV cache")
    print(header)
    for i, scale in enumerate(args.logit_scales):
        with torch.no_grad():
            norm.copy_(base_norm * scale)
        runs = []
        if i == 0 and args.nocache:
            nocache = time_sampler(policy, prompt, args.batch, one, False, args.nocache_repeats, args.warmup_tokens,
                                   NOCACHE)
            runs.append(nocache)
        ref = time_sampler(policy, prompt, args.batch, one, True, args.repeats, args.warmup_tokens, STATIC)
        runs.append(ref)
        runs.append(time_sampler(policy, prompt, args.batch, dyn, True, args.repeats, args.warmup_tokens, DYNAMIC))
        if i == 0 and device.type == "cuda":
            eager = dyn.model_copy(update={"cuda_graphs": False})
            runs.append(time_sampler(policy, prompt, args.batch, eager, True, args.repeats, args.warmup_tokens, EAGER))
        rows = []
        for run in runs:
            agree = agreement(ref.responses, run.responses)
            x_nc = run.tokens_per_s / nocache.tokens_per_s if nocache else None
            x_one = run.tokens_per_s / ref.tokens_per_s
            agree_txt = ("reference" if run is ref else
                         f"{'identical' if agree['identical'] else 'DIFFER'}: {agree['identical_rows']}/{agree['rows']}"
                         f" rows, {agree['differing_tokens']}/{agree['tokens']} tokens differ")
            print(f"{scale:5g} {run.sampler:22s} {run.tokens_per_s:10.1f} {run.seconds:9.3f} {run.forwards:6d} "
                  f"{run.tokens_per_step:8.2f} {'-' if run.peak_gib is None else f'{run.peak_gib:.2f}':>8} "
                  f"{'-' if x_nc is None else f'{x_nc:.2f}':>10} {x_one:8.2f}  {agree_txt}", flush=True)
            rows.append({"sampler": run.sampler, "tokens_per_s": run.tokens_per_s, "seconds": run.seconds,
                         "new_tokens": run.new_tokens, "forwards": run.forwards,
                         "tokens_per_step": run.tokens_per_step, "peak_gib": run.peak_gib,
                         "speedup_vs_nocache": x_nc, "speedup_vs_one_token_cache": x_one,
                         "agreement_vs_one_token_cache": agree})
        record["scales"].append({"logit_scale": scale, "runs": rows})
    if args.groups:
        with torch.no_grad():
            norm.copy_(base_norm * args.logit_scales[0])
        record["groups"] = bench_groups(policy, args, dyn)
    dyn_rows = [(s["logit_scale"], next(r for r in s["runs"] if r["sampler"] == DYNAMIC)) for s in record["scales"]]
    verdicts = []

    def judged(ok: bool) -> str:
        """A target's verdict: the targets are figures of an H200, not judged on a CPU."""
        return ("met" if ok else "NOT met") if device.type == "cuda" else "a GPU target, not judged on CPU"

    for scale, r in dyn_rows:
        x = r["speedup_vs_nocache"]
        same = r["agreement_vs_one_token_cache"]["identical"]
        verdicts.append(f"scale {scale:g}: {'-' if x is None else f'{x:.2f}x'} vs no-cache one-token "
                        f"({judged(x is not None and x >= TARGET_SPEEDUP)}), "
                        f"{r['speedup_vs_one_token_cache']:.2f}x vs cached one-token, greedy "
                        f"{'identical' if same else 'differs'}")
    target = TARGET_TOKENS_PER_S.get(name)
    best = max(r["tokens_per_s"] for _, r in dyn_rows)
    print(f"target >= {TARGET_SPEEDUP:g}x (dynamic + KV cache): " + "; ".join(verdicts))
    if target:
        plain = dyn_rows[0][1]["tokens_per_s"]
        print(f"target >= {target:g} tokens/s: dynamic at scale {dyn_rows[0][0]:g} {plain:.0f} "
              f"({judged(plain >= target)}), best {best:.0f} ({judged(best >= target)})")
    record["targets"] = {"speedup": TARGET_SPEEDUP, "tokens_per_s": target}
    record["seconds"] = time.perf_counter() - t0
    del policy
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return record


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module docstring); ``--tiny`` shrinks everything for a CPU test."""
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Rows: 'one-token, no cache' re-runs the prompt and finished blocks every step (the baseline); "
        "'one-token, KV cache' caches them; 'dynamic, KV cache' unmasks every token above --threshold (DICE's "
        "sampler); on a GPU the cached rows replay CUDA graphs and 'dynamic, KV, no graphs' (first scale) "
        "does not. The targets (>= 3x the baseline, >= 2000 tokens/s for sdar-1.7b) are for the GPU shapes.")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cuda or cpu (default: cuda when a GPU is visible)")
    ap.add_argument("--models", default="tiny,sdar-1.7b", help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--batch", type=int, default=64, help="samples of the prompt decoded together (G)")
    ap.add_argument("--prompt-len", type=int, default=512, help="random prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=512, help="response tokens a row (a multiple of the block)")
    ap.add_argument("--threshold", type=float, default=0.9, help="dynamic remasking's confidence threshold (DICE 0.9)")
    ap.add_argument("--logit-scales", default="1,40", help="final-norm multipliers to run (see the docstring)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of each cached sampler (median)")
    ap.add_argument("--nocache-repeats", type=int, default=1, help="timed runs of the no-cache baseline")
    ap.add_argument("--no-nocache", dest="nocache", action="store_false", help="skip the no-cache baseline")
    ap.add_argument("--warmup-tokens", type=int, default=8, help="new tokens of each sampler's warm-up call")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompt")
    ap.add_argument("--groups", type=int, default=0,
                    help="also time this many groups of --group-size rows, prompts of different lengths, one group a "
                    "batch against batched (0: off)")
    ap.add_argument("--group-size", type=int, default=8, help="--groups: rows a group (G)")
    ap.add_argument("--max-batch-rows", type=int, default=128,
                    help="--groups: rows a batch when batched (sampling.max_batch_rows)")
    ap.add_argument("--tiny", action="store_true",
                    help="CPU-test size: models tiny,sdar-mini, batch 4, prompt 16, 8 new tokens, 1 repeat, "
                    "3 groups of 2")
    ap.add_argument("--out", help="write the figures as JSON here")
    if ap.parse_known_args(argv)[0].tiny:  # defaults only: explicit options still win
        ap.set_defaults(models="tiny,sdar-mini", batch=4, prompt_len=16, new_tokens=8, repeats=1, warmup_tokens=4,
                        groups=3, group_size=2)
    args = ap.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    args.logit_scales = [float(s) for s in args.logit_scales.split(",") if s.strip()]
    for m in args.models:
        if m not in MODELS:
            ap.error(f"--models: {m!r} is not one of {MODELS}")
    if not args.logit_scales or min(args.logit_scales) <= 0:
        ap.error("--logit-scales: one or more positive numbers")
    if args.groups < 0:
        ap.error("--groups: must be >= 0")
    for flag in ("batch", "prompt_len", "new_tokens", "repeats", "nocache_repeats", "warmup_tokens", "group_size",
                 "max_batch_rows"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')}: must be >= 1")
    return args


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; returns (and with ``--out`` writes) the figures."""
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA GPU visible (use --device cpu)")
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    graphs = (f"; cached samplers replay CUDA graphs, {EAGER!r} (first scale) does not" if device.type == "cuda"
              else "; on CPU every sampler runs eager (no CUDA graphs) and the targets are for the GPU shapes")
    print(f"device {gpu}; torch {torch.__version__}; samplers: {NOCACHE!r} (baseline), {STATIC!r}, {DYNAMIC!r}{graphs}; "
          f"greedy (temperature 0), no <|eos|> stop; medians of {args.repeats} (no-cache: {args.nocache_repeats})")
    result = {"device": gpu, "batch": args.batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
              "threshold": args.threshold, "repeats": args.repeats, "nocache_repeats": args.nocache_repeats,
              "models": []}
    for name in args.models:
        result["models"].append(bench_model(name, args, device))
        if args.out:  # after each model, so a run cut short keeps what it measured
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
