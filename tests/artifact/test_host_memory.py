"""How much memory the process may use (``kvserve.artifact.host_memory``) on made-up /proc and
cgroup trees (v2, v1, a container's own mount, no limit), and the prefix pool's refusal and
warning that read it."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvserve.artifact import prefix_pool
from kvserve.artifact.host_memory import HostMemory, host_memory
from kvserve.artifact.prefix_pool import block_bytes, make_prefix_pool

GIB = 1 << 30


def _tree(tmp: Path, cgroup_lines: list[str], files: dict[str, str],
          total_kib: int = 24 << 20, available_kib: int = 20 << 20) -> tuple[Path, Path]:
    proc, cg = tmp / "proc", tmp / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal:       {total_kib} kB\nMemFree:  1 kB\n"
                                  f"MemAvailable:   {available_kib} kB\n")
    (proc / "self" / "cgroup").write_text("\n".join(cgroup_lines) + "\n")
    cg.mkdir()
    for rel, text in files.items():
        (cg / rel).parent.mkdir(parents=True, exist_ok=True)
        (cg / rel).write_text(text + "\n")
    return proc, cg


def test_no_limit_is_the_machine(tmp_path):
    proc, cg = _tree(tmp_path, ["0::/user.slice"], {"user.slice/memory.max": "max"})
    assert host_memory(proc, cg) == HostMemory(24 * GIB, 20 * GIB, "this machine")


def test_v2_the_tightest_of_the_group_and_its_ancestors(tmp_path):
    proc, cg = _tree(tmp_path, ["0::/a/b/c"], {
        "a/memory.max": str(4 * GIB), "a/memory.current": str(3 * GIB),
        "a/b/memory.max": str(8 * GIB), "a/b/memory.current": str(1 * GIB),
        "a/b/c/memory.max": "max", "a/b/c/memory.current": str(GIB // 2)})
    got = host_memory(proc, cg)
    assert got.limit == 4 * GIB and got.available == 1 * GIB  # a's limit less a's usage
    assert got.source == "its control group (v2)"


def test_a_container_sees_its_own_group_at_the_mount(tmp_path):
    """Inside a container the path in /proc/self/cgroup is the host's; the mount is the group."""
    proc, cg = _tree(tmp_path, ["0::/docker/abc123"], {
        "memory.max": str(2 * GIB), "memory.current": str(GIB // 4)})
    got = host_memory(proc, cg)
    assert got.limit == 2 * GIB and got.available == 2 * GIB - GIB // 4


def test_v1_memory_controller_and_its_no_limit_value(tmp_path):
    proc, cg = _tree(tmp_path, ["4:memory:/svc/x", "0::/"], {
        "memory/svc/x/memory.limit_in_bytes": str(3 * GIB),
        "memory/svc/x/memory.usage_in_bytes": str(GIB),
        "memory/memory.limit_in_bytes": "9223372036854771712"})
    got = host_memory(proc, cg)
    assert got == HostMemory(3 * GIB, 2 * GIB, "its control group (v1)")
    proc, cg = _tree(tmp_path / "unlimited", ["4:memory:/", "0::/"], {
        "memory/memory.limit_in_bytes": "9223372036854771712"})
    assert host_memory(proc, cg).source == "this machine"


def test_a_limit_above_the_machine_leaves_the_machine(tmp_path):
    proc, cg = _tree(tmp_path, ["0::/a"], {"a/memory.max": str(64 * GIB)})
    assert host_memory(proc, cg).limit == 24 * GIB


def test_unreadable_trees_give_unknown(tmp_path):
    assert host_memory(tmp_path / "none", tmp_path / "none") == HostMemory(None, None,
                                                                            "this machine")


def test_pool_refuses_a_cap_at_the_limit_and_warns_above_the_free_memory(lm, monkeypatch,
                                                                         caplog):
    one = block_bytes(lm.cfg, 16, 4)
    monkeypatch.setattr(prefix_pool, "host_memory",
                        lambda: HostMemory(10 * one, 4 * one, "its control group (v2)"))
    with pytest.raises(MemoryError, match=r"its control group \(v2\) allows"):
        make_prefix_pool(lm, 10 * one, 16)
    with caplog.at_level(logging.WARNING, logger="kvserve.artifact.prefix_pool"):
        assert make_prefix_pool(lm, 6 * one, 16).n_blocks == 6
    assert "more than the" in caplog.text and "--prefix-cache-mb" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvserve.artifact.prefix_pool"):
        assert make_prefix_pool(lm, 3 * one, 16).n_blocks == 3
    assert caplog.text == ""
