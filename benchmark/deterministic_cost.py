"""Throughput cost of `--deterministic` in sebulba/ppo_envpool.py.

    python benchmark/deterministic_cost.py            # 3 runs per mode and task (~15 min on 2 cores)
    python benchmark/deterministic_cost.py --reps 1 --breakout-reps 0

Each run is the real script in a fresh process (`python sebulba/ppo_envpool.py ...`) and
reports the end-to-end SPS of its summary.json (env steps; Atari frames = 4x), compilation
included, in three modes on the same flags: the default (async, recv batch = half the
pool), async with recv batch = the whole pool (what --deterministic uses, so the pure cost
of exact policy versions and env-id order shows separately), and --deterministic:

* CartPole-v1, the README preset (100k env steps, 8 envs, a0-l0).
* Breakout-v5, a0-l1,2,3, 1 actor thread x 12 envs, 32 steps, 4 minibatches x 4 epochs,
  4 updates.

Writes the medians (min-max) as a table and the raw numbers to
benchmark/results/deterministic_cost.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from actor_efficiency import describe_machine, summarise

ROOT = Path(__file__).resolve().parents[1]
TASKS = {
    "CartPole-v1 (README preset), a0-l0": [
        "--env-id", "CartPole-v1", "--total-timesteps", "100000", "--local-num-envs", "8", "--num-steps", "32",
        "--num-actor-threads", "1", "--hiddens", "64", "64", "--num-minibatches", "1", "--update-epochs", "20",
        "--learning-rate", "1e-3", "--gamma", "0.98", "--gae-lambda", "0.8", "--clip-coef", "0.2",
        "--ent-coef", "0.0"],
    "Breakout-v5, a0-l1,2,3": [
        "--env-id", "Breakout-v5", "--learner-device-ids", "1", "2", "3", "--num-actor-threads", "1",
        "--local-num-envs", "12", "--num-steps", "32", "--num-minibatches", "4", "--update-epochs", "4",
        "--total-timesteps", str(12 * 32 * 4)],
}


def run_sps(flags: list[str], script: str = "ppo_envpool.py") -> float:
    """End-to-end SPS of one run of sebulba/<script> in a fresh process and directory."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, str(ROOT / "sebulba" / script), *flags, "--run-name", "bench",
                        "--log-frequency", "1000"], cwd=tmp, check=True, capture_output=True)
        return json.loads((Path(tmp) / "runs" / "bench" / "summary.json").read_text())["sps"]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3, help="CartPole runs per mode (median reported)")
    parser.add_argument("--breakout-reps", type=int, default=3, help="Breakout runs per mode (0 skips)")
    cli = parser.parse_args()
    results: dict[str, dict[str, list[float]]] = {}
    for task, flags in TASKS.items():
        reps = cli.breakout_reps if task.startswith("Breakout") else cli.reps
        if reps:
            pool = flags[flags.index("--local-num-envs") + 1]
            modes = {"async": flags, "async, recv batch = pool": [*flags, "--async-batch-size", pool],
                     "deterministic": [*flags, "--deterministic"]}
            runs: dict[str, list[float]] = {mode: [] for mode in modes}
            for _ in range(reps):  # interleave the modes so drift in machine load hits each
                for mode, mode_flags in modes.items():
                    runs[mode].append(run_sps(mode_flags))
            results[task] = runs
    out = Path(__file__).resolve().parent / "results" / "deterministic_cost.json"
    out.parent.mkdir(exist_ok=True)
    machine = describe_machine()
    out.write_text(json.dumps({"machine": machine, "tasks": TASKS, "results": results}, indent=2))
    print(f"\nmachine: {machine}\n")
    print("| task | mode | SPS | ÷ async |\n| --- | --- | --- | --- |")
    for task, runs in results.items():
        for mode, values in runs.items():
            ratio = statistics.median(values) / statistics.median(runs["async"])
            print(f"| {task} | {mode} | {summarise(values)} | {ratio:.2f} |")
    print(f"\nwritten: {out}")
