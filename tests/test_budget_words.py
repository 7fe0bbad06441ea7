"""Words that mean one thing: the frontier's and the demo's --cache-tokens (old spelling --train-tokens) is
the text they cache, training tokens = --epochs x --cache-tokens, and the epochs over the cache that
makes are fewer where the cache holds whole shards; `mxd-lens eval` says its tokens and forwards before
it runs them (counted here with a hook on the model's unembedding, each forward's last step)."""

from __future__ import annotations

import logging

import pytest
from conftest import make_text_model

from mxd_lens.cli import build_parser, main


def _help(verb: str, capsys) -> str:
    with pytest.raises(SystemExit):
        main([verb, "--help"])
    return " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("verb", ["frontier", "demo"])
def test_cache_tokens_and_epochs_say_the_same_thing_in_the_help_of_both_studies(verb, capsys):
    text = _help(verb, capsys)
    assert "--cache-tokens" in text and "--train-tokens" in text  # the old spelling still taken
    assert "training tokens = epochs x this" in text  # --cache-tokens' help
    assert "training tokens = epochs x --cache-tokens" in text  # --epochs' help
    assert "epochs over it the output reports are a little fewer" in text
    base = [verb, "--blocks", "3"] if verb == "frontier" else [verb]
    new, old = (
        build_parser(verb).parse_args([*base, flag, "5000"]).study
        for flag in ("--cache-tokens", "--train-tokens")
    )
    assert new.train_tokens == old.train_tokens == 5000
    # `mxd-lens train`'s --epochs keeps its own meaning: passes over the cache it is given
    assert "--epochs [float] passes over the activation cache" in _help("train", capsys)


def test_the_frontier_counts_training_tokens_as_epochs_times_cache_tokens():
    from mxd_lens.studies.frontier import FrontierConfig, StudyTrainConfig, budget_words

    config = FrontierConfig(
        blocks=[1], ks=[2], train_tokens=1000, train=StudyTrainConfig(epochs=2.5, batch_tokens=64)
    )
    assert config.train_config(0).total_tokens == 2500 // 64 * 64
    assert budget_words(2496, 1200, 2.5, 1000) == (
        "2,496 training tokens (2.5 x 1,000 cache tokens; 2.08 epochs over the 1,200 tokens the cache holds "
        "in whole shards)"
    )
    assert budget_words(640, 320, None, 1000).startswith("640 training tokens (--tokens; 2.00 epochs over")


def test_eval_says_its_tokens_and_forwards_before_it_runs_them(tmp_path, monkeypatch):
    import mxd_lens.models
    from mxd_lens.layers import MxD, TopKTranscoder

    model, corpus = make_text_model(tmp_path)
    monkeypatch.setattr(mxd_lens.models, "load_model", lambda name, **kw: model)
    TopKTranscoder.for_model(model, 1, d_sae=8, k=2).save_model(tmp_path / "layers" / "a")
    MxD.for_model(model, 1, d_sae=4, k=2).save_model(tmp_path / "layers" / "b")
    TopKTranscoder.for_model(model, 2, d_sae=8, k=2).save_model(tmp_path / "layers" / "c")
    forwards: list[int] = []
    model.unembed.register_forward_hook(lambda *_: forwards.append(1))
    said: list[tuple[str, int]] = []

    class Said(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append((record.getMessage(), len(forwards)))

    logger = logging.getLogger("mxd_lens.studies.eval.run")
    handler = Said()
    logger.addHandler(handler)
    try:
        with pytest.warns(UserWarning):  # untrained layers with no training record: said, not refused
            assert main(["eval", str(tmp_path / "layers"), "--model", "tiny", "--text", str(corpus),
                         "--eval-tokens", "240", "--context-size", "12", "--rows-per-forward", "8",
                         "--nowrite"]) == 0  # fmt: skip
    finally:
        logger.removeHandler(handler)
    (line, before), *_ = [(m, n) for m, n in said if m.startswith("eval: ")]
    assert before == 0 and "\n" not in line  # one line, before the first forward
    # 20 rows of 12 tokens in batches of 8 rows: 3 batches; 3 layers at blocks 1 and 2
    assert line.startswith(
        "eval: 3 layer(s) at block(s) 1, 2 on 240 held-out tokens (20 rows of 12) in 3 batches: "
    )
    assert (
        f"{len(forwards)} model forwards (3 clean, 9 spliced, 12 with the MLP zero- or mean-ablated" in line
    )
