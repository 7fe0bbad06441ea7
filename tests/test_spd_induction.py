"""The toy induction task, its model (checked against a hand-written forward pass) and its trainer."""

from __future__ import annotations

import json
import re

import pytest
import torch

from mxd_lens.spd.induction import (
    InductionTask,
    Plateau,
    accuracy,
    attention_to_memorised_token,
    final_logits,
    induction_model,
    latest_checkpoint,
    load_induction_model,
    sinusoidal_positions,
    train_induction_model,
)

TASK = InductionTask()
SMALL = dict(batch_size=16, eval_size=32, progress=False)


@pytest.fixture(autouse=True)
def one_thread():
    """The CPUs are shared: OpenMP threads that spin-wait for a busy core make tiny steps 100x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_task_ids() -> None:
    assert (TASK.bos, TASK.induction_token, TASK.d_vocab, TASK.seq_len) == (0, 129, 130, 64)


def test_sample_invariants() -> None:
    batch = TASK.sample_batch(512, torch.Generator().manual_seed(0))
    tokens, labels, s1 = batch
    assert tokens.shape == (512, 64) and labels.shape == (512,) and s1.shape == (512,)
    assert tokens.dtype == labels.dtype == torch.long
    assert (tokens[:, 0] == 0).all() and (tokens[:, -1] == 129).all()
    body = tokens[:, 1:-1]
    assert ((body >= 1) & (body <= 129)).all()
    # Exactly one S before the final position, at s1, and the label right after it (before the end).
    is_s = tokens[:, :-1] == 129
    assert (is_s.sum(1) == 1).all()
    assert (is_s.float().argmax(1) == s1).all()
    assert ((s1 >= 1) & (batch.m <= 62)).all() and batch.s2 == 63
    assert (tokens[torch.arange(512), batch.m] == labels).all()
    assert ((labels >= 1) & (labels <= 128)).all()
    assert set(s1.tolist()) == set(range(1, 62))  # every allowed position is drawn


def test_sample_reproducible() -> None:
    a = TASK.sample_batch(8, torch.Generator().manual_seed(3))
    b = TASK.sample(8, torch.Generator().manual_seed(3))
    c = TASK.sample(8, torch.Generator().manual_seed(4))
    assert torch.equal(a.tokens, b[0]) and torch.equal(a.labels, b[1])
    assert not torch.equal(a.tokens, c[0])


def test_bad_inputs(tmp_path) -> None:
    with pytest.raises(ValueError, match="seq_len=3"):
        InductionTask(seq_len=3)
    with pytest.raises(ValueError, match="n_base_tokens=1"):
        InductionTask(n_base_tokens=1)
    with pytest.raises(ValueError, match="batch=0"):
        TASK.sample(0, torch.Generator())
    with pytest.raises(TypeError, match="torch.Generator"):
        TASK.sample(2, 0)
    with pytest.raises(ValueError, match="window"):
        Plateau(window=0)
    with pytest.raises(ValueError, match="batch_size=0"):
        train_induction_model(tmp_path, steps=1, batch_size=0)
    with pytest.raises(FileNotFoundError, match="no induction model"):
        load_induction_model(tmp_path)
    model = induction_model(0)
    tokens, labels = TASK.sample(4, torch.Generator())
    with pytest.raises(ValueError, match="planted"):
        attention_to_memorised_token(model, tokens, labels[:2])
    with pytest.raises(ValueError, match="labels"):
        accuracy(model, tokens, labels[:3])


def test_model_shape_and_frozen_sinusoidal_positions() -> None:
    model = induction_model(0, positional="shortformer")
    cfg = model.cfg
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.d_head, cfg.d_vocab, cfg.n_ctx) == (
        2,
        16,
        1,
        16,
        130,
        64,
    )
    assert cfg.attn_only and cfg.normalization_type is None and cfg.positional_embedding_type == "shortformer"
    assert not model.pos_embed.W_pos.requires_grad
    assert torch.equal(model.pos_embed.W_pos, sinusoidal_positions(64, 16))
    assert torch.allclose(
        model.pos_embed.W_pos[3, :2],
        torch.tensor([torch.sin(torch.tensor(3.0)), torch.cos(torch.tensor(3.0))]),
    )
    state = torch.random.get_rng_state()
    again = induction_model(0, positional="shortformer")
    assert torch.equal(torch.random.get_rng_state(), state)  # the global RNG is untouched
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters(), strict=True))
    assert not torch.equal(induction_model(1, positional="shortformer").embed.W_E, model.embed.W_E)


def test_the_reference_model_has_no_residual_position_code_and_no_biases() -> None:
    model = induction_model(0)  # the default: the reference's model
    assert torch.equal(model.pos_embed.W_pos, torch.zeros(64, 16)) and not model.pos_embed.W_pos.requires_grad
    biases = [p for name, p in model.named_parameters() if name.rsplit(".", 1)[-1].startswith("b_")]
    assert len(biases) == 9 and all(not b.requires_grad and not b.any() for b in biases)  # Q K V O x 2, U
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trained == {"embed.W_E", "unembed.W_U"} | {
        f"blocks.{i}.attn.W_{m}" for i in (0, 1) for m in "QKVO"
    }
    assert torch.equal(model.blocks[0].attn.pe_qk[:, 0], sinusoidal_positions(64, 16))
    with pytest.raises(ValueError, match="positional='rotary': choose one of"):
        induction_model(0, positional="rotary")


def _reference_logits(model, tokens: torch.Tensor, positional: str) -> torch.Tensor:
    """Independent forward pass, no LayerNorm, no MLP. shortformer: positions enter the inputs of the
    query and key maps; after_projection (goodfire-ai/spd ih/model.py): Q = x W_Q + pe, K = x W_K + pe."""
    T = tokens.shape[1]
    resid = model.embed.W_E[tokens]
    pe = sinusoidal_positions(T, 16) * (3.0 if positional == "shortformer" else 1.0)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for block in model.blocks:
        a = block.attn
        if positional == "shortformer":
            q = (resid + pe) @ a.W_Q[0] + a.b_Q[0]
            k = (resid + pe) @ a.W_K[0] + a.b_K[0]
        else:
            q, k = resid @ a.W_Q[0] + pe, resid @ a.W_K[0] + pe
        v = resid @ a.W_V[0] + a.b_V[0]
        scores = (q @ k.transpose(-1, -2) / a.cfg.d_head**0.5).masked_fill(~causal, float("-inf"))
        resid = resid + scores.softmax(-1) @ v @ a.W_O[0] + a.b_O
    return resid @ model.unembed.W_U + model.unembed.b_U


@pytest.mark.parametrize("positional", ["shortformer", "after_projection"])
def test_model_matches_reference_forward(positional) -> None:
    model = induction_model(0, positional=positional)
    with torch.no_grad():
        if positional == "shortformer":  # make the position code matter: larger than TL's init scale
            model.pos_embed.W_pos.mul_(3.0)
        else:
            for block in model.blocks:
                block.attn.W_Q.mul_(0.1)  # ... or the projections smaller than it
                block.attn.W_K.mul_(0.1)
    tokens, _ = TASK.sample(4, torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = _reference_logits(model, tokens, positional)
        torch.testing.assert_close(model(tokens), expected, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(final_logits(model, tokens), expected[:, -1], rtol=1e-4, atol=1e-5)
        # the position code matters: without it the logits differ
        assert (
            (model(tokens) - expected).abs().max()
            < 1e-4
            < (model(tokens[:, 1:]) - expected[:, 1:]).abs().max()
        )


def test_the_position_code_stays_outside_a_decomposed_projection() -> None:
    """SPD replaces W_Q0 at hook_q; the code is added after it, as the reference adds it after q_proj:
    with W_Q0's components and delta masked to 0, layer 0's queries are the code alone."""
    from mxd_lens.spd.components import Decomposition

    model = induction_model(0)
    tokens, _ = TASK.sample(4, torch.Generator().manual_seed(0))
    decomposition = Decomposition(model, ["blocks.0.attn.W_Q"], C=8, ci="token", ci_hidden=4, seed=0)
    with torch.no_grad():
        unchanged = model(tokens)
        with decomposition.patched():  # masks 1, delta on: the model itself
            torch.testing.assert_close(model(tokens), unchanged, rtol=0, atol=1e-5)
        zero = {"blocks.0.attn.W_Q": torch.zeros(4, 64, 8)}
        with decomposition.patched(zero, {"blocks.0.attn.W_Q": torch.zeros(4, 64)}):
            ablated = model(tokens)
        model.blocks[0].attn.W_Q.zero_()
        torch.testing.assert_close(
            ablated, _reference_logits(model, tokens, "after_projection"), rtol=1e-4, atol=1e-5
        )
        assert (ablated - unchanged).abs().max() > 1e-3


def test_attention_to_memorised_token_reads_the_right_entries() -> None:
    model = induction_model(0)
    batch = TASK.sample_batch(6, torch.Generator().manual_seed(1))
    _, cache = model.run_with_cache(batch.tokens)
    rows = torch.arange(6)
    want1 = cache["pattern", 1][rows, 0, -1, batch.m].mean()
    want0 = cache["pattern", 0][rows, 0, batch.m, batch.s1].mean()
    stats = attention_to_memorised_token(model, batch.tokens, batch.s1)
    assert stats["layer1_s2_to_m"] == pytest.approx(float(want1))
    assert stats["layer0_m_to_s1"] == pytest.approx(float(want0))


def test_training_decreases_loss_and_saves(tmp_path) -> None:
    small_task = InductionTask(n_base_tokens=8, seq_len=8)  # learns in tens of steps
    model, history = train_induction_model(
        tmp_path,
        steps=40,
        lr=1e-2,
        task=small_task,
        plateau=None,
        eval_every=10,
        checkpoint_every=0,
        batch_size=64,
        eval_size=256,
        progress=False,
    )
    records = history["records"]
    assert [r["step"] for r in records] == [10, 20, 30, 40]
    assert records[-1]["eval_loss"] < records[0]["eval_loss"] - 0.2
    assert records[-1]["loss"] < records[0]["loss"] - 0.2
    saved = json.loads((tmp_path / "history.json").read_text())
    assert saved["steps"] == 40 and not saved["solved"] and len(saved["records"]) == 4
    loaded = load_induction_model(tmp_path)
    assert not loaded.pos_embed.W_pos.requires_grad and loaded.cfg.d_vocab == 10
    for (name, p), q in zip(model.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(p, q), name


def test_training_stops_when_solved(tmp_path) -> None:
    _, history = train_induction_model(
        tmp_path,
        steps=200,
        lr=3e-2,
        task=InductionTask(n_base_tokens=8, seq_len=8),
        plateau=None,
        positional="shortformer",  # it reaches 0.995 before 1.0 here
        eval_every=10,
        checkpoint_every=0,
        batch_size=64,
        eval_size=256,
        progress=False,
    )
    solved = history["events"][-1]
    assert solved["kind"] == "solved" and solved["eval_acc"] >= 0.995
    assert history["records"][-1]["step"] == solved["step"] < 200
    # A stricter target on resume trains on from there (a reached target stops at once).
    kwargs = dict(
        lr=3e-2,
        task=InductionTask(n_base_tokens=8, seq_len=8),
        plateau=None,
        positional="shortformer",
        eval_every=10,
        checkpoint_every=10,
        batch_size=64,
        eval_size=256,
        progress=False,
    )
    train_induction_model(tmp_path / "b", steps=solved["step"], **kwargs)
    _, more = train_induction_model(tmp_path / "b", steps=solved["step"] + 20, target_accuracy=1.0, **kwargs)
    assert more["records"][-1]["step"] > solved["step"] and more["config"]["target_accuracy"] == 1.0


def test_training_stops_on_a_loss_plateau_and_the_rule_may_change_on_resume(tmp_path) -> None:
    kwargs = dict(lr=1e-5, task=InductionTask(n_base_tokens=8, seq_len=8), plateau=None, eval_every=10,
                  checkpoint_every=10, batch_size=32, eval_size=64, progress=False, target_accuracy=None)  # fmt: skip
    _, history = train_induction_model(tmp_path, steps=500, stop_window=30, stop_tolerance=0.5, **kwargs)
    (event,) = history["events"]
    records = history["records"]
    assert event["kind"] == "loss_plateau" and records[-1]["step"] == event["step"] == 40 < 500
    # the rule, by hand: the loss 30 steps back, against the best since, fell by less than half
    then = next(r for r in records if r["step"] == event["step"] - 30)
    assert min(r["eval_loss"] for r in records if r["step"] > then["step"]) >= 0.5 * then["eval_loss"]
    _, more = train_induction_model(tmp_path, steps=60, stop_window=0, **kwargs)  # no rule: trains on
    assert more["records"][-1]["step"] == 60 and more["config"]["stop_window"] == 0


def test_plateau_raises_lr_once(tmp_path) -> None:
    plateau = Plateau(window=2, margin=0.5, below=1.01, factor=3.0, max_raises=1)
    _, history = train_induction_model(
        tmp_path, steps=6, plateau=plateau, eval_every=1, checkpoint_every=0, **SMALL
    )
    (event,) = history["events"]
    assert (
        event["kind"] == "plateau_lr_raised" and event["step"] == 3 and event["lr_to"] == pytest.approx(3e-3)
    )
    assert [r["lr"] for r in history["records"]] == pytest.approx([1e-3] * 3 + [3e-3] * 3)


def test_resume_matches_uninterrupted_run(tmp_path) -> None:
    kwargs = dict(
        plateau=Plateau(window=4, margin=0.5, below=1.01), eval_every=1, checkpoint_every=2, **SMALL
    )
    straight, history = train_induction_model(tmp_path / "a", steps=7, **kwargs)
    train_induction_model(tmp_path / "b", steps=3, **kwargs)  # "killed" after step 3
    assert latest_checkpoint(tmp_path / "b").name == "step_000000003"
    resumed, history_b = train_induction_model(tmp_path / "b", steps=7, **kwargs)
    for (name, p), q in zip(straight.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(p, q), name
    assert history_b["events"] == history["events"] and history["events"][0]["step"] == 5

    def strip(records):
        return [{k: v for k, v in r.items() if k != "s_per_step"} for r in records]

    assert strip(history_b["records"]) == strip(history["records"])
    with pytest.raises(ValueError, match="other settings"):
        train_induction_model(tmp_path / "b", steps=8, **{**kwargs, "lr": 2e-3})
    assert len(list((tmp_path / "b" / "checkpoints").glob("step_*"))) == 2


def test_induction_spd_study_train_report_summary(tmp_path):
    """The study's functions on a briefly trained model: a run resumes to the asked steps, the report
    and the summary are written, another model for the same run is refused."""
    import json

    from mxd_lens.spd.induction import train_induction_model
    from mxd_lens.studies.spd_induction import SPDInductionOptions
    from mxd_lens.studies.spd_induction import run as study_lib

    train_induction_model(
        tmp_path / "model", steps=5, batch_size=32, eval_every=5, eval_size=64, progress=False
    )
    study = SPDInductionOptions(variant="token-stoch", steps=4, batch_size=4)
    first = study_lib.train_variant(study, tmp_path, progress=False)
    assert (first["from_step"], first["to_step"]) == (0, 4)
    more = study_lib.train_variant(SPDInductionOptions(variant="token-stoch", steps=6, batch_size=4), tmp_path,
                                   progress=False)  # fmt: skip
    assert (more["from_step"], more["to_step"]) == (4, 6)
    report = study_lib.report_variant(  # 3 PGD steps, not 20: KL 0.0035 over the stochastic draw's 0.0007
        SPDInductionOptions(variant="token-stoch", steps=6, batch_size=4, pruning_draws=2, pgd_steps=3),
        tmp_path,
    )
    assert report["training"]["steps"] == 6 and (tmp_path / "token-stoch/ci_by_position.png").is_file()
    from mxd_lens.spd.pruning import pruning_table
    from mxd_lens.spd.report import EXPECTED_CIRCUIT, POSITION_CLASSES

    checked = {r["module"] for r in report["pruning"]}  # every one-component module still above 1.5
    assert checked == {
        name
        for name, (where, count) in EXPECTED_CIRCUIT.items()
        if count == 1 and report["modules"][name]["l0"][POSITION_CLASSES.index(where)] > 1.5
    }
    assert checked and all(
        r["keep"][-1]["k"] == 1 and r["where"] in POSITION_CLASSES for r in report["pruning"]
    )
    assert pruning_table(report["pruning"]).count("\n") == 1 + sum(len(r["keep"]) for r in report["pruning"])
    from mxd_lens.spd.report import adversarial_table

    adv = report["adversarial"]  # the PGD masks find a KL at least the stochastic draw's
    assert adv["adversarial"]["all"]["kl_all"] >= adv["stochastic"]["all"]["kl_all"]
    assert "all modules" in adversarial_table(report) and "Q0" in adversarial_table(report)
    table = study_lib.summarize_variants(tmp_path)
    assert "token-stoch" in table and json.loads((tmp_path / "summary.json").read_text())["token-stoch"]
    with pytest.raises(ValueError, match="was trained on"):
        study_lib.train_variant(
            SPDInductionOptions(variant="token-stoch", model=str(tmp_path / "x.pt")), tmp_path
        )


def test_the_reference_recipe_is_goodfire_spds_ih_config_and_overrides_get_their_own_folder() -> None:
    from mxd_lens.studies.spd_induction import SPDInductionOptions as InductionSPDStudy
    from mxd_lens.studies.spd_induction.run import make_config

    ref = make_config("ref-token-stoch", steps=1000, batch_size=16)
    assert (ref.C, ref.ci_hidden, ref.ci, ref.faithfulness, ref.faithfulness_warmup_steps) == (
        100,
        128,
        "token",
        100.0,
        200,
    )
    assert (ref.faithfulness_warmup_lr, ref.faithfulness_warmup_weight_decay) == (1e-2, 0.1)
    assert (ref.stochastic_recon, ref.layerwise_recon, ref.ci_masked_recon, ref.subset_recon) == (
        1.0,
        1.0,
        1.0,
        0.0,
    )
    assert (ref.minimality, ref.p_at(0), ref.p_at(999), ref.positions, ref.minimality_reduce) == (
        1e-2,
        0.1,
        0.1,
        "all",
        "mean",
    )
    first = make_config("sequence-subset", steps=1000, batch_size=16)
    assert (first.C, first.faithfulness, first.positions, first.p_at(0), first.subset_recon) == (
        32,
        1e5,
        "last",
        2.0,
        1.0,
    )
    assert InductionSPDStudy("ref-sequence-subset").name == "ref-sequence-subset"
    assert InductionSPDStudy("ref-sequence-subset", C=100, ci_hidden=16).name == "ref-sequence-subset-h16"
    assert InductionSPDStudy("token-stoch", minimality=0.1, C=64).name == "token-stoch-min0.1-c64"
    assert InductionSPDStudy("ref-token-subset", ci_hidden=16).config().ci_hidden == 16
    with pytest.raises(ValueError, match="variant='nope'"):
        make_config("nope", 10, 16)


def test_training_in_trend_chunks_is_the_same_run_and_records_each_chunk(tmp_path):
    import json

    from mxd_lens.spd.induction import train_induction_model
    from mxd_lens.studies.spd_induction import SPDInductionOptions
    from mxd_lens.studies.spd_induction import run as study_lib

    train_induction_model(
        tmp_path / "model", steps=5, batch_size=32, eval_every=5, eval_size=64, progress=False
    )
    model = str(tmp_path / "model" / "model.pt")
    small = dict(variant="ref-token-stoch", steps=5, batch_size=4, C=4, ci_hidden=4, model=model)
    study_lib.train_variant(SPDInductionOptions(**small), tmp_path / "whole", progress=False)
    chunked = SPDInductionOptions(**small, trend_every=2)
    study_lib.train_variant(chunked, tmp_path / "chunks", progress=False)
    name = chunked.name
    points = [
        json.loads(line) for line in (tmp_path / "chunks" / name / "trend.jsonl").read_text().splitlines()
    ]
    assert [p["step"] for p in points] == [0, 2, 4, 5] and set(points[0]["l0"]) == {
        "Q0",
        "K0",
        "V0",
        "O0",
        "Q1",
        "K1",
        "V1",
        "O1",
    }
    assert (
        all(len(v) == 4 for v in points[-1]["l0"].values())
        and (tmp_path / "chunks" / name / "trend.png").is_file()
    )
    states = [torch.load(root / name / "checkpoints" / "step_000000005" / "state.pt", weights_only=True)
              for root in (tmp_path / "whole", tmp_path / "chunks")]  # fmt: skip
    for key, value in states[0]["decomposition"].items():
        assert torch.equal(value, states[1]["decomposition"][key]), key
    # the chunked history also logs each chunk's last step; everything the whole run logged is in it
    assert [r["step"] for r in states[1]["history"]] == [2, 4, 5]
    assert all(r in states[1]["history"] for r in states[0]["history"])


def test_the_model_verb_options_are_the_trainers_keyword_arguments_with_its_defaults():
    """mxd-lens spd-induction-model's options (a torch-free dataclass, so --help is quick) name every
    keyword argument of InductionTrainer that a user sets, with the same defaults."""
    import dataclasses
    import inspect

    from mxd_lens.spd.induction import InductionTrainer
    from mxd_lens.studies.spd_induction import InductionModelOptions

    signature = inspect.signature(InductionTrainer.__init__).parameters
    for option in dataclasses.fields(InductionModelOptions):
        if option.name in ("plateau", "steps"):  # a switch here (the trainer takes the rule); steps: required
            continue
        assert option.name in signature, option.name
        assert signature[option.name].default == option.default, option.name


def test_a_run_kept_in_a_folder_resumes_bit_exactly_on_a_fresh_machine(tmp_path):
    """Train 3 of 6 steps keeping the state in a folder; copy only that folder to a new place (what a
    fresh clone of the repository holds: no results/, no model where the run recorded it), resume to 6:
    the decomposition, the optimiser and the mask generator equal an unbroken 6-step run's exactly."""
    import json
    import shutil

    from mxd_lens.loop import ResumeMismatch
    from mxd_lens.spd.induction import train_induction_model
    from mxd_lens.studies.spd_induction import SPDInductionOptions
    from mxd_lens.studies.spd_induction import run as study_lib

    train_induction_model(
        tmp_path / "model", steps=5, batch_size=32, eval_every=5, eval_size=64, progress=False
    )
    model = tmp_path / "model" / "model.pt"
    small = dict(variant="ref-token-subset", steps=6, batch_size=4, C=4, ci_hidden=4, model=str(model))
    name = SPDInductionOptions(**small).name
    study_lib.train_variant(SPDInductionOptions(**small), tmp_path / "unbroken", progress=False)

    kept = tmp_path / "repo" / "docs" / "kept"
    first = study_lib.train_variant(
        SPDInductionOptions(**small, until=3, trend_every=2, keep_in=str(kept)),
        tmp_path / "machine1",
        progress=False,
    )
    assert (first["from_step"], first["to_step"]) == (0, 3)
    assert json.loads((kept / "checkpoint" / "trainer_state.json").read_text())["step"] == 3
    assert {"run_config.json", "trend.jsonl", "train_log.jsonl", "model.pt"} <= {
        p.name for p in kept.iterdir()
    }
    clone = tmp_path / "clone" / "docs" / "kept"
    shutil.copytree(kept, clone)  # only what was kept travels
    shutil.rmtree(tmp_path / "machine1")
    model.rename(tmp_path / "elsewhere.pt")  # the recorded model path no longer exists
    fresh = SPDInductionOptions(**{**small, "model": None}, trend_every=2, keep_in=str(clone))
    second = study_lib.train_variant(fresh, tmp_path / "machine2", progress=False)
    assert (second["from_step"], second["to_step"]) == (3, 6)
    states = [torch.load(root / name / "checkpoints" / "step_000000006" / "state.pt", weights_only=True)
              for root in (tmp_path / "unbroken", tmp_path / "machine2")]  # fmt: skip
    for part in ("decomposition",):
        for key, value in states[0][part].items():
            assert torch.equal(value, states[1][part][key]), key
    assert torch.equal(states[0]["generator"], states[1]["generator"])
    for a, b in zip(
        states[0]["optimizer"]["state"].values(), states[1]["optimizer"]["state"].values(), strict=True
    ):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((clone / "checkpoint" / "trainer_state.json").read_text())["step"] == 6
    runs = [json.loads(line) for line in (clone / "train_log.jsonl").read_text().splitlines()]
    assert [(r["from_step"], r["to_step"]) for r in runs] == [(0, 3), (3, 6)]
    # the kept state is reported on yet another machine, from the kept files alone
    report = study_lib.report_variant(
        SPDInductionOptions(**{**small, "model": None, "pgd_steps": 0}, keep_in=str(clone)),
        tmp_path / "machine6",
    )
    assert report["training"]["steps"] == 6
    with pytest.raises(ValueError, match="--keep-in"):
        study_lib.report_variant(SPDInductionOptions(**small), tmp_path / "machine7")

    # a kept state of another configuration is refused, naming what differs
    other = SPDInductionOptions(**{**small, "model": None, "C": 4}, minimality=0.5, keep_in=str(clone))
    with pytest.raises(ResumeMismatch, match="minimality"):
        study_lib.train_variant(other, tmp_path / "machine3", progress=False)
    # and so is one written by another version of the CI functions
    import mxd_lens.spd.ci

    original = mxd_lens.spd.ci.CI_VERSION
    mxd_lens.spd.ci.CI_VERSION = original + 1
    try:
        with pytest.raises(ResumeMismatch, match="another version of the SPD CI functions"):
            study_lib.train_variant(
                SPDInductionOptions(**{**small, "model": None, "steps": 8}, keep_in=str(clone)), tmp_path / "machine4",
                progress=False,
            )  # fmt: skip
    finally:
        mxd_lens.spd.ci.CI_VERSION = original
    with pytest.raises(ValueError, match="--until 9"):
        study_lib.train_variant(SPDInductionOptions(**small, until=9), tmp_path / "machine5", progress=False)


def _kept_run_setup(tmp_path):
    """A 5-step toy model and the options of a tiny SPD run of it."""
    from mxd_lens.spd.induction import train_induction_model

    train_induction_model(
        tmp_path / "model", steps=5, batch_size=32, eval_every=5, eval_size=64, progress=False
    )
    model = tmp_path / "model" / "model.pt"
    return dict(variant="ref-token-subset", steps=6, batch_size=4, C=4, ci_hidden=4, model=str(model))


def _snapshot(folder):
    return {
        p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def test_a_kept_state_of_another_run_is_refused_before_anything_is_copied(tmp_path):
    """`train --keep-in K` with K holding another configuration's run was refused only after K's
    checkpoint had become OUT's `latest` and K's trend.jsonl / train_log.jsonl had replaced OUT's, so the
    user's run could not resume even without --keep-in. Now OUT is byte-identical after the refusal."""
    from mxd_lens.loop import ResumeMismatch
    from mxd_lens.studies.spd_induction import SPDInductionOptions
    from mxd_lens.studies.spd_induction import run as study_lib

    small = _kept_run_setup(tmp_path)
    kept = tmp_path / "repo" / "kept"
    other = {**small, "batch_size": 2}  # not in the run's name: the same OUT folder
    study_lib.train_variant(
        SPDInductionOptions(**other, until=4, keep_in=str(kept)), tmp_path / "other", progress=False
    )
    mine = tmp_path / "mine"
    study_lib.train_variant(SPDInductionOptions(**small, until=2, trend_every=1), mine, progress=False)
    out = mine / SPDInductionOptions(**small).name
    before = _snapshot(out)
    assert {"checkpoints/latest", "trend.jsonl", "train_log.jsonl", "run_config.json"} <= set(before)
    # the run asked is OUT's own; K keeps another: refused naming K and what differs
    with pytest.raises(ResumeMismatch) as info:
        study_lib.train_variant(SPDInductionOptions(**small, keep_in=str(kept)), mine, progress=False)
    assert _snapshot(out) == before  # was: K's step 4 as `latest`, K's trend.jsonl and train_log.jsonl
    assert re.fullmatch(
        rf"--keep-in {kept}: {kept / 'checkpoint'} .*'batch_size': \(2, 4\).*nothing was copied .*",
        str(info.value),
    )
    # the run asked is K's, but OUT holds another: refused too, before anything is copied or written
    with pytest.raises(
        ResumeMismatch, match=rf"--keep-in {kept} keeps another run than {out} holds .*batch_size"
    ):
        study_lib.train_variant(SPDInductionOptions(**other, keep_in=str(kept)), mine, progress=False)
    assert _snapshot(out) == before
    # and so does a report of OUT given that K
    with pytest.raises(ResumeMismatch, match="keeps another run than"):
        study_lib.report_variant(SPDInductionOptions(**small, pgd_steps=0, keep_in=str(kept)), mine)
    assert _snapshot(out) == before
    # a refused resume of OUT itself (other settings, no K) leaves its run_config.json alone
    with pytest.raises(ResumeMismatch, match="batch_size"):
        study_lib.train_variant(SPDInductionOptions(**other), mine, progress=False)
    assert _snapshot(out) == before
    # the user's run resumes
    record = study_lib.train_variant(SPDInductionOptions(**small), mine, progress=False)
    assert (record["from_step"], record["to_step"]) == (2, 6)


def test_a_second_run_keeping_into_the_same_folder_is_refused(tmp_path):
    """Two runs keeping into one K at once were not refused, and one run's state silently disappeared."""
    import os
    import subprocess
    import sys

    from mxd_lens.studies.spd_induction import SPDInductionOptions
    from mxd_lens.studies.spd_induction import run as study_lib

    small = _kept_run_setup(tmp_path)
    kept = tmp_path / "kept"
    holder = subprocess.Popen(  # the first run, still keeping into K
        [sys.executable, "-c", "import sys; from mxd_lens.studies.spd_induction.run import lock_kept; "
         f"held = lock_kept(__import__('pathlib').Path({str(kept)!r})); print('held', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(
            RuntimeError,
            match=rf"^--keep-in {kept} is in use by another run keeping its state there \(pid {holder.pid}\): wait",
        ) as info:
            study_lib.train_variant(
                SPDInductionOptions(**small, keep_in=str(kept)), tmp_path / "second", progress=False
            )
        assert "\n" not in str(info.value)
        assert not (tmp_path / "second").exists() and not (kept / "checkpoint").exists()
    finally:
        holder.stdin.close()
        holder.wait()
    record = study_lib.train_variant(
        SPDInductionOptions(**small, until=2, keep_in=str(kept)), tmp_path / "second", progress=False
    )
    assert record["to_step"] == 2 and os.path.isdir(kept / "checkpoint")  # released: the next run keeps there


@pytest.mark.parametrize(
    "damage, file, what",
    [
        (lambda k: (k / "checkpoint" / "trainer_state.json").write_text('{"step": 3,'), "checkpoint/trainer_state.json", r"is not valid JSON \(line 1: "),
        (lambda k: (k / "checkpoint" / "trainer_state.json").write_text('{"nostep": 1}'), "checkpoint/trainer_state.json", "has no step count"),
        (lambda k: (k / "checkpoint" / "state.pt").write_bytes((k / "checkpoint" / "state.pt").read_bytes()[:500]), "checkpoint/state.pt", "cannot be read"),
        (lambda k: (k / "checkpoint" / "state.pt").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:ab\nsize 9\n"), "checkpoint/state.pt", "is a Git LFS pointer"),
        (lambda k: (k / "checkpoint" / "state.pt").unlink(), "checkpoint/state.pt", r"is missing"),
        (lambda k: (k / "train_log.jsonl").write_text((k / "train_log.jsonl").read_text() + "{oops\n"), "train_log.jsonl", r"is not valid JSON \(line 2: "),
        (lambda k: (k / "trend.jsonl").write_text("[1]\n"), "trend.jsonl", "line 1 is not a JSON object"),
        (lambda k: (k / "run_config.json").write_bytes(b"\xff{}"), "run_config.json", "is not UTF-8 text"),
    ],
    ids=["trainer-state-json", "trainer-state-step", "state-truncated", "state-lfs-pointer", "state-missing", "train-log", "trend", "run-config"],
)  # fmt: skip
def test_a_damaged_kept_state_is_reported_by_its_file_in_the_kept_folder(
    tmp_path, damage, file, what, capsys
):
    """A damaged --keep-in state was reported by the path of its copy in OUT, or by a bare JSON error
    (or not at all: a damaged train_log.jsonl was copied into OUT). Now: one line naming the file in K
    and what is wrong, and nothing is copied into OUT."""
    from mxd_lens.cli import main

    small = _kept_run_setup(tmp_path)
    kept = tmp_path / "kept"
    argv = ["spd-induction", "train", "--variant", small["variant"], "--steps", "6", "--batch-size", "4",
            "--C", "4", "--ci-hidden", "4", "--model", small["model"], "--keep-in", str(kept)]  # fmt: skip
    assert main([*argv, "--until", "3", "--trend-every", "3", "--out", str(tmp_path / "first")]) == 0
    damage(kept)
    with pytest.raises(SystemExit) as info:
        main([*argv, "--out", str(tmp_path / "fresh")])
    first_line = str(info.value.code).splitlines()[0]
    assert re.fullmatch(
        rf"mxd-lens spd-induction: kept state {re.escape(str(kept / file))} {what}.*", first_line
    ), first_line
    assert str(tmp_path / "fresh") not in first_line
    assert not list((tmp_path / "fresh").rglob("*.json*"))  # nothing copied into OUT
