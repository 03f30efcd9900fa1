"""Fuzz lowbit serve from its own /openapi.json (issue 25 item 10): no 5xx, replies match the schema."""

import httpx
import hypothesis
import pytest
import schemathesis
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance

from tests.helpers import serve_process

KEY = "sk-fuzz"


@pytest.fixture(scope="session")
def fuzz_server(default_gguf, tmp_path_factory):
    """A small-context server (--ctx-size 256) so generation-heavy examples stay fast."""
    with serve_process([str(default_gguf), "--ctx-size", "256", "--kv-memory", "64MiB"],
                       tmp_path_factory.mktemp("fuzz") / "serve.log", {"LOWBIT_API_KEY": KEY}) as (base, _):
        yield base


schema = schemathesis.pytest.from_fixture("fuzz_schema")


@pytest.fixture(scope="session")
def fuzz_schema(fuzz_server):
    return schemathesis.openapi.from_url(fuzz_server + "/openapi.json")


@pytest.fixture(scope="session")
def sent() -> dict:
    """Examples sent, by operation and status: the run must really cover every route."""
    return {}


@schema.parametrize()
@hypothesis.settings(max_examples=40, deadline=None, derandomize=True)
def test_fuzz(case, sent):
    # a generation may run to the 256-token context: on a loaded 2-core machine that outlasts
    # schemathesis' default 10 s client timeout (seen: POST /v1/responses {"input": ""} timed out)
    r = case.call_and_validate(headers={"Authorization": f"Bearer {KEY}"},
                               checks=[not_a_server_error, response_schema_conformance], timeout=120)
    key = (case.method, case.operation.path)
    sent.setdefault(key, []).append(r.status_code)


def test_fuzz_sent_500_examples_over_every_route(sent, fuzz_schema):
    routes = {(op.method.upper(), op.path) for op in (r.ok() for r in fuzz_schema.get_all_operations())}
    assert routes and routes <= {(m.upper(), p) for m, p in sent}, routes - {(m.upper(), p) for m, p in sent}
    total = sum(map(len, sent.values()))
    assert total >= 500, total
    ok = sum(1 for codes in sent.values() for c in codes if c < 300)
    print(f"schemathesis: {total} examples over {len(sent)} operations, {ok} answered 2xx")


def test_every_operation_has_its_own_id_and_head_root_still_answers(fuzz_server):
    """GET and HEAD / share one route in Ollama; in the schema, two methods of one route would share an
    operation id, which schema tools (and FastAPI's own warning) reject."""
    doc = httpx.get(fuzz_server + "/openapi.json", timeout=10).json()
    ids = [op["operationId"] for ops in doc["paths"].values() for op in ops.values()]
    assert ids and len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    assert httpx.head(fuzz_server + "/", timeout=10).status_code == 200
    assert httpx.get(fuzz_server + "/", timeout=10).text == "Ollama is running"
