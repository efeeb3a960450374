import time, sys, os, json
import torch
from dice_ray import launch
from dice_ray.config import VerifyConfig
from dice_ray.verify.harness import Harness, warm_imports
warm_imports()
from cuda.bindings import driver
mode = sys.argv[1]
torch.cuda.set_device(0); torch.cuda.init(); torch.cuda.set_per_process_memory_fraction(0.15, 0)
launch.configure(compile_only=False); launch._context(0)
settings = {**VerifyConfig().model_dump(), "mode": "gpu", "device": 0, "gpu_memory_fraction": 0.15, "forked": True}
h = Harness("gpu", 0, settings)
out = {"mode": mode}
def ops(dev):
    for dt in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        x = torch.randn(64, device=dev, dtype=dt); y = torch.rand(64, device=dev, dtype=dt)
        z = x.clone(); z.copy_(y); z.zero_(); z.fill_(1.0)
        for f in (torch.relu, torch.abs, torch.isfinite, torch.isnan, torch.square, torch.sqrt, torch.exp, torch.tanh, torch.sigmoid):
            f(x)
        x + y; x - y; x * y; x / y; torch.where(x > 0, x, y); (x == y); (x != y); (x <= y); x.sum(); x.mean(); x.amax(); x.amin()
        x.double(); x.float(); x.to(torch.float16); x.to(torch.bfloat16)
        torch.cat([x, y]); torch.stack([x, y]); x.view(8, 8).t().contiguous(); (x - y).abs().max()
        torch.nn.functional.softmax(x.view(8, 8).float(), -1)
    torch.randint(0, 10, (64,), device=dev); torch.ones(8, device=dev, dtype=torch.int64).sum(); torch.zeros(8, device=dev, dtype=torch.int64).index_add_(0, torch.arange(8, device=dev), torch.ones(8, device=dev, dtype=torch.int64))
    (torch.ones(8, device=dev, dtype=torch.bool) & torch.ones(8, device=dev, dtype=torch.bool)).all(); torch.ones(8, device=dev).any()
if mode == "preload":
    ok = driver.cuDeviceGetAttribute(driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR, 0)
    out["wait_value_nor_attr"] = str(ok)
    flag = torch.zeros(1, dtype=torch.int32).pin_memory()
    s = torch.cuda.Stream(0)
    t0 = time.perf_counter()
    (err,) = driver.cuStreamWaitValue32(driver.CUstream(s.cuda_stream), driver.CUdeviceptr(flag.data_ptr()), 1, driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)
    out["wait_err"] = str(err)
    with torch.cuda.stream(s):
        ops(torch.device("cuda", 0))
    t1 = time.perf_counter()
    out["queued_while_held_ms"] = round(1e3 * (t1 - t0), 1)
    out["done_before_release"] = s.query()
    time.sleep(0.05)
    out["done_after_50ms_held"] = s.query()
    t2 = time.perf_counter(); flag[0] = 1; s.synchronize(); t3 = time.perf_counter()
    out["release_to_done_ms"] = round(1e3 * (t3 - t2), 2)
elif mode == "direct":
    t0 = time.perf_counter(); ops(torch.device("cuda", 0)); torch.cuda.synchronize(); out["ops_direct_ms"] = round(1e3 * (time.perf_counter() - t0), 1)
marks = []
t0 = time.perf_counter()
r = h.self_test(lambda s: marks.append((s, time.perf_counter())), timing=False)
t1 = time.perf_counter(); marks.append(("end", t1))
out["self_test_stages_ms"] = {a: round(1e3 * (tb - ta), 1) for (a, ta), (b, tb) in zip(marks, marks[1:])}
t0 = time.perf_counter(); ops(torch.device("cuda", 0)); torch.cuda.synchronize(); out["ops_again_ms"] = round(1e3 * (time.perf_counter() - t0), 1)
print(json.dumps(out))
