"""``dice-ray verify --task T.py --candidate S.py``: one verdict for a pair of files, for debugging."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dice_ray.config import DiceConfig, RewardConfig, VerifyConfig
from dice_ray.verify.verdict import Verdict

__all__ = ["InputFileError", "load_task_file", "read_source_file", "verify_files"]

MAX_FILE_BYTES = 1_000_000


class InputFileError(ValueError):
    """An input file cannot be used; the message names the file and the broken rule.

    Attributes:
        path: the file.
        rule: ``missing``, ``not-a-file``, ``too-large``, ``not-utf8``, ``empty``, or a task rule
            of :class:`dice_ray.tasks.task.TaskError` (``syntax-error``, ``no-model-class``, ...).
        message: what broke it.
    """

    def __init__(self, path: str | Path, rule: str, message: str):
        super().__init__(f"{path}: [{rule}] {message}")
        self.path = str(path)
        self.rule, self.message = rule, message

    def __reduce__(self):  # pickles with its own arguments
        return type(self), (self.path, self.rule, self.message)


def read_source_file(path: str | Path) -> str:
    """Read a Python source file as UTF-8 text.

    Raises:
        InputFileError: missing, not a regular file, over 1 MB, not UTF-8, or empty.
    """
    p = Path(path)
    if not p.exists():
        raise InputFileError(p, "missing", "no such file")
    if not p.is_file():
        raise InputFileError(p, "not-a-file", "not a regular file")
    size = p.stat().st_size
    if size > MAX_FILE_BYTES:
        raise InputFileError(p, "too-large", f"{size} bytes, the limit is {MAX_FILE_BYTES}")
    try:
        text = p.read_bytes().decode("utf-8-sig")  # as Python reads a source file: a byte-order mark dropped
    except UnicodeDecodeError as e:
        raise InputFileError(p, "not-utf8", f"not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not text.strip():
        raise InputFileError(p, "empty", "the file is empty")
    return text


def load_task_file(path: str | Path) -> Any:
    """A :class:`dice_ray.tasks.task.Task` from a KernelBench-format reference file.

    Raises:
        InputFileError: the file is unreadable or breaks a task rule (no ``Model``, no
            ``get_inputs``, syntax error...).
    """
    src = read_source_file(path)
    from dice_ray.tasks.levels import estimate_level
    from dice_ray.tasks.task import Task
    from dice_ray.tasks.validate import TaskError

    p = Path(path)
    try:
        return Task(task_id=f"file:{p.name}", name=p.stem, level=estimate_level(src), reference_src=src)
    except TaskError as e:
        raise InputFileError(p, e.rule, e.message) from None


def verify_files(
    task_path: str | Path, candidate_path: str | Path, cfg: DiceConfig | VerifyConfig | None = None,
    device: int | None = None,
) -> Verdict:
    """Verify the candidate file against the task file with a fresh :class:`Verifier`.

    Args:
        task_path: a KernelBench-format reference (``Model``, ``get_inputs``, ``get_init_inputs``).
        candidate_path: a fast-format candidate (INTERFACES.md).
        cfg: a DiceConfig (its ``verify`` and ``reward`` sections) or a VerifyConfig (default
            rewards); None: defaults.
        device: CUDA ordinal, as for :class:`~dice_ray.verify.verifier.Verifier`.

    Returns:
        The :class:`Verdict` (candidate faults, including Python syntax errors, are verdicts).
    Raises:
        InputFileError: an input file is unusable (see :func:`read_source_file`, :func:`load_task_file`).
    """
    from dice_ray.verify.verifier import Verifier

    task = load_task_file(task_path)
    candidate = read_source_file(candidate_path)
    if isinstance(cfg, DiceConfig):
        verify_cfg, reward_cfg = cfg.verify, cfg.reward
    else:
        verify_cfg, reward_cfg = cfg or VerifyConfig(), RewardConfig()
    with Verifier(verify_cfg, reward_cfg, device=device) as verifier:
        return verifier.verify(task, candidate, Path(candidate_path).name)
