"""The sbatch template run locally, with stand-ins for `srun` (runs the task here) and
`scontrol` (records its call): SIGUSR1 sent to the batch shell alone reaches the trainer, which
checkpoints and exits 138, and the job is requeued exactly once (warpx PR#4665)."""

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def stand_in(path: Path, body: str):
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_the_pre_emption_signal_sent_to_the_batch_shell_reaches_the_trainer(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # srun: drop its own options, run the task in place (exec: the shell's child is the trainer).
    stand_in(bin_dir / "srun", 'while [[ "$1" == --* ]]; do shift; done\nshift\n'
                               f'exec "{sys.executable}" "$@"\n')
    stand_in(bin_dir / "scontrol", f'echo "$@" >> "{tmp_path}/scontrol.log"\n')
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1",
           "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "localhost", "SLURM_CPUS_PER_TASK": "2", "SCRIPT": str(ROOT / "sebulba" / "ppo_envpool.py")}
    flags = ["--env-id", "CartPole-v1", "--local-num-envs", "8", "--num-steps", "16", "--num-actor-threads", "1",
             "--hiddens", "16", "--update-epochs", "1", "--learner-device-ids", "1", "--total-timesteps", "10000000",
             "--log-frequency", "5", "--eval-episodes", "0"]
    shell = subprocess.Popen(["bash", str(ROOT / "scripts" / "slurm" / "sebulba.sbatch"), *flags], cwd=tmp_path,
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
    lines = []
    for line in shell.stdout:  # training is under way
        lines.append(line)
        if line.startswith("step ") and "update 10/" in line:
            break
    os.kill(shell.pid, signal.SIGUSR1)  # the batch shell's pid only, as --signal=B:USR1 or scancel --batch do
    sent = time.monotonic()
    try:
        rest, _ = shell.communicate(timeout=120)
    except subprocess.TimeoutExpired:  # the trainer never heard the signal: end the whole job
        os.killpg(shell.pid, signal.SIGKILL)
        raise
    output = "".join(lines) + rest
    assert time.monotonic() - sent < 60
    assert shell.returncode == 138, output[-3000:]
    assert "SIGUSR1: checkpointing and stopping" in output and "requeueing job 4242" in output
    summary = json.loads((tmp_path / "runs" / "sebulba_4242" / "summary.json").read_text())
    assert summary["interrupted_by"] == "SIGUSR1"
    assert (tmp_path / "runs" / "sebulba_4242" / "checkpoints" / str(summary["updates"])).is_dir()
    assert (tmp_path / "scontrol.log").read_text().splitlines() == ["requeue 4242"]  # exactly once
