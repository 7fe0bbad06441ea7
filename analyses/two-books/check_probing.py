"""Independent check of the sparse-probing ranking at one K (issue 11; K = 32 unless a third argument says): 5-fold stratified CV instead of the
study's 60/20/20 split, top-5 features by |mean difference| on the training folds, plain
LogisticRegression(C=1, class_weight="balanced") on standardised features, balanced accuracy
(the study balances its test split; one-vs-rest folds here are 1:4 or so). Reads the study's pooled activations.
    python analyses/two-books/check_probing.py results/v2/probing/pooled /work/shared/data/probing
    python analyses/two-books/check_probing.py results/v3/probing/pooled /work/shared/data/probing 16"""

import sys

import numpy as np
from safetensors.torch import load_file
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import balanced_accuracy_score
from sklearn.model_selection import StratifiedKFold
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from mxd_lens.analysis.tasks import offline_suite

pooled, data = sys.argv[1], sys.argv[2]
K = int(sys.argv[3]) if len(sys.argv) > 3 else 32
names = [f"L15.{arch}.k{K}.m8" for arch in ("mxd", "transcoder", "skip_transcoder")]
scores = {n: [] for n in names}
for task_set in offline_suite(data_root=data):
    ex = task_set.load(data)
    labels = np.array(ex.labels)
    for cls in sorted(set(labels))[:1] if task_set.binary else sorted(set(labels)):
        y = labels == cls
        for n in names:
            X = load_file(f"{pooled}/{task_set.name}/{n}.safetensors")["pooled"].numpy()
            acc = []
            for tr, te in StratifiedKFold(5, shuffle=True, random_state=0).split(X, y):
                top = np.argsort(-np.abs(X[tr][y[tr]].mean(0) - X[tr][~y[tr]].mean(0)), kind="stable")[:5]
                clf = make_pipeline(
                    StandardScaler(), LogisticRegression(C=1.0, max_iter=2000, class_weight="balanced")
                )
                clf.fit(X[tr][:, top], y[tr])
                acc.append(balanced_accuracy_score(y[te], clf.predict(X[te][:, top])))
            scores[n].append(np.mean(acc))
for n in names:  # how many units a text's pooled code uses, and how many fire on some text
    X = np.concatenate(
        [
            load_file(f"{pooled}/{t.name}/{n}.safetensors")["pooled"].numpy()
            for t in offline_suite(data_root=data)
        ]
    )
    print(
        f"{n}: {X.shape[0]} texts, nonzero per text {(X > 0).sum(1).mean():.1f}, "
        f"units nonzero on some text {(X > 0).any(0).sum()} of {X.shape[1]} ({(X > 0).any(0).mean():.1%})"
    )
for n in names:
    print(f"{n}: tasks {len(scores[n])}, mean 5-fold balanced accuracy (top 5) {np.mean(scores[n]):.3f}")
d = np.array(scores[names[0]]) - np.array(scores[names[2]])
print(f"MxD - skip: {d.mean():+.3f} +- {d.std(ddof=1) / np.sqrt(len(d)):.3f}")
d = np.array(scores[names[0]]) - np.array(scores[names[1]])
print(f"MxD - transcoder: {d.mean():+.3f} +- {d.std(ddof=1) / np.sqrt(len(d)):.3f}")
