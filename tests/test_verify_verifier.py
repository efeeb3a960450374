"""The Verifier in compile-only mode (no GPU needed): verdicts, sandbox, recovery after failures."""

from __future__ import annotations

import os
import types

import pytest

from _verify_sources import HONEST, RELU_REF, mutate
from dice_ray.config import RewardConfig, VerifyConfig
from dice_ray.tasks.task import Task
from dice_ray.verify.verdict import Verdict
from dice_ray.verify.verifier import COMPILE_ONLY_SPARES, SPARE_ROOM_MIB, Verifier, memory_plan

TASK = Task("test/relu", "relu", 1, RELU_REF)
SECRET = "DICE_RAY_TEST_SECRET"
LIMITS = dict(mode="compile_only", compile_timeout_s=4.0, run_timeout_s=3.0)


@pytest.fixture(scope="module")
def verifier():
    with Verifier(VerifyConfig(**LIMITS), RewardConfig(compile_only_reward=0.7)) as v:
        yield v


@pytest.fixture(scope="module")
def unguarded():
    """Static rules off: candidates reach the sandbox with os/subprocess/socket at hand."""
    os.environ[SECRET] = "hunter2"
    try:
        with Verifier(VerifyConfig(static_rules=False, **LIMITS), RewardConfig()) as v:
            yield v
    finally:
        os.environ.pop(SECRET, None)


def check(v: Verifier, src: str, expected: str, task: Task = TASK) -> Verdict:
    verdict = v.verify(task, src, f"cand-{expected}")
    assert isinstance(verdict, Verdict)
    assert verdict.verdict == expected, verdict.reason
    assert verdict.mode == "compile_only" and verdict.task_id == task.task_id
    assert verdict.seconds > 0
    if expected != "ok":
        assert verdict.reward == 0.0 and verdict.reason
    return verdict


def test_honest_candidate_ok(verifier):
    v = check(verifier, HONEST, "ok")
    assert v.compiled and v.correct is None and v.speedup is None and v.reward == 0.7
    assert "dry run ok" in v.reason


def test_cuda_syntax_error_reports_nvrtc_log(verifier):
    """NVRTC's log, its lines (counted within the CUDA string) followed by the candidate file's."""
    src = mutate("y[i] = x[i]", "y[i] = = x[i]")
    v = check(verifier, src, "compile_error")
    assert "candidate.cu(" in v.reason and "error" in v.reason and not v.compiled
    line = next(n for n, text in enumerate(src.splitlines(), 1) if "= = x[i]" in text)
    cuda_line = line - next(n for n, text in enumerate(src.splitlines(), 1) if 'r"""' in text) + 1
    assert f"candidate.cu({cuda_line}) [candidate line {line}]: error" in v.reason, v.reason


def test_python_syntax_error(verifier):
    check(verifier, mutate("def forward(self, x):", "def forward(self, x)"), "compile_error")


@pytest.mark.parametrize("tail", ["Z = " + "1+" * 500 + "1\n", "Z = " + "-" * 20000 + "1\n"])
def test_a_deeply_nested_candidate_is_a_syntax_error_then_honest_ok(verifier, tail):
    """Python's parser and every recursive pass over a tree overflow on deep nesting (pysource.MAX_NESTING)."""
    v = check(verifier, HONEST + tail, "compile_error")
    assert v.reason.startswith("[syntax]") and "nested" in v.reason and "200 levels" in v.reason, v.reason
    check(verifier, HONEST, "ok")


def test_each_verifier_draws_a_secret_input_seed(verifier, unguarded):
    """A known seed lets a candidate precompute its answers (tests/corpus/cheats/seed_prediction.py): each Verifier
    draws its own (the config pins one only on request: test_verify_gpu's seed test), and it goes with each job,
    not in the workers' settings (their command line)."""
    assert VerifyConfig().input_seed is None
    assert 0 <= verifier.input_seed < 2**31 and "input_seed" not in verifier._settings
    assert unguarded.input_seed != verifier.input_seed  # drawn, not derived from the config (1 in 2**31 to fail)


def test_a_verifier_that_fails_its_self_test_names_it_in_each_verdict():
    """A worker whose known-good relu candidate does not pass (an architecture NVRTC refuses) would fail every
    candidate: it does not start, and each candidate's verdict says why (a toolchain fault, not the candidate's)."""
    with Verifier(VerifyConfig(**LIMITS, arch="sm_10"), RewardConfig()) as v:
        out = v.verify(TASK, HONEST, "a")
        assert out.verdict == "crash" and out.candidate_id == "a" and out.reward == 0.0
        assert "self-test: the built-in relu candidate got compile_error" in out.reason, out.reason
        assert "verify.arch='sm_10'" in out.reason and "invalid value for --gpu-architecture" in out.reason


def test_static_cheats_are_refused_before_compiling(verifier):
    v = check(verifier, mutate("        return y\n", "        return torch.matmul(y, y)\n"), "cheat")
    assert v.rule == "forward-torch-op" and not v.compiled
    v = check(verifier, mutate("import torch\n", "import torch\nimport os\n",
                               mutate("        return y\n", "        os.getpid()\n        return y\n")), "cheat")
    assert v.rule == "forbidden-import" and "static" in v.stage_seconds
    v = check(verifier, mutate("class ModelNew", "class ModelOld", mutate("        return y\n", "        return y.sum()\n")),
              "cheat")  # a cheat decides before the format error (no ModelNew)
    assert v.rule == "forward-torch-op" and "no-modelnew" in v.reason and "ALLOWED" not in v.reason
    v = check(verifier, mutate("class ModelNew", "class ModelOld"), "compile_error")
    assert v.rule == "no-modelnew" and v.reason.startswith("[no-modelnew]")


DEAD_CODE = """

def get_inputs():  # a copy of the task's, never called by the verifier
    return [torch.randn(1024, 1024, device="cuda")]


def check_against_reference():
    import numpy as np
    torch.manual_seed(0)
    return np.allclose(ModelNew()(*get_inputs()).cpu().numpy(), 0)


if __name__ == "__main__":
    import sys
    print(check_against_reference(), file=sys.stderr)
"""


def test_code_the_verifier_never_runs_is_not_judged(verifier):
    """A copy of get_inputs, a test helper, a main block and imports only they use (numpy at top level: the
    worker runs the module without it) are honest; a helper forward calls is run-time code."""
    src = mutate("import torch\n", "import torch\nimport numpy as np\n") + DEAD_CODE
    v = check(verifier, src, "ok")
    assert "dry run ok" in v.reason
    live = mutate("        return y\n", "        return y + get_inputs()[0]\n") + DEAD_CODE
    assert check(verifier, live, "cheat").rule == "forward-torch-op"


@pytest.mark.parametrize("line", ["x = x.cuda()", "x = x.to('cuda')", "x = x.to(torch.device('cuda', 0))",
                                  "assert x.is_cuda", "y = torch.empty(x.shape, device='cuda')",
                                  "torch.cuda.current_device()"])
def test_forward_naming_the_gpu_is_not_a_crash_in_the_dry_run(verifier, line):
    """x.cuda() and the like are no-ops on a GPU: meta stands for it, and what a CPU-only torch cannot
    answer (torch.cuda.current_device()) makes the dry run inconclusive, not a crash."""
    v = check(verifier, mutate("        x = x.contiguous()\n", f"        x = x.contiguous()\n        {line}\n"), "ok")
    assert "dry run" in v.reason


def test_library_include_built_at_run_time_is_caught_by_load_cuda_hook(verifier):
    src = mutate("kernels = load_cuda(cuda_source)", 'kernels = load_cuda("#include <cub" + "las_v2.h>\\n" + cuda_source)')
    v = check(verifier, src, "cheat")
    assert v.rule == "cuda-library" and "load_cuda source" in v.reason


def test_torch_op_hidden_from_static_rules_caught_in_dry_run(verifier):
    v = check(verifier, mutate("        return y\n", "        return y + 0\n"), "cheat")
    assert v.rule == "forward-torch-op" and "add" in v.reason


def test_unknown_kernel_and_bad_launch(verifier):
    v = check(verifier, mutate("kernels.relu_kernel(", "kernels.relu_kernal("), "compile_error")
    assert "unknown-kernel" in v.reason and "relu_kernel" in v.reason
    v = check(verifier, mutate("args=(x, y, n)", "args=(x, y)"), "crash")
    assert "relu_kernel takes 3 parameters" in v.reason


def test_wrong_output_shape_is_incorrect_in_dry_run(verifier):
    v = check(verifier, mutate("        return y\n", "        return y.view(-1)\n"), "incorrect")
    assert v.correct is False and "expected (1024, 1024)" in v.reason


def test_exception_at_import_then_honest_ok(verifier):
    v = check(verifier, mutate("kernels = load_cuda(cuda_source)", "kernels = load_cuda(cuda_source)\nSCALE = 1 / 0"),
              "crash")
    assert "ZeroDivisionError" in v.reason
    check(verifier, HONEST, "ok")


def test_endless_loop_times_out_and_worker_is_replaced(verifier):
    pid = verifier.worker_pid
    src = mutate("        super().__init__()\n", "        super().__init__()\n        while True:\n            pass\n")
    v = check(verifier, src, "timeout")
    assert "run" in v.reason and v.seconds >= 3.0
    assert verifier.worker_pid != pid
    check(verifier, HONEST, "ok")


def test_prepare_measures_nothing_in_compile_only_mode(verifier):
    """Verifier.prepare (reference facts ahead of the candidates) has nothing to measure without a GPU; a
    verify after it is unchanged.  On a GPU:
    tests/test_verify_gpu.py::test_prepare_measures_each_reference_once_before_its_candidates."""
    out = verifier.prepare([TASK])
    assert out["measured"] == 0 and "compile-only" in out["skipped"], out
    assert verifier.stats()["reference_facts"] == 0
    check(verifier, HONEST, "ok")


def test_broken_reference_is_invalid_input(verifier):
    bad = Task("test/bad-ref", "bad", 1, RELU_REF.replace("    return []", "    return [undefined_name]"))
    v = check(verifier, HONEST, "invalid_input", task=bad)
    assert v.rule == "reference-exec" and "undefined_name" in v.reason


def test_os_exit_is_a_crash_then_honest_ok(unguarded):
    pid = unguarded.worker_pid
    v = check(unguarded, mutate("import torch\n", "import torch\nimport os\nos._exit(3)\n"), "crash")
    assert "exited with code 3" in v.reason and not v.compiled
    assert unguarded.worker_pid != pid
    check(unguarded, HONEST, "ok")


def test_no_new_processes_no_network(unguarded):
    v = check(unguarded, mutate("import torch\n", "import torch\nimport subprocess\nsubprocess.run(['true'])\n"), "crash")
    assert "Operation not permitted" in v.reason
    v = check(unguarded, mutate("import torch\n", "import torch\nimport socket\nsocket.create_connection(('1.1.1.1', 53))\n"),
              "crash")
    assert "Operation not permitted" in v.reason


def test_environment_stripped_and_private_cwd(unguarded):
    probe = mutate("import torch\n", (
        "import torch\nimport os\n"
        f"assert '{SECRET}' not in os.environ, 'secret leaked'\n"
        "assert os.path.basename(os.getcwd()).startswith('dice-ray-worker-'), os.getcwd()\n"
        "assert oct(os.stat('.').st_mode & 0o777) == '0o700'\n"
    ))
    check(unguarded, probe, "ok")
    v = check(unguarded, mutate("import torch\n", "import torch\nopen('big.bin', 'wb').write(bytes(100 << 20))\n"),
              "crash")
    assert "File too large" in v.reason


def test_sleep_forever_at_import_times_out(unguarded):
    v = check(unguarded, mutate("import torch\n", "import torch\nimport time\ntime.sleep(3600)\n"), "timeout")
    assert not v.compiled and "load" in v.reason
    check(unguarded, HONEST, "ok")


def test_after_a_crash_a_warm_spare_takes_over(unguarded):
    crash = mutate("import torch\n", "import torch\nimport os\nos._exit(4)\n")
    check(unguarded, crash, "crash")
    assert unguarded.wait_for_spares(120) < 120
    assert unguarded.spares_ready() == len(unguarded._spares) == COMPILE_ONLY_SPARES  # compile-only keeps a few
    spare = unguarded._spares[0]
    assert spare.alive(), (spare.proc.returncode, spare.log_tail(), [(w.pid, w.alive()) for w in unguarded._spares])
    check(unguarded, HONEST, "ok")
    promoted = unguarded.promoted
    check(unguarded, crash, "crash")
    assert unguarded.worker_pid == spare.pid  # swapped in, not cold-started
    assert unguarded.promoted == promoted and unguarded.stats()["promoted"] == promoted  # it was ready: no wait
    assert spare.forked  # forked from the zygote, torch already imported
    assert spare.info["gc_frozen"] > 100_000  # the zygote's imports, frozen: after-job collections skip them
    check(unguarded, HONEST, "ok")
    test_environment_stripped_and_private_cwd(unguarded)  # the forked worker is as sandboxed


def test_the_memory_plan_takes_the_spares_rooms_out_before_the_workers_caps():
    """An H200 (143,771 MiB) at the defaults keeps 31 spares (a quarter of the verifier's 0.9, 1 GiB each) and
    gives each of 6 workers an equal part of the rest; a small GPU keeps fewer (none where a worker would get
    under 1 GiB); an explicit count that would leave a worker under 1 GiB is a config error naming the settings."""
    spares, cap = memory_plan(143771, 0.9, 6, None)
    assert spares == 31
    assert cap * 143771 == pytest.approx((0.9 * 143771 - 31 * SPARE_ROOM_MIB) / 6)
    assert memory_plan(24576, 0.9, 6, None)[0] == 5
    assert memory_plan(143771, 0.9, 6, 8) == (8, pytest.approx((0.9 * 143771 - 8 * SPARE_ROOM_MIB) / 6 / 143771))
    assert memory_plan(143771 * 4, 0.9, 6, None)[0] == 32  # at most 32
    assert memory_plan(8192, 0.45, 6, None) == (0, pytest.approx(0.45 / 6))  # a small GPU: none, the caps as before
    assert memory_plan(16384, 0.45, 6, None)[0] == 1  # as many as leave each worker 1 GiB
    with pytest.raises(ValueError, match=r"verify.spare_workers=20 .* leaving each of its 6 workers .*lower verify.spare_workers"):
        memory_plan(24576, 0.9, 6, 20)


def test_private_folders_of_dead_verifiers_are_swept():
    """A verifier killed with SIGKILL cannot remove its workers' folders; the next one removes the
    folders whose owning process is dead and leaves a live owner's alone."""
    import os
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from dice_ray.verify.sandbox.environment import private_dir, sweep_private_dirs

    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = Path(tempfile.mkdtemp(prefix=f"dice-ray-worker-{owner.pid}-"))
    (dead / "worker.log").write_text("left behind")
    live = Path(private_dir("zygote"))
    assert live.name.startswith(f"dice-ray-zygote-{os.getpid()}-")
    owner.kill()
    owner.wait()
    try:
        assert sweep_private_dirs() >= 1
        assert not dead.exists() and live.is_dir()
    finally:
        live.rmdir()


def test_a_results_stage_parts_join_its_stage_seconds(verifier):
    from dice_ray.verify.sandbox.runner import JobOutcome

    parts = {"run.until_raise": 0.171, "run.after_raise": 0.0004}
    outcome = JobOutcome("result", "run", result={"verdict": "crash", "compiled": True, "reason": "illegal address",
                                                  "parts_s": parts, "fatal": True},
                         stage_s={"load": 0.05, "reference": 0.01, "run": 0.3})
    fields = verifier._from_outcome(outcome)
    assert "parts_s" not in fields
    assert fields["stage_seconds"] == {"load": 0.05, "reference": 0.01, "run": 0.3, **parts}
    v = verifier._verdict(TASK, "c", fields, 0.4)
    assert v.verdict == "crash" and v.stage_seconds["run.until_raise"] == 0.171


def _ref(old: str, new: str) -> Task:
    assert old in RELU_REF, old
    return Task("test/bad-ref", "bad", 1, RELU_REF.replace(old, new))


@pytest.mark.parametrize(
    "task, rule, says",
    [
        # compile-only used to give these an unchecked `ok` (full reward) or blame the candidate (`crash`)
        (_ref("return [torch.randn(1024, 1024)]", "raise RuntimeError('boom')"), "reference-inputs", "boom"),
        (_ref("return torch.relu(x)", "raise ValueError('reference is broken')"), "reference-run", "reference is broken"),
        (_ref("return [torch.randn(1024, 1024)]", "return ['a', 3]"), "reference-run", "TypeError"),
        (_ref("return torch.relu(x)", "return 'text'"), "reference-output", "str, not Tensor"),
        (_ref("super().__init__()", "super().__init__()\n        raise KeyError('w')"), "reference-build", "KeyError"),
        (_ref("import torch\n", "import torch\nimport sys\nsys.exit(3)\n"), "reference-exec", "SystemExit: 3"),
        # the reference's own init inputs do not fit its Model: built (on meta) before ModelNew, so not ModelNew's crash
        (_ref("def get_init_inputs():\n    return []", "def get_init_inputs():\n    return [1, 2, 3]"),
         "reference-build", "takes 1 positional argument"),
        # a reference that hangs on meta tensors runs out the reference stage's time, not the candidate's run
        (_ref("return torch.relu(x)", "while True:\n            pass"), "reference-timeout", "stage 'reference'"),
    ],
)
def test_a_broken_reference_is_invalid_input_in_compile_only_mode(verifier, task, rule, says):
    v = check(verifier, HONEST, "invalid_input", task=task)
    assert v.rule == rule and says in v.reason, v.reason


def test_a_reference_meta_cannot_run_is_no_verdict_on_the_task(verifier):
    # data-dependent: no meta kernel; the task is fine, the shape check is skipped
    v = check(verifier, HONEST, "ok", task=_ref("return torch.relu(x)", "return torch.relu(x) + x.sum().item() * 0"))
    assert "output shapes unchecked" in v.reason


@pytest.mark.parametrize(
    "task, says",
    [
        (None, "the task has no str task_id (task is a NoneType"),
        (types.SimpleNamespace(task_id="t/x", reference_src=None), "no str reference_src"),
        (types.SimpleNamespace(task_id="t/x", reference_src=RELU_REF.replace("def forward", "def fwd")), "no-forward"),
        (types.SimpleNamespace(task_id="t/x", reference_src=RELU_REF.replace("def get_inputs", "def gi")),
         "no-get-inputs"),
        (types.SimpleNamespace(task_id="t/x", reference_src="class Model(:\n"), "syntax-error"),
        (types.SimpleNamespace(task_id="t/x", reference_src=RELU_REF + "Z = " + "-" * 20000 + "1\n"),
         "nested too deeply for the parser"),
    ],
)
def test_a_malformed_task_object_is_invalid_input_not_a_candidate_crash(verifier, task, says):
    v = verifier.verify(task, HONEST, "c")
    assert v.verdict == "invalid_input" and v.rule == "reference-invalid" and says in v.reason, v
    assert v.reward == 0.0 and v.candidate_id == "c"


def test_verify_many_refuses_a_malformed_item_before_verifying_any(verifier):
    with pytest.raises(ValueError, match=r"items\[1\] must be \(task, candidate_src, candidate_id\), got tuple of 2"):
        verifier.verify_many([(TASK, HONEST, "a"), (TASK, HONEST)])
    out = verifier.verify_many([(TASK, HONEST, "a"), (None, HONEST, "b"), (TASK, b"bytes", "c")])
    assert [(v.candidate_id, v.verdict) for v in out] == [("a", "ok"), ("b", "invalid_input"), ("c", "compile_error")]


@pytest.mark.parametrize("error", [
    RuntimeError("Tensor.item() cannot be called on meta tensors"),
    RuntimeError("The tensor has a non-zero number of elements, but its data is not allocated yet."),
    RuntimeError("Expected all tensors to be on the same device, but found at least two devices, cpu and Meta!"),
    AssertionError("Torch not compiled with CUDA enabled"),
    RuntimeError("Found no NVIDIA driver on your system."),
    NotImplementedError("Could not run 'aten::nonzero' with arguments from the 'Meta' backend."),
])
def test_errors_meta_tensors_cause_do_not_blame_the_reference(error):
    """What meta tensors (no data, no GPU) may cause is not the reference's fault: the dry run skips, no invalid_input."""
    from dice_ray.verify.trials.dry_run import _meta_inconclusive

    assert _meta_inconclusive(error)
    assert not _meta_inconclusive(ZeroDivisionError("division by zero"))
    assert not _meta_inconclusive(TypeError("forward() takes 2 positional arguments but 3 were given"))
