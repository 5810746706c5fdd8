"""EnvPool's training protocol: which task family an id is, how its observations reach the
network (`observations`: pixels, vectors, MiniGrid's dict), the env settings every script trains
and evaluates with, the pools themselves, the check on each `recv` batch, and the pool lifetimes
of a --deterministic run."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Any, NamedTuple

import envpool
import gymnasium
import numpy as np

from sebulba.missions import MissionTokenizer, word_space


def is_atari(env_id: str) -> bool:
    return type(envpool.make_spec(env_id)).__name__ == "AtariEnvSpec"


def is_mujoco(env_id: str) -> bool:
    return envpool.registration.registry.specs[env_id][0].startswith("envpool.mujoco")  # (module, spec class, kw)


def is_procgen(env_id: str) -> bool:
    return envpool.registration.registry.specs[env_id][0] == "envpool.procgen"


class UnsupportedObservations(ValueError):
    """A task whose observations are none of the kinds `observations` serves."""


class Observations(NamedTuple):
    """How a task's observations reach the network, by what they are rather than by family.

    kind: "pixels" (uint8 images served channel-first [C, H, W]: Atari's 4 stacked 84x84 grey
      frames, Procgen's 3x64x64, CarRacing's 96x96x3 transposed from [H, W, C]; a conv encoder),
      "minigrid" (MiniGrid's and BabyAI's dict: image, direction, mission as word ids; the
      MiniGrid encoder), or "vector" (float or integer arrays, flattened by the MLP; a dict of
      vectors such as dm_control's concatenated in the spec's key order; a Discrete observation
      as a one-hot float32 vector).
    space: the observation space as the pools serve it (what rollouts store and networks take).
    serve: the host-side transform of one `recv` batch, or None where EnvPool's arrays are served.
    keys: a dict of vectors' keys in flattening order.
    """

    kind: str
    space: Any
    serve: Callable | None
    keys: tuple[str, ...] = ()


def _channels_last(shape) -> bool:
    return shape[-1] <= 4 < shape[0]  # CarRacing (96, 96, 3), gfootball (72, 96, 4); Atari, Procgen are [C, H, W]


def _is_vector(space) -> bool:
    return type(space).__name__ == "Box" and len(space.shape) <= 1


@functools.cache
def observations(env_id: str) -> Observations:
    """The `Observations` of `env_id` (see there), from EnvPool's spec.

    Raises:
      UnsupportedObservations: a dict that is neither MiniGrid's nor a flat dict of vectors (Jumanji's
        nested dicts), or another space (Tuple, Text), with one line saying what is taken.
      ImportError: EnvPool cannot load the family (Procgen without the system Qt 5 runtime).
    """
    source = envpool.make_spec(env_id).observation_space
    name = type(source).__name__
    if name == "Box" and source.dtype == np.uint8 and len(source.shape) == 3:
        if not _channels_last(source.shape):
            return Observations("pixels", source, None)
        h, w, c = source.shape
        return Observations("pixels", gymnasium.spaces.Box(0, 255, (c, h, w), np.uint8),
                            lambda obs: np.ascontiguousarray(np.moveaxis(obs, -1, 1)))
    if name in ("Box", "MultiBinary"):
        return Observations("vector", source, None)
    if name == "Discrete":
        one_hot, start = np.eye(int(source.n), dtype=np.float32), int(source.start)  # rows picked per recv
        return Observations("vector", gymnasium.spaces.Box(0.0, 1.0, (len(one_hot),), np.float32),
                            lambda obs: one_hot[np.asarray(obs) - start])
    if name == "Dict" and {"image", "direction", "mission"} <= set(source.spaces):
        tokenize = MissionTokenizer(env_id)
        return Observations("minigrid", word_space(source, env_id),
                            lambda obs: {**obs, "mission": tokenize(obs["mission"])})
    if name == "Dict" and all(_is_vector(sub) for sub in source.spaces.values()):
        keys = tuple(source.spaces)  # the task's own order (dm_control's observation dict, the robotics tasks')
        size = sum(int(np.prod(source[k].shape)) for k in keys)
        dtype = np.result_type(*(source[k].dtype for k in keys))
        return Observations("vector", gymnasium.spaces.Box(-np.inf, np.inf, (size,), dtype),
                            lambda obs: np.concatenate([np.asarray(obs[k], dtype).reshape(len(obs[k]), -1)
                                                        for k in keys], axis=1), keys)
    what = f"a dict of {', '.join(source.spaces)} holding more than vectors" if name == "Dict" else f"a {name} space"
    raise UnsupportedObservations(
        f"{env_id}'s observations are {what}; the scripts take pixels (uint8 [H, W, C] or [C, H, W]), vectors, "
        "a dict of vectors (dm_control), a Discrete value (toy text) or MiniGrid's dict: pick a task of those "
        "(README.md#tasks) or add its observations to sebulba/envs.py's `observations`")


def is_minigrid(env_id: str) -> bool:
    """Whether the task is MiniGrid's or BabyAI's (its observations a dict: image, direction, mission)."""
    return observations(env_id).kind == "minigrid"


def has_pixels(env_id: str) -> bool:
    """Whether the task's observations are images (Atari, Procgen, CarRacing), which a conv encoder reads."""
    return observations(env_id).kind == "pixels"


# Named Atari protocols (--atari-protocol): the EnvPool settings of one published setup each, so a run is
# comparable with that source's curves and tables. Rewards always come back raw: clipping for training
# happens in `RolloutAssembler`, so the raw game score stays available (both sources clip in training).
# Every protocol: 84x84 grey frames, 4 stacked, frame skip 4, a 27,000-step (108k-frame) limit.
ATARI_PROTOCOLS: dict[str, dict[str, Any]] = {
    # Cleanba's cleanba_ppo.py / cleanba_impala.py `make_env` (Huang et al. 2023), citing Machado et al. 2018
    # for sticky actions, the full action set and no life-loss signal; EnvPool's default FIRE at reset kept.
    "cleanba": dict(repeat_action_probability=0.25, full_action_space=True, noop_max=1, episodic_life=False,
                    use_fire_reset=True),
    # CleanRL's envpool Atari scripts (ppo_atari_envpool.py, pqn_atari_envpool.py): EnvPool's defaults plus
    # episodic_life=True: no sticky actions, the minimal action set, up to 30 no-ops, FIRE at reset.
    "cleanrl": dict(repeat_action_probability=0.0, full_action_space=False, noop_max=30, episodic_life=True,
                    use_fire_reset=True),
    # Machado et al. 2018 ("Revisiting the ALE"), strictly: as cleanba, but the agent must press FIRE itself.
    "machado": dict(repeat_action_probability=0.25, full_action_space=True, noop_max=1, episodic_life=False,
                    use_fire_reset=False),
}

def resolve_episodic_life(env_id: str, protocol: str = "cleanba", override: bool | None = None) -> bool:
    """Whether a life loss ends a training episode: `override` (--episodic-life) if given, else the
    Atari protocol's; always False outside Atari (no lives)."""
    if not is_atari(env_id):
        return False
    return ATARI_PROTOCOLS[protocol]["episodic_life"] if override is None else override


def env_settings(env_id: str, protocol: str = "cleanba", episodic_life: bool | None = None) -> dict[str, Any]:
    """EnvPool settings of the training protocol, for `make_envs` and for the spec that sizes
    the network (the full action space has 18 actions, the minimal one fewer).

    Atari follows the named protocol `protocol` (ATARI_PROTOCOLS, --atari-protocol), with a
    life loss ending a training episode as `episodic_life` (--episodic-life) says, or the
    protocol's own choice when None. Other tasks: EnvPool's defaults ({}).

    Raises:
      KeyError: `protocol` is not in ATARI_PROTOCOLS (`sebulba.config` checks it first).
    """
    if not is_atari(env_id):
        return {}
    return dict(ATARI_PROTOCOLS[protocol], episodic_life=resolve_episodic_life(env_id, protocol, episodic_life),
                reward_clip=False, max_episode_steps=27_000)


def make_spec(env_id: str, protocol: str = "cleanba", episodic_life: bool | None = None):
    """EnvPool's spec of `env_id` under the training protocol, its observation space as the pools
    serve it (`observations`: pixels channel-first, a dict of vectors flattened, a Discrete value
    one-hot, MiniGrid's mission as word ids)."""
    spec = envpool.make_spec(env_id, **env_settings(env_id, protocol, episodic_life))
    served = observations(env_id)
    return spec if served.serve is None else ServedSpec(spec, served.space)


def make_envs(env_id: str, num_envs: int, batch_size: int, seed: int, num_threads: int, protocol: str = "cleanba",
              episodic_life: bool | None = None, **options):
    """EnvPool pool (gymnasium API) with the training protocol's settings (`env_settings`), in
    async mode when batch_size < num_envs; `options` go to envpool.make as they are (render_mode,
    Procgen's levels, say). Observations come as `observations(env_id)` serves them."""
    pool = envpool.make(env_id, env_type="gymnasium", num_envs=num_envs, batch_size=batch_size, seed=seed,
                        num_threads=num_threads, **options, **env_settings(env_id, protocol, episodic_life))
    served = observations(env_id)
    return pool if served.serve is None else ServedPool(pool, served.serve)


class ServedSpec:
    """An EnvPool spec whose observation space is the served one; everything else is the spec's own."""

    def __init__(self, spec, observation_space):
        self._spec, self.observation_space = spec, observation_space

    def __getattr__(self, name: str) -> Any:
        return getattr(self._spec, name)


class ServedPool:
    """An EnvPool pool (gymnasium API) whose observations go through `serve` (`Observations.serve`) in
    `recv`, `step` and `reset`; everything else is the pool's own."""

    def __init__(self, pool, serve: Callable):
        self._pool, self._serve = pool, serve

    def recv(self, *args, **kwargs):
        obs, *rest = self._pool.recv(*args, **kwargs)
        return (self._serve(obs), *rest)

    def step(self, *args, **kwargs):
        obs, *rest = self._pool.step(*args, **kwargs)
        return (self._serve(obs), *rest)

    def reset(self, *args, **kwargs):
        obs, info = self._pool.reset(*args, **kwargs)
        return self._serve(obs), info

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)


UNBOUNDED_EPISODE = 2**31 - 1  # EnvPool's max_episode_steps of a task with no time limit (CliffWalking, Blackjack)
EVALUATION_EPISODE_STEPS = 10_000  # the evaluations' time limit on such a task


def evaluation_step_limit(env_id: str) -> int | None:
    """Env steps after which an evaluation episode is cut (counted as truncated) on a task whose
    episodes EnvPool never truncates (max_episode_steps 2**31 - 1, which its CliffWalking does not
    even apply): EVALUATION_EPISODE_STEPS, so that an evaluation, which plays whole episodes, always
    ends (CliffWalking's greedy policy that never reaches the goal walks forever). None elsewhere:
    the task's own time limit ends its episodes. Training is unaffected."""
    return EVALUATION_EPISODE_STEPS if envpool.make_spec(env_id).config.max_episode_steps >= UNBOUNDED_EPISODE else None


def procgen_levels(env_id: str, start_level: int, num_levels: int, evaluation: bool = False) -> dict[str, int]:
    """Procgen's level settings for `make_envs` (Cobbe et al. 2020, "Leveraging Procedural Generation
    to Benchmark Reinforcement Learning", section 2.2): training on the `num_levels` levels from
    `start_level` on (0: every level, EnvPool's default); `evaluation` on the unbounded level
    distribution (num_levels 0), the paper's test levels, which a training on a bounded set has
    almost surely not seen. {} outside Procgen. The distribution mode is in the id (StarpilotEasy-v0)."""
    if not is_procgen(env_id):
        return {}
    return dict(start_level=start_level, num_levels=0) if evaluation else dict(start_level=start_level,
                                                                                num_levels=num_levels)


def check_env_ids(env_id, batch_size: int):
    """Validate one `recv` batch's env ids.

    Raises:
      RuntimeError: the batch is empty, has the wrong size, or repeats an env id.
    """
    if len(env_id) != batch_size:
        raise RuntimeError(f"EnvPool recv returned {len(env_id)} envs, expected async batch size {batch_size}; "
                           "recv and send must strictly alternate (envpool#259)")
    if len(np.unique(env_id)) != len(env_id):
        raise RuntimeError(f"EnvPool recv returned duplicate env ids {env_id.tolist()} (envpool#312)")
    return env_id


def recv_batch(envs, batch_size: int, sort: bool = False):
    """One `recv`, checked: (env_id [B] int32, obs [B, *obs] or a dict of such, reward [B] raw,
    terminated [B], truncated [B], lives [B] or None). With `sort` (--deterministic) the rows
    are in env-id order.

    Raises:
      RuntimeError: see `check_env_ids`.
    """
    obs, reward, terminated, truncated, info = envs.recv()
    env_id = check_env_ids(np.asarray(info["env_id"]), batch_size)
    lives = info.get("lives")
    if sort:
        order = np.argsort(env_id)
        env_id, reward, terminated, truncated = (x[order] for x in (env_id, reward, terminated, truncated))
        obs = {k: x[order] for k, x in obs.items()} if isinstance(obs, dict) else obs[order]
        lives = None if lives is None else lives[order]
    return env_id, obs, reward, terminated, truncated, lives


RUN_SEED_STRIDE = 10_000_019  # env seeds between the training pools of consecutive --seed values


def pool_seed(seed: int, thread: int, first_rollout: int, num_envs_total: int, num_envs: int) -> int:
    """EnvPool seed of the pool of global actor thread `thread` (process-major) that starts at
    rollout `first_rollout` in the run with --seed `seed`; EnvPool seeds its envs seed, seed + 1,
    ..., so every env of every thread, process and pool (a --deterministic run makes one per
    checkpoint interval) gets a seed of its own (cleanrl PR#238, envpool#298). Runs with
    different --seed values start RUN_SEED_STRIDE env seeds apart (--seed 1 at 1), so their
    training envs share no seed until a run has made that many env slots; with bases seed,
    seed + 1, ..., --seed 1 and 2 shared all but one env. Wraps at 2**31 (EnvPool's int seed).
    Apart from the evaluation pools' seeds (evaluation.eval_seed, from 1,000,003 on): --seed 1's
    stay below them for its first 1,000,000 / num_envs_total rollouts, --seed 2's on start above."""
    base = seed + (seed - 1) * RUN_SEED_STRIDE
    return (base + (thread + first_rollout * num_envs_total // num_envs) * num_envs) % 2**31


def env_segments(start_update: int, num_updates: int, deterministic: bool,
                 checkpoint_interval: int) -> list[tuple[int, int]]:
    """Rollout ranges [begin, end) each served by one fresh EnvPool pool: the whole run, or
    with --deterministic one per checkpoint interval, so a run resumed from a periodic
    checkpoint restarts its envs exactly where the uninterrupted run did."""
    if not deterministic or not checkpoint_interval:
        return [(start_update, num_updates)]
    interval = checkpoint_interval
    cuts = [start_update, *range((start_update // interval + 1) * interval, num_updates, interval), num_updates]
    return list(itertools.pairwise(cuts))
