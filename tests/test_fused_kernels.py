"""cluster.fused_kernels (dice_ray.policy.fused): config values, the clear errors, the module swap on CPU with a
stand-in for Liger, the learner benchmark's --fused option, and (GPU + Liger) equal outputs and gradients."""

from __future__ import annotations

import copy
import importlib.util
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError
from transformers.models.qwen3 import modeling_qwen3

from dice_ray.cluster.console import describe_learner
from dice_ray.config import ModelConfig, load_config
from dice_ray.policy.fused import apply_fused_kernels
from dice_ray.policy.model import RMSNorm, block_mask, build_model, forward_hidden, prompt_blocks, token_logits

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _tiny(dtype: str = "float32") -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(ModelConfig(dtype=dtype), vocab_size=64, pad_id=0)


def _batch(P: int = 6, R: int = 8, bs: int = 4, device: str = "cpu"):
    """Prompt ‖ clean response ‖ one noisy copy, with SDAR's block mask (dice_ray.policy.model.block_mask)."""
    pb = prompt_blocks(P, bs)
    rb = torch.arange(R) // bs + 1
    blocks = torch.cat([pb, rb, rb])
    copies = torch.cat([torch.zeros(P + R, dtype=torch.long), torch.ones(R, dtype=torch.long)])
    pos = torch.cat([torch.arange(P + R), torch.arange(P, P + R)])
    ids = torch.randint(1, 63, (2, P + 2 * R), generator=torch.Generator().manual_seed(1))
    mask = block_mask(blocks, copies, blocks, copies)
    return ids.to(device), pos.to(device), mask.to(device)


class _FakeSwiGLU(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = torch.nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = torch.nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = torch.nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _fake_rope(*args, **kwargs):
    raise AssertionError("Liger's RoPE called on CPU tensors")


@pytest.fixture
def fake_liger(monkeypatch):
    """An importable ``liger_kernel.transformers`` stand-in; the RoPE global is restored after the test."""
    mod = types.ModuleType("liger_kernel.transformers")
    mod.LigerSwiGLUMLP, mod.liger_rotary_pos_emb = _FakeSwiGLU, _fake_rope
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", mod)
    monkeypatch.setattr(modeling_qwen3, "apply_rotary_pos_emb", modeling_qwen3.apply_rotary_pos_emb)
    return mod


@pytest.mark.parametrize("kind", ["auto", "none", "liger"])
def test_config_accepts_kinds(kind):
    assert load_config(None, [f"cluster.fused_kernels={kind}", "cluster.learner_gpus=1"]).cluster.fused_kernels == kind


def test_config_rejects_liger_for_a_cpu_learner_before_anything_starts():
    """The default learner is on CPU (learner_gpus 0): asking for Liger there fails with the config, naming both keys."""
    with pytest.raises((ValidationError, ValueError), match=r"fused_kernels='liger' needs a GPU learner.*learner_gpus is 0"):
        load_config(None, ["cluster.fused_kernels=liger"])
    assert load_config(None, ["cluster.fused_kernels=auto"]).cluster.learner_gpus == 0  # auto: off on CPU, no error


def test_config_rejects_other_kind_naming_the_key():
    with pytest.raises((ValidationError, ValueError), match="fused_kernels"):
        load_config(None, ["cluster.fused_kernels=triton"])
    assert load_config(None, []).cluster.fused_kernels == "auto"


def test_unknown_kind_names_the_key():
    with pytest.raises(ValueError, match=r"cluster.fused_kernels='fast'.*one of"):
        apply_fused_kernels(_tiny(), "fast")


def test_auto_and_none_leave_a_cpu_model_untouched(fake_liger):
    model = _tiny()
    before = [(n, type(m)) for n, m in model.named_modules()]
    rope = modeling_qwen3.apply_rotary_pos_emb
    assert apply_fused_kernels(model, "auto") == [] and apply_fused_kernels(model, "none") == []
    assert [(n, type(m)) for n, m in model.named_modules()] == before
    assert modeling_qwen3.apply_rotary_pos_emb is rope


def test_liger_on_cpu_raises_naming_cuda(fake_liger):
    model = _tiny()
    with pytest.raises(ValueError, match=r"cluster.fused_kernels='liger'.*on cpu.*CUDA only"):
        apply_fused_kernels(model, "liger")
    assert not any(isinstance(m, _FakeSwiGLU) for m in model.modules())


def test_liger_unimportable_gives_the_install_hint(monkeypatch):
    from dice_ray.policy import fused

    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # `import liger_kernel` raises ImportError
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", None)
    monkeypatch.setattr(fused, "_device_type", lambda model: "cuda")  # as if on a GPU: the import is checked next
    with pytest.raises(ValueError, match=r"cluster.fused_kernels='liger'.*pip install -e '\.\[gpu\]'"):
        apply_fused_kernels(_tiny(), "liger")
    assert apply_fused_kernels(_tiny(), "auto") == []
    assert "Liger-Kernel does not import" in fused.liger_blocker(_tiny())


def test_on_cpu_the_device_is_named_before_the_install(monkeypatch):
    """On a CPU learner installing Liger would not help: the error says CUDA, not pip."""
    monkeypatch.setitem(sys.modules, "liger_kernel", None)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", None)
    with pytest.raises(ValueError, match=r"on cpu, and Liger's Triton kernels run on CUDA only") as err:
        apply_fused_kernels(_tiny(), "liger")
    assert "pip install" not in str(err.value)


def test_unsupported_model_type_is_named(fake_liger, monkeypatch):
    from dice_ray.policy import fused

    class Gpt2Like(torch.nn.Linear):
        config = types.SimpleNamespace(model_type="gpt2")

    monkeypatch.setattr(fused, "_device_type", lambda model: "cuda")
    with pytest.raises(ValueError, match=r"model_type 'gpt2'.*supported: \['llama', 'qwen2', 'qwen3'\]"):
        apply_fused_kernels(Gpt2Like(2, 2), "liger")


def test_swap_keeps_parameters_and_outputs(fake_liger):
    """The swap itself (device check bypassed, Liger's classes stood in for): same Parameter objects and state-dict
    names, every MLP replaced, the RoPE global falls back to transformers' own on CPU; the norms stay torch's."""
    from dice_ray.policy import fused

    model = _tiny()
    ref = copy.deepcopy(model)
    params, keys = dict(model.named_parameters()), list(model.state_dict())
    assert fused._patch_liger(model, "qwen3", fake_liger) == ["swiglu", "rope"]
    assert list(model.state_dict()) == keys and all(params[n] is p for n, p in model.named_parameters())
    layers = model.config.num_hidden_layers
    assert sum(isinstance(m, RMSNorm) for m in model.modules()) == 4 * layers + 1  # input, post, q, k; final
    assert sum(isinstance(m, _FakeSwiGLU) for m in model.modules()) == layers
    assert not any(isinstance(m, modeling_qwen3.Qwen3MLP) for m in model.modules())
    assert modeling_qwen3.apply_rotary_pos_emb._dice_unfused is not None
    ids, pos, mask = _batch()
    torch.testing.assert_close(forward_hidden(model, ids, pos, mask), forward_hidden(ref, ids, pos, mask))
    wrapped = modeling_qwen3.apply_rotary_pos_emb
    fused._patch_liger(model, "qwen3", fake_liger)  # a second call does not wrap the wrapper
    assert modeling_qwen3.apply_rotary_pos_emb is wrapped


def test_describe_learner_names_fused_kernels():
    info = {"family": "sdar", "params": 1e6, "model": "built", "zero_stage": 2, "backend": "nccl", "ranks": 1,
            "device": "cuda:0", "seconds": 2.0}
    assert "fused" not in describe_learner({**info, "fused_kernels": []})
    line = describe_learner({**info, "fused_kernels": ["swiglu", "rope"]})
    assert "on cuda:0, fused kernels: swiglu, rope (Liger); ready in 2.0 s" in line


def _bench():
    if "learner_throughput" in sys.modules:
        return sys.modules["learner_throughput"]
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("learner_throughput", BENCH / "learner_throughput.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["learner_throughput"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_benchmark_fused_option_on_cpu(capsys):
    bench = _bench()
    assert bench.parse_args(["--device", "cpu", "--tiny"]).fused == ["none"]
    assert bench.parse_args(["--device", "cuda", "--tiny"]).fused == ["none", "liger"]
    for bad, said in (("liger", "need a CUDA device"), ("none,fast", "must be one of"), ("none,none", "twice")):
        with pytest.raises(SystemExit):
            bench.parse_args(["--device", "cpu", "--tiny", "--fused", bad])
        assert said in capsys.readouterr().err
    assert bench._child_argv(["--tiny", "--fused=none,liger", "--out", "a.json", "--profile", "p.txt"], "liger",
                             "t.json") == ["--tiny", "--profile", "p.liger.txt", "--fused", "liger", "--out", "t.json"]


def test_benchmark_compare_reports_a_failed_variant(tmp_path, monkeypatch, capsys):
    """The parent's table: one variant's figures, the other's error line, no ratio."""
    bench = _bench()

    def fake_run(cmd, **kwargs):
        variant, out = cmd[cmd.index("--fused") + 1], cmd[cmd.index("--out") + 1]
        if variant == "liger":
            return subprocess.CompletedProcess(cmd, 1, stderr="Traceback ...\nValueError: no liger here\n")
        Path(out).write_text(json.dumps({"seconds": 2.0, "processed_tokens_per_s": 1000.0, "mfu": 0.2,
                                         "matmul_mfu": 0.15, "peak_gib": 30.5}))
        return subprocess.CompletedProcess(cmd, 0, stderr="")

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    out = tmp_path / "both.json"
    argv = ["--device", "cuda", "--tiny", "--out", str(out)]
    res = bench.compare_variants(bench.parse_args(argv), argv)
    text = capsys.readouterr().out
    assert ["none", "2.000", "1000", "20.0%", "15.0%", "30.5"] in [line.split() for line in text.splitlines()]
    assert "liger    failed: exit 1: ValueError: no liger here" in text
    assert res["liger_over_none"] is None and json.loads(out.read_text())["variants"]["none"]["mfu"] == 0.2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tol", [("float32", 1e-4), ("bfloat16", 3e-2)])
def test_gpu_liger_matches_unpatched(dtype, tol, monkeypatch):
    """Liger's kernels vs transformers' own on a tiny Qwen3 (block mask, prompt ‖ clean ‖ noisy copy): hidden states
    and every gradient of a scalar loss agree to a relative L2 error below ``tol`` (fp32 1e-4: reduction order only;
    bf16 3e-2: Liger rounds its fused results to bf16 at other points than the eager chain does)."""
    liger = pytest.importorskip("liger_kernel.transformers")
    monkeypatch.setattr(modeling_qwen3, "apply_rotary_pos_emb", modeling_qwen3.apply_rotary_pos_emb)
    model = _tiny(dtype).cuda()
    ref = copy.deepcopy(model)
    ids, pos, mask = _batch(device="cuda")

    def run(m):
        m.zero_grad(set_to_none=True)
        hidden = forward_hidden(m, ids, pos, mask)
        loss = token_logits(m, hidden, mask_id=63).log_softmax(-1)[..., :8].mean()
        loss.backward()
        return hidden.detach().float(), {n: p.grad.float() for n, p in m.named_parameters()}

    h_ref, g_ref = run(ref)  # before the patch: transformers' RoPE too
    assert apply_fused_kernels(model, "liger") == ["swiglu", "rope"]
    assert isinstance(model.model.layers[0].mlp, liger.LigerSwiGLUMLP)
    assert modeling_qwen3.apply_rotary_pos_emb._dice_unfused is not None
    h, g = run(model)

    def rel(a, b):
        return float((a - b).norm() / b.norm().clamp_min(1e-12))

    assert rel(h, h_ref) < tol
    assert set(g) == set(g_ref)
    worst = max(g_ref, key=lambda n: rel(g[n], g_ref[n]))
    assert rel(g[worst], g_ref[worst]) < tol, worst
