"""The GPU check: raw EnvPool, then every script end to end, each for a fixed window after compilation.

    pip install -e '.[cuda,bench]' && python benchmark/gpu.py    # under 10 minutes on one GPU with 16 cores
    python benchmark/gpu.py --dry-run                             # the same pipeline on this CPU, tiny sizes (CI)

In order:

1. `Breakout-v5/EnvPool`: raw EnvPool throughput, the actor side's ceiling on this machine:
   `send`/`recv` with random actions and no policy, 4 envs per core, `recv` batch half the pool,
   one worker thread per core, over a 10 s window (Cleanba's protocol; env steps, frames = 4x).
2. PPO and IMPALA on Breakout-v5 at the scripts' default Atari sizes (PPO: 2 actor threads x 60
   envs x 128 steps an update; IMPALA: 2 x 60 x 20), actor and learner sharing GPU 0 (`a0-l0`);
   with 2 GPUs or more also the actor on GPU 0 and the learner on GPU 1 (`a0-l1`), with 4 or
   more on GPUs 1, 2 and 3 (`a0-l1,2,3`).
3. PQN on Breakout-v5 at its defaults (CleanRL's pqn_atari_envpool.py: 8 envs x 128 steps) and
   SAC on HalfCheetah-v4 at its defaults (CleanRL's hyperparameters, 8 envs x 16 steps), a0-l0.

Each run is a fresh process with the compilation cache off. It trains until WINDOW_S seconds
(and at least 3 updates) have passed since its first update, then gets SIGTERM (it checkpoints
and exits 143). Recorded per run: time to the first update (launch to the first console line:
imports, env pools and compilation), steady env steps/s (between the console lines after the
first update and the last), the actor side's and the learner's rates (`charts/actor_sps`,
`charts/learner_sps`, mean over the updates after the first), the GPU memory peak (the most
`nvidia-smi` reported in use on the GPUs while the run lasted, with JAX's preallocation off, so
it is what the run needed rather than the 75 % JAX reserves by default) and the cores' mean
utilisation. A second run of each starts only in the first REPEATS_UNTIL_S seconds, and no run
starts after STARTS_UNTIL_S, so the check ends within 10 minutes; results are the median
(min-max) over the runs made. Writes benchmark/results/gpu.json (or under --out) and
regenerates RESULTS.md, whose GPU section names the GPU, in the same go.

Reference: Cleanba's PPO reaches about 6.1k env steps/s on Breakout with 1 A100 and 10 CPU
cores (derived from its published runtimes).

On a machine without an NVIDIA GPU, or where JAX cannot see it (the `cuda` extra missing), it
refuses in one line, exit code 2, before running anything. `--dry-run` runs the same pipeline on
the CPU instead: raw EnvPool for a second, then PPO at tiny sizes (4 envs, 8 steps, a small
network) on the split layout `a0-l1`, two of XLA's virtual CPU devices standing in for two GPUs,
stopped after 3 updates (the fewest a steady rate needs), and writes gpu.json and RESULTS.md under
--out (default: a temporary directory): it checks that the check works, not how fast anything is.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from common import (RESULTS, ROOT, CpuSampler, PeriodicSampler, cli_parser, random_stepper, run_script, save, spread,
                    steady_rates)

WINDOW_S = 30  # seconds of steady training measured per run
REPEATS_UNTIL_S = 300  # a second run of each starts only before this many seconds
STARTS_UNTIL_S = 450  # no run starts after this: the last one (about 90 s) ends within 10 minutes
ENV_WINDOW_S = 10
BREAKOUT = ["--env-id", "Breakout-v5"]
# name: (script, flags without the layout, the fewest GPUs it needs, its flags under --dry-run). Every run goes
# through the same `measure`; the dry run makes one, the split layout (each script's own tiny real runs are in the
# test suite), so that CI checks the pipeline in about half a minute.
ATARI_DRY = ["--local-num-envs", "4", "--num-steps", "8", "--num-actor-threads", "1", "--hiddens", "32"]
RUNS = {
    "Breakout-v5/PPO/a0-l0": ("ppo_envpool.py", BREAKOUT, 1, None),  # (dry: the split layout below runs PPO)
    "Breakout-v5/IMPALA/a0-l0": ("impala_envpool.py", BREAKOUT, 1, None),
    "Breakout-v5/PQN/a0-l0": ("pqn_envpool.py", BREAKOUT, 1, None),
    "HalfCheetah-v4/SAC/a0-l0": ("sac_envpool.py", ["--env-id", "HalfCheetah-v4", "--no-save-buffer"], 1, None),
    "Breakout-v5/PPO/a0-l1": ("ppo_envpool.py", BREAKOUT, 2, [*ATARI_DRY, "--channels", "4", "8", "--num-minibatches",
                                                             "2", "--update-epochs", "1"]),
    "Breakout-v5/IMPALA/a0-l1": ("impala_envpool.py", BREAKOUT, 2, None),
    "Breakout-v5/PPO/a0-l1,2,3": ("ppo_envpool.py", BREAKOUT, 4, None),
    "Breakout-v5/IMPALA/a0-l1,2,3": ("impala_envpool.py", BREAKOUT, 4, None),
}
RATES = ("charts/actor_sps", "charts/learner_sps")


class GpuMemorySampler(PeriodicSampler):
    """The most memory (MiB) `nvidia-smi` reports in use over every GPU, polled every `period` s while the block
    runs; None without nvidia-smi (--dry-run)."""

    def __init__(self, period: float = 0.5):
        super().__init__(period)
        self.peak_mib = 0 if shutil.which("nvidia-smi") else None

    def sample(self):
        if self.peak_mib is None:
            return
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, check=False).stdout.split()
        if out and all(v.isdigit() for v in out):
            self.peak_mib = max(self.peak_mib, sum(map(int, out)))


def visible_gpus() -> int:
    """The GPUs JAX sees, asked in a child process (this one starts no JAX backend); 0 where it sees none."""
    probe = subprocess.run([sys.executable, "-c", "import jax; print(len(jax.devices('gpu')))"], capture_output=True,
                           text=True, check=False)
    return int(probe.stdout) if probe.returncode == 0 and probe.stdout.strip().isdigit() else 0


def refusal() -> str | None:
    """Why this machine cannot run the check (one line), or None when JAX sees a GPU."""
    if not shutil.which("nvidia-smi"):
        return ("benchmark/gpu.py needs an NVIDIA GPU: nvidia-smi is not on this machine (run it where a GPU is lent, "
                "or --dry-run to check the script on this CPU)")
    if visible_gpus() == 0:
        return "benchmark/gpu.py: JAX sees no GPU here; install the cuda extra: pip install -e '.[cuda,bench]'"
    return None


def layout_flags(name: str) -> list[str]:
    learners = name.rsplit("/a0-l", 1)[1].split(",")
    return ["--actor-device-ids", "0", "--learner-device-ids", *learners]


def measure_envpool(cores: int, seconds: float) -> dict:
    """Raw EnvPool Breakout-v5 under the training protocol: random actions through send/recv."""
    sys.path.insert(0, str(ROOT))
    from sebulba.envs import make_envs
    num_envs = 4 * cores
    envs = make_envs("Breakout-v5", num_envs, num_envs // 2, seed=0, num_threads=cores)
    envs.async_reset()
    step = random_stepper(envs)
    for _ in range(20):
        step()  # warm-up: every env past its reset
    with CpuSampler(period=0.5) as cpu:
        steps, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            steps += step()
        elapsed = time.perf_counter() - start
    envs.close()
    out = {"num_envs": num_envs, "batch_size": num_envs // 2, "num_threads": cores, "sps": steps / elapsed,
           "cpu_per_core": cpu.per_core_mean()}
    print(f"Breakout-v5/EnvPool: {out['sps']:,.0f} env steps/s ({num_envs} envs, recv batch {num_envs // 2}, "
          f"{cores} threads)", flush=True)
    return out


def measure(name: str, script: str, flags: list[str], dry_run: bool) -> dict:
    flags = [*flags, *layout_flags(name), "--total-timesteps", "1000000000"]
    env = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    if dry_run:
        # two virtual CPU devices for a0-l1, beside the XLA flags this process was given (the test suite's)
        env["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2".strip()
    with GpuMemorySampler() as gpu:
        r = run_script(script, flags, env=env, scalars=RATES, timeout=300,
                       window=(0, 2) if dry_run else (WINDOW_S, 3))
    sps, _ = steady_rates(r["lines"])
    first_step = r["lines"][0][1]
    rates = {tag.split("/")[1]: [v for step, v in r["scalars"][tag] if step > first_step] for tag in RATES}
    out = {"time_to_first_update_s": r["lines"][0][0], "sps": sps, "gpu_memory_peak_mib": gpu.peak_mib,
           "actor_sps": float(np.mean(rates["actor_sps"])), "learner_sps": float(np.mean(rates["learner_sps"])),
           "updates": len(r["lines"]), "wall_s": r["wall_s"], "cores_busy_mean": float(np.mean(r["cpu_per_core"]))
           if r["cpu_per_core"] else None}
    memory = f", GPU memory peak {gpu.peak_mib:,} MiB" if gpu.peak_mib is not None else ""
    print(f"{name}: first update at {out['time_to_first_update_s']:.1f} s, {sps:,.0f} env steps/s (actor "
          f"{out['actor_sps']:,.0f}, learner {out['learner_sps']:,.0f}){memory}", flush=True)
    return {"flags": flags, **out}


def run(dry_run: bool, cores: int, gpus: int) -> dict:
    """Every measurement this machine has the GPUs for, within the time limits: {name: result}."""
    start = time.perf_counter()
    envpool = [measure_envpool(cores, 1.0 if dry_run else ENV_WINDOW_S)]
    results = {"Breakout-v5/EnvPool": {"runs": envpool, "sps": spread([r["sps"] for r in envpool])}}
    todo = [(name, script, dry if dry_run else flags) for name, (script, flags, need, dry) in RUNS.items()
            if need <= gpus and (not dry_run or dry is not None)]
    made: dict[str, list[dict]] = {name: [] for name, _, _ in todo}
    for repeat in range(1 if dry_run else 2):
        for name, script, flags in todo:
            elapsed = time.perf_counter() - start
            if elapsed > STARTS_UNTIL_S or (repeat and elapsed > REPEATS_UNTIL_S):
                print(f"{name}: {'repeat ' * repeat}not started, {elapsed:.0f} s in (the check ends within 10 "
                      "minutes)", flush=True)
                continue
            made[name].append(measure(name, script, flags, dry_run))
    for name, script, _ in todo:
        runs = made[name]
        results[name] = {"script": script, "flags": runs[0]["flags"] if runs else None, "runs": runs,
                         **{k: spread([r[k] for r in runs]) for k in ("time_to_first_update_s", "sps", "actor_sps",
                                                                       "learner_sps", "gpu_memory_peak_mib")}}
    return results


if __name__ == "__main__":
    parser = cli_parser(__doc__, "gpu", None)
    parser.add_argument("--dry-run", action="store_true",
                        help="the same steps on this CPU at tiny sizes, writing under --out (default: a temporary "
                             "directory): checks the script, measures nothing worth keeping")
    cli = parser.parse_args()
    if cli.dry_run:
        gpus, cores = 2, 2  # two virtual CPU devices stand in for two GPUs
        if cli.out == RESULTS:
            cli.out = Path(tempfile.mkdtemp(prefix="sebulba-gpu-dry-run-"))
    else:
        if reason := refusal():
            print(reason, file=sys.stderr)
            sys.exit(2)
        gpus, cores = visible_gpus(), len(os.sched_getaffinity(0))
    path = save("gpu", {"dry_run": cli.dry_run, "gpus_used": gpus, "results": run(cli.dry_run, cores, gpus)}, cli.out)
    print("written:", path)
    from report import report  # matplotlib: only once there is something to plot
    results_md = (ROOT / "benchmark" / "RESULTS.md") if cli.out == RESULTS else cli.out / "RESULTS.md"
    print("written:", report(cli.out, results_md, ROOT / "docs" / "img" if cli.out == RESULTS else cli.out / "img"))
