"""Observations by kind, not by family (sebulba.envs.observations): real EnvPool pools of every
family the scripts take, served as the networks read them (dm_control's dict flattened in its own
key order, a toy-text Discrete value one-hot, CarRacing's pixels channel-first, Procgen's as they
come), Procgen's levels, and the one-line refusals. Short real runs of each script on one id of
each family it takes are at the end (slow tier)."""

import re
import sys
from pathlib import Path

import envpool
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_config import cli

import sebulba.config as config
from sebulba import impala_envpool as impala
from sebulba import ppo_envpool as ppo
from sebulba import ppo_lstm_envpool as ppo_lstm
from sebulba import pqn_envpool as pqn
from sebulba import sac_envpool as sac
from sebulba.config import ConfigError, RunFlags, check_env_id, resolve_run
from sebulba.envs import (EVALUATION_EPISODE_STEPS, evaluation_step_limit, has_pixels, make_envs, make_spec,
                          observations, procgen_levels)
from sebulba.evaluation import run_episodes
from sebulba.rollouts import obs_storage


def procgen_loads() -> bool:
    try:
        envpool.make_spec("CoinrunEasy-v0")
        return True
    except ImportError:
        return False


NEEDS_QT = pytest.mark.skipif(not procgen_loads(), reason="EnvPool's Procgen needs the system Qt 5 runtime: "
                                                          "apt-get install libqt5gui5 (.ci/run installs it)")


def raw_and_served(env_id: str, num_envs: int = 3, seed: int = 7, **options):
    """The first observations of EnvPool's own pool and of `make_envs`'s, same seed."""
    raw = envpool.make(env_id, env_type="gymnasium", num_envs=num_envs, batch_size=num_envs, seed=seed,
                       num_threads=1, **options)
    served = make_envs(env_id, num_envs, num_envs, seed, 1, **options)
    (raw_obs, _), (served_obs, _) = raw.reset(), served.reset()
    actions = np.zeros((num_envs, *raw.action_space.shape), raw.action_space.dtype)
    raw_next, served_next = raw.step(actions)[0], served.step(actions)[0]
    raw.close(), served.close()
    return (raw_obs, raw_next), (served_obs, served_next)


def test_dm_control_dicts_are_flattened_in_the_tasks_own_key_order():
    served = observations("WalkerWalk-v1")
    assert served.kind == "vector" and served.keys == ("orientations", "height", "velocity")  # not sorted
    assert make_spec("WalkerWalk-v1").observation_space.shape == (14 + 1 + 9,)
    for raw, flat in zip(*raw_and_served("WalkerWalk-v1")):
        assert flat.shape == (3, 24) and flat.dtype == np.float64
        np.testing.assert_array_equal(flat[:, :14], raw["orientations"])
        np.testing.assert_array_equal(flat[:, 14], raw["height"])  # a scalar entry: one column
        np.testing.assert_array_equal(flat[:, 15:], raw["velocity"])
    assert obs_storage(make_spec("WalkerWalk-v1").observation_space) == ((24,), np.float32)


def test_a_discrete_observation_becomes_a_one_hot_vector():
    assert make_spec("Taxi-v3").observation_space.shape == (500,)
    for raw, one_hot in zip(*raw_and_served("Taxi-v3")):
        assert one_hot.dtype == np.float32 and one_hot.shape == (3, 500)
        np.testing.assert_array_equal(one_hot.argmax(1), raw)
        np.testing.assert_array_equal(one_hot.sum(1), 1.0)


def test_carracing_pixels_are_served_channel_first_and_stay_uint8():
    assert has_pixels("CarRacing-v2") and make_spec("CarRacing-v2").observation_space.shape == (3, 96, 96)
    for raw, chw in zip(*raw_and_served("CarRacing-v2", num_envs=2)):
        assert chw.dtype == np.uint8 and chw.flags.c_contiguous
        np.testing.assert_array_equal(chw, raw.transpose(0, 3, 1, 2))


@NEEDS_QT
def test_procgen_pixels_come_as_envpool_serves_them():
    served = observations("StarpilotEasy-v0")
    assert served.kind == "pixels" and served.serve is None and served.space.shape == (3, 64, 64)


@NEEDS_QT
def test_procgen_trains_on_its_levels_and_evaluates_on_the_unbounded_distribution():
    flags = RunFlags(env_id="StarpilotEasy-v0", local_num_envs=8, procgen_num_levels=200, procgen_start_level=5)
    record = resolve_run(flags, 16).procgen_levels
    assert record == dict(train=dict(start_level=5, num_levels=200), eval=dict(start_level=5, num_levels=0),
                          distribution_mode="easy")
    assert resolve_run(RunFlags(env_id="StarpilotHard-v0", local_num_envs=8), 16).procgen_levels[
        "distribution_mode"] == "hard"
    assert resolve_run(RunFlags(env_id="CartPole-v1", local_num_envs=8), 16).procgen_levels is None
    assert procgen_levels("Breakout-v5", 0, 200) == {}
    # One level: every training episode is the same game; the evaluation levels are others.
    train = make_envs("StarpilotEasy-v0", 2, 2, 1, 1, **procgen_levels("StarpilotEasy-v0", 3, 1))
    test = make_envs("StarpilotEasy-v0", 2, 2, 1, 1, **procgen_levels("StarpilotEasy-v0", 3, 1, evaluation=True))
    (train_obs, _), (test_obs, _) = train.reset(), test.reset()
    assert (train_obs[0] == train_obs[1]).all() and not (test_obs[0] == test_obs[1]).all()


@pytest.mark.parametrize("env_id, kind", [("Breakout-v5", "pixels"), ("CheetahRun-v1", "vector"),
                                          ("FetchReach-v1", "vector"), ("Blackjack-v1", "vector"),
                                          ("LunarLander-v2", "vector"), ("MiniGrid-Empty-5x5-v0", "minigrid")])
def test_each_family_has_the_kind_its_observations_are(env_id, kind):
    assert observations(env_id).kind == kind


def test_an_id_whose_observations_no_script_takes_is_refused_in_one_line():
    code, stdout, stderr = cli(ppo, "--env-id", "BinPack-v2")
    assert code == 2 and stdout == "" and stderr.strip().splitlines() == [
        "error: --env-id BinPack-v2's observations are a dict of ems, ems_mask, items, items_mask, items_placed, "
        "action_mask holding more than vectors; the scripts take pixels (uint8 [H, W, C] or [C, H, W]), vectors, "
        "a dict of vectors (dm_control), a Discrete value (toy text) or MiniGrid's dict: pick a task of those "
        "(README.md#tasks) or add its observations to sebulba/envs.py's `observations`"]


def test_procgen_without_qt_names_the_package_to_install(monkeypatch):
    """EnvPool's Procgen raises ImportError where the system Qt 5 runtime is missing (this machine
    has it, so the import is made to fail as it does there)."""
    def no_qt(env_id):
        raise ImportError("EnvPool Procgen requires the system Qt 5 runtime on Linux. Install the Qt5 Core/Gui ...")

    monkeypatch.setattr(config, "observations", no_qt)
    with pytest.raises(ConfigError) as error:
        check_env_id("CoinrunEasy-v0")
    assert str(error.value) == ("--env-id CoinrunEasy-v0: EnvPool's procgen tasks cannot load here; install the Qt 5 "
                                "runtime: apt-get install libqt5gui5 (Debian, Ubuntu) or dnf install qt5-qtbase")


@pytest.mark.parametrize("module, env_id, says", [
    (pqn, "CarRacing-v2", "has continuous actions (Box([-1.  0.  0.], 1.0, (3,), float32)); PQN takes the max over "
                          "discrete actions: use sebulba/sac_envpool.py or sebulba/ppo_envpool.py for this task"),
    (ppo, "CarRacing-v2", "--norm-obs is for vector observations; CarRacing-v2's pixels are scaled by 1/255"),
])
def test_what_a_script_cannot_take_is_refused_in_one_line(module, env_id, says):
    code, _, stderr = cli(module, "--env-id", env_id, "--norm-obs", "True") if module is ppo else cli(
        module, "--env-id", env_id)
    assert code == 2 and len(stderr.strip().splitlines()) == 1 and says in stderr, stderr


@NEEDS_QT
@pytest.mark.parametrize("module", [ppo, impala, ppo_lstm])
def test_pixel_tasks_get_the_conv_encoder_and_vector_tasks_the_mlp(module):
    for env_id, pixels in (("StarpilotEasy-v0", True), ("CarRacing-v2", True), ("WalkerWalk-v1", False),
                           ("FrozenLake-v1", False)):
        agent, spec = module.make_agent(module.Args(env_id=env_id, channels=(4,), hiddens=(8,)))
        assert agent.pixels is pixels
        shapes = jax.eval_shape(lambda: module.init_params(agent, spec, jax.random.PRNGKey(0)))
        convs = [p for p in jax.tree_util.tree_leaves_with_path(shapes) if "Conv" in jax.tree_util.keystr(p[0])]
        assert bool(convs) is pixels, env_id


def test_sac_on_pixels_gives_the_actor_and_each_critic_a_conv_encoder_of_its_own():
    args = sac.Args(env_id="CarRacing-v2", hiddens=(8,))
    actor, spec = sac.make_agent(args)
    assert actor.pixels and spec.observation_space.shape == (3, 96, 96)
    frames = jnp.zeros((2, 3, 96, 96), jnp.uint8)
    params = jax.eval_shape(actor.init, jax.random.PRNGKey(0), frames)["params"]
    assert params["encoder"]["Conv_0"]["kernel"].shape == (8, 8, 3, 32)
    critic = sac.Critic((8,), pixels=True)
    q_params = jax.eval_shape(critic.init, jax.random.PRNGKey(0), frames, jnp.zeros((2, 3)))["params"]
    leaf = q_params["VmapQNetwork_0"]["encoder"]["Conv_0"]["kernel"]
    assert leaf.shape == (2, 8, 8, 3, 32)  # twin critics, two encoders
    q = jax.eval_shape(critic.apply, {"params": q_params}, frames, jnp.zeros((2, 3)))
    assert q.shape == (2, 2)


# Short real runs: each script on one id of each family it takes, a few updates at tiny sizes.
TINY = ["--local-num-envs", "4", "--num-actor-threads", "1", "--eval-episodes", "1", "--checkpoint-interval", "0"]
RUNS = [
    (ppo, "CheetahRun-v1", ["--num-steps", "8", "--total-timesteps", "64", "--hiddens", "8"]),
    (ppo, "Taxi-v3", ["--num-steps", "8", "--total-timesteps", "64", "--hiddens", "8"]),
    (ppo, "StarpilotEasy-v0", ["--num-steps", "8", "--total-timesteps", "64", "--channels", "4", "--hiddens", "8",
                               "--procgen-num-levels", "10"]),
    (ppo, "CarRacing-v2", ["--num-steps", "4", "--total-timesteps", "32", "--atari-encoder", "nature", "--hiddens",
                           "8", "--eval-episodes", "0"]),
    (sac, "CarRacing-v2", ["--num-steps", "4", "--total-timesteps", "32", "--learning-starts", "16", "--buffer-size",
                           "64", "--minibatch-size", "8", "--hiddens", "8", "--eval-episodes", "0"]),
    (impala, "WalkerWalk-v1", ["--num-steps", "8", "--total-timesteps", "64", "--hiddens", "8"]),
    (impala, "CoinrunEasy-v0", ["--num-steps", "8", "--total-timesteps", "64", "--channels", "4", "--hiddens", "8"]),
    (ppo_lstm, "FrozenLake-v1", ["--num-steps", "8", "--total-timesteps", "64", "--hiddens", "8"]),
    (pqn, "Taxi-v3", ["--num-steps", "8", "--total-timesteps", "64", "--hiddens", "8"]),
    (pqn, "StarpilotEasy-v0", ["--num-steps", "8", "--total-timesteps", "64", "--num-minibatches", "2", "--update-epochs",
                               "1", "--hiddens", "8"]),
    (sac, "CheetahRun-v1", ["--total-timesteps", "64", "--learning-starts", "32", "--hiddens", "8"]),
]


@pytest.mark.slow
@pytest.mark.parametrize("module, env_id, flags", [
    pytest.param(m, e, f, id=f"{m.__name__.split('.')[-1]}-{e}", marks=[NEEDS_QT] if "Easy" in e else [])
    for m, e, f in RUNS])
def test_each_script_runs_on_each_family_it_takes(module, env_id, flags):
    code, stdout, stderr = cli(module, "--env-id", env_id, *TINY, *flags)
    assert code == 0, stderr
    assert "done:" in stdout and ("final eval" in stdout or "--eval-episodes" in flags)


SCRIPTS = {"ppo": ppo, "impala": impala, "ppo_lstm": ppo_lstm, "pqn": pqn, "sac": sac}


def readme_tasks() -> list[tuple[str, str, str]]:
    """README's Tasks table: (family, example id, the scripts cell) per example id."""
    text = (Path(__file__).parents[1] / "README.md").read_text()
    table = text.split("<!-- tasks:")[1].split("<!-- /tasks -->")[0]
    rows = [line.split("|")[1:-1] for line in table.splitlines() if line.startswith("| ") and "`" in line]
    return [(row[0].strip(), env_id, row[4].strip()) for row in rows for env_id in re.findall(r"`([^`]+)`", row[1])]


@pytest.mark.parametrize("family, env_id, cell", [
    pytest.param(*row, id=row[1], marks=[NEEDS_QT] if row[0] == "Procgen" else []) for row in readme_tasks()])
def test_the_readme_tasks_table_says_which_scripts_take_each_id(family, env_id, cell):
    discrete = type(envpool.make_spec(env_id).action_space).__name__ == "Discrete"
    if "discrete:" in cell:
        cell = cell.split("Box:")[0 if discrete else 1].removeprefix("discrete:").strip(" ;")
    claimed = {name.strip() for name in cell.split(",")}
    taken = set()
    for name, module in SCRIPTS.items():
        try:
            module.resolve(module.Args(env_id=env_id, local_num_envs=8))
            taken.add(name)
        except ConfigError:
            pass
    assert taken == claimed, (family, env_id)


def test_readmes_other_family_commands_are_the_learning_rows():
    """README's "Other task families" commands are benchmark/learning.py's rows, flag for flag."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmark"))
    import learning

    text = (Path(__file__).parents[1] / "README.md").read_text().split("### Other task families")[1].split("### ")[0]
    commands = [line.split()[1:] for line in text.split("```")[1].strip().splitlines()]
    rows = ["LunarLander-v2/PPO/1M", "LunarLander-v2/PQN/1M", "CheetahRun-v1/SAC/500k", "WalkerWalk-v1/SAC/500k",
            "CheetahRun-v1/PPO/1M",
            "StarpilotEasy-v0/PPO/2M-nature", "CarRacing-v2/PPO/1M"]
    assert commands == [[f"sebulba/{learning.TASKS[row][0]}", *learning.TASKS[row][1]] for row in rows]


def test_an_evaluation_ends_on_a_task_whose_episodes_envpool_never_truncates():
    """CliffWalking has no time limit in EnvPool (max_episode_steps 2**31 - 1, and a smaller one is
    not applied): a greedy policy that never reaches the goal would keep an evaluation, which plays
    whole episodes, running forever. Its evaluations cut an episode at EVALUATION_EPISODE_STEPS."""
    assert evaluation_step_limit("CliffWalking-v0") == EVALUATION_EPISODE_STEPS
    assert evaluation_step_limit("CartPole-v1") is None and evaluation_step_limit("Breakout-v5") is None
    envs = make_envs("CliffWalking-v0", 2, 2, 0, 1)

    def up(params, obs, key):  # into the wall: never the goal, never the cliff
        return np.zeros(len(obs), np.int32), None, None, None, key

    returns, lengths, _ = run_episodes(envs, up, None, None, max_steps=evaluation_step_limit("CliffWalking-v0"))
    np.testing.assert_array_equal(lengths, [EVALUATION_EPISODE_STEPS] * 2)
    np.testing.assert_array_equal(returns, [-EVALUATION_EPISODE_STEPS] * 2)  # -1 a step
