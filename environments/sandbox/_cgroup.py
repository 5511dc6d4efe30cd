"""A memory cgroup per sandboxed run, where this machine lets the server make one.

A run's processes, the files of its ``/sandbox`` tmpfs and the kernel memory charged to them (pipe
buffers, inodes, ...) all count against one limit, the run's ceiling (``Limits.memory_bytes`` +
``Limits.disk_bytes``): past it the kernel's OOM killer kills a process of the run (cgroup v2: all
of them), and ``RunResult.out_of_memory`` says so. Without a cgroup, each process is held only by
its own rlimits (``docs/environments.md`` gives both ceilings).

The run's cgroup is made inside the server's own memory cgroup (cgroup v1's ``memory`` hierarchy,
or v2 where the server's cgroup hands the memory controller to its children, or can once the server
moved into a leaf of it), and the sandbox's
PID 1 is moved into it before any sandboxed code runs (``_bwrap.Startup``). ``hierarchy()`` finds
that place once per process, or says why there is none.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import itertools
import logging
import os
import time

from environments.sandbox.exceptions import IsolationUnavailableError

logger = logging.getLogger("environments.sandbox")
PREFIX = "toolgym-sandbox-"
SERVER_LEAF = "toolgym-server"
enabled = True
"""Private switch (benchmarks and tests): ``False`` runs every sandbox without a cgroup, as on a machine without one."""
_names = itertools.count()


@dataclasses.dataclass(frozen=True)
class Hierarchy:
    """Where run cgroups are made: ``directory`` (the server's own memory cgroup) of cgroup ``version`` 1 or 2."""

    version: int
    directory: str

    @property
    def limit_files(self) -> tuple[str, ...]:
        """The files a run's limit is written to, in an order the kernel accepts (v1: memory before memory+swap)."""
        return ("memory.max", "memory.swap.max") if self.version == 2 else (
            "memory.limit_in_bytes", "memory.memsw.limit_in_bytes")


class RunCgroup:
    """One run's memory cgroup: made with its limit, joined by the sandbox, read for OOM kills and removed.

    Raises:
        OSError: the cgroup cannot be made or limited (the directory or file in the message).
    """

    def __init__(self, where: Hierarchy, limit_bytes: int) -> None:
        self.version = where.version
        self.path = os.path.join(where.directory, f"{PREFIX}{os.getpid()}-{next(_names)}")
        os.mkdir(self.path)
        try:
            for name in where.limit_files:
                # memory.swap.max is a swap limit on its own (0: no swap); v1's memsw counts memory plus swap.
                _write(os.path.join(self.path, name), "0" if name == "memory.swap.max" else str(limit_bytes),
                       optional=name != where.limit_files[0])
            if self.version == 2:
                _write(os.path.join(self.path, "memory.oom.group"), "1", optional=True)
        except OSError:
            os.rmdir(self.path)
            raise

    def join(self, pid: int) -> None:
        """Move process ``pid`` (not yet running sandboxed code) into the cgroup; its children are born in it.

        Raises:
            IsolationUnavailableError: the kernel refused (the path and its reason in the message).
        """
        try:
            _write(os.path.join(self.path, "cgroup.procs"), str(pid))
        except OSError as exc:
            raise IsolationUnavailableError(f"cannot move the sandbox into its memory cgroup: {exc}") from exc

    def close(self, timeout: float = 5.0) -> bool:
        """Remove the cgroup (its processes are gone: the caller waited for the sandbox's end).

        Returns:
            Whether the kernel killed a process of it for holding more than its limit.
        """
        try:
            killed = self._oom_kills() > 0
        except OSError as exc:
            logger.warning("could not read the sandbox's cgroup %s: %s", self.path, exc)
            killed = False
        deadline = time.monotonic() + timeout
        while True:
            try:
                os.rmdir(self.path)
                return killed
            except OSError as exc:  # EBUSY: an exiting process has not left it yet
                if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                    logger.warning("could not remove the sandbox's cgroup %s: %s", self.path, exc)
                    return killed
                time.sleep(0.005)

    def _oom_kills(self) -> int:
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        with open(os.path.join(self.path, name), encoding="ascii") as lines:
            for line in lines:
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        return 0


def hierarchy() -> Hierarchy | None:
    """Where this process can make memory cgroups for its runs, or ``None`` (the reason is logged once)."""
    return _probe() if enabled else None


@functools.cache
def _probe() -> Hierarchy | None:
    try:
        where = _find()
        _remove_stale(where.directory)
        RunCgroup(where, 1 << 30).close()
        if not os.access(os.path.join(where.directory, "cgroup.procs"), os.W_OK):
            raise OSError(errno.EACCES, "processes cannot be moved out of it", where.directory)
    except OSError as exc:
        logger.warning("the sandbox cannot make a memory cgroup per run (%s): each run's processes are held by "
                       "their own rlimits only, a looser ceiling (docs/environments.md, 'Memory')", exc)
        return None
    logger.info("the sandbox gives each run a memory cgroup in %s (cgroup v%d)", where.directory, where.version)
    return where


def _find() -> Hierarchy:
    """The server's own memory cgroup: cgroup v1's ``memory`` hierarchy if mounted, else v2's.

    Raises:
        OSError: neither is mounted, or v2's cgroup does not hand the memory controller to its children.
    """
    own: dict[str, str] = {}  # controller ("" for v2) -> path
    with open("/proc/self/cgroup", encoding="utf-8") as lines:
        for line in lines:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for controller in controllers.split(",") if controllers else [""]:
                own[controller] = path
    mounts: dict[str, tuple[str, str]] = {}  # "memory" (v1) or "" (v2) -> (mount root, mount point)
    with open("/proc/self/mountinfo", encoding="utf-8") as lines:
        for line in lines:
            fields, _, tail = line.partition(" - ")
            fstype, _, options = tail.split(" ", 2)
            root, point = fields.split(" ")[3:5]
            if fstype == "cgroup" and "memory" in options.strip().split(","):
                mounts.setdefault("memory", (root, point))
            elif fstype == "cgroup2":
                mounts.setdefault("", (root, point))
    for key, version in (("memory", 1), ("", 2)):
        if key in mounts and key in own:
            root, point = mounts[key]
            relative = os.path.relpath(own[key], root) if own[key].startswith(root) else None
            if relative is None or relative.startswith(".."):
                continue  # our cgroup lies outside what this mount shows (another cgroup namespace)
            directory = os.path.normpath(os.path.join(point, relative))
            if version == 2:
                _enable_memory_for_children(directory)
            return Hierarchy(version, directory)
    raise OSError(errno.ENOENT, "no memory cgroup of this process is mounted", "/proc/self/mountinfo")


def _enable_memory_for_children(directory: str) -> None:
    """Have cgroup v2's ``directory`` hand the memory controller to its children.

    v2 lets a cgroup do that only while it holds no process itself; when this server is its
    cgroup's only process (a container's main process, a ``systemd-run --scope -p Delegate=yes``
    scope), it first moves into a leaf of its own, ``SERVER_LEAF``, still under every limit it had.
    """
    control = os.path.join(directory, "cgroup.subtree_control")
    with open(control, encoding="ascii") as current:
        if "memory" in current.read().split():
            return
    with open(os.path.join(directory, "cgroup.controllers"), encoding="ascii") as current:
        if "memory" not in current.read().split():
            raise OSError(errno.ENOENT, "cgroup v2's memory controller is not enabled for this server's cgroup (its "
                          "parent's cgroup.subtree_control lacks it)", directory)
    with open(os.path.join(directory, "cgroup.procs"), encoding="ascii") as current:
        others = [pid for pid in current.read().split() if pid != str(os.getpid())]
    if others:
        raise OSError(errno.EBUSY, f"cgroup v2 hands the memory controller to a cgroup's children only while it "
                      f"holds no process, and this server's cgroup holds {len(others)} other process(es): start "
                      "the server as the only process of its cgroup (a container's main process, or under "
                      "systemd-run --scope -p Delegate=yes)", directory)
    os.makedirs(os.path.join(directory, SERVER_LEAF), exist_ok=True)
    _write(os.path.join(directory, SERVER_LEAF, "cgroup.procs"), str(os.getpid()))
    _write(control, "+memory")


def _remove_stale(directory: str) -> None:
    """Remove run cgroups left by servers that died mid-run (empty by now: their sandboxes died with them)."""
    for name in os.listdir(directory):
        owner = name[len(PREFIX):].split("-")[0]
        if name.startswith(PREFIX) and owner.isdigit() and not _alive(int(owner)):
            try:
                os.rmdir(os.path.join(directory, name))
            except OSError:
                pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _write(path: str, value: str, optional: bool = False) -> None:
    """Write ``value`` to a cgroup file; ``optional``: a file this kernel lacks (no swap accounting) is skipped."""
    try:
        with open(path, "w", encoding="ascii") as out:
            out.write(value)
    except FileNotFoundError:
        if not optional:
            raise
