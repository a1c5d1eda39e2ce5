"""Status and control messages: rollout workers, the old-logit service, the EWMA, the gateway, the
job's ``/v1/status``, and scale requests (torch-free)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field

from protocol.messages import FINGERPRINT_PATTERN, Message, OldLogitRoute

# --------------------------------------------------------------------------------------------
# status and control (actors and HTTP)
# --------------------------------------------------------------------------------------------


class WorkerStatus(Message):
    worker_id: str
    policy_version: int = Field(ge=0)
    in_flight: int = Field(ge=0)
    generated_trajectories: int = Field(0, ge=0)
    generated_tokens: int = Field(0, ge=0)
    tokens_per_s: float = Field(0.0, ge=0.0)
    errors: int = Field(0, ge=0)
    state: Literal["starting", "running", "paused", "stopping", "failed"] = "running"
    last_error: str = ""
    served_fingerprint: str | None = Field(None, pattern=FINGERPRINT_PATTERN)
    """Fingerprint of the weights the engine serves now, read back after the last update (None: not known)."""
    rss_bytes: int = Field(0, ge=0)
    """Resident memory of the worker's process and the processes it started (its engine's), bytes."""
    resumed_prefill_tokens: int = Field(0, ge=0)
    """Tokens prefilled again when requests interrupted by weight updates resumed (0 when the engine
    keeps its requests across updates, ``rollout.keep_requests_on_update``)."""


class OldLogitServiceStatus(Message):
    route: OldLogitRoute
    versions_held: list[int] = Field(default_factory=list)
    bytes_held: int = Field(0, ge=0)
    tokens_exact: int = Field(0, ge=0)
    tokens_missing: dict[str, int] = Field(default_factory=dict)
    """Missing tokens by :class:`TokenStatus` name."""
    seconds_total: float = Field(0.0, ge=0.0)
    requests: int = Field(0, ge=0)
    started_unix: float | None = None
    """When this service was constructed (Unix seconds); a restarted service process has a new one."""
    rss_bytes: int = Field(0, ge=0)
    """Resident memory of the service's process and the processes it started, bytes."""


class EwmaStatus(Message):
    beta: float = Field(ge=0.0, lt=1.0)
    total_weight: float = Field(ge=0.0)
    resets: int = Field(0, ge=0)
    bytes_held: int = Field(0, ge=0)


class GatewayStatus(Message):
    """``GET /v1/status`` of the OpenAI-compatible gateway: sessions, calls and their accounting.

    Accounting identity: ``sessions_opened == sessions_open + sessions_ended`` and
    ``sessions_ended == sessions_emitted + sum(sessions_dropped.values())``.
    """

    policy_version: int = Field(0, ge=0)
    sessions_opened: int = Field(0, ge=0)
    sessions_open: int = Field(0, ge=0)
    sessions_ended: int = Field(0, ge=0)
    sessions_emitted: int = Field(0, ge=0)
    """Ended sessions turned into trajectories (training sessions) or scored (evaluation sessions);
    a training session's may still wait for its group (``sessions_waiting_for_group``)."""
    sessions_dropped: dict[str, int] = Field(default_factory=dict)
    """Ended sessions that gave no trajectory, by reason (``no_calls``, ``agent_error``, ...)."""
    sessions_refused: int = Field(0, ge=0)
    """New sessions refused by the staleness admission rule (HTTP 429)."""
    trajectories_emitted: int = Field(0, ge=0)
    calls: int = Field(0, ge=0)
    untracked_calls: int = Field(0, ge=0)
    """Calls made with the admin key outside any session (served, never trained on)."""
    tokens_sampled: int = Field(0, ge=0)
    splits: int = Field(0, ge=0)
    """Calls whose rendered prompt did not extend the session's previous ids (a new segment began)."""
    tool_calls_parsed: int = Field(0, ge=0)
    """``<tool_call>`` blocks in replies that parsed into a call (returned as ``tool_calls``, unless
    their reply also held one that did not parse and was answered with an error note)."""
    unparsed_tool_calls: int = Field(0, ge=0)
    """``<tool_call>`` blocks (or unclosed opening tags) in replies that did not parse."""
    tool_call_errors: int = Field(0, ge=0)
    """Replies answered with a tool-call error note (``gateway.tool_call_feedback``)."""
    truncated_sessions: int = Field(0, ge=0)
    """Sessions cut by ``max_session_tokens``."""
    errors: dict[str, int] = Field(default_factory=dict)
    """Refused requests by HTTP status code, each counted once."""
    unavailable: dict[str, int] = Field(default_factory=dict)
    """Calls answered 503, by reason: ``not_taken`` (no worker took the call within
    ``gateway.submit_timeout_s``), ``timeout`` (no result within ``gateway.call_timeout_s``),
    ``worker_lost`` (the worker holding the call was lost, and each resubmission's too),
    ``submit_failed``, ``poll_failed``, ``aborted`` (the worker aborted the generation)."""
    calls_pending: int = Field(0, ge=0)
    """Calls waiting now for a worker to take them or for their result."""
    sessions_waiting_for_group: int = Field(0, ge=0)
    """Ended training sessions held until their GRPO group fills or waits ``gateway.group_wait_s``."""
    groups_partial: int = Field(0, ge=0)
    """Groups handed to training short of ``rollout.sampling.n`` sessions, each trajectory with a baseline
    (:mod:`rollout.gateway.groups`); a session opened without a ``group_id`` is one such group."""
    sessions_in_partial_groups: int = Field(0, ge=0)
    """Sessions handed over in those groups."""
    resubmissions: int = Field(0, ge=0)
    """Submissions repeated because no worker took the call (every worker late, or none running)."""
    lost_resubmissions: int = Field(0, ge=0)
    """Calls submitted again because the rollout worker holding them died, hung or was removed."""
    late_results_discarded: int = Field(0, ge=0)
    """Results that arrived after their call had been answered 503; never trained on."""
    abandoned_calls: int = Field(0, ge=0)
    """Calls whose client disconnected before its reply was ready: sampled, never recorded in the
    session (the agent never saw the reply), never trained on."""
    overhead_ms_mean: float = Field(0.0, ge=0.0)
    """Mean time per served call spent in the gateway's own work (render, stitch, respond), from
    the session's turn to the answer, generation excluded, ms."""
    turn_wait_ms_mean: float = Field(0.0, ge=0.0)
    """Mean time per served call spent waiting for the session's earlier calls to finish (calls of
    one session are served one at a time, in order), ms."""


class JobStatus(Message):
    """``GET /v1/status``: the learner's version and everything about staleness and references."""

    learner_version: int = Field(ge=0)
    run_segment: int = Field(0, ge=0)
    """0 for a fresh run, +1 at every resume: (run_segment, learner_version) names one set of weights."""
    state: Literal["starting", "evaluating", "running", "paused", "finished", "failed"] = "running"
    """``starting`` until the parts are up, ``evaluating`` during a held-out evaluation (before and
    after training), ``running`` while the loop trains, ``paused`` while it holds at a pause request,
    then ``finished`` or ``failed``."""
    workers: list[WorkerStatus] = Field(default_factory=list)
    buffer_size: int = Field(0, ge=0)
    buffer_staleness_hist: dict[int, int] = Field(default_factory=dict)
    last_batch_staleness_hist: dict[int, int] = Field(default_factory=dict)
    oldlogit_route: OldLogitRoute = "none"
    """The job's old-logit route (``loss.oldlogit_route``)."""
    exact_token_fraction: float | None = Field(None, ge=0.0, le=1.0)
    """Share of the last batch's trained tokens whose pi_old was exact (None before the first step)."""
    proxy_fraction: float = Field(0.0, ge=0.0, le=1.0)
    ewma: EwmaStatus | None = None
    mask_kept_fraction: float | None = Field(None, ge=0.0, le=1.0)
    entropy: float | None = Field(None, ge=0.0)
    """Mean policy entropy (nats) over the last batch's trained tokens: a fall towards 0 comes
    before a collapse (None before the first step)."""
    kl_ref: float | None = Field(None, ge=0.0)
    """Mean KL (nats, k3 estimate) of the policy to the frozen reference over the last batch's
    trained tokens; None without a KL penalty (``loss.kl_coef = 0``)."""
    zero_variance_share: float | None = Field(None, ge=0.0, le=1.0)
    """Share of the last batch's groups whose rewards were all equal (no gradient)."""
    tokens_per_s: float = Field(0.0, ge=0.0)
    last_publish_s: float | None = None
    last_publish_unix: float | None = None
    generated: int = Field(0, ge=0)
    """Trajectories submitted so far; ``generated = consumed + sum(dropped) + buffer_size + held + in_flight``."""
    consumed: int = Field(0, ge=0)
    in_flight: int = Field(0, ge=0)
    held: int = Field(0, ge=0)
    """Trajectories out of the buffer for a step that has not started (the batch taken ahead)."""
    dropped: dict[str, Annotated[int, Field(ge=0)]] = Field(default_factory=dict)
    """Dropped trajectories by reason (``stale``, ``buffer_full``, ``aborted``, ``filtered``, ...)."""
    filtered_groups: int = Field(0, ge=0)
    """Groups dropped by dynamic sampling (``controller.dynamic_sampling``) because their rewards were
    all equal; their trajectories count in ``dropped["filtered"]``."""
    zero_variance_admitted: int = Field(0, ge=0)
    """Groups of equal rewards kept for training because ``controller.max_filtered_groups_per_step``
    was reached at their version."""
    skipped_steps: int = Field(0, ge=0)
    fingerprint_mismatch: int = Field(0, ge=0)
    """Consumers found serving other weights than the version published to them (each restarted)."""
    fingerprint_unverified: int = Field(0, ge=0)
    """Consumer reports after a publication whose served fingerprint could not be judged (the engine
    could not read its weights back, or the expected value was unknown); such a rollout worker is
    restarted as a mismatch only with ``rollout.unverified_fingerprint = "mismatch"``."""
    scale_pending: int | None = Field(None, ge=0)
    """A scale request recorded but not applied yet (the latest one wins)."""
    scale_note: str = ""
    """Outcome of the last applied scale request (workers added, removed, or what could not be placed)."""
    oldlogit: OldLogitServiceStatus | None = None
    gateway: GatewayStatus | None = None
    """The OpenAI-compatible gateway's sessions and calls, when the job runs agents through it."""
    held_out: float | None = None
    """Mean reward of the latest held-out evaluation (None before the first)."""
    held_out_success: float | None = Field(None, ge=0.0, le=1.0)
    """Its share of episodes with reward > 0.5."""
    held_out_version: int | None = Field(None, ge=0)
    """The policy version that evaluation was pinned to."""
    eval_resubmitted: int = Field(0, ge=0)
    """Held-out evaluation requests submitted again because the rollout worker holding them was lost
    (died, hung, removed, restarted for a fingerprint mismatch), summed over the run's finished
    evaluations (one still running adds its count when it finishes); never counted in ``dropped``."""
    best_version: int | None = Field(None, ge=0)
    """The version of the best pinned held-out evaluation so far, whose checkpoint is kept
    (``controller.keep_best``; ties: the earlier version); None before the first."""
    best_held_out: float | None = None
    """Its mean held-out reward."""


class ScaleRequest(Message):
    """``POST /v1/workers``: the wanted number of rollout workers.

    Decoded strictly (it arrives from outside as JSON): ``"3"``, ``true`` and ``4.0`` are refused,
    not coerced to integers.
    """

    model_config = ConfigDict(strict=True)

    num_workers: int = Field(ge=0, le=256)


class ScaleResponse(Message):
    """``POST /v1/workers`` answer: the request is recorded; the driver applies the latest one
    between two steps, and ``/v1/status`` shows it as ``scale_pending`` until then and the outcome
    in ``scale_note`` after."""

    num_workers: int = Field(ge=0)
    state: Literal["pending", "applied"] = "pending"
    added: list[str] = Field(default_factory=list)
    removed: list[str] = Field(default_factory=list)
