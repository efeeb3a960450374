"""Bounded nesting (dice_ray.pysource): a source nested deeper than MAX_NESTING is a SyntaxError everywhere a
source is parsed (tasks, scaffolds, candidates), never a RecursionError that aborts a task file or blames the
verifier; and everything that walks a tree copes with one at the bound."""

from __future__ import annotations

import ast
import json

import pytest

from _verify_sources import HONEST, RELU_REF
from dice_ray.pysource import MAX_NESTING, parse_python
from dice_ray.tasks.loaders import load_tasks
from dice_ray.tasks.scaffold import ScaffoldError, make_scaffold
from dice_ray.tasks.task import Task
from dice_ray.tasks.validate import TaskError
from dice_ray.verify.rules.check import check_candidate

#: nested expressions of several shapes, ``k`` levels deep (each adds one level a step, or one and its operator)
FORMS = {
    "unary": lambda k: "-" * k + "1",
    "binop": lambda k: "+".join(["1"] * k),
    "call": lambda k: "f(" * k + "1" + ")" * k,
    "attribute": lambda k: "x" + ".a" * k,
    "subscript": lambda k: "x" + "[0]" * k,
    "list": lambda k: "[" * k + "]" * k,
    "lambda": lambda k: "lambda: " * k + "1",
    "conditional": lambda k: "1 if x else " * k + "1",
}


def _depth(tree: ast.AST) -> int:
    stack, deepest = [(tree, 1)], 0
    while stack:
        node, d = stack.pop()
        deepest = max(deepest, d)
        stack.extend((c, d + 1) for c in ast.iter_child_nodes(node))
    return deepest


def _in_forward(expr: str) -> str:
    return HONEST.replace("        return y\n", f"        z = {expr}\n        return y\n")


def _deepest_accepted(make) -> str:
    k = 1
    while True:
        try:
            parse_python(make(k + 1))
        except SyntaxError:
            return make(k)
        k += 1


def _from_deep_stack(frames: int, fn):
    return fn() if frames == 0 else _from_deep_stack(frames - 1, fn)


@pytest.mark.parametrize("form", sorted(FORMS))
def test_the_bound_is_exact_and_the_rules_walk_a_tree_at_it(form):
    src = _deepest_accepted(lambda k: _in_forward(FORMS[form](k)))
    assert _depth(ast.parse(src)) == MAX_NESTING
    # the anti-cheat rules recurse over the tree: at the bound they finish, even called 300 frames deep
    # (a Ray actor's thread, the verifier's own calls); Python then compiles it
    report = _from_deep_stack(300, lambda: check_candidate(src))
    assert all(v.rule != "syntax" for v in report.violations)
    compile(src, "<candidate>", "exec")


@pytest.mark.parametrize("expr, says", [
    ("-" * (MAX_NESTING + 5) + "1", f"nested more than {MAX_NESTING} levels deep"),
    ("1+" * 6000 + "1", "nested too deeply for the parser"),  # the parser's own RecursionError
    ("-" * 20000 + "1", "nested too deeply for the parser"),  # ... or MemoryError
])
def test_deeper_is_a_syntax_error(expr, says):
    with pytest.raises(SyntaxError, match=says):
        parse_python(f"Z = {expr}\n")
    report = check_candidate(HONEST + f"Z = {expr}\n")
    assert report.first().rule == "syntax" and says in report.first().message


def test_a_deep_task_record_is_rejected_alone_and_its_file_loads(tmp_path):
    deep = RELU_REF + "\nZ = " + "1+" * 6000 + "1\n"
    with pytest.raises(TaskError, match="syntax-error: the reference does not parse: nested too deeply"):
        Task("t/deep", "deep", 1, deep)
    f = tmp_path / "tasks.jsonl"
    f.write_text("\n".join(json.dumps({"reference": r, "id": i}) for i, r in (("deep", deep), ("good", RELU_REF))))
    report = load_tasks(f"jsonl:{f}")
    assert [t.name for t in report.tasks] == ["tasks_good"]
    assert [(r.index, r.rule) for r in report.rejected] == [(1, "syntax-error")]


def test_a_deep_solution_is_a_scaffold_error():
    with pytest.raises(ScaffoldError, match="does not parse: nested too deeply"):
        make_scaffold(HONEST + "Z = " + "-" * 20000 + "1\n", "fast")
