"""The driver: one async RL job, top to bottom.

    start the Ray session and the HTTP status server (:mod:`trainer.driver.cluster.session`)
    start the parts (:func:`trainer.driver.loop.assembly.start_job`): the learner, the old-logit service,
    the rollout workers (every consumer starts from the model folder, version 0), the trajectory
    source; score held-out episodes (reward before)
    loop until total_steps (``_loop``, one line per part):
        controls      apply control requests (scale workers, pause); workers started in the
                      background join, dead or hung ones are replaced
        admit         ``Job.top_up``: the trajectory source submits work under the staleness
                      admission rule (here only when no batch was taken ahead; otherwise after
                      the launch below)
        collect       ``Job.collect``: the source's finished trajectories into the buffer (scorer
                      routes attach exact pi_old here, before their version is superseded)
        take          ``Job.take``: a batch at the learner's version (stale ones dropped, with a
                      reason) and a reference to the snapshot route's per-token answer for it -
                      unless the batch taken ahead during the previous step still stands
                      (``Job.confirm_ahead``: what finished since is collected; a batch that lost
                      a trajectory or passes over a group on its last chance is taken again)
        train         ``Job.async_train``: waits for the batch's old logits, then launches one
                      learner step (exact where known, the configured proxy elsewhere)
        admit         ``Job.top_up`` again: the room the new version opened is submitted while
                      the learner trains, not between its steps
        take ahead    ``Job.take_ahead``: while the learner trains on batch k at version V, batch
                      k+1 is taken for version V+1 and the snapshot route scores it (its tokens
                      are all at versions <= V, which the service holds)
        wait          ``Job.finish_train``: the step's metrics; the version moves up by one when
                      the step is applied
        publish       ``Job.evals.finish`` (a held-out evaluation pinned to the outgoing version ends
                      before the version is replaced), ``Job.await_old_logits`` (the service answers
                      the next batch before it takes the new version: one call at a time),
                      ``route.before_publish`` (scorer routes collect first), then ``Job.publisher.publish``
        log           ``step_report`` -> ``metrics.jsonl``, the trackers, ``/v1/status``, the step
                      line (:mod:`trainer.driver.loop.report`); a few of the batch's trajectories ->
                      ``samples.jsonl`` (:mod:`trainer.driver.records.samples`)
        checkpoint    every ``controller.checkpoint_every`` versions: the learner's state and every
                      finished trajectory not yet consumed (``Job.checkpoint``)
        evaluate      every ``controller.eval_every`` versions: ``Job.evals.start`` sends the held-out
                      requests at the version just published and returns; the learner trains the
                      next step while they run (:mod:`trainer.driver.records.heldout`)
    score held-out episodes (reward after), write summary, plots, checkpoint

What varies between runs is an object chosen once at assembly: the old-logit route
(:mod:`trainer.driver.publication.routes`) and the trajectory source (:mod:`trainer.driver.sources.source`); the loop
never asks which kind it holds. The parts and the operations of one iteration are
:class:`trainer.driver.loop.parts.Job`.

Invariants: the learner's version rises by exactly one per applied step and is published whole to
every consumer before the next version is published (consumers apply it in the background; the
old-logit service runs its calls in order, so it takes V+1 before it scores anything sent after);
a batch holding a token of version V+1 is scored only after the service took V+1 (a batch taken
ahead is taken before V+1 exists); every submitted sample is consumed, dropped with a reason,
buffered, held in a batch taken ahead (returned to the buffer when the loop stops) or in flight
(``TrajectoryBuffer.accounting_ok``).

Time split (``summary["time_split_s"]``, wall seconds of the driver): ``train`` from launching a
step to its metrics; ``old_logits`` only the waits for an answer (and scorer-route attaching
between steps); ``old_logits_overlapped`` the service's scoring seconds hidden behind a learner
step, plus scorer-route attaching while the learner trained; ``publish``; ``eval`` the driver's
waits for held-out evaluations (before and after training their whole length; during training the
waits, which extend the time budget's deadline); ``eval_overlapped`` evaluation seconds that ran
beside training.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

from trainer.driver.cluster.environment import defaults_env
from trainer.driver.cluster.memory import KilledForMemory, killed_for_memory, oom_kill_count, total_memory_bytes
from trainer.driver.cluster.server import StatusBoard
from trainer.driver.cluster.session import StopSignal, ray_session, start_status_server
from trainer.driver.config.schema import JobConfig, one_line, write_resolved
from trainer.driver.loop.assembly import start_job
from trainer.driver.loop.parts import Job, TakenBatch
from trainer.driver.loop.report import failed_part, run_summary, status_fields, step_line, step_report
from trainer.driver.records.heldout import eval_due, eval_record
from trainer.driver.records.metrics_log import MetricsLog, plot_run
from trainer.driver.records.samples import SamplesLog
from trainer.driver.records.trackers import start_trackers
from trainer.learner.checkpoint import latest_tag

__all__ = ["end_reason", "evaluate_reported", "held_by_pause", "run_job", "run_with_restarts"]


def run_with_restarts(cfg: JobConfig, console: Console | None = None) -> dict[str, Any]:
    """:func:`run_job`, started again after a failure of the learner (a dead learner process, or one
    the kernel killed for memory) from the run's latest complete checkpoint
    (``<run_dir>/checkpoints``, ``controller.resume_from``), at most
    ``controller.max_learner_restarts`` times. Returns the summary of the run that finished, with
    ``learner_restarts`` (also in ``summary.json``).

    Raises:
        Exception: what :func:`run_job` raised, when another part failed, the learner failed to
            start (``summary.json`` says ``failed: start-up``: the same start would fail again),
            the restarts are used up, or this run wrote no checkpoint before the failure (a
            checkpoint an earlier run left in the folder is not one to restart from).
    """
    console = console or Console(soft_wrap=True)
    run_dir = Path(cfg.logging.run_dir)
    ckpt, restarts = run_dir / "checkpoints", 0
    own = cfg.controller.resume_from is not None and Path(cfg.controller.resume_from).resolve() == ckpt.resolve()
    found = None if own else _resume_point(ckpt)  # an earlier run's checkpoint there is not this run's
    while True:
        try:
            summary = run_job(cfg, console)
        except Exception as e:
            if failed_part(e) != "learner" or restarts >= cfg.controller.max_learner_restarts:
                raise
            if _failed_at_start(run_dir):
                raise
            if latest_tag(ckpt) is None or (restarts == 0 and _resume_point(ckpt) == found):
                console.print("[red]learner failed before the run's first checkpoint: nothing to restart from[/red]")
                raise
            restarts += 1
            console.print(
                f"[yellow]learner failed ({one_line(e)}): restart {restarts} of "
                f"{cfg.controller.max_learner_restarts}, from {ckpt} ({latest_tag(ckpt)})[/yellow]",
                soft_wrap=True,
            )
            controller = cfg.controller.model_copy(update={"resume_from": str(ckpt)})
            cfg = cfg.model_copy(update={"controller": controller})
        else:
            summary["learner_restarts"] = restarts
            path = Path(cfg.logging.run_dir) / "summary.json"
            path.write_text(json.dumps({**json.loads(path.read_text()), "learner_restarts": restarts}, indent=2))
            return summary


def _resume_point(ckpt: Path) -> tuple[str, int, int] | None:
    """The resume point of a checkpoints folder, as ``(tag, inode, mtime in ns)`` of its pointer
    file; None without one. A save rewrites the pointer (a new file), even for the same version."""
    from trainer.learner.checkpoint import LATEST_FILE

    tag = latest_tag(ckpt)
    if tag is None:
        return None
    st = (ckpt / LATEST_FILE).stat()
    return tag, st.st_ino, st.st_mtime_ns


def _failed_at_start(run_dir: Path) -> bool:
    """Whether the run's ``summary.json`` says it failed before its loop began (``failed: start-up``)."""
    path = run_dir / "summary.json"
    return path.is_file() and str(json.loads(path.read_text()).get("end_reason", "")).startswith("failed: start-up")


def run_job(cfg: JobConfig, console: Console | None = None) -> dict[str, Any]:
    """Run one job to ``controller.total_steps`` (or the time budget); returns the summary dict.

    The summary is also written to ``<run_dir>/summary.json``; metrics go to ``metrics.jsonl`` (and
    the trackers of ``logging.trackers``), a few trained trajectories per step to
    ``samples.jsonl``, plots to ``reward.png`` / ``staleness.png``.

    Raises:
        ImportError: a tracker of ``logging.trackers`` whose package is not installed.
    """
    console = console or Console(soft_wrap=True)  # one line per step at any width
    defaults_env()
    run_dir = Path(cfg.logging.run_dir)
    write_resolved(cfg, run_dir)
    t_start = time.perf_counter()
    board = StatusBoard()
    server = start_status_server(cfg, board, console)  # None without [server]
    log = MetricsLog(run_dir, start_trackers(cfg.logging, cfg.model_dump(mode="json")))
    summary: dict[str, Any] = {"state": "failed", "end_reason": "failed: start-up"}
    stop = StopSignal()
    kills_before = oom_kill_count()  # a rise when a part dies says the kernel killed it for memory
    try:
        with ray_session(cfg), stop.installed():  # after ray.init: Ray installs its own SIGTERM handler
            job = start_job(cfg, console)
            board.follow_gateway(job.source.status)  # the gateway's figures from now on (None without one)
            try:
                samples = SamplesLog(run_dir, cfg.logging.samples_per_step, cfg.logging.max_samples, job.model_path)
                summary = _loop(job, board, log, samples, t_start, stop)
            except Exception as e:
                part = failed_part(e)
                held = job.learner_rss_bytes if part == "learner" else None
                note = killed_for_memory(part, kills_before, oom_kill_count(), held, total_memory_bytes())
                reason = f"failed: {part}" + (" (out of memory)" if note else "")
                summary = {"state": "failed", "end_reason": reason, "error": note or one_line(e)}
                if note:
                    raise KilledForMemory(note) from e
                raise
            finally:
                board.follow_gateway(None)  # its last figures stay served once it stops
                board.update(state=summary["state"])
                job.shutdown()
    except Exception as e:
        if summary["end_reason"] == "failed: start-up":  # the part that could not start
            summary["end_reason"] = f"failed: start-up: {failed_part(e)}"
        summary.setdefault("error", one_line(e))
        raise
    finally:
        log.close()
        if server is not None:
            server.stop()
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    if cfg.logging.plots:
        summary["plots"] = [str(p) for p in plot_run(run_dir)]
    console.print_json(json.dumps(summary, default=str))
    return summary


def _loop(
    job: Job, board: StatusBoard, log: MetricsLog, samples: SamplesLog, t_start: float, stop: StopSignal
) -> dict[str, Any]:
    """The recipe: each line of the iteration is one part's job (see the module docstring)."""
    cfg, console = job.cfg, job.console
    if job.version > 0:  # resumed: consumers loaded the folder (version 0); give them the resumed weights
        job.publisher.publish()
    before = evaluate_reported(job, board, lambda: job.evals.evaluate("before"))
    log_eval(log, board, before)
    console.print(f"held-out reward before training: {before}")
    board.update(state="running", **status_fields(job, job.oldlogit_status()))
    t_loop = time.perf_counter()  # the time budget is the loop's: start-up and evaluations come on top
    deadline = t_loop + cfg.controller.time_budget_s if cfg.controller.time_budget_s else None
    m = None
    nxt: TakenBatch | None = None  # the next batch, taken ahead and scored while the learner trained
    while job.version < cfg.controller.total_steps and not stop.requested:
        if deadline is not None and time.perf_counter() >= deadline:
            break
        job.workers.apply_controls(board)  # control requests: scale workers, pause
        job.workers.admit_started(board)  # workers started in the background join at the current version
        job.workers.replace_dead(board)  # a worker process died: count its samples, start a replacement
        if held_by_pause(board):  # POST /v1/pause: no batch is taken until /v1/resume
            time.sleep(0.2)
            continue
        if nxt is None:  # no batch ready: admit and collect before taking one
            job.top_up()  # the source admits new work under the staleness rule
            job.collect()  # finished trajectories into the buffer
        # a batch at the learner's version, its exact pi_old asked for (one taken ahead unless it lost
        # a trajectory to a fingerprint mismatch found since or passes over a group on its last chance)
        taken, nxt = job.confirm_ahead(nxt) or job.take(), None
        if taken is None:
            time.sleep(0.05)
            continue
        step = job.async_train(taken)  # waits for its old logits, launches the learner step
        job.top_up()  # the room the new version opened is admitted while the learner trains
        nxt = job.take_ahead(step)  # the next batch, for version + 1, scored while the learner trains
        learned = job.finish_train(step)  # the step's metrics: version + 1 when applied
        if learned["applied"]:
            held = job.evals.finish()  # an evaluation pinned to the outgoing version ends before it is replaced
            log_eval(log, board, held)
            if deadline is not None and held:
                deadline += held["waited_s"]  # the loop's wait for an evaluation is outside its budget
            job.await_old_logits(nxt)  # the service answers the next batch before it takes the new version
            job.route.before_publish(job.collect)  # scorer routes: score finished work at the outgoing version
            job.publisher.publish()  # the new version to every consumer
        report = step_report(job, taken.trajectories, learned)  # the row, and the service's status for it
        m = report.metrics
        job.learner_rss_bytes = (m.model_extra or {}).get("rss_bytes")  # named if the kernel kills it
        log.log(job.version, m)
        samples.write(cfg, taken.trajectories, learned, taken.answer, job.version)  # a few, decoded
        if cfg.controller.checkpoint_every and job.version % cfg.controller.checkpoint_every == 0:
            job.checkpoint()
        elif job.keeper.recovery_due(job.version):  # a restart loses at most recovery_checkpoint_s of training
            job.checkpoint(recovery=True)
        if cfg.controller.export_every and job.version % cfg.controller.export_every == 0:
            job.export()  # a Hugging Face folder of this version under <run_dir>/exports
        board.update(**status_fields(job, report.oldlogit, m, report.workers))
        console.print(step_line(m, job.version))
        if learned["applied"] and eval_due(job.version, cfg.controller.eval_every, cfg.controller.total_steps):
            job.evals.start("during")  # pinned to this version; the learner trains the next step meanwhile
    t_end = time.perf_counter()
    job.return_taken(nxt)  # taken ahead, never trained on: back to the buffer, unconsumed
    reason = end_reason(job.version, cfg.controller.total_steps, stop.requested)
    if stop.requested:  # an interrupted run stops promptly
        job.evals.abandon()
        after = {}
    else:  # one started at the last version (the budget ended the loop) is its evaluation after
        after = evaluate_reported(
            job, board, lambda: job.evals.finish("after") if job.evals.running else job.evals.evaluate("after")
        )
        log_eval(log, board, after)
        console.print(f"held-out reward after training: {after}")
    job.collect()  # training trajectories that finished during the evaluation
    job.checkpoint()
    console.print(f"run ended: {reason} at version {job.version}")
    return run_summary(
        job, reason=reason, before=before, after=after, last=m, loop_s=t_end - t_loop, t_end=t_end, t_start=t_start
    )


def log_eval(log: MetricsLog, board: StatusBoard, scores: dict[str, Any]) -> None:
    """One evaluation's record (:func:`trainer.driver.records.heldout.eval_record`) to ``metrics.jsonl`` and the
    trackers (``eval/held_out``, ...), and its figure to ``/v1/status``; nothing for ``{}``."""
    if not scores:
        return
    rec = eval_record(scores["tag"], scores, scores["seconds"], scores["waited_s"])
    log.log_eval(rec)
    if math.isfinite(rec["held_out"]) and math.isfinite(rec["success_rate"]):  # NaN: an agent eval scored nothing
        board.update(held_out=rec["held_out"], held_out_success=rec["success_rate"], held_out_version=rec["version"])


def evaluate_reported(job: Job, board: StatusBoard, evaluate: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``evaluate()`` (a held-out evaluation of ``job``) with ``/v1/status`` saying ``state =
    "evaluating"`` and the job's fields (:func:`trainer.driver.loop.report.status_fields`) meanwhile; the
    state it had is back after."""
    previous = board.status().state
    board.update(state="evaluating", **status_fields(job, job.oldlogit_status()))
    try:
        return evaluate()
    finally:
        board.update(state=previous)


def end_reason(version: int, total_steps: int, interrupted: bool) -> str:
    """Why the loop ended: ``completed`` (``total_steps`` reached), ``interrupted`` (a signal), or
    ``time_budget`` (the budget expired first)."""
    if version >= total_steps:
        return "completed"
    return "interrupted" if interrupted else "time_budget"


def held_by_pause(board: StatusBoard) -> bool:
    """Whether the driver loop holds at a pause request; while it holds, ``/v1/status`` says
    ``state = "paused"``, and ``"running"`` again once it goes on."""
    state = board.status().state
    if board.paused and state == "running":
        board.update(state="paused")
    elif not board.paused and state == "paused":
        board.update(state="running")
    return board.paused
