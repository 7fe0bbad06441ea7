"""Layer speed (issue 2): time of ONE training step of MxD and a TopK transcoder, parameter-matched.

    python benchmarks/layer_speed.py                       # GPT-2 small dims, m = 32, 1,024 tokens
    python benchmarks/layer_speed.py --tokens 64 --m 5 --repeats 1                          # smoke run
    python benchmarks/layer_speed.py --tokens 64 --m 2 --d-model 64 --d-hidden 64 --k 8     # tiny dims
    python benchmarks/layer_speed.py --mallopt     # each variant without / with keep_freed_memory()

A step is: zero grads (set to None, PyTorch's default), out = f(x), loss = mean((out - y)^2),
loss.backward(). x does not require grad (as in training, where x is the frozen host's MLP input).
The optimizer step is not in the step time; an Adam step over the same layer (lr = 0, so the
weights never change between steps) is timed separately and shown in its own column.

Four variants, timed the same way, round-robin (the order rotated every round) so that drift hits
all of them equally; the table shows the median over --repeats rounds after --warmup rounds:

    MxD sparse           mxd(x)                    TopK encoder with K-column backward + embedding_bag decode
    MxD dense ref        mxd.forward_reference(x)  dense [T, N] codes, dense codes @ C, plain autograd
    Transcoder sparse    tc(x)
    Transcoder dense ref tc.forward_reference(x)

Before timing, each sparse variant's output and parameter gradients are checked against its dense
reference on the benchmark batch, so the ratios never compare different functions.

``--mallopt``: glibc's allocator settings are process-global, so the whole benchmark runs twice, in two
child processes one after the other, the second after ``mxd_lens.allocator.keep_freed_memory()`` (what
the ``mxd-lens`` command line does); the table is each variant's median s/step in both and the ratio.

Sizes: I = O = d_model, H* = d_hidden (the host MLP width), transcoder width H = m * I, and N MxD
experts from ``mxd_lens.match_experts(H, I, O, H*)`` so that both layers have the same parameters.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # time this checkout's mxd_lens
import mxd_lens  # noqa: E402
import mxd_lens.allocator  # noqa: E402

# --------------------------------------------------------------------------------------------------
# FLOP model. Counted: matmul-like work only, at 2 FLOPs per multiply-add, T tokens, and nothing
# for x's gradient (x does not require grad, so autograd never computes it). Elementwise work
# (ReLU, GELU, the product (zD) * (aC), biases, bias gradients) is O(T * (N or H*)) and left out;
# so are the non-arithmetic passes over [T, N] (TopK selection, zero-fill, scatter), which cost
# memory traffic, not FLOPs: that is why "achieved GFLOP/s" is printed next to each variant.
#
#   encoder gate   pre = x W_enc          fwd: T*I*W   MACs     (W = N for MxD, H for transcoder)
#     dense ref    dW_enc = x^T dpre      bwd: T*I*W            (dpre is a dense [T, W] matrix)
#     sparse       dW_enc = x^T S         bwd: T*K*I            (S: [T, W] CSR with K entries per row)
#   decoder        y = codes W_dec        fwd: T*W*O  (dense ref)  |  T*K*O  (sparse: embedding_bag)
#                  dW_dec = codes^T dy    bwd: T*W*O  (dense ref)  |  T*K*O  (sparse: K rows/token)
#                  dcodes = dy W_dec^T    bwd: T*W*O  (dense ref)  |  T*K*O  (sparse: K dots/token)
#   MxD only, both forms (the dense hidden layer z = phi(x E + b_E), out = (z D) * (a C) + b):
#                  x E                    fwd: T*I*H*
#                  dE = x^T dpre_E        bwd: T*I*H*           (no dx: x needs no grad)
#                  z D                    fwd: T*H*O
#                  dD = z^T d(zD)         bwd: T*H*O
#                  dz = d(zD) D^T         bwd: T*H*O            (needed to reach dE through phi)
#
# Hence, in MACs per token (FLOPs = 2 * T * this):
#   transcoder sparse   I*H + K*(I + 3*O)
#   transcoder dense    2*I*H + 3*H*O
#   MxD sparse          I*N + K*(I + 3*O) + 2*I*H* + 3*H*O
#   MxD dense ref       2*I*N + 3*N*O     + 2*I*H* + 3*H*O
# The dense hidden layer adds 2*I*H* + 3*H*O MACs per token to MxD in both forms: a floor under
# MxD(sparse) / Transcoder(sparse) that no sparse kernel removes. (Parameter matching makes MxD's gate
# narrower, H - N ~ H*, so the net extra over the transcoder is ~ 2*I*H* + 2*H*O MACs per token.)
# Cross-check: torch.profiler(with_flops=True) counts the same mm/addmm FLOPs to within 0.1%.
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Dims:
    tokens: int
    d_in: int
    d_out: int
    d_hidden: int  # H*
    width: int  # transcoder width H = m * d_in
    n_experts: int  # N
    k: int
    params_mxd: int = 0
    params_tc: int = 0


def _n_params(layer: torch.nn.Module) -> int:
    return sum(p.numel() for p in layer.parameters())


def step_macs(variant: str, d: Dims) -> int:
    """Multiply-adds of one training step (forward + backward, no dx) of ``variant``; see above."""
    T, I, O, Hs, H, N, K = d.tokens, d.d_in, d.d_out, d.d_hidden, d.width, d.n_experts, d.k
    hidden = 2 * I * Hs + 3 * Hs * O
    per_token = {
        "mxd_sparse": I * N + K * (I + 3 * O) + hidden,
        "mxd_dense": 2 * I * N + 3 * N * O + hidden,
        "tc_sparse": I * H + K * (I + 3 * O),
        "tc_dense": 2 * I * H + 3 * H * O,
    }[variant]
    return T * per_token


VARIANTS = {
    # key: (label, layer name, method name)
    "mxd_sparse": ("MxD sparse `mxd(x)`", "mxd", "__call__"),
    "mxd_dense": ("MxD dense ref `mxd.forward_reference(x)`", "mxd", "forward_reference"),
    "tc_sparse": ("Transcoder sparse `tc(x)`", "tc", "__call__"),
    "tc_dense": ("Transcoder dense ref `tc.forward_reference(x)`", "tc", "forward_reference"),
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tokens", type=int, default=1024, help="tokens per batch T (default 1024)")
    p.add_argument("--k", type=int, default=32, help="active codes per token K (default 32)")
    p.add_argument(
        "--m", type=int, default=32, help="transcoder width multiplier: H = m * d_model (default 32)"
    )
    p.add_argument("--repeats", type=int, default=5, help="timed rounds; the table shows medians (default 5)")
    p.add_argument(
        "--warmup", type=int, default=1, help="untimed rounds after the correctness check (default 1)"
    )
    p.add_argument(
        "--threads", type=int, default=None, help="torch.set_num_threads (default: torch's own choice)"
    )
    p.add_argument("--d-model", type=int, default=768, help="I = O (default 768, GPT-2 small)")
    p.add_argument("--d-hidden", type=int, default=3072, help="host MLP width H* (default 3072, GPT-2 small)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--profile", action="store_true", help="also profile one step of each variant (torch.profiler)"
    )
    p.add_argument(
        "--mallopt",
        action="store_true",
        help="run in two child processes, without and with keep_freed_memory(), and compare",
    )
    p.add_argument("--child", choices=("plain", "mallopt"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in ("tokens", "k", "m", "repeats", "d_model", "d_hidden"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    if args.threads is not None and args.threads <= 0:
        p.error("--threads must be positive")
    width = args.m * args.d_model
    try:
        n = mxd_lens.match_experts(width, args.d_model, args.d_model, args.d_hidden)
    except ValueError as err:
        p.error(
            f"--m {args.m}: {err} (parameter matching needs m > d_hidden / d_model = "
            f"{args.d_hidden / args.d_model:g}; for a tiny run shrink the dims too, e.g. "
            f"--d-model 64 --d-hidden 64)"
        )
    if args.k > min(n, width):
        p.error(f"--k {args.k} exceeds the number of MxD experts N = {n} (or the width H = {width})")
    return args


def build(
    args: argparse.Namespace,
) -> tuple[Dims, mxd_lens.MxD, mxd_lens.TopKTranscoder, torch.Tensor, torch.Tensor]:
    I = O = args.d_model
    width = args.m * I
    n = mxd_lens.match_experts(width, I, O, args.d_hidden)
    dims = Dims(args.tokens, I, O, args.d_hidden, width, n, args.k)
    torch.manual_seed(args.seed)
    mxd = mxd_lens.MxD(
        mxd_lens.MxDConfig(d_in=I, d_out=O, d_sae=n, k=args.k, d_hidden=args.d_hidden, activation="gelu_new")
    )
    tc = mxd_lens.TopKTranscoder(mxd_lens.TopKTranscoderConfig(d_in=I, d_out=O, d_sae=width, k=args.k))
    dims = Dims(**{**dims.__dict__, "params_mxd": _n_params(mxd), "params_tc": _n_params(tc)})
    with torch.no_grad():
        # W_out (D) starts at zero; make it non-zero so the step is representative (D = 0 would
        # zero the gradients of everything but D and b).
        mxd.W_out.normal_(0.0, args.d_hidden**-0.5)
    x = torch.randn(args.tokens, I)
    y = torch.randn(args.tokens, O)
    # Matching is on weight matrices; the two count different biases, so allow a small difference.
    assert abs(dims.params_mxd - dims.params_tc) <= 0.01 * dims.params_tc + 2 * (args.d_hidden + O + I), dims
    return dims, mxd, tc, x, y


def make_step(layer: torch.nn.Module, method: str, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    fn = layer if method == "__call__" else getattr(layer, method)

    def step() -> None:
        layer.zero_grad(set_to_none=True)
        out = fn(x)
        loss = (out - y).pow(2).mean()
        loss.backward()

    return step


def check_agreement(layers: dict[str, torch.nn.Module], x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """Sparse and dense reference must give the same output (atol 1e-4) and the same gradients."""
    report = {}
    for name, layer in layers.items():
        with torch.no_grad():
            fast, ref = layer(x), layer.forward_reference(x)
        diff = (fast - ref).abs().max().item()
        if not torch.allclose(fast, ref, atol=1e-4):
            raise AssertionError(
                f"{name}: sparse and dense reference outputs differ (max |diff| = {diff:.3g})"
            )
        report[f"{name} output max|diff|"] = diff
        grads = {}
        for method in ("__call__", "forward_reference"):
            make_step(layer, method, x, y)()
            grads[method] = {k: p.grad.clone() for k, p in layer.named_parameters()}
        layer.zero_grad(set_to_none=True)
        worst = 0.0
        for key, g_fast in grads["__call__"].items():
            g_ref = grads["forward_reference"][key]
            scale = g_ref.abs().max().item()
            rel = (
                (g_fast - g_ref).abs().max().item() / scale
                if scale > 0
                else (g_fast - g_ref).abs().max().item()
            )
            if rel > 1e-3:
                raise AssertionError(
                    f"{name}: gradient of {key} differs between sparse and dense reference (rel {rel:.3g})"
                )
            worst = max(worst, rel)
        report[f"{name} grads max rel diff"] = worst
    return report


def matmul_rate(dims: Dims, repeats: int = 3) -> float:
    """GFLOP/s of a plain fp32 [T, I] @ [I, W] matmul at the benchmark's sizes: the machine's
    practical matmul speed, to read the achieved-GFLOP/s column against."""
    a, b = torch.randn(dims.tokens, dims.d_in), torch.randn(dims.d_in, dims.width)
    a @ b
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * dims.tokens * dims.d_in * dims.width / min(times) / 1e9


def _machine_busy_s() -> float | None:
    """CPU seconds all processes on the machine have used so far (Linux /proc/stat), or None."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[:8])
        return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return None


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def run(argv: Sequence[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.mallopt:
        return mallopt_comparison([a for a in argv if a != "--mallopt"])
    if args.child == "mallopt" and not mxd_lens.allocator.keep_freed_memory():
        raise RuntimeError("keep_freed_memory() did not apply (not glibc?)")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dims, mxd, tc, x, y = build(args)
    layers = {"mxd": mxd, "tc": tc}
    agreement = check_agreement(layers, x, y)

    steps = {key: make_step(layers[lname], method, x, y) for key, (_, lname, method) in VARIANTS.items()}
    optims = {lname: torch.optim.Adam(layer.parameters(), lr=0.0) for lname, layer in layers.items()}
    times: dict[str, list[float]] = {key: [] for key in VARIANTS}
    opt_times: dict[str, list[float]] = {key: [] for key in VARIANTS}
    keys = list(VARIANTS)
    rate_before = matmul_rate(dims)
    gc.collect()
    busy0, own0, wall0 = _machine_busy_s(), _own_cpu_s(), time.perf_counter()
    sys0, faults0 = os.times().system, resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for r in range(args.warmup + args.repeats):
            order = keys[r % len(keys) :] + keys[: r % len(keys)]
            for key in order:
                t0 = time.perf_counter()
                steps[key]()
                t1 = time.perf_counter()
                optims[VARIANTS[key][1]].step()
                t2 = time.perf_counter()
                if r >= args.warmup:
                    times[key].append(t1 - t0)
                    opt_times[key].append(t2 - t1)
    finally:
        if gc_was_enabled:
            gc.enable()
    busy1, own1, wall1 = _machine_busy_s(), _own_cpu_s(), time.perf_counter()
    sys1, faults1 = os.times().system, resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    n_steps = (args.warmup + args.repeats) * len(keys)
    kernel = dict(share=(sys1 - sys0) / max(own1 - own0, 1e-9), faults_per_step=(faults1 - faults0) / n_steps)
    # Share of the machine's CPU time (all cores) that other processes took while we timed.
    others = None
    if busy0 is not None and busy1 is not None:
        capacity = (wall1 - wall0) * (os.cpu_count() or 1)
        others = max(0.0, (busy1 - busy0) - (own1 - own0)) / capacity
    for layer in layers.values():
        layer.zero_grad(set_to_none=True)
    med = {key: statistics.median(v) for key, v in times.items()}
    opt_med = {key: statistics.median(v) for key, v in opt_times.items()}
    macs = {key: step_macs(key, dims) for key in VARIANTS}

    result = dict(
        args=vars(args),
        dims=dims,
        median_s=med,
        adam_median_s=opt_med,
        times=times,
        macs=macs,
        agreement=agreement,
        matmul_gflops=(rate_before, matmul_rate(dims)),
        others_cpu=others,
        kernel=kernel,
        ratios={
            "MxD sparse / MxD dense ref": med["mxd_sparse"] / med["mxd_dense"],
            "MxD sparse / Transcoder sparse": med["mxd_sparse"] / med["tc_sparse"],
            "Transcoder sparse / Transcoder dense ref": med["tc_sparse"] / med["tc_dense"],
        },
        flop_ratios={
            "MxD sparse / MxD dense ref": macs["mxd_sparse"] / macs["mxd_dense"],
            "MxD sparse / Transcoder sparse": macs["mxd_sparse"] / macs["tc_sparse"],
            "Transcoder sparse / Transcoder dense ref": macs["tc_sparse"] / macs["tc_dense"],
        },
    )
    print_report(result)
    if args.profile:
        result["profile"] = profile(steps)
    if args.child:
        print(json.dumps({"median_s": med, "faults_per_step": kernel["faults_per_step"]}))
    return result


def mallopt_comparison(argv: Sequence[str]) -> dict:
    """The benchmark in a child process with the default allocator, then in one after
    keep_freed_memory(): {setting: {"median_s": {variant: s}, "faults_per_step": n}}."""
    results = {}
    for setting in ("plain", "mallopt"):
        run = subprocess.run(
            [sys.executable, __file__, *argv, "--child", setting], capture_output=True, text=True, check=True
        )
        results[setting] = json.loads(run.stdout.strip().splitlines()[-1])
    plain, kept = results["plain"], results["mallopt"]
    print(
        "Two child processes: the default glibc allocator, then keep_freed_memory() (mxd_lens/allocator.py)"
    )
    print()
    print("| variant | default s/step | keep_freed_memory() s/step | default / kept |")
    print("|---|---:|---:|---:|")
    for key, (label, _, _) in VARIANTS.items():
        a, b = plain["median_s"][key], kept["median_s"][key]
        print(f"| {label} | {a:.4f} | {b:.4f} | {a / b:.2f} |")
    print(
        f"\nminor page faults per step (all variants, Adam steps included): default "
        f"{plain['faults_per_step']:,.0f}, kept {kept['faults_per_step']:,.0f}"
    )
    sys.stdout.flush()
    return results


def print_report(res: dict) -> None:
    d: Dims = res["dims"]
    args = res["args"]
    print(
        f"torch {torch.__version__}, torch.get_num_threads() = {torch.get_num_threads()}, "
        f"python {platform.python_version()}, {platform.machine()}, fp32 on CPU"
    )
    print(
        f"dims: T = {d.tokens} tokens, I = O = {d.d_in}, H* = {d.d_hidden}, m = {args['m']} -> transcoder "
        f"H = {d.width}, MxD N = {d.n_experts} experts (match_experts), K = {d.k}; parameters: "
        f"MxD {d.params_mxd:,}, transcoder {d.params_tc:,}"
    )
    malloc_env = [
        f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("MALLOC_") or k == "LD_PRELOAD"
    ]
    print(f"allocator: {', '.join(malloc_env) if malloc_env else 'default (no MALLOC_* / LD_PRELOAD set)'}")
    before, after = res["matmul_gflops"]
    print(
        f"timing: median of {args['repeats']} round-robin rounds after {args['warmup']} warm-up round(s); "
        f"plain [T,I]@[I,H] matmul here: {before:.0f} GFLOP/s before, {after:.0f} after"
    )
    if res["others_cpu"] is not None:
        flag = (
            "  <-- WARNING: the machine was shared, timings are inflated/noisy"
            if res["others_cpu"] > 0.05
            else ""
        )
        print(
            f"other processes used {100 * res['others_cpu']:.0f}% of the machine's CPU time during timing{flag}"
        )
    print(
        f"our process spent {100 * res['kernel']['share']:.0f}% of its CPU time in the kernel during timing "
        f"({res['kernel']['faults_per_step']:,.0f} minor page faults per step, optimizer steps included)"
    )
    print("check: " + ", ".join(f"{k} = {v:.2g}" for k, v in res["agreement"].items()))
    print()
    print(
        "| variant | median s/step | min s/step | tokens/s | step GFLOP | achieved GFLOP/s | Adam step s (not in step) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for key, (label, _, _) in VARIANTS.items():
        s = res["median_s"][key]
        gflop = 2 * res["macs"][key] / 1e9
        print(
            f"| {label} | {s:.4f} | {min(res['times'][key]):.4f} | {d.tokens / s:,.0f} | {gflop:.3g} | {gflop / s:.0f} | {res['adam_median_s'][key]:.4f} |"
        )
    print()
    print("| ratio | measured (time) | FLOP model |")
    print("|---|---:|---:|")
    for name, value in res["ratios"].items():
        print(f"| {name} | {value:.3f} | {res['flop_ratios'][name]:.3f} |")
    sys.stdout.flush()


# Profile groups. Each op's self time goes to the group of the outermost op, among itself and its
# ancestors, that names a group: so the scatter_add_ inside index_add_ counts as "index_add", the
# bias copy inside addmm as "matmul", the zero-fill inside embedding_bag's backward as
# "embedding_bag", and the copy AccumulateGrad makes of a gradient whose memory layout differs
# from its parameter's as "AccumulateGrad (grad copy)".
PROFILE_GROUPS = {
    "matmul": ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::dot", "aten::einsum"),
    "topk": ("aten::topk",),
    "index_add": ("aten::index_add_", "aten::index_add"),
    "embedding_bag": (
        "aten::embedding_bag",
        "aten::_embedding_bag",
        "aten::_embedding_bag_forward_only",
        "aten::_embedding_bag_backward",
        "aten::_embedding_bag_dense_backward",
        "aten::_embedding_bag_per_sample_weights_backward",
    ),
    "zero-fill": ("aten::zeros", "aten::zeros_like", "aten::zero_", "aten::fill_"),
    "scatter/gather": ("aten::scatter", "aten::scatter_", "aten::gather", "aten::index", "aten::scatter_add_"),
    "AccumulateGrad (grad copy)": ("torch::autograd::AccumulateGrad",),
    "elementwise": (
        "aten::mul", "aten::add", "aten::sub", "aten::div", "aten::pow", "aten::tanh", "aten::where",
        "aten::clamp_min", "aten::relu", "aten::threshold_backward", "aten::sum", "aten::mean", "aten::add_",
        "aten::mul_", "aten::tanh_backward", "aten::gt", "aten::neg", "aten::rsub",
    ),
    "copy (other)": ("aten::copy_", "aten::clone", "aten::contiguous"),
}  # fmt: skip


def _group_of(event) -> str:
    found, node = None, event
    while node is not None:
        for group, names in PROFILE_GROUPS.items():
            if node.name in names:
                found = group
        node = node.cpu_parent
    return found or "other (autograd, Python, views)"


def profile(steps: dict[str, Callable[[], None]]) -> dict[str, dict[str, float]]:
    """Self CPU time of one step per variant (after one untimed step), grouped as above."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    breakdown = {}
    for key, step in steps.items():
        step()
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
        by_group: dict[str, float] = {}
        for event in prof.events():
            group = _group_of(event)
            by_group[group] = by_group.get(group, 0.0) + event.self_cpu_time_total / 1e6
        total = sum(by_group.values())
        breakdown[key] = by_group
        print(f"\n### profile: {VARIANTS[key][0]}: one step, {total:.3f} s of self CPU time")
        for group, t in sorted(by_group.items(), key=lambda kv: -kv[1]):
            print(f"    {group:32s} {t:7.3f} s  {100 * t / total:4.0f}%")
        print(
            prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10, max_name_column_width=50)
        )
    sys.stdout.flush()
    return breakdown


def main(argv: Sequence[str] | None = None) -> int:
    run(argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
