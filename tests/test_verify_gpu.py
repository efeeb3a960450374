"""The Verifier on a GPU: correctness, timing, run-time anti-cheat rules, recovery (@pytest.mark.gpu)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from _helpers import process_state
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
    cfg = VerifyConfig(mode="gpu", workers=1, spare_workers=8, compile_timeout_s=60.0, run_timeout_s=8.0, timing_trials=10)
    with Verifier(cfg, RewardConfig(), device=0) as v:
        yield v


@pytest.fixture(scope="module")
def unguarded_gpu():
    """Static rules off and a 1 MiB timing pool (input slots reused): the run-time defences alone."""
    cfg = VerifyConfig(mode="gpu", workers=1, spare_workers=8, static_rules=False, compile_timeout_s=60.0, run_timeout_s=8.0,
                       timing_trials=10, input_pool_mib=1.0, output_checks=8)
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
    y.fill_(7.0)
    before = launch.launch_count()
    with launch.kernels_suppressed():  # the kernel ablation's switch: counted, not run
        mod.relu_kernel(grid=4, block=256, args=(x, y, x.numel()))
    torch.cuda.synchronize()
    assert launch.launch_count() == before + 1 and bool((y == 7.0).all())
    mod.relu_kernel(grid=4, block=256, args=(x, y, x.numel()))  # switched on again
    torch.cuda.synchronize()
    assert torch.equal(y, torch.relu(x))


def test_correct_relu_is_ok_with_speedup(gpu):
    v = check(gpu, HONEST, "ok")
    assert v.compiled and v.correct is True
    assert v.speedup is not None and v.speedup > 0 and v.ref_ms > 0 and v.candidate_ms > 0
    assert v.speedup == pytest.approx(v.ref_ms / v.candidate_ms, rel=1e-6)
    assert v.reward > 0 and v.candidate_spread is not None


def test_standard_headers_compile_and_run_right(gpu):
    """NVRTC has no C library: <cstdint>, <cmath>, <cfloat>, <climits>, <cassert> come from the launcher's own
    headers, and their types and macros run right (a relu through INT64/float limits)."""
    src = mutate('extern "C"', '#include <cstdint>\n#include <cmath>\n#include <cfloat>\n#include <climits>\n'
                 '#include <cassert>\nextern "C"')
    src = mutate(BODY, "assert(n < INT64_MAX); int64_t j = i; "
                 "if (j < n) y[j] = fminf(fmaxf(x[j], 0.f), FLT_MAX) + (CHAR_BIT == 8 ? 0.f : INFINITY);", src)
    v = check(gpu, src, "ok")
    assert v.correct is True and v.speedup is not None


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
        "        if self.calls.item() < 4:\n"
        "            kernels.relu_kernel(grid=(n + 255) // 256, block=256, args=(x, y, self.calls, n))\n"), src)
    v = check(gpu, src, "cheat")
    assert v.rule == "no-kernel-launch" and "timed" in v.reason


TRANSPOSE_REF = RELU_REF.replace("return torch.relu(x)", "return x.t().contiguous()").replace(
    "torch.randn(1024, 1024)", "torch.randn(1024, 768)")
TRANSPOSE = Task("test/transpose", "transpose", 1, TRANSPOSE_REF)
REPO = Path(__file__).resolve().parents[1]


def test_outputs_right_without_the_kernels_are_a_cheat(gpu):
    """Rule kernel-not-used (the kernel ablation): a transpose answered by x.t().contiguous() (copy ops
    forward may run) beside a launch of its own kernel over zero elements passes every other rule; its
    outputs are still right with its kernels counted but not run.  The honest transpose (the built-in
    solution) and the honest relu stay ok."""
    honest = (REPO / "dice_ray/tasks/builtin/L1_36_transpose/solution.py").read_text()
    v = check(gpu, honest, "ok", task=TRANSPOSE)
    assert v.correct is True and "kernel ablation skipped" not in v.reason
    check(gpu, HONEST, "ok")
    v = check(gpu, (REPO / "tests/corpus/cheats/transpose_by_copy.py").read_text(), "cheat", task=TRANSPOSE)
    assert v.rule == "kernel-not-used" and v.reason.startswith("trial 1 "), v.reason


MSE = Task("test/mse", "mse", 1, (REPO / "dice_ray/tasks/builtin/L1_40_mse_loss/reference.py").read_text())


def test_an_honest_loss_finished_on_the_host_is_ok(gpu):
    """A one-element output is ablated now (rule kernel-not-used): an honest MSE whose kernel writes per-block
    partial sums that the host adds up (copied into a host tensor, then ``tolist()``) gets the previous trial's partials replayed in the
    ablated call and rebuilds the previous trial's loss exactly, which matches this trial's within tolerance
    (8M randn pairs: 2.0 both): that echo is inconclusive, not a cheat.  The host-summed cheat is
    tests/corpus/cheats/host_loss.py."""
    solution = (REPO / "dice_ray/tasks/builtin/L1_40_mse_loss/solution.py").read_text()
    finish = "        kernels.mean_finish_kernel(grid=1, block=256, args=(partial, out, parts, n))\n        return out\n"
    assert finish in solution
    src = solution.replace(finish, "        seen = torch.empty(parts)\n        seen[:] = partial\n"
                           "        return torch.full((), sum(seen.tolist()) / n, device=predictions.device)\n")
    v = check(gpu, src, "ok", task=MSE)
    assert "kernel ablation inconclusive" in v.reason, v.reason
    v = check(gpu, solution, "ok", task=MSE)  # the built-in solution: ablated, its outputs need its kernels
    assert "kernel ablation" not in v.reason, v.reason


def test_torch_op_hidden_from_static_rules_is_a_cheat(gpu):
    v = check(gpu, mutate("        return y\n", "        return y * 1.0\n"), "cheat")
    assert v.rule == "forward-torch-op" and "mul" in v.reason


def test_illegal_memory_access_crashes_then_honest_ok(gpu):
    pid = gpu.worker_pid
    v = check(gpu, mutate(BODY, "if (i < n) y[i + (1L << 40)] = 1.f;"), "crash")
    assert "illegal" in v.reason.lower() or "CUDA" in v.reason
    # the fault's wait (~150 ms on an H200) and the verdict's making are reported apart
    assert 0 < v.stage_seconds["run.after_raise"] < v.stage_seconds["run.until_raise"], v.stage_seconds
    assert gpu.worker_pid != pid
    # the crashed worker is stopped, not killed, until the verifier is idle (its exit stalls others' allocations)
    (old,) = [w for w in gpu._suspended if w.pid == pid]
    assert old.reserved_mib is not None and process_state(pid, "T") == "T"
    check(gpu, HONEST, "ok")
    deadline = time.monotonic() + 30
    while gpu.stats()["reaped_idle"] < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gpu.stats()["reaped_idle"] >= 1 and not gpu._suspended and old.proc.poll() is not None
    # the replacement was forked and its self-test stopped before the exclusive timing stage
    (worker,) = [w for w in list(gpu._idle.queue) if w.pid == gpu.worker_pid]
    assert worker.forked and worker.info["self_test"].startswith("ok") and "timing skipped" in worker.info["self_test"]
    # and it loaded the jobs' kernels before it first took the gate (a capture: nothing ran)
    preload = worker.info["preload"]
    assert preload["ops"] > 0 and "error" not in preload and preload["libraries"] == "cublas, cudnn", preload
    assert "preload" in worker.info["boot_phases_s"]


#: the preload check, run in a fresh process as a sandbox worker runs it at its boot: in pytest's own process earlier
#: tests' CUDA state (their garbage, libraries already initialised, threads) made it fail in some orders (twice, on an
#: H200 and an H100)
PRELOAD_CHECK = """
import json, torch
from dice_ray.verify.sandbox.kernel_preload import preload_kernels
torch.cuda.init()
x = torch.full((8,), 3.0, device="cuda")
torch.cuda.synchronize()
before = torch.cuda.memory_allocated()
got = preload_kernels(torch.cuda.current_device())
print(json.dumps({"got": got, "before": before, "after": torch.cuda.memory_allocated(),
                  "reserved": torch.cuda.memory_reserved(), "intact": torch.equal(x, torch.full((8,), 3.0, device="cuda")),
                  "works": float((x + 1).sum().item())}))
"""


def test_kernel_preload_runs_nothing_and_frees_its_memory():
    proc = subprocess.run([sys.executable, "-c", PRELOAD_CHECK], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    got = r["got"]
    assert "error" not in got and got["ops"] == 8 and got["ms"] > 0 and got["libraries"] == "cublas, cudnn", got
    assert r["after"] == r["before"] and r["reserved"] >= r["before"], r
    assert r["intact"] and r["works"] == 32.0, r  # nothing replayed; the context works


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


SIZED_REF = RELU_REF.replace("def get_inputs():\n    return [torch.randn(1024, 1024)]",
                             "batch_size = 256\ndim = 1024\n\ndef get_inputs():\n    return [torch.randn(batch_size, dim)]")
SIZED = Task("test/relu-sized", "relu", 1, SIZED_REF)


def test_hard_coded_size_fails_the_shape_trial(gpu):
    assert "batch_size = 256" in SIZED_REF
    v = check(gpu, HONEST, "ok", task=SIZED)
    assert "shape trial (batch_size 256 -> 512) correct" in v.reason and "scaled trial" in v.reason
    v = check(gpu, mutate("args=(x, y, n)", "args=(x, y, 256 * 1024)").replace("grid=(n + 255) // 256", "grid=1024"),
              "incorrect", task=SIZED)
    assert v.reason.startswith("shape trial")


def test_bf16_precision_downgrade_is_a_cheat(gpu):
    trunc = "if (i < n) { float v = __int_as_float(__float_as_int(x[i]) & 0xFFFF0000); y[i] = v > 0.f ? v : 0.f; }"
    v = check(gpu, mutate(BODY, trunc), "cheat")  # within allclose(1e-2), far from fp32
    assert v.rule == "precision-downgrade"


def test_honest_fp32_passes_the_precision_check(gpu):
    v = check(gpu, HONEST, "ok")
    assert "fp32 error vs float64" in v.reason


def _stateful(state_init: str, body: str) -> str:
    """HONEST whose forward keeps state (allowed only with static rules off) and always launches."""
    src = mutate("        super().__init__()\n", "        super().__init__()\n" + state_init)
    return mutate("        y = torch.empty_like(x)\n        n = x.numel()\n"
                  "        kernels.relu_kernel(grid=(n + 255) // 256, block=256, args=(x, y, n))\n        return y\n",
                  body, src)


def _pointer_cache(after: int) -> str:
    """A candidate that, from call ``after + 1`` on, returns the output it computed before for the same
    input address and shape (one empty launch a call)."""
    return _stateful("        self.cache = {}\n        self.calls = 0\n", (
        "        n = x.numel()\n        self.calls += 1\n        key = (x.data_ptr(), tuple(x.shape))\n"
        f"        if self.calls <= {after} or key not in self.cache:\n            y = torch.empty_like(x)\n"
        "            kernels.relu_kernel(grid=(n + 255) // 256, block=256, args=(x, y, n))\n"
        "            self.cache[key] = y\n"
        "        else:\n            kernels.relu_kernel(grid=1, block=1, args=(x, torch.empty_like(x), 0))\n"
        "        return self.cache[key]\n"))


def test_caching_by_pointer_gives_wrong_outputs(unguarded_gpu):
    # from the first call: a trial's cloned inputs may land where an earlier trial's were freed, or the timed calls' do
    check(unguarded_gpu, _pointer_cache(after=0), "incorrect")
    # honest through the correctness trials: the timed calls' outputs must catch it
    v = check(unguarded_gpu, _pointer_cache(after=6), "incorrect")
    assert "timed call" in v.reason


def test_batch_and_skip_gives_wrong_timed_outputs(unguarded_gpu):
    src = _stateful("        self.calls = 0\n        self.last = None\n", (
        "        n = x.numel()\n        self.calls += 1\n"
        "        if self.calls <= 6 or self.calls % 2:\n            y = torch.empty_like(x)\n"
        "            kernels.relu_kernel(grid=(n + 255) // 256, block=256, args=(x, y, n))\n            self.last = y\n"
        "        else:\n            kernels.relu_kernel(grid=1, block=1, args=(x, torch.empty_like(x), 0))\n"
        "        return self.last\n"))
    v = check(unguarded_gpu, src, "incorrect")
    assert "timed call" in v.reason


def test_work_deferred_to_the_next_call_gives_wrong_timed_outputs(unguarded_gpu):
    """Several calls share a timed window; a candidate that writes each output during the next call
    leaves the last output of a window unwritten (window sizes are secret)."""
    src = _stateful("        self.calls = 0\n        self.pending = None\n", (
        "        n = x.numel()\n        self.calls += 1\n        y = torch.empty_like(x)\n"
        "        if self.calls <= 6:\n"
        "            kernels.relu_kernel(grid=(n + 255) // 256, block=256, args=(x, y, n))\n            return y\n"
        "        if self.pending is not None:\n            px, py = self.pending\n"
        "            kernels.relu_kernel(grid=(n + 255) // 256, block=256, args=(px, py, n))\n"
        "        else:\n            kernels.relu_kernel(grid=1, block=1, args=(x, torch.empty_like(x), 0))\n"
        "        self.pending = (x, y)\n        return y\n"))
    v = check(unguarded_gpu, src, "incorrect")
    assert "timed call" in v.reason


def test_patched_timer_fails_the_wall_clock_audit(unguarded_gpu):
    patch = (
        "import sys\n_t = sys.modules['dice_ray.verify.trials.timing']\n_orig = _t.time_calls\n"
        "def _fast(*a, **k):\n    times = _orig(*a, **k)\n"
        "    times.per_call['candidate'] = [t / 100 for t in times.per_call['candidate']]\n    return times\n"
        "_t.time_calls = _fast\n"
    )
    v = check(unguarded_gpu, mutate("import torch\n", "import torch\n" + patch), "cheat")
    assert v.rule == "timing-audit" and "wall clock" in v.reason


LOOP_REF = RELU_REF.replace("return torch.relu(x)", "for _ in range(100):\n            x = x * 1.0001\n        return x")


def test_a_real_large_speedup_passes_the_audit(gpu):
    fused = "if (i < n) { float v = x[i]; for (int k = 0; k < 100; ++k) v *= 1.0001f; y[i] = v; }"
    v = check(gpu, mutate(BODY, fused), "ok", task=Task("test/loop", "loop", 1, LOOP_REF))
    assert v.speedup > 10 and "audit: wall-clock speedup" in v.reason


def test_concurrent_workers_agree_with_serial(gpu, unguarded_gpu):
    """Four workers at once (timing exclusive on the GPU) give the verdicts one worker gives."""
    batch = [HONEST, mutate(BODY, "if (i < n) y[i] = x[i];"), mutate(BODY, "if (i < n) y[i] = = x[i];"),
             mutate(BODY, "if (i < n) y[i + (1L << 40)] = 1.f;")] * 3
    # every verifier of this module idle first: the other fixture's spares start (CUDA contexts) in its own idle
    # time, beside this one's timing (its gate is not this one's; in a run one verifier owns a GPU). Once on the
    # H200 a serial relu gave 0.48 against 0.84, after the unguarded tests
    unguarded_gpu.wait_for_spares(120)
    gpu.wait_for_spares(120)
    serial = [gpu.verify(RELU, src, f"s{i}") for i, src in enumerate(batch)]
    # its 3 crashes' replacements start in its idle time: let them finish before the other verifier times (its
    # gate is not this one's; in a run one verifier owns a GPU): a failure on the H200 gave relu 1.17 against 0.84
    gpu.wait_for_spares(120)
    cfg = VerifyConfig(mode="gpu", workers=4, spare_workers=8, compile_timeout_s=60.0, run_timeout_s=8.0, timing_trials=10)
    with Verifier(cfg, RewardConfig(), device=0) as many:
        together = many.verify_many([(RELU, src, f"p{i}") for i, src in enumerate(batch)])
    assert [(v.verdict, v.correct) for v in together] == [(v.verdict, v.correct) for v in serial]
    ok = [(a, b) for a, b in zip(serial, together) if a.verdict == "ok"]
    off = [(a.speedup, b.speedup, a.reason, b.reason) for a, b in ok if abs(a.speedup / b.speedup - 1) >= 0.4]
    assert not off, off  # timing is exclusive: as alone, up to tiny-kernel noise


def test_inputs_cannot_be_predicted_from_a_known_seed(gpu):
    """The corpus's seed_prediction candidate stores the answers for the inputs of known seeds: with the seed pinned
    to the config's 42 (as every run was before stop 36) it is `ok`, rewarded for computing nothing; with the
    Verifier's own secret seed (the default) it is `incorrect`."""
    from pathlib import Path

    from dice_ray.tasks.loaders import load_tasks

    src = (Path(__file__).parent / "corpus" / "cheats" / "seed_prediction.py").read_text()
    task = next(t for t in load_tasks("builtin").tasks if t.task_id == "builtin/L1/mse_loss")
    assert gpu.input_seed != VerifyConfig().seed
    check(gpu, src, "incorrect", task=task)
    cfg = VerifyConfig(mode="gpu", workers=1, spare_workers=0, input_seed=42, run_timeout_s=20.0, timing_trials=10)
    with Verifier(cfg, RewardConfig(), device=0) as pinned:
        assert pinned.input_seed == 42
        v = check(pinned, src, "ok", task=task)
        assert v.reward > 0


def test_torch_compile_baseline_is_reported():
    cfg = VerifyConfig(mode="gpu", workers=1, spare_workers=2, seccomp=False, landlock=False, compile_baseline=True, run_timeout_s=60.0, timing_trials=10)
    with Verifier(cfg, RewardConfig(), device=0) as v:
        verdict = check(v, HONEST, "ok")
    assert verdict.compiled_ref_ms > 0 and verdict.speedup_compiled > 0 and "torch.compile" in verdict.reason


NONDETERMINISTIC_REF = RELU_REF.replace("return torch.relu(x)", "return torch.relu(x) + torch.rand_like(x)")


def test_reference_facts_are_measured_once_and_used_after():
    """The first job of a reference runs it twice and in float64; the facts come with later jobs, which
    run it once and bound the precision error instead (a downgrade still gets the exact check)."""
    assert NONDETERMINISTIC_REF != RELU_REF
    cfg = VerifyConfig(mode="gpu", workers=1, spare_workers=0, compile_timeout_s=60.0, run_timeout_s=8.0,
                       timing_trials=10)
    with Verifier(cfg, RewardConfig(), device=0) as v:
        first = check(v, HONEST, "ok")
        assert v.stats()["reference_facts"] == 1 and v.stats()["reference_facts_used"] == 0
        assert "fp32 error vs float64" in first.reason and "at most" in first.reason
        second = check(v, HONEST, "ok")
        assert v.stats()["reference_facts_used"] == 1 and "fp32 error vs float64 at most" in second.reason
        trunc = "if (i < n) { float v = __int_as_float(__float_as_int(x[i]) & 0xFFFF0000); y[i] = v > 0.f ? v : 0.f; }"
        cheat = check(v, mutate(BODY, trunc), "cheat")
        assert cheat.rule == "precision-downgrade" and v.stats()["reference_facts_used"] == 2
        bad = Task("test/relu-nondeterministic", "relu", 1, NONDETERMINISTIC_REF)
        for _ in range(2):  # no facts kept for a reference that failed: each job checks it again
            assert check(v, HONEST, "invalid_input", task=bad).rule == "reference-nondeterministic"
        assert v.stats()["reference_facts"] == 1 and v.stats()["reference_facts_used"] == 2


def test_a_group_of_one_reference_measures_its_facts_once():
    """Candidates of one task verified at once (an RL group): one job measures the reference's facts, the
    others wait for them at their reference stage (dice_ray.verify.facts_book) instead of measuring too."""
    cfg = VerifyConfig(mode="gpu", workers=4, spare_workers=0, compile_timeout_s=60.0, run_timeout_s=8.0,
                       timing_trials=10)
    with Verifier(cfg, RewardConfig(), device=0) as v:
        v.verify_many([(RELU, HONEST, f"warm-{i}") for i in range(4)])  # workers booted (and the facts measured)
        group = Task("test/relu-group", "relu", 1, RELU_REF + "\n# a reference new to the verifier\n")
        used = v.stats()["reference_facts_used"]
        verdicts = v.verify_many([(group, HONEST, f"g{i}") for i in range(4)])
        assert [x.verdict for x in verdicts] == ["ok"] * 4, [x.reason for x in verdicts]
        # one measured; each other one found them known or waited for them (never measured too)
        assert v.stats()["reference_facts_used"] - used == 3 and v.stats()["reference_facts"] == 2


def test_prepare_measures_each_reference_once_before_its_candidates():
    """Verifier.prepare (what the trainer calls at start) measures each new reference's facts in a job of its
    own: the candidates that come after run the reference once; a reference that breaks a rule is named with
    the rule, and a malformed task too; a second prepare finds the facts known."""
    cfg = VerifyConfig(mode="gpu", workers=2, spare_workers=0, compile_timeout_s=60.0, run_timeout_s=8.0,
                       timing_trials=10)
    fresh = Task("test/relu-prepared", "relu", 1, RELU_REF + "\n# a reference new to the verifier\n")
    bad = Task("test/relu-nondeterministic", "relu", 1, NONDETERMINISTIC_REF)
    with Verifier(cfg, RewardConfig(), device=0) as v:
        out = v.prepare([fresh, fresh, bad, object()])
        assert (out["measured"], out["known"]) == (1, 0), out
        assert "reference-nondeterministic" in out["failed"]["test/relu-nondeterministic"], out
        assert "task_id" in out["failed"]["?"], out  # the malformed task: the rule its check names
        assert v.stats()["reference_facts"] == 1 and v.stats()["reference_facts_used"] == 0
        verdicts = v.verify_many([(fresh, HONEST, f"g{i}") for i in range(2)])
        assert [x.verdict for x in verdicts] == ["ok", "ok"], [x.reason for x in verdicts]
        assert v.stats()["reference_facts_used"] == 2  # neither candidate measured them
        assert all("fp32 error vs float64 at most" in x.reason for x in verdicts)
        again = v.prepare([fresh])
        assert (again["measured"], again["known"], again["failed"]) == (0, 1, {}), again
