"""The answer check: probes are built where they say, scored by exact greedy match, and tell a
model that reads its whole prompt from one that only reads a local window."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from hf_csa2.metrics.answer_check import DEPTHS, answer_check, make_probes
from tests.tiny_models import tiny_tokenizer


def filler(tokenizer, n=2, t=400):
    text = "Plain filler sentences about rivers, bread and weather fill the page. " * 40
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][: n * t]
    return torch.tensor(ids).view(n, t)


def test_probes_have_the_window_length_and_end_with_their_answer():
    tok = tiny_tokenizer()
    probes = make_probes(tok, filler(tok), per_depth=3, seed=1)
    assert [p.depth for p in probes] == ["far", "near"] * 3
    for p in probes:
        assert p.ids.shape == (400,)
        text = tok.decode(p.ids)
        cue, answer = text.rsplit("\n\n", 1)[1], tok.decode(p.ids[p.answer_start:])
        assert answer.startswith(" ") and len(answer.split()) == 2
        subject = cue[: -len(answer)]  # "The <thing> of <first> <last> is a"
        fact = f" {subject}{answer}. "
        fact_at = text.index(fact)
        room = len(text) - len(fact) - len("\n\n" + cue)  # the filler's share (a character tokenizer)
        assert abs(fact_at - int(DEPTHS[p.depth] * room)) <= 1, (p.depth, fact_at, room)
    assert [p.ids.tolist() for p in make_probes(tok, filler(tok), 3, seed=1)] == [p.ids.tolist() for p in probes]
    assert [p.ids.tolist() for p in make_probes(tok, filler(tok), 3, seed=2)] != [p.ids.tolist() for p in probes]


def test_windows_too_short_for_a_probe_are_refused():
    tok = tiny_tokenizer()
    with pytest.raises(ValueError, match="too short"):
        make_probes(tok, filler(tok, t=60), per_depth=1)


class Shifted(nn.Module):
    """A decoder whose final hidden state at position t is the one-hot of token t + shift."""

    def __init__(self, vocab: int, shift: int):
        super().__init__()
        self.shift, self.vocab = shift, vocab

    def forward(self, input_ids, use_cache=False):
        ahead = torch.roll(input_ids, -self.shift, dims=1)
        return SimpleNamespace(last_hidden_state=30.0 * nn.functional.one_hot(ahead, self.vocab).float())


class Oracle(nn.Module):
    """A causal LM predicting the token ``shift`` places ahead: shift=1 is always right."""

    def __init__(self, vocab: int, shift: int):
        super().__init__()
        self.model = Shifted(vocab, shift)
        self.lm_head = nn.Linear(vocab, vocab, bias=False)
        nn.init.eye_(self.lm_head.weight)
        self.config = SimpleNamespace(final_logit_softcapping=None)


def test_scoring_reads_the_predictions_of_exactly_the_answer_tokens():
    tok = tiny_tokenizer()
    probes = make_probes(tok, filler(tok), per_depth=4)
    right = answer_check(Oracle(len(tok), shift=1), probes)
    assert (right.far, right.near, right.per_depth) == (4, 4, 4) and right.answer_nll < 1e-3
    wrong = answer_check(Oracle(len(tok), shift=2), probes)  # off by one position
    assert (wrong.far, wrong.near) == (0, 0) and wrong.answer_nll > 1.0


@pytest.mark.real
@pytest.mark.slow
def test_a_local_window_loses_the_far_facts_and_keeps_the_near_ones(smollm2):
    """SmolLM2 answers facts from anywhere in 512 tokens; the same weights with a 128-token
    sliding window (Mistral shares Llama's weight names) lose the far ones only."""
    from transformers import MistralConfig, MistralForCausalLM

    from hf_csa2.data.corpus import CorpusError
    from hf_csa2.data.windows import token_windows

    try:
        windows = token_windows(smollm2.tokenizer, "python-docs:heldout", 512, 3)
    except CorpusError as err:
        pytest.skip(f"real text unavailable: {err}")
    probes = make_probes(smollm2.tokenizer, windows, per_depth=6)
    config = MistralConfig(**{k: v for k, v in smollm2.model.config.to_dict().items() if k != "model_type"},
                           sliding_window=128)
    config._attn_implementation = "sdpa"
    local = MistralForCausalLM(config).eval()
    local.load_state_dict(smollm2.model.state_dict())
    full, windowed = answer_check(smollm2.model, probes), answer_check(local, probes)
    assert full.far >= 5 and full.near >= 5, full
    assert windowed.far <= 1 and windowed.near >= 5, windowed


def test_distractors_are_lookalikes_of_the_asked_fact_with_other_answers():
    tok = tiny_tokenizer()
    probes = make_probes(tok, filler(tok, t=600), per_depth=2, seed=3, distractors=3)
    plain = make_probes(tok, filler(tok, t=600), per_depth=2, seed=3)
    for p, q in zip(probes, plain):
        assert p.ids.shape == (600,) and tok.decode(p.ids[p.answer_start:]) == tok.decode(q.ids[q.answer_start:])
        text = tok.decode(p.ids)
        cue = text.rsplit("\n\n", 1)[1]
        answer = tok.decode(p.ids[p.answer_start:])
        thing, person = cue[len("The "):].split(" of ", 1)
        first, last = person[: -len(answer) - len(" is a")].split()
        facts = [s for s in text.rsplit("\n\n", 1)[0].split(". ") if f"The {thing} of " in s]
        assert len(facts) == 4, facts  # the asked fact and three lookalikes
        others = [f for f in facts if f"{first} {last} is" not in f]
        assert len(others) == 3
        # each lookalike shares a first or last name and has another colour and animal
        assert all((f" {first} " in f) != (f" {last} " in f) for f in others), others
        colour, animal = answer.split()
        assert all(colour not in f and animal not in f for f in others), others
        where = {f: text.index(f) for f in facts}
        asked = where[next(f for f in facts if f not in others)]
        assert (asked < min(where[f] for f in others)) == (p.depth == "far")
    with pytest.raises(ValueError, match="distractors=-1; allowed"):
        make_probes(tok, filler(tok), per_depth=1, distractors=-1)
    with pytest.raises(ValueError, match="too short"):
        make_probes(tok, filler(tok, t=120), per_depth=1, distractors=3)
