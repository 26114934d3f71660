"""The deployment's internal token: server.internal_token, else PDSERVE_INTERNAL_TOKEN, else none.

It guards what only the deployment's own processes may use: worker registration, the KV plane, and
the rendezvous of expert-parallel ranks on other hosts."""

from __future__ import annotations

import os


def internal_token(configured: str | None) -> str | None:
    return configured or os.environ.get("PDSERVE_INTERNAL_TOKEN") or None
