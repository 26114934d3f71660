"""A running process's environment as the kernel holds it (/proc/<pid>/environ)."""

from __future__ import annotations

from pathlib import Path


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(kv.decode(errors="replace").partition("=")[::2] for kv in raw if b"=" in kv)
