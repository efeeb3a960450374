"""The KernelBench / DICE candidate format: ``torch.utils.cpp_extension.load_inline`` modules.

A candidate in this format is a Python module that, at top level, calls
``ext = load_inline(name=..., cpp_sources=..., cuda_sources=..., functions=[...])`` and whose
``ModelNew.forward`` calls ``ext.<function>(...)`` (KernelBench's ``eval.py`` format; every record
of DICE's ``kernel_infilling_evaluation.json`` has this shape).  The verifier never runs torch's
``load_inline`` (a ninja build, ~53 s a candidate on the H200 host, DESIGN.md): it

1. reads the call statically (:func:`extract_specs`, :mod:`ast`): every argument must be a string
   literal, a list/tuple/dict of them, a name bound once at module top level to one, an
   f-string of those, or a ``+`` of those; anything else is ``unsupported-format``
   (:class:`UnsupportedFormat`, a ``compile_error``), its message naming the argument;
2. builds each :class:`InlineSpec` with :class:`dice_ray.verify.inline_build.InlineBuilder` in the
   verifier's process (content-hash cache, parallel, resource-limited compilers), after
   :func:`dice_ray.verify.inline_compile.instrument_cuda` added launch counters to the CUDA source;
3. in the sandboxed worker, :func:`exec_inline` executes the candidate with ``load_inline`` bound
   to a loader that imports the prebuilt ``.so`` (nothing compiles in the worker: seccomp forbids
   fork/exec there) once the call's arguments hash to the built spec.

Vendor libraries: by default cuBLAS, cuDNN & co. are the cheat rule ``cuda-library`` (static, and
``extra_ldflags=["-lcublas"]`` here); with ``VerifyConfig.allow_vendor_libraries`` the ``-l`` flags
of :data:`VENDOR_LIBRARIES` are accepted (:attr:`InlineSpec.extra_ldflags`) and the build links what
:meth:`InlineSpec.vendor_libraries` finds.  The launch counters below only see the candidate's own
``__global__`` kernels, so a forward that only calls cuBLAS still breaks ``no-kernel-launch``.

Launch counting (run-time rule ``no-kernel-launch``): :func:`launch_count` sums the host launch
counters compiled into the current candidate's extensions (no CUDA call, so the harness may read
it inside a timed window), or a module's device counter when its launches could not all be
wrapped; :func:`kernel_runs` reads the device counters (kernels that really started;
synchronising).  :func:`kernels_suppressed` makes every kernel of those extensions return at entry
(still counted): the verifier's ablation of the candidate's kernels (rule ``kernel-not-used``).  See
:mod:`dice_ray.verify.inline_compile` for how the counters and that switch are compiled in.

Everything here runs in the worker too: no pydantic, tree-sitter imported lazily.
"""

from __future__ import annotations

import ast
import contextlib
import dis
import hashlib
import importlib.util
import json
import linecache
import re
import sys
import types
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator

from dice_ray.pysource import parse_python

__all__ = [
    "VENDOR_LIBRARIES",
    "InlineLoadError",
    "InlineSpec",
    "UnsupportedFormat",
    "exec_inline",
    "extract_specs",
    "is_inline",
    "kernel_runs",
    "kernels_suppressed",
    "launch_count",
    "reset",
    "spec_from_call",
]

#: Dotted names that mean torch's ``load_inline`` once import aliases are resolved.
LOAD_INLINE = "torch.utils.cpp_extension.load_inline"
#: ``load_inline`` keywords that only steer torch's own build and are ignored here.
_IGNORED_KWARGS = frozenset({"verbose", "build_directory", "keep_intermediates", "use_pch", "with_cuda",
                             "with_pytorch_error_handling", "is_python_module"})
_POSITIONAL = ("name", "cpp_sources", "cuda_sources")
_FLAG_KWARGS = ("extra_cflags", "extra_cuda_cflags", "extra_ldflags", "extra_include_paths")
#: Extra compiler flags a candidate may pass in ``extra_cflags`` / ``extra_cuda_cflags`` (anything naming a
#: path, a library or the toolchain is refused; a ``-D`` value is a number, so no macro renames a torch API)
_SAFE_FLAG = re.compile(
    r"^(-O[0-3s]?|--?use_fast_math|-ffast-math|-std=c\+\+(14|17|20)|--expt-relaxed-constexpr|"
    r"--expt-extended-lambda|--extended-lambda|-lineinfo|-DNDEBUG|-D[A-Za-z_]\w*(=[+-]?[\d.]+[A-Za-z]*)?|-U[A-Za-z_]\w*|"
    r"-maxrregcount=\d+|--maxrregcount=\d+|-w|-Wall|-Wextra|-Wno-[\w-]+|-funroll-loops|-fno-strict-aliasing|"
    r"-Xptxas|--ptxas-options|-Xcompiler|--compiler-options|-v|--restrict|-ftz=(true|false)|-prec-div=(true|false)|"
    r"-prec-sqrt=(true|false)|-fmad=(true|false)|--?warn-on-spills|-dlcm=c[ag]|--allow-expensive-optimizations(=true)?)$"
)
#: a target architecture flag of nvcc, its value attached (group 2) or the next token
_ARCH_FLAG = re.compile(r"^(-arch|--gpu-architecture|-code|--gpu-code|-gencode|--generate-code)(=\S+)?$")
#: ``-Xptxas=-v,-O3`` / ``-Xcompiler=-O3``: an option handed on to the assembler or host compiler, each of its
#: comma-separated flags safe
_PASSED_FLAG = re.compile(r"^(-Xptxas|--ptxas-options|-Xcompiler|--compiler-options)=(.+)$")
#: ``-l<name>`` of a vendor library, in any flag list: a ``cuda-library`` cheat, not a format problem.
_LIBRARY_FLAG = re.compile(r"^-l(cublas\w*|cudnn\w*|cusparse\w*|cufft\w*|cusolver\w*|curand\w*|nccl\w*|nvshmem\w*)$")
#: ``extra_ldflags`` naming a library every extension is linked with anyway (torch's and the CUDA runtime):
#: accepted and dropped, as they change nothing
_LINKED_ANYWAY = frozenset({"-lcudart", "-lc10", "-lc10_cuda", "-ltorch", "-ltorch_cpu", "-ltorch_cuda",
                            "-ltorch_python"})
#: Vendor math libraries ``VerifyConfig.allow_vendor_libraries`` lets a load_inline candidate link
#: (``-l<name>`` in ``extra_ldflags``); a closed list: any other ``-l`` flag stays refused.
VENDOR_LIBRARIES: tuple[str, ...] = ("cublas", "cublasLt", "cudnn", "cusparse", "cufft", "cusolver", "curand")
#: What in a source needs which vendor libraries (identifiers and headers; torch's cuBLAS handles
#: return cuBLAS types whose functions live in libcublas / libcublasLt).
_VENDOR_USES: tuple[tuple[re.Pattern[str], tuple[str, ...]], ...] = (
    (re.compile(r"\bcublas|getCurrentCUDABlas(Lt)?Handle|getCurrentCUDABlasLtWorkspace"), ("cublas", "cublasLt")),
    (re.compile(r"\bcudnn|getCudnnHandle"), ("cudnn",)),
    (re.compile(r"\bcusparse|getCurrentCUDASparseHandle"), ("cusparse",)),
    (re.compile(r"\bcufft"), ("cufft",)),
    (re.compile(r"\bcusolver|getCurrentCUDASolverDnHandle"), ("cusolver",)),
    # cuRAND's host API (generators); the device API (curand_kernel.h, curand_init) is header-only
    (re.compile(r"\bcurand(Create|Generate|Set|Destroy|Get)\w*|\bcurand\.h\b"), ("curand",)),
)


class UnsupportedFormat(ValueError):
    """The candidate's ``load_inline`` call cannot be read statically (rule ``unsupported-format``,
    or ``cuda-library`` for ``extra_ldflags=['-lcublas']``).

    Attributes:
        rule: the rule id (``"unsupported-format"`` or ``"cuda-library"``).
        argument: the argument that could not be read (``"cuda_sources"``, ``"name"``...), or None.
        line: 1-based line of the call in the candidate, or None.
    """

    def __init__(self, message: str, argument: str | None = None, line: int | None = None,
                 rule: str = "unsupported-format"):
        super().__init__(message)
        self.rule = rule
        self.argument = argument
        self.line = line


class InlineLoadError(Exception):
    """Raised in the worker when a ``load_inline`` call does not match what was built (made a
    subclass of :class:`dice_ray.launch.CompileError` at first use, so the harness reports it
    as a ``compile_error``)."""


@dataclass(frozen=True)
class InlineSpec:
    """One ``load_inline`` call, normalised (sources as tuples of strings, as torch joins them).

    Attributes:
        name: the extension name the candidate chose (``name=``).
        cpp_sources: C++ sources (torch puts them, after ``#include <torch/extension.h>``, into
            ``main.cpp`` with the generated pybind11 bindings of ``functions``).
        cuda_sources: CUDA sources (joined into ``cuda.cu``); empty for a C++-only extension.
        functions: the functions to bind (``functions=`` as a list, a dict's keys, or one name).
        extra_cflags, extra_cuda_cflags: flags for ``main.cpp`` / ``cuda.cu`` (a safe subset).
        no_implicit_headers: torch's flag: no implicit ``#include`` lines are added.
        extra_ldflags: ``-l<vendor library>`` flags (:data:`VENDOR_LIBRARIES` only), accepted only
            with ``VerifyConfig.allow_vendor_libraries``; empty otherwise.
        var: the module-level name bound to the call's result (static extraction only).
        line: the call's 1-based line in the candidate (static extraction only).
    """

    name: str
    cpp_sources: tuple[str, ...]
    cuda_sources: tuple[str, ...] = ()
    functions: tuple[str, ...] = ()
    extra_cflags: tuple[str, ...] = ()
    extra_cuda_cflags: tuple[str, ...] = ()
    no_implicit_headers: bool = False
    extra_ldflags: tuple[str, ...] = ()
    var: str | None = field(default=None, compare=False)
    line: int | None = field(default=None, compare=False)

    def key(self) -> str:
        """SHA-256 hex of the content that decides the build (not ``var``/``line``): the worker
        checks a run-time call against the built spec with it."""
        d = asdict(self)
        d.pop("var")
        d.pop("line")
        if not d["extra_ldflags"]:
            d.pop("extra_ldflags")  # specs without vendor libraries keep the keys they always had
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()

    def vendor_libraries(self) -> tuple[str, ...]:
        """The vendor libraries the build links (only asked for under
        ``VerifyConfig.allow_vendor_libraries``: otherwise the rules refused these sources): those
        named in :attr:`extra_ldflags`, plus those whose names or headers the sources use (cuBLAS
        calls or ``at::cuda::getCurrentCUDABlasHandle``: cublas and cublasLt; ``cudnn*``: cudnn...).

        Returns:
            Names of :data:`VENDOR_LIBRARIES` (``"cublas"``, not ``-lcublas``), in that order.
        """
        wanted = {f[2:] for f in self.extra_ldflags}
        text = self.cpp_source + "\n" + self.cuda_source
        for pattern, libs in _VENDOR_USES:
            if pattern.search(text):
                wanted.update(libs)
        return tuple(lib for lib in VENDOR_LIBRARIES if lib in wanted)

    @property
    def cuda_source(self) -> str:
        """``cuda.cu``'s text as torch builds it (sources joined by newlines)."""
        return "\n".join(self.cuda_sources)

    @property
    def cpp_source(self) -> str:
        return "\n".join(self.cpp_sources)


# ----------------------------------------------------------------------------------------------
# Static extraction
# ----------------------------------------------------------------------------------------------


def _aliases(tree: ast.Module) -> dict[str, str]:
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                out[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                out[a.asname or a.name] = f"{node.module}.{a.name}"
    return out


def _dotted(node: ast.AST, aliases: dict[str, str]) -> str | None:
    if isinstance(node, ast.Name):
        return aliases.get(node.id)
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value, aliases)
        return f"{base}.{node.attr}" if base else None
    return None


def _is_load_inline_call(node: ast.AST, aliases: dict[str, str]) -> bool:
    return isinstance(node, ast.Call) and _dotted(node.func, aliases) == LOAD_INLINE


def is_inline(src: str | ast.Module) -> bool:
    """Whether a candidate is in the load_inline format: it imports ``torch.utils.cpp_extension``
    (or ``cpp_extension`` from ``torch.utils``) or calls something named ``load_inline``.
    False for text that does not parse."""
    try:
        tree = parse_python(src) if isinstance(src, str) else src
    except (SyntaxError, ValueError):
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name.startswith("torch.utils.cpp_extension") for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.module and (
            node.module.startswith("torch.utils.cpp_extension")
            or (node.module == "torch.utils" and any(a.name == "cpp_extension" for a in node.names))
        ):
            return True
        if isinstance(node, ast.Call):
            f = node.func
            if (isinstance(f, ast.Name) and f.id == "load_inline") or (isinstance(f, ast.Attribute) and f.attr == "load_inline"):
                return True
    return False


class _Resolver:
    """Values of module-level constant expressions (literals, names bound once, ``+``, f-strings)."""

    def __init__(self, tree: ast.Module):
        self.bindings: dict[str, list[ast.stmt]] = {}
        for stmt in tree.body:
            for name in _assigned_names(stmt):
                self.bindings.setdefault(name, []).append(stmt)
        self.active: set[str] = set()

    def value(self, node: ast.AST, what: str, before: int) -> Any:
        if isinstance(node, ast.Constant) and isinstance(node.value, (str, int, float, bool, type(None))):
            return node.value
        if isinstance(node, (ast.List, ast.Tuple)):
            return [self.value(e, what, before) for e in node.elts]
        if isinstance(node, ast.Dict):
            if any(k is None for k in node.keys):
                raise UnsupportedFormat(f"{what}: a ** in a dict literal is not a constant", what)
            return {self.value(k, what, before): self.value(v, what, before) for k, v in zip(node.keys, node.values)}
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            left, right = self.value(node.left, what, before), self.value(node.right, what, before)
            if type(left) is not type(right) or not isinstance(left, (str, list)):
                raise UnsupportedFormat(f"{what}: '+' of {type(left).__name__} and {type(right).__name__}", what)
            return left + right
        if isinstance(node, ast.JoinedStr):
            parts = []
            for v in node.values:
                if isinstance(v, ast.Constant):
                    parts.append(str(v.value))
                    continue
                assert isinstance(v, ast.FormattedValue)
                inner = self.value(v.value, what, before)
                spec = self.value(v.format_spec, what, before) if v.format_spec is not None else ""
                if not isinstance(inner, (str, int, float)) or v.conversion not in (-1, ord("s")):
                    raise UnsupportedFormat(f"{what}: f-string field {ast.unparse(v.value)!r} is not a constant", what)
                parts.append(format(inner, spec))
            return "".join(parts)
        if isinstance(node, ast.Name):
            return self.name(node.id, what, before)
        raise UnsupportedFormat(
            f"{what}: {ast.unparse(node)[:80]!r} is not a literal, a name bound to one at module top level, "
            "or a '+' of those", what)

    def name(self, name: str, what: str, before: int) -> Any:
        stmts = self.bindings.get(name, [])
        if len(stmts) != 1 or name in self.active:
            why = "is never assigned at module top level" if not stmts else "is assigned more than once"
            raise UnsupportedFormat(f"{what}: the name {name!r} {why}", what)
        stmt = stmts[0]
        if stmt.lineno >= before:
            raise UnsupportedFormat(f"{what}: the name {name!r} is assigned after the load_inline call", what)
        if not isinstance(stmt, (ast.Assign, ast.AnnAssign)) or stmt.value is None or not all(
            isinstance(t, ast.Name) for t in (stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target])
        ):
            raise UnsupportedFormat(f"{what}: the name {name!r} is not bound by a plain assignment", what)
        self.active.add(name)
        try:
            return self.value(stmt.value, what, before)
        finally:
            self.active.discard(name)


def _assigned_names(stmt: ast.stmt) -> list[str]:
    """Names a top-level statement binds (assignments, loops, with, imports, defs)."""
    out = []
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [stmt.name]
    if isinstance(stmt, (ast.Import, ast.ImportFrom)):
        return [(a.asname or a.name).split(".")[0] for a in stmt.names]
    for node in ast.walk(stmt):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            out.append(node.id)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            break
    return out


def _strings(value: Any, what: str, allow_none: bool = True) -> tuple[str, ...]:
    if value is None and allow_none:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (list, tuple)):
        bad = next((i for i, v in enumerate(value) if not isinstance(v, str)), None)
        if bad is None:
            return tuple(value)
        raise UnsupportedFormat(f"{what}: expected a string or a list of strings; item {bad} is a "
                                f"{type(value[bad]).__name__}", what)
    raise UnsupportedFormat(f"{what}: expected a string or a list of strings, got {type(value).__name__}", what)


def _functions(value: Any) -> tuple[str, ...]:
    if isinstance(value, dict):
        value = list(value)
    names = _strings(value, "functions")
    bad = [n for n in names if not re.fullmatch(r"[A-Za-z_]\w*", n)]
    if bad:
        raise UnsupportedFormat(f"functions: {bad[0]!r} is not a C++ identifier", "functions")
    return names


def _flag_tokens(values: tuple[str, ...]) -> list[str]:
    """The flags a list gives the compiler: torch's ``load_inline`` writes a list's items into its ninja
    command line joined by spaces, so an empty item (``extra_cflags=[""]``, KernelBench's own example)
    adds nothing and ``"-O3 --use_fast_math"`` adds two flags.  Target architecture flags (``-arch=sm_80``,
    ``-gencode arch=compute_80,code=sm_80``, ``--gpu-architecture sm_90``) are dropped: the verifier
    compiles for the device it runs on."""
    tokens = [t for v in values for t in v.split()]
    out: list[str] = []
    skip = False
    for t in tokens:
        if skip:
            skip = False
            continue
        arch = _ARCH_FLAG.match(t)
        if arch:
            skip = not arch.group(2)  # "-arch sm_80": the value is the next token
            continue
        out.append(t)
    return out


def _safe_flag(flag: str) -> bool:
    """Whether a compiler flag is in the safe subset (:data:`_SAFE_FLAG`, or :data:`_PASSED_FLAG` of safe ones)."""
    passed = _PASSED_FLAG.match(flag)
    if passed:
        return all(_SAFE_FLAG.match(f) and not _PASSED_FLAG.match(f) for f in passed.group(2).split(","))
    return bool(_SAFE_FLAG.match(flag))


def _flags(values: tuple[str, ...], what: str, allow_vendor_libraries: bool = False) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Check one flag argument of ``load_inline`` (``what``: ``extra_cflags``, ``extra_cuda_cflags``,
    ``extra_ldflags`` or ``extra_include_paths``) and normalise it (:func:`_flag_tokens`).

    Returns:
        ``(flags, vendor)``: the compiler flags to pass (none for ``extra_ldflags``: its libraries of
        :data:`_LINKED_ANYWAY` are dropped), and the ``-l<vendor library>`` flags, accepted with
        ``allow_vendor_libraries`` (in any list: linking is the build's business).
    Raises:
        UnsupportedFormat: a flag outside what ``what`` accepts (the message names the argument, the flag
            and what that argument accepts); rule ``cuda-library`` for a vendor library's ``-l`` flag when
            vendor libraries are not allowed, and always for NCCL / NVSHMEM.
    """
    flags: list[str] = []
    vendor: list[str] = []
    accepted = "-l" + ", -l".join(VENDOR_LIBRARIES)
    for v in _flag_tokens(values):
        if allow_vendor_libraries and v.startswith("-l") and v[2:] in VENDOR_LIBRARIES:
            vendor.append(v)
        elif _LIBRARY_FLAG.match(v):
            hint = (f"not among the vendor math libraries accepted ({accepted})" if allow_vendor_libraries
                    else f"verify.allow_vendor_libraries=true accepts {accepted}")
            raise UnsupportedFormat(f"{what}: {v!r} links a vendor library ({hint})", what, rule="cuda-library")
        elif what == "extra_include_paths":
            raise UnsupportedFormat(f"{what}: {v!r} is not supported: a candidate may not add include folders "
                                    "(torch's and the CUDA toolkit's headers are found already)", what)
        elif what == "extra_ldflags":
            if v not in _LINKED_ANYWAY:
                raise UnsupportedFormat(
                    f"{what}: {v!r} is not supported: extra_ldflags may name only libraries every extension links "
                    f"anyway ({', '.join(sorted(_LINKED_ANYWAY))}) and, with verify.allow_vendor_libraries=true, "
                    f"the vendor math libraries ({accepted})", what)
        elif _safe_flag(v):
            flags.append(v)
        else:
            raise UnsupportedFormat(f"{what}: {v!r} is not supported (allowed: -O0..-O3, fast-math, -std=c++14/17/20, "
                                    "-D macros with a number or no value, -U macros, --expt-* flags, -lineinfo, "
                                    "warnings, -maxrregcount, -Xptxas / -Xcompiler with those)", what)
    return tuple(flags), tuple(vendor)


def spec_from_call(args: tuple, kwargs: dict[str, Any], var: str | None = None, line: int | None = None, *,
                   allow_vendor_libraries: bool = False) -> InlineSpec:
    """Normalise the arguments of one ``load_inline(...)`` call into an :class:`InlineSpec`.

    Used on the statically read values and, in the worker, on the values the candidate really
    passes (the two must give the same :meth:`InlineSpec.key`).  Flag lists are read as torch's build
    reads them (:func:`_flag_tokens`: ``[""]`` is no flag, ``"-O3 -lineinfo"`` two).  With
    ``allow_vendor_libraries`` (``VerifyConfig.allow_vendor_libraries``) the flag lists may hold
    ``-l<name>`` for the names of :data:`VENDOR_LIBRARIES`, kept in :attr:`InlineSpec.extra_ldflags`.

    Raises:
        UnsupportedFormat: a missing name, an unknown keyword, flags outside the safe subset
            (rule ``cuda-library`` for ``-lcublas``... when vendor libraries are not allowed, and
            always for ``-lnccl`` / ``-lnvshmem``), ``is_python_module=False``, values of the wrong type.
    """
    if len(args) > len(_POSITIONAL):
        raise UnsupportedFormat(f"load_inline takes at most {len(_POSITIONAL)} positional arguments here "
                                f"({', '.join(_POSITIONAL)}); pass the others by keyword", "arguments")
    values = dict(zip(_POSITIONAL, args))
    for k, v in kwargs.items():
        if k in values:
            raise UnsupportedFormat(f"load_inline got {k!r} twice", k)
        values[k] = v
    unknown = sorted(set(values) - set(_POSITIONAL) - {"functions", *_FLAG_KWARGS, "no_implicit_headers"} - _IGNORED_KWARGS)
    if unknown:
        raise UnsupportedFormat(f"load_inline keyword {unknown[0]!r} is not supported", unknown[0])
    if values.get("is_python_module", True) is not True:
        raise UnsupportedFormat("is_python_module must be True", "is_python_module")
    name = values.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_]\w*", name):
        raise UnsupportedFormat(f"name: {name!r} is not an identifier string", "name")
    if "cpp_sources" not in values:
        raise UnsupportedFormat("cpp_sources is missing", "cpp_sources")
    flags = {k: _flags(_strings(values.get(k), k), k, allow_vendor_libraries) for k in _FLAG_KWARGS}
    vendor = tuple(dict.fromkeys(f for _, libs in flags.values() for f in libs))  # in order, once each
    return InlineSpec(
        name=name,
        cpp_sources=_strings(values["cpp_sources"], "cpp_sources", allow_none=False),
        cuda_sources=_strings(values.get("cuda_sources"), "cuda_sources"),
        functions=_functions(values.get("functions")),
        extra_cflags=flags["extra_cflags"][0],
        extra_cuda_cflags=flags["extra_cuda_cflags"][0],
        no_implicit_headers=bool(values.get("no_implicit_headers", False)),
        extra_ldflags=vendor,
        var=var,
        line=line,
    )


def extract_specs(src: str, *, allow_vendor_libraries: bool = False) -> list[InlineSpec]:
    """Read every ``load_inline`` call of a candidate statically (never executes it).

    Each call must be the value of a top-level ``name = load_inline(...)`` assignment; its
    arguments must resolve to constants (see the module docstring).  ``allow_vendor_libraries``
    (``VerifyConfig.allow_vendor_libraries``) accepts vendor ``-l`` flags (:func:`spec_from_call`).

    Returns:
        The specs in source order (empty when the module has no ``load_inline`` call).
    Raises:
        UnsupportedFormat: an argument is dynamic (the message names it), or a call is not a
            top-level assignment.
        SyntaxError: ``src`` is not Python.
    """
    tree = parse_python(src)
    aliases = _aliases(tree)
    resolver = _Resolver(tree)
    top_calls: dict[int, tuple[str, int]] = {}
    for stmt in tree.body:
        if (isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None
                and _is_load_inline_call(stmt.value, aliases)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            if len(targets) == 1 and isinstance(targets[0], ast.Name):
                top_calls[id(stmt.value)] = (targets[0].id, stmt.lineno)
    specs = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        is_call = _is_load_inline_call(node, aliases) or (
            isinstance(node.func, ast.Name) and node.func.id == "load_inline")
        if not is_call:
            continue
        if id(node) not in top_calls:
            raise UnsupportedFormat("load_inline must be called once per extension, as `name = load_inline(...)` "
                                    "at module top level", "load_inline", getattr(node, "lineno", None))
        var, line = top_calls[id(node)]
        if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
            raise UnsupportedFormat("load_inline arguments: *args / **kwargs are not supported", "arguments", line)
        try:
            args = tuple(resolver.value(a, _POSITIONAL[i] if i < len(_POSITIONAL) else f"argument {i}", line)
                         for i, a in enumerate(node.args))
            kwargs = {k.arg: (None if k.arg in _IGNORED_KWARGS else resolver.value(k.value, k.arg, line))
                      for k in node.keywords if k.arg is not None}
            specs.append(spec_from_call(args, kwargs, var=var, line=line,
                                        allow_vendor_libraries=allow_vendor_libraries))
        except UnsupportedFormat as e:
            e.line = e.line or line
            raise
    specs.sort(key=lambda s: s.line or 0)
    return specs


# ----------------------------------------------------------------------------------------------
# Worker side: execute the candidate with load_inline bound to the prebuilt modules
# ----------------------------------------------------------------------------------------------

_IMPORT_NAME = dis.opmap["IMPORT_NAME"]
_current: list[tuple[Any, str]] = []  # (extension module, counting) of the candidate being verified
_loaded: dict[str, Any] = {}  # .so path -> extension module (a .so loads once per process)
_load_error: type | None = None


def _load_error_type() -> type:
    global _load_error
    if _load_error is None:
        from dice_ray.launch import CompileError

        class _InlineLoadError(CompileError, InlineLoadError):
            def __init__(self, message: str):
                RuntimeError.__init__(self, message)
                self.log, self.arch = message, "?"

        _load_error = _InlineLoadError
    return _load_error


def reset() -> None:
    """Forget the extensions of the previous candidate (the harness calls it before a fast-format
    one; :func:`exec_inline` does it itself), so they no longer count in :func:`launch_count`."""
    _current.clear()


def launch_count() -> int:
    """Launches of the current candidate's kernels through its load_inline extensions: the host
    counters (no CUDA call), or the device counter for a module counted on the device."""
    total = 0
    for mod, counting in _current:
        total += int(mod._dice_ray_kernel_runs() if counting == "device" else mod._dice_ray_launches())
    return total


def kernel_runs() -> int:
    """Kernels of the current candidate that really started on the GPU (device counters, read with
    ``cudaMemcpyFromSymbol``: synchronises with the device; never inside a timed window)."""
    return sum(int(mod._dice_ray_kernel_runs()) for mod, _ in _current)


@contextlib.contextmanager
def kernels_suppressed() -> Iterator[None]:
    """Inside the block, every ``__global__`` kernel of the current candidate's extensions returns
    at entry: launches happen and are counted (host and device counters, so ``no-kernel-launch``
    does not fire), no kernel work is done.  Torch ops, ``cudaMemcpy`` and vendor-library kernels
    in the candidate's host code still run.

    The verifier's ablation of the candidate's kernels (dice-ray's own rule ``kernel-not-used``,
    :mod:`dice_ray.verify.harness`).  Sets the ``__constant__`` flag compiled into each extension
    (:data:`~dice_ray.verify.inline_compile.COUNTER_PREFIX`) through its ``_dice_ray_skip_kernels``
    binding, which candidates cannot reach (the facade the candidate gets holds only its
    ``functions``; C++ names containing ``dice_ray`` are ``patching``).  Setting and clearing the flag
    each synchronise the device (work queued before runs its kernels, work after sees the flag) and
    reset the CUDA runtime's last error (a launch refused inside the block, e.g. a grid computed
    from a kernel's unwritten output, would otherwise stop the host counter from counting the
    launches after it).  The flag is cleared on exit, also when the block raises.

    Raises:
        RuntimeError: an extension could not set its flag (a ``cudaError_t`` code; the block does
            not run), or could not clear it on exit.
    """
    mods = [mod for mod, _ in _current]
    done: list[Any] = []
    try:
        for mod in mods:
            err = int(mod._dice_ray_skip_kernels(1))
            done.append(mod)  # cleared on exit even when setting failed half way
            if err:
                raise RuntimeError(f"load_inline extension {mod.__name__}: setting the kernel switch failed "
                                   f"(cudaError_t {err})")
        yield
    finally:
        failed = [mod.__name__ for mod in done if int(mod._dice_ray_skip_kernels(0))]
        if failed:
            raise RuntimeError(f"load_inline extensions {failed}: clearing the kernel switch failed")


class _Stub:
    """A compile-only extension: the objects compiled, nothing can run (the dry run stops here)."""

    def __init__(self, name: str, fn: str):
        self.__name__ = fn
        self._what = f"{name}.{fn}"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"compile-only: {self._what} was compiled to object files and cannot run "
                                  "on meta tensors")


def _import_so(entry: dict[str, Any]) -> Any:
    path = entry["path"]
    mod = _loaded.get(path)
    if mod is None:
        spec = importlib.util.spec_from_file_location(entry["module"], path)
        if spec is None or spec.loader is None:
            raise _load_error_type()(f"cannot load the extension built at {path}")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        _loaded[path] = mod
    return mod


def _make_loader(entries: list[dict[str, Any]], allow_vendor_libraries: bool = False) -> Any:
    by_key = {e["key"]: e for e in entries}

    def load_inline(*args: Any, **kwargs: Any) -> types.ModuleType:
        try:
            spec = spec_from_call(args, kwargs, allow_vendor_libraries=allow_vendor_libraries)
        except UnsupportedFormat as e:
            raise _load_error_type()(f"[{e.rule}] load_inline at run time: {e}") from None
        entry = by_key.get(spec.key())
        if entry is None:
            raise _load_error_type()(
                f"[unsupported-format] load_inline(name={spec.name!r}) was called with arguments that differ from "
                "the ones read statically (only constant arguments are supported)")
        facade = types.ModuleType(spec.name)
        if entry.get("path"):
            mod = _import_so(entry)
            for fn in spec.functions:
                setattr(facade, fn, getattr(mod, fn))
            if entry.get("has_cuda", True) and (mod, entry.get("counting", "host")) not in _current:
                _current.append((mod, entry.get("counting", "host")))
        else:
            for fn in spec.functions:
                setattr(facade, fn, _Stub(spec.name, fn))
        return facade

    return load_inline


def _inline_import(guarded: bool) -> Any:
    import builtins

    from dice_ray.verify.rules import import_allowed

    own_code = "<candidate>"

    def _import(name, globals=None, locals=None, fromlist=(), level=0):  # noqa: A002, ANN001
        # as harness._guarded_import: only the candidate's own import statements are checked
        frame = sys._getframe(1)
        own = frame.f_code.co_filename == own_code and frame.f_code.co_code[frame.f_lasti] == _IMPORT_NAME
        names = tuple(fromlist or ())
        if guarded and own and (level or not import_allowed(name, names, inline=True)):
            from dice_ray.verify.harness import RuleBroken

            what = f"from {name} import {', '.join(names)}" if names else f"import {name}"
            raise RuleBroken("forbidden-import", f"{what} at run time")
        return builtins.__import__(name, globals, locals, fromlist, level)

    return _import


def exec_inline(candidate_src: str, inline_job: dict[str, Any], guarded: bool) -> dict[str, Any]:
    """Execute a load_inline candidate in the worker with ``load_inline`` bound to the prebuilt
    extensions of ``inline_job`` (the verifier's ``job["inline"]``).

    ``inline_job["modules"]``: one dict per spec with ``key`` (:meth:`InlineSpec.key`), ``module``
    (the ``PyInit_`` name), ``path`` (the ``.so``; None in compile-only mode: the functions become
    stubs), ``counting`` and ``has_cuda``; ``inline_job["allow_vendor_libraries"]`` (default False)
    is ``VerifyConfig.allow_vendor_libraries``, so the run-time call is read with the same rules as
    the static one.  While the module runs, ``torch.utils.cpp_extension`` is
    a stand-in holding only that ``load_inline`` (``import torch.utils.cpp_extension``, ``from
    torch.utils.cpp_extension import load_inline`` and ``from torch.utils import cpp_extension``
    all reach it); the real module is put back afterwards.

    Returns:
        The candidate's namespace.
    Raises:
        dice_ray.launch.CompileError (an :class:`InlineLoadError`): a call that does not match a
            built spec; RuleBroken (forbidden import); whatever the module raises.
    """
    import torch.utils

    from dice_ray.verify.harness import _candidate_builtins

    reset()
    fake = types.ModuleType("torch.utils.cpp_extension")
    fake.load_inline = _make_loader(list(inline_job.get("modules", [])),  # type: ignore[attr-defined]
                                    bool(inline_job.get("allow_vendor_libraries", False)))
    missing = object()
    saved_mod = sys.modules.get("torch.utils.cpp_extension", missing)
    saved_attr = torch.utils.__dict__.get("cpp_extension", missing)
    sys.modules["torch.utils.cpp_extension"] = fake
    torch.utils.cpp_extension = fake  # type: ignore[attr-defined]
    try:
        filename = "<candidate>"
        linecache.cache[filename] = (len(candidate_src), None, candidate_src.splitlines(True), filename)
        code = compile(candidate_src, filename, "exec")
        b = _candidate_builtins(guarded)
        b["__import__"] = _inline_import(guarded)
        ns: dict[str, Any] = {"__name__": "dice_ray_candidate", "__builtins__": b}
        exec(code, ns)  # noqa: S102 - the sandboxed worker exists to do this
        return ns
    finally:
        if saved_mod is missing:
            sys.modules.pop("torch.utils.cpp_extension", None)
        else:
            sys.modules["torch.utils.cpp_extension"] = saved_mod
        if saved_attr is missing:
            torch.utils.__dict__.pop("cpp_extension", None)
        else:
            torch.utils.cpp_extension = saved_attr  # type: ignore[attr-defined]
