"""`sharding-dump check`: lints of one case's layout, each naming the tensor and the rule line behind it.

- divisibility: a dimension split over mesh axes whose product does not divide it (XLA pads the last
  shard, or jit refuses the sharding);
- unknown-name: a rule for a logical axis that no tensor of any model carries and that the trainer does
  not define either (`data/lint.yml`), usually a typo; a user's factory model is judged against its own
  weights and activations only;
- unplaced: parameters with no logical axes that no partition rule matches, and other state leaves that
  nothing places (no box, partition rule, weight followed or sharding of the program's own): whole on
  every device;
- partition-rule: a partition rule whose regex matches no parameter path;
- rank: a parameter with more or fewer logical axes than dimensions;
- no-rule: in a user's model, a dimension named by a logical axis that has no rule at all (whole on
  every device; MaxText's own rule files leave names out on purpose);
- replicated: more than a tolerance (default 2%) of the parameter bytes split over no mesh axis of
  size > 1, i.e. held whole by every device;
- memory: params + optimizer state per device above the topology's HBM per device;
- a serving case (an sd.ServingProgram) has lints of its own (memory at its slots x length with
  the largest slot count that fits, a replicated KV cache, steps handing the cache on in another
  layout, kv heads or pages the axes splitting them do not divide): :func:`lint_serving`;
- missing-axis: the rules' source names a mesh axis the mesh lacks (`missing_axes` of the rule file,
  e.g. MaxText's inference.yml and `tensor_transpose`) and it reaches a weight, a cache or the batch:
  where MaxText builds such a leaf's sharding it fails ('Resource axis ... is not found in mesh'); an
  axis only activation rules name is not reported (MaxText drops it from the constraint, as for
  ep-as-dp.yml's `context`);
- pipeline-layers: a pipelined case that builds more decoder layers (and parameters) than the card's
  model, because MaxText counts `pipeline_parallel_layers` in units of a scanned block (gemma4-31b
  with a pipeline: 60 blocks of 6 layers, 360 layers). The golden is what the run builds; this says so.

Which rule decided a dimension comes from flax's own resolver (:func:`sharding_dump.zoo.rules.deciding_rule`),
and where that rule was written from the rule set's origins (file:line of the rule file or model card).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
from typing import Any, Iterable

from sharding_dump import models
from sharding_dump.commands import options
from sharding_dump.commands.progress import Progress
from sharding_dump.core import specs
from sharding_dump.core.layout import TensorLayout, indivisible, leaves, per_device_totals
from sharding_dump.core.state import parameter_count
from sharding_dump.errors import BadInput
from sharding_dump.golden import diff
from sharding_dump.golden.sizes import format_bytes
from sharding_dump.golden.engine import display
from sharding_dump.resources import DATA_DIR, load_yaml, validate
from sharding_dump.zoo import cards, rules, serving, state
from sharding_dump.zoo.case import Case
from sharding_dump.zoo.dump import CaseSetup, case_layouts, handed_back, trace_activations

LINT_FILE = DATA_DIR / "lint.yml"
TOP_TENSORS = 5  # tensors listed under a replicated or memory finding


@dataclasses.dataclass(frozen=True)
class Finding:
    """One problem of a case: which lint, which tensor, what is wrong, and the rule line(s) behind it."""

    lint: str  # divisibility | unknown-name | unplaced | partition-rule | rank | no-rule | replicated | memory
    #            | pipeline-layers | handback
    subject: str  # the tensor (optimizer slots folded in), the rule, or what the numbers are about
    message: str
    details: tuple[str, ...] = ()  # "rule: file:line  [name, axes]" lines, tensors with their rules

    def render(self) -> str:
        lines = [f"  [{self.lint}] {self.subject}", f"      {self.message}"]
        lines += [f"      {d}" for d in self.details]
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class LintSettings:
    replicated_tolerance: float
    known_logical_axes: frozenset[str]


@functools.cache
def lint_settings() -> LintSettings:
    """The defaults of `data/lint.yml`."""
    data = load_yaml(LINT_FILE, "lint settings")
    validate(data, "lint", f"lint settings {LINT_FILE}")
    names = frozenset(name for group in data["known_logical_axes"] for name in group)
    return LintSettings(float(data["replicated_tolerance"]), names)


# Card fields that only size a tensor or change arithmetic: two cards of one block that differ in
# nothing else carry the same logical axis names, so one of them is traced (57 cards, 16 blocks).
SIZE_FIELDS = frozenset({
    "name", "emb_dim", "num_query_heads", "num_kv_heads", "vocab_size", "mlp_dim", "head_dim", "moe_mlp_dim",
    "normalization_layer_epsilon", "rope_max_timescale", "num_experts_per_tok", "qk_nope_head_dim",
    "qk_rope_head_dim", "v_head_dim", "kv_lora_rank", "q_lora_rank", "max_position_embeddings",
    "original_max_position_embeddings", "rope_factor", "beta_fast", "beta_slow", "mscale", "routed_scaling_factor",
    "sliding_window_size", "local_rope_max_timescale", "global_rope_max_timescale", "num_decoder_layers",
    "logical_axis_rules", "rope_type", "rope_interleave", "rope_truncate", "rope_attention_scaling",
    "rope_linear_scaling_factor", "partial_rotary_factor", "global_rope_proportion", "local_rope_proportion",
    "routed_score_func", "mlp_activations_limit", "attn_logits_soft_cap", "final_logits_soft_cap", "indexer_topk",
    "nope_layer_interval", "mlp_activations"})


@functools.cache
def _card_kinds() -> tuple[models.ModelConfig, ...]:
    """One model card per decoder block and set of non-size fields (sizes change no axis name)."""
    kinds: dict[tuple, models.ModelConfig] = {}
    for model in cards.model_names():
        cfg = cards.load_config(model)
        kinds.setdefault(tuple((f.name, getattr(cfg, f.name)) for f in dataclasses.fields(cfg)
                               if f.name not in SIZE_FIELDS), cfg)
    return tuple(kinds.values())


@functools.cache
def _axes_of(cfg: models.ModelConfig) -> frozenset[str]:
    return frozenset(n for _, _, logical in leaves(state.abstract_params(cfg)) for n in logical if n is not None)


def carried_by_a_model(names: set[str]) -> set[str]:
    """The names among `names` that some model card's parameters carry (an optimizer leaf carries its
    parameter's). Cards are traced one kind at a time, and only until every name is found.

    >>> sorted(carried_by_a_model({"q_lora", "embed"}))  # both on the first kind: one card traced
    ['embed', 'q_lora']
    """
    missing, found = set(names), set()
    for cfg in _card_kinds():
        if not missing:
            break
        hit = missing & _axes_of(cfg)
        found |= hit
        missing -= hit
    return found


def _axes_text(axes: rules.MeshAxes) -> str:
    if axes is None:
        return "null"
    if isinstance(axes, str):
        return axes
    return f"[{', '.join(axes)}]"


def rule_text(rule_set: rules.RuleSet, index: int) -> str:
    """`sharding_dump/rules/default.yml:36  [kv_heads, [tensor, tensor_sequence]]`."""
    name, axes = rule_set.logical_axis_rules[index]
    where = "(unknown line)"
    if index < len(rule_set.origins):
        path, line = rule_set.origins[index]
        where = f"{display(path)}:{line}"
    return f"{where}  [{name}, {_axes_text(axes)}]"


# How a leaf whose spec did not come from a linen or NNX box was placed (core.placement.SOURCES).
SOURCE_TEXT = {"type": "placed by the program itself: its init's own sharding (jit out_shardings, reshard, "
                       "device_put or a constraint)",
               "params_axes": "placed by its params_axes names (flax.linen.partitioning) under the logical rules",
               "regex": "placed by a partition rule (path regex)"}


def dimension_rules(rule_set: rules.RuleSet, layout: TensorLayout) -> list[str]:
    """Where a tensor's spec came from when not from a box, then for every named dimension the rule
    that decided it (or that none did)."""
    out = [f"  {SOURCE_TEXT[layout.source]}"] if layout.source in SOURCE_TEXT else []
    if layout.source == "type":
        return out + [f"  spec {specs.spec_to_json(layout.partition_spec, len(layout.shape))}"]
    for dim, name in enumerate(layout.logical_axes):
        if name is None:
            continue
        index = rules.deciding_rule(layout.logical_axes, rule_set.logical_axis_rules, dim)
        out.append(f"  dim {dim} ({name}): " + (rule_text(rule_set, index) if index is not None
                                                else f"no rule for '{name}' (unsharded)"))
    return out


def _tensor_details(rule_set: rules.RuleSet, listed: list[tuple[TensorLayout, int, str]], rest: int,
                    rest_bytes: int, what: str) -> tuple[str, ...]:
    """The listed tensors (with a size and a note) and the rules behind each dimension, then a count
    of the ones not listed."""
    lines = []
    for layout, size, note in listed:
        lines.append(f"{layout.path}{note}  {format_bytes(size)}")
        lines += dimension_rules(rule_set, layout)
    if rest:
        lines.append(f"... and {rest} more {what} ({format_bytes(rest_bytes)})")
    return tuple(lines)


def _fold(per_tensor: dict[str, tuple[Any, ...]]) -> list[tuple[str, tuple[Any, ...]]]:
    """Folds optimizer slots whose finding equals their parameter's under the parameter."""
    out = []
    for name, (finding, slots) in diff.fold_slots(per_tensor).items():
        out.append((name + (f" (and {', '.join(slots)})" if slots else ""), finding))
    return sorted(out, key=lambda item: (item[0].split("/", 1)[0] not in specs.PARAMETER_PARTS, item[0]))


def check_divisibility(setup: CaseSetup, layouts: list[TensorLayout]) -> list[Finding]:
    """Dimensions whose size is not a multiple of the product of the mesh axes they are split over."""
    sizes = setup.plan.sizes
    per_tensor: dict[str, tuple[Any, ...]] = {}
    for layout, dim in indivisible(layouts):
        size, pieces = layout.shape[dim], layout.shards(dim)
        axes = [a for a in layout.axes(dim) if sizes[a] > 1]
        over = " x ".join(f"{a}={sizes[a]}" for a in axes) + (f" = {pieces}" if len(axes) > 1 else "")
        name = layout.logical_axes[dim]
        index = rules.deciding_rule(layout.logical_axes, setup.rule_set.logical_axis_rules, dim)
        problem = (f"dim {dim} ({name}) of size {size} is split over {over}: {size} is not a multiple of {pieces}",
                   rule_text(setup.rule_set, index) if index is not None else f"no rule for '{name}'")
        per_tensor[layout.path] = per_tensor.get(layout.path, ()) + (problem,)
    return [Finding("divisibility", subject, message, (f"rule: {rule}",))
            for subject, problems in _fold(per_tensor) for message, rule in problems]


def check_names(setup: CaseSetup, known: frozenset[str], layouts: list[TensorLayout] = (),
                activation_axes: frozenset[str] | None = None) -> list[Finding]:
    """Rules for logical axes that no tensor carries and that the trainer does not define. A built-in
    model is judged against every model card and MaxText's trainer names (`known`); a user's factory
    against its own weights and activations (`activation_axes`) only."""
    own = {n for t in layouts for n in t.logical_axes if n is not None}
    if setup.config is None:
        used = own | set(activation_axes or ()) | set(setup.rule_set.input_data_sharding_logical_axes)
        why = (f"no weight or activation of model {setup.case.model} carries '{{name}}': the rule never applies "
               "(a typo, or a rule for another model?)")
    else:
        used = own | known | set(setup.rule_set.input_data_sharding_logical_axes)
        used |= carried_by_a_model({name for name, _ in setup.rule_set.logical_axis_rules} - used)
        why = (f"no tensor of any model ({', '.join(cards.model_names())}) carries '{{name}}' and the trainer "
               f"defines no such axis ({display(LINT_FILE)}): the rule never applies (a typo?)")
    findings = []
    for index, (name, _) in enumerate(setup.rule_set.logical_axis_rules):
        if name not in used:
            findings.append(Finding("unknown-name", f"logical axis '{name}'", why.format(name=name),
                                    (f"rule: {rule_text(setup.rule_set, index)}",)))
    return findings


def check_missing_axes(setup: CaseSetup, layouts: list[TensorLayout], batch: bool = True) -> list[Finding]:
    """Mesh axes the rules' source names that the mesh lacks, where they reach a state leaf (or, in a
    training case, `batch`, the batch through data_sharding): MaxText refuses those, and drops the axis
    only from activation constraints (its remove_size_one_mesh_axis)."""
    findings = []
    rule_set = setup.rule_set
    own = {name for (name, _), (path, _) in zip(rule_set.logical_axis_rules, rule_set.origins) if path == rule_set.path} \
        if rule_set.origins else {name for name, _ in rule_set.logical_axis_rules}
    for missing in rule_set.missing_axes:
        named = set(missing.rules) & own  # a card's rule of the same name replaces the file's
        reached = [t for t in layouts if named & set(t.logical_axes)]
        by_batch = batch and missing.data_sharding
        if not reached and not by_batch:
            continue
        names = sorted({n for t in reached for n in t.logical_axes if n in named})
        what = [f"{len(reached)} state lea{'f' if len(reached) == 1 else 'ves'} ({', '.join(names)})"] if reached else []
        what += ["the batch (data_sharding)"] if by_batch else []
        findings.append(Finding(
            "missing-axis", f"mesh axis '{missing.axis}'",
            f"the rules' source names '{missing.axis}', which mesh_axes lacks ({display(rule_set.path)} drops it), and it "
            f"reaches {' and '.join(what)}: MaxText refuses these ('Resource axis: {missing.axis} ... is not found in "
            "mesh'); drop the axis from its rules, or add it to the mesh",
            tuple(f"{t.path}  logical {list(t.logical_axes)}" for t in reached[:TOP_LEAVES])
            + ((f"... and {len(reached) - TOP_LEAVES} more leaves",) if len(reached) > TOP_LEAVES else ())))
    return findings


def _leaves(layouts: list[TensorLayout]) -> list[rules.Leaf]:
    return [(t.path, t.shape, t.logical_axes) for t in layouts]


def check_placement(setup: CaseSetup, layouts: list[TensorLayout]) -> list[Finding]:
    """Weights that nothing places, partition rules that match nothing, logical axes that do not fit a
    tensor's rank, and logical axes with no rule at all: each leaves a weight whole on every device
    without a word."""
    rule_set = setup.rule_set
    by_path = {t.path: t for t in layouts}
    findings = []
    unplaced = rules.unplaced_parameters(rule_set, _leaves(layouts), {t.path for t in layouts if t.source == "type"})
    others = rules.unplaced_state(_leaves(layouts), {t.path for t in layouts if t.source == "none"}, unplaced)
    for paths, title, nouns, what in (
            (unplaced, "parameters placed by nothing", ("parameter", "parameters"),
             f"carry no logical axes and match no partition rule of {display(rule_set.path)}"),
            (others, "state leaves placed by nothing", ("state leaf", "state leaves"),
             "outside params carry no logical axes, match no partition rule, follow no weight and were not placed "
             "by the program")):
        if not paths:
            continue
        ordered = sorted(paths, key=lambda p: (-_global_bytes(by_path[p]), p))
        listed = [(by_path[p], _global_bytes(by_path[p]), "") for p in ordered[:TOP_TENSORS]]
        rest = ordered[TOP_TENSORS:]
        findings.append(Finding("unplaced", title, f"{len(paths)} {nouns[len(paths) > 1]} {what}: each is whole on "
                                                   "every device",
                                _tensor_details(rule_set, listed, len(rest),
                                                sum(_global_bytes(by_path[p]) for p in rest), nouns[1])))
    for rule in rules.unmatched_partition_rules(rule_set, _leaves(layouts)):
        findings.append(Finding("partition-rule", f"partition rule {rule.pattern!r}",
                                f"matches no parameter path of model {setup.case.model_ref.label} (a typo?)",
                                (f"rule: {rule.where}",)))
    for rule, first, path in rules.shadowed_partition_rules(rule_set, _leaves(layouts)):
        findings.append(Finding("partition-rule", f"partition rule {rule.pattern!r}",
                                f"places nothing: every parameter path it matches is matched first by partition "
                                f"rule {first.pattern!r} (first match wins), e.g. {path}",
                                (f"rule: {rule.where}", f"shadowed by: {first.where}")))
    for path, count, rank in rules.rank_mismatches(_leaves(layouts)):
        findings.append(Finding("rank", path, f"{count} logical axes for a tensor of rank {rank}: "
                                + ("the extra names are dropped" if count > rank else
                                   "its last dimensions have no name and stay whole"),
                                (f"logical axes {list(by_path[path].logical_axes)}, shape {list(by_path[path].shape)}",)))
    if setup.config is not None:  # MaxText's rule files leave names out on purpose (pure-fsdp: mlp whole)
        return findings
    ruled = {name for name, _ in rule_set.logical_axis_rules}
    unruled: dict[str, list[TensorLayout]] = {}
    for t in layouts:
        if t.group in specs.PARAMETER_PARTS:
            for name in dict.fromkeys(n for n in t.logical_axes[:len(t.shape)] if n is not None and n not in ruled):
                unruled.setdefault(name, []).append(t)
    for name, tensors in sorted(unruled.items()):
        ordered = sorted(tensors, key=lambda t: (-_global_bytes(t), t.path))
        findings.append(Finding(
            "no-rule", f"logical axis '{name}'",
            f"{len(tensors)} parameter{'s' if len(tensors) > 1 else ''} name a dimension '{name}', and "
            f"{display(rule_set.path)} has no rule for it: that dimension is whole on every device",
            tuple(f"{t.path}  {format_bytes(_global_bytes(t))}" for t in ordered[:TOP_TENSORS])
            + ((f"... and {len(ordered) - TOP_TENSORS} more parameters",) if len(ordered) > TOP_TENSORS else ())))
    return findings


def _global_bytes(layout: TensorLayout) -> int:
    return math.prod(layout.shape) * specs.itemsize(layout.dtype)


def check_replicated(setup: CaseSetup, layouts: list[TensorLayout], tolerance: float) -> list[Finding]:
    """Share of parameter bytes split over no mesh axis of size > 1, against the tolerance."""
    sizes = setup.plan.sizes
    if not any(size > 1 for size in sizes.values()):
        return []
    params = [t for t in layouts if t.group in specs.PARAMETER_PARTS]
    whole = [t for t in params if not any(sizes[a] > 1 for d in range(len(t.shape)) for a in t.axes(d))]
    total = sum(_global_bytes(t) for t in params)
    replicated = sum(_global_bytes(t) for t in whole)
    if not total or replicated / total <= tolerance:
        return []
    axes = ", ".join(f"{a}={s}" for a, s in sizes.items() if s > 1)
    ordered = sorted(whole, key=lambda t: (-_global_bytes(t), t.path))
    listed = [(t, _global_bytes(t), "") for t in ordered[:TOP_TENSORS]]
    rest = ordered[TOP_TENSORS:]
    return [Finding(
        "replicated", "parameters held whole by every device",
        f"{replicated / total:.1%} of the parameter bytes ({format_bytes(replicated)} of "
        f"{format_bytes(total)}) are split over none of {axes}, above the {tolerance:.1%} tolerance",
        _tensor_details(setup.rule_set, listed, len(rest), sum(_global_bytes(t) for t in rest), "replicated parameters"))]


def check_memory(setup: CaseSetup, layouts: list[TensorLayout]) -> list[Finding]:
    """Params + optimizer state per device against the HBM of one device of the topology."""
    hbm = setup.topology.hbm_bytes_per_device
    if hbm is None:
        return []
    totals = per_device_totals(layouts)
    used = sum(totals.get(part, 0) for part in specs.PARAMETER_PARTS + specs.OPTIMIZER_PARTS)
    if used <= hbm:
        return []
    by_param = {t.path: t.per_device_bytes for t in layouts if t.group in specs.PARAMETER_PARTS}  # with its optimizer slots
    for t in layouts:
        mirror = diff.slot_parameter(t.path, by_param) if t.group in specs.OPTIMIZER_PARTS else None
        if mirror:
            by_param[mirror[0]] += t.per_device_bytes
    layout_of = {t.path: t for t in layouts}
    ordered = sorted(by_param, key=lambda p: (-by_param[p], p))
    listed = [(layout_of[p], by_param[p], " (with its optimizer slots)") for p in ordered[:TOP_TENSORS]]
    rest = ordered[TOP_TENSORS:]
    return [Finding(
        "memory", "params + optimizer state per device",
        f"params {format_bytes(sum(totals.get(p, 0) for p in specs.PARAMETER_PARTS))} + optimizer state "
        f"{format_bytes(sum(totals.get(p, 0) for p in specs.OPTIMIZER_PARTS))} = {format_bytes(used)} per device, above the "
        f"{format_bytes(hbm)} HBM of one {setup.topology.chip} device ({used / hbm:.0%}); largest per device:",
        _tensor_details(setup.rule_set, listed, len(rest), sum(by_param[p] for p in rest), "parameters"))]


def _billions(count: int) -> str:
    return f"{count:,} ({count / 1e9:.2f}B)"


def check_pipeline_layers(setup: CaseSetup, layouts: list[TensorLayout]) -> list[Finding]:
    """A pipelined case whose stack holds more decoder layers than the card's model: MaxText's
    `pipeline_parallel_layers` counts units of the pipelined stack, and a unit may be a scanned block."""
    pp, cfg = setup.pipeline, setup.config
    if pp is None or cfg is None:
        return []
    built, model = cards.built_layers(cfg, pipelined=True), cards.built_layers(cfg, pipelined=False)
    if built <= model:
        return []
    built_params = sum(math.prod(t.shape) for t in layouts if rules.parameter(t.path) is not None)
    model_params = parameter_count(state.abstract_params(cfg))
    stack = cards.pipelined_stack(cfg)
    return [Finding(
        "pipeline-layers", "decoder layers the pipeline builds",
        f"the pipelined run builds {built} decoder layers where model {cfg.name} has {model}, and "
        f"{_billions(built_params)} parameters where the model has {_billions(model_params)}",
        (f"MaxText counts pipeline_parallel_layers ({pp.num_layers} = {pp.num_stages} stages x {pp.num_repeats} "
         f"repeats x {pp.layers_per_stage} per stage) and the layers outside the pipeline in units of the "
         f"pipelined stack, here blocks of {stack.unit_layers} layers: {stack.length} blocks in all",))]


def check_handback(setup: CaseSetup, layouts: list[TensorLayout]) -> list[Finding]:
    """A user's program whose step takes a state leaf in or hands it back in another layout than the
    state holds it in: the leaf is resharded every step, there and back."""
    if setup.config is not None:
        return []
    backs, findings = handed_back(setup, layouts), []
    for end, does in (("taken", "takes it"), ("returned", "hands it back")):
        per_tensor = {back.path: (diff.compact(back.came_back), diff.compact(back.went_in), back.moved_bytes)
                      for back in backs[end]}  # optimizer slots laid out alike fold in
        findings += [Finding("handback", subject, f"the step {does} on {step} where the state holds it on {held}: "
                             f"{format_bytes(moved)} moved per device per step"
                             f"{' for each' if ' (and ' in subject else ''}")
                     for subject, (step, held, moved) in _fold(per_tensor)]
    return findings


# A serving case (an sd.ServingProgram): its state at the slots x length it is served with, and the steps
# that hand the KV cache on.

TOP_LEAVES = 5  # leaves listed under a finding


def check_serving_memory(setup: CaseSetup) -> list[Finding]:
    """The state per device at the case's slots x length above one device's HBM."""
    fit = serving.memory_fit(setup)
    if fit is None or fit.used <= fit.hbm:
        return []
    devices = setup.plan.num_devices
    weights = fit.used - fit.cache
    largest = (f"the largest slot count that fits at {fit.length} tokens is {fit.largest_slots} "
               f"(per_device_batch_size={fit.largest_slots / devices:g} on {devices} devices)" if fit.largest_slots
               else f"no slot count fits at {fit.length} tokens: the state without its cache takes "
                    f"{format_bytes(weights)}")
    longest = (f"at {fit.slots} slots the longest cache that fits is {fit.largest_length} tokens"
               if fit.largest_length else f"at {fit.slots} slots no cache length fits")
    return [Finding(
        "memory", f"weights + KV cache per device at {fit.slots} slots x {fit.length} tokens",
        f"{format_bytes(weights)} + cache {format_bytes(fit.cache)} = {format_bytes(fit.used)} "
        f"per device, above the {format_bytes(fit.hbm)} HBM of one {setup.topology.chip} device "
        f"({fit.used / fit.hbm:.0%}); {largest}",
        (longest,))]


def check_cache_replicated(setup: CaseSetup, traced: serving.Traced, tolerance: float) -> list[Finding]:
    """Cache leaves split over none of some mesh axis larger than 1, above `tolerance` of the cache."""
    sizes = setup.plan.sizes
    cache = [t for t in traced.layouts if traced.is_cache(t.path)]
    whole: dict[str, list[TensorLayout]] = {}
    for t in cache:
        used = {a for d in range(len(t.shape)) for a in t.axes(d)}
        for axis, size in sizes.items():
            if size > 1 and axis not in used:
                whole.setdefault(axis, []).append(t)
    total = sum(_bytes(t) for t in cache)
    findings = []
    for axis, held in sorted(whole.items()):
        replicated = sum(_bytes(t) for t in held)
        if not total or replicated / total <= tolerance:
            continue
        ordered = sorted(held, key=lambda t: (-t.per_device_bytes, t.path))
        findings.append(Finding(
            "cache-replicated", f"KV cache whole over {axis}={sizes[axis]}",
            f"{replicated / total:.1%} of the cache's bytes are split over no dimension along {axis}: each of its "
            f"{sizes[axis]} devices holds the same entries "
            f"({format_bytes(sum(t.per_device_bytes for t in held))} per device)",
            tuple(f"{t.path}  spec {diff.compact(_spec(t))}  {format_bytes(t.per_device_bytes)} per device"
                  for t in ordered[:TOP_LEAVES])
            + ((f"... and {len(ordered) - TOP_LEAVES} more cache leaves",) if len(ordered) > TOP_LEAVES else ())))
    return findings


def check_handoffs(traced: serving.Traced, sizes: dict[str, int]) -> list[Finding]:
    """Steps that hand leaves on in another layout than the next step takes them in."""
    findings = []
    for pair, moved in serving.handoffs(traced, sizes).items():
        if not moved:
            continue
        source, target = pair.split(".")
        ordered = sorted(moved, key=lambda m: (-m.bytes_per_request, m.path))
        findings.append(Finding(
            "handoff", f"{source} -> {target}",
            f"{source} hands {len(moved)} lea{'f' if len(moved) == 1 else 'ves'} to {target} in another layout than "
            f"{target} takes {'it' if len(moved) == 1 else 'them'} in: "
            f"{format_bytes(sum(m.bytes_per_request for m in moved))} per request, "
            f"{format_bytes(sum(m.back.moved_bytes for m in moved))} received by the device that moves most",
            tuple(f"{m.path}  {diff.compact(m.back.came_back)} -> {diff.compact(m.back.went_in)}  "
                  f"{format_bytes(m.bytes_per_request)} per request" for m in ordered[:TOP_LEAVES])
            + ((f"... and {len(ordered) - TOP_LEAVES} more leaves",) if len(ordered) > TOP_LEAVES else ())))
    return findings


def lint_serving(setup: CaseSetup, layouts: list[TensorLayout], known: frozenset[str],
                 tolerance: float) -> list[Finding]:
    """Every finding of a serving case, lint by lint."""
    traced = serving.traced_of(setup)
    activation_axes = frozenset(n for step in traced.steps for c in step.activations
                                for n in c.logical_axes if n is not None)
    return (check_divisibility(setup, layouts) + check_names(setup, known, layouts, activation_axes)
            + check_placement(setup, layouts) + check_missing_axes(setup, layouts, batch=False)
            + check_serving_memory(setup)
            + check_cache_replicated(setup, traced, tolerance) + check_handoffs(traced, setup.plan.sizes))


def _bytes(layout: TensorLayout) -> int:
    return math.prod(layout.shape) * specs.itemsize(layout.dtype)


def _spec(layout: TensorLayout) -> specs.SpecJson:
    return specs.spec_to_json(layout.partition_spec, len(layout.shape))


def lint_case(case: Case, tolerance: float | None = None) -> list[Finding]:
    """Every finding of `case`, lint by lint."""
    settings = lint_settings()
    tolerance = settings.replicated_tolerance if tolerance is None else tolerance
    setup, layouts = case_layouts(case)
    if serving.serves(case):  # a server: its state at slots x length, its steps' hand-offs
        return lint_serving(setup, layouts, settings.known_logical_axes, tolerance)
    activation_axes = None
    if setup.config is None:  # a user's model: its own activations name axes its weights may not
        activation_axes = frozenset(n for c in trace_activations(setup) for n in c.logical_axes if n is not None)
    return (check_divisibility(setup, layouts)
            + check_names(setup, settings.known_logical_axes, layouts, activation_axes)
            + check_placement(setup, layouts)
            + check_replicated(setup, layouts, tolerance) + check_memory(setup, layouts)
            + check_pipeline_layers(setup, layouts) + check_handback(setup, layouts)
            + check_missing_axes(setup, layouts))


def parse_tolerance(text: str) -> float:
    """`0.05` or `5%` -> 0.05; BadInput outside [0, 1]."""
    raw = text.strip()
    try:
        value = float(raw[:-1]) / 100 if raw.endswith("%") else float(raw)
    except ValueError:
        value = math.nan
    if not 0 <= value <= 1:
        raise BadInput(f"--replicated-tolerance {text!r}: must be a fraction in [0, 1] (e.g. 0.02) or a percentage (2%)")
    return value


def render_findings(case: Case, findings: Iterable[Finding]) -> str:
    """`<case>: clean`, or a count line and one block per finding."""
    findings = list(findings)
    if not findings:
        return f"{case.label}: clean"
    head = f"{case.label}: {len(findings)} finding{'' if len(findings) == 1 else 's'}"
    return "\n".join([head] + [f.render() for f in findings])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    options.add_case_options(parser, "check every case of the case matrix")
    parser.add_argument("--replicated-tolerance", metavar="F",
                        help="largest share of parameter bytes that may be replicated on every device, as a "
                             "fraction or a percentage (default: data/lint.yml, 2%%)")
    options.add_settings_argument(parser)


def run(args: argparse.Namespace) -> int:
    """Exit 1 on any finding, 0 when clean."""
    tolerance = None if args.replicated_tolerance is None else parse_tolerance(args.replicated_tolerance)
    cases = options.cases_of(args, "checks", options.project_of(args))
    lint_settings()  # a broken data/lint.yml is bad input before any output
    found = 0
    with Progress(len(cases), "checking") as progress:
        for case in cases:
            progress.start(case.label)
            findings = lint_case(case, tolerance)
            found += len(findings)
            head, _, rest = render_findings(case, findings).partition("\n")
            progress.finish(head)
            if rest:
                print(rest, flush=True)
    if len(cases) > 1:
        print(f"{len(cases)} cases checked, {found} finding{'' if found == 1 else 's'}")
    return 1 if found else 0
