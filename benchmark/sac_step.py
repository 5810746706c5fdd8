"""The SAC learner's gradient steps per second alone, with the cores it keeps busy and its FLOP rate.

    python benchmark/sac_step.py            # CleanRL's sizes (256-256, minibatch 256) on HalfCheetah-v4, 5 repetitions
    python benchmark/sac_step.py --quick    # 1 repetition of 2 programs

sebulba/sac_envpool.py's compiled update (`make_update_fn`) on one learner device (a0-l0), its replay
filled from random transitions, run as the learner runs it: programs of 128 gradient steps (the
default 8 envs x 16 steps at replay ratio 1), after compiling. Per repetition: gradient steps/s over
4 programs, and the process's CPU seconds per wall second (cores busy). The FLOP count of one step
is written out from the layer sizes (`step_flops`: matrix multiplies only) and checked against
XLA's cost analysis of one critic-and-actor step. Also measures the ceiling the issue names: a chain of
256 x 256 float32 matmuls in JAX on the same batch, GFLOP per wall second with every core XLA uses.
Writes benchmark/results/sac_step.json (or under --out).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import cli_parser, machine, save, spread  # noqa: E402

from sebulba import replay  # noqa: E402
from sebulba import sac_envpool as sac  # noqa: E402
from sebulba.devices import Placement  # noqa: E402

STEPS_PER_PROGRAM = 128  # 8 envs x 16 steps at replay ratio 1


def step_flops(obs_dim: int, action_dim: int, hiddens: tuple[int, ...], batch: int, policy_frequency: int = 2) -> float:
    """Matmul FLOPs of one SAC gradient step (a multiply-add = 2 FLOPs; biases, activations and
    the optimiser left out): the target (the actor on s' and the twin target critics), the twin
    critics' forward and backward (backward = 2 x forward), and per step on average
    policy_frequency / policy_frequency = 1 actor step (the actor forward and backward, the twin
    critics forward and their backward to the action) and 1 temperature step (an actor forward)."""
    def mlp(sizes):  # forward multiply-adds of one example
        return sum(a * b for a, b in zip(sizes[:-1], sizes[1:]))

    actor = 2 * batch * mlp((obs_dim, *hiddens, 2 * action_dim))
    twin = 2 * 2 * batch * mlp((obs_dim + action_dim, *hiddens, 1))
    target = actor + twin
    critics = 3 * twin
    actor_step = 3 * actor + 2 * twin  # forward + backward of the actor; critics forward + data gradient
    temperature = actor
    return target + critics + (actor_step + temperature) * policy_frequency / policy_frequency


def build(env_id: str, hiddens: tuple[int, ...]):
    """(update function, state, filled buffer, an empty-rollout batch, setup) on device 0."""
    args = sac.Args(env_id=env_id, hiddens=hiddens, buffer_size=100_000, learning_starts=0, total_timesteps=1_000_000)
    setup = sac.resolve(args)
    device = jax.devices()[0]
    placement = Placement([device], [device])
    agent, spec = sac.make_agent(args)
    state, _ = sac.make_train_state(args, setup, sac.init_params(agent, spec, jax.random.PRNGKey(0)), placement)
    update = sac.make_update_fn(args, setup, agent, placement.mesh)
    buffer = replay.create(sac.replay_example(spec), setup.capacity_per_device, placement.mesh)
    rng = np.random.default_rng(0)
    shape = (args.num_steps + 1, setup.num_envs_total)
    obs_dim, action_dim = spec.observation_space.shape[0], spec.action_space.shape[0]
    rollout = sac.Rollout(rng.normal(size=shape + (obs_dim,)).astype(np.float32),
                          rng.uniform(-1, 1, shape + (action_dim,)).astype(np.float32), None, None,
                          rng.normal(size=shape).astype(np.float32), np.zeros(shape, bool), np.zeros(shape, bool),
                          None, None)
    batch = placement.to_learners([rollout])
    for _ in range(20):  # 20 x 128 transitions, no gradient step
        state, buffer, _ = update(state, buffer, batch, jax.random.PRNGKey(1), 0)
    return update, state, buffer, batch, (obs_dim, action_dim)


def time_programs(update, state, buffer, batch, programs: int):
    """(gradient steps/s, cores busy, state, buffer) over `programs` programs of STEPS_PER_PROGRAM steps (the
    buffer is donated to each program: the caller goes on with the one returned)."""
    state, buffer, _ = update(state, buffer, batch, jax.random.PRNGKey(2), STEPS_PER_PROGRAM)  # compile
    jax.block_until_ready(state)
    cpu, wall = sum(os.times()[:2]), time.perf_counter()
    for i in range(programs):
        state, buffer, _ = update(state, buffer, batch, jax.random.PRNGKey(3 + i), STEPS_PER_PROGRAM)
    jax.block_until_ready(state)
    wall = time.perf_counter() - wall
    return programs * STEPS_PER_PROGRAM / wall, (sum(os.times()[:2]) - cpu) / wall, state, buffer


def matmul_ceiling(batch: int = 256, width: int = 256, depth: int = 64, repeats: int = 20) -> float:
    """GFLOP/s of a jitted chain of `depth` [batch, width] @ [width, width] float32 matmuls."""
    weights = jax.random.normal(jax.random.PRNGKey(0), (depth, width, width)) / np.sqrt(width)

    @jax.jit
    def chain(x, weights):
        return jax.lax.fori_loop(0, depth, lambda i, x: jnp.tanh(x @ weights[i]), x)

    x = jax.random.normal(jax.random.PRNGKey(1), (batch, width))
    chain(x, weights).block_until_ready()
    start = time.perf_counter()
    for _ in range(repeats):
        x = chain(x, weights)
    x.block_until_ready()
    return 2 * batch * width * width * depth * repeats / (time.perf_counter() - start) / 1e9


def main(argv=None) -> dict:
    parser = cli_parser(__doc__, "sac_step", "1 repetition of 2 programs")
    parser.add_argument("--env-id", default="HalfCheetah-v4")
    parser.add_argument("--hiddens", type=int, nargs="+", default=[256, 256])
    opts = parser.parse_args(argv)
    repetitions, programs = (1, 2) if opts.quick else (5, 4)
    hiddens = tuple(opts.hiddens)
    update, state, buffer, batch, (obs_dim, action_dim) = build(opts.env_id, hiddens)
    flops = step_flops(obs_dim, action_dim, hiddens, 256)
    rates, busy = [], []
    for _ in range(repetitions):
        rate, cores, state, buffer = time_programs(update, state, buffer, batch, programs)
        rates.append(rate)
        busy.append(cores)
        print(f"{rate:.0f} gradient steps/s, {rate * flops / 1e9:.0f} GFLOP/s, {cores:.2f} cores busy", flush=True)
    ceiling = [matmul_ceiling() for _ in range(3)]
    result = {"env_id": opts.env_id, "hiddens": list(hiddens), "minibatch": 256, "steps_per_program": STEPS_PER_PROGRAM,
              "step_gflop": flops / 1e9, "gradient_steps_per_s": spread(rates), "cores_busy": spread(busy),
              "gflop_per_s": spread([r * flops / 1e9 for r in rates]), "matmul_chain_gflop_per_s": spread(ceiling),
              "xla_flags": os.environ.get("XLA_FLAGS", "")}
    print(f"median {statistics.median(rates):.0f} gradient steps/s ({result['gflop_per_s']['median']:.0f} GFLOP/s, "
          f"{statistics.median(busy):.2f} cores busy); a 256x256 matmul chain: {statistics.median(ceiling):.0f} GFLOP/s")
    save("sac_step", {"machine": machine(), "quick": opts.quick, "results": result}, opts.out)
    return result


if __name__ == "__main__":
    main()
