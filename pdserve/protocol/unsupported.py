"""Fields of the OpenAI API and of vLLM's extensions that pdserve does not implement: a request that
sets one to anything but its no-op value gets a 400 naming it, never a 200 that silently ignores it
(a client switching from vLLM must not find out in production). Fields no one defines here (other
vendors' extras) still pass unread. Each entry: field -> (is the value a no-op?, what to say)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic_core import PydanticCustomError

Rule = tuple[Callable[[Any], bool], str]

UNSUPPORTED_TYPE = "unsupported_parameter"


def _unset(v: Any) -> bool:
    return v is None or v is False or v == [] or v == {} or v == ""


def _one_of(*noops: Any) -> Callable[[Any], bool]:
    return lambda v: v is None or any(v == n and type(v) is type(n) for n in noops)


_LATER = "is not supported by this server"

COMMON: dict[str, Rule] = {
    "structural_tag": (_unset, f"structural tags {_LATER}"),
    "allowed_token_ids": (_unset, f"allowed_token_ids {_LATER}"),
    "bad_words": (_unset, f"bad_words {_LATER}"),
    "logits_processors": (_unset, f"logits_processors {_LATER}"),
    "min_tokens": (_one_of(0), f"min_tokens {_LATER}"),
    "use_beam_search": (_unset, f"beam search {_LATER}"),
    "length_penalty": (_one_of(1, 1.0), f"length_penalty {_LATER}"),
    "best_of": (_one_of(1), f"best_of above 1 {_LATER}"),
    "truncate_prompt_tokens": (lambda v: v is None, f"truncate_prompt_tokens {_LATER}"),
    "include_stop_str_in_output": (_unset, f"include_stop_str_in_output {_LATER}"),
    "skip_special_tokens": (_one_of(True), f"skip_special_tokens false {_LATER}"),
    "spaces_between_special_tokens": (_one_of(True), f"spaces_between_special_tokens false {_LATER}"),
    "return_tokens_as_token_ids": (_unset, f"return_tokens_as_token_ids {_LATER}"),
    "priority": (_one_of(0), f"request priorities {_LATER}"),
    "kv_transfer_params": (_unset, f"kv_transfer_params {_LATER}"),
    "reasoning_effort": (lambda v: v is None, f"reasoning_effort {_LATER}"),
}

CHAT: dict[str, Rule] = {
    "functions": (_unset, f"function calls {_LATER}"),
    "function_call": (_one_of("none", "auto"), f"function calls {_LATER}"),
    "audio": (_unset, f"audio output {_LATER}"),
    "modalities": (lambda v: v is None or v == ["text"], f"output modalities other than text {_LATER}"),
    "prediction": (_unset, f"predicted outputs {_LATER}"),
    "chat_template": (_unset, f"a request's own chat_template {_LATER}"),
    "add_generation_prompt": (_one_of(True), f"add_generation_prompt false {_LATER}"),
    "continue_final_message": (_unset, f"continue_final_message {_LATER}"),
    "documents": (_unset, f"documents {_LATER}"),
    "mm_processor_kwargs": (_unset, f"mm_processor_kwargs {_LATER}"),
    "web_search_options": (_unset, f"web search {_LATER}"),
    "echo": (_unset, f"echo on chat completions {_LATER}"),
}

COMPLETION: dict[str, Rule] = {
    "suffix": (_unset, f"suffix (insertion) {_LATER}"),
    "add_special_tokens": (_one_of(True), f"add_special_tokens false {_LATER}"),
}


def refuse_unsupported(data: Any, rules: dict[str, Rule]) -> None:
    """Raises a validation error (type unsupported_parameter, ctx param) for the first field of
    `data`, a request body as parsed, that asks for what is not implemented."""
    if not isinstance(data, dict):
        return
    for name, (noop, what) in rules.items():
        if name in data and not noop(data[name]):
            raise PydanticCustomError(UNSUPPORTED_TYPE, "{param}: {what}", {"param": name, "what": what})
