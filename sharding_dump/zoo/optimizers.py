"""The optimizer of a case: MaxText's `opt_type` (adamw, adam_pax, sgd, muon) or the user's own.

`opt_type` follows MaxText's setting of that name (default adamw), with MaxText's hyperparameters
(`data/optimizers.yml`, AdamW's from the core). `optimizer=package.module:function` names a
zero-argument function of the user's returning any optax `GradientTransformation` (Adafactor, Lion,
`optax.MultiSteps`, a chain, an `optax.contrib` optimizer), for a built-in model or a factory; every
leaf of its state is laid out by the axes it derives from its parameter (`core/optimizer.py`).

>>> tx = case_optimizer({"opt_type": "adam_pax", "optimizer": ""})
>>> import jax, jax.numpy as jnp
>>> sorted(jax.eval_shape(tx.init, {"w": jax.ShapeDtypeStruct((4, 2), jnp.float32)})._fields)
['count', 'mu', 'nu']
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import optax

from sharding_dump.core.boundary import guard
from sharding_dump.core.state import ADAMW, default_optimizer
from sharding_dump.core.tree import path_text
from sharding_dump.errors import BadInput, shown
from sharding_dump.resources import DATA_DIR, load_yaml, validate
from sharding_dump.zoo.model_ref import load_reference

OPTIMIZERS_FILE = DATA_DIR / "optimizers.yml"


@functools.cache
def _data() -> dict[str, Any]:
    data = load_yaml(OPTIMIZERS_FILE, "optimizer settings")
    validate(data, "optimizers", f"optimizer settings {OPTIMIZERS_FILE}")
    return data


def _schedule() -> optax.Schedule:
    return optax.constant_schedule(ADAMW["learning_rate"])


def adam_pax(learning_rate: optax.ScalarOrSchedule, b1: float, b2: float, eps: float, eps_root: float,
             weight_decay: float) -> optax.GradientTransformation:
    """Adam whose decay rates carry the bias correction (Praxis's sharded Adam, MaxText's
    `opt_type=adam_pax`): `m = (1 - b1_t) g + b1_t m` with `b_t = b (1 - b^(t-1)) / (1 - b^t)`, so no
    correction is applied afterwards; decoupled weight decay. One `ScaleByAdamState(count, mu, nu)`."""

    def init(params: Any) -> optax.ScaleByAdamState:
        return optax.ScaleByAdamState(count=jnp.zeros([], jnp.int32), mu=jax.tree.map(jnp.zeros_like, params),
                                      nu=jax.tree.map(jnp.zeros_like, params))

    def update(updates: Any, state: optax.ScaleByAdamState, params: Any = None) -> tuple[Any, optax.ScaleByAdamState]:
        t = state.count.astype(jnp.float32) + 1.0

        def decay(b: float) -> jax.Array:
            return b * (1.0 - b ** (t - 1.0)) / (1.0 - b ** t)

        d1, d2 = decay(b1), decay(b2)
        mu = jax.tree.map(lambda g, m: (1.0 - d1.astype(g.dtype)) * g + d1.astype(g.dtype) * m, updates, state.mu)
        nu = jax.tree.map(lambda g, v: (1.0 - d2.astype(g.dtype)) * g * g + d2.astype(g.dtype) * v, updates, state.nu)
        steps = jax.tree.map(lambda m, v: m / (jnp.sqrt(v + eps_root) + eps), mu, nu)
        if weight_decay > 0:
            steps = jax.tree.map(lambda s, p: s + weight_decay * p, steps, params)
        rate = learning_rate(state.count) if callable(learning_rate) else learning_rate
        return jax.tree.map(lambda s: -rate * s, steps), optax.ScaleByAdamState(state.count + 1, mu, nu)

    return optax.GradientTransformation(init, update)


def muon_dimension_numbers(params: Any) -> Any:
    """Per parameter, Muon's reduction and output dimensions, or None for a parameter AdamW updates,
    by MaxText's rules on its path (`data/optimizers.yml`)."""
    rules = _data()["muon"]

    def numbers(key_path: Any, _: Any) -> optax.contrib.MuonDimensionNumbers | None:
        segments = path_text(key_path).split("/")
        if any(word in segment for segment in segments for word in rules["adam_if_segment_contains"]) \
                or any(segment in rules["adam_if_segment_is"] for segment in segments):
            return None
        for entry in rules["dimensions"]:
            if "segment" not in entry or (entry["segment"] in segments and any(s in segments for s in entry["any"])):
                return optax.contrib.MuonDimensionNumbers(tuple(entry["reduction"]), tuple(entry["output"]))
        return None

    return jax.tree_util.tree_map_with_path(numbers, params)


def _muon() -> optax.GradientTransformation:
    m = _data()["muon"]
    return optax.contrib.muon(
        _schedule(), ns_coeffs=tuple(m["ns_coeffs"]), ns_steps=m["ns_steps"], beta=m["beta"], eps=ADAMW["eps"],
        weight_decay=m["weight_decay"], adam_b1=ADAMW["b1"], adam_b2=ADAMW["b2"], adam_eps_root=ADAMW["eps_root"],
        adam_weight_decay=ADAMW["weight_decay"], muon_weight_dimension_numbers=muon_dimension_numbers)


def _adam_pax() -> optax.GradientTransformation:
    return adam_pax(_schedule(), ADAMW["b1"], ADAMW["b2"], ADAMW["eps"], ADAMW["eps_root"], ADAMW["weight_decay"])


OPT_TYPES: dict[str, Callable[[], optax.GradientTransformation]] = {
    "adamw": default_optimizer,
    "adam_pax": _adam_pax,
    "sgd": lambda: optax.sgd(_schedule()),
    "muon": _muon,
}


def check(values: Mapping[str, Any], decoder_block: str | None, model: str) -> None:
    """BadInput when the optimizer settings cannot apply to this case: both `opt_type` and
    `optimizer` given, Muon for a block MaxText has no Muon rules for (or a user's factory), ZeRO-1
    with an opt_type MaxText cannot shard over data."""
    opt_type, ref = values["opt_type"], values["optimizer"]
    if ref and opt_type != "adamw":
        raise BadInput(f"opt_type={opt_type} and optimizer={ref}: give one (optimizer= replaces opt_type)")
    if ref:
        return
    data = _data()
    if opt_type == "muon":
        if decoder_block is None:
            raise BadInput(f"opt_type=muon: MaxText's Muon rules name its own decoder blocks' weights; model "
                           f"{model!r} is a user factory (pass your own with optimizer=package.module:function)")
        if decoder_block not in data["muon"]["decoder_blocks"]:
            raise BadInput(f"opt_type=muon: MaxText has no Muon rules for decoder block {decoder_block!r} "
                           f"(blocks with them here: {', '.join(data['muon']['decoder_blocks'])})")
    if values["shard_optimizer_over_data"] and opt_type not in data["zero1_opt_types"]:
        raise BadInput(f"shard_optimizer_over_data=true: opt_type={opt_type} cannot be sharded over data, as in "
                       f"MaxText (opt_types that can: {', '.join(data['zero1_opt_types'])})")


@functools.lru_cache(maxsize=16)
def _user_optimizer(ref: str) -> optax.GradientTransformation:
    factory = load_reference(ref, "optimizer")
    with guard(f"optimizer={ref}: calling {ref.split(':', 1)[1]}()"):
        built = factory()
    if not (callable(getattr(built, "init", None)) and callable(getattr(built, "update", None))):
        raise BadInput(f"optimizer={ref}: {ref.split(':', 1)[1]}() returned {shown(type(built).__name__)}, not an "
                       "optax optimizer: an object with init(params) and update(grads, state, params), such as "
                       "optax.adafactor(1e-3) or optax.MultiSteps(...)")
    return guarded(built, f"optimizer={ref}")


def guarded(tx: Any, name: str) -> optax.GradientTransformationExtraArgs:
    """`tx` whose init and update, when they raise, raise one BadInput line saying which call failed
    and what the harness gave it (the user's optimizer code, run on abstract arrays)."""

    def init(params: Any) -> Any:
        with guard(f"{name}: init(params)", f"the harness passed the model's {len(jax.tree.leaves(params))} "
                                            "parameters as abstract arrays"):
            return tx.init(params)

    def update(updates: Any, state: Any, params: Any = None, **extra: Any) -> Any:
        with guard(f"{name}: update(grads, state, params)", "the harness passed the gradients, the state init "
                                                             "returned, and the parameters, all traced"):
            return tx.update(updates, state, params, **extra)

    return optax.GradientTransformationExtraArgs(init, update)


@functools.lru_cache(maxsize=None)
def _named(opt_type: str) -> optax.GradientTransformation:
    return OPT_TYPES[opt_type]()


def case_optimizer(values: Mapping[str, Any]) -> optax.GradientTransformation:
    """The optimizer the case's settings name (call :func:`check` first): one object per name, so
    the states built with it are cached once."""
    if values["optimizer"]:
        return _user_optimizer(values["optimizer"])
    return _named(values["opt_type"])
