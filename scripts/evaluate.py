"""Evaluate a trained agent: N full episodes on a fresh EnvPool pool, raw episodic returns.

    python scripts/evaluate.py runs/CartPole-v1__ppo_envpool__1__1733000000
    python scripts/evaluate.py RUN_DIR --episodes 32 --greedy --seed 7 --json

Works for runs of any sebulba script with `Args`, `make_agent`, `init_params`, `resolve` and
`make_train_state` (sebulba/ppo_envpool.py, sebulba/impala_envpool.py, sebulba/ppo_lstm_envpool.py,
sebulba/sac_envpool.py: its actor, the mean action with --greedy; sebulba/pqn_envpool.py: ε-greedy with the
run's --end-e, the argmax of the Q-values with --greedy):
the script is the module that RUN_DIR/config.json names under "script" (runs written before it
had one: told apart by their saved flags). An LSTM agent's state starts from zeros in each env,
and again after each life loss for a run trained with --episodic-life, where training restarted
it. Loads RUN_DIR/config.json and the newest checkpoint (or --checkpoint N), imports that script,
rebuilds the network, and runs one episode in each of N envs of a fresh pool with the
training protocol's env settings (Atari: the run's --atari-protocol and --episodic-life, so
FIRE after a life loss is pressed where training had it pressed; an episode is a whole game
all the same, its lives summed).
Taking the first episode of each env does not favour short episodes. Actions are drawn
from the policy, as in training, or with --greedy are its mode (argmax of the logits; the
Gaussian mean, clipped to the action bounds); without either flag, as the run's own final
evaluation did (its --eval-greedy: on for PQN, off for the others). Observations are normalised with the statistics saved in the
checkpoint when the run used --norm-obs. Prints the mean ±
standard deviation of the raw (unclipped) return and of the length in env steps (Atari:
frames = 4x), or a JSON object with --json. --video [PATH] writes the first --video-episodes
episodes as one mp4 (EnvPool's rgb_array frames; imageio with ffmpeg). A run directory without a config or the named
checkpoint, or whose script cannot be imported, ends with one line saying what is there, exit status 2.

RUN_DIR may also be a folder written by scripts/share.py, or a Hugging Face Hub repo id
(<user>/<name>) holding one, downloaded first (docs/evaluation.md, "Sharing a trained agent").
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys
import warnings
from pathlib import Path

import flax.serialization
import jax
import numpy as np
import orbax.checkpoint as ocp

ROOT = Path(__file__).resolve().parents[1]
if __name__ == "__main__":  # one copy of this module when the other script imports it (its Refused is this one's)
    sys.modules["evaluate"] = sys.modules[__name__]
VIDEO_UNDER_RUN = Path("<under the run directory>")  # --video given without a path
sys.path.insert(0, str(ROOT))

from sebulba.checkpoints import complete_steps  # noqa: E402
from sebulba.config import Cluster  # noqa: E402
from sebulba.devices import Placement  # noqa: E402
from sebulba.envs import (evaluation_step_limit, is_atari, is_minigrid, is_mujoco, make_envs, procgen_levels,  # noqa: E402
                          resolve_episodic_life)
from sebulba.evaluation import run_episodes  # noqa: E402
from sebulba.networks import make_policy_fn  # noqa: E402
from sebulba.rundir import software  # noqa: E402
from share import MODEL_FILE, read_model, trained_with  # noqa: E402  (scripts/share.py: the shared folder's format)


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line on stderr (`error: ...`, exit status 2), without the usage block."""

    def error(self, message):
        raise Refused(message)


class Refused(SystemExit):
    """Input this script cannot use: one line on stderr (`error: ...`), exit status 2."""

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message

    def __str__(self):
        return self.message


def rebuild(recorded: dict, where: str):
    """(script module, Args, Agent, env spec, a learner state of the run's layout on the first
    local device) from a run's config.json content; `where` names the config.json in errors.

    Raises:
      Refused: a script in it that cannot be imported.
    """
    saved = recorded["args"]
    # The script that wrote the run, as config.json names it (rundir.script_module). Runs written
    # before config.json had "script" are told apart by the flags only one of the first three scripts has.
    name = recorded.get("script") or ("sebulba.impala_envpool" if "rho_clip" in saved else
                                      "sebulba.ppo_lstm_envpool" if "lstm_size" in saved else "sebulba.ppo_envpool")
    try:
        module = importlib.import_module(name)
    except ImportError as error:
        raise Refused(f"{where} names the script {name}, which cannot be imported ({error}): evaluate it with the "
                      f"scripts/evaluate.py of a checkout that has {name.replace('.', '/')}.py") from error
    args = module.Args(**{k: v for k, v in saved.items() if k in {f.name for f in dataclasses.fields(module.Args)}})
    if "read_mission" not in saved and hasattr(args, "read_mission"):  # written before the mission was read
        args = dataclasses.replace(args, read_mission=False)
    if "atari_protocol" not in saved and hasattr(args, "atari_protocol"):  # written before the protocols were named
        args = dataclasses.replace(args, atari_protocol="machado")
    agent, spec = module.make_agent(args)
    device = jax.local_devices()[0]
    # A one-device learner "mesh": orbax reshards whatever layout the run was saved from.
    placement = Placement([device], [device])
    # resolve gives the optimiser's sizes; as one process that logs nothing (track=False: evaluating needs no W&B login)
    setup = module.resolve(dataclasses.replace(args, distributed=False, track=False), Cluster())
    like, _ = module.make_train_state(args, setup, module.init_params(agent, spec, jax.random.PRNGKey(0)), placement)
    return module, args, agent, spec, like


def load(run_dir: Path, checkpoint: int | None):
    """(script module, Args, Agent, env spec, (params, observation statistics) on the first local
    device, checkpoint update). The training script gives the flags, the network and the
    learner state's layout; the rest is the shared runtime's.

    Raises:
      Refused: no config.json, a script in it that cannot be imported, no checkpoint, or a
        checkpoint number that does not exist.
    """
    config = run_dir / "config.json"
    if not run_dir.is_dir():
        raise Refused(f"{run_dir} is not a directory: give a run directory such as runs/<run name>, a folder written "
                      "by scripts/share.py, or a Hugging Face Hub repo id such as <user>/<env id>-<exp name>-seed<seed>")
    if not config.exists():
        if (run_dir / MODEL_FILE).exists():
            raise Refused(f"{run_dir} lacks config.json: it is not a whole folder written by scripts/share.py (copy or "
                          "download it again)")
        raise Refused(f"{run_dir} has no config.json: give a run directory written by a sebulba script")
    recorded = read_config(config)
    if (run_dir / MODEL_FILE).exists() and "export" not in recorded:
        raise Refused(f"{config} has no export entry: {run_dir} is not a whole folder written by scripts/share.py "
                      "(copy or download it again)")
    if "export" in recorded and not (run_dir / "checkpoints").exists():  # a shared agent's folder (scripts/share.py)
        loaded = load_shared(run_dir)
        if checkpoint is not None and checkpoint != loaded[-1]:
            raise Refused(f"{run_dir} is a shared agent: it holds checkpoint {loaded[-1]} alone, not {checkpoint}")
        return loaded
    if not (run_dir / "checkpoints").exists():
        raise Refused(f"{run_dir}/checkpoints does not exist: the run saved no checkpoint yet")
    steps = complete_steps(run_dir / "checkpoints")  # finished ones only
    if not steps or (checkpoint is not None and checkpoint not in steps):
        raise Refused(f"{run_dir}/checkpoints has {f'checkpoints {sorted(steps)}' if steps else 'no checkpoint'}"
                      + (f", not {checkpoint}" if checkpoint is not None and steps else ""))
    module, args, agent, spec, like = rebuild(recorded, str(config))
    update = checkpoint if checkpoint is not None else max(steps)
    manager = ocp.CheckpointManager((run_dir / "checkpoints").absolute(),
                                    options=ocp.CheckpointManagerOptions(create=False))
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
    try:
        state = manager.restore(update, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract))).state
    except Exception as error:  # orbax's errors for a damaged checkpoint have no common base
        raise Refused(f"{run_dir}/checkpoints/{update} cannot be read ({type(error).__name__}: "
                      f"{str(error).splitlines()[0] if str(error) else ''}): give an older one with --checkpoint "
                      f"({', '.join(map(str, sorted(steps)))})") from error
    finally:
        manager.close()
    return module, args, agent, spec, (state.params, state.obs_moments), update


def read_config(path: Path) -> dict:
    """A run's config.json, parsed.

    Raises:
      Refused: it is not JSON, or holds no flags.
    """
    try:
        recorded = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise Refused(f"{path} is not JSON ({error}): damaged; copy the run or the folder again") from error
    if not isinstance(recorded, dict) or not isinstance(recorded.get("args"), dict):
        raise Refused(f"{path} holds no flags (\"args\"): not a config.json a sebulba script wrote")
    return recorded


def load_shared(folder: Path):
    """As `load`, for a folder written by scripts/share.py (its model.msgpack, checked against the
    checksum its config.json records, and the script's network at this checkout).

    Raises:
      Refused: a partial or altered folder, or params that do not fit the script's network here.
    """
    recorded, state_dict = read_model(folder)
    module, args, agent, spec, like = rebuild(recorded, str(folder / "config.json"))
    target = {"params": like.params, "obs_moments": like.obs_moments}
    try:
        restored = flax.serialization.from_state_dict(target, state_dict)
        fits = all(np.shape(a) == np.shape(b) for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(target)))
    except (ValueError, KeyError, TypeError) as error:  # flax: a missing or extra field
        fits, restored = False, error
    if not fits:
        raise Refused(f"{folder}/{MODEL_FILE} does not fit the network {recorded['script']} builds at this checkout: "
                      f"play it with the sebulba it was trained with ({trained_with(recorded)})")
    recorded_versions = (recorded.get("software") or {}).get("versions") or {}
    differ = [f"{name} {recorded_versions[name]} (here {version})" for name, version in software()["versions"].items()
              if name in ("jax", "flax", "envpool") and recorded_versions.get(name) not in (None, version)]
    if differ:  # the params fit; numbers may still differ in the last bits, or an env's dynamics across envpool versions
        print(f"note: {folder} was trained with {', '.join(differ)}", file=sys.stderr)
    device = jax.local_devices()[0]
    params, moments = jax.device_put((restored["params"], restored["obs_moments"]), device)
    return module, args, agent, spec, (params, moments), recorded["export"]["checkpoint"]


def locate(source: str) -> Path:
    """The local directory `source` names: a run directory or shared folder, as given, or a Hugging
    Face Hub model repo id (`<user>/<name>`, relative, one slash, its first part no local
    directory), downloaded with huggingface_hub into its cache.

    Raises:
      Refused: huggingface_hub missing, or the repo cannot be downloaded (no such repo, no network).
    """
    path = Path(source)
    if path.exists() or path.is_absolute() or source.count("/") != 1 or Path(source.split("/")[0]).is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download
    except ImportError as error:
        raise Refused(f"{source} is no directory here; to download it from the Hugging Face Hub install "
                      'huggingface_hub: pip install -e ".[share]"') from error
    try:
        return Path(snapshot_download(repo_id=source, repo_type="model"))
    except Exception as error:  # huggingface_hub's HTTP and connection errors have no common base
        raise Refused(f"{source} is no directory here, and downloading it as a Hugging Face Hub model repo failed "
                      f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})") from error


def evaluate(module, args, agent, spec, params, episodes: int, seed: int, greedy: bool, video: Path | None = None,
             video_episodes: int = 1) -> dict:
    """One episode in each of `episodes` envs with `params` = (network params, observation
    statistics); raw returns and lengths in env-id order. With `video`, the episodes of the
    first `video_episodes` envs are rendered (EnvPool rgb_array frames: the first observation,
    then one frame per env step) and written one after the other to that mp4 file."""
    threads = min(episodes, os.cpu_count() or 1)
    if video is not None and is_mujoco(args.env_id) and os.environ.get("MUJOCO_GL") not in ("egl", "osmesa"):
        raise Refused("--video on a MuJoCo task needs an OpenGL platform: set MUJOCO_GL=egl (GPU) or "
                         "MUJOCO_GL=osmesa (CPU, with libOSMesa installed)")
    protocol = getattr(args, "atari_protocol", "cleanba")  # SAC has no Atari flags
    episodic_life = resolve_episodic_life(args.env_id, protocol, getattr(args, "episodic_life", None))
    levels = (getattr(args, "procgen_start_level", 0), getattr(args, "procgen_num_levels", 0))  # SAC has none
    envs = make_envs(args.env_id, episodes, episodes, seed, threads, protocol, episodic_life,
                     **procgen_levels(args.env_id, *levels, evaluation=True),
                     **({"render_mode": "rgb_array"} if video else {}))
    recorded = list(range(min(video_episodes, episodes))) if video is not None else []
    frames: list[list[np.ndarray]] = [[] for _ in recorded]

    def record(running):
        for i, frame in zip(recorded, envs.render(env_ids=recorded)):
            if running[i]:
                frames[i].append(frame)

    policy = make_policy_fn(agent, spec.action_space, greedy=greedy)
    returns, lengths, _ = run_episodes(envs, policy, params, jax.random.PRNGKey(seed), record=record if recorded else None,
                                       episodic_life=episodic_life, max_steps=evaluation_step_limit(args.env_id))
    envs.close()
    result = {"episodes": episodes, "return_mean": float(returns.mean()), "return_std": float(returns.std()),
              "length_mean": float(lengths.mean()), "length_std": float(lengths.std()),
              "returns": returns.tolist(), "lengths": lengths.tolist()}
    if is_minigrid(args.env_id):  # MiniGrid's and BabyAI's success: a positive return, the goal reached
        result["success_rate"] = float(np.mean(returns > 0))
    if video is not None:
        write_video(video, [f for episode in frames for f in episode], fps=15 if is_atari(args.env_id) else 50)
        result |= {"video": str(video), "video_frames": sum(map(len, frames))}
    return result


def write_video(path: Path, frames: list[np.ndarray], fps: int):
    """H.264 mp4 through imageio's ffmpeg plugin (frames padded to even sizes, which H.264 needs)."""
    try:
        import imageio.v2 as imageio
    except ImportError as error:
        raise Refused('--video needs imageio and its ffmpeg plugin: pip install -e ".[eval]"') from error
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():  # starting ffmpeg is fork + exec at once, which JAX's threads survive
        warnings.filterwarnings("ignore", message="os.fork", category=RuntimeWarning)
        with imageio.get_writer(path, fps=fps, codec="libx264", macro_block_size=2) as writer:
            for frame in frames:
                writer.append_data(np.pad(frame, ((0, frame.shape[0] % 2), (0, frame.shape[1] % 2), (0, 0))))


def main(argv: list[str] | None = None) -> dict:
    parser = OneLineParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("run_dir", type=Path, help="runs/<run name> of a training run, a folder scripts/share.py wrote, "
                        "or a Hugging Face Hub repo id (<user>/<env id>-<exp name>-seed<seed>), downloaded first")
    parser.add_argument("--checkpoint", type=int, default=None, help="update number of the checkpoint; default newest")
    parser.add_argument("--episodes", type=int, default=10, help="episodes (one per env of the pool)")
    parser.add_argument("--greedy", action=argparse.BooleanOptionalAction, default=None,
                        help="the policy's mode (argmax; Gaussian mean; PQN: argmax of the Q-values); --no-greedy: "
                        "sampled actions (PQN: ε-greedy with the run's --end-e; on Atari a greedy policy can stall a game "
                        "until the 27k-step limit); default: as the run's final evaluation (its --eval-greedy)")
    parser.add_argument("--seed", type=int, default=0, help="env and action seed")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a line of text")
    parser.add_argument("--video", type=Path, nargs="?", const=VIDEO_UNDER_RUN, default=None, metavar="PATH",
                        help="write the first episode(s) to this mp4 file; with no PATH, to RUN_DIR/videos/"
                             "update<N>_seed<S>_<policy>.mp4, or for a shared folder or Hub repo to "
                             "./videos/<its name>_seed<S>_<policy>.mp4 (the path is printed)")
    parser.add_argument("--video-episodes", type=int, default=1, help="episodes recorded with --video")
    cli = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message=".*precision lowered by casting to float32", category=UserWarning)
    if cli.episodes <= 0:
        parser.error(f"--episodes {cli.episodes} must be positive")
    if cli.video is not None and not 1 <= cli.video_episodes <= cli.episodes:
        parser.error(f"--video-episodes {cli.video_episodes} must be between 1 and --episodes {cli.episodes}")
    if cli.video is not None:
        try:  # before any episode is played
            import imageio.v2  # noqa: F401
            import imageio_ffmpeg  # noqa: F401
        except ImportError:
            parser.error('--video needs imageio and its ffmpeg plugin: pip install -e ".[eval]"')
    module, args, agent, spec, params, update = load(locate(str(cli.run_dir)), cli.checkpoint)
    if cli.greedy is None:  # as the run's own final evaluation
        cli.greedy = bool(getattr(args, "eval_greedy", False))
    policy = "greedy" if cli.greedy else "epsilon-greedy" if getattr(agent, "q_network", False) else "sampled"
    if cli.video == VIDEO_UNDER_RUN:  # a shared folder (or the Hub's cache) stays as it was shared: videos/ here
        shared = not (cli.run_dir / "checkpoints").is_dir()
        cli.video = ((Path("videos") / f"{Path(str(cli.run_dir)).name}_seed{cli.seed}_{policy}.mp4") if shared else
                     cli.run_dir / "videos" / f"update{update}_seed{cli.seed}_{policy}.mp4")
    result = {"run_dir": str(cli.run_dir), "env_id": args.env_id, "checkpoint": update, "seed": cli.seed,
              "policy": policy,
              **evaluate(module, args, agent, spec, params, cli.episodes, cli.seed, cli.greedy, cli.video,
                         cli.video_episodes)}
    if cli.json:
        lines = [json.dumps(result)]
    else:
        shown = f"ε-greedy (ε {agent.eval_epsilon:g})" if policy == "epsilon-greedy" else policy
        lines = [f"{args.env_id}, checkpoint {update}, {shown} actions, {cli.episodes} episode{'s' * (cli.episodes > 1)}: return "
                 f"{result['return_mean']:.1f} ± {result['return_std']:.1f}, length {result['length_mean']:.1f} ± "
                 f"{result['length_std']:.1f} env steps"
                 + (f", success rate {result['success_rate']:.2f}" if is_minigrid(args.env_id) else "")]  # MiniGrid
        if cli.video is not None:
            lines.append(f"video: {cli.video} ({result['video_frames']} frames)")
    try:
        print("\n".join(lines), flush=True)  # flushed here: a closed pipe raises now, not at exit
    except BrokenPipeError:  # `--json | head -c 400`: the reader has gone; end as a pipeline's writer does, quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (Python flushes stdout again at exit)
    return result


def run_cli(main):
    """Run a script's `main()`; input it refuses ends in one line on stderr, exit status 2."""
    try:
        main()
    except Refused as refused:
        print(f"error: {refused}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    run_cli(main)
