"""Optimizers of your own, for `optimizer=examples.optimizers:adafactor` (any function of no arguments
returning an optax GradientTransformation). Each leaf of their state is laid out by the axes it derives
from its parameter: Adafactor's factored second moments by the dimensions they keep, a `MultiSteps`
accumulator like its parameter."""

import optax


def adafactor() -> optax.GradientTransformation:
    """Adafactor with factored second moments (optax's defaults: a matrix of two dimensions of at
    least 128 keeps one row and one column vector instead of a full second moment)."""
    return optax.adafactor(learning_rate=1e-3)


def multisteps_adamw() -> optax.GradientTransformation:
    """AdamW applied every 4 micro-steps, gradients accumulated in between (`optax.MultiSteps`)."""
    return optax.MultiSteps(optax.adamw(1e-4, b1=0.9, b2=0.95, weight_decay=0.1), every_k_schedule=4)


def clipped_lion() -> optax.GradientTransformation:
    """Lion behind global-norm clipping (`optax.chain`)."""
    return optax.chain(optax.clip_by_global_norm(1.0), optax.lion(1e-4))
