"""Per-request sampling parameters (the vLLM/OpenAI set), validated with the offending param named."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from pdserve.common.errors import InvalidParam
from pdserve.common.structured import Constraint
from pdserve.common.structured import check as check_constraint

# Below this a temperature divides logits into float32 overflow (inf, then NaN probabilities); vLLM
# treats the same range as numerically unsafe. 0 is greedy decoding.
MIN_TEMPERATURE = 1e-2
# A repetition penalty outside this range scales logits into overflow or flattens them to nothing.
REPETITION_PENALTY_RANGE = (1e-2, 1e2)
# Stop strings are matched against every decoded token: their number and length are bounded.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_CACHE_SALT_CHARS = 256
MAX_CHOICES = 128  # n times the number of prompts of one request
# logit_bias is added to every sampled row: its size is bounded; OpenAI's range of a bias.
MAX_LOGIT_BIAS_TOKENS = 1024
LOGIT_BIAS_RANGE = (-100.0, 100.0)


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context length
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logprobs: int | None = None  # top-k logprobs per sampled token (0 = the sampled token only)
    prompt_logprobs: int | None = None  # top-k logprobs per prompt token (computed here, never cached)
    # token id -> added to its logit before sampling (penalties first, then the bias, then
    # temperature and filters); logprobs stay the model's own distribution.
    logit_bias: dict[int, float] = field(default_factory=dict)
    # An output constraint (common/structured.py: {"kind", "spec"}): every sampled token keeps the
    # output inside its grammar.
    structured: dict[str, Any] | None = None
    skip_special_tokens: bool = True
    # False: token ids only, no text and no stop strings (a worker behind the router, which
    # detokenizes the stream itself; the prefill job of such a request).
    detokenize: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        # JSON object keys are strings (the OpenAI API's, and the worker's internal API's).
        self.logit_bias = {_token_key(k): v for k, v in (self.logit_bias or {}).items()}

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

        temp = self.temperature
        bad(
            not math.isfinite(temp) or (temp != 0 and not MIN_TEMPERATURE <= temp),
            "temperature",
            f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE}, got {temp}",
        )
        bad(not 0 < self.top_p <= 1, "top_p", f"top_p must be in (0, 1], got {self.top_p}")
        bad(self.top_k < -1, "top_k", f"top_k must be -1, 0 (off) or positive, got {self.top_k}")
        bad(not 0 <= self.min_p <= 1, "min_p", f"min_p must be in [0, 1], got {self.min_p}")
        bad(
            self.max_tokens is not None and self.max_tokens < 1,
            "max_tokens",
            f"max_tokens must be at least 1, got {self.max_tokens}",
        )
        lo, hi = REPETITION_PENALTY_RANGE
        bad(
            not lo <= self.repetition_penalty <= hi,
            "repetition_penalty",
            f"repetition_penalty must be in [{lo}, {hi}], got {self.repetition_penalty}",
        )
        bad(
            not -2 <= self.frequency_penalty <= 2,
            "frequency_penalty",
            f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
        )
        bad(
            not -2 <= self.presence_penalty <= 2,
            "presence_penalty",
            f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
        )
        bad(
            self.logprobs is not None and not 0 <= self.logprobs <= 20,
            "logprobs",
            f"logprobs must be in [0, 20], got {self.logprobs}",
        )
        bad(
            self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20,
            "prompt_logprobs",
            f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}",
        )
        bad(bool(self.stop) and not self.detokenize, "stop", "stop strings need detokenize")
        bad(
            len(self.stop) > MAX_STOP_STRINGS,
            "stop",
            f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}",
        )
        bad(
            any(len(s) > MAX_STOP_CHARS for s in self.stop),
            "stop",
            f"a stop string holds at most {MAX_STOP_CHARS} characters",
        )
        bad(
            len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS,
            "stop_token_ids",
            f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(self.stop_token_ids)}",
        )
        bias = self.logit_bias
        bad(
            len(bias) > MAX_LOGIT_BIAS_TOKENS,
            "logit_bias",
            f"logit_bias holds at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(bias)}",
        )
        lo, hi = LOGIT_BIAS_RANGE
        bad(
            any(not isinstance(t, int) for t in bias),
            "logit_bias",
            "logit_bias keys must be token ids (integers)",
        )
        bad(
            any(
                isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi
                for v in bias.values()
            ),
            "logit_bias",
            f"logit_bias values must be numbers in [{lo:g}, {hi:g}]",
        )
        if self.structured is not None:
            check_constraint(Constraint.from_wire(self.structured))
        if vocab_size is not None:
            bad(
                any(not 0 <= t < vocab_size for t in self.stop_token_ids),
                "stop_token_ids",
                "stop_token_ids must be valid token ids",
            )
            bad(
                any(isinstance(t, int) and not 0 <= t < vocab_size for t in bias),
                "logit_bias",
                "logit_bias keys must be valid token ids",
            )


def _token_key(k: Any) -> Any:
    """A logit_bias key as a token id; what is not one stays as it is, for validate() to name."""
    if isinstance(k, str) and k.strip().lstrip("-").isdigit():
        return int(k)
    return k


def check_cache_salt(salt: str | None) -> None:
    """The salt is hashed into the request's block hashes: its length is bounded."""
    if salt is not None and len(salt) > MAX_CACHE_SALT_CHARS:
        raise InvalidParam(
            f"cache_salt holds at most {MAX_CACHE_SALT_CHARS} characters, got {len(salt)}", "cache_salt"
        )


def check_choices(n: int, num_prompts: int) -> None:
    """n choices of each prompt: each is a request of its own, so the total is bounded."""
    if n < 1 or n > 16:
        raise InvalidParam("n must be between 1 and 16", "n")
    if n * num_prompts > MAX_CHOICES:
        raise InvalidParam(
            f"n times the number of prompts is {n * num_prompts}; at most {MAX_CHOICES} choices per request",
            "n" if num_prompts == 1 else "prompt",
        )


def check_prompt(
    prompt_token_ids: list[int],
    params: SamplingParams,
    vocab_size: int,
    max_model_len: int | None,
    output_token_ids: list[int] | None = None,
) -> None:
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
            raise InvalidParam(
                f"prompt and output_token_ids fill the maximum context length ({max_model_len})",
                "output_token_ids",
            )
    max_tokens = params.max_tokens or 1
    if max_model_len and n + max_tokens > max_model_len:
        raise InvalidParam(
            f"this model's maximum context length is {max_model_len} tokens; the request "
            f"asks for {n + max_tokens} ({n} in the prompt, {max_tokens} to generate)",
            "max_tokens" if n < max_model_len else "messages",
        )
