"""The child process of `sharding-dump verify`: compiles one case's training step and writes its figures.

    python -m sharding_dump.commands.verify.child WORK_DIR

It runs in its own process because the number of fake CPU devices (`XLA_FLAGS=
--xla_force_host_platform_device_count=N`, set by the parent) must be fixed before jax starts. It
reads WORK_DIR/request.json (the case, the golden's partition specs, the replicated threshold, --tpu)
and writes WORK_DIR/result.json. Its fd 2 is a file the parent reads: XLA's partitioner warnings are
written there from C++, out of reach of any Python-level capture.
"""

from __future__ import annotations

import json
import resource
import sys
import tempfile
from pathlib import Path
from typing import Any

from sharding_dump.commands.verify.run import COMPILING

# After the partitioner's shardy pass: the module with global shapes and every instruction's sharding.
PROPAGATED_DUMP = "after_shardy-xla"


def _mesh(parts: Any, tpu_topology: str | None, num_slices: int) -> Any:
    """The case's concrete mesh: fake CPU devices, or the devices of a TPU topology (no TPU needed)."""
    import jax
    import numpy as np
    from jax.experimental import mesh_utils
    from jax.sharding import AxisType, Mesh

    from sharding_dump.zoo.mesh import device_grid

    axis_types = (AxisType.Explicit if parts.explicit else AxisType.Auto,) * len(parts.axis_names)
    shape = tuple(i * d for i, d in zip(parts.ici, parts.dcn))
    if tpu_topology is None:
        return jax.make_mesh(shape, parts.axis_names, axis_types=axis_types)
    from jax.experimental import topologies

    devices = topologies.get_topology_desc(tpu_topology, "tpu", num_slices=num_slices).devices
    if num_slices > 1:  # as MaxText builds its mesh (maxtext_utils.create_device_mesh)
        grid = mesh_utils.create_hybrid_device_mesh(parts.ici, parts.dcn, devices,
                                                    allow_split_physical_axes=parts.allow_split)
    else:
        grid = device_grid(shape, devices, parts.allow_split)
    return Mesh(np.asarray(grid), parts.axis_names, axis_types=axis_types)


def _spec(items: list[Any]) -> Any:
    from jax.sharding import PartitionSpec

    return PartitionSpec(*[tuple(e) if isinstance(e, list) else e for e in items])


def _spec_json(sharding: Any, ndim: int) -> Any:
    from sharding_dump.core import specs

    spec = getattr(sharding, "spec", None)
    return specs.spec_to_json(spec, ndim) if spec is not None else str(sharding)


def _mismatches(compiled: Any, parts: Any, golden: dict[str, Any] | None, mesh: Any) -> list[list[Any]]:
    """[golden path, golden spec, compiled spec] for every state leaf whose compiled input or output
    sharding is not equivalent to the golden's (or that one side lacks; the golden's leaves the step does
    not take aside)."""
    import jax
    from jax.sharding import NamedSharding

    from sharding_dump.commands.verify.step import leaf_path

    if golden is None:
        return []
    shapes = {parts.golden_paths.get(leaf_path(k), leaf_path(k)): v
              for k, v in jax.tree_util.tree_leaves_with_path(parts.state)}
    golden = {path: spec for path, spec in golden.items() if path not in parts.uncompiled}
    out: list[list[Any]] = []
    seen = set()
    for shardings in (compiled.input_shardings[0][0], compiled.output_shardings[0]):
        for key, sharding in jax.tree_util.tree_leaves_with_path(shardings):
            if parts.golden_paths and leaf_path(key) not in parts.golden_paths:
                continue  # held otherwise by the golden's build: compiled replicated, not compared
            path = parts.golden_paths.get(leaf_path(key), leaf_path(key))
            ndim = len(shapes[path].shape)
            if path not in golden:
                bad = True
            else:
                bad = not sharding.is_equivalent_to(NamedSharding(mesh, _spec(golden[path])), ndim)
            if bad and path not in seen:
                seen.add(path)
                out.append([path, golden.get(path), _spec_json(sharding, ndim)])
    out += [[path, spec, None] for path, spec in golden.items() if path not in shapes]
    return sorted(out, key=lambda item: item[0])


def _stand_ins(parts: Any, state_shardings: Any, batch_shardings: Any) -> tuple[Any, Any]:
    """The abstract state and batch the step is lowered with: on a mesh whose axes are Explicit each
    carries its sharding in its type, as the arrays a server or trainer passes do (the step's own
    sharding-in-types checks, e.g. a dynamic_update_slice of a cache, see the layouts it runs on)."""
    import jax

    if not parts.explicit:
        return parts.state, parts.batch

    def typed(x: Any, sharding: Any) -> Any:
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return jax.tree.map(typed, parts.state, state_shardings), jax.tree.map(typed, parts.batch, batch_shardings)


def run(request: dict[str, Any]) -> dict[str, Any]:
    """Compiles the requested case's step; the answer the parent reads."""
    import flax.linen as nn
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from sharding_dump.commands.verify import hlo as hlo_text
    from sharding_dump.commands.verify.step import build_step, leaf_path
    from sharding_dump.core.legacy_mesh import legacy_mesh
    from sharding_dump.zoo.case import Case

    c = request["case"]
    case = Case.make(c["model"], c["topology"], c["rule"], c["num_slices"], c["overrides"], project=False)
    parts = build_step(case)
    mesh = _mesh(parts, request["tpu_topology"] if request["tpu"] else None, case.num_slices)
    state_shardings = jax.tree_util.tree_map_with_path(
        lambda key, _: NamedSharding(mesh, parts.state_specs[leaf_path(key)]), parts.state)
    batch_shardings = {name: NamedSharding(mesh, PartitionSpec(*(tuple(parts.batch_spec) + (None,) * x.ndim)[:x.ndim]))
                       for name, x in parts.batch.items()}
    answer: dict[str, Any] = {"jax_version": jax.__version__}
    with tempfile.TemporaryDirectory(prefix="verify-dump-") as dump_dir:
        options = {"xla_dump_to": dump_dir, "xla_dump_hlo_pass_re": "^shardy-xla$"}
        with jax.set_mesh(mesh), legacy_mesh(mesh), nn.logical_axis_rules(parts.logical_axis_rules):
            jitted = jax.jit(parts.step, in_shardings=(state_shardings, batch_shardings),  # metrics replicated
                             out_shardings=(state_shardings, NamedSharding(mesh, PartitionSpec())), donate_argnums=0)
            lowered = jitted.lower(*_stand_ins(parts, state_shardings, batch_shardings))
            Path(request["work"], COMPILING).touch()  # the parent bounds the compile from now
            try:
                compiled = lowered.compile(compiler_options=options)
            except Exception as err:  # XLA's verdict, e.g. RESOURCE_EXHAUSTED on a TPU topology
                answer["compile_error"] = " ".join(str(err).split())[:1000]
                compiled = None
        propagated = sorted(p for p in Path(dump_dir).glob(f"*{PROPAGATED_DUMP}*.txt"))
        if compiled is not None:
            memory = compiled.memory_analysis()
            answer["memory"] = {"argument": memory.argument_size_in_bytes, "output": memory.output_size_in_bytes,
                                "alias": memory.alias_size_in_bytes, "temp": memory.temp_size_in_bytes}
            program = compiled.as_text()
            traffic = hlo_text.collectives(program)
            answer["replicated"] = [vars(v) for v in hlo_text.gathered_values(program, request["threshold"], parts.stacks)]
            answer["collectives"] = {k: {"count": t.count, "bytes": t.bytes} for k, t in traffic.items()}
            answer["mismatches"] = _mismatches(compiled, parts, request["golden"], mesh)
        if propagated:
            values = hlo_text.replicated_values(propagated[-1].read_text(encoding="utf-8"), request["threshold"])
            answer["replicated"] = [vars(v) for v in values] + answer.get("replicated", [])
        elif compiled is not None:
            answer["compile_error"] = "no module after sharding propagation was dumped; cannot check replicated values"
    return answer


def main(argv: list[str]) -> int:
    """Exit 0 with the figures in result.json; 2 with `bad_input`, the one line the parent prints
    (the case's own bad input: a program that fails, exits or runs out of time); 1 with `error`, what
    ended the child otherwise (a MemoryError, a compiler crash)."""
    from sharding_dump.core.boundary import first_line, time_limit
    from sharding_dump.errors import BadInput, one_line, traceback_text

    work = Path(argv[0])
    request = json.loads((work / "request.json").read_text(encoding="utf-8"))
    request["work"] = str(work)
    try:
        with time_limit(request.get("time_limit")):
            answer = run(request)
    except BadInput as err:
        told = {"bad_input": one_line(str(err)), "traceback": traceback_text(err)}  # --traceback prints the latter
        (work / "result.json").write_text(json.dumps(told), encoding="utf-8")
        return 2
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:  # noqa: BLE001: the parent names it (MemoryError, a compiler crash)
        err.__traceback__ = None  # let go of what a MemoryError holds on to
        (work / "result.json").write_text(json.dumps({"error": one_line(first_line(err))[:500]}), encoding="utf-8")
        return 1
    usage = resource.getrusage(resource.RUSAGE_SELF)
    with open("/proc/self/status", encoding="utf-8") as status:
        kib = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    answer.update(cpu_seconds=usage.ru_utime + usage.ru_stime, peak_rss_bytes=kib * 1024)
    (work / "result.json").write_text(json.dumps(answer), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
