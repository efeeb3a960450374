"""Plan before launch: where each role of a run lands and whether its memory fits the GPUs (``dice-ray train --dry-run``).

:func:`make_plan` places the roles the way the trainer asks Ray for them (:mod:`dice_ray.cluster.placement`:
``cluster.learner_ranks`` bundles of ``cluster.learner_gpus`` in one PACK placement group, placed first;
``cluster.num_rollout_workers`` x ``cluster.rollout_gpus`` and the verifiers x ``cluster.verifier_gpus``, packed onto as
few nodes as hold them, or with ``cluster.placement=spread`` dealt over the nodes, the node holding the fewest of the
role first; with no GPU in the cluster every role runs on CPU), fills fractional requests first-fit onto GPUs, and adds
up on each GPU the per-GPU estimates of :mod:`dice_ray.cluster.memory_estimate` of the actors it holds. A plan does not
fit when a GPU's sum exceeds its memory, or when the cluster, given by size, has too few GPUs for the requests.

With ``cluster.colocate_rollout`` rollout worker i shares learner rank ``i mod learner_ranks``'s GPU (inside its
bundle: no GPU of its own), and the GPU holds one phase at a time. Assumed, as the learner and the rollout workers
do it (:mod:`dice_ray.cluster.offload`): while the workers sample, the learner's weights, gradients, optimizer states
and KL reference are in CPU memory and only its runtime (CUDA context, DeepSpeed's buckets) stays; while the learner
steps, each worker keeps its weights and runtime, its KV cache and working set handed back. Such a GPU's sum is
the larger of the two phases, ``max(learner + workers' weights and runtime, workers + learner's runtime)`` (the
shared-GPU lines show both); the offloaded states count in the learner's CPU memory.

The capacity (:func:`resolve_capacity`) comes from, in order: ``--cluster-gpus`` / ``--gpus-per-node`` /
``--gpu-memory-gib``; the Ray cluster at ``--address`` / ``cluster.address`` / ``RAY_ADDRESS`` (its alive nodes'
GPUs from ``ray.nodes()``; a GPU's memory from this machine's GPUs when it has some, else from the nodes'
``accelerator_type`` by :data:`GPU_MEMORY_GIB`); this machine's GPUs (NVML, which makes no CUDA context);
else it is unknown and the plan is printed unchecked. A running cluster that has fewer GPUs than the plan asks
only warns: an autoscaler may still add nodes (each role waits for its placement group up to
``cluster.placement_timeout_s``).

Which GPU of a node Ray gives a fraction may differ from the one shown; the estimates are in
:mod:`dice_ray.cluster.memory_estimate`.
"""

from __future__ import annotations

import io
import shutil
import os
from dataclasses import dataclass, field

from dice_ray.cluster.memory_estimate import (
    GIB,
    Estimate,
    ModelShape,
    chunk_rows,
    groups_per_micro_batch,
    learner_estimate,
    model_shape,
    param_count,
    prompt_tokens,
    rollout_estimate,
    verifier_estimate,
)
from dice_ray.config import DiceConfig

FITS, NO_FIT = 0, 2
TIGHT = 0.9
"""A GPU filled above this share of its memory fits, but the plan calls it tight."""
GPU_MEMORY_GIB = {"H100": 79.6, "H200": 140.4, "B200": 179.1, "H20": 95.6, "L40S": 45.0, "L4": 22.5, "A10G": 22.5,
                  "T4": 15.0}
"""Memory (GiB, as NVML reports it) of a GPU by Ray's ``accelerator_type``; A100 and V100 come in two sizes and are
left out (pass ``--gpu-memory-gib``). H100 is the 80 GB card (an H100 NVL has 94 GB: pass its size)."""


class PlanDoesNotFit(ValueError):
    """The plan cannot fit the cluster; the message names the role(s), the estimate and the capacity."""


@dataclass
class Capacity:
    """The GPUs a plan is checked against.

    Attributes:
        nodes: GPUs of each node (``[]``: a cluster without GPUs); None: unknown.
        gpu_bytes: memory of one GPU (the smallest, if they differ); None: unknown.
        source: where these came from, for the plan's header.
        live: read from a running cluster (a GPU shortfall warns instead of refusing: an autoscaler may add nodes).
    """

    nodes: list[int] | None
    gpu_bytes: int | None
    source: str
    live: bool = False

    @property
    def gpus(self) -> int | None:
        return None if self.nodes is None else sum(self.nodes)


@dataclass
class Gpu:
    node: int
    index: int
    free: float = 1.0
    tenants: list[tuple[str, int, float]] = field(default_factory=list)  # (role, actor, share of the GPU)
    extra: bool = False  # beyond the cluster's GPUs (a running cluster that may still grow)

    @property
    def name(self) -> str:
        return f"n{self.node}:{self.index}" + ("+" if self.extra else "")


@dataclass
class Role:
    """One role: ``actors`` actors of ``gpus`` GPUs each (0: CPU), each using ``estimate`` on its GPU."""

    name: str
    label: str
    actors: int
    gpus: float
    estimate: Estimate
    placed: list[Gpu | None] = field(default_factory=list)
    colocated: bool = False  # rollout workers inside the learner's bundles (cluster.colocate_rollout)

    @property
    def per_gpu(self) -> int:
        return self.estimate.total


@dataclass
class Plan:
    cfg: DiceConfig
    capacity: Capacity
    shape: ModelShape
    prompt: int
    roles: list[Role]
    gpus: list[Gpu]
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool | None:
        """False: refused; None: nothing to check against (capacity unknown); True: fits."""
        if self.problems:
            return False
        if self.gpu_roles() and self.capacity.gpu_bytes is None:
            return None
        return True

    def gpu_roles(self) -> list[Role]:
        return [r for r in self.roles if r.gpus > 0]

    def role(self, name: str) -> Role:
        return next(r for r in self.roles if r.name == name)

    def _bytes(self, gpu: Gpu) -> dict[str, int]:
        """Bytes each role's estimates put on ``gpu`` (an actor of several GPUs counts on its first)."""
        out: dict[str, int] = {}
        for name, actor, _ in gpu.tenants:
            role = self.role(name)
            if role.placed[actor] is gpu:
                out[name] = out.get(name, 0) + role.per_gpu
        return out

    def phases(self, gpu: Gpu) -> tuple[int, int] | None:
        """(learning, sampling) bytes of a GPU the learner shares with colocated rollout workers (the module
        docstring's assumption); None on any other GPU."""
        by = self._bytes(gpu)
        rollout = self.role("rollout")
        if not (rollout.colocated and "learner" in by and "rollout" in by):
            return None
        others = sum(b for name, b in by.items() if name not in ("learner", "rollout"))
        c_r, c_l = rollout.estimate.components, self.role("learner").estimate.components
        workers = by["rollout"] // rollout.per_gpu if rollout.per_gpu else 0
        resident = workers * (c_r.get("weights", 0) + c_r.get("runtime", 0))
        return others + by["learner"] + resident, others + by["rollout"] + c_l.get("runtime", 0)

    def used(self, gpu: Gpu) -> int:
        """Bytes the estimates put on ``gpu`` at its peak: the sum of its actors', or on a GPU shared by colocation
        the larger of its two phases (:meth:`phases`)."""
        both = self.phases(gpu)
        return max(both) if both is not None else sum(self._bytes(gpu).values())


# ---- capacity -----------------------------------------------------------------------------------------------


def _visible(count: int) -> list[int]:
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is None:
        return list(range(count))
    out = []
    for part in env.split(","):
        part = part.strip()
        if part.isdigit() and int(part) < count:
            out.append(int(part))
        elif part and not part.lstrip("-").isdigit():  # a UUID / MIG id: count it, read its memory as the first's
            out.append(0)
    return out


def local_gpus() -> tuple[int, int | None, str] | None:
    """(count, memory of the smallest in bytes, name) of this machine's visible NVIDIA GPUs through NVML (no CUDA
    context is made); None when NVML or a GPU is missing."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no driver, no library: no local GPU
        return None
    try:
        ids = _visible(pynvml.nvmlDeviceGetCount())
        if not ids:
            return None
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in ids]
        mem = min(int(pynvml.nvmlDeviceGetMemoryInfo(h).total) for h in handles)
        name = pynvml.nvmlDeviceGetName(handles[0])
        return len(ids), mem, name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # noqa: BLE001
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


def capacity_from_nodes(nodes: list[dict], gpu_memory_gib: float | None = None) -> Capacity:
    """A running cluster's capacity from ``ray.nodes()`` (alive nodes' ``GPU`` and ``accelerator_type:*``)."""
    alive = [n for n in nodes if n.get("Alive", n.get("alive", True))]
    per_node, types = [], set()
    for n in alive:
        res = n.get("Resources") or n.get("resources") or {}
        g = int(res.get("GPU", 0))
        if g:
            per_node.append(g)
            types |= {k.split(":", 1)[1] for k in res if k.startswith("accelerator_type:")}
    desc = f"{len(per_node)} GPU node(s): {'+'.join(map(str, per_node)) or 'no GPU'}" + (
        f", {'/'.join(sorted(types))}" if types else "")
    mem, why = None, ""
    if gpu_memory_gib:
        mem, why = int(gpu_memory_gib * GIB), f"--gpu-memory-gib {gpu_memory_gib:g}"
    elif per_node:
        here = local_gpus()
        known = [GPU_MEMORY_GIB[t] for t in types if t in GPU_MEMORY_GIB]
        if known and len(known) == len(types):
            mem, why = int(min(known) * GIB), f"{'/'.join(sorted(types))} memory"
        elif here and (not types or any(t.replace("-", " ").lower() in here[2].lower() for t in types)):
            mem, why = here[1], f"this machine's {here[2]}"
    return Capacity(per_node, mem, f"Ray cluster: {desc}" + (f"; {mem / GIB:.1f} GiB a GPU ({why})" if mem else
                                                              "; GPU memory unknown (pass --gpu-memory-gib)"), live=True)


def resolve_capacity(cfg: DiceConfig, cluster_gpus: int | None = None, gpus_per_node: int | None = None,
                     gpu_memory_gib: float | None = None, address: str | None = None) -> Capacity:
    """The capacity to check a plan against (see the module docstring). Connects to a cluster only to read its
    resources (no actor), and disconnects again unless this process was connected before.

    Raises:
        ConnectionError: nothing answers at the address (:class:`~dice_ray.cluster.auth.ClusterUnreachable`), or
            the head refused (token authentication).
    """
    given_mem = int(gpu_memory_gib * GIB) if gpu_memory_gib else None
    if cluster_gpus is not None:
        per = gpus_per_node or cluster_gpus or 1
        nodes = [per] * (cluster_gpus // per) + ([cluster_gpus % per] if cluster_gpus % per else [])
        here = local_gpus()
        mem = given_mem or (here[1] if here else None)
        what = (f"--gpu-memory-gib {gpu_memory_gib:g}" if given_mem else f"this machine's {here[2]}" if here
                else "unknown: pass --gpu-memory-gib")
        return Capacity(nodes, mem, f"given: {cluster_gpus} GPU(s) on {len(nodes)} node(s) of "
                        f"{'+'.join(map(str, nodes)) or 0}; {mem / GIB if mem else 0:.1f} GiB a GPU ({what})"
                        if mem else f"given: {cluster_gpus} GPU(s) on {len(nodes)} node(s); GPU memory {what}")
    address = address or cfg.cluster.address or os.environ.get("RAY_ADDRESS")
    import sys

    ray = sys.modules.get("ray")
    if address or (ray is not None and ray.is_initialized()):
        import ray

        from dice_ray.cluster.auth import connect
        from dice_ray.cluster.scheduler import NAMESPACE

        was = ray.is_initialized()
        if not was:
            connect(address, attempt_timeout_s=5.0, namespace=NAMESPACE, log_to_driver=False, logging_level="ERROR")
        try:
            cap = capacity_from_nodes(ray.nodes(), gpu_memory_gib)
        finally:
            if not was:
                ray.shutdown()
        cap.source = f"{cap.source} (at {address or 'the connected cluster'})"
        return cap
    here = local_gpus()
    if here:
        mem = given_mem or here[1]
        return Capacity([here[0]], mem, f"this machine: {here[0]} x {here[2]}, {mem / GIB:.1f} GiB a GPU "
                        "(a new local Ray cluster gets these)")
    if given_mem is None:  # what `dice-ray train` does here: a local cluster without GPUs, every role on CPU
        return Capacity([], None, "this machine, no GPU: every role runs on CPU here (for a cluster's plan pass "
                        "--cluster-gpus N [--gpus-per-node N] --gpu-memory-gib GIB, or --address)")
    return Capacity(None, given_mem, "no --cluster-gpus, no cluster address, no GPU on this machine")


# ---- placement ----------------------------------------------------------------------------------------------


def _take(gpus: list[Gpu], need: float, prefer_node: int | None = None,
          load: dict[int, int] | None = None) -> list[Gpu] | None:
    """GPUs for one request of ``need`` GPUs (fractions share one GPU, whole numbers take free GPUs of one node):
    ``prefer_node`` first, or with ``load`` (actors of the role a node holds: spread) the least loaded node first."""
    nodes = sorted({g.node for g in gpus}, key=lambda n: ((load or {}).get(n, 0), n) if load is not None
                   else (n != prefer_node, n))
    for n in nodes:
        on = [g for g in gpus if g.node == n]
        if need < 1:
            fit = next((g for g in on if g.free >= need - 1e-9), None)
            if fit is not None:
                return [fit]
        else:
            free = [g for g in on if g.free >= 1 - 1e-9]
            if len(free) >= round(need):
                return free[: round(need)]
    return None


def place(roles: list[Role], capacity: Capacity, spread: bool = False) -> tuple[list[Gpu], int]:
    """Place every GPU actor of ``roles`` (sets ``Role.placed``); returns the GPUs and how many actors found no room.

    The learner's ranks first (one PACK placement group: as few nodes as possible), then colocated rollout workers
    on their ranks' GPUs (inside the ranks' bundles: nothing more taken), then whole-GPU actors, then fractional
    ones from the largest share down, each first-fit; with ``spread`` the rollout workers and verifiers try the node
    holding the fewest of their role first. A running cluster (``capacity.live``) or an unknown one grows by nodes
    like its largest (8 GPUs when unknown) instead of leaving actors out."""
    per = list(capacity.nodes or [])
    gpus = [Gpu(n, i) for n, k in enumerate(per) for i in range(k)]
    grow = capacity.live or capacity.nodes is None
    width = max(per, default=8) or 8
    short = 0
    requests = [(r, a) for r in roles if r.gpus > 0 for a in range(r.actors)]
    order = sorted(requests, key=lambda ra: (ra[0].name != "learner", not ra[0].colocated, ra[0].gpus < 1, -ra[0].gpus))
    learner_node = None
    load: dict[str, dict[int, int]] = {}
    for role, actor in order:
        if role.colocated:  # in rank (actor mod ranks)'s bundle, on its GPU
            rank = next(r for r in roles if r.name == "learner").placed
            g = rank[actor % len(rank)] if rank else None
            role.placed.append(g)
            if g is None:
                short += 1
            else:
                g.tenants.append((role.name, actor, min(role.gpus, 1.0)))
            continue
        spreading = spread and role.name != "learner"
        while True:
            got = _take(gpus, role.gpus, learner_node if role.name == "learner" else None,
                        load.setdefault(role.name, {}) if spreading else None)
            if got is not None or not grow:
                break
            base = max((g.node for g in gpus), default=-1) + 1
            gpus += [Gpu(base, i, extra=capacity.nodes is not None) for i in range(max(width, round(role.gpus)))]
        if got is None:
            short += 1
            role.placed.append(None)
            continue
        if role.name == "learner":
            learner_node = got[0].node
        counts = load.setdefault(role.name, {})
        counts[got[0].node] = counts.get(got[0].node, 0) + 1
        for g in got:
            share = min(role.gpus, 1.0)
            g.free -= share
            g.tenants.append((role.name, actor, share))
        role.placed.append(got[0])
    return gpus, short


# ---- the plan -----------------------------------------------------------------------------------------------


def _broadcast(cfg: DiceConfig, learner_gpus: float, rollout_gpus: float, has_gpus: bool) -> bool:
    """Whether weights go by the bucketed broadcast (:func:`dice_ray.cluster.weight_sync.resolve_mode`'s rule)."""
    whole = has_gpus and learner_gpus >= 1 and rollout_gpus >= 1
    return cfg.cluster.weight_sync != "object_store" and whole


def make_plan(cfg: DiceConfig, capacity: Capacity, prompt: int | None = None, with_deepspeed: bool = True) -> Plan:
    """The placement and per-GPU memory of ``cfg``'s roles on ``capacity``, with what does not fit (``problems``);
    ``with_deepspeed``: add DeepSpeed's own estimate of the learner's model states to its notes."""
    shape = model_shape(cfg.model)
    p = prompt_tokens(cfg, shape, prompt)
    c = cfg.cluster
    has = capacity.gpus is None or capacity.gpus > 0  # unknown: plan the GPUs as configured
    gl, gr = (c.learner_gpus, c.rollout_gpus) if has else (0.0, 0.0)
    gv = c.verifier_gpus if has and cfg.verify.mode != "compile_only" else 0.0
    n_ver = c.num_verifiers or (capacity.gpus if capacity.gpus else 2 if capacity.gpus == 0 else 1)
    bcast = _broadcast(cfg, gl, gr, has)
    colocated = c.colocate_rollout and gl > 0 and gr > 0
    roles = [
        Role("learner", f"learner ({c.learner_ranks} rank{'' if c.learner_ranks == 1 else 's'}, ZeRO-{c.zero_stage})",
             c.learner_ranks, gl, Estimate()),
        Role("rollout", "rollout worker" + (" (colocated)" if colocated else ""), c.num_rollout_workers, gr,
             rollout_estimate(cfg, shape, p, on_gpu=gr > 0, broadcast=bcast), colocated=colocated),
        Role("verifier", "verifier" + (" (compile-only)" if not gv else ""), n_ver, gv,
             verifier_estimate(cfg, capacity.gpu_bytes) if gv else Estimate(notes=["compile-only: CPU"])),
    ]
    if c.num_verifiers is None and capacity.gpus is None:
        roles[2].estimate.notes.append("cluster.num_verifiers unset: one a GPU of the cluster (1 shown)")
    gpus, short = place(roles, capacity, spread=c.placement == "spread")
    lrn = roles[0]
    nodes_used = {g.node for g in lrn.placed if g is not None}
    per_node = max((sum(1 for g in lrn.placed if g is not None and g.node == n) for n in nodes_used), default=1)
    lrn.estimate = learner_estimate(cfg, shape, p, per_node, max(1, len(nodes_used)), on_gpu=gl > 0, broadcast=bcast,
                                    with_deepspeed=with_deepspeed)
    if colocated:
        _colocation_notes(lrn, roles[1])
    plan = Plan(cfg, capacity, shape, p, roles, gpus)
    _check(plan, short)
    return plan


def _colocation_notes(learner: Role, rollout: Role) -> None:
    """Colocation's notes, and the learner's offloaded states counted in its CPU memory (``Estimate.host``)."""
    c = learner.estimate.components
    moved = sum(c.get(k, 0) for k in ("weights", "gradients", "optimizer"))
    learner.estimate.host += moved
    learner.estimate.notes.append(
        f"cluster.colocate_rollout: {_g(moved)} GiB (weights, gradients, optimizer states) go to CPU memory while the "
        f"rollout workers sample on its GPUs; its runtime ({_g(c.get('runtime', 0))} GiB) stays")
    r = rollout.estimate.components
    rollout.estimate.notes.append(
        "colocated on the learner's GPUs: while the learner steps each worker keeps its weights and runtime "
        f"({_g(r.get('weights', 0) + r.get('runtime', 0))} GiB), its KV cache and working set handed back")


def _g(b: int | None) -> str:
    return "?" if b is None else f"{b / GIB:.1f}"


def _hint(plan: Plan, role: Role, room: int) -> str:
    """What would make ``role`` fit in ``room`` bytes (its GPU's memory less the other actors' there)."""
    cfg, c = plan.cfg, plan.cfg.cluster
    if role.name == "learner":
        fixed = role.estimate.components.get("activations", 0) + role.estimate.components.get("runtime", 0)
        ref = plan.shape.params * plan.shape.dtype_bytes if cfg.rl.beta > 0 else 0
        k = groups_per_micro_batch(cfg, plan.prompt)
        hints = []
        if k > 1:
            hints.append(f"its activations ({_g(fixed)} GiB) are those of {k} groups a micro-batch "
                         f"(cluster.micro_batch_tokens={c.micro_batch_tokens} counts a group as G x (prompt + response) "
                         "tokens; the learner scores each in several passes): lower cluster.micro_batch_tokens (0: one "
                         "group a micro-batch), set cluster.gradient_checkpointing=true, or score fewer rows a backward "
                         "(cluster.learner_rows_per_chunk)")
        if fixed + ref >= room:
            if k == 1:
                rows = chunk_rows(cfg)
                held = (f"a whole group, {cfg.rl.num_generations} samples" if rows == cfg.rl.num_generations
                        else f"a row chunk of {rows} of a group's {cfg.rl.num_generations} samples")
                fix = ("lower cluster.learner_rows_per_chunk (rows of a group a backward; 1 the least), "
                       "sampling.max_new_tokens or rl.num_generations" if rows > 1
                       else "lower sampling.max_new_tokens")
                hints.append(f"its activations and runtime alone ({_g(fixed)} GiB: the learner holds the autograd graph "
                             f"of {held} x sampling.max_new_tokens={cfg.sampling.max_new_tokens}, and ZeRO does not "
                             f"split it) leave no room: {fix}"
                             + (f"; rl.beta=0 drops the KL reference ({_g(ref)} GiB a rank)" if ref else ""))
        else:
            for ranks in range(1, 65):
                trial = None
                for stage in sorted({c.zero_stage, 3}):
                    t = cfg.model_copy(update={"cluster": c.model_copy(update={"learner_ranks": ranks, "zero_stage": stage})})
                    est = learner_estimate(t, plan.shape, plan.prompt, min(ranks, 8), max(1, -(-ranks // 8)), on_gpu=True,
                                           with_deepspeed=False)
                    if est.total <= room:
                        trial = (stage, est)
                        break
                if trial:
                    hints.append(f"cluster.learner_ranks={ranks} cluster.zero_stage={trial[0]} would fit "
                                 f"({_g(trial[1].total)} GiB a rank, {ranks} GPU(s) for the learner): ZeRO-3 divides "
                                 "weights, gradients and optimizer states over the ranks")
                    break
        return "; or ".join(hints) or "lower rl.num_generations or sampling.max_new_tokens"
    if role.name == "rollout":
        return ("lower rl.num_generations or sampling.max_new_tokens (the KV cache of a group), or give each rollout "
                "worker a GPU of its own (cluster.rollout_gpus=1)")
    return "lower verify.gpu_memory_fraction (a share of the whole GPU, whatever cluster.verifier_gpus is)"


def _check(plan: Plan, short: int) -> None:
    cap = plan.capacity
    asked = sum(r.actors * r.gpus for r in plan.gpu_roles() if not r.colocated)
    if short:
        each = ", ".join(f"{r.name} {r.actors} x {r.gpus:g}" + (" (in the learner's)" if r.colocated else "")
                         for r in plan.gpu_roles())
        plan.problems.append(f"the roles ask {asked:g} GPU(s) ({each}) "
                             f"and {short} actor(s) find no room on the cluster's {cap.gpus} GPU(s)"
                             f" ({'+'.join(map(str, cap.nodes or []))} a node)")
    if cap.live and any(g.extra for g in plan.gpus):
        plan.warnings.append(f"the cluster has {cap.gpus} GPU(s) now and the roles ask {asked:g}: the actors wait for "
                             "more nodes (an autoscaler), each role's placement group for "
                             f"cluster.placement_timeout_s={plan.cfg.cluster.placement_timeout_s:g} s at most")
    if cap.gpu_bytes is None:
        return
    for g in plan.gpus:
        used = plan.used(g)
        if used <= cap.gpu_bytes:
            continue
        parts = []
        for name, actor, _ in g.tenants:
            role = next(r for r in plan.roles if r.name == name)
            if role.placed[actor] is g:
                parts.append((role, role.per_gpu))
        names = sorted({r.label for r, _ in parts})
        detail = " + ".join(f"{r.name} {_g(b)}" for r, b in parts)
        role = max(parts, key=lambda rb: rb[1])[0]
        others = used - role.per_gpu
        comp = ", ".join(f"{k} {_g(v)}" for k, v in role.estimate.components.items() if v)
        both = plan.phases(g)
        if both is not None:
            detail = f"learning {_g(both[0])} GiB, sampling {_g(both[1])} GiB, one phase at a time (colocated)"
            what = f"GPU {g.name} holds {', '.join(names)}: {detail}"
        else:
            what = (f"{role.label} needs {_g(role.per_gpu)} GiB a GPU ({comp})" if len(parts) == 1 else
                    f"GPU {g.name} holds {', '.join(names)}: {detail} = {_g(used)} GiB")
        line = f"{what}; a GPU holds {_g(cap.gpu_bytes)} GiB: {_hint(plan, role, cap.gpu_bytes - others)}"
        if line not in plan.problems:
            plan.problems.append(line)


def _ranges(idx: list[int]) -> str:
    idx, out, i = sorted(set(idx)), [], 0
    while i < len(idx):
        j = i
        while j + 1 < len(idx) and idx[j + 1] == idx[j] + 1:
            j += 1
        out.append(str(idx[i]) if i == j else f"{idx[i]}-{idx[j]}")
        i = j + 1
    return ",".join(out)


def _where(role: Role) -> str:
    if role.gpus <= 0:
        return "CPU"
    by: dict[str, list[int]] = {}
    for g in role.placed:
        if g is None:
            by.setdefault("no room", [])
        else:
            by.setdefault(f"n{g.node}{'+' if g.extra else ''}", []).append(g.index)
    return " ".join(k if not v else f"{k}:{_ranges(v)}" for k, v in by.items()) + (" (learner's)" if role.colocated else "")


def render(plan: Plan) -> str:
    """The plan as text: the capacity, a table (role, actors x GPUs, where, GiB a GPU by component, the GPU's
    memory, verdict), the GPUs several actors share, each role's notes, warnings and the verdict."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    cap, shape = plan.capacity, plan.shape
    buf = io.StringIO()
    con = Console(file=buf, width=max(shutil.get_terminal_size((132, 24)).columns, 132), highlight=False,
                  color_system=None)
    con.print(f"plan: {shape.family} policy, {param_count(shape.params)} parameters ({shape.dtype_bytes * 8}-bit), "
              f"{plan.cfg.rl.prompts_per_step} prompts x {plan.cfg.rl.num_generations} samples a step, prompt "
              f"{plan.prompt} + {plan.cfg.sampling.max_new_tokens} new tokens"
              + (f", the learner scores {chunk_rows(plan.cfg)} of a group's samples a backward "
                 f"(cluster.learner_rows_per_chunk)" if chunk_rows(plan.cfg) < plan.cfg.rl.num_generations else ""),
              markup=False)
    con.print(f"capacity: {cap.source}", markup=False)
    c = plan.cfg.cluster
    colocated = plan.role("rollout").colocated
    con.print(f"placement: the learner's ranks one PACK group; rollout workers "
              + ("in the learner's bundles (cluster.colocate_rollout: its states in CPU memory while they sample)"
                 if colocated else f"and verifiers {c.placement} (cluster.placement)"), markup=False)
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True,
              title=f"GiB a GPU (a GPU has {_g(cap.gpu_bytes)} GiB)" if cap.gpu_bytes else "GiB a GPU", title_justify="left")
    for col in ("role", "actors x GPU", "where", "weights", "grads", "optim", "act", "KV", "other", "total", "verdict"):
        if col in ("role", "actors x GPU", "where", "verdict"):  # words, unwrapped
            t.add_column(col, no_wrap=True, min_width=6)
        else:  # figures are never cut: each column as wide as its header and its widest figure
            t.add_column(col, justify="right", no_wrap=True, min_width=max(len(col), 5))
    for r in plan.roles:
        c = r.estimate.components
        other = c.get("runtime", 0) + c.get("verifier", 0) + c.get("working", 0)
        shared = [g for g in r.placed if g is not None and len(g.tenants) > 1]
        on_gpu = r.gpus > 0
        if not on_gpu:
            verdict = "CPU, not checked"
        elif any(g is None for g in r.placed):
            verdict = "NO ROOM"
        elif cap.gpu_bytes is None:
            verdict = "capacity unknown"
        else:
            worst = max(plan.used(g) for g in r.placed if g is not None)
            verdict = ("DOES NOT FIT" if worst > cap.gpu_bytes else "tight" if worst > TIGHT * cap.gpu_bytes
                       else "fits") + (" (shared GPU)" if shared else "")
        total = r.per_gpu if (r.name != "verifier" or "verifier" in c or not on_gpu) else None
        t.add_row(r.label, f"{r.actors} x {r.gpus:g}" if on_gpu else f"{r.actors} x CPU", _where(r),
                  *(_g(c.get(k, 0)) for k in ("weights", "gradients", "optimizer", "activations", "kv_cache")),
                  _g(other) if (other or r.name != "verifier" or "verifier" in c) else "?", _g(total), verdict)
    con.print(t)
    shared = [g for g in plan.gpus if len(g.tenants) > 1]
    if shared:
        con.print("GPUs shared by several actors:")
        for g in shared:
            parts = " + ".join(f"{n} {s:g} ({_g(plan.role(n).per_gpu)})" for n, _, s in g.tenants)
            both = plan.phases(g)
            total = (f"learning {_g(both[0])}, sampling {_g(both[1])} (colocated: one phase at a time), peak "
                     if both is not None else "")
            con.print(f"  {g.name}: {parts} = {total}{_g(plan.used(g))} of {_g(cap.gpu_bytes)} GiB", markup=False)
    for r in plan.roles:
        for note in r.estimate.notes:
            con.print(f"  {r.name}: {note}", markup=False)
        if r.estimate.host:
            con.print(f"  {r.name}: {_g(r.estimate.host)} GiB of CPU memory a rank (offloaded states)", markup=False)
    for w in plan.warnings:
        con.print(f"warning: {w}", markup=False)
    if plan.fits is False:
        con.print(f"verdict: does not fit ({len(plan.problems)} problem(s)): " + "; ".join(plan.problems), markup=False)
    elif plan.fits is None and cap.nodes is not None:
        con.print(f"verdict: the {cap.gpus} GPU(s) hold the roles; GPU memory unknown, not checked: pass "
                  "--gpu-memory-gib GIB", markup=False)
    elif plan.fits is None:
        con.print("verdict: capacity unknown, nothing checked: pass --cluster-gpus N [--gpus-per-node N] "
                  "--gpu-memory-gib GIB, or --address of a running cluster", markup=False)
    elif not plan.gpu_roles():
        con.print("verdict: fits (every role on CPU)", markup=False)
    else:
        peak = max((plan.used(g) for g in plan.gpus), default=0)
        used = sum(1 for g in plan.gpus if g.tenants)
        of = f"{used} of {cap.gpus} GPU(s) used" if cap.gpus is not None else f"{used} GPU(s) used (count not checked)"
        con.print(f"verdict: fits: {of}, the fullest holds {_g(peak)} of {_g(cap.gpu_bytes)} GiB", markup=False)
    return buf.getvalue()


def check(cfg: DiceConfig, *, dry_run: bool, cluster_gpus: int | None = None, gpus_per_node: int | None = None,
          gpu_memory_gib: float | None = None, prompt: int | None = None, address: str | None = None,
          out=print) -> Plan:
    """Plan ``cfg`` against the resolved capacity and print it (``dry_run``: the whole plan; otherwise one line, or
    the whole plan when it does not fit).

    Raises:
        PlanDoesNotFit: it does not fit (the message names the role(s), the estimate and the capacity).
        ValueError: a bad size (the message names the flag); ConnectionError: the cluster at the address.
    """
    for flag, value, low in (("--cluster-gpus", cluster_gpus, 0), ("--gpus-per-node", gpus_per_node, 1),
                             ("--prompt-tokens", prompt, 1)):
        if value is not None and value < low:
            raise ValueError(f"{flag} must be >= {low}, got {value}")
    if gpu_memory_gib is not None and not gpu_memory_gib > 0:
        raise ValueError(f"--gpu-memory-gib must be > 0, got {gpu_memory_gib:g}")
    if gpus_per_node is not None and cluster_gpus is None:
        raise ValueError("--gpus-per-node needs --cluster-gpus (the cluster's size)")
    cap = resolve_capacity(cfg, cluster_gpus, gpus_per_node, gpu_memory_gib, address)
    plan = make_plan(cfg, cap, prompt, with_deepspeed=dry_run)
    if dry_run or plan.fits is False:
        out(render(plan).rstrip("\n"))
    elif plan.fits and not plan.gpu_roles():
        out(f"plan: fits (every role on CPU; {cap.source})")
    elif plan.fits:
        peak = max(plan.gpus, key=plan.used, default=None)
        out(f"plan: fits ({cap.source}; the fullest GPU holds {_g(plan.used(peak) if peak else 0)} of "
            f"{_g(cap.gpu_bytes)} GiB; dice-ray train --dry-run shows the plan)")
    else:
        out(f"plan: not checked, capacity unknown ({cap.source})")
    if plan.fits is False:
        raise PlanDoesNotFit("the plan does not fit: " + "; ".join(plan.problems))
    return plan
