"""``dice-ray sft``: the warm start as a command (policy + metrics out, resumable, clear input errors)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dice_ray.cli import main
from dice_ray.cluster.trainer import Trainer
from dice_ray.config import DiceConfig, load_config
from dice_ray.policy.policy import DiffusionPolicy
from dice_ray.policy.sft import sft_data_pairs
from dice_ray.policy.sft_run import SFTRun
from dice_ray.policy.sft_warm_start import warm_start
from dice_ray.tasks.loaders import BUILTIN_DIR

TINY = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=1",
        "model.num_attention_heads=2", "model.num_key_value_heads=1", "model.head_dim=16"]
SMALL = [*TINY, "tasks.max_tasks=3", "sft.batch_size=2", "sft.warmup_steps=1", "sft.learning_rate=1e-2",
         "sft.log_every=1", "sft.num_threads=1", "sft.target_loss=null"]


def _sft(out: Path, *args: str) -> int:
    return main(["sft", "--out", str(out), *args])


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "sft_metrics.jsonl").read_text().splitlines()]


def _error_line(err: str) -> str:
    """The one ``dice-ray: error:`` line of stderr (progress lines may come before it)."""
    errors = [ln for ln in err.splitlines() if ln.startswith("dice-ray: error:")]
    assert len(errors) == 1 and err.strip().endswith(errors[0]), err
    return errors[0]


def test_sft_writes_the_trainers_warm_start_policy_and_metrics(tmp_path, capsys):
    out = tmp_path / "sft"
    assert _sft(out, "--data", "builtin", *SMALL, "sft.steps=4", "sft.checkpoint_every=2") == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["pairs"] == 6 and summary["steps"] == 4 and summary["train_command"] == f"dice-ray train model.path={out}"

    recs = _metrics(out)
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert all(r["loss"] > 0 and r["lr"] > 0 and r["tokens"] > 0 and r["tokens_per_s"] > 0 for r in recs)
    assert recs[-1]["loss"] < recs[0]["loss"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000002", "step_000004"]

    # the trainer starts from it: model.path loads the policy and skips its own warm start
    cfg = load_config(None, [*SMALL, "sft.steps=4", f"model.path={out}"])
    loaded = DiffusionPolicy.from_config(cfg.model)
    assert Trainer(cfg, tmp_path / "run")._warm_start() is False  # returns before touching the learner

    # the weights are those of the trainer's warm start on the same pairs, config and seed
    cfg.model.path = None
    pairs = sft_data_pairs("builtin", cfg)
    reference = DiffusionPolicy.from_config(cfg.model)
    initial = {k: v.clone() for k, v in reference.state_dict().items()}
    warm_start(reference, pairs, cfg.sft.model_copy(update={"cache_dir": str(tmp_path / "cache")}), cfg.rl.seed)
    for name, value in reference.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    assert not torch.equal(initial["model.embed_tokens.weight"], reference.state_dict()["model.embed_tokens.weight"])


def test_resume_after_a_crash_equals_a_straight_run(tmp_path, capsys, monkeypatch):
    args = ["--data", "builtin", *SMALL, "sft.steps=5", "sft.checkpoint_every=2"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert _sft(straight, *args) == 0

    real_step = SFTRun.train_step

    def crash_at_step_4(self):
        if self.step == 3:  # checkpoint at 2, step 3 taken and lost with the crash
            raise KeyboardInterrupt
        return real_step(self)

    monkeypatch.setattr(SFTRun, "train_step", crash_at_step_4)
    with pytest.raises(KeyboardInterrupt):
        _sft(resumed, *args)
    assert [r["step"] for r in _metrics(resumed)] == [1, 2, 3]
    monkeypatch.setattr(SFTRun, "train_step", real_step)
    capsys.readouterr()
    assert _sft(resumed, "--resume") == 0  # --data and config (checkpoint_every too) from the run folder
    assert json.loads(capsys.readouterr().out)["resumed_from"] == 2

    a, b = _metrics(straight), _metrics(resumed)
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5]
    assert [r["loss"] for r in a] == [r["loss"] for r in b] and [r["lr"] for r in a] == [r["lr"] for r in b]
    pa, pb = DiffusionPolicy.load(straight), DiffusionPolicy.load(resumed)
    for name, value in pa.state_dict().items():
        assert torch.equal(pb.state_dict()[name], value), name


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "case, message",
    [
        ("unknown-spec", "--data nope:x: tasks spec 'nope:x'"),
        ("missing-file", "does not exist"),
        ("unreadable-file", "no task accepted"),
        ("no-solution", "none with a reference solution to learn"),
        ("too-long", "exceed max_position_embeddings=128"),
        ("existing-run", "holds a dice-ray sft run already"),
        ("resume-nothing", "not a dice-ray sft run folder"),
        ("bad-key", "config: sft.stepz: unknown key"),
        ("zero-3", "sft.zero_stage"),
        ("out-under-a-file", "cannot create the folder (Not a directory)"),  # was a traceback after loading data
        ("damaged-run", "sft_run.json is damaged"),  # was the bare JSON error, no file named
    ],
)
def test_bad_input_exits_2_with_one_error_line(tmp_path, capsys, case, message):
    out = tmp_path / "out"
    reference = (BUILTIN_DIR / "L1_01_relu" / "reference.py").read_text()
    args = {
        "unknown-spec": ["--data", "nope:x"],
        "missing-file": ["--data", f"alpaca:{tmp_path / 'absent.json'}"],
        "unreadable-file": ["--data", f"alpaca:{_write(tmp_path / 'bad.json', '[{not json')}"],
        "no-solution": ["--data", f"jsonl:{_write(tmp_path / 'ref.jsonl', json.dumps({'reference': reference}))}"],
        "too-long": ["--data", "builtin", "model.max_position_embeddings=128"],
        "existing-run": ["--data", "builtin"],
        "resume-nothing": ["--resume"],
        "bad-key": ["--data", "builtin", "sft.stepz=3"],
        "zero-3": ["--data", "builtin", "sft.zero_stage=3"],
        "out-under-a-file": ["--data", "builtin"],
        "damaged-run": ["--resume"],
    }[case]
    if case == "out-under-a-file":
        _write(tmp_path / "file", "")
        out = tmp_path / "file" / "out"
    if case == "damaged-run":
        out.mkdir()
        (out / "sft_config.yaml").write_text("{}\n")
        (out / "sft_run.json").write_text('{"data": "builtin", "ke')
    if case == "existing-run":
        out.mkdir()
        (out / "sft_config.yaml").write_text("{}\n")
    assert _sft(out, *args, *TINY, "tasks.max_tasks=2", "sft.steps=2") == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    line = _error_line(captured.err)
    assert message in line, line
    if case == "unreadable-file":
        assert "bad-json" in line  # the loader's reason is named


def test_resume_with_changed_settings_names_the_keys(tmp_path, capsys):
    out = tmp_path / "sft"
    assert _sft(out, "--data", "builtin", *SMALL, "sft.steps=2") == 0
    capsys.readouterr()
    assert _sft(out, "--resume", "sft.steps=3", "sft.learning_rate=0.02") == 2
    line = _error_line(capsys.readouterr().err)
    assert "settings differ from the run's: sft.learning_rate " in line and "-> 0.02, sft.steps 2 -> 3;" in line, line
    assert _sft(out, "--resume", "sft.zero_stage=2") == 2  # a ZeRO-0 checkpoint does not load into ZeRO-2
    line = _error_line(capsys.readouterr().err)
    assert "settings differ from the run's: sft.zero_stage 0 -> 2;" in line, line


def _crash_at(monkeypatch, step: int) -> None:
    """Make SFTRun.train_step raise KeyboardInterrupt when the run has taken ``step`` steps."""
    real_step = SFTRun.train_step

    def crashing(self):
        if self.step == step:
            raise KeyboardInterrupt
        return real_step(self)

    monkeypatch.setattr(SFTRun, "train_step", crashing)


def test_zero2_with_accumulation_resumes_exactly_and_matches_the_warm_start(tmp_path, capsys, monkeypatch):
    args = ["--data", "builtin", *SMALL, "sft.steps=4", "sft.checkpoint_every=2", "sft.zero_stage=2",
            "sft.gradient_accumulation_steps=2", "sft.batch_size=1"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert _sft(straight, *args) == 0
    ckpt = straight / "checkpoints" / "step_000004"
    assert (ckpt / "sft_state.pt").is_file()
    assert (ckpt / "ds" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").is_file()  # ZeRO's optimizer state

    with monkeypatch.context() as m:
        _crash_at(m, 2)  # 2 steps, checkpoint, crash
        with pytest.raises(KeyboardInterrupt):
            _sft(resumed, *args)
    capsys.readouterr()
    assert _sft(resumed, "--resume") == 0  # 2 more steps from the DeepSpeed checkpoint
    assert json.loads(capsys.readouterr().out)["resumed_from"] == 2
    a, b = _metrics(straight), _metrics(resumed)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert [r["loss"] for r in a] == [r["loss"] for r in b] and [r["lr"] for r in a] == [r["lr"] for r in b]
    assert a[0]["lr"] == pytest.approx(1e-2) and a[1]["lr"] > a[2]["lr"] > a[3]["lr"]  # 1 warm-up step, cosine
    pa, pb = DiffusionPolicy.load(straight), DiffusionPolicy.load(resumed)
    for name, value in pa.state_dict().items():
        assert torch.equal(pb.state_dict()[name], value), name

    # ZeRO-2 and accumulation take the plain path's steps (up to ZeRO's own rounding of the clip norm)
    cfg = load_config(None, args[2:])
    reference = DiffusionPolicy.from_config(cfg.model)
    initial = reference.state_dict()["model.embed_tokens.weight"].clone()
    warm_start(reference, sft_data_pairs("builtin", cfg),
               cfg.sft.model_copy(update={"cache_dir": str(tmp_path / "cache")}), cfg.rl.seed)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(pa.state_dict()[name], value, rtol=1e-4, atol=1e-5, msg=name)
    assert not torch.allclose(initial, pa.state_dict()["model.embed_tokens.weight"], atol=1e-4)


def test_bf16_trains_through_deepspeeds_mixed_precision_optimizer(tmp_path, capsys):
    out = tmp_path / "sft"
    assert _sft(out, "--data", "builtin", *SMALL, "tasks.max_tasks=1", "model.dtype=bfloat16", "sft.steps=2") == 0
    recs = _metrics(out)
    assert len(recs) == 2 and all(0 < r["loss"] < 100 for r in recs)
    loaded = DiffusionPolicy.load(out)
    assert {v.dtype for v in loaded.state_dict().values() if v.is_floating_point()} == {torch.bfloat16}
    fresh = DiffusionPolicy.from_config(load_config(None, [*TINY, "model.dtype=bfloat16"]).model)
    assert not torch.equal(fresh.state_dict()["model.embed_tokens.weight"], loaded.state_dict()["model.embed_tokens.weight"])


@pytest.mark.gpu
def test_sft_on_the_gpu_with_nccl_zero2_bf16(tmp_path, capsys):
    out = tmp_path / "sft"
    assert _sft(out, "--data", "builtin", *SMALL, "model.dtype=bfloat16", "sft.zero_stage=2", "sft.steps=3") == 0
    assert torch.distributed.get_backend() == "nccl"
    recs = _metrics(out)
    assert len(recs) == 3 and all(0 < r["loss"] < 100 for r in recs)
    assert DiffusionPolicy.load(out).state_dict()["model.embed_tokens.weight"].dtype == torch.bfloat16


def test_the_last_progress_line_shows_the_final_loss(tmp_path, capsys):
    """The progress line's loss is the logged window's mean: the last one equals the summary's final_loss."""
    out = tmp_path / "sft"
    assert _sft(out, "--data", "builtin", *SMALL, "sft.steps=4", "sft.log_every=2") == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    lines = [ln for ln in captured.err.splitlines() if " loss " in ln and "step " in ln]
    assert [ln.split("step ")[1].split()[0] for ln in lines] == ["2/4", "4/4"], captured.err
    shown = float(lines[-1].split(" loss ")[1].split()[0])
    assert shown == round(summary["final_loss"], 4)
    recs = _metrics(out)
    assert abs(summary["final_loss"] - (recs[2]["loss"] + recs[3]["loss"]) / 2) < 1e-9  # the mean of steps 3-4


def test_data_defaults_to_the_configs_tasks_spec(tmp_path, capsys):
    out = tmp_path / "sft"
    assert _sft(out, *SMALL, "sft.steps=1") == 0
    assert json.loads(capsys.readouterr().out)["data"] == DiceConfig().tasks.spec == "builtin:24"
