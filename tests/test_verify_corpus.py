"""The verifier's cheat and fault corpus on CPU: manifests, static rules, compile-only verdicts, faults.

``tests/corpus/cheats/`` holds one fast-format candidate per known cheat (DESIGN.md's list and
issue 3's static rules), ``tests/corpus/faults/`` candidates that break the worker; each folder's
``manifest.yaml`` gives the task and the expected verdicts (field meanings in the manifests).  Here,
without a GPU: every file parses and is listed, every cheat's static rule is the one
:func:`dice_ray.verify.rules.check.check_candidate` reports, a few cheats and faults get their
compile-only verdicts, and after each fault the same Verifier still verifies the honest relu
solution as ok.  The GPU side is ``test_verify_corpus_gpu.py``.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path
from typing import Any, get_args

import pytest
import yaml

from dice_ray.config import RewardConfig, VerifyConfig
from dice_ray.tasks.loaders import load_tasks
from dice_ray.verify.rules.catalog import RULES
from dice_ray.verify.rules.check import check_candidate
from dice_ray.verify.verdict import Verdict, VerdictKind
from dice_ray.verify.verifier import Verifier

CORPUS = Path(__file__).resolve().parent / "corpus"
CHEATS: dict[str, dict[str, Any]] = yaml.safe_load((CORPUS / "cheats" / "manifest.yaml").read_text())
FAULTS: dict[str, dict[str, Any]] = yaml.safe_load((CORPUS / "faults" / "manifest.yaml").read_text())
RELU = "builtin/L1/relu"
# compile-only limits: the fan-out compile bomb runs into compile_timeout_s
LIMITS = dict(mode="compile_only", workers=1, compile_timeout_s=4.0, run_timeout_s=4.0)


@functools.cache
def builtin_tasks() -> dict[str, Any]:
    return {t.task_id: t for t in load_tasks("builtin").tasks}


def source(kind: str, name: str) -> str:
    return (CORPUS / kind / name).read_text()


def alternatives(expect: Any) -> list[dict[str, Any]]:
    """A manifest expectation (a mapping, a list of mappings, or null) as a list of mappings."""
    if expect is None:
        return []
    return list(expect) if isinstance(expect, list) else [expect]


# -- manifests and static rules (no worker) -----------------------------------------------------
def test_manifests_list_every_file_and_every_file_parses():
    verdicts = set(get_args(VerdictKind))
    for kind, manifest in (("cheats", CHEATS), ("faults", FAULTS)):
        files = {p.name for p in (CORPUS / kind).glob("*.py")}
        assert files == set(manifest), f"{kind}: files without an entry {files - set(manifest)}, " \
                                       f"entries without a file {set(manifest) - files}"
        for name, entry in manifest.items():
            ast.parse(source(kind, name), filename=name)
            assert entry["task"] in builtin_tasks(), (name, entry["task"])
            assert entry["verdict"] in verdicts, (name, entry["verdict"])
            expects = [entry, *alternatives(entry.get("runtime")), *alternatives(entry.get("compile_only"))]
            for e in expects:
                if isinstance(e, dict):
                    assert e["verdict"] in verdicts, (name, e)
                    assert e.get("rule") is None or e["rule"] in RULES, (name, e)
            for rule in [entry.get("static"), *entry.get("static_also", [])]:
                assert rule is None or rule in RULES, (name, rule)


@pytest.mark.parametrize("name", sorted(CHEATS))
def test_cheat_static_rule(name):
    """The static layer reports exactly the manifest's rule first (the verdict's rule), and the others."""
    entry = CHEATS[name]
    report = check_candidate(source("cheats", name))
    found = [str(v) for v in report.violations]
    if entry["static"] is None:
        assert report.ok, f"{name}: expected no static rule (run-time layer only), got {found}"
        assert entry["verdict"] in ("incorrect", "cheat") and entry.get("runtime"), name
        return
    first = report.first()
    assert first is not None and first.rule == entry["static"], f"{name}: expected {entry['static']} first, got {found}"
    assert set(entry.get("static_also", [])) <= {v.rule for v in report.violations}, found
    assert entry["verdict"] == RULES[first.rule].verdict and entry["rule"] == first.rule, name


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_fault_static_rules(name):
    """Faults run with static rules on must pass them (they test the sandbox); the others would be refused."""
    report = check_candidate(source("faults", name))
    if FAULTS[name]["static_rules"]:
        assert report.ok, [str(v) for v in report.violations]
    else:
        assert not report.ok and report.first().rule == "forbidden-import"


# -- compile-only Verifier (one worker per fixture, shared by the module) ------------------------
@pytest.fixture(scope="module")
def guarded():
    with Verifier(VerifyConfig(**LIMITS), RewardConfig(compile_only_reward=0.7)) as v:
        yield v


@pytest.fixture(scope="module")
def unguarded():
    """Static rules off: the candidates reach the sandbox with os, ctypes and fork at hand."""
    with Verifier(VerifyConfig(static_rules=False, **LIMITS), RewardConfig()) as v:
        yield v


def verify(v: Verifier, kind: str, name: str) -> Verdict:
    entry = (CHEATS if kind == "cheats" else FAULTS)[name]
    verdict = v.verify(builtin_tasks()[entry["task"]], source(kind, name), f"{kind}/{name}")
    print(f"{name}: {verdict.verdict} {verdict.rule} {verdict.seconds:.2f}s {verdict.reason[:300]!r}")
    assert verdict.mode == "compile_only"
    return verdict


def honest_ok(v: Verifier) -> None:
    task = builtin_tasks()[RELU]
    verdict = v.verify(task, task.solution_src, "honest-relu")
    assert verdict.verdict == "ok" and verdict.compiled, verdict.reason


COMPILE_ONLY_CHEATS = sorted(n for n, e in CHEATS.items() if e.get("compile_only"))


@pytest.mark.parametrize("name", COMPILE_ONLY_CHEATS)
def test_cheat_compile_only(guarded, name):
    expect = CHEATS[name]["compile_only"]
    verdict = verify(guarded, "cheats", name)
    assert verdict.verdict == expect["verdict"], verdict.reason
    assert verdict.rule == expect.get("rule"), verdict.reason
    if CHEATS[name]["static"] is not None:
        assert not verdict.compiled  # refused before compiling


COMPILE_ONLY_FAULTS = sorted(n for n, e in FAULTS.items() if e.get("compile_only") and e["compile_only"] != "ok")


@pytest.mark.parametrize("name", COMPILE_ONLY_FAULTS)
def test_fault_compile_only_then_honest_ok(guarded, unguarded, name):
    """Each fault gets its verdict, the worker is replaced exactly when it died, and the same
    Verifier then verifies the honest relu solution as ok."""
    entry = FAULTS[name]
    v = guarded if entry["static_rules"] else unguarded
    restarts = v.restarts
    verdict = verify(v, "faults", name)
    assert verdict.verdict == entry["compile_only"], verdict.reason
    assert verdict.reward == 0.0
    if entry.get("compile_only_replaced") is not None:
        assert (v.restarts > restarts) == entry["compile_only_replaced"], (restarts, v.restarts, verdict.reason)
    honest_ok(v)


@pytest.mark.xfail(reason="with static rules off the candidate shares the worker's process and can write a "
                          "forged result frame on the verdict pipe (rules: forbidden-import stops torch.os)",
                   strict=False)
def test_forged_verdict_without_static_rules(unguarded):
    verdict = verify(unguarded, "cheats", "forge_verdict.py")
    try:
        assert verdict.verdict != "ok", verdict
    finally:
        honest_ok(unguarded)
