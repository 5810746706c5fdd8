"""The run around a script's threads: `Run`, what the actor, learner and eval threads of one
run share, and the steps every script's `main` takes in the same order. `Run.open` starts the
devices, checks for a checkpoint to resume and prints the layout; `Run.resume` restores the
learner state; `Run.actor_pool` gives an actor thread its EnvPool pool and rollout assembler;
`Run.launch` opens the metric sinks, runs the threads (and the eval thread) under the
supervisor and the stop signals, and writes the summary; `run_cli` maps the outcome to the
exit code. The run directory is written (`Run.write`) only once the run passed every check:
at `resume` for a resumed run, at `launch` for a new one.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import difflib
import json
import os
import queue
import shlex
import signal
import sys
import threading
import time
import typing
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np
import tyro

from sebulba.checkpoints import Checkpointer, incomplete_steps, read_resume_meta, set_aside
from sebulba.config import Cluster, ConfigError, RunFlags, Setup, flag, script_flags
from sebulba.rundir import release_run_dirs, run_dir_owner, script_args, script_module, software
from sebulba.devices import Placement, setup_devices, use_compilation_cache
from sebulba.envs import env_segments, is_atari, is_minigrid, is_procgen, make_envs, pool_seed
from sebulba.evaluation import Evaluator, eval_seed, run_evaluator
from sebulba.metrics import Logger
from sebulba.rollouts import RolloutAssembler, obs_storage
from sebulba.threads import AnyEvent, ParamsSlot, RunFailed, Stopped, StopSignals, Supervisor, Timer, timed_get


@dataclass
class Run:
    """What the threads of one run share. Process 0 alone writes the run directory, logs and
    the console (`lead`)."""

    flags: RunFlags  # the script's Args
    setup: Setup
    run_dir: Path
    placement: Placement | None = None
    checkpointer: Checkpointer | None = None
    logger: Logger | None = None
    meta: dict | None = None  # the checkpoint resumed from, None for a new run
    start_update: int = 0
    wandb_id: str | None = None
    episodes: collections.deque = field(default_factory=lambda: collections.deque(maxlen=20))  # (raw return, length)
    params_slot: ParamsSlot | None = None
    queues: list[queue.Queue] = field(default_factory=list)  # actor thread i -> learner: queues[i]
    stop: threading.Event = field(default_factory=threading.Event)  # the run ends or failed: every thread returns
    preempt: threading.Event = field(default_factory=threading.Event)  # a stop signal: checkpoint, then end
    eval_results: queue.Queue = field(default_factory=lambda: queue.Queue(maxsize=4))  # eval thread -> learner
    make_evaluator: Any = None  # () -> Evaluator for the final evaluation; None: none on this process
    explored_name: str = "sampled"  # the evaluation's other policy, without --eval-greedy (a Q-network's: ε-greedy)
    summary: dict = field(default_factory=dict)
    signum: int = 0  # the first stop signal this process received
    stopped_by: int = 0  # the stop signal the learner acted on (agreed over every process)
    finished: bool = False  # Run.open found the run already done: `summary` is its summary

    @property
    def lead(self) -> bool:
        return self.setup.process_id == 0

    @property
    def interrupted(self):
        """Set when a thread must stop waiting. With several processes, only when the learners have
        agreed to stop (`stop`): one process alone must not leave the update loop, the others
        would wait in a collective."""
        return AnyEvent(self.stop, self.preempt) if self.setup.num_processes == 1 else self.stop

    @classmethod
    def open(cls, flags: RunFlags, setup: Setup, cluster: Cluster = Cluster()) -> Run:
        """Start the devices, look for a checkpoint under runs/<run_name>/checkpoints (a finished
        run returns with `finished` and its summary) and print the layout. Nothing is written yet:
        a run refused before it starts (the memory check) leaves no directory behind; `write`
        creates it.

        Raises:
          ConfigError: a device id that does not exist, an unreadable or mismatched checkpoint.
        """
        run = cls(flags, setup, Path("runs") / setup.run_name)
        use_compilation_cache(flags.compilation_cache_dir)
        actor_devices, learner_devices = setup_devices(flags.actor_device_ids, flags.learner_device_ids,
                                                       cluster)  # first: orbax starts the JAX backend
        run.placement = Placement(actor_devices, learner_devices)
        run.meta = read_resume_meta(run.run_dir / "checkpoints", flags, setup.num_processes)
        if setup.num_processes > 1:  # every process has looked for a checkpoint before any creates the directory
            run.placement.agree_max(0)
        if run.meta is not None and run.meta["update"] >= setup.num_updates:
            run.finished, run.summary = True, run.finished_summary()
            return run
        if run.lead and flags.deterministic and not flags.checkpoint_interval:
            print("warning: --deterministic with --checkpoint-interval 0: a stop signal leaves nothing to resume from")
        if run.lead:
            print(layout_line(flags, setup, len(actor_devices), len(learner_devices)), flush=True)
            if setup.num_updates * setup.batch_size != flags.total_timesteps:
                print(f"--total-timesteps {flags.total_timesteps:,} is not a whole number of updates of "
                      f"{setup.batch_size:,} env steps: training {setup.num_updates * setup.batch_size:,} env steps "
                      f"({setup.num_updates} updates)", flush=True)
        run.wandb_id = uuid.uuid4().hex[:12] if flags.track else None
        if run.meta is not None:
            run.start_update, run.wandb_id = run.meta["update"], run.meta["wandb_id"] or run.wandb_id
            run.episodes.extend(map(tuple, run.meta["episodes"]))
        run.params_slot = ParamsSlot(keep=flags.max_policy_lag + 2 if flags.deterministic else 1)
        return run

    def write(self):
        """Take the run directory (`run_dir_owner`: one process at a time; refused with a
        ConfigError naming the owner), create runs/<run_name>/ (a resumed run's is there
        already), set aside unfinished checkpoints, open the checkpointer and write config.json with `setup` as it is now (a
        script may have settled sizes since `open`). Once: `resume` calls it for a resumed run,
        `launch` for a new one, after the checks that can refuse it."""
        if self.checkpointer is not None:
            return
        setup, flags = self.setup, self.flags
        held_by = run_dir_owner(self.run_dir) if self.lead else None  # process 0 owns the directory for the run
        if setup.num_processes > 1 and self.placement.agree_max(held_by is not None):  # every process refuses
            held_by = held_by or "another launch (process 0 of this run says which)"
        if held_by is not None:
            raise ConfigError(f"{self.run_dir} is in use by {held_by}: wait for it to end, or give another --run-name")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        unfinished = incomplete_steps(self.run_dir / "checkpoints")
        if unfinished and self.lead:  # orbax would list them as steps and refuse to save those steps again
            for path in set_aside(unfinished):
                print(f"checkpoint {path.parent}/{path.name.split('.')[0]} was never finished (the process died while "
                      f"saving it?): set aside as {path.name}; "
                      + (f"resuming from update {self.meta['update']}" if self.meta else "starting anew"))
        if unfinished and setup.num_processes > 1:
            self.placement.agree_max(0)
        self.checkpointer = Checkpointer(self.run_dir / "checkpoints")
        if self.lead:
            (self.run_dir / "config.json").write_text(json.dumps({"args": script_args(flags),
                                                                  "derived": dataclasses.asdict(setup),
                                                                  "software": software(),
                                                                  "script": script_module(flags)}, indent=2))
            print(f"writing {self.run_dir}/: config.json, TensorBoard events, checkpoints/, summary.json at the end; "
                  "watch it with: tensorboard --logdir runs", flush=True)

    def finished_summary(self) -> dict:
        meta, flags = self.meta, self.flags
        if self.lead:
            print(f"{self.run_dir} already finished at update {meta['update']} (global step {meta['global_step']}); "
                  "raise --total-timesteps to train it further")
        summary_file = self.run_dir / "summary.json"
        summary = json.loads(summary_file.read_text()) if summary_file.exists() else {"global_step": meta["global_step"]}
        if self.lead and flags.eval_episodes and "final_eval" not in summary:
            print(f"it has no final evaluation (stopped during it?): python scripts/evaluate.py {self.run_dir} --episodes "
                  f"{flags.eval_episodes} --seed {eval_seed(flags.seed)}{' --greedy' * flags.eval_greedy}")
        return summary

    def resume(self, state, learner_key):
        """(state, learner key replicated over the learner mesh): restored from the checkpoint
        `open` found (after `write`), or as given for a new run."""
        if self.meta is not None:
            self.write()
            state = self.checkpointer.restore_state(self.start_update, state)
            learner_key = np.asarray(self.meta["learner_key"], dtype=np.uint32)
            if self.lead:
                print(f"resumed from {self.checkpointer.manager.directory}/{self.start_update}: update "
                      f"{self.start_update}, global step {self.meta['global_step']}")
        return state, self.placement.replicate(learner_key)

    def env_segments(self) -> list[tuple[int, int]]:
        """Rollout ranges [begin, end) of this session, one EnvPool pool each (see envs.env_segments)."""
        return env_segments(self.start_update, self.setup.num_updates, self.flags.deterministic,
                            self.flags.checkpoint_interval)

    @contextlib.contextmanager
    def actor_pool(self, thread_index: int, begin: int, spec, key, num_steps: int, gamma: float,
                   continuous: bool):
        """(EnvPool pool, RolloutAssembler, action key) of local actor thread `thread_index` for
        the segment starting at rollout `begin`; the pool is closed on exit. Env seeds and
        action keys are distinct per thread of every process and fresh for every pool."""
        flags, setup = self.flags, self.setup
        global_index = setup.process_id * setup.num_actor_threads_total + thread_index
        n = flags.local_num_envs
        seed = pool_seed(flags.seed, global_index, begin, setup.num_envs_total, n)
        envs = make_envs(flags.env_id, n, setup.async_batch_size, seed, setup.num_env_threads, flags.atari_protocol,
                         flags.episodic_life, **(setup.procgen_levels or {}).get("train", {}))
        assembler = RolloutAssembler(n, num_steps, *obs_storage(spec.observation_space),
                                     clip_rewards=is_atari(flags.env_id), episodic_life=setup.episodic_life,
                                     first_rollout=begin, action_shape=spec.action_space.shape, gamma=gamma,
                                     action_dtype=np.float32 if continuous else np.int32)
        try:
            yield envs, assembler, jax.random.fold_in(jax.random.fold_in(key, global_index), begin)
        finally:
            envs.close()

    def add_evaluator(self, agent, spec):
        """On process 0: the final evaluation (--eval-episodes) and the eval thread
        (--eval-interval, started by `launch`, on a pool of its own)."""
        flags, setup = self.flags, self.setup
        self.explored_name = "ε-greedy" if getattr(agent, "q_network", False) else "sampled"
        if self.lead and flags.eval_episodes:
            self.make_evaluator = lambda: Evaluator(flags.env_id, flags.eval_episodes, agent, spec.action_space,
                                                    flags.eval_greedy, eval_seed(flags.seed),
                                                    flags.atari_protocol, flags.episodic_life,
                                                    **(setup.procgen_levels or {}).get("eval", {}))

    def log_eval(self, metrics: dict[str, float], global_step: int, final: bool = False, late: bool = False):
        """eval/* metrics to TensorBoard / W&B at `global_step`, and one console line."""
        version = int(metrics["eval/params_version"])
        self.logger.log(metrics | {"eval/global_step": version * self.setup.batch_size}, global_step)
        print(f"{'final eval' if final else 'eval'} at update {version} "
              f"({'greedy' if self.flags.eval_greedy else self.explored_name} actions): return "
              f"{metrics['eval/episodic_return_mean']:.1f} ± {metrics['eval/episodic_return_std']:.1f}, length "
              f"{metrics['eval/episodic_length_mean']:.1f}"
              + (f", success rate {metrics['eval/success_rate']:.2f}" if is_minigrid(self.flags.env_id) else "")
              + f" ({self.flags.eval_episodes} episodes, {metrics['eval/time_s']:.1f}s)"
              + ", finished after the last update" * late, flush=True)

    def stop_requested(self) -> int:
        """The stop signal to act on now, agreed over every process (0: none); sets `stopped_by`."""
        self.stopped_by = (self.signum if self.setup.num_processes == 1
                           else self.placement.agree_max(self.signum))
        if self.stopped_by and not self.signum and self.lead:
            print(f"{signal.Signals(self.stopped_by).name} on another process: checkpointing and stopping", flush=True)
        return self.stopped_by

    def next_items(self, timer: Timer) -> list | None:
        """The learner's wait: one item from each of `queues`, in order, timed as
        rollout_queue_get_time_s. None when a stop signal ended the wait (`stopped_by` is set;
        the learner ends at this update boundary).

        Raises:
          StallError: a queue stayed empty for --stall-timeout-s.
          Stopped: the run is stopping because a thread failed.
        """
        try:
            with timer("rollout_queue_get_time_s"):
                return [timed_get(q, self.interrupted, self.flags.stall_timeout_s, f"learner (from actor thread {i})")
                        for i, q in enumerate(self.queues)]
        except Stopped:
            if not self.preempt.is_set():
                raise
            self.stopped_by = self.signum
            return None

    def on_signal(self, signum: int):
        self.signum = signum
        self.preempt.set()

    def launch(self, supervisor: Supervisor, learner: threading.Thread) -> dict:
        """Run the threads until the learner returns, a thread fails or a stop signal has been
        checkpointed; close the logger and checkpoints; write and return the summary.

        Raises:
          RunFailed: a thread failed (its traceback was printed) or stalled.
        """
        self.write()  # a new run's directory: it starts now
        setup, flags = self.setup, self.flags
        doing = "stopping (--deterministic: no new checkpoint)" if flags.deterministic else "checkpointing and stopping"
        self.logger = Logger(self.run_dir, self.lead, flags.track, flags.wandb_project_name, flags.wandb_entity,
                             setup.run_name, self.wandb_id, dict(script_args(flags), **dataclasses.asdict(setup)),
                             resumed_at=self.start_update * setup.batch_size if self.meta is not None else None)
        try:
            with StopSignals(self.on_signal, doing):
                start_time = time.time()
                if self.make_evaluator is not None and flags.eval_interval:
                    supervisor.add("evaluator", run_evaluator, self.make_evaluator(), self.params_slot,
                                   self.eval_results, self.placement.actor_devices[0], flags.eval_interval,
                                   self.start_update, setup.num_updates, flags.stall_timeout_s, self.interrupted,
                                   first=True)
                supervisor.run(learner)
            while not self.eval_results.empty():  # an evaluation that finished after the learner's last look
                self.log_eval(self.eval_results.get_nowait(), self.summary["global_step"], late=True)
        finally:
            self.logger.close()
            self.checkpointer.close()
        try:
            return self._finish(supervisor, setup, flags, start_time)
        finally:
            release_run_dirs()  # last: a relaunch of this run waits until summary.json is written

    def _finish(self, supervisor: Supervisor, setup: Setup, flags: RunFlags, start_time: float) -> dict:
        """The run's end after every thread has stopped: the first thread error raised, else the
        summary completed, written to summary.json (process 0) and returned."""
        supervisor.raise_first_error(
            f" (process {setup.process_id} of {setup.num_processes}: if this is a failed collective, another process "
            "ended first; its output has the cause)" if setup.num_processes > 1 else "")
        summary = self.summary
        elapsed = time.time() - start_time - summary.get("final_eval", {}).get("time_s", 0.0)  # training alone
        summary.update(elapsed_s=elapsed, sps=(summary["global_step"] - self.start_update * setup.batch_size) / elapsed,
                       run_dir=str(self.run_dir.absolute()))
        if is_atari(flags.env_id):  # what the returns are comparable with (docs/ppo_envpool.md#atari-protocols)
            summary.update(atari_protocol=flags.atari_protocol, episodic_life=setup.episodic_life)
        if self.lead:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
            status = f"stopped by {summary['interrupted_by']}" if "interrupted_by" in summary else "done"
            ret = summary["episodic_return_mean"]
            print(f"{status}: {summary['global_step']} env steps, {elapsed:.1f}s this session ({summary['sps']:.0f} SPS), "
                  f"episodic return {'n/a (no game finished)' if ret is None else f'{ret:.1f}'}; "
                  f"checkpoint {summary.get('checkpoint')}")
            if "interrupted_by" in summary:
                print(f"to resume: {resume_command(setup.run_name)}", flush=True)
        return summary


def layout_line(flags: RunFlags, setup: Setup, num_actor_devices: int, num_learner_devices: int) -> str:
    """The console's first line: the run's name, processes, devices, threads, envs, the batch and
    the number of updates (the docs quote it; tests/test_docs.py checks them against this)."""
    num_steps = setup.batch_size // setup.num_envs_total
    per_process = setup.num_actor_threads_total * flags.local_num_envs
    return (f"run {setup.run_name}{', deterministic' * flags.deterministic}: {setup.num_processes} process(es) x "
            f"{num_actor_devices} actor device(s) x {flags.num_actor_threads} thread(s) x {flags.local_num_envs} "
            f"envs (recv batch {setup.async_batch_size}) = {setup.num_envs_total} envs; {num_learner_devices} "
            f"learner device(s) x {setup.envs_per_learner} envs; env steps per update: "
            f"{num_steps * flags.local_num_envs} per thread, {num_steps * per_process} per process, "
            f"{setup.batch_size} in all; {setup.num_updates} updates" + "; observation normalisation" * setup.norm_obs
            + "; reward scaling" * setup.norm_reward + "; the mission read" * setup.read_mission
            + (f"; Atari protocol {flags.atari_protocol}" + ", a life loss ends a training episode" * setup.episodic_life
               if is_atari(flags.env_id) else "") + procgen_phrase(flags))


def procgen_phrase(flags: RunFlags) -> str:
    """The layout line's words on Procgen's levels ('' elsewhere)."""
    if not is_procgen(flags.env_id):
        return ""
    train = (f"{flags.procgen_num_levels} levels from level {flags.procgen_start_level}" if flags.procgen_num_levels
             else "every level")
    return f"; Procgen: training on {train}, evaluation on the unbounded level distribution"


def resume_command(run_name: str) -> str:
    """The command that resumes this run: the script's own command line with --run-name, when
    it was started as `python sebulba/<script>.py ...`; else a sentence saying the same."""
    script = Path(sys.argv[0])
    if script.suffix != ".py" or script.parent.name != "sebulba" or not script.is_file():
        return f"the same command with --run-name {run_name}"
    argv = sys.argv[1:]
    named = "--run-name" in argv or any(a.startswith("--run-name=") for a in argv)
    return shlex.join(["python", sys.argv[0], *argv, *([] if named else ["--run-name", run_name])])


def run_cli(args_type: type, main, argv: list[str] | None = None) -> int:
    """Command-line entry point of a script: parse `args_type` with tyro, run `main(args)`,
    and return the exit code (docs/reliability.md): 0 finished, 1 a thread failed or stalled,
    2 bad configuration, 128 + signal number when SIGINT (130), SIGTERM (143) or SIGUSR1
    (138) stopped the run after a checkpoint."""
    if threading.current_thread() is threading.main_thread():  # a script lets Ctrl-C kill it while it imports
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if (unknown := unknown_flag(args_type, sys.argv[1:] if argv is None else argv)) is not None:
        print(f"error: {unknown}", file=sys.stderr)
        return 2
    try:
        args = tyro.cli(args_type, args=argv)
    except BrokenPipeError:  # `--help | head`: the reader has gone; end as a pipeline's writer does, quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (Python flushes stdout again at exit)
        return 0
    if (misplaced := family_only_flag(args.env_id, sys.argv[1:] if argv is None else argv)) is not None:
        print(f"error: {misplaced}", file=sys.stderr)
        return 2
    # EnvPool's specs build gymnasium Boxes from float64 bounds; the cast warning is noise.
    warnings.filterwarnings("ignore", message=".*precision lowered by casting to float32", category=UserWarning)
    try:
        summary = main(args)
    except KeyboardInterrupt:  # Ctrl-C before the threads start (devices, compilation): nothing trained yet
        print("interrupted before training started: nothing to save", file=sys.stderr)
        return 128 + signal.SIGINT
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except RunFailed as error:  # the original traceback was printed by its thread
        print(f"error: {error}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        release_run_dirs()
        os._exit(1)  # a thread stuck inside a native call (EnvPool, XLA) must not keep the process alive
    finally:
        release_run_dirs()
    return 128 + getattr(signal, summary["interrupted_by"]) if "interrupted_by" in summary else 0


# Flags of CleanRL's and Cleanba's scripts that a user coming from them types, and ours.
FLAG_HINTS = {"--num-envs": "--local-num-envs (envs per actor thread)", "--gym-id": "--env-id",
              "--cuda": "--actor-device-ids and --learner-device-ids (a GPU is used when JAX has one)",
              "--capture-video": "scripts/evaluate.py RUN_DIR --video", "--save-model": "--checkpoint-interval (checkpoints are always "
              "saved; scripts/share.py RUN_DIR exports one to share)",
              "--upload-model": "scripts/share.py RUN_DIR --upload --hf-entity <user>, after training",
              "--hf-entity": "scripts/share.py RUN_DIR --upload --hf-entity <user>, after training", "--total-steps": "--total-timesteps",
              "--policy-lr": "--learning-rate", "--q-lr": "--learning-rate", "--lr": "--learning-rate"}  # SAC's names in the on-policy scripts


FAMILY_FLAGS = {"--atari-protocol": ("Atari tasks (*-v5)", is_atari), "--episodic-life": ("Atari tasks (*-v5)", is_atari),
                "--procgen-num-levels": ("Procgen tasks", is_procgen), "--procgen-start-level": ("Procgen tasks", is_procgen)}


def family_only_flag(env_id: str, argv: list[str]) -> str | None:
    """One line for a flag of one task family (FAMILY_FLAGS: Atari's protocol, Procgen's levels)
    typed on a task of another, where it would change nothing (config.json's "derived" records
    atari_protocol and procgen_levels null there); None when there is none."""
    given = [name for token in argv if (name := token.split("=", 1)[0].replace("_", "-")) in FAMILY_FLAGS]
    for name in given:
        family, belongs = FAMILY_FLAGS[name]
        try:
            if not belongs(env_id):
                return f"{name} is for {family}; {env_id} is not one: drop the flag"
        except KeyError:  # not an EnvPool id: resolve_run names it, with the ids meant
            return None
    return None


def unknown_flag(args_type: type, argv: list[str]) -> str | None:
    """One line for the first command-line flag that `args_type` does not have, naming what the
    user most likely meant: the script's own hint (`Args.flag_hints`, e.g. SAC's two learning
    rates for --learning-rate), CleanRL's names (FLAG_HINTS), else the closest of its flags; or
    for a switch given a separate value (`--anneal-lr False`, argparse-era CleanRL's spelling),
    how to write it. None when every flag is known (tyro then parses, and answers anything else)."""
    names, types = script_flags(args_type), typing.get_type_hints(args_type)
    pure = {flag(n) for n in names if types[n] is bool}  # switches: tyro adds --no-<flag> (a bool | None flag takes a value)
    known = {"--help", *(flag(n) for n in names), *(f"--no-{name[2:]}" for name in pure)}
    hints = {**FLAG_HINTS, **getattr(args_type, "flag_hints", {})}
    for i, token in enumerate(argv):
        name = token.split("=", 1)[0].replace("_", "-")
        value = argv[i + 1] if i + 1 < len(argv) else ""
        if name in pure and "=" not in token and value.lower() in ("true", "false"):
            return (f"{name} is a switch and takes no value: write {name} or --no-{name[2:]}, "
                    f"not {name} {value} (or {name}={value})")
        if not token.startswith("--") or name in known or token.startswith("--tyro"):
            continue
        module = args_type.__module__
        script = Path(sys.argv[0]).name if module == "__main__" else f"{module.rsplit('.', 1)[-1]}.py"
        meant = hints.get(name) or " or ".join(difflib.get_close_matches(name, sorted(known - {"--help"}), n=3))
        return f"{script} has no flag {name}" + (f"; did you mean {meant}?" if meant else "") + " (--help lists them)"
    return None
