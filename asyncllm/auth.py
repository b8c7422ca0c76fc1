"""Authentication of TCP engine addresses: zmq CURVE with keys derived from one shared secret.

An ``ipc://`` engine socket lives in a 0700 folder, so the file system keeps
other users out. A ``tcp://`` address is reachable by any machine that routes
to the port, so every TCP connection between a host and the engine core is
CURVE: encrypted, and authenticated both ways. Both key pairs (the core's and
the hosts') are derived from one shared secret, `ASYNCLLM_ENGINE_KEY`, with
scrypt (slow on purpose: an observed public key does not make a short secret
cheap to guess). A peer without the secret cannot finish the handshake: the
core's ZAP handler admits only the hosts' public key, and a host checks the
core's key. The core never sees a frame from a refused peer.

Nothing here travels as pickle: CURVE wraps the same msgpack frames.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
from dataclasses import dataclass, field

import zmq
import zmq.auth.thread
from zmq.utils import z85

from asyncllm import envs
from asyncllm.errors import ConfigError, NotBuiltError

__all__ = ["MIN_KEY_LENGTH", "CurveKeys", "derive_keys", "resolve_key", "secure_client", "ServerAuth"]

MIN_KEY_LENGTH = 16
"""Shortest shared secret accepted; ``python -c "import secrets; print(secrets.token_urlsafe(32))"``
makes a good one."""
_KDF_SALT = b"asyncllm-engine-curve-v1"
_ZAP_DOMAIN = "asyncllm"


@dataclass(frozen=True)
class CurveKeys:
    """The core's and the hosts' CURVE key pairs (z85 bytes), both derived from the shared secret."""

    server_public: bytes
    server_secret: bytes = field(repr=False)
    client_public: bytes = field(repr=False)
    client_secret: bytes = field(repr=False)


def resolve_key(address: str, key: str | None) -> str | None:
    """The shared secret an address needs: None for ``ipc://``; for ``tcp://`` the given key,
    else `ASYNCLLM_ENGINE_KEY`, else `ConfigError` (a TCP address is never served unauthenticated)."""
    if not address.startswith("tcp://"):
        return None
    if not zmq.has("curve"):
        raise NotBuiltError("address", address, "a TCP engine address with this pyzmq (its libzmq has no CURVE)")
    key = key or envs.ENGINE_KEY.get() or None
    if key is None:
        raise ConfigError("address", address, f"a tcp:// engine address together with a shared secret: set "
                          f"{envs.ENGINE_KEY.name} (the same value for the core and every host), or use ipc://")
    if not isinstance(key, str) or len(key) < MIN_KEY_LENGTH:
        raise ConfigError(envs.ENGINE_KEY.name, "<hidden>", f"a secret of at least {MIN_KEY_LENGTH} characters",
                          value_repr="<hidden>")
    return key


@functools.lru_cache(maxsize=4)
def derive_keys(key: str) -> CurveKeys:
    """Both CURVE key pairs from the shared secret (scrypt: tenths of a second, so cached)."""
    server_public, server_secret = _key_pair(key, b"core")
    client_public, client_secret = _key_pair(key, b"host")
    return CurveKeys(server_public, server_secret, client_public, client_secret)


def _key_pair(key: str, role: bytes) -> tuple[bytes, bytes]:
    seed = hashlib.scrypt(key.encode(), salt=_KDF_SALT + b"/" + role, n=2**14, r=8, p=1, dklen=32)
    secret = z85.encode(seed)
    return zmq.curve_public(secret), secret


def secure_client(socket: zmq.Socket, keys: CurveKeys) -> None:
    """Make a host's DEALER a CURVE client of the core (set before `connect`)."""
    socket.curve_serverkey = keys.server_public
    socket.curve_publickey = keys.client_public
    socket.curve_secretkey = keys.client_secret


class ServerAuth:
    """The core's side: a ZAP handler thread admitting only the hosts' key, and the CURVE server options.

    Start it (`secure`) before the ROUTER binds, and `stop` it before the
    context terminates.
    """

    def __init__(self, ctx: zmq.Context, keys: CurveKeys) -> None:
        self._keys = keys
        self._authenticator = zmq.auth.thread.ThreadAuthenticator(ctx)
        self._authenticator.start()
        self._authenticator.configure_curve_callback(_ZAP_DOMAIN, credentials_provider=self)

    def secure(self, socket: zmq.Socket) -> None:
        socket.zap_domain = _ZAP_DOMAIN.encode()
        socket.curve_server = True
        socket.curve_secretkey = self._keys.server_secret
        socket.curve_publickey = self._keys.server_public

    def callback(self, domain: str, client_key: bytes) -> bool:
        """ZAP: admit a peer only if it proved it holds the hosts' secret key."""
        return domain == _ZAP_DOMAIN and hmac.compare_digest(client_key, self._keys.client_public)

    def stop(self) -> None:
        self._authenticator.stop()
