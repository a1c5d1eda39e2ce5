"""Chaos soak: a long tiny-model run on a two-node loopback Ray cluster while parts are killed.

Two phases share ``--minutes``, one after the other, on one cluster (a job is either the env loop
or agents through the gateway, never both). A phase's clock runs only while its job's status says
``running``: start-up (at most ``--start-timeout`` s) and the restart after a killed learner come on
top (a phase ends after at most ``WALL_FACTOR`` times its minutes of wall time):

* ``env``: the env loop (reasoning-gym arithmetic) trains; killed parts: a rollout worker, the
  old-logit service, the learner, the second node (``ENV_KINDS``);
* ``agent``: a job with ``[agent]`` and no in-process agent trains on the sessions of an outside
  agent process (:mod:`benchmarks.soak_agent`) through the gateway; killed parts: the same, plus the
  agent mid-call (``AGENT_KINDS``).

The cluster (:class:`deploy.local_cluster.LocalRayHead`, 127.0.0.1, token auth) has a head with
the learner and one rollout worker and a second node with the other rollout worker and the
old-logit service, as in ``tests/integration/test_node_loss.py``. Each job is ``vintage run
--address <head> --resume auto`` in a process of its own, the tiny model on the transformers
engine, the snapshot route, ``max_staleness = 2``, a checkpoint after every version.

Kills (:func:`benchmarks.soak_logic.kill_schedule`, seeded) come every ``--kill-every LO HI``
seconds, at most ``--max-kills``, each SIGKILL to the PID of the process holding the part (Ray's
state API lists each actor's PID), or to the agent's PID, or to the second node's process group
(then a new node with the same resources joins). A killed learner ends its job ``failed:
learner``; the soak starts the same command again, which resumes from the last checkpoint. A kill
waits until the one before has recovered (at most ``--recover-timeout`` seconds). For every kill:
whether the job noticed, whether the part came back, seconds until the job ran and trained past the
version of the kill, and the trajectories dropped meanwhile (by reason).

At each phase's end the agent and then the job are stopped with SIGTERM (the job checkpoints and
exits), and its ledger is checked by trajectory id (:func:`benchmarks.soak_logic.ledger_check`:
every id consumed exactly once, dropped with a reason, or buffered at the last checkpoint; every
trained trajectory's served fingerprint equal to its version's learner fingerprint). Resident
memory (psutil, every ``--sample-every`` s) of the driver, the actors and the cluster's daemons
gives each long-lived process's growth, first quarter against last quarter (goal < 5%).

    python -m benchmarks.bench_soak --minutes 30 --kill-every 60 120 --seed 0 --out results/soak.json
    python -m benchmarks.bench_soak --set 'controller.stale_trajectories="mask"' --out results/soak_mask.json

``--set SECTION.FIELD=VALUE`` (repeatable) goes to both phases' jobs after the soak's own items.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from benchmarks.soak_logic import (
    AGENT_KINDS,
    ENV_KINDS,
    PlannedKill,
    dropped_delta,
    kill_schedule,
    ledger_check,
    rss_growth,
    worst_growth,
)
from deploy.local_cluster import LocalRayHead, LocalRayNode, outside_private_cluster
from trainer.driver.cluster import owned

REPO = Path(__file__).resolve().parents[1]
HEAD_RESOURCES = {"learner_node": 1, "rollout_node": 1}
NODE_RESOURCES = {"rollout_node": 1, "oldlogit_node": 1}
ROLES = {"rollout_worker": "RolloutWorker", "oldlogit": "OldLogit", "learner": "Learner"}
"""Kill kind -> a part of the Ray actor class name of the process that holds it."""
WALL_FACTOR = 3.0
"""A phase ends after at most this many times its minutes of wall time, however long its job ran."""
CONFIG_ERROR_EXIT = 2
"""``vintage run``'s exit status when it refuses its config: starting it again cannot help."""

MAX_JOB_STARTS = 20
"""Most restarts of one phase's job (a job that cannot start is not started for ever)."""


def job_overrides(phase: str, run_dir: Path, seed: int, extra: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The ``--set`` items of a phase's job (see the module docstring), then ``extra`` (the soak's
    ``--set`` items, which win over the soak's own values of the same key)."""
    out = [
        'model.path="tiny"', "env.eval_prompts=0", 'rollout.engine="transformers"', "rollout.num_workers=2",
        "rollout.max_num_seqs=16", "rollout.sampling.max_tokens=12", "rollout.sampling.n=4",
        "controller.batch_groups=2", "controller.max_staleness=2", "controller.total_steps=1000000",
        "controller.checkpoint_every=1", "controller.keep_checkpoints=2", f"controller.seed={seed}", "learner.micro_batch_size=8",
        "controller.max_learner_restarts=0",  # the soak restarts the job itself (--resume auto) and sees each exit
        "server.port=0", "logging.trackers=[]", "logging.plots=false", 'loss.method="snapshot"',
        "rollout.resources={rollout_node = 1}", "learner.resources={learner_node = 1}",
        "oldlogit.resources={oldlogit_node = 1}", "oldlogit.restart_timeout_s=300", "oldlogit.max_restarts=1000",
        "rollout.start_timeout_s=240", "rollout.max_restarts=1000", "rollout.hang_timeout_s=120",
        f'logging.run_dir="{run_dir}"',
    ]  # fmt: skip
    if phase == "agent":
        out += [
            "agent.concurrency=8",
            "gateway.group_wait_s=20",
            "gateway.call_timeout_s=60",
            "gateway.session_idle_s=60",
        ]
    return out + list(extra)


def v0_fingerprint() -> str:
    """The learner-side fingerprint of version 0 (the tiny model folder, fp32), as a manifest's."""
    from modelkit.modelhub import load_causal_lm, model_folder
    from modelkit.weights import pack_weights

    model = load_causal_lm(model_folder("tiny", 0), "float32")
    return pack_weights(model.state_dict().items(), 0, "float32")[0].fingerprint


class Cluster:
    """The two-node loopback cluster; :meth:`kill_node` SIGKILLs the second node and starts another."""

    def __init__(self) -> None:
        self.head = LocalRayHead.start(num_cpus=3, resources=HEAD_RESOURCES, timeout_s=180)
        self.nodes: list[LocalRayNode] = [self.head.add_node(num_cpus=2, resources=NODE_RESOURCES)]

    def actors(self) -> list[dict[str, Any]]:
        """The ALIVE actors (``class_name``, ``pid``, ``node_id``, ``actor_id``) from Ray's state API."""
        try:
            r = httpx.get(
                f"{self.head.dashboard_url}/api/v0/actors",
                params={"limit": 1000, "filter_keys": "state", "filter_predicates": "=", "filter_values": "ALIVE"},
                headers={"Authorization": f"Bearer {self.head.token}"}, timeout=10,
            )  # fmt: skip
            return r.json()["data"]["result"]["result"] if r.status_code == 200 else []
        except (httpx.HTTPError, KeyError, TypeError, ValueError):
            return []

    def pids(self, kind: str) -> list[int]:
        """PIDs of the ALIVE actors holding part ``kind`` (sorted)."""
        return sorted(a["pid"] for a in self.actors() if ROLES[kind] in a.get("class_name", "") and a.get("pid"))

    def processes(self) -> list[psutil.Process]:
        """Every process of the cluster: its nodes' process groups and their descendants."""
        groups = [self.head.pid] + [n.pid for n in self.nodes]
        return owned.with_descendants([p for g in groups for p in owned.group_members(g)])

    def kill_node(self) -> dict[str, Any]:
        node = self.nodes.pop()
        node.stop(timeout_s=10, sig=signal.SIGKILL)
        self.nodes.append(self.head.add_node(num_cpus=2, resources=NODE_RESOURCES))
        return {"pid": node.pid, "replaced_by": self.nodes[-1].pid}

    def stop(self) -> None:
        for n in self.nodes:
            n.stop(timeout_s=10)
        self.head.stop(timeout_s=10)


class Proc:
    """A child process in a session of its own, stopped by its process group (owned)."""

    def __init__(self, cmd: list[str], log: Path, env: dict[str, str]):
        self.log = log.open("a")
        self.popen = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.pid = self.popen.pid
        owned.own(("soak", self.pid), functools.partial(owned.stop_group, self.pid, 10.0))

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 120.0) -> int | None:
        """``sig`` to the process, wait ``timeout_s``, then its whole group is stopped; its exit code."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout_s)
        owned.stop_group(self.pid, 10.0)
        owned.disown(("soak", self.pid))
        self.log.close()
        return self.popen.poll()


def say(line: str) -> None:
    """One progress line, at once."""
    print(time.strftime("%H:%M:%S ") + line, flush=True)


def last_line(path: Path) -> str:
    """The last non-empty line of a log ("" when there is none)."""
    with contextlib.suppress(FileNotFoundError):
        lines = [x for x in path.read_text(errors="replace").splitlines() if x.strip()]
        return lines[-1] if lines else ""
    return ""


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def job_status(run_dir: Path) -> dict[str, Any] | None:
    """``GET /v1/status`` of the job of ``run_dir`` (None while it does not answer)."""
    srv = read_json(run_dir / "server.json")
    if srv is None:
        return None
    try:
        return httpx.get(f"{srv['url']}/v1/status", timeout=5).json()
    except (httpx.HTTPError, ValueError, KeyError):
        return None


def snapshot(st: dict[str, Any] | None) -> dict[str, Any]:
    """The fields of a status a kill is judged on."""
    st = st or {}
    gw = st.get("gateway") or {}
    return {
        "state": st.get("state"), "version": st.get("learner_version", -1), "segment": st.get("run_segment", -1),
        "dropped": dict(st.get("dropped", {})), "workers": sorted(w["worker_id"] for w in st.get("workers", [])),
        "oldlogit_started": (st.get("oldlogit") or {}).get("started_unix"),
        "sessions_open": gw.get("sessions_open"), "sessions_dropped": dict(gw.get("sessions_dropped", {})),
    }  # fmt: skip


class Phase:
    """One phase: its job (restarted with ``--resume auto`` when it dies), its agent, its kills."""

    def __init__(
        self, name: str, cluster: Cluster, out_dir: Path, seed: int, env: dict[str, str], sets: list[str] | None = None
    ):
        self.name, self.cluster, self.seed, self.env, self.sets = name, cluster, seed, env, sets or []
        self.run_dir = out_dir / name
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.job: Proc | None = None
        self.agent: Proc | None = None
        self.exits: list[dict[str, Any]] = []
        self.last = snapshot(None)

    def start_job(self) -> None:
        cmd = [sys.executable, "-m", "vintage_cli.main", "run", "--address", self.cluster.head.gcs_address,
               "--resume", "auto"]  # fmt: skip
        for o in job_overrides(self.name, self.run_dir, self.seed, self.sets):
            cmd += ["--set", o]
        with contextlib.suppress(FileNotFoundError):
            (self.run_dir / "server.json").unlink()  # the next one is the new job's
        self.job = Proc(cmd, self.run_dir / "job.log", self.env)

    def start_agent(self) -> None:
        cmd = [sys.executable, "-m", "benchmarks.soak_agent", "--run-dir", str(self.run_dir),
               "--status", str(self.run_dir / "agent-status.json")]  # fmt: skip
        self.agent = Proc(cmd, self.run_dir / "agent.log", self.env)

    def tick(self, t: float) -> None:
        """Poll the job; a job that exited is recorded and started again (it resumes)."""
        if self.job is not None and not self.job.alive():
            summary = read_json(self.run_dir / "summary.json") or {}
            self.exits.append(
                {"t_s": round(t, 1), "code": self.job.popen.returncode, "end_reason": summary.get("end_reason")}
            )
            self.job.stop(timeout_s=5)
            self.job = None
            if self.exits[-1]["code"] == CONFIG_ERROR_EXIT and not summary:
                raise SystemExit(f"{self.name}: the job refused its config: {last_line(self.run_dir / 'job.log')}")
            say(f"{self.name} t={t:.0f}s: job exited {self.exits[-1]}; starting it again (--resume auto)")
            if len(self.exits) <= MAX_JOB_STARTS:
                self.start_job()
        self.last = snapshot(job_status(self.run_dir)) if self.job else snapshot(None)

    def fire(self, kind: str, rng: random.Random) -> dict[str, Any]:
        """Kill part ``kind``; returns what was killed (``target``) or why not (``skipped``)."""
        if kind == "node":
            return {"target": self.cluster.kill_node()}
        if kind == "agent":
            return self._kill_agent()
        pids = self.cluster.pids(kind)
        if not pids:
            return {"skipped": f"no ALIVE actor of {ROLES[kind]}"}
        pid = rng.choice(pids)
        with contextlib.suppress(psutil.Error):
            psutil.Process(pid).send_signal(signal.SIGKILL)
        return {"target": {"pid": pid, "of": pids}}

    def _kill_agent(self) -> dict[str, Any]:
        status = self.run_dir / "agent-status.json"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and ((read_json(status) or {}).get("in_flight", 0) == 0):
            time.sleep(0.05)
        st = read_json(status) or {}
        self.agent.stop(signal.SIGKILL, timeout_s=10)
        self.start_agent()
        return {"target": {"pid": st.get("pid"), "in_flight": st.get("in_flight"), "orphaned_sessions": st.get("open")}}

    def stop(self) -> dict[str, Any]:
        out = {}
        if self.agent is not None:
            out["agent_exit"] = self.agent.stop(signal.SIGTERM, timeout_s=10)
        if self.job is not None:
            out["job_exit"] = self.job.stop(signal.SIGTERM, timeout_s=180)
        return out


def judged(kind: str, before: dict[str, Any], now: dict[str, Any], exits_before: int, phase: Phase) -> dict[str, bool]:
    """Whether the job noticed the kill (``detected``) and the part is back (``restarted``): a new
    rollout worker id (or ``worker_died`` drops) and both workers running; a new old-logit service
    start time; the job's exit and its resumed segment running; for a node both; for the agent, the
    gateway dropping sessions ``idle`` and the new agent process having ended a session."""
    new_worker = bool(set(now["workers"]) - set(before["workers"]))
    worker_back = new_worker and len(now["workers"]) >= 2
    died = dropped_delta(before["dropped"], now["dropped"]).get("worker_died", 0) > 0
    service_back = now["oldlogit_started"] is not None and now["oldlogit_started"] != before["oldlogit_started"]
    resumed = now["segment"] > before["segment"] and now["state"] == "running"
    if kind == "rollout_worker":
        return {"detected": new_worker or died, "restarted": worker_back}
    if kind == "oldlogit":
        return {"detected": service_back, "restarted": service_back}
    if kind == "learner":
        return {"detected": len(phase.exits) > exits_before, "restarted": resumed}
    if kind == "node":
        return {"detected": (new_worker or died) and service_back, "restarted": worker_back and service_back}
    st = read_json(phase.run_dir / "agent-status.json") or {}
    agent_ok = phase.agent is not None and phase.agent.alive() and st.get("pid") == phase.agent.pid
    idle = now["sessions_dropped"].get("idle", 0) > before["sessions_dropped"].get("idle", 0)
    return {"detected": idle, "restarted": agent_ok and st.get("ended", 0) > 0}  # its orphans ended idle


def wait_running(phase: Phase, args: argparse.Namespace, clock) -> float | None:
    """Start the phase's job (and agent); poll until its status says ``running``, at most
    ``args.start_timeout`` s. Returns the seconds it took (None: it never ran)."""
    phase.start_job()
    if phase.name == "agent":
        phase.start_agent()
    t0 = clock()
    while clock() - t0 < args.start_timeout:
        phase.tick(0.0)
        args.sampler(clock())
        if phase.last["state"] == "running":
            say(f"{phase.name}: job running after {clock() - t0:.0f} s")
            return round(clock() - t0, 1)
        time.sleep(1.0)
    return None


def settle(pending: tuple[dict, dict], now: dict, w: float, phase: Phase, timeout_s: float) -> bool:
    """Update a kill's record ``pending = (record, status before)`` from status ``now`` at wall
    time ``w`` (seconds since the phase's start); True once it recovered (back, running, past the
    kill's version) or ``timeout_s`` passed. ``recovered_s`` is in wall seconds."""
    rec, before = pending
    j = judged(rec["kind"], before, now, rec["_exits"], phase)
    rec["detected"] = rec["detected"] or j["detected"]
    rec["restarted"] = rec["restarted"] or j["restarted"]
    done = rec["restarted"] and now["state"] == "running" and now["version"] > before["version"]
    if done:
        rec["recovered_s"] = round(w - rec["_fired_wall"], 1)
    if done or w - rec["_fired_wall"] > timeout_s:
        rec["lost"] = dropped_delta(before["dropped"], now["dropped"])
        rec["version_at_recovery"] = now["version"]
        say(f"{phase.name} w={w:.0f}s: {rec['kind']} {'recovered' if done else 'NOT recovered'} {rec}")
        return True
    return False


def run_phase(phase: Phase, plan: list[PlannedKill], minutes: float, args: argparse.Namespace, clock) -> dict:
    """Run one phase: start its job, then ``minutes`` of the job running (its clock ``t`` stops
    while the job is not ``running``: a resume's start-up does not use up the schedule; at most
    ``WALL_FACTOR * minutes`` of wall time), its kills in order at their ``t``, each after the one
    before recovered (or ``args.recover_timeout`` passed)."""
    rng = random.Random(args.seed * 7919 + len(phase.name))
    start_s = wait_running(phase, args, clock)
    t0 = last = clock()
    t, budget = 0.0, (minutes * 60 if start_s is not None else 0.0)
    kills, pending = [], None
    while t < budget and clock() - t0 < WALL_FACTOR * budget:
        phase.tick(t)
        now, w = phase.last, clock() - t0
        t, last = t + (clock() - last if now["state"] == "running" else 0.0), clock()
        if pending is not None and settle(pending, now, w, phase, args.recover_timeout):
            pending = None
        nxt = plan[len(kills)] if len(kills) < len(plan) else None
        if pending is None and nxt is not None and t >= nxt.at_s and now["state"] == "running":
            rec = {"phase": phase.name, "kind": nxt.kind, "planned_at_s": nxt.at_s, "fired_at_s": round(t, 1),
                   "fired_wall_s": round(w, 1), "version_at_kill": now["version"], "detected": False,
                   "restarted": False, "recovered_s": None, "_exits": len(phase.exits), "_fired_wall": w}  # fmt: skip
            rec.update(phase.fire(nxt.kind, rng))
            say(
                f"{phase.name} t={t:.0f}s: killed {nxt.kind} at v{now['version']}: {rec.get('target', rec.get('skipped'))}"
            )
            kills.append(rec)
            pending = None if "skipped" in rec else (rec, now)
        args.sampler(clock())
        time.sleep(1.0)
    if pending is not None:  # the phase ended first: what was seen so far
        rec, before = pending
        rec.update(lost=dropped_delta(before["dropped"], phase.last["dropped"]), note="phase ended before recovery")
    for rec in kills:
        rec.pop("_exits", None)
        rec.pop("_fired_wall", None)
    window = [t0, clock()]
    return {"start_s": start_s, "kills": kills, "exits": phase.exits, "stopped": phase.stop(), "window": window}


class Sampler:
    """RSS of every process of the soak (its jobs, agents and cluster), every ``every_s`` seconds."""

    def __init__(self, cluster: Cluster, phases: list[Phase], every_s: float):
        self.cluster, self.phases, self.every_s = cluster, phases, every_s
        self.samples: dict[str, list[tuple[float, float]]] = {}
        self._next = 0.0

    def __call__(self, t: float) -> None:
        if t < self._next:
            return
        self._next = t + self.every_s
        procs, label = self.cluster.processes(), {}
        for ph in self.phases:
            for what, p in ((f"driver-{ph.name}", ph.job), ("agent", ph.agent)):
                if p is not None and p.alive():
                    label[p.pid] = what
                    with contextlib.suppress(psutil.Error):
                        procs += owned.with_descendants([psutil.Process(p.pid)])
        for p in {p.pid: p for p in procs}.values():
            with contextlib.suppress(psutil.Error):
                key = f"{label.get(p.pid) or p.name()}:{p.pid}"
                self.samples.setdefault(key, []).append((t, float(p.memory_info().rss)))

    def span(self) -> tuple[float, float] | None:
        """The first and last sample times (None before any)."""
        ts = [t for rows in self.samples.values() for t, _ in rows]
        return (min(ts), max(ts)) if ts else None


def result_rows(kills: list[dict[str, Any]]) -> list[str]:
    """The kill table, one line per kill."""
    out = [
        f"{'#':>2} {'phase':5} {'kind':14} {'at s':>6} {'v':>4} {'detected':8} {'restarted':9} {'recover s':>9}  lost"
    ]
    for i, k in enumerate(kills, 1):
        lost = "skipped: " + k["skipped"] if "skipped" in k else json.dumps(k.get("lost", {}))
        rs = "-" if k.get("recovered_s") is None else f"{k['recovered_s']:.1f}"
        out.append(
            f"{i:>2} {k['phase']:5} {k['kind']:14} {k['fired_at_s']:>6.0f} {k['version_at_kill']:>4} "
            f"{str(k['detected']):8} {str(k['restarted']):9} {rs:>9}  {lost}"
        )
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0, help="Soak length, shared by the phases.")
    ap.add_argument("--kill-every", type=float, nargs=2, default=[60.0, 120.0], metavar=("LO", "HI"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-kills", type=int, default=30, help="Most kills over the soak.")
    ap.add_argument("--phases", nargs="+", default=["env", "agent"], choices=["env", "agent"])
    ap.add_argument("--sample-every", type=float, default=5.0, help="Seconds between RSS samples.")
    ap.add_argument("--recover-timeout", type=float, default=300.0, help="Longest wait for a kill's recovery, s.")
    ap.add_argument("--start-timeout", type=float, default=900.0, help="Longest wait for a phase's job to run, s.")
    ap.add_argument("--run-dir", type=Path, default=Path("runs/soak"))
    ap.add_argument("--out", type=Path, default=Path("results/soak.json"))
    ap.add_argument(
        "--set", dest="sets", action="append", default=[], metavar="SECTION.FIELD=VALUE",
        help="A config override for both phases' jobs after the soak's own (repeatable).",
    )  # fmt: skip
    a = ap.parse_args(argv)
    if not 0 < a.minutes < 1e5 or a.sample_every <= 0 or a.recover_timeout <= 0:
        raise SystemExit(
            f"--minutes / --sample-every / --recover-timeout: expected > 0, got {a.minutes} / {a.sample_every} / {a.recover_timeout}"
        )
    return a


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the soak (module docstring); prints the kill table and writes ``--out``. Returns the result."""
    a = parse_args(argv)
    per_phase = a.minutes / len(a.phases)
    kinds = {"env": ENV_KINDS, "agent": AGENT_KINDS}
    plan = kill_schedule(a.seed, [(p, per_phase * 60, kinds[p]) for p in a.phases], a.kill_every, a.max_kills)
    # jobs join the soak's cluster as its nodes do (without a loopback interposer this process may hold)
    env = {
        **outside_private_cluster(os.environ),
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    v0 = v0_fingerprint()
    started, t_start = time.time(), time.monotonic()
    load0 = os.getloadavg()
    cluster = Cluster()
    env.update(cluster.head.client_env())
    phases = [Phase(p, cluster, a.run_dir, a.seed, env, a.sets) for p in a.phases]
    a.sampler = Sampler(cluster, phases, a.sample_every)
    out: dict[str, Any] = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items() if k != "sampler"},
                           "plan": [k.as_dict() for k in plan], "phases": {}}  # fmt: skip
    try:
        for ph in phases:
            res = run_phase(ph, [k for k in plan if k.phase == ph.name], per_phase, a, time.monotonic)
            from trainer.driver.records.ledger import read_ledger

            summary = read_json(ph.run_dir / "summary.json")
            res["summary"] = {k: summary.get(k) for k in ("end_reason", "steps", "run_segment", "generated", "consumed",
                              "buffered", "in_flight", "dropped", "accounting_ok", "worker_restarts",
                              "oldlogit_restarts", "fingerprint_mismatch", "tokens_exact", "tokens_total",
                              "batches_taken_ahead", "batches_retaken")} if summary else None  # fmt: skip
            res["ledger"] = ledger_check(read_ledger(ph.run_dir), v0, summary)
            w0, w1 = res.pop("window")
            res["rss_growth"] = rss_growth(a.sampler.samples, w0, w1)
            res["seconds"] = round(w1 - w0, 1)
            out["phases"][ph.name] = res
    finally:
        for ph in phases:
            ph.stop()
        span = a.sampler.span()
        whole = rss_growth(a.sampler.samples, *span) if span and span[1] > span[0] else {}
        cluster.stop()
    out.update(
        started_unix=started, seconds=round(time.monotonic() - t_start, 1), loadavg_start=load0,
        loadavg_end=os.getloadavg(), cpus=os.cpu_count(), rss_growth_whole=whole,
        worst_growth=worst_growth(whole), v0_fingerprint=v0,
    )  # fmt: skip
    report(out)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1, default=str))
    print(f"wrote {a.out}")
    return out


def report(out: dict[str, Any]) -> None:
    """Print the kill table, each phase's ledger verdict and the memory growth."""
    kills = [k for ph in out["phases"].values() for k in ph["kills"]]
    print("\n".join(result_rows(kills)))
    for name, ph in out["phases"].items():
        lg = ph["ledger"]
        print(
            f"{name}: ledger closed={lg['closed']} ids={lg['ids']} fates={lg['fates']} multiple={len(lg['multiple'])} "
            f"no_fate={len(lg['no_fate'])} rolled_back={lg['rolled_back']} fingerprints={lg['fingerprints']}; "
            f"exits={[e['end_reason'] for e in ph['exits']]}; end={(ph['summary'] or {}).get('end_reason')}"
        )
        key, g = worst_growth(ph["rss_growth"])
        print(
            f"{name}: {len(ph['rss_growth'])} long-lived processes, most growth {key} {g if g is None else f'{g:+.1%}'}"
        )
    key, g = out["worst_growth"]
    print(
        f"whole soak: most growth {key} {g if g is None else f'{g:+.1%}'}; load {out['loadavg_start']} -> {out['loadavg_end']}"
    )


if __name__ == "__main__":
    main()
