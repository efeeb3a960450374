"""How one load_inline extension is compiled: launch counters, the generated files, the light
torch headers, the toolchain, and one compiler process under hard limits.

:class:`dice_ray.verify.inline_build.InlineBuilder` (the pool and its cache) puts these together;
nothing here caches or runs in parallel.

* Launch counters (:func:`instrument_cuda`, tree-sitter-cuda): every ``__global__`` body starts
  with a one-thread ``atomicAdd`` on a ``__device__`` counter (read with ``cudaMemcpyFromSymbol``:
  kernels that really started), and every host launch (``k<<<...>>>(...)``, ``cudaLaunchKernel``...)
  is wrapped so an accepted launch (``cudaPeekAtLastError() == cudaSuccess``) bumps a host counter,
  which costs no CUDA call to read (so the harness may read it inside a timed window).  A module
  with a launch that cannot be wrapped (in a ``#define``, device-side, ``cuLaunchKernel``) is
  counted by its device counter (``counting == "device"``: a synchronising read, measured ~4.5 us a
  call inside the timed window on the H200 machine).
* The kernel switch: after the counter, every ``__global__`` body returns at once while the
  ``__constant__`` flag ``dice_ray_skip_kernels`` is set (``_dice_ray_skip_kernels(1)``, bound like the
  counter readers; :func:`dice_ray.verify.inline.kernels_suppressed`): launches are counted, no
  kernel work happens.  The verifier's ablation of the candidate's kernels (rule ``kernel-not-used``).
* The files: ``main.cpp`` (:func:`main_file`: ``cpp_sources`` + pybind11 bindings of
  ``functions`` + the counter readers) and ``cuda.cu`` (:func:`cuda_file`: the instrumented CUDA
  sources between the counter prefix and suffix); ``#line`` directives keep the candidate's line
  numbers in compiler messages, and the files on disk are named ``inline_build.*`` so a compiler
  never echoes generated lines as the candidate's.
* The light headers (:func:`write_headers`): ``#include <torch/extension.h>`` (or ``torch/types.h``
  / ``torch/all.h`` / ``torch/torch.h``) becomes ``dice_ray_torch_lite.h`` (``ATen/core/Tensor.h``,
  the allocation ops, ``Dispatch.h``, ``TORCH_CHECK``, the ``torch::`` dtype names: the host API the
  rules allow), ``ATen/cuda/CUDAContext.h`` becomes ``dice_ray_cuda_lite.h`` (streams, guards,
  device properties, without the cuBLAS / cuSPARSE / cuSOLVER headers, which the CPU machines'
  CUDA toolkit lacks).  nvcc errors naming a missing ``torch``/``at``/``c10`` member
  (:data:`LITE_MISS`) make the builder compile again with the original headers.  Measured on the
  2-core CPU machines (DICE record 0): nvcc 51 s with ``torch/extension.h``, 24 s with
  ``torch/types.h``, ~11 s lite.
* :func:`run_limited`: a compiler in its own process group with a wall-clock limit (the group is
  killed) and ``RLIMIT_CPU`` / ``RLIMIT_AS`` / ``RLIMIT_FSIZE`` set by a tiny exec wrapper (never
  ``preexec_fn``, which is unsafe from threads): a compile bomb ends as ``timeout`` or ``limit``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dice_ray.verify.inline import InlineSpec

__all__ = [
    "COUNTER_PREFIX",
    "COUNTER_SUFFIX",
    "INTERNAL_ERROR",
    "Instrumented",
    "LITE_MISS",
    "Toolchain",
    "cuda_command",
    "cuda_file",
    "detect_toolchain",
    "instrument_cuda",
    "link_command",
    "main_command",
    "main_file",
    "main_flags",
    "module_name",
    "rename_init_command",
    "run_limited",
    "write_headers",
]

#: bump when the generated files or flags change in a way the toolchain key does not see
COMPILE_VERSION = 6
MAX_LOG = 20_000


def sha(*parts: Any) -> str:
    """SHA-256 hex of a JSON encoding of ``parts``."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


# ----------------------------------------------------------------------------------------------
# Launch counters (tree-sitter-cuda)
# ----------------------------------------------------------------------------------------------


#: Runtime-API launch functions wrapped by the host counter (their cudaError_t result is kept).
LAUNCH_APIS = frozenset({"cudaLaunchKernel", "cudaLaunchCooperativeKernel", "cudaLaunchKernelExC",
                         "cudaLaunchKernelEx"})
COUNTER_PREFIX = """#include <cuda_runtime.h>
__device__ unsigned long long dice_ray_kernel_runs = 0;
__constant__ int dice_ray_skip_kernels = 0;
static unsigned long long dice_ray_launches = 0;
static inline void dice_ray_launch_done() { if (cudaPeekAtLastError() == cudaSuccess) ++dice_ray_launches; }
static inline cudaError_t dice_ray_note_launch(cudaError_t e) { if (e == cudaSuccess) ++dice_ray_launches; return e; }
"""
COUNTER_SUFFIX = """
extern "C" unsigned long long dice_ray_launches_read() { return dice_ray_launches; }
extern "C" unsigned long long dice_ray_kernel_runs_read() {
  unsigned long long v = 0;
  if (cudaMemcpyFromSymbol(&v, dice_ray_kernel_runs, sizeof(v)) != cudaSuccess) return ~0ULL;
  return v;
}
extern "C" int dice_ray_skip_kernels_set(int on) {
  (void)cudaGetLastError();  // a launch refused while skipping must not stop dice_ray_launch_done counting later
  cudaError_t e = cudaDeviceSynchronize();
  if (e == cudaSuccess) e = cudaMemcpyToSymbol(dice_ray_skip_kernels, &on, sizeof(on));
  if (e == cudaSuccess) e = cudaDeviceSynchronize();
  return (int)e;
}
"""
#: the first line of every ``__global__`` body: the device counter (one thread), then the kernel switch
_KERNEL_ENTRY = ("if ((threadIdx.x | threadIdx.y | threadIdx.z | blockIdx.x | blockIdx.y | blockIdx.z) == 0) "
                 "atomicAdd(&::dice_ray_kernel_runs, 1ULL); if (::dice_ray_skip_kernels) return; ")


@dataclass(frozen=True)
class Instrumented:
    """A CUDA source with launch counters (see the module docstring).

    Attributes:
        source: the instrumented text; compiler messages keep the candidate's line numbers
            (a ``#line`` directive follows each kernel counter, launch wrappers stay on their line).
        kernels: names of the ``__global__`` functions that got the device counter.
        launch_sites: host launches wrapped with the host counter.
        counting: ``"host"`` when every launch site was wrapped, else ``"device"``.
        unwrapped: why some launch could not be wrapped (empty with ``counting == "host"``).
    """

    source: str
    kernels: tuple[str, ...]
    launch_sites: int
    counting: str
    unwrapped: tuple[str, ...] = ()


def instrument_cuda(source: str) -> Instrumented:
    """Add the launch counters and the kernel switch to a CUDA source (``cuda.cu`` before
    :func:`cuda_file` puts the counter prefix and suffix around it).

    Raises:
        ImportError: tree-sitter / tree-sitter-cuda are not installed.
    """
    from dice_ray.verify.inline_rules import function_qualifiers, node_text, parse_cuda

    data = source.encode()
    tree = parse_cuda(data)
    edits: list[tuple[int, int, bytes]] = []  # (start, end, replacement)
    kernels: list[str] = []
    unwrapped: list[str] = []
    sites = 0
    stack = [(tree.root_node, "host")]
    while stack:
        node, where = stack.pop()
        if node.type == "function_definition":
            quals = function_qualifiers(node)
            where = "global" if "__global__" in quals else "device" if "__device__" in quals and "__host__" not in quals else (
                "both" if "__device__" in quals else "host")
            body = node.child_by_field_name("body")
            if where == "global" and body is not None and body.child_count and body.children[0].type == "{":
                decl = node.child_by_field_name("declarator")
                ident = _declarator_name(decl)
                kernels.append(ident or "?")
                brace = body.children[0]
                line = brace.start_point[0] + 1  # the counter gets its own line; #line restores the numbering
                edits.append((brace.end_byte, brace.end_byte, f'\n{_KERNEL_ENTRY}\n#line {line} "cuda.cu"\n'.encode()))
        elif node.type == "call_expression":
            fn = node.child_by_field_name("function")
            is_kernel = any(c.type == "kernel_call_syntax" for c in node.children)
            api = fn is not None and _callee_name(fn) in LAUNCH_APIS
            if is_kernel or api:
                if where != "host":
                    unwrapped.append(f"launch in {where} code at line {node.start_point[0] + 1}")
                elif is_kernel:
                    sites += 1
                    edits.append((node.start_byte, node.start_byte, b"("))
                    edits.append((node.end_byte, node.end_byte, b", ::dice_ray_launch_done())"))
                else:
                    sites += 1
                    edits.append((node.start_byte, node.start_byte, b"::dice_ray_note_launch("))
                    edits.append((node.end_byte, node.end_byte, b")"))
        elif node.type == "preproc_arg":
            text = node_text(node, data)
            if "<<<" in text or "cudaLaunch" in text or "cuLaunch" in text:
                unwrapped.append(f"launch inside a macro at line {node.start_point[0] + 1}")
        elif node.type == "identifier" and node_text(node, data) in ("cuLaunchKernel", "cuLaunchKernelEx",
                                                                    "cuLaunchCooperativeKernel"):
            unwrapped.append(f"driver-API launch at line {node.start_point[0] + 1}")
        stack.extend((c, where) for c in reversed(node.children))
    out = bytearray(data)
    for start, end, repl in sorted(edits, key=lambda e: (e[0], e[1]), reverse=True):
        out[start:end] = repl
    return Instrumented(out.decode(), tuple(kernels), sites, "device" if unwrapped else "host", tuple(unwrapped))


def _declarator_name(decl: Any) -> str | None:
    while decl is not None:
        if decl.type in ("identifier", "field_identifier", "qualified_identifier", "destructor_name", "operator_name"):
            return decl.text.decode()
        decl = decl.child_by_field_name("declarator")
    return None


def _callee_name(fn: Any) -> str:
    if fn.type == "template_function":
        fn = fn.child_by_field_name("name") or fn
    if fn.type == "qualified_identifier":
        return fn.text.decode().split("::")[-1]
    return fn.text.decode() if fn.type == "identifier" else ""


# ----------------------------------------------------------------------------------------------
# Light headers and the toolchain
# ----------------------------------------------------------------------------------------------

#: torch's own nvcc flags for extensions (``torch.utils.cpp_extension.COMMON_NVCC_FLAGS``):
#: candidates written for load_inline compile with the same half/bfloat16 operator settings
COMMON_NVCC_FLAGS = ("-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
                     "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__", "--expt-relaxed-constexpr")
LITE_HEADER = "dice_ray_torch_lite.h"
LITE_TEXT = """// dice-ray: the part of <torch/extension.h> a load_inline candidate's CUDA file may use
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/ones_like.h>
#include <ATen/ops/full.h>
#include <ATen/ops/full_like.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/scalar_tensor.h>
#include <c10/core/TensorOptions.h>
#include <c10/util/Exception.h>
#include <c10/util/irange.h>
#include <optional>
#include <vector>
#include <cstdint>
#include <cmath>
namespace torch {
using namespace at;  // NOLINT
using std::nullopt;
using std::optional;
using Dtype = at::ScalarType;
constexpr auto kUInt8 = at::kByte; constexpr auto kInt8 = at::kChar; constexpr auto kInt16 = at::kShort;
constexpr auto kInt32 = at::kInt; constexpr auto kInt64 = at::kLong; constexpr auto kFloat16 = at::kHalf;
constexpr auto kFloat32 = at::kFloat; constexpr auto kFloat64 = at::kDouble; constexpr auto kU8 = kUInt8;
constexpr auto kI8 = kInt8; constexpr auto kI16 = kInt16; constexpr auto kI32 = kInt32; constexpr auto kI64 = kInt64;
constexpr auto kF16 = kFloat16; constexpr auto kF32 = kFloat32; constexpr auto kF64 = kFloat64;
}  // namespace torch
"""
CUDA_LITE_HEADER = "dice_ray_cuda_lite.h"
CUDA_LITE_TEXT = """// dice-ray: ATen/cuda/CUDAContext.h without cuBLAS / cuSPARSE / cuSOLVER headers (streams, guards,
// device properties, AT_CUDA_CHECK): the vendor-library parts are refused by the rules anyway
#pragma once
#include <cstdint>
#include <cuda_runtime_api.h>
#include <c10/core/Allocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/macros/Export.h>
namespace at::cuda {
inline int64_t getNumGPUs() { return c10::cuda::device_count(); }
inline bool is_available() { return c10::cuda::device_count() > 0; }
TORCH_CUDA_CPP_API cudaDeviceProp* getCurrentDeviceProperties();
TORCH_CUDA_CPP_API int warp_size();
TORCH_CUDA_CPP_API cudaDeviceProp* getDeviceProperties(c10::DeviceIndex device);
TORCH_CUDA_CPP_API c10::Allocator* getCUDADeviceAllocator();
}  // namespace at::cuda
#ifndef AT_CUDA_CHECK
#define AT_CUDA_CHECK(EXPR) C10_CUDA_CHECK(EXPR)
#endif
"""
CMAKE_MACROS = "c10/cuda/impl/cuda_cmake_macros.h"
CMAKE_MACROS_TEXT = "#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n"
#: includes the lite build replaces: (pattern, lite header)
LITE_SUBSTITUTIONS = (
    (re.compile(r"^[ \t]*#[ \t]*include[ \t]*[<\"]torch/(extension|types|all|torch)\.h[>\"]", re.M), LITE_HEADER),
    (re.compile(r"^[ \t]*#[ \t]*include[ \t]*[<\"]ATen/cuda/(CUDAContext|CUDAContextLight|Exceptions)\.h[>\"]", re.M),
     CUDA_LITE_HEADER),
)
#: nvcc errors meaning the lite header lacks something the full torch headers have
LITE_MISS = re.compile(r'(namespace|class) "(::)?(torch|at|c10)[\w:]*" has no member|identifier "(torch|at|c10)::'
                        r'|identifier "(AT|TORCH|C10)_\w+" is undefined|name followed by "::" must be a class or '
                        r'namespace name|incomplete type .*(at|torch)::')
LIMIT_WRAPPER = (
    "import os,resource,sys\n"
    "c,a,f=(int(x) for x in sys.argv[1:4])\n"
    "c and resource.setrlimit(resource.RLIMIT_CPU,(c,c+5))\n"
    "a and resource.setrlimit(resource.RLIMIT_AS,(a,a))\n"
    "f and resource.setrlimit(resource.RLIMIT_FSIZE,(f,f))\n"
    "resource.setrlimit(resource.RLIMIT_CORE,(0,0))\n"
    "os.execvp(sys.argv[4],sys.argv[4:])\n"
)


def clip(text: str, limit: int = MAX_LOG) -> str:
    """``text`` cut to ``limit`` characters (its head and tail kept)."""
    if len(text) <= limit:
        return text
    return text[: limit // 2] + f"\n...[{len(text) - limit} characters cut]...\n" + text[-limit // 2:]


@dataclass(frozen=True)
class Toolchain:
    """The compilers and folders of this machine's torch (``torch.utils.cpp_extension``'s include
    and library paths); ``key`` hashes everything that changes a build's output (compiler versions,
    torch version and headers, the Python ABI, the build options, the generated templates)."""

    nvcc: str
    cxx: str
    cuda_home: str
    torch_includes: tuple[str, ...]
    python_include: str
    lib_dirs: tuple[str, ...]
    std: str
    abi: int
    key: str


def detect_toolchain(host_opt: str, lite: bool, pch: bool) -> Toolchain:
    """Find nvcc (``$CUDA_HOME``, torch's ``CUDA_HOME``, ``/usr/local/cuda``, ``PATH``), g++ (``$CXX``),
    torch's include and library folders, its C++ standard and ABI; ~0.1 s (two ``--version`` runs)."""
    import torch
    import torch.utils.cpp_extension as cpp_ext

    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or getattr(cpp_ext, "CUDA_HOME", None)
    if not cuda_home:
        which = shutil.which("nvcc")
        cuda_home = "/usr/local/cuda" if os.path.isdir("/usr/local/cuda") or not which else str(
            Path(os.path.realpath(which)).parents[1])
    nvcc = os.path.join(cuda_home, "bin", "nvcc")
    if not os.path.exists(nvcc):
        nvcc = shutil.which("nvcc") or nvcc
    cxx = os.environ.get("CXX") or shutil.which("g++") or "c++"
    torch_includes = tuple(cpp_ext.include_paths("cpu"))
    python_include = sysconfig.get_path("include", scheme="posix_prefix")
    lib_dirs = tuple(cpp_ext.library_paths("cpu")) + tuple(
        d for d in (os.path.join(cuda_home, "lib64"), os.path.join(cuda_home, "lib")) if os.path.isdir(d))
    std = "c++20" if "-std=c++20" in Path(cpp_ext.__file__).read_text() else "c++17"
    abi = int(torch.compiled_with_cxx11_abi())

    def version(cmd: str) -> str:
        try:
            return subprocess.run([cmd, "--version"], capture_output=True, text=True, timeout=60).stdout.strip()
        except (OSError, subprocess.SubprocessError) as e:
            return f"unavailable: {e}"

    templates = (LITE_TEXT, CUDA_LITE_TEXT, CMAKE_MACROS_TEXT, COUNTER_PREFIX, COUNTER_SUFFIX, COMMON_NVCC_FLAGS,
                 [p.pattern for p, _ in LITE_SUBSTITUTIONS])
    key = sha(COMPILE_VERSION, version(nvcc), version(cxx), torch.__version__, torch_includes, python_include,
               sysconfig.get_config_var("EXT_SUFFIX"), std, abi, host_opt, lite, pch, templates)[:16]
    return Toolchain(nvcc, cxx, cuda_home, torch_includes, python_include, lib_dirs, std, abi, key)


# ----------------------------------------------------------------------------------------------
# The generated files and the command lines
# ----------------------------------------------------------------------------------------------


def main_file(spec: InlineSpec, modname: str, has_cuda: bool) -> str:
    """``main.cpp``: as torch's load_inline writes it (``torch/extension.h`` unless
    ``no_implicit_headers``, then ``cpp_sources``, then ``m.def`` of every function), plus the
    launch counter readers (``_dice_ray_launches``, ``_dice_ray_kernel_runs``) and the kernel switch
    (``_dice_ray_skip_kernels(on)``: returns a ``cudaError_t``, 0 when set) when there is CUDA."""
    lines = [] if spec.no_implicit_headers else ["#include <torch/extension.h>"]
    lines += [f"#define TORCH_EXTENSION_NAME {modname}", '#line 1 "main.cpp"', spec.cpp_source, "",
              '#line 1 "dice_ray_bindings.cpp"']
    if has_cuda:
        lines += ['extern "C" unsigned long long dice_ray_launches_read();',
                  'extern "C" unsigned long long dice_ray_kernel_runs_read();',
                  'extern "C" int dice_ray_skip_kernels_set(int on);']
    lines.append(f"PYBIND11_MODULE({modname}, m) {{")
    lines += [f'  m.def("{f}", &{f}, "{f}");' for f in spec.functions]
    if has_cuda:
        lines += ['  m.def("_dice_ray_launches", &dice_ray_launches_read);',
                  '  m.def("_dice_ray_kernel_runs", &dice_ray_kernel_runs_read);',
                  '  m.def("_dice_ray_skip_kernels", &dice_ray_skip_kernels_set);']
    lines.append("}")
    return "\n".join(lines) + "\n"


def cuda_file(spec: InlineSpec, instrumented: str, lite: bool) -> str:
    """``cuda.cu``: counter prefix, torch's implicit includes (lite or not), the instrumented
    source (its includes of the full torch headers swapped for the lite ones when ``lite``), the
    counter suffix."""
    source = instrumented
    if lite:
        for pattern, header in LITE_SUBSTITUTIONS:
            source = pattern.sub(f"#include <{header}>", source)
    implicit = "" if spec.no_implicit_headers else (
        (f"#include <{LITE_HEADER}>\n" if lite else "#include <torch/types.h>\n")
        + "#include <cuda.h>\n#include <cuda_runtime.h>\n")
    return f'{COUNTER_PREFIX}{implicit}#line 1 "cuda.cu"\n{source}\n#line 1 "dice_ray_counters.cu"\n{COUNTER_SUFFIX}'


#: an optimisation flag of the host compiler (``-O``, ``-O0`` .. ``-O3``, ``-Os``)
_HOST_OPT_FLAG = re.compile(r"^-O[0-3s]?$")
#: a compiler that crashed rather than refused the source (g++ 12 on a precompiled header used at another ``-O``
#: level: a segmentation fault in its IPA pass, measured): not the candidate's fault, never cached
INTERNAL_ERROR = re.compile(r"internal compiler error|died due to signal|terminated program|Segmentation fault")


def main_flags(extra: tuple[str, ...]) -> tuple[str, ...]:
    """``extra_cflags`` as ``main.cpp``'s compile takes them: without ``-O`` flags.  ``main.cpp`` holds the
    bindings and the host glue of ``cpp_sources`` (the kernels are ``cuda.cu``'s, always ``-O3`` on the device):
    it is compiled at the builder's ``host_opt``, the precompiled header's level, as g++ 12 crashes (an internal
    compiler error) on a precompiled header used at another ``-O`` level."""
    return tuple(f for f in extra if not _HOST_OPT_FLAG.match(f))


def main_command(tc: Toolchain, host_opt: str, extra: tuple[str, ...], pch: Path | None = None,
                 source: str = "inline_build.cpp", out: str = "main.o", include_dir: Path | None = None) -> list[str]:
    """g++ for ``main.cpp`` (or, with ``source`` the header and ``out`` the ``.gch``, for the
    precompiled header: the flags must be the same); ``extra`` is ``extra_cflags``, less its ``-O`` flags
    (:func:`main_flags`).  The CUDA toolkit's include folder is on the path, as in torch's build of an extension
    with CUDA sources, and ``include_dir`` (:func:`write_headers`' folder): ``cpp_sources`` may include
    ``<cuda_runtime.h>`` or ``<c10/cuda/CUDAStream.h>``."""
    cmd = [tc.cxx, f"-std={tc.std}", "-fPIC", host_opt, "-DTORCH_API_INCLUDE_EXTENSION_H",
           f"-D_GLIBCXX_USE_CXX11_ABI={tc.abi}"]
    if include_dir is not None:  # the headers a CPU-only torch lacks (write_headers)
        cmd += ["-I", str(include_dir)]
    cuda_include = os.path.join(tc.cuda_home, "include")  # torch's load_inline gives it to main.cpp too
    for inc in (*tc.torch_includes, tc.python_include, *([cuda_include] if os.path.isdir(cuda_include) else [])):
        cmd += ["-isystem", inc]
    if pch is not None:
        cmd += ["-include", str(pch), "-Winvalid-pch"]
    if source.endswith(".h"):
        return [*cmd, "-x", "c++-header", source, "-o", out]
    return [*cmd, *main_flags(extra), "-c", source, "-o", out]


def cuda_command(tc: Toolchain, arch: str, host_opt: str, include_dir: Path, name: str,
                 extra: tuple[str, ...]) -> list[str]:
    """nvcc for ``cuda.cu`` with torch's extension flags (``COMMON_NVCC_FLAGS``), one ``arch``, as a
    release build (``-DNDEBUG``: device ``assert()`` compiles to nothing, as in the fast format,
    :data:`dice_ray.verify.candidate.nvrtc.BASE_OPTIONS`)."""
    cmd = [tc.nvcc, f"-std={tc.std}", f"-gencode=arch=compute_{arch[3:]},code={arch}", *COMMON_NVCC_FLAGS, "-DNDEBUG",
           "-Xcompiler", "-fPIC", "-Xcompiler", host_opt, f"-D_GLIBCXX_USE_CXX11_ABI={tc.abi}",
           f"-DTORCH_EXTENSION_NAME={name}", "-I", str(include_dir)]
    for inc in (*tc.torch_includes, tc.python_include):
        cmd += ["-isystem", inc]
    return [*cmd, *extra, "-c", "inline_build.cu", "-o", "cuda.o"]


def module_name(key: str) -> str:
    """The Python module name of a build: ``dice_<first 20 hex digits of its content key>`` (main.o's,
    shared by the specs with the same ``cpp_sources``, or a linked ``.so``'s own)."""
    return f"dice_{key[:20]}"


def rename_init_command(main_obj: str, out: str, shared: str, own: str) -> list[str]:
    """objcopy of ``main_obj`` to ``out`` with its ``PyInit_<shared>`` renamed ``PyInit_<own>``: one process
    imports a module name once (pybind11 3's multi-phase init, measured: a second ``.so`` of the same
    name gave back the first module), so each linked extension needs a name of its own."""
    return ["objcopy", f"--redefine-sym=PyInit_{shared}=PyInit_{own}", main_obj, out]


def link_command(tc: Toolchain, objects: tuple[str, ...], out: str, cuda: bool) -> list[str]:
    """g++ -shared against torch's (and CUDA's) libraries, as torch's load_inline links."""
    cmd = [tc.cxx, "-shared", *objects, "-o", out]
    for d in tc.lib_dirs:
        cmd += [f"-L{d}", f"-Wl,-rpath,{d}"]
    libs = ["-lc10", "-lc10_cuda", "-ltorch_cpu", "-ltorch_cuda", "-ltorch", "-ltorch_python", "-lcudart"] if cuda \
        else ["-lc10", "-ltorch_cpu", "-ltorch", "-ltorch_python"]
    return cmd + libs


def write_headers(include_dir: Path, tc: Toolchain) -> None:
    """Write the lite headers (and, for a CPU-only torch, c10/cuda's missing generated header)."""
    headers = [(LITE_HEADER, LITE_TEXT), (CUDA_LITE_HEADER, CUDA_LITE_TEXT)]
    if not any(os.path.exists(os.path.join(d, CMAKE_MACROS)) for d in tc.torch_includes):
        headers.append((CMAKE_MACROS, CMAKE_MACROS_TEXT))
    for name, text in headers:
        path = include_dir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_text() != text:
            tmp = path.with_name(f".{path.name}.{os.getpid()}")
            tmp.write_text(text)
            os.replace(tmp, path)


# ----------------------------------------------------------------------------------------------
# A compiler process under limits
# ----------------------------------------------------------------------------------------------


def run_limited(cmd: list[str], cwd: Path, *, timeout_s: float, cpu_s: int, memory_bytes: int,
                file_bytes: int) -> tuple[str, str, float]:
    """Run ``cmd`` in ``cwd`` (its own process group, a minimal environment, output to
    ``cwd/log.txt``) under a wall-clock limit and rlimits.

    Returns:
        ``(kind, log, seconds)``: kind ``"ok"``, ``"compile_error"`` (non-zero exit), ``"timeout"``
        (wall clock: the group was killed) or ``"limit"`` (CPU time, file size or memory); the
        log clipped to :data:`MAX_LOG` characters, with a last line saying which limit.
    """
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(cwd), "TMPDIR": str(cwd),
           "LANG": "C", "LC_ALL": "C"}
    if shutil.which(cmd[0], path=env["PATH"]) is None:
        return "compile_error", (f"compiler not found: {cmd[0]} (the load_inline format needs a CUDA toolkit's nvcc and "
                                 "g++: set CUDA_HOME or put nvcc on PATH)"), 0.0
    log = cwd / "log.txt"
    t0 = time.perf_counter()
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-S", "-E", "-c", LIMIT_WRAPPER, str(cpu_s), str(memory_bytes),
                                 str(file_bytes), *cmd], cwd=cwd, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
        timed_out = False
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            rc = proc.wait()
    try:  # the group may still hold children (cicc, cc1plus) after nvcc died: end them
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if timed_out:  # a verifier that is a child subreaper (dice_ray.verify.zygote) inherits the orphans: reap
        reap_until = time.monotonic() + 2.0
        while time.monotonic() < reap_until:
            try:
                if os.waitpid(-proc.pid, os.WNOHANG)[0] == 0:
                    time.sleep(0.02)
            except ChildProcessError:
                break
    seconds = time.perf_counter() - t0
    with open(log, "rb") as f:
        text = clip(f.read(MAX_LOG * 4).decode(errors="replace"))
    if timed_out:
        return "timeout", f"{text}\n[killed: the compiler ran past its {timeout_s:g} s wall-clock limit]", seconds
    if rc == 0:
        return "ok", text, seconds
    sig = -rc if rc < 0 else (rc - 128 if rc > 128 else 0)
    if sig in (signal.SIGXCPU, signal.SIGKILL):
        return "limit", (f"{text}\n[killed by signal {signal.Signals(sig).name}: the compiler's CPU time limit "
                         f"({cpu_s} s) or memory]"), seconds
    if sig == signal.SIGXFSZ:
        return "limit", f"{text}\n[killed: the compiler's file size limit ({file_bytes // 2**20} MiB)]", seconds
    lowered = text.lower()
    if any(w in lowered for w in ("out of memory", "virtual memory exhausted", "cannot allocate memory",
                                  "std::bad_alloc", "memory allocation failure")):
        return "limit", f"{text}\n[the compiler ran out of its memory limit ({memory_bytes / 2**30:g} GiB)]", seconds
    return "compile_error", text, seconds
