"""KernelBench levels guessed for references that come without one (DICE's infilling records)."""

from __future__ import annotations

import ast

from dice_ray.tasks.validate import validate_reference


def estimate_level(reference_src: str) -> int:
    """Guess a KernelBench level for a reference without one (DICE's infilling records have none).

    Counts the calls in ``Model.forward`` (``torch.relu(x)``, ``self.linear(x)``, ``x.sum()``...):
    at most one call is a single operator (level 1), more is a fusion (level 2).  Parses only.

    Raises:
        TaskError: the reference breaks a rule of :func:`validate_reference`.
    """
    tree = validate_reference(reference_src)
    model = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Model")
    forward = next(
        n for n in model.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == "forward"
    )
    calls = sum(isinstance(n, ast.Call) for n in ast.walk(forward))
    return 1 if calls <= 1 else 2
