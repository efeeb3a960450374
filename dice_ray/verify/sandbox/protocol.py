"""Length-prefixed JSON frames between the verifier and its sandboxed worker.

JSON, not pickle, in both directions: a compromised worker must not be able to run code in the
verifier by what it sends back.  A frame is a 4-byte big-endian length and UTF-8 JSON.
"""

from __future__ import annotations

import json
import os
import select
import struct
import time
from typing import Any

__all__ = ["FrameReader", "ProtocolError", "write_frame"]

MAX_FRAME = 64 * 2**20


class ProtocolError(RuntimeError):
    """A malformed or oversized frame, or the other end closed the pipe."""


def write_frame(fd: int, msg: dict[str, Any]) -> None:
    """Write one message to ``fd`` (blocking). Raises OSError (e.g. BrokenPipeError) on a closed pipe."""
    data = json.dumps(msg, allow_nan=True).encode()
    buf = struct.pack(">I", len(data)) + data
    view = memoryview(buf)
    while view:
        n = os.write(fd, view)
        view = view[n:]


class FrameReader:
    """Reads frames from ``fd`` with a deadline."""

    def __init__(self, fd: int):
        self.fd = fd
        self.buf = b""

    def _take(self) -> dict[str, Any] | None:
        if len(self.buf) < 4:
            return None
        (n,) = struct.unpack(">I", self.buf[:4])
        if n > MAX_FRAME:
            raise ProtocolError(f"frame of {n} bytes exceeds {MAX_FRAME}")
        if len(self.buf) < 4 + n:
            return None
        data, self.buf = self.buf[4 : 4 + n], self.buf[4 + n :]
        try:
            msg = json.loads(data)
        except ValueError as e:
            raise ProtocolError(f"bad frame: {e}") from None
        if not isinstance(msg, dict):
            raise ProtocolError("frame is not a JSON object")
        return msg

    def read(self, timeout_s: float | None) -> dict[str, Any] | None:
        """The next message, or None when ``timeout_s`` (s) passed first.

        Raises:
            ProtocolError: the pipe closed (EOF) or a frame is malformed.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            msg = self._take()
            if msg is not None:
                return msg
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self.fd], [], [], remaining)
            if not ready:
                return None
            chunk = os.read(self.fd, 1 << 16)
            if not chunk:
                raise ProtocolError("pipe closed")
            self.buf += chunk
