"""The oracle's report: markdown tables of :func:`benchmarks.oracle.run_oracle`'s rows and the
reading of what they show, written beside ``oracle.json`` (:func:`write_results`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _g(x: float) -> str:
    """Three significant digits, exponent form below 1e-3 (0 stays 0)."""
    return f"{x:.3g}" if abs(x) >= 1e-3 or x == 0 else f"{x:.1e}"


def _methods(rows: list[dict[str, Any]]) -> list[str]:
    """The methods of ``rows`` in the order they first appear (the oracle writes them in its run order)."""
    return list(dict.fromkeys(r["method"] for r in rows))


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The full README table of ``rows`` (one delta scale): one line per (lag, method)."""
    head = (
        "| lag | method | bias | rel bias | cos | variance | ref err | kept | KL(π_v‖π_new) | max\\|log π_new/π_v\\| "
        "| KL(π_V‖π_new) | π_new/μ band | ΔJ |\n|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|\n"
    )
    lines = []
    order = {m: i for i, m in enumerate(_methods(rows))}
    for r in sorted(rows, key=lambda r: (r["lag"], order[r["method"]])):
        moving = "" if r["stopped"] else " (moving)"
        lines.append(
            f"| {r['lag']} | {r['method']} | {_g(r['bias'])} | {_g(r['rel_bias'])} | {r['cosine']:.3f} "
            f"| {_g(r['variance'])} | {_g(r['ref_err'])} | {r['kept']:.2f} | {_g(r['kl_behav'])}{moving} "
            f"| {_g(r['max_logratio_behav'])} | {_g(r['kl_current'])} "
            f"| [{r['total_ratio_min']:.2f}, {r['total_ratio_max']:.2f}] | {_g(r['gain'])} |"
        )
    return head + "\n".join(lines) + "\n"


def pivot_table(rows: list[dict[str, Any]], key: str, lags: list[int]) -> str:
    """Methods x ``lags`` table of one quantity ``key`` of ``rows`` (one delta scale)."""
    by = {(r["method"], r["lag"]): r for r in rows}
    methods = _methods(rows)
    head = "| method | " + " | ".join(f"lag {k}" for k in lags) + " |\n|---|" + "---:|" * len(lags) + "\n"
    body = "".join(f"| {m} | " + " | ".join(_g(by[m, k][key]) for k in lags) + " |\n" for m in methods)
    return head + body


def drift_table(drift: list[dict[str, Any]]) -> str:
    """Per lag: how far pi_V already is from pi_v, and the discrepancy pi_old vs mu."""
    head = (
        "| lag | KL(π_v‖π_V) | max\\|log π_V/π_v\\| | KL(π_old‖μ) | J(π_V) | ‖∇J‖ |\n|---:|---:|---:|---:|---:|---:|\n"
    )
    return head + "".join(
        f"| {d['lag']} | {_g(d['kl_behav_current'])} | {_g(d['max_logratio_behav_current'])} "
        f"| {_g(d['kl_old_mu'])} | {d['return_current']:.4f} | {_g(d['true_norm'])} |\n"
        for d in drift
    )


# ----------------------------------------------------------------------------------------------
# the reading and the files


def _pick(rows: list[dict[str, Any]], method: str, lag: int) -> dict[str, Any]:
    return next(r for r in rows if r["method"] == method and r["lag"] == lag)


def reading(result: dict[str, list[dict[str, Any]]]) -> str:
    """A few sentences on what the numbers show, each number taken from ``result`` (see :func:`run_oracle`)."""
    rows = result["rows"]
    scales = sorted({r["delta_scale"] for r in rows})
    exact0 = [r for r in rows if r["delta_scale"] == 0 and r["lag"] == 0]
    wd = [r for r in rows if r["delta_scale"] == scales[-1]]
    top = max(r["lag"] for r in rows)
    methods = {r["method"] for r in rows}
    out = []
    if exact0:
        out.append(
            f"- **Sanity.** At lag 0 without discrepancy every method's expected update equals the true gradient "
            f"(largest relative bias {max(r['rel_bias'] for r in exact0):.1e})."
        )
    if {"decoupled_ppo", "snapshot"} <= methods:
        dec = [_pick(wd, "decoupled_ppo", k) for k in range(top + 1)]
        snap = [_pick(wd, "snapshot", k) for k in range(top + 1)]
        first = next((k for k in range(top + 1) if snap[k]["rel_bias"] > 0.01), None)
        out.append(
            "- **Bias at the current weights.** A reference recomputed at version V gives ratio 1, so decoupled "
            f"PPO's clip never acts on the first step and its expected update is the true gradient at every lag "
            f"(largest relative bias {max(r['rel_bias'] for r in dec):.1e}) with a per-sample variance growing "
            f"from {_g(dec[0]['variance'])} (lag 0) to {_g(dec[-1]['variance'])} (lag {top}) as the weights "
            "pi_V/mu spread. The exact reference (snapshot) clips pi_V/pi_v: "
            + (
                f"first at lag {first}, the actions whose ratio already left the band in their advantage's "
                f"direction drop out, and at lag {top} its relative bias is {snap[-1]['rel_bias']:.2f} (the "
                f"expected update shrinks to {snap[-1]['norm'] / snap[-1]['true_norm']:.2f} of the true "
                f"gradient's norm, cosine {snap[-1]['cosine']:.2f}). That is the clip working as a trust region, "
                "not an estimation error: the policy has already moved further than the band allows."
                if first is not None
                else "its clip never binds here."
            )
        )
    if "icepop" in methods:
        ice = [_pick(wd, "icepop", k) for k in range(top + 1)]
        out.append(
            "- **IcePop** masks the discrepancy but applies no weight, so mu's sampling bias stays in its "
            f"expected update: relative bias {ice[0]['rel_bias']:.2f} at lag 0 with the discrepancy, "
            f"{ice[-1]['rel_bias']:.2f} at lag {top}, where its mask on pi_V/mu keeps {ice[-1]['kept']:.2f} "
            "of the behaviour mass."
        )
    if {"decoupled_ppo", "snapshot"} <= methods:
        out.append(
            "- **Trust region.** Optimising the surrogate until it stops, decoupled PPO ends within its band of "
            f"pi_V at every lag (KL(pi_V||pi_new) {_g(min(r['kl_current'] for r in dec))}-"
            f"{_g(max(r['kl_current'] for r in dec))}), so its distance from the behaviour version grows with the "
            f"lag: KL(pi_v||pi_new) {_g(dec[0]['kl_behav'])} at lag 0, {_g(dec[-1]['kl_behav'])} at lag {top}. "
            f"The exact reference's update {'shrinks' if snap[-1]['kl_current'] < snap[0]['kl_current'] else 'moves'}"
            f": KL(pi_V||pi_new) {_g(snap[0]['kl_current'])} at lag 0, {_g(snap[-1]['kl_current'])} at lag {top}, "
            "leaving KL(pi_v||pi_new) "
            f"{_g(snap[-1]['kl_behav'])} against the drift KL(pi_v||pi_V) "
            f"{_g(_drift(result, scales[-1], top)['kl_behav_current'])} that happened before the update. The clip "
            "is one-sided: it cannot pull back an action that is already beyond its band, it only stops pushing it "
            "further, so the exact reference bounds the update, not the distance from pi_v."
        )
    others = [m for m in ("ppo_ewma", "loglinear_prox", "linear_prox", "ppo") if m in methods]
    if others:
        out.append(
            "- **Where the reference sits.** A reference whose weight is the uncapped, unmasked exp(ref - mu) "
            "(ppo's is 1 with ref = mu) gives w r = pi_theta/mu, the full importance ratio, so at theta_V its "
            "expected update is the true gradient until the clip on pi_V/ref drops actions: the reference "
            f"decides where the clip acts. At lag {top} (KL(pi_v||pi_new) / relative bias): "
            + ", ".join(
                f"{m} {_g(_pick(wd, m, top)['kl_behav'])} / {_pick(wd, m, top)['rel_bias']:.2f}" for m in others
            )
            + "."
        )
    if "ppo" in methods and len(scales) > 1:
        first = {
            scale: next((r["lag"] for r in sorted(rows, key=lambda r: r["lag"]) if r["method"] == "ppo"
                         and r["delta_scale"] == scale and r["rel_bias"] > 0.01), None)
            for scale in (scales[0], scales[-1])
        }  # fmt: skip
        out.append(
            "- **PPO on pi_theta/mu** clips the total ratio, so discrepancy and staleness share one band: its "
            f"expected update is first biased at lag {first[scales[-1]]} with delta scale {scales[-1]:g}, "
            f"at lag {first[scales[0]]} with {scales[0]:g}."
        )
    moving = [r for r in rows if not r["stopped"]]
    out.append(
        "- **Convergence.** "
        + (
            "Every ascent stopped (zero expected update) within the step budget."
            if not moving
            else f"{len(moving)} ascents did not stop within the budget (marked 'moving'): their distances are "
            "lower bounds."
        )
    )
    return "\n".join(out) + "\n"


def _drift(result: dict[str, list[dict[str, Any]]], scale: float, lag: int) -> dict[str, Any]:
    return next(d for d in result["drift"] if d["delta_scale"] == scale and d["lag"] == lag)


def write_results(result: dict[str, Any], out: Path, command: str) -> None:
    """``oracle.json`` (every number and the arguments) and ``README.md`` (tables and reading) under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "oracle.json").write_text(json.dumps(result, indent=1) + "\n")
    rows, args = result["rows"], result["args"]
    top = max(r["lag"] for r in rows)
    key_lags = list(range(top + 1))
    parts = [
        "# Exact oracle of the policy-gradient corrections\n",
        f"Made by `{command}` in {result['elapsed_s']:.1f} s (CPU, float64); the numbers are in `oracle.json`.\n",
        "A softmax bandit where every expectation is an exact sum over the actions (no sampling), with the "
        "learner's own loss for each method; definitions in the docstring of `benchmarks/oracle.py`. "
        f"K = {len(args['rewards'])} actions, rewards {list(args['rewards'])}, theta_0 {list(args['theta0'])}, "
        f"versions by exact on-policy gradient ascent with step {args['history_lr']}, learner at version "
        f"V = {top}, behaviour version v = V - lag, mu = softmax(theta_v + delta) with delta = "
        f"{list(args['delta'])} x scale, EWMA window W = "
        + ("the lag" if args["window"] is None else str(args["window"]))
        + f", trust-region ascent steps of {args['lr']} nats (at most {args['steps']}).\n",
        "Columns: **bias** ||E_mu[g] - ∇J|| and **rel bias** over ||∇J|| at theta_V; **cos** between E_mu[g] and "
        "∇J; **variance** E_mu||g||^2 - ||E_mu[g]||^2 per sample; **ref err** max_a |ref - log pi_old| (nats); "
        "**kept** the behaviour mass the discrepancy mask keeps; then where optimising the expected surrogate "
        "from theta_V stops: **KL(π_v‖π_new)**, **max|log π_new/π_v|**, **KL(π_V‖π_new)** (nats), the band of "
        "the total ratio **π_new/μ** over actions, and the true gain **ΔJ** = J(π_new) - J(π_V).\n",
        "## Reading\n",
        reading(result),
    ]
    for scale in sorted({r["delta_scale"] for r in rows}, reverse=True):
        sel = [r for r in rows if r["delta_scale"] == scale]
        title = f"delta scale {scale:g}" + (" (no train-inference discrepancy)" if scale == 0 else "")
        parts += [
            f"## {title}: relative bias at theta_V\n",
            pivot_table(sel, "rel_bias", key_lags),
            f"## {title}: KL(π_v‖π_new) after the update (nats)\n",
            pivot_table(sel, "kl_behav", key_lags),
            f"## {title}: drift before the update\n",
            drift_table([d for d in result["drift"] if d["delta_scale"] == scale]),
            f"## {title}: every lag and method\n",
            markdown_table(sel),
        ]
    (out / "README.md").write_text("\n".join(parts))
