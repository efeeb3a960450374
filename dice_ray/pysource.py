"""Parsing Python source that nobody vetted (task references, candidates, solutions) with bounded nesting.

Every later pass over a tree recurses (``ast.NodeVisitor``, ``compile``, the anti-cheat rules), and
Python's parser itself runs out of stack or memory on deep input: ``Z = 1+1+...+1`` with a few thousand
terms, or ``----...1``.  Such a source is refused here as a ``SyntaxError``, which every caller already
turns into its rule (a task's ``syntax-error``, a candidate's ``syntax``), instead of a
``RecursionError`` that would abort a whole task file or blame the verifier.
"""

from __future__ import annotations

import ast

__all__ = ["MAX_NESTING", "parse_python"]

#: deepest syntax tree accepted (levels of nodes; a module of plain statements is ~10 deep, real kernels'
#: Python under 40). CPython refuses 200 nested parentheses; the anti-cheat rules' recursive walk
#: overflows near 350 levels (Python 3.11), so 200 leaves them room on any caller's stack.
MAX_NESTING = 200


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
