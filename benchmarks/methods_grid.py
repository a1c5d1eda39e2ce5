"""The methods grid's axes, cells and grids, and the statistics its tables use.

The grid itself runs in :mod:`benchmarks.methods`; its tables and plots are made by
:mod:`benchmarks.methods_report`. What follows describes the whole benchmark.

Every cell is one real job (``trainer.driver.loop.job.run_job``: vLLM rollout worker, DeepSpeed learner, the
old-logit service, the EWMA, the async controller) on the tiny random model and the procedural
``rollout.envs.toy:AlphabetEnv`` task (reward = fraction of reply characters in ``a``-``m``; the
random model starts at ~0.42, the optimum is 1.0). One Ray session serves the whole grid.

Axes:

* methods (``METHODS``): ``recompute`` (``decoupled_ppo``: reference recomputed at the current
  version), ``loglinear_prox``, ``linear_prox``, ``snapshot`` (exact old logits, EWMA where
  missing), ``ppo_ewma`` (with auto-reset), ``icepop`` (mask on the recompute reference), ``ppo``
  (clip on pi_theta/mu, the floor);
* staleness ``W = controller.max_staleness`` in {1, 2, 4, 8}, enforced by the controller (the
  per-token staleness histogram of every step is kept);
* discrepancy (``DISCREPANCY``): ``bf16`` (vLLM in bfloat16 against the fp32 learner) and
  ``inject`` (bf16 plus ``rollout.inject_mismatch_std``: rollout weights multiplied by
  ``1 + N(0, std)``, a fresh draw per version);
* seeds (``controller.seed``: sampling, data order and the injected noise; the model is the same).

Proxy probes (``PROBES``): a ``snapshot`` run whose configured proxy is another method's reference
(``recompute``, ``linear_prox``, ``loglinear_prox``). Every token has exact old logits there, so the
proxy is never used for the loss (training is the snapshot method's) but the learner measures its
error against the exact reference: ``proxy_abs_err`` = mean |proxy - log pi_old| in nats. The plain
``snapshot`` cell measures the EWMA's error the same way.

Grids:

* ``full`` (the default of ``vintage bench methods``): 7 methods x W {1,2,4,8} x {bf16, inject} x
  3 seeds = 168 runs, plus the proxy probes (3 x 4 W x 3 seeds = 36 runs), 40 steps each. Measured
  here: ~3 min per 32-step run on a 2-core CPU box (vLLM + DeepSpeed start ~20-40 s, 3-5 s per
  step), so ~11 hours; on a GPU machine far less. Cells already finished in ``out_dir`` are
  skipped, so it can be resumed.
* ``quick`` (CI smoke, ~3 min): the 7 methods at W = 1, bf16, one seed, 2 steps.
* ``confirm``: the real model (SmolLM2-135M-Instruct, easy ``basic_arithmetic``, W = 2, bf16) for
  recompute, snapshot and ppo_ewma, 12 steps each (:data:`CONFIRM`); ~8 min per run on 2 CPUs.
* ``reduced`` (what fits in ~1 hour here, 22 runs of 32 steps, one seed; see ``results/methods/README.md``):
  the 7 methods at W = 4 (bf16); recompute / snapshot / ppo_ewma at W = 1, 8 and 2 (bf16); recompute /
  snapshot / ppo_ewma / icepop at W = 4 with injected mismatch; the recompute and log-linear probes at W = 4.
* ``seeds``: seeds 1 and 2 of recompute / snapshot / ppo_ewma at W = 1, 4, 8 (bf16; 18 runs), to put
  a spread over three seeds on the ``reduced`` grid's core rows when run into the same folder.
* ``lr``: recompute / snapshot / ppo_ewma at W = 4 with lr 3e-2 and 3e-3 (tagged rows ``[lr...]``).
* ``eps``: snapshot / ppo_ewma at W = 4 with a wide clip band, eps_low 0.5 / eps_high 1.0.
* ``paper``: the paper's regime (:data:`PAPER`: 4 optimizer steps per rollout batch, lr
  :data:`PAPER_LR`), the 5 methods of :data:`PAPER_METHODS` at W = 2 and 4, bf16, seeds 0-2
  (30 runs of :data:`PAPER_STEPS` versions, rows tagged ``mb4-lr5e-3``, W = 2's three seeds first;
  ~2 hours here).
* ``paper_lr``: recompute and snapshot at W = 2 in that regime with lr 1e-3, 3e-3, 1e-2: which
  learning rate keeps one version mostly inside the clip band (the largest per-step clip fraction).
* ``paper_real``: the same comparison on SmolLM2 and the demo's task (2 mini-batches of 8 per
  16-sample batch, W = 2, 3 seeds, 20 steps; ~2.5 hours here).
* ``paper_real_stable``: ``paper_real``'s decoupled PPO (recompute) and IcePop cells, seeds 0-2, with
  the demo's stabilisers (:data:`STABILISERS`; rows tagged ``mb2-demo``): how many still collapse.
  Run it into ``paper_real``'s folder to read the rows side by side.
* ``spanning``: rollouts that span versions: ``paper_agent``'s retail agent with a closing turn and
  a store that answers after 60 s (:data:`SPANNING`), decoupled PPO, snapshot and PPO-EWMA at W = 2,
  seeds 0-2, :data:`SPANNING_STEPS` versions (rows tagged ``agent-latency60``; the methods of one
  seed next to each other); the table's "sequences spanning versions" column says how many trained
  sequences carry tokens of two or more versions.
* ``paper_agent``: the same comparison on a multi-turn task through the gateway, the retail agent
  on SmolLM2 (:data:`AGENT`: 2 mini-batches, W = 2, 3 seeds, :data:`PAPER_AGENT_STEPS` steps).
* ``verdict``: ``paper_real``'s regime made decisive by pairing and more seeds: SmolLM2 on the
  demo's task (:data:`CONFIRM`: lr 5e-5, bf16 rollouts against the fp32 learner) with 2 optimizer
  steps per 16-sample batch, :data:`PAPER_REAL_STEPS` versions, the 4 methods of
  :data:`VERDICT_METHODS` at W = 2 and 4, seeds 0-4 (40 runs, rows tagged ``mb2-eval128``; W = 2
  first, the methods of one seed next to each other, so a grid stopped part way leaves whole
  paired seeds). Held-out evaluations pinned every 5 versions on 128 prompts
  (:data:`VERDICT_EVAL`), so each run has a held-out curve and one evaluation's binomial error is
  well below the run-to-run spread. Read it in ``paired.md`` (differences to recompute seed by
  seed, paired t intervals). ``paper_real``'s 3 seeds do not count as W = 2 cells of this grid: its
  runs evaluated 64 prompts before and after only, and an evaluation changes the run it is part of
  (publication waits for it, and vLLM's unseeded held-out requests draw from the stream the
  training samples draw from), so they are other runs of a neighbouring configuration, without a
  held-out curve. At ~6-7 min per run here (``paper_real``: 94 min for 15 runs, plus the
  evaluations), about 4.5 hours; resumable cell by cell (finished cells in ``cells/`` are loaded,
  not run again).

Per row: the final reward's mean with its 95% interval over seeds (Student's t), how many runs
collapsed (ended below their first step's reward), the largest clipped fraction of one optimizer
step and the share of the policy-gradient weight on clipped tokens.

Every grid's table covers all finished cells in its ``out_dir``, so grids run into one folder pool.

Outputs in ``out_dir``: ``cells/<cell>.json`` (per run: summary numbers, per-step curves and the
held-out evaluations with their versions), ``results.json`` (all cells, the seed-aggregated rows and
the paired comparison), ``table.md``, ``seeds.md``, ``paired.md`` (each method minus recompute seed
by seed, with paired t intervals, and evaluation noise beside run-to-run spread), and
``reward_curves.png``, ``staleness_sweep.png``, ``mask_kept.png``. Run folders (metrics.jsonl, config) go to
``out_dir/runs/`` (git-ignored); their checkpoints are deleted after each cell.

    vintage bench methods                       # full grid
    vintage bench methods --quick --out /tmp/q  # smoke
    python -m benchmarks.methods --grid reduced --out results/methods
    python -m benchmarks.methods --grid seeds --out results/methods
    python -m benchmarks.methods --grid confirm --out results/methods/confirm
    python -m benchmarks.methods --grid verdict --out results/methods/verdict --stop-after-min 60  # in parts
    python -m benchmarks.methods --grid paper_real_stable --out results/methods/paper_real
    python -m benchmarks.methods --grid spanning --out results/methods/spanning
    python -m benchmarks.methods_report results/methods/paper_real   # tables from cells/, no run
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

METHODS: dict[str, str] = {
    "recompute": "decoupled_ppo",
    "loglinear_prox": "loglinear_prox",
    "linear_prox": "linear_prox",
    "snapshot": "snapshot",
    "ppo_ewma": "ppo_ewma",
    "icepop": "icepop",
    "ppo": "ppo",
}
"""Label in the tables -> ``loss.method`` preset (``trainer.algorithm.loss_config.METHODS``)."""

PROBES: dict[str, str] = {
    "probe_recompute": "recompute",
    "probe_linear": "linear_prox",
    "probe_loglinear": "loglinear_prox",
}
"""Proxy probes: ``snapshot`` method with ``loss.proxy`` set to the given reference (error measured, not used)."""

INJECT_STD = 0.1
"""Injected mismatch. Measured on the tiny model at initialisation (``make_tiny_model(0)``, 32 x 40
random tokens): bf16 alone gives mean |log mu - log pi| ~0.0011 nats; ``1 + N(0, std)`` on top gives
0.005 (std 0.01), 0.010 (0.02), 0.024 (0.05), 0.049 (0.1) nats. 0.1 is ~45x the natural bf16
mismatch of this model and the size measured for bf16 on the real model (~0.045)."""

DISCREPANCY: dict[str, list[str]] = {
    "bf16": ['rollout.dtype="bfloat16"', "rollout.inject_mismatch_std=0.0"],
    "inject": ['rollout.dtype="bfloat16"', f"rollout.inject_mismatch_std={INJECT_STD}"],
}

REWARD_LEVEL = 0.6
"""'Steps to level': first version at which the 3-step moving mean of the batch reward reaches it."""

LAST_K = 5
"""Final reward = mean batch reward over the last ``LAST_K`` steps."""

BASE: list[str] = [
    'model.path="tiny"',
    "model.tiny_seed=0",
    'env.path="rollout.envs.toy:AlphabetEnv"',
    "env.train_seeds=100000",
    "env.eval_prompts=32",
    "rollout.num_workers=1",
    "rollout.max_num_seqs=64",
    "rollout.sampling.max_tokens=6",
    "rollout.sampling.n=8",
    "rollout.sampling.temperature=1.0",
    "controller.batch_groups=4",
    "controller.buffer_capacity=512",
    "learner.lr=1e-2",
    "learner.micro_batch_size=32",
    "oldlogit.memory_budget_bytes=2147483648",
    "server.port=0",
    "logging.trackers=[]",
    "logging.plots=false",
    "ray.num_cpus=6",
    "controller.recovery_checkpoint_s=0",
    "controller.max_learner_restarts=0",
]
"""Settings shared by every cell. lr 1e-2 and 6-token replies: measured on this box, decoupled PPO at
W = 1 goes 0.43 -> 0.81 in 30 steps (slower settings barely moved: lr 3e-3, 16 tokens: 0.43 -> 0.45).
No recovery checkpoints and no learner restarts: a cell is run again whole when it stops, and a save
mid-run would change its timing against cells run before they existed."""


@dataclass(frozen=True)
class Cell:
    method: str
    W: int
    disc: str
    seed: int
    steps: int
    extra: tuple[str, ...] = ()
    model: str = "tiny"
    tag: str = ""
    """Names a variant of the base settings (e.g. ``lr3e-2``); tagged cells are separate table rows."""

    @property
    def name(self) -> str:
        prefix = "" if self.model == "tiny" else f"{self.model}-"
        suffix = f"-{self.tag}" if self.tag else ""
        return f"{prefix}{self.method}-W{self.W}-{self.disc}-s{self.seed}{suffix}"

    def overrides(self, run_dir: Path) -> list[str]:
        if self.method in PROBES:
            loss = ['loss.method="snapshot"', f'loss.proxy="{PROBES[self.method]}"']
        else:
            loss = [f'loss.method="{METHODS[self.method]}"']
        return (
            BASE
            + DISCREPANCY[self.disc]
            + loss
            + [
                f"controller.max_staleness={self.W}",
                f"controller.seed={self.seed}",
                f"controller.total_steps={self.steps}",
                f'logging.run_dir="{run_dir}"',
            ]
            + list(self.extra)
        )


CONFIRM: tuple[str, ...] = (
    'model.path="smollm2"',
    'env.path="rollout.envs.reasoning_gym_env:ReasoningGymEnv"',
    'env.kwargs={dataset="basic_arithmetic", level="easy", size=2000}',
    "env.train_seeds=1800",
    "env.eval_prompts=64",
    "rollout.kv_cache_gib=2",
    "rollout.sampling.max_tokens=48",
    "controller.batch_groups=2",
    "learner.lr=5e-5",
    "learner.micro_batch_size=16",
)
"""The confirmation run on the real model (the demo's settings: SmolLM2-135M-Instruct, easy
basic_arithmetic, 2 prompts x 8 samples per step, lr 5e-5), applied over :data:`BASE`."""

PAPER: tuple[str, ...] = ("learner.ppo_mini_batches=4", "learner.micro_batch_size=8")
"""The paper's regime: several optimizer steps per rollout batch (4 mini-batches of one 32-sample
batch), so the recompute reference is behind the current policy from the second step on and its
clip acts, exact old logits stay the behaviour version's, and the EWMA moves every step."""

PAPER_LR = "5e-3"
"""Learning rate of the ``paper`` grid. ``paper_lr`` measured, at 4 optimizer steps per version:
1e-2 learns in 32 versions but clips ~20% of recompute's tokens (a version moves the policy out of
the band); 3e-3 clips ~1% and does not move in 32 versions; 5e-3 over :data:`PAPER_STEPS` versions
sits between."""

PAPER_STEPS = 64
"""Versions per ``paper`` run: at half the lr that reaches 0.6 in ~17 versions, about twice as many."""

PAPER_METHODS = ("recompute", "snapshot", "ppo_ewma", "loglinear_prox", "icepop")
"""Methods the paper compares: decoupled PPO (recompute), exact snapshot, PPO-EWMA, the log-linear
proxy and IcePop's mask on the recompute reference."""

PAPER_REAL_STEPS = 20
"""Steps per ``paper_real`` run on SmolLM2 (the demo's task; ~25 s per step with 2 mini-batches here)."""

AGENT: tuple[str, ...] = (
    'model.path="smollm2"',
    'env.path="rollout.envs.retail:RetailEnv"',
    'env.kwargs={level="easy", max_turns=3}',
    "env.train_seeds=2000",
    "env.eval_prompts=32",
    'agent.path="rollout.agents.retail:run"',
    "agent.concurrency=16",
    'agent.tasks="env"',
    "agent.timeout_s=300",
    "gateway.max_session_tokens=1024",
    "rollout.kv_cache_gib=2",
    "rollout.max_num_seqs=32",
    "rollout.sampling.max_tokens=24",
    "rollout.sampling.n=4",
    "controller.batch_groups=4",
    "learner.lr=5e-5",
    "learner.ppo_mini_batches=2",
    "learner.micro_batch_size=4",
)
"""The multi-turn cell: the retail support agent (``rollout.agents.retail``, an OpenAI-client agent)
through the gateway on SmolLM2, as ``deploy/configs/agent-retail.toml`` (easy tasks, 3 turns, 4
episodes per task, 4 tasks per step, lr 5e-5), with 2 optimizer steps per rollout batch; applied
over :data:`BASE`."""

STABILISERS: tuple[str, ...] = (
    "loss.eps_high=0.28",
    "loss.dual_clip=3.0",
    'learner.lr_schedule="cosine"',
    "learner.lr_warmup_steps=2",
    "learner.lr_min_ratio=0.1",
    "loss.entropy_target=0.65",
    "loss.entropy_coef_delta=0.03",
    "loss.entropy_coef_max=0.5",
    "loss.entropy_coef_backoff=0.5",
    "loss.entropy_smoothing=0.5",
    "controller.dynamic_sampling=true",
)
"""The demo's stabilisers (``deploy/configs/demo.toml``): clip-higher and dual clip, a cosine
learning-rate decay from ``learner.lr`` to a tenth of it over the run after 2 warm-up steps, the
adaptive entropy bonus (target 0.65 nats) and dynamic sampling. Rows tagged ``mb2-demo``; the
``mb2-stable`` rows of ``results/methods/paper_real`` ran an earlier set without the entropy bonus
and the dual clip (each cell record lists its own overrides)."""

PAPER_AGENT_STEPS = 20
"""Versions per ``paper_agent`` run (~30 s per step here, plus two 32-task evaluations)."""

VERDICT_METHODS = ("recompute", "snapshot", "ppo_ewma", "loglinear_prox")
"""Methods of the ``verdict`` grid: decoupled PPO (recompute, the baseline of ``paired.md``), exact
snapshot, PPO-EWMA and the log-linear proxy."""

VERDICT_EVAL: tuple[str, ...] = ("env.eval_prompts=128", "controller.eval_every=5")
"""Held-out evaluation of the ``verdict`` grid: 128 prompts (env seeds 1800-1927, inside the
2000-instance dataset and past the 1800 training seeds), pinned to versions 0, 5, 10, 15 and 20.
One evaluation's binomial standard error is at most sqrt(0.25 / 128) = 0.044 (0.029 at p = 0.12,
recompute's mean in ``paper_real``), against a run-to-run sd of held-out success of 0.10-0.31
over ``paper_real``'s 3 seeds; the mean of 4 evaluations (the curve score) has about half that error."""

VERDICT_SEEDS = (0, 1, 2, 3, 4)
"""Seeds of the ``verdict`` grid."""

SPANNING: tuple[str, ...] = (
    'env.kwargs={level="easy", max_turns=3, closing_turn=true}',
    "agent.task_fields={tool_latency_s=60}",
    "agent.concurrency=48",
)
"""Agent sessions that stay open across a publication: :data:`AGENT` with a closing turn (after the
right tool call the store answers and the agent replies once more, so a solved episode takes two
model calls), a store that answers each reply after 60 s (``tool_latency_s``, an ``asyncio``
wait), and 48 sessions at once, three batches of 16. Sessions start in a burst when a publication
opens admission; a session then outlasts the learner's step (~55 s here), so its second call comes
after the next publication and its trajectory carries tokens of two versions. Shorter waits do not
do it: with 10 s and 16 sessions at once, or 30 s and 48, every session ended before the next
publication (0 of 32 and 0 of 48 sequences spanned in 2-3 steps); generation alone neither: with
128-token replies on the tiny model the worker finished each batch within the learner's 7 s step
(0 of 32 sequences in 18 steps)."""

SPANNING_METHODS = ("recompute", "snapshot", "ppo_ewma")
"""Methods of the ``spanning`` grid: decoupled PPO, the exact snapshot route (each version's old
logits, whichever call of the session made the token) and PPO-EWMA. The interruption route attaches
exact old logits only to calls in flight at a publication; a session waiting on its tool between
calls holds none, so snapshot is the exact route for agent sessions."""

SPANNING_STEPS = 12
"""Versions per ``spanning`` run (~55-70 s per step here, plus two 32-task evaluations of ~2 min each)."""

CONFIRM_STEPS = 12
"""Steps per confirmation run: the demo's batch reward rises from ~0.4 to ~0.7 within ~12 steps."""


def grid(kind: str) -> list[Cell]:
    """The cells of grid ``kind`` (one of :data:`GRIDS`), in run order.

    Raises:
        ValueError: ``kind`` is not one of :data:`GRIDS`.
    """
    core = ("recompute", "snapshot", "ppo_ewma")
    if kind == "confirm":
        return [Cell(m, 2, "bf16", 0, CONFIRM_STEPS, CONFIRM, model="smollm2") for m in core]
    if kind == "quick":
        return [Cell(m, 1, "bf16", 0, 2, ("env.eval_prompts=4",)) for m in METHODS]
    if kind == "full":
        return [
            Cell(m, W, d, s, 40)
            for s in (0, 1, 2)
            for d in DISCREPANCY
            for W in (1, 2, 4, 8)
            for m in [*METHODS, *(PROBES if d == "bf16" else ())]
        ]
    if kind == "reduced":
        cells = [Cell(m, 4, "bf16", 0, REDUCED_STEPS) for m in METHODS]
        cells += [Cell(m, W, "bf16", 0, REDUCED_STEPS) for W in (1, 8, 2) for m in core]
        cells += [Cell(m, 4, "inject", 0, REDUCED_STEPS) for m in (*core, "icepop")]
        cells += [Cell(p, 4, "bf16", 0, REDUCED_STEPS) for p in ("probe_recompute", "probe_loglinear")]
        return cells
    if kind == "seeds":
        return [Cell(m, W, "bf16", s, REDUCED_STEPS) for W in (1, 4, 8) for s in (1, 2) for m in core]
    if kind == "lr":
        return [
            Cell(m, 4, "bf16", 0, REDUCED_STEPS, (f"learner.lr={lr}",), tag=f"lr{lr}")
            for lr in ("3e-2", "3e-3")
            for m in core
        ]
    if kind == "paper":
        extra = (*PAPER, f"learner.lr={PAPER_LR}")
        return [
            Cell(m, W, "bf16", s, PAPER_STEPS, extra, tag=f"mb4-lr{PAPER_LR}")
            for W in (2, 4)
            for s in (0, 1, 2)
            for m in PAPER_METHODS
        ]
    if kind == "paper_lr":
        return [
            Cell(m, 2, "bf16", 0, REDUCED_STEPS, (*PAPER, f"learner.lr={lr}"), tag=f"mb4-lr{lr}")
            for lr in ("1e-3", "3e-3", "1e-2")
            for m in ("recompute", "snapshot")
        ]
    if kind == "paper_real":
        extra = (*CONFIRM, "learner.ppo_mini_batches=2", "learner.micro_batch_size=8")
        return [
            Cell(m, 2, "bf16", s, PAPER_REAL_STEPS, extra, model="smollm2", tag="mb2")
            for s in (0, 1, 2)
            for m in PAPER_METHODS
        ]
    if kind == "paper_real_stable":
        extra = (*CONFIRM, "learner.ppo_mini_batches=2", "learner.micro_batch_size=8", *STABILISERS)
        return [
            Cell(m, 2, "bf16", s, PAPER_REAL_STEPS, extra, model="smollm2", tag="mb2-demo")
            for s in (0, 1, 2)
            for m in ("recompute", "icepop")
        ]
    if kind == "paper_agent":
        return [
            Cell(m, 2, "bf16", s, PAPER_AGENT_STEPS, AGENT, model="smollm2", tag="agent-mb2")
            for s in (0, 1, 2)
            for m in PAPER_METHODS
        ]
    if kind == "verdict":
        extra = (*CONFIRM, "learner.ppo_mini_batches=2", "learner.micro_batch_size=8", *VERDICT_EVAL)
        return [
            Cell(m, W, "bf16", s, PAPER_REAL_STEPS, extra, model="smollm2", tag="mb2-eval128")
            for W in (2, 4)
            for s in VERDICT_SEEDS
            for m in VERDICT_METHODS
        ]
    if kind == "spanning":
        extra = (*AGENT, *SPANNING)
        return [
            Cell(m, 2, "bf16", s, SPANNING_STEPS, extra, model="smollm2", tag="agent-latency60")
            for s in (0, 1, 2)
            for m in SPANNING_METHODS
        ]
    if kind == "eps":
        wide = ("loss.eps_low=0.5", "loss.eps_high=1.0")
        return [Cell(m, 4, "bf16", 0, REDUCED_STEPS, wide, tag="eps0.5-1.0") for m in ("snapshot", "ppo_ewma")]
    raise ValueError(f"grid: unknown kind {kind!r} ({', '.join(GRIDS)})")


GRIDS = (
    "quick", "reduced", "seeds", "lr", "eps", "full", "confirm", "paper", "paper_lr", "paper_real",
    "paper_real_stable", "paper_agent", "verdict", "spanning",
)  # fmt: skip
REDUCED_STEPS = 32


def finite_mean(xs: list[float]) -> float:
    """Mean of the finite values of ``xs`` (None, NaN and inf left out); NaN when none is finite."""
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return float(np.mean(xs)) if xs else math.nan


def collapsed(final_reward: float, first_reward: float) -> bool:
    """A run collapsed when its final reward (mean batch reward of the last :data:`LAST_K` steps)
    ended below its first step's batch reward: it ended worse than it began."""
    return bool(math.isfinite(final_reward) and math.isfinite(first_reward) and final_reward < first_reward)


def ci95(values: list[float]) -> float:
    """Half-width of the 95% confidence interval of the mean of ``values``: t(0.975, n - 1) * sd / sqrt(n)
    (Student's t, sample sd); NaN with fewer than 2 values. Example: 0.4, 0.6, 0.8 -> 4.303 * 0.2 /
    sqrt(3) = 0.4968."""
    from scipy.stats import t

    xs = [x for x in values if math.isfinite(x)]
    if len(xs) < 2:
        return math.nan
    return float(t.ppf(0.975, len(xs) - 1) * np.std(xs, ddof=1) / math.sqrt(len(xs)))


def paired_ci95(x: dict[int, float], y: dict[int, float]) -> dict[str, Any]:
    """Paired comparison of two methods over seeds: the per-seed differences ``d_s = x[s] - y[s]``
    over the seeds where both are finite (ascending), their mean and the half-width of its 95%
    confidence interval by the paired Student's t (the one-sample t interval applied to the
    differences; the paired t-test of any statistics text):

        mean = sum_s d_s / n,   sd = sqrt(sum_s (d_s - mean)^2 / (n - 1)),
        half-width = t(0.975, n - 1) * sd / sqrt(n)

    Runs of two methods with the same seed share prompts, sampling seeds and initial weights, so
    what a seed does to both cancels in ``d_s``. Returns ``{"seeds", "diffs", "mean", "ci95"}``;
    ``mean`` is NaN without a common seed, ``ci95`` NaN with fewer than 2.

    Example: x = {0: 0.5, 1: 0.7, 2: 0.6}, y = {0: 0.2, 1: 0.3, 2: 0.5}: d = 0.3, 0.4, 0.1, mean
    0.2667, sd 0.1528, half-width 4.3027 * 0.1528 / sqrt(3) = 0.3795.
    """
    seeds = sorted(s for s in x if s in y and math.isfinite(x[s]) and math.isfinite(y[s]))
    diffs = [float(x[s] - y[s]) for s in seeds]
    return {"seeds": seeds, "diffs": diffs, "mean": float(np.mean(diffs)) if diffs else math.nan, "ci95": ci95(diffs)}


def heldout_curve_score(evals: list[dict[str, Any]]) -> float:
    """A run's held-out curve score: the mean held-out reward (``held_out``, in [0, 1]) of its
    pinned evaluations at versions > 0, the ones during training (``controller.eval_every``) and the
    one after; the evaluation before training (version 0, the initial weights every method of a seed
    shares) is left out. Evaluations are evenly spaced, so this is the area under the held-out curve
    per version. Evaluations that scored nothing (NaN) are left out; NaN when fewer than 2 remain
    (a run evaluated only before and after has a final point, not a curve).

    Example: versions 0, 5, 10, 15, 20 scoring 0.2, 0.4, 0.5, 0.3, 0.6 -> (0.4 + 0.5 + 0.3 + 0.6) / 4 = 0.45.
    """
    xs = [float(e["held_out"]) for e in evals if int(e["version"]) > 0 and e.get("held_out") is not None]
    xs = [x for x in xs if math.isfinite(x)]
    return float(np.mean(xs)) if len(xs) >= 2 else math.nan


def binomial_se(p: float, n: int) -> float:
    """Standard error of one held-out evaluation of ``n`` prompts with mean reward ``p``:
    ``sqrt(p (1 - p) / n)``, the binomial standard error of a success rate. For rewards in [0, 1]
    that are not 0/1 it is an upper bound (a reward X in [0, 1] has X^2 <= X, so Var X <= p (1 - p)).
    NaN when ``p`` is not finite or ``n`` < 1. Example: p = 0.4, n = 128 -> sqrt(0.24 / 128) = 0.0433.
    """
    if not math.isfinite(p) or n < 1:
        return math.nan
    return math.sqrt(max(p * (1.0 - p), 0.0) / n)
