"""The import guard: what a candidate's module may import and call while it runs in the worker.

The candidate's module runs with restricted builtins (:func:`candidate_builtins`: no ``open``, ``eval``,
``setattr``..., ``getattr`` only reading a tensor, submodule or plain value by a public name: :func:`read_attribute`)
and an ``__import__`` that holds its own ``import`` statements to the allow-list
(:func:`dice_ray.verify.rules.allowlist.import_allowed`, the static rules' own): :func:`guarded_import` for the
fast format, :func:`inline_guarded_import` for the load_inline format (``torch.utils.cpp_extension``'s
``load_inline`` allowed).  A refused import is rule ``forbidden-import`` (:class:`RuleBroken`).  C code
(torch's dispatcher, ...) imports through the same builtins; those calls are told apart by the calling frame's
current instruction not being ``IMPORT_NAME`` and pass.  The guard always runs, unlike the dispatch-mode op
check.
"""

from __future__ import annotations

import builtins
import dis
import sys
from typing import Any, Callable

from dice_ray.verify.rules.allowlist import import_allowed
from dice_ray.verify.trials.outcome import RuleBroken

__all__ = ["candidate_builtins", "guarded_import", "inline_guarded_import", "read_attribute"]

_IMPORT_NAME = dis.opmap["IMPORT_NAME"]


def guarded_import(name, globals=None, locals=None, fromlist=(), level=0):  # noqa: A002, ANN001
    """The candidate's ``__import__``: its own ``import`` statements must be on the allow-list.

    C code (torch's dispatcher, ...) also imports through the current frame's builtins; those
    calls are recognised by the frame's current instruction not being IMPORT_NAME and pass.
    """
    frame = sys._getframe(1)
    own = frame.f_code.co_filename == "<candidate>" and frame.f_code.co_code[frame.f_lasti] == _IMPORT_NAME
    names = tuple(fromlist or ())
    if own and (level or not import_allowed(name, names)):
        what = f"from {name} import {', '.join(names)}" if names else f"import {name}"
        raise RuleBroken("forbidden-import", f"{what} at run time")
    return builtins.__import__(name, globals, locals, fromlist, level)


_REMOVED_BUILTINS = ("open", "eval", "exec", "compile", "getattr", "setattr", "delattr", "globals", "locals", "vars",
                     "breakpoint", "input", "help", "memoryview", "exit", "quit")


def read_attribute(obj: Any, name: Any) -> Any:
    """The guarded candidate's ``getattr``: the one form the static rules allow
    (:meth:`~dice_ray.verify.rules.python_rules._Checker.reads_attribute`: ``getattr(self.lstm, "weight_ih_l" +
    suffix)``, two arguments, a parameter, buffer or submodule read by name), checked again where it runs: a public
    name, and a tensor, module or plain value (no function, method, class or module: a value to call).  Rule
    ``dynamic-code`` otherwise."""
    import types

    import torch

    if not isinstance(name, str) or not name.isidentifier() or name.startswith("_"):
        raise RuleBroken("dynamic-code", f"getattr of {name!r}: only a public attribute name may be read")
    value = getattr(obj, name)
    if isinstance(value, (torch.Tensor, torch.nn.Module, int, float, bool, str, type(None))):
        return value
    if isinstance(value, (tuple, list)) and all(isinstance(v, (int, float, bool, str, torch.Tensor)) for v in value):
        return value
    kind = "a module" if isinstance(value, types.ModuleType) else type(value).__name__
    raise RuleBroken("dynamic-code", f"getattr(..., {name!r}) gives {kind}: only tensors, submodules and plain values "
                     "may be read by name")


def candidate_builtins(guarded: bool, importer: Callable[..., Any] | None = None) -> dict[str, Any]:
    """The builtins a candidate's module runs with: all of them, or when ``guarded`` (the static rules on)
    without :data:`_REMOVED_BUILTINS`, with :func:`read_attribute` as ``getattr`` and with :func:`guarded_import`;
    ``importer`` replaces ``__import__`` whether guarded or not (the load_inline format's
    :func:`inline_guarded_import`)."""
    b = dict(vars(builtins))
    if guarded:
        for n in _REMOVED_BUILTINS:
            b.pop(n, None)
        b["getattr"] = read_attribute
        b["__import__"] = guarded_import
    if importer is not None:
        b["__import__"] = importer
    return b


def inline_guarded_import(guarded: bool) -> Callable[..., Any]:
    """The load_inline format's ``__import__``: as :func:`guarded_import`, with ``torch.utils.cpp_extension``'s
    ``load_inline`` allowed (:func:`~dice_ray.verify.rules.allowlist.import_allowed` with ``inline``); when not
    ``guarded`` it checks nothing."""
    own_code = "<candidate>"

    def _import(name, globals=None, locals=None, fromlist=(), level=0):  # noqa: A002, ANN001
        # as guarded_import: only the candidate's own import statements are checked
        frame = sys._getframe(1)
        own = frame.f_code.co_filename == own_code and frame.f_code.co_code[frame.f_lasti] == _IMPORT_NAME
        names = tuple(fromlist or ())
        if guarded and own and (level or not import_allowed(name, names, inline=True)):
            what = f"from {name} import {', '.join(names)}" if names else f"import {name}"
            raise RuleBroken("forbidden-import", f"{what} at run time")
        return builtins.__import__(name, globals, locals, fromlist, level)

    return _import
