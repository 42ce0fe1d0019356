"""The gateway's client of the engines (vLLM's OpenAI HTTP surface, design §1).

One shared :class:`aiohttp.ClientSession` with a pooled connector serves every upstream call.
Every failure of a vPod is raised as :class:`UpstreamFailure` (the gateway fails over to another
vPod); an engine's 4xx answer, which says the request itself is at fault, as
:class:`UpstreamRejected` (the gateway passes it to the client).

Streams are read as SSE: :class:`UpstreamStream` yields each ``data:`` payload parsed as JSON
and stops at ``data: [DONE]``; a stream that ends without it, breaks, stalls longer than the read
timeout, or carries an ``{"error": ...}`` event is a failure.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
from yarl import URL

JSON_HEADERS = {"Content-Type": "application/json"}
_loads = json.loads


class UpstreamFailure(Exception):
    """The vPod failed (connect error, reset, 5xx, timeout, truncated stream): fail over.
    ``kind``: connect | status | broken | timeout | engine_error."""

    def __init__(self, kind: str, detail: str):
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail


class UpstreamRejected(Exception):
    """The engine answered 4xx: the request is at fault (the error body is passed on)."""

    def __init__(self, status: int, body: dict[str, Any]):
        super().__init__(f"engine answered {status}")
        self.status = status
        self.body = body


_BROKEN = (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError,
           ConnectionResetError)


class UpstreamStream:
    """An open SSE response: ``async for chunk in stream`` (dicts). :meth:`close` aborts it (the
    engine sees the connection close and cancels the request); :meth:`release` after [DONE]
    returns the connection to the pool."""

    __slots__ = ("_resp", "done")

    def __init__(self, resp: aiohttp.ClientResponse):
        self._resp = resp
        self.done = False

    def __aiter__(self) -> "UpstreamStream":
        return self

    async def __anext__(self) -> dict[str, Any]:
        content = self._resp.content
        while True:
            try:
                line = await content.readline()
            except asyncio.TimeoutError:
                raise UpstreamFailure("timeout", "no data from the engine within the read "
                                                 "timeout") from None
            except (*_BROKEN, ValueError) as e:      # ValueError: a line over read_bufsize
                raise UpstreamFailure("broken", f"stream broke: {e!r}") from None
            if not line:
                raise UpstreamFailure("broken", "stream ended before [DONE]")
            if line[:5] != b"data:":
                continue            # blank separators, comments, event names
            payload = line[5:].strip()
            if payload == b"[DONE]":
                self.done = True
                raise StopAsyncIteration
            try:
                chunk = _loads(payload)
            except ValueError:
                raise UpstreamFailure("broken", "malformed SSE data") from None
            if "error" in chunk and "choices" not in chunk:
                raise UpstreamFailure("engine_error", str(chunk["error"])[:200])
            return chunk

    async def finish(self, max_chunks: int = 4) -> None:
        """After the last chunk that matters: read up to [DONE] (a few chunks at most) so the
        connection goes back to the pool; else close it."""
        try:
            for _ in range(max_chunks):
                await self.__anext__()
        except StopAsyncIteration:
            self._resp.release()
            return
        except UpstreamFailure:
            pass
        self._resp.close()

    def close(self) -> None:
        """Abort the stream, or (after [DONE]) give the connection back to the pool once the
        engine's end of the chunked body is in (a task waits for it when it is not yet)."""
        resp = self._resp
        if not self.done:
            resp.close()
        elif resp.content.is_eof():
            resp.release()
        else:
            t = asyncio.ensure_future(_release_at_eof(resp))
            _PENDING.add(t)
            t.add_done_callback(_PENDING.discard)


_PENDING: set[asyncio.Future] = set()


async def _release_at_eof(resp: aiohttp.ClientResponse) -> None:
    try:
        await asyncio.wait_for(resp.content.read(), 2.0)
    except Exception:  # noqa: BLE001 - whatever happened, the connection is not reusable
        resp.close()
        return
    resp.release()


class EngineClient:
    """The pooled HTTP client of the engines. :meth:`start` inside the event loop."""

    def __init__(self, *, connect_timeout_s: float = 5.0, read_timeout_s: float = 60.0,
                 limit_per_host: int = 0, api_key: str | None = None):
        # the engines' API key (vLLM's VLLM_API_KEY), sent on every call when set
        self._headers = dict(JSON_HEADERS)
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.limit_per_host = limit_per_host
        self._session: aiohttp.ClientSession | None = None
        self._urls: dict[str, URL] = {}        # parsed once per endpoint and path

    async def start(self) -> None:
        if self._session is None or self._session.closed:
            conn = aiohttp.TCPConnector(limit=0, limit_per_host=self.limit_per_host,
                                        keepalive_timeout=30, enable_cleanup_closed=False)
            timeout = aiohttp.ClientTimeout(total=None, connect=self.connect_timeout_s,
                                            sock_read=self.read_timeout_s)
            self._session = aiohttp.ClientSession(connector=conn, timeout=timeout,
                                                  read_bufsize=1 << 20,
                                                  skip_auto_headers=("User-Agent",),
                                                  auto_decompress=False)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _url(self, url: str) -> URL:
        u = self._urls.get(url)
        if u is None:
            if len(self._urls) > 4096:
                self._urls.clear()
            u = self._urls[url] = URL(url)
        return u

    async def _post(self, url: str, body: bytes) -> aiohttp.ClientResponse:
        if self._session is None:
            await self.start()
        assert self._session is not None
        for attempt in (0, 1):
            try:
                resp = await self._session.post(self._url(url), data=body,
                                                headers=self._headers)
                break
            except asyncio.TimeoutError:
                raise UpstreamFailure("timeout", f"no answer from {url}") from None
            except aiohttp.ClientConnectorError as e:
                raise UpstreamFailure("connect", f"cannot connect to {url}: {e.os_error!r}") \
                    from None
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as e:
                # a pooled keep-alive connection the engine had closed: one fresh try
                if attempt:
                    raise UpstreamFailure("broken", f"{url}: {e!r}") from None
            except aiohttp.ClientError as e:
                raise UpstreamFailure("broken", f"{url}: {e!r}") from None
        if resp.status != 200:
            try:
                raw = await resp.read()
                body_json = _loads(raw) if raw else {}
            except Exception:  # noqa: BLE001 - any unreadable error body is a failure
                body_json = {}
            finally:
                resp.release()
            # 401/403: the engine refused the gateway (a key mismatch), not the request
            if 400 <= resp.status < 500 and resp.status not in (401, 403, 404, 408, 429):
                if not isinstance(body_json, dict) or "error" not in body_json:
                    body_json = {"error": {"message": str(body_json)[:500],
                                           "type": "invalid_request_error", "param": None,
                                           "code": None}}
                raise UpstreamRejected(resp.status, body_json)
            raise UpstreamFailure("status", f"{url} answered {resp.status}")
        return resp

    async def stream(self, url: str, body: bytes) -> UpstreamStream:
        """POST ``body`` (a request with ``stream: true``) and return the open stream."""
        return UpstreamStream(await self._post(url, body))

    async def post_json(self, url: str, body: bytes) -> dict[str, Any]:
        """POST ``body`` (``stream: false``) and return the parsed JSON answer."""
        resp = await self._post(url, body)
        try:
            raw = await resp.read()
        except asyncio.TimeoutError:
            resp.close()
            raise UpstreamFailure("timeout", f"no answer from {url}") from None
        except _BROKEN as e:
            resp.close()
            raise UpstreamFailure("broken", f"{url}: {e!r}") from None
        resp.release()
        try:
            out = _loads(raw)
        except ValueError:
            raise UpstreamFailure("broken", f"{url}: malformed JSON answer") from None
        if not isinstance(out, dict) or "choices" not in out:
            raise UpstreamFailure("engine_error", f"{url}: unexpected answer")
        return out
