"""A run's checkpoints: saved after a step, copied to ``storage_path``, and chosen for ``--resume``.

A checkpoint is the folder ``RUN_DIR/checkpoints/step_NNNNNN`` (NNNNNN steps done): the learner's DeepSpeed
checkpoint and policy, then ``state.json`` (the step and the phase scheduler's state), written last, its completeness
marker. With ``storage_path`` it is copied to the run's :class:`~dice_ray.cluster.storage.CheckpointStore` and only
the newest stays staged locally.

``--resume`` takes the newest valid checkpoint of the two places (:func:`resume_point`): storage's newest complete
one (fetched), or the local folder's when that one is newer (an upload that never happened: the run ended in the
copy, storage was unreachable, or ``memory://`` storage, which lives only in the process that wrote it).
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from dice_ray.cluster.storage import MARKER, TAG_RE, CheckpointStore


def checkpoint_tag(step: int) -> str:
    """``step_NNNNNN``: the tag of the checkpoint taken after ``step`` steps."""
    return f"step_{step:06d}"


def read_state(state_path: Path) -> dict | None:
    """A checkpoint's ``state.json`` when it is valid: a JSON object whose ``step`` is the step its folder's tag
    names; None otherwise (missing, unreadable, or another step)."""
    try:
        state = json.loads(state_path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        return None
    return state if checkpoint_tag(state["step"]) == state_path.parent.name else None


def local_tags(ckpt_dir: Path) -> list[str]:
    """Tags of the valid complete checkpoints under ``ckpt_dir`` (:func:`read_state`), oldest first."""
    if not ckpt_dir.is_dir():
        return []
    return sorted(p.parent.name for p in ckpt_dir.glob(f"step_*/{MARKER}")
                  if TAG_RE.match(p.parent.name) and read_state(p) is not None)


def newest_checkpoint_tag(store: CheckpointStore | None, ckpt_dir: Path) -> str | None:
    """Tag (``step_NNNNNN``) of a run's newest complete checkpoint, in ``store`` (a run with ``storage_path``) or
    under ``ckpt_dir``, whichever is newer; None when there is none."""
    tags = local_tags(ckpt_dir) + (store.tags() if store is not None else [])
    return max(tags) if tags else None


def save_checkpoint(learner: Any, scheduler: Any, ckpt_dir: Path, store: CheckpointStore | None, keep: int,
                    step: int, schedule: dict | None = None) -> str:
    """Save the learner and the scheduler state as ``step_{step:06d}`` under ``ckpt_dir``; with ``store``, copy it
    there. Returns the tag.

    Args:
        learner: the :class:`~dice_ray.cluster.learner.LearnerGroup` (its ``save`` writes the folder).
        scheduler: the phase scheduler actor (its state, with every figure seen so far, goes into ``state.json``).
        keep: checkpoints kept (``keep_checkpoints``): in ``store`` with one (then only the newest stays staged
            under ``ckpt_dir``), else under ``ckpt_dir``.
        schedule: the state to save instead of the scheduler's own, when batches were drawn ahead of the learner.
    """
    tag = checkpoint_tag(step)
    ray.get(learner.save.remote(str(ckpt_dir), tag))
    now = ray.get(scheduler.get_state.remote())
    # a batch drawn ahead is drawn again on resume (its state before the draw), with every figure seen so far
    schedule = {**schedule, "figures": now["figures"]} if schedule is not None else now
    state = {"step": step, "schedule": schedule, "time": time.time()}
    (ckpt_dir / tag / MARKER).write_text(json.dumps(state, indent=1))  # the completeness marker, last
    keep_local = keep
    if store is not None:  # storage_path: copy it there, keep the last K there, only the newest staged
        store.upload(ckpt_dir / tag)
        store.prune(keep)
        keep_local = 1
    tags = sorted(p for p in ckpt_dir.iterdir() if p.is_dir() and (p / MARKER).exists())
    for old in tags[:-keep_local]:
        shutil.rmtree(old, ignore_errors=True)
    return tag


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a resume starts from.

    Attributes:
        state_path: its ``state.json``, on local disk (fetched from storage when it came from there).
        state: that file's contents (``step``, ``schedule``).
        source: ``"storage"`` or ``"local"``.
        line: one console line: which checkpoint was taken, from where, and why.
    """

    state_path: Path
    state: dict
    source: str
    line: str


#: why a ``memory://`` store is empty in a new process
MEMORY_NOTE = ("a memory:// storage_path (fsspec's in-memory filesystem) lives only in the process that wrote it: a new "
               "process, as this --resume is, never sees the checkpoints an earlier one copied there; a folder or an "
               "s3:// / gs:// URL keeps them across processes")


def resume_point(store: CheckpointStore | None, ckpt_dir: Path, run_dir: Path) -> ResumePoint:
    """The newest valid checkpoint of a run: in ``store`` (fetched to ``ckpt_dir``) or under ``ckpt_dir``, whichever
    is newer (storage's on a tie: the fetch keeps a staged copy that is the same checkpoint). A checkpoint whose
    ``state.json`` is not valid (:func:`read_state`) is passed over for the next newest.

    Raises:
        FileNotFoundError: no valid checkpoint in either place; with an empty ``memory://`` store the message says
            that such a store lives only in the process that wrote it (:data:`MEMORY_NOTE`).
    """
    local = local_tags(ckpt_dir)
    remote = store.tags() if store is not None else []
    if store is None:
        where_none = f"no checkpoint under {ckpt_dir}"
    else:
        where_none = f"no complete checkpoint under {store.url} nor under {ckpt_dir}"
        if not remote and store.in_memory:
            where_none += f" ({MEMORY_NOTE})"
    candidates = sorted([(t, 1, "storage") for t in remote] + [(t, 0, "local") for t in local], reverse=True)
    for tag, _, source in candidates:
        if source == "storage":
            state_path = store.fetch(tag, ckpt_dir) / MARKER
        else:
            state_path = ckpt_dir / tag / MARKER
        state = read_state(state_path)
        if state is None:
            continue
        if store is None:
            line = f"[bold]checkpoint[/] {tag} from {ckpt_dir}"
        elif source == "storage":
            here = f"its newest is {max(local)}" if local else "it holds none"
            line = f"[bold]storage[/] fetched {tag} from {store.url}: the newest complete checkpoint ({ckpt_dir}: {here})"
        elif remote:
            line = (f"[bold]checkpoint[/] {tag} from {ckpt_dir} (local disk): newer than the newest complete one under "
                    f"storage_path {store.url}, {max(remote)}")
        else:
            line = (f"[bold]checkpoint[/] {tag} from {ckpt_dir} (local disk): storage_path {store.url} holds no "
                    "complete checkpoint" + (f"; {MEMORY_NOTE}" if store.in_memory else ""))
        return ResumePoint(state_path, state, source, line)
    raise FileNotFoundError(f"--resume {run_dir}: {where_none}")
