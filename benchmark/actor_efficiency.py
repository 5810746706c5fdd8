"""Actor-path efficiency and end-to-end throughput of sebulba/ppo_envpool.py.

    python benchmark/actor_efficiency.py     # CartPole 5 x 10 s, Breakout 3 runs per layout (~12 min on 2 cores)
    python benchmark/actor_efficiency.py --reps 3 --seconds 5 --breakout-reps 0

1. Raw EnvPool async SPS: CartPole-v1 pool, random actions, strict recv -> send.
2. Actor SPS: the script's real actor loop (`run_actor`: recv -> MLP policy on the actor
   device -> send -> per-env rollout assembly) on a pool with the same settings.
   Their ratio is the efficiency of the actor path (1.0 = the policy and bookkeeping cost
   nothing).
3. End-to-end SPS on Breakout-v5 (real run of `main`, a0-l0 and a0-l1,2,3, small sizes;
   env steps, frames = 4x), from the run's summary.json: includes compilation.

Reports the median and min-max of the repetitions, with the machine described, and writes
the raw numbers to benchmark/results/actor_efficiency.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 4)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sebulba.ppo_envpool import (Agent, Args, ParamsSlot, RolloutAssembler, Stopped, main,  # noqa: E402
                                 make_envs, make_policy_fn, run_actor)

POOL = dict(num_envs=16, batch_size=8)  # the CartPole preset's pool
ENV_THREADS = 2


def raw_envpool_sps(seconds: float) -> float:
    args = Args(env_id="CartPole-v1")
    envs = make_envs(args, POOL["num_envs"], POOL["batch_size"], seed=0, num_threads=ENV_THREADS)
    rng = np.random.default_rng(0)
    envs.async_reset()
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        _, _, _, _, info = envs.recv()
        envs.send(rng.integers(0, 2, len(info["env_id"])).astype(np.int32), info["env_id"])
        steps += len(info["env_id"])
    sps = steps / (time.perf_counter() - start)
    envs.close()
    return sps


def actor_sps(seconds: float) -> float:
    args = Args(env_id="CartPole-v1", hiddens=(64, 64), num_steps=64, max_policy_lag=10**9, stall_timeout_s=60)
    envs = make_envs(args, POOL["num_envs"], POOL["batch_size"], seed=0, num_threads=ENV_THREADS)
    agent = Agent(num_actions=2, channels=(), hiddens=args.hiddens, atari=False)
    device = jax.devices()[0]
    params = jax.device_put(agent.init(jax.random.PRNGKey(0), jnp.zeros((1, 4))), device)
    slot = ParamsSlot()
    slot.publish(0, {device: params})
    rollouts: queue.Queue = queue.Queue()
    stop = threading.Event()
    assembler = RolloutAssembler(POOL["num_envs"], args.num_steps, (4,), np.float32, False, False)
    policy = make_policy_fn(agent)
    # Warm up (compile) on a separate short run so the timing holds no compilation.
    run_actor(envs, policy, device, jax.random.PRNGKey(1), slot, rollouts, assembler, 1, args,
              POOL["batch_size"], stop, "bench")
    envs.close()
    envs = make_envs(args, POOL["num_envs"], POOL["batch_size"], seed=1, num_threads=ENV_THREADS)
    assembler = RolloutAssembler(POOL["num_envs"], args.num_steps, (4,), np.float32, False, False)
    timer = threading.Timer(seconds, stop.set)
    start = time.perf_counter()
    timer.start()
    try:
        run_actor(envs, policy, device, jax.random.PRNGKey(1), slot, rollouts, assembler, 10**9, args,
                  POOL["batch_size"], stop, "bench")
    except Stopped:  # the timer ends the measurement window
        pass
    elapsed = time.perf_counter() - start
    envs.close()
    rows = int((assembler.generation * args.num_steps + assembler.row).sum())  # one row per env per recv
    return rows / elapsed


def breakout_e2e_sps(learners: list[int]) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        cwd = os.getcwd()
        os.chdir(tmp)
        try:
            summary = main(Args(env_id="Breakout-v5", actor_device_ids=[0], learner_device_ids=learners,
                                num_actor_threads=1, local_num_envs=12, async_batch_size=6, num_steps=32,
                                num_minibatches=4, update_epochs=4, total_timesteps=12 * 32 * 3,
                                log_frequency=1000, run_name="bench"))
        finally:
            os.chdir(cwd)
    return summary["sps"]


def describe_machine() -> dict:
    cpu = "unknown"
    if Path("/proc/cpuinfo").exists():
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    import envpool
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "jax": jax.__version__,
            "envpool": envpool.__version__, "backend": jax.default_backend()}


def summarise(values: list[float]) -> str:
    return f"{statistics.median(values):,.0f} ({min(values):,.0f}–{max(values):,.0f})"


def run(reps: int, seconds: float, breakout_reps: int) -> dict:
    results: dict[str, list[float]] = {"raw_envpool_async_sps": [], "actor_sps": []}
    for _ in range(reps):
        results["raw_envpool_async_sps"].append(raw_envpool_sps(seconds))
        results["actor_sps"].append(actor_sps(seconds))
    results["actor_efficiency"] = [a / r for a, r in zip(results["actor_sps"], results["raw_envpool_async_sps"])]
    if breakout_reps:
        for name, learners in (("breakout_e2e_sps_a0-l0", [0]), ("breakout_e2e_sps_a0-l1,2,3", [1, 2, 3])):
            results[name] = [breakout_e2e_sps(learners) for _ in range(breakout_reps)]
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5, help="repetitions per measurement (median reported)")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each CartPole measurement window")
    parser.add_argument("--breakout-reps", type=int, default=3, help="Breakout end-to-end runs per layout (0 skips)")
    cli = parser.parse_args()
    machine = describe_machine()
    results = run(cli.reps, cli.seconds, cli.breakout_reps)
    out = Path(__file__).resolve().parent / "results" / "actor_efficiency.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"machine": machine, "pool": POOL, "env_threads": ENV_THREADS, "reps": cli.reps,
                               "breakout_reps": cli.breakout_reps,
                               "seconds": cli.seconds, "results": results}, indent=2))
    print(f"\nmachine: {machine}\n")
    print("| measure | median (min–max) |\n| --- | --- |")
    for name, values in results.items():
        if name == "actor_efficiency":
            print(f"| {name} | {statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f}) |")
        else:
            print(f"| {name} | {summarise(values)} |")
    print(f"\nwritten: {out}")
