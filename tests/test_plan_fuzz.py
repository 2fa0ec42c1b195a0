"""Fuzzing `hf-csa2 convert --plan` with generated plan documents.

Each document is a valid plan with one thing broken: a field given a wrong type, NaN/inf, a
huge or negative number, an unknown key, a section that is not a mapping, or an empty or
non-mapping document. Every one must end in exit 2 with ONE line naming the broken field, no
traceback, no output folder, and the source byte-identical: checked before any weights load.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import typing

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import save_tiny_source

from hf_csa2.cli import main as cli_main
from hf_csa2.surgery import plan as plan_module

SECTIONS = {
    "gqa": plan_module.GqaPlan, "mla": plan_module.MlaPlan, "sinks": plan_module.SinksPlan,
    "csa2": plan_module.Csa2Plan, "distill": plan_module.DistillPlan, "calibration": plan_module.CalibrationPlan,
}


def base_plan(text: str) -> dict:
    """A plan using every section, valid for the tiny llama (checked by the first test)."""
    return {
        "gqa": {"num_key_value_heads": 2},
        "mla": {"kv_lora_rank": 8, "qk_rope_head_dim": 4},
        "sinks": {"init": "off"},
        "csa2": {"full_every": 2, "window": 16, "top_k": 8, "indexer_warmup_steps": 0},
        "distill": {"steps": 1, "num_tokens": 384, "holdout": 1, "every": 1},
        "calibration": {"text": text, "num_tokens": 256, "seq_len": 64, "eval_windows": 1},
        "dtype": "float32",
        "context": 256,
    }


def field_kind(cls, name: str) -> str:
    """'int', 'float', 'bool', 'choice', 'text' or 'list' for a plan field (from its annotation)."""
    info = cls.__pydantic_fields__[name]
    base = plan_module._unwrap(info.annotation)
    if typing.get_origin(base) is typing.Literal:
        return "choice"
    if typing.get_origin(base) is list:
        return "list"
    return {int: "int", float: "float", bool: "bool", str: "text"}[base]


NAN_INF = st.sampled_from([math.nan, math.inf, -math.inf])
TEXTS = st.text(min_size=0, max_size=6)
WRONG = {
    # every value here is outside what the field allows, whatever the field's bounds
    "int": st.one_of(st.integers(max_value=-1), st.integers(min_value=(1 << 31) + 1, max_value=1 << 80),
                     st.floats(allow_nan=True).filter(lambda x: not float(x).is_integer()), NAN_INF,
                     st.sampled_from([1.0, 8.0, "8", "1e11", True, False, [1], {"a": 1}])),
    "float": st.one_of(NAN_INF, st.floats(max_value=-1e-9, allow_infinity=False),
                       st.floats(min_value=1e7, allow_infinity=False),
                       st.sampled_from(["0.3", "big", True, [0.1], {"x": 1.0}])),
    "bool": st.one_of(st.sampled_from(["false", "no", "yes", "maybe", "true", 0, 1, 1.5, [True], {}])),
    "choice": st.one_of(st.text(min_size=1, max_size=8).filter(lambda t: t not in ("calibrated", "mean")),
                        st.integers(), st.sampled_from([True, [], {}])),
    "text": st.one_of(st.just(""), st.integers(), st.floats(allow_nan=False), st.sampled_from([True, ["a"], {}])),
    "list": st.one_of(st.integers(), TEXTS, st.just([]), st.lists(st.integers(), min_size=1, max_size=3),
                      st.lists(st.sampled_from(["full", "dense", "copy", 3]), min_size=1, max_size=3).filter(
                          lambda xs: any(x not in plan_module.CSA2_MODES for x in xs))),
}


@st.composite
def broken_plans(draw, text: str):
    """(document, words the error must contain)."""
    plan = base_plan(text)
    how = draw(st.sampled_from(["field", "field", "field", "field", "unknown", "section", "document", "top"]))
    if how == "document":
        doc, words = draw(st.sampled_from([("", "is empty"), ("# just a comment\n", "is empty"), ("~\n", "is empty"),
                                           ("[1, 2]\n", "must hold a mapping"), ("42\n", "must hold a mapping"),
                                           ("plain text\n", "must hold a mapping")]))
        return doc, [words]
    if how == "top":
        key = draw(st.sampled_from(["dtype", "context"]))
        plan[key] = draw(WRONG["choice"] if key == "dtype" else WRONG["int"])
        return yaml.safe_dump(plan), [key]
    section = draw(st.sampled_from(sorted(SECTIONS)))
    if how == "section":
        # a section that is not a mapping (sinks alone also takes true/false)
        plan[section] = draw(st.one_of(st.integers(), st.text(min_size=1, max_size=5), st.lists(st.integers(), max_size=2)))
        return yaml.safe_dump(plan), [section]
    if how == "unknown":
        names = {f.name for f in dataclasses.fields(SECTIONS[section])}
        key = draw(st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=10).filter(lambda k: k not in names))
        plan.setdefault(section, {})[key] = draw(st.integers())
        return yaml.safe_dump(plan), ["unknown key", key]
    cls = SECTIONS[section]
    name = draw(st.sampled_from([f.name for f in dataclasses.fields(cls)]))
    kind = field_kind(cls, name)
    value = draw(WRONG[kind])
    if kind == "choice":
        allowed = typing.get_args(plan_module._unwrap(cls.__pydantic_fields__[name].annotation))
        if value in allowed:
            value = "not-" + str(value)
    plan.setdefault(section, {})[name] = value
    return yaml.safe_dump(plan, allow_unicode=True), [f"{section}.{name}"]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    save_tiny_source("llama", root / "src")
    text = root / "calib.txt"
    text.write_text(" ".join(f"Item {i} stores value {i * 7 % 13} in slot {i % 5}." for i in range(800)))
    return root


def digest(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def run_convert(workspace, doc: str) -> tuple[int, str]:
    plan = workspace / "plan.yaml"
    plan.write_text(doc)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = cli_main(["convert", str(workspace / "src"), "--plan", str(plan), "--out", str(workspace / "out")])
    return code, err.getvalue()


@pytest.mark.slow
def test_the_base_plan_is_valid(workspace):
    """The fuzz below breaks one thing at a time in THIS plan: it must convert as it is."""
    code, err = run_convert(workspace, yaml.safe_dump(base_plan(str(workspace / "calib.txt"))))
    assert code == 0, err[-3000:]
    import shutil

    shutil.rmtree(workspace / "out")


@settings(max_examples=320, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(data=st.data())
def test_every_broken_plan_is_one_line_exit_2_and_touches_nothing(workspace, data):
    source_before = digest(workspace / "src")
    doc, words = data.draw(broken_plans(str(workspace / "calib.txt")))
    code, err = run_convert(workspace, doc)
    lines = err.strip().splitlines()
    assert code == 2, (doc, err[-2000:])
    assert len(lines) == 1 and lines[0].startswith("hf-csa2: error: "), (doc, err[-2000:])
    assert "Traceback" not in err
    for word in words:
        assert word in lines[0], (word, doc, lines[0])
    assert not (workspace / "out").exists()
    assert digest(workspace / "src") == source_before
