"""Weight-sync time: the learner's weights to the rollout workers, by bucketed broadcast and by the object store.

Issue 6: "Weights go from the learner to rollout workers by a bucketed NCCL broadcast when both sides have
GPUs, by the object store otherwise. Report the sync time for a 1.7B-shape model." This builds the real
actors as ``dice-ray train`` does (``dice_ray/cluster/trainer.py``: one
:class:`~dice_ray.cluster.learner.LearnerGroup` rank with its DeepSpeed engine, ``--workers`` restartable
:class:`~dice_ray.cluster.rollout.RolloutWorker` actors, 1 GPU each when the cluster has GPUs) and times the
real :meth:`WeightSync.push <dice_ray.cluster.weight_sync.WeightSync.push>` in each mode of ``--modes``
(``resolve_mode``, as the trainer resolves ``cluster.weight_sync``; the model is built on the CPU and moved
to its device, as there):
``broadcast`` (NCCL with GPUs, gloo on CPU; ``--bucket-mb`` buckets) and ``object_store``.

For each mode: the learner's weights are perturbed (as a learner step would change them; the workers then
hold other weights, which is checked), one warm-up push (forms the broadcast group), ``--repeats`` timed
pushes, then the rollout workers' weights are compared with the learner's: every tensor's float64 sum and
sum of squares, and a few named tensors fetched whole from both sides and compared bit for bit. A mismatch
stops the run (:class:`SyncMismatch`): a sync that moves nothing fails loudly. Figures: per-push seconds,
median, payload bytes (every tensor the sync carries, tied weights once), buckets, GB/s (payload / median,
per receiving worker) and the object-store / broadcast time ratio.

Models: ``tiny`` is the project's default policy (fp32 on CPU, bf16 on a GPU); ``sdar-1.7b`` is Qwen3-1.7B's
shape (``benchmarks/rollout_throughput.py``'s ``SDAR_1P7B``: hidden 2048, 28 layers, MLP 6144, tied
embeddings), bf16, random init. The actors build it from the ``ModelConfig`` as the train job does
(``DiffusionPolicy.from_config``), so its vocabulary is the shipped tokenizer's (4096), not Qwen3's 151936:
the embedding is 16 MiB instead of 594 MiB. ``qwen3_vocab_projection`` scales the median time by the payload
with Qwen3's vocabulary at the measured GB/s (a projection, labelled as such).

Starts a local Ray cluster (``num_gpus`` = ``torch.cuda.device_count()``) unless ``RAY_ADDRESS`` is set.
A GPU cluster needs 1 + ``--workers`` GPUs (learner and workers on whole GPUs of their own, as NCCL needs).

    python benchmarks/weight_sync.py --model sdar-1.7b --modes broadcast,object_store --repeats 5 \\
        [--bucket-mb 256] [--workers 1] [--json weight_sync.json]            # 2 GPUs: NCCL broadcast
    python benchmarks/weight_sync.py --model tiny --modes broadcast,object_store --repeats 5   # CPU (gloo)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import ray
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rollout_throughput import QWEN3_VOCAB, SDAR_1P7B

from dice_ray.cluster.learner import LearnerGroup, learner_env
from dice_ray.cluster.rollout import ROLLOUT_MAX_RESTARTS, RolloutWorker
from dice_ray.cluster.weight_sync import WeightSync, resolve_mode
from dice_ray.config import ClusterConfig, DiceConfig, ModelConfig

MODELS = ("tiny", "sdar-1.7b")
MODES = ("broadcast", "object_store")
FETCHED = 3
"""Named tensors fetched whole from both sides and compared bit for bit."""
FETCH_MAX_NUMEL = 1 << 24
"""Largest tensor fetched whole (elements); larger ones are compared by their sums only."""


class SyncMismatch(RuntimeError):
    """A rollout worker's weights differ from the learner's after a push (or already equal before one)."""


def model_config(name: str, cuda: bool) -> ModelConfig:
    """The policy shape ``name`` (:data:`MODELS`): bf16 on a GPU; ``tiny`` fp32 on CPU.

    Raises:
        ValueError: an unknown ``name``.
    """
    if name == "tiny":
        return ModelConfig(dtype="bfloat16" if cuda else "float32")
    if name == "sdar-1.7b":
        return SDAR_1P7B.model_copy(update={"dtype": "bfloat16"})
    raise ValueError(f"--model {name!r}: must be one of {MODELS}")


def parse_modes(text: str) -> list[str]:
    """``"broadcast,object_store"`` -> the modes, in order, each once.

    Raises:
        argparse.ArgumentTypeError: an empty list or a mode not in :data:`MODES`.
    """
    modes = list(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))
    bad = [m for m in modes if m not in MODES]
    if not modes or bad:
        raise argparse.ArgumentTypeError(f"--modes {text!r}: a comma-separated list of {', '.join(MODES)}")
    return modes


# ---- run inside the actors (ActorHandle.__ray_call__: fn(actor, *args)) --------------------------------------
def _by_value() -> None:
    """Ship this module's functions to the actors by value when it was imported (a test), not run as a script:
    the actors cannot import ``benchmarks/`` by name."""
    if __name__ != "__main__" and __name__ in sys.modules:
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _module_of(actor) -> torch.nn.Module:
    """The synced module: the learner's engine module (or policy before the engine), a worker's policy model."""
    return actor._module() if hasattr(actor, "_module") else actor.policy.model


def _gathered(actor, modifier: bool = False):
    from contextlib import nullcontext

    engine = getattr(actor, "engine", None)
    if engine is None or actor.cfg.cluster.zero_stage != 3:
        return nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=0 if modifier else None)


def _perturb(actor, seed: int) -> int:
    """Add N(0, 0.02) noise to every floating tensor the sync carries (a learner step's stand-in); their count."""
    from dice_ray.cluster.weight_sync import named_weights

    with _gathered(actor, modifier=True), torch.no_grad():
        tensors = [t for t in named_weights(_module_of(actor)).values() if t.is_floating_point()]
        gen = torch.Generator(device=tensors[0].device).manual_seed(seed)
        for t in tensors:
            t.add_(torch.randn(t.shape, generator=gen, device=t.device, dtype=torch.float32).to(t.dtype) * 0.02)
    return len(tensors)


def _fingerprint(actor, fetch: list[str] | None) -> dict:
    """Per-tensor ``(float64 sum, float64 sum of squares)`` of every synced tensor, and the tensors ``fetch``
    names as CPU copies (None: choose :data:`FETCHED` of them, spread over the model)."""
    from dice_ray.cluster.weight_sync import named_weights

    with _gathered(actor), torch.no_grad():
        tensors = named_weights(_module_of(actor))
        sums = {k: (float(t.double().sum()), float(t.double().square().sum())) for k, t in tensors.items()}
        if fetch is None:
            small = [k for k, t in tensors.items() if t.numel() <= FETCH_MAX_NUMEL and t.is_floating_point()]
            fetch = [small[int(i * (len(small) - 1) / max(FETCHED - 1, 1))] for i in range(min(FETCHED, len(small)))]
        return {"sums": sums, "tensors": {k: tensors[k].detach().to("cpu").clone() for k in fetch}}


def compare_weights(learner: dict, worker: dict, rtol: float = 1e-9) -> list[str]:
    """Where a worker's fingerprint (:func:`_fingerprint`) differs from the learner's.

    Args:
        learner, worker: ``{"sums": {name: (sum, sum_sq)}, "tensors": {name: tensor}}``.
        rtol: relative tolerance of the sums (bit-equal tensors give equal sums).

    Returns:
        one line a difference (missing names, sums, dtypes, shapes or values); empty when they agree.
    """
    out = []
    a, b = learner["sums"], worker["sums"]
    if a.keys() != b.keys():
        out.append(f"tensor names differ: learner only {sorted(a.keys() - b.keys())[:5]}, "
                   f"worker only {sorted(b.keys() - a.keys())[:5]}")
    for k in sorted(a.keys() & b.keys()):
        for what, x, y in zip(("sum", "sum of squares"), a[k], b[k]):
            if abs(x - y) > rtol * max(abs(x), abs(y), 1e-30):
                out.append(f"{k}: {what} {x!r} (learner) != {y!r} (worker)")
                break
    for k, t in learner["tensors"].items():
        u = worker["tensors"].get(k)
        if u is None:
            out.append(f"{k}: not fetched from the worker")
        elif t.dtype != u.dtype or t.shape != u.shape or not torch.equal(t, u):
            out.append(f"{k}: values differ ({t.dtype}{list(t.shape)} vs {u.dtype}{list(u.shape)})")
    return out


def check_synced(learner, workers: list, expect_equal: bool = True) -> int:
    """Compare every worker's weights with the learner's rank 0; returns the tensors compared.

    Args:
        learner: the :class:`LearnerGroup`.
        workers: rollout worker handles.
        expect_equal: True after a push; False before one (the workers must then hold other weights, or the
            check after the push proves nothing).

    Raises:
        SyncMismatch: a worker differs after a push, or equals the learner before one.
    """
    _by_value()
    ref = ray.get(learner.actors[0].__ray_call__.remote(_fingerprint, None))
    names = list(ref["tensors"])
    for i, w in enumerate(workers):
        diff = compare_weights(ref, ray.get(w.__ray_call__.remote(_fingerprint, names)))
        if expect_equal and diff:
            raise SyncMismatch(f"rollout worker {i} does not hold the learner's weights after the push: "
                               f"{len(diff)} difference(s), first {diff[:3]}")
        if not expect_equal and not diff:
            raise SyncMismatch(f"rollout worker {i} already holds the learner's weights before the push: "
                               "the check after it would prove nothing")
    return len(ref["sums"])


# ---- the benchmark ----------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=MODELS, default=None, help="default: sdar-1.7b with CUDA, else tiny")
    ap.add_argument("--modes", type=parse_modes, default=list(MODES), help="comma-separated, of " + ", ".join(MODES))
    ap.add_argument("--repeats", type=int, default=5, help="timed pushes a mode (after one warm-up push)")
    ap.add_argument("--bucket-mb", type=float, default=ClusterConfig().weight_sync_bucket_mb,
                    help="broadcast bucket capacity (MiB), cluster.weight_sync_bucket_mb")
    ap.add_argument("--workers", type=int, default=1, help="rollout workers (cluster.num_rollout_workers)")
    ap.add_argument("--zero-stage", type=int, default=ClusterConfig().zero_stage, choices=(0, 1, 2, 3),
                    help="the learner's DeepSpeed ZeRO stage")
    ap.add_argument("--json", default=None, metavar="OUT", help="write the figures here")
    args = ap.parse_args(argv)
    for name in ("repeats", "workers"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.bucket_mb <= 0:
        ap.error(f"--bucket-mb must be > 0, got {args.bucket_mb}")
    return args


def _payload_bytes(plan) -> int:
    return sum(s.nbytes for bucket in plan for s in bucket)


def bench_mode(mode: str, sync: WeightSync, learner, workers: list, repeats: int, seed: int) -> dict:
    """One mode's figures: perturb the learner's weights (seeded by ``seed``), check the workers differ, one
    warm-up push, ``repeats`` timed pushes (:meth:`WeightSync.push`), check the workers equal the learner.

    Returns:
        ``{"warmup_s", "seconds" (each timed push), "median_s", "buckets", "broadcast_bytes", "tensors_compared"}``.

    Raises:
        SyncMismatch: see :func:`check_synced`.
    """
    _by_value()
    ray.get(learner.actors[0].__ray_call__.remote(_perturb, seed))
    check_synced(learner, workers, expect_equal=False)
    warm = sync.push(version=seed)
    pushes = [sync.push(version=seed) for _ in range(repeats)]
    compared = check_synced(learner, workers)
    seconds = [p["seconds"] for p in pushes]
    return {"warmup_s": warm["seconds"], "seconds": seconds, "median_s": statistics.median(seconds),
            "buckets": pushes[-1]["buckets"], "broadcast_bytes": pushes[-1]["bytes"], "tensors_compared": compared}


def bench_config(model: str, gpus: int, workers: int, bucket_mb: float, zero_stage: int) -> DiceConfig:
    """The run config of the benchmark: model ``model``, one learner rank and ``workers`` rollout workers on
    a whole GPU each when ``gpus`` (else CPU), ``bucket_mb`` broadcast buckets, ZeRO stage ``zero_stage``."""
    per = 1.0 if gpus else 0.0
    return DiceConfig(model=model_config(model, bool(gpus)), cluster=ClusterConfig(
        learner_ranks=1, learner_gpus=per, rollout_gpus=per, num_rollout_workers=workers,
        weight_sync_bucket_mb=bucket_mb, zero_stage=zero_stage))


def build_actors(cfg: DiceConfig, gpus: int) -> tuple[LearnerGroup, list, dict]:
    """The rollout workers and the learner (with its DeepSpeed engine) as ``dice-ray train`` builds them.

    Returns:
        ``(learner group, rollout worker handles, init_engine's report)``, every actor up.
    """
    per = cfg.cluster.rollout_gpus if gpus else 0.0
    threads = 0 if gpus else max(1, (os.cpu_count() or 2) // 2)
    workers = [RolloutWorker.options(num_gpus=per, max_restarts=ROLLOUT_MAX_RESTARTS, max_task_retries=0).remote(
        cfg.model, cfg.sampling, cfg.tasks.prompt_template, threads, cfg.phase.scaffold_granularity)
        for _ in range(cfg.cluster.num_rollout_workers)]
    use_gpu = bool(gpus and cfg.cluster.learner_gpus)
    learner = LearnerGroup(cfg, use_gpu, threads, learner_env(use_gpu))
    engine = ray.get(learner.init_engine.remote())
    ray.get([w.ping.remote() for w in workers])
    return learner, workers, engine


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; returns (and with ``--json`` writes) the figures.

    Raises:
        SyncMismatch: a worker's weights differ from the learner's after a mode's pushes.
        SystemExit: a GPU cluster with fewer than 1 + ``--workers`` GPUs.
    """
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    model = args.model or ("sdar-1.7b" if cuda else "tiny")
    started = False
    if not ray.is_initialized():
        if os.environ.get("RAY_ADDRESS"):
            ray.init(log_to_driver=True)
        else:
            ray.init(address="local", num_gpus=torch.cuda.device_count(), include_dashboard=False, log_to_driver=True)
            started = True
    gpus = int(ray.cluster_resources().get("GPU", 0))
    if gpus and gpus < 1 + args.workers:
        raise SystemExit(f"{gpus} GPU(s): the learner and {args.workers} rollout worker(s) need 1 + {args.workers} "
                         "whole GPUs (NCCL cannot put two ranks on one GPU); lower --workers")
    per = 1.0 if gpus else 0.0
    cfg = bench_config(model, gpus, args.workers, args.bucket_mb, args.zero_stage)
    t0 = time.perf_counter()
    learner, workers, engine = build_actors(cfg, gpus)
    build_s = time.perf_counter() - t0
    plan = learner.plan_buckets(int(args.bucket_mb * 2**20))
    payload = _payload_bytes(plan)
    params = engine["params"]
    device = torch.cuda.get_device_name(0) if cuda else "cpu"
    print(f"model {model}: {params / 1e9:.3f} B params, payload {payload / 2**20:.1f} MiB ({cfg.model.dtype}); "
          f"learner {engine['device']} ZeRO-{args.zero_stage}, {args.workers} rollout worker(s); device {device}; "
          f"actors built in {build_s:.1f} s", flush=True)
    result = {"model": model, "params": params, "dtype": cfg.model.dtype, "payload_bytes": payload,
              "workers": args.workers, "bucket_mb": args.bucket_mb, "zero_stage": args.zero_stage,
              "device": device, "cluster_gpus": gpus, "repeats": args.repeats, "build_s": build_s, "modes": {}}
    try:
        for k, requested in enumerate(args.modes):
            mode, backend = resolve_mode(requested, per, per, gpus)
            sync = WeightSync(learner, workers, mode, backend, args.bucket_mb)
            r = bench_mode(mode, sync, learner, workers, args.repeats, seed=k + 1)
            r.update(backend=backend if mode == "broadcast" else None, gb_per_s=payload / r["median_s"] / 1e9)
            result["modes"][mode] = r
            label = f"{mode} ({backend})" if mode == "broadcast" else mode
            buckets = f", {r['buckets']} bucket(s) of <= {args.bucket_mb:g} MiB" if r["buckets"] else ""
            print(f"{label:22s} pushes {' '.join(f'{s:.4f}' for s in r['seconds'])} s; median {r['median_s']:.4f} s "
                  f"(warm-up {r['warmup_s']:.4f} s); {payload / 2**20:.1f} MiB{buckets}; "
                  f"{r['gb_per_s']:.2f} GB/s; {r['tensors_compared']} tensors equal on every worker", flush=True)
            if args.json:  # after each mode, so a run cut short keeps what it measured
                Path(args.json).write_text(json.dumps(result, indent=1))
    finally:
        learner.shutdown()
        for w in workers:
            ray.kill(w)
        if started:
            ray.shutdown()
    m = result["modes"]
    if "broadcast" in m and "object_store" in m:
        result["object_store_over_broadcast"] = m["object_store"]["median_s"] / m["broadcast"]["median_s"]
        print(f"object_store / broadcast median time: {result['object_store_over_broadcast']:.2f}x")
    vocab = engine_vocab(plan)
    if model == "sdar-1.7b" and vocab is not None and m:  # the shipped tokenizer's vocabulary: project Qwen3's
        extra = (QWEN3_VOCAB - vocab) * SDAR_1P7B.hidden_size * 2  # bf16, tied embedding (sent once)
        result["qwen3_vocab_projection"] = {
            mode: {"payload_bytes": payload + extra, "median_s": r["median_s"] * (payload + extra) / payload}
            for mode, r in m.items()}
        print(f"projection with Qwen3's vocabulary ({QWEN3_VOCAB} rows instead of {vocab}, +{extra / 2**20:.0f} MiB) "
              "at the measured GB/s: " + "; ".join(
                  f"{mode} {p['median_s']:.3f} s" for mode, p in result["qwen3_vocab_projection"].items()))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


def engine_vocab(plan) -> int | None:
    """The vocabulary of the synced model: rows of its input embedding in the bucket plan (None: none found)."""
    for bucket in plan:
        for s in bucket:
            if s.name.endswith("embed_tokens.weight"):
                return s.shape[0]
    return None


if __name__ == "__main__":
    main()
