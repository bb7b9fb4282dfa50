"""Queues with the faces of ``multiprocessing``'s, over one tensorshare queue each."""

import threading

from .. import _native


class _Reader:
    """The end multiprocessing's Pool reads (``_reader.recv``, ``poll``, ``fileno``)."""

    def __init__(self, q):
        self._q = q

    def recv(self):
        return self._q.get()

    def poll(self, timeout=0.0):
        return self._q.poll(timeout)

    def fileno(self):
        return self._q.fileno()

    def close(self):
        pass


class _Writer:
    """The end multiprocessing's Pool writes (``_writer.send``)."""

    def __init__(self, q):
        self._q = q

    def send(self, obj):
        self._q.put(obj)

    def close(self):
        pass


class _Wrapper:
    """What the queues share: the native queue, the ends multiprocessing's Pool reaches
    for, and pickling as the native queue (a handle) plus the class."""

    def __init__(self, q, ctx):
        self._q = q
        self._ctx = ctx
        self._setup()

    def _setup(self):
        self._reader = _Reader(self._q)
        self._writer = _Writer(self._q)
        self._rlock = threading.Lock()
        self._closed = False

    def __reduce__(self):
        return (_rebuild, (type(self), self._q))

    def empty(self):
        return self._q.empty()

    def close(self):
        self._closed = True

    def __repr__(self):
        # Not by fileno(), which routes the queue's values through its socket from then on
        # (where empty() cannot tell a value from a wake-up without taking it).
        return f"<tensorshare {type(self).__name__} at {id(self):#x}>"


def _rebuild(cls, q):
    obj = cls.__new__(cls)
    obj._q = q
    obj._ctx = None
    obj._setup()
    return obj


class SimpleQueue(_Wrapper):
    """``multiprocessing.SimpleQueue``: ``put`` never waits; tensors travel as handles."""

    def __init__(self, *, ctx=None):
        super().__init__(_native.Queue(simple=True), ctx)

    def _check_open(self):
        # As multiprocessing's, whose close() closes both ends of its pipe.
        if self._closed:
            raise OSError("handle is closed")

    def put(self, obj):
        self._check_open()
        self._q.put(obj)

    def get(self):
        self._check_open()
        return self._q.get()

    def empty(self):
        self._check_open()
        return super().empty()


class Queue(_Wrapper):
    """``multiprocessing.Queue``: unbounded unless ``maxsize > 0``; tensors travel as
    handles. ``put`` on an unbounded queue never waits: what the socket cannot take yet is
    written out by a feeder thread, and a process the package started writes it out before
    it leaves, so a sender may exit right after (a child forked by other means writes each
    value directly, waiting for room). ``qsize`` is an estimate, as Python's is."""

    def __init__(self, maxsize=0, *, ctx=None):
        super().__init__(_native.Queue(maxsize), ctx)

    def put(self, obj, block=True, timeout=None):
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")
        self._q.put(obj, block, timeout)

    def get(self, block=True, timeout=None):
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")
        return self._q.get(block, timeout)

    def put_nowait(self, obj):
        return self.put(obj, False)

    def get_nowait(self):
        return self.get(False)

    def full(self):
        return self._q.full()

    def qsize(self):
        return self._q.qsize()

    def join_thread(self):
        # As multiprocessing's, which asserts it. What this process put is written out
        # before it leaves (see the class), so there is no feeder to join here.
        if not self._closed:
            raise AssertionError(f"Queue {self!r} not closed")

    def cancel_join_thread(self):
        # As multiprocessing's: this process leaves without waiting for what it put to be
        # written out, and what is still unwritten then is lost.
        self._q.cancel_join_thread()


class JoinableQueue(Queue):
    """``multiprocessing.JoinableQueue``: ``task_done`` and ``join`` on top of ``Queue``."""

    def __init__(self, maxsize=0, *, ctx):
        super().__init__(maxsize, ctx=ctx)
        self._unfinished_tasks = ctx.Semaphore(0)
        self._cond = ctx.Condition()

    def __reduce__(self):
        return (_rebuild_joinable, (self._q, self._unfinished_tasks, self._cond))

    def put(self, obj, block=True, timeout=None):
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")
        # The task is counted before its value can be taken, so that the consumer's
        # task_done finds it, but the wait for room is not made under the condition: the
        # consumer takes the condition in task_done between its gets, and only its next get
        # makes room. A put that fails (full, a timeout, an interrupt, a value that cannot
        # be sent) takes its count back, and wakes joiners if it was the last.
        with self._cond:
            self._unfinished_tasks.release()
        try:
            self._q.put(obj, block, timeout)
        except BaseException:
            with self._cond:
                self._unfinished_tasks.acquire(False)
                if self._unfinished_tasks._semlock._is_zero():
                    self._cond.notify_all()
            raise

    def task_done(self):
        with self._cond:
            if not self._unfinished_tasks.acquire(False):
                raise ValueError("task_done() called too many times")
            if self._unfinished_tasks._semlock._is_zero():
                self._cond.notify_all()

    def join(self):
        with self._cond:
            if not self._unfinished_tasks._semlock._is_zero():
                self._cond.wait()


def _rebuild_joinable(q, unfinished, cond):
    obj = JoinableQueue.__new__(JoinableQueue)
    obj._q = q
    obj._ctx = None
    obj._unfinished_tasks = unfinished
    obj._cond = cond
    obj._setup()
    return obj
