"""The broadcast ring (workers/shm_broadcast.py) against a model of its slots, under drawn interleavings (hypothesis).

One writer and one to three readers share one thread, so the interleaving is
the drawn one: the writer publishes messages of drawn sizes (empty, up to a
slot, exactly a slot, or past it: the overflow path), readers read, each at its
own pace. The model says when the writer must wait (the slot it would write
still holds a message some reader has not read: it times out with nothing
written, and a retry later succeeds) and when a reader has nothing to read
(`has_message` is False and `dequeue` times out); every reader gets every
message, in order, byte for byte.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncllm.procutil import private_ipc_dir, remove_dir
from asyncllm.workers.shm_broadcast import BroadcastReader, BroadcastWriter

SLOT_BYTES = 64
WAIT_S = 0.002
"""The timeout of a call the model says must wait (it must raise TimeoutError)."""
ARRIVE_S = 5.0
"""The timeout of a call the model says returns at once (an overflow payload may still be on the socket)."""


def _payload(seq: int, size: int) -> bytes:
    """``size`` bytes that name their message: a mix-up of messages or of offsets shows."""
    return bytes((seq * 31 + i * 7) % 251 for i in range(size))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), num_readers=st.integers(1, 3), num_slots=st.integers(1, 4))
def test_readers_get_every_message_in_order_and_the_writer_waits_exactly_when_it_must(
        data: st.DataObject, num_readers: int, num_slots: int) -> None:
    ipc_dir = private_ipc_dir()
    writer = BroadcastWriter(num_readers, f"ipc://{ipc_dir}/ring", num_slots=num_slots, slot_bytes=SLOT_BYTES)
    readers = []
    try:
        readers += [BroadcastReader(writer.handle, r, spin_s=0.0) for r in range(num_readers)]
        writer.wait_for_readers(timeout=10)
        sent: list[bytes] = []
        read = [0] * num_readers  # messages each reader has read
        sizes = st.sampled_from([0, 1, SLOT_BYTES, SLOT_BYTES + 1, 3 * SLOT_BYTES]) | st.integers(0, 2 * SLOT_BYTES)
        for _ in range(data.draw(st.integers(1, 40))):
            who = data.draw(st.integers(-1, num_readers - 1))  # -1: the writer
            if who < 0:
                _write(writer, sent, read, num_slots, data.draw(sizes))
            else:
                _read(readers[who], sent, read, who)
        for who, reader in enumerate(readers):  # the rest, in order
            while read[who] < len(sent):
                _read(reader, sent, read, who)
    finally:
        for reader in readers:
            reader.close()
        writer.close()
        remove_dir(ipc_dir)


def _write(writer: BroadcastWriter, sent: list[bytes], read: list[int], num_slots: int, size: int) -> None:
    seq = len(sent) + 1
    payload = _payload(seq, size)
    must_wait = min(read) < seq - num_slots  # its slot holds message seq - num_slots, which someone has not read
    if must_wait:
        try:
            writer.enqueue(payload, timeout=WAIT_S)
        except TimeoutError:
            return  # nothing written: the message is drawn again later
        raise AssertionError(f"message #{seq} overwrote #{seq - num_slots}, which a reader had not read")
    writer.enqueue(payload, timeout=ARRIVE_S)
    sent.append(payload)


def _read(reader: BroadcastReader, sent: list[bytes], read: list[int], who: int) -> None:
    waiting = read[who] < len(sent)
    assert reader.has_message() == waiting, (who, read[who], len(sent))
    if not waiting:
        try:
            got = reader.dequeue(timeout=WAIT_S)
        except TimeoutError:
            return
        raise AssertionError(f"reader {who} read {got[:8]!r}... past the last message")
    assert reader.dequeue(timeout=ARRIVE_S) == sent[read[who]], (who, read[who])
    read[who] += 1
