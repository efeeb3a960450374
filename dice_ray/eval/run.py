"""``dice-ray eval``: verify candidates of a task set, from a policy or a solutions folder, and report.

Candidates come from one of two sources:

* ``--model PATH`` (a folder written by :meth:`DiffusionPolicy.save`, a checkpoint folder or hub id, or a
  ``dice-ray train`` run directory: its newest checkpoint's policy, :func:`~dice_ray.policy.policy.run_policy`): for every task,
  ``samples`` completions of ``phase`` posed as the rollout workers pose it
  (:func:`dice_ray.policy.task_sampling.sample_task_group`: the phase's prompt, template ``tasks.prompt_template``;
  LLaDA / Dream infill the middle between the scaffold's sides; ``sampling`` section, seed ``rl.seed + task
  index``), each turned into a candidate by :func:`~dice_ray.tasks.prompts.assemble_candidate`; on cuda:0 when
  there is a GPU.  ``infill`` needs the task's solution to cut:
  tasks without one are skipped (listed, not counted);
* ``--solutions DIR``: given files, no model.  Layout: ``DIR/<key>.py`` is one sample of a task,
  or ``DIR/<key>/*.py`` several (in file-name order), where ``<key>`` is the task id with every
  ``/`` replaced by ``__`` (``builtin__L1__relu.py``, ``dice-e2e__17.py``) or the task's name
  (``relu.py``) when no other task of the set shares it.  Tasks without a file count as failed
  (KernelBench); files that match no task are listed as ``unmatched``.

Verification: with a Ray cluster (``cluster.address`` or ``RAY_ADDRESS``) that has GPUs, a
:class:`~dice_ray.cluster.verifier_pool.VerifierPool` sized as the trainer sizes it; otherwise an
in-process :class:`~dice_ray.verify.verifier.Verifier` (GPU when ``torch.cuda.is_available()``,
else compile-only: then correctness and speed are not measured, and the report says so).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dice_ray.config import DiceConfig, TasksConfig, load_config
from dice_ray.eval.metrics import DEFAULT_KS, DEFAULT_PS, compute_metrics
from dice_ray.eval.report import hardware_name, write_report
from dice_ray.tasks.loaders import load_tasks, split_tasks
from dice_ray.tasks.task import Task
from dice_ray.verify.verdict import Verdict

#: ``[(candidate_id, task, source), ...] -> verdicts in order``
VerifyFn = Callable[[list[tuple[str, Task, str]]], list[Verdict]]


class EvalInputError(ValueError):
    """Unusable eval or curate input (no task accepted, unreadable solution file, bad phase ...)."""


@dataclass
class Candidate:
    """One candidate to verify: its task, sample index, source and where it came from.

    ``source`` is the file's raw bytes when they are not UTF-8: the verifier gives that candidate
    its ``compile_error`` verdict (naming the byte) and the others are verified as usual."""

    task: Task
    sample: int
    source: str | bytes
    origin: str  # a file path, or "model"

    @property
    def candidate_id(self) -> str:
        return f"{self.task.task_id}#{self.sample}"


#: ``dice-ray eval --split``: which part of the task list (:func:`~dice_ray.tasks.loaders.split_tasks`)
SPLITS = ("all", "heldout", "train")


def run_tasks_config(model: str | Path | None) -> TasksConfig | None:
    """The ``tasks`` section of ``model`` when it is a ``dice-ray train`` run directory (its ``config.yaml`` beside
    ``checkpoints/``), else None.

    Raises:
        EvalInputError: the run's ``config.yaml`` does not parse as a dice-ray config.
    """
    if model is None or not (Path(model) / "config.yaml").is_file() or not (Path(model) / "checkpoints").is_dir():
        return None
    from pydantic import ValidationError

    try:
        return load_config(Path(model) / "config.yaml").tasks
    except (ValidationError, ValueError, OSError) as e:
        raise EvalInputError(f"--model {model}: its config.yaml is not a dice-ray config ({str(e).splitlines()[0]})") from None


def load_eval_tasks(spec: str, cfg: DiceConfig, log: Callable[[str], None] = lambda s: None,
                    split: str = "all", split_from: TasksConfig | None = None) -> list[Task]:
    """The tasks of ``spec`` (``tasks.max_input_elements`` cap): the ``split`` part, then the first
    ``tasks.max_tasks`` of it. ``log`` gets the load summary, one line a rejected record (file, index or line,
    reason; :meth:`~dice_ray.tasks.loaders.LoadReport.rejection_lines`) and the split's.

    ``split`` is ``all``, or the ``heldout`` / ``train`` part of the split a ``dice-ray train`` run made
    (:func:`~dice_ray.tasks.loaders.split_tasks`): with ``split_from`` (the run's ``tasks`` section,
    :func:`run_tasks_config`), that run's split (its ``max_tasks`` first, then its ``heldout_fraction``); without,
    a default run's (all tasks, ``cfg.tasks.heldout_fraction``). So ``tasks.max_tasks`` here never moves a
    training task into the held-out part: it takes the first N of the part.

    Raises:
        EvalInputError: no task was accepted, or the split is unknown or empty.
        ValueError, FileNotFoundError: see :func:`dice_ray.tasks.loaders.load_tasks`.
    """
    if split not in SPLITS:
        raise EvalInputError(f"--split {split!r}: one of {', '.join(SPLITS)}")
    report = load_tasks(spec, max_input_elements=cfg.tasks.max_input_elements)
    log(f"tasks {report.summary()}")
    for line in report.rejection_lines():
        log(f"  {line}")
    tasks = report.tasks
    if not tasks:
        raise EvalInputError(f"tasks {spec!r}: no task accepted ({report.summary()})")
    if split != "all":
        by = split_from or cfg.tasks
        made = (f"the run's split (tasks.spec={by.spec}, tasks.max_tasks={by.max_tasks}, "
                f"tasks.heldout_fraction={by.heldout_fraction})" if split_from is not None else
                f"a default run's split (all tasks, tasks.heldout_fraction={by.heldout_fraction})")
        if split_from is not None and split_from.spec != spec:
            log(f"note: the run trained on tasks {split_from.spec!r}, not {spec!r}: its split is applied to {spec!r}")
        pool = tasks[: by.max_tasks] if split_from is not None else tasks  # max_tasks None: all
        train, heldout = split_tasks(pool, by.heldout_fraction)
        tasks = heldout if split == "heldout" else train
        if not tasks:
            raise EvalInputError(f"--split {split}: no task in that part of {len(pool)}, by {made}")
        first = f"; tasks.max_tasks={cfg.tasks.max_tasks}: the first of them" if cfg.tasks.max_tasks else ""
        log(f"split {split}: {len(tasks)} of {len(pool)} tasks, by {made}{first}")
    return tasks[: cfg.tasks.max_tasks]  # None: all


def solution_key(task: Task) -> str:
    """The file stem of ``task`` in a solutions folder: its id with ``/`` replaced by ``__``."""
    return task.task_id.replace("/", "__")


def solution_candidates(tasks: list[Task], folder: str | Path) -> tuple[list[Candidate], list[str]]:
    """Candidates read from a solutions folder (layout in the module docstring).

    Returns:
        (candidates in task order, unmatched file or folder names).  A file that is not UTF-8 is a
        candidate all the same (its bytes as ``source``: one verdict, ``compile_error``).
    Raises:
        FileNotFoundError: ``folder`` is not a directory.
        EvalInputError: a solution file cannot be read (the OS refused, naming the file).
    """
    root = Path(folder)
    if not root.is_dir():
        raise FileNotFoundError(f"solutions folder {root} does not exist")
    names: dict[str, int] = {}
    for t in tasks:
        names[t.name] = names.get(t.name, 0) + 1
    by_key: dict[str, Task] = {solution_key(t): t for t in tasks}
    by_key.update({t.name: t for t in tasks if names[t.name] == 1 and t.name not in by_key})
    files: dict[str, list[Path]] = {}
    unmatched = []
    for entry in sorted(root.iterdir()):
        key = entry.stem if entry.is_file() and entry.suffix == ".py" else entry.name if entry.is_dir() else None
        task = by_key.get(key) if key is not None else None
        if task is None:
            if not entry.name.startswith((".", "_")):
                unmatched.append(entry.name)
            continue
        paths = [entry] if entry.is_file() else sorted(p for p in entry.glob("*.py") if p.is_file())
        files.setdefault(task.task_id, []).extend(paths)
    out = []
    for task in tasks:
        for j, path in enumerate(files.get(task.task_id, [])):
            try:
                raw = path.read_bytes()
            except OSError as e:
                raise EvalInputError(f"solution file {path} cannot be read ({e.strerror or e})") from None
            try:
                src: str | bytes = raw.decode("utf-8")
            except UnicodeDecodeError:
                src = raw  # not text: its own verdict, not the end of the run
            out.append(Candidate(task, j, src, str(path)))
    return out, unmatched


def model_candidates(
    tasks: list[Task], model: str | Path, samples: int, phase: str, cfg: DiceConfig
) -> tuple[list[Candidate], dict[str, str], dict[str, str]]:
    """Sample ``samples`` completions a task from the policy saved in ``model``.

    Returns:
        (candidates, skipped, failed): ``skipped`` maps the tasks ``phase`` cannot pose (infill
        without a solution) to the reason, they leave the evaluated set; ``failed`` maps tasks
        whose sampling raised (e.g. prompt longer than the model's positions) to the error,
        they stay in the set and count as failed.
    Raises:
        FileNotFoundError: ``model`` is not a saved policy folder.
        EvalInputError: ``samples < 1`` or an unknown ``phase``.
    """
    from dice_ray.policy.policy import DiffusionPolicy
    from dice_ray.policy.task_sampling import sample_task_group
    from dice_ray.tasks.prompts import PHASES

    if phase not in PHASES:
        raise EvalInputError(f"--phase must be one of {PHASES}, got {phase!r}")
    if samples < 1:
        raise EvalInputError(f"--samples must be >= 1, got {samples}")
    policy = DiffusionPolicy.load(model)
    import torch

    if torch.cuda.is_available():  # sampling on the GPU the verifier times on: the tiny policy is small
        policy.to("cuda")
    out: list[Candidate] = []
    skipped: dict[str, str] = {}
    failed: dict[str, str] = {}
    for i, task in enumerate(tasks):
        if phase == "infill" and task.solution_src is None:
            skipped[task.task_id] = "infill needs a solution to cut; the task has none"
            continue
        try:
            _, sources = sample_task_group(policy, task, phase, cfg.tasks.prompt_template,
                                           cfg.phase.scaffold_granularity, samples, cfg.sampling, cfg.rl.seed + i)
        except ValueError as e:
            failed[task.task_id] = f"sampling failed: {e}"
            continue
        out += [Candidate(task, j, source, "model") for j, source in enumerate(sources)]
    return out, skipped, failed


def ray_address(cfg: DiceConfig) -> str | None:
    """The Ray cluster to use: ``cluster.address``, else ``RAY_ADDRESS``, else None (no Ray)."""
    return cfg.cluster.address or os.environ.get("RAY_ADDRESS") or None


def ray_gpus(cfg: DiceConfig) -> int:
    """GPUs of the configured Ray cluster (connecting to it); 0 without a cluster or in compile-only mode."""
    address = ray_address(cfg)
    if address is None or cfg.verify.mode == "compile_only":
        return 0
    import ray

    from dice_ray.cluster.scheduler import NAMESPACE

    if not ray.is_initialized():
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, logging_level="ERROR")
    return int(ray.cluster_resources().get("GPU", 0))


@contextmanager
def open_verifier(cfg: DiceConfig) -> Iterator[tuple[VerifyFn, str]]:
    """A verify function and its description, closed on exit.

    A Ray cluster with GPUs (:func:`ray_gpus`) gets an unnamed VerifierPool sized like the
    trainer's (``cluster.num_verifiers`` or one a GPU, ``cluster.verifier_gpus`` each, the same
    call timeout); anything else an in-process Verifier (``verify`` section).

    Raises:
        RuntimeError: ``verify.mode == "gpu"`` and no GPU is visible.
    """
    gpus = ray_gpus(cfg)
    if gpus:
        import ray

        from dice_ray.cluster.verifier_pool import VerifierPool
        from dice_ray.verify.verifier import AUTO_GPU_WORKERS

        n = cfg.cluster.num_verifiers or gpus
        workers = cfg.verify.workers or AUTO_GPU_WORKERS
        call_timeout = cfg.verify.compile_timeout_s + (3 + workers) * cfg.verify.run_timeout_s + 60
        pool = VerifierPool.remote(cfg.verify, cfg.reward, n, cfg.cluster.verifier_gpus, call_timeout, None,
                                   "dice-ray-eval")
        try:
            yield (lambda items: ray.get(pool.verify_batch.remote(items))), (
                f"Ray VerifierPool ({n} actor(s), {cfg.cluster.verifier_gpus:g} GPU each)")
        finally:
            try:
                ray.get(pool.close.remote(), timeout=60)
            finally:
                ray.kill(pool)
        return
    from dice_ray.verify.verifier import Verifier

    verifier = Verifier(cfg.verify, cfg.reward)
    try:
        where = f"GPU cuda:{verifier.device}" if verifier.mode == "gpu" else "compile-only"
        yield (lambda items: verifier.verify_many([(t, src, cid) for cid, t, src in items])), (
            f"in-process Verifier ({where}, {verifier.workers} worker(s))")
    finally:
        verifier.close()


def evaluate(
    tasks_spec: str,
    cfg: DiceConfig,
    out_dir: str | Path,
    *,
    model: str | Path | None = None,
    solutions: str | Path | None = None,
    samples: int = 1,
    phase: str = "e2e",
    split: str = "all",
    log: Callable[[str], None] = lambda s: None,
) -> dict[str, Any]:
    """Evaluate a policy (``model``) or a solutions folder (``solutions``) on ``tasks_spec``.

    Exactly one of ``model`` and ``solutions`` is given.  Writes ``results.json``, ``results.md``
    and ``results.png`` into ``out_dir`` (:func:`dice_ray.eval.report.write_report`).  ``split`` picks the
    tasks as :func:`load_eval_tasks` does (``heldout``: those ``dice-ray train`` kept out of SFT and RL; the split
    of the run itself when ``model`` is a run directory).

    Returns:
        The result dict written to ``results.json`` (``metrics``, ``candidates`` with one verdict
        each, ``hardware``, ``verifier``, ``missing``, ``skipped``, ``unmatched``, ...).
    Raises:
        EvalInputError: neither or both sources, ``out_dir`` cannot be created, no task, bad phase /
            samples, unreadable solution.
        FileNotFoundError: the tasks path, the model or the solutions folder does not exist.
        FileNotFoundError / ValueError: the model folder lacks a file its format needs or has a bad config
            (:meth:`~dice_ray.policy.policy.DiffusionPolicy.check_path`).
        RuntimeError: ``verify.mode == "gpu"`` without a GPU.
    """
    if (model is None) == (solutions is None):
        raise EvalInputError("give exactly one of --model PATH and --solutions DIR")
    try:  # before any work: a run that verified everything must not fail at the end for want of a folder
        Path(out_dir).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise EvalInputError(f"--out {out_dir}: cannot create the folder ({e.strerror or e})") from None
    tasks = load_eval_tasks(tasks_spec, cfg, log, split, run_tasks_config(model) if split != "all" else None)
    skipped: dict[str, str] = {}
    failed: dict[str, str] = {}
    unmatched: list[str] = []
    if model is not None:
        from dice_ray.policy.policy import DiffusionPolicy

        model = DiffusionPolicy.check_path(model)  # a broken folder or unknown hub id fails here, before sampling
        log(f"sampling {samples} completion(s) a task from {model} ({phase}) on {len(tasks)} task(s)")
        cands, skipped, failed = model_candidates(tasks, model, samples, phase, cfg)
        source = f"model {model} ({phase}, {samples} sample(s) a task)"
    else:
        cands, unmatched = solution_candidates(tasks, solutions)
        if unmatched:
            log(f"note: {len(unmatched)} entr(ies) of {solutions} match no task: {', '.join(unmatched[:5])}")
        source = f"solutions {solutions}"
        samples = max([c.sample + 1 for c in cands], default=0)
    evaluated = [t for t in tasks if t.task_id not in skipped]
    if not evaluated:
        raise EvalInputError(f"no task of {tasks_spec!r} can be evaluated in phase {phase!r} ({len(skipped)} skipped)")
    log(f"verifying {len(cands)} candidate(s) of {len(evaluated)} task(s)")
    with open_verifier(cfg) as (verify, verifier_desc):
        verdicts = verify([(c.candidate_id, c.task, c.source) for c in cands])
    by_task: dict[str, list[Verdict]] = {}
    for v in verdicts:
        by_task.setdefault(v.task_id, []).append(v)
    metrics = compute_metrics([(t.task_id, t.level) for t in evaluated], by_task, DEFAULT_PS,
                              [k for k in DEFAULT_KS if k <= max(samples, 1)])
    result = {
        "source": source,
        "tasks_spec": tasks_spec,
        "split": split,
        "hardware": hardware_name(verdicts),
        "verifier": verifier_desc,
        "verify_config": cfg.verify.model_dump(mode="json"),
        "samples_per_task": samples,
        "tasks": [{"task_id": t.task_id, "name": t.name, "level": t.level} for t in evaluated],
        "candidates": [
            {"task_id": c.task.task_id, "sample": c.sample, "candidate_id": c.candidate_id, "origin": c.origin,
             "source": c.source if isinstance(c.source, str) else c.source.decode("utf-8", "replace"),
             "verdict": v.model_dump(mode="json")}
            for c, v in zip(cands, verdicts)
        ],
        "metrics": metrics,
        "missing": sorted({t.task_id for t in evaluated} - set(by_task)),
        "sampling_failed": failed,
        "skipped": skipped,
        "unmatched": unmatched,
    }
    paths = write_report(result, out_dir)
    log(f"wrote {', '.join(str(p) for p in paths.values())}")
    return result
