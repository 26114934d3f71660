"""The tokenizer pool: chat templating and tokenization in worker processes (the design's encoder balancer).

Templating and tokenizing a long prompt takes milliseconds of CPU that would otherwise stall the
router's event loop. Each pool process loads the tokenizer once. The router keeps a tokenizer of
its own too, for incremental detokenization of the streams.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
from concurrent.futures import ProcessPoolExecutor
from typing import Any

# Torch-free: each pool process loads only the tokenizer (tests/test_import_contracts.py).
from pdserve.common.tokenizer import TokenizerWrapper, load_tokenizer

_tokenizer: TokenizerWrapper | None = None  # one per pool process


def _init(model: str) -> None:
    global _tokenizer
    from pdserve.utils.process import die_with_parent

    die_with_parent()  # never outlive the router
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the router's to handle
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _tokenizer = load_tokenizer(model)


def _pool_tokenizer() -> TokenizerWrapper:
    if _tokenizer is None:
        raise RuntimeError("tokenizer pool function called outside an initialised pool process")
    return _tokenizer


def _encode(text: str, add_special_tokens: bool = True) -> list[int]:
    return _pool_tokenizer().encode(text, add_special_tokens)


def _encode_chat(
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    add_special_tokens: bool = False,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    return _pool_tokenizer().encode_chat(messages, add_generation_prompt, add_special_tokens, template_kwargs)


class TokenizerPool:
    def __init__(self, model: str, processes: int) -> None:
        self.processes = processes
        # Spawned, not forked: a fork of the router would inherit its threads and signal handlers.
        self.pool = (
            ProcessPoolExecutor(
                processes,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_init,
                initargs=(model,),
            )
            if processes > 0
            else None
        )
        self.local = load_tokenizer(model) if processes <= 0 else None

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.local is not None:  # processes <= 0: no pool, encode here
            return self.local.encode(text, add_special_tokens)
        return await asyncio.get_running_loop().run_in_executor(self.pool, _encode, text, add_special_tokens)

    async def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Raises ValueError for messages the chat template rejects."""
        if self.local is not None:
            return self.local.encode_chat(
                messages, add_generation_prompt, add_special_tokens, template_kwargs
            )
        return await asyncio.get_running_loop().run_in_executor(
            self.pool, _encode_chat, messages, add_generation_prompt, add_special_tokens, template_kwargs
        )

    async def warm_up(self) -> None:
        """Start the pool's processes and load their tokenizers now, not on the first request."""
        await self.encode("warm up")

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
