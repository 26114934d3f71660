"""Moved to pdserve.common.sampling (torch-free, shared with the router); re-exported here."""
from pdserve.common.errors import InvalidParam
from pdserve.common.sampling import SamplingParams, check_prompt

__all__ = ["InvalidParam", "SamplingParams", "check_prompt"]
