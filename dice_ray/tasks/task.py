"""The task model: one KernelBench-format problem and, optionally, a working solution.

A *reference* (KernelBench format, also the ``pytorch_code`` of DICE's RL data) is a Python module
that defines ``class Model(nn.Module)`` with a ``forward``, ``get_inputs()`` (the forward's
arguments) and ``get_init_inputs()`` (the constructor's arguments).  A *solution* defines
``class ModelNew`` with the same constructor signature, in one of two formats:

* ``"fast"``: dice-ray's NVRTC format (``cuda_source = r\"\"\"...\"\"\"``,
  ``kernels = load_cuda(cuda_source)``, see INTERFACES.md);
* ``"load_inline"``: KernelBench / DICE's ``torch.utils.cpp_extension.load_inline`` format.

Sources are untrusted (DICE records, user files): validation here only parses them with
:mod:`ast` and never executes them (:mod:`dice_ray.tasks.validate`); references run only inside the
verifier's sandbox.  Input sizing: :mod:`dice_ray.tasks.sizing`; levels guessed: :mod:`dice_ray.tasks.levels`.
"""

from __future__ import annotations

from dataclasses import dataclass

from dice_ray.tasks.validate import SolutionFormat, TaskError, validate_reference, validate_solution


#: :attr:`Task.role` values: the phase whose task set a task belongs to, or ``"both"``
TASK_ROLES: tuple[str, ...] = ("both", "infill", "e2e")


@dataclass(frozen=True)
class Task:
    """One problem: a KernelBench-format reference and, optionally, a working solution.

    Attributes:
        task_id: unique id, e.g. ``"builtin/L1/relu"``, ``"dice-e2e/17"``, ``"dice-infill/3"``.
        name: short human name (``"relu"``).
        level: 0..4; 1 single operator, 2 fusion, 3 whole model (KernelBench levels; DICE data also
            has 0).  Used to order the curriculum from single operators to fused models.
        reference_src: the reference module (see :func:`~dice_ray.tasks.validate.validate_reference`).
        solution_src: a working solution, or None.
        solution_format: ``"fast"`` or ``"load_inline"``; set exactly when ``solution_src`` is.
        solution_variants: further honest solutions in ``solution_format`` (the built-in suite's slower variants,
            ``solution_slow.py``: same result, a slower kernel); the SFT warm start learns each, so that RL's
            speedup term has a slower and a faster way to choose between. Infill scaffolds cut ``solution_src``.
        role: the phase whose set the task belongs to (:data:`TASK_ROLES`): ``"infill"`` for DICE's kernel
            infilling file, ``"e2e"`` for its end-to-end file, ``"both"`` for every other source. A run whose
            tasks include a set marked for a phase draws that phase's prompts from it (DICE's recipe: infilling
            from one file, end-to-end from the other); see :func:`dice_ray.tasks.loaders.phase_pool`.

    Raises:
        TaskError: on construction, when a field breaks a rule (the message names the field and
            the rule).  Sources are parsed, never executed.
    """

    task_id: str
    name: str
    level: int
    reference_src: str
    solution_src: str | None = None
    solution_format: SolutionFormat | None = None
    solution_variants: tuple[str, ...] = ()
    role: str = "both"

    def __post_init__(self) -> None:
        for field in ("task_id", "name"):
            value = getattr(self, field)
            if not isinstance(value, str) or not value.strip():
                raise TaskError(f"bad-{field.replace('_', '-')}", f"{field} must be a non-empty str, got {value!r}")
        if isinstance(self.level, bool) or not isinstance(self.level, int) or not 0 <= self.level <= 4:
            raise TaskError("bad-level", f"level must be an int in 0..4, got {self.level!r}")
        validate_reference(self.reference_src)
        if (self.solution_src is None) != (self.solution_format is None):
            raise TaskError(
                "solution-format-mismatch",
                "solution_src and solution_format must be given together "
                f"(solution_src is {'None' if self.solution_src is None else 'set'}, "
                f"solution_format={self.solution_format!r})",
            )
        if self.solution_src is not None:
            validate_solution(self.solution_src, self.solution_format)
        if self.solution_variants and self.solution_src is None:
            raise TaskError("solution-format-mismatch", "solution_variants need a solution_src (their format is its)")
        for i, src in enumerate(self.solution_variants):
            validate_solution(src, self.solution_format, field=f"solution variant {i + 1}")
        if self.role not in TASK_ROLES:
            raise TaskError("bad-role", f"role must be one of {TASK_ROLES}, got {self.role!r}")
