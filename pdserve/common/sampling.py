"""Per-request sampling parameters (the vLLM/OpenAI set), validated with the offending param named."""
from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.common.errors import InvalidParam


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                      # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16         # None: up to the context length
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logprobs: int | None = None         # top-k logprobs per sampled token (0 = the sampled token only)
    skip_special_tokens: bool = True
    # False: token ids only, no text and no stop strings (a worker behind the router, which
    # detokenizes the stream itself; the prefill job of such a request).
    detokenize: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def validate(self, vocab_size: int | None = None) -> None:
        def bad(cond: bool, param: str, msg: str) -> None:
            if cond:
                raise InvalidParam(msg, param)

        bad(self.temperature < 0, "temperature", f"temperature must be >= 0, got {self.temperature}")
        bad(not 0 < self.top_p <= 1, "top_p", f"top_p must be in (0, 1], got {self.top_p}")
        bad(self.top_k < -1, "top_k", f"top_k must be -1, 0 (off) or positive, got {self.top_k}")
        bad(not 0 <= self.min_p <= 1, "min_p", f"min_p must be in [0, 1], got {self.min_p}")
        bad(self.max_tokens is not None and self.max_tokens < 1, "max_tokens",
            f"max_tokens must be at least 1, got {self.max_tokens}")
        bad(self.repetition_penalty <= 0, "repetition_penalty",
            f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        bad(not -2 <= self.frequency_penalty <= 2, "frequency_penalty",
            f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        bad(not -2 <= self.presence_penalty <= 2, "presence_penalty",
            f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        bad(self.logprobs is not None and not 0 <= self.logprobs <= 20, "logprobs",
            f"logprobs must be in [0, 20], got {self.logprobs}")
        bad(bool(self.stop) and not self.detokenize, "stop", "stop strings need detokenize")
        if vocab_size is not None:
            bad(any(not 0 <= t < vocab_size for t in self.stop_token_ids), "stop_token_ids",
                "stop_token_ids must be valid token ids")


def check_prompt(prompt_token_ids: list[int], params: SamplingParams, vocab_size: int,
                 max_model_len: int | None, output_token_ids: list[int] | None = None) -> None:
    """Raise InvalidParam for a request no engine of this model could run: the checks a worker and
    the router share (max_model_len None: not known yet, not checked). `output_token_ids`: tokens
    already generated (a migrated stream); they must leave room for at least one more."""
    params.validate(vocab_size)
    n = len(prompt_token_ids)
    if n == 0:
        raise InvalidParam("the prompt is empty", "prompt")
    if any(not 0 <= t < vocab_size for t in prompt_token_ids):
        raise InvalidParam("the prompt holds token ids outside the vocabulary", "prompt")
    if output_token_ids:
        if any(not 0 <= t < vocab_size for t in output_token_ids):
            raise InvalidParam("output_token_ids holds token ids outside the vocabulary", "output_token_ids")
        if params.max_tokens is not None and len(output_token_ids) >= params.max_tokens:
            raise InvalidParam("output_token_ids already holds max_tokens tokens", "output_token_ids")
        if max_model_len and n + len(output_token_ids) >= max_model_len:
            raise InvalidParam(f"prompt and output_token_ids fill the maximum context length ({max_model_len})",
                               "output_token_ids")
    max_tokens = params.max_tokens or 1
    if max_model_len and n + max_tokens > max_model_len:
        raise InvalidParam(f"this model's maximum context length is {max_model_len} tokens; the request "
                           f"asks for {n + max_tokens} ({n} in the prompt, {max_tokens} to generate)",
                           "max_tokens" if n < max_model_len else "messages")
