"""Loss configuration and the named methods of the correction library. Imports no torch.

A method is a preset of :class:`LossConfig` fields; :func:`loss_config` builds one by name with
overrides. The learner passes the config to :func:`trainer.algorithm.losses.compute_policy_loss`.

| method           | reference for the clip (prox)      | discrepancy correction on prox/mu  |
|------------------|------------------------------------|------------------------------------|
| ppo              | mu (clip on pi_theta/mu)           | none (d = 1)                       |
| grpo             | mu, group-normalised advantages    | none                               |
| decoupled_ppo    | recompute at current version       | weight min(d, 5)                   |
| tis              | recompute                          | weight min(d, 2)                   |
| icepop           | recompute                          | mask 1[0.5 <= d <= 2]              |
| linear_prox      | linear proxy (alpha = (k-1)/k)     | weight min(d, 5)                   |
| loglinear_prox   | log-linear proxy                   | weight min(d, 5)                   |
| snapshot, old_logit_model, interrupt_sync | exact pi_old, EWMA where missing | weight + mask |
| ppo_ewma         | EWMA policy (PPO-EWMA)             | weight min(d, 5) and mask          |
| gspo             | mu, sequence ratio                 | none                               |
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from protocol import OldLogitRoute

Proxy = Literal["behav", "recompute", "linear_prox", "loglinear_prox", "ewma"]


class LossConfig(BaseModel):
    """Everything the policy loss needs to know; defaults are plain PPO on pi_theta/mu."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    method: str = "ppo"
    """Name of the preset this config came from (informational, reported in metrics and logs)."""
    policy_loss: Literal["ppo_clip", "gspo"] = "ppo_clip"
    """Token-ratio PPO clip, or GSPO's length-normalised sequence ratio."""
    proxy: Proxy = "behav"
    """Reference for tokens without exact old logits: mu, recompute, linear/log-linear proxy, EWMA."""
    oldlogit_route: OldLogitRoute = "none"
    """Exact pi_old route; when not "none" the learner must pass old log-probs (NaN where missing)."""
    eps_low: float = Field(0.2, gt=0.0, lt=1.0)
    """Lower clip: the ratio is clipped at 1 - eps_low."""
    eps_high: float = Field(0.2, gt=0.0)
    """Upper clip: the ratio is clipped at 1 + eps_high (> eps_low is DAPO's clip-higher)."""
    dual_clip: float | None = Field(None, gt=1.0)
    """Dual clip c for negative advantages (loss capped at -c A); None disables it."""
    behav_weight_cap: float | None = Field(None, gt=0.0)
    """Cap C of the truncated weight min(prox/mu, C); None applies no weight."""
    discrepancy_mask: bool = False
    """Zero the loss where prox/mu leaves [mask_low, mask_high] (IcePop / masked IS)."""
    mask_low: float = Field(0.5, ge=0.0)
    """Lower bound of the discrepancy mask (its kept fraction is reported even when not applied)."""
    mask_high: float = Field(2.0, gt=0.0)
    """Upper bound of the discrepancy mask."""
    level: Literal["token", "seq_product", "seq_geomean"] = "token"
    """Where the discrepancy ratio is formed: per token, sequence product, sequence geometric mean."""
    aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"] = "token_mean"
    """Loss denominator; token_mean divides by the global token count of the optimizer batch."""
    advantage: Literal["grpo", "rloo", "reinforce"] = "grpo"
    """Advantage estimator applied to the rewards before the loss (see trainer.algorithm.advantages)."""
    kl_coef: float = Field(0.0, ge=0.0)
    """Weight of the KL penalty against the frozen reference policy (version 0: the model folder, or
    the base model with the LoRA adapter switched off), added to the loss as
    ``kl_coef * aggregate(k(logp - ref_logprobs))`` over the loss tokens with the loss's own
    denominator (verl's ``use_kl_loss``); 0 turns it off and the reference is never scored."""
    kl_reward_coef: float = Field(0.0, ge=0.0)
    """Weight of the KL penalty in the reward (verl's ``use_kl_in_reward`` with a fixed
    coefficient): each sequence's reward becomes ``r - kl_reward_coef * sum_t (log mu_t - log
    pi_ref_t)`` over its loss tokens (mu: the behaviour policy that sampled them; pi_ref: the frozen
    reference of ``kl_coef``), before its group's advantages
    (:func:`trainer.algorithm.losses.kl_in_reward`). A group of equal task rewards then carries the
    KL differences, but dynamic sampling judges the task rewards. 0 turns it off."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token estimator of KL(pi_theta || pi_ref) from x = log pi_theta - log pi_ref
    (Schulman 2020, "Approximating KL divergence"): k1 = x, k2 = x^2 / 2, k3 = e^-x - 1 + x (the
    "low-variance" form, verl's ``low_var_kl``). See :func:`trainer.algorithm.losses.kl_penalty` for
    the gradient each one gives."""
    entropy_coef: float = Field(0.0, ge=0.0)
    """Weight of the entropy bonus: the loss subtracts ``entropy_coef * aggregate(H_t)`` with H_t
    the entropy (nats) of the policy's next-token distribution at each loss token, computed chunked
    from the training forward (verl's ``entropy_coeff``); 0 turns it off. With ``entropy_target``
    it is the adaptive coefficient's starting value."""
    entropy_target: float = Field(0.0, ge=0.0)
    """Adaptive entropy control (nats; 0 turns it off): after every version the entropy coefficient
    moves by ``entropy_coef_delta``, up when the step's mean entropy was below this target and down
    otherwise, within ``[0, entropy_coef_max]`` (the rule of Skywork-OR1, He et al. 2025), and the
    bonus stays on at the current coefficient (:mod:`trainer.algorithm.entropy_control`). The
    coefficient in use is ``entropy_coef`` in the step's metrics."""
    entropy_coef_delta: float = Field(0.002, gt=0.0)
    """How much the adaptive entropy coefficient moves per version."""
    entropy_coef_max: float = Field(0.05, ge=0.0)
    """The adaptive entropy coefficient's ceiling."""
    entropy_coef_backoff: float | None = Field(None, gt=0.0, lt=1.0)
    """Above the target, multiply the adaptive coefficient by this factor (e.g. 0.5: halve it)
    instead of subtracting ``entropy_coef_delta``, so the control lets go of an entropy that
    overshoots faster than it grips one that falls (additive increase, multiplicative decrease);
    unset: subtract."""
    entropy_smoothing: float = Field(0.0, ge=0.0, lt=1.0)
    """Weight of the earlier versions in the entropy the adaptive control reads: an exponential
    moving average ``s * previous + (1 - s) * last version's mean entropy``; 0 reads the last
    version's alone (one batch's entropy is noisy: 16 samples of ~10 tokens swing by 0.8 nats
    between consecutive SmolLM2 versions)."""

    @model_validator(mode="after")
    def _check(self) -> LossConfig:
        if self.mask_low >= self.mask_high:
            raise ValueError(f"mask_low ({self.mask_low}) must be < mask_high ({self.mask_high})")
        if self.dual_clip is not None and self.dual_clip <= 1 + self.eps_high:
            raise ValueError(f"dual_clip ({self.dual_clip}) must be > 1 + eps_high ({1 + self.eps_high})")
        if self.policy_loss == "gspo" and self.dual_clip is not None:
            raise ValueError("dual_clip is not defined for policy_loss='gspo'")
        return self

    @property
    def kl_penalty(self) -> bool:
        """Whether a KL penalty to the frozen reference is on: ``kl_coef`` in the loss or
        ``kl_reward_coef`` in the reward; either needs the reference's log-probs."""
        return self.kl_coef > 0 or self.kl_reward_coef > 0


_EXACT = {"proxy": "ewma", "behav_weight_cap": 5.0, "discrepancy_mask": True}

METHODS: dict[str, dict[str, Any]] = {
    "ppo": {"advantage": "rloo"},
    "grpo": {"advantage": "grpo"},
    "decoupled_ppo": {"proxy": "recompute", "behav_weight_cap": 5.0},
    "tis": {"proxy": "recompute", "behav_weight_cap": 2.0},
    "icepop": {"proxy": "recompute", "discrepancy_mask": True},
    "linear_prox": {"proxy": "linear_prox", "behav_weight_cap": 5.0},
    "loglinear_prox": {"proxy": "loglinear_prox", "behav_weight_cap": 5.0},
    "snapshot": {**_EXACT, "oldlogit_route": "snapshot"},
    "old_logit_model": {**_EXACT, "oldlogit_route": "old_logit_model"},
    "interrupt_sync": {**_EXACT, "oldlogit_route": "interrupt_sync"},
    "ppo_ewma": {"proxy": "ewma", "behav_weight_cap": 5.0, "discrepancy_mask": True},
    "gspo": {"policy_loss": "gspo", "eps_low": 3e-4, "eps_high": 4e-4, "aggregation": "seq_mean_token_mean"},
}
"""Named methods as field presets over :class:`LossConfig` defaults. "ppo" uses the leave-one-out
baseline because vintage has no critic; every method can take any advantage estimator by override."""


def loss_config(method: str, **overrides: Any) -> LossConfig:
    """The :class:`LossConfig` of a named method, with field overrides; unknown names raise."""
    if method not in METHODS:
        raise ValueError(f"unknown loss method={method!r}; expected one of {sorted(METHODS)}")
    return LossConfig(**{"method": method, **METHODS[method], **overrides})


class EwmaConfig(BaseModel):
    """PPO-EWMA proximal model (trainer.algorithm.ewma.EwmaProximal).

    Decay: the EWMA's mean lag is beta / (1 - beta) versions. "window" sets beta = W / (W + 2),
    a mean lag of W / 2, the mean staleness of tokens spread evenly over [0, W] (W = max_staleness);
    "lag" sets beta = s / (1 + s) from the measured mean version lag s, a mean lag of s; "fixed"
    uses ``beta`` as given.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    beta_source: Literal["window", "lag", "fixed"] = "window"
    """Where the decay comes from: staleness window, measured mean lag, or a fixed beta."""
    window: float = Field(2.0, ge=0.0)
    """Staleness window W for beta = W / (W + 2), in versions; the job sets it to max_staleness. The
    EWMA folds the weights in after every optimizer step, so with S optimizer steps per version
    (``learner.ppo_epochs * learner.ppo_mini_batches``) every source's mean lag of s versions
    (W / 2 here) becomes s * S + (S - 1) / 2 optimizer steps, the last term the lag inside a batch
    (``trainer.algorithm.ewma.step_beta``)."""
    initial_lag: float = Field(1.0, ge=0.0)
    """Mean lag assumed by the "lag" source until the first measurement arrives."""
    beta: float = Field(0.5, ge=0.0, lt=1.0)
    """Decay per version of the "fixed" source (a mean lag of beta / (1 - beta) versions), turned into
    a decay per optimizer step like the other sources'."""
    reset_tau: float = Field(0.5, ge=0.0, le=1.0)
    """Reset the EWMA to the current weights when the discrepancy mask on pi_ewma/mu keeps less than
    this fraction of valid tokens: below one half, the EWMA has drifted from what the rollouts sampled
    more than the mask tolerates, and its reference would discard most of the batch."""
    device: str = "cpu"
    """Where the fp32 EWMA copy lives; host memory by default, so it costs no accelerator memory."""
    probe_every: int = Field(4, ge=0)
    """The EWMA forward runs only on micro-batches holding a sampled token without exact old logits.
    So that the auto-reset signal stays measured when every token is exact, the forward still runs on
    the first micro-batch of every ``probe_every``-th step (step versions 0, k, 2k, ...; 0: never);
    on other steps without such tokens ``ewma_kept_frac`` is NaN and the EWMA does not reset."""

    def probes(self, version: int) -> bool:
        """Whether the step at ``version`` runs the probe forward (every ``probe_every``-th version
        from 0; never when ``probe_every`` is 0). Example: ``probe_every`` 4 -> versions 0, 4, 8."""
        return self.probe_every > 0 and version % self.probe_every == 0
