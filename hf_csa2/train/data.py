"""Training data through the ``datasets`` library: load, render chat records, tokenise, pack into
fixed-length blocks; every step is cached on disk by ``datasets`` (fingerprinted ``map`` calls), so
a second run of the same recipe starts at once.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import datasets

from ..cache import cache_dir
from ..data.corpus import list_text_files, resolve_text
from .recipe import CHAT_TASKS, DataSpec, RecipeError
from .teacher_answers import with_teacher_answers

TEXT_COLUMNS = ("text", "messages", "input_ids")


def _dataset_cache() -> str:
    return str(cache_dir() / "datasets")


def _is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and ((path / "dataset_info.json").is_file() or (path / "state.json").is_file()
                              or (path / "dataset_dict.json").is_file())


def load_records(text: str) -> datasets.Dataset:
    """The raw records of ``data.text``: a ``text`` column (plain text, one record per file), a
    ``messages`` column (chat records) or ``input_ids`` (already tokenised)."""
    path = Path(text).expanduser()
    if _is_saved_dataset(path):
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise RecipeError(f"data.text={text!r} is a DatasetDict without a 'train' split (it has {list(ds)})")
            ds = ds["train"]
    elif path.suffix == ".jsonl" and path.is_file():
        ds = datasets.load_dataset("json", data_files=str(path), split="train", cache_dir=_dataset_cache())
    else:
        files = [str(f) for f in list_text_files(resolve_text(text))]
        if not files:
            raise RecipeError(f"data.text={text!r} holds no text files (.txt, .rst, .md)")
        ds = datasets.load_dataset("text", data_files=files, sample_by="document", split="train",
                                   cache_dir=_dataset_cache())
    if not any(c in ds.column_names for c in TEXT_COLUMNS):
        raise RecipeError(f"data.text={text!r} has the columns {ds.column_names}; allowed: one of "
                          f"{', '.join(TEXT_COLUMNS)} (text, chat records {{\"messages\": [...]}}, or token ids)")
    return ds


# User turns of the chat format (never the needle suite's or the answer check's templates: the evals
# must stay a test of something not trained on). ``continue``: continue a passage.
CONTINUE_PROMPTS = (
    "Continue this text.",
    "Here is the start of a document. Write how it goes on.",
    "Read the passage below and continue it in the same style.",
    "What comes next in this text? Write the next part.",
)
# ``recall``: the passage, then a request to copy out the sentence that begins with a quoted cue.
RECALL_PROMPTS = (
    'Write out in full the sentence of the text above that begins with "{cue}".',
    'Quote, word for word, the sentence from this passage that starts with "{cue}".',
)
# ``next``: the passage, then a request to copy out the sentence that follows a quoted one.
NEXT_PROMPTS = (
    'In the text above, which sentence comes right after "{cue}"? Quote it exactly.',
    'Copy out the sentence that directly follows "{cue}" in the passage.',
)
# ``fill``: the passage, then one of its sentences with a word (one that occurs once in the passage)
# left out; the answer is the word, copied from the passage: a short, exact answer that only the
# passage holds, read by what surrounds it.
FILL_PROMPTS = (
    'One word of this sentence from the text above is left out: "{cue}". Which word goes in the gap? '
    "Answer with that word only.",
    'Fill in the blank with the word the passage uses: "{cue}"',
)
BLANK = "____"
# ``first``: the passage, then two of its words (each occurring once, far apart) and the question which
# one the passage has first; the answer is that word: the order of two things read from far back, which
# no single sentence holds.
FIRST_PROMPTS = (
    'Of the words "{a}" and "{b}", which one appears earlier in the text above? Answer with that word only.',
    'Which comes first in this passage, the word "{a}" or the word "{b}"? Reply with just that word.',
)
# The same tasks for base models, as text to complete (``data.format: text``): a lead-in that
# quotes the cue, then the sentence (or the word).
RECALL_LEADS = (
    'The sentence above that begins with "{cue}" reads in full: ',
    'Word for word, the sentence of this passage starting with "{cue}" is: ',
)
NEXT_LEADS = (
    'In the text above, the sentence right after "{cue}" is: ',
    'The sentence that directly follows "{cue}" reads: ',
)
FILL_LEADS = (
    'In the text above, the word left out of "{cue}" is: ',
    'The missing word in "{cue}", as the passage has it, is: ',
)
# ``lookalike``: a copy of one of the passage's sentences with two words swapped for others of the passage
# is planted a third of the passage away from it; the request quotes the original with one word left out
# (the other swapped word is still in the cue and tells the two apart); the answer is the original's word,
# not the look-alike's: reading past a near-duplicate, which plain passages never ask.
LOOKALIKE_PROMPTS = (
    'In the text above, which word fills the gap in "{cue}"? Answer with that word only.',
    'Give the word the passage has where this sentence has a gap: "{cue}"',
)
LOOKALIKE_LEADS = (
    'In the text above, the word in the gap of "{cue}" is: ',
    'Where "{cue}" has a gap, the passage reads: ',
)
FIRST_LEADS = (
    'Of the words "{a}" and "{b}", the one that appears earlier in the text above is: ',
    'Between "{a}" and "{b}", the word this passage has first is: ',
)
# ``planted``: a sentence of ANOTHER document planted at a random place of the passage, then that sentence with
# one word left out (a word the passage itself never has): the answer has nothing to do with what the
# passage is about, so neither its topic nor its style gives it away; it must be found and read back.
PLANTED_PROMPTS = (
    'A sentence from another text was slipped into the passage above: "{cue}". Which word is missing from it? '
    "Answer with that word only.",
    'Somewhere in this passage is a sentence that does not belong there: "{cue}". Give the word in its gap.',
)
PLANTED_LEADS = (
    'The sentence slipped into the text above, "{cue}", has in its gap the word: ',
    'Where the out-of-place sentence "{cue}" has a gap, the passage reads: ',
)
PROMPTS = {"recall": RECALL_PROMPTS, "next": NEXT_PROMPTS, "fill": FILL_PROMPTS, "first": FIRST_PROMPTS,
           "lookalike": LOOKALIKE_PROMPTS, "planted": PLANTED_PROMPTS}
LEADS = {"recall": RECALL_LEADS, "next": NEXT_LEADS, "fill": FILL_LEADS, "first": FIRST_LEADS,
         "lookalike": LOOKALIKE_LEADS, "planted": PLANTED_LEADS}


def _request(template: str, cue) -> str:
    """A prompt or lead-in with its cue: one quoted text, or the two words of ``first``."""
    return template.format(a=cue[0], b=cue[1]) if isinstance(cue, tuple) else template.format(cue=cue)


_SENTENCE_END = re.compile(r"(?<=[.!?])(?<!e\.g\.)(?<!i\.e\.)(?<!\bvs\.)\s+(?=[A-Z\"'(`])")
_CUE_WORDS = 5


def _sentences(chunk: str) -> list[str]:
    """Sentences of one paragraph group, verbatim (line breaks kept), split after . ! ? before a capital."""
    return [s.strip() for s in _SENTENCE_END.split(chunk) if s.strip()]


def _copyable(sentence: str, lo: int = 6, hi: int = 60) -> bool:
    return lo <= len(sentence.split()) <= hi and "\n\n" not in sentence


def _continue_exchange(chunk: str, k: int) -> list[dict] | None:
    cut = chunk.rfind("\n\n", 0, len(chunk) // 2 + len(chunk) // 4)
    if cut < len(chunk) // 4:  # no paragraph break near the middle: cut at a space, else mid-word
        cut = chunk.rfind(" ", 0, len(chunk) // 2)
        if cut <= 0:
            cut = len(chunk) // 2
    head, tail = chunk[:cut].strip(), chunk[cut:].strip()
    if not (head and tail):
        return None
    return [{"role": "user", "content": f"{CONTINUE_PROMPTS[k % len(CONTINUE_PROMPTS)]}\n\n{head}"},
            {"role": "assistant", "content": tail}]


_WORD = r"[A-Za-z0-9_][\w\-]*[A-Za-z0-9_]"


def _whole_word(word: str) -> str:
    return rf"(?<![\w\-]){re.escape(word)}(?![\w\-])"


def _fill_pairs(chunk: str, sentences: list[str]) -> list[tuple[str, str]]:
    """``(sentence with one word blanked, the word)`` for every word of 4+ characters of a copyable
    sentence that occurs once in the passage, in any case (so the gap has one answer)."""
    pairs = []
    for s in sentences:
        if not _copyable(s):
            continue
        for word in dict.fromkeys(re.findall(_WORD, s)):
            if len(word) >= 4 and len(re.findall(_whole_word(word), chunk, flags=re.IGNORECASE)) == 1:
                blanked = re.sub(_whole_word(word), BLANK, s, count=1)
                pairs.append((" ".join(blanked.split()), word))
    return pairs


def _unique_words(chunk: str) -> list[tuple[int, str]]:
    """``(character offset, word)`` of every word of 4+ characters that occurs once in the passage
    (any case, whole words), in passage order."""
    seen: dict[str, list[tuple[int, str]]] = {}
    for m in re.finditer(_WORD, chunk):
        seen.setdefault(m.group().lower(), []).append((m.start(), m.group()))
    return sorted(v[0] for v in seen.values() if len(v) == 1 and len(v[0][1]) >= 4)


def _first_pick(chunk: str, k: int) -> tuple[tuple[str, str], str] | None:
    """``((word a, word b), the earlier of them)``: two words that each occur once in the passage,
    at least a third of the passage apart; which is asked first follows ``k``, so the answer is the
    first word asked as often as the second."""
    words = _unique_words(chunk)
    gap = len(chunk) // 3
    rng = random.Random(k)
    early = [w for w in words if w[0] + gap < words[-1][0]] if words else []
    if not early:
        return None
    start, earlier = rng.choice(early)
    _, later = rng.choice([w for w in words if w[0] >= start + gap])
    pair = (earlier, later) if rng.random() < 0.5 else (later, earlier)
    return pair, earlier


def _lookalike_pick(chunk: str, k: int) -> tuple[str, tuple[str, str]] | None:
    """``(the passage with a look-alike planted, (cue, answer))`` for ``lookalike``: a copyable sentence
    with two words that each occur once in the passage (the key stays in the cue, the answer is
    blanked), its copy with both swapped for two other such words planted before a sentence at least
    a third of the passage's sentences away. None when no sentence or no place qualifies."""
    sentences = _sentences(chunk)
    unique = {w.lower() for _, w in _unique_words(chunk)}
    rng = random.Random(k)
    candidates = []
    for j, sentence in enumerate(sentences):
        own = [w for w in dict.fromkeys(re.findall(_WORD, sentence)) if w.lower() in unique]
        if _copyable(sentence) and len(own) >= 2:
            candidates.append((j, sentence, own))
    if not candidates:
        return None
    j, sentence, own = rng.choice(candidates)
    key, answer = rng.sample(own, 2)
    others = sorted(w for _, w in _unique_words(chunk) if not re.search(_whole_word(w), sentence, re.IGNORECASE))
    places = [i for i in range(len(sentences)) if abs(i - j) >= max(1, len(sentences) // 3)]
    if len(others) < 2 or not places:
        return None
    key2, answer2 = rng.sample(others, 2)
    twin = re.sub(_whole_word(key), lambda m: key2, sentence, count=1)
    twin = re.sub(_whole_word(answer), lambda m: answer2, twin, count=1)
    at = chunk.find(sentences[rng.choice(places)])
    planted = f"{chunk[:at]}{twin} {chunk[at:]}"
    cue = " ".join(re.sub(_whole_word(answer), BLANK, sentence, count=1).split())
    return planted, (cue, answer)


def _planted_pick(chunk: str, k: int, foreign: list[str]) -> tuple[str, tuple[str, str]] | None:
    """``(the passage with a sentence of another document planted in it, (cue, answer))`` for
    ``planted``: a copyable sentence of ``foreign`` (that document's sentences) with a word of 4+
    characters that occurs once in it and nowhere in the passage (any case, whole words), planted
    before a random sentence of the passage or after the last; the cue is that sentence with the
    word left out. None when no sentence of ``foreign`` qualifies."""
    sentences = _sentences(chunk)
    if not foreign or not sentences:
        return None
    rng = random.Random(k)
    for j in rng.sample(range(len(foreign)), len(foreign)):  # the first that qualifies, in a random order
        sentence = " ".join(foreign[j].split())
        if not _copyable(sentence):
            continue
        words = [w for w in dict.fromkeys(re.findall(_WORD, sentence)) if len(w) >= 4
                 and len(re.findall(_whole_word(w), sentence, flags=re.IGNORECASE)) == 1
                 and not re.search(_whole_word(w), chunk, flags=re.IGNORECASE)]
        if words:
            break
    else:
        return None
    answer = rng.choice(words)
    place = rng.randrange(len(sentences) + 1)
    if place == len(sentences):
        planted = f"{chunk.rstrip()} {sentence}"
    else:
        at = chunk.find(sentences[place])
        planted = f"{chunk[:at]}{sentence} {chunk[at:]}"
    return planted, (re.sub(_whole_word(answer), BLANK, sentence, count=1), answer)


def _copy_pick(chunk: str, k: int, task: str) -> tuple[str, str] | None:
    """``(cue, answer)`` of a copy task on one passage: ``recall`` cues a sentence by its first words,
    ``next`` quotes a whole sentence and answers with the one after it, ``fill`` quotes a sentence
    with a word left out and answers with the word, ``first`` names two words (the cue is the pair)
    and answers with the one the passage has first. A recall / next cue occurs once in the passage,
    a fill or first word too; the pick among those that qualify follows ``k`` (None when none qualify)."""
    if task == "first":
        return _first_pick(chunk, k)
    sentences = _sentences(chunk)
    if task == "fill":
        pairs = _fill_pairs(chunk, sentences)
        return pairs[random.Random(k).randrange(len(pairs))] if pairs else None
    pairs = []  # (cue, answer)
    for j, s in enumerate(sentences):
        if task == "recall" and _copyable(s):
            cue = " ".join(s.split()[:_CUE_WORDS])
            pairs.append((cue, s))
        elif task == "next" and j + 1 < len(sentences) and _copyable(s, hi=40) and _copyable(sentences[j + 1], lo=4):
            pairs.append((" ".join(s.split()), sentences[j + 1]))
    # the cue must point at one place: it occurs once in the passage (whitespace as in the request)
    flat = " ".join(chunk.split())
    pairs = [(cue, answer) for cue, answer in pairs if flat.count(cue) == 1]
    if not pairs:
        return None
    return pairs[random.Random(k).randrange(len(pairs))]


def _passages(text: str, passage_chars: int) -> list[str]:
    """Consecutive paragraphs gathered to about ``passage_chars`` characters (a short tail is kept
    when it has a quarter of that)."""
    paragraphs = [p.strip() for p in text.split("\n\n") if p.strip()]
    chunks, current = [], ""
    for p in paragraphs:
        current = f"{current}\n\n{p}" if current else p
        if len(current) >= passage_chars:
            chunks.append(current)
            current = ""
    if len(current) >= passage_chars // 4:
        chunks.append(current)
    return chunks


def _check_tasks(tasks: tuple[str, ...]) -> None:
    unknown = [t for t in tasks if t not in CHAT_TASKS]
    if unknown or not tasks:
        raise ValueError(f"tasks={list(tasks)}: allowed values are {', '.join(CHAT_TASKS)} (at least one)")


def _task_picks(text: str, passage_chars: int, start: int, tasks: tuple[str, ...], foreign: str | None = None):
    """``(k, task, passage, pick)`` per passage: the task in turn from ``tasks[start % len]``, and
    for a copy task its ``(cue, answer)``; a passage no copy task fits becomes ``continue``.
    ``foreign``: another document, whose sentences ``planted`` plants (None: ``planted`` never fits)."""
    _check_tasks(tasks)
    foreign_sentences = _sentences(foreign) if foreign and "planted" in tasks else []
    for i, chunk in enumerate(_passages(text, passage_chars)):
        k = start + i
        task = tasks[k % len(tasks)]
        if task in ("lookalike", "planted"):  # the tasks that change the passage: a sentence planted in it
            planted = _lookalike_pick(chunk, k) if task == "lookalike" else _planted_pick(chunk, k, foreign_sentences)
            chunk, pick = planted if planted else (chunk, None)
        else:
            pick = _copy_pick(chunk, k, task) if task != "continue" else None
        yield k, (task if pick else "continue"), chunk, pick


def passages_to_chat(text: str, passage_chars: int, start: int = 0,
                     tasks: tuple[str, ...] = ("continue",), foreign: str | None = None) -> list[list[dict]]:
    """Chat exchanges cut from one document: consecutive paragraphs gathered to about
    ``passage_chars`` characters, each turned into one exchange of the task ``tasks[(start + i) %
    len(tasks)]`` (:data:`CHAT_TASKS`):

    - ``continue``: the first half (by paragraphs, else by characters at a space) goes in a user
      turn after a request to continue it, the rest is the assistant's answer;
    - ``recall``: the whole passage, then a request for the sentence that begins with a quoted
      cue (its first words); the answer is that sentence, copied from the passage;
    - ``next``: the whole passage, then a request for the sentence after a quoted one;
    - ``fill``: the whole passage, then one of its sentences with a word left out (:data:`BLANK`),
      asking for the word;
    - ``first``: the whole passage, then two of its words (each once in it, a third of it apart),
      asking which comes first; the answer is that word;
    - ``lookalike``: the passage with a copy of one of its sentences planted a third of it away, two
      words of the copy swapped for others of the passage; then the original with one of those two
      words left out, asking for it (the look-alike holds a wrong answer);
    - ``planted``: the passage with a sentence of the document ``foreign`` planted at a random place,
      then that sentence with a word the passage never has left out, asking for it.

    A passage with no sentence that fits a copy task becomes a ``continue`` exchange. Requests
    rotate and picks follow from ``start`` and the position, so the output is deterministic."""
    exchanges = []
    for k, task, chunk, pick in _task_picks(text, passage_chars, start, tasks, foreign):
        if task == "continue":
            exchange = _continue_exchange(chunk, k)
        else:
            prompts = PROMPTS[task]
            request = _request(prompts[k % len(prompts)], pick[0])
            exchange = [{"role": "user", "content": f"{chunk.strip()}\n\n{request}"},
                        {"role": "assistant", "content": pick[1]}]
        if exchange:
            exchanges.append(exchange)
    return exchanges


def passages_to_completions(text: str, passage_chars: int, start: int = 0,
                            tasks: tuple[str, ...] = ("continue",), foreign: str | None = None) -> list[str]:
    """The copy tasks for a base model (no chat template): the same passages and picks as
    :func:`passages_to_chat`, as plain-text documents. ``continue``: the passage as it is;
    ``recall`` / ``next``: the passage, a blank line, a lead-in quoting the cue
    (:data:`RECALL_LEADS` / :data:`NEXT_LEADS`) and the sentence asked for, so the loss on the
    answer's tokens is a loss on copying from the prompt."""
    return [document for document, _ in _completion_documents(text, passage_chars, start, tasks, foreign)]


def _completion_documents(text: str, passage_chars: int, start: int, tasks: tuple[str, ...], foreign: str | None = None):
    """:func:`passages_to_completions`' documents, each with the character offset where its answer
    (the sentence asked for) starts; None for a passage as it is."""
    for k, task, chunk, pick in _task_picks(text, passage_chars, start, tasks, foreign):
        if task == "continue":
            yield chunk, None
        else:
            leads = LEADS[task]
            document = f"{chunk.strip()}\n\n{_request(leads[k % len(leads)], pick[0])}{pick[1]}"
            yield document, len(document) - len(pick[1])


def _foreign_documents(texts: list[str]) -> list[str | None]:
    """For each document of a batch, the one half a batch away (another document, for ``planted``)."""
    n = len(texts)
    return [texts[(j + n // 2) % n] if n > 1 else None for j in range(n)]


def _to_chat(passage_chars: int, tasks: tuple[str, ...]):
    def convert(batch: dict, indices: list[int]) -> dict:
        return {"messages": [m for i, text, other in zip(indices, batch["text"], _foreign_documents(batch["text"]))
                             for m in passages_to_chat(text, passage_chars, i, tasks, other)]}

    return convert


def _to_completions(passage_chars: int, tasks: tuple[str, ...], answers: bool = False):
    def convert(batch: dict, indices: list[int]) -> dict:
        docs = [d for i, text, other in zip(indices, batch["text"], _foreign_documents(batch["text"]))
                for d in _completion_documents(text, passage_chars, i, tasks, other)]
        out = {"text": [d for d, _ in docs]}
        if answers:
            out["answer_from"] = [-1 if a is None else a for _, a in docs]
        return out

    return convert


def _answer_from(rendered: str, messages: list[dict]) -> int:
    """Character offset in a rendered chat record where its last assistant turn's content starts
    (-1: the record does not end with one). The content's last occurrence: a copy task's answer
    is also in the passage before it."""
    content = (messages[-1].get("content") or "").strip() if messages else ""
    if not content or messages[-1].get("role") != "assistant":
        return -1
    return rendered.rfind(content)  # stripped: templates may trim a turn's content


def _renderer(tokenizer, answers: bool = False):
    """Records -> ``input_ids`` (EOS appended); with ``answers`` also ``answer_mask``: 1 on the
    tokens of the answer (a chat record's last assistant turn from its content on, end-of-turn
    tokens and EOS included, so stopping is part of it; a copy-task document's sentence), 0 elsewhere."""
    def render(batch: dict) -> dict:
        if "input_ids" in batch:
            out = {"input_ids": batch["input_ids"]}
            if answers:
                out["answer_mask"] = [[0] * len(x) for x in batch["input_ids"]]
            return out
        starts = None
        if "messages" in batch:
            if not getattr(tokenizer, "chat_template", None):
                texts = ["\n\n".join(f"{m['role']}: {m['content']}" for m in msgs) for msgs in batch["messages"]]
            else:
                texts = [tokenizer.apply_chat_template(msgs, tokenize=False) for msgs in batch["messages"]]
            if answers:
                starts = [_answer_from(t, msgs) for t, msgs in zip(texts, batch["messages"])]
        else:
            texts = batch["text"]
            if answers:
                starts = batch.get("answer_from", [-1] * len(texts))
        enc = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=answers)
        eos = tokenizer.eos_token_id
        tail = [eos] if eos is not None else []
        out = {"input_ids": [x + tail for x in enc["input_ids"]]}
        if answers:
            out["answer_mask"] = [[int(start >= 0 and a >= start) for a, _ in offsets] + [int(start >= 0)] * len(tail)
                                  for offsets, start in zip(enc["offset_mapping"], starts)]
        return out

    return render


def _packer(seq_len: int):
    def pack(batch: dict) -> dict:
        out = {}
        for column in batch:
            stream = [t for ids in batch[column] for t in ids]
            out[column] = [stream[i * seq_len:(i + 1) * seq_len] for i in range(len(stream) // seq_len)]
        return out

    return pack


def chat_format(spec: DataSpec, tokenizer) -> bool:
    """Whether plain text becomes chat exchanges (``format: chat``, or ``auto`` with a chat template)."""
    if spec.format == "auto":
        return bool(getattr(tokenizer, "chat_template", None))
    return spec.format == "chat"


def training_blocks(spec: DataSpec, tokenizer, answers: bool = False, *, teacher=None,
                    tokens_needed: int | None = None, log=print) -> datasets.Dataset:
    """``[N]`` records with ``input_ids`` of exactly ``spec.seq_len`` tokens: documents in order,
    each followed by EOS, concatenated and cut (the last partial block of each 1,000 documents is
    dropped). Several ``spec.text`` entries are mixed: their blocks taken in turn, one of each, until
    every one is used up (none repeated). At most ``spec.num_tokens`` tokens (whole blocks, the first
    of that order, so a mix comes in equal parts). With ``answers`` the records also have
    ``answer_mask`` (``[seq_len]``, 1 on answer tokens, see :func:`_renderer`); data with no answer
    tokens at all is refused (a weight on answers would do nothing). With ``spec.answers ==
    "teacher"``, ``teacher`` (a model sharing ``tokenizer``) writes the answers of the exchanges the
    run will read: about ``tokens_needed`` tokens (None: all of them; :mod:`.teacher_answers`)."""
    if answers and not getattr(tokenizer, "is_fast", False):
        raise RecipeError("loss.answer_weight needs a fast tokenizer (token offsets); "
                          f"{type(tokenizer).__name__} is not one: use loss.answer_weight: 1.0")
    if spec.answers == "teacher":
        if teacher is None:
            raise ValueError("data.answers=teacher: training_blocks needs the teacher model")
        if not chat_format(spec, tokenizer) or not getattr(tokenizer, "chat_template", None):
            raise RecipeError("data.answers=teacher writes the assistant turns of chat exchanges; this student's "
                              "tokenizer has no chat template (data.format resolves to text, or there is no template "
                              "to render the teacher's prompts with); use data.answers: passage")
    caps = [n for n in (spec.num_tokens, tokens_needed) if n is not None]
    per_part = -(-min(caps) // len(spec.text)) + spec.seq_len if caps else None  # the mix takes parts in turn
    parts = [_blocks_of(text, spec, tokenizer, answers, teacher=teacher, tokens_needed=per_part, log=log)
             for text in spec.text]
    if answers and not any(any(m) for part in parts for m in part["answer_mask"]):
        raise RecipeError(f"loss.answer_weight: data.text={list(spec.text)} has no answer tokens (plain text with "
                          "data.tasks [continue] in the text format); use chat exchanges, chat records or copy "
                          "tasks (data.tasks: recall, next), or loss.answer_weight: 1.0")
    ds = parts[0] if len(parts) == 1 else datasets.interleave_datasets(
        parts, stopping_strategy="all_exhausted_without_replacement")
    if spec.num_tokens is not None:
        ds = ds.select(range(min(len(ds), max(1, spec.num_tokens // spec.seq_len))))
    return ds.with_format("torch")


def _blocks_of(text: str, spec: DataSpec, tokenizer, answers: bool = False, *, teacher=None,
               tokens_needed: int | None = None, log=print) -> datasets.Dataset:
    """The packed blocks of one ``data.text`` entry."""
    ds = load_records(text)
    if spec.answers == "teacher" and "messages" not in ds.column_names and "text" not in ds.column_names:
        raise RecipeError(f"data.answers=teacher: data.text entry {text!r} holds token ids, with no turns to "
                          "answer; use text, chat records, or data.answers: passage")
    copy_tasks = [t for t in spec.tasks if t != "continue"]
    if copy_tasks and "text" not in ds.column_names:
        raise RecipeError(f"data.tasks={list(spec.tasks)}: the tasks {copy_tasks} are built from plain text, but "
                          f"data.text entry {text!r} holds {'chat records' if 'messages' in ds.column_names else 'token ids'}; "
                          "use a text corpus, file or folder, or data.tasks: [continue]")
    if "text" in ds.column_names and chat_format(spec, tokenizer):
        ds = ds.map(_to_chat(spec.passage_chars, tuple(spec.tasks)), batched=True, with_indices=True,
                    remove_columns=ds.column_names, desc="chat exchanges")
    elif copy_tasks:
        ds = ds.map(_to_completions(spec.passage_chars, tuple(spec.tasks), answers), batched=True, with_indices=True,
                    remove_columns=ds.column_names, desc="copy-task documents")
    if spec.answers == "teacher":
        ds = with_teacher_answers(ds, teacher, tokenizer, max_new_tokens=spec.answer_tokens,
                                  tokens_needed=tokens_needed, log=log)
    ds = ds.map(_renderer(tokenizer, answers), batched=True, remove_columns=ds.column_names, desc="tokenising")
    ds = ds.map(_packer(spec.seq_len), batched=True, batch_size=1000, desc=f"packing into {spec.seq_len}-token blocks")
    if len(ds) == 0:
        raise RecipeError(f"data.text entry {text!r} has fewer than data.seq_len={spec.seq_len} tokens")
    return ds


def write_chat_jsonl(records: list[list[dict]], path: str | Path) -> Path:
    """Chat records (lists of ``{"role", "content"}``) as JSONL, the format ``data.text`` reads."""
    path = Path(path)
    with path.open("w") as f:
        for msgs in records:
            f.write(json.dumps({"messages": msgs}, ensure_ascii=False) + "\n")
    return path


__all__ = ["BLANK", "CHAT_TASKS", "CONTINUE_PROMPTS", "FILL_LEADS", "FILL_PROMPTS", "FIRST_LEADS", "FIRST_PROMPTS", "LOOKALIKE_LEADS",
           "LOOKALIKE_PROMPTS", "LEADS", "NEXT_LEADS", "NEXT_PROMPTS", "PLANTED_LEADS", "PLANTED_PROMPTS",
           "PROMPTS", "RECALL_LEADS", "RECALL_PROMPTS",
           "chat_format", "load_records", "passages_to_chat", "passages_to_completions", "training_blocks", "write_chat_jsonl"]
