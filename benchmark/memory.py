"""Peak host memory with the default Atari sizes, against the rollouts that can be in flight.

    python benchmark/memory.py            # Breakout-v5 at the script's default sizes, 3 runs (~25 min on 2 cores)
    python benchmark/memory.py --quick    # the computed figures and one small run (~2 min)

sebulba/ppo_envpool.py on Breakout-v5 with the script's defaults: 2 actor threads x 60 envs x
128 steps, frames 84x84x4, IMPALA ResNet 16-32-32/256, 4 minibatches of 3,840 frames.

* rollout bytes: one actor thread's rollout exactly as the script allocates it (a
  RolloutAssembler buffer, num_steps + 1 rows), and the dtype of its frames;
* rollouts in flight: per actor thread the one being assembled, the one in its queue (maxsize
  1) and the one the learner trains on, i.e. 3 x actor threads;
* frames on the learner: dtype of the observations the minibatch programs receive (after
  `prepare` and `shuffle`, traced with the real shapes);
* working memory (XLA's compiled temporary bytes) of the program that takes one minibatch's
  gradient: the whole 3,840-frame minibatch, and as --gradient-accumulation-steps 64 (one
  60-frame microbatch per program);
* peak RSS of real runs (the process, sampled every 0.5 s from launch to the end of its second
  update; during the first, the actors fill and queue the next rollout and start the one
  after) with the default sizes plus `--gradient-accumulation-steps 64 --update-epochs 1`: the
  whole minibatch's working memory does not fit a 24 GiB machine, and one epoch instead of
  four changes no buffer, only the time (~2.5 min per update instead of ~10 on 2 cores).
  With --quick the run is small (8 envs x 32 steps) and its peak is compared with its own
  rollouts in flight; the computed figures stay those of the default sizes.

Writes benchmark/results/memory.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import tyro
from common import cli_parser, run_script, save, spread

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sebulba import ppo_envpool as ppo
from sebulba.devices import Placement
from sebulba.rollouts import RolloutAssembler, rollout_shapes

ENV = ["--env-id", "Breakout-v5"]
ACCUMULATION = 64
RUN_FLAGS = [*ENV, "--gradient-accumulation-steps", str(ACCUMULATION), "--update-epochs", "1"]
QUICK_FLAGS = [*RUN_FLAGS, "--local-num-envs", "8", "--num-steps", "32"]
IN_FLIGHT_PER_THREAD = 3  # assembling + queued (maxsize 1) + on the learner


def rollout_bytes(args: ppo.Args) -> tuple[int, str]:
    """(bytes of one actor thread's rollout as the script allocates it, dtype of its frames)."""
    obs_space = ppo.make_agent(args)[1].observation_space
    assembler = RolloutAssembler(args.local_num_envs, args.num_steps, obs_space.shape, obs_space.dtype,
                                     clip_rewards=True, episodic_life=True)
    buffer = assembler._buffer(0)
    return sum(field.nbytes for field in buffer), str(buffer.obs.dtype)


def working_memory(flags: list[str]) -> tuple[int, str]:
    """(XLA's temporary bytes of the program taking one (micro)batch's gradient, the dtype of the
    frames it receives), for the real update on one learner device and a rollout of the run's
    shape (the program the script's memory check compiles)."""
    args = tyro.cli(ppo.Args, args=[*flags, "--learner-device-ids", "0"])
    setup = ppo.resolve(args)
    agent, spec = ppo.make_agent(args)
    params = ppo.init_params(agent, spec, jax.random.PRNGKey(0))
    placement = Placement([jax.devices()[0]], [jax.devices()[0]])
    state, _ = ppo.make_train_state(args, setup, params, placement)
    rollout = rollout_shapes(args.num_steps, setup.num_envs_total, spec, placement.env_sharded)
    compiled = ppo.compile_gradient_step(ppo.make_update_fn(args, agent, placement.mesh), args, state, rollout)
    return compiled.memory_analysis().temp_size_in_bytes, str(rollout.obs.dtype)


def run(quick: bool, reps: int) -> dict:
    args = tyro.cli(ppo.Args, args=ENV)
    per_rollout, rollout_dtype = rollout_bytes(args)
    in_flight = IN_FLIGHT_PER_THREAD * args.num_actor_threads * per_rollout
    whole, learner_dtype = working_memory(ENV)
    micro, _ = working_memory([*ENV, "--gradient-accumulation-steps", str(ACCUMULATION)])
    print(f"rollout {per_rollout / 2**20:,.0f} MiB per actor thread (frames {rollout_dtype}), in flight "
          f"{in_flight / 2**20:,.0f} MiB; learner frames {learner_dtype}; minibatch working memory "
          f"{whole / 2**30:.1f} GiB whole, {micro / 2**30:.2f} GiB as {ACCUMULATION} microbatches", flush=True)
    flags = QUICK_FLAGS if quick else RUN_FLAGS
    run_args = tyro.cli(ppo.Args, args=flags)
    batch = ppo.resolve(run_args).batch_size
    run_in_flight = IN_FLIGHT_PER_THREAD * run_args.num_actor_threads * rollout_bytes(run_args)[0]
    peaks = []
    for i in range(1 if quick else reps):
        result = run_script("ppo_envpool.py", [*flags, "--total-timesteps", str(2 * batch)], timeout=1800)
        peaks.append(result["peak_rss_bytes"])
        print(f"run {i + 1}: peak RSS {peaks[-1] / 2**20:,.0f} MiB = {peaks[-1] / run_in_flight:.2f} x in flight "
              f"({result['wall_s']:.0f} s)", flush=True)
    return {"quick": quick, "reps": len(peaks), "env_id": args.env_id, "num_actor_threads": args.num_actor_threads,
            "local_num_envs": args.local_num_envs, "num_steps": args.num_steps,
            "rollout_bytes": per_rollout, "rollout_obs_dtype": rollout_dtype, "learner_obs_dtype": learner_dtype,
            "in_flight_per_thread": IN_FLIGHT_PER_THREAD, "in_flight_bytes": in_flight,
            "minibatch_working_bytes": whole, "accumulation": ACCUMULATION, "microbatch_working_bytes": micro,
            "run_flags": [*flags, "--total-timesteps", str(2 * batch)], "run_in_flight_bytes": run_in_flight,
            "peak_rss_bytes": spread(peaks), "peak_rss_over_in_flight": spread([p / run_in_flight for p in peaks])}


if __name__ == "__main__":
    cli = cli_parser(__doc__, "memory", "the computed figures and one small run").parse_args()
    print("written:", save("memory", run(cli.quick, reps=3), cli.out))
