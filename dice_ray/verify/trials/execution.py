"""Source execution in the worker: the candidate's and the reference's modules run, each in a fresh namespace.

:func:`exec_source` runs a module's text (the fast format's candidate: ``load_cuda`` compiles with NVRTC here, its
source checked first by :func:`check_load_cuda_source`; the task's reference, unguarded);
:func:`exec_inline` runs a load_inline candidate with ``load_inline`` bound to its prebuilt extensions
(:mod:`dice_ray.verify.trials.inline_loader`; :func:`standing_in` puts that ``load_inline`` back while ``ModelNew`` is
built).  A guarded run has the import guard's builtins
(:mod:`dice_ray.verify.trials.import_guard`).  The source comes as text from the parent (which read the candidate
once, :class:`~dice_ray.verify.candidate.candidate.Candidate`); compiling it here is executing it.
"""

from __future__ import annotations

import contextlib
import functools
import linecache
import sys
import types
from collections.abc import Iterator
from typing import Any

from dice_ray.verify.rules.cuda_text import check_cuda_source
from dice_ray.verify.trials import inline_launches
from dice_ray.verify.trials.import_guard import candidate_builtins, inline_guarded_import
from dice_ray.verify.trials.inline_loader import make_loader
from dice_ray.verify.trials.outcome import RuleBroken

__all__ = ["check_load_cuda_source", "exec_inline", "exec_source", "inline_stand_in", "standing_in"]

@functools.lru_cache(maxsize=64)
def _compile(src: str, filename: str) -> Any:
    """``compile(src, filename, "exec")``, cached: a task's reference is compiled once, not once a
    candidate (0.3 ms a compile, under the GPU gate).  A code object is immutable; each exec of it
    still makes a fresh namespace.

    Raises:
        SyntaxError, ValueError: as ``compile`` (not cached).
    """
    return compile(src, filename, "exec")


def exec_source(src: str, filename: str, guarded: bool) -> dict[str, Any]:
    """Execute a module's source in a fresh namespace (candidate: restricted builtins when ``guarded``).

    Raises:
        whatever the module raises (SyntaxError, CompileError, RuleBroken, ...).
    """
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    code = _compile(src, filename)
    ns: dict[str, Any] = {"__name__": f"dice_ray_{filename.strip('<>')}", "__builtins__": candidate_builtins(guarded)}
    exec(code, ns)  # noqa: S102 - the sandboxed worker exists to do this
    return ns


def check_load_cuda_source(source: Any) -> None:
    """``load_cuda``'s hook (:func:`dice_ray.launch.configure`'s ``source_check``): the CUDA-side rules
    (:func:`~dice_ray.verify.rules.cuda_text.check_cuda_source`) on the final source string, however it was built.

    Raises:
        RuleBroken: the first violation (``cuda-library``, ``file-access``).
    """
    if isinstance(source, str):
        for v in check_cuda_source(source):
            raise RuleBroken(v.rule, f"load_cuda source: {v.message}")


def inline_stand_in(inline_job: dict[str, Any]) -> types.ModuleType:
    """The ``torch.utils.cpp_extension`` a load_inline candidate sees: a module holding only the ``load_inline`` that
    loads ``inline_job``'s prebuilt extensions (:func:`~dice_ray.verify.trials.inline_loader.make_loader`;
    ``inline_job`` is the verifier's ``job["inline"]``, see :func:`exec_inline`)."""
    fake = types.ModuleType("torch.utils.cpp_extension")
    fake.load_inline = make_loader(list(inline_job.get("modules", [])),  # type: ignore[attr-defined]
                                    bool(inline_job.get("allow_vendor_libraries", False)))
    return fake


@contextlib.contextmanager
def standing_in(fake: types.ModuleType | None) -> Iterator[None]:
    """Inside the block, ``torch.utils.cpp_extension`` is ``fake`` (:func:`inline_stand_in`): ``import
    torch.utils.cpp_extension``, ``from torch.utils.cpp_extension import load_inline``, ``from torch.utils import
    cpp_extension`` and ``torch.utils.cpp_extension.load_inline`` all reach it; the real module is put back after.
    ``fake`` None: nothing changes (the fast format)."""
    if fake is None:
        yield
        return
    import torch.utils

    missing = object()
    saved_mod = sys.modules.get("torch.utils.cpp_extension", missing)
    saved_attr = torch.utils.__dict__.get("cpp_extension", missing)
    sys.modules["torch.utils.cpp_extension"] = fake
    torch.utils.cpp_extension = fake  # type: ignore[attr-defined]
    try:
        yield
    finally:
        if saved_mod is missing:
            sys.modules.pop("torch.utils.cpp_extension", None)
        else:
            sys.modules["torch.utils.cpp_extension"] = saved_mod
        if saved_attr is missing:
            torch.utils.__dict__.pop("cpp_extension", None)
        else:
            torch.utils.cpp_extension = saved_attr  # type: ignore[attr-defined]


def exec_inline(candidate_src: str, inline_job: dict[str, Any], guarded: bool,
                stand_in: types.ModuleType | None = None) -> dict[str, Any]:
    """Execute a load_inline candidate in the worker with ``load_inline`` bound to the prebuilt
    extensions of ``inline_job`` (the verifier's ``job["inline"]``).

    ``inline_job["modules"]``: one dict per spec with ``key`` (:meth:`InlineSpec.key
    <dice_ray.verify.candidate.inline_spec.InlineSpec.key>`), ``module``
    (the ``PyInit_`` name), ``path`` (the ``.so``; None in compile-only mode: the functions become
    stubs), ``counting`` and ``has_cuda``; ``inline_job["allow_vendor_libraries"]`` (default False)
    is ``VerifyConfig.allow_vendor_libraries``, so the run-time call is read with the same rules as
    the static one.  While the module runs, ``torch.utils.cpp_extension`` is ``stand_in`` (default: a new
    :func:`inline_stand_in` of ``inline_job``; :func:`standing_in`); the harness puts the same one back while
    ``ModelNew`` is built, whose ``__init__`` may call ``load_inline`` too
    (:func:`~dice_ray.verify.candidate.inline_spec.extract_specs`).

    Returns:
        The candidate's namespace.
    Raises:
        CompileError (an :class:`~dice_ray.verify.trials.inline_loader.InlineLoadError`): a call that does not match a
            built spec; RuleBroken (forbidden import); whatever the module raises.
    """
    inline_launches.reset()
    with standing_in(stand_in if stand_in is not None else inline_stand_in(inline_job)):
        filename = "<candidate>"
        linecache.cache[filename] = (len(candidate_src), None, candidate_src.splitlines(True), filename)
        code = compile(candidate_src, filename, "exec")
        b = candidate_builtins(guarded, importer=inline_guarded_import(guarded))
        ns: dict[str, Any] = {"__name__": "dice_ray_candidate", "__builtins__": b}
        exec(code, ns)  # noqa: S102 - the sandboxed worker exists to do this
        return ns
