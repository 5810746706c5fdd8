"""scripts/share.py on real short runs of every script: the shared folder plays as the run directory
does, its model card parses with huggingface_hub's card tools, a partial or altered folder is
refused in one line, and the upload stops before the network without a token."""

import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tyro
from huggingface_hub import ModelCard

import sebulba.impala_envpool as impala
import sebulba.ppo_envpool as ppo
import sebulba.ppo_lstm_envpool as ppo_lstm
import sebulba.pqn_envpool as pqn
import sebulba.sac_envpool as sac

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("share")]  # one worker: the runs are trained once

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import evaluate  # noqa: E402
import share  # noqa: E402

DISCRETE = ["--env-id", "CartPole-v1", "--local-num-envs", "4", "--num-steps", "8", "--num-actor-threads", "1",
            "--hiddens", "16", "--total-timesteps", "64", "--eval-episodes", "0", "--log-frequency", "1000"]
RUNS = {"ppo": (ppo, [*DISCRETE, "--num-minibatches", "1", "--update-epochs", "1"]),
        "impala": (impala, DISCRETE),
        "ppo_lstm": (ppo_lstm, [*DISCRETE, "--num-minibatches", "1", "--update-epochs", "1", "--lstm-size", "8"]),
        "pqn": (pqn, [*DISCRETE, "--num-minibatches", "1", "--update-epochs", "1"]),
        "sac": (sac, ["--env-id", "Pendulum-v1", "--local-num-envs", "4", "--num-steps", "4", "--num-actor-threads",
                      "1", "--hiddens", "16", "16", "--total-timesteps", "64", "--learning-starts", "16",
                      "--minibatch-size", "16", "--buffer-size", "256", "--eval-episodes", "0", "--log-frequency",
                      "1000"])}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A directory holding runs/<name> of a 2-update run of each script (trained once for the module)."""
    root = tmp_path_factory.mktemp("trained")
    with contextlib.chdir(root):
        for name, (module, flags) in RUNS.items():
            module.main(tyro.cli(module.Args, args=[*flags, "--run-name", name]))
    return root


def shared_run(trained: Path, name: str) -> tuple[Path, Path]:
    """(run directory, its shared folder), both in this test's directory: a copy of the run, and share.py's folder."""
    shutil.copytree(trained / "runs" / name, Path("runs") / name)
    folder = share.main([f"runs/{name}", "--episodes", "3", "--seed", "4", "--no-video"])
    return Path("runs") / name, folder


@pytest.mark.parametrize("name", list(RUNS))
def test_a_shared_folder_plays_as_its_run_directory(trained, name):
    """Same seed, greedy: the folder, without the run directory, plays the same games as the run directory does."""
    run, folder = shared_run(trained, name)
    assert folder == Path("shared") / f"{'Pendulum-v1' if name == 'sac' else 'CartPole-v1'}-{name}_envpool-seed1"
    assert {p.name for p in folder.iterdir()} == {"README.md", "config.json", "eval.json", "model.msgpack",
                                                  "summary.json", "tensorboard"}
    played = evaluate.main([str(run), "--episodes", "3", "--seed", "4", "--greedy", "--json"])
    run.rename("elsewhere")  # the folder stands alone
    again = evaluate.main([str(folder), "--episodes", "3", "--seed", "4", "--greedy", "--json"])
    assert again["returns"] == played["returns"] and again["lengths"] == played["lengths"]
    assert again["checkpoint"] == played["checkpoint"] == json.loads((folder / "config.json").read_text())[
        "export"]["checkpoint"]
    recorded = json.loads((folder / "eval.json").read_text())  # as the run's own final evaluation would play
    assert recorded["episodes"] == 3 and recorded["seed"] == 4
    assert recorded["returns"] == evaluate.main([str(folder), "--episodes", "3", "--seed", "4", "--json"])["returns"]


def test_the_model_card_and_the_folder_say_what_the_agent_is(trained):
    run, folder = shared_run(trained, "ppo")
    card = ModelCard.load(folder / "README.md")  # huggingface_hub's own parser, as the Hub reads it
    result = json.loads((folder / "eval.json").read_text())
    assert card.data.library_name == "sebulba" and {"CartPole-v1", "PPO", "reinforcement-learning"} <= set(card.data.tags)
    (entry,) = card.data.eval_results
    assert (entry.dataset_type, entry.metric_type) == ("CartPole-v1", "mean_reward")
    assert entry.metric_value == f"{result['return_mean']:.2f} +/- {result['return_std']:.2f}"
    config = json.loads((folder / "config.json").read_text())
    train = config["export"]["training_command"]
    assert train.startswith("python sebulba/ppo_envpool.py ") and " --env-id CartPole-v1 --total-timesteps 64 " in train
    assert "--run-name" not in train and "--channels" not in train  # defaults are left out
    assert train in card.content and "python scripts/evaluate.py <user>/CartPole-v1-ppo_envpool-seed1" in card.content
    # The training command trains the same flags again.
    def same(values):  # JSON has lists where Args has tuples
        return {k: tuple(v) if isinstance(v, (list, tuple)) else v for k, v in values.items() if k != "run_name"}
    assert same(tyro.cli(ppo.Args, args=train.split()[2:]).__dict__) == same({**ppo.Args().__dict__, **config["args"]})
    assert sorted(p.name for p in (folder / "tensorboard").iterdir()) == sorted(
        p.name for p in run.glob("events.out.tfevents.*"))


def cli(*argv, env=None):
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def test_a_partial_altered_or_mismatched_folder_is_refused_in_one_line(trained, capsys):
    _, folder = shared_run(trained, "ppo")
    model = (folder / "model.msgpack").read_bytes()
    (folder / "model.msgpack").write_bytes(model[:-1] + bytes([model[-1] ^ 1]))  # one bit
    out = cli(str(ROOT / "scripts" / "evaluate.py"), str(folder))
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        f"error: {folder}/model.msgpack is not the file its config.json records (SHA-256 differs): altered or partly "
        "copied; copy or download the folder again"], out.stderr
    (folder / "model.msgpack").unlink()
    with pytest.raises(SystemExit, match="lacks model.msgpack: it is not a whole folder written by scripts/share.py"):
        evaluate.main([str(folder)])
    (folder / "model.msgpack").write_bytes(model)
    config = json.loads((folder / "config.json").read_text())
    changed = {**config, "args": {**config["args"], "hiddens": [32]}}  # a network this folder's params do not fit
    (folder / "config.json").write_text(json.dumps(changed))
    with pytest.raises(SystemExit, match="model.msgpack does not fit the network sebulba.ppo_envpool builds at this "
                                         "checkout: play it with the sebulba it was trained with \\(commit "):
        evaluate.main([str(folder)])
    (folder / "config.json").write_text(json.dumps({**config, "export": {**config["export"], "format": 99}}))
    with pytest.raises(SystemExit, match="records export format 99, and this checkout reads format 1"):
        evaluate.main([str(folder)])
    software = {**config["software"], "versions": {**config["software"]["versions"], "flax": "0.1.0"}}
    (folder / "config.json").write_text(json.dumps({**config, "software": software}))
    capsys.readouterr()
    evaluate.main([str(folder), "--episodes", "1"])  # it fits: it plays, and says what differs
    assert f"note: {folder} was trained with flax 0.1.0 (here " in capsys.readouterr().err


def test_an_existing_folder_is_not_mixed_into_and_bad_flags_stop_before_anything_is_written(trained):
    """A second export to the same folder is refused (an upload would push the earlier one's files too) unless
    --overwrite replaces that earlier export; a folder share.py did not write is never deleted."""
    run, folder = shared_run(trained, "ppo")
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit, match="exists and is not empty: give another --out, or --overwrite to replace"):
        share.main([str(run), "--episodes", "1", "--no-video"])
    share.main([str(run), "--episodes", "1", "--no-video", "--overwrite"])
    assert not (folder / "notes.txt").exists() and json.loads((folder / "eval.json").read_text())["episodes"] == 1
    Path("mine").mkdir()
    (Path("mine") / "keep.txt").write_text("mine")
    with pytest.raises(SystemExit, match="not a folder scripts/share.py wrote, so --overwrite will not delete it"):
        share.main([str(run), "--out", "mine", "--overwrite"])
    assert (Path("mine") / "keep.txt").exists()
    for argv, message in ((["--hf-entity", "someone"], "add --upload"),
                          (["--upload", "--repo-id", "noslash"], "is not a Hub repo id"),
                          (["--episodes", "0"], "--episodes 0 must be positive")):
        with pytest.raises(SystemExit, match=message):
            share.main([str(run), "--out", "never", *argv])
        assert not Path("never").exists()
    (folder / "config.json").write_text("{broken")
    with pytest.raises(SystemExit, match="config.json is not JSON"):
        evaluate.main([str(folder)])


def test_the_upload_without_a_token_stops_in_one_line_with_the_folder_written(trained, tmp_path):
    shutil.copytree(trained / "runs" / "ppo", Path("runs") / "ppo")
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_TOKEN": "", "HF_HUB_OFFLINE": "0"}
    env_clean = {k: v for k, v in {**os.environ, **env}.items() if k != "HF_TOKEN"}
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "share.py"), "runs/ppo", "--episodes", "2",
                          "--no-video", "--upload", "--hf-entity", "someone"], capture_output=True, text=True,
                         timeout=300, env=env_clean)
    folder = Path("shared/CartPole-v1-ppo_envpool-seed1")
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        "error: no Hugging Face token: run `hf auth login` (or set HF_TOKEN), then the same command; the folder is "
        f"written: {folder}"], out.stderr
    assert (folder / "model.msgpack").exists() and (folder / "README.md").exists()
    assert "python scripts/evaluate.py someone/CartPole-v1-ppo_envpool-seed1 " in (folder / "README.md").read_text()
    no_entity = cli(str(ROOT / "scripts" / "share.py"), "runs/ppo", "--upload")
    assert no_entity.returncode == 2 and "--upload needs --hf-entity" in no_entity.stderr
