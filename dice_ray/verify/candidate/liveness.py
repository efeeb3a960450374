"""Which parts of a candidate module can ever run: dead code is not judged as run-time code.

Solutions written for KernelBench often carry code the harness never runs: a copy of the task's
``get_inputs`` / ``get_init_inputs`` (``torch.randn``), a test function, an
``if __name__ == "__main__":`` block, an import only those use.  The verifier executes the module,
builds ``ModelNew`` and calls its methods; nothing else.  Judging dead code by the run-time rules
(``forward-torch-op`` for the ``torch.randn`` of a ``get_inputs`` copy) refuses honest kernels, so the
static rules (:mod:`dice_ray.verify.rules`) skip what :func:`dead_code` finds, and the worker runs the
module without its dead imports (:func:`strip_dead_imports`), which its import guard would refuse.  A
:class:`~dice_ray.verify.candidate.candidate.Candidate` finds its dead code once (``Candidate.dead``) for both.

Live code, found from the module's own text only:

* everything at module top level except the bodies of functions and classes' methods, and except an
  ``if __name__ == "__main__":`` block (the verifier runs the module under another ``__name__``; the
  block counts as live when the module assigns ``__name__`` anywhere);
* decorators, default values and annotations of every function (they run when the ``def`` does),
  the bases, keywords and body statements of every class (they run when the ``class`` does);
* the methods' bodies of ``ModelNew`` (of every class when there is no ``ModelNew``: such a candidate is
  judged whole), and of every class whose name live code mentions;
* the bodies of module-level functions whose name live code mentions (as a name, or as an attribute
  name anywhere: conservative), and so on until nothing new is reached.

Nothing can reach a function without mentioning its name, except the ways the static rules refuse in
live code (``globals()``, ``getattr``, dunder attributes, ``sys.modules``), so a dead body never runs.
An import is dead when the names it binds are mentioned only in dead code (or nowhere).
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import dataclass, field

from dice_ray.pysource import parse_python

__all__ = ["DeadCode", "dead_code", "strip_dead_imports"]

_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef)


@dataclass(frozen=True)
class DeadCode:
    """What of a module never runs (:func:`dead_code`); sets of ``id()`` of nodes of the tree it was found in.

    Attributes:
        bodies: functions and methods (``FunctionDef`` nodes) whose bodies never run (their decorators,
            defaults and annotations do).
        blocks: module-level ``if __name__ == "__main__":`` statements that never run.
        classes: classes (``ClassDef`` nodes) no live code mentions (their statements run, their methods never).
        imports: ``Import`` / ``ImportFrom`` statements whose names only dead code mentions.
        aliases: the names (``ast.alias`` nodes) of live-code imports that only dead code mentions
            (``load`` in ``from torch.utils.cpp_extension import load_inline, load``); those of dead imports too.
    """

    bodies: set[int] = field(default_factory=set)
    blocks: set[int] = field(default_factory=set)
    classes: set[int] = field(default_factory=set)
    imports: set[int] = field(default_factory=set)
    aliases: set[int] = field(default_factory=set)

    def skips(self, node: ast.AST) -> bool:
        """Whether ``node`` is a dead main block or a dead import (skipped whole)."""
        return id(node) in self.blocks or id(node) in self.imports


def _is_main_guard(node: ast.stmt) -> bool:
    """``if __name__ == "__main__":`` (either side of the ``==``), no ``else``-less variants."""
    if not isinstance(node, ast.If) or not isinstance(node.test, ast.Compare):
        return False
    t = node.test
    if len(t.ops) != 1 or not isinstance(t.ops[0], ast.Eq):
        return False
    sides = [t.left, t.comparators[0]]
    return (any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides)
            and any(isinstance(s, ast.Constant) and s.value == "__main__" for s in sides))


def _mentions(nodes: list[ast.AST]) -> set[str]:
    """Names loaded in ``nodes`` (whole subtrees) and every attribute name there."""
    out: set[str] = set()
    for root in nodes:
        for n in ast.walk(root):
            if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Store):
                out.add(n.id)
            elif isinstance(n, ast.Attribute):
                out.add(n.attr)
    return out


def _def_header(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.AST]:
    """What of a ``def`` runs when the ``def`` statement does: decorators, defaults, annotations."""
    a = fn.args
    parts: list[ast.AST] = [*fn.decorator_list, *a.defaults, *[d for d in a.kw_defaults if d is not None]]
    parts += [x.annotation for x in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]
              if x is not None and x.annotation is not None]
    return parts + ([fn.returns] if fn.returns is not None else [])


def _class_parts(cls: ast.ClassDef) -> tuple[list[ast.AST], list[ast.FunctionDef | ast.AsyncFunctionDef]]:
    """``(what runs when the class statement does, its methods)``."""
    runs: list[ast.AST] = [*cls.decorator_list, *cls.bases, *cls.keywords]
    methods = []
    for stmt in cls.body:
        if isinstance(stmt, _DEFS):
            methods.append(stmt)
            runs += _def_header(stmt)
        else:
            runs.append(stmt)
    return runs, methods


def dead_code(tree: ast.Module) -> DeadCode:
    """Find what of a candidate module never runs (see the module docstring).  Parses nothing, runs nothing.

    Returns:
        A :class:`DeadCode` of ``id()`` of nodes of ``tree``.
    """
    renamed = any(isinstance(n, ast.Name) and n.id == "__name__" and isinstance(n.ctx, ast.Store)
                  for n in ast.walk(tree)) or any(isinstance(n, (ast.Global, ast.Nonlocal)) and "__name__" in n.names
                                                  for n in ast.walk(tree))
    dead = DeadCode()
    live: list[ast.AST] = []  # code that runs
    pending: dict[str, list[ast.stmt]] = {}  # module-level def/class name -> its statements, not yet reached
    for stmt in tree.body:
        if isinstance(stmt, _DEFS):
            live += _def_header(stmt)
            pending.setdefault(stmt.name, []).append(stmt)
        elif isinstance(stmt, ast.ClassDef):
            runs, _ = _class_parts(stmt)
            live += runs
            pending.setdefault(stmt.name, []).append(stmt)
        elif _is_main_guard(stmt) and not renamed:
            dead.blocks.add(id(stmt))
        elif not isinstance(stmt, (ast.Import, ast.ImportFrom)):
            live.append(stmt)
    reached: list[ast.stmt] = []
    classes = [n for n, stmts in pending.items() if any(isinstance(t, ast.ClassDef) for t in stmts)]
    todo = ["ModelNew"] if "ModelNew" in classes else classes  # no ModelNew (a malformed candidate): judge every class
    seen: set[str] = set()
    while True:
        names = set(todo) | _mentions(live)
        new = [n for n in names if n in pending and n not in seen]
        if not new:
            break
        todo = []
        for name in new:
            seen.add(name)
            for stmt in pending[name]:
                reached.append(stmt)
                if isinstance(stmt, ast.ClassDef):
                    live += _class_parts(stmt)[1]  # methods' whole subtrees
                else:
                    live.append(stmt)
    reached_ids = {id(s) for s in reached}
    for stmts in pending.values():
        for stmt in stmts:
            if id(stmt) in reached_ids:
                continue
            if isinstance(stmt, ast.ClassDef):
                dead.classes.add(id(stmt))
                dead.bodies.update(id(m) for m in _class_parts(stmt)[1])
            else:
                dead.bodies.add(id(stmt))
    used = _mentions(live)
    never_run = {id(n) for outer in ast.walk(tree)
                 if id(outer) in dead.blocks or (id(outer) in dead.bodies and isinstance(outer, _DEFS))
                 for stmt in outer.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in never_run:
            unused = [a for a in node.names if a.name != "*" and (a.asname or a.name).split(".")[0] not in used]
            dead.aliases.update(id(a) for a in unused)
            if len(unused) == len(node.names):
                dead.imports.add(id(node))
    return dead


def strip_dead_imports(src: str, allowed: Callable[[str, tuple[str, ...]], bool], *, tree: ast.Module | None = None,
                       dead: DeadCode | None = None) -> str:
    """``src`` without the dead imports (:func:`dead_code`) that ``allowed(module, names)`` refuses, so the
    worker's import guard never meets an import nothing uses: a dead statement becomes ``pass``, one that also
    binds live names keeps only those (``from m import used, unused`` -> ``from m import used``); line numbers
    are kept.  Imports inside dead bodies are left alone: they never run.  ``src`` unchanged when it does not
    parse.

    Args:
        src: a candidate module.
        allowed: ``(module, names) -> bool``, the import allow-list
            (:func:`dice_ray.verify.rules.allowlist.import_allowed`).
        tree, dead: ``src``'s parse tree and its :func:`dead_code`, when the caller has them
            (:meth:`Candidate.runnable_source <dice_ray.verify.candidate.candidate.Candidate.runnable_source>`:
            read once); parsed and found here otherwise.
    """
    if tree is None:
        try:
            tree = parse_python(src)
        except (SyntaxError, ValueError):
            return src
    if dead is None:
        dead = dead_code(tree)

    def refused(node: ast.Import | ast.ImportFrom, aliases: list[ast.alias]) -> bool:
        if isinstance(node, ast.Import):
            return any(not allowed(a.name, ()) for a in aliases)
        return bool(node.level) or not allowed(node.module or "", tuple(a.name for a in aliases))

    lines = src.splitlines(keepends=True)
    edits: list[tuple[ast.stmt, str]] = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)) or not any(id(a) in dead.aliases for a in node.names):
            continue
        live = [a for a in node.names if id(a) not in dead.aliases]
        if refused(node, node.names) and not (live and refused(node, live)):
            kept = type(node)(names=live, **({"module": node.module, "level": node.level}
                                             if isinstance(node, ast.ImportFrom) else {}))
            edits.append((node, ast.unparse(kept) if live else "pass"))
    for node, text in sorted(edits, key=lambda e: (e[0].lineno, e[0].col_offset), reverse=True):
        first, last = node.lineno - 1, (node.end_lineno or node.lineno) - 1
        start, end = node.col_offset, node.end_col_offset or 0
        head, tail = lines[first][:start], lines[last][end:]
        lines[first:last + 1] = [head + text + tail] + ["\n"] * (last - first)
    return "".join(lines)
