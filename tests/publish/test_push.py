"""`hf-csa2 push` / `card`: no Hub is reachable here, so the tests stand at the `HfApi` boundary
(a recording stand-in) and on the download side (the uploaded files laid out as a Hub snapshot
in a temporary HF cache, loaded offline by repo ID without hf_csa2)."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard
from tiny_models import save_tiny_source

from hf_csa2.cli import main as cli_main
from hf_csa2.io.sources import load_source
from hf_csa2.io.trust import CODE_MANIFEST, model_code_problems
from hf_csa2.publish import PublishError, PushOptions, push
from hf_csa2.publish.provenance import source_provenance
from hf_csa2.surgery.pipeline import convert

# the module, not the package's ``push`` function of the same name
push_module = importlib.import_module("hf_csa2.publish.push")
REPO = "someone/tiny-mqa-sinks"
SECRET = "hf_SECRETTOKENthatmustneverbeprinted"
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches".split()


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A tiny Llama converted to MQA + sinks (remote-code model), its source and calibration text."""
    root = tmp_path_factory.mktemp("publish")
    text = root / "calib.txt"
    text.write_text(" ".join(WORDS[(7 * i) % len(WORDS)] for i in range(6000)))
    save_tiny_source("llama", root / "src")
    plan = {"calibration": {"text": str(text), "num_tokens": 1024, "seq_len": 256, "eval_windows": 2},
            "gqa": {"num_key_value_heads": 1}, "sinks": {}}
    convert(str(root / "src"), plan, out_dir=root / "out", log=lambda m: None)
    return root


@pytest.fixture
def folder(converted, tmp_path):
    """A private copy of the converted folder, free to damage."""
    return Path(shutil.copytree(converted / "out", tmp_path / "tiny-mqa"))


class RecordingApi:
    """Stands in for `huggingface_hub.HfApi`: records every call and, for uploads, the files of
    the folder it was given, laid out as a Hub snapshot in ``cache`` (what a later download gets)."""

    def __init__(self, cache: Path | None = None):
        self.calls, self.uploaded, self.cache = [], {}, cache

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id, kwargs))

    def create_branch(self, repo_id, **kwargs):
        self.calls.append(("create_branch", repo_id, kwargs))

    def upload_folder(self, *, repo_id, folder_path, **kwargs):
        self.calls.append(("upload_folder", repo_id, kwargs))
        root = Path(folder_path)
        self.uploaded = {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}
        if self.cache is not None:
            owner, name = repo_id.split("/")
            repo = self.cache / f"models--{owner}--{name}"
            commit = "0123456789abcdef0123456789abcdef01234567"
            for rel, data in self.uploaded.items():
                (repo / "snapshots" / commit / rel).parent.mkdir(parents=True, exist_ok=True)
                (repo / "snapshots" / commit / rel).write_bytes(data)
            (repo / "refs").mkdir(parents=True, exist_ok=True)
            (repo / "refs" / "main").write_text(commit)
        return type("CommitInfo", (), {"commit_url": f"https://huggingface.co/{repo_id}/commit/x", "pr_url": None})()


@pytest.fixture
def no_hub(monkeypatch):
    """`HfApi` must not be created (no network call): constructing it fails the test."""
    import huggingface_hub

    def forbidden(*args, **kwargs):
        raise AssertionError("HfApi created: a network call would follow")

    monkeypatch.setattr(huggingface_hub, "HfApi", forbidden)
    monkeypatch.setenv("HF_TOKEN", SECRET)


def expected_files(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir() if p.is_file()} | {"README.md"}


def test_push_uploads_exactly_the_validated_files_with_the_repo_options(folder, monkeypatch, capsys):
    monkeypatch.setenv("HF_TOKEN", SECRET)
    (folder / "README.md").write_text("an old card that the generated one replaces")
    api = RecordingApi()
    options = PushOptions(private=True, revision="v1", commit_message="first upload", license="apache-2.0",
                          base_model="org/tiny-llama")
    result = push(folder, REPO, options, api=api)
    assert [c[0] for c in api.calls] == ["create_repo", "create_branch", "upload_folder"]
    assert api.calls[0][2] == {"repo_type": "model", "private": True, "exist_ok": True}
    assert api.calls[1][2]["branch"] == "v1"
    assert api.calls[2][2] == {"repo_type": "model", "commit_message": "first upload", "revision": "v1", "create_pr": False}
    assert set(api.uploaded) == expected_files(folder) == set(result["files"])
    for name, data in api.uploaded.items():
        if name != "README.md":
            assert data == (folder / name).read_bytes(), name
    assert api.uploaded["README.md"].decode() == result["card"] != (folder / "README.md").read_text()
    out = capsys.readouterr()
    assert SECRET not in out.out + out.err


def test_create_pr_uploads_as_a_pull_request_without_a_branch(folder):
    api = RecordingApi()
    push(folder, REPO, PushOptions(create_pr=True, license="apache-2.0", base_model="org/tiny-llama"), api=api,
         log=lambda m: None)
    assert [c[0] for c in api.calls] == ["create_repo", "upload_folder"]
    assert api.calls[1][2]["create_pr"] is True


class RecordingApiHub1(RecordingApi):
    """huggingface_hub 1.x's ``HfApi`` also has ``upload_large_folder`` (2.0 removed it: its
    ``upload_folder`` commits a big folder in parts and resumes by itself)."""

    def upload_large_folder(self, *, repo_id, folder_path, **kwargs):
        self.calls.append(("upload_large_folder", repo_id, kwargs))
        root = Path(folder_path)
        self.uploaded = {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_a_large_folder_takes_the_resumable_upload_the_installed_hub_has(folder, monkeypatch):
    """Above LARGE_FOLDER_BYTES: hub 1.x's ``upload_large_folder`` (no commit message, branch or PR:
    asking for one keeps ``upload_folder``), else ``upload_folder``, which is resumable in hub 2.x.
    Calls to methods the installed ``HfApi`` has bind to its real signatures."""
    import inspect

    from huggingface_hub import HfApi

    options = dict(license="apache-2.0", base_model="org/tiny-llama")
    monkeypatch.setattr(push_module, "LARGE_FOLDER_BYTES", 1)  # this tiny folder counts as large
    hub1 = RecordingApiHub1()
    push(folder, REPO, PushOptions(private=True, **options), api=hub1, log=lambda m: None)
    assert [c[0] for c in hub1.calls] == ["create_repo", "upload_large_folder"]
    assert hub1.calls[1][2] == {"repo_type": "model", "private": True}
    assert set(hub1.uploaded) == expected_files(folder)
    assert all(hub1.uploaded[n] == (folder / n).read_bytes() for n in hub1.uploaded if n != "README.md")
    hub1_message = RecordingApiHub1()
    push(folder, REPO, PushOptions(commit_message="m", **options), api=hub1_message, log=lambda m: None)
    assert [c[0] for c in hub1_message.calls] == ["create_repo", "upload_folder"]  # one commit, as asked
    hub2 = RecordingApi()  # no upload_large_folder, as huggingface_hub >= 2.0
    push(folder, REPO, PushOptions(**options), api=hub2, log=lambda m: None)
    assert [c[0] for c in hub2.calls] == ["create_repo", "upload_folder"] and set(hub2.uploaded) == expected_files(folder)
    for name, repo_id, kwargs in hub1.calls + hub2.calls:
        if hasattr(HfApi, name):
            extra = {"folder_path": "x"} if name.startswith("upload") else {}
            inspect.signature(getattr(HfApi, name)).bind(None, repo_id=repo_id, **extra, **kwargs)


REMOTE_LOAD = textwrap.dedent(
    """
    import sys, torch
    sys.modules["hf_csa2"] = None  # this process has no hf_csa2
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
    assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
    with torch.no_grad():
        torch.save(model(torch.load(sys.argv[2])).logits, sys.argv[3])
    """
)


def test_the_uploaded_files_load_offline_by_repo_id_without_hf_csa2_and_give_the_folders_logits(folder, tmp_path):
    cache = tmp_path / "hf-cache"
    api = RecordingApi(cache)
    push(folder, REPO, PushOptions(license="apache-2.0", base_model="org/tiny-llama"), api=api, log=lambda m: None)
    x = torch.randint(4, 100, (1, 12))
    torch.save(x, tmp_path / "x.pt")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"))
    proc = subprocess.run([sys.executable, "-c", REMOTE_LOAD, REPO, str(tmp_path / "x.pt"), str(tmp_path / "y.pt")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with torch.no_grad():
        expected = load_source(str(folder), check_supported=False).model(x).logits
    torch.testing.assert_close(torch.load(tmp_path / "y.pt"), expected, atol=1e-5, rtol=1e-5)


def test_the_card_parses_has_the_metadata_and_states_the_reports_numbers(folder, converted, tmp_path):
    ppl_json = tmp_path / "ppl.json"
    assert cli_main(["eval", "ppl", str(converted / "src"), str(folder), "--text", str(converted / "calib.txt"),
                     "--window", "64", "--max-windows", "3", "--json", str(ppl_json)]) == 0
    assert cli_main(["card", str(folder), "--repo-id", REPO, "--license", "apache-2.0", "--base-model",
                     "org/tiny-llama", "--eval", str(ppl_json), "--out", str(tmp_path / "card.md")]) == 0
    card = ModelCard.load(tmp_path / "card.md")
    data = card.data.to_dict()
    assert data["base_model"] == "org/tiny-llama" and data["base_model_relation"] == "finetune"
    assert data["library_name"] == "transformers" and data["pipeline_tag"] == "text-generation"
    assert data["license"] == "apache-2.0" and {"hf-csa2", "mqa", "attention-sinks"} <= set(data["tags"])
    stated = {r.metric_type: r.metric_value for r in card.data.eval_results}
    report = json.loads((folder / "conversion_report.json").read_text())
    source, last = report["stages"][0], report["stages"][-1]
    by_origin = {(r.metric_type, r.dataset_name): r.metric_value for r in card.data.eval_results}
    assert by_origin[("ppl_ratio", f"{converted / 'calib.txt'} (scoring windows)")] == round(
        last["calib_ppl"] / source["calib_ppl"], 4)
    assert by_origin[("ppl_ratio", str(converted / "calib.txt"))] == round(
        json.loads(ppl_json.read_text())["results"][1]["ratio"], 4)
    assert stated["kv_elements_per_token"] == last["kv_elements_per_token"] == 2 * 1 * 12 * 2
    assert stated["kv_elements_per_token_source"] == source["kv_elements_per_token"]
    check = last["answer_check"]
    assert stated["answer_check_far"] == round(check["far"] / check["per_depth"], 4)
    for r in card.data.eval_results:  # the body's table states the same values
        assert f"| {r.metric_name} | {r.dataset_name} | {r.metric_value} |" in card.text
    assert "hf-csa2 eval ppl" in card.text  # the command recorded in the result file


def test_dry_run_prints_files_sizes_and_card_and_creates_no_api(folder, no_hub, capsys):
    code = cli_main(["push", str(folder), REPO, "--dry-run", "--license", "apache-2.0", "--base-model", "org/tiny"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert f"{(folder / 'model.safetensors').stat().st_size:,}  model.safetensors" in out.err
    assert "base_model: org/tiny" in out.err and SECRET not in out.out + out.err


def _bin(folder):
    (folder / "pytorch_model.bin").write_bytes(b"pickle")


def _edit_code(folder):
    with open(folder / "modeling_hf_csa2.py", "a") as f:
        f.write("\nimport os  # an edit\n")


def _no_tokenizer(folder):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink()


def _does_not_load(folder):
    config = json.loads((folder / "config.json").read_text())
    config["hidden_size"] = 40  # the weights no longer fit the config
    (folder / "config.json").write_text(json.dumps(config))


def _stray(folder):
    (folder / "runs").mkdir()
    (folder / "runs" / "log.txt").write_text("x")


@pytest.mark.parametrize("damage, needle", [
    (_bin, "pickled files are never published, safetensors only: pytorch_model.bin"),
    (_edit_code, "model code edited after it was saved: modeling_hf_csa2.py"),
    (_no_tokenizer, "no tokenizer loads from the folder"),
    (_does_not_load, "does not load and run without hf-csa2"),
    (_stray, "stray files: runs/"),
])
def test_each_validation_failure_is_one_line_exit_2_and_no_network(folder, no_hub, capsys, damage, needle):
    damage(folder)
    code = cli_main(["push", str(folder), REPO, "--license", "apache-2.0", "--base-model", "org/tiny"])
    err = capsys.readouterr().err
    assert code == 2, err
    errors = [line for line in err.splitlines() if line.startswith("hf-csa2: error:")]
    assert len(errors) == 1 and needle in errors[0] and err.rstrip().endswith(errors[0]), err


def test_all_problems_are_listed_in_one_error(folder, no_hub):
    _bin(folder)
    _stray(folder)
    with pytest.raises(PublishError) as caught:
        push(folder, REPO, PushOptions(), log=lambda m: None)
    message = str(caught.value)
    for needle in ("pytorch_model.bin", "stray files: runs/", "base model unknown", "license unknown"):
        assert needle in message


def test_include_publishes_a_named_extra_file_but_never_a_pickle(folder):
    _stray(folder)
    api = RecordingApi()
    push(folder, REPO, PushOptions(include=("runs/*",), license="apache-2.0", base_model="org/t"), api=api,
         log=lambda m: None)
    assert "runs/log.txt" in api.uploaded
    _bin(folder)
    with pytest.raises(PublishError, match="pickled"):
        push(folder, REPO, PushOptions(include=("*",), license="apache-2.0", base_model="org/t"), api=api,
             log=lambda m: None)


@pytest.mark.parametrize("repo, flags, needle", [
    ("not-a-repo-id", [], "allowed: OWNER/NAME"),
    (REPO, ["--format", "gguf"], "--format 'gguf'; allowed: native, deepseek_v3"),
    (REPO, ["--eval", "missing.json"], "--eval file not found: missing.json"),
])
def test_bad_arguments_fail_before_the_folder_is_read(tmp_path, no_hub, capsys, repo, flags, needle):
    code = cli_main(["push", str(tmp_path / "nothing-here"), repo, *flags])
    assert code == 2 and needle in capsys.readouterr().err


def test_code_manifest_tells_edited_and_foreign_files_apart(folder):
    assert model_code_problems(folder) == []
    manifest = json.loads((folder / CODE_MANIFEST).read_text())["files"]
    assert "modeling_hf_csa2.py" in manifest and len(manifest) == len(list(folder.glob("*.py")))
    (folder / "helper.py").write_text("x = 1\n")
    assert model_code_problems(folder) == ["Python files that are not hf-csa2 model code: helper.py"]
    (folder / "helper.py").unlink()
    (folder / CODE_MANIFEST).unlink()  # a folder saved before manifests: the package comparison still guards it
    assert model_code_problems(folder) == []
    _edit_code(folder)
    assert "differs from the installed hf-csa2's (modeling_hf_csa2.py)" in model_code_problems(folder)[0]


def test_built_in_aliases_know_their_hub_repository_and_license():
    smol = source_provenance("smollm2-135m")
    gemma = source_provenance("gemma3-270m")
    assert (smol.base_model, smol.license) == ("HuggingFaceTB/SmolLM2-135M-Instruct", "apache-2.0")
    assert (gemma.base_model, gemma.license) == ("google/gemma-3-270m", "gemma")


def test_a_source_folder_in_the_hub_cache_gives_its_repository_and_card_license(tmp_path):
    snapshot = tmp_path / "models--org--model" / "snapshots" / "abc"
    save_tiny_source("llama", snapshot)
    (snapshot / "README.md").write_text("---\nlicense: mit\n---\n# model\n")
    found = source_provenance(str(snapshot))
    assert (found.base_model, found.license) == ("org/model", "mit")


def test_an_adapter_folder_is_published_with_its_converted_base(folder, tmp_path):
    from peft import LoraConfig, get_peft_model

    model = load_source(str(folder), check_supported=False).model
    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False))
    peft_model.save_pretrained(tmp_path / "adapter")
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == str(folder)
    api = RecordingApi()
    result = push(tmp_path / "adapter", "someone/tiny-lora", PushOptions(base_model=REPO, license="apache-2.0"), api=api,
                  log=lambda m: None)
    assert set(api.uploaded) == {"adapter_config.json", "adapter_model.safetensors", "README.md"}
    card = ModelCard(result["card"])
    assert card.data.base_model == REPO and card.data.to_dict()["base_model_relation"] == "adapter"
    assert card.data.license == "apache-2.0" and "peft" in card.data.tags and "mqa" in card.data.tags
    assert f'PeftModel.from_pretrained(base, "someone/tiny-lora")' in card.text


def test_convert_push_to_hub_checks_license_before_work_then_uploads(converted, tmp_path, monkeypatch, no_hub, capsys):
    args = ["convert", str(converted / "src"), "--to", "gqa", "--kv-heads", "1", "--calib-text",
            str(converted / "calib.txt"), "--calib-tokens", "1024", "--calib-seq-len", "256", "--out",
            str(tmp_path / "out"), "--push-to-hub", REPO]
    assert cli_main(args) == 2
    assert "license of" in capsys.readouterr().err and not (tmp_path / "out").exists()  # refused before converting
    api = RecordingApi()
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "HfApi", lambda: api)
    assert cli_main(args + ["--license", "mit", "--base-model", "org/tiny-llama", "--private"]) == 0
    assert api.calls[0] == ("create_repo", REPO, {"repo_type": "model", "private": True, "exist_ok": True})
    assert set(api.uploaded) == expected_files(tmp_path / "out")
    assert "license: mit" in api.uploaded["README.md"].decode()


def test_format_deepseek_v3_publishes_the_stock_export_without_model_code(tmp_path):
    from tiny_models import tiny_model, tiny_tokenizer

    from hf_csa2.surgery.mla import apply_mla
    from hf_csa2.surgery.plan import MlaPlan

    plan = MlaPlan(kv_lora_rank=6, qk_rope_head_dim=6, rope_key="shared", latent_norm=True, uniform_rope=True)
    model = apply_mla(tiny_model("llama", num_kv_heads=1), plan,
                      windows=torch.randint(3, 128, (4, 32), generator=torch.Generator().manual_seed(1)))[0]
    model.save_pretrained(tmp_path / "mla")
    tiny_tokenizer().save_pretrained(tmp_path / "mla")
    api = RecordingApi()
    result = push(tmp_path / "mla", REPO, PushOptions(format="deepseek_v3", license="mit", base_model="org/t"), api=api,
                  log=lambda m: None)
    assert not any(f.endswith(".py") for f in api.uploaded) and "model.safetensors" in api.uploaded
    assert json.loads(api.uploaded["config.json"])["model_type"] == "deepseek_v3"
    card = ModelCard(result["card"])
    assert "mla" in card.data.tags and "trust_remote_code" not in card.text
    assert not (tmp_path / "mla" / "README.md").exists()  # the folder itself is never written


def test_a_gguf_source_gives_the_license_it_carries():
    from hf_csa2.io.sources import SourceError, resolve_alias

    try:
        gguf = resolve_alias("smollm2-135m")
    except SourceError as err:
        pytest.skip(f"SmolLM2 GGUF cannot be fetched: {err}")
    found = source_provenance(str(gguf))
    assert found.license == "apache-2.0" and found.base_model is None  # a GGUF file does not name its repository
