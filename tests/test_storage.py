"""Checkpoints to a storage_path (a folder or an fsspec URL), the last K kept (issue 6)."""

import json
import shutil
import uuid
from types import SimpleNamespace

import fsspec
import pytest
from pydantic import ValidationError

from dice_ray.cluster.storage import (
    MARKER,
    CheckpointStore,
    check_storage_url,
    run_store_url,
)
from dice_ray.config import load_config


def _stage(parent, step, payload=b"weights"):
    """A staged checkpoint folder like the learner + trainer write: files, a sub-folder, state.json."""
    d = parent / f"step_{step:06d}"
    (d / "policy").mkdir(parents=True)
    (d / "mp_rank_00_model_states.pt").write_bytes(payload + bytes([step]))
    (d / "policy" / "config.json").write_text(json.dumps({"step": step}))
    (d / MARKER).write_text(json.dumps({"step": step, "schedule": {"i": step}}))
    return d


@pytest.fixture(params=["memory", "file"])
def url(request, tmp_path):
    if request.param == "memory":
        u = f"memory://dice-ray-test/{uuid.uuid4().hex}/run"
        yield u
        fs = fsspec.filesystem("memory")
        fs.rm(u.split("://", 1)[1].rsplit("/", 1)[0], recursive=True)
    else:
        yield f"file://{tmp_path / 'store' / 'run'}"


def test_upload_list_fetch_round_trip(url, tmp_path):
    store = CheckpointStore(url)
    assert store.tags() == [] and store.latest() is None
    for step in (1, 2):
        store.upload(_stage(tmp_path / "staging", step))
    assert store.tags() == ["step_000001", "step_000002"] and store.latest() == "step_000002"

    got = store.fetch("step_000001", tmp_path / "resume")
    assert got == tmp_path / "resume" / "step_000001"
    assert (got / "mp_rank_00_model_states.pt").read_bytes() == b"weights\x01"
    assert json.loads((got / "policy" / "config.json").read_text()) == {"step": 1}
    assert json.loads((got / MARKER).read_text())["schedule"] == {"i": 1}
    with pytest.raises(FileNotFoundError, match="step_000009"):
        store.fetch("step_000009", tmp_path / "resume")


def test_keep_last_k(url, tmp_path):
    store = CheckpointStore(url)
    for step in range(1, 6):
        store.upload(_stage(tmp_path / "staging", step))
        store.prune(2)
    assert store.tags() == ["step_000004", "step_000005"]
    with pytest.raises(ValueError, match="keep=0"):
        store.prune(0)


def test_checkpoint_without_marker_is_ignored_and_pruned(url, tmp_path):
    store = CheckpointStore(url)
    store.upload(_stage(tmp_path / "staging", 1))
    store.upload(_stage(tmp_path / "staging", 3))
    # a copy cut short before its marker: step 2 (older than the newest complete) and step 4 (newer)
    for step in (2, 4):
        part = store._remote(f"step_{step:06d}", "mp_rank_00_model_states.pt")
        store.fs.makedirs(part.rsplit("/", 1)[0], exist_ok=True)
        store.fs.pipe_file(part, b"half")
    assert store.tags() == ["step_000001", "step_000003"] and store.latest() == "step_000003"
    with pytest.raises(FileNotFoundError, match="step_000004"):
        store.fetch("step_000004", tmp_path / "resume")
    assert store.prune(1) == ["step_000001", "step_000002"]  # step 4 may still be in flight: left alone
    names = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in store.fs.ls(store.root, detail=False))
    assert names == ["step_000003", "step_000004"]


def test_marker_is_copied_last_and_stale_copy_replaced(tmp_path, monkeypatch):
    store = CheckpointStore(f"file://{tmp_path / 'store'}")
    staged = _stage(tmp_path / "staging", 7)
    stale = tmp_path / "store" / "step_000007"
    stale.mkdir(parents=True)
    (stale / "leftover.bin").write_bytes(b"old")
    order = []
    put = store.fs.put_file
    monkeypatch.setattr(store.fs, "put_file", lambda lp, rp, **kw: (order.append(rp.rsplit("/", 1)[-1]), put(lp, rp, **kw)))
    store.upload(staged)
    assert order[-1] == MARKER and len(order) == 3
    assert not (stale / "leftover.bin").exists()


def test_fetch_keeps_identical_staged_copy(tmp_path):
    store = CheckpointStore(str(tmp_path / "store"))  # a plain path works too
    staged = _stage(tmp_path / "staging", 1)
    store.upload(staged)
    (staged / "mp_rank_00_model_states.pt").write_bytes(b"local")  # same marker: the same checkpoint
    assert store.fetch("step_000001", tmp_path / "staging") == staged
    assert (staged / "mp_rank_00_model_states.pt").read_bytes() == b"local"
    (staged / MARKER).write_text("{}")  # a different marker: download over it
    store.fetch("step_000001", tmp_path / "staging")
    assert (staged / "mp_rank_00_model_states.pt").read_bytes() == b"weights\x01"


def test_upload_refuses_incomplete_or_misnamed(tmp_path):
    store = CheckpointStore(f"memory://dice-ray-test/{uuid.uuid4().hex}")
    d = tmp_path / "step_000001"
    d.mkdir()
    with pytest.raises(FileNotFoundError, match=MARKER):
        store.upload(d)
    bad = tmp_path / "final"
    bad.mkdir()
    (bad / MARKER).write_text("{}")
    with pytest.raises(ValueError, match="step_NNNNNN"):
        store.upload(bad)


def test_config_storage_path_validated():
    assert load_config(None, []).storage_path is None
    assert load_config(None, ["storage_path=memory://b/runs"]).storage_path == "memory://b/runs"
    with pytest.raises(ValidationError, match="nosuchproto"):
        load_config(None, ["storage_path=nosuchproto://b/runs"])
    with pytest.raises(ValidationError, match="non-empty"):
        load_config(None, ["storage_path=' '"])
    with pytest.raises(ValueError, match="non-empty"):
        check_storage_url("")
    with pytest.raises(ValidationError, match="one slash after its protocol"):  # a typo, not a folder named "s3:"
        load_config(None, ["storage_path=s3:/bucket/runs"])
    assert load_config(None, ["storage_path=runs:v2"]).storage_path == "runs:v2"  # a colon in a folder name is fine
    assert run_store_url("s3://b/runs/", "r1") == "s3://b/runs/r1"


class _Remote:
    def __init__(self, fn):
        self.remote = fn


def test_trainer_checkpoints_to_storage_and_resumes_from_it(tmp_path, monkeypatch):
    """Trainer.checkpoint / _restore with storage_path, the Ray actors replaced by stand-ins."""
    from dice_ray.cluster import trainer as tr

    monkeypatch.setattr(tr.ray, "get", lambda x, **kw: x)
    saved, loaded = [], []

    def save(ckpt_dir, tag):
        d = tmp_path / "run" / "checkpoints" / tag
        d.mkdir(parents=True)
        (d / "model.pt").write_bytes(tag.encode())
        saved.append(tag)

    learner = SimpleNamespace(
        save=_Remote(save), load=_Remote(lambda d, tag: loaded.append((d, tag))),
        init_engine=_Remote(lambda: {"family": "sdar", "model": "built (random init)", "params": 1}),  # its report's shape
    )
    scheduler = SimpleNamespace(get_state=_Remote(lambda: {"step": 0}), set_state=_Remote(lambda s: None))
    store_url = f"file://{tmp_path / 'bucket'}"
    cfg = load_config(None, [f"storage_path={store_url}", "keep_checkpoints=2"])
    t = tr.Trainer(cfg, tmp_path / "run")
    t.learner, t.scheduler = learner, scheduler
    for step in (1, 2, 3):
        t.checkpoint(step)
    assert t.store.url == f"{store_url}/run"
    assert t.store.tags() == ["step_000002", "step_000003"]
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step_000003"]

    shutil.rmtree(tmp_path / "run" / "checkpoints")  # a fresh machine: nothing staged
    r = tr.Trainer(cfg, tmp_path / "run", resume=True)
    r.learner, r.scheduler = learner, scheduler
    r._restore()
    assert r.start_step == 3 and loaded == [(str(tmp_path / "run" / "checkpoints"), "step_000003")]
    assert (tmp_path / "run" / "checkpoints" / "step_000003" / "model.pt").read_bytes() == b"step_000003"


# ---- --resume: the newer of storage and the local folder; memory:// across processes --------------------------

def _run_stand_ins(run_dir, loaded: list):
    """The learner and scheduler stand-ins of a Trainer's checkpoint / restore: the learner writes a real checkpoint
    folder (a weights file named after its tag), the scheduler a state of its own."""
    def save(ckpt_dir, tag):
        d = run_dir / "checkpoints" / tag
        d.mkdir(parents=True)
        (d / "model.pt").write_bytes(tag.encode())

    learner = SimpleNamespace(save=_Remote(save), load=_Remote(lambda d, tag: loaded.append(tag)),
                              init_engine=_Remote(lambda: {"family": "sdar", "model": "built (random init)", "params": 1}))
    scheduler = SimpleNamespace(get_state=_Remote(lambda: {"step": 0, "figures": []}), set_state=_Remote(lambda s: None))
    return learner, scheduler


def test_resume_takes_the_newest_valid_checkpoint_of_storage_and_the_local_folder(tmp_path):
    from dice_ray.cluster.checkpoint import newest_checkpoint_tag, resume_point

    store = CheckpointStore(f"file://{tmp_path / 'bucket' / 'run'}")
    ckpt = tmp_path / "run" / "checkpoints"
    for step in (2, 3):
        store.upload(_stage(tmp_path / "staging", step))
    _stage(ckpt, 4)  # staged, never uploaded (the run ended in the copy)
    point = resume_point(store, ckpt, tmp_path / "run")
    assert (point.source, point.state["step"], point.state_path) == ("local", 4, ckpt / "step_000004" / MARKER)
    assert f"step_000004 from {ckpt} (local disk): newer than the newest complete one under storage_path " \
           f"{store.url}, step_000003" in point.line
    assert newest_checkpoint_tag(store, ckpt) == "step_000004"

    shutil.rmtree(ckpt / "step_000004")
    _stage(ckpt, 2)  # an older local copy: storage's newest is fetched
    point = resume_point(store, ckpt, tmp_path / "run")
    assert (point.source, point.state["step"]) == ("storage", 3)
    assert (ckpt / "step_000003" / "mp_rank_00_model_states.pt").read_bytes() == b"weights\x03"
    assert f"fetched step_000003 from {store.url}: the newest complete checkpoint ({ckpt}: its newest is step_000002)" \
           in point.line

    _stage(ckpt, 5)
    (ckpt / "step_000005" / MARKER).write_text('{"step": 5, "sched')  # cut short: not a valid checkpoint
    assert resume_point(store, ckpt, tmp_path / "run").state["step"] == 3
    assert newest_checkpoint_tag(store, ckpt) == "step_000003"

    shutil.rmtree(ckpt)
    empty = CheckpointStore(f"file://{tmp_path / 'bucket' / 'other'}")
    with pytest.raises(FileNotFoundError, match=f"no complete checkpoint under {empty.url} nor under {ckpt}$"):
        resume_point(empty, ckpt, tmp_path / "run")
    with pytest.raises(FileNotFoundError, match=f"no checkpoint under {ckpt}$"):
        resume_point(None, ckpt, tmp_path / "run")


_WRITE_TO_MEMORY = """
import json, sys
from pathlib import Path
from types import SimpleNamespace
import ray
from dice_ray.cluster import trainer as tr
from dice_ray.config import load_config

ray.get = lambda x, **kw: x  # the actors are stand-ins
run, url = Path(sys.argv[1]), sys.argv[2]

class Remote:
    def __init__(self, fn):
        self.remote = fn

def save(ckpt_dir, tag):
    (run / "checkpoints" / tag).mkdir(parents=True)
    (run / "checkpoints" / tag / "model.pt").write_bytes(tag.encode())

t = tr.Trainer(load_config(None, [f"storage_path={url}", "keep_checkpoints=2"]), run)
t.learner = SimpleNamespace(save=Remote(save))
t.scheduler = SimpleNamespace(get_state=Remote(lambda: {"step": 0, "figures": []}))
for step in (1, 2, 3):
    t.checkpoint(step)
print(json.dumps(t.store.tags()))
"""


def test_memory_storage_resumed_in_a_new_process_takes_the_local_checkpoint_and_says_why(tmp_path, monkeypatch):
    """``storage_path: memory://...`` (fsspec's in-memory filesystem) holds the uploads only in the process that made
    them: a run writes its checkpoints there in one process; ``--resume`` in another (this one) finds storage empty,
    takes the newest checkpoint still on local disk and says so; with none there either, the error names the reason."""
    import io
    import subprocess
    import sys

    from rich.console import Console

    from dice_ray.cluster import trainer as tr

    url = f"memory://dice-ray-test/{uuid.uuid4().hex}"
    run = tmp_path / "run"
    wrote = subprocess.run([sys.executable, "-c", _WRITE_TO_MEMORY, str(run), url], capture_output=True, text=True,
                           timeout=300)
    assert wrote.returncode == 0, wrote.stderr[-3000:]
    assert json.loads(wrote.stdout.splitlines()[-1]) == ["step_000002", "step_000003"]  # there, in that process
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000003"]  # only the newest staged

    monkeypatch.setattr(tr.ray, "get", lambda x, **kw: x)
    cfg = load_config(None, [f"storage_path={url}", "keep_checkpoints=2"])
    r = tr.Trainer(cfg, run, resume=True, console=Console(file=io.StringIO(), width=400))
    assert r.store.tags() == []  # a new process: the memory filesystem is empty
    loaded = []
    r.learner, r.scheduler = _run_stand_ins(run, loaded)
    r._restore()
    assert r.start_step == 3 and loaded == ["step_000003"]
    said = r.console.file.getvalue()
    assert f"checkpoint step_000003 from {run / 'checkpoints'} (local disk): storage_path {url}/run holds no " \
           "complete checkpoint; a memory:// storage_path (fsspec's in-memory filesystem) lives only in the process " \
           "that wrote it" in said, said

    shutil.rmtree(run / "checkpoints")
    r = tr.Trainer(cfg, run, resume=True)
    r.learner, r.scheduler = _run_stand_ins(run, loaded)
    with pytest.raises(FileNotFoundError) as info:
        r._restore()
    assert str(info.value).startswith(f"--resume {run}: no complete checkpoint under {url}/run nor under "
                                      f"{run / 'checkpoints'} (a memory:// storage_path (fsspec's in-memory filesystem) "
                                      "lives only in the process that wrote it: a new process, as this --resume is, "
                                      "never sees the checkpoints"), info.value
