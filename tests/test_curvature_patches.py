"""The conv patch unfolding of ``vk.curvature`` (strided slices of the padded input) against
``lax.conv_general_dilated_patches``, the one-hot-kernel reference, for 1-D, 2-D and 3-D
convolutions with strides, dilation and every padding form."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from vjpkit.curvature._stats import _patches
from vjpkit.curvature._types import Layout

SPATIAL = {1: "H", 2: "HW", 3: "DHW"}


def reference(x, window, strides, padding, dilation):
    """Patches with features ordered ``(*window, c_in)``, from the one-hot-kernel conv."""
    s = SPATIAL[len(window)]
    p = lax.conv_general_dilated_patches(
        x, window, strides, padding, rhs_dilation=dilation, dimension_numbers=(f"N{s}C", f"{s}IO", f"N{s}C")
    )  # features (c_in, *window)
    lead, cin = p.shape[:-1], x.shape[-1]
    p = jnp.moveaxis(p.reshape(*lead, cin, *window), len(lead), -1)
    return p.reshape(*lead, -1)


CASES = [
    ((2, 9, 3), (3,), (1,), "SAME", (1,)),
    ((2, 10, 2), (4,), (3,), "VALID", (2,)),
    ((2, 7, 8, 3), (3, 3), (1, 1), "SAME", (1, 1)),
    ((2, 7, 8, 3), (3, 2), (2, 3), "SAME", (1, 1)),
    ((2, 9, 9, 2), (3, 3), (2, 1), "VALID", (2, 1)),
    ((2, 6, 7, 2), (2, 3), (1, 2), ((1, 2), (0, 3)), (1, 2)),
    ((2, 5, 5, 5, 2), (2, 3, 2), (1, 2, 1), "SAME", (1, 1, 2)),
]


@pytest.mark.parametrize("shape, window, strides, padding, dilation", CASES)
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_patches_equal_the_one_hot_kernel_reference(shape, window, strides, padding, dilation, jit):
    x = jax.random.normal(jax.random.key(len(shape) + sum(window)), shape)
    layout = Layout(
        "conv", "w", None, in_ndim=len(window) + 1, strides=strides, padding=padding, dilation=dilation
    )
    kernel = (*window, shape[-1], 4)
    fn = (
        jax.jit(lambda x: _patches(x, layout, kernel[:-1]))
        if jit
        else (lambda x: _patches(x, layout, kernel[:-1]))
    )
    got = fn(x)
    want = reference(x, window, strides, padding, dilation)
    assert got.shape == want.shape
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
