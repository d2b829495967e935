"""The forum's networks, explained: what every cotangent of every layer call is, with its shape.

Threads 000 and 001 ask what ``grad_input`` and ``grad_output`` of a PyTorch backward hook
are, and one poster (Patrick) lists the shapes he saw for two layers of his 2-conv + 3-fc net
at batch 64. ``vk.explain`` answers with one table per network. It traces shapes only: no
forward or backward pass runs on data, and the arguments here are ``jax.ShapeDtypeStruct``s.

1. the conv layer: 16x16 maps with 16 channels, batch 64, 32 kernels of 3x3
   (NHWC input ``(64, 16, 16, 16)``, weight ``(3, 3, 16, 32)``), as a first layer, and again
   with the input differentiated (as when a layer sits below it);
2. the fully connected layer 84 -> 10 at batch 64;
3. a 2-conv + 3-fc net on 32x32x3 images (CIFAR-sized): conv 16 3x3 -> relu -> max_pool ->
   conv 32 3x3 -> relu -> max_pool -> flatten -> fc 120 -> fc 84 -> fc 10, under a mean
   cross-entropy loss. The sizes are chosen so that its ``conv2`` is exactly layer 1 and its
   ``fc3`` exactly layer 2, inside a real network.

It then explains why PyTorch's legacy ``register_backward_hook`` showed ``(bias, input,
weight)`` for Linear and ``None`` for the first conv, from the vjpkit shapes (PyTorch's
behaviour as verified on torch 2.13.0 in docs/cotangents.md; this script does not import torch).

Run: ``python examples/explain_shapes.py`` (a few seconds; ``--steps`` is accepted for
uniformity with the other examples and unused). Needs only vjpkit: ``pip install -e .``.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import optax

from vjpkit import nn
from vjpkit.inspect._explain import explain

BATCH = 64
S = jax.ShapeDtypeStruct


def _params(model: nn.Layer, *inputs: S):
    """The params' shapes, without computing them."""
    return jax.eval_shape(
        lambda: model.init(jax.random.key(0), *(jnp.zeros(i.shape, i.dtype) for i in inputs))
    )


def conv_layer():
    """Layer 1: ``nn.conv2d(32, 3)`` on ``(64, 16, 16, 16)``."""
    conv = nn.conv2d(32, 3, name="conv")
    x = S((BATCH, 16, 16, 16), jnp.float32)
    params = _params(conv, x)
    print("\n== 1. conv 16 -> 32 channels, 3x3, on 64 maps of 16x16 (a first layer: x is data) ==")
    first = explain(conv.apply, params, x)
    print("\n== 1b. the same conv with x differentiated too (as when another layer is below it) ==")
    inner = explain(conv.apply, params, x, argnums=(0, 1))
    return {"model": conv, "params": params, "x": x, "first": first, "inner": inner}


def fc_layer():
    """Layer 2: ``nn.dense(10)`` on ``(64, 84)``."""
    fc = nn.dense(10, name="fc")
    x = S((BATCH, 84), jnp.float32)
    params = _params(fc, x)
    print("\n== 2. fully connected 84 -> 10 at batch 64 ==")
    return {"model": fc, "params": params, "x": x, "rows": explain(fc.apply, params, x)}


NET = nn.serial(
    conv1=nn.conv2d(16, 3),
    relu1=nn.relu(),
    pool1=nn.max_pool(2),
    conv2=nn.conv2d(32, 3),
    relu2=nn.relu(),
    pool2=nn.max_pool(2),
    flat=nn.flatten(),
    fc1=nn.dense(120),
    relu3=nn.relu(),
    fc2=nn.dense(84),
    relu4=nn.relu(),
    fc3=nn.dense(10),
)


def net_loss(params, x, labels):
    """Mean cross-entropy of the 2-conv + 3-fc net (PyTorch's ``nn.CrossEntropyLoss()``)."""
    return optax.softmax_cross_entropy_with_integer_labels(NET.apply(params, x), labels).mean()


def lenet():
    """Network 3: the 2-conv + 3-fc net on ``(64, 32, 32, 3)`` images, under a scalar loss."""
    x = S((BATCH, 32, 32, 3), jnp.float32)
    labels = S((BATCH,), jnp.int32)
    params = _params(NET, x)
    print("\n== 3. 2-conv + 3-fc net on 64 images of 32x32x3, mean cross-entropy loss ==")
    return {"params": params, "x": x, "labels": labels, "rows": explain(net_loss, params, x, labels)}


def _nchw(shape):
    n, h, w, c = shape
    return (n, c, h, w)


def legacy_hook(net_rows):
    """PyTorch's legacy ``grad_input`` for Linear and Conv2d, rebuilt from vjpkit's records."""
    rows = {r["key"]: r for r in net_rows}
    fc3, conv1, conv2 = rows["fc3"], rows["conv1"], rows["conv2"]
    kh, kw, cin, cout = conv2["grad_params"]["weight"].shape
    return {
        # last autograd op of nn.Linear: addmm(bias, input, weight.t()) -> its three input gradients
        "linear": [
            ("dL/dbias", fc3["grad_params"]["bias"].shape),
            ("dL/dinput", fc3["grad_input"].shape),
            ("dL/d(weight.t())", fc3["grad_params"]["weight"].shape),  # vjpkit's (in, out) = weight.T
        ],
        # last autograd op of nn.Conv2d: convolution(input, weight, bias)
        "conv": [
            ("dL/dinput", _nchw(conv2["grad_input"].shape)),
            ("dL/dweight", (cout, cin, kh, kw)),
            ("dL/dbias", conv2["grad_params"]["bias"].shape),
        ],
        "first_conv_input": conv1["grad_input"],  # None: not computed
        "grad_output": {"linear": fc3["grad_output"].shape, "conv": _nchw(conv2["grad_output"].shape)},
        "vjpkit": {
            key: {
                "grad_input": rows[key]["grad_input"].shape,
                "weight": rows[key]["grad_params"]["weight"].shape,
                "bias": rows[key]["grad_params"]["bias"].shape,
            }
            for key in ("fc3", "conv2")
        },
    }


def explain_pytorch(legacy) -> None:
    lin, conv, vk_fc, vk_conv = (
        legacy["linear"],
        legacy["conv"],
        legacy["vjpkit"]["fc3"],
        legacy["vjpkit"]["conv2"],
    )
    torch_weight = tuple(reversed(vk_fc["weight"]))
    fmt = lambda entries: ", ".join(f"{name} {shape}" for name, shape in entries)
    print(
        "\n== Why PyTorch's legacy register_backward_hook showed (bias, input, weight) and None ==",
        "The legacy hook's grad_input is not dL/d(module input): it is the gradients of the inputs",
        "of the LAST autograd op inside the module (docs/cotangents.md; verified on torch 2.13.0).",
        "",
        "nn.Linear(84, 10) computes y = addmm(bias, x, weight.t()), so its grad_input is addmm's",
        f"three input gradients, in addmm's argument order: ({fmt(lin)}).",
        f"That is Patrick's 'bias, data, weights' order; the last entry has weight.T's shape {lin[2][1]}.",
        f"vjpkit's fc3: grad_params['bias'] {vk_fc['bias']}, grad_input {vk_fc['grad_input']}, "
        f"grad_params['weight'] {vk_fc['weight']};",
        f"vjpkit's dense weight is (in, out), the transpose of torch's (out, in) = {torch_weight}.",
        "",
        "nn.Conv2d(16, 32, 3) ends in convolution(x, weight, bias), so grad_input is",
        f"({fmt(conv)}) in NCHW, as in thread 001.",
        f"vjpkit's conv2 (NHWC): grad_input {vk_conv['grad_input']}, grad_params['weight'] "
        f"{vk_conv['weight']}, ['bias'] {vk_conv['bias']}.",
        "",
        "For the FIRST conv, x is the data batch, which needs no gradient: PyTorch puts None in slot 0,",
        f"and vjpkit's conv1 record has grad_input = {legacy['first_conv_input']} (it is never computed).",
        f"grad_output is dL/dy in both: Linear {legacy['grad_output']['linear']}, "
        f"Conv2d {legacy['grad_output']['conv']} (NCHW); PyTorch wraps it in a 1-tuple.",
        "The legacy tuple follows the module's last op, so it changes with the layer type, bias=False",
        "and the input's rank; a vjpkit record names each field instead.",
        sep="\n",
    )


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1, help="unused; accepted for uniformity")
    parser.parse_args(argv)
    results = {"conv": conv_layer(), "fc": fc_layer(), "net": lenet()}
    results["legacy"] = legacy_hook(results["net"]["rows"])
    explain_pytorch(results["legacy"])
    return results


if __name__ == "__main__":
    main()
