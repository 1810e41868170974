"""A reward term served over HTTP: batches of images POSTed to `server_url`, one score (and extras) back per image.

The entry `{name, server_url, headers, format, batch_size, max_concurrency, request_timeout_s, max_retries,
retry_backoff, prompts_from, weight}` becomes a `BatchRewardTerm`: the manager hands it batches of `batch_size`
images, `max_concurrency` at once. Each batch is one request (`wire_format`: JSON, or flow_grpo's pickle):

- connection errors, a request attempt slower than `request_timeout_s`, and HTTP 408 / 429 / 5xx are retried up to
  `max_retries` times, waiting `retry_backoff * 2**attempt` seconds before each retry (verl-omni's client's rule);
- any other status fails the batch at once with the server's reason; so does an answer that breaks the format;
- a sample the server could not score (a null score with a reason) fails alone, with the server's reason.

Header values written `env:NAME` are read from the environment of the scoring process at each request and exist
only in the request: never stored on the term, never put in a reason or a log line. The URL is shown without any
`user:password@` part, query string or fragment (`display_url`).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any
from urllib.parse import urlsplit

import httpx

from omni_core.rewards.entries import display_url
from omni_core.rewards.terms import BatchRewardTerm, RewardBatch
from omni_core.rewards.wire_format import PICKLE_FORMAT, WIRE_FORMATS, WireFormat

__all__ = ["ENV_PREFIX", "RewardServerClient", "RewardServerError", "display_url", "server_term"]

ENV_PREFIX = "env:"
RETRIED_STATUS = frozenset({408, 429})  # and every 5xx


class RewardServerError(RuntimeError):
    """A batch the reward server did not score; the message names the server (without credentials) and the reason."""


class RewardServerClient:
    """Scores one batch per call (`__call__(batch)`), from any number of threads; one connection pool per process."""

    def __init__(
        self,
        url: str,
        headers: dict[str, str],
        fmt: str = "json",
        request_timeout_s: float = 120.0,
        max_retries: int = 2,
        retry_backoff: float = 0.5,
        max_connections: int = 4,
        prompts_from: str = "prompt",
    ) -> None:
        if urlsplit(url).scheme not in ("http", "https") or not urlsplit(url).hostname:
            raise ValueError(f"server_url={display_url(url)!r} must be an http:// or https:// URL with a host")
        if fmt not in WIRE_FORMATS:
            raise ValueError(f"format={fmt!r} is not a reward-server wire format; choose one of {list(WIRE_FORMATS)}")
        self.url = url
        self.shown_url = display_url(url)
        self._headers = dict(headers)  # values as written: literals or env:NAME references, never resolved here
        self.fmt = fmt  # the name: a term shipped to another process carries no functions
        self.request_timeout_s = request_timeout_s
        self.max_retries = max_retries
        self.retry_backoff = retry_backoff
        self.max_connections = max_connections
        self.prompts_from = prompts_from
        self._client: httpx.Client | None = None
        self._lock = threading.Lock()

    @property
    def wire(self) -> WireFormat:
        return WIRE_FORMATS[self.fmt]

    def __getstate__(self) -> dict[str, Any]:  # a term shipped to another process opens its own pool there
        return {**self.__dict__, "_client": None, "_lock": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _http(self) -> httpx.Client:
        with self._lock:
            if self._client is None:
                limits = httpx.Limits(max_connections=self.max_connections, max_keepalive_connections=self.max_connections)
                self._client = httpx.Client(timeout=self.request_timeout_s, limits=limits, follow_redirects=False)
            return self._client

    def _request_headers(self) -> dict[str, str]:
        """The headers of one request, `env:NAME` values read now (a missing variable fails the batch, unretried)."""
        resolved = {"content-type": self.wire.content_type}
        for name, value in self._headers.items():
            if value.startswith(ENV_PREFIX):
                var = value[len(ENV_PREFIX) :]
                if var not in os.environ:
                    raise RewardServerError(
                        f"{self.shown_url}: header {name!r} reads environment variable {var}, which is not set in the "
                        f"scoring process (pid {os.getpid()}); export it where the rollout workers (or the evaluation) run"
                    )
                value = os.environ[var]
            resolved[name] = value
        return resolved

    def __call__(self, batch: RewardBatch) -> list[Any]:
        n = len(batch)
        texts = batch.prompts if self.prompts_from == "prompt" else batch.ground_truths
        metadata = [
            {"data_source": s, "ground_truth": g, "extra_info": e}
            for s, g, e in zip(batch.data_sources, batch.ground_truths, batch.extra_infos, strict=True)
        ]
        return self.wire.parse(self._post(self.wire.encode(batch.images, texts, metadata)), n)

    def _post(self, body: bytes) -> bytes:
        attempts = self.max_retries + 1
        last = ""
        for attempt in range(attempts):
            headers = self._request_headers()
            try:
                response = self._http().post(self.url, content=body, headers=headers)
            except httpx.TimeoutException as exc:
                last = f"no answer within request_timeout_s={self.request_timeout_s:g} s ({type(exc).__name__})"
            except httpx.TransportError as exc:  # connection refused / reset, protocol error, ...
                last = f"{type(exc).__name__}: {exc}"
            else:
                if response.status_code == 200:
                    return response.content
                detail = self.wire.error_detail(response.content)
                last = f"HTTP {response.status_code}: {detail}"
                if response.status_code not in RETRIED_STATUS and response.status_code < 500:
                    raise RewardServerError(f"{self.shown_url} answered {last} (a client error: not retried)")
            finally:
                del headers  # resolved secrets live for one request only
            if attempt < self.max_retries:
                time.sleep(self.retry_backoff * 2**attempt)
        raise RewardServerError(
            f"{self.shown_url}: no scores after {attempts} attempts (max_retries={self.max_retries}); last: {last}"
        )


def server_term(spec: Any, verl_client: bool = False) -> BatchRewardTerm:
    """The batched term of a reward-server entry (`RewardFunctionSpec` with `server_url`).

    `verl_client`: the entry is verl-omni's `http_scorer_client` (its `path`): flow_grpo's pickle format, and each
    sample's ground_truth sent as its prompt, as that client does.
    """
    fmt = PICKLE_FORMAT.name if verl_client else spec.format
    prompts_from = spec.prompts_from or ("ground_truth" if verl_client else "prompt")
    client = RewardServerClient(
        spec.server_url,
        dict(spec.headers),
        fmt=fmt,
        request_timeout_s=spec.request_timeout_s,
        max_retries=spec.max_retries,
        retry_backoff=spec.retry_backoff,
        max_connections=spec.max_concurrency,
        prompts_from=prompts_from,
    )
    label = spec.name or urlsplit(spec.server_url).netloc.rpartition("@")[2]
    return BatchRewardTerm(
        label=label, fn=client, weight=spec.weight, batch_size=spec.batch_size, max_concurrency=spec.max_concurrency
    )
