"""Pipes between Python processes: ends carry tensors and arrays as handles, with the
behaviour of multiprocessing's connections."""

import multiprocessing.connection

import numpy as np
import pytest

import tensorshare.multiprocessing as mp
from conftest import import_torch


def _double_back(conn):
    while True:
        try:
            item = conn.recv()
        except EOFError:
            return
        if item is None:
            return
        item["t"].mul_(2)
        conn.send(item)


def test_a_duplex_pipe_between_processes(ctx):
    torch = import_torch()
    ours, theirs = ctx.Pipe()
    p = ctx.Process(target=_double_back, args=(theirs,))
    p.start()
    theirs.close()
    t = torch.ones(3)
    ours.send({"t": t, "a": np.arange(3), "f": lambda x: x + 1})
    got = ours.recv()
    ours.send(None)
    p.join(60)
    assert p.exitcode == 0
    assert got["f"](1) == 2
    np.testing.assert_array_equal(got["a"], np.arange(3))
    # the child doubled the tensor in place: the parent's tensor shows it
    assert torch.equal(t, torch.full((3,), 2.0))
    assert got["t"].untyped_storage().data_ptr() == t.untyped_storage().data_ptr()


def _exit_at_once(conn):
    conn.close()


def test_recv_raises_eoferror_once_the_other_end_is_gone():
    ctx = mp.get_context("fork")
    ours, theirs = ctx.Pipe()
    p = ctx.Process(target=_exit_at_once, args=(theirs,))
    p.start()
    theirs.close()
    p.join(60)
    assert ours.poll(5)  # the hang-up is ready to be received
    with pytest.raises(EOFError):
        ours.recv()


def test_a_one_way_pipe_has_a_reading_and_a_writing_end():
    reader, writer = mp.Pipe(duplex=False)
    assert reader.readable and not reader.writable
    assert writer.writable and not writer.readable
    with pytest.raises(OSError, match="read-only"):
        reader.send(1)
    with pytest.raises(OSError, match="write-only"):
        writer.recv()
    writer.send("x")
    assert reader.recv() == "x"


def test_poll_bytes_and_wait():
    a, b = mp.Pipe()
    assert not a.poll()
    assert not a.poll(0.01)
    b.send_bytes(b"0123456789", 2, 5)
    ready = multiprocessing.connection.wait([a], timeout=5)
    assert ready == [a]
    assert a.poll(None)
    assert a.recv_bytes() == b"23456"
    b.send_bytes(b"long message")
    with pytest.raises(OSError, match="bad message length"):
        a.recv_bytes(maxlength=4)
    with pytest.raises(ValueError):
        b.send_bytes(b"abc", 2, 5)
    a.close()
    assert a.closed
    with pytest.raises(OSError, match="closed"):
        a.send(1)


def test_an_end_travels_through_a_queue(ctx):
    q = ctx.Queue()
    a, b = ctx.Pipe()
    q.put(b)
    got = q.get(timeout=10)
    got.send("through the received end")
    assert a.recv() == "through the received end"
