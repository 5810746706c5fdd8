"""The run's own steps (sebulba/runtime.py) that need no training run."""

import sys
from pathlib import Path

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
