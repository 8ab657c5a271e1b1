"""Reading a multiprocessing pipe's messages in bulk: every frame that has arrived, with one read.

`Connection.recv_bytes` reads one message with two `os.read` calls (its 4-byte length, then the body),
and each call gives the GIL up. In the server's frontend the event loop holds the GIL while it writes
streams, so the engine client's receiver thread waits up to the switch interval (5 ms) to get it back
after every read: two waits per engine step, while the engine process blocks on a full pipe
(BENCHMARKS.md, issue 16, h39). One large read takes every message written meanwhile, for one wait.

The frames are multiprocessing's own (`Connection.send_bytes`): a big-endian signed 32-bit length and
the body, or -1 and a 64-bit length for bodies of 2 GiB or more:

    [00 00 00 05] b"hello" [00 00 00 02] b"ok"   ->   read_frames() == [b"hello", b"ok"]
"""

from __future__ import annotations

import os
import struct

_READ_SIZE = 1 << 20


class FrameReader:
    """The frames arriving on a blocking file descriptor, as they come; only one thread reads it."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._buf = bytearray()

    def read_frames(self) -> list[bytes]:
        """The complete frames received so far, at least one (blocks until then); EOFError once the
        writer has closed its end and every frame before that was returned."""
        while True:
            frames = self._split()
            if frames:
                return frames
            chunk = os.read(self._fd, _READ_SIZE)
            if not chunk:
                raise EOFError
            self._buf += chunk

    def _split(self) -> list[bytes]:
        buf = self._buf
        frames: list[bytes] = []
        pos = 0
        while len(buf) - pos >= 4:
            (size,) = struct.unpack_from("!i", buf, pos)
            head = 4
            if size == -1:
                if len(buf) - pos < 12:
                    break
                (size,) = struct.unpack_from("!Q", buf, pos + 4)
                head = 12
            if len(buf) - pos - head < size:
                break
            frames.append(bytes(buf[pos + head : pos + head + size]))
            pos += head + size
        if pos:
            del buf[:pos]
        return frames
