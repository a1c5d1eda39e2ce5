"""Rollout worker: turns RolloutRequests into Trajectories, taking weight updates mid-generation.

:class:`RolloutWorkerCore` is a plain class (tested without Ray); its thin Ray actor wrapper is
:data:`rollout.worker_actor.RolloutWorker`. A background thread steps the engine one token at a time while the caller
submits work, polls finished trajectories and pushes weights.

Invariants:

* every sampled token is stamped with ``engine.version`` at the step that sampled it; all tokens
  of one step come from one version, because weights change only between steps (under the lock);
* a weight update interrupts every running request *between two tokens*, applies the new version,
  and resumes each one from its generated prefix (prompt + tokens so far, budget = what is left;
  the tokens prefilled again count in ``resumed_prefill_tokens``). The version boundary therefore
  falls at the exact token; a request that had produced nothing yet gets the version of its first
  token. Versions never decrease within a sequence. With
  :attr:`rollout.engine.EngineConfig.keep_requests_on_update` the running requests stay in the
  engine instead and go on under the new version, with their prefix's KV cache from the old one;
  the boundary still falls between two tokens;
* ``score_prefixes(items, temperature, known) -> [old_logprobs]`` (optional, the interrupt_sync
  route) is called after the interruption (or, with kept requests, at the update) and before the
  new weights are applied, while the
  old-logit service still holds the outgoing version, with one :class:`protocol.OldLogitItem` for
  every sequence - in flight *or finished but not yet polled* - that holds tokens of the
  outgoing version; the exact ``pi_old`` it returns is attached to the sequence (values attached at
  earlier interruptions are passed as ``known`` and kept), so the trajectory arrives with
  ``old_logprobs`` for every completed segment;
* a failed update (bad payload, engine error) raises; interrupted requests resume under the old
  version, which keeps serving;
* a LoRA adapter publication (``manifest.adapter`` set) is merged into the worker's own pristine
  copy of the base weights (the engine's model folder, loaded at the first adapter) by
  :func:`modelkit.lora.merged_weights` and applied like full weights; every version is merged
  from that base, never from the previous version;
* after every applied update (and at the start) the worker reads its engine's weights back
  (:meth:`rollout.engine.GenerationEngine.served_fingerprint`) into ``served_fingerprint``, which
  every trajectory it emits carries, and keeps the applied fingerprint, that of the tensors it
  handed to the engine (the merged weights for an adapter; both in :class:`rollout.served_weights.ServedWeights`); :meth:`fingerprint` reports both;
* every submitted sample leaves exactly once through :meth:`poll`, finished (``stop``/``length``)
  or ``abort`` with the reason in ``info["error"]``.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from modelkit.procmem import tree_rss_bytes
from protocol import OldLogitItem, RolloutRequest, Trajectory, WeightManifest, WorkerStatus
from rollout.agent import ChatFormat, Episode, TemplateChatFormat
from rollout.engine import EngineRequest, GenerationEngine
from rollout.envs import check_reset, check_step, load_env
from rollout.served_weights import ServedWeights

PrefixScorer = Callable[[list[OldLogitItem], float, list[np.ndarray | None]], list[np.ndarray]]


def sample_id(request_id: str, i: int, n: int) -> str:
    """The trajectory id of sample ``i`` of a request of ``n`` samples: the request's own id when
    ``n = 1``, else ``<request id>/<i>``."""
    return request_id if n == 1 else f"{request_id}/{i}"


def request_of(trajectory_id: str, held: Mapping[str, int]) -> str:
    """The inverse of :func:`sample_id` against the request ids in ``held``: the id itself when it
    is held (an ``n = 1`` request), else the part before its last ``/``."""
    return trajectory_id if trajectory_id in held else trajectory_id.rsplit("/", 1)[0]


def first_prompt(ep: Episode, chat: ChatFormat) -> list[int]:
    """The prompt token ids of a new episode's request: its ``prompt`` text, its chat ``messages``
    or its ``prompt_ids``, or else the first observation of its environment, which is loaded and
    reset into ``ep.env`` (the reset's info in ``ep.info["env"]``).

    Raises:
        ValueError, TypeError: the request cannot be rendered or its environment refused it (the
            message names the request), or the prompt renders to no tokens.
    """
    r = ep.request
    try:
        if r.prompt is not None:
            prompt = chat.text_ids(r.prompt)
        elif r.messages is not None:
            prompt = chat.prompt_ids(r.messages)
        elif r.prompt_ids is not None:
            prompt = [int(x) for x in r.prompt_ids]
        else:
            ep.env = load_env(r.env.path, **r.env.kwargs)
            msgs, info = check_reset(ep.env.reset(r.env.seed), r.env.path)
            ep.info["env"] = {"path": r.env.path, "seed": r.env.seed, **info}
            prompt = chat.prompt_ids(msgs)
    except (ValueError, TypeError) as e:
        raise type(e)(f"request {r.request_id!r}: {e}") from e
    if not prompt:
        raise ValueError(f"request {r.request_id!r}: prompt renders to no tokens")
    return prompt


def prefix_item(held: Episode | Trajectory) -> tuple[float, OldLogitItem]:
    """A held sequence (an unfinished episode or an unpolled trajectory) as the scoring request for
    its old logits, with its sampling temperature."""
    if isinstance(held, Episode):
        item = OldLogitItem(
            trajectory_id=held.trajectory_id, token_ids=np.asarray(held.token_ids, np.int32),
            loss_mask=np.asarray(held.loss_mask, np.int8), versions=np.asarray(held.versions, np.int32),
        )  # fmt: skip
        return held.request.sampling.temperature, item
    item = OldLogitItem(
        trajectory_id=held.trajectory_id, token_ids=held.token_ids, loss_mask=held.loss_mask, versions=held.versions
    )
    return float(held.info["temperature"]), item


class RolloutWorkerCore:
    """Generation loop over one engine (see the module invariants).

    Args:
        engine: a started :class:`rollout.engine.GenerationEngine`.
        chat: chat-template renderer; default: the tokenizer of ``engine.config.model_path``.
        worker_id: name reported in trajectories and status.
        max_num_seqs: most sequences handed to the engine at once (the rest wait, in order).
        score_prefixes: scorer of prefixes at the outgoing version (interrupt_sync route).
        torch_threads: torch intra-op threads of the background generation thread (set when it
            starts, :func:`modelkit.cores.set_torch_threads`); None leaves the process's count.

    Raises:
        ValueError: ``max_num_seqs`` < 1.
    """

    def __init__(
        self,
        engine: GenerationEngine,
        chat: ChatFormat | None = None,
        worker_id: str = "rollout-0",
        max_num_seqs: int = 64,
        score_prefixes: PrefixScorer | None = None,
        torch_threads: int | None = None,
    ):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: must be >= 1, got {max_num_seqs}")
        if chat is None:
            from transformers import AutoTokenizer

            chat = TemplateChatFormat(AutoTokenizer.from_pretrained(engine.config.model_path))
        self.engine, self.chat, self.worker_id = engine, chat, worker_id
        self.max_num_seqs, self.score_prefixes = max_num_seqs, score_prefixes
        self.torch_threads = torch_threads
        self.max_context = engine.config.max_model_len
        self._lock = threading.RLock()
        self._waiting = 0  # callers waiting for the lock: the loop yields to them between steps
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pending: collections.deque[Episode] = collections.deque()
        self._running: dict[str, Episode] = {}
        self._done: list[Trajectory] = []
        self._ids = itertools.count()
        self._known: set[str] = set()
        self.generated_tokens = self.generated_trajectories = self.errors = self.updates = 0
        self.busy_seconds = 0.0
        self.resumed_prefill_tokens = 0
        """Tokens handed to the engine again, to be prefilled again, when requests interrupted by
        applied weight updates resume (their prompt and everything sampled so far; requests the
        engine had not scheduled yet count too): the prefill that keeping requests saves."""
        self.last_update_seconds: float | None = None
        self.last_error = ""
        self.state = "running"
        self.weights = ServedWeights(engine, self._record_error)
        """The served and applied fingerprints, and the base adapters merge into."""

    # --- public API --------------------------------------------------------------------------

    @property
    def version(self) -> int:
        """Weight version now serving."""
        return self.engine.version

    @property
    def served_fingerprint(self) -> str | None:
        """Fingerprint of the weights the engine serves, read back from it after the last update."""
        return self.weights.served

    def submit(self, requests: list[RolloutRequest] | RolloutRequest) -> int:
        """Queue requests (``n`` samples each). Returns the number of samples queued.

        Samples of ``purpose = "eval"`` requests are queued ahead of the training samples waiting
        (in their own order), so a held-out evaluation waits only for the sequences already running.

        A request given as a mapping is decoded strictly (:meth:`protocol.Message.from_wire`).

        Raises:
            ValueError: a request id is already queued, or its prompt/env cannot be built, or a
                mapping breaks a field (``pydantic.ValidationError``; the message names the request
                and field). Nothing of a failing call is queued.
            TypeError: an environment returns malformed messages from ``reset``, or a request is
                neither a :class:`RolloutRequest` nor a mapping.
        """
        reqs = [requests] if isinstance(requests, RolloutRequest) else list(requests)
        built: list[Episode] = []
        for k, r in enumerate(reqs):
            r = RolloutRequest.from_wire(r, f"requests[{k}]")
            for i in range(r.sampling.n):
                built.append(self._new_episode(r, sample_id(r.request_id, i, r.sampling.n)))
        with self._locked():
            ids = [ep.trajectory_id for ep in built]
            dup = sorted({t for t in ids if t in self._known or ids.count(t) > 1})
            if dup:
                raise ValueError(f"request_id: {dup[:3]} already queued on {self.worker_id}")
            evals = []
            for ep in built:
                self._known.add(ep.trajectory_id)
                if ep.finish_reason:  # no room for even one token
                    self._finalize(ep)
                elif ep.request.purpose == "eval":
                    evals.append(ep)
                else:
                    self._pending.append(ep)
            self._pending.extendleft(reversed(evals))  # held-out episodes go before waiting training ones
        self._wake.set()
        return len(built)

    def poll(self, max_items: int | None = None) -> list[Trajectory]:
        """Finished trajectories since the last call (oldest first), at most ``max_items``."""
        with self._locked():
            k = len(self._done) if max_items is None else max(0, max_items)
            out, self._done = self._done[:k], self._done[k:]
            for t in out:
                self._known.discard(t.trajectory_id)
        return out

    def update_weights(self, manifest: WeightManifest, payload: Mapping[str, Any]) -> int:
        """Interrupt in-flight requests, apply weights ``manifest.version``, resume; returns the version.
        With ``keep_requests_on_update`` the requests are not interrupted: they go on under the new
        weights.

        ``payload`` is ``{hf_name: tensor}`` from ``modelkit.weights.pack_weights``; it is verified
        (checksum, shapes) before anything is interrupted. An adapter publication is merged into
        the kept base first (:meth:`rollout.served_weights.ServedWeights.merged_adapter`).

        Raises:
            protocol.ProtocolError: the payload does not match the manifest.
            ValueError: the version is not newer than the serving one, or tensors do not fit.
            rollout.engine.EngineError: the engine failed while copying.
        """
        from modelkit.weights import unpack_weights

        if manifest.version <= self.engine.version:
            raise ValueError(
                f"manifest.version: {manifest.version} is not newer than serving version {self.engine.version}"
            )
        named = unpack_weights(manifest, payload)
        if manifest.adapter is not None:
            named = self.weights.merged_adapter(named, manifest.adapter)
        t0 = time.perf_counter()
        with self._locked():
            resumed = 0
            if not self.engine.config.keep_requests_on_update:
                resumed = sum(len(ep.token_ids) for ep in self._running.values())
                self._interrupt()
            outgoing = self.engine.version
            if self.score_prefixes is not None:
                try:
                    self._attach_old_logprobs(outgoing)
                except Exception as e:  # those tokens stay NaN: the learner uses its proxy, and says so
                    self._record_error(f"score_prefixes failed: {e!r}")
            self.engine.update_weights(named, manifest.version)
            self.resumed_prefill_tokens += resumed  # they resume under the new version
            self.weights.record_update(named)
            self.updates += 1
            self.last_update_seconds = time.perf_counter() - t0
        self._wake.set()
        return self.engine.version

    def fingerprint(self) -> dict[str, Any]:
        """``{"version", "served", "applied"}``: the serving version, the fingerprint read back from
        the engine (None if it cannot be read) and that of the tensors the last update handed to it
        (None before one). See :mod:`modelkit.fingerprint`."""
        with self._locked():
            return {
                "version": self.engine.version,
                "served": self.weights.served,
                "applied": self.weights.applied,
            }

    def status(self) -> WorkerStatus:
        """Version, in-flight samples, throughput (tokens / second spent stepping) and errors."""
        with self._locked():
            return WorkerStatus(
                worker_id=self.worker_id,
                policy_version=self.engine.version,
                in_flight=len(self._pending) + len(self._running),
                generated_trajectories=self.generated_trajectories,
                generated_tokens=self.generated_tokens,
                tokens_per_s=self.generated_tokens / self.busy_seconds if self.busy_seconds > 0 else 0.0,
                errors=self.errors,
                state=self.state,
                last_error=self.last_error[-500:],
                served_fingerprint=self.served_fingerprint,
                rss_bytes=tree_rss_bytes(),
                resumed_prefill_tokens=self.resumed_prefill_tokens,
            )

    def step(self) -> int:
        """Admit waiting samples and run one engine step; returns tokens produced, -1 when idle."""
        with self._locked():
            self._admit()
            if not self._running and not self.engine.has_unfinished():
                return -1
            t0 = time.perf_counter()
            deltas = self.engine.step()
            self.busy_seconds += time.perf_counter() - t0
            version, n = self.engine.version, 0
            for d in deltas:
                n += len(d.token_ids)
                self._on_delta(d, version)
            self.generated_tokens += n
            return n

    def run_until_idle(self, timeout_s: float = 600.0) -> list[Trajectory]:
        """Step on the caller's thread until nothing is queued or running; returns :meth:`poll`.

        Raises:
            TimeoutError: still busy after ``timeout_s`` seconds.
        """
        end = time.monotonic() + timeout_s
        while self.step() >= 0:
            if time.monotonic() > end:
                raise TimeoutError(
                    f"timeout_s: still {len(self._running) + len(self._pending)} samples in flight after {timeout_s} s"
                )
        return self.poll()

    def start(self) -> None:
        """Start the background generation thread (idempotent)."""
        if self._thread and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name=f"{self.worker_id}-gen", daemon=True)
        self._thread.start()

    def stop(self, abort_in_flight: bool = False, timeout_s: float = 30.0) -> None:
        """Stop the background thread; optionally emit every unfinished sample as ``abort``."""
        self._stop.set()
        self._wake.set()
        if self._thread:
            self._thread.join(timeout_s)
        if abort_in_flight:
            with self._locked():
                self._interrupt()
                while self._pending:
                    ep = self._pending.popleft()
                    ep.finish_reason, ep.info["error"] = "abort", "worker stopped"
                    self._finalize(ep)
        self.state = "stopping" if abort_in_flight else "paused"

    def close(self) -> None:
        """Stop and release the engine."""
        self.stop()
        self.engine.close()

    # --- internals ---------------------------------------------------------------------------

    class _Locked:
        def __init__(self, core: RolloutWorkerCore):
            self.core = core

        def __enter__(self):
            self.core._waiting += 1
            self.core._lock.acquire()
            self.core._waiting -= 1

        def __exit__(self, *exc):
            self.core._lock.release()

    def _locked(self) -> RolloutWorkerCore._Locked:
        return RolloutWorkerCore._Locked(self)

    def _loop(self) -> None:
        if self.torch_threads:  # torch's thread count is per thread: set it where the engine steps
            from modelkit.cores import set_torch_threads

            set_torch_threads(self.torch_threads)
        while not self._stop.is_set():
            try:
                n = self.step()
            except Exception as e:  # keep the actor alive; the error is visible in status()
                self._record_error(f"step failed: {e!r}\n{traceback.format_exc(limit=3)}")
                if self.engine.failed:
                    self.state = "failed"
                    return
                n = -1
            if n < 0:
                self._wake.wait(0.05)
                self._wake.clear()
            elif self._waiting:
                time.sleep(0.0005)  # the lock is not fair: let a waiting update/poll in

    def _record_error(self, msg: str) -> None:
        self.errors += 1
        self.last_error = msg

    def _new_episode(self, r: RolloutRequest, tid: str) -> Episode:
        seed = r.sampling.seed if r.sampling.n == 1 else None
        ep = Episode(trajectory_id=tid, request=r, seed=seed)
        prompt = first_prompt(ep, self.chat)
        ep.add_context(prompt)
        ep.prompt_len = len(prompt)
        if not self._start_turn(ep):
            ep.info["error"] = f"prompt length {len(prompt)} leaves no room in max_model_len {self.max_context}"
        return ep

    def _start_turn(self, ep: Episode) -> bool:
        budget = min(ep.request.sampling.max_tokens, self.max_context - len(ep.token_ids))
        if budget < 1:  # context budget exhausted: that is truncation too (multi-turn)
            ep.finish_reason, ep.truncated = "length", True
            ep.info["context_exhausted"] = True
            return False
        ep.start_turn(budget)
        return True

    def _admit(self) -> None:
        while self._pending and len(self._running) < self.max_num_seqs:
            ep = self._pending.popleft()
            rid = f"{ep.trajectory_id}@{next(self._ids)}"
            s = ep.request.sampling
            try:
                self.engine.add(
                    EngineRequest(
                        rid, list(ep.token_ids), ep.turn_budget, s.temperature, list(s.stop_token_ids), ep.seed
                    )
                )
            except ValueError as e:
                ep.finish_reason, ep.info["error"] = "abort", f"engine refused request: {e}"
                self._record_error(ep.info["error"])
                self._finalize(ep)
                continue
            ep.engine_rid = rid
            self._running[rid] = ep

    def _on_delta(self, d, version: int) -> None:
        ep = self._running.get(d.request_id)
        if ep is None:  # output of a request we aborted: never recorded
            return
        ep.add_sampled(d.token_ids, d.behav_logprobs, version)
        if d.finish_reason:
            del self._running[d.request_id]
            ep.engine_rid = None
            self._end_turn(ep, d.finish_reason)

    def _end_turn(self, ep: Episode, reason: str) -> None:
        turn = ep.turn_ids
        ep.turn_boundaries.append((ep.turn_start, len(ep.token_ids)))
        ep.turns += 1
        ep.finish_reason = reason
        ep.truncated = ep.truncated or reason == "length"
        if reason == "abort" or ep.env is None:
            return self._finalize(ep)
        try:
            obs, reward, done, info = check_step(ep.env.step(self.chat.decode(turn)), ep.request.env.path)
        except Exception as e:  # a broken env ends its episode, not the worker
            ep.finish_reason, ep.info["error"] = "abort", f"env.step failed: {e!r}"
            self._record_error(ep.info["error"])
            return self._finalize(ep)
        ep.turn_rewards.append(reward)
        ep.info.setdefault("turn_info", []).append(info)
        if done or ep.turns >= getattr(ep.env, "max_turns", 1):
            ep.info["env_done"] = bool(done)
            return self._finalize(ep)
        if not obs:
            ep.finish_reason, ep.info["error"] = "abort", "env returned no observation and not done"
            return self._finalize(ep)
        ctx = self.chat.close_ids(turn, reason) + self.chat.observation_ids(obs)
        if len(ep.token_ids) + len(ctx) >= self.max_context:  # no room for the observation + 1 token
            ep.finish_reason, ep.truncated = "length", True
            ep.info["context_exhausted"] = True
            return self._finalize(ep)
        ep.add_context(ctx)
        if not self._start_turn(ep):
            return self._finalize(ep)
        self._pending.appendleft(ep)  # continue the conversation before admitting new work

    def _finalize(self, ep: Episode) -> None:
        try:
            self._done.append(ep.to_trajectory(self.worker_id, self.engine.version, self.served_fingerprint))
            self.generated_trajectories += 1
        except Exception as e:  # an internal bug; say so loudly rather than emit a bad sample
            self._record_error(f"trajectory {ep.trajectory_id} invalid, dropped: {e}")

    def _interrupt(self) -> None:
        """Abort every running request between two tokens; they wait, first in line, to resume."""
        if not self._running:
            return
        self.engine.abort(list(self._running))
        for ep in reversed(list(self._running.values())):
            ep.engine_rid = None
            ep.resumes += 1
            self._pending.appendleft(ep)
        self._running.clear()

    def _attach_old_logprobs(self, version: int) -> None:
        """Score every unfinished or unpolled sequence holding ``version`` tokens and attach pi_old."""
        seqs: list[Episode | int] = list(self._pending) + list(self._running.values())
        seqs += [i for i, t in enumerate(self._done) if (t.versions == version).any()]
        by_temp: dict[float, list] = {}
        for x in seqs:
            if isinstance(x, Episode) and version not in x.versions:
                continue
            held = x if isinstance(x, Episode) else self._done[x]
            temperature, item = prefix_item(held)
            by_temp.setdefault(temperature, []).append((x, item, held.old_logprobs))
        for temperature, group in by_temp.items():
            lps = self.score_prefixes([g[1] for g in group], temperature, [g[2] for g in group])
            for (target, _, _), lp in zip(group, lps, strict=True):
                if isinstance(target, Episode):
                    target.old_logprobs = np.asarray(lp, np.float32)
                else:
                    self._done[target] = self._done[target].with_old_logprobs(lp)
