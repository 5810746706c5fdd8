"""scripts/evaluate.py on checkpoints of short real CartPole runs of both scripts."""

import contextlib
import dataclasses
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import envpool
import tyro

import sebulba.impala_envpool as impala
import sebulba.ppo_envpool as ppo
import sebulba.ppo_lstm_envpool as ppo_lstm
from sebulba import evaluation
from sebulba.checkpoints import Checkpointer
from sebulba.config import ConfigError, check_wandb_login
from sebulba.devices import Placement
from sebulba.evaluation import eval_seed
from sebulba.rundir import script_module
from sebulba.threads import ParamsSlot

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import evaluate

FLAGS = ["--env-id", "CartPole-v1", "--local-num-envs", "8", "--num-steps", "32", "--num-actor-threads", "1",
         "--hiddens", "64", "64", "--log-frequency", "1000"]


def train(module, name: str, total: int, *flags: str) -> Path:
    module.main(tyro.cli(module.Args, args=[*FLAGS, *flags, "--total-timesteps", str(total),
                                                   "--run-name", name, "--checkpoint-interval", "2"]))
    return Path("runs") / name


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory) -> Path:
    """A 2-update CartPole run (absolute path) whose config.json says it trained with --track;
    the training itself logged only to TensorBoard (W&B is not what the tests below look at)."""
    root = tmp_path_factory.mktemp("tracked")
    with contextlib.chdir(root):
        ppo.main(ppo.Args(env_id="CartPole-v1", local_num_envs=4, num_steps=8, num_actor_threads=1, hiddens=(8,),
                          num_minibatches=1, update_epochs=1, total_timesteps=4 * 8 * 2, run_name="tracked",
                          checkpoint_interval=2, eval_episodes=0, log_frequency=1000))
    run = root / "runs" / "tracked"
    config = json.loads((run / "config.json").read_text())
    config["args"]["track"] = True
    (run / "config.json").write_text(json.dumps(config))
    return run


def test_a_run_trained_with_track_evaluates_without_a_wandb_login(tracked_run, tmp_path, monkeypatch):
    """Evaluating is not logging: no W&B login is looked for (it was, through the training
    script's `resolve`, which stopped with ConfigError on a machine without one)."""
    for name in ("WANDB_API_KEY", "WANDB_MODE", "NETRC", "WANDB_CONFIG_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # an empty home: no ~/.netrc, no W&B settings
    with pytest.raises(ConfigError, match="no W&B login"):  # what a training run with --track would meet here
        check_wandb_login()
    result = evaluate.main([str(tracked_run), "--episodes", "2", "--json"])
    assert result["checkpoint"] == 2 and len(result["returns"]) == 2


def test_script_module_names_the_script_imported_or_run_as_a_file(monkeypatch):
    assert script_module(ppo.Args()) == "sebulba.ppo_envpool"
    assert script_module(ppo_lstm.Args()) == "sebulba.ppo_lstm_envpool"  # its own Args, not PPO's it extends
    # `python sebulba/sac_envpool.py`: the script's Args is defined in __main__, the file names it
    main = type(sys)("__main__")
    main.__file__ = "/checkout/sebulba/sac_envpool.py"
    monkeypatch.setitem(sys.modules, "__main__", main)
    args = dataclasses.make_dataclass("Args", [], bases=(ppo.Args,), namespace={"__module__": "__main__"})
    assert script_module(args()) == "sebulba.sac_envpool"


def test_evaluate_imports_the_script_config_json_names(tracked_run, tmp_path, monkeypatch):
    """Not the flags only one script has: a new script's run loaded PPO's Agent that way."""
    run = shutil.copytree(tracked_run, tmp_path / "run")
    config = json.loads((run / "config.json").read_text())
    assert config["script"] == "sebulba.ppo_envpool"
    # A script of PPO's functions under another name is the one loaded.
    (tmp_path / "copy_of_ppo.py").write_text("from sebulba.ppo_envpool import *  # noqa: F403\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    (run / "config.json").write_text(json.dumps(config | {"script": "copy_of_ppo"}))
    assert evaluate.load(run, None)[0].__name__ == "copy_of_ppo"
    (run / "config.json").write_text(json.dumps(config | {"script": "sebulba.no_such_script"}))
    with pytest.raises(SystemExit) as error:
        evaluate.main([str(run), "--episodes", "2"])
    assert "names the script sebulba.no_such_script, which cannot be imported" in str(error.value)
    assert "has sebulba/no_such_script.py" in str(error.value) and "\n" not in str(error.value)
    del config["script"]  # a run written before config.json named its script: told apart by its flags
    (run / "config.json").write_text(json.dumps(config))
    module, *_ = evaluate.load(run, None)
    assert module is ppo and evaluate.main([str(run), "--episodes", "2", "--json"])["checkpoint"] == 2


def test_json_into_a_pipe_closed_early_ends_quietly(tracked_run):
    """`evaluate.py RUN --json | head -c 400`: the reader is gone when the result is printed (here
    before the first byte, so the write must fail); the script ends as a well-behaved pipeline
    writer does, exit status 0 and no traceback (it ended in a BrokenPipeError raised through
    wandb's console capture)."""
    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "evaluate.py"), str(tracked_run), "--episodes", "2",
                             "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    _, err = proc.communicate(timeout=120)
    err = err.decode()
    assert proc.returncode == 0 and "Traceback" not in err and "BrokenPipeError" not in err, err


def test_printed_numbers_match_a_recomputation_from_the_same_seed(capsys):
    run = train(ppo, "ppo", 8 * 32 * 12, "--num-minibatches", "1", "--update-epochs", "20", "--learning-rate", "1e-3",
                "--ent-coef", "0.0")
    capsys.readouterr()  # the training run's console
    result = evaluate.main([str(run), "--episodes", "5", "--seed", "3", "--greedy", "--json"])
    assert json.loads(capsys.readouterr().out) == result
    assert result["checkpoint"] == 12 and result["policy"] == "greedy"
    # Recompute without the script's code path: restore the saved params through the training
    # shared checkpointer, step a plain EnvPool pool with the same seed, argmax op by op.
    args = ppo.Args(**json.loads((run / "config.json").read_text())["args"])
    agent = ppo.Agent(2, (), (64, 64), False)
    device = jax.devices()[0]
    placement = Placement([device], [device])
    like, _ = ppo.make_train_state(args, ppo.resolve(args), agent.init(jax.random.PRNGKey(0), np.zeros((1, 4))),
                                   placement)
    params = Checkpointer(run / "checkpoints").restore_state(12, like).params
    envs = envpool.make("CartPole-v1", env_type="gymnasium", num_envs=5, batch_size=5, seed=3, num_threads=2)
    obs, _ = envs.reset()
    returns, lengths, finished = np.zeros(5), np.zeros(5, int), np.zeros(5, bool)
    while not finished.all():
        logits = np.asarray(agent.apply(params, obs)[0])
        obs, reward, terminated, truncated, _ = envs.step(logits.argmax(axis=1).astype(np.int32))
        returns[~finished] += reward[~finished]
        lengths[~finished] += 1
        finished |= terminated | truncated
    assert result["returns"] == returns.tolist() and result["lengths"] == lengths.tolist()
    assert result["return_mean"] == pytest.approx(returns.mean()) and result["return_std"] == pytest.approx(returns.std())
    assert "success_rate" not in result  # CartPole defines no success (MiniGrid's: tests/test_envpool_runs.py)
    assert evaluate.main([str(run), "--episodes", "5", "--seed", "3", "--greedy", "--json"]) == result  # same numbers
    evaluate.main([str(run), "--episodes", "5", "--checkpoint", "10", "--greedy"])  # an older checkpoint by number
    assert "checkpoint 10, greedy actions, 5 episodes: return" in capsys.readouterr().out


def test_eval_thread_logs_eval_metrics_and_the_final_evaluation_matches_evaluate_py(capsys, monkeypatch):
    import sebulba.learner
    record = sebulba.learner.Bookkeeping.record
    # 0.2 s an update: on a loaded machine the 16 short updates could otherwise all pass
    # during the eval thread's first evaluation (which compiles its policy).
    monkeypatch.setattr(sebulba.learner.Bookkeeping, "record", lambda *a: (time.sleep(0.2), record(*a))[1])
    run = train(ppo, "evals", 8 * 32 * 16, "--eval-interval", "2", "--eval-episodes", "3")
    summary = json.loads((run / "summary.json").read_text())
    events = EventAccumulator(str(run))
    events.Reload()
    assert {"eval/episodic_return_mean", "eval/episodic_return_std", "eval/episodic_length_mean", "eval/time_s",
            "eval/params_version", "eval/global_step"} <= set(events.Tags()["scalars"])
    assert "eval/success_rate" not in events.Tags()["scalars"] and "success_rate" not in summary["final_eval"]
    versions = [int(e.value) for e in events.Scalars("eval/params_version")]
    periodic, final = versions[:-1], versions[-1]
    assert final == 16 and len(periodic) >= 2, versions  # the eval thread's, then the final evaluation
    assert all(2 <= v < 16 for v in periodic) and periodic == sorted(set(periodic))
    assert [e.value for e in events.Scalars("eval/global_step")] == [v * 8 * 32 for v in versions]
    out = capsys.readouterr().out
    assert f"eval at update {periodic[0]} (sampled actions): return" in out
    assert "final eval at update 16 (sampled actions): return" in out
    # The final evaluation is scripts/evaluate.py's protocol with the eval pool's seed, recorded in the summary.
    assert summary["final_eval"]["params_version"] == 16 and summary["final_eval"]["seed"] == eval_seed(1)
    again = evaluate.main([str(run), "--episodes", "3", "--seed", str(summary["final_eval"]["seed"]), "--json"])
    assert summary["final_eval"]["episodic_return_mean"] == pytest.approx(again["return_mean"])
    assert summary["final_eval"]["episodic_length_mean"] == pytest.approx(again["length_mean"])


def test_impala_runs_and_bad_run_dirs(tmp_path):
    run = train(impala, "impala", 8 * 32 * 2)
    assert json.loads((run / "config.json").read_text())["script"] == "sebulba.impala_envpool"
    result = evaluate.main([str(run), "--episodes", "3"])
    assert result["policy"] == "sampled" and len(result["returns"]) == 3
    assert result["returns"] == [float(n) for n in result["lengths"]]  # CartPole pays 1 per step
    with pytest.raises(SystemExit, match="has checkpoints \\[2\\], not 7"):
        evaluate.main([str(run), "--checkpoint", "7"])
    with pytest.raises(SystemExit, match="has no config.json"):
        evaluate.main([str(tmp_path)])
    with pytest.raises(SystemExit, match="is not a directory"):
        evaluate.main([str(tmp_path / "missing")])
    for episodes, recorded in (("3", "0"), ("2", "5")):
        with pytest.raises(SystemExit) as error:  # argparse: usage and one line on stderr, exit status 2
            evaluate.main([str(run), "--episodes", episodes, "--video", "v.mp4", "--video-episodes", recorded])
        assert error.value.code == 2 and not Path("v.mp4").exists()


def frames_in(path: Path) -> int:
    import imageio.v2 as imageio
    with imageio.get_reader(path) as reader:
        return reader.count_frames()


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")  # imageio starts ffmpeg: fork + exec at once
@pytest.mark.parametrize("env_id", ["CartPole-v1", "Breakout-v5"])
def test_video_has_one_frame_per_step_of_the_recorded_episodes(env_id, capsys):
    module = ppo
    # Breakout trains on a 3-device learner mesh: evaluation restores it onto one device.
    learners = ["1", "2", "3"] if env_id == "Breakout-v5" else ["0"]
    tiny = ["--env-id", env_id, "--local-num-envs", "6", "--num-steps", "8", "--num-actor-threads", "1",
            "--num-minibatches", "1", "--update-epochs", "1", "--channels", "4", "8", "--hiddens", "16",
            "--learner-device-ids", *learners, "--total-timesteps", "48", "--run-name", "tiny", "--log-frequency",
            "1000", "--eval-episodes", "0"]
    module.main(tyro.cli(module.Args, args=tiny))
    capsys.readouterr()
    video = Path("videos") / f"{env_id}.mp4"
    # Sampled actions (the default): an untrained greedy Breakout policy may never press FIRE.
    recorded = 2 if env_id == "CartPole-v1" else 1  # (a Breakout game is hundreds of frames to encode)
    result = evaluate.main(["runs/tiny", "--episodes", str(recorded + 1), "--video", str(video), "--video-episodes",
                            str(recorded)])
    assert f"video: {video} ({result['video_frames']} frames)" in capsys.readouterr().out
    assert result["video_frames"] == sum(n + 1 for n in result["lengths"][:recorded])  # first obs + each step
    assert frames_in(video) == result["video_frames"]
    if env_id == "CartPole-v1":  # --video with no path: under the run directory, the path printed
        again = evaluate.main(["runs/tiny", "--episodes", "2", "--seed", "5", "--video"])
        default = Path("runs/tiny/videos/update1_seed5_sampled.mp4")
        assert f"video: {default} (" in capsys.readouterr().out and again["video"] == str(default)
        assert frames_in(default) == again["video_frames"] == again["lengths"][0] + 1


def test_an_evaluation_that_ends_after_the_last_update_is_still_logged(monkeypatch, capsys):
    """The eval thread's evaluation of update 6 of 8 takes longer than the rest of training (and the
    final evaluation): its result arrives when the learner has stopped looking, and is logged."""
    real = evaluation.Evaluator.__call__

    def slow(self, params, stop):
        result = real(self, params, stop)
        if threading.current_thread().name == "evaluator":  # not the final evaluation (the learner's)
            time.sleep(3)
        return result

    monkeypatch.setattr(evaluation.Evaluator, "__call__", slow)
    publish = ParamsSlot.publish

    def publish_and_let_the_evaluator_wake(self, version, params):  # a busy machine must not let 7 and 8 overtake it
        publish(self, version, params)
        if version == 6:
            time.sleep(1)

    monkeypatch.setattr(ParamsSlot, "publish", publish_and_let_the_evaluator_wake)
    run = train(ppo, "late", 8 * 32 * 8, "--eval-interval", "6", "--eval-episodes", "2")
    out = capsys.readouterr().out
    assert "eval at update 6 (sampled actions): return" in out and "finished after the last update" in out
    events = EventAccumulator(str(run)).Reload()
    assert sorted(int(e.value) for e in events.Scalars("eval/params_version")) == [6, 8]  # periodic, final


def test_runs_with_consecutive_seeds_evaluate_on_disjoint_env_seeds_and_start_states():
    """EnvPool seeds a pool's envs base, base + 1, ...: evaluation bases one apart (the runs'
    --seed plus an offset) shared all but one env between --seed 1 and 2, so their final
    evaluations replayed the same start states. Spread, the 100-episode pools of seeds 1 to 5
    share no env seed, and Pendulum's start angles of seeds 1 and 2 differ everywhere."""
    ranges = [set(range(eval_seed(s), eval_seed(s) + 100)) for s in range(1, 6)]
    assert all(not a & b for i, a in enumerate(ranges) for b in ranges[i + 1:])
    assert eval_seed(0) == evaluation.EVAL_SEED_OFFSET and 0 <= eval_seed(2**40) < 2**31
    starts = []
    for seed in (1, 2):
        pool = envpool.make("Pendulum-v1", env_type="gymnasium", num_envs=10, seed=eval_seed(seed))
        obs, _ = pool.reset()
        pool.close()
        starts.append(np.arctan2(obs[:, 1], obs[:, 0]))
    assert not np.isclose(starts[0][:, None], starts[1][None, :]).any()
