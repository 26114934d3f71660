"""The rate limiter's table of buckets stays bounded: refilled buckets are dropped, the table never
holds more than its bound, and an admission looks at a constant number of buckets. The clock is the
`now` each call takes; nothing sleeps."""

from __future__ import annotations

from pdserve.router import rate_limit
from pdserve.router.rate_limit import RateLimiter


def test_buckets_that_refilled_are_dropped():
    rl = RateLimiter(rpm=60, tpm=1000)
    for i in range(500):  # one request from each of 500 addresses
        assert rl.admit(f"10.0.{i // 256}.{i % 256}", 0.0) == 0
    rl.charge_tokens("10.0.0.1", 100, 0.0)
    assert len(rl.requests) == 500  # each took a request: none is full
    assert "10.0.0.1" in rl.tokens and len(rl.tokens) <= 5  # untouched token buckets are full: dropped
    # A minute on, every bucket has refilled: each is the same as no bucket. Ordinary traffic from one
    # client drains them, a few per admission.
    for i in range(200):
        assert rl.admit("client", 61.0 + i) == 0
    assert len(rl.requests) == 1 and len(rl.tokens) == 1
    assert "client" in rl.requests


def test_a_bucket_still_refilling_is_kept_and_still_limits():
    rl = RateLimiter(rpm=2, tpm=None)
    assert rl.admit("busy", 0.0) == 0 and rl.admit("busy", 0.0) == 0
    for i in range(100):
        rl.admit(f"idle-{i}", 0.0)
    for i in range(10):
        rl.admit(f"late-{i}", 20.0)  # the sweep reaches "busy", not yet full: it stays
    assert "busy" in rl.requests
    assert 9.9 < rl.admit("busy", 20.0) < 10.1  # 2/min: one more at 30 s


def test_the_table_is_bounded_by_default():
    rl = RateLimiter(rpm=60, tpm=None)
    for i in range(rate_limit.MAX_KEYS + 50):  # all at once: none has refilled, none can be dropped as full
        rl.admit(f"k{i}", 0.0)
    assert len(rl.requests) == rate_limit.MAX_KEYS


def test_a_full_table_pushes_out_the_least_recently_used():
    rl = RateLimiter(rpm=3, tpm=None, max_keys=10)
    for _ in range(3):
        assert rl.admit("regular", 0.0) == 0
    for i in range(100):
        rl.admit(f"scan-{i}", 1.0)
        if i % 5 == 0:
            assert rl.admit("regular", 1.0) > 0  # used recently: kept, and still out of requests
    assert len(rl.requests) == 10 and "regular" in rl.requests
    assert "scan-0" not in rl.requests and "scan-99" in rl.requests


def test_an_admission_looks_at_a_constant_number_of_buckets(monkeypatch):
    rl = RateLimiter(rpm=60, tpm=60)
    for i in range(5000):  # none full: a scan of the table would look at all of them
        rl.admit(f"k{i}", 0.0)
    seen = {"n": 0}
    refill, full_at = rate_limit.Bucket.refill, rate_limit.Bucket.full_at

    def counting_refill(self, now):
        seen["n"] += 1
        return refill(self, now)

    def counting_full_at(self, now):
        seen["n"] += 1
        return full_at(self, now)

    monkeypatch.setattr(rate_limit.Bucket, "refill", counting_refill)
    monkeypatch.setattr(rate_limit.Bucket, "full_at", counting_full_at)
    for i in range(100):
        rl.admit(f"new-{i}", 1.0)
        rl.charge_tokens(f"new-{i}", 5, 1.0)
    assert seen["n"] <= 100 * 3 * (rate_limit._SWEEP + 1)
