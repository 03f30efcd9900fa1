"""A stand-in for Anthropic's API that records what Claude Code sends (see README.md).

    python record.py PORT LOG.jsonl [tool]

Every request (method, path, query, headers, JSON body) is appended to LOG.jsonl as one line. POST
/v1/messages gets a minimal valid Message, streamed as SSE events when the body says `stream`;
/v1/messages/count_tokens gets {"input_tokens": 1234}; anything else a 404. With `tool`, a request
offering the Bash tool whose last turn holds no tool_result is answered with a Bash `ls` call, so that
Claude Code runs it and sends the follow-up request carrying the tool_result."""

import json
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

LOG = sys.argv[2]
TOOL = sys.argv[3:] == ["tool"]
lock = threading.Lock()


def reply(body: dict) -> tuple[list[dict], str]:
    last = (body.get("messages") or [{}])[-1].get("content")
    answered = isinstance(last, list) and any(b.get("type") == "tool_result" for b in last)
    if TOOL and not answered and "Bash" in [t.get("name") for t in body.get("tools") or []]:
        return [{"type": "text", "text": "I will list the files."},
                {"type": "tool_use", "id": "toolu_01" + uuid.uuid4().hex[:22], "name": "Bash",
                 "input": {"command": "ls", "description": "List files"}}], "tool_use"
    return [{"type": "text", "text": "There are no files here."}], "end_turn"


def events(msg: dict) -> bytes:
    out = [{"type": "message_start", "message": {**msg, "content": [], "stop_reason": None}}]
    for i, b in enumerate(msg["content"]):
        if b["type"] == "text":
            start, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": b["text"]}
        else:
            start, delta = {**b, "input": {}}, {"type": "input_json_delta", "partial_json": json.dumps(b["input"])}
        out += [{"type": "content_block_start", "index": i, "content_block": start},
                {"type": "content_block_delta", "index": i, "delta": delta},
                {"type": "content_block_stop", "index": i}]
    out += [{"type": "message_delta", "delta": {"stop_reason": msg["stop_reason"], "stop_sequence": None},
             "usage": {"output_tokens": msg["usage"]["output_tokens"]}}, {"type": "message_stop"}]
    return b"".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in out)


class Recorder(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def send(self, status: int, data: bytes, kind: str = "application/json"):
        self.send_response(status)
        self.send_header("content-type", kind)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def handle_one(self):
        raw = self.rfile.read(int(self.headers.get("content-length") or 0))
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode("utf-8", "replace")
        url = urlsplit(self.path)
        with lock, open(LOG, "a") as f:
            f.write(json.dumps({"time": time.time(), "method": self.command, "path": url.path, "query": url.query,
                                "headers": dict(self.headers.items()), "body": body}) + "\n")
        if self.command == "POST" and url.path == "/v1/messages/count_tokens":
            return self.send(200, b'{"input_tokens": 1234}')
        if self.command != "POST" or url.path != "/v1/messages":
            return self.send(404, b'{"type": "error", "error": {"type": "not_found_error", "message": "not here"}}')
        content, stop = reply(body)
        msg = {"id": "msg_" + uuid.uuid4().hex, "type": "message", "role": "assistant", "model": body.get("model"),
               "content": content, "stop_reason": stop, "stop_sequence": None,
               "usage": {"input_tokens": 100, "output_tokens": 10}}
        if body.get("stream"):
            return self.send(200, events(msg), "text/event-stream")
        self.send(200, json.dumps(msg).encode())

    do_GET = do_HEAD = do_POST = handle_one


if __name__ == "__main__":
    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Recorder).serve_forever()
