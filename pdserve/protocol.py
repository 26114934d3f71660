"""The only types that cross a process boundary: the OpenAI-compatible HTTP API."""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field


class OpenAIModel(BaseModel):
    # Unknown fields are accepted and ignored, as OpenAI-compatible servers do.
    model_config = ConfigDict(extra="ignore")


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class _SamplingFields(OpenAIModel):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: str | None = None   # requests with different salts never share cached prefixes


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: int | None = None
    echo: bool = False


class ContentPart(OpenAIModel):
    type: str
    text: str | None = None


class ChatMessage(OpenAIModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[str, list[ContentPart], None] = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text or "" for p in self.content if p.type == "text")


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def model_card(name: str, max_model_len: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": now(), "owned_by": "pdserve", "max_model_len": max_model_len}
