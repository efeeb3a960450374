"""Host reads of a candidate's forward: what OpRecorder keeps and HostReadReplay answers (dice_ray.verify.trials.host_reads).

CPU tensors stand for device ones here (``HOST_DEVICE_TYPES`` narrowed to meta); which aten ops a CUDA read
is (``tolist``, ``.cpu()``: ``_to_copy``) was measured on an H200 and is what the corpus's
``ablation_probe_*.py`` candidates exercise on a GPU.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from dice_ray.verify.trials import host_reads
from dice_ray.verify.trials.host_reads import HostReadReplay
from dice_ray.verify.trials.op_recorder import OpRecorder


@pytest.fixture
def cpu_as_device(monkeypatch):
    monkeypatch.setattr(host_reads, "HOST_DEVICE_TYPES", ("meta",))


def test_replay_answers_in_order_and_only_like_for_like(cpu_as_device):
    """The n-th scalar read of the recorded dtype gets the n-th recorded value (item, bool, int and float all
    read through aten _local_scalar_dense); another dtype, or a read past the record, reads the tensor;
    OpRecorder keeps scalar reads in order, and forbidden ops as before."""
    one = torch.tensor([1], dtype=torch.int32)
    recorder = OpRecorder()
    with recorder:
        one.item(), bool(one), float(torch.tensor([2.5])), one + one
    assert recorder.host_reads == [("scalar", torch.int32, 1), ("scalar", torch.int32, 1),
                                   ("scalar", torch.float32, 2.5)]
    assert recorder.forbidden == ["add"]
    zero = torch.tensor([0], dtype=torch.int32)
    with HostReadReplay(recorder.host_reads) as replay:
        got = [zero.item(), bool(zero), int(torch.tensor([7])), zero.item()]
    assert got == [1, True, 7, 0] and replay.replayed == 2  # int64 is not float32's: read; then past the record
    pinned = OpRecorder()  # rule host-memory at run time: an allocation with pin_memory=True (needs CUDA to succeed)
    with pinned, contextlib.suppress(RuntimeError):
        torch.zeros(1, pin_memory=True)
    assert pinned.pinned == ["zeros"] and pinned.forbidden == []


def test_copies_to_the_host_and_tensor_text_are_replayed_but_the_inputs_are_read_live(cpu_as_device):
    """A copy into a host tensor, and the text of a tensor (repr/str/f-string: torch formats it with dispatch
    modes off), come back as recorded; a read from the storage of one of ``live`` (the call's inputs) reads
    the tensor and still uses up its place in the record."""
    flag, x = torch.tensor([1], dtype=torch.int32), torch.arange(4.0)
    recorder = OpRecorder()
    with recorder:
        seen = torch.empty(1, dtype=torch.int32)
        seen.copy_(flag)
        text = f"{flag}"
        head = torch.empty(2)
        head.copy_(x[:2])
    assert [r[0] for r in recorder.host_reads] == ["copy", "text", "copy"] and "1" in text
    flag.zero_()
    x2 = x + 10
    with HostReadReplay(recorder.host_reads, live=[x2]) as replay:
        seen = torch.empty(1, dtype=torch.int32)
        seen.copy_(flag)
        text = str(flag)
        head = torch.empty(2)
        head.copy_(x2[:2])
    assert seen.tolist() == [1] and "1" in text and "0" not in text.replace("int32", "")
    assert head.tolist() == [10.0, 11.0] and replay.replayed == 2
    assert str(flag) == repr(flag) and "0" in str(flag)  # outside the replay: the tensor's own text


def test_a_host_tensors_text_neither_is_recorded_nor_takes_a_recorded_place(monkeypatch):
    """Texts are kept for device tensors only, and in the replay a host tensor's text is its own: printing one
    before the flag cannot shift the flag's recorded text onto it (and leave the flag read live).  Meta tensors
    stand for device ones here, CPU tensors are the host's."""
    monkeypatch.setattr(host_reads, "HOST_DEVICE_TYPES", ("cpu",))
    flag, host = torch.empty(1, device="meta"), torch.tensor([7])
    recorder = OpRecorder()
    with recorder:
        str(host), str(flag)
    assert [r[0] for r in recorder.host_reads] == ["text"] and "meta" in recorder.host_reads[0][1]
    with HostReadReplay(recorder.host_reads) as replay:
        texts = [str(host), str(flag)]
    assert "7" in texts[0] and "meta" not in texts[0] and texts[1] == recorder.host_reads[0][1]
    assert replay.replayed == 1


def test_large_copies_and_host_tensors_own_reads_are_not_kept(cpu_as_device, monkeypatch):
    """Copies over MAX_COPY_BYTES are not kept (nor replayed); nor are reads of memory the host owns."""
    monkeypatch.setattr(host_reads, "MAX_COPY_BYTES", 16)
    recorder = OpRecorder()
    with recorder:
        torch.empty(8).copy_(torch.ones(8))  # 32 bytes
        torch.empty(2).copy_(torch.ones(2))  # 8 bytes
    assert [r[0] for r in recorder.host_reads] == ["copy"] and recorder.host_reads[0][1].shape == (2,)
    monkeypatch.setattr(host_reads, "HOST_DEVICE_TYPES", ("cpu", "meta"))
    recorder = OpRecorder()
    with recorder:
        torch.tensor([3]).item(), str(torch.tensor([3]))
    assert recorder.host_reads == []


def test_one_elements_copy_to_the_host_is_a_read_like_item(cpu_as_device):
    """x.cpu().item() (Python, or .cpu().item<float>() in host C++) is aten _to_copy to the CPU: of one element it
    is the read item() makes, recorded and replayed; of more it stays a torch op forward may not run."""
    def to_host(t):
        return torch.ops.aten._to_copy(t, device=torch.device("cpu"))

    flag = torch.tensor([1], dtype=torch.int32)
    recorder = OpRecorder()
    with recorder:
        assert to_host(flag).tolist() == [1]
    assert [r[0] for r in recorder.host_reads][:1] == ["to_host"] and recorder.forbidden == []
    three = torch.arange(3.0)
    with OpRecorder() as wide:
        to_host(three)
    assert wide.forbidden == ["_to_copy"]
    flag.zero_()
    with HostReadReplay(recorder.host_reads) as replay:
        seen = to_host(flag)
    assert seen.tolist() == [1] and replay.replayed >= 1
    with HostReadReplay(recorder.host_reads, live=[flag]):
        assert to_host(flag).tolist() == [0]  # the call's own input: read live


def test_host_values_uploaded_to_the_device_are_no_torch_op():
    """torch.tensor(sizes, device=...) (torch::tensor in host C++) is a _to_copy from the host: an upload, as an
    allocation and a copy_ are; a device-to-device _to_copy (a cast) stays a torch op."""
    from dice_ray.verify.trials.op_recorder import _upload

    host = torch.arange(3)
    assert _upload("_to_copy", (host,), {"device": torch.device("cuda", 0)})
    assert _upload("_to_copy", (host,), {"device": "cuda", "dtype": torch.int64})
    assert not _upload("_to_copy", (host,), {"dtype": torch.float16})  # a cast on the host's tensor, no device
    assert not _upload("_to_copy", (torch.empty(3, device="meta"),), {"device": "cuda"})
    assert not _upload("add", (host,), {"device": "cuda"})
