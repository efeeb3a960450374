"""Task validation rules and loaders: DICE's two files load with counted rejections, malformed records
are rejected with file, index and reason while loading goes on, nothing is ever executed; KernelBench
JSON, Alpaca pairs and JSON Lines load the same way; too-large inputs are scaled down when they can be."""

from __future__ import annotations

import codecs
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dice_ray.tasks.loaders import (
    phase_pool,
    select_tasks,
    DEFAULT_MAX_INPUT_ELEMENTS,
    load_reference_file,
    load_tasks,
)
from dice_ray.tasks.levels import estimate_level
from dice_ray.tasks.sizing import scale_down_inputs, shape_constant, static_input_elements
from dice_ray.tasks.task import Task
from dice_ray.tasks.validate import TaskError

REF = '''import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return torch.relu(x)


def get_inputs():
    return [torch.randn(N, 1024)]


def get_init_inputs():
    return []
'''
REF_SMALL = "N = 64\n" + REF
# a record whose import would have a visible side effect if anything executed it
REF_TRAP = "open('EXECUTED', 'w').write('x')\n" + REF_SMALL
INLINE_SOL = '''import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

source = """
__global__ void k(float* x) {}
"""

mod = load_inline(name="m", cpp_sources="", cuda_sources=source, functions=[])


class ModelNew(nn.Module):
    def forward(self, x):
        return x
'''


def _infill_record(i, **over):
    rec = {"id": i, "pytorch_code": REF_SMALL, "cuda_code": INLINE_SOL}
    cut = INLINE_SOL.index("source = ")
    end = INLINE_SOL.index('"""\n', INLINE_SOL.index('"""') + 3) + 3
    rec.update(prefix=INLINE_SOL[:cut], middle=INLINE_SOL[cut:end], suffix=INLINE_SOL[end:])
    rec.update(over)
    return rec


# ---- Task rules -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "src, rule",
    [
        (None, "not-a-string"),
        ("   \n", "empty-source"),
        ("def f(:\n", "syntax-error"),
        (REF_SMALL.replace("class Model", "class Mdl"), "no-model-class"),
        (REF_SMALL.replace("def forward", "def fwd"), "no-forward"),
        (REF_SMALL.replace("def get_inputs", "def inputs"), "no-get-inputs"),
        (REF_SMALL.replace("def get_init_inputs", "def init_inputs"), "no-get-init-inputs"),
        ("x = 1\n" * 40_000, "too-large"),
    ],
)
def test_reference_rules(src, rule):
    with pytest.raises(TaskError, match=f"^{rule}: ") as err:
        Task("t/1", "t", 1, src)
    assert err.value.rule == rule
    assert rule == "not-a-string" or "the reference" in str(err.value)  # names the input


def test_task_field_rules():
    Task("t/1", "t", 1, REF_SMALL)
    with pytest.raises(TaskError, match="bad-level"):
        Task("t/1", "t", 7, REF_SMALL)
    with pytest.raises(TaskError, match="bad-task-id"):
        Task("", "t", 1, REF_SMALL)
    with pytest.raises(TaskError, match="solution-format-mismatch"):
        Task("t/1", "t", 1, REF_SMALL, INLINE_SOL, None)
    with pytest.raises(TaskError, match="bad-format"):
        Task("t/1", "t", 1, REF_SMALL, INLINE_SOL, "triton")
    with pytest.raises(TaskError, match="no-loader-call"):
        Task("t/1", "t", 1, REF_SMALL, INLINE_SOL, "fast")
    with pytest.raises(TaskError, match="no-modelnew-class"):
        Task("t/1", "t", 1, REF_SMALL, INLINE_SOL.replace("ModelNew", "Other"), "load_inline")


def test_static_input_elements_and_level():
    assert static_input_elements(REF_SMALL) == 64 * 1024
    two_inputs = "N = 2048 * 2\nh, w = 8, 4\n" + REF.replace("(N, 1024)", "(N, h * w), torch.rand(N)")
    assert static_input_elements(two_inputs) == 4096 * 32 + 4096
    assert static_input_elements(REF) == 0  # N unknown: a lower bound, not a guess
    # get_inputs's own constants count (a reference sized through a local escaped the bound: 10**6 x 10**6)
    local = REF.replace("    return [torch.randn(N, 1024)]", "    n = 10**6\n    return [torch.randn(n, n)]")
    assert local != REF and static_input_elements(local) == 10**12
    rebound = REF_SMALL.replace("    return [torch.randn(N, 1024)]", "    N = int(input())\n    return [torch.randn(N, 1024)]")
    assert rebound != REF_SMALL and static_input_elements(rebound) == 0  # rebound to something unknown: unknown
    assert estimate_level(REF_SMALL) == 1
    assert estimate_level(REF_SMALL.replace("torch.relu(x)", "torch.relu(x) + torch.sigmoid(x)")) == 2


# ---- loaders --------------------------------------------------------------------------------------


def test_malformed_records_are_rejected_with_reasons(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    e2e = [
        {"idx": 0, "level": "1", "pytorch_code": REF_SMALL, "cuda_code": "", "raw_answer": ""},
        {"idx": 1, "level": "2", "pytorch_code": REF_SMALL},  # missing cuda_code
        {"idx": 2, "level": "1", "pytorch_code": 42, "cuda_code": ""},
        {"idx": 3, "level": "1", "pytorch_code": "def f(:\n", "cuda_code": ""},
        {"idx": 4, "level": "1", "pytorch_code": REF_SMALL.replace("class Model", "class M"), "cuda_code": ""},
        {"idx": 5, "level": "high", "pytorch_code": REF_SMALL, "cuda_code": ""},
        "not a record",
        {"idx": 0, "level": 1, "pytorch_code": REF_SMALL, "cuda_code": ""},  # duplicate id
        {"idx": 8, "level": 1, "pytorch_code": "M = 2**10\nN = M * M\n" + REF, "cuda_code": ""},  # 1G elements
        {"idx": 9, "level": 2, "pytorch_code": REF_TRAP, "cuda_code": INLINE_SOL},
        {"idx": 10, "level": 2, "pytorch_code": REF_SMALL, "cuda_code": "def f(:\n"},
    ]
    infill = [
        _infill_record(1),
        _infill_record(2, middle="source = 1"),
        _infill_record(3, suffix=None),
        {"pytorch_code": REF_SMALL},  # missing id, cuda_code, prefix, middle, suffix
    ]
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "e2e.json").write_text(json.dumps(e2e))
    (tmp_path / "data" / "infill.json").write_text(json.dumps(infill))
    (tmp_path / "data" / "broken.json").write_text("[{")
    (tmp_path / "data" / "object.json").write_text("{}")
    report = load_tasks(f"dice:{tmp_path / 'data'}")
    assert sorted(t.task_id for t in report.tasks) == ["dice-e2e/0", "dice-e2e/9", "dice-infill/1"]
    reasons = {(r.source.rsplit("/", 1)[-1], r.index): r.rule for r in report.rejected}
    assert reasons == {
        ("e2e.json", 1): "missing-key", ("e2e.json", 2): "not-a-string", ("e2e.json", 3): "syntax-error",
        ("e2e.json", 4): "no-model-class", ("e2e.json", 5): "bad-level", ("e2e.json", 6): "not-an-object",
        ("e2e.json", 7): "duplicate-id", ("e2e.json", 8): "inputs-too-large", ("e2e.json", 10): "syntax-error",
        ("infill.json", 1): "scaffold-mismatch", ("infill.json", 2): "not-a-string", ("infill.json", 3): "missing-key",
        ("broken.json", "file"): "bad-json", ("object.json", "file"): "not-a-list",
    }
    assert "cuda_code does not parse" in next(r.reason for r in report.rejected if r.index == 10)
    assert not (tmp_path / "EXECUTED").exists(), "a record was executed"
    solved = {t.task_id: t.solution_format for t in report.tasks}
    assert solved == {"dice-e2e/0": None, "dice-e2e/9": "load_inline", "dice-infill/1": "load_inline"}
    summary = report.summary()
    assert "3 accepted" in summary and "14 rejected" in summary and "missing-key: 2" in summary
    assert len(load_tasks(f"dice:{tmp_path / 'data'}", max_input_elements=None).tasks) == 4


def test_dice_files_load_with_counts(dice_data):
    e2e = load_tasks(f"dice:{dice_data / 'end_to_end_kernel_generation_4000.json'}")
    infill = load_tasks(f"dice:{dice_data / 'kernel_infilling_evaluation.json'}")
    both = load_tasks(f"dice:{dice_data}")
    assert len(e2e.tasks) + len(e2e.rejected) == 4000
    assert len(e2e.tasks) >= 3900 and set(e2e.accepted_by_level()) <= {0, 1, 2, 3}
    assert set(e2e.rejected_by_rule()) <= {"inputs-too-large"}, e2e.summary()
    assert len(infill.tasks) + len(infill.rejected) == 99 and len(infill.tasks) >= 95
    assert all(t.solution_format == "load_inline" for t in infill.tasks)
    assert len(both.tasks) == len(e2e.tasks) + len(infill.tasks)
    for report in (e2e, infill, both):
        assert f"{len(report.tasks)} accepted" in report.summary()
        assert f"{len(report.rejected)} rejected" in report.summary()
    cap = load_tasks(f"dice:{dice_data / 'end_to_end_kernel_generation_4000.json'}", max_input_elements=None)
    assert len(cap.tasks) == 4000 and DEFAULT_MAX_INPUT_ELEMENTS == 2**28
    # each file is its phase's set: a run on both draws infilling from one and end-to-end from the other
    assert {t.role for t in infill.tasks} == {"infill"} and {t.role for t in e2e.tasks} == {"e2e"}
    assert phase_pool(both.tasks, "infill") == infill.tasks and phase_pool(both.tasks, "e2e") == e2e.tasks
    joined = load_tasks(f"dice:{dice_data / 'kernel_infilling_evaluation.json'}+builtin")
    assert len(joined.tasks) == len(infill.tasks) + len(load_tasks("builtin").tasks)
    assert phase_pool(joined.tasks, "infill") == infill.tasks  # the builtin tasks (role both) serve end to end
    assert {t.task_id for t in phase_pool(joined.tasks, "e2e")} == {t.task_id for t in load_tasks("builtin").tasks}


def test_combined_specs_keep_order_and_refuse_a_task_twice(tmp_path):
    lines = tmp_path / "mine.jsonl"
    relu = load_tasks("builtin").tasks[0]
    lines.write_text(json.dumps({"reference": relu.reference_src, "name": "r", "id": "1"}) + "\n")
    report = load_tasks(f"builtin+jsonl:{lines}")
    assert [t.task_id for t in report.tasks][-1] == "jsonl-mine/1" and len(report.tasks) == 110
    twice = load_tasks(f"jsonl:{lines}+jsonl:{lines}")
    assert len(twice.tasks) == 1 and twice.rejected_by_rule() == {"duplicate-id": 1}
    assert "duplicate-id: 1" in twice.summary()
    with pytest.raises(ValueError, match="tasks spec"):
        load_tasks("builtin+nothing:x")
    # a run on one set poses it in both phases; variants are kept only when asked
    tasks = load_tasks("builtin").tasks
    assert phase_pool(tasks, "infill") == phase_pool(tasks, "e2e") == tasks
    assert not any(t.solution_variants for t in select_tasks(tasks, None, False))
    assert sum(bool(t.solution_variants) for t in select_tasks(tasks, 40, True)) >= 20
    assert len(select_tasks(tasks, 5, False)) == 5


def test_bad_specs_and_paths(tmp_path):
    with pytest.raises(ValueError, match="tasks spec"):
        load_tasks("kernelbook:x")
    with pytest.raises(FileNotFoundError):
        load_tasks(f"dice:{tmp_path / 'missing.json'}")
    with pytest.raises(ValueError, match="max_input_elements"):
        load_tasks("builtin", max_input_elements=0)


def test_reference_file_and_kernelbench_folder(tmp_path):
    lvl = tmp_path / "level2"
    lvl.mkdir()
    (lvl / "1_Relu.py").write_text(REF_SMALL)
    (lvl / "2_Broken.py").write_text("import torch\n")
    task = load_reference_file(lvl / "1_Relu.py")
    assert (task.task_id, task.level, task.solution_src) == ("file/1_Relu", 2, None)
    with pytest.raises(TaskError, match="no-model-class"):
        load_reference_file(lvl / "2_Broken.py")
    with pytest.raises(FileNotFoundError):
        load_reference_file(lvl / "3_Missing.py")
    (lvl / "4_Bom.py").write_bytes(codecs.BOM_UTF8 + (lvl / "1_Relu.py").read_bytes())  # Python runs it: so do we
    assert load_reference_file(lvl / "4_Bom.py").reference_src == (lvl / "1_Relu.py").read_text()
    report = load_tasks(f"kernelbench:{tmp_path}")
    assert [t.task_id for t in report.tasks] == ["kernelbench/level2/1_Relu", "kernelbench/level2/4_Bom"]
    assert [(r.index, r.rule) for r in report.rejected] == [("level2/2_Broken", "no-model-class")]


# ---- more loaders: kernelbench-json, alpaca, jsonl (issue 4) --------------------------------------

FAST_SOL = '''import torch.nn as nn
from dice_ray.launch import load_cuda

cuda_source = r"""
extern "C" __global__ void k(float* x) {}
"""
kernels = load_cuda(cuda_source)


class ModelNew(nn.Module):
    def forward(self, x):
        return x
'''


def _fenced(code, lang="python"):
    return f"```{lang}\n{code}```\n"


def _rules(report):
    return {(r.source.rsplit("/", 1)[-1], r.index): r.rule for r in report.rejected}


def test_a_jsonl_line_that_is_not_utf8_loses_only_itself(tmp_path):
    good = json.dumps({"reference": REF, "id": "good"}).encode()
    f = tmp_path / "mixed.jsonl"
    f.write_bytes(codecs.BOM_UTF8 + good + b'\n{"reference": "\xff"}\n' + good.replace(b"good", b"also") + b"\n")
    report = load_tasks(f"jsonl:{f}")
    assert [t.name for t in report.tasks] == ["mixed_good", "mixed_also"]
    assert _rules(report) == {("mixed.jsonl", 2): "bad-json"} and "line 2: not UTF-8" in report.rejected[0].reason


def test_bad_file_levels_are_rejected_per_file(tmp_path):
    """Empty file, not JSON, wrong top-level type: one file-level rejection each, loading goes on."""
    for spec, ext in (("kernelbench-json", "json"), ("alpaca", "json"), ("jsonl", "jsonl")):
        d = tmp_path / spec
        d.mkdir()
        (d / f"empty.{ext}").write_text(" \n")
        (d / f"broken.{ext}").write_bytes(b"\xff\xfe not utf-8")
        if ext == "json":
            (d / "text.json").write_text("not json at all")
            (d / "scalar.json").write_text('"a string"')
        report = load_tasks(f"{spec}:{d}")
        assert report.tasks == []
        # JSON Lines is decoded a line at a time: the bad bytes lose their line only
        expected = {("empty." + ext, "file"): "empty-file", ("broken." + ext, 1 if ext == "jsonl" else "file"): "bad-json"}
        if ext == "json":
            expected |= {("text.json", "file"): "bad-json", ("scalar.json", "file"): "not-a-list"}
        assert _rules(report) == expected, spec
        assert f"{len(expected)} rejected" in report.summary()
    not_list = tmp_path / "obj.json"
    not_list.write_text(json.dumps({"rows": 3}))
    assert _rules(load_tasks(f"kernelbench-json:{not_list}")) == {("obj.json", "file"): "not-a-list"}
    assert _rules(load_tasks(f"alpaca:{not_list}")) == {("obj.json", "file"): "not-a-list"}


def test_kernelbench_json_layouts_ids_and_bad_records(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rows = [
        {"code": REF_SMALL, "level": 1, "name": "19_ReLU", "problem_id": 19},  # the HF dataset's row
        {"pytorch_code": REF_SMALL, "level": "2", "problem_name": "Relu Again.py", "problem_id": 7},
        {"ref_arch_src": REF_TRAP},  # no level, name, id: estimated level, index id
        {"code": REF_SMALL, "level": 9, "name": "x"},
        {"name": "no_code", "level": 1},
        {"code": "def f(:\n", "level": 1, "name": "bad"},
        ["not", "an", "object"],
        {"code": REF_SMALL, "level": 1, "name": "ReLU", "problem_id": 19},  # same id as row 0
    ]
    (tmp_path / "kb.json").write_text(json.dumps(rows))
    report = load_tasks(f"kernelbench-json:{tmp_path / 'kb.json'}")
    assert [(t.task_id, t.name, t.level) for t in report.tasks] == [
        ("kernelbench/level1/19_ReLU", "19_ReLU", 1),
        ("kernelbench/level2/7_Relu_Again", "Relu Again.py", 2),
        ("kernelbench-kb/2", "kb-2", 1),
    ]
    assert _rules(report) == {("kb.json", 3): "bad-level", ("kb.json", 4): "missing-key",
                              ("kb.json", 5): "syntax-error", ("kb.json", 6): "not-an-object",
                              ("kb.json", 7): "duplicate-id"}
    assert "code" in next(r.reason for r in report.rejected if r.index == 4)
    assert not (tmp_path / "EXECUTED").exists(), "a record was executed"
    # {"problems": [...]}, the HF DatasetDict dumped by split, and JSON Lines (Dataset.to_json)
    folder = tmp_path / "kb"
    folder.mkdir()
    (folder / "a.json").write_text(json.dumps({"problems": rows[:1]}))
    (folder / "b.json").write_text(json.dumps({"level_2": [{"code": REF_SMALL, "name": "3_Fused", "problem_id": 3}]}))
    (folder / "c.jsonl").write_text(json.dumps({"code": REF_SMALL, "level": 3, "name": "1_MLP"}) + "\n{oops\n")
    (folder / "notes.txt").write_text("ignored")
    report = load_tasks(f"kernelbench-json:{folder}")
    assert [t.task_id for t in report.tasks] == [
        "kernelbench/level1/19_ReLU", "kernelbench/level2/3_Fused", "kernelbench/level3/1_MLP"]
    assert _rules(report) == {("c.jsonl", 2): "bad-json"}
    assert report.accepted_by_level() == {1: 1, 2: 1, 3: 1}


def _alpaca(ref_block, answer, shape="instruction"):
    if shape == "instruction":
        return {"instruction": "Optimize this PyTorch model with CUDA kernels.", "input": ref_block, "output": answer}
    return {"prompt": "Write ModelNew for:\n" + ref_block, "response": answer}


def test_alpaca_pairs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    other = _fenced("__global__ void k() {}\n", "cpp")  # a non-Python block before the answer
    records = [
        _alpaca(_fenced(REF_TRAP), "Here it is:\n" + other + _fenced(INLINE_SOL)),
        _alpaca(_fenced(REF_SMALL), _fenced(FAST_SOL, "py"), shape="prompt"),
        _alpaca(REF_SMALL, ""),  # bare reference in input, no answer: task without solution
        _alpaca("no code here", _fenced(INLINE_SOL)),
        _alpaca(_fenced(REF_SMALL), "I cannot do that."),
        _alpaca(_fenced(REF_SMALL), _fenced(INLINE_SOL.replace("class ModelNew(nn.Module):", "class ModelNew(:"))),
        _alpaca(_fenced(REF_SMALL), _fenced(INLINE_SOL.replace("load_inline(", "compile("))),
        {"question": "?", "answer": "!"},
        _alpaca(_fenced(REF_SMALL.replace("def forward", "def fwd")), ""),
        {"prompt": ["not", "text"], "response": ""},
    ]
    (tmp_path / "cuke.json").write_text(json.dumps(records))
    report = load_tasks(f"alpaca:{tmp_path / 'cuke.json'}")
    got = {t.task_id: (t.solution_format, t.level) for t in report.tasks}
    assert got == {"alpaca-cuke/0": ("load_inline", 1), "alpaca-cuke/1": ("fast", 1), "alpaca-cuke/2": (None, 1)}
    assert report.tasks[0].solution_src == INLINE_SOL and report.tasks[0].reference_src == REF_TRAP
    assert _rules(report) == {("cuke.json", 3): "no-reference-block", ("cuke.json", 4): "bad-solution",
                              ("cuke.json", 5): "bad-solution", ("cuke.json", 6): "bad-solution",
                              ("cuke.json", 7): "missing-key", ("cuke.json", 8): "no-forward",
                              ("cuke.json", 9): "not-a-string"}
    reasons = {r.index: r.reason for r in report.rejected}
    assert reasons[5].startswith("bad-solution: syntax-error: ") and "no-loader-call" in reasons[6]
    assert not (tmp_path / "EXECUTED").exists(), "a record was executed"
    assert "3 accepted (L1: 3; 2 with a solution)" in report.summary() and "bad-solution: 3" in report.summary()


def test_jsonl_lines(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    lines = [
        json.dumps({"reference": REF_SMALL, "solution": INLINE_SOL, "level": 2, "name": "relu", "id": "a"}),
        "",  # blank lines are skipped, line numbers still count them
        json.dumps({"pytorch_code": REF_TRAP, "cuda_code": FAST_SOL}),
        "{not json",
        json.dumps([1, 2]),
        json.dumps({"solution": INLINE_SOL}),
        json.dumps({"reference": REF_SMALL, "solution": "class ModelNew:\n    pass\n"}),
        json.dumps({"reference": REF_SMALL, "solution": 5}),
        json.dumps({"reference": REF_SMALL, "id": "a"}),
        json.dumps({"reference": REF_SMALL, "level": 1, "name": "", "id": 10}),
        json.dumps({"reference": REF_SMALL, "id": "../etc"}),
        json.dumps({"reference": REF_SMALL, "solution": ""}) + "\r",
        "{not json either",  # refused while reading, before lines 5-11 are parsed
    ]
    (tmp_path / "t.jsonl").write_text("\n".join(lines) + "\n")
    report = load_tasks(f"jsonl:{tmp_path / 't.jsonl'}")
    got = {t.task_id: (t.name, t.level, t.solution_format) for t in report.tasks}
    assert got == {"jsonl-t/a": ("relu", 2, "load_inline"), "jsonl-t/3": ("t_3", 1, "fast"),
                   "jsonl-t/12": ("t_12", 1, None)}
    assert _rules(report) == {("t.jsonl", 4): "bad-json", ("t.jsonl", 5): "not-an-object",
                              ("t.jsonl", 6): "missing-key", ("t.jsonl", 7): "bad-solution",
                              ("t.jsonl", 8): "bad-solution", ("t.jsonl", 9): "duplicate-id",
                              ("t.jsonl", 10): "bad-name", ("t.jsonl", 11): "bad-id", ("t.jsonl", 13): "bad-json"}
    assert "line 4" in next(r.reason for r in report.rejected if r.index == 4)
    assert [r.index for r in report.rejected] == [*range(4, 12), 13]  # line order (4 and 13 refused while reading)
    assert report.rejection_lines()[0].startswith(f"rejected {tmp_path / 't.jsonl'}[4]: bad-json: line 4")
    assert not (tmp_path / "EXECUTED").exists(), "a record was executed"
    with pytest.raises(FileNotFoundError, match="JSON Lines"):
        load_tasks(f"jsonl:{tmp_path / 'missing'}")


def test_a_spec_may_set_the_level_of_its_tasks(dice_data):
    """``dice:FILE@level=N``: a file without levels (or with guessed ones) gets the level it is known to have."""
    path = dice_data / "kernel_infilling_evaluation.json"
    guessed = load_tasks(f"dice:{path}")
    assert set(guessed.accepted_by_level()) == {1, 2}  # estimated from Model.forward
    set_ = load_tasks(f"dice:{path}@level=1+builtin:2")
    assert set_.accepted_by_level() == {1: len(guessed.tasks) + 2}
    assert [t.task_id for t in set_.tasks[:len(guessed.tasks)]] == [t.task_id for t in guessed.tasks]
    for bad in ("7", "one", ""):
        with pytest.raises(ValueError, match="@level= takes a level 0..4"):
            load_tasks(f"dice:{path}@level={bad}")


def test_spec_error_names_every_spec():
    with pytest.raises(ValueError) as err:
        load_tasks("alpaca:")
    for spec in ("builtin", "dice:PATH", "kernelbench:DIR", "kernelbench-json:PATH", "alpaca:PATH", "jsonl:PATH"):
        assert spec in str(err.value)


# ---- memory budget: scale down when the definition allows (KernelBench#146) ----------------------

HUGE = REF.replace("torch.randn(N, 1024)", "torch.randn(batch_size, dim)").replace(
    "def get_init_inputs():\n    return []", "def get_init_inputs():\n    return [dim]"
)
HUGE_SCALABLE = "# sizes: é\nbatch_size = 1_048_576  # 2**30 elements with dim\ndim = 1024\n" + HUGE


def test_huge_inputs_are_scaled_down_or_rejected(tmp_path):
    assert static_input_elements(HUGE_SCALABLE) == 2**30
    literal = REF.replace("torch.randn(N, 1024)", "torch.randn(1048576, 1024)")  # no constant to halve
    shared = "batch_size = 1048576\ndim = 1024\n" + HUGE.replace("return [dim]", "return [dim, batch_size]")
    lines = [json.dumps({"reference": src, "id": i}) for i, src in enumerate((HUGE_SCALABLE, literal, shared))]
    (tmp_path / "big.jsonl").write_text("\n".join(lines))
    report = load_tasks(f"jsonl:{tmp_path / 'big.jsonl'}")
    assert [t.task_id for t in report.tasks] == ["jsonl-big/0"]
    assert [(r.index, r.rule) for r in report.rejected] == [(2, "inputs-too-large"), (3, "inputs-too-large")]
    scaled = report.scaled[0]
    assert (scaled.task_id, scaled.constant, scaled.old_value, scaled.new_value) == ("jsonl-big/0", "batch_size",
                                                                                     2**20, 2**18)
    assert scaled.elements == 2**28 == static_input_elements(report.tasks[0].reference_src)
    # the source changes only at that literal
    assert report.tasks[0].reference_src == HUGE_SCALABLE.replace("1_048_576", "262144")
    assert "1 inputs scaled down" in report.summary()
    report = load_tasks(f"jsonl:{tmp_path / 'big.jsonl'}", max_input_elements=None)
    assert len(report.tasks) == 3 and report.scaled == []
    smaller = load_tasks(f"jsonl:{tmp_path / 'big.jsonl'}", max_input_elements=3000)
    assert smaller.scaled[0].new_value == 2 and smaller.scaled[0].elements == 2048


def test_scale_down_inputs_rules():
    crlf = HUGE_SCALABLE.replace("\n", "\r\n")
    out = scale_down_inputs(crlf, 2**20)
    assert out == crlf.replace("1_048_576", "1024")
    assert scale_down_inputs(HUGE_SCALABLE, 2**30) == HUGE_SCALABLE  # fits already: unchanged
    assert scale_down_inputs(HUGE_SCALABLE, 1023) is None  # still 1024 elements with batch_size = 1
    assert scale_down_inputs("M = 2**10\nN = M * M\n" + REF, 2**10) is None  # N reads a name: not a size constant
    # arithmetic on literals is a size constant (KernelBench's M = 256 * 8), written back as one literal
    assert scale_down_inputs("N = 2**20\n" + REF, 2**10) == "N = 1\n" + REF
    assert shape_constant("N = 256 * 8 + (1 << 3)\n" + REF) == ("N", 2056)
    assert shape_constant("N = 2.0 * 8\n" + REF) is None and shape_constant("N = -4 * 8\n" + REF) is None
    with pytest.raises(ValueError, match="max_elements"):
        scale_down_inputs(HUGE_SCALABLE, 0)
    with pytest.raises(TaskError, match="no-model-class"):
        scale_down_inputs("x = 1\n", 10)
    assert shape_constant(HUGE_SCALABLE) == ("batch_size", 2**20) and shape_constant("def (:") is None


@settings(max_examples=60, deadline=None)
@given(value=st.integers(1, 2**40), dim=st.integers(1, 4096), cap=st.integers(1, 2**34))
def test_scale_down_halves_just_enough(value, dim, cap):
    src = f"batch_size = {value}\ndim = {dim}\n" + HUGE
    out = scale_down_inputs(src, cap)
    if value * dim <= cap:
        assert out == src
    elif dim > cap:
        assert out is None
    else:
        (_, new), k = shape_constant(out), 1
        while (value >> k) * dim > cap:
            k += 1
        assert new == value >> k and new * dim <= cap < 2 * new * dim + dim


def test_malformed_variants_of_dice_files(dice_data, tmp_path):
    """DICE's two real files, damaged: each damage is a rejection naming the file (and record) and the
    rule; a BOM is harmless; nothing raises but a path that gives no data file at all."""
    e2e = (dice_data / "end_to_end_kernel_generation_4000.json").read_bytes()
    infill = json.loads((dice_data / "kernel_infilling_evaluation.json").read_text())
    folder = tmp_path / "d"
    folder.mkdir()
    (folder / "truncated.json").write_bytes(e2e[:5000])
    (folder / "bom.json").write_bytes(b"\xef\xbb\xbf" + json.dumps(json.loads(e2e)[:3]).encode())
    (folder / "latin1.json").write_bytes(e2e[:200] + b"\xff" + e2e[200:300])
    (folder / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    dup = [dict(infill[0], id="x"), dict(infill[1], id="x")]
    (folder / "infill_dup.json").write_text(json.dumps(dup))
    report = load_tasks(f"dice:{folder}")
    reasons = {(r.source.rsplit("/", 1)[-1], r.index): r.reason for r in report.rejected}
    assert sorted(t.task_id for t in report.tasks) == ["dice-e2e/0", "dice-e2e/1", "dice-e2e/2", "dice-infill/x"]
    assert reasons[("truncated.json", "file")].startswith("bad-json: Unterminated string")
    assert reasons[("latin1.json", "file")] == "bad-json: not UTF-8 text (invalid start byte at byte 200)"
    assert reasons[("deep.json", "file")] == "bad-json: nested too deeply for the JSON parser"  # was a RecursionError
    assert reasons[("infill_dup.json", 1)] == "duplicate-id: task id 'dice-infill/x' was already loaded from infill_dup.json[0]"
    assert len(reasons) == 4
    line = json.dumps({"reference": infill[0]["pytorch_code"]})
    (tmp_path / "j.jsonl").write_text("\ufeff" + line + "\n" + "[" * 100_000 + "\n")
    report = load_tasks(f"jsonl:{tmp_path / 'j.jsonl'}")
    assert [t.task_id for t in report.tasks] == ["jsonl-j/1"]
    assert [(r.index, r.reason) for r in report.rejected] == [(2, "bad-json: line 2: nested too deeply for the JSON parser")]


def test_paths_that_give_no_data_file_say_why(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x.jsonl").write_text("{}\n")
    (tmp_path / "f.json").write_text("[]")
    for spec, says in [
        (f"dice:{tmp_path / 'empty'}", "DICE data folder .* holds no .json file"),  # was: 0 tasks, no word why
        (f"dice:{tmp_path / 'other'}", "holds no .json file"),
        (f"kernelbench-json:{tmp_path / 'empty'}", "holds no .json or .jsonl file"),
        ("dice:/dev/null", "is neither a regular file nor a folder"),  # was: "does not exist"
        (f"kernelbench:{tmp_path / 'f.json'}", "is not a folder"),
        (f"jsonl:{tmp_path / 'missing'}", "does not exist"),
    ]:
        with pytest.raises(FileNotFoundError, match=says):
            load_tasks(spec)
    with pytest.raises(FileNotFoundError, match="is not a regular file"):
        load_reference_file(tmp_path / "empty")
    (tmp_path / "nul.py").write_bytes(b"\x00class Model: pass\n")
    with pytest.raises(TaskError, match=r"does not parse: source code string cannot contain null bytes$"):
        load_reference_file(tmp_path / "nul.py")


def test_a_split_that_is_not_a_list_is_named(tmp_path):
    f = tmp_path / "kb.json"
    f.write_text(json.dumps({"level_1": [{"code": REF_SMALL, "name": "relu"}], "level_2": 5}))
    report = load_tasks(f"kernelbench-json:{f}")
    assert [r.reason for r in report.rejected] == [
        "not-a-list: an object of splits must hold a list under every key: 'level_2' is a int"]


def test_kernelbench_folder_with_too_many_files_fails_at_once(tmp_path, monkeypatch):
    """A wrong folder (a home directory, a virtual environment) is refused, not parsed for minutes; hidden and
    package folders are not searched."""
    import dice_ray.tasks.loaders as loaders

    monkeypatch.setattr(loaders, "MAX_KERNELBENCH_FILES", 3)
    for i in range(3):
        (tmp_path / f"{i}_Relu.py").write_text(REF_SMALL)
    for skipped in (".venv", "site-packages", "__pycache__"):
        (tmp_path / skipped).mkdir()
        (tmp_path / skipped / "x.py").write_text("x = 1\n")
    assert len(load_tasks(f"kernelbench:{tmp_path}").tasks) == 3
    (tmp_path / "3_Relu.py").write_text(REF_SMALL)
    with pytest.raises(ValueError, match="more than 3 .py files under it"):
        load_tasks(f"kernelbench:{tmp_path}")
