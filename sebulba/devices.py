"""Devices: the JAX backend, virtual CPU devices, the `jax.distributed` start, and
`Placement`, every device placement of a run (actor devices, the learner mesh, its shardings).
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sebulba.config import Cluster, ConfigError, resolves

HEARTBEAT_TIMEOUT_S = 20  # a process silent this long is dead: jax.distributed ends the others
MAX_VIRTUAL_CPU_DEVICES = 64  # a typo such as device id 99 must not quietly make a hundred CPU devices


def use_compilation_cache(directory: str | None):
    """Turn on JAX's persistent compilation cache in `directory` (--compilation-cache-dir; `~`
    expanded, created on first write), or leave it off for None. Every program is cached, however
    short its compile: a run's dozen small programs are what a second run would otherwise wait
    for. Before the first compile; a program compiled again with the same shapes, flags and
    library versions is read from disk."""
    if directory is None:
        return
    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def use_orbax_distributed_barriers():
    """Orbax's barriers through the jax.distributed client (with timeouts) instead of a collective
    over every device, which on the CPU opens a second Gloo context beside the learner mesh's
    (and prints Gloo's "connected" line twice). Orbax reads this absl flag; nothing here parses
    absl flags, so they are marked parsed at their defaults first."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    flags.FLAGS.experimental_orbax_use_distributed_barrier = True


def setup_devices(actor_device_ids: list[int], learner_device_ids: list[int],
                  cluster: Cluster = Cluster()) -> tuple[list[jax.Device], list[jax.Device]]:
    """Start the JAX backend; return (this process's actor devices, the learner devices of
    every process, process-major: the learner mesh).

    Device ids are local to each process. On the CPU backend `jax_num_cpu_devices` is raised
    to cover the largest requested id, unless the user's XLA_FLAGS already set a device count
    (never overwritten). A multi-process cluster joins `jax.distributed` first (CPU
    collectives through gloo); a process that dies is noticed by the others' heartbeat
    within HEARTBEAT_TIMEOUT_S and ends them.

    Raises:
      ConfigError: a requested id does not exist on this process.
    """
    ids = sorted(set(actor_device_ids + learner_device_ids))
    needed = ids[-1] + 1
    created = False
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        with contextlib.suppress(RuntimeError):  # the backend is already up (e.g. in tests): use what exists
            if needed > jax.config.jax_num_cpu_devices:  # more than MAX_VIRTUAL_CPU_DEVICES: refused below
                jax.config.update("jax_num_cpu_devices", min(needed, MAX_VIRTUAL_CPU_DEVICES))
                created = True
    if cluster.num_processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        use_orbax_distributed_barriers()
        join(cluster, ids)
    devices = jax.local_devices()
    if needed > len(devices) and created and devices[0].platform == "cpu":
        raise ConfigError(f"device id {needed - 1} requested but without an accelerator at most "
                          f"{MAX_VIRTUAL_CPU_DEVICES} virtual CPU devices are made; use ids 0..{len(devices) - 1}")
    if needed > len(devices):
        raise ConfigError(f"device id {needed - 1} requested but this process has {len(devices)} "
                          f"{devices[0].platform} devices; use ids 0..{len(devices) - 1}")
    if created and devices[0].platform == "cpu" and needed > 1:
        print(f"no accelerator: running on {len(devices)} virtual CPU devices (jax_num_cpu_devices={needed})")
    per_process = [jax.local_devices(process_index=p) for p in range(jax.process_count())]
    learners = [local[i] for local in per_process for i in learner_device_ids]
    return [devices[i] for i in actor_device_ids], learners


def join(cluster: Cluster, local_device_ids: list[int]):
    """`jax.distributed.initialize` with a bound: every process reaches process 0's coordinator
    within `cluster.coordinator_timeout_s` seconds, or ends with one line on stderr naming the
    address, where it came from and what to check, and exit code 1 (JAX alone would wait 5
    minutes, then abort with a native stack trace). This process owns every device it names
    (`local_device_ids`; JAX would give each SLURM task one GPU).

    Raises:
      ConfigError: the coordinator's address is not host:port, or its host does not resolve here.
    """
    address, who = cluster.coordinator_address, f"process {cluster.process_id} of {cluster.num_processes}"
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"the coordinator address {address!r} ({cluster.coordinator}) must be HOST:PORT")
    if not resolves(host.strip("[]")):
        raise ConfigError(f"{who}: the coordinator host {host} ({cluster.coordinator}) does not resolve on "
                          f"{socket.gethostname()}: check DNS or /etc/hosts on every node, or give "
                          "--coordinator-address HOST:PORT with a name or address that resolves")

    def give_up():
        what = ("not every process reached the coordinator it runs" if cluster.process_id == 0
                else "could not reach the coordinator")
        print(f"error: {who}: {what} at {address} ({cluster.coordinator}) within {cluster.coordinator_timeout_s:g} s: "
              f"check that every process started, that {host} is process 0's node and reachable from every node, and "
              f"that port {port} is open between the nodes (--coordinator-timeout-s waits longer)",
              file=sys.stderr, flush=True)
        os._exit(1)  # initialize() does not return, and a native abort would follow

    print(f"{who}: joining the coordinator at {address} ({cluster.coordinator})", flush=True)
    # Off: JAX's preemption service would catch SIGTERM from initialize() on and only log it ("SIGTERM
    # caught"), so until StopSignals is installed a requeue (scontrol requeue, pre-emption) would go
    # unheard and the job would train on until SIGKILL. The run votes on stop signals itself
    # (Run.stop_requested).
    jax.config.update("jax_enable_preemption_service", False)
    watchdog = threading.Timer(cluster.coordinator_timeout_s, give_up)
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.distributed.initialize(address, cluster.num_processes, cluster.process_id,
                                   local_device_ids=local_device_ids, heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S,
                                   initialization_timeout=int(cluster.coordinator_timeout_s) + 30)
    finally:
        watchdog.cancel()


class Placement:
    """Every device placement of the script: actor devices, the learner mesh (the learner
    devices of every process) and its shardings."""

    def __init__(self, actor_devices: list[jax.Device], learner_devices: list[jax.Device]):
        self.actor_devices = actor_devices
        self.mesh = Mesh(np.array(learner_devices), ("learner",))
        self.replicated = NamedSharding(self.mesh, P())
        self.env_sharded = NamedSharding(self.mesh, P(None, "learner"))  # [T, envs, ...]: env axis split
        self.num_local_learners = sum(d.process_index == jax.process_index() for d in learner_devices)
        self._max = jax.jit(jnp.max, out_shardings=self.replicated)

    def agree_max(self, value: int) -> int:
        """The largest of every process's `value` (an int), once every process has called this: a
        barrier and a vote. It runs on the learner mesh, the run's one collective group (a
        barrier over every device would open a second Gloo context on the CPU, and print
        Gloo's "connected" line a second time)."""
        local = np.full(self.num_local_learners, value, np.int32)
        spread = jax.make_array_from_process_local_data(NamedSharding(self.mesh, P("learner")), local,
                                                        (self.mesh.size,))
        return int(host(self._max(spread)))

    def to_actors(self, params) -> dict[jax.Device, Any]:
        """One copy of the (replicated) learner `params` on each of this process's actor devices."""
        local = jax.tree.map(lambda x: x.addressable_data(0), params)
        return {d: jax.device_put(local, d) for d in self.actor_devices}

    def replicate(self, tree):
        """Host values, the same on every process -> arrays replicated over the learner mesh."""
        return jax.tree.map(lambda x: jax.make_array_from_process_local_data(self.replicated, np.asarray(x)), tree)

    def to_learners(self, rollouts: list[NamedTuple]) -> NamedTuple:
        """Concatenate this process's per-thread host rollouts [T+1, N] (a `Rollout`, or any
        pytree of [T+1, N, ...] arrays: dictionary observations too) into its [T+1, K*N] part
        of the global batch [T+1, processes*K*N], ordered so each local learner device's
        contiguous env slice holds an equal part of every thread's envs."""
        num_learners = self.num_local_learners

        def interleave(*xs):  # K x [T+1, N, ...] -> [T+1, K*N, ...] in one copy (frames are most of the bytes)
            (t, n), rest, k = xs[0].shape[:2], xs[0].shape[2:], len(xs)
            local = np.empty((t, k * n) + rest, xs[0].dtype)
            per_learner = local.reshape((t, num_learners, k, n // num_learners) + rest)
            for i, x in enumerate(xs):
                per_learner[:, :, i] = x.reshape((t, num_learners, n // num_learners) + rest)
            global_shape = (t, k * n * jax.process_count()) + rest
            return jax.make_array_from_process_local_data(self.env_sharded, local, global_shape)

        return jax.tree.map(interleave, *rollouts)


def host(x) -> np.ndarray:
    """The value of an array replicated over the learner mesh, on the host (any process)."""
    return np.asarray(x.addressable_data(0))
