"""Ray's token authentication (Ray >= 2.60) when connecting to a head by its address.

Ray turns token authentication on for a head started once a token exists (``~/.ray/auth_token``,
which any local ``ray.init()`` writes), and its ``ray.init`` sends the token by itself only for
``address="auto"`` (a head found on this machine): given an explicit ``HOST:PORT`` it sends none
unless ``RAY_AUTH_MODE=token`` is set, and then retries for ~20 s before "Failed to connect".
dice-ray connects by address (``dice-ray status``, ``verifiers``, ``train --address``), so for a head
on this machine it does what Ray does for ``"auto"``; a remote head's token stays the user's to give
(Ray docs, "Token authentication": https://docs.ray.io/en/latest/ray-security/token-auth.html).
"""

from __future__ import annotations

import ipaddress
import os
import socket
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

__all__ = ["AUTH_HINT", "NO_CLUSTER_HINT", "connect", "connection_hint", "is_this_machine", "token_auth_for"]

#: appended to a failed connection's message
AUTH_HINT = ("if the cluster uses token authentication (Ray >= 2.60's default), export RAY_AUTH_MODE=token "
             "with its token in ~/.ray/auth_token, RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN")


#: appended when no cluster answered at all
NO_CLUSTER_HINT = ("no Ray cluster is running there: the local cluster `dice-ray train` starts ends with its run "
                   "(give --address of a running cluster, or run this while the job runs)")


def _host(address: str) -> str:
    """The host of ``HOST:PORT``, ``[V6]:PORT`` or ``scheme://HOST:PORT`` (lower case, no brackets)."""
    return urlsplit(address if "://" in address else f"//{address}").hostname or ""


def is_this_machine(address: str) -> bool:
    """Whether ``address``'s host is a loopback name or address, this machine's host name, or an address
    of one of its network interfaces (``psutil.net_if_addrs``)."""
    import psutil

    host = _host(address)
    if host in ("", "localhost", socket.gethostname().lower(), socket.getfqdn().lower()):
        return True
    try:
        if ipaddress.ip_address(host).is_loopback:
            return True
    except ValueError:
        return False  # another host name: not resolved (a slow DNS lookup for a status command)
    return any(a.address.split("%", 1)[0].lower() == host for addrs in psutil.net_if_addrs().values() for a in addrs)


def _token_at_hand() -> bool:
    if os.environ.get("RAY_AUTH_TOKEN"):
        return True
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or str(Path.home() / ".ray" / "auth_token")
    return Path(path).is_file()


def token_auth_for(address: str | None) -> bool:
    """Before ``ray.init(address=address)``: set ``RAY_AUTH_MODE=token`` when it is unset, a token is at
    hand (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``) and ``address`` is a head
    on this machine (:func:`is_this_machine`), as Ray does for ``"auto"``.

    Args:
        address: ``HOST:PORT`` of a GCS, a ``ray://`` / ``http://`` URL, ``"auto"`` or None (Ray's own
            rule applies to those two: nothing is changed).

    Returns:
        Whether it set ``RAY_AUTH_MODE`` (an explicit ``RAY_AUTH_MODE``, ``disabled`` included, is kept).
    """
    if not address or address == "auto" or "RAY_AUTH_MODE" in os.environ:
        return False
    if not (_token_at_hand() and is_this_machine(address)):
        return False
    os.environ["RAY_AUTH_MODE"] = "token"
    try:  # Ray caches its config when imported: refresh it, as its own connection to "auto" does
        from ray._raylet import Config

        Config.initialize("")
    except (ImportError, AttributeError):  # another Ray: the variable still reaches a later import and child processes
        pass
    return True


def connect(address: str, **init_kwargs: Any) -> Any:
    """``ray.init(address=address, **init_kwargs)`` after :func:`token_auth_for`; returns Ray's context.

    Raises:
        ConnectionError: Ray could not connect; the message ends with :func:`connection_hint`'s.
    """
    import ray

    token_auth_for(address)
    try:
        return ray.init(address=address, **init_kwargs)
    except ConnectionError as e:
        raise ConnectionError(f"{e}; {connection_hint(str(e))}") from None


def connection_hint(message: str) -> str:
    """What to try after Ray's connection error ``message``: when it found no cluster at all, that a
    local cluster started by ``dice-ray train`` ends with its run; otherwise :data:`AUTH_HINT`."""
    if "could not find any running ray instance" in message.lower():
        return NO_CLUSTER_HINT
    return AUTH_HINT
