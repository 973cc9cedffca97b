"""Property-based API testing over the server's own OpenAPI schema: no 5xx, no schema violations.

The server runs with small token limits so that every generated request finishes quickly; the number
of examples per operation is bounded.
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from tests.conftest import RunningServer


@pytest.fixture(scope="module")
def small_server():
    srv = RunningServer({"MAX_TOTAL_TOKENS": "48", "MAX_INPUT_TOKENS": "32", "MAX_CONCURRENT_REQUESTS": "64"})
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def api_schema(small_server):
    schema = schemathesis.openapi.from_url(small_server.url + "/openapi.json")
    schema.config.base_url = small_server.url
    return schema


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_api_conforms(case):
    case.call_and_validate(timeout=60)
