"""The trainer's console lines for the warm start and the learner: readable sentences, not dict reprs."""

from __future__ import annotations

import os

from dice_ray.cluster.learner import learner_env
from dice_ray.cluster.console import describe_summary, describe_heldout, describe_learner, describe_warm_start
from dice_ray.cluster.step_record import correct_rate
from dice_ray.verify.verdict import Verdict


def _verdict(kind: str, correct: bool | None, mode: str) -> Verdict:
    return Verdict(candidate_id="c", task_id="t", verdict=kind, compiled=kind != "compile_error", correct=correct,
                   speedup=None, reward=0.0, reason="", mode=mode, seconds=0.1)


def test_warm_start_line_says_steps_pairs_time_loss_and_why_it_stopped():
    report = {"steps": 658, "final_loss": 0.0677, "seconds": 23.98, "cache_hit": False, "cache_key": "2efde44e0b5936e8b6e3aaa5",
              "num_pairs": 176, "losses": [(50, 6.359), (650, 0.107), (658, 0.0677)]}
    line = describe_warm_start(report, 800, 0.08)
    assert line == ("658 SFT steps on 176 (prompt, solution) pairs in 24.0 s, loss 6.36 -> 0.068; stopped at step 658 "
                    "of 800: loss below sft.target_loss=0.08; cached as 2efde44e0b59")
    assert "stopped" not in describe_warm_start(report | {"steps": 800}, 800, 0.08)  # ran every step
    short = describe_warm_start(report | {"steps": 20, "losses": [(20, 6.6612)]}, 20, 0.08)
    assert ", loss 6.661; cached as" in short and "->" not in short  # one logged step: no "6.66 -> 6.661"
    hit = describe_warm_start(report | {"cache_hit": True, "steps": 0, "losses": []}, 800, 0.08)
    assert hit == "from the SFT cache (2efde44e0b59): 176 (prompt, solution) pairs, final loss 0.068"
    assert "{" not in line + hit


def test_learner_line_says_where_the_weights_came_from_and_how_it_runs():
    info = {"family": "sdar", "model": "built, warm-started by SFT", "backend": "gloo", "zero_stage": 0, "ranks": 1,
            "seconds": 1.26, "device": "cpu", "params": 551_040}
    assert describe_learner(info) == ("sdar policy, 0.55 M params, built, warm-started by SFT; DeepSpeed ZeRO-0 over "
                                      "gloo, 1 rank(s) on cpu; ready in 1.3 s")


def test_heldout_line_names_each_phase_and_says_when_correctness_was_not_measured():
    out = {"infill": {"candidates": 8, "tasks": 4, "compile_rate": 0.25, "ok_rate": 0.125, "correct_rate": None,
                      "compile_only": True},
           "e2e": {"candidates": 8, "tasks": 4, "compile_rate": 0.5, "correct_rate": 0.125, "compile_only": False}}
    assert describe_heldout(out) == ("infill: 8 candidates (4 held-out tasks), 25.0% compile, 12.5% ok, correctness not measured "
                                     "(compile-only verifier); e2e: 8 candidates (4 held-out tasks), 50.0% compile, "
                                     "12.5% correct")
    gpu_none = {"e2e": {"candidates": 8, "compile_rate": 0.0, "correct_rate": None, "compile_only": False}}
    assert describe_heldout(gpu_none) == "e2e: 8 candidates, 0.0% compile, correctness not measured (nothing compiled)"
    gpu_failed_after = {"infill": {"candidates": 64, "compile_rate": 0.3125, "correct_rate": None, "compile_only": False}}
    assert describe_heldout(gpu_failed_after) == ("infill: 64 candidates, 31.2% compile, correctness not measured "
                                                  "(none reached the correctness check)")
    assert describe_heldout({}) == "no eligible task"


def test_summary_lines_say_steps_rewards_rates_and_heldout_in_words():
    summary = {"steps": 10, "phases_seen": ["e2e", "infill", "ramp"], "verifier_mode": "compile_only",
               "final": {"reward_mean": 0.016, "compile_rate": 0.0156, "correct_rate": None, "cheat_rate": 0.0,
                         "speedup_geomean": None},
               "reward_mean_first_last": [0.390625, 0.015625], "groups_dropped_total": 47, "seconds": 332.9,
               "heldout_end": {"infill": {"candidates": 8, "compile_rate": 0.125, "correct_rate": None}}}
    text = describe_summary(summary)
    assert text.splitlines()[0] == ("10 steps (phases infill, ramp, e2e), 332.9 s with the warm start and held-out "
                                    "evaluations, verifier compile-only")
    assert "reward 0.391 -> 0.016; last step: compile 2%, correct n/a, cheat 0%, speedup n/a; 47 groups dropped" in text
    assert "held-out" not in text.splitlines()[1] and "{" not in text and len(text.splitlines()) == 2  # said just before
    counted = describe_summary({**summary, "final": {**summary["final"], "verdicts": {"ok": 21, "compile_error": 43}}})
    assert counted.splitlines()[2] == "last step's verdicts: compile_error 43, ok 21" and len(counted.splitlines()) == 3
    gpu = describe_summary({**summary, "verifier_mode": "gpu", "heldout_end": None,
                            "final": {**summary["final"], "correct_rate": 0.5, "speedup_geomean": 1.234}})
    assert "verifier gpu" in gpu and "correct 50%" in gpu and "speedup 1.23x" in gpu
    assert gpu.splitlines()[0].startswith("10 steps (phases infill, ramp, e2e), 332.9 s with the warm start, ")  # none held out


def test_learner_line_says_why_auto_left_the_fused_kernels_off_on_a_gpu():
    info = {"family": "sdar", "params": 1.7e9, "model": "built (random init)", "zero_stage": 2, "backend": "nccl",
            "ranks": 1, "device": "cuda:0", "seconds": 3.0}
    on = describe_learner({**info, "fused_kernels": ["swiglu", "rope"]})
    assert "fused kernels: swiglu, rope (Liger)" in on and "off" not in on
    off = describe_learner({**info, "fused_kernels": [], "fused_kernels_off": "Liger-Kernel does not import (x)"})
    assert "fused kernels off (cluster.fused_kernels=auto: Liger-Kernel does not import (x))" in off
    assert "fused" not in describe_learner({**info, "device": "cpu", "fused_kernels": [], "fused_kernels_off": None})


def test_learner_line_names_a_slow_deepspeed_set_up():
    """A first run spends ~25 s in deepspeed.initialize building DeepSpeed's ops (0.4 s once cached): the line
    says where the time went, right after a warm start line that reports its own time."""
    info = {"family": "sdar", "params": 5.5e5, "model": "built, warm-started by SFT", "zero_stage": 0,
            "backend": "gloo", "ranks": 1, "device": "cpu", "fused_kernels": []}
    slow = describe_learner({**info, "seconds": 25.9, "deepspeed_seconds": 25.5})
    assert slow.endswith("ready in 25.9 s (DeepSpeed's set-up 25.5 s of it: it builds its ops on first use, then "
                         "caches them in ~/.cache/dice-ray/torch_extensions)")
    named = slow.rsplit("caches them in ", 1)[1].rstrip(")")
    assert os.path.expanduser(named) == learner_env(False)["TORCH_EXTENSIONS_DIR"]  # the folder the learner uses
    assert describe_learner({**info, "seconds": 0.4, "deepspeed_seconds": 0.3}).endswith("ready in 0.4 s")
    assert describe_learner({**info, "seconds": 0.4}).endswith("ready in 0.4 s")


def test_correct_rate_counts_only_what_a_gpu_verifier_measured():
    # compile-only: 15 ok (not measured) and one dry run's wrong shape (incorrect, correct=False) -> no rate, not 0 %
    dry = [_verdict("ok", None, "compile_only")] * 15 + [_verdict("incorrect", False, "compile_only")]
    assert correct_rate(dry) is None
    gpu = [_verdict("ok", True, "gpu"), _verdict("incorrect", False, "gpu"), _verdict("crash", None, "gpu"),
           _verdict("ok", True, "gpu")]
    assert correct_rate(gpu) == 2 / 3  # the crash measured nothing
    assert correct_rate([]) is None


def test_a_resumed_run_says_how_many_steps_it_ran_and_claims_no_warm_start():
    summary = {"steps": 12, "resumed_at_step": 10, "phases_seen": ["infill"], "verifier_mode": "compile_only",
               "final": {"compile_rate": 0.27, "correct_rate": None}, "seconds": 35.04, "heldout_end": {"infill": {}},
               "reward_mean_first_last": [0.4, 0.3], "groups_dropped_total": 3}
    first = describe_summary(summary).splitlines()[0]
    assert first == ("12 steps (phases infill), 2 of them in this run, resumed at step 10: 35.0 s with the final "
                     "held-out evaluation, verifier compile-only")
    assert "warm start" not in first
    assert "warm start" in describe_summary({**summary, "resumed_at_step": None})
    assert "held-out" not in describe_summary({**summary, "heldout_end": None})


def test_step_record_counts_each_phases_prompts_and_figures():
    from types import SimpleNamespace

    from dice_ray.cluster.scheduler import Decision, PromptRequest, StepPlan
    from dice_ray.cluster.step_record import step_record

    reqs = [PromptRequest(f"s3-p{i}", f"t{i}", phase, i) for i, phase in enumerate(["infill", "infill", "e2e"])]
    groups = [SimpleNamespace(request=r, candidates=["a", "b"]) for r in reqs]

    def v(ok: bool) -> Verdict:
        return Verdict(candidate_id="c", task_id="t", verdict="ok" if ok else "compile_error", compiled=ok,
                       correct=None, speedup=None, reward=1.0 if ok else 0.0, reason="", mode="compile_only", seconds=0.1)

    built_but_unlaunchable = v(False).model_copy(update={"compiled": True})  # e.g. unknown-kernel: compiled, not rewarded
    verdicts = [v(True), v(True), v(True), built_but_unlaunchable, v(False), v(False)]
    decision = Decision(3, "leave-infill", 0.75, "compile_rate 0.8 >= 0.6", "compile_rate", 0.8, 0.6)
    rec = step_record(StepPlan(3, 0.75, "ramp", reqs, decision), groups, verdicts, dropped=1)
    assert (rec["prompts_infill"], rec["prompts_e2e"], rec["infill_target"]) == (2, 1, 0.75)
    assert rec["infill_fraction"] == 2 / 3  # the share actually sampled, not the curriculum's target
    assert rec["by_phase"]["infill"] == {"prompts": 2, "candidates": 4, "reward_mean": 0.75, "compile_rate": 1.0,
                                         "ok_rate": 0.75, "correct_rate": None, "speedup_geomean": None}
    assert rec["by_phase"]["e2e"]["reward_mean"] == 0.0 and rec["reward_mean"] == 0.5
    assert rec["phase_decision"]["action"] == "leave-infill" and rec["gate_figure"] == 0.8


def test_learning_line_compares_each_phase_start_and_end():
    from dice_ray.cluster.console import describe_learning

    start = {"infill": {"reward_mean": 0.41}, "e2e": {"reward_mean": 0.12}}
    end = {"infill": {"reward_mean": 0.62}, "e2e": {"reward_mean": 0.10}}
    assert describe_learning(start, end) == ("training prompts, reward at start -> end: infill 0.410 -> 0.620 (up), "
                                             "e2e 0.120 -> 0.100 (down)")
    # what is printed decides the word: a control arm's 0.4223 -> 0.4220 (H100 run) reads "0.422 -> 0.422 (same)"
    assert describe_learning({"infill": {"reward_mean": 0.4223}}, {"infill": {"reward_mean": 0.4220}}) == (
        "training prompts, reward at start -> end: infill 0.422 -> 0.422 (same)")
    assert describe_learning(None, end) is None
    summary_line = describe_summary({"steps": 2, "phases_seen": ["infill"], "final": {}, "train_start": start,
                                     "train_end": end}).splitlines()
    assert any(line.startswith("training prompts, reward at start -> end") for line in summary_line)


def test_spread_picks_evenly_first_and_last_included():
    from dice_ray.cluster.evaluation import spread

    assert spread(list(range(10)), 4) == [0, 3, 6, 9] and spread([1, 2], 5) == [1, 2] and spread(list(range(5)), 1) == [0]


def test_the_step_table_fits_an_80_column_terminal():
    """Each column's name and widest value fit its width, and a row with the spaces between is at most 80 wide."""
    from dice_ray.cluster.console import COLUMNS

    widest = {"step": 9999, "phase": "infill", "infill": 1.0, "reward": -0.123, "±std": 0.5, "compile": 1.0,
              "correct": 1.0, "cheat": 1.0, "speedup": 99.99, "drop": 999, "loss": -1.23e-12, "sec": 999.9}
    assert sorted(widest) == sorted(name for name, _, _ in COLUMNS)
    for name, width, fmt in COLUMNS:
        assert len(name) <= width and len(fmt.format(widest[name])) <= width, (name, fmt.format(widest[name]))
    assert sum(width for _, width, _ in COLUMNS) + len(COLUMNS) - 1 <= 80


def test_step_table_names_the_verifier_mode_above_its_header():
    """README: the line above the step table says the verifiers run compile-only; the header follows it, then the
    rows, and the mode line comes again only when the mode changes."""
    import io

    from rich.console import Console

    from dice_ray.cluster.console import StepTable

    buf = io.StringIO()
    table = StepTable(Console(file=buf, width=80, color_system=None))
    rec = {"verifier_mode": "compile_only", "step": 0, "phase": "infill", "infill_fraction": 1.0, "reward_mean": 0.5,
           "reward_std": 0.1, "compile_rate": 0.5, "correct_rate": None, "cheat_rate": 0.0, "speedup_geomean": None,
           "groups_dropped": 0, "loss": 0.0, "step_seconds": 1.0}
    table.header()
    table.row(rec)
    table.row({**rec, "step": 1})
    lines = buf.getvalue().splitlines()
    assert lines[0].startswith("verifier compile-only") and lines[1].split()[:2] == ["step", "phase"], lines
    assert [ln.split()[0] for ln in lines[2:]] == ["0", "1"]
    assert all(len(ln) <= 80 for ln in lines)
