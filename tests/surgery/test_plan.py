"""Plan dataclasses: YAML round trip and one clear error per bad field."""

import re
from pathlib import Path

import pytest

from hf_csa2.surgery.plan import MLA_REMOVED_FIELDS, ConversionPlan, MlaPlan, PlanError


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


def test_every_preset_header_names_its_own_convert_command():
    """A user copies the command from the header; scripts/preset_table.py reads the source from it."""
    presets = sorted((Path(__file__).parents[2] / "conversion").glob("*.yaml"))
    missing = [p.name for p in presets if not re.search(
        r"^#.*hf-csa2 convert \S+ --plan conversion/" + re.escape(p.name) + r"\b", p.read_text(), re.M)]
    assert not missing, f"presets whose header lacks 'hf-csa2 convert SOURCE --plan conversion/<name>': {missing}"


# hf_csa2_plan.yaml as 0.1 wrote it next to a checkpoint (every field, the removed ones false).
PLAN_0_1 = """\
gqa: null
mla:
  kv_lora_rank: 64
  qk_rope_head_dim: 32
  rope_key: shared
  rope_criterion: perturbation
  init: activation_aware
  latent_norm: false
  uniform_rope: false
  averaged_values: false
  drop_fast_terms: false
  uneven_ranks: false
  compare_weight_svd: true
  refit_output: true
  ridge: 0.3
  refine_steps: 100
  refine_lr: 0.0003
sinks: null
csa2: null
distill: null
calibration:
  text: python-docs:calib
  num_tokens: 8192
  seq_len: 512
  eval_windows: 4
dtype: float32
context: 8192
"""


def test_plans_saved_before_0_2_load_and_drop_the_removed_mla_fields(tmp_path):
    path = tmp_path / "hf_csa2_plan.yaml"
    path.write_text(PLAN_0_1)
    plan = ConversionPlan.from_yaml(path)
    assert plan.mla == MlaPlan(kv_lora_rank=64, qk_rope_head_dim=32, refine_steps=100, refine_lr=3e-4)
    assert not set(MLA_REMOVED_FIELDS) & set(plan.to_dict()["mla"])
    path.write_text(plan.to_yaml())
    assert ConversionPlan.from_yaml(path) == plan
    assert MlaPlan(kv_lora_rank=8, qk_rope_head_dim=4, uneven_ranks=False) == MlaPlan(kv_lora_rank=8, qk_rope_head_dim=4)


@pytest.mark.parametrize("name, figure", [("averaged_values", "2.634"), ("drop_fast_terms", "2.538"),
                                          ("uneven_ranks", "3.089")])
def test_a_removed_mla_field_set_true_is_refused_with_the_reason(tmp_path, name, figure):
    path = tmp_path / "hf_csa2_plan.yaml"
    path.write_text(PLAN_0_1.replace(f"{name}: false", f"{name}: true"))
    with pytest.raises(PlanError) as err:
        ConversionPlan.from_yaml(path)
    message = str(err.value)
    assert message.startswith(f"mla.{name}=true: removed in 0.2 (") and figure in message, message
    assert "allowed: false" in message and "\n" not in message
    with pytest.raises(PlanError, match=f"mla.{name}='yes': removed in 0.2"):
        ConversionPlan.from_dict({"mla": {"kv_lora_rank": 8, "qk_rope_head_dim": 4, name: "yes"}})


@pytest.mark.parametrize(
    "mla, message",
    [
        ({"qk_rope_head_dim": 3}, "mla.qk_rope_head_dim=3; allowed: an even number"),
        ({"init": "weight_svd", "refine_steps": 5}, "mla.refine_steps needs init: activation_aware"),
        ({"init": "weight_svd", "latent_norm": True}, "mla.latent_norm needs init: activation_aware"),
    ],
)
def test_the_mla_section_checks_its_own_fields_together(mla, message):
    with pytest.raises(PlanError, match=message):
        ConversionPlan.from_dict({"mla": {"kv_lora_rank": 8, "qk_rope_head_dim": 4, **mla}})
    with pytest.raises(ValueError, match=message):  # on its own too (pydantic's ValidationError is a ValueError)
        MlaPlan(**{"kv_lora_rank": 8, "qk_rope_head_dim": 4, **mla})


@pytest.mark.parametrize(
    "plan, message",
    [
        ({"gqa": {"num_key_value_heads": 1, "init": "mean", "refine_steps": 5}}, "gqa.refine_steps needs init: calibrated"),
        ({"gqa": {"num_key_value_heads": 1, "refine_steps": 5}, "calibration": {"num_tokens": 1024, "seq_len": 512}},
         "gqa.refine_steps needs at least 3 calibration windows .* gives 2"),
        ({"mla": {"kv_lora_rank": 8, "qk_rope_head_dim": 4, "refine_steps": 5}, "calibration": {"num_tokens": 1024, "seq_len": 512}},
         "mla.refine_steps needs at least 3 calibration windows .* gives 2"),
    ],
)
def test_a_refinement_needs_a_calibrated_init_and_held_out_windows(plan, message):
    with pytest.raises(PlanError, match=message):
        ConversionPlan.from_dict(plan)
