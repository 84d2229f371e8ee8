"""tests/support/tls_context.py: one context per set of arguments, made by the real ssl.create_default_context."""

from __future__ import annotations

import ssl

import certifi
import httpx
import openai
import pytest

from tests.support.tls_context import one_tls_context_per_process, shared_default


def test_the_same_arguments_give_the_same_context_and_others_a_context_of_their_own():
    create = shared_default(ssl.create_default_context)
    first = create(cafile=certifi.where())
    assert create(cafile=certifi.where()) is first
    assert first.verify_mode == ssl.CERT_REQUIRED and first.check_hostname
    assert first.cert_store_stats()["x509_ca"] > 100  # the bundle was loaded, as ssl's own would
    other = create(ssl.Purpose.CLIENT_AUTH)
    assert other is not first and create(ssl.Purpose.CLIENT_AUTH) is other


def test_httpx_and_openai_clients_made_while_open_build_a_context_once_and_ssl_is_itself_again_after():
    made: list[dict] = []
    real = ssl.create_default_context

    def counted(*args, **kwargs) -> ssl.SSLContext:
        made.append(kwargs)
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ssl, "create_default_context", counted)
        with one_tls_context_per_process():
            for _ in range(3):
                httpx.Client().close()
                openai.OpenAI(base_url="http://127.0.0.1:1/v1", api_key="unused").close()
        assert ssl.create_default_context is counted
    assert len(made) == 1, made  # httpx and openai ask for the same bundle (certifi's, or $SSL_CERT_FILE)
