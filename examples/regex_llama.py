"""A LLaMA in Flax linen written the way many JAX trainers write one: its weights carry no logical
axes (they are placed by parameter-path regexes, `examples/regex_llama.yml`), and its activations are
constrained by a helper that acts only inside the trainer's `with mesh:` block. Dump it with

    sharding-dump --model examples.regex_llama:small_llama --topology cpu-8 \\
        --rule examples/regex_llama.yml ici_mp_parallelism=2
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.interpreters import pxla
from jax.sharding import PartitionSpec as PS

BATCH = ("dp", "fsdp")  # the mesh axes the batch is split over


def with_sharding_constraint(x: jax.Array, spec: PS) -> jax.Array:
    """`x` constrained to `spec` when the current `with mesh:` mesh has every axis `spec` names, else
    `x` unchanged (a single host without a mesh, an evaluation run on another mesh)."""
    mesh = pxla.thread_resources.env.physical_mesh
    names = {a for entry in spec if entry is not None for a in ((entry,) if isinstance(entry, str) else entry)}
    if mesh.empty or not names <= set(mesh.axis_names):
        return x
    return jax.lax.with_sharding_constraint(x, spec)


@dataclasses.dataclass(frozen=True)
class LLaMAConfig:
    vocab_size: int = 8192
    hidden_size: int = 512
    intermediate_size: int = 1408
    num_hidden_layers: int = 2
    num_attention_heads: int = 8
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000.0


class RMSNorm(nn.Module):
    eps: float

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        weight = self.param("kernel", nn.initializers.ones, (x.shape[-1],))
        x32 = x.astype(jnp.float32)
        return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps) * weight


def rotary(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary position embedding of `x` [batch, length, heads, head_dim] at `positions` [batch, length]."""
    half = x.shape[-1] // 2
    freqs = 1.0 / theta ** (jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions[..., None, None].astype(jnp.float32) * freqs
    first, second = x[..., :half], x[..., half:]
    return jnp.concatenate([first * jnp.cos(angles) - second * jnp.sin(angles),
                            second * jnp.cos(angles) + first * jnp.sin(angles)], axis=-1)


class Attention(nn.Module):
    config: LLaMAConfig

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        c = self.config
        b, s, _ = x.shape
        head_dim = c.hidden_size // c.num_attention_heads

        def project(name: str) -> jax.Array:
            y = nn.Dense(c.hidden_size, use_bias=False, name=name)(x).reshape(b, s, c.num_attention_heads, head_dim)
            return with_sharding_constraint(y, PS(BATCH, None, "mp", None))

        q, k, v = project("wq"), project("wk"), project("wv")
        q, k = rotary(q, positions, c.rope_theta), rotary(k, positions, c.rope_theta)
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        out = with_sharding_constraint(out, PS(BATCH, None, "mp", None)).reshape(b, s, c.hidden_size)
        return nn.Dense(c.hidden_size, use_bias=False, name="wo")(out)


class FeedForward(nn.Module):
    config: LLaMAConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        gate = nn.Dense(c.intermediate_size, use_bias=False, name="w1")(x)
        up = nn.Dense(c.intermediate_size, use_bias=False, name="w3")(x)
        hidden = with_sharding_constraint(nn.silu(gate) * up, PS(BATCH, None, "mp"))
        return nn.Dense(c.hidden_size, use_bias=False, name="w2")(hidden)


class Block(nn.Module):
    config: LLaMAConfig

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        c = self.config
        x = with_sharding_constraint(x, PS(BATCH, None, None))
        x = x + Attention(c, name="attention")(RMSNorm(c.rms_norm_eps, name="attention_norm")(x), positions)
        return x + FeedForward(c, name="feed_forward")(RMSNorm(c.rms_norm_eps, name="ffn_norm")(x))


class Transformer(nn.Module):
    config: LLaMAConfig

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        c = self.config
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        x = nn.Embed(c.vocab_size, c.hidden_size, name="wte")(tokens)
        block = nn.remat(Block, static_argnums=())
        for i in range(c.num_hidden_layers):
            x = block(c, name=f"h_{i}")(x, positions)
        return RMSNorm(c.rms_norm_eps, name="ln_f")(x)


class LLaMAForCausalLM(nn.Module):
    config: LLaMAConfig = LLaMAConfig()

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        hidden = Transformer(self.config, name="transformer")(tokens)
        logits = nn.Dense(self.config.vocab_size, use_bias=False, name="lm_head")(hidden)
        return with_sharding_constraint(logits, PS(BATCH, None, "mp"))


def small_llama() -> LLaMAForCausalLM:
    """The factory `--model examples.regex_llama:small_llama` calls: 2 layers, 512 wide."""
    return LLaMAForCausalLM()
