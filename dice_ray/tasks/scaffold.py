"""Scaffolds for the infilling phase: cut a working solution into prefix / middle / suffix.

DICE's bi-phase curriculum (arXiv 2602.11715) first trains on *kernel infilling*: the policy sees
the reference and the solution's prefix and suffix and writes the middle, the CUDA source.  Cuts
are at ``source`` granularity:

* ``"fast"`` (dice-ray's NVRTC format, INTERFACES.md): prefix = everything up to and including the
  line ``cuda_source = r\"\"\"`` (with its newline); middle = the CUDA source inside the string;
  suffix = from the closing ``\"\"\"`` to the end.
* ``"load_inline"`` (KernelBench / DICE's format): DICE's own split, as in its
  ``kernel_infilling_evaluation.json``: prefix = the imports (and comments) before the CUDA source,
  middle = the whole assignment ``source = \"\"\"...\"\"\"`` of that source, suffix = ``cpp_src``,
  ``load_inline(...)`` and ``ModelNew``.

The CUDA source is found from the loader call, not by line heuristics: the string literal (or the
variable holding it) passed to ``load_cuda(...)`` or as ``cuda_sources=`` to ``load_inline(...)``,
located with :mod:`ast` positions, so any variable name works.  Invariant:
``prefix + middle + suffix == solution_src`` exactly.  Sources are parsed, never executed.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from dataclasses import dataclass

_TRIPLE_OPEN = re.compile(r"""\A([rRuU]?)(\"\"\"|''')""")
_NEWLINE = re.compile(r"\r\n|\r|\n")


class ScaffoldError(ValueError):
    """The solution has no CUDA source that can be cut out (or does not parse)."""


@dataclass(frozen=True)
class Scaffold:
    """A solution cut in three: ``prefix + middle + suffix`` is the solution's source, exactly.

    ``middle`` is what the policy writes in the infilling phase.
    """

    prefix: str
    middle: str
    suffix: str

    @property
    def source(self) -> str:
        """The whole solution source, ``prefix + middle + suffix``."""
        return self.prefix + self.middle + self.suffix


class _Positions:
    """Maps ast (line, UTF-8 byte column) positions to str offsets."""

    def __init__(self, src: str):
        self.src = src
        self.line_starts = [0] + [m.end() for m in _NEWLINE.finditer(src)]

    def offset(self, lineno: int, col_byte: int) -> int:
        start = self.line_starts[lineno - 1]
        end = self.line_starts[lineno] if lineno < len(self.line_starts) else len(self.src)
        line = self.src[start:end]
        return start + len(line.encode("utf-8")[:col_byte].decode("utf-8", errors="strict"))

    def span(self, node: ast.AST) -> tuple[int, int]:
        return (
            self.offset(node.lineno, node.col_offset),  # type: ignore[attr-defined]
            self.offset(node.end_lineno, node.end_col_offset),  # type: ignore[attr-defined]
        )


def _call_name(call: ast.Call) -> str | None:
    f = call.func
    if isinstance(f, ast.Name):
        return f.id
    if isinstance(f, ast.Attribute):
        return f.attr
    return None


def _source_argument(tree: ast.Module, fmt: str) -> tuple[ast.expr, ast.Call]:
    """The expression passed as the CUDA source to the format's loader call."""
    loader, keyword, position = ("load_cuda", "source", 0) if fmt == "fast" else ("load_inline", "cuda_sources", 2)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _call_name(node) == loader:
            for kw in node.keywords:
                if kw.arg == keyword:
                    return kw.value, node
            if len(node.args) > position:
                return node.args[position], node
    raise ScaffoldError(f"solution_src ({fmt}): no {loader}() call with a CUDA source ({keyword}=...)")


def _is_str(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def _targets(node: ast.Assign | ast.AnnAssign) -> list[ast.expr]:
    return node.targets if isinstance(node, ast.Assign) else [node.target]


def _resolve(tree: ast.Module, expr: ast.expr, call: ast.Call) -> tuple[ast.expr, ast.stmt | None]:
    """Follow ``[x]`` and a variable name to the string literal; returns (literal, its assignment)."""
    if isinstance(expr, (ast.List, ast.Tuple)):
        if len(expr.elts) != 1:
            raise ScaffoldError(f"solution_src: the CUDA sources list has {len(expr.elts)} items, expected 1")
        expr = expr.elts[0]
    if _is_str(expr):
        return expr, None
    if isinstance(expr, ast.Name):
        assigns = [
            n
            for n in ast.walk(tree)
            if isinstance(n, (ast.Assign, ast.AnnAssign))
            and n.value is not None
            and (n.lineno, n.col_offset) < (call.lineno, call.col_offset)
            and any(isinstance(t, ast.Name) and t.id == expr.id for t in _targets(n))
        ]
        if not assigns:
            raise ScaffoldError(f"solution_src: the CUDA source variable {expr.id!r} is never assigned before its use")
        last = max(assigns, key=lambda n: (n.lineno, n.col_offset))
        if not _is_str(last.value):
            raise ScaffoldError(
                f"solution_src: {expr.id!r} is assigned a {type(last.value).__name__}, not a string literal"
            )
        return last.value, last
    raise ScaffoldError(f"solution_src: the CUDA source is a {type(expr).__name__}, not a string literal or a name")


def _single_string_token(text: str) -> bool:
    try:
        toks = [t for t in tokenize.generate_tokens(io.StringIO(text).readline) if t.type == tokenize.STRING]
    except (tokenize.TokenError, SyntaxError):
        return False
    return len(toks) == 1 and toks[0].string == text


def make_scaffold(solution_src: str, fmt: str) -> Scaffold:
    """Cut ``solution_src`` (format ``fmt``: ``"fast"`` or ``"load_inline"``) at its CUDA source.

    See the module docstring for where each format is cut.  ``prefix + middle + suffix ==
    solution_src`` always holds.

    Raises:
        ScaffoldError: ``fmt`` is unknown; ``solution_src`` does not parse; there is no loader call
            with a CUDA source; the source is not a string literal (or a variable assigned one);
            for ``"fast"``, the literal is not a single triple-quoted (raw) string.
    """
    if fmt not in ("fast", "load_inline"):
        raise ScaffoldError(f"fmt must be 'fast' or 'load_inline', got {fmt!r}")
    if not isinstance(solution_src, str):
        raise ScaffoldError(f"solution_src must be a str, got {type(solution_src).__name__}")
    try:
        tree = ast.parse(solution_src)
    except (SyntaxError, ValueError) as e:
        raise ScaffoldError(f"solution_src does not parse: {e}") from None
    expr, call = _source_argument(tree, fmt)
    literal, assign = _resolve(tree, expr, call)
    pos = _Positions(solution_src)
    if fmt == "load_inline":
        start, end = pos.span(assign if assign is not None else literal)
        return Scaffold(solution_src[:start], solution_src[start:end], solution_src[end:])
    start, end = pos.span(literal)
    token = solution_src[start:end]
    m = _TRIPLE_OPEN.match(token)
    if m is None or not _single_string_token(token):
        raise ScaffoldError("solution_src (fast): the CUDA source must be one triple-quoted string r\"\"\"...\"\"\"")
    body_start = start + m.end()
    if solution_src.startswith("\r\n", body_start):
        body_start += 2
    elif solution_src.startswith(("\n", "\r"), body_start):
        body_start += 1
    body_end = max(end - 3, body_start)
    return Scaffold(solution_src[:body_start], solution_src[body_start:body_end], solution_src[body_end:])
