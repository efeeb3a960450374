"""Checkpoint storage: a run's checkpoints copied to a local folder or an fsspec URL, the last K kept.

As in Ray Train's ``storage_path``: DeepSpeed writes each checkpoint to a local staging folder
(``RUN_DIR/checkpoints/step_NNNNNN``); :class:`CheckpointStore` then copies it to
``{storage_path}/{run name}/step_NNNNNN`` on any fsspec filesystem (``s3://``, ``gs://``,
``file://``, ``memory://``, a plain path). ``state.json`` is the completeness marker: it is copied
last, so a checkpoint whose copy was cut short is never taken as the latest, and pruning removes it.
``memory://`` (fsspec's in-memory filesystem) lives only in the process that wrote it: a resume in a new
process finds it empty (:func:`dice_ray.cluster.checkpoint.resume_point` then says so).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import fsspec
from fsspec.core import url_to_fs

MARKER = "state.json"
TAG_RE = re.compile(r"^step_\d{6}$")


def check_storage_url(url: str) -> str:
    """Validate ``storage_path``: a non-empty path or a URL whose protocol fsspec can open.

    Raises:
        ValueError: ``url`` is empty, has one slash after its protocol (``s3:/bucket``), or its protocol is
            unknown to fsspec or needs a package that is not installed (the message names the package,
            e.g. ``s3fs`` for ``s3://``).
    """
    if not url or not url.strip():
        raise ValueError("storage_path must be a non-empty folder or fsspec URL (e.g. s3://bucket/runs)")
    if re.match(r"^[A-Za-z][\w+.-]+:/(?!/)", url):  # s3:/bucket: a URL missing a slash, not a folder named "s3:"
        raise ValueError(f"storage_path={url!r} looks like a URL with one slash after its protocol; "
                         "write PROTOCOL://... (s3://bucket/runs) or a plain folder")
    protocol = fsspec.core.split_protocol(url)[0] or "file"
    try:
        fsspec.get_filesystem_class(protocol)
    except (ValueError, ImportError) as e:
        raise ValueError(f"storage_path={url!r}: fsspec cannot open protocol {protocol!r}: {e}") from e
    return url


class CheckpointStore:
    """The checkpoints of one run under an fsspec folder: upload, list complete ones, prune, fetch.

    Args:
        url: the run's checkpoint folder (``s3://bucket/runs/NAME``, ``file:///abs/path``,
            ``memory://x``, or a plain path); made on the first upload.

    Raises:
        ValueError: see :func:`check_storage_url`.
    """

    def __init__(self, url: str):
        self.url = check_storage_url(url)
        self.fs, self.root = url_to_fs(url)
        self.root = self.root.rstrip("/")

    @property
    def in_memory(self) -> bool:
        """Whether the store is fsspec's ``memory://`` filesystem: it lives only in the process that wrote it."""
        protocol = self.fs.protocol
        return "memory" in ((protocol,) if isinstance(protocol, str) else protocol)

    def _remote(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def upload(self, local_dir: str | Path) -> str:
        """Copy the checkpoint folder ``local_dir`` (named ``step_NNNNNN``, holding ``state.json``) to
        the store, its ``state.json`` last; a stale copy of the same tag is replaced. Returns its path.

        Raises:
            FileNotFoundError: ``local_dir`` is not a folder or lacks ``state.json``.
            ValueError: the folder name is not a checkpoint tag ``step_NNNNNN``.
        """
        local = Path(local_dir)
        if not (local / MARKER).is_file():
            raise FileNotFoundError(f"checkpoint {local}: no {MARKER} (not a complete checkpoint)")
        if not TAG_RE.match(local.name):
            raise ValueError(f"checkpoint {local}: folder name must be step_NNNNNN")
        dest = self._remote(local.name)
        if self.fs.exists(dest):
            self.fs.rm(dest, recursive=True)
        files = sorted(p for p in local.rglob("*") if p.is_file() and p.relative_to(local).as_posix() != MARKER)
        for p in [*files, local / MARKER]:  # the marker last
            target = self._remote(local.name, p.relative_to(local).as_posix())
            self.fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
            self.fs.put_file(str(p), target)
        return dest

    def tags(self) -> list[str]:
        """Tags of the complete checkpoints (those with ``state.json``), oldest first."""
        if not self.fs.exists(self.root):
            return []
        names = [e.rstrip("/").rsplit("/", 1)[-1] for e in self.fs.ls(self.root, detail=False)]
        return sorted(n for n in names if TAG_RE.match(n) and self.fs.exists(self._remote(n, MARKER)))

    def latest(self) -> str | None:
        """Tag of the newest complete checkpoint, or None."""
        tags = self.tags()
        return tags[-1] if tags else None

    def prune(self, keep: int) -> list[str]:
        """Delete all but the newest ``keep`` complete checkpoints, and any incomplete one older than
        the newest complete one (a cut-short copy). Returns the deleted tags.

        Raises:
            ValueError: ``keep`` < 1.
        """
        if keep < 1:
            raise ValueError(f"keep={keep}: must be >= 1")
        complete = self.tags()
        if not complete:
            return []
        names = [e.rstrip("/").rsplit("/", 1)[-1] for e in self.fs.ls(self.root, detail=False)]
        partial = [n for n in names if TAG_RE.match(n) and n not in complete and n < complete[-1]]
        doomed = sorted(complete[:-keep] + partial)
        for tag in doomed:
            self.fs.rm(self._remote(tag), recursive=True)
        return doomed

    def fetch(self, tag: str, local_parent: str | Path) -> Path:
        """Download checkpoint ``tag`` to ``local_parent/tag`` (replacing what is there), its
        ``state.json`` last; returns the folder. A staged copy whose ``state.json`` equals the stored
        one is the same complete checkpoint and is kept as is (no download).

        Raises:
            FileNotFoundError: no complete checkpoint ``tag`` in the store.
        """
        if tag not in self.tags():
            raise FileNotFoundError(f"no complete checkpoint {tag!r} under {self.url}")
        dest = Path(local_parent) / tag
        marker = self.fs.cat_file(self._remote(tag, MARKER))
        if (dest / MARKER).is_file() and (dest / MARKER).read_bytes() == marker:
            return dest
        if dest.exists():
            shutil.rmtree(dest)
        src = self._remote(tag)
        for path in self.fs.find(src):
            rel = path[len(src) :].lstrip("/")
            if rel != MARKER:
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                self.fs.get_file(path, str(dest / rel))
        dest.mkdir(parents=True, exist_ok=True)
        (dest / MARKER).write_bytes(marker)
        return dest


def run_store_url(storage_path: str, run_name: str) -> str:
    """``{storage_path}/{run_name}``: where one run's checkpoints go (runs sharing a storage_path
    do not prune each other's checkpoints)."""
    return storage_path.rstrip("/") + "/" + run_name
