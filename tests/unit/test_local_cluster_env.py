"""A local Ray cluster started from inside a private loopback cluster's environment (a test
session, a job) does not inherit that environment's interposer or its single-node setting."""

from deploy.local_cluster import outside_private_cluster
from trainer.driver.cluster.netguard import MARK


def test_the_interposer_and_the_single_node_setting_are_left_out_and_the_rest_kept():
    env = {
        "LD_PRELOAD": "/v/loopback.so:/other.so", MARK: "/v/loopback.so", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_AUTH_TOKEN": "t" * 32, "PATH": "/bin",
    }  # fmt: skip
    assert outside_private_cluster(env) == {"LD_PRELOAD": "/other.so", "RAY_AUTH_TOKEN": "t" * 32, "PATH": "/bin"}
    only = {"LD_PRELOAD": "/v/loopback.so", MARK: "/v/loopback.so"}
    assert outside_private_cluster(only) == {}
    assert outside_private_cluster({"LD_PRELOAD": "/other.so"}) == {"LD_PRELOAD": "/other.so"}  # not ours: kept
