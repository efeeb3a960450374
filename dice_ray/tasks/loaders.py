"""Load tasks: the built-in suite, DICE's RL data (JSON), KernelBench folders, single reference files.

Specs accepted by :func:`load_tasks`:

* ``"builtin"``: the suite shipped in ``dice_ray/tasks/builtin/<L{level}_{nn}_{name}>/`` (a
  KernelBench-format ``reference.py`` and a fast-format ``solution.py`` each, and for some a slower honest
  ``solution_slow.py``: :attr:`Task.solution_variants`), ordered from single operators (level 1) to fusions
  (level 2). ``"builtin:N"``: its first N tasks (the embedded default's ``builtin:24``: single
  operators).
* ``"dice:PATH"``: DICE's RL data (deadlykitten4/DICE ``rl_data/``), a JSON file or a folder of
  ``.json`` files, each a list of records of one of three shapes (found per file, by the keys most
  records carry):

  - end-to-end (``end_to_end_kernel_generation_4000.json``): ``{idx, level, pytorch_code,
    cuda_code, raw_answer}``; an empty ``cuda_code`` gives a task without solution;
    task ids ``dice-e2e/<idx>``;
  - infilling (``kernel_infilling_evaluation.json``): ``{id, pytorch_code, cuda_code, prefix,
    middle, suffix}``; ``cuda_code`` is a ``load_inline`` solution that ``prefix + middle + suffix``
    rebuilds (the loader's own cut, :func:`~dice_ray.tasks.scaffold.make_scaffold`, gives exactly DICE's
    three parts); task ids ``dice-infill/<id>``, level estimated from the reference;

  A task of the infilling file has :attr:`Task.role` ``"infill"`` and one of the end-to-end file ``"e2e"``:
  a run given both (their folder, or ``dice:A+dice:B``) draws each phase's prompts from its own file
  (:func:`phase_pool`), as DICE's recipe does;
  - reference only (``kernelbench_level1.json``): ``{pytorch_code}``; ids ``dice-<file stem>/<index>``.

* ``"kernelbench:DIR"``: a KernelBench checkout's problem folder (``level1/19_ReLU.py`` ...); every
  ``.py`` under DIR is a reference, the level read from a ``level<N>`` folder name.
* ``"kernelbench-json:PATH"``: KernelBench problems as JSON (a file, or a folder of ``.json`` /
  ``.jsonl`` files): a list of records, ``{"problems": [...]}``, or an object of lists keyed by split
  (the Hugging Face dataset ``ScalingIntelligence/KernelBench`` dumped as ``{"level_1": [...], ...}``);
  a ``.jsonl`` file holds one record a line (``Dataset.to_json``).  A record is the dataset's row
  ``{code, level, name, problem_id}``: the reference under ``code`` (or ``pytorch_code``,
  ``ref_arch_src``), ``level`` optional (else the split's ``level_<N>``, else estimated), ``name`` (or
  ``problem_name``) and ``problem_id`` optional.  Ids ``kernelbench/level<N>/<name>`` as the folder
  loader gives them (``<problem_id>_`` prefixed when the name lacks it), ``kernelbench/<name>``
  without a level, ``kernelbench-<file stem>/<index>`` without a name or problem id.
* ``"alpaca:PATH"``: instruction-tuning pairs (CuKe / Alpaca shape; a JSON file or a folder of
  them): a list of ``{instruction, input, output}`` or ``{prompt, response}``.  The reference is the
  fenced Python block (```` ```python ````, ```` ```py ```` or untagged) of ``prompt`` (or
  ``instruction`` + ``input``) that holds ``class Model`` and ``get_inputs`` (or the whole ``input``
  when that is the bare module); the solution is the last fenced block of ``response`` /
  ``output`` holding ``class ModelNew`` (or the bare output), format ``fast`` when it calls
  ``load_cuda`` else ``load_inline``.  An empty output gives a task without solution; an output
  without a valid solution is **rejected** (rule ``bad-solution``), not loaded reference-only: the
  output is what such a record is for (the SFT target), and quietly dropping it would hide a broken
  converter.  Ids ``alpaca-<file stem>/<index>``, levels estimated.
* ``KIND:PATH@level=N`` (any kind with a PATH): every task of that file or folder gets level N, whatever its
  records say or the estimate guesses (``dice:kernelbench_level1.json@level=1``: DICE's reference-only file
  has no levels, and :func:`~dice_ray.tasks.levels.estimate_level` makes a few single operators level 2).
* several specs joined by ``+`` (``dice:infill.json+dice:e2e.json``, ``builtin+jsonl:mine.jsonl``): their tasks
  together, in the order given; a task id met again is rejected (rule ``duplicate-id``).
* ``"jsonl:PATH"``: one JSON object a line (a file, or a folder of ``.jsonl`` files):
  ``reference`` (or ``pytorch_code``), optional ``solution`` (or ``cuda_code``; format detected as
  above, a bad one rejected as ``bad-solution``), ``level`` (else estimated), ``name``, ``id`` (else the
  line number).  Ids ``jsonl-<file stem>/<id>``.  A line that is not a JSON object is rejected with its
  line number (the :attr:`Rejection.index`) and loading goes on; blank lines are skipped.

Data files are UTF-8 JSON (a leading byte-order mark is dropped); a folder must hold at least one
file of its spec's kind.  Records are untrusted: each is validated by parsing only (:mod:`ast`), never executed (references
run only inside the verifier's sandbox).  References whose ``get_inputs`` allocates more than
``max_input_elements`` elements by a static lower bound (:func:`static_input_elements`; DICE's data
holds some of up to 17 GB) are **scaled down** when their definition allows it (KernelBench#146):
their size constant (:func:`~dice_ray.tasks.sizing.shape_constant`, read only by ``get_inputs``) is
halved until the bound fits (:func:`~dice_ray.tasks.sizing.scale_down_inputs`), and the change is
listed in :attr:`LoadReport.scaled`; a solution is kept as it is (the verifier's shape trial
already demands solutions that follow the sizes).  References that cannot be scaled are refused
(``inputs-too-large``).  A bad record is rejected with its file, index and reason
(``"<rule>: <detail>"``) and loading goes on; :meth:`LoadReport.summary` counts accepted tasks by
level, scaled ones, and rejections by rule.
"""

from __future__ import annotations

import codecs
import json
import os
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from dice_ray.tasks.levels import estimate_level
from dice_ray.tasks.scaffold import ScaffoldError, make_scaffold
from dice_ray.tasks.sizing import scale_down_inputs, shape_constant, static_input_elements
from dice_ray.tasks.task import Task
from dice_ray.tasks.validate import TaskError, validate_reference, validate_solution

#: Folder of the built-in suite.
BUILTIN_DIR = Path(__file__).resolve().parent / "builtin"
_BUILTIN_NAME = re.compile(r"^L(\d)_(\d+)_([a-z0-9_]+)$")
_MAX_JSON_BYTES = 512 * 1024 * 1024
#: Default cap on a reference's input elements (2**28: 1 GiB of fp32), by a static lower bound.
DEFAULT_MAX_INPUT_ELEMENTS = 2**28


#: rejected records listed one a line (:meth:`LoadReport.rejection_lines`; the rest are counted)
SHOWN_REJECTIONS = 20


@dataclass(frozen=True)
class Rejection:
    """A record that was not loaded.

    Attributes:
        source: the file (or folder) it came from.
        index: its position in the file's list (``"<split>/<i>"`` in a KernelBench split object),
            its 1-based line number in a JSON Lines file, ``"file"`` when the whole file was
            refused, or the folder name of a built-in task.
        reason: ``"<rule>: <detail>"``, e.g. ``"syntax-error: pytorch_code does not parse: line 3: ..."``.
    """

    source: str
    index: int | str
    reason: str

    @property
    def rule(self) -> str:
        """The rule id, the part of ``reason`` before the first colon."""
        return self.reason.split(":", 1)[0]


@dataclass(frozen=True)
class ScaledTask:
    """A task whose inputs were scaled down to fit ``max_input_elements`` (KernelBench#146).

    Attributes:
        task_id: the task's id.
        constant: the size constant that was halved (module-level name in the reference).
        old_value: its value in the record.
        new_value: its value in the loaded task.
        elements: input elements (static lower bound) after scaling.
    """

    task_id: str
    constant: str
    old_value: int
    new_value: int
    elements: int


@dataclass
class LoadReport:
    """The result of :func:`load_tasks`: the accepted tasks and the rejected records.

    Attributes:
        spec: the spec that was loaded.
        tasks: accepted tasks, in file order (built-in suite: level 1 first).
        rejected: one :class:`Rejection` a refused record (or file).
        files: the files read.
        scaled: one :class:`ScaledTask` an accepted task whose inputs were scaled down.
    """

    spec: str
    tasks: list[Task] = field(default_factory=list)
    rejected: list[Rejection] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    scaled: list[ScaledTask] = field(default_factory=list)

    def rejected_by_rule(self) -> dict[str, int]:
        """Rejections counted by rule id, most frequent first."""
        return dict(Counter(r.rule for r in self.rejected).most_common())

    def accepted_by_level(self) -> dict[int, int]:
        """Accepted tasks counted by level, in level order."""
        return dict(sorted(Counter(t.level for t in self.tasks).items()))

    def rejection_lines(self, limit: int = SHOWN_REJECTIONS) -> list[str]:
        """One line a rejected record, ``rejected FILE[INDEX]: RULE: DETAIL`` (white space runs made one space, cut at
        200 characters), for the first ``limit``; then ``... and N more rejected``."""
        lines = [f"rejected {r.source}[{r.index}]: {' '.join(r.reason.split())[:200]}" for r in self.rejected[:limit]]
        if len(self.rejected) > limit:
            lines.append(f"... and {len(self.rejected) - limit} more rejected")
        return lines

    def summary(self) -> str:
        """One line: accepted tasks (by level, with solutions, scaled down) and rejections (by rule)."""
        levels = ", ".join(f"L{lvl}: {n}" for lvl, n in self.accepted_by_level().items())
        solved = sum(t.solution_src is not None for t in self.tasks)
        text = f"{self.spec}: {len(self.tasks)} accepted ({levels or 'none'}; {solved} with a solution"
        text += f"; {len(self.scaled)} inputs scaled down)" if self.scaled else ")"
        text += f", {len(self.rejected)} rejected"
        if self.rejected:
            text += " (" + ", ".join(f"{rule}: {n}" for rule, n in self.rejected_by_rule().items()) + ")"
        return text


def load_tasks(spec: str, max_input_elements: int | None = DEFAULT_MAX_INPUT_ELEMENTS) -> LoadReport:
    """Load the tasks named by ``spec`` (see the module docstring for the accepted specs).

    Args:
        spec: ``"builtin"``, ``"builtin:N"``, ``"dice:PATH"``, ``"kernelbench:DIR"``, ``"kernelbench-json:PATH"``,
            ``"alpaca:PATH"`` or ``"jsonl:PATH"``; a PATH may end in ``@level=N`` (every task of it gets level N).
        max_input_elements: scale down references whose ``get_inputs`` allocates more elements
            than this (static lower bound) when they have a size constant, refuse the others (rule
            ``inputs-too-large``); None: no cap.

    Raises:
        ValueError: ``spec`` is none of the above, or its ``@level=`` is not a level 0..4.
        FileNotFoundError: PATH / DIR does not exist, is not a regular file or folder, or is a
            folder without a data file of the spec's kind (``.json``, ``.jsonl``).
    Bad records never raise: they are listed in :attr:`LoadReport.rejected`.
    """
    if not isinstance(spec, str):
        raise ValueError(f"tasks spec must be a str, got {type(spec).__name__}")
    if max_input_elements is not None and (isinstance(max_input_elements, bool) or max_input_elements < 1):
        raise ValueError(f"max_input_elements must be None or an int >= 1, got {max_input_elements!r}")
    parts = _SPEC_SPLIT.split(spec)
    if len(parts) > 1:
        return _load_combined(spec, parts, max_input_elements)
    kind, sep, rest = spec.partition(":")
    if spec == "builtin":
        return _load_builtin(BUILTIN_DIR, spec, max_input_elements)
    if kind == "builtin" and sep:
        if not rest.isdigit() or int(rest) < 1:
            raise ValueError(f"tasks spec {spec!r}: builtin:N takes the suite's first N tasks, N an integer >= 1")
        report = _load_builtin(BUILTIN_DIR, spec, max_input_elements)
        report.tasks = report.tasks[: int(rest)]
        return report
    loader = _LOADERS.get(kind)
    if sep and rest and loader is not None:
        path, level = _level_suffix(spec, rest)
        report = loader(Path(path).expanduser(), spec, max_input_elements)
        if level is not None:
            report.tasks = [replace(t, level=level) for t in report.tasks]
        return report
    raise ValueError(
        f"tasks spec {spec!r}: expected 'builtin', 'builtin:N', 'dice:PATH', 'kernelbench:DIR', 'kernelbench-json:PATH', "
        "'alpaca:PATH' or 'jsonl:PATH' (a PATH may end in @level=N)"
    )


_LEVEL_SUFFIX = re.compile(r"^(?P<path>.+)@level=(?P<level>[^@/]*)$")


def _level_suffix(spec: str, rest: str) -> tuple[str, int | None]:
    """``(PATH, N)`` of a spec's ``PATH@level=N`` (``(PATH, None)`` without the suffix).

    Raises:
        ValueError: N is not a level 0..4 (the message names the spec).
    """
    m = _LEVEL_SUFFIX.match(rest)
    if m is None:
        return rest, None
    try:
        return m.group("path"), _level(m.group("level"))
    except TaskError:
        raise ValueError(f"tasks spec {spec!r}: @level= takes a level 0..4, got {m.group('level')!r}") from None


#: where a combined spec splits: a ``+`` followed by another spec's kind
_SPEC_SPLIT = re.compile(r"\+(?=builtin(?:\+|$|:)|(?:dice|kernelbench|kernelbench-json|alpaca|jsonl):)")


def _load_combined(spec: str, parts: list[str], cap: int | None) -> LoadReport:
    """The tasks of each spec of ``parts`` together (``A+B``), a task id seen before rejected as ``duplicate-id``."""
    report = LoadReport(spec)
    seen: set[str] = set()
    for part in parts:
        one = load_tasks(part, cap)
        report.files += one.files
        report.scaled += one.scaled
        report.rejected += one.rejected
        for t in one.tasks:
            if t.task_id in seen:
                report.rejected.append(Rejection(part, t.task_id, f"duplicate-id: task {t.task_id} is given by an "
                                                                  f"earlier spec of {spec!r}"))
                continue
            seen.add(t.task_id)
            report.tasks.append(t)
    return report


def split_tasks(tasks: list[Task], heldout_fraction: float) -> tuple[list[Task], list[Task]]:
    """Deterministic train / held-out split (``tasks.heldout_fraction``): sorted by (level, task id), every
    k-th task is held out, k = round(1 / heldout_fraction) (at least 2). ``dice-ray train``, ``dice-ray sft``
    and ``dice-ray eval --split`` all cut a task list this way, so the same list splits the same.

    Returns:
        ``(train, heldout)``, both in (level, task id) order; ``(tasks, [])`` for a fraction of 0 or fewer
        than 2 tasks.
    """
    if heldout_fraction <= 0 or len(tasks) < 2:
        return tasks, []
    k = max(2, round(1 / heldout_fraction))
    ordered = sorted(tasks, key=lambda t: (t.level, t.task_id))
    heldout = [t for i, t in enumerate(ordered) if i % k == k - 1]
    held = {t.task_id for t in heldout}
    return [t for t in ordered if t.task_id not in held], heldout


def select_tasks(tasks: list[Task], max_tasks: int | None, solution_variants: bool) -> list[Task]:
    """The tasks a run uses (``dice-ray train``, ``dice-ray sft``): the first ``max_tasks`` (``tasks.max_tasks``; None:
    all), without their :attr:`Task.solution_variants` unless ``solution_variants`` (``tasks.solution_variants``)."""
    return [t if solution_variants or not t.solution_variants else replace(t, solution_variants=())
            for t in tasks[:max_tasks]]


def phase_pool(tasks: list[Task], phase: str) -> list[Task]:
    """The tasks whose prompts serve ``phase`` (``"infill"`` or ``"e2e"``): those of :attr:`Task.role` ``phase`` when
    the list holds any (DICE's recipe: infilling from its infilling file, end-to-end from its end-to-end file),
    else those of role ``both``, else all of them (a run on one set alone poses it in both phases)."""
    for pick in (lambda t: t.role == phase, lambda t: t.role == "both"):
        pool = [t for t in tasks if pick(t)]
        if pool:
            return pool
    return list(tasks)


def _capped(task: Task, cap: int | None, report: LoadReport | None = None) -> Task:
    """``task``, its inputs scaled down to ``cap`` elements when needed and possible (noted in
    ``report.scaled``); TaskError ``inputs-too-large`` when they cannot be."""
    if cap is None:
        return task
    n = static_input_elements(task.reference_src)
    if n <= cap:
        return task
    src = scale_down_inputs(task.reference_src, cap)
    if src is None:
        raise TaskError(
            "inputs-too-large",
            f"get_inputs() allocates at least {n} elements, the cap is {cap}, and no size constant read "
            "only by get_inputs can be halved to fit",
        )
    (name, old), (_, new) = shape_constant(task.reference_src), shape_constant(src)  # type: ignore[misc]
    if report is not None:
        report.scaled.append(ScaledTask(task.task_id, name, old, new, static_input_elements(src)))
    return replace(task, reference_src=src)


def load_reference_file(path: str | Path) -> Task:
    """Read one KernelBench-format reference file as a :class:`Task` (no solution).

    The task id is ``file/<stem>``; the level is read from a ``level<N>`` parent folder (KernelBench
    layout) when there is one, else estimated from ``Model.forward`` (:func:`estimate_level`).

    Raises:
        FileNotFoundError: ``path`` does not exist or is not a regular file.
        TaskError: the file is not valid UTF-8 or breaks a reference rule (names the rule).
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"reference file {p} " + ("is not a regular file" if p.exists() else "does not exist"))
    try:
        src = p.read_text(encoding="utf-8-sig")
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
            ref = (folder / "reference.py").read_text(encoding="utf-8-sig")
            sol = (folder / "solution.py").read_text(encoding="utf-8-sig")
            report.files += [str(folder / "reference.py"), str(folder / "solution.py")]
            variants = []
            for path in sorted(folder.glob("solution_*.py")):  # slower honest variants (solution_slow.py)
                variants.append(path.read_text(encoding="utf-8-sig"))
                report.files.append(str(path))
            make_scaffold(sol, "fast")
            task = _capped(Task(f"builtin/L{level}/{name}", name, level, ref, sol, "fast", tuple(variants)), cap, report)
        except OSError as e:
            report.rejected.append(Rejection(str(folder), folder.name, f"missing-file: {e}"))
            continue
        except (TaskError, ScaffoldError) as e:
            report.rejected.append(Rejection(str(folder), folder.name, _reason(e)))
            continue
        report.tasks.append(task)
    return report


# ---------------------------------------------------------------------------------------------
# JSON record files (dice, kernelbench-json, alpaca, jsonl share the loop)
# ---------------------------------------------------------------------------------------------

#: (index, record) pairs of one file: list positions, ``"<split>/<i>"``, or 1-based line numbers.
_Entries = list[tuple[int | str, object]]
#: Turns one record (and its index) into a Task, or raises TaskError / ScaffoldError.
_RecordParser = Callable[[object, int | str], Task]


def _reason(e: Exception) -> str:
    if isinstance(e, TaskError):
        return str(e)
    if isinstance(e, ScaffoldError):
        return f"no-cuda-source: {e}"
    return f"{type(e).__name__}: {e}"


def _data_files(path: Path, suffixes: tuple[str, ...], what: str) -> list[Path]:
    """``[path]`` for a file, the ``suffixes`` files of a folder; FileNotFoundError when there is none."""
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in suffixes)
        if not files:
            raise FileNotFoundError(f"{what} folder {path} holds no {' or '.join(suffixes)} file")
        return files
    if path.exists():
        raise FileNotFoundError(f"{what} path {path} is neither a regular file nor a folder")
    raise FileNotFoundError(f"{what} path {path} does not exist")


def _read_bytes(file: Path) -> bytes:
    """The file's bytes, a leading UTF-8 byte-order mark dropped (RFC 8259 allows it); TaskError ``bad-json``
    (too large, unreadable) or ``empty-file``."""
    try:
        if file.stat().st_size > _MAX_JSON_BYTES:
            raise ValueError(f"file is larger than {_MAX_JSON_BYTES} bytes")
        data = file.read_bytes().removeprefix(codecs.BOM_UTF8)
    except (OSError, ValueError) as e:
        raise TaskError("bad-json", str(e)) from None
    if not data.strip():
        raise TaskError("empty-file", "the file holds no JSON")
    return data


def _decode(data: bytes, where: str = "") -> str:
    """``data`` as UTF-8 text; TaskError ``bad-json`` (with ``where``, e.g. ``"line 3: "``) when it is not."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TaskError("bad-json", f"{where}not UTF-8 text ({e.reason} at byte {e.start})") from None


def _read_text(file: Path) -> str:
    """The file's text; TaskError ``bad-json`` (too large, unreadable, not UTF-8) or ``empty-file``."""
    text = _decode(_read_bytes(file))
    if not text.strip():
        raise TaskError("empty-file", "the file holds no JSON")
    return text


def _json_loads(text: str, where: str = "") -> object:
    """``json.loads``; TaskError ``bad-json`` (with ``where``, e.g. ``"line 3: "``) when it fails."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise TaskError("bad-json", f"{where}{e}") from None
    except RecursionError:
        raise TaskError("bad-json", f"{where}nested too deeply for the JSON parser") from None


def _read_json(file: Path) -> object:
    return _json_loads(_read_text(file))


def _read_json_list(file: Path, report: LoadReport) -> _Entries:
    data = _read_json(file)
    if not isinstance(data, list):
        raise TaskError("not-a-list", f"top level is a {type(data).__name__}, expected a list")
    return list(enumerate(data))


def _read_json_lines(file: Path, report: LoadReport) -> _Entries:
    """One record a non-blank line; a line that is not UTF-8 JSON is rejected (its line number) here, the
    others kept."""
    entries: _Entries = []
    for n, raw in enumerate(_read_bytes(file).split(b"\n"), 1):  # not splitlines: JSON may hold U+2028
        try:
            line = _decode(raw, f"line {n}: ")
            if line.strip():
                entries.append((n, _json_loads(line, f"line {n}: ")))
        except TaskError as e:
            report.rejected.append(Rejection(str(file), n, str(e)))
    return entries


def _load_record_files(
    path: Path,
    spec: str,
    cap: int | None,
    what: str,
    suffixes: tuple[str, ...],
    read: Callable[[Path, LoadReport], _Entries],
    parser_for: Callable[[Path, _Entries], _RecordParser],
) -> LoadReport:
    """Read each file of ``path`` (``read``), parse each record (``parser_for(file, entries)``), cap."""
    report = LoadReport(spec)
    seen: dict[str, str] = {}  # task id -> where it was loaded from
    for file in _data_files(path, suffixes, what):
        report.files.append(str(file))
        first = len(report.rejected)
        try:
            entries = read(file, report)
        except TaskError as e:
            report.rejected.append(Rejection(str(file), "file", str(e)))
            continue
        parse = parser_for(file, entries)
        for index, rec in entries:
            try:
                task = parse(rec, index)
                if task.task_id in seen:
                    raise TaskError("duplicate-id", f"task id {task.task_id!r} was already loaded from {seen[task.task_id]}")
                task = _capped(task, cap, report)
            except (TaskError, ScaffoldError) as e:
                report.rejected.append(Rejection(str(file), index, _reason(e)))
                continue
            seen[task.task_id] = f"{file.name}[{index}]"
            report.tasks.append(task)
        # lines that did not decode were refused while reading, the others while parsing: list them in line order
        report.rejected[first:] = sorted(report.rejected[first:], key=lambda r: r.index if isinstance(r.index, int) else -1)
    return report


def _solution_format(src: str) -> str:
    """``"fast"`` when the solution calls ``load_cuda``, else ``"load_inline"``."""
    return "fast" if re.search(r"\bload_cuda\s*\(", src) else "load_inline"


def _checked_solution(src: str, field: str) -> tuple[str, str]:
    """``(src, format)``; TaskError ``bad-solution: <the broken rule>`` when it is not a valid solution."""
    fmt = _solution_format(src)
    try:
        validate_solution(src, fmt, field=field)
    except TaskError as e:
        raise TaskError("bad-solution", str(e)) from None
    return src, fmt


def _stem_id(stem: str, index: int | str) -> str:
    """``<stem>-<index>``, checked to be a clean id (the file stem comes from the user)."""
    return _record_id(f"{stem}/{index}".replace("/", "-"), "file stem")


# ---------------------------------------------------------------------------------------------
# DICE JSON
# ---------------------------------------------------------------------------------------------

_E2E_KEYS = ("idx", "level", "pytorch_code", "cuda_code")
_INFILL_KEYS = ("id", "pytorch_code", "cuda_code", "prefix", "middle", "suffix")
_REFERENCE_KEYS = ("pytorch_code",)


def _load_dice(path: Path, spec: str, cap: int | None) -> LoadReport:
    def parser_for(file: Path, entries: _Entries) -> _RecordParser:
        kind = _dice_kind([rec for _, rec in entries])
        return lambda rec, i: _dice_record(rec, kind, file.stem, i)  # type: ignore[arg-type]

    return _load_record_files(path, spec, cap, "DICE data", (".json",), _read_json_list, parser_for)


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
                    rec["pytorch_code"], rec["cuda_code"], "load_inline", role="infill")
    if kind == "reference":
        rec = _check_keys(rec, _REFERENCE_KEYS)  # no id of its own: the file stem and the index name it
        validate_reference(rec["pytorch_code"], field="pytorch_code")
        tid = _stem_id(stem, index)
        return Task(f"dice-{stem}/{index}", tid, estimate_level(rec["pytorch_code"]), rec["pytorch_code"])
    rec = _check_keys(rec, _E2E_KEYS)
    rid = _record_id(rec["idx"], "idx")
    level = _level(rec["level"])
    validate_reference(rec["pytorch_code"], field="pytorch_code")
    cuda = rec["cuda_code"]
    if cuda is None or (isinstance(cuda, str) and not cuda.strip()):
        return Task(f"dice-e2e/{rid}", f"e2e_{rid}", level, rec["pytorch_code"], role="e2e")
    if not isinstance(cuda, str):
        raise TaskError("not-a-string", f"cuda_code must be a str, got {type(cuda).__name__}")
    fmt = _solution_format(cuda)
    validate_solution(cuda, fmt, field="cuda_code")
    return Task(f"dice-e2e/{rid}", f"e2e_{rid}", level, rec["pytorch_code"], cuda, fmt, role="e2e")


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


#: most .py files a kernelbench:DIR folder may hold (KernelBench's four levels hold ~270): a wrong folder
#: (a home directory, a virtual environment) fails at once instead of parsing for minutes
MAX_KERNELBENCH_FILES = 5000
_SKIPPED_DIRS = {"__pycache__", "site-packages", "dist-packages", "node_modules"}


def _kernelbench_files(root: Path) -> list[Path]:
    """The ``.py`` files under ``root`` (sorted; hidden, cache and package folders skipped; names
    starting with ``_`` left out).

    Raises:
        ValueError: more than :data:`MAX_KERNELBENCH_FILES` of them.
    """
    files: list[Path] = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in _SKIPPED_DIRS)
        files += [Path(folder) / n for n in names if n.endswith(".py") and not n.startswith("_")]
        if len(files) > MAX_KERNELBENCH_FILES:
            raise ValueError(f"KernelBench folder {root}: more than {MAX_KERNELBENCH_FILES} .py files under it "
                             "(KernelBench's levels hold ~270): not a KernelBench folder? kernelbench:DIR takes the "
                             "folder holding level1/ ... level4/ or their .py references")
    return sorted(files)


def _load_kernelbench(root: Path, spec: str, cap: int | None) -> LoadReport:
    if not root.is_dir():
        what = "is not a folder" if root.exists() else "does not exist"
        raise FileNotFoundError(f"KernelBench folder {root} {what} (kernelbench:DIR takes a folder of .py references)")
    report = LoadReport(spec)
    for file in _kernelbench_files(root):
        report.files.append(str(file))
        rel = file.relative_to(root).with_suffix("").as_posix()
        try:
            src = file.read_text(encoding="utf-8-sig")
            validate_reference(src, field=f"{rel}.py")
            level = _level_from_path(file) or estimate_level(src)
            task = _capped(Task(f"kernelbench/{rel}", file.stem, level, src), cap, report)
        except UnicodeDecodeError as e:
            report.rejected.append(Rejection(str(file), rel, f"not-utf8: {e}"))
            continue
        except TaskError as e:
            report.rejected.append(Rejection(str(file), rel, _reason(e)))
            continue
        report.tasks.append(task)
    return report


# ---------------------------------------------------------------------------------------------
# KernelBench JSON (the Hugging Face dataset's rows)
# ---------------------------------------------------------------------------------------------

_KB_REFERENCE_KEYS = ("code", "pytorch_code", "ref_arch_src")


def _load_kernelbench_json(path: Path, spec: str, cap: int | None) -> LoadReport:
    def read(file: Path, report: LoadReport) -> _Entries:
        if file.suffix == ".jsonl":
            return _read_json_lines(file, report)
        data = _read_json(file)
        if isinstance(data, list):
            return list(enumerate(data))
        if isinstance(data, dict) and isinstance(data.get("problems"), list):
            return list(enumerate(data["problems"]))
        if isinstance(data, dict) and data and all(isinstance(v, list) for v in data.values()):
            return [(f"{split}/{i}", rec) for split, recs in data.items() for i, rec in enumerate(recs)]
        if isinstance(data, dict) and data and any(isinstance(v, list) for v in data.values()):
            bad = ", ".join(f"{k!r} is a {type(v).__name__}" for k, v in data.items() if not isinstance(v, list))
            raise TaskError("not-a-list", f"an object of splits must hold a list under every key: {bad}")
        raise TaskError(
            "not-a-list",
            f"top level is a {type(data).__name__}, expected a list, {{\"problems\": [...]}} or lists keyed by split",
        )

    return _load_record_files(
        path, spec, cap, "KernelBench JSON", (".json", ".jsonl"), read,
        lambda file, _: lambda rec, i: _kernelbench_record(rec, i, file.stem),
    )


def _kernelbench_record(rec: object, index: int | str, stem: str) -> Task:
    rec = _check_keys(rec, ())
    key = next((k for k in _KB_REFERENCE_KEYS if k in rec), None)
    if key is None:
        raise TaskError(
            "missing-key", f"record lacks a reference ({', '.join(_KB_REFERENCE_KEYS)}; has {', '.join(map(str, rec))})"
        )
    src = rec[key]
    validate_reference(src, field=key)
    level = rec.get("level")
    if level is None and isinstance(index, str):  # "<split>/<i>": the HF dataset's level_<N> splits
        m = re.fullmatch(r"level_?(\d)", index.split("/")[0].lower())
        level = int(m.group(1)) if m else None
    level = None if level is None else _level(level)
    name = rec.get("name", rec.get("problem_name"))
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise TaskError("bad-name", f"name must be a non-empty str, got {name!r}")
    pid = None if rec.get("problem_id") is None else _record_id(rec["problem_id"], "problem_id")
    key_ = pid
    if name is not None:
        key_ = re.sub(r"[^\w.\-]+", "_", name.strip().removesuffix(".py"))
        if pid is not None and not key_.startswith(f"{pid}_"):
            key_ = f"{pid}_{key_}"  # as KernelBench's file names: level1/19_ReLU.py
    if key_ is None:
        task_id = f"kernelbench-{stem}/{index}"
        key_ = _stem_id(stem, index)
    else:
        task_id = f"kernelbench/level{level}/{key_}" if level is not None else f"kernelbench/{key_}"
    return Task(task_id, name.strip() if name else key_, estimate_level(src) if level is None else level, src)


# ---------------------------------------------------------------------------------------------
# Alpaca-shape pairs (CuKe)
# ---------------------------------------------------------------------------------------------

_PYTHON_FENCES = frozenset({"", "python", "py", "python3"})
_MODEL_CLASS = re.compile(r"^class\s+Model\s*[(:]", re.MULTILINE)
_MODELNEW_CLASS = re.compile(r"^class\s+ModelNew\s*[(:]", re.MULTILINE)


def _code_blocks(text: str) -> list[str]:
    """The closed Markdown fenced blocks of ``text`` tagged python / py / python3 or untagged."""
    blocks: list[str] = []
    lang: str | None = None
    body: list[str] = []
    for line in text.splitlines():
        fence = line.strip().startswith("```")
        if lang is None and fence:
            lang, body = line.strip()[3:].strip().lower(), []
        elif lang is not None and fence:
            if lang in _PYTHON_FENCES:
                blocks.append("\n".join(body) + "\n")
            lang = None
        elif lang is not None:
            body.append(line)
    return blocks


def _text(rec: dict, key: str) -> str:
    value = rec.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise TaskError("not-a-string", f"{key} must be a str, got {type(value).__name__}")
    return value


def _load_alpaca(path: Path, spec: str, cap: int | None) -> LoadReport:
    return _load_record_files(
        path, spec, cap, "Alpaca data", (".json",), _read_json_list,
        lambda file, _: lambda rec, i: _alpaca_record(rec, i, file.stem),
    )


def _alpaca_record(rec: object, index: int | str, stem: str) -> Task:
    rec = _check_keys(rec, ())
    if "prompt" in rec:
        prompt_key, answer_key, candidates = "prompt", "response", _code_blocks(_text(rec, "prompt"))
    elif "instruction" in rec:
        prompt_key, answer_key = "instruction + input", "output"
        candidates = _code_blocks(_text(rec, "instruction") + "\n" + _text(rec, "input")) + [_text(rec, "input")]
    else:
        raise TaskError("missing-key", f"record lacks prompt or instruction (has {', '.join(map(str, rec)) or 'none'})")
    ref = next((c for c in candidates if _MODEL_CLASS.search(c) and "get_inputs" in c), None)
    if ref is None:
        raise TaskError("no-reference-block", f"{prompt_key} holds no ```python block with class Model and get_inputs")
    validate_reference(ref, field=f"the reference block of {prompt_key}")
    tid = _stem_id(stem, index)
    answer = _text(rec, answer_key)
    if not answer.strip():
        return Task(f"alpaca-{stem}/{index}", tid, estimate_level(ref), ref)
    blocks = [b for b in _code_blocks(answer) if _MODELNEW_CLASS.search(b)]
    if not blocks and _MODELNEW_CLASS.search(answer):
        blocks = [answer]  # a bare module, no fences
    if not blocks:
        raise TaskError("bad-solution", f"{answer_key} holds no ```python block with class ModelNew")
    sol, fmt = _checked_solution(blocks[-1], f"the solution block of {answer_key}")
    return Task(f"alpaca-{stem}/{index}", tid, estimate_level(ref), ref, sol, fmt)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# JSON Lines
# ---------------------------------------------------------------------------------------------


def _load_jsonl(path: Path, spec: str, cap: int | None) -> LoadReport:
    return _load_record_files(
        path, spec, cap, "JSON Lines", (".jsonl",), _read_json_lines,
        lambda file, _: lambda rec, i: _jsonl_record(rec, i, file.stem),
    )


def _jsonl_record(rec: object, line: int | str, stem: str) -> Task:
    rec = _check_keys(rec, ())
    ref_key = next((k for k in ("reference", "pytorch_code") if k in rec), None)
    if ref_key is None:
        raise TaskError("missing-key", f"record lacks reference (or pytorch_code; has {', '.join(map(str, rec)) or 'none'})")
    ref = rec[ref_key]
    validate_reference(ref, field=ref_key)
    rid = _record_id(rec["id"], "id") if "id" in rec else str(line)
    _stem_id(stem, rid)  # checks the stem's characters
    level = estimate_level(ref) if rec.get("level") is None else _level(rec["level"])
    name = rec.get("name", f"{stem}_{rid}")
    if not isinstance(name, str) or not name.strip():
        raise TaskError("bad-name", f"name must be a non-empty str, got {name!r}")
    sol_key = next((k for k in ("solution", "cuda_code") if k in rec), None)
    sol = None if sol_key is None else rec[sol_key]
    if sol is None or (isinstance(sol, str) and not sol.strip()):
        return Task(f"jsonl-{stem}/{rid}", name.strip(), level, ref)
    if not isinstance(sol, str):
        raise TaskError("bad-solution", f"{sol_key} must be a str, got {type(sol).__name__}")
    sol, fmt = _checked_solution(sol, sol_key)  # type: ignore[arg-type]
    return Task(f"jsonl-{stem}/{rid}", name.strip(), level, ref, sol, fmt)  # type: ignore[arg-type]


_LOADERS: dict[str, Callable[[Path, str, int | None], LoadReport]] = {
    "dice": _load_dice,
    "kernelbench": _load_kernelbench,
    "kernelbench-json": _load_kernelbench_json,
    "alpaca": _load_alpaca,
    "jsonl": _load_jsonl,
}
