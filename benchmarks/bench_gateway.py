"""The gateway's cost: the same agent work through the OpenAI API vs the in-process agent loop.

    python -m benchmarks.bench_gateway [--model smollm2|tiny|PATH] [--engine vllm|transformers]
                                       [--episodes 32] [--max-tokens 24] [--calls 20]

1. Throughput: ``--episodes`` retail episodes (easy, 3 turns) generated (a) by the rollout worker's
   in-process agent loop (env requests) and (b) by the retail OpenAI-client agent
   (:mod:`rollout.agents.retail`) through the gateway over HTTP on 127.0.0.1, all episodes at once,
   on the same worker and engine. Tokens/s counts sampled tokens (loss mask 1); the ratio is
   gateway / in-process (goal >= 0.9).
2. Added latency per call: ``--calls`` sequential one-token calls on the same chat prompt, through
   the gateway (client-side wall time) and as an in-process prompt-ids request (submit to result);
   the difference of the medians is what the gateway adds to one call. The gateway's own estimate
   (time in the handler outside generation) is reported next to it.

The worker runs in a Ray actor, as in a job (the gateway and the agents in this process);
``--in-process-worker`` puts it in this process instead, sharing the GIL with the HTTP stack.

Prints a table and writes ``runs/bench/gateway.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

from protocol import EnvRef, RolloutRequest, SamplingParams  # noqa: E402
from rollout.agent import TemplateChatFormat  # noqa: E402
from rollout.agents import retail  # noqa: E402
from rollout.engine import EngineConfig, make_engine  # noqa: E402
from rollout.gateway import Gateway, GatewayServer, WorkerBackend  # noqa: E402
from rollout.worker import RolloutWorkerCore  # noqa: E402

RETAIL = "rollout.envs.retail:RetailEnv"
KWARGS = {"level": "easy", "max_turns": 3}


def _drain(core: RolloutWorkerCore, k: int, timeout_s: float = 3600) -> list:
    got, end = [], time.time() + timeout_s
    while len(got) < k and time.time() < end:
        got += core.poll()
        time.sleep(0.002)
    return got


def in_process(core: RolloutWorkerCore, seeds: list[int], max_tokens: int, tag: str) -> dict:
    reqs = [
        RolloutRequest(
            request_id=f"{tag}{s}",
            group_id=tag,
            env=EnvRef(path=RETAIL, kwargs=KWARGS, seed=s),
            sampling=SamplingParams(max_tokens=max_tokens),
        )
        for s in seeds
    ]
    t0 = time.perf_counter()
    core.submit(reqs)
    got = _drain(core, len(reqs))
    dt = time.perf_counter() - t0
    n = sum(t.num_generated for t in got)
    return {"episodes": len(got), "tokens": n, "seconds": dt, "tokens_per_s": n / dt}


async def _agents(gw: Gateway, url: str, seeds: list[int]) -> list:
    import openai

    async def one(seed: int):
        s = gw.open_session()
        client = openai.AsyncOpenAI(base_url=f"{url}/sessions/{s.session_id}/v1", api_key=s.key, max_retries=0)
        try:
            out = await retail.run({"seed": seed, "env": {"kwargs": KWARGS}}, client)
        finally:
            await client.close()
        return gw.end_session(s.session_id, reward=out["reward"])

    return await asyncio.gather(*(one(s) for s in seeds))


def through_gateway(gw: Gateway, url: str, seeds: list[int]) -> dict:
    t0 = time.perf_counter()
    ended = asyncio.run(_agents(gw, url, seeds))
    dt = time.perf_counter() - t0
    n = sum(t.num_generated for e in ended for t in e.trajectories)
    return {"episodes": len(ended), "tokens": n, "seconds": dt, "tokens_per_s": n / dt}


def latency(core: RolloutWorkerCore, gw: Gateway, url: str, chat, calls: int) -> dict:
    import openai

    msgs = [
        {"role": "system", "content": retail.RetailEnv().reset(0)[0][0]["content"]},
        {"role": "user", "content": "Hi"},
    ]
    ids = chat.prompt_ids(msgs)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=gw.admin_token, max_retries=0)
    client.chat.completions.create(model="vintage", messages=msgs, max_tokens=1)  # connection warm-up
    before = gw.stats.overhead_s, gw.stats.calls
    direct, via = [], []
    for i in range(calls):  # alternate the two paths so a busy machine slows both alike
        t0 = time.perf_counter()
        req = RolloutRequest(
            request_id=f"lat{i}", group_id="lat", prompt_ids=ids, sampling=SamplingParams(max_tokens=1)
        )
        core.submit(req)
        _drain(core, 1)
        direct.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        client.chat.completions.create(model="vintage", messages=msgs, max_tokens=1)
        via.append(time.perf_counter() - t0)
    handler_ms = 1e3 * (gw.stats.overhead_s - before[0]) / max(1, gw.stats.calls - before[1])
    return {
        "calls": calls,
        "prompt_tokens": len(ids),
        "in_process_ms_median": 1e3 * statistics.median(direct),
        "gateway_ms_median": 1e3 * statistics.median(via),
        "added_ms_median": 1e3 * (statistics.median(via) - statistics.median(direct)),
        "gateway_handler_overhead_ms_mean": handler_ms,
    }


class RayWorker:
    """A :data:`rollout.worker_actor.RolloutWorker` actor behind the core's ``submit/poll/version/close``, as in a job."""

    def __init__(self, cfg: EngineConfig):
        import ray

        from rollout.worker_actor import RolloutWorker

        if not ray.is_initialized():
            ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
        self._ray = ray
        self.actor = RolloutWorker.remote(cfg, max_num_seqs=cfg.max_num_seqs)
        ray.get(self.actor.ready.remote())

    def submit(self, requests) -> int:
        return self._ray.get(self.actor.submit.remote(requests if isinstance(requests, list) else [requests]))

    def poll(self) -> list:
        return self._ray.get(self.actor.poll.remote())

    @property
    def version(self) -> int:
        return 0

    def close(self) -> None:
        self._ray.get(self.actor.close.remote())
        self._ray.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--engine", default="vllm", choices=["vllm", "transformers"])
    ap.add_argument("--episodes", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--out", default="runs/bench/gateway.json")
    ap.add_argument(
        "--in-process-worker",
        action="store_true",
        help="run the worker in this process (shares the GIL with the gateway and the agents) instead of a Ray actor",
    )
    a = ap.parse_args()
    from transformers import AutoTokenizer

    from modelkit.modelhub import make_tiny_model, prepare_smollm2

    real = prepare_smollm2() if a.model in ("smollm2", "tiny") else Path(a.model)
    path = make_tiny_model(seed=0, tokenizer_from=real) if a.model == "tiny" else real
    chat = TemplateChatFormat(AutoTokenizer.from_pretrained(path))
    cfg = EngineConfig(
        kind=a.engine, model_path=str(path), max_model_len=2048, kv_cache_gib=1, max_num_seqs=max(a.episodes, 8)
    )
    if a.in_process_worker:
        core = RolloutWorkerCore(make_engine(cfg), chat=chat, max_num_seqs=cfg.max_num_seqs)
        core.start()
    else:
        core = RayWorker(cfg)
    backend = WorkerBackend.over_core(core)
    gw = Gateway(backend, chat, cfg.max_model_len, default_max_tokens=a.max_tokens)
    server = GatewayServer(gw).start()
    try:
        in_process(core, [10_000, 10_001], a.max_tokens, "warm")  # engine warm-up
        seeds = list(range(a.episodes))
        result = {
            "model": str(path),
            "engine": a.engine,
            "episodes": a.episodes,
            "max_tokens": a.max_tokens,
            "worker": "in-process" if a.in_process_worker else "ray actor",
            "in_process": in_process(core, seeds, a.max_tokens, "ip"),
            "gateway": through_gateway(gw, server.url, seeds),
        }
        result["throughput_ratio"] = result["gateway"]["tokens_per_s"] / result["in_process"]["tokens_per_s"]
        result["latency"] = latency(core, gw, server.url, chat, a.calls)
        result["gateway_status"] = gw.status().model_dump()
    finally:
        server.stop()
        backend.close()
        core.close()
    for k in ("in_process", "gateway"):
        r = result[k]
        print(
            f"{k:12s} {r['tokens_per_s']:8.1f} tok/s  ({r['tokens']} tokens, {r['episodes']} episodes, {r['seconds']:.1f} s)"
        )
    lat = result["latency"]
    print(f"throughput ratio  {result['throughput_ratio']:.3f}  (gateway / in-process; goal >= 0.9)")
    print(
        f"one-token call    in-process {lat['in_process_ms_median']:.1f} ms   gateway {lat['gateway_ms_median']:.1f} ms   "
        f"added {lat['added_ms_median']:.1f} ms   (in the handler {lat['gateway_handler_overhead_ms_mean']:.2f} ms)"
    )
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
