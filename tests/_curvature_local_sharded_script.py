"""Local layers' per-example statistics on a sharded batch, run in a subprocess by
tests/test_curvature_structures_v4.py.

Usage: ``python tests/_curvature_local_sharded_script.py`` with
``XLA_FLAGS=--xla_force_host_platform_device_count=4`` and ``JAX_PLATFORMS=cpu``. Prints one line
``RESULT <json>``; a check that fails raises (non-zero exit, traceback on stderr).

For the test file's model (an embedding lookup, a positional table, a layer norm, a scalar gain,
a dense head and a temperature no layer reads) called on the batch, ``jax.vmap``-ed inside the
loss, and with per-iteration layer norms and gains under ``lax.scan``:
``vk.curvature.stats("*", [...])`` under ``jax.jit`` on a batch sharded over every device equals
the same call on the batch held by one device (loss, gradient and every statistic), and the
local layers' and the leaf's statistics equal the oracle (``vmap(grad)``, the brute-force GGN
diagonal).
"""

from __future__ import annotations

import json
import warnings

import jax
from jax.sharding import NamedSharding, PartitionSpec

import vjpkit as vk

jax.config.update("jax_enable_x64", True)
jax.config.update("jax_numpy_dtype_promotion", "strict")

from tests import test_curvature_structures_v4 as t  # noqa: E402

BATCH = 8  # two sequences per device


def run(structure: str) -> dict:
    forward = {"plain": t.model, "scan": t.scanned, **t.STRUCTURES}[structure]
    params, x, y = t.problem(n=BATCH, blocks=structure == "scan")
    f = jax.jit(vk.value_and_grad(t.ce(forward), capture=vk.curvature.stats("*", t.WHICH)))
    one = jax.devices()[0]
    batch = NamedSharding(vk.train.data_mesh(), PartitionSpec("data"))
    xs, ys = jax.device_put(x, batch), jax.device_put(y, batch)
    assert len(xs.sharding.device_set) == jax.device_count() == 4, xs.sharding
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the temperature's leaf entry
        want = f(*jax.device_put((params, x, y), one))
        got = f(params, xs, ys)
    t.tree_allclose(got, want, rtol=1e-12, atol=1e-15)
    per, ggn = t.oracle(forward, params, x, y)
    checked = t.check(got[1], per, ggn)
    return {"sharded": True, "checked": sorted(checked), "layers": sorted(got[1])}


if __name__ == "__main__":
    out = {"devices": jax.device_count(), **{s: run(s) for s in ("plain", "vmap_in_loss", "scan")}}
    print("RESULT " + json.dumps(out))
