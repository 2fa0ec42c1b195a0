"""Teacher-written answers for chat exchanges (``data.answers: teacher``).

The exchanges built from passages (:func:`.data.passages_to_chat`) answer with passage text: a
continuation, or the sentence a copy task asks for. With ``teacher`` the teacher writes every
assistant turn instead (greedy, from the same user turn, rendered with the chat template's
generation prompt), so the student is distilled on the teacher's own answers in the form it gives
them -- sequence-level distillation (Kim & Rush, 2016) under the token-level KL the recipe already
applies. Chat records the user brings are answered the same way (their last assistant turn is
replaced).

Generation is the dear part on a CPU, so only as many exchanges are answered as the run will read
(``tokens_needed``), in order, in chunks cached on disk by ``datasets`` under a fingerprint of the
exchanges, the teacher's weights and the generation settings: a rerun, a longer run or another
process of the same run reads the cached chunks.
"""

from __future__ import annotations

import hashlib
import re
import time
from typing import Callable

import datasets
import torch

CHUNK = 64          # exchanges per cached chunk
GENERATE_BATCH = 8  # prompts per generate() call (left-padded)
_VERSION = "teacher-answers-1"  # bump when the generation or the cut changes what a chunk holds

_SENTENCE_END = re.compile(r"[.!?][\"')\]]*(?=\s|$)")


def teacher_fingerprint(model: torch.nn.Module) -> str:
    """A digest of the model's class, config and every parameter and buffer (names, shapes, values):
    two teachers give the same cached answers only when they compute the same thing."""
    h = hashlib.sha256(type(model).__name__.encode())
    h.update(model.config.to_json_string(use_diff=False).encode())
    for name, tensor in list(model.state_dict().items()):
        h.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        h.update(tensor.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:24]


def cut_unfinished(answer: str) -> str:
    """An answer that ran out of tokens, cut after its last full sentence ('' when it has none), so
    the end-of-turn that follows it in training closes a whole sentence."""
    ends = [m.end() for m in _SENTENCE_END.finditer(answer)]
    return answer[: ends[-1]].strip() if ends else ""


def _stop_ids(model, tokenizer) -> set[int]:
    ids = model.generation_config.eos_token_id
    ids = set(ids if isinstance(ids, (list, tuple)) else [ids] if ids is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


@torch.no_grad()
def generate_answers(model, tokenizer, prompts: list[list[dict]], max_new_tokens: int) -> list[str]:
    """The teacher's greedy answer to each prompt (``[{"role", "content"}, ...]`` ending with a user
    turn): at most ``max_new_tokens`` tokens, stopped at end of turn; an unfinished one cut by
    :func:`cut_unfinished`. Special tokens are not part of the returned text."""
    stop = _stop_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(stop)
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"  # generate() appends to the right of every row
    try:
        answers = []
        for i in range(0, len(prompts), GENERATE_BATCH):
            texts = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False)
                     for p in prompts[i:i + GENERATE_BATCH]]
            enc = tokenizer(texts, add_special_tokens=False, return_tensors="pt", padding=True)
            out = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=sorted(stop),
                                 pad_token_id=pad)
            for row in out[:, enc["input_ids"].shape[1]:].tolist():
                finished = any(t in stop for t in row)
                if finished:
                    row = row[: min(row.index(t) for t in stop if t in row)]
                text = tokenizer.decode(row, skip_special_tokens=True).strip()
                answers.append(text if finished else cut_unfinished(text))
        return answers
    finally:
        tokenizer.padding_side = side


def _answerer(model, tokenizer, max_new_tokens: int):
    def answer(batch: dict) -> dict:
        prompts = [msgs[:-1] if msgs and msgs[-1]["role"] == "assistant" else msgs for msgs in batch["messages"]]
        written = generate_answers(model, tokenizer, prompts, max_new_tokens)
        return {"messages": [p + [{"role": "assistant", "content": a}] for p, a in zip(prompts, written) if a]}

    return answer


def _rendered_tokens(tokenizer, records: datasets.Dataset) -> int:
    if len(records) == 0:
        return 0
    texts = [tokenizer.apply_chat_template(m, tokenize=False) for m in records["messages"]]
    return sum(len(x) + 1 for x in tokenizer(texts, add_special_tokens=False)["input_ids"])  # + EOS each


def with_teacher_answers(exchanges: datasets.Dataset, model, tokenizer, *, max_new_tokens: int,
                         tokens_needed: int | None, log: Callable[[str], None] = print) -> datasets.Dataset:
    """``exchanges`` (a ``messages`` column of chat records) with every assistant turn written by
    ``model``; records whose answer comes out empty are dropped. Only the first records up to
    ``tokens_needed`` rendered tokens are answered (None: all), chunk by chunk, each chunk cached
    on disk (see the module docstring)."""
    key = f"{_VERSION}:{teacher_fingerprint(model)}:{max_new_tokens}:{exchanges._fingerprint}"
    chunks, tokens, started = [], 0, time.perf_counter()
    for start in range(0, len(exchanges), CHUNK):
        if tokens_needed is not None and tokens >= tokens_needed:
            break
        part = exchanges.select(range(start, min(start + CHUNK, len(exchanges))))
        fingerprint = hashlib.sha256(f"{key}:{start}:{len(part)}".encode()).hexdigest()[:16]
        cached = part.map(_answerer(model, tokenizer, max_new_tokens), batched=True, batch_size=CHUNK,
                          remove_columns=part.column_names, new_fingerprint=fingerprint,
                          desc=f"teacher answers {start}-{start + len(part)}")
        chunks.append(cached)
        tokens += _rendered_tokens(tokenizer, cached)
    answered = datasets.concatenate_datasets(chunks) if chunks else exchanges.select([])
    log(f"teacher answers: {len(answered)} exchanges ({tokens:,} tokens) from the first "
        f"{min(len(exchanges), len(chunks) * CHUNK)} of {len(exchanges)}, {time.perf_counter() - started:.0f} s "
        "(cached chunks are read, not generated)")
    return answered


__all__ = ["cut_unfinished", "generate_answers", "teacher_fingerprint", "with_teacher_answers"]
