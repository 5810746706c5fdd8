"""MiniGrid's and BabyAI's missions as words (sebulba/missions.py) and the encoder that reads
them (sebulba/networks.py): the vocabulary against missions sampled from every registered task,
the round trip back to the text, the errors, which tasks read the mission, and that the
network sees it. The learning test (a task that needs the mission) is in tests/test_envpool_runs.py."""

import functools

import envpool
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sebulba.impala_envpool as impala
import sebulba.ppo_envpool as ppo
import sebulba.ppo_lstm_envpool as ppo_lstm
from sebulba.config import BROKEN_TASKS, ConfigError
from sebulba.envs import make_envs, make_spec
from sebulba.missions import (VOCAB, WORD_ID, MissionTokenizer, decode, mission_varies, mission_width, reads_mission,
                              split_words)
from sebulba.networks import MiniGridEncoder, MissionEncoder, RunningMoments
from sebulba.rollouts import obs_storage, rollout_shapes, zeros_obs

TASKS = sorted(e for e in envpool.list_all_envs() if e.startswith(("MiniGrid-", "BabyAI-")))
HANGS = set(BROKEN_TASKS)  # its grammar is BabyAI-Synth-v0's, sampled here


@functools.cache
def sampled_missions() -> dict[str, tuple[list[str], np.ndarray]]:
    """{task: (the mission texts of 24 games, their word ids [24, W])}: each game a reset of its own
    seed, the text read from the raw pool's bytes and the ids from the pool the scripts use."""
    out = {}
    for task in sorted(set(TASKS) - HANGS):
        n = 2 if "WFC" in task else 24  # WFC's maze generation is slow, and its mission is fixed
        raw = envpool.make(task, env_type="gymnasium", num_envs=n, batch_size=n, seed=1, num_threads=1)
        texts = [bytes(row).rstrip(b"\0").decode() for row in raw.reset()[0]["mission"]]
        raw.close()
        pool = make_envs(task, n, n, seed=1, num_threads=1)
        out[task] = (texts, pool.reset()[0]["mission"])
        pool.close()
    return out


def test_every_registered_task_is_sampled():
    assert len(TASKS) == 177 and sum(t.startswith("BabyAI-") for t in TASKS) == 96  # EnvPool 1.2.5
    assert set(sampled_missions()) == set(TASKS) - HANGS


def test_missions_of_every_task_are_words_of_the_vocabulary_and_decode_back_to_their_text():
    for task, (texts, ids) in sampled_missions().items():
        width = mission_width(task)
        assert ids.shape == (len(texts), width) and ids.dtype == np.uint8, task
        assert make_spec(task).observation_space["mission"].shape == (width,)
        for text, row in zip(texts, ids):
            assert decode(row) == text, task
            words = split_words(text)
            np.testing.assert_array_equal(row[:len(words)], [WORD_ID[w] for w in words])
            assert not row[len(words):].any()  # padded with 0 after the words


def test_the_widths_are_the_grammars_longest_missions():
    longest = {task: max(len(split_words(t)) for t in texts) for task, (texts, _) in sampled_missions().items()}
    assert longest["MiniGrid-LockedRoom-v0"] == mission_width("MiniGrid-LockedRoom-v0") == 18
    assert longest["MiniGrid-GoToDoor-5x5-v0"] == mission_width("MiniGrid-GoToDoor-5x5-v0") == 5
    assert longest["BabyAI-GoToLocal-v0"] == 5 and mission_width("BabyAI-GoToLocal-v0") == 9
    assert mission_width("BabyAI-BossLevel-v0") == 72 and mission_width("BabyAI-SynthLoc-v0") == 17
    assert longest["BabyAI-MoveTwoAcrossS8N9-v0"] == mission_width("BabyAI-MoveTwoAcrossS8N9-v0") == 20


def test_tasks_read_the_mission_where_it_varies_from_game_to_game():
    for task, (texts, _) in sampled_missions().items():
        assert mission_varies(task) == (len(set(texts)) > 1), (task, sorted(set(texts))[:3])
    assert not reads_mission("MiniGrid-MemoryS7-v0", None) and reads_mission("MiniGrid-MemoryS7-v0", True)
    assert reads_mission("BabyAI-GoToLocal-v0", None) and not reads_mission("BabyAI-GoToLocal-v0", False)


def test_an_unknown_word_or_a_too_long_mission_is_an_error_naming_it_and_the_task():
    tokenize = MissionTokenizer("BabyAI-GoToLocal-v0")
    with pytest.raises(ValueError, match=r"^BabyAI-GoToLocal-v0: mission 'go to the pink ball' has word 'pink'"):
        tokenize(np.frombuffer(b"go to the pink ball".ljust(512, b"\0"), np.uint8)[None])
    with pytest.raises(ValueError, match=r"^BabyAI-GoToLocal-v0: mission .* has 12 words, more than the 9"):
        tokenize.encode("go to the red ball and go to the blue key behind")
    assert tokenize(np.zeros((0, 512), np.uint8)).shape == (0, 9)
    assert decode(tokenize.encode("")) == "" and len(VOCAB) < 256  # ids fit uint8


def test_the_mission_costs_its_word_ids_not_its_bytes():
    for task, before in (("BabyAI-GoToLocal-v0", 512), ("MiniGrid-GoToDoor-5x5-v0", 96)):
        shapes, dtypes = obs_storage(make_spec(task).observation_space)
        assert envpool.make_spec(task).observation_space["mission"].shape == (before,)
        assert shapes["mission"] == (mission_width(task),) and dtypes["mission"] == np.uint8


def agent_features(task: str, read_mission: bool | None):
    args = ppo.Args(env_id=task, hiddens=(32,), read_mission=read_mission)
    agent, spec = ppo.make_agent(args)
    return agent, spec, ppo.init_params(agent, spec, jax.random.PRNGKey(0))


def test_the_encoder_sees_the_mission_and_its_gradients_reach_the_word_embeddings():
    agent, spec, params = agent_features("MiniGrid-GoToDoor-5x5-v0", None)
    assert agent.read_mission
    obs = zeros_obs(spec.observation_space, 2)
    obs["image"][:] = np.random.default_rng(0).integers(0, 6, obs["image"].shape)
    obs["mission"] = MissionTokenizer("MiniGrid-GoToDoor-5x5-v0").encode_all(["go to the red door",
                                                                              "go to the blue door"])
    same_grid = jax.tree.map(lambda x: x[:1].repeat(2, 0), {k: v for k, v in obs.items() if k != "mission"})
    policy, value = jax.jit(agent.apply)(params, {**same_grid, "mission": obs["mission"]}, RunningMoments.create(()))
    assert not np.allclose(policy[0], policy[1]) and value[0] != value[1]

    # The gradient through a learner's loss: IMPALA's, on a rollout of these observations (its
    # network is PPO's MiniGridEncoder; this also takes the dictionary rollout through the loss).
    args = impala.Args(env_id="MiniGrid-GoToDoor-5x5-v0", hiddens=(32,))
    agent, spec = impala.make_agent(args)
    params = impala.init_params(agent, spec, jax.random.PRNGKey(0))
    rollout = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), rollout_shapes(1, 2, spec, None))
    rollout.obs.update({k: v[None].repeat(2, 0) for k, v in obs.items()})
    def loss(p):
        return impala.impala_loss(p, lambda q, o: agent.apply(q, o, RunningMoments.create(())), rollout, args)
    grads = jax.jit(jax.grad(loss, has_aux=True))(params)[0]["params"]["MiniGridEncoder_0"]["MissionEncoder_0"]
    embedding = np.asarray(grads["Embed_0"]["embedding"])
    used = {WORD_ID[w] for w in ("go", "to", "the", "red", "blue", "door")}
    assert all(np.abs(embedding[i]).sum() > 0 for i in used)
    assert not np.abs(embedding[[i for i in range(len(VOCAB)) if i not in used]]).any()


def test_the_mission_encoder_reads_each_mission_to_its_last_word():
    ids = MissionTokenizer("BabyAI-GoToLocal-v0").encode_all(["go to the red ball", "go to the red ball"])
    ids[1, 5:] = WORD_ID["key"]  # words after the mission's end (never stored so) do not change its features
    encoder = MissionEncoder(len(VOCAB))
    params = encoder.init(jax.random.PRNGKey(0), ids)
    features = encoder.apply(params, ids)
    assert features.shape == (2, 64) and features.dtype == jnp.float32
    cut = encoder.apply(params, ids[:, :5])  # the same 5 words, nothing after them
    np.testing.assert_allclose(features[0], cut[0], rtol=1e-6)
    assert not np.allclose(features[1], cut[1])  # the second row's padding was not padding


def test_a_task_with_a_fixed_mission_keeps_the_network_it_had():
    agent, spec, params = agent_features("MiniGrid-MemoryS7-v0", None)
    assert not agent.read_mission
    blind = MiniGridEncoder((32,)).init(jax.random.PRNGKey(0), zeros_obs(spec.observation_space, 1))
    read = MiniGridEncoder((32,), mission=True).init(jax.random.PRNGKey(0), zeros_obs(spec.observation_space, 1))
    assert set(blind["params"]) == {"Embed_0", "Embed_1", "Embed_2", "Embed_3", "Dense_0"}
    assert {"MissionEncoder_0", "FiLM_0", "FiLM_1"} <= set(read["params"])
    still, moments = zeros_obs(spec.observation_space, 1), RunningMoments.create(())
    moved = {**still, "mission": np.full((1, 18), 3, np.uint8)}
    np.testing.assert_array_equal(agent.apply(params, moved, moments)[0], agent.apply(params, still, moments)[0])


@pytest.mark.parametrize("module", [ppo, ppo_lstm, impala])
def test_every_script_with_dictionary_observations_reads_the_mission(module):
    args = module.Args(env_id="BabyAI-GoToLocal-v0", hiddens=(32,), local_num_envs=8, num_steps=16,
                       total_timesteps=10_000)
    assert module.resolve(args).read_mission
    agent, spec = module.make_agent(args)
    assert agent.minigrid and agent.read_mission
    params = module.init_params(agent, spec, jax.random.PRNGKey(0))
    assert "MissionEncoder_0" in str(jax.tree_util.tree_structure(params))


def test_a_task_that_hangs_in_envpool_is_refused_before_anything_starts():
    with pytest.raises(ConfigError, match=r"^--env-id BabyAI-SynthS5R2-v0 cannot run: EnvPool 1.2.5 never returns"):
        ppo.resolve(ppo.Args(env_id="BabyAI-SynthS5R2-v0", local_num_envs=8, num_steps=16, total_timesteps=10_000))


def test_read_mission_is_refused_where_there_is_no_mission():
    with pytest.raises(ConfigError, match=r"^--read-mission is for MiniGrid and BabyAI tasks; CartPole-v1 has no"):
        ppo.resolve(ppo.Args(env_id="CartPole-v1", read_mission=True, local_num_envs=8, num_steps=16,
                             total_timesteps=10_000))

