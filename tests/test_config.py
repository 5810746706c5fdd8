"""Bad configuration is refused before any thread starts, with one line saying what to change (Mava#1122, Stoix#66).

The shared flags and batch arithmetic (sebulba/config.py) are tested on `RunFlags` alone; each
script's own hyperparameters through its `resolve`.
"""

import contextlib
import dataclasses
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import wandb

from sebulba import impala_envpool as impala
from sebulba import ppo_lstm_envpool as ppo_lstm
from sebulba import ppo_envpool as ppo
from sebulba import pqn_envpool as pqn
from sebulba import sac_envpool as sac
from sebulba.config import ConfigError, RunFlags, resolve_run

SCRIPTS = Path(__file__).resolve().parents[1] / "sebulba"
CARTPOLE = dict(env_id="CartPole-v1", local_num_envs=8, total_timesteps=10_000)


def test_envs_not_divisible_by_learners_names_nearest_values():
    with pytest.raises(ConfigError, match=r"--local-num-envs=6 is not divisible by 4 learner devices; use 4 or 8"):
        resolve_run(RunFlags(**{**CARTPOLE, "local_num_envs": 6}, learner_device_ids=[0, 1, 2, 3]), num_steps=16)


@pytest.mark.parametrize("change, message", [
    (dict(async_batch_size=3), r"--async-batch-size=3 must divide --local-num-envs=8"),
    (dict(async_batch_size=16), r"--async-batch-size=16 must divide"),
    (dict(total_timesteps=100), r"--total-timesteps=100 is smaller than one batch \(256"),
    (dict(env_id="CartPol-v1"), r"did you mean CartPole-v1"),
    (dict(env_id="Pong-v5", norm_obs=True), r"--norm-obs and --norm-reward are for vector observations"),
    (dict(eval_interval=5, eval_episodes=0), r"--eval-interval=5 needs --eval-episodes > 0"),
    (dict(eval_episodes=-1), r"--eval-episodes=-1 must be >= 0"),
    (dict(local_num_envs=0), r"--local-num-envs=0 must be positive"),
    (dict(stall_timeout_s=float("nan")), r"--stall-timeout-s=nan must be positive"),
    (dict(max_policy_lag=-1), r"--max-policy-lag=-1 must be >= 0"),
    (dict(learner_device_ids=[1, 1]), r"ids must be distinct"),
    (dict(actor_device_ids=[]), r"--actor-device-ids and --learner-device-ids each need at least one id"),
    (dict(deterministic=True, async_batch_size=4), r"--deterministic steps every env in lockstep"),
    (dict(max_policy_lag=0, async_batch_size=4), r"--max-policy-lag 0 \(synchronous\) steps every env in lockstep"),
    (dict(num_env_threads=-1), r"--num-env-threads=-1 must be >= 0"),  # EnvPool aborted the process (exit 134)
    (dict(run_name="../escape"), r"--run-name '../escape' must name one directory inside runs/"),
    (dict(run_name="a/b"), r"--run-name 'a/b' must name one directory inside runs/"),
    (dict(run_name=".."), r"must name one directory inside runs/"),
])
def test_bad_shared_values_are_refused(change, message):
    with pytest.raises(ConfigError, match=message):
        resolve_run(RunFlags(**{**CARTPOLE, **change}), num_steps=16)


@pytest.mark.parametrize("change, message", [
    (dict(num_minibatches=3), r"do not split into --num-minibatches=3"),
    (dict(num_steps=0), r"--num-steps=0 must be positive"),
    (dict(learning_rate=-1.0), r"--learning-rate=-1.0 must be positive"),
    (dict(gamma=1.5), r"--gamma=1.5 must be in \(0, 1\]"),
    (dict(gae_lambda=0.0), r"--gae-lambda=0.0 must be in \(0, 1\]"),
    (dict(max_grad_norm=0.0), r"--max-grad-norm=0.0 must be positive"),
    (dict(vf_coef=-0.5), r"--vf-coef=-0.5 must be >= 0"),
    (dict(total_timesteps=100), r"--total-timesteps=100 is smaller than one batch \(256"),  # the shared checks too
    (dict(clip_coef=-0.1), r"--clip-coef=-0.1 must be positive"),
    (dict(env_id="Breakout-v5", channels=()), r"the IMPALA ResNet needs at least one width in each"),
    (dict(env_id="Breakout-v5", hiddens=()), r"--channels 16 32 32 --hiddens : the IMPALA ResNet"),
    (dict(atari_encoder="nat"), r"^--atari-encoder nat: use one of impala, nature$"),
    (dict(env_id="Breakout-v5", atari_encoder="nature", hiddens=()),
     r"^--hiddens is empty: the Nature CNN needs at least one dense layer \(the paper's: 512\)$"),
])
def test_bad_ppo_values_are_refused(change, message):
    with pytest.raises(ConfigError, match=message):
        ppo.resolve(ppo.Args(**{**CARTPOLE, "num_steps": 16, **change}))


@pytest.mark.parametrize("module", [ppo, impala, ppo_lstm])
def test_a_mistyped_env_id_is_named_before_envpool_is_asked_about_it(module):
    """Each script's own checks (the network's, say) ask EnvPool about the task: the id is checked first."""
    with pytest.raises(ConfigError, match=r"^--env-id CartPol-v1 is not an EnvPool task; did you mean CartPole-v1"):
        module.resolve(module.Args(**{**CARTPOLE, "env_id": "CartPol-v1"}))


def test_missing_device_is_refused_before_any_thread(tmp_path):
    with pytest.raises(ConfigError, match=r"device id 9 requested but this process has 4 cpu devices; use ids 0..3"):
        ppo.main(ppo.Args(**CARTPOLE, num_steps=16, learner_device_ids=[9]))
    assert not (tmp_path / "runs").exists()


def test_track_without_a_wandb_login_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_SERVICE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc, no wandb settings
    monkeypatch.setenv("NETRC", str(tmp_path / ".netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    try:
        with pytest.raises(ConfigError, match=r"^--track found no W&B login: run `wandb login`.*WANDB_MODE=offline"):
            ppo.main(ppo.Args(**CARTPOLE, num_steps=16, track=True))
    finally:
        wandb.teardown()  # the lookup set up W&B's process-wide settings with these variables: later tests log offline
    assert not (tmp_path / "runs").exists() and not (tmp_path / "wandb").exists()
    monkeypatch.setenv("WANDB_MODE", "offline")  # logging locally needs no login
    ppo.resolve(ppo.Args(**CARTPOLE, num_steps=16, track=True))


def test_batch_arithmetic():
    flags = dict(**CARTPOLE, actor_device_ids=[0, 1], num_actor_threads=2, learner_device_ids=[2, 3])
    s = resolve_run(RunFlags(**flags), num_steps=16)
    assert (s.num_actor_threads_total, s.num_envs_total, s.batch_size) == (4, 32, 512)
    assert s.envs_per_learner == 16 and s.num_updates == 10_000 // 512 and s.async_batch_size == 4
    assert resolve_run(RunFlags(**CARTPOLE, deterministic=True), 16).async_batch_size == 8  # lockstep: the whole pool
    assert resolve_run(RunFlags(**CARTPOLE, max_policy_lag=0), 16).async_batch_size == 8
    assert ppo.resolve(ppo.Args(**flags, num_steps=16, num_minibatches=4)).minibatch_size == 16 * 16 // 4


def run_cli(script, *flags):
    return subprocess.run([sys.executable, str(SCRIPTS / script), *flags], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "COLUMNS": "400"})


class Terminal(io.StringIO):
    encoding = "utf-8"  # as a script's own stdout here; tyro draws its help's boxes in ASCII on other streams


def cli(module, *flags) -> tuple[int, str, str]:
    """A script's command line in this process, as its `__main__` runs it (`cli`): (exit code,
    stdout, stderr). A fresh process per case would pay JAX's import each time;
    test_help_piped_into_head_ends_quietly and the device-id case run the files themselves."""
    stdout, stderr = Terminal(), Terminal()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            code = module.cli(list(flags))
        except SystemExit as exit:  # tyro: --help, an unknown flag
            code = exit.code
    return code, stdout.getvalue(), stderr.getvalue()


@pytest.mark.parametrize("script, module", [("ppo_envpool.py", ppo), ("impala_envpool.py", impala),
                                            ("ppo_lstm_envpool.py", ppo_lstm), ("sac_envpool.py", sac),
                                            ("pqn_envpool.py", pqn)])
def test_cli_help_lists_every_flag_with_its_help_line(script, module, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")
    code, stdout, _ = cli(module, "--help")
    assert code == 0
    text = " ".join(stdout.split())
    fields = {f.name: f for f in dataclasses.fields(module.Args)}  # (ClassVars such as SAC's flag_hints are not)
    hidden = {name for name, f in fields.items() if "Suppress" in str(f.type)}  # not a flag of this script
    docs = {name: f for name, f in fields.items() if name not in hidden}
    for name in docs:
        assert re.search(rf"--{name.replace('_', '-')}[ ,]", text), name
    for name in hidden:
        assert not re.search(rf"--{name.replace('_', '-')}[ ,]", text), name
    # Every field's docstring is one line, and it is the flag's help, whole and unbroken: with the
    # terminal 400 columns wide no help wraps, so a flag's entry spans at most two lines (the
    # second when the flag's name is too long to share one with its help).
    # The script first (its redeclared fields win), then what its Args builds on.
    source = "\n".join(Path(f).read_text() for f in (SCRIPTS / script, SCRIPTS / "ppo_envpool.py", SCRIPTS / "config.py"))
    for name in docs:
        help_line = re.search(rf"\n    {name}: [^\n]*\n    \"\"\"([^\n]*)\"\"\"\n", source).group(1)
        assert " ".join(help_line.split()) in text, (name, help_line)
    entries = re.split(r"\n│ (?=-)", stdout.split("╭─ options")[1].split("╰")[0])[1:]
    assert len(entries) == len(docs) + 1  # and --help
    for entry in entries:
        assert entry.rstrip().count("\n") <= 1, entry


@pytest.mark.parametrize("module", [ppo, impala])
def test_cli_mistyped_env_id_is_one_line_with_suggestions(module):
    code, _, stderr = cli(module, "--env-id", "CartPol-v1")
    assert code == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "error: --env-id CartPol-v1 is not an EnvPool task; did you mean CartPole-v1, "), stderr
    assert not Path("runs").exists()


@pytest.mark.slow
def test_help_piped_into_head_ends_quietly():
    out = subprocess.run(f"{sys.executable} {SCRIPTS / 'ppo_envpool.py'} --help | head -2", shell=True,
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.startswith("usage:") and out.stderr == ""


def test_cli_wrong_flag_and_bad_value_exit_nonzero_with_one_clear_line():
    code, _, stderr = cli(ppo, "--num-envs", "8")
    assert code != 0 and "--num-envs" in stderr
    code, _, stderr = cli(ppo, "--env-id", "CartPole-v1", "--local-num-envs", "6", "--learner-device-ids", "0", "1",
                          "2", "3")
    assert code == 2
    assert stderr.strip().splitlines()[-1] == "error: --local-num-envs=6 is not divisible by 4 learner devices; use 4 or 8"


@pytest.mark.parametrize("module, given", [(pqn, ["--atari-protocol", "machado"]), (ppo, ["--atari_protocol=cleanrl"]),
                                           (impala, ["--episodic-life", "False"]),
                                           (ppo_lstm, ["--episodic-life=True"])])
def test_an_atari_flag_on_a_task_that_is_not_atari_is_refused(module, given):
    """--atari-protocol and --episodic-life change nothing outside Atari: typed there, one line, exit 2."""
    code, _, stderr = cli(module, "--env-id", "CartPole-v1", *given)
    name = given[0].split("=")[0].replace("_", "-")
    assert code == 2 and stderr.strip().splitlines() == [
        f"error: {name} is for Atari tasks (*-v5); CartPole-v1 is not one: drop the flag"], stderr


@pytest.mark.parametrize("given", [["--procgen-num-levels", "200"], ["--procgen_start_level=5"]])
def test_a_procgen_flag_on_a_task_that_is_not_procgen_is_refused(given):
    code, _, stderr = cli(ppo, "--env-id", "Breakout-v5", *given)
    name = given[0].split("=")[0].replace("_", "-")
    assert code == 2 and stderr.strip().splitlines() == [
        f"error: {name} is for Procgen tasks; Breakout-v5 is not one: drop the flag"], stderr


def test_config_json_records_that_the_atari_protocol_does_not_apply():
    assert resolve_run(RunFlags(env_id="CartPole-v1", local_num_envs=8), 16).atari_protocol is None
    assert resolve_run(RunFlags(env_id="Pong-v5", local_num_envs=8, atari_protocol="machado"), 16).atari_protocol == (
        "machado")


@pytest.mark.parametrize("module, given, meant", [
    (sac, "--learning-rate", "--policy-lr (the actor's) and --q-lr (the critics' and the temperature's)"),
    (sac, "--learnin-starts", "--learning-starts"), (ppo, "--num-envs", "--local-num-envs (envs per actor thread)"),
    (ppo, "--policy-lr", "--learning-rate"), (impala, "--learning_rte", "--learning-rate"),
    (pqn, "--eps-finish", "--end-e"), (ppo, "--lr", "--learning-rate"),
    (pqn, "--norm-obs", "nothing: PQN normalises no observation, as its sources (LayerNorm scales the features)")])
def test_an_unknown_flag_is_one_line_naming_the_flags_meant(module, given, meant):
    code, _, stderr = cli(module, "--env-id", "CartPole-v1", given, "1")
    assert code == 2 and stderr.strip().splitlines() == [
        f"error: {module.__name__.split('.')[-1]}.py has no flag {given.replace('_', '-')}; did you mean {meant}? "
        "(--help lists them)"], stderr


def test_every_spelling_of_a_real_flag_passes_the_unknown_flag_check():
    from sebulba.runtime import unknown_flag
    assert unknown_flag(ppo.Args, ["--num_steps", "8", "--no-norm-adv", "--norm-adv=False", "--env-id=x", "-h"]) is None
    assert unknown_flag(sac.Args, ["--no-autotune", "--no-save-buffer"]) is None
    assert unknown_flag(sac.Args, ["--norm-obs", "True"]) is not None  # hidden: not a flag of SAC's
    assert unknown_flag(pqn.Args, ["--norm-reward", "True"]) is not None  # nor of PQN's
    assert unknown_flag(ppo.Args, ["--no-seed"]) is not None  # --no- only for switches
    assert unknown_flag(ppo.Args, ["--read-mission", "False"]) is None  # bool | None: takes a value
    assert unknown_flag(ppo.Args, ["--no-read-mission"]) == (  # and has no --no- form
        "ppo_envpool.py has no flag --no-read-mission; did you mean --read-mission or --norm-reward? (--help lists them)")


def test_a_switch_given_a_value_says_how_to_write_it():
    """`--anneal-lr False` (argparse-era CleanRL) is two tokens to tyro: the switch and a stray
    "False", which tyro answers with a boxed "Unrecognized options: False"."""
    from sebulba.runtime import unknown_flag
    assert unknown_flag(pqn.Args, ["--env-id", "Breakout-v5", "--anneal-lr", "False"]) == (
        "--anneal-lr is a switch and takes no value: write --anneal-lr or --no-anneal-lr, "
        "not --anneal-lr False (or --anneal-lr=False)")
    assert unknown_flag(pqn.Args, ["--anneal-lr", "--seed", "2"]) is None


@pytest.mark.slow
def test_cli_device_ids_beyond_the_virtual_cpu_devices_are_one_line():
    """In a process of its own: how many virtual devices JAX may make is settled before its backend starts."""
    out = run_cli("ppo_envpool.py", "--env-id", "CartPole-v1", "--learner-device-ids", "99")  # a typo for 9?
    assert out.returncode == 2 and out.stderr.strip().splitlines()[-1] == (
        "error: device id 99 requested but without an accelerator at most 64 virtual CPU devices are made; "
        "use ids 0..63")
