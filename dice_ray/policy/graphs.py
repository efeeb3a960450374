"""The sampler's cached denoising forward, recorded once as a CUDA graph and replayed at every step.

At the SDAR-1.7B shape a denoising forward (batch 64, 4-8 new tokens a row) is ~1,600 kernel launches
from Python: about 22 ms of host time for about 9 ms of GPU work on an H200 (``torch.profiler`` of
``sample_ids`` without graphs), so the GPU waits for the host. A CUDA graph (NVIDIA CUDA Graphs through
PyTorch's ``torch.cuda.CUDAGraph``) records those launches once and replays them with one call. Only the
model forward is recorded; the step around it (LM head, drawing, remasking, masks) stays eager. Measured
on an H200 (``benchmarks/rollout_throughput.py``, same run): 5,796 tokens/s with graphs against 2,122
without, recording included.

What makes the forward replayable is the preallocated :class:`~dice_ray.policy.model.KVCache`
(``capacity=C``): the new keys go to positions held in a device tensor (``cache.slots``) and attention
spans the whole buffer under a ``[q, C]`` mask, so no recorded kernel depends on the cache length. A
recording keeps its inputs (token ids, positions, mask, slots) and its output in fixed tensors; each call
copies the step's values in and replays. One recording a query shape: the block sampler has two (a block
alone, or the finished block committed with the next one), made when each is first needed in a
``sample_ids`` call (two warm-up forwards and the recorded one), since every call has a new cache. A batch of
groups whose prompts differ in length (:func:`~dice_ray.policy.sampler.sample_groups`) passes per-row positions
``[A, q]`` and masks ``[A, q, C]`` instead of ``[q]`` and ``[q, C]``: the same recording, its inputs one row each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dice_ray.policy.model import KVCache, forward_hidden

__all__ = ["CachedForward"]


@dataclass
class _Recording:
    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor
    pos: torch.Tensor
    mask: torch.Tensor
    slots: torch.Tensor
    out: torch.Tensor


class CachedForward:
    """:func:`~dice_ray.policy.model.forward_hidden` over a preallocated KV cache: eager, or recorded as CUDA
    graphs and replayed.

    Args:
        model: the policy's transformers model (eval mode, on its device).
        cache: a :class:`~dice_ray.policy.model.KVCache` with a capacity, filled by the prefill (and
            expanded to its rows). Its buffers must stay the same tensors while recordings live (a
            recording reads and writes those addresses).
        graphs: record and replay (CUDA only); False calls ``forward_hidden`` every time.

    Raises:
        ValueError: ``graphs`` for a model that is not on a CUDA device, or a cache without a capacity.
    """

    def __init__(self, model: torch.nn.Module, cache: KVCache, graphs: bool):
        device = next(model.parameters()).device
        if graphs and device.type != "cuda":
            raise ValueError(f"CUDA graphs need the model on a CUDA device, it is on {device}")
        if cache.capacity is None:
            raise ValueError("CachedForward needs a preallocated KVCache (capacity set)")
        self.model, self.cache, self.graphs, self.device = model, cache, graphs, device
        self._recordings: dict[tuple, _Recording] = {}

    @property
    def recordings(self) -> int:
        """Graphs recorded so far (one a query shape)."""
        return len(self._recordings)

    def __call__(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Hidden states of one cached forward; its ``q`` new keys go to ``cache.slots`` (:meth:`KVCache.next_slots`).

        Args:
            ids: LongTensor[A, q] token ids.
            pos: LongTensor[q] RoPE positions, or [A, q] (a batch of groups whose prompts differ in length: each
                row's own positions).
            mask: BoolTensor[q, C] (:meth:`KVCache.pad_mask`), or [A, q, C] (each row's keys: a left-padded
                prompt's padding hidden).

        Returns:
            FloatTensor[A, q, hidden_size] in the model dtype. With graphs it is the recording's output
            tensor, overwritten by the next call of the same shape: use it before then.
        """
        if not self.graphs:
            return forward_hidden(self.model, ids, pos, mask, self.cache)
        shape = (tuple(ids.shape), tuple(pos.shape), tuple(mask.shape))
        rec = self._recordings.get(shape)
        if rec is None:
            rec = self._recordings[shape] = self._record(ids, pos, mask)
        rec.ids.copy_(ids)
        rec.pos.copy_(pos)
        rec.mask.copy_(mask)
        rec.slots.copy_(self.cache.slots)
        rec.graph.replay()
        return rec.out

    def _record(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> _Recording:
        """Warm up on a side stream (lazy initialisations stay out of the graph), then record one forward.

        Both write this step's new keys at this step's slots, the same values the replay that follows writes."""
        ids, pos, mask, slots = ids.clone(), pos.clone(), mask.clone(), self.cache.slots.clone()
        step_slots, self.cache.slots = self.cache.slots, slots
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    forward_hidden(self.model, ids, pos, mask, self.cache)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = forward_hidden(self.model, ids, pos, mask, self.cache)
        finally:
            self.cache.slots = step_slots
        return _Recording(graph, ids, pos, mask, slots, out)
