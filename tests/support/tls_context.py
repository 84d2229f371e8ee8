"""One default TLS context per test process, however many HTTP clients the tests make.

httpx builds an SSL context for every client it makes, and `httpx.get`/`post`/`stream` make a client per call, as
does every `openai.OpenAI`/`anthropic.Anthropic`. Each `ssl.create_default_context(cafile=...)` (certifi's bundle,
or $SSL_CERT_FILE's) parses the whole CA bundle: about 30 ms of CPU on these machines. test_errors, test_tenants
and test_load alone made 536 of them in `make test`'s two workers. Every test talks plain HTTP to 127.0.0.1, so no
context is ever used for a handshake; the shared one is made the same way, once per set of arguments.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

DefaultContext = Callable[..., ssl.SSLContext]


def shared_default(make: DefaultContext) -> DefaultContext:
    """`make` (ssl.create_default_context) that returns one context for each set of arguments it has seen."""
    made: dict[tuple, ssl.SSLContext] = {}

    def create_default_context(purpose: ssl.Purpose = ssl.Purpose.SERVER_AUTH, *, cafile: str | None = None,
                               capath: str | None = None, cadata: str | bytes | None = None) -> ssl.SSLContext:
        key = (purpose, cafile, capath, cadata)
        if key not in made:
            made[key] = make(purpose, cafile=cafile, capath=capath, cadata=cadata)
        return made[key]

    return create_default_context


@contextmanager
def one_tls_context_per_process() -> Iterator[None]:
    """While open, ssl.create_default_context returns the context it made before for the same arguments."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ssl, "create_default_context", shared_default(ssl.create_default_context))
        yield
