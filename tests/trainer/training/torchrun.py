"""Launch a test script on 2 CPU processes (``torchrun`` or ``accelerate launch``), and never leave a rank behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from trainer.launch.vllm_server import free_port

ROOT = Path(__file__).resolve().parents[3]


def torchrun_two_ranks(script: str, *args: str, timeout_s: float = 1200,
                       accelerate_config: Path | None = None) -> tuple[int, str]:
    """Run ``tests/trainer/training/<script> ARGS`` on 2 ranks (gloo, one thread each); (exit code, stderr).

    The launcher is ``torchrun``, or ``accelerate launch --config_file accelerate_config`` (the
    config file says how many processes).
    """
    port = str(free_port())
    if accelerate_config is None:
        launcher = ["torch.distributed.run", "--nproc_per_node", "2", "--master_port", port]
    else:
        launcher = ["accelerate.commands.launch", "--config_file", str(accelerate_config), "--main_process_port", port]
    cmd = [sys.executable, "-m", *launcher, str(ROOT / "tests" / "trainer" / "training" / script), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=timeout_s)
    finally:  # never leave a rank behind, whatever happened
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, stderr
