"""The driver's Ray: a cluster named on purpose (``--address`` / ``cluster.address``, else ``RAY_ADDRESS``) is joined;
without one a private local cluster is started, never whatever ``ray start`` left running on the machine.

A plain ``ray.init()`` joins the cluster recorded in Ray's temp dir (``/tmp/ray/ray_current_cluster``, written by the
latest ``ray start``): on a shared machine that is another user's or session's cluster (its resources, its
dashboard, its shutdown). :func:`start_ray` passes ``address="local"`` instead, which always starts a new cluster
that ends with the run. ``--address auto`` still joins the machine's ``ray start`` cluster, on purpose.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator

import ray

from dice_ray.cluster.auth import connect
from dice_ray.cluster.scheduler import NAMESPACE

#: ``ray.init``'s address that starts a new local cluster whatever runs on the machine or ``RAY_ADDRESS`` says
PRIVATE_CLUSTER = "local"

#: the logger of Ray's (>= 2.60) notices about token authentication on a local cluster it starts
_RAY_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"


def _drop_token_auth_on_notice(record: logging.LogRecord) -> bool:
    """A logging filter: drops Ray's WARNING that the local cluster it starts has token authentication on (the safe
    default; the first line of every run, which new users read as a problem: README, Troubleshooting, says what it
    means for ``ray job submit``); its warning that authentication is *off* still shows."""
    return not record.getMessage().startswith("Token authentication is enabled for this Ray cluster")


def start_ray(address: str | None) -> dict:
    """Connect to ``address`` (or ``RAY_ADDRESS``), else start a private local cluster with the dashboard
    (``ray.init(address="local")``: a cluster that ``ray start`` runs on this machine is not joined; pass
    ``auto`` as the address for that).

    Returns:
        ``{"address": ..., "dashboard": url or None, "started": bool}`` (``started``: a new local cluster).
    """
    address = address or os.environ.get("RAY_ADDRESS")
    if not sys.stdout.isatty():  # a log file: actors' lines without colour codes around their "(Actor pid=...)" prefix
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    if ray.is_initialized():
        ctx = ray.get_runtime_context()
        return {"address": ctx.gcs_address, "dashboard": None, "started": False}
    # Ray's own INFO lines ("Started a local Ray instance. View the dashboard at ..." with colour codes in a
    # log file) are left out: the trainer prints the address and the dashboard itself
    with _sigterm_kept():
        ctx, started = _init(address)
    url = ctx.dashboard_url
    return {"address": ctx.address_info.get("gcs_address"), "dashboard": f"http://{url}" if url else None, "started": started}


def _init(address: str | None):
    """``ray.init`` for :func:`start_ray`: (Ray's context, whether a new local cluster was started)."""
    if address:
        ctx = connect(address, namespace=NAMESPACE, log_to_driver=True, logging_level="WARNING")  # Ray >= 2.60's token
        started = False
    else:
        logging.getLogger(_RAY_AUTH_LOGGER).addFilter(_drop_token_auth_on_notice)
        ctx = ray.init(address=PRIVATE_CLUSTER, namespace=NAMESPACE, include_dashboard=True,
                       dashboard_host="127.0.0.1", log_to_driver=True, logging_level="WARNING")
        started = True
    return ctx, started


@contextlib.contextmanager
def _sigterm_kept() -> Iterator[None]:
    """Keep the process's SIGTERM handler over ``ray.init``: a driver's init sets Ray's own (``sys.exit(15)`` in
    Python, and a C-level one that prints "SIGTERM received" with a stack and aborts, exit 134), so the trainer's
    handler (stop as on Ctrl-C, ``--resume`` printed, ``stopped.json``) never ran on a real run (a fresh user's
    trial). Only a Python handler is kept (a default one leaves Ray's, which shuts Ray down on the way out); main
    thread only (signals are set there)."""
    main = threading.current_thread() is threading.main_thread()
    before = signal.getsignal(signal.SIGTERM) if main else None
    try:
        yield
    finally:
        if callable(before):
            signal.signal(signal.SIGTERM, before)
