"""Prompts: both phases and template sets, candidates rebuilt exactly from SFT targets, fences
stripped, compact references keep the code, prompts stay short."""

from __future__ import annotations

import ast
from dataclasses import replace

import pytest

from dice_ray.tasks.loaders import load_tasks
from dice_ray.tasks.prompts import (
    E2E_FORMAT,
    can_infill,
    FILL_MARKER,
    infill_context,
    assemble_candidate,
    build_prompt,
    compact_reference,
    sft_pairs,
    strip_fence,
)
from dice_ray.tasks.scaffold import ScaffoldError, make_scaffold
from dice_ray.tasks.task import Task

BUILTIN = load_tasks("builtin").tasks


def _strip_docstrings(tree: ast.AST) -> str:
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and len(body) > 1 and isinstance(body[0], ast.Expr) and isinstance(
            getattr(body[0], "value", None), ast.Constant
        ) and isinstance(body[0].value.value, str):
            node.body = body[1:]
    return ast.dump(tree)


@pytest.mark.parametrize("template", ["compact", "dice"])
def test_sft_pairs_rebuild_the_solution(template):
    """Every pair rebuilds its solution; end-to-end pairs only where the template asks for the solution's format."""
    for task in BUILTIN:
        plain = replace(task, solution_variants=())
        pairs = sft_pairs(plain, template)
        assert len(pairs) == (2 if E2E_FORMAT[template] == "fast" else 1)
        infill_prompt, middle = pairs[0]
        assert middle == make_scaffold(task.solution_src, "fast").middle
        assert assemble_candidate(task, "infill", middle) == task.solution_src
        assert middle not in infill_prompt and "class Model" in infill_prompt  # no answer leaks
        if len(pairs) == 2:
            e2e_prompt, whole = pairs[1]
            assert whole == task.solution_src and assemble_candidate(task, "e2e", whole) == task.solution_src
            assert task.solution_src not in e2e_prompt and "class Model" in e2e_prompt


def test_sft_pairs_learn_each_variant_and_bidirectional_pairs_keep_the_suffix():
    with_variant = [t for t in BUILTIN if t.solution_variants]
    assert with_variant, "the built-in suite ships slower variants"
    for task in with_variant:
        pairs = sft_pairs(task)
        assert len(pairs) == 2 * (1 + len(task.solution_variants))
        variant = task.solution_variants[0]
        assert (build_prompt(task, "e2e"), variant) in pairs  # the variant's end-to-end pair
        assert assemble_candidate(replace(task, solution_src=variant), "infill", pairs[2][1]) == variant
    task = replace(BUILTIN[0], solution_variants=())
    (before, middle, after), _ = sft_pairs(task, family="llada")
    assert (before, after) == infill_context(task) and before.endswith(make_scaffold(task.solution_src, "fast").prefix)
    assert after == make_scaffold(task.solution_src, "fast").suffix and assemble_candidate(task, "infill", middle) == task.solution_src


@pytest.mark.parametrize("template", ["compact", "dice"])
def test_infill_context_surrounds_the_middle(template):
    for task in BUILTIN[:20]:
        sc = make_scaffold(task.solution_src, "fast")
        before, after = infill_context(task, template)
        assert before.endswith(sc.prefix) and after.startswith(sc.suffix) and "class Model" in before
        assert FILL_MARKER not in before + after and sc.middle not in before + after


def test_dice_template_asks_end_to_end_for_load_inline():
    compact, dice = build_prompt(BUILTIN[0], "e2e", "compact"), build_prompt(BUILTIN[0], "e2e", "dice")
    assert "load_cuda" in compact and "load_inline" not in compact
    assert "load_inline(" in dice and "load_cuda" not in dice and "class ModelNew" in dice


def test_compact_prompts_fit_the_tiny_policy():
    for task in BUILTIN:
        infill = build_prompt(task, "infill")
        sc = make_scaffold(task.solution_src, "fast")
        assert sc.prefix + FILL_MARKER + sc.suffix in infill
        assert infill.count(FILL_MARKER) == 2  # the instruction names it, the scaffold holds it
        assert len(infill) < 2600 and len(build_prompt(task, "e2e")) < 2200, task.task_id
        assert "load_cuda" in build_prompt(task, "e2e")
    dice_infill = build_prompt(BUILTIN[0], "infill", "dice")
    assert FILL_MARKER not in dice_infill and "The prefix:" in dice_infill and "The suffix:" in dice_infill


def test_bad_phase_template_and_missing_solution():
    task = BUILTIN[0]
    with pytest.raises(ValueError, match="phase"):
        build_prompt(task, "rl")
    with pytest.raises(ValueError, match="template"):
        build_prompt(task, "e2e", "huge")
    bare = Task("t/1", "t", 1, task.reference_src)
    assert sft_pairs(bare) == [] and "Solution:" in build_prompt(bare, "e2e")
    with pytest.raises(ScaffoldError, match="no solution_src"):
        build_prompt(bare, "infill")
    with pytest.raises(TypeError):
        assemble_candidate(task, "e2e", None)


def test_braces_and_slot_names_in_sources_are_kept():
    task = BUILTIN[0]
    ref = task.reference_src.replace("return []", 'return [{"k": "{suffix}"}]')
    odd = Task("t/2", "t", 1, ref, task.solution_src, "fast")
    for template in ("compact", "dice"):
        for phase in ("infill", "e2e"):
            prompt = build_prompt(odd, phase, template)
            assert '{"k": "{suffix}"}' in prompt and prompt.count("kernels.relu_kernel(") == (phase == "infill")


def test_fences():
    assert strip_fence("```python\nx = 1\n```\nmore text") == "x = 1\n"
    assert strip_fence("\n```\nx = 1\n") == "x = 1\n"  # unclosed: runs to the end
    assert strip_fence("x = 1\n```python\ny\n```") == "x = 1\n```python\ny\n```"  # no leading fence
    task = BUILTIN[0]
    middle = make_scaffold(task.solution_src, "fast").middle
    assert assemble_candidate(task, "infill", f"```cpp\n{middle}```") == task.solution_src
    assert assemble_candidate(task, "e2e", f"```python\n{task.solution_src}```\n") == task.solution_src


def test_compact_reference_keeps_the_code(dice_data):
    import json

    records = json.loads((dice_data / "kernel_infilling_evaluation.json").read_text())
    records += json.loads((dice_data / "end_to_end_kernel_generation_4000.json").read_text())[:300]
    shorter = 0
    for rec in records:
        src = rec["pytorch_code"]
        small = compact_reference(src)
        assert _strip_docstrings(ast.parse(small)) == _strip_docstrings(ast.parse(src))
        assert "#" not in small or "#" in src.replace("# ", "")  # comments gone (a '#' may sit in a string)
        assert "\n\n\n" not in small
        shorter += len(small) < len(src)
    assert shorter > len(records) // 2


def test_dice_infill_tasks_prompt_and_assemble(dice_data):
    report = load_tasks(f"dice:{dice_data / 'kernel_infilling_evaluation.json'}")
    for task in report.tasks:
        pairs = sft_pairs(task)
        assert len(pairs) == 1  # load_inline solutions: no end-to-end pair in the compact (fast) template
        prompt, middle = pairs[0]
        assert middle.startswith("source = ") and assemble_candidate(task, "infill", middle) == task.solution_src
        assert FILL_MARKER in prompt
        dice = sft_pairs(task, "dice")  # DICE's template asks end to end for load_inline: both pairs
        assert len(dice) == 2 and dice[1][1] == task.solution_src and "load_inline" in dice[1][0]


@pytest.mark.parametrize("template", ["compact", "dice"])
def test_body_granularity_prompts_and_candidates(template):
    """Infill at body granularity: the prompt names the kernel body, the scaffold's middle is one
    kernel's body, and prefix + body + suffix rebuilds the solution; source prompts keep their words."""
    for task in load_tasks("builtin").tasks:
        assert can_infill(task, "body") and can_infill(task, "source")
        body = make_scaffold(task.solution_src, task.solution_format, "body")
        prompt = build_prompt(task, "infill", template, "body")
        if template == "compact":
            assert FILL_MARKER in prompt and prompt.endswith("Kernel body:\n") and "CUDA source" not in prompt
        else:
            assert "the body of the CUDA kernel" in prompt and "CUDA source of the kernels" not in prompt
        assert "__global__" in prompt and body.prefix.rstrip().endswith("{")
        assert assemble_candidate(task, "infill", body.middle, "body") == task.solution_src
        src_prompt = build_prompt(task, "infill", template)
        assert ("with the CUDA source so that" in src_prompt) if template == "compact" else (
            "the CUDA source of the kernels" in src_prompt)
    relu = load_tasks("builtin").tasks[0]
    with pytest.raises(ScaffoldError):
        build_prompt(relu, "infill", template, "statement")
    no_kernel = Task("t/cublas", "cublas", 1, relu.reference_src, relu.solution_src.replace("__global__", "__device__"), "fast")
    assert can_infill(no_kernel, "source") and not can_infill(no_kernel, "body")
