"""The run's own steps (sebulba/runtime.py, the console of sebulba/learner.py) that need no training run."""

import collections
import os
import queue
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from sebulba import learner

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
            "sys.exit(ppo.cli(['--env-id', 'CartPole-v1', '--local-num-envs', '8', '--num-steps', '16', "
            "'--total-timesteps', '1024']))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(Path(SCRIPT).parents[1])})
    assert out.returncode == 130, out.stderr
    assert out.stderr.strip().splitlines() == ["interrupted before training started: nothing to save"]


def test_the_eta_is_timed_from_the_end_of_the_first_update_which_compiles(monkeypatch, capsys):
    clock = iter([0.0, 10.0, 10.0, 11.0, 12.0])  # start; the first update's end, read twice; the next two
    monkeypatch.setattr(learner.time, "time", lambda: next(clock))
    run = SimpleNamespace(setup=SimpleNamespace(batch_size=100, num_updates=10, num_actor_threads_total=1, process_id=0),
                          flags=SimpleNamespace(checkpoint_interval=0, log_frequency=1), episodes=collections.deque(),
                          summary={}, start_update=0, eval_results=queue.Queue(), queues=[queue.Queue()],
                          logger=SimpleNamespace(log=lambda record, step: None))
    books = learner.Bookkeeping(run, lambda step: 1e-3)
    for update in range(3):
        books.record(update, SimpleNamespace(step=update), None, np.zeros(4), [([20.0], [20], {"actor_sps": 1.0})], {},
                     {"transfer_time_s": 0.1, "update_time_s": 0.5})
    etas = [line.rsplit("eta", 1)[1].strip() for line in capsys.readouterr().out.splitlines()]
    assert etas == ["-", "8s", "7s"]  # 1 s per update after the first 10 s one (the old ETA said 50 s, then 40 s)


@pytest.mark.slow
def test_a_rerun_reads_its_programs_from_the_compilation_cache(tmp_path):
    def run(*flags: str, variable: str):
        flags = ["--env-id", "CartPole-v1", "--local-num-envs", "8", "--num-steps", "16", "--total-timesteps", "256",
                 "--eval-episodes", "0", *flags]
        out = subprocess.run([sys.executable, SCRIPT, *flags], capture_output=True, text=True, timeout=120,
                             cwd=tmp_path, env={**os.environ, "SEBULBA_COMPILATION_CACHE_DIR": variable})
        assert out.returncode == 0, out.stderr
    cache, other = tmp_path / "cache", tmp_path / "other"
    run(variable=str(cache))  # the variable moves the default
    first = sorted(p.name for p in cache.iterdir())
    assert len(first) >= 5  # the policy, prepare, shuffle, step, ...: every program, however small
    run("--compilation-cache-dir", str(cache), variable=str(other))  # the flag wins; the same sizes again:
    assert sorted(p.name for p in cache.iterdir()) == first and not other.exists()  # every program found, none added
    run("--compilation-cache-dir", "None", variable=str(other))  # off
    assert not other.exists()
