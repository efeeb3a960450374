"""What the sandboxed worker does with one candidate: load, reference check, correctness, timing.

Runs inside :mod:`dice_ray.verify.worker` (never in the verifier's own process).  Stages follow
KernelBench's ``eval.py`` (seeded ``Model`` and ``ModelNew`` from ``get_init_inputs()``, several
input trials, allclose) and ``timing.py`` (CUDA events, L2 flush, warm-up), as small typed steps,
with the run-time anti-cheat rules added:

* every candidate call (correctness, warm-up, timed) must launch >= 1 kernel of the candidate
  (``dice_ray.launch.launch_count``): ``no-kernel-launch``;
* a :class:`~torch.utils._python_dispatch.TorchDispatchMode` sees every aten op of the candidate's
  forward in the correctness trials (and the compile-only dry run); ops outside
  :data:`ALLOWED_ATEN_OPS` (allocation, views, fills, copies) are ``forward-torch-op``;
* inputs are cloned separately for candidate and reference and compared with a pristine copy
  after the candidate ran: ``input-mutation``;
* outputs must be plain ``torch.Tensor`` objects: ``output-type``;
* before each correctness call the caching allocator's free blocks are filled with 0xFF bytes
  (NaN in every float type), so a candidate that returns ``torch.empty`` memory holding a freed
  reference output, or leaves elements unwritten, reads NaN and fails;
* the candidate runs before the reference in each trial; a last comparison after timing catches
  candidates that change behaviour after the first calls.

Failures are typed (:class:`JobResult`), not recognised by matching exception text, except the
CUDA-error probe that decides whether the worker must be replaced (``fatal``).
"""

from __future__ import annotations

import builtins
import copy
import dis
import gc
import linecache
import math
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dice_ray import launch
from dice_ray.verify.correctness import compare_outputs, flatten_outputs
from dice_ray.verify.rules import check_cuda_source, import_allowed

__all__ = ["ALLOWED_ATEN_OPS", "Harness", "JobResult", "RuleBroken"]

# Bound at import, before any candidate runs (patching these later cannot fool the harness).
_Event = torch.cuda.Event
_synchronize = torch.cuda.synchronize
_perf = time.perf_counter
_gpu_sleep = getattr(torch.cuda, "_sleep", None)  # spins the GPU for N clock cycles
#: GPU cycles spun before each timed call (~100 us at 2 GHz), after the L2 flush: the host's launch
#: overhead (Python, up to roughly this long) then overlaps GPU work instead of being timed
HEADROOM_CYCLES = 200_000
_launch_count = launch.launch_count

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
_STAGE_BUDGET_FRACTION = 0.3
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
  # timing of one side may use this share of run_timeout_s


class RuleBroken(Exception):
    """A run-time anti-cheat rule broken by the candidate (``rule`` is an id of ``rules.RULES``)."""

    def __init__(self, rule: str, message: str):
        super().__init__(f"[{rule}] {message}")
        self.rule = rule
        self.message = message


class ReferenceError_(Exception):
    """The task's reference failed (verdict ``invalid_input``; ``rule`` names how)."""

    def __init__(self, rule: str, message: str):
        super().__init__(f"[{rule}] {message}")
        self.rule = rule
        self.message = message


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
    fatal: bool = False  # the worker must be replaced (sticky CUDA error)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class OpRecorder(TorchDispatchMode):
    """Records the aten ops run under it that are not in :data:`ALLOWED_ATEN_OPS`."""

    def __init__(self) -> None:
        super().__init__()
        self.forbidden: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        name = func.overloadpacket.__name__
        if name not in ALLOWED_ATEN_OPS and name not in self.forbidden:
            self.forbidden.append(name)
        return func(*args, **(kwargs or {}))


def _error_text(exc: BaseException, limit: int = 1500) -> str:
    """``Type: message`` plus the innermost candidate/reference frames, at most ``limit`` characters."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename in ("<candidate>", "<reference>")]
    where = "".join(f"  {f.filename} line {f.lineno}: {(f.line or '').strip()}\n" for f in frames[-3:])
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, launch.CompileError):
        text = str(exc)
    text = f"{text}\n{where}" if where else text
    return text if len(text) <= limit else text[: limit - 20] + "\n...[truncated]"


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


def exec_source(src: str, filename: str, guarded: bool) -> dict[str, Any]:
    """Execute a module's source in a fresh namespace (candidate: restricted builtins when ``guarded``).

    Raises:
        whatever the module raises (SyntaxError, CompileError, RuleBroken, ...).
    """
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    code = compile(src, filename, "exec")
    ns: dict[str, Any] = {"__name__": f"dice_ray_{filename.strip('<>')}", "__builtins__": _candidate_builtins(guarded)}
    exec(code, ns)  # noqa: S102 - the sandboxed worker exists to do this
    return ns


def _check_cuda_source(source: Any) -> None:
    """load_cuda's hook: the CUDA-side rules on the final source string, however it was built."""
    if isinstance(source, str):
        for v in check_cuda_source(source):
            raise RuleBroken(v.rule, f"load_cuda source: {v.message}")


def _clone(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.clone()
    return copy.deepcopy(x)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if torch.equal(a, b):
            return True
        if a.is_floating_point():
            return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())
        return False
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001
        return True


def _check_output_types(out: Any) -> None:
    for i, o in enumerate(flatten_outputs(out)):
        if isinstance(o, torch.Tensor) and type(o) not in (torch.Tensor, torch.nn.Parameter):
            raise RuleBroken("output-type", f"output {i} is a {type(o).__module__}.{type(o).__name__}, not a torch.Tensor")


def _stats(times: list[float]) -> tuple[float, float]:
    s = sorted(times)
    med = s[len(s) // 2] if len(s) % 2 else 0.5 * (s[len(s) // 2 - 1] + s[len(s) // 2])

    def q(p: float) -> float:
        k = (len(s) - 1) * p
        lo, hi = math.floor(k), math.ceil(k)
        return s[lo] + (s[hi] - s[lo]) * (k - lo)

    return med, (q(0.75) - q(0.25)) / med if med > 0 else 0.0


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
        if mode == "gpu":
            assert device is not None
            self.dev = torch.device("cuda", device)
            l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 * 2**20) or 64 * 2**20
            self.flush = torch.empty(int(2 * l2) // 4, dtype=torch.int32, device=self.dev)
        else:
            self.dev = torch.device("cpu")
        self._torch_state = self._save_torch_state()
        if settings.get("static_rules", True):
            launch.configure(source_check=_check_cuda_source)

    def self_test(self) -> str:
        """Verify a built-in relu candidate once (warms every path); returns its verdict and reason."""
        saved = dict(self.settings)
        self.settings.update(timing_trials=3, warmup=1, correctness_trials=1)
        try:
            r = self.run({"candidate_src": _SELF_TEST_CANDIDATE, "reference_src": _SELF_TEST_REFERENCE,
                          "kernel_refs": {"kernels": ["relu_kernel"]}}, lambda _s: None)
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

    # -- helpers -------------------------------------------------------------------------------
    def cuda_healthy(self) -> bool:
        """False when the CUDA context holds a sticky error (the worker must be replaced)."""
        if self.mode != "gpu":
            return True
        try:
            _synchronize(self.device)
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
        torch.manual_seed(seed)
        try:
            with device:
                raw = ns["get_inputs"]()
            raw = list(raw) if isinstance(raw, (list, tuple)) else [raw]
            return [x.to(device) if isinstance(x, torch.Tensor) else x for x in raw]
        except Exception as e:  # noqa: BLE001
            raise ReferenceError_("reference-inputs", f"get_inputs() failed: {_error_text(e)}") from None

    def _call_candidate(self, model: Any, args: list[Any], record: bool) -> Any:
        before = _launch_count()
        rec = OpRecorder() if record else None
        with torch.no_grad():
            if rec is not None:
                with rec:
                    out = model(*args)
            else:
                out = model(*args)
        if _launch_count() == before:
            raise RuleBroken("no-kernel-launch", "a call of ModelNew.forward launched no kernel of the candidate")
        if rec is not None and rec.forbidden:
            raise RuleBroken("forward-torch-op", f"forward ran torch ops outside its kernels: {rec.forbidden}")
        _check_output_types(out)
        return out

    def _compare(self, out: Any, ref: Any) -> Any:
        s = self.settings
        return compare_outputs(out, ref, rtol=s["rtol"], atol=s["atol"], half_rtol=s["half_rtol"],
                               half_atol=s["half_atol"])

    # -- the job ------------------------------------------------------------------------------
    def run(self, job: dict[str, Any], stage: Callable[[str], None]) -> JobResult:
        """Verify one candidate; ``stage(name)`` is called at each stage boundary ("load",
        "reference", "run") so the parent can apply that stage's time limit.  Never raises for a
        bad candidate or reference."""
        result = JobResult("crash")
        try:
            result = self._run(job, stage)
        except RuleBroken as e:
            result = JobResult("cheat", compiled=True, reason=e.message, rule=e.rule)
        except ReferenceError_ as e:
            result = JobResult("invalid_input", compiled=True, reason=e.message, rule=e.rule)
        except Exception as e:  # noqa: BLE001
            result = JobResult("crash", compiled=True, reason=_error_text(e))
        finally:
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
        gc.collect(1 if self.jobs % 50 else 2)  # a full collection costs ~0.15 s with torch loaded
        if self.mode == "gpu" and not result.fatal:
            try:
                torch.cuda.empty_cache()
            except Exception:  # noqa: BLE001
                result.fatal = True
        return result

    def _run(self, job: dict[str, Any], stage: Callable[[str], None]) -> JobResult:
        s = self.settings
        guarded = bool(s.get("static_rules", True))
        # 1. load: execute the candidate module (this is where NVRTC compiles)
        stage("load")
        try:
            cand = exec_source(job["candidate_src"], "<candidate>", guarded)
        except RuleBroken as e:
            return JobResult("cheat", reason=e.message, rule=e.rule)
        except launch.CompileError as e:
            return JobResult("compile_error", reason=_error_text(e, 6000))
        except SyntaxError as e:
            return JobResult("compile_error", reason=f"Python syntax error: {e}")
        except Exception as e:  # noqa: BLE001
            return JobResult("crash", reason=f"executing the candidate module raised {_error_text(e)}")
        if not isinstance(cand.get("ModelNew"), type):
            return JobResult("compile_error", compiled=True, reason="the candidate defines no class ModelNew",
                             rule="no-modelnew")
        refs = {k: set(v) for k, v in job.get("kernel_refs", {}).items()}
        bad = self._unknown_kernels(refs, cand, None)
        if bad:
            return JobResult("compile_error", compiled=True, reason=bad, rule="unknown-kernel")

        # 2. reference: module, init inputs
        stage("reference")
        try:
            ref = exec_source(job["reference_src"], "<reference>", guarded=False)
            torch.manual_seed(s["seed"])
            init_inputs = list(ref["get_init_inputs"]())
        except Exception as e:  # noqa: BLE001
            raise ReferenceError_("reference-exec", f"reference module or get_init_inputs() failed: {_error_text(e)}")
        if self.mode == "compile_only":
            stage("run")
            return self._compile_only(cand, ref, init_inputs, refs)
        return self._gpu(cand, ref, init_inputs, refs, stage)

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
    def _compile_only(self, cand: dict, ref: dict, init_inputs: list, refs: dict[str, set[str]]) -> JobResult:
        s = self.settings
        torch.manual_seed(s["seed"])
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
            outcome = self._dry_run(model, cand, ref, init_inputs)
            if isinstance(outcome, JobResult):
                return outcome
            note += f"; {outcome}"
        return JobResult("ok", compiled=True, reason=f"{note} (compile-only: correctness and speed not measured)")

    def _dry_run(self, model: Any, cand: dict, ref: dict, init_inputs: list) -> JobResult | str:
        """forward on meta tensors with launches checked, not run; returns a note or a verdict."""
        meta = torch.device("meta")
        try:
            inputs = self._inputs(ref, self.settings["seed"] + 1, meta)
            model = model.to(meta)
        except Exception as e:  # noqa: BLE001
            return f"dry run skipped (inputs on meta: {type(e).__name__})"
        launch.configure(dry_run=True)
        try:
            out = self._call_candidate(model, inputs, record=True)
        except RuleBroken:
            raise
        except Exception as e:  # noqa: BLE001
            msg = str(e)
            if isinstance(e, NotImplementedError) or any(w in msg for w in ("meta", "data pointer", "storage")):
                return f"dry run inconclusive ({type(e).__name__} on meta tensors)"
            return JobResult("crash", compiled=True, reason=f"dry run of forward (meta tensors, launches checked): "
                             f"{_error_text(e)}")
        finally:
            launch.configure(dry_run=False)
        try:
            torch.manual_seed(self.settings["seed"])
            with meta, torch.no_grad():
                expected = ref["Model"](*init_inputs)(*inputs)
        except Exception:  # noqa: BLE001
            return "dry run ok (reference not runnable on meta: output shapes unchecked)"
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
             stage: Callable[[str], None]) -> JobResult:
        s = self.settings
        dev = self.dev
        try:
            torch.manual_seed(s["seed"])
            with dev:
                ref_model = ref["Model"](*init_inputs).to(dev).eval()
        except Exception as e:  # noqa: BLE001
            raise ReferenceError_("reference-build", f"Model(*get_init_inputs()) failed: {_error_text(e)}") from None
        seeds = [s["seed"] + 1 + i for i in range(s["correctness_trials"])]
        # reference sanity on the first trial's inputs: runs, deterministic, finite
        inputs0 = self._inputs(ref, seeds[0], dev)
        outs = []
        for _ in range(2):
            args = [_clone(x) for x in inputs0]
            try:
                with torch.no_grad():
                    outs.append(ref_model(*args))
                _synchronize(self.device)
            except Exception as e:  # noqa: BLE001
                raise ReferenceError_("reference-run", f"Model.forward failed: {_error_text(e)}") from None
        ref_mutates = not all(_same(a, b) for a, b in zip(args, inputs0))
        leaves = flatten_outputs(outs[0])
        if not leaves or not all(isinstance(o, (torch.Tensor, int, float, bool)) for o in leaves):
            raise ReferenceError_("reference-output", f"Model.forward returned {type(outs[0]).__name__}, not Tensor(s)")
        if any(isinstance(o, torch.Tensor) and o.is_floating_point() and not bool(torch.isfinite(o).all()) for o in leaves):
            raise ReferenceError_("reference-nonfinite", "the reference output has NaN/inf values")
        if not self._compare(outs[1], outs[0]).ok:
            raise ReferenceError_("reference-nondeterministic", "two reference runs on the same inputs differ")
        del outs, args, leaves

        stage("run")
        torch.manual_seed(s["seed"])
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

        # correctness trials: candidate first (on poisoned free memory), then reference
        for i, seed in enumerate(seeds):
            inputs = inputs0 if i == 0 else self._inputs(ref, seed, dev)
            pristine = [_clone(x) for x in inputs]
            cand_in = [_clone(x) for x in inputs]
            ref_in = [_clone(x) for x in inputs]
            del inputs
            self._poison_free_memory()
            try:
                out = self._call_candidate(model, cand_in, record=True)
                _synchronize(self.device)
            except RuleBroken:
                raise
            except Exception as e:  # noqa: BLE001
                return JobResult("crash", compiled=True, reason=f"trial {i}: forward raised {_error_text(e)}")
            if not ref_mutates and not all(_same(a, b) for a, b in zip(cand_in, pristine)):
                raise RuleBroken("input-mutation", f"trial {i}: the candidate modified its inputs")
            with torch.no_grad():
                expected = ref_model(*ref_in)
            cmp = self._compare(out, expected)
            if not cmp.ok:
                return JobResult("incorrect", compiled=True, correct=False, reason=f"trial {i} (seed {seed}): {cmp.reason}")
            del out, expected, cand_in, ref_in, pristine

        # timing: reference eager and candidate, same inputs, same worker, L2 flushed before each call
        inputs = self._inputs(ref, s["seed"] + 1000, dev)
        ref_in = [_clone(x) for x in inputs]
        cand_in = [_clone(x) for x in inputs]
        del inputs
        ref_times, ref_out = self._time(lambda: ref_model(*ref_in), None)
        cand_times, cand_out = self._time(lambda: model(*cand_in), True)
        cmp = self._compare(cand_out, ref_out)
        if not cmp.ok:
            return JobResult("incorrect", compiled=True, correct=False,
                             reason=f"after timing (the last timed call): {cmp.reason}")
        ref_ms, ref_spread = _stats(ref_times)
        cand_ms, cand_spread = _stats(cand_times)
        speedup = ref_ms / max(cand_ms, 1e-6)
        return JobResult(
            "ok", compiled=True, correct=True, speedup=speedup, ref_ms=ref_ms, candidate_ms=cand_ms,
            ref_spread=ref_spread, candidate_spread=cand_spread,
            reason=(f"{len(seeds)} trials correct; candidate {cand_ms:.4f} ms (IQR {cand_spread:.0%}), "
                    f"reference {ref_ms:.4f} ms (IQR {ref_spread:.0%}), speedup {speedup:.3f}x"),
        )

    def _time(self, fn: Callable[[], Any], candidate: bool | None) -> tuple[list[float], Any]:
        """CUDA-event times (ms) of ``fn`` after warm-up, the L2 flushed before each call
        (KernelBench ``timing.py``) and :data:`HEADROOM_CYCLES` of GPU spin queued before the start
        event, so device time is measured, not Python launch overhead (up to ~100 us of it, for
        reference and candidate alike); for the candidate every call must launch a kernel."""
        s = self.settings

        def call() -> Any:
            before = _launch_count()
            with torch.no_grad():
                out = fn()
            if candidate and _launch_count() == before:
                raise RuleBroken("no-kernel-launch", "a timed call of ModelNew.forward launched no kernel")
            return out

        t0 = _perf()
        out = call()
        _synchronize(self.device)
        per_call = _perf() - t0
        for _ in range(s["warmup"]):
            out = call()
        _synchronize(self.device)
        budget = s["run_timeout_s"] * _STAGE_BUDGET_FRACTION
        n = max(3, min(s["timing_trials"], int(budget / max(per_call, 1e-6))))
        starts = [_Event(enable_timing=True) for _ in range(n)]
        ends = [_Event(enable_timing=True) for _ in range(n)]
        assert self.flush is not None
        for i in range(n):
            self.flush.zero_()
            if _gpu_sleep is not None:
                _gpu_sleep(HEADROOM_CYCLES)
            starts[i].record()
            out = call()
            ends[i].record()
        _synchronize(self.device)
        return [a.elapsed_time(b) for a, b in zip(starts, ends)], out
