"""Needle/distractor generator and scorer: determinism, lengths, and scripted models that
prove the construction (an oracle scores 100%, a distractor-picker 0%)."""

import re

import pytest
from tiny_models import tiny_tokenizer

from hf_csa2.evals.needle import CATEGORIES, generate_samples, read_jsonl, score_output, write_jsonl
from hf_csa2.evals.needle_eval import format_markdown, generate_answers, score_records, write_reports

WORDS = ("parser buffer socket thread module import syntax value object method class string list "
         "number module error handler stream codec format").split()


def haystack(n=600):
    return " ".join(f"The {WORDS[i % len(WORDS)]} number {i} is described in section {i % 17}. "
                    f"It is used by the {WORDS[(i * 7) % len(WORDS)]}." for i in range(n))


@pytest.fixture(scope="module")
def samples():
    return generate_samples(tiny_tokenizer(), haystack(), lengths=(1500, 3000), depths=(0.0, 0.5, 1.0),
                            per_cell=3, seed=3)


def oracle(prompt: str) -> str:
    """Answers from the prompt alone, as a perfect reader would."""
    log = prompt.split("<log>", 1)[1].split("</log>", 1)[0]
    question = prompt.split("Question:", 1)[1]
    device = re.search(r"[Ii]n ((?:[a-z]+ )+[A-Z]\w*-\d+)", question).group(1)
    if "which alarm" in question.lower():
        events = re.findall(r"the (\w+) alarm was triggered in " + re.escape(device), log)
        return events[0]
    if "firmware" in question:
        new = re.search(re.escape(device) + r", controller model \S+ was replaced by controller model (\S+?)\.", log).group(1)
        return re.search(r"controller model " + re.escape(new) + r" runs firmware version (\d+\.\d+\.\d+)", log).group(1)
    return re.search(r"installed in " + re.escape(device) + r" is model (\S+?)\.", log).group(1)


def first_distractor(sample):
    return sample.wrong[0] if sample.wrong else "no idea"


def test_every_category_and_cell_is_generated(samples):
    assert {s.category for s in samples} == set(CATEGORIES)
    assert len(samples) == len(CATEGORIES) * 2 * 3 * 3
    assert len({s.id for s in samples}) == len(samples)


def test_lengths_are_tokenizer_true_and_close_to_target(samples):
    tok = tiny_tokenizer()
    for s in samples:
        assert s.length == len(tok(s.context, add_special_tokens=False).input_ids)
        assert 0.85 * s.target_length <= s.length <= s.target_length


def test_records_sit_at_their_depths(samples):
    for s in samples:
        if s.category == "far":
            assert abs(s.depths[0] - s.depth) < 0.05
        if s.category == "local":
            assert s.depths[0] >= 0.88


def test_same_seed_same_bytes(tmp_path):
    a = generate_samples(tiny_tokenizer(), haystack(), lengths=(1500,), depths=(0.5,), per_cell=2, seed=1)
    b = generate_samples(tiny_tokenizer(), haystack(), lengths=(1500,), depths=(0.5,), per_cell=2, seed=1)
    c = generate_samples(tiny_tokenizer(), haystack(), lengths=(1500,), depths=(0.5,), per_cell=2, seed=2)
    write_jsonl(a, tmp_path / "a.jsonl")
    write_jsonl(b, tmp_path / "b.jsonl")
    write_jsonl(c, tmp_path / "c.jsonl")
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    assert (tmp_path / "a.jsonl").read_bytes() != (tmp_path / "c.jsonl").read_bytes()
    assert read_jsonl(tmp_path / "a.jsonl") == a


def test_oracle_scores_100_percent_everywhere(samples):
    outputs = generate_answers(oracle, tiny_tokenizer(), samples)
    records = score_records(samples, outputs)
    assert all(r["correct"] for r in records), [r for r in records if not r["correct"]][:3]


def test_first_distractor_scores_zero_on_distractor(samples):
    distractor = [s for s in samples if s.category == "distractor"]
    assert distractor and all(len(s.wrong) == 4 for s in distractor)
    assert not any(score_output(s, first_distractor(s)) for s in distractor)
    # listing every candidate is not rewarded either
    assert not any(score_output(s, " ".join([s.answer, *s.wrong])) for s in distractor)


def test_too_short_length_is_refused():
    with pytest.raises(ValueError, match="target_length=300"):
        generate_samples(tiny_tokenizer(), haystack(), categories=("distractor",), lengths=(300,), depths=(0.5,), per_cell=1)


def test_scorer_normalises_only_case_and_whitespace():
    from hf_csa2.evals.needle import NeedleSample

    s = NeedleSample(id="x", category="far", target_length=1, depth=0, context="", question="", answer="AB-1234")
    assert score_output(s, "  the model is ab-1234 \n")
    assert not score_output(s, "AB 1234") and not score_output(s, "AB-123")


def test_reports(samples, tmp_path):
    outputs = generate_answers(oracle, tiny_tokenizer(), samples)
    results = {"oracle": score_records(samples, outputs),
               "distractor-picker": score_records(samples, [first_distractor(s) for s in samples])}
    paths = write_reports(results, tmp_path)
    table = (tmp_path / "needle.md").read_text()
    assert "| distractor | 1500 | 9 | 1.00 [0.70, 1.00] | 0.00 [0.00, 0.30] | 0.00 |" in table  # 95 % Wilson
    assert len(paths["heatmaps"]) == 2 * len(CATEGORIES)
    assert all((tmp_path / p).exists() for p in paths["heatmaps"])
    assert format_markdown(results).splitlines()[0].startswith("| capability | length | n | oracle")
    # by length and depth, all capabilities pooled: a model that lost only the early facts reads
    # differently from one that lost everything
    results["late-only"] = score_records(samples, [out if s.depth > 0.5 else "no idea" for s, out in zip(samples, outputs)])
    table = write_reports(results, tmp_path)["table"]
    for length in (1500, 3000):
        for depth in (0.0, 0.5, 1.0):
            n = sum(s.target_length == length and s.depth == depth for s in samples)
            late = n if depth > 0.5 else 0
            assert f"| {length} | {depth:.0%} | {n}/{n} | 0/{n} | {late}/{n} |" in table, table


class Interrupted(Exception):
    pass


def test_journal_resumes_and_refuses_other_settings(samples, tmp_path):
    from hf_csa2.evals.needle_eval import OutputJournal

    settings = {"seed": 3, "lengths": [1500, 3000]}
    journal = OutputJournal(tmp_path / "needle.partial.jsonl", settings)
    calls, stop_at = [], [5]

    def counting_oracle(prompt):
        calls.append(prompt)
        if len(calls) == stop_at[0]:
            raise Interrupted  # the run stops mid-way
        return oracle(prompt)

    with pytest.raises(Interrupted):
        generate_answers(counting_oracle, tiny_tokenizer(), samples, on_output=journal.writer("m"))
    with (tmp_path / "needle.partial.jsonl").open("a") as f:
        f.write('{"model": "m", "id": "cut')  # a line cut by the interruption is ignored
    resumed = OutputJournal(tmp_path / "needle.partial.jsonl", settings)
    assert len(resumed.done["m"]) == 4
    calls.clear()
    stop_at[0] = None
    outputs = generate_answers(counting_oracle, tiny_tokenizer(), samples, done=resumed.done["m"],
                               on_output=resumed.writer("m"))
    assert len(calls) == len(samples) - 4  # only the unanswered samples are generated again
    assert all(r["correct"] for r in score_records(samples, outputs))
    with pytest.raises(ValueError, match="other settings"):
        OutputJournal(tmp_path / "needle.partial.jsonl", {"seed": 4})
