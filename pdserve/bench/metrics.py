"""Per-request records and the summary computed from them.

Everything here is a pure function of timestamps and counts, so tests feed synthetic records and
compare with hand-computed values; nothing reads a clock.

Definitions (also in docs/bench.md):
- TTFT: first streamed content after the request was sent.
- ITL: gap between consecutive content chunks, pooled over all requests. A chunk that carries
  several tokens (a detokenizer holding back half a character, say) counts as one gap.
- TPOT: per request, (e2e - ttft) / (output_tokens - 1); requests with one token have none.
- per-user tok/s: per request, 1000 / TPOT: how fast the text streams for that user once it has
  started. This is one axis of the throughput-versus-experience trade-off.
- Throughputs divide completed requests' tokens by the run's wall time.
- Goodput: completed requests meeting every SLO given, per second.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field


@dataclass
class RequestRecord:
    """What the client saw of one request. Times are seconds on one monotonic clock."""

    id: str
    tag: str = "all"
    start: float = 0.0
    end: float | None = None
    # Arrival time of every chunk that carried content, in order.
    chunk_times: list[float] = field(default_factory=list)
    # From the server's `usage` when it sent one; None when it did not.
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    error: str | None = None  # an error kind ("connect_error", "http_503", ...); None if ok
    error_detail: str = ""
    finish_reason: str | None = None
    text: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def output_tokens(self) -> int:
        # Usage is authoritative; counting chunks is the fallback for servers that send none.
        if self.completion_tokens is not None:
            return self.completion_tokens
        return len(self.chunk_times)

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def e2e(self) -> float | None:
        return None if self.end is None else self.end - self.start

    @property
    def itls(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> float | None:
        n = self.output_tokens
        if self.end is None or not self.chunk_times or n < 2:
            return None
        return (self.end - self.chunk_times[0]) / (n - 1)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["chunk_times"] = [round(t - self.start, 6) for t in self.chunk_times]
        d.pop("text")
        return d


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation between closest ranks.

    Same convention as numpy's default, written out so the tests' hand computations are plain:
    rank r = q/100 * (n-1); result = v[floor r] + (r - floor r) * (v[ceil r] - v[floor r]).
    """
    if not values:
        raise ValueError("percentile of no values")
    v = sorted(values)
    r = q / 100 * (len(v) - 1)
    lo = int(r)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (r - lo) * (v[hi] - v[lo])


def nearest_rank_p99(values: list[float]) -> float:
    """The sample at rank round(0.99 * (n-1)): the p99 the ITL benchmarks (interference, images_itl)
    report, one observed gap rather than an interpolation between two."""
    v = sorted(values)
    return v[min(len(v) - 1, int(round(0.99 * (len(v) - 1))))]


def dist(values: list[float], scale: float = 1.0) -> dict:
    """{mean, p50, p90, p99} of values times scale; zeros when there are no values, so the JSON
    keeps one shape (and `count` says whether the numbers mean anything)."""
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0, "count": 0}
    return {
        "mean": sum(values) / len(values) * scale,
        "p50": percentile(values, 50) * scale,
        "p90": percentile(values, 90) * scale,
        "p99": percentile(values, 99) * scale,
        "count": len(values),
    }


def _latency_block(ok: list[RequestRecord]) -> dict:
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    tpots = [r.tpot for r in ok if r.tpot is not None]
    e2es = [r.e2e for r in ok if r.e2e is not None]
    itls = [g for r in ok for g in r.itls]
    speeds = [1.0 / t for t in tpots if t > 0]
    return {
        "ttft_ms": dist(ttfts, 1000.0),
        "tpot_ms": dist(tpots, 1000.0),
        "itl_ms": dist(itls, 1000.0),
        "e2e_ms": dist(e2es, 1000.0),
        "per_user_tok_s": {
            "mean": sum(speeds) / len(speeds) if speeds else 0.0,
            "p50": percentile(speeds, 50) if speeds else 0.0,
        },
    }


def meets_slo(r: RequestRecord, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    """A completed request meets the SLOs given; a missing TTFT/TPOT fails the matching SLO,
    except that a one-token reply has no TPOT to miss."""
    if not r.ok:
        return False
    if slo_ttft_ms is not None and (r.ttft is None or r.ttft * 1000 > slo_ttft_ms):
        return False
    if slo_tpot_ms is not None and r.tpot is not None and r.tpot * 1000 > slo_tpot_ms:
        return False
    return True


def summarize(
    records: list[RequestRecord],
    duration_s: float,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
) -> dict:
    """The report's JSON body for one run (see the module docstring for each figure)."""
    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    inp = sum(r.prompt_tokens or 0 for r in ok)
    out = sum(r.output_tokens for r in ok)
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: 0.0)
    s: dict = {
        "completed": len(ok),
        "failed": len(failed),
        "duration_s": duration_s,
        "input_tokens": inp,
        "output_tokens": out,
        "request_throughput": per_s(len(ok)),
        "output_throughput_tok_s": per_s(out),
        "total_throughput_tok_s": per_s(inp + out),
    }
    s.update(_latency_block(ok))
    if slo_ttft_ms is not None or slo_tpot_ms is not None:
        good = sum(1 for r in ok if meets_slo(r, slo_ttft_ms, slo_tpot_ms))
        s["goodput_req_s"] = per_s(good)
        s["slo"] = {"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms, "met": good}
    s["errors"] = dict(Counter(r.error for r in failed))
    # Requests the server answered without `usage`: their token counts are chunk counts, and
    # their prompt tokens are missing from input_tokens.
    s["usage_missing"] = sum(1 for r in ok if r.completion_tokens is None)
    tags = sorted({r.tag for r in records})
    if len(tags) > 1:
        s["by_tag"] = {}
        for t in tags:
            sub = [r for r in ok if r.tag == t]
            block = {
                "completed": len(sub),
                "failed": sum(1 for r in failed if r.tag == t),
                "output_tokens": sum(r.output_tokens for r in sub),
            }
            block.update(_latency_block(sub))
            s["by_tag"][t] = block
    return s
