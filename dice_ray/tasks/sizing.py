"""Input sizing of a reference, by parsing only: a static bound of the elements ``get_inputs()`` allocates, the
size constant that can change without changing the model, a reference scaled down to a memory budget, and the
dtypes its inputs may have.

DICE's RL data holds references with up to 4.3e9 input elements (17 GB of fp32): loaders refuse or halve those
(:func:`scale_down_inputs`, KernelBench#146); the verifier's shape trial doubles the size constant
(:func:`shape_constant`); the static rules leave a cast to one of the inputs' dtypes (:func:`input_dtypes`) to
the run-time op check.  Nothing is executed: constants are evaluated from the syntax tree.
"""

from __future__ import annotations

import ast
import functools
import math

from dice_ray.pysource import SourcePositions, call_name, parse_python
from dice_ray.tasks.validate import validate_reference


_TENSOR_FACTORIES = frozenset({"randn", "rand", "ones", "zeros", "empty"})
#: torch's dtype attributes (``torch.half``, ``torch.long``...) by the dtype's name
_DTYPE_ATTRS = {"float32": "float32", "float": "float32", "float64": "float64", "double": "float64",
                "float16": "float16", "half": "float16", "bfloat16": "bfloat16", "int64": "int64", "long": "int64",
                "int32": "int32", "int": "int32", "int16": "int16", "short": "int16", "int8": "int8", "uint8": "uint8",
                "bool": "bool", "complex64": "complex64", "cfloat": "complex64", "complex128": "complex128",
                "cdouble": "complex128"}
#: tensor methods that are ``.to(<dtype>)`` under another name (``x.half()`` is ``x.to(torch.float16)``)
CAST_METHODS = {"float": "float32", "double": "float64", "half": "float16", "bfloat16": "bfloat16", "long": "int64",
                "int": "int32", "short": "int16", "char": "int8", "byte": "uint8", "bool": "bool"}
#: calls that return int64 tensors (sampled indices, index results) without naming a dtype
_INT64_CALLS = frozenset({"randint", "randint_like", "randperm", "arange", "multinomial", "argmax", "argmin", "argsort",
                          "nonzero", "searchsorted", "bucketize"})
#: calls that return bool tensors (comparisons by name, tests, logical ops)
_BOOL_CALLS = frozenset({"eq", "ne", "lt", "le", "gt", "ge", "isnan", "isinf", "isfinite", "logical_and", "logical_or",
                         "logical_not", "logical_xor"})
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


@functools.lru_cache(maxsize=256)
def input_dtypes(reference_src: str) -> frozenset[str]:
    """The dtypes a reference's inputs may have, read from ``get_inputs`` and the module-level statements (its
    constants: ``DTYPE = torch.float64``) without executing anything: float32 (torch's default), every torch dtype
    they name (``dtype=torch.float64``, ``.to(torch.half)``, ``torch.long``), every cast method they call
    (``.double()``, ``.long()``: :data:`CAST_METHODS`), int64 for the calls that return indices (``torch.randint``,
    ``torch.arange``, ``x.argmax()``...) and for a ``torch.tensor`` of int literals or of data built at run time, bool
    for one of bool literals and for a comparison (``torch.rand(n) < 0.5``, ``x.ge(0)``, ``torch.isnan(x)``).

    A superset where the text says it; what it cannot read adds nothing.  The static rules leave a cast to one of
    these dtypes to the run-time op check, which refuses one that converts (:mod:`dice_ray.verify.rules.python_rules`):
    an extra dtype here only moves a refusal from the static rules to run time.

    Returns:
        The dtype names (``"float32"``, ``"float64"``, ``"int64"``...); ``{"float32"}`` when ``reference_src`` does
        not parse (cached by source: the verifier asks once a candidate).
    """
    out = {"float32"}
    try:
        tree = parse_python(reference_src)
    except (SyntaxError, ValueError):
        return frozenset(out)
    torch_names = {(a.asname or a.name) for n in tree.body if isinstance(n, ast.Import) for a in n.names
                   if a.name == "torch"}
    read = [n for n in tree.body if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            or (isinstance(n, ast.FunctionDef) and n.name == "get_inputs")]
    for node in (n for stmt in read for n in ast.walk(stmt)):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in torch_names
                and node.attr in _DTYPE_ATTRS):
            out.add(_DTYPE_ATTRS[node.attr])
        elif isinstance(node, ast.Compare):
            out.add("bool")
        elif isinstance(node, ast.Call):
            name = call_name(node)
            if isinstance(node.func, ast.Attribute) and name in CAST_METHODS and not node.args:
                out.add(CAST_METHODS[name])
            elif name in _INT64_CALLS:
                out.add("int64")
            elif name in _BOOL_CALLS:
                out.add("bool")
            elif name == "view_as_complex":
                out.add("complex64")
            elif name in ("tensor", "as_tensor", "full") and node.args:
                data = node.args[-1] if name == "full" else node.args[0]
                for c in ast.walk(data):
                    if isinstance(c, ast.Constant) and type(c.value) in (bool, int):
                        out.add("bool" if type(c.value) is bool else "int64")
                    elif isinstance(c, (ast.comprehension, ast.Name)) and name != "full":
                        out.add("int64")  # data built at run time (range(n), a list): index lists, usually
    return frozenset(out)
