"""Pipes between Python processes: ends carry tensors and arrays as handles, with the
behaviour of multiprocessing's connections."""

import multiprocessing
import multiprocessing.connection

import numpy as np
import pytest

import tensorshare.multiprocessing as mp
from conftest import import_torch, run_python


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


def test_recv_raises_eoferror_once_the_other_end_is_gone(ctx):
    # Before, under spawn and forkserver, the parent kept its copies of the descriptors of
    # the child's arguments until the Process object went, so the other end stayed open
    # here and recv waited for good.
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


def _echo_bytes(conn):
    conn.send_bytes(conn.recv_bytes())
    conn.close()


def test_bytes_like_objects_and_recv_bytes_into_as_multiprocessing(ctx):
    # Before: send_bytes took bytes only, recv_bytes_into did not exist, a bad offset was
    # an OverflowError, and sending to a closed peer an EOFError.
    import array

    ours, theirs = ctx.Pipe()
    p = ctx.Process(target=_echo_bytes, args=(theirs,))
    p.start()
    theirs.close()
    try:
        ours.send_bytes(np.arange(4, dtype=np.int32), 4, 8)  # items 1 and 2, as bytes
        into = bytearray(b"." * 12)
        assert ours.recv_bytes_into(into, 2) == 8
        assert bytes(into) == b".." + np.array([1, 2], dtype=np.int32).tobytes() + b".."
    finally:
        p.join(60)
    assert p.exitcode == 0
    with pytest.raises(BrokenPipeError):
        ours.send_bytes(b"nobody reads")

    a, b = mp.Pipe()
    for buf in (bytearray(b"abc"), memoryview(b"abc"), array.array("b", b"abc")):
        b.send_bytes(buf)
        assert a.recv_bytes() == b"abc"
    b.send_bytes(b"0123456789")
    with pytest.raises(multiprocessing.BufferTooShort) as short:
        a.recv_bytes_into(bytearray(4))
    assert short.value.args[0] == b"0123456789"
    floats = array.array("f", [0.0] * 4)
    b.send_bytes(array.array("f", [1.5, 2.5]))
    assert a.recv_bytes_into(floats, 4) == 8 and floats.tolist() == [0.0, 1.5, 2.5, 0.0]
    for offset, size, message in [
        (-1, None, "negative"),
        (5, None, "< offset"),
        (0, -1, "negative"),
        (2, 2, "offset \\+ size"),
    ]:
        with pytest.raises(ValueError, match=message):
            b.send_bytes(b"abc", offset, size)
    with pytest.raises(ValueError, match="negative offset"):
        a.recv_bytes_into(bytearray(2), -1)
    with pytest.raises(ValueError, match="offset too large"):
        a.recv_bytes_into(bytearray(2), 3)


def test_recv_bytes_of_a_value_sent_by_send_gives_its_pickle_as_multiprocessing_does():
    # multiprocessing's send is send_bytes of the value's pickle, so recv_bytes gives the
    # pickle; here it raised "the message received is not bytes", and the value was lost.
    import pickle

    a, b = mp.Pipe()
    a.send({"k": [1, 2]})
    a.send("next")
    got = b.recv_bytes()
    assert isinstance(got, bytes) and pickle.loads(got) == {"k": [1, 2]}
    assert b.recv() == "next"
    a.send((3, 4))
    buf = bytearray(256)
    n = b.recv_bytes_into(buf)
    assert pickle.loads(bytes(buf[:n])) == (3, 4)
    a.send(b"raw")
    assert b.recv_bytes() == b"raw"


def _send_messages(conn, messages):
    for m in messages:
        conn.send_bytes(m)
    conn.close()


def test_recv_bytes_into_fills_a_buffer_of_any_format_and_refuses_a_read_only_one_before_taking_a_message(
    ctx,
):
    # A buffer of one-byte items of another format than unsigned bytes (array('b'), a
    # numpy int8 array, a ctypes char array) was kept as it was: the message was taken off
    # the pipe, then assigning it into the buffer failed, and it was lost. A read-only
    # buffer failed the same way, after the message was taken.
    import array
    import ctypes

    buffers = [
        array.array("b", bytes(8)),
        np.zeros(8, np.int8),
        np.zeros(8, np.bool_),
        ctypes.create_string_buffer(8),
        array.array("h", bytes(8)),
    ]
    messages = [b"m%d" % i for i in range(len(buffers))]
    ours, theirs = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_send_messages, args=(theirs, messages))
    p.start()
    theirs.close()
    try:
        for buf, message in zip(buffers, messages, strict=True):
            # Refused before anything is taken: the next message is still there.
            with pytest.raises(TypeError, match="writable"):
                ours.recv_bytes_into(b"12345678")
            assert ours.recv_bytes_into(buf, 1) == len(message)
            assert bytes(memoryview(buf).cast("B"))[1 : 1 + len(message)] == message
    finally:
        p.join(60)
    assert p.exitcode == 0


def _use_one_way_ends(r, w, q):
    got = [r.readable, r.writable, w.readable, w.writable]
    ends = q.get()  # the same ends again, through a queue
    got += [ends[0].readable, ends[0].writable, ends[1].readable, ends[1].writable]
    for call in [lambda: r.send("x"), w.recv, lambda: ends[0].send("x")]:
        try:
            call()
            got.append("no error")
        except OSError as e:
            got.append(str(e))
    w.send(got)
    ends[1].send("through the queue's end")


def test_the_ends_of_a_one_way_pipe_stay_one_way_in_the_process_they_reach(ctx):
    # The wire's ends are duplex: a reading end received by another process could send
    # (into the writing end, which refuses to receive: sent for nobody), and a writing end
    # could wait to receive. multiprocessing's ends keep their direction wherever they go.
    r, w = ctx.Pipe(duplex=False)
    q = ctx.Queue()
    p = ctx.Process(target=_use_one_way_ends, args=(r, w, q))
    p.start()
    q.put((r, w))
    try:
        got = r.recv()
        assert got[:8] == [True, False, False, True] * 2
        assert got[8:] == ["connection is read-only", "connection is write-only", "connection is read-only"]
        assert r.recv() == "through the queue's end"
    finally:
        p.join(60)
    assert p.exitcode == 0
    # A duplex end stays duplex.
    a, b = ctx.Pipe()
    q.put(a)
    a2 = q.get(timeout=60)
    assert a2.readable and a2.writable
    a2.send("both ways")
    assert b.recv() == "both ways"


SEND_TO_A_PEER_THAT_DOES_NOT_READ = """
    import signal
    import tensorshare.multiprocessing as mp

    class Stuck(Exception):
        pass

    sent, last = 0, -1

    def tick(signum, frame):
        # Raises once the sends stopped: the pipe is full, and send waits for the peer.
        global last
        if sent == last:
            raise Stuck(sent)
        last = sent

    if __name__ == "__main__":
        ctx = mp.get_context("fork")
        ours, theirs = ctx.Pipe()
        go = ctx.Event()
        p = ctx.Process(target=go.wait)  # holds the other end, and reads nothing
        p.start()
        signal.signal(signal.SIGALRM, tick)
        signal.setitimer(signal.ITIMER_REAL, 0.2, 0.2)
        try:
            while True:
                ours.send(b"x" * 4096)
                sent += 1
        except Stuck:
            signal.setitimer(signal.ITIMER_REAL, 0)
            print("interrupted after", sent)
        go.set()
        p.join(60)
        assert p.exitcode == 0
        got = 0
        while theirs.poll(0):
            assert theirs.recv_bytes() == b"x" * 4096
            got += 1
        print(got == sent)
"""


def test_a_send_waiting_for_a_peer_that_does_not_read_is_interrupted_by_a_signal():
    # send waited for room in the socket with no end, and no signal handler ran: Ctrl-C
    # did nothing, and only SIGKILL ended the process.
    out = run_python(SEND_TO_A_PEER_THAT_DOES_NOT_READ, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.split("\n")
    assert lines[0].startswith("interrupted after") and lines[1] == "True", out.stdout


def test_a_one_way_end_at_the_deepest_level_travels_whole():
    # A one-way end travels as an Object with the end one level below it: at the deepest
    # level a handle may take it was an encode error ("nested deeper than 256 levels"),
    # where the value is to be pickled whole.
    import tensorshare

    for duplex in (True, False):
        r, w = mp.Pipe(duplex=duplex)
        v = w
        for _ in range(255):
            v = [v]
        got = tensorshare.roundtrip(v)
        for _ in range(255):
            got = got[0]
        assert (got.readable, got.writable) == (duplex, True)
        got.send("deep")
        assert r.recv() == "deep"
