"""A rewarded candidate computes when its kernels are its task's solution's up to names (dice_ray.eval.kernel_match)."""

from dataclasses import replace

from dice_ray.eval.kernel_match import body_shape, computes, kernel_shapes, slower_variant
from dice_ray.tasks.loaders import load_tasks

TASKS = {t.name: t for t in load_tasks("builtin").tasks}


def test_solutions_match_themselves_and_not_other_tasks():
    relu, gelu = TASKS["relu"], TASKS["gelu_tanh"]
    assert all(computes(t.solution_src, t) for t in TASKS.values())
    assert not computes(gelu.solution_src, relu) and not computes(relu.solution_src, gelu)


def test_renamed_variables_still_compute_an_emptied_or_other_math_kernel_does_not():
    relu = TASKS["relu"]
    renamed = relu.solution_src.replace("float v", "float w").replace("v > 0.f ? v", "w > 0.f ? w")
    assert renamed != relu.solution_src and computes(renamed, relu)
    emptied = relu.solution_src.replace("y[i] = v > 0.f ? v : 0.f;", "")
    assert not computes(emptied, relu)
    assert body_shape("y[i] = expf(x[i]);") != body_shape("y[i] = tanhf(x[i]);")  # called names are kept
    assert body_shape("y[i] = expf(x[i]); // a") == body_shape("out[j] = expf(inp[j]);")


def test_variants_count_as_the_tasks_own_and_garbage_has_no_kernel():
    with_variant = next(t for t in TASKS.values() if t.solution_variants)
    assert computes(with_variant.solution_variants[0], with_variant)
    assert not computes(with_variant.solution_variants[0], replace(with_variant, solution_variants=()))
    assert kernel_shapes("not python (") == frozenset() and not computes("import torch\n", TASKS["relu"])


def test_a_slower_variant_is_told_from_the_solution_names_aside():
    """Every built-in task's slower variant is told apart from its solution by its kernels (what
    benchmarks/learning.py --speedup-variants counts); renamed, still the variant; not computing, or no variant: None."""
    with_variants = [t for t in TASKS.values() if t.solution_variants]
    assert len(with_variants) >= 30
    for t in with_variants:
        assert slower_variant(t.solution_variants[0], t) is True, t.name
        assert slower_variant(t.solution_src, t) is False, t.name
    relu = TASKS["relu"]
    slow = relu.solution_variants[0]
    renamed = slow.replace("long start", "long first").replace("i = start; i < start + 64", "i = first; i < first + 64")
    assert renamed != slow and slower_variant(renamed, relu) is True
    assert slower_variant("import torch\n", relu) is None
    assert slower_variant(relu.solution_src, replace(relu, solution_variants=())) is None
