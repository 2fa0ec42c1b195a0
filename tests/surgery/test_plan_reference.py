"""The plan as data: docs/plans.md and docs/plan.schema.json are generated from the plan
dataclasses and current; CLI flags are generated from the same fields; --set reaches any field."""

import json
from pathlib import Path

import pytest

from hf_csa2.cli import build_parser
from hf_csa2.surgery import plan_reference
from hf_csa2.surgery.plan import (
    SURGERY_SECTIONS,
    ConversionPlan,
    DistillPlan,
    GqaPlan,
    PlanError,
    plan_fields,
    set_fields,
)

DOCS = Path(__file__).resolve().parents[2] / "docs"
SECTIONS = [*SURGERY_SECTIONS, "distill", "calibration"]


def test_the_docs_are_what_the_plan_dataclasses_generate():
    fix = "python -m hf_csa2.surgery.plan_reference docs/"
    assert (DOCS / plan_reference.MARKDOWN_FILE).read_text() == plan_reference.markdown(), f"stale: run {fix}"
    schema = json.loads((DOCS / plan_reference.SCHEMA_FILE).read_text())
    assert schema == plan_reference.json_schema(), f"stale: run {fix}"


@pytest.mark.parametrize("section", ["", *SECTIONS])
def test_every_field_is_described_and_documented(section):
    markdown = plan_reference.markdown()
    for f in plan_fields(section):
        if section or f.base in (int, float, bool, str, None):
            assert f.description, f"{f.path} has no description"
            assert f"| `{f.name}` | {f.allowed}" in markdown, f.path


def test_the_schema_refuses_what_the_plan_refuses():
    schema = plan_reference.json_schema()
    gqa = schema["$defs"]["GqaPlan"]
    assert gqa["additionalProperties"] is False and gqa["required"] == ["num_key_value_heads"]
    assert gqa["properties"]["init"]["enum"] == ["calibrated", "mean"]
    assert gqa["properties"]["num_key_value_heads"]["minimum"] == 1


def test_distill_flags_are_the_distill_fields():
    parser = build_parser()
    args = parser.parse_args(["distill", "src", "conv", "--out", "o", "--steps", "3", "--lr", "0.002",
                              "--trainable", "all"])
    assert args.distill_flags.values(args) == {"steps": 3, "lr": 0.002, "trainable": "all"}
    help_text = parser._subparsers._group_actions[0].choices["distill"].format_help()
    for name in DistillPlan.__pydantic_fields__:
        assert f"--{name.replace('_', '-')}" in help_text, name


@pytest.mark.parametrize("argv, words", [
    (["distill", "s", "c", "--out", "o", "--steps", "0"], "--steps: 0; allowed: an integer >= 1"),
    (["distill", "s", "c", "--out", "o", "--holdout", "x"], "--holdout: 'x'; allowed: an integer >= 1"),
    (["convert", "s", "--to", "gqa", "--kv-heads", "0", "--out", "o"], "--kv-heads/--gqa-num-key-value-heads: 0"),
    (["convert", "s", "--to", "gqa", "--gqa-ridge", "inf", "--kv-heads", "1", "--out", "o"], "allowed: a finite number > 0"),
])
def test_generated_flags_check_their_values_while_parsing(argv, words, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(argv)
    assert exit_.value.code == 2 and words in capsys.readouterr().err


def test_convert_flags_reach_the_gqa_and_calibration_sections():
    parser = build_parser()
    args = parser.parse_args(["convert", "s", "--to", "gqa", "--kv-heads", "2", "--init", "mean", "--no-gqa-refit-output",
                              "--calib-tokens", "1024", "--calib-seq-len", "128", "--out", "o"])
    assert args.gqa_flags.values(args) == {"num_key_value_heads": 2, "init": "mean", "refit_output": False}
    assert args.calibration_flags.values(args) == {"num_tokens": 1024, "seq_len": 128}
    assert GqaPlan(**args.gqa_flags.values(args)).refit_output is False


def test_set_fields_reaches_any_field_and_the_plan_validates_it():
    data = set_fields({"gqa": {"num_key_value_heads": 1}}, ["gqa.ridge=0.5", "context=4096", "sinks.margin=3.0",
                                                            "csa2.layers=[full, reuse]"])
    assert data["gqa"] == {"num_key_value_heads": 1, "ridge": 0.5} and data["context"] == 4096
    assert data["sinks"] == {"margin": 3.0} and data["csa2"] == {"layers": ["full", "reuse"]}
    plan = ConversionPlan.from_dict(set_fields({"gqa": {"num_key_value_heads": 1}}, ["gqa.ridge=0.5", "context=4096"]))
    assert plan.gqa.ridge == 0.5 and plan.context == 4096
    with pytest.raises(PlanError, match="gqa.ridge='x'"):
        ConversionPlan.from_dict(set_fields({"gqa": {"num_key_value_heads": 1}}, ["gqa.ridge=x"]))
    with pytest.raises(PlanError, match="unknown key 'rdge' in gqa"):
        ConversionPlan.from_dict(set_fields({"gqa": {"num_key_value_heads": 1}}, ["gqa.rdge=1.0"]))
    for bad in ["gqa.ridge", "=3", "a.b.c=1", "gqa.=1"]:
        with pytest.raises(PlanError, match="allowed: SECTION.FIELD=VALUE"):
            set_fields({}, [bad])
