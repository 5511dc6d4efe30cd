"""The capture endpoint: an OpenAI-compatible chat server inside the rollout worker, one secret per rollout.

A black-box agent (a script on the ``openai`` client, a framework's agent, a coding agent in a
sandbox) talks to ``/v1/chat/completions`` as it would to any OpenAI-compatible server. Each
request is rendered with the trainer's chat template into token ids, sampled through the worker's
sampler client (token ids in, ids and log-probs out; the rollout's policy version, concurrency
limits and retries), and answered in OpenAI's format with the tool calls parsed from the text.
Every answered request is one :class:`~trainer.records.TurnRecord` of the rollout's
:class:`CaptureSession`; the loop reconciles them into samples at the end as it does its own.

A reply that an agent sends back unchanged in a later request is rendered as the exact text the
model generated (the endpoint keeps it by :func:`~trainer.rollout.openai_compat.assistant_key`),
so the prompt extends the held tokens whatever ids or spacing the agent's framework uses; an agent
that rewrites or drops history forks a new sample instead.

Routes (``{secret}`` is the rollout's, 256 random bits)::

    POST /r/{secret}/v1/chat/completions     GET /r/{secret}/v1/models
    POST /v1/chat/completions                GET /v1/models        (secret as the API key)

A key that is another live rollout's secret is refused beside a URL secret (401), and so is an
unknown secret; a finished rollout's secret gets 404 ``rollout_finished``. The server listens on
loopback unless configured otherwise; request bodies, requests per rollout and requests in flight
per rollout are bounded.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import json
import logging
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from transformers import PreTrainedTokenizerBase

from trainer.exceptions import VLLMServerError
from trainer.metrics import RecordBuffer
from trainer.records import TurnRecord
from trainer.rollout.chat_template import build_assistant_message, completion_text, rollout_family, stop_token_ids
from trainer.rollout.openai_compat import (
    ChatRequest,
    OpenAIRequestError,
    Reply,
    assistant_key,
    completion_body,
    completion_chunks,
    error_body,
    parse_chat_request,
    reply_from_text,
)
from trainer.rollout.prompt_render import ConversationRenderer, splits_at_added_tokens

__all__ = ["CaptureServer", "CaptureSession", "InProcessTransport", "SampleFunc"]

logger = logging.getLogger(__name__)

SampleFunc = Callable[[list[int], int | None, list[str]], Coroutine[Any, Any, TurnRecord]]
"""``(prompt_ids, max_tokens or None, stop strings) -> TurnRecord``: one sampling request."""

_FINISHED_KEPT = 65536  # secrets of finished rollouts remembered, to answer 404 rather than 401
_RENDERERS_KEPT = 2  # per rollout: an agent alternating two tool sets keeps both incremental
_ROUTE = re.compile(r"(?:/r/(?P<secret>[^{}/]+))?/v1/(?P<route>chat/completions|models)")


@dataclass
class CaptureSession:
    """One rollout's side of the endpoint: its secret, its recorded turns and its bookkeeping.

    Attributes:
        secret: The rollout's secret (in its base URL and as its API key).
        base_url: ``http://host:port/r/<secret>/v1``, what an OpenAI client takes as ``base_url``.
        context: The rollout's context: sampling runs in it (the group's policy version).
        max_requests: Requests answered before the rollout is refused more (429).
        turns: Every answered request, in the order answered.
        conversation: The last request's messages followed by its reply (the captured conversation).
        tool_calls: Tool calls returned to the agent.
        tool_failures: Malformed ``<tool_call>`` blocks and calls to a tool the request did not offer.
        saw_tools: Some request offered tools.
        exhausted: A request was refused because ``max_requests`` were answered.
        finished: The rollout ended: every further request is refused.
        fatal: A sampler failure that must stop the run (the server is gone), raised by the loop.
    """

    secret: str
    base_url: str
    context: contextvars.Context
    max_requests: int
    parallel_requests: int = 1
    turns: list[TurnRecord] = field(default_factory=list)
    conversation: list[dict[str, Any]] = field(default_factory=list)
    tool_calls: int = 0
    tool_failures: int = 0
    saw_tools: bool = False
    exhausted: bool = False
    finished: bool = False
    fatal: BaseException | None = None
    requests: int = 0
    replies: dict[str, str] = field(default_factory=dict)  # assistant_key -> generated text
    pending_calls: dict[str, tuple[str, float]] = field(default_factory=dict)  # call id -> (tool, answered at)
    renderers: dict[str, ConversationRenderer] = field(default_factory=dict)  # tools JSON -> renderer, LRU order
    render_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    tasks: set[asyncio.Task[TurnRecord]] = field(default_factory=set)
    failed: asyncio.Event = field(default_factory=asyncio.Event)
    slots: asyncio.Semaphore = field(init=False)

    def __post_init__(self) -> None:
        self.slots = asyncio.Semaphore(self.parallel_requests)

    def fail(self, exc: BaseException) -> None:
        """Mark a failure that ends the run (the loop re-raises it)."""
        if self.fatal is None:
            self.fatal = exc
        self.failed.set()


class CaptureServer:
    """The endpoint (an aiohttp application) serving every rollout's :class:`CaptureSession`.

    Args:
        sample: Samples one turn (the loop's ``generate_one_turn`` with the request's limits).
        tokenizer: The trainer's tokenizer.
        model_name: The name ``/v1/models`` lists and replies carry.
        max_model_len: The server's limit: a longer prompt is refused (``context_length_exceeded``).
        records: Where tool and endpoint metrics go.
        chat_template: The template to render with (``None``: the tokenizer's).
        chat_template_kwargs: Extra template variables.
        host: Address to listen on (loopback by default: agents run beside the worker).
        port: Port (0: any free one; :attr:`url` tells which).
        max_request_bytes: Largest request body accepted (413 above).
    """

    def __init__(
        self, sample: SampleFunc, tokenizer: PreTrainedTokenizerBase, model_name: str, max_model_len: int,
        records: RecordBuffer, chat_template: str | None = None, chat_template_kwargs: dict[str, Any] | None = None,
        host: str = "127.0.0.1", port: int = 0, max_request_bytes: int = 8 * 2**20,
    ) -> None:
        self.sample = sample
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.records = records
        self.chat_template = chat_template
        self.kwargs = dict(chat_template_kwargs or {})
        self.family = rollout_family(chat_template or tokenizer.chat_template)  # the format replies are read in
        self._stop_ids = stop_token_ids(tokenizer, self.family)
        self.host, self.port = host, port
        self.max_request_bytes = max_request_bytes
        self.url = ""
        self._sessions: dict[str, CaptureSession] = {}
        self._finished: OrderedDict[str, None] = OrderedDict()
        self._runner: web.AppRunner | None = None
        self._incremental = False
        self.address: tuple[str, int] | None = None  # (host, port) listened on

    # ------------------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Listen; :attr:`url` is then ``http://host:port``."""
        self._incremental = splits_at_added_tokens(self.tokenizer, None, self.chat_template, **self.kwargs)
        app = web.Application(client_max_size=self.max_request_bytes)
        for prefix in ("/r/{secret}/v1", "/v1"):
            app.router.add_post(f"{prefix}/chat/completions", self._chat)
            app.router.add_get(f"{prefix}/models", self._models)
        # handler_cancellation: an agent that hangs up cancels its handler, and so its sampling request;
        # without it the sampling would finish and a turn no agent received would be trained on.
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0, handler_cancellation=True)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()
        host, port = self._runner.addresses[0][:2]
        self.address = (host, port)
        self.url = f"http://{host if ':' not in host else f'[{host}]'}:{port}"
        logger.info("harness endpoint listening at %s", self.url)

    async def stop(self) -> None:
        """Finish every session and stop listening."""
        for session in list(self._sessions.values()):
            self.close(session)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def open(self, context: contextvars.Context, max_requests: int, parallel_requests: int = 1) -> CaptureSession:
        """A new rollout's session (its secret is fresh)."""
        secret = secrets.token_urlsafe(32)
        session = CaptureSession(secret, f"{self.url}/r/{secret}/v1", context, max_requests, parallel_requests)
        self._sessions[secret] = session
        return session

    def close(self, session: CaptureSession) -> None:
        """End a rollout: later requests get ``rollout_finished``; its requests in flight are cancelled."""
        session.finished = True
        for task in session.tasks:
            task.cancel()
        if self._sessions.pop(session.secret, None) is not None:
            self._finished[session.secret] = None
            while len(self._finished) > _FINISHED_KEPT:
                self._finished.popitem(last=False)

    # ------------------------------------------------------------------------------ routes
    def _session(self, secret: str | None, auth: str) -> CaptureSession:
        """The session a request is for: the secret in its URL, else its ``Authorization`` key."""
        key = auth[7:].strip() if auth[:7].lower() == "bearer " else None
        if secret is not None and key is not None and key != secret and key in self._sessions:
            raise OpenAIRequestError("the API key belongs to another rollout than the URL", 401, "invalid_api_key")
        secret = secret or key
        if not secret:
            raise OpenAIRequestError("no rollout secret: use the rollout's base URL or its API key", 401,
                                     "invalid_api_key")
        session = self._sessions.get(secret)
        if session is not None:
            return session
        if secret in self._finished:
            raise OpenAIRequestError("this rollout has finished; its endpoint answers no more requests", 404,
                                     "rollout_finished")
        raise OpenAIRequestError("unknown rollout secret", 401, "invalid_api_key")

    def models_body(self, secret: str | None, auth: str) -> tuple[int, dict[str, Any]]:
        """``GET /v1/models``: the status and the JSON body."""
        try:
            self._session(secret, auth)
        except OpenAIRequestError as exc:
            return exc.status, error_body(exc)
        return 200, {"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "toolgym"}]}

    async def _models(self, request: web.Request) -> web.StreamResponse:
        status, body = self.models_body(request.match_info.get("secret"), request.headers.get("Authorization", ""))
        return web.json_response(body, status=status)

    async def chat(self, secret: str | None, auth: str, read: Callable[[], Awaitable[bytes]],
                   ) -> tuple[int, dict[str, Any] | list[bytes]]:
        """``POST /v1/chat/completions``: the status and the JSON body, or the server-sent events of a
        streamed answer (``data: ...`` lines, ``data: [DONE]`` last).

        Args:
            secret: The secret in the URL (``None`` on the ``/v1`` routes).
            auth: The ``Authorization`` header (``""`` without one).
            read: Reads the request body; raises :class:`OpenAIRequestError` (413) when it is too large.
        """
        try:
            session = self._session(secret, auth)
            # Counted on arrival, so requests waiting for the rollout's slot count toward its limit too
            # (a request refused before sampling is refunded below).
            if session.requests >= session.max_requests:
                session.exhausted = True
                raise OpenAIRequestError(f"this rollout has made its {session.max_requests} requests "
                                         "(agent_max_requests)", 429, "rollout_request_limit")
            session.requests += 1
            sampled = False
            try:
                async with session.slots:  # the body is read only now: a waiting request holds no body in memory
                    chat = await self._read_chat(read)
                    prompt_ids = await self._prepare(session, chat)
                    sampled = True
                    turn, reply = await self._answer(session, chat, prompt_ids)
            finally:
                if not sampled:  # refused (or hung up) before sampling: it does not count
                    session.requests -= 1
        except OpenAIRequestError as exc:
            self.records.add("agent/refused_request_count", 1)
            return exc.status, error_body(exc)
        prompt_n, completion_n = len(turn.prompt_ids), len(turn.output_ids)
        if not chat.stream:
            return 200, completion_body(reply, self.model_name, prompt_n, completion_n)
        chunks = completion_chunks(reply, self.model_name, prompt_n, completion_n, chat.include_usage)
        return 200, [*(f"data: {json.dumps(c, ensure_ascii=False)}\n\n".encode() for c in chunks), b"data: [DONE]\n\n"]

    def too_large(self) -> OpenAIRequestError:
        """The error of a request body over ``max_request_bytes``."""
        return OpenAIRequestError(f"request body over {self.max_request_bytes} bytes", 413, "request_too_large")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        async def read() -> bytes:
            try:
                return await request.read()
            except web.HTTPRequestEntityTooLarge as exc:
                raise self.too_large() from exc

        status, body = await self.chat(request.match_info.get("secret"), request.headers.get("Authorization", ""),
                                       read)
        if not isinstance(body, list):
            return web.json_response(body, status=status)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        for event in body:
            await response.write(event)
        await response.write_eof()
        return response

    # ------------------------------------------------------------------------------ answering
    @staticmethod
    async def _read_chat(read: Callable[[], Awaitable[bytes]]) -> ChatRequest:
        """The request's body, decoded and checked off the event loop (a body of megabytes takes a while)."""
        raw = await read()
        try:
            body = await asyncio.to_thread(json.loads, raw)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:  # nesting too deep: Recursion
            raise OpenAIRequestError(f"the body is not JSON that can be read: {type(exc).__name__}") from exc
        return parse_chat_request(body)

    async def _prepare(self, session: CaptureSession, chat: ChatRequest) -> list[int]:
        """The prompt ids of a request, or the refusal that costs nothing afterwards."""
        if session.finished:
            raise OpenAIRequestError("this rollout has finished", 404, "rollout_finished")
        tools_key = json.dumps(chat.tools, sort_keys=True)
        try:
            prompt_ids = await self._render(session, chat, tools_key)
            if len(prompt_ids) >= self.max_model_len:
                raise OpenAIRequestError(
                    f"the conversation renders to {len(prompt_ids)} tokens; the server's max_model_len is "
                    f"{self.max_model_len}", 400, "context_length_exceeded", "messages")
        except OpenAIRequestError:
            session.renderers.pop(tools_key, None)  # it holds the refused prompt: keep nothing of it
            raise
        self._tool_results_arrived(session, chat.messages)
        return prompt_ids

    async def _answer(self, session: CaptureSession, chat: ChatRequest,
                      prompt_ids: list[int]) -> tuple[TurnRecord, Reply]:
        task = asyncio.create_task(self.sample(prompt_ids, chat.max_tokens, chat.stop), context=session.context)
        session.tasks.add(task)
        try:
            await asyncio.wait({task})
        except asyncio.CancelledError:  # the agent hung up: its sampling request goes too
            task.cancel()
            raise
        finally:
            session.tasks.discard(task)
        if task.cancelled() or session.finished:
            raise OpenAIRequestError("this rollout finished while the request was sampled", 404, "rollout_finished")
        exc = task.exception()
        if isinstance(exc, VLLMServerError) and "refused with HTTP 4" in exc.message:
            raise OpenAIRequestError(f"the sampler refused the request: {exc.detail[:500]}")
        if exc is not None:
            session.fail(exc)
            raise OpenAIRequestError(f"sampling failed: {type(exc).__name__}: {exc}", 502, "sampler_error")
        turn, text = self._cut_at_stop(task.result(), chat.stop)
        session.turns.append(turn)
        reply = reply_from_text(text, chat.parse_tools, truncated=turn.finish_reason == "length", family=self.family,
                                tools=chat.tools)
        session.replies[reply.key] = text
        self._count_calls(session, chat, reply)
        message: dict[str, Any] = {"role": "assistant", "content": reply.content}
        if reply.reasoning_content is not None:
            message["reasoning_content"] = reply.reasoning_content
        if reply.tool_calls:
            message["tool_calls"] = reply.tool_calls
        session.conversation = [*chat.messages, message]
        return turn, reply

    def _cut_at_stop(self, turn: TurnRecord, stop: list[str]) -> tuple[TurnRecord, str]:
        """The turn ended after the token that completes the first stop string, and the text before it.

        The sampler is not told the stop strings, so it may generate past one; the tokens after it
        are dropped (never shown, never trained). The tokens kept are distributed exactly as if the
        sampler had stopped there itself.
        """
        def decode(ids: list[int]) -> str:
            return completion_text(self.tokenizer, ids, self._stop_ids)

        text = decode(turn.output_ids)
        if not any(s in text for s in stop):
            return turn, text
        lo, hi = 1, len(turn.output_ids)  # the shortest prefix whose text holds a stop string
        while lo < hi:
            mid = (lo + hi) // 2
            if any(s in decode(turn.output_ids[:mid]) for s in stop):
                hi = mid
            else:
                lo = mid + 1
        kept = decode(turn.output_ids[:lo])
        cut = dataclasses.replace(
            turn, output_ids=turn.output_ids[:lo], output_log_probs=turn.output_log_probs[:lo],
            output_mask=turn.output_mask[:lo] if turn.output_mask is not None else None,
            output_sampling_mask=turn.output_sampling_mask[:lo] if turn.output_sampling_mask is not None else None,
            output_sampler_logprobs=(turn.output_sampler_logprobs[:lo]
                                     if turn.output_sampler_logprobs is not None else None),
            finish_reason="stop")
        return cut, kept[: min(i for i in (kept.find(s) for s in stop) if i >= 0)]

    async def _render(self, session: CaptureSession, chat: ChatRequest, tools_key: str) -> list[int]:
        """The request's prompt ids; replies that came back unchanged render as generated.

        Rendering and tokenizing run on a thread (a long conversation takes seconds of CPU that would
        stall every other rollout on the worker's loop), one at a time per rollout (its renderers keep
        state). A rollout keeps the renderers of its last :data:`_RENDERERS_KEPT` tool sets.
        """
        messages = []
        for m in chat.messages:
            text = session.replies.get(assistant_key(m["content"], m.get("tool_calls"))) \
                if m["role"] == "assistant" else None
            messages.append(build_assistant_message(text, self.family, chat.tools) if text is not None else m)
        async with session.render_lock:
            render = session.renderers.pop(tools_key, None)
            if render is None:
                render = ConversationRenderer(self.tokenizer, chat.tools, self.chat_template, self._incremental,
                                              **self.kwargs)
            session.renderers[tools_key] = render  # the most recently used last
            while len(session.renderers) > _RENDERERS_KEPT:
                del session.renderers[next(iter(session.renderers))]
            try:
                return await asyncio.to_thread(render, messages)
            except Exception as exc:  # the template refused the conversation (a jinja TemplateError...)
                raise OpenAIRequestError(f"the chat template cannot render this conversation: "
                                         f"{type(exc).__name__}: {exc}", param="messages") from exc

    def _count_calls(self, session: CaptureSession, chat: ChatRequest, reply: Reply) -> None:
        """``tools/*`` metrics of one reply, as the built-in loop names them."""
        if chat.tools is None:
            return
        session.saw_tools = True
        offered = {t["function"].get("name") for t in chat.tools}
        failures = reply.malformed_calls
        self.records.add_rate("tools/failure_frequency", reply.malformed_calls, reply.malformed_calls)
        self.records.add_rate("tools/malformed_frequency", reply.stray_markers, 1)
        if reply.malformed_calls:
            self.records.add("tools/<unparsed>/call_count", reply.malformed_calls)
            self.records.add("tools/<unparsed>/failure_count", reply.malformed_calls)
        if reply.tool_calls:
            self.records.add("tools/parallel_calls_mean", len(reply.tool_calls))
        now = time.monotonic()
        for call in reply.tool_calls:
            name = call["function"]["name"]
            unknown = name not in offered
            failures += unknown
            self.records.add(f"tools/{name}/call_count", 1)
            self.records.add(f"tools/{name}/failure_count", int(unknown))
            self.records.add("tools/unknown_name_count", int(unknown))
            self.records.add_rate("tools/failure_frequency", int(unknown), 1)
            session.pending_calls[call["id"]] = (name, now)
        session.tool_calls += len(reply.tool_calls) + reply.malformed_calls
        session.tool_failures += failures

    def _tool_results_arrived(self, session: CaptureSession, messages: list[dict[str, Any]]) -> None:
        """``tools/latency_s``: from the reply that made a call to the request that brings its result."""
        now = time.monotonic()
        for m in messages:
            pending = session.pending_calls.pop(m.get("tool_call_id", ""), None) if m["role"] == "tool" else None
            if pending is not None:
                name, answered_at = pending
                self.records.add("tools/latency_s", now - answered_at)
                self.records.add(f"tools/{name}/latency_s", now - answered_at)


class InProcessTransport:
    """An ``httpx`` transport that answers the endpoint's routes in the caller's task, for the client of
    :attr:`~trainer.rollout.agents.AgentTask.client`.

    A Python agent runs on the worker's event loop beside the endpoint, so its requests need not
    cross a loopback socket: the transport hands each one to :meth:`CaptureServer.chat` (or
    :meth:`CaptureServer.models_body`) and returns the same status, headers and body the aiohttp
    server would. That saves the connection pool (which checks every pooled connection on each
    request), the HTTP framing on both sides and the loop iterations between them: most of the
    endpoint's cost per request. Any other URL, route or method goes over the network, as it would
    without this transport. A request's read timeout (the client's ``timeout``) bounds its answer.

    Args:
        server: The started endpoint.
        httpx: The ``httpx`` module of the ``openai`` client (``httpx`` or ``httpx2``, by version).
    """

    def __init__(self, server: CaptureServer, httpx: Any) -> None:
        self.server = server
        self.httpx = httpx
        self._network: Any = None

    async def __aenter__(self) -> InProcessTransport:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the network transport, if a request needed it."""
        if self._network is not None:
            await self._network.aclose()
            self._network = None

    def _route(self, request: Any) -> tuple[str, str | None] | None:
        """``(route, secret)`` of a request to this endpoint, ``None`` for anything else."""
        url = request.url
        if self.server.address is None or url.scheme != "http" or (url.host, url.port) != self.server.address:
            return None
        match = _ROUTE.fullmatch(url.path)
        if match is None or request.method != ("POST" if match["route"] == "chat/completions" else "GET"):
            return None
        return match["route"], match["secret"]

    async def handle_async_request(self, request: Any) -> Any:
        """Answer one request (the ``httpx`` transport interface)."""
        route = self._route(request)
        if route is None:
            if self._network is None:
                self._network = self.httpx.AsyncHTTPTransport()
            return await self._network.handle_async_request(request)
        name, secret = route
        auth = request.headers.get("Authorization", "")
        body: dict[str, Any] | list[bytes]
        if name == "models":
            status, body = self.server.models_body(secret, auth)
        else:
            async def read() -> bytes:
                data: bytes = await request.aread()
                if len(data) > self.server.max_request_bytes:
                    raise self.server.too_large()
                return data

            timeout = (request.extensions.get("timeout") or {}).get("read")
            deadline = asyncio.timeout(timeout)
            try:
                async with deadline:
                    status, body = await self.server.chat(secret, auth, read)
            except TimeoutError as exc:
                if not deadline.expired():
                    raise
                raise self.httpx.ReadTimeout("the endpoint did not answer within the read timeout",
                                             request=request) from exc
        if isinstance(body, list):
            return self.httpx.Response(status, content=b"".join(body), request=request, headers={
                "Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        return self.httpx.Response(status, content=json.dumps(body).encode(), request=request,
                                   headers={"Content-Type": "application/json; charset=utf-8"})
