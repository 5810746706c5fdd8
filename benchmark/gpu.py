"""The GPU check: both scripts on one GPU, actor and learner sharing it.

    pip install -e '.[cuda,bench]' && python benchmark/gpu.py    # about 6 min on one GPU with 16 cores
    python benchmark/gpu.py --quick                               # 4 updates a run, one run each (~2 min)

Runs `--actor-device-ids 0 --learner-device-ids 0` on Breakout-v5 at the scripts' default
Atari sizes (PPO: 2 actor threads x 60 envs x 128 steps per update, 8 updates; IMPALA:
2 x 60 x 20, 60 updates) and on CartPole-v1 (one thread x 48 envs x 32 steps, MLP 64-64, 60
updates), PPO and IMPALA, each run in a fresh process with the compilation cache off. Repeats
(2 for Breakout, 3 for CartPole) start only in the first 330 s, so the check ends within
about 8 minutes. Recorded per run: time to the first update (launch to the first console
line: imports, env pools and compilation included), steady env steps/s (between the console
lines after the first update and the last), the actor side's and the learner's rates
(`charts/actor_sps`, `charts/learner_sps`, mean over the updates after the first), and the
GPU memory peak: the most `nvidia-smi` reported in use on GPU 0 while the run lasted, with
JAX's preallocation off (XLA_PYTHON_CLIENT_PREALLOCATE=false), so it is what the run needed
rather than the 75 % JAX reserves by default. Writes benchmark/results/gpu.json (or under
--out) and, in full mode, regenerates RESULTS.md, whose GPU section names the GPU.

Reference: Cleanba's PPO reaches about 6.1k env steps/s on Breakout with 1 A100 and 10 CPU
cores (derived from its published runtimes).

On a machine without an NVIDIA GPU, or where JAX cannot see it (the `cuda` extra missing), it
refuses in one line, exit code 2, before running anything.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time

from common import (PPO_CARTPOLE_THROUGHPUT, RESULTS, ROOT, PeriodicSampler, cli_parser, flag_value, impala_flags,
                    run_script, save, spread, steady_rates)

ON_GPU0 = ["--actor-device-ids", "0", "--learner-device-ids", "0"]
# name: (script, flags without the budget, env steps per update, updates, repeats)
RUNS = {
    "Breakout-v5/PPO": ("ppo_envpool.py", ["--env-id", "Breakout-v5"], 2 * 60 * 128, 8, 2),
    "Breakout-v5/IMPALA": ("impala_envpool.py", ["--env-id", "Breakout-v5"], 2 * 60 * 20, 60, 2),
    "CartPole-v1/PPO": ("ppo_envpool.py", PPO_CARTPOLE_THROUGHPUT, 48 * 32, 60, 3),
    "CartPole-v1/IMPALA": ("impala_envpool.py", impala_flags(PPO_CARTPOLE_THROUGHPUT), 48 * 32, 60, 3),
}
RATES = ("charts/actor_sps", "charts/learner_sps")
REPEATS_UNTIL_S = 330  # a repeat starts only before this many seconds, so the check ends within about 8 minutes


class GpuMemorySampler(PeriodicSampler):
    """The most memory (MiB) `nvidia-smi` reports in use on GPU 0, polled every `period` s while the block runs."""

    def __init__(self, period: float = 0.5):
        super().__init__(period)
        self.peak_mib = 0

    def sample(self):
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, check=False).stdout.strip()
        if out.isdigit():
            self.peak_mib = max(self.peak_mib, int(out))


def refusal() -> str | None:
    """Why this machine cannot run the check (one line), or None when JAX sees a GPU."""
    if not shutil.which("nvidia-smi"):
        return "benchmark/gpu.py needs an NVIDIA GPU: nvidia-smi is not on this machine (run it where a GPU is lent)"
    probe = subprocess.run([sys.executable, "-c", "import jax; print(len(jax.devices('gpu')))"], capture_output=True,
                           text=True, check=False)
    if probe.returncode or not probe.stdout.strip().isdigit() or int(probe.stdout) == 0:
        return "benchmark/gpu.py: JAX sees no GPU here; install the cuda extra: pip install -e '.[cuda,bench]'"
    return None


def measure(name: str, script: str, flags: list[str], batch: int, updates: int) -> dict:
    flags = [*flags, *ON_GPU0, "--total-timesteps", str(batch * updates)]
    if "--local-num-envs" in flags:
        assert int(flag_value(flags, "--local-num-envs")) * int(flag_value(flags, "--num-steps")) == batch
    with GpuMemorySampler() as gpu:
        r = run_script(script, flags, env={"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}, scalars=RATES)
    sps, _ = steady_rates(r["lines"])
    first_step = r["lines"][0][1]
    rates = {tag.split("/")[1]: [v for step, v in r["scalars"][tag] if step > first_step] for tag in RATES}
    out = {"time_to_first_update_s": r["lines"][0][0], "sps": sps, "gpu_memory_peak_mib": gpu.peak_mib,
           "actor_sps": sum(rates["actor_sps"]) / len(rates["actor_sps"]),
           "learner_sps": sum(rates["learner_sps"]) / len(rates["learner_sps"]), "wall_s": r["wall_s"],
           "cpu_per_core": r["cpu_per_core"]}
    print(f"{name}: first update at {out['time_to_first_update_s']:.1f} s, {sps:,.0f} env steps/s (actor "
          f"{out['actor_sps']:,.0f}, learner {out['learner_sps']:,.0f}), GPU memory peak {gpu.peak_mib:,} MiB",
          flush=True)
    return {"flags": flags, **out}


def run(quick: bool) -> dict:
    results, start = {}, time.perf_counter()
    for name, (script, flags, batch, updates, repeats) in RUNS.items():
        runs = [measure(name, script, flags, batch, 4 if quick else updates)]
        while len(runs) < (1 if quick else repeats) and time.perf_counter() - start < REPEATS_UNTIL_S:
            runs.append(measure(name, script, flags, batch, updates))
        results[name] = {"script": script, "flags": runs[0]["flags"], "runs": runs,
                         **{k: spread([r[k] for r in runs]) for k in ("time_to_first_update_s", "sps", "actor_sps",
                                                                       "learner_sps", "gpu_memory_peak_mib")}}
    return results


if __name__ == "__main__":
    parser = cli_parser(__doc__, "gpu", "4 updates a run, one repeat (about 2 min)")
    cli = parser.parse_args()
    reason = refusal()
    if reason:
        print(reason, file=sys.stderr)
        sys.exit(2)
    path = save("gpu", {"quick": cli.quick, "results": run(cli.quick)}, cli.out)
    print("written:", path)
    if cli.out == RESULTS and not cli.quick:
        from report import report  # matplotlib: only once there is something to plot
        print("written:", report(RESULTS, ROOT / "benchmark" / "RESULTS.md", ROOT / "docs" / "img"))
