"""The GPU spin before a timed window: a kernel that fills every SM, so no other stream's work overlaps it.

A timed window (:mod:`dice_ray.verify.trials.timing`) starts with a spin, so the host can queue the window's
calls while the GPU waits, and the host's launch overhead is not timed.  ``torch.cuda._sleep`` spins
one thread and leaves the SMs free: a kernel a candidate put on a stream of its own, without waiting
for the launching stream, could run beside it, before the window's start event, untimed (corpus
cheat ``side_stream_nowait.py``).

:class:`FillSpin` launches ``SMs x blocks-an-SM`` blocks of 256 threads (the driver's occupancy for
this kernel: every thread slot of every SM, ``__launch_bounds__`` keeps the registers low enough).  No
block of another kernel can become resident before the spin's blocks exit.  A launch returns once the
work queued before the spin (the window's input fills) has finished, so the spin is next on the GPU:
kernels the host queues afterwards, on any stream, find the SMs taken by the time they arrive (the
host's next launch takes microseconds; the spin's blocks are resident sooner), and the candidate's
side-stream work runs after the window's start event, inside the window.  (Without that wait a
side-stream kernel queued while earlier work drained could start beside it, before the spin.)  Its
launches are not counted by :func:`dice_ray.launch.launch_count` (the verifier's rule that every
timed call launches a kernel of the candidate's own).

The blocks first zero a flush buffer (the L2 flush: twice the L2 written), then wait:

* :meth:`FillSpin.hold` / :meth:`FillSpin.release`: until the host releases the spin, which it does
  once it has queued the window's calls (block 0 polls a word of pinned host memory, the other blocks
  a word of device memory that block 0 sets), or :data:`HOLD_TIMEOUT_CYCLES`.  So the GPU starts the
  calls when the host has queued them all: no host time is timed and none is spun away.  This is
  NVBench's blocking kernel (``nvbench/blocking_kernel.cuh``), here filling the SMs as well.  A spin
  of a fixed length sized from the host's estimated queuing time (1.5x, grown 1.25x whenever the
  host fell behind) left 15 % of the windows host-bound and spun beyond the queuing (one H200,
  2026-12-01).
* ``FillSpin(device)(cycles)``: for ``cycles`` of the SM clock.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from dice_ray import launch
from dice_ray.verify.candidate import nvrtc

__all__ = ["BLOCK", "HOLD_TIMEOUT_CYCLES", "FillSpin", "for_device"]

# Bound at import, before any candidate runs (patching torch later cannot change the spin).
_Event = torch.cuda.Event
_record = torch.cuda.Event.record
_query = torch.cuda.Event.query

#: threads a block of the spin
BLOCK = 256

#: cycles a held spin waits at most for its release (~20 ms at 2 GHz): a host that never releases it (a
#: forward that synchronizes, so waits on the spin itself) costs that a window, not a hang
HOLD_TIMEOUT_CYCLES = 40_000_000

_SOURCE = r"""
extern "C" __global__ void __launch_bounds__(256, 8) fill_spin(
        long long cycles, uint4* flush, unsigned long long words, const volatile unsigned long long* released,
        volatile unsigned long long* go, unsigned long long token, long long timeout) {
    long long start = clock64();
    uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < words; i += stride) {
        flush[i] = zero;  // the L2 flush, inside the spin: no kernel of its own to wait for
    }
    if (token != 0ull) {  // held: until the host has released `token` (or `timeout` cycles)
        if (threadIdx.x == 0) {
            if (blockIdx.x == 0) {
                while (*released < token && clock64() - start < timeout) {
#if __CUDA_ARCH__ >= 700
                    __nanosleep(256);
#endif
                }
                *go = token;  // one reader of host memory; the other blocks read this word in device memory
            } else {
                while (*go < token && clock64() - start < timeout) {
#if __CUDA_ARCH__ >= 700
                    __nanosleep(256);
#endif
                }
            }
        }
        __syncthreads();
    }
    while (clock64() - start < cycles) {
#if __CUDA_ARCH__ >= 700
        __nanosleep(128);
#endif
    }
}
"""


class FillSpin:
    """Spin every SM of one GPU: held until the host releases it (:meth:`hold`, :meth:`release`), or for a
    number of its clock cycles (``FillSpin(device)(cycles)``); either zeroes a flush buffer first.

    Args:
        device: CUDA ordinal; the kernel is compiled (NVRTC, :func:`dice_ray.verify.candidate.nvrtc.compile_cuda`) and
            loaded into torch's primary context of it.

    Attributes:
        grid: blocks a launch (SMs x resident blocks an SM).
        blocks_per_sm: resident blocks of :data:`BLOCK` threads an SM (8 on an H100/H200).

    Raises:
        launch.CompileError: NVRTC failed.
        RuntimeError: the driver could not load the kernel or map the release word, or the kernel cannot
            fill an SM's thread slots (then other streams' blocks could run beside it).
    """

    def __init__(self, device: int):
        from cuda.bindings import driver

        self.device = device
        with torch.cuda.device(device):
            program = nvrtc.compile_cuda(_SOURCE, launch.target_arch())
        # launch's loader (torch's context, a module cache), not a KernelModule (whose calls count as launches)
        self._fn = launch.KernelModule._load(program, device)["fill_spin"]
        self.blocks_per_sm = int(launch._check(
            driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(self._fn, BLOCK, 0), "occupancy of fill_spin"))
        props = torch.cuda.get_device_properties(device)
        slots = int(getattr(props, "max_threads_per_multi_processor", 0) or 0)
        if slots and self.blocks_per_sm * BLOCK < slots:
            raise RuntimeError(f"fill_spin: {self.blocks_per_sm} blocks of {BLOCK} threads an SM leave "
                               f"{slots - self.blocks_per_sm * BLOCK} of {slots} thread slots free on cuda:{device}")
        self.grid = props.multi_processor_count * self.blocks_per_sm
        # the release word: pinned host memory mapped for the GPU, written by the host with a plain store
        flags = driver.CU_MEMHOSTALLOC_PORTABLE | driver.CU_MEMHOSTALLOC_DEVICEMAP
        host_word = int(launch._check(driver.cuMemHostAlloc(8, flags), "cuMemHostAlloc of the release word"))
        self._released = ctypes.c_uint64.from_address(host_word)
        self._released.value = 0
        released_dev = int(launch._check(driver.cuMemHostGetDevicePointer(host_word, 0),
                                         "cuMemHostGetDevicePointer of the release word"))
        self._go = torch.zeros(1, dtype=torch.int64, device=torch.device("cuda", device))
        self._token = 0
        self._args = (ctypes.c_longlong(0), ctypes.c_uint64(0), ctypes.c_uint64(0), ctypes.c_uint64(released_dev),
                      ctypes.c_uint64(self._go.data_ptr()), ctypes.c_uint64(0), ctypes.c_longlong(HOLD_TIMEOUT_CYCLES))
        self._ptrs = (ctypes.c_void_p * len(self._args))(*(ctypes.addressof(a) for a in self._args))
        self._stream = torch.cuda.current_stream
        self._launch = driver.cuLaunchKernel
        self._stream_type = driver.CUstream
        self._ok = driver.CUresult.CUDA_SUCCESS
        self._reached = _Event()

    def __call__(self, cycles: int, stream: torch.cuda.Stream | None = None, flush: torch.Tensor | None = None) -> None:
        """Queue a spin of ``cycles`` SM clock cycles on ``stream`` (zeroing ``flush`` first); return once
        the work queued before it finished.

        Args:
            cycles: SM clock cycles each block waits, counted from its start, flush included (~0.5 ns
                each at 2 GHz); <= 0 still launches (and flushes).
            stream, flush: as for :meth:`hold`.

        Raises:
            ValueError, RuntimeError: as for :meth:`hold`.
        """
        self._start(int(cycles), stream, flush, 0)

    def hold(self, stream: torch.cuda.Stream | None = None, flush: torch.Tensor | None = None) -> int:
        """Queue a spin on ``stream`` (zeroing ``flush`` first) that lasts until :meth:`release` of the
        returned token, or :data:`HOLD_TIMEOUT_CYCLES`; return once the work queued before it finished.

        Args:
            stream: a stream of this device; None: its current stream (a lookup costs ~8 us, so a
                caller spinning before many windows passes the stream it looked up once).
            flush: a contiguous buffer on this device (any dtype; twice the L2 size for an L2 flush) that
                the spin's blocks zero in 16-byte stores before they wait (a tail under 16 bytes is left);
                None: no flush.

        Returns:
            The token to release (tokens grow by one a hold; releasing one releases every earlier one).
        Raises:
            ValueError: ``flush`` is not a contiguous tensor on this device, or not 16-byte aligned.
            RuntimeError: the driver refused the launch (a broken context).
        """
        self._token += 1
        self._start(0, stream, flush, self._token)
        return self._token

    def release(self, token: int) -> None:
        """Let the spin of ``token`` (and any earlier one) end: a store to the pinned word it polls (the
        GPU sees it within microseconds)."""
        self._released.value = token

    def _start(self, cycles: int, stream: torch.cuda.Stream | None, flush: torch.Tensor | None, token: int) -> None:
        if flush is None:
            ptr, words = 0, 0
        else:
            if flush.device != torch.device("cuda", self.device) or not flush.is_contiguous() or flush.data_ptr() % 16:
                raise ValueError(f"flush buffer on {flush.device} (contiguous {flush.is_contiguous()}, address "
                                 f"{flush.data_ptr():#x}): need a contiguous, 16-byte aligned buffer on cuda:{self.device}")
            ptr, words = flush.data_ptr(), flush.numel() * flush.element_size() // 16
        a = self._args
        a[0].value, a[1].value, a[2].value, a[5].value = cycles, ptr, words, token
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

