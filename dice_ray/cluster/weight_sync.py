"""Weight sync from the learner to the rollout workers: a bucketed broadcast or the object store.

After each learner step the new weights go to every rollout worker, one of two ways
(``cluster.weight_sync``):

* ``broadcast``: a ``torch.distributed`` process group over learner rank 0 (group rank 0) and the rollout
  workers (ranks 1..W), separate from the learner's DeepSpeed group. The parameters are laid out in
  buckets of at most ``cluster.weight_sync_bucket_mb`` MiB; each bucket is flattened into one byte buffer
  and broadcast from rank 0, and each worker copies its slices into its own parameters. NCCL when both
  sides have GPUs, gloo on CPU. The pattern of OpenRLHF's ``trainer/ray`` weight-sync workers, with
  whole buckets instead of one call a parameter.
* ``object_store``: rank 0 puts a CPU state dict in Ray's object store and every worker loads it.

``auto`` (the default) broadcasts over NCCL when the learner and the rollout workers each hold whole GPUs
of their own, and uses the object store otherwise (CPU runs, or GPUs shared by fractions: NCCL refuses two
ranks on one device).

A step whose learner changed no weight (every group dropped for want of an advantage, or the control arm of
``rl.update_policy=false``) sends nothing: :meth:`WeightSync.relabel` tells the workers to call the weights they
hold by the new version (a 1.4B-parameter policy's object-store push took 9-12 s on an H100 machine, for the same
weights).

A rollout worker that died and was restarted by Ray (issue 6) is re-synced with :meth:`WeightSync.resync`.
On the object store that is exact: the pushes keep the ObjectRefs of the last ``keep_versions`` versions
(``rl.max_staleness + 1``: every version a batch in flight can have been launched with), so the worker
gets the very weights its batch was launched with. A broadcast cannot resend an old version (the learner
holds only its current weights), and a new process cannot join a formed group: ``resync`` forms a new
group (:meth:`WeightSync.reset`) and re-broadcasts the last pushed version to every worker, so a
re-sampled shard may be fresher than the rest of its batch; its groups record the version that sampled
them and the staleness bound is still checked on them. A push also pings the workers first and forms a
new group when one of them came back empty (it died between steps). A worker dying *during* a broadcast
is not recovered: the collective fails or times out (``BroadcastSpec.timeout_s``) and the run stops.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass, replace

import ray
import torch

GROUP_PREFIX = "dice_ray_weight_sync"
ALIGN = 16
"""Byte alignment of every tensor's slice in a bucket (so a slice can be viewed as its dtype)."""
MAX_PUSH_ATTEMPTS = 3
"""Consecutive failed ``set_weights`` calls of one rollout worker before a push gives up."""


@dataclass(frozen=True)
class TensorSlot:
    """Where one named tensor lives in a bucket: bytes ``[offset, offset + nbytes)``."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class BroadcastSpec:
    """What a group member needs to join the weight-sync group and take part in one broadcast.

    Attributes:
        address, port: the ``TCPStore`` rendezvous, served by learner rank 0 (group rank 0).
        world_size: 1 + the number of rollout workers.
        backend: ``"nccl"`` or ``"gloo"``.
        buckets: the bucket plan (:func:`plan_buckets`), the same for every member.
        rank: this member's rank in the group (0: the sender).
        timeout_s: rendezvous and collective timeout (seconds).
        generation: bumped by :meth:`WeightSync.reset`; a member whose group is of another generation
            joins the new group (a restarted rollout worker cannot join an existing one).
    """

    address: str
    port: int
    world_size: int
    backend: str
    buckets: tuple[tuple[TensorSlot, ...], ...]
    rank: int = 0
    timeout_s: float = 600.0
    generation: int = 0


def named_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors a weight sync carries: parameters and persistent buffers, each storage once (tied
    weights once), in a fixed order. Under DeepSpeed ZeRO-3 a parameter's full shape is ``ds_shape``;
    gather it (``deepspeed.zero.GatheredParameters``) before reading its data."""
    out = dict(module.named_parameters())
    skip = {n for m_name, m in module.named_modules() for n in (
        f"{m_name}.{b}" if m_name else b for b in getattr(m, "_non_persistent_buffers_set", ()))}
    out.update((k, v) for k, v in module.named_buffers() if k not in skip)
    return out


def plan_buckets(tensors: dict[str, torch.Tensor], bucket_bytes: int) -> tuple[tuple[TensorSlot, ...], ...]:
    """Lay named tensors out in byte buckets of at most ``bucket_bytes`` (a larger tensor gets its own).

    Args:
        tensors: name -> tensor (its ``ds_shape`` is used where present, as under ZeRO-3).
        bucket_bytes: bucket capacity in bytes (> 0).

    Returns:
        buckets of :class:`TensorSlot`, in the order of ``tensors``; every slot starts on an ``ALIGN``
        boundary.

    Raises:
        ValueError: ``bucket_bytes`` is not positive.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    buckets: list[tuple[TensorSlot, ...]] = []
    cur: list[TensorSlot] = []
    used = 0
    for name, t in tensors.items():
        shape = tuple(getattr(t, "ds_shape", None) or t.shape)
        nbytes = int(torch.Size(shape).numel()) * t.element_size()
        start = -(-used // ALIGN) * ALIGN
        if cur and start + nbytes > bucket_bytes:
            buckets.append(tuple(cur))
            cur, start = [], 0
        cur.append(TensorSlot(name, str(t.dtype).removeprefix("torch."), shape, start, nbytes))
        used = start + nbytes
    if cur:
        buckets.append(tuple(cur))
    return tuple(buckets)


def bucket_size(bucket: tuple[TensorSlot, ...]) -> int:
    """Bytes of a bucket's flat buffer."""
    return bucket[-1].offset + bucket[-1].nbytes


class BroadcastGroup:
    """One member's end of the weight-sync process group (a ``torch.distributed`` group of its own, so
    learner rank 0 can belong to it and to DeepSpeed's default group at once).

    Args:
        spec: the group (its ``rank`` is this member's).
        device: this member's model device; buffers live there under NCCL, on the CPU under gloo.

    Raises:
        ValueError: an unknown backend, or NCCL without a CUDA device.
    """

    def __init__(self, spec: BroadcastSpec, device: torch.device):
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=spec.timeout_s)
        store = dist.TCPStore(spec.address, spec.port, spec.world_size, is_master=spec.rank == 0,
                              timeout=timeout, wait_for_workers=False)
        store = dist.PrefixStore(GROUP_PREFIX, store)
        if spec.backend == "gloo":
            self.pg = dist.ProcessGroupGloo(store, spec.rank, spec.world_size, timeout)
            device = torch.device("cpu")
        elif spec.backend == "nccl":
            if device.type != "cuda":
                raise ValueError(f"weight sync backend 'nccl' needs a CUDA device, this member has {device}")
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(device)
            self.pg = dist.ProcessGroupNCCL(store, spec.rank, spec.world_size)
        else:
            raise ValueError(f"weight sync backend must be 'nccl' or 'gloo', got {spec.backend!r}")
        self.spec, self.device = spec, device

    def _broadcast(self, buf: torch.Tensor) -> None:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        self.pg.broadcast([buf], opts).wait()

    def current(self, spec: BroadcastSpec) -> bool:
        """Whether this group is the one ``spec`` names (same generation)."""
        return self.spec.generation == spec.generation

    def send_bucket(self, bucket: tuple[TensorSlot, ...], tensors: dict[str, torch.Tensor]) -> None:
        """Rank 0: flatten one bucket's tensors into a byte buffer and broadcast it."""
        buf = torch.empty(bucket_size(bucket), dtype=torch.uint8, device=self.device)
        for s in bucket:
            src = tensors[s.name].detach().to(self.device).contiguous().view(-1).view(torch.uint8)
            buf[s.offset: s.offset + s.nbytes].copy_(src)
        self._broadcast(buf)

    def receive(self, module: torch.nn.Module) -> int:
        """Ranks >= 1: receive every bucket and copy it into ``module``'s tensors; returns bytes received.

        Raises:
            KeyError: the plan names a tensor ``module`` lacks (the two sides build different models).
        """
        own = named_weights(module)
        missing = [s.name for b in self.spec.buckets for s in b if s.name not in own]
        if missing:
            raise KeyError(f"weight sync: the learner sends {missing[:5]} which this model does not have")
        total = 0
        with torch.no_grad():
            for bucket in self.spec.buckets:
                buf = torch.empty(bucket_size(bucket), dtype=torch.uint8, device=self.device)
                self._broadcast(buf)
                for s in bucket:
                    src = buf[s.offset: s.offset + s.nbytes].view(getattr(torch, s.dtype)).view(s.shape)
                    own[s.name].copy_(src)
                total += buf.numel()
        return total


class WeightSync:
    """The driver's side of the weight sync: pushes the learner's weights to the rollout workers.

    Args:
        learner: the learner (a :class:`~dice_ray.cluster.learner.LearnerGroup`).
        workers: the rollout worker actor handles.
        mode: ``"broadcast"`` or ``"object_store"`` (resolve ``auto`` with :func:`resolve_mode`).
        backend: ``"nccl"`` or ``"gloo"`` (broadcast only).
        bucket_mb: bucket capacity in MiB (broadcast only).
        keep_versions: object store only: how many of the last pushed versions :meth:`resync` can resend
            (their state dicts stay in the object store; ``rl.max_staleness + 1`` covers every batch in flight).

    Raises:
        ValueError: an unknown mode, or ``keep_versions < 1``.
    """

    def __init__(self, learner, workers: list, mode: str, backend: str = "gloo", bucket_mb: float = 256.0,
                 keep_versions: int = 1):
        if mode not in ("broadcast", "object_store"):
            raise ValueError(f"weight sync mode must be 'broadcast' or 'object_store', got {mode!r}")
        if keep_versions < 1:
            raise ValueError(f"keep_versions={keep_versions}: must be >= 1")
        self.learner, self.workers, self.mode = learner, workers, mode
        self.backend, self.bucket_bytes = backend, int(bucket_mb * 2**20)
        self.spec: BroadcastSpec | None = None
        self._generation = 0
        self.keep_versions = keep_versions
        self.kept: dict[int, object] = {}  # version -> ObjectRef of its state dict (object store)
        self.version: int | None = None  # the last version pushed
        self._queued: list = []  # set_weights calls of pushes that did not wait (object store)

    def reset(self, workers: list | None = None) -> None:
        """Form a new broadcast group at the next push (after a rollout worker was replaced).

        Args:
            workers: the new rollout worker handles (None: keep the list).
        """
        if workers is not None:
            self.workers = workers
        self.spec = None
        self._generation += 1

    def push(self, version: int, wait: bool = True) -> dict:
        """Send the learner's current weights to every worker as ``version``; blocks until all hold it
        (unless ``wait=False``: see below).

        A worker found dead on the way (object store: its ``set_weights`` fails; broadcast: a worker answers
        its ping with no weights) is waited for (:func:`~dice_ray.cluster.rollout.wait_until_alive`) and
        given the weights again (broadcast: in a new group); ``restarts`` counts them.

        ``wait=False`` (object store only; the asynchronous pipeline): the ``set_weights`` calls are queued on
        the workers and not waited for, so a push does not wait for the rollouts launched ahead, which run
        first (a Ray actor runs one caller's calls in order); every ``generate`` launched after the push
        samples with ``version``. A call that fails (its worker died) is not retried here: the worker's
        next ``generate`` fails too and the pipeline recovers it (``StepPipeline``, :meth:`resync`).
        Failures seen since the last push are counted in ``restarts``.

        Returns:
            ``{"mode", "seconds", "bytes" (broadcast: bytes a worker received), "buckets", "restarts"}``.

        Raises:
            RuntimeError: a worker that failed ``MAX_PUSH_ATTEMPTS`` times in a row, or did not come back.
            ValueError: ``wait=False`` on a broadcast (a collective needs every worker at once).
        """
        from dice_ray.cluster.rollout import wait_until_alive

        if not wait and self.mode != "object_store":
            raise ValueError("weight sync: only an object-store push can be queued without waiting (wait=False)")
        t0 = time.perf_counter()
        self.version = version
        if self.mode == "object_store":
            weights = self.learner.weights_ref()
            self._keep(version, weights)
            restarts = self._settle_queued()
            if wait:
                restarts += self._send(range(len(self.workers)), weights, version)
            else:
                self._queued += [w.set_weights.remote(weights, version) for w in self.workers]
            return {"mode": self.mode, "seconds": time.perf_counter() - t0, "bytes": None, "buckets": None,
                    "restarts": restarts}
        restarts = 0
        if self.spec is not None:  # a worker restarted since the group formed cannot join it: form a new one
            restarts = sum(wait_until_alive(w) < 0 for w in self.workers)
            if restarts:
                self.reset()
        if self.spec is None:
            address, port = self.learner.rendezvous()
            buckets = self.learner.plan_buckets(self.bucket_bytes)
            self.spec = BroadcastSpec(address, port, 1 + len(self.workers), self.backend, buckets,
                                      generation=self._generation)
        specs = [replace(self.spec, rank=i + 1) for i in range(len(self.workers))]
        sent = self.learner.broadcast_weights(self.spec)
        got = [w.set_weights.remote(s, version) for w, s in zip(self.workers, specs)]
        ray.get(sent + got)
        return {"mode": self.mode, "seconds": time.perf_counter() - t0,
                "bytes": sum(bucket_size(b) for b in self.spec.buckets), "buckets": len(self.spec.buckets),
                "restarts": restarts}

    def relabel(self, version: int, wait: bool = True) -> dict:
        """The learner's weights did not change since the last push (a step without an update): every worker keeps
        what it holds and calls it ``version`` (:meth:`RolloutWorker.set_version`); nothing is read from the learner
        or sent. A worker that holds no weights (restarted since the last push) or died on the way gets them as in
        :meth:`push` (object store: the last pushed ref, kept as ``version`` too; broadcast: a new group and a full
        push). Before any push it is :meth:`push`. ``wait=False`` as in :meth:`push` (object store only): a worker
        found empty later fails its next ``generate`` and the pipeline re-syncs it with the kept ref.

        Returns:
            :meth:`push`'s report with ``"relabel": True`` and ``bytes`` 0 (``None`` when queued), ``restarts``
            counting the workers that needed the weights again.

        Raises:
            RuntimeError / ValueError: as :meth:`push`.
        """
        if self.version is None:
            return self.push(version, wait)
        if not wait and self.mode != "object_store":
            raise ValueError("weight sync: only an object-store push can be queued without waiting (wait=False)")
        t0 = time.perf_counter()
        last, self.version = self.version, version
        restarts = 0
        if self.mode == "object_store":
            self._keep(version, self.kept[last])
            restarts = self._settle_queued()
        refs = [w.set_version.remote(version) for w in self.workers]
        if not wait:
            self._queued += refs
            return {"mode": self.mode, "relabel": True, "seconds": time.perf_counter() - t0, "bytes": None,
                    "buckets": None, "restarts": restarts}
        empty = []
        for i, ref in enumerate(refs):
            try:
                held = ray.get(ref)
            except ray.exceptions.RayActorError:
                held = -1
            if held < 0:
                empty.append(i)
        if empty and self.mode == "object_store":
            self._send(empty, self.kept[version], version)
        elif empty:  # a restarted process cannot join the formed group: a new one, the weights to every worker
            self.reset()
            self.push(version)
        return {"mode": self.mode, "relabel": True, "seconds": time.perf_counter() - t0, "bytes": 0, "buckets": 0,
                "restarts": restarts + len(empty)}

    def _keep(self, version: int, weights) -> None:
        """Object store: keep ``weights`` (an ObjectRef) as ``version``, and only the last ``keep_versions``."""
        self.kept[version] = weights
        for v in sorted(self.kept)[:-self.keep_versions]:
            del self.kept[v]

    def resync(self, worker: int, version: int) -> int:
        """Give the restarted worker ``workers[worker]`` the weights of ``version`` (a batch's launch version).

        Object store: the kept ref of ``version`` is resent to that worker alone (exact); a version no longer
        kept (older than the last ``keep_versions`` pushes) gets the last pushed version instead. Broadcast:
        a new group and the last pushed version to every worker (see the module notes). Call it while the
        learner is idle between a push and its next step (its weights are the last pushed version's).

        Args:
            worker: index into ``workers``.
            version: the weights version wanted.

        Returns:
            the version the worker now holds (``version``, or the last pushed one as described).

        Raises:
            RuntimeError: nothing was pushed yet, or the worker keeps failing (see :meth:`push`).
        """
        if self.version is None:
            raise RuntimeError("weight sync: resync before any push")
        if self.mode == "object_store":
            held = version if version in self.kept else self.version
            self._send([worker], self.kept[held], held)
            return held
        self.reset()
        self.push(self.version)
        return self.version

    def _settle_queued(self) -> int:
        """Object store: forget the queued ``set_weights`` calls that finished; how many failed (their worker
        died: the pipeline re-syncs it when its next ``generate`` fails). Ones still queued are kept."""
        if not self._queued:
            return 0
        done, self._queued = ray.wait(self._queued, num_returns=len(self._queued), timeout=0)
        failed = 0
        for ref in done:
            try:
                ray.get(ref)
            except ray.exceptions.RayError:
                failed += 1
        return failed

    def _send(self, indices, weights, version: int) -> int:
        """Object store: ``set_weights`` on the workers ``indices``, each retried after a restart; restarts seen."""
        from dice_ray.cluster.rollout import wait_until_alive

        todo = {i: self.workers[i].set_weights.remote(weights, version) for i in indices}
        restarts, fails = 0, dict.fromkeys(todo, 0)
        while todo:
            i, ref = next(iter(todo.items()))
            try:
                ray.get(ref)
                del todo[i]
            except ray.exceptions.RayActorError as e:
                restarts, fails[i] = restarts + 1, fails[i] + 1
                if fails[i] >= MAX_PUSH_ATTEMPTS:
                    raise RuntimeError(f"weight sync: rollout worker {i} failed set_weights {fails[i]} times in a "
                                       f"row (version {version}): {e}") from e
                wait_until_alive(self.workers[i])
                todo[i] = self.workers[i].set_weights.remote(weights, version)
        return restarts


def resolve_mode(mode: str, learner_gpus: float, rollout_gpus: float, cluster_gpus: int) -> tuple[str, str]:
    """``cluster.weight_sync`` -> (mode, backend).

    ``auto``: NCCL broadcast when the cluster has GPUs and the learner and every rollout worker hold at
    least one whole GPU (separate pools), else the object store. ``broadcast``: NCCL under that same
    condition, else gloo (CPU tensors). ``object_store``: always the object store.

    Raises:
        ValueError: an unknown mode.
    """
    whole = bool(cluster_gpus) and learner_gpus >= 1 and rollout_gpus >= 1
    if mode == "auto":
        return ("broadcast", "nccl") if whole else ("object_store", "gloo")
    if mode == "broadcast":
        return "broadcast", "nccl" if whole else "gloo"
    if mode == "object_store":
        return "object_store", "gloo"
    raise ValueError(f"cluster.weight_sync must be 'auto', 'broadcast' or 'object_store', got {mode!r}")
