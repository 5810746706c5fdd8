"""The flags every sebulba script shares, their checks and the batch arithmetic.

`RunFlags` holds the run, environment, evaluation, device, distributed and checkpoint flags;
each script's `Args` subclasses it and adds the algorithm's hyperparameters (a script may
redeclare a field to change its default or help line). `resolve_run` checks these flags and
derives the quantities every algorithm uses (`Setup`), before any thread or device work;
`check_ranges` gives a script's own hyperparameters the same one-line errors. Cluster
detection (`detect_cluster`) decides how many processes the run has; `sebulba/devices.py`
starts them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import os
import socket
import subprocess
import time
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import envpool
import tyro

from sebulba.envs import (ATARI_PROTOCOLS, UnsupportedObservations, is_atari, is_minigrid, is_mujoco, is_procgen,
                          observations, procgen_levels, resolve_episodic_life)
from sebulba.missions import reads_mission


class ConfigError(ValueError):
    """A configuration that cannot work; the message says what to change."""


@dataclass
class RunFlags:
    """Flags every sebulba script shares (run, environments, evaluation, devices, processes, checkpoints)."""

    exp_name: str = "sebulba"
    """experiment name, part of the default run name"""
    seed: int = 1
    """root seed for parameters, actions and environments"""
    track: bool = False
    """mirror metrics and config to Weights & Biases (set WANDB_MODE=offline to log locally)"""
    wandb_project_name: str = "sebulba"
    """W&B project"""
    wandb_entity: str | None = None
    """W&B entity (team or user); None uses your default entity"""
    log_frequency: int = 10
    """write metrics and one console line every this many learner updates"""
    run_name: str | None = None
    """run directory name under runs/; default {env_id}__{exp_name}__{seed}__{unix time}"""

    env_id: str = "Breakout-v5"
    """EnvPool task id: pixels (Atari `*-v5`, Procgen, CarRacing: a conv encoder), vectors (MuJoCo, dm_control's dicts flattened, classic control, Box2D, toy text one-hot: an MLP), or MiniGrid/BabyAI (README.md#tasks)"""
    total_timesteps: int = 50_000_000
    """env steps to train for, summed over every env (Atari: frames = 4 x env steps)"""
    local_num_envs: int = 60
    """envs in each actor thread's EnvPool pool"""
    async_batch_size: int | None = None
    """envs returned by each `recv`; smaller than --local-num-envs so stepping and inference overlap; None = half the pool"""
    num_env_threads: int = 0
    """EnvPool worker threads per pool; 0 = this machine's cores divided over the actor threads"""
    atari_protocol: Literal["cleanba", "cleanrl", "machado"] = "cleanba"
    """Atari env settings of one published setup (docs/ppo_envpool.md#atari-protocols): cleanba (Cleanba's cleanba_ppo.py: sticky actions 0.25, 18 actions, <= 1 no-op, FIRE at reset), cleanrl (CleanRL's ppo_atari_envpool.py: EnvPool's defaults + life loss ends a training episode), machado (Machado et al. 2018: as cleanba, no FIRE at reset)"""
    episodic_life: bool | None = None
    """Atari: end a training episode at every life loss (the raw game return is still logged per game); None: as --atari-protocol says (cleanrl: on)"""
    procgen_num_levels: int = 0
    """Procgen: train on this many levels from --procgen-start-level (Cobbe et al. 2020's generalisation protocol: 200 on Easy ids, 500 on Hard); 0 = every level; evaluation always plays the unbounded distribution (unseen levels); the id names the distribution mode"""
    procgen_start_level: int = 0
    """Procgen: the first of the training levels"""
    norm_obs: bool | None = None
    """True: normalise observations by their running mean and std, clipped to +-10; None: on for MuJoCo tasks"""
    norm_reward: bool | None = None
    """True: scale training rewards by the running std of the discounted return; None: on for MuJoCo tasks"""
    read_mission: bool | None = None
    """MiniGrid/BabyAI: read the mission (word embeddings, a GRU, FiLM); None: on where the mission varies game to game"""
    eval_interval: int = 0
    """evaluate the newest params every this many updates in a separate thread on its own pool (eval/*); 0 = never"""
    eval_episodes: int = 10
    """episodes per evaluation (one per env of the eval pool), also of the final one in summary.json; 0 = none"""
    eval_greedy: bool = False
    """evaluate with the policy's mode (argmax, Gaussian mean); on Atari a greedy policy can stall a game"""

    actor_device_ids: list[int] = dataclasses.field(default_factory=lambda: [0])
    """local device ids that run actor threads and policy inference"""
    learner_device_ids: list[int] = dataclasses.field(default_factory=lambda: [0])
    """local device ids of the learner mesh; the batch's env axis is split over them"""
    num_actor_threads: int = 2
    """actor threads per actor device, each with its own EnvPool pool"""
    max_policy_lag: int = 1
    """bound on policy lag (learner version - acting version); 0 = synchronous, as CleanRL alternates"""
    stall_timeout_s: float = 600.0
    """seconds without a rollout or a parameter update before the run fails as stalled"""
    checkpoint_interval: int = 100
    """save a checkpoint every this many updates (also at the end and on SIGINT/SIGTERM/SIGUSR1); 0 = only then"""
    distributed: bool = False
    """join a multi-process run (jax.distributed): an srun step, or the three flags below (docs/distributed.md)"""
    coordinator_address: str | None = None
    """--distributed: host:port where process 0 runs the coordinator (under SLURM: the first node of the step)"""
    num_processes: int | None = None
    """--distributed outside SLURM: processes in the run"""
    process_id: int | None = None
    """--distributed outside SLURM: this process's index, 0 .. num_processes - 1"""
    coordinator_timeout_s: float = 45.0
    """--distributed: seconds for every process to reach the coordinator before each one ends with an error"""
    deterministic: bool = False
    """bit-identical reruns and resumes: lockstep envs, exact policy versions, env restarts at checkpoints"""
    compilation_cache_dir: str | None = os.environ.get("SEBULBA_COMPILATION_CACHE_DIR", "~/.cache/sebulba/jax") or None
    """JAX's persistent compilation cache (a rerun of the same sizes skips compiling); None, or the variable empty: off"""


def flag(name: str) -> str:
    """The command-line spelling of a field: num_steps -> --num-steps."""
    return f"--{name.replace('_', '-')}"


def script_flags(args_type: type) -> list[str]:
    """The field names of a script's `Args` that are its command-line flags: all but those a
    script hides with `tyro.conf.Suppress` (SAC's Atari and normalisation fields, say)."""
    hints = typing.get_type_hints(args_type, include_extras=True)
    return [f.name for f in dataclasses.fields(args_type)
            if not any(marker is tyro.conf.Suppress for marker in typing.get_args(hints[f.name])[1:])]


def check_ranges(flags, positive=(), above_zero=(), unit_interval=(), non_negative=()):
    """One-line errors for out-of-range fields of any flags dataclass: `positive` (integers
    > 0), `above_zero` (floats > 0, NaN refused), `unit_interval` (in (0, 1]), `non_negative`.

    Raises:
      ConfigError: the first field out of its range, named as its flag.
    """
    for name in positive:
        if getattr(flags, name) <= 0:
            raise ConfigError(f"{flag(name)}={getattr(flags, name)} must be positive")
    for name in above_zero:
        if not getattr(flags, name) > 0:
            raise ConfigError(f"{flag(name)}={getattr(flags, name)} must be positive")
    for name in unit_interval:
        if not 0 < getattr(flags, name) <= 1:
            raise ConfigError(f"{flag(name)}={getattr(flags, name)} must be in (0, 1]")
    for name in non_negative:
        if getattr(flags, name) < 0:
            raise ConfigError(f"{flag(name)}={getattr(flags, name)} must be >= 0")


# Tasks EnvPool registers that cannot run: a run on them would hang in EnvPool's own code.
BROKEN_TASKS = {"BabyAI-SynthS5R2-v0": "EnvPool 1.2.5 never returns from its reset for some env seeds (9 of a "
                                       "one-env pool), so nearly every pool of 16 or more envs hangs; "
                                       "BabyAI-Synth-v0 has the same grammar"}


def check_env_id(env_id: str):
    """--env-id must name an EnvPool task that runs. Checked before anything asks EnvPool about the
    id: its spec and registry lookups raise a bare KeyError for an unknown one.

    Raises:
      ConfigError: an unknown id, with the closest EnvPool ids; a task in BROKEN_TASKS, with why; a
        task whose observations no script takes (`sebulba.envs.observations`), or whose family
        EnvPool cannot load here (Procgen without the Qt 5 runtime), with what to do.
    """
    if env_id not in envpool.list_all_envs():
        close = difflib.get_close_matches(env_id, envpool.list_all_envs(), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else "; see envpool.list_all_envs()"
        raise ConfigError(f"--env-id {env_id} is not an EnvPool task{hint}")
    if env_id in BROKEN_TASKS:
        raise ConfigError(f"--env-id {env_id} cannot run: {BROKEN_TASKS[env_id]}")
    try:
        observations(env_id)
    except UnsupportedObservations as error:
        raise ConfigError(f"--env-id {error}") from None
    except ImportError as error:  # EnvPool's Procgen without the Qt 5 runtime (libQt5Gui.so.5)
        family = envpool.registration.registry.specs[env_id][0].removeprefix("envpool.")
        fix = ("install the Qt 5 runtime: apt-get install libqt5gui5 (Debian, Ubuntu) or dnf install qt5-qtbase"
               if family == "procgen" else str(error).splitlines()[0])
        raise ConfigError(f"--env-id {env_id}: EnvPool's {family} tasks cannot load here; {fix}") from None


ATARI_ENCODERS = ("impala", "nature")  # --atari-encoder's choices: sebulba.networks.make_atari_encoder


def check_network(env_id: str, channels, hiddens, atari_encoder: str = "impala"):
    """The conv encoders of pixel tasks (Atari, Procgen, CarRacing: `sebulba.envs.observations`):
    --atari-encoder names one of ATARI_ENCODERS; the IMPALA ResNet needs at least one conv stack and
    one dense layer, the Nature CNN one dense layer.

    Raises:
      ConfigError: `env_id` is not an EnvPool task (`check_env_id`, first), --atari-encoder is
        unknown, or --channels or --hiddens is empty where the pixel encoder needs them.
    """
    check_env_id(env_id)
    if atari_encoder not in ATARI_ENCODERS:
        raise ConfigError(f"--atari-encoder {atari_encoder}: use one of {', '.join(ATARI_ENCODERS)}")
    if observations(env_id).kind != "pixels":
        return
    if atari_encoder == "nature" and not hiddens:
        raise ConfigError("--hiddens is empty: the Nature CNN needs at least one dense layer (the paper's: 512)")
    if atari_encoder == "impala" and (not channels or not hiddens):
        raise ConfigError(f"--channels {' '.join(map(str, channels))} --hiddens {' '.join(map(str, hiddens))}: "
                          "the IMPALA ResNet needs at least one width in each (defaults: 16 32 32 and 256)")


def nearest_multiples(value: int, divisor: int) -> str:
    """'48 or 64': the multiples of `divisor` on either side of `value` (positive ones only)."""
    lower = (value // divisor) * divisor
    options = [v for v in (lower, lower + divisor) if v > 0]
    return " or ".join(str(v) for v in options)


def normalization(env_id: str, norm_obs: bool | None, norm_reward: bool | None) -> tuple[bool, bool]:
    """(--norm-obs, --norm-reward) with None resolved: on for MuJoCo tasks, off otherwise."""
    default = is_mujoco(env_id)
    return (default if norm_obs is None else norm_obs, default if norm_reward is None else norm_reward)


# What JAX's own SLURM detection reads (jax._src.clusters.SlurmCluster); all are set inside an `srun` step.
SLURM_STEP_VARS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")


@dataclass(frozen=True)
class Cluster:
    """The processes of this run: (1, 0) unless --distributed. `coordinator` says where the
    address came from, for the error a process gives when it cannot reach it."""

    num_processes: int = 1
    process_id: int = 0
    coordinator_address: str | None = None  # host:port of process 0's coordinator service
    slurm_job_id: str | None = None
    coordinator: str = "--coordinator-address"
    coordinator_timeout_s: float = 45.0


def first_host(nodelist: str) -> str:
    """The first host of a Slurm hostlist: 'n[1-2],m3' -> 'n1', 'node[007,009-011]' -> 'node007',
    'a,b' -> 'a' (JAX's own rule, jax/_src/clusters/slurm_cluster.py)."""
    name, _, ranges = nodelist.split(",")[0].partition("[")
    return name + ranges.split("-")[0].rstrip("]")


def slurm_coordinator(env) -> tuple[str, str]:
    """(host:port, where it came from) of a SLURM step's coordinator, as JAX derives it: the first
    node of SLURM_STEP_NODELIST; port JAX_COORDINATOR_PORT, else 61440 + SLURM_JOB_ID mod 4096.
    A node name that does not resolve (NodeName differs from the host name) is replaced by the
    node's NodeAddr from `scontrol show node`, when that resolves."""
    nodelist = env["SLURM_STEP_NODELIST"]
    host = first_host(nodelist)
    port = env.get("JAX_COORDINATOR_PORT") or str(int(env["SLURM_JOB_ID"]) % 2**12 + 2**16 - 2**12)
    where = f"the first node of SLURM_STEP_NODELIST={nodelist}"
    if not resolves(host):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            shown = subprocess.run(["scontrol", "show", "node", "-o", host], capture_output=True, text=True,
                                   timeout=10).stdout
            address = next((f[len("NodeAddr="):] for f in shown.split() if f.startswith("NodeAddr=")), host)
            if address != host and resolves(address):
                host, where = address, f"NodeAddr of {host}, {where}"
    return f"{host}:{port}", where


def resolves(host: str) -> bool:
    try:
        socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError):
        return False
    return True


def detect_cluster(flags: RunFlags) -> Cluster:
    """Processes of a --distributed run, from the flags, JAX_* variables or a SLURM step.

    In an srun step SLURM gives the process count and index; the coordinator is
    --coordinator-address (or JAX_COORDINATOR_ADDRESS) if given, else `slurm_coordinator`'s. A
    shell on an allocated SLURM node (SLURM_JOB_ID set, no step variables) runs as a single
    process and says so.

    Raises:
      ConfigError: --distributed with neither SLURM nor a complete coordinator setting.
    """
    if not flags.distributed:
        given = [f for f, v in (("--coordinator-address", flags.coordinator_address), ("--num-processes",
                                 flags.num_processes), ("--process-id", flags.process_id)) if v is not None]
        if given:
            raise ConfigError(f"{', '.join(given)} only apply with --distributed; add it to join a multi-process run")
        return Cluster()
    if not flags.coordinator_timeout_s > 0:
        raise ConfigError(f"--coordinator-timeout-s={flags.coordinator_timeout_s} must be > 0")
    env = os.environ
    address = flags.coordinator_address or env.get("JAX_COORDINATOR_ADDRESS")
    where = "--coordinator-address" if flags.coordinator_address else "JAX_COORDINATOR_ADDRESS"
    count = flags.num_processes if flags.num_processes is not None else env.get("JAX_NUM_PROCESSES")
    index = flags.process_id if flags.process_id is not None else env.get("JAX_PROCESS_ID")
    if (count, index) == (None, None) and all(v in env for v in SLURM_STEP_VARS):
        if address is None:
            address, where = slurm_coordinator(env)
        return Cluster(int(env["SLURM_NTASKS"]), int(env["SLURM_PROCID"]), address, env["SLURM_JOB_ID"], where,
                       flags.coordinator_timeout_s)
    if (address, count, index) != (None, None, None):
        missing = [f for f, v in (("--coordinator-address", address), ("--num-processes", count),
                                  ("--process-id", index)) if v is None]
        if missing:
            raise ConfigError(f"--distributed outside SLURM also needs {' and '.join(missing)} "
                              "(or JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID)")
        count, index = int(count), int(index)
        if not 0 <= index < count:
            raise ConfigError(f"--process-id={index} must be in 0..{count - 1} for --num-processes={count}")
        return Cluster(count, index, address, env.get("SLURM_JOB_ID"), where, flags.coordinator_timeout_s)
    if "SLURM_JOB_ID" in env:
        missing = ", ".join(v for v in SLURM_STEP_VARS if v not in env)
        tasks = f"; launch with srun to run all {env['SLURM_NTASKS']} tasks" if int(env.get("SLURM_NTASKS", 1)) > 1 else ""
        print(f"--distributed: SLURM_JOB_ID is set but {missing} not (a shell on an allocated node, not an srun "
              f"step): running as a single process{tasks}")
        return Cluster(slurm_job_id=env["SLURM_JOB_ID"])
    raise ConfigError("--distributed needs a SLURM step (launch with srun) or --coordinator-address, --num-processes "
                      "and --process-id (scripts/launch_local.py sets them on one machine)")


@dataclass(frozen=True)
class Setup:
    """Quantities derived once from the flags (never CLI flags). Counts are global (every
    process) unless the name says local. A script may subclass it for its own sizes."""

    run_name: str
    async_batch_size: int
    num_env_threads: int
    num_actor_threads_total: int  # local: over every actor device of this process
    num_envs_total: int  # envs feeding one update, every process
    batch_size: int  # env steps per update, every process
    num_updates: int
    envs_per_learner: int
    num_processes: int = 1
    process_id: int = 0
    norm_obs: bool = False  # --norm-obs / --norm-reward resolved (None: on for MuJoCo)
    norm_reward: bool = False
    read_mission: bool = False  # --read-mission resolved (None: on where the task's mission varies)
    episodic_life: bool = False  # --episodic-life resolved (None: the --atari-protocol's; never outside Atari)
    atari_protocol: str | None = None  # --atari-protocol where it applies (Atari); None: the task is not Atari
    procgen_levels: dict | None = None  # Procgen: {"train": envpool's level settings, "eval": ..., "distribution_mode"}


def check_wandb_login():
    """--track needs W&B credentials (`wandb login`, WANDB_API_KEY) unless WANDB_MODE is offline or
    disabled; looked up without a prompt and without the network (wandb.login(verify=False)).

    Raises:
      ConfigError: no credentials; before wandb.init could print its traceback and leave a run behind.
    """
    import wandb

    if os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun"):
        return
    if not wandb.login(prompt=False, verify=False):
        raise ConfigError("--track found no W&B login: run `wandb login` (or set WANDB_API_KEY), or set "
                          "WANDB_MODE=offline to log locally and `wandb sync` later")


def resolve_run(flags: RunFlags, num_steps: int, cluster: Cluster = Cluster()) -> Setup:
    """Check the shared flags and derive the batch arithmetic over every process of `cluster`
    for rollouts of `num_steps` transitions per env.

    Raises:
      ConfigError: one line naming the flag and valid values.
    """
    check_env_id(flags.env_id)  # first: the checks below ask EnvPool about the task
    if flags.atari_protocol not in ATARI_PROTOCOLS:
        raise ConfigError(f"--atari-protocol {flags.atari_protocol}: use one of {', '.join(ATARI_PROTOCOLS)}")
    check_ranges(flags, positive=("local_num_envs", "num_actor_threads", "total_timesteps", "log_frequency"),
                 above_zero=("stall_timeout_s",),
                 non_negative=("max_policy_lag", "checkpoint_interval", "eval_interval", "eval_episodes",
                               "num_env_threads", "procgen_num_levels", "procgen_start_level"))  # a negative thread count aborts inside EnvPool
    if flags.run_name is not None and (not flags.run_name or Path(flags.run_name).name != flags.run_name
                                       or flags.run_name in (".", "..")):
        raise ConfigError(f"--run-name {flags.run_name!r} must name one directory inside runs/: no '/', '.' or '..'")
    if not flags.actor_device_ids or not flags.learner_device_ids:
        raise ConfigError("--actor-device-ids and --learner-device-ids each need at least one id")
    for name, ids in (("actor", flags.actor_device_ids), ("learner", flags.learner_device_ids)):
        if len(set(ids)) != len(ids) or min(ids) < 0:
            raise ConfigError(f"--{name}-device-ids {ids}: ids must be distinct and >= 0")
    if flags.track and cluster.process_id == 0:  # only process 0 logs
        check_wandb_login()
    if flags.eval_interval and not flags.eval_episodes:
        raise ConfigError(f"--eval-interval={flags.eval_interval} needs --eval-episodes > 0")
    norm_obs, norm_reward = normalization(flags.env_id, flags.norm_obs, flags.norm_reward)
    if is_atari(flags.env_id) and (norm_obs or norm_reward):
        raise ConfigError("--norm-obs and --norm-reward are for vector observations; Atari frames are scaled by 1/255 "
                          "and rewards clipped to [-1, 1]")
    if observations(flags.env_id).kind == "pixels" and norm_obs:
        raise ConfigError(f"--norm-obs is for vector observations; {flags.env_id}'s pixels are scaled by 1/255")
    if is_minigrid(flags.env_id) and norm_obs:
        raise ConfigError("--norm-obs is for vector observations; a MiniGrid observation holds object, colour and "
                          "state ids, which the network embeds")
    if flags.read_mission and not is_minigrid(flags.env_id):
        raise ConfigError(f"--read-mission is for MiniGrid and BabyAI tasks; {flags.env_id} has no mission")
    n = flags.local_num_envs
    lockstep = flags.deterministic or flags.max_policy_lag == 0  # every env in every recv
    if lockstep and flags.async_batch_size not in (None, n):
        mode = "--deterministic" if flags.deterministic else "--max-policy-lag 0 (synchronous)"
        raise ConfigError(f"{mode} steps every env in lockstep: drop --async-batch-size or set it to "
                          f"--local-num-envs={n}")
    async_batch = flags.async_batch_size if flags.async_batch_size is not None else n if lockstep else max(1, n // 2)
    if not 0 < async_batch <= n or n % async_batch:
        raise ConfigError(f"--async-batch-size={async_batch} must divide --local-num-envs={n}; "
                          f"use one of {[d for d in range(1, n + 1) if n % d == 0]}")
    num_learners = len(flags.learner_device_ids)  # per process; each process feeds its own learner devices
    if n % num_learners:
        raise ConfigError(f"--local-num-envs={n} is not divisible by {num_learners} learner devices; "
                          f"use {nearest_multiples(n, num_learners)}")
    num_threads = len(flags.actor_device_ids) * flags.num_actor_threads
    num_envs_total = cluster.num_processes * num_threads * n
    batch_size = num_steps * num_envs_total
    if flags.total_timesteps < batch_size:
        raise ConfigError(f"--total-timesteps={flags.total_timesteps} is smaller than one batch ({batch_size} env steps "
                          f"= num_steps x envs); use at least {batch_size}")
    if flags.run_name is None and cluster.num_processes > 1 and cluster.slurm_job_id is None:
        raise ConfigError("--distributed: give every process the same --run-name (the default contains the start time)")
    # Under SLURM the default name is stable across requeues of the job, which then resume.
    stamp = f"slurm{cluster.slurm_job_id}" if cluster.slurm_job_id else str(int(time.time()))
    cores = os.cpu_count() or 1
    return Setup(
        run_name=flags.run_name or f"{flags.env_id.replace('/', '_')}__{flags.exp_name}__{flags.seed}__{stamp}",
        async_batch_size=async_batch,
        num_env_threads=flags.num_env_threads or max(1, cores // num_threads),
        num_actor_threads_total=num_threads,
        num_envs_total=num_envs_total,
        batch_size=batch_size,
        num_updates=flags.total_timesteps // batch_size,
        envs_per_learner=num_envs_total // (cluster.num_processes * num_learners),
        num_processes=cluster.num_processes,
        process_id=cluster.process_id,
        norm_obs=norm_obs,
        norm_reward=norm_reward,
        read_mission=reads_mission(flags.env_id, flags.read_mission),
        episodic_life=resolve_episodic_life(flags.env_id, flags.atari_protocol, flags.episodic_life),
        atari_protocol=flags.atari_protocol if is_atari(flags.env_id) else None,
        procgen_levels=procgen_record(flags),
    )


def procgen_record(flags: RunFlags) -> dict | None:
    """What a Procgen run trains and evaluates on, for config.json: EnvPool's level settings of the
    training and the evaluation pools (`sebulba.envs.procgen_levels`) and the distribution mode its
    id names; None outside Procgen."""
    if not is_procgen(flags.env_id):
        return None
    levels = [procgen_levels(flags.env_id, flags.procgen_start_level, flags.procgen_num_levels, evaluation)
              for evaluation in (False, True)]
    mode = envpool.make_spec(flags.env_id).config.distribution_mode
    return dict(train=levels[0], eval=levels[1], distribution_mode=PROCGEN_MODES.get(mode, mode))


PROCGEN_MODES = {0: "easy", 1: "hard", 2: "extreme", 3: "memory", 10: "exploration"}  # procgen's DistributionMode
