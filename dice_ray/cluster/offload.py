"""Freeing a learner rank's GPU while the rollout workers sample on it (``cluster.colocate_rollout``).

After a learner step the rank's DeepSpeed engine moves its states to CPU memory (:func:`offload_states`), and back
before the next step (:func:`reload_states`); :class:`StatesOffload` is the rank's switch between the two. What
moves, by ZeRO stage, with DeepSpeed 0.19's ``engine.offload_states`` / ``reload_states`` where they apply:

- **ZeRO 1-2**: DeepSpeed moves all of it: the 16-bit weights (the module's parameters stay views of DeepSpeed's
  flat buffer, now in CPU memory, so the weights can still be read while offloaded), the fp32 master partition, the
  gradient partition and the optimizer's moments.
- **ZeRO-3**: DeepSpeed moves the 16-bit weight partitions, the gradient partitions and the gradient buckets. Its
  own move of the fp32 master partitions and the optimizer states asserts DeepSpeed's FusedAdam, and the learner
  steps torch's AdamW (no JIT op build), so torch moves those, the way DeepSpeed does (the tensors the optimizer
  steps, and their state).
- **ZeRO-0**: DeepSpeed has no offload here (no ZeRO optimizer), so torch moves the module's parameters, buffers and
  gradients and the optimizer's state. (A 16-bit policy at stage 0 runs DeepSpeed's unfused 16-bit optimizer,
  whose master copies this does not know: the config refuses it with colocation.)
- With ``cluster.learner_offload`` the states DeepSpeed keeps in CPU memory stay there; ZeRO-3's offloaded
  parameters are DeepSpeed's to move, and its ``offload_states`` refuses them: only the rest moves.

``extra`` modules (the frozen KL reference) are moved by torch. Torch's moves copy each tensor on the engine's device
into new memory (page-locked when it comes from CUDA) and swap it into the same tensor object (``t.data = copy``,
as DeepSpeed does and ``Module.to`` does), so every holder (the optimizer's param groups and state, the module)
keeps its reference; the device memory goes once its last user does, and the CUDA cache is emptied.
"""

from __future__ import annotations

import gc
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

OFFLOAD_DEVICE = "cpu"


@dataclass
class Offloaded:
    """What :func:`offload_states` moved, for :func:`reload_states`.

    Attributes:
        device: the engine's device the states come back to.
        deepspeed: the DeepSpeed state kinds ``engine.offload_states`` moved (``OffloadStateTypeEnum`` values).
        tensors: the tensors torch moved (their ``.data`` now in CPU memory).
        nbytes: bytes torch moved (DeepSpeed's part not counted).
        seconds: wall time of the offload.
    """

    device: torch.device
    deepspeed: list = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)
    nbytes: int = 0
    seconds: float = 0.0


def _deepspeed_part(engine) -> list:
    """The ``OffloadStateTypeEnum`` kinds DeepSpeed's ``engine.offload_states`` is asked to move (see the module
    docstring): at ZeRO 1-2 the four it moves there, less the master weights and moments a CPU optimizer
    (``cluster.learner_offload``) keeps in CPU memory already; at ZeRO-3 the 16-bit partitions, gradients and
    buckets; none at ZeRO-0 nor where DeepSpeed keeps the parameters in CPU memory itself."""
    stage = engine.zero_optimization_stage()
    if stage == 0:
        return []
    param_offload = engine.zero_offload_param()
    if param_offload is not None and str(getattr(param_offload.device, "value", param_offload.device)) != "none":
        return []
    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum as S

    if stage == 3:
        return [S.lp_params, S.lp_grads, S.contiguous_grad_buffer]
    if engine.zero_use_cpu_optimizer():
        return [S.lp_params, S.lp_grads]
    return [S.optim_states, S.hp_params, S.lp_params, S.lp_grads]


def _torch_part(engine, extra: Sequence[torch.nn.Module]) -> list[torch.Tensor]:
    """The tensors torch moves (see the module docstring), each once, whatever their device."""
    stage = engine.zero_optimization_stage()
    modules = list(extra) + ([engine.module] if stage == 0 else [])
    out: dict[int, torch.Tensor] = {}

    def add(t):
        if isinstance(t, torch.Tensor):
            out.setdefault(id(t), t)

    for m in modules:
        for p in m.parameters():
            add(p)
            add(p.grad)
        for b in m.buffers():
            add(b)
    if stage in (0, 3):
        opt = engine.basic_optimizer
        # ZeRO-3 hands the optimizer its fp32 partitions only inside its step: take them from DeepSpeed's optimizer
        stepped = [p for group in opt.param_groups for p in group["params"]] + list(opt.state)
        stepped += list(getattr(engine.optimizer, "fp32_partitioned_groups_flat", [])) if stage == 3 else []
        for p in stepped:
            add(p)
            add(p.grad)
            for v in opt.state.get(p, {}).values():
                add(v)
    return list(out.values())


def _move(t: torch.Tensor, device: torch.device | str) -> None:
    """Copy ``t``'s values into new memory on ``device`` (page-locked when leaving CUDA) and swap it in."""
    if t.is_cuda and torch.device(device).type == "cpu":
        copy = torch.empty_like(t, device="cpu", pin_memory=True)
        copy.copy_(t.data)
    else:
        copy = t.data.to(device, copy=True)
    t.data = copy


def offload_states(engine, extra: Sequence[torch.nn.Module] = ()) -> Offloaded:
    """Move a DeepSpeed engine's states (and ``extra`` modules) on its device to CPU memory.

    Args:
        engine: a ``deepspeed.DeepSpeedEngine`` after its step (no backward in progress).
        extra: more modules on the engine's device (the frozen KL reference).

    Returns:
        what moved, for :func:`reload_states`.

    Raises:
        ValueError: ZeRO-0 with an optimizer other than a plain torch one (DeepSpeed's 16-bit wrapper holds master
            copies this cannot move; the config refuses colocation there).
    """
    t0 = time.perf_counter()
    device = torch.device(engine.device)
    if engine.zero_optimization_stage() == 0 and engine.optimizer is not engine.basic_optimizer:
        raise ValueError(f"offload_states: ZeRO-0 with DeepSpeed's {type(engine.optimizer).__name__} (a 16-bit policy) "
                         "is not supported: use cluster.zero_stage >= 1")
    done = Offloaded(device, _deepspeed_part(engine))
    if done.deepspeed:
        engine.offload_states(include=done.deepspeed)
    for t in _torch_part(engine, extra):
        if t.device == device:
            done.nbytes += t.numel() * t.element_size()
            _move(t, OFFLOAD_DEVICE)
            done.tensors.append(t)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    done.seconds = time.perf_counter() - t0
    return done


def reload_states(engine, offloaded: Offloaded) -> float:
    """Bring back what :func:`offload_states` moved; returns the wall time (s)."""
    t0 = time.perf_counter()
    if offloaded.deepspeed:
        engine.reload_states()
    for t in offloaded.tensors:
        _move(t, offloaded.device)
    if offloaded.device.type == "cuda":
        torch.cuda.synchronize(offloaded.device)
    return time.perf_counter() - t0


class StatesOffload:
    """A learner rank's switch: its states in CPU memory while rollout workers sample on its GPU, on the GPU while it
    works.

    Args:
        enabled: off, :meth:`sleep` and :meth:`wake` do nothing (no colocation, or a CPU learner).
    """

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.parked: Offloaded | None = None
        self.engine = None
        self.extra: list[torch.nn.Module] = []
        self.offload_seconds = 0.0  # the last offload's and reload's wall times
        self.reload_seconds = 0.0

    @property
    def asleep(self) -> bool:
        """The states are in CPU memory."""
        return self.parked is not None

    def sleep(self, engine, extra: Sequence[torch.nn.Module | None] = ()) -> None:
        """Move ``engine``'s states (and the ``extra`` modules that are not None) to CPU memory, unless off or asleep
        already; the engine and modules are kept for :meth:`awake`."""
        if not self.enabled or self.asleep or engine is None:
            return
        self.engine, self.extra = engine, [m for m in extra if m is not None]
        self.parked = offload_states(engine, self.extra)
        self.offload_seconds = self.parked.seconds

    def wake(self) -> None:
        """Bring the states back to the device, unless awake."""
        if self.parked is None:
            return
        self.reload_seconds = reload_states(self.engine, self.parked)
        self.parked = None

    @contextmanager
    def awake(self) -> Iterator[None]:
        """The states on the device inside; back in CPU memory after if they were there before."""
        was = self.asleep
        self.wake()
        try:
            yield
        finally:
            if was:
                self.sleep(self.engine, self.extra)
