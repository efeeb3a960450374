"""The fast candidate format's run time: load NVRTC-compiled kernels and launch them from Python, counted.

A candidate writes its kernels as ``extern "C" __global__`` functions in a string and calls
``kernels = load_cuda(cuda_source)``; its ``ModelNew.forward`` then launches them with
``kernels.<name>(grid, block, args, shared_mem=0)`` on ``torch.cuda.current_stream()``.  This module is what
candidates import (``from dice_ray.launch import load_cuda``); the compile itself is
:mod:`dice_ray.verify.candidate.nvrtc` (NVRTC, cached by content hash).

Built on cuda-python (``cuda.bindings.driver``); same idea as CuPy's ``RawModule``, without CuPy.  Without a GPU
(or after ``configure(compile_only=True)``) :func:`load_cuda` still runs the real NVRTC compile for
:data:`~dice_ray.verify.candidate.nvrtc.DEFAULT_ARCH` (a real compile verdict) but the kernels cannot launch.

Measured: host-side cost of one launch 13 us (``torch.relu_``: 10 us).

Process-wide state: a module cache per (image, device), a launch counter (:func:`launch_count`) that the
verifier reads to enforce "every timed call launches at least one of the candidate's kernels", and a switch
that skips launches while still counting them (:func:`kernels_suppressed`, the verifier's ablation of the
candidate's kernels: rule ``kernel-not-used``).
"""

from __future__ import annotations

import contextlib
import ctypes
import operator
import struct
import threading
from dataclasses import dataclass
from typing import Any, Iterator

from dice_ray.verify.candidate import nvrtc
from dice_ray.verify.candidate.nvrtc import DEFAULT_ARCH, CompileError, CompiledProgram, KernelParam

__all__ = [
    "CompileError",
    "Kernel",
    "KernelModule",
    "configure",
    "kernels_suppressed",
    "launch_count",
    "load_cuda",
    "target_arch",
]

_DEFAULT_SMEM_LIMIT = 48 * 1024
_lock = threading.RLock()


def _check(result: Any, what: str) -> Any:
    """Unpack a cuda-python ``(err, *values)`` tuple; raise RuntimeError on a driver error."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        from cuda.bindings import driver

        name = driver.cuGetErrorName(err)[1] if isinstance(err, driver.CUresult) else b"?"
        desc = driver.cuGetErrorString(err)[1] if isinstance(err, driver.CUresult) else b""
        name = name.decode() if isinstance(name, bytes) else str(err)
        desc = desc.decode() if isinstance(desc, bytes) else ""
        raise RuntimeError(f"{what} failed: {name}: {desc}")
    return rest[0] if len(rest) == 1 else tuple(rest)


# ----------------------------------------------------------------------------------------------
# Device state
# ----------------------------------------------------------------------------------------------


@dataclass
class _Config:
    compile_only: bool | None = None  # None: decide on first use (no GPU -> compile-only)
    arch: str | None = None  # compile-only target
    dry_run: bool = False  # compile-only: validate launches (arg types, grid) without running
    source_check: Any = None  # callable(source) run before compiling; raises to refuse a source


_config = _Config()
_launches = 0
_suppressed = False  # launches counted but not run (kernels_suppressed); private: candidates cannot read it
_contexts: dict[int, Any] = {}  # device ordinal -> CUcontext (primary)
_modules: dict[tuple[str, int], tuple[Any, dict[str, Any]]] = {}  # (key, device) -> (CUmodule, functions)


def configure(
    *, compile_only: bool | None = None, arch: str | None = None, dry_run: bool | None = None, source_check: Any = None
) -> None:
    """Set how :func:`load_cuda` behaves in this process (the verifier's worker calls it once).

    Args:
        compile_only: True: never touch a GPU (compile for ``arch``); False: require a GPU;
            None: a GPU when ``torch.cuda.is_available()``.
        arch: NVRTC target in compile-only mode (default :data:`DEFAULT_ARCH`).
        dry_run: compile-only: kernel calls check their arguments and count as launches but do
            nothing (the verifier's dry run of ``forward`` on meta tensors); False: they raise.
        source_check: ``callable(source)`` called by :func:`load_cuda` before compiling (the
            verifier's CUDA-side anti-cheat rules, applied to the final string however it was built).
    """
    with _lock:
        if compile_only is not None:
            _config.compile_only = compile_only
        if arch is not None:
            _config.arch = arch
        if dry_run is not None:
            _config.dry_run = dry_run
        if source_check is not None:
            _config.source_check = source_check


def _is_compile_only() -> bool:
    if _config.compile_only is None:
        import torch

        _config.compile_only = not torch.cuda.is_available()
    return _config.compile_only


def target_arch() -> str:
    """The arch :func:`load_cuda` compiles for: the current device's (``sm_90`` on an H100/H200), or in
    compile-only mode the configured one (:data:`~dice_ray.verify.candidate.nvrtc.DEFAULT_ARCH` unless set)."""
    if _is_compile_only():
        return _config.arch or DEFAULT_ARCH
    import torch

    major, minor = torch.cuda.get_device_capability(torch.cuda.current_device())
    return f"sm_{major}{minor}"


def _context(device: int) -> Any:
    """torch's primary context of ``device``, made current on the calling thread."""
    from cuda.bindings import driver

    ctx = _contexts.get(device)
    if ctx is None:
        import torch

        torch.cuda.init()  # torch first: it creates and owns the primary context
        _check(driver.cuInit(0), "cuInit")
        dev = _check(driver.cuDeviceGet(device), "cuDeviceGet")
        ctx = _check(driver.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        _contexts[device] = ctx
    _check(driver.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    return ctx


def launch_count() -> int:
    """Kernel launches made through :class:`KernelModule` in this process (dry runs and suppressed
    launches included)."""
    return _launches


@contextlib.contextmanager
def kernels_suppressed() -> Iterator[None]:
    """Inside the block, every kernel call of a :class:`KernelModule` does all a launch does (checks
    its arguments, counts in :func:`launch_count`) except ``cuLaunchKernel``: no kernel runs.

    The verifier's ablation of the candidate's kernels (dice-ray's own rule ``kernel-not-used``,
    :mod:`dice_ray.verify.trials.ablation`): a forward whose outputs are still right with its kernels
    skipped computed them with torch's copy/fill ops, not its kernels.  Counting the skipped
    launches keeps ``no-kernel-launch`` from firing instead.  Process-wide (one flag, read on every
    launch); the previous state is restored on exit, also when the block raises, so blocks nest.
    The flag is a private module global: candidates may not read private attributes of objects
    they did not define (rule ``dynamic-code``), so a candidate can neither read nor clear it (it
    can still notice that its kernels did not run, from a value one of them writes: the ablation
    catches kernels that do nothing, not a candidate that checks for it).
    """
    global _suppressed
    prior = _suppressed
    _suppressed = True
    try:
        yield
    finally:
        _suppressed = prior


# ----------------------------------------------------------------------------------------------
# Kernels and modules
# ----------------------------------------------------------------------------------------------


def _dims(value: Any, what: str, kernel: str) -> tuple[int, int, int]:
    if type(value) is int and value >= 1:  # the common case, checked in ~0.1 us
        return value, 1, 1
    items = value if isinstance(value, (tuple, list)) else (value,)
    if not 1 <= len(items) <= 3:
        raise ValueError(f"kernel {kernel}: {what} must be an int or a tuple of 1-3 ints, got {value!r}")
    try:
        dims = [operator.index(v) for v in items]
    except TypeError:
        raise TypeError(f"kernel {kernel}: {what} must be an int or a tuple of 1-3 ints, got {value!r}") from None
    if any(d < 1 for d in dims):
        raise ValueError(f"kernel {kernel}: {what} dimensions must be >= 1, got {value!r}")
    dims += [1] * (3 - len(dims))
    return dims[0], dims[1], dims[2]


_UINT_FMT = {1: "B", 2: "H", 4: "I", 8: "Q"}
_INT_BOUNDS = {n: (-(1 << (8 * n - 1)), (1 << (8 * n)) - 1) for n in (1, 2, 4, 8)}
_SLOT = 8  # every parameter gets its own 8-byte-aligned slot in the argument buffer
_torch: Any = None
_raw_stream: Any = None
_tls = threading.local()
_driver_mod: Any = None
_SUCCESS: Any = None
_RETRY_LAUNCH: tuple[Any, ...] = ()
_streams: dict[int, Any] = {}


def _torch_mod() -> Any:
    global _torch, _raw_stream
    if _torch is None:
        import torch

        fast = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        _raw_stream = fast if fast is not None else (lambda d: torch.cuda.current_stream(d).cuda_stream)
        _torch = torch
    return _torch


def _driver() -> Any:
    """``cuda.bindings.driver``, imported on first use, and the launch's constants from it."""
    global _driver_mod, _SUCCESS, _RETRY_LAUNCH
    if _driver_mod is None:
        from cuda.bindings import driver

        _SUCCESS = driver.CUresult.CUDA_SUCCESS
        _RETRY_LAUNCH = (driver.CUresult.CUDA_ERROR_INVALID_CONTEXT, driver.CUresult.CUDA_ERROR_INVALID_HANDLE)
        _driver_mod = driver
    return _driver_mod


def _stream(handle: int) -> Any:
    """The ``CUstream`` wrapping a raw stream handle, made once a handle."""
    stream = _streams.get(handle)
    if stream is None:
        if len(_streams) >= 256:  # bounded: a process that makes many streams does not grow it
            _streams.clear()
        stream = _streams[handle] = _driver().CUstream(handle)
    return stream


class Kernel:
    """One ``__global__`` function of a :class:`KernelModule`; call it to launch.

    Attributes:
        name: the entry name (as in PTX; ``extern "C"`` names are unmangled).
        params: the parameters read from PTX (cross-checked with ``cuFuncGetParamInfo`` on a GPU).
    """

    def __init__(self, name: str, params: tuple[KernelParam, ...], module: "KernelModule", function: Any):
        self.name = name
        self.params = params
        self._module = module
        self._function = function
        self._smem_set = _DEFAULT_SMEM_LIMIT
        fmt, offsets, off = "<", [], 0
        for p in params:
            slot = (p.size + _SLOT - 1) // _SLOT * _SLOT
            if p.kind == "bytes":
                code = f"{p.size}s"
            elif p.kind == "float":
                code = "f" if p.size == 4 else "d"
            else:
                code = _UINT_FMT[p.size]
            fmt += code + (f"{slot - p.size}x" if slot > p.size else "")
            offsets.append(off)
            off += slot
        self._fmt = struct.Struct(fmt)
        self._buf = ctypes.create_string_buffer(max(_SLOT, self._fmt.size))
        base = ctypes.addressof(self._buf)
        self._ptrs = (ctypes.c_void_p * max(1, len(params)))(*[base + o for o in offsets])
        self._ptrs_addr = ctypes.addressof(self._ptrs)
        self._pointer = [p.kind == "int" and p.size == 8 for p in params]  # may take a Tensor's device pointer
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Kernel({self.name}, params={[p.ptx_type for p in self.params]})"

    def _where(self, p: KernelParam) -> str:
        return f"kernel {self.name} parameter {p.index} ({p.ptx_type}, {p.size} bytes)"

    def _value(self, p: KernelParam, a: Any, device: int | None) -> Any:
        if isinstance(a, _torch.Tensor):
            if p.size != 8 or p.kind != "int":
                raise TypeError(f"{self._where(p)}: got a Tensor, which is passed as an 8-byte device pointer")
            if device is None:
                return 0  # dry run (meta tensors have no storage)
            if not a.is_cuda or a.get_device() != device:
                raise TypeError(f"{self._where(p)}: tensor is on {a.device}, kernels run on cuda:{device}")
            return a.data_ptr()
        if isinstance(a, int):  # bool included
            if p.kind == "float":
                return float(a)
            if p.kind != "int":
                raise TypeError(f"{self._where(p)}: got {type(a).__name__}; pass bytes of length {p.size}")
            lo, hi = _INT_BOUNDS[p.size]
            if not lo <= a <= hi:
                raise TypeError(f"{self._where(p)}: int {a} does not fit in {p.size} bytes")
            return a & ((1 << (8 * p.size)) - 1)
        if isinstance(a, float):
            if p.kind != "float":
                raise TypeError(f"{self._where(p)}: got float {a!r} for an integer or pointer parameter")
            return a
        if isinstance(a, (bytes, bytearray)):
            if p.kind != "bytes" or len(a) != p.size:
                raise TypeError(f"{self._where(p)}: got {len(a)} bytes" + ("" if p.kind == "bytes" else " for a scalar"))
            return bytes(a)
        raise TypeError(f"{self._where(p)}: unsupported argument type {type(a).__name__} (use Tensor, int, float, bool, bytes)")

    def _values(self, args: Any, device: int | None) -> list[Any]:
        if not isinstance(args, (tuple, list)):
            raise TypeError(f"kernel {self.name}: args must be a tuple, got {type(args).__name__}")
        if len(args) != len(self.params):
            raise TypeError(f"kernel {self.name} takes {len(self.params)} parameters, got {len(args)} args")
        tensor, pointer = _torch.Tensor, self._pointer
        return [a.data_ptr() if ptr and type(a) is tensor and a.is_cuda and a.get_device() == device  # the common case
                else self._value(p, a, device) for p, a, ptr in zip(self.params, args, pointer)]

    def __call__(self, grid: Any, block: Any, args: tuple = (), shared_mem: int = 0) -> None:
        """Launch on ``torch.cuda.current_stream()`` (asynchronous, like any CUDA launch); inside
        :func:`kernels_suppressed` the launch is checked and counted but not made.

        Args:
            grid, block: an int or a tuple of up to 3 ints (missing dimensions are 1).
            args: one value a kernel parameter: Tensor (device pointer, 8 bytes), int (int8..int64 by
                the parameter's size; converted for a float parameter), float (float/double by
                size), bool, bytes (structs / ``__half``, exact size).
            shared_mem: dynamic shared memory (bytes); above 48 KiB the kernel's limit is raised.

        Raises:
            TypeError: an argument does not match its parameter (the message names the kernel and
                the parameter), or the argument count is wrong.
            ValueError: a bad grid / block / shared_mem.
            RuntimeError: no GPU (compile-only module), or the driver refused the launch.
        """
        global _launches
        _torch_mod()
        grid3 = _dims(grid, "grid", self.name)
        block3 = _dims(block, "block", self.name)
        smem = operator.index(shared_mem)
        if smem < 0:
            raise ValueError(f"kernel {self.name}: shared_mem must be >= 0, got {shared_mem}")
        mod = self._module
        if not mod.launchable:
            if not _config.dry_run:
                raise RuntimeError(f"no GPU: compile-only (kernel {self.name} was compiled for {mod.arch}, not launched)")
            self._values(args, None)
            with _lock:
                _launches += 1
            return
        driver = _driver()
        values = self._values(args, mod.device)
        if getattr(_tls, "device", None) != mod.device:  # the context is current per thread
            _context(mod.device)
            _tls.device = mod.device
        if smem > self._smem_set:
            attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            _check(driver.cuFuncSetAttribute(self._function, attr, smem), f"kernel {self.name}: shared_mem={smem}")
            self._smem_set = smem
        if _suppressed:  # kernels_suppressed(): counted, not run
            with _lock:
                _launches += 1
            return
        stream = _stream(_raw_stream(mod.device))
        for attempt in (0, 1):
            with self._lock:  # one argument buffer a kernel; the driver copies it during cuLaunchKernel
                self._fmt.pack_into(self._buf, 0, *values)
                (err,) = driver.cuLaunchKernel(self._function, *grid3, *block3, smem, stream, self._ptrs_addr, 0)
            if attempt or err not in _RETRY_LAUNCH:
                break
            _context(mod.device)  # something made another context current on this thread
        if err != _SUCCESS:
            _check((err,), f"launch of kernel {self.name} (grid={grid3}, block={block3}, shared_mem={smem})")
        with _lock:
            _launches += 1


class KernelModule:
    """The kernels of one compiled CUDA source; ``module.<name>`` is a :class:`Kernel`.

    Attributes:
        kernel_names: the ``__global__`` entries, in source order.
        arch: the compile target.
        device: the CUDA device ordinal it is loaded on, None for a compile-only module.
        launchable: False in compile-only mode.
        compile_ms: the NVRTC compile time of its program (ms; the first compile, not a cache hit).
    """

    def __init__(self, program: CompiledProgram, device: int | None):
        self._program = program
        self.arch = program.arch
        self.device = device
        self.launchable = device is not None
        self.compile_ms = program.compile_ms
        self.kernel_names: list[str] = list(program.kernels)
        self._kernels: dict[str, Kernel] = {}
        functions: dict[str, Any] = {}
        if device is not None:
            functions = self._load(program, device)
        for name, params in program.kernels.items():
            self._kernels[name] = Kernel(name, params, self, functions.get(name))

    @staticmethod
    def _load(program: CompiledProgram, device: int) -> dict[str, Any]:
        from cuda.bindings import driver

        with _lock:
            cached = _modules.get((program.key, device))
            if cached is not None:
                return cached[1]
            _context(device)
            module = _check(driver.cuModuleLoadData(program.cubin), "cuModuleLoadData")
            functions = {}
            for name, params in program.kernels.items():
                fn = _check(driver.cuModuleGetFunction(module, name.encode()), f"cuModuleGetFunction({name})")
                sizes = []
                while True:
                    err, _offset, size = driver.cuFuncGetParamInfo(fn, len(sizes))
                    if err != driver.CUresult.CUDA_SUCCESS:
                        break
                    sizes.append(int(size))
                if sizes != [p.size for p in params]:
                    raise CompileError(
                        f"kernel {name}: parameter sizes from cuFuncGetParamInfo {sizes} differ from PTX "
                        f"{[p.size for p in params]}",
                        program.arch,
                    )
                functions[name] = fn
            _modules[(program.key, device)] = (module, functions)
            return functions

    def _resolve(self, name: str) -> Kernel | None:
        k = self._kernels.get(name)
        if k is None:  # a C++-mangled kernel (forgot extern "C"): _Z<len><name>...
            prefix = f"_Z{len(name)}{name}"
            hits = [v for n, v in self._kernels.items() if n.startswith(prefix)]
            k = hits[0] if len(hits) == 1 else None
        return k

    def __getattr__(self, name: str) -> Kernel:
        if name.startswith("_"):
            raise AttributeError(name)
        k = self._resolve(name)
        if k is None:
            raise AttributeError(f"CUDA module has no kernel {name!r}; its kernels: {self.kernel_names}")
        return k

    def has_kernel(self, name: str) -> bool:
        """True when ``module.<name>`` resolves (exact, or a unique C++-mangled match)."""
        return self._resolve(name) is not None

    def __dir__(self) -> list[str]:
        return [*super().__dir__(), *self.kernel_names]

    def __repr__(self) -> str:
        where = f"cuda:{self.device}" if self.launchable else "compile-only"
        return f"KernelModule({self.arch}, {where}, kernels={self.kernel_names})"


def load_cuda(source: str) -> KernelModule:
    """Compile ``source`` with NVRTC (cached by content hash) and load it for launching.

    On a GPU: compiles a cubin for the current device's arch and loads it into torch's primary
    context (retained and made current after torch initialised CUDA).  Without one (or in
    compile-only mode): compiles for the configured arch (:data:`DEFAULT_ARCH`) only; the
    returned module's kernels raise ``RuntimeError("no GPU: compile-only")`` when called.

    Returns:
        A :class:`KernelModule`.
    Raises:
        TypeError: ``source`` is not a str.
        CompileError: NVRTC rejected the source (``.log`` has the NVRTC log), or it has no kernel.
        RuntimeError: the driver failed to load the image.
        Exception: whatever the configured ``source_check`` raises (the verifier's rule violation).
    """
    if _config.source_check is not None:
        _config.source_check(source)
    program = nvrtc.compile_cuda(source, target_arch())
    if _is_compile_only():
        return KernelModule(program, None)
    import torch

    return KernelModule(program, torch.cuda.current_device())
