"""The load_inline stand-in the worker gives a candidate: its prebuilt extensions, loaded once the call matches.

The worker never builds (seccomp forbids fork/exec there): the verifier built each
:class:`~dice_ray.verify.candidate.inline_spec.InlineSpec` (:mod:`dice_ray.verify.candidate.inline_build`) and
sends a job entry a spec (``key``, ``module``, ``path``, ``counting``, ``has_cuda``).  :func:`make_loader` gives
the ``load_inline`` the candidate's module calls (:func:`dice_ray.verify.trials.execution.exec_inline`): the
call's arguments are read as the static reading read them (:func:`~dice_ray.verify.candidate.inline_spec.spec_from_call`)
and must hash to a built spec; the candidate gets a facade holding only its ``functions``, and the extension's
launch counters count (:func:`dice_ray.verify.trials.inline_launches.register`).  In compile-only mode (no
``.so``) the functions are stubs.
"""

from __future__ import annotations

import importlib.util
import types
from typing import Any

from dice_ray.verify.candidate.inline_spec import UnsupportedFormat, spec_from_call
from dice_ray.verify.candidate.nvrtc import CompileError
from dice_ray.verify.trials import inline_launches

__all__ = ["InlineLoadError", "make_loader"]

_loaded: dict[str, Any] = {}  # .so path -> extension module (a .so loads once per process)


class InlineLoadError(CompileError):
    """A ``load_inline`` call in the worker that does not match what was built, or a ``.so`` that does not load
    (a :class:`~dice_ray.verify.candidate.nvrtc.CompileError`, so the harness reports it as one).

    Attributes:
        log: the message; ``arch`` is ``"?"``; ``source`` is None (no CUDA source of the candidate's to point into).
    """

    def __init__(self, message: str):
        RuntimeError.__init__(self, message)
        self.log, self.arch, self.source = message, "?", None

    def __reduce__(self):  # pickles with its own arguments
        return type(self), (self.log,)


class _Stub:
    """A compile-only extension: the objects compiled, nothing can run (the dry run stops here)."""

    def __init__(self, name: str, fn: str):
        self.__name__ = fn
        self._what = f"{name}.{fn}"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"compile-only: {self._what} was compiled to object files and cannot run "
                                  "on meta tensors")


def _import_so(entry: dict[str, Any]) -> Any:
    path = entry["path"]
    mod = _loaded.get(path)
    if mod is None:
        spec = importlib.util.spec_from_file_location(entry["module"], path)
        if spec is None or spec.loader is None:
            raise InlineLoadError(f"cannot load the extension built at {path}")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        _loaded[path] = mod
    return mod


def make_loader(entries: list[dict[str, Any]], allow_vendor_libraries: bool = False) -> Any:
    """The ``load_inline`` a load_inline candidate runs with: ``entries`` are the built specs' job entries
    (:meth:`BuildResult.job_entry <dice_ray.verify.candidate.inline_build.BuildResult.job_entry>`),
    ``allow_vendor_libraries`` reads the call as the static reading did.

    The returned function raises :class:`InlineLoadError` for a call whose arguments do not match a built spec
    (``[unsupported-format]``, or the rule of an argument it cannot read) or whose ``.so`` does not load.
    """
    by_key = {e["key"]: e for e in entries}

    def load_inline(*args: Any, **kwargs: Any) -> types.ModuleType:
        try:
            spec = spec_from_call(args, kwargs, allow_vendor_libraries=allow_vendor_libraries)
        except UnsupportedFormat as e:
            raise InlineLoadError(f"[{e.rule}] load_inline at run time: {e}") from None
        entry = by_key.get(spec.key())
        if entry is None:
            raise InlineLoadError(
                f"[unsupported-format] load_inline(name={spec.name!r}) was called with arguments that differ from "
                "the ones read statically (only constant arguments are supported)")
        facade = types.ModuleType(spec.name)
        if entry.get("path"):
            mod = _import_so(entry)
            for fn in spec.functions:
                setattr(facade, fn, getattr(mod, fn))
            if entry.get("has_cuda", True):
                inline_launches.register(mod, entry.get("counting", "host"))
        else:
            for fn in spec.functions:
                setattr(facade, fn, _Stub(spec.name, fn))
        return facade

    return load_inline
