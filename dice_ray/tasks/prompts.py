"""Prompts for the two phases of DICE's curriculum, and the candidates built from completions.

* ``"infill"`` (DICE's kernel infilling, first phase): the prompt shows the reference and the
  solution's scaffold (:mod:`dice_ray.tasks.scaffold`) with :data:`FILL_MARKER` where the CUDA source
  was cut out; the policy writes that middle, and the candidate is ``prefix + completion + suffix``.
* ``"e2e"`` (end-to-end generation, second phase): the prompt shows the reference and the rules of
  the template's candidate format (:data:`E2E_FORMAT`); the policy writes the whole solution file.

Two template sets:

* ``"compact"`` (default): short, for the tiny policy's ~600-token prompt budget; the reference is
  shown without comments, docstrings and blank-line runs (:func:`compact_reference`). End-to-end
  prompts ask for dice-ray's fast (NVRTC) format.
* ``"dice"``: fuller prompts in the manner of DICE's rollout prompts (deadlykitten4/DICE,
  ``sdar_rl_rollout_kernel.py``: task statement, reference, prefix and suffix blocks, output rules,
  a worked example for end-to-end), for real (SDAR-size) models. End-to-end prompts ask for the
  ``load_inline`` format (KernelBench's and DICE's, the format DICE's checkpoints were trained on),
  with a worked ``load_inline`` example.

The bidirectional families (LLaDA, Dream) infill for real: the span is decoded between a fixed
prefix and suffix (:func:`infill_context` gives the two texts); SDAR sees the scaffold in its prompt
(:func:`build_prompt`), as DICE's SDAR rollouts do.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from dataclasses import replace
from functools import lru_cache

from dice_ray.pysource import parse_python
from dice_ray.tasks.scaffold import Scaffold, ScaffoldError, make_scaffold
from dice_ray.tasks.task import Task

PHASES: tuple[str, ...] = ("infill", "e2e")
TEMPLATES: tuple[str, ...] = ("compact", "dice")
#: The candidate format each template's end-to-end prompt asks for (and its SFT targets are written in).
E2E_FORMAT: dict[str, str] = {"compact": "fast", "dice": "load_inline"}
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


_EXAMPLE_INLINE_SOLUTION = '''import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

add_source = """
#include <torch/extension.h>

__global__ void add_kernel(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ out,
                           long n) {
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i < n) out[i] = a[i] + b[i];
}

torch::Tensor add_cuda(torch::Tensor a, torch::Tensor b) {
    auto out = torch::empty_like(a);
    long n = a.numel();
    add_kernel<<<(n + 255) / 256, 256>>>(a.data_ptr<float>(), b.data_ptr<float>(), out.data_ptr<float>(), n);
    return out;
}
"""

add_cpp_source = "torch::Tensor add_cuda(torch::Tensor a, torch::Tensor b);"

add_ext = load_inline(
    name="add_ext",
    cpp_sources=add_cpp_source,
    cuda_sources=add_source,
    functions=["add_cuda"],
)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, a, b):
        return add_ext.add_cuda(a.contiguous(), b.contiguous())
'''

_INLINE_RULES = (
    "Kernels: CUDA C++ in a string passed as cuda_sources to torch.utils.cpp_extension.load_inline, with the C++ "
    "declarations as cpp_sources and the host functions listed in functions=[...]; ModelNew.forward calls them. Host "
    "C++ allocates the outputs (torch::empty) and launches the kernels. No torch ops for the math."
)

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
    + _EXAMPLE_INLINE_SOLUTION
    + "```\n\n"
    + _INLINE_RULES
    + "\n\nYou are given the following architecture:\n```python\n{reference}```\n\n"
    "Optimize the architecture named Model with custom CUDA kernels and name the new architecture ModelNew, "
    "with the same __init__ arguments. Output the whole new file in one code block, real code that compiles, "
    "no explanation and no testing code.\n",
}

#: Bidirectional infilling (LLaDA, Dream; :func:`infill_context`): the text before the span, ending with the scaffold's
#: prefix, and the text after it, starting with the scaffold's suffix; the span is decoded between them.
_SPAN = {
    "compact": ("Reference:\n{reference}\nWrite {what} where it is missing so that ModelNew matches Model:\n{prefix}",
                "{suffix}"),
    "dice": (_DICE_STATEMENT
             + "You are given a PyTorch reference, the ground truth of the behaviour, and a solution whose middle, "
             "{what_long}, is missing. Write the middle so that the file is a working ModelNew equivalent to Model. Keep "
             "to the kernel names, arguments and launch configuration the rest of the file uses.\n\n"
             "The reference architecture:\n```python\n{reference}```\n\n"
             "The solution:\n```python\n{prefix}",
             "{suffix}```\n"),
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
        raise ScaffoldError("the task has no solution_src: the infill phase needs one to cut")
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


def infill_blocker(task: Task, granularity: str = "source") -> str | None:
    """Why ``task`` cannot be posed in the infill phase (the scaffold's error: no solution, or nothing to cut at
    ``granularity``, e.g. a ``load_inline`` solution that only calls cuBLAS has no kernel body); None when it can."""
    try:
        task_scaffold(task, granularity)
    except ScaffoldError as e:
        return str(e)
    return None


def can_infill(task: Task, granularity: str = "source") -> bool:
    """Whether ``task`` can be posed in the infill phase (:func:`infill_blocker` finds nothing against it)."""
    return infill_blocker(task, granularity) is None


def _reference(task: Task, template: str) -> str:
    """The reference as the template shows it (compact: :func:`compact_reference`), ending with a newline."""
    if template not in TEMPLATES:
        raise ValueError(f"template must be one of {TEMPLATES}, got {template!r}")
    reference = compact_reference(task.reference_src) if template == "compact" else task.reference_src
    return reference if reference.endswith("\n") else reference + "\n"


def build_prompt(task: Task, phase: str, template: str = "compact", granularity: str = "source") -> str:
    """The prompt of ``task`` for ``phase`` (``"infill"`` or ``"e2e"``) in template set ``template``.

    Infill prompts show the scaffold of the task's own solution (fast or load_inline format, cut at
    ``granularity``: ``"source"``, DICE's, or ``"body"``) with the middle marked missing; end-to-end prompts ask
    for the template's format (:data:`E2E_FORMAT`: fast for ``compact``, load_inline for ``dice``).

    Raises:
        ValueError: unknown ``phase`` or ``template``.
        ScaffoldError: ``phase == "infill"`` and the task has no solution with a CUDA source to cut.
    """
    _check_phase(phase)
    reference = _reference(task, template)
    compact = template == "compact"
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


def infill_context(task: Task, template: str = "compact", granularity: str = "source") -> tuple[str, str]:
    """The two fixed texts around the span a bidirectional policy (LLaDA, Dream) infills for ``task``.

    ``before`` holds the instructions, the reference and the scaffold's prefix, and ends exactly where the middle
    goes; ``after`` starts with the scaffold's suffix. The policy decodes the middle between them
    (:func:`dice_ray.policy.sampler.infill_group`), and ``assemble_candidate(task, "infill", middle)`` builds the
    candidate, as for SDAR, which reads the same scaffold inside its prompt (:func:`build_prompt`).

    Raises:
        ValueError: unknown ``template``.
        ScaffoldError: the task has no solution with something to cut at ``granularity``.
    """
    reference = _reference(task, template)
    sc = task_scaffold(task, granularity)
    what, _, what_long = _MIDDLE_WORDS[granularity]
    before, after = _SPAN[template]
    return (_fill(before, reference=reference, prefix=sc.prefix, what=what, what_long=what_long),
            _fill(after, suffix=sc.suffix if template == "compact" or sc.suffix.endswith("\n") else sc.suffix + "\n"))


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


def sft_pairs(task: Task, template: str = "compact", family: str = "sdar",
              granularity: str = "source") -> list[tuple[str, ...]]:
    """Training pairs for the SFT warm start on ``task``'s solution and its variants.

    For the solution and each of :attr:`Task.solution_variants`: an infill pair (the middle of the scaffold cut at
    ``granularity``, the run's ``phase.scaffold_granularity``, as the target)
    and, when the solution is in the format the template's end-to-end prompt asks for (:data:`E2E_FORMAT`), an
    end-to-end pair (the whole solution as the target); ``[]`` without a solution. Infill pairs are
    ``(prompt, middle)`` for SDAR, which reads the scaffold in its prompt (:func:`build_prompt`), and
    ``(before, middle, after)`` for the bidirectional families (``"llada"``, ``"dream"``), which decode the middle
    between the scaffold's two sides (:func:`infill_context`). ``assemble_candidate(task, phase, target)``
    rebuilds the solution (or variant) exactly for every pair.

    Raises:
        ValueError: unknown ``template``.
        ScaffoldError: the solution has nothing to cut at ``granularity``.
    """
    if task.solution_src is None:
        return []
    pairs: list[tuple[str, ...]] = []
    for src in (task.solution_src, *task.solution_variants):
        one = task if src is task.solution_src else replace(task, solution_src=src, solution_variants=())
        middle = task_scaffold(one, granularity).middle
        if family == "sdar":
            pairs.append((build_prompt(one, "infill", template, granularity), middle))
        else:
            before, after = infill_context(one, template, granularity)
            pairs.append((before, middle, after))
        if one.solution_format == E2E_FORMAT[template]:
            pairs.append((build_prompt(one, "e2e", template), src))
    return pairs


def training_pairs(tasks: list[Task], template: str = "compact", family: str = "sdar",
                   granularity: str = "source") -> tuple[list[tuple[str, ...]], int]:
    """The SFT warm start's pairs of ``tasks`` (:func:`sft_pairs` of each task with a solution), and how many tasks
    were skipped because their solution cannot be cut at ``granularity`` (e.g. no ``__global__`` kernel)."""
    pairs: list[tuple[str, ...]] = []
    uncut = 0
    for t in tasks:
        try:
            pairs += sft_pairs(t, template, family, granularity)
        except ScaffoldError:
            uncut += 1
    return pairs, uncut
