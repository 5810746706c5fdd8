"""Checkpoints and resume: orbax checkpoints of a run's learner state and metadata under
runs/<run>/checkpoints/<update>, and the check that a resumed run has the flags it was
written with.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from sebulba.config import ConfigError, RunFlags, normalization
from sebulba.envs import is_atari, resolve_episodic_life
from sebulba.missions import reads_mission


# Flags that may differ between a run and its resumption; every other flag must match
# (--norm-obs, --norm-reward and --read-mission by their resolved values).
RESUMABLE_FLAGS = {"run_name",  # the checkpoint was found under runs/<run name>: a run started without one resumes with it
                   "track", "wandb_project_name", "wandb_entity", "log_frequency", "num_env_threads",
                   "stall_timeout_s", "checkpoint_interval", "total_timesteps", "eval_interval", "eval_episodes",
                   "eval_greedy", "norm_obs", "norm_reward", "read_mission", "compilation_cache_dir",
                   "atari_protocol", "episodic_life"}  # compared as resolved in read_resume_meta


def is_complete(step_dir: Path) -> bool:
    """orbax finished writing this checkpoint: its commit marker and its metadata are there. A
    directory a process left while it died saving (or one a file system copied half-way) lacks
    them, and orbax would still list it as a step (flax PR#1200, maxtext PR#5260)."""
    return (step_dir / "commit_success.txt").is_file() and (step_dir / "_CHECKPOINT_METADATA").is_file()


def incomplete_steps(directory: Path) -> list[Path]:
    """Step directories under `directory` that orbax never finished (see `is_complete`)."""
    if not directory.is_dir():
        return []
    return sorted((p for p in directory.iterdir() if p.is_dir() and p.name.isdigit() and not is_complete(p)),
                  key=lambda p: int(p.name))


def set_aside(paths: list[Path]) -> list[Path]:
    """Rename unfinished step directories to <step>.incomplete-<unix time> (kept for a look, ignored
    by orbax), so that the run can save that step again. Returns the new paths."""
    moved = []
    for path in paths:
        moved.append(path.rename(path.with_name(f"{path.name}.incomplete-{int(time.time())}")))
    return moved


def complete_steps(directory: Path) -> list[int]:
    """The updates of the finished checkpoints under `directory`, oldest first."""
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.is_dir() and p.name.isdigit() and is_complete(p))


def read_meta(directory: Path, update: int) -> dict:
    """The JSON metadata saved with checkpoint `update` in `directory` (updates done, global env step,
    the learner's key, the last episodes, the flags).

    Raises:
      Exception: orbax's, for a checkpoint it cannot read (they have no common base).
    """
    manager = ocp.CheckpointManager(directory.absolute(), options=ocp.CheckpointManagerOptions(create=False))
    try:
        return manager.restore(update, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
    finally:
        manager.close()


def read_resume_meta(directory: Path, flags: RunFlags, num_processes: int = 1) -> dict | None:
    """Metadata of the newest finished checkpoint in `directory`, or None for a new run
    (unfinished ones are skipped: `incomplete_steps`). `flags` (a script's Args) must match the
    saved ones, except RESUMABLE_FLAGS.

    Raises:
      ConfigError: the checkpoint is unreadable or was written with other flags.
    """
    steps = complete_steps(directory)
    if not steps:
        return None
    update = steps[-1]
    try:
        meta = read_meta(directory, update)
    except Exception as error:  # noqa: BLE001 - any unreadable checkpoint is the same error to the user
        raise ConfigError(f"cannot read checkpoint {directory}/{update} ({type(error).__name__}); "
                          "delete it or use a new --run-name") from error
    saved = meta["args"]
    now = json.loads(json.dumps(dataclasses.asdict(flags)))
    # A deterministic run restarts its envs at every checkpoint interval: the interval is part of the run.
    resumable = RESUMABLE_FLAGS - {"checkpoint_interval"} if flags.deterministic else RESUMABLE_FLAGS
    differ = [f"--{k.replace('_', '-')} {saved[k]} (now {v})" for k, v in now.items()
              if k not in resumable and k in saved and v != saved[k]]
    was = normalization(flags.env_id, saved.get("norm_obs"), saved.get("norm_reward"))
    now_norm = normalization(flags.env_id, flags.norm_obs, flags.norm_reward)
    differ += [f"--{flag} {old} (now {new})" for flag, old, new in zip(("norm-obs", "norm-reward"), was,
                                                                       now_norm) if old != new]
    # The Atari protocol as resolved; a run from before --atari-protocol trained by Machado et al.'s settings.
    if is_atari(flags.env_id):
        was_protocol = saved.get("atari_protocol", "machado")
        differ += [f"--atari-protocol {was_protocol} (now {flags.atari_protocol})"] * (was_protocol != flags.atari_protocol)
        was_life, now_life = (resolve_episodic_life(flags.env_id, p, e) for p, e in (
            (was_protocol, saved.get("episodic_life")), (flags.atari_protocol, flags.episodic_life)))
        differ += [f"--episodic-life {was_life} (now {now_life})"] * (was_life != now_life)
    # A run from before --atari-encoder used the IMPALA ResNet.
    if "atari_encoder" not in saved and getattr(flags, "atari_encoder", "impala") != "impala":
        differ.append(f"--atari-encoder impala (now {flags.atari_encoder})")
    # A run from before --read-mission did not read the mission.
    was_read, now_read = (reads_mission(flags.env_id, f)
                          for f in (saved.get("read_mission", False), flags.read_mission))
    differ += [f"--read-mission {was_read} (now {now_read})"] * (was_read != now_read)
    if meta.get("num_processes", 1) != num_processes:  # the global batch would change
        differ.append(f"{meta.get('num_processes', 1)} process(es) (now {num_processes})")
    if differ:
        raise ConfigError(f"checkpoint {directory}/{update} was written with " + ", ".join(differ) +
                          "; resume with the same flags or use a new --run-name")
    return meta


class CheckpointError(RuntimeError):
    """A checkpoint could not be written; the message names its directory."""


class Checkpointer:
    """orbax checkpoints in runs/<run>/checkpoints/<update>: the LearnerState (params, optimizer
    state, step, normalisation statistics) and JSON metadata (update and env-step counters, learner PRNG key, recent
    episodes, W&B run id, the flags). orbax writes to a temporary directory and renames it
    when complete, so a checkpoint half-written when the process died is never loaded. The
    newest 3 are kept."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.manager = ocp.CheckpointManager(directory.absolute(), options=ocp.CheckpointManagerOptions(max_to_keep=3))
        self.failed = False

    def save(self, update: int, state, meta: dict, extra: dict | None = None):
        """Save `state`, `meta` and the `extra` items ({name: pytree of arrays}, each restored on its
        own by `restore_item`: SAC's replay buffer, which evaluation never reads) and wait until
        the checkpoint is on disk: orbax saves in a background thread and
        reports a failure only at a later call (orbax#605, keras#23609), by when the run had
        trained on and the summary named a checkpoint that does not exist.

        Raises:
          CheckpointError: the save failed (the directory is named; the newest saved one too).
        """
        try:
            items = {name: ocp.args.StandardSave(item) for name, item in (extra or {}).items()}
            self.manager.save(update, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                              meta=ocp.args.JsonSave(meta), **items), force=True)
            self.manager.wait_until_finished()
        except Exception as error:  # noqa: BLE001 - whatever the storage raised, the run cannot go on unsaved
            self.failed = True
            saved = complete_steps(self.directory)
            raise CheckpointError(f"could not save checkpoint {self.directory}/{update} ({type(error).__name__}: "
                                  f"{error}); the newest saved one is "
                                  f"{f'{self.directory}/{saved[-1]}' if saved else 'none'}") from error

    def restore_state(self, update: int, like):
        """The state saved at `update`, laid out (shapes, dtypes, shardings) like `like`."""
        return self.restore_item(update, "state", like)

    def restore_item(self, update: int, name: str, like):
        """Item `name` ("state", or one of `save`'s extra items) saved at `update`, laid out like `like`."""
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        return self.manager.restore(update, args=ocp.args.Composite(**{name: ocp.args.StandardRestore(abstract)}))[name]

    def close(self):
        """Wait for pending saves and close; after a failed save (already raised) it raises nothing."""
        if self.failed:
            with contextlib.suppress(Exception):
                self.manager.close()
            return
        self.manager.wait_until_finished()
        self.manager.close()
