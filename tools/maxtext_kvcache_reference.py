"""Records the KV cache MaxText's own code builds for llama2-7b under its inference configuration.

Run with a MaxText installation (its own jax and flax), not this package's environment:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tools/maxtext_kvcache_reference.py OUT.json

MaxEngine builds the model twice, in prefill and in autoregressive mode (`nnx.eval_shape`, nothing
allocated) and places every `nnx.Cache` variable by the configuration's logical axis rules
(`maxtext_utils._nnx_cache_partition_specs`, what `MaxEngine.kv_cache_annotations` holds). Per case
(mesh settings, quantize_kvcache) this writes each cache variable's shape, dtype, logical axes and
partition spec, with the mesh and the rules used. MaxText's `inference/inference.yml` does not
resolve as it is: its rules and data_sharding name `tensor_transpose`, which base.yml's mesh_axes no
longer has ('Resource axis: tensor_transpose ... is not found in mesh'); it is read with that axis
dropped, and the file records so.
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
from pathlib import Path

CASES = [["ici_fsdp_parallelism=-1"], ["ici_fsdp_parallelism=1", "ici_tensor_parallelism=8", "quantize_kvcache=true"]]
SETTINGS = ["model_name=llama2-7b", "per_device_batch_size=1", "max_prefill_predict_length=1024",
            "max_target_length=2048", "hardware=cpu", "skip_jax_distributed_system=true", "attention=dot_product"]


def main(out: str) -> int:
    import jax
    import maxtext
    from flax import nnx
    from maxtext.configs import pyconfig
    from maxtext.inference.maxengine import maxengine
    from maxtext.utils import maxtext_utils

    configs = Path(maxtext.__file__).parent / "configs"
    text = (configs / "inference/inference.yml").read_text()
    fixed = re.sub(r"'tensor_transpose', ?|, ?'tensor_transpose'", "", text)
    fixed = fixed.replace('base_config: "base.yml"', f'base_config: "{configs / "base.yml"}"')
    cases = []
    with tempfile.TemporaryDirectory() as work:
        path = Path(work) / "inference.yml"
        path.write_text(fixed)
        for extra in CASES:
            config = pyconfig.initialize(["", str(path)] + SETTINGS + extra)
            engine = maxengine.MaxEngine(config)
            modes = {}
            for mode, model in (("prefill", engine.model), ("autoregressive", engine.model_ar)):
                specs = maxtext_utils._nnx_cache_partition_specs(model, config, engine.mesh)
                _, cache, _ = nnx.split(model, nnx.Cache, ...)
                leaves = {}
                for key, var in nnx.to_flat_state(cache):
                    value = var.get_value()
                    leaves["/".join(map(str, key))] = {"shape": list(value.shape), "dtype": str(value.dtype),
                                                       "logical_axes": list(var.get_metadata().get("out_sharding") or ())}
                for key, spec in jax.tree_util.tree_leaves_with_path(
                        specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)):
                    name = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in key)
                    leaves[name]["partition_spec"] = [list(e) if isinstance(e, tuple) else e for e in spec]
                modes[mode] = leaves
            cases.append({"settings": SETTINGS + extra, "mesh": dict(engine.mesh.shape),
                          "logical_axis_rules": [[n, a if isinstance(a, (str, type(None))) else list(a)]
                                                 for n, a in config.logical_axis_rules],
                          "cache": modes})
    record = {"maxtext": getattr(maxtext, "__version__", "0.2.5"), "jax": jax.__version__,
              "config": "inference/inference.yml, with 'tensor_transpose' dropped from its rules and data_sharding "
                        "(base.yml's mesh_axes has no such axis: MaxText refuses the file as it is)",
              "tensor_transpose_in_inference_yml": text.count("tensor_transpose"), "cases": cases}
    Path(out).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
