"""The task model: one KernelBench-format problem and, optionally, a working solution.

A *reference* (KernelBench format, also the ``pytorch_code`` of DICE's RL data) is a Python module
that defines ``class Model(nn.Module)`` with a ``forward``, ``get_inputs()`` (the forward's
arguments) and ``get_init_inputs()`` (the constructor's arguments).  A *solution* defines
``class ModelNew`` with the same constructor signature, in one of two formats:

* ``"fast"``: dice-ray's NVRTC format (``cuda_source = r\"\"\"...\"\"\"``,
  ``kernels = load_cuda(cuda_source)``, see INTERFACES.md);
* ``"load_inline"``: KernelBench / DICE's ``torch.utils.cpp_extension.load_inline`` format.

Sources are untrusted (DICE records, user files): validation here only parses them with
:mod:`ast` and never executes them; references run only inside the verifier's sandbox.
"""

from __future__ import annotations

import ast
import functools
import math
import re
from dataclasses import dataclass
from typing import Literal

from dice_ray.pysource import parse_python

_NEWLINE = re.compile(r"\r\n|\r|\n")  # Python's line ends

SolutionFormat = Literal["fast", "load_inline"]
#: :attr:`Task.role` values: the phase whose task set a task belongs to, or ``"both"``
TASK_ROLES: tuple[str, ...] = ("both", "infill", "e2e")
SOLUTION_FORMATS: tuple[str, ...] = ("fast", "load_inline")

#: Longest source accepted (characters); DICE's longest reference is ~1.6k, its longest solution ~9k.
MAX_SOURCE_CHARS = 200_000


class TaskError(ValueError):
    """A task's field breaks a validation rule.

    Attributes:
        rule: short id of the broken rule (``"syntax-error"``, ``"no-model-class"``, ...), used by
            :class:`dice_ray.tasks.loaders.LoadReport` to count rejections by reason.
        message: what broke it (``str(error)`` is ``"rule: message"``).
    """

    def __init__(self, rule: str, message: str):
        super().__init__(f"{rule}: {message}")
        self.rule, self.message = rule, message

    def __reduce__(self):  # pickles with its own arguments (it crosses Ray and process boundaries)
        return type(self), (self.rule, self.message)


def _parse(src: object, field: str) -> ast.Module:
    if not isinstance(src, str):
        raise TaskError("not-a-string", f"{field} must be a str, got {type(src).__name__}")
    if not src.strip():
        raise TaskError("empty-source", f"{field} is empty")
    if len(src) > MAX_SOURCE_CHARS:
        raise TaskError("too-large", f"{field} has {len(src)} characters, the limit is {MAX_SOURCE_CHARS}")
    try:
        return parse_python(src)
    except SyntaxError as e:
        at = f"line {e.lineno}: " if e.lineno else ""
        raise TaskError("syntax-error", f"{field} does not parse: {at}{e.msg}") from None
    except ValueError as e:  # e.g. NUL bytes
        raise TaskError("syntax-error", f"{field} does not parse: {e}") from None


def _top_level_names(tree: ast.Module) -> tuple[dict[str, ast.ClassDef], set[str]]:
    classes: dict[str, ast.ClassDef] = {}
    functions: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            classes[node.name] = node
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            functions.add(node.name)
        elif isinstance(node, ast.Assign):  # get_inputs = lambda: [...]
            functions.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return classes, functions


def _has_method(cls: ast.ClassDef, name: str) -> bool:
    return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name for n in cls.body)


def validate_reference(src: object, field: str = "the reference") -> ast.Module:
    """Check that ``src`` is a KernelBench-format reference, by parsing only (never executing).

    Rules: a non-empty str of at most :data:`MAX_SOURCE_CHARS` characters that parses as Python and
    defines, at top level, ``class Model`` with a ``forward`` method, ``get_inputs`` and
    ``get_init_inputs``.

    Returns:
        The parsed module.
    Raises:
        TaskError: naming ``field`` and the broken rule (``not-a-string``, ``empty-source``,
            ``too-large``, ``syntax-error``, ``no-model-class``, ``no-forward``, ``no-get-inputs``,
            ``no-get-init-inputs``).
    """
    tree = _parse(src, field)
    classes, functions = _top_level_names(tree)
    if "Model" not in classes:
        raise TaskError("no-model-class", f"{field} must define a top-level class Model (KernelBench format)")
    if not _has_method(classes["Model"], "forward"):
        raise TaskError("no-forward", f"{field}: class Model must define forward()")
    for fn in ("get_inputs", "get_init_inputs"):
        if fn not in functions:
            raise TaskError(f"no-{fn.replace('_', '-')}", f"{field} must define a top-level function {fn}()")
    return tree


def validate_solution(src: object, fmt: object, field: str = "the solution") -> ast.Module:
    """Check that ``src`` is a solution in format ``fmt``, by parsing only (never executing).

    Rules: ``fmt`` is ``"fast"`` or ``"load_inline"``; ``src`` parses (see :func:`validate_reference`
    for the string rules) and defines a top-level ``class ModelNew`` with ``forward``; a ``"fast"``
    solution calls ``load_cuda``, a ``"load_inline"`` one calls ``load_inline``.

    Raises:
        TaskError: naming ``field`` and the broken rule (``bad-format``, ``syntax-error``,
            ``no-modelnew-class``, ``no-forward``, ``no-loader-call``, ...).
    """
    if fmt not in SOLUTION_FORMATS:
        raise TaskError("bad-format", f"solution_format must be one of {SOLUTION_FORMATS}, got {fmt!r}")
    tree = _parse(src, field)
    classes, _ = _top_level_names(tree)
    if "ModelNew" not in classes:
        raise TaskError("no-modelnew-class", f"{field} must define a top-level class ModelNew")
    if not _has_method(classes["ModelNew"], "forward"):
        raise TaskError("no-forward", f"{field}: class ModelNew must define forward()")
    loader = "load_cuda" if fmt == "fast" else "load_inline"
    if not any(isinstance(n, ast.Call) and call_name(n) == loader for n in ast.walk(tree)):
        raise TaskError("no-loader-call", f"{field} in format {fmt!r} must call {loader}()")
    return tree


class SourcePositions:
    """Maps :mod:`ast` positions (1-based line, UTF-8 byte column) of ``src`` to ``str`` offsets, with
    Python's line ends (``\\r\\n``, ``\\r``, ``\\n``); sources with non-ASCII text cut exactly."""

    def __init__(self, src: str):
        self.src = src
        self.line_starts = [0] + [m.end() for m in _NEWLINE.finditer(src)]

    def offset(self, lineno: int, col_byte: int) -> int:
        """The ``str`` offset of line ``lineno`` (1-based), UTF-8 byte column ``col_byte``."""
        start = self.line_starts[lineno - 1]
        end = self.line_starts[lineno] if lineno < len(self.line_starts) else len(self.src)
        return start + len(self.src[start:end].encode("utf-8")[:col_byte].decode("utf-8", errors="strict"))

    def span(self, node: ast.AST) -> tuple[int, int]:
        """``(start, end)`` ``str`` offsets of ``node`` (it must carry end positions)."""
        return (
            self.offset(node.lineno, node.col_offset),  # type: ignore[attr-defined]
            self.offset(node.end_lineno, node.end_col_offset),  # type: ignore[attr-defined]
        )


def call_name(call: ast.Call) -> str | None:
    """The called name of ``call``: ``f`` for ``f(...)`` and ``m.f(...)``; None for anything else."""
    f = call.func
    if isinstance(f, ast.Name):
        return f.id
    if isinstance(f, ast.Attribute):
        return f.attr
    return None


def estimate_level(reference_src: str) -> int:
    """Guess a KernelBench level for a reference without one (DICE's infilling records have none).

    Counts the calls in ``Model.forward`` (``torch.relu(x)``, ``self.linear(x)``, ``x.sum()``...):
    at most one call is a single operator (level 1), more is a fusion (level 2).  Parses only.

    Raises:
        TaskError: the reference breaks a rule of :func:`validate_reference`.
    """
    tree = validate_reference(reference_src)
    model = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Model")
    forward = next(
        n for n in model.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == "forward"
    )
    calls = sum(isinstance(n, ast.Call) for n in ast.walk(forward))
    return 1 if calls <= 1 else 2


_TENSOR_FACTORIES = frozenset({"randn", "rand", "ones", "zeros", "empty"})
_BINOPS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.FloorDiv: lambda a, b: a // b,
    ast.Div: lambda a, b: a / b,
    ast.LShift: lambda a, b: a << b if isinstance(a, int) and isinstance(b, int) and 0 <= b <= 64 else _unknown(),
}


def _unknown() -> object:
    raise _Unknown


class _Unknown(Exception):
    pass


def _static_value(node: ast.AST, env: dict[str, object]) -> object:
    """Evaluate int/float arithmetic and tuples over known names; anything else is unknown."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.Name) and node.id in env:
        return env[node.id]
    if isinstance(node, (ast.Tuple, ast.List)):
        return tuple(_static_value(e, env) for e in node.elts)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        v = _static_value(node.operand, env)
        if isinstance(v, (int, float)):
            return -v
    if isinstance(node, ast.BinOp):
        a, b = _static_value(node.left, env), _static_value(node.right, env)
        if isinstance(a, tuple) and isinstance(b, tuple) and isinstance(node.op, ast.Add):
            return a + b
        if isinstance(a, (int, float)) and isinstance(b, (int, float)):
            if isinstance(node.op, ast.Pow) and abs(b) <= 64 and abs(a) <= 2**32:
                return a**b
            op = _BINOPS.get(type(node.op))
            if op is not None and not (isinstance(node.op, (ast.FloorDiv, ast.Div)) and b == 0):
                return op(a, b)
    raise _Unknown


def _bind_constants(statements: list[ast.stmt], env: dict[str, object]) -> dict[str, object]:
    """``env`` with the constant assignments among ``statements`` (in order; a later one rebinds) added."""
    for node in statements:
        if isinstance(node, ast.Assign):
            try:
                value = _static_value(node.value, env)
            except _Unknown:
                for target in node.targets:  # a name bound to something unknown is unknown from here on
                    for name in ast.walk(target):
                        if isinstance(name, ast.Name):
                            env.pop(name.id, None)
                continue
            for target in node.targets:
                if isinstance(target, ast.Name):
                    env[target.id] = value
                elif isinstance(target, ast.Tuple) and isinstance(value, tuple) and len(value) == len(target.elts):
                    env.update({t.id: v for t, v in zip(target.elts, value) if isinstance(t, ast.Name)})
    return env


def static_input_elements(reference_src: str) -> int:
    """A lower bound of the elements ``get_inputs()`` allocates, found without executing anything.

    Evaluates module-level constant assignments (``N = 2048 * 2``, ``h, w = 32, 32``) and sums the
    sizes of ``torch.randn/rand/ones/zeros/empty(...)`` calls in ``get_inputs`` whose sizes are
    literal arithmetic over those constants; calls it cannot size count 0.  DICE's RL data holds
    references with up to 4.3e9 input elements (17 GB of fp32): loaders refuse those by this bound.

    Raises:
        TaskError: the reference breaks a rule of :func:`validate_reference`.
    """
    tree = validate_reference(reference_src)
    env = _bind_constants(tree.body, {})
    get_inputs = next(
        (n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == "get_inputs"),
        None,
    )
    if get_inputs is not None:  # its own constants too (n = 10**6; randn(n, n))
        env = _bind_constants(get_inputs.body, dict(env))
    total = 0
    for call in ast.walk(get_inputs) if get_inputs is not None else ():
        if not (isinstance(call, ast.Call) and call_name(call) in _TENSOR_FACTORIES):
            continue
        try:
            dims: list[object] = []
            for arg in [*call.args, *(k.value for k in call.keywords if k.arg == "size")]:
                v = _static_value(arg, env)
                dims.extend(v if isinstance(v, tuple) else (v,))
            if dims and all(isinstance(d, int) and d >= 0 for d in dims):
                total += math.prod(dims)  # type: ignore[arg-type]
        except _Unknown:
            continue
    return total


def _int_constant(node: ast.AST) -> int | None:
    """The value of an int literal or of arithmetic on int literals only (``2048``, ``256 * 8``, ``2 ** 16``,
    ``1 << 20``), or None."""
    if isinstance(node, ast.Constant):
        return node.value if type(node.value) is int else None
    if isinstance(node, (ast.BinOp, ast.UnaryOp)) and all(
            isinstance(n, (ast.BinOp, ast.UnaryOp, ast.operator, ast.unaryop))
            or (isinstance(n, ast.Constant) and type(n.value) is int) for n in ast.walk(node)):
        try:
            value = _static_value(node, {})
        except _Unknown:
            return None
        return value if type(value) is int else None
    return None


def _constant_names(node: ast.stmt) -> list[tuple[str, ast.expr]]:
    """``(name, value)`` of a module-level ``NAME = value`` or of the names of a literal tuple unpacked into names
    (``batch_size, in_channels = 128, 3``, as 53 KernelBench level-2/3 references write their sizes), in order."""
    if not (isinstance(node, ast.Assign) and len(node.targets) == 1):
        return []
    target, value = node.targets[0], node.value
    if isinstance(target, ast.Name):
        return [(target.id, value)]
    if (isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and len(target.elts) == len(value.elts)
            and all(isinstance(t, ast.Name) for t in target.elts)
            and not any(isinstance(v, ast.Starred) for v in value.elts)):
        return [(t.id, v) for t, v in zip(target.elts, value.elts)]  # type: ignore[attr-defined]
    return []


def _shape_constant_node(tree: ast.Module) -> tuple[str, ast.expr] | None:
    """The first module-level ``NAME = <int >= 1>`` (a literal or arithmetic on literals: ``M = 256 * 8``; or a name
    of a literal tuple unpacked into names: ``batch_size, dim = 16, 16384``) that ``get_inputs`` reads and nothing
    else at module level does, as ``(name, value expression)``, a name bound on its own line first; None when there is
    none."""
    consts: list[tuple[str, ast.expr]] = []
    single: set[str] = set()  # bound by NAME = value
    bound: dict[str, int] = {}
    for node in tree.body:
        for name, value in _constant_names(node):
            if (_int_constant(value) or 0) >= 1:
                consts.append((name, value))
                if isinstance(node.targets[0], ast.Name):  # type: ignore[attr-defined]
                    single.add(name)
        for t in node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AnnAssign, ast.AugAssign)) else []:
            for n in ast.walk(t):
                if isinstance(n, ast.Name):
                    bound[n.id] = bound.get(n.id, 0) + 1
    inside: set[str] = set()
    outside: set[str] = set()
    for node in tree.body:
        names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        if isinstance(node, ast.FunctionDef) and node.name == "get_inputs":
            inside |= names
        else:
            outside |= names
    found = [(name, value) for name, value in consts if name in inside and name not in outside and bound.get(name) == 1]
    # a name of its own line first (what the shape trial doubled before tuple-unpacked sizes were read), then the
    # first name of an unpacked tuple
    return next((f for f in found if f[0] in single), found[0] if found else None)


@functools.lru_cache(maxsize=256)
def shape_constant(reference_src: str) -> tuple[str, int] | None:
    """The size constant of a reference that can change without changing the model.

    That is the first module-level ``NAME = <int >= 1>`` (a literal, or arithmetic on literals such as
    KernelBench's ``M = 256 * 8``, or a name of a literal tuple unpacked into names, ``batch_size, dim = 16, 16384``)
    that ``get_inputs`` reads and nothing else in the module does (so ``Model`` and ``get_init_inputs``, hence the weights, are
    unchanged).  The verifier's shape trial doubles it (:mod:`dice_ray.verify.trials.correctness_trials`); loaders halve
    it to fit a memory budget (:func:`scale_down_inputs`, KernelBench#146).  Parses only.

    Returns:
        ``(name, value)``, or None when there is no such constant or ``reference_src`` does not parse
        (cached by source: the verifier asks once a candidate, 1 ms a parse).
    """
    try:
        node = _shape_constant_node(parse_python(reference_src))
    except (SyntaxError, ValueError):
        return None
    return None if node is None else (node[0], _int_constant(node[1]))  # type: ignore[return-value]


def scale_down_inputs(reference_src: str, max_elements: int) -> str | None:
    """Shrink a reference whose inputs exceed ``max_elements`` by halving its size constant.

    KernelBench#146 (problems whose inputs do not fit a GPU): when the reference has a size constant
    (:func:`shape_constant`), halve it until :func:`static_input_elements` is at most
    ``max_elements``, rewriting the source text only at that literal (found by :mod:`ast`
    positions; comments and layout are kept).  Parses only, never executes.

    Args:
        reference_src: a KernelBench-format reference (see :func:`validate_reference`).
        max_elements: the budget, in input elements (>= 1).

    Returns:
        The reference with the constant halved as often as needed (unchanged when it already fits);
        None when it does not fit and cannot be scaled (no size constant, or still too large with
        the constant at 1).  :func:`shape_constant` of both sources gives the old and new value.
    Raises:
        TaskError: ``reference_src`` breaks a rule of :func:`validate_reference`.
        ValueError: ``max_elements`` is not an int >= 1.
    """
    if isinstance(max_elements, bool) or not isinstance(max_elements, int) or max_elements < 1:
        raise ValueError(f"max_elements must be an int >= 1, got {max_elements!r}")
    node = _shape_constant_node(validate_reference(reference_src))
    if static_input_elements(reference_src) <= max_elements:
        return reference_src
    if node is None:
        return None
    lit = node[1]  # a literal, or arithmetic on literals (256 * 8): written back as one literal
    start, end = SourcePositions(reference_src).span(lit)
    value, src = _int_constant(lit), reference_src
    while static_input_elements(src) > max_elements:
        if value <= 1:
            return None
        value //= 2
        src = reference_src[:start] + str(value) + reference_src[end:]
    return src


@dataclass(frozen=True)
class Task:
    """One problem: a KernelBench-format reference and, optionally, a working solution.

    Attributes:
        task_id: unique id, e.g. ``"builtin/L1/relu"``, ``"dice-e2e/17"``, ``"dice-infill/3"``.
        name: short human name (``"relu"``).
        level: 0..4; 1 single operator, 2 fusion, 3 whole model (KernelBench levels; DICE data also
            has 0).  Used to order the curriculum from single operators to fused models.
        reference_src: the reference module (see :func:`validate_reference`).
        solution_src: a working solution, or None.
        solution_format: ``"fast"`` or ``"load_inline"``; set exactly when ``solution_src`` is.
        solution_variants: further honest solutions in ``solution_format`` (the built-in suite's slower variants,
            ``solution_slow.py``: same result, a slower kernel); the SFT warm start learns each, so that RL's
            speedup term has a slower and a faster way to choose between. Infill scaffolds cut ``solution_src``.
        role: the phase whose set the task belongs to (:data:`TASK_ROLES`): ``"infill"`` for DICE's kernel
            infilling file, ``"e2e"`` for its end-to-end file, ``"both"`` for every other source. A run whose
            tasks include a set marked for a phase draws that phase's prompts from it (DICE's recipe: infilling
            from one file, end-to-end from the other); see :func:`dice_ray.tasks.loaders.phase_pool`.

    Raises:
        TaskError: on construction, when a field breaks a rule (the message names the field and
            the rule).  Sources are parsed, never executed.
    """

    task_id: str
    name: str
    level: int
    reference_src: str
    solution_src: str | None = None
    solution_format: SolutionFormat | None = None
    solution_variants: tuple[str, ...] = ()
    role: str = "both"

    def __post_init__(self) -> None:
        for field in ("task_id", "name"):
            value = getattr(self, field)
            if not isinstance(value, str) or not value.strip():
                raise TaskError(f"bad-{field.replace('_', '-')}", f"{field} must be a non-empty str, got {value!r}")
        if isinstance(self.level, bool) or not isinstance(self.level, int) or not 0 <= self.level <= 4:
            raise TaskError("bad-level", f"level must be an int in 0..4, got {self.level!r}")
        validate_reference(self.reference_src)
        if (self.solution_src is None) != (self.solution_format is None):
            raise TaskError(
                "solution-format-mismatch",
                "solution_src and solution_format must be given together "
                f"(solution_src is {'None' if self.solution_src is None else 'set'}, "
                f"solution_format={self.solution_format!r})",
            )
        if self.solution_src is not None:
            validate_solution(self.solution_src, self.solution_format)
        if self.solution_variants and self.solution_src is None:
            raise TaskError("solution-format-mismatch", "solution_variants need a solution_src (their format is its)")
        for i, src in enumerate(self.solution_variants):
            validate_solution(src, self.solution_format, field=f"solution variant {i + 1}")
        if self.role not in TASK_ROLES:
            raise TaskError("bad-role", f"role must be one of {TASK_ROLES}, got {self.role!r}")
