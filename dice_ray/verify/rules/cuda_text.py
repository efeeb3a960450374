"""The CUDA-side rules on any text: library headers that do the work, and files read by path or by a hidden name.

Applied to a candidate's whole module (``__has_include`` only, :func:`dice_ray.verify.rules.check.check_candidate`),
to each load_inline source (:mod:`dice_ray.verify.rules.cpp_rules`) and, in the worker, to the final string
``load_cuda`` compiles however it was built (:func:`dice_ray.verify.trials.execution.check_load_cuda_source`).
"""

from __future__ import annotations

import re

from dice_ray.verify.rules.catalog import Violation

__all__ = ["check_cuda_source"]

_CUDA_LIBRARIES = re.compile(
    r"#\s*include\s*[<\"]\s*(cublas\w*|cublasLt\w*|cudnn\w*|cutlass/[^>\"]*|cute/[^>\"]*|thrust/[^>\"]*|"
    r"cusparse\w*|cufft\w*|cusolver\w*|nccl\w*|nvshmem\w*)",
    re.I,
)
#: libraries of _CUDA_LIBRARIES that are not math libraries: refused even with vendor libraries allowed
_COMM_LIBRARIES = re.compile(r"(nccl|nvshmem)", re.IGNORECASE)
#: ``#include NAME`` (a macro naming the file: ``#define P "/etc/x"``), ``#include_next``, ``#import``, ``#embed``
#: (directives at a line's start in a CUDA/C++ source), and ``__has_include`` anywhere (a file-existence
#: probe): the file is read or tested by a name no rule can check
_INDIRECT_INCLUDE = re.compile(r"(?m)^[ \t]*#[ \t]*(?:include_next|import|embed)\b.*$|"
                               r"^[ \t]*#[ \t]*include(?:[ \t]*(?![<\"\s])|[ \t]+(?![<\"\s])).*$")
_HAS_INCLUDE = re.compile(r"__has_include\w*")
_INCLUDE_PATH = re.compile(r"#\s*include\s*[<\"]\s*(/|~|[^>\"\n]*\.\.)[^>\"\n]*[>\"]?")


def check_cuda_source(text: str, *, allow_vendor_libraries: bool = False, whole_module: bool = False) -> list[Violation]:
    """The CUDA-side rules on any text: ``cuda-library`` (library headers that do the work for the
    kernel) and ``file-access`` (``#include`` of an absolute or ``..`` path: NVRTC would read it
    and its error log would carry the file's content into the verdict).

    ``allow_vendor_libraries`` (``VerifyConfig.allow_vendor_libraries``, load_inline sources only)
    drops the ``cuda-library`` violations of the vendor math libraries (cuBLAS, cuDNN, cuSPARSE,
    cuFFT, cuSOLVER, CUTLASS, CuTe, thrust); NCCL and NVSHMEM headers are refused all the same.

    Also ``file-access`` for a file the preprocessor would read or probe by a name no rule reads:
    ``#include NAME`` (a macro), ``#include_next``, ``#embed``, ``__has_include``; the text is read as the
    preprocessor reads it (``%:`` digraphs, backslash-newline splices).  ``whole_module``: ``text`` is a
    candidate's Python module (its CUDA sources inside strings): only ``__has_include`` is looked for
    there, as a Python comment may start ``# include``; the directives are checked on each real source
    (``load_cuda``'s hook in the worker, the load_inline sources' rules).
    """
    out = []
    # as the preprocessor reads it (translation phases 1-2): `%:` is `#`, a backslash-newline joins lines
    # (`#inc\<newline>lude`); the line numbers below are of this text, close enough to point at the directive
    text = text.replace("%:", "#").replace("\\\n", "")
    for m in [*_HAS_INCLUDE.finditer(text), *(() if whole_module else _INDIRECT_INCLUDE.finditer(text))]:
        line = text.count("\n", 0, m.start()) + 1
        out.append(Violation("file-access", f"{m.group(0).strip()[:80]!r}: a file named by a macro or probed (only "
                             "#include <...> or \"...\" of a literal name)", line))
    for m in _CUDA_LIBRARIES.finditer(text):
        if allow_vendor_libraries and not _COMM_LIBRARIES.match(m.group(1)):
            continue
        line = text.count("\n", 0, m.start()) + 1
        out.append(Violation("cuda-library", f"includes the library header {m.group(1)!r}", line))
    for m in _INCLUDE_PATH.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        out.append(Violation("file-access", f"includes a file by path: {m.group(0).strip()!r}", line))
    return out
