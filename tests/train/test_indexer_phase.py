"""The CSA2 indexer loss in training (DSA stage 1 / 2): its value is the KL of each indexer's
distribution to the teacher's head-summed dense attention over the positions it may pick, its
gradient reaches the indexers only, the indexer steps of a recipe train nothing else and lower
that KL, two processes agree with one, and a student without indexers is refused."""

import json
import os
import subprocess
import sys

import pytest
import torch
from folders import tree_digest
from peft import PeftModel
from safetensors.torch import load_file
from tiny_models import save_tiny_source
from transformers import AutoModelForCausalLM

from hf_csa2.cli import main as cli_main
from hf_csa2.data.windows import token_windows
from hf_csa2.engine.trainer import INDEX_LOSS
from hf_csa2.io.sources import load_source
from hf_csa2.surgery.pipeline import convert
from hf_csa2.train.indexer_phase import IndexerLoss, dense_teacher
from hf_csa2.train.recipe import RecipeError, load_recipe
from hf_csa2.train.run import run_recipe

TEXT = " ".join(f"Record {i}: the valve {i * 5 % 17} opens when gauge {i * 3 % 7} reads {i * 11 % 23} units."
                for i in range(400))
MODES = ["full", "reuse", "reindex", "reuse"]
WINDOW = 8


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A tiny Llama source, its text, a CSA2 student (full, reuse, reindex, reuse) and an MQA one."""
    root = tmp_path_factory.mktemp("indexer")
    (root / "text.txt").write_text(TEXT)
    save_tiny_source("llama", root / "src", num_layers=4)
    calib = {"text": str(root / "text.txt"), "num_tokens": 256, "seq_len": 64, "eval_windows": 2}
    convert(str(root / "src"), {"mla": {"kv_lora_rank": 8, "qk_rope_head_dim": 4},
                                "csa2": {"layers": MODES, "window": WINDOW, "top_k": 8, "indexer_warmup_steps": 0},
                                "calibration": calib},
            out_dir=root / "csa2", log=lambda m: None)
    convert(str(root / "src"), {"gqa": {"num_key_value_heads": 1}, "calibration": calib}, out_dir=root / "mqa",
            log=lambda m: None)
    return root


def windows(work, n=2, t=64):
    return token_windows(load_source(work / "src").tokenizer, work / "text.txt", t, n)


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
        selectable = pos[None, :] <= pos[:, None] - WINDOW
        layers = student.model.layers
        pe = student.model.rotary_emb(hidden[0], pos[None])
        x = {i: layers[i].input_layernorm(hidden[i]) for i in (0, 2)}
        keys = layers[0].self_attn.indexer.keys(x[0], pe)
        terms = []
        for i in (0, 2):  # the full layer and the reindex layer (reading layer 0's index keys)
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


def test_indexer_steps_train_only_the_indexers_and_lower_their_kl(work):
    out = work / "out-indexer"
    sets = recipe_sets(work, "csa2", "steps=5", "loss.indexer_steps=4", "eval.every=4", "save.every=4")
    report = run_recipe(load_recipe(None, sets), out, log=lambda m: None)
    assert report["steps"] == 5
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

    ids = windows(work, n=4)
    teacher = dense_teacher(load_source(work / "src").model)
    trained = PeftModel.from_pretrained(load_source(work / "csa2").model, out / "checkpoints" / "checkpoint-4")
    before = index_loss(start, teacher, ids)
    after = index_loss(trained, teacher, ids)
    assert after < 0.9 * before, (float(before), float(after))  # training-free indexers (no warm-up in convert)


def test_indexer_steps_need_indexers_and_come_before_the_last_step(work, tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("student: x\n")
    args = [a for s in recipe_sets(work, "mqa", "steps=3", "loss.indexer_steps=2") for a in ("--set", s)]
    before = tree_digest(work / "mqa")
    assert cli_main(["train", str(recipe), *args, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "need a CSA2 student with full or reindex layers" in err and "has none" in err
    assert not (tmp_path / "out").exists() and tree_digest(work / "mqa") == before
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
