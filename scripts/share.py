"""Share a trained agent the way the field does: a run directory -> a folder in the Hugging Face
Hub's model-repo layout, played back by scripts/evaluate.py without the run directory, and
optionally pushed to the Hub.

    python scripts/share.py runs/CartPole-v1__ppo_envpool__1__1733000000     # writes shared/<repo name>/
    python scripts/share.py RUN_DIR --upload --hf-entity <user>              # and pushes it to <user>/<repo name>
    python scripts/evaluate.py shared/<repo name>                            # plays the folder
    python scripts/evaluate.py <user>/<repo name>                            # downloads it from the Hub, plays it

The repo name is `{env_id}-{exp_name}-seed{seed}`, as Cleanba and CleanRL name theirs. The folder:

* model.msgpack: the params and observation statistics of the newest checkpoint (or
  --checkpoint N), in flax's msgpack serialisation (`flax.serialization.to_state_dict`);
* config.json: the run's own (its flags, derived sizes, software versions, git commit and the
  script's module), plus "export": the format number, the checkpoint, the env steps trained,
  model.msgpack's SHA-256, the training command and the command that plays the folder;
* eval.json: an evaluation of --episodes games (scripts/evaluate.py's: one game per env of a
  fresh pool, seed --seed, greedy where the run's own final evaluation was);
* summary.json: the run's summary (its final evaluation, where it had one);
* replay.mp4: the first evaluation game, where the task renders (imageio installed; MuJoCo
  tasks need MUJOCO_GL=egl or osmesa); left out otherwise, and the script says why;
* tensorboard/: the run's TensorBoard event files (the Hub shows them under "Training metrics");
* README.md: the model card. YAML metadata the Hub reads (library_name, tags with the env id
  and the algorithm, a model-index entry whose mean_reward is the mean ± std over the
  evaluation's games), then the training command and the command that plays it.

The folder is written fresh: an existing one is refused, or with --overwrite replaced where it
is an earlier export. --upload pushes the folder with huggingface_hub to
`{hf_entity}/{repo name}` (or --repo-id), and the model card's play command names that repo.
Without a token it stops with one line, exit status 2, after writing the folder; an upload that
fails (no network, no such user) stops with one line, exit status 1. A run directory without
a config or a checkpoint gets one line, exit status 2.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if __name__ == "__main__":  # one copy of this module when the other script imports it (its Refused is this one's)
    sys.modules["share"] = sys.modules[__name__]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

FORMAT = 1  # of the folder: a reader refuses another
MODEL_FILE = "model.msgpack"
ALGORITHMS = {"sebulba.ppo_envpool": "PPO", "sebulba.impala_envpool": "IMPALA", "sebulba.ppo_lstm_envpool": "PPO-LSTM",
              "sebulba.sac_envpool": "SAC", "sebulba.pqn_envpool": "PQN"}


def refuse(message: str):
    from evaluate import Refused
    raise Refused(message)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def trained_with(recorded: dict) -> str:
    """"commit <hash> (with uncommitted changes), jax <v>, flax <v>, envpool <v>", from a run's config.json content."""
    software = recorded.get("software") or {}
    git, versions = software.get("git") or {}, software.get("versions") or {}
    commit = f"commit {git['commit'][:12]}" + " (with uncommitted changes)" * bool(git.get("dirty")) \
        if git.get("commit") else "a commit not recorded"
    return f"{commit}, jax {versions.get('jax')}, flax {versions.get('flax')}, envpool {versions.get('envpool')}"


def read_model(folder: Path) -> tuple[dict, dict]:
    """(config.json's content, the state dict of model.msgpack) of a shared folder.

    Raises:
      Refused: a file missing, a format other than this one's, or model.msgpack whose SHA-256 is not the
        recorded one (altered, or partly downloaded).
    """
    import flax.serialization

    missing = [name for name in ("config.json", MODEL_FILE) if not (folder / name).is_file()]
    if missing:
        refuse(f"{folder} lacks {' and '.join(missing)}: it is not a whole folder written by scripts/share.py "
               "(copy or download it again)")
    from evaluate import read_config

    recorded = read_config(folder / "config.json")
    export = recorded.get("export") or {}
    if export.get("format") != FORMAT:
        refuse(f"{folder}/config.json records export format {export.get('format')}, and this checkout reads format "
               f"{FORMAT}: play it with the sebulba it was trained with ({trained_with(recorded)})")
    if sha256(folder / MODEL_FILE) != export.get("model_sha256"):
        refuse(f"{folder}/{MODEL_FILE} is not the file its config.json records (SHA-256 differs): altered or partly "
               "copied; copy or download the folder again")
    return recorded, flax.serialization.msgpack_restore((folder / MODEL_FILE).read_bytes())


def training_command(module, args) -> str:
    """The command line that trains `args` again: the script's flags that differ from its defaults."""
    from sebulba.config import flag, script_flags

    defaults, words = module.Args(), ["python", f"sebulba/{module.__name__.rsplit('.', 1)[-1]}.py"]
    for name in script_flags(module.Args):
        value, default = getattr(args, name), getattr(defaults, name)
        if name == "run_name" or (tuple(value) if isinstance(value, list) else value) == default:  # JSON: lists
            continue
        if isinstance(value, bool) and isinstance(default, bool):
            words.append(flag(name) if value else f"--no-{flag(name)[2:]}")
        elif isinstance(value, (list, tuple)):
            words += [flag(name), *map(str, value)]
        else:
            words += [flag(name), str(value)]
    return shlex.join(words)


def model_card(recorded: dict, result: dict, repo_name: str, train: str, play: str, video: bool) -> str:
    """README.md: YAML metadata (huggingface_hub's ModelCardData) and a body saying what the agent is and how to play it."""
    from huggingface_hub import EvalResult, ModelCardData

    env_id, algorithm = recorded["args"]["env_id"], ALGORITHMS.get(recorded["script"], recorded["script"])
    mean, std = result["return_mean"], result["return_std"]
    data = ModelCardData(library_name="sebulba", model_name=algorithm,
                         tags=[env_id, "reinforcement-learning", "deep-reinforcement-learning", algorithm, "jax",
                               "envpool", "sebulba"],
                         eval_results=[EvalResult(task_type="reinforcement-learning", task_name="reinforcement-learning",
                                                  dataset_type=env_id, dataset_name=env_id, metric_type="mean_reward",
                                                  metric_name="mean_reward", metric_value=f"{mean:.2f} +/- {std:.2f}")])
    export = recorded["export"]
    lines = [
        "---", data.to_yaml(), "---", "",
        f"# {algorithm} on {env_id}: {repo_name}", "",
        f"A {algorithm} agent trained with sebulba's `{recorded['script'].rsplit('.', 1)[-1]}.py` for "
        f"{export['global_step']:,} env steps (checkpoint {export['checkpoint']}). Over {result['episodes']} evaluation "
        f"games ({result['policy']} actions, seed {result['seed']}) its return is {mean:.2f} ± {std:.2f}, its length "
        f"{result['length_mean']:.1f} ± {result['length_std']:.1f} env steps (eval.json).", "",
        *(["[replay.mp4](replay.mp4): the first evaluation game.", ""] if video else []),
        "## Play it", "",
        "In a checkout of sebulba (`pip install -e \".[share]\"`):", "", "```", play, "```", "",
        "## Train it again", "", "```", train, "```", "",
        f"Trained with sebulba at {trained_with(recorded)}; config.json holds every flag and version, tensorboard/ "
        "the training curves.", ""]
    return "\n".join(lines)


def repo_name_of(recorded: dict) -> str:
    """`{env_id}-{exp_name}-seed{seed}` of a run's config.json content, as Cleanba and CleanRL name their repos."""
    args = recorded["args"]
    return f"{str(args['env_id']).replace('/', '_')}-{args.get('exp_name')}-seed{args.get('seed')}"


def export(run_dir: Path, out: Path | None, checkpoint: int | None, episodes: int, seed: int, video: bool,
           repo_id: str | None = None, overwrite: bool = False) -> Path:
    """Write the shared folder of `run_dir` (module docstring) and return its path; its model card's play command
    names `repo_id` where it is known (an upload), else <user>/<repo name>.

    Raises:
      Refused: what scripts/evaluate.py refuses for the run directory; an existing folder at `out` (without
        `overwrite`, or one scripts/share.py did not write).
    """
    import flax.serialization
    import jax

    import evaluate

    if not run_dir.is_dir():
        refuse(f"{run_dir} does not exist: give the run directory of a training run, runs/<run name>")
    if not (run_dir / "checkpoints").is_dir():
        refuse(f"{run_dir} holds no checkpoints/: give the run directory of a training run, runs/<run name>")
    recorded = evaluate.read_config(run_dir / "config.json") if (run_dir / "config.json").exists() else None
    repo_name = repo_name_of(recorded) if recorded else run_dir.name
    out = out or Path("shared") / repo_name
    if out.exists() and any(out.iterdir()):  # a folder is uploaded whole: nothing of an earlier one may stay in it
        ours = (out / "config.json").exists() and "export" in evaluate.read_config(out / "config.json")
        if not overwrite or not ours:
            refuse(f"{out} exists and is not empty: give another --out" + (
                ", or --overwrite to replace that earlier export" if ours else
                " (it is not a folder scripts/share.py wrote, so --overwrite will not delete it)"))
        shutil.rmtree(out)
    module, args, agent, spec, (params, moments), update = evaluate.load(run_dir, checkpoint)
    out.mkdir(parents=True, exist_ok=True)
    state = {"params": flax.serialization.to_state_dict(params), "obs_moments": flax.serialization.to_state_dict(moments)}
    (out / MODEL_FILE).write_bytes(flax.serialization.msgpack_serialize(jax.device_get(state)))
    greedy = bool(getattr(args, "eval_greedy", False))  # as the run's own final evaluation
    replay = out / "replay.mp4" if video else None
    if replay is not None and evaluate.is_mujoco(args.env_id) and os.environ.get("MUJOCO_GL") not in ("egl", "osmesa"):
        print("replay.mp4 left out: rendering a MuJoCo task needs MUJOCO_GL=egl (GPU) or MUJOCO_GL=osmesa (CPU)")
        replay = None
    if replay is not None:
        try:
            import imageio.v2  # noqa: F401
            import imageio_ffmpeg  # noqa: F401
        except ImportError:
            print('replay.mp4 left out: writing it needs imageio and its ffmpeg plugin: pip install -e ".[share]"')
            replay = None
    (out / "replay.mp4").unlink(missing_ok=True)
    result = evaluate.evaluate(module, args, agent, spec, (params, moments), episodes, seed, greedy, replay)
    policy = "greedy" if greedy else "epsilon-greedy" if getattr(agent, "q_network", False) else "sampled"
    result = {"env_id": args.env_id, "checkpoint": update, "seed": seed, "policy": policy, **result}
    result.pop("video", None)
    (out / "eval.json").write_text(json.dumps(result, indent=2))
    if (run_dir / "summary.json").exists():  # this machine's paths stay here: the run directory's own name instead
        here = str(run_dir.absolute())
        (out / "summary.json").write_text((run_dir / "summary.json").read_text().replace(here, f"runs/{run_dir.name}"))
    events = sorted(run_dir.glob("events.out.tfevents.*"))
    if events:
        (out / "tensorboard").mkdir(exist_ok=True)
        for path in events:
            shutil.copyfile(path, out / "tensorboard" / path.name)
    from sebulba.checkpoints import read_meta  # (evaluate.load has read the same checkpoint's state)
    play = f"python scripts/evaluate.py {repo_id or f'<user>/{repo_name}'} --episodes {episodes} --seed {seed}"
    recorded["export"] = {"format": FORMAT, "checkpoint": update,
                          "global_step": read_meta(run_dir / "checkpoints", update)["global_step"],
                          "model_sha256": sha256(out / MODEL_FILE), "repo_name": repo_name,
                          "training_command": training_command(module, args), "play_command": play}
    (out / "config.json").write_text(json.dumps(recorded, indent=2))
    (out / "README.md").write_text(model_card(recorded, result, repo_name, recorded["export"]["training_command"],
                                              play, replay is not None))
    return out


def upload(folder: Path, repo_id: str) -> str:
    """Push `folder` to the Hub model repo `repo_id` (created if missing); its URL.

    Raises:
      Refused: no Hugging Face token (exit status 2).
      SystemExit: the upload failed (exit status 1, one line).
    """
    from huggingface_hub import HfApi, get_token

    if get_token() is None:
        refuse(f"no Hugging Face token: run `hf auth login` (or set HF_TOKEN), then the same command; the folder is "
               f"written: {folder}")
    try:
        api = HfApi()
        api.create_repo(repo_id, repo_type="model", exist_ok=True)
        return api.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="model",
                                 commit_message=f"sebulba: {folder.name}").commit_url
    except Exception as error:  # huggingface_hub's HTTP and connection errors have no common base
        first = str(error).splitlines()[0] if str(error) else ""
        print(f"error: could not upload {folder} to {repo_id} ({type(error).__name__}: {first}); the folder is written",
              file=sys.stderr)
        raise SystemExit(1) from error


def main(argv: list[str] | None = None) -> Path:
    from evaluate import OneLineParser, read_config

    parser = OneLineParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("run_dir", type=Path, help="runs/<run name> of a training run")
    parser.add_argument("--out", type=Path, default=None, help="the folder to write; default shared/<repo name>")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier export at the same folder")
    parser.add_argument("--checkpoint", type=int, default=None, help="update number of the checkpoint; default newest")
    parser.add_argument("--episodes", type=int, default=10, help="evaluation games for eval.json and the model card")
    parser.add_argument("--seed", type=int, default=0, help="the evaluation's env and action seed")
    parser.add_argument("--video", action=argparse.BooleanOptionalAction, default=True,
                        help="replay.mp4 of the first evaluation game, where the task renders")
    parser.add_argument("--upload", action="store_true", help="push the folder to the Hugging Face Hub")
    parser.add_argument("--hf-entity", default=None, help="--upload: the Hub user or organisation")
    parser.add_argument("--repo-id", default=None, help="--upload: the whole repo id; default <hf-entity>/<repo name>")
    cli = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message=".*precision lowered by casting to float32", category=UserWarning)
    if cli.episodes <= 0:
        parser.error(f"--episodes {cli.episodes} must be positive")
    if cli.upload and not (cli.hf_entity or cli.repo_id):
        parser.error("--upload needs --hf-entity <user> (or --repo-id <user>/<name>)")
    if not cli.upload and (cli.hf_entity or cli.repo_id):
        parser.error("--hf-entity and --repo-id name where --upload pushes the folder: add --upload")
    if cli.hf_entity is not None and not re.fullmatch(r"[\w.-]+", cli.hf_entity):
        parser.error(f"--hf-entity {cli.hf_entity!r} is not a Hub user or organisation name (letters, digits, - _ .)")
    if cli.repo_id is not None and not re.fullmatch(r"[\w.-]+/[\w.-]+", cli.repo_id):
        parser.error(f"--repo-id {cli.repo_id!r} is not a Hub repo id: <user>/<name>")
    try:
        import huggingface_hub  # noqa: F401 - the model card's metadata, and --upload
    except ImportError:
        parser.error('scripts/share.py writes the model card (and uploads) with huggingface_hub: pip install -e ".[share]"')
    repo_id = None
    if cli.upload:
        config = cli.run_dir / "config.json"
        repo_id = cli.repo_id or f"{cli.hf_entity}/{repo_name_of(read_config(config)) if config.exists() else ''}"
    folder = export(cli.run_dir, cli.out, cli.checkpoint, cli.episodes, cli.seed, cli.video, repo_id, cli.overwrite)
    result = json.loads((folder / "eval.json").read_text())
    evaluate_py = os.path.relpath(Path(__file__).resolve().parent / "evaluate.py")
    print(f"written: {folder}/ (return {result['return_mean']:.1f} ± {result['return_std']:.1f} over "
          f"{result['episodes']} games; play it: python {evaluate_py} {folder})", flush=True)
    if repo_id:
        print(f"uploaded: {upload(folder, repo_id)}")
    return folder


if __name__ == "__main__":
    from evaluate import run_cli

    run_cli(main)
