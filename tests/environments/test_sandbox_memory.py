"""Every byte a sandboxed run holds counts against its limits: attacks on the memory ceiling, at the default limits.

Each attack runs twice: with a memory cgroup per run (where this machine lets the test make one)
and without (``_cgroup.enabled`` off), as on a machine that has none.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from environments.python_exec import PythonExecEnv
from environments.sandbox import DEFAULT_LIMITS, Limits, _cgroup, memory_ceiling, run_python
from tests.environments.sandbox_attacks import ATTACKS, HostMemory

MiB = 1 << 20
# What each attack's last call fails with: the seccomp filter (EPERM, EAFNOSUPPORT), /dev being
# read-only (EROFS), RLIMIT_NOFILE (EMFILE), and the in-flight descriptor limit, which is RLIMIT_NOFILE too.
FAILURES = {
    "memfd": "PermissionError EPERM",
    "sysv_shm": "PermissionError EPERM",
    "posix_shm": "OSError EROFS",
    "pipes": "OSError EMFILE",
    "socketpairs": "OSError EMFILE",
    "in_flight": "OSError ETOOMANYREFS",
    "sysv_messages": "PermissionError EPERM",
    "tcp_loopback": "OSError EAFNOSUPPORT",
}
# The most one descriptor's kernel buffer holds at the defaults (a socket's send buffer,
# net.core.wmem_default = 208 KiB, with the kernel's bookkeeping).
PER_DESCRIPTOR = 256 << 10


@pytest.fixture(params=["cgroup", "rlimits"])
def containment(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """``cgroup``: runs get a memory cgroup each (skipped where none can be made); ``rlimits``: they do not."""
    if request.param == "rlimits":
        monkeypatch.setattr(_cgroup, "enabled", False)
    elif _cgroup.hierarchy() is None:
        pytest.skip("this machine gives the sandbox no memory cgroup (the warning logged says why)")
    yield request.param
    where = _cgroup.hierarchy()
    if where is not None:  # every run removed its cgroup
        assert not [n for n in os.listdir(where.directory) if n.startswith(f"{_cgroup.PREFIX}{os.getpid()}-")]


@pytest.fixture
def peaks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The most memory each run's cgroup held at once, as the kernel counted it, read before the cgroup goes."""
    found: list[int] = []
    close = _cgroup.RunCgroup.close

    def read_then_close(self: _cgroup.RunCgroup, timeout: float = 5.0) -> bool:
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        found.append(int(Path(self.path, name).read_text()))
        return close(self, timeout)

    monkeypatch.setattr(_cgroup.RunCgroup, "close", read_then_close)
    return found


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_memory_held_without_a_mapping_is_refused_and_given_back(containment, attack):
    with HostMemory() as host:
        result = run_python(ATTACKS[attack], DEFAULT_LIMITS)
    last = result.output.splitlines()[-1] if result.output else ""
    assert result.exit_code == 0 and last.startswith(f"REFUSED {FAILURES[attack]} "), result
    held = int(last.split()[-1])
    assert held <= DEFAULT_LIMITS.open_files * PER_DESCRIPTOR  # a few MiB, where 2 GiB was asked for
    # The host saw none of the 2 GiB (slack for the interpreter and other work on this machine) ...
    assert host.shmem_rise < 64 * MiB and host.available_fall < 1024 * MiB, vars(host)
    # ... and has it all back once the run has returned.
    now = host.settled(shmem_slack=16 * MiB, available_slack=256 * MiB)
    assert now["Shmem"] - host.before["Shmem"] <= 16 * MiB
    assert host.before["MemAvailable"] - now["MemAvailable"] <= 256 * MiB


def test_a_run_s_processes_together_hold_at_most_its_ceiling(containment, peaks):
    if containment != "cgroup":
        pytest.skip("without a cgroup each process is held by its own RLIMIT_AS alone (docs/environments.md)")
    share = 900 * MiB  # each child stays under RLIMIT_AS; together they ask for 2.6 GiB
    code = ("import os, time\npids = []\nfor _ in range(3):\n    pid = os.fork()\n    if pid == 0:\n"
            f"        block = bytearray({share})\n        print('child held', len(block), flush=True)\n"
            "        time.sleep(1)\n        os._exit(0)\n    pids.append(pid)\n"
            "print([os.waitpid(pid, 0)[1] for pid in pids])")
    result = run_python(code, DEFAULT_LIMITS)
    assert result.out_of_memory and not result.ok and not result.timed_out, result
    statuses = result.output.splitlines()[-1]
    assert result.output.count("child held") <= 2 and "9" in statuses.strip("[]").split(", ")  # a child: SIGKILL
    # The host's MemAvailable moves with other work too (a CI run saw it fall 930 MiB beside this test);
    # the kernel's own count of the run is exact. That the run gave everything back is the
    # ``containment`` fixture's check: its cgroup was removed, which the kernel refuses while it holds a process.
    assert len(peaks) == 1 and peaks[0] <= memory_ceiling(DEFAULT_LIMITS), peaks


def test_kernel_memory_of_the_run_s_files_counts_against_its_ceiling(containment):
    if containment != "cgroup":
        pytest.skip("without a cgroup, directory entries are bounded by CPU time alone (docs/environments.md)")
    limits = Limits(memory_bytes=96 * MiB, cpu_seconds=60, wall_seconds=60.0)
    # Empty directories take no space in the tmpfs (disk_bytes), but about 1 KiB of kernel memory each.
    result = run_python("import os\ni = 0\nwhile True:\n    os.mkdir(f'd{i}')\n    i += 1", limits)
    assert result.out_of_memory and not result.timed_out, result


def test_the_python_environment_says_the_run_ran_out_of_memory(containment):
    if containment != "cgroup":
        pytest.skip("only a cgroup counts the run's processes together")
    env = PythonExecEnv(Limits(memory_bytes=256 * MiB))
    env.reset()
    # Both processes hold their block together (the sleep): one that allocated after the other had exited
    # would never push the run past its ceiling.
    out = env.run_code("import os, time\nos.fork()\nblock = bytearray(200 << 20)\nprint('held', flush=True)\n"
                       "time.sleep(2)")
    assert "[killed: the run held more than its memory limit of 288 MiB]" in out
    assert env.solution is None  # a run killed for its memory is not a solution


def test_cgroups_left_by_a_server_that_died_mid_run_are_removed(containment):
    if containment != "cgroup":
        pytest.skip("no cgroups to leave")
    where = _cgroup.hierarchy()
    assert where is not None
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid names no process now
    left = Path(where.directory, f"{_cgroup.PREFIX}{dead.pid}-0")
    left.mkdir()
    _cgroup._remove_stale(where.directory)
    assert not left.exists()
