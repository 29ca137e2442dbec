"""A serving case: a ServingProgram's state and steps on the case's mesh, and its golden documents.

The case's serving settings (`slots`, `max_prefill_predict_length`, `max_target_length`,
`page_size`, `cache_dtype`) reach the program's `init`; its state is laid out leaf by leaf as a
TrainProgram's is (what init placed itself, else its boxes and the rule file); every step is traced
once on that state. The goldens are the state's `named_shardings.json` and `logical_shardings.json`
and `serving_steps.json`: per step the layout each state leaf is taken in and handed back in, its
inputs, outputs and activation placements, and every hand-off between steps with the bytes it moves
per request.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Any, Iterator, Mapping

import jax
from jax.sharding import PartitionSpec

from sharding_dump.core import documents, specs
from sharding_dump.core.format import SERVING_FILE, document
from sharding_dump.core.handback import HandBack, hand_backs
from sharding_dump.core.layout import TensorLayout, per_device_totals
from sharding_dump.core.program import Input, ProgramError
from sharding_dump.core.program import ServingProgram, ServingSettings
from sharding_dump.core.serving import StepTrace, init_state, trace_steps
from sharding_dump.errors import BadInput
from sharding_dump.zoo import rules, state
from sharding_dump.zoo.case import Case
from sharding_dump.zoo.mesh import MeshPlan

SERVING_SETTINGS = ("max_prefill_predict_length", "quantize_kvcache", "page_size")
SERVE = "serving"  # the setting that serves a model card (MaxEngine's prefill, insert and generate)

ProgramKey = Any  # a factory reference (str), or a ZooServer: what builds the case's ServingProgram


def serves(case: Case) -> bool:
    """The case is a server: a factory's ServingProgram, or a model card with serving=true."""
    if case.model_ref.kind != "factory":
        return bool(dict(case.overrides).get(SERVE, False))
    from sharding_dump.zoo.model_ref import factory_program

    return isinstance(factory_program(case.model), ServingProgram)


def check_settings(case: Case) -> None:
    """Serving settings given to a training case are bad input (nothing would read them), as is
    serving=true for a factory (its program says whether it serves). The program is built only when
    such a setting is given: `verify` runs the user's code in its child alone."""
    overrides = dict(case.overrides)
    if case.model_ref.kind == "factory" and SERVE in overrides:
        raise BadInput(f"{SERVE}={str(overrides[SERVE]).lower()}: applies to the zoo's model cards; model "
                       f"{case.model!r} is a factory, whose program serves when it is an sd.ServingProgram")
    given = [key for key, _ in case.overrides if key in SERVING_SETTINGS]
    if given and not serves(case):
        what = f"model {case.model!r} is trained, not served" if case.model_ref.kind == "factory" else \
            f"model {case.model!r} is trained unless {SERVE}=true"
        raise BadInput(f"{given[0]}: applies to serving programs only (an sd.ServingProgram, or a card with "
                       f"{SERVE}=true); {what}")


def zoo_server(config: Any, values: Mapping[str, Any], stages: int) -> ProgramKey:
    """The ZooServer of a card case with serving=true; BadInput when the zoo does not serve it so."""
    from sharding_dump.models.serving import ZooServer

    served = served_blocks()
    if config.decoder_block not in served:
        raise BadInput(f"{SERVE}=true: the zoo serves decoder blocks {', '.join(served)} (MaxText's KV cache "
                       f"of their dense attention); model {config.name!r} is a {config.decoder_block} block")
    if stages > 1:
        raise BadInput(f"{SERVE}=true: stage axis of size {stages}: a server's layers are not pipelined "
                       "(size the stage axis 1)")
    if values["shard_mode"] == "explicit":
        raise BadInput(f"shard_mode=explicit: the zoo serves a card as MaxEngine does, on a mesh of Auto axes "
                       "(its linen decoder constrains, sharding in types would assert); give shard_mode=auto")
    if values["page_size"]:
        raise BadInput(f"page_size={values['page_size']}: the zoo serves MaxText's contiguous KV cache "
                       "(MaxEngine without paged attention); give page_size=0")
    if values["max_prefill_predict_length"] >= values["max_target_length"]:
        raise BadInput(f"max_prefill_predict_length={values['max_prefill_predict_length']}: MaxText's KV cache "
                       f"needs max_target_length ({values['max_target_length']}) longer (its generate cache "
                       "holds the difference)")
    return ZooServer(config)


def served_blocks() -> list[str]:
    """The zoo's decoder blocks a card may be served as: those whose layer is the dense decoder layer,
    the one that carries MaxText's KV cache."""
    from sharding_dump.models.dense import DecoderLayer
    from sharding_dump.zoo import cards

    return sorted(name for name, block in cards.decoder_blocks().items()
                  if block.entry_point is None and getattr(cards.block_class(name), "layer", None) is DecoderLayer)


def program_key(setup: Any) -> ProgramKey:
    """What builds the ServingProgram of a resolved serving case (zoo.dump.CaseSetup)."""
    return setup.server if setup.config is not None else setup.case.model


def settings_of(values: Mapping[str, Any], global_batch: int) -> ServingSettings:
    """The case's serving settings, as MaxText's names give them: the slots are the global batch
    (per_device_batch_size x devices), the cache int8 under quantize_kvcache, else bfloat16; BadInput
    (one line naming the setting) when they do not fit."""
    page, length = values["page_size"], values["max_target_length"]
    if page and length % page:
        raise BadInput(f"page_size={page}: give 0 (no pages) or a whole number of tokens that divides "
                       f"max_target_length={length}")
    try:
        return ServingSettings(global_batch, values["max_prefill_predict_length"], values["max_target_length"],
                               values["page_size"], "int8" if values["quantize_kvcache"] else "bfloat16")
    except ProgramError as err:
        raise BadInput(str(err).replace("ServingSettings(max_prefill_length=", "max_prefill_predict_length=(")
                       .replace("ServingSettings(max_length=", "max_target_length=(")
                       .replace("ServingSettings(", "")) from None


@dataclasses.dataclass(frozen=True)
class Traced:
    """A serving case traced: every state leaf's layout and every step."""

    settings: ServingSettings
    layouts: tuple[TensorLayout, ...]
    steps: tuple[StepTrace, ...]
    cache_keys: tuple[str, ...]

    def is_cache(self, path: str) -> bool:
        return path.split("/", 1)[0] in self.cache_keys


@contextlib.contextmanager
def _on(plan: MeshPlan, rule_set: rules.RuleSet, explicit: bool) -> Iterator[Any]:
    """The case's mesh (and legacy mesh) and logical rules, as the server runs under them."""
    import flax.linen as nn

    from sharding_dump.core.layout import rules_of
    from sharding_dump.core.legacy_mesh import legacy_mesh

    mesh = plan.abstract_mesh(explicit=explicit)
    with jax.sharding.use_abstract_mesh(mesh), legacy_mesh(mesh), nn.logical_axis_rules(rules_of(rule_set)):
        yield mesh


@functools.lru_cache(maxsize=64)
def init_layouts(ref: ProgramKey, plan: MeshPlan, rule_set: rules.RuleSet, explicit: bool,
                 settings: ServingSettings, types: bool) -> tuple[Any, tuple[TensorLayout, ...]]:
    """The program's init traced once: its abstract state and every leaf's layout (what init placed
    itself, else its boxes and the rule file). `types` False: traced on the Auto mesh for its sizes
    only, in a case whose mesh is Explicit, so a concrete mesh of the program's with Explicit axes
    (jax-llm-examples' `jax.make_mesh`) is the case's and its axis types are not compared here. Every
    argument is given, and by position: the cache keys calls by how they pass them, so the dump and
    verify share one trace."""
    from sharding_dump.core.handback import check_mesh
    from sharding_dump.core.placement import declared_specs, placed_outputs
    from sharding_dump.core.program import boxed_view
    from sharding_dump.core.state import abstract_key

    with _on(plan, rule_set, explicit) as mesh:
        shapes, closed = init_state(_program(ref), settings, abstract_key())
        check_mesh(closed, mesh, "the program's init", types=types)
        raw, declared = placed_outputs(shapes, declared_specs(closed), mesh)
        return raw, tuple(state.tensor_layouts(boxed_view(raw), plan, rule_set, False, declared))


@functools.lru_cache(maxsize=64)
def trace_case(ref: ProgramKey, plan: MeshPlan, rule_set: rules.RuleSet, explicit: bool,
               settings: ServingSettings) -> Traced:
    """init and every step of the program behind `ref`, traced once per process for these inputs."""
    from sharding_dump.core.layout import resolve
    from sharding_dump.core.placement import placed

    program = _program(ref)
    raw, layouts = init_layouts(ref, plan, rule_set, explicit, settings, True)

    def input_spec(field: Input) -> PartitionSpec:
        return resolve(field.logical_axes, rule_set) if field.logical_axes else PartitionSpec()

    with _on(plan, rule_set, explicit) as mesh:
        held = {t.path: t.partition_spec for t in layouts}
        start = placed(raw, held, mesh) if explicit else raw
        steps = trace_steps(program, settings, start, held, mesh, input_spec)
    return Traced(settings, layouts, tuple(steps), program.cache)


def _program(key: ProgramKey) -> ServingProgram:
    if not isinstance(key, str):
        return _zoo_program(key)
    from sharding_dump.zoo.model_ref import factory_program

    program = factory_program(key)
    assert isinstance(program, ServingProgram)
    return program


@functools.lru_cache(maxsize=16)
def _zoo_program(server: Any) -> ServingProgram:
    return server.program()


def program_of(setup: Any) -> ServingProgram:
    """The ServingProgram of a resolved serving case."""
    return _program(program_key(setup))


def traced_of(setup: Any) -> Traced:
    """The serving case of a resolved setup (zoo.dump.CaseSetup), traced."""
    return trace_case(program_key(setup), setup.plan, setup.rule_set, setup.explicit,
                      settings_of(setup.values, setup.batch.global_batch_size))


# --- hand-offs ----------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Moved:
    """One leaf handed from a step to the next in another layout than the next takes it in."""

    path: str  # the state leaf, or `<step>/<output path>` for an output a later step takes
    back: HandBack  # its two layouts, and the bytes the device that moves most receives for it
    bytes_per_request: int  # the request's share of the leaf (all of it for a leaf not per request)


def handoffs(traced: Traced, sizes: Mapping[str, int]) -> dict[str, list[Moved]]:
    """`<from>.<to>` -> the leaves that change layout on the way, for every pair of consecutive steps
    and the last step into itself (generate feeds the next generate): a state leaf handed back in
    another layout than the next step takes it in, and an output a later step takes (`takes=`) in
    another layout than the state leaf of the same path. A cache leaf's share per request is its
    bytes over the slots; an output's, its bytes over the requests its step serves."""
    steps = traced.steps
    pairs = list(zip(steps, steps[1:])) + ([(steps[-1], steps[-1])] if steps else [])
    by_path = {t.path: t for t in traced.layouts}
    out: dict[str, list[Moved]] = {}
    for source, target in pairs:
        paths = [p for p, spec in source.state_out.items() if spec is not None and target.state_in.get(p) is not None]
        backs = hand_backs([source.state_out[p] for p in paths],
                           [(p, by_path[p].shape, by_path[p].dtype, target.state_in[p]) for p in paths], sizes)
        per = {b.path: traced.settings.slots if traced.is_cache(b.path) else 1 for b in backs}
        out[f"{source.name}.{target.name}"] = [Moved(b.path, b, _global_bytes(b.shape, b.dtype) // per[b.path])
                                               for b in backs]
    for step in steps:
        if step.takes is None:
            continue
        source = next(s for s in steps if s.name == step.takes)
        handed = [(p, leaf, spec) for p, (leaf, spec) in source.outputs.items()
                  if spec is not None and step.state_in.get(p) is not None]
        backs = hand_backs([spec for _, _, spec in handed],
                           [(p, tuple(leaf.shape), leaf.dtype.name, step.state_in[p]) for p, leaf, _ in handed], sizes)
        out.setdefault(f"{source.name}.{step.name}", []).extend(
            Moved(f"{source.name}/{b.path}", b, _global_bytes(b.shape, b.dtype) // source.requests) for b in backs)
    return out


def _global_bytes(shape: tuple[int, ...], dtype: str) -> int:
    return math.prod(shape) * specs.itemsize(dtype)


# --- memory -------------------------------------------------------------------------------------------

def cache_bytes(traced: Traced) -> dict[str, int]:
    """The KV cache's bytes: per device, per request (its global bytes over the slots) and per device
    per request (over the slots each device holds)."""
    cache = [t for t in traced.layouts if traced.is_cache(t.path)]
    per_device = sum(t.per_device_bytes for t in cache)
    total = sum(_global_bytes(t.shape, t.dtype) for t in cache)
    slots = traced.settings.slots
    return {"per_device": per_device, "per_request": total // slots,
            "per_device_per_request": per_device // slots}


# --- documents ----------------------------------------------------------------------------------------

def _json(spec: PartitionSpec | None, ndim: int) -> Any:
    return None if spec is None else specs.spec_to_json(spec, ndim)


def serving_document(traced: Traced, head: Mapping[str, Any], mesh: Any) -> dict[str, Any]:
    """serving_steps.json: the steps' layouts, inputs, outputs, activations and hand-offs."""
    from sharding_dump.core.layout import mesh_sizes

    sizes = mesh_sizes(mesh)
    ndim = {t.path: len(t.shape) for t in traced.layouts}
    tensors: dict[str, Any] = {}
    steps: dict[str, Any] = {}
    for step in traced.steps:
        steps[step.name] = {"requests": step.requests, "takes": step.takes}
        for path, spec in step.state_in.items():
            tensors[f"{step.name}/state/{path}"] = {"in": _json(spec, ndim[path]),
                                                    "out": _json(step.state_out.get(path), ndim[path])}
        for name, leaf in step.inputs.items():
            tensors[f"{step.name}/input/{name}"] = {"shape": list(leaf.shape), "dtype": leaf.dtype.name}
        for path, (leaf, spec) in step.outputs.items():
            entry = {"shape": list(leaf.shape), "dtype": leaf.dtype.name, "partition_spec": _json(spec, leaf.ndim)}
            if spec is not None:
                entry["per_device_bytes"] = TensorLayout(path, tuple(leaf.shape), leaf.dtype.name,
                                                         (None,) * leaf.ndim, spec, sizes).per_device_bytes
            tensors[f"{step.name}/output/{path}"] = entry
        for key, entry in documents.activation_entries(step.activations, mesh).items():
            tensors[f"{step.name}/activation/{key}"] = entry
    moves = {}
    for pair, moved in handoffs(traced, sizes).items():
        moves[pair] = {"leaves_moved": len(moved), "bytes_per_request": sum(m.bytes_per_request for m in moved),
                       "moved_bytes_per_device": sum(m.back.moved_bytes for m in moved)}
        for m in moved:
            tensors[f"handoff/{pair}/{m.path}"] = {
                "shape": list(m.back.shape), "dtype": m.back.dtype, "from": m.back.came_back, "to": m.back.went_in,
                "bytes_per_request": m.bytes_per_request, "moved_bytes_per_device": m.back.moved_bytes}
    totals = per_device_totals(traced.layouts)
    return document("serving", {**head, "serving": traced.settings.header(), "steps": steps, "handoffs": moves,
                                 "cache_bytes": cache_bytes(traced), "per_device_bytes": totals}, tensors)


def serving_documents(traced: Traced, head: Mapping[str, Any], mesh: Any) -> dict[str, dict[str, Any]]:
    """Every golden document of a serving case, keyed by file name."""
    docs = documents.golden_documents(list(traced.layouts), mesh, None, header=head)
    docs[SERVING_FILE] = serving_document(traced, head, mesh)
    return docs


# --- what fits ----------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Fit:
    """The state per device at the case's slots x length against one device's HBM, and the largest
    slot count (at the case's length) and length (at the case's slots) that fit; 0 when none does."""

    hbm: int
    used: int
    cache: int
    slots: int
    length: int
    largest_slots: int
    largest_length: int


Scaled = list[tuple[TensorLayout, dict[int, int]]]  # each leaf with what its dimensions gain as a setting doubles


def _scaled(layouts: tuple[TensorLayout, ...], doubled: tuple[TensorLayout, ...]) -> Scaled:
    """Each leaf with the dimensions that grew when one setting was doubled (init traced again), and by
    how much: a dimension is taken as affine in the setting (the slots or the length; MaxText's generate
    cache holds max_target_length less the prompt's max_prefill_predict_length)."""
    other = {t.path: t for t in doubled}
    return [(t, {d: other[t.path].shape[d] - size for d, size in enumerate(t.shape) if other[t.path].shape[d] > size})
            for t in layouts]


def _bytes_at(scaled: Scaled, old: int, new: int) -> int:
    """Per-device bytes of the state with its scaling setting at `new` in place of `old`."""
    total = 0
    for t, grows in scaled:
        shape = tuple(max(0, size + grows[d] * (new - old) // old) if d in grows else size
                      for d, size in enumerate(t.shape))
        total += dataclasses.replace(t, shape=shape).per_device_bytes
    return total


def _largest(scaled: Scaled, old: int, hbm: int) -> int:
    """The largest value in [1, old] at which the state fits `hbm` (0: none does)."""
    low, high = 0, old
    while low < high:
        mid = (low + high + 1) // 2
        if _bytes_at(scaled, old, mid) <= hbm:
            low = mid
        else:
            high = mid - 1
    return low


def memory_fit(setup: Any) -> Fit | None:
    """How the case's state fits one device of its topology (None: no HBM size known). The slot and
    length dimensions of every leaf are read by tracing init again at twice the slots and twice the
    length (on the Auto mesh: nothing is compiled), so the sizes are the program's, not a formula."""
    hbm = setup.topology.hbm_bytes_per_device
    if hbm is None:
        return None
    settings = settings_of(setup.values, setup.batch.global_batch_size)
    args = (program_key(setup), setup.plan, setup.rule_set, False)
    types = not setup.explicit  # the Auto mesh is the case's own only in an Auto case
    layouts = init_layouts(*args, settings, types)[1]
    slots = _scaled(layouts, init_layouts(*args, dataclasses.replace(settings, slots=2 * settings.slots), types)[1])
    length = _scaled(layouts, init_layouts(*args, dataclasses.replace(settings, max_length=2 * settings.max_length),
                                           types)[1])
    used = sum(t.per_device_bytes for t in layouts)
    cache = sum(t.per_device_bytes for t in layouts if t.path.split("/", 1)[0] in program_of(setup).cache)
    return Fit(hbm, used, cache, settings.slots, settings.max_length, _largest(slots, settings.slots, hbm),
               _largest(length, settings.max_length, hbm))
