"""Teacher backends: any OpenAI-compatible chat-completions server, or a local causal LM.

The HTTP client uses only the standard library. vLLM (``vllm serve MODEL``), TGI and hosted
APIs all serve ``POST {base_url}/chat/completions``. Retries with exponential backoff and
jitter on 429, 5xx, connection errors and timeouts; ``Retry-After`` is honoured up to the
backoff cap. Authentication and not-found errors stop the build (the configuration is wrong);
other 4xx answers fail only the current request.
"""
from __future__ import annotations

import http.client
import json
import random
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, Protocol

from iga_ds.errors import UserError

RETRYABLE_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})
FATAL_STATUS = frozenset({401, 403, 404})


class TeacherError(Exception):
    """A request failed for good; the seed is retried on the next run."""


class TeacherRejected(TeacherError):
    """The server refused this request (e.g. 400: prompt too long); the group is dropped."""


class ChatClient(Protocol):
    def chat(self, messages: list[dict]) -> str: ...


class Counters:
    """Thread-safe counts shown on the progress bar and written to stats.json."""

    def __init__(self):
        self._lock = threading.Lock()
        self.values: dict[str, int] = {}

    def add(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.values[key] = self.values.get(key, 0) + n

    def get(self, key: str) -> int:
        with self._lock:
            return self.values.get(key, 0)


def resolve_api_key(env_var: str | None, key_file: str | None) -> str | None:
    """The key from ``--api-key-file`` or the named environment variable; never printed."""
    import os

    if key_file:
        try:
            key = Path(key_file).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise UserError(f"--api-key-file {key_file}: cannot read ({exc.strerror})") from None
        except UnicodeDecodeError:
            raise UserError(f"--api-key-file {key_file}: not UTF-8 text") from None
        if not key:
            raise UserError(f"--api-key-file {key_file}: the file is empty")
        return key
    if env_var:
        return os.environ.get(env_var) or None
    return None


class OpenAIChatClient:
    """``POST {base_url}/chat/completions`` with retries; returns the first choice's text."""

    def __init__(self, base_url: str, model: str, api_key: str | None = None,
                 temperature: float = 0.7, max_tokens: int = 1024, timeout: float = 120.0,
                 max_retries: int = 6, backoff: float = 1.0, max_backoff: float = 60.0,
                 counters: Counters | None = None, sleep: Callable[[float], None] = time.sleep):
        if not base_url.startswith(("http://", "https://")):
            raise UserError(f"--base-url {base_url!r}: expected http://HOST:PORT/v1 or https://...")
        base = base_url.rstrip("/")
        self.url = base if base.endswith("/chat/completions") else base + "/chat/completions"
        self.model = model
        self._api_key = api_key
        self.temperature, self.max_tokens, self.timeout = temperature, max_tokens, timeout
        self.max_retries, self.backoff, self.max_backoff = max_retries, backoff, max_backoff
        self.counters = counters or Counters()
        self._sleep = sleep

    def __repr__(self) -> str:  # never show the key
        return f"OpenAIChatClient(url={self.url!r}, model={self.model!r})"

    def _request(self, body: bytes) -> bytes:
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        req = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
        with urllib.request.urlopen(req, timeout=self.timeout) as resp:
            return resp.read()

    def _wait(self, attempt: int, retry_after: str | None) -> None:
        delay = self.backoff * (2 ** attempt)
        if retry_after:
            try:
                delay = max(delay, float(retry_after))
            except ValueError:
                pass
        delay = min(delay, self.max_backoff) * (0.5 + random.random() / 2)
        self._sleep(delay)

    def chat(self, messages: list[dict]) -> str:
        body = json.dumps({"model": self.model, "messages": messages,
                           "temperature": self.temperature, "max_tokens": self.max_tokens}).encode()
        last = "no attempt"
        for attempt in range(self.max_retries + 1):
            self.counters.add("requests")
            retry_after = None
            try:
                raw = self._request(body)
            except urllib.error.HTTPError as exc:
                status = exc.code
                retry_after = exc.headers.get("Retry-After") if exc.headers else None
                exc.close()
                if status in FATAL_STATUS:
                    what = {401: "unauthorized (check the API key)", 403: "forbidden (check the API key)",
                            404: "not found (check --base-url and --model)"}[status]
                    raise UserError(f"teacher server {self.url}: HTTP {status} {what}") from None
                if status not in RETRYABLE_STATUS:
                    raise TeacherRejected(f"HTTP {status}") from None
                last = f"HTTP {status}"
            except (urllib.error.URLError, http.client.HTTPException, ConnectionError,
                    socket.timeout, TimeoutError) as exc:
                last = f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"
            else:
                return _first_choice_text(raw)
            if attempt < self.max_retries:
                self.counters.add("http_retries")
                self._wait(attempt, retry_after)
        raise TeacherError(f"{self.url}: gave up after {self.max_retries + 1} attempts ({last})")


def _first_choice_text(raw: bytes) -> str:
    """The reply text, or "" for a reply without one (the caller treats it as malformed)."""
    try:
        obj = json.loads(raw)
        content = obj["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError):
        return ""
    return content if isinstance(content, str) else ""


class LocalCausalLMClient:
    """A transformers causal LM run in-process from a local directory (no remote code)."""

    def __init__(self, model_dir: str, max_new_tokens: int = 512, temperature: float = 0.7,
                 device: str | None = None, counters: Counters | None = None):
        path = Path(model_dir)
        if not path.is_dir():
            raise UserError(f"--model {model_dir}: with --teacher local, expected a local "
                            "directory holding a transformers model (config.json, weights, tokenizer)")
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path)
            self.model = AutoModelForCausalLM.from_pretrained(path)
        except (OSError, ValueError) as exc:
            raise UserError(f"--model {model_dir}: cannot load a causal LM ({exc})") from None
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.model.to(self.device).eval()
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.counters = counters or Counters()
        self._lock = threading.Lock()  # one generate at a time: the model is shared

    def _prompt_ids(self, messages: list[dict]):
        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            enc = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                          return_dict=True, return_tensors="pt")
            return enc["input_ids"]
        text = "".join(f"{m['role']}: {m['content']}\n\n" for m in messages) + "assistant:"
        return tok(text, return_tensors="pt")["input_ids"]

    def chat(self, messages: list[dict]) -> str:
        import torch

        self.counters.add("requests")
        ids = self._prompt_ids(messages).to(self.device)
        pad = self.tokenizer.pad_token_id
        if pad is None:
            pad = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else 0
        kwargs = {"max_new_tokens": self.max_new_tokens, "pad_token_id": pad,
                  "attention_mask": torch.ones_like(ids)}
        if self.temperature > 0:
            kwargs.update(do_sample=True, temperature=self.temperature)
        else:
            kwargs.update(do_sample=False)
        with self._lock, torch.no_grad():
            out = self.model.generate(ids, **kwargs)
        return self.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
