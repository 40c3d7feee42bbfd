"""Overrides live in the config, not the environment: one frozen object read where a command starts,
carried in RuntimeConfig, recorded in the manifest; nothing in engine/ or kernels/ reads the
environment (but the extensions' build folder); each override changes only the op it names; and
docs/architecture.md's table of variables is the code's."""

import ast
import re
from pathlib import Path

import pytest
import torch

from moebench.engine.overrides import CHOICES, VARIABLES, Overrides
from moebench.errors import MoebenchError

from repo_paths import REPO as ROOT
# where a build goes and how long to wait for another process's build: not how any op runs
BUILD_PLACES = {"kernels/build.py"}
# the variables that are no override: which files and binaries to use
OTHER_VARIABLES = {"MOEBENCH_GSM8K_DIR", "MOEBENCH_CACHE", "MOEBENCH_LLAMA_SERVER", "MOEBENCH_LLAMA_BATCHED_BENCH",
                   "MOEBENCH_EXTENSIONS_DIR", "MOEBENCH_BUILD_WAIT_S"}


def environment_reads(path: Path) -> list[int]:
    """Lines of `path` that read the process environment (os.environ, os.getenv, environ.get)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv") and \
                isinstance(node.value, ast.Name) and node.value.id == "os":
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os" and \
                any(a.name in ("environ", "getenv") for a in node.names):
            lines.append(node.lineno)
    return lines


def test_nothing_below_the_entry_reads_the_environment():
    found = {}
    for folder in ("engine", "kernels"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            name = str(path.relative_to(ROOT))
            if name not in BUILD_PLACES and environment_reads(path):
                found[name] = environment_reads(path)
    assert found == {}


def test_the_cpp_extension_reads_no_environment_but_through_one_entry_point():
    getenv = {str(p.relative_to(ROOT)): len(re.findall(r"\bgetenv\s*\(", p.read_text()))
              for p in (ROOT / "kernels" / "csrc").iterdir() if p.suffix in (".cpp", ".h")}
    assert {name: n for name, n in getenv.items() if n} == {}
    assert "set_overrides" in (ROOT / "kernels" / "csrc" / "pool.cpp").read_text()


def test_the_environment_feeds_the_overrides_once_and_a_bad_value_is_one_line():
    env = {"MOEBENCH_CPU_KERNEL": "torch", "MOEBENCH_DECODE_CHAINS": "0", "MOEBENCH_POOL_SPIN_US": "50",
           "MOEBENCH_UNRELATED": "x"}
    o = Overrides.from_environment(env)
    assert (o.moe_op, o.chains, o.pool_spin_us) == ("torch", False, 50)
    assert o.changed() == {"moe_op": "torch", "chains": False, "pool_spin_us": 50}
    assert Overrides.from_environment({}) == Overrides()
    for variable, value, needle in (("MOEBENCH_DENSE_KERNEL", "off", "choose from kernel, torch"),
                                    ("MOEBENCH_AVX512", "yes", "choose 0 or 1"),
                                    ("MOEBENCH_POOL_SPIN_US", "-3", "must be >= 0")):
        with pytest.raises(MoebenchError, match=f"{variable}={value}: {needle}"):
            Overrides.from_environment({variable: value})
    with pytest.raises(Exception):  # frozen: a session cannot change what the entry read
        o.dense = "torch"


def table_rows() -> dict[str, tuple[str, str, str]]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text[text.index("## Environment variables"):]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`MOEBENCH_"):
            rows[cells[0].strip("`")] = (cells[1], cells[2], cells[3])
    return rows


def test_the_docs_table_is_the_code():
    rows = table_rows()
    assert set(rows) == set(VARIABLES.values()) | OTHER_VARIABLES
    default = Overrides()
    for field, variable in VARIABLES.items():
        value, what, read_in = rows[variable]
        assert read_in == "`engine/overrides.py`" and what.startswith(f"override `{field}`"), variable
        shown = getattr(default, field)
        shown = str(int(shown)) if isinstance(shown, bool) else str(shown)
        assert value.strip("`") == shown, (variable, value, shown)
        for choice in CHOICES.get(field, ()):
            assert choice == shown or f"`{choice}`" in what, (variable, choice)
    for variable in OTHER_VARIABLES:
        first = rows[variable][2].split(",")[0].strip().strip("`")
        assert variable in (ROOT / first).read_text(), (variable, first)


@pytest.fixture(scope="module")
def bundled():
    from moebench.engine import load_checkpoint
    from moebench.engine.model import cpu_step_ops
    from moebench.measuring.run import bundled_model_path

    if cpu_step_ops() is None:
        pytest.skip("needs the C++ extension")
    return load_checkpoint(bundled_model_path(), dtype=torch.float32, experts_in_checkpoint_dtype=True)


def ran(ckpt, overrides: Overrides) -> dict:
    from moebench.engine import Engine, Request, RuntimeConfig
    from moebench.kernels import cpu_dense

    before = cpu_dense.dense_backends()
    rt = RuntimeConfig(kernel="fused", batch_size=2, max_new_tokens=5, overrides=overrides)
    result = Engine(ckpt, None, rt).generate([Request("a", ""), Request("b", "")], prompt_ids=[[5, 6, 7], [8, 9]])
    after = cpu_dense.dense_backends()
    ev = result.evidence
    return {"moe": sorted(ev["kernel"]["backends"]), "attention": sorted(ev["attention"]),
            "dense_kernel": after.get(cpu_dense.BACKEND_CPP, 0) > before.get(cpu_dense.BACKEND_CPP, 0),
            "path": ev["decode_path"]["path"], "chains": ev["decode_path"]["chains"],
            "tokens": [c.output_ids for c in result.completions], "errors": result.activation_errors}


def test_each_override_changes_only_the_op_it_names(bundled):
    base = ran(bundled, Overrides())
    assert base["moe"] == ["cpp-avx2-pool"] and base["dense_kernel"] and base["path"] == "chained" and base["chains"]
    for overrides, changed in ((Overrides(moe_op="torch"), {"moe": ["torch-grouped"]}),
                               (Overrides(chains=False), {"chains": False}),
                               (Overrides(attention="torch"), {"attention": ["torch-sdpa"], "chains": False}),
                               (Overrides(dense="torch"), {"dense_kernel": False, "chains": False})):
        got = ran(bundled, overrides)
        assert got["errors"] == [], (overrides, got["errors"])  # chosen: a result, not a fallback
        assert got["tokens"] == base["tokens"], overrides
        for key in ("moe", "attention", "dense_kernel", "path", "chains"):
            assert got[key] == changed.get(key, base[key]), (overrides, key, got[key])


def test_the_kernels_and_python_read_one_weight_format_table():
    """kernels/csrc/weight_format.h is the one list of what the kernels stream; the Python side asks the
    extension for it instead of keeping its own copy."""
    from moebench.kernels.cpu_moe import load_extension, weight_formats

    if load_extension() is None:
        pytest.skip("needs the C++ extension")
    assert set(weight_formats("experts")) == {torch.float32, torch.bfloat16, torch.int8, torch.uint8}  # uint8: int4
    assert set(weight_formats("dense")) == {torch.float32, torch.bfloat16, torch.int8, torch.uint8}
    head = weight_formats("lm_head")
    assert set(head) == {torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn}
    assert weight_formats("dense")[torch.int8]["row_extra"] == 8 and head[torch.int8]["scale_tensor"]
    python_side = "\n".join((ROOT / "kernels" / name).read_text() for name in ("cpu_moe.py", "cpu_dense.py"))
    assert "float8_e4m3fn)" not in python_side and "CPP_WEIGHT_DTYPES" not in python_side


def test_the_pool_takes_its_spin_from_the_overrides_entry_point():
    from moebench.kernels.cpu_moe import load_extension

    ext = load_extension()
    if ext is None:
        pytest.skip("needs the C++ extension")
    assert ext.set_overrides(True, 50) and ext.set_overrides(True, 200)
    ext.simd_stats()  # asks which kernel streams: the AVX-512 choice is made now, for this process
    assert not ext.set_overrides(False, 200)  # the other choice, asked for later, is refused (not ignored)
    assert ext.pool_selftest(50, 2) == 0
