"""A driver that listens on loopback only refuses a cluster that reaches it at another address."""

import pytest

from trainer.driver.cluster.session import check_driver_reachable


@pytest.mark.parametrize(
    ("loopback_bound", "advertised_ip"),
    [(False, "192.0.2.2"), (False, "127.0.0.1"), (True, "127.0.0.1"), (True, "::1")],
)  # listens everywhere, or the cluster reaches it on loopback
def test_a_driver_the_cluster_can_reach_joins(loopback_bound, advertised_ip):
    assert check_driver_reachable("127.0.0.1:6379", loopback_bound, advertised_ip) is None


def test_a_loopback_bound_driver_advertised_at_an_outward_address_is_refused_naming_both():
    with pytest.raises(
        ValueError,
        match=r"^ray\.address: '127\.0\.0\.1:6379': this driver listens on loopback only .* reaches it at 192\.0\.2\.2;",
    ):
        check_driver_reachable("127.0.0.1:6379", loopback_bound=True, advertised_ip="192.0.2.2")
