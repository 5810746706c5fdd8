"""Bad configuration is refused before any thread starts, with one line saying what to change (K12)."""

import subprocess
import sys
from pathlib import Path

import pytest

from sebulba.ppo_envpool import Args, ConfigError, main, resolve

SCRIPT = Path(__file__).resolve().parents[1] / "sebulba" / "ppo_envpool.py"
CARTPOLE = dict(env_id="CartPole-v1", local_num_envs=8, num_steps=16, total_timesteps=10_000)


def test_k12_envs_not_divisible_by_learners_names_nearest_values():
    with pytest.raises(ConfigError, match=r"--local-num-envs=6 is not divisible by 4 learner devices; use 4 or 8"):
        resolve(Args(**{**CARTPOLE, "local_num_envs": 6}, learner_device_ids=[0, 1, 2, 3]))


@pytest.mark.parametrize("change, message", [
    (dict(async_batch_size=3), r"--async-batch-size=3 must divide --local-num-envs=8"),
    (dict(async_batch_size=16), r"--async-batch-size=16 must divide"),
    (dict(num_minibatches=3), r"do not split into --num-minibatches=3"),
    (dict(total_timesteps=100), r"--total-timesteps=100 is smaller than one batch \(256"),
    (dict(env_id="CartPol-v1"), r"did you mean CartPole-v1"),
    (dict(env_id="Pong-v5", norm_obs=True), r"--norm-obs and --norm-reward are for vector observations"),
    (dict(eval_interval=5, eval_episodes=0), r"--eval-interval=5 needs --eval-episodes > 0"),
    (dict(eval_episodes=-1), r"--eval-episodes=-1 must be >= 0"),
    (dict(num_steps=0), r"--num-steps=0 must be positive"),
    (dict(learning_rate=-1.0), r"--learning-rate=-1.0 must be positive"),
    (dict(gamma=1.5), r"--gamma=1.5 must be in \(0, 1\]"),
    (dict(gae_lambda=0.0), r"--gae-lambda=0.0 must be in \(0, 1\]"),
    (dict(max_policy_lag=-1), r"--max-policy-lag=-1 must be >= 0"),
    (dict(learner_device_ids=[1, 1]), r"ids must be distinct"),
    (dict(deterministic=True, async_batch_size=4), r"--deterministic steps every env in lockstep"),
    (dict(max_policy_lag=0, async_batch_size=4), r"--max-policy-lag 0 \(synchronous\) steps every env in lockstep"),
    (dict(max_grad_norm=0.0), r"--max-grad-norm=0.0 must be positive"),
    (dict(vf_coef=-0.5), r"--vf-coef=-0.5 must be >= 0"),
])
def test_bad_values_are_refused(change, message):
    with pytest.raises(ConfigError, match=message):
        resolve(Args(**{**CARTPOLE, **change}))


def test_missing_device_is_refused_before_any_thread(tmp_path):
    with pytest.raises(ConfigError, match=r"device id 9 requested but this process has 4 cpu devices; use ids 0..3"):
        main(Args(**CARTPOLE, learner_device_ids=[9]))
    assert not (tmp_path / "runs").exists()


def test_batch_arithmetic():
    s = resolve(Args(**CARTPOLE, actor_device_ids=[0, 1], num_actor_threads=2, learner_device_ids=[2, 3],
                     num_minibatches=4))
    assert (s.num_actor_threads_total, s.num_envs_total, s.batch_size) == (4, 32, 512)
    assert s.envs_per_learner == 16 and s.minibatch_size == 16 * 16 // 4
    assert s.num_updates == 10_000 // 512 and s.async_batch_size == 4
    assert resolve(Args(**CARTPOLE, deterministic=True)).async_batch_size == 8  # lockstep: the whole pool
    assert resolve(Args(**CARTPOLE, max_policy_lag=0)).async_batch_size == 8


def run_cli(*flags):
    return subprocess.run([sys.executable, str(SCRIPT), *flags], capture_output=True, text=True, timeout=120)


def test_cli_help_lists_every_flag():
    out = run_cli("--help")
    assert out.returncode == 0
    for name in Args.__dataclass_fields__:
        assert "--" + name.replace("_", "-") in out.stdout, name


def test_cli_wrong_flag_and_bad_value_exit_nonzero_with_one_clear_line():
    out = run_cli("--num-envs", "8")
    assert out.returncode != 0 and "--num-envs" in out.stderr
    out = run_cli("--env-id", "CartPole-v1", "--local-num-envs", "6", "--learner-device-ids", "0", "1", "2", "3")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == (
        "error: --local-num-envs=6 is not divisible by 4 learner devices; use 4 or 8")
