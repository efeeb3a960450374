"""C++/CUDA text parsed with tree-sitter-cuda (a superset of the C++ grammar), and the node helpers its readers share.

Read by the load_inline format's C++/CUDA rules (:mod:`dice_ray.verify.rules.cpp_rules`), its launch counters
(:mod:`dice_ray.verify.candidate.inline_counters`), the task scaffolds (:mod:`dice_ray.tasks.scaffold`) and the
kernel matcher (:mod:`dice_ray.eval.kernel_match`).  tree-sitter is imported on first use.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["function_qualifiers", "node_text", "parse_cuda"]

_PARSERS = threading.local()  # a tree-sitter Parser is not thread-safe: one per thread


def parse_cuda(data: bytes | str) -> Any:
    """Parse C++/CUDA text with tree-sitter-cuda (a superset of the C++ grammar).

    Returns:
        The ``tree_sitter.Tree`` (text as UTF-8 bytes; node positions are byte offsets).
    Raises:
        ImportError: ``tree-sitter`` / ``tree-sitter-cuda`` are not installed.
    """
    parser = getattr(_PARSERS, "parser", None)
    if parser is None:
        import tree_sitter
        import tree_sitter_cuda

        parser = _PARSERS.parser = tree_sitter.Parser(tree_sitter.Language(tree_sitter_cuda.language()))
    return parser.parse(data.encode() if isinstance(data, str) else data)


def node_text(node: Any, data: bytes | None = None) -> str:
    """The text of a tree-sitter ``node`` (from ``data``, the parsed bytes, when given), undecodable bytes replaced."""
    raw = node.text if data is None else data[node.start_byte:node.end_byte]
    return raw.decode(errors="replace")


def function_qualifiers(fn: Any) -> set[str]:
    """CUDA execution-space qualifiers of a ``function_definition`` node (``__global__``...)."""
    return {c.type for c in fn.children if c.type in ("__global__", "__device__", "__host__")}
