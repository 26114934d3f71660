"""Moved to pdserve.common.detokenizer (torch-free, shared with the router); re-exported here."""
from pdserve.common.detokenizer import IncrementalDetokenizer

__all__ = ["IncrementalDetokenizer"]
