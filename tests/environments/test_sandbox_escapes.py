"""Escapes from the bubblewrap sandbox, written as model code would try them: each must fail."""

from __future__ import annotations

import os
import site
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest

from environments.sandbox import Limits, run_python

pytestmark = pytest.mark.slow  # each escape is a sandboxed interpreter run: about a minute in all

LIMITS = Limits(wall_seconds=30.0)  # generous: CI machines are busy
PROJECT = str(Path(__file__).resolve().parents[2])


def run(code: str, limits: Limits = LIMITS) -> str:
    """Run ``code`` in the sandbox and return its output, requiring a clean exit."""
    result = run_python(code, limits)
    assert result.ok, result.output
    return result.output


def test_the_interpreter_has_no_hook_to_switch_off_and_runs_unprivileged():
    out = run("import os, sys\nprint(os.getuid(), os.getgid(), os.getgroups(), os.getresuid())\n"
              "status = dict(line.split(':\\t') for line in open('/proc/self/status').read().splitlines())\n"
              "print(status['CapEff'], status['CapPrm'], status['CapAmb'], status['NoNewPrivs'], status['Seccomp'])")
    ids, caps = out.splitlines()
    assert ids in ("65534 65534 [] (65534, 65534, 65534)", "65534 65534 [65534] (65534, 65534, 65534)")
    assert caps == "0000000000000000 0000000000000000 0000000000000000 1 2"  # no capabilities; seccomp filter


@pytest.mark.parametrize("spawn", [
    # the raw primitive under subprocess (no audit event), argument list of CPython 3.11
    "import _posixsubprocess\nr, w = os.pipe()\n"
    "pid = _posixsubprocess.fork_exec([sys.executable, '-c', CHILD], [sys.executable.encode()], True, (), None, None,"
    " -1, -1, -1, -1, -1, -1, r, w, True, False, -1, None, None, None, -1, None, False)\n"
    "os.waitpid(pid, 0)",
    "pid = os.fork()\nif pid == 0:\n    exec(CHILD)\n    os._exit(0)\nos.waitpid(pid, 0)",
    "import multiprocessing\ndef child():\n    exec(CHILD)\nif __name__ == '__main__':\n"
    "    p = multiprocessing.get_context('spawn').Process(target=child)\n    p.start()\n    p.join()",
])
def test_a_new_process_is_still_inside_the_sandbox(spawn):
    child = ("import os, socket\n"
             "try:\n    socket.create_connection(('127.0.0.1', 22), timeout=2)\n    print('CONNECTED', flush=True)\n"
             "except OSError as e:\n    print('refused', e.errno, flush=True)\n"
             "try:\n    open('/escape', 'w')\n    print('WROTE', flush=True)\n"
             "except OSError as e:\n    print('no write', e.errno, flush=True)\n"
             "print('uid', os.getuid(), flush=True)")
    out = run(f"import os, sys\nCHILD = {child!r}\n{spawn}")
    assert "refused 97" in out and "no write 30" in out and "uid 65534" in out
    assert "CONNECTED" not in out and "WROTE" not in out


WRITES = {
    "os.open": "os.open('{p}', os.O_WRONLY | os.O_CREAT, 0o644)",
    "dir_fd": "os.open('{n}', os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=os.open('{d}', os.O_RDONLY))",
    "mkdir dir_fd": "os.mkdir('{n}', dir_fd=os.open('{d}', os.O_RDONLY))",
    "symlink dir_fd": "os.symlink('/sandbox', '{n}', dir_fd=os.open('{d}', os.O_RDONLY))",
    "mkfifo": "os.mkfifo('{p}')",
    "sqlite": "import sqlite3\nsqlite3.connect('{p}').execute('create table t(x)')",
    "setxattr": "os.setxattr('{d}', b'user.x', b'1')",
}


@pytest.mark.parametrize("route", sorted(WRITES))
@pytest.mark.parametrize("directory", ["/", "/usr", "/dev", "/proc", "/root", PROJECT, "/tmp"])
def test_nothing_outside_the_work_directory_can_be_written(route, directory):
    name = f"escape-{uuid.uuid4().hex}"
    attempt = WRITES[route].format(p=os.path.join(directory, name), d=directory, n=name)
    out = run("import os\ntry:\n" + "".join(f"    {line}\n" for line in attempt.splitlines())
              + "    print('WROTE')\nexcept Exception as e:\n    print('refused', type(e).__name__)")
    assert out.startswith("refused"), out
    assert not os.path.exists(os.path.join(directory, name))


def test_device_nodes_and_fifos_cannot_be_made_even_in_the_work_directory():
    out = run("import os, stat\nfor make in (lambda: os.mknod('null', stat.S_IFCHR | 0o666, os.makedev(1, 3)),\n"
              "             lambda: os.mknod('sda', stat.S_IFBLK | 0o666, os.makedev(8, 0)),\n"
              "             lambda: os.mkfifo('fifo')):\n"
              "    try:\n        make()\n        print('MADE')\n    except OSError as e:\n        print(e.errno)")
    assert out.split() == ["1", "1", "1"]  # EPERM from the seccomp filter


def test_kernel_interfaces_are_refused():
    out = run("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
              "calls = {'ptrace': lambda: libc.ptrace(16, 1, 0, 0), 'unshare': lambda: libc.unshare(0x10000000),\n"
              "         'mount': lambda: libc.mount(b'none', b'/sandbox', b'tmpfs', 0, None),\n"
              "         'keyctl': lambda: libc.syscall(250, 0, 0, 0, 0, 0),\n"
              "         'add_key': lambda: libc.syscall(248, 0, 0),\n"
              "         'setns': lambda: libc.setns(os.open('/proc/self/ns/net', os.O_RDONLY), 0)}\n"
              "for name, call in calls.items():\n    print(name, call(), ctypes.get_errno())")
    assert all(line.split()[1:] == ["-1", "1"] for line in out.splitlines()), out
    sysctl = run("try:\n    open('/proc/sys/kernel/printk_ratelimit', 'w').write('5')\n    print('WROTE')\n"
                 "except OSError as e:\n    print(e.errno)")
    assert sysctl.strip() in ("13", "30")


def test_only_the_run_s_own_processes_and_files_are_visible():
    out = run("import os\nprint(sorted(os.listdir('/')))\n"
              "print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\nprint(os.listdir('.'))")
    root, pids, here = out.splitlines()
    # Only the interpreter's read-only binds show beside the sandbox's own dirs: wherever the checkout
    # (and so the venv) lives, its top folder appears holding that path alone (e.g. /tmp in CI's clone).
    binds = {Path(p).resolve().parts[1] for p in (sys.prefix, sys.base_prefix, sys.executable)}
    assert set(eval(root)) <= {"dev", "proc", "sandbox", "usr", "lib", "lib64"} | binds
    assert eval(pids) == [1, 2] and eval(here) == ["main.py"]
    project = run(f"import os\nprint(os.listdir({PROJECT!r}) if os.path.isdir({PROJECT!r}) else [])")
    assert set(eval(project)) <= {".venv"}  # at most the interpreter's own prefix, when the venv lives there


def test_another_run_s_files_cannot_be_read():
    secret = uuid.uuid4().hex
    holder_ready = threading.Event()

    def holder() -> None:
        holder_ready.set()
        run_python(f"open('secret.txt', 'w').write({secret!r})\nimport time\ntime.sleep(8)", LIMITS)

    thread = threading.Thread(target=holder)
    thread.start()
    holder_ready.wait()
    try:
        out = run("import glob, os\nfound = []\nfor pattern in ('/sandbox/*', '/tmp/*/secret.txt', '/proc/*/root/*',"
                  " '/proc/*/cwd/*', '/*/secret.txt'):\n    for path in glob.glob(pattern):\n"
                  "        try:\n            found.append(open(path).read())\n        except OSError:\n"
                  "            pass\nprint(found)")
    finally:
        thread.join()
    assert secret not in out


def test_no_network_at_all():
    out = run("import socket\nlines = open('/proc/net/dev').read().splitlines()[2:]\n"
              "print(sorted(line.split(':')[0].strip() for line in lines))\n"
              "for family in (socket.AF_INET, socket.AF_INET6, socket.AF_NETLINK, socket.AF_PACKET):\n"
              "    try:\n        socket.socket(family, socket.SOCK_DGRAM)\n        print('OPENED')\n"
              "    except OSError as e:\n        print(e.errno)\n"
              "a, b = socket.socketpair()\na.sendall(b'local')\nprint(b.recv(5).decode())")
    interfaces, *families, local = out.splitlines()
    assert eval(interfaces) == ["lo"]  # the namespace's own loopback, nothing routed
    assert families == ["97"] * 4  # EAFNOSUPPORT from the seccomp filter: not even the loopback
    assert local == "local"  # Unix sockets (asyncio's, multiprocessing's) work


def _alive(marker: str) -> list[str]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
        except OSError:
            pass
    return found


@pytest.mark.parametrize("ending", ["exit", "timeout"])
def test_no_process_of_a_run_survives_it(ending):
    marker = f"toolgym-survivor-{uuid.uuid4().hex}"
    code = (f"import glob, os, sys, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
            f"        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}])\n"
            f"    os._exit(0)\n"
            f"while not any({marker!r}.encode() in open(p, 'rb').read() for p in glob.glob('/proc/[0-9]*/cmdline')):\n"
            f"    time.sleep(0.05)\nprint('daemon running', flush=True)\n"
            + ("time.sleep(60)\n" if ending == "timeout" else ""))
    result = run_python(code, Limits(wall_seconds=15.0 if ending == "timeout" else 30.0))
    assert "daemon running" in result.output
    assert result.timed_out == (ending == "timeout")
    assert _alive(marker) == []


def test_fork_and_thread_bombs_stop_at_the_process_limit():
    limits = Limits(processes=8, wall_seconds=30.0, memory_bytes=4 << 30)
    forks = run("import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
                "            time.sleep(30)\n            os._exit(0)\n        n += 1\n"
                "except OSError as e:\n    print(n, e.errno)", limits)
    threads = run("import threading, time\nn = 0\ntry:\n    while True:\n"
                  "        threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n        n += 1\n"
                  "except RuntimeError:\n    print(n)", limits)
    assert int(forks.split()[0]) < 8 and forks.split()[1] == "11"  # EAGAIN
    assert int(threads) < 8


def test_the_disk_is_the_capped_work_directory():
    out = run("n = 0\ntry:\n    with open('big', 'wb') as f:\n        while True:\n"
              "            f.write(b'x' * (1 << 20))\n            n += 1\nexcept OSError as e:\n    print(n, e.errno)",
              Limits(disk_bytes=8 << 20, wall_seconds=30.0))
    megabytes, errno = out.split()
    assert int(megabytes) <= 8 and errno in ("27", "28")  # EFBIG (the file limit) or ENOSPC


NOT_ROOT_CHECKS = """
import sys
sys.path.insert(0, {tests!r})
from environments.sandbox import Limits, run_python, score_tests
import test_env_python_exec as t
ids = run_python("import os\\nprint(os.getuid(), open('/proc/self/status').read().split('CapEff:')[1].split()[0])")
write = run_python("import os\\ntry:\\n    os.open('/x', os.O_WRONLY | os.O_CREAT)\\n"
                   "except OSError as e:\\n    print(e.errno)")
forks = run_python("import os, time\\nn = 0\\ntry:\\n    while True:\\n        if os.fork() == 0:\\n"
                   "            time.sleep(10)\\n            os._exit(0)\\n        n += 1\\n"
                   "except OSError:\\n    print(n)",
                   Limits(processes=8, wall_seconds=30))
hacks = [score_tests(t.HACKS[name], t.FIB_TESTS, t.FAST) for name in sorted(t.HACKS)]
print(repr((ids.output.split(), write.output.split(), int(forks.output) < 8, hacks,
            score_tests(t.FIB, t.FIB_TESTS, t.FAST))))
"""


def test_a_server_not_run_as_root_gets_the_same_isolation():
    """The server as uid 65534: bubblewrap's own mapping, no uid switch, a non-dumpable grader.

    Run with the system's Python 3.11 (the venv's may lie under a home directory only root can
    enter) on this checkout and the venv's site-packages.
    """
    system_python = Path("/usr/bin/python3")
    if os.geteuid() != 0 or not system_python.exists():
        pytest.skip("needs root (to start a process as uid 65534) and /usr/bin/python3")
    version = subprocess.run([system_python, "-c", "import sys; print(sys.version_info[:2])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    if version != str(sys.version_info[:2]):
        pytest.skip(f"/usr/bin/python3 is {version}, the venv's site-packages are for {sys.version_info[:2]}")
    tests = str(Path(__file__).resolve().parent)
    path = os.pathsep.join([PROJECT, *site.getsitepackages()])
    env = {"PATH": os.environ["PATH"], "HOME": "/tmp", "PYTHONPATH": path}
    done = subprocess.run([system_python, "-c", NOT_ROOT_CHECKS.format(tests=tests)], capture_output=True, text=True,
                          env=env, cwd="/tmp", user=65534, group=65534, extra_groups=[], timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    ids, write, forks_stopped, hacks, correct = eval(done.stdout)
    assert ids == ["65534", "0000000000000000"] and write == ["30"] and forks_stopped
    assert len(hacks) > 10 and set(hacks) == {0.0} and correct == 1.0
