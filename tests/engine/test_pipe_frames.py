"""FrameReader reads multiprocessing's own frames (Connection.send_bytes) in bulk: every message
written so far in one call, in order, split or whole, then EOFError once the writer closed."""

from __future__ import annotations

import multiprocessing
import os
import threading

import pytest

from pagedllm.engine.pipe_frames import FrameReader


def test_every_frame_written_so_far_in_one_call_in_order():
    recv, send = multiprocessing.Pipe(duplex=False)
    messages = [b"", b"x", os.urandom(100), os.urandom(20000), b"last"]  # 20000 > 16 KiB: header written apart
    for m in messages:
        send.send_bytes(m)
    reader = FrameReader(recv.fileno())
    assert reader.read_frames() == messages
    send.close()
    with pytest.raises(EOFError):
        reader.read_frames()
    recv.close()


def test_frames_split_across_reads_wait_for_their_rest():
    r, w = os.pipe()
    frame = len(b"hello").to_bytes(4, "big") + b"hello"
    reader = FrameReader(r)
    got: list[list[bytes]] = []
    t = threading.Thread(target=lambda: got.append(reader.read_frames()))
    t.start()
    for i in range(len(frame)):  # a byte at a time: the header and the body split anywhere
        os.write(w, frame[i : i + 1])
    t.join(5)
    assert got == [[b"hello"]]
    os.write(w, frame + frame[:6])  # one whole frame and the start of the next
    assert reader.read_frames() == [b"hello"]
    os.write(w, frame[6:])
    assert reader.read_frames() == [b"hello"]
    os.close(w)
    os.close(r)


def test_a_large_body_across_many_reads():
    recv, send = multiprocessing.Pipe(duplex=False)
    big = os.urandom(3 << 20)  # larger than one read and than the pipe's buffer
    t = threading.Thread(target=send.send_bytes, args=(big,))
    t.start()
    assert FrameReader(recv.fileno()).read_frames() == [big]
    t.join(5)
    send.close()
    recv.close()
