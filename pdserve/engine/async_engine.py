"""Runs an LLMEngine on its own thread and streams each request's outputs to an asyncio consumer.

Torch releases the GIL inside its kernels, so the HTTP event loop stays responsive while the
engine thread computes. All engine calls happen on the engine thread; other threads only post
commands to it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from pdserve.common.errors import DuplicateRequestId, EngineDeadError, RequestFailed, RequestMoved  # noqa: F401 (re-exported)
from pdserve.common.images import ImageInput
from pdserve.common.outputs import RequestOutput
from pdserve.common.sampling import SamplingParams
from pdserve.engine.engine import LLMEngine
from pdserve.engine.request import Request

log = logging.getLogger(__name__)


def tokens_to_go(req: Request) -> int:
    """Output tokens a request may still generate (its max_tokens, else its context's room)."""
    limit = req.params.max_tokens
    return (limit - len(req.output_token_ids)) if limit is not None else 1 << 30


# What other threads post to the engine thread.
@dataclass
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    cache_salt: str | None
    prefill_peer: str | None
    output_token_ids: list[int] | None
    images: list[ImageInput] | None


@dataclass
class AbortRequest:
    request_id: str


@dataclass
class CallOnEngine:
    fn: Callable[[LLMEngine], object]
    future: concurrent.futures.Future


Command = AddRequest | AbortRequest | CallOnEngine


def _put_all(items: list) -> None:
    """Each (queue, item) in order, on the consumer's loop."""
    for q, item in items:
        q.put_nowait(item)


class AsyncEngine:
    def __init__(
        self, engine: LLMEngine, on_output: Callable[[RequestOutput, float], None] | None = None
    ) -> None:
        self.engine = engine
        self.on_output = on_output  # metrics hook, called on the engine thread
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self.dead: BaseException | None = None
        self.accepting = True
        engine.connector.wake = self._wake.set  # a peer's message wakes an idle loop

    def start(self) -> None:
        self._thread.start()

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        prefill_peer: str | None = None,
        output_token_ids: list[int] | None = None,
        images: list[ImageInput] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yields deltas until the request finishes. Cancelling the consumer aborts the request.
        `output_token_ids`: see LLMEngine.add_request."""
        if self.dead is not None:
            raise EngineDeadError(str(self.dead))
        self.engine.check_request(
            prompt_token_ids, params, output_token_ids
        )  # pure check, raises InvalidParam
        if self.has_stream(request_id):  # its stream would get this one's outputs, or the reverse
            raise DuplicateRequestId(f"request id {request_id!r} is already running on this worker")
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        self._post(
            AddRequest(
                request_id,
                prompt_token_ids,
                params,
                time.monotonic(),
                cache_salt,
                prefill_peer,
                output_token_ids,
                images,
            )
        )
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                log.info("request %s aborted: its consumer went away", request_id)
                self._post(AbortRequest(request_id))

    def has_stream(self, request_id: str) -> bool:
        """Whether a consumer reads `request_id` now (read from the event loop)."""
        return request_id in self._streams

    def open_streams(self) -> int:
        """Requests whose consumer still reads (read from the event loop)."""
        return len(self._streams)

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidParam for a request that cannot run (a pure check, safe from any thread)."""
        self.engine.check_request(prompt_token_ids, params)

    def abort(self, request_id: str) -> None:
        self._post(AbortRequest(request_id))

    def call(self, fn: Callable[[LLMEngine], object]) -> concurrent.futures.Future:
        """Run fn(engine) on the engine thread between two steps; the future holds its result."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._post(CallOnEngine(fn, fut))
        return fut

    def evacuate(self, reason: str, count: int | None = None) -> concurrent.futures.Future:
        """Give up every request on this engine: streams get RequestMoved (their router continues
        them elsewhere), requests without a stream (prefill jobs) are aborted, which tells their peer.
        With `count`: only that many streams that are generating, those with the most tokens still
        to go first (a pool evening out its streams: they gain the most from a less loaded worker)."""

        def run(engine: LLMEngine) -> int:
            rids = list(engine.requests)
            if count is not None:
                rids = sorted(
                    (
                        rid
                        for rid, r in engine.requests.items()
                        if rid in self._streams and r.output_token_ids and not r.is_finished
                    ),
                    key=lambda rid: -tokens_to_go(engine.requests[rid]),
                )[: max(0, count)]
            for rid in rids:
                engine.abort_request(rid)
                self._deliver(rid, RequestMoved(reason))
            return len(rids)

        return self.call(run)

    def _post(self, cmd: Command) -> None:
        self._commands.put(cmd)
        self._wake.set()

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        self._deliver_all([(request_id, item)])

    def _deliver_all(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        """Each item to its request's stream, in order: one wake-up of each consumer loop (a call a
        stream wrote to the loop's self-pipe once per stream and token)."""
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for request_id, item in items:
            stream = self._streams.get(request_id)
            if stream is not None:
                loop, q = stream
                batches.setdefault(loop, []).append((q, item))
        for loop, pairs in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, pairs)
            except RuntimeError:  # the consumer's loop is closed
                pass

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, AddRequest):
                if cmd.request_id not in self._streams:  # cancelled before it reached the engine
                    continue
                try:
                    self.engine.add_request(
                        cmd.request_id,
                        cmd.prompt_token_ids,
                        cmd.params,
                        arrival_time=cmd.arrival_time,
                        cache_salt=cmd.cache_salt,
                        prefill_peer=cmd.prefill_peer,
                        output_token_ids=cmd.output_token_ids,
                        images=cmd.images,
                    )
                except Exception as e:  # noqa: BLE001 - delivered to the request's consumer
                    self._deliver(cmd.request_id, e)
            elif isinstance(cmd, AbortRequest):
                out = self.engine.abort_request(cmd.request_id)
                if out is not None:
                    self._deliver(cmd.request_id, out)
            else:
                try:
                    cmd.future.set_result(cmd.fn(self.engine))
                except Exception as e:  # noqa: BLE001 - raised to the caller
                    cmd.future.set_exception(e)

    def _loop(self) -> None:
        while not self._stop:
            self._drain_commands()
            if not self.engine.has_unfinished():
                # A model of several processes (expert parallelism) may lose one while idle.
                failure = getattr(self.engine.model, "failure", None)
                lost = failure() if failure is not None else None
                if lost is not None:
                    log.error("engine failed while idle: %s", lost)
                    self.dead = lost
                    return
                self.engine.idle()
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # noqa: BLE001 - a bug must fail requests, not hang them
                log.exception("engine step failed")
                self.dead = e
                for rid in list(self.engine.requests):
                    self.engine.abort_request(rid)
                    self._deliver(rid, EngineDeadError(f"engine failed: {e}"))
                return
            now = time.monotonic()
            if self.on_output is not None:
                for out in outputs:
                    self.on_output(out, now)
            self._deliver_all([(o.request_id, RequestFailed(o.error) if o.error else o) for o in outputs])

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop admitting, let running requests finish until the timeout, abort the rest, stop."""
        self.accepting = False
        deadline = time.monotonic() + timeout
        while self._streams and time.monotonic() < deadline and self.dead is None:
            time.sleep(0.05)
        for rid in list(self._streams):
            self.abort(rid)
        time.sleep(0.1)
        self._stop = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
