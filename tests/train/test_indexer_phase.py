"""The CSA2 indexer loss in training (DSA stage 1 / 2): its value is the KL of each indexer's
distribution to the teacher's head-summed dense attention over the positions it may pick, its
gradient reaches the indexers only, the indexer steps of a recipe build no graph of anything else,
train nothing else and lower that KL on other text, the schedule restarts after them, indexers get
their own learning rate, two processes agree with one, and recipes that cannot train an indexer
are refused before anything is written."""

import json
import os
import subprocess
import sys

import datasets
import pytest
import torch
from folders import tree_digest
from peft import PeftModel
from safetensors.torch import load_file
from tiny_models import save_tiny_source
from transformers import AutoModelForCausalLM, get_cosine_schedule_with_warmup

from hf_csa2.cli import main as cli_main
from hf_csa2.data.windows import token_windows
from hf_csa2.engine.trainer import INDEX_LOSS, DistillationTrainer, training_only
from hf_csa2.io.sources import load_source
from hf_csa2.surgery.pipeline import convert
from hf_csa2.train.indexer_phase import IndexerLoss, dense_teacher
from hf_csa2.train.recipe import RecipeError, load_recipe
from hf_csa2.train.run import run_recipe
from hf_csa2.train.trainer import prepare_student, training_arguments

TEXT = " ".join(f"Record {i}: the valve {i * 5 % 17} opens when gauge {i * 3 % 7} reads {i * 11 % 23} units."
                for i in range(400))
OTHER = " ".join(f"On day {i} the ferry left pier {i * 7 % 9} with {i * 13 % 31} cars and a crate of {i % 5} bells."
                 for i in range(200))
MODES = ["full", "reuse", "reindex", "reuse"]
WINDOW, SINKS = 8, 2


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A tiny Llama source, its text, a CSA2 student (full, reuse, reindex, reuse) and an MQA one."""
    root = tmp_path_factory.mktemp("indexer")
    (root / "text.txt").write_text(TEXT)
    (root / "other.txt").write_text(OTHER)
    save_tiny_source("llama", root / "src", num_layers=4)
    calib = {"text": str(root / "text.txt"), "num_tokens": 256, "seq_len": 64, "eval_windows": 2}
    convert(str(root / "src"), {"mla": {"kv_lora_rank": 8, "qk_rope_head_dim": 4},
                                "csa2": {"layers": MODES, "window": WINDOW, "top_k": 8, "sink_tokens": SINKS,
                                         "indexer_warmup_steps": 0},
                                "calibration": calib},
            out_dir=root / "csa2", log=lambda m: None)
    convert(str(root / "src"), {"gqa": {"num_key_value_heads": 1}, "calibration": calib}, out_dir=root / "mqa",
            log=lambda m: None)
    return root


def windows(work, n=2, t=64, text="text.txt"):
    return token_windows(load_source(work / "src").tokenizer, work / text, t, n)


def index_loss(student, teacher, ids) -> torch.Tensor:
    loss = IndexerLoss(student, teacher)
    with torch.no_grad(), loss.teacher_targets():
        teacher(ids)
    with loss.active():
        return student(ids)[INDEX_LOSS]


def test_index_loss_is_the_kl_to_the_teachers_head_summed_attention(work):
    ids = windows(work)
    student = load_source(work / "csa2").model
    eager = AutoModelForCausalLM.from_pretrained(work / "src", attn_implementation="eager").eval()
    got = index_loss(student, dense_teacher(load_source(work / "src").model), ids)

    with torch.no_grad():
        attn = eager(ids, output_attentions=True).attentions  # [B, H, T, T] per layer
        hidden = student(ids, output_hidden_states=True).hidden_states
        t = ids.shape[1]
        pos = torch.arange(t)
        layers = student.model.layers
        pe = student.model.rotary_emb(hidden[0], pos[None])
        x = {i: layers[i].input_layernorm(hidden[i]) for i in (0, 2)}
        keys = layers[0].self_attn.indexer.keys(x[0], pe)
        terms = []
        for i, first in ((0, 0), (2, SINKS)):  # full; reindex (layer 0's keys, its own first tokens held exactly)
            selectable = (pos[None, :] <= pos[:, None] - WINDOW) & (pos[None, :] >= first)
            mass = attn[i].sum(1) * selectable
            valid = mass.sum(-1) > 0
            target = mass / mass.sum(-1, keepdim=True).clamp_min(1e-30)
            indexer = layers[i].self_attn.indexer
            q, w = indexer.queries(x[i], pe)
            scores = (torch.einsum("btnd,bsd->btns", q, keys).relu() * w[..., None]).sum(2)  # sum_h w_h ReLU(q_h.k)
            logp = torch.log_softmax(scores.masked_fill(~selectable, float("-inf")), -1)
            kl = torch.where(target > 0, target * (target.clamp_min(1e-30).log() - logp), torch.zeros(()))
            terms.append(kl.sum(-1)[valid].mean())
    expected = torch.stack(terms).mean()
    assert expected > 0.05  # the converted indexers are not exact: a KL well above rounding
    torch.testing.assert_close(got.detach(), expected, rtol=1e-4, atol=1e-6)


def test_index_loss_reaches_the_indexers_only(work):
    student = load_source(work / "csa2").model.train()
    loss = index_loss(student, dense_teacher(load_source(work / "src").model), windows(work))
    loss.backward()
    reached = {n for n, p in student.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    indexers = {n for n, _ in student.named_parameters() if ".indexer." in n}
    # layer 2 (reindex) scores against layer 0's keys detached: its own wq / weights_proj only
    assert reached == indexers and "model.layers.0.self_attn.indexer.wk.weight" in reached


def recipe_sets(work, student, *extra):
    text = work / "text.txt"
    return [f"student={work / student}", f"data.text={text}", "data.seq_len=64", f"eval.texts=[{text}]",
            "eval.seq_len=64", "eval.windows=2", "batch=2", "log_every=1", "optim.lr=3.0e-3", *extra]


def test_indexer_steps_build_no_graph_of_anything_else(work):
    student = load_source(work / "csa2").model.train()
    teacher = dense_teacher(load_source(work / "src").model)
    loss = IndexerLoss(student, teacher)
    ids = windows(work)
    with torch.no_grad(), loss.teacher_targets():
        teacher(ids)
    flags = [p.requires_grad for p in student.parameters()]
    with loss.active(), training_only(student, loss.parameters()):
        out = student(ids)
    assert not out.logits.requires_grad and out[INDEX_LOSS].requires_grad
    assert [p.requires_grad for p in student.parameters()] == flags  # restored on exit
    out[INDEX_LOSS].backward()
    assert all(p.grad is None for n, p in student.named_parameters() if ".indexer." not in n)
    loss.remove()
    assert INDEX_LOSS not in student(ids)  # no hooks left


def test_indexer_steps_train_only_the_indexers_and_lower_their_kl(work):
    out = work / "out-indexer"
    sets = recipe_sets(work, "csa2", "steps=5", "loss.indexer_steps=4", "eval.every=4", "save.every=4")
    report = run_recipe(load_recipe(None, sets), out, log=lambda m: None)
    assert report["steps"] == 5
    logged = {h["step"]: h for h in report["history"] if "loss" in h}
    for step in (1, 2, 3, 4):  # the loss of the indexer steps is the indexer loss itself
        assert logged[step]["loss"] == pytest.approx(logged[step]["index_kl"], rel=1e-5)
    assert "index_kl" not in logged[5]  # indexer_weight 0: distillation alone afterwards
    start = load_source(work / "csa2").model
    start_state = start.state_dict()
    after_phase = load_file(str(out / "checkpoints" / "checkpoint-4" / "adapter_model.safetensors"))
    lora_b = [v for k, v in after_phase.items() if "lora_B" in k]
    assert lora_b and all(float(v.abs().max()) == 0 for v in lora_b)  # LoRA has not moved (B starts at 0)
    moved = set()
    for key, value in after_phase.items():
        name = key.removeprefix("base_model.model.")
        if name in start_state and not torch.equal(value, start_state[name]):
            moved.add(name)
    assert moved and all(".indexer." in n for n in moved), moved
    assert any(".sinks" in k or "kv_a_proj" in k for k in after_phase)  # other surgery tensors are there, unmoved
    final = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    assert any(float(v.abs().max()) > 0 for k, v in final.items() if "lora_B" in k)  # step 5 distils

    ids = windows(work, n=4, text="other.txt")  # text the run did not train on
    teacher = dense_teacher(load_source(work / "src").model)
    trained = PeftModel.from_pretrained(load_source(work / "csa2").model, out / "checkpoints" / "checkpoint-4")
    before = index_loss(start, teacher, ids)
    after = index_loss(trained, teacher, ids)
    assert after < 0.9 * before, (float(before), float(after))  # training-free indexers (no warm-up in convert)


def test_the_schedule_starts_after_the_indexer_steps_and_indexers_get_their_own_rate(work, tmp_path):
    student = load_source(work / "csa2").model
    teacher = load_source(work / "src").model
    recipe = load_recipe(None, recipe_sets(work, "csa2", "steps=12", "loss.indexer_steps=4", "schedule.kind=cosine",
                                           "schedule.warmup_steps=3", "optim.indexer_lr=0.01"))
    model, _ = prepare_student(student, teacher, recipe)
    dense = dense_teacher(teacher)
    trainer = DistillationTrainer(model=model, args=training_arguments(recipe, tmp_path), teacher=dense,
                                  eval_dataset=datasets.Dataset.from_dict({"input_ids": [[1, 2]]}),
                                  held_out={}, indexer=IndexerLoss(model, dense), indexer_steps=4,
                                  indexer_lr=0.01, evaluate_at_start=False)
    trainer.create_optimizer_and_scheduler(num_training_steps=12)
    groups = trainer.optimizer.param_groups
    indexer_ids = {id(p) for p in trainer.indexer.parameters()}
    mine = [g for g in groups if any(id(p) in indexer_ids for p in g["params"])]
    assert mine and all(g["lr"] == 0.01 and all(id(p) in indexer_ids for p in g["params"]) for g in mine)
    assert sum(len(g["params"]) for g in mine) == len(indexer_ids)
    assert all(g["lr"] == 3.0e-3 for g in groups if g not in mine) and len(groups) > len(mine)
    # transformers' own cosine-with-warm-up over the 8 distillation steps is the reference
    probe = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    reference = get_cosine_schedule_with_warmup(probe, num_warmup_steps=3, num_training_steps=8)
    expected = []
    for _ in range(8):
        expected.append(probe.param_groups[0]["lr"])
        probe.step()
        reference.step()
    got = [trainer.lr_scheduler.lr_lambdas[0](step) for step in range(12)]
    assert got[:4] == [1.0] * 4  # constant through the indexer steps
    assert got[4:] == pytest.approx(expected) and got[4] == 0.0  # warm-up starts again


@pytest.mark.parametrize("student, extra, words", [
    ("mqa", [], "need a CSA2 student with full or reindex layers"),
    ("csa2", ["data.seq_len=10"], f"use data.seq_len >= {WINDOW + SINKS + 1}"),
    ("csa2", ["peft.train_surgery_parameters=false"], "which this recipe freezes"),
])
def test_recipes_that_cannot_train_an_indexer_are_refused(work, tmp_path, capsys, student, extra, words):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("student: x\n")
    args = [a for s in recipe_sets(work, student, "steps=3", "loss.indexer_steps=2", *extra) for a in ("--set", s)]
    before = tree_digest(work / student)
    assert cli_main(["train", str(recipe), *args, "--out", str(tmp_path / "out")]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and words in errors[0], errors
    assert not (tmp_path / "out").exists() and tree_digest(work / student) == before


def test_indexer_steps_come_before_the_last_step(work):
    with pytest.raises(RecipeError, match=r"loss.indexer_steps=3 must be less than recipe.steps=3"):
        load_recipe(None, [f"student={work / 'csa2'}", "steps=3", "loss.indexer_steps=3"])


@pytest.mark.slow
def test_two_processes_match_one_with_indexer_steps(work, tmp_path):
    """torchrun with 2 CPU processes (gloo) x batch 2 against 1 process x batch 4, through both
    stages: the indexer steps (only the indexers take part) and distillation with the indexer loss."""
    sets = recipe_sets(work, "csa2", "steps=4", "loss.indexer_steps=2", "loss.indexer_weight=0.5",
                       "eval.every=4", "save.every=4")
    args = [a for s in sets for a in ("--set", s)]
    recipe = tmp_path / "r.yaml"
    recipe.write_text("student: x\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = [sys.executable, "-m", "hf_csa2", "train", str(recipe), *args]
    subprocess.run(run + ["--set", "batch=4", "--out", str(tmp_path / "one")], check=True, env=env,
                   capture_output=True, timeout=600)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29519",
                    "-m", "hf_csa2", "train", str(recipe), *args, "--set", "batch=2", "--out", str(tmp_path / "two")],
                   check=True, env=env, capture_output=True, timeout=600)

    def losses(folder):
        history = json.loads((folder / "training_report.json").read_text())["history"]
        return {h["step"]: h["loss"] for h in history if "loss" in h}

    a, b = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-4), (step, a, b)
