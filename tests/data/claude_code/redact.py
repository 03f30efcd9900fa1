"""A recorder log (record.py) → the redacted request files kept here (see README.md).

    python redact.py LOG.jsonl NAME [NAME ...]

The log's first POST /v1/messages requests, in order, are written as NAME.json: the headers that matter (the
key replaced) and the body with every key, block, cache_control mark, tool name, schema and the message
structure as sent, but each string longer than KEEP characters (Claude Code's prose: system prompt,
tool and property descriptions, system reminders) cut to its first KEEP characters and " [...]", and
metadata.user_id's device and session ids zeroed."""

import json
import re
import sys
from pathlib import Path

KEEP = 80
HEADERS = ("anthropic-beta", "anthropic-version", "anthropic-dangerous-direct-browser-access", "user-agent",
           "x-app", "x-api-key", "content-type", "accept")


def cut(o):
    if isinstance(o, dict):
        return {k: cut(v) for k, v in o.items()}
    if isinstance(o, list):
        return [cut(v) for v in o]
    return o[:KEEP] + " [...]" if isinstance(o, str) and len(o) > KEEP else o


def redact(record: dict) -> dict:
    headers = {k.lower(): v for k, v in record["headers"].items()}
    kept = {k: "<redacted>" if k == "x-api-key" else headers[k] for k in HEADERS if k in headers}
    body = {k: v if k == "metadata" else cut(v) for k, v in record["body"].items()}
    if isinstance(body.get("metadata", {}).get("user_id"), str):
        body["metadata"] = {**body["metadata"], "user_id": re.sub(r"[0-9a-f]{8,}(-[0-9a-f]{4,})*", lambda m: re.sub(
            "[0-9a-f]", "0", m[0]), body["metadata"]["user_id"])}
    return {"method": record["method"], "path": record["path"], "query": record["query"], "headers": kept,
            "body": body}


if __name__ == "__main__":
    log, names = sys.argv[1], sys.argv[2:]
    lines = Path(log).read_text().splitlines()
    records = [r for r in map(json.loads, lines) if r["method"] == "POST" and r["path"] == "/v1/messages"]
    assert len(names) <= len(records), f"{len(records)} requests in the log, {len(names)} names"
    for name, record in zip(names, records):
        path = Path(__file__).parent / f"{name}.json"
        path.write_text(json.dumps(redact(record), indent=1, ensure_ascii=False) + "\n")
        print(path, path.stat().st_size)
