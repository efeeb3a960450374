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

``body`` granularity (either format) cuts one ``__global__`` kernel's body inside that CUDA source:
prefix = everything up to and including the kernel's opening ``{``, middle = the body, suffix = from
the closing ``}`` on, so the policy keeps the signature, the helpers and the host code.  The kernel
is found with tree-sitter-cuda (:func:`dice_ray.verify.candidate.cuda_tree.parse_cuda`) on the string's
*value*, so braces in comments, string and char literals, templates, macros, ``__launch_bounds__``
and ``extern "C"`` blocks are handled by the grammar; ``__device__`` helpers are never cut.  The
value's positions are mapped back to the Python source through the literal's escapes (``\\n``,
``\\"``, line continuations, ``\\r\\n`` newlines), so raw and plain strings and non-ASCII text cut
exactly.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
import unicodedata
from dataclasses import dataclass
from typing import Any, Literal

from dice_ray.pysource import SourcePositions, call_name, parse_python

_TRIPLE_OPEN = re.compile(r"""\A([rRuU]?)(\"\"\"|''')""")
_STRING_PREFIX = re.compile(r"\A([rRuU]?)(\"\"\"|'''|\"|')")
_SIMPLE_ESCAPES = {"\\": "\\", "'": "'", '"': '"', "a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r",
                   "t": "\t", "v": "\v"}
_HEX_ESCAPES = {"x": 2, "u": 4, "U": 8}
# tree-sitter node types that end a function declarator chain with the function's name
_NAME_NODES = frozenset({"identifier", "field_identifier", "qualified_identifier", "template_function", "operator_name"})

Granularity = Literal["source", "body"]
GRANULARITIES: tuple[str, ...] = ("source", "body")


class ScaffoldError(ValueError):
    """The solution cannot be cut: it does not parse, has no CUDA source, or (``body`` granularity) no
    ``__global__`` kernel / no kernel of the asked name.  The message names the input and the rule."""


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


def _source_argument(tree: ast.Module, fmt: str) -> tuple[ast.expr, ast.Call]:
    """The expression passed as the CUDA source to the format's loader call."""
    loader, keyword, position = ("load_cuda", "source", 0) if fmt == "fast" else ("load_inline", "cuda_sources", 2)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and call_name(node) == loader:
            for kw in node.keywords:
                if kw.arg == keyword:
                    return kw.value, node
            if len(node.args) > position:
                return node.args[position], node
    raise ScaffoldError(f"the solution ({fmt}): no {loader}() call with a CUDA source ({keyword}=...)")


def _is_str(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def _targets(node: ast.Assign | ast.AnnAssign) -> list[ast.expr]:
    return node.targets if isinstance(node, ast.Assign) else [node.target]


def _resolve(tree: ast.Module, expr: ast.expr, call: ast.Call) -> tuple[ast.expr, ast.stmt | None]:
    """Follow ``[x]`` and a variable name to the string literal; returns (literal, its assignment)."""
    if isinstance(expr, (ast.List, ast.Tuple)):
        if len(expr.elts) != 1:
            raise ScaffoldError(f"the solution: the CUDA sources list has {len(expr.elts)} items, expected 1")
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
            raise ScaffoldError(f"the solution: the CUDA source variable {expr.id!r} is never assigned before its use")
        last = max(assigns, key=lambda n: (n.lineno, n.col_offset))
        if not _is_str(last.value):
            raise ScaffoldError(
                f"the solution: {expr.id!r} is assigned a {type(last.value).__name__}, not a string literal"
            )
        return last.value, last
    raise ScaffoldError(f"the solution: the CUDA source is a {type(expr).__name__}, not a string literal or a name")


def _single_string_token(text: str) -> bool:
    try:
        toks = [t for t in tokenize.generate_tokens(io.StringIO(text).readline) if t.type == tokenize.STRING]
    except (tokenize.TokenError, SyntaxError):
        return False
    return len(toks) == 1 and toks[0].string == text


def _locate(solution_src: str, fmt: str) -> tuple[ast.expr, ast.stmt | None, SourcePositions]:
    """The CUDA source literal of ``solution_src``, its assignment (or None) and a position map."""
    if fmt not in ("fast", "load_inline"):
        raise ScaffoldError(f"fmt must be 'fast' or 'load_inline', got {fmt!r}")
    if not isinstance(solution_src, str):
        raise ScaffoldError(f"the solution must be a str, got {type(solution_src).__name__}")
    try:
        tree = parse_python(solution_src)
    except (SyntaxError, ValueError) as e:
        raise ScaffoldError(f"the solution does not parse: {e}") from None
    expr, call = _source_argument(tree, fmt)
    literal, assign = _resolve(tree, expr, call)
    return literal, assign, SourcePositions(solution_src)


def make_scaffold(
    solution_src: str, fmt: str, granularity: Granularity = "source", kernel: str | None = None
) -> Scaffold:
    """Cut ``solution_src`` (format ``fmt``: ``"fast"`` or ``"load_inline"``) at its CUDA source.

    Args:
        solution_src: the solution's Python source (parsed, never executed).
        fmt: ``"fast"`` (``load_cuda``) or ``"load_inline"`` (KernelBench / DICE).
        granularity: ``"source"`` cuts the whole CUDA source (DICE's infilling split);
            ``"body"`` cuts one ``__global__`` kernel's body, braces and signature kept.
        kernel: with ``"body"``, the kernel's name; default the first kernel in the source.

    See the module docstring for where each cut falls.  ``prefix + middle + suffix ==
    solution_src`` always holds.

    Raises:
        ScaffoldError: ``fmt`` or ``granularity`` is unknown; ``solution_src`` does not parse; there
            is no loader call with a CUDA source; the source is not a string literal (or a variable
            assigned one); for ``"fast"``, the literal is not a single triple-quoted (raw) string;
            for ``"body"``, the source has no ``__global__`` kernel with a body, ``kernel`` names
            none of them (the message lists those found), or a kernel's body does not parse.
    """
    if granularity not in GRANULARITIES:
        raise ScaffoldError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if granularity == "body":
        cuts = _body_cuts(solution_src, fmt)
        if kernel is None:
            return cuts[0][1]
        for name, sc in cuts:
            if name == kernel:
                return sc
        raise ScaffoldError(
            f"the solution ({fmt}): no __global__ kernel named {kernel!r}; kernels found: {[n for n, _ in cuts]}"
        )
    if kernel is not None:
        raise ScaffoldError(f"kernel={kernel!r} applies to granularity 'body' only, not {granularity!r}")
    literal, assign, pos = _locate(solution_src, fmt)
    if fmt == "load_inline":
        start, end = pos.span(assign if assign is not None else literal)
        return Scaffold(solution_src[:start], solution_src[start:end], solution_src[end:])
    start, end = pos.span(literal)
    token = solution_src[start:end]
    m = _TRIPLE_OPEN.match(token)
    if m is None or not _single_string_token(token):
        raise ScaffoldError("the solution (fast): the CUDA source must be one triple-quoted string r\"\"\"...\"\"\"")
    body_start = start + m.end()
    if solution_src.startswith("\r\n", body_start):
        body_start += 2
    elif solution_src.startswith(("\n", "\r"), body_start):
        body_start += 1
    body_end = max(end - 3, body_start)
    return Scaffold(solution_src[:body_start], solution_src[body_start:body_end], solution_src[body_end:])


def detect_format(solution_src: str) -> str:
    """The solution format of ``solution_src`` from its loader call: ``"fast"`` when it calls
    ``load_cuda(...)``, else ``"load_inline"`` when it calls ``load_inline(...)``.

    Raises:
        ScaffoldError: ``solution_src`` does not parse or calls neither loader.
    """
    try:
        tree = parse_python(solution_src)
    except (SyntaxError, ValueError) as e:
        raise ScaffoldError(f"the solution does not parse: {e}") from None
    names = {call_name(n) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    for fmt, loader in (("fast", "load_cuda"), ("load_inline", "load_inline")):
        if loader in names:
            return fmt
    raise ScaffoldError("the solution calls neither load_cuda() (fast format) nor load_inline(): no CUDA source to cut")


def kernel_scaffolds(solution_src: str, fmt: str) -> list[tuple[str, Scaffold]]:
    """One ``body`` scaffold per ``__global__`` kernel, in source order: ``[(kernel name, scaffold)]``.

    Each is what ``make_scaffold(solution_src, fmt, "body", kernel=name)`` gives for the first
    kernel of that name (overloads and specialisations share a name: all are listed here).

    Raises:
        ScaffoldError: as :func:`make_scaffold` with ``granularity="body"``.
    """
    return _body_cuts(solution_src, fmt)


def _literal_chars(token: str) -> tuple[str, list[tuple[int, int]]]:
    r"""Decode one Python string token: (its value, per value character its [start, end) in ``token``).

    Follows the tokenizer: newlines in the text (``\r\n``, ``\r``) are ``\n`` in the value; in a
    non-raw string the escapes (``\\``, ``\n``, ``\x41``, ``\N{...}``, line continuations...) are
    decoded, an unknown escape keeps its backslash.
    """
    m = _STRING_PREFIX.match(token)
    assert m is not None, token
    raw = m.group(1) in ("r", "R")
    start, stop = m.end(), len(token) - len(m.group(2))
    chars: list[str] = []
    spans: list[tuple[int, int]] = []
    j = start
    while j < stop:
        c = token[j]
        if c == "\r":
            step = 2 if token.startswith("\r\n", j) else 1
            chars.append("\n")
        elif c != "\\" or raw:
            step = 1
            chars.append(c)
        else:
            nxt = token[j + 1]
            if nxt in "\r\n":  # line continuation: no character in the value
                j += 3 if token.startswith("\r\n", j + 1) else 2
                continue
            if nxt in _SIMPLE_ESCAPES:
                step, value = 2, _SIMPLE_ESCAPES[nxt]
            elif nxt in "01234567":
                digits = re.match(r"[0-7]{1,3}", token[j + 1:j + 4])
                assert digits is not None
                step, value = 1 + len(digits.group()), chr(int(digits.group(), 8))
            elif nxt in _HEX_ESCAPES:
                n = _HEX_ESCAPES[nxt]
                step, value = 2 + n, chr(int(token[j + 2:j + 2 + n], 16))
            elif nxt == "N":
                close = token.index("}", j)
                step, value = close + 1 - j, unicodedata.lookup(token[j + 3:close])
            else:  # unknown escape: the backslash stays, the next character is read on its own
                step, value = 1, "\\"
            chars.append(value)
        spans.append((j, j + step))
        j += step
    return "".join(chars), spans


def _kernel_bodies(cuda: str) -> list[tuple[str, int, int]]:
    """``[(name, index of the body's "{", index of its "}")]`` for each ``__global__`` kernel with a
    body in ``cuda`` (str indices), in source order; ``__device__`` helpers and prototypes skipped."""
    from dice_ray.verify.candidate.cuda_tree import function_qualifiers, node_text, parse_cuda

    data = cuda.encode("utf-8", errors="surrogatepass")
    root = parse_cuda(data).root_node
    found: list[tuple[str, Any, Any]] = []
    stack = [root]
    while stack:
        node = stack.pop()
        if node.type == "function_definition" and "__global__" in function_qualifiers(node):
            decl = node.child_by_field_name("declarator")
            while decl is not None and decl.type not in _NAME_NODES:
                decl = decl.child_by_field_name("declarator")
            found.append((node_text(decl) if decl is not None else "?", node, node.child_by_field_name("body")))
            continue  # a kernel holds no kernels
        stack.extend(reversed(node.children))

    def char_index(byte: int) -> int:
        return len(data[:byte].decode("utf-8", errors="surrogatepass"))

    out = []
    for name, fn, body in found:
        kids = body.children if body is not None else []
        if not kids or kids[0].type != "{" or kids[-1].type != "}" or kids[-1].is_missing:
            raise ScaffoldError(
                f"the solution: the body of __global__ kernel {name!r} (line {fn.start_point[0] + 1} of the CUDA "
                "source) does not parse as a { ... } block"
            )
        out.append((name, char_index(kids[0].start_byte), char_index(kids[-1].start_byte)))
    return out


def _body_cuts(solution_src: str, fmt: str) -> list[tuple[str, Scaffold]]:
    literal, _, pos = _locate(solution_src, fmt)
    start, end = pos.span(literal)
    token = solution_src[start:end]
    if not _single_string_token(token):
        raise ScaffoldError(f"the solution ({fmt}): body granularity needs the CUDA source as one string literal, "
                            "not implicitly concatenated ones")
    value, spans = _literal_chars(token)
    if value != literal.value:  # type: ignore[attr-defined]
        raise ScaffoldError(f"the solution ({fmt}): the CUDA source literal could not be mapped back to the source")
    kernels = _kernel_bodies(value)
    if not kernels:
        raise ScaffoldError(f"the solution ({fmt}): the CUDA source has no __global__ kernel with a body to cut")
    out = []
    for name, open_i, close_i in kernels:
        cut_a, cut_b = start + spans[open_i][1], start + spans[close_i][0]
        out.append((name, Scaffold(solution_src[:cut_a], solution_src[cut_a:cut_b], solution_src[cut_b:])))
    return out
