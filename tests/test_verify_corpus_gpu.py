"""The verifier's cheat and fault corpus on a GPU (@pytest.mark.gpu): every case gets its verdict.

For each cheat of ``tests/corpus/cheats/`` (manifest fields in ``manifest.yaml``): the verdict and
rule with every layer on, and the verdict of the run-time layer alone (``static_rules=False``);
candidates that patch process-wide state are followed by honest, wrong and input-mutating
candidates on the same worker, which must still be judged right.  For each fault of
``tests/corpus/faults/``: its verdict, whether the worker was replaced, and an honest candidate
verified correctly right after by the same Verifier.  Finally a batch of 30 candidates, 10 %
crashing, must give the other 27 the verdicts they get alone.  CPU side: ``test_verify_corpus.py``.
"""

from __future__ import annotations

from typing import Any

import pytest

from dice_ray.config import RewardConfig, VerifyConfig
from dice_ray.verify.verdict import Verdict
from dice_ray.verify.verifier import Verifier
from test_verify_corpus import CHEATS, FAULTS, RELU, alternatives, builtin_tasks, source

pytestmark = pytest.mark.gpu

# small timing budget: the corpus checks verdicts, not speed (the fan-out compile bomb and the
# endless kernel run into compile_timeout_s / run_timeout_s)
BASE = dict(mode="gpu", workers=1, spare_workers=8, compile_timeout_s=10.0, run_timeout_s=10.0, timing_trials=10)
RELU_BODY = "        y[i] = v > 0.f ? v : 0.f;"


@pytest.fixture(scope="module")
def gpu():
    with Verifier(VerifyConfig(**BASE), RewardConfig(), device=0) as v:
        yield v


@pytest.fixture(scope="module")
def runtime_gpu():
    """The run-time layer alone: static rules off, a tiny timing pool (input slots reused every 2 calls)."""
    with Verifier(VerifyConfig(static_rules=False, input_pool_mib=1.0, **BASE), RewardConfig(), device=0) as v:
        yield v


def run(v: Verifier, task_id: str, src: str, label: str) -> Verdict:
    verdict = v.verify(builtin_tasks()[task_id], src, label)
    print(f"{label}: {verdict.verdict} {verdict.rule} correct={verdict.correct} speedup={verdict.speedup} "
          f"{verdict.seconds:.2f}s {verdict.reason[:600]!r}")
    assert isinstance(verdict, Verdict) and verdict.mode == "gpu"
    if verdict.verdict != "ok":
        assert verdict.reward == 0.0
    return verdict


def honest(task_id: str = RELU) -> str:
    return builtin_tasks()[task_id].solution_src


def wrong_relu() -> str:
    src = honest()
    assert RELU_BODY in src
    return src.replace(RELU_BODY, "        y[i] = v;")


def check_honest(v: Verifier, label: str) -> None:
    verdict = run(v, RELU, honest(), label)
    assert verdict.verdict == "ok" and verdict.correct is True and verdict.compiled, verdict.reason
    assert verdict.speedup is not None and 0.2 < verdict.speedup < 3.0, verdict.speedup


def matches(verdict: Verdict, expect: dict[str, Any]) -> bool:
    if verdict.verdict != expect["verdict"]:
        return False
    if "rule" in expect and verdict.rule != expect["rule"]:
        return False
    if "reason" in expect and expect["reason"] not in verdict.reason:
        return False
    if "max_speedup" in expect and not (verdict.speedup is not None and verdict.speedup <= expect["max_speedup"]):
        return False
    return True


# -- cheats ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CHEATS))
def test_cheat_every_layer(gpu, name):
    entry = CHEATS[name]
    verdict = run(gpu, entry["task"], source("cheats", name), f"cheats/{name}")
    assert verdict.verdict == entry["verdict"], verdict.reason
    assert verdict.rule == entry["rule"], verdict.reason
    if "reason" in entry:
        assert entry["reason"] in verdict.reason
    if entry["verdict"] == "incorrect":
        assert verdict.correct is False


RUNTIME = [n for n, e in CHEATS.items() if e.get("runtime")]


@pytest.mark.parametrize("name", RUNTIME)
def test_cheat_runtime_layer(runtime_gpu, name):
    """The run-time layer alone (static rules off) gives the manifest's verdict; a candidate that
    patched process-wide state leaves the worker judging later candidates right."""
    entry = CHEATS[name]
    verdict = run(runtime_gpu, entry["task"], source("cheats", name), f"runtime/{name}")
    expects = alternatives(entry["runtime"])
    assert any(matches(verdict, e) for e in expects), f"{name}: got {verdict.verdict} {verdict.rule} " \
        f"speedup={verdict.speedup}, expected one of {expects}: {verdict.reason}"
    if entry.get("poisons"):
        check_honest(runtime_gpu, f"honest after {name}")
        after = run(runtime_gpu, RELU, wrong_relu(), f"wrong after {name}")
        assert after.verdict == "incorrect", after.reason
        after = run(runtime_gpu, "builtin/L1/relu", source("cheats", "mutate_inputs.py"), f"mutation after {name}")
        assert (after.verdict, after.rule) == ("cheat", "input-mutation"), after.reason


# -- faults ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(FAULTS))
def test_fault_then_honest_ok(gpu, runtime_gpu, name):
    entry = FAULTS[name]
    v = gpu if entry["static_rules"] else runtime_gpu
    restarts = v.restarts
    verdict = run(v, entry["task"], source("faults", name), f"faults/{name}")
    assert verdict.verdict == entry["verdict"], verdict.reason
    if "compiled" in entry:
        assert verdict.compiled == entry["compiled"], verdict.reason
    if entry.get("reason_any"):
        assert any(s in verdict.reason for s in entry["reason_any"]), verdict.reason
    if entry.get("replaced") is not None:
        assert (v.restarts > restarts) == entry["replaced"], (restarts, v.restarts, verdict.reason)
    check_honest(v, f"honest after {name}")


# -- a batch with 10 % crashing candidates -------------------------------------------------------
def batch() -> list[tuple[str, str, str, bool]]:
    """30 ``(task_id, source, candidate_id, crashes)``: 27 ordinary candidates and 3 crashing ones."""
    items: list[tuple[str, str, bool]] = []
    for t in ("relu", "gelu_tanh", "sigmoid", "tanh", "silu", "softmax", "sum_dim", "mean_dim", "matmul", "linear",
              "add", "layernorm"):
        items.append((f"builtin/L1/{t}", honest(f"builtin/L1/{t}"), False))
    for name in ("reuse_freed_output.py", "partial_write.py", "near_zero.py", "hardcoded_shape.py",
                 "detect_correctness_phase.py", "uninit_memory.py", "mutate_inputs.py", "lazy_output.py",
                 "precision_downgrade.py", "torch_matmul.py", "forge_verdict.py", "eval_getattr.py"):
        items.append((CHEATS[name]["task"], source("cheats", name), False))
    relu = honest()
    items.append((RELU, relu.replace("if (i < n) {", "if (i < n) {{"), False))  # CUDA syntax error
    items.append((RELU, relu.replace("def forward(self, x):", "def forward(self, x)"), False))  # Python syntax error
    items.append((RELU, relu.replace("kernels.relu_kernel(", "kernels.relu_kernal("), False))  # unknown kernel
    assert len(items) == 27
    crashers = [(RELU, source("faults", "illegal_memory_access.py"), True),
                (RELU, source("faults", "device_trap.py"), True),
                (RELU, source("faults", "illegal_memory_access.py"), True)]
    for pos, c in zip((3, 13, 23), crashers):
        items.insert(pos, c)
    return [(task_id, src, f"batch-{i}", crashes) for i, (task_id, src, crashes) in enumerate(items)]


def test_batch_with_crashes_gives_the_others_their_own_verdicts(gpu):
    items = batch()
    assert len(items) == 30 and sum(c for *_, c in items) == 3
    alone = {cid: run(gpu, task_id, src, f"alone/{cid}") for task_id, src, cid, crashes in items if not crashes}
    tasks = builtin_tasks()
    cfg = VerifyConfig(**{**BASE, "workers": 3})
    with Verifier(cfg, RewardConfig(), device=0) as many:
        triples = [(tasks[task_id], src, cid) for task_id, src, cid, _ in items]
        if hasattr(many, "verify_many"):
            together = many.verify_many(triples)
        else:
            together = [many.verify(*t) for t in triples]
    assert [v.candidate_id for v in together] == [cid for _, _, cid, _ in items]
    for (task_id, _, cid, crashes), v in zip(items, together):
        print(f"batch {cid} {task_id}: {v.verdict} {v.rule} correct={v.correct} {v.reason[:200]!r}")
        if crashes:
            assert v.verdict == "crash", v.reason
        else:
            assert (v.verdict, v.correct) == (alone[cid].verdict, alone[cid].correct), (cid, v.reason, alone[cid].reason)
    kinds = {v.verdict for v in alone.values()}
    assert {"ok", "incorrect", "cheat", "compile_error"} <= kinds, kinds
