"""The learner: DeepSpeed ranks as Ray actors taking GRPO-family steps on diffusion-policy log-probs.

Each rank builds the policy, warm-starts it (masked-diffusion SFT, cached), wraps it in a DeepSpeed
engine (ZeRO stage from config; gloo on CPU with ``DS_ACCELERATOR=cpu``, NCCL on GPU; client
``torch.optim.AdamW``) and, each RL step, computes per-token log-probs of every rollout with
``rl.logprob_estimator`` (:mod:`dice_ray.policy.logprobs`; default TraceRL's per-denoising-step
log-probs, Wang et al. 2025, DICE's estimator) and the clipped policy loss of
:func:`dice_ray.rl.loss.clipped_policy_loss`. Groups are micro-batches; one optimizer step a call.
TraceRL's ratio uses the behaviour log-probs the sampler recorded; the ``coupled`` and ``diffu_grpo``
estimators score a state the sampler never saw, so their old log-probs are recomputed at the start of
the step under the pre-update weights, with the same masks (:func:`estimator_seed`).

Data parallel over ``cluster.learner_ranks`` ranks (:class:`LearnerGroup`, on GPUs in one Ray placement
group): :func:`plan_step` splits a step's groups across the ranks by tokens and packs each rank's share
into micro-batches of at most ``cluster.micro_batch_tokens`` tokens (gradient accumulation; a group is
never split across micro-batches or ranks, only into row chunks, below). Each group's loss is weighted
``world_size / total_groups``: DeepSpeed averages gradients over ranks, so N ranks take the update one rank
takes on the same groups. Ranks with fewer micro-batches run zero-weight ones (every rank joins every gradient
reduction). ``cluster.gradient_checkpointing`` recomputes each group's (or row chunk's) forward in the backward
pass (``torch.utils.checkpoint``, one at a time).

Row chunks (``cluster.learner_rows_per_chunk``, :func:`row_chunks`): a group of G samples is scored in chunks of
at most that many rows, one forward + backward a chunk (gradient accumulation, as micro-batches; the boundary is
the last chunk of the last micro-batch), so the autograd graph held at once is a chunk's, not a group's. Each
chunk runs every pass of the estimator with its own rows, the prompt's included (re-encoded a chunk: its gradient
is the sum over the chunks, complete), and builds its own training KV cache, so nothing is recomputed inside a
pass (the cache is mutated in attention). The loss is the whole group's: the advantages come from the whole
group, and each chunk's loss is its rows' per-sequence means divided by G
(:func:`~dice_ray.rl.loss.clipped_policy_loss`'s ``num_sequences``), so the chunks' losses, and their gradients,
sum to the group's; the KL reference, the ratio's old log-probs and the coupled masks are per row, the same in
any chunk. A micro-batch runs :attr:`RankShare.chunks` backwards, the same count on every rank.

Equal collectives (ZeRO-3): every rank runs the same backwards (each may reduce gradients across the ranks), and,
under ZeRO-3, the same forwards of the engine's module in the same order: DeepSpeed gathers a module's partitioned
parameters from every rank in each of its forwards (and again in its backward), so a rank making a forward another
does not waits for a gather nobody joins (a hang, or gloo's "collective mismatch", or parameters of the wrong module).
How many forwards a log-prob call makes depends on its data (:func:`~dice_ray.policy.logprobs.state_passes`:
TraceRL one pass a distinct denoising step of the chunk's scored tokens, coupled 2, diffu-GRPO 1, after SDAR's
prompt and clean passes), and a rank's micro-batches hold different groups. So :func:`plan_step` fixes, for every
backward of every rank, the slots (one a group of the micro-batch of any rank that holds the most) and each slot's
passes (the most any rank's chunk there needs: :attr:`RankShare.passes`), and at ZeRO-3 :func:`forward_schedule`
makes every slot a call on every rank with exactly those passes (``response_logprobs(passes=)``: states that score
nothing padded in, every pass kept in the autograd graph so the backward visits it too), a padding call where the
rank has no chunk (one row of its group of fewest tokens, nothing scored, loss weight 0); the ``coupled`` /
``diffu_grpo`` old log-probs run the same calls without grad. The KL reference (``rl.beta > 0``) is a plain copy
of the model, no DeepSpeed hooks: its forwards gather nothing and run for real chunks only. A padding pass scores no
token, so losses and gradients are unchanged; a step's ``padding_forwards`` counts the forwards that scored
nothing. Under ZeRO 0-2 forwards are no collectives: calls make the passes their data needs, and only a backward in
which a rank has no chunk gets a padding call. The learner never calls ``engine.forward`` (it runs the module's
parts), so it tells a ZeRO optimizer where each backward's forwards begin itself (:meth:`Learner._begin_micro_step`):
without it ZeRO-3 kept only a step's last backward's gradients.
"""

from __future__ import annotations

import os
import random
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np
import ray
import torch

from dice_ray.cluster.offload import StatesOffload
from dice_ray.cluster.placement import RolePlacement, learner_placement
from dice_ray.config import DEEPSPEED_OPS_DIR, DiceConfig


@dataclass
class TrainGroup:
    """One group as the learner consumes it (padded to the group's longest response).

    Attributes:
        prompt_ids: int64 [P].
        response_ids: int64 [G, R].
        unmask_step: int64 [G, R], the denoising step at which a token was unmasked (SDAR: within its block;
            LLaDA / Dream: over the whole response); -1 on padding and never-decoded tail positions.
        mask: bool [G, R], True on real response tokens (False on padding and on a rollout's ``tail_ids``,
            the decoded positions after a LLaDA / Dream response's ``eos``, kept for the TraceRL replay).
        behaviour_logprobs: float32 [G, R], log-probs recorded when the rollout was sampled.
        advantages: float32 [G].
        suffix_ids: int64 [S], LLaDA / Dream infilling: the fixed tokens after the span, shared by the group
            (:attr:`~dice_ray.policy.samples.Rollout.suffix_ids`); empty otherwise (SDAR keeps the scaffold in its
            prompt).
        span_lens: int64 [G, N], LLaDA / Dream: each row's span length (tokens) at each of its denoising steps
            (:attr:`~dice_ray.policy.samples.Rollout.span_lengths`), 0 after a row's last step; N = the group's
            most steps. Empty (numel 0) for SDAR.
    """

    prompt_ids: torch.Tensor
    response_ids: torch.Tensor
    unmask_step: torch.Tensor
    mask: torch.Tensor
    behaviour_logprobs: torch.Tensor
    advantages: torch.Tensor
    suffix_ids: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    span_lens: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 0, dtype=torch.long))


def make_train_group(prompt_ids: list[int], rollouts: list, advantages: torch.Tensor) -> TrainGroup:
    """Pad a group's rollouts into a :class:`TrainGroup` (pad id 0 and step -1, masked out); a rollout's
    ``tail_ids`` / ``tail_steps`` follow its response, masked out (context for the TraceRL replay); the group's
    ``suffix_ids`` and every rollout's ``span_lengths`` come along (the context the sampler saw).

    Raises:
        ValueError: the rollouts do not share one ``suffix_ids`` (a group is one prompt).
    """
    g = len(rollouts)
    r = max(len(x.response_ids) + len(x.tail_ids) for x in rollouts)
    suffix = list(rollouts[0].suffix_ids)
    if any(list(x.suffix_ids) != suffix for x in rollouts):
        raise ValueError("rollouts: the samples of a group must share one suffix_ids (one prompt a group)")
    ids = torch.zeros(g, r, dtype=torch.long)
    steps = torch.full((g, r), -1, dtype=torch.long)
    mask = torch.zeros(g, r, dtype=torch.bool)
    blp = torch.zeros(g, r, dtype=torch.float32)
    span_lens = torch.zeros(g, max(len(x.span_lengths) for x in rollouts), dtype=torch.long)
    for i, x in enumerate(rollouts):
        n = len(x.response_ids)
        end = n + len(x.tail_ids)
        ids[i, :end] = torch.tensor(list(x.response_ids) + list(x.tail_ids), dtype=torch.long)
        steps[i, :end] = torch.tensor(list(x.unmask_step) + list(x.tail_steps), dtype=torch.long)
        mask[i, :n] = True
        blp[i, :n] = torch.tensor(x.behaviour_logprobs)
        span_lens[i, : len(x.span_lengths)] = torch.tensor(x.span_lengths, dtype=torch.long)
    return TrainGroup(torch.tensor(prompt_ids, dtype=torch.long), ids, steps, mask, blp, advantages.float(),
                      torch.tensor(suffix, dtype=torch.long), span_lens)


def row_chunks(n_rows: int, rows_per_chunk: int) -> list[slice]:
    """The row chunks of a group of ``n_rows`` samples: consecutive slices of ``rows_per_chunk`` rows, the last one
    shorter when they do not divide; ``rows_per_chunk`` 0 (or >= ``n_rows``): one chunk, the whole group.

    Raises:
        ValueError: ``n_rows < 1`` or ``rows_per_chunk < 0``.
    """
    if n_rows < 1 or rows_per_chunk < 0:
        raise ValueError(f"row_chunks: need n_rows >= 1 and rows_per_chunk >= 0, got {n_rows} and {rows_per_chunk}")
    size = rows_per_chunk or n_rows
    return [slice(i, min(i + size, n_rows)) for i in range(0, n_rows, size)]


def group_tokens(g: TrainGroup) -> int:
    """Tokens a group costs a micro-batch: ``G * (P + R + S)``, prompt, padded response and suffix of each sample."""
    n, r = g.response_ids.shape
    return n * (r + g.prompt_ids.numel() + g.suffix_ids.numel())


@dataclass
class RankShare:
    """One learner rank's part of a step (:func:`plan_step`).

    Attributes:
        groups: the groups this rank trains on (a padding-only rank holds one group it weights 0).
        indices: each group's index in the step's batch (seeds the ``coupled`` masks, :func:`estimator_seed`).
        micro_batches: positions into ``groups``, one list a micro-batch, in slot order (chunk ``j`` of its
            ``s``-th group is slot ``s`` of the micro-batch's ``j``-th backward).
        padded: per micro-batch, True when it only joins the gradient reduction (weight 0).
        scale: weight of each group's loss, ``world_size / total_groups``.
        rows_per_chunk: rows of a group a forward + backward (``cluster.learner_rows_per_chunk``; 0: the whole group).
        chunks: backwards a micro-batch, the same on every rank: the row chunks of the step's largest group
            (chunk ``j`` of every group of a micro-batch goes in its ``j``-th backward).
        estimator: the log-prob estimator ``passes`` was counted for (``rl.logprob_estimator``).
        passes: ``passes[m][j][s]``, the same on every rank: the state passes of the log-prob call in slot ``s``
            of backward ``j`` of micro-batch ``m``, the most any rank's chunk there needs
            (:func:`~dice_ray.policy.logprobs.state_passes`); 0: no rank has a chunk there. Every backward has a
            slot above 0. Under ZeRO-3 every rank makes each of these calls (:func:`forward_schedule`).
    """

    groups: list[TrainGroup]
    indices: list[int]
    micro_batches: list[list[int]]
    padded: list[bool] = field(default_factory=list)
    scale: float = 1.0
    rows_per_chunk: int = 0
    chunks: int = 1
    estimator: str = "tracerl"
    passes: list[list[list[int]]] = field(default_factory=list)


@dataclass(frozen=True)
class LogprobCall:
    """One ``response_logprobs`` call of a backward on the engine's module (:func:`forward_schedule`): its forwards
    are SDAR's prompt and clean passes and ``passes`` state passes (``diffu_grpo``: one), or LLaDA / Dream's
    ``passes`` full-attention passes.

    Attributes:
        group: position into :attr:`RankShare.groups`.
        rows: the rows of the group scored (a row chunk), or, padding, its first row.
        passes: ``response_logprobs``' ``passes``, the state passes of the call.
        real: False for a padding call: it scores no token and its loss is weighted 0 (it only makes the call
            another rank makes there).
    """

    group: int
    rows: slice
    passes: int
    real: bool = True


def split_across_ranks(tokens: list[int], world_size: int) -> list[list[int]]:
    """Deal group indices to ranks, largest first, each to the rank with the fewest tokens so far (LPT).

    Returns:
        ``world_size`` lists of indices into ``tokens`` (each index once; a list may be empty).

    Raises:
        ValueError: ``world_size < 1``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    shares: list[list[int]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for i in sorted(range(len(tokens)), key=lambda i: (-tokens[i], i)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        shares[r].append(i)
        load[r] += tokens[i]
    return [sorted(x) for x in shares]


def pack_micro_batches(indices: list[int], tokens: list[int], budget: int) -> list[list[int]]:
    """First-fit-decreasing packing of groups into micro-batches of at most ``budget`` tokens.

    Args:
        indices: the groups to pack (indices into ``tokens``).
        tokens: tokens of every group (:func:`group_tokens`).
        budget: token budget of a micro-batch; 0: one group a micro-batch. A group over the budget gets a
            micro-batch of its own.

    Returns:
        micro-batches of indices, each index exactly once.

    Raises:
        ValueError: a negative budget.
    """
    if budget < 0:
        raise ValueError(f"micro-batch token budget must be >= 0, got {budget}")
    if budget == 0:
        return [[i] for i in indices]
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(indices, key=lambda i: (-tokens[i], i)):
        for b in range(len(bins)):
            if tokens[i] <= room[b]:
                bins[b].append(i)
                room[b] -= tokens[i]
                break
        else:
            bins.append([i])
            room.append(budget - tokens[i])
    return [sorted(b) for b in bins]


def plan_step(groups: list[TrainGroup], world_size: int, micro_batch_tokens: int,
              rows_per_chunk: int = 0, estimator: str = "tracerl") -> list[RankShare]:
    """Split a step's groups across ``world_size`` data-parallel ranks and pack each share into micro-batches.

    Every rank gets the same number of micro-batches (the largest share's count): shorter ones are padded with
    zero-weight micro-batches, so each rank takes part in every gradient reduction (ZeRO-2/3 reduce on each
    backward). Each real group's loss is weighted ``world_size / len(groups)``. With ``rows_per_chunk`` (rows of
    a group a backward, :func:`row_chunks`; 0: whole groups) every micro-batch takes as many backwards as the
    largest group has chunks (:attr:`RankShare.chunks`), on every rank. :attr:`RankShare.passes` fixes the
    log-prob calls of every backward for all ranks: a slot per group of the micro-batch that holds the most, and
    in each the most state passes any rank's chunk there needs under ``estimator``.

    Raises:
        ValueError: no groups, or a bad ``world_size`` / ``micro_batch_tokens`` / ``rows_per_chunk`` /
            ``estimator``.
    """
    from dice_ray.policy.logprobs import state_passes

    if not groups:
        raise ValueError("plan_step: no groups to train on")
    if rows_per_chunk < 0:
        raise ValueError(f"rows_per_chunk must be >= 0, got {rows_per_chunk}")
    least = state_passes(estimator, torch.zeros(0, 0, dtype=torch.long), torch.zeros(0, 0, dtype=torch.bool))
    row_slices = [row_chunks(g.response_ids.shape[0], rows_per_chunk) for g in groups]
    need = [[state_passes(estimator, g.unmask_step[r], g.mask[r]) for r in rs] for g, rs in zip(groups, row_slices)]
    chunks = max(len(rs) for rs in row_slices)
    tokens = [group_tokens(g) for g in groups]
    packed = [pack_micro_batches(idx, tokens, micro_batch_tokens) for idx in split_across_ranks(tokens, world_size)]
    n_micro = max(len(p) for p in packed)
    passes = []
    for m in range(n_micro):
        held = [p[m] for p in packed if m < len(p)]  # micro-batch m of each rank that has one
        per_backward = []
        for j in range(chunks):
            slot = [max((need[mb[s]][j] for mb in held if s < len(mb) and j < len(need[mb[s]])), default=0)
                    for s in range(max(len(mb) for mb in held))]
            if not any(slot):  # no group of the micro-batch has a chunk j: one zero-weight call a rank
                slot[0] = least
            per_backward.append(slot)
        passes.append(per_backward)
    shares = []
    for micro in packed:
        idx = sorted(i for m in micro for i in m) or [0]  # a rank with no group pads with group 0, weight 0
        pos = {i: k for k, i in enumerate(idx)}
        batches = [[pos[i] for i in m] for m in micro]
        padded = [False] * len(batches) + [True] * (n_micro - len(batches))
        batches += [[0]] * (n_micro - len(batches))
        shares.append(RankShare([groups[i] for i in idx], idx, batches, padded, world_size / len(groups),
                                rows_per_chunk, chunks, estimator, passes))
    return shares


def forward_schedule(share: RankShare, uniform: bool) -> list[list[list[LogprobCall]]]:
    """The log-prob calls of a rank's backwards: ``[m][j]``, those of backward ``j`` of micro-batch ``m``, in order.

    Slot ``s`` of a backward holds chunk ``j`` of the micro-batch's ``s``-th group, when the rank has one there,
    with the plan's passes if ``uniform``, else the fewest its rows take
    (:func:`~dice_ray.policy.logprobs.state_passes`, at least one pass: a chunk that scores nothing still has a
    gradient, 0). ``uniform`` (ZeRO-3, where every forward of the engine's module gathers parameters across the
    ranks): every slot some rank fills
    (:attr:`RankShare.passes` above 0) holds a call on every rank, padding calls where this one has no chunk;
    so every rank makes the same calls, with the same passes, in the same order. Otherwise a backward without a
    chunk of this rank holds one padding call (every rank joins every gradient reduction). A padding call scores
    nothing of the first row of the rank's group of fewest tokens, its loss weighted 0.

    Raises:
        ValueError: the plan's passes do not cover its micro-batches and chunks.
    """
    from dice_ray.policy.logprobs import state_passes

    if len(share.passes) != len(share.micro_batches) or any(len(p) != share.chunks for p in share.passes):
        raise ValueError(f"share.passes: must be [micro-batches={len(share.micro_batches)}][chunks={share.chunks}]"
                         f"[slots] (plan_step's)")
    least = state_passes(share.estimator, torch.zeros(0, 0, dtype=torch.long), torch.zeros(0, 0, dtype=torch.bool))
    chunks = [row_chunks(g.response_ids.shape[0], share.rows_per_chunk) for g in share.groups]
    filler = min(range(len(share.groups)), key=lambda k: (group_tokens(share.groups[k]), k))
    schedule = []
    for micro, pad, passes in zip(share.micro_batches, share.padded, share.passes):
        backwards = []
        for j, slots in enumerate(passes):
            calls = []
            for s, n in enumerate(slots):
                k = micro[s] if not pad and s < len(micro) else None
                if k is not None and j < len(chunks[k]):
                    g, rows = share.groups[k], chunks[k][j]
                    own = n if uniform else state_passes(share.estimator, g.unmask_step[rows], g.mask[rows])
                    calls.append(LogprobCall(k, rows, own))
                elif uniform and n:
                    calls.append(LogprobCall(filler, slice(0, 1), n, real=False))
            if not calls:
                calls.append(LogprobCall(filler, slice(0, 1), least, real=False))
            backwards.append(calls)
        schedule.append(backwards)
    return schedule


def estimator_seed(base: int, step: int, group: int) -> int:
    """Seed of a group's log-prob estimator masks (``coupled``) at one learner step: fixed per run seed,
    step and group, so the old-policy and new-policy log-probs of the step use the same masks."""
    return (base * 1_000_003 + step) * 65_537 + group


def learner_env(use_gpu: bool) -> dict:
    """Environment for a learner rank: DeepSpeed's CPU accelerator without GPUs, and a persistent
    ``TORCH_EXTENSIONS_DIR`` so DeepSpeed's JIT ops, if any, build once per machine (on a CPU none: see
    ``dice_ray.policy.deepspeed_setup.deepspeed_initialize``)."""
    env = {"TORCH_EXTENSIONS_DIR": os.path.expanduser(DEEPSPEED_OPS_DIR)}
    if not use_gpu:
        env["DS_ACCELERATOR"] = "cpu"
    return env


@ray.remote(num_cpus=0)
class Learner:
    """One DeepSpeed rank (driven through :class:`LearnerGroup`).

    Args:
        cfg: the run's config.
        rank, world_size: this rank in the learner group.
        num_threads: torch CPU threads (0: torch's default).
    """

    rank, world_size = 0, 1
    offload = StatesOffload(False)  # a rank without colocation (a test's bare instance); __init__ sets its own

    def __init__(self, cfg: DiceConfig, rank: int, world_size: int, num_threads: int = 0):
        from dice_ray.policy.policy import DiffusionPolicy

        if num_threads:
            torch.set_num_threads(num_threads)
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.use_gpu = torch.cuda.is_available() and bool(ray.get_gpu_ids())
        self.device = torch.device("cuda", 0) if self.use_gpu else torch.device("cpu")
        self.policy = DiffusionPolicy.from_config(cfg.model)
        self.policy.model.to(self.device)
        self.engine = None
        self.ref_model = None
        self.step_count = 0
        self.weight_group = None  # the weight-sync group (rank 0, broadcast mode), joined on first use
        self.warm_started = False  # warm_start ran (init_engine reports where the weights came from)
        # cluster.colocate_rollout: the states leave the GPU while rollout workers sample on it (a GPU rank only)
        self.offload = StatesOffload(cfg.cluster.colocate_rollout and self.use_gpu)

    def rendezvous(self) -> tuple[str, int]:
        """This node's IP and a free port on it (the rendezvous rank 0 serves)."""
        import socket

        with socket.socket() as sock:
            sock.bind(("", 0))
            return ray.util.get_node_ip_address(), sock.getsockname()[1]

    def warm_start(self, pairs: list[tuple[str, ...]], master_addr: str | None = None,
                   master_port: int | None = None) -> dict:
        """Masked-diffusion SFT warm start (cached by content hash); before :meth:`init_engine`. Given a
        rendezvous (several ranks), every rank joins the learner's group here and trains its shard of each batch."""
        from dataclasses import asdict

        from dice_ray.policy.deepspeed_setup import init_rank_group
        from dice_ray.policy.sft_warm_start import warm_start

        parallel = master_addr is not None and self.world_size > 1
        if parallel:
            init_rank_group(self.rank, self.world_size, master_addr, master_port)
        log = (lambda line: print(line, flush=True)) if self.rank == 0 else None  # reaches the driver's console
        report = warm_start(self.policy, pairs, self.cfg.sft, seed=self.cfg.sft_seed, log=log, data_parallel=parallel)
        self.warm_started = True
        return asdict(report)

    def init_engine(self, master_addr: str = "127.0.0.1", master_port: int | None = None) -> dict:
        """Join the learner's process group and wrap the policy in a DeepSpeed engine; returns what was set up.

        The model gets the fused kernels of ``cluster.fused_kernels`` first (:func:`dice_ray.policy.fused.apply_fused_kernels`;
        the report's ``fused_kernels`` lists them, and ``fused_kernels_off`` says why ``auto`` left them off on a GPU;
        ValueError when ``liger`` is asked for and cannot be applied), then the attention of ``cluster.learner_attention``
        (:func:`dice_ray.policy.model.set_attention`; ``attention`` names it, ``attention_off`` says why ``auto`` kept
        SDPA on a GPU) and, with ``cluster.learner_compile``, compiled decoder layers
        (:func:`dice_ray.policy.compiled.compile_layers`; ``compiled_layers`` counts them, 0 without).

        With several ranks, every rank first takes rank 0's weights (a warm-start cache hit loads on rank 0 only), so the
        KL reference and the engine start from the same policy everywhere.

        With ``cluster.colocate_rollout`` (on a GPU) the engine's states then go to CPU memory
        (:class:`~dice_ray.cluster.offload.StatesOffload`; ``offload_seconds`` says how long it took, None without),
        so the rollout workers sample on a free GPU; :meth:`train_step` brings them back.

        Args:
            master_addr, master_port: the ``torch.distributed`` rendezvous (rank 0's :meth:`rendezvous`);
                a free local port when None (one rank).
        """
        from dice_ray.policy.compiled import compile_layers
        from dice_ray.policy.fused import apply_fused_kernels, liger_blocker
        from dice_ray.policy.deepspeed_setup import deepspeed_initialize
        from dice_ray.policy.model import flex_blocker, set_attention

        t0 = time.perf_counter()
        backend = "nccl" if self.use_gpu else "gloo"
        if master_port is None:
            master_port = self.rendezvous()[1]
        os.environ.update(
            MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size), LOCAL_RANK="0",
        )
        if not torch.distributed.is_initialized():
            torch.distributed.init_process_group(backend, rank=self.rank, world_size=self.world_size)
        model = self.policy.model.to(self.device)
        if self.world_size > 1:
            with torch.no_grad():
                for t in list(model.parameters()) + list(model.buffers()):
                    torch.distributed.broadcast(t.data, src=0)
        # the SFT warm start leaves its last step's gradients on the parameters (a cache hit or a resume
        # does not), and DeepSpeed's first backward would add the RL gradient to them: start from none
        model.zero_grad(set_to_none=True)
        # fused Triton kernels (Liger) before the KL reference copy and the engine; the rollout workers sample with
        # the unpatched model in their own processes (equal numerics within bf16 rounding: dice_ray.policy.fused)
        fused = apply_fused_kernels(model, self.cfg.cluster.fused_kernels)
        fused_off = liger_blocker(model) if self.use_gpu and not fused and self.cfg.cluster.fused_kernels == "auto" else None
        # the attention of the block-masked passes (the KL reference copies the choice), then the compiled layers
        # (the learner's model only: the reference runs no backward)
        attention = set_attention(model, self.cfg.cluster.learner_attention)
        attention_off = (flex_blocker(model) if self.use_gpu and attention == "sdpa"
                         and self.cfg.cluster.learner_attention == "auto" else None)
        if self.cfg.rl.beta > 0:
            import copy

            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        compiled = compile_layers(model) if self.cfg.cluster.learner_compile else 0
        optimizer = torch.optim.AdamW(model.parameters(), lr=self.cfg.rl.learning_rate, weight_decay=0.0)
        c = self.cfg.cluster
        zero: dict = {"stage": c.zero_stage}
        if c.learner_offload:  # optimizer state (and, under ZeRO-3, parameters) in CPU memory
            zero["offload_optimizer"] = {"device": "cpu"}
            if c.zero_stage == 3:
                zero["offload_param"] = {"device": "cpu"}
        ds_config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,  # micro-batches are counted by set_gradient_accumulation_boundary
            "gradient_clipping": self.cfg.rl.max_grad_norm,
            "zero_optimization": zero,
            "zero_force_ds_cpu_optimizer": False,  # offload with the client AdamW (no DeepSpeed op build)
            "bf16": {"enabled": self.cfg.model.dtype == "bfloat16"},
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        t_ds = time.perf_counter()
        self.engine, _, _, _ = deepspeed_initialize(model=model, optimizer=optimizer, config=ds_config)
        t_ds = time.perf_counter() - t_ds
        self.offload.sleep(self.engine, [self.ref_model])
        built = "built, warm-started by SFT" if self.warm_started else "built (random init)"
        return {"family": self.policy.family, "model": self.cfg.model.path or built,
                "backend": backend, "zero_stage": c.zero_stage, "ranks": self.world_size,
                "seconds": time.perf_counter() - t0, "deepspeed_seconds": t_ds, "device": str(self.device),
                "params": sum(p.numel() for p in self.policy.model.parameters()), "fused_kernels": fused,
                "fused_kernels_off": fused_off, "attention": attention, "attention_off": attention_off,
                "compiled_layers": compiled,
                "offload_seconds": self.offload.parked.seconds if self.offload.asleep else None}

    def train_step(self, groups: list[TrainGroup] | RankShare) -> dict:
        """One optimizer step a PPO epoch over this rank's groups (``rl.ppo_epochs`` epochs); with
        ``cluster.colocate_rollout`` the states come back to the GPU first and go to CPU memory after
        (``seconds`` includes both).

        Args:
            groups: this rank's :class:`RankShare` (:func:`plan_step`), or a plain list of groups (one rank:
                packed here by ``cluster.micro_batch_tokens``, chunked by ``cluster.learner_rows_per_chunk``).

        Returns:
            this rank's loss, clip fraction, KL, ratio mean (means over its group evaluations; a group scored in
            row chunks counts once, its stats merged by :func:`~dice_ray.rl.loss.merge_chunk_stats`), ``groups``
            (that count), tokens, grad norm, micro-batches a epoch, ``row_chunks`` (backwards a micro-batch),
            ``padding_forwards`` (forwards of the engine's module that scored nothing: padding calls and passes,
            :func:`forward_schedule`), seconds, tokens/s, step (:func:`merge_rank_stats` combines ranks).

        Raises:
            ValueError: the share was planned for another estimator than ``rl.logprob_estimator``.
        """
        from torch.utils.checkpoint import checkpoint

        from dice_ray.policy.families import family_of
        from dice_ray.policy.logprobs import response_logprobs, state_passes
        from dice_ray.rl.loss import clipped_policy_loss, merge_chunk_stats

        t0 = time.perf_counter()
        self.offload.wake()
        rl, c = self.cfg.rl, self.cfg.cluster
        dev, est = self.device, rl.logprob_estimator
        share = groups if isinstance(groups, RankShare) else plan_step(
            groups, 1, c.micro_batch_tokens, c.learner_rows_per_chunk, est)[0]
        if share.estimator != est:
            raise ValueError(f"train_step: the share was planned for the {share.estimator!r} estimator, this learner "
                             f"scores with rl.logprob_estimator={est!r}")
        gs = share.groups
        uniform = c.zero_stage == 3  # every forward gathers parameters across the ranks: every rank the same calls
        schedule = forward_schedule(share, uniform)
        block, mask_id = self.policy.block_size, self.policy.mask_id
        sums = {"loss": 0.0, "clip_fraction": 0.0, "kl": 0.0, "ratio_mean": 0.0}
        n_items = 0
        tokens = 0
        self.engine.train()
        seeds = [estimator_seed(rl.seed, self.step_count, i) for i in share.indices]
        real = sorted({k for m, pad in zip(share.micro_batches, share.padded) if not pad for k in m})

        # bidirectional families (LLaDA, Dream) decode a canvas of max_new_tokens whatever the group's longest
        # response (an infill span grows up to it): the replay needs its length at every step (the group's span
        # trace; without one, max_new_tokens throughout), and the suffix after an infilled span; SDAR decodes
        # block by block and ignores both
        canvas = None if family_of(self.engine.module) in (None, "sdar") else self.cfg.sampling.max_new_tokens

        def logprobs_of(model, g: TrainGroup, seed: int, rows: slice, passes: int | None = None,
                        score: bool = True) -> torch.Tensor:
            """Log-probs [rows, R] of one row chunk of ``g``; the canvas, trace and masks are the whole group's.
            ``score=False``: a padding call, every token unscored (0), ``passes`` state passes all the same."""
            trace = g.span_lens.to(dev) if g.span_lens.numel() else None
            # tracerl follows the trace; coupled / diffu_grpo score a canvas as long as the group's longest span
            longest = canvas if trace is None else int(g.span_lens.max())
            mask = g.mask.to(dev) if score else torch.zeros_like(g.mask, device=dev)
            return response_logprobs(est, model, g.prompt_ids.to(dev), g.response_ids.to(dev), g.unmask_step.to(dev),
                                     mask, block, mask_id, seed=seed, canvas_len=longest,
                                     suffix_ids=g.suffix_ids.to(dev), span_lens=trace, rows=rows, passes=passes)

        def idle(call: LogprobCall) -> int:
            """Forwards of ``call`` that score nothing: a padding call's all (SDAR's prompt and clean passes too), a
            real call's passes beyond its rows' need."""
            if call.real:
                g = gs[call.group]
                return call.passes - state_passes(est, g.unmask_step[call.rows], g.mask[call.rows])
            return call.passes + (2 if canvas is None and est != "diffu_grpo" else 0)

        calls = [call for backwards in schedule for forwards in backwards for call in forwards]
        padding = rl.ppo_epochs * sum(idle(call) for call in calls)
        old = {k: gs[k].behaviour_logprobs.to(dev) for k in real}
        if est != "tracerl":  # the ratio's old log-probs: same estimator and masks, pre-update weights, call by call
            pieces: dict[int, list[torch.Tensor]] = {k: [] for k in real}
            with torch.no_grad():
                for call in calls:
                    if call.real:
                        k = call.group
                        pieces[k].append(logprobs_of(self.engine.module, gs[k], seeds[k], call.rows, call.passes))
                    elif uniform:  # no reduction waits on a no-grad forward: only ZeRO-3's gathers need it
                        logprobs_of(self.engine.module, gs[call.group], 0, call.rows, call.passes, score=False)
                    else:
                        continue
                    padding += idle(call)
            old = {k: torch.cat(pieces[k]) for k in real}

        def call_loss(call: LogprobCall, ref: torch.Tensor | None):
            """The loss of a call: a real one's rows' share of their group's loss (divided by its G) and their
            stats; a padding call's 0 (its log-probs times 0, so the backward runs through its forwards) and None."""
            g, k = gs[call.group], call.group
            if not call.real:
                return logprobs_of(self.engine.module, g, 0, call.rows, call.passes, score=False).sum() * 0.0, None
            logprobs = logprobs_of(self.engine.module, g, seeds[k], call.rows, call.passes)
            rows = call.rows
            return clipped_policy_loss(logprobs, old[k][rows], g.advantages[rows].to(dev), g.mask[rows].to(dev),
                                       epsilon=rl.epsilon, beta=rl.beta, ref_logprobs=ref,
                                       num_sequences=g.response_ids.shape[0])

        last = len(share.micro_batches) - 1
        for _ in range(rl.ppo_epochs):
            for m, (micro, pad) in enumerate(zip(share.micro_batches, share.padded)):
                parts: dict[int, list] = {k: [] for k in micro}
                for j, forwards in enumerate(schedule[m]):  # chunk j of each group of the micro-batch: one backward
                    self.engine.set_gradient_accumulation_boundary(m == last and j == share.chunks - 1)
                    self._begin_micro_step()
                    total = None
                    for call in forwards:
                        ref = None
                        if call.real and self.ref_model is not None:  # a plain module: no collective in its forward
                            with torch.no_grad():
                                ref = logprobs_of(self.ref_model, gs[call.group], seeds[call.group], call.rows)
                        if c.gradient_checkpointing:  # the call's forwards are recomputed in the backward
                            loss, stats = checkpoint(call_loss, call, ref, use_reentrant=False)
                        else:
                            loss, stats = call_loss(call, ref)
                        if call.real:
                            parts[call.group].append(stats)
                            loss = loss * share.scale
                        total = loss if total is None else total + loss
                    self.engine.backward(total, scale_wrt_gas=False)
                if not pad:
                    for k in micro:
                        stats = merge_chunk_stats(parts[k])
                        for key in sums:
                            sums[key] += getattr(stats, key)
                        n_items += 1
                        tokens += int(gs[k].mask.sum())
            grad_norm = self._grad_norm()
            self.engine.step()
        if grad_norm is None:  # ZeRO >= 1: DeepSpeed's optimizer computed it in the step
            norm = self.engine.get_global_grad_norm()
            grad_norm = None if norm is None else float(norm)
        self.step_count += 1
        self.offload.sleep(self.engine, [self.ref_model])
        seconds = time.perf_counter() - t0
        out = {k: v / max(n_items, 1) for k, v in sums.items()}
        out.update(groups=n_items, tokens=tokens, grad_norm=grad_norm, micro_batches=len(share.micro_batches),
                   row_chunks=share.chunks, padding_forwards=padding, seconds=seconds,
                   tokens_per_s=tokens / max(seconds, 1e-9), step=self.step_count)
        return out

    def _begin_micro_step(self) -> None:
        """Tell a ZeRO optimizer that a micro-step (the forwards of one backward) begins, as DeepSpeed's
        ``engine.forward`` does first; the learner calls the engine's module's parts (:mod:`dice_ray.policy.logprobs`),
        never the engine, so it must. ZeRO-3 counts micro-steps there: without it each backward overwrote, instead
        of adding to, the gradient partitions, and only the step's last backward reached the optimizer. A no-op for
        an engine without a ZeRO optimizer (ZeRO-0, the tests' plain engines)."""
        zero = sys.modules.get("deepspeed.runtime.base_optimizer")  # imported with any DeepSpeed engine
        optimizer = getattr(self.engine, "optimizer", None)
        if zero is not None and isinstance(optimizer, zero.ZeROOptimizer):
            optimizer.clear_backward_seen_flag()

    def _grad_norm(self) -> float | None:
        """L2 norm of the accumulated gradients before clipping (last PPO epoch); None under ZeRO >= 1,
        where the gradients are partitioned and DeepSpeed's optimizer reports its own norm in the step."""
        if self.cfg.cluster.zero_stage:
            return None
        grads = [p.grad.detach().float().norm() for p in self.engine.module.parameters() if p.grad is not None]
        return float(torch.stack(grads).norm()) if grads else None

    def _gathered(self, params=None):
        """Context in which ZeRO-3's partitioned parameters are whole (every rank must enter it); a no-op
        under ZeRO 0-2."""
        if self.engine is None or self.cfg.cluster.zero_stage != 3:
            return nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(params if params is not None else self.engine.module.parameters()))

    def _module(self) -> torch.nn.Module:
        return self.engine.module if self.engine is not None else self.policy.model

    def get_weights(self) -> dict | None:
        """The policy's weights as CPU tensors on rank 0 (the object-store weight sync), None on other ranks
        (which only join ZeRO-3's gather). Offloaded states are read where they are under ZeRO 0-2 (the module's
        parameters, in CPU memory); ZeRO-3 gathers on the GPU, so its states come back for it and go again."""
        with self.offload.awake() if self.cfg.cluster.zero_stage == 3 else nullcontext(), self._gathered():
            if self.rank:
                return None
            return {k: v.detach().to("cpu").clone() for k, v in self._module().state_dict().items()}

    def weight_plan(self, bucket_bytes: int) -> tuple:
        """The bucket plan of the policy's weights (:func:`dice_ray.cluster.weight_sync.plan_buckets`)."""
        from dice_ray.cluster.weight_sync import named_weights, plan_buckets

        return plan_buckets(named_weights(self._module()), bucket_bytes)

    def broadcast_weights(self, spec) -> int:
        """Send the weights over the weight-sync group, bucket by bucket (rank 0; the group is joined on the
        first call). Other ranks only join ZeRO-3's per-bucket gather. Returns the bytes sent.

        Args:
            spec: the group's :class:`~dice_ray.cluster.weight_sync.BroadcastSpec` (rank 0).
        """
        from dice_ray.cluster import weight_sync as ws

        if self.rank == 0 and (self.weight_group is None or not self.weight_group.current(spec)):
            self.weight_group = ws.BroadcastGroup(spec, self.device)
        sent = 0
        with self.offload.awake():  # the buckets go from the device
            tensors = ws.named_weights(self._module())
            for bucket in spec.buckets:
                with self._gathered([tensors[s.name] for s in bucket if isinstance(tensors[s.name], torch.nn.Parameter)]):
                    if self.rank == 0:
                        self.weight_group.send_bucket(bucket, tensors)
                        sent += ws.bucket_size(bucket)
        return sent

    def save(self, ckpt_dir: str, tag: str) -> str:
        """DeepSpeed checkpoint (model, optimizer, LR schedule) + the policy for eval; returns its folder.

        For an exact resume it also keeps, in DeepSpeed's ``client_state``, the learner's step count (it
        seeds the ``coupled`` estimator's masks, :func:`estimator_seed`) and the torch / numpy / python RNG
        states; and, with ``rl.beta > 0``, the frozen KL reference (``reference.pt``): it is the
        warm-started policy, which a resumed learner no longer has (it loads the RL weights instead).
        """
        client_state = {"dice_ray": {"step_count": self.step_count, "rng": _rng_state()}}
        with self.offload.awake():  # DeepSpeed saves its states from where it keeps them
            self.engine.save_checkpoint(ckpt_dir, tag=tag, client_state=client_state)
            with self._gathered():
                if self.rank == 0:
                    self.policy.save(os.path.join(ckpt_dir, tag, "policy"))
                    if self.ref_model is not None:
                        torch.save(self.ref_model.state_dict(), os.path.join(ckpt_dir, tag, "reference.pt"))
        return os.path.join(ckpt_dir, tag)

    def load(self, ckpt_dir: str, tag: str) -> None:
        """Restore a checkpoint written by :meth:`save` (after :meth:`init_engine`): weights, optimizer,
        LR schedule, step count, RNG states and the KL reference.

        Raises:
            FileNotFoundError: no checkpoint ``tag`` under ``ckpt_dir``, or its KL reference is missing
                while ``rl.beta > 0``.
        """
        with self.offload.awake():  # DeepSpeed loads into its states where they live on the device
            path, client_state = self.engine.load_checkpoint(ckpt_dir, tag=tag)
            if path is None:
                raise FileNotFoundError(f"no DeepSpeed checkpoint {tag!r} under {ckpt_dir}")
            extra = (client_state or {}).get("dice_ray")
            if extra is not None:  # checkpoints of older dice-ray versions lack it: step count 0, RNG as is
                self.step_count = extra["step_count"]
                _set_rng_state(extra["rng"])
            if self.ref_model is not None:
                ref = os.path.join(ckpt_dir, tag, "reference.pt")
                if not os.path.exists(ref):
                    raise FileNotFoundError(f"rl.beta={self.cfg.rl.beta} needs the KL reference {ref}, which is missing")
                self.ref_model.load_state_dict(torch.load(ref, map_location=self.device, weights_only=True))


def merge_rank_stats(*outs: dict) -> dict:
    """Combine the ranks' :meth:`Learner.train_step` results into the step's: loss, clip fraction, KL and
    ratio mean weighted by each rank's group evaluations; tokens and padding forwards summed; seconds the slowest
    rank's; grad norm and step rank 0's (the same on every rank)."""
    n = sum(o["groups"] for o in outs)
    out = {k: sum(o[k] * o["groups"] for o in outs) / max(n, 1) for k in ("loss", "clip_fraction", "kl", "ratio_mean")}
    seconds = max(o["seconds"] for o in outs)
    tokens = sum(o["tokens"] for o in outs)
    out.update(groups=n, tokens=tokens, grad_norm=outs[0]["grad_norm"], micro_batches=outs[0]["micro_batches"],
               row_chunks=outs[0].get("row_chunks", 1),
               padding_forwards=sum(o.get("padding_forwards", 0) for o in outs), seconds=seconds, tokens_per_s=tokens / max(seconds, 1e-9), step=outs[0]["step"], ranks=len(outs))
    return out


@ray.remote(num_cpus=0)
def _merge_stats(*outs: dict) -> dict:
    return merge_rank_stats(*outs)


@ray.remote(num_cpus=0)
def _first(*outs):
    return outs[0]


class _Call:
    """``group.method.remote(*args)`` -> one ObjectRef, as an actor handle's method answers."""

    def __init__(self, fn):
        self.remote = fn


class LearnerGroup:
    """The learner's ``cluster.learner_ranks`` DeepSpeed ranks, driven as one.

    On GPUs the ranks are Ray actors in one placement group (a bundle of ``cluster.learner_gpus`` GPUs a
    rank, packed on as few nodes as possible: :func:`~dice_ray.cluster.placement.learner_placement`); on CPU plain
    actors (gloo). The group answers the calls the
    driver makes on a learner actor handle (``group.train_step.remote(batch)`` gives one ObjectRef), so
    the driver loop is the same for one rank or many: ``warm_start`` runs on every rank, data-parallel (each
    rank a shard of each SFT batch; a cache hit loads on rank 0 only, and ``init_engine`` hands rank 0's weights
    to the others); ``train_step`` splits the batch with :func:`plan_step` and merges the
    ranks' stats (:func:`merge_rank_stats`); ``save`` / ``load`` / ``init_engine`` run on every rank and
    answer rank 0's result.

    Args:
        cfg: the run's config (``cluster.learner_ranks``, ``learner_gpus``, ``micro_batch_tokens``,
            ``learner_rows_per_chunk``).
        use_gpu: give each rank ``cluster.learner_gpus`` GPUs (else CPU, gloo).
        num_threads: torch CPU threads of each rank (0: torch's default).
        env: environment variables of the rank processes (:func:`learner_env`).
        placement: where the ranks go (:func:`~dice_ray.cluster.placement.learner_placement`, its owner removes its
            group); None: the group makes its own from ``cfg`` and ``use_gpu`` and removes it in :meth:`shutdown`.

    Raises:
        ValueError: ``use_gpu`` with ``cluster.learner_gpus`` of 0.
        PlacementTimeout: its own placement group was not placed within ``cluster.placement_timeout_s``.
    """

    def __init__(self, cfg: DiceConfig, use_gpu: bool, num_threads: int = 0, env: dict | None = None,
                 placement: RolePlacement | None = None):
        n = cfg.cluster.learner_ranks
        self.cfg, self.world_size = cfg, n
        self._own_placement = placement is None
        self.placement = learner_placement(cfg, use_gpu) if placement is None else placement
        self.actors = [
            Learner.options(runtime_env={"env_vars": env or {}}, **self.placement.options(i)).remote(cfg, i, n, num_threads)
            for i in range(n)
        ]
        self.warm_start = _Call(self._warm_start)
        self.init_engine = _Call(self._init_engine)
        self.train_step = _Call(self._train_step)
        self.save = _Call(lambda ckpt_dir, tag: self._all("save", ckpt_dir, tag))
        self.load = _Call(lambda ckpt_dir, tag: self._all("load", ckpt_dir, tag))

    def _all(self, method: str, *args):
        refs = [getattr(a, method).remote(*args) for a in self.actors]
        return refs[0] if len(refs) == 1 else _first.remote(*refs)

    def _warm_start(self, pairs):
        if self.world_size == 1:
            return self.actors[0].warm_start.remote(pairs)
        addr, port = ray.get(self.actors[0].rendezvous.remote())  # every rank trains a shard of each batch
        return self._all("warm_start", pairs, addr, port)

    def _init_engine(self):
        addr, port = ray.get(self.actors[0].rendezvous.remote())
        return self._all("init_engine", addr, port)

    def _train_step(self, groups: list[TrainGroup]):
        c = self.cfg.cluster
        shares = plan_step(groups, self.world_size, c.micro_batch_tokens, c.learner_rows_per_chunk,
                           self.cfg.rl.logprob_estimator)
        refs = [a.train_step.remote(s) for a, s in zip(self.actors, shares)]
        return refs[0] if len(refs) == 1 else _merge_stats.remote(*refs)

    # ---- weight sync (dice_ray.cluster.weight_sync.WeightSync) ----
    def weights_ref(self):
        """ObjectRef of rank 0's CPU state dict (all ranks join ZeRO-3's gather)."""
        if self.cfg.cluster.zero_stage != 3:
            return self.actors[0].get_weights.remote()
        refs = [a.get_weights.remote() for a in self.actors]
        ray.get(refs[1:])
        return refs[0]

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0's node IP and a free port there (the weight-sync group's rendezvous)."""
        return ray.get(self.actors[0].rendezvous.remote())

    def plan_buckets(self, bucket_bytes: int) -> tuple:
        """The bucket plan of the weights (rank 0's)."""
        return ray.get(self.actors[0].weight_plan.remote(bucket_bytes))

    def broadcast_weights(self, spec) -> list:
        """Start the bucketed broadcast from rank 0 (every rank under ZeRO-3); returns the ObjectRefs."""
        ranks = self.actors if self.cfg.cluster.zero_stage == 3 else self.actors[:1]
        return [a.broadcast_weights.remote(spec) for a in ranks]

    def shutdown(self) -> None:
        """Kill the ranks, and remove their placement group when the group made it."""
        for a in self.actors:
            ray.kill(a)
        if self._own_placement:
            self.placement.remove()


def _rng_state() -> dict:
    """The process's torch (CPU and, if present, CUDA), numpy and python RNG states."""
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    """Restore what :func:`_rng_state` took (CUDA states only where CUDA is up)."""
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
