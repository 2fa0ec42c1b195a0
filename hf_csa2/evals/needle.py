"""Needle/distractor long-context tasks that score memory capabilities separately (seed 002 §5).

"Reads long" and "remembers precisely" are different abilities; one score hides which one a
conversion broke. Every sample is a maintenance log (real text from the haystack corpus with
synthetic device records inserted at sentence boundaries) and one question:

* ``local``       -- one record in the last 10% of the context (depth d maps to 0.9 + 0.1 d);
* ``far``         -- one unique record at depth d;
* ``distractor``  -- the record at depth d plus look-alike records (sibling devices, other codes);
* ``composition`` -- a replacement record at depth d and, far from it, the new part's spec;
                     the answer needs both (what firmware runs in the replacement?);
* ``order``       -- two alarm events; which came first;
* ``repeated``    -- the ``far`` record repeated several times from depth d on (easier control).

Two prompt styles ask the same records. ``chat`` (instruct models): an instruction, the log, then
the question, wrapped in the model's chat template. ``completion`` (base models, which answer a
continuation far better than a question): the log, then the start of a statement whose
continuation is the answer ("Maintenance record: the controller installed in boiler Orchid-42 is
model"); no chat template, and only the continuation's first sentence is scored.

Lengths are tokenizer-true: the prompt (user message, before any chat template) is filled with
haystack sentences up to the target token count. Everything is derived from
``seed`` so the same arguments give the same samples, byte for byte.

Scoring (:func:`score_output`) normalises case and whitespace only: an output is correct when
it contains the answer and none of the sample's wrong options (distractor values, the other
alarm), so listing every candidate is not rewarded.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import InputError

CATEGORIES = ("local", "far", "distractor", "composition", "order", "repeated")
PROMPT_STYLES = ("chat", "completion")
DEFAULT_LENGTHS = (1024, 2048, 4096)
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)

_SITES = ("Orchid", "Granite", "Harbor", "Juniper", "Falcon", "Meadow", "Cobalt", "Willow", "Summit", "Ember",
          "Lantern", "Quarry", "Beacon", "Tundra", "Saffron", "Pioneer")
_DEVICES = ("pump station", "boiler", "chiller", "compressor", "generator", "turbine", "conveyor", "furnace")
_ALARMS = ("pressure", "temperature", "smoke", "flood", "power", "vibration", "door", "oxygen", "coolant", "fan")
_LETTERS = "ABCDEFGHJKLMNPRSTUVWXYZ"

INSTRUCTION = ("Below is a maintenance log mixed with unrelated documentation. "
               "Read it and answer the question that follows it.")
ANSWER_HINT = "Reply with the answer only, no sentence.\nAnswer:"
COMPLETION_HEADER = "Maintenance log mixed with unrelated documentation."


@dataclass
class NeedleSample:
    """One prompt and its expected answer.

    ``context`` is the user message (document + question); ``length`` its token count with the
    generating tokenizer; ``depths`` the relative positions (0..1) where records were inserted.
    ``wrong`` lists answers that make an output incorrect even if it also contains ``answer``.
    ``style`` is the prompt style (``PROMPT_STYLES``): a ``completion`` context ends with the
    start of the statement the answer completes and is fed without a chat template.
    """

    id: str
    category: str
    target_length: int
    depth: float
    context: str
    question: str
    answer: str
    wrong: list[str] = field(default_factory=list)
    length: int = 0
    depths: list[float] = field(default_factory=list)
    style: str = "chat"


def normalise(text: str) -> str:
    """Lower-case and collapse whitespace; nothing else (no punctuation stripping)."""
    return " ".join(text.lower().split())


_FIRST_SENTENCE = re.compile(r"(?<=[.!?])\s|\n")


def score_output(sample: NeedleSample, output: str) -> bool:
    """True when ``output`` contains the answer and none of the wrong options. A completion is
    judged on its first sentence only: a base model keeps writing log lines after the answer,
    and a later line naming a look-alike record is not an answer to this one."""
    if sample.style == "completion":
        output = _FIRST_SENTENCE.split(output.lstrip(), maxsplit=1)[0]
    out = normalise(output)
    return normalise(sample.answer) in out and not any(normalise(w) in out for w in sample.wrong)


# -- haystack ------------------------------------------------------------------------------

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9`*\"'(])")


def haystack_sentences(text: str) -> list[str]:
    """Split real text into sentence-like pieces (whitespace collapsed, markup kept)."""
    text = re.sub(r"\s+", " ", text)
    return [s.strip() for s in _SENTENCE_END.split(text) if len(s.strip()) > 1]


def _code(rng: random.Random) -> str:
    return f"{rng.choice(_LETTERS)}{rng.choice(_LETTERS)}-{rng.randint(1000, 9999)}"


def _records(category: str, rng: random.Random, depth: float, distractors: int, repeats: int):
    """(records [(relative position, sentence)], question, completion cue, answer, wrong options)."""
    site = rng.choice(_SITES)
    device_kind = rng.choice(_DEVICES)
    number = rng.randint(10, 99)
    device = f"{device_kind} {site}-{number}"
    code = _code(rng)
    record = f"Maintenance record: the controller installed in {device} is model {code}."
    question = f"What is the model of the controller installed in {device}?"
    cue = f"Maintenance record: the controller installed in {device} is model"
    if category in ("far", "local"):
        pos = 0.9 + 0.1 * depth if category == "local" else depth
        return [(pos, record)], question, cue, code, []
    if category == "repeated":
        span = max(1e-6, 1.0 - depth)
        return [(depth + span * i / repeats, record) for i in range(repeats)], question, cue, code, []
    if category == "distractor":
        others = rng.sample([n for n in range(10, 100) if n != number], distractors)
        wrong, recs = [], [(depth, record)]
        for n in others:
            other_code = _code(rng)
            while other_code == code or other_code in wrong:
                other_code = _code(rng)
            wrong.append(other_code)
            recs.append((rng.random(), f"Maintenance record: the controller installed in {device_kind} {site}-{n} "
                                       f"is model {other_code}."))
        return recs, question, cue, code, wrong
    if category == "composition":
        new_code = _code(rng)
        firmware = f"{rng.randint(2, 9)}.{rng.randint(0, 9)}.{rng.randint(0, 9)}"
        # the spec sits at least half the context away from the replacement record
        spec_pos = depth + 0.5 if depth < 0.5 else depth - 0.5
        recs = [(depth, f"Maintenance record: in {device}, controller model {code} was replaced by controller "
                        f"model {new_code}."),
                (spec_pos, f"Specification sheet: controller model {new_code} runs firmware version {firmware}.")]
        return (recs, f"Which firmware version runs on the replacement controller in {device}?",
                f"Specification sheet: the replacement controller in {device} runs firmware version", firmware, [])
    if category == "order":
        first, second = rng.sample(_ALARMS, 2)
        later = depth + (1.0 - depth) * rng.uniform(0.3, 1.0) if depth < 0.7 else depth
        earlier = depth if depth < 0.7 else depth * rng.uniform(0.0, 0.7)
        recs = [(earlier, f"Event log: the {first} alarm was triggered in {device}."),
                (later, f"Event log: the {second} alarm was triggered in {device}.")]
        a, b = (first, second) if rng.random() < 0.5 else (second, first)
        q = f"In {device}, which alarm was triggered first: the {a} alarm or the {b} alarm?"
        cue = f"Event log: of the {a} alarm and the {b} alarm in {device}, the first to be triggered was the"
        return recs, q, cue, first, [second]
    raise ValueError(f"category={category!r}; allowed: {', '.join(CATEGORIES)}")


def _assemble(sentences: list[str], records: list[tuple[float, str]], question: str, cue: str,
              style: str) -> tuple[str, list[float]]:
    """Insert each record before the sentence at its relative position; return the prompt in
    ``style`` + the records' depths."""
    slots: dict[int, list[str]] = {}
    depths = []
    for pos, rec in sorted(records):
        idx = min(len(sentences), max(0, round(pos * len(sentences))))
        slots.setdefault(idx, []).append(rec)
        depths.append(idx / max(1, len(sentences)))
    parts = []
    for i in range(len(sentences) + 1):
        parts.extend(slots.get(i, []))
        if i < len(sentences):
            parts.append(sentences[i])
    doc = " ".join(parts)
    if style == "completion":
        return f"{COMPLETION_HEADER}\n\n{doc}\n\n{cue}", depths
    return f"{INSTRUCTION}\n\n<log>\n{doc}\n</log>\n\nQuestion: {question}\n{ANSWER_HINT}", depths


def make_sample(tokenizer, sentences: list[str], category: str, target_length: int, depth: float, seed: int,
                index: int, distractors: int = 4, repeats: int = 8, style: str = "chat") -> NeedleSample:
    """Build one sample whose context is at most ``target_length`` tokens (tokenizer-true). Both
    styles draw the same records, haystack and answer from the seed."""
    rng = random.Random(f"{seed}|{category}|{target_length}|{depth}|{index}")
    records, question, cue, answer, wrong = _records(category, rng, depth, distractors, repeats)
    start = rng.randrange(len(sentences))
    rotated = sentences[start:] + sentences[:start]

    def count(n):
        text, _ = _assemble(rotated[:n], records, question, cue, style)
        return len(tokenizer(text, add_special_tokens=False).input_ids)

    if count(0) > target_length:
        raise InputError(f"target_length={target_length} tokens cannot hold the {category} records and question "
                         f"({count(0)} tokens without any haystack); use a longer length")
    # Largest sentence count whose prompt fits: geometric probe then binary search.
    lo, hi = 0, 1
    while hi <= len(rotated) and count(hi) <= target_length:
        lo, hi = hi, hi * 2
    hi = min(hi, len(rotated) + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if count(mid) <= target_length else (lo, mid)
    context, depths = _assemble(rotated[:lo], records, question, cue, style)
    return NeedleSample(
        id=f"{category}-{target_length}-{depth:g}-{index}", category=category, target_length=target_length,
        depth=depth, context=context, question=question, answer=answer, wrong=wrong,
        length=len(tokenizer(context, add_special_tokens=False).input_ids), depths=depths, style=style,
    )


def generate_samples(tokenizer, haystack_text: str, *, categories=CATEGORIES, lengths=DEFAULT_LENGTHS,
                     depths=DEFAULT_DEPTHS, per_cell: int = 4, seed: int = 0, distractors: int = 4,
                     repeats: int = 8, style: str = "chat") -> list[NeedleSample]:
    """All samples for categories x lengths x depths, ``per_cell`` each (deterministic), in
    prompt ``style`` (``chat`` or ``completion``; :func:`prompt_style` picks one for a model)."""
    if style not in PROMPT_STYLES:
        raise InputError(f"prompt style {style!r}; allowed: {', '.join(PROMPT_STYLES)}")
    for c in categories:
        if c not in CATEGORIES:
            raise InputError(f"category={c!r}; allowed: {', '.join(CATEGORIES)}")
    sentences = haystack_sentences(haystack_text)
    if len(sentences) < 50:
        raise InputError(f"haystack has only {len(sentences)} sentences; pass a longer text")
    return [
        make_sample(tokenizer, sentences, c, n, d, seed, i, distractors, repeats, style)
        for c in categories for n in lengths for d in depths for i in range(per_cell)
    ]


def prompt_style(tokenizer, requested: str = "auto", instruct: bool = True) -> str:
    """``chat`` for an instruction-tuned model (``instruct``; e.g.
    :func:`hf_csa2.io.sources.instruction_tuned`) whose tokenizer has a chat template, else
    ``completion`` (a base model); ``requested`` other than ``auto`` wins."""
    allowed = ("auto",) + PROMPT_STYLES
    if requested not in allowed:
        raise InputError(f"prompt style {requested!r}; allowed: {', '.join(allowed)}")
    if requested != "auto":
        return requested
    return "chat" if instruct and getattr(tokenizer, "chat_template", None) else "completion"


def write_jsonl(samples: list[NeedleSample], path: str | Path) -> Path:
    """One JSON object per line (the format lm-eval task YAMLs read with ``dataset_path: json``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for s in samples:
            f.write(json.dumps(asdict(s), ensure_ascii=False) + "\n")
    return path


def read_jsonl(path: str | Path) -> list[NeedleSample]:
    return [NeedleSample(**json.loads(line)) for line in Path(path).read_text().splitlines() if line.strip()]


__all__ = [
    "CATEGORIES", "NeedleSample", "PROMPT_STYLES", "generate_samples", "haystack_sentences", "make_sample",
    "normalise", "prompt_style", "read_jsonl", "score_output", "write_jsonl",
]
