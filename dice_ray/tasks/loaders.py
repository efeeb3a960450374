"""Load tasks: the built-in suite, DICE's RL data (JSON), KernelBench folders, single reference files.

Specs accepted by :func:`load_tasks`:

* ``"builtin"``: the suite shipped in ``dice_ray/tasks/builtin/<L{level}_{nn}_{name}>/`` (a
  KernelBench-format ``reference.py`` and a fast-format ``solution.py`` each), ordered from single
  operators (level 1) to fusions (level 2).
* ``"dice:PATH"``: DICE's RL data (deadlykitten4/DICE ``rl_data/``), a JSON file or a folder of
  ``.json`` files, each a list of records of one of three shapes (found per file, by the keys most
  records carry):

  - end-to-end (``end_to_end_kernel_generation_4000.json``): ``{idx, level, pytorch_code,
    cuda_code, raw_answer}``; an empty ``cuda_code`` gives a task without solution;
    task ids ``dice-e2e/<idx>``;
  - infilling (``kernel_infilling_evaluation.json``): ``{id, pytorch_code, cuda_code, prefix,
    middle, suffix}``; ``cuda_code`` is a ``load_inline`` solution that ``prefix + middle + suffix``
    rebuilds; task ids ``dice-infill/<id>``, level estimated from the reference;
  - reference only (``kernelbench_level1.json``): ``{pytorch_code}``; ids ``dice-<file stem>/<index>``.

* ``"kernelbench:DIR"``: a KernelBench checkout's problem folder (``level1/19_ReLU.py`` ...); every
  ``.py`` under DIR is a reference, the level read from a ``level<N>`` folder name.

Records are untrusted: each is validated by parsing only (:mod:`ast`), never executed (references
run only inside the verifier's sandbox).  References whose ``get_inputs`` allocates more than
``max_input_elements`` elements by a static lower bound (:func:`static_input_elements`; DICE's data
holds some of up to 17 GB) are refused too.  A bad record is rejected with its file, index and reason
(``"<rule>: <detail>"``) and loading goes on; :meth:`LoadReport.summary` counts both.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from dice_ray.tasks.scaffold import ScaffoldError, make_scaffold
from dice_ray.tasks.task import (
    Task,
    TaskError,
    estimate_level,
    static_input_elements,
    validate_reference,
    validate_solution,
)

#: Folder of the built-in suite.
BUILTIN_DIR = Path(__file__).resolve().parent / "builtin"
_BUILTIN_NAME = re.compile(r"^L(\d)_(\d+)_([a-z0-9_]+)$")
_MAX_JSON_BYTES = 512 * 1024 * 1024
#: Default cap on a reference's input elements (2**28: 1 GiB of fp32), by a static lower bound.
DEFAULT_MAX_INPUT_ELEMENTS = 2**28


@dataclass(frozen=True)
class Rejection:
    """A record that was not loaded.

    Attributes:
        source: the file (or folder) it came from.
        index: its position in the file's list (or ``"file"`` when the whole file was refused, or
            the folder name of a built-in task).
        reason: ``"<rule>: <detail>"``, e.g. ``"syntax-error: pytorch_code does not parse: line 3: ..."``.
    """

    source: str
    index: int | str
    reason: str

    @property
    def rule(self) -> str:
        """The rule id, the part of ``reason`` before the first colon."""
        return self.reason.split(":", 1)[0]


@dataclass
class LoadReport:
    """The result of :func:`load_tasks`: the accepted tasks and the rejected records.

    Attributes:
        spec: the spec that was loaded.
        tasks: accepted tasks, in file order (built-in suite: level 1 first).
        rejected: one :class:`Rejection` a refused record (or file).
        files: the files read.
    """

    spec: str
    tasks: list[Task] = field(default_factory=list)
    rejected: list[Rejection] = field(default_factory=list)
    files: list[str] = field(default_factory=list)

    def rejected_by_rule(self) -> dict[str, int]:
        """Rejections counted by rule id, most frequent first."""
        return dict(Counter(r.rule for r in self.rejected).most_common())

    def accepted_by_level(self) -> dict[int, int]:
        """Accepted tasks counted by level, in level order."""
        return dict(sorted(Counter(t.level for t in self.tasks).items()))

    def summary(self) -> str:
        """One line: accepted tasks (by level, with solutions) and rejections (by rule)."""
        levels = ", ".join(f"L{lvl}: {n}" for lvl, n in self.accepted_by_level().items())
        solved = sum(t.solution_src is not None for t in self.tasks)
        text = f"{self.spec}: {len(self.tasks)} accepted ({levels or 'none'}; {solved} with a solution)"
        text += f", {len(self.rejected)} rejected"
        if self.rejected:
            text += " (" + ", ".join(f"{rule}: {n}" for rule, n in self.rejected_by_rule().items()) + ")"
        return text


def load_tasks(spec: str, max_input_elements: int | None = DEFAULT_MAX_INPUT_ELEMENTS) -> LoadReport:
    """Load the tasks named by ``spec`` (see the module docstring for the accepted specs).

    Args:
        spec: ``"builtin"``, ``"dice:PATH"`` or ``"kernelbench:DIR"``.
        max_input_elements: refuse references whose ``get_inputs`` allocates more elements than
            this (static lower bound, rule ``inputs-too-large``); None: no cap.

    Raises:
        ValueError: ``spec`` is none of ``"builtin"``, ``"dice:PATH"``, ``"kernelbench:DIR"``.
        FileNotFoundError: PATH / DIR does not exist.
    Bad records never raise: they are listed in :attr:`LoadReport.rejected`.
    """
    if not isinstance(spec, str):
        raise ValueError(f"tasks spec must be a str, got {type(spec).__name__}")
    if max_input_elements is not None and (isinstance(max_input_elements, bool) or max_input_elements < 1):
        raise ValueError(f"max_input_elements must be None or an int >= 1, got {max_input_elements!r}")
    kind, sep, rest = spec.partition(":")
    if spec == "builtin":
        return _load_builtin(BUILTIN_DIR, spec, max_input_elements)
    if sep and rest and kind == "dice":
        return _load_dice(Path(rest).expanduser(), spec, max_input_elements)
    if sep and rest and kind == "kernelbench":
        return _load_kernelbench(Path(rest).expanduser(), spec, max_input_elements)
    raise ValueError(f"tasks spec {spec!r}: expected 'builtin', 'dice:PATH' or 'kernelbench:DIR'")


def _capped(task: Task, cap: int | None) -> Task:
    """``task``, unless its inputs exceed ``cap`` elements (TaskError ``inputs-too-large``)."""
    if cap is not None:
        n = static_input_elements(task.reference_src)
        if n > cap:
            raise TaskError("inputs-too-large", f"get_inputs() allocates at least {n} elements, the cap is {cap}")
    return task


def load_reference_file(path: str | Path) -> Task:
    """Read one KernelBench-format reference file as a :class:`Task` (no solution).

    The task id is ``file/<stem>``; the level is read from a ``level<N>`` parent folder (KernelBench
    layout) when there is one, else estimated from ``Model.forward`` (:func:`estimate_level`).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        TaskError: the file is not valid UTF-8 or breaks a reference rule (names the rule).
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"reference file {p} does not exist")
    try:
        src = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise TaskError("not-utf8", f"reference file {p} is not UTF-8: {e}") from None
    validate_reference(src, field=f"reference file {p}")
    return Task(f"file/{p.stem}", p.stem, _level_from_path(p) or estimate_level(src), src)


# ---------------------------------------------------------------------------------------------
# built-in suite
# ---------------------------------------------------------------------------------------------


def _load_builtin(root: Path, spec: str, cap: int | None) -> LoadReport:
    report = LoadReport(spec)
    for folder in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(("_", "."))):
        m = _BUILTIN_NAME.match(folder.name)
        if m is None:
            report.rejected.append(Rejection(str(root), folder.name, "bad-folder-name: expected L<level>_<nn>_<name>"))
            continue
        level, name = int(m.group(1)), m.group(3)
        try:
            ref = (folder / "reference.py").read_text(encoding="utf-8")
            sol = (folder / "solution.py").read_text(encoding="utf-8")
            report.files += [str(folder / "reference.py"), str(folder / "solution.py")]
            make_scaffold(sol, "fast")
            task = _capped(Task(f"builtin/L{level}/{name}", name, level, ref, sol, "fast"), cap)
        except OSError as e:
            report.rejected.append(Rejection(str(folder), folder.name, f"missing-file: {e}"))
            continue
        except (TaskError, ScaffoldError) as e:
            report.rejected.append(Rejection(str(folder), folder.name, _reason(e)))
            continue
        report.tasks.append(task)
    return report


# ---------------------------------------------------------------------------------------------
# DICE JSON
# ---------------------------------------------------------------------------------------------

_E2E_KEYS = ("idx", "level", "pytorch_code", "cuda_code")
_INFILL_KEYS = ("id", "pytorch_code", "cuda_code", "prefix", "middle", "suffix")
_REFERENCE_KEYS = ("pytorch_code",)


def _reason(e: Exception) -> str:
    if isinstance(e, TaskError):
        return str(e)
    if isinstance(e, ScaffoldError):
        return f"no-cuda-source: {e}"
    return f"{type(e).__name__}: {e}"


def _json_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if path.is_dir():
        return sorted(p for p in path.glob("*.json") if p.is_file())
    raise FileNotFoundError(f"DICE data path {path} does not exist")


def _load_dice(path: Path, spec: str, cap: int | None) -> LoadReport:
    report = LoadReport(spec)
    seen: set[str] = set()
    for file in _json_files(path):
        report.files.append(str(file))
        try:
            if file.stat().st_size > _MAX_JSON_BYTES:
                raise ValueError(f"file is larger than {_MAX_JSON_BYTES} bytes")
            records = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            report.rejected.append(Rejection(str(file), "file", f"bad-json: {e}"))
            continue
        if not isinstance(records, list):
            report.rejected.append(
                Rejection(str(file), "file", f"not-a-list: top level is a {type(records).__name__}, expected a list")
            )
            continue
        kind = _dice_kind(records)
        for i, rec in enumerate(records):
            try:
                task = _capped(_dice_record(rec, kind, file.stem, i), cap)
                if task.task_id in seen:
                    raise TaskError("duplicate-id", f"task id {task.task_id!r} was already loaded")
            except (TaskError, ScaffoldError) as e:
                report.rejected.append(Rejection(str(file), i, _reason(e)))
                continue
            seen.add(task.task_id)
            report.tasks.append(task)
    return report


def _dice_kind(records: list) -> str:
    """``"infill"``, ``"e2e"`` or ``"reference"``: the shape most dict records of a file have."""
    votes: Counter[str] = Counter()
    for rec in records:
        if isinstance(rec, dict):
            if "middle" in rec or "prefix" in rec:
                votes["infill"] += 1
            elif "idx" in rec or "raw_answer" in rec or "level" in rec:
                votes["e2e"] += 1
            else:
                votes["reference"] += 1
    return votes.most_common(1)[0][0] if votes else "e2e"


def _check_keys(rec: object, keys: tuple[str, ...]) -> dict:
    if not isinstance(rec, dict):
        raise TaskError("not-an-object", f"record is a {type(rec).__name__}, expected a JSON object")
    missing = [k for k in keys if k not in rec]
    if missing:
        raise TaskError("missing-key", f"record lacks {', '.join(missing)} (has {', '.join(map(str, rec)) or 'none'})")
    return rec


def _record_id(value: object, key: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, str)) or not str(value).strip():
        raise TaskError("bad-id", f"{key} must be an int or a non-empty str, got {value!r}")
    text = str(value).strip()
    if not re.fullmatch(r"[\w.\-]+", text):
        raise TaskError("bad-id", f"{key} {text!r} may hold only letters, digits, '_', '.', '-'")
    return text


def _dice_record(rec: object, kind: str, stem: str, index: int) -> Task:
    if kind == "infill":
        rec = _check_keys(rec, _INFILL_KEYS)
        rid = _record_id(rec["id"], "id")
        validate_reference(rec["pytorch_code"], field="pytorch_code")
        validate_solution(rec["cuda_code"], "load_inline", field="cuda_code")
        for k in ("prefix", "middle", "suffix"):
            if not isinstance(rec[k], str):
                raise TaskError("not-a-string", f"{k} must be a str, got {type(rec[k]).__name__}")
        if rec["prefix"] + rec["middle"] + rec["suffix"] != rec["cuda_code"]:
            raise TaskError("scaffold-mismatch", "prefix + middle + suffix does not rebuild cuda_code")
        make_scaffold(rec["cuda_code"], "load_inline")
        return Task(f"dice-infill/{rid}", f"infill_{rid}", estimate_level(rec["pytorch_code"]),
                    rec["pytorch_code"], rec["cuda_code"], "load_inline")
    if kind == "reference":
        rec = _check_keys(rec, _REFERENCE_KEYS)  # no id of its own: the file stem and the index name it
        validate_reference(rec["pytorch_code"], field="pytorch_code")
        tid = _record_id(f"{stem}/{index}".replace("/", "-"), "file stem")  # checks the stem's characters
        return Task(f"dice-{stem}/{index}", tid, estimate_level(rec["pytorch_code"]), rec["pytorch_code"])
    rec = _check_keys(rec, _E2E_KEYS)
    rid = _record_id(rec["idx"], "idx")
    level = _level(rec["level"])
    validate_reference(rec["pytorch_code"], field="pytorch_code")
    cuda = rec["cuda_code"]
    if cuda is None or (isinstance(cuda, str) and not cuda.strip()):
        return Task(f"dice-e2e/{rid}", f"e2e_{rid}", level, rec["pytorch_code"])
    if not isinstance(cuda, str):
        raise TaskError("not-a-string", f"cuda_code must be a str, got {type(cuda).__name__}")
    fmt = "fast" if re.search(r"\bload_cuda\s*\(", cuda) else "load_inline"
    validate_solution(cuda, fmt, field="cuda_code")
    return Task(f"dice-e2e/{rid}", f"e2e_{rid}", level, rec["pytorch_code"], cuda, fmt)


def _level(value: object) -> int:
    """DICE writes levels as strings ("2"); accept an int or a digit string in 0..4."""
    if isinstance(value, bool):
        raise TaskError("bad-level", f"level must be an int in 0..4, got {value!r}")
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if not isinstance(value, int) or not 0 <= value <= 4:
        raise TaskError("bad-level", f"level must be an int in 0..4 (or its digit string), got {value!r}")
    return value


# ---------------------------------------------------------------------------------------------
# KernelBench folders
# ---------------------------------------------------------------------------------------------


def _level_from_path(path: Path) -> int | None:
    for part in reversed(path.parent.parts):
        m = re.fullmatch(r"level_?(\d)", part.lower())
        if m and 0 <= int(m.group(1)) <= 4:
            return int(m.group(1))
    return None


def _load_kernelbench(root: Path, spec: str, cap: int | None) -> LoadReport:
    if not root.is_dir():
        raise FileNotFoundError(f"KernelBench folder {root} does not exist")
    report = LoadReport(spec)
    for file in sorted(root.rglob("*.py")):
        if file.name.startswith("_"):
            continue
        report.files.append(str(file))
        rel = file.relative_to(root).with_suffix("").as_posix()
        try:
            src = file.read_text(encoding="utf-8")
            validate_reference(src, field=f"{rel}.py")
            level = _level_from_path(file) or estimate_level(src)
            task = _capped(Task(f"kernelbench/{rel}", file.stem, level, src), cap)
        except UnicodeDecodeError as e:
            report.rejected.append(Rejection(str(file), rel, f"not-utf8: {e}"))
            continue
        except TaskError as e:
            report.rejected.append(Rejection(str(file), rel, _reason(e)))
            continue
        report.tasks.append(task)
    return report
