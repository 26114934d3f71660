"""Control-plane messages: role switches (router admin API -> router -> worker), the controller's
decisions (`GET /admin/controller`), and a rollout's canary and worker starts (control/rollout_api.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

SwitchableRole = Literal["prefill", "decode"]


class RoleChange(BaseModel):
    """Body of `POST /admin/workers/{id}/role` at the router and `POST /internal/role` at a worker."""

    model_config = ConfigDict(extra="forbid")
    role: SwitchableRole
    # How long running requests may take to finish before they are moved to other workers
    # (None: the router's controller.drain_timeout_s).
    drain_timeout_s: float | None = Field(default=None, ge=0)


class LeaveRequest(BaseModel):
    """Body of `POST /internal/leave`: the worker empties itself before a scale-down stops it."""

    model_config = ConfigDict(extra="forbid")
    drain_timeout_s: float | None = Field(default=None, ge=0)


class ShedRequest(BaseModel):
    """Body of `POST /internal/shed`: the worker gives up `count` of its generating streams, for
    the router to continue on less loaded workers (the controller evens the decode pool out)."""

    model_config = ConfigDict(extra="forbid")
    count: int = Field(ge=1)


class RoleChanged(BaseModel):
    """A worker's answer to `POST /internal/role`: its role and KV endpoint now."""

    role: str
    kv_endpoint: str | None = None
    moved: int = 0  # requests given up to be continued on other workers
    switches_total: int = 0


class ControllerDecision(BaseModel):
    """One entry of `GET /admin/controller`: what the controller did, to which worker, and why."""

    time: float  # unix seconds
    action: str  # switch_to_prefill | switch_to_decode | add_prefill | add_decode | remove |
    # rebalance | hold
    worker: str | None = None
    reason: str
    inputs: dict[str, float] = Field(default_factory=dict)
    ok: bool = True  # False: the action was tried and failed (error in `reason`)


class CanarySetting(BaseModel):
    """Body of `PUT /admin/canary`: this share of new requests goes to workers of `version` first."""

    model_config = ConfigDict(extra="forbid")
    version: str = Field(min_length=1)
    weight: float = Field(ge=0, le=1)


class StartWorker(BaseModel):
    """Body of `POST /admin/workers`: start one worker of `role` running `config` (a config as
    `Config.to_dict()` writes it) or a version this router's fleet ran before (a rollback)."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["prefill", "decode"]
    config: dict | None = None
    version: str | None = None
    timeout_s: float | None = Field(default=None, gt=0)  # to become healthy (None: rollout.health_timeout_s)
    # The worker it replaces: a fleet of several hosts starts the new one on that worker's host.
    replaces: str | None = None


class HostStart(BaseModel):
    """Body of `POST /agent/workers` at a host agent (control/host_agent.py): start one worker of
    `role` on the agent's host running `config` (as `Config.to_dict()` writes it). Ports left unset
    are picked free by the worker; a host's first worker may be given fixed ones."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["prefill", "decode"]
    config: dict
    port: int | None = Field(default=None, ge=1, le=65535)
    kv_port: int | None = Field(default=None, ge=1, le=65535)
    kv_events_port: int | None = Field(default=None, ge=1, le=65535)
    # An idempotency key: a start sent again with a key the agent has seen (its reply was lost)
    # answers with the worker that start made, and makes no other.
    request_id: str | None = Field(default=None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")


class HostWorker(BaseModel):
    """One worker a host agent started, as `GET /agent/workers` lists it."""

    id: str
    role: str
    pid: int
    url: str | None = None  # None until the worker has bound its port
    alive: bool
    healthy: bool = False
    exit_code: int | None = None
    log_tail: str = ""  # the end of its log once it has exited
    request_id: str | None = None  # the key of the start that made it (HostStart.request_id)
