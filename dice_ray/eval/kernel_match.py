"""Does a rewarded candidate still compute? Its kernel bodies against the task's own solutions, names aside.

Without a GPU the reward is a proxy (compiled, rule-abiding, right output shapes on a dry run): a policy could
learn to launch an empty or trivial kernel and still be paid. For a policy that learned from a task's own
solutions (the built-in suite's warm start), a rewarded candidate *computes* when every ``__global__`` kernel body
it has matches a kernel body of the task's solution or of one of its variants, up to the names of variables:
bodies are compared as token sequences (tree-sitter-cuda leaves, comments dropped) whose identifiers are renamed
by order of first appearance, except called names (``expf``, ``fmaxf``, ``__shfl_down_sync``) and CUDA's built-in
variables (``threadIdx``, ...), which keep theirs: ``expf`` for ``tanhf`` is another computation. A share of such
candidates well below 1 at the end of a compile-only run shows a policy that learned to game the proxy.

With the built-in suite's slower variants in the warm start (``tasks.solution_variants``), :func:`slower_variant`
tells which of a task's honest solutions a computing candidate reproduces: the share of slower ones is what the
speedup term of the reward should drive down (``benchmarks/learning.py --speedup-variants``).
"""

from __future__ import annotations

from functools import lru_cache

from dice_ray.tasks.scaffold import ScaffoldError, detect_format, kernel_scaffolds
from dice_ray.tasks.task import Task

#: Identifiers compared by name: CUDA's built-in variables (their fields are field_identifier leaves, kept as well).
_BUILTINS = frozenset({"threadIdx", "blockIdx", "blockDim", "gridDim", "warpSize"})


def body_shape(body: str) -> tuple[str, ...]:
    """The token sequence of a kernel body with its variable names replaced by ``v0, v1, ...`` in order of first
    appearance (called names, CUDA built-ins, keywords, literals and operators kept; comments dropped).

    Raises:
        ImportError: tree-sitter-cuda is not installed.
    """
    from dice_ray.verify.candidate.cuda_tree import parse_cuda

    data = body.encode()
    names: dict[str, str] = {}
    out: list[str] = []
    stack = [parse_cuda(data).root_node]
    while stack:
        node = stack.pop()
        if node.type == "comment":
            continue
        if node.child_count == 0:
            text = data[node.start_byte:node.end_byte].decode(errors="replace")
            called = node.parent is not None and node.parent.type == "call_expression" and node.prev_sibling is None
            if node.type == "identifier" and not called and text not in _BUILTINS:
                text = names.setdefault(text, f"v{len(names)}")
            out.append(text)
        stack.extend(reversed(node.children))
    return tuple(out)


@lru_cache(maxsize=4096)
def kernel_shapes(src: str) -> frozenset[tuple[str, ...]]:
    """:func:`body_shape` of every ``__global__`` kernel of a solution (fast or load_inline format); empty when it
    has none or does not parse. Cached by source: an evaluation asks :func:`computes` and :func:`slower_variant`
    of the same candidate."""
    try:
        return frozenset(body_shape(sc.middle) for _, sc in kernel_scaffolds(src, detect_format(src)))
    except (ScaffoldError, ValueError, SyntaxError):
        return frozenset()


@lru_cache(maxsize=1024)
def _solution_shapes(solutions: tuple[str, ...]) -> frozenset[tuple[str, ...]]:
    return frozenset().union(*(kernel_shapes(s) for s in solutions))


def computes(candidate_src: str, task: Task) -> bool:
    """Whether every kernel of ``candidate_src`` matches a kernel of ``task``'s solution or its variants up to names
    (:func:`body_shape`); False for a candidate without a kernel or a task without a solution."""
    if task.solution_src is None:
        return False
    mine = kernel_shapes(candidate_src)
    return bool(mine) and mine <= _solution_shapes((task.solution_src, *task.solution_variants))


def slower_variant(candidate_src: str, task: Task) -> bool | None:
    """Whether a candidate reproduces one of ``task``'s slower variants (:attr:`Task.solution_variants`) rather than
    its solution: True when every kernel of it matches a variant's kernel (:func:`body_shape`) and not every one
    matches the solution's; False when its kernels are the solution's; None when it does not compute
    (:func:`computes`) or the task has no variant."""
    if not task.solution_variants or not computes(candidate_src, task):
        return None
    return not kernel_shapes(candidate_src) <= _solution_shapes((task.solution_src,))
