"""What torch's ``test/test_multiprocessing.py`` checks of CUDA tensors, asked of
``tensorshare.multiprocessing``: a CUDA tensor travels as torch's own CUDA IPC handle, so the
receiver maps the sender's memory (its writes reach the sender), one storage sent twice
arrives as one, views share it, a ``Parameter`` and ``requires_grad`` are kept, a CUDA
``Event`` travels by its interprocess handle, and torch's rules hold (a storage alone is
refused with torch's error; a forked child cannot use CUDA once its parent has). Then
tensorshare's own CUDA tensors (``tensorshare.empty_shared(..., device="cuda")``), which travel
as tensorshare handles: sent on by a process that received them, and given back when a holder
is killed.

Each case is a script run in a Python process of its own, which initialises CUDA and starts
its children with spawn or the fork server: the test process never initialises CUDA, so the
fork children of other tests can. Skipped, saying so, where no CUDA device is.
"""

import functools
import os
import pathlib
import subprocess
import textwrap

import pytest

from conftest import import_torch, named_segments, run_python

METHODS = ["spawn", "forkserver"]
ROOT = pathlib.Path(__file__).resolve().parents[3]

PRELUDE = """\
import sys

import torch

import tensorshare.multiprocessing as mp

LONG = 120


def join(p):
    p.join(LONG)
    if p.exitcode is None:
        p.kill()
        p.join()
    assert p.exitcode == 0, f"child ended with {p.exitcode}"
"""


@functools.cache
def _cuda_devices():
    """How many CUDA devices torch sees, asked of a process of its own (torch's probe in this
    process would set up the driver here, before other tests fork)."""
    out = run_python("import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
    if out.returncode != 0:
        return 0
    return int(out.stdout.split()[-1])


@pytest.fixture
def cuda():
    import_torch()
    if _cuda_devices() == 0:
        pytest.skip("no CUDA device on this machine (torch.cuda.is_available() is False)")


def run_case(tmp_path, body, method, expect_ok=True):
    """Runs the script ``PRELUDE + body`` (its ``{method}`` replaced) as ``main.py``; the
    finished process. With ``expect_ok``, it must exit 0 having printed ``ok``, and leave no
    named segment of tensorshare's behind."""
    before = set(named_segments())
    code = PRELUDE + textwrap.dedent(body).replace("{method}", method)
    out = run_python(code, timeout=240, script_dir=tmp_path)
    if expect_ok:
        assert out.returncode == 0 and out.stdout.split()[-1:] == ["ok"], out.stdout + out.stderr
        assert set(named_segments()) <= before
    return out


def test_a_child_writes_what_the_parent_sees_and_one_storage_arrives_once(cuda, tmp_path):
    # torch's test_cuda_simple (through _test_sharing), test_mixed_types_cuda_sharing and
    # test_is_shared_cuda, under both start methods in one script each.
    for method in METHODS:
        run_case(
            tmp_path,
            """
            def child(q_in, q_out, done):
                x, column, again, as_bytes = q_in.get(timeout=LONG)
                assert x.is_cuda and x.is_shared()
                ptr = x.untyped_storage().data_ptr()
                # One storage sent twice, and its views, arrive as one storage.
                assert again.untyped_storage().data_ptr() == ptr
                assert column.untyped_storage().data_ptr() == ptr
                assert as_bytes.untyped_storage().data_ptr() == ptr
                assert column.stride() == (5,) and column.storage_offset() == 1
                x.fill_(7)
                column.fill_(3)
                # 1.0f32's bytes, written through the byte view, read through the float one.
                as_bytes[96:100] = torch.tensor([0, 0, 128, 63], dtype=torch.uint8, device="cuda")
                torch.cuda.synchronize()
                q_out.put(x[4, 4].item())
                done.wait(LONG)


            if __name__ == "__main__":
                ctx = mp.get_context("{method}")
                x = torch.zeros(5, 5, device="cuda")
                assert x.is_shared()
                q_in, q_out, done = ctx.Queue(), ctx.Queue(), ctx.Event()
                p = ctx.Process(target=child, args=(q_in, q_out, done))
                p.start()
                q_in.put([x, x[:, 1], x, x.view(torch.uint8).view(-1)])
                assert q_out.get(timeout=LONG) == 1.0
                expect = torch.full((5, 5), 7.0, device="cuda")
                expect[:, 1] = 3
                expect[4, 4] = 1
                assert torch.equal(x, expect), x
                done.set()
                join(p)
                print("ok")
            """,
            method,
        )


def test_tensors_of_a_producer_that_drops_its_own_arrive_whole(cuda, tmp_path):
    # torch's test_cuda_memory_allocation, test_cuda_parameter_sharing,
    # test_integer_parameter_serialization_cuda, test_empty_tensor_sharing_cuda and
    # test_cuda_variable_sharing: the producer keeps the memory for the consumer after it
    # drops its own tensors, until the consumer is done.
    run_case(
        tmp_path,
        """
        def producer(q, done):
            for i in range(5):
                q.put(torch.arange(i * 5, (i + 1) * 5, device="cuda"))
            q.put(torch.nn.Parameter(torch.ones(3, device="cuda") * 2))
            q.put(torch.nn.Parameter(torch.arange(4, device="cuda"), requires_grad=False))
            q.put(torch.ones(2, 2, device="cuda", requires_grad=True))
            q.put(torch.empty(0, device="cuda"))
            q.put(torch.empty(0, 3, dtype=torch.int64, device="cuda"))
            torch.cuda.empty_cache()
            done.wait(LONG)


        if __name__ == "__main__":
            ctx = mp.get_context("{method}")
            q, done = ctx.Queue(), ctx.Event()
            p = ctx.Process(target=producer, args=(q, done))
            p.start()
            got = [q.get(timeout=LONG) for _ in range(5)]
            for i, t in enumerate(got):
                assert t.is_cuda and t.tolist() == list(range(i * 5, (i + 1) * 5)), (i, t)
            w = q.get(timeout=LONG)
            assert type(w) is torch.nn.Parameter and w.requires_grad and w.tolist() == [2.0] * 3
            n = q.get(timeout=LONG)
            assert type(n) is torch.nn.Parameter and not n.requires_grad and n.dtype == torch.int64
            v = q.get(timeout=LONG)
            assert v.requires_grad and v.is_leaf and v.sum().item() == 4
            e = q.get(timeout=LONG)
            assert e.is_cuda and e.numel() == 0 and e.dtype == torch.float32
            e2 = q.get(timeout=LONG)
            assert e2.is_cuda and e2.shape == (0, 3) and e2.dtype == torch.int64
            done.set()
            join(p)
            print("ok")
        """,
        "spawn",
    )


def test_state_dicts_through_a_bounded_queue_do_not_deadlock(cuda, tmp_path):
    # torch's test_cuda_ipc_deadlock: a producer and a consumer process, 20 state dicts of a
    # model on the GPU through a queue of capacity 3.
    run_case(
        tmp_path,
        """
        def producer(q):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)).cuda()
            for i in range(20):
                with torch.no_grad():
                    for w in model.parameters():
                        w.fill_(i)
                q.put({"step": i, "state": {k: v.clone() for k, v in model.state_dict().items()}})
            q.put(None)


        def consumer(q, out):
            seen = []
            while (item := q.get(timeout=LONG)) is not None:
                state = item["state"]
                assert all(v.is_cuda and bool((v == item["step"]).all()) for v in state.values())
                seen.append(item["step"])
            out.put(seen)


        if __name__ == "__main__":
            ctx = mp.get_context("{method}")
            q, out = ctx.Queue(3), ctx.Queue()
            procs = [ctx.Process(target=producer, args=(q,)), ctx.Process(target=consumer, args=(q, out))]
            for p in procs:
                p.start()
            assert out.get(timeout=LONG) == list(range(20))
            for p in procs:
                join(p)
            print("ok")
        """,
        "spawn",
    )


def test_a_thousand_tensors_from_a_child_arrive_with_their_values(cuda, tmp_path):
    # torch's test_cuda_send_many, as far as this package makes it different: the parent
    # checks every tensor's value and lets each go before the next.
    run_case(
        tmp_path,
        """
        def producer(q, done):
            for i in range(1000):
                q.put((i, torch.full((64,), float(i), device="cuda")))
            done.wait(LONG)


        if __name__ == "__main__":
            ctx = mp.get_context("{method}")
            q, done = ctx.Queue(), ctx.Event()
            p = ctx.Process(target=producer, args=(q, done))
            p.start()
            for expect in range(1000):
                i, t = q.get(timeout=LONG)
                assert i == expect and t.sum().item() == 64 * i, (i, t)
                del t
            done.set()
            join(p)
            print("ok")
        """,
        "forkserver",
    )


def test_an_interprocess_event_orders_a_childs_read_after_the_parents_write(cuda, tmp_path):
    # torch's test_event and test_event_multiprocess: the parent queues a long sleep and a
    # fill on its stream, records an interprocess event and sends it (the tensor first,
    # alone, so that its own handle's wait is not what orders the read); the child's stream
    # waits on the event before it reads.
    run_case(
        tmp_path,
        """
        def child(q_in, q_out):
            x = q_in.get(timeout=LONG)
            event = q_in.get(timeout=LONG)
            assert type(event) is torch.cuda.Event
            torch.cuda.current_stream().wait_event(event)
            q_out.put(x.sum().item())
            event.synchronize()
            q_out.put(event.query())


        if __name__ == "__main__":
            ctx = mp.get_context("{method}")
            x = torch.zeros(1 << 20, device="cuda")
            torch.cuda.synchronize()
            q_in, q_out = ctx.Queue(), ctx.Queue()
            p = ctx.Process(target=child, args=(q_in, q_out))
            p.start()
            q_in.put(x)
            torch.cuda._sleep(200_000_000)  # some 0.1 s of GPU time before the fill
            x.fill_(1)
            event = torch.cuda.Event(interprocess=True)
            event.record()
            q_in.put(event)
            assert q_out.get(timeout=LONG) == float(1 << 20)
            assert q_out.get(timeout=LONG) is True
            join(p)
            print("ok")
        """,
        "spawn",
    )


def test_cuda_tensors_as_spawn_arguments_and_inside_closures_are_shared(cuda, tmp_path):
    # torch.multiprocessing.spawn with a CUDA tensor among its arguments, and a lambda
    # capturing one as a Process's target: each child writes its own row, the parent sees
    # them. (Until this package sent CUDA tensors, both were refused.)
    for method in METHODS:
        run_case(
            tmp_path,
            """
            def write_row(rank, x):
                x[rank].fill_(rank + 1)
                torch.cuda.synchronize()


            if __name__ == "__main__":
                x = torch.zeros(3, 4, device="cuda")
                mp.spawn(write_row, args=(x,), nprocs=2, start_method="{method}")
                ctx = mp.get_context("{method}")
                p = ctx.Process(target=lambda: (x[2].fill_(9), torch.cuda.synchronize()))
                p.start()
                join(p)
                assert x.tolist() == [[1.0] * 4, [2.0] * 4, [9.0] * 4], x
                print("ok")
            """,
            method,
        )


def test_what_torch_refuses_is_refused_with_its_words(cuda, tmp_path):
    # torch's own errors: a CUDA storage alone, and a non-leaf tensor that requires grad.
    run_case(
        tmp_path,
        """
        import tensorshare

        if __name__ == "__main__":
            q = mp.get_context("{method}").Queue()
            x = torch.ones(4, device="cuda")
            ours = tensorshare.empty_shared((4,), device="cuda")
            for bad, words in [
                (x.untyped_storage(), "Cannot pickle CUDA storage"),
                ({"s": x.untyped_storage()}, "Cannot pickle CUDA storage"),
                ((x.requires_grad_() * 2,), "Cowardly refusing to serialize non-leaf tensor"),
                # torch would send these without the bit, and the receiver read other values.
                (torch.ones(2, dtype=torch.complex64, device="cuda").conj(), "negative or conjugate bit"),
                # torch's CUDA IPC knows its own memory only ("invalid device pointer").
                (ours.view(torch.complex64), "over CUDA memory of tensorshare's"),
                (ours.untyped_storage(), "over CUDA memory of tensorshare's"),
            ]:
                try:
                    q.put(bad)
                except Exception as e:
                    assert words in str(e) or words in str(e.__cause__), repr(e)
                else:
                    raise AssertionError(f"{type(bad)} was sent")
            print("ok")
        """,
        "spawn",
    )


def test_a_forked_child_cannot_use_cuda_its_parent_set_up_as_in_torch(cuda, tmp_path):
    # torch's test_wrong_cuda_fork: the child's first CUDA call raises torch's error.
    out = run_case(
        tmp_path,
        """
        def child():
            torch.ones(1, device="cuda")


        if __name__ == "__main__":
            torch.ones(1, device="cuda")
            p = mp.get_context("{method}").Process(target=child)
            p.start()
            p.join(LONG)
            print("exit", p.exitcode)
        """,
        "fork",
        expect_ok=False,
    )
    assert out.returncode == 0, out.stderr
    assert "exit 1" in out.stdout, out.stdout + out.stderr
    assert "Cannot re-initialize CUDA in forked subprocess" in out.stderr, out.stderr


def test_tensorshare_cuda_tensors_are_sent_on_and_shared_by_three_processes(cuda, tmp_path):
    # A relay sends on what it received, which torch refuses ("Attempted to send CUDA tensor
    # received from another process"): the writes of the relay and of the last process
    # reach the creator, views and every dtype arrive as views of one allocation each.
    run_case(
        tmp_path,
        """
        import tensorshare


        def relay(q_in, q_out, done):
            item = q_in.get(timeout=LONG)
            x = item["x"]
            assert x.is_cuda and x.untyped_storage().data_ptr() == item["col"].untyped_storage().data_ptr()
            torch.cuda._sleep(200_000_000)  # some 0.1 s of GPU time first
            x[0].fill_(5)  # queued on torch's stream: the send waits for it
            q_out.put(item)
            done.wait(LONG)


        def last(q_in, q_out, done):
            item = q_in.get(timeout=LONG)
            x, col, w = item["x"], item["col"], item["w"]
            assert col.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
            assert col.stride() == (4,) and col.storage_offset() == 1, (col.stride(), col.storage_offset())
            assert type(w) is torch.nn.Parameter and w.requires_grad and w.dtype == torch.bfloat16
            q_out.put((
                x[0].tolist(),
                col.tolist(),
                item["h"].dtype, item["h"].tolist(),
                item["b"].dtype, item["b"].tolist(),
                w.tolist(),
            ))
            x[1].fill_(7)
            torch.cuda.synchronize()
            q_out.put("written")
            done.wait(LONG)


        if __name__ == "__main__":
            ctx = mp.get_context("{method}")
            x = tensorshare.empty_shared((3, 4), device="cuda")
            x.fill_(1)
            h = tensorshare.empty_shared((4,), dtype=torch.float16, device="cuda").fill_(0.5)
            b = tensorshare.empty_shared(2, dtype=torch.bool, device="cuda").fill_(True)
            w = tensorshare.empty_shared((3,), dtype=torch.bfloat16, device="cuda").fill_(0.25)
            w = torch.nn.Parameter(w)
            q1, q2, q3, done = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Event()
            procs = [
                ctx.Process(target=relay, args=(q1, q2, done)),
                ctx.Process(target=last, args=(q2, q3, done)),
            ]
            for p in procs:
                p.start()
            q1.put({"x": x, "col": x[:, 1], "h": h, "b": b, "w": w})
            got = q3.get(timeout=LONG)
            assert got == (
                [5.0] * 4, [5.0, 1.0, 1.0],
                torch.float16, [0.5] * 4,
                torch.bool, [True, True],
                [0.25] * 3,
            ), got
            assert q3.get(timeout=LONG) == "written"
            assert x.tolist() == [[5.0] * 4, [7.0] * 4, [1.0] * 4], x
            done.set()
            for p in procs:
                join(p)
            print("ok")
        """,
        "spawn",
    )


def test_a_killed_holder_gives_a_tensorshare_cuda_tensor_back_to_its_creator(cuda, tmp_path):
    # torch keeps a CUDA allocation a consumer held until its producer exits; here the
    # creator gets it back as soon as the holder is SIGKILLed (the kernel closes the
    # holder's descriptors), and gives it to the driver: the device's free memory is back.
    run_case(
        tmp_path,
        """
        import gc

        import tensorshare

        GIB = 1 << 30


        def hold(q, ack):
            t = q.get(timeout=LONG)
            ack.put(t[-1].item())
            q.get()  # until killed


        if __name__ == "__main__":
            ctx = mp.get_context("{method}")
            q, ack = ctx.Queue(), ctx.Queue()
            p = ctx.Process(target=hold, args=(q, ack))
            p.start()
            torch.cuda.init()
            x = tensorshare.empty_shared((GIB // 4,), dtype=torch.float32, device="cuda").fill_(3)
            q.put(x)
            assert ack.get(timeout=LONG) == 3.0
            del x
            gc.collect()
            torch.cuda.synchronize()
            before_kill = torch.cuda.mem_get_info()[0]
            assert tensorshare.cuda_empty_cache() == 0  # the holder has it
            p.kill()
            p.join(LONG)
            given = tensorshare.cuda_empty_cache()
            assert given >= GIB, given
            after = torch.cuda.mem_get_info()[0]
            assert after - before_kill >= GIB, (before_kill, after)
            print("ok")
        """,
        "spawn",
    )


def cuda_peer_binary():
    """The example `cuda_peer` (feature `cuda`), built here if it is missing."""
    target = pathlib.Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    exe = target / "debug" / "examples" / "cuda_peer"
    if not exe.exists():
        subprocess.run(
            ["cargo", "build", "-q", "-p", "tensorshare", "--features", "cuda", "--example", "cuda_peer"],
            cwd=ROOT,
            check=True,
        )
    return str(exe)


def test_cuda_tensors_go_both_ways_between_rust_and_python(cuda, tmp_path):
    # A Rust process makes CUDA tensors (a view, f16, bool) that arrive as torch CUDA tensors
    # over its memory; Python's tensorshare CUDA tensors (a view, bf16) arrive in Rust over
    # Python's memory, and Rust's write into one is what Python then reads.
    run_case(
        tmp_path,
        """
        import gc

        import tensorshare

        if __name__ == "__main__":
            requests, answers = mp.Queue(), mp.Queue()
            peer = tensorshare.popen(["{exe}"], (requests, answers))
            try:
                requests.put("make")
                made = answers.get(timeout=LONG)
                x, column = made["x"], made["column"]
                assert x.is_cuda and x.dtype == torch.float32 and x.tolist() == [[1.5] * 3] * 2, x
                assert column.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
                assert column.stride() == (3,) and column.storage_offset() == 1
                assert column.tolist() == [1.5] * 2
                assert made["halves"].dtype == torch.float16 and made["halves"].tolist() == [0.5] * 4
                assert made["flags"].dtype == torch.bool and made["flags"].tolist() == [True] * 3
                del made, x, column
                gc.collect()

                y = tensorshare.empty_shared((2, 3), device="cuda")
                y.copy_(torch.arange(6.0).view(2, 3))
                bh = tensorshare.empty_shared(3, dtype=torch.bfloat16, device="cuda").fill_(0.25)
                requests.put({"check": {"x": y, "column": y[:, 2], "bhalves": bh}})
                found = answers.get(timeout=LONG)
                assert found == {
                    "devices": ["cuda:0"] * 3,
                    "x": [0.0, 1.0, 2.0, 3.0, 4.0, 5.0],
                    "column": [2.0, 5.0],
                    "column_strides": [3],
                    "one_allocation": True,
                    "bhalves": [0.25] * 3,
                }, found
                assert y.tolist() == [[9.0] * 3] * 2, y
            finally:
                requests.put(None)
            assert peer.wait(LONG) == 0
            print("ok")
        """.replace("{exe}", cuda_peer_binary()),
        "spawn",
    )


def test_the_simulated_devices_tensors_do_not_reach_torch():
    # The simulated CUDA device (for tests without a GPU) keeps its memory on the host:
    # handed to torch as CUDA memory, torch's kernels would run on host addresses.
    import_torch()
    out = run_python(
        """
        import tensorshare
        try:
            tensorshare.empty_shared((4,), device="cuda:0")
        except Exception as e:
            print(type(e).__name__, e)
        else:
            print("made")
        """,
        env={"TENSORSHARE_CUDA_DRIVER": "simulated"},
    )
    assert out.returncode == 0, out.stderr
    assert "simulated" in out.stdout and "do not become torch tensors" in out.stdout, out.stdout
