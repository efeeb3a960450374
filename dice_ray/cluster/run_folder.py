"""A run's folder before and after its sessions: a new folder for a new run (never one that holds a run), the
config of ``--resume`` checked against the run before anything starts, and the marker of a session that ended early
(``stopped.json``, read by ``dice-ray report``)."""

from __future__ import annotations

import json
import time
from datetime import datetime
from pathlib import Path

from dice_ray.cluster.checkpoint import newest_checkpoint_tag
from dice_ray.cluster.storage import CheckpointStore, run_store_url
from dice_ray.config import DiceConfig, load_config
from dice_ray.report import STOPPED_FILE, read_metrics

#: what a folder holds once a run used it (a second run there would append to its metrics, overwrite its config and
#: rotate its checkpoints away)
RUN_FILES = ("config.yaml", "metrics.jsonl", "checkpoints")


def new_run_dir(cfg: DiceConfig) -> Path:
    """``cfg.run_dir / (run_name or a timestamp)``: a folder no run has used.  A timestamp another run took (two
    runs started in the same second) gets ``-2``, ``-3``, ...

    Raises:
        ValueError: ``run_name`` names a folder that holds a run (:data:`RUN_FILES`); the message gives the
            ``--resume`` command that continues it.
    """
    root = Path(cfg.run_dir).expanduser().resolve()
    if cfg.run_name:
        path = root / cfg.run_name
        used = [f for f in RUN_FILES if (path / f).exists()]
        if used:
            raise ValueError(f"run_name={cfg.run_name}: {path} already holds a run ({', '.join(used)}); "
                             f"`dice-ray train --resume {path}` continues it, another run_name starts a new one")
        return path
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    path, n = root / stamp, 2
    while path.exists():
        path, n = root / f"{stamp}-{n}", n + 1
    return path


#: config sections a resume cannot change: the checkpoint's policy (family, shape, weights) and the task list whose
#: order and split the phase scheduler's saved position indexes
RESUME_FIXED = ("model", "tasks")


def resume_config(run_dir: Path, overrides: list[str]) -> DiceConfig:
    """The config of ``dice-ray train --resume RUN_DIR key=value ...``: the run's ``config.yaml`` with the overrides,
    checked against the run before anything is started or written.

    Raises:
        FileNotFoundError: ``run_dir`` has no ``config.yaml`` (not a dice-ray run directory).
        pydantic.ValidationError / ValueError: a bad key or value; an override of a :data:`RESUME_FIXED` section
            (naming the field, its value in the run and the one asked for); ``rl.steps`` not above the steps the
            run's newest checkpoint holds (nothing to do).
    """
    cfg_file = run_dir / "config.yaml"
    if not cfg_file.exists():
        raise FileNotFoundError(f"--resume {run_dir}: no config.yaml (not a dice-ray run directory)")
    saved, cfg = load_config(cfg_file, []), load_config(cfg_file, overrides)
    for section in RESUME_FIXED:
        was, now = getattr(saved, section).model_dump(), getattr(cfg, section).model_dump()
        changed = [k for k in now if now[k] != was.get(k)]
        if changed:
            k = changed[0]
            raise ValueError(f"--resume {run_dir}: {section}.{k} cannot change on resume (the run has {was.get(k)!r}, "
                             f"asked {now[k]!r}): the checkpoint's policy and the scheduler's task position depend on "
                             f"the {section} section; start a new run for another")
    store = CheckpointStore(run_store_url(cfg.storage_path, run_dir.name)) if cfg.storage_path else None
    tag = newest_checkpoint_tag(store, run_dir / "checkpoints")
    done = int(tag.removeprefix("step_")) if tag and tag.removeprefix("step_").isdigit() else None
    if done is not None and cfg.rl.steps <= done:
        raise ValueError(f"--resume {run_dir}: rl.steps={cfg.rl.steps}, and its newest checkpoint ({tag}) already holds "
                         f"{done} steps: nothing to do; pass rl.steps={done + 1} or more to train longer")
    return cfg


def mark_stopped(run_dir: Path, reason: str, steps: int) -> int:
    """Write ``run_dir/stopped.json`` (:data:`~dice_ray.report.STOPPED_FILE`, read by ``dice-ray report``): the
    session ended early for ``reason`` (``interrupted``, or the error's line). Returns the steps done (records of
    ``metrics.jsonl``). Nothing is written where the run folder was never made (set-up failed before it)."""
    if not run_dir.is_dir():
        return 0
    done = len(read_metrics(run_dir)) if (run_dir / "metrics.jsonl").is_file() else 0
    (run_dir / STOPPED_FILE).write_text(json.dumps({"reason": reason, "steps_done": done, "steps": steps,
                                                    "time": time.time()}, indent=1))
    return done
