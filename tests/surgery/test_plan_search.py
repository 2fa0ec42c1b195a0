"""CSA2 plan search: the lazy greedy (against the plain greedy and, for additive losses, the
optimum), budget parsing, plans assembled in place by the bank (real, saveable models), and
``hf-csa2 plan`` end to end on a tiny checkpoint."""

import dataclasses
import itertools

import pytest
import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import VOCAB, save_tiny_source, tiny_model

from hf_csa2.cli import main as cli_main
from hf_csa2.metrics.kv_cache import config_kv_elements_at_context
from hf_csa2.model.configuration_hf_csa2 import Csa2Config
from hf_csa2.surgery.csa2 import apply_csa2
from hf_csa2.surgery.plan import ConversionPlan, Csa2Plan, MlaPlan
from hf_csa2.surgery.plan_search import (PlanBank, PlanPoint, greedy_demotion, pareto_envelope, parse_kv_budget,
                                         plan_modes, search_plan, uniform_full_layers)
from hf_csa2.surgery.rebuild import to_csa2

CSA2 = Csa2Plan(full_every=1, window=4, top_k=6, indexer_warmup_steps=2,  # the bank sets its own layer modes
                lowrank_key_rank=8)  # values: the full width, 24
MLA = MlaPlan(kv_lora_rank=8, qk_rope_head_dim=4)


def windows(n, length=40, seed=3):
    return torch.randint(3, VOCAB, (n, length), generator=torch.Generator().manual_seed(seed))


def plain_greedy(n, loss, stop_at):
    full, path = tuple(range(n)), []
    path.append((full, loss(full)))
    while len(full) > stop_at:
        best = min(full, key=lambda f: (loss(tuple(x for x in full if x != f)), -f))
        full = tuple(x for x in full if x != best)
        path.append((full, loss(full)))
    return path


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(0.0, 10.0), min_size=2, max_size=9), st.data())
def test_lazy_greedy_is_optimal_for_additive_losses(costs, data):
    n = len(costs)
    stop_at = data.draw(st.integers(0, n - 1))
    refresh = data.draw(st.integers(1, n))

    def loss(full):
        return sum(c for i, c in enumerate(costs) if i not in full)

    path = greedy_demotion(range(n), loss, lambda full: len(full) <= stop_at, refresh=refresh)
    assert [len(f) for f, _ in path] == list(range(n, stop_at - 1, -1))
    for full, value in path:  # each step's plan is the best subset of its size
        best = min(loss(c) for c in itertools.combinations(range(n), len(full)))
        assert value == pytest.approx(loss(full)) and value == pytest.approx(best)
    assert all(a[1] <= b[1] + 1e-12 for a, b in zip(path, path[1:]))


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(0.1, 5.0), min_size=3, max_size=8), st.integers(0, 2))
def test_lazy_greedy_with_full_refresh_is_the_plain_greedy(weights, stop_at):
    """A loss where a demotion changes its neighbours' cost (layers read the nearest earlier
    full layer): with refresh >= n the lazy search makes the plain greedy's choices."""
    n = len(weights)

    def loss(full):
        total = 0.0
        for i in range(n):
            if i not in full:
                earlier = [f for f in full if f < i]
                total += weights[i] * ((i - earlier[-1]) ** 1.5 if earlier else 10.0)
        return total

    calls = []
    path = greedy_demotion(range(n), lambda f: calls.append(f) or loss(f), lambda full: len(full) <= stop_at, refresh=n)
    assert path == plain_greedy(n, loss, stop_at)
    lazy_calls = []
    # a demotion changes only its neighbours' increases, so the lazy search (neighbours + the
    # best other stale candidate) still makes the plain greedy's choices
    lazy = greedy_demotion(range(n), lambda f: lazy_calls.append(f) or loss(f), lambda full: len(full) <= stop_at,
                           refresh=1)
    # equal losses may break ties differently (hypothesis found weights with two demotions of equal loss)
    assert [round(l, 9) for _, l in lazy] == [round(l, 9) for _, l in path]
    assert len(lazy_calls) <= len(calls)


def test_budget_parsing_and_errors():
    assert parse_kv_budget("960", 11520) == 960
    assert parse_kv_budget("1/12", 11520) == pytest.approx(960)
    assert parse_kv_budget("0.5", 100) == pytest.approx(50)
    for bad in ("abc", "0", "-3", "1/0"):
        with pytest.raises(ValueError, match="--kv-budget"):
            parse_kv_budget(bad, 100)


def test_plan_modes_and_uniform_layers():
    assert plan_modes(5, [1, 3]) == ["swa", "full", "reuse", "full", "reuse"]
    assert plan_modes(3, [], "reindex") == ["swa", "swa", "swa"]
    assert uniform_full_layers(30, 3) == [0, 10, 20]
    assert uniform_full_layers(7, 2) == [0, 3]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-3.0, 3.0), min_size=2, max_size=8), st.data())
def test_past_budget_walks_on_while_the_loss_falls(gains, data):
    """Demoting can lower the loss (a lossy full layer replaced by an exact window): the walk
    goes past the first fitting plan exactly while each step still lowers the loss."""
    n = len(gains)
    stop_at = data.draw(st.integers(0, n - 1))

    def loss(full):  # each demoted layer adds its gain (negative: demoting helps)
        return 10.0 + sum(g for i, g in enumerate(gains) if i not in full)

    path = greedy_demotion(range(n), loss, lambda full: len(full) <= stop_at, refresh=n, past_budget=True)
    sizes, losses = [len(f) for f, _ in path], [v for _, v in path]
    assert sizes == list(range(n, n - len(path), -1)) and sizes[-1] <= stop_at
    first_fit = sizes.index(stop_at)
    # a step past the first one beyond the budget is taken only after a step that lowered the loss
    assert all(losses[k - 1] < losses[k - 2] for k in range(first_fit + 2, len(path)))
    assert sizes[-1] == 0 or losses[-1] >= losses[-2]
    # additive gains, full refresh: the first step past the budget that stops is a real optimum
    assert len(path) > first_fit + 1 or sizes[-1] == 0  # always one step past the budget
    fitting = losses[first_fit:]
    best_any = min(loss(c) for k in range(0, stop_at + 1) for c in itertools.combinations(range(n), k))
    assert min(fitting) == pytest.approx(best_any)


def test_past_budget_fixed_cases():
    gains = {0: -1.0, 1: -2.0, 2: 5.0}

    def loss(full):
        return 10.0 + sum(g for i, g in gains.items() if i not in full)

    path = greedy_demotion(range(3), loss, lambda full: len(full) <= 2, past_budget=True)
    assert [f for f, _ in path] == [(0, 1, 2), (0, 2), (2,), ()]  # -2, -1, then +5 stops it
    assert [f for f, _ in greedy_demotion(range(3), loss, lambda full: len(full) <= 2)] == [(0, 1, 2), (0, 2)]
    # the step that reaches the budget raises the loss; the next one lowers it again
    table = {(0, 1, 2): 10.0, (1, 2): 12.0, (0, 2): 13.0, (0, 1): 14.0, (2,): 11.0, (1,): 12.5, (0,): 20.0, (): 30.0}
    path = greedy_demotion(range(3), table.__getitem__, lambda full: len(full) <= 2, past_budget=True)
    assert [f for f, _ in path] == [(0, 1, 2), (1, 2), (2,), ()]


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(0.0, 3.0), min_size=2, max_size=7), st.data())
def test_kept_layers_are_never_demoted(costs, data):
    n = len(costs)
    keep = data.draw(st.sets(st.integers(0, n - 1), max_size=n))
    stop_at = data.draw(st.integers(0, n))

    def loss(full):
        return sum(c for i, c in enumerate(costs) if i not in full)

    path = greedy_demotion(range(n), loss, lambda full: len(full) <= stop_at, refresh=2, past_budget=True, keep=keep)
    assert all(keep <= set(full) for full, _ in path)
    # it goes on until it fits, unless only kept layers are left
    assert len(path[-1][0]) <= max(stop_at, len(keep))
    if len(keep) < n:  # something was demotable: the keep rule must not stop the walk at once
        assert len(path) > 1 and len(path[1][0]) == n - 1


def test_pareto_envelope_is_monotone():
    pts = [PlanPoint([0], [], kv, ppl) for kv, ppl in [(10, 5.0), (20, 4.0), (30, 4.5), (40, 3.0)]]
    env = pareto_envelope(pts)
    assert [p.kv_elements_per_token for p in env] == [10, 20, 40]
    assert all(a.calib_ppl > b.calib_ppl for a, b in zip(env, env[1:]))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_an_installed_plan_is_a_real_model(arch, exact_window=False):
    """The bank's in-place plan has a consistent config and state: rebuilt from them it gives
    the same logits, and its all-full plan is the all-full conversion."""
    torch.manual_seed(0)
    src = tiny_model(arch, num_layers=5)
    mla = MLA if arch != "qwen3" else MlaPlan(kv_lora_rank=8, qk_rope_head_dim=4, rope_key="per_head")
    fit, score = windows(6), windows(2, seed=4)
    plan = dataclasses.replace(CSA2, exact_window=exact_window)
    bank = PlanBank(src, fit, score, plan, mla)
    ids = windows(1, 33, seed=5)
    with torch.no_grad():
        reference, _ = apply_csa2(src, plan, mla, windows=fit)
        bank.install(range(5))
        assert torch.allclose(bank.model(ids).logits, reference(ids).logits, atol=1e-5)
        modes = bank.install([1, 3])
        assert modes == ["swa", "full", "reuse", "full", "reuse"]
        rebuilt = to_csa2(bank.model, bank.model.config.attention_layers, bank.model.state_dict())
        assert [s["mode"] for s in rebuilt.config.attention_layers] == modes
        assert torch.allclose(bank.model(ids).logits, rebuilt(ids).logits, atol=1e-5)
    assert (3, "reuse", 1) not in bank.parts and (2, "reuse", 1) in bank.parts and (4, "reuse", 3) in bank.parts
    full = [s for s in bank.model.config.attention_layers if s["mode"] == "full"]
    assert [s.get("exact_window", False) for s in full] == [exact_window] * 2


def test_an_installed_plan_keeps_the_exact_window_of_its_full_layers():
    test_an_installed_plan_is_a_real_model("llama", exact_window=True)


def test_a_part_that_fails_to_fit_leaves_the_installed_plan_as_it_was(monkeypatch):
    torch.manual_seed(0)
    src = tiny_model("llama", num_layers=5)
    bank = PlanBank(src, windows(4), windows(2, seed=4), CSA2, MLA)
    bank.install([0, 2])
    before_modules = [layer.self_attn for layer in bank.model.model.layers]
    before_specs = [dict(s) for s in bank.model.config.attention_layers]

    def broken(*args, **kwargs):
        raise RuntimeError("fit failed")

    monkeypatch.setattr("hf_csa2.surgery.plan_search.fit_csa2_layer", broken)
    with pytest.raises(RuntimeError, match="fit failed"):
        bank.install([0, 3])  # layer 4 reads layer 3: a part not fitted yet
    assert [layer.self_attn for layer in bank.model.model.layers] == before_modules
    assert bank.model.config.attention_layers == before_specs


def test_search_walks_down_to_the_budget():
    torch.manual_seed(0)
    src = tiny_model("llama", num_layers=5)
    probe = PlanBank(src, windows(4), windows(2, seed=4), CSA2, MLA)
    budget = probe.kv_elements_per_token([0, 2], 64)
    res = search_plan(src, windows(4), windows(2, seed=4), CSA2, MLA, kv_budget=budget, context=64, log=lambda m: None)
    kv = [p.kv_elements_per_token for p in res.path]
    ppl = [p.calib_ppl for p in res.path]
    assert [len(p.full_layers) for p in res.path] == list(range(5, 5 - len(res.path), -1))
    assert all(a > b for a, b in zip(kv, kv[1:]))
    first_fit = next(k for k, v in enumerate(kv) if v <= budget)
    assert first_fit == 3 and kv[2] > budget
    # one step past the budget, then on only while the loss fell; the chosen plan is the best fitting one
    assert len(res.path) > first_fit + 1
    assert all(ppl[k - 1] < ppl[k - 2] for k in range(first_fit + 2, len(ppl)))
    assert len(res.path) == 6 or ppl[-1] >= ppl[-2]
    assert res.chosen.calib_ppl == min(ppl[first_fit:])
    assert res.uniform is not None and res.uniform.full_layers == uniform_full_layers(5, len(res.chosen.full_layers))
    assert res.chosen.modes == plan_modes(5, res.chosen.full_layers)
    with pytest.raises(ValueError, match="below the cheapest plan"):
        search_plan(src, windows(4), windows(2, seed=4), CSA2, MLA, kv_budget=1.0, context=64, log=lambda m: None)
    # a layer kept full (a retrieval layer) stays full on every step, and the plan still fits
    kept = search_plan(src, windows(4), windows(2, seed=4), CSA2, MLA, kv_budget=budget, context=64, keep_full=[4],
                       log=lambda m: None)
    assert all(4 in p.full_layers for p in kept.path) and kept.kept_full == [4]
    assert kept.chosen.kv_elements_per_token <= budget and kept.chosen.modes[4] == "full"
    assert [p.full_layers for p in kept.path] != [p.full_layers for p in res.path]  # unkept, 4 goes
    with pytest.raises(ValueError, match=r"cheapest plan that keeps layers \[0, 1, 2\] full"):
        search_plan(src, windows(4), windows(2, seed=4), CSA2, MLA, kv_budget=budget, context=64,
                    keep_full=[0, 1, 2], log=lambda m: None)
    with pytest.raises(ValueError, match=r"layers to keep full \[7\]; allowed: layer indices 0..4"):
        search_plan(src, windows(4), windows(2, seed=4), CSA2, MLA, kv_budget=budget, context=64, keep_full=[7],
                    log=lambda m: None)


def test_lowrank_layers_stay_lowrank_on_every_step_and_count_in_the_budget():
    torch.manual_seed(0)
    src = tiny_model("llama", num_layers=5)
    probe = PlanBank(src, windows(4), windows(2, seed=4), CSA2, MLA, lowrank_layers=[3])
    assert probe.modes([0, 2]) == ["full", "reuse", "full", "lowrank", "reuse"]
    # a lowrank layer caches its codes (8 + 24 wide) for every token; as a reader it would hold its last
    # window - 1 = 3 tokens' exact keys and values (2 KV heads x 12, twice)
    reader_specs = probe.plan_specs(["full", "reuse", "full", "reuse", "reuse"])
    reader_kv = config_kv_elements_at_context(Csa2Config.from_base_config(probe.dense.config.to_base_config(),
                                                                          reader_specs), 64) / 64
    assert probe.kv_elements_per_token([0, 2], 64) == pytest.approx(reader_kv + 8 + 24 - 3 * 2 * 2 * 12 / 64)
    budget = probe.kv_elements_per_token([0, 2], 64)
    res = search_plan(src, windows(4), windows(2, seed=4), CSA2, MLA, kv_budget=budget, context=64,
                      lowrank_layers=[3], log=lambda m: None)
    assert res.lowrank_layers == [3] and all(p.modes[3] == "lowrank" and 3 not in p.full_layers for p in res.path)
    assert len(res.path[0].full_layers) == 4 and res.chosen.kv_elements_per_token <= budget
    assert res.uniform is None or 3 not in res.uniform.full_layers
    with pytest.raises(ValueError, match=r"layers \[3\] are asked to stay full and to be lowrank"):
        search_plan(src, windows(4), windows(2, seed=4), CSA2, MLA, kv_budget=budget, context=64, keep_full=[3],
                    lowrank_layers=[3], log=lambda m: None)
    with pytest.raises(ValueError, match=r"layers to make lowrank \[5\]; allowed: layer indices 0..4"):
        search_plan(src, windows(4), windows(2, seed=4), CSA2, MLA, kv_budget=budget, context=64,
                    lowrank_layers=[5], log=lambda m: None)


def test_swa_pass_keeps_only_improving_swa_layers():
    torch.manual_seed(0)
    src = tiny_model("llama", num_layers=5)
    bank = PlanBank(src, windows(4), windows(2, seed=4), CSA2, MLA)
    full = [1, 3]
    start = PlanPoint(full, bank.modes(full), bank.kv_elements_per_token(full, 64), bank.calib_ppl(full))
    log = []
    out = bank.swa_pass(start, log.append)
    assert len(log) == 2  # layers 2 and 4 read; layer 0 is swa already
    assert out.full_layers == full and out.kv_elements_per_token == start.kv_elements_per_token
    assert all(a == b or (a == "reuse" and b == "swa") for a, b in zip(start.modes, out.modes))
    assert out.calib_ppl <= start.calib_ppl
    assert out.calib_ppl == pytest.approx(bank.score_modes(out.modes), rel=1e-6)  # the kept plan really scores so
    assert sum("(kept)" in line for line in log) == sum(a != b for a, b in zip(start.modes, out.modes))
    with pytest.raises(ValueError, match="allowed in this bank: full, swa, lowrank, reuse"):
        bank.install_modes(["swa", "full", "reindex", "full", "reuse"])
    # the keep rule, on a score where swa helps at layer 2 and hurts at layer 4
    bank.score_modes = lambda modes: 10.0 - (modes[2] == "swa") + (modes[4] == "swa")
    out = bank.swa_pass(PlanPoint(full, bank.modes(full), 1.0, 10.0), log=lambda m: None)
    assert out.modes == ["swa", "full", "swa", "full", "reuse"] and out.calib_ppl == 9.0


def test_plan_cli_writes_a_plan_that_converts(tmp_path, capsys):
    save_tiny_source("llama", tmp_path / "src", num_layers=4)
    text = " ".join(f"Record {i}: sensor {i % 17} reported value {i * 13 % 97} at step {i}." for i in range(400))
    (tmp_path / "calib.txt").write_text(text)
    base = {"mla": {"kv_lora_rank": 8, "qk_rope_head_dim": 4}, "csa2": {"full_every": 2, "window": 4, "top_k": 8,
                                                                      "indexer_warmup_steps": 2},
            "calibration": {"text": str(tmp_path / "calib.txt"), "num_tokens": 192, "seq_len": 48, "eval_windows": 2}}
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    out = tmp_path / "chosen.yaml"
    args = ["plan", str(tmp_path / "src"), "--kv-budget", "1/3", "--plan", str(tmp_path / "base.yaml"),
            "--out", str(out), "--context", "64", "--swa-pass"]
    assert cli_main(args) == 0
    table = capsys.readouterr().out
    assert "| step 0 |" in table and "| uniform |" in table and "| chosen + swa at " in table
    text = out.read_text()
    assert text.startswith("# CSA2 layer plan chosen by: hf-csa2 plan")
    plan = ConversionPlan.from_yaml(out)
    assert plan.csa2.full_every is None and len(plan.csa2.layers) == 4 and plan.csa2.window == 4
    assert cli_main(["convert", str(tmp_path / "src"), "--plan", str(out), "--out", str(tmp_path / "conv")]) == 0
    # bad input: named before any work
    assert cli_main(args) == 2  # --out exists
    assert "exists" in capsys.readouterr().err
    assert cli_main(args[:3] + ["lots"] + args[4:-5] + ["--out", str(tmp_path / "x.yaml")]) == 2
    assert "--kv-budget 'lots'" in capsys.readouterr().err
    for flag, value, message in (("--keep-full", "x", "--keep-full 'x'; allowed: comma-separated layer indices"),
                                 ("--keep-full", "9", "--keep-full 9; allowed: layer indices 0..3"),
                                 ("--retrieval-drop", "0", "--retrieval-drop 0.0; allowed: a share in (0, 1]"),
                                 ("--retrieval-mode", "dense", "--retrieval-mode: invalid choice: 'dense'")):
        assert cli_main(args[:-5] + ["--out", str(tmp_path / "y.yaml"), flag, value]) == 2
        assert message in capsys.readouterr().err and not (tmp_path / "y.yaml").exists()
    # retrieval layers become lowrank by default: ranks wider than the source's keys are refused up front
    no_mla = {"csa2": {"layers": ["swa", "lowrank", "swa", "swa"], "window": 4}, "calibration": base["calibration"]}
    (tmp_path / "no_mla.yaml").write_text(yaml.safe_dump(no_mla))
    assert cli_main(["plan", str(tmp_path / "src"), "--kv-budget", "1/3", "--plan", str(tmp_path / "no_mla.yaml"),
                     "--out", str(tmp_path / "y.yaml")]) == 2
    assert "has no mla section" in capsys.readouterr().err
    wide = {**base, "csa2": {**base["csa2"], "lowrank_key_rank": 25}}
    (tmp_path / "wide.yaml").write_text(yaml.safe_dump(wide))
    assert cli_main(["plan", str(tmp_path / "src"), "--kv-budget", "1/3", "--plan", str(tmp_path / "wide.yaml"),
                     "--out", str(tmp_path / "y.yaml"), "--context", "64"]) == 2
    assert "csa2.lowrank_key_rank=25 exceeds the source's key/value width 24" in capsys.readouterr().err
    kept = tmp_path / "kept.yaml"
    assert cli_main(args[:-5] + ["--out", str(kept), "--keep-full", "3"]) == 0
    assert ConversionPlan.from_yaml(kept).csa2.layers[3] == "full"
    assert "retrieval scan" in capsys.readouterr().err  # run, or said why it was skipped
