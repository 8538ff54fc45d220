"""Teacher pipeline against a real local HTTP server speaking chat-completions.

The server answers each of the three prompts with scripted replies. Directives in the seed
problem steer it: ``[dag-bad]`` (DAG never parses), ``[low]`` (verification score 0.5),
``[spread]`` (the legal CoT is always much longer), ``[flaky]`` (the first math instance is
malformed), ``[types]`` (the science answer is a number, the others yes/no). A script of
HTTP statuses (429, 500, ...) can precede the normal replies.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from iga_ds.cli import main
from iga_ds.data.schema import read_isomer_jsonl
from iga_ds.data.teacher.clients import Counters, OpenAIChatClient, TeacherError
from iga_ds.data.teacher.parse import MalformedOutput, parse_instance, parse_verification
from iga_ds.data.teacher.pipeline import BuildSettings, build
from iga_ds.errors import UserError
from teacher_server import DAG  # the seed DAG every scripted teacher of these tests returns
from teacher_server import QuietServer



class ScriptedTeacher:
    def __init__(self, delay: float = 0.0):
        self.delay = delay
        self.statuses: list[int] = []  # served (and popped) before any normal reply
        self.lock = threading.Lock()
        self.in_flight = 0
        self.max_in_flight = 0
        self.requests = 0
        self.auth_headers: list[str | None] = []
        self.per_key = Counter()

    def reply(self, messages: list[dict]) -> str:
        system, user = messages[0]["content"], messages[-1]["content"]
        directives = set(re.findall(r"\[([a-z-]+)\]", user))
        if "extracting logical structure" in system:
            if "dag-bad" in directives:
                return "Sure! Here is the DAG: nodes a, b."
            dag = dict(DAG, logical_form="modus ponens " + " ".join(f"[{d}]" for d in sorted(directives)))
            return "```json\n" + json.dumps(dag) + "\n```"
        if "creating domain-specific" in system:
            domain = re.search(r"Target domain: (\w+)", user).group(1)
            with self.lock:
                self.per_key[(user, domain)] += 1
                n = self.per_key[(user, domain)]
            if "flaky" in directives and domain == "math" and n == 1:
                return '{"problem": "unterminated'
            # each step names the DAG nodes it uses and derives: the paper's filter compares them with the DAG
            steps = [{"text": "premise holds", "uses": [], "derives": "a"},
                     {"text": "so the conclusion holds", "uses": ["a"], "derives": "b"}]
            if "spread" in directives and domain == "legal":
                steps = [f"step {i}" for i in range(7)]
            answer = 3 if ("types" in directives and domain == "science") else "yes"
            return json.dumps({"problem": f"A {domain} problem: if a then b; a. Is b true?",
                               "cot_solution": steps, "answer": answer, "alignment_score": 0.9})
        if "rigorous logical reasoning evaluator" in system:
            score = 0.5 if "low" in directives else 0.93
            return f"1. yes\n2. yes\n3. yes\nScore: {score}\nVerdict: {'PASS' if score >= 0.85 else 'FAIL'}"
        return "?"


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # keep test output clean
        pass

    def do_POST(self):
        teacher: ScriptedTeacher = self.server.teacher
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with teacher.lock:
            teacher.requests += 1
            teacher.auth_headers.append(self.headers.get("Authorization"))
            teacher.in_flight += 1
            teacher.max_in_flight = max(teacher.max_in_flight, teacher.in_flight)
            status = teacher.statuses.pop(0) if teacher.statuses else 200
        try:
            if teacher.delay:
                time.sleep(teacher.delay)
            if self.path != "/v1/chat/completions":
                status = 404
            if status != 200:
                self.send_response(status)
                if status == 429:
                    self.send_header("Retry-After", "0")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            content = teacher.reply(body["messages"])
            data = json.dumps({"id": "x", "object": "chat.completion", "model": body["model"],
                               "choices": [{"index": 0, "finish_reason": "stop",
                                            "message": {"role": "assistant", "content": content}}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        finally:
            with teacher.lock:
                teacher.in_flight -= 1


@pytest.fixture
def server():
    httpd = QuietServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    httpd.teacher = ScriptedTeacher()
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def url(httpd) -> str:
    return f"http://127.0.0.1:{httpd.server_address[1]}/v1"


def write_seeds(path: Path, problems: list[str]) -> Path:
    path.write_text("".join(json.dumps({"seed_id": f"s{i:03d}", "problem": p}) + "\n"
                            for i, p in enumerate(problems)))
    return path


def client(httpd, **kw) -> OpenAIChatClient:
    return OpenAIChatClient(url(httpd), "teacher-model", backoff=0.001, max_backoff=0.01, timeout=10, **kw)


def run_build(tmp_path, httpd, problems, **settings_kw):
    seeds = write_seeds(tmp_path / "seeds.jsonl", problems)
    settings = BuildSettings(model="teacher-model", **settings_kw)
    return build(seeds, tmp_path / "out", client(httpd), settings, concurrency=4, progress=False)


def test_good_groups_are_kept_and_validate(tmp_path, server):
    stats = run_build(tmp_path, server, [f"If a then b. a. Is b? #{i}" for i in range(6)])
    assert stats["kept_groups"] == 6 and stats["dropped_groups"] == 0 and stats["retention"] == 1.0
    records = read_isomer_jsonl(tmp_path / "out" / "isomers.jsonl")
    assert len(records) == 24
    assert all(r["cot"].endswith("\nAnswer: yes") and r["alignment_score"] == 0.93 for r in records)
    assert json.loads((tmp_path / "out" / "stats.json").read_text())["kept_groups"] == 6
    assert server.teacher.requests == 6 * (1 + 4 * 2)


def test_filters_regeneration_and_drop_reasons(tmp_path, server):
    problems = ["ok one", "[dag-bad] p", "[low] p", "[spread] p", "[flaky] p", "[types] p", "ok two"]
    stats = run_build(tmp_path, server, problems, max_regenerations=2)
    dropped = {json.loads(line)["seed_id"]: json.loads(line)["reason"]
               for line in (tmp_path / "out" / "dropped.jsonl").read_text().splitlines()}
    assert dropped == {"s001": "dag_malformed", "s002": "low_score (math)",
                       "s003": "step_count_spread", "s005": "answer_type_mismatch"}
    assert stats["kept_groups"] == 3
    assert stats["retention"] == pytest.approx(3 / 7)
    assert stats["drop_reasons"] == {"answer_type_mismatch": 1, "dag_malformed": 1,
                                     "low_score": 1, "step_count_spread": 1}
    kept = read_isomer_jsonl(tmp_path / "out" / "isomers.jsonl")
    flaky = [r for r in kept if r["seed_id"] == "s004" and r["domain"] == "math"][0]
    assert flaky["meta"]["regenerations"] == 1
    # the DAG was asked for 1 + 2 times for the seed whose DAG never parses
    assert stats["this_run"]["malformed"] == 3 + 1


def test_retries_on_429_and_5xx_then_succeeds(tmp_path, server):
    server.teacher.statuses = [429, 500, 503, 502]
    stats = run_build(tmp_path, server, ["only seed"])
    assert stats["kept_groups"] == 1
    assert stats["this_run"]["http_retries"] == 4


def test_gives_up_after_retries_and_resume_finishes(tmp_path, server, capsys):
    server.teacher.statuses = [500] * 100
    seeds = write_seeds(tmp_path / "seeds.jsonl", ["a", "b"])
    args = ["data", "build", "--seeds", str(seeds), "--out", str(tmp_path / "out"), "--base-url",
            url(server), "--model", "m", "--max-retries", "2", "--backoff", "0.001", "--no-progress"]
    assert main(args) == 1
    assert "run the same command again" in capsys.readouterr().err
    assert not (tmp_path / "out" / "isomers.jsonl").exists()
    server.teacher.statuses = []
    assert main(args) == 0
    assert len(read_isomer_jsonl(tmp_path / "out" / "isomers.jsonl")) == 8


def test_requests_run_concurrently(tmp_path, server):
    server.teacher.delay = 0.05
    run_build(tmp_path, server, [f"p{i}" for i in range(8)])
    assert server.teacher.max_in_flight >= 3


def test_api_key_from_env_is_sent_and_never_printed(tmp_path, server, capsys, monkeypatch):
    monkeypatch.setenv("MY_TEACHER_KEY", "sk-secret-123")
    seeds = write_seeds(tmp_path / "seeds.jsonl", ["p"])
    assert main(["data", "build", "--seeds", str(seeds), "--out", str(tmp_path / "o"), "--base-url",
                 url(server), "--model", "m", "--api-key-env", "MY_TEACHER_KEY"]) == 0
    assert set(server.teacher.auth_headers) == {"Bearer sk-secret-123"}
    captured = capsys.readouterr()
    assert "sk-secret" not in captured.out + captured.err
    assert "sk-secret" not in (tmp_path / "o" / "stats.json").read_text()
    assert "sk-secret" not in (tmp_path / "o" / "build.json").read_text()


def test_unauthorized_is_a_one_line_error(tmp_path, server, capsys):
    server.teacher.statuses = [401]
    seeds = write_seeds(tmp_path / "seeds.jsonl", ["p"])
    assert main(["data", "build", "--seeds", str(seeds), "--out", str(tmp_path / "o"), "--base-url",
                 url(server), "--model", "m", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "HTTP 401" in err and err.count("\n") == 1


def test_resume_with_other_settings_is_refused(tmp_path, server):
    run_build(tmp_path, server, ["p"])
    with pytest.raises(UserError, match="min_score"):
        run_build(tmp_path, server, ["p"], min_score=0.5)


def test_torn_tail_is_repaired_without_loss_or_duplicate(tmp_path, server):
    run_build(tmp_path, server, [f"p{i}" for i in range(3)])
    kept = tmp_path / "out" / "isomers.jsonl"
    lines = kept.read_bytes().splitlines(keepends=True)
    # as if killed in the middle of writing the last group: two whole lines and half a line
    kept.write_bytes(b"".join(lines[:-2]) + lines[-2][:25])
    dropped = tmp_path / "out" / "dropped.jsonl"
    dropped.write_bytes(b'{"seed_id": "s0')
    stats = run_build(tmp_path, server, [f"p{i}" for i in range(3)])
    records = read_isomer_jsonl(kept)
    assert Counter(r["seed_id"] for r in records) == {"s000": 4, "s001": 4, "s002": 4}
    assert stats["kept_groups"] == 3 and dropped.read_bytes() == b""


def test_kill_mid_build_and_resume(tmp_path, server):
    server.teacher.delay = 0.02
    n = 40
    problems = [("[low] " if i % 5 == 0 else "") + f"problem {i}" for i in range(n)]
    seeds = write_seeds(tmp_path / "seeds.jsonl", problems)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "iga_ds.cli", "data", "build", "--seeds", str(seeds), "--out", str(out),
           "--base-url", url(server), "--model", "m", "--concurrency", "4", "--max-regenerations", "1",
           "--no-progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kept = out / "isomers.jsonl"
    deadline = time.time() + 60
    while time.time() < deadline:
        if kept.exists() and kept.stat().st_size > 0 and len(kept.read_bytes().splitlines()) >= 16:
            break
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    partial_groups = len({json.loads(x)["seed_id"] for x in kept.read_bytes().splitlines()
                          if x.endswith(b"}")})
    assert 0 < partial_groups < n * 4 // 5, "the kill should land mid-way"
    assert subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE).returncode == 0
    records = read_isomer_jsonl(kept)
    kept_seeds = Counter(r["seed_id"] for r in records)
    dropped = [json.loads(x)["seed_id"] for x in (out / "dropped.jsonl").read_text().splitlines()]
    assert set(kept_seeds.values()) == {4}
    assert len(dropped) == len(set(dropped))
    assert set(kept_seeds) | set(dropped) == {f"s{i:03d}" for i in range(n)}
    assert not set(kept_seeds) & set(dropped)
    assert sorted(dropped) == [f"s{i:03d}" for i in range(0, n, 5)]


def test_client_direct_retry_exhaustion(server):
    server.teacher.statuses = [503] * 10
    counters = Counters()
    c = client(server, max_retries=2, counters=counters)
    with pytest.raises(TeacherError, match="gave up after 3 attempts"):
        c.chat([{"role": "user", "content": "hi"}])
    assert counters.get("http_retries") == 2 and counters.get("requests") == 3


def test_unreachable_server_is_retried_then_fails(tmp_path):
    c = OpenAIChatClient("http://127.0.0.1:9/v1", "m", max_retries=1, backoff=0.001, timeout=2)
    with pytest.raises(TeacherError, match="gave up"):
        c.chat([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("text", [
    "", "no json here", '{"problem": "p"}', '{"problem": "p", "cot_solution": [], "answer": "1"}',
    '{"problem": "p", "cot_solution": ["s"], "answer": ""}', "[1, 2, 3]",
])
def test_malformed_instances_are_rejected(text):
    with pytest.raises(MalformedOutput):
        parse_instance(text)


def test_instance_parsing_normalises_steps_and_answer():
    inst = parse_instance('Here you go:\n{"problem": " A  b ", "cot_solution": "Step 1: x\\n2) y\\nAnswer: 4",'
                          ' "answer": 4, "alignment_score": "0.9"}')
    assert inst.problem == "A b" and inst.steps == ["x", "y"] and inst.answer == "4"
    assert inst.cot_text() == "x\ny\nAnswer: 4" and inst.self_score == 0.9


@pytest.mark.parametrize("text, score, verdict", [
    ("Structural alignment score: 0.91\nPASS", 0.91, "PASS"),
    ("4. Structural alignment score (0.0-1.0): 0.6 -> FAIL: step 2 missing", 0.6, "FAIL"),
    ("Score: 1\nVerdict: PASS", 1.0, "PASS"),
])
def test_verification_parsing(text, score, verdict):
    v = parse_verification(text)
    assert v.score == score and v.verdict == verdict


def test_verification_without_score_is_malformed():
    with pytest.raises(MalformedOutput):
        parse_verification("PASS, looks isomorphic")


@pytest.mark.slow
def test_local_teacher_plumbing_with_tiny_random_model(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    words = ["<unk>", "<eos>", "{", "}", '"', ":", ",", "problem", "yes", "score", "0.9", "PASS", "a", "b"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
    model_dir = tmp_path / "tiny"
    fast.save_pretrained(model_dir)
    GPT2LMHeadModel(GPT2Config(vocab_size=len(words), n_positions=4096, n_embd=16, n_layer=1,
                               n_head=2, eos_token_id=1, bos_token_id=1)).save_pretrained(model_dir)
    seeds = write_seeds(tmp_path / "seeds.jsonl", ["a b", "b a"])
    out = tmp_path / "out"
    rc = main(["data", "build", "--seeds", str(seeds), "--out", str(out), "--teacher", "local",
               "--model", str(model_dir), "--max-tokens", "6", "--max-regenerations", "1", "--no-progress"])
    assert rc == 0
    stats = json.loads((out / "stats.json").read_text())
    # random weights never emit a DAG: every seed is dropped as malformed, nothing crashes
    assert stats["dropped_groups"] == 2 and stats["drop_reasons"] == {"dag_malformed": 2}
    assert stats["this_run"]["requests"] == 4


def test_local_teacher_names_a_missing_model(tmp_path, capsys):
    seeds = write_seeds(tmp_path / "seeds.jsonl", ["p"])
    assert main(["data", "build", "--seeds", str(seeds), "--out", str(tmp_path / "o"), "--teacher", "local",
                 "--model", str(tmp_path / "teacher.gguf")]) == 2
    assert "--model: " + str(tmp_path / "teacher.gguf") + ": no such GGUF file" in capsys.readouterr().err


def test_bad_seed_file(tmp_path, capsys):
    seeds = tmp_path / "seeds.jsonl"
    seeds.write_text('{"seed_id": "a", "problem": "p"}\n{"seed_id": "a", "problem": "q"}\n')
    assert main(["data", "build", "--seeds", str(seeds), "--out", str(tmp_path / "o"), "--base-url",
                 "http://127.0.0.1:9/v1", "--model", "m"]) == 2
    assert f"{seeds}:2: field 'seed_id': 'a' already used on line 1" in capsys.readouterr().err
