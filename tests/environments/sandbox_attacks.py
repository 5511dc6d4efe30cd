"""Attacks on a sandboxed run's memory ceiling, written as model code would try them, and a host meter.

Each attack tries to hold ``TARGET`` bytes (twice the default ceiling) in memory that no mapping
shows: the pages of memfds and shared memory, the buffers of pipes and sockets. Its last line of
output is ``REFUSED <exception> <errno> <bytes held>`` when a call failed, or ``HELD <bytes held>``.
``HostMemory`` samples the host's ``/proc/meminfo`` while a run goes on. Used by
``test_sandbox_memory.py`` and ``bench/sandbox/bench_memory.py``.
"""

from __future__ import annotations

import threading
import time
from types import TracebackType

TARGET = 2 << 30
_PRELUDE = f"""
import errno, os, sys
TARGET = {TARGET}
held = 0
keep = []

def refused(error):
    print('REFUSED', type(error).__name__, errno.errorcode.get(error.errno, error.errno), held, flush=True)
"""
_EPILOGUE = """
except OSError as error:
    refused(error)
else:
    print('HELD', held, flush=True)
"""


def _attack(body: str) -> str:
    """The program: ``body`` (which grows ``held`` and keeps what it makes in ``keep``) inside the reporting."""
    return _PRELUDE + "try:\n" + "".join(f"    {line}\n" for line in body.strip("\n").splitlines()) + _EPILOGUE


ATTACKS: dict[str, str] = {
    # Written pages of memfds, never mapped: RLIMIT_FSIZE caps each one, not how many there are.
    "memfd": _attack("""
chunk = b'x' * (1 << 20)
while held < TARGET:
    fd = os.memfd_create('flood')
    keep.append(fd)
    for _ in range(32):
        held += os.write(fd, chunk)
"""),
    # System V shared memory: the segments outlive their mapping (and, for a while, the run's IPC namespace).
    "sysv_shm": _attack("""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
size = 64 << 20
while held < TARGET:
    segment = libc.shmget(0, ctypes.c_size_t(size), 0o1600)
    if segment < 0:
        raise OSError(ctypes.get_errno(), 'shmget')
    address = libc.shmat(segment, None, 0)
    if address in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), 'shmat')
    ctypes.memset(address, 1, size)
    libc.shmdt(ctypes.c_void_p(address))
    held += size
"""),
    # POSIX shared memory: files in /dev/shm, as multiprocessing.shared_memory makes them.
    "posix_shm": _attack("""
from multiprocessing import shared_memory
while held < TARGET:
    block = shared_memory.SharedMemory(create=True, size=64 << 20)
    keep.append(block)
    block.buf[:] = b'x' * (64 << 20)
    held += 64 << 20
"""),
    # Pipes filled and never read, each grown to the largest size the kernel lets a user ask for.
    "pipes": _attack("""
import fcntl
chunk = b'x' * (1 << 16)
while held < TARGET:
    read_end, write_end = os.pipe()
    keep += [read_end, write_end]
    try:
        fcntl.fcntl(write_end, 1031, 1 << 20)  # F_SETPIPE_SZ
    except PermissionError:
        pass  # refused: fill it at its default size
    os.set_blocking(write_end, False)
    try:
        while True:
            held += os.write(write_end, chunk)
    except BlockingIOError:
        pass
"""),
    # Unix socket pairs filled both ways and never read.
    "socketpairs": _attack("""
import socket
chunk = b'x' * (1 << 16)
while held < TARGET:
    pair = socket.socketpair()
    keep += pair
    for end in pair:
        try:
            end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 30)
        except PermissionError:
            pass
        end.setblocking(False)
        try:
            while True:
                held += end.send(chunk)
        except BlockingIOError:
            pass
"""),
    # Filled socket pairs sent away in flight (SCM_RIGHTS) and closed here: held without a descriptor.
    "in_flight": _attack("""
import socket
chunk = b'x' * (1 << 16)
carrier = None
while held < TARGET:
    a, b = socket.socketpair()
    a.setblocking(False)
    try:
        while True:
            held += a.send(chunk)
    except BlockingIOError:
        pass
    while True:
        if carrier is None:  # a new one each time the last one's buffer is full of messages
            carrier, far_end = socket.socketpair()
            carrier.setblocking(False)
            keep += [carrier, far_end]
        try:
            socket.send_fds(carrier, [b'x'], [a.fileno(), b.fileno()])
            break
        except BlockingIOError:
            carrier = None
    a.close()
    b.close()
"""),
    # System V message queues: up to 32,000 queues of 16 KiB in each IPC namespace by default.
    "sysv_messages": _attack("""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
class Message(ctypes.Structure):
    _fields_ = [('mtype', ctypes.c_long), ('mtext', ctypes.c_char * 8192)]
message = Message(1, b'x' * 8192)
while held < TARGET:
    queue = libc.msgget(0, 0o1600)
    if queue < 0:
        raise OSError(ctypes.get_errno(), 'msgget')
    while libc.msgsnd(queue, ctypes.byref(message), 8192, 0o4000) == 0:  # IPC_NOWAIT
        held += 8192
"""),
    # TCP on the namespace's own loopback: the kernel grows each connection's buffers to megabytes.
    "tcp_loopback": _attack("""
import socket
chunk = b'x' * (1 << 20)
server = socket.socket()
server.bind(('127.0.0.1', 0))
server.listen(1000)
keep.append(server)
while held < TARGET:
    client = socket.create_connection(server.getsockname())
    keep += [client, server.accept()[0]]
    client.setblocking(False)
    try:
        while True:
            held += client.send(chunk)
    except BlockingIOError:
        pass
"""),
}


def meminfo() -> dict[str, int]:
    """The host's ``/proc/meminfo``, in bytes."""
    with open("/proc/meminfo", encoding="ascii") as lines:
        return {key: int(value.split()[0]) << 10 for key, _, value in (line.partition(":") for line in lines)}


class HostMemory:
    """Samples the host's Shmem and MemAvailable while the ``with`` block runs: before, peak rise, largest fall."""

    def __init__(self, interval: float = 0.01) -> None:
        self.interval = interval
        self.before = meminfo()
        self.shmem_rise = 0
        self.available_fall = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> HostMemory:
        self.before = meminfo()
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            now = meminfo()
            self.shmem_rise = max(self.shmem_rise, now["Shmem"] - self.before["Shmem"])
            self.available_fall = max(self.available_fall, self.before["MemAvailable"] - now["MemAvailable"])

    def settled(self, shmem_slack: int, available_slack: int, timeout: float = 10.0) -> dict[str, int]:
        """Wait until Shmem and MemAvailable are back within the slacks of ``before``; the last reading.

        Other work on the host moves both a little; what a run left behind stays.
        """
        deadline = time.monotonic() + timeout
        while True:
            now = meminfo()
            back = (now["Shmem"] - self.before["Shmem"] <= shmem_slack
                    and self.before["MemAvailable"] - now["MemAvailable"] <= available_slack)
            if back or time.monotonic() > deadline:
                return now
            time.sleep(0.05)
