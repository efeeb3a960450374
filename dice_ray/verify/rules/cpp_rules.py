"""The C++/CUDA rules: static rules on the sources of a load_inline candidate, parsed with tree-sitter-cuda.

:func:`check_inline` is what :func:`dice_ray.verify.rules.check.check_candidate` adds for the load_inline
format (:mod:`dice_ray.verify.candidate.inline_spec`): the Python side gets the fast format's rules (forward may
call the extension's functions instead of ``kernels.<name>``), and every ``cpp_sources`` /
``cuda_sources`` text gets these, on its parse tree (calls, qualified names, includes), not on
regular expressions over the text:

* ``cpp-torch-op``: host C++ may use only allocation, view and metadata ATen/torch APIs
  (:data:`ALLOWED_CPP_TORCH_CALLS`, :data:`ALLOWED_CPP_TENSOR_METHODS`).  ``torch::matmul``,
  ``at::relu``, ``x.sum()``, ``torch::conv2d``, ``F::relu`` through a namespace alias, ``matmul``
  under ``using namespace torch``, arithmetic operators on ``Tensor`` variables, and torch's own
  kernels (``ATen/native/...`` headers) are the classic fallback cheat of this format.  Also a torch
  op taken as a value (``&at::relu``, called through a pointer), unqualified torch names in host
  code (``relu(x)``: argument-dependent lookup finds ``at::relu`` for a Tensor argument without any
  ``using``; C math names such as ``max``/``exp`` only with a Tensor argument), namespace aliases of torch, and
  ``#define`` bodies (unparsed by tree-sitter: each is checked as host code, and a macro standing for a
  torch namespace or op, ``#define NS at``, is flagged).
  ATen's dispatcher and dispatch-key state (``c10::Dispatcher::singleton().findSchemaOrThrow(...)``,
  ``ExcludeDispatchKeyGuard``, ``TorchDispatchModeTLS::pop_stack()``, ``ThreadLocalStateGuard``: ops by
  schema name or hidden from the run-time dispatch mode), pointers
  to Tensor methods (``&at::Tensor::add_``), explicit operator calls (``x.operator*(y)``), and
  operators on Tensors held by reference, in containers (``v[0] * 2``) or lambda parameters.
* ``cuda-library``: cuBLAS(Lt) / cuDNN / cuSPARSE / cuFFT / cuSOLVER / CUTLASS / CuTe / thrust
  names and handles (``at::cuda::getCurrentCUDABlasHandle``), headers, ``-lcublas``; none of it
  with ``VerifyConfig.allow_vendor_libraries`` (``allow_vendor_libraries=True`` here), except
  NCCL / NVSHMEM headers.  Torch's own wrappers (``at::cuda::blas::gemm``) stay ``cpp-torch-op``,
  and the candidate must still define and launch a ``__global__`` kernel (``no-kernel-launch``).
* ``cuda-stream``: stream, event and graph APIs (``cudaStreamCreate``, ``getStreamFromPool``,
  ``cudaGraph*``...); the current stream (``at::cuda::getCurrentCUDAStream()``) is allowed.
* ``forbidden-import``: thread and process headers and APIs (``<thread>``, ``std::thread``,
  ``std::async``, ``pthread_create``, ``#pragma omp``, ``<pybind11/...>``, ``<Python.h>``).
* ``file-access``: ``system``, ``popen``, ``fork``, ``exec*``, ``dlopen``, ``fopen``, ``getenv``,
  ``socket``... and file/network headers.
* ``dynamic-code``: calls into Python from C++ (``py::``, ``pybind11::``, ``Py*`` C API).
* ``no-kernel-launch``: no ``__global__`` kernel, or no launch of one anywhere.
* ``patching``: names containing ``dice_ray`` (the launch counters' names); operator registration
  (``TORCH_LIBRARY_IMPL(aten, CUDA, m)``, ``torch::Library``, ``RegisterOperators``): it would
  replace the kernels torch's own ops (the reference's) run.

Host code is everything outside ``__global__`` / ``__device__`` functions; method-call and
operator checks apply there only (device code cannot call ATen).
"""

from __future__ import annotations

import functools
import re
from typing import Any

from dice_ray.verify.candidate.candidate import Candidate
from dice_ray.verify.candidate.cuda_tree import function_qualifiers, node_text, parse_cuda
from dice_ray.verify.candidate.inline_spec import InlineSpec
from dice_ray.verify.rules.allowlist import ALLOWED_TENSOR_METHODS
from dice_ray.verify.rules.catalog import Violation
from dice_ray.verify.rules.cuda_text import check_cuda_source

__all__ = ["ALLOWED_CPP_TENSOR_METHODS", "ALLOWED_CPP_TORCH_CALLS", "check_inline", "check_inline_sources"]

#: Last components of ``torch::`` / ``at::`` names host code may call (allocation, options,
#: metadata, checks, current stream and device, caching allocator; ``torch::tensor(sizes, opts)`` uploads host
#: values, as an allocation and a copy do).
ALLOWED_CPP_TORCH_CALLS: frozenset[str] = frozenset(
    {
        "empty", "empty_like", "empty_strided", "zeros", "zeros_like", "ones", "ones_like", "full", "full_like",
        "from_blob", "scalar_tensor", "tensor", "TensorOptions", "dtype", "device", "layout", "requires_grad", "memory_format",
        "Device", "Scalar", "ScalarType", "IntArrayRef", "ArrayRef", "TensorList", "Tensor", "MemoryFormat",
        "typeMetaToScalarType", "scalarTypeToTypeMeta", "elementSize", "toString", "isFloatingType",
        "isIntegralType", "isComplexType", "isReducedFloatingType", "make_optional", "optional", "nullopt",
        "NoGradGuard", "AutoGradMode", "InferenceMode", "DeviceGuard", "OptionalDeviceGuard", "irange",
        "getCurrentCUDAStream", "getDefaultCUDAStream", "getCurrentDeviceProperties", "getDeviceProperties",
        "current_device", "device_count", "set_device", "CUDAGuard", "OptionalCUDAGuard", "get", "raw_alloc",
        "raw_alloc_with_stream", "raw_delete", "allocate", "warp_size", "is_available", "getNumGPUs",
        "checkAllSameGPU", "checkContiguous", "checkAllContiguous", "checkDim", "checkSize", "checkScalarType",
        "checkSameGPU", "TensorArg", "TensorGeometryArg", "ceil_div", "divup",
    }
)
#: ``Tensor`` methods host code may call (the Python rule's list plus the C++ spellings).
ALLOWED_CPP_TENSOR_METHODS: frozenset[str] = ALLOWED_TENSOR_METHODS | frozenset(
    {
        "sizes", "strides", "scalar_type", "options", "dtype", "device", "is_cuda", "is_cpu", "is_meta", "defined",
        "data", "mutable_data_ptr", "const_data_ptr", "accessor", "packed_accessor32", "packed_accessor64",
        "generic_packed_accessor", "itemsize", "nbytes", "layout", "is_sparse", "has_storage", "sym_size",
        "sym_sizes", "sym_numel", "sym_stride", "sym_strides", "suggest_memory_format",
        "is_non_overlapping_and_dense", "slice", "resize", "real", "imag", "requires_grad", "is_complex",
        "is_signed", "is_alias_of",
    }
)
#: Methods returning a view of a tensor (an expression built with them is still a tensor).
_VIEW_METHODS = frozenset({"contiguous", "view", "reshape", "transpose", "permute", "unsqueeze", "squeeze", "flatten",
                           "expand", "expand_as", "view_as", "reshape_as", "narrow", "select", "slice", "to", "cuda",
                           "detach", "t"})
_TENSOR_TYPES = frozenset({"torch::Tensor", "at::Tensor", "Tensor", "::at::Tensor", "::torch::Tensor"})
_LIBRARY_NAME = re.compile(r"^(cublas|cublasLt|cudnn|cusparse|cufft|cusolver|CUBLAS|CUDNN|CUSPARSE|CUFFT|CUSOLVER)")
_LIBRARY_NAMESPACES = frozenset({"thrust", "cutlass", "cute", "cudnn_frontend"})
_LIBRARY_CALLS = frozenset({"getCurrentCUDABlasHandle", "getCurrentCUDABlasLtHandle", "getCurrentCUDASparseHandle",
                            "getCurrentCUDASolverDnHandle", "getCudnnHandle", "getCurrentCUDABlasLtWorkspace"})
_STREAM_NAMES = re.compile(
    r"^(cudaStreamCreate\w*|cudaStreamBeginCapture\w*|cudaStreamEndCapture|cudaGraph\w*|cudaEvent\w*|"
    r"cudaStreamWaitEvent|cudaLaunchHostFunc|cudaStreamAddCallback|cudaStreamPerThread|cuStream\w*|cuGraph\w*|"
    r"cuEvent\w*|getStreamFromPool|getStreamFromExternal|CUDAStreamGuard|OptionalCUDAStreamGuard|"
    r"CUDAMultiStreamGuard|setCurrentCUDAStream|CUDAGraph|CUDAEvent)$"
)
#: memory both the host and a kernel reach (pinned, mapped, managed), and copies from device to host outside
#: torch: a kernel that writes a flag there tells the host code that it ran, which the verifier's kernel
#: ablation must not (rule ``host-memory``; none of DICE's 4,099 solutions uses one)
_HOST_MEMORY_NAMES = re.compile(
    r"^(cudaMallocManaged|cudaMallocHost|cudaHostAlloc|cudaHostRegister|cudaHostGetDevicePointer|cudaMemcpyDeviceToHost|"
    r"cudaMemcpyDefault|cudaMemcpyFromSymbol\w*|cudaMemcpy3D\w*|cudaMemcpyPeer\w*|cudaMemcpy\w*FromArray\w*|"
    r"cudaMemPrefetchAsync|cudaMemAdvise\w*|cudaStreamAttachMemAsync|cuMemAllocManaged|cuMemHostAlloc|cuMemAllocHost\w*|"
    r"cuMemHostRegister\w*|cuMemHostGetDevicePointer\w*|cuMemcpy\w*|__managed__|pinned_memory|pin_memory|"
    r"getPinnedMemoryAllocator|getCachingHostAllocator|CachingHostAllocator\w*|HostAllocator)$")
#: cudaMemcpy calls -> the index of their cudaMemcpyKind argument (optional for the ToSymbol ones), and the kinds
#: that copy nothing to the host
_MEMCPY_KIND_ARG = {"cudaMemcpy": 3, "cudaMemcpyAsync": 3, "cudaMemcpy2D": 6, "cudaMemcpy2DAsync": 6,
                    "cudaMemcpyToSymbol": 4, "cudaMemcpyToSymbolAsync": 4}
_MEMCPY_KINDS_OK = frozenset({"cudaMemcpyHostToDevice", "cudaMemcpyDeviceToDevice", "cudaMemcpyHostToHost"})
_THREAD_CALLS = frozenset({"pthread_create", "thread", "jthread", "async", "packaged_task"})
_SYSTEM_CALLS = frozenset({"system", "popen", "fork", "vfork", "execl", "execlp", "execle", "execv", "execvp",
                           "execvpe", "execve", "posix_spawn", "posix_spawnp", "dlopen", "dlsym", "fopen", "freopen",
                           "open", "openat", "creat", "unlink", "getenv", "secure_getenv", "setenv", "putenv",
                           "socket", "connect", "ptrace", "syscall", "kill", "mkfifo"})
_THREAD_HEADERS = re.compile(r"^(thread|future|pthread\.h|unistd\.h|sys/.*|dlfcn\.h|spawn\.h|signal\.h|csignal|"
                             r"Python\.h|pybind11/.*|torch/python\.h|torch/csrc/.*|omp\.h|execution)$")
_FILE_HEADERS = re.compile(r"^(fstream|filesystem|netdb\.h|arpa/.*|netinet/.*|fcntl\.h|dirent\.h)$")
_TORCH_OP_HEADERS = re.compile(r"^(ATen/native/.*|torch/nn\.h|torch/nn/.*|torch/linalg\.h|torch/fft\.h|"
                               r"torch/special\.h|ATen/cuda/CUDABlas\.h|ATen/cudnn/.*|ATen/cuda/tunable/.*)$")

#: ATen's dispatcher and dispatch-key state: an op called by its schema name
#: (``Dispatcher::singleton().findSchemaOrThrow("aten::relu", "")``), redispatched below the Python key, or
#: run with the Python key excluded (``ExcludeDispatchKeyGuard``) is torch compute that neither the
#: name rules nor the run-time dispatch mode see; so is any op run after the dispatch mode is taken off its
#: thread-local stack (``TorchDispatchModeTLS::pop_stack()``) or the thread-local state is replaced
#: (``ThreadLocalStateGuard``, ``_force_tls_local_dispatch_key_set``, ``DisablePythonDispatcher``).
_DISPATCH_NAMES = re.compile(
    r"^(Dispatcher|findSchema\w*|findOp|OperatorHandle|TypedOperatorHandle|OperatorName|callBoxed|redispatch\w*|"
    r"DispatchKey|DispatchKeySet|\w*DispatchKeyGuard|tls_set_dispatch_key_\w+|tls_local_dispatch_key_set|"
    r"AutoDispatch\w+|KernelFunction|BoxedKernel|PythonDispatcherTLS|ForceDispatchKeyGuard|"
    r"\w*DispatchModeTLS|\w*TorchFunctionTLS|\w*LocalDispatchKeySet|_force_tls_\w+|tls_is_dispatch_\w+|"
    r"\w*PythonDispatcher|ThreadLocalState\w*|\w*PythonTLSSnapshot|MaybeSetTLSOnEntryGuard|DisableTorch\w+)$")
#: operator registration: ``TORCH_LIBRARY_IMPL(aten, CUDA, m) { m.impl("relu", slow) }`` replaces the
#: kernels the reference runs (a slow reference, or one that returns the candidate's answer).
_REGISTRATION_NAMES = re.compile(r"^(TORCH_LIBRARY\w*|Library|RegisterOperators|registerOperator|"
                                 r"TORCH_REGISTER\w*|C10_REGISTER\w*|REGISTER_DISPATCH)$")
#: explicit operator calls that stay as calls (``x.operator*(y)``): the others are operators on values
_PLAIN_OPERATORS = frozenset({"operator()", "operator[]", "operator=", "operator->", "operator bool"})

#: torch function names that are also C/C++/CUDA library functions (``max(a, b)``, ``exp(v)``, ``sort(...)``
#: under ``using namespace std``): unqualified, they are torch ops only with a Tensor argument (found by
#: argument-dependent lookup); every other unqualified torch name in host code is one (``relu(x)``)
_C_LIBRARY_NAMES = frozenset({
    "abs", "min", "max", "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sqrt", "rsqrt", "pow", "floor",
    "ceil", "round", "trunc", "fmod", "fmin", "fmax", "sin", "cos", "tan", "sinh", "cosh", "tanh", "asin", "acos",
    "atan", "atan2", "asinh", "acosh", "atanh", "erf", "erfc", "erfinv", "lgamma", "tgamma", "hypot", "frexp",
    "ldexp", "isnan", "isinf", "isfinite", "signbit", "nextafter", "copysign", "remainder", "sign", "clamp", "all",
    "any", "sort", "swap", "fill", "copy", "equal", "gcd", "lcm", "real", "imag", "conj", "norm", "dot", "cross",
    "inner", "outer", "trace", "numel", "empty", "count_nonzero", "unique", "reverse", "transform", "accumulate",
    "get", "rand", "randint", "seed", "cumsum", "cumprod", "div", "mul", "add", "sub", "minimum", "maximum",
    "floor_divide", "square", "negative", "positive", "reciprocal", "frac", "fix", "rot90", "roll", "take",
    "select", "where", "ones", "zeros", "full", "arange", "range", "stack", "concat", "split", "chunk", "tile",
    "sum", "mean", "prod", "std", "var", "median", "argmax", "argmin",
})
@functools.cache
def _torch_names() -> tuple[frozenset[str], frozenset[str]]:
    """(torch / torch.nn.functional function names, Tensor methods that compute), built once.

    Cached as one value: verifier threads check candidates concurrently, and two module globals
    filled one after the other let a thread see the first set and not the second (a DICE infilling
    reference got ``internal verifier error: AssertionError`` on the H200 that way).
    """
    import torch
    import torch.nn.functional as F

    # vars(), not getattr(): no lazy submodule (torch._dynamo, torch.onnx...) is imported here
    names = {n for n, v in vars(torch).items() if not n.startswith("_") and callable(v)}
    names |= {n for n, v in vars(F).items() if not n.startswith("_") and callable(v)}
    compute = frozenset(n for n in dir(torch.Tensor) if not n.startswith("_")) - ALLOWED_CPP_TENSOR_METHODS
    return frozenset(names - ALLOWED_CPP_TORCH_CALLS), compute


def _is_tensor_type(text: str) -> bool:
    """A Tensor type, or a container of Tensors (``std::vector<at::Tensor>``, ``c10::optional<Tensor>``,
    ``TensorList``): its elements are Tensors, and ``v[0] * 2`` is an ATen op."""
    t = re.sub(r"\s|\bconst\b", "", text)
    return t in _TENSOR_TYPES or bool(re.search(r"(^|[<,:])Tensor([>,]|$)|^(at::|torch::|c10::)?(TensorList|ITensorListRef)$",
                                                t))


def _qualified_parts(node: Any) -> list[str]:
    """``at::cuda::getCurrentCUDAStream`` -> ['at', 'cuda', 'getCurrentCUDAStream'] (template args dropped)."""
    text = re.sub(r"<[^<>]*>", "", node.text.decode(errors="replace"))
    text = re.sub(r"<[^<>]*>", "", text)
    return [p.strip() for p in text.strip().lstrip(":").split("::") if p.strip()]


#: Tensor methods whose result is no Tensor (a Device, options, sizes...): a method called on it is that
#: object's (``x.device().index()`` is the device's ordinal, not ``Tensor::index``)
_METADATA_METHODS = frozenset({"device", "options", "sizes", "strides", "dtype", "scalar_type", "layout",
                               "sym_sizes", "sym_strides", "suggest_memory_format"})


def _of_metadata(receiver: Any) -> bool:
    """Whether ``receiver`` is a call of one of :data:`_METADATA_METHODS` (``x.device()``, ``x.options()``)."""
    if receiver is None or receiver.type != "call_expression":
        return False
    fn = receiver.child_by_field_name("function")
    field = fn.child_by_field_name("field") if fn is not None and fn.type == "field_expression" else None
    return field is not None and node_text(field) in _METADATA_METHODS


#: torch's C++ namespaces: a candidate may not open them (``namespace at { ... }``)
_TORCH_NAMESPACES = frozenset({"at", "torch", "c10", "caffe2", "aten"})


class _SourceChecker:
    def __init__(self, text: str, what: str, line: int | None, allow_vendor_libraries: bool = False):
        self.allow_vendor = allow_vendor_libraries
        self.data = text.encode()
        self.what = what
        self.line = line
        self.tree = parse_cuda(self.data)
        self.out: list[Violation] = []
        self.seen: set[tuple[str, str]] = set()
        self.torch_aliases = {"torch", "at"}
        self.using_torch = False
        self.using_names: dict[str, str] = {}
        self.defined: set[str] = set()
        self.kernels: list[str] = []
        self.launches = 0

    def add(self, rule: str, message: str, node: Any) -> None:
        if rule == "cuda-library" and self.allow_vendor:
            return  # vendor math libraries allowed (NCCL / NVSHMEM headers: check_cuda_source)
        key = (rule, message)
        if key in self.seen:
            return
        self.seen.add(key)
        where = f"{self.what} line {node.start_point[0] + 1}" if node is not None else self.what
        self.out.append(Violation(rule, f"{where}: {message}", self.line))

    # -- passes ----------------------------------------------------------------------------------
    def run(self) -> None:
        for v in check_cuda_source(self.data.decode(errors="replace"), allow_vendor_libraries=self.allow_vendor):
            self.out.append(Violation(v.rule, f"{self.what} line {v.line}: {v.message}", self.line))
        root = self.tree.root_node
        self.prepass(root)
        self.walk(root)

    def prepass(self, root: Any) -> None:
        stack = [root]
        while stack:
            n = stack.pop()
            if n.type == "using_declaration":
                q = [c for c in n.children if c.type in ("identifier", "qualified_identifier", "nested_namespace_specifier")]
                is_ns = any(c.type == "namespace" for c in n.children)
                if q:
                    parts = _qualified_parts(q[0])
                    if is_ns and parts and parts[0] in self.torch_aliases:  # at::cuda too: cuda::clamp_min is an op
                        self.using_torch = True
                    elif not is_ns and len(parts) > 1 and parts[0] in self.torch_aliases:
                        self.using_names[parts[-1]] = "::".join(parts)
            elif n.type == "namespace_alias_definition":
                kids = [c for c in n.children if c.type in ("namespace_identifier", "identifier")]
                target = [c for c in n.children if c.type in ("nested_namespace_specifier", "qualified_identifier")]
                target = target or kids[1:]  # `namespace mine = at;`: the target is a plain name
                if kids and target and _qualified_parts(target[0])[0] in self.torch_aliases:
                    self.torch_aliases.add(node_text(kids[0]))
            elif n.type == "function_definition":
                decl = n.child_by_field_name("declarator")
                while decl is not None and decl.type not in ("identifier", "field_identifier", "qualified_identifier"):
                    decl = decl.child_by_field_name("declarator")
                if decl is not None:
                    self.defined.add(_qualified_parts(decl)[-1] if decl.type == "qualified_identifier" else node_text(decl))
            stack.extend(n.children)

    def walk(self, root: Any) -> None:
        """Visit every node in source order (iteratively: a long expression is a deep tree)."""
        stack: list[tuple[Any, str, set[str]]] = [(root, "host", set())]
        while stack:
            node, where, tensors = stack.pop()
            t = node.type
            if t == "function_definition":
                quals = function_qualifiers(node)
                where = "global" if "__global__" in quals else "device" if "__device__" in quals else "host"
                if where == "global":
                    self.kernels.append(node_text(node.child_by_field_name("declarator") or node).split("(")[0])
                tensors = self.tensor_params(node) if where == "host" else set()
            elif t == "preproc_include":
                self.include(node)
            elif t == "gnu_asm_expression" and where == "host":
                self.add("file-access", "inline assembly in host code (a system call no rule sees)", node)
            elif t == "preproc_call":
                d = node.child_by_field_name("directive")
                a = node.child_by_field_name("argument")
                if d is not None and node_text(d) == "#pragma" and a is not None and node_text(a).strip().startswith("omp"):
                    self.add("forbidden-import", "#pragma omp (host threads)", node)
            elif t == "preproc_arg" and "<<<" in node_text(node):
                self.launches += 1
            elif t in ("identifier", "type_identifier", "namespace_identifier", "field_identifier"):
                self.name(node)
            elif t == "type_qualifier" and node_text(node) == "__managed__":
                self.add("host-memory", "declares a __managed__ variable (memory a kernel writes and the host reads "
                         "outside torch)", node)
            elif t in ("preproc_def", "preproc_function_def"):
                self.macro(node)
            elif t == "namespace_definition" and node.child_by_field_name("name") is not None and \
                    node_text(node.child_by_field_name("name")).split("::")[0].strip() in _TORCH_NAMESPACES | self.torch_aliases:
                self.add("cpp-torch-op", f"opens torch's namespace {node_text(node.child_by_field_name('name'))}: "
                         "names in it resolve to torch's own (cuda::clamp_min in namespace at)", node)
            elif t == "qualified_identifier":
                parts = _qualified_parts(node)
                if len(parts) == 2 and parts[0] == "std" and parts[1] in _THREAD_CALLS:
                    self.add("forbidden-import", f"uses std::{parts[1]} (host threads)", node)
                elif where == "host":
                    self.reference(node, parts)
            elif t == "call_expression":
                if any(c.type == "kernel_call_syntax" for c in node.children):
                    self.launches += 1
                fn = node.child_by_field_name("function")
                if fn is not None:
                    self.call(node, fn, where, tensors)
            elif t == "operator_name" and where == "host" and node.parent is not None and (
                    node.parent.type == "field_expression" or (node.parent.type == "call_expression"
                                                               and node.parent.child_by_field_name("function") == node)
            ) and re.sub(r"\s", "", node_text(node)) not in {
                    re.sub(r"\s", "", o) for o in _PLAIN_OPERATORS}:
                self.add("cpp-torch-op", f"host code calls {node_text(node)} explicitly (an operator on Tensors)", node)
            elif t == "ERROR" and where == "host":
                for m in re.finditer(r"(?:\.|->)\s*(?:template\s+)?(\w+)", node_text(node)):
                    if m.group(1) in _torch_names()[1]:
                        self.add("cpp-torch-op", f"host code calls the tensor method .{m.group(1)}() (in text the "
                                 "parser could not read)", node)
            elif t == "lambda_expression" and where == "host":
                tensors = set(tensors) | self.tensor_params(node)
            elif t == "declaration" and where == "host":
                self.declaration(node, tensors)
            elif where == "host" and t in ("binary_expression", "assignment_expression", "unary_expression"):
                self.operator(node, tensors)
            stack.extend((c, where, tensors) for c in reversed(node.children))

    # -- checks ----------------------------------------------------------------------------------
    def include(self, node: Any) -> None:
        path = node.child_by_field_name("path")
        if path is None:
            return
        name = node_text(path).strip().strip('<>"').strip()
        if _THREAD_HEADERS.match(name):
            self.add("forbidden-import", f"#include <{name}> (threads, processes or Python from C++)", node)
        elif _FILE_HEADERS.match(name):
            self.add("file-access", f"#include <{name}> (files or network)", node)
        elif _TORCH_OP_HEADERS.match(name):
            rule = "cuda-library" if ("cudnn" in name or "Blas" in name or "tunable" in name) else "cpp-torch-op"
            self.add(rule, f"#include <{name}> (torch's own compute)", node)

    def name(self, node: Any) -> None:
        text = node_text(node)
        if "dice_ray" in text:
            self.add("patching", f"uses the name {text} (the verifier's launch counters)", node)
        elif _REGISTRATION_NAMES.match(text) and (text != "Library" or node.type == "type_identifier"):
            self.add("patching", f"uses {text} (registers operator kernels: torch's own ops, the reference's "
                     "included, would run the candidate's code)", node)
        elif _DISPATCH_NAMES.match(text):
            self.add("cpp-torch-op", f"uses {text} (ATen's dispatcher: a torch op by schema name or below the "
                     "dispatch keys)", node)
        elif node.type == "identifier" and text == "operator" and node.parent is not None \
                and node.parent.type in ("binary_expression", "call_expression"):
            self.add("cpp-torch-op", "host code calls an operator function explicitly (operator*(a, b))", node)
        elif _LIBRARY_NAME.match(text) or (node.type == "namespace_identifier" and text in _LIBRARY_NAMESPACES) \
                or text in _LIBRARY_CALLS:
            self.add("cuda-library", f"uses {text} (a vendor math library)", node)
        elif _STREAM_NAMES.match(text):
            self.add("cuda-stream", f"uses {text} (streams, events or graphs hide work from the timed stream)", node)
        elif _HOST_MEMORY_NAMES.match(text):
            self.add("host-memory", f"uses {text} (memory a kernel writes and the host reads outside torch)", node)
        elif node.type == "namespace_identifier" and text in ("py", "pybind11"):
            self.add("dynamic-code", f"uses {text}:: (calls into Python from C++)", node)
        elif node.type == "identifier" and re.match(r"^Py[A-Z]\w*_\w+$|^Py_\w+$", text):
            self.add("dynamic-code", f"uses {text} (the Python C API)", node)
        elif node.type == "identifier" and text in _SYSTEM_CALLS:  # &fopen, auto f = system: called later
            self.add("file-access", f"uses {text} (file, process or network access)", node)

    def reference(self, node: Any, parts: list[str]) -> None:
        """A torch op named in an expression without being called there (``&at::relu``, ``auto f = at::relu``):
        it is called through a pointer or alias later, where the call rule cannot see whose it is."""
        if node.parent is not None and node.parent.type == "qualified_identifier":
            return  # the outermost name decides (at::Tensor::add_: ['at', 'Tensor', 'add_'])
        last = node.named_children[-1] if node.named_children else None
        while last is not None and last.type == "qualified_identifier" and last.named_children:
            last = last.named_children[-1]
        parent = node.parent
        called = parent is not None and parent.type == "call_expression" and parent.child_by_field_name("function") == node
        if (not called and last is not None and last.type in ("identifier", "field_identifier") and len(parts) > 1
                and parts[0] in self.torch_aliases and (parts[-1] in _torch_names()[0] or (
                    "Tensor" in parts[:-1] and parts[-1] in _torch_names()[1]))):
            self.add("cpp-torch-op", f"host code takes {'::'.join(parts)} as a value (a torch op called through a "
                     "pointer or alias)", node)

    def macro(self, node: Any) -> None:
        """``#define`` bodies are not parsed by tree-sitter: check each one as host code (wrapped in a
        function), and flag a macro that stands for a torch namespace or op (``#define NS at``,
        ``#define RELU at::relu``): what it expands to would otherwise go unchecked."""
        name_node, body = node.child_by_field_name("name"), node.child_by_field_name("value")
        if body is None:
            return
        name, text = node_text(name_node) if name_node is not None else "?", node_text(body).strip()
        if "##" in text:  # J(TORCH_LIB, RARY_IMPL), J(dice_, ray_launches): names no rule can read
            self.add("dynamic-code", f"the macro {name} pastes tokens (##) into names the rules cannot read", node)
            return
        parts = [p.strip() for p in text.lstrip(":").split("::")]
        if re.fullmatch(r"(::)?\w+(::\w+)*(::)?", text) and parts[0] in self.torch_aliases and (
                not parts[-1] or not re.match(r"k?[A-Z]", parts[-1])):  # at::cuda, at::relu; not at::kFloat, at::Tensor
            self.add("cpp-torch-op", f"the macro {name} stands for {text} (torch APIs behind a macro)", node)
            return
        params = node.child_by_field_name("parameters")
        for p in re.findall(r"\w+", node_text(params)) if params is not None else ():
            if re.search(rf"::\s*{p}\b|\b{p}\s*::", text):  # #define OP(n) at::cuda::n
                self.add("cpp-torch-op", f"the macro {name} builds a qualified name from its argument {p} "
                         f"({text[:60]}): what it names is read by no rule", node)
                return
        inner = _SourceChecker(f"void dice_macro_body() {{ {text.replace(chr(92) + chr(10), ' ')}\n; }}", self.what,
                               self.line, self.allow_vendor)
        inner.torch_aliases = set(self.torch_aliases)
        inner.using_torch, inner.using_names, inner.defined = self.using_torch, dict(self.using_names), self.defined
        inner.prepass(inner.tree.root_node)
        inner.walk(inner.tree.root_node)
        for v in inner.out:
            self.add(v.rule, f"in the macro {name}: {v.message.split(': ', 1)[-1]}", node)

    def call(self, node: Any, fn: Any, where: str, tensors: set[str]) -> None:
        if fn.type == "template_function":
            fn = fn.child_by_field_name("name") or fn
        if fn.type == "qualified_identifier":
            parts = _qualified_parts(fn)
            if not parts:
                return
            if parts[-1] in _SYSTEM_CALLS and parts[0] in ("std", ""):
                self.add("file-access", f"calls {'::'.join(parts)}", node)
            elif parts[0] in self.torch_aliases and len(parts) > 1 and parts[-1] not in ALLOWED_CPP_TORCH_CALLS \
                    and parts[-1] not in _LIBRARY_CALLS and not _STREAM_NAMES.match(parts[-1]):
                self.add("cpp-torch-op", f"host code calls {'::'.join(parts)} (only allocation, view and metadata "
                         "ATen APIs are allowed: compute must be in the candidate's kernels)", node)
        elif fn.type == "identifier":
            name = node_text(fn)
            if name in _MEMCPY_KIND_ARG:
                self.memcpy_kind(node, name)
            if name in _SYSTEM_CALLS:
                self.add("file-access", f"calls {name}()", node)
            elif name in ("pthread_create",):
                self.add("forbidden-import", f"calls {name}() (host threads)", node)
            elif name in self.using_names and name not in ALLOWED_CPP_TORCH_CALLS and name not in self.defined:
                self.add("cpp-torch-op", f"host code calls {self.using_names[name]} (through a using-declaration)", node)
            elif self.using_torch and where == "host" and name not in self.defined and name in _torch_names()[0]:
                self.add("cpp-torch-op", f"host code calls {name}() under `using namespace torch/at`", node)
            elif where == "host" and name in _torch_names()[0] and (
                    any(self.is_tensor(a, tensors) for a in self.arguments(node))
                    or (name not in self.defined and name not in _C_LIBRARY_NAMES)):
                self.add("cpp-torch-op", f"host code calls {name}() unqualified: with a Tensor argument C++ finds "
                         f"at::{name} by argument-dependent lookup (a torch op)", node)
        elif fn.type == "field_expression" and where == "host":
            field = fn.child_by_field_name("field")
            if field is not None and field.type == "template_method":
                field = field.child_by_field_name("name") or field
            method = node_text(field) if field is not None else ""
            if (method in _torch_names()[1] and not (method == "cpu" and self.read_by_item(node))
                    and not _of_metadata(fn.child_by_field_name("argument"))):
                self.add("cpp-torch-op", f"host code calls the tensor method .{method}() (only allocation, view and "
                         "metadata methods are allowed)", node)

    @staticmethod
    def read_by_item(call: Any) -> bool:
        """Whether the call ``call`` (``x.cpu()``) is at once read by ``.item()`` / ``.item<T>()``
        (``x.cpu().item<float>()``): the host reads one scalar, as ``x.item<float>()`` does (torch
        copies the one element to the host either way; run time allows that copy, and the kernel
        ablation replays the value, as for ``.item()``)."""
        outer = call.parent
        if outer is None or outer.type != "field_expression" or outer.child_by_field_name("argument") != call:
            return False
        field = outer.child_by_field_name("field")
        if field is not None and field.type == "dependent_name":  # x.cpu().template item<float>()
            field = next((c for c in field.named_children if c.type == "template_method"), field)
        if field is not None and field.type == "template_method":
            field = field.child_by_field_name("name") or field
        user = outer.parent
        return (field is not None and node_text(field) == "item" and user is not None
                and user.type == "call_expression" and user.child_by_field_name("function") == outer)

    def memcpy_kind(self, node: Any, name: str) -> None:
        """``host-memory`` unless a cudaMemcpy's kind is spelled as one that copies nothing to the host (a cast
        integer, a variable or a macro may be cudaMemcpyDeviceToHost)."""
        args = self.arguments(node)
        at = _MEMCPY_KIND_ARG[name]
        if len(args) <= at and "ToSymbol" in name:
            return  # the default kind: cudaMemcpyHostToDevice
        kind = node_text(args[at]).strip() if len(args) > at else "(none)"
        if kind.split("::")[-1] not in _MEMCPY_KINDS_OK:
            self.add("host-memory", f"{name}(...) with kind {kind}: only cudaMemcpyHostToDevice, "
                     "cudaMemcpyDeviceToDevice and cudaMemcpyHostToHost may be spelled (reads of device memory go "
                     "through torch)", node)

    @staticmethod
    def arguments(call: Any) -> list[Any]:
        args = call.child_by_field_name("arguments")
        return list(args.named_children) if args is not None else []

    def tensor_params(self, fn: Any) -> set[str]:
        out: set[str] = set()
        decl = fn.child_by_field_name("declarator")
        params = decl.child_by_field_name("parameters") if decl is not None else None
        for p in (params.children if params is not None else []):
            if p.type == "parameter_declaration":
                name = self.tensor_decl_name(p.child_by_field_name("type"), p.child_by_field_name("declarator"))
                if name:
                    out.add(name)
        return out

    @staticmethod
    def tensor_decl_name(type_node: Any, declarator: Any) -> str | None:
        if type_node is None or declarator is None or not _is_tensor_type(node_text(type_node)):
            return None
        while declarator is not None and declarator.type in ("reference_declarator", "pointer_declarator"):
            declarator = next((c for c in declarator.children if c.type == "identifier"), None)
        return node_text(declarator) if declarator is not None and declarator.type == "identifier" else None

    def declaration(self, node: Any, tensors: set[str]) -> None:
        type_node = node.child_by_field_name("type")
        for d in node.children_by_field_name("declarator"):
            target = d.child_by_field_name("declarator") if d.type == "init_declarator" else d
            name = self.tensor_decl_name(type_node, target)
            if name:
                tensors.add(name)
            elif (d.type == "init_declarator" and type_node is not None and node_text(type_node) == "auto"
                  and target is not None and self.unwrap(target).type == "identifier"
                  and self.is_tensor(d.child_by_field_name("value"), tensors)):
                tensors.add(node_text(self.unwrap(target)))

    @staticmethod
    def unwrap(declarator: Any) -> Any:
        """The name inside ``&name`` / ``&&name`` declarators (``const auto& xr = x``)."""
        while declarator.type == "reference_declarator":
            inner = next((c for c in declarator.named_children), None)
            if inner is None:
                break
            declarator = inner
        return declarator

    def is_tensor(self, node: Any, tensors: set[str]) -> bool:
        if node is None:
            return False
        if node.type == "identifier":
            return node_text(node) in tensors
        if node.type == "parenthesized_expression":
            return any(self.is_tensor(c, tensors) for c in node.named_children)
        if node.type == "subscript_expression":
            return self.is_tensor(node.child_by_field_name("argument"), tensors)
        if node.type == "call_expression":
            fn = node.child_by_field_name("function")
            if fn is not None and fn.type == "qualified_identifier":
                parts = _qualified_parts(fn)
                return bool(parts) and parts[0] in self.torch_aliases and parts[-1] in (
                    "empty", "empty_like", "zeros", "zeros_like", "ones", "ones_like", "full", "full_like", "from_blob")
            if fn is not None and fn.type == "field_expression":
                field = fn.child_by_field_name("field")
                return (field is not None and node_text(field) in _VIEW_METHODS
                        and self.is_tensor(fn.child_by_field_name("argument"), tensors))
        return False

    def operator(self, node: Any, tensors: set[str]) -> None:
        op = node.child_by_field_name("operator")
        opt = node_text(op) if op is not None else ""
        if node.type == "assignment_expression":
            if opt == "=":
                return
            operands = [node.child_by_field_name("left")]
        elif node.type == "unary_expression":
            if opt not in ("-", "~"):
                return
            operands = [node.child_by_field_name("argument")]
        else:
            if opt in ("&&", "||"):
                return
            operands = [node.child_by_field_name("left"), node.child_by_field_name("right")]
        if any(self.is_tensor(o, tensors) for o in operands):
            self.add("cpp-torch-op", f"host code applies the operator {opt} to a Tensor (an ATen op)", node)


def check_inline_sources(spec: InlineSpec, allow_vendor_libraries: bool = False) -> tuple[list[Violation], list[str], int]:
    """Apply the C++/CUDA rules to one :class:`~dice_ray.verify.candidate.inline_spec.InlineSpec`
    (``allow_vendor_libraries``: ``VerifyConfig.allow_vendor_libraries``, see the module docstring).

    Returns:
        (violations, names of the ``__global__`` kernels, host launch sites found); each
        violation's line is the ``load_inline`` call's, its message names the source and line.
    """
    out: list[Violation] = []
    kernels: list[str] = []
    launches = 0
    for what, text in (("cpp_sources", spec.cpp_source), ("cuda_sources", spec.cuda_source)):
        if not text.strip():
            continue
        c = _SourceChecker(text, what, spec.line, allow_vendor_libraries)
        c.run()
        out.extend(c.out)
        kernels.extend(c.kernels)
        launches += c.launches + len(re.findall(r"\bcu(da)?Launch\w*\s*\(", text))
    return out, kernels, launches


def check_inline(candidate: Candidate, kernel_refs: dict[str, set[str]]) -> list[Violation]:
    """The load_inline format's extra rules on a candidate (called by
    :func:`~dice_ray.verify.rules.check.check_candidate`; the candidate's ``allow_vendor_libraries``,
    ``VerifyConfig.allow_vendor_libraries``: no ``cuda-library`` violations for vendor math libraries, vendor
    ``-l`` flags accepted).

    Reads the ``load_inline`` calls the candidate read (:attr:`Candidate.specs
    <dice_ray.verify.candidate.candidate.Candidate.specs>`; ``unsupported-format`` when an argument is dynamic),
    checks their sources (see the module docstring), that some kernel exists and is launched
    (``no-kernel-launch``), and that every ``ext.<name>`` the Python code uses (``kernel_refs``, holder ->
    names, from the Python rules) is one of the extension's ``functions`` (``unknown-kernel``).
    """
    e = candidate.spec_error
    if e is not None:
        return [Violation(e.rule, str(e), e.line)]
    specs = candidate.specs
    if not specs:
        return [Violation("unsupported-format", "imports torch.utils.cpp_extension but never calls "
                          "`name = load_inline(...)` at module top level (or `self.<name> = load_inline(...)` in "
                          "__init__)", None)]
    allow_vendor_libraries = candidate.allow_vendor_libraries
    out: list[Violation] = []
    kernels: list[str] = []
    launches = 0
    try:
        for spec in specs:
            v, k, n = check_inline_sources(spec, allow_vendor_libraries)
            out.extend(v)
            kernels.extend(k)
            launches += n
    except ImportError as e:  # tree-sitter missing: the C++ rules cannot run
        return [Violation("unsupported-format", f"the load_inline format needs tree-sitter-cuda: {e}", None)]
    first = specs[0].line
    if not kernels:
        out.append(Violation("no-kernel-launch", "the load_inline extension defines no __global__ kernel", first))
    elif not launches:
        out.append(Violation("no-kernel-launch", f"no host code launches the kernels {kernels} (a decoy kernel)", first))
    by_var = {var: set(functions) for var, functions in candidate.kernels.items()}
    every = set().union(*by_var.values())
    for holder, names in kernel_refs.items():
        known = by_var.get(holder, every)
        missing = sorted(names - known)
        if missing:
            out.append(Violation("unknown-kernel", f"{holder}.{', '.join(missing)}: not among the extension's "
                                 f"functions {sorted(known)}", None))
    return out
