"""What this CPU is and which vector instructions it has: benchmarks print it beside every figure,
and builds (llama.cpp's) are chosen per feature set, never per machine name."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

# The flags that change which kernels run (x86); listed in this order in a feature key.
KERNEL_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)


@lru_cache(maxsize=1)
def _cpuinfo() -> tuple[str, frozenset[str]]:
    name, flags = "unknown", set()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return name, frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and name == "unknown":
            name = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    return name, frozenset(flags)


def cpu_name() -> str:
    return _cpuinfo()[0]


def cpu_flags() -> frozenset[str]:
    return _cpuinfo()[1]


def feature_key() -> str:
    """e.g. 'avx2-fma-f16c': the kernel-relevant flags present, for caching builds per feature set."""
    present = [f for f in KERNEL_FLAGS if f in cpu_flags()]
    return "-".join(present) or "generic"


def _cpu_list(text: str) -> set[int]:
    """sysfs's CPU list ("0-3,8") as a set."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        lo, _, hi = part.partition("-")
        if lo.isdigit():
            cpus.update(range(int(lo), int(hi if hi.isdigit() else lo) + 1))
    return cpus


def _size_bytes(text: str) -> int | None:
    text = text.strip().upper()
    digits = text.rstrip("KMG")
    if not digits.isdigit():
        return None
    return int(digits) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[len(digits) :], 1)


@lru_cache(maxsize=4)
def core_cache_bytes(default: int = 1 << 20, cpu: Path = Path("/sys/devices/system/cpu/cpu0")) -> int:
    """The largest cache one core owns (sysfs: shared with no CPU outside cpu0's core), or `default`
    where the kernel does not say. A cache shared between cores is not counted: in a VM it is the host
    socket's, which other tenants fill too (a 2-core VM in docs/benchmarks.md reports a 480 MB L3)."""
    try:
        core = _cpu_list((cpu / "topology/thread_siblings_list").read_text())
    except OSError:  # no topology: the CPU alone
        core = {int(cpu.name[3:])} if cpu.name[3:].isdigit() else set()
    sizes = []
    for index in cpu.glob("cache/index*"):
        try:
            shared = _cpu_list((index / "shared_cpu_list").read_text())
            size = _size_bytes((index / "size").read_text())
        except OSError:
            continue
        if size is not None and shared and shared <= core:
            sizes.append(size)
    return max(sizes, default=default)


def describe() -> str:
    """A benchmark's CPU line: the model name and the widest vector ISA."""
    f = cpu_flags()
    isa = "AMX" if "amx_tile" in f else "AVX-512" if "avx512f" in f else "AVX2" if "avx2" in f else "no AVX2"
    return f"{cpu_name()} ({isa})"
