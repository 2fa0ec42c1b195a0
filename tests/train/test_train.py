"""hf-csa2 train on tiny checkpoints: losses, which parameters train, outputs (adapter, merged,
report), resume to the same losses, two processes vs one, bad recipes refused before anything
is written."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import torch
from peft import PeftModel
from folders import tree_digest
from tiny_models import save_tiny_source, tiny_tokenizer
from torch.nn import functional as F
from transformers import AutoModelForCausalLM

import hf_csa2  # noqa: F401  (registers the hf_csa2 model type)
from hf_csa2.cli import main as cli_main
from hf_csa2.evals.round_trip import reload_without_hf_csa2
from hf_csa2.io.sources import load_source
from hf_csa2.surgery.pipeline import convert
from hf_csa2.train.recipe import load_recipe
from hf_csa2.train.run import run_recipe
from hf_csa2.engine.trainer import distillation_loss
from hf_csa2.train.trainer import surgery_parameter_names

TEXT = " ".join(f"Entry {i}: the parser reads token {i * 7 % 13} and writes value {i * 3 % 11} to the buffer."
                for i in range(400))


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A tiny Llama source, its text, and two students: MQA (saved as a native Llama) and
    MLA + sinks (an hf_csa2 checkpoint)."""
    root = tmp_path_factory.mktemp("train")
    (root / "text.txt").write_text(TEXT)
    save_tiny_source("llama", root / "src")
    calib = {"text": str(root / "text.txt"), "num_tokens": 256, "seq_len": 64, "eval_windows": 2}
    convert(str(root / "src"), {"gqa": {"num_key_value_heads": 1}, "calibration": calib}, out_dir=root / "mqa",
            log=lambda m: None)
    convert(str(root / "src"), {"mla": {"kv_lora_rank": 8, "qk_rope_head_dim": 4}, "sinks": {}, "calibration": calib},
            out_dir=root / "mla", log=lambda m: None)
    return root


def recipe_sets(work: Path, student: str, *extra: str) -> list[str]:
    text = work / "text.txt"
    return [f"student={work / student}", f"data.text={text}", "data.seq_len=64", f"eval.texts=[{text}]",
            "eval.seq_len=64", "eval.windows=2", "eval.every=3", "save.every=3", "steps=6", "batch=2",
            "log_every=1", "optim.lr=3.0e-3", *extra]


def losses(report_or_history) -> dict[int, float]:
    history = report_or_history["history"] if isinstance(report_or_history, dict) else report_or_history
    return {h["step"]: h["loss"] for h in history if "loss" in h}


def evals(history, metric: str = "kl") -> list[float]:
    return [h[f"eval_text_{metric}"] for h in history if f"eval_text_{metric}" in h]


# -- the loss ---------------------------------------------------------------------------

def test_distillation_loss_matches_its_definition():
    torch.manual_seed(0)
    s, t = torch.randn(2, 5, 11), torch.randn(2, 5, 11)
    ids = torch.randint(0, 11, (2, 5))
    p_t = F.softmax(t[:, :-1] / 2.0, -1)
    kl = (p_t * (p_t.log() - F.log_softmax(s[:, :-1] / 2.0, -1))).sum(-1).mean() * 4.0
    torch.testing.assert_close(distillation_loss(s, t, ids, "kd", temperature=2.0), kl)
    ce = F.cross_entropy(s[:, :-1].reshape(-1, 11), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(distillation_loss(s, None, ids, "lm"), ce)
    mixed = distillation_loss(s, t, ids, "kd+lm", lm_weight=0.25)
    kd1 = distillation_loss(s, t, ids, "kd")
    torch.testing.assert_close(mixed, 0.75 * kd1 + 0.25 * ce)
    assert distillation_loss(t, t, ids, "kd").abs() < 1e-6 < kl


def test_distillation_loss_on_chosen_positions_is_the_loss_there():
    """positions: logits taken at those positions only; the same terms as the full loss restricted to
    them, and all positions 0..T-2 give the full loss."""
    torch.manual_seed(1)
    s, t = torch.randn(2, 9, 13), torch.randn(2, 9, 13)
    ids = torch.randint(0, 13, (2, 9))
    idx = torch.tensor([0, 3, 4, 7])
    p_t = F.softmax(t[:, idx], -1)
    kl = (p_t * (p_t.log() - F.log_softmax(s[:, idx], -1))).sum(-1).mean()
    ce = F.cross_entropy(s[:, idx].reshape(-1, 13), ids[:, idx + 1].reshape(-1))
    torch.testing.assert_close(distillation_loss(s[:, idx], t[:, idx], ids, "kd", positions=idx), kl)
    torch.testing.assert_close(distillation_loss(s[:, idx], None, ids, "lm", positions=idx), ce)
    every = torch.arange(8)
    for kind in ("kd", "lm", "kd+lm"):
        torch.testing.assert_close(distillation_loss(s[:, every], t[:, every], ids, kind, positions=every),
                                   distillation_loss(s, t, ids, kind))


def test_weighted_loss_is_the_weighted_mean_of_the_per_token_terms():
    """weights: ones give the plain loss; weight only on one prediction gives that prediction's loss;
    answer_weights puts the weight on predictions OF answer tokens (the mask shifted by one)."""
    from hf_csa2.engine.trainer import answer_weights

    torch.manual_seed(2)
    s, t = torch.randn(2, 6, 7), torch.randn(2, 6, 7)
    ids = torch.randint(0, 7, (2, 6))
    for kind in ("kd", "lm", "kd+lm"):
        torch.testing.assert_close(distillation_loss(s, t, ids, kind, weights=torch.ones(2, 5)),
                                   distillation_loss(s, t, ids, kind))
        one = torch.zeros(2, 5)
        one[1, 3] = 2.5
        torch.testing.assert_close(distillation_loss(s, t, ids, kind, weights=one),
                                   distillation_loss(s[1:, 3:5], t[1:, 3:5], ids[1:, 3:5], kind))
    mask = torch.tensor([[0, 0, 1, 1, 0, 0], [1, 0, 0, 0, 0, 1]])
    assert answer_weights(mask, 4.0).tolist() == [[1, 4, 4, 1, 1], [1, 1, 1, 1, 4]]
    assert answer_weights(mask, 4.0, torch.tensor([0, 4])).tolist() == [[1, 1], [1, 4]]
    p_t = F.softmax(t[:, :-1], -1)
    per_token = (p_t * (p_t.log() - F.log_softmax(s[:, :-1], -1))).sum(-1)
    w = answer_weights(mask, 4.0)
    torch.testing.assert_close(distillation_loss(s, t, ids, "kd", weights=w), (per_token * w).sum() / w.sum())


def test_answer_weight_weighs_the_loss_on_the_answer_tokens_of_each_batch(work, tmp_path):
    """loss.answer_weight: compute_loss reads the batch's answer_mask and weighs the predictions of
    answer tokens that many times the others."""
    from hf_csa2.engine.trainer import DistillationTrainer, answer_weights
    from hf_csa2.train.trainer import prepare_student, training_arguments

    recipe = load_recipe(None, recipe_sets(work, "mla", "loss.answer_weight=5.0"))
    teacher = load_source(work / "src").model
    model, _ = prepare_student(load_source(work / "mla").model, teacher, recipe)
    trainer = DistillationTrainer(model=model, args=training_arguments(recipe, tmp_path), teacher=teacher,
                                  eval_dataset=datasets.Dataset.from_dict({"input_ids": [[1, 2]]}), held_out={},
                                  answer_weight=recipe.loss.answer_weight, evaluate_at_start=False)
    ids = torch.randint(4, 100, (2, 64))
    mask = torch.zeros(2, 64, dtype=torch.long)
    mask[:, 40:52] = 1
    loss = trainer.compute_loss(model, {"input_ids": ids, "answer_mask": mask})
    with torch.no_grad():
        s, t = model(input_ids=ids).logits, teacher(input_ids=ids).logits
    torch.testing.assert_close(loss.detach(), distillation_loss(s, t, ids, "kd", weights=answer_weights(mask, 5.0)))
    assert abs(loss.item() - distillation_loss(s, t, ids, "kd").item()) > 1e-4


def test_last_answer_start_is_the_last_run_with_something_before_it():
    from hf_csa2.engine.trainer import last_answer_start

    assert last_answer_start(torch.tensor([0, 0, 1, 1, 0, 1, 1, 1])) == 5
    assert last_answer_start(torch.tensor([1, 1, 0, 0, 1, 0])) == 4
    assert last_answer_start(torch.tensor([1, 1, 0, 0])) is None  # the tail of an exchange of the block before
    assert last_answer_start(torch.zeros(6, dtype=torch.long)) is None


def test_on_policy_scores_the_students_own_greedy_answer_against_the_teacher(work, tmp_path):
    """loss.on_policy: each block is cut before its last answer, the student writes the answer
    greedily, and the loss is KL(teacher || student) on those written tokens alone, mean over blocks;
    blocks without an answer fall back to the usual loss."""
    from hf_csa2.engine.trainer import DistillationTrainer, token_kl
    from hf_csa2.train.trainer import prepare_student, training_arguments

    recipe = load_recipe(None, recipe_sets(work, "mla", "loss.on_policy=1.0", "loss.on_policy_tokens=5"))
    teacher = load_source(work / "src").model
    model, _ = prepare_student(load_source(work / "mla").model, teacher, recipe)
    model.get_base_model().generation_config.eos_token_id = None  # random weights: no early stop, 5 tokens each
    trainer = DistillationTrainer(model=model, args=training_arguments(recipe, tmp_path), teacher=teacher,
                                  eval_dataset=datasets.Dataset.from_dict({"input_ids": [[1, 2]]}), held_out={},
                                  on_policy=recipe.loss.on_policy, on_policy_tokens=recipe.loss.on_policy_tokens,
                                  evaluate_at_start=False)
    torch.manual_seed(3)
    ids = torch.randint(4, 100, (2, 64))
    mask = torch.zeros(2, 64, dtype=torch.long)
    mask[0, 30:40], mask[1, 50:64] = 1, 1
    loss = trainer.compute_loss(model, {"input_ids": ids, "answer_mask": mask})
    expect = []
    with torch.no_grad():
        for row, start in ((ids[0], 30), (ids[1], 50)):
            seq = row[:start]
            for _ in range(5):  # greedy, one token at a time, without a cache
                seq = torch.cat([seq, model(input_ids=seq[None]).logits[0, -1].argmax()[None]])
            s, t = model(input_ids=seq[None]).logits, teacher(input_ids=seq[None]).logits
            expect.append(token_kl(t[:, start - 1:-1], s[:, start - 1:-1]))
            assert not torch.equal(seq[start:], row[start:start + 5])  # it scored its own tokens, not the block's
    torch.testing.assert_close(loss.detach(), torch.stack(expect).mean(), rtol=1e-4, atol=1e-6)
    assert loss.requires_grad
    trainer.log({"loss": 1.0})  # the training log line carries the on-policy loss since the last one
    assert trainer.state.log_history[-1]["on_policy_kl"] == pytest.approx(loss.item())
    no_answer = trainer.compute_loss(model, {"input_ids": ids, "answer_mask": torch.zeros_like(mask)})
    with torch.no_grad():
        plain = distillation_loss(model(input_ids=ids).logits, teacher(input_ids=ids).logits, ids, "kd")
    torch.testing.assert_close(no_answer.detach(), plain)


def test_loss_positions_score_a_fresh_draw_of_positions_with_logits_there_only(work, tmp_path):
    """loss.positions: teacher and student compute logits at N positions of each block (sorted,
    distinct, each predicting a token of the block), drawn anew for each micro-batch."""
    from hf_csa2.engine.trainer import DistillationTrainer
    from hf_csa2.train.trainer import prepare_student, training_arguments

    recipe = load_recipe(None, recipe_sets(work, "mla", "loss.positions=8"))
    teacher = load_source(work / "src").model
    model, _ = prepare_student(load_source(work / "mla").model, teacher, recipe)
    trainer = DistillationTrainer(model=model, args=training_arguments(recipe, tmp_path), teacher=teacher,
                                  eval_dataset=datasets.Dataset.from_dict({"input_ids": [[1, 2]]}),
                                  held_out={}, positions=recipe.loss.positions, evaluate_at_start=False)
    seen = {}
    for name, m in (("teacher", teacher), ("student", model.get_base_model())):
        m.lm_head.register_forward_hook(lambda mod, args, out, name=name: seen.setdefault(name, []).append(out.shape))
    ids = torch.randint(4, 100, (2, 64))
    draws = [trainer.scored_positions(64, "cpu") for _ in range(2)]
    for d in draws:
        assert len(d) == 8 == len(set(d.tolist())) and torch.equal(d, d.sort().values) and int(d.max()) < 63
    assert not torch.equal(draws[0], draws[1])
    torch.manual_seed(5)
    loss = trainer.compute_loss(model, {"input_ids": ids})
    torch.manual_seed(5)
    idx = trainer.scored_positions(64, "cpu")
    assert seen["teacher"][-1][:2] == seen["student"][-1][:2] == (2, 8)
    with torch.no_grad():
        expect = distillation_loss(model(input_ids=ids).logits[:, idx], teacher(input_ids=ids).logits[:, idx], ids, "kd",
                                   positions=idx)
    torch.testing.assert_close(loss.detach(), expect)


def test_peft_layers_restrict_lora_to_those_layers(work, tmp_path):
    report = run_recipe(load_recipe(None, recipe_sets(work, "mla", "steps=2", "peft.layers=[1]", "loss.positions=16")),
                        tmp_path / "out", log=lambda m: None)
    from safetensors.torch import load_file

    lora = [k for k in load_file(str(tmp_path / "out" / "adapter" / "adapter_model.safetensors")) if "lora_" in k]
    assert lora and all(".layers.1." in k for k in lora), lora
    assert sorted(losses(report)) == [1, 2]
    with pytest.raises(Exception, match=r"peft.layers=\[5\]: the student has 2 decoder layers"):
        run_recipe(load_recipe(None, recipe_sets(work, "mla", "peft.layers=[5]")), tmp_path / "out5", log=lambda m: None)
    assert not (tmp_path / "out5").exists()


def test_surgery_parameters_are_the_created_or_reshaped_ones(work):
    teacher = load_source(work / "src").model
    mqa = surgery_parameter_names(load_source(work / "mqa").model, teacher)
    assert mqa == [f"model.layers.{i}.self_attn.{p}_proj.weight" for i in range(2) for p in ("k", "v")]
    mla = set(surgery_parameter_names(load_source(work / "mla").model, teacher))
    assert {"model.layers.0.self_attn.sinks", "model.layers.1.self_attn.kv_a_proj.weight"} <= mla
    assert not any("q_proj" in n or "o_proj" in n or "mlp" in n for n in mla)


# -- end to end -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def trained(work):
    """The MLA student trained with LoRA (6 steps); its out folder and report."""
    before = tree_digest(work / "mla")
    report = run_recipe(load_recipe(None, recipe_sets(work, "mla")), work / "out-mla", log=lambda m: None)
    assert tree_digest(work / "mla") == before, "the student folder must not change"
    return work / "out-mla", report


def test_training_moves_the_student_toward_the_teacher(trained):
    _, report = trained
    kl = evals(report["history"])
    assert len(kl) == len(evals(report["history"], "ppl_ratio")) == 3  # steps 0, 3, 6
    assert kl[2] < kl[1] < kl[0] and kl[2] < 0.95 * kl[0], kl  # held-out KL to the teacher falls
    assert report["tokens_seen"] == 6 * 2 * 64 and report["steps"] == 6


def test_adapter_and_merged_outputs_reproduce_the_trained_model(trained, work, tmp_path):
    out, report = trained
    x = torch.randint(4, 100, (1, 24))
    merged = AutoModelForCausalLM.from_pretrained(out / "merged").eval()
    student = load_source(work / "mla").model
    with_adapter = PeftModel.from_pretrained(student, out / "adapter").eval()
    assert any(n.endswith("sinks") for n in report["full_parameters"]), "sinks are surgery parameters: trained in full"
    full = [n for n in report["full_parameters"] if n.endswith("kv_a_proj.weight")]
    with torch.no_grad():
        original = load_source(work / "mla").model(x).logits
        torch.testing.assert_close(with_adapter(x).logits, merged(x).logits, atol=1e-5, rtol=1e-5)
        assert (merged(x).logits - original).abs().max() > 1e-3
        # the full parameters came back from the adapter file, not from the student folder
        trained_sinks = with_adapter.get_base_model().get_parameter(full[0])
        assert not torch.equal(trained_sinks, load_source(work / "mla").model.get_parameter(full[0]))
    got = reload_without_hf_csa2(out / "merged", x, tmp_path)
    torch.testing.assert_close(got["logits"], merged(x).logits, atol=1e-5, rtol=1e-5)
    assert (out / "curves.png").stat().st_size > 0
    saved = json.loads((out / "training_report.json").read_text())
    assert saved["steps"] == 6 and losses(saved) == losses(report)


def test_native_student_stays_native_and_full_training_works(work):
    report = run_recipe(load_recipe(None, recipe_sets(work, "mqa", "peft=null", "steps=3")), work / "out-mqa",
                        log=lambda m: None)
    config = json.loads((work / "out-mqa" / "merged" / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_key_value_heads"] == 1 and "auto_map" not in config
    assert not (work / "out-mqa" / "adapter").exists()
    merged = AutoModelForCausalLM.from_pretrained(work / "out-mqa" / "merged")
    student = load_source(work / "mqa").model
    changed = {n for n, p in merged.named_parameters() if not torch.equal(p, student.get_parameter(n))}
    assert changed and all(".self_attn." in n for n in changed)  # trainable: attention (the default)
    assert len(losses(report)) == 3


def test_answer_check_at_every_evaluation(work, tmp_path):
    """eval.answers: the answer check on probes cut from the held-out text, logged at each evaluation;
    the last one equals the check run by hand on the merged model, the teacher's is in the report."""
    from hf_csa2.data.windows import token_windows
    from hf_csa2.metrics.answer_check import answer_check, make_probes

    sets = recipe_sets(work, "mla", "steps=3", "eval.answers=2", "eval.seq_len=160")
    report = run_recipe(load_recipe(None, sets), tmp_path / "out", log=lambda m: None)
    logged = [(h["step"], h["eval_text_answers_far"], h["eval_text_answers_near"], h["eval_text_answer_nll"])
              for h in report["history"] if "eval_text_answers_far" in h]
    assert [row[0] for row in logged] == [0, 3] and logged[0][3] != logged[1][3]
    tok = load_source(work / "src").tokenizer
    probes = make_probes(tok, token_windows(tok, work / "text.txt", 160, 2), 2)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "merged", trust_remote_code=True)
    check = answer_check(merged, probes)
    assert logged[-1][1:3] == (check.far, check.near)
    assert logged[-1][3] == pytest.approx(check.answer_nll, rel=1e-5)  # the trained model's answers were scored
    assert report["teacher_answers"]["text"] == answer_check(load_source(work / "src").model, probes).to_dict()


def test_resume_continues_to_the_same_losses(trained, work):
    out, report = trained
    resumed = work / "out-resumed"
    shutil.copytree(out, resumed)
    shutil.rmtree(resumed / "checkpoints" / "checkpoint-6")
    again = run_recipe(load_recipe(None, recipe_sets(work, "mla")), resumed, resume=True, log=lambda m: None)
    first, second = losses(report), losses(again)
    assert sorted(second) == [1, 2, 3, 4, 5, 6] and again["resumed_from"].endswith("checkpoint-3")
    for step in (4, 5, 6):
        assert second[step] == pytest.approx(first[step], rel=1e-6, abs=1e-7), (step, first, second)


@pytest.mark.slow
def test_two_processes_match_one_at_the_same_global_batch(work, tmp_path):
    """torchrun with 2 CPU processes (gloo) x batch 2 against 1 process x batch 4."""
    base = recipe_sets(work, "mla", "steps=4", "eval.every=4", "save.every=4")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = tmp_path / "one"
    two = tmp_path / "two"
    run = [sys.executable, "-m", "hf_csa2", "train"]
    args = [a for s in base for a in ("--set", s)]
    recipe = tmp_path / "r.yaml"
    recipe.write_text("student: x\n")
    subprocess.run(run + [str(recipe), *args, "--set", "batch=4", "--out", str(one)], check=True, env=env,
                   capture_output=True, timeout=600)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29517",
                    "-m", "hf_csa2", "train", str(recipe), *args, "--set", "batch=2", "--out", str(two)],
                   check=True, env=env, capture_output=True, timeout=600)
    a = losses(json.loads((one / "training_report.json").read_text()))
    b = json.loads((two / "training_report.json").read_text())
    assert b["world_size"] == 2 and b["tokens_seen"] == 4 * 4 * 64
    b = losses(b)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-4), (step, a, b)


# -- bad input ---------------------------------------------------------------------------

def test_bad_recipes_exit_2_and_write_nothing(work, tmp_path, capsys):
    other = tmp_path / "other-tokenizer"
    save_tiny_source("llama", other)
    tok = tiny_tokenizer()
    tok.add_tokens(["<extra>"])
    tok.save_pretrained(other)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"student: {work / 'mla'}\n")
    cases = [
        (["--set", "optim.lrr=1"], "unknown key 'lrr' in optim"),
        (["--set", "steps=many"], "steps='many'"),
        (["--set", f"student={tmp_path / 'missing'}"], "missing"),
        (["--set", f"teacher={other}", "--set", f"data.text={work / 'text.txt'}",
          "--set", f"eval.texts=[{work / 'text.txt'}]"], "another tokenizer"),
        (["--resume"], "holds no checkpoint"),
        (["--set", f"data.text={work / 'text.txt'}", "--set", f"eval.texts=[{work / 'text.txt'}]",
          "--set", "eval.answers=2", "--set", "eval.seq_len=64"], "eval.answers=2 with eval.seq_len=64"),
        (["--set", f"data.text={work / 'text.txt'}", "--set", f"eval.texts=[{work / 'text.txt'}]",
          "--set", "data.answers=teacher"], "data.answers=teacher writes the assistant turns"),  # no chat template
    ]
    before = tree_digest(work / "mla")
    capsys.readouterr()  # the fixtures' progress output
    for extra, words in cases:
        out = tmp_path / "out"
        code = cli_main(["train", str(recipe), "--out", str(out), *extra])
        errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line.lower()]
        assert code == 2 and len(errors) == 1 and errors[0].startswith("hf-csa2: error: ") and words in errors[0], \
            (extra, errors)
        assert not out.exists(), extra
    assert tree_digest(work / "mla") == before


def test_existing_output_needs_overwrite(work, tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"student: {work / 'mla'}\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    capsys.readouterr()
    assert cli_main(["train", str(recipe), "--out", str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err and (out / "keep.txt").read_text() == "mine"


def test_training_blocks_pack_text_and_chat_with_the_template(work, tmp_path):
    from hf_csa2.train.data import training_blocks
    from hf_csa2.train.recipe import DataSpec

    tok = tiny_tokenizer()
    text = work / "text.txt"
    blocks = training_blocks(DataSpec(text=str(text), seq_len=64, format="text"), tok)
    ids = tok(TEXT, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert len(blocks) == len(ids) // 64
    assert blocks[3]["input_ids"].tolist() == ids[3 * 64:4 * 64]
    assert len(training_blocks(DataSpec(text=str(text), seq_len=64, format="text", num_tokens=640), tok)) == 10
    tok.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    (tmp_path / "doc.txt").write_text("\n\n".join(f"Paragraph {i} " + "text " * 30 for i in range(10)))
    chat = training_blocks(DataSpec(text=str(tmp_path / "doc.txt"), seq_len=32, format="auto"), tok)
    decoded = tok.decode(torch.cat([b["input_ids"] for b in chat]).tolist())
    assert decoded.startswith("<user>Continue this text.") and "<assistant>" in decoded


def test_several_texts_are_mixed_block_by_block_each_block_once(tmp_path):
    from hf_csa2.train.data import training_blocks
    from hf_csa2.train.recipe import DataSpec

    tok = tiny_tokenizer()
    (tmp_path / "a.txt").write_text("x " * 800)
    (tmp_path / "b.txt").write_text("y " * 300)
    spec = dict(text=[str(tmp_path / "a.txt"), str(tmp_path / "b.txt")], seq_len=32, format="text")
    alone = [len(training_blocks(DataSpec(**dict(spec, text=[t])), tok)) for t in spec["text"]]
    mixed = training_blocks(DataSpec(**spec), tok)
    first = [tok.decode(b["input_ids"].tolist()).split()[0] for b in mixed]  # every block one letter throughout
    assert len(mixed) == sum(alone) and alone[0] > alone[1] > 2
    assert first[:2 * alone[1]] == ["x", "y"] * alone[1]          # in turn while both last
    assert first[2 * alone[1]:] == ["x"] * (alone[0] - alone[1])     # then the rest, none repeated
    capped = training_blocks(DataSpec(**spec, num_tokens=4 * 32), tok)
    assert [tok.decode(b["input_ids"].tolist()).split()[0] for b in capped] == ["x", "y"] * 2


def test_copy_tasks_in_both_formats_and_not_on_chat_records(work, tmp_path):
    from hf_csa2.train.data import training_blocks, write_chat_jsonl
    from hf_csa2.train.recipe import DataSpec, RecipeError

    tok = tiny_tokenizer()
    doc = tmp_path / "doc.txt"
    doc.write_text("\n\n".join(f"Paragraph {i} begins here with some words. Then it ends." for i in range(40)))
    # no chat template: auto resolves to text, and the copy task becomes a completion of the passage
    text = training_blocks(DataSpec(text=str(doc), seq_len=32, format="auto", tasks=["recall"], passage_chars=200), tok)
    decoded = tok.decode(torch.cat([b["input_ids"] for b in text]).tolist())
    assert "user:" not in decoded and 'begins with "Paragraph' in decoded
    chat = training_blocks(DataSpec(text=str(doc), seq_len=32, format="chat", tasks=["recall"], passage_chars=200), tok)
    decoded = tok.decode(torch.cat([b["input_ids"] for b in chat]).tolist())
    assert "user: Paragraph" in decoded and 'that begins with "Paragraph' in decoded
    records = write_chat_jsonl([[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]] * 50,
                               tmp_path / "chat.jsonl")
    with pytest.raises(RecipeError, match=r"data.tasks=\['continue', 'next'\].*holds chat records.*data.tasks: \[continue\]"):
        training_blocks(DataSpec(text=str(records), seq_len=8, tasks=["continue", "next"]), tok)


def _answer_text(tok, block) -> str:
    return tok.decode([i for i, m in zip(block["input_ids"].tolist(), block["answer_mask"].tolist()) if m])


def test_answer_masks_mark_the_assistant_turns_and_the_copied_sentences(tmp_path):
    """training_blocks(answers=True): the same input_ids as without, and answer_mask 1 exactly on each
    exchange's assistant turn from its content to the record's end (EOS), or on a copy-task
    document's sentence; data without answers is refused by name."""
    from hf_csa2.train.data import passages_to_chat, passages_to_completions, training_blocks
    from hf_csa2.train.recipe import DataSpec, RecipeError

    tok = tiny_tokenizer()
    doc = tmp_path / "doc.txt"
    text = "\n\n".join(f"Paragraph {i} begins here with some words. Then it ends." for i in range(120))
    doc.write_text(text)
    # a template that trims the content, as Gemma's does: the answer is still found
    tok.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}{% endfor %}"
    spec = DataSpec(text=str(doc), seq_len=1024, format="chat", tasks=["continue", "recall"], passage_chars=200)
    plain, marked = training_blocks(spec, tok), training_blocks(spec, tok, answers=True)
    assert torch.equal(plain[:]["input_ids"], marked[:]["input_ids"]) and "answer_mask" not in plain.column_names
    exchanges = passages_to_chat(text, 200, 0, ("continue", "recall"))
    expected = "".join(e[-1]["content"].strip() + "</s>" for e in exchanges)
    got = _answer_text(tok, marked[0])
    assert expected.startswith(got) and got.count("</s>") >= 2
    docs = passages_to_completions(text, 200, 0, ("recall",))
    spec = DataSpec(text=str(doc), seq_len=1024, format="text", tasks=["recall"], passage_chars=200)
    sentences = [d.rsplit(": ", 1)[1] for d in docs]  # the lead-in ends with ': ', then the sentence
    got = _answer_text(tok, training_blocks(spec, tok, answers=True)[0])
    assert "".join(x + "</s>" for x in sentences).startswith(got) and got.count("</s>") >= 2
    with pytest.raises(RecipeError, match=r"loss.answer_weight: data.text=.*has no answer tokens.*answer_weight: 1.0"):
        training_blocks(DataSpec(text=str(doc), seq_len=64, format="text"), tok, answers=True)


def test_an_exportable_mla_student_stays_exportable(work, tmp_path):
    """A DeepSeek-V3-exportable MLA student (shared rope key, normalised latent, one rope table)
    trained with LoRA merges into a checkpoint that still exports to stock DeepseekV3, with the
    merged model's logits."""
    from hf_csa2.export.deepseek_v3 import export_problems, to_deepseek_v3

    calib = {"text": str(work / "text.txt"), "num_tokens": 256, "seq_len": 64, "eval_windows": 2}
    mla = {"kv_lora_rank": 8, "qk_rope_head_dim": 6, "rope_key": "shared", "latent_norm": True, "uniform_rope": True}
    convert(str(work / "src"), {"mla": mla, "calibration": calib}, out_dir=tmp_path / "ds-mla", log=lambda m: None)
    student = load_source(tmp_path / "ds-mla").model
    assert export_problems(student) == []
    run_recipe(load_recipe(None, recipe_sets(work, "mla", f"student={tmp_path / 'ds-mla'}", "steps=2", "eval.every=2",
                                             "save.every=2")), tmp_path / "out", log=lambda m: None)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "merged").eval()
    assert export_problems(merged) == []
    # the convert pipeline's distillation stage runs on the same engine: it keeps the format too
    distill = {"steps": 6, "lr": 3e-3, "num_tokens": 2048, "every": 3}
    convert(str(work / "src"), {"mla": mla, "distill": distill, "calibration": calib}, out_dir=tmp_path / "ds-distill",
            log=lambda m: None)
    assert export_problems(load_source(tmp_path / "ds-distill").model) == []
    x = torch.randint(4, 100, (2, 20))
    with torch.no_grad():
        assert (merged(x).logits - student(x).logits).abs().max() > 1e-4  # training changed it
        assert (to_deepseek_v3(merged)(x).logits - merged(x).logits).abs().max() <= 1e-4


def test_merged_and_adapter_outputs_publish_with_the_runs_last_evaluation(trained, tmp_path):
    """`hf-csa2 push` of train's outputs (dry run): the card states the run's last held-out ratio
    and KL as logged, the merged folder's base is the source, the adapter's the converted student."""
    from huggingface_hub import ModelCard

    from hf_csa2.publish import PushOptions, push

    out, report = trained
    last = [h for h in report["history"] if "eval_text_ppl_ratio" in h][-1]
    options = PushOptions(license="apache-2.0", base_model="org/tiny-llama")
    merged = ModelCard(push(out / "merged", "me/tiny-mla-uplifted", options, dry_run=True, log=lambda m: None)["card"])
    stated = {r.metric_type: r.metric_value for r in merged.data.eval_results}
    assert stated["uplift_ppl_ratio"] == round(last["eval_text_ppl_ratio"], 4)
    assert stated["uplift_kl"] == round(last["eval_text_kl"], 4)
    assert f"for {report['steps']} steps" in merged.text and merged.data.to_dict()["base_model_relation"] == "finetune"
    adapter = push(out / "adapter", "me/tiny-mla-lora", PushOptions(license="apache-2.0", base_model="me/tiny-mla"),
                   dry_run=True, log=lambda m: None)
    assert set(adapter["files"]) == {"adapter_config.json", "adapter_model.safetensors", "README.md"}
    card = ModelCard(adapter["card"])
    assert card.data.base_model == "me/tiny-mla" and card.data.to_dict()["base_model_relation"] == "adapter"
