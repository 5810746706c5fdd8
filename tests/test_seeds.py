"""Env seeds, action keys and minibatch permutations are distinct across actor threads,
processes and learner devices (cleanrl PR#238, envpool#298, Stoix PR#127)."""

from pathlib import Path

import jax
import numpy as np

from sebulba.config import Cluster, RunFlags, resolve_run
from sebulba.devices import Placement
from sebulba.envs import make_spec, pool_seed
from sebulba.evaluation import eval_seed
from sebulba.networks import RunningMoments
from sebulba.ppo_envpool import Agent, Args, make_update_fn
from sebulba.runtime import Run
from test_learner import make_rollout

FLAGS = dict(env_id="CartPole-v1", local_num_envs=8, num_actor_threads=2, seed=1, total_timesteps=10**6,
             run_name="seeds", deterministic=True, checkpoint_interval=4)


def test_every_env_of_every_thread_and_process_has_its_own_seed_and_first_observation():
    """2 processes x 2 actor threads x 8 envs, --seed 1: 32 distinct env seeds (also for the pools a
    --deterministic run makes at each checkpoint interval), 32 distinct first observations and
    distinct action noise per thread."""
    flags, spec, root = RunFlags(**FLAGS), make_spec("CartPole-v1"), jax.random.PRNGKey(1)
    seeds, first_obs, noise = [], [], []
    for process in range(2):
        setup = resolve_run(flags, 16, Cluster(2, process, "h:1"))
        run = Run(flags, setup, Path("runs/seeds"))
        for thread in range(2):
            with run.actor_pool(thread, 0, spec, root, 16, 0.99, False) as (envs, _, key):
                seeds += [envs.config["seed"] + i for i in range(8)]
                first_obs += list(envs.reset()[0])
                noise.append(np.asarray(jax.random.normal(key, (4,))))
    assert sorted(seeds) == list(range(1, 33))
    assert len({tuple(np.round(o, 6)) for o in first_obs}) == 32
    assert len({tuple(n) for n in noise}) == 4
    later = [pool_seed(1, thread, 4, 32, 8) + i for thread in range(4) for i in range(8)]  # the pools of rollout 4..
    assert len(set(later)) == 32 and not set(later) & set(seeds)


def test_runs_with_different_seeds_train_on_different_env_seeds():
    """Seeds of a learning benchmark are independent samples only if their envs are: --seed 1 to 5,
    2 threads x 8 envs, pools remade every 4 rollouts for 10,000 rollouts (a --deterministic run),
    share no env seed, and none reaches the evaluation pools' seeds; --seed 1 keeps seeds 1, 2, ..."""
    def env_seeds(seed):
        return {pool_seed(seed, thread, rollout, 16, 8) + i
                for thread in range(2) for rollout in range(0, 10_000, 4) for i in range(8)}
    runs = [env_seeds(seed) for seed in range(1, 6)]
    assert min(runs[0]) == 1 and all(len(r) == 2 * 2_500 * 8 for r in runs)
    assert len(set().union(*runs)) == sum(len(r) for r in runs)
    evaluation = {eval_seed(seed) + i for seed in range(1, 6) for i in range(100)}
    assert not evaluation & set().union(*runs)


def test_each_learner_device_draws_its_own_minibatch_permutation():
    devices = jax.devices()
    placement = Placement([devices[0]], devices[1:3])
    args = Args(env_id="CartPole-v1", hiddens=(8,), num_minibatches=2, local_num_envs=4)
    agent = Agent(num_actions=2, channels=(), hiddens=(8,), pixels=False)
    update = make_update_fn(args, agent, placement.mesh)
    rollout = placement.to_learners([make_rollout(8, 4, 1.0)])
    data = update.programs["prepare"](placement.replicate(RunningMoments.create(())), rollout)
    perm = update.programs["shuffle"](data, placement.replicate(np.asarray(jax.random.PRNGKey(0))))
    per_device = [np.asarray(shard.data) for shard in sorted(perm.addressable_shards, key=lambda s: s.device.id)]
    assert len(per_device) == 2 and per_device[0].shape == per_device[1].shape
    assert not np.array_equal(per_device[0], per_device[1])
    for p in per_device:  # each a permutation of its own device's 16 transitions
        assert sorted(p.ravel().tolist()) == list(range(16))
