"""Plan dataclasses: YAML round trip and one clear error per bad field."""

from pathlib import Path

import pytest

from hf_csa2.surgery.plan import ConversionPlan, PlanError


def test_yaml_round_trip(tmp_path):
    plan = ConversionPlan.from_dict({"gqa": {"num_key_value_heads": 1, "init": "mean"}, "sinks": True})
    path = tmp_path / "p.yaml"
    path.write_text(plan.to_yaml())
    assert ConversionPlan.from_yaml(path) == plan


@pytest.mark.parametrize(
    "data, words",
    [
        ({"gqa": {"num_key_value_heads": 0}}, ["gqa.num_key_value_heads=0", "allowed: an integer >= 1"]),
        ({"gqa": {"num_key_value_heads": 1, "init": "svd"}}, ["gqa.init", "calibrated", "mean"]),
        ({"gqa": {}}, ["gqa", "num_key_value_heads"]),
        ({"sinks": {"init": "zero"}}, ["sinks.init", "calibrated", "off"]),
        ({"dtype": "int8"}, ["dtype", "float32"]),
        ({"gqa": {"num_key_value_heads": 1}, "hsi": {}}, ["unknown", "hsi", "allowed", "mla", "csa2"]),
        ({"mla": {"kv_lora_rank": 64}}, ["mla", "qk_rope_head_dim"]),
        ({"mla": {"kv_lora_rank": 64, "qk_rope_head_dim": 32, "init": "svd"}}, ["mla.init", "activation_aware", "weight_svd"]),
        ({"calibration": {"num_tokens": 10, "seq_len": 512}}, ["num_tokens", "seq_len"]),
        ({"distill": {"steps": 10}}, ["distill needs a surgery stage", "gqa, mla, sinks or csa2"]),
        ({"sinks": True, "distill": {"steps": 0}}, ["distill.steps=0", "integer >= 1"]),
        ({"sinks": True, "distill": {"lr": -1}}, ["distill.lr=-1", "allowed: a finite number > 0"]),
        ({"sinks": True, "distill": {"trainable": "mlp"}}, ["distill.trainable='mlp'", "attention, all"]),
        ({"sinks": True, "distill": {"num_tokens": 2048, "holdout": 4}},
         ["distill.num_tokens=2048 gives 4 windows", "holdout=4", "num_tokens >= 2560"]),
        ({"sinks": True, "distill": {"epochs": 3}}, ["unknown", "epochs", "steps", "trainable"]),
    ],
)
def test_bad_fields_name_the_field_and_allowed_values(data, words):
    with pytest.raises(PlanError) as err:
        ConversionPlan.from_dict(data)
    for word in words:
        assert word in str(err.value)


def test_kv_heads_must_divide_query_heads():
    class Cfg:
        num_attention_heads = 9

    plan = ConversionPlan.from_dict({"gqa": {"num_key_value_heads": 2}})
    with pytest.raises(PlanError, match=r"allowed: \[1, 3, 9\]"):
        plan.validate_for(Cfg)


def test_missing_plan_file(tmp_path):
    with pytest.raises(PlanError, match="does not exist"):
        ConversionPlan.from_yaml(tmp_path / "nope.yaml")


def test_presets_parse():
    presets = sorted((Path(__file__).parents[2] / "conversion").glob("*.yaml"))
    assert presets, "conversion/ must hold presets"
    for preset in presets:
        ConversionPlan.from_yaml(preset)
