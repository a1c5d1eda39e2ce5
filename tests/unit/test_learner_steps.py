"""combine_step_metrics: one learner step's metrics from its optimizer steps' (hand-worked)."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.algorithm.loss_config import loss_config
from trainer.algorithm.losses import proxy_diagnostics
from trainer.learner.ranks import all_reduce_floats, gather_rows, micro_batch_count
from trainer.learner.settings import LearnerSettings
from trainer.learner.steps import combine_step_metrics, reads_taken_recompute, reduce_metrics


def step(tokens, applied=1.0, **kw):
    base = {"tokens": tokens, "applied": applied, "grad_norm": 1.0, "ewma_kept_frac": math.nan, "loss": 0.0}
    return {**base, **kw}


def test_token_weighted_means_extremes_sums_and_clip_shares():
    a = step(10, loss=0.4, clip_frac_high=0.1, clip_frac_low=0.0, ratio_max=1.0, ratio_min=1.0, grad_norm=2.0,
             forward_loss_s=0.5, backward_s=1.0, micro_batches=2, pg_weight=1.0, pg_weight_clipped=0.0,
             proxy_err_sum=0.5, proxy_err_tokens=10, ewma_reset=0.0)  # fmt: skip
    b = step(30, loss=0.0, clip_frac_high=0.3, clip_frac_low=0.1, ratio_max=1.6, ratio_min=0.7, grad_norm=4.0,
             forward_loss_s=1.0, backward_s=1.5, micro_batches=2, pg_weight=2.0, pg_weight_clipped=1.0,
             proxy_err_sum=1.5, proxy_err_tokens=30, ewma_reset=1.0)  # fmt: skip
    out = combine_step_metrics([a, b])
    assert out["loss"] == pytest.approx((0.4 * 10 + 0.0 * 30) / 40)  # 0.1
    assert out["clip_frac_high"] == pytest.approx(0.25) and out["clip_frac_low"] == pytest.approx(0.075)
    assert out["clip_frac_step_max"] == pytest.approx(0.4)  # step b: 0.3 + 0.1
    assert (out["ratio_max"], out["ratio_min"]) == (1.6, 0.7)
    assert out["grad_norm"] == 3.0 and out["grad_norm_max"] == 4.0
    assert (out["forward_loss_s"], out["backward_s"], out["micro_batches"]) == (1.5, 2.5, 4.0)
    # 30 x 1.0 / (10 x 1.0 + 30 x 2.0) = 30 / 70 of the gradient weight sat on clipped tokens
    assert out["clip_grad_removed_frac"] == pytest.approx(3 / 7)
    assert out["proxy_abs_err"] == pytest.approx(2.0 / 40) and out["proxy_err_tokens"] == 40
    assert out["ewma_reset"] == 1.0 and math.isnan(out["ewma_kept_frac"])
    assert (out["optimizer_steps"], out["optimizer_steps_total"]) == (2.0, 2.0)
    assert "tokens" not in out and "applied" not in out and "proxy_err_sum" not in out


def test_skipped_steps_leave_the_gradient_norm_out():
    out = combine_step_metrics([step(8, applied=0.0, grad_norm=math.nan), step(8, grad_norm=5.0, ewma_kept_frac=0.9)])
    assert out["grad_norm"] == 5.0 and out["optimizer_steps"] == 1.0 and out["ewma_kept_frac"] == 0.9
    none = combine_step_metrics([step(8, applied=0.0, grad_norm=math.nan)])
    assert math.isnan(none["grad_norm"]) and math.isnan(none["grad_norm_max"]) and none["optimizer_steps"] == 0.0
    assert math.isnan(none["proxy_abs_err"]) and none["clip_grad_removed_frac"] == 0.0


def test_a_single_step_passes_its_metrics_through():
    out = combine_step_metrics([step(12, loss=-0.25, clip_frac_high=0.5, entropy=1.25)])
    assert out["loss"] == -0.25 and out["clip_frac_high"] == 0.5 and out["entropy"] == 1.25
    assert out["clip_frac_step_max"] == 0.5


def test_steps_without_tokens_take_plain_means():
    out = combine_step_metrics([step(0, entropy=1.0), step(0, entropy=2.0)])
    assert out["entropy"] == 1.5


def test_a_step_without_loss_tokens_leaves_the_extremes_alone():
    """A mini-batch whose rows carry no loss token reports ratio and discrepancy extremes of 0 (no
    ratio at all); the batch's extremes come from the steps that had tokens: 0.7 and 1.6, not 0."""
    empty = step(0, loss=0.0, ratio_max=0.0, ratio_min=0.0, discrepancy_min=0.0, discrepancy_max=0.0)
    full = step(20, loss=0.1, ratio_max=1.6, ratio_min=0.7, discrepancy_min=0.9, discrepancy_max=1.2)
    out = combine_step_metrics([empty, full])
    assert (out["ratio_min"], out["ratio_max"], out["discrepancy_min"], out["discrepancy_max"]) == (0.7, 1.6, 0.9, 1.2)
    none = combine_step_metrics([empty])
    assert math.isnan(none["ratio_min"]) and math.isnan(none["ratio_max"])


def test_micro_batch_count_is_the_largest_ranks_share_and_at_least_one():
    """10 rows, 2 ranks, micro-batch 4: 5 rows on the larger rank -> 2; 0 rows -> 1; 8 rows, 1 rank,
    micro-batch 4 -> 2; 9 -> 3."""
    assert micro_batch_count(10, 2, 4) == 2
    assert micro_batch_count(0, 2, 4) == 1
    assert [micro_batch_count(n, 1, 4) for n in (8, 9)] == [2, 3]


def test_with_one_rank_the_collectives_are_the_identity():
    values = torch.tensor([[1.0, math.nan]])
    assert all_reduce_floats([1.5, 2.0], 1, "max") == [1.5, 2.0]
    assert gather_rows(values, 1) is values


def test_reduce_metrics_gives_token_weighted_means_and_extremes():
    """One rank: ratio_max with sums [2.5, weight 2, max 1.5, min 1.0] -> 1.5; entropy [3.0, 2, ...]
    -> 3.0 / 2 = 1.5; ratio_min [1.6, 2, 0.9, 0.7] -> 0.7; a metric without weight -> 0."""
    acc = {
        "ratio_max": [2.5, 2.0, 1.5, 1.0], "entropy": [3.0, 2.0, 2.0, 1.0], "ratio_min": [1.6, 2.0, 0.9, 0.7],
        "approx_kl": [0.0, 0.0, -math.inf, math.inf],
    }  # fmt: skip
    out = reduce_metrics(acc, lambda values, op: values)
    assert out == {"ratio_max": 1.5, "entropy": 1.5, "ratio_min": 0.7, "approx_kl": 0.0}


def test_proxy_diagnostics_sum_the_proxy_error_on_exact_tokens_and_the_ewma_keep():
    """Proxy "behav": mu = [-1, -2, -3], exact old [-1.5, -2.5, ?] on the first two loss tokens
    (the third is a loss token without an exact value): err = 0.5 + 0.5 = 1.0 over 2 tokens. The
    EWMA's log-probs [-1, -2, -3 + ln 10] against mu: ratios 1, 1, 10; the band [0.5, 2] keeps 2 of
    the 3 loss tokens."""
    cfg = loss_config("grpo", proxy="behav", mask_low=0.5, mask_high=2.0)
    mu = torch.tensor([[-1.0, -2.0, -3.0]])
    old = torch.tensor([[-1.5, -2.5, math.nan]])
    mask = torch.tensor([[True, True, True]])
    exact = torch.tensor([[True, True, False]])
    ewma = torch.tensor([[-1.0, -2.0, -3.0 + math.log(10.0)]])
    out = proxy_diagnostics(cfg, mu.clone(), mu, old, mask, exact, ewma_logprobs=ewma)
    assert out == pytest.approx({"err": 1.0, "err_n": 2.0, "ewma_keep": 2.0, "ewma_n": 3.0})
    ewma_cfg = loss_config("grpo", proxy="ewma")
    assert proxy_diagnostics(ewma_cfg, mu.clone(), mu, old, mask, exact) == {
        "err": 0.0,
        "err_n": 0.0,
        "ewma_keep": 0.0,
        "ewma_n": 0.0,
    }  # the EWMA proxy without its forward: nothing measured


def test_learner_settings_give_the_scheduled_rate_and_the_deepspeed_config():
    """lr 1e-3, cosine over 10 steps after 2 warm-up steps, floor 0.1: step 0 -> 1e-3 / 3, step 2 ->
    1e-3, step 7 (half way) -> 1e-3 * (0.1 + 0.9 * 0.5) = 0.55e-3. bf16 turns DeepSpeed's bf16 on."""
    s = LearnerSettings(
        model_path="m", lr=1e-3, lr_schedule="cosine", lr_warmup_steps=2, lr_decay_steps=12, lr_min_ratio=0.1,
        dtype="bfloat16", micro_batch_size=4, zero_stage=2, grad_clip=1.0,
    )  # fmt: skip
    assert [s.lr_at(k) for k in (0, 2, 7)] == pytest.approx([1e-3 / 3, 1e-3, 0.55e-3])
    ds = s.deepspeed_config()
    assert ds["train_micro_batch_size_per_gpu"] == 4 and ds["zero_optimization"] == {"stage": 2}
    assert ds["bf16"] == {"enabled": True} and ds["gradient_clipping"] == 1.0


def test_the_rollback_copy_is_kept_only_without_gradient_clipping_unless_asked():
    """``auto``: no copy with clipping (1.0), a copy without (0); ``on`` and ``off`` as they say."""
    s = LearnerSettings(model_path="m")
    assert s.rollback_copy == "auto" and s.grad_clip == 1.0 and not s.keeps_rollback_copy
    assert LearnerSettings(model_path="m", grad_clip=0.0).keeps_rollback_copy
    assert LearnerSettings(model_path="m", rollback_copy="on").keeps_rollback_copy
    assert not LearnerSettings(model_path="m", grad_clip=0.0, rollback_copy="off").keeps_rollback_copy


def test_which_mini_batches_read_the_recompute_taken_before_the_first_step():
    """One pass: the first mini-batch's own forward is at the consuming version, the later ones read
    the reference taken before; several passes: every mini-batch reads it; no recompute: none."""
    assert reads_taken_recompute(3, 1, True) == [False, True, True]
    assert reads_taken_recompute(3, 2, True) == [True, True, True]
    assert reads_taken_recompute(2, 2, False) == [False, False]
