"""The seccomp filter every bubblewrap sandbox runs under (``bwrap --seccomp FD``).

A deny list on top of the namespaces, as Flatpak does: the calls that reach kernel surface a Python
program never needs (mounts, device nodes, tracing, keyrings, new namespaces, kernel modules, BPF,
io_uring, which bypasses seccomp for the I/O it queues, extended attributes) fail with ``EPERM``.
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
# clone() flags that would make a new namespace; clone3 passes its flags in memory seccomp cannot
# read, so it answers ENOSYS and the C library falls back to clone().
_NAMESPACE_FLAGS = (0x00000080, 0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000,
                    0x40000000)


@functools.cache
def filter_program() -> bytes:
    """The compiled BPF program (``struct sock_filter`` array) for this machine's architecture."""
    rules = pyseccomp.SyscallFilter(defaction=pyseccomp.ALLOW)
    for name in DENIED:
        try:
            rules.add_rule(pyseccomp.ERRNO(errno.EPERM), name)
        except OSError:
            continue  # a call this architecture does not have (iopl on arm64, ...)
    for flag in _NAMESPACE_FLAGS:
        rules.add_rule(pyseccomp.ERRNO(errno.EPERM), "clone", pyseccomp.Arg(0, pyseccomp.MASKED_EQ, flag, flag))
    rules.add_rule(pyseccomp.ERRNO(errno.ENOSYS), "clone3")
    with tempfile.TemporaryFile() as out:
        rules.export_bpf(out)
        out.seek(0)
        return out.read()
