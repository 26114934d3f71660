"""`pdserve rollout --config NEW`: replace a running deployment's workers with workers of a new
config, one at a time, canary first; roll the replaced ones back on a failed health check or an
SLO breach.

It runs where the operator runs it, as a client of the router's admin API (control/rollout_api.py):
the router owns the traffic (canary weight, drains) and its fleet the processes, and the state of a
rollout is the fleet itself (each worker's version in GET /admin/workers), so a rollout that was
interrupted is resumed by running it again, and undone by a rollout of the old config. Per worker
of an old version (decode workers first: every request reaches one, so the canary sees traffic):
1. the router's fleet starts a worker of the same role running NEW, and adds it once healthy;
2. the canary weight sends that share of new requests to the new version first (rollout_check.py
   canary_weight: rollout.canary_weight for the first worker, widening towards 1);
3. for rollout.window_s the new worker must stay healthy, and then the new version's TTFT and TPOT
   p90 and its failed share, from the router's /metrics over the window, must be within the SLOs;
4. the old worker is retired: no new work, its requests finish or move (no request is lost), stopped.
Old-version workers that join while it runs (the controller's scale-up, a crashed worker restarted
with its old config) are replaced in turn before it ends. A failure stops the rollout: the canary
weight of the new version drops to 0, each replaced worker gets its old version back (started
first, then the new one is retired the same way), the canary is cleared, and the command exits 1.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from pdserve.config import Config, ConfigError, load_config
from pdserve.control.rollout_check import Reading, Slo, Verdict, canary_weight, judge, read
from pdserve.version import config_digest, version_label

log = logging.getLogger(__name__)
_UNHEALTHY_POLLS = 3  # in a row: one slow health check under load is not a failed worker
MAX_PASSES = 4  # over the fleet's old-version workers: the ones found first, then any that joined


class AdminError(Exception):
    """The router refused or failed an admin call (`status`: its HTTP status, 0 when unreachable)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class RolloutFailed(Exception):
    """A new worker failed its health check or the SLO check: roll back."""


@dataclass(frozen=True)
class Settings:
    canary_weight: float
    window_s: float
    slo: Slo
    health_timeout_s: float
    drain_timeout_s: float | None = None  # None: the router's controller.drain_timeout_s
    poll_s: float = 0.5

    @classmethod
    def from_config(cls, cfg: Config, drain_timeout_s: float | None = None) -> Settings:
        r = cfg.rollout
        slo = Slo(
            r.slo_ttft_ms or cfg.controller.slo_ttft_ms,
            r.slo_tpot_ms or cfg.controller.slo_tpot_ms,
            r.max_error_rate,
        )
        return cls(r.canary_weight, r.window_s, slo, r.health_timeout_s, drain_timeout_s)


class Admin:
    """The router's admin API, as the rollout calls it."""

    def __init__(self, url: str, key: str | None, timeout_s: float = 900.0) -> None:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        # A connection per call: a rollout sits idle between calls for longer than the router keeps a
        # connection open (a worker's start, a drain), and a POST sent on a connection the server has
        # just closed fails with "Server disconnected" and cannot be retried safely (a start is not
        # idempotent). The calls are few.
        self.http = httpx.Client(
            base_url=url.rstrip("/"),
            headers=headers,
            timeout=timeout_s,
            limits=httpx.Limits(max_keepalive_connections=0),
        )

    def call(self, method: str, path: str, **kw) -> dict:
        try:
            r = self.http.request(method, path, **kw)
        except httpx.HTTPError as e:
            raise AdminError(f"{method} {path}: {e}") from e
        if r.status_code >= 400:
            try:
                msg = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                msg = r.text[:500]
            raise AdminError(f"{method} {path}: {r.status_code} {msg}", r.status_code)
        return r.json()

    def workers(self) -> dict[str, dict]:
        return {w["id"]: w for w in self.call("GET", "/admin/workers")["workers"]}

    def reading(self, version: str) -> Reading:
        try:
            r = self.http.get("/metrics")
        except httpx.HTTPError as e:
            raise AdminError(f"GET /metrics: {e}") from e
        return read(r.text, version)

    def start(
        self,
        role: str,
        timeout_s: float,
        config: dict | None = None,
        version: str | None = None,
        replaces: str | None = None,
    ) -> dict:
        body = {"role": role, "config": config, "version": version, "timeout_s": timeout_s}
        return self.call("POST", "/admin/workers", json={**body, "replaces": replaces})

    def retire(self, worker_id: str, drain_timeout_s: float | None) -> dict:
        return self.call(
            "POST", f"/admin/workers/{worker_id}/retire", json={"drain_timeout_s": drain_timeout_s}
        )

    def canary(self, version: str | None, weight: float = 0.0) -> dict:
        if version is None:
            return self.call("DELETE", "/admin/canary")
        return self.call("PUT", "/admin/canary", json={"version": version, "weight": weight})


@dataclass
class Step:
    old: dict  # the worker being replaced, as GET /admin/workers described it
    new: dict | None = None  # its replacement, once started
    old_retired: bool = False


@dataclass
class Outcome:
    completed: bool
    version: str
    reason: str
    replaced: int = 0
    verdicts: list[Verdict] = field(default_factory=list)


class Rollout:
    def __init__(
        self, admin: Admin, config: Config, settings: Settings, say: Callable[[str], None] = print
    ) -> None:
        self.admin, self.config, self.s, self.say = admin, config, settings, say
        self.version = version_label(config_digest(config)) or ""

    def _todo(self, seen: set[str]) -> list[dict]:
        """Workers of another version not yet replaced (`seen`: the ones replaced and their
        replacements), decode workers first."""
        todo = [
            w
            for w in self.admin.workers().values()
            if w.get("version") != self.version and w["id"] not in seen
        ]
        mixed = [w["id"] for w in todo if w["role"] not in ("prefill", "decode")]
        if mixed:
            raise AdminError(f"only prefill and decode workers are rolled out; {mixed} are not")
        return sorted(todo, key=lambda w: (w["role"] != "decode", w["id"]))

    def run(self) -> Outcome:
        seen: set[str] = set()
        todo = self._todo(seen)
        if not todo:
            return Outcome(True, self.version, f"every worker runs version {self.version} already")
        steps: list[Step] = []
        verdicts: list[Verdict] = []
        try:
            for _ in range(MAX_PASSES):
                self._replace(todo, steps, verdicts, seen)
                # Workers that joined meanwhile (the controller's scale-up, a crashed worker a
                # supervisor restarted with its old config) run an old version too: the rollout
                # ends only when none is left, or the fleet would stay mixed with no rollout to end it.
                todo = self._todo(seen)
                if not todo:
                    break
                self.say(f"{len(todo)} worker(s) of another version joined meanwhile")
            else:
                raise RolloutFailed(
                    f"workers of another version kept joining ({len(todo)} after {MAX_PASSES} passes)"
                )
            self.admin.canary(None)
        except (RolloutFailed, AdminError) as e:
            self.say(f"rollout stopped: {e}")
            self.rollback(steps)
            return Outcome(False, self.version, str(e), sum(s.old_retired for s in steps), verdicts)
        return Outcome(True, self.version, f"every worker runs version {self.version}", len(steps), verdicts)

    def _replace(self, todo: list[dict], steps: list[Step], verdicts: list[Verdict], seen: set[str]) -> None:
        """Replace each of `todo` in turn (one step each, appended to `steps`)."""
        total = len(steps) + len(todo)
        for old in todo:
            i = len(steps)
            weight = canary_weight(i, total, self.s.canary_weight)
            self.say(f"[{i + 1}/{total}] replacing {old['id']} ({old['role']}, version {old.get('version')})")
            steps.append(Step(old))
            seen.add(old["id"])
            try:
                new = self.admin.start(
                    old["role"],
                    self.s.health_timeout_s,
                    config=self.config.to_dict(),
                    replaces=old["id"],
                )
            except AdminError as e:
                if e.status != 502:  # refused (no fleet, a bad config): not the new worker's fault
                    raise
                raise RolloutFailed(f"health check: {e}") from e
            steps[-1].new = new
            seen.add(new["id"])
            new = self.known(new)
            if new.get("version") != self.version:
                raise RolloutFailed(f"the new worker runs version {new.get('version')}, not {self.version}")
            self.admin.canary(self.version, weight)
            self.say(
                f"  {new['id']} is healthy; {weight:.0%} of new requests go to {self.version} first; "
                f"watching for {self.s.window_s:g}s"
            )
            verdict = self.watch(new["id"])
            verdicts.append(verdict)
            self.say(f"  {verdict.reason}")
            if not verdict.ok:
                raise RolloutFailed(verdict.reason)
            try:
                moved = self.admin.retire(old["id"], self.s.drain_timeout_s)["moved"]
                self.say(f"  {old['id']} retired ({moved} requests moved)")
            except AdminError as e:
                if e.status != 404:
                    raise
                # Gone meanwhile (it died and the router forgot it): nothing is left to retire.
                self.say(f"  {old['id']} left the deployment by itself; nothing to retire")
            steps[-1].old_retired = True

    def known(self, new: dict, timeout_s: float = 10.0) -> dict:
        """`new` once the router has read its version (its first health check may have timed out)."""
        deadline = time.monotonic() + timeout_s
        while new.get("version") is None and time.monotonic() < deadline:
            time.sleep(self.s.poll_s)
            new = self.admin.workers().get(new["id"], new)
        return new

    def watch(self, worker_id: str) -> Verdict:
        """The new worker's health through the window, then the SLO verdict on its version."""
        before = self.admin.reading(self.version)
        end = time.monotonic() + self.s.window_s
        unhealthy = 0
        while (left := end - time.monotonic()) > 0:
            time.sleep(min(self.s.poll_s, left))
            w = self.admin.workers().get(worker_id)
            unhealthy = unhealthy + 1 if w is None or not w["healthy"] else 0
            if unhealthy >= _UNHEALTHY_POLLS:
                return Verdict(False, f"health check: {worker_id} is unhealthy")
        return judge(before, self.admin.reading(self.version), self.s.slo)

    def rollback(self, steps: list[Step]) -> None:
        """Each replaced worker's old version back (started before the new one leaves, so no pool
        empties), newest first. Keeps going past a failed step and says so."""
        self.say(f"rolling back {sum(s.new is not None for s in steps)} new worker(s)")
        try:
            self.admin.canary(self.version, 0.0)  # new requests to the old version from now on
        except AdminError as e:
            self.say(f"  could not turn the canary off: {e}")
        for step in reversed(steps):
            try:
                if step.old_retired:
                    back = self.admin.start(
                        step.old["role"],
                        self.s.health_timeout_s,
                        version=step.old["version"],
                        replaces=step.new["id"] if step.new is not None else None,  # on the old one's host
                    )
                    self.say(f"  {back['id']} runs version {back.get('version')} again")
                if step.new is not None:
                    self.admin.retire(step.new["id"], self.s.drain_timeout_s)
                    self.say(f"  {step.new['id']} retired")
            except AdminError as e:
                self.say(f"  rollback step for {step.old['id']} failed: {e}")
        try:
            self.admin.canary(None)
        except AdminError as e:
            self.say(f"  could not clear the canary: {e}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve rollout", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--config", required=True, help="the new config (YAML); its rollout: section sets the defaults below"
    )
    p.add_argument("--router", default="http://127.0.0.1:8000", help="the router's URL")
    p.add_argument(
        "--admin-key",
        default=os.environ.get("PDSERVE_ADMIN_KEY"),
        help="an admin key of the router (default: $PDSERVE_ADMIN_KEY)",
    )
    p.add_argument(
        "--canary-weight",
        type=float,
        help="share of new requests to the new version first (rollout.canary_weight)",
    )
    p.add_argument(
        "--window-s", type=float, help="health and SLO check after each new worker (rollout.window_s)"
    )
    p.add_argument(
        "--slo-ttft-ms", type=float, help="TTFT p90 the new version must keep (rollout.slo_ttft_ms)"
    )
    p.add_argument(
        "--slo-tpot-ms", type=float, help="TPOT p90 the new version must keep (rollout.slo_tpot_ms)"
    )
    p.add_argument("--max-error-rate", type=float, help="failed share allowed (rollout.max_error_rate)")
    p.add_argument(
        "--health-timeout-s",
        type=float,
        help="a new worker must be healthy within (rollout.health_timeout_s)",
    )
    p.add_argument(
        "--drain-timeout-s",
        type=float,
        help="an old worker's requests may finish this long before they move "
        "(default: the router's controller.drain_timeout_s)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    flags = {
        "rollout.canary_weight": args.canary_weight,
        "rollout.window_s": args.window_s,
        "rollout.slo_ttft_ms": args.slo_ttft_ms,
        "rollout.slo_tpot_ms": args.slo_tpot_ms,
        "rollout.max_error_rate": args.max_error_rate,
        "rollout.health_timeout_s": args.health_timeout_s,
    }
    try:
        config = load_config(args.config, flags)
    except ConfigError as e:
        for key, problem in e.problems:
            print(f"pdserve rollout: config error: {key}: {problem}", file=sys.stderr)
        return 2
    if args.drain_timeout_s is not None and args.drain_timeout_s < 0:
        print("pdserve rollout: --drain-timeout-s must be at least 0", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    rollout = Rollout(
        Admin(args.router, args.admin_key),
        config,
        Settings.from_config(config, args.drain_timeout_s),
        say=lambda line: print(f"{time.monotonic() - t0:7.1f}s  {line}", flush=True),
    )
    try:
        outcome = rollout.run()
    except AdminError as e:
        print(f"pdserve rollout: {e}", file=sys.stderr)
        return 1
    print(("rollout complete: " if outcome.completed else "rolled back: ") + outcome.reason, flush=True)
    return 0 if outcome.completed else 1
