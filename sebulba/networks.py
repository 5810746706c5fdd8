"""Agent building blocks every script shares: the IMPALA ResNet, Nature CNN, MLP and MiniGrid encoders (the
latter with a mission encoder and FiLM), the running statistics of observation normalisation and
reward scaling, the three action distributions (categorical, diagonal Gaussian, tanh-squashed
Gaussian), and the jitted policy function that actors and evaluation call. Each script's `Agent`
puts its heads on these encoders.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from sebulba.missions import VOCAB


class ResidualBlock(nn.Module):
    channels: int

    @nn.compact
    def __call__(self, x):
        y = nn.Conv(self.channels, (3, 3))(nn.relu(x))
        y = nn.Conv(self.channels, (3, 3))(nn.relu(y))
        return x + y


class ImpalaEncoder(nn.Module):
    """IMPALA ResNet (Espeholt et al. 2018, Fig. 3): conv, max-pool, two residual blocks per stack; the
    convolutions in flax's default init (as Cleanba's), the dense layers orthogonal with gain sqrt(2)."""

    channels: tuple[int, ...]
    hiddens: tuple[int, ...]

    @nn.compact
    def __call__(self, obs):  # obs: [B, C, H, W] uint8 frames
        x = jnp.transpose(obs, (0, 2, 3, 1)).astype(jnp.float32) / 255.0
        for c in self.channels:
            x = nn.Conv(c, (3, 3))(x)
            x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
            x = ResidualBlock(c)(x)
            x = ResidualBlock(c)(x)
        x = nn.relu(x).reshape((x.shape[0], -1))
        for h in self.hiddens:  # orthogonal, gain sqrt(2), zero bias: Cleanba's and CleanRL's ppo_procgen.py's
            x = nn.relu(nn.Dense(h, kernel_init=nn.initializers.orthogonal(np.sqrt(2)))(x))
        return x


def conv_as_matmul(x, kernel, stride: int):
    """VALID convolution of x [N, H, W, C] with kernel [k, k, C, F] at `stride` as one matmul over
    the input's k x k patches (im2col: [N*H'*W', k*k*C] @ [k*k*C, F]) -> [N, H', W', F]. The
    patches are k*k strided slices, whose gradient is a pad-and-add; XLA:CPU runs this as a
    multithreaded GEMM, where its own convolution's gradient ran on about one core at half
    the speed (the Nature CNN's gradient, batch 256: 0.20 s against 0.44 s on 2 cores;
    benchmark/conv.py)."""
    k, _, c, f = kernel.shape
    n, h, w, _ = x.shape
    out_h, out_w = (h - k) // stride + 1, (w - k) // stride + 1
    patches = jnp.stack([x[:, i:i + stride * (out_h - 1) + 1:stride, j:j + stride * (out_w - 1) + 1:stride]
                         for i in range(k) for j in range(k)], axis=3)  # [N, H', W', k*k, C], (i, j) row-major
    return (patches.reshape(n * out_h * out_w, k * k * c) @ kernel.reshape(k * k * c, f)).reshape(n, out_h, out_w, f)


class ValidConv(nn.Module):
    """`nn.Conv(features, (size, size), (stride, stride), padding="VALID")` with the same
    parameters ("kernel" [size, size, C, features], "bias" [features]) and outputs, lowered to
    `conv_as_matmul` on the CPU and to XLA's convolution elsewhere (GPUs' cuDNN is faster there)."""

    features: int
    size: int
    stride: int
    kernel_init: Callable = nn.initializers.lecun_normal()

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", self.kernel_init, (self.size, self.size, x.shape[-1], self.features))
        bias = self.param("bias", nn.initializers.zeros, (self.features,))
        conv = functools.partial(lax.conv_general_dilated, window_strides=(self.stride, self.stride), padding="VALID",
                                 dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return lax.platform_dependent(x, kernel, cpu=functools.partial(conv_as_matmul, stride=self.stride),
                                      default=conv) + bias


class NatureEncoder(nn.Module):
    """The Nature CNN (Mnih et al. 2015, "Human-level control through deep reinforcement
    learning", Methods: model architecture), as CleanRL's ppo_atari.py has it: frames [B, C, H, W]
    uint8 scaled to [0, 1], conv 32 8x8 stride 4, conv 64 4x4 stride 2, conv 64 3x3 stride 1
    (VALID padding, ReLU after each), flattened, then ReLU dense layers `hiddens` (the paper's:
    512) -> [B, hiddens[-1]] float32. Orthogonal init with gain sqrt(2), zero biases. On 84x84x4
    frames with (512,): 1,684,128 parameters and ~9.3M multiply-adds a frame, about a sixth of
    the IMPALA ResNet's (16, 32, 32) + 256. With `layer_norm`, a LayerNorm after every conv and
    dense layer, before its ReLU (`norm`)."""

    hiddens: tuple[int, ...]
    layer_norm: bool = False
    convs = ((32, 8, 4), (64, 4, 2), (64, 3, 1))  # (channels, kernel size, stride)

    @nn.compact
    def __call__(self, obs):
        init = nn.initializers.orthogonal(np.sqrt(2))
        x = jnp.transpose(obs, (0, 2, 3, 1)).astype(jnp.float32) / 255.0
        for i, (channels, size, stride) in enumerate(self.convs):  # named as nn.Conv's: checkpoints load either way
            x = nn.relu(self.norm(ValidConv(channels, size, stride, kernel_init=init, name=f"Conv_{i}")(x), 3))
        x = x.reshape((x.shape[0], -1))
        for h in self.hiddens:
            x = nn.relu(self.norm(nn.Dense(h, kernel_init=init)(x), 1))
        return x

    def norm(self, x, axes: int):
        """With `layer_norm` (PQN's Q-network: CleanRL's pqn_atari_envpool.py, torch's LayerNorm over
        a conv output's whole [C, H, W]): LayerNorm over the last `axes` axes, an elementwise scale
        and bias over them, epsilon 1e-5 (torch's); else x."""
        if not self.layer_norm:
            return x
        last = tuple(range(-axes, 0))
        return nn.LayerNorm(epsilon=1e-5, reduction_axes=last, feature_axes=last)(x)


def make_atari_encoder(name: str, channels: tuple[int, ...], hiddens: tuple[int, ...]) -> nn.Module:
    """The Atari encoder `name` (one of sebulba.config.ATARI_ENCODERS): the IMPALA ResNet with conv stacks
    `channels`, or the Nature CNN (whose convolutions are fixed; `channels` is unused), each
    followed by the dense layers `hiddens`. `sebulba.config.check_network` rejects other names."""
    return NatureEncoder(hiddens) if name == "nature" else ImpalaEncoder(channels, hiddens)


class MLPEncoder(nn.Module):
    hiddens: tuple[int, ...]

    @nn.compact
    def __call__(self, obs):  # obs: [B, D] float
        x = obs.reshape((obs.shape[0], -1)).astype(jnp.float32)
        for h in self.hiddens:
            x = nn.tanh(nn.Dense(h, kernel_init=nn.initializers.orthogonal(np.sqrt(2)))(x))
        return x


class LayerNormMLP(nn.Module):
    """Vector observations [B, D] -> [B, hiddens[-1]] float32: Dense, LayerNorm, ReLU per width in
    `hiddens` (PQN's Q-network on vector tasks: CleanRL's pqn.py, 120-84; purejaxql's pqn_gymnax.py,
    2 x 256), orthogonal init with gain sqrt(2), zero biases, LayerNorm epsilon 1e-5 (torch's)."""

    hiddens: tuple[int, ...]

    @nn.compact
    def __call__(self, obs):
        x = obs.reshape((obs.shape[0], -1)).astype(jnp.float32)
        for h in self.hiddens:
            x = nn.relu(nn.LayerNorm(epsilon=1e-5)(nn.Dense(h, kernel_init=nn.initializers.orthogonal(np.sqrt(2)))(x)))
        return x


class MissionEncoder(nn.Module):
    """The mission's word ids [B, W] (uint8, `sebulba.missions.VOCAB`, padded with 0 after the words)
    -> features [B, features] float32: `embed`-dimensional word embeddings read by a GRU (Cho et al.
    2014; flax's GRUCell), whose state after the mission's last word is the result. BabyAI's baseline
    instruction encoder (Chevalier-Boisvert et al. 2019, section 4; Hui et al. 2020)."""

    vocab_size: int
    features: int = 64
    embed: int = 32

    @nn.compact
    def __call__(self, ids):
        ids = ids.astype(jnp.int32)
        last = jnp.maximum(jnp.sum(ids > 0, axis=-1), 1) - 1  # an empty mission reads the padding once
        words = nn.Embed(self.vocab_size, self.embed)(ids)  # [B, W, embed]
        # A zero state of the words' type: inside the learner's shard_map it varies over the mesh as they do.
        zeros = jnp.zeros_like(words[:, 0, :1], shape=(ids.shape[0], self.features))
        states = nn.RNN(nn.GRUCell(self.features))(words, initial_carry=zeros)  # [B, W, features]
        return jnp.take_along_axis(states, last[:, None, None], axis=1)[:, 0]


class FiLM(nn.Module):
    """Feature-wise linear modulation (Perez et al. 2018): x [B, ..., C] -> x * gamma + beta, with
    gamma = 1 + Dense(condition), beta = Dense(condition) from `condition` [B, D], broadcast over
    x's middle axes (here the 7x7 cells)."""

    @nn.compact
    def __call__(self, x, condition):
        channels = x.shape[-1]
        shape = (x.shape[0],) + (1,) * (x.ndim - 2) + (channels,)
        gamma = 1.0 + nn.Dense(channels, name="gamma")(condition).reshape(shape)
        return x * gamma + nn.Dense(channels, name="beta")(condition).reshape(shape)


class MiniGridEncoder(nn.Module):
    """Dictionary observations of MiniGrid/BabyAI tasks: the agent's 7x7 egocentric view
    `image` [B, 7, 7, 3] uint8, whose channels are MiniGrid's object, colour and state ids,
    `direction` [B] int32 (0-3) and `mission` [B, W] uint8 word ids (sebulba/missions.py). Each id
    gets a learned `embed`-dimensional embedding (MiniGrid's id ranges: 11 object types, 6
    colours, 3 door states), the direction too; they are concatenated, flattened and passed
    through ReLU dense layers `hiddens` -> [B, hiddens[-1]] float32.

    With `mission`, the mission is read as BabyAI's baseline reads it (Chevalier-Boisvert et al.
    2019): a `MissionEncoder`, whose features condition each cell's features by FiLM in
    `film_layers` layers of `film_channels` (1x1 convolutions: a cell's features are already its
    ids), and are concatenated to the flattened cells. Without it the mission is ignored (a task
    whose mission never changes) and the network is the one without these layers."""

    hiddens: tuple[int, ...]
    embed: int = 8
    mission: bool = False
    film_channels: int = 32
    film_layers: int = 2
    id_ranges = (11, 6, 3)  # minigrid.core.constants: OBJECT_TO_IDX, COLOR_TO_IDX, STATE_TO_IDX

    @nn.compact
    def __call__(self, obs):
        image = obs["image"].astype(jnp.int32)
        x = jnp.concatenate([nn.Embed(n, self.embed)(jnp.clip(image[..., c], 0, n - 1))
                             for c, n in enumerate(self.id_ranges)], axis=-1)  # [B, 7, 7, 3 embed]
        if self.mission:
            words = MissionEncoder(len(VOCAB))(obs["mission"])
            for _ in range(self.film_layers):
                x = nn.relu(FiLM()(nn.Dense(self.film_channels)(x), words))
        x = jnp.concatenate([x.reshape((image.shape[0], -1)),
                             nn.Embed(4, self.embed)(obs["direction"].astype(jnp.int32))], axis=-1)
        if self.mission:
            x = jnp.concatenate([x, words], axis=-1)
        for h in self.hiddens:
            x = nn.relu(nn.Dense(h, kernel_init=nn.initializers.orthogonal(np.sqrt(2)))(x))
        return x


class RunningMoments(NamedTuple):
    """Running mean and variance of a stream of samples, each of the shape of `mean`."""

    mean: jax.Array  # float32
    var: jax.Array  # float32, population variance
    count: jax.Array  # float32 scalar, samples seen (starts at 1e-4, as gym's RunningMeanStd)

    @staticmethod
    def create(shape) -> RunningMoments:
        return RunningMoments(jnp.zeros(shape, jnp.float32), jnp.ones(shape, jnp.float32), jnp.float32(1e-4))

    def normalize(self, x):
        """(x - mean) / std, clipped to [-10, 10] (as CleanRL's MuJoCo PPO)."""
        return jnp.clip((x - self.mean) / jnp.sqrt(self.var + 1e-8), -10.0, 10.0)

    def update(self, x, axis_name: str) -> RunningMoments:
        """Add the samples x [T, n, *shape] of every device on mesh axis `axis_name` (equal n
        on each): the batch's moments in two passes over the mesh, merged with the running ones
        by Chan et al. (1979)'s parallel rule. Inside shard_map; the result is invariant."""
        x = x.reshape((-1,) + self.mean.shape).astype(jnp.float32)
        count = x.shape[0] * jax.lax.psum(1, axis_name)
        mean = jax.lax.pmean(jnp.mean(x, axis=0), axis_name)
        var = jax.lax.pmean(jnp.mean(jnp.square(x - mean), axis=0), axis_name)
        total = self.count + count
        delta = mean - self.mean
        m2 = self.var * self.count + var * count + jnp.square(delta) * self.count * count / total
        return RunningMoments(self.mean + delta * count / total, m2 / total, total)


# Action distributions: `policy` is logits [B, A] (categorical), (mean, log_std) [B, A] each (diagonal Gaussian),
# or a TanhGaussian (SAC's squashed Gaussian, actions in (-1, 1)^A).

# A learned log-std can run away downwards; below about -87 its exp underflows float32 to 0 and the
# log-prob becomes inf - inf = NaN (rsl_rl PR#190). Every Gaussian helper reads it floored here:
# std >= 2e-9, far below any useful action noise, so training never meets the floor otherwise.
LOG_STD_MIN = -20.0


class TanhGaussian(NamedTuple):
    """A diagonal Gaussian squashed by tanh: a = tanh(u), u ~ N(mean, exp(log_std)^2), so
    a in (-1, 1)^A (SAC, Haarnoja et al. 2018b, appendix C). mean, log_std [B, A] float32 are
    the pre-squash Gaussian's. The env receives `a` mapped affinely onto its action bounds
    (`make_policy_fn`); log-probabilities and entropies are those of `a` in (-1, 1)^A, whatever
    the bounds, as Stable-Baselines3's SAC has them."""

    mean: jax.Array
    log_std: jax.Array


def tanh_log_det(u):
    """log(1 - tanh(u)^2) [..., A], elementwise: the log-Jacobian of the squash, computed as
    2 (log 2 - u - softplus(-2u)), exact and finite for every u (1 - tanh(u)^2 underflows to 0
    in float32 from |u| ~ 9)."""
    return 2.0 * (jnp.log(2.0) - u - jax.nn.softplus(-2.0 * u))


def tanh_gaussian_sample(policy: TanhGaussian, key):
    """Reparameterised sample (a [B, A] in (-1, 1), log pi(a|s) [B]): u = mean + std * eps,
    a = tanh(u), and log pi(a|s) = sum_i [log N(u_i; mean_i, std_i) - log(1 - tanh(u_i)^2)]
    (Haarnoja et al. 2018b, eq. 26). Gradients flow to mean and log_std through u."""
    mean, log_std = gaussian(policy)
    eps = jax.random.normal(key, mean.shape)
    u = mean + jnp.exp(log_std) * eps
    logp = jnp.sum(-0.5 * jnp.square(eps) - log_std - 0.5 * jnp.log(2 * jnp.pi) - tanh_log_det(u), axis=-1)
    return jnp.tanh(u), logp


def gaussian(policy):
    """(mean, log_std) of a Gaussian policy, log_std floored at LOG_STD_MIN."""
    mean, log_std = policy
    return mean, jnp.maximum(log_std, LOG_STD_MIN)


def log_prob(policy, actions):
    """log pi(a|s) [B] of actions [B] int32 (categorical) or [B, A] float32 (Gaussian, unclipped
    sample: the env receives it clipped to the action space, the loss sees it as sampled;
    TanhGaussian: a in (-1, 1), inverted through atanh, so within 1e-6 of +-1 it is read at
    +-(1 - 1e-6); a learner takes it from `tanh_gaussian_sample` instead)."""
    if isinstance(policy, TanhGaussian):
        mean, log_std = gaussian(policy)
        u = jnp.arctanh(jnp.clip(actions, -1.0 + 1e-6, 1.0 - 1e-6))
        z = (u - mean) / jnp.exp(log_std)
        return jnp.sum(-0.5 * jnp.square(z) - log_std - 0.5 * jnp.log(2 * jnp.pi) - tanh_log_det(u), axis=-1)
    if isinstance(policy, tuple):
        mean, log_std = gaussian(policy)
        z = (actions - mean) / jnp.exp(log_std)
        return jnp.sum(-0.5 * jnp.square(z) - log_std - 0.5 * jnp.log(2 * jnp.pi), axis=-1)
    return jnp.take_along_axis(jax.nn.log_softmax(policy), actions[..., None], axis=-1)[..., 0]


def entropy(policy):
    """Entropy [B] in nats (not for a TanhGaussian, which has no closed form: estimate it as
    -log pi of samples, as SAC's learner does)."""
    if isinstance(policy, TanhGaussian):
        raise TypeError("a TanhGaussian's entropy has no closed form; use -tanh_gaussian_sample(...)[1]")
    if isinstance(policy, tuple):
        return jnp.sum(gaussian(policy)[1] + 0.5 * jnp.log(2 * jnp.pi * jnp.e), axis=-1)
    logp = jax.nn.log_softmax(policy)
    return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


def sample_action(policy, key, greedy: bool = False):
    """An action per row: sampled, or with `greedy` the mode (argmax; the Gaussian mean; tanh of
    the TanhGaussian's mean)."""
    if isinstance(policy, TanhGaussian):
        return jnp.tanh(policy.mean) if greedy else tanh_gaussian_sample(policy, key)[0]
    if isinstance(policy, tuple):
        mean, log_std = gaussian(policy)
        return mean if greedy else mean + jnp.exp(log_std) * jax.random.normal(key, mean.shape)
    return (jnp.argmax(policy, axis=-1) if greedy else jax.random.categorical(key, policy)).astype(jnp.int32)


class RecurrentPolicy:
    """The policy of a recurrent agent (one with `lstm_size`), called as
    policy((params, obs_moments), obs [B, *obs], state [B, 2, lstm_size] float32, starts [B] bool, key)
    -> (action, env action, logprob [B], value [B], state in [B, 2, H], state out [B, 2, H], key).

    `state` is each row's LSTM (cell, hidden) state before this step; rows with `starts` (the
    first observation of an episode) begin from zeros instead. State in is the state the
    step used (after that reset), state out the one after it. `zero_state(n)` gives n rows of
    zeros; evaluation and actors keep one row per env."""

    recurrent = True

    def __init__(self, agent: nn.Module, action_space=None, greedy: bool = False):
        bounds = (action_space.low, action_space.high) if agent.continuous else None
        self.lstm_size = agent.lstm_size

        @jax.jit
        def policy(params, obs, state, starts, key):
            params, obs_moments = params
            state = jnp.where(starts[:, None, None], 0.0, state)
            dist, value, new_state = agent.apply(params, obs, state, obs_moments)
            key, sample_key = jax.random.split(key)
            action = sample_action(dist, sample_key, greedy)
            env_action = None if bounds is None else jnp.clip(action, *bounds)
            return action, env_action, log_prob(dist, action), value, state, new_state, key

        self.policy = policy

    def __call__(self, params, obs, state, starts, key):
        return self.policy(params, obs, state, starts, key)

    def zero_state(self, n: int) -> np.ndarray:
        return np.zeros((n, 2, self.lstm_size), np.float32)


def make_policy_fn(agent: nn.Module, action_space=None, greedy: bool = False):
    """jit((params, obs_moments), obs [B, *obs], key) -> (action, env action, logprob [B], value [B], key)
    for a flax `agent` whose apply(params, obs, obs_moments) returns (policy, value [B]) and
    whose `continuous` says which distribution `policy` parameterises.

    The action is what the behaviour policy sampled ([B] int32, or [B, A] float32); the env
    action is what `send` gets (`env_action`: clipped to a Box `action_space`'s bounds, or for a
    TanhGaussian mapped onto them; None for discrete actions: send the action; no second copy
    to the host). `greedy` takes the policy's mode instead of sampling (evaluation). A recurrent agent (one with `lstm_size`,
    sebulba/ppo_lstm_envpool.py's) gets a `RecurrentPolicy` instead. A Q-network (an agent with
    `q_network`, sebulba/pqn_envpool.py's, whose apply returns Q-values [B, A]) gets its
    ε-greedy policy with ε = 0 where `greedy`, else its `eval_epsilon`; the value is max_a Q."""
    if getattr(agent, "lstm_size", 0):
        return RecurrentPolicy(agent, action_space, greedy)
    if getattr(agent, "q_network", False):
        act, epsilon = make_epsilon_greedy_fn(agent), 0.0 if greedy else agent.eval_epsilon

        def q_policy(params, obs, key):
            action, logprob, value, _, key = act(params, obs, key, epsilon)
            return action, None, logprob, value, key

        return q_policy
    bounds = (action_space.low, action_space.high) if agent.continuous else None

    @jax.jit
    def policy(params, obs, key):
        params, obs_moments = params
        dist, value = agent.apply(params, obs, obs_moments)
        key, sample_key = jax.random.split(key)
        action = sample_action(dist, sample_key, greedy)
        return action, env_action(dist, action, bounds), log_prob(dist, action), value, key

    return policy


def env_action(dist, action, bounds):
    """What `send` gets for `action`: None for discrete actions (the action itself); a Gaussian's
    sample clipped to the Box `bounds` (low, high); a TanhGaussian's a in (-1, 1) mapped affinely
    onto them, low + (a + 1) (high - low) / 2."""
    if bounds is None:
        return None
    if isinstance(dist, TanhGaussian):
        low, high = bounds
        return low + (action + 1.0) * (high - low) / 2.0
    return jnp.clip(action, *bounds)


def epsilon_greedy(q_values, key, epsilon):
    """ε-greedy action choice (Watkins 1989; Mnih et al. 2015) over q_values [B, A] float32 with
    `epsilon` (a scalar in [0, 1]): with probability ε an action drawn uniformly from all A
    (the greedy one among them), else argmax_a Q (the first of ties), as purejaxql's
    eps_greedy_exploration. Returns (actions [B] int32, log mu(a|s) [B] float32 under the
    behaviour policy mu(a|s) = ε / A + (1 - ε) [a = argmax_a Q], explored [B] bool: the uniform
    draw was taken)."""
    explore_key, action_key = jax.random.split(key)
    greedy = jnp.argmax(q_values, axis=-1).astype(jnp.int32)
    num_actions = q_values.shape[-1]
    explored = jax.random.uniform(explore_key, greedy.shape) < epsilon
    actions = jnp.where(explored, jax.random.randint(action_key, greedy.shape, 0, num_actions, jnp.int32), greedy)
    prob = epsilon / num_actions + (1.0 - epsilon) * (actions == greedy)
    return actions, jnp.log(prob), explored


def make_epsilon_greedy_fn(agent: nn.Module):
    """jit((params, obs_moments), obs [B, *obs], key, epsilon) -> (action [B] int32, log mu(a|s)
    [B], max_a Q(s, a) [B] float32, explored [B] bool, key) for a Q-network `agent` whose
    apply(params, obs, obs_moments) returns Q-values [B, A]; `epsilon_greedy` chooses. ε is a
    traced scalar: a new ε compiles nothing."""

    @jax.jit
    def policy(params, obs, key, epsilon):
        params, obs_moments = params
        q_values = agent.apply(params, obs, obs_moments)
        key, sample_key = jax.random.split(key)
        action, logprob, explored = epsilon_greedy(q_values, sample_key, epsilon)
        return action, logprob, jnp.max(q_values, axis=-1), explored, key

    return policy
