"""Dictionary observations (EnvPool's MiniGrid tasks: image, direction, mission) through the
shared data path: the actor loop and rollout assembly with env ids in any order, the
transfer onto the learner mesh, the MiniGrid encoder, the refusal. The mission's words:
tests/test_missions.py. Real MiniGrid runs:
tests/test_docs.py trains the documented PPO command, tests/test_lstm.py the LSTM script
through scripts/evaluate.py."""

import jax
import numpy as np
import pytest
from fake_envpool import ScriptedPool, drive_actor

import sebulba.ppo_envpool as ppo
from sebulba.config import ConfigError
from sebulba.devices import Placement
from sebulba.envs import is_minigrid, make_spec
from sebulba.networks import RunningMoments
from sebulba.rollouts import obs_storage, rollout_shapes, zeros_obs

MEMORY = "MiniGrid-MemoryS7-v0"


def test_minigrid_observations_are_stored_as_their_own_arrays():
    spec = make_spec(MEMORY)
    assert is_minigrid(MEMORY) and not is_minigrid("CartPole-v1")
    shapes, dtypes = obs_storage(spec.observation_space)
    assert shapes == {"direction": (), "image": (7, 7, 3), "mission": (18,)}  # word ids, not the 96 bytes
    assert dtypes == {"direction": np.int32, "image": np.uint8, "mission": np.uint8}
    rollout = rollout_shapes(4, 6, spec, None)
    assert rollout.obs["image"].shape == (5, 6, 7, 7, 3) and rollout.obs["direction"].dtype == np.int32
    assert zeros_obs(spec.observation_space, 2)["image"].shape == (2, 7, 7, 3)


@pytest.mark.parametrize("deterministic", [False, True])
def test_each_env_keeps_its_own_dictionary_observations_when_ids_come_in_any_order(deterministic):
    # 4 envs, recv batches of 2 in a scrambled order; the stand-in writes (env id, appearance k)
    # into every pixel of the image and k % 4 into the direction.
    batches = [[3, 1], [0, 2], [1, 3], [2, 0], [0, 3], [1, 2], [3, 2], [1, 0], [2, 1], [0, 3]]
    pool = ScriptedPool(batches, 4, dict_obs=True)
    items, error = drive_actor(pool, 2, 2, 1, num_actions=7, deterministic=deterministic)
    assert error is None and len(items) == 1
    rollout = items[0][0]
    for e in range(4):
        image, direction = rollout.obs["image"][:, e], rollout.obs["direction"][:, e]
        assert (image[..., 0] == e).all() and (image[..., 2] == 0).all()
        np.testing.assert_array_equal(image[:, 0, 0, 1], [0, 1, 2])  # rows 0..T: the env's 1st..3rd observations
        np.testing.assert_array_equal(direction, [0, 1, 2])
        assert len(pool.actions_received[e]) >= 2  # every env was stepped with actions of its own


def test_dictionary_rollouts_reach_each_learner_device_with_its_own_envs():
    devices = jax.devices()
    placement = Placement([devices[0]], devices[1:3])
    spec = make_spec(MEMORY)
    host_rollout = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), rollout_shapes(3, 4, spec, None))
    host_rollout.obs["image"][..., 0] = np.arange(4, dtype=np.uint8)[None, :, None, None]  # env id in channel 0
    batch = placement.to_learners([host_rollout])
    image = batch.obs["image"]
    assert image.sharding == placement.env_sharded and batch.obs["direction"].sharding == placement.env_sharded
    for shard in image.addressable_shards:
        envs = range(4)[shard.index[1]]
        assert shard.device in devices[1:3]
        np.testing.assert_array_equal(np.asarray(shard.data)[0, :, 0, 0, 0], list(envs))


def test_the_minigrid_agent_reads_image_and_direction():
    args = ppo.Args(env_id=MEMORY, hiddens=(32,))
    agent, spec = ppo.make_agent(args)
    assert agent.minigrid and not agent.pixels
    params = ppo.init_params(agent, spec, jax.random.PRNGKey(0))
    obs = zeros_obs(spec.observation_space, 3)
    policy, value = agent.apply(params, obs, RunningMoments.create(()))
    assert policy.shape == (3, 7) and value.shape == (3,)
    turned = {**obs, "direction": np.array([0, 1, 2], np.int32)}
    assert not np.allclose(agent.apply(params, turned, RunningMoments.create(()))[0][1:], policy[1:])
    moved = {**obs, "mission": np.full((3, 18), 7, np.uint8)}  # MemoryS7's mission never changes: not read
    np.testing.assert_array_equal(agent.apply(params, moved, RunningMoments.create(()))[0], policy)


def test_norm_obs_is_refused_on_dictionary_observations():
    with pytest.raises(ConfigError, match=r"^--norm-obs is for vector observations; a MiniGrid observation"):
        ppo.resolve(ppo.Args(env_id=MEMORY, norm_obs=True, local_num_envs=8, num_steps=16, total_timesteps=10_000))
