"""Typed per-layer attention specs (hf_csa2/model/layer_specs.py): JSON round trips, refusals
that name the field, and config.json files that stay as they were."""

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import tiny_config, tiny_model
from transformers import LlamaConfig

from hf_csa2.model.configuration_hf_csa2 import Csa2Config, validate_csa2_sources
from hf_csa2.model.dense_attention import DenseSinkAttention
from hf_csa2.model.layer_specs import (
    AttentionSpec,
    Csa2FullSpec,
    Csa2ReaderSpec,
    DenseSpec,
    MlaSpec,
    check_csa2_sources,
    parse_attention_layers,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "checkpoints-0.1"
HEADS, HEAD_DIM = 4, 12  # pair indices lie in [0, 6)
GEOMETRY = {"num_attention_heads": HEADS, "head_dim": HEAD_DIM, "qk_norm": False}
KEYS = {  # every key to_dict writes, per kind/mode (defaults written out; exact_window only when true)
    "dense": {"kind", "num_key_value_heads", "sinks"},
    "mla": {"kind", "num_key_value_heads", "sinks", "kv_lora_rank", "rope_pairs", "latent_norm"},
    "full": {"kind", "mode", "num_key_value_heads", "sinks", "kv_lora_rank", "rope_pairs", "latent_norm", "window",
             "top_k", "index_heads", "index_head_dim", "index_rope_pairs", "exact_window"},
    "swa": {"kind", "mode", "num_key_value_heads", "sinks", "window", "sink_tokens"},
    "reuse": {"kind", "mode", "num_key_value_heads", "sinks", "window", "sink_tokens", "source", "entries"},
    "reindex": {"kind", "mode", "num_key_value_heads", "sinks", "window", "sink_tokens", "source", "entries", "top_k",
                "index_heads", "index_head_dim", "index_rope_pairs"},
}


def from_dict(data, layer_idx=0, **geometry):
    return AttentionSpec.from_dict(data, layer_idx, **{**GEOMETRY, **geometry})


# -- strategies: valid JSON specs, optional keys sometimes left to their defaults ---------------

positive = st.integers(1, 64)
kv_heads = st.sampled_from([1, 2, 4])


@st.composite
def maybe(draw, fields: dict) -> dict:
    """Each optional field present or left out."""
    return {k: draw(v) for k, v in fields.items() if draw(st.booleans())}


@st.composite
def common(draw) -> dict:
    return {"num_key_value_heads": draw(kv_heads), **draw(maybe({"sinks": st.booleans()}))}


@st.composite
def mla_fields(draw) -> dict:
    base = draw(common())
    kv, n = base["num_key_value_heads"], draw(st.integers(0, 3))
    keys = draw(st.sampled_from([1, kv]))
    # A key shared by several KV heads mixes them, so its slots may repeat a frequency.
    pairs = st.lists(st.integers(0, HEAD_DIM // 2 - 1), min_size=n, max_size=n, unique=not (keys == 1 and kv > 1))
    return {**base, "kv_lora_rank": draw(positive), "rope_pairs": [draw(pairs) for _ in range(keys)],
            **draw(maybe({"latent_norm": st.booleans()}))}


index_rope_pairs = st.lists(st.integers(0, HEAD_DIM // 2 - 1), max_size=4, unique=True)


@st.composite
def full_spec(draw, window=None) -> dict:
    pairs = draw(index_rope_pairs)
    return {"kind": "csa2", "mode": "full", **draw(mla_fields()), "window": window or draw(positive),
            "top_k": draw(positive), "index_heads": draw(positive), "index_head_dim": max(1, 2 * len(pairs) + draw(st.integers(0, 8))),
            **({"index_rope_pairs": pairs} if pairs or draw(st.booleans()) else {}),
            **draw(maybe({"exact_window": st.booleans()}))}


@st.composite
def reader_spec(draw, mode: str, source: int | None = None) -> dict:
    spec = {"kind": "csa2", "mode": mode, **draw(common()), "window": draw(positive),
            **draw(maybe({"sink_tokens": st.integers(0, 8)}))}
    if mode != "swa":
        spec["source"] = draw(st.integers(0, 8)) if source is None else source
    if mode == "reindex":
        spec.update(top_k=draw(positive), index_heads=draw(positive))
    return spec


layer_dict = st.one_of(
    common().map(lambda d: {"kind": "dense", **d}),
    mla_fields().map(lambda d: {"kind": "mla", **d}),
    full_spec(),
    *(reader_spec(mode) for mode in ("swa", "reindex", "reuse")),
)


@settings(max_examples=200, deadline=None)
@given(layer_dict)
def test_every_kind_and_mode_round_trips_through_its_json_form(data):
    spec = from_dict(data)
    written = spec.to_dict()
    assert from_dict(written) == spec
    assert json.loads(json.dumps(written)) == written  # plain JSON
    # Cross-layer fields stay unset until check_csa2_sources fills them in.
    derived = {"entries", "index_head_dim", "index_rope_pairs"} - set(data) if "source" in data else set()
    unset = {"exact_window"} - ({"exact_window"} if data.get("exact_window") else set())  # written only when true
    assert set(written) == KEYS[data.get("mode", data["kind"])] - derived - unset
    for key, value in data.items():  # given values are kept (pair lists sorted)
        if key == "rope_pairs":
            value = [sorted(p) for p in value]
        elif key == "index_rope_pairs":
            value = sorted(value)
        assert written.get(key, False) == value, key


@st.composite
def csa2_plan(draw) -> list[dict]:
    """A valid CSA2 layer list: a full layer first, then any modes reading earlier layers."""
    window = draw(positive)
    layers = [draw(full_spec(window=window))]
    for i in range(1, draw(st.integers(2, 6))):
        mode = draw(st.sampled_from(["full", "swa", "reindex", "reuse"]))
        if mode == "full":
            layers.append(draw(full_spec(window=window)))
            continue
        readable = [j for j, s in enumerate(layers) if s["mode"] == "full" or (mode == "reuse" and s["mode"] == "reindex")]
        spec = draw(reader_spec(mode, source=draw(st.sampled_from(readable))))
        if mode == "reuse":
            spec["window"] = layers[spec["source"]]["window"] + draw(st.integers(0, 4))
        layers.append(spec)
    return layers


@settings(max_examples=60, deadline=None)
@given(csa2_plan())
def test_csa2_plans_round_trip_and_fill_in_entries(layers):
    specs = parse_attention_layers(layers, **GEOMETRY)
    assert parse_attention_layers([s.to_dict() for s in specs], **GEOMETRY) == specs
    for spec in specs:
        if isinstance(spec, Csa2ReaderSpec) and spec.mode != "swa":
            assert isinstance(specs[spec.entries], Csa2FullSpec)
        if isinstance(spec, Csa2ReaderSpec) and spec.mode == "reindex":
            assert (spec.index_head_dim, spec.index_rope_pairs) == (specs[spec.source].index_head_dim,
                                                                    specs[spec.source].index_rope_pairs)
    base = LlamaConfig(hidden_size=48, num_attention_heads=HEADS, head_dim=HEAD_DIM, num_key_value_heads=2,
                       num_hidden_layers=len(layers), intermediate_size=64, vocab_size=128)
    config = Csa2Config.from_base_config(base, layers)
    assert config.attention_layers == [s.to_dict() for s in specs] == validate_csa2_sources(layers)
    assert config.layer_specs == specs


# -- refusals: a ValueError naming attention_layers[i].field, the value and what is allowed -----

MLA = {"kind": "mla", "num_key_value_heads": 2, "kv_lora_rank": 4, "rope_pairs": [[0], [1]]}
FULL = {"kind": "csa2", "mode": "full", "num_key_value_heads": 2, "kv_lora_rank": 6, "rope_pairs": [[0, 1]],
        "window": 4, "top_k": 8, "index_heads": 2, "index_head_dim": 8, "index_rope_pairs": [0, 1]}
REUSE = {"kind": "csa2", "mode": "reuse", "num_key_value_heads": 2, "source": 0, "window": 4}
REINDEX = {"kind": "csa2", "mode": "reindex", "num_key_value_heads": 2, "source": 0, "window": 4, "top_k": 4,
           "index_heads": 1}


@pytest.mark.parametrize(
    "data, message",
    [
        ([], "attention_layers[0] must be a mapping, got list"),
        ({"kind": "sparse", "num_key_value_heads": 2}, "attention_layers[0].kind='sparse'; allowed: dense, lowrank, mla, csa2"),
        ({"kind": "dense", "num_key_value_heads": 2, "windw": 3},
         "attention_layers[0] has unknown keys ['windw']; allowed for kind='dense': ['kind', 'num_key_value_heads', 'sinks']"),
        ({**FULL, "mode": "swa"}, "attention_layers[0] has unknown keys ['index_head_dim', "),
        ({"kind": "dense", "num_key_value_heads": 3},
         "attention_layers[0].num_key_value_heads=3 must divide num_attention_heads=4; allowed: [1, 2, 4]"),
        ({"kind": "dense", "num_key_value_heads": True}, "attention_layers[0].num_key_value_heads=True must divide"),
        ({"kind": "dense", "num_key_value_heads": "2"}, "attention_layers[0].num_key_value_heads='2' must divide"),
        ({"kind": "dense", "num_key_value_heads": 2, "sinks": "yes"},
         "attention_layers[0].sinks='yes' must be true or false"),
        ({**MLA, "kv_lora_rank": "8"}, "attention_layers[0].kv_lora_rank='8' must be an integer >= 1"),
        ({**MLA, "kv_lora_rank": True}, "attention_layers[0].kv_lora_rank=True must be an integer >= 1"),
        ({**MLA, "latent_norm": 1}, "attention_layers[0].latent_norm=1 must be true or false"),
        ({**MLA, "rope_pairs": [[0], [1], [2]]}, "attention_layers[0].rope_pairs must be a list of pair-index lists, one per KV head (2)"),
        ({**MLA, "rope_pairs": [[0, 1], [1]]}, "attention_layers[0].rope_pairs lists must all have the same length, got sizes [1, 2]"),
        ({**MLA, "rope_pairs": [[0], [6]]}, "attention_layers[0].rope_pairs entries must be distinct pair indices in [0, 6); got [6]"),
        ({**MLA, "rope_pairs": [[0], [True]]}, "attention_layers[0].rope_pairs entries must be distinct pair indices"),
        ({**MLA, "rope_pairs": [[1, 1], [0, 2]]}, "attention_layers[0].rope_pairs entries must be distinct pair indices in [0, 6); got [1, 1]"),
        ({**FULL, "window": 0}, "attention_layers[0].window=0 must be an integer >= 1"),
        ({**FULL, "top_k": None}, "attention_layers[0].top_k=None must be an integer >= 1"),
        ({**FULL, "index_rope_pairs": [0, 1, 2, 3, 4]},
         "attention_layers[0].index_rope_pairs=[0, 1, 2, 3, 4] must be distinct pair indices in [0, 6) filling at most index_head_dim=8"),
        ({**FULL, "index_rope_pairs": [6]}, "attention_layers[0].index_rope_pairs=[6] must be distinct pair indices in [0, 6)"),
        ({**REUSE, "mode": "copy"}, "attention_layers[0].mode='copy'; allowed: swa, full, reindex, reuse"),
        ({**REUSE, "sink_tokens": -1}, "attention_layers[0].sink_tokens=-1 must be an integer >= 0"),
        ({**REUSE, "sink_tokens": False}, "attention_layers[0].sink_tokens=False must be an integer >= 0"),
        ({**REUSE, "source": "0"}, "attention_layers[0].source='0' must be the index of an earlier layer"),
        ({**REUSE, "top_k": 4}, "attention_layers[0] has unknown keys ['top_k']; allowed for kind='csa2' mode='reuse'"),
        ({**REINDEX, "index_head_dim": 0}, "attention_layers[0].index_head_dim=0 must be an integer >= 1"),
    ],
)
def test_a_bad_layer_is_refused_naming_the_field(data, message):
    with pytest.raises(ValueError) as err:
        from_dict(data)
    assert message in str(err.value)


def test_a_shared_rope_key_is_refused_for_qk_norm_sources():
    with pytest.raises(ValueError, match=r"attention_layers\[0\]\.rope_pairs: a QK-norm source"):
        from_dict({**MLA, "rope_pairs": [[0]]}, qk_norm=True)
    assert from_dict({**MLA, "rope_pairs": [[0]]}).rope_pairs == ((0,),)  # fine without QK-norm


def test_a_subclass_takes_only_its_own_kind():
    assert isinstance(MlaSpec.from_dict(FULL, 0, **GEOMETRY), Csa2FullSpec)  # a full layer is an MLA layer
    with pytest.raises(ValueError, match=r"attention_layers\[3\] describes a DenseSpec; a MlaSpec is needed here"):
        MlaSpec.from_dict({"num_key_value_heads": 2}, 3, **GEOMETRY)


@pytest.mark.parametrize(
    "layers, message",
    [
        ([FULL, {**REUSE, "source": 1}],
         "attention_layers[1]: mode='reuse' reads source=1, which is a later layer; it needs an earlier csa2 layer of mode full or reindex"),
        ([FULL, {**REUSE, "source": 5}], "attention_layers[1]: mode='reuse' reads source=5, which is a later layer"),
        ([{"kind": "dense", "num_key_value_heads": 2}, REINDEX],
         "attention_layers[1]: mode='reindex' reads source=0, which is kind='dense' mode=None; it needs an earlier csa2 layer of mode full"),
        ([FULL, {**REUSE}, {**REINDEX, "source": 1}], "which is kind='csa2' mode='reuse'"),
        ([FULL, {**REINDEX, "index_head_dim": 4}],
         "attention_layers[1].index_head_dim=4: a reindex layer scores its source's index keys, so it must equal layer 0's 8"),
        ([FULL, {**REINDEX, "index_rope_pairs": [0]}], "attention_layers[1].index_rope_pairs=[0]: a reindex layer scores"),
        ([FULL, {**REUSE, "window": 2}],
         ("attention_layers[1].window=2 is narrower than its source layer 0's window 4: the Top-K it reuses skips that "
          "window; allowed: window >= 4")),
    ],
)
def test_a_bad_source_is_refused_naming_the_layer(layers, message):
    specs = [from_dict(d, i) for i, d in enumerate(layers)]
    with pytest.raises(ValueError) as err:
        check_csa2_sources(specs)
    assert message in str(err.value)


def test_reindex_inherits_the_index_geometry_and_reuse_of_reindex_reads_the_full_entries():
    specs = parse_attention_layers([FULL, REINDEX, {**REUSE, "source": 1}], **GEOMETRY)
    assert specs[1].entries == 0 and (specs[1].index_head_dim, specs[1].index_rope_pairs) == (8, (0, 1))
    assert specs[2].entries == 0
    # the dict form for plans built outside the model package
    assert validate_csa2_sources([FULL, REINDEX])[1] == specs[1].to_dict()


# -- the config ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["dense-gqa-sinks", "mla-gemma3", "csa2-mixed"])
def test_a_saved_config_keeps_its_attention_layers_byte_for_byte(name, tmp_path):
    folder = FIXTURES / name
    stored = json.loads((folder / "config.json").read_text())["attention_layers"]
    config = Csa2Config.from_pretrained(folder)
    assert [spec.to_dict() for spec in config.layer_specs] == config.attention_layers == stored
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())["attention_layers"]
    assert json.dumps(saved, indent=2, sort_keys=True) == json.dumps(stored, indent=2, sort_keys=True)


def test_layer_specs_follow_reassignment_and_in_place_edits():
    config = Csa2Config.from_base_config(tiny_config("llama"), [{"num_key_value_heads": 2}] * 2)
    assert config.layer_specs == [DenseSpec(num_key_value_heads=2)] * 2 and not config.attention_layers[0]["sinks"]
    assert config.uses_only_native_features
    config.attention_layers = [{"kind": "dense", "num_key_value_heads": 1, "sinks": True}, MLA]
    assert config.layer_specs == [DenseSpec(num_key_value_heads=1, sinks=True),
                                  MlaSpec(num_key_value_heads=2, kv_lora_rank=4, rope_pairs=((0,), (1,)))]
    config.attention_layers[0]["num_key_value_heads"] = 3
    with pytest.raises(ValueError, match=r"attention_layers\[0\]\.num_key_value_heads=3 must divide"):
        _ = config.layer_specs


def test_modules_take_a_json_dict_at_the_boundary_and_show_it_as_spec():
    source = tiny_model("llama")
    config = Csa2Config.from_base_config(source.config, [{"num_key_value_heads": 2}] * 2)
    attn = DenseSinkAttention(source.model.layers[0].self_attn, config, 0, {"num_key_value_heads": 2, "sinks": True})
    assert attn.layer_spec == DenseSpec(num_key_value_heads=2, sinks=True)
    assert attn.spec == {"kind": "dense", "num_key_value_heads": 2, "sinks": True}
    assert attn.sinks is not None
