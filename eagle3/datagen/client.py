"""The async generation loop: a bounded pool of workers, retries with backoff, a failure budget.

`concurrency` workers pull prompts from one shared iterator, so at most that many requests are
in flight and memory stays flat however many prompts there are. A request that fails with a
retryable error (429, 5xx, 408/409, timeout, connection error) is retried with exponential
backoff and jitter (honouring Retry-After); other errors (400, 401, 404...) fail the sample at
once. A failed sample goes to errors.jsonl; when failed samples exceed the budget the loop stops
taking new prompts and the run fails with a summary.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable
from urllib.parse import urlsplit, urlunsplit

import openai

from eagle3.datagen.prompts import Prompt
from eagle3.datagen.config import ClientConfig, DatasetSpec
from eagle3.datagen.redact import redact, redact_secrets, redacting_logger, register_secret

log = redacting_logger(__name__)
# one INFO line per HTTP request drowns the progress lines at 2000 in flight
for _name in ("httpx", "httpx2", "openai"):
    logging.getLogger(_name).setLevel(logging.WARNING)

RETRYABLE_STATUS = {408, 409, 429}
AUTH_STATUS = {401, 403}
SDK_PARAMS = {"model", "messages", "max_tokens", "temperature", "top_p", "seed"}
MAX_RETRY_AFTER_S = 120.0
TOO_LONG = "too_long"
# what servers answer (HTTP 400) to a prompt that does not fit their context: llama.cpp's server
# ("the request exceeds the available context size", type exceed_context_size_error), llama-cpp-python,
# OpenAI and vLLM ("This model's maximum context length is N tokens", code context_length_exceeded),
# older vLLM ("The decoder prompt (length N) is longer than the maximum model length of M") and SGLang
# ("The input (N tokens) is longer than the model's context length", "Requested token count exceeds the
# model's maximum context length"). No retry and no other request makes such a prompt fit.
TOO_LONG_MESSAGE = re.compile(
    r"(?i)exceeds? the available context size|exceed_context_size|context_length_exceeded|"
    r"maximum context length|longer than the (?:model's context length|maximum model length)")


@dataclass
class Endpoint:
    """An OpenAI-compatible base URL and its API key. A `user:key@` in the URL is credentials, not address:
    it is taken out of `base_url` (which is printed and written) and its key is the API key when none is
    given. The key is registered for redaction and never printed."""

    base_url: str
    api_key: str = field(default="EMPTY", repr=False)

    def __post_init__(self) -> None:
        parts = urlsplit(self.base_url)
        if parts.username is not None or parts.password is not None:
            url_key = parts.password or parts.username or ""
            if not self.api_key or self.api_key == "EMPTY":
                self.api_key = url_key
            register_secret(url_key)
            host = parts.hostname or ""
            netloc = f"[{host}]" if ":" in host else host
            self.base_url = urlunsplit(parts._replace(netloc=netloc + (f":{parts.port}" if parts.port else "")))
        self.base_url = self.base_url.rstrip("/")
        register_secret(self.api_key)


class SampleFailed(Exception):
    """A sample that failed for good; the message is redacted (it goes to errors.jsonl and the logs)."""

    def __init__(self, reason: str, message: str, attempts: int):
        message = redact(message)
        super().__init__(f"{reason}: {message}")
        self.reason, self.message, self.attempts = reason, message, attempts


@dataclass
class RunStats:
    """Live counters of this run (the report's per-run part and the progress line)."""

    total: int = 0  # samples to generate in this run
    done: int = 0
    failed: int = 0  # counted against the failure budget
    too_long: int = 0  # prompts the endpoint rejected as longer than its context: bad input, not failures
    redacted_secrets: int = 0  # API keys masked in answers
    requests: int = 0  # successful HTTP completions
    prompt_tokens: int = 0
    completion_tokens: int = 0
    retries: Counter = field(default_factory=Counter)
    failures: Counter = field(default_factory=Counter)
    started: float = field(default_factory=time.monotonic)
    aborted: str | None = None

    def elapsed(self) -> float:
        return max(time.monotonic() - self.started, 1e-9)

    def progress_line(self, name: str, cfg: ClientConfig) -> str:
        el = self.elapsed()
        fin = self.done + self.failed + self.too_long
        rate = fin / el
        eta = (self.total - fin) / rate if rate > 0 else float("inf")
        cost = cost_usd(self.prompt_tokens, self.completion_tokens, cfg)
        return (f"{name}: {fin}/{self.total} ({100.0 * fin / max(self.total, 1):.1f}%) done={self.done} "
                f"failed={self.failed} too_long={self.too_long} retries={sum(self.retries.values())} "
                f"{self.requests / el:.1f} req/s "
                f"{(self.prompt_tokens + self.completion_tokens) / el:.0f} tok/s "
                f"(out {self.completion_tokens / el:.0f}) ${cost:.4f} elapsed {el:.0f}s ETA {_fmt_eta(eta)}")


def reason_retried(reason: str) -> bool:
    """Whether a later try may not meet this failure reason again: timeouts, connection errors, bad answers,
    HTTP 408/409/429 and 5xx may pass; any other status (401/403: the key; 400, 404...) will not."""
    return not reason.isdigit() or int(reason) in RETRYABLE_STATUS or int(reason) >= 500


def reason_label(reason: str) -> str:
    return f"HTTP {reason}" if reason.isdigit() else reason


def _fmt_eta(s: float) -> str:
    if s == float("inf"):
        return "?"
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m{s % 60:02d}s" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def cost_usd(prompt_tokens: int, completion_tokens: int, cfg: ClientConfig) -> float:
    return (prompt_tokens * cfg.price_prompt_per_m + completion_tokens * cfg.price_completion_per_m) / 1e6


def backoff_delay(attempt: int, cfg: ClientConfig, rng: random.Random) -> float:
    """Exponential with "equal jitter": half fixed, half random, so retries of many requests spread out."""
    d = min(cfg.backoff_max_s, cfg.backoff_base_s * (2 ** attempt))
    return d / 2 + rng.uniform(0, d / 2)


class StatusError(Exception):
    """A non-200 answer; `retry_after` from the Retry-After header when there is one."""

    def __init__(self, status: int, message: str, retry_after: float | None = None):
        super().__init__(f"HTTP {status}: {message}")
        self.status, self.message, self.retry_after = status, message, retry_after


class ConnectionFailed(Exception):
    pass


def _parse_retry_after(v) -> float | None:
    try:
        return min(float(v), MAX_RETRY_AFTER_S) if v is not None else None
    except ValueError:
        return None


class AiohttpChat:
    """POST /chat/completions with aiohttp and plain dicts: the high-concurrency path.

    Measured on 2 cores (bench/datagen_bench.py): the openai SDK spends 1.3-2.5 ms of CPU per request
    (request transform, pydantic models), which caps one event loop below 400 requests/s; this path
    spends ~0.5 ms. It speaks the same OpenAI-compatible wire format as the SDK.
    """

    def __init__(self, endpoint: Endpoint, cfg: ClientConfig):
        import aiohttp

        self._aiohttp = aiohttp
        self.url = endpoint.base_url.rstrip("/") + "/chat/completions"
        headers = {"Content-Type": "application/json"}
        if endpoint.api_key:
            headers["Authorization"] = f"Bearer {endpoint.api_key}"
        self.session = aiohttp.ClientSession(
            headers=headers,
            # the pool must hold every in-flight request, or requests queue in the pool and time out there
            connector=aiohttp.TCPConnector(limit=cfg.concurrency, limit_per_host=0, force_close=False),
            timeout=aiohttp.ClientTimeout(total=cfg.request_timeout_s, connect=min(30.0, cfg.request_timeout_s)))

    async def create(self, payload: dict) -> dict:
        aiohttp = self._aiohttp
        try:
            async with self.session.post(self.url, data=json.dumps(payload)) as r:
                body = await r.read()
                if r.status != 200:
                    # redacted before it is cut: a cut could leave a key's head that no longer matches
                    raise StatusError(r.status, redact(body.decode(errors="replace"))[:300],
                                      _parse_retry_after(r.headers.get("Retry-After")))
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
            if isinstance(e, aiohttp.ServerTimeoutError):
                raise TimeoutError(str(e)) from None
            raise ConnectionFailed(f"{type(e).__name__}: {e}") from None
        try:
            return json.loads(body)
        except ValueError as e:
            raise ValueError(f"response is not JSON: {e}") from None

    async def close(self) -> None:
        await self.session.close()


class OpenAISDKChat:
    """The openai AsyncOpenAI client: slower per request (see AiohttpChat) but the SDK's own behaviour."""

    def __init__(self, endpoint: Endpoint, cfg: ClientConfig):
        import httpx2 as httpx  # openai >= 3 is built on httpx2

        limits = httpx.Limits(max_connections=cfg.concurrency, max_keepalive_connections=cfg.concurrency)
        http = openai.DefaultAsyncHttpxClient(limits=limits, timeout=httpx.Timeout(cfg.request_timeout_s, connect=30.0))
        # retries are ours (with the failure accounting); the SDK's own are off
        self.client = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key or "EMPTY",
                                         max_retries=0, timeout=cfg.request_timeout_s, http_client=http)

    async def create(self, payload: dict) -> dict:
        known = {k: v for k, v in payload.items() if k in SDK_PARAMS}
        extra = {k: v for k, v in payload.items() if k not in SDK_PARAMS} or None
        try:
            resp = await self.client.chat.completions.create(**known, extra_body=extra)
        except openai.APITimeoutError as e:
            raise TimeoutError(str(e)) from None
        except openai.APIConnectionError as e:
            raise ConnectionFailed(str(e.__cause__ or e)) from None
        except openai.APIStatusError as e:
            raise StatusError(e.status_code, redact(str(e.message))[:300],
                              _parse_retry_after(e.response.headers.get("retry-after"))) from None
        except openai.APIResponseValidationError as e:
            raise ValueError(str(e)[:300]) from None
        return resp.model_dump()

    async def close(self) -> None:
        await self.client.close()


def make_client(endpoint: Endpoint, cfg: ClientConfig):
    return OpenAISDKChat(endpoint, cfg) if cfg.http_client == "openai" else AiohttpChat(endpoint, cfg)


async def chat_with_retries(client, payload: dict, cfg: ClientConfig, stats: RunStats, rng: random.Random):
    """One chat completion; returns (response dict, attempts) or raises SampleFailed."""
    reason, message = "?", ""
    for attempt in range(cfg.max_retries + 1):
        delay = None
        try:
            async with asyncio.timeout(cfg.request_timeout_s):
                return await client.create(payload), attempt + 1
        except TimeoutError as e:
            reason, message = "timeout", str(e) or f"no answer in {cfg.request_timeout_s}s"
        except ConnectionFailed as e:
            reason, message = "connection", str(e)
        except StatusError as e:
            reason, message = str(e.status), e.message
            if e.status in (400, 413) and TOO_LONG_MESSAGE.search(message):
                raise SampleFailed(TOO_LONG, message, attempt + 1) from None
            if not (e.status in RETRYABLE_STATUS or e.status >= 500):
                raise SampleFailed(reason, message, attempt + 1) from None
            delay = e.retry_after
        except ValueError as e:
            reason, message = "bad_response", str(e)[:300]
        if attempt == cfg.max_retries:
            break
        stats.retries[reason] += 1
        await asyncio.sleep(delay if delay is not None else backoff_delay(attempt, cfg, rng))
    raise SampleFailed(reason, message, cfg.max_retries + 1)


async def generate_sample(client, prompt: Prompt, spec: DatasetSpec, cfg: ClientConfig, stats: RunStats,
                          rng: random.Random) -> dict:
    """All assistant turns of one conversation, in order (turn k sees the model's own answers 1..k-1)."""
    system = prompt.system if prompt.system is not None else spec.system_prompt
    messages = [{"role": "system", "content": system}] if system is not None else []
    answers, finish, p_tok, c_tok, attempts = [], [], 0, 0, 0
    t0 = time.monotonic()
    for user in prompt.user_turns:
        messages.append({"role": "user", "content": user})
        payload = {"model": cfg.model, "messages": messages, "max_tokens": spec.max_tokens,
                   "temperature": spec.temperature, "top_p": spec.top_p}
        if spec.seed is not None:
            payload["seed"] = spec.seed
        if spec.extra_body:
            payload.update(spec.extra_body)  # sent as top-level JSON fields, as the SDK's extra_body does
        resp, n = await chat_with_retries(client, payload, cfg, stats, rng)
        attempts += n
        stats.requests += 1
        try:
            choice = resp["choices"][0]
            text = choice["message"].get("content") or ""
            reason = choice.get("finish_reason")
        except (KeyError, IndexError, TypeError, AttributeError):
            raise SampleFailed("bad_response", f"no choices[0].message in {str(resp)[:200]}", attempts) from None
        text, n = redact_secrets(text)  # an endpoint that answers with the key: not into the training data
        stats.redacted_secrets += n
        usage = resp.get("usage") or {}
        pt, ct = int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
        p_tok, c_tok = p_tok + pt, c_tok + ct
        stats.prompt_tokens += pt
        stats.completion_tokens += ct
        messages.append({"role": "assistant", "content": text})
        answers.append(text)
        finish.append(reason)
        if reason == "length" or not text.strip():
            break  # later turns would build on a cut or empty answer; the drop rules decide
    return {"sample_id": prompt.sample_id, "dataset": spec.name, "line": prompt.line_no, "messages": messages,
            "answer": answers[-1], "finish_reason": finish[-1], "finish_reasons": finish,
            "usage": {"prompt_tokens": p_tok, "completion_tokens": c_tok}, "attempts": attempts,
            "wall_s": round(time.monotonic() - t0, 3), "model": cfg.model}


async def generate_all(client, prompts: list[Prompt], spec: DatasetSpec, cfg: ClientConfig,
                       on_done: Callable[[dict], None], on_failed: Callable[[Prompt, SampleFailed], None],
                       stats: RunStats | None = None, seed: int = 0, dataset_size: int | None = None,
                       on_too_long: Callable[[Prompt, SampleFailed], None] | None = None) -> RunStats:
    """Generate `prompts`; the failure budget is a fraction of `dataset_size` (all prompts, resumed ones too).

    A prompt the endpoint rejects as too long for its context goes to `on_too_long` (default: `on_failed`)
    and does not count against the budget: it is a bad input line, which no retry fixes."""
    stats = stats or RunStats()
    stats.total = len(prompts)
    size = dataset_size or len(prompts)
    budget = int(cfg.max_failed_fraction * size)  # failed samples allowed; one more aborts
    it = iter(prompts)
    rng = random.Random(seed)

    async def worker():
        for prompt in it:  # a shared iterator: no await between next() calls, so no prompt is taken twice
            if stats.aborted:
                return
            try:
                rec = await generate_sample(client, prompt, spec, cfg, stats, rng)
            except SampleFailed as e:
                if e.reason == TOO_LONG:
                    stats.too_long += 1
                    (on_too_long or on_failed)(prompt, e)
                    continue
                stats.failed += 1
                stats.failures[e.reason] += 1
                on_failed(prompt, e)
                if stats.failed > budget and not stats.aborted:
                    stats.aborted = (f"more than the failure budget allows (max_failed_fraction "
                                     f"{cfg.max_failed_fraction:.2%} of {size} prompts = {budget} samples)")
                continue
            on_done(rec)
            stats.done += 1

    async def progress():
        while True:
            await asyncio.sleep(cfg.log_every_s)
            log.info(stats.progress_line(spec.name, cfg))

    n_workers = min(cfg.concurrency, max(len(prompts), 1))
    reporter = asyncio.create_task(progress())
    try:
        await asyncio.gather(*(worker() for _ in range(n_workers)))
    finally:
        reporter.cancel()
    log.info(stats.progress_line(spec.name, cfg))
    return stats
