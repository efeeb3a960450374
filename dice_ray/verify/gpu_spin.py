"""The GPU spin before a timed window: a kernel that fills every SM, so no other stream's work overlaps it.

A timed window (:mod:`dice_ray.verify.timing`) starts with a spin, so the host can queue the window's
calls while the GPU waits, and the host's launch overhead is not timed.  ``torch.cuda._sleep`` spins
one thread and leaves the SMs free: a kernel a candidate put on a stream of its own, without waiting
for the launching stream, could run beside it, before the window's start event, untimed (corpus
cheat ``side_stream_nowait.py``).

:class:`FillSpin` launches ``SMs x blocks-an-SM`` blocks of 256 threads (the driver's occupancy for
this kernel: every thread slot of every SM, ``__launch_bounds__`` keeps the registers low enough), each
waiting (in ``__nanosleep`` steps from sm_70 on) until ``cycles`` of its SM's clock have passed.  No
block of another kernel can become resident before the spin's blocks exit.  A call returns once the
work queued before the spin (such as the L2 flush) has finished, so the spin is next on the GPU:
kernels the host queues afterwards, on any stream, find the SMs taken by the time they arrive (the
host's next launch takes microseconds; the spin's blocks are resident sooner), and the candidate's
side-stream work runs after the window's start event, inside the window.  (Without that wait a
side-stream kernel queued while the flush drained could start beside it, before the spin.)  Its
launches are not counted by :func:`dice_ray.launch.launch_count` (the verifier's rule that every
timed call launches a kernel of the candidate's own).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from dice_ray import launch

__all__ = ["BLOCK", "FillSpin", "for_device"]

# Bound at import, before any candidate runs (patching torch later cannot change the spin).
_Event = torch.cuda.Event
_record = torch.cuda.Event.record
_query = torch.cuda.Event.query

#: threads a block of the spin
BLOCK = 256

_SOURCE = r"""
extern "C" __global__ void __launch_bounds__(256, 8) fill_spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) {
#if __CUDA_ARCH__ >= 700
        __nanosleep(128);
#endif
    }
}
"""


class FillSpin:
    """Spin every SM of one GPU for a number of its clock cycles: ``FillSpin(device)(cycles)``.

    Args:
        device: CUDA ordinal; the kernel is compiled (NVRTC, :func:`dice_ray.launch.compile_cuda`) and
            loaded into torch's primary context of it.

    Attributes:
        grid: blocks a launch (SMs x resident blocks an SM).
        blocks_per_sm: resident blocks of :data:`BLOCK` threads an SM (8 on an H100/H200).

    Raises:
        launch.CompileError: NVRTC failed.
        RuntimeError: the driver could not load the kernel, or it cannot fill an SM's thread slots
            (then other streams' blocks could run beside it).
    """

    def __init__(self, device: int):
        from cuda.bindings import driver

        self.device = device
        with torch.cuda.device(device):
            program = launch.compile_cuda(_SOURCE)
        # launch's loader (torch's context, a module cache), not a KernelModule: its calls count as launches
        self._fn = launch.KernelModule._load(program, device)["fill_spin"]
        self.blocks_per_sm = int(launch._check(
            driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(self._fn, BLOCK, 0), "occupancy of fill_spin"))
        props = torch.cuda.get_device_properties(device)
        slots = int(getattr(props, "max_threads_per_multi_processor", 0) or 0)
        if slots and self.blocks_per_sm * BLOCK < slots:
            raise RuntimeError(f"fill_spin: {self.blocks_per_sm} blocks of {BLOCK} threads an SM leave "
                               f"{slots - self.blocks_per_sm * BLOCK} of {slots} thread slots free on cuda:{device}")
        self.grid = props.multi_processor_count * self.blocks_per_sm
        self._arg = ctypes.c_longlong(0)
        self._ptrs = (ctypes.c_void_p * 1)(ctypes.addressof(self._arg))
        self._stream = torch.cuda.current_stream
        self._launch = driver.cuLaunchKernel
        self._stream_type = driver.CUstream
        self._ok = driver.CUresult.CUDA_SUCCESS
        self._reached = _Event()

    def __call__(self, cycles: int, stream: torch.cuda.Stream | None = None) -> None:
        """Queue the spin on ``stream``; return once the work queued before it finished.

        The host polls an event recorded on that stream just before the spin: it waits for the work
        queued before it, usually the L2 flush, tens of microseconds.

        Args:
            cycles: SM clock cycles each block waits (~0.5 ns each at 2 GHz); <= 0 still launches.
            stream: a stream of this device; None: its current stream (a lookup costs ~8 us, so a
                caller spinning before many windows passes the stream it looked up once).

        Raises:
            RuntimeError: the driver refused the launch (a broken context).
        """
        self._arg.value = int(cycles)
        current = self._stream(self.device) if stream is None else stream
        raw = self._stream_type(current.cuda_stream)
        _record(self._reached, current)
        (err,) = self._launch(self._fn, self.grid, 1, 1, BLOCK, 1, 1, 0, raw, ctypes.addressof(self._ptrs), 0)
        if err != self._ok:
            raise RuntimeError(f"launch of fill_spin (grid={self.grid}, block={BLOCK}) failed: {err}")
        while not _query(self._reached):
            pass


@functools.cache
def for_device(device: int) -> FillSpin:
    """The one :class:`FillSpin` of ``device`` in this process (made on first use; see its errors)."""
    return FillSpin(device)

