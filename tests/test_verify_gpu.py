"""The Verifier on a GPU: correctness, timing, run-time anti-cheat rules, recovery (@pytest.mark.gpu)."""

from __future__ import annotations

import pytest
import torch

from _verify_sources import HONEST, RELU_REF, TINY_REF, mutate
from dice_ray.config import RewardConfig, VerifyConfig
from dice_ray.tasks.task import Task
from dice_ray.verify.verdict import Verdict
from dice_ray.verify.verifier import Verifier

pytestmark = pytest.mark.gpu

RELU = Task("test/relu", "relu", 1, RELU_REF)
TINY = Task("test/tiny", "tiny", 1, TINY_REF)
BODY = "if (i < n) y[i] = x[i] > 0.f ? x[i] : 0.f;"


@pytest.fixture(scope="module")
def gpu():
    cfg = VerifyConfig(mode="gpu", compile_timeout_s=60.0, run_timeout_s=8.0, timing_trials=10)
    with Verifier(cfg, RewardConfig(), device=0) as v:
        yield v


def check(v: Verifier, src: str, expected: str, task: Task = RELU) -> Verdict:
    verdict = v.verify(task, src, f"cand-{expected}")
    assert isinstance(verdict, Verdict)
    print(f"{expected}: {verdict.verdict} {verdict.rule} {verdict.seconds:.2f}s {verdict.reason[:700]!r}")
    assert verdict.verdict == expected, verdict.reason
    assert verdict.mode == "gpu"
    if expected != "ok":
        assert verdict.reward == 0.0
    return verdict


def test_launcher_in_process():
    from dice_ray import launch

    mod = launch.load_cuda(HONEST.split('r"""')[1].split('"""')[0])
    assert mod.launchable and mod.arch.startswith("sm_")
    x = torch.randn(1000, device="cuda")
    y = torch.empty_like(x)
    before = launch.launch_count()
    mod.relu_kernel(grid=4, block=256, args=(x, y, x.numel()))
    torch.cuda.synchronize()
    assert torch.equal(y, torch.relu(x)) and launch.launch_count() == before + 1
    with pytest.raises(TypeError, match=r"relu_kernel parameter 1 .*cpu"):
        mod.relu_kernel(grid=4, block=256, args=(x, torch.empty(1000), x.numel()))
    with pytest.raises(RuntimeError, match="launch of kernel relu_kernel"):
        mod.relu_kernel(grid=1, block=4096, args=(x, y, x.numel()))  # > 1024 threads a block
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):  # launches go to the current stream
        mod.relu_kernel(grid=4, block=256, args=(x, y, x.numel()))
    s.synchronize()
    assert torch.equal(y, torch.relu(x))


def test_correct_relu_is_ok_with_speedup(gpu):
    v = check(gpu, HONEST, "ok")
    assert v.compiled and v.correct is True
    assert v.speedup is not None and v.speedup > 0 and v.ref_ms > 0 and v.candidate_ms > 0
    assert v.speedup == pytest.approx(v.ref_ms / v.candidate_ms, rel=1e-6)
    assert v.reward > 0 and v.candidate_spread is not None


def test_wrong_result_is_incorrect(gpu):
    v = check(gpu, mutate(BODY, "if (i < n) y[i] = x[i];"), "incorrect")
    assert v.correct is False and v.speedup is None


def test_all_zeros_for_a_tiny_output_is_incorrect(gpu):
    v = check(gpu, mutate(BODY, "if (i < n) y[i] = 0.f;"), "incorrect", task=TINY)
    assert "differ" in v.reason


def test_unwritten_output_reads_poisoned_memory(gpu):
    # KernelBench gap: torch.empty may hand back the reference's freed output, already correct
    check(gpu, mutate(BODY, "if (i < 0) y[i] = 0.f;"), "incorrect")


def test_input_mutation_is_a_cheat(gpu):
    src = mutate("args=(x, y, n))\n        return y", "args=(x, x, n))\n        return x")
    v = check(gpu, src, "cheat")
    assert v.rule == "input-mutation"


def test_decoy_kernel_never_launched_is_a_cheat(gpu):
    src = mutate("        n = x.numel()\n", "        n = x.numel()\n        if n > 0:\n            return y\n")
    v = check(gpu, src, "cheat")
    assert v.rule == "no-kernel-launch"


def test_launching_only_during_correctness_is_a_cheat(gpu):
    src = mutate(BODY, BODY + "\n    if (i == 0) calls[0] += 1;")
    src = mutate("float* __restrict__ y, long n)", "float* __restrict__ y, long long* calls, long n)", src)
    src = mutate("        super().__init__()\n", (
        "        super().__init__()\n"
        "        self.register_buffer('calls', torch.zeros(1, dtype=torch.int64))\n"
        "        self.register_buffer('out', torch.zeros(1024, 1024))\n"), src)
    src = mutate("        y = torch.empty_like(x)\n", "        y = self.out\n", src)
    src = mutate("        kernels.relu_kernel(grid=(n + 255) // 256, block=256, args=(x, y, n))\n", (
        "        if self.calls.item() < 3:\n"
        "            kernels.relu_kernel(grid=(n + 255) // 256, block=256, args=(x, y, self.calls, n))\n"), src)
    v = check(gpu, src, "cheat")
    assert v.rule == "no-kernel-launch" and "timed" in v.reason


def test_torch_op_hidden_from_static_rules_is_a_cheat(gpu):
    v = check(gpu, mutate("        return y\n", "        return y * 1.0\n"), "cheat")
    assert v.rule == "forward-torch-op" and "mul" in v.reason


def test_illegal_memory_access_crashes_then_honest_ok(gpu):
    pid = gpu.worker_pid
    v = check(gpu, mutate(BODY, "if (i < n) y[i + (1L << 40)] = 1.f;"), "crash")
    assert "illegal" in v.reason.lower() or "CUDA" in v.reason
    assert gpu.worker_pid != pid
    check(gpu, HONEST, "ok")


def test_endless_kernel_times_out_then_honest_ok(gpu):
    pid = gpu.worker_pid
    spin = "const volatile float* v = x; while (v[0] == v[0]) { } if (i < n) y[i] = 0.f;"
    v = check(gpu, mutate(BODY, spin), "timeout")
    assert gpu.worker_pid != pid and v.compiled
    check(gpu, HONEST, "ok")


def test_failing_reference_is_invalid_input(gpu):
    bad = Task("test/bad", "bad", 1, RELU_REF.replace("return torch.relu(x)", "return torch.relu(x) @ torch.ones(3, 3)"))
    v = check(gpu, HONEST, "invalid_input", task=bad)
    assert v.rule == "reference-run"
