"""The daemon's API fuzzed from its own OpenAPI schema (schemathesis' strategies, run by
hypothesis) against a live daemon: with the operator's token, with another service's replica
token, and with none. No answer is a 5xx, every error is {"detail": "<one line>"}, and the
service that was there before is still there, unchanged, afterwards."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.control import auth
from orchestrator.control.api import create_app
from tests.fakes.standin import services_running

pytestmark = pytest.mark.timeout(300)
KEPT = "kept"


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    with services_running(tmp_path_factory.mktemp("fuzz-home"), (KEPT,)) as (d, client, replicas):
        before = client.get(f"/v1/services/{KEPT}").json()
        schema = schemathesis.openapi.from_dict(create_app(d).openapi())
        operations = [result.ok() for result in schema.get_all_operations()]
        yield d, client, before, auth.replica_token_for(d.store.get_replica(replicas[KEPT]["replica_id"])), operations
        after = client.get(f"/v1/services/{KEPT}").json()
        assert after["status"] == before["status"]
        assert after["replicas"][0]["replica_id"] == before["replicas"][0]["replica_id"]


def _touches_the_kept_service(case) -> bool:
    values = [*(case.path_parameters or {}).values(), *(case.query or {}).values()]
    if isinstance(case.body, dict):
        values += [v for v in case.body.values() if isinstance(v, str)]
    return any(isinstance(v, str) and KEPT in v for v in values)


@pytest.mark.parametrize("who", ["operator", "replica", "nobody"])
def test_no_input_makes_the_api_fail(live, who):
    d, client, before, replica_token, operations = live
    headers = {"operator": {"Authorization": f"Bearer {d.token}"},
               "replica": {"Authorization": f"Bearer {replica_token}"}, "nobody": {}}[who]
    seen: list[int] = []

    @settings(max_examples={"operator": 250, "replica": 60, "nobody": 40}[who], deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def fuzz(data):
        case = data.draw(st.one_of(*[op.as_strategy() for op in operations]))
        if who == "operator" and case.method.upper() in ("DELETE", "POST") and _touches_the_kept_service(case):
            return  # the operator may take the service down; that is no failure
        response = case.call(base_url=d.url, headers=headers, timeout=30)
        seen.append(response.status_code)
        assert response.status_code < 500, (case.method, case.formatted_path, case.body, response.text)
        if response.status_code >= 400:
            detail = response.json()["detail"]
            assert isinstance(detail, str) and "\n" not in detail, response.text
        if who == "nobody" and case.formatted_path != "/v1/health":
            assert response.status_code in (401, 404, 405, 422), (case.formatted_path, response.status_code)

    fuzz()
    assert len(seen) > 20
    assert client.get(f"/v1/services/{KEPT}").json()["replicas"][0]["state"] == "READY"
