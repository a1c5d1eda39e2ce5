"""The OpenAI-compatible gateway: outside agents generate through the rollout worker, token-in/token-out.

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

from rollout.gateway.app import ApiError, EndedSession, Gateway, GatewayServer
from rollout.gateway.backend import WorkerBackend
from rollout.gateway.groups import GroupGate
from rollout.gateway.session import CallRecord, Completion, Segment, Session

__all__ = [
    "ApiError",
    "CallRecord",
    "Completion",
    "EndedSession",
    "Gateway",
    "GatewayServer",
    "GroupGate",
    "Segment",
    "Session",
    "WorkerBackend",
]
