"""Sharing through the hub, offline: the staged files exactly, the upload against a mock of the hub
API, and SAELens's own ``SAE.from_pretrained`` reading a populated Hugging Face cache."""

from __future__ import annotations

import json

import huggingface_hub
import pytest
import torch
from conftest import make_model, randomise
from sae_lens import SAE

from mxd_lens.cli import main
from mxd_lens.layers import MxD, TopKSkipTranscoder


@pytest.fixture
def run(tmp_path):
    model = make_model("gated")
    final = tmp_path / "run" / "final"
    layers = {"L1.mxd.k2.m8": MxD.for_model(model, 1, d_sae=6, k=2),
              "L1.skip_transcoder.k2.m8": TopKSkipTranscoder.for_model(model, 1, d_sae=16, k=2)}  # fmt: skip
    for name, layer in layers.items():
        randomise(layer, 2, scale=0.1)
        layer.cfg.metadata.evaluation = {"metrics": {"delta_ce": 0.0123, "fvu": 0.25}, "tokens": 640,
                                         "text": {"text": "held.txt", "split": "eval"}}  # fmt: skip
        layer.save_model(final / name)
    return final, layers


def test_dry_run_writes_the_saelens_layout_and_a_model_card(run, tmp_path, capsys):
    final, layers = run
    assert main(["publish", str(final), "--repo-id", "user/tiny", "--dry-run", str(tmp_path / "out")]) == 0
    files = sorted(str(p.relative_to(tmp_path / "out")) for p in (tmp_path / "out").rglob("*") if p.is_file())
    assert files == ["L1.mxd.k2.m8/cfg.json", "L1.mxd.k2.m8/sae_weights.safetensors", "L1.skip_transcoder.k2.m8/cfg.json",
                     "L1.skip_transcoder.k2.m8/sae_weights.safetensors", "README.md"]  # fmt: skip
    for name in layers:
        for f in ("cfg.json", "sae_weights.safetensors"):
            assert (tmp_path / "out" / name / f).read_bytes() == (final / name / f).read_bytes()
    card = (tmp_path / "out/README.md").read_text()
    assert card.startswith("---\nlibrary_name: saelens") and "+0.0123" in card and "0.250" in card
    assert (
        "import mxd_lens  # registers" in card and 'SAE.from_pretrained("user/tiny", "L1.mxd.k2.m8")' in card
    )
    with pytest.raises(SystemExit, match="not empty"):
        main(["publish", str(final), "--repo-id", "user/tiny", "--dry-run", str(tmp_path / "out")])
    with pytest.raises(SystemExit, match="must be 'user_or_org/name'"):
        main(["publish", str(final), "--repo-id", "tiny", "--dry-run", str(tmp_path / "out2")])


def test_a_damaged_layer_is_named_and_nothing_is_staged_or_uploaded(run, tmp_path):
    from mxd_lens.hub import publish

    final, _ = run
    weights = final / "L1.mxd.k2.m8" / "sae_weights.safetensors"
    weights.write_bytes(weights.read_bytes()[:-40])
    with pytest.raises(
        SystemExit, match=r"L1.mxd.k2.m8/sae_weights\.safetensors is not a readable safetensors file"
    ):
        main(["publish", str(final), "--repo-id", "user/tiny", "--dry-run", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()

    class NoUpload:
        def create_repo(self, *args, **kwargs):
            raise AssertionError("nothing may reach the hub")

        upload_folder = create_repo

    with pytest.raises(ValueError, match="not a readable safetensors file"):
        publish(final, "user/tiny", api=NoUpload())


def test_a_repo_id_the_hub_would_refuse_is_refused_here(run, tmp_path):
    final, _ = run
    for bad in ("user/bad name!", "user/a..b", "user/a--b"):
        with pytest.raises(SystemExit, match="not a valid hub repository id"):
            main(["publish", str(final), "--repo-id", bad, "--dry-run", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_upload_is_one_commit_of_the_staged_files(run):
    from mxd_lens.hub import publish

    final, _ = run
    calls = []

    class MockApi:
        def create_repo(self, repo_id, private, exist_ok):
            calls.append(("create_repo", repo_id, private, exist_ok))

        def upload_folder(self, folder_path, repo_id, revision, commit_message):
            files = sorted(str(p.relative_to(folder_path)) for p in folder_path.rglob("*") if p.is_file())
            calls.append(("upload_folder", repo_id, files, commit_message))
            return type("Commit", (), {"commit_url": "https://huggingface.co/user/tiny/commit/abc"})()

    url = publish(final, "user/tiny", api=MockApi())
    assert url.endswith("/commit/abc")
    assert calls[0] == ("create_repo", "user/tiny", False, True)
    assert calls[1][0] == "upload_folder" and len(calls[1][2]) == 5 and "L1.mxd.k2.m8" in calls[1][3]


def test_from_pretrained_reads_a_populated_hub_cache_offline(run, tmp_path, monkeypatch):
    """The cache as the hub client leaves it after a download: refs/main -> a snapshot holding the
    files, and a .no_exist marker for the optional sparsity file SAELens asks for."""
    from mxd_lens.hub import stage

    final, layers = run
    staged = stage(final, "user/tiny", tmp_path / "staged")
    cache, commit = tmp_path / "hub", "0123456789abcdef0123456789abcdef01234567"
    repo = cache / "models--user--tiny"
    shutil_copytree(staged, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    for name in layers:
        marker = repo / ".no_exist" / commit / name
        marker.mkdir(parents=True)
        (marker / "sparsity.safetensors").touch()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    for name, layer in layers.items():
        loaded = SAE.from_pretrained("user/tiny", name)
        assert type(loaded) is type(layer)
        x = torch.randn(5, layer.cfg.d_in)
        with torch.no_grad():
            torch.testing.assert_close(loaded(x), layer(x))
        assert json.loads((repo / "snapshots" / commit / name / "cfg.json").read_text())["metadata"][
            "evaluation"
        ]


def test_damaged_files_are_named_by_saelens_own_loaders(run, tmp_path, monkeypatch):
    """SAE.load_from_disk and SAE.from_pretrained (a damaged hub-cache entry) name the file, and for the
    hub say force_download=True; the original error is chained."""
    import shutil

    from mxd_lens.hub import stage
    from mxd_lens.layers.io import DamagedLayerError

    final, _ = run
    folder = final / "L1.mxd.k2.m8"
    cfg = folder / "cfg.json"
    cfg.write_text(cfg.read_text()[:50])
    with pytest.raises(DamagedLayerError, match=rf"{cfg} is not valid JSON") as info:
        SAE.load_from_disk(folder)
    assert isinstance(info.value.__cause__, json.JSONDecodeError)
    weights = final / "L1.skip_transcoder.k2.m8" / "sae_weights.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good[: len(good) // 2])
    with pytest.raises(DamagedLayerError, match=rf"{weights} is not a readable safetensors file"):
        SAE.load_from_disk(weights.parent)
    weights.write_bytes(good)
    staged = stage(weights.parent, "user/tiny", tmp_path / "staged")
    cache, commit = tmp_path / "hub", "0123456789abcdef0123456789abcdef01234567"
    repo = cache / "models--user--tiny"
    shutil.copytree(staged, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    (repo / ".no_exist" / commit / "L1.skip_transcoder.k2.m8").mkdir(parents=True)
    (repo / ".no_exist" / commit / "L1.skip_transcoder.k2.m8" / "sparsity.safetensors").touch()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    SAE.from_pretrained("user/tiny", "L1.skip_transcoder.k2.m8")  # whole: loads
    cached = repo / "snapshots" / commit / "L1.skip_transcoder.k2.m8" / "cfg.json"
    cached.write_text("{")
    with pytest.raises(DamagedLayerError, match=r"cfg\.json is not valid JSON.*force_download=True"):
        SAE.from_pretrained("user/tiny", "L1.skip_transcoder.k2.m8")


def shutil_copytree(src, dst):
    import shutil

    shutil.copytree(src, dst)
