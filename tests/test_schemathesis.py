"""Property-based API testing over the server's own OpenAPI schema: no 5xx, no schema violations.

The server runs with small token limits so that every generated request finishes quickly; each
operation gets a bounded number of generated examples.
"""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance

from tests.conftest import server_with

EXAMPLES = 25


small_server = server_with({"MAX_TOTAL_TOKENS": "48", "MAX_INPUT_TOKENS": "32", "MAX_CONCURRENT_REQUESTS": "64"})


def test_api_conforms(small_server):
    schema = schemathesis.openapi.from_url(small_server.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/generate", "/generate_stream", "/v1/completions",
                                              "/v1/chat/completions", "/health", "/info"}
    for op in operations:

        @given(case=op.as_strategy())
        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def conforms(case):
            # Schema-valid bodies may still be refused with 422 by limits the schema cannot express
            # (prompt tokens over MAX_INPUT_TOKENS, prompt + new tokens over MAX_TOTAL_TOKENS, n > 1).
            case.call_and_validate(base_url=small_server.url, timeout=60, excluded_checks=[positive_data_acceptance])

        conforms()
