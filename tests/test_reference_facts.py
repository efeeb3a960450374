"""The reference's facts (dice_ray.verify.trials.reference_facts): measured once, a bound that never lets a
precision downgrade through, JSON round trip.  On the CPU: the math is the same on any device."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

from dice_ray.verify.trials import reference_facts as rf


class Net(nn.Module):
    """fp32 matmul + tanh, and an integer output (not checked for precision)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(256, 128)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.tanh(self.lin(x))
        return y, y.argmax(dim=1)


def _setup() -> tuple[Net, list[torch.Tensor], tuple]:
    torch.manual_seed(0)
    net = Net().eval()
    x = [torch.randn(64, 256)]
    with torch.no_grad():
        expected = net(*x)
    return net, x, expected


def _exact(out: torch.Tensor, net: Net, x: list[torch.Tensor], p: rf.OutputPrecision, ref: torch.Tensor) -> float:
    g = rf.float64_outputs(net, x)[p.index]
    return rf.relative_rms(out, g, p.scale, torch.isfinite(g) & torch.isfinite(ref))


def test_measure_finds_the_fp32_outputs_and_their_own_error():
    net, x, expected = _setup()
    facts = rf.measure(net, x, expected, precision_rtol=1e-4)
    assert facts.note == "" and [p.index for p in facts.outputs] == [0]  # the int64 argmax is not checked
    p = facts.outputs[0]
    assert p.scale > 0 and 0 < p.ref_error < 1e-5  # fp32 rounding against float64
    assert rf.relative_rms(expected[0], rf.float64_outputs(net, x)[0], p.scale) == pytest.approx(p.ref_error, rel=1e-6)
    assert net.lin.weight.dtype == torch.float32  # the float64 run used a copy


def test_the_bound_is_never_below_the_exact_error():
    net, x, expected = _setup()
    p = rf.measure(net, x, expected, 1e-4).outputs[0]
    ref = expected[0]
    gen = torch.Generator().manual_seed(1)
    for noise in (0.0, 1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2):
        out = ref + noise * torch.randn(ref.shape, generator=gen)
        assert rf.error_bound(out, ref, p) >= _exact(out, net, x, p, ref) - 1e-12
    for dtype in (torch.float16, torch.bfloat16):  # downgrades: the bound is far above the rule's limit
        out = ref.to(dtype).float()
        assert rf.error_bound(out, ref, p) > max(1e-4, 10 * p.ref_error)
        assert _exact(out, net, x, p, ref) > max(1e-4, 10 * p.ref_error)


def test_an_honest_output_clears_the_bound_and_a_non_finite_one_does_not():
    net, x, expected = _setup()
    p = rf.measure(net, x, expected, 1e-4).outputs[0]
    ref = expected[0]
    assert rf.error_bound(ref.clone(), ref, p) == pytest.approx(p.ref_error)
    bad = ref.clone()
    bad[0, 0] = float("nan")
    assert not rf.error_bound(bad, ref, p) <= 1e-4  # NaN: no bound, the exact check runs


def test_no_float64_run_when_the_check_is_off_or_nothing_is_fp32():
    net, x, expected = _setup()
    assert rf.measure(net, x, expected, 0.0) == rf.ReferenceFacts()
    assert rf.measure(net.half(), [x[0].half()], tuple(e.half() for e in expected), 1e-4) == rf.ReferenceFacts()


def test_a_reference_that_does_not_run_in_float64_is_noted():
    class NoDouble(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.dtype == torch.float64:
                raise TypeError("float32 only")
            return x * 2

    x = [torch.randn(8)]
    facts = rf.measure(NoDouble(), x, x[0] * 2, 1e-4)
    assert facts.outputs == [] and facts.note.startswith("precision check skipped") and "TypeError" in facts.note


def test_facts_round_trip_as_json():
    net, x, expected = _setup()
    facts = rf.measure(net, x, expected, 1e-4)
    assert rf.ReferenceFacts.from_dict(json.loads(json.dumps(facts.to_dict()))) == facts
    with pytest.raises((KeyError, TypeError)):
        rf.ReferenceFacts.from_dict({"outputs": [{"index": 0}], "note": ""})
