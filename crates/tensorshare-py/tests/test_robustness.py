"""What tensorshare promises Python users beyond torch: O(arenas) descriptors, nothing
left in /dev/shm after SIGKILL, and a clear MemoryError (never a bus error) when shared
memory is full. Each case runs in a Python process of its own."""

import gc
import os
import select
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest

from conftest import (
    LONG,
    STRATEGIES,
    import_torch,
    mapped_at,
    named_segments,
    needs_moves_into_arenas,
    reap,
    run_python,
)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_ten_thousand_live_tensors_under_a_limit_of_256_descriptors(strategy):
    if strategy == "file_descriptor":
        needs_moves_into_arenas("storages that cost no descriptor each under file_descriptor")
    import_torch()
    out = run_python(
        f"""
        import os, resource
        import torch
        import tensorshare.multiprocessing as mp

        def produce(q, n):
            for i in range(n):
                q.put(torch.full((4,), float(i)))
            q.put(None)

        if __name__ == "__main__":
            resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
            mp.set_sharing_strategy("{strategy}")
            ctx = mp.get_context("fork")
            q = ctx.Queue(maxsize=64)
            p = ctx.Process(target=produce, args=(q, 10_000))
            p.start()
            kept = []
            while (t := q.get(timeout=120)) is not None:
                kept.append(t)
            p.join(60)
            assert p.exitcode == 0, p.exitcode
            assert len(kept) == 10_000
            assert all(float(t[0]) == i for i, t in enumerate(kept))
            print("fds", len(os.listdir("/proc/self/fd")))
        """
    )
    assert out.returncode == 0, out.stderr
    fds = int(out.stdout.split("fds")[1])
    assert fds < 64, f"{fds} descriptors open for 10,000 live tensors"


def _wait_for_exit(pids, timeout=10.0):
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        try:
            ready, _, _ = select.select([fd], [], [], timeout)
            assert ready, f"process {pid} still runs after {timeout} s"
        finally:
            os.close(fd)


@pytest.mark.parametrize("victim", ["producer", "consumer"])
def test_sigkill_mid_stream_leaves_nothing_in_dev_shm(victim):
    import_torch()
    # The scenario founds a cleanup group of its own (root: its pid), kills one side
    # mid-stream, and prints the pids of its children (the cleaner among them) before it
    # exits; once they are gone, no file of the group may be left.
    env = {"TENSORSHARE_SHM_GROUP": ""}
    out = run_python(
        f"""
        import os, signal
        import torch
        import tensorshare.multiprocessing as mp

        def produce(q, ready):
            ready.put("go")
            i = 0
            while True:
                q.put(torch.full((1 << 14,), float(i)))
                i += 1

        def consume(q, ready):
            for _ in range(20):
                q.get(timeout=60)
            ready.put("consumed")
            while True:
                q.get(timeout=60)

        if __name__ == "__main__":
            mp.set_sharing_strategy("file_system")
            # A named block here first: this process founds the group, whose root it is.
            first = torch.ones(4)
            mp.Queue().put(first)
            ctx = mp.get_context("fork")
            q, ready = ctx.Queue(maxsize=8), ctx.SimpleQueue()
            producer = ctx.Process(target=produce, args=(q, ready))
            consumer = ctx.Process(target=consume, args=(q, ready))
            producer.start()
            consumer.start()
            assert ready.get() == "go" and ready.get() == "consumed"
            during = [n for n in os.listdir("/dev/shm") if n.startswith(f"tensorshare_{{os.getpid()}}_")]
            print("during", len(during))
            victim = producer if "{victim}" == "producer" else consumer
            os.kill(victim.pid, signal.SIGKILL)
            victim.join(30)
            for p in (producer, consumer):
                p.kill()
                p.join(30)
            children = set()
            for tid in os.listdir("/proc/self/task"):
                with open(f"/proc/self/task/{{tid}}/children") as f:
                    children.update(int(c) for c in f.read().split())
            print("root", os.getpid(), "children", *sorted(children))
        """,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    words = out.stdout.split()
    assert int(words[words.index("during") + 1]) > 0, "the scenario made no named segment"
    root = int(words[words.index("root") + 1])
    _wait_for_exit([int(w) for w in words[words.index("children") + 1 :]])
    assert named_segments(root) == []


def test_a_named_segment_cut_short_by_a_peer_reads_as_zeros_not_a_bus_error():
    needs_moves_into_arenas("a tensor moved into a named arena")
    # A named file cannot be sealed: here its creator cuts it to half under a receiver that
    # uses the default strategy. Both keep running: the cut pages read as zeros, the rest
    # stays shared. faulthandler is enabled first, as pytest and
    # `python -X faulthandler` do: it must never see the fault.
    import_torch()
    out = run_python(
        """
        import faulthandler, os
        faulthandler.enable()
        import torch
        import tensorshare.multiprocessing as mp

        def consume(q, ready, go):
            mp.set_sharing_strategy("file_descriptor")
            t = q.get(timeout=60)
            ready.put("mapped")
            while go.get() != "stop":
                ready.put((float(t.sum()), int((t == 0).sum())))

        if __name__ == "__main__":
            mp.set_sharing_strategy("file_system")
            ctx = mp.get_context("fork")
            q, ready, go = ctx.Queue(), ctx.Queue(), ctx.SimpleQueue()
            p = ctx.Process(target=consume, args=(q, ready, go), daemon=True)
            p.start()
            n = 1 << 20
            t = torch.ones(n)
            q.put(t)
            assert ready.get(timeout=60) == "mapped"
            mine = [
                n for n in os.listdir("/dev/shm")
                if n.startswith(f"tensorshare_{os.getpid()}_") and not n.endswith("_group")
            ]
            assert mine, "no named segment"
            page = os.sysconf("SC_PAGE_SIZE")
            for name in mine:
                with open(f"/dev/shm/{name}", "r+b") as f:
                    f.truncate(os.fstat(f.fileno()).st_size // 2 // page * page)
            go.put("read")
            total, zeros = ready.get(timeout=60)
            assert 0 < zeros < n and total == n - zeros, (total, zeros)
            assert int((t == 0).sum()) == zeros, "the creator reads the same zeros"
            t.fill_(5.0)
            go.put("read")
            assert ready.get(timeout=60) == (5.0 * (n - zeros), zeros), "the rest is still shared"
            go.put("stop")
            p.join(60)
            print("exitcode", p.exitcode)
        """,
        env={"TENSORSHARE_SHM_GROUP": ""},
    )
    assert out.returncode == 0, out.stderr
    assert "exitcode 0" in out.stdout, out.stdout + out.stderr


def test_with_the_sigbus_handler_turned_off_a_cut_named_segment_is_a_bus_error():
    # TENSORSHARE_SIGBUS_HANDLER=0 keeps tensorshare's signal handling out of the process:
    # a cut named segment is then what it is in torch.
    import_torch()
    out = run_python(
        """
        import os
        import torch
        import tensorshare
        import tensorshare.multiprocessing as mp

        mp.set_sharing_strategy("file_system")
        t = tensorshare.empty_shared((1 << 20,), torch.float32)
        t.fill_(1.0)
        for n in os.listdir("/dev/shm"):
            if n.startswith(f"tensorshare_{os.getpid()}_") and not n.endswith("_group"):
                os.truncate(f"/dev/shm/{n}", 0)
        print("sum", float(t.sum()), flush=True)
        """,
        env={"TENSORSHARE_SHM_GROUP": "", "TENSORSHARE_SIGBUS_HANDLER": "0"},
    )
    assert out.returncode == -signal.SIGBUS, (out.returncode, out.stdout, out.stderr)
    assert "sum" not in out.stdout


@pytest.mark.parametrize("context", ["tensorshare", "torch"])
def test_a_dataloader_worker_reading_a_cut_named_segment_is_not_killed(context):
    # torch's DataLoader workers install a SIGBUS handler of their own, which would take the
    # place of tensorshare's; tensorshare's goes back on top of it in the workers of its own
    # context, and, once tensorshare.multiprocessing is imported, in fork workers of torch's.
    import_torch()
    out = run_python(
        f"""
        import os
        import torch
        import tensorshare
        import tensorshare.multiprocessing as mp
        from torch.utils.data import DataLoader, Dataset

        mp.set_sharing_strategy("file_system")
        big = tensorshare.empty_shared((1 << 20,), torch.float32)
        big.fill_(1.0)
        files = [
            f"/dev/shm/{{n}}" for n in os.listdir("/dev/shm")
            if n.startswith(f"tensorshare_{{os.getpid()}}_") and not n.endswith("_group")
        ]
        assert files

        class Cut(Dataset):
            def __len__(self):
                return 2

            def __getitem__(self, i):
                if i == 0:
                    for f in files:
                        os.truncate(f, 0)
                return float(big.sum())

        ctx = mp.get_context("fork") if "{context}" == "tensorshare" else "fork"
        loader = DataLoader(Cut(), num_workers=1, multiprocessing_context=ctx, batch_size=None)
        print("got", [x for x in loader])
        """,
        env={"TENSORSHARE_SHM_GROUP": ""},
    )
    assert out.returncode == 0, out.stderr
    assert "got [0.0, 0.0]" in out.stdout, out.stdout + out.stderr


def run_in_small_dev_shm(mib, script):
    """Runs `script` in a mount namespace whose /dev/shm is a tmpfs of `mib` MiB (a
    container's is 64), from this directory; skips where that cannot be mounted."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip(f"mounting a {mib} MiB tmpfs over /dev/shm needs root and unshare")
    cmd = [
        "unshare",
        "-m",
        "sh",
        "-c",
        f'mount -t tmpfs -o size={mib}m tmpfs /dev/shm && cd "$2" && exec "$0" -c "$1"',
        os.sys.executable,
        script,
        os.getcwd(),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if out.returncode != 0 and (
        ("mount" in out.stderr and "permission" in out.stderr.lower()) or "unshare failed" in out.stderr
    ):
        pytest.skip(f"cannot mount a tmpfs here: {out.stderr.strip()}")
    return out


def test_a_full_dev_shm_is_a_memory_error_not_a_bus_error():
    needs_moves_into_arenas("tensorshare's MemoryError where torch raises its own")
    import_torch()
    script = """
import torch
import tensorshare
import tensorshare.multiprocessing as mp

mp.set_sharing_strategy("file_system")
try:
    tensorshare.empty_shared((4 << 20,), torch.uint8)
except MemoryError as e:
    print("empty_shared:", e)
q = mp.Queue()
try:
    q.put(torch.ones(1 << 20))
except MemoryError as e:
    print("put:", e)
mp.set_sharing_strategy("file_descriptor")
q.put(torch.ones(1 << 20))
print("memfd:", float(q.get().sum()))
"""
    out = run_in_small_dev_shm(1, script)
    assert out.returncode == 0, out.stderr
    assert "empty_shared:" in out.stdout and "put:" in out.stdout, out.stdout
    print(out.stdout)
    assert "memfd: 1048576.0" in out.stdout


def test_free_arenas_give_their_room_in_dev_shm_back_when_it_is_needed_or_asked_for():
    needs_moves_into_arenas("tensors moved into arenas by share_memory_()")
    # In a 16 MiB /dev/shm, under file_system: of 10 MiB of small tensors shared and dropped,
    # this process keeps arenas of at most a 16th of /dev/shm for reuse, letting the rest go
    # as the tensors go. A tensor that does not fit takes the room of free arenas kept (the
    # allocator lets them go before it gives up), and trim_arenas() gives all of it back for
    # a worker, which has no other way to reach it.
    import_torch()
    script = """
import gc, os
import torch
import tensorshare
import tensorshare.multiprocessing as mp

def free_mib():
    s = os.statvfs("/dev/shm")
    return s.f_bavail * s.f_frsize / 2**20

def big(i):
    return torch.full((3 << 20,), float(i))  # 12 MiB, made in the worker

def fill_and_drop():
    xs = [torch.full((64 << 10,), float(i)).share_memory_() for i in range(40)]
    del xs
    gc.collect()
    return free_mib()

if __name__ == "__main__":
    torch.set_num_threads(1)
    mp.set_sharing_strategy("file_system")
    print("free after dropping:", fill_and_drop() > 14)
    x = torch.ones(1 << 18).share_memory_()  # 1 MiB: another size class
    print("1 MiB shared:", x.is_shared() and float(x.sum()) == float(1 << 18))
    y = torch.ones(3 << 20).share_memory_()  # 12 MiB: an arena of its own
    print("12 MiB shared:", y.is_shared())
    del x, y
    print("dropped again:", fill_and_drop() > 14)
    print("trimmed:", tensorshare.trim_arenas() > 0, free_mib() > 15)
    with mp.get_context("fork").Pool(1) as pool:
        print("worker's 12 MiB:", [float(t[0]) for t in pool.map(big, [7])])
"""
    out = run_in_small_dev_shm(16, script)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.splitlines() == [
        "free after dropping: True",
        "1 MiB shared: True",
        "12 MiB shared: True",
        "dropped again: True",
        "trimmed: True True",
        "worker's 12 MiB: [7.0]",
    ], out.stdout + out.stderr


def test_a_data_loader_runs_its_epoch_in_a_small_dev_shm_under_file_system():
    # Two workers make batches of samples from 128 KiB to 1 MiB in a 16 MiB /dev/shm (torch's
    # own workers finish this epoch down to 10 MiB, and so does this). Each process keeps to
    # its share of that room: arenas of a 64th of it, free ones beyond a 16th let go, and a
    # receiver keeps mapped no more than a 16th, and none that its creator let go. Before,
    # the workers' size classes grew arenas up to 8 MiB and the epoch died part way.
    import_torch()
    script = """
import torch
import torch.utils.data as tud
import tensorshare.multiprocessing as mp

class Samples(tud.Dataset):
    def __len__(self):
        return 512
    def __getitem__(self, i):
        return torch.full((1 << (15 + i % 4),), float(i))  # 128 KiB to 1 MiB

def collate(samples):
    return [s.clone() for s in samples]  # one storage per sample

if __name__ == "__main__":
    torch.set_num_threads(1)
    mp.set_sharing_strategy("file_system")
    loader = tud.DataLoader(Samples(), batch_size=4, num_workers=2, prefetch_factor=2,
                            collate_fn=collate, multiprocessing_context=mp.get_context("fork"))
    seen = []
    for batch in loader:
        assert all(s.is_shared() for s in batch)
        seen += [(float(s[0]), float(s[-1]), s.numel()) for s in batch]
    print(seen == [(float(i), float(i), 1 << (15 + i % 4)) for i in range(512)])
"""
    out = run_in_small_dev_shm(16, script)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.splitlines() == ["True"], out.stdout + out.stderr


def test_a_mapping_beyond_the_address_space_limit_is_a_memory_error():
    # Under `ulimit -v`, an arena that cannot be mapped is a MemoryError naming the address
    # space, as any allocation that finds no room is, not an OSError; nothing is left behind,
    # and sharing works again once the limit allows it.
    import_torch()
    out = run_python(
        """
        import resource
        import torch
        import tensorshare
        import tensorshare.multiprocessing as mp

        for strategy in ["file_descriptor", "file_system"]:
            mp.set_sharing_strategy(strategy)
            tensorshare.empty_shared((1024,), torch.float32)  # the arenas' bookkeeping is made
            vm = int(next(l.split()[1] for l in open("/proc/self/status") if l.startswith("VmSize:"))) << 10
            soft, hard = resource.getrlimit(resource.RLIMIT_AS)
            resource.setrlimit(resource.RLIMIT_AS, (vm + (64 << 20), hard))
            try:
                tensorshare.empty_shared((64 << 20,), torch.float32)  # 256 MiB
                print(strategy, "no error")
            except MemoryError as e:
                print(strategy, "MemoryError", "ulimit -v" in str(e))
            finally:
                resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
            t = tensorshare.empty_shared((64 << 20,), torch.float32)
            print(strategy, "after:", t.numel() == 64 << 20)
        """
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.splitlines() == [
        "file_descriptor MemoryError True",
        "file_descriptor after: True",
        "file_system MemoryError True",
        "file_system after: True",
    ], out.stdout + out.stderr


def test_a_receiver_out_of_descriptors_is_told_of_its_descriptor_limit_and_loses_nothing():
    needs_moves_into_arenas("receives that cost no descriptor per storage")
    # Each 9 MiB tensor comes in an arena of its own, which the receiver holds through a
    # descriptor of its own: under a limit of 64 descriptors, keeping them all runs out. The
    # error names the limit, not a missing /proc, and comes before a message is taken: once
    # the receiver lets its tensors go, every value arrives, each once.
    import_torch()
    out = run_python(
        """
        import resource
        import torch
        import tensorshare.multiprocessing as mp

        def produce(q, n):
            torch.set_num_threads(1)
            for i in range(n):
                q.put(torch.full(((9 << 20) // 8,), float(i), dtype=torch.float64))
            q.put(None)

        if __name__ == "__main__":
            ctx = mp.get_context("fork")
            q = ctx.Queue(maxsize=4)
            p = ctx.Process(target=produce, args=(q, 80))
            p.start()
            resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
            kept, got = [], []
            while True:
                try:
                    t = q.get(timeout=60)
                except OSError as e:
                    print("refused:", e)
                    kept.clear()
                    continue
                if t is None:
                    break
                kept.append(t)
                got.append(int(t[0]))
            p.join()
            print("got:", sorted(got) == list(range(80)), len(got))
        """,
        timeout=LONG * 2,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    refusals = [line for line in out.stdout.splitlines() if line.startswith("refused:")]
    assert refusals, out.stdout + out.stderr
    assert all("RLIMIT_NOFILE" in line and "/proc" not in line for line in refusals), refusals
    assert "got: True 80" in out.stdout, out.stdout + out.stderr


def test_a_message_lost_at_the_descriptor_limit_says_so():
    needs_moves_into_arenas("receives that cost no descriptor per storage")
    # Each message brings 6 arenas new to the receiver: 12 descriptors at once, more than the
    # reserve kept for finishing a message. Some are lost at the limit; every value either
    # arrives or an error says that its message is lost (or its descriptors were cut off),
    # and refusals say that no message was taken.
    import_torch()
    out = run_python(
        """
        import resource
        import torch
        import tensorshare.multiprocessing as mp

        def produce(q, n):
            torch.set_num_threads(1)
            for i in range(n):
                q.put([torch.full(((9 << 20) // 8,), float(i), dtype=torch.float64) for _ in range(6)])
            q.put(None)

        if __name__ == "__main__":
            ctx = mp.get_context("fork")
            q = ctx.Queue(maxsize=2)
            p = ctx.Process(target=produce, args=(q, 30))
            p.start()
            resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
            kept, got, lost, refused, other = [], 0, 0, 0, []
            while True:
                try:
                    m = q.get(timeout=60)
                except OSError as e:
                    if "none was taken" in str(e):
                        refused += 1
                    elif "is lost" in str(e) or "cut off" in str(e):
                        lost += 1
                    else:
                        other.append(str(e))
                    del kept[: max(1, len(kept) // 2)]
                    continue
                if m is None:
                    break
                kept.append(m)
                got += 1
            p.join()
            print("accounted:", got + lost == 30, "other errors:", other)
        """,
        timeout=LONG * 2,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "accounted: True other errors: []" in out.stdout, out.stdout + out.stderr


def test_receives_go_on_where_memfds_cannot_be_made():
    # A seccomp filter (as some sandboxes have) refuses memfd_create: no descriptors can be
    # kept in reserve, and receives go on without, as they did before there was one.
    if os.uname().machine != "x86_64":
        pytest.skip("the filter names x86_64's system call number")
    out = run_python(
        """
        import ctypes, os, struct
        import tensorshare.multiprocessing as mp

        def deny_memfd_create():
            libc = ctypes.CDLL(None, use_errno=True)
            # Load the system call number; memfd_create (319): EPERM; anything else: allow.
            code = [(0x20, 0, 0, 0), (0x15, 0, 1, 319), (0x06, 0, 0, 0x00050001), (0x06, 0, 0, 0x7FFF0000)]
            insns = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *c) for c in code))
            prog = ctypes.create_string_buffer(struct.pack("HxxxxxxQ", len(code), ctypes.addressof(insns)))
            assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
            args = [ctypes.c_ulong(a) for a in (2, ctypes.addressof(prog), 0, 0)]
            assert libc.prctl(22, *args) == 0  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER

        if __name__ == "__main__":
            mp.set_sharing_strategy("file_system")
            q = mp.get_context("fork").Queue()
            for i in range(3):
                q.put(i)
            deny_memfd_create()
            try:
                os.memfd_create("probe")
                print("memfd_create still allowed")
            except PermissionError:
                pass
            print([q.get(timeout=30) for _ in range(3)])
        """
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.splitlines() == ["[0, 1, 2]"], out.stdout + out.stderr


def test_torch_storage_methods_swapped_in_its_c_type_are_refused_not_followed():
    # A program can rewrite the dict of torch's C type itself (through gc.get_referents of
    # its mappingproxy): here StorageBase.data_ptr becomes nbytes, so a copy that trusted
    # the name would read from address 1024. The descriptors are checked by name and owner
    # when first looked up, and the send is refused with a clear error instead.
    import_torch()
    out = run_python(
        """
        import gc
        import torch
        d = gc.get_referents(torch._C.StorageBase.__dict__)[0]
        d["data_ptr"] = d["nbytes"]
        import tensorshare
        try:
            tensorshare.roundtrip(torch.ones(256))
        except RuntimeError as e:
            print("refused:", e)
        """
    )
    assert out.returncode == 0, out.stderr
    assert "refused: torch._C.StorageBase.data_ptr is not its C method" in out.stdout, out.stdout


def test_a_meta_tensor_reaching_a_process_without_torch_is_an_error_not_a_crash(tmp_path):
    # Where torch cannot be imported a tensor arrives as a numpy array; a meta tensor has no
    # bytes, and an array over its empty block would have viewed memory at a dangling address.
    torch = import_torch()
    from tensorshare import _native

    data, fds, _parcel = _native.export(torch.empty(1 << 20, device="meta"))
    assert not fds
    path = tmp_path / "message"
    path.write_bytes(data)
    out = run_python(
        f"""
        import sys

        class NoTorch:
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ModuleNotFoundError("No module named 'torch'")

        sys.meta_path.insert(0, NoTorch())
        from tensorshare import _native
        try:
            a = _native.import_(open({str(path)!r}, "rb").read(), [])
            print("got", a.shape, a.sum())
        except ValueError as e:
            print("refused:", e)
        """
    )
    assert out.returncode == 0, out.stderr
    assert "refused: a meta tensor of shape [1048576] has no data" in out.stdout, out.stdout


def test_a_message_naming_a_meta_array_is_an_error_not_a_crash():
    # No sender makes a meta numpy array; a hostile one can, by changing a meta tensor's tag
    # in the message (byte 7: 9 is a tensor, 10 an array).
    import_torch()
    out = run_python(
        """
        import torch
        from tensorshare import _native

        data, fds, _parcel = _native.export(torch.empty(1 << 20, device="meta"))
        data = bytearray(data)
        assert data[7] == 9, bytes(data[:16])
        data[7] = 10
        try:
            a = _native.import_(bytes(data), [])
            print("got", a.shape, a.sum())
        except ValueError as e:
            print("refused:", e)
        # The Python half checks too: no array of elements over an empty block.
        from tensorshare import _reduction
        try:
            empty = _native.empty_block(0)
            a = _reduction.rebuild(True, empty, "float32", (1 << 20,), (1,), 0, False, False, "cpu")
            print("got", a.shape, a.sum())
        except ValueError as e:
            print("refused too:", e)
        """
    )
    assert out.returncode == 0, out.stderr
    assert "refused: a meta tensor of shape [1048576] has no data" in out.stdout, out.stdout
    assert "refused too: an array of shape (1048576,) over an empty block" in out.stdout, out.stdout


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_spawned_and_forkserver_children_join_the_parents_cleanup_group(method):
    needs_moves_into_arenas("a tensor moved into a named arena by share_memory_()")
    # A child started by spawn or the fork server does not have its parent's environment:
    # it is told the parent's cleanup group, and its named segments belong to it (one group,
    # one cleaner for the whole job, not one per child).
    import_torch()
    out = run_python(
        f"""
        import os
        import torch
        import tensorshare.multiprocessing as mp
        from tensorshare import _native

        def work(q):
            mp.set_sharing_strategy("file_system")
            t = torch.ones(10).share_memory_()
            me = os.getpid()
            mine = [n for n in os.listdir("/dev/shm") if n.startswith("tensorshare_") and f"_{{me}}_" in n]
            q.put((os.environ.get("TENSORSHARE_SHM_GROUP"), mine, t))

        if __name__ == "__main__":
            mp.set_sharing_strategy("file_system")
            base = torch.ones(10).share_memory_()
            root = _native.shm_group_for_workers()
            ctx = mp.get_context("{method}")
            q = ctx.Queue()
            ps = [ctx.Process(target=work, args=(q,)) for _ in range(2)]
            for p in ps:
                p.start()
            got = [q.get(timeout=60) for _ in ps]
            for p in ps:
                p.join(60)
            for group, mine, t in got:
                assert group == str(root), (group, root)
                assert mine and all(n.startswith(f"tensorshare_{{root}}_") for n in mine), (mine, root)
                assert float(t.sum()) == 10.0
            print("exitcodes", [p.exitcode for p in ps])
        """,
        env={"TENSORSHARE_SHM_GROUP": ""},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "exitcodes [0, 0]" in out.stdout, out.stdout + out.stderr


def test_a_fork_child_removes_the_names_of_what_it_made_as_it_leaves():
    # A fork child ends in os._exit, which runs no exit handler: the names of the named
    # segments it made go as it leaves, while the job runs on; what it sent stays readable.
    import_torch()
    out = run_python(
        """
        import os
        import torch
        import tensorshare.multiprocessing as mp

        def work(q):
            mp.set_sharing_strategy("file_system")
            q.put((os.getpid(), torch.full((1 << 16,), 3.0).share_memory_()))

        if __name__ == "__main__":
            mp.set_sharing_strategy("file_system")
            base = torch.ones(10).share_memory_()  # the parent's group, which the child is in
            ctx = mp.get_context("fork")
            q = ctx.Queue()
            p = ctx.Process(target=work, args=(q,))
            p.start()
            pid, t = q.get(timeout=60)
            p.join(60)
            names = [n for n in os.listdir("/dev/shm") if n.startswith("tensorshare_")]
            left = [n for n in names if n.split("_")[2:3] == [str(pid)]]
            assert left == [], left
            assert float(t.sum()) == 3.0 * (1 << 16)
            print("exitcode", p.exitcode)
        """,
        env={"TENSORSHARE_SHM_GROUP": ""},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "exitcode 0" in out.stdout, out.stdout + out.stderr


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_child_whose_main_module_shares_on_import_joins_the_parents_group(method, tmp_path):
    needs_moves_into_arenas("a tensor moved into a named arena by share_memory_()")
    # A spawn or fork server child imports the main module before it reads its process
    # state: a named segment made at import must already belong to the parent's group.
    import_torch()
    script = tmp_path / "main_shares_on_import.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import os
            import torch
            import tensorshare.multiprocessing as mp

            mp.set_sharing_strategy("file_system")
            AT_IMPORT = torch.ones(10).share_memory_()


            def work(q):
                names = [n for n in os.listdir("/dev/shm") if n.startswith("tensorshare_")]
                q.put([n for n in names if n.split("_")[2:3] == [str(os.getpid())]])


            if __name__ == "__main__":
                from tensorshare import _native

                ctx = mp.get_context("{method}")
                q = ctx.Queue()
                p = ctx.Process(target=work, args=(q,))
                p.start()
                mine = q.get(timeout=60)
                p.join(60)
                root = _native.shm_group_for_workers()
                assert mine and all(n.startswith(f"tensorshare_{{root}}_") for n in mine), (mine, root)
                print("exitcode", p.exitcode)
            """
        )
    )
    env = dict(os.environ, TENSORSHARE_SHM_GROUP="")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "exitcode 0" in out.stdout, out.stdout + out.stderr


def _report_after(go, tensors, results):
    go.wait(LONG)
    # Read through numpy: a torch reduction this large runs on OpenMP's threads, which a
    # child forked after its parent used them waits for for good (in torch too).
    results.put([(float(t.numpy().min()), float(t.numpy().max())) for t in tensors])


def test_fork_children_keep_tensors_their_parent_dropped_and_allocated_over(strategy):
    """Workers forked each with a shared buffer of its own (torch's pattern of a buffer per
    worker, the loop's variable rebound, so the parent keeps none): the parent's next shared
    tensors of that size must not take their memory while the workers read it."""
    torch = import_torch()
    import tensorshare.multiprocessing as mp

    ctx = mp.get_context("fork")
    go, results = ctx.Event(), ctx.Queue()
    procs = []
    try:
        for rank in range(3):
            buf = torch.full((4096,), float(rank)).share_memory_()
            procs.append(ctx.Process(target=_report_after, args=(go, [buf], results)))
            procs[-1].start()
        del buf
        others = [torch.full((4096,), -1.0).share_memory_() for _ in range(100)]
        go.set()
        got = sorted(results.get(timeout=LONG)[0] for _ in procs)
    finally:
        go.set()
        for p in procs:
            reap(p)
    assert got == [(float(r), float(r)) for r in range(3)], "a worker's buffer was written over"
    assert all(p.exitcode == 0 for p in procs)
    del others


_INHERITED = []


def _drop_what_was_inherited(dropped, done):
    _INHERITED.clear()
    gc.collect()
    dropped.set()
    done.wait(LONG)


def test_a_fork_child_that_drops_what_it_inherited_gives_its_memory_back(strategy):
    """A fork worker that drops the shared tensors it inherited no longer holds their memory
    while it lives on: the parent, having dropped them too, hands that memory out again (it
    used to stay held until the worker's first shared allocation, or its end)."""
    needs_moves_into_arenas("arena slots handed out again")
    torch = import_torch()
    import tensorshare.multiprocessing as mp

    ctx = mp.get_context("fork")
    dropped, done = ctx.Event(), ctx.Event()
    # 1 MiB each: the size class's first arena has 8 slots, soon come round to again.
    _INHERITED[:] = [torch.full((1 << 18,), 5.0).share_memory_() for _ in range(2)]
    at = {t.untyped_storage().data_ptr() for t in _INHERITED}
    p = ctx.Process(target=_drop_what_was_inherited, args=(dropped, done))
    p.start()
    try:
        assert dropped.wait(LONG)
        _INHERITED.clear()
        gc.collect()
        others = [torch.empty(1 << 18).share_memory_() for _ in range(32)]
        reused = at & {t.untyped_storage().data_ptr() for t in others}
    finally:
        done.set()
        reap(p)
    assert p.exitcode == 0
    assert reused == at, "memory the worker no longer had stayed held for it while it lived"


def _fork_a_reader_then_drop(q, dropped, allocated, results):
    import tensorshare.multiprocessing as mp

    tensors = q.get(timeout=LONG)
    q.get(timeout=LONG)  # a second message: the first one's holds are settled by now
    reader = mp.get_context("fork").Process(target=_report_after, args=(allocated, tensors, results))
    reader.start()
    del tensors
    gc.collect()
    dropped.set()
    reap(reader)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_fork_child_of_a_receiver_keeps_what_the_receiver_dropped(method):
    """A process that received tensors forks a child that reads them, then drops its own:
    the creator, which dropped its own too, must not hand their memory out again while the
    child reads it (the receiver's locks are on a description the child shares, so the
    receiver's unlock would have let them go for both)."""
    torch = import_torch()
    import tensorshare.multiprocessing as mp

    ctx = mp.get_context(method)
    q, results = ctx.Queue(), ctx.Queue()
    dropped, allocated = ctx.Event(), ctx.Event()
    middle = ctx.Process(target=_fork_a_reader_then_drop, args=(q, dropped, allocated, results))
    middle.start()
    try:
        # 1 MiB each: the size class's arenas have 8 slots, soon come round to again.
        tensors = [torch.full((1 << 18,), 5.0) for _ in range(8)]
        q.put(tensors)
        q.put("settle")
        assert dropped.wait(LONG)
        del tensors
        others = [torch.full((1 << 18,), -1.0).share_memory_() for _ in range(40)]
        allocated.set()
        got = results.get(timeout=LONG)
    finally:
        allocated.set()
        reap(middle)
    assert got == [(5.0, 5.0)] * 8, "the child's tensors were written over"
    assert middle.exitcode == 0
    del others


def _send_back_a_view(t, q, received):
    q.put(t[2:6])
    received.wait(LONG)


def test_a_fork_child_sends_a_view_of_a_tensor_it_inherited_shared():
    """A fork child sends back a view of a tensor its parent shared before the fork (a shared
    model's parameter, a dataset): it arrives as a view of the parent's own memory, as in
    torch, whose arena record the child cannot use (it is its parent's)."""
    torch = import_torch()
    import tensorshare.multiprocessing as mp

    ctx = mp.get_context("fork")
    q, received = ctx.Queue(), ctx.Event()
    t = torch.arange(8.0).share_memory_()
    p = ctx.Process(target=_send_back_a_view, args=(t, q, received))
    p.start()
    try:
        view = q.get(timeout=LONG)
        received.set()
    finally:
        received.set()
        reap(p)
    assert p.exitcode == 0
    assert view.tolist() == [2.0, 3.0, 4.0, 5.0]
    view.fill_(-1.0)
    assert t.tolist() == [0.0, 1.0, -1.0, -1.0, -1.0, -1.0, 6.0, 7.0], "the view is no view of t"


def test_inherited_reads_a_handed_value_and_names_a_descriptor_that_is_not_open(monkeypatch):
    import numpy as np

    import tensorshare
    from tensorshare import _native

    value = {"a": np.arange(4.0), "s": "x"}
    data, fds, parcel = _native.export(value)
    mine = [os.dup(fd) for fd in fds]  # what a child started by popen inherits
    del parcel
    monkeypatch.setenv("TS_TEST_HANDOFF", data.hex() + ":" + ",".join(map(str, mine)))
    got = tensorshare.inherited("TS_TEST_HANDOFF")
    assert got["s"] == "x"
    np.testing.assert_array_equal(got["a"], value["a"])
    for fd in mine:  # inherited closed them
        with pytest.raises(OSError):
            os.fstat(fd)
    # A descriptor that is not open: the error names it (it used to be a bare EBADF from
    # closing it afterwards).
    monkeypatch.setenv("TS_TEST_HANDOFF", data.hex() + ":" + str(mine[0]))
    with pytest.raises(OSError, match="of a value sent to this process"):
        tensorshare.inherited("TS_TEST_HANDOFF")
    # A text that is not one (no parent wrote it) leaves the descriptors it names alone.
    keep = os.dup(1)
    try:
        for text in (f"zz:{keep}", f"{data.hex()}:{keep},x", f"@y:{keep}"):
            monkeypatch.setenv("TS_TEST_HANDOFF", text)
            with pytest.raises(ValueError):
                tensorshare.inherited("TS_TEST_HANDOFF")
            os.fstat(keep)  # still open
    finally:
        os.close(keep)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_child_of_os_fork_sends_through_torchs_queue_what_it_made_not_its_parents(strategy):
    # multiprocessing's descriptor sharer (torch's queues pass descriptors through it) is
    # reset only in processes multiprocessing starts: a child of os.fork handed out the
    # descriptors its parent registered, and the receiver read another tensor's memory.
    import_torch()
    out = run_python(
        f"""
        import os
        import torch
        import tensorshare
        import torch.multiprocessing as tmp

        tmp.set_sharing_strategy("{strategy}")
        ctx = tmp.get_context("fork")
        q, sq = ctx.SimpleQueue(), ctx.SimpleQueue()
        a = tensorshare.share_memory_(torch.full((10,), 1.0))
        q.put(a)
        q.get()  # the parent's sharer runs now, and has handed out one descriptor
        r, w = os.pipe()
        r2, w2 = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.read(r, 1)
                sq.put(tensorshare.share_memory_(torch.full((10,), 3.0)))
                os.read(r2, 1)  # stays until the parent has it
            finally:
                os._exit(0)
        d = tensorshare.share_memory_(torch.full((10,), 7.0))
        q.put(d)  # the parent registers its next descriptor
        os.write(w, b"g")
        c = sq.get()
        os.write(w2, b"g")
        c.fill_(-5.0)
        print("got", c.tolist()[0], "a", a.tolist()[0], "d", d.tolist()[0], "own", q.get().tolist()[0])
        os.waitpid(pid, 0)
        """,
        timeout=LONG,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "got -5.0 a 1.0 d 7.0 own 7.0" in out.stdout, out.stdout + out.stderr


def _add_one_to_each(tensors):
    for t in tensors:
        t += 1.0


def _descriptors_of_file_mapped_at(address):
    """How many descriptors of this process are open on the file mapped at ``address``."""
    parts = mapped_at(address)
    assert parts is not None, f"nothing is mapped at {address:#x}"
    major, minor = (int(x, 16) for x in parts[3].split(":"))
    file = (os.makedev(major, minor), int(parts[4]))
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            st = os.stat(int(fd))
            if (st.st_dev, st.st_ino) == file:
                count += 1
        except OSError:
            pass  # the listing's own descriptor, closed by now
    return count


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_started_process_leaves_no_descriptor_of_its_arguments_in_its_parent(method):
    needs_moves_into_arenas("tensors moved into arenas by share_memory_()")
    # torch's own Process (multiprocessing's) with arena tensors in its arguments: their
    # descriptors were kept open in the parent as long as the Process object (one per storage
    # and process), though the child has its own once it is started.
    torch = import_torch()
    import torch.multiprocessing as tmp

    from tensorshare import _native

    ctx = tmp.get_context(method)
    tensors = [torch.zeros(16).share_memory_() for _ in range(5)]  # into blocks
    address = tensors[0].untyped_storage().data_ptr()
    assert all(_native.find_block(t.untyped_storage().data_ptr()) is not None for t in tensors)
    processes, held = [], []
    try:
        for _ in range(3):
            p = ctx.Process(target=_add_one_to_each, args=(tensors,))
            p.start()
            processes.append(p)
            reap(p)
            assert p.exitcode == 0
            held.append(_descriptors_of_file_mapped_at(address))
    finally:
        for p in processes:
            reap(p)
    # The first start may leave the description that sends are made from (shared by the
    # messages of a while, then replaced); nothing more for each process started.
    assert held[1:] == held[:1] * 2, f"descriptors of the arena after each start: {held}"
    assert [t[0].item() for t in tensors] == [3.0] * 5, "a child wrote no block the parent sees"


def test_under_torchs_file_system_strategy_a_shared_tensor_stays_where_numpy_sees_it():
    needs_moves_into_arenas("a tensor moved into an arena by tensorshare.share_memory_")
    # A tensor shared before it is viewed from numpy stays in that memory when torch's own
    # queue sends it, under either strategy, as in plain torch, which never moves a shared
    # storage again. A version that let torch move an arena storage at put under
    # file_system left the array on the freed slot, which the next tensors were handed.
    torch = import_torch()
    import torch.multiprocessing as tmp

    import tensorshare
    from tensorshare import _native

    before = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_system")
    try:
        q = tmp.get_context("fork").SimpleQueue()
        t = tensorshare.share_memory_(torch.zeros(1024))
        a = t.numpy()
        block = _native.find_block(t.untyped_storage().data_ptr())
        assert block is not None, "tensorshare.share_memory_ put it in a block"
        assert t.share_memory_() is t and t.is_shared(), "torch's share_memory_() left it there"
        q.put(t)
        got = q.get()
        assert _native.find_block(t.untyped_storage().data_ptr()) is block, "the storage moved"
        a[0] = 3.0
        assert (t[0].item(), got[0].item()) == (3.0, 3.0), "the tensor left the memory numpy sees"
        others = [tensorshare.share_memory_(torch.full((1024,), 7.0)) for _ in range(20)]
        a[1] = 5.0
        assert all(o[1].item() == 7.0 for o in others), "numpy wrote into another tensor"
    finally:
        tmp.set_sharing_strategy(before)


def test_under_torchs_file_system_strategy_torchs_queues_work_as_without_tensorshare():
    needs_moves_into_arenas("a tensor moved into an arena by tensorshare.share_memory_")
    # torch's file_system strategy lets a sender exit right after its put, and a Pool's
    # worker end after each task. With tensorshare imported, share_memory_() put storages
    # in arenas, which torch's queues send by descriptor, fetched from the sender: the
    # receiver's get failed (FileNotFoundError) once the sender had gone, and a Pool with
    # maxtasksperchild=1 lost its results. share_memory_() is torch's under that strategy.
    import_torch()
    out = run_python(
        """
        import torch
        import torch.multiprocessing as tmp
        import tensorshare

        def send_and_exit(q):
            t = torch.arange(10.0)
            t.share_memory_()
            q.put(t)
            q.close()
            q.join_thread()  # written out: the child leaves now

        def shared(i):
            return torch.full((100,), float(i)).share_memory_()

        if __name__ == "__main__":
            tmp.set_sharing_strategy("file_system")
            ctx = tmp.get_context("fork")
            q = ctx.Queue()
            p = ctx.Process(target=send_and_exit, args=(q,))
            p.start()
            p.join()
            print("after exit", q.get(timeout=60).sum().item())
            with ctx.Pool(2, maxtasksperchild=1) as pool:
                print("pool", [t[0].item() for t in pool.map_async(shared, range(6)).get(timeout=60)])
            # Made with tensorshare, a tensor is in a block under either strategy.
            t = tensorshare.share_memory_(torch.zeros(4))
            print("block", tensorshare._native.find_block(t.untyped_storage().data_ptr()) is not None)
        """,
        timeout=LONG * 2,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.split("\n")[:3] == [
        "after exit 45.0",
        "pool [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]",
        "block True",
    ], out.stdout + out.stderr


def test_popen_hands_a_value_too_large_for_the_environment_and_keeps_the_env_it_is_given():
    # Linux caps one environment string at 128 KiB: a value of 10,000 file names failed to
    # start ("Argument list too long", naming the program). And env={} was taken for no env.
    import subprocess

    import tensorshare
    import tensorshare.multiprocessing as mp

    child = (
        "import os, tensorshare; text = os.environ.get('TENSORSHARE_HANDOFF', ''); "
        "fd = int(text[1:].split(':')[0]) if text.startswith('@') else None\n"
        "try:\n    sealed = fd is not None and os.pwrite(fd, b'x', 0) < 0\n"
        "except PermissionError:\n    sealed = True\n"
        "q, paths = tensorshare.inherited(); "
        "q.put((len(paths), paths[-1], sorted(os.environ), sealed))"
    )
    q = mp.Queue()
    paths = [f"/data/train/{i:08}.jpeg" for i in range(10_000)]
    for env in (None, {"ONLY": "1"}, {}):
        proc = tensorshare.popen([sys.executable, "-c", child], (q, paths), env=env)
        try:
            n, last, names, sealed = q.get(timeout=LONG)
            assert proc.wait(LONG) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert (n, last, sealed) == (
            10_000,
            "/data/train/00009999.jpeg",
            True,
        )  # sealed: siblings read the same
        if env is not None:
            assert set(names) - {"LC_CTYPE"} == set(env), names  # CPython may set LC_CTYPE
    small = tensorshare.popen([sys.executable, "-c", child], (q, ["one"]), env={}, stdout=subprocess.DEVNULL)
    assert q.get(timeout=LONG)[:2] == (1, "one")
    assert small.wait(LONG) == 0


def test_a_message_naming_a_storage_it_lacks_says_so_once():
    # The reason was prefixed twice: "invalid message: invalid message: storage 5 ...".
    torch = import_torch()
    import tensorshare
    from tensorshare import _native

    data, fds, _ = _native.export(tensorshare.empty_shared((2,), torch.float32))
    data = bytes(data)
    at = data.index(bytes.fromhex("0900000801"))  # a Tensor, a handle of storage 0, float32
    bad = data[:at] + bytes.fromhex("090005") + data[at + 3 :]
    fd = os.dup(fds[0])
    try:
        with pytest.raises(_native.InvalidMessage) as e:
            _native.import_(bad, [fd])
    finally:
        os.close(fd)
    assert str(e.value) == "invalid message: storage 5 is not in the message's table of 1"


STARTS_IN_TWO_THREADS_AT_ONCE = """
    import os, threading, multiprocessing.context
    import torch
    import tensorshare.multiprocessing as mp
    from tensorshare import _native

    def report(q):
        # The environment the child was started with (as its main module's import saw it).
        with open("/proc/self/environ", "rb") as f:
            start = dict(v.split(b"=", 1) for v in f.read().split(b"\\0") if b"=" in v)
        q.put(start.get(b"TENSORSHARE_SHM_GROUP", b"").decode())

    if __name__ == "__main__":
        mp.set_sharing_strategy("file_system")
        base = torch.ones(4).share_memory_()  # founds this process's group
        group = str(_native.shm_group_for_workers())
        both_in, a_done = threading.Barrier(2), threading.Event()
        original = multiprocessing.context.SpawnProcess._Popen

        def popen(process_obj):
            both_in.wait(60)  # both starts are inside their window
            if threading.current_thread().name == "b":
                a_done.wait(60)  # and a's start is over before b's child is made
            return original(process_obj)

        multiprocessing.context.SpawnProcess._Popen = staticmethod(popen)
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        ps = {n: ctx.Process(target=report, args=(q,)) for n in "ab"}
        def start(n):
            ps[n].start()
            if n == "a":
                a_done.set()
        ts = [threading.Thread(target=start, args=(n,), name=n) for n in "ab"]
        for t in ts: t.start()
        for t in ts: t.join()
        multiprocessing.context.SpawnProcess._Popen = staticmethod(original)
        got = sorted([q.get(timeout=60), q.get(timeout=60)], key=str)
        for p in ps.values(): p.join(60)
        print(got == [group, group], repr(os.environ.get("TENSORSHARE_SHM_GROUP")))
"""


def test_children_started_by_two_threads_at_once_each_start_in_the_group_which_then_leaves_the_environment():
    # The group was put in the environment for the length of each start and then given
    # back, with no regard for other threads (spawn's TORCH_MP_PARALLEL_START starts from a
    # thread pool): one start's end took it away while another's child was being made
    # (which then made its named segments outside the group at import), and that other
    # start gave back what it had found, the group, which stayed in the environment of every
    # later subprocess.
    import_torch()
    out = run_python(STARTS_IN_TWO_THREADS_AT_ONCE, timeout=3 * LONG, env={"TENSORSHARE_SHM_GROUP": ""})
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.split("\n")[0] == "True ''", out.stdout
