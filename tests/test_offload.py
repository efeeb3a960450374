"""A colocated learner's states leave its device and come back (:mod:`dice_ray.cluster.offload`,
``cluster.colocate_rollout``).

On CPU (DeepSpeed's CPU accelerator, one gloo rank in this process) the engine's device is the CPU, so "leaving" is a
copy into new memory: checked here for every ZeRO stage, with and without ZeRO-Offload, are the tensors torch
moves (each gets new storage, values kept), the state kinds DeepSpeed's own ``offload_states`` is asked for, and that
an engine offloaded and reloaded after every step trains bit for bit as one that never was. On a GPU
(``@pytest.mark.gpu``) the CUDA memory the states held must be given back and come back bitwise."""

from __future__ import annotations

import pytest
import torch

from dice_ray.cluster.offload import StatesOffload, offload_states, reload_states
from dice_ray.config import load_config


class _Tiny(torch.nn.Module):
    """Three linear layers, a norm and a buffer (torch moves buffers too at ZeRO-0); ``width`` sets the hidden size."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.a, self.h, self.b = torch.nn.Linear(16, width), torch.nn.Linear(width, width), torch.nn.Linear(width, 4)
        self.norm = torch.nn.LayerNorm(width)
        self.register_buffer("scale", torch.full((4,), 0.5))

    def forward(self, x):
        return self.b(self.norm(self.h(self.a(x)).relu())) * self.scale


def _engine(stage: int, offload: bool = False, bf16: bool = False, width: int = 32):
    from dice_ray.policy.deepspeed_setup import deepspeed_initialize, init_single_process_group

    init_single_process_group()
    torch.manual_seed(0)
    model = _Tiny(width)
    zero: dict = {"stage": stage}
    if offload:  # cluster.learner_offload, as Learner.init_engine sets it
        zero["offload_optimizer"] = {"device": "cpu"}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu"}
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
              "zero_optimization": zero, "zero_force_ds_cpu_optimizer": False, "bf16": {"enabled": bf16},
              "steps_per_print": 10**9}
    engine, *_ = deepspeed_initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                      config=config)
    return engine


def _step(engine, seed: int) -> None:
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(seed)).to(engine.device)
    engine.backward(engine(x).pow(2).mean())
    engine.step()


def _weights(engine) -> dict[str, torch.Tensor]:
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=engine.zero_optimization_stage() == 3):
        return {k: v.detach().cpu().clone() for k, v in engine.module.state_dict().items()}


def _moments(engine) -> list[torch.Tensor]:
    """The client optimizer's state tensors (what torch moves at ZeRO 0 and 3)."""
    opt = engine.basic_optimizer
    return [v for state in opt.state.values() for v in state.values() if torch.is_tensor(v) and v.numel() > 1]


# every stage; ZeRO-Offload at 2 and 3 (3 keeps its parameters in CPU memory: DeepSpeed's part is then empty)
ALL = ["optim_states", "hp_params", "lp_params", "lp_grads"]
CASES = [(0, False, []), (1, False, ALL), (2, False, ALL), (3, False, ["lp_params", "lp_grads", "contiguous_grad_buffer"]),
         (2, True, ["lp_params", "lp_grads"]), (3, True, [])]


@pytest.mark.slow
@pytest.mark.parametrize("stage, offload, deepspeed_part", CASES)
def test_offloaded_states_come_back_and_train_on_bitwise(stage, offload, deepspeed_part):
    plain, parked = _engine(stage, offload), _engine(stage, offload)
    reference = torch.nn.Linear(4, 4)  # the frozen KL reference: torch moves it at every stage
    ref_before = {k: v.clone() for k, v in reference.state_dict().items()}
    for seed in range(3):
        _step(plain, seed)
        _step(parked, seed)
        moments = _moments(parked)
        module = list(parked.module.parameters()) + list(parked.module.buffers()) if stage == 0 else []
        watched = list(reference.parameters()) + module + (moments if stage in (0, 3) else [])
        before = [(t.data_ptr(), t.detach().clone()) for t in watched]
        done = offload_states(parked, [reference])
        kinds = [k.value for k in done.deepspeed]
        assert kinds == deepspeed_part
        if kinds:
            assert {k.value for k in parked.optimizer.offloaded_states} == set(kinds)
        moved = {id(t) for t in done.tensors}
        for t, (ptr, value) in zip(watched, before):
            assert id(t) in moved and t.data_ptr() != ptr, "a tensor torch should move kept its memory"
            assert torch.equal(t, value)
        assert done.nbytes == sum(t.numel() * t.element_size() for t in done.tensors) > 0
        reload_states(parked, done)
        assert not kinds or not parked.optimizer.offloaded_states
        assert all(torch.equal(reference.state_dict()[k], v) for k, v in ref_before.items())
    want, got = _weights(plain), _weights(parked)
    assert all(torch.equal(want[k], got[k]) for k in want), "offload and reload changed the training"
    assert want["a.weight"].ne(_weights(_engine(stage, offload))["a.weight"]).any(), "the steps should move the weights"


@pytest.mark.slow
def test_the_switch_sleeps_wakes_and_keeps_its_state_inside_awake():
    engine = _engine(2)
    _step(engine, 0)
    off = StatesOffload(enabled=False)
    off.sleep(engine)
    assert not off.asleep and not engine.optimizer.offloaded_states
    on = StatesOffload(enabled=True)
    on.sleep(engine, [None])
    assert on.asleep and engine.optimizer.offloaded_states
    with on.awake():
        assert not on.asleep and not engine.optimizer.offloaded_states
        _step(engine, 1)  # a step in between (a checkpoint's save, a ZeRO-3 gather) works on the device states
    assert on.asleep and engine.optimizer.offloaded_states
    on.wake()
    assert not on.asleep
    with on.awake():
        pass
    assert not on.asleep, "awake() leaves awake states awake"


def test_zero0_with_deepspeeds_16bit_optimizer_is_refused():
    engine = _engine(0, bf16=True)
    with pytest.raises(ValueError, match="ZeRO-0 with DeepSpeed's FP16_UnfusedOptimizer .* use cluster.zero_stage >= 1"):
        offload_states(engine)


@pytest.mark.gpu
@pytest.mark.parametrize("stage, bf16", [(0, False), (2, False), (2, True), (3, True)])
def test_a_gpu_learner_gives_its_memory_back_and_gets_it_bitwise(stage, bf16):
    width = 2048  # 4.3 M parameters: the hidden layer is above ZeRO-3's persistence threshold (1e5), as a policy's are
    plain = _engine(stage, bf16=bf16, width=width)
    _step(plain, 0)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    parked = _engine(stage, bf16=bf16, width=width)
    _step(parked, 0)
    _step(plain, 1)
    _step(parked, 1)
    before = _weights(parked)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    footprint = held - base  # this engine's weights, master copies, moments (gradients are freed after a step)
    done = offload_states(parked)
    freed = held - torch.cuda.memory_allocated()
    assert footprint > 0 and freed >= 0.9 * footprint, f"offload gave back {freed} of its {footprint} bytes"
    reload_states(parked, done)
    assert torch.cuda.memory_allocated() >= held - 0.1 * footprint, "the states came back to the GPU"
    after = _weights(parked)
    assert all(torch.equal(before[k], after[k]) for k in before)
    _step(plain, 5)
    _step(parked, 5)
    want, got = _weights(plain), _weights(parked)
    assert all(torch.equal(want[k], got[k]) for k in want)


@pytest.mark.slow
@pytest.mark.parametrize("zero", [0, 2])
def test_a_colocated_learner_rank_sleeps_between_its_calls_and_learns_the_same(zero, tmp_path):
    """The learner rank's wiring (its actor class in this process, no Ray): asleep after start-up and after every
    step, its weights read while asleep, a checkpoint saved and loaded leaving it asleep, and the same updates as a
    rank that never offloads (the switch forced on, as a GPU rank with cluster.colocate_rollout gets it)."""
    from dice_ray.cluster.learner import Learner
    from test_learner_ranks import _groups

    cfg = load_config(None, ["rl.beta=0.01", f"cluster.zero_stage={zero}", "rl.seed=3", "sft.enabled=false"])
    plain, colocated = Learner.__ray_actor_class__(cfg, 0, 1), Learner.__ray_actor_class__(cfg, 0, 1)
    colocated.offload = StatesOffload(True)
    assert plain.init_engine()["offload_seconds"] is None
    assert colocated.init_engine()["offload_seconds"] is not None and colocated.offload.asleep
    for seed in (1, 2):
        a, b = plain.train_step(_groups(3, seed)), colocated.train_step(_groups(3, seed))
        assert colocated.offload.asleep and not plain.offload.asleep
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]
    want, got = plain.get_weights(), colocated.get_weights()
    assert colocated.offload.asleep, "under ZeRO 0-2 the weights are read where they are"
    assert all(torch.equal(want[k], got[k]) for k in want)
    colocated.save(str(tmp_path), "t")
    assert colocated.offload.asleep
    colocated.load(str(tmp_path), "t")
    assert colocated.offload.asleep and colocated.step_count == 2
    a, b = plain.train_step(_groups(2, 9)), colocated.train_step(_groups(2, 9))
    assert a["loss"] == b["loss"]
