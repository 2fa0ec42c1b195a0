"""Completion-style needle prompts (base models): the same records and answers as the chat style,
the answer is the prompt's continuation, only its first sentence is scored; the style is chosen
from the checkpoint's lineage and can be forced."""

import json
import re

import pytest
from .test_needle import haystack, oracle
from tiny_models import tiny_tokenizer

from hf_csa2.evals.needle import (
    ANSWER_HINT, CATEGORIES, COMPLETION_HEADER, INSTRUCTION, generate_samples, prompt_style, score_output,
)
from hf_csa2.evals.needle_eval import build_prompt, generate_answers, score_records
from hf_csa2.io.sources import instruction_tuned, source_names

GRID = dict(lengths=(1500,), depths=(0.0, 0.5, 1.0), per_cell=2, seed=5)


@pytest.fixture(scope="module")
def both():
    tok = tiny_tokenizer()
    return (generate_samples(tok, haystack(), **GRID),
            generate_samples(tok, haystack(), style="completion", **GRID))


def completion_oracle(prompt: str) -> str:
    """Continues the prompt as a perfect reader of its log would, then keeps writing log lines
    (as base models do), one of them naming a look-alike record."""
    log, _, cue = prompt.rpartition("\n\n")
    device = re.search(r"(?:in|of the \w+ alarm and the \w+ alarm in) ((?:[a-z]+ )+[A-Z]\w*-\d+)", cue).group(1)
    if cue.endswith("the first to be triggered was the"):
        answer = re.findall(r"the (\w+) alarm was triggered in " + re.escape(device), log)[0] + " alarm"
    elif cue.endswith("firmware version"):
        new = re.search(re.escape(device) + r", controller model \S+ was replaced by controller model (\S+?)\.", log).group(1)
        answer = re.search(r"controller model " + re.escape(new) + r" runs firmware version (\d+\.\d+\.\d+)", log).group(1)
    else:
        answer = re.search(r"installed in " + re.escape(device) + r" is model (\S+?)\.", log).group(1)
    others = re.findall(r"is model (\S+?)\.", log) + re.findall(r"the (\w+) alarm was triggered", log)
    return f" {answer}.\nMaintenance record: the controller installed in boiler Z-1 is model {' '.join(others)}."


def test_completion_samples_ask_the_same_records_as_chat_samples(both):
    chat, completion = both
    assert [s.id for s in chat] == [s.id for s in completion]
    for c, s in zip(chat, completion):
        assert (c.answer, c.wrong, c.question, c.category) == (s.answer, s.wrong, s.question, s.category)
        assert (c.style, s.style) == ("chat", "completion")
        assert s.context.startswith(COMPLETION_HEADER) and INSTRUCTION not in s.context and ANSWER_HINT not in s.context
        assert 0.85 * s.target_length <= s.length <= s.target_length
        assert abs(s.depths[0] - c.depths[0]) < 0.05
        # the prompt ends with the start of a statement; it gives the answer away only where the
        # question does (order names both alarms, in the question's shuffled order)
        cue = s.context.rpartition("\n\n")[2]
        assert cue.split(":")[0] in ("Maintenance record", "Specification sheet", "Event log")
        assert (s.answer in cue) == (s.category == "order") and s.question not in s.context
    assert {s.category for s in completion} == set(CATEGORIES)


def test_completion_oracle_scores_everything_and_copiers_of_look_alikes_nothing(both):
    _, completion = both
    outputs = generate_answers(completion_oracle, tiny_tokenizer(), completion)
    assert all(r["correct"] for r in score_records(completion, outputs))
    distractor = [s for s in completion if s.category == "distractor"]
    assert distractor and not any(score_output(s, f" {s.wrong[0]}. And {s.answer}.") for s in distractor)
    # the chat-style oracle reads a completion prompt wrongly (no question there): the styles differ
    with pytest.raises(IndexError):
        oracle(completion[0].context)


def test_only_the_first_sentence_of_a_completion_is_scored(both):
    chat, completion = both
    s, c = next(x for x in completion if x.category == "distractor"), next(x for x in chat if x.category == "distractor")
    rambling = f" {s.answer}. Maintenance record: the controller installed in a look-alike is model {s.wrong[0]}."
    assert score_output(s, rambling) and not score_output(c, rambling)
    assert score_output(s, f"\n {s.answer}\nmore {s.wrong[0]}")
    firmware = next(x for x in completion if x.category == "composition")
    assert re.fullmatch(r"\d\.\d\.\d", firmware.answer) and score_output(firmware, f" {firmware.answer}. Then")
    assert not score_output(s, f" unknown. {s.answer}")


def test_completion_prompts_never_get_a_chat_template(both):
    chat, completion = both
    tok = tiny_tokenizer()
    tok.chat_template = "{% for m in messages %}<|user|>{{ m['content'] }}{% endfor %}<|assistant|>"
    assert build_prompt(tok, completion[0]) == completion[0].context
    assert build_prompt(tok, chat[0]).startswith("<|user|>") and build_prompt(tok, chat[0], chat_template=False) == chat[0].context


def test_prompt_style_follows_the_model_and_can_be_forced():
    tok = tiny_tokenizer()
    assert prompt_style(tok) == "completion"  # no chat template
    tok.chat_template = "{{ messages[0]['content'] }}"
    assert prompt_style(tok, instruct=True) == "chat"
    assert prompt_style(tok, instruct=False) == "completion"  # a base model whose tokenizer has a template
    assert prompt_style(tok, "completion", instruct=True) == "completion"
    assert prompt_style(tiny_tokenizer(), "chat", instruct=False) == "chat"
    with pytest.raises(ValueError, match="prompt style 'qa'; allowed: auto, chat, completion"):
        prompt_style(tok, "qa")
    with pytest.raises(ValueError, match="allowed: chat, completion"):
        generate_samples(tok, haystack(), style="auto", **GRID)


def test_instruction_tuned_follows_a_converted_folder_to_its_source(tmp_path):
    assert instruction_tuned("smollm2-135m") and not instruction_tuned("gemma3-270m")
    assert instruction_tuned("google/gemma-3-270m-it") and instruction_tuned("org/Llama-3-8B-Instruct")
    assert not instruction_tuned("Qwen/Qwen2.5-0.5B") and not instruction_tuned("org/summit-7b")
    for source, expected in (("smollm2-135m", True), ("gemma3-270m", False)):
        converted = tmp_path / f"from-{source}"
        uplifted = tmp_path / f"uplifted-{source}"
        for folder, parent in ((converted, source), (uplifted, str(converted))):
            folder.mkdir()
            (folder / "conversion_report.json").write_text(json.dumps({"source": parent}))
        assert instruction_tuned(str(uplifted)) is expected
        assert source_names(str(uplifted))[-2:][0] == source
    (tmp_path / "hub-copy").mkdir()
    (tmp_path / "hub-copy" / "config.json").write_text(json.dumps({"_name_or_path": "google/gemma-3-1b-it"}))
    assert instruction_tuned(str(tmp_path / "hub-copy"))
    loop = tmp_path / "loop"
    loop.mkdir()
    (loop / "conversion_report.json").write_text(json.dumps({"source": str(tmp_path / "loop2")}))
    (tmp_path / "loop2").mkdir()
    (tmp_path / "loop2" / "conversion_report.json").write_text(json.dumps({"source": str(loop)}))
    assert not instruction_tuned(str(loop))  # a cycle of markers ends (depth limit), names no instruct model


def test_eval_needle_picks_completion_for_a_base_model_and_obeys_the_flag(tmp_path, capsys):
    from tiny_models import save_tiny_source

    from hf_csa2.cli import main as cli_main

    save_tiny_source("llama", tmp_path / "base", max_position_embeddings=4096)  # no chat template, no instruct name
    (tmp_path / "text.txt").write_text(haystack())
    common = ["--text", str(tmp_path / "text.txt"), "--lengths", "1500", "--depths", "0.5", "--per-cell", "1",
              "--categories", "far", "--max-new-tokens", "4"]
    used = {}
    for flag in ("auto", "chat"):
        out = tmp_path / f"needle-{flag}"
        assert cli_main(["eval", "needle", str(tmp_path / "base"), "--out", str(out), "--prompt-style", flag,
                         "--export-jsonl", str(tmp_path / f"{flag}.jsonl"), *common]) == 0
        used[flag] = json.loads((out / "needle.json").read_text())["settings"]["prompt_style_used"]
        exported = [json.loads(line) for line in (tmp_path / f"{flag}.jsonl").read_text().splitlines()]
        assert {r["style"] for r in exported} == {used[flag]}
    assert used == {"auto": "completion", "chat": "chat"}
    assert "needle prompts: completion" in capsys.readouterr().err
