"""`dice-ray report RUN_DIR` on finished, running and bad folders; the metric docs and the Grafana dashboard."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

import dice_ray.cluster.metrics as metrics_mod
from dice_ray.cli import main
from dice_ray.cluster.metrics import (
    METRICS,
    NAME_PREFIX,
    PROMETHEUS_PREFIX,
    RUN_TAG,
    RunMetrics,
)
from dice_ray.report import load_run, read_metrics

DASHBOARD = Path(__file__).resolve().parents[1] / "dashboards" / "dice_ray_grafana.json"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ---- a run directory as `dice-ray train` writes it --------------------------------------------------
def _record(step: int, phase: str, frac: float, reward: float, compile_rate: float, correct=None, speedup=None) -> dict:
    """A metrics.jsonl line with the fields of trainer.step_record plus Trainer.train_step's extras."""
    return {
        "step": step, "phase": phase, "infill_fraction": frac, "reward_mean": reward, "reward_std": 0.1,
        "compile_rate": compile_rate, "correct_rate": correct, "cheat_rate": 0.0, "speedup_geomean": speedup,
        "verdicts": {"ok": 2, "compile_error": 2}, "candidates": 4, "groups": 2, "groups_dropped": 1,
        "verifier_mode": "compile_only", "loss": -0.01 * (step + 1), "clip_fraction": 0.0, "kl": None,
        "learner_step_seconds": 0.5, "rollout_seconds": 1.0, "verify_seconds": 2.0, "learn_seconds": 0.5,
        "sync_seconds": 0.5, "rollout_tokens_per_s": 100.0, "verifier_throughput": 2.0, "verifier_queue_depth": 0,
        "verifier_pool_size": 2, "weights_version": step + 1, "step_seconds": 4.0,
    }


def _run_dir(root: Path, name: str, planned: int, records: list[dict], tail: str = "", summary: dict | None = None) -> Path:
    run = root / name
    run.mkdir()
    cfg = {"run_name": None, "tasks": {"spec": "builtin"}, "rl": {"steps": planned, "prompts_per_step": 2, "num_generations": 2},
           "phase": {"infill_steps": 2, "ramp_steps": 0}, "verify": {"mode": "compile_only"}}
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    if summary is not None:
        (run / "summary.json").write_text(json.dumps(summary))
    return run


def _report(capsys, *args) -> tuple[int, str, str]:
    rc = main(["report", *map(str, args)])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_report_of_a_finished_run(tmp_path, capsys):
    recs = [_record(0, "infill", 1.0, 0.2, 0.5), _record(1, "infill", 1.0, 0.4, 0.75),
            _record(2, "e2e", 0.0, 0.6, 1.0, correct=0.5, speedup=1.5), _record(3, "e2e", 0.0, 0.8, 1.0, correct=1.0, speedup=2.0)]
    summary = {"steps": 4, "seconds": 120.0,
               "heldout_start": {"e2e": {"candidates": 4, "compile_rate": 0.25, "correct_rate": None}},
               "heldout_end": {"e2e": {"candidates": 4, "compile_rate": 0.75, "correct_rate": None}},
               "train_start": {"infill": {"candidates": 8, "reward_mean": 0.25, "compile_rate": 0.5, "correct_rate": None}},
               "train_end": {"infill": {"candidates": 8, "reward_mean": 0.625, "compile_rate": 0.75, "correct_rate": None}}}
    run = _run_dir(tmp_path, "done", 4, recs, summary=summary)
    out = tmp_path / "out"
    rc, stdout, _ = _report(capsys, run, "--out", out)
    assert rc == 0
    md = (out / "report.md").read_text()
    assert md == stdout
    assert (out / "curves.png").read_bytes()[:8] == PNG_MAGIC
    assert not (run / "report.md").exists()  # --out was honoured
    assert "# dice-ray run `done`" in md and "still running" not in md and "finished, the last session in 2.0 min" in md
    assert "Steps done: **4** / 4 planned (100%)" in md
    assert "| infill | 0-1 (2) | 1.00 -> 1.00 | 0.300 |" in md
    assert "| e2e | 2-3 (2) | 0.00 -> 0.00 | 0.700 |" in md
    assert "| compile rate | 50.0% | 100.0% | 81.2% | 50.0% | 100.0% |" in md
    # None steps left out; a first value from a later step than the run's first says its step
    assert "| correct rate | 50.0% (step 2) | 100.0% | 75.0% | 50.0% | 100.0% |" in md
    assert "| speedup (geomean) | 1.50x (step 2) | 2.00x | 1.75x | 1.50x | 2.00x |" in md
    assert "| verify | 2.00 | 50% |" in md and "| whole step | 4.00 | 100% |" in md and "Asynchronous" not in md
    assert "## Held-out tasks" in md and "| end | e2e | 4 | n/a | 75.0% | n/a |" in md
    assert "## Training prompts (fixed seeds)" in md and "| end | infill | 8 | 0.625 | 75.0% | n/a |" in md
    assert "Groups dropped (equal rewards): 4." in md and "`rl.steps` | `4`" in md


def test_report_of_an_async_run_explains_stage_times_longer_than_the_step(tmp_path, capsys):
    recs = [_record(i, "infill", 1.0, 0.2, 0.5) | {"staleness_max": min(i, 2), "staleness_mean": min(i, 2) * 0.75,
                                                   "rollout_seconds": 9.0, "rollout_busy_share": 0.9}
            for i in range(3)]
    rc, md, _ = _report(capsys, _run_dir(tmp_path, "async", 3, recs), "--out", tmp_path / "out")
    assert rc == 0
    assert "Asynchronous run (samples up to 2 learner step(s) stale)" in md
    assert "| rollout | 9.00 | 225% |" in md  # longer than the step: it started steps earlier
    assert "- Staleness (learner steps a sample's weights lag): mean 0.75, max 2." in md
    sync = [_record(i, "infill", 1.0, 0.2, 0.5) | {"staleness_max": 0, "staleness_mean": 0.0} for i in range(2)]
    _, md, _ = _report(capsys, _run_dir(tmp_path, "sync", 2, sync), "--out", tmp_path / "out2")
    assert "Asynchronous" not in md and "Staleness" not in md


def test_report_of_a_running_run_with_a_torn_last_line(tmp_path, capsys):
    recs = [_record(i, "infill", 1.0, 0.1 * i, 0.5) for i in range(3)]
    torn = json.dumps(_record(3, "ramp", 0.5, 0.9, 0.9))[:57]  # the trainer is mid-write
    run = _run_dir(tmp_path, "going", 10, recs, tail=torn)
    rc, stdout, err = _report(capsys, run)
    assert rc == 0, err
    md = (run / "report.md").read_text()  # default --out is the run directory
    assert md == stdout
    assert (run / "curves.png").read_bytes()[:8] == PNG_MAGIC
    assert md.startswith("# dice-ray run `going` (still running)")
    assert "no summary.json yet" in md
    assert "Steps done: **3** / 10 planned (30%)" in md
    assert "Skipped 1 incomplete line(s)" in md
    assert "ramp" not in md.split("## Phase timeline")[1].split("## Rates")[0]
    assert "| correct rate | n/a | n/a | n/a | n/a | n/a |" in md  # compile-only: never measured
    assert "## Held-out" not in md


def test_report_of_a_resumed_run_still_going_is_not_finished(tmp_path, capsys):
    """`train --resume` leaves the first session's summary.json until it ends: steps written since mean running."""
    recs = [_record(i, "infill", 1.0, 0.1 * i, 0.5) for i in range(11)]
    run = _run_dir(tmp_path, "resumed", 12, recs, summary={"steps": 10, "seconds": 60.0})
    rc, md, _ = _report(capsys, run, "--out", tmp_path / "out")
    assert rc == 0 and md.startswith("# dice-ray run `resumed` (still running)")
    assert "summary.json is an earlier session's" in md and "Status: finished" not in md
    (run / "summary.json").write_text(json.dumps({"steps": 11, "seconds": 30.0}))  # the resumed session ended
    _, md, _ = _report(capsys, run, "--out", tmp_path / "out")
    assert "still running" not in md and "Status: finished, the last session in 0.5 min" in md


def test_report_of_a_run_with_no_step_yet(tmp_path, capsys):
    run = _run_dir(tmp_path, "fresh", 5, [])
    (run / "metrics.jsonl").unlink()  # set-up done (config.yaml written), first step not finished
    rc, stdout, _ = _report(capsys, run)
    assert rc == 0
    assert "(still running)" in stdout and "Steps done: **0** / 5 planned (0%)" in stdout and "No step finished yet." in stdout
    assert (run / "curves.png").is_file()


@pytest.mark.parametrize("kind", ["missing", "empty", "file"])
def test_report_of_a_bad_folder_exits_2_with_one_line(tmp_path, capsys, kind):
    target = tmp_path / "nope"
    if kind == "empty":
        target.mkdir()
    elif kind == "file":
        target.write_text("x")
    rc, stdout, err = _report(capsys, target)
    assert rc == 2 and stdout == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith("dice-ray: error: ") and str(target) in err
    assert ("not a folder" if kind != "empty" else "no config.yaml nor metrics.jsonl") in err
    assert not (tmp_path / "curves.png").exists() and not (target / "report.md").exists()


def test_read_metrics_keeps_every_whole_record_whatever_the_cut(tmp_path):
    recs = [_record(0, "infill", 1.0, 0.2, 0.5), _record(1, "ramp", 0.5, 0.3, 0.6)]
    last = json.dumps(_record(2, "e2e", 0.0, 0.4, 0.7))
    for cut in range(0, len(last), 7):
        (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs) + last[:cut])
        assert read_metrics(tmp_path) == recs, cut
        assert load_run(tmp_path).skipped_lines == (1 if cut else 0)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs) + last + "\n")
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2]


# ---- metric names: docs == code == dashboard ---------------------------------------------------------
def _documented_names() -> list[str]:
    """The ``dice_ray_*`` names of the reST table in dice_ray/cluster/metrics.py's docstring."""
    return re.findall(r"^``(dice_ray_\w+)``\s+\S", metrics_mod.__doc__, flags=re.MULTILINE)


def test_documented_metric_list_equals_the_registered_gauges(monkeypatch):
    made = []

    class FakeGauge:
        def __init__(self, name, description="", tag_keys=()):
            made.append((name, tuple(tag_keys)))

    monkeypatch.setattr(metrics_mod, "Gauge", FakeGauge)
    RunMetrics("r")
    documented = _documented_names()
    assert len(documented) == len(set(documented)) >= 10
    assert sorted(documented) == sorted(name for name, _ in made) == sorted(NAME_PREFIX + k for k in METRICS)
    assert {tags for _, tags in made} == {(RUN_TAG,)}


PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset"}


def _promql_parts(expr: str) -> tuple[set[str], set[str]]:
    """(metric names, label names used in matchers) of a PromQL expression (Grafana variables allowed)."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    labels = {m for block in re.findall(r"\{([^}]*)\}", s) for m in re.findall(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)", block)}
    s = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", s)
    s = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    s = re.sub(r"\$\w+|\b\d+(?:\.\d+)?(?:[eE][+-]?\d+)?\b", " ", s)
    names = {m.group(1) for m in re.finditer(r"([A-Za-z_:][\w:]*)\s*(\()?", s) if not m.group(2)} - PROMQL_WORDS
    return names, labels


def test_promql_parser_sees_metric_names_and_labels():
    names, labels = _promql_parts('max by (run) (rate(ray_x{SessionName=~"$S", run="a"}[5m])) / on (run) y_total > 2')
    assert names == {"ray_x", "y_total"} and labels == {"SessionName", "run"}


def _pool_gauge_names() -> list[str]:
    """The ``dice_ray_verifier_pool_*`` names of the reST table in dice_ray/cluster/verifier_pool.py's docstring
    (the pool actor's own gauges, tag ``pool``)."""
    from dice_ray.cluster import verifier_pool

    return re.findall(r"^``(dice_ray_verifier_pool_\w+)``\s+\S", verifier_pool.__doc__, flags=re.MULTILINE)


def test_grafana_dashboard_uses_only_documented_prometheus_names():
    """Every documented gauge, the run's (tag ``run``) and the verifier pool's (tag ``pool``), has a panel, and the
    panels name no other metric or label."""
    dash = json.loads(DASHBOARD.read_text())
    pool_names = {PROMETHEUS_PREFIX + n for n in _pool_gauge_names()}
    assert len(pool_names) == 6
    allowed = {PROMETHEUS_PREFIX + n for n in _documented_names()} | pool_names
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    assert panels and len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    seen: set[str] = set()
    for p in panels:
        assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
        for t in p["targets"]:
            names, labels = _promql_parts(t["expr"])
            assert names and names <= allowed, (p["title"], t["expr"])
            assert labels <= ({"pool", "SessionName"} if names <= pool_names else {RUN_TAG, "SessionName"}), t["expr"]
            seen |= names
    assert seen == allowed  # every documented metric has a panel
    for var in ("SessionName", "run"):
        metric = re.match(r"label_values\((\w+)", variables[var]["query"]["query"]).group(1)
        assert metric in allowed


def test_report_config_keys_exist_in_the_config_model():
    from dice_ray.config import load_config
    from dice_ray.report import CONFIG_KEYS

    tree = load_config(None, []).model_dump(mode="json")
    for key in CONFIG_KEYS:
        node = tree
        for part in key.split("."):
            assert isinstance(node, dict) and part in node, f"report.CONFIG_KEYS: {key} is not a config key"
            node = node[part]


def test_report_to_an_unwritable_out_exits_2(tmp_path, capsys):
    run = _run_dir(tmp_path, "r", 2, [_record(0, "infill", 1.0, 0.1, 0.5)])
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    rc, stdout, err = _report(capsys, run, "--out", blocker)
    assert rc == 2 and stdout == "" and err.startswith(f"dice-ray: error: report: cannot write to {blocker}")


@pytest.mark.parametrize("config, says", [(b"\xff\xfe", "invalid start byte"),  # was a traceback
                                          (b"rl: [\n", "config.yaml: unreadable (line 2, column 1: expected the node")])
def test_report_of_a_damaged_config_names_file_and_line(tmp_path, capsys, config, says):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_bytes(config)
    (run / "metrics.jsonl").write_text('{"step": 0, "reward_mean": 0.1}\n')
    rc, _, err = _report(capsys, run)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and says in err, err


def test_report_skips_damaged_metrics_lines_and_summary(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("rl:\n  steps: 3\n")
    (run / "metrics.jsonl").write_bytes(b'{"step": 0, "reward_mean": 0.1}\n\xff{\n' + b"[" * 100_000 + b"\n")
    (run / "summary.json").write_bytes(b"\xff{")  # was a UnicodeDecodeError traceback
    rc, stdout, _ = _report(capsys, run)
    assert rc == 0 and "(still running)" in stdout


def test_report_of_the_runs_folder_names_the_runs_in_it(tmp_path, capsys):
    """`dice-ray report runs` (the parent of the run directories): one line listing them and the command for the newest."""
    for name in ("20261201-101010", "20261201-121212"):
        _run_dir(tmp_path, name, 2, [_record(0, "infill", 1.0, 0.1, 0.5)])
    rc, stdout, err = _report(capsys, tmp_path)
    assert rc == 2 and stdout == "" and len(err.strip().splitlines()) == 1
    assert "run directories in it: 20261201-101010, 20261201-121212" in err
    assert f"(dice-ray report {tmp_path / '20261201-121212'})" in err


def test_pool_gauge_table_equals_the_registered_gauges(monkeypatch):
    """The verifier pool's gauges (dice_ray/cluster/verifier_pool.py's table) are the ones it registers."""
    import ray.util.metrics

    from dice_ray.cluster import verifier_pool

    made = []

    class FakeGauge:
        def __init__(self, name, description="", tag_keys=()):
            made.append((name, tuple(tag_keys)))

    monkeypatch.setattr(ray.util.metrics, "Gauge", FakeGauge)
    gauges = verifier_pool._make_gauges()
    documented = re.findall(r"^``(dice_ray_verifier_pool_\w+)``\s+\S", verifier_pool.__doc__, flags=re.MULTILINE)
    assert sorted(documented) == sorted(name for name, _ in made) and len(gauges) == len(made) == 6
    assert {tags for _, tags in made} == {("pool",)}


def test_report_says_the_step_of_a_last_value_when_the_last_step_had_none(tmp_path, capsys):
    """The last step dropped every group (no learner update, loss None): "last" is step 1's loss, and says so."""
    recs = [_record(0, "infill", 1.0, 0.2, 0.5), _record(1, "infill", 1.0, 0.3, 0.5), _record(2, "infill", 1.0, 0.0, 0.5)]
    recs[2]["loss"] = None
    rc, md, _ = _report(capsys, _run_dir(tmp_path, "dropped", 3, recs), "--out", tmp_path / "out")
    assert rc == 0
    assert "| policy loss | -1.000e-02 | -2.000e-02 (step 1) |" in md
