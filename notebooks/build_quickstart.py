"""Writes notebooks/quickstart.ipynb (cells below, no outputs: CI executes it, tests/test_notebooks.py).

python notebooks/build_quickstart.py
"""

from pathlib import Path

import nbformat

CELLS = [
    (
        "md",
        """# mxd-lens quickstart

The Python API on a tiny random model (the command-line verbs: docs/studies.md), in about a minute on a
CPU: build a Mixture of Decoders (MxD) and a TopK transcoder for one MLP, splice them in, encode/decode,
train a few steps, evaluate, save and load (SAELens format), attach with `add_sae`, steer, and probe a toy
task. The real model (SmolLM2-135M, offline) is `notebooks/smollm2_mxd.ipynb`.""",
    ),
    (
        "code",
        """import random
import tempfile
from pathlib import Path

import torch
from sae_lens import SAE, HookedSAETransformer
from tokenizers import Tokenizer, models, pre_tokenizers
from transformer_lens import HookedTransformerConfig
from transformers import AutoTokenizer, PreTrainedTokenizerFast

import mxd_lens  # registers MxD and our transcoders with SAELens

torch.manual_seed(0)
work = Path(tempfile.mkdtemp())""",
    ),
    (
        "md",
        """A tiny gated (SwiGLU-like) model with a word-level tokenizer, and a text of random sentences.""",
    ),
    (
        "code",
        """words = "the cat sat on a mat while dogs ran over green hills and birds sang songs of rain".split()
rng = random.Random(0)
docs = [" ".join(rng.choice(words) for _ in range(rng.randint(5, 40))) for _ in range(400)]
(work / "corpus.txt").write_text("\\n\\n".join(docs))
vocab = {"<bos>": 0, "<eos>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(words)}}
backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
backend.pre_tokenizer = pre_tokenizers.Whitespace()
PreTrainedTokenizerFast(
    tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
).save_pretrained(work / "tok")

cfg = HookedTransformerConfig(
    n_layers=2,
    d_model=64,
    n_ctx=32,
    d_head=16,
    n_heads=4,
    d_mlp=256,
    d_vocab=len(vocab),
    act_fn="silu",
    gated_mlp=True,
    normalization_type="RMS",
    model_name="tiny",
)
model = HookedSAETransformer(cfg)  # a HookedTransformer that also takes SAELens's add_sae
model.set_tokenizer(AutoTokenizer.from_pretrained(work / "tok"))
tokens = model.to_tokens(docs[:4])[:, :32]""",
    ),
    (
        "md",
        """## Build and splice

`MxD.for_model(model, block, d_sae=N, k=K)` sizes an MxD for block 1's MLP; `match_experts` gives the N
whose parameter count matches a TopK transcoder of a given width. `MxD.from_mlp` is the MLP itself as an
MxD: spliced in, the loss does not change.""",
    ),
    (
        "code",
        """width = 8 * cfg.d_model
n = mxd_lens.match_experts(width, cfg.d_model, cfg.d_model, cfg.d_mlp, glu=True)
mxd = mxd_lens.MxD.for_model(model, 1, d_sae=n, k=4)
tc = mxd_lens.TopKTranscoder.for_model(model, 1, d_sae=width, k=4)
print(
    f"MxD: {n} experts, {sum(p.numel() for p in mxd.parameters()):,} params; "
    f"transcoder: {width} latents, {sum(p.numel() for p in tc.parameters()):,} params"
)

clean = model(tokens, return_type="loss").item()
with mxd_lens.splice(model, mxd_lens.MxD.from_mlp(model, 1)):
    exact = model(tokens, return_type="loss").item()
print(f"clean loss {clean:.4f}; with MxD.from_mlp spliced {exact:.4f}")
assert abs(exact - clean) < 1e-4""",
    ),
    (
        "md",
        """## Encode and decode

The codes are the K active experts' coefficients; `decode(encode(x))` is the layer's output.""",
    ),
    (
        "code",
        """with mxd_lens.capture_mlp_io(model, [1]) as io:
    model(tokens)
x = io[1]["in"].reshape(-1, cfg.d_model)
codes = mxd.encode(x)
print("codes", tuple(codes.shape), "active per token", (codes > 0).sum(-1).float().mean().item())
torch.testing.assert_close(mxd.decode(codes), mxd(x))""",
    ),
    (
        "md",
        """## Train a few steps

A live activation stream from the model over the text, and the trainer on both layers (one batch feeds
every learner). A real run uses a cache and several epochs (`mxd-lens cache`, `mxd-lens train`).""",
    ),
    (
        "code",
        """from mxd_lens.activations import ModelActivations
from mxd_lens.layers.learners import LearnerSpec
from mxd_lens.training import TrainConfig, Trainer

stream = ModelActivations.from_text(model, [1], str(work / "corpus.txt"), context_size=16, rows_per_shard=32)
trainer = Trainer(
    [mxd, LearnerSpec("transcoder", 1, k=4)],
    stream,
    TrainConfig(total_tokens=64 * 120, batch_tokens=64, lr=3e-3),
    progress=False,
)
metrics = trainer.fit()
trained = trainer.trained_layers()  # at raw scale, with the training record in cfg.metadata.training
for name, m in metrics.items():
    print(f"{name}: FVU {m['fvu']:.3f}, L0 {m['l0']:.1f}")""",
    ),
    (
        "md",
        """## Evaluate on held-out text

Each layer spliced alone: ΔCE (lower is better), KL, FVU, L0, dead units, CE recovered.""",
    ),
    (
        "code",
        """import pandas as pd

from mxd_lens.evaluation import evaluate, held_out_batches

batches = held_out_batches(model, str(work / "corpus.txt"), "eval", eval_tokens=320, context_size=16)
rows = evaluate(model, trained, batches, progress=False)
pd.DataFrame(rows)[["name", "delta_ce", "kl", "fvu", "l0", "dead_fraction", "ce_recovered_zero"]]""",
    ),
    (
        "md",
        """## Save and load (SAELens format), and attach the SAELens way""",
    ),
    (
        "code",
        """name = next(n for n in trained if ".mxd." in n)
trained[name].save_model(work / name)
loaded = SAE.load_from_disk(work / name)  # our class, because mxd_lens is imported
print(type(loaded).__name__, "from", work / name)

# replaces hook_mlp_out, as mxd_lens.splice does; the layer trained without position 0 (BOS), so
# keep the MLP there as the splice does (SAELens splices every position unless told which to skip)
model.add_sae(loaded, exclude_special_tokens=[model.tokenizer.bos_token_id])
with_sae = model(tokens, return_type="loss").item()
model.reset_saes()
with mxd_lens.splice(model, loaded):
    spliced = model(tokens, return_type="loss").item()
print(f"add_sae loss {with_sae:.4f} == splice loss {spliced:.4f}")
assert abs(with_sae - spliced) < 1e-5""",
    ),
    (
        "md",
        """## Steer

Add α to one expert's coefficient at every position; with the error term on, α = 0 is exactly the clean model. (A random model writes nonsense either way: this shows the mechanics.)""",
    ),
    (
        "code",
        """from mxd_lens.analysis import steering

feature = int(loaded.encode(x).sum(0).argmax())  # the expert most used on this text
for alpha in (0.0, 20.0):
    with mxd_lens.splice(model, loaded, error_term=True), steering.steer(model, loaded, feature, alpha):
        generation = steering.generate(model, "the cat", n_samples=2, max_new_tokens=8, seed=0)
    print(f"alpha {alpha:>4}: {generation.texts[0]!r}")""",
    ),
    (
        "md",
        """## Probe a toy task

Texts that mention *cat* vs *dogs*: which k features separate them (features ranked on the training split only).""",
    ),
    (
        "code",
        """import json
import lzma

from mxd_lens.analysis import probing
from mxd_lens.analysis.tasks import jsonl_task_set

rows = []
for i in range(120):
    label = "cat" if i % 2 else "dog"
    body = [rng.choice(words[4:]) for _ in range(rng.randint(4, 10))]
    body.insert(rng.randrange(len(body)), "cat" if label == "cat" else "dogs")
    rows.append({"text": " ".join(body), "label": label})
with lzma.open(work / "animals.jsonl.xz", "wt") as f:
    f.writelines(json.dumps(r) + "\\n" for r in rows)
task_set = jsonl_task_set(work / "animals.jsonl.xz", ["cat", "dog"], per_class=60)
table, _ = probing.run_probing(model, [task_set], trained, ks=[1, 2], context_size=16, progress=False)
probing.summarize(table)[["k=1", "k=2", "k=all"]].round(3)""",
    ),
]


def notebook(cells: list[tuple[str, str]]) -> nbformat.NotebookNode:
    """A notebook of markdown ("md") and code cells, no outputs, the python3 kernel; cell ids by position,
    so that writing it again changes nothing (tests/test_notebooks.py compares it with the committed one)."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_markdown_cell(src, id=f"cell-{i}") if kind == "md"
                else nbformat.v4.new_code_cell(src, id=f"cell-{i}") for i, (kind, src) in enumerate(cells)]  # fmt: skip
    return nb


def write_notebook(cells: list[tuple[str, str]], path: Path) -> None:
    nbformat.write(notebook(cells), path)


def main() -> None:
    write_notebook(CELLS, Path(__file__).with_name("quickstart.ipynb"))


if __name__ == "__main__":
    main()
