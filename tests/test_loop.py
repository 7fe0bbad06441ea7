"""The shared training loop (mxd_lens.loop) on a toy trainer: least squares by SGD, the step's batch a
function of the step. Each behaviour is checked against an independent reference: an uninterrupted
run, a closed-form schedule, a hand-counted cadence."""

import json
import math

import pytest
import torch

from mxd_lens.config import scheduled_lr
from mxd_lens.loop import ResumeMismatch, TrainingDiverged, TrainingLoop, differences


class Toy(TrainingLoop):
    def __init__(self, out_dir, steps=12, lr=0.1, checkpoint_every=4, log_every=3, stop_below=None):
        self.out_dir, self.total_steps, self.progress = out_dir, steps, False
        self.log_every, self.checkpoint_every, self.lr = log_every, checkpoint_every, lr
        self.stop_below = stop_below
        self.w = torch.nn.Parameter(torch.zeros(3))
        self.optimizer = torch.optim.SGD([self.w], lr=lr)
        self.history, self.seen, self.last_loss = [], [], math.inf

    def batch_stream(self):
        for step in range(self.step, self.total_steps):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(8, 3, generator=g)
            yield x, x @ torch.tensor([1.0, -2.0, 0.5])

    def train_step(self, batch):
        x, y = batch
        loss = (x @ self.w - y).pow(2).mean()
        self.check_loss(loss)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.seen.append(self.step)
        self.last_loss = loss.item()
        return {"loss": loss.item(), "lr": self.optimizer.param_groups[0]["lr"]}

    def lr_at(self, step):
        return scheduled_lr(step, self.total_steps, self.lr, warmup_steps=2, schedule="linear")

    def optimizers(self):
        return [self.optimizer]

    def named_parameters(self):
        return [("w", self.w)]

    def should_stop(self):
        return self.stop_below is not None and self.last_loss < self.stop_below

    def identity(self):
        return {"config": {"lr": self.lr, "steps": self.total_steps}}

    def resume_free(self):
        return ("steps",)

    def write_state(self, folder):
        torch.save({"w": self.w.detach(), "opt": self.optimizer.state_dict(), "step": self.step,
                    "history": self.history}, folder / "state.pt")  # fmt: skip
        (folder / "trainer_state.json").write_text(json.dumps(self.identity()))

    def read_state(self, folder):
        return torch.load(folder / "state.pt", weights_only=True)

    def apply_state(self, state):
        with torch.no_grad():
            self.w.copy_(state["w"])
        self.optimizer.load_state_dict(state["opt"])
        self.step, self.history = state["step"], state["history"]


def test_scheduled_lr_matches_its_formula():
    # warmup 4 of 20 steps, then a linear decay over every later step to 0.1 x lr at the last step
    lrs = [scheduled_lr(s, 20, 1.0, warmup_steps=4, schedule="linear", floor=0.1) for s in range(20)]
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert lrs[19] == pytest.approx(0.1)
    expected = [1 - 0.9 * (s - 4 + 1) / 16 for s in range(4, 20)]
    assert lrs[4:] == pytest.approx(expected)
    cosine = scheduled_lr(9, 20, 1.0, schedule="cosine", decay_steps=10)
    assert cosine == pytest.approx(1.0)  # the decay starts at step 10
    assert scheduled_lr(14, 20, 1.0, schedule="cosine", decay_steps=10) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="schedule='step'"):
        scheduled_lr(0, 10, 1.0, schedule="step")


def test_cadence_lr_and_resume_equal_an_unbroken_run(tmp_path):
    whole = Toy(tmp_path / "whole")
    whole.fit()
    assert [h["step"] for h in whole.history] == [3, 6, 9, 12]  # every log_every, and the last
    assert sorted(p.name for p in (tmp_path / "whole/checkpoints").glob("step_*")) == [
        "step_000000008", "step_000000012"]  # fmt: skip
    assert [h["lr"] for h in whole.history] == pytest.approx([whole.lr_at(s - 1) for s in (3, 6, 9, 12)])

    class Killed(Exception):
        pass

    broken = Toy(tmp_path / "broken")
    stream = broken.batch_stream

    def dies():
        for i, batch in enumerate(stream()):
            if i == 6:
                raise Killed
            yield batch

    broken.batch_stream = dies
    with pytest.raises(Killed):
        broken.fit()
    resumed = Toy(tmp_path / "broken")
    resumed.fit(resume=True)
    assert resumed.seen == list(range(4, 12))  # from the checkpoint at step 4
    assert torch.equal(resumed.w, whole.w) and resumed.history == whole.history


def test_resume_refuses_other_settings_and_names_them(tmp_path):
    Toy(tmp_path, steps=8).fit()
    with pytest.raises(ResumeMismatch, match=r"other settings .*'lr': \(0.1, 0.2\)"):
        Toy(tmp_path, steps=8, lr=0.2).fit(resume=True)
    more = Toy(tmp_path, steps=12)  # steps is free: a finished run may go on
    more.fit(resume=True)
    assert more.seen == [8, 9, 10, 11]
    assert differences({"a": 1, "b": 2}, {"a": 1, "b": 3, "c": 4}, free=["c"]) == {"b": (2, 3)}


def test_divergence_applies_nothing_and_names_the_last_checkpoint(tmp_path):
    toy = Toy(tmp_path)
    stream = toy.batch_stream

    def poisoned():
        for batch in stream():
            x, y = batch
            yield (x, y * float("nan")) if toy.step == 5 else (x, y)

    toy.batch_stream = poisoned
    with pytest.raises(
        TrainingDiverged, match="loss is nan at step 5; the last good checkpoint is .*step_000000004"
    ):
        toy.fit()
    assert toy.seen == [0, 1, 2, 3, 4] and torch.isfinite(toy.w).all()


def test_early_stop_and_running_out(tmp_path):
    toy = Toy(tmp_path / "stop", steps=200, lr=0.3, stop_below=1e-3)
    toy.fit()
    assert toy.step < 200 and toy.last_loss < 1e-3
    assert toy.history[-1]["step"] == toy.step  # the stopping step is recorded
    assert (tmp_path / "stop/checkpoints" / f"step_{toy.step:09d}").is_dir()  # and checkpointed

    short = Toy(tmp_path / "short", steps=10)
    short.batch_stream = lambda: iter([])
    with pytest.raises(ValueError, match="ran out after 0 of 10 steps"):
        short.fit()
