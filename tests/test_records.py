"""The training record a saved layer carries: typed in memory, a plain JSON object on disk."""

from __future__ import annotations

import json
import random

import torch
from sae_lens import SAE
from test_training import SPECS, config, source

from mxd_lens.layers.io import describe_layer, load_layer
from mxd_lens.records import EvaluationRecord, TextRecord, TrainingRecord
from mxd_lens.training import Trainer


def test_a_record_round_trips_and_reads_any_subset_of_its_keys():
    full = TrainingRecord(
        model={"kind": "hub", "name": "m"},
        config={"lr": 0.001},
        learner={"arch": "mxd"},
        tokens=640,
        steps=10,
        epochs=1.5,
        normalization={"input_scale": 2.0, "output_scale": 0.5, "folded": True},
        data={"text": "t", "split": "train"},
        metrics={"fvu": 0.25},
    )
    assert TrainingRecord.from_dict(json.loads(json.dumps(full.to_dict()))) == full
    saved = full.to_dict()
    for _ in range(20):  # an older version wrote fewer keys: the rest read as their defaults
        kept = random.sample(sorted(saved), random.randrange(len(saved) + 1))
        record = TrainingRecord.from_dict({k: saved[k] for k in kept})
        for name in saved:
            expected = saved[name] if name in kept else TrainingRecord.__dataclass_fields__[name].default
            assert getattr(record, name) == expected, name
    assert TrainingRecord.from_dict(None) == TrainingRecord.from_dict({}) == TrainingRecord()
    assert TrainingRecord.from_dict({**saved, "added_later": 1}) == full  # unknown keys are ignored


def test_a_saved_layer_with_an_old_record_loads_both_ways(tmp_path):
    trainer = Trainer(SPECS[:1], source(), config(total_tokens=64 * 4), tmp_path, progress=False)
    trainer.fit()
    folder = tmp_path / "final" / SPECS[0].name
    cfg = json.loads((folder / "cfg.json").read_text())
    record = TrainingRecord.from_dict(cfg["metadata"]["training"])
    assert record == TrainingRecord.of(load_layer(folder)) and record.tokens == trainer.tokens_seen
    # As an older version wrote it: no steps, epochs, normalization or metrics.
    for key in ("steps", "epochs", "normalization", "metrics"):
        del cfg["metadata"]["training"][key]
    (folder / "cfg.json").write_text(json.dumps(cfg))
    old = TrainingRecord.of(load_layer(folder))
    assert (old.steps, old.epochs, old.normalization, old.metrics) == (None, None, None, None)
    assert old.data == record.data and old.tokens == record.tokens
    loaded = SAE.load_from_disk(folder)
    assert loaded.cfg.metadata.training == cfg["metadata"]["training"]
    x = torch.randn(5, loaded.cfg.d_in)
    torch.testing.assert_close(loaded(x), load_layer(folder)(x))
    table = describe_layer(folder)
    assert f"{record.tokens:,}" in table.to_string()


def test_text_and_evaluation_records_read_what_cfg_json_stores():
    text = {"text": "mxd_lens:resources/a.txt", "split": "eval", "eval_fraction": 0.05, "split_seed": 0,
            "digests": {"a.txt": "sha256:00"}}  # fmt: skip
    stored = {"metrics": {"kl": 0.01}, "text": text, "tokens": 640, "context_size": 128, "skip_positions": 0,
              "spliced_from": 1, "model": {"kind": "hub", "name": "m"}, "mxd_lens_version": "0.2.0"}  # fmt: skip
    record = EvaluationRecord.from_dict(stored)
    assert record.to_dict() == stored and record.text == TextRecord.from_dict(text)
    assert record.text.file_name == "a.txt" and "eval side" in record.text.describe()
    # The same measurement is the same text content and side, tokens and context, whatever the name
    renamed = {**stored, "text": {**text, "text": "/elsewhere/b.txt"}, "metrics": {"kl": 0.02}}
    assert EvaluationRecord.from_dict(renamed).key() == record.key()
    for change in ({"tokens": 320}, {"context_size": 64}, {"skip_positions": 4}, {"text": {**text, "split": "train"}},
                   {"text": {**text, "digests": {"a.txt": "sha256:11"}}}):  # fmt: skip
        assert EvaluationRecord.from_dict({**stored, **change}).key() != record.key(), change
    # A layer evaluated before there could be several records one "evaluation"; none at all reads as []
    assert EvaluationRecord.all_of({"evaluation": stored}) == [record]
    assert EvaluationRecord.all_of({"evaluations": [stored, renamed], "evaluation": renamed})[1].metrics == {
        "kl": 0.02
    }
    assert EvaluationRecord.all_of({}) == EvaluationRecord.all_of(None) == []
    older = {k: v for k, v in stored.items() if k != "skip_positions"}  # written before the option
    assert EvaluationRecord.from_dict(older).key() == record.key()
    # one spliced at BOS too (before spliced_from existed) is the measurement a new evaluation replaces
    at_bos = {k: v for k, v in stored.items() if k != "spliced_from"}
    assert (
        EvaluationRecord.from_dict(at_bos).key() == record.key()
        and EvaluationRecord.from_dict(at_bos).spliced_from is None
    )
    assert not TextRecord() and not TrainingRecord().text and TrainingRecord(data=text).text.split == "eval"
