"""DeepSpeed set-up shared by the RL learner (:class:`dice_ray.cluster.learner.Learner`) and ``dice-ray sft``:
``deepspeed.initialize`` without a JIT-built op on a CPU, a one-rank ``torch.distributed`` group, and the one-process
engine of ``dice-ray sft``."""

from __future__ import annotations

import os
from typing import Any

import torch

from dice_ray.config import DEEPSPEED_OPS_DIR, SFTConfig


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def deepspeed_initialize(**kwargs: Any) -> tuple[Any, ...]:
    """``deepspeed.initialize(**kwargs)``, on a CPU accelerator without DeepSpeed's shared-memory collective op
    (:func:`_skip_shm_comm_op`: no JIT build at a machine's first run).

    Returns:
        what ``deepspeed.initialize`` returns (engine, optimizer, dataloader, scheduler).
    Raises:
        whatever ``deepspeed.initialize`` raises.
    """
    import deepspeed

    _skip_shm_comm_op()
    return deepspeed.initialize(**kwargs)


def _skip_shm_comm_op() -> None:
    """On DeepSpeed's CPU accelerator, mark its shared-memory collective op (``deepspeed_shm_comm``) unavailable,
    so its communication backend reduces through ``torch.distributed`` (gloo) instead of JIT-building the op at
    the first ``deepspeed.initialize`` of a machine: 30-50 s on a 2-core machine, the first run's longest wait.
    dice-ray's CPU learner and SFT are single-host, test-sized runs that gain nothing from it.  No effect on a GPU
    (NCCL).  DeepSpeed keeps the probed op table in ``deepspeed.ops.__compatible_ops__`` (edits persist)."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() == "cpu":
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def init_single_process_group() -> str:
    """Make this process a one-rank ``torch.distributed`` group (gloo on CPU, NCCL on GPU) unless it is one.

    The group is kept for the life of the process: DeepSpeed caches the groups it was initialised with, so a
    destroyed and re-created group would break its next engine. Like ``Learner.init_engine`` it sets
    ``MASTER_ADDR`` / ``MASTER_PORT`` (a free local port) / ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK``; like
    ``dice_ray.cluster.learner.learner_env`` (unless already set) ``DS_ACCELERATOR=cpu`` without a GPU and a
    persistent ``TORCH_EXTENSIONS_DIR`` (DeepSpeed's JIT ops, if any, build once per machine).

    Returns:
        the group's backend.

    Raises:
        RuntimeError: this process already belongs to a group of more than one rank.
    """
    import torch.distributed as dist

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.expanduser(DEEPSPEED_OPS_DIR))
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise RuntimeError(f"dice-ray sft trains in one process, but this process is rank {dist.get_rank()} "
                               f"of a torch.distributed group of {dist.get_world_size()}")
        return dist.get_backend()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    dist.init_process_group(backend, rank=0, world_size=1)
    return backend


def init_rank_group(rank: int, world_size: int, master_addr: str, master_port: int) -> str:
    """Make this process rank ``rank`` of a ``world_size``-rank ``torch.distributed`` group (gloo on CPU, NCCL on
    GPU) at the rendezvous ``master_addr:master_port``, as ``Learner.init_engine`` joins the learner's group; the
    environment as :func:`init_single_process_group` sets it. A process already in a group of that size keeps it.

    Returns:
        the group's backend.

    Raises:
        RuntimeError: this process already belongs to a group of another size.
    """
    import torch.distributed as dist

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.expanduser(DEEPSPEED_OPS_DIR))
    if dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise RuntimeError(f"this process is rank {dist.get_rank()} of a torch.distributed group of "
                               f"{dist.get_world_size()}, not of {world_size}")
        return dist.get_backend()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK="0")
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    return backend


def deepspeed_engine(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                     scheduler: torch.optim.lr_scheduler.LRScheduler, cfg: SFTConfig, bf16: bool,
                     data_parallel: bool = False):
    """A one-process DeepSpeed engine around ``model`` with the client AdamW and lr schedule.

    ZeRO stage ``cfg.zero_stage``, ``gradient_clipping`` ``cfg.max_grad_norm``, ``gradient_accumulation_steps``
    as configured (``engine.backward`` divides each batch's loss by it; ``engine.step`` steps the optimizer and
    the scheduler at the accumulation boundary only), bf16 (fp32 master weights in DeepSpeed's optimizer) when
    ``bf16``. Joins (or makes) the one-rank group of :func:`init_single_process_group` first; with
    ``data_parallel`` the group this process already belongs to (:func:`init_rank_group`: one engine a rank,
    gradients averaged over the ranks).

    Returns:
        the ``deepspeed.DeepSpeedEngine`` (its module is ``model``, moved to the accelerator).

    Raises:
        RuntimeError: without ``data_parallel``, this process belongs to a group of more than one rank; with it,
            to no group.
    """
    import torch.distributed as dist

    if not data_parallel:
        init_single_process_group()
    elif not dist.is_initialized():
        raise RuntimeError("data_parallel: join the ranks' group first (init_rank_group)")
    ds_config = {
        "train_micro_batch_size_per_gpu": cfg.batch_size,
        "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
        "gradient_clipping": cfg.max_grad_norm,
        "zero_optimization": {"stage": cfg.zero_stage},
        "bf16": {"enabled": bf16},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    engine, _, _, _ = deepspeed_initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config)
    return engine
