"""The native API: two processes over tcp, bad input, closing, signals,
asyncio."""

import asyncio
import mmap
import os
import signal
import threading
import time

import numpy as np
import pytest

import kvlane
from conftest import LEN, expected_sha, pattern


def test_write_and_read_between_two_processes_byte_checked_notifications_after_data(native_target):
    t = native_target.info
    mine = pattern(1)
    with kvlane.Agent(engine_id="init", backend="tcp", regions=[mine]) as agent:
        peer = agent.connect(t["addr"])
        assert peer.engine_id == "target"
        assert peer.remote_regions()[0]["nbytes"] == LEN
        base, rbase = mine.ctypes.data, t["buf"]

        # WRITE the first half of mine over the target's second half.
        h = peer.write_spans([(base, LEN // 2)], [(rbase + LEN // 2, LEN // 2)], notify=b"w1")
        assert h.wait(10) is True and h.status == "done" and h.done()
        tel = h.telemetry
        assert (tel.bytes, tel.descriptors) == (LEN // 2, 1) and tel.xfer_us > 0
        theirs = pattern(7)
        theirs[LEN // 2:] = mine[: LEN // 2]
        (note,) = native_target.ask({"op": "notes", "n": 1})["notes"]
        assert note == ["init", "w1", expected_sha(theirs)]

        # READ their first 64 KiB into my last 64 KiB, as an (N, 2) array.
        k = 64 << 10
        local = np.array([[base + LEN - k, k]], dtype=np.uint64)
        remote = np.array([[rbase, k]], dtype=np.uint64)
        h = peer.read_spans(local, remote, notify=b"r1")
        assert h.wait(10)
        assert (mine[LEN - k:] == pattern(7)[:k]).all()
        (note,) = native_target.ask({"op": "notes", "n": 1})["notes"]
        assert note[:2] == ["init", "r1"]
        assert native_target.ask({"op": "sha"})["sha"] == expected_sha(theirs)

        peer.notify(b"hello")
        (note,) = native_target.ask({"op": "notes", "n": 1})["notes"]
        assert note[:2] == ["init", "hello"]


def test_a_prepared_transfer_posts_again_with_the_bytes_of_each_post(native_target):
    t = native_target.info
    mine = pattern(1)
    with kvlane.Agent(engine_id="init", backend="tcp", regions=[mine]) as agent:
        peer = agent.connect(t["addr"])
        base, rbase = mine.ctypes.data, t["buf"]
        now_us = lambda: time.time_ns() // 1000  # noqa: E731
        prepared = now_us()
        p = peer.prepare_spans("WRITE", [(base, 4096)], [(rbase, 4096)])
        theirs = pattern(7)
        handles, calls = [], []
        for i in range(5):
            # Each post sends what the buffer holds then, under its own
            # handle: the plan is reused, not the transfer.
            mine[:4096] = i
            time.sleep(0.01)
            a = now_us()
            h = peer.post(p)
            calls.append((a, now_us()))
            assert h.wait(10) and h.status == "done"
            handles.append(h)
            theirs[:4096] = i
            assert native_target.ask({"op": "sha"})["sha"] == expected_sha(theirs), i
        assert len({id(h) for h in handles}) == 5
        tels = [h.telemetry for h in handles]
        assert all(t.bytes == 4096 for t in tels)
        # Wall-clock start times (1 ms of slack for the clocks' rounding):
        # the first post counts from its prepare, later ones from their
        # own post call, and the post time fits in what the caller saw.
        slack = 1000
        assert prepared - slack <= tels[0].start_time_us <= calls[0][0] + slack
        assert tels[0].post_us <= calls[0][1] - prepared + slack
        for (a, b), t in list(zip(calls, tels))[1:]:
            assert a - slack <= t.start_time_us <= b + slack, (a, b, t.start_time_us)
            assert t.post_us <= b - a + slack


def test_post_batch_posts_every_item_byte_checked_and_answers_each(native_target):
    t = native_target.info
    mine = pattern(1)
    k, n = 4096, 16
    with kvlane.Agent(engine_id="init", backend="tcp", regions=[mine]) as agent:
        peer = agent.connect(t["addr"])
        base, rbase = mine.ctypes.data, t["buf"]
        assert peer.post_batch([]) == []

        # n WRITEs of my blocks 0..n to their odd blocks; the last one
        # notifies, after its own data.
        writes = [peer.prepare_spans("WRITE", [(base + i * k, k)], [(rbase + (2 * i + 1) * k, k)],
                                     notify=b"batch" if i == n - 1 else None) for i in range(n)]
        hs = peer.post_batch(writes)
        assert len(hs) == n and len({id(h) for h in hs}) == n
        for h in hs:
            assert h.wait(10) and h.status == "done"
        assert all(h.telemetry.bytes == k for h in hs)
        theirs = pattern(7)
        for i in range(n):
            theirs[(2 * i + 1) * k:(2 * i + 2) * k] = mine[i * k:(i + 1) * k]
        (note,) = native_target.ask({"op": "notes", "n": 1})["notes"]
        assert note[:2] == ["init", "batch"]
        assert native_target.ask({"op": "sha"})["sha"] == expected_sha(theirs)

        # n READs of their even blocks into my blocks n..2n; the same
        # prepared transfer twice in one batch is two transfers.
        reads = [peer.prepare_spans("READ", [(base + (n + i) * k, k)], [(rbase + 2 * i * k, k)])
                 for i in range(n)]
        hs = peer.post_batch(reads + [reads[0]])
        assert len(hs) == n + 1
        assert all(h.wait(10) for h in hs)
        for i in range(n):
            assert (mine[(n + i) * k:(n + i + 1) * k] == theirs[2 * i * k:(2 * i + 1) * k]).all(), i

        # An item that is not a prepared transfer: named, nothing posted.
        mine[:k] = 0xAB
        with pytest.raises(kvlane.InvalidInputError, match="item 1 of the batch is a str"):
            peer.post_batch([writes[0], "not a transfer"])
        assert native_target.ask({"op": "sha"})["sha"] == expected_sha(theirs)

        # Refused transfers come back failed, each with its error.
        peer.disconnect()
        with pytest.raises(kvlane.PeerLostError):
            peer.post(writes[0])
        hs = peer.post_batch(writes[:3])
        assert [h.status for h in hs] == ["failed"] * 3
        for h in hs:
            assert isinstance(h.error(), kvlane.PeerLostError)
            with pytest.raises(kvlane.PeerLostError):
                h.wait(1)
        assert native_target.ask({"op": "sha"})["sha"] == expected_sha(theirs)
    with pytest.raises(kvlane.ClosedError):
        peer.post_batch(writes)


def _vma_fields(addr: int) -> dict:
    """The `/proc/self/smaps` fields of the mapping holding `addr`."""
    with open("/proc/self/smaps") as f:
        fields, inside = {}, False
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and line.split()[0].endswith(":"):
                fields[line.split()[0][:-1]] = line.split()[1]
    return fields


def test_host_buffer_is_aligned_zeroed_huge_page_memory_that_registers_zero_copy():
    for shared in (True, False):
        small = kvlane.host_buffer(4096, shared=shared)
        assert (small.dtype, small.shape, small.flags.writeable) == (np.uint8, (4096,), True)
        assert small.ctypes.data % 4096 == 0 and not small.any()
        for bad in (0, -1):
            with pytest.raises(kvlane.InvalidInputError, match="positive size"):
                kvlane.host_buffer(bad, shared=shared)
    n = 3 << 20
    assert not kvlane.host_buffer(n).any()
    # The private form: 2 MiB-aligned, advised to use huge pages.
    big = kvlane.host_buffer(n, shared=False)
    assert big.shape == (n,) and big.ctypes.data % (2 << 20) == 0 and not big.any()

    # Registered zero-copy: a WRITE from another agent lands in the array.
    src = np.arange(n, dtype=np.uint64).view(np.uint8)[:n]
    with kvlane.Agent(engine_id="dst", backend="tcp", regions=[big]) as dst, \
         kvlane.Agent(engine_id="src", backend="tcp", regions=[src]) as a:
        peer = a.connect(dst.addr)
        assert peer.write_spans([(src.ctypes.data, n)], [(big.ctypes.data, n)]).wait(10)
        assert (big == src).all()

    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        mode = f.read()
    if "[never]" in mode:
        pytest.skip(f"transparent huge pages are off here ({mode.strip()}): the advice has no effect")
    fields = _vma_fields(big.ctypes.data)
    assert fields.get("THPeligible") == "1", fields


def test_blocks_with_kv_layout_in_one_process():
    layout = kvlane.KvLayout(2, 16, 4096)
    a_kv = pattern(3, layout.required_len)
    b_kv = np.zeros(layout.required_len, dtype=np.uint8)
    with kvlane.Agent(engine_id="a", backend="tcp", kv=[(layout, a_kv)]) as a, \
         kvlane.Agent(engine_id="b", backend="tcp", kv=[(layout, b_kv)]) as b:
        peer = a.connect(b.addr)
        assert peer.write_blocks((0, 2), [0, 1, 2], [8, 9, 10], notify=b"req").wait(10)
        note = b.notifications().recv(10)
        assert (note.sender, note.payload) == ("a", b"req")
        for layer in range(2):
            for part in range(2):
                src, dst = layout.offset(layer, part, 0), layout.offset(layer, part, 8)
                assert (b_kv[dst:dst + 3 * 4096] == a_kv[src:src + 3 * 4096]).all()
        a_kv[:] = 0
        assert peer.read_blocks((0, 1), [5], [8]).wait(10)
        off = layout.offset(0, 0, 5)
        assert (a_kv[off:off + 4096] == b_kv[layout.offset(0, 0, 8):][:4096]).all()


def test_bytearray_and_mmap_register_zero_copy_and_await_works():
    ba = bytearray(b"x" * 8192)
    mm = mmap.mmap(-1, 8192)
    with kvlane.Agent(engine_id="a", backend="tcp", regions=[ba]) as a, \
         kvlane.Agent(engine_id="b", backend="tcp", regions=[mm]) as b:
        mem = kvlane.Memory(ba)
        assert mem.nbytes == 8192 and not mem.readonly
        peer = a.connect(b.addr)
        rb = peer.remote_regions()[0]["addr"]
        addr = np.frombuffer(ba, dtype=np.uint8).ctypes.data

        async def go():
            await peer.write_spans([(addr, 4096)], [(rb + 4096, 4096)])

        asyncio.run(go())
        assert mm[4096:8192] == b"x" * 4096
        with pytest.raises(BufferError):
            ba.extend(b"more")  # the registration holds the buffer in place


def test_bad_input_is_a_clear_exception_and_nothing_hangs():
    mine = pattern(1, 8192)
    ro = bytes(8192)  # read-only
    theirs = np.zeros(8192, dtype=np.uint8)
    a = kvlane.Agent(engine_id="a", backend="tcp", regions=[mine, ro])
    b = kvlane.Agent(engine_id="b", backend="tcp", regions=[theirs])
    peer = a.connect(b.addr)
    la, rb = mine.ctypes.data, theirs.ctypes.data
    ro_addr = kvlane.Memory(ro).addr

    with pytest.raises(kvlane.InvalidInputError, match="outside every local registration"):
        peer.write_spans([(la + 8000, 1000)], [(rb, 1000)])
    with pytest.raises(kvlane.InvalidInputError, match="advertised"):
        peer.write_spans([(la, 1000)], [(rb + 8000, 1000)])
    with pytest.raises(kvlane.InvalidInputError, match="span pair 0"):
        peer.write_spans([(la, 1000)], [(rb, 2000)])
    with pytest.raises(kvlane.InvalidInputError, match="pair one to one"):
        peer.write_spans([(la, 10), (la + 10, 10)], [(rb, 20)])
    with pytest.raises(kvlane.RefusedError, match="read-only"):
        peer.read_spans([(ro_addr, 100)], [(rb, 100)])
    assert kvlane.Memory(ro).readonly
    with pytest.raises(kvlane.InvalidInputError, match="8-byte integers"):
        peer.write_spans(np.zeros((1, 2), dtype=np.float32), [(rb, 1)])
    with pytest.raises(kvlane.InvalidInputError, match="backend is"):
        kvlane.Agent(backend="carrier-pigeon")
    # Host memory is never registered as GPU memory: no driver here
    # (Unsupported), or the driver says it is not device memory.
    with pytest.raises((kvlane.UnsupportedError, kvlane.InvalidInputError), match="cuda:0"):
        kvlane.Memory.unsafe_from_ptr(la, 16, "cuda")
    with pytest.raises(kvlane.Error):
        peer.write_blocks((0, 1), [0], [0])  # no KV cache registered

    h = peer.write_spans([(la, 100)], [(rb, 100)])
    assert h.wait(10)
    h.release()
    for call in (lambda: h.wait(1), h.done, lambda: h.status):
        with pytest.raises(kvlane.InvalidInputError, match="released"):
            call()

    a.close()
    a.close()  # idempotent
    assert a.closed
    with pytest.raises(kvlane.ClosedError):
        a.connect(b.addr)
    with pytest.raises(kvlane.ClosedError):
        peer.write_spans([(la, 100)], [(rb, 100)])
    with pytest.raises(kvlane.ClosedError):
        peer.notify(b"x")
    assert a.notifications().recv(0.1) is None
    b.close()
    assert issubclass(kvlane.StaleError, kvlane.PeerLostError)
    assert issubclass(kvlane.TimeoutError, kvlane.Error)


def test_ctrl_c_interrupts_a_wait():
    # A process started in the background by a non-interactive shell
    # inherits SIGINT ignored, and Python then installs no handler: put
    # Python's own back, so the signal reaches the wait however we run.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with kvlane.Agent(engine_id="a", backend="tcp") as a:
            threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
            start = time.monotonic()
            with pytest.raises(KeyboardInterrupt):
                # Bounded, so a lost signal fails the test instead of
                # hanging it; nothing else would end this wait.
                a.notifications().recv(30)
            assert time.monotonic() - start < 5
    finally:
        signal.signal(signal.SIGINT, previous)


def test_peer_killed_mid_transfer_fails_with_peer_lost_within_the_liveness_budget(make_target):
    size = 64 << 20
    target = make_target("native", size)
    t = target.info
    mine = np.zeros(size, dtype=np.uint8)
    with kvlane.Agent(engine_id="init", backend="tcp", regions=[mine],
                      keepalive_interval=0.2, liveness_budget=3) as agent:
        peer = agent.connect(t["addr"])
        events = agent.events()
        handles = [peer.read_spans([(mine.ctypes.data, size)], [(t["buf"], size)]) for _ in range(8)]
        target.proc.kill()
        target.proc.wait()
        start = time.monotonic()
        errors = []
        for h in handles:
            try:
                h.wait(20)
            except kvlane.PeerLostError as e:
                errors.append(e)
        assert errors, "some transfer was in flight when the peer died"
        assert all(h.done() for h in handles)
        assert time.monotonic() - start < 5
        # Later transfers fail at once, and the peer is reported dead.
        with pytest.raises(kvlane.PeerLostError):
            peer.read_spans([(mine.ctypes.data, 10)], [(t["buf"], 10)]).wait(10)
        kinds = set()
        while "dead" not in kinds and time.monotonic() - start < 10:
            ev = events.recv(0.5)
            if ev is not None:
                kinds.add(ev.kind)
        assert "dead" in kinds


def test_notifications_and_peer_events_as_sync_and_async_iterators():
    a_mem, b_mem = bytearray(4096), bytearray(4096)
    with kvlane.Agent(engine_id="a", backend="tcp", regions=[a_mem]) as a, \
         kvlane.Agent(engine_id="b", backend="tcp", regions=[b_mem]) as b:
        events = a.events()
        peer = a.connect(b.addr)
        ev = events.recv(10)
        assert (ev.kind, ev.detail) == ("up", "b")
        peer.notify(b"one")
        assert next(iter(b.notifications())).payload == b"one"

        async def first_two():
            got = []
            async for note in b.notifications():
                got.append(note.payload)
                if len(got) == 2:
                    return got

        peer.notify(b"two")
        peer.notify(b"three")
        assert asyncio.run(asyncio.wait_for(first_two(), 10)) == [b"two", b"three"]
        peer.disconnect()
        kinds = {e.kind for e in iter(lambda: events.recv(1), None)}
        assert "closed" in kinds
    assert list(b.notifications()) == []  # closed: iteration ends

    async def after_close():
        return [n async for n in b.notifications()]

    assert asyncio.run(after_close()) == []


def test_psk_authenticates_and_a_wrong_key_is_refused():
    with kvlane.Agent(engine_id="a", backend="tcp", psk=b"secret") as a, \
         kvlane.Agent(engine_id="b", backend="tcp", psk=b"secret") as b, \
         kvlane.Agent(engine_id="c", backend="tcp", psk=b"other") as c:
        assert a.connect(b.addr).engine_id == "b"
        start = time.monotonic()
        with pytest.raises(kvlane.RefusedError, match="pre-shared key"):
            c.connect(b.addr)
        assert time.monotonic() - start < 30


def test_the_readme_python_quick_start_runs_as_written():
    readme = os.path.join(os.path.dirname(__file__), "..", "..", "..", "README.md")
    with open(readme) as f:
        text = f.read()
    section = text.split("## Quick start (Python)", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert "kvlane.Agent" in code and "host_buffer" in code
    exec(compile(code, "README.md (Quick start, Python)", "exec"), {"__name__": "readme"})


def test_transfer_deadline_fails_a_longer_transfer_with_timeout_and_bad_seconds_are_refused():
    for kw in ({"transfer_deadline": 0}, {"transfer_deadline": -1.0}, {"keepalive_interval": -1.0},
               {"transfer_deadline": float("nan")}):
        name = next(iter(kw))
        with pytest.raises(kvlane.InvalidInputError, match=f"{name} is a positive number of seconds"):
            kvlane.Agent(backend="tcp", **kw)
    n = 256 << 20  # tens of milliseconds over tcp at least; the deadline is 1 ms
    src, dst = kvlane.host_buffer(n), kvlane.host_buffer(n)
    with kvlane.Agent(engine_id="dst", backend="tcp", regions=[dst]) as b, \
         kvlane.Agent(engine_id="src", backend="tcp", regions=[src], transfer_deadline=0.001) as a:
        peer = a.connect(b.addr)
        h = peer.write_spans([(src.ctypes.data, n)], [(dst.ctypes.data, n)])
        with pytest.raises(kvlane.TimeoutError):
            h.wait(10)
        assert h.status == "failed"


def test_waits_take_endless_timeouts_and_an_endless_deadline_is_clamped():
    # inf and 1e300 seconds are "no end" (not a panic past the clock's
    # range); a deadline of 1e19 s is clamped to a day (every transfer ends).
    n = 4096
    src, dst = kvlane.host_buffer(n), kvlane.host_buffer(n)
    src[:] = 7
    with kvlane.Agent(engine_id="dst", backend="tcp", regions=[dst]) as b, \
         kvlane.Agent(engine_id="src", backend="tcp", regions=[src], transfer_deadline=1e19) as a:
        notes = b.notifications()
        peer = a.connect(b.addr)
        h = peer.write_spans([(src.ctypes.data, n)], [(dst.ctypes.data, n)], notify=b"landed")
        assert h.wait(float("inf")) is True
        assert h.wait(1e300) is True
        note = notes.recv(float("inf"))
        assert (note.sender, note.payload) == ("src", b"landed")
        assert notes.recv(-1.0) is None
        assert (dst == 7).all()


def test_release_while_another_thread_waits_is_no_borrow_error():
    # release() takes the handle away from later calls; a wait already in
    # progress in another thread finishes (it was a RuntimeError "Already
    # borrowed" from PyO3 before).
    import threading
    n = 256 << 20
    src, dst = kvlane.host_buffer(n), kvlane.host_buffer(n)
    raced = 0
    with kvlane.Agent(engine_id="dst", backend="tcp", regions=[dst]) as b, \
         kvlane.Agent(engine_id="src", backend="tcp", regions=[src]) as a:
        peer = a.connect(b.addr)
        for _ in range(5):
            h = peer.write_spans([(src.ctypes.data, n)], [(dst.ctypes.data, n)])
            out, started = [], threading.Event()

            def waiter():
                started.set()
                out.append(h.wait(60))

            t = threading.Thread(target=waiter)
            t.start()
            started.wait()
            time.sleep(0.02)
            raced += not h.done()
            h.release()
            t.join(90)
            assert out == [True]
            with pytest.raises(kvlane.InvalidInputError, match="released"):
                h.done()
    assert raced > 0, "every transfer ended before its release: the race was never run"
