"""The SPD step's exact speed-ups (issue 28 item 1) against the implementation without them: the chunked
CI MLP with its hidden layer recomputed in backward (``ci_chunked``), the token CI on distinct input rows
(``ci_distinct_rows``), and a module's components computed on routed batch rows only
(``routed_rows_only``); and the allocator setting the command line makes (``keep_freed_memory``)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import mxd_lens.spd.ci as ci_module
from mxd_lens.spd import SPDConfig, SPDTrainer
from mxd_lens.spd.ci import SequenceCI, VectorMLPCI, distinct_rows
from mxd_lens.spd.induction import InductionTask, induction_model
from mxd_lens.spd.losses import reconstruction_losses
from mxd_lens.spd.sites import decomposable_weights

FLAGS = ("ci_chunked", "ci_distinct_rows", "routed_rows_only")
TASK = InductionTask(n_base_tokens=6, seq_len=8)  # few tokens: layer 0's inputs repeat


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def perturbed(module: torch.nn.Module) -> torch.nn.Module:
    """Non-zero biases, so that every parameter's gradient is exercised."""
    with torch.no_grad():
        for param in module.parameters():
            param.add_(0.1 * torch.randn_like(param))
    return module


def grads_of(module: torch.nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    module.zero_grad(set_to_none=True)
    loss.backward()
    return {name: p.grad.clone() for name, p in module.named_parameters()}


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(ci_module, "CHUNK_ELEMENTS", 5 * 4 * 3)  # 3 rows a chunk at C = 5, H = 4


@pytest.mark.parametrize(
    "options", [{"chunked": True}, {"distinct": True}, {"chunked": True, "distinct": True}]
)
def test_token_ci_options_match_the_plain_mlp(small_chunks, options):
    torch.manual_seed(0)
    ci = perturbed(VectorMLPCI(3, 6, 5, 4, torch.Generator().manual_seed(1)))
    x = torch.randn(3, 2, 7, 6)
    x[0] = torch.randn(4, 6)[torch.randint(0, 4, (2, 7))]  # module 0 reads 4 distinct rows
    weight = torch.randn(3, 2, 7, 5)
    plain = ci(x)
    fast = ci(x, **options)
    assert fast.shape == plain.shape and rel(fast, plain) <= 1e-6
    expected, got = grads_of(ci, (plain * weight).sum()), grads_of(ci, (ci(x, **options) * weight).sum())
    for name in expected:
        assert rel(got[name], expected[name]) <= 1e-6, name


def test_sequence_ci_chunked_matches_and_passes_the_gradient_to_its_attention(small_chunks):
    torch.manual_seed(0)
    ci = perturbed(SequenceCI(2, 6, 5, 4, torch.Generator().manual_seed(1), n_ctx=7))
    assert "distinct" not in ci.options  # never exact for a sequence CI
    x, weight = torch.randn(2, 3, 7, 6), torch.randn(2, 3, 7, 5)
    plain, fast = ci(x), ci(x, chunked=True)
    assert rel(fast, plain) <= 1e-6
    expected, got = grads_of(ci, (plain * weight).sum()), grads_of(ci, (ci(x, chunked=True) * weight).sum())
    assert set(got) >= {"W_qkv", "relative_bias"}  # reached through the chunked MLP's input gradient
    for name in expected:
        assert rel(got[name], expected[name]) <= 1e-6, name


def test_distinct_rows_are_exact_and_survive_a_hash_collision(monkeypatch):
    rows = torch.randn(5, 4)
    x = rows[torch.tensor([0, 3, 3, 1, 0, 4, 2, 3])]
    found, inverse = distinct_rows(x)
    assert found.shape == (5, 4) and torch.equal(found[inverse], x)
    assert distinct_rows(torch.randn(8, 4)) is None  # all distinct: nothing to gain
    # every key the same: the bit-for-bit check catches it and torch.unique decides
    monkeypatch.setattr(ci_module, "_hash_multipliers", lambda d, device: torch.zeros(d, dtype=torch.long))
    found, inverse = distinct_rows(x)
    assert found.shape == (5, 4) and torch.equal(found[inverse], x)
    assert distinct_rows(torch.randn(8, 4)) is None


def make_trainer(tmp_path, name: str, ci: str = "token", **flags: bool) -> SPDTrainer:
    model = induction_model(0, TASK)
    model.requires_grad_(False)
    modules = [m for m in decomposable_weights(model) if ".attn." in m]
    config = SPDConfig(
        C=5, ci=ci, ci_hidden=4, batch_size=4, steps=3, faithfulness=10.0, stochastic_recon=1.0,
        layerwise_recon=1.0, subset_recon=1.0, ci_masked_recon=1.0, minimality=1e-2, p_start=1.0,
        checkpoint_every=0, **{flag: flags.get(flag, False) for flag in FLAGS},
    )  # fmt: skip

    def batches(step: int) -> torch.Tensor:
        return TASK.sample(4, torch.Generator().manual_seed(step))[0]

    return SPDTrainer(model, modules, batches, config, tmp_path / name, progress=False)


def test_routed_rows_only_gives_the_same_losses_and_gradients(tmp_path):
    trainer = make_trainer(tmp_path, "run")
    decomp, tokens = trainer.decomposition, trainer.batches(0)
    target, inputs = decomp.run_clean(trainer.model, tokens)
    results = {}
    for flag in (False, True):
        decomp.routed_rows_only = flag
        ci = decomp.ci_from_inputs(inputs)
        losses = reconstruction_losses(decomp, tokens, target, ci, generator=torch.Generator().manual_seed(3))
        results[flag] = (losses, grads_of(decomp, sum(losses.values())))
    (plain, plain_grads), (fast, fast_grads) = results[False], results[True]
    for term in plain:
        assert rel(fast[term], plain[term]) <= 1e-6, term
    for name in plain_grads:
        assert rel(fast_grads[name], plain_grads[name]) <= 1e-6, name


@pytest.mark.parametrize(
    "ci, flags",
    [("token", {flag: True}) for flag in FLAGS] + [("token", dict.fromkeys(FLAGS, True)), ("sequence", dict.fromkeys(FLAGS, True))],
)  # fmt: skip
def test_training_steps_match_the_implementation_without_speed_ups(tmp_path, ci, flags):
    plain, fast = make_trainer(tmp_path, "plain", ci), make_trainer(tmp_path, "fast", ci, **flags)
    for step in range(3):
        tokens = plain.batches(step)
        expected, got = plain.train_step(tokens), fast.train_step(tokens)
        plain.step = fast.step = step + 1
        for term in ("faithfulness", "stochastic_recon", "layerwise_recon", "subset_recon", "ci_masked_recon", "minimality"):  # fmt: skip
            assert abs(got[term] - expected[term]) <= 1e-5 * abs(expected[term]), (step, term)
    for (name, p), q in zip(
        plain.decomposition.named_parameters(), fast.decomposition.parameters(), strict=True
    ):
        assert rel(q.detach(), p.detach()) <= 1e-5, name


def test_speed_up_flags_default_on_and_are_free_on_resume(tmp_path):
    config = SPDConfig()
    assert all(getattr(config, flag) for flag in FLAGS)
    first = make_trainer(tmp_path, "run", **dict.fromkeys(FLAGS, True))
    first.config.steps = first.total_steps = 2
    first.fit(resume=False)
    # as a checkpoint written before these flags existed
    (state,) = (tmp_path / "run" / "checkpoints").glob("step_*/trainer_state.json")
    saved = json.loads(state.read_text())
    saved["config"] = {k: v for k, v in saved["config"].items() if k not in FLAGS}
    state.write_text(json.dumps(saved))
    again = make_trainer(tmp_path, "run")  # every speed-up off: the same training, so it resumes
    again.fit(resume=True)
    assert again.step == 3


def test_keep_freed_memory_only_from_the_command_line(monkeypatch):
    from mxd_lens import allocator, cli

    monkeypatch.setattr(allocator, "platform", type("P", (), {"system": staticmethod(lambda: "Darwin"),
                                                             "libc_ver": staticmethod(lambda: ("", ""))}))  # fmt: skip
    assert allocator.keep_freed_memory() is False  # another libc: a no-op
    monkeypatch.undo()
    monkeypatch.setenv("MXD_LENS_KEEP_FREED_MEMORY", "0")
    assert allocator.keep_freed_memory() is False  # turned off by the environment, before any mallopt
    monkeypatch.delenv("MXD_LENS_KEEP_FREED_MEMORY")
    calls = []
    monkeypatch.setattr(cli, "keep_freed_memory", lambda: calls.append(1))
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert calls == [1]
    code = (
        "import sys, mxd_lens, mxd_lens.spd; print('mxd_lens.allocator' in sys.modules); "
        "from mxd_lens.allocator import keep_freed_memory; print(keep_freed_memory())"
    )  # in a child: the setting is process-global
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    imported, applied = out.split()
    assert imported == "False"  # a plain import leaves the allocator alone
    import platform

    on_glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
    assert applied == str(on_glibc)  # set where glibc is, a no-op elsewhere


@pytest.mark.parametrize("value", ["false", "off", "no", "0", "FALSE", " Off "])
def test_keep_freed_memory_is_turned_off_by_every_spelling_of_off(monkeypatch, value):
    """MXD_LENS_KEEP_FREED_MEMORY=false/off/no once kept freed memory: only "0" was off."""
    from mxd_lens import allocator

    calls = []
    monkeypatch.setattr(allocator.ctypes, "CDLL", lambda *a: calls.append(a))  # no mallopt may be reached
    monkeypatch.setenv("MXD_LENS_KEEP_FREED_MEMORY", value)
    assert allocator.keep_freed_memory() is False
    assert calls == []


@pytest.mark.parametrize("value", ["1", "true", "on", "yes", "YES", ""])
def test_keep_freed_memory_on_spellings_and_a_bad_value_refused(monkeypatch, value):
    from mxd_lens import allocator

    monkeypatch.setenv("MXD_LENS_KEEP_FREED_MEMORY", value)
    assert allocator.setting_on("MXD_LENS_KEEP_FREED_MEMORY", default=True) is True
    monkeypatch.setenv("MXD_LENS_KEEP_FREED_MEMORY", "maybe")
    with pytest.raises(ValueError, match=r"MXD_LENS_KEEP_FREED_MEMORY='maybe': give one of 1, true"):
        allocator.keep_freed_memory()


def test_a_bad_keep_freed_memory_value_is_one_line_from_the_command(monkeypatch, capsys):
    from mxd_lens.cli import main

    monkeypatch.setenv("MXD_LENS_KEEP_FREED_MEMORY", "maybe")
    with pytest.raises(SystemExit, match=r"^mxd-lens: MXD_LENS_KEEP_FREED_MEMORY='maybe': give one of"):
        main(["info", "nowhere"])
