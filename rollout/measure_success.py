"""Starting success rate of a model on the built-in environments (real engine, real agent loop).

    python -m rollout.measure_success --episodes 64 --temperature 1.0 [--model PATH] [--json OUT]

Success = episode reward >= 1.0 (reasoning-gym: exact answer; retail: final database == goal).
The mean reward is reported too (reasoning-gym's scorer gives partial credit).
"""

from __future__ import annotations

import argparse
import json
import time

from protocol import EnvRef, RolloutRequest, SamplingParams
from rollout.engine import EngineConfig, make_engine
from rollout.worker import RolloutWorkerCore

ENVS = {
    "reasoning_gym/basic_arithmetic/easy": (
        "rollout.envs.reasoning_gym_env:ReasoningGymEnv",
        {"dataset": "basic_arithmetic", "level": "easy"},
    ),
    "reasoning_gym/basic_arithmetic/easy_mixed": (
        "rollout.envs.reasoning_gym_env:ReasoningGymEnv",
        {"dataset": "basic_arithmetic", "level": "easy_mixed"},
    ),
    "retail/easy": ("rollout.envs.retail:RetailEnv", {"level": "easy"}),
    "retail/medium": ("rollout.envs.retail:RetailEnv", {"level": "medium"}),
}


def measure(core: RolloutWorkerCore, name: str, episodes: int, temperature: float, max_tokens: int) -> dict:
    """Run ``episodes`` episodes of one environment; returns success rate, mean reward, tokens, seconds."""
    path, kwargs = ENVS[name]
    reqs = [
        RolloutRequest(
            request_id=f"{name}#{i}",
            group_id=name,
            env=EnvRef(path=path, kwargs=kwargs, seed=i),
            sampling=SamplingParams(temperature=temperature, max_tokens=max_tokens),
        )
        for i in range(episodes)
    ]
    t0 = time.perf_counter()
    core.submit(reqs)
    trajs = core.run_until_idle(timeout_s=3600)
    rewards = [t.reward for t in trajs]
    return {
        "env": name,
        "episodes": len(trajs),
        "temperature": temperature,
        "success_rate": sum(r >= 1.0 for r in rewards) / len(trajs),
        "mean_reward": sum(rewards) / len(trajs),
        "generated_tokens": sum(t.num_generated for t in trajs),
        "truncated": sum(t.truncated for t in trajs),
        "seconds": time.perf_counter() - t0,
        "example": core.chat.decode(trajs[0].token_ids[trajs[0].prompt_len :].tolist())[:300],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="HF folder; default: SmolLM2-135M-Instruct")
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--envs", nargs="*", default=list(ENVS))
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.model is None:
        from modelkit.modelhub import prepare_smollm2

        a.model = str(prepare_smollm2())
    core = RolloutWorkerCore(
        make_engine(EngineConfig(model_path=a.model, max_model_len=2048, kv_cache_gib=1)), max_num_seqs=64
    )
    results = []
    for n in a.envs:
        r = measure(core, n, a.episodes, a.temperature, a.max_tokens)
        results.append(r)
        print(
            f"{r['env']:45s} success {r['success_rate']:.3f}  mean reward {r['mean_reward']:.3f}  "
            f"({r['episodes']} episodes, {r['generated_tokens']} tokens, {r['seconds']:.0f} s)",
            flush=True,
        )
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(results, fh, indent=1)
    core.close()


if __name__ == "__main__":
    main()
