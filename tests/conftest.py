import jax
import pytest

jax.config.update("jax_numpy_dtype_promotion", "strict")


@pytest.fixture(params=[False, True], ids=["eager", "jit"])
def maybe_jit(request):
    """Returns jax.jit or the identity: every test using it runs both ways."""
    return jax.jit if request.param else (lambda f: f)
