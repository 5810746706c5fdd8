"""End-to-end throughput of sebulba/impala_envpool.py next to sebulba/ppo_envpool.py on the
same layout, the same actors and the same batch per update.

    python benchmark/impala_vs_ppo.py                 # 3 runs per script and task (~10 min on 2 cores)
    python benchmark/impala_vs_ppo.py --reps 1 --breakout-reps 0

Each run is the real script in a fresh process and reports the end-to-end SPS of its
summary.json (env steps; Atari frames = 4x), compilation included. PPO keeps its default
update (4 epochs x 4 minibatches of each batch, as Cleanba); IMPALA takes one V-trace
gradient step per batch, so the difference is mostly learner work per env step.

* CartPole-v1, a0-l0, 1 actor thread x 32 envs, 16 steps, MLP 64-64, 200k env steps.
* Breakout-v5, a0-l1,2,3, 1 actor thread x 12 envs, 32 steps, IMPALA ResNet, 4 updates.

Writes the medians (min-max) as a table and the raw numbers to
benchmark/results/impala_vs_ppo.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from actor_efficiency import describe_machine, summarise
from deterministic_cost import run_sps

TASKS = {
    "CartPole-v1, a0-l0": [
        "--env-id", "CartPole-v1", "--total-timesteps", "200000", "--local-num-envs", "32", "--num-steps", "16",
        "--num-actor-threads", "1", "--hiddens", "64", "64"],
    "Breakout-v5, a0-l1,2,3": [
        "--env-id", "Breakout-v5", "--learner-device-ids", "1", "2", "3", "--num-actor-threads", "1",
        "--local-num-envs", "12", "--num-steps", "32", "--total-timesteps", str(12 * 32 * 4)],
}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3, help="CartPole runs per script (median reported)")
    parser.add_argument("--breakout-reps", type=int, default=3, help="Breakout runs per script (0 skips)")
    cli = parser.parse_args()
    results: dict[str, dict[str, list[float]]] = {}
    for task, flags in TASKS.items():
        reps = cli.breakout_reps if task.startswith("Breakout") else cli.reps
        if reps:
            runs: dict[str, list[float]] = {"ppo_envpool.py": [], "impala_envpool.py": []}
            for _ in range(reps):  # interleaved so drift in machine load hits both
                for script in runs:
                    runs[script].append(run_sps(flags, script))
            results[task] = runs
    out = Path(__file__).resolve().parent / "results" / "impala_vs_ppo.json"
    out.parent.mkdir(exist_ok=True)
    machine = describe_machine()
    out.write_text(json.dumps({"machine": machine, "tasks": TASKS, "results": results}, indent=2))
    print(f"\nmachine: {machine}\n")
    print("| task | PPO SPS | IMPALA SPS | IMPALA ÷ PPO |\n| --- | --- | --- | --- |")
    for task, runs in results.items():
        ppo, impala = runs["ppo_envpool.py"], runs["impala_envpool.py"]
        print(f"| {task} | {summarise(ppo)} | {summarise(impala)} | "
              f"{statistics.median(impala) / statistics.median(ppo):.2f} |")
    print(f"\nwritten: {out}")
