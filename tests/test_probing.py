"""Sparse probing: pooling against a one-text-at-a-time loop, train-only selection, the probe, tasks."""

from __future__ import annotations

import dataclasses
import json
import lzma
import random

import numpy as np
import pytest
import torch
from conftest import WORDS, make_text_model, randomise

from mxd_lens.analysis import probing
from mxd_lens.analysis.tasks import TaskSet, binary_task, jsonl_task_set, splits
from mxd_lens.hooks import capture_mlp_io
from mxd_lens.layers import MxD, TopKTranscoder


@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    model, _ = make_text_model(tmp_path_factory.mktemp("tm"))
    return model


def labelled_file(path, n_per_class=30, classes=("cat", "dog", "bird"), seed=0):
    """Texts of random words where each class's texts repeat one marker word ('cat', 'dogs', 'birds')."""
    rng = random.Random(seed)
    markers = {"cat": "cat", "dog": "dogs", "bird": "birds"}
    rows = []
    for c in classes:
        for _ in range(n_per_class):
            words = [rng.choice(WORDS[4:]) for _ in range(rng.randint(3, 9))]
            words.insert(rng.randrange(len(words)), markers[c])
            rows.append({"text": " ".join(words), "label": c})
    rng.shuffle(rows)
    with lzma.open(path, "wt") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def test_pooling_equals_one_text_at_a_time(text_model):
    layers = {"mxd": randomise(MxD.for_model(text_model, 1, d_sae=12, k=3, d_hidden=8), 1),
              "tc": randomise(TopKTranscoder.for_model(text_model, 1, d_sae=20, k=4), 2)}  # fmt: skip
    texts = ["the cat sat on a mat", "dogs", "birds sang songs of rain over green hills and the cat ran",
             "a mat while dogs ran"]  # fmt: skip
    pooled = probing.pooled_activations(text_model, layers, texts, dense_layers=[0, 1], context_size=8,
                                        batch_size=3, progress=False)  # fmt: skip
    bos = text_model.tokenizer.bos_token_id
    for i, text in enumerate(texts):
        ids = text_model.tokenizer(text, add_special_tokens=False)["input_ids"][:7]
        tokens = torch.tensor([[bos] + ids])
        with capture_mlp_io(text_model, [0, 1]) as io:
            text_model(tokens)
        for name, layer in layers.items():
            codes = layer.encode(io[1]["in"])[0, 1:]  # the text's tokens: no BOS, the last one kept
            torch.testing.assert_close(pooled[name][i], codes.mean(0), atol=1e-5, rtol=1e-5)
        for L in (0, 1):
            torch.testing.assert_close(
                pooled[f"mlp_in.L{L}"][i], io[L]["in"][0, 1:].mean(0), atol=1e-5, rtol=1e-5
            )
            torch.testing.assert_close(
                pooled[f"mlp_out.L{L}"][i], io[L]["out"][0, 1:].mean(0), atol=1e-5, rtol=1e-5
            )


def test_rank_features_uses_only_the_rows_it_is_given():
    rng = np.random.default_rng(0)
    y = np.array([0, 1] * 50)
    X = rng.normal(size=(100, 6))
    X[:, 4] += 3 * y  # separates the classes everywhere
    parts = {"train": list(range(60)), "val": list(range(60, 80)), "test": list(range(80, 100))}
    X_bad = X.copy()
    X_bad[80:, 2] += 50 * y[80:]  # a feature that separates only the test rows
    for data in (X, X_bad):
        result = probing.probe_task(data, y, parts, k=1)
        assert result["features"] == [4]
    # the reference: the argmax of |class mean difference| over the training rows
    tr = np.arange(60)
    diff = np.abs(X[tr][y[tr] == 1].mean(0) - X[tr][y[tr] == 0].mean(0))
    assert list(probing.rank_features(X[tr], y[tr])) == list(np.argsort(-diff, kind="stable"))


def test_probe_accuracy_and_validation_choice():
    rng = np.random.default_rng(1)
    y = np.array([0, 1] * 60)
    X = rng.normal(size=(120, 3))
    X[:, 0] += 4 * (2 * y - 1)
    parts = {"train": list(range(80)), "val": list(range(80, 100)), "test": list(range(100, 120))}
    result = probing.probe_task(X, y, parts, k=2)
    assert result["test_accuracy"] == 1.0 and result["features"][0] == 0
    noise = probing.probe_task(rng.normal(size=(120, 3)), y, parts, k=1)
    assert noise["test_accuracy"] < 0.85
    with pytest.raises(ValueError, match="k=4"):
        probing.probe_task(X, y, parts, k=4)


def test_run_probing_finds_the_planted_feature(text_model, tmp_path):
    path = labelled_file(tmp_path / "animals.jsonl.xz")
    task_set = jsonl_task_set(path, ["cat", "dog", "bird"], per_class=30)
    # a transcoder whose latent 5 reads exactly the 'cat' token's MLP input (all latents kept: k = d_sae)
    layer = TopKTranscoder.for_model(text_model, 1, d_sae=16, k=16)
    randomise(layer, 3, scale=0.01)
    cat = text_model.tokenizer("cat", add_special_tokens=False)["input_ids"]
    with capture_mlp_io(text_model, [1]) as io:
        text_model(torch.tensor([[0] + cat * 3]))
    direction = io[1]["in"][0, 1:].mean(0)
    with torch.no_grad():
        layer.W_enc[:, 5] = 10 * direction / direction.norm() ** 2
        layer.b_enc[5] = 0.0
    table, fitted = probing.run_probing(text_model, [task_set], {"tc": layer}, ks=[1, 2], context_size=12,
                                        cache=tmp_path / "cache", progress=False)  # fmt: skip
    assert set(table.task) == {"animals/cat", "animals/dog", "animals/bird"}
    row = table[(table.task == "animals/cat") & (table.source == "tc") & (table.k == 1)].iloc[0]
    assert row.features == [5]
    assert row.test_accuracy >= 0.75  # 12 test texts; chance is 0.5
    assert set(table[table.k == "all"].source) == {"mlp_in.L1", "mlp_out.L1"}
    # the cache gives back the same pooled activations and notices edited weights
    store = probing.PooledCache(tmp_path / "cache")
    examples = task_set.load()
    again = store.get(text_model, examples, {"tc": layer}, [1], context_size=12, progress=False)
    fresh = probing.pooled_activations(
        text_model, {"tc": layer}, examples.texts, [1], context_size=12, progress=False
    )
    for key in fresh:
        torch.testing.assert_close(again[key], fresh[key])
    with torch.no_grad():
        layer.W_enc[:, 5] *= 2
    edited = store.get(text_model, examples, {"tc": layer}, [1], context_size=12, progress=False)
    torch.testing.assert_close(edited["tc"][:, 5], 2 * fresh["tc"][:, 5], atol=1e-5, rtol=1e-5)
    # a damaged entry is recomputed, not an error
    entry = tmp_path / "cache" / task_set.name / "tc.safetensors"
    entry.write_bytes(entry.read_bytes()[:20])
    (entry.with_suffix(".json")).write_text((entry.with_suffix(".json")).read_text()[:-3])
    again = store.get(text_model, examples, {"tc": layer}, [1], context_size=12, progress=False)
    torch.testing.assert_close(again["tc"], edited["tc"])
    entry.write_bytes(entry.read_bytes()[:20])
    again = store.get(text_model, examples, {"tc": layer}, [1], context_size=12, progress=False)
    torch.testing.assert_close(again["tc"], edited["tc"])


def test_pooled_cache_tells_apart_two_models_with_one_name(text_model, tmp_path):
    """Two models both called ``cfg.model_name`` (e.g. two local folders named "model") must not share
    pooled activations: the cache is keyed by the model's identity, not its short name."""
    import copy

    task_set = jsonl_task_set(
        labelled_file(tmp_path / "a.jsonl.xz", n_per_class=5), ["cat", "dog"], per_class=5
    )
    examples = task_set.load()
    other = copy.deepcopy(text_model)
    with torch.no_grad():
        other.blocks[0].mlp.W_in.mul_(-1.5)
    assert other.cfg.model_name == text_model.cfg.model_name
    store = probing.PooledCache(tmp_path / "cache")
    first = store.get(text_model, examples, {}, [1], context_size=12, progress=False)
    second = store.get(other, examples, {}, [1], context_size=12, progress=False)
    expected = probing.pooled_activations(other, {}, examples.texts, [1], context_size=12, progress=False)
    for key in expected:
        torch.testing.assert_close(second[key], expected[key])
    assert not torch.allclose(first["mlp_out.L1"], second["mlp_out.L1"])


def test_pooled_cache_files_get_the_mode_open_would_give(text_model, tmp_path):
    """Written through mkstemp-style temporaries (0600), the cache must still be readable as a plain file."""
    import os
    import stat

    examples = jsonl_task_set(
        labelled_file(tmp_path / "a.jsonl.xz", n_per_class=5), ["cat", "dog"], per_class=5
    ).load()
    layer = randomise(TopKTranscoder.for_model(text_model, 1, d_sae=8, k=2), 1)
    old = os.umask(0o022)
    try:
        probing.PooledCache(tmp_path / "cache").get(text_model, examples, {"tc": layer}, [], context_size=12,
                                                    progress=False)  # fmt: skip
    finally:
        os.umask(old)
    files = sorted((tmp_path / "cache").rglob("*"))
    names = [f.name for f in files if f.is_file()]
    assert names == ["tc.json", "tc.safetensors"]  # no temporary left behind
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o644 for f in files if f.is_file())


def test_splits_are_stratified_disjoint_and_seeded():
    labels = ["a"] * 20 + ["b"] * 30
    s = splits(labels, (0.6, 0.2, 0.2), seed=3)
    assert sorted(s["train"] + s["val"] + s["test"]) == list(range(50))
    assert sum(labels[i] == "a" for i in s["test"]) == 4 and sum(labels[i] == "b" for i in s["test"]) == 6
    assert s == splits(labels, (0.6, 0.2, 0.2), seed=3) and s != splits(labels, (0.6, 0.2, 0.2), seed=4)
    rows, y = binary_task(labels, "a", s["train"])
    assert sum(y) == len(y) // 2 == 12 and all(labels[r] == "a" for r, t in zip(rows, y, strict=True) if t)


def test_bad_input(tmp_path, text_model):
    with pytest.raises(ValueError, match="two distinct classes"):
        TaskSet("x", ("a",), file="f.jsonl")
    with pytest.raises(ValueError, match="too few to split"):
        TaskSet("x", ("a", "b"), per_class=3, file="f.jsonl")
    with pytest.raises(ValueError, match="at least 2 per class"):
        splits(["a"] * 4 + ["b"] * 4)
    with pytest.raises(ValueError, match="only one class"):
        splits(["a"] * 40)
    missing = tmp_path / "missing.jsonl"
    missing.write_text('{"text": "the cat"}\n')
    with pytest.raises(ValueError, match="lacks"):
        jsonl_task_set(missing, ["a", "b"], per_class=5).load()
    path = labelled_file(tmp_path / "few.jsonl.xz", n_per_class=6)
    with pytest.raises(ValueError, match="too few examples"):
        jsonl_task_set(path, ["cat", "dog"], per_class=10).load()
    with pytest.raises(ValueError, match="tokenises to nothing"):
        probing.tokenize_texts(text_model, ["the cat", ""], 8)
    layer = TopKTranscoder.for_model(text_model, 1, d_sae=16, k=4)
    task_set = jsonl_task_set(path, ["cat", "dog"], per_class=6)
    with pytest.raises(ValueError, match="k=17"):
        probing.run_probing(text_model, [task_set], {"tc": layer}, ks=[17], context_size=12, progress=False)


def test_summarize_means_and_standard_errors():
    import pandas as pd

    table = pd.DataFrame(
        {
            "task": ["a", "b", "c", "a", "b", "c"],
            "source": ["x"] * 3 + ["d"] * 3,
            "k": [1, 1, 1, "all", "all", "all"],
            "test_accuracy": [0.5, 0.7, 0.9, 1.0, 0.8, 0.9],
        }
    )
    out = probing.summarize(table)
    assert out.loc["x", "k=1"] == pytest.approx(0.7) and out.loc["d", "k=all"] == pytest.approx(0.9)
    assert out.loc["x", "se k=1"] == pytest.approx(np.std([0.5, 0.7, 0.9], ddof=1) / 3**0.5)
    assert out.loc["x", "tasks"] == 3 and np.isnan(out.loc["x", "k=all"])


def test_paired_difference_against_a_hand_count():
    import pandas as pd

    table = pd.DataFrame(
        {
            "task": ["a", "b", "c"] * 2,
            "source": ["x"] * 3 + ["y"] * 3,
            "k": [1] * 6,
            "test_accuracy": [0.6, 0.7, 0.9, 0.5, 0.8, 0.7],
        }
    )
    out = probing.paired_difference(table, "x", "y").iloc[0]
    diffs = [0.1, -0.1, 0.2]
    assert out.mean_difference == pytest.approx(np.mean(diffs))
    assert out.se == pytest.approx(np.std(diffs, ddof=1) / 3**0.5)
    assert (out.a_wins, out.b_wins, out.tasks) == (2, 1, 3)


def animal_task_and_layers(model, tmp_path):
    """The animals task set (3 classes, 30 texts each) and an MxD and a transcoder (K = 4) of block 1
    saved under tmp_path/final/{mxd,tc}."""
    task_set = jsonl_task_set(
        labelled_file(tmp_path / "animals.jsonl.xz"), ["cat", "dog", "bird"], per_class=30
    )
    for name, layer in {
        "mxd": MxD.for_model(model, 1, d_sae=6, k=4),
        "tc": TopKTranscoder.for_model(model, 1, d_sae=16, k=4),
    }.items():
        randomise(layer, 3, scale=0.05)
        layer.save_model(tmp_path / "final" / name)
    return task_set


def run_probing_study(model, study, out, progress=False, task_sets=None):
    """The probing study as ``mxd-lens probe`` runs it: run, then the report writer; the result's tables."""
    from mxd_lens.studies.probe.run import run
    from mxd_lens.studies.report import write_result

    result = run(model, study, out, task_sets=task_sets, progress=progress)
    write_result(result, out)
    return result.value


def merge_probing(folders, out):
    from mxd_lens.studies.probe import MergeOptions
    from mxd_lens.studies.probe.run import merge
    from mxd_lens.studies.report import write_result

    result = merge(None, MergeOptions(folders=[str(f) for f in folders]), out)
    write_result(result, out)
    return result.value


def test_probing_study_writes_its_tables_and_pairs_by_k(text_model, tmp_path):
    import pandas as pd

    from mxd_lens.studies.probe import ProbeOptions as ProbingStudy

    task_set = animal_task_and_layers(text_model, tmp_path)
    study = ProbingStudy(layers=[str(tmp_path / "final")], ks=[1, 2], context_size=12)
    out = run_probing_study(text_model, study, tmp_path / "out", progress=False, task_sets=[task_set])
    for name in ("probing.csv", "summary.csv", "paired.csv", "probing.json", "probing.png"):
        assert (tmp_path / "out" / name).is_file(), name
    table = pd.read_csv(tmp_path / "out/probing.csv")
    # layers by their architecture key and K; labels are for the printed text and the plot only
    assert "label" not in table and "method" not in table
    layers = table.dropna(subset=["arch"]).drop_duplicates("source").set_index("source")
    assert layers.arch.to_dict() == {"mxd": "mxd", "tc": "transcoder"} and set(layers.K) == {4}
    summary = pd.read_csv(tmp_path / "out/summary.csv", index_col="source")
    assert summary.loc["mxd", "arch"] == "mxd" and summary.loc["tc", "K"] == 4
    # MxD minus the transcoder, by hand from the written table
    for k in (1, 2):
        acc = {
            s: table[(table.source == s) & (table.k == str(k))].set_index("task").test_accuracy
            for s in ("mxd", "tc")
        }
        row = out["paired"][(out["paired"].k == k)].iloc[0]
        assert (row.arch, row.other_arch, row.a, row.b, row.K) == ("mxd", "transcoder", "mxd", "tc", 4)
        assert row.mean_difference == pytest.approx((acc["mxd"] - acc["tc"]).mean())

    # tables written before the arch column read the same: `method` (the old name, the same keys), or
    # only a label per layer ('MxD K=4')
    from mxd_lens.analysis.probing import layer_sources
    from mxd_lens.studies.probe.run import probing_result, read_probing_table

    written = read_probing_table(tmp_path / "out")
    assert layer_sources(written) == {"mxd": ("mxd", 4), "tc": ("transcoder", 4)}
    labels = {"mxd": "MxD K=4", "tc": "Transcoder K=4"}
    older = written.rename(columns={"arch": "method"})
    oldest = written.drop(columns=["arch", "K"]).assign(
        label=written.source.map(labels).fillna(written.source)
    )
    text = probing_result(written, {}).text
    assert "MxD K=4" in text and "| MxD - Transcoder |" in text
    for old in (older, oldest):
        assert layer_sources(old) == layer_sources(written)
        assert probing_result(old, {}).text == text


def test_hf_sources_read_local_datasets_in_saebench_layouts(tmp_path):
    """SAEBench's layouts, as local dataset folders: one text and one label column (bias_in_bios),
    a config per language with the text at translation.<lang> (europarl), a header skip (github code)."""
    from mxd_lens.analysis.tasks import SAEBENCH, HFSource, TaskSet

    def write(folder, configs):
        lines = ["---", "configs:"]
        for name, rows in configs.items():
            (folder / name).mkdir(parents=True)
            (folder / name / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            lines += [f"- config_name: {name}", f"  data_files: {name}/train.jsonl"]
        (folder / "README.md").write_text("\n".join([*lines, "---", ""]))

    bios = tmp_path / "bios"
    write(bios, {"default": [{"hard_text": f"bio {i} {'x' * i}", "profession": i % 3} for i in range(30)]})
    loaded = TaskSet("bios", ("0", "2"), 6, hf=HFSource(str(bios), "hard_text", "profession")).load()
    assert loaded.labels == ["0"] * 6 + ["2"] * 6
    assert all(int(t.split()[1]) % 3 == int(c) for t, c in zip(loaded.texts, loaded.labels, strict=True))

    europarl = tmp_path / "europarl"
    write(europarl, {"en-fr": [{"translation": {"en": f"hello {i}", "fr": f"bonjour {i}"}} for i in range(8)],
                     "fr-it": [{"translation": {"fr": f"salut {i}", "it": f"ciao {i}"}} for i in range(8)]})  # fmt: skip
    source = HFSource(str(europarl), "translation.{label}", class_configs={"en": "en-fr", "fr": "fr-it"})
    loaded = TaskSet("europarl", ("en", "fr"), 5, hf=source).load()
    assert loaded.labels == ["en"] * 5 + ["fr"] * 5
    assert all(t.startswith("hello") for t in loaded.texts[:5]) and all(
        t.startswith("salut") for t in loaded.texts[5:]
    )
    # SAEBench's own europarl entry has the same shape (a config per language, translation.<lang>)
    (ours,) = [s for s in SAEBENCH if s.name == "europarl"]
    assert ours.hf.text_field == "translation.{label}" and ours.hf.class_configs["fr"] == "fr-it"

    code = tmp_path / "code"
    write(code, {"default": [{"code": "#" * 10 + ("print(1)" if i % 2 else "int main;") * 3, "language": "Python" if i % 2 else "C"} for i in range(20)]})  # fmt: skip
    loaded = TaskSet(
        "code", ("C", "Python"), 5, hf=HFSource(str(code), "code", "language", skip_chars=10, min_chars=5)
    ).load()
    assert all(not t.startswith("#") for t in loaded.texts)


def test_the_bundled_sets_load_and_each_file_has_its_licence_written():
    """What a fresh install probes on: the licence-clear sets shipped as package data."""
    from mxd_lens.analysis.tasks import OFFLINE_SETS, bundled_data, offline_suite

    root = bundled_data()
    sets = offline_suite(None, root)
    assert {s.name for s in sets} == {"language_id", "debian_set1", "debian_set2", "fortunes_set1", "fortunes_set2",
                                      "vader_snippets"}  # fmt: skip
    assert sum(len(s.tasks) for s in sets) == 26 and len(OFFLINE_SETS) > len(sets)
    readme = (root / "README.md").read_text()
    for path in root.glob("*.jsonl.xz"):
        assert f"| {path.name} |" in readme, path.name
    examples = sets[0].load(root)
    assert len(examples) == sets[0].per_class * len(sets[0].classes)
    with pytest.raises(FileNotFoundError, match="holds none of the offline suite"):
        offline_suite(None, root.parent / "nowhere")


def test_merged_studies_equal_one_study_of_all_layers(text_model, tmp_path, capsys):
    """Probing two layers in one study, or each in its own study and merging the two, gives the same
    tables (the dense ceiling, computed by both, appears once); a study on other texts is refused."""

    import pandas as pd

    from mxd_lens.studies.probe import ProbeOptions as ProbingStudy
    from mxd_lens.studies.probe.run import read_probing_table

    task_set = animal_task_and_layers(text_model, tmp_path)

    def study(layers, out, task=task_set):
        config = ProbingStudy(layers=layers, ks=[1, 2], context_size=12)
        run_probing_study(text_model, config, tmp_path / out, progress=False, task_sets=[task])
        return tmp_path / out

    both = study([str(tmp_path / "final")], "both")
    one = study([str(tmp_path / "final" / "mxd")], "one")
    other = study([str(tmp_path / "final" / "tc")], "other")
    # through the verb: what a user runs
    from mxd_lens.cli import main

    assert main(["probe-merge", str(one), str(other), "--out", str(tmp_path / "merged")]) == 0
    assert "MxD - Transcoder" in capsys.readouterr().out
    merged = {"paired": pd.read_csv(tmp_path / "merged/paired.csv")}

    def rows(table):
        return table.sort_values(["task", "source", "k"]).reset_index(drop=True)

    expected = read_probing_table(both)
    pd.testing.assert_frame_equal(rows(read_probing_table(tmp_path / "merged")), rows(expected))
    for name in ("summary.csv", "paired.csv"):
        pd.testing.assert_frame_equal(
            pd.read_csv(tmp_path / "merged" / name), pd.read_csv(both / name), check_exact=False
        )
    assert len(merged["paired"]) == 2  # MxD - Transcoder at k = 1 and 2
    assert (tmp_path / "merged" / "probing.png").is_file()
    record = json.loads((tmp_path / "merged/probing.json").read_text())
    assert record["merged_from"] == [str(one), str(other)] and len(record["studies"]) == 2

    # a shared row that differs (as from a study on other texts or another model) is named and refused
    tampered = read_probing_table(other)
    dense = tampered.index[tampered.k == "all"][0]
    tampered.loc[dense, "test_accuracy"] -= 0.125
    (tmp_path / "tampered").mkdir()
    tampered.to_csv(tmp_path / "tampered/probing.csv", index=False)
    with pytest.raises(
        ValueError, match=f"{tampered.source[dense]} at k=all on {tampered.task[dense]}.*cannot be merged"
    ):
        merge_probing([one, tmp_path / "tampered"], tmp_path / "refused")
    fewer = read_probing_table(other)
    fewer = fewer[fewer.task != fewer.task[0]]
    (tmp_path / "fewer").mkdir()
    fewer.to_csv(tmp_path / "fewer/probing.csv", index=False)
    with pytest.raises(ValueError, match="other tasks"):
        merge_probing([one, tmp_path / "fewer"], tmp_path / "refused")
    with pytest.raises(ValueError, match="at least two"):
        merge_probing([one], tmp_path / "refused")
    with pytest.raises(FileNotFoundError, match="probing study wrote"):
        merge_probing([one, tmp_path], tmp_path / "refused")
    with pytest.raises(SystemExit, match="mxd-lens probe-merge: .*other tasks"):
        main(["probe-merge", str(one), str(tmp_path / "fewer"), "--out", str(tmp_path / "refused")])


def test_paper_protocol_against_a_hand_loop():
    """probe_paper: top 100 by signed train mean difference, the one-feature probe with the best F1 on the
    chosen split; checked against a direct loop, and selection on test can only flatter."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import f1_score
    from sklearn.preprocessing import StandardScaler

    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 300)
    X = rng.normal(size=(300, 150))
    X[:, 7] += 1.5 * y  # a strong feature
    X[:, 40:140] += 0.3 * y[:, None] * rng.random(100)  # many weak ones
    parts = {"train": list(range(180)), "val": list(range(180, 240)), "test": list(range(240, 300))}
    on_test = probing.probe_paper(X, y, parts, select_on="test")
    on_val = probing.probe_paper(X, y, parts, select_on="val")
    assert on_test["test_f1"] >= on_val["test_f1"]
    tr, te = np.array(parts["train"]), np.array(parts["test"])
    diff = X[tr][y[tr] == 1].mean(0) - X[tr][y[tr] == 0].mean(0)
    best = None
    for f in sorted(range(150), key=lambda f: -diff[f])[:100]:
        scaler = StandardScaler().fit(X[tr][:, [f]])
        probe = LogisticRegression(C=1.0, max_iter=2000).fit(scaler.transform(X[tr][:, [f]]), y[tr])
        f1 = f1_score(y[te], probe.predict(scaler.transform(X[te][:, [f]])))
        if best is None or f1 > best[0]:
            best = (f1, f)
    assert on_test["features"] == [best[1]] and on_test["test_f1"] == pytest.approx(best[0])
    with pytest.raises(ValueError, match="select_on"):
        probing.probe_paper(X, y, parts, select_on="train")


def test_both_protocols_and_the_neuron_baseline_in_one_study(text_model, tmp_path):
    """protocols and neurons add rows without changing the saebench ones; the neurons are the MLP's
    hidden activations (hook_post) mean-pooled like codes; the paper summaries are written apart."""
    import pandas as pd

    from mxd_lens.analysis.probing import pooled_activations
    from mxd_lens.studies.probe import ProbeOptions as ProbingStudy

    task_set = animal_task_and_layers(text_model, tmp_path)
    plain = ProbingStudy(layers=[str(tmp_path / "final")], ks=[1, 2], context_size=12)
    full = dataclasses.replace(plain, protocols=["saebench", "paper", "paper_val"], neurons=True)
    a = run_probing_study(text_model, plain, tmp_path / "a", progress=False, task_sets=[task_set])
    b = run_probing_study(text_model, full, tmp_path / "b", progress=False, task_sets=[task_set])
    keys = ["task", "source", "k"]
    old = a["table"].set_index(keys)["test_accuracy"]
    new = b["table"][b["table"].protocol == "saebench"].set_index(keys)["test_accuracy"]
    pd.testing.assert_series_equal(old, new.loc[old.index])
    sources = set(b["table"].source)
    block = int(next(s for s in sources if s.startswith("mlp_in.L")).split(".L")[1])
    assert f"neurons.L{block}" in sources
    assert set(b["table"].protocol) == {"saebench", "paper", "paper_val"}
    for name in ("summary_paper.csv", "summary_paper_val.csv"):
        assert (tmp_path / "b" / name).is_file()
    # the neurons, pooled: the mean over the text's tokens (after BOS) of the MLP's hook_post
    texts = ["the cat sat", "a dog ran far"]
    pooled = pooled_activations(text_model, {}, texts, [block], context_size=12, progress=False, neurons=True)
    for i, text in enumerate(texts):
        ids = probing.tokenize_texts(text_model, [text], 12)[0]
        _, cache = text_model.run_with_cache(torch.tensor([ids]))
        skip = int(text_model.cfg.default_prepend_bos)
        expected = cache[f"blocks.{block}.mlp.hook_post"][0, skip:].mean(0)
        torch.testing.assert_close(pooled[f"neurons.L{block}"][i], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("per_class", [8, 4])
def test_too_few_examples_per_class_are_refused_up_front_naming_the_option(tmp_path, monkeypatch, per_class):
    """`probe --per-class 8` cannot give every split of a class 2 examples: refused by the study's check,
    before the model is loaded or a text read, naming --per-class and the least that works."""
    import mxd_lens.models
    import mxd_lens.studies.common
    from mxd_lens.analysis.tasks import offline_suite
    from mxd_lens.cli import main
    from mxd_lens.studies.probe import ProbeOptions
    from mxd_lens.studies.probe.run import check

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(mxd_lens.models, "load_model", no_model)
    monkeypatch.setattr(mxd_lens.studies.common, "host_model", no_model)
    argv = ["probe", "--layers", str(tmp_path / "L1"), "--per-class", str(per_class), "--out", str(tmp_path)]
    message = rf"^mxd-lens probe: --per-class {per_class} is too few: .* takes --per-class 9 or more"
    with pytest.raises(SystemExit, match=message):
        main(argv)
    check(ProbeOptions(layers=["L1"], per_class=9))  # the least it names works, with every set's split:
    for task_set in offline_suite(9):
        splits([str(i % 2) for i in range(2 * task_set.per_class)])
