"""dice_ray.cluster.auth: when dice-ray sends this machine's Ray token to a head given by address."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import psutil
import pytest

from dice_ray.cluster.auth import AUTH_HINT, NO_CLUSTER_HINT, connection_hint, is_this_machine, token_auth_for


@pytest.mark.parametrize("address", ["127.0.0.1:6379", "localhost:6379", "[::1]:6379", "ray://127.0.0.1:10001",
                                     "http://127.0.0.1:8265", f"{socket.gethostname()}:6379", "127.0.0.2:6379"])
def test_loopback_and_own_names_are_this_machine(address):
    assert is_this_machine(address)


def test_an_interface_address_is_this_machine_and_others_are_not():
    ours = next((a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                 if a.family == socket.AF_INET and not a.address.startswith("127.")), None)
    if ours is not None:  # a machine with a network interface besides loopback
        assert is_this_machine(f"{ours}:6379")
    assert not is_this_machine("203.0.113.9:6379")  # TEST-NET-3: never a local address
    assert not is_this_machine("head.example.invalid:6379")  # a name is not resolved


def _run(address: str, home, **env: str) -> str:
    """token_auth_for in a fresh process (it refreshes Ray's cached config, which must not leak into this one)."""
    code = ("import os; from dice_ray.cluster.auth import token_auth_for; "
            f"print(token_auth_for({address!r}), os.environ.get('RAY_AUTH_MODE'))")
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    out = subprocess.run([sys.executable, "-c", code], env=base | {"HOME": str(home), **env}, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-1500:]
    return out.stdout.strip()


@pytest.fixture
def home_with_token(tmp_path):
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("0123456789abcdef" * 4)
    return tmp_path


def test_a_local_head_gets_the_token_when_one_is_at_hand(home_with_token, tmp_path_factory):
    assert _run("127.0.0.1:6379", home_with_token) == "True token"
    empty = tmp_path_factory.mktemp("empty")
    assert _run("127.0.0.1:6379", empty) == "False None"  # no token: nothing to send
    assert _run("127.0.0.1:6379", empty, RAY_AUTH_TOKEN="abc") == "True token"  # a token in the environment


def test_remote_heads_auto_and_an_explicit_mode_are_left_alone(home_with_token):
    assert _run("203.0.113.9:6379", home_with_token) == "False None"  # the local token is not sent away
    assert _run("auto", home_with_token) == "False None"  # Ray's own rule
    assert _run("127.0.0.1:6379", home_with_token, RAY_AUTH_MODE="disabled") == "False disabled"


def test_the_hint_names_what_to_set():
    assert "RAY_AUTH_MODE=token" in AUTH_HINT and "~/.ray/auth_token" in AUTH_HINT
    assert token_auth_for(None) is False and token_auth_for("auto") is False


def test_connection_hint_tells_no_cluster_from_auth():
    """Ray's 'no running instance' error gets the no-cluster hint (not the token one); others the token hint."""
    assert connection_hint("Could not find any running Ray instance. Please specify the one to connect to") == NO_CLUSTER_HINT
    assert "dice-ray train" in NO_CLUSTER_HINT and "RAY_AUTH" not in NO_CLUSTER_HINT
    assert connection_hint("Failed to connect to GCS at 10.0.0.5:6379: unauthenticated") == AUTH_HINT
