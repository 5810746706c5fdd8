"""A scripted stand-in with EnvPool's async interface, for situations real EnvPool cannot be
made to produce on demand (a chosen recv order, an empty batch, scripted rewards)."""

import queue
import threading

import jax
import jax.numpy as jnp
import numpy as np

from sebulba.networks import RunningMoments, make_policy_fn
from sebulba.ppo_envpool import Agent, Args, run_actor
from sebulba.rollouts import RolloutAssembler
from sebulba.threads import ParamsSlot


class ScriptedPool:
    """`recv` returns the scripted env-id batches in order. Each env's k-th appearance returns
    its k-th scripted (reward, terminated, truncated, lives) and an observation
    [env_id, k, 0] so tests can see where every row came from. Raises, like a pool that
    lost track, when `recv` is called twice without a `send` in between or when `send`
    names envs other than the ones just received.
    """

    def __init__(self, id_batches, num_envs, steps=None, dict_obs=False):
        self.id_batches = [np.asarray(b, np.int32) for b in id_batches]
        self.num_envs = num_envs
        self.steps = steps or {}  # env -> list of (reward, terminated, truncated, lives)
        self.appearances = np.zeros(num_envs, int)
        self.actions_received = {e: [] for e in range(num_envs)}
        self.pending = None
        self.calls = 0
        self.closed = False
        self.dict_obs = dict_obs  # MiniGrid-like: image [7, 7, 3] uint8 holding (env_id, k, 0), direction k % 4

    def async_reset(self):
        self.pending = None

    def recv(self):
        if self.pending is not None:
            raise RuntimeError("recv called twice without send")
        ids = self.id_batches[self.calls]
        self.calls += 1
        rows = []
        for e in ids:
            k = self.appearances[e]
            script = self.steps.get(int(e), [])
            rows.append(script[k] if k < len(script) else (0.0, False, False, 1))
            self.appearances[e] += 1
        reward, terminated, truncated, lives = (np.array(c) for c in zip(*rows)) if rows else [np.zeros(0)] * 4
        obs = np.stack([[e, self.appearances[e] - 1, 0] for e in ids]).astype(np.float32) if len(ids) else np.zeros((0, 3), np.float32)
        if self.dict_obs:
            obs = {"image": np.broadcast_to(obs.astype(np.uint8)[:, None, None, :], (len(ids), 7, 7, 3)).copy(),
                   "direction": (obs[:, 1] % 4).astype(np.int32), "mission": np.zeros((len(ids), 18), np.uint8)}
        self.pending = ids
        info = {"env_id": ids, "lives": np.asarray(lives, np.int32), "elapsed_step": np.zeros(len(ids), np.int32)}
        return obs, np.asarray(reward, np.float32), np.asarray(terminated, bool), np.asarray(truncated, bool), info

    def send(self, actions, env_id):
        if self.pending is None or not np.array_equal(np.sort(env_id), np.sort(self.pending)):  # any order, as EnvPool
            raise RuntimeError(f"send for {env_id} does not match the last recv {self.pending}")
        for a, e in zip(np.asarray(actions), env_id):
            self.actions_received[int(e)].append(int(a))
        self.pending = None

    def close(self):
        self.closed = True


MINIGRID_OBS = ({"direction": (), "image": (7, 7, 3), "mission": (18,)},  # MemoryS7's word ids
                {"direction": np.dtype(np.int32), "image": np.dtype(np.uint8), "mission": np.dtype(np.uint8)})


def drive_actor(pool, batch_size, num_steps, num_rollouts, obs_dim=3, num_actions=3, deterministic=False):
    """Drive the real actor loop (real policy on CPU device 0) over a scripted pool; no learner
    publishes params here, so the lag bound is lifted. A pool with `dict_obs` gets a MiniGrid agent."""
    dict_obs = getattr(pool, "dict_obs", False)
    agent = Agent(num_actions=num_actions, channels=(), hiddens=(8,), pixels=False, minigrid=dict_obs)
    obs_shape, obs_dtype = MINIGRID_OBS if dict_obs else ((obs_dim,), np.float32)
    example = jax.tree.map(lambda shape, dtype: jnp.zeros((1, *shape), dtype), obs_shape, obs_dtype,
                           is_leaf=lambda x: isinstance(x, tuple))
    params = agent.init(jax.random.PRNGKey(0), example)
    slot = ParamsSlot()
    slot.publish(0, {jax.devices()[0]: (params, RunningMoments.create(()))})
    q = queue.Queue()
    assembler = RolloutAssembler(pool.num_envs, num_steps, obs_shape, obs_dtype, clip_rewards=False, episodic_life=False)
    error = None
    try:
        run_actor(pool, make_policy_fn(agent), jax.devices()[0], jax.random.PRNGKey(1), slot, q, assembler,
                  num_rollouts, Args(stall_timeout_s=5, max_policy_lag=1000, deterministic=deterministic), batch_size,
                  threading.Event(), "actor")
    except RuntimeError as e:
        error = e
    return [q.get_nowait() for _ in range(q.qsize())], error
