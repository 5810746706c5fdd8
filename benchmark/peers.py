"""Ours beside the PPO and SAC a user would pick instead, on the same box in one sitting: CleanRL,
Stable-Baselines3 (through RL Baselines3 Zoo) and Sample Factory (PPO only), each installed from PyPI
and run as its users run it.

    python benchmark/peers.py --setup        # once: .venv-peers/ for CleanRL and Sample Factory
    python benchmark/peers.py                # every task and measurement (about 2 h on 2 cores)
    python benchmark/peers.py --tasks Hopper-v4/SAC   # SAC alone (about 50 min on 2 cores)
    python benchmark/peers.py --tasks CartPole-v1 --systems sb3   # re-measure some, keep the rest
    python benchmark/peers.py --systems ours # ours alone, merged beside the peers' recorded runs

Where each peer comes from: Stable-Baselines3 and RL Baselines3 Zoo install beside this project
(`pip install -e ".[peers]"`: stable-baselines3, rl_zoo3, torch on the CPU, gymnasium[mujoco]).
CleanRL and Sample Factory pin older gym/gymnasium releases than this project's, so they get a
virtual environment of their own, .venv-peers/ (`--setup`: torch, sample-factory[mujoco] 2.1.1
with gymnasium 0.29, and the cleanrl 1.2.0 wheel, which pins gym 0.23.1 and declares Python
< 3.11 although its scripts run on 3.11: installed with --no-deps --ignore-requires-python, with
the stable-baselines3 1.2.0 it pins for its SAC's replay buffer). CleanRL 1.2.0's SAC is a gym-era
script whose gym has no MuJoCo v4 tasks: benchmark/gym_mujoco_v4.py registers gymnasium's there and
runs the script unchanged.

Two measurements per PPO task (CartPole-v1, Hopper-v4):
* equal work: every system runs BUDGET env steps of the same PPO (the hyperparameters of
  `EQUAL`: ours from README's preset, the peers' flags set to the same numbers wherever they can
  express them). Recorded: the wall clock of the whole process, launch to exit, and env steps/s
  over it (BUDGET / wall clock).
* time to score: every system at its own documented preset (ours: README's commands; CleanRL: its
  script's defaults; Stable-Baselines3: the Zoo's tuned hyperparameters; Sample Factory: its
  example launchers' documented command lines), stopped when the mean return of its last WINDOW finished games
  first reaches TARGETS[task], or at CAPS[task] seconds. Recorded: the seconds from launch (what a
  user waits: imports, compilation, every env step), the env steps by then, and the curve.

A peer's progress is read from what it prints, as its users read it: ours' console line; CleanRL's
`global_step=..., episodic_return=...` per game (PPO and SAC); the Zoo's SB3 table (`ep_rew_mean`, its
`stats_window_size` set to WINDOW; its periodic evaluation off, as ours'); Sample Factory's `Avg episode reward` (its `--stats_avg` set
to WINDOW; printed every 5 s, so its times to score are late by up to 5 s). Neither setting
changes what is learned.

SAC (Hopper-v4/SAC): equal work only, SAC_BUDGET env steps of CleanRL's sac_continuous_action.py
hyperparameters (`SAC_EQUAL`, ours' defaults) in ours, CleanRL and the Zoo's Hopper-v4 preset with
the same numbers wherever SB3 can express them. Recorded beside the wall clock: gradient steps/s
over the learning phase (the env steps between the first and the last point of the curve past
learning_starts over the seconds between them: one gradient step per env step in all three) and the
return at the end. Writes benchmark/results/peers.json, merged with the runs already there
per task and system; `benchmark/report.py` turns it into RESULTS.md's tables and the plots.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import PPO_CARTPOLE, PPO_MUJOCO, RESULTS, ROOT, machine, spread

BUDGET = 102_400  # env steps of the equal-work runs: 400 updates of 8 x 32 (CartPole), 50 of 8 x 256 (Hopper)
TARGETS = {"CartPole-v1": 475.0, "Hopper-v4": 1000.0}  # mean return of the last WINDOW games
CAPS = {"CartPole-v1": 300.0, "Hopper-v4": 600.0}  # seconds a time-to-score run may take
WINDOW = 20
SYSTEMS = ("ours", "cleanrl", "sb3", "sample_factory")
NAMES = {"ours": "ppo_envpool.py (ours)", "cleanrl": "CleanRL", "sb3": "Stable-Baselines3 (RL Zoo)",
         "sample_factory": "Sample Factory"}
PEERS_VENV = ROOT / ".venv-peers"
PEERS_PYTHON = PEERS_VENV / "bin" / "python"
# .venv-peers/: what --setup installs (torch from this box's disk where it lies there).
VENV_REQUIREMENTS = ["torch>=2.8,<2.14", "sample-factory[mujoco]==2.1.1", "gymnasium[mujoco]==0.29.1", "gym==0.23.1",
                     "pygame>=2.1,<3", "pandas<3", "matplotlib<4"]  # the last two: stable-baselines3 1.2.0's imports
# cleanrl's own pins (gym 0.23.1, Python < 3.11) are met above or too strict; stable-baselines3 1.2.0 (its pin, for
# the SAC script's replay buffer) asks for gym 0.21's API, which 0.23.1 keeps where the buffer uses it.
VENV_NO_DEPS = ["cleanrl==1.2.0", "stable-baselines3==1.2.0"]

# The same PPO in every system's words. CartPole: README's preset (RL Zoo's tuned CartPole-v1 PPO,
# which ours took: 8 envs x 32 steps, one 256-sample minibatch x 20 epochs, lr 1e-3 annealed to 0,
# gamma 0.98, lambda 0.8, clip 0.2, no entropy bonus, separate 64-64 tanh policy and value MLPs).
# Hopper: CleanRL's MuJoCo PPO over 8 envs x 256 steps (32 minibatches of 64 x 10 epochs, lr 3e-4
# annealed, gamma 0.99, lambda 0.95, observation normalisation and reward scaling).
PPO_HOPPER = ["--env-id", "Hopper-v4", *PPO_MUJOCO]
EQUAL = {
    "CartPole-v1": dict(envs=8, steps=32, minibatches=1, epochs=20, lr=1e-3, gamma=0.98, gae_lambda=0.8, clip=0.2,
                        ent=0.0, vf=0.5, max_grad_norm=0.5, normalize=False),
    "Hopper-v4": dict(envs=8, steps=256, minibatches=32, epochs=10, lr=3e-4, gamma=0.99, gae_lambda=0.95, clip=0.2,
                      ent=0.0, vf=0.5, max_grad_norm=0.5, normalize=True),
}
OURS_PRESET = {"CartPole-v1": PPO_CARTPOLE, "Hopper-v4": PPO_HOPPER}
SF_ENVS = {"CartPole-v1": ("sf_examples.train_gym_env", "CartPole-v1"),
           "Hopper-v4": ("sf_examples.mujoco.train_mujoco", "mujoco_hopper")}
# Sample Factory's presets: the MuJoCo launcher's own defaults; for CartPole-v1 the command line its
# sf_examples/train_gym_env.py documents (without the defaults, use_rnn and all, it did not reach 475 in 300 s).
SF_PRESET = {"CartPole-v1": ["--algo=APPO", "--use_rnn=False", "--num_envs_per_worker=20", "--policy_workers_per_policy=2",
                             "--recurrence=1", "--with_vtrace=False", "--batch_size=512", "--reward_scale=0.1",
                             "--save_every_sec=10", "--experiment_summaries_interval=10"],
             "Hopper-v4": []}
CLEANRL_SCRIPTS = {"CartPole-v1": "cleanrl.ppo", "Hopper-v4": "cleanrl.ppo_continuous_action"}

# SAC at equal work: CleanRL sac_continuous_action.py's hyperparameters (ours' defaults): 1 gradient step per
# env step after 5,000 uniformly random ones, batch 256, replay 1M, gamma 0.99, tau 0.005, Adam at 3e-4 (actor)
# and 1e-3 (critics, temperature), 2 actor and temperature steps every 2nd step, autotuned temperature
# (target entropy -|A|), 256-256 ReLU networks. Ours runs its default 8 envs x 16 steps (CleanRL one env).
# SB3 cannot express two of them: one learning rate for all three optimisers (3e-4, its default) and the actor
# updated every step; its log-std is clipped to [-20, 2] where CleanRL's and ours are squashed into [-5, 2]. CleanRL
# 1.2.0 and SB3 differentiate the temperature loss in log alpha without the factor alpha (CleanRL's newer script and
# ours keep it).
SAC_BUDGET = 50_000
SAC_TASKS = {"Hopper-v4/SAC": "Hopper-v4"}
SAC_EQUAL = dict(learning_starts=5000, batch_size=256, buffer_size=1_000_000, gamma=0.99, tau=0.005, policy_lr=3e-4,
                 q_lr=1e-3, policy_frequency=2, target_network_frequency=1, autotune=True, hiddens=[256, 256])
TASKS = [*TARGETS, *SAC_TASKS]


def with_value(flags: list[str], name: str, value) -> list[str]:
    """`flags` with `name`'s value replaced by `value`."""
    out = list(flags)
    out[out.index(name) + 1] = str(value)
    return out


def command(system: str, task: str, mode: str, seed: int, directory: Path) -> list[str]:
    """The command line `system` runs for `task` in `mode` ("equal" or "preset") with `seed`,
    writing under `directory`.

    Raises:
      ValueError: an unknown system.
    """
    if task in SAC_TASKS:
        return sac_command(system, SAC_TASKS[task], seed, directory)
    h = EQUAL[task]
    equal = mode == "equal"
    if system == "ours":
        flags = OURS_PRESET[task]
        if equal:
            flags = with_value(flags, "--total-timesteps", BUDGET)
        return [sys.executable, str(ROOT / "sebulba" / "ppo_envpool.py"), *flags, "--seed", str(seed),
                "--log-frequency", "1", "--eval-episodes", "0", "--run-name", "peers"]
    if system == "cleanrl":
        out = [str(PEERS_PYTHON), "-m", CLEANRL_SCRIPTS[task], "--env-id", task, "--seed", str(seed), "--cuda", "False"]
        if equal:
            out += ["--total-timesteps", BUDGET, "--num-envs", h["envs"], "--num-steps", h["steps"],
                    "--num-minibatches", h["minibatches"], "--update-epochs", h["epochs"], "--learning-rate", h["lr"],
                    "--gamma", h["gamma"], "--gae-lambda", h["gae_lambda"], "--clip-coef", h["clip"],
                    "--ent-coef", h["ent"], "--vf-coef", h["vf"], "--max-grad-norm", h["max_grad_norm"]]
        return [str(x) for x in out]
    if system == "sb3":
        out = [sys.executable, "-m", "rl_zoo3.train", "--algo", "ppo", "--env", task, "--seed", str(seed),
               "--log-folder", str(directory / "logs"), "--device", "cpu", "--vec-env", "dummy", "--eval-freq", "-1",
               "--hyperparams", f"stats_window_size:{WINDOW}"]
        if equal:  # the Zoo's -n; and every hyperparameter, so nothing of its preset is left
            out[out.index("--hyperparams") + 1:out.index("--hyperparams") + 2] = [
                f"stats_window_size:{WINDOW}", f"n_envs:{h['envs']}", f"n_steps:{h['steps']}",
                f"batch_size:{h['envs'] * h['steps'] // h['minibatches']}", f"n_epochs:{h['epochs']}",
                f"learning_rate:'lin_{h['lr']}'", f"gamma:{h['gamma']}", f"gae_lambda:{h['gae_lambda']}",
                f"clip_range:{h['clip']}", f"ent_coef:{h['ent']}", f"vf_coef:{h['vf']}",
                f"max_grad_norm:{h['max_grad_norm']}", f"normalize:{h['normalize']}", "policy:'MlpPolicy'",
                "policy_kwargs:dict(net_arch=dict(pi=[64,64],vf=[64,64]),activation_fn=nn.Tanh,ortho_init=True,"
                "log_std_init=0.0)"]
            out[out.index("--seed"):out.index("--seed")] = ["-n", str(BUDGET)]
        return out
    if system == "sample_factory":
        module, env = SF_ENVS[task]
        out = [str(PEERS_PYTHON), "-m", module, f"--env={env}", f"--experiment=peers_{seed}",
               f"--train_dir={directory / 'train_dir'}", f"--seed={seed}", "--device=cpu", f"--stats_avg={WINDOW}"]
        if not equal:
            return out + SF_PRESET[task]
        # Rollouts of 64 (CartPole: 32) steps: Sample Factory's minibatches hold whole rollouts. Its learning
        # rate stays constant: --lr_schedule refuses linear_decay (its learner has it; only a launcher's defaults set it).
        rollout = min(h["steps"], h["envs"] * h["steps"] // h["minibatches"])
        out += [f"--train_for_env_steps={BUDGET}", "--num_workers=2", f"--num_envs_per_worker={h['envs'] // 2}",
                f"--rollout={rollout}", f"--batch_size={h['envs'] * h['steps'] // h['minibatches']}",
                "--num_batches_per_epoch=" + str(h["minibatches"]), f"--num_epochs={h['epochs']}",
                f"--learning_rate={h['lr']}", f"--gamma={h['gamma']}",
                f"--gae_lambda={h['gae_lambda']}",
                f"--ppo_clip_ratio={h['clip']}", f"--exploration_loss_coeff={h['ent']}",
                f"--value_loss_coeff={h['vf']}", f"--max_grad_norm={h['max_grad_norm']}",
                "--encoder_mlp_layers", "64", "64", "--nonlinearity=tanh", "--actor_critic_share_weights=False",
                "--use_rnn=False", f"--normalize_input={h['normalize']}", f"--normalize_returns={h['normalize']}"]
        return out
    raise ValueError(f"unknown system {system}: use one of {', '.join(SYSTEMS)}")


def sac_command(system: str, env_id: str, seed: int, directory: Path) -> list[str]:
    """The command line `system` runs for SAC on `env_id` at equal work (SAC_EQUAL, SAC_BUDGET env steps).

    Raises:
      ValueError: a system without SAC.
    """
    h = SAC_EQUAL
    if system == "ours":  # its defaults are SAC_EQUAL
        return [sys.executable, str(ROOT / "sebulba" / "sac_envpool.py"), "--env-id", env_id, "--total-timesteps",
                str(SAC_BUDGET), "--seed", str(seed), "--log-frequency", "1", "--eval-episodes", "0",
                "--run-name", "peers"]
    if system == "cleanrl":
        out = [str(PEERS_PYTHON), str(ROOT / "benchmark" / "gym_mujoco_v4.py"), "cleanrl.sac_continuous_action",
               "--env-id", env_id, "--seed", seed, "--cuda", "False", "--total-timesteps", SAC_BUDGET,
               "--buffer-size", h["buffer_size"], "--gamma", h["gamma"], "--tau", h["tau"],
               "--batch-size", h["batch_size"], "--learning-starts", h["learning_starts"],
               "--policy-lr", h["policy_lr"], "--q-lr", h["q_lr"], "--policy-frequency", h["policy_frequency"],
               "--target-network-frequency", h["target_network_frequency"], "--autotune", h["autotune"]]
        return [str(x) for x in out]
    if system == "sb3":  # the Zoo's preset for the task, with SAC_EQUAL's numbers where SB3 has them
        return [sys.executable, "-m", "rl_zoo3.train", "--algo", "sac", "--env", env_id, "-n", str(SAC_BUDGET),
                "--seed", str(seed), "--log-folder", str(directory / "logs"), "--device", "cpu", "--vec-env", "dummy",
                "--eval-freq", "-1", "--hyperparams", f"stats_window_size:{WINDOW}",
                f"learning_starts:{h['learning_starts']}", f"batch_size:{h['batch_size']}",
                f"buffer_size:{h['buffer_size']}", f"gamma:{h['gamma']}", f"tau:{h['tau']}",
                f"learning_rate:{h['policy_lr']}", "train_freq:1", "gradient_steps:1",
                f"target_update_interval:{h['target_network_frequency']}", "ent_coef:'auto'",
                "policy_kwargs:dict(net_arch=[" + ",".join(map(str, h["hiddens"])) + "])"]
    raise ValueError(f"no SAC in {system}: use ours, cleanrl or sb3")


def learning_rate(curve: list[tuple[float, int, float]], starts: int) -> float | None:
    """Gradient steps/s over the learning phase at one gradient step per env step: the env steps
    between the first and the last curve point (seconds, env steps, return) past `starts`, over the
    seconds between them; None with fewer than two such points."""
    past = [(t, s) for t, s, _ in curve if s > starts]
    if len(past) < 2 or past[-1][0] <= past[0][0]:
        return None
    return (past[-1][1] - past[0][1]) / (past[-1][0] - past[0][0])


# What each system prints. Ours: the console line; CleanRL: a line per finished game; the Zoo: SB3's
# table, a row per line; Sample Factory: its periodic report.
OURS_LINE = re.compile(r"^step\s+(\d+) \| update \d+/\d+ \| sps\s+\d+ \| return\s+(\S+)")
CLEANRL_GAME = re.compile(r"global_step=(\d+), episodic_return=\[?([-\d.e+]+)\]?")
SB3_ROW = re.compile(r"^\|\s+(ep_rew_mean|total_timesteps)\s+\|\s+([-\d.e+]+)\s+\|")
SF_FRAMES = re.compile(r"Total num frames: (\d+)")
SF_REWARD = re.compile(r"Avg episode reward: \[\(0, '([-\d.e+]+)'\)\]")
SF_COLLECTED = re.compile(r"Collected \{0: (\d+)\}")  # at exit: env steps run, a little past the budget


class Progress:
    """A system's learning curve as its output arrives: points (seconds since launch, env steps,
    mean return of the last WINDOW games) from `feed(seconds, line)`."""

    def __init__(self, system: str):
        self.system = system
        self.points: list[tuple[float, int, float]] = []
        self.steps = 0
        self.games: collections.deque = collections.deque(maxlen=WINDOW)
        self.sb3_mean: float | None = None
        self.collected: int | None = None  # Sample Factory's env steps at exit

    def feed(self, seconds: float, line: str):
        if self.system == "ours":
            if (m := OURS_LINE.match(line)) and m[2] != "n/a":
                self.points.append((seconds, int(m[1]), float(m[2])))
        elif self.system == "cleanrl":
            if m := CLEANRL_GAME.search(line):
                self.games.append(float(m[2]))
                self.points.append((seconds, int(m[1]), sum(self.games) / len(self.games)))
        elif self.system == "sb3":  # ep_rew_mean comes before total_timesteps in the table
            if m := SB3_ROW.match(line):
                if m[1] == "ep_rew_mean":
                    self.sb3_mean = float(m[2])
                elif self.sb3_mean is not None:
                    self.points.append((seconds, int(m[2]), self.sb3_mean))
        elif self.system == "sample_factory":
            if m := SF_FRAMES.search(line):
                self.steps = int(m[1])
            if (m := SF_REWARD.search(line)) and self.steps:
                self.points.append((seconds, self.steps, float(m[1])))
            if m := SF_COLLECTED.search(line):
                self.collected = int(m[1])

    def reached(self, target: float) -> tuple[float, int] | tuple[None, None]:
        """(seconds, env steps) of the first point at or above `target`."""
        return next(((t, s) for t, s, r in self.points if r >= target), (None, None))


def stop(proc: subprocess.Popen):
    """SIGTERM to the process group (Sample Factory's workers too), SIGKILL 15 s later."""
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait)
            return
        except (ProcessLookupError, subprocess.TimeoutExpired):
            continue


def launch(argv: list[str], system: str, cwd: Path, target: float | None, cap: float) -> dict:
    """Run `argv` in `cwd` as its own process group; stop it when the curve reaches `target`
    (None: let it finish) or after `cap` seconds. Returns the wall clock (launch to exit), the
    curve, whether it reached the target and when, the exit code and the output's last lines."""
    tail: collections.deque = collections.deque(maxlen=60)
    progress = Progress(system)
    start = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled"},
                            start_new_session=True)
    timer = threading.Timer(cap, stop, (proc,))
    timer.start()
    stopped = False
    for line in proc.stdout:
        tail.append(line)
        progress.feed(time.perf_counter() - start, line)
        if target is not None and not stopped and progress.reached(target)[0] is not None:
            stopped = True
            threading.Thread(target=stop, args=(proc,), daemon=True).start()
    code = proc.wait()
    wall = time.perf_counter() - start
    timer.cancel()
    seconds, steps = progress.reached(target) if target is not None else (None, None)
    return {"wall_s": round(wall, 2), "code": code, "capped": wall >= cap, "seconds": seconds, "global_step": steps,
            "final_return": progress.points[-1][2] if progress.points else None,
            "env_steps": progress.collected, "curve": [(round(t, 2), s, round(r, 1)) for t, s, r in progress.points],
            "tail": "".join(tail)[-3000:]}


def run_one(system: str, task: str, mode: str, seed: int) -> dict:
    """One run in a fresh temporary directory; an equal-work run must end by itself with exit code 0."""
    with tempfile.TemporaryDirectory() as tmp:
        argv = command(system, task, mode, seed, Path(tmp))
        target = TARGETS[task] if mode == "preset" else None
        cap = CAPS[task] if mode == "preset" else 3600.0 if task in SAC_TASKS else 3 * CAPS[task]
        result = launch(argv, system, Path(tmp), target, cap)
    # Paths relative to the checkout; the report writes this interpreter's absolute path as `python`.
    result["command"] = " ".join(a.replace(str(ROOT), ".").replace(tmp, "$TMP") for a in argv)
    result["seed"] = seed
    if mode == "equal":
        if result["code"] != 0:
            raise RuntimeError(f"{system} {task} exited {result['code']}:\n{result['tail']}")
        result["env_steps"] = result["env_steps"] or (SAC_BUDGET if task in SAC_TASKS else BUDGET)  # exactly
        result["sps"] = round(result["env_steps"] / result["wall_s"], 1)
        if task in SAC_TASKS:
            rate = learning_rate(result["curve"], SAC_EQUAL["learning_starts"])
            result["grad_steps_per_s"] = None if rate is None else round(rate, 1)
    return result


def summarise(runs: list[dict], mode: str) -> dict:
    if mode == "equal":
        return {"wall_s": spread([r["wall_s"] for r in runs]), "sps": spread([r["sps"] for r in runs]),
                "grad_steps_per_s": spread([r.get("grad_steps_per_s") for r in runs]),
                "final_return": spread([r["final_return"] for r in runs])}

    def over_seeds(values: list) -> dict:
        # The median is over every seed, one that never reached the target ranking slowest (2 of 3
        # reached gives the slower of the two, fewer than half none); min-max over those that did.
        median = statistics.median(math.inf if v is None else v for v in values) if values else math.inf
        return {**spread(values), "median": None if math.isinf(median) else median}

    seconds, steps = over_seeds([r["seconds"] for r in runs]), over_seeds([r["global_step"] for r in runs])
    return {"seconds": seconds, "global_step": steps,
            "reached": sum(r["seconds"] is not None for r in runs), "seeds": len(runs)}


def run(tasks: list[str], systems: list[str], modes: list[str], seeds: list[int], saved: dict, path: Path) -> dict:
    """Measure every (task, mode, system), saving after each system so that an interrupted sitting
    keeps what it measured; a system that fails is recorded with its error and the rest go on."""
    results = saved
    for task in tasks:
        for mode in modes:
            if task in SAC_TASKS and mode != "equal":
                continue
            entry = results.setdefault(task, {}).setdefault(mode, {})
            for system in systems:
                if task in SAC_TASKS and system == "sample_factory":
                    continue
                runs, error = [], None
                for seed in seeds:
                    try:
                        runs.append(run_one(system, task, mode, seed))
                    except RuntimeError as failure:
                        error = str(failure)[-2000:]
                        print(f"{task} {mode} {system} seed {seed}: FAILED\n{error}", flush=True)
                        break
                    r = runs[-1]
                    said = (f"{r['wall_s']:.0f} s, {r['sps']:,.0f} env steps/s, "
                            f"{r.get('grad_steps_per_s')} gradient steps/s, return {r['final_return']}"
                            if mode == "equal" else
                            f"{r['seconds']:.0f} s to {TARGETS[task]:g} ({r['global_step']:,} env steps)"
                            if r["seconds"] is not None else f"not reached in {r['wall_s']:.0f} s")
                    print(f"{task} {mode} {system} seed {seed}: {said}", flush=True)
                name = "sac_envpool.py (ours)" if task in SAC_TASKS and system == "ours" else NAMES[system]
                entry[system] = {"name": name, "runs": runs, "error": error, **summarise(runs, mode)}
                save(results, path)
    return results


def save(results: dict, path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"machine": machine(), "budget": BUDGET, "targets": TARGETS, "caps": CAPS, "window": WINDOW,
            "equal": EQUAL, "sac_budget": SAC_BUDGET, "sac_equal": SAC_EQUAL, "peer_versions": peer_versions(),
            "results": results}
    path.write_text(json.dumps(data, separators=(",", ":")))


def peer_versions() -> dict:
    """The peers' versions where they are installed: the `peers` extra here, .venv-peers/ beside it."""
    from importlib.metadata import PackageNotFoundError, version
    here = {}
    for package in ("stable-baselines3", "rl_zoo3", "torch", "gymnasium", "mujoco"):
        try:
            here[package] = version(package)
        except PackageNotFoundError:
            here[package] = None
    venv = {}
    if PEERS_PYTHON.exists():
        probe = ("import json, importlib.metadata as m\nout = {}\nfor p in ('cleanrl', 'sample-factory', 'stable-baselines3', 'torch', "
                 "'gymnasium', 'gym', 'mujoco'):\n    try: out[p] = m.version(p)\n    except Exception: out[p] = None\n"
                 "print(json.dumps(out))")
        venv = json.loads(subprocess.run([str(PEERS_PYTHON), "-c", probe], capture_output=True, text=True,
                                         check=True).stdout)
    return {"extra": here, "venv": venv}


def peers_section(data: dict, img: Path, rel: str, save_fig) -> list[str]:
    """RESULTS.md's part on peers.json: a table per measurement and task, and per task a plot of
    the preset runs' return against the wall clock (written with `save_fig(fig, path)` under
    `img`, linked as `rel`/name)."""
    import matplotlib.pyplot as plt

    def fmt(s: dict, digits: int = 0) -> str:
        if not s or s.get("median") is None:
            return "n/a"
        return f"{s['median']:,.{digits}f} ({s['min']:,.{digits}f}–{s['max']:,.{digits}f})"

    versions = data["peer_versions"]
    listed = lambda found: ", ".join(f"{k} {v}" for k, v in found.items() if v)  # noqa: E731
    out = ["## Ours beside the peers (`benchmark/peers.py`)", "",
           "PPO in each system a user would pick instead, on this box in one sitting, each installed from PyPI "
           f"and run as its users run it. Beside this project (the `peers` extra): {listed(versions['extra'])}; in "
           f".venv-peers/: {listed(versions['venv'])}. Times are wall clock from launch to exit (or to the "
           "target), imports and start-up included; ours ran with its default persistent compilation cache "
           "(~/.cache/sebulba/jax), warm from earlier runs of the same sizes, as a user rerunning a command has it "
           "(a first run on a machine compiles first: the startup section has how long). Median (min–max) over "
           "seeds.", ""]
    results = data["results"]
    for task, modes in results.items():
        equal = modes.get("equal", {})
        if equal and task in SAC_TASKS:
            out += sac_table(task, equal, data, fmt)
        elif equal:
            out += [f"### Equal work, {task}: {data['budget']:,} env steps of the same PPO", "",
                    f"Hyperparameters: {', '.join(f'{k} {v}' for k, v in data['equal'][task].items())}. Target: ours "
                    "at 3× each peer's env steps/s or more.", "",
                    *equal_rows(equal, "sps", "env steps/s", fmt), ""]
        preset = modes.get("preset", {})
        if preset:
            target, cap = data["targets"][task], data["caps"][task]
            ours = preset.get("ours", {}).get("seconds", {}).get("median")
            out += [f"### Time to score, {task}: mean return of the last {data['window']} games ≥ {target:g}", "",
                    f"Each system at its own preset, stopped at the target or after {cap:.0f} s. Target: ours first, "
                    "the fastest peer taking 2× as long or more. Seconds and env steps: the median over all seeds, "
                    "a seed that never reached it ranking slowest; min–max over the seeds that did.",
                    "", "| system | reached | seconds to score | env steps by then | their time ÷ ours | command |",
                    "| --- | --- | --- | --- | --- | --- |"]
            fig, ax = plt.subplots(figsize=(7, 4))
            for (system, r), color in zip(preset.items(), ("C0", "C1", "C2", "C3")):
                theirs = r["seconds"]["median"]
                ratio = ("" if system == "ours" or not ours or theirs is None else
                         f"{theirs / ours:.1f}× ({'met' if theirs >= 2 * ours else 'missed'})")
                example = re.sub(r"^/\S*/python ", "python ", r["runs"][0]["command"]) if r["runs"] else ""
                out.append(f"| {r['name']} | {r['reached']} of {r['seeds']} | {fmt(r['seconds'])} | "
                           f"{fmt(r['global_step'])} | {ratio} | `{example}` |")
                for i, run in enumerate(r["runs"]):
                    if run["curve"]:
                        ts, _, rets = zip(*run["curve"])
                        ax.plot(ts, rets, color=color, alpha=0.7, lw=1, label=r["name"] if i == 0 else None)
            ax.axhline(target, color="grey", ls="--", lw=1)
            ax.set(xlabel="seconds since launch", ylabel=f"return (mean of last {data['window']} games)", title=task)
            ax.legend(fontsize=8)
            name = f"peers_{task.split('-')[0].lower()}.png"
            save_fig(fig, img / name)
            out += ["", f"![{task}: return against wall clock, each system at its preset]({rel}/{name})", ""]
    return out


def sac_table(task: str, equal: dict, data: dict, fmt) -> list[str]:
    """RESULTS.md's table of a SAC task's equal-work runs (gradient steps/s, wall clock, the return)."""
    out = [f"### Equal work, {task}: {data['sac_budget']:,} env steps of the same SAC", "",
           f"Hyperparameters (CleanRL sac_continuous_action.py's): "
           f"{', '.join(f'{k} {v}' for k, v in data['sac_equal'].items())}; ours over its default 8 envs x 16 "
           "steps, CleanRL over one env; Stable-Baselines3 (the Zoo's Hopper-v4 preset with these numbers) "
           "cannot express two of them: one learning rate (3e-4) for the critics and the temperature too, and the "
           "actor updated every step instead of twice every 2nd. Not the same either: CleanRL 1.2.0 (PyPI's last "
           "release) and Stable-Baselines3 take the temperature's gradient without the factor alpha that ours and "
           "CleanRL's newer script keep (docs/sac_envpool.md), and Stable-Baselines3 clips the log-std to [-20, 2] "
           "where the others squash it into [-5, 2]. Gradient steps/s: over the learning phase (from "
           "the first to the last logged point past learning_starts). Return: the mean of the last "
           f"{data['window']} training games at the end. Target: ours at 3x each peer's gradient steps/s or more, "
           "the same return within noise.", "",
           *equal_rows(equal, "grad_steps_per_s", "gradient steps/s", fmt)]
    return [*out, ""]


def equal_rows(equal: dict, key: str, label: str, fmt) -> list[str]:
    """An equal-work table: per system its seeds, wall clock, the rate `key` (headed `label`), ours ÷
    theirs in it against the 3× target, and the return at the end; a system that failed, its error."""
    ours = (equal.get("ours", {}).get(key) or {}).get("median")
    out = [f"| system | seeds | wall clock (s) | {label} | ours ÷ theirs | return at the end |",
           "| --- | --- | --- | --- | --- | --- |"]
    for system, r in equal.items():
        if r.get("error") and not r["runs"]:
            out.append(f"| {r['name']} | failed: {r['error'].splitlines()[-1][:120]} | | | | |")
            continue
        theirs = (r.get(key) or {}).get("median")
        ratio = ("" if system == "ours" or not ours or not theirs else
                 f"{ours / theirs:.1f}× ({'met' if ours >= 3 * theirs else 'missed'})")
        out.append(f"| {r['name']} | {len(r['runs'])} | {fmt(r['wall_s'])} | {fmt(r.get(key) or {})} | {ratio} | "
                   f"{fmt(r['final_return'])} |")
    return out


def setup():
    """Create .venv-peers/ with CleanRL and Sample Factory (see the module docstring)."""
    subprocess.run([sys.executable, "-m", "venv", str(PEERS_VENV)], check=True)
    pip = [str(PEERS_PYTHON), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, *VENV_REQUIREMENTS], check=True)
    subprocess.run([*pip, "--no-deps", "--ignore-requires-python", *VENV_NO_DEPS], check=True)
    print(f"ready: {PEERS_VENV}", json.dumps(peer_versions()["venv"]))


def missing(systems: list[str]) -> list[str]:
    """What the chosen systems need and this machine lacks, each with the command that installs it."""
    out = []
    if "sb3" in systems:
        import importlib.util
        if importlib.util.find_spec("rl_zoo3") is None or importlib.util.find_spec("stable_baselines3") is None:
            out.append('Stable-Baselines3 and RL Zoo: pip install -e ".[peers]"')
    if {"cleanrl", "sample_factory"} & set(systems) and not PEERS_PYTHON.exists():
        out.append("CleanRL and Sample Factory: python benchmark/peers.py --setup")
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--setup", action="store_true", help="create .venv-peers/ (CleanRL, Sample Factory) and exit")
    parser.add_argument("--tasks", nargs="+", choices=TASKS, default=TASKS)
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--modes", nargs="+", choices=("equal", "preset"), default=["equal", "preset"])
    parser.add_argument("--seeds", type=int, default=3, help="seeds 1..N per system")
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory for peers.json")
    cli = parser.parse_args()
    if cli.setup:
        setup()
        sys.exit(0)
    if lacking := missing(cli.systems):
        sys.exit("error: the peers are not installed; " + "; ".join(lacking))
    path = cli.out / "peers.json"
    saved = json.loads(path.read_text())["results"] if path.exists() else {}
    run(cli.tasks, cli.systems, cli.modes, list(range(1, cli.seeds + 1)), saved, path)
    print("written:", path)
