"""The trainer: it learns, is reproducible, resumes bit for bit (also after SIGKILL), splits exactly over
DDP ranks, and stops cleanly on NaN or a full disk."""

from __future__ import annotations

import itertools
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import make_model
from sae_lens import SAE
from safetensors.torch import load_file
from test_activations import random_rows

from mxd_lens.activations import CachedActivations, ModelActivations, write_cache
from mxd_lens.checkpoints import CheckpointError
from mxd_lens.layers.learners import LearnerSpec
from mxd_lens.loop import TrainingDiverged
from mxd_lens.training import TrainConfig, Trainer

SPECS = [
    LearnerSpec("mxd", 1, k=4, width_multiplier=8),
    LearnerSpec("transcoder", 1, k=4, width_multiplier=8),
    LearnerSpec("skip_transcoder", 1, k=4, width_multiplier=8),
    LearnerSpec("mxd", 2, k=2, width_multiplier=8),
]


def source(kind="gpt2", blocks=(1, 2), rows_per_shard=16):
    return ModelActivations(
        make_model(kind), list(blocks), random_rows(), context_size=12, rows_per_shard=rows_per_shard
    )


def config(**overrides):
    base = dict(
        total_tokens=64 * 30, batch_tokens=64, lr=3e-3, warmup_steps=5, checkpoint_every=10, log_every=5
    )
    return TrainConfig(**{**base, **overrides})


def final_weights(out: Path) -> dict[str, dict[str, torch.Tensor]]:
    return {
        p.name: load_file(p / "sae_weights.safetensors")
        for p in sorted((out / "final").iterdir())
        if p.is_dir()
    }


def crash_at(trainer, step, monkeypatch):
    """Run ``trainer.fit()`` and interrupt it (KeyboardInterrupt) as it starts step ``step``."""
    real_step = Trainer._train_step

    def crashing(self, *args):
        if self.step == step:
            raise KeyboardInterrupt
        return real_step(self, *args)

    monkeypatch.setattr(Trainer, "_train_step", crashing)
    with pytest.raises(KeyboardInterrupt):
        trainer.fit()
    monkeypatch.setattr(Trainer, "_train_step", real_step)


def assert_identical(a, b):
    assert a.keys() == b.keys()
    for name in a:
        for key in a[name]:
            assert torch.equal(a[name][key], b[name][key]), (name, key)


def test_learners_learn_and_keep_their_invariants(tmp_path):
    trainer = Trainer(SPECS, source(), config(total_tokens=64 * 80), tmp_path, progress=False)
    metrics = trainer.fit()
    for name, learner in trainer.learners.items():
        history = learner.history
        assert history[-1]["fvu"] < 0.6 * history[0]["fvu"], name
        assert history[-1]["l0"] <= learner.spec.k
        assert 0 <= history[-1]["dead_fraction"] <= 1
        assert metrics[name] == {k: v for k, v in history[-1].items() if k not in ("step", "tokens")}
        norms = learner.layer.W_dec.norm(dim=-1)
        if learner.spec.normalizes_decoder:
            torch.testing.assert_close(norms, torch.ones_like(norms))
        assert all(torch.isfinite(p).all() for p in learner.layer.parameters())
    assert trainer.fit(resume=True) == metrics  # resuming a finished run changes nothing
    # Final weights load through SAELens with the training record in their metadata.
    loaded = SAE.load_from_disk(tmp_path / "final" / SPECS[0].name)
    record = loaded.cfg.metadata.training
    assert (
        record["tokens"] == 64 * 80
        and record["learner"]["arch"] == "mxd"
        and record["metrics"]["fvu"] == metrics[SPECS[0].name]["fvu"]
    )
    assert loaded.cfg.metadata.hook_name_out == "blocks.1.hook_mlp_out"
    assert json.loads((tmp_path / "final" / "metrics.json").read_text()).keys() == trainer.learners.keys()


def test_same_seed_same_weights_other_seed_other_weights(tmp_path):
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        Trainer(SPECS[:2], source(), config(seed=seed), tmp_path / name, progress=False).fit()
    assert_identical(final_weights(tmp_path / "a"), final_weights(tmp_path / "b"))
    a, c = final_weights(tmp_path / "a"), final_weights(tmp_path / "c")
    assert not torch.equal(a[SPECS[0].name]["W_enc"], c[SPECS[0].name]["W_enc"])


def test_cache_and_live_model_train_identically(tmp_path):
    live = source("gated")
    write_cache(live, tmp_path / "cache", n_shards=5, progress=False)
    cached = CachedActivations(tmp_path / "cache", shuffle="shard")  # the live stream's order
    cfg = config(total_tokens=64 * 10, init_b_dec="target_mean", objective="paper")
    Trainer(SPECS, live, cfg, tmp_path / "live", progress=False).fit()
    Trainer(SPECS, cached, cfg, tmp_path / "cached", progress=False).fit()
    assert_identical(final_weights(tmp_path / "live"), final_weights(tmp_path / "cached"))


def test_resume_after_a_crash_is_bit_identical(tmp_path, monkeypatch):
    Trainer(SPECS, source(), config(), tmp_path / "whole", progress=False).fit()

    crash_at(Trainer(SPECS, source(), config(), tmp_path / "broken", progress=False), 17, monkeypatch)
    assert (tmp_path / "broken" / "checkpoints" / "latest").read_text() == "step_000000010"
    Trainer(SPECS, source(), config(), tmp_path / "broken", progress=False).fit(resume=True)
    assert_identical(final_weights(tmp_path / "whole"), final_weights(tmp_path / "broken"))


def test_resume_with_other_settings_is_refused(tmp_path):
    trainer = Trainer(SPECS[:1], source(), config(total_tokens=64 * 10), tmp_path, progress=False)
    trainer.fit()
    with pytest.raises(ValueError, match="other settings.*'lr': \\(0.003, 0.001\\)"):
        Trainer(SPECS[:1], source(), config(lr=1e-3), tmp_path, progress=False).fit(resume=True)
    with pytest.raises(ValueError, match="trained other learners"):
        Trainer(SPECS[1:2], source(), config(), tmp_path, progress=False).fit(resume=True)


def test_resume_matches_the_text_by_content_not_by_how_its_path_was_spelled(tmp_path, monkeypatch):
    """A run recorded with a relative text path resumes when asked with the absolute one (and a
    "path" beside it, as runs record now); another digest is refused."""
    info = {"text": "data/a.txt", "split": "train", "eval_fraction": 0.02, "split_seed": 0,
            "digests": {"a.txt": "sha256:" + "1" * 64}}  # fmt: skip
    crash_at(
        Trainer(SPECS[:1], source(), config(), tmp_path, progress=False, data_info=info), 17, monkeypatch
    )
    moved = {**info, "text": "/elsewhere/data/a.txt", "path": "/elsewhere/data/a.txt"}
    Trainer(SPECS[:1], source(), config(), tmp_path, progress=False, data_info=moved).fit(resume=True)
    crash_at(
        Trainer(SPECS[:1], source(), config(), tmp_path / "b", progress=False, data_info=info),
        17,
        monkeypatch,
    )
    edited = {**info, "digests": {"a.txt": "sha256:" + "2" * 64}}
    with pytest.raises(ValueError, match="trained on other data"):
        Trainer(SPECS[:1], source(), config(), tmp_path / "b", progress=False, data_info=edited).fit(
            resume=True
        )


def test_a_checkpoint_whose_learners_record_layer_resumes(tmp_path, monkeypatch):
    """``layer`` was the block index's name before the rename: a checkpoint whose learners record
    "layer" resumes to the same weights."""
    whole = Trainer(SPECS[:1], source(), config(), tmp_path / "whole", progress=False)
    whole.fit()
    crash_at(Trainer(SPECS[:1], source(), config(), tmp_path / "old", progress=False), 17, monkeypatch)
    state_file = tmp_path / "old/checkpoints/step_000000010/trainer_state.json"
    state = json.loads(state_file.read_text())
    for spec in state["learners"].values():
        spec["layer"] = spec.pop("block")
    state_file.write_text(json.dumps(state))
    Trainer(SPECS[:1], source(), config(), tmp_path / "old", progress=False).fit(resume=True)
    assert_identical(final_weights(tmp_path / "whole"), final_weights(tmp_path / "old"))


def test_the_block_index_has_no_other_name():
    from mxd_lens.layers import MxD

    with pytest.raises(TypeError):
        MxD.for_model(make_model("gpt2"), layer=1, d_sae=8, k=2)
    assert not hasattr(SPECS[0], "layer")


def test_nan_loss_stops_and_names_the_last_good_checkpoint(tmp_path, monkeypatch):
    trainer = Trainer(SPECS[:1], source(), config(), tmp_path, progress=False)
    real_step = Trainer._train_step

    def poison_at_13(self, learner, x, y):
        return real_step(self, learner, x, y * float("inf") if self.step == 13 else y)

    monkeypatch.setattr(Trainer, "_train_step", poison_at_13)
    with pytest.raises(
        TrainingDiverged, match="loss is (nan|inf) at step 13; the last good checkpoint is .*step_000000010"
    ):
        trainer.fit()
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_000000010"


def test_full_disk_leaves_the_previous_checkpoint_latest(tmp_path, monkeypatch):
    trainer = Trainer(SPECS[:2], source(), config(), tmp_path, progress=False)
    calls = {"n": 0}
    real_save = torch.save

    def save_then_fill_disk(obj, path, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:  # the first learner's state in the second checkpoint
            raise OSError(28, "No space left on device")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save_then_fill_disk)
    with pytest.raises(
        CheckpointError, match="no space left on .*step_000000020.*last good checkpoint is .*step_000000010"
    ):
        trainer.fit()
    checkpoints = tmp_path / "checkpoints"
    assert (checkpoints / "latest").read_text() == "step_000000010"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step_000000010"]


def test_training_computes_only_the_shards_it_uses(tmp_path):
    stream = source()  # shards of 176 tokens: two batches of 64 each
    computed = []
    real_shards = stream.shards

    def counting_shards(start=0):
        for shard in real_shards(start):
            computed.append(1)
            yield shard

    stream.shards = counting_shards
    trainer = Trainer(
        SPECS[:1], stream, config(total_tokens=64 * 4, checkpoint_every=2), tmp_path, progress=False
    )
    trainer.fit()
    assert trainer.step == 4 and trainer.tokens_seen == 64 * 4 and len(computed) == 2
    resumed = Trainer(
        SPECS[:1], stream, config(total_tokens=64 * 6, checkpoint_every=2), tmp_path, progress=False
    )
    computed.clear()
    resumed.fit(resume=True)  # continues 256 tokens in: shard 1 (tokens 176-351) again, then shard 2
    assert resumed.step == 6 and len(computed) == 2


def test_grad_clip_bounds_the_gradient_adam_sees_and_logs_the_norm_before(tmp_path, monkeypatch):
    seen = []  # the global gradient norm of each learner as the optimizer steps
    real_step = torch.optim.Adam.step

    def recording_step(self, *args, **kwargs):
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        seen.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.Adam, "step", recording_step)
    runs = {}
    for clip in (None, 0.05):
        seen.clear()
        trainer = Trainer(SPECS[:1], source(), config(grad_clip=clip, log_every=1), progress=False)
        trainer.fit()
        runs[clip] = (list(seen), trainer.learners[SPECS[0].name].history)
    free, free_history = runs[None]
    clipped, history = runs[0.05]
    # Unclipped: the logged norm is the gradient Adam used; nothing counted as clipped.
    torch.testing.assert_close([h["grad_norm"] for h in free_history], free, rtol=1e-5, atol=0)
    assert free_history[-1]["clipped_steps"] == 0
    # Clipped: the first step (same init, same batch) logs the free run's norm, Adam sees at most 0.05.
    assert history[0]["grad_norm"] == pytest.approx(free[0], rel=1e-5) and free[0] > 0.05
    assert max(clipped) <= 0.05 * (1 + 1e-5)
    logged = [h["grad_norm"] for h in history]
    torch.testing.assert_close(clipped, [min(n, 0.05) for n in logged], rtol=1e-5, atol=0)
    assert history[-1]["clipped_steps"] == sum(n > 0.05 for n in logged) > 0
    with pytest.raises(ValueError, match="grad_clip=0 must be > 0"):
        config(grad_clip=0)


def test_bad_configs_are_refused(tmp_path):
    with pytest.raises(ValueError, match="total_tokens=10 is less than one batch of 100"):
        TrainConfig(total_tokens=10, batch_tokens=100)
    with pytest.raises(ValueError, match="architecture 'sae' unknown"):
        LearnerSpec("sae", 0, 4)
    with pytest.raises(ValueError, match="init='mlp'"):
        LearnerSpec("transcoder", 0, 4, init="mlp")
    with pytest.raises(ValueError, match="holds blocks \\[1, 2\\], not 0"):
        Trainer([LearnerSpec("mxd", 0, 4)], source(), config(), "unused", progress=False)
    with pytest.raises(ValueError, match="ran out after"):
        Trainer(
            SPECS[:1],
            ModelActivations(
                make_model(), [1], lambda: iter([torch.zeros(12, dtype=torch.long)] * 32), 12, 16
            ),
            config(),
            tmp_path / "unused",
            progress=False,
        ).fit()


def test_bad_sizes_from_the_shell_name_the_option(tmp_path, cache):
    from mxd_lens.cli import main

    base = ["train", "--cache", str(cache), "--arch", "transcoder", "--k", "2", "--no-progress"]
    cases = [
        (["--width-multiplier", "0"], r"width_multiplier=0 \(--width-multiplier\) must be positive"),
        (["--checkpoint-every", "-1"], r"checkpoint_every=-1 \(--checkpoint-every\) must be >= 0"),
        (["--lr", "-1e-3"], r"lr=-0.001 must be > 0"),  # a negative value reaches the field's check
        (["--k", "-2"], r"k=-2 \(--k\) must be positive"),
        (
            ["--batch-tokens", "30000", "--tokens", "60000"],
            r"batch_tokens=30,000 \(--batch-tokens\) is more than the whole cache \(21,120 tokens\)",
        ),
    ]
    for extra, message in cases:
        with pytest.raises(SystemExit, match=message):
            main([*base, "--tokens", "640", *extra, "--out", str(tmp_path / "run")])
    with pytest.warns(
        UserWarning, match=r"norm_tokens=65,536 \(--norm-tokens\) is more than the cache holds \(21,120"
    ):
        main([*base, "--tokens", "3200", "--batch-tokens", "32", "--out", str(tmp_path / "ok")])


def test_the_last_checkpoint_and_the_final_layers_share_one_fold(tmp_path, monkeypatch):
    """A run whose last step is also a checkpoint folds each learner's scales once for both."""
    from mxd_lens.layers import MLPReplacement

    calls = []
    real = MLPReplacement.fold_activation_scales
    monkeypatch.setattr(
        MLPReplacement, "fold_activation_scales", lambda self, *a: calls.append(1) or real(self, *a)
    )
    trainer = Trainer(
        SPECS[:1], source(), config(total_tokens=64 * 20, checkpoint_every=10), tmp_path, progress=False
    )
    trainer.fit()
    assert len(calls) == 2  # steps 10 and 20; the final layers reuse step 20's
    saved = load_file(tmp_path / "final" / SPECS[0].name / "sae_weights.safetensors")
    checkpoint = load_file(
        tmp_path / "checkpoints" / "step_000000020" / SPECS[0].name / "sae_weights.safetensors"
    )
    assert all(torch.equal(saved[k], checkpoint[k]) for k in saved)


def test_mlp_init_starts_from_the_host_weights(tmp_path):
    live = source("gated")
    trainer = Trainer(
        [LearnerSpec("mxd", 1, k=4, init="mlp")],
        live,
        config(total_tokens=64),
        tmp_path,
        model=live.model,
        progress=False,
    )
    mxd, mlp = trainer.learners["L1.mxd.k4.m8.init-mlp"].layer, live.model.blocks[1].mlp
    assert (
        torch.equal(mxd.W_in, mlp.W_in)
        and torch.equal(mxd.W_in_gate, mlp.W_gate)
        and torch.equal(mxd.W_out, mlp.W_out)
    )


# -- subprocesses: SIGKILL and DDP ----------------------------------------------------------------


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "mxd_lens.cli", "train", "--no-progress", *args]


@pytest.fixture
def cache(tmp_path):
    return write_cache(source(rows_per_shard=64), tmp_path / "cache", n_shards=30, progress=False)


TRAIN_ARGS = [
    "--arch",
    "mxd",
    "transcoder",
    "--k",
    "4",
    "--width-multiplier",
    "8",
    "--batch-tokens",
    "32",
    "--lr",
    "0.003",
    "--warmup",
    "5",
]


def test_sigkill_at_a_random_step_then_resume_is_bit_identical(tmp_path, cache):
    """kill -9 at a random moment (mid-step or mid-checkpoint-write) after a random one of the first
    checkpoints, then --resume: it goes on from the checkpoint `latest` names, and the final weights
    equal an uninterrupted run's bit for bit."""
    steps, every = 80, 5
    args = [*TRAIN_ARGS, "--cache", str(cache), "--tokens", str(32 * steps), "--checkpoint-every", str(every)]
    args += ["--log-every", "1"]  # the resumed run's first logged step shows where it went on from
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # even where the caller set more (see conftest.py)
    subprocess.run(_cli(*args, "--out", str(tmp_path / "whole")), check=True, capture_output=True, env=env)
    victim = subprocess.Popen(
        _cli(*args, "--out", str(tmp_path / "killed")),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    # Wait for the 2nd, 3rd or 4th checkpoint, then kill at a random moment of the next checkpoint period
    # (in one of its steps or while its checkpoint is written), the period timed on the victim itself so
    # that this holds on a fast or a loaded machine: 55 or more steps before the end.
    target = every * random.randint(2, 4)
    latest = tmp_path / "killed" / "checkpoints" / "latest"
    seen, step = {}, 0  # the step `latest` names (written atomically) -> when it was first seen
    deadline = time.monotonic() + 120
    while victim.poll() is None and time.monotonic() < deadline:
        try:
            step = int(latest.read_text().removeprefix("step_"))
        except (FileNotFoundError, ValueError):
            pass
        seen.setdefault(step, time.monotonic())
        if step >= target:
            break
        time.sleep(0.002)
    delay = random.uniform(0.0, seen[step] - seen.get(step - every, seen[step] - 0.05))
    time.sleep(delay)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert victim.returncode == -signal.SIGKILL and not (tmp_path / "killed" / "final").exists(), (
        f"finished before the kill (after step {target} + {delay:.3f} s)"
    )
    killed_at = int(latest.read_text().removeprefix("step_"))
    resumed = subprocess.run(
        _cli(*args, "--out", str(tmp_path / "killed"), "--resume"),
        check=True,
        capture_output=True,
        text=True,
        env=env,
    )
    first = re.search(r"^step (\d+)/", resumed.stderr, flags=re.M)  # not from scratch, nor from an older one
    assert first and int(first[1]) == killed_at + 1, (killed_at, resumed.stderr[-2000:])
    assert_identical(final_weights(tmp_path / "whole"), final_weights(tmp_path / "killed"))


def test_two_ddp_ranks_equal_one_process_on_the_same_global_batch(tmp_path, cache):
    """Under torchrun each rank holds half the batch: the weights equal one process's on the whole batch.
    For the BatchTopK transcoder the selection is still the global batch's top T*K (the ranks' candidates
    are gathered) and the threshold steps by the global smallest kept code. One torchrun run trains all
    three kinds (starting torchrun's processes is most of this test's time)."""
    from mxd_lens.cli import main

    archs = ["--arch", "mxd", "transcoder", "batchtopk_transcoder"]
    budget = ["--tokens", str(32 * 20), "--checkpoint-every", "0"]
    args = [*archs, *TRAIN_ARGS[3:], "--cache", str(cache), *budget]
    assert main(["train", "--no-progress", *args, "--out", str(tmp_path / "single")]) == 0  # in this process
    ddp = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "mxd_lens.cli",
        "train",
        "--no-progress",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [*ddp, *args, "--out", str(tmp_path / "ddp")], capture_output=True, text=True, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    single, ddp_weights = final_weights(tmp_path / "single"), final_weights(tmp_path / "ddp")
    assert single.keys() == ddp_weights.keys() and len(single) == 6  # 3 architectures x blocks 1, 2
    for name in single:
        if "batchtopk" in name:
            assert float(single[name]["threshold"].max()) > 0, name
        for key in single[name]:
            torch.testing.assert_close(
                ddp_weights[name][key], single[name][key], rtol=1e-4, atol=1e-5, msg=f"{name}.{key}"
            )


def test_a_warm_start_on_scaled_activations_computes_the_host_hidden_layer(tmp_path):
    """After the scales are known, the copied hidden layer reads s_in x and writes s_out times the
    host MLP's hidden output (z D), brute-forced from the host's weights."""
    live = source("gated")
    trainer = Trainer(
        [LearnerSpec("mxd", 1, k=4, init="mlp")],
        live,
        config(total_tokens=64 * 2, lr=1e-12),
        model=live.model,
        progress=False,
    )
    learner = trainer.learners["L1.mxd.k4.m8.init-mlp"]
    batch = next(iter(trainer.batch_stream()))  # the scales are estimated on the first batches
    s_in, s_out = trainer.scales[1]
    mlp = live.model.blocks[1].mlp
    x = batch[1][0][:8].double()
    phi = learner.layer.phi
    host = (phi(x @ mlp.W_gate.double()) * (x @ mlp.W_in.double())) @ mlp.W_out.double()
    layer = learner.layer.double()
    torch.testing.assert_close(layer.hidden(s_in * x) @ layer.W_out, s_out * host)


def test_a_warm_start_into_a_layer_without_a_dense_path_is_refused():
    with pytest.raises(ValueError, match="init='default'"):
        LearnerSpec("transcoder", 1, k=4, init="mlp")


@pytest.mark.parametrize("shuffle", ["global", "shard"])
def test_a_cache_written_before_the_rename_trains_as_its_renamed_copy(tmp_path, shuffle):
    """A cache under its old names (block_*.safetensors, in shards.jsonl too, and the manifest's old
    keys ``layers`` and ``rows_per_block``) trains to the same weights as the same cache under today's
    names; a checkpoint with the old names of its data record resumes on it."""
    from test_activations import OLD_STREAM_KEYS, _as_written_before_shards_were_named_shards

    write_cache(source(), tmp_path / "new", n_shards=4, progress=False)
    write_cache(source(), tmp_path / "old", n_shards=4, progress=False)
    _as_written_before_shards_were_named_shards(tmp_path / "old")
    old = CachedActivations(tmp_path / "old", shuffle=shuffle)
    assert old.info == CachedActivations(tmp_path / "new").info and old.n_shards == 4
    cfg = config(total_tokens=64 * 10, norm_tokens=64 * 2, checkpoint_every=5)
    for name in ("new", "old"):
        Trainer(
            SPECS[:2],
            CachedActivations(tmp_path / name, shuffle=shuffle),
            cfg,
            tmp_path / f"run_{name}",
            progress=False,
        ).fit()
    assert_identical(final_weights(tmp_path / "run_new"), final_weights(tmp_path / "run_old"))
    # A checkpoint written before the renames resumes (and on the old cache, whose content identity
    # reads the old records): its stream record says layers and rows_per_block, its cache's shard
    # count is "blocks" and shard-by-shard reading was shuffle="block". Its last five steps are
    # redone to the same weights.
    checkpoints = tmp_path / "run_old" / "checkpoints"
    shutil.rmtree(checkpoints / "step_000000010")
    (checkpoints / "latest").write_text("step_000000005")
    state_path = checkpoints / "step_000000005" / "trainer_state.json"
    state = json.loads(state_path.read_text())
    data = state["data"]
    data["stream"] = {OLD_STREAM_KEYS.get(k, k): v for k, v in data["stream"].items()}
    data["blocks"] = data.pop("shards")
    data["shuffle"] = {"global": "global", "shard": "block"}[data["shuffle"]]
    state_path.write_text(json.dumps(state))
    trainer = Trainer(
        SPECS[:2],
        CachedActivations(tmp_path / "old", shuffle=shuffle),
        cfg,
        tmp_path / "run_old",
        progress=False,
    )
    trainer.fit(resume=True)
    assert trainer.step == 10
    assert_identical(final_weights(tmp_path / "run_new"), final_weights(tmp_path / "run_old"))


def test_the_default_width_trains_on_a_host_whose_mlp_is_too_wide_for_m8(tmp_path, monkeypatch, capsys):
    """Qwen2.5-0.5B's MLP is 5.43 x d_model (GLU): a width-8 transcoder has fewer parameters than the
    MxD's dense hidden layer alone, and the default refused to train. Here d_mlp = 5.5 x d_model: the run
    chooses m = 10, says so, and the MxD gets at least d_model experts at the transcoder's parameters."""
    from conftest import make_text_model
    from transformer_lens import HookedTransformer

    import mxd_lens.models
    from mxd_lens.cli import main
    from mxd_lens.matching import default_width_multiplier, match_experts

    small, corpus = make_text_model(tmp_path, kind="gated")
    cfg = small.cfg.to_dict()
    cfg.update(d_mlp=88, n_params=None)  # 5.5 x d_model = 16
    torch.manual_seed(0)
    model = HookedTransformer(type(small.cfg).from_dict(cfg), small.tokenizer).eval()
    monkeypatch.setattr(mxd_lens.models, "load_model", lambda name, **kw: model)
    with pytest.raises(ValueError, match="fewer parameters than the MxD's dense hidden layer"):
        match_experts(8 * 16, 16, 16, 88, glu=True)  # what the old default asked for
    assert default_width_multiplier(16, 16, 88, glu=True) == 10
    stream = ["--model", "tiny", "--text", str(corpus), "--context-size", "12", "--rows-per-shard", "16"]
    args = ["train", *stream, "--blocks", "1", "--k", "2", "--tokens", "320", "--batch-tokens", "32"]
    assert main([*args, "--no-progress", "--out", str(tmp_path / "run")]) == 0
    assert "width multiplier m = 10 (raised from 8" in capsys.readouterr().err  # the mxd_lens logger
    folders = {p.name: p for p in (tmp_path / "run" / "final").iterdir() if p.is_dir()}
    assert sorted(folders) == ["L1.mxd-gate=topk-gate_standardize=0.1.k2.m10", "L1.transcoder.k2.m10"]
    layers = {name: SAE.load_from_disk(str(path)) for name, path in folders.items()}
    n_params = {name: sum(p.numel() for p in layer.parameters()) for name, layer in layers.items()}
    mxd = next(layer for name, layer in layers.items() if "mxd" in name)
    assert mxd.cfg.d_sae == match_experts(10 * 16, 16, 16, 88, glu=True) >= 16
    low, high = sorted(n_params.values())
    assert (high - low) / high < 0.05  # parameter-matched


def test_train_runs_one_nested_run_config_and_records_it_whole(tmp_path):
    """`training.train(TrainRun)` is what `mxd-lens train` calls: it writes OUT/run.json (the run as one
    JSON object), trains the learners the run names, and a second call with resume continues (here: a
    finished run reports its metrics again, bit for bit)."""
    import dataclasses

    from conftest import make_text_model

    from mxd_lens.activations import ModelActivations, write_cache
    from mxd_lens.config import LearnersConfig, StreamConfig, TrainRun
    from mxd_lens.training import train

    model, corpus = make_text_model(tmp_path)
    stream = ModelActivations.from_config(
        model, [1], StreamConfig(text=str(corpus), context_size=12, rows_per_shard=16)
    )
    write_cache(stream, tmp_path / "cache", n_shards=2, progress=False)
    run = TrainRun(out=str(tmp_path / "run"), train=TrainConfig(epochs=1, batch_tokens=32, norm_tokens=64),
                   cache=str(tmp_path / "cache"), learners=LearnersConfig(arch=["mxd", "transcoder"], k=[2],
                   width_multiplier=[8]), no_progress=True)  # fmt: skip
    metrics = train(run)
    assert sorted(metrics) == ["L1.mxd.k2.m8", "L1.transcoder.k2.m8"]
    recorded = json.loads((tmp_path / "run" / "run.json").read_text())
    assert recorded == json.loads(json.dumps(dataclasses.asdict(run)))
    assert recorded["learners"]["arch"] == ["mxd", "transcoder"] and recorded["train"]["epochs"] == 1
    again = train(dataclasses.replace(run, resume=True))
    assert again == metrics
    with pytest.raises(ValueError, match="not a key of mxd_lens.ARCHITECTURES"):  # before the cache is opened
        train(dataclasses.replace(run, cache=str(tmp_path / "none"), learners=LearnersConfig(arch=["nope"])))


def test_the_normalisation_sample_is_capped_in_memory_and_says_so(monkeypatch, caplog):
    """Over the cap the scales come from the first batches that fit it (brute force on the same stream),
    and the log names the tokens used; under it, --norm-tokens as given."""
    import logging

    import mxd_lens.training as training

    def scales_from(n_batches):
        stream = training.shuffled_batches(source(blocks=(1, 2)), 64, config().seed)
        batches = list(itertools.islice(stream, n_batches))
        out = {}
        for block in (1, 2):
            x = torch.cat([b[block][0] for b in batches]).double()
            y = torch.cat([b[block][1] for b in batches]).double()
            out[block] = (
                float((x.shape[-1] / x.pow(2).sum(-1).mean()).sqrt()),
                float((y.shape[-1] / y.pow(2).sum(-1).mean()).sqrt()),
            )
        return out

    specs = [LearnerSpec("mxd", 1, k=4, width_multiplier=8), LearnerSpec("mxd", 2, k=4, width_multiplier=8)]
    first = next(iter(training.shuffled_batches(source(blocks=(1, 2)), 64, config().seed)))
    one_batch = sum(t.nbytes for pair in first.values() for t in pair)  # 2 blocks x (x, y) x 64 tokens
    monkeypatch.setattr(training, "NORM_SAMPLE_BYTES", 3 * one_batch)
    for norm_tokens, used in ((64 * 8, 3), (64 * 2, 2)):
        caplog.clear()
        trainer = Trainer(specs, source(blocks=(1, 2)), config(norm_tokens=norm_tokens), progress=False)
        with caplog.at_level(logging.INFO, logger="mxd_lens.training"):
            next(iter(trainer.batch_stream()))
        expected = scales_from(used)
        for block in (1, 2):
            assert trainer.scales[block] == pytest.approx(expected[block], rel=1e-9)
        capped = [r.getMessage() for r in caplog.records if "normalisation scales" in r.getMessage()]
        assert bool(capped) == (used == 3)
        if capped:
            assert "first 192 tokens, not --norm-tokens 512" in capped[0] and "2 blocks" in capped[0]
