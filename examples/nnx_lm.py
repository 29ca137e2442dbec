"""A causal LM in Flax NNX: weights annotated with `nnx.with_partitioning` (logical axes), layers
stacked with `nnx.vmap` + `nnx.scan` (the layer axis named `layers`), activations constrained with
flax's `nn.with_logical_constraint`. Dump it with

    sharding-dump --model examples.nnx_lm:small_lm --topology cpu-8 --rule examples/rules.yml \\
        ici_fsdp_parallelism=4 ici_tensor_parallelism=2
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx


def linear(d_in: int, d_out: int, axes: tuple[str, str], rngs: nnx.Rngs) -> nnx.Linear:
    init = nnx.with_partitioning(nnx.initializers.lecun_normal(), axes)
    return nnx.Linear(d_in, d_out, use_bias=False, kernel_init=init, rngs=rngs)


def norm(dim: int, rngs: nnx.Rngs) -> nnx.RMSNorm:
    return nnx.RMSNorm(dim, scale_init=nnx.with_partitioning(nnx.initializers.ones, ("norm",)), rngs=rngs)


class Block(nnx.Module):
    def __init__(self, embed: int, heads: int, mlp: int, rngs: nnx.Rngs):
        self.heads = heads
        self.attention_norm, self.mlp_norm = norm(embed, rngs), norm(embed, rngs)
        self.query, self.key, self.value = (linear(embed, embed, ("embed", "heads"), rngs) for _ in range(3))
        self.out = linear(embed, embed, ("heads", "embed"), rngs)
        self.up = linear(embed, mlp, ("embed", "mlp"), rngs)
        self.down = linear(mlp, embed, ("mlp", "embed"), rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, s, e = x.shape
        x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
        h = self.attention_norm(x)
        q, k, v = (p(h).reshape(b, s, self.heads, -1) for p in (self.query, self.key, self.value))
        x = x + self.out(jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, s, e))
        h = nn.with_logical_constraint(nnx.gelu(self.up(self.mlp_norm(x))), ("batch", "length", "mlp"))
        return x + self.down(h)


class NnxLM(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, vocab: int = 32_000, embed: int = 1024, layers: int = 4,
                 heads: int = 16, mlp: int = 4096):
        init = nnx.with_partitioning(nnx.initializers.normal(1.0), ("vocab", "embed"))
        self.embedder = nnx.Embed(vocab, embed, embedding_init=init, rngs=rngs)

        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_blocks(rngs: nnx.Rngs) -> Block:
            return Block(embed, heads, mlp, rngs)

        self.blocks = make_blocks(rngs)
        self.final_norm = norm(embed, rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def run(x: jax.Array, block: Block) -> jax.Array:
            return block(x)

        x = run(self.embedder(tokens).astype(jnp.float32), self.blocks)
        logits = self.embedder.attend(self.final_norm(x))
        return nn.with_logical_constraint(logits, ("batch", "length", "vocab"))


def small_lm() -> NnxLM:
    """The factory `--model examples.nnx_lm:small_lm` calls (under nnx.eval_shape: nothing allocated)."""
    return NnxLM(nnx.Rngs(0))
