"""Dump flax's own lm1b and NNX Gemma 3 1B training models through the documented program interface,
from a flax checkout, with no edit to their source.

    pip install jaxtyping            # flax's Gemma imports it
    python tools/flax_examples.py --flax-dir /path/to/flax [--golden-dir DIR]

For each model it runs `sharding-dump --model flax_examples:<factory> ...` (the factories below
return `sd.ModelProgram`s over flax's modules, configured as flax's trainers configure them), then
prints the parameter count and checks: lm1b 49,653,040 parameters; Gemma 738,225,280 (Gemma 3 1B
with the lm1b trainer's 35,008-token vocabulary), and every activation spec of its ShardingConfig
(`act_btd`, `act_btf`, `act_btnh`) present in activation_shardings.json forward and backward.
Exit status 0 when all hold, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
REPO = TOOLS.parent
FLAX_DIR = "SHARDING_DUMP_FLAX_DIR"  # environment: the flax checkout the factories import from
LM1B_PARAMS, GEMMA_PARAMS = 49_653_040, 738_225_280
CASE = ["--topology", "cpu-8", "ici_fsdp_parallelism=4", "ici_tensor_parallelism=2", "per_device_batch_size=32",
        "max_target_length=128"]


def _import_from(example: str) -> None:
    path = str(Path(os.environ[FLAX_DIR]) / "examples" / example)
    if path not in sys.path:
        sys.path.insert(0, path)


def lm1b():
    """lm1b's training model: train.py's `train_config` from configs/default.py (dropout on)."""
    import flax.linen as nn
    import jax.numpy as jnp

    import sharding_dump as sd

    _import_from("lm1b")
    import models

    config = models.TransformerConfig(vocab_size=30_000, output_vocab_size=30_000, dtype=jnp.bfloat16, emb_dim=512,
                                      num_heads=8, num_layers=6, qkv_dim=512, mlp_dim=2048, max_len=512,
                                      dropout_rate=0.1, attention_dropout_rate=0.1, deterministic=False, decode=False,
                                      kernel_init=nn.initializers.xavier_uniform(),
                                      bias_init=nn.initializers.normal(stddev=1e-6))
    return sd.ModelProgram(models.TransformerLM(config), inputs={"inputs_segmentation": sd.Input()})


def gemma():
    """Gemma 3 1B as flax's Gemma train.py builds it (its fsdp/tensor ShardingConfig, the lm1b vocabulary),
    called as its train step calls it: positions, no cache, the causal mask of the tokens, rngs."""
    import jax.numpy as jnp
    from flax import nnx

    import sharding_dump as sd

    _import_from("gemma")
    import transformer as transformer_lib
    from transformer_cfg import ShardingConfig

    shd = ShardingConfig.fsdp_tp_sharding(fsdp_axis_name="fsdp", tensor_parallel_axis_name="tensor")
    config = transformer_lib.TransformerConfig.from_version_name("gemma3_1b", num_embed=35_008, dtype=jnp.bfloat16,
                                                                 shd_config=shd)
    return sd.ModelProgram(lambda: transformer_lib.Transformer(config, rngs=nnx.Rngs(params=0, dropout=0)),
                           positions="positions", kwargs={"cache": None},
                           inputs={"attention_mask": lambda b: transformer_lib.make_causal_attn_mask(b["inputs"] > 0)})


def _dump(factory: str, rule: str, golden: Path, extra: list[str]) -> Path:
    from sharding_dump.commands import cli

    status = cli.main(["--model", f"flax_examples:{factory}", "--rule", rule, *CASE, *extra, "--golden-dir", str(golden)])
    if status != 0:
        raise SystemExit(status)
    return next((golden / f"flax_examples-{factory}").rglob("named_shardings.json")).parent


def _params(folder: Path) -> int:
    tensors = json.loads((folder / "named_shardings.json").read_text())["tensors"]
    return sum(math.prod(t["shape"]) for path, t in tensors.items() if path.startswith("params/"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flax-dir", required=True, help="a flax checkout (its examples/lm1b and examples/gemma)")
    parser.add_argument("--golden-dir", help="where to write the dumps (default: a temporary folder)")
    args = parser.parse_args(argv)
    os.environ[FLAX_DIR] = str(Path(args.flax_dir).resolve())
    sys.path.insert(0, str(TOOLS))
    os.chdir(REPO)
    golden = Path(args.golden_dir or tempfile.mkdtemp(prefix="flax-examples-"))
    failures = []
    lm1b_dir = _dump("lm1b", "examples/lm1b_rules.yml", golden, [])
    count = _params(lm1b_dir)
    print(f"lm1b: {count:,} parameters ({'ok' if count == LM1B_PARAMS else f'expected {LM1B_PARAMS:,}'})")
    failures += [] if count == LM1B_PARAMS else ["lm1b parameters"]
    gemma_dir = _dump("gemma", "examples/gemma_rules.yml", golden, ["shard_mode=explicit"])
    count = _params(gemma_dir)
    print(f"gemma3_1b: {count:,} parameters ({'ok' if count == GEMMA_PARAMS else f'expected {GEMMA_PARAMS:,}'})")
    failures += [] if count == GEMMA_PARAMS else ["gemma parameters"]
    acts = json.loads((gemma_dir / "activation_shardings.json").read_text())["tensors"]
    btd, btf, btnh = ["fsdp", None, "tensor"], ["fsdp", None, "tensor"], ["fsdp", None, "tensor", None]
    expected = {"embedder/__call__": btd, "embedder/attend": btd}  # act_btd on the embedding and the logits
    for layer in range(26):
        expected.update({f"layers/{layer}/attn/q_einsum/__call__": btnh, f"layers/{layer}/attn/attn_vec_einsum/__call__": btd,
                         f"layers/{layer}/mlp/gate_proj/__call__": btf, f"layers/{layer}/mlp/up_proj/__call__": btf,
                         f"layers/{layer}/mlp/down_proj/__call__": btd})
    for pass_ in ("forward", "backward"):
        wrong = [k for k, spec in expected.items() if acts.get(f"{pass_}/{k}", {}).get("partition_spec") != spec]
        print(f"gemma3_1b {pass_}: {len(expected) - len(wrong)} of {len(expected)} ShardingConfig activation specs "
              f"(act_btd, act_btf, act_btnh) present" + (f"; missing or different: {wrong[:3]}" if wrong else ""))
        failures += [f"gemma activations {pass_}"] if wrong else []
    print(f"dumps in {golden}")
    if failures:
        print(f"FAILED: {', '.join(failures)}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
