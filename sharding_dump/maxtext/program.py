"""Dump a case through the installed MaxText's own code, many cases in one process.

What runs is MaxText's, in the order its `train_compile` runs it: `pyconfig` composes the config
(base.yml or the case's config file, then the KEY=VALUE words, the model config and the
custom_mesh_and_rule file they name); `get_topology_mesh` builds MaxText's topology mesh (libtpu's
topology description, no TPU needed); `get_shaped_inputs` builds its model, optimizer, abstract train
state and state shardings; `get_functional_train_with_signature` gives its train step with its in and
out shardings, which is traced (never compiled) for the activation placements it states. The golden
documents are written from what those calls return: each leaf's NamedSharding as MaxText placed it,
its logical axes as the variable's metadata declares them (the names MaxText's placement resolves,
with the stacked-layer axis where the metadata puts it), and every constraint of the traced step,
read by :mod:`sharding_dump.core.capture`.

MaxText is imported once per process (:class:`MaxText`), on first use; its absence, and anything
MaxText raises for a case, is a BadInput of one line naming MaxText's own reason.
"""

from __future__ import annotations

import contextlib
import io
import os
from typing import Any

from sharding_dump.errors import BadInput, one_line
from sharding_dump.maxtext.case import MaxTextCase

INSTALL = "pip install --no-deps -r requirements-maxtext.txt of sharding-dump's repository (docs/guide/guard-your-maxtext.md)"


class MaxText:
    """The installed MaxText's modules, imported once."""

    def __init__(self) -> None:
        # libtpu's lock file guards a TPU's chips; a topology description uses none, and another
        # process holding the lock (a second dump, a compile) must not refuse this one.
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                import jax
                from flax import nnx
                from maxtext.configs import pyconfig
                from maxtext.trainers.pre_train import train, train_compile
                from maxtext.utils import maxtext_utils, sharding
                from maxtext.utils.globals import MAXTEXT_PKG_DIR
        except ImportError as err:
            raise BadInput(f"MaxText is not importable here ({err}): {INSTALL}") from None
        import maxtext

        self.jax, self.nnx = jax, nnx
        self.pyconfig, self.train, self.train_compile = pyconfig, train, train_compile
        self.maxtext_utils, self.sharding = maxtext_utils, sharding
        self.base_config = os.path.join(MAXTEXT_PKG_DIR, "configs", "base.yml")
        self.version = getattr(maxtext, "__version__", "") or _version()

    def config(self, case: MaxTextCase) -> Any:
        """MaxText's config for the case, composed by MaxText; its refusal is MaxText's reason."""
        initialize = getattr(self.pyconfig, "_initialize_pydantic", None)
        with _maxtext_says(case, "its config"):
            if initialize is None:  # a MaxText without the raising variant (it exits 2 on a bad config)
                return self.pyconfig.initialize(case.argv(self.base_config))
            # initialize() would log the reason and call sys.exit(2); this is the same composition
            # with the reason kept
            config = self.pyconfig.HyperParameters(initialize(case.argv(self.base_config)))
            self.train_compile.validate_config(config)
            return config

    def documents(self, case: MaxTextCase) -> dict[str, dict[str, Any]]:
        """The golden documents of one case, as MaxText's own code builds and places its state and step,
        with the key implementation MaxText's train_compile sets; the jax options MaxText's code sets
        (`get_topology_mesh` sets one) are put back afterwards, so the caller's process keeps its own."""
        before = dict(self.jax.config.values)
        try:
            with self.jax.default_prng_impl("unsafe_rbg"):
                return self._documents(case)
        finally:
            for name, value in before.items():
                if self.jax.config.values.get(name) != value:
                    self.jax.config.update(name, value)

    def _documents(self, case: MaxTextCase) -> dict[str, dict[str, Any]]:
        from sharding_dump.core import capture, documents
        from sharding_dump.core.layout import TensorLayout, mesh_sizes, path_text

        config = self.config(case)
        mt = self
        with _maxtext_says(case, "its topology mesh"):
            mesh = mt.train_compile.get_topology_mesh(config)
        with _maxtext_says(case, "its train state"):
            shaped, _, state_shardings, _, model = mt.train_compile.get_shaped_inputs(mesh, config)
        with _maxtext_says(case, "its train step"), mt.jax.numpy_dtype_promotion("standard"):
            params_shardings, step_shardings = mt.sharding.maybe_update_params_sharding_with_opt(config, state_shardings)
            input_shardings = mt.sharding.build_zero1_input_state_mesh_shardings(config, step_shardings, params_shardings)
            data_sharding = mt.sharding.get_input_data_sharding(config, mesh)
            step, in_shard, out_shard, _, _ = mt.maxtext_utils.get_functional_train_with_signature(
                mt.train.train_step, data_sharding, input_shardings, model, config, params_shardings)
            jitted = mt.jax.jit(step, in_shardings=in_shard, out_shardings=out_shard)
            constraints = [_constrained(c) for c in
                           capture.record_activations(jitted, *shaped, mesh=mesh, rules=config.logical_axis_rules)]
        sizes = mesh_sizes(mesh)
        axes = self.logical_axes(shaped[0])
        arrays = {path_text(p): leaf for p, leaf in mt.jax.tree_util.tree_leaves_with_path(shaped[0])}
        layouts = []
        for key_path, sharding in mt.jax.tree_util.tree_leaves_with_path(state_shardings):
            path = path_text(key_path)
            leaf = arrays[path]  # an RNG key as the zoo writes one: the typed key (`key<rbg>`, MaxText's impl)
            layouts.append(TensorLayout(path, tuple(leaf.shape), str(leaf.dtype), axes.get(path, ()),
                                        sharding.spec, sizes))
        layouts.sort(key=lambda t: t.path)
        shard_mode = "explicit" if "explicit" in str(config.shard_mode).lower() else "auto"
        header = {"case": case.header(), **documents.mesh_header(mesh, shard_mode)}
        batch = {"batch": {"global_batch_size": int(config.global_batch_size_to_train_on),
                           "max_target_length": int(config.max_target_length),
                           "per_device_batch_size": config.per_device_batch_size,
                           "data_pipeline_spec": _spec_json(data_sharding.spec)}}
        return documents.golden_documents(layouts, mesh, constraints, header=header, activation_header=batch)

    def logical_axes(self, state: Any) -> dict[str, tuple[str | None, ...]]:
        """Per leaf path, the logical axes its variable's metadata declares, the stacked-layer axis
        inserted where the metadata says (the names MaxText's placement resolves with its rules)."""
        from sharding_dump.core.layout import path_text

        nnx = self.nnx
        out = {}
        for key_path, var in self.jax.tree_util.tree_leaves_with_path(state, is_leaf=lambda x: isinstance(x, nnx.Variable)):
            if not isinstance(var, nnx.Variable):
                continue
            meta = var.get_metadata()
            names = meta.get("out_sharding") or meta.get("sharding_names") or meta.get("sharding")
            if not names or not isinstance(names, (tuple, list, str)):
                continue
            names = [names] if isinstance(names, str) else list(names)
            if "param_scan_axis" in meta and nnx.PARTITION_NAME in meta and meta[nnx.PARTITION_NAME] not in names:
                names.insert(meta.get("param_scan_axis", 0), meta[nnx.PARTITION_NAME])
            out[path_text(key_path)] = tuple(names)
        return out


def _constrained(constraint: Any) -> Any:
    """A constraint as the golden format writes it: a dimension left to XLA (`P.UNCONSTRAINED`,
    MaxText's pipeline does) unsplit, as the format has no word for it (a limit the docs state). An RNG
    key (MaxText's pipeline carries one) stays the typed key, as the state's keys and the zoo's are."""
    import dataclasses

    from jax.sharding import PartitionSpec

    spec = constraint.partition_spec
    if any(entry is PartitionSpec.UNCONSTRAINED for entry in spec):
        spec = PartitionSpec(*(None if entry is PartitionSpec.UNCONSTRAINED else entry for entry in spec))
        constraint = dataclasses.replace(constraint, partition_spec=spec)
    return constraint


def _spec_json(spec: Any) -> list[Any]:
    from sharding_dump.core.specs import spec_to_json

    return spec_to_json(spec, len(spec))


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("maxtext")
    except PackageNotFoundError:
        return "unknown"


@contextlib.contextmanager
def _maxtext_says(case: MaxTextCase, what: str):  # type: ignore[no-untyped-def]
    """MaxText's own exception, raised while it builds `what` for `case`, as one line."""
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    except BadInput:
        raise
    except (Exception, SystemExit) as err:  # MaxText's reason, whatever it raised
        reason = str(err).strip().splitlines()
        text = next((line.strip() for line in reason if line.strip()), "") if reason else ""
        if type(err).__name__ == "ValidationError" and len(reason) > 1:  # pydantic: the field, then why
            text = "; ".join(line.strip() for line in reason[1:3])
        raise BadInput(one_line(f"MaxText refuses {case.label}: {what}: {type(err).__name__}: {text or 'no message'}")) from None


_RUNNER: MaxText | None = None


def maxtext() -> MaxText:
    """The process's MaxText, imported on first use."""
    global _RUNNER
    if _RUNNER is None:
        _RUNNER = MaxText()
    return _RUNNER
