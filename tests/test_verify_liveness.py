"""What of a candidate never runs (dice_ray.verify.candidate.liveness) and how the static rules treat it."""

from __future__ import annotations

import ast

from _verify_sources import HONEST, mutate
from dice_ray.verify.candidate.liveness import dead_code, strip_dead_imports
from dice_ray.verify.rules.allowlist import import_allowed
from dice_ray.verify.rules.check import check_candidate

HELPERS = '''

def get_inputs():
    return [torch.randn(1024, 1024)]


def get_init_inputs():
    return []


class Model(nn.Module):  # a copy of the reference, never used
    def forward(self, x):
        return torch.relu(x)


if __name__ == "__main__":
    import sys
    torch.manual_seed(0)
    print(ModelNew()(*get_inputs()), file=sys.stderr)
'''


def defs(tree: ast.Module) -> dict[str, ast.AST]:
    return {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}


def test_helpers_the_harness_never_calls_are_dead_and_pass_the_rules():
    src = mutate("import torch\n", "import torch\nimport numpy as np  # only the main block's\n") + HELPERS
    tree = ast.parse(src)
    dead, named = dead_code(tree), defs(tree)
    assert {id(named["get_inputs"]), id(named["get_init_inputs"])} <= dead.bodies
    assert id(named["Model"]) in dead.classes and id(named["ModelNew"]) not in dead.classes
    assert len(dead.blocks) == 1 and len(dead.imports) == 1  # numpy (sys is inside the dead block)
    assert check_candidate(src).ok, [str(v) for v in check_candidate(src).violations]


def test_what_live_code_reaches_is_judged():
    """A helper forward calls, a class ModelNew uses, a main block under a renamed __name__, a decorator or a
    default of a dead function (they run with the def), and a malformed module without ModelNew (judged whole)."""
    called = mutate("        return y\n", "        return y + get_inputs()[0]\n") + HELPERS
    assert "forward-torch-op" in {v.rule for v in check_candidate(called).violations}
    used_model = mutate("        return y\n", "        return Model()(y)\n") + HELPERS
    assert "reference-model" in {v.rule for v in check_candidate(used_model).violations}
    renamed = HELPERS.replace("if __name__", '__name__ = "__main__"\nif __name__')
    assert not check_candidate(HONEST + renamed).ok
    decorated = HONEST + "\n@torch.jit.script\ndef unused(x):\n    return x\n"
    assert {"dynamic-code", "torch-internals"} & {v.rule for v in check_candidate(decorated).violations}
    default = HONEST + "\ndef unused(x=open('/etc/hostname')):\n    return x\n"
    assert "file-access" in {v.rule for v in check_candidate(default).violations}
    nameless = mutate("class ModelNew", "class Kernel", mutate("        return y\n", "        return y.sum()\n"))
    assert check_candidate(nameless).first().rule == "forward-torch-op"


def test_dead_imports_are_stripped_for_the_worker_with_line_numbers_kept():
    src = ("import torch\nimport numpy as np\nfrom os import (path,\n    sep)\nimport math\n"
           "def f():\n    import sys\n    return 1\n" + HONEST)
    out = strip_dead_imports(src, import_allowed)
    assert out.splitlines()[:5] == ["import torch", "pass", "pass", "", "import math"]
    assert "    import sys" in out  # inside a dead body: never runs, left alone
    assert len(out.splitlines()) == len(src.splitlines())
    live = src + "\nX = np.pi\n"
    assert "import numpy as np" in strip_dead_imports(live, import_allowed)
    assert strip_dead_imports("def (:\n", import_allowed) == "def (:\n"


def test_names_of_an_import_only_dead_code_uses_are_dropped_alone():
    """``from m import used, unused``: the unused name is neither judged nor imported."""
    src = open_corpus("kb_example_add.py").replace(
        "from torch.utils.cpp_extension import load_inline",
        "from torch.utils.cpp_extension import load_inline, load, CUDA_HOME\nimport math, os")
    assert check_candidate(src).ok, [str(v) for v in check_candidate(src).violations]
    out = strip_dead_imports(src, lambda m, n: import_allowed(m, n, inline=True))
    assert "from torch.utils.cpp_extension import load_inline\npass\n" in out  # math is allowed, os is not: all dead
    used = src.replace("        return self.elementwise_add", "        load('x', [])\n        return self.elementwise_add")
    assert not check_candidate(used).ok


def open_corpus(name: str) -> str:
    from pathlib import Path

    return (Path(__file__).resolve().parent / "corpus" / "honest" / name).read_text()
