"""From a Case to its golden documents: topology -> rule -> mesh -> model -> state -> JSON.

>>> from sharding_dump.zoo.case import Case
>>> docs = dump_case(Case.make("qwen3-0.6b", "tpu7x-16", "pure-fsdp"))
>>> sorted(docs)
['activation_shardings.json', 'logical_shardings.json', 'named_shardings.json']
>>> docs["named_shardings.json"]["tensors"]["model/token_embedder/embedding"]["partition_spec"]
[None, 'fsdp']
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any

from jax.extend.core import ClosedJaxpr
from jax.sharding import PartitionSpec

from sharding_dump import models
from sharding_dump.core import documents, specs
from sharding_dump.core.capture import Constraint, Recording, read_constraints, resolved, trace
from sharding_dump.core.gc_policy import fewer_collections
from sharding_dump.core.handback import HandBack, check_mesh, demanded, hand_backs, returned
from sharding_dump.core.layout import TensorLayout, indivisible, typed_layouts
from sharding_dump.core.legacy_mesh import legacy_mesh
from sharding_dump.core.optimizer import state_with_slots
from sharding_dump.core.placement import box_named_arrays, box_params_axes, placed
from sharding_dump.core.program import ModelProgram, TrainProgram, boxed_view
from sharding_dump.core.state import SEGMENT_FIELD, Model, abstract_key, abstract_train_state, as_model, explicit_train_state
from sharding_dump.core.step import BATCH_FIELDS, Step, next_token_step
from sharding_dump.errors import BadInput, ProgramLayoutWarning, UnevenSplitWarning
from sharding_dump.golden import codec
from sharding_dump.models.pipeline import PipelineConfig
from sharding_dump.zoo import cards, optimizers, releases, rules, serving, settings, state
from sharding_dump.zoo.batch import BatchPlan, plan_batch
from sharding_dump.zoo.cards import card_path
from sharding_dump.zoo.case import Case
from sharding_dump.zoo.mesh import MeshPlan, plan_mesh
from sharding_dump.zoo.model_ref import factory_program
from sharding_dump.zoo.pipeline_plan import check_batch, pipeline_rules, plan_pipeline, stage_before_data
from sharding_dump.zoo.topology import Topology, load_topology


@dataclasses.dataclass(frozen=True)
class CaseSetup:
    """Everything resolved for one case (in explicit mode, after a check of the traced init)."""

    case: Case
    topology: Topology
    rule_set: rules.RuleSet  # the rule file with the model card's rules merged in
    values: dict[str, Any]  # effective settings
    plan: MeshPlan
    config: models.ModelConfig | None  # None for a user's factory model
    batch: BatchPlan
    pipeline: PipelineConfig | None = None  # the built-in model's pipeline schedule, when `stage` > 1
    server: Any = None  # a card served (serving=true): the ZooServer that builds its ServingProgram

    @property
    def optimizer(self) -> Any:
        """The case's optax optimizer: MaxText's `opt_type` or the user's own `optimizer=`."""
        return optimizers.case_optimizer(self.values)

    @property
    def explicit(self) -> bool:
        """shard_mode=explicit: the state is traced on an Explicit-axis mesh."""
        return self.values["shard_mode"] == "explicit"

    @property
    def step_explicit(self) -> bool:
        """The training step too runs on the Explicit-axis mesh: a user's program in explicit mode (a
        model with sharding in types needs it; the zoo's step stays on the Auto mesh)."""
        return self.explicit and self.config is None

    def step_mesh(self) -> Any:
        """The abstract mesh the training step is traced on."""
        return self.plan.abstract_mesh(explicit=self.step_explicit)

    def step_inputs(self) -> tuple[Any, ...]:
        """Everything the traced training step depends on: setups that agree on it trace the same step,
        once per process (a card's explicit-mode case and its auto twin agree: the zoo's step runs on
        the Auto mesh)."""
        return self._step_inputs(self.rule_set)

    def shared_step_inputs(self) -> tuple[Any, ...] | None:
        """The step inputs but the rule file, for a card's step: the rules reach the trace only as
        flax's logical axis rules, and where nothing but `constrain()` reads them the trace is the same
        under any rule file that has rules (:func:`sharding_dump.core.capture.resolved`). None for a
        user's program, whose reading also takes physical layouts out of the jaxpr."""
        if self.config is None:
            return None
        return self._step_inputs(bool(self.rule_set.logical_axis_rules))

    def _step_inputs(self, rules: Any) -> tuple[Any, ...]:
        factory = self.case.model if self.config is None else None
        return (factory, self.config, self.pipeline, self.optimizer, self.batch, self.plan, rules, self.step_explicit)


def setup_case(case: Case) -> CaseSetup:
    """Resolves topology, rules, settings, mesh and model config; BadInput on anything invalid."""
    topology = load_topology(case.topology, case.num_slices)
    rule_set = case.rule_set()
    mesh_defaults = rule_set.mesh_settings_for(topology.name)
    card_defaults = cards.card_settings(case.model) if case.model_ref.kind != "factory" else {}
    values = settings.resolve(case.overrides, card_defaults, mesh_defaults)
    explicit = frozenset(mesh_defaults) | frozenset(k for k, _ in case.overrides)
    plan = plan_mesh(rule_set, topology, values, explicit)
    serving.check_settings(case)
    server = None
    if case.model_ref.kind == "factory":
        config, pipeline = None, None
        _check_factory_settings(case, values, plan)
    else:
        nnx = releases.nnx_build(values)
        config = cards.load_config(case.model, weight_dtype=values["weight_dtype"],
                                   sparse_matmul=values["sparse_matmul"], segment_ids=nnx,
                                   outside_pipeline=case.release.outside_pipeline if nnx else (), **case.release.model)
        releases.check_build(case.release, nnx, values["shard_optimizer_over_data"],
                             config.decoder_block, plan.sizes.get("tensor", 1), stages=plan.sizes.get("stage", 1))
        rule_set = rules.with_overrides(rule_set, config.logical_axis_rules, source=card_path(case.model))
        pipeline = plan_pipeline(values, plan, rule_set, cards.pipelined_stack_length(config))
        if pipeline is not None:
            rule_set = pipeline_rules(rule_set)
            plan = stage_before_data(plan)
        if serving.serves(case):
            server = serving.zoo_server(config, values, plan.sizes.get("stage", 1))
    if values["shard_optimizer_over_data"] and state.DATA_AXIS not in plan.axis_names:
        raise BadInput(f"shard_optimizer_over_data=true: rule '{rule_set.name}' has no 'data' mesh axis "
                       f"(mesh_axes: {', '.join(plan.axis_names)})")
    optimizers.check(values, config.decoder_block if config is not None else None, case.model)
    releases.check_case(case.release, values, config, plan.sizes, _kv_head_axes(config, rule_set))
    optimizers.case_optimizer(values)  # a user's optimizer that cannot be built fails here, before any trace
    batch = plan_batch(rule_set, plan, values)
    if pipeline is not None:
        check_batch(pipeline, batch.global_batch_size)
    setup = CaseSetup(case, topology, rule_set, values, plan, config, batch, pipeline, server)
    if setup.explicit:
        _check_even_splits(setup)
    return setup


def _kv_head_axes(config: models.ModelConfig | None, rule_set: rules.RuleSet) -> tuple[str, ...]:
    """The mesh axes the rules place the kv_heads dimension of a key projection on (MaxText's kernel axes
    (embed, kv_heads, kv_head_dim)); () for a user's model."""
    if config is None:
        return ()
    from sharding_dump.core.layout import resolve

    return specs.entry_axes(resolve((config.attention_embed_axis, "kv_heads", "kv_head_dim"), rule_set)[1])


# Settings that only a built-in model (built from a card) can honour.
CARD_ONLY_SETTINGS = ("weight_dtype", "sparse_matmul", "num_pipeline_microbatches", "num_pipeline_repeats",
                      "pipeline_parallel_layers")


def _check_factory_settings(case: Case, values: dict[str, Any], plan: MeshPlan) -> None:
    """A user's model is built by its own factory: settings that shape a built-in model do not apply."""
    given = [key for key, _ in case.overrides if key in CARD_ONLY_SETTINGS]
    if given:
        raise BadInput(f"{given[0]}: applies to built-in models only; model {case.model!r} is built by its own "
                       "factory (set it there)")
    if plan.sizes.get("stage", 1) > 1:
        raise BadInput(f"stage axis of size {plan.sizes['stage']}: pipeline parallelism is built into the zoo's "
                       f"layer stacks; model {case.model!r} is a user factory (size the stage axis 1)")
    chosen = [f"{key}={values[key]}" for key, _ in case.overrides if key in ("optimizer", "opt_type")]
    if chosen and isinstance(factory_program(case.model), TrainProgram):
        raise BadInput(f"{chosen[0]}: model {case.model!r} is a TrainProgram, whose own train_step runs its "
                       "optimizer (set it there)")


def _check_even_splits(setup: CaseSetup) -> None:
    """Explicit mode rejects a dimension that does not split evenly over its mesh axes (auto mode
    pads it): say which one, before anything is traced on the Explicit mesh."""
    if serving.serves(setup.case):  # traced on the Auto mesh: Explicit refuses uneven splits
        layouts = list(serving.init_layouts(serving.program_key(setup), setup.plan, setup.rule_set, False,
                                            serving.settings_of(setup.values, setup.batch.global_batch_size),
                                            False)[1])
    elif _own_init(setup):  # a user's own init is traced once, on the case's Explicit mesh: the state the dump reads
        layouts = _own_layouts(setup)
    else:
        auto = _abstract_state(setup.config, setup.optimizer, setup.pipeline) if setup.config is not None else \
            _factory_state(setup.case.model, setup.plan, setup.rule_set, False, setup.optimizer)
        layouts = state.tensor_layouts(maxtext_state(setup, layout_view(setup, auto)), setup.plan, setup.rule_set,
                                       setup.values["shard_optimizer_over_data"])
    params_first = _uneven_params_first(layouts)
    for layout, dim in params_first[:1]:
        spec = specs.spec_to_json(layout.partition_spec, len(layout.shape))[dim]
        raise BadInput(f"shard_mode=explicit: {layout.path} dimension {dim} (size {layout.shape[dim]}) does not "
                       f"split evenly over {spec} ({layout.shards(dim)} shards); explicit mode needs even "
                       f"splits (shard_mode=auto pads them)")


# A process that handles a whole matrix (`check --all`, a test session) builds each state and traces each
# step once: the caches hold every case of a matrix (a state or a recording is shapes only, not arrays).
CASES_PER_PROCESS = 256


@functools.lru_cache(maxsize=CASES_PER_PROCESS)
def _abstract_state(config: models.ModelConfig, tx: Any, pipeline: PipelineConfig | None) -> dict[str, Any]:
    # Shapes only depend on the config, optimizer and pipeline; cases of one model share the traced init.
    return state.abstract_state(config, tx, pipeline)


@functools.lru_cache(maxsize=16)
def program_model(ref: str) -> Model:
    """The model of a factory's ModelProgram as the core drives it, built once per process."""
    program = factory_program(ref)
    assert isinstance(program, ModelProgram)
    return program.model_of()


@functools.lru_cache(maxsize=CASES_PER_PROCESS)
def _factory_state(ref: str, plan: MeshPlan, rules: rules.RuleSet, explicit: bool, tx: Any) -> Any:
    """The abstract state of a user's model on the plan's mesh under the rule file (its logical rules,
    and in explicit mode its path rules too); for a TrainProgram, (its own init's state, {leaf path:
    the spec it placed that leaf on}), traced once."""
    program = factory_program(ref)
    mesh = plan.abstract_mesh(explicit=explicit)
    if isinstance(program, TrainProgram):
        import flax.linen as nn
        import jax

        from sharding_dump.core.layout import rules_of

        key = abstract_key()
        with jax.sharding.use_abstract_mesh(mesh), legacy_mesh(mesh), nn.logical_axis_rules(rules_of(rules)):
            return program.placed_state(key)
    model = program_model(ref)
    if explicit:
        return explicit_train_state(model, mesh, rules, tx)
    return abstract_train_state(model.abstract_params(mesh, rules), tx)


def _own_init(setup: CaseSetup) -> bool:
    """The case's state comes from the user's own init (a TrainProgram)."""
    return setup.config is None and isinstance(factory_program(setup.case.model), TrainProgram)


def layout_view(setup: CaseSetup, train_state: Any) -> Any:
    """The state as layouts read it: NNX variables boxed like linen's, and for a TrainProgram (whose
    own init built its optimizer state over boxed parameters) every optimizer leaf re-derived from its
    parameter, as the harness derives its own."""
    view = boxed_view(train_state)
    if _own_init(setup):
        view = state_with_slots(box_params_axes(box_named_arrays(view)))
    return view


def _own_traced(setup: CaseSetup) -> tuple[Any, dict[str, Any]]:
    """A TrainProgram's state, traced once on the case's mesh, and what its init placed itself."""
    return _factory_state(setup.case.model, setup.plan, setup.rule_set, setup.explicit,
                          setup.optimizer)


def _own_layouts(setup: CaseSetup) -> list[TensorLayout]:
    """A TrainProgram's state leaf by leaf: what its init placed itself, else its boxes, params_axes
    and the rule file's path rules."""
    raw, declared = _own_traced(setup)
    return state.tensor_layouts(layout_view(setup, raw), setup.plan, setup.rule_set,
                                setup.values["shard_optimizer_over_data"], declared)


def abstract_state_of(setup: CaseSetup) -> Any:
    """The abstract training state of the case's model: a card's (boxed), or a user program's, whose
    init runs under the case's mesh and rules as it would in training (on the Explicit-axis mesh in
    explicit mode, each leaf then carrying its sharding: for a TrainProgram, the layout the dump
    gives it, as a trainer places its state before the step)."""
    if setup.config is not None:
        return _abstract_state(setup.config, setup.optimizer, setup.pipeline)
    if not _own_init(setup):
        return _factory_state(setup.case.model, setup.plan, setup.rule_set, setup.explicit,
                              setup.optimizer)
    raw, _ = _own_traced(setup)
    if not setup.explicit:
        return raw
    return placed(raw, {t.path: t.partition_spec for t in _own_layouts(setup)}, setup.step_mesh())


def header(setup: CaseSetup) -> dict[str, Any]:
    """The part every golden file of the case starts with."""
    return {
        "case": setup.case.header(),
        "mesh": {"axis_names": list(setup.plan.axis_names), "axis_sizes": list(setup.plan.shape),
                 "shard_mode": setup.values["shard_mode"]},
    }


def case_layouts(case: Case) -> tuple[CaseSetup, list[TensorLayout]]:
    """The resolved case and the layout of every leaf of its training state (auto mode: from the
    rules; explicit mode: read from the state traced on an Explicit-axis mesh)."""
    setup = setup_case(case)
    over_data = setup.values["shard_optimizer_over_data"]
    if serving.serves(case):  # weights, KV cache and decode state, as init placed them
        return setup, list(serving.traced_of(setup).layouts)
    if setup.explicit and setup.config is not None:
        traced = state.explicit_state(setup.config, setup.plan, setup.rule_set, over_data, setup.optimizer,
                                      setup.pipeline, releases.nnx_build(setup.values))
        return setup, state.typed_state_layouts(maxtext_state(setup, traced), setup.plan)
    if _own_init(setup):  # what the program placed itself, then the rules
        return setup, _own_layouts(setup)
    boxed = layout_view(setup, abstract_state_of(setup))
    if setup.explicit:
        return setup, typed_layouts(boxed, setup.plan.sizes, setup.rule_set)
    return setup, state.tensor_layouts(maxtext_state(setup, boxed), setup.plan, setup.rule_set, over_data)


def maxtext_state(setup: CaseSetup, boxed: Any) -> Any:
    """A card's boxed state as the MaxText build the case's settings choose lays it out: the Linen
    build's {'params', 'opt_state', 'step'} as it is, the NNX build's (releases.nnx_build) assembled by
    state.nnx_state with the RNG state of the modules data/maxtext_releases.yml names for its decoder
    block. A user's own model is no MaxText build: as it is."""
    if setup.config is None or not releases.nnx_build(setup.values):
        return boxed
    rel = setup.case.release
    bias_state = setup.config.routed_bias and rel.bias_is_state(setup.config.name)
    return state.nnx_state(boxed, state.rng_modules(boxed["params"], rel.rng_modules(cards.block_lineage(setup.config.decoder_block))),
                           rel.rng_streams, rel.rng_key_impl, bias_state, _opt_state_without_bias(boxed, setup.optimizer)
                           if bias_state else None)


def _opt_state_without_bias(boxed: Any, tx: Any) -> Any:
    """The optimizer state over the parameters but the routed biases (state.model_state_bias): the
    structure `tx` gives them, each leaf the one `boxed`'s optimizer state already holds at its path
    (as placed: in explicit mode each carries the sharding its slot was given, which a second
    `tx.init` would not keep on every jax release)."""
    import jax

    from sharding_dump.core.tree import is_box, path_text

    placed = {path_text(key): leaf for key, leaf in
              jax.tree_util.tree_leaves_with_path(boxed["opt_state"], is_leaf=is_box)}
    structure = abstract_train_state(state.model_state_bias(boxed["params"]), tx)["opt_state"]
    return jax.tree_util.tree_map_with_path(lambda key, leaf: placed.get(path_text(key), leaf), structure,
                                            is_leaf=is_box)


def _uneven_params_first(layouts: list[TensorLayout]) -> list[tuple[TensorLayout, int]]:
    """The (leaf, dimension) pairs that split unevenly, parameters before optimizer slots (the one
    worth naming first)."""
    return sorted(indivisible(layouts), key=lambda item: item[0].group not in specs.PARAMETER_PARTS)


def warn_uneven(setup: CaseSetup, layouts: list[TensorLayout]) -> None:
    """Warns (UnevenSplitWarning) when any leaf of the case splits unevenly, naming one (a parameter
    when there is one); `sharding-dump check` lists them all."""
    uneven = _uneven_params_first(layouts)
    if not uneven:
        return
    layout, dim = uneven[0]
    count = len({t.path for t, _ in uneven})
    over = " x ".join(f"{a}={setup.plan.sizes[a]}" for a in layout.axes(dim) if setup.plan.sizes[a] > 1)
    warnings.warn(UnevenSplitWarning(
        f"{setup.case.label}: {count} lea{'f does' if count == 1 else 'ves do'} not split evenly over their mesh "
        f"axes (the last shard is padded), e.g. {layout.path} dimension {dim} ({layout.logical_axes[dim]}) of "
        f"size {layout.shape[dim]} over {over} = {layout.shards(dim)} shards; `sharding-dump check` lists them"),
        stacklevel=2)


STEP_ENDS = ("taken", "returned")  # where a step may lay the state out otherwise: as it takes it, as it returns it


def handed_back(setup: CaseSetup, layouts: list[TensorLayout]) -> dict[str, list[HandBack]]:
    """The state leaves the case's step takes in (`taken`: its jit's in_shardings, a constraint on
    the state at its top) or hands back in (`returned`) another layout than the state holds them in."""
    reading = step_reading(setup)
    out = {}
    for end in STEP_ENDS:
        given = dict(getattr(reading, end))
        went = [t for t in layouts if t.path in given]
        out[end] = hand_backs([given[t.path] for t in went], [(t.path, t.shape, t.dtype, t.partition_spec) for t in went],
                              setup.plan.sizes)
    return out


def program_batch(setup: CaseSetup) -> dict[str, tuple[specs.SpecJson, specs.SpecJson]]:
    """{batch field: (the program's spec, the rule file's data_sharding)} of every field the program
    takes in a layout of its own: the one its step demands (its jit's in_shardings, a constraint or
    reshard at its top), else its own data sharding (`Input(sharding=...)`)."""
    fields = case_batch(setup)
    declared = {name: field.sharding for name, field in batch_fields(setup.case).items()
                if field is not None and field.sharding is not None}
    own = {**{name: getattr(s, "spec", s) for name, s in declared.items()}, **dict(step_reading(setup).batch)}
    return {name: (specs.spec_to_json(spec, fields[name].ndim),
                   specs.spec_to_json(setup.batch.pipeline_spec, fields[name].ndim))
            for name, spec in own.items()}


def warn_program_layouts(setup: CaseSetup, backs: dict[str, list[HandBack]],
                         batch: dict[str, tuple[specs.SpecJson, specs.SpecJson]]) -> None:
    """Says aloud (ProgramLayoutWarning) where the program lays out otherwise than the case: its batch
    against the rule file's data_sharding, and the state its step takes or hands back."""
    sizes = setup.plan.sizes
    for name, (own, rule) in sorted(batch.items()):
        if specs.spec_to_json(own, len(own), sizes) != specs.spec_to_json(rule, len(rule), sizes):
            warnings.warn(ProgramLayoutWarning(
                f"{setup.case.label}: the program's step takes batch field {name!r} on {own}, where the rule file's "
                f"data_sharding places it on {rule}; the golden holds the program's"), stacklevel=2)
    for end, does in zip(STEP_ENDS, ("takes", "hands back")):
        if backs[end]:
            first, count = backs[end][0], len(backs[end])
            warnings.warn(ProgramLayoutWarning(
                f"{setup.case.label}: the step {does} {count} state lea{'f' if count == 1 else 'ves'} in another "
                f"layout than the state holds {'it' if count == 1 else 'them'} in, resharded every step, e.g. "
                f"{first.path} {first.went_in} -> {first.came_back}; `sharding-dump check` lists them"), stacklevel=2)


def dump_case(case: Case) -> dict[str, dict[str, Any]]:
    """Every golden document of `case`, keyed by file name (UnevenSplitWarning when a leaf splits
    unevenly, ProgramLayoutWarning where the program lays out otherwise than the case). A user's
    program adds to the activations' header what it decides itself: `batch.program_spec`, the layout
    it takes each batch field in, and `taken` and `returned`, the layout of every state leaf its step
    takes or hands back otherwise than the state holds it."""
    with fewer_collections():
        setup, layouts = case_layouts(case)
        warn_uneven(setup, layouts)
        if serving.serves(case):
            return serving.serving_documents(serving.traced_of(setup), header(setup), setup.plan.abstract_mesh())
        constraints = trace_activations(setup)
        backs, batch = handed_back(setup, layouts), program_batch(setup)
        warn_program_layouts(setup, backs, batch)
    step_header: dict[str, Any] = {"batch": setup.batch.header()}
    if batch:
        step_header["batch"]["program_spec"] = {name: own for name, (own, _) in sorted(batch.items())}
    for end in STEP_ENDS:
        if backs[end]:
            step_header[end] = {back.path: back.came_back for back in backs[end]}
    return documents.golden_documents(layouts, setup.plan.abstract_mesh(), constraints, header=header(setup),
                                      activation_header=step_header)


def case_model(setup: CaseSetup) -> Model:
    """The zoo model of a card case as the core drives it."""
    assert setup.config is not None
    return as_model(cards.build_model(setup.config, setup.pipeline))


def case_step(setup: CaseSetup) -> Step:
    """One training step of the case: a card's or a ModelProgram's next-token step (batch placed on the
    rule's input axes, else the data pipeline's layout; forward, backward, optimizer update), or a
    TrainProgram's own step."""
    axes, spec = setup.batch.logical_axes, None if setup.batch.logical_axes else setup.batch.pipeline_spec
    if setup.config is not None:
        return next_token_step(case_model(setup).apply, setup.optimizer, axes, input_spec=spec)
    program = factory_program(setup.case.model)
    if isinstance(program, TrainProgram):
        return program.step(axes, spec)
    return program.train_step(program_model(setup.case.model), setup.optimizer, axes, spec)


def batch_fields(case: Case) -> dict[str, Any]:
    """The batch fields of the case's step: the token fields of a card (with their segment ids in
    MaxText's NNX build, whose attention constrains them), a program's own (its Input per name; None
    for a card's token fields)."""
    if serving.serves(case):  # no training batch: each step has inputs of its own
        return {}
    if case.model_ref.kind == "factory":
        return factory_program(case.model).batch_fields()
    segments = (SEGMENT_FIELD,) if releases.nnx_build(dict(case.overrides)) else ()
    return {name: None for name in BATCH_FIELDS + segments}


def case_batch(setup: CaseSetup) -> dict[str, Any]:
    """The abstract batch of the case: the token fields, or a program's own; on an Explicit-axis mesh
    each field carries the data pipeline's layout in its type."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    fields = batch_fields(setup.case)
    out = {}
    for name, field in fields.items():
        abstract = field.abstract(*setup.batch.shape) if field is not None else \
            jax.ShapeDtypeStruct(setup.batch.shape, "int32")
        if setup.step_explicit:
            spec = (tuple(setup.batch.pipeline_spec) + (None,) * abstract.ndim)[:abstract.ndim]
            abstract = jax.ShapeDtypeStruct(abstract.shape, abstract.dtype,
                                            sharding=NamedSharding(setup.step_mesh(), PartitionSpec(*spec)))
        out[name] = abstract
    return out


def trace_case(setup: CaseSetup) -> tuple[ClosedJaxpr, Recording]:
    """The jaxpr of one training step of the case's model on its abstract mesh, and its recording."""
    return trace(case_step(setup), abstract_state_of(setup), case_batch(setup),
                 mesh=setup.step_mesh(), rules=setup.rule_set)


def trace_activations(setup: CaseSetup) -> tuple[Constraint, ...]:
    """Every activation constraint of one training step of the case's model on its mesh (traced once
    per process for setups with equal step inputs: the golden dump and `check` of a case share it), as
    the case's MaxText build records them: its NNX build records a pipeline stage's own constraints at
    the stage's shape (see :func:`per_stage`)."""
    constraints = step_reading(setup).constraints
    if setup.config is None or not releases.nnx_build(setup.values):
        return constraints
    return tuple(per_stage(c) for c in constraints)


def per_stage(constraint: Constraint) -> Constraint:
    """A constraint placed inside a vmap (a pipeline's stages, vmapped over `stage`) as the function the
    vmap runs placed it: without the leading dimensions the vmap added (`Constraint.vmapped`, the traced
    rank less the rank its constrain() call saw; fewer logical axes than dimensions only leave the last ones
    free, as Qwen3-Next's attention output). MaxText's NNX build records a stage's activations so, where its
    Linen build records none. Any other constraint is returned as it is."""
    added = constraint.vmapped
    if added <= 0:
        return constraint
    spec = tuple(constraint.partition_spec) + (None,) * (len(constraint.shape) - len(constraint.partition_spec))
    return dataclasses.replace(constraint, shape=constraint.shape[added:], partition_spec=PartitionSpec(*spec[added:]))


@dataclasses.dataclass(frozen=True)
class StepReading:
    """What one traced training step of the case holds: its activation placements, and what a user's
    program decides in it (:mod:`sharding_dump.core.handback`): (state leaf, spec) pairs of the
    layouts its step takes the state in and hands it back in where it declares them, and (batch
    field, spec) of the layouts it demands of its batch."""

    constraints: tuple[Constraint, ...]
    taken: tuple[tuple[str, PartitionSpec], ...] = ()
    returned: tuple[tuple[str, PartitionSpec], ...] = ()
    batch: tuple[tuple[str, PartitionSpec], ...] = ()


def step_reading(setup: CaseSetup) -> StepReading:
    """The case's traced step read once per process (see :func:`trace_activations`); a card's step
    whose rules nothing but `constrain()` read is traced once for every rule file (same model, batch
    and mesh), each case's constrain() specs resolved under its own rules."""
    free = setup.shared_step_inputs()
    shared = _rule_free(_StepOf(free, setup)) if free is not None else None
    if shared is not None:
        return dataclasses.replace(shared, constraints=resolved(shared.constraints, setup.rule_set))
    return _recorded(_StepOf(setup.step_inputs(), setup))[0]


@dataclasses.dataclass(frozen=True)
class _StepOf:
    inputs: tuple[Any, ...]  # the cache key
    setup: CaseSetup = dataclasses.field(compare=False)


@functools.lru_cache(maxsize=CASES_PER_PROCESS)
def _rule_free(step: _StepOf) -> StepReading | None:
    """The reading of the first case with these rule-free step inputs, when its trace read its rules
    only in constrain() (so any rule file gives the same trace); None when something else read them
    (a MoE dispatch's shard_map specs, a pipeline's stage rules): then each rule file is traced."""
    reading, rules_read = _recorded(_StepOf(step.setup.step_inputs(), step.setup))
    return None if rules_read else reading


@functools.lru_cache(maxsize=CASES_PER_PROCESS)
def _recorded(step: _StepOf) -> tuple[StepReading, bool]:
    """The step's reading, and whether anything but constrain() read its rules."""
    setup = step.setup
    closed, rec = trace_case(setup)
    constraints = tuple(read_constraints(closed, rec))
    if setup.config is not None:  # the zoo's own step decides nothing the rule file does not
        return StepReading(constraints), rec.rules_read
    import jax

    from sharding_dump.core.tree import path_text

    check_mesh(closed, setup.step_mesh(), "the program's step")
    state = [path_text(key) for key, _ in jax.tree_util.tree_leaves_with_path(abstract_state_of(setup))]
    back = tuple((path, spec) for path, spec in zip(state, returned(closed, len(state))) if spec is not None)
    taken = tuple((state[i], spec) for i, spec in demanded(closed, range(len(state)), placements=False).items())
    fields = [path_text(key) for key, _ in jax.tree_util.tree_leaves_with_path(case_batch(setup))]
    batch = []
    for index, name in enumerate(fields, start=len(state)):
        skip = f"activation:{name}@{rec.token}."  # the harness's own placement of the field, made first
        batch += [(name, spec) for spec in demanded(closed, [index], skip).values()]
    return StepReading(constraints, taken, back, tuple(batch)), rec.rules_read


def render_case(case: Case) -> dict[str, bytes]:
    """The exact bytes of every golden file of `case`."""
    return codec.render(dump_case(case))
