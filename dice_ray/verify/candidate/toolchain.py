"""The compilers of a load_inline build and their command lines (torch's extension flags, one arch).

:func:`detect_toolchain` finds nvcc, g++ and this machine's torch (include and library folders, C++ standard,
ABI); its key hashes everything that changes a build's output, so the compile pool's cache
(:mod:`dice_ray.verify.candidate.inline_build`) keeps one folder a toolchain.  The ``*_command`` functions give
the command lines of ``main.cpp`` (g++, the precompiled header), ``cuda.cu`` (nvcc) and the link, as torch's
``load_inline`` would run them.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dice_ray.verify.candidate.inline_counters import COUNTER_PREFIX, COUNTER_SUFFIX
from dice_ray.verify.candidate.inline_files import CMAKE_MACROS_TEXT, CUDA_LITE_TEXT, LITE_SUBSTITUTIONS, LITE_TEXT

__all__ = [
    "COMMON_NVCC_FLAGS",
    "Toolchain",
    "cuda_command",
    "detect_toolchain",
    "link_command",
    "main_command",
    "main_flags",
    "module_name",
    "rename_init_command",
    "sha",
]

#: bump when the generated files or flags change in a way the toolchain key does not see
COMPILE_VERSION = 6


def sha(*parts: Any) -> str:
    """SHA-256 hex of a JSON encoding of ``parts``."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


#: torch's own nvcc flags for extensions (``torch.utils.cpp_extension.COMMON_NVCC_FLAGS``):
#: candidates written for load_inline compile with the same half/bfloat16 operator settings
COMMON_NVCC_FLAGS = ("-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
                     "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__", "--expt-relaxed-constexpr")


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



#: an optimisation flag of the host compiler (``-O``, ``-O0`` .. ``-O3``, ``-Os``)
_HOST_OPT_FLAG = re.compile(r"^-O[0-3s]?$")


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

