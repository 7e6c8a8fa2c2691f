"""Clients of the session's `slipstream serve` process (the `server` fixture, tests/conftest.py;
helpers to start more in tests/serve/server.py)."""
from __future__ import annotations

import httpx
import pytest

from tests.serve.server import API_KEY


@pytest.fixture(scope="session")
def openai_client(server):
    import openai

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0,
                         timeout=60.0)


@pytest.fixture()
def http(server):
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=60.0) as client:
        yield client
