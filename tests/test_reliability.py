"""Supervision, stalls, signals, checkpoints and resume on real CartPole runs. The runtime
(sebulba/runtime.py, threads.py, checkpoints.py) is tested once, on the PPO script; each
script keeps one smoke test of what it wires in: a failing thread, a stop signal with resume,
--deterministic (the IMPALA learner reads its queues differently there)."""

import importlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import tyro
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import sebulba.envs
import sebulba.evaluation
import sebulba.ppo_envpool as ppo
import sebulba.runtime
from sebulba.checkpoints import complete_steps
from sebulba.config import ConfigError
from sebulba.evaluation import eval_seed

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ["ppo_envpool", "impala_envpool"]
COMMON = ["--env-id", "CartPole-v1", "--local-num-envs", "8", "--num-steps", "16", "--num-actor-threads", "2",
          "--hiddens", "16", "--log-frequency", "5"]
SMALL = {"ppo_envpool": [*COMMON, "--update-epochs", "1"], "impala_envpool": COMMON}

# A child process starts from a user's shell environment: without the W&B service address that an
# in-process W&B run of this pytest process leaves in WANDB_SERVICE (children would share that
# service, which still holds a killed child's run id as "in use").
def shell_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}

# Patches applied inside the child process before the CLI runs.
ACTOR_FAULT = """
import sebulba.runtime
real = sebulba.runtime.make_envs
class Faulty:
    def __init__(self, pool): self.pool, self.calls = pool, 0
    def recv(self):
        self.calls += 1
        if self.calls == 40:  # inside the thread's 2nd rollout (the 1st needs 34 recvs)
            raise RuntimeError("injected EnvPool fault")
        return self.pool.recv()
    def __getattr__(self, name): return getattr(self.pool, name)
made = []
def patched(*a, **k):  # only the first actor thread's pool fails
    made.append(1)
    return Faulty(real(*a, **k)) if len(made) == 1 else real(*a, **k)
sebulba.runtime.make_envs = patched
"""
LEARNER_FAULT = """
real = ppo.make_update_fn
def patched(*a, **k):
    update, calls = real(*a, **k), []
    def faulty(*args):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected learner fault")
        return update(*args)
    faulty.programs = update.programs  # (the memory check compiles them)
    return faulty
ppo.make_update_fn = patched
"""
# The stuck learner never returns: the supervisor's join deadline (10 s for a thread stuck in native
# code) is cut to 1 s in the child, so the test measures the stall detection, not the deadline.
LEARNER_STALL = LEARNER_FAULT.replace('raise RuntimeError("injected learner fault")', "time.sleep(3600)") + """
import sebulba.threads
sebulba.threads.Supervisor.join_timeout_s = 1.0
"""


def run_cli(flags, patch="", timeout=180, script="ppo_envpool"):
    code = f"import sys, time\nimport sebulba.{script} as ppo\n{patch}\nsys.exit(ppo.cli(sys.argv[1:]))"
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code, *flags], capture_output=True, text=True, timeout=timeout,
                         env={**shell_env(), "PYTHONPATH": str(ROOT)})
    return out, time.monotonic() - start


# Each thread kind fails on one script: the supervisor is shared (tests/test_threads.py tests it alone).
@pytest.mark.parametrize("patch, message, script", [(ACTOR_FAULT, "injected EnvPool fault", "ppo_envpool"),
                                                    (LEARNER_FAULT, "injected learner fault", "impala_envpool")],
                         ids=["actor-ppo", "learner-impala"])
def test_a_failing_thread_ends_the_run_with_its_traceback(patch, message, script):
    out, seconds = run_cli(SMALL[script] + ["--total-timesteps", "100000", "--run-name", "fault"], patch, script=script)
    assert out.returncode == 1, out.stderr[-2000:]
    assert "Traceback" in out.stderr and f"RuntimeError: {message}" in out.stderr
    assert out.stderr.count("Traceback") == 1  # the original, once
    assert out.stderr.strip().splitlines()[-1].startswith("error: ")
    assert seconds < 60  # start-up and compilation included; the failure itself ends the run within seconds


def test_a_stalled_learner_is_named_not_waited_for():
    out, seconds = run_cli(SMALL["ppo_envpool"] + ["--total-timesteps", "100000", "--stall-timeout-s", "3", "--run-name",
                                                   "stall"], LEARNER_STALL)
    assert out.returncode == 1
    # Whichever wait the actors hit first (queue full, or params too old) names the learner.
    assert re.search(r"StallError: actor thread \d .*the learner (stalled|stopped consuming)", out.stderr)
    assert seconds < 60


def test_a_normal_run_joins_every_thread_and_closes_every_pool(monkeypatch):
    pools = []
    real = sebulba.envs.make_envs
    for module in (sebulba.runtime, sebulba.evaluation):  # the actor threads' pools, the final evaluation's
        monkeypatch.setattr(module, "make_envs", lambda *a, **k: pools.append(real(*a, **k)) or pools[-1])
    released = []  # the run directory is given up last: a relaunch never runs beside the summary being written
    release = sebulba.runtime.release_run_dirs
    monkeypatch.setattr(sebulba.runtime, "release_run_dirs",
                        lambda: released.append(Path("runs/clean/summary.json").exists()) or release())
    summary = ppo.main(ppo.Args(env_id="CartPole-v1", local_num_envs=8, num_steps=16, hiddens=(16,),
                                total_timesteps=8 * 16 * 2 * 3, run_name="clean"))
    assert summary["updates"] == 3 and "interrupted_by" not in summary
    assert released == [True] and not Path("runs/clean.lock").exists()
    assert len(pools) == 3 and all(p.closed for p in pools)  # two actor threads' and the final evaluation's
    alive = [t.name for t in threading.enumerate() if t.name.startswith(("actor-", "learner", "evaluator"))]
    assert alive == []


def start_run(flags, script="ppo_envpool"):
    code = f"import sys\nimport sebulba.{script} as ppo\nsys.exit(ppo.cli(sys.argv[1:]))"
    return subprocess.Popen([sys.executable, "-c", code, *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**shell_env(), "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"})


def signal_at_update(proc, update: int, sig) -> tuple[int, str]:
    """Read a `start_run` child's console until the line of update `update` (training under way),
    send it `sig`, wait for it: (exit code, everything it printed)."""
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("step ") and f"update {update}/" in line:
            break
    proc.send_signal(sig)
    rest, _ = proc.communicate(timeout=60)
    return proc.returncode, "".join(lines) + rest


# The signal handling is shared (sebulba/threads.py, runtime.py): each signal on one script.
@pytest.mark.parametrize("sig, code, script", [(signal.SIGINT, 130, "ppo_envpool"), (signal.SIGTERM, 143, "impala_envpool")])
def test_a_stop_signal_checkpoints_and_the_same_command_resumes(sig, code, script):
    total = 8 * 16 * 2 * 60
    flags = SMALL[script] + ["--total-timesteps", str(total), "--checkpoint-interval", "1000", "--run-name", "preempted"]
    returncode, output = signal_at_update(start_run(flags, script), 10, sig)
    assert returncode == code, output
    assert f"{sig.name}: checkpointing and stopping" in output
    assert "to resume: the same command with --run-name preempted" in output
    stopped = json.loads(Path("runs/preempted/summary.json").read_text())
    assert stopped["interrupted_by"] == sig.name and 10 <= stopped["updates"] < 60
    assert (Path("runs/preempted/checkpoints") / str(stopped["updates"])).is_dir()

    out, _ = run_cli(flags, script=script)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "resumed from" in out.stdout and f"update {stopped['updates']}," in out.stdout
    done = json.loads(Path("runs/preempted/summary.json").read_text())
    assert done["global_step"] == total and done["updates"] == 60 and "interrupted_by" not in done
    # The resumed run continued counters: its first console line is past the stop point.
    first = next(line for line in out.stdout.splitlines() if line.startswith("step "))
    assert int(first.split("|")[1].split()[1].split("/")[0]) > stopped["updates"]


def test_resume_refuses_a_mismatched_or_unreadable_checkpoint(capsys):
    flags = SMALL["ppo_envpool"] + ["--total-timesteps", str(8 * 16 * 2 * 2), "--run-name", "ckpt"]
    ppo.main(tyro.cli(ppo.Args, args=flags))
    out, _ = run_cli([*flags[:flags.index("--num-steps")], "--num-steps", "32", *flags[flags.index("--num-steps") + 2:]])
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith("error: checkpoint ")
    assert "--num-steps 16 (now 32)" in out.stderr
    assert out.stderr.strip().count("\n") == 0  # one line, nothing else
    summary = Path("runs/ckpt/summary.json").read_text()
    capsys.readouterr()
    ppo.main(tyro.cli(ppo.Args, args=flags))  # rerunning a finished run trains nothing, leaves it as it was
    assert "already finished at update 2" in capsys.readouterr().out
    assert Path("runs/ckpt/summary.json").read_text() == summary
    longer = [*flags[:flags.index("--total-timesteps")], "--total-timesteps", str(8 * 16 * 2 * 3),
              *flags[flags.index("--total-timesteps") + 2:]]
    ppo.main(tyro.cli(ppo.Args, args=longer))  # a larger --total-timesteps trains the same run further
    out = capsys.readouterr().out
    assert "resumed from" in out and "done: 768 env steps" in out
    for f in Path("runs/ckpt/checkpoints/3").rglob("*"):
        if f.is_file():
            f.write_bytes(b"garbage")
    with pytest.raises(ConfigError, match="cannot read checkpoint"):
        ppo.main(tyro.cli(ppo.Args, args=longer))


# After the save at update 10, the checkpoint directory becomes immutable (chattr +i: even root cannot
# write it, as a read-only or full disk): the save at 20 fails inside real orbax.
SAVE_FAULT = """
import subprocess
import sebulba.checkpoints
real = sebulba.checkpoints.Checkpointer.save
def save(self, update, state, meta, extra=None):
    real(self, update, state, meta, extra)
    if update == 10:
        subprocess.run(["chattr", "+i", str(self.directory)], check=True)
sebulba.checkpoints.Checkpointer.save = save
"""


def test_a_failed_checkpoint_save_ends_the_run_loudly(tmp_path):
    probe = tmp_path / "probe"
    probe.mkdir()
    if subprocess.run(["chattr", "+i", str(probe)], capture_output=True).returncode:
        pytest.skip("chattr +i is not available here: no way to make a directory unwritable for root")
    subprocess.run(["chattr", "-i", str(probe)], check=True)
    checkpoints = Path("runs/unsaved/checkpoints")
    try:
        out, _ = run_cli([*SMALL["ppo_envpool"], "--num-actor-threads", "1", "--total-timesteps", str(8 * 16 * 30),
                          "--checkpoint-interval", "10", "--eval-episodes", "0", "--run-name", "unsaved"], SAVE_FAULT)
    finally:
        subprocess.run(["chattr", "-i", str(checkpoints)])
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("error: learner failed: CheckpointError(") and "could not save checkpoint " \
        "runs/unsaved/checkpoints/20" in last and "the newest saved one is runs/unsaved/checkpoints/10" in last
    assert complete_steps(checkpoints) == [10]
    assert "update 30/30" not in out.stdout  # the run stopped at the failed save, it did not train on
    assert not Path("runs/unsaved/summary.json").exists()  # nothing says update 20 was saved


# Inside the resumed run: every call of W&B's log, with its keyword arguments, into wandb_calls.jsonl.
WANDB_SPY = """
import json, wandb
real_log = wandb.Run.log
def log(self, data, *args, **kwargs):
    with open("wandb_calls.jsonl", "a") as f:
        f.write(json.dumps({"global_step": data.get("global_step"), "args": len(args), "kwargs": sorted(kwargs)}) + "\\n")
    return real_log(self, data, *args, **kwargs)
wandb.Run.log = log
"""


def test_one_process_owns_a_run_directory_and_a_killed_owner_does_not_block_the_resume():
    """The same command launched while its run is going is refused in one line (exit 2, before
    any thread) naming the owner; once the owner is killed (SIGKILL) the same command runs."""
    flags = [*SMALL["ppo_envpool"], "--num-actor-threads", "1", "--checkpoint-interval", "0", "--eval-episodes", "0",
             "--run-name", "owned"]
    owner = start_run([*flags, "--total-timesteps", str(8 * 16 * 100_000)])
    for line in owner.stdout:
        if line.startswith("step "):  # training under way
            break
    second, _ = run_cli([*flags, "--total-timesteps", str(8 * 16 * 100_000)])
    assert second.returncode == 2 and "Traceback" not in second.stderr, second.stderr
    assert second.stderr.strip().splitlines()[-1].startswith(
        f"error: runs/owned is in use by process {owner.pid} on host {socket.gethostname()} since "), second.stderr
    assert not (Path("runs/owned") / "summary.json").exists()
    owner.kill()
    owner.communicate(timeout=60)
    assert Path("runs/owned.lock").exists()  # the file stays; the kernel dropped its lock with the process
    out, _ = run_cli([*flags, "--total-timesteps", "600"])  # 4 updates of 128 env steps and 88 more
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert not Path("runs/owned.lock").exists()  # a normal exit removes it
    assert out.stdout.splitlines()[1] == ("--total-timesteps 600 is not a whole number of updates of 128 env steps: "
                                          "training 512 env steps (4 updates)"), out.stdout  # said up front


def test_a_filesystem_without_locks_is_refused_in_one_line():
    """Lustre mounted without flock answers flock with ENOSYS: one line saying the run directory's
    filesystem cannot be locked and what to do, exit 2, nothing written."""
    patch = ("import errno, fcntl\n"
             "def no_locks(*_):\n    raise OSError(errno.ENOSYS, 'Function not implemented')\n"
             "fcntl.flock = no_locks")
    out, _ = run_cli([*SMALL["ppo_envpool"], "--total-timesteps", "600", "--run-name", "unlockable"], patch)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().splitlines() == [
        "error: runs/ is on a filesystem that cannot be locked (Function not implemented), so two launches of one run "
        "could write unlockable/ together: launch from a directory on a filesystem with locks (local disk; Lustre "
        "mounted with -o flock; NFS with its lock service)"], out.stderr
    assert not Path("runs/unlockable").exists() and not Path("runs/unlockable.lock").exists()


def test_no_metric_is_dropped_after_resuming_from_an_older_checkpoint():
    """A run logs every update, checkpoints every 4 and is killed (SIGKILL) after logging update 6
    or later; the same command resumes from update 4. TensorBoard then holds every update once,
    the resumed session's from 5 on; W&B receives every point from the checkpoint on with its
    global step as a metric, never a `step` it would drop for not increasing (wandb#5632)."""
    flags = [*SMALL["ppo_envpool"], "--num-actor-threads", "1", "--checkpoint-interval", "4", "--log-frequency", "1",
             "--eval-episodes", "0", "--track", "--run-name", "killed"]
    _, output = signal_at_update(start_run([*flags, "--total-timesteps", str(8 * 16 * 1000)]), 6, signal.SIGKILL)
    assert sorted(p.name for p in Path("runs/killed/checkpoints").iterdir() if p.name.isdigit()) == ["4"], output
    out, _ = run_cli([*flags, "--total-timesteps", str(8 * 16 * 10)], WANDB_SPY)
    assert out.returncode == 0 and "resumed from" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
    events = EventAccumulator("runs/killed").Reload()
    points = [(e.step, e.value) for e in events.Scalars("charts/updates")]
    assert points == [(128 * u, float(u)) for u in range(1, 11)], points
    calls = [json.loads(line) for line in Path("wandb_calls.jsonl").read_text().splitlines()]
    assert all(c["args"] == 0 and c["kwargs"] == [] for c in calls)  # no step= for W&B to refuse
    assert [c["global_step"] for c in calls] == [128 * u for u in range(5, 11)]


def test_a_half_written_checkpoint_does_not_block_the_resume(capsys):
    """A finished checkpoint at 4, then one at 8 that orbax never finished (no commit marker, no
    metadata) and a temporary directory of 12: the run resumes from 4 and trains on to 12."""
    flags = [*SMALL["ppo_envpool"], "--num-actor-threads", "1", "--checkpoint-interval", "4", "--eval-episodes", "0",
             "--run-name", "half", "--total-timesteps"]
    ppo.main(tyro.cli(ppo.Args, args=[*flags, str(8 * 16 * 8)]))  # the run that "died" saving update 8
    checkpoints = Path("runs/half/checkpoints")
    for marker in ("commit_success.txt", "_CHECKPOINT_METADATA"):
        (checkpoints / "8" / marker).unlink()
    (checkpoints / "12.orbax-checkpoint-tmp-1733000000").mkdir()
    capsys.readouterr()
    summary = ppo.main(tyro.cli(ppo.Args, args=[*flags, str(8 * 16 * 12)]))
    out = capsys.readouterr().out
    assert "checkpoints/8 was never finished" in out and "resumed from" in out and "update 4, global step 512" in out
    assert summary["updates"] == 12 and "interrupted_by" not in summary
    assert [p.name for p in checkpoints.glob("8.incomplete-*")] != []  # kept for a look, out of orbax's way
    assert sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()) == [4, 8, 12]


def test_a_run_started_without_a_name_resumes_with_the_name_it_printed(capsys):
    """The README command has no --run-name: the stop line prints the command with the default name
    added, and that command resumes (the checkpoint's saved run_name was None)."""
    flags = [*SMALL["ppo_envpool"], "--num-actor-threads", "1", "--eval-episodes", "0", "--total-timesteps"]
    first = ppo.main(tyro.cli(ppo.Args, args=[*flags, str(8 * 16 * 2)]))
    name = Path(first["run_dir"]).name
    capsys.readouterr()
    again = ppo.main(tyro.cli(ppo.Args, args=[*flags, str(8 * 16 * 4), "--run-name", name]))
    assert "resumed from" in capsys.readouterr().out and again["updates"] == 4


def test_a_resume_refused_for_memory_leaves_the_run_as_it_was_and_keeps_its_microbatches(monkeypatch, capsys):
    """A run resumed where its learner no longer fits is refused before it writes anything (its
    directory, config.json and checkpoints stay as they were); resumed where it fits, with
    --gradient-accumulation-steps None it keeps the count its checkpoint records."""
    import sebulba.learner
    flags = [*SMALL["ppo_envpool"], "--num-actor-threads", "1", "--eval-episodes", "0", "--run-name", "kept",
             "--total-timesteps"]
    ppo.main(tyro.cli(ppo.Args, args=[*flags, str(8 * 16 * 2)]))
    files = {p: p.read_bytes() for p in Path("runs/kept").rglob("*") if p.is_file()}
    real = sebulba.learner.psutil.virtual_memory
    monkeypatch.setattr(sebulba.learner.psutil, "virtual_memory", lambda: type("Free", (), {"available": 1 << 10}))
    with pytest.raises(ConfigError, match=r"^the learner needs .* lower --local-num-envs or --num-steps$"):
        ppo.main(tyro.cli(ppo.Args, args=[*flags, str(8 * 16 * 4)]))
    assert {p: p.read_bytes() for p in Path("runs/kept").rglob("*") if p.is_file()} == files
    monkeypatch.setattr(sebulba.learner.psutil, "virtual_memory", real)
    meta = Path("runs/kept/checkpoints/2/meta/metadata")  # the count the first session settled, as if chosen: 2
    meta.write_text(meta.read_text().replace('"gradient_accumulation_steps": 1', '"gradient_accumulation_steps": 2'))
    capsys.readouterr()
    again = ppo.main(tyro.cli(ppo.Args, args=[*flags, str(8 * 16 * 4)]))
    assert again["updates"] == 4 and "resumed from" in capsys.readouterr().out
    assert json.loads(Path("runs/kept/config.json").read_text())["derived"]["gradient_accumulation_steps"] == 2


@pytest.mark.parametrize("script", SCRIPTS)
def test_deterministic_runs_are_bit_identical_and_a_stopped_run_resumes_into_the_same_run(script):
    """Two runs with the same seed and layout end with bit-identical parameters. For PPO the second
    run is stopped by SIGTERM between checkpoints and resumed (on 2 learner devices: also checks
    that resuming a multi-device CPU layout works); the stop and resume path is shared, so IMPALA's
    second run goes straight through."""
    total = 8 * 16 * 2 * 24
    module = importlib.import_module(f"sebulba.{script}")
    flags = [*SMALL[script], "--total-timesteps", str(total), "--deterministic", "--checkpoint-interval", "4",
             "--learner-device-ids", "1", "2", "--log-frequency", "1"]
    first = module.main(tyro.cli(module.Args, args=[*flags, "--run-name", "first"]))
    if script != "ppo_envpool":
        second = module.main(tyro.cli(module.Args, args=[*flags, "--run-name", "second"]))
        assert first["params_sha256"] == second["params_sha256"]
        return

    returncode, output = signal_at_update(start_run([*flags, "--run-name", "stopped"], script), 6, signal.SIGTERM)
    assert returncode == 143, output
    assert "SIGTERM: stopping (--deterministic: no new checkpoint)" in output
    stopped = json.loads(Path("runs/stopped/summary.json").read_text())
    resume_from = int(Path(stopped["checkpoint"]).name)
    assert resume_from % 4 == 0 and resume_from < stopped["updates"] < 24
    assert f"resumes from update {resume_from}" in output
    out, _ = run_cli([*flags, "--run-name", "stopped"], script=script)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert f"resumed from {Path('runs/stopped/checkpoints').absolute()}/{resume_from}:" in out.stdout
    assert json.loads(Path("runs/stopped/summary.json").read_text())["params_sha256"] == first["params_sha256"]

    # The checkpoint interval decides where envs restart: a deterministic run may not change it.
    with pytest.raises(ConfigError, match=r"--checkpoint-interval 4 \(now 8\)"):
        module.main(tyro.cli(module.Args, args=[*flags, "--checkpoint-interval", "8", "--run-name", "first"]))


def test_a_stop_signal_during_the_final_evaluation_keeps_the_run_and_says_how_to_finish_it(monkeypatch, capsys):
    real = sebulba.evaluation.Evaluator.__call__

    def signalled(self, params, stop):  # SIGTERM arrives while the final evaluation starts
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.5)  # the handler runs in the main thread
        return real(self, params, stop)

    monkeypatch.setattr(sebulba.evaluation.Evaluator, "__call__", signalled)
    flags = [*SMALL["ppo_envpool"], "--total-timesteps", str(8 * 16 * 2 * 2), "--run-name", "final"]
    summary = ppo.main(tyro.cli(ppo.Args, args=flags))
    assert summary["interrupted_by"] == "SIGTERM" and "final_eval" not in summary
    assert summary["updates"] == 2 and len(summary["params_sha256"]) == 64  # trained, saved and hashed
    assert "stopped by SIGTERM" in capsys.readouterr().out
    # Evaluation flags, and --norm-obs given as its resolved value, may change on resume.
    again = ppo.main(tyro.cli(ppo.Args, args=[*flags, "--eval-interval", "1", "--norm-obs", "False"]))
    assert again == json.loads(Path("runs/final/summary.json").read_text())
    out = capsys.readouterr().out
    assert "already finished at update 2" in out
    assert f"python scripts/evaluate.py runs/final --episodes 10 --seed {eval_seed(1)}" in out
    with pytest.raises(ConfigError, match=r"--norm-obs False \(now True\)"):
        ppo.main(tyro.cli(ppo.Args, args=[*flags, "--norm-obs", "True"]))


def test_many_minibatch_steps_over_two_learner_devices_do_not_stall_the_cpu_collectives():
    # 32 minibatches x 10 epochs queued at once made XLA:CPU's all-reduce rendezvous time out
    # and abort the process (MAX_STEPS_IN_FLIGHT): in a child process, so a regression cannot take pytest down.
    # (Without it this run aborted in its first update, after 60 s, with exit status 134.)
    out, _ = run_cli([*SMALL["ppo_envpool"][:-2], "--num-actor-threads", "1", "--num-steps", "32", "--hiddens", "64",
                      "64", "--num-minibatches", "32", "--update-epochs", "10", "--learner-device-ids", "1", "2",
                      "--total-timesteps", "512", "--eval-episodes", "0", "--run-name", "many"])
    assert out.returncode == 0, out.stderr[-2000:]
