"""Hostile user code (issue 28): factories, ModelProgram, TrainProgram, rule specs, verify and the
pytest plugin, tried as a hostile but realistic user would. Each probe must end with exit status 2,
one line on stderr naming the call or argument (and, for a time limit, the limit), no traceback and
nothing written; Ctrl-C must end a run at once with exit 130.

The CLI runs in-process (`cli.main`) where an exit status can be read that way; the interrupts, the
verify child and a user's `while True: pass` run in real processes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from sharding_dump.commands import cli

REPO = Path(__file__).resolve().parents[2]
MAX_LINE = 700

RULES = "mesh_axes: [data]\nlogical_axis_rules:\n  - [batch, data]\n  - [vocab, data]\n"
SIZES = ["--topology", "cpu-2", "ici_data_parallelism=2", "per_device_batch_size=1", "max_target_length=8"]

# The user's code: one module of factories (imported once per probe, under a name of its own).
FACTORIES = '''
import os, sys, time
import jax, jax.numpy as jnp, flax.linen as nn
import sharding_dump as sd


class Tiny(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        table = nn.Embed(64, 8, embedding_init=nn.with_logical_partitioning(nn.initializers.normal(), ("vocab", "embed")))
        return table.attend(table(tokens))


class Exits(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        Tiny()(tokens)
        sys.exit(4)


class Custom(BaseException):
    pass


def tiny():
    return Tiny()


def _init(key):
    return {"params": {"w": jnp.zeros((4, 4))}, "step": jnp.zeros((), jnp.int32)}


def _with_w(state, w):
    return {**state, "params": {"w": w}}


def _program(step):
    return sd.TrainProgram(_init, step)


def _raise(exc):
    raise exc


def silenced_exit():
    sys.stderr = sys.stdout = open(os.devnull, "w")
    sys.exit(0)
def none(): return None
def exit0(): raise SystemExit(0)
def exit3(): sys.exit(3)
def exit_text(): sys.exit("bye")
def interrupt(): raise KeyboardInterrupt
def custom(): raise Custom("odd")
def generator_exit(): raise GeneratorExit
def memory(): raise MemoryError("cannot allocate")
def loops():
    while True:
        pass
def sleeps(): time.sleep(3600)

def step_exit0(): return _program(lambda state, batch: _raise(SystemExit(0)))
def step_exit3(): return _program(lambda state, batch: sys.exit(3))
def step_interrupt(): return _program(lambda state, batch: _raise(KeyboardInterrupt()))
def step_custom(): return _program(lambda state, batch: _raise(Custom("in step")))
def step_loops():
    def step(state, batch):
        while True:
            pass
    return _program(step)
def init_exit(): return sd.TrainProgram(lambda key: sys.exit(1), lambda state, batch: (state, {}))
def model_call_exit(): return Exits()
def hook_exit(): return sd.ModelProgram(Tiny(), call=lambda model, batch, rngs: sys.exit(2))
def input_exit(): return sd.ModelProgram(Tiny(), inputs={"mask": lambda batch: sys.exit(5)})
def logits_custom(): return sd.ModelProgram(Tiny(), logits=lambda out: _raise(Custom("no logits")))

def step_str_leaf(): return _program(lambda state, batch: (_with_w(state, "weights"), {}))
def step_other_shape(): return _program(lambda state, batch: (_with_w(state, jnp.zeros((4, 8))), {}))
def step_other_dtype(): return _program(lambda state, batch: (_with_w(state, jnp.zeros((4, 4), jnp.bfloat16)), {}))
def step_lost_leaf(): return _program(lambda state, batch: ({"params": state["params"]}, {}))
def step_str_metric(): return _program(lambda state, batch: (state, {"loss": "low"}))
def step_none_leaf(): return _program(lambda state, batch: ({**state, "step": None}, {}))

def str_dtype(): return sd.ModelProgram(Tiny(), inputs={"mask": sd.Input(dtype="str")})
def int_logits(): return sd.ModelProgram(Tiny(), logits=lambda out: out.astype(jnp.int32))
def init_none(): return sd.TrainProgram(lambda key: None, lambda state, batch: (state, {}))
def bad_dtype(): return sd.ModelProgram(Tiny(), inputs={"mask": sd.Input(dtype="notadtype")})
def bad_axes(): return sd.ModelProgram(Tiny(), inputs={"mask": sd.Input(logical_axes=(3, None))})
def axes_rank(): return sd.ModelProgram(Tiny(), inputs={"mask": sd.Input(logical_axes=("batch",))})
def axes_string(): return sd.ModelProgram(Tiny(), inputs={"mask": sd.Input(logical_axes="batch")})
def negative_shape(): return sd.ModelProgram(Tiny(), inputs={"mask": sd.Input(shape=(-1, "length"))})
def float_shape(): return sd.ModelProgram(Tiny(), inputs={"mask": sd.Input(shape=(2.5,))})
def inputs_list(): return sd.ModelProgram(Tiny(), inputs=[sd.Input()])
def inputs_value(): return sd.ModelProgram(Tiny(), inputs={"mask": 5})
def rngs_number(): return sd.ModelProgram(Tiny(), rngs=5)
def rngs_numbers(): return sd.ModelProgram(Tiny(), rngs=(1, 2))
def logits_float(): return sd.ModelProgram(Tiny(), logits=2.5)
def logits_bool(): return sd.ModelProgram(Tiny(), logits=True)
def kwargs_list(): return sd.ModelProgram(Tiny(), kwargs=[("deterministic", True)])
def positions_number(): return sd.ModelProgram(Tiny(), positions=3)
def call_number(): return sd.ModelProgram(Tiny(), call=5)
def model_number(): return sd.ModelProgram(5)
def train_init_number(): return sd.TrainProgram(3, lambda state, batch: (state, {}))
def train_step_none(): return sd.TrainProgram(_init, None)
def train_batch_list(): return sd.TrainProgram(_init, lambda state, batch: (state, {}), batch=[sd.Input()])
def train_batch_value(): return sd.TrainProgram(_init, lambda state, batch: (state, {}), batch={"inputs": 5})
def train_batch_empty(): return sd.TrainProgram(_init, lambda state, batch: (state, {}), batch={})
def dtype_none(): return sd.ModelProgram(Tiny(), inputs={"mask": sd.Input(dtype=None)})
def _placed_on(mesh, shape=(4, 4)):
    from jax.sharding import NamedSharding, PartitionSpec
    sharding = NamedSharding(mesh, PartitionSpec(mesh.axis_names[0]))
    return _program_of(lambda key: jax.jit(lambda: {"params": {"w": jnp.zeros(shape)}},
                                           out_shardings={"params": {"w": sharding}})())
def _program_of(init): return sd.TrainProgram(init, lambda state, batch: (state, {}))
def init_own_mesh(): return _placed_on(jax.sharding.AbstractMesh((7,), ("own",)), (14, 4))
def state_empty_key(): return _program_of(lambda key: {"": jnp.zeros(2), "params": {"w": jnp.zeros(2)}})
def state_bare_array(): return _program_of(lambda key: jnp.zeros((4, 4)))
class Masked(nn.Module):
    @nn.compact
    def __call__(self, tokens, mask=None):
        return Tiny()(tokens)
def float64_input(): return sd.ModelProgram(Masked(), inputs={"mask": sd.Input(dtype="float64")})
def train_init_model(): return sd.TrainProgram(Tiny(), lambda state, batch: (state, {}))
def train_step_hf():
    from examples.hf_llama import small_llama
    return sd.TrainProgram(_init, small_llama())
def hf_in_model_program():
    from examples.hf_llama import small_llama
    return sd.ModelProgram(small_llama(), positions="position_ids", kwargs={"deterministic": False},
                           inputs={"attention_mask": lambda batch: jnp.ones_like(batch["inputs"])})
def tty_aware():  # what tqdm_loggable and other progress bars ask of standard output when imported
    out = sys.stdout
    out.writelines([f"tty={out.isatty()} encoding={out.encoding} errors={out.errors}", "\\n"])
    out.flush()
    return Tiny()
def train_batch_slash(): return sd.TrainProgram(_init, lambda state, batch: (state, {}), batch={"a/b": sd.Input()})
def _odd_names(axis):
    from jax.sharding import NamedSharding, PartitionSpec
    names = ("a|b`c", "line\\nbreak", "<script>x</script>")
    def init(key):
        shard = NamedSharding(jax.sharding.get_abstract_mesh(), PartitionSpec(*axis))
        return jax.jit(lambda: {name: jnp.zeros((4, 4)) for name in names}, out_shardings={name: shard for name in names})()
    return _program_of(init)
def odd_names_old(): return _odd_names(("data", None))
def odd_names_new(): return _odd_names((None, "data"))
def state_same_path(): return _program_of(lambda key: {"a/b": jnp.zeros(2), "a": {"b": jnp.zeros(2)}})
'''

# Modules that fail while they are imported: file name -> bytes.
IMPORTS = {
    "imp_exit0": b"raise SystemExit(0)\n",
    "imp_exit3": b"import sys\nsys.exit(3)\n",
    "imp_interrupt": b"raise KeyboardInterrupt\n",
    "imp_custom": b"class Odd(BaseException):\n    pass\nraise Odd('at import')\n",
    "imp_syntax": b"def make(:\n    pass\n",
    "imp_nul": b"def make():\n    return 1\x00\n",
    "imp_encoding": b"def make():\n    return '\xff\xfe'\n",
    "imp_runtime": b"raise RuntimeError('no GPU here')\n",
    "imp_loops": b"while True:\n    pass\n",
}


def factory(name: str) -> list[str]:
    return ["--model", f"hostile_user:{name}", "--rule", "rules.yml", *SIZES]


# (id, argv, the words the one error line must hold)
PROBES: list[tuple[str, list[str], str]] = [
    # --- every exit from the user's code: factory, import, init, call, step ----------------------------
    ("factory-SystemExit-0", factory("exit0"), "the model factory hostile_user:exit0 exited with SystemExit(0)"),
    ("factory-sys.exit-3", factory("exit3"), "exited with SystemExit(3)"),
    ("factory-sys.exit-text", factory("exit_text"), "exited with SystemExit('bye')"),
    ("factory-KeyboardInterrupt", factory("interrupt"), "raised KeyboardInterrupt with no Ctrl-C"),
    ("factory-BaseException", factory("custom"), "the model factory hostile_user:custom failed with Custom: odd"),
    ("factory-GeneratorExit", factory("generator_exit"), "failed with GeneratorExit"),
    ("factory-silences-stderr-and-exits", factory("silenced_exit"), "hostile_user:silenced_exit exited with "
                                                                     "SystemExit(0)"),
    ("factory-MemoryError", factory("memory"), "failed with MemoryError: cannot allocate"),
    ("import-SystemExit-0", ["--model", "imp_exit0:make", "--rule", "rules.yml", *SIZES],
     "importing imp_exit0 (for model imp_exit0:make) exited with SystemExit(0)"),
    ("import-sys.exit-3", ["--model", "imp_exit3:make", "--rule", "rules.yml", *SIZES], "exited with SystemExit(3)"),
    ("import-KeyboardInterrupt", ["--model", "imp_interrupt:make", "--rule", "rules.yml", *SIZES],
     "importing imp_interrupt (for model imp_interrupt:make) raised KeyboardInterrupt with no Ctrl-C"),
    ("import-BaseException", ["--model", "imp_custom:make", "--rule", "rules.yml", *SIZES], "failed with Odd: at import"),
    ("import-SyntaxError", ["--model", "imp_syntax:make", "--rule", "rules.yml", *SIZES],
     "importing imp_syntax (for model imp_syntax:make) failed with SyntaxError"),
    ("import-null-bytes", ["--model", "imp_nul:make", "--rule", "rules.yml", *SIZES], "importing imp_nul"),
    ("import-bad-encoding", ["--model", "imp_encoding:make", "--rule", "rules.yml", *SIZES],
     "importing imp_encoding (for model imp_encoding:make) failed with SyntaxError"),
    ("import-RuntimeError", ["--model", "imp_runtime:make", "--rule", "rules.yml", *SIZES],
     "failed with RuntimeError: no GPU here"),
    ("optimizer-SystemExit", factory("tiny") + ["optimizer=hostile_user:exit0"],
     "optimizer=hostile_user:exit0: calling exit0() exited with SystemExit(0)"),
    ("step-SystemExit-0", factory("step_exit0"), "the program's train_step step_exit0.<locals>.<lambda> exited with "
                                                 "SystemExit(0)"),
    ("step-sys.exit-3", factory("step_exit3"), "exited with SystemExit(3)"),
    ("step-KeyboardInterrupt", factory("step_interrupt"), "train_step step_interrupt.<locals>.<lambda> raised "
                                                          "KeyboardInterrupt with no Ctrl-C"),
    ("step-BaseException", factory("step_custom"), "failed with Custom: in step"),
    ("init-sys.exit", factory("init_exit"), "the program's init init_exit.<locals>.<lambda> exited with SystemExit(1)"),
    ("model-call-sys.exit", factory("model_call_exit"), "the model call exited with SystemExit(4)"),
    ("call-hook-sys.exit", factory("hook_exit"), "the call hook hook_exit.<locals>.<lambda> exited with SystemExit(2)"),
    ("input-function-sys.exit", factory("input_exit"), "computing input 'mask' with input_exit.<locals>.<lambda> exited"),
    ("logits-function-BaseException", factory("logits_custom"), "picking the logits out of the model's output failed "
                                                               "with Custom: no logits"),
    # --- time limits ---------------------------------------------------------------------------------
    ("factory-loop", factory("loops") + ["--time-limit", "1"],
     "the model factory hostile_user:loops did not finish within the time limit of 1 s (--time-limit"),
    ("factory-sleep", factory("sleeps") + ["--time-limit", "0.5"], "did not finish within the time limit of 0.5 s"),
    ("step-loop", factory("step_loops") + ["--time-limit", "1"],
     "the program's train_step step_loops.<locals>.step did not finish within the time limit of 1 s"),
    ("import-loop", ["--model", "imp_loops:make", "--rule", "rules.yml", *SIZES, "--time-limit", "1"],
     "importing imp_loops (for model imp_loops:make) did not finish within the time limit of 1 s"),
    ("time-limit-zero", factory("tiny") + ["--time-limit", "0"], "argument --time-limit: '0': give a number of seconds"),
    ("time-limit-text", factory("tiny") + ["--time-limit", "soon"], "argument --time-limit: 'soon'"),
    ("time-limit-inf", factory("tiny") + ["--time-limit", "inf"], "at most 10000000"),
    # --- arguments checked where they are given ------------------------------------------------------
    ("Input-dtype", factory("bad_dtype"), "Input(dtype='notadtype'): not a numeric dtype; give a numpy or JAX dtype"),
    ("Input-dtype-str", factory("str_dtype"), "Input(dtype='str'): not a numeric dtype"),
    ("logits-int", factory("int_logits"), "the model's output float32[2,8,64] holds no float logits [batch, length, vocab]"),
    ("init-None", factory("init_none"), "returned None, a state with no arrays"),
    ("Input-logical-axes-int", factory("bad_axes"), "Input(logical_axes=(3, None)): give a tuple of logical axis names"),
    ("Input-logical-axes-rank", factory("axes_rank"), "Input(logical_axes=('batch',)): 1 names for a rank-2 shape"),
    ("Input-logical-axes-str", factory("axes_string"), "Input(logical_axes='batch'): give a tuple"),
    ("Input-shape-negative", factory("negative_shape"), "Input(shape=(-1, 'length')): give a tuple of sizes"),
    ("Input-shape-float", factory("float_shape"), "Input(shape=(2.5,))"),
    ("ModelProgram-inputs-list", factory("inputs_list"), "ModelProgram(inputs=(int32[batch,length])): give a mapping"),
    ("ModelProgram-inputs-value", factory("inputs_value"), "ModelProgram(inputs=...): 'mask' is 5; give an Input"),
    ("ModelProgram-rngs-int", factory("rngs_number"), "ModelProgram(rngs=5): give None"),
    ("ModelProgram-rngs-ints", factory("rngs_numbers"), "ModelProgram(rngs=(1, 2))"),
    ("ModelProgram-logits-float", factory("logits_float"), "ModelProgram(logits=2.5): give None"),
    ("ModelProgram-logits-bool", factory("logits_bool"), "ModelProgram(logits=True)"),
    ("ModelProgram-kwargs-list", factory("kwargs_list"), "ModelProgram(kwargs="),
    ("ModelProgram-positions-int", factory("positions_number"), "ModelProgram(positions=3): give 'auto', None"),
    ("ModelProgram-call-int", factory("call_number"), "ModelProgram(call=5): give None or a function"),
    ("ModelProgram-model-int", factory("model_number"), "ModelProgram(model=5): give a Flax linen or NNX module"),
    ("TrainProgram-init-int", factory("train_init_number"), "TrainProgram(init=3): give a function init(key)"),
    ("TrainProgram-step-None", factory("train_step_none"), "TrainProgram(train_step=None): give a function"),
    ("TrainProgram-batch-list", factory("train_batch_list"), "TrainProgram(batch=(int32[batch,length])): give a non-empty mapping"),
    ("TrainProgram-batch-value", factory("train_batch_value"), "TrainProgram(batch=...): field 'inputs' is 5"),
    ("TrainProgram-batch-empty", factory("train_batch_empty"), "TrainProgram(batch={}): give a non-empty mapping"),
    ("Input-dtype-None", factory("dtype_none"), "Input(dtype=None): not a numeric dtype"),
    ("TrainProgram-batch-field-slash", factory("train_batch_slash"), "TrainProgram(batch=...): field name 'a/b': give a "
                                                                     "non-empty str of letters, digits"),
    ("TrainProgram-init-a-module", factory("train_init_model"), "TrainProgram(init=Tiny()): a model, not a function "
                                                                "init(key) -> state"),
    ("TrainProgram-step-a-HF-model", factory("train_step_hf"), "TrainProgram(train_step=<transformers.models.llama."),
    # --- a state init places or names itself -----------------------------------------------------------
    ("init-placed-on-its-own-mesh", factory("init_own_mesh"), "places its arrays on its own mesh own=7 (jit <lambda>), "
                                                               "not on the case's mesh data=2: give the case the "
                                                               "program's mesh"),
    ("state-empty-key", factory("state_empty_key"), "init returned a state with a leaf at '', a path with an empty "
                                                    "name"),
    ("state-bare-array", factory("state_bare_array"), "init returned a state with a leaf at ''"),
    ("state-two-leaves-one-path", factory("state_same_path"), "init returned two leaves at 'a/b'"),
    # --- what a step returns -------------------------------------------------------------------------
    ("step-str-leaf", factory("step_str_leaf"), "returned 'weights' at params/w, not an array"),
    ("step-other-shape", factory("step_other_shape"), "returned float32[4,8] at params/w, where the state it was given holds "
                                                      "float32[4,4]"),
    ("step-other-dtype", factory("step_other_dtype"), "returned bfloat16[4,4] at params/w"),
    ("step-lost-leaf", factory("step_lost_leaf"), "a state of another tree than init's: missing leaf step"),
    ("step-None-leaf", factory("step_none_leaf"), "a state of another tree than init's: missing leaf step"),
    ("step-str-metric", factory("step_str_metric"), "metrics with 'low' at loss, not an array or a number"),
    # --- rule specs ----------------------------------------------------------------------------------
    ("partition-rule-repeated-axis", ["--model", "examples.regex_llama:small_llama", "--rule", "dup.yml", *SIZES[:2]],
     "field partition_rules/0 ('attention/(wq|wk|wv)/kernel'): mesh axis 'fsdp' appears twice in the spec"),
    ("partition-rule-repeated-in-entry", ["--model", "examples.regex_llama:small_llama", "--rule", "dup_entry.yml",
                                          *SIZES[:2]], "mesh axis 'fsdp' appears twice"),
    ("partition-rule-unknown-logical", ["--model", "examples.regex_llama:small_llama", "--rule", "nonsense.yml",
                                        *SIZES[:2]],
     "field partition_rules/0 ('feed_forward'): logical axis 'nonsense' has no rule in logical_axis_rules"),
    ("partition-rule-backtracking", ["--model", "examples.regex_llama:small_llama", "--rule", "backtrack.yml",
                                     *SIZES[:2]], "the regex '(\\\\w+/?)+Z' on "),
    ("partition-rule-too-many-entries", ["--model", "examples.regex_llama:small_llama", "--rule", "rank.yml",
                                         *SIZES[:2]], "3 entries for parameter"),
]

LLAMA_RULE = "mesh_axes: [fsdp, mp]\ndata_sharding: [[fsdp]]\n"
RULE_FILES = {
    "rules.yml": RULES,
    "dup.yml": LLAMA_RULE + "partition_rules:\n  - ['attention/(wq|wk|wv)/kernel', [fsdp, fsdp]]\n",
    "dup_entry.yml": LLAMA_RULE + "partition_rules:\n  - [kernel, [[fsdp, mp], fsdp]]\n",
    "nonsense.yml": LLAMA_RULE + "logical_axis_rules:\n  - [mlp, mp]\n"
                                 "partition_rules:\n  - [feed_forward, {logical: [nonsense, mlp]}]\n",
    "backtrack.yml": LLAMA_RULE + "partition_rules:\n  - ['(\\w+/?)+Z', [fsdp]]\n",
    "rank.yml": LLAMA_RULE + "partition_rules:\n  - [ln_f/kernel, [fsdp, mp, null]]\n",
}


@pytest.fixture
def user_repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A user's folder: the factories, the failing modules and the rule files; `examples` importable."""
    (tmp_path / "hostile_user.py").write_text(textwrap.dedent(FACTORIES))
    for name, data in IMPORTS.items():
        (tmp_path / f"{name}.py").write_bytes(data)
    for name, text in RULE_FILES.items():
        (tmp_path / name).write_text(text)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(REPO))
    for module in ["hostile_user", *IMPORTS]:
        monkeypatch.delitem(sys.modules, module, raising=False)
    return tmp_path


def listing(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if "__pycache__" not in p.parts)


def test_there_are_at_least_60_probes():
    assert len(PROBES) >= 60 and len({name for name, _, _ in PROBES}) == len(PROBES)


@pytest.mark.parametrize("name, argv, words", PROBES, ids=[p[0] for p in PROBES])
def test_hostile_user_code_is_one_line_exit_2_and_nothing_written(name, argv, words, user_repo, capsys):
    before = listing(user_repo)
    status = cli.main([*argv, "--golden-dir", str(user_repo / "golden")])
    captured = capsys.readouterr()
    assert status == 2, f"exit status {status}, stderr {captured.err[-1500:]!r}"
    assert captured.out == "" and captured.err.count("\n") == 1, captured.err[-2000:]
    assert captured.err.startswith("sharding-dump: error: ") and len(captured.err) <= MAX_LINE, captured.err
    assert words in captured.err, captured.err
    assert listing(user_repo) == before


def test_a_factory_that_moves_the_process_moves_no_path(user_repo, capsys):
    """A factory that changes the working folder, the environment and jax's x64 option: the run
    reads the rule file given relative to where it started, writes the goldens there, and writes the
    same bytes as a factory that changes nothing."""
    (user_repo / "mover.py").write_text(textwrap.dedent("""
        import os, jax
        from hostile_user import tiny
        def make():
            os.chdir("/")
            os.environ["JAX_ENABLE_X64"] = "1"
            jax.config.update("jax_enable_x64", True)
            return tiny()
    """))
    args = ["--rule", "rules.yml", *SIZES, "--golden-dir", "golden"]
    assert cli.main(["--model", "plain=hostile_user:tiny", *args]) == 0
    assert cli.main(["--model", "moved=mover:make", *args]) == 0
    assert os.getcwd() == str(user_repo) and "JAX_ENABLE_X64" not in os.environ or os.environ["JAX_ENABLE_X64"] != "1"
    plain, moved = (user_repo / "golden/plain", user_repo / "golden/moved")
    files = listing(plain)
    assert len(files) > 3 and files == listing(moved)
    for name in files:
        if name.endswith(".json"):
            assert (plain / name).read_text().replace('"plain"', '"X"') == (moved / name).read_text().replace('"moved"', '"X"')
    capsys.readouterr()


def test_a_shadowed_partition_rule_is_warned_about_and_checked(user_repo, capsys):
    (user_repo / "shadow.yml").write_text(LLAMA_RULE + "partition_rules:\n  - [kernel, [fsdp]]\n"
                                          "  - ['attention/wq/kernel', [mp, fsdp]]\n  - ['.*', [null]]\n")
    args = ["--model", "examples.regex_llama:small_llama", "--rule", "shadow.yml", *SIZES[:2]]
    assert cli.main([*args, "--golden-dir", "golden"]) == 0
    err = capsys.readouterr().err
    assert "rule_shadow: partition rule shadow.yml:5 ('attention/wq/kernel') places nothing: every " \
           "parameter path it matches is matched first by partition rule shadow.yml:4 ('kernel')" in err, err
    assert cli.main(["check", *args]) == 1
    assert "partition rule 'attention/wq/kernel'" in capsys.readouterr().out


PYPROJECTS = [
    ("not-utf-8", b'[tool.sharding-dump]\ngolden-dir = "\xff"\n', "pyproject.toml: not UTF-8 text (byte 35"),
    ("tool-a-number", b"tool = 5\n", "pyproject.toml: field tool must be a table ([tool.sharding-dump]), not int"),
    ("table-a-number", b"[tool]\nsharding-dump = 5\n", "field (top level): must be an object, not int"),
    ("time-limit-text", b'[tool.sharding-dump]\ntime-limit = "soon"\n', "field time-limit: must be a number"),
]


@pytest.mark.parametrize("name, data, words", PYPROJECTS, ids=[p[0] for p in PYPROJECTS])
def test_a_broken_pyproject_of_the_users_repository_is_one_line(name, data, words, user_repo, capsys):
    (user_repo / "pyproject.toml").write_bytes(data)
    before = listing(user_repo)
    assert cli.main(factory("tiny")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("sharding-dump: error: ") and words in err, err[-2000:]
    assert listing(user_repo) == before


# --- real processes: Ctrl-C, and the verify child --------------------------------------------------

LOOPING = '''
import os, sys, time
def make():
    open("started", "w").write(str(os.getpid()))
    while True:
        pass
'''


def _start(user_repo: Path, argv: list[str], ignore_sigint: bool = False) -> subprocess.Popen:
    (user_repo / "looping.py").write_text(textwrap.dedent(LOOPING))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "sharding_dump.commands.cli", *argv]
    if ignore_sigint:  # as a shell starts a background job: SIGINT ignored, inherited through exec
        command = ["sh", "-c", 'trap "" INT; exec "$@"', "sh", *command]
    return subprocess.Popen(command, cwd=user_repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _interrupt_when_started(proc: subprocess.Popen, marker: Path) -> tuple[int, str, float]:
    """SIGINT once the user's loop has started; the exit status, stderr and seconds to exit."""
    deadline = time.monotonic() + 300
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.exists(), proc.communicate()[1][-2000:]
    time.sleep(0.2)  # well inside `while True: pass`
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=2)  # the bound the issue sets: Ctrl-C ends a run within 2 s
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"still running 2 s after SIGINT: {proc.communicate()[1][-1000:]}")
    return proc.returncode, err, time.monotonic() - sent


@pytest.mark.parametrize("ignored", [pytest.param(False, marks=pytest.mark.compile), True],
                         ids=["sigint-default", "sigint-inherited-ignored"])
def test_ctrl_c_ends_a_factory_stuck_in_a_loop(user_repo, ignored):
    """`while True: pass` in a factory: SIGINT ends the run within 2 s, exit 130, one short line,
    nothing written; also when the process started with SIGINT ignored (a job put in the background
    of a script inherits that, which is why Ctrl-C used to do nothing)."""
    proc = _start(user_repo, ["--model", "looping:make", "--rule", "rules.yml", *SIZES, "--golden-dir", "golden"],
                  ignore_sigint=ignored)
    status, err, _ = _interrupt_when_started(proc, user_repo / "started")
    assert (status, err) == (130, "sharding-dump: interrupted\n")
    assert not (user_repo / "golden").exists()


@pytest.mark.compile  # a verify child: a second process that imports jax
def test_ctrl_c_ends_verify_and_its_child(user_repo):
    """A verify child in the user's loop: SIGINT to the parent alone ends both, exit 130."""
    proc = _start(user_repo, ["verify", "--model", "looping:make", "--rule", "rules.yml", *SIZES,
                              "--golden-dir", "golden"])
    status, err, _ = _interrupt_when_started(proc, user_repo / "started")
    assert (status, err) == (130, "sharding-dump: interrupted\n")
    child = int((user_repo / "started").read_text())
    time.sleep(0.1)
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)


VERIFY_PROBES = [
    ("factory-None", "none", [], 2, "sharding-dump: error: the model factory hostile_user:none returned NoneType"),
    ("step-sys.exit", "step_exit3", [], 2,
     "sharding-dump: error: the program's train_step step_exit3.<locals>.<lambda> exited with SystemExit(3)"),
    ("step-loop", "step_loops", ["--time-limit", "1"], 2,
     "sharding-dump: error: the program's train_step step_loops.<locals>.step did not finish within the time limit "
     "of 1 s"),
]


@pytest.mark.compile  # a verify child: a second process that imports jax
@pytest.mark.parametrize("name, function, extra, status, words", VERIFY_PROBES, ids=[p[0] for p in VERIFY_PROBES])
def test_a_bad_program_in_the_verify_child_is_its_own_line_exit_2(name, function, extra, status, words, user_repo,
                                                                   capsys):
    got = cli.main(["verify", "--model", f"hostile_user:{function}", "--rule", "rules.yml", *SIZES, *extra,
                    "--golden-dir", "golden"])
    captured = capsys.readouterr()
    assert got == status and captured.err.count("\n") == 1 and words in captured.err, captured.err[-2000:]


@pytest.mark.compile  # a verify child: a second process that imports jax
def test_verify_traceback_comes_back_from_its_child(user_repo, capsys):
    """--traceback under verify: the user's code fails in the compiling process, which sends its whole
    traceback back with its one line; the parent prints both, exit 2."""
    got = cli.main(["verify", "--model", "hostile_user:custom", "--rule", "rules.yml", *SIZES, "--golden-dir", "golden",
                    "--traceback"])
    err = capsys.readouterr().err
    assert got == 2 and err.startswith("Traceback (most recent call last):\n"), err[-2000:]
    assert 'in custom\n    def custom(): raise Custom("odd")' in err
    assert err.splitlines()[-1].startswith("sharding-dump: error: the model factory hostile_user:custom failed with "
                                           "Custom: odd at hostile_user.py:")


@pytest.mark.compile
def test_a_verify_child_killed_or_out_of_memory_is_named(user_repo, capsys):
    """The child's real end: the SIGKILL the out-of-memory killer sends, a MemoryError in the user's
    call; and a compile past the time limit."""
    (user_repo / "dying.py").write_text("import os, signal\ndef make():\n    os.kill(os.getpid(), signal.SIGKILL)\n")
    assert cli.main(["verify", "--model", "dying:make", "--rule", "rules.yml", *SIZES, "--golden-dir", "golden"]) == 1
    assert "compile failed: the compiling process was killed by SIGKILL (the kernel's out-of-memory killer" \
        in capsys.readouterr().out
    (user_repo / "starved.py").write_text(textwrap.dedent("""
        import resource
        from hostile_user import tiny
        def make():  # memory runs out in the compiler, after the user's code returned
            with open("/proc/self/status") as status:
                size = next(int(line.split()[1]) for line in status if line.startswith("VmSize:")) * 1024
            resource.setrlimit(resource.RLIMIT_AS, (size + (64 << 20), resource.RLIM_INFINITY))
            return tiny()
    """))
    assert cli.main(["verify", "--model", "starved:make", "--rule", "rules.yml", *SIZES, "--golden-dir", "golden"]) == 1
    out = capsys.readouterr().out
    reason = out.split("compile failed: the compiling process ", 1)[-1].split("\n", 1)[0]
    # how a starved compiler dies varies (a MemoryError, SIGABRT from LLVM, the loader's abort): each is named
    assert any(word in reason for word in ("MemoryError", "alloc", "pthread_create")), out
    assert cli.main(["verify", "--model", "hostile_user:memory", "--rule", "rules.yml", *SIZES,
                     "--golden-dir", "golden"]) == 2
    assert "failed with MemoryError: cannot allocate" in capsys.readouterr().err
    assert cli.main(["verify", "--model", "qwen3-0.6b", "--topology", "cpu-1", "--rule", "default",
                     "max_target_length=8", "per_device_batch_size=1", "--time-limit", "0.05",
                     "--golden-dir", "golden"]) == 2
    assert "compiling the training step did not finish within the time limit of 0.05 s" in capsys.readouterr().err


# --- the pytest plugin ------------------------------------------------------------------------------

CASES = """\
cases:
  - {model: hostile_user:exit0, topology: cpu-2, rule: rules.yml, overrides: {ici_data_parallelism: 2, per_device_batch_size: 1, max_target_length: 8}}
  - {model: hostile_user:interrupt, topology: cpu-2, rule: rules.yml, overrides: {ici_data_parallelism: 2, per_device_batch_size: 1, max_target_length: 8}}
  - {model: hostile_user:step_loops, topology: cpu-2, rule: rules.yml, overrides: {ici_data_parallelism: 2, per_device_batch_size: 1, max_target_length: 8}}
  - {model: hostile_user:tiny, topology: cpu-2, rule: rules.yml, overrides: {ici_data_parallelism: 2, per_device_batch_size: 1, max_target_length: 8}}
"""
TINY_CASE = "hostile_user-tiny/cpu-2/slice_1/rule_rules_ici_data_parallelism=2_per_device_batch_size=1_max_target_length=8"


def test_under_pytest_a_bad_factory_fails_its_test_and_the_run_goes_on(mini_project, monkeypatch):
    """SystemExit and a raised KeyboardInterrupt in a factory, a train_step past
    --sharding-time-limit: each fails its own test in one line, and the other tests run."""
    project = mini_project({"cases.yml": CASES, "rules.yml": RULES, "hostile_user.py": textwrap.dedent(FACTORIES)})
    monkeypatch.syspath_prepend(str(REPO))
    for module in ("hostile_user",):
        monkeypatch.delitem(sys.modules, module, raising=False)
    result = project.runpytest("-p", "sharding_dump.pytest_plugin", "-p", "no:cacheprovider", "--sharding-update",
                               "--sharding-time-limit", "1")
    result.assert_outcomes(passed=2, failed=3)
    out = result.stdout.str()
    assert "sharding-dump: error: hostile_user:exit0/" in out and "exited with SystemExit(0)" in out
    assert "raised KeyboardInterrupt with no Ctrl-C" in out
    assert "step_loops.<locals>.step did not finish within the time limit of 1 s (--time-limit, pytest " \
           "--sharding-time-limit" in out
    assert "Traceback" not in out and (project.path / "golden" / TINY_CASE / "named_shardings.json").is_file()


def test_update_goldens_replaces_a_golden_too_large_or_a_folder(mini_project, monkeypatch):
    """A golden replaced by a file above the 64 MiB limit, another by a folder: a check refuses them
    (one line), `--sharding-update` replaces both with the dump and names what it replaced."""
    cases = "cases:\n" + CASES.splitlines()[-1] + "\n"
    project = mini_project({"cases.yml": cases, "rules.yml": RULES, "hostile_user.py": textwrap.dedent(FACTORIES)})
    monkeypatch.syspath_prepend(str(REPO))
    monkeypatch.delitem(sys.modules, "hostile_user", raising=False)
    run = lambda *args: project.runpytest("-p", "sharding_dump.pytest_plugin", "-p", "no:cacheprovider", *args)  # noqa: E731
    run("--sharding-update").assert_outcomes(passed=2)
    folder = project.path / "golden" / TINY_CASE
    good = {name: (folder / name).read_bytes() for name in os.listdir(folder)}
    os.truncate(folder / "named_shardings.json", 70 << 20)
    (folder / "logical_shardings.json").unlink()
    (folder / "logical_shardings.json").mkdir()
    (folder / "logical_shardings.json" / "inside.txt").write_text("x")
    refused = run()
    refused.assert_outcomes(passed=1, failed=1)
    assert "more than the limit of 67108864" in refused.stdout.str() or "Is a directory" in refused.stdout.str()
    repaired = run("--sharding-update")
    repaired.assert_outcomes(passed=2)
    repaired.stdout.fnmatch_lines([
        f"sharding-dump: replaced golden/{TINY_CASE}/logical_shardings.json (a folder) by the dump",
        f"sharding-dump: replaced golden/{TINY_CASE}/named_shardings.json (a file of 73400320 bytes, above the "
        "limit of 67108864) by the dump",
        "sharding-dump goldens: 1 updated, 0 created, 0 unchanged, 0 deleted"])
    assert {name: (folder / name).read_bytes() for name in os.listdir(folder)} == good
    run().assert_outcomes(passed=2)
    documented = [line for line in (REPO / "docs/errors-and-limits.md").read_text().splitlines()
                  if line.startswith("sharding-dump: replaced ")]
    assert documented and all(line.replace("<case>", TINY_CASE) in repaired.stdout.lines for line in documented)


def test_the_projects_time_limit_is_a_setting_the_option_overrides(user_repo, capsys):
    """`time-limit` of [tool.sharding-dump]; --time-limit overrides it; a bad value is one line."""
    (user_repo / "pyproject.toml").write_text("[tool.sharding-dump]\ntime-limit = 0.5\n")
    assert cli.main(factory("loops")) == 2
    assert "hostile_user:loops did not finish within the time limit of 0.5 s" in capsys.readouterr().err
    assert cli.main(factory("loops") + ["--time-limit", "0.25"]) == 2
    assert "within the time limit of 0.25 s" in capsys.readouterr().err
    (user_repo / "pyproject.toml").write_text("[tool.sharding-dump]\ntime-limit = 0\n")
    assert cli.main(factory("loops")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "field time-limit" in err, err


def test_a_case_file_that_cannot_be_read_is_its_one_line_under_pytest(mini_project):
    """A case file above the size limit: one error line for the project, and no warning that -k/-m
    deselected its golden tests (none was collected, and that line already says why)."""
    project = mini_project({"cases.yml": "cases: [" + "[" * (300 << 10) + "\n", "rules.yml": RULES})
    result = project.runpytest("-p", "sharding_dump.pytest_plugin", "-p", "no:cacheprovider")
    result.assert_outcomes(errors=1)
    out = result.stdout.str()
    assert "sharding-dump: error: case matrix " in out and "more than the limit of 262144" in out, out
    assert "no golden test ran" not in out and "Traceback" not in out, out


def test_tensor_names_of_any_text_keep_the_markdown_and_html_reports_whole(user_repo, capsys):
    """A state's names are the user's: a backtick, a '|', a line break or markup in one must not end
    its code span, split its table row, or reach the page as HTML."""
    for side, function in (("old", "odd_names_old"), ("new", "odd_names_new")):
        assert cli.main(["--model", f"X=hostile_user:{function}", "--rule", "rules.yml", *SIZES, "--golden-dir", side]) == 0
    capsys.readouterr()
    assert cli.main(["diff", "--format", "markdown", "old", "new"]) == 1
    out = capsys.readouterr().out
    parts = out.split("\n| memory per device ")[1].split("\n\n")[0].splitlines()[2:]  # the parts are names too
    assert [row.split(" | ")[0].removeprefix("| ").rstrip() for row in parts] == [
        "activations", "`<script>x<`", "``a\\|b`c``", "`line\\nbreak`"], parts
    rows = out.split("\n| tensor ")[1].split("\n\n")[0].splitlines()[2:]  # the tensor table's body
    tensors = [row.split(" | ")[0].removeprefix("| ").rstrip() for row in rows]
    assert tensors == ["`<script>x</script>`", "``a\\|b`c``", "`line\\nbreak`"], rows
    assert all(row.count(" | ") == 4 and row.endswith(" |") for row in rows), rows
    assert cli.main(["diff", "--format", "html", "old", "new"]) == 1
    page = capsys.readouterr().out
    assert "<script>x" not in page and "&lt;script&gt;x&lt;/script&gt;" in page


def test_a_64_bit_input_is_traced_as_jax_gives_it_without_a_raw_warning(user_repo, capsys, recwarn):
    """Input(dtype='float64') without jax_enable_x64: jax makes it float32; the dump says so in its
    layout instead of letting jax's multi-line UserWarning through to stderr."""
    assert cli.main(factory("float64_input") + ["--golden-dir", "golden"]) == 0
    err = capsys.readouterr().err
    assert all(line.startswith("sharding-dump: warning: ") for line in err.splitlines()), err
    assert not [w for w in recwarn if "float64" in str(w.message)], [str(w.message) for w in recwarn]


def test_standard_output_keeps_the_whole_file_api_for_the_users_code(user_repo, capsys):
    """The CLI's guard of standard output is still a file to the user's code: isatty, encoding, errors,
    writelines and flush are the stream's own (mutation: drop `_Stdout.__getattr__`, and the factory
    fails with `AttributeError: '_Stdout' object has no attribute 'isatty'`)."""
    assert cli.main(factory("tty_aware") + ["--golden-dir", "golden"]) == 0, capsys.readouterr().err
    assert "tty=false encoding=utf-8 errors=strict\n" in capsys.readouterr().out.lower()
def test_a_hugging_face_model_in_a_model_program_is_its_module(user_repo, capsys):
    """ModelProgram(FlaxPreTrainedModel, ...) dumps its linen module, as a factory returning that
    model does: the same layouts as examples.hf_llama:small_llama under the harness's HF call."""
    (user_repo / "hf.yml").write_text((REPO / "examples/hf_llama_rules.yml").read_text())
    args = ["--rule", "hf.yml", "--topology", "cpu-2", "ici_fsdp_parallelism=2", "per_device_batch_size=1",
            "max_target_length=8", "--golden-dir", "golden"]
    assert cli.main(["--model", "mine=hostile_user:hf_in_model_program", *args]) == 0
    assert cli.main(["--model", "theirs=examples.hf_llama:small_llama", *args]) == 0
    capsys.readouterr()
    mine, theirs = (next((user_repo / "golden" / name).rglob("named_shardings.json")) for name in ("mine", "theirs"))
    assert mine.read_text().replace('"mine"', '"X"') == theirs.read_text().replace('"theirs"', '"X"')
