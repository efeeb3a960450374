"""What the sandboxed worker does with one candidate: load, reference check, correctness, timing.

Runs inside :mod:`dice_ray.verify.worker` (never in the verifier's own process).  Stages follow
KernelBench's ``eval.py`` (seeded ``Model`` and ``ModelNew`` from ``get_init_inputs()``, several
input trials, allclose) and ``timing.py`` (CUDA events, L2 flush, warm-up), as small typed steps,
with the run-time anti-cheat rules added:

* every candidate call (correctness, warm-up, timed) must launch >= 1 kernel of the candidate
  (``dice_ray.launch.launch_count`` plus, for the load_inline format, the launch counters compiled
  into its extensions, :func:`dice_ray.verify.inline.launch_count`): ``no-kernel-launch``;
* a :class:`~torch.utils._python_dispatch.TorchDispatchMode` sees every aten op of the candidate's
  forward in the correctness trials (and the compile-only dry run); ops outside
  :data:`ALLOWED_ATEN_OPS` (allocation, views, fills, copies) are ``forward-torch-op``;
* inputs are cloned separately for candidate and reference and compared with a pristine copy
  after the candidate ran: ``input-mutation``;
* outputs must be plain ``torch.Tensor`` objects: ``output-type``;
* in each trial the reference runs first and its outputs stay alive while the candidate runs; before
  the candidate the caching allocator's free blocks are filled with 0xFF bytes (NaN in every float
  type), so a candidate that returns ``torch.empty`` memory, or leaves elements unwritten, reads NaN;
* trials: ``correctness_trials`` seeds, then the inputs at another scale (``scaled_trial``), then a
  size constant of ``get_inputs`` doubled (:func:`shape_constant`): hard-coded shapes fail;
* the kernel ablation (dice-ray's own rule ``kernel-not-used``): before the second trial's call the
  candidate runs once on that trial's inputs with every launch of its kernels counted but not run
  (:func:`dice_ray.launch.kernels_suppressed`, :func:`dice_ray.verify.inline.kernels_suppressed`);
  outputs that still match the reference were computed by its allowed copy/fill ops or on the host, not
  its kernels (a transpose as ``x.t().contiguous()``, a loss summed from ``tolist()``, next to a kernel
  that does nothing); the values forward reads onto the host in that call, except its inputs', are the
  previous trial's (:mod:`dice_ray.verify.host_reads`);
* fp32 outputs are compared with a float64 run of the reference: ``precision-downgrade`` (from the
  second job of a reference on, a bound from its facts, :mod:`dice_ray.verify.reference_facts`,
  clears an honest output without the float64 run);
* timing (:mod:`dice_ray.verify.timing`): windows of ``k..2k-1`` calls (sizes secret) long enough
  that host jitter does not matter, fresh inputs every call, the timed calls' outputs compared with
  the reference's (caching, batch-and-skip, deferring work and behaving differently once timed give
  ``incorrect``; compared after the timing stage, in the shared ``check`` stage, by
  :class:`TimedOutputChecks`), and speedups above ``audit_speedup`` re-timed by the host clock:
  ``timing-audit``.

Failures are typed (:class:`JobResult`), not recognised by matching exception text, except the
CUDA-error probe that decides whether the worker must be replaced (``fatal``).
"""

from __future__ import annotations

import builtins
import copy
import dis
import functools
import gc
import linecache
import os
import random
import re
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch

from dice_ray import launch
from dice_ray.tasks.task import shape_constant
from dice_ray.verify import gpu_spin, inline, mismatch_kernel, reference_facts, timing
from dice_ray.verify.correctness import (Comparison, compare_outputs, count_mismatches_batch, fill_could_match,
                                         flatten_outputs)
from dice_ray.verify.host_reads import HostReadLog, HostReadReplay, TextHookedMode, host_read_kind
from dice_ray.verify.meta_device import MetaStandsForDevice, cuda_unavailable
from dice_ray.verify.reference_facts import ReferenceFacts
from dice_ray.verify.rules import check_cuda_source, import_allowed

__all__ = ["ALLOWED_ATEN_OPS", "Harness", "JobResult", "OpRecorder", "RuleBroken", "warm_imports"]

# Bound at import, before any candidate runs (patching these later cannot fool the harness).
_synchronize = torch.cuda.synchronize
_equal = torch.equal
_perf = time.perf_counter
_fast_launches = launch.launch_count
_inline_launches = inline.launch_count
_suppress_fast = launch.kernels_suppressed
_suppress_inline = inline.kernels_suppressed


def _launch_count() -> int:
    """Launches of the candidate's own kernels so far: load_cuda kernels (fast format) plus the
    host launch counters of its load_inline extensions (:func:`dice_ray.verify.inline.launch_count`;
    no CUDA call, so it may be read inside a timed window)."""
    return _fast_launches() + _inline_launches()


#: aten ops a candidate's forward may run outside its kernels (allocation, views, fills, copies).
ALLOWED_ATEN_OPS: frozenset[str] = frozenset(
    {
        "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "new_zeros", "new_ones", "new_full",
        "zeros", "zeros_like", "ones", "ones_like", "full", "full_like", "zero_", "fill_", "copy_", "clone",
        "view", "_unsafe_view", "_reshape_alias", "reshape", "as_strided", "t", "transpose", "permute", "expand",
        "unsqueeze", "squeeze", "select", "slice", "narrow", "split", "split_with_sizes", "chunk", "unbind",
        "detach", "alias", "lift_fresh", "_local_scalar_dense", "sym_size", "sym_stride", "sym_numel",
        "sym_storage_offset", "is_contiguous", "unflatten", "flatten", "contiguous", "resolve_conj", "resolve_neg",
    }
)
_STAGE_BUDGET_FRACTION = 0.3  # timing of one side may use this share of run_timeout_s
_CHECK_ALL_BYTES = 64 * 2**20  # outputs up to this size: _CHECKED_CALLS and window ends checked; larger: output_checks
_CHECKED_CALLS = 64  # timed calls (besides each window's last) whose outputs are checked, drawn in secret
_WINDOW_OUTPUT_BYTES = 2**30  # a timed window's outputs (alive until checked) stay under this
_KEPT_OUTPUT_BYTES = 512 * 2**20  # checked timed outputs kept for the shared check stage; beyond, compared at once
_SELF_TEST_REFERENCE = """
import torch
import torch.nn as nn
class Model(nn.Module):
    def forward(self, x):
        return torch.relu(x)
def get_inputs():
    return [torch.randn(4096)]
def get_init_inputs():
    return []
"""
_SELF_TEST_CANDIDATE = '''
import torch
import torch.nn as nn
from dice_ray.launch import load_cuda
kernels = load_cuda(r"""
extern "C" __global__ void relu_kernel(const float* x, float* y, long n) {
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] > 0.f ? x[i] : 0.f;
}
""")
class ModelNew(nn.Module):
    def forward(self, x):
        y = torch.empty_like(x)
        kernels.relu_kernel((x.numel() + 255) // 256, 256, (x, y, x.numel()))
        return y
'''


class RuleBroken(Exception):
    """A run-time anti-cheat rule broken by the candidate (``rule`` is an id of ``rules.RULES``)."""

    def __init__(self, rule: str, message: str):
        super().__init__(f"[{rule}] {message}")
        self.rule = rule
        self.message = message

    def __reduce__(self):  # pickles with its own arguments
        return type(self), (self.rule, self.message)


class ReferenceError_(Exception):
    """The task's reference failed (verdict ``invalid_input``; ``rule`` names how)."""

    def __init__(self, rule: str, message: str):
        super().__init__(f"[{rule}] {message}")
        self.rule = rule
        self.message = message

    def __reduce__(self):  # pickles with its own arguments
        return type(self), (self.rule, self.message)


@dataclass
class JobResult:
    """The worker's answer for one job (sent as JSON; the parent builds the Verdict from it)."""

    verdict: str
    compiled: bool = False
    correct: bool | None = None
    speedup: float | None = None
    reason: str = ""
    rule: str | None = None
    ref_ms: float | None = None
    candidate_ms: float | None = None
    ref_spread: float | None = None
    candidate_spread: float | None = None
    compiled_ref_ms: float | None = None
    speedup_compiled: float | None = None
    # host seconds of a stage's parts, named ``stage.part``: the timing stage's (Harness._measure), or, when a
    # forward raised, ``run.until_raise`` (its call to the error: ~150 ms for an illegal address on an H200,
    # the GPU-wide fault) and ``run.after_raise`` (the error to this result)
    parts_s: dict[str, float] | None = None
    fatal: bool = False  # the worker must be replaced (sticky CUDA error)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _upload(name: str, args: tuple, kwargs: dict[str, Any]) -> bool:
    """Whether an aten call copies host values to the device (``_to_copy`` of a CPU tensor to a device:
    ``torch.tensor(sizes, device=...)``, in Python or host C++), as an allocation and a ``copy_`` may."""
    target = kwargs.get("device")
    return (name == "_to_copy" and bool(args) and isinstance(args[0], torch.Tensor) and args[0].device.type == "cpu"
            and target is not None and torch.device(target).type not in ("cpu", "meta"))


class OpRecorder(TextHookedMode):
    """Records the aten ops run under it that are not in :data:`ALLOWED_ATEN_OPS` nor a host read nor an upload
    (``forbidden``; :func:`~dice_ray.verify.host_reads.host_read_kind`: a one-element ``.cpu()`` is a read,
    ``torch.tensor(values, device=...)`` an upload), the values
    the code read onto the host (``host_reads``: a :class:`~dice_ray.verify.host_reads.HostReadLog`'s ``reads``,
    tensor texts among them), for the kernel ablation's replay; and the ops that allocated pinned host memory
    (``pinned``: rule ``host-memory``, which a kernel given its address writes)."""

    def __init__(self) -> None:
        super().__init__()
        self.forbidden: list[str] = []
        self.pinned: list[str] = []
        self._log = HostReadLog()
        self.host_reads = self._log.reads
        self._on_text = self._log.record_text

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        name = func.overloadpacket.__name__
        kwargs = kwargs or {}
        if (name not in ALLOWED_ATEN_OPS and name not in self.forbidden and host_read_kind(name, args, kwargs) is None
                and not _upload(name, args, kwargs)):
            self.forbidden.append(name)  # a host read (one element's .cpu()) is replayed, not refused
        if kwargs.get("pin_memory") and name not in self.pinned:
            self.pinned.append(name)
        out = func(*args, **kwargs)
        self._log.note(name, args, out, kwargs)
        return out


def _error_text(exc: BaseException, limit: int = 1500) -> str:
    """``Type: message`` plus the innermost candidate/reference frames, at most ``limit`` characters."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename in ("<candidate>", "<reference>")]
    where = "".join(f"  {f.filename} line {f.lineno}: {(f.line or '').strip()}\n" for f in frames[-3:])
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, launch.CompileError):
        text = str(exc)
    text = f"{text}\n{where}" if where else text
    return text if len(text) <= limit else text[: limit - 20] + "\n...[truncated]"


def _in_candidate_lines(exc: launch.CompileError, candidate_src: str) -> launch.CompileError:
    """``exc`` with each ``candidate.cu(N)`` of its log followed by `` [candidate line M]``, the line of the
    candidate's file, when its CUDA source is found there verbatim (a raw string literal; one with escapes is
    not, and ``exc`` is returned as it is).  NVRTC counts lines within the CUDA string."""
    at = candidate_src.find(exc.source) if exc.source else -1
    if at < 0:
        return exc
    first = candidate_src.count("\n", 0, at)  # the file line of the source's line 1, less one
    log = re.sub(r"candidate\.cu\((\d+)\)", lambda m: f"{m.group(0)} [candidate line {first + int(m.group(1))}]",
                 exc.log)
    out = launch.CompileError(log, exc.arch, exc.source)
    out.__traceback__ = exc.__traceback__  # its frames name the load_cuda call
    return out


#: words of an error on meta tensors that may come from meta itself (no data, no CUDA, a tensor the code made on
#: another device), not from the code; matched case-insensitively, and a doubt counts for the reference
_META_ARTEFACTS = ("meta", "data pointer", "storage", "cuda", "notimplementederror", "not allocated", "device", "nvidia")


def _meta_inconclusive(exc: BaseException) -> bool:
    """Whether ``exc``, raised by code run on meta tensors on a machine without a GPU, may be meta's
    doing (an op without a meta kernel, a data access, a ``.cuda()`` call) rather than the code's."""
    text = exc.message if isinstance(exc, ReferenceError_) else f"{type(exc).__name__}: {exc}"
    return isinstance(exc, NotImplementedError) or any(w in text.lower() for w in _META_ARTEFACTS)


_IMPORT_NAME = dis.opmap["IMPORT_NAME"]


def _guarded_import(name, globals=None, locals=None, fromlist=(), level=0):  # noqa: A002, ANN001
    """The candidate's ``__import__``: its own ``import`` statements must be on the allow-list.

    C code (torch's dispatcher, ...) also imports through the current frame's builtins; those
    calls are recognised by the frame's current instruction not being IMPORT_NAME and pass.
    """
    frame = sys._getframe(1)
    own = frame.f_code.co_filename == "<candidate>" and frame.f_code.co_code[frame.f_lasti] == _IMPORT_NAME
    names = tuple(fromlist or ())
    if own and (level or not import_allowed(name, names if name == "dice_ray.launch" else ())):
        what = f"from {name} import {', '.join(names)}" if names else f"import {name}"
        raise RuleBroken("forbidden-import", f"{what} at run time")
    return builtins.__import__(name, globals, locals, fromlist, level)


_REMOVED_BUILTINS = ("open", "eval", "exec", "compile", "getattr", "setattr", "delattr", "globals", "locals", "vars",
                     "breakpoint", "input", "help", "memoryview", "exit", "quit")


def _candidate_builtins(guarded: bool) -> dict[str, Any]:
    b = dict(vars(builtins))
    if guarded:
        for n in _REMOVED_BUILTINS:
            b.pop(n, None)
        b["__import__"] = _guarded_import
    return b


@functools.lru_cache(maxsize=64)
def _compile(src: str, filename: str) -> Any:
    """``compile(src, filename, "exec")``, cached: a task's reference is compiled once, not once a
    candidate (0.3 ms a compile, under the GPU gate).  A code object is immutable; each exec of it
    still makes a fresh namespace.

    Raises:
        SyntaxError, ValueError: as ``compile`` (not cached).
    """
    return compile(src, filename, "exec")


def exec_source(src: str, filename: str, guarded: bool) -> dict[str, Any]:
    """Execute a module's source in a fresh namespace (candidate: restricted builtins when ``guarded``).

    Raises:
        whatever the module raises (SyntaxError, CompileError, RuleBroken, ...).
    """
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    code = _compile(src, filename)
    ns: dict[str, Any] = {"__name__": f"dice_ray_{filename.strip('<>')}", "__builtins__": _candidate_builtins(guarded)}
    exec(code, ns)  # noqa: S102 - the sandboxed worker exists to do this
    return ns


def _check_cuda_source(source: Any) -> None:
    """load_cuda's hook: the CUDA-side rules on the final source string, however it was built."""
    if isinstance(source, str):
        for v in check_cuda_source(source):
            raise RuleBroken(v.rule, f"load_cuda source: {v.message}")


#: torch's scaled-dot-product-attention backends (``torch.backends.cuda.<k>_sdp_enabled``), restored after each job
_SDP_BACKENDS = ("flash", "mem_efficient", "math", "cudnn")


def _seed(seed: int) -> None:
    """``torch.manual_seed(seed)`` for the generators a worker uses (CPU and CUDA), without seeding
    the uninitialised XPU/MTIA back-ends: torch queues those as lazy calls that format a stack trace,
    0.5 ms each, paid once per timed call's inputs."""
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(seed)


def _clone(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.clone()
    return copy.deepcopy(x)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if _equal(a, b):
            return True
        if a.is_floating_point():
            return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())
        return False
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001
        return True


#: outputs of at most this many bytes are kept for the kernel ablation's echo check (Harness._ablate)
_ECHO_BYTES = 16 * 2**20


def _small_copy(out: Any) -> Any:
    """A clone of a forward's outputs when their tensors hold at most :data:`_ECHO_BYTES` in all, else None."""
    leaves = flatten_outputs(out)
    size = sum(o.numel() * o.element_size() for o in leaves if isinstance(o, torch.Tensor))
    return [_clone(o) for o in leaves] if size <= _ECHO_BYTES else None


def _same_outputs(out: Any, kept: list[Any]) -> bool:
    """Whether a forward's outputs are element for element ``kept`` (:func:`_small_copy`; NaN equals NaN)."""
    leaves = flatten_outputs(out)
    return len(leaves) == len(kept) and all(
        isinstance(a, torch.Tensor) == isinstance(b, torch.Tensor) and _same(a, b) for a, b in zip(leaves, kept))


def _check_output_types(out: Any) -> None:
    for i, o in enumerate(flatten_outputs(out)):
        if isinstance(o, torch.Tensor) and type(o) not in (torch.Tensor, torch.nn.Parameter):
            raise RuleBroken("output-type", f"output {i} is a {type(o).__module__}.{type(o).__name__}, not a torch.Tensor")


def warm_imports() -> None:
    """Import on the CPU what a first job would import lazily: entering a ``TorchDispatchMode``
    (:class:`OpRecorder`) pulls in ``torch._dynamo``, sympy and ~800 more modules (1-5 s).  The fork
    server calls this, so workers forked from it start with them loaded.  Touches no GPU."""
    with OpRecorder(), torch.no_grad():
        (torch.ones(4) + 1).sum()


class Harness:
    """Runs jobs in the worker.

    Args:
        mode: ``"gpu"`` or ``"compile_only"``.
        device: CUDA ordinal (gpu mode).
        settings: the worker's settings (VerifyConfig fields as a dict).
    """

    def __init__(self, mode: str, device: int | None, settings: dict[str, Any]):
        self.mode = mode
        self.device = device
        self.settings = settings
        self.flush: torch.Tensor | None = None
        self.jobs = 0
        self.input_seed = int(settings["seed"])  # a job's own: job["input_seed"] (Verifier.input_seed)
        if mode == "gpu":
            assert device is not None
            self.dev = torch.device("cuda", device)
            l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 * 2**20) or 64 * 2**20
            self.flush = torch.empty(int(2 * l2) // 4, dtype=torch.int32, device=self.dev)
            mismatch_kernel.warm(device)  # the output checks' kernels, in the worker's set-up, not a job
            gpu_spin.for_device(device)  # the timed windows' spin, likewise
        else:
            self.dev = torch.device("cpu")
        self._torch_state = self._save_torch_state()
        if settings.get("static_rules", True):
            launch.configure(source_check=_check_cuda_source)

    def self_test(self, stage: Callable[..., Any] = lambda *_a, **_k: None, timing: bool = True) -> str:
        """Verify a built-in relu candidate once (warms every path); returns its verdict and reason.
        ``stage`` is the job's stage callback (the worker's start takes the GPU gate through it);
        ``timing=False`` stops after the correctness trial (no exclusive stage)."""
        saved = dict(self.settings)
        self.settings.update(timing_trials=3, warmup=1, correctness_trials=1, self_test_timing=timing)
        try:
            r = self.run({"candidate_src": _SELF_TEST_CANDIDATE, "reference_src": _SELF_TEST_REFERENCE,
                          "kernel_refs": {"kernels": ["relu_kernel"]}}, stage)
        finally:
            self.settings.clear()
            self.settings.update(saved)
            self.jobs = 0
        return f"{r.verdict}: {r.reason[:300]}"

    # -- global torch state --------------------------------------------------------------------
    @staticmethod
    def _save_torch_state() -> dict[str, Any]:
        return {
            "dtype": torch.get_default_dtype(),
            "matmul_precision": torch.get_float32_matmul_precision(),
            "tf32": torch.backends.cuda.matmul.allow_tf32,
            "cudnn_tf32": torch.backends.cudnn.allow_tf32,
            "cudnn_bench": torch.backends.cudnn.benchmark,
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            "grad": torch.is_grad_enabled(),
            # what a load_inline candidate's C++ can flip (at::globalContext()) to slow the reference down
            "cudnn": torch.backends.cudnn.enabled,
            "cudnn_deterministic": torch.backends.cudnn.deterministic,
            "fp16_reduction": torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
            "bf16_reduction": torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
            "sdp": {k: getattr(torch.backends.cuda, f"{k}_sdp_enabled")() for k in _SDP_BACKENDS},
        }

    def _restore_torch_state(self) -> None:
        s = self._torch_state
        torch.set_default_dtype(s["dtype"])
        torch.set_float32_matmul_precision(s["matmul_precision"])
        torch.backends.cuda.matmul.allow_tf32 = s["tf32"]
        torch.backends.cudnn.allow_tf32 = s["cudnn_tf32"]
        torch.backends.cudnn.benchmark = s["cudnn_bench"]
        torch.use_deterministic_algorithms(s["deterministic"])
        torch.set_grad_enabled(s["grad"])
        torch.backends.cudnn.enabled = s["cudnn"]
        torch.backends.cudnn.deterministic = s["cudnn_deterministic"]
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = s["fp16_reduction"]
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = s["bf16_reduction"]
        for k, on in s["sdp"].items():
            getattr(torch.backends.cuda, f"enable_{k}_sdp")(on)

    # -- helpers -------------------------------------------------------------------------------
    def cuda_healthy(self) -> bool:
        """False when the CUDA context holds a sticky error (the worker must be replaced)."""
        if self.mode != "gpu":
            return True
        try:
            from cuda.bindings import driver

            (err,) = driver.cuCtxSynchronize()  # an error code, not torch's exception (tens of ms to build after a fault)
            if err != driver.CUresult.CUDA_SUCCESS:
                return False
            t = torch.ones(1, device=self.dev)
            return float((t + 1).item()) == 2.0
        except Exception:  # noqa: BLE001
            return False

    def _poison_free_memory(self) -> None:
        """Fill the caching allocator's free blocks with 0xFF bytes (NaN for every float type)."""
        from cuda.bindings import driver

        stream = driver.CUstream(torch.cuda.current_stream(self.device).cuda_stream)
        for seg in torch.cuda.memory_snapshot():
            if seg.get("device", self.device) != self.device:
                continue
            addr = seg["address"]
            for blk in seg["blocks"]:
                a = blk.get("address", addr)
                if blk["state"] == "inactive" and blk["size"] >= 4:
                    driver.cuMemsetD32Async(driver.CUdeviceptr(a), 0xFFFFFFFF, blk["size"] // 4, stream)
                addr = a + blk["size"]

    def _inputs(self, ns: dict[str, Any], seed: int, device: torch.device) -> list[Any]:
        _seed(seed)
        try:
            with device:
                raw = ns["get_inputs"]()
            raw = list(raw) if isinstance(raw, (list, tuple)) else [raw]
            return [x.to(device) if isinstance(x, torch.Tensor) else x for x in raw]
        except (Exception, SystemExit) as e:  # noqa: BLE001 - sys.exit() in a reference is its failure
            raise ReferenceError_("reference-inputs", f"get_inputs() failed: {_error_text(e)}") from None

    def _call_candidate(self, model: Any, args: list[Any], record: bool) -> Any:
        before = _launch_count()
        rec = OpRecorder() if record else None
        with torch.no_grad():
            if rec is not None:
                with rec:
                    out = model(*args)
                self._host_reads = rec.host_reads  # for the kernel ablation's replay (_ablate)
                self._read_outputs = _small_copy(out) if rec.host_reads else None  # its echo (_ablate)
            else:
                out = model(*args)
        if _launch_count() == before:
            raise RuleBroken("no-kernel-launch", "a call of ModelNew.forward launched no kernel of the candidate")
        if rec is not None and rec.pinned:
            raise RuleBroken("host-memory", f"forward allocated pinned host memory ({', '.join(rec.pinned)} with "
                             "pin_memory=True): a kernel given its address writes host memory")
        if rec is not None and rec.forbidden:
            raise RuleBroken("forward-torch-op", f"forward ran torch ops outside its kernels: {rec.forbidden}")
        _check_output_types(out)
        return out

    def _tolerances(self) -> dict[str, float]:
        """The comparison's tolerances from the job's settings: ``rtol``, ``atol``, ``half_rtol``, ``half_atol``."""
        return {k: self.settings[k] for k in ("rtol", "atol", "half_rtol", "half_atol")}

    def _compare(self, out: Any, ref: Any) -> Any:
        """:func:`compare_outputs` (its reason on failure), counted first by the fused kernels."""
        tol = self._tolerances()
        counts = count_mismatches_batch([(out, ref)], **tol)
        if not isinstance(counts, tuple) and int(counts[0]) == 0:
            return Comparison(True, "")
        return compare_outputs(out, ref, **tol)

    # -- the job ------------------------------------------------------------------------------
    def run(self, job: dict[str, Any], stage: Callable[..., Any]) -> JobResult:
        """Verify one candidate; ``stage(name, **extra)`` is called at each stage boundary ("load",
        "reference", "run", "timing", "check") so the parent can take the GPU gate and apply that
        stage's time limit.  The reference facts (:mod:`~dice_ray.verify.reference_facts`) travel
        through it: ``stage("reference")`` may return ``{"reference_facts": {...}}`` (the parent's go:
        known facts, then the reference runs once), and a job that measured them passes them on as
        ``stage("run", reference_facts={...})``, before its candidate's model is built.  Never raises
        for a bad candidate or reference."""
        result = JobResult("crash")
        self._error_at: float | None = None  # when the candidate's forward raised (_trial)
        self._host_reads: list[tuple] = []  # the last recorded call's host reads (OpRecorder), replayed by _ablate
        self._read_outputs: Any = None  # that call's outputs when it read the host and they are small (_ablate)
        try:
            result = self._run(job, stage)
        except RuleBroken as e:
            result = JobResult("cheat", compiled=True, reason=e.message, rule=e.rule)
        except ReferenceError_ as e:
            result = JobResult("invalid_input", compiled=True, reason=e.message, rule=e.rule)
        except (Exception, SystemExit) as e:  # noqa: BLE001 - sys.exit() in a candidate is its crash, not the worker's
            result = JobResult("crash", compiled=True, reason=_error_text(e))
        finally:
            t_cleanup = _perf()
            launch.configure(dry_run=False)
            try:
                self._restore_torch_state()
            except Exception:  # noqa: BLE001
                result.fatal = True
        if not self.cuda_healthy():
            result.fatal = True
            if result.verdict == "ok":
                result = JobResult("crash", compiled=True, reason="CUDA context broken after the run", fatal=True)
            else:
                result.reason = f"{result.reason}\n(sticky CUDA error: worker replaced)".strip()
        self.jobs += 1
        if self._error_at is not None and result.parts_s is not None:
            result.parts_s["run.after_raise"] = round(_perf() - self._error_at, 5)
        if result.fatal:
            return result  # the worker exits: nothing to collect
        gc.collect(1 if self.jobs % 50 else 2)  # a full collection costs ~0.15 s with torch loaded
        if self.mode == "gpu":
            try:
                torch.cuda.empty_cache()
            except Exception:  # noqa: BLE001
                result.fatal = True
        result.parts_s = {**(result.parts_s or {}), "cleanup": round(_perf() - t_cleanup, 5)}
        return result

    def _run(self, job: dict[str, Any], stage: Callable[..., Any]) -> JobResult:
        # the inputs' seeds: the Verifier's secret (a candidate that knew them could compute its answers ahead)
        self.input_seed = int(job.get("input_seed", self.settings["seed"]))
        if job.get("reference_only"):
            return self._reference_only(job, stage)
        s = self.settings
        guarded = bool(s.get("static_rules", True))
        # 1. load: execute the candidate module (this is where NVRTC compiles)
        stage("load")
        try:
            if job.get("inline"):  # the load_inline format: prebuilt extensions (dice_ray.verify.inline)
                cand = inline.exec_inline(job["candidate_src"], job["inline"], guarded)
            else:
                inline.reset()  # an earlier candidate's extensions no longer count as launches
                cand = exec_source(job["candidate_src"], "<candidate>", guarded)
        except RuleBroken as e:
            return JobResult("cheat", reason=e.message, rule=e.rule)
        except launch.CompileError as e:
            return JobResult("compile_error", reason=_error_text(_in_candidate_lines(e, job["candidate_src"]), 6000))
        except SyntaxError as e:
            return JobResult("compile_error", reason=f"Python syntax error: {e}")
        except (Exception, SystemExit) as e:  # noqa: BLE001 - sys.exit() at import: the candidate's crash
            return JobResult("crash", reason=f"executing the candidate module raised {_error_text(e)}")
        if not isinstance(cand.get("ModelNew"), type):
            return JobResult("compile_error", compiled=True, reason="the candidate defines no class ModelNew",
                             rule="no-modelnew")
        refs = {k: set(v) for k, v in job.get("kernel_refs", {}).items()}
        bad = self._unknown_kernels(refs, cand, None)
        if bad:
            return JobResult("compile_error", compiled=True, reason=bad, rule="unknown-kernel")

        # 2. reference: module, init inputs; the torch flags and the GPU as the job found them (the candidate
        # module ran at load: a flag it set or a kernel it left running would change what the reference computes)
        go = stage("reference")
        ref, init_inputs = self._load_reference(job["reference_src"])
        if self.mode == "compile_only":
            on_meta = self._reference_on_meta(ref, init_inputs)  # in the reference stage: its hang is its own
            stage("run")
            return self._compile_only(cand, init_inputs, refs, on_meta)
        facts = go.get("reference_facts") if isinstance(go, dict) else None
        return self._gpu(cand, ref, init_inputs, refs, stage, job["reference_src"],
                         None if facts is None else ReferenceFacts.from_dict(facts))

    def _load_reference(self, reference_src: str) -> tuple[dict[str, Any], list[Any]]:
        """The reference module's namespace and its ``get_init_inputs()``, with the torch flags restored and
        the GPU synchronized first.

        Raises:
            ReferenceError_: ``reference-exec``.
        """
        self._restore_torch_state()
        if self.mode == "gpu":
            _synchronize(self.device)
        try:
            ref = exec_source(reference_src, "<reference>", guarded=False)
            _seed(self.settings["seed"])
            return ref, list(ref["get_init_inputs"]())
        except (Exception, SystemExit) as e:  # noqa: BLE001 - sys.exit() in a reference is its failure
            raise ReferenceError_("reference-exec", f"reference module or get_init_inputs() failed: {_error_text(e)}")

    def _reference_on_trial0(self, ref: dict[str, Any], init_inputs: list[Any],
                             facts: ReferenceFacts | None) -> tuple[Any, list[Any], bool, Any, ReferenceFacts]:
        """``Model(*init_inputs)`` on the GPU (seeded, eval mode), trial 0's inputs (seed ``seed + 1``) and the
        reference checked on them (:meth:`_check_reference`): ``(model, inputs0, mutates, expected0, facts)``.
        One place for a candidate's job and a reference-only job, so both measure the same facts.

        Raises:
            ReferenceError_: ``reference-build``, ``reference-inputs`` or one of :meth:`_check_reference`'s.
        """
        _seed(self.settings["seed"])
        try:
            with self.dev:
                ref_model = ref["Model"](*init_inputs).to(self.dev).eval()
        except Exception as e:  # noqa: BLE001
            raise ReferenceError_("reference-build", f"Model(*get_init_inputs()) failed: {_error_text(e)}") from None
        inputs0 = self._inputs(ref, self.input_seed + 1, self.dev)
        return (ref_model, inputs0, *self._check_reference(ref_model, inputs0, facts))

    def _reference_only(self, job: dict[str, Any], stage: Callable[..., Any]) -> JobResult:
        """A job without a candidate (``reference_only``, :meth:`Verifier.prepare
        <dice_ray.verify.verifier.Verifier.prepare>`): measure the reference's facts on trial 0's inputs, as a
        candidate's first job would, and pass them on with the ``run`` stage's announcement.  Verdict ``ok``
        (nothing was judged; ``reason`` says whether they were measured or already known), or
        ``invalid_input`` naming the reference's broken rule (``reference-*``).  GPU mode only."""
        go = stage("reference")
        if isinstance(go, dict) and go.get("reference_facts"):
            return JobResult("ok", reason="reference facts already known")
        ref, init_inputs = self._load_reference(job["reference_src"])
        *_, facts = self._reference_on_trial0(ref, init_inputs, None)
        stage("run", reference_facts=facts.to_dict())
        return JobResult("ok", reason="reference facts measured")

    @staticmethod
    def _unknown_kernels(refs: dict[str, set[str]], ns: dict[str, Any], model: Any) -> str:
        problems = []
        for holder, names in refs.items():
            if holder.startswith("self."):
                if model is None:
                    continue
                mod = getattr(model, holder[5:], None)
            else:
                mod = ns.get(holder)
            if not isinstance(mod, launch.KernelModule):
                problems.append(f"{holder} is not a load_cuda module")
                continue
            missing = sorted(n for n in names if not mod.has_kernel(n) and n not in dir(mod))
            if missing:
                problems.append(f"{holder}.{', '.join(missing)}: no such kernel; compiled kernels: {mod.kernel_names}")
        return "; ".join(problems)

    # -- compile-only ---------------------------------------------------------------------------
    def _reference_on_meta(self, ref: dict, init_inputs: list) -> tuple[list[Any] | None, Any, str]:
        """Compile-only's reference check, run in the ``reference`` stage before the candidate's model is
        built (so a reference that hangs or whose ``get_init_inputs()`` does not fit its ``Model`` is the
        reference's fault, not the candidate's): ``Model(*init_inputs)``, ``get_inputs()`` and ``forward``
        on meta tensors.  An error that may come from meta itself (:func:`_meta_inconclusive`: no data, no
        CUDA) skips what needs it.

        Returns:
            ``(inputs, expected, note)``: trial 0's inputs on meta (None when ``get_inputs()`` does not
            run on meta), the reference's output on them (None when it cannot be had on meta) and what
            was skipped, for the dry run's note ("" when nothing was).
        Raises:
            ReferenceError_: ``reference-build``, ``reference-inputs``, ``reference-run`` or
                ``reference-output``: an error that is the reference's own (verdict ``invalid_input``).
        """
        meta = torch.device("meta")
        _seed(self.settings["seed"])
        try:
            with meta:
                ref_model = ref["Model"](*init_inputs)
        except Exception as e:  # noqa: BLE001
            if not _meta_inconclusive(e):
                raise ReferenceError_("reference-build", f"Model(*get_init_inputs()) failed: {_error_text(e)}") from None
            ref_model = None
        try:
            inputs = self._inputs(ref, self.input_seed + 1, meta)
        except ReferenceError_ as e:
            if not _meta_inconclusive(e):
                raise
            return None, None, "dry run skipped (the reference's get_inputs() does not run on meta tensors)"
        unrunnable = "dry run ok (reference not runnable on meta: output shapes unchecked)"
        if ref_model is None:
            return inputs, None, unrunnable
        try:
            with meta, torch.no_grad():
                expected = ref_model(*[_clone(x) for x in inputs])
        except Exception as e:  # noqa: BLE001
            if not _meta_inconclusive(e):
                raise ReferenceError_("reference-run", f"Model.forward failed (on meta tensors): {_error_text(e)}") from None
            return inputs, None, unrunnable
        leaves = flatten_outputs(expected)
        if not leaves or not all(isinstance(o, (torch.Tensor, int, float, bool)) for o in leaves):
            raise ReferenceError_("reference-output", f"Model.forward returned {type(expected).__name__}, not Tensor(s)")
        return inputs, expected, ""

    def _compile_only(self, cand: dict, init_inputs: list, refs: dict[str, set[str]],
                      on_meta: tuple[list[Any] | None, Any, str]) -> JobResult:
        """ModelNew built on the CPU, its kernel names checked, then (``dry_run``) :meth:`_dry_run` against
        :meth:`_reference_on_meta`'s ``on_meta``."""
        s = self.settings
        _seed(s["seed"])
        try:
            model = cand["ModelNew"](*init_inputs)
        except RuleBroken:
            raise
        except Exception as e:  # noqa: BLE001
            return JobResult("crash", compiled=True, reason=f"ModelNew(*get_init_inputs()) raised {_error_text(e)}")
        bad = self._unknown_kernels(refs, cand, model)
        if bad:
            return JobResult("compile_error", compiled=True, reason=bad, rule="unknown-kernel")
        note = "compiled; ModelNew built on CPU"
        if s.get("dry_run", True):
            outcome = self._dry_run(model, *on_meta)
            if isinstance(outcome, JobResult):
                return outcome
            note += f"; {outcome}"
        return JobResult("ok", compiled=True, reason=f"{note} (compile-only: correctness, speed and the run-time "
                         "anti-cheat rules not measured; a GPU verifier checks them)")

    def _dry_run(self, model: Any, inputs: list[Any] | None, expected: Any, skipped: str) -> JobResult | str:
        """forward on the reference's meta ``inputs`` with launches checked, not run, and its outputs'
        shapes and dtypes checked against ``expected`` (:meth:`_reference_on_meta`); returns a note or a
        verdict (``skipped``: the note when the reference could not give inputs or ``expected``).  Meta stands
        for the GPU (:class:`~dice_ray.verify.meta_device.MetaStandsForDevice`: ``x.cuda()`` is a no-op), and
        what the machine's lack of CUDA stops is inconclusive, not a crash."""
        if inputs is None:
            return skipped
        try:
            model = model.to(torch.device("meta"))
        except Exception as e:  # noqa: BLE001
            return f"dry run skipped (ModelNew does not move to meta tensors: {type(e).__name__})"
        launch.configure(dry_run=True)
        try:
            with MetaStandsForDevice():  # x.cuda(), device="cuda": meta is the device here
                out = self._call_candidate(model, inputs, record=True)
        except RuleBroken:
            raise
        except Exception as e:  # noqa: BLE001
            msg = str(e)
            if isinstance(e, NotImplementedError) or any(w in msg for w in ("meta", "data pointer", "storage")):
                return f"dry run inconclusive ({type(e).__name__} on meta tensors)"
            if cuda_unavailable(e):  # torch.cuda.current_device() and the like on a machine without CUDA
                return f"dry run inconclusive (forward asks for CUDA, which this machine lacks: {type(e).__name__})"
            return JobResult("crash", compiled=True, reason=f"dry run of forward (meta tensors, launches checked): "
                             f"{_error_text(e)}")
        finally:
            launch.configure(dry_run=False)
        if expected is None:
            return skipped
        outs, exps = flatten_outputs(out), flatten_outputs(expected)
        if len(outs) != len(exps):
            return JobResult("incorrect", compiled=True, correct=False,
                             reason=f"dry run: forward returned {len(outs)} outputs, the reference {len(exps)}")
        for i, (o, r) in enumerate(zip(outs, exps)):
            if isinstance(r, torch.Tensor):
                if not isinstance(o, torch.Tensor) or tuple(o.shape) != tuple(r.shape) or o.dtype != r.dtype:
                    got = f"{tuple(o.shape)} {o.dtype}" if isinstance(o, torch.Tensor) else type(o).__name__
                    return JobResult("incorrect", compiled=True, correct=False,
                                     reason=f"dry run: output {i} is {got}, expected {tuple(r.shape)} {r.dtype}")
        return "dry run ok (launch arguments and output shapes checked on meta tensors)"

    # -- GPU ------------------------------------------------------------------------------------
    def _gpu(self, cand: dict, ref: dict, init_inputs: list, refs: dict[str, set[str]],
             stage: Callable[..., Any], reference_src: str, facts: ReferenceFacts | None) -> JobResult:
        """The GPU stages of a job; ``facts``: the reference's, from an earlier job (None: measured here
        and passed on with the ``run`` stage's announcement)."""
        s = self.settings
        dev = self.dev
        ref_model, inputs0, ref_mutates, expected0, learnt = self._reference_on_trial0(ref, init_inputs, facts)
        seeds = [self.input_seed + 1 + i for i in range(s["correctness_trials"])]  # trial 0's is inputs0's

        stage("run", **({} if learnt is facts else {"reference_facts": learnt.to_dict()}))
        facts = learnt
        _seed(s["seed"])
        try:
            with dev:
                model = cand["ModelNew"](*init_inputs).to(dev)
        except RuleBroken:
            raise
        except Exception as e:  # noqa: BLE001
            return JobResult("crash", compiled=True, reason=f"ModelNew(*get_init_inputs()) raised {_error_text(e)}")
        bad = self._unknown_kernels(refs, cand, model)
        if bad:
            return JobResult("compile_error", compiled=True, reason=bad, rule="unknown-kernel")
        notes: list[str] = []
        for n, (label, make) in enumerate(self._trials(ref, seeds, inputs0, reference_src, notes)):
            if n:
                stage("run")  # between trials: a worker waiting to time goes first (runner.GpuGate)
            failed = self._trial(model, ref_model, make, label, ref_mutates, precision=facts if n == 0 else None,
                                 notes=notes, expected=expected0 if n == 0 else None, ablate=n == 1)
            expected0 = None
            if failed is not None:
                return failed
        notes.insert(0, f"{len(seeds)} seeded trials correct")
        _synchronize(self.device)
        if not s.get("self_test_timing", True):
            return JobResult("ok", compiled=True, correct=True, reason="; ".join(notes + ["self-test: timing skipped"]))

        stage("timing")
        t = self._measure(ref, ref_model, model, ref_mutates, stage)
        if isinstance(t, JobResult):
            return t
        notes.append(t.pop("note"))
        return JobResult("ok", compiled=True, correct=True, reason="; ".join(notes), **t)

    def _check_reference(self, ref_model: Any, inputs0: list[Any],
                         facts: ReferenceFacts | None) -> tuple[bool, Any, ReferenceFacts]:
        """Run the reference on trial 0's inputs: it must run, return tensors and be finite; without
        ``facts`` (the first job of this reference) it runs twice, must be deterministic, and its
        precision facts are measured (:func:`~dice_ray.verify.reference_facts.measure`: a float64 run).
        Returns whether it modifies its own inputs (then mutation is not checked), its first output
        (trial 0's expected output: trial 0 does not run the reference again) and the facts (``facts``
        itself when given, else the new ones).

        Raises:
            ReferenceError_: ``reference-run``, ``reference-output``, ``reference-nonfinite``,
                ``reference-nondeterministic``.
        """
        outs = []
        for _ in range(1 if facts is not None else 2):
            args = [_clone(x) for x in inputs0]
            try:
                with torch.no_grad():
                    outs.append(ref_model(*args))
                _synchronize(self.device)
            except Exception as e:  # noqa: BLE001
                raise ReferenceError_("reference-run", f"Model.forward failed: {_error_text(e)}") from None
        leaves = flatten_outputs(outs[0])
        if not leaves or not all(isinstance(o, (torch.Tensor, int, float, bool)) for o in leaves):
            raise ReferenceError_("reference-output", f"Model.forward returned {type(outs[0]).__name__}, not Tensor(s)")
        if not _finite(outs[0]):
            raise ReferenceError_("reference-nonfinite", "the reference output has NaN/inf values")
        mutates = not all(_same(a, b) for a, b in zip(args, inputs0))
        if facts is None:
            if not self._compare(outs[1], outs[0]).ok:
                raise ReferenceError_("reference-nondeterministic", "two reference runs on the same inputs differ")
            facts = reference_facts.measure(ref_model, inputs0, outs[0], float(self.settings.get("precision_rtol", 0.0)))
        return mutates, outs[0], facts

    def _trials(self, ref: dict, seeds: list[int], inputs0: list[Any], reference_src: str,
                notes: list[str]) -> list[tuple[str, Callable[[], list[Any] | None]]]:
        """The correctness trials as ``(label, make_inputs)``: one a seed, then the same inputs at
        another scale (``scaled_trial``), then a size constant doubled (``shape_trial``).
        ``make_inputs`` returns None when the trial cannot apply (noted, skipped)."""
        s, dev = self.settings, self.dev
        trials: list[tuple[str, Callable[[], list[Any] | None]]] = [
            (f"trial {i} (seed {seed})", (lambda: inputs0) if i == 0 else (lambda seed=seed: self._inputs(ref, seed, dev)))
            for i, seed in enumerate(seeds)
        ]
        factor = float(s.get("scaled_trial", 1.0))
        if factor != 1.0:
            scaled_seed = seeds[-1] + 1

            def scaled() -> list[Any]:
                return [x * factor if isinstance(x, torch.Tensor) and x.is_floating_point() else x
                        for x in self._inputs(ref, scaled_seed, dev)]

            trials.append((f"scaled trial (seed {scaled_seed}, floating inputs x{factor:g})", scaled))
        if s.get("shape_trial", True):
            found = shape_constant(reference_src)
            if found is None:
                notes.append("shape trial skipped (no size constant read only by get_inputs)")
            else:
                name, value = found
                shape_seed = seeds[-1] + 2

                def doubled() -> list[Any] | None:
                    ref[name] = 2 * value
                    try:
                        return self._inputs(ref, shape_seed, dev)
                    except ReferenceError_ as e:
                        notes.append(f"shape trial skipped ({name}={2 * value}: {e.message[:120]})")
                        return None
                    finally:
                        ref[name] = value

                trials.append((f"shape trial ({name} {value} -> {2 * value})", doubled))
        return trials

    def _trial(self, model: Any, ref_model: Any, make: Callable[[], list[Any] | None], label: str,
               ref_mutates: bool, precision: ReferenceFacts | None, notes: list[str],
               expected: Any = None, ablate: bool = False) -> JobResult | None:
        """One correctness trial: the reference first (its outputs stay alive; ``expected``: its output on
        these inputs, already computed), then the candidate on NaN-poisoned free memory with cloned
        inputs; returns a failing verdict or None.  ``precision``: the reference's facts on these
        inputs (trial 0), to check the candidate's precision with (:meth:`_check_precision`).
        ``ablate``: run :meth:`_ablate` on these inputs first (the trial after trial 0).

        Seeded trials must run the reference; a scaled or shape trial the reference cannot run (it
        raises or gives NaN/inf) is skipped with a note.
        """
        seeded = label.startswith("trial")
        self._restore_torch_state()  # the candidate may have flipped TF32 & co.: the reference runs as set up
        inputs = make()
        if inputs is None:
            return None
        try:
            if expected is None:
                with torch.no_grad():
                    expected = ref_model(*[_clone(x) for x in inputs])
                _synchronize(self.device)
        except Exception as e:  # noqa: BLE001
            if seeded:
                raise ReferenceError_("reference-run", f"{label}: Model.forward failed: {_error_text(e)}") from None
            notes.append(f"{label.split(' (')[0]} skipped (the reference raised {type(e).__name__})")
            return None
        if not seeded and not _finite(expected):
            notes.append(f"{label.split(' (')[0]} skipped (the reference gives NaN/inf there)")
            return None
        ablate = ablate and self._worth_ablating(expected, notes)  # before the fill: its temporaries hold the reference
        self._poison_free_memory()  # one fill serves the ablation's call and this trial's (after it only its own
        # outputs were freed: NaN where its skipped kernels wrote nothing, else what did not match the reference)
        if ablate:
            self._ablate(model, inputs, expected, label, notes)
        pristine = inputs  # never handed to anyone (the reference ran on clones): the copy to compare with
        cand_in = [_clone(x) for x in inputs]
        t_call = _perf()
        try:
            out = self._call_candidate(model, cand_in, record=True)
            _synchronize(self.device)
        except RuleBroken:
            raise
        except Exception as e:  # noqa: BLE001
            self._error_at = _perf()
            return JobResult("crash" if seeded else "incorrect", compiled=True, correct=None if seeded else False,
                             reason=f"{label}: forward raised {_error_text(e)}",
                             parts_s={"run.until_raise": round(self._error_at - t_call, 5)})
        if not ref_mutates and not all(_same(a, b) for a, b in zip(cand_in, pristine)):
            raise RuleBroken("input-mutation", f"{label}: the candidate modified its inputs")
        cmp = self._compare(out, expected)
        if not cmp.ok:
            return JobResult("incorrect", compiled=True, correct=False, reason=f"{label}: {cmp.reason}")
        if precision is not None:
            note = self._check_precision(ref_model, pristine, expected, out, precision)
            if note:
                notes.append(note)
        if not seeded:
            notes.append(f"{label} correct")
        return None

    def _worth_ablating(self, expected: Any, notes: list[str]) -> bool:
        """Whether the kernel ablation (:meth:`_ablate`) can tell anything from ``expected``: not when a buffer
        filled with a usual initial value would match every reference output
        (:func:`~dice_ray.verify.correctness.fill_could_match`: all zeros, a loss of exactly 1, ones within the
        tolerance), which an honest ``torch.zeros`` buffer whose kernel did not run would; then a note says so.
        Run before the free memory is poisoned: the comparison's temporaries hold the reference's values."""
        if fill_could_match(expected, **self._tolerances()):
            notes.append("kernel ablation skipped (a filled buffer would match the reference outputs)")
            return False
        return True

    def _ablate(self, model: Any, inputs: list[Any], expected: Any, label: str, notes: list[str]) -> None:
        """Rule ``kernel-not-used`` (dice-ray's own rule: an ablation of the candidate's kernels).

        Runs ``model`` once on clones of ``inputs`` (on the free memory the trial just NaN-poisoned) with
        every launch of its kernels counted but not run (:func:`dice_ray.launch.kernels_suppressed` for
        load_cuda kernels, :func:`dice_ray.verify.inline.kernels_suppressed` for load_inline ones), and
        compares its outputs with ``expected`` (the reference's on ``inputs``).  Forward may run torch's
        allocation/view/copy/fill ops (:data:`ALLOWED_ATEN_OPS`) and ``no-kernel-launch`` only asks for a
        launch, so a data-movement task (transpose, concat, padding) can be answered by
        ``x.t().contiguous()`` next to a kernel that does nothing; outputs that are right without the
        kernels were computed that way.  Nothing changes when the ablated call raises (it needed its
        kernels) or gives wrong outputs.  The trial runs it only where :meth:`_worth_ablating`: a
        one-element output is ablated unless a usual initial fill matches it, so a scalar (a loss) computed on
        the host next to a kernel that does nothing is caught.  Its outputs are compared by counts alone
        (no copy of the reference is left in the free memory the trial's own call allocates from).  Values
        forward reads onto the host (``item()``, a copy to a host tensor, ``str()``) are answered with those
        of the previous trial's call
        (:class:`~dice_ray.verify.host_reads.HostReadReplay`), except reads of its inputs, which are live: a
        forward that checks a flag its kernel sets, and raises or returns garbage when the flag is clear,
        cannot tell the ablated call from a real one, and one that computes on the host from its inputs
        computes this call's answer.  A forward whose outputs need its kernels gets wrong outputs (the
        replayed values are another input's) or, when it builds them on the host from replayed values
        alone, exactly its previous call's outputs: that echo is inconclusive (noted), not a cheat, even
        where the two trials' answers agree within tolerance (a loss over inputs of one distribution).

        The harness runs it in the trial after trial 0, before that trial's own call, on that trial's
        inputs: the candidate has not seen them, so no buffer it kept (an output buffer made in
        ``__init__`` and reused) holds their answer, and trial 0's call already did any first-call set-up.

        Raises:
            RuleBroken: ``kernel-not-used``.
            RuntimeError: a load_inline extension could not set or clear its kernel switch.
        """
        cand_in = [_clone(x) for x in inputs]
        with _suppress_fast(), _suppress_inline():
            try:
                with torch.no_grad(), HostReadReplay(self._host_reads, live=cand_in) as replay:
                    out = model(*cand_in)
                _synchronize(self.device)
                _check_output_types(out)
            except (Exception, SystemExit):  # noqa: BLE001 - it needed its kernels: no verdict from this run
                return
        if replay.replayed and self._read_outputs is not None and _same_outputs(out, self._read_outputs):
            notes.append("kernel ablation inconclusive (forward rebuilt its previous call's outputs from the "
                         "host reads replayed to it)")
            return
        counts = count_mismatches_batch([(out, expected)], **self._tolerances())  # counts only: compare_outputs copies the reference
        if not all(mismatch_kernel.supported(o, r) for o, r in zip(flatten_outputs(out), flatten_outputs(expected))
                   if isinstance(r, torch.Tensor) and r.numel()):
            self._poison_free_memory()  # the batched comparison stacked copies of the reference, since freed
        if not isinstance(counts, tuple) and int(counts[0]) == 0:
            raise RuleBroken("kernel-not-used",
                             f"{label}: with every launch of the candidate's kernels counted but not run, forward's "
                             "outputs still match the reference: its torch copy/fill ops or the host computed them, "
                             "not its kernels")

    def _check_precision(self, ref_model: Any, inputs: list[Any], expected: Any, out: Any,
                         facts: ReferenceFacts) -> str:
        """Compare fp32 outputs with a float64 run of the reference (``precision_rtol``).

        The candidate's relative RMS error may not exceed ``max(precision_rtol, 10 x the fp32
        reference's own)``: computing an fp32 task in fp16/bf16/TF32 passes allclose at 1e-2 but
        fails here.  ``facts`` (:mod:`~dice_ray.verify.reference_facts`: the reference's own error and
        the float64 output's scale on these inputs) bound the error without a float64 run; an output
        the bound cannot clear gets the exact check, with one.  Returns a note; the check is skipped
        (noted) when the reference has no fp32 outputs or does not run in float64.

        Raises:
            RuleBroken: ``precision-downgrade``.
        """
        bound = float(self.settings.get("precision_rtol", 0.0))
        if bound <= 0 or facts.note or not facts.outputs:
            return facts.note if bound > 0 else ""
        outs, refs = flatten_outputs(out), flatten_outputs(expected)
        worst, exact = 0.0, []
        for p in facts.outputs:
            limit = max(bound, 10.0 * p.ref_error)
            if p.scale == 0.0:
                continue
            upper = reference_facts.error_bound(outs[p.index], refs[p.index], p)
            if upper <= limit:
                worst = max(worst, upper)
            else:
                exact.append((p, limit))
        if exact:
            try:
                gt = reference_facts.float64_outputs(ref_model, inputs)
            except Exception as e:  # noqa: BLE001
                return f"precision check skipped (the reference does not run in float64: {type(e).__name__})"
            for p, limit in exact:
                o, r, g = outs[p.index], refs[p.index], gt[p.index]
                e_cand = reference_facts.relative_rms(o, g, p.scale, torch.isfinite(g) & torch.isfinite(r))
                if e_cand > limit:
                    raise RuleBroken("precision-downgrade",
                                     f"output {p.index}: relative RMS error {e_cand:.2e} against a float64 run of the "
                                     f"reference; the fp32 reference's own is {p.ref_error:.2e}, the bound "
                                     f"max({bound:g}, 10x that) = {limit:.2e}")
                worst = max(worst, e_cand)
        return f"fp32 error vs float64 {'at most ' if not exact else ''}{worst:.1e}"

    def _measure(self, ref: dict, ref_model: Any, model: Any, ref_mutates: bool,
                 stage: Callable[..., Any]) -> dict[str, Any] | JobResult:
        """Time reference and candidate on one :class:`~dice_ray.verify.timing.InputSchedule`,
        audit large speedups, then (stage ``check``: the GPU shared again) compare the timed
        calls' outputs with the reference's (:class:`TimedOutputChecks`); returns the JobResult
        fields or a failing JobResult.

        Raises:
            RuleBroken: ``no-kernel-launch`` (a call launched no candidate kernel), ``timing-audit``.
        """
        s, dev = self.settings, self.dev
        assert self.flush is not None
        base = self.input_seed + 1000
        pool_bytes = int(s.get("input_pool_mib", 1024) * 2**20)
        warmup = max(1, s["warmup"])
        make = lambda seed: self._inputs(ref, seed, dev)  # noqa: E731
        start = _perf()
        # the call-time probe: 3 one-call windows a side after a warm-up one (the median resists one slow window)
        probe = timing.InputSchedule(make, base - 4, 4, pool_bytes)
        t0 = _perf()
        p = timing.time_calls(ref_model, model, probe, {"reference": [1] * 4, "candidate": [1] * 4}, 1, self.flush,
                              self.device, ref_mutates=ref_mutates)
        per_call = (_perf() - t0) / 8  # host seconds of one call in its own window (either side)
        call_ms = {k: timing.spread_stats(p.per_call[k])[0] for k in ("reference", "candidate")}
        in_bytes = timing.input_bytes(probe(1))
        with torch.no_grad():
            out_bytes = timing.input_bytes(flatten_outputs(ref_model(*[_clone(x) for x in probe(1)])))
        del probe
        limit = min(pool_bytes // max(in_bytes, 1), _WINDOW_OUTPUT_BYTES // max(2 * out_bytes, 1))
        window_ms = float(s.get("timing_window_ms", 0.0))
        k = {side: timing.calls_per_window(ms, window_ms, (limit + 1) // 2) for side, ms in call_ms.items()}
        budget = s["run_timeout_s"] * _STAGE_BUDGET_FRACTION
        trials = max(3, min(s["timing_trials"], int(budget / max(1.5 * max(k.values()) * per_call, 1e-6))))
        warmup = -(-warmup // min(k.values()))  # warm-up windows: at least `warmup` calls a side
        secret = random.Random(os.urandom(8))  # window sizes and checked calls: unknowable to the candidate
        sizes = {side: timing.window_sizes(n, warmup + trials, secret) for side, n in k.items()}
        spans = [max(r, c) for r, c in zip(sizes["reference"], sizes["candidate"])]
        calls = sum(spans)
        schedule = timing.InputSchedule(make, base, calls, pool_bytes)
        firsts = [sum(spans[:w]) for w in range(len(spans))]
        ends = {j0 + n - 1 for j0, n in zip(firsts, sizes["candidate"])}  # each candidate window's last call
        cand_calls = [j0 + i for j0, n in zip(firsts, sizes["candidate"]) for i in range(n)]
        if out_bytes <= _CHECK_ALL_BYTES:  # each window's last call (deferred work) and a secret sample
            checked = ends | set(secret.sample(cand_calls, min(len(cand_calls), _CHECKED_CALLS)))
        else:
            n = min(len(cand_calls) - 1, int(s.get("output_checks", 5)))
            checked = {cand_calls[-1], *secret.sample(cand_calls[:-1], n)}
        counts = [_launch_count()]
        parts = {"probe": _perf() - start, "check": 0.0}

        def launched(side: str, j: int) -> None:
            if side != "candidate":
                counts[0] = _launch_count()
                return
            if _launch_count() == counts[0]:
                raise RuleBroken("no-kernel-launch", f"timed call {j} of ModelNew.forward launched no kernel")
            counts[0] = _launch_count()

        checks = TimedOutputChecks(self._tolerances(), lambda j: f"timed call {j} (inputs of seed {base + j})")

        def check(j: int, ref_out: Any, out: Any, inputs: list[Any]) -> None:
            t_check = _perf()
            try:
                checks.add(j, ref_out, out, inputs)
            finally:
                counts[0] = _launch_count()  # the comparison kernels are not the candidate's launches
                parts["check"] += _perf() - t_check

        t_windows = _perf()
        try:
            times = timing.time_calls(ref_model, model, schedule, sizes, warmup, self.flush, self.device, check,
                                      checked, ref_mutates, self._compiled(ref_model, schedule(0)), each_call=launched)
        except _Mismatch as e:
            return JobResult("incorrect", compiled=True, correct=False, reason=str(e))
        parts["fill"] = schedule.fill_s
        parts["windows"] = _perf() - t_windows - parts["fill"] - parts["check"]
        parts["gpu"] = 1e-3 * sum(t * n for side, v in times.per_call.items()
                                  for t, n in zip(v, sizes["candidate" if side == "candidate" else "reference"][warmup:]))
        parts.update({f"windows.{k}": v for k, v in times.host_s.items()})
        t_rest = _perf()
        net = {side: timing.spread_stats([max(t, 1e-6) for t in v]) for side, v in times.per_call.items()}
        (ref_ms, ref_spread), (cand_ms, cand_spread) = net["reference"], net["candidate"]
        speedup = ref_ms / max(cand_ms, 1e-6)
        timed = {side: v[warmup:] for side, v in sizes.items()}
        note = (f"candidate {cand_ms:.4f} ms (IQR {cand_spread:.0%}), reference {ref_ms:.4f} ms (IQR {ref_spread:.0%}), "
                f"speedup {speedup:.3f}x over {trials} timed windows a side of "
                f"{min(timed['reference'])}-{max(timed['reference'])} reference and "
                f"{min(timed['candidate'])}-{max(timed['candidate'])} candidate calls on {schedule.slots} input slots "
                f"(stream-ordered end events; windows whose work outlasted the stream, timed to the device-wide "
                f"synchronize: {times.outlasted.get('reference', 0)} reference, {times.outlasted.get('candidate', 0)} "
                f"candidate; windows the host was still queuing when the GPU reached them, left out while half are clean: "
                f"{times.host_bound.get('reference', 0)} reference, {times.host_bound.get('candidate', 0)} candidate), "
                f"{len(checked)} outputs checked")
        if speedup > s.get("audit_speedup", 10.0):
            audit = {side: v[warmup: warmup + min(trials, 10)] for side, v in sizes.items()}
            ref_wall, _ = timing.spread_stats(timing.wall_times(ref_model, schedule, audit["reference"], self.flush,
                                                                self.device))
            cand_wall, _ = timing.spread_stats(timing.wall_times(model, schedule, audit["candidate"], self.flush,
                                                                 self.device))
            wall_speedup = ref_wall / max(cand_wall, 1e-6)
            factor = s.get("audit_factor", 3.0)
            if speedup > factor * wall_speedup:
                raise RuleBroken("timing-audit", f"CUDA events give {speedup:.1f}x but the host wall clock {wall_speedup:.1f}x "
                                 f"(reference {ref_wall:.4f} ms, candidate {cand_wall:.4f} ms a call): more than {factor:g}x apart")
            note += f"; audit: wall-clock speedup {wall_speedup:.1f}x"
        parts["audit"] = _perf() - t_rest
        del schedule
        stage("check")
        t_check = _perf()
        try:
            wrong, n_checked = checks.wrong()
        except _Mismatch as e:
            return JobResult("incorrect", compiled=True, correct=False, reason=str(e))
        parts["check"] += _perf() - t_check
        if wrong:
            j, n = wrong[0]
            return JobResult("incorrect", compiled=True, correct=False,
                             reason=f"timed call {j} (inputs of seed {base + j}): {n} elements differ from the "
                             f"reference's; {len(wrong)} of {n_checked} checked timed calls wrong")
        fields = {"speedup": speedup, "ref_ms": ref_ms, "candidate_ms": cand_ms, "ref_spread": ref_spread,
                  "candidate_spread": cand_spread, "note": note,
                  "parts_s": {f"timing.{k}": round(v, 5) for k, v in parts.items()}}
        if "baseline" in net:
            compiled_ms = net["baseline"][0]
            fields.update(compiled_ref_ms=compiled_ms, speedup_compiled=compiled_ms / max(cand_ms, 1e-6))
            fields["note"] += f"; torch.compile reference {compiled_ms:.4f} ms"
        return fields

    def _compiled(self, ref_model: Any, example: list[Any]) -> Callable[..., Any] | None:
        """``torch.compile(reference)`` when ``compile_baseline`` is on, compiled and warmed here
        (outside any timed window); None when off or when it fails to compile."""
        if not self.settings.get("compile_baseline"):
            return None
        try:
            compiled = torch.compile(ref_model)
            with torch.no_grad():
                compiled(*[_clone(x) for x in example])
            _synchronize(self.device)
            return compiled
        except Exception:  # noqa: BLE001 - the baseline is a report, never a verdict
            return None


class _Mismatch(Exception):
    """A timed call's output differs from the reference's (verdict ``incorrect``)."""


def _shares_memory(outputs: list[Any], inputs: list[Any]) -> bool:
    """Whether a tensor of ``outputs`` lives in the storage of a tensor of ``inputs``."""
    held = {x.untyped_storage().data_ptr() for x in inputs if isinstance(x, torch.Tensor)}
    return any(isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() in held for o in outputs)


class TimedOutputChecks:
    """The timed calls' outputs to compare with the reference's, kept and compared in batches.

    :meth:`add` keeps a pair (no GPU work, so the exclusive timing stage spends nothing on it)
    until ``keep_bytes`` of outputs are held; then the held pairs are compared at once
    (:func:`~dice_ray.verify.correctness.count_mismatches_batch`: a few kernels, no sync).
    :meth:`wrong` compares the rest and reads every count with one sync: the harness calls it in
    the shared ``check`` stage, after the timing stage.

    Args:
        tolerances: ``rtol``, ``atol``, ``half_rtol``, ``half_atol`` (VerifyConfig fields).
        describe: ``j -> str`` naming timed call ``j`` in a reason (its inputs' seed).
        keep_bytes: outputs (candidate's and reference's) held before a batch is compared (bytes).
    """

    def __init__(self, tolerances: dict[str, float], describe: Callable[[int], str],
                 keep_bytes: int = _KEPT_OUTPUT_BYTES):
        self.tolerances = tolerances
        self.describe = describe
        self.keep_bytes = keep_bytes
        self._pending: list[tuple[int, Any, Any]] = []
        self._held = 0
        self._counts: list[tuple[list[int], torch.Tensor]] = []

    def add(self, j: int, ref_out: Any, out: Any, inputs: list[Any] = ()) -> None:
        """Keep timed call ``j``'s outputs for comparison; compare at once when an output shares
        memory with ``inputs`` (a pool slot whose values change before the check stage).

        Raises:
            RuleBroken: ``output-type`` (an output is not a plain Tensor).
            _Mismatch: a batch compared now has a structure, shape or dtype mismatch.
        """
        _check_output_types(out)
        self._pending.append((j, ref_out, out))
        self._held += sum(timing.input_bytes(flatten_outputs(o)) for o in (ref_out, out))
        if self._held > self.keep_bytes or _shares_memory([*flatten_outputs(ref_out), *flatten_outputs(out)], inputs):
            self._compare()

    def _compare(self) -> None:
        if not self._pending:
            return
        calls = [j for j, _, _ in self._pending]
        counts = count_mismatches_batch([(out, ref) for _, ref, out in self._pending], **self.tolerances)
        self._pending, self._held = [], 0
        if isinstance(counts, tuple):
            i, reason = counts
            raise _Mismatch(f"{self.describe(calls[i])}: {reason}")
        self._counts.append((calls, counts))

    def wrong(self) -> tuple[list[tuple[int, int]], int]:
        """Compare what is held and read every count (one sync).

        Returns:
            ``([(call, failing elements), ...] for the wrong calls in call order, calls checked)``.
        Raises:
            _Mismatch: a structure, shape or dtype mismatch.
        """
        self._compare()
        if not self._counts:
            return [], 0
        calls = [j for js, _ in self._counts for j in js]
        counts = torch.cat([c.to(self._counts[0][1].device) for _, c in self._counts]).tolist()
        return sorted((j, n) for j, n in zip(calls, counts) if n), len(calls)


def _finite(out: Any) -> bool:
    return all(bool(torch.isfinite(o).all()) for o in flatten_outputs(out)
               if isinstance(o, torch.Tensor) and o.is_floating_point())
