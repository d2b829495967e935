"""Plot a small CNN's cotangents on scikit-learn's digits: gradient flow, histograms, backward shapes.

Trains the CNN for ``--steps`` SGD steps with ``vk.train.fit``, capturing every layer's
``grad_output`` and ``grad_params`` norms inside the compiled step
(``vk.capture("*", fields=[...], reduce="norm")``); ``on_records`` collects them on the host,
one ``(step, captured)`` pair per step. Then one more gradient computation, on the last batch of
images with the trained params, captures whole records (``reduce=None``). The script writes
three PNGs into ``--out``:

* ``gradient_flow.png``: each layer's parameter-gradient norm over the steps, log scale
  (``plot_gradient_flow``);
* ``histograms.png``: histograms of that last step's ``grad_output`` and ``grad_params``, for
  the layers with parameters (``plot_histograms``);
* ``backward_shapes.png``: the shapes of that step's ``grad_output -> grad_input`` and
  ``grad_params``, layer by layer in backward order (``plot_backward_shapes``).

Run: ``python examples/plot_gradients.py`` (a few seconds; the files go to a fresh temporary
directory, which is printed, or to ``--out DIR``). The run is deterministic: on one machine and
JAX version it computes the same numbers every time. The docs' pictures (``docs/img``) are this
script's, at its defaults: ``python scripts/make_doc_images.py`` remakes them, and
``tests/test_doc_images.py`` checks what ``docs/inspect.md`` says about them against this
script's numbers. Needs the ``examples`` extra (scikit-learn and matplotlib):
``pip install -e ".[examples]"``.
"""

from __future__ import annotations

import argparse
import pathlib
import tempfile
import time

import jax
import optax
from _digits import cnn, load_images

import vjpkit as vk
from vjpkit import nn
from vjpkit.inspect import plot_backward_shapes, plot_gradient_flow, plot_histograms

model = cnn(fc1=nn.dense(32), relu3=nn.relu(), fc2=nn.dense(10))
FILES = ("gradient_flow.png", "histograms.png", "backward_shapes.png")


def loss_fn(params, batch):
    x, y = batch
    return optax.softmax_cross_entropy_with_integer_labels(model.apply(params, x), y).mean()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="directory for the PNGs (default: a new temporary one)")
    args = parser.parse_args(argv)
    out = pathlib.Path(args.out or tempfile.mkdtemp(prefix="vjpkit-plots-"))

    x, y = load_images()
    params = model.init(jax.random.key(args.seed), x[: args.batch_size])

    # 1. Train, capturing each layer's cotangent norms in the graph; a (step, captured) pair per step.
    history: list[tuple[int, dict]] = []
    start = time.perf_counter()
    state, metrics = vk.train.fit(
        loss_fn,
        optax.sgd(args.lr, momentum=0.9),
        params,
        (x, y),
        batch_size=args.batch_size,
        steps=args.steps,
        capture=vk.capture("*", fields=["grad_output", "grad_params"], reduce="norm"),
        on_records=lambda step, captured: history.append((step, captured)),
        seed=args.seed,
        progress=False,
    )
    print(
        f"trained {args.steps} steps in {time.perf_counter() - start:.1f} s; "
        f"loss {metrics['loss'][0]:.3f} -> {metrics['loss'][-1]:.3f}"
    )

    # 2. One more step with whole records (reduce=None). Un-jitted, so that `captured` keeps
    #    backward order (jax.jit returns dicts with sorted keys); for one step, eager is fast enough.
    batch = (x[-args.batch_size :], y[-args.batch_size :])
    spec = vk.capture("*", fields=["grad_output", "grad_input", "grad_params"])
    grads, captured = vk.grad(loss_fn, capture=spec)(state.params, batch)
    backward = list(captured)  # fc2, relu3, fc1, flat, pool, relu2, conv2, relu1, conv1

    # 3. The three pictures.
    with_params = [k for k in backward if jax.tree.leaves(captured[k].grad_params)]
    figures = {
        FILES[0]: plot_gradient_flow(history, layers=backward, path=out / FILES[0]),
        FILES[1]: plot_histograms(
            captured, fields=("grad_output", "grad_params"), layers=with_params, path=out / FILES[1]
        ),
        FILES[2]: plot_backward_shapes(captured, path=out / FILES[2]),
    }
    paths = [out / name for name in FILES]
    for p in paths:
        print(f"wrote {p} ({p.stat().st_size / 1024:.0f} KB)")
    return dict(
        paths=paths,
        figures=figures,
        history=history,
        metrics=metrics,
        captured=captured,
        with_params=with_params,
        state=state,
        out=out,
    )


if __name__ == "__main__":
    main()
