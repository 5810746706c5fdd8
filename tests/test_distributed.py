"""Multi-process runs on one machine: jax.distributed over local processes, CPU collectives
through gloo (multi-node Sebulba). Each test starts real processes. The multi-process runtime is
shared, so each test runs one script; each script has one two-process smoke test."""

import importlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import tyro

from sebulba.checkpoints import read_resume_meta
from sebulba.config import Cluster, ConfigError, RunFlags, detect_cluster, resolve_run

ROOT = Path(__file__).resolve().parents[1]
FLAGS = ["--env-id", "CartPole-v1", "--local-num-envs", "8", "--num-steps", "16", "--num-actor-threads", "1",
         "--hiddens", "16", "--log-frequency", "2", "--actor-device-ids", "0", "--learner-device-ids", "1",
         "--distributed"]
UPDATES = 4
TOTAL = ["--total-timesteps", str(2 * 8 * 16 * UPDATES)]  # two processes x 8 envs x 16 steps per update

# Instrumentation run inside each process: after every update, the SHA-256 of the params;
# for every batch, the env steps this process contributed; at every save and restore, the
# SHA-256 of the params written or read.
RECORD = """
import hashlib, os, sys
import jax
import sebulba.checkpoints, sebulba.runtime
from sebulba.devices import host
flag = sys.argv.index("--process-id") + 1 if "--process-id" in sys.argv else None
pid = sys.argv[flag] if flag else os.environ.get("JAX_PROCESS_ID", os.environ.get("SLURM_PROCID", "0"))
def sha(params):
    return hashlib.sha256(b"".join(host(x).tobytes() for x in jax.tree.leaves(params))).hexdigest()
def record(kind, value):
    with open(f"{kind}_{pid}.txt", "a") as f:
        f.write(f"{value}\\n")
real_update = ppo.make_update_fn
def make_update_fn(*a, **k):
    update = real_update(*a, **k)
    def recorded(state, rollout, key):
        record("steps", (rollout.actions.shape[0] - 1) * sum(s.data.shape[1] for s in rollout.actions.addressable_shards))
        state, metrics = update(state, rollout, key)
        record("params", sha(state.params))
        return state, metrics
    recorded.programs = update.programs  # (the memory check compiles them)
    return recorded
ppo.make_update_fn = make_update_fn
Checkpointer = sebulba.checkpoints.Checkpointer
real_save, real_restore = Checkpointer.save, Checkpointer.restore_state
def save(self, update, state, meta, extra=None):
    real_save(self, update, state, meta, extra)
    record("saved", f"{update} {sha(state.params)}")
    if os.environ.get("KILL_AFTER_SAVE") == str(update):
        self.manager.wait_until_finished()
        os._exit(9)
def restore_state(self, update, like):
    state = real_restore(self, update, like)
    record("restored", f"{update} {sha(state.params)}")
    return state
Checkpointer.save, Checkpointer.restore_state = save, restore_state
"""


def command(patch: str = "", script: str = "ppo_envpool") -> list[str]:
    code = f"import sys\nimport sebulba.{script} as ppo\n{RECORD}\n{patch}\nsys.exit(ppo.cli(sys.argv[1:]))"
    return [sys.executable, "-c", code]


def start(flags: list[str], env: dict[str, str], patch: str = "", script: str = "ppo_envpool") -> subprocess.Popen:
    return subprocess.Popen([*command(patch, script), *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT), **env})


def finish(procs: list[subprocess.Popen], timeout: float = 240) -> list[tuple[int, str]]:
    return [(p.communicate(timeout=timeout)[0], p.returncode)[::-1] for p in procs]


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lines(kind: str, pid: int) -> list[str]:
    return Path(f"{kind}_{pid}.txt").read_text().split()


def check_two_process_run(name: str, outputs: list[tuple[int, str]]):
    for code, out in outputs:
        assert code == 0, out[-3000:]
    assert lines("params", 0) == lines("params", 1)  # the same parameters after every update
    assert len(lines("params", 0)) == UPDATES
    summary = json.loads(Path(f"runs/{name}/summary.json").read_text())
    steps = sum(int(n) for pid in (0, 1) for n in lines("steps", pid))
    assert summary["global_step"] == steps == 2 * 8 * 16 * UPDATES
    assert [p.name for p in Path("runs").iterdir()] == [name]  # one run directory
    assert len(list(Path(f"runs/{name}/wandb").glob("offline-run-*"))) == 1  # one W&B run
    assert summary["params_sha256"] == lines("params", 0)[-1]
    assert "process(es)" in outputs[0][1] and "process(es)" not in outputs[1][1]  # process 0 alone reports
    for _, out in outputs:  # one Gloo context per process (the learner mesh's; orbax's barriers use the client)
        assert out.count("is connected to 1 peer ranks") == 1, out[-3000:]


@pytest.mark.slow
def test_two_processes_with_explicit_coordinator_share_one_learner_mesh(script="impala_envpool"):
    port = free_port()
    procs = [start([*FLAGS, *TOTAL, "--track", "--run-name", "explicit", "--coordinator-address", f"127.0.0.1:{port}",
                    "--num-processes", "2", "--process-id", str(i)], {}, script=script) for i in range(2)]
    check_two_process_run("explicit", finish(procs))


@pytest.mark.slow
def test_launch_local_runs_a_save_kill_relaunch_cycle_bit_for_bit(script="ppo_envpool"):
    """Save at update 2, kill both processes, relaunch: both restore exactly the saved
    parameters and the counters continue."""
    launcher = [sys.executable, str(ROOT / "scripts" / "launch_local.py"), "-n", "2", "--grace-s", "30", "--"]
    flags = [*FLAGS, *TOTAL, "--checkpoint-interval", "2", "--run-name", "relaunched"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    killed = subprocess.run([*launcher, *command(script=script), *flags], env={**env, "KILL_AFTER_SAVE": "2"},
                            capture_output=True, text=True, timeout=240)
    assert killed.returncode == 9, killed.stdout[-3000:]
    saved = lines("saved", 0)
    assert saved[:1] == ["2"] and lines("saved", 1) == saved  # one checkpoint, taken by both processes
    resumed = subprocess.run([*launcher, *command(script=script), *flags], env=env, capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert lines("restored", 0) == lines("restored", 1) == saved  # bit for bit, on every process
    assert "[0] resumed from" in resumed.stdout and "update 2, global step 512" in resumed.stdout
    summary = json.loads(Path("runs/relaunched/summary.json").read_text())
    assert summary["updates"] == UPDATES and summary["global_step"] == 2 * 8 * 16 * UPDATES
    args = tyro.cli(importlib.import_module(f"sebulba.{script}").Args, args=flags)
    with pytest.raises(ConfigError, match=r"written with 2 process\(es\) \(now 1\)"):  # the global batch would change
        read_resume_meta(Path("runs/relaunched/checkpoints"), args, num_processes=1)


# Tiny launch_local processes. Process 1 writes its pid and dies by SIGKILL; process 0 waits
# until the launcher has reaped process 1 (its pid is gone; at most 10 s: the old launcher
# did not look at process 1 while process 0 ran), then exits 1.
KILLED_THEN_FAILED = """
import os, signal, sys, time
if os.environ["JAX_PROCESS_ID"] == "1":
    with open("one.tmp", "w") as f:
        f.write(str(os.getpid()))
    os.rename("one.tmp", "one.pid")
    os.kill(os.getpid(), signal.SIGKILL)
deadline = time.monotonic() + 10
while not os.path.exists("one.pid") and time.monotonic() < deadline:
    time.sleep(0.02)
pid = int(open("one.pid").read())
while time.monotonic() < deadline:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        break
    time.sleep(0.02)
time.sleep(0.3)
sys.exit(1)
"""
# Process 1 exits 2 at once; process 0 would sleep a minute and is killed after --grace-s.
FAILED_THEN_KILLED = """
import os, sys, time
if os.environ["JAX_PROCESS_ID"] == "1":
    sys.exit(2)
time.sleep(60)
"""


@pytest.mark.slow
@pytest.mark.parametrize("code, expected, line", [
    (KILLED_THEN_FAILED, 137, "launch_local: process 1 failed first (exit 137, killed by SIGKILL)"),
    (FAILED_THEN_KILLED, 2, "launch_local: process 1 failed first (exit 2)"),
    ("pass", 0, None),
], ids=["killed-then-failed", "failed-then-killed-after-grace", "both-succeed"])
def test_launch_local_reports_the_process_that_failed_first(code, expected, line):
    """The exit code is the first failure in time, not the first by process index (which was
    process 0's 1, losing the SIGKILL that explains the run's end), and stderr names it."""
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "launch_local.py"), "-n", "2", "--grace-s", "0.5",
                           "--", sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == expected, done.stderr
    reports = [s for s in done.stderr.splitlines() if "failed first" in s]
    assert reports == ([line] if line else []), done.stderr
    if code is FAILED_THEN_KILLED:
        assert "launch_local: process 0 still running 0.5s after another failed; killing it" in done.stderr


def test_a_partial_slurm_environment_runs_as_one_process(monkeypatch, capsys):
    for var in ("SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID", "JAX_COORDINATOR_ADDRESS",
                "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    cluster = detect_cluster(RunFlags(distributed=True))
    assert cluster == Cluster(slurm_job_id="77")
    assert "running as a single process" in capsys.readouterr().out
    monkeypatch.delenv("SLURM_JOB_ID")
    with pytest.raises(ConfigError, match="--distributed needs a SLURM step"):
        detect_cluster(RunFlags(distributed=True))
    with pytest.raises(ConfigError, match="also needs --num-processes and --process-id"):
        detect_cluster(RunFlags(distributed=True, coordinator_address="127.0.0.1:1234"))
    with pytest.raises(ConfigError, match="--process-id=2 must be in 0..1"):
        detect_cluster(RunFlags(distributed=True, coordinator_address="h:1", num_processes=2, process_id=2))
    with pytest.raises(ConfigError, match="same --run-name"):
        resolve_run(RunFlags(env_id="CartPole-v1", distributed=True), 16, Cluster(2, 0, "h:1"))
    # Under SLURM every process names the run after the job (a requeued job keeps its id and resumes).
    assert resolve_run(RunFlags(env_id="CartPole-v1", distributed=True), 16,
                       Cluster(2, 1, "h:1", "77")).run_name.endswith("__1__slurm77")


def test_global_batch_arithmetic():
    s = resolve_run(RunFlags(env_id="CartPole-v1", local_num_envs=8, num_actor_threads=2, learner_device_ids=[1, 2],
                             total_timesteps=100_000, run_name="x"), 16, Cluster(3, 1, "h:1"))
    assert (s.num_envs_total, s.batch_size, s.envs_per_learner) == (3 * 2 * 8, 3 * 2 * 8 * 16, 8)
    assert s.num_actor_threads_total == 2 and s.num_updates == 100_000 // (3 * 2 * 8 * 16)
    with pytest.raises(ConfigError, match=r"smaller than one batch \(768"):
        resolve_run(RunFlags(env_id="CartPole-v1", local_num_envs=8, num_actor_threads=2, total_timesteps=500,
                             run_name="x"), 16, Cluster(3, 1, "h:1"))


@pytest.mark.slow
def test_a_stop_signal_on_one_process_stops_every_process_at_the_same_update():
    port = free_port()
    procs = [start([*FLAGS, "--total-timesteps", "100000", "--run-name", "signalled", "--log-frequency", "1",
                    "--coordinator-address", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)], {})
             for i in range(2)]
    for line in procs[0].stdout:
        if line.startswith("step ") and "update 3/" in line:
            break
    procs[1].send_signal(signal.SIGTERM)
    outputs = finish(procs, timeout=120)
    assert [code for code, _ in outputs] == [143, 143], outputs[0][1][-2000:] + outputs[1][1][-2000:]
    assert "SIGTERM on another process: checkpointing and stopping" in outputs[0][1]
    summary = json.loads(Path("runs/signalled/summary.json").read_text())
    assert summary["interrupted_by"] == "SIGTERM"
    assert [p.name for p in Path("runs/signalled/checkpoints").iterdir()] == [str(summary["updates"])]
    assert lines("saved", 0) == lines("saved", 1)  # both took part in the same checkpoint


def test_coordinator_flags_without_distributed_are_refused():
    with pytest.raises(ConfigError, match="--num-processes, --process-id only apply with --distributed"):
        detect_cluster(RunFlags(num_processes=2, process_id=0))
