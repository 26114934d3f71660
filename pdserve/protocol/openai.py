"""The OpenAI-compatible HTTP API's types: the completion and chat requests (with the fields this
server refuses, protocol/unsupported.py), usage and error bodies, ids and the /v1/models card."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pdserve.protocol import unsupported


class OpenAIModel(BaseModel):
    # Unknown fields are accepted and ignored, as OpenAI-compatible servers do; the known fields
    # this server does not implement are refused (protocol/unsupported.py).
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
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None  # token id (a string, as JSON keys are) -> bias
    prompt_logprobs: int | None = None  # vLLM's: top-k logprobs of every prompt token
    cache_salt: str | None = None  # requests with different salts never share cached prefixes
    # Output constraints (common/structured.py reads them; at most one per request).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None  # vLLM's older spellings of structured_outputs
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None

    def guided(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in GUIDED_FIELDS}


GUIDED_FIELDS = (
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_whitespace_pattern",
)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False

    @model_validator(mode="before")
    @classmethod
    def _implemented(cls, data: Any) -> Any:
        unsupported.refuse_unsupported(data, {**unsupported.COMMON, **unsupported.COMPLETION})
        return data


class ImageURL(OpenAIModel):
    url: str
    detail: str | None = None


class ContentPart(OpenAIModel):
    type: str
    text: str | None = None
    refusal: str | None = None  # the text of an assistant's "refusal" part
    image_url: ImageURL | str | None = None  # an "image_url" part: a data: URL (or http(s), if allowed)


class FunctionCall(OpenAIModel):
    name: str
    arguments: str  # a JSON object, as a string


class ToolCallItem(OpenAIModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionSpec(OpenAIModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class Tool(OpenAIModel):
    type: Literal["function"]
    function: FunctionSpec


class NamedToolChoice(OpenAIModel):
    type: Literal["function"]
    function: dict[str, str]  # {"name": ...}


class ChatMessage(OpenAIModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallItem] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        # Only text reaches the template; chat_content.py refuses the parts it cannot read.
        return "".join(
            (p.refusal if p.type == "refusal" else p.text) or ""
            for p in self.content
            if p.type in ("text", "refusal")
        )


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    chat_template_kwargs: dict[str, Any] | None = None  # more template variables (enable_thinking, ...)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="before")
    @classmethod
    def _implemented(cls, data: Any) -> Any:
        unsupported.refuse_unsupported(data, {**unsupported.COMMON, **unsupported.CHAT})
        return data


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
    return {
        "id": name,
        "object": "model",
        "created": now(),
        "owned_by": "pdserve",
        "max_model_len": max_model_len,
    }
