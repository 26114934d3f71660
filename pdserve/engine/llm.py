"""Offline API: `LLM(model=...).generate(prompts, SamplingParams(...))` and `.chat(...)`."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Sequence, cast

from pdserve.common.images import ImageInput, expand_image_tokens
from pdserve.common.sampling import SamplingParams
from pdserve.config import Config, load_config
from pdserve.config_flags import keyword_key
from pdserve.engine.engine import LLMEngine
from pdserve.engine.request import TokenLogprob
from pdserve.model.loader import LoadedModel


@dataclass
class GenerationOutput:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # With SamplingParams.prompt_logprobs: one entry per prompt token, None for the first.
    prompt_logprobs: list[TokenLogprob | None] | None = None


class LLM:
    """Runs requests to completion in one process, with the same engine the server uses.

    Keyword overrides use dotted config keys with dots as double underscores, or the short names of
    the command-line flags (config_flags.FLAGS): LLM(model="smollm2-135m", dtype="float32",
    block_size=16, max_num_seqs=64).
    """

    def __init__(
        self,
        model: str | None = None,
        config: Config | None = None,
        loaded: LoadedModel | None = None,
        **overrides: Any,
    ) -> None:
        """`loaded` reuses weights already in memory (tests build several engines on one model)."""
        if model is not None:
            overrides["model"] = model
        dotted = {keyword_key(k): v for k, v in overrides.items()}
        self.config = config or load_config(None, dotted)
        self.engine = LLMEngine(self.config, loaded)
        self.config = self.engine.config  # model.quantization resolved (auto: as the weights are stored)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: str | list[int] | Sequence[str] | Sequence[list[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[GenerationOutput]:
        one = isinstance(prompts, str) or (prompts and isinstance(prompts[0], int))  # a batch of one
        batch = cast("Sequence[str | list[int]]", [prompts] if one else prompts)
        token_lists = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in batch]
        return self._run(token_lists, params)

    def chat(
        self,
        conversations: list[dict[str, Any]] | list[list[dict[str, Any]]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[GenerationOutput]:
        # One conversation (a list of messages) is a batch of one.
        batch = [conversations] if conversations and isinstance(conversations[0], dict) else conversations
        prompts = [self._chat_prompt(cast("list[dict[str, Any]]", c)) for c in batch]
        return self._run([ids for ids, _ in prompts], params, [images for _, images in prompts])

    def _chat_prompt(self, messages: list[dict[str, Any]]) -> tuple[list[int], list[ImageInput]]:
        """Token ids and images of a conversation; a VLM reads OpenAI `image_url` parts (data: URLs)."""
        vision = self.engine.images
        if all(not isinstance(m.get("content"), list) for m in messages):
            return self.tokenizer.encode_chat(messages), []
        from pdserve.chat_content import chat_inputs
        from pdserve.common.errors import APIError
        from pdserve.protocol import ChatMessage

        try:  # content parts as the server reads them: refused the same way
            inputs = chat_inputs(
                [ChatMessage.model_validate(m) for m in messages],
                self.engine.model_name,
                vision.slots.placeholder if vision else None,
                self.config.vision,
            )
        except APIError as e:
            raise ValueError(e.message) from None
        if vision is None:
            return self.tokenizer.encode_chat(inputs.messages), []
        return expand_image_tokens(
            self.tokenizer.encode_chat(inputs.messages),
            vision.slots.image_token_id,
            vision.slots.tokens_per_image,
            inputs.images,
        )

    def _run(
        self,
        token_lists: list[list[int]],
        params: SamplingParams | Sequence[SamplingParams] | None,
        images: list[list[ImageInput]] | None = None,
    ) -> list[GenerationOutput]:
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(token_lists)
        if len(params) != len(token_lists):
            raise ValueError("give one SamplingParams, or one per prompt")
        images = images or [[] for _ in token_lists]
        for ids, p, ims in zip(token_lists, params, images):
            self.engine.check_request(ids, p, images=ims)  # reject the batch before anything runs
        results: dict[str, GenerationOutput] = {}
        order = []
        for ids, p, ims in zip(token_lists, params, images):
            rid = f"offline-{next(self._ids)}"
            order.append(rid)
            results[rid] = GenerationOutput(prompt_token_ids=ids)
            self.engine.add_request(rid, ids, p, images=ims)
        for out in self.engine.run_until_idle():
            r = results[out.request_id]
            r.token_ids.extend(out.new_token_ids)
            r.text += out.new_text
            r.logprobs.extend(out.new_logprobs)
            if out.prompt_logprobs is not None:
                r.prompt_logprobs = out.prompt_logprobs
            if out.finished:
                r.finish_reason = out.finish_reason
        return [results[rid] for rid in order]
