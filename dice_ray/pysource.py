"""Parsing Python source that nobody vetted (task references, candidates, solutions) with bounded nesting; positions
and call names in its syntax tree (:class:`SourcePositions`, :func:`call_name`).

Every later pass over a tree recurses (``ast.NodeVisitor``, ``compile``, the anti-cheat rules), and
Python's parser itself runs out of stack or memory on deep input: ``Z = 1+1+...+1`` with a few thousand
terms, or ``----...1``.  Such a source is refused here as a ``SyntaxError``, which every caller already
turns into its rule (a task's ``syntax-error``, a candidate's ``syntax``), instead of a
``RecursionError`` that would abort a whole task file or blame the verifier.
"""

from __future__ import annotations

import ast
import re

__all__ = ["MAX_NESTING", "SourcePositions", "call_name", "parse_python"]

#: deepest syntax tree accepted (levels of nodes; a module of plain statements is ~10 deep, real kernels'
#: Python under 40). CPython refuses 200 nested parentheses; the anti-cheat rules' recursive walk
#: overflows near 350 levels (Python 3.11), so 200 leaves them room on any caller's stack.
MAX_NESTING = 200

_NEWLINE = re.compile(r"\r\n|\r|\n")  # Python's line ends


def parse_python(src: str, filename: str = "<unknown>") -> ast.Module:
    """``ast.parse(src)`` with the nesting bounded by :data:`MAX_NESTING`.

    Raises:
        SyntaxError: ``src`` is not Python, or nests deeper than :data:`MAX_NESTING` (the message
            says so, with the line where the limit was passed; also when the parser itself runs out
            of stack or memory on it).
        ValueError: ``src`` holds NUL bytes (as ``ast.parse``).
    """
    try:
        tree = ast.parse(src, filename)
    except (RecursionError, MemoryError):
        raise SyntaxError(f"nested too deeply for the parser (the limit is {MAX_NESTING} levels)",
                          (filename, None, None, None)) from None
    stack: list[tuple[ast.AST, int]] = [(tree, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_NESTING:
            line = getattr(node, "lineno", None)
            raise SyntaxError(f"nested more than {MAX_NESTING} levels deep (an expression or block nested this "
                              "deep is refused)", (filename, line, None, None))
        stack.extend((child, depth + 1) for child in ast.iter_child_nodes(node))
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
