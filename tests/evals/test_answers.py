"""hf-csa2 eval answers: every model scored on the same probes cut from the text (the figures equal
the answer check run by hand on those probes), a JSON file, and models with another tokenizer refused."""

import json

import pytest
from tiny_models import save_tiny_source, tiny_tokenizer

from hf_csa2.cli import main as cli_main
from hf_csa2.data.windows import token_windows
from hf_csa2.evals.answers import compare_answers
from hf_csa2.io.sources import load_source
from hf_csa2.metrics.answer_check import answer_check, make_probes

TEXT = " ".join(f"Line {i} of the ledger notes {i * 7 % 19} crates of pears and {i * 5 % 13} of plums." for i in range(300))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("answers")
    (root / "text.txt").write_text(TEXT)
    for name, seed in (("a", 0), ("b", 1)):
        save_tiny_source("llama", root / name, seed=seed)
    return root


def test_every_model_is_scored_on_the_same_probes(models, tmp_path, capsys):
    a, b, text = models / "a", models / "b", models / "text.txt"
    out = tmp_path / "answers.json"
    assert cli_main(["eval", "answers", str(a), str(b), "--text", str(text), "--context", "128", "--per-depth", "3",
                     "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert table.startswith("| model | far | near | answer NLL |")
    results = json.loads(out.read_text())["results"]
    tok = load_source(a).tokenizer
    probes = make_probes(tok, token_windows(tok, text, 128, 3), 3)
    for r, folder in zip(results, (a, b)):
        expected = answer_check(load_source(folder).model, probes).to_dict()
        assert r == {"model": str(folder), **expected}
    # two different random models: the NLLs of their answers differ (each model really ran)
    assert results[0]["answer_nll"] != results[1]["answer_nll"] and results[0]["per_depth"] == 3
    assert results[0]["context"] == 128


def test_a_model_with_another_tokenizer_is_refused(models, tmp_path):
    other = tmp_path / "other"
    save_tiny_source("llama", other)
    tok = tiny_tokenizer()
    tok.add_tokens(["<extra>"])
    tok.save_pretrained(other)
    entries = [(str(models / "a"), lambda: load_source(models / "a")), (str(other), lambda: load_source(other))]
    with pytest.raises(ValueError, match="tokenizer differs"):
        compare_answers(entries, models / "text.txt", context=128, per_depth=2)


def test_a_context_too_short_for_a_probe_exits_2(models, capsys):
    code = cli_main(["eval", "answers", str(models / "a"), "--text", str(models / "text.txt"), "--context", "24"])
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line.lower()]
    assert code == 2 and len(errors) == 1 and "--context 24" in errors[0] and "too short" in errors[0], errors
