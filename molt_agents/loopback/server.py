"""The loopback: an OpenAI-compatible server that captures what the policy samples.

Each rollout gets its own base URL, `http://127.0.0.1:PORT/s/<session>/v1`,
so a stock OpenAI client (any agent program) works unchanged while every
token id, logprob and weight version is recorded behind its back:

    POST /s/<session>/v1/chat/completions   (stream=true as server-sent events)
    POST /s/<session>/v1/completions
    POST /s/<session>/v1/responses          (OpenAI's Responses API, mapped onto the chat route: responses.py)
    POST /s/<session>/v1/messages           (Anthropic's Messages API, the same way: anthropic.py; the
    POST /s/<session>/v1/messages/count_tokens   anthropic SDK's base URL is http://127.0.0.1:PORT/s/<session>)
    GET  /s/<session>/v1/models
    POST /s/<session>/finish                {"reward": 1.0, "info": {...}} -> the session's trajectories
    POST /v1/chat/completions               the policy, captured nowhere (an LLM judge asking the policy)

A vision-language policy (`vision`) takes images as `image_url` content parts
with `data:` URLs (base64 PNG / JPEG / WebP / GIF); http(s) URLs are fetched
only when `image_limits.allow_remote` is set.

All routes need `Authorization: Bearer <api_key>` or `x-api-key: <api_key>`
(a fresh key per run by default). Bad input gets a 4xx with an OpenAI-style
error body (Anthropic's shape on the Messages routes) and leaves
the session as it was; so does a bad `/finish` body (a finite `reward`, an
optional `info` object, no other keys), and a session whose `on_finish`
fails stays open to be finished again. An unexpected error is logged
(logger `molt.loopback`) and answered with a 500 in the same shape, and the
client's connection stays open. A reply is only sent once it is captured:
a session finished while a request sampled answers that request with a 404.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import uuid
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from jinja2 import TemplateError
from starlette.exceptions import HTTPException as StarletteHTTPException

from molt_agents.chat_template import ReasoningFormat, reasoning_format, render_text
from molt_agents.engines.base import SamplingParams, turn_seed
from molt_agents.loopback import anthropic, protocol, responses, streaming
from molt_agents.loopback.anthropic import CountTokensRequest, MessagesRequest
from molt_agents.loopback.protocol import APIError, ChatRequest, CompletionRequest
from molt_agents.loopback.responses import ResponsesRequest
from molt_agents.loopback.session import Session
from molt_agents.loopback.streaming import ReplyText, Wire
from molt_agents.multimodal import ImageError, ImageLimits, chat_images, for_template, is_image_part
from molt_agents.tool_calls import parse_reply
from molt_env.trajectory import Trajectory

log = logging.getLogger("molt.loopback")

# How long an idle keep-alive connection stays open. A server that closes it while a client still counts
# it as reusable races that client's next request (the client reads a closed connection: httpx's
# ReadError). Clients drop idle connections after 4-15 s (httpx and the openai SDK 5 s, aiohttp 15 s) or
# never (requests); uvicorn's default, 5 s, is one of those. 75 s outlasts them, as nginx's default does.
KEEP_ALIVE_S = 75


class Loopback:
    """Serve `engine` (with `tokenizer`) on the OpenAI wire and capture sessions.

    `auto_sessions`: create a session on first use of an unknown id (molt-serve);
    off, an unknown session is a 404 (training, where the runner opens sessions).
    `on_finish(trajectories)` receives each finished session's segments; with `keep_messages` they carry
    the session's last chat request and reply (`Trajectory.messages`: molt-serve's files).
    """

    def __init__(self, engine, tokenizer, *, model_name: str = "policy", host: str = "127.0.0.1",
                 port: int = 0, api_key: str | None = None, max_model_len: int = 4096,
                 default_max_tokens: int = 512, max_body_bytes: int = 8 << 20, auto_sessions: bool = False,
                 keep_messages: bool = False,
                 on_finish: Callable[[list[Trajectory]], None] | None = None, vision=None,
                 image_limits: ImageLimits = ImageLimits()):
        self.engine, self.tokenizer = engine, tokenizer
        self.reasoning = reasoning_format(tokenizer)  # where the template writes reasoning, if it does
        self.vision, self.image_limits = vision, image_limits
        self.model_name, self.host, self.port = model_name, host, port
        self.api_key = api_key or secrets.token_urlsafe(24)
        self.max_model_len, self.default_max_tokens = max_model_len, default_max_tokens
        self.max_body_bytes, self.auto_sessions, self.on_finish = max_body_bytes, auto_sessions, on_finish
        self.keep_messages = keep_messages
        self.sessions: dict[str, Session] = {}
        self._sessions_lock = threading.Lock()
        self._server = None
        self._serving: asyncio.Future | None = None  # `begin`'s server on the caller's loop
        self._thread: threading.Thread | None = None
        # Chat and text completions stream as OpenAI's chunks, ended by [DONE].
        self._openai_wire = Wire(self._events, lambda error: streaming.event(error.body()), streaming.DONE)
        self.app = self._build_app()

    # ------------------------------------------------------------------
    # Sessions

    def open_session(self, session_id: str | None = None, *, rollout_id: str = "", group_id: str = "",
                     defaults: dict | None = None) -> Session:
        session_id = session_id or uuid.uuid4().hex
        with self._sessions_lock:
            if session_id in self.sessions:
                raise ValueError(f"session {session_id!r} already exists")
            session = Session(session_id, self.tokenizer, rollout_id=rollout_id, group_id=group_id,
                              defaults=dict(defaults or {}), vision=self.vision)
            self.sessions[session_id] = session
        return session

    def base_url(self, session_id: str) -> str:
        return f"http://{self.host}:{self.port}/s/{session_id}/v1"

    def finish(self, session_id: str, reward: float, info: dict | None = None) -> list[Trajectory]:
        """Close a session; returns (and hands to `on_finish`) its segments with the reward.

        If building the trajectories or `on_finish` fails, the session stays open, as it was.
        """
        with self._sessions_lock:
            session = self._existing(session_id)
            trajectories = session.trajectories(reward, info, self.keep_messages)
            del self.sessions[session_id]  # claimed: a concurrent finish of this session is a 404
            session.finished = True
        if self.on_finish is not None:
            try:
                self.on_finish(trajectories)
            except BaseException:
                with self._sessions_lock:
                    session.finished = False
                    self.sessions[session_id] = session
                raise
        return trajectories

    def discard(self, session_id: str) -> None:
        """Close a session without keeping anything (its agent failed); an unknown one is ignored."""
        with self._sessions_lock:
            session = self.sessions.pop(session_id, None)
            if session is not None:
                session.finished = True

    def _existing(self, session_id: str) -> Session:
        """The open session `session_id`, or a 404; the caller holds `_sessions_lock`."""
        session = self.sessions.get(session_id)
        if session is None:
            raise APIError(404, f"unknown session '{session_id}'", code="session_not_found")
        return session

    def _session(self, session_id: str) -> Session:
        """The open session `session_id`; with `auto_sessions`, an unknown one is opened."""
        with self._sessions_lock:
            if session_id in self.sessions or not self.auto_sessions:
                return self._existing(session_id)
        try:
            return self.open_session(session_id)
        except ValueError:  # opened concurrently by another request
            return self._session(session_id)

    # ------------------------------------------------------------------
    # Serving

    async def serve(self) -> None:
        """Serve on the running event loop until `stop()`."""
        import uvicorn

        self._pick_port()
        config = uvicorn.Config(self.app, host=self.host, port=self.port, log_level="warning",
                                lifespan="off", timeout_graceful_shutdown=1, timeout_keep_alive=KEEP_ALIVE_S)
        self._server = uvicorn.Server(config)
        await self._server.serve()

    def _pick_port(self) -> None:
        import socket

        if self.port == 0:  # pick a free port now, so base URLs are known before serving
            with socket.socket() as probe:
                probe.bind((self.host, 0))
                self.port = probe.getsockname()[1]

    @property
    def started(self) -> bool:
        return self._server is not None and self._server.started

    async def begin(self) -> None:
        """Serve on the running event loop in the background (once); returns when the port listens."""
        if self._serving is None:
            self._serving = asyncio.ensure_future(self.serve())
        while not self.started:
            if self._serving.done():
                raise RuntimeError(f"the loopback could not start on port {self.port}")
            await asyncio.sleep(0.01)

    def start(self) -> Loopback:
        """Serve from a background thread; returns once the port is listening."""
        self._pick_port()
        self._thread = threading.Thread(target=lambda: asyncio.run(self.serve()), daemon=True,
                                        name="molt-loopback")
        self._thread.start()
        while not self.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"the loopback failed to start on {self.host}:{self.port}")
            threading.Event().wait(0.02)
        return self

    def stop(self) -> None:
        if self._serving is not None:
            self._serving.cancel()
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)

    # ------------------------------------------------------------------
    # App

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="molt loopback", docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(APIError)
        async def api_error(request: Request, error: APIError):
            return _answer(request.url.path, error)

        @app.exception_handler(StarletteHTTPException)
        async def http_error(request: Request, error: StarletteHTTPException):
            return _answer(request.url.path, APIError(error.status_code, str(error.detail),
                                                      code="not_found" if error.status_code == 404 else None))

        app.add_middleware(_AuthorizeAndContain, api_key=self.api_key)

        @app.get("/s/{session_id}/v1/models")
        async def models(session_id: str):
            self._session(session_id)
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                                "owned_by": "molt", "max_model_len": self.max_model_len}]}

        @app.post("/s/{session_id}/v1/chat/completions")
        async def chat_completions(session_id: str, request: Request):
            body = protocol.parse(ChatRequest, await self._read_json(request))
            session = self._session(session_id)
            find_base = await self._chat_base(session, body, param="messages")
            return await self._respond(session, find_base, body, body.top_logprobs or 0, self._chat_response,
                                       self._openai_wire)

        @app.post("/s/{session_id}/v1/responses")
        async def responses_api(session_id: str, request: Request):
            body = protocol.parse(ResponsesRequest, await self._read_json(request))
            session = self._session(session_id)
            conversation = responses.conversation(body, session.conversations)
            chat = responses.chat_request(body, conversation)
            find_base = await self._chat_base(session, chat, param="input")
            reply = responses.Reply(body, self.model_name)

            def build(*chat_reply_args) -> dict:
                chat_reply = self._chat_response(*chat_reply_args)
                final = reply.response(chat_reply)
                if body.store:  # for a later request's previous_response_id
                    session.conversations[reply.id] = [*conversation, chat_reply["choices"][0]["message"]]
                return final

            return await self._respond(session, find_base, chat, 0, build, Wire(reply.events, reply.error))

        @app.post("/s/{session_id}/v1/messages")
        async def messages_api(session_id: str, request: Request):
            body = protocol.parse(MessagesRequest, await self._read_json(request))
            session = self._session(session_id)
            chat = anthropic.chat_request(body, self.reasoning)
            find_chat_base = await self._chat_base(session, chat, param="messages")
            reply = anthropic.Reply(self.model_name, self.reasoning if body.thinks else None)

            def find_base():
                base = find_chat_base()
                reply.input_tokens = len(base.token_ids)  # for message_start, sent once sampling starts
                return base

            def build(chat_body, base, samples, stop) -> dict:
                stopped_by = anthropic.stop_sequence(self._reply_text(samples[0], []), stop)
                return reply.message(self._chat_response(chat_body, base, samples, stop, reply.reasoning),
                                     stopped_by)

            return await self._respond(session, find_base, chat, 0, build, Wire(reply.events, reply.error))

        @app.post("/s/{session_id}/v1/messages/count_tokens")
        async def count_tokens(session_id: str, request: Request):
            body = protocol.parse(CountTokensRequest, await self._read_json(request))
            self._session(session_id)
            messages, tools = anthropic.chat_messages(body, self.reasoning)
            rendered = self._render(ChatRequest(messages=messages, tools=tools), param="messages")
            return {"input_tokens": len(self.tokenizer.encode(rendered, add_special_tokens=False))}

        @app.post("/s/{session_id}/v1/completions")
        async def completions(session_id: str, request: Request):
            body = protocol.parse(CompletionRequest, await self._read_json(request))
            session = self._session(session_id)
            if isinstance(body.prompt, list) and any(t < 0 or t >= len(self.tokenizer) for t in body.prompt):
                raise APIError(400, "prompt holds token ids outside the vocabulary", param="prompt")
            find_base = (lambda: session.base_for_text(body.prompt)) if isinstance(body.prompt, str) \
                else (lambda: session.base_for_ids(body.prompt))
            return await self._respond(session, find_base, body, body.logprobs or 0, self._completion_response,
                                       self._openai_wire)

        @app.post("/v1/chat/completions")
        async def uncaptured(request: Request):
            # The policy for a caller that trains nothing on it (an LLM judge: `molt_env.Judge("policy")`).
            body = protocol.parse(ChatRequest, await self._read_json(request))
            session = Session(uuid.uuid4().hex, self.tokenizer, vision=self.vision)  # this request's alone
            find_base = await self._chat_base(session, body, param="messages")
            return await self._respond(session, find_base, body, body.top_logprobs or 0, self._chat_response,
                                       self._openai_wire)

        @app.post("/s/{session_id}/finish")
        async def finish(session_id: str, request: Request):
            body = protocol.parse(protocol.FinishRequest, await self._read_json(request))
            with self._sessions_lock:
                session = self._existing(session_id)
            async with session.lock:  # a request still sampling on this session is captured first
                trajectories = self.finish(session_id, body.reward, body.info)
            return {"session": session_id, "segments": len(trajectories),
                    "trainable_tokens": sum(t.num_trainable for t in trajectories)}

        return app

    async def _chat_base(self, session: Session, body: ChatRequest, param: str):
        """Render `body`'s messages and tools; returns the `find_base` that stitches them onto the session.
        `param` names the request field an error is about."""
        # Decoding (or fetching) images runs off the event loop; text-only requests skip the thread hop.
        images = await asyncio.to_thread(self._images, body.messages, param) if _has_images(body.messages) else []
        rendered = self._render(body, param)
        return lambda: session.base_for_text(rendered, images)

    def _render(self, body: ChatRequest, param: str) -> str:
        """`body`'s messages and tools under the model's chat template, ready for the reply."""
        try:
            return render_text(self.tokenizer, for_template(body.messages), body.tools)
        except TemplateError as error:  # the template's own raise_exception, e.g. "roles must alternate"
            raise APIError(400, f"the model's chat template refuses these messages: {error}",
                           param=param) from None

    def _images(self, messages: list[dict], param: str) -> list:
        if self.vision is None:
            raise APIError(400, "the request has images, but this policy is not a vision-language model",
                           param=param, code="invalid_image")
        try:
            images = chat_images(messages, self.image_limits)
        except ImageError as error:
            raise APIError(400, str(error), param=param, code="invalid_image") from None
        return images

    async def _read_json(self, request: Request):
        """The decoded body, read no further than `max_body_bytes`."""
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise APIError(413, f"request body over {self.max_body_bytes} bytes", code="body_too_large")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_body_bytes:
                raise APIError(413, f"request body over {self.max_body_bytes} bytes", code="body_too_large")
        return protocol.decode(bytes(body))

    # ------------------------------------------------------------------
    # Generation

    async def _respond(self, session: Session, find_base, body, top: int, build, wire: Wire):
        """Sample for a chat or completion request; a stream written by `wire`, or the whole response.

        `build(body, base, samples, stop)` makes the response once the samples are captured. It is JSON
        as it is, so it goes out as a `JSONResponse` (FastAPI would walk a returned dict to encode it).
        """
        if body.stream:
            return await self._stream(session, find_base, body, top, build, wire)
        async with session.lock:
            return JSONResponse(await self._generate(session, find_base, body, top, build))

    async def _generate(self, session: Session, find_base, body, top: int, build, on_start=None,
                        on_tokens=None) -> dict:
        """Sample for `body` after the segment `find_base()` picks, capture the samples and `build` the
        response; the session is unchanged on failure, so a client never sees a reply that was not captured.

        `on_start()` runs once the request is accepted; `on_tokens` sees tokens as they are sampled.
        """
        mark = session.mark()
        try:
            base = find_base()
            samples = await self._sample(session, base, body, top, on_start, on_tokens)
            if session.finished:  # by the runner, directly, while this request sampled
                raise APIError(404, f"session '{session.id}' was finished while this request sampled",
                               code="session_not_found")
            for segment, sample in zip(session.choices(base, body.n), samples):
                segment.append_sample(sample)
            stop = self._stop(session, body)
            response = build(body, base, samples, stop)
            if isinstance(body, ChatRequest):
                reply = {"role": "assistant", "content": self._reply_text(samples[0], stop)}
                session.chat = [*for_template(body.messages), reply]
            return response
        except BaseException:  # a rejected, failed or abandoned request leaves no trace
            session.restore(mark)
            raise

    async def _sample(self, session: Session, base, body, top: int, on_start, on_tokens):
        prompt_len = len(base.token_ids)
        room = self.max_model_len - prompt_len
        if room < 1:
            raise APIError(400, f"the prompt is {prompt_len} tokens; the context window is "
                                f"{self.max_model_len}", param="messages", code="context_length_exceeded")
        defaults = session.defaults
        pick = lambda value, name, fallback: value if value is not None else defaults.get(name, fallback)  # noqa: E731
        params = SamplingParams(
            temperature=pick(body.temperature, "temperature", 1.0),
            top_p=pick(body.top_p, "top_p", 1.0),
            top_k=max(pick(body.top_k, "top_k", 0), 0),
            max_tokens=min(pick(body.max_new_tokens, "max_tokens", self.default_max_tokens), room),
            stop=tuple(self._stop(session, body)),
            stop_token_ids=(self.tokenizer.eos_token_id,),
            # A seed the client sets is its own; the session's default seed moves on with every request.
            seed=body.seed if body.seed is not None else turn_seed(defaults.get("seed"), session.requests),
            n=body.n,
            top_logprobs=top,
        )
        session.requests += 1
        if on_start is not None:
            on_start()
        return await self.engine.generate(list(base.token_ids), params, on_tokens=on_tokens,
                                          images=base.prompt_images())

    @staticmethod
    def _stop(session: Session, body) -> list[str]:
        return body.stop_list or list(session.defaults.get("stop", ()))

    def _reply_text(self, sample, stop: list[str]) -> str:
        """What the client sees: no end-of-turn token, cut before a stop string (the tokens stay whole)."""
        ids = sample.token_ids
        if ids and ids[-1] == self.tokenizer.eos_token_id:
            ids = ids[:-1]
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        cuts = [text.find(s) for s in stop if s and s in text]
        return text[: min(cuts)] if cuts else text

    def _usage(self, prompt_len: int, samples) -> dict:
        completion = sum(len(s.token_ids) for s in samples)
        return {"prompt_tokens": prompt_len, "completion_tokens": completion,
                "total_tokens": prompt_len + completion}

    def _logprobs(self, sample) -> list[dict]:
        tops = sample.top_logprobs or [None] * len(sample.token_ids)
        return [protocol.token_logprob(self.tokenizer, t, lp, top)
                for t, lp, top in zip(sample.token_ids, sample.logprobs, tops)]

    def _chat_response(self, body: ChatRequest, base, samples, stop: list[str],
                       reasoning: ReasoningFormat | None = None) -> dict:
        """The chat completion of `samples`; with `reasoning`, a reply's leading reasoning is split off into
        the message's `reasoning_content` (as vLLM's reasoning parsers do) before tool calls are parsed."""
        prompt_len = len(base.token_ids) - len(samples[0].token_ids)
        out = []
        for index, sample in enumerate(samples):
            text = self._reply_text(sample, stop)
            thought, text = reasoning.split(text) if reasoning else (None, text)
            content, tool_calls = parse_reply(text) if body.tool_choice != "none" and body.tools else (text, [])
            message = {"role": "assistant", "content": content}
            if thought is not None:
                message["reasoning_content"] = thought
            if tool_calls:
                message["tool_calls"] = tool_calls
            finish_reason = "tool_calls" if tool_calls else sample.finish_reason
            choice = {"index": index, "message": message, "finish_reason": finish_reason,
                      "logprobs": {"content": self._logprobs(sample)} if body.logprobs else None}
            out.append(choice)
        return {"id": protocol.new_id("chatcmpl"), "object": "chat.completion", "created": protocol.now(),
                "model": self.model_name, "choices": out, "usage": self._usage(prompt_len, samples)}

    def _completion_response(self, body: CompletionRequest, base, samples, stop: list[str]) -> dict:
        prompt_len = len(base.token_ids) - len(samples[0].token_ids)
        out = []
        for index, sample in enumerate(samples):
            choice = {"index": index, "text": self._reply_text(sample, stop),
                      "finish_reason": sample.finish_reason, "logprobs": None}
            if body.logprobs is not None:
                entries = self._logprobs(sample)
                choice["logprobs"] = {"tokens": [e["token"] for e in entries],
                                      "token_logprobs": [e["logprob"] for e in entries],
                                      "top_logprobs": [{t["token"]: t["logprob"] for t in e.get("top_logprobs", [])}
                                                       for e in entries] if body.logprobs else None,
                                      "text_offset": []}
            out.append(choice)
        return {"id": protocol.new_id("cmpl"), "object": "text_completion", "created": protocol.now(),
                "model": self.model_name, "choices": out, "usage": self._usage(prompt_len, samples)}

    # ------------------------------------------------------------------
    # Streaming

    async def _stream(self, session: Session, find_base, body, top: int, build, wire: Wire) -> StreamingResponse:
        """Start sampling; a request rejected before sampling starts is still a plain 4xx."""
        events: asyncio.Queue = asyncio.Queue()

        async def produce():
            async with session.lock:
                final = await self._generate(
                    session, find_base, body, top, build, on_start=lambda: events.put_nowait(("start",)),
                    on_tokens=lambda index, progress: events.put_nowait(("tokens", index, progress)))
            events.put_nowait(("done", final))

        def failed(task: asyncio.Task):
            if not task.cancelled() and task.exception() is not None:
                events.put_nowait(("error", task.exception()))

        task = asyncio.create_task(produce())
        task.add_done_callback(failed)
        try:
            first = await events.get()
        except asyncio.CancelledError:
            task.cancel()
            raise
        if first[0] == "error":
            raise first[1]
        written = wire.events(body, self._sampled(session, body, events))
        return _Stream(self._guarded(session, written, wire, task), task)

    async def _sampled(self, session: Session, body, events: asyncio.Queue):
        """The reply as the engine samples it, for any protocol: `("text", index, progress, new_text)` per
        batch of tokens (`new_text`: what is now safe to show), then `("done", final_response, replies)`."""
        tools = isinstance(body, ChatRequest) and bool(body.tools) and body.tool_choice != "none"
        replies = [ReplyText(self.tokenizer, self._stop(session, body), tools=tools) for _ in range(body.n)]
        while True:
            kind, *rest = await events.get()
            if kind == "error":
                raise rest[0]
            if kind == "done":
                yield "done", rest[0], replies
                return
            index, progress = rest
            yield "text", index, progress, replies[index].feed(progress.token_ids)

    async def _guarded(self, session: Session, written, wire: Wire, task: asyncio.Task):
        """Send `written`; a failure becomes the stream's last event, and a client that hangs up aborts sampling."""
        try:
            async for event in written:
                yield event
        except Exception as error:  # the status was sent with the headers: the error is the last event
            if not isinstance(error, APIError):
                log.error("streaming a reply on session %s failed", session.id, exc_info=error)
                error = APIError(500, f"generation failed: {error}", type="server_error")
            yield wire.error(error)
        finally:
            if not task.done():  # the client hung up: abort sampling; the session is restored
                task.cancel()
        if wire.end:
            yield wire.end

    async def _events(self, body, sampled):
        """Chat and text completion chunks."""
        chat = isinstance(body, ChatRequest)
        head = {"id": protocol.new_id("chatcmpl" if chat else "cmpl"),
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": protocol.now(), "model": self.model_name}

        def chunk(choices, **extra):
            return streaming.event({**head, "choices": choices, **extra})

        def piece(index, text, logprobs=None, finish_reason=None, **delta):
            if chat:
                delta = ({"content": text} if text else {}) | delta
                return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

        if chat:
            yield chunk([piece(i, "", role="assistant") for i in range(body.n)])
        async for kind, *rest in sampled:
            if kind == "text":
                index, progress, text = rest
                logprobs = None
                if (body.logprobs if chat else body.logprobs is not None):
                    entries = self._logprobs(progress)
                    logprobs = {"content": entries} if chat else {
                        "tokens": [e["token"] for e in entries],
                        "token_logprobs": [e["logprob"] for e in entries]}
                if text or logprobs:
                    yield chunk([piece(index, text, logprobs)])
                continue
            final, replies = rest
            for choice, reply in zip(final["choices"], replies):
                index = choice["index"]
                if chat:
                    rest_text = reply.rest(choice["message"]["content"])
                    if rest_text:
                        yield chunk([piece(index, rest_text)])
                    for i, call in enumerate(choice["message"].get("tool_calls", [])):
                        yield chunk([piece(index, "", tool_calls=[{"index": i, **call}])])
                else:
                    rest_text = reply.rest(choice["text"])
                    if rest_text:
                        yield chunk([piece(index, rest_text)])
                yield chunk([piece(index, "", finish_reason=choice["finish_reason"])])
            if body.include_usage_in_stream:
                yield chunk([], usage=final["usage"])


_UNEXPECTED = APIError(500, "the loopback failed on this request; its log (logger 'molt.loopback') has the traceback",
                       type="server_error")
_UNAUTHORIZED = APIError(401, "missing or wrong API key (Authorization: Bearer <key>, or x-api-key: <key>)",
                         type="authentication_error", code="invalid_api_key")


def _answer(path: str, error: APIError) -> JSONResponse:
    """`error` as a response in the shape of the API that `path` belongs to."""
    body = anthropic.error_body(error) if anthropic.speaks(path) else error.body()
    return JSONResponse(body, status_code=error.status)


class _AuthorizeAndContain:
    """ASGI middleware around every route: a request without the API key gets a 401; an error no route
    handled gets a JSON 500 and is logged, where Starlette would answer 500 but re-raise and uvicorn drop
    the client's connection. Plain ASGI (not `@app.middleware("http")`, which runs each request in a task
    of its own behind memory streams)."""

    def __init__(self, app, api_key: str):
        self.app, self.bearer, self.key = app, f"Bearer {api_key}".encode(), api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if _header(scope, b"authorization") != self.bearer and _header(scope, b"x-api-key") != self.key:
            return await _answer(scope["path"], _UNAUTHORIZED)(scope, receive, send)
        started = False

        async def sending(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception:
            if started:  # the status is sent; a stream reports its own errors (`Loopback._guarded`)
                raise
            log.exception("%s %s failed", scope["method"], scope["path"])
            await _answer(scope["path"], _UNEXPECTED)(scope, receive, send)


def _header(scope, name: bytes) -> bytes | None:
    """The first value of header `name` (lower case) in an ASGI `scope`."""
    return next((value for key, value in scope["headers"] if key == name), None)


class _Stream(StreamingResponse):
    """Server-sent events that stop `sampling` (a task) the moment the client hangs up. Starlette's own
    response cancels its writer then, but through anyio, which delivers the cancel only while the writer
    waits on nothing ready; a writer fed by every engine step can miss it until the reply is done."""

    def __init__(self, content, sampling: asyncio.Task):
        super().__init__(content, media_type="text/event-stream")
        self.sampling = sampling

    async def listen_for_disconnect(self, receive) -> None:
        await super().listen_for_disconnect(receive)
        self.sampling.cancel()  # `_generate` restores the session; `_guarded` ends the stream


def _has_images(messages: list[dict]) -> bool:
    return any(isinstance(m.get("content"), list) and any(map(is_image_part, m["content"])) for m in messages)
