"""The run's own steps (sebulba/runtime.py) that need no training run."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sebulba.runtime import resume_command

SCRIPT = str(Path(__file__).resolve().parents[1] / "sebulba" / "ppo_envpool.py")


def test_a_stopped_run_names_the_command_that_resumes_it(monkeypatch):
    monkeypatch.setattr(sys, "argv", [SCRIPT, "--env-id", "CartPole-v1", "--hiddens", "64", "64"])
    assert resume_command("CartPole-v1__ppo_envpool__1__17") == (
        f"python {SCRIPT} --env-id CartPole-v1 --hiddens 64 64 --run-name CartPole-v1__ppo_envpool__1__17")
    monkeypatch.setattr(sys, "argv", [SCRIPT, "--run-name", "mine", "--seed", "2"])  # already named: as typed
    assert resume_command("mine") == f"python {SCRIPT} --run-name mine --seed 2"
    monkeypatch.setattr(sys, "argv", ["-c", "--seed", "2"])  # not started as a script file
    assert resume_command("mine") == "the same command with --run-name mine"


@pytest.mark.slow
def test_ctrl_c_while_the_libraries_load_exits_without_a_traceback():
    child = subprocess.Popen([sys.executable, SCRIPT, "--env-id", "CartPole-v1"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    time.sleep(0.8)  # importing jax, flax and envpool takes ~3 s on 2 cores
    child.send_signal(signal.SIGINT)
    out, err = child.communicate(timeout=60)
    assert child.returncode == -signal.SIGINT and out == "" and "Traceback" not in err, err


@pytest.mark.slow
def test_ctrl_c_before_the_threads_start_says_so_in_one_line(tmp_path):
    # SIGINT while the update is being built (after the run directory, before the threads).
    code = ("import os, signal, sys, sebulba.ppo_envpool as ppo\n"
            "real = ppo.make_update_fn\n"
            "def interrupted(*a):\n    os.kill(os.getpid(), signal.SIGINT)\n    return real(*a)\n"
            "ppo.make_update_fn = interrupted\n"
            f"sys.exit(ppo.cli(['--env-id', 'CartPole-v1', '--local-num-envs', '8', '--num-steps', '16', "
            "'--total-timesteps', '1024']))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(Path(SCRIPT).parents[1])})
    assert out.returncode == 130, out.stderr
    assert out.stderr.strip().splitlines() == ["interrupted before training started: nothing to save"]
