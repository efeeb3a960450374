"""The launches of a load_inline candidate's kernels: the counters compiled into its extensions, and their switch.

Run-time rule ``no-kernel-launch``: :func:`launch_count` sums the host launch counters compiled into the current
candidate's extensions (no CUDA call, so the harness may read it inside a timed window), or a module's device
counter when its launches could not all be wrapped; :func:`kernel_runs` reads the device counters (kernels that
really started; synchronising).  :func:`kernels_suppressed` makes every kernel of those extensions return at
entry (still counted): the verifier's ablation of the candidate's kernels (rule ``kernel-not-used``).  See
:mod:`dice_ray.verify.candidate.inline_counters` for how the counters and that switch are compiled in; the
loader (:mod:`dice_ray.verify.trials.inline_loader`) registers each extension the candidate loads
(:func:`register`).  The fast format's counter is :func:`dice_ray.launch.launch_count`; both together:
:mod:`dice_ray.verify.trials.launches`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

__all__ = ["kernel_runs", "kernels_suppressed", "launch_count", "register", "reset"]

_current: list[tuple[Any, str]] = []  # (extension module, counting) of the candidate being verified


def register(mod: Any, counting: str) -> None:
    """Count the launches of extension ``mod`` (``counting``: ``"host"`` or ``"device"``, the build's
    :attr:`~dice_ray.verify.candidate.inline_counters.Instrumented.counting`) for the current candidate (once)."""
    if (mod, counting) not in _current:
        _current.append((mod, counting))


def reset() -> None:
    """Forget the extensions of the previous candidate (the harness calls it before a fast-format
    one; :func:`~dice_ray.verify.trials.execution.exec_inline` does it itself), so they no longer count in
    :func:`launch_count`."""
    _current.clear()


def launch_count() -> int:
    """Launches of the current candidate's kernels through its load_inline extensions: the host
    counters (no CUDA call), or the device counter for a module counted on the device."""
    total = 0
    for mod, counting in _current:
        total += int(mod._dice_ray_kernel_runs() if counting == "device" else mod._dice_ray_launches())
    return total


def kernel_runs() -> int:
    """Kernels of the current candidate that really started on the GPU (device counters, read with
    ``cudaMemcpyFromSymbol``: synchronises with the device; never inside a timed window)."""
    return sum(int(mod._dice_ray_kernel_runs()) for mod, _ in _current)


@contextlib.contextmanager
def kernels_suppressed() -> Iterator[None]:
    """Inside the block, every ``__global__`` kernel of the current candidate's extensions returns
    at entry: launches happen and are counted (host and device counters, so ``no-kernel-launch``
    does not fire), no kernel work is done.  Torch ops, ``cudaMemcpy`` and vendor-library kernels
    in the candidate's host code still run.

    The verifier's ablation of the candidate's kernels (dice-ray's own rule ``kernel-not-used``,
    :mod:`dice_ray.verify.trials.ablation`).  Sets the ``__constant__`` flag compiled into each extension
    (:data:`~dice_ray.verify.candidate.inline_counters.COUNTER_PREFIX`) through its ``_dice_ray_skip_kernels``
    binding, which candidates cannot reach (the facade the candidate gets holds only its
    ``functions``; C++ names containing ``dice_ray`` are ``patching``).  Setting and clearing the flag
    each synchronise the device (work queued before runs its kernels, work after sees the flag) and
    reset the CUDA runtime's last error (a launch refused inside the block, e.g. a grid computed
    from a kernel's unwritten output, would otherwise stop the host counter from counting the
    launches after it).  The flag is cleared on exit, also when the block raises.

    Raises:
        RuntimeError: an extension could not set its flag (a ``cudaError_t`` code; the block does
            not run), or could not clear it on exit.
    """
    mods = [mod for mod, _ in _current]
    done: list[Any] = []
    try:
        for mod in mods:
            err = int(mod._dice_ray_skip_kernels(1))
            done.append(mod)  # cleared on exit even when setting failed half way
            if err:
                raise RuntimeError(f"load_inline extension {mod.__name__}: setting the kernel switch failed "
                                   f"(cudaError_t {err})")
        yield
    finally:
        failed = [mod.__name__ for mod in done if int(mod._dice_ray_skip_kernels(0))]
        if failed:
            raise RuntimeError(f"load_inline extensions {failed}: clearing the kernel switch failed")
