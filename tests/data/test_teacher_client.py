"""The teacher's HTTP client against real local servers, and the build command's behaviour at
its edges: connection reuse, redirects that must not carry the key to another host, the plain
HTTP warning, JSON mode and its fallback, the causes of failures, option checks, Ctrl-C, and
the in-process client on a tiny model."""
from __future__ import annotations

import json
import logging
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from iga_ds.cli import main
from iga_ds.data.teacher.clients import LocalCausalLMClient, OpenAIChatClient, TeacherError, TeacherRejected
from iga_ds.data.teacher.pipeline import BuildSettings, build
from iga_ds.errors import UserError
from teacher_server import TOO_LONG, TeacherServer, write_seeds

HELLO = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hello"}]
KEY = "sk-test-secret-123"


def client(url: str, **kw) -> OpenAIChatClient:
    return OpenAIChatClient(url, "m", backoff=0.001, max_backoff=0.01, timeout=10, **kw)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_connections_are_kept_alive_one_per_thread():
    with TeacherServer() as server, client(server.url) as c:
        for _ in range(20):
            c.chat(HELLO)
        assert len({r.client_port for r in server.teacher.requests}) == 1  # one connection, 20 requests
        server.teacher.requests.clear()
        server.teacher.delay = 0.01
        ports: dict[int, set] = {}

        def five_requests(i: int) -> None:
            for _ in range(5):
                c.chat([{"role": "user", "content": f"thread {i}"}])

        threads = [threading.Thread(target=five_requests, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for r in server.teacher.requests:
            ports.setdefault(r.body["messages"][0]["content"], set()).add(r.client_port)
        assert len(server.teacher.requests) == 40 and len(ports) == 8
        assert all(len(p) == 1 for p in ports.values())  # each thread reused its connection
        assert len(set.union(*ports.values())) == 8


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_a_redirect_to_another_host_does_not_carry_the_key(status):
    with TeacherServer() as first, TeacherServer() as second, client(first.url, api_key=KEY) as c:
        first.teacher.redirect = (status, second.url)
        assert c.chat(HELLO) == "?"
        (asked,), (moved,) = first.teacher.requests, second.teacher.requests
        assert asked.headers.get("Authorization") == f"Bearer {KEY}"
        assert "Authorization" not in moved.headers  # another port is another origin
        assert moved.body == asked.body  # the POST went on as it was


def test_a_redirect_within_the_origin_keeps_the_key():
    with TeacherServer() as server, client(server.url, api_key=KEY) as c:
        server.teacher.redirect = (308, server.url + "/moved")
        c.chat(HELLO)
        assert [r.path for r in server.teacher.requests] == ["/v1/chat/completions", "/v1/moved/chat/completions"]
        assert {r.headers.get("Authorization") for r in server.teacher.requests} == {f"Bearer {KEY}"}


@pytest.mark.parametrize("url, key, warns", [
    ("http://teacher.example.org:8000/v1", KEY, True),
    ("http://10.1.2.3:8000/v1", KEY, True),
    ("https://teacher.example.org/v1", KEY, False),
    ("http://localhost:8000/v1", KEY, False),
    ("http://127.0.0.5:8000/v1", KEY, False),
    ("http://[::1]:8000/v1", KEY, False),
    ("http://teacher.example.org:8000/v1", None, False),
])
def test_a_key_over_plain_http_to_another_machine_is_warned_about(caplog, url, key, warns):
    with caplog.at_level(logging.WARNING), OpenAIChatClient(url, "m", api_key=key):
        pass
    warned = [r.getMessage() for r in caplog.records if "plain HTTP" in r.getMessage()]
    assert bool(warned) == warns
    assert KEY not in caplog.text


def test_json_mode_is_asked_for_and_dropped_for_good_when_refused():
    with TeacherServer() as server:
        with client(server.url) as c:
            c.chat(HELLO, json_reply=True)
            c.chat(HELLO)
        asked = [r.body.get("response_format") for r in server.teacher.requests]
        assert asked == [{"type": "json_object"}, None]
        server.teacher.requests.clear()
        server.teacher.refuse_json_mode = True
        with client(server.url) as c:
            replies = [c.chat(HELLO, json_reply=True) for _ in range(3)]
            assert replies == ["?"] * 3 and c.counters.get("json_mode_refused") == 1
        asked = [r.body.get("response_format") for r in server.teacher.requests]
        assert asked == [{"type": "json_object"}, None, None, None]


@pytest.mark.parametrize("json_mode", [True, False])
def test_the_pipeline_asks_json_mode_for_the_prompts_that_ask_for_json(tmp_path, json_mode):
    seeds = write_seeds(tmp_path / "seeds.jsonl", ["if a then b; a. b?"])
    with TeacherServer() as server, client(server.url, json_mode=json_mode) as c:
        stats = build(seeds, tmp_path / "out", c, BuildSettings(model="m"), progress=False)
        assert stats["kept_groups"] == 1
        kinds = {}
        for r in server.teacher.requests:
            system = r.body["messages"][0]["content"]
            kind = next(k for k in ("extracting", "creating", "rigorous") if k in system)
            kinds.setdefault(kind, set()).add(json.dumps(r.body.get("response_format")))
    on = json.dumps({"type": "json_object"}) if json_mode else "null"
    assert kinds == {"extracting": {on}, "creating": {on}, "rigorous": {"null"}}


def test_a_refusal_carries_the_server_message_and_is_not_retried():
    with TeacherServer() as server, client(server.url) as c:
        with pytest.raises(TeacherRejected, match="HTTP 400 from http://127.0.0.1:.*: " + TOO_LONG[:30]) as info:
            c.chat([{"role": "user", "content": "[reject] a long prompt"}])
        assert info.value.status == 400 and len(server.teacher.requests) == 1


def test_a_wrong_model_stops_with_the_server_message():
    with TeacherServer() as server, client(server.url) as c:
        server.teacher.refuse_all = (404, "The model `m` does not exist.")
        with pytest.raises(UserError, match=r"HTTP 404 not found \(check --base-url and --model\): "
                                            r"The model `m` does not exist\.$"):
            c.chat(HELLO)


def test_spent_retries_say_their_last_cause():
    port = closed_port()
    with client(f"http://127.0.0.1:{port}/v1", max_retries=1) as c, pytest.raises(TeacherError) as info:
        c.chat(HELLO)
    assert str(info.value) == (f"gave up after 2 attempts: connection refused to "
                               f"http://127.0.0.1:{port}/v1/chat/completions")


def test_the_build_command_prints_the_cause_of_seeds_left_to_do(tmp_path, capsys):
    seeds = write_seeds(tmp_path / "seeds.jsonl", ["p"])
    port = closed_port()
    assert main(["data", "build", "--seeds", str(seeds), "--out", str(tmp_path / "o"), "--base-url",
                 f"http://127.0.0.1:{port}/v1", "--model", "m", "--max-retries", "1", "--backoff", "0.001",
                 "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert (f"1 seeds still to do (this run: 1 failed after retries, 0 refused by the server; last: gave up "
            f"after 2 attempts: connection refused to http://127.0.0.1:{port}/v1/chat/completions); run the "
            "same command again to resume") in err


@pytest.mark.parametrize("argument, value, message", [
    ("max_retries", -1, "max_retries=-1: expected an integer >= 0"),
    ("max_retries", 1.5, "max_retries=1.5: expected an integer >= 0"),
    ("timeout", 0, "timeout=0: expected a number > 0"),
    ("timeout", float("nan"), "timeout=nan: expected a number > 0"),
    ("backoff", -1.0, "backoff=-1.0: expected a number >= 0"),
    ("max_backoff", -1.0, "max_backoff=-1.0: expected a number >= 0"),
])
def test_the_client_checks_its_numbers_as_the_command_line_does(argument, value, message):
    # a library caller skips the command line's checks: max_retries=-1 used to make no attempt
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        OpenAIChatClient("http://127.0.0.1:9/v1", "m", **{argument: value})
    with OpenAIChatClient("http://127.0.0.1:9/v1", "m", max_retries=0, backoff=0.0) as edge:
        assert edge.max_retries == 0


@pytest.mark.parametrize("option, value, message", [
    ("--max-retries", "-1", "--max-retries -1: expected a number >= 0"),
    ("--concurrency", "0", "--concurrency 0: expected a number >= 1"),
    ("--timeout", "0", "--timeout 0.0: expected a number > 0"),
    ("--timeout", "nan", "--timeout nan: expected a number > 0"),
    ("--backoff", "-0.5", "--backoff -0.5: expected a number >= 0"),
    ("--max-tokens", "0", "--max-tokens 0: expected a number >= 1"),
    ("--temperature", "-1", "--temperature -1.0: expected a number >= 0"),
    ("--max-regenerations", "-1", "--max-regenerations -1: expected a number >= 0"),
    ("--max-step-diff", "-2", "--max-step-diff -2: expected a number >= 0"),
    ("--min-score", "1.5", "--min-score 1.5: expected a number in [0, 1]"),
    ("--shard", "4/4", "--shard 4/4: expected 0 <= I < N"),
    ("--shard", "two", "--shard 'two': expected I/N"),
])
def test_option_values_are_checked_before_anything_is_written(tmp_path, capsys, option, value, message):
    seeds = write_seeds(tmp_path / "seeds.jsonl", ["p"])
    out = tmp_path / "o"
    assert main(["data", "build", "--seeds", str(seeds), "--out", str(out), "--base-url",
                 "http://127.0.0.1:9/v1", "--model", "m", option, value]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"iga-ds: error: {message}") and err.count("\n") == 1
    assert not out.exists()


def test_the_client_benchmark_writes_its_three_rows(tmp_path, monkeypatch, capsys):
    import bench_teacher_client  # bench/ is on the path: pytest's pythonpath option (pyproject.toml)

    out = tmp_path / "bench.json"
    monkeypatch.setattr(sys, "argv", ["bench_teacher_client.py", "--concurrency", "4", "--requests", "40",
                                      "--repeat", "1", "--seeds", "3", "--out", str(out)])
    bench_teacher_client.main()  # against its own local server, in a process of its own
    rows = json.loads(out.read_text())["rows"]
    assert [row["what"] for row in rows] == ["server alone", "OpenAIChatClient", "pipeline"]
    assert [row["requests"] for row in rows] == [40, 40, 3 * 9]  # a seed: its DAG, 4 instances, 4 checks
    assert all(row["concurrency"] == 4 and len(row["rates"]) == 1 and row["median"] > 0 for row in rows)
    assert "| pipeline" in capsys.readouterr().out


@pytest.mark.slow
def test_ctrl_c_stops_at_once_and_the_build_resumes(tmp_path):
    seeds = write_seeds(tmp_path / "seeds.jsonl", [f"p{i}" for i in range(8)])
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "iga_ds.cli", "data", "build", "--seeds", str(seeds), "--out", str(out),
           "--base-url", "URL", "--model", "m", "--concurrency", "4", "--no-progress"]
    with TeacherServer() as server:
        cmd[cmd.index("URL")] = server.url
        server.teacher.delay = 120  # every request hangs: only abandoning them ends the build quickly
        # Ctrl-C's default action, as in a terminal: a suite started in the background of a
        # non-interactive shell ignores SIGINT, and Python keeps an ignored SIGINT ignored
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        deadline = time.monotonic() + 60
        while server.teacher.in_flight < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.teacher.in_flight == 4
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        took = time.monotonic() - sent
        assert proc.returncode == 130 and "iga-ds: interrupted" in err.decode(), err.decode()
        assert took < 5, f"Ctrl-C took {took:.1f} s"
        stats = json.loads((out / "stats.json").read_text())
        assert stats["pending_seeds"] == 8 and not (out / "dropped.jsonl").exists()
        server.teacher.delay = 0
        assert subprocess.run(cmd, capture_output=True, timeout=120, check=False).returncode == 0
    assert json.loads((out / "stats.json").read_text())["kept_groups"] == 8
    assert len((out / "isomers.jsonl").read_text().splitlines()) == 8 * 4


def _tiny_chat_model(folder: Path) -> Path:
    """A random LLaMA of a few thousand weights and a word-level tokenizer with a chat template."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = ["<unk>", "<eos>", "<|user|>", "<|assistant|>", "<|system|>", "hello", "You", "are", "terse", ".",
             "yes", "no", "score"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
    fast.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
                          "{% if add_generation_prompt %}<|assistant|> {% endif %}")
    fast.save_pretrained(folder)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(words), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                 eos_token_id=1, bos_token_id=1, pad_token_id=1)).save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_the_local_client_loads_through_the_model_resolver_and_uses_the_chat_template(tmp_path):
    import torch

    folder = _tiny_chat_model(tmp_path / "tiny")
    local = LocalCausalLMClient(str(folder), max_new_tokens=6, temperature=0.0, device="cpu")
    ids = local.prompt_ids(HELLO)
    text = "<|system|> You are terse. <|user|> hello <|assistant|> "
    assert ids[0].tolist() == local.tokenizer(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        greedy = local.model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=1,
                                      attention_mask=torch.ones_like(ids))
    assert local.chat(HELLO, json_reply=True) == local.tokenizer.decode(greedy[0, ids.shape[1]:],
                                                                        skip_special_tokens=True)
    assert local.counters.get("requests") == 1
