"""The trainer's warm start, :func:`warm_start`: masked-diffusion SFT of the policy
(:class:`~dice_ray.policy.sft_run.SFTRun`), cached by content hash.

It runs inside the Learner actor, before its DeepSpeed engine, on
the plain torch path: with one rank the learner joins its own ``torch.distributed`` group (its world size, its
backend) only afterwards, in ``Learner.init_engine``, and DeepSpeed keeps the groups it saw for the life of the
process, so a one-rank group made here could be neither replaced nor torn down. With ``cluster.learner_ranks`` N > 1
every rank joins the learner's group first (``Learner.warm_start``) and trains its shard of each batch
(``data_parallel``), the gradients all-reduced: the same weights as one rank, within float rounding. Results are cached under
``cfg.cache_dir / <key>`` where the key hashes the pairs, the model config, the tokenizer, the initial
weights, the SFT config (less bookkeeping and engine-only fields) and the seed; a second call with the same
inputs loads the weights instead of training.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from safetensors.torch import load_model, save_model

from dice_ray.config import SFTConfig
from dice_ray.policy.policy import DiffusionPolicy
from dice_ray.policy.sft_run import SFTRun, torch_threads

SFT_VERSION = "3"  # bump when the training recipe changes: old cache entries stop matching
# fields that do not change the warm start's weights (zero_stage only picks dice-ray sft's engine; seed is hashed as
# the seed in effect, DiceConfig.sft_seed)
_BOOKKEEPING = {"enabled", "cache_dir", "num_threads", "log_every", "checkpoint_every", "zero_stage", "seed"}


@dataclass
class SFTReport:
    """What :func:`warm_start` did.

    Attributes:
        steps: optimizer steps taken (fewer than ``cfg.steps`` when ``target_loss`` stopped it early;
            0 on a cache hit or when disabled).
        final_loss: the SFT loss (nats a token: SDAR's mean masked-token cross-entropy, LLaDA / Dream's 1/t-weighted
            one, see :mod:`dice_ray.policy.sft_loss`) over the last logged window, as trained (also on a cache
            hit); NaN when nothing was trained.
        seconds: wall time of the call (s).
        cache_hit: True when the weights came from the cache.
        cache_key: the content hash naming the cache entry.
        num_pairs: training pairs.
        losses: ``(step, mean loss of the window ending there)`` every ``log_every`` steps.
    """

    steps: int
    final_loss: float
    seconds: float
    cache_hit: bool
    cache_key: str = ""
    num_pairs: int = 0
    losses: list[tuple[int, float]] = field(default_factory=list)


def sft_cache_key(policy: DiffusionPolicy, pairs: list[tuple[str, ...]], cfg: SFTConfig, seed: int) -> str:
    """sha256 (hex, 24 chars) of everything that decides the warm-started weights (a list of 2-tuple pairs hashes as
    it always has; a triple hashes as its three texts)."""
    h = hashlib.sha256()
    cfg_part = cfg.model_dump(exclude=_BOOKKEEPING)
    model_part = policy.model_cfg.model_dump(exclude={"path"})
    h.update(json.dumps([SFT_VERSION, cfg_part, model_part, seed, pairs], sort_keys=True).encode())
    h.update(hashlib.sha256(policy.tokenizer.to_json().encode()).digest())
    for name, t in sorted(policy.model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:24]


PROGRESS_EVERY_S = 30.0
"""The warm start's progress lines come every ``log_every`` steps or every this many seconds (s), whichever
is sooner: on loaded cores 50 steps can take minutes."""


def _progress_line(run: SFTRun, steps: int, elapsed_s: float, since_step1_s: float | None,
                   target_loss: float | None = None) -> str:
    """``warm start: step 120/800, loss 4.468 (step 100), 106 s, ~600 s left at this pace``: the loss is the last
    recorded window's (named when it is not this step's); the time left assumes every later step runs at the
    mean pace of the steps after the first (``since_step1_s``: seconds since step 1 ended; the set-up and the
    first step, slower, would inflate it), or of all steps so far when there are none yet (other load on the cores
    may slow the rest down). With a ``target_loss`` (``sft.target_loss``) the run usually stops sooner, so the line
    says ``at most ~600 s left at this pace (it stops at loss <= 0.1)``."""
    parts = [f"warm start: step {run.step}/{steps}"]
    if run.losses:
        at, loss = run.losses[-1]
        parts.append(f"loss {loss:.3f}" + ("" if at == run.step else f" (step {at})"))
    parts.append(f"{elapsed_s:.0f} s")
    if run.step:
        pace = since_step1_s / (run.step - 1) if since_step1_s is not None and run.step > 1 else elapsed_s / run.step
        left = f"~{pace * (steps - run.step):.0f} s left at this pace"
        parts.append(left if target_loss is None else f"at most {left} (it stops at loss <= {target_loss:g})")
    return ", ".join(parts)


def warm_start(policy: DiffusionPolicy, pairs: list[tuple[str, ...]], cfg: SFTConfig, seed: int,
               log: Callable[[str], None] | None = None, data_parallel: bool = False) -> SFTReport:
    """Masked-diffusion SFT of ``policy`` (in place) on (prompt, target) pairs (LLaDA / Dream also (before,
    middle, after) infill triples, :func:`~dice_ray.policy.sft_batches.tokenize_pairs`), cached by content hash.

    The model is left in eval mode. With ``cfg.enabled`` False or ``cfg.steps == 0`` nothing is trained. Plain torch
    (no DeepSpeed, no ``torch.distributed`` group: it runs in the Learner actor before ``Learner.init_engine`` joins
    the learner's group, see the module doc); ``cfg.zero_stage`` is ignored. The weights equal those
    ``dice-ray sft`` (:func:`~dice_ray.policy.sft.run_sft`) writes for the same pairs, config and seed at
    ``sft.zero_stage=0`` in float32.

    Args:
        log: called with a progress line every ``cfg.log_every`` steps or :data:`PROGRESS_EVERY_S`, whichever
            comes first (not on a cache hit).
        data_parallel: this process is one rank of the ``torch.distributed`` group it belongs to (the learner's
            ranks, ``cluster.learner_ranks``, joined by ``Learner.warm_start``): every rank trains its shard of each
            batch, gradients averaged by an all-reduce (:class:`SFTRun` ``data_parallel``: the weights one rank
            trains, within float rounding). Rank 0 decides a cache hit, loads or writes the entry; on a hit the
            other ranks keep their weights (``Learner.init_engine`` hands them rank 0's). Same cache key as one rank.

    Returns:
        :class:`SFTReport` (steps, final loss, seconds, cache_hit).

    Raises:
        ValueError: ``pairs`` is empty or a pair is too long (see :func:`~dice_ray.policy.sft_batches.tokenize_pairs`).
    """
    t0 = time.perf_counter()
    if not pairs:
        raise ValueError("pairs: need at least one (prompt, target) pair")
    pairs = [tuple(str(x) for x in pair) for pair in pairs]
    if not cfg.enabled or cfg.steps == 0:
        return SFTReport(0, float("nan"), time.perf_counter() - t0, False, "", len(pairs))
    key = sft_cache_key(policy, pairs, cfg, seed)
    entry = Path(cfg.cache_dir).expanduser() / key
    hit = (entry / "model.safetensors").is_file() and (entry / "report.json").is_file()
    rank = 0
    if data_parallel:
        import torch.distributed as dist

        data_parallel = dist.is_initialized() and dist.get_world_size() > 1
        if data_parallel:  # rank 0's view of the cache decides, for every rank
            rank, decided = dist.get_rank(), [hit]
            dist.broadcast_object_list(decided, src=0)
            hit = bool(decided[0])
            if hit and rank:
                policy.model.eval()
                return SFTReport(0, float("nan"), time.perf_counter() - t0, True, key, len(pairs))
    if hit:
        load_model(policy.model, str(entry / "model.safetensors"))
        policy.model.eval()
        saved = json.loads((entry / "report.json").read_text())
        return SFTReport(0, saved["final_loss"], time.perf_counter() - t0, True, key, len(pairs),
                         [tuple(x) for x in saved["losses"]])

    run = SFTRun(policy, pairs, cfg, seed, data_parallel=data_parallel)
    last_line, step1_end = t0, None
    try:
        with torch_threads(cfg.num_threads):
            while not run.finished:
                run.train_step()
                now = time.perf_counter()
                step1_end = now if step1_end is None else step1_end
                # the last step's line is the caller's summary (an actor's line would reach the driver's
                # console after it)
                at_boundary = bool(run.losses) and run.losses[-1][0] == run.step
                if log is not None and not run.finished and (at_boundary or now - last_line >= PROGRESS_EVERY_S):
                    last_line = now
                    log(_progress_line(run, cfg.steps, now - t0, now - step1_end, cfg.target_loss))
    finally:
        policy.model.zero_grad(set_to_none=True)  # a cache hit leaves none either: RL must start the same
        policy.model.eval()
    model = policy.model
    final = run.losses[-1][1]
    steps_done = run.losses[-1][0]
    if rank:  # rank 0 writes the cache entry
        return SFTReport(steps_done, final, time.perf_counter() - t0, False, key, len(pairs), run.losses)
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=entry.parent, prefix=f".{key}."))
    save_model(model, str(tmp / "model.safetensors"))
    report = SFTReport(steps_done, final, time.perf_counter() - t0, False, key, len(pairs), run.losses)
    (tmp / "report.json").write_text(json.dumps(asdict(report)))
    try:
        tmp.rename(entry)
    except OSError:  # another process wrote the same entry first: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
    return report
