"""vintage oldlogit_service: versioned exact old log-probs (snapshot, old-logit model, interruption
sync) with per-token honest "missing" answers, and the proxy-error meter. The Ray actor lives in
``oldlogit_service.actor`` (imported on demand so this package does not import ray)."""

from oldlogit_service.items import items_from_trajectories, merge_old_logprobs, status_from_old_logprobs
from oldlogit_service.proxy_error import ProxyError, ProxyErrorMeter, proxy_error
from oldlogit_service.service import OldLogitService

__all__ = [
    "OldLogitService",
    "ProxyError",
    "ProxyErrorMeter",
    "items_from_trajectories",
    "merge_old_logprobs",
    "proxy_error",
    "status_from_old_logprobs",
]
