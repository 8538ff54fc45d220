"""Teacher backends: any OpenAI-compatible chat-completions server, or a causal LM in this process.

The HTTP client is httpx (docs/TEACHER.md says why): one pool of keep-alive connections shared by
the build's threads. vLLM (``vllm serve MODEL``), TGI, llama.cpp's server and hosted APIs all
serve ``POST {base_url}/chat/completions``.

- Retries with exponential backoff and jitter on 408/409/425/429, 5xx, connection errors and
  timeouts; ``Retry-After`` is honoured up to the backoff cap. When the retries are spent the
  error says the last cause ("connection refused to http://...").
- 401/403/404 stop the build (the key, the URL or the model name is wrong). Any other 4xx is a
  :class:`TeacherRejected` carrying the server's message; the pipeline decides whether it is
  the seed's fault or the setup's.
- JSON mode: a request may ask for ``response_format={"type": "json_object"}`` (vLLM, OpenAI,
  llama.cpp support it). A server that refuses it (a 400 or 422 naming ``response_format``)
  gets the request again without it, and no JSON mode for the rest of the build.
- Redirects are followed (at most 5, the POST kept as it is), but the ``Authorization`` header
  only goes to the origin (scheme, host and port) of ``--base-url``: once a redirect leaves it,
  the key is not sent again for that request. A key sent over plain HTTP to a host that is not
  this machine is warned about once.
- Credentials in ``--base-url`` (``http://user:password@host/v1``) go to the server as basic
  auth and never into a message, a log line or the client's ``repr``: the URL is shown as
  ``http://***@host/v1`` (:func:`redact_url`).
"""
from __future__ import annotations

import ipaddress
import json
import logging
import os
import random
import ssl
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import httpx

from iga_ds.errors import UserError
from iga_ds.models import load_auto_tokenizer, load_causal_lm

log = logging.getLogger(__name__)

RETRYABLE_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})
FATAL_STATUS = {401: "unauthorized (check the API key)", 403: "forbidden (check the API key)",
                404: "not found (check --base-url and --model)"}
REDIRECT_STATUS = frozenset({301, 302, 303, 307, 308})
MAX_REDIRECTS = 5
JSON_MODE = {"type": "json_object"}
_MESSAGE_CHARS = 300


class TeacherError(Exception):
    """A request failed for good in this run; the seed stays to do and the next run retries it."""


class TeacherRejected(TeacherError):
    """The server refused the request (a 4xx other than 401/403/404), with its message."""

    def __init__(self, status: int, message: str, url: str):
        super().__init__(f"HTTP {status} from {url}: {message}" if message else f"HTTP {status} from {url}")
        self.status, self.message = status, message


class ChatClient(Protocol):
    def chat(self, messages: list[dict], json_reply: bool = False) -> str: ...


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


def is_local_host(host: str) -> bool:
    """Whether ``host`` is this machine: ``localhost`` or a loopback address."""
    host = host.strip("[]").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def server_message(body: bytes) -> str:
    """The error message of a refused request on one line: the ``error.message`` of OpenAI and
    vLLM, TGI's ``error``, FastAPI's ``detail``, or the body's text."""
    text = body.decode("utf-8", "replace")
    try:
        obj = json.loads(text)
    except ValueError:
        obj = None
    if isinstance(obj, dict):
        found = obj.get("error", obj.get("message", obj.get("detail")))
        if isinstance(found, dict):
            found = found.get("message", found)
        if found is not None:
            text = found if isinstance(found, str) else json.dumps(found)
    text = " ".join(text.split())
    return text if len(text) <= _MESSAGE_CHARS else text[:_MESSAGE_CHARS - 3] + "..."


def redact_url(url: str | httpx.URL) -> str:
    """``url`` as it may be shown: its user name and password (if any) replaced by ``***``."""
    text = str(url)
    try:
        parsed = httpx.URL(text)
    except (httpx.InvalidURL, TypeError, ValueError):
        return _redact_userinfo_text(text)
    return str(parsed.copy_with(userinfo=b"***")) if parsed.userinfo else text


def _redact_userinfo_text(text: str) -> str:
    """The ``user:password@`` part of a URL that does not parse, replaced by ``***@``."""
    scheme, sep, rest = text.partition("://")
    if not sep or "@" not in rest.split("/", 1)[0]:
        return text
    return f"{scheme}://***@{rest.split('@', 1)[1]}"


def _refuses_json_mode(status: int, message: str) -> bool:
    text = message.lower()
    return status in (400, 422) and ("response_format" in text or "json_object" in text)


class OpenAIChatClient:
    """``POST {base_url}/chat/completions`` with retries; returns the first choice's text.

    Thread-safe: each thread that calls :meth:`chat` keeps its own keep-alive connection.
    """

    def __init__(self, base_url: str, model: str, api_key: str | None = None,
                 temperature: float = 0.7, max_tokens: int = 1024, timeout: float = 120.0,
                 max_retries: int = 6, backoff: float = 1.0, max_backoff: float = 60.0,
                 counters: Counters | None = None, sleep: Callable[[float], None] = time.sleep,
                 json_mode: bool = True):
        if not base_url.startswith(("http://", "https://")):
            raise UserError(f"--base-url {redact_url(base_url)!r}: expected http://HOST:PORT/v1 or https://...")
        # the command line checks its options; a library caller gets the same checks here, or a
        # negative max_retries would make no attempt at all and a negative backoff fail mid-build
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"max_retries={max_retries!r}: expected an integer >= 0")
        if not timeout > 0:  # written so that NaN fails too
            raise ValueError(f"timeout={timeout!r}: expected a number > 0")
        for name, value in (("backoff", backoff), ("max_backoff", max_backoff)):
            if not value >= 0:
                raise ValueError(f"{name}={value!r}: expected a number >= 0")
        base = base_url.rstrip("/")
        self.url = httpx.URL(base if base.endswith("/chat/completions") else base + "/chat/completions")
        self.shown_url = redact_url(self.url)  # what messages say: no credentials
        self._userinfo = self.url.userinfo.decode("utf-8", "replace") if self.url.userinfo else ""
        self.model = model
        self._auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.temperature, self.max_tokens, self.timeout = temperature, max_tokens, timeout
        self.max_retries, self.backoff, self.max_backoff = max_retries, backoff, max_backoff
        self.counters = counters or Counters()
        self.json_mode = json_mode
        self._sleep = sleep
        self._local = threading.local()
        self._clients: list[httpx.Client] = []
        self._clients_lock = threading.Lock()
        self._tls: ssl.SSLContext | None = None  # one for all threads: each costs milliseconds to make
        if api_key and self.url.scheme == "http" and not is_local_host(self.url.host):
            log.warning("warning: the API key goes in clear text over plain HTTP to %s; "
                        "use an https:// --base-url", self.url.host)

    def __repr__(self) -> str:  # never show the key
        return f"OpenAIChatClient(url={self.shown_url!r}, model={self.model!r})"

    def _scrub(self, text: object) -> str:
        """``text`` with this URL's credentials, wherever they appear in it, replaced by ``***``."""
        text = str(text)
        for secret in (self._userinfo, self.url.password or ""):
            if len(secret) >= 3:  # a one-letter password would blank out every such letter
                text = text.replace(secret, "***")
        return text

    def _http(self) -> httpx.Client:
        """This thread's httpx client: one keep-alive connection per thread. A pool shared by
        all threads costs more: httpcore looks at every pooled connection on every request
        (about a third of the time at 64 threads)."""
        http = getattr(self._local, "http", None)
        if http is None:
            with self._clients_lock:
                if self._tls is None:
                    self._tls = ssl.create_default_context()
                http = httpx.Client(timeout=self.timeout, follow_redirects=False, verify=self._tls,
                                    headers={"Content-Type": "application/json", "Accept": "application/json"},
                                    limits=httpx.Limits(max_connections=1, max_keepalive_connections=1))
                self._clients.append(http)
            self._local.http = http
        return http

    def close(self) -> None:
        with self._clients_lock:
            for http in self._clients:
                http.close()
            self._clients.clear()

    def __enter__(self) -> OpenAIChatClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _post(self, payload: bytes):
        """POST to the URL, following redirects; the key goes only to the first URL's origin."""
        url, headers = self.url, self._auth
        for _ in range(MAX_REDIRECTS + 1):
            response = self._http().post(url, content=payload, headers=headers)
            location = response.headers.get("Location")
            if response.status_code not in REDIRECT_STATUS or not location:
                return response
            target = url.join(location)
            if (target.scheme, target.host, target.port) != (self.url.scheme, self.url.host, self.url.port):
                headers = {}  # another origin: it gets no credentials, now or after a way back
            url = target
        raise UserError(f"teacher server {self.shown_url}: more than {MAX_REDIRECTS} redirects (last to "
                        f"{redact_url(url)})")

    def _wait(self, attempt: int, retry_after: str | None) -> None:
        delay = self.backoff * (2 ** attempt)
        if retry_after:
            try:
                delay = max(delay, float(retry_after))
            except ValueError:
                pass
        delay = min(delay, self.max_backoff) * (0.5 + random.random() / 2)
        self._sleep(delay)

    def _payload(self, messages: list[dict], json_reply: bool) -> bytes:
        body = {"model": self.model, "messages": messages,
                "temperature": self.temperature, "max_tokens": self.max_tokens}
        if json_reply:
            body["response_format"] = JSON_MODE
        return json.dumps(body).encode()

    def _attempt(self, messages: list[dict], json_reply: bool) -> tuple[str | None, str, str | None]:
        """One request: (reply, "", None), or (None, why it failed, Retry-After) for a retry.

        Raises what no retry can mend: UserError for 401/403/404, TeacherRejected for other 4xx.
        """
        use_json = json_reply and self.json_mode
        try:
            response = self._post(self._payload(messages, use_json))
        except httpx.TimeoutException:
            return None, f"no answer within {self.timeout:g} s from {self.shown_url} (--timeout)", None
        except httpx.ConnectError as exc:
            reason = "connection refused" if "refused" in str(exc).lower() else f"cannot connect ({self._scrub(exc)})"
            return None, f"{reason} to {self.shown_url}", None
        except httpx.TransportError as exc:
            return None, f"{type(exc).__name__} from {self.shown_url}: {self._scrub(exc)}", None
        status = response.status_code
        if 200 <= status < 300:
            return _first_choice_text(response.content), "", None
        message = server_message(response.content)
        if use_json and _refuses_json_mode(status, message):
            self.json_mode = False  # for the rest of the build: the server has no JSON mode
            self.counters.add("json_mode_refused")
            log.warning("warning: %s refuses JSON mode (%s); asking without response_format", self.shown_url,
                        self._scrub(message))
            return self._attempt(messages, json_reply)
        if status in FATAL_STATUS:
            detail = f": {message}" if message else ""
            raise UserError(f"teacher server {self.shown_url}: HTTP {status} {FATAL_STATUS[status]}"
                            f"{self._scrub(detail)}")
        message = self._scrub(message)  # a server may echo the URL it was asked
        if status not in RETRYABLE_STATUS:
            raise TeacherRejected(status, message, self.shown_url)
        return None, f"HTTP {status} from {self.shown_url}" + (f": {message}" if message else ""), \
            response.headers.get("Retry-After")

    def chat(self, messages: list[dict], json_reply: bool = False) -> str:
        """The reply's text; ``json_reply`` asks for JSON mode where the server has it."""
        last = "no attempt"
        for attempt in range(self.max_retries + 1):
            self.counters.add("requests")
            reply, last, retry_after = self._attempt(messages, json_reply)
            if reply is not None:
                return reply
            if attempt < self.max_retries:
                self.counters.add("http_retries")
                self._wait(attempt, retry_after)
        attempts = self.max_retries + 1
        raise TeacherError(f"gave up after {attempts} attempt{'s' if attempts > 1 else ''}: {last}")


def _first_choice_text(raw: bytes) -> str:
    """The reply text, or "" for a reply without one (the caller treats it as malformed)."""
    try:
        obj = json.loads(raw)
        content = obj["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError):
        return ""
    return content if isinstance(content, str) else ""


class LocalCausalLMClient:
    """A causal LM run in this process, loaded through ``iga_ds.models``: a local folder, a hub
    id or a single .gguf file (no remote code). Prompts go through the tokenizer's chat template
    where it has one."""

    def __init__(self, model: str, max_new_tokens: int = 512, temperature: float = 0.7,
                 device: str | None = None, counters: Counters | None = None):
        import torch

        self.tokenizer = load_auto_tokenizer(model, what="--model")
        self.model = load_causal_lm(model, what="--model", dtype=torch.float32)
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.model.to(self.device).eval()
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.counters = counters or Counters()
        self._lock = threading.Lock()  # one generate at a time: the model is shared

    def prompt_ids(self, messages: list[dict]):
        """The token ids of ``messages`` as the model expects them, ready for its answer."""
        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            enc = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                          return_dict=True, return_tensors="pt")
            return enc["input_ids"]
        text = "".join(f"{m['role']}: {m['content']}\n\n" for m in messages) + "assistant:"
        return tok(text, return_tensors="pt")["input_ids"]

    def chat(self, messages: list[dict], json_reply: bool = False) -> str:
        """Generate the reply (``json_reply`` is for servers: the prompt itself asks for JSON)."""
        import torch

        self.counters.add("requests")
        ids = self.prompt_ids(messages).to(self.device)
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
