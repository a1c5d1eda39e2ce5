"""PinnedEvaluation sums the evaluations' ``resubmitted`` scores over the run (hand values)."""

from __future__ import annotations

from collections import Counter

from trainer.driver.loop.pinned_eval import PinnedEvaluation


class Source:
    """Each evaluation scores the next of ``resubmitted`` (None: a source that reports none)."""

    def __init__(self, resubmitted):
        self.resubmitted = list(resubmitted)

    def start_eval(self, tag: str) -> bool:
        return True

    def finish_eval(self) -> dict:
        n = self.resubmitted.pop(0)
        return {"reward": 0.5, "episodes": 4} | ({} if n is None else {"resubmitted": n})


class Keeper:
    def save_for_eval(self, version: int) -> None:
        pass

    def note_best(self, result: dict) -> None:
        pass


def test_resubmissions_are_summed_over_finished_evaluations_and_not_over_an_abandoned_one():
    evals = PinnedEvaluation(Source([2, None, 3, 5]), Keeper(), Counter(), lambda: None, lambda: 7)
    assert evals.evaluate("before")["resubmitted"] == 2
    assert "resubmitted" not in evals.evaluate("during")  # a source that reports none adds 0
    assert evals.evaluate("during")["resubmitted"] == 3
    assert evals.resubmitted == 5
    assert evals.start("during") and evals.running
    evals.abandon()  # the job stops: its scores are never read
    assert (evals.running, evals.finish(), evals.resubmitted) == (False, {}, 5)
