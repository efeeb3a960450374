"""The launch counters and the kernel switch compiled into a load_inline extension's CUDA source (tree-sitter-cuda).

* Every ``__global__`` body starts with a one-thread ``atomicAdd`` on a ``__device__`` counter (read with
  ``cudaMemcpyFromSymbol``: kernels that really started), and every host launch (``k<<<...>>>(...)``,
  ``cudaLaunchKernel``...) is wrapped so an accepted launch (``cudaPeekAtLastError() == cudaSuccess``) bumps a
  host counter, which costs no CUDA call to read (so the harness may read it inside a timed window).  A module
  with a launch that cannot be wrapped (in a ``#define``, device-side, ``cuLaunchKernel``) is counted by its
  device counter (``counting == "device"``: a synchronising read, measured ~4.5 us a call inside the timed
  window on the H200 machine).
* The kernel switch: after the counter, every ``__global__`` body returns at once while the ``__constant__``
  flag ``dice_ray_skip_kernels`` is set (``_dice_ray_skip_kernels(1)``, bound like the counter readers;
  :func:`dice_ray.verify.trials.inline_launches.kernels_suppressed`): launches are counted, no kernel work
  happens.  The verifier's ablation of the candidate's kernels (rule ``kernel-not-used``).

:data:`COUNTER_PREFIX` / :data:`COUNTER_SUFFIX` go around the instrumented source in ``cuda.cu``
(:func:`dice_ray.verify.candidate.inline_files.cuda_file`); the worker reads the counters through the
extension's bindings (:mod:`dice_ray.verify.trials.inline_launches`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dice_ray.verify.candidate.cuda_tree import function_qualifiers, node_text, parse_cuda

__all__ = ["COUNTER_PREFIX", "COUNTER_SUFFIX", "LAUNCH_APIS", "Instrumented", "instrument_cuda"]

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
