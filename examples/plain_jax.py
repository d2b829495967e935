"""A transformer in plain jax.numpy, no layer library, with every layer's backward pass visible.

The model is a dict of arrays and a few functions: a token embedding whose table is tied to
the output head (``h @ params["embed"].T``), a learned positional table, pre-norm blocks with
attention written as einsums (``q``, ``k``, ``v``, ``o`` projections, separate leaves under
``params["blocks"]["attn"]``) and an MLP, layer norms written in jnp with ``scale`` and
``bias``, and the blocks run by ``lax.scan`` over weights stacked on a leading axis. Nothing in
it mentions vjpkit: inside a vjpkit transform, plain-JAX matching finds the layers in the traced
program by dataflow and names them by parameter path (``blocks/attn/q``, ``blocks/mlp/fc``,
``embed`` for the lookup and ``embed#1`` for the tied head); see docs/plain-jax.md.

The task, made by the script: each sequence repeats a random pattern of ``--period`` tokens;
the model predicts every next token, and after the first period each one is a copy from
``--period`` positions back, which the attention learns to look up. The script

1. prints ``vk.explain`` of the loss: the matched layer calls, in forward order, with shapes;
2. trains with ``vk.train.fit``, capturing every layer's gradient norm each step in the graph
   (``reduce="norm"``; a layer inside the scan gives one norm per block, stacked), and prints
   the accuracy on the predictable positions of fresh sequences;
3. plots the gradient flow (``plot_gradient_flow``), one line per layer and block, to --out;
4. prints per-example gradient norms of a few sequences (``per_example_grad_norms``; the
   layers inside ``lax.scan`` take the dense fast paths per block, and the table tied to the
   head, ``h @ embed.T``, is one leaf whose lookup and head add per example, cross term
   included, in ``B x T^2`` Gram matrices; nothing falls back to ``vmap(grad)``).

Run: ``python examples/plain_jax.py`` (about 300 steps; ``--steps N`` for a shorter run).
Needs ``pip install -e ".[plot]"`` (matplotlib) for the plot.
"""

from __future__ import annotations

import argparse
import pathlib
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax

import vjpkit as vk


def init_params(key, vocab: int, dim: int, depth: int, length: int) -> dict:
    """The model: a plain dict of arrays; the blocks' weights stacked on a leading ``depth`` axis."""
    keys = iter(jax.random.split(key, 8))

    def normal(shape, scale):
        return scale * jax.random.normal(next(keys), shape, jnp.float32)

    def norm(*lead):
        return {"scale": jnp.ones((*lead, dim)), "bias": jnp.zeros((*lead, dim))}

    return {
        "embed": normal((vocab, dim), dim**-0.5),
        "pos": normal((length, dim), 0.1),
        "blocks": {
            "ln1": norm(depth),
            "attn": {name: normal((depth, dim, dim), dim**-0.5) for name in ("q", "k", "v", "o")},
            "ln2": norm(depth),
            "mlp": {
                "fc": {"w": normal((depth, dim, 4 * dim), dim**-0.5), "b": jnp.zeros((depth, 4 * dim))},
                "proj": {"w": normal((depth, 4 * dim, dim), (4 * dim) ** -0.5), "b": jnp.zeros((depth, dim))},
            },
        },
        "ln_f": norm(),
    }


def layer_norm(x, p):
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]


def attention(x, p, heads: int):
    b, t, d = x.shape
    q, k, v = (jnp.einsum("btd,de->bte", x, p[n]).reshape(b, t, heads, d // heads) for n in "qkv")
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.float32(d // heads))
    scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e9)  # causal
    out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v).reshape(b, t, d)
    return jnp.einsum("btd,de->bte", out, p["o"])


def mlp(x, p):
    h = jax.nn.gelu(x @ p["fc"]["w"] + p["fc"]["b"])
    return h @ p["proj"]["w"] + p["proj"]["b"]


def block(x, p, heads: int):  # x + (h @ W + b): each bias joins its matmul's layer call
    x = x + attention(layer_norm(x, p["ln1"]), p["attn"], heads)
    return x + mlp(layer_norm(x, p["ln2"]), p["mlp"])


def apply(params, tokens, heads: int = 4):
    dim = params["embed"].shape[1]
    # `pos` is a shift layer of its own (a bias add joins dense, conv and scale calls, not lookups)
    x = params["embed"][tokens] * jnp.sqrt(jnp.float32(dim)) + params["pos"][: tokens.shape[1]]
    x, _ = jax.lax.scan(lambda h, p: (block(h, p, heads), None), x, params["blocks"])
    return layer_norm(x, params["ln_f"]) @ params["embed"].T  # the head: the tied table


def loss_fn(params, tokens):
    """Mean next-token cross-entropy over every position of ``tokens`` (batch, length + 1)."""
    logits = apply(params, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def make_data(rng: np.random.Generator, n: int, length: int, period: int, vocab: int) -> np.ndarray:
    """``n`` sequences of ``length + 1`` tokens, each a random pattern of ``period`` repeated."""
    pattern = rng.integers(0, vocab, size=(n, period))
    return np.tile(pattern, (1, length // period + 2))[:, : length + 1].astype(np.int32)


def accuracy(params, tokens, period: int) -> float:
    """Next-token accuracy on the predictable positions (after the first period)."""
    predicted = jnp.argmax(apply(params, tokens[:, :-1]), -1)
    return float(jnp.mean(predicted[:, period - 1 :] == tokens[:, period:]))


def unstack(history: list) -> dict:
    """``{name[i]: (steps, norms)}``: a layer in the scan has one norm per block, stacked."""
    series: dict = {}
    for step, captured in history:
        for key in sorted(captured):
            grads = jax.tree.leaves(captured[key].grad_params)
            leaves = [np.atleast_1d(np.asarray(g, np.float64)) for g in grads]
            norm = np.sqrt(sum(np.square(g) for g in leaves))  # the norm of all of the call's params
            for i, value in enumerate(norm):
                name = f"{key}[{i}]" if len(norm) > 1 else key
                series.setdefault(name, ([], []))
                series[name][0].append(step)
                series[name][1].append(float(value))
    return series


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--length", type=int, default=16)
    parser.add_argument("--period", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=16)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="directory for the plots (default: a temp dir)")
    args = parser.parse_args(argv)

    rng = np.random.default_rng(args.seed)
    train = make_data(rng, 4096, args.length, args.period, args.vocab)
    test = make_data(rng, 256, args.length, args.period, args.vocab)
    params = init_params(jax.random.key(args.seed), args.vocab, args.dim, args.depth, args.length)

    # 1. What plain-JAX matching found: one row per layer call, named by parameter path.
    rows = vk.explain(loss_fn, params, train[: args.batch_size])
    names = [row["key"] for row in rows]

    # 2. Train, capturing every layer's gradient norm each step (in the graph).
    history: list = []
    state, metrics = vk.train.fit(
        loss_fn,
        optax.adam(args.lr),
        params,
        train,
        batch_size=args.batch_size,
        steps=args.steps,
        capture=vk.capture("*", fields=["grad_params"], reduce="norm"),
        on_records=lambda step, captured: history.append((step, captured)),
        seed=args.seed,
        progress=False,
    )
    acc = accuracy(state.params, test, args.period)
    print(f"loss {metrics['loss'][0]:.3f} -> {metrics['loss'][-1]:.3f}")
    print(f"test accuracy after the first period {acc:.3f} (chance {1 / args.vocab:.3f})")

    # 3. Gradient flow: one line per layer call and block.
    out = pathlib.Path(args.out or tempfile.mkdtemp(prefix="vjpkit-plain-jax-"))
    out.mkdir(parents=True, exist_ok=True)
    series = unstack(history)
    attn = [k for k in series if k.startswith("blocks/attn/")]
    rest = [k for k in series if k not in attn]
    vk.inspect.plot_gradient_flow(
        {k: series[k] for k in attn}, path=out / "plain_jax_attention_flow.png", title="attention projections"
    )
    vk.inspect.plot_gradient_flow(
        {k: series[k] for k in rest}, path=out / "plain_jax_gradient_flow.png", title="embeddings, norms, MLP"
    )
    print(f"wrote {out / 'plain_jax_attention_flow.png'} and {out / 'plain_jax_gradient_flow.png'}")

    # 4. Per-example gradient norms of a few test sequences. The layers inside lax.scan take
    # the fast paths per block (stacked weights: the per-block squared norms summed). The tied
    # table's lookup and head (h @ embed.T, a transposed weight) add per example, cross term
    # included (vjpkit.stats: Gram matrices of their rows, never B x the table).
    batch = jnp.asarray(test[:8])
    _, _, norms = jax.jit(vk.inspect.per_example_grad_norms(loss_fn))(state.params, batch)
    print("per-example gradient norms:", np.array2string(np.asarray(norms.total), precision=3))
    top = max(norms.layers, key=lambda k: float(norms.layers[k][0]))
    print(f"  example 0: largest in {top!r} ({float(norms.layers[top][0]):.3f})")
    return {
        "names": names,
        "rows": rows,
        "metrics": metrics,
        "accuracy": acc,
        "history": history,
        "series": series,
        "state": state,
        "batch": batch,
        "norms": norms,
        "out": out,
    }


if __name__ == "__main__":
    main()
