"""NVRTC: the fast candidate format's compiler (CUDA C++ string -> cubin and PTX), cached by content hash.

A fast-format candidate writes its kernels as ``extern "C" __global__`` functions in a string and calls
``kernels = load_cuda(cuda_source)`` (:mod:`dice_ray.launch`, the format's run time: it loads what this module
compiles and launches it).  Compiling this way takes ~0.05 s a candidate, against ~53 s for KernelBench's /
DICE's ``torch.utils.cpp_extension.load_inline`` format (measured, see DESIGN.md), which decides how many
candidates an RL step can verify.

Built on cuda-python (``cuda.bindings.nvrtc``) and NVRTC; same idea as CuPy's ``RawModule``, without CuPy.  A
compile needs no GPU: the target is the caller's (:func:`dice_ray.launch.target_arch`: the device's, or
:data:`DEFAULT_ARCH` without one).

Measured (builtin suite, 56 kernels): NVRTC sm_90 cubin compile median 32 ms on the 2-core CPU machines, 52 ms
on the H200 host.

Process-wide state: a compile cache keyed by the SHA-256 of (source, arch, options, the standard headers) and
its counters (:func:`compile_stats`).  Nothing here imports torch or pydantic: it runs inside the verifier's
sandboxed worker.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "BASE_OPTIONS",
    "CompileError",
    "CompiledProgram",
    "DEFAULT_ARCH",
    "KernelParam",
    "STANDARD_HEADERS",
    "compile_cuda",
    "compile_stats",
    "parse_ptx_entries",
]

#: NVRTC target without a GPU; keep equal to ``VerifyConfig.arch``'s default (this module must not
#: import pydantic: it runs inside the verifier's sandboxed worker).
DEFAULT_ARCH = "sm_90"
#: Options every compile gets (the candidate cannot choose its own).  ``-DNDEBUG``: a release build, so
#: a device ``assert()`` compiles to nothing (NVRTC's built-in ``assert`` honours it, as ``<cassert>``
#: does).  A failed device assert is a trap, and a trap takes its process 1.1-2.0 s to report on an
#: H200 (an illegal address: ~0.15 s), all of it holding the verifier's GPU gate (docs/benchmarks.md).
BASE_OPTIONS: tuple[str, ...] = ("--std=c++17", "-DNDEBUG")
_CACHE_SIZE = 512


def _defines(**macros: str) -> str:
    """``#define`` lines, each guarded: CCCL's ``<cuda/std/...>`` headers define some of the same names."""
    return "".join(f"#ifndef {k}\n#define {k} {v}\n#endif\n" for k, v in macros.items())


# the same types as CCCL's <cuda/std/cstdint> under NVRTC (identical typedefs may be repeated in C++)
_INT_TYPES = """typedef signed char int8_t; typedef short int16_t; typedef int int32_t; typedef long long int64_t;
typedef unsigned char uint8_t; typedef unsigned short uint16_t; typedef unsigned int uint32_t;
typedef unsigned long long uint64_t; typedef long long intptr_t; typedef unsigned long long uintptr_t;
typedef long long intmax_t; typedef unsigned long long uintmax_t;
namespace std { using ::int8_t; using ::int16_t; using ::int32_t; using ::int64_t; using ::uint8_t;
using ::uint16_t; using ::uint32_t; using ::uint64_t; using ::intptr_t; using ::uintptr_t; }
""" + _defines(INT8_MAX="127", INT16_MAX="32767", INT32_MAX="2147483647", INT64_MAX="9223372036854775807LL",
               INT32_MIN="(-2147483647 - 1)", INT64_MIN="(-9223372036854775807LL - 1LL)", UINT8_MAX="255",
               UINT16_MAX="65535", UINT32_MAX="4294967295U", UINT64_MAX="18446744073709551615ULL")
_LIMITS = _defines(CHAR_BIT="8", SCHAR_MAX="127", SCHAR_MIN="(-128)", UCHAR_MAX="255", SHRT_MAX="32767",
                   SHRT_MIN="(-32768)", USHRT_MAX="65535", INT_MAX="2147483647", INT_MIN="(-2147483647 - 1)",
                   UINT_MAX="4294967295U", LLONG_MAX="9223372036854775807LL",
                   LLONG_MIN="(-9223372036854775807LL - 1LL)", ULLONG_MAX="18446744073709551615ULL")
_FLOATS = _defines(FLT_MAX="3.40282346638528859812e+38F", FLT_MIN="1.17549435082228750797e-38F",
                   FLT_EPSILON="1.1920928955078125e-07F", DBL_MAX="1.79769313486231570815e+308",
                   DBL_MIN="2.22507385850720138309e-308", DBL_EPSILON="2.2204460492503131e-16")
# NVRTC's own math functions (expf, tanhf, fmaxf, ...) need no header; these add the macros of <math.h>
# (CUDA's math_constants.h spells infinity and NaN the same way: device code only).
_MATH = _defines(INFINITY="__int_as_float(0x7f800000)", HUGE_VALF="__int_as_float(0x7f800000)",
                 NAN="__int_as_float(0x7fffffff)", M_PI="3.14159265358979323846", M_E="2.7182818284590452354",
                 M_SQRT2="1.41421356237309504880", M_LN2="0.69314718055994530942")
#: The C/C++ standard headers a kernel may include in the fast format, as NVRTC sees them. NVRTC has no
#: C library, so ``#include <cstdint>`` would otherwise fail to compile: each name maps to a small header
#: of the types and macros kernels use (fixed-width integers, limits, float limits, math macros);
#: ``<cassert>``, ``<cstddef>`` and ``<cstdio>`` are empty (``assert``, ``size_t`` and device ``printf`` are
#: NVRTC built-ins). CUDA's own headers (``cuda_fp16.h``, ``cuda_bf16.h``, ``cuda_runtime.h``, CCCL) come
#: from the toolkit's include folder where one is found.
STANDARD_HEADERS: dict[str, str] = {
    **dict.fromkeys(("cstdint", "stdint.h"), _INT_TYPES),
    **dict.fromkeys(("climits", "limits.h"), _LIMITS),
    **dict.fromkeys(("cfloat", "float.h"), _FLOATS),
    **dict.fromkeys(("cmath", "math.h"), _MATH),
    **dict.fromkeys(("cassert", "assert.h", "cstddef", "stddef.h", "cstdio", "stdio.h"), ""),
}
_HEADERS_DIGEST = hashlib.sha256(repr(sorted(STANDARD_HEADERS.items())).encode()).hexdigest()
# what nvrtcCreateProgram takes, encoded once (not on every compile)
_HEADER_NAMES = [name.encode() for name in STANDARD_HEADERS]
_HEADER_SOURCES = [text.encode() for text in STANDARD_HEADERS.values()]


class CompileError(RuntimeError):
    """NVRTC rejected a CUDA source.

    Attributes:
        log: the NVRTC program log (errors with line numbers of ``candidate.cu``, the source, as nvcc prints
            them).
        arch: the target (e.g. ``"sm_90"``).
        source: the CUDA source that failed, or None (the verifier finds it in the candidate's file to give
            the file's line numbers too).
    """

    def __init__(self, log: str, arch: str, source: str | None = None):
        self.log = log
        self.arch = arch
        self.source = source
        super().__init__(f"NVRTC compile for {arch} failed:\n{log.strip()}")

    def __reduce__(self):  # pickles with its own arguments (it crosses Ray and process boundaries)
        return type(self), (self.log, self.arch, self.source)


# PTX scalar type -> (bytes, kind); kind "int" | "float" | "bytes"
_PTX_TYPES: dict[str, tuple[int, str]] = {
    "u8": (1, "int"), "s8": (1, "int"), "b8": (1, "int"), "pred": (1, "int"),
    "u16": (2, "int"), "s16": (2, "int"), "b16": (2, "int"), "f16": (2, "bytes"), "bf16": (2, "bytes"),
    "u32": (4, "int"), "s32": (4, "int"), "b32": (4, "int"), "f32": (4, "float"),
    "u64": (8, "int"), "s64": (8, "int"), "b64": (8, "int"), "f64": (8, "float"),
}
_ENTRY_RE = re.compile(r"\.entry\s+([A-Za-z_$][\w$]*)\s*\((.*?)\)", re.S)
_PARAM_RE = re.compile(r"\.param\b([^,]*)")


@dataclass(frozen=True)
class KernelParam:
    """One kernel parameter as the compiled PTX declares it.

    Attributes:
        index: position in the kernel's signature.
        size: bytes (8 for pointers and ``long``/``double``, 4 for ``int``/``float``, ...).
        kind: ``"int"`` (integers and pointers), ``"float"`` (f32/f64) or ``"bytes"`` (structs,
            ``__half``: pass a ``bytes`` object of exactly ``size`` bytes).
        ptx_type: the PTX spelling, e.g. ``"u64"``, ``"f32"``, ``"b8[16]"``.
    """

    index: int
    size: int
    kind: str
    ptx_type: str


def _parse_params(body: str) -> tuple[KernelParam, ...]:
    params = []
    for i, m in enumerate(_PARAM_RE.finditer(body)):
        tokens = m.group(1).replace("\n", " ").split()
        array = re.search(r"\[(\d+)\]", m.group(1))
        scalar = next((t[1:] for t in tokens if t.startswith(".") and t[1:] in _PTX_TYPES), None)
        if scalar is None:
            raise CompileError(f"cannot read PTX parameter {i}: {m.group(1).strip()!r}", "?")
        size, kind = _PTX_TYPES[scalar]
        if array is not None:
            size, kind, spelled = size * int(array.group(1)), "bytes", f"{scalar}[{array.group(1)}]"
        else:
            spelled = scalar
        params.append(KernelParam(i, size, kind, spelled))
    return tuple(params)


def parse_ptx_entries(ptx: str) -> dict[str, tuple[KernelParam, ...]]:
    """Kernel entries (``.entry``) of a PTX module and their parameters, in source order.

    Raises:
        CompileError: a parameter declaration the parser does not know.
    """
    return {m.group(1): _parse_params(m.group(2)) for m in _ENTRY_RE.finditer(ptx)}


@dataclass(frozen=True)
class CompiledProgram:
    """An NVRTC compile result.

    Attributes:
        key: SHA-256 hex of (source, arch, options): the cache key.
        arch: the target (``"sm_90"``).
        cubin: the device image (loaded with ``cuModuleLoadData``).
        ptx: the PTX (kernel names and parameter types are read from it).
        kernels: ``name -> parameters`` for every ``__global__`` entry.
        compile_ms: wall time of the NVRTC compile (ms); 0.0 for a cache hit is not recorded here.
    """

    key: str
    arch: str
    cubin: bytes
    ptx: str
    kernels: dict[str, tuple[KernelParam, ...]]
    compile_ms: float


@dataclass
class _Stats:
    compiles: int = 0
    cache_hits: int = 0
    failures: int = 0
    compile_ms_total: float = 0.0


_lock = threading.RLock()
_compile_cache: OrderedDict[str, CompiledProgram | CompileError] = OrderedDict()
_stats = _Stats()


def _include_dirs() -> list[str]:
    """CUDA header folders for NVRTC (``cuda_fp16.h``, ``cuda_bf16.h``, CCCL), where found."""
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    try:  # pip wheels (nvidia-cuda-runtime / cuda-toolkit) put headers under site-packages/nvidia
        import nvidia  # type: ignore[import-not-found]

        for base in getattr(nvidia, "__path__", []):
            roots += [str(p) for p in Path(base).glob("*") if (p / "include" / "cuda_fp16.h").exists()]
    except ImportError:
        pass
    found: list[str] = []
    for root in roots:
        if not root:
            continue
        inc = Path(root) / "include"
        if (inc / "cuda_fp16.h").exists():
            found.append(str(inc))
            if (inc / "cccl").is_dir():
                found.append(str(inc / "cccl"))
            break
    return found


_INCLUDES: list[str] | None = None


def compile_cuda(source: str, arch: str | None = None, options: tuple[str, ...] = ()) -> CompiledProgram:
    """Compile CUDA C++ with NVRTC to a cubin (and PTX) for ``arch``, cached by content hash.

    Args:
        source: CUDA C++ with ``extern "C" __global__`` kernels; no torch headers (NVRTC has no
            host compiler); the C/C++ standard headers of :data:`STANDARD_HEADERS` are provided, and
            ``cuda_fp16.h``/``cuda_bf16.h``/CCCL come from the CUDA include folder when one is found.
        arch: ``"sm_90"`` etc.; None: :data:`DEFAULT_ARCH` (a GPU process passes its device's,
            :func:`dice_ray.launch.target_arch`).
        options: extra NVRTC options (the verifier passes none).

    Returns:
        The :class:`CompiledProgram` (the same object for a cache hit).
    Raises:
        TypeError: ``source`` is not a str.
        CompileError: NVRTC rejected the source (carries the NVRTC log); failures are cached too.
    """
    global _INCLUDES
    if not isinstance(source, str):
        raise TypeError(f"load_cuda: source must be a str, got {type(source).__name__}")
    arch = arch or DEFAULT_ARCH
    opts = (f"--gpu-architecture={arch}", *BASE_OPTIONS, *options)
    key = hashlib.sha256("\0".join((source, *opts, _HEADERS_DIGEST)).encode()).hexdigest()
    with _lock:
        hit = _compile_cache.get(key)
        if hit is not None:
            _compile_cache.move_to_end(key)
            _stats.cache_hits += 1
            if isinstance(hit, CompileError):
                raise hit
            return hit
        if _INCLUDES is None:
            _INCLUDES = _include_dirs()
    from cuda.bindings import nvrtc

    t0 = time.perf_counter()
    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), b"candidate.cu", len(_HEADER_NAMES), _HEADER_SOURCES,
                                         _HEADER_NAMES)
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise CompileError(f"nvrtcCreateProgram: {err}", arch)
    try:
        all_opts = [o.encode() for o in (*opts, *(f"-I{d}" for d in _INCLUDES))]
        (cerr,) = nvrtc.nvrtcCompileProgram(prog, len(all_opts), all_opts)
        _, log_size = nvrtc.nvrtcGetProgramLogSize(prog)
        # bytearray, never a bytes object: NVRTC writes into the buffer, and a one-byte bytes object
        # is CPython's shared singleton (a NUL written into it corrupts that byte process-wide)
        log_buf = bytearray(log_size)
        nvrtc.nvrtcGetProgramLog(prog, log_buf)
        log = bytes(log_buf).rstrip(b"\0").decode(errors="replace")
        if cerr != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            exc = CompileError(log or str(cerr), arch, source)
            with _lock:
                _stats.failures += 1
                _remember(key, exc)
            raise exc
        _, n = nvrtc.nvrtcGetCUBINSize(prog)
        cubin_buf = bytearray(n)
        nvrtc.nvrtcGetCUBIN(prog, cubin_buf)
        cubin = bytes(cubin_buf)
        _, n = nvrtc.nvrtcGetPTXSize(prog)
        ptx_buf = bytearray(n)
        nvrtc.nvrtcGetPTX(prog, ptx_buf)
        ptx = bytes(ptx_buf).rstrip(b"\0").decode(errors="replace")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    ms = (time.perf_counter() - t0) * 1e3
    try:
        kernels = parse_ptx_entries(ptx)
    except CompileError as e:
        raise CompileError(e.log, arch, source) from None
    if not kernels:
        exc = CompileError('no __global__ kernel in the source (kernels must be extern "C" __global__)', arch, source)
        with _lock:
            _remember(key, exc)
        raise exc
    program = CompiledProgram(key, arch, cubin, ptx, kernels, ms)
    with _lock:
        _stats.compiles += 1
        _stats.compile_ms_total += ms
        _remember(key, program)
    return program


def _remember(key: str, value: CompiledProgram | CompileError) -> None:
    _compile_cache[key] = value
    while len(_compile_cache) > _CACHE_SIZE:
        _compile_cache.popitem(last=False)


def compile_stats() -> dict[str, float]:
    """Counters of this process: ``compiles``, ``cache_hits``, ``failures``, ``compile_ms_total`` (ms)."""
    with _lock:
        return dict(vars(_stats))

