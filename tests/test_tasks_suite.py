"""The built-in suite: size and spread, every task validates, every solution compiles with NVRTC for
sm_90 and launches only kernels that exist with the right arguments (launcher dry run), every reference
runs on CPU, and ModelNew gets the reference's weights from the same seed and returns outputs of the
reference's shape and dtype."""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

import pytest
import torch

from dice_ray import launch
from dice_ray.tasks.loaders import BUILTIN_DIR, load_tasks
from dice_ray.tasks.scaffold import make_scaffold
from dice_ray.verify.candidate import nvrtc

REPORT = load_tasks("builtin")
TASKS = REPORT.tasks
IDS = [t.task_id for t in TASKS]


def test_suite_size_spread_and_validity():
    assert REPORT.rejected == [], REPORT.summary()
    assert len(TASKS) >= 40
    by_level = Counter(t.level for t in TASKS)
    assert by_level[1] >= 30 and by_level[2] >= 10, by_level
    assert len(set(IDS)) == len(IDS)
    assert all(t.solution_format == "fast" for t in TASKS)
    folders = sorted(p.name for p in BUILTIN_DIR.iterdir() if p.is_dir() and not p.name.startswith(("_", ".")))
    assert len(folders) == len(TASKS)
    # level 1 before level 2: the curriculum goes from single operators to fusions
    assert [t.level for t in TASKS] == sorted(t.level for t in TASKS)
    names = {t.name for t in TASKS}
    for needed in ("relu", "gelu_tanh", "gelu_erf", "softmax", "log_softmax", "layernorm", "rmsnorm", "matmul",
                   "matvec", "bmm", "transpose", "linear", "cumsum", "argmax_dim", "linear_relu", "add_layernorm"):
        assert needed in names, needed


def _kernel_calls(tree: ast.Module) -> set[str]:
    """Names ``X`` in ``<module var>.X(...)`` where the module var was assigned ``load_cuda(...)``."""
    module_vars = {
        t.id
        for n in tree.body
        if isinstance(n, ast.Assign)
        and isinstance(n.value, ast.Call)
        and getattr(n.value.func, "id", "") == "load_cuda"
        for t in n.targets
        if isinstance(t, ast.Name)
    }
    return {
        n.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in module_vars
    }


@pytest.mark.parametrize("task", TASKS, ids=IDS)
def test_solution_compiles_for_sm90_and_names_existing_kernels(task):
    cuda = make_scaffold(task.solution_src, "fast").middle
    assert '"""' not in cuda
    program = nvrtc.compile_cuda(cuda, arch="sm_90")
    used = _kernel_calls(ast.parse(task.solution_src))
    assert used, "forward launches no kernel"
    assert used <= set(program.kernels), f"unknown kernels {used - set(program.kernels)}"
    assert not re.search(r"#include\s*<(?!cuda)", cuda), "NVRTC has no std headers"


@pytest.fixture
def dry_run_launcher():
    """Compile-only launcher whose kernel calls check their arguments and count, then restore it."""
    saved = (launch._config.compile_only, launch._config.arch, launch._config.dry_run)
    launch.configure(compile_only=True, arch="sm_90", dry_run=True)
    yield
    launch._config.compile_only, launch._config.arch, launch._config.dry_run = saved


def _exec(src: str, name: str) -> dict:
    ns: dict = {"__name__": name}
    exec(compile(src, name, "exec"), ns)  # the suite is ours and trusted; DICE records never get here
    return ns


def test_references_run_and_solutions_match_shapes_weights_and_launch(dry_run_launcher):
    with torch.no_grad():
        for task in TASKS:
            ref = _exec(task.reference_src, f"{task.task_id}/reference")
            sol = _exec(task.solution_src, f"{task.task_id}/solution")
            init = ref["get_init_inputs"]()
            torch.manual_seed(0)
            model = ref["Model"](*init)
            torch.manual_seed(0)
            new = sol["ModelNew"](*init)
            ref_params, new_params = list(model.parameters()), list(new.parameters())
            assert [p.shape for p in ref_params] == [p.shape for p in new_params], task.task_id
            assert all(torch.equal(a, b) for a, b in zip(ref_params, new_params)), task.task_id
            torch.manual_seed(0)
            inputs = ref["get_inputs"]()
            n_in = sum(x.numel() for x in inputs if isinstance(x, torch.Tensor))
            assert 10**5 <= n_in <= 6 * 10**7, (task.task_id, n_in)
            assert all(x.dtype == torch.float32 for x in inputs if isinstance(x, torch.Tensor)), task.task_id
            expected = model(*inputs)
            before = launch.launch_count()
            got = new(*inputs)  # dry run: every launch checks its argument count and types
            assert launch.launch_count() > before, f"{task.task_id}: forward launched no kernel"
            assert isinstance(got, torch.Tensor) and got.shape == expected.shape, task.task_id
            assert got.dtype == expected.dtype, task.task_id


def test_solution_forward_uses_no_torch_math():
    """ModelNew.forward only allocates (empty/empty_like), reshapes by shape arithmetic and launches."""
    allowed = {"contiguous", "numel", "dim", "empty", "empty_like", "prod", "shape"}
    for task in TASKS:
        tree = ast.parse(task.solution_src)
        new = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ModelNew")
        fwd = next(n for n in new.body if isinstance(n, ast.FunctionDef) and n.name == "forward")
        kernels = _kernel_calls(tree)
        for call in (n for n in ast.walk(fwd) if isinstance(n, ast.Call)):
            name = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", None)
            assert name in allowed | kernels | {"min", "max", "list", "len", "range", "int"}, (task.task_id, name)


def test_builtin_files_are_package_data():
    """Every task folder holds exactly reference.py and solution.py, and some a slower solution_slow.py
    (tests/test_tasks_variants.py); all shipped by package-data **/*.py."""
    for folder in (p for p in Path(BUILTIN_DIR).iterdir() if p.is_dir() and not p.name.startswith(("_", "."))):
        files = sorted(f.name for f in folder.iterdir() if f.name != "__pycache__")
        assert files in (["reference.py", "solution.py"], ["reference.py", "solution.py", "solution_slow.py"]), files


@pytest.mark.gpu
def test_every_solution_is_ok_on_the_gpu():
    """Each built-in solution gets verdict ok on the GPU (correct on every trial, timed): the suite's
    solutions are what the infill phase cuts and what curation measures, so a wrong one is a defect."""
    from dice_ray.config import RewardConfig, VerifyConfig
    from dice_ray.verify.verifier import Verifier

    with Verifier(VerifyConfig(mode="gpu", timing_trials=5), RewardConfig(), device=0) as v:
        verdicts = v.verify_many([(t, t.solution_src, t.task_id) for t in TASKS])
    bad = [(t.task_id, r.verdict, r.reason[:300]) for t, r in zip(TASKS, verdicts) if r.verdict != "ok"]
    assert not bad, bad
