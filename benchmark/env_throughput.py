"""Environment throughput: the physical limit of the actor side on this machine.

    python benchmark/env_throughput.py            # full sweep, 3 repetitions of 2 s windows (~6 min on 2 cores)
    python benchmark/env_throughput.py --quick    # one env count and thread count per task, 1 repetition (~15 s)

Random actions, no policy, no learning. For CartPole-v1 and Breakout-v5 (the training
protocol's settings: Cleanba's for Atari, so SPS are env steps; frames = 4x), env
steps per second and the machine's per-core CPU utilisation (%) of:

* `envpool_sync`: EnvPool `step()` on the whole pool (batch = envs);
* `envpool_async_b{B}`: EnvPool `send`/`recv` with `recv` batch B (B = envs / 4, envs / 2);
* `gymnasium_async`: gymnasium's subprocess vector env (one process per env);
* `gymnasium_sync`: gymnasium's synchronous vector env (every env in this process, in turn);

over a sweep of env counts and EnvPool worker threads (gymnasium has no thread setting).
Breakout under gymnasium is ALE (`ale-py`) with gymnasium's AtariPreprocessing (frame skip 4,
84x84 grey) and a 4-frame stack: the same game and sticky actions (p = 0.25) as EnvPool's.
Writes benchmark/results/env_throughput.json (or under --out).
"""

from __future__ import annotations

import time
import warnings
from functools import partial
from pathlib import Path

import gymnasium as gym
import numpy as np

from common import CpuSampler, cli_parser, save, spread

warnings.filterwarnings("ignore", module="gymnasium")

TASKS = {"CartPole-v1": {"envs": [8, 32, 128], "quick": [32]}, "Breakout-v5": {"envs": [8, 16, 32], "quick": [8]}}
GYMNASIUM_MAX_ENVS = 32  # one process per env: beyond this a 2-core machine only measures process switching


def envpool_pool(env_id: str, num_envs: int, batch_size: int, num_threads: int):
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from sebulba.envs import make_envs  # the training protocol's settings
    return make_envs(env_id, num_envs, batch_size, seed=0, num_threads=num_threads)


def gymnasium_env(env_id: str):
    if env_id == "Breakout-v5":
        import ale_py
        gym.register_envs(ale_py)
        env = gym.make("ALE/Breakout-v5", frameskip=1, repeat_action_probability=0.25, full_action_space=True,
                       max_num_frames_per_episode=108_000)
        env = gym.wrappers.AtariPreprocessing(env, frame_skip=4, screen_size=84, grayscale_obs=True, noop_max=0)
        return gym.wrappers.FrameStackObservation(env, 4)
    return gym.make(env_id)


def measure(step_fn, seconds: float) -> dict:
    """Call step_fn (returns env steps taken) for `seconds`; SPS and per-core utilisation."""
    for _ in range(3):
        step_fn()  # warm-up
    with CpuSampler(period=min(0.5, seconds / 4)) as cpu:
        steps, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            steps += step_fn()
        elapsed = time.perf_counter() - start
    return {"sps": steps / elapsed, "cpu_per_core": cpu.per_core_mean()}


def envpool_sync(env_id, num_envs, num_threads, seconds, rng):
    env = envpool_pool(env_id, num_envs, num_envs, num_threads)
    n = env.action_space.n
    env.reset()

    def step():
        env.step(rng.integers(0, n, num_envs).astype(np.int32))
        return num_envs
    try:
        return measure(step, seconds)
    finally:
        env.close()


def envpool_async(env_id, num_envs, batch_size, num_threads, seconds, rng):
    env = envpool_pool(env_id, num_envs, batch_size, num_threads)
    n = env.action_space.n
    env.async_reset()

    def step():
        info = env.recv()[-1]
        env.send(rng.integers(0, n, batch_size).astype(np.int32), info["env_id"])
        return batch_size
    try:
        return measure(step, seconds)
    finally:
        env.close()


def gymnasium_vector(env_id, num_envs, asynchronous, seconds, rng):
    fns = [partial(gymnasium_env, env_id)] * num_envs
    env = gym.vector.AsyncVectorEnv(fns) if asynchronous else gym.vector.SyncVectorEnv(fns)
    n = env.single_action_space.n
    env.reset(seed=0)

    def step():
        env.step(rng.integers(0, n, num_envs))
        return num_envs
    try:
        return measure(step, seconds)
    finally:
        env.close()


def run(quick: bool, reps: int, seconds: float, threads: list[int]) -> list[dict]:
    rows = []
    rng = np.random.default_rng(0)
    for env_id, sizes in TASKS.items():
        for num_envs in sizes["quick" if quick else "envs"]:
            configs = []
            for t in threads:
                configs.append(("envpool_sync", t, partial(envpool_sync, env_id, num_envs, t, seconds, rng)))
                for b in (num_envs // 4, num_envs // 2):
                    configs.append((f"envpool_async_b{b}", t,
                                    partial(envpool_async, env_id, num_envs, b, t, seconds, rng)))
            if num_envs <= GYMNASIUM_MAX_ENVS:
                configs.append(("gymnasium_async", None, partial(gymnasium_vector, env_id, num_envs, True, seconds, rng)))
                configs.append(("gymnasium_sync", None, partial(gymnasium_vector, env_id, num_envs, False, seconds, rng)))
            for mode, t, fn in configs:
                runs = [fn() for _ in range(reps)]
                row = {"env_id": env_id, "num_envs": num_envs, "mode": mode, "threads": t,
                       "sps": spread([r["sps"] for r in runs]), "sps_runs": [r["sps"] for r in runs],
                       "cpu_per_core": [float(np.median(c)) for c in zip(*(r["cpu_per_core"] for r in runs))]}
                rows.append(row)
                print(f"{env_id:12s} envs {num_envs:4d} {mode:20s} threads {t or '-'!s:>2}: "
                      f"{row['sps']['median']:10,.0f} env steps/s, cores % {[round(c) for c in row['cpu_per_core']]}",
                      flush=True)
    return rows


if __name__ == "__main__":
    import os
    parser = cli_parser(__doc__, "env_throughput", "one env count per task, threads = cores, 1 repetition of 0.5 s")
    parser.add_argument("--reps", type=int, default=3, help="repetitions per configuration (median reported)")
    parser.add_argument("--seconds", type=float, default=2.0, help="measurement window per repetition")
    cli = parser.parse_args()
    cores = os.cpu_count() or 1
    threads = [cores] if cli.quick else sorted({1, cores})
    reps, seconds = (1, 0.5) if cli.quick else (cli.reps, cli.seconds)
    rows = run(cli.quick, reps, seconds, threads)
    print("written:", save("env_throughput", {"quick": cli.quick, "reps": reps, "seconds": seconds, "rows": rows},
                           cli.out))
