"""Output comparison (scaled tolerance, dtype, non-finite) and the reward."""

from __future__ import annotations

import math

import pytest
import torch

from dice_ray.config import RewardConfig
from dice_ray.verify.reward import compute_reward
from dice_ray.verify.trials.correctness import compare_outputs, fill_could_match
from dice_ray.verify.verdict import Verdict

TOL = dict(rtol=1e-2, atol=1e-2)


def test_identical_and_noisy_outputs_pass():
    ref = torch.randn(256, 256)
    assert compare_outputs(ref.clone(), ref, **TOL).ok
    assert compare_outputs(ref * (1 + 1e-4), ref, **TOL).ok
    assert compare_outputs((ref, 3), (ref.clone(), 3), **TOL).ok


def test_zeros_for_a_near_zero_reference_fail_where_kernelbench_passes():
    ref = torch.randn(512, 512) * 1e-3
    zeros = torch.zeros_like(ref)
    assert torch.allclose(zeros, ref, atol=1e-2, rtol=1e-2)  # KernelBench's check lets this through
    result = compare_outputs(zeros, ref, **TOL)
    assert not result.ok and "differ" in result.reason
    assert not compare_outputs(ref * 0.5, ref, **TOL).ok
    assert compare_outputs(ref * (1 + 1e-4), ref, **TOL).ok  # an honest near-zero result still passes


def test_all_zero_reference_accepts_zeros_only():
    ref = torch.zeros(64)
    assert compare_outputs(torch.zeros(64), ref, **TOL).ok
    assert not compare_outputs(torch.full((64,), 1e-3), ref, **TOL).ok


def test_shape_dtype_structure_mismatches():
    ref = torch.randn(8, 8)
    assert "shape" in compare_outputs(ref.view(64), ref, **TOL).reason
    assert "dtype" in compare_outputs(ref.half(), ref, **TOL).reason  # precision downgrade
    assert "outputs" in compare_outputs((ref, ref), ref, **TOL).reason
    assert not compare_outputs(3.0, ref, **TOL).ok
    assert not compare_outputs(torch.tensor([1, 2]), torch.tensor([1, 3]), **TOL).ok
    assert compare_outputs(torch.tensor([1, 2]), torch.tensor([1, 2]), **TOL).ok


def test_non_finite_values_must_sit_where_the_reference_has_them():
    ref = torch.randn(16)
    bad = ref.clone()
    bad[3] = float("nan")
    assert "NaN" in compare_outputs(bad, ref, **TOL).reason
    ref2 = ref.clone()
    ref2[5] = float("inf")
    assert compare_outputs(ref2.clone(), ref2, **TOL).ok
    flipped = ref2.clone()
    flipped[5] = -float("inf")
    assert not compare_outputs(flipped, ref2, **TOL).ok


def test_half_outputs_use_half_tolerance():
    ref = torch.randn(1024).bfloat16()
    noisy = (ref.float() * 1.02).bfloat16()
    assert compare_outputs(noisy, ref, **TOL, half_rtol=5e-2, half_atol=5e-2).ok
    assert not compare_outputs(noisy, ref, **TOL, half_rtol=1e-3, half_atol=1e-3).ok


def test_reward():
    cfg = RewardConfig()
    assert compute_reward(False, None, False, None, cfg) == 0.0
    assert compute_reward(True, True, True, 4.0, cfg) == 0.0
    assert compute_reward(True, False, False, None, cfg) == 0.0
    assert compute_reward(True, None, False, None, cfg) == cfg.compile_only_reward
    assert compute_reward(True, True, False, None, cfg) == 1.0
    assert compute_reward(True, True, False, 1.0, cfg) == 1.0
    assert compute_reward(True, True, False, 2.0, cfg) == pytest.approx(1.5)
    assert compute_reward(True, True, False, 1000.0, cfg) == pytest.approx(1.0 + 0.5 * 3)
    assert compute_reward(True, True, False, math.inf, cfg) == pytest.approx(2.5)
    assert compute_reward(True, True, False, 0.01, cfg) == pytest.approx(0.5)
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="speedup"):
            compute_reward(True, True, False, bad, cfg)


def test_verdict_round_trip():
    v = Verdict(candidate_id="c", task_id="t", verdict="ok", compiled=True, correct=True, speedup=1.5, reward=1.3,
                reason="", ref_ms=0.2, candidate_ms=0.13, mode="gpu", seconds=0.5)
    assert Verdict.model_validate_json(v.model_dump_json()) == v
    with pytest.raises(ValueError):
        Verdict(candidate_id="c", task_id="t", verdict="great", compiled=True, correct=True, speedup=None,
                reward=0.0, reason="", mode="gpu", seconds=0.0)


def test_count_mismatches_agrees_with_compare_outputs():
    from dice_ray.verify.trials.correctness import count_mismatches

    torch.manual_seed(0)
    r = torch.randn(64, 32)
    cases = [
        (r.clone(), r), (r + 1e-4, r), (r + 0.5, r), (torch.zeros_like(r), r * 1e-4), (r * 1e-4, r * 1e-4),
        (torch.where(r > 0, float("nan"), r), r), (r.half(), r.half()), ((r + 0.03).half(), r.half()),
        (r.long(), r.long()), ((r.long(), r + 1e-5), (r.long(), r)), (r[:10], r), (r.double(), r),
    ]
    for out, ref in cases:
        ok = compare_outputs(out, ref, rtol=1e-2, atol=1e-2).ok
        n = count_mismatches(out, ref, rtol=1e-2, atol=1e-2)
        assert (not isinstance(n, str) and int(n) == 0) == ok, (out, ref, n)


def _cases() -> list[tuple]:
    """(out, ref) pairs on CPU: exact, noisy, wrong, near-zero scale, non-finite, half, integer, nested."""
    torch.manual_seed(0)
    r = torch.randn(64, 32)
    inf_ref = r.clone()
    inf_ref[0, :4] = torch.tensor([float("inf"), float("-inf"), float("nan"), float("nan")])
    return [
        (r.clone(), r), (r + 1e-4, r), (r + 0.5, r), (torch.zeros_like(r), r * 1e-4), (r * 1e-4, r * 1e-4),
        (torch.where(r > 0, float("nan"), r), r), (r.half(), r.half()), ((r + 0.03).half(), r.half()),
        (r.long(), r.long()), ((r.long(), r + 1e-5), (r.long(), r)), (inf_ref.clone(), inf_ref),
        (torch.where(torch.isfinite(inf_ref), inf_ref, 0.0), inf_ref), (-inf_ref, inf_ref), (r.bfloat16(), r.bfloat16()),
        (r * 1e3 + 1.0, r * 1e3), (torch.zeros(0), torch.zeros(0)),
    ]


def test_count_mismatches_batch_agrees_with_compare_outputs_pair_by_pair():
    """One batch of pairs of different scales (each row compared against its own reference's rms)
    gives, pair by pair, zero exactly where compare_outputs passes."""
    from dice_ray.verify.trials.correctness import count_mismatches_batch

    cases = _cases()
    counts = count_mismatches_batch(cases, **TOL)
    assert not isinstance(counts, tuple) and counts.shape == (len(cases),)
    for (out, ref), n in zip(cases, counts.tolist()):
        assert (n == 0) == compare_outputs(out, ref, **TOL).ok, (out, ref, n)
    # the same pairs repeated: the stacked rows stay independent
    again = count_mismatches_batch(cases + cases, **TOL)
    assert again.tolist() == counts.tolist() * 2


def test_count_mismatches_batch_names_the_first_pair_with_another_structure():
    from dice_ray.verify.trials.correctness import count_mismatches_batch

    r = torch.randn(8)
    assert count_mismatches_batch([(r, r), (r[:4], r), ((r, r), r)], **TOL) == (1, "output 0: (4,) torch.float32 on cpu, "
                                                                                 "expected (8,) torch.float32 on cpu")


def test_timed_output_checks_report_wrong_calls_and_compare_aliased_outputs_at_once():
    """Kept outputs are compared later, except an output living in an input slot (the slot is refilled
    before the check stage): that one is compared when added."""
    from dice_ray.verify.trials.timing_stage import TimedOutputChecks, _Mismatch

    checks = TimedOutputChecks(dict(TOL, half_rtol=5e-2, half_atol=5e-2), lambda j: f"call {j}")
    slot = torch.randn(16)
    checks.add(0, slot, slot.clone(), [slot])  # the reference returns its input: compared now
    slot.add_(100.0)  # the slot is refilled with the next call's values
    ref = torch.randn(16)
    checks.add(1, ref, ref.clone(), [torch.randn(16)])
    checks.add(2, ref, ref + 1.0, [torch.randn(16)])
    assert checks.wrong() == ([(2, 16)], 3)
    tiny = TimedOutputChecks(dict(TOL, half_rtol=5e-2, half_atol=5e-2), lambda j: f"call {j}", keep_bytes=1)
    with pytest.raises(_Mismatch, match="call 7: output 0: "):
        tiny.add(7, ref, ref[:8], [])  # over the kept budget: compared (and refused) at once


def test_fill_could_match_only_outputs_an_untouched_honest_buffer_would_give():
    """The kernel ablation skips references a usual initial fill matches within tolerance; a one-element loss
    of another value, or a constant nobody starts a buffer with, is ablated (a host-computed scalar is caught)."""
    def matched(*outs):
        return fill_could_match(outs if len(outs) > 1 else outs[0], **TOL, half_rtol=5e-2, half_atol=5e-2)

    assert matched(torch.zeros(4, 4)) and matched(torch.tensor(0.0)) and matched(torch.tensor(1.0))
    assert matched(torch.full((5,), float("nan"))) and matched(torch.ones(6, dtype=torch.bool))
    assert matched(torch.empty(0)) and matched([]) and matched(torch.zeros(3), 3, None)
    assert matched(torch.tensor([1.0004])) and matched(torch.ones(64) + 1e-4 * torch.randn(64))  # within tolerance
    assert matched(torch.full((3,), -float("inf"))) and matched(torch.full((2,), torch.finfo(torch.float16).min,
                                                                           dtype=torch.float16))
    assert matched(torch.tensor([255], dtype=torch.uint8)) and matched(torch.tensor([-1, -1]))
    assert not matched(torch.tensor(1.7)) and not matched(torch.full((8,), 2.5)) and not matched(torch.tensor([3]))
    assert not matched(torch.arange(4.0)) and not matched(torch.zeros(3), torch.tensor([0, 1]))
    assert not matched(torch.tensor([1.0, float("nan")])) and not matched(torch.randn(3, 3).t())
    assert not matched(torch.tensor(1.05)) and not matched(torch.tensor([1.0, 0.0]))


def _ablation_harness(monkeypatch):
    """A Harness with only the parts _ablate uses, on CPU tensors standing for device ones (host_reads counts
    CPU memory as device memory, so a copy into a CPU tensor is a host read)."""
    from dice_ray.verify.trials import bound, host_reads
    from dice_ray.verify.trials.harness import Harness

    h = object.__new__(Harness)
    h.settings, h.device, h._host_reads, h._read_outputs = dict(TOL, half_rtol=5e-2, half_atol=5e-2), None, [], None
    h.poisoned = 0  # fills of the free memory (a no-op on CPU)
    monkeypatch.setattr(h, "_poison_free_memory", lambda: setattr(h, "poisoned", h.poisoned + 1))
    monkeypatch.setattr(bound, "synchronize", lambda device: None)
    monkeypatch.setattr(host_reads, "HOST_DEVICE_TYPES", ("meta",))
    return h


def test_kernel_ablation_without_a_gpu(monkeypatch):
    """Harness._ablate (rule kernel-not-used) on CPU tensors: outputs right while the kernels are switched
    off are a cheat, wrong outputs and a raising forward change nothing, references a usual fill matches
    are not ablated (noted), a one-element loss of another value is, and the switch is on only during the ablated call.  (On a GPU, with real kernels:
    tests/test_verify_gpu.py::test_outputs_right_without_the_kernels_are_a_cheat.)"""
    from dice_ray import launch
    from dice_ray.verify.trials.outcome import RuleBroken

    h = _ablation_harness(monkeypatch)
    seen = []

    def model(by_copy):
        def forward(x):
            seen.append(launch._suppressed)
            if by_copy is None:
                raise RuntimeError("needs its kernels")
            return x.t().contiguous() if by_copy else torch.full_like(x.t(), float("nan"))
        return forward

    x = torch.randn(6, 4)
    notes: list[str] = []
    h._ablate(model(False), [x], x.t().contiguous(), "trial 1", notes)  # honest: its kernels did not write
    assert h.poisoned == 1  # CPU outputs take the batched comparison, whose copies of the reference are freed
    h._ablate(model(None), [x], x.t().contiguous(), "trial 1", notes)
    with pytest.raises(RuleBroken, match="trial 1: with every launch") as e:
        h._ablate(model(True), [x], x.t().contiguous(), "trial 1", notes)
    assert e.value.rule == "kernel-not-used" and seen == [True, True, True] and not launch._suppressed
    assert notes == []
    assert h._worth_ablating(x.t().contiguous(), notes) and h._worth_ablating(torch.tensor(1.7), notes)
    assert not h._worth_ablating(torch.zeros(4, 6), notes)  # a zero reference: not ablated
    assert notes == ["kernel ablation skipped (a filled buffer would match the reference outputs)"]

    def host_loss(p, t):  # a scalar summed on the host next to a kernel that does nothing
        seen.append(launch._suppressed)
        return torch.full((), sum((a - b) ** 2 for a, b in zip(p.reshape(-1).tolist(), t.reshape(-1).tolist())) / p.numel())

    p, t = torch.randn(64, 8), torch.randn(64, 8)
    with pytest.raises(RuleBroken, match="or the host computed them") as e:
        h._ablate(host_loss, [p, t], torch.mean((p - t) ** 2), "trial 1", notes)
    assert e.value.rule == "kernel-not-used" and seen[-1] is True


def _recorded_call(h, forward, *args):
    """The previous trial's call: forward under OpRecorder, its host reads and outputs kept as the harness does."""
    from dice_ray.verify.trials.ablation import small_copy as _small_copy
    from dice_ray.verify.trials.op_recorder import OpRecorder

    recorder = OpRecorder()
    with recorder:
        out = forward(*args)
    h._host_reads, h._read_outputs = recorder.host_reads, (_small_copy(out) if recorder.host_reads else None)
    return recorder


def test_kernel_ablation_answers_host_reads_as_the_real_call_did(monkeypatch):
    """A forward that reads a flag its kernel sets (``item()``) and raises when the flag is clear would tell
    the ablated call from a real one and dodge rule kernel-not-used: the ablated call's host reads are
    answered with those OpRecorder kept from the previous recorded call (HostReadReplay), so it sees the flag
    set and its copy-op answer is caught.  (On a GPU, with a real kernel, tolist() and str() too:
    tests/corpus/cheats/ablation_probe_*.py.)"""
    from dice_ray import launch
    from dice_ray.verify.trials.outcome import RuleBroken

    h = _ablation_harness(monkeypatch)

    def probing(x):
        flag = torch.zeros(1, dtype=torch.int32)
        if not launch._suppressed:
            flag.fill_(1)  # what its kernel does
        if flag.item() == 0:
            raise RuntimeError("its kernels were skipped")
        return x.t().contiguous()

    def honest(x):  # reads a count its kernel makes, then fills the output with its kernel
        count = torch.zeros(1, dtype=torch.int64)
        if not launch._suppressed:
            count.fill_(x.numel())
        out = torch.full((int(count.item()),), float("nan"))
        if not launch._suppressed:
            out.copy_(x.reshape(-1) * 2)
        return out

    x = torch.randn(6, 4)
    h._ablate(probing, [x], x.t().contiguous(), "trial 1", [])  # nothing recorded: it raises, no verdict
    recorder = _recorded_call(h, honest, torch.randn(6, 4))  # the previous trial's call, on other inputs
    assert recorder.host_reads[0][:2] == ("scalar", torch.int64)  # (then its kernel stand-in's copy_, a CPU copy)
    h._ablate(honest, [x], x.reshape(-1) * 2, "trial 1", [])  # its outputs still need its kernels
    recorder = _recorded_call(h, probing, torch.randn(6, 4))
    assert recorder.host_reads == [("scalar", torch.int32, 1)]
    with pytest.raises(RuleBroken, match="trial 1: with every launch") as e:
        h._ablate(probing, [x], x.t().contiguous(), "trial 1", [])
    assert e.value.rule == "kernel-not-used"


def test_kernel_ablation_reads_inputs_live_and_lets_an_honest_host_finish_echo(monkeypatch):
    """A one-element loss: computed on the host from a copy of the inputs (a kernel launched beside it doing
    nothing) it is a cheat, even though the input read is in the record (reads of the call's inputs are live);
    an honest forward whose kernel writes partial sums that the host adds up gets the previous call's partials
    replayed and rebuilds exactly its previous output: inconclusive, noted, not a cheat, although the two
    trials' losses agree within the tolerance."""
    from dice_ray import launch
    from dice_ray.verify.trials.outcome import RuleBroken

    h = _ablation_harness(monkeypatch)

    def host_loss(p, t):
        a, b = torch.empty(p.shape), torch.empty(t.shape)
        a.copy_(p), b.copy_(t)  # to the host (a device-to-host copy on a GPU)
        return torch.full((), sum((u - v) ** 2 for u, v in zip(a.reshape(-1).tolist(), b.reshape(-1).tolist()))
                          / p.numel())

    def host_finish(p, t):
        partial = torch.full((8,), float("nan"))
        if not launch._suppressed:  # what its kernel does: per-row-block partial sums
            partial.copy_(((p - t) ** 2).reshape(8, -1).sum(1))
        seen = torch.empty(8)
        seen.copy_(partial)
        return torch.full((), sum(seen.tolist()) / p.numel())

    p0, t0 = torch.randn(64, 8), torch.randn(64, 8)
    p1, t1 = p0 * 1.001, t0 * 1.001  # the next trial: a loss 0.2 % away, within the 1 % tolerance
    expected = torch.mean((p1 - t1) ** 2)
    for forward in (host_loss, host_finish):
        _recorded_call(h, forward, p0, t0)
        notes: list[str] = []
        if forward is host_loss:
            with pytest.raises(RuleBroken, match="or the host computed them") as e:
                h._ablate(forward, [p1, t1], expected, "trial 1", notes)
            assert e.value.rule == "kernel-not-used"
        else:
            h._ablate(forward, [p1, t1], expected, "trial 1", notes)
            assert notes == ["kernel ablation inconclusive (forward rebuilt its previous call's outputs from the "
                             "host reads replayed to it)"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_fused_mismatch_kernels_count_what_the_torch_rule_counts():
    """The fused kernels (dice_ray.verify.trials.mismatch_kernel) give the torch rule's count, element for
    element, for every float dtype, non-finite values, near-zero scales, a grid-stride size and a
    non-contiguous output."""
    from dice_ray.verify.trials import mismatch_kernel
    from dice_ray.verify.trials.correctness import _value_masks, count_mismatches_batch

    cuda = [(o.cuda(), r.cuda()) for o, r in _cases() if isinstance(o, torch.Tensor) and o.is_floating_point()]
    big = torch.randn(3_000_001, device="cuda")
    cuda += [(big + 0.02 * torch.randn_like(big), big), (big.double() * 1.001, big.double()),
             (torch.randn(64, 64, device="cuda").t(), torch.randn(64, 64, device="cuda").t().contiguous())]
    assert all(mismatch_kernel.supported(o, r) for o, r in cuda if r.numel())
    got = count_mismatches_batch(cuda, **TOL).tolist()
    for (o, r), n in zip(cuda, got):
        if not r.numel():
            assert n == 0
            continue
        rtol, atol = (5e-2, 5e-2) if r.dtype in (torch.float16, torch.bfloat16) else (1e-2, 1e-2)
        misplaced, bad, *_ = _value_masks(o, r, rtol, atol)
        assert n == int((misplaced | bad).sum()), (o.dtype, n)
    assert 0 < got[-3] < big.numel() and got[-2] == 0
