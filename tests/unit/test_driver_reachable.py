"""A driver that listens on loopback only refuses a cluster that would be given its outward address."""

import pytest

from trainer.driver.cluster.session import check_driver_reachable


@pytest.mark.parametrize(
    ("loopback_bound", "advertises_loopback"),
    [(False, False), (False, True), (True, True)],  # listens everywhere, or tells the cluster 127.0.0.1
)
def test_a_driver_the_cluster_can_reach_joins(loopback_bound, advertises_loopback):
    assert check_driver_reachable("127.0.0.1:6379", loopback_bound, advertises_loopback) is None


def test_a_loopback_bound_driver_that_would_advertise_its_outward_address_is_refused_naming_the_address():
    with pytest.raises(ValueError, match=r"^ray\.address: '127\.0\.0\.1:6379': this driver listens on loopback only"):
        check_driver_reachable("127.0.0.1:6379", loopback_bound=True, advertises_loopback=False)
