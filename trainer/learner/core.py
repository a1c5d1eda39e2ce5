"""The DeepSpeed learner: several optimizer steps per rollout batch, one version per batch, a non-finite guard.

:class:`LearnerCore` is a plain class around a DeepSpeed engine (tested without Ray);
:data:`Learner` is its ``ray.remote`` wrapper, one actor per data-parallel rank, and
:class:`LearnerGroup` drives the ranks from the controller.

One :meth:`LearnerCore.train_step` at learner version ``V``:

1. collate the trajectories (:func:`trainer.algorithm.batch.collate`): per-token staleness ``V - v_t``,
   exact old log-probs where a route supplied them (NaN elsewhere), GRPO advantages over the whole
   batch; the batch is split into ``ppo_mini_batches`` mini-batches, taken ``ppo_epochs`` times
   in a row order drawn per epoch from (seed, version, epoch) (``shuffle_mini_batches``), one
   optimizer step each (with one step, the batch itself); with several steps and a proxy built
   from the current log-probs, those of version ``V`` are taken first (the recompute reference);
   each rank then takes rows ``rank::world_size`` of a mini-batch; with ``loss.kl_coef`` or
   ``loss.kl_reward_coef`` a no-grad forward of the frozen reference
   (:class:`trainer.learner.reference.ReferencePolicy`) scores the whole batch first, once for all
   its optimizer steps (unless the old-logit service's answer brought its log-probs), and with ``loss.kl_reward_coef`` the rewards lose the KL penalty of the
   reward and the advantages are recomputed (:meth:`LearnerCore._with_reference`);
2. per optimizer step, the global token count ``N`` of the mini-batch (all-reduced over ranks) is
   the token-mean denominator of every micro-batch, and the loss is multiplied by ``world_size``
   because DeepSpeed averages gradients over data-parallel ranks;
3. per micro-batch: with the PPO-EWMA proxy a no-grad forward with the EWMA weights (only where a
   sampled token lacks exact old logits, plus a probe every ``ewma.probe_every`` versions that keeps
   the auto-reset signal and the proxy-error metric measured), the forward
   of the current policy (log-probs and entropy, with gradient under ``loss.entropy_coef``), :func:`trainer.algorithm.losses.compute_policy_loss` (exact
   reference where known, the configured proxy elsewhere), ``engine.backward``; gradient
   accumulation is driven by hand (``set_gradient_accumulation_boundary``), so the number of
   micro-batches may change per step; with one rank at ZeRO stage 0 in fp32 DeepSpeed's gradient
   reduction (an average over one rank) is off, and parameters left without a gradient get a zero
   one before the step, as the reduction would give them;
4. the learning rate is set from the schedule (:func:`trainer.learner.schedule.lr_multiplier`);
5. the non-finite guard: the gradient norm (ZeRO stage 0 in fp32, where the learner computes it)
   or else a hook on every parameter flags a non-finite gradient, the loss is checked, and the
   flag is all-reduced; if set, ``engine.step()`` runs with the inner torch
   optimizer's ``step`` suppressed (DeepSpeed still clears its gradient buffers, weights and
   optimizer state stay untouched) and the optimizer step is counted as skipped. A step DeepSpeed
   itself skips (its own overflow check) counts the same way. The optimizer's own step is checked
   too: the parameters and state it updates are copied before it runs (:class:`trainer.learner.guard.StepGuard`),
   and when any updated weight or state tensor is not finite (an infinite learning rate, an
   overflowing update) every rank restores the copy, so weights and optimizer state are exactly
   those of before the step, and the step counts as skipped (``nonfinite_weight_steps``);
6. after each applied optimizer step the EWMA folds the new weights in and resets when the
   discrepancy mask on pi_ewma/mu keeps less than ``ewma.reset_tau`` of the tokens; after the last
   one, ``version += 1`` when at least one step of the batch applied (otherwise the version stays,
   so weights a guard refused are never published as a new version).

ZeRO stages 0-3 all run on CPU with gloo and a torch ``AdamW`` passed in (DeepSpeed's fused/CPU Adam
would JIT-compile for minutes); bf16 keeps fp32 master weights in DeepSpeed's optimizer wrapper.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import psutil
import torch

from modelkit.cores import torch_threads
from modelkit.scoring import (
    scoring_mode,
    sequence_logprobs,
    sequence_logprobs_and_entropy,
)
from modelkit.weights import Transport
from protocol import OldLogitAnswer, Trajectory, WeightManifest
from trainer.algorithm.batch import Batch, collate, first_loss_position, pass_order
from trainer.algorithm.entropy_control import EntropyControl
from trainer.algorithm.ewma import EwmaProximal
from trainer.algorithm.losses import compute_policy_loss, proxy_diagnostics
from trainer.algorithm.proximal import RECOMPUTE_PROXIES
from trainer.learner import checkpoint, publication
from trainer.learner.guard import StepGuard, stage0_grad_norm, zero_missing_grads
from trainer.learner.models import ewma_logprobs, load_learner_models
from trainer.learner.ranks import all_reduce_floats, micro_batch_count, score_rows
from trainer.learner.reference import require_reference_logprobs, with_kl_reward_penalty
from trainer.learner.settings import LearnerSettings, init_distributed
from trainer.learner.steps import combine_step_metrics, reads_taken_recompute, reduce_metrics, sum_max_min


class LearnerCore:
    """One data-parallel rank of the learner around a DeepSpeed engine.

    Args:
        settings: :class:`LearnerSettings`.
        rank: this process's data-parallel rank.
        world_size: number of ranks; every rank must be constructed concurrently (collective init).

    Attributes:
        version: learner steps (rollout batches) with at least one applied optimizer step (initial
            weights: 0); a batch whose every optimizer step was skipped leaves it alone.
        skipped_steps: optimizer steps refused by the non-finite guard (or DeepSpeed's overflow check).
        nonfinite_weight_steps: of those, steps whose update produced a non-finite weight or optimizer
            state (e.g. an infinite learning rate) and were rolled back.
        ewma: the :class:`trainer.algorithm.ewma.EwmaProximal`, or None when the proxy is not "ewma".
        reference: the KL penalties' :class:`trainer.learner.reference.ReferencePolicy`, or None when
            ``loss.kl_coef`` and ``loss.kl_reward_coef`` are 0 or each batch brings the reference's
            log-probs (``reference_in_batch``: the old-logit service scores them).
    """

    def __init__(self, settings: LearnerSettings, rank: int = 0, world_size: int = 1) -> None:
        import deepspeed

        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        self.settings, self.rank, self.world_size = settings, rank, world_size
        init_distributed(settings, rank, world_size)
        torch.manual_seed(settings.seed)
        models = load_learner_models(settings, self._torch_dtype)
        model, scorer = models.policy, models.ewma_scorer
        self.pad_token_id, self.reference = models.pad_token_id, models.reference
        self._optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad], lr=settings.lr, betas=settings.betas,
            eps=settings.adam_eps, weight_decay=settings.weight_decay, fused=settings.fused_adam or None,
        )  # fmt: skip
        self._guard = StepGuard(self._optimizer, self._all_reduce, settings.keeps_rollback_copy)
        ds_config = settings.deepspeed_config()
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=self._optimizer, config=ds_config)
        if scorer is not None:  # the EWMA forwards run where the engine's do
            scorer.to(self.engine.device)
        if self.reference is not None:
            self.reference.to(self.engine.device)
        if not settings.checks_grads_by_norm:
            self._guard.watch(self.engine.module.parameters())
        elif world_size == 1:
            # one rank has nothing to average: DeepSpeed would flatten every gradient after the
            # boundary micro-batch's backward, all-reduce it with itself and copy it back
            self.engine.enable_backward_allreduce = False
        self.version = 0
        self.skipped_steps = 0
        self.nonfinite_weight_steps = 0
        self.optimizer_steps = 0
        """Applied optimizer steps since version 0: the learning-rate schedule's step count."""
        self.entropy_control = EntropyControl(settings.loss)
        """The entropy coefficient of the next version (adaptive under ``loss.entropy_target``)."""
        self._scoring = {"chunk_bytes": settings.logprob_chunk_bytes, "packed": settings.pack_sequences}
        """How every learner log-prob is computed (:func:`modelkit.scoring.sequence_logprobs`)."""
        self.last_publish: dict[str, float] = {}
        self.last_optimizer_steps: list[dict[str, float]] = []
        """Per optimizer step metrics of the last :meth:`train_batch` (before :func:`combine_step_metrics`)."""
        self._device_payloads: deque = deque(maxlen=2)  # CUDA IPC publications consumers may still read
        self.ewma: EwmaProximal | None = None
        self._scorer = scorer
        if settings.loss.proxy == "ewma":
            # the decay is set in versions; the EWMA folds weights in per optimizer step
            steps = settings.ppo_epochs * settings.ppo_mini_batches
            with self._full_params():
                self.ewma = EwmaProximal(
                    self.engine.module, settings.ewma, trainable_only=settings.lora.enabled, steps_per_version=steps
                )

    # -- helpers --------------------------------------------------------------------------------

    @property
    def _torch_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.settings.dtype == "bfloat16" else torch.float32

    def _full_params(self) -> contextlib.AbstractContextManager:
        """Context in which ``engine.module``'s parameters are whole tensors (ZeRO-3 gathers them)."""
        if self.settings.zero_stage == 3:
            import deepspeed

            return deepspeed.zero.GatheredParameters(list(self.engine.module.parameters()), modifier_rank=None)
        return contextlib.nullcontext()

    def _all_reduce(self, values: list[float], op: str = "sum") -> list[float]:
        return all_reduce_floats(values, self.world_size, op)

    # -- training -------------------------------------------------------------------------------

    def train_step(
        self,
        trajectories: Sequence[Trajectory],
        old_logits: OldLogitAnswer | Sequence[np.ndarray | None] | None = None,
    ) -> dict[str, float]:
        """One optimizer step on a batch of trajectories consumed at the current version.

        Every rank gets the *same* full list (advantages need whole groups) and trains on its rows.
        ``old_logits``: exact pi_old aligned with ``trajectories`` (an :class:`OldLogitAnswer` or
        arrays with NaN where missing); None uses each trajectory's attached ``old_logprobs``.
        The step runs on ``settings.torch_threads`` torch threads (the count before is restored).
        Returns :meth:`train_batch`'s metrics.
        """
        s = self.settings
        batch = collate(
            trajectories, self.version, old_logits=old_logits, temperature=s.temperature, pad_token_id=self.pad_token_id,
            max_token_staleness=s.max_token_staleness, overlong_filter=s.overlong_filter, advantage=s.loss.advantage,
            current_from_learner=s.current_from_learner,
        )  # fmt: skip
        with torch_threads(s.torch_threads):
            return self.train_batch(batch)

    def train_batch(self, batch: Batch) -> dict[str, float]:
        """One learner step on a collated (or hand-built) :class:`Batch`: ``ppo_epochs`` passes over
        it, each split into ``ppo_mini_batches`` mini-batches (:meth:`Batch.mini_batches`; fewer
        when the batch has fewer rows), one optimizer step per mini-batch, then ``version += 1`` if
        at least one step applied. A policy version is therefore one published update per rollout
        batch (as AReaL and verl count it), whatever the number of optimizer steps inside it.

        The reference of the second and later optimizer steps: exact old log-probs stay those of
        each token's own version; the EWMA folds the weights in after every optimizer step (the
        next step's EWMA forward sees them); "recompute" and the linear proxies use the log-probs
        under the consuming version's weights, taken once before the first step
        (:meth:`_with_recompute`), so their ratio departs from 1 from the second step on and the
        clip acts. With one step per batch nothing is taken: the forward's own log-probs are those.

        Returns a dict of floats: ``loss`` (token-weighted mean of the steps' token-mean losses),
        ``applied`` (1 when at least one optimizer step applied), ``optimizer_steps`` (applied)
        and ``optimizer_steps_total``, ``version`` (after the step), ``consumed_version``,
        ``skipped_steps`` (optimizer steps refused so far), ``grad_norm`` (mean before clipping over
        applied steps, NaN when none) and ``grad_norm_max``, ``tokens`` (the batch's loss tokens,
        one pass), ``sequences``, the loss library's metrics as token-weighted means over steps
        (``clip_frac_low/high``, ``mask_kept_fraction``, ``exact_token_fraction``, ``entropy``,
        ``approx_kl``, ``ratio_mean`` ...; ``*_max``/``*_min`` as extremes), ``clip_frac_step_max``
        (largest clipped fraction of one optimizer step), ``clip_grad_removed_frac`` (share of the
        policy-gradient weight |w r A| on clipped tokens), ``proxy_abs_err`` (mean |proxy - exact|
        in nats over exact tokens, NaN without any) and ``proxy_err_tokens``, ``ewma_*`` (beta,
        total_weight, resets, kept_frac, reset, bytes), ``step_s``, ``tokens_per_s``, phase seconds
        summed over steps (``recompute_forward_s``, ``ewma_forward_s``, ``forward_loss_s``, ``backward_s``,
        ``optimizer_s``, ``ewma_update_s``) and the collation counts (``stale_masked_tokens``,
        ``overlong_masked_seqs``, ``staleness_*``, ``response_tokens_*``, ``groups``,
        ``zero_variance_groups``: groups whose rewards are all equal).

        Raises:
            ValueError: the batch was collated for another version than the learner's.
        """
        if batch.consuming_version != self.version:
            raise ValueError(f"batch collated for version {batch.consuming_version}, learner is at {self.version}")
        t0 = time.perf_counter()
        s = self.settings
        count = min(s.ppo_mini_batches, max(1, batch.size))
        steps = s.ppo_epochs * count
        recompute = steps > 1 and s.loss.proxy in RECOMPUTE_PROXIES
        kl_out: dict[str, float] = {}
        if s.loss.kl_penalty:  # frozen: scored once for every optimizer step of the batch
            batch, kl_out = self._with_reference(batch)
        tr = time.perf_counter()
        if recompute and s.ppo_epochs > 1:  # every row is read by a later step: take them all at once
            batch = self._with_recompute(batch)
        taken = reads_taken_recompute(count, s.ppo_epochs, recompute)

        def one_pass(epoch: int) -> list[Batch]:  # built when its pass starts: one reordered copy at a time
            return pass_order(batch, epoch, s.seed, s.ppo_mini_batches, s.shuffle_mini_batches).mini_batches(count)

        first = one_pass(0)
        if s.ppo_epochs == 1:
            first = [self._with_recompute(mb) if t else mb for mb, t in zip(first, taken, strict=True)]
        recompute_s = time.perf_counter() - tr
        probe = self.ewma is not None and self.ewma.config.probes(self.version)
        results = []
        for epoch in range(s.ppo_epochs):
            for j, mb in enumerate(first if epoch == 0 else one_pass(epoch)):
                results.append(self._optimizer_step(mb, probe and epoch == 0 and j == 0, taken[j]))
        self.last_optimizer_steps = results
        applied = any(r["applied"] > 0 for r in results)
        out: dict[str, float] = {"consumed_version": float(self.version)}
        if applied:
            self.version += 1
        out.update(combine_step_metrics(results))
        step_s = time.perf_counter() - t0
        n_tok = float(sum(r["tokens"] for r in results[: len(first)]))  # one pass
        out.update(
            applied=float(applied), version=float(self.version), skipped_steps=float(self.skipped_steps),
            nonfinite_weight_steps=float(self.nonfinite_weight_steps), tokens=n_tok, sequences=float(batch.size),
            step_s=step_s, tokens_per_s=n_tok / step_s if step_s > 0 else 0.0, recompute_forward_s=recompute_s,
            rss_bytes=float(psutil.Process().memory_info().rss),
        )  # fmt: skip
        out.update(kl_out)
        out["entropy_coef"] = self.entropy_control.coef
        if applied:
            self.entropy_control.after_version(out["entropy"])
        if self.ewma is not None:
            out.update({f"ewma_{k}": float(v) for k, v in self.ewma.status().items()})
        out.update({k: float(v) for k, v in batch.stats.items() if k not in out})
        return out

    @property
    def _ranks(self) -> tuple[int, int, int, torch.device]:
        """``(rank, world_size, micro_batch_size, device)``: how :func:`score_rows` splits a batch here."""
        return self.rank, self.world_size, self.settings.micro_batch_size, self.engine.device

    def _with_recompute(self, batch: Batch) -> Batch:
        """``batch`` with ``recompute_logprobs`` filled: the current weights' log-probs (eval mode,
        learner numerics) of every row (:func:`trainer.learner.ranks.score_rows`)."""
        with scoring_mode(self.engine.module) as model:
            lp = score_rows(batch, lambda mb, first: sequence_logprobs(
                model, mb.token_ids, mb.attention_mask, mb.temperature, first, **self._scoring
            ), *self._ranks)  # fmt: skip
        return replace(batch, recompute_logprobs=lp)

    def _with_reference(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        """``batch`` with ``ref_logprobs`` filled by the frozen reference (:func:`score_rows`; with
        ``reference_in_batch`` the batch brings them), and with ``loss.kl_reward_coef`` its rewards
        lowered by the KL penalty of the reward and its advantages recomputed
        (:func:`trainer.learner.reference.with_kl_reward_penalty`).

        Returns the batch and metrics: ``ref_forward_s`` (the reference's forwards, or only the
        check of the values the batch brought: near 0); with the
        reward penalty ``kl_reward`` (mean per-sequence estimate, nats) and ``kl_reward_penalty``
        (mean amount taken off a reward).

        Raises:
            ValueError: with ``reference_in_batch``, a loss token without a finite reference log-prob
                (:func:`trainer.learner.reference.require_reference_logprobs`)."""
        t0 = time.perf_counter()
        if self.reference is not None:
            lp = score_rows(batch, lambda mb, first: self.reference.logprobs(
                self.engine.module, mb.token_ids, mb.attention_mask, mb.temperature, first, **self._scoring
            ), *self._ranks)  # fmt: skip
            batch = replace(batch, ref_logprobs=lp)
        else:
            require_reference_logprobs(batch)
        ref_forward_s = time.perf_counter() - t0
        batch, out = with_kl_reward_penalty(batch, self.settings.loss.kl_reward_coef, self.settings.loss.advantage)
        return batch, {"ref_forward_s": ref_forward_s, **out}

    def _optimizer_step(self, batch: Batch, probe: bool, use_recompute: bool) -> dict[str, float]:
        """One optimizer step on one mini-batch (the whole rollout batch with one step per batch).

        The token-mean denominator ``N`` is the mini-batch's loss tokens over all ranks, so the loss
        does not depend on the micro-batch split; gradient accumulation runs over its micro-batches.
        ``probe``: run the EWMA forward on the first micro-batch even when every token is exact.
        ``use_recompute``: the reference for "recompute" and the linear proxies is
        ``batch.recompute_logprobs`` (taken before the batch's first step). After an applied step
        the EWMA folds the new weights in and may reset; the version is the caller's.

        Returns the step's metrics: ``loss``, ``applied``, ``grad_norm``, ``tokens`` (N), the loss
        library's token-weighted means and extremes (``entropy`` among them), proxy error sums,
        ``ewma_kept_frac``, ``ewma_reset``, phase seconds and micro-batch counts."""
        local = batch.shard(self.rank, self.world_size) if self.world_size > 1 else batch
        mbs = self.settings.micro_batch_size
        split = local.micro_batches(mbs, micro_batch_count(batch.size, self.world_size, mbs))
        micro = [m.to(self.engine.device) for m in split]
        first = first_loss_position(local)  # one for every micro-batch: their sums match a single pass
        n_tok, n_seq = self._all_reduce([float(local.n_tokens), float(local.loss_mask.any(-1).sum())])
        self._guard.clear()
        acc: dict[str, list[float]] = {}
        sums = {"loss": 0.0, "err": 0.0, "err_n": 0.0, "ewma_keep": 0.0, "ewma_n": 0.0}
        timing = {"ewma_forward_s": 0.0, "forward_loss_s": 0.0, "backward_s": 0.0}
        ewma_runs = 0
        self.engine.train()
        for i, mb in enumerate(micro):
            self.engine.set_gradient_accumulation_boundary(i == len(micro) - 1)
            recompute = mb.recompute_logprobs if use_recompute else None
            ewma_runs += self._micro_step(mb, first, (n_tok, n_seq), probe and i == 0, recompute, acc, sums, timing)
        s = self.settings
        if not self.engine.enable_backward_allreduce:
            zero_missing_grads(self.engine.module.parameters())
        grad_norm = stage0_grad_norm(self.engine.module) if s.checks_grads_by_norm else None
        keys = sorted(sums)
        glob = dict(zip(keys, self._all_reduce([sums[k] for k in keys]), strict=True))
        grads_bad = bool(self._guard.grad_bad) or (grad_norm is not None and not math.isfinite(grad_norm))
        local_bad = not math.isfinite(sums["loss"]) or grads_bad
        lr = s.lr_at(self.optimizer_steps)  # the schedule's rate for this step
        for group in self._optimizer.param_groups:
            group["lr"] = lr
        applied, rolled_back, timing["optimizer_s"] = self._guard.step(self.engine, local_bad)
        self.nonfinite_weight_steps += int(rolled_back)
        self.optimizer_steps += int(applied)
        if grad_norm is None:
            g = self.engine.get_global_grad_norm()
            grad_norm = float(g) if g is not None else math.nan
        kept = glob["ewma_keep"] / glob["ewma_n"] if glob["ewma_n"] > 0 else math.nan
        td = time.perf_counter()
        ewma_reset = self._fold_into_ewma(batch, kept) if applied else False
        self.skipped_steps += int(not applied)
        timing["ewma_update_s"] = time.perf_counter() - td
        out = reduce_metrics(acc, self._all_reduce)
        out.update(timing)
        out.update(
            loss=glob["loss"], applied=float(applied), grad_norm=grad_norm if applied else math.nan, tokens=n_tok,
            proxy_err_sum=glob["err"], proxy_err_tokens=glob["err_n"], ewma_kept_frac=kept, ewma_reset=float(ewma_reset),
            micro_batches=float(len(micro)), ewma_forward_micro_batches=float(ewma_runs), lr=lr,
        )  # fmt: skip
        return out

    def _micro_step(
        self,
        mb: Batch,
        first: int,
        counts: tuple[float, float],
        probe: bool,
        recompute: torch.Tensor | None,
        acc: dict[str, list[float]],
        sums: dict[str, float],
        timing: dict[str, float],
    ) -> int:
        """Forward, loss and backward of one micro-batch, accumulating its metrics into ``acc``,
        ``sums`` and ``timing``; ``counts`` are the mini-batch's global token and sequence counts.
        Returns 1 when the EWMA forward ran (a sampled token lacked exact old logits, or ``probe``)."""
        cfg, mask = self.entropy_control.loss_config(), mb.loss_mask
        exact_mask = mb.exact_mask | mb.current_mask  # the consuming version's own tokens are exact here
        ta = time.perf_counter()
        ewma_lp = None
        if self.ewma is not None and (bool((mask & ~exact_mask).any()) or probe):
            model = self._scorer if self._scorer is not None else self.engine.module
            ewma_lp = ewma_logprobs(self.ewma, model, mb, first, self._scoring)
        tb = time.perf_counter()
        ref_lp = mb.ref_logprobs if self.settings.loss.kl_penalty else None  # taken before the batch's first step
        lp, entropy = sequence_logprobs_and_entropy(
            self.engine, mb.token_ids, mb.attention_mask, mb.temperature, first,
            entropy_grad=cfg.entropy_coef > 0, **self._scoring,
        )  # fmt: skip
        old = torch.where(mb.current_mask, lp.detach(), mb.old_logprobs)
        loss, m = compute_policy_loss(
            lp, mb.behav_logprobs, mb.advantages, mask, cfg, old_logprobs=old,
            exact_mask=exact_mask, staleness=mb.staleness, recompute_logprobs=recompute,
            ref_logprobs=ref_lp, entropy=entropy,
            # every sampled token has exact old logits when the EWMA forward was skipped: the
            # proxy is never read there, so the current log-probs stand in for it
            ewma_logprobs=ewma_lp if ewma_lp is not None or self.ewma is None else lp.detach(),
            global_token_count=counts[0], global_seq_count=counts[1],
        )  # fmt: skip
        tc = time.perf_counter()
        self.engine.backward(loss * float(self.world_size))  # DeepSpeed averages gradients over ranks
        timing["ewma_forward_s"] += tb - ta
        timing["forward_loss_s"] += tc - tb
        timing["backward_s"] += time.perf_counter() - tc
        sums["loss"] += float(loss.detach())
        m["entropy"] = float(entropy.detach()[mask].sum() / mask.sum().clamp(min=1))
        sum_max_min(m, float(mask.sum()), acc)
        diag = proxy_diagnostics(
            cfg, lp, mb.behav_logprobs, old, mask, exact_mask, mb.staleness, ewma_lp, recompute
        )  # the proxy's error against the exact tokens, the EWMA's discrepancy mask
        for k, v in diag.items():
            sums[k] += v
        return int(ewma_lp is not None)

    def _fold_into_ewma(self, batch: Batch, kept: float) -> bool:
        """After an applied optimizer step: the EWMA folds the new weights in, then resets when the
        discrepancy mask on pi_ewma/mu kept less than ``ewma.reset_tau`` (``kept``). Returns whether it
        reset (False without an EWMA)."""
        if self.ewma is None:
            return False
        if self.ewma.config.beta_source == "lag" and bool(batch.sampled_mask.any()):
            # measured mean version lag of the consumed tokens (same batch on every rank)
            self.ewma.observe_lag(float(batch.staleness[batch.sampled_mask].float().mean()))
        with self._full_params():
            self.ewma.update(self.engine.module)
            return self.ewma.maybe_reset(kept, self.engine.module)

    # -- inspection and publication -------------------------------------------------------------

    def logprobs(self, batch: Batch) -> torch.Tensor:
        """``[batch, seq]`` fp32 log-probs (nats) of ``batch`` under the current weights (no grad),
        computed on the engine's device and returned on the CPU.

        Under ZeRO-3 with several ranks every rank must call it (the forward gathers parameters).
        """
        with scoring_mode(self.engine.module) as model:
            on_device = batch.to(self.engine.device)
            lp = sequence_logprobs(
                model, on_device.token_ids, on_device.attention_mask, batch.temperature, **self._scoring
            )
            return lp.float().cpu()

    def state_dict_full(self) -> dict[str, torch.Tensor]:
        """See :func:`trainer.learner.publication.state_dict_full`."""
        return publication.state_dict_full(self)

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """See :func:`trainer.learner.publication.adapter_state`."""
        return publication.adapter_state(self)

    def publish(
        self,
        dtype: str = "float32",
        copy: bool = True,
        transport: Transport = "host",
        mismatch_std: float = 0.0,
        mismatch_seed: int = 0,
    ) -> tuple[WeightManifest, Mapping[str, torch.Tensor]]:
        """See :func:`trainer.learner.publication.publish` (every ZeRO-3 rank must call it)."""
        return publication.publish(self, dtype, copy, transport, mismatch_std, mismatch_seed)

    def get_version(self) -> int:
        """The current version (for Ray callers; the attribute :attr:`version` locally)."""
        return self.version

    def status(self) -> dict[str, Any]:
        """Version, skipped steps, EWMA state, last publish measurements, rank info."""
        return {
            "version": self.version, "skipped_steps": self.skipped_steps, "rank": self.rank, "world_size": self.world_size,
            "zero_stage": self.settings.zero_stage, "dtype": self.settings.dtype, "last_publish": dict(self.last_publish),
            "ewma": self.ewma.status() if self.ewma is not None else None, "lora": self.settings.lora.enabled,
        }  # fmt: skip

    def save_checkpoint(self, directory: str, extra: dict[str, Any] | None = None) -> str:
        """See :func:`trainer.learner.checkpoint.save_checkpoint` (every rank must call it)."""
        return str(checkpoint.save_checkpoint(self, directory, extra=extra))

    def load_checkpoint(self, directory: str, tag: str | None = None) -> dict[str, Any]:
        """See :func:`trainer.learner.checkpoint.load_checkpoint` (every rank must call it); returns ``extra``."""
        return checkpoint.load_checkpoint(self, directory, tag=tag)


def __getattr__(name: str) -> Any:
    """``Learner``: the Ray actor wrapping :class:`LearnerCore`, one per data-parallel rank, created
    concurrently. Made on first use, so the plain class imports where Ray is not installed."""
    if name == "Learner":
        import ray

        actor = globals().setdefault("Learner", ray.remote(LearnerCore))
        return actor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
