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
