"""The shared-memory broadcast ring, with readers in separate interpreters.

Reader processes run this very file as a script (see `_reader_main`), the way
workers are fresh interpreters: the ring must work across processes, keep
order, never overwrite unread slots, and cost nothing while idle.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
import time
from multiprocessing import resource_tracker

import msgspec
import pytest

from asyncllm.procutil import private_ipc_dir, remove_dir
from asyncllm.workers.shm_broadcast import BroadcastReader, BroadcastWriter, RingHandle

SLOT_BYTES = 4096


def _messages(seed: int, count: int) -> list[bytes]:
    """Deterministic payloads, about one in eight larger than a slot (overflow path)."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        size = rng.randint(SLOT_BYTES + 1, 3 * SLOT_BYTES) if rng.random() < 0.125 else rng.randint(0, SLOT_BYTES)
        out.append(i.to_bytes(4, "little") + rng.randbytes(size))
    return out


def _reader_main(argv: list[str]) -> None:
    """Reader process: read `count` messages, compare with the expected ones, print a JSON report."""
    handle = msgspec.json.decode(argv[0], type=RingHandle)
    index, seed, count, mode = int(argv[1]), int(argv[2]), int(argv[3]), argv[4]
    reader = BroadcastReader(handle, index)
    print("attached", flush=True)
    if mode == "wait-go":
        sys.stdin.readline()
    expected = _messages(seed, count)
    digest = hashlib.sha256()
    mismatches = 0
    for want in expected:
        got = reader.dequeue(timeout=30)
        digest.update(got)
        mismatches += got != want
    reader.close()
    print(json.dumps({"mismatches": mismatches, "sha256": digest.hexdigest()}), flush=True)


def _start_reader(handle: RingHandle, index: int, seed: int, count: int, mode: str = "run") -> subprocess.Popen:
    args = [msgspec.json.encode(handle).decode(), str(index), str(seed), str(count), mode]
    proc = subprocess.Popen(
        [sys.executable, __file__, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "attached", proc.stderr.read() if proc.stderr else ""
    return proc


def _report(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "resource_tracker" not in err and "leaked" not in err, err
    return json.loads(out.strip().splitlines()[-1])


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.fixture
def ipc_dir():
    path = private_ipc_dir()
    yield path
    remove_dir(path)


def _writer(ipc_dir: str, num_readers: int, num_slots: int = 8) -> BroadcastWriter:
    return BroadcastWriter(num_readers, f"ipc://{ipc_dir}/ring", num_slots=num_slots, slot_bytes=SLOT_BYTES)


def test_two_readers_receive_1000_messages_in_order(ipc_dir):
    count, seed = 1000, 7
    messages = _messages(seed, count)
    assert sum(len(m) > SLOT_BYTES for m in messages) > 50  # the overflow path is exercised
    writer = _writer(ipc_dir, num_readers=2)
    readers = [_start_reader(writer.handle, i, seed, count) for i in range(2)]
    writer.wait_for_readers(timeout=10)
    for payload in messages:
        writer.enqueue(payload, timeout=30)
    want = hashlib.sha256(b"".join(messages)).hexdigest()
    for proc in readers:
        assert _report(proc) == {"mismatches": 0, "sha256": want}
    writer.close()


def test_writer_blocks_instead_of_overwriting_unread_slot(ipc_dir):
    num_slots, seed = 4, 11
    messages = _messages(seed, num_slots + 3)
    writer = _writer(ipc_dir, num_readers=1, num_slots=num_slots)
    proc = _start_reader(writer.handle, 0, seed, len(messages), mode="wait-go")
    writer.wait_for_readers(timeout=10)
    for payload in messages[:num_slots]:
        writer.enqueue(payload, timeout=1)
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        writer.enqueue(messages[num_slots], timeout=0.3)
    assert time.monotonic() - start >= 0.3
    assert proc.stdin is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()
    for payload in messages[num_slots:]:
        writer.enqueue(payload, timeout=10)
    assert _report(proc) == {"mismatches": 0, "sha256": hashlib.sha256(b"".join(messages)).hexdigest()}
    writer.close()


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs Linux /proc")
def test_idle_reader_uses_little_cpu_and_wakes_on_doorbell(ipc_dir):
    seed = 3
    messages = _messages(seed, 2)
    writer = _writer(ipc_dir, num_readers=1)
    proc = _start_reader(writer.handle, 0, seed, len(messages))
    writer.wait_for_readers(timeout=10)
    writer.enqueue(messages[0], timeout=5)
    time.sleep(0.2)  # past the spin window: the reader now sleeps on its doorbell
    before = _cpu_seconds(proc.pid)
    time.sleep(1.0)
    idle_cpu = _cpu_seconds(proc.pid) - before
    assert idle_cpu < 0.2
    writer.enqueue(messages[1], timeout=5)
    assert _report(proc)["mismatches"] == 0
    writer.close()


def _shm_exists(name: str) -> bool:
    return os.path.exists(f"/dev/shm/{name}")


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs Linux /dev/shm")
def test_segment_is_unlinked_once_readers_attached_and_readers_leave_it_alone(ipc_dir):
    writer = _writer(ipc_dir, num_readers=1)
    name = writer.handle.shm_name
    assert _shm_exists(name)
    proc = _start_reader(writer.handle, 0, seed=5, count=2)
    writer.wait_for_readers(timeout=10)
    assert not _shm_exists(name)  # mapped by both sides: the name is no longer needed
    for payload in _messages(5, 2):
        writer.enqueue(payload, timeout=5)
    assert _report(proc)["mismatches"] == 0  # the reader exited without unlinking or warning
    writer.close()
    writer.close()  # idempotent


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs Linux /dev/shm")
def test_close_unlinks_a_segment_no_reader_joined(ipc_dir):
    writer = _writer(ipc_dir, num_readers=2)
    name = writer.handle.shm_name
    writer.close()
    assert not _shm_exists(name)


def test_wait_for_readers_times_out_without_readers(ipc_dir):
    writer = _writer(ipc_dir, num_readers=2)
    with pytest.raises(TimeoutError, match="0 of 2 ring readers attached"):
        writer.wait_for_readers(timeout=0.1)
    writer.close()


if __name__ == "__main__":
    _reader_main(sys.argv[1:])


def test_has_message_tells_whether_dequeue_would_return_at_once(ipc_dir):
    writer = _writer(ipc_dir, num_readers=1, num_slots=2)
    reader = BroadcastReader(writer.handle, 0)
    try:
        writer.wait_for_readers(timeout=10)
        assert not reader.has_message()
        writer.enqueue(b"one", timeout=5)
        writer.enqueue(b"two", timeout=5)
        assert reader.has_message() and reader.has_message()  # asking takes nothing
        assert reader.dequeue(timeout=5) == b"one" and reader.has_message()
        assert reader.dequeue(timeout=5) == b"two" and not reader.has_message()
        writer.enqueue(b"three", timeout=5)  # the slot of "one" again: its old sequence number is not taken for it
        assert reader.has_message() and reader.dequeue(timeout=5) == b"three"
    finally:
        reader.close()
        writer.close()


def test_neither_side_tells_the_resource_tracker(ipc_dir, monkeypatch):
    # Registering starts a tracker process (it outlives the engine in the host), and a reader's would unlink the ring.
    registered: list[str] = []
    monkeypatch.setattr(resource_tracker, "register", lambda name, rtype: registered.append(name))
    writer = _writer(ipc_dir, num_readers=1)
    reader = BroadcastReader(writer.handle, 0)
    writer.wait_for_readers(timeout=10)
    writer.enqueue(b"hello", timeout=5)
    assert reader.dequeue(timeout=5) == b"hello"
    reader.close()
    writer.close()
    assert registered == []
