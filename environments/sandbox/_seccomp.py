"""The seccomp filter every bubblewrap sandbox runs under (``bwrap --seccomp FD``).

A deny list on top of the namespaces, as Flatpak does: the calls that reach kernel surface a Python
program never needs (mounts, device nodes, tracing, keyrings, new namespaces, kernel modules, BPF,
io_uring, which bypasses seccomp for the I/O it queues, extended attributes) fail with ``EPERM``.
So do the calls that make memory a process holds without a mapping, which its rlimits do not count
(``MEMORY``): memfds, System V shared memory, message queues and semaphores, POSIX message queues,
inotify, larger pipe and socket buffers; and sockets other than ``AF_UNIX`` (TCP on the namespace's
loopback grows its buffers to megabytes, outside a cgroup v1 memory limit) fail with
``EAFNOSUPPORT``. ``docs/environments.md`` ("Memory") gives the ceiling this leaves.
System calls of a foreign architecture (the 32-bit ``int 0x80`` entry point) kill the process:
that is libseccomp's default action for an architecture the filter was not built for.
"""

from __future__ import annotations

import errno
import functools
import tempfile

import pyseccomp

DENIED = (
    # file systems and device nodes
    "mount", "umount2", "pivot_root", "chroot", "mknod", "mknodat", "fsopen", "fsconfig", "fsmount", "fspick",
    "move_mount", "open_tree", "mount_setattr", "open_by_handle_at", "name_to_handle_at", "quotactl", "swapon",
    "swapoff", "acct", "setxattr", "lsetxattr", "fsetxattr", "removexattr", "lremovexattr", "fremovexattr",
    "fanotify_init",
    # other processes and the kernel
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd", "keyctl", "add_key", "request_key",
    "unshare", "setns", "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter",
    "io_uring_register", "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot",
    "syslog", "vhangup", "iopl", "ioperm", "uselib", "lookup_dcookie", "settimeofday", "clock_settime",
    "clock_adjtime", "adjtimex",
)
MEMORY = ("memfd_create", "memfd_secret", "shmget", "msgget", "semget", "mq_open", "inotify_init", "inotify_init1")
_AF_UNIX = 1
_F_SETPIPE_SZ = 1031
_SOL_SOCKET = 1
_BUFFER_OPTIONS = (7, 8, 32, 33)  # SO_SNDBUF, SO_RCVBUF, SO_SNDBUFFORCE, SO_RCVBUFFORCE
# clone() flags that would make a new namespace; clone3 passes its flags in memory seccomp cannot
# read, so it answers ENOSYS and the C library falls back to clone().
_NAMESPACE_FLAGS = (0x00000080, 0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000,
                    0x40000000)


@functools.cache
def filter_program() -> bytes:
    """The compiled BPF program (``struct sock_filter`` array) for this machine's architecture."""
    rules = pyseccomp.SyscallFilter(defaction=pyseccomp.ALLOW)
    for name in DENIED + MEMORY:
        try:
            rules.add_rule(pyseccomp.ERRNO(errno.EPERM), name)
        except OSError:
            continue  # a call this architecture does not have (iopl on arm64, ...)
    for name in ("socket", "socketpair"):
        rules.add_rule(pyseccomp.ERRNO(errno.EAFNOSUPPORT), name, pyseccomp.Arg(0, pyseccomp.NE, _AF_UNIX))
    rules.add_rule(pyseccomp.ERRNO(errno.EPERM), "fcntl", pyseccomp.Arg(1, pyseccomp.EQ, _F_SETPIPE_SZ))
    for option in _BUFFER_OPTIONS:
        rules.add_rule(pyseccomp.ERRNO(errno.EPERM), "setsockopt", pyseccomp.Arg(1, pyseccomp.EQ, _SOL_SOCKET),
                       pyseccomp.Arg(2, pyseccomp.EQ, option))
    for flag in _NAMESPACE_FLAGS:
        rules.add_rule(pyseccomp.ERRNO(errno.EPERM), "clone", pyseccomp.Arg(0, pyseccomp.MASKED_EQ, flag, flag))
    rules.add_rule(pyseccomp.ERRNO(errno.ENOSYS), "clone3")
    with tempfile.TemporaryFile() as out:
        rules.export_bpf(out)
        out.seek(0)
        return out.read()
