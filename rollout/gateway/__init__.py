"""The OpenAI-compatible gateway: outside agents generate through the rollout worker, token-in/token-out.

* :mod:`rollout.gateway.app` - :class:`Gateway` (sessions, rendering, the OpenAI API) and
  :class:`GatewayServer` (uvicorn on 127.0.0.1);
* :mod:`rollout.gateway.backend` - :class:`WorkerBackend`, calls as prompt-ids requests to a worker;
* :mod:`rollout.gateway.session` - stitching calls into trajectories;
* :mod:`rollout.gateway.tools` - the text format of tools, tool calls and tool results.
"""

from rollout.gateway.app import ApiError, EndedSession, Gateway, GatewayServer
from rollout.gateway.backend import WorkerBackend
from rollout.gateway.session import CallRecord, Segment, Session

__all__ = [
    "ApiError",
    "CallRecord",
    "EndedSession",
    "Gateway",
    "GatewayServer",
    "Segment",
    "Session",
    "WorkerBackend",
]
