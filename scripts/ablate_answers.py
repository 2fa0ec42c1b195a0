"""Which part of a conversion costs its answers: put source pieces back into the converted model
one at a time and re-ask the answer check (and the teacher-forced agreement) on the same windows.

    python scripts/ablate_answers.py SOURCE CONVERTED [--text python-docs:heldout] [--context 512,1024]
        [--per-depth 6] [--restore o_proj:11,17] [--restore o_proj:all] [--restore attn:5/o_proj:11]

Each ``--restore PART:LAYERS[/PART:LAYERS...]`` is one variant: ``o_proj`` copies the source's output projection
into those layers (what the conversion would give without its o_proj refits: the converted layers
keep the source's head layout of values, so the source o_proj applies as is); ``attn`` puts the
source's whole attention module back (dense over the full prefix: no latent, no reuse, no sparse
read), e.g. in the reuse layers only, to see what they cost; ``windowN`` the source's attention
restricted to its last N tokens (with the source as CONVERTED: which layers read far facts);
``exact-window`` makes a full layer read
its window from the source's exact keys/values and only Top-K far entries from its latent,
``window-only`` reads no far entry at all; ``own-keys`` / ``own-values`` / ``own-both`` make a
reuse layer read its OWN exact keys / values / both at the shared Top-K addresses, ``own-rankN``
both cut to rank N (an oracle basis from the same text); ``lowrankK,V`` replaces the layer by a
``lowrank`` layer built from the source's (its q/o projections, key codes of width K and value codes of
width V fitted on the source's inputs to that layer over ``--calib`` text: what the conversion fits,
without the o_proj refit). Prints one row per
variant and context: answer check far/near, answer NLL, top-1 agreement and KL over all positions.
"""

from __future__ import annotations

import argparse
import copy

import torch

from hf_csa2.data.windows import token_windows
from hf_csa2.evals.compare import compare_models
from hf_csa2.io.sources import load_source
from hf_csa2.metrics.answer_check import answer_check, make_probes
from hf_csa2.model.attention_base import rotate_half
from hf_csa2.model.lowrank_attention import LowRankKVAttention
from hf_csa2.model.modeling_hf_csa2 import key_rotary
from hf_csa2.surgery.calibration import attention_input_moments
from hf_csa2.surgery.lowrank import fit_lowrank_layer


class _DenseFromSource(torch.nn.Module):
    """The source's attention module in a converted model's layer: dense over the whole causal
    prefix (its own mask is built here, the converted model passes its own kind), no cache."""

    def __init__(self, attn, window: int | None = None):
        super().__init__()
        self.attn, self.window = attn, window

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        t = hidden_states.shape[1]
        mask = torch.full((t, t), float("-inf"), dtype=hidden_states.dtype, device=hidden_states.device).triu(1)
        if self.window:  # only the last `window` tokens (a sliding-window layer)
            mask = mask + torch.full_like(mask, float("-inf")).tril(-self.window)
        return self.attn(hidden_states, position_embeddings=position_embeddings, attention_mask=mask[None, None],
                         past_key_values=None)


def low_rank(x: torch.Tensor, rank: int) -> torch.Tensor:
    """x [B, H, S, D] projected per head onto its own top-``rank`` right singular vectors (an
    oracle: the basis comes from the same text)."""
    flat = x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[-1]).transpose(0, 1)  # [H, B*S, D]
    basis = torch.linalg.svd(flat.float(), full_matrices=False).Vh[:, :rank]  # [H, r, D]
    return torch.einsum("bhsd,hrd,hre->bhse", x, basis.to(x.dtype), basis.to(x.dtype))


def own_entries(attn, which: str) -> None:
    """Make a reindex/reuse layer read its OWN exact keys (``which`` = keys), values (values) or
    both at the shared entries' Top-K addresses, instead of what its reader maps from the full
    layer's latent (no cache: the layer's own keys/values of every position are at hand)."""
    plain = type(attn).read_segments

    def read_segments(hidden_states, position_embeddings, cache=None):
        segments, v_up = plain(attn, hidden_states, position_embeddings, cache)
        window, entries = segments
        if attn.sink_tokens:
            raise SystemExit("own-* variants need a reader without sink_tokens")
        q, k, v = window.query, window.keys, window.values  # [B, T, HQ, D], [B, S, H, D] (rotated)
        d = q.shape[-1]
        kind = which
        if kind.startswith("rank"):  # own keys/values, each cut to this rank before RoPE
            rank = int(kind[4:])
            cos, sin = (e[:, None] for e in position_embeddings)
            kt = k.transpose(1, 2)  # [B, H, S, D]
            k_plain = kt * cos - rotate_half(kt) * sin  # RoPE undone
            k_hat = low_rank(k_plain, rank)
            k = (k_hat * cos + rotate_half(k_hat) * sin).transpose(1, 2)
            v = low_rank(v.transpose(1, 2), rank).transpose(1, 2)
            kind = "both"
        if kind in ("keys", "both"):
            q_e, k_e = q, k
        else:
            q_e, k_e = entries.query, entries.keys
        if kind in ("values", "both"):
            eye = torch.eye(d, dtype=q.dtype, device=q.device).expand(q.shape[2], d, d)
            v_e, v_up = v, eye
        else:
            v_e = entries.values
        segments[1] = type(entries)(q_e, k_e, v_e, entries.index)
        return segments, v_up

    attn.read_segments = read_segments


def exact_window(attn, source_attn, far: bool = True) -> None:
    """Make a full CSA2 layer read its own last ``window`` tokens exactly (the source layer's
    keys/values, as a reader layer does) and only its Top-K far entries from its latent (none
    with ``far=False``: a sliding-window layer that still writes entries for its readers)."""
    from hf_csa2.model.attention_base import apply_rotary
    from hf_csa2.model.sparse_attention import SparseSegment, sparse_sink_attention, window_index

    def attention_output(hidden_states, position_embeddings, attention_mask=None, cache=None, **kwargs):
        b, t, _ = hidden_states.shape
        shape = (b, t, -1, source_attn.head_dim)
        q = source_attn.q_norm(source_attn.q_proj(hidden_states).view(shape)).transpose(1, 2)
        k = source_attn.k_norm(source_attn.k_proj(hidden_states).view(shape)).transpose(1, 2)
        v = source_attn.v_proj(hidden_states).view(shape).transpose(1, 2)
        q, k = apply_rotary(q, k, *position_embeddings)
        latent, rope_part = attn.compress(hidden_states, position_embeddings)
        index_keys = attn.indexer.keys(hidden_states, position_embeddings)
        positions = torch.arange(t, device=hidden_states.device)
        iq, iw = attn.indexer.queries(hidden_states, position_embeddings)
        top = attn.indexer.select(iq, iw, index_keys, positions, attn.top_k, attn.window)
        read = top if far else torch.full_like(top, -1)
        q_nope, q_rope = attn.queries(hidden_states, position_embeddings)
        q_l, k_l, latent1, v_up = attn.absorbed_operands(q_nope, q_rope, latent, rope_part)
        own = SparseSegment(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                            window_index(positions, attn.window).expand(b, -1, -1))
        entries = SparseSegment(q_l.transpose(1, 2), k_l.transpose(1, 2), latent1.transpose(1, 2), read)
        (out, out_lat), _ = sparse_sink_attention([own, entries], scaling=attn.scaling, sinks=attn.sinks, path="scores")
        out = out + torch.einsum("bthr,hdr->bthd", out_lat, v_up[attn.kv_of_query])
        attn.scratch = {"latent": latent, "rope": rope_part, "index_keys": index_keys, "top_k": top,
                        "position_embeddings": position_embeddings}
        return out.reshape(b, t, -1).contiguous(), None

    attn.attention_output = attention_output


CALIB = {"text": "python-docs:calib", "seq_len": 1024, "windows": 8}  # set from the command line


def lowrank_from_source(model, source, i: int, key_rank: int, value_rank: int):
    """Layer ``i`` of ``source`` as a ``lowrank`` layer of ``model`` (codes fitted on the calibration text)."""
    src_attn = source.model.layers[i].self_attn
    if "moments" not in CALIB:
        windows = token_windows(CALIB["tokenizer"], CALIB["text"], CALIB["seq_len"], CALIB["windows"])
        CALIB["moments"] = attention_input_moments(source, windows, batch_size=2)
    spec = {"kind": "lowrank", "num_key_value_heads": src_attn.config.num_key_value_heads, "sinks": False,
            "key_rank": key_rank, "value_rank": value_rank}
    attn = LowRankKVAttention(copy.deepcopy(src_attn), model.config, i, spec)
    fit_lowrank_layer(attn, src_attn, CALIB["moments"][i])
    attn.key_rotary = key_rotary(model.model.rotary_emb, model.config, i)
    return attn


def restore(model, source, part: str, layers: str):
    """Put the source's ``part`` back into ``model`` (changed in place) in ``layers``."""
    n = len(model.model.layers)
    picked = range(n) if layers == "all" else [int(x) for x in layers.split(",")]
    with torch.no_grad():
        for i in picked:
            if part == "o_proj":
                model.model.layers[i].self_attn.o_proj.weight.copy_(source.model.layers[i].self_attn.o_proj.weight)
            elif part == "attn":
                model.model.layers[i].self_attn = _DenseFromSource(copy.deepcopy(source.model.layers[i].self_attn))
            elif part.startswith("window") and part[6:].isdigit():
                model.model.layers[i].self_attn = _DenseFromSource(copy.deepcopy(source.model.layers[i].self_attn), int(part[6:]))
            elif part in ("exact-window", "window-only"):
                exact_window(model.model.layers[i].self_attn, source.model.layers[i].self_attn, far=part == "exact-window")
            elif part.startswith("own-"):
                own_entries(model.model.layers[i].self_attn, part[4:])
            elif part.startswith("lowrank"):
                key_rank, value_rank = (int(r) for r in part[len("lowrank"):].split(","))
                model.model.layers[i].self_attn = lowrank_from_source(model, source, i, key_rank, value_rank)
            else:
                raise SystemExit(f"unknown part {part!r}; allowed: o_proj, attn, windowN, exact-window, window-only, own-keys, own-values, own-both, "
                                 "lowrankK,V")
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source")
    parser.add_argument("converted")
    parser.add_argument("--text", default="python-docs:heldout")
    parser.add_argument("--context", default="512,1024")
    parser.add_argument("--per-depth", type=int, default=6)
    parser.add_argument("--windows", type=int, default=3, help="text windows the probes are cut from")
    parser.add_argument("--restore", action="append", default=[], metavar="PART:LAYERS")
    parser.add_argument("--calib", default=CALIB["text"], help="text the lowrank variants' codes are fitted on")
    args = parser.parse_args()
    source = load_source(args.source)
    CALIB.update(text=args.calib, tokenizer=source.tokenizer)
    converted = load_source(args.converted).model.eval()
    if getattr(converted.config, "csa2_read_path", None):
        converted.config.csa2_read_path = "scores"  # exact like the reference "gather", much faster at these lengths

    def variants():
        """(name, model) per variant, built one at a time (a copy of the model each)."""
        yield "as converted", converted
        for spec in args.restore:
            model, names = copy.deepcopy(converted), []  # patched methods close over this copy's modules
            for change in spec.split("/"):  # e.g. exact-window:5/own-both:11,17
                part, layers = change.split(":")
                restore(model, source.model, part, layers)
                names.append(f"{part} in {layers}")
            yield " + ".join(names), model

    print("| variant | context | answers far | near | answer NLL | top-1 agreement | KL |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for context in [int(c) for c in args.context.split(",")]:
        windows = token_windows(source.tokenizer, args.text, context, args.windows)
        probes = make_probes(source.tokenizer, windows, args.per_depth)
        ref = answer_check(source.model, probes)
        print(f"| source | {context} | {ref.far}/{ref.per_depth} | {ref.near}/{ref.per_depth} | {ref.answer_nll:.3f} | 1 | 0 |")
        for name, model in variants():
            check = answer_check(model, probes)
            cmp = compare_models(source.model, model, windows[:1], bucket=context)
            print(f"| {name} | {context} | {check.far}/{check.per_depth} | {check.near}/{check.per_depth} | "
                  f"{check.answer_nll:.3f} | {cmp.top1_agreement:.3f} | {cmp.buckets[0].kl:.4f} |", flush=True)


if __name__ == "__main__":
    main()
