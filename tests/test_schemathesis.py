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


# where each route takes its generation's length (Ollama's: in options)
LENGTH = {"/v1/chat/completions": "max_tokens", "/v1/completions": "max_tokens", "/v1/messages": "max_tokens",
          "/v1/responses": "max_output_tokens", "/infill": "n_predict", "/api/chat": "num_predict",
          "/api/generate": "num_predict"}
SHORT = 8


def _cap(fields: dict, key: str, most: int) -> None:
    """fields[key] made `most` when absent or larger (llama-server's and Ollama's -1, no limit, included);
    a value of another type is left as drawn, to be refused."""
    v = fields.get(key, most + 1)
    if isinstance(v, int) and not isinstance(v, bool) and (v > most or (v < 0 and key in ("n_predict", "num_predict"))):
        fields[key] = most


def steered(case):
    """The case made cheap and worth sending. Its generation is cut to SHORT tokens, and to 2 choices:
    the schema names the served models, so most examples run one, and each run to the context's end
    (a length not given, or drawn large: hypothesis likes large integers) would make the run minutes
    longer for no more of the server's code; short, a stream also ends within the 20 events
    schemathesis reads of it, so its last events are checked too. And a Messages conversation ends with
    the user's turn, which no schema can say: drawn freely, half end with the assistant's (a prefill,
    refused) and the replies would go mostly unchecked."""
    body, path = case.body, case.operation.path
    if not isinstance(body, dict):
        return case
    if path in LENGTH:
        fields = body.setdefault("options", {}) if path.startswith("/api/") else body
        if isinstance(fields, dict):
            _cap(fields, LENGTH[path], SHORT)
    if "n" in body:  # each choice is a generation
        _cap(body, "n", 2)
    turns = body.get("messages")
    if (path.startswith("/v1/messages") and isinstance(turns, list) and turns and isinstance(turns[-1], dict)
            and turns[-1].get("role") == "assistant"):
        turns.append({"role": "user", "content": "Go on."})
    return case


@schema.parametrize()
@hypothesis.settings(max_examples=15, deadline=None, derandomize=True)  # ~1,700 examples in all
def test_fuzz(case, sent):
    # a generation may run to the 256-token context: on a loaded 2-core machine that outlasts
    # schemathesis' default 10 s client timeout (seen: POST /v1/responses {"input": ""} timed out)
    r = steered(case).call_and_validate(headers={"Authorization": f"Bearer {KEY}"},
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
    by_route = {(m.upper(), p): codes for (m, p), codes in sent.items() if (m.upper(), p) in routes}
    print(", ".join(f"{m} {p}: {len(c)} ({sum(x < 300 for x in c)} 2xx)" for (m, p), c in sorted(by_route.items())))
    for path in ("/v1/messages", "/v1/messages/count_tokens"):  # their replies checked, not only refusals
        assert 200 in by_route[("POST", path)], (path, by_route[("POST", path)])


ASK = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("path, body, status", [
    # tool_choice's type an object: looked up in a dict, unhashable, a 500
    ("/v1/messages", {"messages": ASK, "max_tokens": 1, "tool_choice": {"type": {}}}, 400),
    # a top_p under fp32's least positive number is 0 on the sampler's tensor: no token kept, a 500
    ("/v1/messages", {"messages": ASK, "max_tokens": 1, "top_p": 5e-324}, 200),
    ("/v1/chat/completions", {"messages": ASK, "max_tokens": 1, "top_p": 5e-324}, 200),
])
def test_what_the_fuzzer_found(fuzz_server, path, body, status):
    r = httpx.post(fuzz_server + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == status, r.text
    if path == "/v1/messages" and status == 400:
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error", r.text


def test_every_operation_has_its_own_id_and_head_root_still_answers(fuzz_server):
    """GET and HEAD / share one route in Ollama; in the schema, two methods of one route would share an
    operation id, which schema tools (and FastAPI's own warning) reject."""
    doc = httpx.get(fuzz_server + "/openapi.json", timeout=10).json()
    ids = [op["operationId"] for ops in doc["paths"].values() for op in ops.values()]
    assert ids and len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    assert httpx.head(fuzz_server + "/", timeout=10).status_code == 200
    assert httpx.get(fuzz_server + "/", timeout=10).text == "Ollama is running"
