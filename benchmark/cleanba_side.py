"""Cleanba's own IMPALA update on a batch that benchmark/cleanba.py saved: run in .venv-cleanba (Cleanba's jax
0.4, flax 0.6, optax 0.1, rlax), never imported by this project.

    .venv-cleanba/bin/python benchmark/cleanba_side.py CLEANBA_CHECKOUT IN.npz OUT.npz

Cleanba's script builds its update inside `if __name__ == "__main__":`, so this loads the file from the checkout
unchanged, executes its module level (the networks, its PyTorch-style RMSProp), then, from its main block, the
definitions `linear_schedule`, `get_logits_and_value`, `policy_gradient_loss`, `entropy_loss_fn`, `impala_loss` and
`single_device_update`, and the `tx=` of its `TrainState.create`, each as written there (Python's ast picks them
out; nothing is copied into this file). `args` and `envs`, which those definitions read as globals, are Cleanba's
own `Args` with the batch's settings and the action count.

IN.npz: the AgentParams leaves under "network_params/...", "actor_params/...", "critic_params/..." (flax names),
the Transition fields obs [T+1, N, 4, 84, 84] uint8, actions [T+1, N], logitss [T+1, N, A], rewards, dones,
firststeps [T+1, N] as Cleanba's actor stores them, and the settings (gamma, ent_coef, vf_coef, max_grad_norm,
learning_rate, updates: how many updates to take on the batch). OUT.npz: the loss terms and the gradient's global
norm at the given params (Cleanba's impala_loss, sums over the batch), the flat gradient, and the params after
each update of Cleanba's single_device_update (pmapped over one device, as its learner runs).
"""

import ast
import sys
from types import SimpleNamespace

import numpy as np

MAIN_DEFINITIONS = ("linear_schedule", "get_logits_and_value", "policy_gradient_loss", "entropy_loss_fn",
                    "impala_loss", "single_device_update")


def is_main_block(node) -> bool:
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
            and getattr(node.test.left, "id", None) == "__name__")


def load_cleanba(path: str, settings: dict, num_actions: int) -> dict:
    """Cleanba's definitions from `path` (cleanba/cleanba_impala.py) in one namespace, with `args` and `envs`."""
    source = open(path).read()
    tree = ast.parse(source)
    main = next(node for node in tree.body if is_main_block(node))
    namespace = {"__name__": "cleanba_impala", "__file__": path}
    exec(compile(ast.Module([n for n in tree.body if n is not main], type_ignores=[]), path, "exec"), namespace)
    args = namespace["Args"]()
    for name, value in settings.items():
        setattr(args, name, value)
    namespace["args"] = args
    namespace["envs"] = SimpleNamespace(single_action_space=SimpleNamespace(n=num_actions))
    defs = [n for n in main.body if isinstance(n, ast.FunctionDef) and n.name in MAIN_DEFINITIONS]
    missing = set(MAIN_DEFINITIONS) - {n.name for n in defs}
    if missing:
        raise SystemExit(f"{path}: no {', '.join(sorted(missing))} in its main block (another Cleanba version?)")
    exec(compile(ast.Module(defs, type_ignores=[]), path, "exec"), namespace)
    create = next(n for n in ast.walk(main) if isinstance(n, ast.Call) and getattr(n.func, "attr", None) == "create")
    tx = next(k.value for k in create.keywords if k.arg == "tx")
    namespace["tx"] = eval(compile(ast.Expression(tx), path, "eval"), namespace)
    return namespace


def main(checkout: str, inputs: str, outputs: str):
    import flax
    import jax
    import jax.numpy as jnp
    import optax
    from flax.training.train_state import TrainState

    data = dict(np.load(inputs))
    settings = dict(gamma=float(data["gamma"]), ent_coef=float(data["ent_coef"]), vf_coef=float(data["vf_coef"]),
                    max_grad_norm=float(data["max_grad_norm"]), learning_rate=float(data["learning_rate"]),
                    anneal_lr=False, num_minibatches=1, gradient_accumulation_steps=1, num_updates=1)
    ns = load_cleanba(f"{checkout}/cleanba/cleanba_impala.py", settings, data["logitss"].shape[-1])

    def tree(prefix):
        out = {}
        for key, value in data.items():
            if key.startswith(prefix + "/"):
                node, *path = key[len(prefix) + 1:].split("/")
                parent = out.setdefault(node, {})
                for part in path[:-1]:
                    parent = parent.setdefault(part, {})
                parent[path[-1]] = jnp.asarray(value)
        return flax.core.freeze(out)

    params = ns["AgentParams"](tree("network_params"), tree("actor_params"), tree("critic_params"))
    batch = [jnp.asarray(data[k]) for k in ("obs", "actions", "logitss", "rewards", "dones", "firststeps")]
    (loss, (pg_loss, v_loss, ent_loss)), grads = jax.value_and_grad(ns["impala_loss"], has_aux=True)(params, *batch)
    result = dict(loss=loss, pg_loss=pg_loss, v_loss=v_loss, ent_loss=ent_loss, grad_norm=optax.global_norm(grads))
    result.update({f"grad/{k}": v for k, v in flatten(grads).items()})

    devices = jax.devices()[:1]
    update = jax.pmap(ns["single_device_update"], axis_name="local_devices", devices=devices)
    state = flax.jax_utils.replicate(TrainState.create(apply_fn=None, params=params, tx=ns["tx"]), devices=devices)
    # its update reads obs, actions, logitss, rewards, dones and firststeps; the other three fields ride along unread
    fields = dict(obs=batch[0], dones=batch[4], actions=batch[1], logitss=batch[2], env_ids=batch[4], rewards=batch[3],
                  truncations=batch[4], terminations=batch[4], firststeps=batch[5])
    storage = [ns["Transition"](**{k: v[None] for k, v in fields.items()})]
    keys = jax.device_put_replicated(jax.random.PRNGKey(0), devices)
    for i in range(int(data["updates"])):
        state, *_, keys = update(state, storage, keys)
        result.update({f"params{i + 1}/{k}": v for k, v in flatten(flax.jax_utils.unreplicate(state.params)).items()})
    np.savez(outputs, **{k: np.asarray(v) for k, v in result.items()})


def flatten(params) -> dict:
    import flax
    out = {}
    for part in ("network_params", "actor_params", "critic_params"):
        flat = flax.traverse_util.flatten_dict(flax.core.unfreeze(getattr(params, part)))
        out.update({"/".join((part, *key)): value for key, value in flat.items()})
    return out


if __name__ == "__main__":
    main(*sys.argv[1:4])
