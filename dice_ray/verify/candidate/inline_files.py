"""The files of a load_inline build: ``main.cpp``, ``cuda.cu`` and the light torch headers.

* ``main.cpp`` (:func:`main_file`: ``cpp_sources`` + pybind11 bindings of ``functions`` + the counter readers)
  and ``cuda.cu`` (:func:`cuda_file`: the instrumented CUDA sources between the counter prefix and suffix,
  :mod:`dice_ray.verify.candidate.inline_counters`); ``#line`` directives keep the candidate's line numbers in
  compiler messages, and the files on disk are named ``inline_build.*`` so a compiler never echoes generated
  lines as the candidate's.
* The light headers (:func:`write_headers`): ``#include <torch/extension.h>`` (or ``torch/types.h`` /
  ``torch/all.h`` / ``torch/torch.h``) becomes ``dice_ray_torch_lite.h`` (``ATen/core/Tensor.h``, the
  allocation ops, ``Dispatch.h``, ``TORCH_CHECK``, the ``torch::`` dtype names: the host API the rules allow),
  ``ATen/cuda/CUDAContext.h`` becomes ``dice_ray_cuda_lite.h`` (streams, guards, device properties, without the
  cuBLAS / cuSPARSE / cuSOLVER headers, which the CPU machines' CUDA toolkit lacks).  nvcc errors naming a
  missing ``torch``/``at``/``c10`` member (:data:`LITE_MISS`) make the builder compile again with the original
  headers.  Measured on the 2-core CPU machines (DICE record 0): nvcc 51 s with ``torch/extension.h``, 24 s
  with ``torch/types.h``, ~11 s lite.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from collections.abc import Iterable

from dice_ray.verify.candidate.inline_counters import COUNTER_PREFIX, COUNTER_SUFFIX
from dice_ray.verify.candidate.inline_spec import InlineSpec

__all__ = ["CUDA_LITE_HEADER", "LITE_HEADER", "LITE_MISS", "LITE_SUBSTITUTIONS", "cuda_file", "main_file",
           "write_headers"]

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



def write_headers(include_dir: Path, torch_includes: Iterable[str]) -> None:
    """Write the lite headers into ``include_dir`` (and, when none of ``torch_includes``, torch's include folders
    (:attr:`Toolchain.torch_includes <dice_ray.verify.candidate.toolchain.Toolchain.torch_includes>`), has it:
    a CPU-only torch, c10/cuda's missing generated header)."""
    headers = [(LITE_HEADER, LITE_TEXT), (CUDA_LITE_HEADER, CUDA_LITE_TEXT)]
    if not any(os.path.exists(os.path.join(d, CMAKE_MACROS)) for d in torch_includes):
        headers.append((CMAKE_MACROS, CMAKE_MACROS_TEXT))
    for name, text in headers:
        path = include_dir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_text() != text:
            tmp = path.with_name(f".{path.name}.{os.getpid()}")
            tmp.write_text(text)
            os.replace(tmp, path)

