"""A short in-context retrieval probe: a fact planted in real text, asked back at the end.

Perplexity can stay close to the source's while a conversion loses the skill of copying from
its prompt. This probe asks for that skill directly and cheaply, so every conversion stage can
report it: each probe is a window of real text with one sentence such as

    The lucky charm of Ingrid Marlow is a copper heron.

inserted far back (``far``: 5 % into the window) or just before the end (``near``: the last
~10 %), and the window ends with the cue ``The lucky charm of Ingrid Marlow is a`` whose
continuation is the answer ``copper heron``. A probe is answered when the model's greedy
prediction is right at every answer token (teacher-forced: exactly what greedy decoding would
print), so one forward pass scores it. The templates are our own (no overlap with the needle
suite's maintenance logs), and every choice follows from ``seed``.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

import torch

from .perplexity import head_log_probs

_FIRST = ("Ingrid", "Tomas", "Amara", "Felix", "Yusuf", "Leona", "Mateo", "Priya", "Oskar", "Hana", "Dmitri",
          "Nadia", "Ruben", "Selma", "Kofi", "Elise")
_LAST = ("Marlow", "Okafor", "Lindqvist", "Moreau", "Castell", "Brennan", "Takeda", "Halloran", "Vance", "Duarte",
         "Sorensen", "Whitlock", "Abara", "Kessler", "Ferro", "Quayle")
_THINGS = ("lucky charm", "favourite tool", "travel souvenir", "garden statue", "desk ornament", "childhood toy")
_COLOURS = ("copper", "violet", "silver", "scarlet", "amber", "ivory", "olive", "cobalt")
_ANIMALS = ("heron", "badger", "otter", "falcon", "walrus", "lynx", "beetle", "salmon", "tortoise", "raven")

DEPTHS = {"far": 0.05, "near": 0.9}


@dataclass
class Probe:
    ids: torch.Tensor  # [T] the whole window, answer included
    answer_start: int  # index of the first answer token in ``ids``
    answer_len: int
    depth: str  # "far" or "near"


@dataclass
class AnswerCheck:
    """How many probes were answered, per depth, and the mean NLL of the answer tokens (nats)."""

    far: int
    near: int
    per_depth: int
    answer_nll: float
    context: int

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        return f"far {self.far}/{self.per_depth}, near {self.near}/{self.per_depth}"


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _bos(tokenizer) -> list[int]:
    """The BOS id when the tokenizer adds one by itself (Gemma needs it), else nothing."""
    with_special = tokenizer("a")["input_ids"]
    bos = tokenizer.bos_token_id
    return [bos] if bos is not None and with_special and with_special[0] == bos else []


def make_probes(tokenizer, filler: torch.Tensor, per_depth: int, seed: int = 0, distractors: int = 0) -> list[Probe]:
    """``per_depth`` far and ``per_depth`` near probes, each exactly ``T`` tokens long.

    Args:
        tokenizer: the model's tokenizer.
        filler: LongTensor ``[M, T]`` of real text (e.g. the stage report's scoring windows);
            probe ``i`` is cut from window ``i % M``.
        per_depth: probes per depth.
        distractors: lookalike facts planted in each probe besides the asked one: the same thing
            of other people (each sharing the asked person's first or last name), with other
            answers, spread evenly between 20 % and 80 % of the window. The answer then needs
            the asked record told apart from its neighbours, not only found. The asked facts are
            those drawn without distractors (their own random stream), so both can be compared.
    """
    if distractors < 0:
        raise ValueError(f"distractors={distractors}; allowed: an integer >= 0")
    rng = random.Random(seed)
    m, t = filler.shape
    bos = _bos(tokenizer)
    pairs = [(f, l) for f in _FIRST for l in _LAST]
    people = rng.sample(pairs, 2 * per_depth) if 2 * per_depth <= len(pairs) else [rng.choice(pairs) for _ in range(2 * per_depth)]
    probes = []
    for i, (first, last) in enumerate(people):
        depth = "far" if i % 2 == 0 else "near"
        thing = rng.choice(_THINGS)
        colour, animal = rng.choice(_COLOURS), rng.choice(_ANIMALS)
        fact = _encode(tokenizer, f" The {thing} of {first} {last} is a {colour} {animal}. ")
        cue = _encode(tokenizer, f"\n\nThe {thing} of {first} {last} is a")
        answer = _encode(tokenizer, f" {colour} {animal}")
        lookalikes = [_encode(tokenizer, f" The {thing} of {other} is a {c} {a}. ")
                      for other, c, a in _lookalikes(random.Random(f"{seed}/{i}"), first, last, colour, animal, distractors)]
        room = t - len(bos) - len(fact) - len(cue) - len(answer) - sum(map(len, lookalikes))
        if room < 8:
            raise ValueError(f"windows of {t} tokens are too short for the answer check (need >= "
                             f"{t - room + 8} tokens); use longer windows")
        text = filler[i // 2 % m, :room].tolist()
        planted = sorted([(int(DEPTHS[depth] * room), fact)] +
                         [(int((0.2 + 0.6 * (j + 0.5) / len(lookalikes)) * room), f) for j, f in enumerate(lookalikes)],
                         key=lambda x: x[0])
        ids, cut = list(bos), 0
        for at, sentence in planted:
            ids += text[cut:at] + sentence
            cut = at
        ids += text[cut:] + cue + answer
        probes.append(Probe(torch.tensor(ids), answer_start=len(ids) - len(answer), answer_len=len(answer), depth=depth))
    return probes


def _lookalikes(rng: random.Random, first: str, last: str, colour: str, animal: str, n: int) -> list[tuple[str, str, str]]:
    """``n`` (other person, colour, animal): alternately the same first name with another last
    name and the same last name with another first; no answer repeats the asked one."""
    people = [f"{first} {l}" for l in rng.sample([l for l in _LAST if l != last], len(_LAST) - 1)]
    others = [f"{f} {last}" for f in rng.sample([f for f in _FIRST if f != first], len(_FIRST) - 1)]
    answers = [(c, a) for c in _COLOURS for a in _ANIMALS if c != colour and a != animal]
    chosen = rng.sample(answers, n) if n <= len(answers) else [rng.choice(answers) for _ in range(n)]
    return [((people if j % 2 == 0 else others)[j // 2 % len(people)], *chosen[j]) for j in range(n)]


@torch.no_grad()
def answer_check(model, probes: list[Probe], batch_size: int = 4) -> AnswerCheck:
    """Score ``probes`` (from :func:`make_probes`) with ``model``: teacher-forced greedy exact match
    of every answer token. Runs in eval mode without a cache; the model's mode is restored."""
    was_training = model.training
    model.eval()
    hits = {"far": 0, "near": 0}
    nll, count = 0.0, 0
    device = next(model.parameters()).device
    try:
        for start in range(0, len(probes), batch_size):
            chunk = probes[start : start + batch_size]
            ids = torch.stack([p.ids for p in chunk]).to(device)
            hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
            for row, p in zip(range(len(chunk)), chunk):
                # the prediction of token j is made at position j - 1
                at = torch.arange(p.answer_start - 1, p.answer_start - 1 + p.answer_len, device=device)
                lp = head_log_probs(model, hidden[row, at])  # [answer_len, vocab]
                target = ids[row, at + 1]
                hits[p.depth] += bool((lp.argmax(-1) == target).all())
                nll -= float(lp.gather(-1, target[:, None]).sum())
                count += p.answer_len
    finally:
        model.train(was_training)
    per_depth = sum(p.depth == "far" for p in probes)
    return AnswerCheck(far=hits["far"], near=hits["near"], per_depth=per_depth, answer_nll=nll / max(count, 1),
                       context=int(probes[0].ids.shape[0]) if probes else 0)


__all__ = ["AnswerCheck", "Probe", "answer_check", "make_probes"]
