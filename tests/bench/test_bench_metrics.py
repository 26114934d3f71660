"""Metrics from synthetic timestamps, checked against values worked out by hand."""

import pytest

from pdserve.bench.metrics import RequestRecord, dist, meets_slo, percentile, summarize


def rec(id, start, chunks, end, prompt=None, completion=None, error=None, tag="all"):
    return RequestRecord(
        id=id,
        tag=tag,
        start=start,
        end=end,
        chunk_times=list(chunks),
        prompt_tokens=prompt,
        completion_tokens=completion,
        error=error,
    )


def test_percentile_interpolates_between_ranks():
    v = [10.0, 20.0, 30.0, 40.0]
    # rank = q/100 * 3
    assert percentile(v, 0) == 10.0
    assert percentile(v, 50) == 25.0  # rank 1.5: 20 + 0.5*10
    assert percentile(v, 90) == pytest.approx(37.0)  # rank 2.7: 30 + 0.7*10
    assert percentile(v, 99) == pytest.approx(39.7)  # rank 2.97
    assert percentile(v, 100) == 40.0
    assert percentile([5.0], 99) == 5.0
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0  # unsorted input
    with pytest.raises(ValueError):
        percentile([], 50)


def test_dist_scales_and_handles_empty():
    d = dist([0.1, 0.2, 0.3], 1000.0)
    assert d["mean"] == pytest.approx(200.0)
    assert d["p50"] == pytest.approx(200.0)
    assert d["p90"] == pytest.approx(280.0)  # rank 1.8
    assert d["count"] == 3
    assert dist([]) == {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0, "count": 0}


def test_request_record_derived_times():
    # sent at 10.0, tokens at 10.5, 10.7, 11.0, 11.1; stream ends 11.2; usage says 5 tokens
    r = rec("a", 10.0, [10.5, 10.7, 11.0, 11.1], 11.2, prompt=7, completion=5)
    assert r.ttft == pytest.approx(0.5)
    assert r.e2e == pytest.approx(1.2)
    assert r.itls == pytest.approx([0.2, 0.3, 0.1])
    # TPOT: (end - first token) / (tokens - 1) = 0.7 / 4
    assert r.tpot == pytest.approx(0.175)
    assert r.output_tokens == 5
    # Without usage the chunk count stands in for the token count.
    r2 = rec("b", 0.0, [1.0, 2.0, 4.0], 4.0)
    assert r2.output_tokens == 3
    assert r2.tpot == pytest.approx(1.5)
    # One token: no TPOT; no tokens: no TTFT.
    assert rec("c", 0.0, [1.0], 1.0, completion=1).tpot is None
    assert rec("d", 0.0, [], 1.0, completion=0).ttft is None


def test_summarize_hand_computed():
    records = [
        # A: ttft 1.0, e2e 3.0, 5 tokens -> tpot 0.5, itls 0.5,0.5,0.5,0.5
        rec("A", 0.0, [1.0, 1.5, 2.0, 2.5, 3.0], 3.0, prompt=10, completion=5),
        # B: ttft 2.0, e2e 4.0 (end 5.0), 3 tokens -> tpot 1.0, itls 1.0,1.0
        rec("B", 1.0, [3.0, 4.0, 5.0], 5.0, prompt=20, completion=3),
        # C failed: contributes nothing but its error kind
        rec("C", 0.0, [0.5], 0.6, prompt=None, completion=None, error="connection_dropped"),
        rec("D", 0.0, [], 0.1, error="connect_error"),
        rec("E", 0.0, [], 0.1, error="connect_error"),
    ]
    s = summarize(records, duration_s=5.0)
    assert s["completed"] == 2 and s["failed"] == 3
    assert s["input_tokens"] == 30
    assert s["output_tokens"] == 8
    assert s["request_throughput"] == pytest.approx(0.4)
    assert s["output_throughput_tok_s"] == pytest.approx(1.6)
    assert s["total_throughput_tok_s"] == pytest.approx(38 / 5)
    assert s["ttft_ms"]["mean"] == pytest.approx(1500.0)
    assert s["ttft_ms"]["p50"] == pytest.approx(1500.0)
    assert s["ttft_ms"]["p90"] == pytest.approx(1900.0)
    assert s["e2e_ms"]["mean"] == pytest.approx(3500.0)
    assert s["tpot_ms"]["mean"] == pytest.approx(750.0)
    assert s["tpot_ms"]["p99"] == pytest.approx(995.0)  # 500 + 0.99*500
    # ITLs pooled: [0.5]*4 + [1.0]*2 -> sorted rank for p50 = 2.5 -> 0.5; p90 rank 4.5 -> 1.0
    assert s["itl_ms"]["mean"] == pytest.approx(4000.0 / 6)
    assert s["itl_ms"]["p50"] == pytest.approx(500.0)
    assert s["itl_ms"]["p90"] == pytest.approx(1000.0)
    assert s["itl_ms"]["count"] == 6
    # per-user speeds 1/0.5 = 2 and 1/1.0 = 1
    assert s["per_user_tok_s"]["mean"] == pytest.approx(1.5)
    assert s["per_user_tok_s"]["p50"] == pytest.approx(1.5)
    assert s["errors"] == {"connection_dropped": 1, "connect_error": 2}
    assert "goodput_req_s" not in s
    assert "by_tag" not in s
    assert s["usage_missing"] == 0


def test_goodput_counts_requests_meeting_every_slo():
    records = [
        rec("fast", 0.0, [0.1, 0.2, 0.3], 0.3, prompt=1, completion=3),  # ttft 100, tpot 100
        rec("slowstart", 0.0, [0.9, 1.0], 1.0, prompt=1, completion=2),  # ttft 900, tpot 100
        rec("slowdecode", 0.0, [0.1, 0.6], 0.6, prompt=1, completion=2),  # ttft 100, tpot 500
        rec("onetoken", 0.0, [0.2], 0.2, prompt=1, completion=1),  # no tpot to miss
        rec("failed", 0.0, [], 0.1, error="http_503"),
    ]
    s = summarize(records, 2.0, slo_ttft_ms=200, slo_tpot_ms=200)
    assert s["slo"]["met"] == 2  # fast and onetoken
    assert s["goodput_req_s"] == pytest.approx(1.0)
    # Only a TTFT SLO: slowdecode passes too.
    assert summarize(records, 2.0, slo_ttft_ms=200)["slo"]["met"] == 3
    assert not meets_slo(records[4], None, None)
    assert meets_slo(records[1], None, None)


def test_by_tag_splits_classes():
    records = [
        rec("d1", 0.0, [0.1, 0.2], 0.2, prompt=4, completion=2, tag="decode"),
        rec("d2", 0.0, [0.1, 0.4], 0.4, prompt=4, completion=2, tag="decode"),
        rec("p1", 0.0, [2.0], 2.0, prompt=900, completion=1, tag="prefill"),
        rec("p2", 0.0, [], 0.1, error="timeout", tag="prefill"),
    ]
    s = summarize(records, 2.0)
    assert set(s["by_tag"]) == {"decode", "prefill"}
    d = s["by_tag"]["decode"]
    assert d["completed"] == 2 and d["failed"] == 0 and d["output_tokens"] == 4
    assert d["tpot_ms"]["mean"] == pytest.approx(200.0)  # 100 and 300
    assert s["by_tag"]["prefill"]["failed"] == 1
    assert s["by_tag"]["prefill"]["ttft_ms"]["p50"] == pytest.approx(2000.0)


def test_zero_duration_and_no_records():
    s = summarize([], 0.0)
    assert s["completed"] == 0 and s["failed"] == 0
    assert s["request_throughput"] == 0.0
    assert s["ttft_ms"]["count"] == 0


def test_to_dict_makes_times_relative():
    d = rec("x", 100.0, [100.5, 101.0], 101.0, prompt=3, completion=2).to_dict()
    assert d["chunk_times"] == [0.5, 1.0]
    assert "text" not in d
