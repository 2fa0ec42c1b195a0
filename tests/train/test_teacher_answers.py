"""data.answers: teacher -- the teacher writes the assistant turns of the training exchanges (greedy,
cut at end of turn or after the last full sentence), only as many as a run reads, cached on disk
by a fingerprint of the exchanges, the teacher and the settings."""

import datasets
import pytest
import torch
from tiny_models import tiny_model, tiny_tokenizer

from hf_csa2.train import teacher_answers
from hf_csa2.train.data import training_blocks
from hf_csa2.train.recipe import DataSpec, Recipe, RecipeError
from hf_csa2.train.teacher_answers import cut_unfinished, generate_answers, with_teacher_answers

CHAT = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}")


def chat_tokenizer():
    tok = tiny_tokenizer()
    tok.chat_template = CHAT
    return tok


@pytest.fixture
def teacher():
    """A tiny Llama that stops at '8' as well as at EOS, so its random greedy text ends often at
    some point: answers that end, answers cut, and answers that come out empty all occur."""
    model = tiny_model("llama")
    tok = chat_tokenizer()
    model.generation_config.eos_token_id = [tok.eos_token_id, tok.convert_tokens_to_ids("8")]
    return model


def prompts(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"Question {i}: " + "why " * (i % 4)}] for i in range(n)]


def expected_answer(model, tok, prompt, max_new_tokens) -> str:
    """The answer from one unstopped greedy generation, cut by hand at the first stop token."""
    ids = tok(tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False), add_special_tokens=False,
              return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0,
                             min_new_tokens=max_new_tokens)[0, ids.shape[1]:].tolist()
    stops = set(model.generation_config.eos_token_id)
    for j, t in enumerate(out):
        if t in stops:
            return tok.decode(out[:j], skip_special_tokens=True).strip()
    return cut_unfinished(tok.decode(out, skip_special_tokens=True).strip())


@pytest.mark.parametrize("text, cut", [
    ("One. Two three", "One."), ("Is it? Yes! And then", "Is it? Yes!"), ('He said "go." Then', 'He said "go."'),
    ("no sentence end here", ""), ("v1.2 is out", ""), ("Done.", "Done."),
])
def test_an_unfinished_answer_is_cut_after_its_last_full_sentence(text, cut):
    assert cut_unfinished(text) == cut


def test_answers_are_the_teachers_greedy_text_to_its_stop(teacher, monkeypatch):
    tok = chat_tokenizer()
    monkeypatch.setattr(teacher_answers, "GENERATE_BATCH", 1)
    asked = prompts(12)
    got = generate_answers(teacher, tok, asked, 12)
    want = [expected_answer(teacher, tok, p, 12) for p in asked]
    assert got == want
    assert any(got) and not all(got)  # both kinds occur, so the check above tests both


def test_left_padded_batches_give_each_prompt_its_own_answer(monkeypatch):
    """Prompts of different lengths in one generate() call: every row is what it is alone. In fp64,
    so that batching's rounding cannot flip a near-tie of the random model's greedy choice."""
    model, tok = tiny_model("llama").double(), chat_tokenizer()
    asked = [[{"role": "user", "content": "x" * n}] for n in (1, 9, 30, 4)]
    alone = [generate_answers(model, tok, [p], 10) for p in asked]
    raw = [tok.decode(model.generate(tok(tok.apply_chat_template(p, add_generation_prompt=True, tokenize=False),
                                         return_tensors="pt", add_special_tokens=False)["input_ids"],
                                     do_sample=False, max_new_tokens=10, pad_token_id=0)[0, -10:]) for p in asked]
    assert len(set(raw)) > 1  # the rows differ, so a mix-up between rows would show
    assert generate_answers(model, tok, asked, 10) == [a[0] for a in alone]
    assert tok.padding_side == "right"  # restored


def _saved_exchanges(tmp_path, n: int) -> datasets.Dataset:
    records = [p + [{"role": "assistant", "content": "the passage's answer"}] for p in prompts(n)]
    datasets.Dataset.from_dict({"messages": records}).save_to_disk(str(tmp_path / "ex"))
    return datasets.load_from_disk(str(tmp_path / "ex"))


def test_with_teacher_answers_replaces_the_assistant_turns_and_drops_empty_ones(teacher, tmp_path, monkeypatch):
    tok = chat_tokenizer()
    monkeypatch.setattr(teacher_answers, "GENERATE_BATCH", 1)
    ds = _saved_exchanges(tmp_path, 10)
    out = with_teacher_answers(ds, teacher, tok, max_new_tokens=12, tokens_needed=None, log=lambda m: None)
    want = [(p, expected_answer(teacher, tok, p, 12)) for p in prompts(10)]
    assert [r for r in out["messages"]] == [p + [{"role": "assistant", "content": a}] for p, a in want if a]
    assert 0 < len(out) < 10


def test_only_the_exchanges_a_run_reads_are_answered_and_chunks_are_cached(teacher, tmp_path, monkeypatch):
    tok = chat_tokenizer()
    monkeypatch.setattr(teacher_answers, "CHUNK", 4)
    ds = _saved_exchanges(tmp_path, 12)
    calls = []
    real = teacher_answers.generate_answers
    monkeypatch.setattr(teacher_answers, "generate_answers", lambda *a, **k: calls.append(len(a[2])) or real(*a, **k))
    few = with_teacher_answers(ds, teacher, tok, max_new_tokens=8, tokens_needed=1, log=lambda m: None)
    k = len(calls)  # chunks up to the first with an answer: it holds the 1 token asked for
    assert 1 <= k < 3 and calls == [4] * k and 0 < len(few) <= 4 * k
    every = with_teacher_answers(ds, teacher, tok, max_new_tokens=8, tokens_needed=None, log=lambda m: None)
    assert calls == [4] * 3  # the first k chunks came from the cache
    assert every["messages"][:len(few)] == few["messages"]
    again = with_teacher_answers(ds, teacher, tok, max_new_tokens=8, tokens_needed=None, log=lambda m: None)
    assert calls == [4] * 3 and again["messages"] == every["messages"]
    with_teacher_answers(ds, teacher, tok, max_new_tokens=7, tokens_needed=None, log=lambda m: None)
    assert len(calls) == 6  # another setting is another cache entry
    with torch.no_grad():
        teacher.model.norm.weight.add_(1e-3)
    with_teacher_answers(ds, teacher, tok, max_new_tokens=8, tokens_needed=None, log=lambda m: None)
    assert len(calls) == 9  # and so are other weights


def test_training_blocks_mark_the_teachers_answers(teacher, tmp_path):
    tok = chat_tokenizer()
    doc = tmp_path / "doc.txt"
    doc.write_text("\n\n".join(f"Paragraph {i} begins here with some words. Then it ends." for i in range(60)))
    spec = DataSpec(text=str(doc), seq_len=64, format="chat", tasks=["continue", "recall"], passage_chars=200,
                    answers="teacher", answer_tokens=12)
    blocks = training_blocks(spec, tok, answers=True, teacher=teacher, log=lambda m: None)
    ids = torch.cat([b["input_ids"] for b in blocks]).tolist()
    mask = torch.cat([b["answer_mask"] for b in blocks]).tolist()
    marked = tok.decode([i for i, m in zip(ids, mask) if m])
    text = tok.decode(ids)
    assert "<assistant>" in text and "Paragraph 0 begins" in text
    assert "Then it ends" not in marked  # passage answers are gone: the marked tokens are the teacher's
    answers = [seg.split("<user>")[0] for seg in text.split("<assistant>")[1:]]
    assert marked.startswith(answers[0].replace("</s>", ""))


def test_teacher_answers_are_refused_where_there_are_no_turns_to_write(teacher, tmp_path):
    tok = chat_tokenizer()
    (tmp_path / "doc.txt").write_text("Some text. " * 200)
    with pytest.raises(RecipeError, match=r"data.answers=teacher.*format=text.*data.answers: passage"):
        Recipe.from_dict({"student": "x", "data": {"format": "text", "answers": "teacher"}})
    plain = tiny_tokenizer()  # no chat template: auto resolves to text
    with pytest.raises(RecipeError, match=r"data.answers=teacher.*no chat template.*data.answers: passage"):
        training_blocks(DataSpec(text=str(tmp_path / "doc.txt"), seq_len=32, answers="teacher"), plain, teacher=teacher)
    datasets.Dataset.from_dict({"input_ids": [[5, 6, 7] * 20] * 4}).save_to_disk(str(tmp_path / "ids"))
    with pytest.raises(RecipeError, match=r"data.answers=teacher.*token ids"):
        training_blocks(DataSpec(text=str(tmp_path / "ids"), seq_len=8, answers="teacher"), tok, teacher=teacher)
