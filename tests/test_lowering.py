"""Ready for the first GPU: every program a script compiles, lowered for GPU (`cuda`) and TPU on
this CPU-only machine (JAX lowers for a platform without its devices).

Each case runs a script for one update on CPU with `jax.jit` wrapped, so that every program the
script builds itself is recorded with the abstract arguments (shape, dtype, sharding) of its
first call: the actors' policy, every learner program, the evaluator's policy, the observation
statistics. Each is then lowered for `cuda` and `tpu`. The Nature CNN's convolutions take a
CPU-only branch (`lax.platform_dependent` in sebulba/networks.py's ValidConv: patches and one
matmul, which XLA:CPU runs faster); lowered for a GPU or TPU the same programs must hold XLA's
convolution instead, and lowered for the CPU none. That branch alone is also checked in the fast
tier, on the Nature CNN's forward pass and gradient (under a second, no training).
"""

import functools
import sys
import threading

import jax
import pytest
import tyro

import sebulba.impala_envpool as impala
import sebulba.ppo_envpool as ppo
import sebulba.ppo_lstm_envpool as lstm
import sebulba.pqn_envpool as pqn
import sebulba.sac_envpool as sac

ONE_UPDATE = ["--num-actor-threads", "1", "--actor-device-ids", "0", "--learner-device-ids", "1", "2",
              "--checkpoint-interval", "0", "--eval-episodes", "1", "--log-frequency", "1"]
VECTOR = ["--env-id", "CartPole-v1", "--local-num-envs", "4", "--num-steps", "8", "--hiddens", "16",
          "--total-timesteps", "32"]
# The evaluator plays a whole game: on Breakout that is seconds of policy calls, so the Atari cases leave it out (its
# program is the actors' policy's, greedy or not; the vector cases lower it).
ATARI = ["--env-id", "Breakout-v5", "--local-num-envs", "2", "--num-steps", "4", "--total-timesteps", "8",
         "--num-minibatches", "1", "--update-epochs", "1", "--eval-episodes", "0"]
CASES = {  # name: (script, flags, whether the programs hold the Nature CNN)
    "ppo-vector": (ppo, [*VECTOR, "--num-minibatches", "2", "--update-epochs", "1"], False),
    "ppo-atari-nature": (ppo, [*ATARI, "--atari-encoder", "nature", "--hiddens", "32", "--gradient-accumulation-steps",
                               "2"], True),
    "impala-vector": (impala, VECTOR, False),
    "ppo-lstm-vector": (lstm, [*VECTOR, "--num-minibatches", "2", "--update-epochs", "1", "--lstm-size", "8"], False),
    "pqn-vector": (pqn, [*VECTOR, "--num-minibatches", "2", "--update-epochs", "1"], False),
    "pqn-atari-nature": (pqn, [*ATARI, "--hiddens", "32"], True),
    "sac-vector": (sac, ["--env-id", "Pendulum-v1", "--local-num-envs", "4", "--num-steps", "2", "--hiddens", "16",
                         "--total-timesteps", "16", "--learning-starts", "8", "--minibatch-size", "8",
                         "--buffer-size", "64"], False),
}


class Recorded:
    """A jitted program of a script: forwards everything to it, and keeps the abstract arguments
    of its first call (outside a trace: a program called inside another is lowered with it)."""

    def __init__(self, jitted, name: str, programs: dict, lock: threading.Lock):
        self.jitted, self.name, self.programs, self.lock = jitted, name, programs, lock
        functools.update_wrapper(self, jitted)

    def __call__(self, *args, **kwargs):
        leaves = jax.tree.leaves((args, kwargs))
        if not any(isinstance(x, jax.core.Tracer) for x in leaves):
            with self.lock:
                if self.name not in self.programs:
                    self.programs[self.name] = (self.jitted, jax.tree.map(abstract, (args, kwargs)))
        return self.jitted(*args, **kwargs)

    def __getattr__(self, name):  # .lower, .trace, .eval_shape (the scripts' memory checks use them)
        return getattr(self.jitted, name)

    def __get__(self, instance, owner):  # a jitted method
        return self if instance is None else functools.partial(self, instance)


def abstract(x):
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    if hasattr(x, "shape") and hasattr(x, "dtype"):  # a NumPy array: placed by jit as on the first call
        return jax.ShapeDtypeStruct(x.shape, x.dtype)
    return x


def record_programs(module, flags: list[str], monkeypatch) -> dict:
    """{name: (jitted program, (args, kwargs) abstract)} of every program `module` jitted itself in a run of
    `flags`; named by the function's qualified name, numbered from the second program of one name on."""
    programs, made, lock, real = {}, {}, threading.Lock(), jax.jit

    def jit(fun=None, **options):
        if fun is None:  # @jax.jit(...) with options
            return lambda f: jit(f, **options)
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if not caller.startswith("sebulba"):  # orbax's and flax's own programs
            return real(fun, **options)
        name = getattr(fun, "__qualname__", None) or getattr(getattr(fun, "func", None), "__qualname__", repr(fun))
        name = f"{caller.rsplit('.', 1)[-1]}.{name}".replace(".<locals>", "")
        made[name] = made.get(name, 0) + 1  # one name a program: the actors' policy, the evaluator's (#2)
        return Recorded(real(fun, **options), name + f"#{made[name]}" * (made[name] > 1), programs, lock)

    monkeypatch.setattr(jax, "jit", jit)
    summary = module.main(tyro.cli(module.Args, args=[*ONE_UPDATE, *flags, "--run-name", "lowered"]))
    assert summary["updates"] >= 1
    return programs


def lowered_texts(jitted, arguments, platforms: tuple[str, ...]) -> dict[str, str]:
    """{platform: StableHLO text} of `jitted` traced once with `arguments`, lowered for each platform."""
    args, kwargs = arguments
    traced = jitted.trace(*args, **kwargs)
    return {platform: traced.lower(lowering_platforms=(platform,)).as_text() for platform in platforms}


def test_the_nature_cnn_lowers_to_xla_convolutions_on_accelerators_and_to_the_patch_path_on_the_cpu():
    """The fast tier's check of the branch: the Nature CNN's forward pass and its gradient, lowered for each platform."""
    import jax.numpy as jnp

    from sebulba.networks import NatureEncoder

    encoder = NatureEncoder((32,))
    frames = jnp.zeros((2, 4, 84, 84), jnp.uint8)
    variables = jax.eval_shape(encoder.init, jax.random.PRNGKey(0), frames)
    forward = jax.jit(encoder.apply)
    gradient = jax.jit(jax.grad(lambda v, x: encoder.apply(v, x).sum()))
    for program, accelerated in ((forward, 3), (gradient, 3 + 5)):  # the backward pass: input and kernel gradients
        texts = lowered_texts(program, ((variables, frames), {}), ("cuda", "tpu", "cpu"))
        assert texts["cuda"].count("stablehlo.convolution") == accelerated
        assert texts["tpu"].count("stablehlo.convolution") == accelerated
        assert texts["cpu"].count("stablehlo.convolution") == 0


@pytest.mark.slow  # one real update of each script
@pytest.mark.parametrize("case", list(CASES))
def test_every_program_of_a_script_lowers_for_gpu_and_tpu(case, monkeypatch):
    module, flags, nature = CASES[case]
    programs = record_programs(module, flags, monkeypatch)
    names = set(programs)
    policies = {n for n in names if n.rsplit("#", 1)[0].endswith(".policy")}
    assert len(policies) == (1 if "--eval-episodes" in flags else 2), names  # the actors' and the evaluator's
    assert any(".make_update_fn." in n for n in names), names  # the learner's
    if module is ppo and nature:  # microbatches: the gradient program, added up by the step program
        assert {"ppo_envpool.make_update_fn.add_gradient", "ppo_envpool.make_update_fn.step"} <= names, names
    convolutions = {}
    for name, (jitted, arguments) in programs.items():
        for platform, text in lowered_texts(jitted, arguments, ("cuda", "tpu", "cpu")).items():  # raises where a
            convolutions[name, platform] = text.count("stablehlo.convolution")  # branch cannot lower
    for name in names:
        assert convolutions[name, "cuda"] == convolutions[name, "tpu"], name
        if nature:  # the Nature CNN: XLA's convolution on accelerators, the patch path on the CPU
            assert convolutions[name, "cpu"] == 0, name
    if nature:
        assert all(convolutions[n, "cuda"] == 3 for n in policies), {n: convolutions[n, "cuda"] for n in policies}
        learner = max(convolutions[n, "cuda"] for n in names - set(policies))
        assert learner >= 3 + 5, convolutions  # forward, and the backward pass's input and kernel gradients
