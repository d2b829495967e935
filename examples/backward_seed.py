"""What is the ``gradient`` of ``out.backward(gradient)``? The seed scenarios, done explicitly.

Two forum threads ask what the ``gradient`` argument of ``out.backward(gradient)`` and the
``grad_outputs`` of ``torch.autograd.grad`` are. They are the cotangent seed: dL/d(out), the
``grad_output`` that starts reverse mode. In vjpkit it is the argument of the pullback:
``out, pullback = vk.vjp(f, *args); grads = pullback(seed)``. Each scenario below prints its
result with a one-line explanation:

1. ``x @ a`` with seed ``[[1,2,3,4],[5,6,7,8]]``: ``grad_x = [[10,10,10],[26,26,26]]``.
2. seeds ``(1, 2)`` on two scalar losses ``(l1, l2)`` equal ``grad(l1 + 2 * l2)``.
3. ``v @ J`` without forming ``J``, checked against the explicit ``jax.jacrev`` Jacobian.
4. the default seed of ones: the gradient for a single-element output, ``grad(out.sum())`` otherwise.
5. the seed is the last layer's ``grad_output``, seen by a hook.

Run: ``python examples/backward_seed.py`` (a few seconds; ``--steps`` is accepted for
uniformity with the other examples and unused). Needs only vjpkit: ``pip install -e .``.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import vjpkit as vk
from vjpkit import nn


def matmul_seed():
    """Seed thread 003: ``out = x @ a`` with ``x = ones(2, 3)``, ``a = ones(3, 4)``."""
    x, a = jnp.ones((2, 3)), jnp.ones((3, 4))
    seed = jnp.array([[1.0, 2, 3, 4], [5, 6, 7, 8]])
    out, pullback = vk.vjp(lambda x, a: x @ a, x, a)
    grad_x, grad_a = pullback(seed)
    try:
        pullback(jnp.ones((4, 4)))  # the thread's commented-out `gradient = torch.ones(4, 4)`
    except vk.SeedError as err:
        wrong_shape_error = str(err)
    return {"out": out, "seed": seed, "grad_x": grad_x, "grad_a": grad_a, "error": wrong_shape_error}


def two_losses():
    """Seed thread 004: seeds ``(1, 2)`` on ``(l1, l2)`` give ``grad(l1 + 2 * l2)``."""
    inp = jnp.array([0.5, -1.0, 2.0])

    def losses(inp):
        return jnp.sum(jnp.sin(inp)), jnp.sum(inp**2)

    (l1, l2), pullback = vk.vjp(losses, inp)
    (seeded,) = pullback((jnp.float32(1.0), jnp.float32(2.0)))
    summed = jax.grad(lambda inp: losses(inp)[0] + 2 * losses(inp)[1])(inp)
    return {"l1": l1, "l2": l2, "seeded": seeded, "summed": summed}


_model = nn.serial(fc1=nn.dense(8), act=nn.tanh(), fc2=nn.dense(5))


def _model_setup():
    x = jax.random.normal(jax.random.key(0), (3,))
    params = _model.init(jax.random.key(1), x)
    v = jnp.array([1.0, -2.0, 0.5, 0.0, 3.0])
    return params, x, v


def vector_jacobian():
    """``v @ J`` for ``f: R^3 -> R^5`` (a small MLP) from one pullback, without forming ``J``."""
    params, x, v = _model_setup()
    f = lambda x: _model.apply(params, x)
    _, pullback = vk.vjp(f, x)
    (v_j,) = pullback(v)
    jacobian = jax.jacrev(f)(x)  # (5, 3): built only to check, one pullback per output element
    return {"v": v, "vJ": v_j, "jacobian": jacobian, "v_at_J": v @ jacobian}


def default_seed():
    """``out.backward()`` means seed 1: the gradient for one element, ``grad(out.sum())`` for more."""
    w = jnp.array([1.0, 2.0, 3.0])
    x = jnp.array([0.1, 0.2, 0.3])
    single = lambda w: jnp.tanh(w @ x)[None]  # shape (1,): one element, like torch's (1,) tensors
    out, pullback = vk.vjp(single, w)
    (grad_single,) = pullback(jnp.ones_like(out))
    try:
        vk.grad(single)(w)
    except vk.SeedError as err:
        grad_error = str(err)
    many = lambda w: jnp.tanh(w * x)  # three elements
    out_many, pullback_many = vk.vjp(many, w)
    (ones_many,) = pullback_many(jnp.ones_like(out_many))
    return {
        "grad_single": grad_single,
        "grad_scalar": jax.grad(lambda w: single(w)[0])(w),
        "grad_error": grad_error,
        "ones_many": ones_many,
        "grad_sum_many": jax.grad(lambda w: jnp.sum(many(w)))(w),
    }


def seed_is_grad_output():
    """A hook on the last layer sees the seed as its ``grad_output``."""
    params, x, v = _model_setup()
    seen = []
    _, pullback = vk.vjp(
        lambda x: _model.apply(params, x), x, hooks={"fc2": vk.on_host(lambda rec: seen.append(rec))}
    )
    jax.block_until_ready(pullback(v))  # the host function has run once the outputs are ready
    return {"v": v, "grad_output": seen[0].grad_output, "records": len(seen)}


def _fmt(x) -> str:
    return np.array2string(np.asarray(x), precision=4, separator=", ", suppress_small=True).replace("\n", "")


def say(title: str, *lines: str) -> None:
    print(title)
    for line in lines:
        print(f"   {line}")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1, help="unused; accepted for uniformity")
    parser.parse_args(argv)

    results = {}
    r = results["matmul_seed"] = matmul_seed()
    say(
        "1. out = x @ a with x = ones(2, 3), a = ones(3, 4); seed = [[1,2,3,4],[5,6,7,8]]",
        f"grad_x = pullback(seed)[0] = {_fmt(r['grad_x'])}",
        "Why: grad_x[i, j] = sum_k seed[i, k] * dout[i, k]/dx[i, j]: row i of the seed dotted with dout/dx.",
        "Here dout[i, k]/dx[i, j] = a[j, k] = 1, so the rows give 1+2+3+4 = 10 and 5+6+7+8 = 26.",
        "It is the gradient of L = sum(seed * out): the seed weights out's elements, not out itself.",
        f"The seed is the 'gradient' of out.backward(gradient): dL/d(out), shape {tuple(r['seed'].shape)}.",
        f"A (4, 4) seed is refused: {r['error'].split('. A seed')[0]}.",
    )

    r = results["two_losses"] = two_losses()
    say(
        "2. l1 = sum(sin(inp)), l2 = sum(inp ** 2); vjp of (l1, l2) with seeds (1, 2)",
        f"pullback((1., 2.))[0] = {_fmt(r['seeded'])}",
        f"grad(l1 + 2 * l2)     = {_fmt(r['summed'])}",
        "Equal: the seeds weight the outputs, so one backward pass gives the gradient of 1*l1 + 2*l2.",
    )

    r = results["vector_jacobian"] = vector_jacobian()
    diff = float(jnp.max(jnp.abs(r["vJ"] - r["v_at_J"])))
    say(
        f"3. f: R^3 -> R^5 (an MLP); v = {_fmt(r['v'])}",
        f"pullback(v)[0]       = {_fmt(r['vJ'])}   (one backward pass, J never formed)",
        f"v @ jax.jacrev(f)(x) = {_fmt(r['v_at_J'])}   (J is {r['jacobian'].shape})",
        f"max |difference| = {diff:.1e}: a pullback is a vector-Jacobian product; the seed is the vector.",
    )

    r = results["default_seed"] = default_seed()
    say(
        "4. out = tanh(w @ x)[None] has one element; seed = ones_like(out)",
        f"pullback(ones)[0] = {_fmt(r['grad_single'])} = grad of that element {_fmt(r['grad_scalar'])}",
        f"vk.grad refuses the (1,)-shaped output: {r['grad_error'].split(' Reverse mode')[0]}",
        f"For 3 elements, ones gives grad(out.sum()) = {_fmt(r['ones_many'])}: a choice of seed,",
        "not 'the' gradient, which is why a non-scalar output needs an explicit seed.",
    )

    r = results["seed_is_grad_output"] = seed_is_grad_output()
    same = bool(jnp.array_equal(r["grad_output"], r["v"]))
    say(
        f"5. A hook on the last layer fc2 sees grad_output = {_fmt(r['grad_output'])}",
        f"equal to the seed: {same}. The seed is the grad_output that starts reverse mode.",
    )
    return results


if __name__ == "__main__":
    main()
