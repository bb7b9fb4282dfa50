"""multiprocessing's own objects travel as multiprocessing sends them: shared ctypes
(`Value`, `Array`), a `Manager` and its proxies, the ends of multiprocessing's own `Pipe` and
sockets, as process arguments and through tensorshare's queues, with every start method.
Their reducers are those multiprocessing registers (`ForkingPickler.register`), which
tensorshare's pickler consults as multiprocessing's does: pickled as plain objects instead,
a Connection arrived holding its sender's descriptor number, and wrote to whatever file had
that number in the receiver."""

import functools
import multiprocessing
import os
import socket
import threading

import pytest

import tensorshare
from conftest import LONG, reap


def _add(v, a):
    v.value += 41
    a[0] = 99.0


def test_value_and_array_reach_a_child_whose_writes_the_parent_sees(ctx):
    v = ctx.Value("i", 1)
    a = ctx.Array("d", [0.0, 1.0])
    p = ctx.Process(target=_add, args=(v, a))
    p.start()
    reap(p)
    assert p.exitcode == 0
    assert v.value == 42 and a[:] == [99.0, 1.0]


def _fill_dict(d, lst):
    d["a"] = 1
    lst.append("from child")


def test_a_manager_starts_and_its_proxies_reach_a_child(ctx):
    with ctx.Manager() as m:
        d, lst = m.dict(), m.list()
        p = ctx.Process(target=_fill_dict, args=(d, lst))
        p.start()
        reap(p)
        assert p.exitcode == 0
        assert dict(d) == {"a": 1} and list(lst) == ["from child"]


def _send_on(conn, sock, what="from child"):
    conn.send(f"hello {what}")
    sock.sendall(f"bytes {what}".encode())


def _read_what_was_sent(r, a, what):
    """What ``_send_on`` sent, read from the other ends of its pipe and socket."""
    assert r.poll(LONG) and r.recv() == f"hello {what}"
    a.settimeout(LONG)
    assert a.recv(64) == f"bytes {what}".encode()


def test_ends_of_multiprocessings_pipe_and_a_socket_as_process_arguments(ctx):
    r, w = multiprocessing.Pipe()
    a, b = socket.socketpair()
    with r, w, a, b:
        p = ctx.Process(target=_send_on, args=(w, b))
        p.start()
        _read_what_was_sent(r, a, "from child")
        reap(p)
    assert p.exitcode == 0


def _send_on_received(q, n_files):
    # Descriptors opened first, so that the sender's descriptor numbers name other files
    # here: a Connection or socket that arrived with its sender's number would write to one.
    files = [open(os.devnull, "w") for _ in range(n_files)]  # noqa: SIM115 - closed below
    try:
        conn, sock = q.get(timeout=LONG)
        _send_on(conn, sock, "through the queue")
    finally:
        for f in files:
            f.close()


def test_ends_of_multiprocessings_pipe_and_a_socket_through_a_queue(ctx):
    q = ctx.Queue()
    r, w = multiprocessing.Pipe()
    a, b = socket.socketpair()
    with r, w, a, b:
        p = ctx.Process(target=_send_on_received, args=(q, 64))
        p.start()
        q.put((w, b))
        _read_what_was_sent(r, a, "through the queue")
        reap(p)
    assert p.exitcode == 0


def _scaled(x, factor):
    return x * factor


def test_a_partial_keeps_its_attributes_as_its_own_reduction_keeps_them():
    # multiprocessing's reducer for functools.partial drops them; the partial's own keeps
    # them, and is the one used.
    p = functools.update_wrapper(functools.partial(_scaled, factor=3), _scaled)
    got = tensorshare.roundtrip({"f": p})["f"]
    assert got(2) == 6 and got.__name__ == "_scaled" and got.__wrapped__ is _scaled


def _nothing(*args):
    pass


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_process_argument_that_cannot_be_pickled_names_itself(method):
    import tensorshare.multiprocessing as mp

    ctx = mp.get_context(method)
    p = ctx.Process(target=_nothing, args=(1, threading.Lock()))
    with pytest.raises(TypeError, match=r"cannot send the target and arguments of a process .*lock"):
        p.start()
    assert p.pid is None


def test_torchs_reducers_are_consulted_for_its_events_not_its_tensors_or_storages():
    # torch registers reducers with multiprocessing's pickler for its tensor and storage
    # classes (legacy ones such as torch.FloatTensor too), which tensorshare sends itself,
    # and for its CUDA Event, which travels by torch's interprocess handle.
    pytest.importorskip("torch", reason="torch is not installed in this environment")
    import torch
    import torch.multiprocessing  # noqa: F401  (registers torch's reducers)

    from tensorshare._reduction import _consulted

    assert _consulted(torch.cuda.Event)
    for cls in (torch.Tensor, torch.nn.Parameter, torch.FloatTensor, torch.UntypedStorage):
        assert not _consulted(cls), cls
    assert not _consulted(torch.FloatStorage)
