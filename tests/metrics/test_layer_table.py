"""The per-layer table of `hf-csa2 inspect` and the model card: runs of alike layers share a row."""

from hf_csa2.metrics.kv_cache import format_layer_table


def dense(window=None, kv=1):
    return {"kind": "dense", "num_key_value_heads": kv, "window": window, "kv_elements_per_token": 128 * kv}


def test_consecutive_alike_layers_share_one_row_and_any_difference_starts_a_new_one():
    reuse = {"kind": "csa2", "mode": "reuse", "source": 0, "top_k": 64, "read_window": 16, "num_key_value_heads": 1,
             "window": 16, "kv_elements_per_token": 0}
    layers = [dense(), dense(), dense(), reuse, dense(512), dense(512), dense(), dense(kv=3)]
    rows = format_layer_table(layers).splitlines()[2:]
    assert [r.split(" | ")[0] for r in rows] == ["| 0-2", "| 3", "| 4-5", "| 6", "| 7"]
    assert rows[1] == "| 3 | csa2 reuse <- 0 (top-64, window 16) | 1 | - | - | False | 16 | 0 |"
    assert rows[2].endswith("| 512 | 128 |") and rows[4].endswith("| 3 | - | - | False | - | 384 |")
    assert len(format_layer_table([dense()] * 30).splitlines()) == 3  # an MQA conversion: one row, 0-29
