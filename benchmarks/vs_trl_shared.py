"""What both sides of the vintage-vs-TRL benchmark (:mod:`benchmarks.bench_vs_trl`) share: the task's
prompts and reward from vintage's environment, the one held-out evaluation both final policies get,
and the bookkeeping that turns each side's steps and seconds into its record and the ratios.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

GOAL_RATIO = 1.0
"""Project goal: vintage trains at least this many times TRL's completion tokens per second..."""
GOAL_REWARD_DIFF = 0.0
"""...with a held-out reward no lower than TRL's after the same wall time."""


# -- the shared task: prompts and reward from vintage's environment -------------------------------


def prompt_rows(env_path: str, env_kwargs: dict[str, Any], seeds: list[int]) -> list[dict[str, Any]]:
    """One row per seed, ``{"prompt": messages, "seed": seed}``, from the environment's ``reset(seed)``.

    ``messages`` is the chat-message list the rollout worker renders with the tokenizer's chat
    template (TRL renders conversational prompts the same way, with the generation prompt).

    Raises:
        ValueError: bad ``env_path``; TypeError: ``reset`` does not return ``(messages, info)``.
    """
    from rollout.envs import check_reset, load_env

    env = load_env(env_path, **env_kwargs)
    return [{"prompt": check_reset(env.reset(s), env_path)[0], "seed": int(s)} for s in seeds]


def completion_text(completion: str | list[dict[str, Any]]) -> str:
    """The assistant's text of one completion: a plain string, or TRL's conversational form (a list
    of messages, the assistant's content last)."""
    if isinstance(completion, str):
        return completion
    return str(completion[-1]["content"]) if completion else ""


class EnvReward:
    """The environment's reward as a TRL reward function: ``reset(seed)`` then ``step(text)``.

    Called as ``reward(prompts=..., completions=..., seed=[...], **kwargs) -> list[float]`` (TRL
    passes the dataset's extra columns as keyword lists); :meth:`score` scores one text.

    Raises:
        ValueError: ``completions`` and ``seed`` differ in length; TypeError: the environment's
            ``step`` does not return ``(messages, reward, done, info)`` with a finite reward.
    """

    __name__ = "env_reward"  # TRL names the reward column after it

    def __init__(self, env_path: str, env_kwargs: dict[str, Any]):
        from rollout.envs import load_env

        self.env_path = env_path
        self.env = load_env(env_path, **env_kwargs)

    def score(self, text: str, seed: int) -> float:
        """Reward of the reply ``text`` to the task of ``seed`` (single turn: the first step's reward)."""
        from rollout.envs import check_reset, check_step

        check_reset(self.env.reset(int(seed)), self.env_path)
        return check_step(self.env.step(text), self.env_path)[1]

    def __call__(self, prompts=None, completions=(), seed=(), **kwargs: Any) -> list[float]:
        if len(completions) != len(seed):
            raise ValueError(f"seed: {len(seed)} seeds for {len(completions)} completions")
        return [self.score(completion_text(c), s) for c, s in zip(completions, seed, strict=True)]


def heldout_seeds(train_seeds: int, eval_prompts: int, env_size: int | None) -> list[int]:
    """Held-out seeds ``[train_seeds, train_seeds + eval_prompts)``.

    Raises:
        ValueError: ``eval_prompts < 1``, or the environment has ``env_size`` tasks (seed ``s`` picks
            task ``s % env_size``) and the range would reach past it into training tasks.
    """
    if eval_prompts < 1:
        raise ValueError(f"eval_prompts: must be >= 1, got {eval_prompts}")
    if env_size is not None and train_seeds + eval_prompts > env_size:
        raise ValueError(
            f"eval_prompts: {eval_prompts} held-out seeds from {train_seeds} reach past the environment's "
            f"{env_size} tasks (at most {max(env_size - train_seeds, 0)})"
        )
    return list(range(train_seeds, train_seeds + eval_prompts))


# -- pure bookkeeping --------------------------------------------------------------------------------


def _finite(x: float) -> float | None:
    return float(x) if x is not None and math.isfinite(x) else None


def side_record(
    *, steps: int, samples: int, loop_s: float, step_end_s: list[float], tokens: int | None = None
) -> dict[str, Any]:
    """Throughput of one side from its counts and times.

    Args:
        steps: optimizer steps applied.
        samples: completions trained on (``steps x batch`` when every step is full).
        tokens: completion tokens trained on (the loss's tokens, prompts not counted); None when
            the side does not report them.
        loop_s: wall seconds of the training loop (first step's generation to the last step's end).
        step_end_s: ``[steps]`` wall seconds from process launch to the end of each step.

    Returns:
        ``s_per_step = loop_s / steps``; ``s_per_step_steady = (t_last - t_first) / (steps - 1)``
        (the pipeline fill of the first step left out; None for one step); ``samples_per_s =
        samples / loop_s``; ``samples_per_s_wall = samples / t_last`` (start-up included);
        ``tokens_per_s = tokens / loop_s`` (a policy that learns shorter replies trains more
        completions per second but not more tokens; None without tokens); ``first_step_s =
        t_first``. Rates are None where their denominator is 0 or missing.
    """
    first = step_end_s[0] if step_end_s else None
    last = step_end_s[-1] if step_end_s else None
    return {
        "steps": int(steps),
        "samples": int(samples),
        "loop_s": float(loop_s),
        "s_per_step": _finite(loop_s / steps) if steps else None,
        "s_per_step_steady": _finite((last - first) / (len(step_end_s) - 1)) if len(step_end_s) > 1 else None,
        "samples_per_s": _finite(samples / loop_s) if loop_s > 0 else None,
        "samples_per_s_wall": _finite(samples / last) if last else None,
        "tokens": None if tokens is None else int(tokens),
        "tokens_per_s": _finite(tokens / loop_s) if tokens and loop_s > 0 else None,
        "first_step_s": _finite(first) if first is not None else None,
        "last_step_s": _finite(last) if last is not None else None,
    }


def summarize(vintage: dict[str, Any], trl: dict[str, Any]) -> dict[str, Any]:
    """Ratios of two :func:`side_record` dicts that also carry ``heldout = {"reward": ...}``.

    ``tokens_per_s_ratio = vintage / TRL`` (training-loop completion tokens per second),
    ``samples_per_s_ratio`` likewise in completions, ``samples_per_s_wall_ratio`` in completions
    from launch, ``reward_diff = vintage - TRL`` held-out reward; ``goal_met``: the tokens ratio
    >= :data:`GOAL_RATIO` and diff >= :data:`GOAL_REWARD_DIFF` (False when either is undefined).
    """

    def ratio(key: str) -> float | None:
        a, b = vintage.get(key), trl.get(key)
        return _finite(a / b) if a is not None and b else None

    ra, rb = vintage.get("heldout", {}).get("reward"), trl.get("heldout", {}).get("reward")
    diff = _finite(ra - rb) if ra is not None and rb is not None else None
    r = ratio("tokens_per_s")
    return {
        "tokens_per_s_ratio": r,
        "samples_per_s_ratio": ratio("samples_per_s"),
        "samples_per_s_wall_ratio": ratio("samples_per_s_wall"),
        "s_per_step_ratio": ratio("s_per_step"),
        "reward_diff": diff,
        "goal": {"tokens_per_s_ratio": GOAL_RATIO, "reward_diff": GOAL_REWARD_DIFF},
        "goal_met": bool(r is not None and diff is not None and r >= GOAL_RATIO and diff >= GOAL_REWARD_DIFF),
    }


def _fmt(x: Any, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def table_markdown(result: dict[str, Any]) -> str:
    """The side-by-side table of a result dict (``vintage``, ``trl``, ``base``, ``ratios``)."""
    v, t, q = result["vintage"], result["trl"], result["ratios"]
    rows = [
        ("configuration", v["configuration"], t["configuration"], ""),
        ("optimizer steps in the budget", _fmt(v["steps"], "d"), _fmt(t["steps"], "d"), ""),
        ("completions trained", _fmt(v["samples"], "d"), _fmt(t["samples"], "d"), ""),
        ("first step done at, s from launch", _fmt(v["first_step_s"], ".0f"), _fmt(t["first_step_s"], ".0f"), ""),
        ("s / optimizer step (loop)", _fmt(v["s_per_step"], ".2f"), _fmt(t["s_per_step"], ".2f"),
         _fmt(q["s_per_step_ratio"], ".2f")),
        ("s / step after the first", _fmt(v["s_per_step_steady"], ".2f"), _fmt(t["s_per_step_steady"], ".2f"), ""),
        ("completion tokens trained", _fmt(v.get("tokens"), "d"), _fmt(t.get("tokens"), "d"), ""),
        ("completion tokens / s (loop)", _fmt(v.get("tokens_per_s"), ".1f"), _fmt(t.get("tokens_per_s"), ".1f"),
         _fmt(q.get("tokens_per_s_ratio"), ".2f") + "x"),
        ("completions / s (loop)", _fmt(v["samples_per_s"], ".2f"), _fmt(t["samples_per_s"], ".2f"),
         _fmt(q["samples_per_s_ratio"], ".2f") + "x"),
        ("completions / s (from launch)", _fmt(v["samples_per_s_wall"], ".2f"), _fmt(t["samples_per_s_wall"], ".2f"),
         _fmt(q["samples_per_s_wall_ratio"], ".2f") + "x"),
        ("held-out reward (untrained: " + _fmt(result["base"]["reward"], ".3f") + ")",
         _fmt(v["heldout"]["reward"], ".3f"), _fmt(t["heldout"]["reward"], ".3f"),
         ("+" if (q["reward_diff"] or 0) >= 0 else "") + _fmt(q["reward_diff"], ".3f")),
        ("held-out success (reward > 0.5)", _fmt(v["heldout"]["success_rate"], ".3f"),
         _fmt(t["heldout"]["success_rate"], ".3f"), ""),
    ]  # fmt: skip
    out = "| | vintage | TRL GRPOTrainer | vintage / TRL |\n|---|---|---|---|\n"
    return out + "\n".join(f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows) + "\n"


# -- the shared held-out evaluation ------------------------------------------------------------------


def evaluate_heldout(
    model, tokenizer, rows: list[dict[str, Any]], reward: EnvReward, max_new_tokens: int, batch_size: int = 50
) -> dict[str, Any]:
    """Mean environment reward of greedy replies to ``rows`` (:func:`prompt_rows`).

    Prompts are rendered with the tokenizer's chat template (generation prompt on, no extra special
    tokens, as the rollout worker does), left-padded, decoded greedily for at most
    ``max_new_tokens`` tokens; replies are decoded without special tokens and scored by
    ``reward.score``. Returns ``{"reward": mean, "success_rate": share > 0.5, "episodes": n}``.
    """
    import torch

    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.eval()
    scores: list[float] = []
    for i in range(0, len(rows), batch_size):
        chunk = rows[i : i + batch_size]
        texts = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in chunk]
        enc = tokenizer(texts, add_special_tokens=False, padding=True, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(
                **enc,
                do_sample=False,
                max_new_tokens=max_new_tokens,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
                temperature=None,
                top_p=None,
                top_k=None,
            )
        replies = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        scores += [reward.score(text, r["seed"]) for text, r in zip(replies, chunk, strict=True)]
    n = len(scores)
    return {
        "reward": sum(scores) / n if n else None,
        "success_rate": sum(s > 0.5 for s in scores) / n if n else None,
        "episodes": n,
    }


def vintage_state_dict(checkpoints: Path) -> dict[str, Any]:
    """Model weights of the newest complete vintage checkpoint in ``checkpoints`` (DeepSpeed's
    ``mp_rank_00_model_states.pt``, ``module`` entry: full weights for ZeRO stages 0-2).

    Raises:
        FileNotFoundError: no complete checkpoint, or its model-states file is missing.
    """
    import torch

    from trainer.learner.checkpoint import latest_tag

    tag = latest_tag(checkpoints)
    if tag is None:
        raise FileNotFoundError(f"{checkpoints}: no complete vintage checkpoint")
    path = checkpoints / tag / "mp_rank_00_model_states.pt"
    if not path.is_file():
        raise FileNotFoundError(f"{path} missing")
    # written by this run's own learner; holds DeepSpeed's non-tensor bookkeeping besides the weights
    return torch.load(path, map_location="cpu", weights_only=False)["module"]


def load_policy(model_path: Path, state_dict: dict[str, Any] | None = None):
    """The fp32 HF model at ``model_path``, with ``state_dict`` loaded over it when given.

    Raises:
        ValueError: ``state_dict`` misses a weight of the model or has one it lacks.
    """
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    if state_dict is not None:
        missing, unexpected = model.load_state_dict(state_dict, strict=False)
        tied = set(getattr(model, "_tied_weights_keys", None) or {})
        missing = [k for k in missing if k not in tied]
        if missing or unexpected:
            raise ValueError(f"state_dict: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return model
