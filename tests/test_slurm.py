"""Sebulba under a real Slurm: scripts/slurm/local_cluster.sh starts a controller and two slurmd
nodes (n1, n2) on this machine, and each test submits scripts/slurm/sebulba.sbatch with sbatch,
as a user does on a CPU cluster: `ACTOR_DEVICE_IDS=0 LEARNER_DEVICE_IDS="1 2" sbatch
--gpus-per-node=0 ...`. The job's two tasks (srun, one per node) join one jax.distributed run
whose learner mesh holds both nodes' learner devices. Slurm's own signals, requeues and job
states are real; the trainer is sebulba/ppo_envpool.py through tests/slurm_job.py, whose
fault-injection hook the failure tests switch on. Skipped where Slurm is not installed."""

import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sebulba.config import Cluster, first_host, slurm_coordinator

ROOT = Path(__file__).resolve().parents[1]
PROGRAMS = ("slurmctld", "slurmd", "munged", "sbatch", "srun", "scontrol", "sinfo")
# The jobs' `python` is this interpreter (a virtual environment need not be activated), then Slurm's daemons
SEARCH_PATH = f"{Path(sys.executable).parent}:{os.environ['PATH']}:/usr/sbin:/sbin"
MISSING = [p for p in PROGRAMS if shutil.which(p, path=SEARCH_PATH) is None]
UPDATES = 24
FLAGS = ["--env-id", "CartPole-v1", "--local-num-envs", "8", "--num-steps", "16", "--num-actor-threads", "1",
         "--hiddens", "16", "--update-epochs", "1", "--eval-episodes", "0", "--deterministic", "--checkpoint-interval",
         "4", "--log-frequency", "1", "--total-timesteps", str(2 * 8 * 16 * UPDATES)]  # 2 processes x 8 envs x 16 steps


def slurm(test):
    """A test that needs the local cluster: marked slurm and slow, skipped where Slurm is missing, and
    run on one pytest-xdist worker (the cluster is one per worker: two would share its ports)."""
    skip = pytest.mark.skipif(bool(MISSING), reason=f"needs Slurm (missing {', '.join(MISSING)}): apt-get install "
                                                    "slurmctld slurmd slurm-client munge")
    return pytest.mark.xdist_group("slurm")(pytest.mark.slurm(pytest.mark.slow(skip(test))))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, request):
    """The environment that points sbatch, srun and scontrol at a fresh two-node local cluster."""
    grouped = [item.nodeid for item in request.session.items if item.get_closest_marker("slurm")]
    if os.environ.get("PYTEST_XDIST_WORKER") and not all(nodeid.endswith("@slurm") for nodeid in grouped):
        pytest.fail("pytest-xdist did not keep the Slurm tests on one worker (two clusters would share ports): "
                    "pytest >= 9.2 with pytest-xdist 3.8 (pytest-dev/pytest-xdist#1386); install the dev extra's "
                    "pytest, or run tests/test_slurm.py with -n 0", pytrace=False)
    directory = tmp_path_factory.mktemp("slurm")
    env = {**os.environ, "PATH": SEARCH_PATH, "SLURM_CONF": str(directory / "slurm.conf"), "PYTHONPATH": str(ROOT),
           "SCRIPT": str(ROOT / "tests" / "slurm_job.py"), "ACTOR_DEVICE_IDS": "0", "LEARNER_DEVICE_IDS": "1 2"}
    for var in ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SEBULBA_TEST_FAULT", "JAX_COORDINATOR_ADDRESS"):
        env.pop(var, None)
    up = subprocess.run([str(ROOT / "scripts" / "slurm" / "local_cluster.sh"), "up", str(directory)],
                        env={**env, "CPUS": "4"},
                        capture_output=True, text=True, timeout=90)
    assert up.returncode == 0, up.stdout + up.stderr
    yield env
    subprocess.run([str(ROOT / "scripts" / "slurm" / "local_cluster.sh"), "down", str(directory)], env=env,
                   capture_output=True, timeout=60)


def submit(env, *args, fault=None, cwd=None) -> str:
    """sbatch the template from `cwd` (default: the current directory); returns the job id."""
    env = {**env, **({"SEBULBA_TEST_FAULT": fault} if fault else {})}
    out = subprocess.run(["sbatch", "--parsable", "--gpus-per-node=0", "--cpus-per-task=1", "--time=10",
                          str(ROOT / "scripts" / "slurm" / "sebulba.sbatch"), *args], env=env, capture_output=True,
                         text=True, timeout=30, check=True, cwd=cwd)
    return out.stdout.strip().split(";")[0]


def job(env, job_id) -> dict[str, str]:
    """`scontrol show job` as a dict (JobState, Restarts, ExitCode, ...)."""
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=env, capture_output=True, text=True, timeout=30)
    return dict(field.split("=", 1) for field in out.stdout.split() if "=" in field)


def log(job_id, cwd=".") -> str:
    path = Path(cwd, f"slurm-sebulba-{job_id}.out")
    return path.read_text() if path.exists() else ""


def wait_for(condition, timeout_s: float, what: str, job_id, env):
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job_id], env=env, timeout=30)
            raise AssertionError(f"{what} not within {timeout_s} s; job {job(env, job_id)}")
        time.sleep(0.5)


def ended(env, job_id, timeout_s=180) -> dict:
    wait_for(lambda: job(env, job_id).get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), timeout_s,
             "the end of the job", job_id, env)
    return job(env, job_id)


def summary(run_name, cwd=".") -> dict:
    return json.loads(Path(cwd, "runs", run_name, "summary.json").read_text())


@pytest.fixture(scope="module")
def jobs(cluster, tmp_path_factory):
    """Every job of this module, submitted at once so that they share the cluster (4 CPUs a
    node; the pre-emption test comes first, to signal its job while it runs): {name: (job id,
    its directory)}."""
    specs = {"uninterrupted": (FLAGS, None), "pre-empted": (FLAGS, None),
             "failing": ([*FLAGS[:-1], "100000"], "learner"),
             "unresolvable": ([*FLAGS, "--coordinator-address", "no-such-node.invalid:12345"], None),
             "closed-port": ([*FLAGS, "--coordinator-timeout-s", "15"], "closed-port")}
    submitted = {}
    for name, (flags, fault) in specs.items():
        directory = tmp_path_factory.mktemp(name)
        submitted[name] = submit(cluster, *flags, fault=fault, cwd=directory), directory
    yield submitted
    subprocess.run(["scancel", *(job_id for job_id, _ in submitted.values())], env=cluster, timeout=30)


def seconds(state: dict, field: str) -> float:
    return datetime.datetime.fromisoformat(state[field]).timestamp()


@slurm
def test_a_pre_empted_job_checkpoints_requeues_and_resumes_to_the_same_params(cluster, jobs):
    """USR1 to the batch shell alone (`scancel --signal=USR1 --batch`): every process stops and
    exits 138 (--deterministic: it resumes from its last periodic checkpoint), the template
    requeues the job. Then `scontrol requeue` while it runs again (SIGTERM, and Slurm requeues
    it). Each time the job keeps its id and run name and resumes; the final params equal the
    uninterrupted run's."""
    job_id, directory = jobs["pre-empted"]
    run_name, output = f"sebulba_{job_id}", lambda: log(job_id, directory)
    wait_for(lambda: "update 6/" in output(), 150, "update 6", job_id, cluster)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], env=cluster, check=True, timeout=30)
    wait_for(lambda: "| update 10/" in output().partition("resumed from")[2], 150, "training after the first resume",
             job_id, cluster)
    first = output()
    assert first.count("SIGUSR1: stopping (--deterministic: no new checkpoint)") == 2, first[-4000:]  # both tasks
    assert "n1: task 0: Exited with exit code 138" in first and "n2: task 1: Exited with exit code 138" in first
    assert f"stopped before the time limit; requeueing job {job_id}" in first
    assert f"job {job_id} restart 1 on n[1-2]: run {run_name}" in first
    subprocess.run(["scontrol", "requeue", job_id], env=cluster, check=True, timeout=30)
    state = ended(cluster, job_id)
    final = output()
    assert state["JobState"] == "COMPLETED" and state["Restarts"] == "2", final[-4000:]
    assert f"job {job_id} restart 2 on n[1-2]: run {run_name}" in final
    assert final.count("SIGTERM: stopping") == 2 and final.count("0: resumed from") == 2, final[-4000:]
    assert summary(run_name, directory)["updates"] == UPDATES
    reference_id, reference_directory = jobs["uninterrupted"]
    ended(cluster, reference_id)
    reference = summary(f"sebulba_{reference_id}", reference_directory)
    assert summary(run_name, directory)["params_sha256"] == reference["params_sha256"]


@slurm
def test_a_two_node_job_trains_one_learner_mesh_and_completes(cluster, jobs):
    job_id, directory = jobs["uninterrupted"]
    state = ended(cluster, job_id)
    output = log(job_id, directory)
    assert state["JobState"] == "COMPLETED" and state["ExitCode"] == "0:0", output[-4000:]
    config = json.loads((directory / "runs" / f"sebulba_{job_id}" / "config.json").read_text())
    assert (config["derived"]["num_processes"], config["derived"]["process_id"]) == (2, 0)
    assert config["derived"]["run_name"] == f"sebulba_{job_id}"
    port = int(job_id) % 4096 + 61440  # JAX's port for a SLURM job
    for task in (0, 1):  # every process got its index and the coordinator from SLURM's environment
        assert f"{task}: process {task} of 2: joining the coordinator at 127.0.0.1:{port} (NodeAddr of n1, the first " \
               "node of SLURM_STEP_NODELIST=n[1-2])" in output, output[-4000:]
    assert "0: run sebulba_" in output and "2 process(es) x 1 actor device(s)" in output
    assert "4 learner device(s) x 4 envs" in output  # one mesh: both nodes' devices 1 and 2
    assert summary(f"sebulba_{job_id}", directory)["updates"] == UPDATES
    completions = (Path(cluster["SLURM_CONF"]).parent / "log" / "jobcomp.txt").read_text()
    assert re.search(rf"JobId={job_id} .*JobState=COMPLETED", completions)


@slurm
def test_a_task_that_fails_ends_the_job_as_failed_with_its_traceback(cluster, jobs):
    job_id, directory = jobs["failing"]
    state = ended(cluster, job_id)
    output = log(job_id, directory)
    assert state["JobState"] == "FAILED", output[-4000:]
    assert "1: Traceback (most recent call last):" in output and "1: RuntimeError: injected learner fault" in output
    failed_at = float(re.search(r"injected learner fault in process 1 at ([\d.]+)", output).group(1))
    assert seconds(state, "EndTime") - failed_at < 60  # every task ended, none waited for the time limit
    assert "n2: task 1: Exited with exit code 1" in output, output[-4000:]
    assert re.search(r"n1: task 0: (Exited with exit code [1-9]|Aborted)", output), output[-4000:]


@slurm
def test_a_coordinator_that_cannot_be_reached_ends_every_task_within_a_minute(cluster, jobs):
    (unresolvable, unresolvable_dir), (closed, closed_dir) = jobs["unresolvable"], jobs["closed-port"]
    for job_id in (unresolvable, closed):
        state = ended(cluster, job_id)
        assert state["JobState"] == "FAILED" and seconds(state, "EndTime") - seconds(state, "StartTime") < 60
    output = log(unresolvable, unresolvable_dir)
    for task in (0, 1):
        assert (f"{task}: error: process {task} of 2: the coordinator host no-such-node.invalid (--coordinator-address) "
                "does not resolve on") in output, output[-3000:]
    output = log(closed, closed_dir)
    port = int(closed) % 4096 + 61440
    assert (f"1: error: process 1 of 2: could not reach the coordinator at 127.0.0.1:{port} (NodeAddr of n1, the "
            "first node of SLURM_STEP_NODELIST=n[1-2]) within 15 s") in output, output[-3000:]
    assert f"0: error: process 0 of 2: not every process reached the coordinator it runs at 127.0.0.1:{port}" in output
    assert "Traceback" not in output and "DEADLINE_EXCEEDED" not in output


def test_the_coordinator_of_a_slurm_step(monkeypatch):
    """JAX's rule (first node of the step, port from the job id), with the node's NodeAddr where
    its name does not resolve; --coordinator-address overrides it; a shell without a step runs alone."""
    assert [first_host(n) for n in ("n[1-2],m3", "node[007,009-011]", "a,b", "solo", "gpu-a[10-12]")] == \
        ["n1", "node007", "a", "solo", "gpu-a10"]
    env = {"SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "localhost,n2"}
    assert slurm_coordinator(env) == (f"localhost:{4242 % 4096 + 61440}",
                                      "the first node of SLURM_STEP_NODELIST=localhost,n2")
    assert slurm_coordinator({**env, "JAX_COORDINATOR_PORT": "5000"})[0] == "localhost:5000"
    monkeypatch.setenv("PATH", "/nonexistent")  # no scontrol: an unresolvable name stays as it is, to be refused
    assert slurm_coordinator({**env, "SLURM_STEP_NODELIST": "no-such-node[1-2]"})[0].startswith("no-such-node1:")
    from sebulba.config import RunFlags, detect_cluster

    for var, value in {**env, "SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "0"}.items():
        monkeypatch.setenv(var, value)
    monkeypatch.delenv("JAX_COORDINATOR_ADDRESS", raising=False)
    assert detect_cluster(RunFlags(distributed=True)) == Cluster(2, 1, f"localhost:{4242 % 4096 + 61440}", "4242",
                                                                 "the first node of SLURM_STEP_NODELIST=localhost,n2")
    given = detect_cluster(RunFlags(distributed=True, coordinator_address="h0:99", coordinator_timeout_s=5))
    assert given == Cluster(2, 1, "h0:99", "4242", "--coordinator-address", 5)
