"""A part killed by the kernel's OOM killer is reported as such, in one line, with what it held."""

from __future__ import annotations

from trainer.driver.cluster.memory import GIB, killed_for_memory, oom_kill_count, total_memory_bytes


def test_the_kernels_counters_are_read_from_vmstat_and_meminfo(tmp_path):
    vmstat = tmp_path / "vmstat"
    vmstat.write_text("nr_free_pages 123\noom_kill 7\npgfault 9\n")
    assert oom_kill_count(vmstat) == 7
    vmstat.write_text("nr_free_pages 123\n")  # an old kernel without the field
    assert oom_kill_count(vmstat) is None
    assert oom_kill_count(tmp_path / "absent") is None
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24576000 kB\nMemFree:  1 kB\n")
    assert total_memory_bytes(meminfo) == 24576000 * 1024
    assert total_memory_bytes(tmp_path / "absent") is None


def test_a_rise_in_the_kill_count_names_memory_and_what_the_part_held():
    assert killed_for_memory("learner", 0, 1, 8.9 * GIB, 24 * GIB) == (
        "learner: killed by the kernel's out-of-memory killer (oom_kill 0 -> 1); "
        "it held 8.9 GiB resident at its last step, of 24.0 GiB on this machine"
    )
    assert (
        killed_for_memory("learner", 3, 4) == "learner: killed by the kernel's out-of-memory killer (oom_kill 3 -> 4)"
    )
    # no rise, or a count that could not be read: nothing is said about memory
    assert killed_for_memory("learner", 2, 2, 1.0) is None
    assert killed_for_memory("learner", None, 1) is None
    assert killed_for_memory("learner", 1, None) is None
