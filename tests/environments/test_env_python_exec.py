"""The Python execution environment and its sandbox limits."""

from __future__ import annotations

import pytest

from environments.python_exec import PythonExecEnv
from environments.sandbox import (
    MODE_VARIABLE,
    Isolation,
    Limits,
    SandboxConfigError,
    isolation,
    run_python,
    score_tests,
)

FAST = Limits(cpu_seconds=5, wall_seconds=30.0, output_bytes=1024)  # generous: CI machines are busy


def test_reward_is_the_share_of_tests_passed_by_the_last_successful_code():
    env = PythonExecEnv(limits=FAST)
    env.reset(tests="assert f(1) == 1\nassert f(2) == 4\nassert f(3) == 10")
    assert env.get_reward() == 0.0  # nothing ran yet
    assert env.run_code("def f(x):\n    return x * x\nprint(f(3))") == "9\n"
    failing = env.run_code("def f(x):\n    return x +\n")
    assert "SyntaxError" in failing and "[exit code 1]" in failing
    assert env.get_reward() == pytest.approx(2 / 3)  # the failing run does not replace the solution


@pytest.mark.parametrize(("code", "expected"), [
    ("import socket\nsocket.socket()", "socket.__new__ is not allowed"),
    ("import subprocess\nsubprocess.run(['true'])", "subprocess.Popen is not allowed"),
    ("open('/tmp/toolgym-escape', 'w')", "not allowed outside the working directory"),
    ("import os\nos.kill(1, 9)", "os.kill is not allowed"),
    ("x = bytearray(4 << 30)", "MemoryError"),
])
def test_weak_mode_keeps_the_audit_hook_and_limits(code, expected):
    result = run_python(code, FAST, mode=Isolation.WEAK)
    assert not result.ok and expected in result.output


def test_memory_is_limited_in_the_sandbox():
    result = run_python("x = bytearray(4 << 30)", FAST)
    assert not result.ok and "MemoryError" in result.output


def test_sandbox_limits_time_and_output():
    looping = PythonExecEnv(limits=Limits(cpu_seconds=1, wall_seconds=60.0)).run_code("while True:\n    pass")
    assert "[killed: CPU limit of 1 s]" in looping
    sleeping = PythonExecEnv(limits=Limits(wall_seconds=0.3)).run_code("import time\ntime.sleep(5)")
    assert "[killed: wall-clock limit of 0.3 s]" in sleeping
    loud = run_python("print('x' * 100000)", FAST)
    assert loud.output.endswith("[output truncated]") and len(loud.output) < 1100


def test_code_runs_in_a_private_directory_and_can_use_it():
    result = run_python("open('note.txt', 'w').write('hi')\nimport os\nprint(sorted(os.listdir('.')))", FAST)
    assert result.ok and "note.txt" in result.output
    assert "note.txt" not in run_python("import os\nprint(os.listdir('.'))", FAST).output


FIB_TESTS = ["assert fib(0) == 0", "assert fib(1) == 1", "assert fib(10) == 55", "assert fib(20) == 6765"]
FIB = "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n"


@pytest.mark.parametrize("mode", [None, Isolation.WEAK])
def test_correct_solutions_score_1_and_partial_ones_their_share(mode):
    assert score_tests(FIB, FIB_TESTS, FAST, mode=mode) == 1.0
    assert score_tests("def fib(n):\n    return n\n", FIB_TESTS, FAST, mode=mode) == 0.5  # fib(0), fib(1)
    assert score_tests(FIB, [], FAST, mode=mode) == 0.0


HACKS = {
    "exec replaced": "def exec(*args, **kwargs):\n    pass\n",
    "builtins patched": "import builtins\nbuiltins.exec = lambda *a, **k: None\nbuiltins.AssertionError = KeyError\n",
    "assert neutered": "AssertionError = type('Never', (BaseException,), {})\nclass Exception(BaseException): pass\n",
    "always equal": "class Anything:\n    def __eq__(self, other):\n        return True\n"
                    "    __hash__ = object.__hash__\ndef fib(n):\n    return Anything()\n",
    "int that equals anything": "class Liar(int):\n    def __eq__(self, other):\n        return True\n"
                                "def fib(n):\n    return Liar(-1)\n",  # compared as the plain -1
    "marker printed": "print('__toolgym_tests__ 1000')\nimport os, sys\nsys.stdout.flush()\nos._exit(0)\n",
    "early exit": "import sys\nsys.exit(0)\n",
    "crash while graded": "def fib(n):\n    import os\n    os._exit(0)\n",
    # "4" before the grader's own "0 0" would read as 40 passed, clamped to all of them
    "result fd guessed": "import os\nfor fd in range(3, 256):\n    try:\n"
                         "        os.write(fd, b'4')\n    except OSError:\n"
                         "        pass\ndef fib(n):\n    return -1\n",
    # the parent's (the grader's) pipes that are not the solution's own: its output, and the result
    "grader's fds via /proc": "import os\n"
                              "mine = {os.readlink(f'/proc/self/fd/{fd}') for fd in os.listdir('/proc/self/fd')\n"
                              "        if os.path.exists(f'/proc/self/fd/{fd}')}\n"
                              "try:\n    for fd in os.listdir(f'/proc/{os.getppid()}/fd'):\n"
                              "        link = os.readlink(f'/proc/{os.getppid()}/fd/{fd}')\n"
                              "        if link.startswith('pipe:') and link not in mine:\n"
                              "            with open(f'/proc/{os.getppid()}/fd/{fd}', 'w') as f:\n"
                              "                f.write('4')\n"
                              "except OSError:\n    pass\ndef fib(n):\n    return -1\n",
    "grader killed": "import os, signal\nfor pid in (1, os.getppid()):\n    try:\n"
                     "        os.kill(pid, signal.SIGKILL)\n    except OSError:\n        pass\n"
                     "def fib(n):\n    return -1\n",
}


@pytest.mark.parametrize("hack", sorted(HACKS))
def test_reward_hacks_score_0(hack):
    assert score_tests(HACKS[hack], FIB_TESTS, FAST) == 0.0


def test_a_hack_through_the_environment_scores_0_and_a_solution_1():
    env = PythonExecEnv(limits=FAST)
    env.reset(tests=FIB_TESTS)
    assert env.run_code(HACKS["marker printed"]) == "__toolgym_tests__ 1000\n"  # it ran "without error"
    assert env.get_reward() == 0.0
    env.run_code(FIB)
    assert env.get_reward() == 1.0


def test_bad_settings_are_typed_errors(monkeypatch):
    monkeypatch.setenv(MODE_VARIABLE, "none")
    with pytest.raises(SandboxConfigError, match="TOOLGYM_SANDBOX='none': use 'bwrap'"):
        isolation()
    with pytest.raises(SandboxConfigError, match="Limits.processes must be > 0"):
        Limits(processes=0)
