"""CSA2 layer-plan search: which layers are ``full`` under a KV budget (``hf-csa2 plan``).

Greedy, IndexCache-style: start with every layer ``full``; at each step demote the full
layer whose removal raises the calibration loss least (the layers that read it now read the
previous full layer; layers before the first full layer become ``swa``), until the plan's KV
elements per token at the reference context fit the budget, and on while each further demotion
still lowers the loss (a full layer's latent entries are lossy, so fewer full layers can score
better). The path is the trade-off curve; the chosen plan is the best-scoring one that fits.

A real conversion per candidate would take minutes, so candidates are assembled from a bank
of parts fitted once (:class:`PlanBank`): the all-full CSA2 model (each layer's MLA entries
and indexer, fitted layer by layer like a real conversion), and for every (layer, mode,
source) the search visits, that layer's reader, entry bias and ``o_proj`` fitted with the
same :func:`~hf_csa2.surgery.csa2.fit_csa2_layer` a conversion runs, on the all-full model's
activations (a conversion fits on the plan's own activations: the search scores a proxy, and
the chosen plan is then converted for real). Each candidate is installed into the bank
model in place and scored on the held-out calibration windows.

Lazy greedy: a demotion changes only the readers of its neighbours, so each step re-scores
the neighbours of the last demoted layer, never-scored candidates and the ``refresh`` best
candidates of earlier steps; with ``refresh`` >= the number of layers it is the plain greedy.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import asdict, dataclass
from fractions import Fraction
from types import SimpleNamespace
from typing import Callable, Iterable

import torch

from ..errors import InputError
from ..metrics.kv_cache import config_kv_elements_at_context
from ..metrics.perplexity import mean_nll
from ..model.configuration_hf_csa2 import Csa2Config, attention_head_dim, validate_csa2_sources
from ..model.csa2_attention import Csa2ReaderAttention
from ..model.lowrank_attention import LowRankKVAttention
from ..model.modeling_hf_csa2 import key_rotary
from .calibration import decoder_layers
from .csa2 import (
    Csa2FitOptions,
    apply_csa2,
    as_dense_csa2,
    csa2_layer_specs,
    default_sources,
    dense_layer_specs,
    fit_csa2_layer,
    layer_mode,
)
from .layerwise import calibrate_layerwise, source_attention_outputs
from .plan import Csa2Plan, MlaPlan

SEARCH_OTHER_MODES = ("reuse", "reindex", "swa")


@dataclass
class PlanPoint:
    """One plan on the trade-off curve."""

    full_layers: list[int]
    modes: list[str]
    kv_elements_per_token: float  # at the search's reference context
    calib_ppl: float


@dataclass
class PlanSearchResult:
    source_ppl: float
    source_kv_elements_per_token: float
    context: int
    budget: float
    path: list[PlanPoint]  # all-full first, one demotion per step
    uniform: PlanPoint | None  # evenly spaced full layers, as many as the chosen plan
    evaluations: int
    swa_pass: PlanPoint | None = None  # the chosen full layers with readers turned swa where that helps
    kept_full: list[int] = dataclasses.field(default_factory=list)  # never demoted (e.g. retrieval layers)
    lowrank_layers: list[int] = dataclasses.field(default_factory=list)  # lowrank in every plan (e.g. retrieval layers)

    @property
    def final(self) -> PlanPoint:
        """The plan to write: the swa pass's when it ran, else the chosen one."""
        return self.swa_pass if self.swa_pass is not None else self.chosen

    @property
    def chosen(self) -> PlanPoint:
        """The best-scoring plan on the path that fits the budget (ties: the cheaper one)."""
        fitting = [p for p in self.path if p.kv_elements_per_token <= self.budget]
        if not fitting:
            raise InputError(f"no plan on the path fits the budget of {self.budget:.1f} KV elements/token")
        return min(fitting, key=lambda p: (p.calib_ppl, p.kv_elements_per_token))

    def as_dict(self) -> dict:
        return {**asdict(self), "chosen": asdict(self.chosen), "final": asdict(self.final),
                "envelope": [asdict(p) for p in pareto_envelope(self.path)]}


def parse_kv_budget(text: str | float, source_kv: float) -> float:
    """KV budget in elements per token: a number >= 1 is absolute (e.g. ``960``); a fraction
    (``1/12``, ``0.083``) is relative to the source's ``source_kv``."""
    try:
        value = float(Fraction(str(text).strip()))
    except (ValueError, ZeroDivisionError):
        raise InputError(f"--kv-budget {text!r}; allowed: elements per token (e.g. 960) or a fraction of the "
                         f"source's {source_kv:.0f} (e.g. 1/12 or 0.083)") from None
    if value <= 0:
        raise InputError(f"--kv-budget {text!r}; allowed: a positive number")
    return value * source_kv if value < 1 else value


def plan_modes(num_layers: int, full_layers: Iterable[int], other_mode: str = "reuse",
               lowrank_layers: Iterable[int] = ()) -> list[str]:
    """Modes of the plan with these full layers: ``lowrank`` at ``lowrank_layers``, ``other_mode``
    after the first full layer, ``swa`` before it (nothing to read there)."""
    full, own = set(full_layers), set(lowrank_layers)
    first = min(full) if full else num_layers
    return ["lowrank" if i in own else "full" if i in full else ("swa" if i < first else other_mode)
            for i in range(num_layers)]


def uniform_full_layers(num_layers: int, count: int) -> list[int]:
    """``count`` evenly spaced full layers starting at 0 (``full_every`` when it divides)."""
    return sorted({k * num_layers // count for k in range(count)}) if count else []


def greedy_demotion(layers: Iterable[int], evaluate: Callable[[tuple[int, ...]], float],
                    fits: Callable[[tuple[int, ...]], bool], refresh: int = 4,
                    on_step: Callable[[tuple[int, ...], float], None] | None = None,
                    past_budget: bool = False, keep: Iterable[int] = ()) -> list[tuple[tuple[int, ...], float]]:
    """Demote full layers one at a time until ``fits(full_layers)``; with ``past_budget``, try
    one more demotion and go on while each demotion lowers the loss (the path then ends with the
    first one that did not, unless no demotable layer is left). Layers in ``keep`` stay full.

    ``evaluate(full_layers) -> loss`` scores a plan. Each step scores the candidates named in
    the module docstring (stale ones ranked by the loss increase they caused when last scored)
    and demotes the one with the lowest loss (ties: the later layer).
    Returns the path ``[(full_layers, loss), ...]``, all layers first.
    """
    full = tuple(sorted(layers))
    keep = frozenset(keep)
    current = evaluate(full)
    path = [(full, current)]
    # Loss increase of demoting each layer, measured against the plan of the step that scored
    # it: increases, unlike absolute losses, stay comparable from one step to the next.
    increase: dict[int, float] = {}
    last_neighbours: set[int] = set()
    first_fit: int | None = None

    def more() -> bool:
        # past the budget: one step beyond the first fitting plan, then on while steps lower the loss
        nonlocal first_fit
        if not fits(full):
            return True
        if first_fit is None:
            first_fit = len(path) - 1
        return past_budget and (len(path) - 1 == first_fit or path[-1][1] < path[-2][1])

    while any(f not in keep for f in full) and more():
        # the neighbours are re-scored anyway: the refresh slots go to the best other stale ones
        demotable = [f for f in full if f not in keep]
        ranked = sorted((f for f in demotable if f in increase and f not in last_neighbours), key=lambda f: (increase[f], -f))
        todo = ({f for f in demotable if f not in increase} | last_neighbours | set(ranked[:refresh])) - keep
        losses = {f: evaluate(tuple(x for x in full if x != f)) for f in sorted(todo)}
        increase.update({f: loss - current for f, loss in losses.items()})
        best = min(todo, key=lambda f: (losses[f], -f))
        k = full.index(best)
        last_neighbours = set(full[max(k - 1, 0): k] + full[k + 1: k + 2])
        full, current = full[:k] + full[k + 1:], losses[best]
        del increase[best]
        path.append((full, current))
        if on_step is not None:
            on_step(full, current)
    return path


class PlanBank:
    """Parts for assembling CSA2 plans of one model (see the module docstring).

    ``model``: the source (native or hf_csa2 dense); ``fit`` [N, T] calibration windows for
    the fits, ``score`` [M, T] for the loss; ``plan`` / ``mla_plan``: the ``csa2`` and ``mla``
    sections whose settings every part is fitted with (the layer modes in ``plan`` are not
    used: the bank assembles its own). The all-full model is fitted on every ``fit`` window,
    the per-layer parts on the first ``part_windows`` (all when None).
    """

    def __init__(self, model, fit: torch.Tensor, score: torch.Tensor, plan: Csa2Plan, mla_plan: MlaPlan,
                 other_mode: str = "reuse", log: Callable[[str], None] = print, part_windows: int | None = None,
                 lowrank_layers: Iterable[int] = ()):
        if other_mode not in SEARCH_OTHER_MODES:
            raise ValueError(f"other_mode={other_mode!r}; allowed: {', '.join(SEARCH_OTHER_MODES)}")
        self.dense = as_dense_csa2(model)
        self.num_layers = len(self.dense.config.attention_layers)
        self.other_mode, self.score = other_mode, score
        self.lowrank_layers = sorted(set(lowrank_layers))
        self.plan = dataclasses.replace(plan, layers=["full"] * self.num_layers, full_every=None)
        self.opts = Csa2FitOptions.from_plan(self.plan)
        log(f"plan search: fitting the all-full model ({self.num_layers} layers)")
        self.model, _ = apply_csa2(self.dense, self.plan, mla_plan, windows=fit)
        # Calibration windows are short: read through the fast exact path (same results to rounding).
        self.model.config.csa2_read_path = "scores"
        self.full_specs = [dict(s) for s in self.model.config.attention_layers]
        self.full_modules = [layer.self_attn for layer in decoder_layers(self.model)]
        self.dense_modules = [layer.self_attn for layer in decoder_layers(self.dense)]
        # Parts are fitted on the first `part_windows` windows (the search fits hundreds of them).
        part_fit = fit if part_windows is None else fit[:part_windows]
        inputs: dict[int, tuple] = {}
        calibrate_layerwise(self.model, part_fit, lambda i, attn, hidden, kw: inputs.__setitem__(i, (hidden, kw)))
        self.inputs = [inputs[i] for i in range(self.num_layers)]
        # What a full layer leaves for its readers (entries, index keys, Top-K) on the fit windows.
        self.fit_peers = [SimpleNamespace(scratch=dict(m.scratch), indexer=m.indexer) for m in self.full_modules]
        self.targets = source_attention_outputs(self.dense, part_fit)
        self.parts: dict[tuple, Csa2ReaderAttention] = {}
        self.part_notes: dict[tuple, dict] = {}
        self.evaluations = 0

    # -- plans ------------------------------------------------------------------------------
    def plan_specs(self, modes: list[str], sources: list[int | None] | None = None) -> list[dict]:
        sources = default_sources(modes) if sources is None else sources
        first = self.full_specs[0]
        specs = csa2_layer_specs(self.full_specs, self.dense.config.attention_layers, modes, sources,
                                 window=self.opts.window, top_k=self.opts.top_k, index_heads=first["index_heads"],
                                 index_head_dim=first["index_head_dim"], index_rope_pairs=first["index_rope_pairs"],
                                 sinks=self.plan.sinks, sink_tokens=self.plan.sink_tokens,
                                 exact_window=self.plan.exact_window,
                                 lowrank_ranks=(self.plan.lowrank_key_rank, self.plan.lowrank_value_rank),
                                 head_dim=attention_head_dim(self.dense.config), select_block=self.plan.select_block)
        return validate_csa2_sources(specs)

    def modes(self, full_layers: Iterable[int]) -> list[str]:
        return plan_modes(self.num_layers, full_layers, self.other_mode, self.lowrank_layers)

    def kv_elements_per_token(self, full_layers: Iterable[int], context: int) -> float:
        """Cache elements per token after a ``context``-token prefill (from the config)."""
        specs = self.plan_specs(self.modes(full_layers))
        config = Csa2Config.from_base_config(self.dense.config.to_base_config(), specs)
        return config_kv_elements_at_context(config, context) / context

    # -- parts ------------------------------------------------------------------------------
    def part(self, i: int, specs: list[dict]) -> Csa2ReaderAttention | LowRankKVAttention:
        """Layer ``i`` of a plan as a fitted window or lowrank layer (cached per mode and source)."""
        spec = specs[i]
        key = (i, layer_mode(spec), spec.get("source"))
        if key not in self.parts:
            entries = specs[spec["entries"]] if "entries" in spec else None
            dense = self.dense_modules[i]
            if spec["kind"] == "lowrank":
                attn = LowRankKVAttention(dense, self.model.config, i, spec)
                attn.key_rotary = key_rotary(self.model.model.rotary_emb, self.dense.config.to_base_config(), i)
            else:
                attn = Csa2ReaderAttention(dense, self.model.config, i, spec, entries)
            attn.o_proj = copy.deepcopy(attn.o_proj)  # refit per part; q/k/v stay shared with the dense layer
            if attn.sinks is not None and dense.sinks is not None:
                attn.sinks.data.copy_(dense.sinks.data)
            attn.peers = self.fit_peers
            hidden, kwargs = self.inputs[i]
            self.part_notes[key] = fit_csa2_layer(attn, dense, hidden, kwargs, self.targets[i], self.opts)
            self.parts[key] = attn.eval()
        return self.parts[key]

    def install(self, full_layers: Iterable[int]) -> list[str]:
        """Make the bank model the plan with these full layers (in place); returns its modes."""
        modes = self.modes(full_layers)
        self.install_modes(modes)
        return modes

    def install_modes(self, modes: list[str]) -> None:
        """Make the bank model the plan with these modes (in place; full layers as in the bank,
        the others ``swa`` or the bank's ``other_mode``). All or nothing: when a part fails to
        fit, the model keeps the plan it had."""
        if any(m not in ("full", "swa", "lowrank", self.other_mode) for m in modes):
            raise ValueError(f"modes {modes}; allowed in this bank: full, swa, lowrank, {self.other_mode}")
        specs = self.plan_specs(modes)
        layers = decoder_layers(self.model)
        modules = [self.full_modules[i] if modes[i] == "full" else self.part(i, specs) for i in range(len(layers))]
        for layer, attn in zip(layers, modules):  # nothing below can fail half-way
            layer.self_attn = attn
        self.model.config.attention_layers = specs
        peers = [layer.self_attn for layer in layers]
        for attn in peers:
            if isinstance(attn, Csa2ReaderAttention):
                attn.peers = peers

    def calib_ppl(self, full_layers: Iterable[int]) -> float:
        return self.score_modes(self.modes(full_layers))

    @torch.no_grad()
    def score_modes(self, modes: list[str]) -> float:
        self.install_modes(modes)
        self.evaluations += 1
        return mean_nll(self.model, self.score)["ppl"]

    def swa_pass(self, point: PlanPoint, log: Callable[[str], None] = print) -> PlanPoint:
        """Try each reading layer of ``point`` as ``swa`` (own window only), in order, keeping
        it where the calibration loss falls. Same KV: a reader caches only its window."""
        modes, best = list(point.modes), point.calib_ppl
        for i, mode in enumerate(point.modes):
            if mode in ("full", "swa", "lowrank"):
                continue
            trial = modes[:i] + ["swa"] + modes[i + 1:]
            ppl = self.score_modes(trial)
            log(f"  swa pass: layer {i} as swa: calib ppl {ppl:.3f} ({'kept' if ppl < best else 'not kept'})")
            if ppl < best:
                modes, best = trial, ppl
        return PlanPoint(list(point.full_layers), modes, point.kv_elements_per_token, best)


def search_plan(model, fit: torch.Tensor, score: torch.Tensor, plan: Csa2Plan, mla_plan: MlaPlan, *, kv_budget: float,
                context: int, other_mode: str = "reuse", refresh: int = 4, part_windows: int | None = None,
                swa_pass: bool = False, keep_full: Iterable[int] = (), lowrank_layers: Iterable[int] = (),
                log: Callable[[str], None] = print) -> PlanSearchResult:
    """Greedy plan search (module docstring) down to ``kv_budget`` elements per token at
    ``context`` tokens, every part fitted with the settings of ``plan`` / ``mla_plan`` (see
    :class:`PlanBank`). Layers in ``keep_full`` are never demoted (e.g. the retrieval layers of
    :func:`~hf_csa2.metrics.retrieval_layers.scan_retrieval_layers`, which calibration loss does
    not see). Layers in ``lowrank_layers`` are ``lowrank`` in every plan (own keys and values as
    rank-r codes: for retrieval layers, which reuse cannot serve) and never full. Also scores the
    uniform plan with as many full layers as the chosen one; with ``swa_pass``, then tries the
    chosen plan's readers as ``swa`` (:meth:`PlanBank.swa_pass`)."""
    dense_specs = dense_layer_specs(model)
    n = len(dense_specs)
    keep_full, lowrank_layers = sorted(set(keep_full)), sorted(set(lowrank_layers))
    for name, layers in (("to keep full", keep_full), ("to make lowrank", lowrank_layers)):
        if any(not 0 <= i < n for i in layers):
            raise InputError(f"layers {name} {layers}; allowed: layer indices 0..{n - 1}")
    if set(keep_full) & set(lowrank_layers):
        raise InputError(f"layers {sorted(set(keep_full) & set(lowrank_layers))} are asked to stay full and to be "
                         "lowrank; allowed: one mode per layer")
    base = model.config.to_base_config() if hasattr(model.config, "to_base_config") else model.config
    source_kv = config_kv_elements_at_context(base, context) / context
    swa_specs = csa2_layer_specs(dense_specs, dense_specs, ["swa"] * n, [None] * n, window=plan.window,
                                 top_k=plan.top_k, index_heads=1, index_head_dim=1, sink_tokens=plan.sink_tokens)
    floor = config_kv_elements_at_context(Csa2Config.from_base_config(base, swa_specs), context) / context
    if kv_budget < floor:
        raise InputError(f"KV budget {kv_budget:.1f} elements/token is below the cheapest plan (every layer swa with "
                         f"window {plan.window}: {floor:.1f} at a {context}-token context)")
    source_ppl = mean_nll(model, score)["ppl"]
    bank = PlanBank(model, fit, score, plan, mla_plan, other_mode, log, part_windows, lowrank_layers)
    least = bank.kv_elements_per_token(keep_full, context) if keep_full or lowrank_layers else floor
    if least > kv_budget:
        raise InputError(f"KV budget {kv_budget:.1f} elements/token is below the cheapest plan that keeps layers "
                         f"{keep_full} full and {lowrank_layers} lowrank ({least:.1f} at a {context}-token context); "
                         "raise the budget or keep fewer layers")

    def evaluate(full: tuple[int, ...]) -> float:
        ppl = bank.calib_ppl(full)
        log(f"  full {list(full)}: calib ppl {ppl:.3f}, KV/token {bank.kv_elements_per_token(full, context):.1f}")
        return ppl

    def on_step(full: tuple[int, ...], ppl: float) -> None:
        log(f"step {n - len(full)}: full {list(full)} calib ppl {ppl:.3f} KV/token {bank.kv_elements_per_token(full, context):.1f}")

    candidates = [i for i in range(n) if i not in lowrank_layers]
    path = greedy_demotion(candidates, evaluate, lambda full: bank.kv_elements_per_token(full, context) <= kv_budget,
                           refresh=refresh, on_step=on_step, past_budget=True, keep=keep_full)
    points = [PlanPoint(list(f), bank.modes(f), bank.kv_elements_per_token(f, context), loss) for f, loss in path]
    result = PlanSearchResult(source_ppl=source_ppl, source_kv_elements_per_token=source_kv, context=context,
                              budget=kv_budget, path=points, uniform=None, evaluations=0, kept_full=keep_full,
                              lowrank_layers=lowrank_layers)
    layers = [i for i in uniform_full_layers(n, len(result.chosen.full_layers)) if i not in lowrank_layers]
    if layers == result.chosen.full_layers:
        result.uniform = result.chosen
    elif layers:
        result.uniform = PlanPoint(layers, bank.modes(layers), bank.kv_elements_per_token(layers, context),
                                   bank.calib_ppl(layers))
    if swa_pass:
        result.swa_pass = bank.swa_pass(result.chosen, log)
    result.evaluations = bank.evaluations
    return result


def pareto_envelope(points: list[PlanPoint]) -> list[PlanPoint]:
    """The best plan at or below each point's budget (more budget never scores worse)."""
    out: list[PlanPoint] = []
    for p in sorted(points, key=lambda p: p.kv_elements_per_token):
        if not out or p.calib_ppl < out[-1].calib_ppl:
            out.append(p)
    return out


def format_curve(result: PlanSearchResult) -> str:
    """Markdown table of the search path (plus the uniform plan of the chosen size). The column
    ``best at ≤ this KV`` is the trade-off curve: the lowest calib ppl of any path plan at or
    below that KV."""
    lines = [f"| plan | full layers | KV elements/token @{result.context} | KV ratio | calib ppl | ppl ratio | "
             "best at ≤ this KV |",
             "|---|---|---:|---:|---:|---:|---:|",
             f"| source | all dense | {result.source_kv_elements_per_token:.1f} | 1.000 | {result.source_ppl:.3f} | 1.000 | |"]
    envelope = pareto_envelope(result.path)
    chosen = result.chosen

    def best_at(kv: float) -> str:
        below = [p.calib_ppl for p in envelope if p.kv_elements_per_token <= kv]
        return f"{min(below):.3f}" if below else ""

    rows = [(f"step {k}" + (" (chosen)" if p is chosen else ""), p, best_at(p.kv_elements_per_token))
            for k, p in enumerate(result.path)]
    if result.uniform is not None:
        rows.append(("uniform", result.uniform, ""))
    if result.swa_pass is not None:
        swa = [i for i, m in enumerate(result.swa_pass.modes) if m == "swa" and result.chosen.modes[i] != "swa"]
        rows.append((f"chosen + swa at {','.join(map(str, swa)) or 'none'}", result.swa_pass, ""))
    for name, p, best in rows:
        full = ",".join(map(str, p.full_layers)) or "-"
        lines.append(f"| {name} | {full} | {p.kv_elements_per_token:.1f} | "
                     f"{p.kv_elements_per_token / result.source_kv_elements_per_token:.3f} | {p.calib_ppl:.3f} | "
                     f"{p.calib_ppl / result.source_ppl:.3f} | {best} |")
    return "\n".join(lines)


__all__ = ["PlanBank", "PlanPoint", "PlanSearchResult", "format_curve", "greedy_demotion", "pareto_envelope",
           "parse_kv_budget", "plan_modes", "search_plan", "uniform_full_layers"]
