"""The buffer pool: bounded, resident, reference-counted leases; pieces of one value."""

from __future__ import annotations

import threading

import pytest

from kvstore.buffers import BufferPool, Pieces, borrow, footprint
from kvstore.errors import ConfigError


def test_a_released_buffer_is_reused_not_reallocated():
    pool = BufferPool(8 << 20)
    a = pool.lease(3 << 20)
    assert a is not None and len(a.view) == 3 << 20
    a.view[:4] = b"abcd"
    a.release()
    b = pool.lease((3 << 20) - 100)  # a little smaller: the same buffer fits
    assert b is not None and bytes(b.view[:4]) == b"abcd"
    assert pool.stats()["allocations"] == 1
    b.release()
    assert pool.stats()["leased_bytes"] == 0


def test_the_budget_bounds_what_is_held_and_a_full_pool_says_none():
    pool = BufferPool(4 << 20)
    a = pool.lease(3 << 20)
    assert a is not None
    assert pool.lease(3 << 20) is None  # no room, no wait: a miss, counted
    assert pool.stats()["misses"] == 1 and pool.stats()["held_bytes"] <= 4 << 20
    a.release()
    small = [pool.lease(1 << 20) for _ in range(4)]  # the free 3 MiB buffer is dropped to make room
    assert all(s is not None for s in small) and pool.stats()["held_bytes"] <= 4 << 20
    for s in small:
        s.release()


def test_a_pool_of_the_footprints_holds_those_leases_at_once():
    assert [footprint(n) for n in (0, 1, 1 << 16, (1 << 16) + 1)] == [1 << 16, 1 << 16, 1 << 16, 2 << 16]
    sizes = [(3 << 20) + 17, 100, 1 << 20, (5 << 20) - 1]
    pool = BufferPool(sum(map(footprint, sizes)))
    leases = [pool.lease(n) for n in sizes]
    assert all(lease is not None for lease in leases) and pool.lease(1) is None
    assert pool.stats()["held_bytes"] == pool.max_bytes


def test_a_waiting_lease_gets_a_buffer_when_one_is_released():
    pool = BufferPool(2 << 20)
    a = pool.lease(2 << 20)
    threading.Timer(0.05, a.release).start()
    b = pool.lease(2 << 20, wait=5)
    assert b is not None
    b.release()


def test_leases_are_reference_counted():
    pool = BufferPool(2 << 20)
    a = pool.lease(1 << 20)
    a.retain()
    a.release()
    assert pool.stats()["leased_bytes"] > 0  # one holder left
    a.release()
    assert pool.stats()["leased_bytes"] == 0
    with pytest.raises(RuntimeError):
        a.release()
    with pytest.raises(RuntimeError):
        a.retain()


def test_an_oversize_lease_is_served_outside_the_budget():
    pool = BufferPool(1 << 20)
    big = pool.lease(3 << 20)
    assert big is not None and pool.stats()["oversize"] == 1 and pool.stats()["held_bytes"] == 0
    big.release()


def test_borrowed_leases_and_pieces():
    value = b"0123456789"
    lease = borrow(value)
    assert bytes(lease.view) == value and lease.nbytes == 10
    lease.release()
    lease.release()  # a borrowed lease's release does nothing
    pool = BufferPool(1 << 20)
    owner = pool.lease(4)
    owner.view[:] = b"tail"
    pieces = Pieces([b"head", memoryview(bytearray(b"-")), owner.view], owner=owner)
    assert len(pieces) == 9 and pieces.tobytes() == b"head-tail"
    out = bytearray(12)
    pieces.copy_into(memoryview(out))
    assert bytes(out[:9]) == b"head-tail"
    pieces.retain().release()
    pieces.release()
    assert pool.stats()["leased_bytes"] == 0


class _XorSeal:
    """A one-byte trailer: the XOR of every byte after the first part; counts its passes."""

    nbytes = 1
    first = 1

    def __init__(self):
        self.passes = 0
        self.slices = []

    def start(self):
        self.passes += 1
        seal = self

        class Sealing:
            acc = 0

            def update(self, data):
                seal.slices.append(len(data))
                for b in bytes(data):
                    self.acc ^= b

            def finish(self):
                return bytes([self.acc])

        return Sealing()


def test_a_sealed_value_computes_its_trailer_as_it_streams():
    body = bytes(range(1, 251)) * 40  # 10,000 bytes
    expected = 0
    for b in body:
        expected ^= b
    seal = _XorSeal()
    pieces = Pieces([b"head", body], seal=seal)
    assert len(pieces) == 4 + len(body) + 1  # the trailer's size is known before any pass
    streamed = list(pieces.stream(slice_bytes=4096))
    assert [len(p) for p in streamed] == [4, 4096, 4096, 1808, 1]  # the header is not fed to the seal
    assert seal.slices == [4096, 4096, 1808]
    assert b"".join(bytes(p) for p in streamed) == b"head" + body + bytes([expected])
    assert pieces.trailer() == bytes([expected]) and pieces.parts[-1] == bytes([expected])
    assert pieces.tobytes() == b"head" + body + bytes([expected])
    assert seal.passes == 1  # once known, the trailer is not computed again


def test_an_abandoned_stream_leaves_the_trailer_to_a_fresh_pass():
    seal = _XorSeal()
    pieces = Pieces([b"h", b"abc", b"def"], seal=seal)
    stream = pieces.stream(slice_bytes=2)
    next(stream), next(stream)  # a send that failed half way
    stream.close()
    out = bytearray(len(pieces))
    pieces.copy_into(memoryview(out))  # the retry
    assert bytes(out) == b"habcdef" + bytes([ord("a") ^ ord("b") ^ ord("c") ^ ord("d") ^ ord("e") ^ ord("f")])
    assert seal.passes == 2


def test_bad_budget_is_a_config_error():
    with pytest.raises(ConfigError, match="max_bytes"):
        BufferPool(10)


def test_write_all_resumes_partial_vectored_writes_and_refuses_a_write_of_nothing():
    from kvstore.buffers import IOV_MAX, write_all

    parts = [bytes([i % 256]) * (i % 7 + 1) for i in range(IOV_MAX * 2 + 5)]
    out = bytearray()
    calls = []

    def write(views):  # takes at most 10 bytes a call, as a full socket buffer would
        calls.append(len(views))
        data = b"".join(bytes(v) for v in views)[:10]
        out.extend(data)
        return len(data)

    write_all(write, [memoryview(p) for p in parts])
    assert bytes(out) == b"".join(parts) and max(calls) <= IOV_MAX
    with pytest.raises(OSError, match="moved 0 bytes"):
        write_all(lambda views: 0, [memoryview(b"x")])


def test_a_slow_registration_holds_up_no_other_lease_or_release():
    """A new buffer is registered with the accelerator (milliseconds of driver time on a GPU)
    outside the pool's lock: meanwhile a free buffer is leased and a lease released; a failed
    allocation gives its reserved budget back."""
    from kvstore.testing.pinner import CountingPinner

    class SlowPinner(CountingPinner):
        def __init__(self) -> None:
            super().__init__()
            self.entered, self.go = threading.Event(), threading.Event()
            self.slow = False

        def pin(self, array, *, read_only=False):
            if self.slow:
                self.entered.set()
                assert self.go.wait(10)
            return super().pin(array, read_only=read_only)

    pinner = SlowPinner()
    pool = BufferPool(1 << 20, pin=pinner)
    warm = pool.lease(4096)
    held = pool.lease(4096)
    warm.release()
    pinner.slow = True
    got = []
    slow = threading.Thread(target=lambda: got.append(pool.lease(256 << 10)))  # no free buffer fits
    slow.start()
    assert pinner.entered.wait(10)
    quick = pool.lease(4096)  # the free buffer, while the other lease's registration runs
    assert quick is not None and quick.pinned
    held.release()
    quick.release()
    pinner.go.set()
    slow.join(10)
    assert got[0] is not None and got[0].pinned and pool.stats()["leased_bytes"] == footprint(256 << 10)
    got[0].release()

    class Failing(CountingPinner):
        def pin(self, array, *, read_only=False):
            raise MemoryError("no room")

    pool = BufferPool(1 << 20, pin=Failing())
    with pytest.raises(MemoryError):
        pool.lease(4096)
    assert pool.stats()["held_bytes"] == 0 and pool.stats()["leased_bytes"] == 0


def test_a_hash_releases_the_gil_while_it_runs():
    """``xxh3_digest`` (every load's and save's hash) lets other Python threads run meanwhile, in
    any xxhash release (the one-shot function held the GIL before 4.0): a thread that sleeps
    briefly wakes on time while another hashes 256 MiB at a time, instead of waiting for each
    hash to end."""
    import statistics
    import sys
    import time

    import numpy as np

    from kvstore.buffers import xxh3_digest

    big = memoryview(np.ones(256 << 20, dtype=np.uint8))
    start = time.perf_counter()
    xxh3_digest(big)
    one = time.perf_counter() - start
    stop = threading.Event()

    def hashing() -> None:
        while not stop.is_set():
            xxh3_digest(big)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.0005)  # what kvstore's adapters set; the GIL changes hands promptly
    late: list[float] = []
    thread = threading.Thread(target=hashing)
    try:
        thread.start()
        time.sleep(one / 2)
        while len(late) < 25:
            t = time.perf_counter()
            time.sleep(0.001)
            late.append(time.perf_counter() - t - 0.001)
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)
    # Held, a wake-up would wait for the rest of a hash: half of one on average (seen: 0.1 ms
    # late here, against 22 ms beside a copy of the same bytes that holds the GIL).
    assert statistics.median(late) < one / 6, (statistics.median(late), one)


def test_a_pools_dropped_buffers_end_their_registrations_off_the_leasing_thread():
    """A lease that drops a free registered buffer to make room returns without waiting for the
    registration to end (a driver call that may wait for the device): it ends on the unpin thread,
    the memory kept until it has."""
    import time

    from kvstore.pinned import flush_unpins
    from kvstore.testing.pinner import SlowPinner

    pinner = SlowPinner(unpin_s=0.5)
    pool = BufferPool(1 << 20, pin=pinner)
    pool.lease(512 << 10).release()  # a free registered buffer of 512 KiB
    lease = pool.lease(768 << 10)  # too large for it, and no room beside it: the free one is dropped
    returned = time.perf_counter()
    assert lease is not None and lease.pinned
    assert flush_unpins(10)
    assert [name for name, _, _ in pinner.unpins] == ["kvstore-unpin"]
    assert returned < pinner.unpins[0][2]  # the lease did not wait for the unregistration
    lease.release()
    del lease  # its view held the buffer too
    pool.clear()  # the last free buffer: its registration ends on the unpin thread too
    assert flush_unpins(10) and pinner.stats()["unpinned"] == 2
    assert {name for name, _, _ in pinner.unpins} == {"kvstore-unpin"}
