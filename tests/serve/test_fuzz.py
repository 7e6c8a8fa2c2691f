"""Fuzz every operation of the server's OpenAPI schema with schemathesis: no input may cause a 5xx,
and every response conforms to the schema (status code, content type, body, headers).

Both valid and invalid bodies are generated (few examples per operation, so it stays fast);
generation lengths that are valid but slow on a CPU are trimmed before sending.
"""
from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import (  # noqa: E402
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.serve.server import API_KEY  # noqa: E402

MAX_EXAMPLES = 15
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance, response_headers_conformance, negative_data_rejection]
MAX_TOKENS = 4


@pytest.fixture(scope="session")
def api_schema(server):
    return schemathesis.openapi.from_url(server.base_url + "/openapi.json",
                                         headers={"Authorization": f"Bearer {API_KEY}"})


schema = schemathesis.pytest.from_fixture("api_schema")


def _bound_cost(path: str, body) -> None:
    """Keep valid-but-slow requests cheap: a few tokens, n <= 2, 2 prompts."""
    if not isinstance(body, dict) or not path.startswith("/v1/"):
        return
    for key in ("max_tokens", "max_completion_tokens"):
        if _is_int(body.get(key)) and MAX_TOKENS < body[key] < 10**6:
            body[key] = MAX_TOKENS
    if _is_int(body.get("n")) and 2 < body["n"] <= 16:
        body["n"] = 2
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
        body["prompt"] = prompt[:2]
    if path == "/v1/chat/completions" and body.get("max_tokens") is None \
            and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_TOKENS  # unset means "the rest of the context" for chat


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_no_server_errors(case, server):
    _bound_cost(case.path, case.body)
    response = case.call(base_url=server.base_url, headers=server.headers, timeout=60)
    case.validate_response(response, checks=CHECKS)
    content_type = response.headers.get("content-type") or [""]
    if str(content_type[0] if isinstance(content_type, list) else content_type).startswith(
            "text/event-stream"):
        # A stream cannot change its status line: an internal error must not hide in it.
        assert '"type": "server_error"' not in response.text
        assert response.text.rstrip().endswith("data: [DONE]")
