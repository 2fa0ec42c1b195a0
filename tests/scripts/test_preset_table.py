"""scripts/preset_table.py: the sentences a preset header carries where a figure is worse off-domain or at length."""
import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "scripts" / "preset_table.py"


@pytest.fixture(scope="module")
def table():
    spec = importlib.util.spec_from_file_location("preset_table", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def results(table, tmp_path, preset: dict, source: dict):
    r = table.Results(tmp_path / "r.json", fresh=True)
    for key, measures in (("source:src", source), ("p", preset)):
        for m, v in measures.items():
            r.data.setdefault(key, {})[m] = {"value": v, "commit": "x", "date": "d"}
    return r


SOURCE = {"ppl python-docs:heldout 2048x4": 10.0, "ppl fortunes:heldout 2048x4": 20.0,
          "ppl python-docs:heldout 8192x1": 8.0, "ppl fortunes:heldout 8192x1": 16.0,
          "answers python-docs:heldout 512": {"far": 20, "near": 20},
          "answers fortunes:heldout 512": {"far": 20, "near": 20},
          "answers python-docs:heldout 2048": {"far": 20, "near": 20}}


def test_a_preset_equal_everywhere_carries_no_caveat(table, tmp_path):
    assert table.caveats(results(table, tmp_path, dict(SOURCE), SOURCE), "p", "src") == []


def test_worse_off_domain_and_at_length_are_each_said(table, tmp_path):
    preset = dict(SOURCE)
    preset["ppl fortunes:heldout 2048x4"] = 22.0                        # ratio 1.10 vs 1.00 at home
    preset["ppl python-docs:heldout 8192x1"] = 8.8                       # 1.10 at 8K vs 1.00 at 2K
    preset["answers fortunes:heldout 512"] = {"far": 10, "near": 20}     # 75 % of the source's vs 100 %
    preset["answers python-docs:heldout 2048"] = {"far": 0, "near": 20}  # 50 % at 2K vs 100 % at 512
    said = table.caveats(results(table, tmp_path, preset, SOURCE), "p", "src")
    assert any("other domain at 2048x4" in s and "1.100" in s for s in said), said
    assert any("at length on python-docs" in s and "1.100 at 8192x1" in s for s in said), said
    assert any("answers worse on the other domain at 512" in s and "75%" in s for s in said), said
    assert any("answers worse at length on python-docs" in s and "50%" in s for s in said), said
    assert len(said) == 4, said


def test_the_header_block_carries_the_caveats(table, tmp_path):
    preset = dict(SOURCE, **{"ppl fortunes:heldout 2048x4": 30.0})
    block = table.header_block(results(table, tmp_path, preset, SOURCE), "p", "src")
    assert any(line.startswith("#   worse: ppl worse on the other domain") for line in block), block


@pytest.mark.parametrize("max_positions, expected", [(32768, [4096, 8192]), (8192, [4096, 8192]),
                                                     (4096, [4096]), (6000, [4096, 6000]), (2048, []),
                                                     (None, [4096, 8192])])
def test_long_contexts_are_4k_and_the_longest_the_source_supports(table, max_positions, expected):
    config = type("Config", (), {"max_position_embeddings": max_positions})()
    assert table.long_contexts(config) == expected


@pytest.mark.parametrize("max_positions, only, expected", [(32768, (8192,), [8192]), (8192, (4096,), [4096]),
                                                           (4096, (8192,), []), (6000, (4096, 6000), [4096, 6000])])
def test_long_contexts_can_be_narrowed_to_the_ones_asked_for(table, max_positions, only, expected):
    config = type("Config", (), {"max_position_embeddings": max_positions})()
    assert table.long_contexts(config, only) == expected


def test_long_columns_read_by_context_then_corpus(table, tmp_path):
    source = dict(SOURCE, **{"ppl fortunes:heldout 4096x2": 18.0, "ppl python-docs:heldout 4096x2": 9.0})
    _, long_ = table._ppl_keys(results(table, tmp_path, {}, source), "source:src")
    assert long_ == ["ppl python-docs:heldout 4096x2", "ppl fortunes:heldout 4096x2",
                     "ppl python-docs:heldout 8192x1", "ppl fortunes:heldout 8192x1"]


def test_merge_takes_what_a_parallel_run_measured_and_keeps_the_rest(table, tmp_path):
    ours = results(table, tmp_path, {"ppl python-docs:heldout 2048x4": 11.0}, SOURCE)
    ours.path.write_text(json.dumps(ours.data))
    theirs = table.Results(tmp_path / "theirs.json", fresh=True)
    theirs.data = json.loads(ours.path.read_text())
    theirs.put("p", "ppl fortunes:heldout 2048x4", 25.0)          # new in the parallel run
    theirs.put("source:src", "ppl python-docs:heldout 2048x4", 12.0)  # measured again there: theirs wins
    taken = ours.merge(theirs.path)
    assert sorted(taken) == ["p: ppl fortunes:heldout 2048x4", "source:src: ppl python-docs:heldout 2048x4"]
    reread = table.Results(ours.path, fresh=False)
    assert reread.get("p", "ppl fortunes:heldout 2048x4")["value"] == 25.0
    assert reread.get("source:src", "ppl python-docs:heldout 2048x4")["value"] == 12.0
    assert reread.get("p", "ppl python-docs:heldout 2048x4")["value"] == 11.0
    assert ours.merge(theirs.path) == []


def test_readme_table_has_both_corpora_at_2k_and_at_8k(table, tmp_path):
    preset = dict(SOURCE, **{"ppl fortunes:heldout 8192x1": 20.0})
    lines = table.readme_table(results(table, tmp_path, preset, SOURCE), {"p": "src"})
    head, source_row, preset_row = lines[1], lines[3], lines[4]
    assert "ppl ratio python-docs 4 × 2,048 | ppl ratio fortunes 4 × 2,048 | ppl ratio python-docs 1 × 8,192 | " \
           "ppl ratio fortunes 1 × 8,192" in head
    assert source_row.startswith("| **src** (source) | – | 1 | 1 | 1 | 1 |")
    assert preset_row.startswith("| `p` | – | 1.000 | 1.000 | 1.000 | 1.250 |")
