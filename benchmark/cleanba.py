"""Cleanba (Huang et al. 2023, github.com/vwxyzjn/cleanba) beside ours on this box, run from a checkout the user
fetched, never copied here.

    python benchmark/cleanba.py --setup                          # once: .venv-cleanba/ (Cleanba's pins, nearest)
    python benchmark/cleanba.py parity --cleanba PATH            # one batch through both IMPALA updates
    python benchmark/cleanba.py throughput --cleanba PATH        # Cleanba's IMPALA as it runs here (env steps/s)

PATH is a checkout of Cleanba (its cleanba/cleanba_impala.py); its commit is recorded with the results.

Why a venv of its own: Cleanba pins jax 0.4, flax 0.6, optax 0.1, chex 0.1.5, rlax 0.1.5, envpool 0.8 and gym
0.23.1 on Python < 3.11 (its poetry.lock: jax 0.4.8, jaxlib 0.4.7, flax 0.6.8, optax 0.1.4, envpool 0.8.1). `--setup`
makes .venv-cleanba/ with Python 3.10 (found as `python3.10` or under pyenv) and the lock's versions where PyPI has
them for it: jaxlib's oldest wheel for Python 3.10 there is 0.4.13 (so jax 0.4.13 and ml-dtypes 0.2.0 with it),
chex 0.1.5 reads `jax.interpreters.xla.DeviceArray`, which jax 0.4.13 no longer has (so chex 0.1.7, the next that
imports), and envpool 0.8.1 has no Python 3.10 wheel there (so 0.8.4). The rest are the lock's.

`parity`: the exact check. One real rollout (Breakout-v5 under Cleanba's protocol, 32 envs x 20 steps + the
bootstrap row, the IMPALA ResNet 16-32-32/256 at its initial parameters, actions sampled from it), then both
updates on it from the same parameters with the same hyperparameters (Cleanba's defaults: gamma 0.99, entropy
0.01, value 0.5, clip 40, lr 6e-4 held), compared on the loss terms (sums over the batch), the gradient and
the parameters after each of UPDATES updates on the same batch (off-policy from the second on: the batch's
behaviour logits stay those of the initial parameters). Cleanba is fed the batch twice:
* `native`: as Cleanba's actor stores it (row t: obs_t, the action on it, and the reward and done that came *with*
  obs_t; mask = 1 - first step of an episode);
* `aligned`: the same transitions in ours' alignment (transition t earns the reward that came with obs_{t+1}, its
  discount is 0 when obs_{t+1} ended the episode, and the row of an episode's last observation is masked).
In `aligned`, where the two differ only by the update's code, every difference beyond float noise is a lead; in
`native` (one update) the differences are those of the alignment (intended: docs/impala_envpool.md says which). Ours runs with
`--optimizer rmsprop-torch` (PyTorch's RMSProp, Cleanba's) and, for the step size, with `rmsprop` (TF1's).
Writes benchmark/results/cleanba.json (key "parity").

`throughput`: Cleanba's cleanba_impala.py unchanged, at its defaults but for --total-timesteps (its actor and
learner on device 0, as on a CPU), for a fixed window; env steps/s from its own `SPS:` lines.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import RESULTS, ROOT, machine

VENV = ROOT / ".venv-cleanba"
VENV_PYTHON = VENV / "bin" / "python"
# Cleanba's poetry.lock, but where PyPI has no wheel for Python 3.10 or the pinned version fails to import (above).
REQUIREMENTS = ["jax==0.4.13", "jaxlib==0.4.13", "ml-dtypes==0.2.0", "flax==0.6.8", "optax==0.1.4", "chex==0.1.7",
                "rlax==0.1.5", "envpool==0.8.4", "gym==0.23.1", "tensorboardX==2.6", "tyro==0.5.5", "rich==11.2.0",
                "numpy==1.23.5", "scipy==1.9.3", "orbax==0.1.7", "tensorstore==0.1.35", "dm-tree==0.1.8",
                "msgpack==1.0.4"]
SETTINGS = dict(gamma=0.99, ent_coef=0.01, vf_coef=0.5, max_grad_norm=40.0, learning_rate=6e-4)
NUM_ENVS, NUM_STEPS, UPDATES = 32, 20, 5


def python310() -> str:
    found = shutil.which("python3.10")
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    candidates = [found] if found and subprocess.run([found, "--version"], capture_output=True).returncode == 0 else []
    candidates += sorted(str(p) for p in pyenv.glob("3.10*/bin/python3.10"))
    if not candidates:
        raise SystemExit("benchmark/cleanba.py --setup: needs Python 3.10 (Cleanba's jaxlib 0.4 has no wheel for "
                         "Python 3.11 and newer here); install it (pyenv install 3.10) and run again")
    return candidates[0]


def setup():
    if not VENV_PYTHON.exists():
        subprocess.run([python310(), "-m", "venv", str(VENV)], check=True)
    subprocess.run([str(VENV_PYTHON), "-m", "pip", "install", "-q", *REQUIREMENTS], check=True)
    print(f"{VENV}: ready ({', '.join(REQUIREMENTS[:8])}, ...)")


def checkout_commit(path: Path) -> str:
    result = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True)
    if result.returncode == 0:
        return result.stdout.strip()
    marker = path / "COMMIT"  # a snapshot exported without .git: its commit written beside it
    return marker.read_text().strip() if marker.exists() else "unknown"


def collect_rollout(seed: int = 1, rollouts_run: int = 16):
    """A real rollout of our IMPALA agent at its initial parameters: (args, agent, params, Rollout, the done flags
    of the row before its first). Of the pool's first `rollouts_run` rollouts, the one where most episodes end."""
    import jax
    import numpy as np

    from sebulba.envs import make_envs, recv_batch
    from sebulba.impala_envpool import Args, init_params, make_agent
    from sebulba.networks import make_policy_fn
    from sebulba.rollouts import RolloutAssembler, obs_storage

    args = Args(env_id="Breakout-v5", atari_protocol="cleanba", local_num_envs=NUM_ENVS, num_steps=NUM_STEPS,
                anneal_lr=False, **SETTINGS)
    agent, spec = make_agent(args)
    params = init_params(agent, spec, jax.random.PRNGKey(seed))
    policy, key = make_policy_fn(agent, spec.action_space), jax.random.PRNGKey(seed + 1)
    envs = make_envs(args.env_id, NUM_ENVS, NUM_ENVS, seed, 2, "cleanba")
    assembler = RolloutAssembler(NUM_ENVS, NUM_STEPS, *obs_storage(spec.observation_space), clip_rewards=True,
                                 episodic_life=False)
    envs.async_reset()
    rollouts = []
    while len(rollouts) < rollouts_run:
        env_id, obs, reward, terminated, truncated, lives = recv_batch(envs, NUM_ENVS)
        action, _, logprob, value, key = policy((params, None), obs, key)
        action = np.asarray(action)
        envs.send(action, env_id)
        for rollout, *_ in assembler.add(env_id, obs, reward, terminated, truncated, lives, action,
                                         np.asarray(logprob), np.asarray(value), 0):
            rollouts.append(rollout)
    envs.close()
    ends = [int((r.terminated | r.truncated).sum()) for r in rollouts[1:]]
    previous, rollout = rollouts[ends.index(max(ends))], rollouts[ends.index(max(ends)) + 1]
    return args, agent, params, rollout, previous.terminated[-2] | previous.truncated[-2]


def cleanba_params(params) -> dict:
    """Our Agent's params as Cleanba's AgentParams leaves ("network_params/params/ConvSequence_0/Conv_0/kernel", ...):
    the same layers in the same order (conv, max-pool, two residual blocks per stack; dense; policy and value heads)."""
    import numpy as np
    p = params["params"]
    encoder, out = p["ImpalaEncoder_0"], {}
    for stack in range(3):
        out[f"network_params/params/ConvSequence_{stack}/Conv_0"] = encoder[f"Conv_{stack}"]
        for block in range(2):
            for conv in range(2):
                out[f"network_params/params/ConvSequence_{stack}/ResidualBlock_{block}/Conv_{conv}"] = \
                    encoder[f"ResidualBlock_{2 * stack + block}"][f"Conv_{conv}"]
    out["network_params/params/Dense_0"] = encoder["Dense_0"]
    out["actor_params/params/Dense_0"], out["critic_params/params/Dense_0"] = p["Dense_0"], p["Dense_1"]
    return {f"{name}/{leaf}": np.asarray(layer[leaf]) for name, layer in out.items() for leaf in ("kernel", "bias")}


def ours_side(args, agent, params, rollout, updates: int, optimizer: str):
    """Our loss terms (sums), gradient and params after each of `updates` updates on `rollout`, flattened as
    Cleanba's leaves, with our impala_loss and the --optimizer's transformation after the global-norm clip."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from sebulba.impala_envpool import OPTIMIZERS, impala_loss

    batch = jax.tree.map(jnp.asarray, rollout)
    mask = 1.0 - (rollout.terminated[:-1] | rollout.truncated[:-1]).astype(np.float32)

    def loss_fn(p, rollout):
        return impala_loss(p, lambda q, obs: agent.apply(q, obs), rollout, args)

    grad_fn = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
    (loss, metrics), grads = grad_fn(params, batch)  # at the initial params: the loss terms and the first step
    count = float(mask.sum())
    out = dict(loss=loss, pg_loss=metrics["policy_loss"] * count, v_loss=metrics["value_loss"] * count,
               ent_loss=-metrics["entropy"] * count, grad_norm=optax.global_norm(grads))
    out.update({f"grad/{k}": v for k, v in cleanba_params(grads).items()})
    tx = optax.chain(optax.clip_by_global_norm(args.max_grad_norm), OPTIMIZERS[optimizer](args.learning_rate))
    state = tx.init(params)
    for i in range(updates):
        step, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, step)
        out.update({f"params{i + 1}/{k}": v for k, v in cleanba_params(params).items()})
        if i + 1 < updates:
            _, grads = grad_fn(params, batch)
    return {k: np.asarray(v) for k, v in out.items()}


def cleanba_batch(agent, params, rollout, before, aligned: bool) -> dict:
    """The rollout as Cleanba's Transition fields ([T+1, N]); see the module docstring for the two alignments."""
    import numpy as np
    logits = np.asarray(agent.apply(params, rollout.obs.reshape((-1,) + rollout.obs.shape[2:]))[0])
    logits = logits.reshape(rollout.actions.shape + (-1,))
    done = rollout.terminated | rollout.truncated
    if rollout.truncated.any():
        raise SystemExit("a time limit inside the parity batch: Cleanba does not bootstrap truncations; use another seed")
    if aligned:  # row t carries what transition t earns in ours: the reward and end received with obs_{t+1}
        rewards = np.concatenate([rollout.rewards[1:], np.zeros_like(rollout.rewards[:1])])
        dones = np.concatenate([rollout.terminated[1:], np.zeros_like(done[:1])]).astype(np.float32)
        firststeps = done.astype(np.float32)  # ours' mask: the row of an episode's last observation
    else:
        rewards, dones = rollout.rewards, done.astype(np.float32)
        firststeps = np.concatenate([before[None], done[:-1]]).astype(np.float32)  # the row after an episode's end
    return dict(obs=rollout.obs, actions=rollout.actions, logitss=logits.astype(np.float32), rewards=rewards,
                dones=dones, firststeps=firststeps)


def compare(ours: dict, theirs: dict) -> dict:
    import numpy as np

    def rel(a, b):
        return float(np.linalg.norm(np.ravel(a) - np.ravel(b)) / max(np.linalg.norm(np.ravel(b)), 1e-30))

    def tree_rel(prefix):
        keys = sorted(k for k in theirs if k.startswith(prefix))
        a = np.concatenate([np.ravel(ours[k]) for k in keys])
        b = np.concatenate([np.ravel(theirs[k]) for k in keys])
        return rel(a, b)

    row = {k: {"ours": float(ours[k]), "cleanba": float(theirs[k]), "relative_difference": rel(ours[k], theirs[k])}
           for k in ("loss", "pg_loss", "v_loss", "ent_loss", "grad_norm")}
    row["gradient_relative_difference"] = tree_rel("grad/")
    initial = {k.split("/", 1)[1]: v for k, v in ours.items() if k.startswith("params0/")}
    for i in range(1, UPDATES + 1):
        keys = sorted(k for k in theirs if k.startswith(f"params{i}/"))
        if not keys:  # native: one update
            break
        step_ours = np.concatenate([np.ravel(ours[k] - initial[k.split("/", 1)[1]]) for k in keys])
        step_theirs = np.concatenate([np.ravel(theirs[k] - initial[k.split("/", 1)[1]]) for k in keys])
        row[f"after_{i}"] = {"step_norm_ours": float(np.linalg.norm(step_ours)),
                             "step_norm_cleanba": float(np.linalg.norm(step_theirs)),
                             "step_relative_difference": rel(step_ours, step_theirs)}
    return row


def parity(checkout: Path):
    import numpy as np
    if not VENV_PYTHON.exists():
        raise SystemExit("run `python benchmark/cleanba.py --setup` first (.venv-cleanba/)")
    args, agent, params, rollout, before = collect_rollout()
    done = rollout.terminated | rollout.truncated
    print(f"batch: {NUM_STEPS + 1} x {NUM_ENVS} rows of Breakout-v5 (cleanba protocol), {int(done.sum())} episode ends, "
          f"{int((rollout.rewards != 0).sum())} rewards")
    initial = {f"params0/{k}": v for k, v in cleanba_params(params).items()}
    ours = {name: {**initial, **ours_side(args, agent, params, rollout, UPDATES, name)}
            for name in ("rmsprop-torch", "rmsprop")}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for alignment in ("aligned", "native"):
            inputs, outputs = Path(tmp) / f"{alignment}-in.npz", Path(tmp) / f"{alignment}-out.npz"
            np.savez(inputs, **cleanba_params(params),
                     **cleanba_batch(agent, params, rollout, before, alignment == "aligned"),
                     **SETTINGS, updates=UPDATES if alignment == "aligned" else 1)
            subprocess.run([str(VENV_PYTHON), str(ROOT / "benchmark" / "cleanba_side.py"), str(checkout), str(inputs),
                            str(outputs)], check=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
            theirs = dict(np.load(outputs))
            results[alignment] = {name: compare(o, theirs) for name, o in ours.items()}
    record = dict(machine=machine(), cleanba_commit=checkout_commit(checkout), settings=SETTINGS,
                  batch=dict(env_id="Breakout-v5", protocol="cleanba", num_envs=NUM_ENVS, num_steps=NUM_STEPS,
                             episode_ends=int(done.sum()), rewards=int((rollout.rewards != 0).sum()),
                             network="IMPALA ResNet 16-32-32/256, initial parameters (seed 1)"),
                  updates=UPDATES, results=results)
    save("parity", record)
    print(json.dumps(results, indent=1))


def throughput(checkout: Path, seconds: float):
    """Cleanba's cleanba_impala.py as its users run it (its defaults: Breakout-v5, 2 actor threads x 64 envs x 20
    steps, 4 minibatches, actor and learner on device 0), stopped after `seconds`; env steps/s from its `SPS:` lines
    and its learner's `training time:` lines."""
    import re
    command = [str(VENV_PYTHON), "cleanba/cleanba_impala.py", "--log-frequency", "1"]
    started, sps, training = time.monotonic(), [], []
    with tempfile.TemporaryDirectory() as tmp, open(Path(tmp) / "console.log", "w+") as log:
        process = subprocess.Popen(command, cwd=checkout, stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, "JAX_PLATFORMS": "cpu"}, start_new_session=True)
        try:
            process.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            process.wait()
        log.seek(0)
        for line in log:
            if m := re.match(r"SPS: (\d+)", line):
                sps.append((time.monotonic() - started, int(m.group(1))))
            if m := re.search(r"^(\d+) actor_policy_version.*training time: ([\d.]+)s", line):
                training.append((int(m.group(1)), float(m.group(2))))
    record = dict(machine=machine(), cleanba_commit=checkout_commit(checkout), command=" ".join(command[1:]),
                  seconds=seconds, sps_lines=[s for _, s in sps], training_time_s=training)
    save("throughput", record)
    print(json.dumps(record, indent=1))


def save(key: str, record: dict):
    path = RESULTS / "cleanba.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data[key] = record
    path.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {path.relative_to(ROOT)} [{key}]")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", nargs="?", choices=("parity", "throughput"))
    parser.add_argument("--setup", action="store_true", help="create .venv-cleanba/ and install Cleanba's pins into it")
    parser.add_argument("--cleanba", type=Path, help="a checkout of github.com/vwxyzjn/cleanba")
    parser.add_argument("--seconds", type=float, default=600.0, help="throughput: how long Cleanba runs")
    args = parser.parse_args(argv)
    if args.setup:
        setup()
    if args.command is None:
        if not args.setup:
            parser.error("give --setup, parity or throughput")
        return
    if args.cleanba is None or not (args.cleanba / "cleanba" / "cleanba_impala.py").exists():
        parser.error("--cleanba PATH: a checkout of Cleanba holding cleanba/cleanba_impala.py")
    if args.command == "parity":
        parity(args.cleanba.resolve())
    else:
        throughput(args.cleanba.resolve(), args.seconds)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
