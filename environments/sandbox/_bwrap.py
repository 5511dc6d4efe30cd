"""The bubblewrap command line of one run: namespaces, binds, the work directory, the seccomp filter.

What a sandbox sees: a read-only view of the interpreter's prefixes (``sys.prefix``,
``sys.base_prefix``) and of the directories holding the shared libraries it and its extension
modules load, each at its real path (symlinks resolved, as is the interpreter it runs: a ``.venv``
that is a symlink, or lies under one, works like any other); its own ``/proc`` (its processes only)
and a minimal ``/dev``, both read-only; a size-capped tmpfs at ``WORKDIR``, the only writable place.
Nothing else of the host: no project tree, no home directory, no host ``/tmp``, no other run. It
runs as uid/gid 65534 with no capabilities in fresh user, mount, PID, network (loopback only), IPC,
UTS and cgroup namespaces, in a new session, and dies with the process that started it.

Left to itself, bubblewrap started by root maps the sandbox's uid to host uid 0, which the kernel
treats as the owner of root's files (root-writable sysctls, ``/proc/sysrq-trigger``) and exempts
from RLIMIT_NPROC. So the caller writes the maps itself: host uid 65534 is the
sandbox's 65534, and the code runs as that (``Startup``). ``/proc`` and ``/dev`` are read-only all
the same. Started by another user, bubblewrap maps the sandbox's 65534 to that user, as it is meant
to run.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import re
import select
import shutil
import signal
import site
import subprocess
import sys
import sysconfig
import time

from environments.sandbox._cgroup import RunCgroup
from environments.sandbox.exceptions import IsolationUnavailableError

WORKDIR = "/sandbox"
UID = 65534
_LDD_PATH = re.compile(r"(/\S+) \(0x")
# What bubblewrap says when the kernel, a container runtime or an LSM refuses it namespaces.
_NAMESPACE_REFUSED = ("namespace", "uid map", "Operation not permitted", "Permission denied")


def executable() -> str | None:
    """The ``bwrap`` binary on ``PATH``, or ``None``."""
    return shutil.which("bwrap")


@functools.cache
def interpreter() -> str:
    """The interpreter a sandbox runs: ``sys.executable`` with every symlink resolved, like the bound paths.

    The path a venv's interpreter was started by (``.venv/bin/python``, a symlink, possibly under
    a symlinked folder) need not exist in the sandbox, which binds only real paths; the real binary
    does. It starts without the venv (no ``pyvenv.cfg`` beside it), which ``-S`` and
    ``_core.boot_config``'s site-packages path make no matter.
    """
    return os.path.realpath(sys.executable)


def site_packages() -> list[str]:
    """The host interpreter's site-packages directories, resolved like the bound paths (``sys.path`` in a sandbox)."""
    return [os.path.realpath(path) for path in site.getsitepackages()]


def explain(error: str) -> str:
    """What bubblewrap's ``error`` means here and what to do, as a sentence to append; "" when nothing is known."""
    if "execvp" in error or "Can't find source path" in error:
        return (f" (the sandbox binds only these host paths, read-only: {', '.join(read_only_paths())}; the path "
                "above is not among them: please report this interpreter layout as a bug)")
    if any(sign in error for sign in _NAMESPACE_REFUSED):
        return (": this host does not let bubblewrap make the namespaces a sandbox needs. Allow unprivileged user "
                "namespaces (sysctl kernel.unprivileged_userns_clone=1, or on Ubuntu 24.04 "
                "kernel.apparmor_restrict_unprivileged_userns=0; Docker's default seccomp profile refuses them "
                "too), or set TOOLGYM_SANDBOX=weak to run model code without isolation (unsafe: see "
                "docs/environments.md)")
    return ""


def switches_user() -> bool:
    """Whether sandboxes start as their namespace's root and ``_boot.py`` switches to ``UID``.

    So when the server runs as root (see the module docstring); otherwise bubblewrap maps ``UID``
    to the server's own uid, which is not root, and the command starts as ``UID`` with no capabilities.
    """
    return os.geteuid() == 0


def command(bwrap: str, disk_bytes: int, seccomp_fd: int, env: dict[str, str], startup: Startup) -> list[str]:
    """The ``bwrap`` arguments before the sandboxed command, which gets ``WORKDIR`` as cwd and only ``env``.

    With ``startup.maps_users``, the sandbox waits until ``startup`` has written its uid and gid
    maps: its command then starts as root of its user namespace (host root), keeping only
    CAP_SETUID and CAP_SETGID, and ``_boot.py`` switches to ``UID`` (host uid ``UID`` too, which is
    not root and so is bound by RLIMIT_NPROC) before any model code runs.
    """
    args = [bwrap, "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session", "--clearenv",
            "--cap-drop", "ALL", "--info-fd", str(startup.info_fd)]
    if startup.maps_users:
        args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--userns-block-fd", str(startup.block_fd)]
    else:
        args += ["--disable-userns", "--uid", str(UID), "--gid", str(UID)]
        if startup.block_fd >= 0:
            args += ["--block-fd", str(startup.block_fd)]
    for name, value in env.items():
        args += ["--setenv", name, value]
    for directory in _mount_parents():  # made 0755: bubblewrap would copy the host's mode (/root is 0700)
        args += ["--perms", "0755", "--dir", directory]
    for path in read_only_paths():
        args += ["--ro-bind", path, path]
    for link, target in _root_symlinks():
        args += ["--symlink", target, link]
    args += ["--proc", "/proc", "--remount-ro", "/proc", "--dev", "/dev", "--remount-ro", "/dev",
             "--size", str(disk_bytes), "--perms", "0777", "--tmpfs", WORKDIR, "--chdir", WORKDIR,
             "--remount-ro", "/", "--seccomp", str(seccomp_fd)]
    return args


class Startup:
    """One sandbox's start and end: its cgroup, its uid/gid maps, and the wait for every process of it to be gone.

    ``info_fd`` and ``block_fd`` (with ``maps_users`` or a ``cgroup``) go to ``command`` (and to
    the child, as inherited fds). Calling the object (the runner's ``started`` hook) reads the
    sandbox's host pid, moves it into ``cgroup``, with ``maps_users`` maps uid/gid 0 and ``UID`` to
    themselves, and lets the sandbox go on: it was blocked before running its command, so every
    process of the run is born in the cgroup. ``close`` kills the sandbox's PID 1 and waits until
    it is gone: bubblewrap's own process exits as soon as the command does, before the kernel has
    finished killing the rest of the PID namespace, and without that wait a ``setsid`` child could
    outlive the run by a moment (and hold the cgroup).
    """

    def __init__(self, maps_users: bool, cgroup: RunCgroup | None = None) -> None:
        self.maps_users, self.cgroup = maps_users, cgroup
        self._info_read, self.info_fd = os.pipe()
        self.block_fd, self._block_write = os.pipe() if maps_users or cgroup is not None else (-1, -1)
        self._init: int | None = None  # a pidfd of the sandbox's PID 1

    @property
    def fds(self) -> tuple[int, ...]:
        """The descriptors the bubblewrap process must inherit."""
        return (self.info_fd, self.block_fd) if self.block_fd >= 0 else (self.info_fd,)

    def __call__(self, deadline: float) -> None:
        """Learn the pid of the sandbox that has just started; move it into its cgroup, map its users, release it.

        Raises:
            TimeoutError: no pid before ``deadline``.
            ChildProcessError: bubblewrap exited before telling it (its error is in its output).
            OSError: the cgroup could not take the process.
        """
        for fd in self.fds:
            os.close(fd)
        self.info_fd = self.block_fd = -1
        info = b""
        while not info.rstrip().endswith(b"}"):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([self._info_read], [], [], remaining)[0]:
                raise TimeoutError("bubblewrap did not start in time")
            chunk = os.read(self._info_read, 4096)
            if not chunk:
                raise ChildProcessError("bubblewrap exited before starting the sandbox")
            info += chunk
        pid = json.loads(info)["child-pid"]
        self._init = os.pidfd_open(pid)
        if self.cgroup is not None:
            self.cgroup.join(pid)
        if self.maps_users:
            for kind in ("uid_map", "gid_map"):
                with open(f"/proc/{pid}/{kind}", "w", encoding="ascii") as out:
                    out.write(f"0 0 1\n{UID} {UID} 1\n")
        if self._block_write >= 0:
            os.write(self._block_write, b"1")

    def close(self, timeout: float = 10.0) -> None:
        """Kill the sandbox's PID 1 (and so its namespace), wait up to ``timeout`` s for it, close the fds."""
        if self._init is not None:
            try:
                signal.pidfd_send_signal(self._init, signal.SIGKILL)
            except ProcessLookupError:
                pass
            select.select([self._init], [], [], timeout)
            os.close(self._init)
        for fd in (self._info_read, self.info_fd, self.block_fd, self._block_write):
            if fd >= 0:
                os.close(fd)


@functools.cache
def read_only_paths() -> tuple[str, ...]:
    """The host paths a sandbox sees (read-only, at the same place), resolved: outermost first, no repeats.

    The interpreter's prefixes, the directory of its binary, its site-packages, and the directories
    of the shared libraries it and its extension modules load.
    """
    prefixes = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)}
    paths = set(prefixes)
    libraries = [os.path.realpath(os.path.dirname(library)) for library in _shared_libraries()]
    for directory in [os.path.dirname(interpreter()), *site_packages(), *libraries]:
        if not any(directory == p or directory.startswith(p + os.sep) for p in prefixes):
            paths.add(directory)
    # A bind of a directory inside another bound one would be redundant; sort so parents come first.
    ordered = sorted(paths, key=lambda p: (p.count(os.sep), p))
    return tuple(p for i, p in enumerate(ordered)
                 if not any(p.startswith(q + os.sep) for q in ordered[:i]))


@functools.cache
def _mount_parents() -> tuple[str, ...]:
    """The directories above the bound paths, parents first."""
    parents = set()
    for path in read_only_paths():
        parent = os.path.dirname(path)
        while parent != "/":
            parents.add(parent)
            parent = os.path.dirname(parent)
    return tuple(sorted(parents, key=lambda p: (p.count(os.sep), p)))


def _shared_libraries() -> list[str]:
    """The shared libraries (as the loader names them) of the interpreter and its extension modules."""
    ldd = shutil.which("ldd")
    dynload = os.path.join(sysconfig.get_path("platstdlib"), "lib-dynload")
    binaries = [interpreter(), *sorted(glob.glob(os.path.join(dynload, "*.so")))]
    if ldd is None:
        raise IsolationUnavailableError("ldd (Debian package libc-bin) is not installed: the sandbox cannot tell "
                                        "which libraries the interpreter needs")
    listing = subprocess.run([ldd, *binaries], capture_output=True, text=True, check=False).stdout
    return sorted(set(_LDD_PATH.findall(listing)))


@functools.cache
def _root_symlinks() -> tuple[tuple[str, str], ...]:
    """The merged-/usr links of the host's root (``/lib -> usr/lib``), through which libraries are named."""
    links = []
    for name in ("lib", "lib32", "lib64", "libx32"):
        path = "/" + name
        if os.path.islink(path):
            links.append((path, os.readlink(path)))
    return tuple(links)
