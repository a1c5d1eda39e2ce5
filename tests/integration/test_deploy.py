"""deploy/: example configs, the KubeRay RayJob manifest, the scripts, and a real `ray job submit`.

The job test starts its own Ray head on this machine with token authentication
(:class:`deploy.local_cluster.LocalRayHead`, every port picked free), submits
``vintage run deploy/configs/tiny.toml --address auto`` with the Ray CLI exactly as a user would,
waits for the job and checks what it wrote; the head is stopped by PID in a ``finally``. Nothing
else on the machine is started or stopped. This process never sets RAY_AUTH_* itself: the token
goes only into the environment of the CLI calls, so other tests' clusters are unaffected.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from trainer.driver.config.schema import load_config

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
CONFIGS = sorted((DEPLOY / "configs").glob("*.toml"))
RAY = str(Path(sys.executable).parent / "ray")
TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}


# --- configs ---------------------------------------------------------------------------------


def test_configs_exist():
    names = {p.name for p in CONFIGS}
    assert {"tiny.toml", "gpu-cluster.toml", "gpu-smoke.toml"} <= names, names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_validates(path):
    cfg = load_config(path)
    from rollout.envs import import_attr

    import_attr(cfg.env.path)  # the environment named by the config exists


def test_tiny_config_is_a_few_cpu_steps():
    cfg = load_config(DEPLOY / "configs" / "tiny.toml")
    assert cfg.model.path == "tiny"
    assert cfg.rollout.num_workers == 1
    assert cfg.loss.method == "snapshot" and cfg.loss.oldlogit_route == "snapshot"
    assert cfg.controller.max_staleness == 1 and cfg.controller.total_steps == 3
    assert cfg.controller.batch_groups == 2
    assert cfg.rollout.sampling.max_tokens == 16 and cfg.rollout.sampling.n == 4
    assert cfg.server.port == 0 and cfg.server.host == "127.0.0.1"
    assert cfg.logging.run_dir.startswith("runs/")
    assert cfg.ray.address is None  # the address comes from the command line


def test_gpu_configs():
    c = load_config(DEPLOY / "configs" / "gpu-cluster.toml")
    assert (c.rollout.engine, c.rollout.dtype, c.rollout.num_workers) == ("vllm", "bfloat16", 4)
    assert (c.learner.world_size, c.learner.zero_stage, c.learner.dtype) == (8, 3, "bfloat16")
    assert c.ray.address is None
    s = load_config(DEPLOY / "configs" / "gpu-smoke.toml")
    assert s.model.path == "smollm2" and s.controller.total_steps == 3
    assert (s.rollout.engine, s.rollout.dtype, s.rollout.num_workers) == ("vllm", "bfloat16", 1)
    assert (s.learner.world_size, s.learner.zero_stage, s.learner.dtype) == (1, 0, "bfloat16")


# --- KubeRay manifest ------------------------------------------------------------------------


def _ray_resources(value: str) -> dict[str, float]:
    """KubeRay's rayStartParams ``resources``: a JSON object inside a quoted string, '"{\\"a\\": 1}"'."""
    inner = json.loads(value)
    return json.loads(inner) if isinstance(inner, str) else inner


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def test_rayjob_manifest():
    docs = [d for d in yaml.safe_load_all((DEPLOY / "kuberay" / "rayjob.yaml").read_text()) if d]
    jobs = [d for d in docs if d.get("kind") == "RayJob"]
    assert len(jobs) == 1
    job = jobs[0]
    assert job["apiVersion"] == "ray.io/v1"
    spec = job["spec"]
    assert spec["entrypoint"].split()[:3] == ["vintage", "run", "/configs/gpu-cluster.toml"]
    assert "--address auto" in spec["entrypoint"]  # the job joins its cluster, not a private one
    assert spec["shutdownAfterJobFinishes"] is True
    cluster = spec["rayClusterSpec"]
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    assert set(groups) == {"rollout", "learner", "oldlogit"}

    # each group is sized on its own and carries its own custom resource
    res = {name: _ray_resources(g["rayStartParams"]["resources"]) for name, g in groups.items()}
    for name in groups:
        assert res[name].get(name, 0) >= 1, (name, res[name])
        for other in set(groups) - {name}:
            assert other not in res[name], (name, res[name])
    cfg = load_config(DEPLOY / "configs" / "gpu-cluster.toml")
    assert res["learner"]["learner"] == cfg.learner.world_size
    learner_gpus = int(groups["learner"]["rayStartParams"]["num-gpus"]) * groups["learner"]["replicas"]
    assert learner_gpus >= cfg.learner.world_size
    assert groups["rollout"]["replicas"] == cfg.rollout.num_workers
    # the driver lands where learner rank 0 may live (rank 0 is pinned to the driver's node)
    entry_res = json.loads(spec["entrypointResources"])
    assert all(res["learner"].get(k, 0) >= v for k, v in entry_res.items()), entry_res

    # token auth on every Ray container and on the submitter, from one Secret
    containers = [cluster["headGroupSpec"]["template"]["spec"]["containers"][0]]
    containers += [g["template"]["spec"]["containers"][0] for g in groups.values()]
    containers += [spec["submitterPodTemplate"]["spec"]["containers"][0]]
    secrets_used = set()
    for c in containers:
        env = _env(c)
        assert env["RAY_AUTH_MODE"]["value"] == "token", c["name"]
        ref = env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
        secrets_used.add((ref["name"], ref["key"]))
    assert len(secrets_used) == 1

    # the config comes from a ConfigMap mounted at /configs on the node that runs the driver
    for pod in [cluster["headGroupSpec"]["template"]["spec"], groups["learner"]["template"]["spec"]]:
        vols = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
        assert "configMap" in vols[mounts["/configs"]]


# --- scripts ---------------------------------------------------------------------------------


@pytest.mark.parametrize("script", ["submit.sh", "gpu_smoke.sh"])
def test_scripts_parse(script):
    path = DEPLOY / script
    assert os.access(path, os.X_OK), f"{path} is not executable"
    subprocess.run(["bash", "-n", str(path)], check=True)


def test_submit_sh_usage():
    r = subprocess.run([str(DEPLOY / "submit.sh"), "--help"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and "RAY_AUTH_TOKEN" in r.stdout
    r = subprocess.run([str(DEPLOY / "submit.sh")], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "CONFIG is required" in r.stderr


# --- a real Ray head with token auth, and `ray job submit` -----------------------------------


@pytest.fixture(scope="module")
def head():
    from deploy.local_cluster import LocalRayHead

    h = LocalRayHead.start(num_cpus=4, timeout_s=180)
    try:
        yield h
    finally:
        h.stop()


def _cli_env(tmp_path: Path, token: str | None) -> dict[str, str]:
    """Environment of a Ray CLI call: this one minus RAY_AUTH_*, plus ``token`` when given.

    HOME points at an empty folder so the CLI cannot fall back to a ~/.ray/auth_token of this user.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH") and k != "RAY_ADDRESS"}
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env["HOME"] = str(home)
    if token is not None:
        env.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token})
    return env


def _submit(head, tmp_path: Path, token: str | None, entrypoint: list[str], submission_id: str):
    cmd = [RAY, "job", "submit", "--address", head.dashboard_url, "--submission-id", submission_id, "--no-wait"]
    return subprocess.run(
        [*cmd, "--", *entrypoint],
        env=_cli_env(tmp_path, token),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )


def test_submit_without_or_with_a_wrong_token_is_refused(head, tmp_path):
    for token, why in ((None, "Missing authentication token"), ("not-" + secrets.token_hex(8), "Invalid")):
        sid = f"refused-{secrets.token_hex(4)}"
        r = _submit(head, tmp_path, token, ["echo", "should-not-run"], sid)
        assert r.returncode != 0, r.stdout + r.stderr
        assert why in r.stdout + r.stderr, (r.stdout + r.stderr)[-2000:]
        # and nothing was created under that id
        got = httpx.get(f"{head.dashboard_url}/api/jobs/{sid}", headers=_auth(head), timeout=10)
        assert got.status_code == 404, got.text
    # the HTTP job API itself refuses unauthenticated reads, too
    assert httpx.get(f"{head.dashboard_url}/api/jobs/", timeout=10).status_code == 401
    bad = {"Authorization": "Bearer wrong"}
    assert httpx.get(f"{head.dashboard_url}/api/jobs/", headers=bad, timeout=10).status_code == 403


def _auth(head) -> dict[str, str]:
    return {"Authorization": f"Bearer {head.token}"}


def _wait_job(head, sid: str, deadline: float) -> dict:
    info: dict = {}
    while time.monotonic() < deadline:
        r = httpx.get(f"{head.dashboard_url}/api/jobs/{sid}", headers=_auth(head), timeout=10)
        r.raise_for_status()
        info = r.json()
        if info.get("status") in TERMINAL:
            return info
        time.sleep(3)
    return info


def _job_logs(head, sid: str) -> str:
    try:
        r = httpx.get(f"{head.dashboard_url}/api/jobs/{sid}/logs", headers=_auth(head), timeout=10)
        return r.json().get("logs", "") if r.status_code == 200 else r.text
    except httpx.HTTPError as e:  # pragma: no cover - diagnostics only
        return f"(no logs: {e})"


@pytest.mark.timeout(660)
def test_tiny_job_via_ray_job_submit(head, tmp_path):
    run_dir = tmp_path / "run"
    sid = f"vintage-tiny-{secrets.token_hex(4)}"
    entry = [
        "vintage",
        "run",
        str(DEPLOY / "configs" / "tiny.toml"),
        "--address",
        "auto",
        "--set",
        f'logging.run_dir="{run_dir}"',
        "--set",
        "server.port=0",
    ]
    r = _submit(head, tmp_path, head.token, entry, sid)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    info = _wait_job(head, sid, time.monotonic() + 570)
    if info.get("status") not in TERMINAL:
        httpx.post(f"{head.dashboard_url}/api/jobs/{sid}/stop", headers=_auth(head), timeout=10)
    logs = _job_logs(head, sid)
    assert info.get("status") == "SUCCEEDED", f"job {sid}: {info.get('status')} {info.get('message')}\n{logs[-6000:]}"

    # the run used the submitted config and the cluster it was submitted to
    resolved = json.loads((run_dir / "config.resolved.json").read_text())
    assert resolved["ray"]["address"] == "auto"
    assert resolved["controller"]["total_steps"] == 3

    # versions advance one per optimizer step, within the staleness bound
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    key = next((k for k in ("policy_version", "learner_version", "version") if any(k in r for r in rows)), "step")
    versions = [r[key] for r in rows if _number(r.get(key))]
    assert len(versions) >= 3, (key, rows[:3])
    assert versions == sorted(versions) and len(set(versions)) >= 3, (key, versions)
    assert max(versions) >= min(versions) + 2 and max(versions) >= 3, (key, versions)
    stale = [r["staleness_max"] for r in rows if _number(r.get("staleness_max"))]
    assert all(s <= 1 for s in stale), stale  # max_staleness = 1 in tiny.toml
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["state"] == "finished" and summary["steps"] >= 3, summary


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
