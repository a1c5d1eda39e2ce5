"""The exact oracle of the policy-gradient corrections (benchmarks/oracle.py), against values worked by hand.

The hand-worked case: K = 2 actions with rewards r = (1, 0), lag 1 (two versions), and

    theta_v = (0, ln 4)         pi_old = pi_v = (0.2, 0.8)      the behaviour version, exact
    theta_V = (ln 3, ln 7)      pi_V = (0.3, 0.7)               the learner's current version
    delta   = (ln(14/9), 0)     mu = softmax(theta_v + delta) = (14/9, 4) / (50/9) = (0.28, 0.72)

    A = r - E_mu[r] = (1 - 0.28, 0 - 0.28) = (0.72, -0.28)
    J(pi_V) = 0.3, true gradient dJ/dtheta = pi_V (r - J) = (0.3 * 0.7, 0.7 * -0.3) = (0.21, -0.21)
    d log pi_V(a) / dtheta = e_a - pi_V: a = 0 -> (0.7, -0.7), a = 1 -> (-0.3, 0.3)

Per sample a ~ mu, the update of an unclipped action is g(a) = w(a) r(a) A(a) (e_a - pi_V), where w is
the detached weight on ref/mu and r = pi_V/ref; a clipped action gives g(a) = 0. Clip eps = 0.2.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from benchmarks.oracle import (
    METHODS,
    ewma_logits,
    expected_update,
    gradient_stats,
    main,
    make_problems,
    natural_step,
    per_sample_updates,
    reference_stats,
    true_gradient,
    trust_region,
    version_history,
)

D = torch.float64
LN = math.log


def hand_case():
    """The module docstring's K = 2, lag 1 case as oracle problems."""
    history = torch.tensor([[0.0, LN(4)], [LN(3), LN(7)]], dtype=D)
    delta = torch.tensor([[LN(14 / 9), 0.0]], dtype=D)
    return make_problems(history, [1], delta, torch.tensor([1.0, 0.0], dtype=D))


def test_hand_case_inputs():
    p = hand_case()
    assert p.mu[0].tolist() == pytest.approx([0.28, 0.72], abs=1e-12)
    assert p.advantages[0].tolist() == pytest.approx([0.72, -0.28], abs=1e-12)
    assert true_gradient(p.theta_current, p.rewards)[0].tolist() == pytest.approx([0.21, -0.21], abs=1e-12)


def test_decoupled_ppo_by_hand():
    """Recompute reference ref = pi_V, so r = 1 (no clip), w = min(pi_V/mu, 5) = (0.3/0.28, 0.7/0.72):

    g(0) = (0.3/0.28) * 0.72 * (0.7, -0.7) = (0.54, -0.54)
    g(1) = (0.7/0.72) * -0.28 * (-0.3, 0.3) = (0.0588/0.72, -0.0588/0.72) = (0.081667, -0.081667)
    E_mu[g] = 0.28 * 0.54 + 0.72 * 0.081667 = 0.1512 + 0.0588 = 0.21 -> (0.21, -0.21), the true gradient
    variance = 0.28 * 2 * 0.54^2 + 0.72 * 2 * 0.081667^2 - 2 * 0.21^2 = 0.163296 + 0.009604 - 0.0882 = 0.0847
    """
    p = hand_case()
    g = per_sample_updates("decoupled_ppo", p)[0]
    assert g[0].tolist() == pytest.approx([0.54, -0.54], abs=1e-12)
    assert g[1].tolist() == pytest.approx([0.0588 / 0.72, -0.0588 / 0.72], abs=1e-12)
    assert expected_update("decoupled_ppo", p)[0].tolist() == pytest.approx([0.21, -0.21], abs=1e-12)
    s = gradient_stats("decoupled_ppo", p)
    assert s["bias"].item() == pytest.approx(0.0, abs=1e-12)
    assert s["variance"].item() == pytest.approx(0.0847, abs=1e-12)
    # the reference is pi_V: |log 0.3 - log 0.2| = ln 1.5 = 0.405465 is the larger error against pi_old
    assert reference_stats("decoupled_ppo", p)["ref_err"].item() == pytest.approx(LN(1.5), abs=1e-12)


def test_snapshot_by_hand():
    """Exact reference ref = pi_old = (0.2, 0.8): d = pi_old/mu = (0.2/0.28, 0.8/0.72) = (0.714, 1.111) is
    inside the mask [0.5, 2] and under the cap 5, so w = d; r = pi_V/pi_old = (1.5, 0.875).

    a = 0: A > 0 and r = 1.5 > 1.2 -> clipped, g(0) = 0
    a = 1: A < 0 and r = 0.875 >= 0.8 -> kept, w r = pi_V/mu = 0.7/0.72,
           g(1) = (0.7/0.72) * -0.28 * (-0.3, 0.3) = (0.081667, -0.081667)
    E_mu[g] = 0.72 * 0.081667 = 0.7 * 0.28 * 0.3 = 0.0588 -> (0.0588, -0.0588): 0.28 of the true gradient
    bias = (0.21 - 0.0588) * sqrt(2) = 0.213829, cosine 1
    variance = 0.72 * 2 * 0.081667^2 - 2 * 0.0588^2 = 0.009604 - 0.00691488 = 0.00268912
    """
    p = hand_case()
    g = per_sample_updates("snapshot", p)[0]
    assert g[0].tolist() == [0.0, 0.0]
    assert g[1].tolist() == pytest.approx([0.0588 / 0.72, -0.0588 / 0.72], abs=1e-12)
    assert expected_update("snapshot", p)[0].tolist() == pytest.approx([0.0588, -0.0588], abs=1e-12)
    s = gradient_stats("snapshot", p)
    assert s["bias"].item() == pytest.approx(0.1512 * math.sqrt(2), abs=1e-12)
    assert s["rel_bias"].item() == pytest.approx(0.72, abs=1e-12)
    assert s["cosine"].item() == pytest.approx(1.0, abs=1e-12)
    assert s["variance"].item() == pytest.approx(0.00268912, abs=1e-12)
    st = reference_stats("snapshot", p)
    assert st["ref_err"].item() == pytest.approx(0.0, abs=1e-12)
    assert st["kept"].item() == pytest.approx(1.0, abs=1e-12)


def test_ppo_and_icepop_by_hand():
    """ppo: ref = mu, w = 1, r = pi_V/mu = (1.071, 0.972), both inside [0.8, 1.2]: g is decoupled_ppo's, so
    E_mu[g] = (0.21, -0.21). At lag 1 the proxies have alpha = 0, ref = mu and weight 1: the same.

    icepop: ref = pi_V, no weight, mask on d = pi_V/mu = (1.071, 0.972) keeps both, r = 1:
    g(0) = 0.72 * (0.7, -0.7) = (0.504, -0.504), g(1) = -0.28 * (-0.3, 0.3) = (0.084, -0.084)
    E_mu[g] = 0.28 * 0.504 + 0.72 * 0.084 = 0.14112 + 0.06048 = 0.2016 -> bias 0.0084 * sqrt(2) = 0.011879
    variance = 0.28 * 2 * 0.504^2 + 0.72 * 2 * 0.084^2 - 2 * 0.2016^2 = 0.07112448
    """
    p = hand_case()
    for method in ("ppo", "loglinear_prox", "linear_prox", "tis"):
        assert expected_update(method, p)[0].tolist() == pytest.approx([0.21, -0.21], abs=1e-12), method
    g = per_sample_updates("icepop", p)[0]
    assert g.flatten().tolist() == pytest.approx([0.504, -0.504, 0.084, -0.084], abs=1e-12)
    s = gradient_stats("icepop", p)
    assert s["bias"].item() == pytest.approx(0.0084 * math.sqrt(2), abs=1e-12)
    assert s["variance"].item() == pytest.approx(0.07112448, abs=1e-12)


def test_ewma_reference_by_hand():
    """W = lag = 1 -> beta = 1/3; from theta_v (total 1) one update with theta_V: total' = 1/3 + 1 = 4/3,
    theta_ewma = theta_v * (1/3)/(4/3) + theta_V / (4/3) = 0.25 theta_v + 0.75 theta_V
    = (0.75 ln 3, 0.25 ln 4 + 0.75 ln 7) = (0.823959, 1.806006); pi_ewma = (0.272486, 0.727514), so
    r = pi_V/pi_ewma = (1.1010, 0.9622) stays inside the clip and w = pi_ewma/mu inside the mask: the
    expected update is the true gradient (0.21, -0.21). The EWMA holds fp32 weights (tolerance 1e-6).
    """
    history = torch.tensor([[0.0, LN(4)], [LN(3), LN(7)]], dtype=D)
    assert ewma_logits(history, 1.0).tolist() == pytest.approx([0.823959, 1.806006], abs=1e-6)
    p = hand_case()
    assert p.ewma_logprobs.exp()[0].tolist() == pytest.approx([0.272486, 0.727514], abs=1e-6)
    assert expected_update("ppo_ewma", p)[0].tolist() == pytest.approx([0.21, -0.21], abs=1e-6)
    # the ewma.py docstring's example: from 0, beta 1/2 (W = 2), versions 1 then 2 -> 1.428571
    steps = torch.tensor([[0.0, 0.0], [1.0, 0.0], [2.0, 0.0]], dtype=D)
    assert ewma_logits(steps, 2.0).tolist() == pytest.approx([1.428571, 0.0], abs=1e-6)


def test_trust_region_by_hand():
    """Ascent on the expected surrogate stops where every action's ratio has left its band on its
    advantage's side (action 0 pushed up, action 1 down; with K = 2, pi(0) = 1 - pi(1)):

    snapshot, ref pi_old = (0.2, 0.8): action 0 is clipped from the start (r = 1.5); action 1 stops at
    pi(1) = 0.8 * 0.8 = 0.64 -> pi_new = (0.36, 0.64);
    KL(pi_v || pi_new) = 0.2 ln(0.2/0.36) + 0.8 ln(0.8/0.64) = 0.060958, KL(pi_V || pi_new) = 0.008032.
    decoupled_ppo, ref pi_V = (0.3, 0.7): action 0 stops at 1.2 * 0.3 = 0.36 (pi(1) = 0.64), action 1
    goes on to 0.8 * 0.7 = 0.56 -> pi_new = (0.44, 0.56); KL(pi_v || pi_new) = 0.127648, KL(pi_V || .) = 0.041303.
    ppo, ref mu = (0.28, 0.72): 0.336 then 0.8 * 0.72 = 0.576 -> pi_new = (0.424, 0.576); KL(pi_v || .) = 0.112520.
    The last crossing overshoots by at most lr nats in a logit: tolerance 2e-3.
    """
    p = hand_case()
    expected = {
        "snapshot": ((0.36, 0.64), 0.060958, 0.008032),
        "decoupled_ppo": ((0.44, 0.56), 0.127648, 0.041303),
        "ppo": ((0.424, 0.576), 0.112520, 0.032696),
    }
    for method, (pi_new, kl_behav, kl_current) in expected.items():
        tr = trust_region(method, p, steps=4000, lr=0.0025)
        assert bool(tr["stopped"][0]), method
        assert torch.softmax(tr["theta"][0], -1).tolist() == pytest.approx(pi_new, abs=2e-3), method
        assert tr["kl_behav"].item() == pytest.approx(kl_behav, abs=2e-3), method
        assert tr["kl_current"].item() == pytest.approx(kl_current, abs=2e-3), method
    snap = trust_region("snapshot", p, steps=4000, lr=0.0025)
    # total ratio pi_new/mu = (0.36/0.28, 0.64/0.72) = (1.2857, 0.8889); true gain J: 0.36 - 0.3 = 0.06
    assert snap["total_ratio_min"].item() == pytest.approx(0.64 / 0.72, abs=3e-3)
    assert snap["total_ratio_max"].item() == pytest.approx(0.36 / 0.28, abs=3e-3)
    assert snap["gain"].item() == pytest.approx(0.06, abs=2e-3)


def test_trust_region_budget_and_errors():
    p = hand_case()
    one = trust_region("decoupled_ppo", p, steps=1, lr=0.0025)
    assert one["steps_taken"].tolist() == [1] and one["stopped"].tolist() == [False]
    with pytest.raises(ValueError, match="steps"):
        trust_region("decoupled_ppo", p, steps=0)
    with pytest.raises(ValueError, match="unknown loss method"):
        per_sample_updates("no_such_method", p)


def test_lag0_without_discrepancy_every_method_is_the_true_gradient():
    """Lag 0 and delta = 0: mu = pi_old = pi_V = pi_ewma (W = 0 -> beta = 0), every ratio and weight is 1,
    so each method's expected update is sum_a pi(a) A(a) (e_a - pi) = dJ/dtheta, with the same variance."""
    r = torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0], dtype=D)
    history = version_history(torch.tensor([-1.0, -0.5, 0.0, 0.5, 1.0], dtype=D), r, 3, 1.0)
    p = make_problems(history, [0], torch.zeros(1, 5, dtype=D), r)
    true = true_gradient(p.theta_current, r)
    variances = []
    for method in METHODS:
        assert expected_update(method, p)[0].tolist() == pytest.approx(true[0].tolist(), abs=1e-6), method
        variances.append(gradient_stats(method, p)["variance"].item())
    assert variances == pytest.approx([variances[0]] * len(METHODS), abs=1e-6)


def test_version_history_and_natural_step_by_hand():
    """theta_0 = (0, 0), r = (1, 0): pi = (0.5, 0.5), J = 0.5, dJ/dtheta = (0.25, -0.25) -> theta_1 = (0.25, -0.25)
    with step 1. Natural step at pi = (0.5, 0.5) of the update (0.1, -0.1): u = update / pi = (0.2, -0.2),
    scaled to a largest entry of lr = 0.01 -> (0.01, -0.01)."""
    h = version_history(torch.zeros(2, dtype=D), torch.tensor([1.0, 0.0], dtype=D), 1, 1.0)
    assert h.flatten().tolist() == pytest.approx([0.0, 0.0, 0.25, -0.25], abs=1e-15)
    theta = torch.zeros(2, 2, dtype=D)
    update = torch.tensor([[0.1, -0.1], [0.0, 0.0]], dtype=D)
    assert natural_step(update, theta, 0.01).flatten().tolist() == pytest.approx([0.01, -0.01, 0.0, 0.0], abs=1e-15)
    with pytest.raises(ValueError, match="lags must lie"):
        make_problems(h, [2], torch.zeros(1, 2, dtype=D), torch.tensor([1.0, 0.0], dtype=D))


def test_main_writes_the_table(tmp_path):
    out = tmp_path / "oracle"
    main(["--out", str(out), "--max-lag", "1", "--methods", "decoupled_ppo,snapshot", "--steps", "400"])
    result = json.loads((out / "oracle.json").read_text())
    assert len(result["rows"]) == 2 * 2 * 2  # delta scales 0 and 1, lags 0 and 1, two methods
    assert all(r["rel_bias"] < 1e-12 for r in result["rows"] if r["lag"] == 0 and r["delta_scale"] == 0)
    readme = (out / "README.md").read_text()
    assert "python -m benchmarks.oracle --out" in readme
    assert "| 1 | snapshot |" in readme and "## Reading" in readme
