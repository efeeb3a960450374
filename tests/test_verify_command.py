"""verify_files (``dice-ray verify``): one verdict for two files; clear errors for unusable files."""

from __future__ import annotations

import pytest

from _verify_sources import HONEST, RELU_REF
from dice_ray.config import DiceConfig, VerifyConfig
from dice_ray.verify.command import InputFileError, verify_files


@pytest.fixture
def files(tmp_path):
    task = tmp_path / "relu_task.py"
    task.write_text(RELU_REF)
    cand = tmp_path / "relu_solution.py"
    cand.write_text(HONEST)
    return task, cand


def test_verify_files_gives_a_verdict(files):
    task, cand = files
    cfg = DiceConfig(verify=VerifyConfig(mode="compile_only"))
    v = verify_files(task, cand, cfg)
    assert v.verdict == "ok" and v.task_id == "file:relu_task.py" and v.candidate_id == "relu_solution.py"
    assert v.reward == cfg.reward.compile_only_reward


@pytest.mark.parametrize(
    "which,content,rule",
    [
        ("task", None, "missing"),
        ("task", "", "empty"),
        ("task", b"\xff\xfe\x00binary", "not-utf8"),
        ("task", "import torch\ndef get_inputs():\n    return []\n", "no-model-class"),
        ("task", "class Model(:\n", "syntax-error"),
        ("candidate", None, "missing"),
        ("candidate", b"\x80\x81", "not-utf8"),
    ],
)
def test_unusable_files_raise_naming_file_and_rule(files, which, content, rule):
    task, cand = files
    target = task if which == "task" else cand
    if content is None:
        target.unlink()
    elif isinstance(content, bytes):
        target.write_bytes(content)
    else:
        target.write_text(content)
    with pytest.raises(InputFileError) as info:
        verify_files(task, cand, VerifyConfig(mode="compile_only"))
    assert info.value.rule == rule and str(target) in str(info.value)
    assert f"[{rule}] {rule}:" not in str(info.value)  # "[syntax-error] ... does not parse", not the rule twice
    assert isinstance(info.value, ValueError)


def test_files_with_a_byte_order_mark_verify_as_python_reads_them(files):
    task, cand = files
    for f in files:
        f.write_bytes(b"\xef\xbb\xbf" + f.read_bytes())
    assert verify_files(task, cand, DiceConfig(verify=VerifyConfig(mode="compile_only"))).verdict == "ok"


def test_folder_is_not_a_file(files, tmp_path):
    task, _ = files
    with pytest.raises(InputFileError, match="not-a-file"):
        verify_files(task, tmp_path, VerifyConfig(mode="compile_only"))
