"""A pure-JAX Llama-style LM that places everything itself, with sharding in types.

Written after the pattern of jax-ml/jax-llm-examples' Llama 3 (`llama3_jax/model.py`): the weights
are a plain pytree of arrays, each declared with its *logical* axes; the program's own
:class:`ShardingRules` map those to mesh axes; `init` creates every weight inside one
`jax.jit(out_shardings=...)` and the step places its activations with `out_sharding=` on einsums and
the embedding gather, and `jax.sharding.reshard` on the batch. No flax box, no rule file rule: the
rule file only declares the mesh (`examples/pure_jax_rules.yml`), and the harness reads every
placement from the program itself.

The program reaches the case's mesh as it would reach its own in training: `jax.sharding.
get_abstract_mesh()` inside `init` and the step (the harness traces both under the case's mesh).

    sharding-dump --model examples.pure_jax_llama:small_llama --topology cpu-4 \\
        --rule examples/pure_jax_rules.yml ici_fsdp_parallelism=2 ici_tensor_parallelism=2 shard_mode=explicit \\
        per_device_batch_size=2 max_target_length=64
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import sharding_dump as sd

AxisName = str | tuple[str, ...] | None


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """The program's own logical-to-mesh rules (one field per logical axis)."""

    batch: AxisName = "fsdp"
    sequence: AxisName = None
    act_embed: AxisName = None
    act_mlp: AxisName = "tensor"
    act_heads: AxisName = "tensor"
    embed: AxisName = "fsdp"
    q_heads: AxisName = "tensor"
    kv_heads: AxisName = "tensor"
    head_dim: AxisName = None
    mlp: AxisName = "tensor"
    vocab: AxisName = "tensor"
    norm: AxisName = None


RULES = ShardingRules()


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 256
    embed: int = 64
    mlp: int = 128
    q_heads: int = 4
    kv_heads: int = 4  # as many as q_heads: no grouped-query repeat to place
    head_dim: int = 16
    layers: int = 2
    rules: ShardingRules = RULES


def spec(rules: ShardingRules, *logical: str | None) -> P:
    """The program's own translation of logical axes to a PartitionSpec."""
    return P(*(getattr(rules, name) if name is not None else None for name in logical))


def shapes(cfg: Config) -> dict:
    """Every weight: (shape, logical axes)."""
    layer = {
        "attn_norm": ((cfg.embed,), ("norm",)),
        "q": ((cfg.embed, cfg.q_heads, cfg.head_dim), ("embed", "q_heads", "head_dim")),
        "k": ((cfg.embed, cfg.kv_heads, cfg.head_dim), ("embed", "kv_heads", "head_dim")),
        "v": ((cfg.embed, cfg.kv_heads, cfg.head_dim), ("embed", "kv_heads", "head_dim")),
        "o": ((cfg.q_heads, cfg.head_dim, cfg.embed), ("q_heads", "head_dim", "embed")),
        "mlp_norm": ((cfg.embed,), ("norm",)),
        "w_gate": ((cfg.embed, cfg.mlp), ("embed", "mlp")),
        "w_up": ((cfg.embed, cfg.mlp), ("embed", "mlp")),
        "w_down": ((cfg.mlp, cfg.embed), ("mlp", "embed")),
    }
    return {"embedding": ((cfg.vocab, cfg.embed), ("vocab", "embed")),
            "layers": [dict(layer) for _ in range(cfg.layers)],
            "final_norm": ((cfg.embed,), ("norm",)),
            "lm_head": ((cfg.embed, cfg.vocab), ("embed", "vocab"))}


def _is_info(x) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], tuple) and isinstance(x[1], tuple)


def init_weights(key: jax.Array, cfg: Config) -> dict:
    """Every weight created inside one jit whose out_shardings are the program's own rules."""
    infos = shapes(cfg)
    mesh = jax.sharding.get_abstract_mesh()
    shardings = jax.tree.map(lambda info: NamedSharding(mesh, spec(cfg.rules, *info[1])), infos, is_leaf=_is_info)

    @partial(jax.jit, out_shardings=shardings)
    def create(key):
        leaves, tree = jax.tree.flatten(infos, is_leaf=_is_info)
        keys = jax.random.split(key, len(leaves))
        made = [jnp.ones(shape) if logical == ("norm",) else jax.random.normal(k, shape) * shape[0] ** -0.5
                for k, (shape, logical) in zip(keys, leaves)]
        return jax.tree.unflatten(tree, made)

    return create(key)


def rms_norm(x: jax.Array, gamma: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * gamma


def forward(weights: dict, tokens: jax.Array, cfg: Config) -> jax.Array:
    """Logits [batch, length, vocab], every activation placed by the program's rules."""
    r = cfg.rules
    x = weights["embedding"].at[tokens, :].get(out_sharding=spec(r, "batch", "sequence", "act_embed"))
    length = tokens.shape[1]
    mask = jnp.tril(jnp.ones((length, length), bool))
    for layer in weights["layers"]:
        h = rms_norm(x, layer["attn_norm"])
        q = jnp.einsum("btd,dhk->bthk", h, layer["q"], out_sharding=spec(r, "batch", "sequence", "act_heads", None))
        k = jnp.einsum("btd,dhk->bthk", h, layer["k"], out_sharding=spec(r, "batch", "sequence", "act_heads", None))
        v = jnp.einsum("btd,dhk->bthk", h, layer["v"], out_sharding=spec(r, "batch", "sequence", "act_heads", None))
        scores = jnp.einsum("bqhk,bshk->bhqs", q, k) * cfg.head_dim ** -0.5
        probs = jax.nn.softmax(jnp.where(mask, scores, -1e9), axis=-1)
        attn = jnp.einsum("bhqs,bshk->bqhk", probs, v)
        x = x + jnp.einsum("bthk,hkd->btd", attn, layer["o"], out_sharding=spec(r, "batch", "sequence", "act_embed"))
        h = rms_norm(x, layer["mlp_norm"])
        gate = jnp.einsum("btd,df->btf", h, layer["w_gate"], out_sharding=spec(r, "batch", "sequence", "act_mlp"))
        up = jnp.einsum("btd,df->btf", h, layer["w_up"], out_sharding=spec(r, "batch", "sequence", "act_mlp"))
        x = x + jnp.einsum("btf,fd->btd", jax.nn.silu(gate) * up, layer["w_down"],
                           out_sharding=spec(r, "batch", "sequence", "act_embed"))
    x = rms_norm(x, weights["final_norm"])
    return jnp.einsum("btd,dv->btv", x, weights["lm_head"], out_sharding=spec(r, "batch", "sequence", None))


def program(cfg: Config, out_rules: ShardingRules | None = None) -> sd.TrainProgram:
    """Its own init (weights, AdamW state, step count) and train step; with `out_rules`, the step is
    jitted with `out_shardings` that hand the state back on those rules (as jax-llm-examples' prefill
    hands its KV cache back on the cache's shardings)."""
    tx = optax.adamw(3e-4, weight_decay=0.1)

    def make_state(params: dict) -> dict:
        return {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32)}

    def init(key: jax.Array) -> dict:
        return make_state(init_weights(key, cfg))

    def state_shardings(rules: ShardingRules) -> dict:
        """The whole state's shardings on `rules`: the weights' own, and AdamW's moments following
        them by sharding in types (`eval_shape` of the optimizer's init over typed weights)."""
        mesh = jax.sharding.get_abstract_mesh()
        typed = jax.tree.map(lambda info: jax.ShapeDtypeStruct(info[0], jnp.float32,
                                                               sharding=NamedSharding(mesh, spec(rules, *info[1]))),
                             shapes(cfg), is_leaf=_is_info)
        return jax.tree.map(lambda leaf: leaf.sharding, jax.eval_shape(make_state, typed))

    def train_step(state: dict, batch: dict) -> tuple[dict, dict]:
        tokens = jax.sharding.reshard(batch["inputs"], spec(cfg.rules, "batch", "sequence"))
        targets = jax.sharding.reshard(batch["targets"], spec(cfg.rules, "batch", "sequence"))

        def loss_fn(params: dict) -> jax.Array:
            logits = forward(params, tokens, cfg)
            return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        return ({"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state,
                 "step": state["step"] + 1}, {"loss": loss})

    def jitted_step(state: dict, batch: dict) -> tuple[dict, dict]:
        replicated = NamedSharding(jax.sharding.get_abstract_mesh(), P())
        return jax.jit(train_step, out_shardings=(state_shardings(out_rules), replicated))(state, batch)

    step = train_step if out_rules is None else jitted_step
    return sd.TrainProgram(init, step, batch={"inputs": sd.Input(), "targets": sd.Input()})


def small_llama() -> sd.TrainProgram:
    """Two layers at toy sizes, placed by the module's RULES (read when called)."""
    return program(Config(rules=RULES))


OUT_RULES: ShardingRules | None = None  # the rules the jitted step hands the state back on (None: RULES)


def small_llama_jitted() -> sd.TrainProgram:
    """`small_llama` with its step jitted, handing the state back on OUT_RULES (read when called)."""
    return program(Config(rules=RULES), out_rules=OUT_RULES or RULES)
