"""flax's lm1b training program as sharding-dump sees it: the model (examples/flax_lm1b/models.py,
flax's own file, unmodified) in training mode, dropout on, called with packed-sequence positions and
segmentation, both ways the harness takes a program:

* :func:`lm1b` (and :func:`small_lm1b`): a ModelProgram: the model and how to call it; the harness
  runs its next-token step with AdamW;
* :func:`lm1b_train` (and :func:`small_lm1b_train`): a TrainProgram: lm1b's own init (a flax
  TrainState with lm1b's AdamW) and step (its weighted cross entropy, dropout key folded with the
  step, `apply_gradients`), traced as they are.

    sharding-dump --model examples.lm1b:small_lm1b --topology cpu-8 --rule examples/lm1b_rules.yml ici_fsdp_parallelism=4 ici_tensor_parallelism=2
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

import sharding_dump as sd
from examples.flax_lm1b import models

PACKED = {"inputs_segmentation": sd.Input()}  # lm1b trains on packed sequences: segment ids per token


def config(**override) -> models.TransformerConfig:
    """lm1b's training configuration (its configs/default.py as train.py builds `train_config`)."""
    values = dict(vocab_size=30_000, output_vocab_size=30_000, dtype=jnp.bfloat16, emb_dim=512, num_heads=8,
                  num_layers=6, qkv_dim=512, mlp_dim=2048, max_len=512, dropout_rate=0.1,
                  attention_dropout_rate=0.1, deterministic=False, decode=False,
                  kernel_init=nn.initializers.xavier_uniform(), bias_init=nn.initializers.normal(stddev=1e-6))
    return models.TransformerConfig(**{**values, **override})


SMALL = dict(vocab_size=512, output_vocab_size=512, emb_dim=64, num_heads=4, qkv_dim=64, mlp_dim=128, num_layers=2)


def lm1b() -> sd.ModelProgram:
    """The training model; positions go to its `inputs_positions` keyword (found by name), the
    segmentation is a further batch field; dropout gets the `dropout` stream."""
    return sd.ModelProgram(models.TransformerLM(config()), inputs=PACKED)


def small_lm1b() -> sd.ModelProgram:
    return sd.ModelProgram(models.TransformerLM(config(**SMALL)), inputs=PACKED)


def weighted_cross_entropy(logits: jax.Array, targets: jax.Array, weights: jax.Array) -> jax.Array:
    """lm1b's loss (label smoothing 0): summed token cross entropy over the non-padding tokens."""
    log_probs = nn.log_softmax(logits.astype(jnp.float32))
    loss = -jnp.sum(jax.nn.one_hot(targets, logits.shape[-1]) * log_probs, axis=-1)
    return (loss * weights).sum() / weights.sum()


def train_program(cfg: models.TransformerConfig, batch_size: int = 32, length: int = 128) -> sd.TrainProgram:
    """lm1b's init (utils.init_train_state) and train_step (train.train_step), written as it writes them."""
    model = models.TransformerLM(cfg)
    schedule = optax.join_schedules([optax.linear_schedule(0.0, 0.0016, 1000),
                                     lambda count: 0.0016 * (count + 1000) ** -0.5 * 1000 ** 0.5], [1000])
    tx = optax.adamw(schedule, b1=0.9, b2=0.98, eps=1e-9, weight_decay=0.1)

    def init(key: jax.Array) -> train_state.TrainState:
        variables = model.init({"params": key, "dropout": key}, jnp.ones((batch_size, length), jnp.float32))
        return train_state.TrainState.create(apply_fn=model.apply, params=variables["params"], tx=tx)

    def step(state: train_state.TrainState, batch: dict[str, jax.Array]) -> tuple[train_state.TrainState, dict]:
        inputs = batch["inputs"]
        weights = jnp.where(inputs > 0, 1, 0).astype(jnp.float32)
        dropout_rng = jax.random.fold_in(jax.random.key(0), state.step)

        def loss_fn(params):
            logits = model.apply({"params": params}, inputs, inputs_positions=batch["inputs_position"],
                                 inputs_segmentation=batch["inputs_segmentation"], rngs={"dropout": dropout_rng})
            return weighted_cross_entropy(logits, inputs, weights), logits

        (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss, "learning_rate": schedule(state.step)}

    return sd.TrainProgram(init, step, batch={"inputs": sd.Input(), "inputs_position": sd.Input(),
                                              "inputs_segmentation": sd.Input()})


def lm1b_train() -> sd.TrainProgram:
    return train_program(config())


def small_lm1b_train() -> sd.TrainProgram:
    return train_program(config(**SMALL))
