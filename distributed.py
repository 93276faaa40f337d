"""Processes, devices and the mesh: joining a multi-process run, the ("data", "model") mesh,
whether a model and batch fit on it, which rows of a batch this process holds; and how every
process stops together (a signal, a failed checkpoint write).

    start_distributed(DistConfig(...))      # before any device is touched; no-op for 1 process
    check_fits(mesh_cfg, model_cfg, batch_size, len(jax.devices()))
    mesh = make_mesh(mesh_cfg)              # explicit axis types: jax.make_mesh + jax.set_mesh

Parameters are FSDP-sharded over "data" and tensor-parallel over "model"; the batch is split
over "data". Which parameter dimension goes on which axis is declared once, in model.py.
"""

import atexit
import dataclasses
import os
import pathlib
import signal
import socket
import sys
import threading
import time

import jax
from jax.experimental import multihost_utils
from jax.sharding import AxisType

from attention import check_platform
from cli import UserError
from model import LOGICAL_TO_MESH, ModelConfig, param_table


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    data: int = 1  # batch split and FSDP over this axis
    model: int = 1  # tensor parallelism over heads / ffw / vocab


@dataclasses.dataclass(frozen=True)
class DistConfig:
    """Several processes (one per host, or per GPU): JAX's multi-controller runtime. Fields left
    unset come from JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID; with
    --dist.auto JAX detects them itself on SLURM, Open MPI, Cloud TPU and GKE."""
    coordinator: str = ""  # host:port of process 0
    num_processes: int = 0  # 0: $JAX_NUM_PROCESSES, else 1 (a single process)
    process_id: int = -1  # -1: $JAX_PROCESS_ID
    auto: bool = False  # jax.distributed.initialize() with cluster auto-detection
    timeout: int = 300  # seconds to wait for all processes to join (JAX's default)



def start_distributed(cfg: DistConfig) -> None:
    """Join the other processes of a multi-process run (before any JAX device is touched); a
    single process does nothing. Every process then sees all devices of all processes."""
    if cfg.timeout <= 0:
        raise UserError(f"--dist.timeout must be positive, got {cfg.timeout}")
    if cfg.auto:
        join(None, None, None, cfg.timeout)
        return
    env = os.environ
    n = cfg.num_processes or int(env.get("JAX_NUM_PROCESSES", 1))
    if n <= 1:
        return
    coordinator = cfg.coordinator or env.get("JAX_COORDINATOR_ADDRESS", "")
    pid = cfg.process_id if cfg.process_id >= 0 else int(env.get("JAX_PROCESS_ID", -1))
    if not coordinator or not 0 <= pid < n:
        raise UserError(f"a {n}-process run needs --dist.coordinator HOST:PORT and "
                        f"--dist.process-id in [0, {n}) (or JAX_COORDINATOR_ADDRESS and "
                        "JAX_PROCESS_ID)")
    join(coordinator, n, pid, cfg.timeout)


def join(coordinator: str | None, n: int | None, pid: int | None, timeout: int) -> None:
    """jax.distributed.initialize. A process other than 0 first waits up to `timeout` seconds
    for the coordinator to accept connections, and fails in one line if it never does (JAX
    itself would abort the process with a C++ stack trace)."""
    if coordinator and pid:
        host, _, port = coordinator.rpartition(":")
        if not host or not port.isdigit():
            raise UserError(f"--dist.coordinator must be HOST:PORT, got {coordinator!r}")
        try:  # a name that does not resolve never will: say so now, not after the timeout
            socket.getaddrinfo(host.strip("[]"), int(port))
        except (socket.gaierror, UnicodeError) as e:
            raise UserError(f"--dist.coordinator {coordinator}: the host name {host!r} does not "
                            f"resolve ({getattr(e, 'strerror', None) or e}); check it") from None
        deadline, said = time.monotonic() + timeout, False
        while True:
            try:
                socket.create_connection((host, int(port)), timeout=2).close()
                break
            except OSError as e:
                if not said:  # say at once what it waits for, and for how long
                    print(f"process {pid}: waiting up to {timeout}s (--dist.timeout) for the "
                          f"coordinator {coordinator}", flush=True)
                    said = True
                if time.monotonic() > deadline:
                    raise UserError(f"could not reach --dist.coordinator {coordinator} within "
                                    f"--dist.timeout {timeout}s ({e.strerror or e}): is process "
                                    "0 running, and is the address right?") from None
                time.sleep(0.5)
    # JAX ends a join that times out with a C++ abort and its stack trace; this watchdog ends
    # it first, in one line (JAX's own limit is set later than it).
    watchdog = threading.Timer(timeout, give_up, (
        f"error: process {pid if pid is not None else '?'}: not every one of the "
        f"{n or '?'} processes joined within --dist.timeout {timeout}s: are they all started, "
        "with the same --dist.coordinator and --dist.num-processes?",))
    watchdog.daemon = True
    watchdog.start()
    jax.distributed.initialize(coordinator, num_processes=n, process_id=pid,
                               initialization_timeout=timeout + 60)
    watchdog.cancel()
    listener = threading.Thread(target=listen_for_stop, daemon=True)
    _listening.set()
    listener.start()
    atexit.register(lambda: (_listening.clear(), listener.join(timeout=5)))  # before JAX's




def give_up(line: str, code: int = 2) -> None:
    """One line to stderr, then end the process at once (from any thread)."""
    sys.stdout.flush()
    print(line, file=sys.stderr, flush=True)
    os._exit(code)


# One process that must stop (its checkpoint write failed) tells the others through JAX's
# coordination service, whose key-value store every process reaches: they stop within about a
# second instead of waiting in the next collective for the heartbeat timeout (100 s) and a C++
# abort. JAX exposes the store only as jax._src.distributed's client.
STOP_KEY = "spikefix/stop"


def _client():
    from jax._src import distributed
    return distributed.global_state.client


_listening = threading.Event()


def listen_for_stop() -> None:
    """A thread per process: polls STOP_KEY every second and ends this process when another
    one sets it; stops polling when the process exits (a thread still blocked in the client
    at exit would abort it)."""
    while _listening.is_set():
        try:
            message = _client().blocking_key_value_get(STOP_KEY, 1000)
        except Exception:  # not set within the second (or the service has gone): poll again
            continue
        if not message.startswith(f"process {jax.process_index()}:"):
            if jax.process_index() == 0:  # the service's host goes last: its exit would
                time.sleep(3)  # abort a process still in its grace (a C++ trace)
            give_up(f"error: {message}; process {jax.process_index()} stops too", code=1)
        return


def peer_stopped() -> str | None:
    """The message of another process that told this run to stop, if one did (a collective
    that failed because that process left is then no error of this process's own)."""
    if jax.process_count() <= 1:
        return None
    try:
        message = _client().blocking_key_value_get(STOP_KEY, 200)
    except Exception:
        return None
    return None if message.startswith(f"process {jax.process_index()}:") else message


# What a collective says when another process of the run has died (killed, its machine gone):
# gloo's cut connection, the coordination service's missed heartbeats.
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "heartbeat",
             "UNAVAILABLE", "Socket closed")


def peer_lost(e: Exception) -> str | None:
    """The first line of `e` if it is a collective cut off by a process that died (a
    multi-process run only), else None."""
    text = str(e)
    if jax.process_count() <= 1 or not any(k in text for k in PEER_LOST):
        return None
    return text.strip().splitlines()[0][:200]


def stop_peers(reason: str) -> None:
    """Tell the other processes of a multi-process run to stop, and give them time to hear it
    (they poll every second). Process 0 hosts the service and leaves last: it waits 2 s for
    the others to go; another process leaves after 1 s, before process 0 does."""
    if jax.process_count() <= 1:
        return
    try:
        _client().key_value_set(STOP_KEY, f"process {jax.process_index()}: {reason}")
        time.sleep(2.0 if jax.process_index() == 0 else 1.0)
    except Exception:
        pass


# Datasheet bf16 dense peaks, TFLOP/s per device (NVIDIA's and Google's spec sheets), matched
# by a part of jax's device_kind; MFU (PaLM's model FLOPs utilisation) is taken against them.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0,
               "A10G": 70.0, "TPU v4": 275.0, "TPU v5 lite": 197.0, "TPU v5p": 459.0}


def peak_tflops(given: float = 0.0) -> tuple[float, str]:
    """(the peak TFLOP/s of one device, where it comes from); 0 where none is known (a CPU
    has no datasheet figure: --peak-tflops gives one, e.g. bench's 2048^3 matmul rate)."""
    if given:
        return given, "--peak-tflops"
    kind = jax.devices()[0].device_kind
    found = next((v for k, v in PEAK_TFLOPS.items() if k in kind), 0.0)
    return found, f"{kind}'s bf16 datasheet figure" if found else ""


def say(*args, **kwargs) -> None:
    """print, on process 0 only."""
    if jax.process_index() == 0:
        print(*args, **kwargs)


def check_fits(mesh: MeshConfig, model: ModelConfig, batch_size: int,
               n_devices: int | None) -> None:
    """Raise UserError if the mesh cannot hold this model and batch. Which dimension is split
    over which mesh axis comes from the parameter table, as the shardings do."""
    sizes = {"data": mesh.data, "model": mesh.model}
    if LOGICAL_TO_MESH["seq"]:
        raise UserError(f"model.LOGICAL_TO_MESH splits the sequence over "
                        f"{LOGICAL_TO_MESH['seq']!r}, but every attention form builds its causal "
                        "mask from the positions one device holds: keep \"seq\" unsplit (None)")
    if n_devices is not None and mesh.data * mesh.model != n_devices:
        raise UserError(f"mesh {mesh.data}x{mesh.model} needs {mesh.data * mesh.model} devices "
                        f"but {n_devices} are present: set --mesh.data and --mesh.model so "
                        "their product is the device count")
    if batch_size % mesh.data:
        raise UserError(f"data.batch_size={batch_size} is not divisible by "
                        f"mesh.data={mesh.data}: change one of them")
    for name, spec in param_table(model).items():
        for dim, axis in zip(spec.shape, spec.axes):
            mesh_axis = LOGICAL_TO_MESH[axis]
            if mesh_axis and dim % sizes[mesh_axis]:
                raise UserError(f"{name}'s {axis} dimension ({dim}) is not divisible by "
                                f"mesh.{mesh_axis}={sizes[mesh_axis]}: change the model's "
                                "width or the mesh")


def make_mesh(cfg: MeshConfig, devices=None) -> jax.sharding.Mesh:
    return jax.make_mesh((cfg.data, cfg.model), ("data", "model"),
                         axis_types=(AxisType.Explicit, AxisType.Explicit), devices=devices)



def setup_mesh(cfg, devices) -> jax.sharding.Mesh:
    """The mesh of cfg.mesh over `devices`, once the model and batch are known to fit on it."""
    check_fits(cfg.mesh, cfg.model, cfg.data.batch_size, len(devices))
    try:
        check_platform(cfg.model.attention, devices[0].platform)
    except ValueError as e:
        raise UserError(str(e)) from None
    return make_mesh(cfg.mesh, devices)



def process_rows(sharding, batch_size: int) -> slice:
    """This process's rows of the global batch: those its own devices hold under `sharding`
    (all of them on one process)."""
    rows = [i[0] for i in sharding.addressable_devices_indices_map((batch_size, 1)).values()]
    return slice(min(r.start or 0 for r in rows), max(r.stop or batch_size for r in rows))


class StopRequested:
    """SIGINT / SIGTERM: save a checkpoint at the next step boundary, then exit. A second
    signal stops at once, saving nothing (the latest complete checkpoint stays the latest).

    On several processes a per-process flag could deadlock the collective save (one process
    saving step s, another s+1), so SIGTERM is left to JAX's preemption service: a signal to
    any process reaches all, and every process stops after the same step
    (`reached_preemption_sync_point`). Ctrl-C there is passed on as a SIGTERM to itself."""

    def __init__(self, run_dir: pathlib.Path):
        self.signal, self.run_dir = None, run_dir
        self.multi = jax.process_count() > 1
        sigs = (signal.SIGINT,) if self.multi else (signal.SIGINT, signal.SIGTERM)
        self.before = {sig: signal.signal(sig, self.handle) for sig in sigs}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        """The handlers as they were: a run that returned (train() in process, as the guarded
        rows of lab/harness.py call it one seed after another) must not swallow the next
        signal, which would reach its flag and no loop."""
        for sig, handler in self.before.items():
            signal.signal(sig, handler)

    def handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.signal is not None:
            print(flush=True)  # past the terminal's ^C
            print(f"{name} again: stopped without saving; the latest complete checkpoint in "
                  f"{self.run_dir} is where the same command resumes", file=sys.stderr, flush=True)
            os._exit(128 + signum)
        self.signal = signum
        print(f"\n{name}: saving a checkpoint after this step...", flush=True)
        if self.multi:  # to JAX's preemption notifier, which tells every process
            os.kill(os.getpid(), signal.SIGTERM)

    def requested(self, step: int) -> bool:
        """Whether to save and stop after `step` (called once per step, on every process)."""
        if self.multi and multihost_utils.reached_preemption_sync_point(step):
            self.signal = self.signal or signal.SIGTERM
            return True
        return self.signal is not None and not self.multi


def checkpoint_failed(error: Exception, run_dir: pathlib.Path) -> None:
    """A checkpoint could not be written: one line naming the cause and the last good
    checkpoint, then exit at once (orbax's writer threads would otherwise keep the process
    alive for ever after the failure)."""
    if peer := peer_stopped():  # another process left first, and this write failed with it
        give_up(f"error: {peer}; process {jax.process_index()} stops too", code=1)
    cause = str(error).split(" [tensorstore_spec")[0].split("\n")[0]
    try:  # read from the folder: a checkpoint manager would wait for the other processes
        good = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir()
                      if p.name.isdigit())
    except OSError:
        good = []
    sys.stdout.flush()
    print(f"error: writing a checkpoint to {run_dir}/checkpoints failed ({type(error).__name__}: "
          f"...{cause[-160:]}); the last good checkpoint is "
          f"{f'step {good[-1]}' if good else 'none'}. Fix the cause (disk space?) and resume "
          "with the same command", file=sys.stderr, flush=True)
    stop_peers(f"its checkpoint write to {run_dir} failed (see its output)")
    os._exit(1)


def activation_bytes(cfg: ModelConfig, tokens: int, model_shards: int = 1) -> int:
    """An estimate of the activations a train step keeps for its backward (no
    rematerialisation), for `tokens` tokens on one device whose heads, ffw and vocab are split
    `model_shards` ways: per layer and token the two blocks' normed inputs and residuals (4 D),
    q and the attention output (2 N H), k and v (2 K H), the MLP's gate, up and their product
    (3 F), in the compute dtype; and the logits with their gradient in float32 (2 V). A lower
    bound on the step's peak: the backward's temporaries come on top (XLA:CPU's peak temporary
    memory was 2.3-2.6x this on the small configs of the test)."""
    D, H, F, V = cfg.d_model, cfg.head_dim, cfg.d_ff, cfg.vocab_size
    layer = 4 * D + (2 * cfg.n_heads * H + 2 * cfg.n_kv_heads * H + 3 * F) / model_shards
    return int(tokens * (cfg.n_layers * layer * jax.numpy.dtype(cfg.dtype).itemsize
                         + 2 * V / model_shards * 4))
