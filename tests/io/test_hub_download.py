"""Hub model IDs download the way `from_pretrained` does (no Hub is reachable here, so the
tests stand at the huggingface_hub boundary: what `snapshot_download` is asked, and what each
of its errors becomes)."""

from __future__ import annotations

import fnmatch

import httpx2 as httpx
import pytest
from huggingface_hub import errors as hf_errors
from tiny_models import save_tiny_source

import hf_csa2.io.sources as sources
from hf_csa2.cli import main as cli_main
from hf_csa2.io.sources import HUB_FILES, SourceError, resolve_source


@pytest.fixture
def fake_hub(monkeypatch, tmp_path):
    """snapshot_download replaced by a recorder returning a tiny checkpoint folder."""
    snapshot = tmp_path / "hub" / "snapshot"
    save_tiny_source("llama", snapshot)
    calls = []

    def fake(repo_id, **kwargs):
        calls.append({"repo_id": repo_id, **kwargs})
        if isinstance(fake.error, Exception):
            raise fake.error
        return str(snapshot)

    fake.error = None
    monkeypatch.setattr(sources, "snapshot_download", fake)
    monkeypatch.chdir(tmp_path)  # no local folder "org/model" may shadow the ID
    return fake, calls, snapshot


def response(status: int) -> httpx.Response:
    return httpx.Response(status, request=httpx.Request("GET", "https://huggingface.co/api/models/org/model"))


def test_online_hub_id_is_downloaded_with_only_what_a_conversion_needs(fake_hub, monkeypatch):
    fake, calls, snapshot = fake_hub
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    assert resolve_source("org/model", revision="v1.0") == ("hub", snapshot.resolve())
    (call,) = calls
    assert call["repo_id"] == "org/model" and call["revision"] == "v1.0" and call["local_files_only"] is False
    assert call["allow_patterns"] == HUB_FILES
    wanted = ["config.json", "generation_config.json", "model.safetensors", "model-00001-of-00002.safetensors",
              "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
              "merges.txt", "special_tokens_map.json", "chat_template.jinja"]
    unwanted = ["pytorch_model.bin", "modeling_custom.py", "model.gguf", "flax_model.msgpack", "tf_model.h5",
                "training_args.bin", "optimizer.pt"]
    assert all(any(fnmatch.fnmatch(f, p) for p in HUB_FILES) for f in wanted)
    assert not any(fnmatch.fnmatch(f, p) for f in unwanted for p in HUB_FILES)


def test_offline_uses_the_cache_only(fake_hub, monkeypatch):
    fake, calls, _ = fake_hub
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    resolve_source("org/model")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    resolve_source("org/model", offline=True)  # --offline wins over the environment
    assert [c["local_files_only"] for c in calls] == [True, True]


@pytest.mark.parametrize("error, offline, words", [
    (hf_errors.GatedRepoError("restricted", response=response(403)), False, ["is gated", "hf auth login"]),
    (hf_errors.RepositoryNotFoundError("404", response=response(404)), False, ["was not found", "private"]),
    (hf_errors.RevisionNotFoundError("404", response=response(404)), False, ["has no revision 'v9'"]),
    (hf_errors.LocalEntryNotFoundError("no connection"), False, ["cannot be reached", "not in the local cache"]),
    (hf_errors.LocalEntryNotFoundError("not cached"), True, ["not in the local Hugging Face cache", "HF_HUB_OFFLINE=1"]),
    (hf_errors.HfHubHTTPError("500 server error", response=response(500)), False, ["failed", "500"]),
])
def test_hub_errors_are_clear(fake_hub, monkeypatch, error, offline, words):
    fake, _, _ = fake_hub
    fake.error = error
    monkeypatch.setenv("HF_HUB_OFFLINE", "1" if offline else "0")
    with pytest.raises(SourceError) as err:
        resolve_source("org/model", revision="v9")
    for word in words:
        assert word in str(err.value)


def test_convert_downloads_a_hub_id_when_online(fake_hub, monkeypatch, tmp_path, capsys):
    fake, calls, snapshot = fake_hub
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    text = tmp_path / "calib.txt"
    text.write_text(" ".join(f"Item {i} holds {i * 7 % 11}." for i in range(500)))
    code = cli_main(["convert", "org/model", "--revision", "main", "--sinks", "--calib-text", str(text),
                     "--calib-tokens", "1024", "--out", str(tmp_path / "out")])
    assert code == 0, capsys.readouterr().err[-2000:]
    assert len(calls) == 1, calls  # resolved once, not once per loading step
    assert calls[0]["local_files_only"] is False and calls[0]["revision"] == "main"
    assert (tmp_path / "out" / "config.json").exists()
    fake.error = hf_errors.GatedRepoError("restricted", response=response(403))
    code = cli_main(["convert", "org/model", "--offline", "--sinks", "--out", str(tmp_path / "out2")])
    err = capsys.readouterr().err
    assert code == 2 and "is gated" in err and "Traceback" not in err
    assert calls[-1]["local_files_only"] is True
