"""Each host's request ids are its own: hosts sharing a core may use the same ids.

The core keys a request by its host's tag and the host's id (`request_key`): the tag is the host's DEALER
identity in hex and a colon, so no id of one host spells another's key. The core tags what a host sends
(`AddRequest`, `AbortRequests`) once it is checked, and `host_outputs` takes the tag off what it sends back: a host
sees its own ids everywhere, and cannot name, probe or abort another host's requests. The core's own log names a
request by its key. Adapter ids likewise: asyncllm/engine/lora_ids.py.
"""

from __future__ import annotations

from collections.abc import Iterable

from asyncllm import protocol

__all__ = ["host_outputs", "request_key", "request_keys"]


def host_tag(client_id: bytes) -> str:
    return client_id.hex() + ":"


def request_key(client_id: bytes, request_id: str) -> str:
    """The core's key of `client_id`'s request `request_id` (its scheduler, KV cache, grammars and log)."""
    return host_tag(client_id) + request_id


def request_keys(client_id: bytes, request_ids: Iterable[str]) -> list[str]:
    tag = host_tag(client_id)
    return [tag + request_id for request_id in request_ids]


def host_outputs(client_id: bytes, deltas: list[protocol.RequestOutputDelta],
                 token_req_ids: list[str]) -> tuple[list[protocol.RequestOutputDelta], list[str]]:
    """`client_id`'s outputs under its own ids. The deltas are this round's, sent once: renamed in place."""
    start = len(host_tag(client_id))
    for delta in deltas:
        request_id = delta.request_id[start:]
        if delta.error is not None:  # an error may quote the key
            delta.error = delta.error.replace(delta.request_id, request_id)
        delta.request_id = request_id
    return deltas, [key[start:] for key in token_req_ids]
