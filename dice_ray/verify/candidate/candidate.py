"""The candidate, read once: one typed object that every stage of the verifier reads instead of the source text.

:meth:`Verifier.verify <dice_ray.verify.verifier.Verifier.verify>` makes it at its entry
(:meth:`Candidate.from_source`): the module is parsed once (:func:`dice_ray.pysource.parse_python`, nesting
bounded), its format decided on that tree (:func:`~dice_ray.verify.candidate.inline_spec.is_inline`), a
load_inline candidate's calls read from it (:func:`~dice_ray.verify.candidate.inline_spec.extract_specs`) and its
dead code found from it when first asked (:func:`~dice_ray.verify.candidate.liveness.dead_code`).  The static
rules (:func:`dice_ray.verify.rules.check.check_candidate`), the source the worker runs
(:meth:`Candidate.runnable_source`) and the load_inline build (``Verifier._prepare_inline``) all read this object.
The sandboxed worker is another process: it gets :meth:`runnable_source`'s text and executes it (compiling it
there is executing it).

Functions that take a candidate also take a source string (:meth:`Candidate.coerce`), for tests and tools that
hold only text; the verifier itself reads a candidate once.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from dice_ray.pysource import parse_python
from dice_ray.verify.candidate.inline_spec import InlineSpec, UnsupportedFormat, extract_specs, is_inline
from dice_ray.verify.candidate.liveness import DeadCode, dead_code, strip_dead_imports

__all__ = ["Candidate"]


@dataclass(frozen=True, eq=False)
class Candidate:
    """A candidate module read once (see the module docstring); immutable.

    Attributes:
        source: the module's text as submitted.
        tree: its parse tree, or None when it does not parse (then ``syntax_error`` says why).
        syntax_error: the ``SyntaxError`` (or ``ValueError``: NUL bytes) of the parse, None when it parsed.
        format: ``"fast"`` (``load_cuda``, NVRTC) or ``"inline"`` (torch's ``load_inline``, KernelBench /
            DICE); ``"fast"`` for text that does not parse.
        specs: the load_inline format's calls read statically, in source order (empty for the fast format, for a
            load_inline candidate without a top-level ``name = load_inline(...)`` or a ``self.<name> =
            load_inline(...)`` in ``__init__``, and when ``spec_error`` is set).
        spec_error: why a load_inline candidate's calls cannot be read (rule ``unsupported-format``, or
            ``cuda-library`` for a vendor library's ``-l`` flag), None otherwise.
        allow_vendor_libraries: ``VerifyConfig.allow_vendor_libraries`` when the calls were read: with it, the
            ``-l`` flags of :data:`~dice_ray.verify.candidate.inline_spec.VENDOR_LIBRARIES` are accepted.
    """

    source: str
    tree: ast.Module | None
    syntax_error: SyntaxError | ValueError | None
    format: Literal["fast", "inline"]
    specs: tuple[InlineSpec, ...] = ()
    spec_error: UnsupportedFormat | None = None
    allow_vendor_libraries: bool = False

    @classmethod
    def from_source(cls, source: str, *, allow_vendor_libraries: bool = False) -> Candidate:
        """Read a candidate module: parse it, decide its format, read its ``load_inline`` calls.

        Args:
            source: the candidate module's text.
            allow_vendor_libraries: ``VerifyConfig.allow_vendor_libraries`` (how ``-l`` flags are read).

        Returns:
            The :class:`Candidate`; a source that does not parse gives one with ``tree`` None (not an error).
        Raises:
            TypeError: ``source`` is not a str.
        """
        if not isinstance(source, str):
            raise TypeError(f"candidate source must be a str, got {type(source).__name__}")
        try:
            tree = parse_python(source)
        except (SyntaxError, ValueError) as e:
            return cls(source, None, e, "fast", allow_vendor_libraries=allow_vendor_libraries)
        if not is_inline(tree):
            return cls(source, tree, None, "fast", allow_vendor_libraries=allow_vendor_libraries)
        try:
            specs, error = tuple(extract_specs(tree, allow_vendor_libraries=allow_vendor_libraries)), None
        except UnsupportedFormat as e:
            specs, error = (), e
        return cls(source, tree, None, "inline", specs, error, allow_vendor_libraries)

    @classmethod
    def coerce(cls, candidate: Candidate | str, *, allow_vendor_libraries: bool | None = None) -> Candidate:
        """``candidate`` itself, or a source string read with :meth:`from_source`.

        Args:
            allow_vendor_libraries: how a text's ``-l`` flags are read (None: False); for a Candidate, None or the
                value it was read with.

        Raises:
            TypeError: neither a Candidate nor a str.
            ValueError: a Candidate read with another ``allow_vendor_libraries`` than the one given.
        """
        if not isinstance(candidate, Candidate):
            return cls.from_source(candidate, allow_vendor_libraries=bool(allow_vendor_libraries))
        if allow_vendor_libraries is not None and candidate.allow_vendor_libraries != allow_vendor_libraries:
            raise ValueError(f"the candidate was read with allow_vendor_libraries={candidate.allow_vendor_libraries}, "
                             f"asked for {allow_vendor_libraries}")
        return candidate

    @functools.cached_property
    def dead(self) -> DeadCode:
        """What of the module never runs (:func:`~dice_ray.verify.candidate.liveness.dead_code` of :attr:`tree`),
        found on first use; empty when the module does not parse."""
        return DeadCode() if self.tree is None else dead_code(self.tree)

    @property
    def kernels(self) -> dict[str | None, tuple[str, ...]]:
        """The load_inline format's extension functions by the name holding each extension
        (``{"ext": ("relu",)}`` for ``ext = load_inline(..., functions=["relu"])`` at module top level,
        ``{"self.ext": ...}`` for ``self.ext = load_inline(...)`` in ``__init__``); empty for the fast format,
        whose ``kernels.<name>`` uses the static rules find (``StaticReport.kernel_refs``)."""
        return {s.var: s.functions for s in self.specs}

    def runnable_source(self, allowed: Callable[[str, tuple[str, ...]], bool]) -> str:
        """The text the sandboxed worker executes: :attr:`source` without the dead imports ``allowed`` refuses
        (:func:`~dice_ray.verify.candidate.liveness.strip_dead_imports` on this tree; line numbers kept), so
        the worker's import guard never meets an import nothing uses.  :attr:`source` itself when it does not
        parse.

        Args:
            allowed: ``(module, names) -> bool``, the import allow-list
                (:func:`dice_ray.verify.rules.allowlist.import_allowed`).
        """
        if self.tree is None:
            return self.source
        return strip_dead_imports(self.source, allowed, tree=self.tree, dead=self.dead)
