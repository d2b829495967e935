"""The peer frameworks of ``benchmarks/run.py``: Flax NNX, Equinox and PyTorch.

Every peer builds the same model as ``benchmarks/models.py`` and starts from the same initial
weights (vjpkit's, copied into the peer's layout), with the same data, loss (softmax
cross-entropy, mean) and optimizer (SGD, lr 0.01, momentum 0.9), so the first-step losses agree
to float32 rounding.

The CNN pools as vjpkit's ``nn.max_pool`` does (``models.max_pool_reshape``: a reshape and a
max) in every Flax NNX and Equinox row named in ``PEER_ROWS``, so that their ratios to vjpkit
measure the library, not the pool. The CNN alone also has the rows of ``OWN_POOL_ROWS`` (the
name plus ``OWN_POOL``): the same model with the peer's own pool (``nnx.max_pool``,
``eqx.nn.MaxPool2d``, both ``lax.reduce_window``), what their users get. PyTorch pools with
``nn.MaxPool2d``.

* Flax NNX and Equinox are JAX: they run in run.py's process, as ``JaxVariant``s.
* PyTorch runs in a worker subprocess (``python benchmarks/peers.py --torch-worker``), so that
  its OpenMP threads and XLA's thread pool never compete. ``TorchClient`` speaks JSON lines with
  it: ``setup`` builds both PyTorch variants of a model and returns their first-step time, peak
  memory and first loss; ``time`` runs ``n`` steps of one variant and returns the seconds per
  step. The worker imports numpy and torch only, never JAX.

A peer that cannot be imported raises ``ImportError`` (Flax, Equinox) or reports it in the
worker's first line (PyTorch); run.py turns that into rows marked ``skipped: <reason>``.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import numpy as np

PEERS = ("flax", "equinox", "torch")
LR, MOMENTUM = 0.01, 0.9
FLAX_ROWS = ("Flax NNX", "Flax NNX (split/merge + jax.jit)")
EQUINOX_ROWS = ("Equinox",)
TORCH_ROWS = ("PyTorch eager", "PyTorch eager + full backward hooks (norms)")
PEER_ROWS = {"flax": FLAX_ROWS, "equinox": EQUINOX_ROWS, "torch": TORCH_ROWS}
OWN_POOL = ", lax.reduce_window pool"
OWN_POOL_ROWS = {peer: tuple(name + OWN_POOL for name in PEER_ROWS[peer]) for peer in ("flax", "equinox")}
_PARAM_LAYERS = {"cnn": ("conv1", "conv2", "fc")}  # the MLPs: fc1, fc2, fc3


def param_layers(key: str) -> tuple[str, ...]:
    return _PARAM_LAYERS.get(key, ("fc1", "fc2", "fc3"))


def peer_rows(peer: str, key: str) -> tuple[str, ...]:
    """A peer's row names for model ``key``: ``OWN_POOL_ROWS`` come after, for the CNN only."""
    return PEER_ROWS[peer] + (OWN_POOL_ROWS.get(peer, ()) if key == "cnn" else ())


def _pools(peer: str, key: str, like_vjpkit, own) -> dict[tuple[str, ...], Any]:
    """Row names -> the CNN's pool layer: vjpkit's for ``PEER_ROWS``, the peer's for ``OWN_POOL_ROWS``."""
    pools = {PEER_ROWS[peer]: like_vjpkit}
    if key == "cnn":
        pools[OWN_POOL_ROWS[peer]] = own
    return pools


def chw_layers(key: str, params) -> list[tuple[np.ndarray, np.ndarray]]:
    """vjpkit's params as ``[(weight, bias)]`` in PyTorch's (and Equinox's) layout.

    Dense ``(in, out)`` becomes ``(out, in)``, conv ``HWIO`` becomes ``OIHW``, and the CNN's
    final dense layer is permuted from vjpkit's (H, W, C) flatten order to the (C, H, W) order
    of an NCHW flatten.
    """
    p = {name: {k: np.asarray(v) for k, v in params[name].items()} for name in param_layers(key)}
    if key != "cnn":
        return [(p[n]["weight"].T.copy(), p[n]["bias"]) for n in param_layers(key)]
    w = p["fc"]["weight"]
    c = p["conv2"]["weight"].shape[3]
    hw = round((w.shape[0] // c) ** 0.5)
    w_chw = w.reshape(hw, hw, c, w.shape[1]).transpose(2, 0, 1, 3).reshape(w.shape)
    return [
        (p["conv1"]["weight"].transpose(3, 2, 0, 1).copy(), p["conv1"]["bias"]),
        (p["conv2"]["weight"].transpose(3, 2, 0, 1).copy(), p["conv2"]["bias"]),
        (w_chw.T.copy(), p["fc"]["bias"]),
    ]


# ----------------------------------------------------------------------------------------------
# JAX variants (run.py's own rows use this class too)


@dataclass
class JaxVariant:
    """A jitted training step ``step(carry, x, y) -> (carry, loss, extra)`` and its state.

    ``lower()`` returns the step lowered for the same arguments (for XLA's memory analysis).
    ``trace()``, where set (run.py's ``jax.jit`` rows), returns ``jax.jit(step).trace(...)`` for
    the same arguments: ``staged_first_call`` times the first call's compilation in its stages.
    """

    step: Any
    carry: Any
    x: Any
    y: Any
    lower: Any
    info: dict = field(default_factory=dict)
    trace: Any = None

    def staged_first_call(self) -> dict[str, float]:
        """The first call's compilation split in ``jax.stages``, each part timed (seconds).

        ``trace_s``: Python tracing to a jaxpr (``jit(step).trace(...)``; a library's own work
        while tracing, vjpkit's engine included, is here); ``lower_s``: the jaxpr to StableHLO
        (``traced.lower()``); ``xla_compile_s``: XLA's compilation (``lowered.compile()``);
        ``total_s``: the three together, timed around them. Call it on fresh step functions after
        ``jax.clear_caches()``, as ``first_call`` is, so that nothing is cached.
        """
        start = time.perf_counter()
        traced = self.trace()
        t_traced = time.perf_counter()
        lowered = traced.lower()
        t_lowered = time.perf_counter()
        lowered.compile()
        end = time.perf_counter()
        return {
            "trace_s": t_traced - start,
            "lower_s": t_lowered - t_traced,
            "xla_compile_s": end - t_lowered,
            "total_s": end - start,
        }

    def first_call(self) -> tuple[float, float]:
        import jax

        start = time.perf_counter()
        self.carry, loss, extra = self.step(self.carry, self.x, self.y)
        jax.block_until_ready((loss, extra))
        return time.perf_counter() - start, float(loss)

    def warm_up(self, n: int) -> None:
        self.time(n)

    def time(self, n: int) -> float:
        """Seconds per step over ``n`` steps (the carry goes on training)."""
        import jax

        carry, out = self.carry, None
        start = time.perf_counter()
        for _ in range(n):
            carry, loss, extra = self.step(carry, self.x, self.y)
            out = (loss, extra)
        jax.block_until_ready(out)
        jax.effects_barrier()
        elapsed = time.perf_counter() - start
        self.carry = carry
        return elapsed / n

    def memory(self) -> dict:
        return xla_memory(self.lower().compile())


def xla_memory(compiled) -> dict:
    """XLA's compiled memory analysis: temp + argument + output - alias bytes, in MB."""
    analysis = getattr(compiled, "memory_analysis", None)
    if analysis is None:  # equinox's Compiled wraps jax's
        analysis = compiled.compiled.memory_analysis
    m = analysis()
    peak = m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
    return {
        "peak_mb": peak / 1e6,
        "temp_mb": m.temp_size_in_bytes / 1e6,
        "argument_mb": m.argument_size_in_bytes / 1e6,
        "output_mb": m.output_size_in_bytes / 1e6,
        "alias_mb": m.alias_size_in_bytes / 1e6,
        "method": "xla memory_analysis",
    }


def _xent(logits, y):
    import optax

    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def flax_variants(key: str, params, x, y) -> dict[str, JaxVariant]:
    """Flax NNX rows: for each pool of ``_pools``, ``nnx.jit`` and split/merge (``_flax_pair``)."""
    from flax import nnx
    from models import max_pool_reshape

    own = functools.partial(nnx.max_pool, window_shape=(2, 2), strides=(2, 2))
    out = {}
    for names, pool in _pools("flax", key, max_pool_reshape, own).items():
        out.update(zip(names, _flax_pair(key, params, x, y, pool)))
    return out


def _flax_model(key: str, params, pool):
    """The model as ``nnx.Sequential`` (the CNN pooling with ``pool``) and its ``nnx.Optimizer``."""
    import jax.numpy as jnp
    import optax
    from flax import nnx

    rngs = nnx.Rngs(0)
    if key == "cnn":
        model = nnx.Sequential(
            nnx.Conv(1, 16, kernel_size=(3, 3), padding="SAME", rngs=rngs),
            nnx.relu,
            pool,
            nnx.Conv(16, 32, kernel_size=(3, 3), padding="SAME", rngs=rngs),
            nnx.relu,
            pool,
            lambda h: h.reshape(h.shape[0], -1),
            nnx.Linear(7 * 7 * 32, 10, rngs=rngs),
        )
        layers = [model.layers[i] for i in (0, 3, 7)]
    else:
        sizes = [params[n]["weight"].shape for n in param_layers(key)]
        model = nnx.Sequential(
            nnx.Linear(*sizes[0], rngs=rngs),
            nnx.relu,
            nnx.Linear(*sizes[1], rngs=rngs),
            nnx.relu,
            nnx.Linear(*sizes[2], rngs=rngs),
        )
        layers = [model.layers[i] for i in (0, 2, 4)]
    for layer, name in zip(layers, param_layers(key)):  # vjpkit's layout is flax's
        layer.kernel[...] = jnp.asarray(params[name]["weight"])
        layer.bias[...] = jnp.asarray(params[name]["bias"])
    return model, nnx.Optimizer(model, optax.sgd(LR, momentum=MOMENTUM), wrt=nnx.Param)


def _flax_pair(key: str, params, x, y, pool) -> tuple[JaxVariant, JaxVariant]:
    """Flax NNX, idiomatic (``nnx.jit``) and the documented functional loop (split/merge)."""
    import jax
    from flax import nnx

    def loss_fn(model, x, y):
        return _xent(model(x), y)

    @nnx.jit
    def train_step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
        optimizer.update(model, grads)
        return loss

    model, optimizer = _flax_model(key, params, pool)

    def nnx_step(carry, x, y):
        return carry, train_step(*carry, x, y), None

    @jax.jit
    def jax_train_step(graphdef, state, x, y):
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
        optimizer.update(model, grads)
        return loss, nnx.state((model, optimizer))

    graphdef, state = nnx.split(_flax_model(key, params, pool))

    def split_step(carry, x, y):
        loss, carry = jax_train_step(graphdef, carry, x, y)
        return carry, loss, None

    nnx_variant = JaxVariant(nnx_step, (model, optimizer), x, y, None)
    nnx_variant.lower = lambda: train_step.lower(*nnx_variant.carry, x, y)
    split_variant = JaxVariant(split_step, state, x, y, None)
    split_variant.lower = lambda: jax_train_step.lower(graphdef, split_variant.carry, x, y)
    return nnx_variant, split_variant


def equinox_variants(key: str, params, x, y) -> dict[str, JaxVariant]:
    """Equinox rows, one for each pool of ``_pools`` (``_equinox_variant``)."""
    import equinox as eqx
    from models import max_pool_reshape

    pools = _pools("equinox", key, eqx.nn.Lambda(max_pool_reshape), eqx.nn.MaxPool2d(2, stride=2))
    return {name: _equinox_variant(key, params, x, y, pool) for (name,), pool in pools.items()}


def _equinox_model(key: str, params, pool):
    """The model as ``eqx.nn.Sequential`` (the CNN pooling with ``pool``), vjpkit's weights in."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(0), 3)
    if key == "cnn":
        model = eqx.nn.Sequential(
            [
                eqx.nn.Conv2d(1, 16, 3, padding="SAME", key=keys[0]),
                eqx.nn.Lambda(jax.nn.relu),
                pool,
                eqx.nn.Conv2d(16, 32, 3, padding="SAME", key=keys[1]),
                eqx.nn.Lambda(jax.nn.relu),
                pool,
                eqx.nn.Lambda(jnp.ravel),
                eqx.nn.Linear(7 * 7 * 32, 10, key=keys[2]),
            ]
        )
        index = (0, 3, 7)
    else:
        sizes = [params[n]["weight"].shape for n in param_layers(key)]
        model = eqx.nn.Sequential(
            [
                eqx.nn.Linear(*sizes[0], key=keys[0]),
                eqx.nn.Lambda(jax.nn.relu),
                eqx.nn.Linear(*sizes[1], key=keys[1]),
                eqx.nn.Lambda(jax.nn.relu),
                eqx.nn.Linear(*sizes[2], key=keys[2]),
            ]
        )
        index = (0, 2, 4)
    for i, (w, b) in zip(index, chw_layers(key, params)):
        old = model.layers[i]
        model = eqx.tree_at(
            lambda m, i=i: (m.layers[i].weight, m.layers[i].bias),
            model,
            (jnp.asarray(w), jnp.asarray(b).reshape(old.bias.shape)),
        )
    return model


def _equinox_variant(key: str, params, x, y, pool) -> JaxVariant:
    """Equinox: per-example modules vmapped over the batch, ``eqx.filter_jit``; NCHW for the CNN."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    model = _equinox_model(key, params, pool)
    if key == "cnn":
        x = jnp.transpose(x, (0, 3, 1, 2))  # the data as an NCHW user would have it
    opt = optax.sgd(LR, momentum=MOMENTUM)
    opt_state = opt.init(eqx.filter(model, eqx.is_inexact_array))

    def loss_fn(model, x, y):
        return _xent(jax.vmap(model)(x), y)

    @eqx.filter_jit
    def step(carry, x, y):
        model, opt_state = carry
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        updates, opt_state = opt.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        return (eqx.apply_updates(model, updates), opt_state), loss, None

    variant = JaxVariant(step, (model, opt_state), x, y, None)
    variant.lower = lambda: step.lower(variant.carry, x, y)
    return variant


# ----------------------------------------------------------------------------------------------
# PyTorch: the client (in run.py's process) and the worker (its own process)


class TorchClient:
    """Starts the PyTorch worker; ``hello()`` is its first reply (version, or why it failed)."""

    def __init__(self, threads: int):
        self._log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115  (the worker's stderr, closed in close())
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--torch-worker", "--threads", str(threads)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            bufsize=1,
        )
        self._hello = None

    def hello(self) -> dict:
        if self._hello is None:
            self._hello = self._read()
        return self._hello

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self._log.seek(0)
            tail = self._log.read()[-2000:]
            raise RuntimeError(f"the PyTorch worker exited (code {self.proc.poll()}):\n{tail}")
        return json.loads(line)

    def request(self, **msg) -> dict:
        self.hello()
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        reply = self._read()
        if not reply.get("ok"):
            raise RuntimeError(f"PyTorch worker: {reply.get('error')}")
        return reply

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._log.close()


@dataclass
class TorchVariant:
    """A PyTorch row, as run.py sees it: its timing runs in the worker."""

    client: TorchClient
    name: str
    info: dict

    def time(self, n: int) -> float:
        return self.client.request(cmd="time", variant=self.name, n=n)["per_step_s"]


def torch_variants(client: TorchClient, key: str, params, x, y, tmpdir: str) -> dict[str, TorchVariant]:
    """Sends the model's weights and data to the worker and sets both PyTorch rows up there."""
    arrays = {"y": np.asarray(y).astype(np.int64)}
    x = np.asarray(x)
    arrays["x"] = np.ascontiguousarray(x.transpose(0, 3, 1, 2)) if x.ndim == 4 else x
    for i, (w, b) in enumerate(chw_layers(key, params)):
        arrays[f"w{i}"], arrays[f"b{i}"] = w, b
    path = os.path.join(tmpdir, f"torch_{key}.npz")
    np.savez(path, **arrays)
    reply = client.request(cmd="setup", model=key, npz=path)
    return {name: TorchVariant(client, name, info) for name, info in reply["variants"].items()}


def _torch_model(torch, key, layers):
    nn = torch.nn
    if key == "cnn":
        model = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(7 * 7 * 32, 10),
        )
    else:
        (w1, _), (w2, _), (w3, _) = layers
        model = nn.Sequential(
            nn.Linear(w1.shape[1], w1.shape[0]),
            nn.ReLU(),
            nn.Linear(w2.shape[1], w2.shape[0]),
            nn.ReLU(),
            nn.Linear(w3.shape[1], w3.shape[0]),
        )
    with torch.no_grad():
        modules = [m for m in model if isinstance(m, nn.Linear | nn.Conv2d)]
        for m, (w, b) in zip(modules, layers):
            m.weight.copy_(torch.from_numpy(w))
            m.bias.copy_(torch.from_numpy(b))
    return model


class _TorchRun:
    """One PyTorch row in the worker: model, optimizer, step, and (hooked) the norms list."""

    def __init__(self, torch, key, layers, x, y, hooked: bool):
        self.torch, self.x, self.y = torch, x, y
        self.model = _torch_model(torch, key, layers)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=LR, momentum=MOMENTUM)
        self.hooked = hooked
        self.norms: list = []
        if hooked:
            norm = torch.linalg.vector_norm

            def hook(module, grad_input, grad_output):
                self.norms.extend(norm(g) for g in grad_input if g is not None)
                self.norms.extend(norm(g) for g in grad_output if g is not None)

            for m in self.model:  # every submodule: layers with and without params
                m.register_full_backward_hook(hook)

    def step(self):
        if self.hooked:
            self.norms.clear()
        self.opt.zero_grad()
        loss = self.torch.nn.functional.cross_entropy(self.model(self.x), self.y)
        loss.backward()
        if self.hooked:
            norm = self.torch.linalg.vector_norm
            self.norms.extend(norm(p.grad) for p in self.model.parameters() if p.grad is not None)
        self.opt.step()
        return loss

    def time(self, n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            loss = self.step()
        loss.item()  # eager CPU: already computed; a no-op barrier
        return (time.perf_counter() - start) / n

    def memory(self) -> dict:
        """Peak tensor bytes during one step: persistent + the step's allocation high-water mark.

        Persistent: params, momentum buffers and the batch (alive across steps). The step's
        high-water mark: the running sum of the CPU allocator's allocations during one step, less
        the frees of those same buffers, recorded by ``torch.profiler.profile(profile_memory=True)``.
        The previous step's grads are freed by ``zero_grad`` before anything is allocated (so
        they are in neither part), and the new grads are allocated, and counted, during the step.
        """
        torch = self.torch
        persistent = sum(p.numel() * p.element_size() for p in self.model.parameters())
        persistent += sum(
            t.numel() * t.element_size()
            for state in self.opt.state.values()
            for t in state.values()
            if torch.is_tensor(t)
        )
        persistent += sum(t.numel() * t.element_size() for t in (self.x, self.y))
        from torch._C._profiler import _EventType
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            self.step()
        events = []

        def walk(nodes):
            for e in nodes:
                if e.tag == _EventType.Allocation:
                    events.append((e.start_time_ns, e.extra_fields.alloc_size, e.extra_fields.ptr))
                walk(e.children)

        walk(prof.profiler.kineto_results.experimental_event_tree())
        born: dict[int, int] = {}  # buffers allocated during this step: ptr -> bytes
        live = high = 0
        for _, size, ptr in sorted(events, key=lambda e: e[0]):
            if size > 0:
                born[ptr] = size
                live += size
                high = max(high, live)
            elif ptr in born:  # frees of older buffers (the last step's grads) are not counted
                live -= born.pop(ptr)
        return {
            "peak_mb": (persistent + high) / 1e6,
            "persistent_mb": persistent / 1e6,
            "step_high_water_mb": high / 1e6,
            "method": "torch.profiler allocation events",
        }


def _torch_setup(torch, msg) -> dict[str, _TorchRun]:
    arrays = np.load(msg["npz"])
    x = torch.from_numpy(arrays["x"])
    y = torch.from_numpy(arrays["y"])
    layers = [(arrays[f"w{i}"], arrays[f"b{i}"]) for i in range(3)]
    return {
        name: _TorchRun(torch, msg["model"], layers, x, y, hooked) for name, hooked in zip(TORCH_ROWS, (0, 1))
    }


def torch_worker(threads: int) -> None:
    """The worker's loop: JSON requests on stdin, one JSON reply line each on stdout."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything else written to stdout (profiler chatter) goes to stderr

    def send(obj):
        out.write(json.dumps(obj) + "\n")

    try:
        import torch
    except ImportError as err:
        send({"ok": False, "error": f"{type(err).__name__}: {err}"})
        return
    torch.set_num_threads(threads)
    send({"ok": True, "torch": torch.__version__, "threads": torch.get_num_threads()})
    runs: dict[str, _TorchRun] = {}
    for line in sys.stdin:
        msg = json.loads(line)
        try:
            if msg["cmd"] == "quit":
                break
            if msg["cmd"] == "setup":
                runs = _torch_setup(torch, msg)
                info = {}
                for name, run in runs.items():
                    start = time.perf_counter()
                    loss = float(run.step())
                    first = time.perf_counter() - start
                    run.time(3)  # warm-up
                    info[name] = {"first_call_s": first, "first_loss": loss, "memory": run.memory()}
                    run.time(2)
                send({"ok": True, "variants": info})
            elif msg["cmd"] == "time":
                send({"ok": True, "per_step_s": runs[msg["variant"]].time(int(msg["n"]))})
            else:
                send({"ok": False, "error": f"unknown command {msg['cmd']!r}"})
        except Exception:
            send({"ok": False, "error": traceback.format_exc(limit=5)})


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "--torch-worker":
        torch_worker(int(sys.argv[3]) if len(sys.argv) >= 4 else os.cpu_count() or 1)
    else:
        sys.exit("peers.py is used by benchmarks/run.py; run that instead")


def cpu_times():
    """(all cores' time, their busy time, this process's and its waited children's CPU time), or None."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:9]]
    except OSError:
        return None
    hz, own = os.sysconf("SC_CLK_TCK"), os.times()
    mine = own.user + own.system + own.children_user + own.children_system
    return sum(ticks) / hz, (sum(ticks) - ticks[3] - ticks[4]) / hz, mine


def other_cpu_share(before, after):
    """The share of all cores' time that other processes used between two ``cpu_times()``."""
    if before is None or after is None or after[0] <= before[0]:
        return None
    total, busy, mine = (a - b for a, b in zip(after, before))
    return max(0.0, busy - mine) / total
