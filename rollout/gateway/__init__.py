"""The OpenAI-compatible gateway: outside agents generate through the rollout worker, token-in/token-out.

* :mod:`rollout.gateway.config` - :class:`GatewayConfig`, the gateway's settings (the ``[gateway]`` section);
* :mod:`rollout.gateway.app` - :class:`Gateway` (the call path: render, sample, stitch, reply) and
  :class:`GatewayServer` (uvicorn on 127.0.0.1);
* :mod:`rollout.gateway.router` - the HTTP routes (FastAPI ``APIRouter``, auth as dependencies);
* :mod:`rollout.gateway.sessions` - the session table (open, reward, end, counts);
* :mod:`rollout.gateway.session` - stitching calls into trajectories;
* :mod:`rollout.gateway.groups` - ended sessions held by GRPO group, partial groups with baselines;
* :mod:`rollout.gateway.bodies` - request bodies and the sampling checks;
* :mod:`rollout.gateway.prompts` - a call's prompt ids;
* :mod:`rollout.gateway.replies` - OpenAI-shaped replies and streams;
* :mod:`rollout.gateway.errors` - :class:`ApiError`;
* :mod:`rollout.gateway.backend` - :class:`WorkerBackend`, calls as prompt-ids requests to a worker;
* :mod:`rollout.gateway.tools` - the text format of tools, tool calls and tool results.
"""

from importlib import import_module
from typing import Any

_HOMES = {
    "ApiError": "rollout.gateway.app",
    "EndedSession": "rollout.gateway.sessions",
    "Gateway": "rollout.gateway.app",
    "GatewayServer": "rollout.gateway.app",
    "GatewayConfig": "rollout.gateway.config",
    "WorkerBackend": "rollout.gateway.backend",
    "GroupGate": "rollout.gateway.groups",
    "CallRecord": "rollout.gateway.session",
    "Completion": "rollout.gateway.session",
    "Segment": "rollout.gateway.session",
    "Session": "rollout.gateway.session",
}
"""Where each public name lives: imported on first use, so reading a job's config (which holds
:class:`GatewayConfig`) does not load the HTTP server."""


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'rollout.gateway' has no attribute {name!r}")
    return getattr(import_module(_HOMES[name]), name)


__all__ = sorted(_HOMES)
