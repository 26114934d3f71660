"""vLLM's tokenizer endpoints, with its request and response shapes: POST /tokenize (a prompt, or chat
messages through the model's chat template), POST /detokenize and GET /tokenizer_info. They are
installed beside the OpenAI routes, so the router answers them itself from its tokenizer pool and
never touches a worker; a worker answers them too."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import Field, ValidationError, model_validator

from pdserve.chat_content import chat_messages
from pdserve.common.errors import APIError
from pdserve.protocol import ChatMessage, OpenAIModel, Tool, unsupported
from pdserve.server import tool_calls

if TYPE_CHECKING:
    from pdserve.server.openai_api import OpenAIHandlers


class _Tokenize(OpenAIModel):
    model: str | None = None
    add_special_tokens: bool | None = None
    return_token_strs: bool = False


class TokenizeCompletionRequest(_Tokenize):
    prompt: str


class TokenizeChatRequest(_Tokenize):
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = Field(default=None, max_length=128)  # shown as a chat request shows them

    @model_validator(mode="before")
    @classmethod
    def _implemented(cls, data: Any) -> Any:
        refused = ("chat_template", "continue_final_message", "documents")
        unsupported.refuse_unsupported(data, {k: unsupported.CHAT[k] for k in refused})
        return data


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int]


def _parse(model: type[OpenAIModel], body: Any) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as e:  # the same 400 body as the routes' own validation
        raise RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in e.errors()]) from None


async def _json(http: Request) -> Any:
    try:
        return await http.json()
    except ValueError:
        raise RequestValidationError(
            [{"type": "json_invalid", "loc": ("body",), "msg": "invalid JSON"}]
        ) from None


def install_tokenize_api(app: FastAPI, handlers: OpenAIHandlers, max_model_len: Callable[[], int]) -> None:
    tok = handlers.tokenizer

    def check_model(name: str | None) -> None:
        if name is not None:
            handlers._check_model(name)

    @app.post("/tokenize")
    async def tokenize(http: Request):
        body = await _json(http)
        chat = isinstance(body, dict) and "messages" in body
        req = _parse(TokenizeChatRequest if chat else TokenizeCompletionRequest, body)
        check_model(req.model)
        if isinstance(req, TokenizeChatRequest):
            tools = tool_calls.shown(req.tools, tok.chat_template)
            messages = tool_calls.template_messages(
                chat_messages(req.messages, handlers.model_name), tools, tok.chat_template
            )
            kwargs = {**(req.chat_template_kwargs or {}), **(tools.template_kwargs() if tools else {})}
            try:
                ids = await handlers.encoder.encode_chat(
                    messages,
                    req.add_generation_prompt,
                    bool(req.add_special_tokens),
                    kwargs or None,
                )
            except ValueError as e:
                raise APIError(400, str(e), "messages", "invalid_value") from e
        else:
            special = True if req.add_special_tokens is None else req.add_special_tokens
            ids = await handlers.encoder.encode(req.prompt, special)
        strs = [tok.id_to_token(i) for i in ids] if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": max_model_len(), "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(http: Request):
        req = _parse(DetokenizeRequest, await _json(http))
        check_model(req.model)
        bad = next((i for i, t in enumerate(req.tokens) if not 0 <= t < tok.vocab_size), None)
        if bad is not None:
            raise APIError(
                400,
                f"tokens[{bad}] = {req.tokens[bad]} is outside the vocabulary (0..{tok.vocab_size - 1})",
                "tokens",
                "invalid_value",
            )
        return {"prompt": tok.decode(req.tokens, skip_special_tokens=False)}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        def text(i: int | None) -> str | None:
            return tok.id_to_token(i) if i is not None else None

        return {
            "tokenizer_class": type(tok.tok).__name__,
            "model": handlers.model_name,
            "vocab_size": tok.vocab_size,
            "model_max_length": max_model_len(),
            "bos_token": text(tok.bos_token_id),
            "bos_token_id": tok.bos_token_id,
            "add_bos_token": tok.add_bos,
            "eos_token": text(tok.eos_token_ids[0]) if tok.eos_token_ids else None,
            "eos_token_ids": list(tok.eos_token_ids),
            "chat_template": tok.chat_template,
        }
