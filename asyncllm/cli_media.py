"""``asyncllm serve``'s media flags: vLLM's ``--allowed-local-media-path`` and ``--allowed-media-domains``.

asyncllm's server fetches no http(s) media (an http(s) url in a request is a 400: docs/security.md), so no domain
can be allowed: ``--allowed-media-domains`` is accepted, so that a vLLM launch line is understood, and refused at
start with the reason, rather than left for the user to believe that image URLs of those domains are fetched.
"""

from __future__ import annotations

import argparse

__all__ = ["add_media_args", "MEDIA_DOMAINS_REFUSAL"]

MEDIA_DOMAINS_REFUSAL = ("asyncllm fetches no http(s) media, so no domain can be allowed: send images, video and "
                         "audio as data: URLs, or as file:// URLs with --allowed-local-media-path (docs/security.md)")


def add_media_args(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                       help="let requests name media files inside DIR as file:// URLs (trusted clients only; "
                            "default: no file is read for a request)")
    serve.add_argument("--allowed-media-domains", nargs="+", default=None, type=_media_domain, metavar="DOMAIN",
                       help="vLLM's flag, refused: asyncllm fetches no http(s) media")


def _media_domain(raw: str) -> str:
    """Any domain given: the parser's error, `MEDIA_DOMAINS_REFUSAL` (the server can fetch from none)."""
    raise argparse.ArgumentTypeError(f"{raw!r} cannot be allowed: {MEDIA_DOMAINS_REFUSAL}")
