"""torch's synchronize and equal and the host clock, bound at import, before any candidate runs.

A candidate runs in the worker's process: it could patch ``torch.cuda.synchronize`` or ``time.perf_counter``
(the static rules refuse it; this is the run time's own guard).  The trials call these bindings, made when the
worker imported this module, never the attributes a candidate could have replaced (patching them later cannot
fool the trials).  Tests and benchmarks replace them here (``bound.synchronize``) to count or skip syncs.
"""

from __future__ import annotations

import time

import torch

__all__ = ["equal", "perf", "synchronize"]

#: ``torch.cuda.synchronize(device)``
synchronize = torch.cuda.synchronize
#: ``torch.equal(a, b)``
equal = torch.equal
#: ``time.perf_counter()`` (host seconds)
perf = time.perf_counter
