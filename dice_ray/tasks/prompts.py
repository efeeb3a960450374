"""Prompts for the two phases of DICE's curriculum, and the candidates built from completions.

* ``"infill"`` (DICE's kernel infilling, first phase): the prompt shows the reference and the
  solution's scaffold (:mod:`dice_ray.tasks.scaffold`) with :data:`FILL_MARKER` where the CUDA source
  was cut out; the policy writes that middle, and the candidate is ``prefix + completion + suffix``.
* ``"e2e"`` (end-to-end generation, second phase): the prompt shows the reference and the fast
  format's rules (INTERFACES.md); the policy writes the whole solution file.

Two template sets:

* ``"compact"`` (default): short, for the tiny policy's ~600-token prompt budget; the reference is
  shown without comments, docstrings and blank-line runs (:func:`compact_reference`).
* ``"dice"``: fuller prompts in the manner of DICE's rollout prompts (deadlykitten4/DICE,
  ``sdar_rl_rollout_kernel.py``: task statement, reference, prefix and suffix blocks, output rules,
  a worked example for end-to-end), for real (SDAR-size) models.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from functools import lru_cache

from dice_ray.pysource import parse_python
from dice_ray.tasks.scaffold import Scaffold, ScaffoldError, make_scaffold
from dice_ray.tasks.task import Task

PHASES: tuple[str, ...] = ("infill", "e2e")
TEMPLATES: tuple[str, ...] = ("compact", "dice")
#: Where the missing CUDA source goes in an infill prompt.
FILL_MARKER = "<FILL>"

_FORMAT_RULES = (
    'Kernels: extern "C" __global__ functions in cuda_source = r"""...""", kernels = load_cuda(cuda_source) '
    "(from dice_ray.launch import load_cuda). ModelNew.forward allocates outputs with torch.empty and launches "
    "kernels.<name>(grid=..., block=..., args=(tensors, ints, floats)). No torch ops for the math."
)

_COMPACT = {
    "infill": "Reference:\n{reference}\nFill {marker} with {what} so that ModelNew matches Model:\n"
    "{prefix}{marker}{suffix}\n{What}:\n",
    "e2e": "Reference:\n{reference}\nWrite ModelNew, same __init__ arguments as Model, with CUDA kernels. "
    + _FORMAT_RULES
    + "\nSolution:\n",
}

_EXAMPLE_REFERENCE = '''import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, a, b):
        return a + b


def get_inputs():
    return [torch.randn(4096, 1024), torch.randn(4096, 1024)]


def get_init_inputs():
    return []
'''

_EXAMPLE_SOLUTION = '''import torch
import torch.nn as nn
from dice_ray.launch import load_cuda

cuda_source = r"""
extern "C" __global__ void add_kernel(const float* __restrict__ a, const float* __restrict__ b,
                                      float* __restrict__ out, long n) {
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i < n) out[i] = a[i] + b[i];
}
"""

kernels = load_cuda(cuda_source)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, a, b):
        a = a.contiguous()
        b = b.contiguous()
        out = torch.empty_like(a)
        n = a.numel()
        kernels.add_kernel(grid=(n + 255) // 256, block=256, args=(a, b, out, n))
        return out
'''

_DICE_STATEMENT = (
    "You write custom CUDA kernels that replace the PyTorch operators of a given architecture to make it "
    "faster. You may fuse operators or change the algorithm (online softmax, tiling), but the result must "
    "match the reference.\n\n"
)

_DICE = {
    "infill": _DICE_STATEMENT
    + "You are given a PyTorch reference, the ground truth of the behaviour, and a solution skeleton: a prefix "
    "and a suffix. Write the missing middle, {what_long}, so that prefix + middle + suffix "
    "is a working ModelNew equivalent to Model. Keep to the kernel names, arguments and launch configuration "
    "the suffix uses.\n\n"
    "The reference architecture:\n```python\n{reference}```\n\n"
    "The prefix:\n```python\n{prefix}```\n\n"
    "The suffix:\n```python\n{suffix}```\n\n"
    "Output only the middle in one code block, real code that compiles, no explanation and no testing code.\n",
    "e2e": _DICE_STATEMENT
    + "Here is an example. The given architecture:\n```python\n"
    + _EXAMPLE_REFERENCE
    + "```\nThe new architecture with custom CUDA kernels:\n```python\n"
    + _EXAMPLE_SOLUTION
    + "```\n\n"
    + _FORMAT_RULES
    + "\n\nYou are given the following architecture:\n```python\n{reference}```\n\n"
    "Optimize the architecture named Model with custom CUDA kernels and name the new architecture ModelNew, "
    "with the same __init__ arguments. Output the whole new file in one code block, real code that compiles, "
    "no explanation and no testing code.\n",
}

_SLOT = re.compile(r"\{(reference|prefix|suffix|marker|what|What|what_long)\}")
#: How an infill prompt names the middle, by scaffold granularity: (short, heading, long).
_MIDDLE_WORDS: dict[str, tuple[str, str, str]] = {
    "source": ("the CUDA source", "CUDA source", "the CUDA source of the kernels"),
    "body": ("the kernel's body", "Kernel body", "the body of the CUDA kernel whose braces end the prefix and open the suffix"),
}
_FENCE = re.compile(r"```[\w+-]*[ \t]*\r?\n(.*?)(?:```|\Z)", re.S)


def _fill(template: str, **values: str) -> str:
    """Put values in the ``{slot}`` places in one pass (values may hold braces, even slot names)."""
    return _SLOT.sub(lambda m: values[m.group(1)], template)


def _check_phase(phase: str) -> None:
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")


@lru_cache(maxsize=4096)
def _cached_scaffold(solution_src: str, fmt: str, granularity: str) -> Scaffold:
    return make_scaffold(solution_src, fmt, granularity)


def task_scaffold(task: Task, granularity: str = "source") -> Scaffold:
    """The scaffold of ``task``'s solution (cached), cut at ``granularity`` (``"source"``: the CUDA
    source; ``"body"``: the first ``__global__`` kernel's body; :func:`dice_ray.tasks.scaffold.make_scaffold`).

    Raises:
        ScaffoldError: the task has no solution, its solution has nothing to cut at that granularity,
            or ``granularity`` is unknown.
    """
    if task.solution_src is None or task.solution_format is None:
        raise ScaffoldError(f"task {task.task_id} has no solution_src: the infill phase needs one to cut")
    return _cached_scaffold(task.solution_src, task.solution_format, granularity)


@lru_cache(maxsize=4096)
def compact_reference(src: str) -> str:
    """``src`` without comments, docstrings, trailing spaces and runs of blank lines (for short prompts).

    Only presentation changes: the code itself is kept token for token.  A source that does not
    tokenize or parse is returned with trailing spaces and blank-line runs removed only.
    """
    src = src.replace("\r\n", "\n").replace("\r", "\n")
    lines = src.split("\n")
    drop: set[int] = set()  # 0-based lines to remove entirely
    cut: dict[int, int] = {}  # 0-based line -> column where a trailing comment starts
    try:
        for tok in tokenize.generate_tokens(io.StringIO(src).readline):
            if tok.type == tokenize.COMMENT:
                row, col = tok.start[0] - 1, tok.start[1]
                if lines[row][:col].strip():
                    cut[row] = col
                else:
                    drop.add(row)
        for node in ast.walk(parse_python(src)):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
                first = node.body[0]
                if (
                    isinstance(first, ast.Expr)
                    and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)
                    and len(node.body) > 1  # a body that is only a docstring must keep it
                    and not lines[first.lineno - 1].encode()[: first.col_offset].strip()
                    and not lines[first.end_lineno - 1].encode()[first.end_col_offset :].strip()
                ):
                    drop.update(range(first.lineno - 1, first.end_lineno))
    except (tokenize.TokenError, SyntaxError, IndentationError, ValueError, IndexError):
        drop, cut = set(), {}
    out: list[str] = []
    for i, line in enumerate(lines):
        if i in drop:
            continue
        line = (line[: cut[i]] if i in cut else line).rstrip()
        if not line and (not out or not out[-1]):
            continue
        out.append(line)
    while out and not out[-1]:
        out.pop()
    return "\n".join(out) + "\n"


def can_infill(task: Task, granularity: str = "source") -> bool:
    """Whether ``task`` can be posed in the infill phase: it has a solution with something to cut at
    ``granularity`` (a ``load_inline`` solution that only calls cuBLAS has no kernel body)."""
    try:
        task_scaffold(task, granularity)
    except ScaffoldError:
        return False
    return True


def build_prompt(task: Task, phase: str, template: str = "compact", granularity: str = "source") -> str:
    """The prompt of ``task`` for ``phase`` (``"infill"`` or ``"e2e"``) in template set ``template``.

    Infill prompts show the scaffold of the task's own solution (fast or load_inline format, cut at
    ``granularity``: ``"source"``, DICE's, or ``"body"``); end-to-end prompts always ask for the fast format.

    Raises:
        ValueError: unknown ``phase`` or ``template``.
        ScaffoldError: ``phase == "infill"`` and the task has no solution with a CUDA source to cut.
    """
    _check_phase(phase)
    if template not in TEMPLATES:
        raise ValueError(f"template must be one of {TEMPLATES}, got {template!r}")
    compact = template == "compact"
    reference = compact_reference(task.reference_src) if compact else task.reference_src
    if not reference.endswith("\n"):
        reference += "\n"
    text = (_COMPACT if compact else _DICE)[phase]
    if phase == "e2e":
        return _fill(text, reference=reference)
    sc = task_scaffold(task, granularity)
    prefix, suffix = sc.prefix, sc.suffix
    if not compact:
        prefix = prefix if prefix.endswith("\n") else prefix + "\n"
        suffix = suffix if suffix.endswith("\n") else suffix + "\n"
    what, heading, what_long = _MIDDLE_WORDS[granularity]
    return _fill(text, reference=reference, prefix=prefix, suffix=suffix, marker=FILL_MARKER, what=what,
                 What=heading, what_long=what_long)


def strip_fence(completion: str) -> str:
    """The content of the first markdown code block of ``completion`` (an unclosed one runs to the end).

    A completion that does not start with a fence (after blank space) is returned unchanged.
    """
    if not completion.lstrip().startswith("```"):
        return completion
    m = _FENCE.search(completion)
    return m.group(1) if m else completion


def assemble_candidate(task: Task, phase: str, completion: str, granularity: str = "source") -> str:
    """The candidate source built from a policy completion.

    ``"infill"``: ``prefix + completion + suffix`` of the task's scaffold at ``granularity``;
    ``"e2e"``: the completion.
    In both, a completion that starts with a markdown fence is first reduced to the fenced code
    (:func:`strip_fence`; the ``dice`` templates ask for a code block).

    Raises:
        ValueError: unknown ``phase``.
        TypeError: ``completion`` is not a str.
        ScaffoldError: ``"infill"`` for a task without a solution to cut.
    """
    _check_phase(phase)
    if not isinstance(completion, str):
        raise TypeError(f"completion must be a str, got {type(completion).__name__}")
    body = strip_fence(completion)
    if phase == "e2e":
        return body
    sc = task_scaffold(task, granularity)
    return sc.prefix + body + sc.suffix


def sft_pairs(task: Task, template: str = "compact") -> list[tuple[str, str]]:
    """(prompt, target completion) pairs for the SFT warm start on ``task``'s solution.

    ``[(infill prompt, scaffold middle), (e2e prompt, solution_src)]`` for a fast-format solution;
    only the infill pair for a load_inline solution (end-to-end prompts ask for the fast format);
    ``[]`` without a solution.  ``assemble_candidate(task, phase, target)`` rebuilds the solution
    exactly for every pair.

    Raises:
        ValueError: unknown ``template``.
        ScaffoldError: the solution has no CUDA source to cut.
    """
    if task.solution_src is None:
        return []
    pairs = [(build_prompt(task, "infill", template), task_scaffold(task).middle)]
    if task.solution_format == "fast":
        pairs.append((build_prompt(task, "e2e", template), task.solution_src))
    return pairs
