"""schemathesis against the running API, from the API's own /openapi.json (docs/faults.md, Fuzzing).

The app runs on a real HTTP server over real Redis with the scripted worker, and every
operation of the document gets generated requests, valid (positive) and invalid
(negative). Each response is checked: never a 5xx, its status documented, its content type
documented, and its body valid against the documented schema. The number of cases is
bounded for CI (`CASES_PER_OPERATION` per operation and mode) and counted.
"""

from __future__ import annotations

import os
import time
from collections import Counter

import hypothesis
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.generation.modes import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

pytestmark = pytest.mark.integration

# per operation and mode; LLMQ_FUZZ_CASES=100 runs a sweep of over 2,000 cases (tests/README.md)
CASES_PER_OPERATION = int(os.environ.get("LLMQ_FUZZ_CASES", "25"))
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]
SETTINGS = hypothesis.settings(
    max_examples=CASES_PER_OPERATION,
    deadline=None,
    database=None,
    derandomize=True,  # the same cases on every run: a CI failure reproduces locally
    suppress_health_check=list(HealthCheck),
    phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate],
)


def test_fuzz_every_operation_from_the_published_schema(server, worker) -> None:
    schema = schemathesis.openapi.from_url(f"{server}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 28
    statuses: Counter[int] = Counter()
    failures: list[str] = []
    cases = 0
    no_negative: list[str] = []
    started = time.monotonic()
    with requests.Session() as session:
        for operation in operations:
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

                @SETTINGS
                @given(case=operation.as_strategy(generation_mode=mode), known=st.booleans())
                def run(case, known: bool) -> None:
                    nonlocal cases
                    cases += 1
                    if known and isinstance(case.body, dict) and "model" in case.body:
                        case.body["model"] = "tiny"  # the fake worker's: past the model check
                    response = case.call(base_url=server, session=session, timeout=30)
                    statuses[response.status_code] += 1
                    try:
                        case.validate_response(response, checks=CHECKS)
                    except FailureGroup as exc:  # collected: one report for all
                        failures.append(f"{case.operation.label}: {str(exc)[:600]}")

                try:
                    run()
                except hypothesis.errors.Unsatisfiable:
                    # nothing to make invalid: no parameters and no body (GET /health)
                    assert mode == GenerationMode.NEGATIVE, operation.label
                    no_negative.append(operation.label)
    elapsed = time.monotonic() - started
    print(f"schemathesis: {cases} cases in {elapsed:.1f}s over {len(operations)} operations")
    print(f"no invalid request to make for {len(no_negative)}: {no_negative}")
    print(f"statuses: {dict(sorted(statuses.items()))}")
    assert not failures, "\n\n".join(failures[:10])
    assert cases >= 14 * CASES_PER_OPERATION
    assert not [s for s in statuses if s >= 500]
    assert statuses[200] + statuses[202] > 0  # some cases did get through validation


def test_the_checks_do_catch_a_body_that_breaks_its_schema(server) -> None:
    """The sweep above can fail: against a document that says /health answers
    `{"status": "nope"}`, the real answer is reported as a schema violation."""
    document = requests.get(f"{server}/openapi.json", timeout=10).json()
    document["components"]["schemas"]["Health"]["properties"]["status"]["const"] = "nope"
    schema = schemathesis.openapi.from_dict(document)
    schema.config.update(base_url=server)
    case = schema["/health"]["GET"].Case()
    response = case.call(base_url=server, timeout=10)
    assert response.status_code == 200
    with pytest.raises(FailureGroup) as caught:
        case.validate_response(response, checks=CHECKS)
    assert "Response violates schema" in str(caught.value)
