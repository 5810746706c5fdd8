"""The Nature CNN's gradient on the CPU: XLA's convolution against the matmul over patches that
sebulba/networks.py's `ValidConv` runs there, and against a chain of plain matmuls of the same
shapes (what the convolutions cost at the machine's matmul speed: the ceiling).

    python benchmark/conv.py             # CleanRL's Atari minibatch: 256 frames (~1 min on 2 cores)
    python benchmark/conv.py --quick     # 32 frames

Each program is the gradient of a policy-and-value loss of the Nature CNN (Mnih et al. 2015,
84x84x4 frames, 512 hidden) with respect to its parameters, compiled once, then timed over
several steps: the median wall clock, the CPU-seconds per step (how many cores it kept busy)
and its FLOP rate, counting the multiply-adds of the forward pass and of the two backward
products (the first layer's input gradient is not needed and not counted). Writes
benchmark/results/conv.json.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from common import cli_parser, save

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sebulba.networks import NatureEncoder  # noqa: E402

CONVS = NatureEncoder.convs  # (channels, kernel size, stride)


class XlaConvNature(nn.Module):
    """The Nature CNN as it was before `ValidConv`: flax's nn.Conv (XLA's convolution)."""

    @nn.compact
    def __call__(self, obs):
        x = jnp.transpose(obs, (0, 2, 3, 1)).astype(jnp.float32) / 255.0
        for channels, size, stride in CONVS:
            x = nn.relu(nn.Conv(channels, (size, size), (stride, stride), padding="VALID")(x))
        return nn.relu(nn.Dense(512)(x.reshape((x.shape[0], -1))))


def gemm_shapes(batch: int) -> list[tuple[int, int, int]]:
    """(rows, inner, columns) of each layer's forward matmul over `batch` frames."""
    shapes, size, channels = [], 84, 4
    for out_channels, kernel, stride in CONVS:
        size = (size - kernel) // stride + 1
        shapes.append((batch * size * size, kernel * kernel * channels, out_channels))
        channels = out_channels
    return [*shapes, (batch, size * size * channels, 512)]


def flops(batch: int) -> float:
    """FLOPs of one gradient: forward, weight gradient, input gradient (not for the first layer)."""
    macs = [m * k * n for m, k, n in gemm_shapes(batch)]
    return 2.0 * (3 * sum(macs) - macs[0])


class Heads(nn.Module):
    encoder: nn.Module

    @nn.compact
    def __call__(self, obs):
        x = self.encoder(obs)
        return nn.Dense(4)(x), nn.Dense(1)(x)[:, 0]


def network_gradient(encoder: nn.Module, batch: int):
    """(jitted gradient, its arguments): the encoder with a policy (4 actions) and a value head."""
    net, rng = Heads(encoder), np.random.default_rng(0)
    obs = jnp.asarray(rng.integers(0, 256, (batch, 4, 84, 84), dtype=np.uint8))
    actions, returns = jnp.asarray(rng.integers(0, 4, batch)), jnp.asarray(rng.standard_normal(batch, np.float32))
    params = net.init(jax.random.PRNGKey(0), obs[:1])

    def loss(params, obs, actions, returns):
        logits, values = net.apply(params, obs)
        logp = jax.nn.log_softmax(logits)[jnp.arange(batch), actions]
        return -jnp.mean(logp) + 0.5 * jnp.mean(jnp.square(values - returns))

    return jax.jit(jax.grad(loss)), (params, obs, actions, returns)


def gemm_gradient(batch: int):
    """(jitted gradient, its arguments): plain matmuls of the layers' shapes, the same backward products."""
    keys = jax.random.split(jax.random.PRNGKey(0), 8)
    shapes = gemm_shapes(batch)
    xs = [jax.random.normal(keys[i], (m, k)) for i, (m, k, _) in enumerate(shapes)]
    ws = [jax.random.normal(keys[4 + i], (k, n)) * 0.01 for i, (_, k, n) in enumerate(shapes)]

    def loss(ws, inner_xs, first_x):
        return sum(jnp.sum(jax.nn.relu(x @ w)) for x, w in zip([first_x, *inner_xs], ws))

    return jax.jit(jax.grad(loss, argnums=(0, 1))), (ws, xs[1:], xs[0])


def measure(gradient, args, steps: int) -> dict:
    start = time.perf_counter()
    jax.block_until_ready(gradient(*args))
    compile_s = time.perf_counter() - start
    walls, cpus = [], []
    for _ in range(steps):
        wall, cpu = time.perf_counter(), time.process_time()
        jax.block_until_ready(gradient(*args))
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return {"compile_s": compile_s, "step_s": statistics.median(walls), "step_s_min": min(walls),
            "step_s_max": max(walls), "cpu_s_per_step": statistics.median(cpus)}


if __name__ == "__main__":
    cli = cli_parser(__doc__, "conv", "32 frames instead of 256").parse_args()
    batch, steps = (32, 5) if cli.quick else (256, 9)
    results = {}
    for name, (gradient, args) in {"xla_convolution": network_gradient(XlaConvNature(), batch),
                                   "matmul_over_patches": network_gradient(NatureEncoder((512,)), batch),
                                   "matmul_chain_ceiling": gemm_gradient(batch)}.items():
        r = measure(gradient, args, steps)
        r["gflop_per_s"] = flops(batch) / r["step_s"] / 1e9
        results[name] = r
        print(f"{name:22s} batch {batch}: {r['step_s'] * 1e3:6.0f} ms a gradient ({r['step_s_min'] * 1e3:.0f}-"
              f"{r['step_s_max'] * 1e3:.0f}), {r['cpu_s_per_step'] / r['step_s']:.2f} cores busy, "
              f"{r['gflop_per_s']:5.1f} GFLOP/s, compiled in {r['compile_s']:.1f} s", flush=True)
    print("written:", save("conv", {"quick": cli.quick, "batch": batch, "gflop_per_gradient": flops(batch) / 1e9,
                                    "results": results}, cli.out / "quick" if cli.quick else cli.out))
