"""The rollout workers' notes: what the job prints and shows as ``/v1/status`` ``scale_note`` when
workers die, hang, are scaled or join. Pure strings from the pool's counts and the settings; the
job (:class:`trainer.driver.loop.parts.Job`) decides where they go."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainer.driver.publication.fingerprints import FINGERPRINT_MISMATCH

if TYPE_CHECKING:
    from trainer.driver.workers.pool import WorkerPool


def workers_line(pool: WorkerPool, wanted: int) -> str:
    """``"<running> of <wanted> running[, <n> starting]"``: the rollout workers now."""
    starting = len(pool.starting)
    return f"{len(pool)} of {wanted} running" + (f", {starting} starting" if starting else "")


def lost_workers_note(
    pool: WorkerPool, wanted: int, deaths: dict[str, tuple[int, str]], restarts: int, max_restarts: int
) -> str:
    """The note on workers that died or hung (``deaths``: ``{worker id: (samples lost, reason)}``),
    with the workers and the restarts used (of ``rollout.max_restarts``) after their replacements
    were asked for."""
    what = {
        "worker_died": "died",
        "worker_hung": f"hung (no finished trajectory in {pool.hang_timeout_s or 0:g} s)",
        FINGERPRINT_MISMATCH: "served other weights than its version's (fingerprint mismatch)",
    }
    return (
        f"rollout worker(s) {', '.join(f'{w} {what[r]}' for w, (_, r) in sorted(deaths.items()))} "
        f"({sum(lost for lost, _ in deaths.values())} samples lost); "
        f"{workers_line(pool, wanted)}, {restarts} of {max_restarts} restarts used"
    )


def scaled_note(pool: WorkerPool, want: int, removed: int) -> str:
    """The note on a scale request to ``want`` workers that removed ``removed`` of them."""
    return f"scaling rollout workers to {want}: {workers_line(pool, want)}" + (
        f", {removed} removed" if removed else ""
    )


def started_note(pool: WorkerPool, wanted: int, joined: list[str], gave_up: list[str], start_timeout_s: float) -> str:
    """The note on workers started in the background: those that joined, those given up (not placed
    and started within ``rollout.start_timeout_s``)."""
    parts = [f"rollout worker(s) {', '.join(joined)} started"] if joined else []
    if gave_up:
        parts.append(
            f"{', '.join(gave_up)} not placed and started within rollout.start_timeout_s = "
            f"{start_timeout_s:g} s, given up"
        )
    return f"{'; '.join(parts)}; {workers_line(pool, wanted)}"
