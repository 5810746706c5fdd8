"""Each stage of the pipeline alone: actor efficiency and the work-conserving limit.

    python benchmark/stages.py            # CartPole-v1 and Breakout-v5, 3 repetitions (~5 min on 2 cores)
    python benchmark/stages.py --quick    # CartPole-v1, a0-l0, 1 repetition (~15 s)

For the task configurations of benchmark/e2e.py (common.TASKS), in this process, with
process CPU time (user + system, every thread: EnvPool workers, XLA's pool, Python):

* `env`: EnvPool async pool of the run's size and `recv` batch, random actions ->
  raw env steps/s and CPU-seconds per env step;
* `actor`: the script's real actor loop (`run_actor`: recv -> policy on actor device 0 ->
  send -> per-env rollout assembly) on the same pool, params fixed, no learner -> actor
  env steps/s; actor efficiency = actor SPS / raw env SPS (1.0: the policy and the
  bookkeeping cost nothing);
* `inference`: the jitted policy alone on recv-batch-sized observations (host -> device ->
  host as the actor does) -> CPU-seconds per env step;
* `policy latency` (CartPole-v1): median µs of one policy call alone, beside the learner's
  update loop on another device, and beside a NumPy load: what CPU contention does to it;
* `learning`: the compiled update alone on a batch of the run's shape, for each learner
  layout -> CPU-seconds per env step;
* for CartPole-v1, actor efficiency over a sweep of pool sizes, `recv` batches and EnvPool
  worker threads (POOLS).

The work-conserving limit of a layout is cores / (env + inference + learning CPU-seconds per
env step): the SPS of a machine whose every core does nothing but this work. benchmark/e2e.py
reports its measured SPS as a fraction of it. Atari: env steps; frames = 4x.
Writes benchmark/results/stages.json (or under --out).
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import sys
import threading
import time
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 4)

import numpy as np  # noqa: E402
import tyro  # noqa: E402

from common import TASKS, cli_parser, random_stepper, save, spread  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sebulba import ppo_envpool as ppo  # noqa: E402
from sebulba.devices import Placement, host  # noqa: E402
from sebulba.envs import is_atari, make_envs  # noqa: E402
from sebulba.networks import RunningMoments, make_policy_fn  # noqa: E402
from sebulba.rollouts import Rollout, RolloutAssembler  # noqa: E402
from sebulba.threads import ParamsSlot, Stopped  # noqa: E402


def task_args(flags: list[str], learners: list[int] = (0,)) -> tuple[ppo.Args, ppo.Setup]:
    args = tyro.cli(ppo.Args, args=[*flags, "--learner-device-ids", *map(str, learners)])
    return args, ppo.resolve(args)


def timed(fn, seconds: float, min_calls: int = 1) -> tuple[float, float, int]:
    """Call fn (returns env steps) for at least `seconds` and `min_calls` calls:
    (env steps/s, CPU-seconds per env step, calls)."""
    steps, calls = 0, 0
    cpu0, start = time.process_time(), time.perf_counter()
    while time.perf_counter() - start < seconds or calls < min_calls:
        steps += fn()
        calls += 1
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu0
    return steps / wall, cpu / steps, calls


def env_stage(args: ppo.Args, setup: ppo.Setup, seconds: float) -> tuple[float, float]:
    envs = make_envs(args.env_id, args.local_num_envs, setup.async_batch_size, seed=0, num_threads=setup.num_env_threads,
                     protocol=args.atari_protocol, episodic_life=args.episodic_life)
    envs.async_reset()
    step = random_stepper(envs)
    timed(step, 0.2)
    try:
        sps, cpu, _ = timed(step, seconds)
    finally:
        envs.close()
    return sps, cpu


def agent_and_params(args: ppo.Args):
    agent, spec = ppo.make_agent(args)
    return agent, ppo.init_params(agent, spec, jax.random.PRNGKey(0)), spec.observation_space


def actor_stage(args: ppo.Args, setup: ppo.Setup, seconds: float) -> float:
    agent, params, obs_space = agent_and_params(args)
    device = jax.devices()[0]
    slot = ParamsSlot()
    slot.publish(0, {device: jax.device_put((params, RunningMoments.create(())), device)})
    policy = make_policy_fn(agent)
    args = dataclasses.replace(args, max_policy_lag=10**9, stall_timeout_s=60)

    def actor(num_rollouts: int, stop: threading.Event, seed: int) -> RolloutAssembler:
        envs = make_envs(args.env_id, args.local_num_envs, setup.async_batch_size, seed=seed,
                         num_threads=setup.num_env_threads, protocol=args.atari_protocol,
                         episodic_life=args.episodic_life)
        assembler = RolloutAssembler(args.local_num_envs, args.num_steps, obs_space.shape, obs_space.dtype,
                                     is_atari(args.env_id), False)
        try:
            ppo.run_actor(envs, policy, device, jax.random.PRNGKey(seed), slot, queue.Queue(), assembler,
                          num_rollouts, args, setup.async_batch_size, stop, "bench")
        except Stopped:  # the timer ends the measurement window
            pass
        finally:
            envs.close()
        return assembler

    actor(1, threading.Event(), 0)  # compile outside the window
    stop = threading.Event()
    timer = threading.Timer(seconds, stop.set)
    start = time.perf_counter()
    timer.start()
    assembler = actor(10**9, stop, 1)
    elapsed = time.perf_counter() - start
    rows = int((assembler.generation * args.num_steps + assembler.row).sum())  # one row per env per recv
    return rows / elapsed


def policy_caller(args: ppo.Args, setup: ppo.Setup):
    """One policy call as the actor makes it (recv-batch observations in, outputs to the host,
    on actor device 0), compiled; returns the env steps it serves."""
    agent, params, obs_space = agent_and_params(args)
    device = jax.devices()[0]
    params = jax.device_put((params, RunningMoments.create(())), device)
    policy = make_policy_fn(agent)
    obs = np.zeros((setup.async_batch_size, *obs_space.shape), obs_space.dtype)
    key = jax.device_put(jax.random.PRNGKey(0), device)

    def call():
        nonlocal key
        action, _, logprob, value, key = policy(params, obs, key)
        np.asarray(action), np.asarray(logprob), np.asarray(value)
        return len(obs)
    call()
    return call


def inference_stage(args: ppo.Args, setup: ppo.Setup, seconds: float) -> float:
    call = policy_caller(args, setup)
    timed(call, 0.2)
    return timed(call, seconds)[1]


def learning_loop(flags: list[str], learners: list[int]):
    """(one update as the learner thread does it -> env steps, the run's Setup), compiled."""
    args, setup = task_args(flags, learners)
    agent, params, obs_space = agent_and_params(args)
    placement = Placement([jax.devices()[0]], [jax.devices()[i] for i in learners])
    state, _ = ppo.make_train_state(args, setup, params, placement)
    update = ppo.make_update_fn(args, agent, placement.mesh)
    t, n = args.num_steps + 1, args.local_num_envs
    rng = np.random.default_rng(0)
    rollout = Rollout(obs=rng.integers(0, 255, (t, n, *obs_space.shape)).astype(obs_space.dtype),
                      actions=rng.integers(0, agent.num_actions, (t, n)).astype(np.int32),
                      logprobs=np.full((t, n), -1.0, np.float32), values=rng.normal(size=(t, n)).astype(np.float32),
                      rewards=rng.normal(size=(t, n)).astype(np.float32), terminated=rng.random((t, n)) < 0.02,
                      truncated=np.zeros((t, n), bool), versions=np.zeros((t, n), np.int32),
                      discounted_returns=np.zeros((t, n), np.float32))
    rollouts = [rollout] * setup.num_actor_threads_total
    key = placement.replicate(np.asarray(jax.random.key_data(jax.random.PRNGKey(0))))

    def step():  # what the learner thread does per update: host -> learner mesh, update, metrics -> host
        nonlocal state, key
        batch = placement.to_learners(rollouts)
        key, update_key = jax.random.split(key)
        state, metrics = update(state, batch, update_key)
        jax.tree.map(host, metrics)
        return setup.batch_size
    step()  # compile
    return step, setup


def learning_stage(flags: list[str], learners: list[int], seconds: float) -> float:
    return timed(learning_loop(flags, learners)[0], seconds, min_calls=2)[1]


def policy_latency(flags: list[str], seconds: float) -> dict[str, float]:
    """Median wall-clock µs of one policy call (recv-batch observations, outputs to the host, on
    actor device 0) alone; beside the learner's update loop on device 1 in another thread (what
    the actor meets end to end on a0-l1); and beside a NumPy loop of 400x400 matrix products
    (BLAS on every core, GIL released): CPU load that is not XLA's."""
    call = policy_caller(*task_args(flags))

    def median_call_us() -> float:
        times, start = [], time.perf_counter()
        while time.perf_counter() - start < seconds:
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
        return float(np.median(times)) * 1e6

    def beside(load) -> float:
        stop = threading.Event()

        def loop():
            while not stop.is_set():
                load()
        thread = threading.Thread(target=loop, daemon=True)
        thread.start()
        time.sleep(0.5)
        try:
            return median_call_us()
        finally:
            stop.set()
            thread.join()

    median_call_us()  # warm up
    learner_step = learning_loop(flags, [1])[0]
    matrix = np.random.default_rng(0).random((400, 400), np.float32)
    return {"alone": median_call_us(), "beside_learner": beside(learner_step), "beside_numpy": beside(lambda: matrix @ matrix)}


# CartPole pools for the actor-efficiency sweep: (envs, recv batch, EnvPool worker threads).
POOLS = [(48, 48, 2), (256, 256, 2), (256, 256, 1), (512, 256, 1), (512, 256, 2)]


def efficiency_sweep(flags: list[str], reps: int, seconds: float) -> list[dict]:
    rows = []
    for envs, batch, threads in POOLS:
        args, setup = task_args([*flags, "--local-num-envs", str(envs), "--async-batch-size", str(batch),
                                 "--num-env-threads", str(threads)])
        raw = [env_stage(args, setup, seconds)[0] for _ in range(reps)]
        actor = [actor_stage(args, setup, seconds) for _ in range(reps)]
        rows.append({"envs": envs, "recv_batch": batch, "env_threads": threads, "raw_env_sps": spread(raw),
                     "actor_sps": spread(actor), "actor_efficiency": spread([a / r for a, r in zip(actor, raw)])})
        print(f"  pool {envs} / recv {batch} / {threads} threads: raw {rows[-1]['raw_env_sps']['median']:,.0f}, actor "
              f"{rows[-1]['actor_sps']['median']:,.0f} SPS, efficiency {rows[-1]['actor_efficiency']['median']:.2f}",
              flush=True)
    return rows


def run(quick: bool, reps: int, seconds: float, only: str | None = None) -> dict:
    results = {}
    cores = os.cpu_count() or 1
    for task, spec in TASKS.items():
        if (quick and not spec["quick"]) or only not in (None, task):
            continue
        args, setup = task_args(spec["flags"])
        runs = {"raw_env_sps": [], "env_cpu_s_per_step": [], "actor_sps": [], "inference_cpu_s_per_step": [],
                "policy_us_alone": [], "policy_us_beside_learner": [], "policy_us_beside_numpy": []}
        for _ in range(reps):
            sps, cpu = env_stage(args, setup, seconds)
            runs["raw_env_sps"].append(sps)
            runs["env_cpu_s_per_step"].append(cpu)
            runs["actor_sps"].append(actor_stage(args, setup, seconds))
            runs["inference_cpu_s_per_step"].append(inference_stage(args, setup, seconds))
            if task == "CartPole-v1":  # the cheap policy whose latency matters; Breakout's is compute
                for where, us in policy_latency(spec["flags"], seconds).items():
                    runs[f"policy_us_{where}"].append(us)
        runs["actor_efficiency"] = [a / r for a, r in zip(runs["actor_sps"], runs["raw_env_sps"])]
        learning = {}
        for layout, learners in ({"a0-l0": [0]} if quick else spec["layouts"]).items():
            learning[layout] = [learning_stage(spec["flags"], learners, seconds) for _ in range(reps)]
        limits = {layout: cores / (spread(runs["env_cpu_s_per_step"])["median"]
                                   + spread(runs["inference_cpu_s_per_step"])["median"] + spread(cpu)["median"])
                  for layout, cpu in learning.items()}
        results[task] = {"flags": spec["flags"], "recv_batch": setup.async_batch_size,
                         "env_threads": setup.num_env_threads, "runs": runs, "learning_cpu_s_per_step": learning,
                         "work_conserving_limit_sps": limits,
                         "summary": {k: spread(v) for k, v in runs.items()}}
        if task == "CartPole-v1" and not quick:
            results[task]["efficiency_sweep"] = efficiency_sweep(spec["flags"], reps, seconds)
        s = results[task]["summary"]
        print(f"{task}: raw env {s['raw_env_sps']['median']:,.0f} SPS, actor {s['actor_sps']['median']:,.0f} SPS, "
              f"efficiency {s['actor_efficiency']['median']:.2f}; CPU-us per env step: env "
              f"{s['env_cpu_s_per_step']['median'] * 1e6:.1f}, inference {s['inference_cpu_s_per_step']['median'] * 1e6:.1f}, "
              "learning " + ", ".join(f"{k} {spread(v)['median'] * 1e6:.1f}" for k, v in learning.items())
              + "; limit " + ", ".join(f"{k} {v:,.0f}" for k, v in limits.items()) + " SPS", flush=True)
        if s["policy_us_alone"]["median"] is not None:
            print(f"  policy call: {s['policy_us_alone']['median']:.0f} us alone, "
                  f"{s['policy_us_beside_learner']['median']:.0f} beside the learner, "
                  f"{s['policy_us_beside_numpy']['median']:.0f} beside NumPy", flush=True)
    return results


if __name__ == "__main__":
    parser = cli_parser(__doc__, "stages", "CartPole-v1, a0-l0, 1 repetition of 0.5 s windows")
    parser.add_argument("--reps", type=int, default=3, help="repetitions per measurement (median reported)")
    parser.add_argument("--seconds", type=float, default=3.0, help="measurement window per repetition")
    parser.add_argument("--task", choices=list(TASKS), help="only this task, merged into the existing stages.json")
    cli = parser.parse_args()
    reps, seconds = (1, 0.5) if cli.quick else (cli.reps, cli.seconds)
    previous = cli.out / "stages.json"
    kept = json.loads(previous.read_text()) if cli.task and previous.exists() else None
    if kept and (kept.get("quick"), kept.get("reps"), kept.get("seconds")) != (cli.quick, reps, seconds):
        parser.error(f"--task merges into {previous}, measured with --reps {kept.get('reps')} --seconds "
                     f"{kept.get('seconds')}{' --quick' if kept.get('quick') else ''}; use those, or --out elsewhere")
    results = run(cli.quick, reps, seconds, cli.task)
    if kept:  # the other tasks as they were measured, each with its commit and CPU
        here = {k: kept["machine"].get(k) for k in ("commit", "cpu")}
        results = {**{t: {**here, **r} for t, r in kept["tasks"].items()}, **results}
    print("written:", save("stages", {"quick": cli.quick, "reps": reps, "seconds": seconds, "cores": os.cpu_count(),
                                      "tasks": results}, cli.out))
