"""The load_inline format on a GPU (@pytest.mark.gpu): build + link + load, launch counters, DICE
infilling records verified end to end, cheats, the build cache across verifications."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from dice_ray.config import RewardConfig, VerifyConfig
from dice_ray.tasks.task import Task
from dice_ray.verify.candidate.inline_build import InlineBuilder, device_arch
from dice_ray.verify.candidate.inline_counters import instrument_cuda
from dice_ray.verify.candidate.inline_spec import extract_specs
from dice_ray.verify.trials import inline_launches as inline
from dice_ray.verify.trials.execution import exec_inline
from dice_ray.verify.verifier import Verifier
from test_verify_inline import CANDIDATE

pytestmark = pytest.mark.gpu

RELU_REF = """
import torch
import torch.nn as nn
class Model(nn.Module):
    def forward(self, x):
        return torch.relu(x)
def get_inputs():
    return [torch.randn(1 << 20)]
def get_init_inputs():
    return []
"""
COPY_REF = RELU_REF.replace("torch.relu(x)", "x * 1.0")
TRANSPOSE_REF = RELU_REF.replace("torch.relu(x)", "x.t().contiguous()").replace("torch.randn(1 << 20)",
                                                                                "torch.randn(1024, 768)")
#: the transpose answered by ATen copy ops in the host code, beside a launch of the kernel over zero elements
TRANSPOSE_BY_COPY = CANDIDATE.replace("auto y = torch::empty_like(x);", "auto y = x.t().contiguous();").replace(
    "relu_kernel<<<(n + 255) / 256, 256>>>(x.contiguous().data_ptr<float>(), y.data_ptr<float>(), n);",
    "relu_kernel<<<1, 256>>>(x.data_ptr<float>(), y.data_ptr<float>(), 0);")
#: DICE infilling records (id -> verdict observed on the H200 machine, 2026-11-30), chosen for varied
#: ops and moderate input sizes; 7278 (maximum(x, 0) fused) computes wrong values in 175 of 432 elements
DICE_EXPECTED = {617: "ok", 3890: "ok", 7773: "ok", 136: "ok", 7278: "incorrect", 6180: "ok", 3635: "ok",
                 8917: "ok"}
RESULTS: dict[str, object] = {}


def record(key: str, value: object) -> None:
    """Observed figures, written to $OUT/inline_gpu.json on the device machine."""
    RESULTS[key] = value
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "inline_gpu.json"), "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("inline-gpu-cache")


@pytest.fixture(scope="module")
def gpu(cache):
    cfg = VerifyConfig(mode="gpu", compile_timeout_s=120.0, run_timeout_s=60.0, timing_trials=10, workers=4,
                       inline_cache_dir=str(cache))
    with Verifier(cfg, RewardConfig(), device=0) as v:
        yield v


def test_build_link_load_and_count_launches_in_process(cache):
    (spec,) = extract_specs(CANDIDATE)
    b = InlineBuilder(cache, arch=device_arch(0), link=True)  # the verifier's settings: same cache entries
    t0 = time.perf_counter()
    r = b.build(spec)
    cold = time.perf_counter() - t0
    assert r.ok and r.path, r.log
    t0 = time.perf_counter()
    again = b.build(spec)
    hit = time.perf_counter() - t0
    assert again.cached and again.path == r.path
    record("direct_build", {"cold_s": cold, "hit_s": hit, "lite": r.lite, "stats": b.stats()})
    ns = exec_inline(CANDIDATE, {"modules": [r.job_entry(spec)]}, guarded=False)
    model = ns["ModelNew"]()
    x = torch.randn(10_000, device="cuda")
    before, runs = inline.launch_count(), inline.kernel_runs()
    for _ in range(3):
        y = model(x)
    torch.cuda.synchronize()
    assert torch.equal(y, torch.relu(x))
    assert inline.launch_count() == before + 3 and inline.kernel_runs() == runs + 3
    x2 = x.abs() + 1.0  # relu(x2) == x2: values no freed block holds
    with inline.kernels_suppressed():  # the kernel ablation's switch: launched, counted, returns at entry
        z = model(x2)
    torch.cuda.synchronize()
    assert inline.launch_count() == before + 4 and inline.kernel_runs() == runs + 4
    assert not torch.equal(z, x2)
    assert torch.equal(model(x2), x2)  # switched off again


def test_dice_records_end_to_end(gpu, dice_data):
    records = {r["id"]: r for r in json.loads((dice_data / "kernel_infilling_evaluation.json").read_text())}
    items = [(Task(f"dice/{i}", f"dice-{i}", 1, records[i]["pytorch_code"]), records[i]["cuda_code"], str(i))
             for i in DICE_EXPECTED]
    t0 = time.perf_counter()
    verdicts = gpu.verify_many(items)
    observed = {int(v.candidate_id): (v.verdict, v.rule, v.speedup, v.reason[:300]) for v in verdicts}
    record("dice", {"seconds": time.perf_counter() - t0, "verdicts": observed,
                    "builder": gpu._inline_builder.stats()})
    for v in verdicts:
        print(v.candidate_id, v.verdict, v.rule, v.speedup, v.reason[:200])
    assert {i: observed[i][0] for i in DICE_EXPECTED} == DICE_EXPECTED


def test_second_verify_of_identical_candidate_hits_the_cache(gpu):
    task = Task("test/relu", "relu", 1, RELU_REF)
    first = gpu.verify(task, CANDIDATE, "first")
    hits = gpu._inline_builder.stats()["hits"]
    second = gpu.verify(task, CANDIDATE, "second")
    record("relu", {"first": first.model_dump(), "second": second.model_dump()})
    assert first.verdict == second.verdict == "ok", first.reason
    assert gpu._inline_builder.stats()["hits"] == hits + 1


def test_device_counted_module_verifies(gpu):
    """A launch inside a macro cannot be wrapped: the module is counted on the device."""
    src = CANDIDATE.replace("torch::Tensor relu_cuda(", "#define LAUNCH(k, g, b, ...) k<<<g, b>>>(__VA_ARGS__)\n"
                            "torch::Tensor relu_cuda(", 1).replace("relu_kernel<<<(n + 255) / 256, 256>>>(",
                                                                   "LAUNCH(relu_kernel, (n + 255) / 256, 256, ")
    assert instrument_cuda(extract_specs(src)[0].cuda_source).counting == "device"
    v = gpu.verify(Task("test/relu", "relu", 1, RELU_REF), src, "macro")
    record("device_counted", v.model_dump())
    assert v.verdict == "ok", v.reason


def test_cheats_and_errors(gpu):
    relu = Task("test/relu", "relu", 1, RELU_REF)
    torch_op = CANDIDATE.replace("    return y;\n}", "    y = at::relu(x);\n    return y;\n}")
    v = gpu.verify(relu, torch_op, "cpp-torch-op")
    assert v.verdict == "cheat" and v.rule == "cpp-torch-op", v.reason
    decoy = CANDIDATE.replace(
        "relu_kernel<<<(n + 255) / 256, 256>>>(x.contiguous().data_ptr<float>(), y.data_ptr<float>(), n);",
        "if (n < 0) relu_kernel<<<1, 1>>>(x.data_ptr<float>(), y.data_ptr<float>(), n);\n"
        "    cudaMemcpyAsync(y.data_ptr<float>(), x.data_ptr<float>(), n * sizeof(float), cudaMemcpyDeviceToDevice, 0);")
    v = gpu.verify(Task("test/copy", "copy", 1, COPY_REF), decoy, "decoy")
    record("decoy", v.model_dump())
    assert v.verdict == "cheat" and v.rule == "no-kernel-launch", v.reason
    v = gpu.verify(Task("test/transpose", "transpose", 1, TRANSPOSE_REF), TRANSPOSE_BY_COPY, "transpose-by-copy")
    record("transpose_by_copy", v.model_dump())
    assert v.verdict == "cheat" and v.rule == "kernel-not-used", v.reason
    broken = CANDIDATE.replace("int i = blockIdx.x", "int i = = blockIdx.x")
    v = gpu.verify(relu, broken, "broken")
    assert v.verdict == "compile_error" and "cuda.cu(" in v.reason and "error" in v.reason, v.reason
