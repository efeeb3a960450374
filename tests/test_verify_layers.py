"""dice_ray.verify's imports flow one way: no import cycle, and no module imports a later stage.

Every module of the package is parsed with :mod:`ast` (imports inside functions and ``TYPE_CHECKING`` blocks
count too); the layer order is the one the package docstring declares (``Layers: ``...``) and every module must
sit in one of its layers.  :mod:`dice_ray.launch`, the fast format's run time outside the package, sits between
``candidate`` and ``rules``.  The checks are plain functions, tried on made-up graphs first so that each is known
to fail when it should.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import dice_ray.verify

ROOT = Path(dice_ray.verify.__file__).resolve().parents[1]  # the dice_ray package folder
PACKAGE = "dice_ray.verify"
#: modules outside the package that are part of its layering: name -> the layer they come after
OUTSIDE = {"dice_ray.launch": "candidate"}


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """``dotted name -> file`` of every module of the ``dice_ray`` package (packages as their ``__init__``)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = ("dice_ray", *path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports_of(name: str, source: str, known: set[str], is_package: bool = False) -> set[str]:
    """The modules of ``known`` that the module ``name`` (text ``source``) imports anywhere: ``import a.b``
    gives ``a.b``; ``from a import b`` gives ``a.b`` when that is a module, else ``a``; relative imports are
    resolved against ``name``."""
    out: set[str] = set()
    package = name if is_package else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        out.update(t for t in targets if t in known)
    out.discard(name)
    return out


def import_graph() -> dict[str, set[str]]:
    """``module -> modules it imports`` for every module of ``dice_ray`` (only edges between them)."""
    files = module_files()
    known = set(files)
    return {name: imports_of(name, path.read_text(), known, path.name == "__init__.py") for name, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of ``graph``: its strongly connected components of more than one module (Tarjan),
    each as a list of modules in the order a cycle walks them."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(_walk(graph, set(component)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _walk(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """One cycle through ``component`` (a strongly connected set), from its first module back to it."""
    start = min(component)
    path, seen = [start], {start}
    while True:
        nxt = sorted(w for w in graph[path[-1]] if w in component)
        back = [w for w in nxt if w == start]
        if back and len(path) > 1:
            return [*path, start]
        step = next((w for w in nxt if w not in seen), start)
        if step == start:
            return [*path, start]
        path.append(step)
        seen.add(step)


def declared_layers(docstring: str) -> list[list[str]]:
    """The layer order the package docstring declares: ``Layers: ... ``a -> b, c -> d`` ...`` gives
    ``[["a"], ["b", "c"], ["d"]]``."""
    m = re.search(r"Layers:.*?``([^`]*->[^`]*)``", docstring, re.S)
    assert m, "the package docstring declares no layer order (``a -> b -> ...``)"
    return [[name.strip() for name in step.split(",")] for step in m.group(1).split("->")]


def layer_of(module: str, layers: list[list[str]]) -> float | None:
    """The position of ``module`` in ``layers``: a stage's package (``dice_ray.verify.trials.*``) or a top-level
    module of it (``dice_ray.verify.verifier``); :data:`OUTSIDE` modules come half a step after their layer;
    None for a module outside the package and :data:`OUTSIDE`, or for the package itself."""
    if module in OUTSIDE:
        return next(i for i, names in enumerate(layers) if OUTSIDE[module] in names) + 0.5
    if not module.startswith(PACKAGE + "."):
        return None
    stage = module[len(PACKAGE) + 1:].split(".")[0]
    return next((float(i) for i, names in enumerate(layers) if stage in names), None)


def layer_breaches(graph: dict[str, set[str]], layers: list[list[str]]) -> list[str]:
    """Every import of a later layer (``a (layer i) imports b (layer j > i)``), and every module of the package
    that sits in no declared layer."""
    out = []
    for module, deps in sorted(graph.items()):
        mine = layer_of(module, layers)
        if mine is None:
            if module.startswith(PACKAGE + "."):
                out.append(f"{module} sits in no declared layer")
            continue
        out += [f"{module} (layer {mine:g}) imports {dep} (layer {layer_of(dep, layers):g})" for dep in sorted(deps)
                if layer_of(dep, layers) is not None and layer_of(dep, layers) > mine]
    return out


def _verify_part(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """``graph`` restricted to the package and :data:`OUTSIDE` (their edges among themselves)."""
    ours = {m for m in graph if m == PACKAGE or m.startswith(PACKAGE + ".") or m in OUTSIDE}
    return {m: graph[m] & ours for m in ours}


# -- the checks can fail ---------------------------------------------------------------------------------------


def test_the_cycle_check_finds_a_made_up_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert cycles(graph) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_import_reader_sees_lazy_relative_and_from_imports():
    known = {"p", "p.a", "p.b", "p.c", "p.sub", "p.sub.d"}
    src = ("import p.a\nfrom p import b\nfrom . import c as cc\ndef f():\n    from .sub import d\n"
           "    from p.sub import thing\nimport os\n")
    assert imports_of("p.x", src, known) == {"p.a", "p.b", "p.c", "p.sub.d", "p.sub"}


def test_the_layer_check_finds_an_import_of_a_later_stage():
    layers = declared_layers("Layers: ``candidate -> rules -> trials, x -> verifier``.")
    assert layers == [["candidate"], ["rules"], ["trials", "x"], ["verifier"]]
    graph = {"dice_ray.verify.rules.check": {"dice_ray.verify.trials.harness", "dice_ray.verify.candidate.nvrtc"},
             "dice_ray.verify.trials.harness": {"dice_ray.launch", "dice_ray.verify.x"},
             "dice_ray.verify.candidate.nvrtc": {"dice_ray.launch"},
             "dice_ray.verify.stray": set(), "dice_ray.launch": {"dice_ray.verify.candidate.nvrtc"}}
    assert layer_breaches(graph, layers) == [
        "dice_ray.verify.candidate.nvrtc (layer 0) imports dice_ray.launch (layer 0.5)",
        "dice_ray.verify.rules.check (layer 1) imports dice_ray.verify.trials.harness (layer 2)",
        "dice_ray.verify.stray sits in no declared layer",
    ]


# -- the package -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return _verify_part(import_graph())


def test_every_module_of_the_package_is_read(graph):
    assert {"dice_ray.verify.verifier", "dice_ray.verify.candidate.candidate", "dice_ray.verify.rules.check",
            "dice_ray.verify.trials.harness", "dice_ray.verify.sandbox.worker", "dice_ray.launch"} <= set(graph)
    assert "dice_ray.verify.sandbox.runner" in graph["dice_ray.verify.verifier"]  # edges are read


def test_the_package_has_no_import_cycle(graph):
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_imports_follow_the_declared_layers(graph):
    breaches = layer_breaches(graph, declared_layers(dice_ray.verify.__doc__ or ""))
    assert not breaches, "\n".join(breaches)


def test_package_inits_import_nothing(graph):
    """A stage's ``__init__`` runs whenever any of its modules is imported (the sandboxed worker, dice_ray.launch
    inside a candidate): it holds a docstring only."""
    inits = {m: deps for m, deps in graph.items() if module_files()[m].name == "__init__.py"}
    assert set(inits) >= {"dice_ray.verify", "dice_ray.verify.candidate", "dice_ray.verify.trials"}
    for module in inits:
        tree = ast.parse(module_files()[module].read_text())
        assert all(isinstance(s, ast.Expr) for s in tree.body), f"{module}'s __init__ runs code"
