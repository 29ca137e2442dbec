"""The training program the harness traces: the model and how it is called, or the user's own step.

Two levels, both reachable as a factory (`--model package.module:function` returning one):

* :class:`ModelProgram`: a model (linen or NNX, or a factory of one) and how to call it on a batch.
  The harness builds the state (default AdamW) and runs its next-token step, calling the model with
  the batch's tokens plus what the program declares: positions under the keyword the model takes,
  further batch fields (:class:`Input`) or values computed from the batch, constant keyword
  arguments (`deterministic=False`, `cache=None`), RNG streams (dropout), which part of the output
  is the logits; or all of it through a `call(model, batch, rngs)` hook.
* :class:`TrainProgram`: the user's own `init(key) -> state` and `train_step(state, batch) ->
  (state, metrics)` plus an abstract batch with logical axes per field. The harness traces *their*
  step (their loss, optimizer, remat, RNG handling, gradient accumulation) and dumps its state.

A module or a plain factory of one is the simplest program: `ModelProgram(model)`.

Every call into the user's code is guarded: an exception there, or a call that does not fit, is a
:class:`ProgramError` (a one-line BadInput) saying which call failed, what the harness passed and
what the interface expects.

>>> import flax.linen as nn, jax.numpy as jnp
>>> class Tiny(nn.Module):
...     @nn.compact
...     def __call__(self, tokens, inputs_positions=None, deterministic=True):
...         x = nn.Embed(64, 8)(tokens)
...         x = nn.Dropout(0.1)(x, deterministic=deterministic)
...         return x @ jnp.ones((8, 64)), None
>>> program = ModelProgram(Tiny(), kwargs={"deterministic": False})
>>> sorted(program.model_of().build_params()), program.position_keyword(Tiny())
(['Embed_0'], 'inputs_positions')
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import re
from typing import Any, Callable, Iterator, Mapping, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from sharding_dump.core import state as core_state
from sharding_dump.core.boundary import UserCodeError, guard, says
from sharding_dump.core.step import BATCH_FIELDS, Step, next_token_step, place_batch
from sharding_dump.core.tree import is_box, path_text, unbox
from sharding_dump.errors import shown

SIZES = ("batch", "length")  # the symbolic sizes a training batch's Input may name
SERVING_SIZES = ("slots", "prefill_length", "max_length")  # those a serving step's Input may name


class ProgramError(UserCodeError):
    """A call into the user's code failed or did not fit the interface, or a program was built with
    an argument the interface does not take: one line, exit status 2."""


@dataclasses.dataclass(frozen=True)
class Input:
    """One field of the batch: its shape (ints, or `batch` / `length` for the case's global batch
    size and sequence length; in a serving step `slots`, `prefill_length`, `max_length`), dtype and
    logical axes. Without logical axes the field is placed like
    the tokens (the rule file's input axes, else the data pipeline's layout) on its first two
    dimensions. `sharding` is the program's own data sharding instead (Kauldron's `sharding.ds`):
    the layout its own data pipeline hands the field over in, a PartitionSpec of mesh axes or a
    NamedSharding on the case's mesh; the golden records it as the program's batch layout."""

    shape: tuple[int | str, ...] = SIZES
    dtype: str = "int32"
    logical_axes: tuple[str | None, ...] | None = None
    sharding: PartitionSpec | NamedSharding | None = None

    def __post_init__(self) -> None:
        """Checked where it is written, so the line names the argument rather than a later trace."""
        shape, axes = self.shape, self.logical_axes
        spec = self.sharding.spec if isinstance(self.sharding, NamedSharding) else self.sharding
        if spec is not None and not isinstance(spec, PartitionSpec) or spec is not None and len(spec) > len(shape):
            raise ProgramError(f"Input(sharding={shown(self.sharding)}): give None, a PartitionSpec of mesh axes "
                               "of at most one entry per dimension, or a NamedSharding")
        if spec is not None and axes is not None:
            raise ProgramError(f"Input(logical_axes={shown(axes)}, sharding={shown(self.sharding)}): give one of "
                               "them: logical axes the rule file places, or the program's own sharding")
        if isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence) or not all(
                isinstance(d, str) and d in SIZES + SERVING_SIZES
                or isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise ProgramError(f"Input(shape={shown(shape)}): give a tuple of sizes, each a whole number >= 0 or "
                               f"one of {', '.join(map(repr, SIZES + SERVING_SIZES))}")
        object.__setattr__(self, "shape", tuple(shape))
        try:  # None is no dtype here, though numpy reads it as float64
            numeric = self.dtype is not None and (jnp.issubdtype(jnp.dtype(self.dtype), jnp.number)
                                                  or jnp.dtype(self.dtype) == jnp.bool_)
        except (TypeError, ValueError):
            numeric = False
        if not numeric:
            raise ProgramError(f"Input(dtype={shown(self.dtype)}): not a numeric dtype; give a numpy or JAX dtype "
                               "such as 'int32', 'float32' or 'bfloat16'")
        if axes is None:
            return
        if isinstance(axes, (str, bytes)) or not isinstance(axes, Sequence) or not all(
                a is None or isinstance(a, str) for a in axes):
            raise ProgramError(f"Input(logical_axes={shown(axes)}): give a tuple of logical axis names (str) or None, "
                               "one per dimension")
        if len(axes) != len(self.shape):
            raise ProgramError(f"Input(logical_axes={shown(axes)}): {len(axes)} names for a rank-{len(self.shape)} "
                               f"shape {self.shape}; give one name (or None) per dimension")
        object.__setattr__(self, "logical_axes", tuple(axes))

    def abstract(self, batch: int, length: int) -> jax.ShapeDtypeStruct:
        """This field for a batch of `batch` sequences of `length` tokens."""
        return self.sized({"batch": batch, "length": length})

    def sized(self, sizes: Mapping[str, int]) -> jax.ShapeDtypeStruct:
        """This field with its symbolic sizes given by `sizes` (name -> int)."""
        unknown = [d for d in self.shape if isinstance(d, str) and d not in sizes]
        if unknown:
            raise ProgramError(f"Input(shape={self.shape}): size {unknown[0]!r} is not one of this program's "
                               f"({', '.join(sizes)})")
        # the dtype jax gives it (float64 is float32 without jax_enable_x64), not one jax warns about
        return jax.ShapeDtypeStruct(tuple(sizes[d] if isinstance(d, str) else int(d) for d in self.shape),
                                    jax.dtypes.canonicalize_dtype(self.dtype))

    def check(self, name: str) -> None:
        """BadInput (one line) when the shape names an unknown size or the axes do not fit it."""
        for dim in self.shape:
            if isinstance(dim, str) and dim not in SIZES or not isinstance(dim, (str, int)):
                raise ProgramError(f"batch field {name!r}: shape entry {dim!r}: give an int or one of {', '.join(SIZES)}")
        if self.logical_axes is not None and len(self.logical_axes) != len(self.shape):
            raise ProgramError(f"batch field {name!r}: {len(self.logical_axes)} logical axes for a rank-"
                               f"{len(self.shape)} shape {self.shape}")


TOKEN_BATCH = {name: Input() for name in BATCH_FIELDS}


@functools.cache
def _call_defaults() -> dict[str, tuple[str, ...]]:
    from sharding_dump.resources import DATA_DIR, load_yaml, validate

    path = DATA_DIR / "program.yml"
    data = load_yaml(path, "model call defaults")
    validate(data, "program", f"model call defaults {path}")
    return {key: tuple(value) for key, value in data.items()}


def position_keywords() -> tuple[str, ...]:
    """Keyword names a model may take positions under (data/program.yml)."""
    return _call_defaults()["position_keywords"]


def default_streams() -> tuple[str, ...]:
    """RNG streams provided while tracing (data/program.yml)."""
    return _call_defaults()["rng_streams"]


# --- describing what was passed, guarding the user's code -------------------------------------------

class ArgName(str):
    """An argument shown by its name in a call's text (`train_step(state, {...})`): a whole training
    state is too long for the one line, and a quoted 'state' would read as a string passed."""


def describe(value: Any) -> str:
    """A short text for an argument: `int32[8,128]` for an array, `{inputs: int32[8,128], ...}` for a
    mapping, the repr (cut) for anything else."""
    from sharding_dump.errors import shown

    if isinstance(value, ArgName):
        return str(value)
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"{getattr(value.dtype, 'name', value.dtype)}[{','.join(map(str, value.shape))}]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {describe(v)}" for k, v in value.items()) + "}"
    if type(value).__name__ == "Rngs":
        return f"Rngs({', '.join(str(name) for name in vars(value) if not str(name).startswith('_'))})"
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(describe(v) for v in value) + ")"
    return shown(value, 40)


def call_text(name: str, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None) -> str:
    """`name(int32[8,128], positions=int32[8,128])`."""
    parts = [describe(a) for a in args] + [f"{k}={describe(v)}" for k, v in (kwargs or {}).items()]
    return f"{name}({', '.join(parts)})"


def signature_text(fn: Any) -> str:
    """`Transformer.__call__(self, last_tokens, positions, cache, attention_mask, rngs=None)` (no annotations)."""
    target = fn if inspect.isfunction(fn) or inspect.ismethod(fn) else type(fn).__call__
    name = getattr(target, "__qualname__", type(target).__name__)
    try:
        params = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):
        return name
    shown = [p.replace(annotation=inspect.Parameter.empty) for p in params]
    return f"{name}({', '.join(str(p) for p in shown)})"


@contextlib.contextmanager
def user_code(what: str, passed: str, expects: str) -> Iterator[None]:
    """Runs the user's code at the boundary (:func:`sharding_dump.core.boundary.guard`): anything it
    raises, a `sys.exit` or its time running out becomes one ProgramError line naming the call, the
    user's file and line it raised at, what was passed, and, when it failed at its entry, what the
    interface expects (a BadInput from a nested guard, and Ctrl-C, pass through)."""
    with guard(what, f"the harness passed {passed}", error=ProgramError, call_hint=expects):
        yield


# --- level 1: the model and how to call it ------------------------------------------------------------

Call = Callable[[Any, dict[str, Any], dict[str, jax.Array]], Any]


@dataclasses.dataclass(frozen=True)
class ModelProgram:
    """A model and how the harness calls it on a batch (see the module docstring).

    `model`: a linen module, an NNX module, or a zero-argument factory of either (an NNX factory is
    built abstractly). `call(model, batch, rngs) -> output` replaces the declarative call: `model` is
    the bound linen module or the NNX module, `batch` the dict of placed batch fields, `rngs` one key
    per stream. Otherwise the model is called as `model(batch["inputs"], **keywords)` with:
    `positions` ("auto": the first of data/program.yml's position keywords its `__call__` takes; a
    name; or None) receiving `batch["inputs_position"]`; `inputs`, keyword -> :class:`Input` (a batch
    field of that name) or a function of the batch; `kwargs`, constant keyword arguments; and, for an
    NNX `__call__` taking `rngs`, `rngs=nnx.Rngs(**keys)`. `logits` picks the logits out of the
    output: None for the output itself, its `.logits`, or the first element of a tuple; an attribute
    or key name; an index; or a function of the output."""

    model: Any
    call: Call | None = None
    inputs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    positions: str | None = "auto"
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    logits: Any = None
    rngs: tuple[str, ...] | None = None  # None: data/program.yml's rng_streams

    def __post_init__(self) -> None:
        """Every argument checked where it is given: one line naming it and what would be valid."""
        if hf_module(self.model) is not None:  # a Hugging Face FlaxPreTrainedModel: its linen module
            object.__setattr__(self, "model", hf_module(self.model))
        if not isinstance(self.model, (nn.Module, _nnx().Module)) and not callable(self.model):
            raise ProgramError(f"ModelProgram(model={describe(self.model)}): give a Flax linen or NNX module, or a "
                               "zero-argument function returning one")
        if self.call is not None and not callable(self.call):
            raise ProgramError(f"ModelProgram(call={describe(self.call)}): give None or a function "
                               "call(model, batch, rngs) returning the model's output")
        if not isinstance(self.inputs, Mapping):
            raise ProgramError(f"ModelProgram(inputs={describe(self.inputs)}): give a mapping, keyword -> Input(...) "
                               "or a function of the batch, e.g. inputs={'segment_ids': Input()}")
        for name, value in self.inputs.items():
            if not isinstance(name, str) or not name.isidentifier():
                raise ProgramError(f"ModelProgram(inputs=...): key {shown(name)}: give the keyword the model's call "
                                   "takes (an identifier)")
            if not isinstance(value, Input) and not callable(value):
                raise ProgramError(f"ModelProgram(inputs=...): {name!r} is {describe(value)}; give an Input(shape, "
                                   "dtype, logical_axes) or a function of the batch")
        if self.positions is not None and not (isinstance(self.positions, str) and (
                self.positions == "auto" or self.positions.isidentifier())):
            raise ProgramError(f"ModelProgram(positions={describe(self.positions)}): give 'auto', None or the "
                               "keyword the model's call takes the positions under")
        if not isinstance(self.kwargs, Mapping) or not all(isinstance(k, str) and k.isidentifier()
                                                           for k in self.kwargs):
            raise ProgramError(f"ModelProgram(kwargs={describe(self.kwargs)}): give a mapping, keyword (an "
                               "identifier) -> constant argument")
        logits = self.logits
        if not (logits is None or callable(logits) or isinstance(logits, str)
                or isinstance(logits, int) and not isinstance(logits, bool)):
            raise ProgramError(f"ModelProgram(logits={describe(logits)}): give None (the output, its .logits or the "
                               "first element of a tuple), an attribute or key name, an index, or a function of "
                               "the output")
        rngs = self.rngs
        if isinstance(rngs, str):
            rngs = (rngs,)
        if rngs is not None and (not isinstance(rngs, Sequence) or not all(isinstance(r, str) and r for r in rngs)):
            raise ProgramError(f"ModelProgram(rngs={describe(self.rngs)}): give None (the streams of "
                               "data/program.yml) or a tuple of RNG stream names, e.g. ('dropout',)")
        object.__setattr__(self, "rngs", None if rngs is None else tuple(rngs))

    def streams(self) -> tuple[str, ...]:
        return default_streams() if self.rngs is None else tuple(self.rngs)

    def batch_fields(self) -> dict[str, Input]:
        """The token batch plus the Input fields the call takes."""
        fields = dict(TOKEN_BATCH)
        for name, value in self.inputs.items():
            if isinstance(value, Input):
                value.check(name)
                fields[name] = value
        return fields

    def model_of(self, built: Any = None) -> core_state.Model:
        """The model as the core drives it, called by this program's call (built abstractly)."""
        init_fields = {name: f.abstract(*core_state.INIT_TOKENS) for name, f in self.batch_fields().items()}
        if built is None:
            built = self.model
            if not isinstance(built, (nn.Module, _nnx().Module)):
                with user_code(f"the model factory {_name(self.model)}", "no arguments",
                               "a model factory takes no arguments and returns a Flax linen or NNX module"):
                    built = core_state.build_abstract(self.model)
        if not isinstance(built, (nn.Module, _nnx().Module)):
            raise ProgramError(f"the model factory {_name(self.model)} returned {type(built).__name__}; the interface "
                               "expects a Flax linen or NNX module (or a ModelProgram / TrainProgram)")
        model = core_state.as_model(self.model, self._guarded_call(built), init_fields, self.streams(), built=built)
        init = model.build_params

        def build_params() -> Any:
            with user_code(f"initialising the model ({type(built).__name__}.init)", call_text("init", [init_fields]),
                           f"it is initialised through the same call as in the step: {self._expects(built)}"):
                return init()

        return dataclasses.replace(model, build_params=build_params)

    def position_keyword(self, module: Any) -> str | None:
        """The keyword positions are passed under, for this (linen or NNX) module."""
        if self.positions != "auto":
            return self.positions
        names = _parameters(module)
        return next((k for k in position_keywords() if k in names), None)

    def _expects(self, module: Any) -> str:
        if self.call is not None:
            return f"the call hook {_name(self.call)}(model, batch, rngs) returns the model's output"
        return (f"the model's call is {signature_text(module)}; the harness passes the tokens, the positions "
                "under a keyword the call takes, the RNG streams of ModelProgram(rngs=...) and what "
                "ModelProgram(inputs=..., kwargs=...) declares, or calls ModelProgram(call=...)")

    def _guarded_call(self, module: Any) -> Call:
        keyword = self.position_keyword(module)
        streams_kw = self.call is None and not isinstance(module, nn.Module) and core_state.takes(
            type(module).__call__, "rngs")

        def call(bound: Any, batch: dict[str, Any], rngs: dict[str, jax.Array]) -> Any:
            if self.call is not None:
                with user_code(f"the call hook {_name(self.call)}", f"call(model, {describe(batch)}, {describe(rngs)})",
                               self._expects(module)):
                    return self.call(bound, batch, rngs)
            kwargs: dict[str, Any] = {}
            if keyword is not None:
                kwargs[keyword] = batch["inputs_position"]
            for name, value in self.inputs.items():
                if isinstance(value, Input):
                    kwargs[name] = batch[name]
                else:
                    with user_code(f"computing input {name!r} with {_name(value)}", call_text("", [batch]),
                                   "an input function takes the batch and returns the argument"):
                        kwargs[name] = value(batch)
            kwargs.update(self.kwargs)
            if streams_kw and rngs:
                kwargs["rngs"] = _nnx().Rngs(**rngs)
            with user_code("the model call", call_text(f"{type(module).__name__}", [batch["inputs"]], kwargs),
                           self._expects(module)):
                return bound(batch["inputs"], **kwargs)

        return call

    def pick_logits(self, output: Any, batch: dict[str, Any]) -> jax.Array:
        """The logits [batch, length, vocab] out of the model's output; ProgramError when they are not."""
        pick = self.logits
        with user_code("picking the logits out of the model's output", describe(output),
                       "ModelProgram(logits=...) names them: an attribute or key, an index, or a function"):
            if callable(pick):
                logits = pick(output)
            elif isinstance(pick, str):
                logits = output[pick] if isinstance(output, Mapping) else getattr(output, pick)
            elif isinstance(pick, int):
                logits = output[pick]
            elif hasattr(output, "logits") and not hasattr(output, "shape"):
                logits = output.logits
            elif isinstance(output, (tuple, list)) and output:
                logits = output[0]
            else:
                logits = output
        tokens = batch["inputs"].shape
        if getattr(logits, "ndim", None) != 3 or tuple(logits.shape[:2]) != tuple(tokens) \
                or not jnp.issubdtype(logits.dtype, jnp.floating):
            raise ProgramError(f"the model's output {describe(output)} holds no float logits [batch, length, vocab] "
                               f"for tokens {describe(batch['inputs'])}; name them with ModelProgram(logits=...): an "
                               "attribute or key, an index, or a function of the output")
        return logits

    def train_step(self, model: core_state.Model, optimizer: Any, input_axes: Sequence[str | None] | None,
                   input_spec: PartitionSpec | None) -> Step:
        """The harness's next-token step over this model's call."""
        step = next_token_step(model.apply, optimizer, None, logits=self.pick_logits, streams=self.streams())
        fields = self.batch_fields()
        own = {name: f.logical_axes for name, f in fields.items()}
        shardings = {name: f.sharding for name, f in fields.items()}

        def placed(state: Any, batch: dict[str, jax.Array]) -> tuple[Any, Any]:
            return step(state, place_batch(batch, input_axes, input_spec, own, shardings))

        return placed


# --- level 2: the user's own init and step --------------------------------------------------------------

def _check_mesh_argument(owner: str, mesh: Any) -> None:
    """ProgramError naming `owner(mesh=...)` when `mesh` is neither None nor a mesh."""
    if mesh is not None and not isinstance(mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
        raise ProgramError(f"{owner}(mesh={describe(mesh)}): give the mesh the program runs on, a "
                           "jax.sharding.Mesh (Levanter's trainer.device_mesh) or AbstractMesh, or None")


@dataclasses.dataclass(frozen=True)
class TrainProgram:
    """The user's own training program: `init(key) -> state` (the full training state, parameters
    boxed with logical axes as linen's `with_logical_partitioning` or NNX variables' sharding metadata
    leave them, and the optimizer state built over them), `train_step(state, batch) -> (state,
    metrics)` (their loss, optimizer, remat, RNG handling) and the abstract `batch`, field name ->
    :class:`Input`. The harness runs `init` under `jax.eval_shape` on the case's mesh and rules,
    places each batch field (its logical axes, else the input layout) and traces `train_step` on the
    state with linen boxes removed (as a trainer unboxes before jit).

    `mesh`: the mesh the program runs on, when it sets it as a context rather than naming it in its
    shardings (Levanter's `with trainer:`, `jax.set_mesh(mesh)`, haliax's `named_jit` taking the mesh
    from that context): a traced init or step cannot set a mesh, so the harness traces them on the
    case's mesh and refuses, in one line naming both, a `mesh` other than it (axis names, sizes,
    types). A mesh set with `jax.set_mesh` while init is traced is held against the case's too."""

    init: Callable[[jax.Array], Any]
    train_step: Callable[[Any, dict[str, jax.Array]], tuple[Any, Any]]
    batch: Mapping[str, Input] = dataclasses.field(default_factory=lambda: dict(TOKEN_BATCH))
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None

    def __post_init__(self) -> None:
        """Every argument checked where it is given: one line naming it and what would be valid."""
        for name, fn, form in (("init", self.init, "init(key) -> state"),
                               ("train_step", self.train_step, "train_step(state, batch) -> (state, metrics)")):
            if not callable(fn):
                raise ProgramError(f"TrainProgram({name}={describe(fn)}): give a function {form}")
            if isinstance(fn, (nn.Module, _nnx().Module)) or hf_module(fn) is not None:
                raise ProgramError(f"TrainProgram({name}={describe(fn)}): a model, not a function {form}; a factory "
                                   "returns the model itself, or a ModelProgram of it, for the harness's own step")
        _check_mesh_argument("TrainProgram", self.mesh)
        if not isinstance(self.batch, Mapping) or not self.batch:
            raise ProgramError(f"TrainProgram(batch={describe(self.batch)}): give a non-empty mapping, field name -> "
                               "Input(shape, dtype, logical_axes), e.g. {'inputs': Input(), 'targets': Input()}")
        for name, field in self.batch.items():
            if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
                raise ProgramError(f"TrainProgram(batch=...): field name {shown(name)}: give a non-empty str of "
                                   "letters, digits, '_', '.' or '-' (it names the field in activation_shardings.json)")
            if not isinstance(field, Input):
                raise ProgramError(f"TrainProgram(batch=...): field {name!r} is {describe(field)}; give an "
                                   "Input(shape, dtype, logical_axes)")

    def legacy_mesh(self) -> contextlib.AbstractContextManager[None]:
        """The program's concrete `mesh` as the legacy `with mesh:` context while its init and step are
        traced (already held to the case's): EasyLM's and t5x's `pjit`, given bare PartitionSpecs, take
        their mesh from there, and jax places them on a concrete mesh only."""
        from sharding_dump.core.legacy_mesh import legacy_mesh

        return legacy_mesh(self.mesh) if isinstance(self.mesh, jax.sharding.Mesh) else contextlib.nullcontext()

    def batch_fields(self) -> dict[str, Input]:
        for name, field in self.batch.items():
            if not isinstance(field, Input):
                raise ProgramError(f"TrainProgram batch field {name!r} is {type(field).__name__}; the interface "
                                   "expects an Input(shape, dtype, logical_axes)")
            field.check(name)
        return dict(self.batch)

    def abstract_state(self, key: jax.Array) -> Any:
        """`init(key)` traced once, abstractly (call it inside the case's mesh and rules): see
        :meth:`placed_state`."""
        return self.placed_state(key)[0]

    def placed_state(self, key: jax.Array) -> tuple[Any, dict[str, PartitionSpec]]:
        """`init(key)` traced once, abstractly, and {leaf path: spec} of every leaf the program placed
        itself (`jit(out_shardings=)`, `reshard`, `device_put`, a constraint, or the sharding in its
        type on an Explicit mesh), each such leaf carrying that sharding in its type, on an Auto mesh
        as on an Explicit one (:mod:`sharding_dump.core.placement`). An init that places its state on
        a mesh of its own other than the current one is refused (:func:`~sharding_dump.core.handback.
        check_mesh`)."""
        from sharding_dump.core.handback import check_context_mesh, check_mesh
        from sharding_dump.core.placement import declared_specs, placed_outputs

        case = jax.sharding.get_abstract_mesh()
        check_context_mesh(self.mesh, case, "TrainProgram(mesh=...)")
        with user_code(f"the program's init {_name(self.init)}", call_text("init", [key]),
                       "init(key) returns the training state"), self.legacy_mesh():
            closed, shapes = jax.make_jaxpr(self.init, return_shape=True)(key)
        check_mesh(closed, case, f"the program's init {_name(self.init)}")
        if not jax.tree.leaves(shapes):
            raise ProgramError(f"the program's init {_name(self.init)} returned {describe(shapes)}, a state with no "
                               "arrays; the interface expects the training state: its parameters and optimizer state")
        return placed_outputs(shapes, declared_specs(closed), jax.sharding.get_abstract_mesh())

    def step(self, input_axes: Sequence[str | None] | None, input_spec: PartitionSpec | None) -> Step:
        """Their step, with the batch placed first and the state's linen boxes removed."""
        fields = self.batch_fields()
        own = {name: f.logical_axes for name, f in fields.items()}
        shardings = {name: f.sharding for name, f in fields.items()}

        def step(state: Any, batch: dict[str, jax.Array]) -> tuple[Any, Any]:
            state = unbox(state)
            batch = place_batch(batch, input_axes, input_spec, own, shardings)
            with user_code(f"the program's train_step {_name(self.train_step)}", call_text("train_step", [
                    ArgName("state"), batch]), "train_step(state, batch) returns (new state, metrics)"), self.legacy_mesh():
                out = self.train_step(state, batch)
            if not (isinstance(out, tuple) and len(out) == 2):
                raise ProgramError(f"the program's train_step {_name(self.train_step)} returned {describe(out)}; "
                                   "the interface expects a pair (new state, metrics)")
            check_step_output(_name(self.train_step), state, *out)
            return out

        return step


CACHE_DTYPES = ("auto", "bfloat16", "float32", "int8")  # auto: the program's own choice
_STEP_NAME = re.compile(r"[A-Za-z0-9_-]+")


@dataclasses.dataclass(frozen=True)
class ServingSettings:
    """What the server is sized for: `slots` requests decoded at once, prompts of up to
    `max_prefill_length` tokens, `max_length` tokens per request in the cache (prompt and generated),
    `page_size` tokens per cache page (0: one contiguous cache per slot) and the cache's dtype
    (`auto`: the program's own)."""

    slots: int
    max_prefill_length: int
    max_length: int
    page_size: int = 0
    cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        for name in ("slots", "max_prefill_length", "max_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ProgramError(f"ServingSettings({name}={shown(value)}): give a whole number >= 1")
        if self.max_prefill_length > self.max_length:
            raise ProgramError(f"ServingSettings(max_prefill_length={self.max_prefill_length}): longer than the cache "
                               f"(max_length={self.max_length}); a prompt must fit the cache")
        if not isinstance(self.page_size, int) or self.page_size < 0 or self.page_size and \
                self.max_length % self.page_size:
            raise ProgramError(f"ServingSettings(page_size={shown(self.page_size)}): give 0 (no pages) or a whole "
                               f"number that divides max_length={self.max_length}")
        if self.cache_dtype not in CACHE_DTYPES:
            raise ProgramError(f"ServingSettings(cache_dtype={shown(self.cache_dtype)}): give one of "
                               f"{', '.join(CACHE_DTYPES)}")

    def sizes(self) -> dict[str, int]:
        """The symbolic sizes an Input's shape may name."""
        return {"slots": self.slots, "prefill_length": self.max_prefill_length, "max_length": self.max_length}

    def header(self) -> dict[str, Any]:
        """As recorded at the top of the serving goldens."""
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class ServingStep:
    """One step of the server: `fn(state, inputs, settings) -> (new state, outputs)`.

    `inputs`: field name -> :class:`Input` (shapes in ints or `slots`, `prefill_length`,
    `max_length`); `requests`: how many requests one call serves (an int, or one of those sizes),
    which sets the bytes per request of what it hands on; `takes`: the name of an earlier step whose
    outputs this one receives under `inputs[takes]` (an insert takes the prefill's), as they came out."""

    fn: Callable[[Any, dict[str, Any]], tuple[Any, Any]]
    inputs: Mapping[str, Input] = dataclasses.field(default_factory=dict)
    requests: int | str = "slots"
    takes: str | None = None

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise ProgramError(f"ServingStep(fn={describe(self.fn)}): give a function fn(state, inputs, settings) -> "
                               "(new state, outputs)")
        if not isinstance(self.inputs, Mapping) or not all(
                isinstance(k, str) and isinstance(v, Input) for k, v in self.inputs.items()):
            raise ProgramError(f"ServingStep(inputs={describe(self.inputs)}): give a mapping, field name -> "
                               "Input(shape, dtype, logical_axes)")
        for name, field in self.inputs.items():
            for dim in field.shape:
                if isinstance(dim, str) and dim not in SERVING_SIZES:
                    raise ProgramError(f"ServingStep(inputs=...): field {name!r} shape entry {dim!r}: a serving "
                                       f"input's sizes are ints or one of {', '.join(SERVING_SIZES)}")
        requests = self.requests
        if not (isinstance(requests, str) and requests in SERVING_SIZES
                or isinstance(requests, int) and not isinstance(requests, bool) and requests >= 1):
            raise ProgramError(f"ServingStep(requests={shown(requests)}): give a whole number >= 1 or one of "
                               f"{', '.join(SERVING_SIZES)}")
        if self.takes is not None and not isinstance(self.takes, str):
            raise ProgramError(f"ServingStep(takes={shown(self.takes)}): give None or the name of an earlier step")

    def request_count(self, settings: ServingSettings) -> int:
        return settings.sizes()[self.requests] if isinstance(self.requests, str) else int(self.requests)


@dataclasses.dataclass(frozen=True)
class ServingProgram:
    """The user's server: `init(key, settings) -> state` (weights, KV cache, decode state, placed as
    the program places them) and `steps`, name -> :class:`ServingStep` (or a bare function with no
    inputs), in the order a request meets them (prefill, insert, generate; or one mixed step).
    `cache`: the top-level keys of the state that hold the KV cache (counted as cache in the goldens
    and in `check`). `mesh`: the mesh the server runs on when it sets it as a context rather than
    naming it in its shardings, held against the case's as :class:`TrainProgram`'s `mesh` is."""

    init: Callable[[jax.Array, ServingSettings], Any]
    steps: Mapping[str, ServingStep]
    cache: tuple[str, ...] = ("cache",)
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None

    def __post_init__(self) -> None:
        _check_mesh_argument("ServingProgram", self.mesh)
        if not callable(self.init):
            raise ProgramError(f"ServingProgram(init={describe(self.init)}): give a function init(key, settings) "
                               "-> state")
        if not isinstance(self.steps, Mapping) or not self.steps:
            raise ProgramError(f"ServingProgram(steps={describe(self.steps)}): give a non-empty mapping, step name "
                               "-> ServingStep(fn, inputs), e.g. {'prefill': ..., 'generate': ...}")
        steps: dict[str, ServingStep] = {}
        for name, step in self.steps.items():
            if not isinstance(name, str) or not _STEP_NAME.fullmatch(name):
                raise ProgramError(f"ServingProgram(steps=...): step name {shown(name)}: give letters, digits, "
                                   "'_' or '-'")
            if callable(step) and not isinstance(step, ServingStep):
                step = ServingStep(step)
            if not isinstance(step, ServingStep):
                raise ProgramError(f"ServingProgram(steps=...): step {name!r} is {describe(step)}; give a "
                                   "ServingStep(fn, inputs)")
            if step.takes is not None and step.takes not in steps:
                raise ProgramError(f"ServingProgram(steps=...): step {name!r} takes the outputs of "
                                   f"{step.takes!r}, which is not an earlier step ({', '.join(steps) or 'none'})")
            steps[name] = step
        object.__setattr__(self, "steps", steps)
        cache = (self.cache,) if isinstance(self.cache, str) else self.cache
        if not isinstance(cache, tuple) or not all(isinstance(c, str) and c for c in cache):
            raise ProgramError(f"ServingProgram(cache={describe(self.cache)}): give the top-level state keys that "
                               "hold the KV cache, e.g. ('cache',)")
        object.__setattr__(self, "cache", cache)


# --- tracing ------------------------------------------------------------------------------------------

Program = ModelProgram | TrainProgram

# --- Hugging Face Flax models -----------------------------------------------------------------------------

HF_PRETRAINED = "FlaxPreTrainedModel"  # transformers' base class of every Flax model a user holds


def hf_module(obj: Any) -> nn.Module | None:
    """The linen module of a Hugging Face Flax model: a `FlaxPreTrainedModel`'s `.module`, or such a
    module itself (a linen module defined in `transformers.models`); None for anything else. Read
    from the object's class, so transformers is never imported here."""
    if any(cls.__name__ == HF_PRETRAINED for cls in type(obj).__mro__) and isinstance(
            getattr(obj, "module", None), nn.Module):
        return obj.module
    if isinstance(obj, nn.Module) and type(obj).__module__.startswith("transformers.models."):
        return obj
    return None


def hf_program(module: nn.Module) -> ModelProgram:
    """A Hugging Face Flax module called as HF's own Flax training scripts call it (run_clm_flax):
    `input_ids`, an all-ones `attention_mask` (a batch of full sequences), `position_ids`, dropout
    on (`deterministic=False`, the `dropout` stream); the logits are the output's `.logits`."""
    return ModelProgram(module, positions="position_ids",
                        inputs={"attention_mask": _all_ones}, kwargs={"deterministic": False})


def _all_ones(batch: dict[str, Any]) -> jax.Array:
    return jnp.ones_like(batch["inputs"])


def check_step_output(name: str, state: Any, new_state: Any, metrics: Any) -> None:
    """ProgramError naming the first leaf of the step's output that is not what the next step could
    take: a new state of another tree than the state given, a leaf of another shape or dtype, or a
    leaf (of the state, or of the metrics) that is no array."""
    what = f"the program's train_step {name} returned"
    expects = "the interface expects the new state to have the tree, shapes and dtypes of the state it was given"
    if jax.tree.structure(new_state) != jax.tree.structure(state):
        old_paths = {path_text(k) for k, _ in jax.tree_util.tree_leaves_with_path(state)}
        new_paths = {path_text(k) for k, _ in jax.tree_util.tree_leaves_with_path(new_state)}
        differs = sorted(old_paths ^ new_paths)
        first = f": {'missing' if differs[0] in old_paths else 'new'} leaf {differs[0]}" if differs else ""
        raise ProgramError(f"{what} a state of another tree than init's{first}; {expects}")
    for (key, old), new in zip(jax.tree_util.tree_leaves_with_path(state), jax.tree.leaves(new_state)):
        path = path_text(key) or "(the state)"
        if not (hasattr(new, "shape") and hasattr(new, "dtype")):
            raise ProgramError(f"{what} {describe(new)} at {path}, not an array; {expects}")
        if tuple(new.shape) != tuple(old.shape) or new.dtype != old.dtype:  # a PRNG key's too
            raise ProgramError(f"{what} {describe(new)} at {path}, where the state it was given holds "
                               f"{describe(old)}; {expects}")
    for key, leaf in jax.tree_util.tree_leaves_with_path(metrics):
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")) and not isinstance(leaf, (int, float, complex)):
            raise ProgramError(f"{what} metrics with {describe(leaf)} at {path_text(key) or '(the metrics)'}, not an "
                               "array or a number; the interface expects metrics of arrays, e.g. {'loss': loss}")


def as_program(obj: Any, name: str = "") -> Program:
    """A ModelProgram, TrainProgram or ServingProgram as given, or a module / module factory as `ModelProgram(obj)`.
    A factory is run once (under `nnx.eval_shape`: an NNX module it builds comes back abstract); a
    ModelProgram whose model it built as an NNX module gets that module back abstract too."""
    from flax import nnx

    if isinstance(obj, (ModelProgram, TrainProgram, ServingProgram)):
        return obj
    if hf_module(obj) is not None:
        return hf_program(hf_module(obj))
    if isinstance(obj, (nn.Module, nnx.Module)):
        return ModelProgram(obj)
    if not callable(obj):
        raise ProgramError(f"model {name or _name(obj)} is a {type(obj).__name__}; the interface expects a Flax "
                           "module, a ModelProgram or TrainProgram, or a zero-argument function returning one")
    held: list[ModelProgram] = []
    other: list[Any] = []

    def build() -> Any:
        built = obj()
        if isinstance(built, nnx.Module):
            return built
        if isinstance(built, ModelProgram) and isinstance(built.model, nnx.Module):
            held.append(built)
            return built.model
        other.append(built)
        return None

    with user_code(f"the model factory {name or _name(obj)}", "no arguments",
                   "a factory takes no arguments and returns a Flax module, a ModelProgram, a TrainProgram or a "
                   "ServingProgram"):
        with nnx.use_eager_sharding(False):
            try:
                abstract = nnx.eval_shape(build)
            except ValueError as err:  # a factory that sets its mesh (flax's Gemma trainer builds its model
                if not says(err, "set_mesh"):  # under jax.set_mesh), which jax refuses inside the trace of
                    raise  # nnx.eval_shape, is run as it is: it builds its state outside any trace
                held.clear()
                other.clear()
                abstract = build()
    if held:
        return dataclasses.replace(held[0], model=abstract)
    built = other[0] if other else abstract
    if isinstance(built, (ModelProgram, TrainProgram, ServingProgram)):
        return built
    if hf_module(built) is not None:
        return hf_program(hf_module(built))
    if isinstance(built, (nn.Module, nnx.Module)):
        return ModelProgram(built)
    raise ProgramError(f"the model factory {name or _name(obj)} returned {type(built).__name__}; the interface "
                       "expects a Flax linen or NNX module, a Hugging Face FlaxPreTrainedModel, a ModelProgram or a "
                       "TrainProgram")


def _nnx() -> Any:
    from flax import nnx

    return nnx


def _parameters(target: Any) -> tuple[str, ...]:
    fn = target.__call__ if isinstance(target, nn.Module) else type(target).__call__
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return ()


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def boxed_view(state: Any) -> Any:
    """The state with every NNX variable that has sharding metadata as a flax `Partitioned` box over
    its value (others as their value), so that layouts read logical axes from linen and NNX alike."""
    nnx = core_state.loaded_nnx()
    if nnx is None:  # no NNX variable exists yet: a linen state is its own view
        return state

    def box(leaf: Any) -> Any:
        if not isinstance(leaf, nnx.Variable):
            return leaf
        names = leaf.get_metadata().get("out_sharding")
        value = leaf.get_value()
        return nn.Partitioned(value, names=tuple(names)) if names else value

    return jax.tree.map(box, state, is_leaf=lambda x: isinstance(x, nnx.Variable) or is_box(x))
