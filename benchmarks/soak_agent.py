"""The outside agent of the chaos soak: a process of its own that trains through a job's gateway.

It reads the gateway's URL and admin token from ``<run_dir>/gateway.json`` (again after every
connection failure: a resumed job serves on a new port), and keeps ``--groups`` GRPO groups of
``--group-size`` sessions running. A session is two chat calls, the second extending the first
(the reply as returned, then a user turn), then ``POST /v1/sessions/{id}/end`` with a reward that
depends on the sampled text (``(sum of its code points) mod 3 / 2``: 0, 0.5 or 1), so groups have
variance. Refusals with ``Retry-After`` (429, 503) are waited out; any other failure abandons the
session (it stays open in the gateway, as when an agent dies) and is counted.

After every change it writes ``--status`` (JSON, replaced atomically): its ``pid``, ``in_flight``
(chat calls awaiting an answer now), ``open`` (sessions it opened and has not ended), ``opened``,
``ended``, ``abandoned`` (opened, then a call failed: left open) and ``errors`` by kind (also
failures to open), so the soak can kill it mid-call.

    python -m benchmarks.soak_agent --run-dir runs/soak/agent --status runs/soak/agent-status.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from collections import Counter
from pathlib import Path

import httpx


class AgentState:
    """The counters written to the status file (see the module docstring)."""

    def __init__(self, path: Path):
        self.path = path
        self.in_flight = self.open = self.opened = self.ended = self.abandoned = 0
        self.errors: Counter = Counter()

    def write(self) -> None:
        row = {
            "pid": os.getpid(), "in_flight": self.in_flight, "open": self.open, "opened": self.opened,
            "ended": self.ended, "abandoned": self.abandoned, "errors": dict(self.errors),
        }  # fmt: skip
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(row))
        os.replace(tmp, self.path)


def reward_of(text: str) -> float:
    """``(sum of the code points of text) mod 3 / 2``: 0.0, 0.5 or 1.0."""
    return (sum(map(ord, text)) % 3) / 2


async def _post(client: httpx.AsyncClient, url: str, token: str, body: dict) -> dict:
    """POST ``body``; waits out 429 / 503 with ``Retry-After`` (at most 60 tries). Raises httpx errors."""
    for _ in range(60):
        r = await client.post(url, json=body, headers={"Authorization": f"Bearer {token}"})
        if r.status_code in (429, 503) and "retry-after" in r.headers:
            await asyncio.sleep(min(5.0, float(r.headers["retry-after"])))
            continue
        r.raise_for_status()
        return r.json()
    raise httpx.HTTPError(f"{url}: still refused after 60 tries")


async def session(client: httpx.AsyncClient, gw: dict, group: str, k: int, st: AgentState) -> None:
    """One session of ``group`` (see the module docstring)."""
    s = await _post(client, f"{gw['url']}/v1/sessions", gw["token"], {"group_id": group, "train": True})
    st.opened += 1
    st.open += 1
    st.write()
    try:
        messages = [{"role": "user", "content": f"Count from {k} to {k + 3}."}]
        text = ""
        for _ in range(2):
            st.in_flight += 1
            st.write()
            try:
                url = f"{s['base_url']}/chat/completions"
                reply = await _post(client, url, s["key"], {"model": "vintage", "messages": messages})
            finally:
                st.in_flight -= 1
            content = reply["choices"][0]["message"]["content"] or ""
            text += content
            messages += [{"role": "assistant", "content": content}, {"role": "user", "content": "Go on."}]
        await _post(client, f"{gw['url']}/v1/sessions/{s['id']}/end", gw["token"], {"reward": reward_of(text)})
        st.ended += 1
    except BaseException:
        st.abandoned += 1  # left open in the gateway, as by an agent that died
        raise
    finally:
        st.open -= 1
    st.write()


async def run(run_dir: Path, st: AgentState, groups: int, group_size: int) -> None:
    """Keep ``groups`` groups of ``group_size`` sessions running until the process is ended."""
    counter = 0

    async def one_group() -> None:
        nonlocal counter
        while True:
            try:
                gw = json.loads((run_dir / "gateway.json").read_text())
            except (OSError, ValueError):
                await asyncio.sleep(1.0)
                continue
            counter += 1
            group = f"a{os.getpid()}-{counter}"
            async with httpx.AsyncClient(timeout=httpx.Timeout(120.0)) as client:
                got = await asyncio.gather(
                    *(session(client, gw, group, counter * group_size + k, st) for k in range(group_size)),
                    return_exceptions=True,
                )
            failed = [e for e in got if isinstance(e, BaseException)]
            for e in failed:
                st.errors[type(e).__name__] += 1
            st.write()
            if failed:
                await asyncio.sleep(2.0)

    st.write()
    await asyncio.gather(*(one_group() for _ in range(groups)))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", type=Path, required=True, help="The job's run folder (its gateway.json).")
    ap.add_argument("--status", type=Path, required=True, help="Status JSON written after every change.")
    ap.add_argument("--groups", type=int, default=2, help="GRPO groups running at once.")
    ap.add_argument("--group-size", type=int, default=4, help="Sessions per group (rollout.sampling.n).")
    a = ap.parse_args(argv)
    if a.groups < 1 or a.group_size < 1:
        raise SystemExit(f"--groups / --group-size: expected >= 1, got {a.groups} / {a.group_size}")
    asyncio.run(run(a.run_dir, AgentState(a.status), a.groups, a.group_size))


if __name__ == "__main__":
    main()
