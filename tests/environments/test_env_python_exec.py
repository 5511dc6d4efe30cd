"""The Python execution environment and its sandbox limits."""

from __future__ import annotations

import pytest

from environments.python_exec import PythonExecEnv
from environments.sandbox import Isolation, Limits, run_python

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
