"""Validation of a task's sources by parsing only: a KernelBench-format reference, a solution in a known format.

Sources are untrusted (DICE records, user files): they are parsed with :mod:`ast`
(:func:`dice_ray.pysource.parse_python`, nesting bounded) and never executed here; references run only inside the
verifier's sandbox.  A broken rule is a :class:`TaskError` naming the field and the rule.
"""

from __future__ import annotations

import ast
from typing import Literal

from dice_ray.pysource import call_name, parse_python

SolutionFormat = Literal["fast", "load_inline"]
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
