import pytest

from trainer.driver.sources.admission import AdmissionWindow
from trainer.driver.sources.buffer import admission_capacity


def test_the_window_narrows_on_stale_drops_and_widens_after_quiet_versions():
    w = AdmissionWindow(max_staleness=2, recover_after=2)
    stale = {5: 3, 6: 4}  # the run's stale total first reaches 3 at version 5, 4 at 6
    total, got = 0, {}
    for v in range(3, 11):
        total = stale.get(v, total)
        got[v] = w.update(v, total)
        assert w.update(v, total) == got[v]  # once per version
    assert got == {3: 2, 4: 2, 5: 1, 6: 0, 7: 0, 8: 1, 9: 1, 10: 2}


def test_at_window_0_admission_is_the_synchronous_rule():
    # batch 8, learner at 6 with 48 scheduled (6 batches consumed): one more batch at window 0,
    # three at the bound 2
    assert admission_capacity(6, 0, 8, 48) == 8 and admission_capacity(6, 2, 8, 48) == 24


def test_bad_settings_name_their_value():
    with pytest.raises(ValueError, match="max_staleness: must be >= 0, got -1"):
        AdmissionWindow(max_staleness=-1)
    with pytest.raises(ValueError, match="controller.admission_recover_after: must be >= 1, got 0"):
        AdmissionWindow(max_staleness=2, recover_after=0)


def test_the_buffer_admits_with_the_narrowed_window():
    # batch 4, bound 2, 8 scheduled at version 2: room (2 + 2 + 1) * 4 - 8 = 12; after a stale drop
    # seen at version 3 the window is 1: (3 + 1 + 1) * 4 - scheduled
    from trainer.driver.sources.buffer import TrajectoryBuffer

    b = TrajectoryBuffer(capacity=16, max_staleness=2, window=AdmissionWindow(2, recover_after=3))
    b.note_submitted(8)
    assert b.admission_room(2, 4) == 12
    b.note_lost(1, "stale")  # a stale drop (in flight, for the test)
    assert b.scheduled == 7 and b.admission_room(3, 4) == 5 * 4 - 7
    assert TrajectoryBuffer(capacity=16, max_staleness=2).admission_room(3, 4, scheduled=7) == 6 * 4 - 7
