"""The honest corpus (tests/corpus/honest/, issue 41): honest load_inline solutions are accepted.

Every entry goes through everything up to the compile here (the manifest's fields, the static rules, the
``load_inline`` call read statically, the sandboxed worker executing the module with its extensions as
compile-only stubs, ModelNew built, the dry run) and must get its manifest's verdict; one entry that gathers
several of the field's kinds (``-O2`` in ``extra_cflags`` with the precompiled header, ``.cpu().item<float>()``,
empty flag strings) is also built for real.  ``benchmarks/honest_corpus.py`` builds them all.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from _helpers import load_benchmark
from dice_ray.config import RewardConfig, VerifyConfig
from dice_ray.verify.candidate import inline_spec as inline
from dice_ray.verify.candidate.candidate import Candidate
from dice_ray.verify.rules.check import check_candidate
from dice_ray.verify.verifier import Verifier

bench = load_benchmark("honest_corpus")
CORPUS: Path = bench.CORPUS
LIMITS = dict(mode="compile_only", compile_timeout_s=60.0, run_timeout_s=30.0)


@pytest.fixture(scope="module")
def entries(dice_data) -> list[Any]:
    found, skipped = bench.load_corpus(CORPUS, dice_data)
    assert not skipped
    return found


def test_manifest_names_each_entrys_source_licence_and_verdict():
    """At least 60 entries; every file of the folder has one; sources, licences and kinds are given, and every
    expected refusal its rule and why."""
    import yaml

    manifest = yaml.safe_load((CORPUS / "manifest.yaml").read_text())
    files = {p.name for p in CORPUS.glob("*.py")}
    assert files <= set(manifest) and len(manifest) >= 60
    for name, spec in manifest.items():
        assert spec.get("source") and spec.get("licence"), name
        assert sum(k in spec for k in ("task", "dice", "reference")) == 1, name
        expect = spec.get("expect", "ok")
        assert expect == "ok" or (expect["rule"] and len(expect["why"]) > 40), name
    refusals = [n for n, s in manifest.items() if s.get("expect", "ok") != "ok"]
    assert len(refusals) <= 0.05 * len(manifest)


def test_static_rules_give_each_entry_its_verdict(entries):
    for e in entries:
        report = check_candidate(e.candidate, allow_vendor_libraries=e.config.get("allow_vendor_libraries", False))
        first = report.first()
        if e.expect["verdict"] == "ok":
            assert first is None, f"{e.name}: {[str(v) for v in report.violations]}"
            assert inline.extract_specs(e.candidate, allow_vendor_libraries=bool(e.config)), e.name
        else:
            assert first is not None and first.rule == e.expect["rule"], e.name


def _stub_modules(verifier: Verifier):
    """``Verifier._prepare_inline`` without the build: the specs read statically, each a compile-only stub (as
    compile-only mode runs an extension that was built: its functions cannot run on meta tensors)."""
    allow = verifier.verify_cfg.allow_vendor_libraries

    def prepare(candidate: Candidate) -> dict[str, Any]:
        specs = inline.extract_specs(candidate.source, allow_vendor_libraries=allow)
        modules = [{"key": s.key(), "name": s.name, "module": None, "path": None, "counting": "host",
                    "has_cuda": bool(s.cuda_sources), "kernels": []} for s in specs]
        return {"modules": modules, "allow_vendor_libraries": allow}

    return prepare


def test_every_entry_up_to_the_compile(entries):
    """The verdict of each entry with its extensions as stubs: honest ones ok (the dry run stops at the first
    extension call, or before: x.cuda(), dead helpers and imports, a one-value .cpu().item() are no reason to
    refuse), the expected refusals refused by their rule."""
    by_config: dict[str, list[Any]] = {}
    for e in entries:
        by_config.setdefault(json.dumps(e.config, sort_keys=True), []).append(e)
    wrong = []
    for key, group in by_config.items():
        with Verifier(VerifyConfig(**LIMITS, **json.loads(key)), RewardConfig()) as v:
            v._prepare_inline = _stub_modules(v)
            for e in group:
                got = v.verify(e.task, e.candidate, e.name)
                if not bench._matches(got, e.expect):
                    wrong.append(f"{e.name}: {got.verdict} [{got.rule}] {got.reason[:300]}")
    assert not wrong, "\n".join(wrong)


def test_a_representative_entry_compiles_for_real(tmp_path):
    """cpu_item_frobenius.py, built with the precompiled torch header: -O2 in extra_cflags (g++ 12 crashed on
    it, and the crash was cached as the candidate's compile error), a host-C++ .cpu().item<float>(), empty
    extra_ldflags; its verdict names the build's seconds."""
    entry = next(e for e in bench.load_corpus(CORPUS, tmp_path)[0] if e.name == "cpu_item_frobenius.py")
    with Verifier(VerifyConfig(**LIMITS, inline_cache_dir=str(tmp_path / "cache")), RewardConfig()) as v:
        got = v.verify(entry.task, entry.candidate, entry.name)
    assert got.verdict == "ok" and got.compiled, got.reason
    assert got.stage_seconds["compile"] > 0 and "static" in got.stage_seconds
