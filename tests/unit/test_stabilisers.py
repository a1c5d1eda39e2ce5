"""The stabilisers beside the correction: KL to a frozen reference, entropy bonus, learning-rate
schedule, shuffled mini-batches. Hand-worked values."""

import math
from dataclasses import replace

import pytest
import torch

from modelkit.scoring import sequence_logprobs_and_entropy
from trainer.algorithm.batch import Batch, pass_order, shuffled_rows
from trainer.algorithm.entropy_control import EntropyControl, adaptive_entropy_coef, smoothed_entropy
from trainer.algorithm.loss_config import loss_config
from trainer.algorithm.losses import (
    K3_MAX,
    compute_policy_loss,
    kl_in_reward,
    kl_penalty,
    regularisers,
)
from trainer.learner.reference import require_reference_logprobs, with_kl_reward_penalty
from trainer.learner.schedule import lr_multiplier


def t(values, grad=False):
    return torch.tensor(values, dtype=torch.float32, requires_grad=grad)


# ---- KL penalty ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("estimator", "value", "grad"), [
    ("k1", 0.5, 1.0),  # d/dx x = 1
    ("k2", 0.125, 0.5),  # d/dx x^2/2 = x
    ("k3", math.exp(-0.5) - 1 + 0.5, 1 - math.exp(-0.5)),  # d/dx (e^-x - 1 + x) = 1 - e^-x
])  # fmt: skip
def test_kl_forms_at_a_log_ratio_of_one_half(estimator, value, grad):
    """log pi_theta - log pi_ref = 0.5: k1 = 0.5, k2 = 0.125, k3 = 0.106531; the gradient with respect
    to log pi_theta is 1, x = 0.5 and 1 - e^-0.5 = 0.393469 (k2's expectation under pi_theta is the
    reverse KL's gradient, k3's the forward KL's, k1's is zero)."""
    logp = t([[-1.0, -7.0]], grad=True)
    ref = t([[-1.5, -1.0]])
    per_token = kl_penalty(logp, ref, t([[1, 0]]), estimator)
    assert per_token[0, 0].item() == pytest.approx(value, abs=1e-6)
    assert per_token[0, 1].item() == 0.0  # masked: no value, no gradient
    per_token.sum().backward()
    assert logp.grad.tolist()[0] == pytest.approx([grad, 0.0], abs=1e-6)


def test_k3_is_capped_where_the_reference_is_far_above_the_policy():
    """x = -20: e^20 - 21 ~ 4.85e8 would dominate every other token; k3 is capped at 10 nats."""
    assert kl_penalty(t([[-21.0]]), t([[-1.0]]), t([[1]]), "k3").item() == K3_MAX


def test_the_kl_term_adds_coef_times_its_token_mean_and_kl_ref_is_reported():
    """Two loss tokens with x = 0.5 and 0: k3 = 0.106531 and 0, token mean 0.053265; with
    kl_coef 0.1 the loss is the policy loss + 0.0053265; with A = 0 the policy loss is 0, so the
    loss is the KL term alone, and its gradient on the first token 0.1 * (1 - e^-0.5) / 2."""
    logp = t([[-1.0, -2.0]], grad=True)
    ref = t([[-1.5, -2.0]])
    cfg = loss_config("grpo", kl_coef=0.1)
    loss, m = compute_policy_loss(logp, logp.detach(), t([0.0]), t([[1, 1]]), cfg, ref_logprobs=ref)
    k3 = math.exp(-0.5) - 1 + 0.5
    assert loss.item() == pytest.approx(0.1 * k3 / 2, abs=1e-7)
    assert m["kl_ref"] == pytest.approx(k3 / 2, abs=1e-6) and m["kl_loss"] == pytest.approx(k3 / 2, abs=1e-6)
    loss.backward()
    assert logp.grad.tolist()[0] == pytest.approx([0.1 * (1 - math.exp(-0.5)) / 2, 0.0], abs=1e-7)


def test_a_kl_penalty_without_reference_log_probs_is_refused():
    cfg = loss_config("grpo", kl_coef=0.1)
    with pytest.raises(ValueError, match=r"^loss.kl_coef = 0.1 needs ref_logprobs"):
        regularisers(t([[-1.0]]), t([[1]]), cfg)


def test_the_kl_of_the_reward_sums_log_mu_minus_log_ref_over_the_loss_tokens():
    nan = math.nan
    mu = torch.tensor([[nan, -1.0, -2.0], [nan, -0.5, nan], [nan, -3.0, -0.2]])
    ref = torch.tensor([[-9.0, -1.5, -1.0], [-9.0, -1.0, -9.0], [-9.0, -3.0, -0.2]])
    mask = torch.tensor([[False, True, True], [False, True, False], [False, True, True]])
    # 0.5 - 1.0; 0.5 (its padding slot counts 0); 0 where mu = ref
    assert kl_in_reward(mu, ref, mask).tolist() == pytest.approx([-0.5, 0.5, 0.0])


def test_rewards_lowered_by_the_kl_penalty_give_the_group_its_new_advantages():
    """Rewards [1, 0, 0] of one group, KL [-0.5, 0.5, 0], coefficient 0.2: [1.1, -0.1, 0.0], mean
    1/3, population std 0.543650: advantages [1.410221, -0.797081, -0.613139] on the loss tokens;
    a row with a sender's baseline 0.5 gets its reward minus 0.5."""
    mask = torch.tensor([[False, True, True], [False, True, False], [False, True, True], [False, True, True]])
    b = Batch(
        token_ids=torch.ones(4, 3, dtype=torch.long), attention_mask=torch.ones(4, 3, dtype=torch.long),
        loss_mask=mask, behav_logprobs=torch.zeros(4, 3), advantages=torch.zeros(4, 3),
        rewards=torch.tensor([1.0, 0.0, 0.0, 0.9]), group_index=torch.tensor([0, 0, 0, 1]),
        baselines=torch.tensor([math.nan, math.nan, math.nan, 0.5]),
    )  # fmt: skip
    kl = torch.tensor([-0.5, 0.5, 0.0, 1.0])
    out = b.with_rewards(b.rewards - 0.2 * kl, "grpo")
    want = [1.410221, -0.797081, -0.613139, 0.2]  # the last: 0.9 - 0.2 - 0.5
    assert out.rewards.tolist() == pytest.approx([1.1, -0.1, 0.0, 0.7])
    assert out.seq_advantages.tolist() == pytest.approx(want, abs=1e-6)
    assert out.advantages[:, 1].tolist() == pytest.approx(want, abs=1e-6)
    assert out.advantages[1, 2] == 0.0 and out.advantages[:, 0].tolist() == [0.0] * 4  # off the loss tokens
    with pytest.raises(ValueError, match=r"rewards: shape \(3,\) != \(4,\)"):
        b.with_rewards(torch.zeros(3))


def test_the_reward_penalty_lowers_each_reward_by_its_kl_and_reports_the_means():
    """Two sequences of one group, rewards [1, 0], log mu - log ref summed over their loss tokens
    0.5 and 1.5 nats, coefficient 0.1: rewards [0.95, -0.15]; kl_reward the mean 1.0, the mean
    penalty 0.1; GRPO advantages +-1 (two values, population std 0.55). Coefficient 0: unchanged."""
    b = Batch(
        token_ids=torch.ones(2, 2, dtype=torch.long), attention_mask=torch.ones(2, 2, dtype=torch.long),
        loss_mask=torch.tensor([[True, True], [True, False]]), behav_logprobs=torch.tensor([[-1.0, -1.0], [-0.5, 0.0]]),
        advantages=torch.zeros(2, 2), rewards=torch.tensor([1.0, 0.0]), group_index=torch.tensor([0, 0]),
        ref_logprobs=torch.tensor([[-1.25, -1.25], [-2.0, 0.0]]),
    )  # fmt: skip
    out, m = with_kl_reward_penalty(b, 0.1, "grpo")
    assert out.rewards.tolist() == pytest.approx([0.95, -0.15])
    assert m == pytest.approx({"kl_reward": 1.0, "kl_reward_penalty": 0.1})
    assert out.seq_advantages.tolist() == pytest.approx([1.0, -1.0], abs=1e-5)
    same, none = with_kl_reward_penalty(b, 0.0, "grpo")
    assert same is b and none == {}


def test_reference_logprobs_a_batch_brings_must_cover_every_loss_token():
    """One loss token of three without a finite reference log-prob (a NaN on a loss token; the NaN
    off the loss mask does not count) is refused with the count and the version."""
    b = Batch(
        token_ids=torch.ones(2, 2, dtype=torch.long), attention_mask=torch.ones(2, 2, dtype=torch.long),
        loss_mask=torch.tensor([[True, True], [True, False]]), behav_logprobs=torch.zeros(2, 2),
        advantages=torch.zeros(2, 2), consuming_version=3,
        ref_logprobs=torch.tensor([[-1.0, math.nan], [-2.0, math.nan]]),
    )  # fmt: skip
    with pytest.raises(ValueError, match="ref_logprobs: 1 loss tokens of the batch at version 3 came without"):
        require_reference_logprobs(b)
    require_reference_logprobs(replace(b, ref_logprobs=torch.tensor([[-1.0, -1.0], [-2.0, math.nan]])))


def test_no_regulariser_leaves_the_policy_loss_bit_for_bit():
    logp = t([[-1.0, -2.0]], grad=True)
    mu = t([[-1.2, -1.9]])
    plain, _ = compute_policy_loss(logp, mu, t([1.0]), t([[1, 1]]), loss_config("ppo"))
    with_ref, m = compute_policy_loss(logp, mu, t([1.0]), t([[1, 1]]), loss_config("ppo"), ref_logprobs=mu)
    assert plain.item() == with_ref.item() and "kl_loss" not in m and "kl_ref" in m


# ---- entropy bonus ------------------------------------------------------------------------------


class _Uniform(torch.nn.Module):
    """A 'model' whose logits are a learnable ``[V]`` vector at every position (for scoring tests)."""

    def __init__(self, logits):
        super().__init__()
        self.logits = torch.nn.Parameter(torch.tensor(logits))

    def forward(self, input_ids, attention_mask, logits_to_keep=0, **_):
        b, t_ = input_ids.shape
        n = logits_to_keep or t_
        return type("Out", (), {"logits": self.logits.expand(b, n, -1)})()


def test_entropy_of_a_uniform_distribution_over_four_tokens_and_its_gradient():
    """Uniform over 4 tokens: H = log 4 = 1.386294 nats; at the uniform point H is at its maximum,
    so its gradient with respect to the logits is 0; the no-gradient path gives the same value."""
    model = _Uniform([0.0, 0.0, 0.0, 0.0])
    ids, mask = torch.tensor([[0, 1, 2]]), torch.ones(1, 3, dtype=torch.long)
    _, ent = sequence_logprobs_and_entropy(model, ids, mask, 1.0, chunk_bytes=0, entropy_grad=True)
    assert ent[0, 1:].tolist() == pytest.approx([math.log(4)] * 2, abs=1e-6)
    ent[0, 1:].sum().backward()
    assert model.logits.grad.abs().max().item() == pytest.approx(0.0, abs=1e-6)
    _, plain = sequence_logprobs_and_entropy(model, ids, mask, 1.0, chunk_bytes=0)
    assert not plain.requires_grad and plain[0, 1].item() == pytest.approx(math.log(4), abs=1e-6)


def test_the_entropy_bonus_subtracts_coef_times_the_token_mean_entropy():
    """Two tokens with H = 1.0 and 0.5 nats, entropy_coef 0.01, A = 0: loss = -0.01 * 0.75 = -0.0075,
    and d loss / d H_t = -0.01 / 2 per token."""
    logp = t([[-1.0, -2.0]], grad=True)
    ent = t([[1.0, 0.5]], grad=True)
    cfg = loss_config("grpo", entropy_coef=0.01)
    loss, m = compute_policy_loss(logp, logp.detach(), t([0.0]), t([[1, 1]]), cfg, entropy=ent)
    assert loss.item() == pytest.approx(-0.0075, abs=1e-8) and m["entropy_loss"] == pytest.approx(0.75)
    loss.backward()
    assert ent.grad.tolist()[0] == pytest.approx([-0.005, -0.005], abs=1e-9)


# ---- learning-rate schedule ---------------------------------------------------------------------


def test_cosine_schedule_with_warm_up_and_floor_at_chosen_steps():
    """Warm-up 2, decay to step 10, floor 0.1: steps 0, 1 -> 1/3, 2/3 (warm-up); step 2 -> 1; step 6
    is half-way (p = 0.5): 0.1 + 0.9 * (1 + cos(pi/2)) / 2 = 0.55; step 10 and after -> 0.1."""
    m = [lr_multiplier(s, "cosine", 2, 10, 0.1) for s in (0, 1, 2, 6, 10, 50)]
    assert m == pytest.approx([1 / 3, 2 / 3, 1.0, 0.55, 0.1, 0.1], abs=1e-12)


def test_linear_and_constant_schedules():
    """Linear from step 0 to 4 without floor: 1, 0.75, 0.5, 0.25, 0; constant stays 1 after warm-up."""
    assert [lr_multiplier(s, "linear", 0, 4, 0.0) for s in range(5)] == pytest.approx([1, 0.75, 0.5, 0.25, 0])
    assert [lr_multiplier(s, "constant", 1, None, 0.0) for s in range(3)] == [0.5, 1.0, 1.0]


def test_a_schedule_refuses_bad_settings_naming_the_field():
    with pytest.raises(ValueError, match="learner.lr_schedule"):
        lr_multiplier(0, "step", 0, 4, 0.0)
    with pytest.raises(ValueError, match="learner.lr_decay_steps"):
        lr_multiplier(3, "cosine", 0, None, 0.0)
    with pytest.raises(ValueError, match="learner.lr_min_ratio"):
        lr_multiplier(0, "linear", 0, 4, 1.5)


# ---- shuffled mini-batches ----------------------------------------------------------------------


def test_a_shuffled_order_from_a_fixed_seed():
    """The order is a function of (seed, version, epoch) alone: the same on every call (every rank,
    a resumed run), another one for the next epoch."""
    assert shuffled_rows(4, 0, 0, 0) == [0, 1, 3, 2]
    assert shuffled_rows(8, 3, 5, 1) == shuffled_rows(8, 3, 5, 1)
    assert sorted(shuffled_rows(8, 3, 5, 1)) == list(range(8))
    assert shuffled_rows(8, 3, 5, 1) != shuffled_rows(8, 3, 5, 2)


def test_a_pass_takes_the_shuffled_order_only_with_two_mini_batches_or_more():
    """Rows 10, 11, 12, 13 at version 0, seed 0: pass 0 with 2 mini-batches reads rows
    [0, 1, 3, 2] (:func:`shuffled_rows`), so rewards [10, 11, 13, 12]; one mini-batch, or shuffle
    off, keeps the batch itself."""
    b = Batch(
        token_ids=torch.ones(4, 2, dtype=torch.long), attention_mask=torch.ones(4, 2, dtype=torch.long),
        loss_mask=torch.ones(4, 2, dtype=torch.bool), behav_logprobs=torch.zeros(4, 2),
        advantages=torch.zeros(4, 2), rewards=torch.tensor([10.0, 11.0, 12.0, 13.0]),
    )  # fmt: skip
    assert pass_order(b, 0, 0, 2, True).rewards.tolist() == [10.0, 11.0, 13.0, 12.0]
    assert pass_order(b, 0, 0, 1, True) is b and pass_order(b, 0, 0, 2, False) is b


# ---- adaptive entropy control -------------------------------------------------------------------


def test_adaptive_entropy_coefficient_steps_toward_the_target_within_its_bounds():
    """delta 0.002, ceiling 0.05, target 0.5 nats: below the target the coefficient rises, above it
    falls, never below 0 nor above the ceiling; a step without a finite entropy leaves it."""
    assert adaptive_entropy_coef(0.004, 0.3, 0.5, 0.002, 0.05) == pytest.approx(0.006)
    assert adaptive_entropy_coef(0.004, 0.7, 0.5, 0.002, 0.05) == pytest.approx(0.002)
    assert adaptive_entropy_coef(0.001, 0.7, 0.5, 0.002, 0.05) == 0.0
    assert adaptive_entropy_coef(0.049, 0.1, 0.5, 0.002, 0.05) == 0.05
    assert adaptive_entropy_coef(0.5, 0.5, 0.5, 0.002, 0.05) == 0.05  # at the target: down, and clipped
    assert adaptive_entropy_coef(0.004, math.nan, 0.5, 0.002, 0.05) == 0.004


def test_the_entropy_bonus_stays_on_above_the_target_while_its_coefficient_falls():
    """Target 0.5, start 0.03, delta 0.01: entropies 0.4, 0.8, 0.8, 0.8, 0.8 move the coefficient
    0.03 -> 0.04 -> 0.03 -> 0.02 -> 0.01 -> 0; each version trains with the coefficient before its
    move, so the bonus is on (0.04, 0.03, ...) after versions whose entropy was above the target."""
    ctl = EntropyControl(loss_config("grpo", entropy_coef=0.03, entropy_target=0.5, entropy_coef_delta=0.01))
    used = []
    for entropy in (0.4, 0.8, 0.8, 0.8, 0.8):
        used.append(ctl.loss_config().entropy_coef)
        ctl.after_version(entropy)
    assert used == pytest.approx([0.03, 0.04, 0.03, 0.02, 0.01]) and ctl.coef == 0.0
    assert ctl.loss_config().entropy_coef == 0.0
    resumed = EntropyControl(ctl.cfg)
    resumed.load_state_dict({"coef": 0.02})
    assert resumed.loss_config().entropy_coef == 0.02 and resumed.entropy is None


def test_a_backoff_halves_the_coefficient_above_the_target_and_adds_below():
    """Target 0.5, delta 0.002, ceiling 0.05, backoff 0.5: coef 0.04 with entropy 0.7 -> 0.02 (not
    0.038), 0.02 with 0.3 -> 0.022, 0.004 with 0.5 (at the target) -> 0.002."""
    assert adaptive_entropy_coef(0.04, 0.7, 0.5, 0.002, 0.05, 0.5) == pytest.approx(0.02)
    assert adaptive_entropy_coef(0.02, 0.3, 0.5, 0.002, 0.05, 0.5) == pytest.approx(0.022)
    assert adaptive_entropy_coef(0.004, 0.5, 0.5, 0.002, 0.05, 0.5) == pytest.approx(0.002)


def test_the_smoothed_entropy_is_an_exponential_moving_average_started_by_the_first_version():
    """Smoothing 0.5: None then 1.0 -> 1.0; then 0.2 -> 0.6; then NaN leaves 0.6; smoothing 0 reads
    the last version alone."""
    assert smoothed_entropy(None, 1.0, 0.5) == 1.0
    assert smoothed_entropy(1.0, 0.2, 0.5) == pytest.approx(0.6)
    assert smoothed_entropy(0.6, math.nan, 0.5) == 0.6
    assert smoothed_entropy(None, math.nan, 0.5) is None
    assert smoothed_entropy(0.6, 0.2, 0.0) == 0.2


def test_the_control_reads_the_smoothed_entropy_and_resumes_it_from_its_state():
    """Target 0.8, start 0, delta 0.03, ceiling 0.3, backoff 0.5, smoothing 0.5; version entropies
    0.4, 1.6, 1.6, 0.2: smoothed 0.4, 1.0, 1.3, 0.75 -> coefficients 0.03, 0.015, 0.0075, 0.0375.
    The single reading 1.6 after 0.4 halves once, where the last version alone would have read two
    crossings. A resumed control continues from the saved smoothed entropy."""
    cfg = loss_config(
        "grpo", entropy_target=0.8, entropy_coef_delta=0.03, entropy_coef_max=0.3, entropy_coef_backoff=0.5,
        entropy_smoothing=0.5,
    )  # fmt: skip
    ctl, coefs, smoothed = EntropyControl(cfg), [], []
    for entropy in (0.4, 1.6, 1.6, 0.2):
        ctl.after_version(entropy)
        coefs.append(ctl.coef)
        smoothed.append(ctl.entropy)
    assert smoothed == pytest.approx([0.4, 1.0, 1.3, 0.75])
    assert coefs == pytest.approx([0.03, 0.015, 0.0075, 0.0375])
    resumed = EntropyControl(cfg)
    resumed.load_state_dict(ctl.state_dict())
    resumed.after_version(1.25)  # smoothed (0.75 + 1.25) / 2 = 1.0, above: halve
    assert resumed.entropy == pytest.approx(1.0) and resumed.coef == pytest.approx(0.01875)
