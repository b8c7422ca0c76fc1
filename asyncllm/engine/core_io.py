"""The engine core's socket thread: one ROUTER, many host DEALERs.

zmq sockets are single-threaded, so one I/O thread owns the ROUTER: it decodes
every host frame (dropping malformed ones with a logged error) into
`inbox`, and sends whatever the busy loop pushes on an inproc socket.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid

import msgspec
import zmq

from asyncllm import protocol
from asyncllm.auth import ServerAuth, derive_keys, resolve_key
from asyncllm.engine.channel import unbounded
from asyncllm.engine.client_liveness import HeardAt, mark_heard
from asyncllm import errors
from asyncllm.errors import ConfigError

logger = logging.getLogger("asyncllm.engine.core")

_STOP = b"\x00stop"
_MAX_FRAME_BYTES = 64 << 20
"""A peer sending a larger frame is disconnected by zmq before anything is decoded."""


class CoreIO:
    """Owns the ROUTER socket; `inbox` yields (client_id, HostMessage)."""

    def __init__(self, address: str, key: str | None = None) -> None:
        """`key`: the shared secret of a tcp:// address (default ASYNCLLM_ENGINE_KEY; asyncllm/auth.py)."""
        self.inbox: queue.Queue[tuple[bytes, protocol.HostMessage]] = queue.Queue()
        self.last_heard: dict[bytes, HeardAt] = {}
        """client_id -> when this thread last received from that host (`time.monotonic`), for the hosts
        `ClientLiveness` times out (it adds and removes them): a step that keeps the busy loop from the inbox does
        not make a host look silent."""
        self._ctx = zmq.Context()
        key = resolve_key(address, key)
        self._auth = ServerAuth(self._ctx, derive_keys(key)) if key is not None else None
        self._router = unbounded(self._ctx.socket(zmq.ROUTER))  # a slow host's outputs wait, never dropped
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 0)  # one to a gone host is dropped: the core never blocks
        self._router.setsockopt(zmq.MAXMSGSIZE, _MAX_FRAME_BYTES)
        if self._auth is not None:
            self._auth.secure(self._router)  # CURVE, and only peers holding the hosts' key get through
        try:
            self._router.bind(address)
        except zmq.ZMQError as exc:
            self._router.close(linger=0)
            if self._auth is not None:
                self._auth.stop()
            self._ctx.term()
            raise ConfigError("address", address, f"an address this process can listen on ({exc})") from exc
        self._outbox_address = f"inproc://asyncllm-core-out-{uuid.uuid4().hex}"
        self._outbox_pull = unbounded(self._ctx.socket(zmq.PULL))
        self._outbox_pull.bind(self._outbox_address)
        self._outbox_push = unbounded(self._ctx.socket(zmq.PUSH))  # the busy loop's send never waits for this thread
        self._outbox_push.connect(self._outbox_address)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(protocol.HostMessage)
        self._thread = threading.Thread(target=self._run, name="asyncllm-core-io", daemon=True)
        self._thread.start()

    def send(self, client_id: bytes, message: protocol.CoreMessage) -> None:
        """Queue one message for one host (called from the busy loop only)."""
        self._outbox_push.send_multipart([client_id, self._encoder.encode(message)], copy=False)

    def close(self) -> None:
        self._outbox_push.send_multipart([_STOP, b""])
        self._thread.join(timeout=5)
        self._outbox_push.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._outbox_pull, zmq.POLLIN)
        try:
            while True:
                events = dict(poller.poll())
                if self._outbox_pull in events:
                    client_id, payload = self._outbox_pull.recv_multipart()
                    if client_id == _STOP:
                        return
                    self._router.send_multipart([client_id, payload])
                if self._router in events:
                    self._receive()
        finally:
            self._router.close(linger=0)
            self._outbox_pull.close(linger=0)

    def _receive(self) -> None:
        frames = self._router.recv_multipart()
        if len(frames) != 2:
            logger.error("dropped a malformed frame from a host: %d parts", len(frames))
            return
        client_id, payload = frames
        try:
            message = self._decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:  # nested too deep: RecursionError
            logger.error("dropped an undecodable frame from a host: %s", exc)
            self._refuse_undecodable(client_id, payload, exc)
            return
        mark_heard(self.last_heard, client_id)  # only a host the core times out (`ClientLiveness.watch`)
        self.inbox.put((client_id, message))

    def _refuse_undecodable(self, client_id: bytes, payload: bytes, exc: Exception) -> None:
        """An add-request the core cannot decode (a value of a type its field does not take) ends with an error
        for its id, when the id can be read, rather than leave its caller waiting."""
        request_id = _add_request_id(payload)
        if request_id is None:
            return
        delta = protocol.RequestOutputDelta(request_id, [], "abort",
                                            error=f"request: the engine core could not decode it ({exc})")
        outputs = protocol.Outputs([delta], None, time.time())
        self._router.send_multipart([client_id, msgspec.msgpack.encode(outputs)])  # this thread owns the router


def _add_request_id(payload: bytes) -> str | None:
    """The request id of an `AddRequest` frame read without its types (tagged, array-like: its first two items)."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except (msgspec.DecodeError, RecursionError):
        return None
    if isinstance(raw, list) and len(raw) > 1 and raw[0] == "AddRequest" and isinstance(raw[1], str):
        return raw[1]
    return None


def fail_startup(io: CoreIO, exc: BaseException, grace_s: float = 3.0) -> None:
    """Tell every host that says hello within `grace_s` why the core failed to start (`EngineFailed`)."""
    error_type = type(exc).__name__ if isinstance(exc, errors.AsyncLLMError) else "EngineDeadError"
    failed = protocol.EngineFailed(error_type, f"engine core failed to start: {exc}", protocol.config_error_parts(exc))
    deadline = time.monotonic() + grace_s
    told: set[bytes] = set()
    while time.monotonic() < deadline:
        try:
            client_id, _ = io.inbox.get(timeout=0.05)
        except queue.Empty:
            if told:
                break
            continue
        if client_id not in told:
            io.send(client_id, failed)
            told.add(client_id)
    time.sleep(0.1)


def unknown_host_answer(message: protocol.HostMessage) -> protocol.CoreMessage | None:
    """What the core answers a request or call from a host it does not know (it never said Hello, or was taken for
    dead), so that its caller fails with `EngineDeadError` instead of waiting; None: nothing waits for an answer."""
    error = errors.EngineDeadError("this engine core does not know this host: it never said Hello, or was taken "
                                   "for dead")
    if isinstance(message, protocol.AddRequest):
        delta = protocol.RequestOutputDelta(message.request_id, [], "abort", error=str(error),
                                            error_type="EngineDeadError")
        return protocol.Outputs([delta], None, time.time())
    fields = protocol.call_error_fields(error)
    if isinstance(message, protocol.UpdateWeights):
        return protocol.WeightsUpdated(message.update_id, **fields)
    if isinstance(message, (protocol.Sleep, protocol.WakeUp)):
        return protocol.SleepModeDone(message.call_id, **fields)
    if isinstance(message, protocol.AddLoRA):
        return protocol.LoRAAdded(message.call_id, **fields)
    if isinstance(message, protocol.RemoveLoRA):
        return protocol.LoRARemoved(message.call_id, **fields)
    if isinstance(message, protocol.PinLoRA):
        return protocol.LoRAPinned(message.call_id, **fields)
    if isinstance(message, protocol.Heartbeat):  # detached while silent (a lost network): its streams must not wait
        return protocol.EngineFailed("EngineDeadError", f"{error}: it was silent past host_heartbeat_timeout_s")
    return None
