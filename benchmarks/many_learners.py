"""One stream feeding N learners: the whole training step (loss, backward, clipping, Adam, decoder
renormalisation, firing counters: ``Trainer.train_step``) against the GEMM-rate floor, per architecture.

    python benchmarks/many_learners.py                      # SmolLM2 dims: d 576, GLU 1536, m 8, K 32, 512 tokens
    python benchmarks/many_learners.py --learners 30 --repeats 3     # a replacement model's 30 blocks
    python benchmarks/many_learners.py --d-model 64 --d-hidden 128 --tokens 64 --learners 2 --repeats 1  # smoke

For each architecture, one ``Trainer`` with ``--learners`` learners of it (one per block of a synthetic
stream, random activations) takes ``--repeats`` timed steps after ``--warmup`` untimed ones; the same
stream batch feeds them all, as a live stream does. Printed per architecture, per learner-step:

    step        the median wall time of a whole step, divided by the learners
    floor       the step's matmul FLOPs (benchmarks/layer_speed.py's FLOP model, + W_skip's forward and
                gradient for the skip transcoder) at the plain matmul rate measured in the same run
                ([T, d] x [d, m*d], fp32, the same threads)
    step/floor  the ratio the issue targets (<= 1.3)
    adam        the optimizer step alone (torch.optim.Adam(fused=True), as the trainer builds it)
    adam floor  Adam's memory traffic (per parameter: read weight, grad, two moments; write weight, two
                moments; 28 bytes) at the copy bandwidth measured in the same run

The floor counts no elementwise or memory-bound work (TopK selection, AuxK, Adam, norms), so where
step/floor stays above 1.3 the adam columns show how much of the gap is the optimizer's memory traffic.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from layer_speed import Dims, matmul_rate, step_macs  # noqa: E402

from mxd_lens.activations import StreamInfo  # noqa: E402
from mxd_lens.config import RECOMMENDED_MXD, TrainConfig  # noqa: E402
from mxd_lens.layers.learners import LearnerSpec  # noqa: E402
from mxd_lens.matching import match_experts  # noqa: E402
from mxd_lens.training import Trainer  # noqa: E402


class _Stream:
    """What a Trainer reads of a source before its first batch: the stream's description."""

    epoch_tokens = None
    text_info = None

    def __init__(self, info: StreamInfo):
        self.info = info


def copy_bandwidth(n: int = 1 << 25, repeats: int = 5) -> float:
    """Bytes per second of a large tensor copy (read + write counted), the memory-bound floor."""
    a, b = torch.randn(n), torch.empty(n)
    b.copy_(a)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        b.copy_(a)
        times.append(time.perf_counter() - t)
    return 2 * 4 * n / min(times)


def measure(arch: str, args: argparse.Namespace, rate: float, bandwidth: float) -> dict[str, float]:
    d, h = args.d_model, args.d_hidden
    blocks = list(range(args.learners))
    names = {str(b): [f"blocks.{b}.mlp.hook_in", f"blocks.{b}.hook_mlp_out"] for b in blocks}
    info = StreamInfo("synthetic", blocks, d, d, 16, 129, True, d_hidden=h, activation="silu", gated=True,
                      hook_names=names)  # fmt: skip
    specs = [LearnerSpec(arch, block, args.k, args.m) for block in info.blocks]
    config = TrainConfig(total_tokens=args.tokens * 1000, batch_tokens=args.tokens)
    trainer = Trainer(specs, _Stream(info), config, progress=False)
    trainer.scales = {b: (1.0, 1.0) for b in info.blocks}
    trainer.loss_scale = {b: float(d) for b in info.blocks}
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(args.tokens, d, generator=g), torch.randn(args.tokens, d, generator=g)
    batch = {b: (x, y) for b in info.blocks}
    steps = []
    for i in range(args.warmup + args.repeats):
        t = time.perf_counter()
        trainer.train_step(batch)
        if i >= args.warmup:
            steps.append(time.perf_counter() - t)
    learner = next(iter(trainer.learners.values()))
    optimizer = learner.optimizer
    adam = []
    for _ in range(args.repeats + 1):
        t = time.perf_counter()
        optimizer.step()
        adam.append(time.perf_counter() - t)
    n_params = sum(p.numel() for p in learner.layer.parameters())
    mxd = arch.startswith("mxd")
    dims = Dims(args.tokens, d, d, h, args.m * d, learner.layer.cfg.d_sae if mxd else 0, args.k)
    macs = step_macs("mxd_sparse" if mxd else "tc_sparse", dims)
    macs += (
        2 * args.tokens * d * h if mxd else 0
    )  # a GLU host: E's second half (x E_up), forward and gradient
    macs += 2 * args.tokens * d * d if arch == "skip_transcoder" else 0  # x W_skip, forward and gradient
    return {
        "step": statistics.median(steps) / args.learners,
        "floor": 2 * macs / rate,
        "adam": statistics.median(adam[1:]),
        "adam_floor": 28 * n_params / bandwidth,
        "params": n_params,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=576)
    parser.add_argument("--d-hidden", type=int, default=1536, help="the host MLP's width (GLU)")
    parser.add_argument("--m", type=int, default=8)
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=512, help="tokens per step")
    parser.add_argument("--learners", type=int, default=4, help="learners of each architecture (blocks)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    d = args.d_model
    n = match_experts(args.m * d, d, d, args.d_hidden, glu=True)
    rate_dims = Dims(args.tokens, d, d, args.d_hidden, args.m * d, n, args.k)
    rate = matmul_rate(rate_dims) * 1e9
    bandwidth = copy_bandwidth()
    print(
        f"d_model {d}, GLU width {args.d_hidden}, m {args.m} (H {args.m * d}, MxD N {n}), K {args.k}, "
        f"{args.tokens} tokens a step, {args.learners} learners each, {torch.get_num_threads()} threads; "
        f"matmul {rate / 1e9:.0f} GFLOP/s, copy {bandwidth / 1e9:.1f} GB/s"
    )
    print(
        f"{'architecture':<36} {'step ms':>8} {'floor ms':>9} {'step/floor':>10} {'adam ms':>8} {'adam floor':>10}"
    )
    for arch in (RECOMMENDED_MXD, "transcoder", "skip_transcoder"):
        r = measure(arch, args, rate, bandwidth)
        print(
            f"{arch:<36} {r['step'] * 1e3:>8.3g} {r['floor'] * 1e3:>9.3g} {r['step'] / r['floor']:>10.2f} "
            f"{r['adam'] * 1e3:>8.3g} {r['adam_floor'] * 1e3:>10.3g}"
        )
    print(f"matmul rate after: {matmul_rate(rate_dims):.0f} GFLOP/s (drift: compare with the first)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
