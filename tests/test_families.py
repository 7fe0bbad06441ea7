"""The family conformance matrix: every guarantee the docs make, checked on a tiny random model of every
MLP-bearing causal-LM class TransformerLens 3.9 converts (tests/families.py builds them; a test checks the
list against TL's weight dispatch) and on feature rows (a setting changed), each against an independent
reference (transformers' logits, hand-written forward hooks and formulas), never against mxd_lens's own
capture. A class load_model refuses is a row too: the refusal is what its load cell checks.

Each (family, guarantee) is one test item; all checks of a family run once per session and are cached,
so the items and the generated table share one computation. A cell is "✓", "n/a: <why>" (the guarantee
does not apply), "approx.: <why>" (holds approximately by design, documented: the bfloat16 row's
rounding), "refused: <what>" (the refusal is what is checked), or the item fails with the check's error
(the table then says "✗ ...").

    python tests/test_families.py --write    # regenerate the table in docs/models.md
"""

from __future__ import annotations

import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # as a script: conftest and families importable

import families as fam  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from conftest import mlp_io_by_hand as mlp_io  # noqa: E402
from conftest import randomise  # noqa: E402

DOCS = Path(__file__).resolve().parent.parent / "docs" / "models.md"
START, END = "<!-- families:start -->", "<!-- families:end -->"
GUARANTEES = {  # test id -> column
    "load": "load",
    "from_mlp": "from_mlp",
    "train_load": "train → load",
    "evaluate": "evaluate",
    "attribution": "attribution",
    "probe": "probe",
    "steer": "steer",
    "export": "export",
    "graph": "graph (every block)",
}
# blocks normalise the MLP output: layers write the MLP module
POST_NORM = {"gemma2", "gemma3", "olmo2", "olmo3"}
TRAIN_ARCHS = None  # set in check_train (mxd-lens train's default architectures)
TRAIN_K = 32  # mxd-lens train's default --k
REFUSED = "refused: MoE MLP"
NOT_LOADED = "n/a: refused at load"


class CheckFailed(AssertionError):
    """A failed comparison: ``short`` goes in the table, the message in the test failure."""

    def __init__(self, short: str, detail: str = ""):
        super().__init__(f"{short}: {detail}" if detail else short)
        self.short = short


def require(ok: bool, short: str, detail: str = "") -> None:
    if not ok:
        raise CheckFailed(short, detail)


class Tolerance:
    """The current row's tolerances: as written (float32's), or in a half dtype (the bfloat16 row) widened to
    HALF_UNITS rounding units of the dtype (``finfo.eps``) relative to the largest value compared; a check
    that passes only widened makes its cell "approx.: ..."."""

    eps: float | None = None  # the row's dtype's rounding unit when it is a half dtype
    widened = False  # a comparison of this check needed the widening


TOL = Tolerance()
HALF_UNITS = 4


def close(a: torch.Tensor, b: torch.Tensor, atol: float, what: str, scale: float | None = None) -> None:
    """max |a - b| <= atol (in a half-dtype row: or HALF_UNITS rounding units of ``scale``, default the
    largest |a|, |b|)."""
    diff = float((a.float() - b.float()).abs().max())
    if diff > atol and TOL.eps is not None:
        scale = max(float(a.float().abs().max()), float(b.float().abs().max())) if scale is None else scale
        atol, TOL.widened = max(atol, HALF_UNITS * TOL.eps * max(1.0, scale)), True
    require(diff <= atol, f"{what} differs", f"max |Δ| = {diff:.2e} > {atol:g}")


def near(got: float, want: float, rel: float, abs_: float, scale: float = 0.0) -> bool:
    """got == want to ``rel`` / ``abs_`` (in a half-dtype row: or to HALF_UNITS rounding units of want, or
    of ``scale``: the magnitude of what was rounded, for a difference of two rounded values)."""
    if got == pytest.approx(want, rel=rel, abs=abs_):
        return True
    units = HALF_UNITS * (TOL.eps or 0.0)
    if TOL.eps is not None and got == pytest.approx(want, rel=units, abs=max(abs_, units * scale)):
        TOL.widened = True
        return True
    return False


@dataclass
class Cell:
    text: str  # what the table shows
    error: str | None = None  # the failure (traceback), None when the check passed
    seconds: float = 0.0


@dataclass
class Host:
    family: fam.Family
    model: Any  # the TL model
    hf: Any  # the transformers model
    folder: Path
    work: Path  # a scratch folder of this family
    tokens: torch.Tensor  # [2, 12] random ids (no special tokens)

    @property
    def key(self) -> str:
        return self.family.key

    @property
    def writes_module(self) -> bool:
        return self.key in POST_NORM

    @property
    def mxd_ok(self) -> bool:
        """False for a host no MxD is built on (xIELU): its checks use transcoders only."""
        return "transcoders" not in self.family.tags

    def mxd_or_skip(self, block: int, d_sae: int, k: int, **mxd: Any) -> Any:
        """An MxD for block ``block`` (``mxd``: its fields), or on a transcoders-only host a skip transcoder."""
        from mxd_lens import MxD, TopKSkipTranscoder

        if self.mxd_ok:
            return MxD.for_model(self.model, block, d_sae=d_sae, k=k, **mxd)
        return TopKSkipTranscoder.for_model(self.model, block, d_sae=d_sae, k=k)


# -- hand-written references ----------------------------------------------------------------------------
def replaced(
    model, tokens: torch.Tensor, fns: dict[int, Callable[[torch.Tensor], torch.Tensor]], first: int = 0
) -> torch.Tensor:
    """Logits with each block's MLP *module* output replaced by fn(its input) from position ``first`` on
    (the module's own output before it): forward hooks on blocks[L].mlp. In a pre-norm block the module
    output is hook_mlp_out itself; in a post-norm block (Gemma-2/3, OLMo-2) the host's norm runs after it,
    as after the MLP."""

    def hook(module, args, out, fn):
        new = fn(args[0]).to(out.dtype).clone()
        new[:, :first] = out[:, :first]
        return new

    handles = [model.blocks[b].mlp.register_forward_hook(lambda m, args, out, fn=fn: hook(m, args, out, fn))
               for b, fn in fns.items()]  # fmt: skip
    try:
        with torch.no_grad():
            return model(tokens)
    finally:
        for handle in handles:
            handle.remove()


def ce(logits: torch.Tensor, tokens: torch.Tensor) -> float:
    """Next-token cross-entropy, in float32 (as evaluate computes it: docs/models.md, what stays float32)."""
    logits = logits.float()
    return float(F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)))


def kl(clean: torch.Tensor, other: torch.Tensor) -> float:
    """Mean over predicted tokens of KL(clean || other) of the next-token distributions."""
    p, q = clean[:, :-1].float().log_softmax(-1), other[:, :-1].float().log_softmax(-1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def circuit_tracer_forward(t: dict[str, torch.Tensor], x: torch.Tensor, k: int) -> torch.Tensor:
    """circuit-tracer 0.5.0's SingleLayerTranscoder with TopK(k) (tests/test_export.py), in the tensors'
    dtype."""
    x = x.to(t["W_enc"].dtype)
    pre = F.linear(x, t["W_enc"], t["b_enc"])
    _, idx = torch.topk(pre, k=k, dim=-1)
    acts = pre * torch.zeros_like(pre).scatter_(-1, idx, 1.0)
    out = acts @ t["W_dec"] + t["b_dec"]
    return out + x @ t["W_skip"].T if "W_skip" in t else out


# -- the checks ----------------------------------------------------------------------------------------
def check_load(h: Host) -> str:
    """TL's logits equal transformers' on the same tokens (log-probs, max |Δ| <= 1e-4; in a half dtype,
    against transformers in that dtype, within the load check's tolerance)."""
    if h.family.dtype != "float32":
        import copy

        from mxd_lens.models import load_check_tolerance

        dtype = getattr(torch, h.family.dtype)
        with torch.no_grad():
            ours = h.model(h.tokens).float().log_softmax(-1)
            logits = copy.deepcopy(h.hf).to(dtype)(h.tokens).logits.float()
        tolerance = load_check_tolerance(dtype, float(logits.abs().max()))
        close(ours, logits.log_softmax(-1), tolerance, f"log-probs vs transformers in {h.family.dtype}")
        return f"approx.: {h.family.dtype}, as transformers in {h.family.dtype} (the load check's tolerance)"
    with torch.no_grad():
        ours = h.model(h.tokens).log_softmax(-1)
        theirs = h.hf(h.tokens).logits.log_softmax(-1)
    close(ours, theirs, 1e-4, "log-probs vs transformers")
    if h.family.route == "tl_config":
        from mxd_lens.models import load_model

        try:
            load_model(str(h.folder))
        except ValueError as err:
            require("load_model('allenai/OLMo-2-0425-1B')" in str(err) and "\n" not in str(err),
                    "refused with another message", str(err))  # fmt: skip
        else:
            return "✓ (load_model now loads the folder: update the row)"
        return "n/a: TL 3.9 loads OLMo-2 by name only (a folder: refused, naming it); its converter ✓"
    if h.key == "stablelm":  # the newer StableLM class has no TL converter: refused by name
        stablelm2 = fam.Family("stablelm2", "StableLM-2", "StableLmConfig", "StableLmForCausalLM",
                               fam.BY_KEY["llama"].kwargs)  # fmt: skip
        folder, _ = fam.hf_folder(h.work, stablelm2)
        from mxd_lens.models import load_model

        try:
            load_model(str(folder))
        except ValueError as err:
            require("StableLmForCausalLM, which TransformerLens's HookedTransformer cannot load" in str(err),
                    "StableLmForCausalLM refused with another message", str(err))  # fmt: skip
        else:
            raise CheckFailed("StableLmForCausalLM loads now: add it as a row")
    return "✓"


def check_from_mlp(h: Host) -> str:
    """MxD.from_mlp reproduces every block's MLP module; all spliced, the logits are the clean ones."""
    import mxd_lens
    from mxd_lens import MxD

    model = h.model
    if not h.mxd_ok:
        try:
            MxD.from_mlp(model, 0)
        except ValueError as err:
            require("trained parameters" in str(err) and "transcoder, skip_transcoder, batchtopk_transcoder"
                    in str(err), "MxD refused with another message", str(err))  # fmt: skip
            return f"n/a: {model.cfg.act_fn} has trained parameters: MxD refused, naming the transcoders"
        raise CheckFailed("MxD.from_mlp accepted a host whose activation has trained parameters")
    with torch.no_grad():
        clean = model(h.tokens)
        layers = []
        for block in range(model.cfg.n_layers):
            mxd = MxD.from_mlp(model, block)
            x, y = mlp_io(model, block, h.tokens)
            close(mxd(x), y, 1e-5, f"block {block}'s MxD.from_mlp output vs the MLP")
            layers.append(mxd)
        with mxd_lens.splice(model, *layers):
            spliced = model(h.tokens)
    close(spliced, clean, 1e-4, "spliced logits vs clean")
    return "✓"


def check_train(h: Host) -> str:
    """mxd-lens train's default architectures and width on a text stream, a few steps; the saved folders
    load through SAELens into our classes and give the trained layers' outputs, spliced too."""
    from sae_lens import SAE

    import mxd_lens  # noqa: F401  (registers our architectures with SAELens)
    from mxd_lens.activations import ModelActivations
    from mxd_lens.config import RECOMMENDED_MXD
    from mxd_lens.layers.learners import LearnerSpec
    from mxd_lens.training import TrainConfig, Trainer

    model, block = h.model, 1
    text = h.work / "corpus.txt"
    text.write_text(fam.corpus())
    stream = ModelActivations.from_text(model, [block], str(text), context_size=fam.N_CTX, rows_per_shard=8)
    archs = (RECOMMENDED_MXD, "transcoder") if h.mxd_ok else ("transcoder", "skip_transcoder")
    specs = [LearnerSpec(arch, block, TRAIN_K) for arch in archs]  # default width
    config = TrainConfig(total_tokens=4 * 64, batch_tokens=64, norm_tokens=128, warmup_steps=1, log_every=2,
                         checkpoint_every=1000)  # fmt: skip
    out = h.work / "train"
    trainer = Trainer(specs, stream, config, out, progress=False)
    trainer.fit()
    trained = trainer.trained_layers()  # by learner name (the width is resolved from the stream)
    require(len(trained) == len(specs), "learners", str(list(trained)))
    x, _ = mlp_io(model, block, h.tokens)
    want_out = f"blocks.{block}.mlp.hook_out" if h.writes_module else f"blocks.{block}.hook_mlp_out"
    first = int(stream.info.drop_first_position)  # the trainer left out position 0 (BOS) then
    for name, layer in trained.items():
        loaded = SAE.load_from_disk(out / "final" / name)
        require(list(loaded.cfg.metadata.seqpos_slice) == ([1, None] if first else [None]),
                "records other positions", str(loaded.cfg.metadata.seqpos_slice))  # fmt: skip
        require(type(loaded) is type(layer), "loads as another class", f"{type(loaded)} vs {type(layer)}")
        require(loaded.cfg.metadata.hook_name_out == want_out, "writes elsewhere",
                f"{loaded.cfg.metadata.hook_name_out} vs {want_out}")  # fmt: skip
        with torch.no_grad():
            close(loaded(x), layer(x), 1e-6, f"{name} loaded vs trained output")
            with mxd_lens.splice(model, loaded):
                spliced = model(h.tokens)
            close(
                spliced,
                replaced(model, h.tokens, {block: layer}, first),
                1e-5,
                "spliced loaded layer vs hooks",
            )
    return "✓"


def check_evaluate(h: Host) -> str:
    """evaluate's CE (clean, spliced, zero-ablated), KL and FVU equal hand-written TL hook computations;
    one layer trained without position 0 (seqpos_slice [1, None]) keeps the MLP there in its splice and
    its block's zero-ablation, and every FVU then counts positions 1.. (where every layer replaces)."""
    from mxd_lens import TopKTranscoder
    from mxd_lens.evaluation import evaluate

    model = h.model
    data = [h.tokens, h.tokens.flip(1)]
    layers = {"tc": randomise(TopKTranscoder.for_model(model, 1, d_sae=24, k=4), seed=4),
              "mxd": randomise(h.mxd_or_skip(2, d_sae=12, k=3), seed=5, scale=0.2)}  # fmt: skip
    layers["mxd"].cfg.metadata.seqpos_slice = [1, None]
    rows = evaluate(model, layers, data, skip_first_position=False, progress=False, jacobian_tokens=0)
    rows = {r["name"]: r for r in rows}
    blocks, firsts = {"tc": 1, "mxd": 2}, {"tc": 0, "mxd": 1}
    require(rows["mxd"]["spliced_from"] == 1 and rows["tc"]["spliced_from"] == 0, "spliced_from",
            str({n: r["spliced_from"] for n, r in rows.items()}))  # fmt: skip
    with torch.no_grad():
        clean = [model(t) for t in data]
        for name, layer in layers.items():
            b, first = blocks[name], firsts[name]
            spliced = [replaced(model, t, {b: layer}, first) for t in data]
            keep = torch.arange(data[0].shape[1])[:, None] < first  # positions where the MLP's output stays
            zero = [model.run_with_hooks(t, fwd_hooks=[(f"blocks.{b}.hook_mlp_out", lambda v, hook, keep=keep: v * keep)])
                    for t in data]  # fmt: skip
            io = [mlp_io(model, b, t) for t in data]
            y = torch.cat([o[1][:, 1:].reshape(-1, model.cfg.d_model) for o in io]).double()
            y_hat = torch.cat([layer(o[0])[:, 1:].reshape(-1, model.cfg.d_model) for o in io]).double()
            want = {
                "ce_clean": sum(ce(c, t) for c, t in zip(clean, data, strict=True)) / 2,
                "ce_spliced": sum(ce(s, t) for s, t in zip(spliced, data, strict=True)) / 2,
                "ce_zero_ablation": sum(ce(z, t) for z, t in zip(zero, data, strict=True)) / 2,
                "kl": sum(kl(c, s) for c, s in zip(clean, spliced, strict=True)) / 2,
                "fvu": float((y_hat - y).pow(2).sum() / (y - y.mean(0)).pow(2).sum()),
            }
            for key, value in want.items():
                got = rows[name][key]
                require(near(got, value, 1e-4, 1e-6), f"{key} differs",
                        f"{name}: evaluate {got!r}, by hand {value!r}")  # fmt: skip
    return "✓"


def check_attribution(h: Host) -> str:
    """attribute's parts sum to the target (completeness <= 1e-4) and edges between two spliced blocks
    are the change of the downstream pre-activation in the frozen model, written out here."""
    import mxd_lens
    from mxd_lens import MxD, TopKTranscoder
    from mxd_lens.attribution import attribute, contributions, edges, logit_target

    model = h.model
    tokens = h.tokens[:1, :8]
    up = randomise(MxD.for_model(model, 0, d_sae=16, k=3) if h.mxd_ok
                   else TopKTranscoder.for_model(model, 0, d_sae=16, k=3), 1, scale=0.3)  # fmt: skip
    down = randomise(TopKTranscoder.for_model(model, 2, d_sae=16, k=3), 2, scale=0.3)
    target = logit_target(token=7, minus=3)
    with mxd_lens.splice(model, up, down):
        result = attribute(model, tokens, target)
        with torch.no_grad():
            real = float(target(model(tokens)))
        table = edges(model, tokens, 0, 2, keep=1.0)
        keep = lambda n: n.endswith(("hook_pattern", "hook_scale", "hook_mlp_out"))  # noqa: E731
        with torch.no_grad():
            _, cache = model.run_with_cache(tokens, names_filter=keep)  # the prompt's spliced run
    require(near(result.target, real, 1e-4, 1e-5), "target differs from the model's",
            f"{result.target} vs {real}")  # fmt: skip
    # (Gemma-2's final logit soft-cap is linearised at the prompt, its offset a part of its own)
    require(near(result.total, result.target, 1e-4, 0.0) or result.completeness <= 1e-4, "completeness > 1e-4",
            f"parts sum to {result.total}, target {result.target} (completeness {result.completeness:.2e})")  # fmt: skip

    # edges: the frozen model written out (patterns, norm scales and every other block's hook_mlp_out as on
    # the prompt), block 0's MLP module output replaced (its post-norm, scale frozen, runs after it)
    require(len(table) > 0, "no edges")
    top = table.iloc[0]
    x0, _ = mlp_io(model, 0, tokens)
    with torch.no_grad():
        y0 = up(x0)
    split = contributions(up, x0[0])
    t1, u = int(top.up_position), int(top.up_unit)
    edited = y0.clone()
    edited[0, t1] -= split.vectors[t1, int((split.indices[t1] == u).nonzero())]

    def frozen_pre(module_out: torch.Tensor) -> torch.Tensor:
        seen = {}
        frozen = lambda n: keep(n) and n != "blocks.0.hook_mlp_out"  # noqa: E731
        handles = [model.blocks[0].mlp.register_forward_hook(lambda m, args, out: module_out),
                   model.blocks[2].mlp.register_forward_pre_hook(lambda m, args: seen.update(x=args[0]))]  # fmt: skip
        try:
            with torch.no_grad():
                model.run_with_hooks(tokens, fwd_hooks=[(frozen, lambda v, hook: cache[hook.name])])
                return seen["x"][0] @ down.W_enc + down.b_enc
        finally:
            for handle in handles:
                handle.remove()

    before, after = frozen_pre(y0), frozen_pre(edited)
    t2, m = int(top.down_position), int(top.down_unit)
    require(near(float(before[t2, m]), top.down_pre, 1e-5, 1e-6), "edge pre-activation differs",
            f"{float(before[t2, m])} vs {top.down_pre}")  # fmt: skip
    moved = float(after[t2, m] - before[t2, m])
    require(near(moved, -top.weight, 1e-3, 1e-5, scale=abs(float(before[t2, m]))),
            "edge weight is not the frozen change",
            f"removing the contribution moves the pre-activation by {moved}, edge weight {top.weight}")  # fmt: skip
    return "✓"


PROBE_TEXTS = [("the cat sat on a mat", 0), ("dogs ran over green hills", 1), ("a cat and birds sang", 0),
               ("the dogs sang songs of rain", 1), ("while the cat ran", 0), ("green dogs sat on the mat", 1),
               ("cat songs of rain", 0), ("birds and dogs", 1), ("the cat", 0), ("dogs over hills", 1),
               ("a green cat sang", 0), ("rain and dogs", 1)]  # fmt: skip


def check_probe(h: Host) -> str:
    """Pooled codes / MLP inputs of a few texts: finite, the right shapes, the first text's equal to a
    one-text forward by hand; a probe fits on them."""
    from mxd_lens import TopKTranscoder
    from mxd_lens.analysis import probing

    model = h.model
    texts, labels = zip(*PROBE_TEXTS, strict=True)
    layer = randomise(TopKTranscoder.for_model(model, 1, d_sae=20, k=4), 2)
    ctx = 8
    pooled = probing.pooled_activations(model, {"tc": layer}, list(texts), dense_layers=[1], context_size=ctx,
                                        batch_size=5, progress=False)  # fmt: skip
    n, d = len(texts), model.cfg.d_model
    require(tuple(pooled["tc"].shape) == (n, 20) and tuple(pooled["mlp_in.L1"].shape) == (n, d), "shapes",
            str({k: tuple(v.shape) for k, v in pooled.items()}))  # fmt: skip
    require(all(torch.isfinite(v).all() for v in pooled.values()), "non-finite features")
    tok = model.tokenizer
    bos = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    head = [bos] if model.cfg.default_prepend_bos else []
    ids = tok(texts[0], add_special_tokens=False)["input_ids"][: ctx - len(head)]
    x, _ = mlp_io(model, 1, torch.tensor([head + ids]))
    with torch.no_grad():
        codes = layer.encode(x)[0, len(head) :]
    close(pooled["tc"][0], codes.mean(0), 1e-5, "pooled codes vs by hand")
    close(pooled["mlp_in.L1"][0], x[0, len(head) :].mean(0), 1e-5, "pooled MLP input vs by hand")
    import numpy as np

    X = torch.cat([pooled["tc"], pooled["mlp_in.L1"]], 1).numpy()
    parts = {"train": list(range(8)), "val": [8, 9], "test": [10, 11]}
    result = probing.probe_task(X, np.array(labels), parts, k=2)
    require(0 <= result["test_accuracy"] <= 1 and len(result["features"]) == 2, "probe", str(result))
    return "✓"


def check_steer(h: Host) -> str:
    """steer(add alpha to code f) changes the block's output (where the layer writes) by exactly
    alpha * W_dec[f] (transcoder) / alpha * (z D) * C[f] (MxD), at every position."""
    import mxd_lens
    from mxd_lens import MxD, TopKTranscoder
    from mxd_lens.analysis.steering import steer

    model, block, feature, alpha = h.model, 1, 5, 2.5
    x, _ = mlp_io(model, block, h.tokens)
    for layer in (randomise(TopKTranscoder.for_model(model, block, d_sae=24, k=4), 1),
                  randomise(h.mxd_or_skip(block, d_sae=24, k=4, d_hidden=8), 2)):  # fmt: skip
        with torch.no_grad():
            if isinstance(layer, MxD):
                vector = alpha * (layer.hidden(x) @ layer.W_out) * layer.W_dec[feature]
            else:
                vector = alpha * layer.W_dec[feature].expand_as(x)
        site = model.blocks[block].mlp if h.writes_module else model.blocks[block].hook_mlp_out
        outs = []
        with torch.no_grad(), mxd_lens.splice(model, layer):
            # registered after the splice's hooks: sees what the block writes
            handle = site.register_forward_hook(lambda m, args, out, outs=outs: outs.append(out.clone()))
            try:
                model(h.tokens)
                with steer(model, layer, feature, alpha):
                    model(h.tokens)
            finally:
                handle.remove()
        close(
            outs[1] - outs[0],
            vector,
            1e-4,
            f"{type(layer).__name__} steered change vs alpha·vector",
            scale=float(outs[1].float().abs().max()),
        )  # the block's output, rounded in a half dtype
    return "✓"


def check_export(h: Host) -> str:
    """A transcoder at every block, exported for circuit-tracer: config.yaml names the hooks, and the
    exported tensors run as circuit-tracer runs them, at those hooks, give the spliced model's logits."""
    import yaml
    from safetensors.torch import load_file

    import mxd_lens
    from mxd_lens import TopKTranscoder
    from mxd_lens.export import export_circuit_tracer

    model, k = h.model, 3
    layers = {}
    for b in range(model.cfg.n_layers):
        # float32, as trained layers are (in a half dtype, 3.0 + small terms would tie in the TopK)
        layer = randomise(TopKTranscoder.for_model(model, b, d_sae=16, k=k, dtype="float32"), b, scale=0.2)
        with torch.no_grad():
            layer.b_enc.fill_(3.0)  # every pre-activation positive: circuit-tracer's TopK (no ReLU) agrees
        layer.save_model(h.work / "tc" / f"L{b}")
        layers[b] = layer
    out = export_circuit_tracer(h.work / "tc", h.work / "ct")
    config = yaml.safe_load((out / "config.yaml").read_text())
    hook_out = "mlp.hook_out" if h.writes_module else "hook_mlp_out"
    got = (config["model_kind"], config["feature_input_hook"], config["feature_output_hook"], config["k"])
    require(got == ("transcoder_set", "mlp.hook_in", hook_out, k), "config.yaml", str(got))
    tensors = {b: load_file(out / f"layer_{b}.safetensors") for b in layers}
    with torch.no_grad(), mxd_lens.splice(model, *layers.values()):
        spliced = model(h.tokens)
    exported = replaced(
        model, h.tokens, {b: (lambda x, t=t: circuit_tracer_forward(t, x, k)) for b, t in tensors.items()}
    )
    close(exported, spliced, 1e-4, "circuit-tracer forward at the exported hooks vs spliced logits")
    return "✓"


def check_graph(h: Host) -> str:
    """An attribution graph with a layer at every block (MxD where the family takes it, else TopK; a skip
    transcoder at the last): every target's in-edges and bias sum to its input (<= 1e-4), and those inputs
    are the model's own on the prompt (each unit's pre-activation on its MLP's clean input, each logit)."""
    from mxd_lens import MxD, TopKSkipTranscoder, TopKTranscoder
    from mxd_lens.graph import build_graph

    model, n = h.model, h.model.cfg.n_layers
    layers = []
    for block in range(n):
        cls = TopKSkipTranscoder if block == n - 1 else MxD if h.mxd_ok else TopKTranscoder
        layers.append(randomise(cls.for_model(model, block, d_sae=16, k=3), block, scale=0.3))
    tokens = h.tokens[:1, :8]
    graph = build_graph(model, layers, tokens)
    errors = graph.completeness_errors()
    allowed = torch.full_like(errors, 1e-4)
    if TOL.eps is not None and bool(
        (errors > allowed).any()
    ):  # a half model: its rounding, summed over the edges
        rows = torch.cat(
            [torch.arange(graph.n_features), torch.arange(graph.n_nodes - graph.n_logits, graph.n_nodes)]
        )
        summed = graph.adjacency[rows].abs().sum(1) + graph.bias[rows].abs()
        allowed += HALF_UNITS * TOL.eps * summed / graph.inputs[rows].abs().clamp_min(1.0)
        TOL.widened = True
    worst = int(torch.argmax(errors - allowed))
    require(bool((errors <= allowed).all()), "completeness > 1e-4",
            f"|in-edges + bias - input| / max(|input|, 1) = {float(errors[worst]):.2e} > {float(allowed[worst]):.2e}")  # fmt: skip
    require(graph.n_features > 0, "no feature node")
    want = []
    for block, position, unit in zip(graph.features["block"], graph.features["position"], graph.features["unit"],
                                     strict=True):  # fmt: skip
        layer = layers[block]
        x, _ = mlp_io(model, block, tokens)
        with torch.no_grad():
            want.append(float((layer.process_sae_in(x[0, position]) @ layer.W_enc + layer.b_enc)[unit]))
    want = torch.tensor(want)
    close(graph.inputs[: graph.n_features], want, 1e-4 * max(1.0, float(want.abs().max())),
          "the units' inputs vs their pre-activations on the clean MLP inputs")  # fmt: skip
    with torch.no_grad():
        logits = model(tokens)[0, -1].float()
    demeaned = (logits - logits.mean())[graph.logit_tokens]
    close(graph.inputs[-graph.n_logits :], demeaned, 1e-4, "logit targets vs the model's logits",
          scale=float(logits.abs().max()))  # fmt: skip
    return "✓"


CHECKS: dict[str, Callable[[Host], str]] = {
    "load": check_load,
    "from_mlp": check_from_mlp,
    "train_load": check_train,
    "evaluate": check_evaluate,
    "attribution": check_attribution,
    "probe": check_probe,
    "steer": check_steer,
    "export": check_export,
    "graph": check_graph,
}


# -- the MoE refusals ----------------------------------------------------------------------------------
def refused(fn: Callable[[], Any], h: Host) -> str:
    try:
        fn()
    except ValueError as err:
        text = str(err)
        one_line = "\n" not in text
        require(f"{h.family.arch}'s MLP is a mixture of experts" in text and "use a model with dense MLPs" in text
                and one_line, "refused with another message", text)  # fmt: skip
        return REFUSED
    raise CheckFailed("not refused", "a MoE model was accepted")


def dense_twin_layer(h: Host, cls: Any, block: int = 1) -> Any:
    """A layer of the MoE model's shape built on a dense twin (the refusals must come from the MoE model)."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    dense = {"num_experts": None, "experts_per_token": None, "tokenizer_name": None}
    cfg = HookedTransformerConfig.from_dict({**h.model.cfg.to_dict(), **dense})
    layer = cls.for_model(HookedTransformer(cfg), block, d_sae=16, k=3)
    layer.cfg.metadata.model_name = h.model.cfg.model_name
    return layer


def refusal_checks(h: Host) -> dict[str, Callable[[], Any]]:
    import mxd_lens
    from mxd_lens import MxD, TopKTranscoder
    from mxd_lens.activations import ModelActivations
    from mxd_lens.analysis import probing
    from mxd_lens.evaluation import evaluate
    from mxd_lens.graph import build_graph
    from mxd_lens.models import load_model

    model = h.model
    layer = dense_twin_layer(h, TopKTranscoder)

    def splice():
        with mxd_lens.splice(model, layer):
            pass

    return {
        "load": lambda: load_model(str(h.folder)),
        "from_mlp": lambda: MxD.from_mlp(model, 1),
        "train_load": lambda: ModelActivations(model, [1], lambda: iter(h.tokens), context_size=8),
        "evaluate": lambda: evaluate(model, [layer], [h.tokens], progress=False),
        "attribution": splice,
        "probe": lambda: probing.pooled_activations(model, {"tc": layer}, ["the cat"], progress=False),
        "steer": splice,
        "export": lambda: TopKTranscoder.for_model(model, 1, d_sae=16, k=3),
        "graph": lambda: build_graph(model, [layer], h.tokens[:1, :8]),
    }


# -- running and caching -------------------------------------------------------------------------------
_RESULTS: dict[str, dict[str, Cell]] = {}


def host(root: Path, family: fam.Family) -> Host:

    model, hf, folder = fam.build(root, family)
    work = root / f"{family.key}-work"
    work.mkdir(exist_ok=True)
    if model.tokenizer("the cat sat", add_special_tokens=False)["input_ids"] != [3, 4, 5]:
        # transformers 5 loads any tokenizer in a qwen2 folder as Qwen2Tokenizer (byte-level BPE), which
        # splits the test's words: give the model the word tokenizer itself (a folder without config.json)
        from transformers import AutoTokenizer

        fam.make_tokenizer([fam.TOKENIZER_TEXT]).save_pretrained(work / "tok")
        model.set_tokenizer(AutoTokenizer.from_pretrained(work / "tok"))
    tokens = torch.randint(3, model.cfg.d_vocab, (2, 12), generator=torch.Generator().manual_seed(1))
    return Host(family, model, hf, folder, work, tokens)


def short(err: BaseException, root: Path) -> str:
    """The table's text of a failure: its type and first line, without this run's temporary paths."""
    if isinstance(err, CheckFailed):
        return err.short
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    first = first.replace(str(root.resolve()), "<tmp>").replace(str(root), "<tmp>")
    first = first if len(first) <= 240 else first[:237] + "..."
    return f"{type(err).__name__}: {first}"


def refused_at_load(root: Path, family: fam.Family) -> dict[str, Cell]:
    """A row load_model refuses: its one-line ValueError says ``family.refusal`` (the load cell); nothing
    else applies."""
    from mxd_lens.models import load_model

    start = time.perf_counter()
    try:
        folder, _ = fam.hf_folder(root, family)
        load_model(str(folder), dtype=family.dtype)
    except ValueError as err:
        if family.refusal in str(err) and "\n" not in str(err):
            cell = Cell(family.cell)
        else:
            cell = Cell("✗ refused with another message", f"expected {family.refusal!r} in one line: {err}")
    except Exception as err:
        cell = Cell(f"✗ {short(err, root)}", "".join(traceback.format_exception(err)))
    else:
        cell = Cell("✗ loads now: update the row", "load_model accepted it")
    cell.seconds = time.perf_counter() - start
    return {key: cell if key == "load" else Cell(NOT_LOADED) for key in GUARANTEES}


def run_family(root: Path, family: fam.Family) -> dict[str, Cell]:
    """Every check of ``family``, each caught: {test id: Cell}."""
    if family.key in _RESULTS:
        return _RESULTS[family.key]
    if family.route == "refused":
        _RESULTS[family.key] = refused_at_load(root, family)
        return _RESULTS[family.key]
    cells: dict[str, Cell] = {}
    try:
        h = host(root, family)
    except Exception as err:
        cell = Cell(f"✗ build: {short(err, root)}", traceback.format_exc())
        cells = dict.fromkeys(GUARANTEES, cell)
    else:
        checks = refusal_checks(h) if family.route == "moe" else CHECKS
        half = getattr(torch, family.dtype)
        TOL.eps = torch.finfo(half).eps if half in (torch.bfloat16, torch.float16) else None
        for key in GUARANTEES:
            start = time.perf_counter()
            TOL.widened = False
            try:
                text = refused(checks[key], h) if family.route == "moe" else checks[key](h)
                if text == "✓" and TOL.widened:
                    text = f"approx.: {family.dtype} rounding (≤ {HALF_UNITS} of its rounding units)"
                cells[key] = Cell(text)
            except Exception as err:
                cells[key] = Cell(f"✗ {short(err, root)}", "".join(traceback.format_exception(err)))
            cells[key].seconds = time.perf_counter() - start
        TOL.eps = None
    _RESULTS[family.key] = cells
    return cells


def table(root: Path) -> str:
    """The markdown table: family × guarantee, then each row's notes."""
    head = "| family | " + " | ".join(GUARANTEES.values()) + " |"
    lines = [head, "|" + "---|" * (len(GUARANTEES) + 1)]
    for family in fam.FAMILIES:
        cells = run_family(root, family)
        text = [cells[key].text.replace("|", "\\|") for key in GUARANTEES]
        lines.append(f"| {family.title} | " + " | ".join(text) + " |")
    lines += ["", "How each row is built (tests/families.py):", ""]
    for f in fam.FAMILIES:
        lines.append(f"- **{f.title}** (`{f.arch}`): {f.notes}.")
    return "\n".join(lines)


def docs_block() -> str:
    text = DOCS.read_text(encoding="utf-8")
    if START not in text or END not in text:
        raise ValueError(f"{DOCS} has no {START} ... {END} block")
    return text.split(START, 1)[1].split(END, 1)[0].strip("\n")


def write_docs(generated: str) -> None:
    text = DOCS.read_text(encoding="utf-8")
    before, rest = text.split(START, 1)
    after = rest.split(END, 1)[1]
    DOCS.write_text(f"{before}{START}\n{generated}\n{END}{after}", encoding="utf-8")


# -- pytest ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("families")


@pytest.mark.parametrize("guarantee", list(GUARANTEES))
@pytest.mark.parametrize("family", [f.key for f in fam.FAMILIES])
def test_family_guarantee(root, family, guarantee):
    cell = run_family(root, fam.BY_KEY[family])[guarantee]
    if cell.error is not None:
        pytest.fail(
            f"{fam.BY_KEY[family].title} × {GUARANTEES[guarantee]}: {cell.text}\n{cell.error}", pytrace=False
        )
    assert cell.text == "✓" or cell.text.startswith(("n/a: ", "approx.: ", "refused: ")), cell.text


def test_the_families_cover_what_the_issue_asks():
    assert len(fam.FAMILIES) >= 17
    keys = {"santacoder", "qwen1", "olmo", "olmo3", "apertus", "llama_mqa", "llama_rope3", "llama_head_dim",
            "llama_attention_bias", "llama_mlp_bias", "llama_bf16"}  # fmt: skip
    assert keys <= set(fam.BY_KEY), keys - set(fam.BY_KEY)
    assert fam.BY_KEY["llama_mqa"].kwargs["num_key_value_heads"] == 1
    qwen2 = fam.BY_KEY["qwen2"].kwargs
    assert qwen2["num_key_value_heads"] < qwen2["num_attention_heads"]
    assert qwen2["intermediate_size"] == 5.5 * fam.D_MODEL  # the real models' gated ratio


def test_every_causal_lm_class_tl_converts_has_a_row():
    """What "every MLP-bearing family TL converts" means: each causal-LM class of TL's weight dispatch is a
    row's class, but Gemma-3's image-text class, whose language model is the Gemma-3 row's (TL builds it by
    name only; a folder of it is refused)."""
    import inspect
    import re

    from transformer_lens import loading_from_pretrained as tl

    source = inspect.getsource(tl.get_pretrained_state_dict)
    converted = {
        n for n in re.findall(r'original_architecture == "(\w+)"', source) if "CausalLM" in n or "LMHead" in n
    }
    assert converted - {f.arch for f in fam.FAMILIES} == set()
    assert {"Gemma3ForConditionalGeneration"} <= set(re.findall(r'original_architecture == "(\w+)"', source))


def test_the_docs_table_is_the_generated_one(root):
    generated = table(root)
    assert docs_block() == generated, (
        "docs/models.md's families table is stale: python tests/test_families.py --write"
    )


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/test_families.py --write")
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory(prefix="families-") as tmp:
        generated = table(Path(tmp))
    write_docs(generated)
    print(generated)
