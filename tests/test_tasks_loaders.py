"""Task validation rules and loaders: DICE's two files load with counted rejections, malformed records
are rejected with file, index and reason while loading goes on, nothing is ever executed."""

from __future__ import annotations

import json
import time

import pytest

from dice_ray.tasks.loaders import DEFAULT_MAX_INPUT_ELEMENTS, load_reference_file, load_tasks
from dice_ray.tasks.task import Task, TaskError, estimate_level, static_input_elements

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
    assert rule == "not-a-string" or "reference_src" in str(err.value)


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
        {"idx": 8, "level": 1, "pytorch_code": "N = 2**20\n" + REF, "cuda_code": ""},  # 1G elements
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
    t0 = time.perf_counter()
    e2e = load_tasks(f"dice:{dice_data / 'end_to_end_kernel_generation_4000.json'}")
    infill = load_tasks(f"dice:{dice_data / 'kernel_infilling_evaluation.json'}")
    both = load_tasks(f"dice:{dice_data}")
    assert time.perf_counter() - t0 < 20
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
    report = load_tasks(f"kernelbench:{tmp_path}")
    assert [t.task_id for t in report.tasks] == ["kernelbench/level2/1_Relu"]
    assert [(r.index, r.rule) for r in report.rejected] == [("level2/2_Broken", "no-model-class")]
