"""The named Atari protocols (--atari-protocol): each one's EnvPool settings against the values its
source uses, the --episodic-life override, and evaluation that plays whole games under each."""

import numpy as np
import pytest

from sebulba.config import ConfigError, RunFlags, resolve_run
from sebulba.envs import make_envs, make_spec, resolve_episodic_life
from sebulba.evaluation import run_episodes

# Written out from each source, not from sebulba/envs.py:
# - Cleanba's cleanba_ppo.py make_env: episodic_life=False, repeat_action_probability=0.25, noop_max=1,
#   full_action_space=True, max_episode_steps=108000 / 4, reward_clip=True, EnvPool's use_fire_reset default (True).
# - CleanRL's ppo_atari_envpool.py: envpool.make(env_id, episodic_life=True, reward_clip=True), EnvPool's defaults
#   otherwise: repeat_action_probability=0, full_action_space=False, noop_max=30, use_fire_reset=True, 27,000 steps.
# - Machado et al. 2018: sticky actions 0.25, the full action set, no life-loss signal, no FIRE pressed for the agent.
# Rewards: every source clips them for training; here EnvPool returns them raw and the assembler clips (K04).
SOURCES = {
    "cleanba": dict(repeat_action_probability=0.25, full_action_space=True, noop_max=1, episodic_life=False,
                    use_fire_reset=True, max_episode_steps=27_000, actions=18),
    "cleanrl": dict(repeat_action_probability=0.0, full_action_space=False, noop_max=30, episodic_life=True,
                    use_fire_reset=True, max_episode_steps=27_000, actions=4),
    "machado": dict(repeat_action_probability=0.25, full_action_space=True, noop_max=1, episodic_life=False,
                    use_fire_reset=False, max_episode_steps=27_000, actions=18),
}


@pytest.mark.parametrize("protocol", SOURCES)
def test_each_protocols_pool_has_its_sources_settings(protocol):
    expected = dict(SOURCES[protocol])
    actions = expected.pop("actions")
    pool = make_envs("Breakout-v5", 2, 2, seed=0, num_threads=1, protocol=protocol)
    try:
        assert {k: pool.config[k] for k in expected} == expected
        assert pool.config["reward_clip"] is False  # raw scores reach the logs; training clips them
        assert pool.action_space.n == make_spec("Breakout-v5", protocol).action_space.n == actions
    finally:
        pool.close()


def test_episodic_life_follows_the_protocol_unless_given():
    assert resolve_episodic_life("Breakout-v5", "cleanrl") is True
    assert resolve_episodic_life("Breakout-v5", "cleanba") is False
    assert resolve_episodic_life("Breakout-v5", "cleanrl", False) is False  # the flag wins over the protocol
    assert resolve_episodic_life("Breakout-v5", "cleanba", True) is True
    assert resolve_episodic_life("CartPole-v1", "cleanrl") is False  # no lives outside Atari
    pool = make_envs("Breakout-v5", 1, 1, seed=0, num_threads=1, protocol="cleanrl", episodic_life=False)
    assert pool.config["episodic_life"] is False and pool.config["noop_max"] == 30
    pool.close()
    setup = resolve_run(RunFlags(env_id="Breakout-v5", atari_protocol="cleanrl", local_num_envs=4), num_steps=8)
    assert setup.episodic_life is True


def test_an_unknown_protocol_is_one_line_naming_the_choices():
    with pytest.raises(ConfigError, match="--atari-protocol dopamine: use one of cleanba, cleanrl, machado"):
        resolve_run(RunFlags(env_id="Breakout-v5", atari_protocol="dopamine", local_num_envs=4), num_steps=8)


class LivesPool:
    """One env, synchronous, EnvPool's gymnasium API with `episodic_life=True`: a life loss terminates
    the episode and the next step is EnvPool's auto-reset (action ignored, reward 0)."""

    config = {"num_envs": 1}

    def __init__(self, script):
        self.script, self.t = script, 0  # [(reward, terminated, truncated, lives)]

    def reset(self):
        return np.zeros((1, 2), np.float32), {"lives": np.array([3])}

    def step(self, action):
        reward, terminated, truncated, lives = self.script[self.t]
        self.t += 1
        return (np.zeros((1, 2), np.float32), np.array([reward], float), np.array([terminated]),
                np.array([truncated]), {"lives": np.array([lives])})


def random_policy(params, obs, key):
    return np.zeros(len(obs), np.int32), None, None, None, key


# A game of 3 lives: scored 1, lost a life (auto-reset step), scored 5, lost a life (auto-reset), scored 2, game over.
GAME = [(1, False, False, 3), (0, True, False, 2), (0, False, False, 2), (5, False, False, 2), (0, True, False, 1),
        (0, False, False, 1), (2, False, False, 1), (0, True, False, 0)]


def test_evaluation_under_a_life_loss_protocol_plays_the_whole_game():
    returns, lengths, _ = run_episodes(LivesPool(GAME), random_policy, None, None, episodic_life=True)
    assert returns.tolist() == [8.0]  # every life's score, the game's
    assert lengths.tolist() == [6]  # 8 steps less the 2 auto-reset steps that carry no action


def test_evaluation_without_life_loss_episodes_ends_at_termination():
    returns, lengths, _ = run_episodes(LivesPool(GAME), random_policy, None, None, episodic_life=False)
    assert (returns.tolist(), lengths.tolist()) == ([1.0], [2])
