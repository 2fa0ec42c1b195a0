"""Recipes: typed fields, one-line errors naming the field, --set overrides, the shipped recipes."""

from pathlib import Path

import pytest

from hf_csa2.train.recipe import Recipe, RecipeError, load_recipe

RECIPES = sorted((Path(__file__).resolve().parents[2] / "recipes").glob("*.yaml"))


def test_set_overrides_any_field_by_its_dotted_path():
    r = load_recipe(None, ["student=runs/mqa", "optim.lr=2.0e-4", "peft.r=8", "eval.texts=[a.txt]", "steps=3"])
    assert (r.student, r.optim.lr, r.peft.r, r.eval.texts, r.steps) == ("runs/mqa", 2e-4, 8, ["a.txt"], 3)
    assert r.peft.alpha == 32 and r.loss.kind == "kd"  # untouched fields keep their defaults


def test_data_text_is_one_text_or_a_list_to_mix():
    assert load_recipe(None, ["student=x", "data.text=a.txt"]).data.text == ["a.txt"]
    assert load_recipe(None, ["student=x", "data.text=[a.txt, b.txt]"]).data.text == ["a.txt", "b.txt"]
    assert load_recipe(None, ["student=x"]).data.text == ["python-docs:calib"]


def test_peft_null_trains_modules_directly():
    assert load_recipe(None, ["student=x", "peft=null", "trainable=all"]).peft is None


@pytest.mark.parametrize("sets, words", [
    (["student=x", "optim.lrr=1"], ["unknown key 'lrr' in optim", "allowed: lr, weight_decay, max_grad_norm"]),
    (["steps=3"], ["needs the field 'student'"]),
    (["student=x", "steps=0"], ["steps=0", ">= 1"]),
    (["student=x", "steps=ten"], ["steps='ten'", "an integer"]),
    (["student=x", "loss.kind=mse"], ["loss.kind='mse'", "kd, kd+lm, lm"]),
    (["student=x", "optim.lr=1e-4"], ["optim.lr='1e-4'", "write it with a dot"]),
    (["student=x", "eval.texts=[]"], ["eval.texts", "at least 1"]),
    (["student=x", "peft.dropout=1.5"], ["peft.dropout=1.5", "<= 0.99"]),
    (["student=x", "optim=3"], ["optim=3", "not a mapping"]),
    (["student=x", "optim.lr"], ["--set 'optim.lr'", "FIELD=VALUE"]),
    (["student=x", "loss.positions=511"], ["loss.positions=511", "less than data.seq_len - 1 = 511"]),
    (["student=x", "peft.layers=[]"], ["peft.layers", "at least 1"]),
    (["student=x", "data.text=[]"], ["data.text", "at least 1"]),
    (["student=x", "data.text=3"], ["data.text", "a non-empty string"]),
    (["student=x", "peft.layers=[-1]"], ["peft.layers[0]=-1", "greater than or equal to 0"]),
    (["student=x", "loss.answer_weight=0.0"], ["loss.answer_weight=0.0", "greater than 0"]),
    (["student=x", "loss.on_policy=1.5"], ["loss.on_policy=1.5", "less than or equal to 1"]),
    (["student=x", "loss.on_policy=0.5", "loss.kind=kd+lm"], ["loss.on_policy=0.5 needs loss.kind: kd", "'kd+lm'"]),
    (["student=x", "loss.on_policy=0.5", "data.format=text"], ["on_policy=0.5 needs answers", "data.tasks=[continue]"]),
    (["student=x", "loss.on_policy_tokens=0"], ["loss.on_policy_tokens=0", "greater than or equal to 1"]),
])
def test_bad_fields_name_the_field_and_what_is_allowed(sets, words):
    with pytest.raises(RecipeError) as err:
        load_recipe(None, sets)
    for w in words:
        assert w in str(err.value)


@pytest.mark.parametrize("text, words", [
    ("", ["is empty"]),
    ("student: [unclosed", ["not valid YAML"]),
    ("- a\n- b\n", ["mapping of fields"]),
    ("1: x\nstudent: y\n", ["the key 1"]),
])
def test_bad_recipe_files_are_refused(tmp_path, text, words):
    path = tmp_path / "r.yaml"
    path.write_text(text)
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    for w in words:
        assert w in str(err.value)


def test_recipe_round_trips_through_yaml(tmp_path):
    r = load_recipe(None, ["student=x", "loss.kind=kd+lm", "peft=null"])
    path = tmp_path / "r.yaml"
    path.write_text(r.to_yaml())
    assert load_recipe(path) == r and Recipe.from_dict(r.to_dict()) == r


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_shipped_recipes_validate(path, monkeypatch):
    monkeypatch.chdir(path.parents[1])  # plans are named from the repository root
    r = load_recipe(path)
    assert r.student and r.steps >= 1
    if r.plan is not None:
        assert r.conversion_plan() is not None


def test_plan_set_changes_the_plan_the_student_is_converted_with(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text("gqa: {num_key_value_heads: 1, ridge: 0.3}\ndistill: {steps: 5}\n")
    base = load_recipe(None, ["student=x", f"plan={plan}"]).conversion_plan()
    changed = load_recipe(None, ["student=x", f"plan={plan}", "plan_set=[gqa.ridge=0.5, distill=null]"]).conversion_plan()
    assert (base.gqa.ridge, base.distill.steps) == (0.3, 5)
    assert (changed.gqa.ridge, changed.distill) == (0.5, None) and changed.gqa.num_key_value_heads == 1
    with pytest.raises(RecipeError, match=r"plan_set=\['gqa.bogus=1'\].*unknown key 'bogus' in gqa; allowed: num_key"):
        load_recipe(None, ["student=x", f"plan={plan}", "plan_set=[gqa.bogus=1]"]).conversion_plan()
    with pytest.raises(RecipeError, match="needs recipe.plan"):
        load_recipe(None, ["student=x", "plan_set=[distill=null]"])


def test_chat_exchanges_split_passages_into_a_request_and_its_continuation():
    from hf_csa2.train.data import CONTINUE_PROMPTS, passages_to_chat

    text = "\n\n".join(f"Paragraph {i} says " + " ".join(["more"] * 30) for i in range(12))
    exchanges = passages_to_chat(text, 600, start=1)
    assert len(exchanges) >= 3
    for i, (user, answer) in enumerate(exchanges):
        assert (user["role"], answer["role"]) == ("user", "assistant")
        request, _, head = user["content"].partition("\n\n")
        assert request == CONTINUE_PROMPTS[(1 + i) % len(CONTINUE_PROMPTS)]
        assert f"{head}\n\n{answer['content']}" in text  # the answer is the passage's own continuation
    from hf_csa2.evals.needle import ANSWER_HINT, INSTRUCTION
    assert not {INSTRUCTION, ANSWER_HINT} & set(CONTINUE_PROMPTS)


@pytest.mark.parametrize("name, kind", [("ddp.yaml", "MULTI_GPU"), ("fsdp.yaml", "FSDP")])
def test_accelerate_configs_load(name, kind):
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(RECIPES[0].parent / "accelerate" / name))
    assert config.distributed_type.name == kind and config.num_processes == 2


def test_chat_exchanges_from_text_without_paragraphs_or_spaces():
    from hf_csa2.train.data import passages_to_chat

    words = passages_to_chat(" ".join(["word"] * 400), 600)
    assert len(words) == 1 and words[0][1]["content"] and words[0][0]["content"].endswith("word")
    late_space = passages_to_chat("x" * 700 + " tail", 600)  # the only space is past the middle
    assert len(late_space) == 1 and late_space[0][1]["content"] == "x" * 348 + " tail"


SENTENCES = [f"Sentence number {w} tells the reader about the {w} topic in some detail." for w in
             ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth")]
DOC = "\n\n".join(" ".join(SENTENCES[i:i + 2]) for i in range(0, 8, 2))


def _task_of(request: str) -> str:
    from hf_csa2.train.data import PROMPTS

    for name, prompts in PROMPTS.items():
        if any(request.startswith(p.split("{")[0]) for p in prompts):
            return name
    return "continue"


def test_recall_exchanges_ask_for_a_sentence_of_the_passage_by_its_first_words():
    from hf_csa2.train.data import RECALL_PROMPTS, passages_to_chat

    exchanges = passages_to_chat(DOC, 1000, start=0, tasks=("recall",))
    assert len(exchanges) == 1
    user, answer = exchanges[0][0]["content"], exchanges[0][1]["content"]
    passage, _, request = user.rpartition("\n\n")
    assert passage == DOC and _task_of(request) == "recall" and request.startswith(RECALL_PROMPTS[0].split('"')[0])
    cue = request.split('"')[1]
    assert answer in SENTENCES and answer.startswith(cue) and DOC.count(cue) == 1
    picks = {passages_to_chat(DOC, 1000, start=k, tasks=("recall",))[0][1]["content"] for k in range(12)}
    assert len(picks) > 2  # the sentence asked for varies with the position, not always the first
    assert passages_to_chat(DOC, 1000, start=5, tasks=("recall",)) == passages_to_chat(DOC, 1000, 5, ("recall",))


def test_next_exchanges_ask_for_the_sentence_after_a_quoted_one():
    from hf_csa2.train.data import passages_to_chat

    for k in range(6):
        user, answer = (m["content"] for m in passages_to_chat(DOC, 1000, start=k, tasks=("next",))[0])
        request = user.rpartition("\n\n")[2]
        assert _task_of(request) == "next"
        cue = request.split('"')[1]
        assert SENTENCES.index(answer) == SENTENCES.index(cue) + 1


def test_fill_exchanges_leave_out_a_word_the_passage_has_once():
    from hf_csa2.train.data import BLANK, FILL_PROMPTS, passages_to_chat

    names = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot")
    sentences = [f"The {w} handler calls parse_{w}_item before it returns." for w in names]
    doc = "\n\n".join(" ".join(sentences[i:i + 2]) for i in range(0, 6, 2))
    assert passages_to_chat(DOC, 1000, tasks=("fill",))[0][0]["content"].startswith("Continue")  # no word once
    answers = set()
    for k in range(10):
        user, answer = (m["content"] for m in passages_to_chat(doc, 1000, start=k, tasks=("fill",))[0])
        passage, _, request = user.rpartition("\n\n")
        assert passage == doc and _task_of(request) == "fill" and request.startswith(FILL_PROMPTS[k % 2].split('"')[0])
        cue = request.split('"')[1]
        assert cue.count(BLANK) == 1 and cue.replace(BLANK, answer) in sentences
        assert answer in names or answer in {f"parse_{w}_item" for w in names}  # "handler": many times, never asked
        answers.add(answer)
    assert len(answers) > 3
    # words are whole words: "value" inside "values", "read" inside "re-read" do not count as more
    from hf_csa2.train.data import _fill_pairs, _sentences

    text = "The values are read twice at the start. Every value is re-read later in the loop. Twice it ran."
    pairs = _fill_pairs(text, _sentences(text))
    words = {w for _, w in pairs}
    assert {"value", "values", "read", "re-read", "start", "loop"} <= words and not words & {"The", "twice"}
    assert ("The values are ____ twice at the start.", "read") in pairs


def test_first_exchanges_ask_which_of_two_far_apart_words_the_passage_has_first():
    from hf_csa2.train.data import FIRST_PROMPTS, passages_to_chat

    names = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india")
    doc = "\n\n".join(f"The {w} handler runs before it returns." for w in names)
    asked_first = []
    for k in range(40):
        user, answer = (m["content"] for m in passages_to_chat(doc, 1000, start=k, tasks=("first",))[0])
        passage, _, request = user.rpartition("\n\n")
        assert passage == doc and _task_of(request) == "first" and request.startswith(FIRST_PROMPTS[k % 2].split('"')[0])
        a, b = request.split('"')[1], request.split('"')[3]
        assert {a, b} <= set(names) and answer in (a, b)
        assert doc.index(answer) == min(doc.index(a), doc.index(b))  # the earlier one, not the first asked
        assert abs(doc.index(a) - doc.index(b)) >= len(doc) // 3
        asked_first.append(answer == a)
    assert 10 <= sum(asked_first) <= 30  # the answer is not always the word asked first
    # every word repeated, or fewer than two words that occur once: continue instead
    assert _task_of(passages_to_chat(DOC, 1000, tasks=("first",))[0][0]["content"]) == "continue"
    assert _task_of(passages_to_chat("Token token token token token token unique.", 40, tasks=("first",))[0][0]["content"]) == "continue"
    from hf_csa2.train.data import _unique_words

    assert [w for _, w in _unique_words("Value values VALUE read re-read, read once.")] == ["values", "re-read", "once"]


def test_lookalike_exchanges_plant_a_near_copy_far_away_and_ask_for_the_originals_word():
    import re

    from hf_csa2.train.data import BLANK, LOOKALIKE_PROMPTS, _sentences, passages_to_chat

    names = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india")
    doc = " ".join(f"The {w} handler calls parse_{w} before it returns." for w in names)
    answers = set()
    for k in range(12):
        user, answer = (m["content"] for m in passages_to_chat(doc, 1000, start=k, tasks=("lookalike",))[0])
        passage, _, request = user.rpartition("\n\n")
        assert _task_of(request) == "lookalike" and request.startswith(LOOKALIKE_PROMPTS[k % 2].split('"')[0])
        cue = request.split('"')[1]
        original = cue.replace(BLANK, answer)
        old, new = _sentences(doc), _sentences(passage)
        assert len(new) == len(old) + 1 and original in old
        (twin,) = [x for x in new if x not in old]
        assert [x for x in new if x != twin] == old  # the passage is kept, one sentence planted
        differ = [(a, b) for a, b in zip(original.split(), twin.split()) if a != b]
        assert len(differ) == 2 and len(original.split()) == len(twin.split())  # two words swapped
        assert answer in [a for a, _ in differ] and BLANK not in twin
        wrong = dict(differ)[answer]
        assert wrong != answer and re.sub(re.escape(answer), wrong, cue.replace(BLANK, answer)) != twin  # the key differs too
        assert len(re.findall(rf"\b{re.escape(answer)}\b", passage)) == 1  # only the original holds the answer
        assert abs(new.index(twin) - new.index(original)) >= len(old) // 3
        answers.add(answer)
    assert len(answers) > 3
    # no sentence with two words that occur once in the passage: continue instead
    assert _task_of(passages_to_chat(DOC, 1000, tasks=("lookalike",))[0][0]["content"]) == "continue"


FOREIGN = ("Kettles whistle loudly when the water boils over. A heron waited motionless beside the quiet pond. "
           "Grandmother baked cinnamon bread every winter morning.")


def test_planted_exchanges_plant_another_documents_sentence_and_ask_for_a_word_the_passage_lacks():
    import re

    from hf_csa2.train.data import BLANK, PLANTED_PROMPTS, _sentences, passages_to_chat

    old, foreign = _sentences(DOC), _sentences(FOREIGN)
    places, answers = set(), set()
    for k in range(60):
        user, answer = (m["content"] for m in passages_to_chat(DOC, 1000, start=k, tasks=("planted",), foreign=FOREIGN)[0])
        passage, _, request = user.rpartition("\n\n")
        assert _task_of(request) == "planted" and request.startswith(PLANTED_PROMPTS[k % 2].split('"')[0])
        cue = request.split('"')[1]
        assert cue.count(BLANK) == 1
        new = _sentences(passage)
        (planted,) = [x for x in new if x not in old]
        assert [x for x in new if x != planted] == old  # the passage is kept whole, one sentence added
        assert planted in foreign and cue.replace(BLANK, answer) == planted  # the answer is the planted sentence's word
        assert not re.search(rf"\b{re.escape(answer)}\b", DOC, re.IGNORECASE)  # nothing of the passage gives it away
        assert len(re.findall(rf"\b{re.escape(answer)}\b", passage, re.IGNORECASE)) == 1
        places.add(new.index(planted))
        answers.add(answer)
    assert places == set(range(len(old) + 1))  # at the start, in between, at the end
    assert len(answers) > 5
    # no other document, or none of its sentences has a word the passage lacks: continue instead
    assert _task_of(passages_to_chat(DOC, 1000, tasks=("planted",))[0][0]["content"]) == "continue"
    assert _task_of(passages_to_chat(DOC, 1000, tasks=("planted",), foreign=DOC)[0][0]["content"]) == "continue"


def test_planted_takes_its_sentence_from_another_document_of_the_batch_in_both_formats():
    from hf_csa2.train.data import BLANK, PLANTED_LEADS, _sentences, _to_chat, _to_completions

    tasks = ("planted",)
    chats = _to_chat(500, tasks)({"text": [DOC, FOREIGN]}, [0, 1])["messages"]
    docs = _to_completions(500, tasks, answers=True)({"text": [DOC, FOREIGN]}, [0, 1])
    assert len(chats) == 2 and len(docs["text"]) == 2
    for k, (chat, document, start, own, other) in enumerate(zip(chats, docs["text"], docs["answer_from"], (DOC, FOREIGN),
                                                                (FOREIGN, DOC))):
        user, answer = chat[0]["content"], chat[1]["content"]
        passage, _, request = user.rpartition("\n\n")
        (planted,) = [x for x in _sentences(passage) if x not in _sentences(own)]
        assert planted in _sentences(other)
        cue = request.split('"')[1]
        assert document == f"{passage}\n\n{PLANTED_LEADS[k % 2].format(cue=cue)}{answer}" and cue.count(BLANK) == 1
        assert document[start:] == answer
    assert _to_chat(1000, tasks)({"text": [DOC]}, [0])["messages"][0][0]["content"].startswith("Continue")  # alone


def test_copy_tasks_rotate_and_fall_back_to_continuing_when_no_sentence_fits():
    from hf_csa2.train.data import passages_to_chat

    text = "\n\n".join(" ".join(SENTENCES) for _ in range(3))  # every cue occurs three times: none qualifies
    exchanges = passages_to_chat(text, 400, tasks=("recall", "next"))
    assert exchanges and all(_task_of(user["content"]) == "continue" for user, _ in exchanges)
    paragraphs = "\n\n".join(" ".join(s.replace("number", f"{p}/") for s in SENTENCES[:3]) for p in range(6))
    kinds = [_task_of(user["content"].rpartition("\n\n")[2]) for user, _ in
             passages_to_chat(paragraphs, 150, start=1, tasks=("continue", "recall"))]
    assert kinds == ["recall", "continue"] * 3  # in turn, from tasks[start % 2]
    with pytest.raises(ValueError, match="allowed values are continue, recall, next, fill"):
        passages_to_chat(DOC, 400, tasks=("copy",))


def test_completion_copy_tasks_are_the_chat_tasks_as_text():
    """For base models the same passages and picks become documents: passage, a lead-in quoting the
    cue, and the passage's own sentence right after it."""
    from hf_csa2.train.data import LEADS, passages_to_chat, passages_to_completions

    # two words once per sentence (lookalike swaps two)
    paragraphs = "\n\n".join(" ".join(s.replace("number", f"tag{p}{i}").replace("reader", f"reader{p}{i}")
                                        for i, s in enumerate(SENTENCES)) for p in range(4))
    tasks = ("recall", "next", "fill", "continue", "first", "lookalike")
    chats = passages_to_chat(paragraphs, 300, start=2, tasks=tasks)
    documents = passages_to_completions(paragraphs, 300, start=2, tasks=tasks)
    assert len(documents) == len(chats) == 4
    for k, (chat, document) in enumerate(zip(chats, documents), start=2):
        user, answer = chat[0]["content"], chat[1]["content"]
        task = _task_of(user.rpartition("\n\n")[2])
        assert task == tasks[k % 6]
        if task == "continue":
            head = user.split("\n\n", 1)[1]  # after the request
            assert document.split() == (head + " " + answer).split() and answer not in head  # the passage, whole
            continue
        passage, _, completion = document.rpartition("\n\n")
        assert passage == user.rpartition("\n\n")[0] and completion.endswith(": " + answer)
        quoted = user.rpartition("\n\n")[2].split('"')
        leads = LEADS[task]
        lead = leads[k % len(leads)]
        lead = lead.format(a=quoted[1], b=quoted[3]) if task == "first" else lead.format(cue=quoted[1])
        assert completion == lead + answer
    with pytest.raises(ValueError, match="allowed values are continue, recall, next, fill"):
        passages_to_completions(DOC, 400, tasks=())


def test_copy_task_templates_are_not_the_evals_templates():
    from hf_csa2.evals.needle import ANSWER_HINT, INSTRUCTION
    from hf_csa2.metrics import answer_check
    from hf_csa2.train.data import LEADS, PROMPTS

    for prompt in [p for group in (*PROMPTS.values(), *LEADS.values()) for p in group]:
        assert INSTRUCTION not in prompt and ANSWER_HINT not in prompt and "controller" not in prompt
        assert "alarm" not in prompt and "triggered" not in prompt  # the needles' order question
        assert not any(thing in prompt for thing in answer_check._THINGS)


def test_recipe_data_tasks_are_validated():
    from hf_csa2.train.recipe import load_recipe

    assert load_recipe(None, ["student=x", "data.tasks=[recall, next]"]).data.tasks == ["recall", "next"]
    assert load_recipe(None, ["student=x"]).data.tasks == ["continue"]
    with pytest.raises(RecipeError, match=r"data.tasks\[0\]='copy'.*allowed: a list of continue, recall, next, fill, first, lookalike"):
        load_recipe(None, ["student=x", "data.tasks=[copy]"])
    with pytest.raises(RecipeError, match="data.tasks=.*at least 1 item"):
        load_recipe(None, ["student=x", "data.tasks=[]"])
