"""Functions and classes between processes: lambdas, closures and local functions travel by
value with every start method (tensors they capture as handles), while a function or class
of the main module travels by name as with multiprocessing, so that the receiver uses its
own (its globals, its class), with a copy by value for a receiver whose main module lacks
it."""

import pytest

from conftest import LONG, import_torch, run_python


def _call(q, out):
    f = q.get(timeout=LONG)
    out.put(f(3))


def _run(target):
    target()


def test_lambdas_closures_and_local_functions_through_process_pool_and_queues(ctx):
    torch = import_torch()
    import tensorshare

    # Shared before a fork child can inherit it (a fork child's copy of a private tensor is
    # its own, in torch too); under spawn and forkserver the closure travels by value, the
    # tensor inside as a handle.
    captured = tensorshare.share_memory_(torch.zeros(3))

    def local_fill(value):  # a local function, closing over a tensor
        captured.fill_(value)
        return float(captured.sum())

    p = ctx.Process(target=_run, args=(lambda: local_fill(2.0),))
    p.start()
    p.join(LONG)
    assert p.exitcode == 0
    assert captured.tolist() == [2.0, 2.0, 2.0], "the closure's tensor is the parent's memory"

    k = 10
    with ctx.Pool(2) as pool:
        assert pool.map(lambda x: x * k, range(5)) == [0, 10, 20, 30, 40]
        assert pool.apply(local_fill, (1.0,)) == 3.0
    assert captured.tolist() == [1.0, 1.0, 1.0]

    q, out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_call, args=(q, out))
    p.start()
    try:
        q.put(lambda x: x + k)
        assert out.get(timeout=LONG) == 13
    finally:
        p.join(LONG)
    assert p.exitcode == 0


_MAIN_SCRIPT = """
import sys
import threading

import tensorshare.multiprocessing as mp

model = None
LOCK = threading.Lock()  # cannot be pickled: a function that uses it travels by name only


def init(name):
    global model
    model = name


def task(x):
    with LOCK:
        return model, x


class Message:
    def __init__(self, text):
        self.text = text


def check(q, out):
    m = q.get(timeout=60)
    out.put((type(m) is Message, isinstance(m, Message), m.text))


if __name__ == "__main__":
    method = sys.argv[1] if len(sys.argv) > 1 else "{method}"
    ctx = mp.get_context(method)
    with ctx.Pool(2, initializer=init, initargs=("resnet",)) as pool:
        print(pool.map(task, range(3)))
    q, out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=check, args=(q, out))
    p.start()
    q.put(Message("hi"))
    print(out.get(timeout=60))
    p.join(60)
    print(p.exitcode)
"""


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_a_main_modules_functions_and_classes_travel_by_name(method, tmp_path):
    # Before: they travelled by value with a copy of their globals, so a Pool's tasks did
    # not see what the workers' initializer set (model stayed None), a task using a lock of
    # the module could not be sent at all, and a class was a copy unknown to the receiver's
    # isinstance. multiprocessing sends them by name: the receiver uses its own.
    out = run_python(_MAIN_SCRIPT.replace("{method}", method), timeout=120, script_dir=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "[('resnet', 0), ('resnet', 1), ('resnet', 2)]",
        "(True, True, 'hi')",
        "0",
    ], out.stderr


def test_a_main_module_that_is_no_file_still_sends_its_functions_by_value():
    # Under spawn, a child of `python -c` has no main module of the parent's to look in:
    # the copy by value that travels beside the name is used (multiprocessing fails here).
    out = run_python(
        """
        import tensorshare.multiprocessing as mp

        BASE = 5

        def add(x):
            return x + BASE

        class Box:
            def __init__(self, v):
                self.v = v

        def unbox(b):
            return b.v * 2

        if __name__ == "__main__":
            with mp.get_context("spawn").Pool(1) as pool:
                print(pool.map(add, [1, 2]), pool.map(unbox, [Box(4)]))
        """,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == "[6, 7] [8]\n", out.stderr


def test_a_main_function_that_cannot_be_copied_names_itself_where_it_cannot_be_found():
    # Sent by name alone (its globals hold a lock), to a spawned child of `python -c`
    # whose main module lacks it: the child's error says which function, and why.
    out = run_python(
        """
        import threading
        import tensorshare.multiprocessing as mp

        LOCK = threading.Lock()

        def locked(x):
            with LOCK:
                return x

        def receive(q, out):
            try:
                q.get(timeout=60)
                out.put("received")
            except Exception as e:
                out.put(f"{type(e).__name__}: {e}")

        if __name__ == "__main__":
            ctx = mp.get_context("spawn")
            q, out = ctx.Queue(), ctx.Queue()
            p = ctx.Process(target=receive, args=(q, out))
            p.start()
            q.put(locked)
            print(out.get(timeout=60))
            p.join(60)
        """,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "locked is not in this process's main module" in out.stdout, (out.stdout, out.stderr)


def test_a_function_defined_again_under_the_main_guard_is_the_one_that_runs(tmp_path):
    # The receiver's main module has a function of that name, but another one (defined at
    # the top of the script, where the sender's is under `if __name__ == "__main__":`): the
    # copy by value runs, not the receiver's.
    out = run_python(
        """
        import tensorshare.multiprocessing as mp

        def handler(x):
            return "the module's"

        def child(q, out):
            out.put(q.get(timeout=60)(0))

        if __name__ == "__main__":
            def handler(x):
                return "the one sent"

            ctx = mp.get_context("spawn")
            q, out = ctx.Queue(), ctx.Queue()
            p = ctx.Process(target=child, args=(q, out))
            p.start()
            q.put(handler)
            print(out.get(timeout=60))
            p.join(60)
        """,
        timeout=120,
        script_dir=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == "the one sent\n", out.stderr
