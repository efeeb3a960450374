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

Live code runs at one of two times (:func:`construction_code`): when ``ModelNew`` is built (``__init__`` and what
only it calls: nn.Conv2d's own ``reset_parameters()`` pattern, ``_make_layer()`` helpers) or at run time
(``forward`` and everything else).  The static rules judge construction code as ``__init__`` (torch may be used
freely there) and everything else as run-time code.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import dataclass, field

from dice_ray.pysource import parse_python

__all__ = ["Construction", "DeadCode", "construction_code", "dead_code", "strip_dead_imports"]

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


# -- construction code: what runs only while ModelNew is built ----------------------------------------------------

#: decorators that leave a function's body running when, and only when, it is called (``@torch.no_grad()``
#: ``reset_parameters``); any other decorator keeps a function run-time code (the rules refuse it anyway)
_PASS_THROUGH_DECORATORS = frozenset({"staticmethod", "classmethod", "no_grad", "inference_mode"})
#: callees that consume a generator expression handed to them at once (``nn.Sequential(*(Block(c) for c in cs))``,
#: ``nn.ModuleList(Block(c) for c in cs)``); a generator kept (``self.g = (f() for _ in ...)``) runs later
_CONSUMERS = frozenset({"list", "tuple", "set", "frozenset", "dict", "sorted", "sum", "min", "max", "any", "all",
                        "Sequential", "ModuleList", "ModuleDict", "ParameterList", "ParameterDict", "join", "extend",
                        "cat", "stack"})


@dataclass(frozen=True)
class Construction:
    """When live code runs (:func:`construction_code`).

    Attributes:
        functions: ``id()`` of the ``FunctionDef`` nodes that run only while ``ModelNew`` is built: the
            ``__init__`` of every class no run-time code builds, and every function or method reachable only from
            those (judged by the static rules as ``__init__`` is).
        why_runtime: for a function that is called from construction code but is run-time code all the same,
            ``id()`` of its node -> why (``"called from forward (line 40)"``), and for the ``__init__`` of a class
            run-time code builds, why (``"Helper is used from forward (line 40)"``), for the rules' messages.
    """

    functions: frozenset[int] = frozenset()
    why_runtime: dict[int, str] = field(default_factory=dict)


def _docstrings(tree: ast.Module) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                out.add(id(first.value))
    return out


def _decorator_name(dec: ast.AST) -> str:
    target = dec.func if isinstance(dec, ast.Call) else dec
    return target.attr if isinstance(target, ast.Attribute) else target.id if isinstance(target, ast.Name) else ""


def _eager(genexp: ast.GeneratorExp, parent: dict[int, ast.AST]) -> bool:
    """Whether a generator expression is consumed where it stands: star-unpacked, or handed to a consumer."""
    up = parent.get(id(genexp))
    if isinstance(up, ast.Starred):
        return True
    if isinstance(up, ast.Call) and genexp in up.args:
        f = up.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
        return name in _CONSUMERS
    return False


def construction_code(tree: ast.Module, dead: DeadCode, reserved: frozenset[str] = frozenset()) -> Construction:
    """Which live functions run only while ``ModelNew`` is built: construction code, judged like ``__init__``.

    A name is followed wherever it is mentioned (a ``Name``, an attribute name, a string that is the name and not a
    docstring), as :func:`dead_code` follows it; mentions in dead code do not count.  A mention's time is that of
    the code around it: a function's body runs when the function does, a lambda's or a kept generator
    expression's whenever it is called or advanced (run time), module and class bodies while the module loads.

    * The ``__init__`` of a class is construction code unless run-time code mentions the class (builds it:
      ``Helper()`` in forward) or a subclass of it that run-time code builds; ``ModelNew`` is built by the verifier.
    * A function or method (of any class, or a module-level or nested ``def``) is construction code when every
      live mention of its name is a call (``self.reset_parameters()``, ``helper(m)``) in the body of construction
      code, and the name is not one torch or the run time calls on its own (``reserved``: ``forward``,
      ``nn.Module``'s methods; any dunder), not a string's value (``getattr(self, "name")``), not a generator or
      ``async`` and has no decorator but :data:`_PASS_THROUGH_DECORATORS`.  A method called from both
      ``__init__`` and ``forward``, handed to ``register_forward_hook`` or ``self.apply`` (a value, not a call), or
      called in a lambda stays run-time code.

    Args:
        tree: the module.
        dead: its :func:`dead_code`.
        reserved: names the run time may call without the module mentioning them (the static rules pass
            ``nn.Module``'s methods and ``forward``).

    Returns:
        A :class:`Construction`.  Parses nothing, runs nothing.
    """
    parent: dict[int, ast.AST] = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parent[id(child)] = node
    skipped = set(dead.blocks) | set(dead.imports)
    for node in ast.walk(tree):
        if id(node) in dead.bodies and isinstance(node, _DEFS):
            skipped.update(id(s) for s in node.body)

    # each live mention: (name, node, the function whose body holds it or None, lazy in between)
    mentions: dict[str, list[tuple[ast.AST, ast.AST | None, bool]]] = {}

    def walk(node: ast.AST, fn: ast.AST | None, lazy: bool) -> None:
        if id(node) in skipped:
            return
        if isinstance(node, ast.Name):
            mentions.setdefault(node.id, []).append((node, fn, lazy))
        elif isinstance(node, ast.Attribute):
            mentions.setdefault(node.attr, []).append((node, fn, lazy))
        if isinstance(node, (*_DEFS, ast.Lambda)):
            header = _def_header(node) if isinstance(node, _DEFS) else [*node.args.defaults, *[
                d for d in node.args.kw_defaults if d is not None]]
            for h in header:
                walk(h, fn, lazy)
            for stmt in (node.body if isinstance(node, _DEFS) else [node.body]):
                walk(stmt, node, False)
            return
        if isinstance(node, ast.ClassDef):
            for part in [*node.decorator_list, *node.bases, *node.keywords, *node.body]:
                walk(part, fn, lazy)
            return
        if isinstance(node, ast.GeneratorExp) and not _eager(node, parent):
            walk(node.generators[0].iter, fn, lazy)  # evaluated where the expression stands, the rest when advanced
            walk(node.elt, fn, True)
            for i, gen in enumerate(node.generators):
                for part in [gen.target, *([gen.iter] if i else []), *gen.ifs]:
                    walk(part, fn, True)
            return
        for child in ast.iter_child_nodes(node):
            walk(child, fn, lazy)

    walk(tree, None, False)
    # a string naming a function (getattr(self, "reset_parameters")): reached where the rules cannot follow; a name
    # built from pieces is the getattr rule's (python_rules: its name may not be or begin a method's)
    docstrings = _docstrings(tree)
    words = {node.value.strip() for node in ast.walk(tree) if isinstance(node, ast.Constant)
             and isinstance(node.value, str) and id(node) not in docstrings and node.value.strip().isidentifier()}

    classes: dict[str, list[ast.ClassDef]] = {}
    defs: dict[str, list[ast.FunctionDef | ast.AsyncFunctionDef]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            classes.setdefault(node.name, []).append(node)
        elif isinstance(node, _DEFS) and node.name != "__init__":
            defs.setdefault(node.name, []).append(node)
    inits = {id(n): cls.name for cls in (c for cs in classes.values() for c in cs) for n in cls.body
             if isinstance(n, ast.FunctionDef) and n.name == "__init__"}

    def eligible(name: str) -> bool:
        fns = defs[name]
        return (not (name.startswith("__") and name.endswith("__")) and name not in reserved and name not in classes
                and name not in words and all(
                    isinstance(f, ast.FunctionDef) and all(_decorator_name(d) in _PASS_THROUGH_DECORATORS
                                                           for d in f.decorator_list)
                    and not any(isinstance(n, (ast.Yield, ast.YieldFrom)) for n in _own_nodes(f)) for f in fns))

    candidates = {name for name in defs if eligible(name) and mentions.get(name)}
    cons = {id(n) for name in candidates for n in defs[name]} | set(inits)  # shrinks to the answer
    runtime_classes: set[str] = set()
    why: dict[str, str] = {}  # function name -> why it is run-time code
    built: dict[str, str] = {}  # class name -> why run-time code may build it
    inside: dict[int, set[str]] = {}  # function id -> the names mentioned in its body (it holds them: fn)
    for name, found in mentions.items():
        for _, fn, _ in found:
            if fn is not None:
                inside.setdefault(id(fn), set()).add(name)
    bases = {c.name: {b.id for b in c.bases if isinstance(b, ast.Name)} for cs in classes.values() for c in cs}

    def where(node: ast.AST, fn: ast.AST | None, lazy: bool) -> str:
        line = getattr(node, "lineno", "?")
        if lazy or isinstance(fn, ast.Lambda):
            return f"in a lambda or a kept generator expression (line {line})"
        return f"from {getattr(fn, 'name', 'module level')} (line {line})" if fn is not None else \
            f"at module or class level (line {line})"

    def leave(ids: list[int]) -> list[str]:
        """Functions that are run-time code after all: out of cons; the names their bodies mention, to check again."""
        cons.difference_update(ids)
        return [n for i in ids for n in inside.get(i, ())]

    # a worklist: a name is checked again when a function that mentions it leaves construction code
    todo = sorted(set(mentions) & (candidates | set(classes)))
    while todo:
        name = todo.pop()
        if name in candidates:
            for node, fn, lazy in mentions[name]:
                up = parent.get(id(node))
                called = isinstance(up, ast.Call) and up.func is node
                if not (called and fn is not None and not lazy and id(fn) in cons):
                    candidates.discard(name)
                    why[name] = (f"called {where(node, fn, lazy)}" if called else
                                 f"used {where(node, fn, lazy)} other than by a call")
                    todo += leave([id(n) for n in defs[name]])
                    break
        if name in classes and name not in runtime_classes:
            bad = next(((node, fn, lazy) for node, fn, lazy in mentions.get(name, [])
                        if fn is not None and (lazy or id(fn) not in cons)), None)
            sub = next((c for c in sorted(runtime_classes) if name in bases.get(c, ())), None)
            if bad is not None or sub is not None:
                runtime_classes.add(name)
                built[name] = (f"{name} is used {where(*bad)}" if bad is not None else
                               f"{name} is a base of {sub}, which run-time code builds")
                todo += leave([i for i, cls in inits.items() if cls == name])
                todo += sorted(bases.get(name, ()))  # its bases' __init__ run when it is built
    functions = {id(n) for name in candidates for n in defs[name]}
    functions |= {i for i, cls in inits.items() if cls not in runtime_classes}
    # why a function construction code calls is run-time code all the same (for the rules' messages)
    why_runtime = {id(n): why[name] for name in why for n in defs[name]
                   if any(isinstance(parent.get(id(m)), ast.Call) and parent[id(m)].func is m and id(f) in functions
                          and not lazy for m, f, lazy in mentions.get(name, []))}
    why_runtime.update({i: built[cls] for i, cls in inits.items() if cls in built})
    return Construction(frozenset(functions), why_runtime)


def _own_nodes(fn: ast.AST) -> list[ast.AST]:
    """The nodes of a function's body, not those of functions, lambdas or classes nested in it."""
    out, stack = [], list(fn.body)
    while stack:
        n = stack.pop()
        out.append(n)
        if not isinstance(n, (*_DEFS, ast.Lambda, ast.ClassDef)):
            stack.extend(ast.iter_child_nodes(n))
    return out
