"""Ray's token authentication (Ray >= 2.60) when connecting to a head by its address.

Ray turns token authentication on for a head started once a token exists (``~/.ray/auth_token``,
which any local ``ray.init()`` writes), and its ``ray.init`` sends the token by itself only for
``address="auto"`` (a head found on this machine): given an explicit ``HOST:PORT`` it sends none
unless ``RAY_AUTH_MODE=token`` is set, and then retries for ~20 s before "Failed to connect".
dice-ray connects by address (``dice-ray status``, ``verifiers``, ``train --address``), so for a head
on this machine it does what Ray does for ``"auto"``; a remote head's token stays the user's to give
(Ray docs, "Token authentication": https://docs.ray.io/en/latest/ray-security/token-auth.html).

Before ``ray.init`` it asks the head once (:func:`probe_gcs`, a few seconds at most): given an address
where nothing answers as a Ray GCS (a cluster that is gone, a hung process, another program on the
port), ``ray.init`` retries 20 times for ~30 s each (~10 minutes) and then says only "Failed to connect".
"""

from __future__ import annotations

import ipaddress
import os
import socket
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, NamedTuple
from urllib.parse import urlsplit

__all__ = ["AUTH_HINT", "NO_CLUSTER_HINT", "PROBE_TIMEOUT_S", "START_HINT", "ClusterRefused", "ClusterUnreachable",
           "GcsProbe", "connect", "connection_hint", "gcs_host_port", "is_this_machine", "probe_gcs", "token_auth_for"]

#: appended to a failed connection's message
AUTH_HINT = ("if the cluster uses token authentication (Ray >= 2.60's default), export RAY_AUTH_MODE=token "
             "with its token in ~/.ray/auth_token, RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN")


#: what to do when no cluster answered at an address
START_HINT = ("the local cluster `dice-ray train` starts ends with its run (give --address of a running cluster, "
              "or run this while the job runs)")

#: appended when no cluster answered at all
NO_CLUSTER_HINT = f"no Ray cluster is running there: {START_HINT}"


#: seconds :func:`probe_gcs` waits for a TCP connection, and again for the GCS's reply
PROBE_TIMEOUT_S = 5.0


class GcsProbe(NamedTuple):
    """What :func:`probe_gcs` found at an address."""

    #: ``"ok"`` (a Ray GCS answered), ``"closed"`` (no TCP connection: nothing listens, or unreachable),
    #: ``"silent"`` (the port accepts connections but no Ray GCS replies) or ``"refused"`` (a GCS answered
    #: and refused the request: token authentication)
    state: str
    #: why, in a few words (``"connection refused"``, the GCS's refusal); empty for ``"ok"``
    detail: str = ""


class ClusterUnreachable(ConnectionError):
    """No Ray cluster answers at ``address``: nothing listens there (``probe.state == "closed"``) or what
    listens is no Ray GCS that replies (``"silent"``). The message is one line, naming the address and why."""

    def __init__(self, address: str, probe: GcsProbe):
        self.address, self.probe = address, probe
        super().__init__(f"no Ray cluster answers at {address} ({probe.detail}): none runs there now (not started "
                         "yet, or already ended)")

    def __reduce__(self):  # pickles with its own arguments
        return type(self), (self.address, self.probe)


class ClusterRefused(ConnectionError):
    """The Ray head at ``address`` answered but refused the connection (token authentication); the
    message is one line ending with :data:`AUTH_HINT`."""

    def __init__(self, address: str, probe: GcsProbe):
        self.address, self.probe = address, probe
        super().__init__(f"the Ray cluster at {address} answered but refused the connection ({probe.detail}); {AUTH_HINT}")

    def __reduce__(self):  # pickles with its own arguments
        return type(self), (self.address, self.probe)


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


def gcs_host_port(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of a GCS address ``HOST:PORT`` or ``[V6]:PORT``; None for anything else (``"auto"``,
    a ``ray://`` or ``http://`` URL, no port)."""
    if "://" in address or ":" not in address:
        return None
    try:
        port = urlsplit(f"//{address}").port
    except ValueError:  # a port that is no number, or out of range
        return None
    host = _host(address)
    return (host, port) if host and port else None


def _token_path() -> Path:
    return Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")


def _token_at_hand() -> bool:
    if os.environ.get("RAY_AUTH_TOKEN"):
        return True
    return _token_path().is_file()


def probe_gcs(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> GcsProbe:
    """Ask the Ray GCS at ``address`` (``HOST:PORT``) for its cluster id, as ``ray.init`` does first, on a channel
    as Ray makes it (its token when token authentication is on, TLS when ``RAY_USE_TLS`` says so), but once and
    bounded: a TCP connection within ``timeout_s`` seconds, then the GCS's reply within ``timeout_s`` seconds
    (at most ~2 x ``timeout_s`` in all).

    Args:
        address: ``HOST:PORT`` or ``[V6]:PORT`` of a head's GCS (see :func:`gcs_host_port`).
        timeout_s: seconds for each of the two waits.

    Returns:
        A :class:`GcsProbe`; ``"ok"`` too for an address that is no ``HOST:PORT`` (nothing probed), where
        Ray's gRPC channel or GCS stubs cannot be imported (another Ray: after the TCP check), and for a GCS
        error other than the ones it names (``ray.init`` then says what it is).
    """
    hp = gcs_host_port(address)
    if hp is None:
        return GcsProbe("ok")
    try:
        socket.create_connection(hp, timeout=timeout_s).close()
    except socket.gaierror as e:
        return GcsProbe("closed", f"host name {hp[0]!r} not resolved: {e.strerror or e}")
    except TimeoutError:
        return GcsProbe("closed", f"no TCP connection within {timeout_s:g} s")
    except OSError as e:
        return GcsProbe("closed", (e.strerror or str(e)).lower())
    try:
        import grpc
        from ray._private.grpc_utils import init_grpc_channel
        from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc
    except ImportError:  # another Ray: the TCP check is all
        return GcsProbe("ok")
    target = f"[{hp[0]}]:{hp[1]}" if ":" in hp[0] else f"{hp[0]}:{hp[1]}"
    with init_grpc_channel(target, options=[("grpc.enable_http_proxy", 0)]) as channel:
        try:
            gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId(
                gcs_service_pb2.GetClusterIdRequest(), timeout=timeout_s)
        except grpc.RpcError as e:
            code = e.code()
            if code == grpc.StatusCode.UNAUTHENTICATED:
                return GcsProbe("refused", e.details() or "unauthenticated")
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                return GcsProbe("silent", f"the port accepts connections but no Ray GCS replied within {timeout_s:g} s")
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNIMPLEMENTED):
                return GcsProbe("silent", "the port accepts connections but what listens there is no Ray GCS "
                                          f"({code.name.lower()})")
    return GcsProbe("ok")


@contextmanager
def _bounded_ray_connect(attempt_timeout_s: float) -> Iterator[None]:
    """While in it: ``ray.init`` connects to a GCS in one attempt, of ``attempt_timeout_s`` plus Ray's two
    fixed 5 s waits (Ray's default: 20 attempts of ~40 s). A variable the user set is kept."""
    bounds = {"RAY_gcs_server_port_wait_time_s": "1", "RAY_py_gcs_connect_timeout_s": str(max(1, round(attempt_timeout_s)))}
    added = {k: v for k, v in bounds.items() if k not in os.environ}
    os.environ.update(added)
    try:
        _refresh_ray_config()
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def _refresh_ray_config() -> None:
    """Ray caches its config (``RAY_*`` variables) when imported: read it again, as its own connection to
    ``"auto"`` does."""
    try:
        from ray._raylet import Config

        Config.initialize("")
    except (ImportError, AttributeError):  # another Ray: the variables still reach a later import and child processes
        pass


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
    _refresh_ray_config()
    return True


def connect(address: str, *, attempt_timeout_s: float | None = None, **init_kwargs: Any) -> Any:
    """``ray.init(address=address, **init_kwargs)`` after :func:`token_auth_for` and, for a ``HOST:PORT``
    address, :func:`probe_gcs` (a few seconds at most); returns Ray's context.

    Args:
        address: a GCS ``HOST:PORT``, ``"auto"`` or a ``ray://`` URL (these two are not probed).
        attempt_timeout_s: when given, ``ray.init``'s own connection to the GCS is one attempt of about
            this many seconds plus 10 (for a head that answered the probe and went away since);
            None: Ray's retries (~20 attempts).
        init_kwargs: passed to ``ray.init``.

    Raises:
        ClusterUnreachable: nothing at ``address`` answers as a Ray GCS (a ConnectionError).
        ClusterRefused: the head answered and refused: token authentication (a ConnectionError).
        ConnectionError: ``ray.init`` could not connect; for an address not probed the message ends with
            :func:`connection_hint`'s (a probed head answered with the token ray.init sends: no token hint).
    """
    import ray

    token_auth_for(address)
    probe = probe_gcs(address)
    if probe.state in ("closed", "silent"):
        raise ClusterUnreachable(address, probe)
    if probe.state == "refused":
        raise ClusterRefused(address, probe)
    probed = gcs_host_port(address) is not None
    try:
        if attempt_timeout_s is None:
            return ray.init(address=address, **init_kwargs)
        with _bounded_ray_connect(attempt_timeout_s):
            return ray.init(address=address, **init_kwargs)
    except ConnectionError as e:
        if not probed:
            raise ConnectionError(f"{e}; {connection_hint(str(e))}") from None
        raise ConnectionError(f"{e} (its GCS answered dice-ray's check just before, with the token ray.init sends: "
                              f"not token authentication; `ray status --address {address}` says more)") from None


def connection_hint(message: str) -> str:
    """What to try after Ray's connection error ``message``: when it found no cluster at all, that a
    local cluster started by ``dice-ray train`` ends with its run; otherwise :data:`AUTH_HINT`."""
    if "could not find any running ray instance" in message.lower():
        return NO_CLUSTER_HINT
    return AUTH_HINT
