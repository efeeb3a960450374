"""``dice-ray eval`` / ``dice-ray curate``: metrics against hand-computed values, reports, CLI end to end (CPU)."""

from __future__ import annotations

import json
import math
import shutil

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dice_ray.cli import main
from dice_ray.eval.metrics import compute_metrics, group_metrics, pass_at_k
from dice_ray.eval.report import COMPILE_ONLY_HARDWARE, markdown, write_report
from dice_ray.tasks.loaders import BUILTIN_DIR
from dice_ray.verify.verdict import Verdict


def V(kind: str = "ok", speedup: float | None = None, correct: bool | None = True, mode: str = "gpu",
      task: str = "t") -> Verdict:
    """A verdict with only the fields the metrics read set meaningfully."""
    compiled = kind not in ("compile_error",)
    return Verdict(candidate_id="c", task_id=task, verdict=kind, compiled=compiled,
                   correct=correct if kind in ("ok", "incorrect") else None,
                   speedup=speedup if kind == "ok" else None, reward=0.0, reason="", mode=mode, seconds=0.0)


# -- pass@k ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("n,c,k,expected", [
    (5, 2, 1, 0.4),         # 1 - C(3,1)/C(5,1) = 1 - 3/5
    (5, 2, 2, 0.7),         # 1 - C(3,2)/C(5,2) = 1 - 3/10
    (10, 3, 5, 1 - 21 / 252),  # 1 - C(7,5)/C(10,5)
    (5, 0, 3, 0.0),         # no correct sample
    (4, 2, 3, 1.0),         # n - c < k: every draw of 3 holds a correct one
    (1, 1, 1, 1.0),
])
def test_pass_at_k_hand_computed(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected)


@pytest.mark.parametrize("n,c,k", [(3, 1, 4), (0, 0, 1), (3, 4, 1), (3, -1, 1), (3, 1, 0)])
def test_pass_at_k_rejects_bad_input(n, c, k):
    with pytest.raises(ValueError, match="pass_at_k"):
        pass_at_k(n, c, k)


def test_pass_at_k_rejects_non_int():
    with pytest.raises(TypeError, match="k must be an int"):
        pass_at_k(3, 1, 1.0)


@given(st.integers(1, 40).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
def test_pass_at_k_equals_binomial_form(nck):
    n, c, k = nck
    assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-9)


# -- group and level metrics ------------------------------------------------------------------------
def _four_tasks():
    """A and B level 1, C and D level 2; D got no candidate."""
    return {
        "A": [V("ok", 3.0), V("compile_error")],
        "B": [V("ok", 1.5), V("ok", 0.5)],
        "C": [V("incorrect", correct=False), V("ok", 4.0)],
    }, [("A", 1), ("B", 1), ("C", 2), ("D", 2)]


def test_metrics_hand_computed():
    verdicts, tasks = _four_tasks()
    m = compute_metrics(tasks, verdicts, ps=(0, 1, 2), ks=(1, 2, 5))
    o = m["overall"]
    assert (o["tasks"], o["samples"], o["measured"]) == (4, 6, True)
    assert o["compiled"] == pytest.approx(3 / 4)           # first samples of A, B, C
    assert o["correct"] == pytest.approx(2 / 4)            # A, B (C's first sample is incorrect)
    assert o["fast_p"] == pytest.approx({"0": 0.5, "1": 0.5, "2": 0.25})  # speedups 3.0, 1.5; strict >
    assert o["geomean_speedup"] == pytest.approx(math.sqrt(3.0 * 1.5))  # C's 4.0 is a second sample: ignored
    # pass@1: A 1/2, B 1, C 1/2, D 0 -> 2/4; pass@2: A, B, C 1, D 0 -> 3/4; pass@5: k > n
    assert o["pass_at_k"]["1"] == pytest.approx(0.5)
    assert o["pass_at_k"]["2"] == pytest.approx(0.75)
    assert o["pass_at_k"]["5"] is None
    l1, l2 = m["levels"]["1"], m["levels"]["2"]
    assert (l1["compiled"], l1["correct"], l1["fast_p"]["2"]) == (1.0, 1.0, 0.5)
    assert (l2["compiled"], l2["correct"], l2["fast_p"]["1"], l2["geomean_speedup"]) == (0.5, 0.0, 0.0, None)
    assert list(m["levels"]) == ["1", "2"]


def test_metrics_no_correct_solution():
    g = group_metrics([[V("incorrect", correct=False)], [V("compile_error")]], ps=(0, 1), ks=(1,))
    assert g["compiled"] == 0.5 and g["correct"] == 0.0
    assert g["fast_p"] == {"0": 0.0, "1": 0.0} and g["geomean_speedup"] is None and g["pass_at_k"]["1"] == 0.0


def test_metrics_compile_only_are_not_measured_not_zero():
    g = group_metrics([[V("ok", correct=None, mode="compile_only")], [V("compile_error", mode="compile_only")]],
                      ps=(0, 1), ks=(1,))
    assert g["measured"] is False and g["compiled"] == 0.5
    assert g["correct"] is None and g["fast_p"] == {"0": None, "1": None}
    assert g["geomean_speedup"] is None and g["pass_at_k"]["1"] is None


def test_metrics_bad_input():
    with pytest.raises(ValueError, match="not in tasks"):
        compute_metrics([("A", 1)], {"B": [V()]})
    with pytest.raises(ValueError, match="unique"):
        compute_metrics([("A", 1), ("A", 1)], {})
    with pytest.raises(ValueError, match=">= 0"):
        group_metrics([[V()]], ps=(-1,))


# -- report ---------------------------------------------------------------------------------------
def _result(verdicts, tasks):
    cands = [{"task_id": tid, "sample": j, "candidate_id": f"{tid}#{j}", "origin": "test", "source": "",
              "verdict": v.model_dump(mode="json")} for tid, vs in verdicts.items() for j, v in enumerate(vs)]
    return {"source": "test", "tasks_spec": "builtin", "hardware": "NVIDIA H200", "verifier": "test",
            "samples_per_task": 2, "tasks": [{"task_id": t, "name": t, "level": lvl} for t, lvl in tasks],
            "candidates": cands, "metrics": compute_metrics(tasks, verdicts, ks=(1, 2)), "missing": ["D"]}


def test_report_files_written_and_parseable(tmp_path):
    verdicts, tasks = _four_tasks()
    paths = write_report(_result(verdicts, tasks), tmp_path / "r")
    data = json.loads(paths["json"].read_text())
    assert data["metrics"]["overall"]["fast_p"]["2"] == pytest.approx(0.25)
    assert len(data["candidates"]) == 6
    md = paths["md"].read_text()
    assert "| Level 1 | 2 | 4 | 100.0% | 100.0% |" in md and "| Overall | 4 | 6 | 75.0% | 50.0% |" in md
    assert "not measured" not in md and "compile-only: `ok`" not in md
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_compile_only_says_not_measured():
    vs = {"A": [V("ok", correct=None, mode="compile_only")], "B": [V("compile_error", mode="compile_only")]}
    res = _result(vs, [("A", 1), ("B", 1)])
    res["hardware"] = COMPILE_ONLY_HARDWARE
    md = markdown(res)
    assert "NOT measured" in md
    assert "| Overall | 2 | 2 | 50.0% | not measured | not measured |" in md
    assert "| 0.0%" not in md  # no unmeasured metric printed as a measured 0
    assert "Verdicts: compile_error 1, ok 1\n(compile-only: `ok` means compiled, rule-abiding" in md  # not "correct"


# -- CLI end to end (compile-only, forced so that a GPU machine runs the same path) -------------------
@pytest.fixture
def no_ray(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


def test_eval_solutions_cli(tmp_path, capsys, no_ray):
    sol = tmp_path / "sol"
    sol.mkdir()
    shutil.copy(BUILTIN_DIR / "L1_01_relu" / "solution.py", sol / "relu.py")          # by task name
    (sol / "builtin__L1__gelu_tanh.py").write_text("import torch\nthis is not python(\n")  # by task id
    (sol / "not_a_task.py").write_text("x = 1\n")
    out = tmp_path / "out"
    rc = main(["eval", "--tasks", "builtin", "--solutions", str(sol), "--out", str(out),
               "tasks.max_tasks=3", "verify.mode=compile_only"])
    assert rc == 0
    data = json.loads((out / "results.json").read_text())
    got = {c["task_id"]: c["verdict"]["verdict"] for c in data["candidates"]}
    assert got == {"builtin/L1/relu": "ok", "builtin/L1/gelu_tanh": "compile_error"}
    assert data["missing"] == ["builtin/L1/gelu_erf"] and data["unmatched"] == ["not_a_task.py"]
    o = data["metrics"]["overall"]
    assert o["compiled"] == pytest.approx(1 / 3) and o["correct"] is None and o["fast_p"]["1"] is None
    assert data["hardware"] == COMPILE_ONLY_HARDWARE
    assert "not measured" in (out / "results.md").read_text() and (out / "results.png").is_file()
    assert "NOT measured" in capsys.readouterr().out


def test_split_heldout_is_the_part_train_kept_out(tmp_path, capsys, no_ray):
    """``--split heldout`` evaluates only tasks ``dice-ray train`` held out of SFT and RL: a default run's split
    (all tasks), or, for a run directory, that run's own (its ``tasks.max_tasks`` first); ``tasks.max_tasks`` of
    the eval then takes the first N of the part, so it can never pull in a training task."""
    import yaml

    from dice_ray.config import DiceConfig, TasksConfig
    from dice_ray.eval.run import EvalInputError, load_eval_tasks, run_tasks_config
    from dice_ray.tasks.loaders import load_tasks, split_tasks

    every = load_tasks("builtin").tasks
    train, heldout = split_tasks(every, 0.2)  # what a default `dice-ray train` holds out
    ids = lambda ts: [t.task_id for t in ts]  # noqa: E731
    cfg = DiceConfig()
    assert ids(load_eval_tasks("builtin", cfg, split="heldout")) == ids(heldout) and len(heldout) == 21
    assert ids(load_eval_tasks("builtin", cfg, split="train")) == ids(train)
    assert sorted(ids(heldout) + ids(train)) == sorted(ids(load_eval_tasks("builtin", cfg)))
    five = DiceConfig.model_validate({"tasks": {"max_tasks": 5}})
    lines: list[str] = []
    assert ids(load_eval_tasks("builtin", five, lines.append, split="heldout")) == ids(heldout)[:5]  # not a split of 5
    assert ("split heldout: 21 of 109 tasks, by a default run's split (all tasks, tasks.heldout_fraction=0.2); "
            "tasks.max_tasks=5: the first of them") in lines
    assert ids(load_eval_tasks("builtin", five)) == ids(every)[:5]

    # a run directory: its own split (a run of tasks.max_tasks=12 held out 2 of those 12)
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump({"tasks": {"max_tasks": 12}}))
    own = run_tasks_config(run)
    assert own == TasksConfig(max_tasks=12) and run_tasks_config(tmp_path) is None and run_tasks_config(None) is None
    assert ids(load_eval_tasks("builtin", cfg, split="heldout", split_from=own)) == ids(split_tasks(every[:12], 0.2)[1])

    with pytest.raises(EvalInputError, match="--split 'test'"):
        load_eval_tasks("builtin", cfg, split="test")
    with pytest.raises(EvalInputError, match="no task in that part"):
        load_eval_tasks("builtin", DiceConfig.model_validate({"tasks": {"heldout_fraction": 0.0}}), split="heldout")
    (run / "config.yaml").write_text("tasks: {max_tasks: -1}\n")
    with pytest.raises(EvalInputError, match="not a dice-ray config"):
        run_tasks_config(run)

    # --model of that run directory: the run's own split, whatever the eval's tasks.max_tasks
    from dice_ray.config import ModelConfig
    from dice_ray.policy.policy import DiffusionPolicy

    (run / "config.yaml").write_text(yaml.safe_dump({"tasks": {"max_tasks": 12}}))
    DiffusionPolicy.build(ModelConfig()).save(run / "checkpoints" / "step_000001" / "policy")
    out = tmp_path / "out"
    assert main(["eval", "--tasks", "builtin", "--model", str(run), "--split", "heldout", "--out", str(out),
                 "tasks.max_tasks=50", "sampling.max_new_tokens=16", "verify.mode=compile_only"]) == 0
    data = json.loads((out / "results.json").read_text())
    assert data["split"] == "heldout" and [t["task_id"] for t in data["tasks"]] == ids(split_tasks(every[:12], 0.2)[1])
    assert "by the run's split (tasks.spec=builtin:24, tasks.max_tasks=12" in capsys.readouterr().err


def test_eval_needs_one_source(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["eval", "--tasks", "builtin", "--out", str(tmp_path)])
    assert e.value.code == 2
    assert main(["eval", "--tasks", "builtin", "--solutions", str(tmp_path / "none"), "--out", str(tmp_path / "out")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_eval_model_cli(tmp_path, no_ray):
    from dice_ray.config import ModelConfig
    from dice_ray.policy.policy import DiffusionPolicy

    DiffusionPolicy.build(ModelConfig()).save(tmp_path / "policy")
    out = tmp_path / "out"
    rc = main(["eval", "--tasks", "builtin", "--model", str(tmp_path / "policy"), "--samples", "1", "--out", str(out),
               "tasks.max_tasks=2", "sampling.max_new_tokens=16", "verify.mode=compile_only"])
    assert rc == 0
    data = json.loads((out / "results.json").read_text())
    ids = [c["candidate_id"] for c in data["candidates"]]
    assert sorted(ids) == ["builtin/L1/gelu_tanh#0", "builtin/L1/relu#0"]
    assert all(c["verdict"]["candidate_id"] == c["candidate_id"] for c in data["candidates"])
    assert {c["verdict"]["task_id"] for c in data["candidates"]} == {"builtin/L1/relu", "builtin/L1/gelu_tanh"}
    assert (out / "results.md").is_file() and (out / "results.png").is_file()


def test_curate_without_gpu_exits_2(tmp_path, capsys, no_ray):
    out = tmp_path / "cuke.jsonl"
    rc = main(["curate", "--tasks", "builtin", "--min-speedup", "2.0", "--out", str(out), "verify.mode=compile_only"])
    err = capsys.readouterr().err
    assert rc == 2 and not out.exists()
    assert len(err.strip().splitlines()) == 1 and "speedups need a GPU verifier" in err


def test_curate_allow_compile_only(tmp_path, no_ray):
    out = tmp_path / "cuke.jsonl"
    rc = main(["curate", "--tasks", "builtin", "--out", str(out), "--allow-compile-only",
               "tasks.max_tasks=2", "verify.mode=compile_only"])
    assert rc == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["task_id"] for r in rows] == ["builtin/L1/relu", "builtin/L1/gelu_tanh"]
    assert all(r["speedup"] is None and r["mode"] == "compile_only" and r["hardware"] == COMPILE_ONLY_HARDWARE
               and r["verifier_config"]["mode"] == "compile_only" and "ModelNew" in r["solution"] for r in rows)
    assert (tmp_path / "cuke.jsonl.rejected.jsonl").read_text() == ""  # both kept: nothing left out


def test_curate_writes_why_each_left_out_solution_was_left_out(tmp_path, no_ray):
    """A cheating solution is not kept; the sidecar names its verdict and rule (compile-only verifier)."""
    from dice_ray.tasks.loaders import load_tasks

    relu = next(t for t in load_tasks("builtin").tasks if t.task_id == "builtin/L1/relu")
    cheat = relu.solution_src.replace("class ModelNew", "import threading\nLIVE = threading.active_count()\nclass ModelNew", 1)
    spec = tmp_path / "two.jsonl"
    spec.write_text("".join(json.dumps({"reference": relu.reference_src, "solution": sol, "id": i, "name": "relu"}) + "\n"
                            for i, sol in (("honest", relu.solution_src), ("threads", cheat))))
    out = tmp_path / "kept.jsonl"
    rc = main(["curate", "--tasks", f"jsonl:{spec}", "--out", str(out), "--allow-compile-only", "verify.mode=compile_only"])
    assert rc == 0
    assert [json.loads(line)["task_id"] for line in out.read_text().splitlines()] == ["jsonl-two/honest"]
    (left,) = [json.loads(line) for line in (tmp_path / "kept.jsonl.rejected.jsonl").read_text().splitlines()]
    assert left["task_id"] == "jsonl-two/threads" and left["verdict"] == "cheat" and left["why"] == "cheat"
    assert left["rule"] and left["reason"]


def test_eval_a_solution_file_that_is_not_utf8_gets_its_verdict_and_the_others_theirs(tmp_path, no_ray):
    sol = tmp_path / "sol"
    sol.mkdir()
    shutil.copy(BUILTIN_DIR / "L1_01_relu" / "solution.py", sol / "relu.py")
    (sol / "builtin__L1__gelu_tanh.py").write_bytes(b"import torch\n\xff\xfe garbage\n")  # was: the whole eval stopped
    out = tmp_path / "out"
    rc = main(["eval", "--tasks", "builtin", "--solutions", str(sol), "--out", str(out),
               "tasks.max_tasks=2", "verify.mode=compile_only"])
    assert rc == 0
    data = json.loads((out / "results.json").read_text())
    got = {c["task_id"]: (c["verdict"]["verdict"], c["verdict"]["reason"]) for c in data["candidates"]}
    assert got["builtin/L1/relu"][0] == "ok"
    assert got["builtin/L1/gelu_tanh"] == ("compile_error", "candidate is not UTF-8 text (invalid start byte at byte 13)")


@pytest.mark.parametrize("cmd", ["eval", "curate"])
def test_an_unusable_out_fails_before_any_verification(tmp_path, capsys, no_ray, monkeypatch, cmd):
    import dice_ray.eval.run as run

    def no_verifier(cfg):
        raise AssertionError("verification started before --out was checked")

    monkeypatch.setattr(run, "open_verifier", no_verifier)
    (tmp_path / "file").write_text("")
    for out, says in [(tmp_path / "file" / "x", "Not a directory" if cmd == "eval" else "is not a folder"),
                      *([(tmp_path, "is a folder, want a file")] if cmd == "curate" else [])]:
        args = (["eval", "--solutions", str(tmp_path)] if cmd == "eval" else ["curate", "--allow-compile-only"])
        assert main([*args, "--tasks", "builtin", "--out", str(out), "verify.mode=compile_only"]) == 2  # was a traceback
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"--out {out}: cannot" in err[0] and says in err[0], err


@pytest.mark.parametrize("value", ["inf", "nan", "0", "-1"])
def test_curate_min_speedup_must_be_finite_and_positive(tmp_path, capsys, no_ray, value):
    assert main(["curate", "--tasks", "builtin", "--min-speedup", value, "--out", str(tmp_path / "o.jsonl"),
                 "--allow-compile-only"]) == 2
    assert "--min-speedup must be a finite number > 0" in capsys.readouterr().err


def test_model_may_name_a_train_run_directory(tmp_path, capsys, no_ray):
    """--model RUN_DIR takes the newest checkpoint's policy; a run with none fails in one line before sampling."""
    from dice_ray.policy.policy import run_policy as policy_path

    run = tmp_path / "run"
    for step in ("step_000003", "step_000010"):
        (run / "checkpoints" / step / "policy").mkdir(parents=True)
    (run / "checkpoints" / "step_000011").mkdir()  # a checkpoint being written: no policy yet
    assert policy_path(run) == run / "checkpoints" / "step_000010" / "policy"
    assert policy_path(tmp_path / "policy") == tmp_path / "policy"  # not a run: as given
    (run / "model_config.json").write_text("{}")  # a policy of its own beside checkpoints/ (dice-ray sft --out)
    assert policy_path(run) == run
    empty = tmp_path / "empty"
    (empty / "checkpoints").mkdir(parents=True)
    rc = main(["eval", "--tasks", "builtin", "--model", str(empty), "--out", str(tmp_path / "out"), "verify.mode=compile_only"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1].startswith("dice-ray: error: model path") and "a dice-ray run directory with no checkpoint" in err[-1]
    assert not any("sampling" in line for line in err)


def test_the_plot_of_an_all_zero_evaluation_says_so_rather_than_stay_blank():
    """results.png of a run where nothing compiled (compile-only) or nothing was correct (measured): bars labelled 0%,
    and a sentence across the axes; a run with a compiled task has no such sentence."""
    import matplotlib.pyplot as plt

    from dice_ray.eval.report import figure

    def result(compiled: float, measured: bool) -> dict:
        level = {"compiled": compiled}
        return {"candidates": [], "tasks": [{"task_id": "t", "level": 1}], "hardware": "H100",
                "metrics": {"overall": {"measured": measured, "compiled": compiled}, "levels": {1: level}}}

    def texts(fig) -> list[str]:
        return [t.get_text() for t in fig.axes[0].texts]

    for compiled, said in ((0.0, True), (0.5, False)):
        fig = figure(result(compiled, measured=False))
        assert any("no task compiled" in t for t in texts(fig)) == said
        assert f"{compiled:.0%}" in texts(fig)  # each bar's label
        plt.close(fig)
    fig = figure(result(0.0, measured=True))
    assert any("fast_p is 0 at every p" in t for t in texts(fig))
    plt.close(fig)
