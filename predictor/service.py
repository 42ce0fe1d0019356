"""The predictor as the gateway uses it: asynchronous, micro-batched, and quick to say no.

:class:`BertPredictor` answers the router's length-predictor protocol
(:class:`router.predict.LengthPredictor`: ``predict``, ``repredict``, ``observe``) with
awaitables. Requests that arrive together are encoded together: the worker takes up to
``max_batch`` queued requests (after waiting ``max_wait_s`` for more, 0 by default: what queued
while it was busy is the batch), encodes them in one worker thread off the event loop — prompts
of similar length share a forward pass (:meth:`predictor.encoder.Encoder.encode`) — and the
requests arriving meanwhile form the next batch.

It never makes the router queue behind it. A request is refused at once (the gateway then asks
its cheap per-input-length median instead and counts a fallback in ``/metrics``) when
``max_queue`` requests already wait, and abandoned when its answer has not come within
``timeout_s``; the forward pass it was part of still completes and its embedding is kept, so a
later re-prediction of the same prompt costs only the head (a few microseconds of NumPy).

Re-prediction (§3.4) uses the head's own distribution conditioned on the answer being longer than
what has been generated (:meth:`predictor.model.LengthModel.remaining_point`).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from .data import family_of
from .model import LengthModel


class PredictorBusy(RuntimeError):
    """The predictor's queue is full: the caller should use its fallback."""


class BertPredictor:
    name = "bert"

    def __init__(self, model: LengthModel | None = None, *, model_dir: str | Path | None = None,
                 edges: tuple[int, ...] | None = None, serving_model: str | None = None,
                 encoder_dir: str | Path | None = None, runtime: str = "auto",
                 max_batch: int = 32, max_wait_s: float = 0.0, max_queue: int = 256,
                 timeout_s: float = 0.5, cache_size: int = 8192):
        if model is None:
            model = LengthModel.load(model_dir, edges=edges)
        elif edges is not None and tuple(edges) != model.edges:
            raise ValueError("the predictor's bucket edges are not the router's")
        if model.encoder is None:
            model.attach_encoder(encoder_dir, runtime=runtime)
        if max_batch < 1 or max_queue < 1 or max_wait_s < 0 or timeout_s <= 0:
            raise ValueError("max_batch and max_queue must be >= 1, max_wait_s >= 0, "
                             "timeout_s > 0")
        self.model = model
        self.family = family_of(serving_model)
        self.max_batch, self.max_wait_s = int(max_batch), float(max_wait_s)
        self.max_queue, self.timeout_s = int(max_queue), float(timeout_s)
        self._cache: OrderedDict[str, np.ndarray] = OrderedDict()
        self._cache_size = int(cache_size)
        self._queue: list[tuple[str, str, asyncio.Future]] = []
        self._wake: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="predictor")
        # counters (read by the gateway's /metrics and by the benchmark)
        self.batches = 0
        self.batched = 0
        self.refused = 0
        self.timeouts = 0
        self.encode_s = 0.0

    # ---- the protocol -------------------------------------------------------------------------
    async def predict(self, prompt: str, prompt_tokens: int) -> int:
        return self.model.point(await self._dist(prompt, prompt_tokens))

    async def repredict(self, prompt: str, prompt_tokens: int, generated: int) -> int:
        return self.model.remaining_point(await self._dist(prompt, prompt_tokens), generated)

    def observe(self, prompt_tokens: int, output_tokens: int) -> None:
        """Nothing online: the served-request log retrains the head offline
        (``orchestrator predictor train --from-log``)."""

    # ---- batching -----------------------------------------------------------------------------
    async def _dist(self, prompt: str, prompt_tokens: int) -> np.ndarray:
        key = hashlib.sha1(prompt.encode("utf-8", "surrogatepass")).hexdigest()
        emb = self._cache.get(key)
        if emb is None:
            emb = await self._embed(key, prompt)
        else:
            self._cache.move_to_end(key)
        return self.model.distribution_from_emb(emb[None, :], [prompt_tokens],
                                                [self.family])[0]

    async def _embed(self, key: str, prompt: str) -> np.ndarray:
        if len(self._queue) >= self.max_queue:
            self.refused += 1
            raise PredictorBusy(f"{len(self._queue)} predictions queued")
        loop = asyncio.get_running_loop()
        if self._worker is None or self._worker.done():
            self._wake = asyncio.Event()
            self._worker = loop.create_task(self._run())
        fut: asyncio.Future = loop.create_future()
        self._queue.append((key, prompt, fut))
        self._wake.set()
        try:
            return await asyncio.wait_for(asyncio.shield(fut), self.timeout_s)
        except asyncio.TimeoutError:
            self.timeouts += 1
            raise

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            if len(self._queue) < self.max_batch and self.max_wait_s > 0:
                await asyncio.sleep(self.max_wait_s)
            batch = self._queue[:self.max_batch]
            del self._queue[:self.max_batch]
            if not self._queue:
                self._wake.clear()
            if not batch:
                continue
            t = time.perf_counter()
            try:
                emb = await loop.run_in_executor(self._pool, self.model.encoder.encode,
                                                 [p for _, p, _ in batch])
            except Exception as e:  # noqa: BLE001 - every waiter gets the failure
                for _, _, f in batch:
                    if not f.done():
                        f.set_exception(e)
                continue
            self.encode_s += time.perf_counter() - t
            self.batches += 1
            self.batched += len(batch)
            for (key, _, f), v in zip(batch, emb):
                self._cache[key] = v
                if not f.done():
                    f.set_result(v)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)

    def stats(self) -> dict[str, float]:
        return {"batches": self.batches, "batched": self.batched, "refused": self.refused,
                "timeouts": self.timeouts, "encode_s": self.encode_s,
                "queued": len(self._queue)}

    async def aclose(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            try:
                await self._worker
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
        self._pool.shutdown(wait=False, cancel_futures=True)
