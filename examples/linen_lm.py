"""A causal LM in Flax linen, as a team would write it: logical axes on every weight, activation
constraints with `nn.with_logical_constraint`. Dump it with

    sharding-dump --model examples.linen_lm:small_lm --topology cpu-8 --rule examples/rules.yml \\
        ici_fsdp_parallelism=4 ici_tensor_parallelism=2
"""

import flax.linen as nn
import jax
import jax.numpy as jnp


def dense(features: int, axes: tuple[str, str], name: str) -> nn.Dense:
    init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), axes)
    return nn.Dense(features, use_bias=False, kernel_init=init, name=name)


def norm(name: str) -> nn.RMSNorm:
    return nn.RMSNorm(scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("norm",)), name=name)


class Block(nn.Module):
    heads: int
    mlp: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        b, s, e = x.shape
        x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
        h = norm("attention_norm")(x)
        q, k, v = (dense(e, ("embed", "heads"), n)(h).reshape(b, s, self.heads, -1) for n in ("query", "key", "value"))
        attention = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, s, e)
        x = x + dense(e, ("heads", "embed"), "out")(attention)
        h = nn.gelu(dense(self.mlp, ("embed", "mlp"), "up")(norm("mlp_norm")(x)))
        h = nn.with_logical_constraint(h, ("batch", "length", "mlp"))
        return x + dense(e, ("mlp", "embed"), "down")(h)


class LinenLM(nn.Module):
    vocab: int = 32_000
    embed: int = 1024
    layers: int = 4
    heads: int = 16
    mlp: int = 4096

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        init = nn.with_logical_partitioning(nn.initializers.normal(1.0), ("vocab", "embed"))
        embedder = nn.Embed(self.vocab, self.embed, embedding_init=init, name="embedder")
        x = embedder(tokens).astype(jnp.float32)
        for i in range(self.layers):
            x = Block(self.heads, self.mlp, name=f"block_{i}")(x)
        logits = embedder.attend(norm("final_norm")(x))
        return nn.with_logical_constraint(logits, ("batch", "length", "vocab"))


def small_lm() -> LinenLM:
    """The factory `--model examples.linen_lm:small_lm` calls."""
    return LinenLM()
