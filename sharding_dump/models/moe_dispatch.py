"""How routed tokens reach their experts: MaxText's sorted (ragged) dispatch, `sparse_matmul: true`.

MaxText (e591f30, `layers/moe.py`, `RoutedMoE.sparse_matmul`) runs the experts inside one
`shard_map` over the whole mesh. Per device:

1. route: top-k experts per token (:func:`sharding_dump.models.moe.route`);
2. permute: every token repeated `num_experts_per_tok` times, sorted by expert (argsort, gathered
   with a custom VJP whose backward pass is the inverse gather), `group_sizes` the tokens per expert;
3. with expert parallelism (the mesh axes of the experts' `exp` dimension, `fsdp` left out), a
   `ragged_all_to_all` sends each expert's tokens to the devices holding that expert into a buffer
   of the worst-case size, where they are sorted again by local expert;
4. three grouped matmuls, `jax.lax.ragged_dot` (MaxText's kernel with `megablox: false` and
   `use_tokamax_gmm: false`; its Pallas kernels compute the same products): gate and up projections,
   the gated unit, the down projection, reduce-scattered over `tensor` when it splits the experts'
   hidden dimension;
5. the way back: the second sort undone, the reverse `ragged_all_to_all`, the first sort undone, and
   each token's expert outputs summed with its routing weights in float32.

The weights enter the `shard_map` as MaxText places them: `(exp, None, mlp_no_fsdp)` and
`(exp, mlp_no_fsdp, None)` with `fsdp` removed, so each step gathers the experts over `fsdp` once.
Tokens enter and leave on `(activation_batch, activation_norm_length, ...)`. Under `jax.eval_shape`
all of this is shapes only: it traces in constant time whatever the number of tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from sharding_dump.core.legacy_mesh import current_legacy_mesh

FSDP_AXIS = "fsdp"
TENSOR_AXIS = "tensor"
TOKEN_AXES = ("activation_batch", "activation_norm_length", None)
OUTPUT_AXES = ("activation_batch", "activation_norm_length", "activation_embed")
WI_AXES = ("exp", None, "mlp_no_fsdp")
WO_AXES = ("exp", "mlp_no_fsdp", None)


@jax.custom_vjp
def sort_rows(inputs: jax.Array, order: jax.Array) -> jax.Array:
    """inputs[order]: MaxText's `_sort_activations` with `use_custom_sort_vjp` (its default), whose
    cotangent is gathered back by the inverse permutation instead of scattered."""
    return inputs[order, ...]


def _sort_rows_fwd(inputs: jax.Array, order: jax.Array) -> tuple[jax.Array, jax.Array]:
    return inputs[order, ...], order


def _sort_rows_bwd(order: jax.Array, grads: jax.Array) -> tuple[jax.Array, None]:
    return sort_rows(grads, jnp.argsort(order)), None


sort_rows.defvjp(_sort_rows_fwd, _sort_rows_bwd)


def _axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _entry(axes: tuple[str, ...]) -> Any:
    return None if not axes else axes[0] if len(axes) == 1 else axes


def mesh_spec(logical: tuple[str | None, ...], drop: tuple[str, ...] = ()) -> PartitionSpec:
    """The mesh axes the current logical rules give `logical`, without the axes in `drop`."""
    spec = nn.logical_to_mesh_axes(logical)
    return PartitionSpec(*(_entry(tuple(a for a in _axes(e) if a not in drop)) for e in spec))


def fitting_spec(spec: PartitionSpec, shape: tuple[int, ...], sizes: dict[str, int]) -> PartitionSpec:
    """`spec` with the axes of a dimension they do not divide left out (replicated there), as
    MaxText's `remove_incompatible_mesh_axes_from_partition_spec`: shard_map needs even splits."""
    entries = []
    for dim, entry in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        axes = _axes(entry)
        if dim % math.prod(sizes.get(a, 1) for a in axes):
            axes = ()
        entries.append(_entry(axes))
    return PartitionSpec(*entries)


def device_platform() -> str | None:
    """The platform of the devices of the `with mesh:` mesh (verify's child holds the mesh it compiles
    for there), None without one or for an abstract mesh: a dump, which compiles nothing. (Inside
    `jax.jit`, `jax.set_mesh`'s devices cannot be asked for.)"""
    mesh = current_legacy_mesh()
    if isinstance(mesh, jax.sharding.Mesh) and not mesh.empty:
        return getattr(mesh.devices.flat[0], "platform", None)
    return None


@dataclasses.dataclass(frozen=True)
class Dispatch:
    """What the shard_map body needs to know of the mesh and the model."""

    num_experts: int
    top_k: int
    dtype: Any
    ep_axes: tuple[str, ...]  # the experts' mesh axes: expert parallelism
    ep: int
    tp: bool  # `tensor` splits the experts' hidden dimension: reduce-scatter the down projection
    cpu: bool = False  # the mesh's devices are CPUs (see `exchange`)

    def buffer_size(self, rows: int) -> int:
        """MaxText's `get_ragged_buffer_size` without `ragged_buffer_factor`: the worst case, every
        routed token of this device landing on one expert shard (at most E/k times its share)."""
        return int(rows * min(self.ep, self.num_experts / self.top_k))


def all_to_all_params(sizes: jax.Array, shard: jax.Array, dispatch: bool) -> tuple[jax.Array, ...]:
    """(input offsets, send sizes, output offsets, receive sizes) of a ragged_all_to_all, from
    `sizes[i, j]`: the rows batch shard i sends to expert shard j (MaxText's `get_all_to_all_params`,
    batch sharded). The way back (`dispatch=False`) reads the transposed matrix."""
    matrix = sizes if dispatch else sizes.T
    local = matrix[shard]
    input_offsets = jnp.concatenate((jnp.zeros((1,), local.dtype), jnp.cumsum(local)[:-1]))
    stacked = jnp.concatenate((jnp.zeros((1,) + matrix.shape[1:], matrix.dtype), matrix), axis=0)
    output_offsets = jnp.cumsum(stacked, axis=0, dtype=matrix.dtype)[shard]
    return input_offsets, local, output_offsets, matrix[:, shard]


def exchange(d: Dispatch, rows: jax.Array, sizes: jax.Array, shard: jax.Array, out_rows: int,
             dispatch: bool) -> jax.Array:
    """Sends `rows` (grouped by destination) over the expert axes, received into `out_rows` rows
    grouped by sender: `jax.lax.ragged_all_to_all`. XLA:CPU has no ragged all-to-all, so for a mesh of
    CPU devices the same rows are picked out of an all-gather of every shard's rows (each device holds
    all of them for a moment: more memory than the TPU's exchange, the same values)."""
    input_offsets, send, output_offsets, recv = all_to_all_params(sizes, shard, dispatch)
    if not d.cpu:
        out = jnp.zeros((out_rows, rows.shape[1]), rows.dtype)
        return jax.lax.ragged_all_to_all(rows, out, input_offsets, send, output_offsets, recv, axis_name=d.ep_axes)
    matrix = sizes if dispatch else sizes.T  # matrix[i, j]: rows shard i sends to shard j
    everyone = jax.lax.all_gather(rows, d.ep_axes)
    block_end = jnp.cumsum(recv)
    row = jnp.arange(out_rows)
    sender = jnp.minimum(jnp.searchsorted(block_end, row, side="right"), d.ep - 1)
    source_start = jnp.cumsum(matrix, axis=1)[:, shard] - matrix[:, shard]
    source = source_start[sender] + row - (block_end - recv)[sender]
    valid = row < block_end[-1]
    return jnp.where(valid[:, None], everyone[sender, jnp.where(valid, source, 0)], 0)


def local_permute(rows: jax.Array, global_sizes: jax.Array, local_experts: int,
                  shard: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Rows received from every batch shard (grouped by sender, then by expert) sorted by local
    expert: (sorted rows, the order, tokens per local expert, the local expert of each row)."""
    mine = jax.lax.dynamic_slice_in_dim(global_sizes, shard * local_experts, local_experts, axis=1)
    per_sender = mine.reshape(-1)
    group_sizes = jnp.sum(mine, axis=0)
    expert_of = jnp.repeat(jnp.arange(per_sender.shape[0]) % local_experts, per_sender,
                           total_repeat_length=rows.shape[0])
    order = jnp.argsort(expert_of)
    return sort_rows(rows, order), order, group_sizes, expert_of[order]


def gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, dtype: Any) -> jax.Array:
    """Grouped matmul: row block g of `lhs` times `rhs[g]` (jax.lax.ragged_dot)."""
    return jax.lax.ragged_dot(lhs.astype(dtype), rhs.astype(dtype), group_sizes.astype(jnp.int32),
                              preferred_element_type=dtype)


def dispatch_body(d: Dispatch, route: Callable[..., tuple[jax.Array, jax.Array]],
                  unit: Callable[[jax.Array, jax.Array], jax.Array], x: jax.Array, logits: jax.Array,
                  router: dict[str, jax.Array], w: dict[str, jax.Array]) -> jax.Array:
    """One device's part of the sorted dispatch (see the module docstring)."""
    batch, length, embed = x.shape
    weights, selected = route(logits, router)
    rows = x.reshape(batch * length, embed)
    flat = selected.reshape(-1)
    order = jnp.argsort(flat)
    x_sorted = sort_rows(jnp.repeat(rows, d.top_k, axis=0), order).astype(d.dtype)
    group_sizes = jnp.bincount(flat, length=d.num_experts)
    expert_of = jnp.repeat(jnp.arange(d.num_experts), group_sizes, total_repeat_length=flat.shape[0])

    if d.ep > 1:
        local_experts = d.num_experts // d.ep
        shard = jax.lax.axis_index(d.ep_axes)
        to_shard = jnp.sum(group_sizes.reshape(-1, local_experts), axis=1)
        all_sizes = jax.lax.all_gather(to_shard, d.ep_axes)
        received = exchange(d, x_sorted, all_sizes, shard, d.buffer_size(x_sorted.shape[0]), True)
        global_sizes = jax.lax.all_gather(group_sizes, d.ep_axes)
        tokens, local_order, groups, expert_of = local_permute(received, global_sizes, local_experts, shard)
    else:
        tokens, groups = x_sorted, group_sizes

    valid = (jnp.arange(tokens.shape[0]) < jnp.sum(groups))[:, None]
    gate, up = gmm(tokens, w["wi_0"], groups, d.dtype), gmm(tokens, w["wi_1"], groups, d.dtype)
    if "wi_0_bias" in w:
        gate = jnp.where(valid, gate + w["wi_0_bias"][expert_of].astype(d.dtype), 0)
        up = jnp.where(valid, up + w["wi_1_bias"][expert_of].astype(d.dtype), 0)
    out = gmm(unit(gate, up).astype(d.dtype), w["wo"], groups, d.dtype)
    if d.tp:
        out = jax.lax.psum_scatter(out, TENSOR_AXIS, scatter_dimension=1, tiled=True)
    if "wo_bias" in w:
        out = jnp.where(valid, out + w["wo_bias"][expert_of].astype(d.dtype), 0)

    if d.ep > 1:
        back = sort_rows(out, jnp.argsort(local_order))
        out = exchange(d, back, all_sizes, shard, flat.shape[0], False)
    unsorted = sort_rows(out, jnp.argsort(order)).reshape(batch * length, d.top_k, -1)
    combined = jnp.einsum("BKE,BK->BE", unsorted.astype(jnp.float32),
                          weights.reshape(batch * length, d.top_k).astype(jnp.float32))
    return combined.reshape(batch, length, -1).astype(d.dtype)


def sorted_dispatch(num_experts: int, top_k: int, dtype: Any, route: Callable[..., tuple[jax.Array, jax.Array]],
                    unit: Callable[[jax.Array, jax.Array], jax.Array], x: jax.Array, logits: jax.Array,
                    router: dict[str, jax.Array], w: dict[str, jax.Array]) -> jax.Array:
    """The routed experts' output (batch, length, embed) by MaxText's sorted dispatch.

    `route(logits, router)` gives (weights, experts) per token, `router` holding the replicated
    routing parameters (bias, per-expert scale); `unit(gate, up)` is the gated unit; `w` holds
    `wi_0`, `wi_1`, `wo` and, with `mlp_bias`, their biases."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:  # no mesh (a model's init): one device's dispatch, no shard_map
        return dispatch_body(Dispatch(num_experts, top_k, dtype, (), 1, False), route, unit, x, logits, router, w)
    sizes = dict(mesh.shape)
    wi_spec, wo_spec = mesh_spec(WI_AXES, (FSDP_AXIS,)), mesh_spec(WO_AXES, (FSDP_AXIS,))
    ep_axes = _axes(wi_spec[0])
    ep = math.prod(sizes.get(a, 1) for a in ep_axes)
    hidden_axes = _axes(wi_spec[2])
    d = Dispatch(num_experts, top_k, dtype, ep_axes, ep, TENSOR_AXIS in hidden_axes and sizes.get(TENSOR_AXIS, 1) > 1,
                 device_platform() == "cpu")
    token_spec = mesh_spec(TOKEN_AXES)
    if ep == 1:  # tokens may stay whole where the batch does not divide (MaxText: only without EP)
        token_spec = fitting_spec(token_spec, x.shape, sizes)
    out_spec = fitting_spec(mesh_spec(OUTPUT_AXES), x.shape, sizes) if ep == 1 else mesh_spec(OUTPUT_AXES)
    w_specs = {"wi_0": wi_spec, "wi_1": wi_spec, "wo": wo_spec}
    # The biases split as the products they are added to: the hidden dimension as the weights', the
    # output's over `tensor` after the reduce-scatter (MaxText names them (exp, activation_mlp) and
    # (exp, activation_embed), which its rules map to the same axes).
    hidden = PartitionSpec(wi_spec[0], wi_spec[2])
    output = PartitionSpec(wi_spec[0], TENSOR_AXIS if d.tp else None)
    bias_specs = {"wi_0_bias": hidden, "wi_1_bias": hidden, "wo_bias": output}
    w_specs.update({name: spec for name, spec in bias_specs.items() if name in w})
    router_specs = {name: PartitionSpec() for name in router}
    body = functools.partial(dispatch_body, d, route, unit)
    return jax.shard_map(body, in_specs=(token_spec, token_spec, router_specs, w_specs), out_specs=out_spec,
                         check_vma=False)(x, logits, router, w)
