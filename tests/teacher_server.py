"""A deterministic OpenAI-compatible teacher for the tests: a real HTTP/1.1 server on 127.0.0.1.

Its replies depend only on the request, so a seed gets the same outcome however often a killed
build asks again. Directives in a seed problem steer that seed:

- ``[low]``: every verification scores 0.5 (the seed is dropped as ``low_score``);
- ``[dag-bad]``: the DAG reply never parses (dropped as ``dag_malformed``);
- ``[reject]``: HTTP 400 with a message, as a server refuses a prompt longer than its context;
- ``[plain]``: the instance replies in the paper's own format, numbered steps naming no
  uses/derives nodes (``Teacher.annotate = False``: every seed does);
- ``[verdict-fail]``: every verification scores 0.9 but says FAIL.

Knobs on :class:`Teacher` act on every request: ``delay`` (seconds before answering),
``refuse_all`` (a status and message for every request), ``refuse_json_mode`` (a 400 naming
``response_format`` when a request asks for JSON mode), ``redirect`` (a status and the base URL
that a request to ``/v1/chat/completions`` is sent on to; any other path ending in
``/chat/completions`` is answered). Every request is recorded with its headers, body, client port
and the times (``time.monotonic``) it arrived and was answered, so that requests in flight at
once show. Connections are kept alive (HTTP/1.1), so connection reuse shows in the client ports.
"""
from __future__ import annotations

import json
import re
import socket
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

DAG = {"nodes": [{"id": "a", "type": "PROPOSITION", "description": "premise"},
                 {"id": "b", "type": "PROPOSITION", "description": "conclusion"},
                 {"id": "g", "type": "GOAL", "description": "is b true"}],
       "edges": [{"from": "a", "to": "b", "label": "IMPLIES"},
                 {"from": "g", "to": "b", "label": "REQUIRES"}],
       "step_count": 2}
# each step names the DAG nodes it uses and derives, as the filter compares them with the DAG
STEPS = [{"text": "premise holds", "uses": [], "derives": "a"},
         {"text": "so the conclusion holds", "uses": ["a"], "derives": "b"}]
# the same steps in the paper's own format: numbered, naming no nodes
PLAIN_STEPS = "1. The premise holds.\n2. So the conclusion holds."
TOO_LONG = "This model's maximum context length is 2048 tokens; the messages of this request are longer"


@dataclass
class Request:
    path: str
    headers: dict[str, str]
    body: dict | None
    client_port: int
    arrived: float = 0.0
    answered: float = float("inf")  # until the reply is written

    def overlaps(self, other: Request) -> bool:
        """Whether the two were in flight at one moment."""
        return self.arrived < other.answered and other.arrived < self.answered


class Teacher:
    """The replies and the knobs; thread-safe."""

    def __init__(self):
        self.lock = threading.Lock()
        self.stopped = threading.Event()  # set when the server shuts down: ends every wait
        self.requests: list[Request] = []
        self.in_flight = 0
        self.delay = 0.0
        self.refuse_all: tuple[int, str] | None = None
        self.refuse_json_mode = False
        self.redirect: tuple[int, str] | None = None
        self.annotate = True

    def reply(self, messages: list[dict], json_mode: bool) -> str:
        system, user = messages[0]["content"], messages[-1]["content"]
        directives = set(re.findall(r"\[([a-z-]+)\]", user))
        if "extracting logical structure" in system:
            if "dag-bad" in directives:
                return "Sure! Here is the DAG: nodes a, b."
            dag = json.dumps(dict(DAG, logical_form="modus ponens " + " ".join(f"[{d}]" for d in sorted(directives))))
            return dag if json_mode else "```json\n" + dag + "\n```"
        if "creating domain-specific" in system:
            domain = re.search(r"Target domain: (\w+)", user).group(1)
            plain = "plain" in directives or not self.annotate
            steps = PLAIN_STEPS if plain else STEPS
            return json.dumps({"problem": f"A {domain} problem: if a then b; a. Is b true?",
                               "cot_solution": steps, "answer": "yes", "alignment_score": 0.9})
        if "rigorous logical reasoning evaluator" in system:
            if "verdict-fail" in directives:
                return "1. yes\n2. no\n3. no\n4. 0.9\nFAIL: problem 2 needs one step more than the seed"
            score = 0.5 if "low" in directives else 0.93
            return f"1. yes\n2. yes\n3. yes\nScore: {score}\nVerdict: {'PASS' if score >= 0.85 else 'FAIL'}"
        return "?"

    def answer(self, path: str, body: dict | None) -> tuple[int, dict[str, str], bytes]:
        """(status, headers, body) of the reply to one request."""
        if self.redirect is not None and path == "/v1/chat/completions":
            status, base = self.redirect
            return status, {"Location": base.rstrip("/") + "/chat/completions"}, b""
        if not path.endswith("/chat/completions") or body is None:
            return 404, {}, _error("no such route")
        if self.refuse_all is not None:
            return self.refuse_all[0], {}, _error(self.refuse_all[1])
        json_mode = body.get("response_format") == {"type": "json_object"}
        if json_mode and self.refuse_json_mode:
            return 400, {}, _error("response_format is not supported by this server")
        if "[reject]" in json.dumps(body["messages"]):
            return 400, {}, _error(TOO_LONG)
        content = self.reply(body["messages"], json_mode)
        return 200, {"Content-Type": "application/json"}, json.dumps(
            {"id": "x", "object": "chat.completion", "model": body.get("model"),
             "choices": [{"index": 0, "finish_reason": "stop",
                          "message": {"role": "assistant", "content": content}}]}).encode()


def _error(message: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "invalid_request_error"}}).encode()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive

    def setup(self):
        super().setup()
        # the reply goes out in two writes (head, body): without this, Nagle's algorithm holds
        # the body until the client's delayed ACK, 40 ms a request
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, *args):  # keep test output clean
        pass

    def do_POST(self):
        teacher: Teacher = self.server.teacher
        raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        request = Request(self.path, dict(self.headers), body, self.client_address[1], time.monotonic())
        with teacher.lock:
            teacher.requests.append(request)
            teacher.in_flight += 1
        try:
            if teacher.delay:
                teacher.stopped.wait(teacher.delay)
            status, headers, data = teacher.answer(self.path, body)
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        finally:
            with teacher.lock:
                teacher.in_flight -= 1
                request.answered = time.monotonic()


class QuietServer(ThreadingHTTPServer):
    """A threading HTTP server that takes a client hanging up as no error."""

    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        # a client that hung up (a pipeline that stopped early closes its pooled connections)
        # is no error of the server's; its traceback on stderr would land in what tests read
        if isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)):
            return
        super().handle_error(request, client_address)


class TeacherServer:
    """``with TeacherServer() as server:`` serves ``server.teacher`` at ``server.url``."""

    def __init__(self, teacher: Teacher | None = None):
        self.teacher = teacher or Teacher()
        self.httpd = QuietServer(("127.0.0.1", 0), _Handler)
        self.httpd.teacher = self.teacher
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> TeacherServer:
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.teacher.stopped.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def write_seeds(path, problems: list[str]):
    """A seeds file with ids s000, s001, ... for ``problems``."""
    path.write_text("".join(json.dumps({"seed_id": f"s{i:03d}", "problem": p}) + "\n" for i, p in enumerate(problems)))
    return path
