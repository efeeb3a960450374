"""Honest kernels from the field are accepted: the honest corpus through the real compile-only verifier.

Reads a corpus folder (default ``tests/corpus/honest/``: its ``manifest.yaml`` says what an entry is), verifies
every entry with a compile-only :class:`~dice_ray.verify.verifier.Verifier` (static rules, the nvcc / g++ build of
its ``load_inline`` extensions, the dry run), and prints one line an entry (its verdict, rule, seconds and, for a
refusal, the reason), then the ok rate over the corpus.  Entries are ``<file>.py`` solutions of the folder paired
with a built-in task, and ``dice-infill/N`` records of DICE's infilling file read from the DICE data folder
(``--dice``; skipped, and said so, when it is absent).  A cold build takes 15-20 s an entry on 2 CPU cores (the
first about 60 s more: the precompiled torch header); ``--cache`` keeps the builds (default: a fresh folder).

    python benchmarks/honest_corpus.py [--corpus DIR] [--dice DIR] [--only NAME,...] [--cache DIR]
        [--target 0.95] [--json OUT] [--mode compile_only|gpu]

With ``--mode gpu`` (a GPU machine) each entry is also run, checked against its reference and timed: the
correct verdict of an honest entry is then ``ok`` with ``correct`` true.

Exits 1 when the ok rate is under ``--target`` or an entry's verdict is not the one its manifest expects (an
expected refusal counts as a refusal in the rate, and must come with its rule and a ``why``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / "tests" / "corpus" / "honest"
DICE_DATA = Path(os.environ.get("DICE_DATA_DIR", REPO.parent / "shared" / "data" / "dice"))

__all__ = ["CORPUS", "DICE_DATA", "Entry", "load_corpus", "main"]


@dataclass(frozen=True)
class Entry:
    """One corpus entry, ready to verify.

    Attributes:
        name: its manifest key (``kb_example_add.py``, ``dice-infill/6035``).
        task: the :class:`~dice_ray.tasks.task.Task` it solves (its reference).
        candidate: the solution's source.
        config: VerifyConfig fields its verdict is for (``{}``: the defaults).
        expect: ``{"verdict": "ok"}`` or an expected refusal ``{"verdict", "rule", "why"}``.
        meta: the manifest's other fields (``source``, ``licence``, ``kinds``).
    """

    name: str
    task: Any
    candidate: str
    config: dict[str, Any] = field(default_factory=dict)
    expect: dict[str, Any] = field(default_factory=lambda: {"verdict": "ok"})
    meta: dict[str, Any] = field(default_factory=dict)


def load_corpus(corpus: Path = CORPUS, dice: Path = DICE_DATA) -> tuple[list[Entry], list[str]]:
    """The entries of ``corpus``'s ``manifest.yaml`` (see its header for the fields; a folder of other solutions
    may also name, instead of a built-in ``task``, a ``reference`` file relative to the folder, and the solution's
    ``file`` when the entry's name is not its path).

    Returns:
        ``(entries, skipped)``: the entries in manifest order, and the names of DICE entries left out because
        ``dice`` lacks their file.
    Raises:
        ValueError: an entry is malformed (no task or DICE record, an unknown built-in task, a missing file or
            record, an expected refusal without its rule and ``why``); the message names the entry.
    """
    from dice_ray.tasks.loaders import load_reference_file, load_tasks
    from dice_ray.tasks.task import Task

    manifest = yaml.safe_load((corpus / "manifest.yaml").read_text())
    builtin = {t.task_id: t for t in load_tasks("builtin").tasks}
    records: dict[str, dict[Any, dict]] = {}
    entries, skipped = [], []
    for name, spec in manifest.items():
        expect = spec.get("expect", "ok")
        expect = {"verdict": expect} if isinstance(expect, str) else dict(expect)
        if expect["verdict"] != "ok" and not (expect.get("rule") and expect.get("why")):
            raise ValueError(f"{name}: an expected refusal needs its rule and a why")
        meta = {k: spec.get(k) for k in ("source", "licence", "kinds")}
        if "dice" in spec:
            file = dice / spec["dice"]["file"]
            if not file.is_file():
                skipped.append(name)
                continue
            if file.name not in records:
                records[file.name] = {r["id"]: r for r in json.loads(file.read_text())}
            rec = records[file.name].get(spec["dice"]["id"])
            if rec is None:
                raise ValueError(f"{name}: no record {spec['dice']['id']!r} in {file}")
            task = Task(f"dice-{name}", f"dice_{spec['dice']['id']}", 1, rec["pytorch_code"])
            candidate = rec["cuda_code"]
        else:
            path = corpus / spec.get("file", name)
            if not path.is_file():
                raise ValueError(f"{name}: no such file in {corpus}")
            if "reference" in spec:  # a KernelBench-format reference file, relative to the corpus folder
                task = load_reference_file(corpus / spec["reference"])
            elif spec.get("task") in builtin:
                task = builtin[spec["task"]]
            else:
                raise ValueError(f"{name}: task {spec.get('task')!r} is not a built-in task (or give a reference file)")
            candidate = path.read_text()
        entries.append(Entry(name, task, candidate, dict(spec.get("config") or {}), expect, meta))
    return entries, skipped


def _matches(verdict: Any, expect: dict[str, Any]) -> bool:
    return verdict.verdict == expect["verdict"] and (expect["verdict"] == "ok" or verdict.rule == expect.get("rule"))


def main(argv: list[str] | None = None) -> int:
    """Verify the corpus compile-only; print the verdicts and the ok rate (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", type=Path, default=CORPUS, help="folder with manifest.yaml")
    ap.add_argument("--dice", type=Path, default=DICE_DATA, help="DICE data folder (dice-infill/N entries)")
    ap.add_argument("--only", default="", help="comma-separated entry names")
    ap.add_argument("--cache", type=Path, default=None, help="load_inline build cache (default: a fresh folder)")
    ap.add_argument("--target", type=float, default=0.95, help="least ok rate")
    ap.add_argument("--json", type=Path, default=None, help="write the verdicts here")
    ap.add_argument("--mode", default="compile_only", choices=("compile_only", "gpu", "auto"),
                    help="VerifyConfig.mode: gpu also runs, checks and times every entry")
    args = ap.parse_args(argv)

    from dice_ray.config import RewardConfig, VerifyConfig
    from dice_ray.verify.verifier import Verifier

    entries, skipped = load_corpus(args.corpus, args.dice)
    if args.only:
        wanted = set(args.only.split(","))
        entries = [e for e in entries if e.name in wanted]
    cache = args.cache or Path(tempfile.mkdtemp(prefix="honest-corpus-"))
    for name in skipped:
        print(f"{name:44s} skipped: no DICE data at {args.dice}")
    rows = []
    t_all = time.monotonic()
    groups: dict[str, list[Entry]] = {}
    for e in entries:
        groups.setdefault(json.dumps(e.config, sort_keys=True), []).append(e)
    for key, group in groups.items():  # one Verifier a config; its workers verify (and build) side by side
        cfg = VerifyConfig(mode=args.mode, inline_cache_dir=str(cache), compile_timeout_s=120.0, run_timeout_s=60.0,
                           **json.loads(key))
        with Verifier(cfg, RewardConfig()) as verifier:
            verdicts = verifier.verify_many([(e.task, e.candidate, e.name) for e in group])
        for e, v in zip(group, verdicts):
            good = _matches(v, e.expect)
            rows.append({"name": e.name, "verdict": v.verdict, "rule": v.rule, "expected": e.expect["verdict"],
                         "as_expected": good, "seconds": round(v.seconds, 2), "mode": v.mode,
                         "compile_s": v.stage_seconds.get("compile"), "reason": v.reason[:2000]})
            note = "" if v.verdict == "ok" else f"  {' '.join(v.reason.split())[:160]}"
            mark = "" if good else f"  EXPECTED {e.expect['verdict']}" + (f" [{e.expect.get('rule')}]" if e.expect.get("rule") else "")
            print(f"{e.name:44s} {v.verdict:13s} {v.rule or '-':18s} {v.seconds:6.1f}s{mark}{note}", flush=True)
    n = len(rows)
    ok = sum(r["verdict"] == "ok" for r in rows)
    wrong = [r["name"] for r in rows if not r["as_expected"]]
    rate = ok / n if n else 0.0
    print(f"\n{ok}/{n} ok ({100 * rate:.1f} %), {n - ok} refused ({n - ok - len(wrong)} as the manifest expects), "
          f"{len(wrong)} not as expected{': ' + ', '.join(wrong) if wrong else ''}; {len(skipped)} skipped; "
          f"{time.monotonic() - t_all:.0f} s")
    if args.json:
        args.json.write_text(json.dumps({"ok_rate": rate, "ok": ok, "entries": n, "skipped": skipped, "rows": rows},
                                        indent=1))
    return 0 if n and rate >= args.target and not wrong else 1


if __name__ == "__main__":
    sys.exit(main())
