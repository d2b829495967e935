import shutil
import tempfile

import jax
import pytest

jax.config.update("jax_numpy_dtype_promotion", "strict")

# Eager (non-jit) calls of a hooked transform trace fresh custom_vjp rules on every call, so the
# small programs JAX dispatches for them miss its in-memory caches and are recompiled each time:
# that compilation dominates the eager variants' runtime. A compilation cache private to this
# test session (keyed by the program's HLO, so a hit returns what compiling would have) lets
# identical programs compile once. Nothing carries over between sessions.
_XLA_CACHE = tempfile.mkdtemp(prefix="vjpkit-tests-xla-cache-")
jax.config.update("jax_compilation_cache_dir", _XLA_CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(_XLA_CACHE, ignore_errors=True)


@pytest.fixture(params=[False, True], ids=["eager", "jit"])
def maybe_jit(request):
    """Returns jax.jit or the identity: every test using it runs both ways."""
    return jax.jit if request.param else (lambda f: f)
