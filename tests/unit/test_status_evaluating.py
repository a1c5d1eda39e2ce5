"""``/v1/status`` during a held-out evaluation: ``state = "evaluating"``, and the gateway's figures
read live while the loop is busy (stand-in parts around a real :class:`StatusBoard` and buffer)."""

from __future__ import annotations

from types import SimpleNamespace

from protocol import GatewayStatus
from trainer.driver.cluster.server import StatusBoard
from trainer.driver.loop.job import evaluate_reported
from trainer.driver.sources.buffer import TrajectoryBuffer


class Gateway:
    """Counts calls as a gateway would; ``status`` is what ``AgentSource.status`` returns."""

    def __init__(self) -> None:
        self.calls, self.tokens = 0, 0

    def status(self) -> GatewayStatus:
        return GatewayStatus(policy_version=2, calls=self.calls, tokens_sampled=self.tokens, calls_pending=1)


def test_the_state_is_evaluating_and_the_gateway_figures_are_live_during_an_evaluation():
    board, gw, seen = StatusBoard(), Gateway(), []
    buf = TrajectoryBuffer(capacity=8, max_staleness=1)
    buf.note_submitted(4)  # 4 evaluation-time sessions admitted earlier, all still in flight

    def evaluate(tag):
        seen.append(board.status())
        gw.calls, gw.tokens = 3, 3 * 14  # three calls of 14 sampled tokens each
        seen.append(board.status())
        return {"reward": 0.5}

    job = SimpleNamespace(
        version=2, run_segment=0, route=SimpleNamespace(name="none"), pool=SimpleNamespace(statuses=lambda: []),
        buffer=buf, publisher=SimpleNamespace(last={}), source=SimpleNamespace(status=gw.status), oldlogit_status=lambda: None,
        fingerprints=SimpleNamespace(mismatches=0, unverified=0),
        evals=SimpleNamespace(evaluate=evaluate, resubmitted=0),
    )  # fmt: skip
    board.follow_gateway(job.source.status)  # as run_job does once the parts are up
    assert board.status().state == "starting" and board.status().gateway.calls == 0

    assert evaluate_reported(job, board, lambda: job.evals.evaluate("before")) == {"reward": 0.5}
    first, second = seen
    assert (first.state, first.learner_version, first.in_flight, first.gateway.calls) == ("evaluating", 2, 4, 0)
    assert (second.state, second.gateway.calls, second.gateway.tokens_sampled) == ("evaluating", 3, 42)
    assert board.registry.get_sample_value("vintage_gateway_calls_pending") == 1.0
    assert board.status().state == "starting"  # the state it had before

    board.follow_gateway(None)  # the job stops: the last figures read stay
    gw.calls = 9
    assert board.status().gateway.calls == 3
