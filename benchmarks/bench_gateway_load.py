"""The gateway under load: concurrent agent sessions over HTTP with bad and abandoned calls mixed in.

    python -m benchmarks.bench_gateway_load [--sessions 64] [--calls 3] [--max-tokens 8] [--rounds 2]
                                            [--model tiny|smollm2|PATH] [--engine transformers|vllm]
    vintage bench gateway-load

Each round opens ``--sessions`` sessions at once through ``POST /v1/sessions`` on the real gateway
(:class:`rollout.gateway.GatewayServer`, uvicorn on 127.0.0.1) in front of a rollout worker in a
Ray actor, as in a job. Every session makes ``--calls`` chat calls with the ``openai`` client (the
history grows by the reply and one user turn each time) and then ends with a reward. Every third
session (0, 3, 6, ...) also makes one extra call, before its ``session // 3 mod 3``-th good call,
of the kind ``KINDS[(session // 3) mod 7]`` (httpx, raw): with 64 sessions and 3 calls that is 22
extra calls among 214 (10.3%), 3-4 of each kind:

    bad_json        a body that is not JSON                          400, param body
    wrong_type      ``max_tokens: "eight"``                          400, param max_tokens
    unknown_session a session id that was never opened               404, param session_id
    body_too_large  a body one byte over ``--max-body-bytes``        413, param body
    over_context    a prompt over the engine's context (in tokens)   400, param messages
    unauthorised    the session's URL with another key               401, param api_key
    abandoned       a good call whose client disconnects after ``--abandon-after-s``

An abandoned call is sampled but never recorded (the gateway counts it in ``abandoned_calls``), so
the calls recorded are the good ones plus any abandoned call that finished before its client left;
one whose client gave up before its request reached the gateway (still connecting, under load) is
in neither count.
At the end of every round, once no call is pending: the gateway's open sessions, pending calls,
call locks and key table (all 0 when nothing leaks), the sessions it still remembers and the
resident memory (RSS) of this process (the gateway, its server and the clients; the worker is
another process). Refusals: per kind, the status codes and error messages the clients got and
whether each names its field (``param`` set and the message starting with a field name); the
gateway's own count per status (``errors``) must equal the clients' (each refusal counted once).
Latency: p50 / p99 of the good calls, client wall time, milliseconds (numpy's linear percentile).

Bounded: ``--sessions * (--calls + 1) * --rounds`` calls, each with a 120 s client timeout, every
round within ``--budget-s``. Prints a table and writes ``results/gateway_load.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import re
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

KINDS = ["bad_json", "wrong_type", "unknown_session", "body_too_large", "over_context", "unauthorised", "abandoned"]
EXPECTED = {
    "bad_json": (400, "body"),
    "wrong_type": (400, "max_tokens"),
    "unknown_session": (404, "session_id"),
    "body_too_large": (413, "body"),
    "over_context": (400, "messages"),
    "unauthorised": (401, "api_key"),
}
"""The status and ``param`` each refused kind must get."""


def extra_call(session: int, calls: int) -> tuple[int, str] | None:
    """``(before which good call, kind)`` of session ``session``'s extra call, or None (two of three
    sessions make none). Example: session 9 of 3 calls: before call 0, kind ``KINDS[3]``."""
    if session % 3:
        return None
    k = session // 3
    return k % calls, KINDS[k % len(KINDS)]


def named(status: int, body: Any) -> bool:
    """True when ``body`` is the OpenAI error shape with ``code == status``, a ``param`` and a
    message that starts with a field name (``max_tokens: ...``, ``request body: ...``)."""
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict) or err.get("code") != status or not err.get("param"):
        return False
    return re.match(r"^[a-z_][a-z_ .\[\]0-9]*: ", str(err.get("message", ""))) is not None


def percentile_ms(xs: list[float], q: float) -> float | None:
    """The ``q``-th percentile (linear interpolation, numpy's default) of ``xs`` seconds, in ms."""
    import numpy as np

    return float(1e3 * np.percentile(xs, q)) if xs else None


def refusal_body(kind: str, url: str, sid: str, key: str, max_body: int, context: int) -> tuple[str, dict]:
    """``(url, httpx request keywords)`` of the refused call ``kind`` in session ``sid``."""
    call = f"{url}/sessions/{sid}/v1/chat/completions"
    auth = {"Authorization": f"Bearer {key}"}
    json_h = {**auth, "Content-Type": "application/json"}
    msgs = [{"role": "user", "content": "Hi"}]
    if kind == "bad_json":
        return call, {"content": b'{"model": "vintage", "messages": [', "headers": json_h}
    if kind == "wrong_type":
        return call, {"json": {"model": "vintage", "messages": msgs, "max_tokens": "eight"}, "headers": auth}
    if kind == "unknown_session":
        return f"{url}/sessions/s-0000000000000000/v1/chat/completions", {"json": {"messages": msgs}, "headers": auth}
    if kind == "body_too_large":
        pad = max_body + 1 - len(json.dumps({"messages": [{"role": "user", "content": ""}]}))
        body = json.dumps({"messages": [{"role": "user", "content": "x" * pad}]}).encode()
        return call, {"content": body, "headers": json_h}
    if kind == "over_context":
        return call, {"json": {"messages": [{"role": "user", "content": "word " * (2 * context)}]}, "headers": auth}
    if kind == "unauthorised":
        return call, {"json": {"messages": msgs}, "headers": {"Authorization": "Bearer sk-vintage-not-this-one"}}
    raise ValueError(f"kind: {kind!r} is not a refused kind")


class Round:
    """One round's client-side record: good-call latencies, refusals by kind, abandoned calls."""

    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.good_failed: Counter = Counter()
        self.refused: dict[str, list[dict]] = {k: [] for k in EXPECTED}
        self.abandoned = self.abandon_completed = 0
        self.session_errors: Counter = Counter()
        """Sessions that could not open or end (the exception, its numbers and ids shaped out)."""

    def summary(self) -> dict[str, Any]:
        kinds = {}
        for kind, rows in self.refused.items():
            want_status, want_param = EXPECTED[kind]
            kinds[kind] = {
                "calls": len(rows),
                "statuses": dict(Counter(str(r["status"]) for r in rows)),
                "messages": dict(Counter(r["message"] for r in rows)),
                "params": dict(Counter(str(r["param"]) for r in rows)),
                "as_expected": all(r["status"] == want_status and r["param"] == want_param for r in rows),
                "named": all(r["named"] for r in rows),
            }
        return {
            "good_calls": len(self.latencies),
            "good_failed": dict(self.good_failed),
            "latency_ms": {
                "p50": percentile_ms(self.latencies, 50),
                "p99": percentile_ms(self.latencies, 99),
                "mean": 1e3 * statistics.fmean(self.latencies) if self.latencies else None,
            },
            "refusals": kinds,
            "session_errors": dict(self.session_errors),
            "abandoned": self.abandoned,
            "abandon_completed_first": self.abandon_completed,
        }


async def _refuse(http, rec: Round, kind: str, url: str, s: dict, args) -> None:
    import httpx

    target, kw = refusal_body(kind, url, s["id"], s["key"], args.max_body_bytes, args.max_model_len)
    try:
        r = await http.post(target, **kw)
    except httpx.TransportError as e:  # no answer at all: an unnamed refusal
        rec.refused[kind].append(
            {"status": 0, "message": f"{type(e).__name__}: {e}"[:200], "param": None, "named": False}
        )
        return
    try:
        body = r.json()
    except ValueError:
        body = {"raw": r.text[:200]}
    err = body.get("error", {}) if isinstance(body, dict) else {}
    rec.refused[kind].append(
        {
            "status": r.status_code,
            "message": _shape(str(err.get("message"))),
            "param": err.get("param"),
            "named": named(r.status_code, body),
        }
    )


def _shape(message: str) -> str:
    """``message`` with its numbers and quoted ids replaced (so equal refusals count as one message)."""
    return re.sub(r"\d+", "N", re.sub(r"'[^']*'", "'...'", message))


async def _abandon(http, rec: Round, url: str, s: dict, messages: list, args) -> None:
    body = {"model": "vintage", "messages": messages, "max_tokens": args.max_tokens}
    call = http.post(
        f"{url}/sessions/{s['id']}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {s['key']}"}
    )
    rec.abandoned += 1
    try:
        await asyncio.wait_for(call, args.abandon_after_s)
        rec.abandon_completed += 1
    except TimeoutError:
        pass  # the client closed its connection mid-call


async def _session(i: int, gw_url: str, admin: str, http, rec: Round, args) -> None:
    import openai

    r = await http.post(f"{gw_url}/v1/sessions", json={}, headers={"Authorization": f"Bearer {admin}"})
    r.raise_for_status()
    s = r.json()
    client = openai.AsyncOpenAI(base_url=s["base_url"], api_key=s["key"], max_retries=0, timeout=120.0)
    messages = [{"role": "user", "content": f"Count from 1 to {3 + i % 7}."}]
    extra = extra_call(i, args.calls)
    try:
        for j in range(args.calls):
            if extra is not None and extra[0] == j:
                if extra[1] == "abandoned":
                    await _abandon(http, rec, gw_url, s, messages, args)
                else:
                    await _refuse(http, rec, extra[1], gw_url, s, args)
            t0 = time.perf_counter()
            try:
                reply = await client.chat.completions.create(
                    model="vintage", messages=messages, max_tokens=args.max_tokens
                )
            except openai.APIStatusError as e:
                rec.good_failed[f"{e.status_code}: {_shape(e.message)}"[:200]] += 1
                continue
            except openai.APIConnectionError as e:
                rec.good_failed[f"no answer: {type(e.__cause__ or e).__name__}"] += 1
                continue
            rec.latencies.append(time.perf_counter() - t0)
            messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""}]
            messages += [{"role": "user", "content": "Go on."}]
        r = await http.post(
            f"{gw_url}/v1/sessions/{s['id']}/end", json={"reward": 1.0}, headers={"Authorization": f"Bearer {s['key']}"}
        )
        r.raise_for_status()
    finally:
        await client.close()


async def run_round(gw_url: str, admin: str, args) -> Round:
    """``args.sessions`` sessions at once (see the module docstring), within ``args.budget_s``."""
    import httpx

    rec = Round()
    limits = httpx.Limits(max_connections=4 * args.sessions, max_keepalive_connections=args.sessions)
    async with httpx.AsyncClient(timeout=120.0, limits=limits) as http:
        jobs = [_session(i, gw_url, admin, http, rec, args) for i in range(args.sessions)]
        done = await asyncio.wait_for(asyncio.gather(*jobs, return_exceptions=True), args.budget_s)
    rec.session_errors.update(f"{type(e).__name__}: {_shape(str(e))}"[:200] for e in done if e is not None)
    return rec


def gateway_tables(gw) -> dict[str, int]:
    """Sizes of the gateway's tables that must not grow with the sessions that ended."""
    b = gw.backend
    return {
        "sessions_open": gw.status().sessions_open,
        "calls_pending": b.pending,
        "call_locks": len(gw._call_locks),
        "keys_of_open_sessions": len(gw._by_key),
        "sessions_remembered": len(gw._sessions),
        "ended_keys_remembered": len(gw._ended_keys),
        "abandoned_ids_remembered": len(b._abandoned),
        "sessions_waiting_for_group": gw.groups.waiting,
    }


def wait_idle(gw, timeout_s: float = 120.0) -> float:
    """Seconds until no call is pending (at most ``timeout_s``)."""
    t0 = time.monotonic()
    while gw.backend.pending and time.monotonic() - t0 < timeout_s:
        time.sleep(0.05)
    return time.monotonic() - t0


def rss_mib() -> float:
    import psutil

    gc.collect()
    return psutil.Process().memory_info().rss / 2**20


def _checks(rounds: list[dict]) -> dict[str, bool]:
    last = rounds[-1]
    t = last["tables"]
    return {
        "no_leak": all(r["tables"]["sessions_open"] == 0 and r["tables"]["calls_pending"] == 0 for r in rounds)
        and t["call_locks"] == 0
        and t["keys_of_open_sessions"] == 0,
        "refusals_counted_once": all(r["refused_by_status_client"] == r["refused_by_status_gateway"] for r in rounds),
        "every_refusal_named": all(k["named"] for r in rounds for k in r["client"]["refusals"].values()),
        "refusals_as_expected": all(k["as_expected"] for r in rounds for k in r["client"]["refusals"].values()),
        "good_calls_all_served": all(not r["client"]["good_failed"] for r in rounds),
        "sessions_all_ended": all(not r["client"]["session_errors"] for r in rounds),
        "abandoned_calls_not_recorded": all(
            r["calls_recorded"] == r["client"]["good_calls"] + r["client"]["abandon_completed_first"]
            and r["abandoned_calls_gateway"] <= r["client"]["abandoned"] - r["client"]["abandon_completed_first"]
            for r in rounds
        ),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", default="tiny", help="tiny (a random 2-layer model, SmolLM2's tokenizer), smollm2 or an HF folder"
    )
    ap.add_argument("--engine", default="transformers", choices=["transformers", "vllm"])
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--calls", type=int, default=3, help="good chat calls per session")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--max-body-bytes", type=int, default=1 << 20)
    ap.add_argument("--abandon-after-s", type=float, default=0.05)
    ap.add_argument("--budget-s", type=float, default=600.0, help="longest one round may take, seconds")
    ap.add_argument("--out", default="results/gateway_load.json")
    a = ap.parse_args(argv)
    from transformers import AutoTokenizer

    from trainer.driver.cluster.environment import defaults_env

    defaults_env()  # the job's defaults, before Ray starts: one thread per process, Ray's memory monitor off
    from benchmarks.bench_gateway import RayWorker
    from benchmarks.machine import machine_facts
    from modelkit.modelhub import make_tiny_model, prepare_smollm2
    from rollout.agent import TemplateChatFormat
    from rollout.engine import EngineConfig
    from rollout.gateway import Gateway, GatewayServer, WorkerBackend

    t_start = time.perf_counter()
    real = prepare_smollm2() if a.model in ("smollm2", "tiny") else Path(a.model)
    path = make_tiny_model(seed=0, tokenizer_from=real) if a.model == "tiny" else real
    chat = TemplateChatFormat(AutoTokenizer.from_pretrained(path))
    cfg = EngineConfig(kind=a.engine, model_path=str(path), max_model_len=a.max_model_len, max_num_seqs=a.sessions)
    core = RayWorker(cfg)
    backend = WorkerBackend(core.submit, core.poll, lambda: core.version)
    gw = Gateway(backend, chat, a.max_model_len, default_max_tokens=a.max_tokens)
    server = GatewayServer(gw, max_body_bytes=a.max_body_bytes).start()
    result: dict[str, Any] = {"settings": {**vars(a), "model_path": str(path)}, "rounds": []}
    try:
        import openai

        warm = openai.OpenAI(base_url=f"{server.url}/v1", api_key=gw.admin_token, max_retries=0)
        warm.chat.completions.create(model="vintage", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
        result["rss_mib_before"] = rss_mib()
        for k in range(a.rounds):
            before = gw.status()
            errors_before = Counter(before.errors)
            t0 = time.perf_counter()
            rec = asyncio.run(run_round(server.url, gw.admin_token, a))
            seconds = time.perf_counter() - t0
            idle_s = wait_idle(gw)
            ended = gw.take_ended()
            st = gw.status()
            client = rec.summary()
            by_status = Counter()
            for kind in client["refusals"].values():
                by_status.update(kind["statuses"])
            result["rounds"].append(
                {
                    "round": k,
                    "seconds": seconds,
                    "idle_after_s": idle_s,
                    "client": client,
                    "refused_by_status_client": dict(sorted(by_status.items())),
                    "refused_by_status_gateway": dict(sorted((Counter(st.errors) - errors_before).items())),
                    "tables": gateway_tables(gw),
                    "calls_recorded": st.calls - before.calls,
                    "abandoned_calls_gateway": st.abandoned_calls - before.abandoned_calls,
                    "splits": st.splits - before.splits,
                    "sessions_ended_handed_over": len(ended),
                    "trajectories": sum(len(e.trajectories) for e in ended),
                    "status": st.model_dump(),
                    "rss_mib_after": rss_mib(),
                    "load_average": os.getloadavg(),
                }
            )
        result["checks"] = _checks(result["rounds"])
        result["machine"] = machine_facts(t_start)
    finally:
        server.stop()
        backend.close()
        core.close()
    _print(result)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {out}")
    return result


def _print(result: dict[str, Any]) -> None:
    print(f"RSS before the load: {result['rss_mib_before']:.1f} MiB")
    for r in result["rounds"]:
        c, t = r["client"], r["tables"]
        lat = c["latency_ms"]
        print(
            f"round {r['round']}: {c['good_calls']} good calls in {r['seconds']:.1f} s (load {r['load_average'][0]:.1f}), "
            f"p50 {lat['p50']:.0f} ms, p99 {lat['p99']:.0f} ms; abandoned {c['abandoned']} "
            f"({c['abandon_completed_first']} completed first); RSS after {r['rss_mib_after']:.1f} MiB"
        )
        print(f"  {'kind':16s} {'calls':>5s}  {'status':10s} {'param':12s} named  message")
        for kind, k in c["refusals"].items():
            msg = "; ".join(k["messages"])[:90]
            print(
                f"  {kind:16s} {k['calls']:5d}  {','.join(k['statuses']):10s} {','.join(k['params']):12s} "
                f"{'yes' if k['named'] else 'NO ':5s}  {msg}"
            )
        print(
            f"  refusals by status: clients {r['refused_by_status_client']}, gateway {r['refused_by_status_gateway']}"
        )
        print(
            f"  calls recorded {r['calls_recorded']}, abandoned (gateway) {r['abandoned_calls_gateway']}, "
            f"splits {r['splits']}, trajectories {r['trajectories']} of {r['sessions_ended_handed_over']} sessions"
        )
        print(f"  tables after: {t}")
    print(f"checks: {result['checks']}")


if __name__ == "__main__":
    main()
