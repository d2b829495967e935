"""A small decoder-only transformer in plain Flax linen, trained with ``vk.train.fit``.

The task, made by the script: sort ``--length`` digits. A sequence is ``digits, SEP, sorted
digits``; the model predicts each next token and is scored on the sorted half. Nothing in the
model mentions vjpkit: inside vjpkit transforms every linen module call is a layer call named by
its Flax path (``block_0/attn/query``, ``block_1/mlp/fc``, ...). The script

1. trains with ``vk.train.fit``, capturing the gradient norm of every attention and MLP dense
   layer each step (``reduce="norm"``, in the graph), and prints the answer accuracy;
2. plots attention against MLP gradient flow over training (``plot_gradient_flow``);
3. prints per-example gradient norms of one batch (``per_example_grad_norms``: one forward and
   one backward pass of the loss vmapped over the examples; Flax ``Dense``, ``Embed`` and
   ``LayerNorm`` have fast paths and the positional ``Embed``, looked up with ``arange``, is
   lifted over the examples, so no layer falls back to ``jax.vmap(jax.grad)``).

Run: ``python examples/flax_transformer.py --steps 400``.
"""

import argparse
import pathlib
import tempfile

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import vjpkit as vk

SEP = 10
VOCAB = 11


class SelfAttention(nn.Module):
    heads: int

    @nn.compact
    def __call__(self, x):
        b, t, d = x.shape
        split = lambda a: a.reshape(b, t, self.heads, d // self.heads)
        q, k, v = (split(nn.Dense(d, name=n)(x)) for n in ("query", "key", "value"))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.float32(d // self.heads))
        causal = jnp.tril(jnp.ones((t, t), bool))
        weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
        out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, d)
        return nn.Dense(d, name="out")(out)


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        return nn.Dense(d, name="proj")(nn.gelu(nn.Dense(4 * d, name="fc")(x)))


class Block(nn.Module):
    heads: int

    @nn.compact
    def __call__(self, x):
        x = x + SelfAttention(self.heads, name="attn")(nn.LayerNorm(name="ln1")(x))
        return x + MLP(name="mlp")(nn.LayerNorm(name="ln2")(x))


class Transformer(nn.Module):
    dim: int = 48
    depth: int = 2
    heads: int = 4
    max_len: int = 32

    @nn.compact
    def __call__(self, tokens):
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        x = nn.Embed(VOCAB, self.dim, name="embed")(tokens) + nn.Embed(self.max_len, self.dim, name="pos")(
            positions
        )
        for i in range(self.depth):
            x = Block(self.heads, name=f"block_{i}")(x)
        return nn.Dense(VOCAB, name="head")(nn.LayerNorm(name="ln_f")(x))


def make_data(rng: np.random.Generator, n: int, length: int) -> np.ndarray:
    digits = rng.integers(0, 10, size=(n, length))
    return np.concatenate([digits, np.full((n, 1), SEP), np.sort(digits, axis=1)], axis=1).astype(np.int32)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--length", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="directory for the plot (default: a temp dir)")
    args = parser.parse_args(argv)

    rng = np.random.default_rng(args.seed)
    train, test = make_data(rng, 8192, args.length), make_data(rng, 512, args.length)
    model = Transformer()
    # jitted: eagerly, each initializer would compile op by op for each parameter shape
    params = jax.jit(model.init)(jax.random.key(args.seed), train[:2, :-1])["params"]
    answer = slice(args.length, 2 * args.length)  # predictions of the sorted half

    def loss_fn(params, tokens):
        logits = model.apply({"params": params}, tokens[:, :-1])[:, answer]
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:][:, answer]).mean()

    @jax.jit
    def accuracy(params, tokens):
        logits = model.apply({"params": params}, tokens[:, :-1])[:, answer]
        return jnp.mean(jnp.argmax(logits, -1) == tokens[:, 1:][:, answer])

    # 1. Train, capturing attention and MLP dense layers' gradient norms each step.
    history: list = []
    layers = ["block_*/attn/*", "block_*/mlp/*"]
    state, metrics = vk.train.fit(
        loss_fn,
        optax.adamw(args.lr, weight_decay=0.0),
        params,
        train,
        batch_size=args.batch_size,
        steps=args.steps,
        capture=vk.capture(layers, fields=["grad_params"], reduce="norm"),
        on_records=lambda step, captured: history.append((step, captured)),
        seed=args.seed,
        progress=False,
    )
    acc = float(accuracy(state.params, test))
    print(f"loss {metrics['loss'][0]:.3f} -> {metrics['loss'][-1]:.3f}")
    print(f"test answer accuracy {acc:.3f} (chance 0.100)")

    # 2. Attention versus MLP gradient flow over training.
    out = pathlib.Path(args.out or tempfile.mkdtemp(prefix="vjpkit-flax-"))
    keys = sorted(history[0][1])
    attn = [k for k in keys if "/attn/" in k]
    mlp = [k for k in keys if "/mlp/" in k]
    plot = vk.inspect.plot_gradient_flow(history, layers=attn + mlp, path=out / "flax_gradient_flow.png")
    del plot
    flow = {}
    for group, names in (("attention", attn), ("mlp", mlp)):
        last = [
            float(np.sqrt(sum(np.square(v) for v in jax.tree.leaves(history[-1][1][k].grad_params))))
            for k in names
        ]
        flow[group] = float(np.mean(last))
    print(f"mean final grad norm: attention {flow['attention']:.2e}, mlp {flow['mlp']:.2e}")
    print(f"wrote {out / 'flax_gradient_flow.png'}")

    # 3. Per-example gradient norms of one test batch.
    norms_fn = jax.jit(vk.inspect.per_example_grad_norms(loss_fn))
    _, _, norms = norms_fn(state.params, test[:16])
    print("per-example gradient norms (first 8):", np.array2string(np.asarray(norms.total[:8]), precision=3))
    return {
        "accuracy": acc,
        "metrics": metrics,
        "history": history,
        "norms": norms,
        "state": state,
        "loss_fn": loss_fn,
        "test": test,
        "flow": flow,
        "out": out,
    }


if __name__ == "__main__":
    main()
