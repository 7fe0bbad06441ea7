"""Writes notebooks/smollm2_mxd.ipynb (no outputs); notebooks/run_smollm2.py executes it in place so
that it is committed with its outputs (minutes on a CPU; not in CI).

    python notebooks/build_smollm2.py && python notebooks/run_smollm2.py
"""

from pathlib import Path

from build_quickstart import write_notebook

CELLS = [
    (
        "md",
        """# MxD on SmolLM2-135M (offline)

The embedded default model, SmolLM2-135M-Instruct (from its PyPI wheel, no hub): train a small MxD and
a parameter-matched TopK transcoder on block 15, compare them spliced on held-out text, plot the
frontier study's results, read one expert's top-activating contexts and steer with it. Small budget
(minutes on a CPU): the numbers here show the workflow; docs/results.md has the study's.""",
    ),
    (
        "code",
        """%matplotlib inline
from pathlib import Path

import pandas as pd

import mxd_lens
from mxd_lens.activations import CachedActivations, ModelActivations, write_cache
from mxd_lens.data import default_text
from mxd_lens.evaluation import evaluate, held_out_batches
from mxd_lens.layers.learners import LearnerSpec
from mxd_lens.models import load_model
from mxd_lens.training import TrainConfig, Trainer

work = Path("../results/notebook-smollm2")
model = load_model()  # SmolLM2-135M-Instruct, offline
block, k = 15, 32
print(model.cfg.model_name, model.cfg.n_layers, "blocks, d_model", model.cfg.d_model)""",
    ),
    (
        "md",
        """## Cache a little, train from the cache for several epochs""",
    ),
    (
        "code",
        """text = str(default_text())  # the bundled Austen novels; training reads the 'train' side of its split
stream = ModelActivations.from_text(model, [block], text, context_size=128, rows_per_shard=64)
cache = write_cache(
    stream, work / "cache", n_shards=8, dtype="float16", progress=False
)  # 8 x 64 x 127 tokens
source = CachedActivations(cache)
trainer = Trainer(
    [LearnerSpec("mxd", block, k), LearnerSpec("transcoder", block, k)],
    source,
    TrainConfig(epochs=3, batch_tokens=256),
    work / "run",
    progress=False,
)
metrics = trainer.fit()
pd.DataFrame(metrics).T[["fvu", "l0", "dead_fraction"]]""",
    ),
    (
        "md",
        """## Splice on held-out text

ΔCE is the spliced model's loss minus the clean one's (lower is better).""",
    ),
    (
        "code",
        """layers = {name: layer.eval() for name, layer in trainer.trained_layers().items()}
batches = held_out_batches(model, text, "eval", eval_tokens=4096, context_size=128)
rows = evaluate(model, layers, batches, progress=False)
pd.DataFrame(rows)[["name", "params", "delta_ce", "kl", "fvu", "l0", "dead_fraction", "ce_recovered_zero"]]""",
    ),
    (
        "md",
        """## The frontier study (docs/results.md): ΔCE, KL and FVU against K""",
    ),
    (
        "code",
        """from mxd_lens.studies.frontier.run import load_results, plot_frontier, summarize

# the committed copy of the study's results, with the K = 8 MxD point's rerun (gradient clipping) in
# place of its diverged run, as in docs/results.md
study, rerun = Path("../docs/results/frontier-v2"), Path("../docs/results/frontier-v2-clip")
if (study / "frontier.json").is_file():
    table = load_results(study, [rerun])
    display(plot_frontier(table))
    display(summarize(table)[["block", "k", "arch", "seeds", "delta_ce", "kl", "fvu", "l0", "dead_fraction"]])
else:
    print(f"{study} not found: run the study (command in docs/results.md), then this notebook again")""",
    ),
    (
        "md",
        """## One expert: its top-activating contexts, and steering with it""",
    ),
    (
        "code",
        """from IPython.display import HTML

from mxd_lens.analysis.inspect import text_batches, to_html, top_activations

mxd = layers[next(n for n in layers if ".mxd." in n)]
used = top_activations(
    model, mxd, text_batches(model, None, 8192, 128), range(mxd.cfg.d_sae), n=1, progress=False
)
expert = int(used.sort_values("activation", ascending=False).iloc[0].feature)  # the most strongly firing
contexts = top_activations(model, mxd, text_batches(model, None, 32768, 128), [expert], n=8, progress=False)
HTML(to_html(contexts, f"MxD block {block}, expert {expert}"))""",
    ),
    (
        "code",
        """from mxd_lens.analysis import steering

scale = float(contexts.activation.max())
for multiple in (0, 4, 16):
    with mxd_lens.splice(model, mxd, error_term=True), steering.steer(model, mxd, expert, multiple * scale):
        generation = steering.generate(model, "Let's talk about", n_samples=1, max_new_tokens=24, seed=0)
    print(f"alpha = {multiple:>2} x max activation: {generation.texts[0]!r}")""",
    ),
]


def main() -> None:
    write_notebook(CELLS, Path(__file__).with_name("smollm2_mxd.ipynb"))


if __name__ == "__main__":
    main()
