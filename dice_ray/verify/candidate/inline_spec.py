"""The load_inline candidate format (KernelBench / DICE), read statically: its ``load_inline`` calls as specs.

A candidate in this format is a Python module that, at top level, calls
``ext = load_inline(name=..., cpp_sources=..., cuda_sources=..., functions=[...])`` and whose
``ModelNew.forward`` calls ``ext.<function>(...)`` (KernelBench's ``eval.py`` format; every record
of DICE's ``kernel_infilling_evaluation.json`` has this shape).  The verifier never runs torch's
``load_inline`` (a ninja build, ~53 s a candidate on the H200 host, DESIGN.md): it

1. reads the call statically (:func:`extract_specs`, :mod:`ast`, once a candidate:
   :class:`~dice_ray.verify.candidate.candidate.Candidate`; ``self.ext = load_inline(...)`` in a class's
   ``__init__`` too, whose local names bound once to constants are read as well): every argument must be a string
   literal, a list/tuple/dict of them, a name bound once at module top level to one (also as an
   element of a tuple unpacked into names: ``BLOCK, ITEMS = 256, 4``), an f-string of those, a
   ``+`` of those, or negation and bounded arithmetic on numbers (``64 * 1024``); anything else is ``unsupported-format``
   (:class:`UnsupportedFormat`, a ``compile_error``), its message naming the argument;
2. builds each :class:`InlineSpec` with :class:`dice_ray.verify.candidate.inline_build.InlineBuilder` in the
   verifier's process (content-hash cache, parallel, resource-limited compilers), after
   :func:`dice_ray.verify.candidate.inline_counters.instrument_cuda` added launch counters to the CUDA source;
3. in the sandboxed worker, :func:`dice_ray.verify.trials.execution.exec_inline` executes the candidate with
   ``load_inline`` bound to a loader that imports the prebuilt ``.so`` (:mod:`dice_ray.verify.trials.inline_loader`;
   nothing compiles in the worker: seccomp forbids fork/exec there) once the call's arguments hash to the built
   spec (:func:`spec_from_call`, the same reading as here).

Vendor libraries: by default cuBLAS, cuDNN & co. are the cheat rule ``cuda-library`` (static, and
``extra_ldflags=["-lcublas"]`` here); with ``VerifyConfig.allow_vendor_libraries`` the ``-l`` flags
of :data:`VENDOR_LIBRARIES` are accepted (:attr:`InlineSpec.extra_ldflags`) and the build links what
:meth:`InlineSpec.vendor_libraries` finds.  The launch counters only see the candidate's own
``__global__`` kernels, so a forward that only calls cuBLAS still breaks ``no-kernel-launch``.

Runs in the worker too (:func:`spec_from_call`): no pydantic, no torch.
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from dice_ray.pysource import parse_python

__all__ = [
    "LOAD_INLINE",
    "VENDOR_LIBRARIES",
    "InlineSpec",
    "UnsupportedFormat",
    "extract_specs",
    "is_inline",
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
        """``main.cpp``'s ``cpp_sources`` part as torch builds it (sources joined by newlines)."""
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


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _power(a: Any, b: Any) -> Any:
    if abs(b) > 64 or abs(a) > 2**32:
        raise ValueError("power too large")
    return a**b


def _shift(a: Any, b: Any) -> Any:
    if not (isinstance(a, int) and isinstance(b, int)) or not 0 <= b <= 64:
        raise ValueError("shift")
    return a << b


#: arithmetic on numbers a constant argument may use (``64 * 1024``, ``2 ** 10``, ``1 << 20``), bounded
_ARITHMETIC = {ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b, ast.FloorDiv: lambda a, b: a // b,
               ast.Div: lambda a, b: a / b, ast.Mod: lambda a, b: a % b, ast.Pow: _power, ast.LShift: _shift}


class _Resolver:
    """Values of module-level constant expressions (literals, names bound once, also as an element of a tuple
    unpacked into names, ``+``, f-strings, negation and bounded arithmetic on numbers)."""

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
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            operand = self.value(node.operand, what, before)
            if _number(operand):
                return -operand if isinstance(node.op, ast.USub) else operand
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            left, right = self.value(node.left, what, before), self.value(node.right, what, before)
            if _number(left) and _number(right):
                return left + right
            if type(left) is not type(right) or not isinstance(left, (str, list)):
                raise UnsupportedFormat(f"{what}: '+' of {type(left).__name__} and {type(right).__name__}", what)
            return left + right
        if isinstance(node, ast.BinOp) and type(node.op) in _ARITHMETIC:  # GRID_CAP = 64 * 1024
            left, right = self.value(node.left, what, before), self.value(node.right, what, before)
            if _number(left) and _number(right):
                try:
                    return _ARITHMETIC[type(node.op)](left, right)
                except (ArithmeticError, ValueError):
                    pass
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
        value = _bound_value(stmt, name)
        if value is None:
            raise UnsupportedFormat(f"{what}: the name {name!r} is not bound by a plain assignment", what)
        self.active.add(name)
        try:
            return self.value(value, what, before)
        finally:
            self.active.discard(name)


class _InitResolver(_Resolver):
    """Values of a ``load_inline`` call's arguments in a class's ``__init__`` (:func:`extract_specs`): ``__init__``'s
    local names bound once, by a plain assignment among its own statements (not inside an ``if``, a loop or a
    ``with``), before the call, to constant expressions; other names as at module top level (the module has run when
    ``__init__`` does), and the values of module-level names read in module scope.  A parameter of ``__init__`` is
    known only when ``ModelNew`` is built: ``unsupported-format``."""

    def __init__(self, tree: ast.Module, init: ast.FunctionDef):
        super().__init__(tree)
        self.init = init
        a = init.args
        self.params = {x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg] if x is not None}
        self.local_stmts: dict[str, list[ast.stmt]] = {}
        for stmt in init.body:
            for name in _assigned_names(stmt):
                self.local_stmts.setdefault(name, []).append(stmt)
        nodes = list(ast.walk(init))
        self.locals = {n.id for n in nodes if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del))}
        self.locals |= {a.asname or a.name.split(".")[0] for n in nodes if isinstance(n, (ast.Import, ast.ImportFrom))
                        for a in n.names}
        self.module_scope = 0  # > 0 while a module-level name's value is read

    def name(self, name: str, what: str, before: int) -> Any:
        if self.module_scope or (name not in self.params and name not in self.locals):
            self.module_scope += 1
            try:
                return super().name(name, what, 1 << 62)  # the module has run when __init__ does
            finally:
                self.module_scope -= 1
        if name in self.params:
            raise UnsupportedFormat(f"{what}: {name!r} is a parameter of __init__, known only when ModelNew is built; "
                                    "the verifier builds each extension before that, from constant arguments", what)
        stmts = self.local_stmts.get(name, [])
        value = _bound_value(stmts[0], name) if len(stmts) == 1 else None
        if value is None or name in self.active or stmts[0].lineno >= before or self._rebound(name, stmts[0]):
            raise UnsupportedFormat(f"{what}: the local name {name!r} of __init__ is not bound once, by a plain "
                                    "assignment among __init__'s own statements before the call", what)
        self.active.add(name)
        try:
            return self.value(value, what, before)
        finally:
            self.active.discard(name)

    def _rebound(self, name: str, stmt: ast.stmt) -> bool:
        """Whether ``name`` is bound anywhere in ``__init__`` but ``stmt`` (inside an ``if``, a loop, a ``with``...)."""
        own = {id(n) for n in ast.walk(stmt)}
        return any(isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, (ast.Store, ast.Del))
                   and id(n) not in own for n in ast.walk(self.init))


def _bound_value(stmt: ast.stmt, name: str) -> ast.AST | None:
    """The expression a plain top-level assignment binds ``name`` to: ``name = value`` (every target a name), or its
    element of a literal tuple unpacked into names (``D, H, W = 16, 32, 32``); None otherwise."""
    if not isinstance(stmt, (ast.Assign, ast.AnnAssign)) or stmt.value is None:
        return None
    targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
    if all(isinstance(t, ast.Name) for t in targets):
        return stmt.value
    if len(targets) == 1 and isinstance(targets[0], (ast.Tuple, ast.List)) and isinstance(stmt.value, (ast.Tuple, ast.List)) \
            and len(targets[0].elts) == len(stmt.value.elts):
        for t, v in zip(targets[0].elts, stmt.value.elts):
            if isinstance(t, ast.Name) and t.id == name and not isinstance(v, ast.Starred):
                return v
    return None


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


def _misplaced_call(tree: ast.Module, call: ast.Call) -> str:
    """Why a ``load_inline`` call is not read, and where to move it: the verifier builds every extension before the
    module runs, from the calls it reads at module top level and in ``__init__``."""
    where = None
    for stmt in tree.body:
        for outer in ast.walk(stmt):
            if isinstance(outer, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(n is call for n in ast.walk(outer)):
                where = outer  # the innermost one is found last
    if where is not None and any(where is init for init in _inits(tree)):
        return ("load_inline is called inside __init__() other than as `self.<name> = load_inline(...)`, a statement "
                "of __init__'s own (not inside an if, a loop, a with or an expression, not through a local name): the "
                "verifier builds each extension before the module runs, from calls it can read; write it so, or as "
                "`ext = load_inline(...)` at module top level")
    if where is not None:
        return (f"load_inline is called inside {where.name}(): the verifier builds each extension before the module "
                "runs, from a call at module top level or a `self.<name> = load_inline(...)` statement of __init__; "
                "move it there, with constant arguments, and call ext.<function>(...) in forward")
    return ("load_inline must be called once per extension, as `name = load_inline(...)` at module top level (not "
            "inside an expression, a loop or a condition)")


def _inits(tree: ast.Module) -> list[ast.FunctionDef]:
    """The ``__init__`` methods of the module-level classes."""
    return [m for c in tree.body if isinstance(c, ast.ClassDef) for m in c.body
            if isinstance(m, ast.FunctionDef) and m.name == "__init__"]


def _first_param(fn: ast.FunctionDef) -> str | None:
    params = [*fn.args.posonlyargs, *fn.args.args]
    return params[0].arg if params else None


def extract_specs(src: str | ast.Module, *, allow_vendor_libraries: bool = False) -> list[InlineSpec]:
    """Read every ``load_inline`` call of a candidate statically (never executes it), from its text or its parse
    tree (:attr:`Candidate.tree <dice_ray.verify.candidate.candidate.Candidate.tree>`: read once a candidate).

    Each call must be the value of a top-level ``name = load_inline(...)`` assignment, or of a
    ``self.<name> = load_inline(...)`` statement of a module-level class's ``__init__`` (its own statement, not inside
    an ``if``, a loop or a ``with``: it runs once each time the class is built; the spec's ``var`` is
    ``"self.<name>"``); its arguments must resolve to constants (see the module docstring; in ``__init__`` also its
    local names bound once to constants before the call, :class:`_InitResolver`).  ``allow_vendor_libraries``
    (``VerifyConfig.allow_vendor_libraries``) accepts vendor ``-l`` flags (:func:`spec_from_call`).

    Returns:
        The specs in source order (empty when the module has no ``load_inline`` call).
    Raises:
        UnsupportedFormat: an argument is dynamic (the message names it: a parameter of ``__init__`` too), or a
            call is neither a top-level assignment nor a ``self.<name> = load_inline(...)`` statement of ``__init__``.
        SyntaxError: ``src`` is not Python.
    """
    tree = parse_python(src) if isinstance(src, str) else src
    aliases = _aliases(tree)
    module = _Resolver(tree)
    # id(call) -> (the name holding the extension, the line, the resolver of its arguments)
    top_calls: dict[int, tuple[str, int, _Resolver]] = {}
    for stmt in tree.body:
        if (isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None
                and _is_load_inline_call(stmt.value, aliases)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            if len(targets) == 1 and isinstance(targets[0], ast.Name):
                top_calls[id(stmt.value)] = (targets[0].id, stmt.lineno, module)
    for init in _inits(tree):
        for stmt in init.body:  # self.<name> = load_inline(...), a statement of __init__'s own
            if (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and _is_load_inline_call(stmt.value, aliases)
                    and isinstance(stmt.targets[0], ast.Attribute) and isinstance(stmt.targets[0].value, ast.Name)
                    and stmt.targets[0].value.id == "self" and _first_param(init) == "self"):
                top_calls[id(stmt.value)] = (f"self.{stmt.targets[0].attr}", stmt.lineno, _InitResolver(tree, init))
    specs = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        is_call = _is_load_inline_call(node, aliases) or (
            isinstance(node.func, ast.Name) and node.func.id == "load_inline")
        if not is_call:
            continue
        if id(node) not in top_calls:
            raise UnsupportedFormat(_misplaced_call(tree, node), "load_inline", getattr(node, "lineno", None))
        var, line, resolver = top_calls[id(node)]
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
