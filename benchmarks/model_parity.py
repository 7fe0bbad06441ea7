"""Model parity (issue 4): the TransformerLens model from ``load_model`` against transformers' own
implementation of the same weights, its next-token loss on held-out English, and its speed.

    python benchmarks/model_parity.py                   # the default, SmolLM2-135M-Instruct
    python benchmarks/model_parity.py --windows 2       # quicker
    python benchmarks/model_parity.py --model path/to/model.gguf

1. Load: ``load_model(--model)``, timed (the first call fetches and converts; later calls reuse
   the converted folder under ``mxd_lens.models.cache_dir()``).
2. Reference: transformers' ``AutoModelForCausalLM`` on the same source, for a GGUF read from the
   GGUF file itself (its own dequantisation, not our converted folder), for a folder from the folder.
3. Text: rows exactly as training and evaluation build them, ``TokenRows.for_model(model, 512)``
   over the eval side of ``split_texts`` of Jane Austen's novels (documents are paragraphs; the
   model's EOS separates them; each row is the model's BOS + 511 tokens when it prepends BOS).
   ``--running-text`` joins those paragraphs with blank lines instead, as prose reads.
4. Parity: max |Δ log-prob| between TL and transformers over every vocabulary entry at every
   position of the first row, with LayerNorm (RMSNorm) unfolded and folded.
5. Loss: next-token CE in nats/token over ``--windows`` rows, for three treatments of the first
   position of the same rows: the model's BOS (as loaded), ``<|im_start|>`` (what TL would prepend
   with the Instruct tokenizer's BOS), and no BOS at all (the row's first text token starts it).
   They are compared on the same targets, text tokens 2..511 of each row; the convention's own CE
   (all 511 text tokens, the first predicted from BOS alone) is printed too, and how far the
   first position's residual stream stands out (the attention sink) with and without a BOS.
6. Speed: TL forward of ``--batch`` rows with ``stop_at_layer=16`` (blocks 0..15, as when caching
   one mid layer's activations) and a full forward; median of 3 after a warm-up.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from layer_speed import _machine_busy_s, _own_cpu_s

from mxd_lens import models
from mxd_lens.config import DEFAULT_MODEL
from mxd_lens.data import TokenRows, iter_texts, split_texts

CORPUS = Path(__file__).resolve().parents[2] / "shared" / "data" / "corpus" / "jane_austen_novels.txt.xz"


def reference_model(name_or_path: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import GgufConfig

    path = models.default_model_path() if name_or_path == DEFAULT_MODEL else Path(name_or_path)
    if path.suffix == ".gguf":
        return AutoModelForCausalLM.from_pretrained(
            str(path.parent),
            gguf_file=path.name,
            dtype=torch.float32,
            quantization_config=GgufConfig(dequantize=True),
        ).eval()
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, local_files_only=True).eval()


def token_losses(model, rows: torch.Tensor, batch: int) -> torch.Tensor:
    """Next-token CE at every position: ``[rows, pos - 1]``, entry i predicting ``rows[:, i + 1]``."""
    with torch.no_grad():
        return torch.cat(
            [model(chunk, return_type="loss", loss_per_token=True) for chunk in rows.split(batch)]
        )


def tokens_per_second(fn, n_tokens: int, repeats: int = 3) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return n_tokens / statistics.median(times)


def run(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default=DEFAULT_MODEL, help="the default, a .gguf file or a Hugging Face folder"
    )
    parser.add_argument("--corpus", default=str(CORPUS))
    parser.add_argument("--windows", type=int, default=8, help="rows of 512 tokens for the loss")
    parser.add_argument("--batch", type=int, default=4, help="rows per forward")
    parser.add_argument(
        "--running-text",
        action="store_true",
        help="join the eval paragraphs with blank lines into one text instead of separating them with EOS",
    )
    args = parser.parse_args(argv)
    results: dict[str, float] = {}

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32 on CPU")
    start = time.perf_counter()
    model = models.load_model(args.model)
    results["load_s"] = time.perf_counter() - start
    bos, eos = model.tokenizer.bos_token, model.tokenizer.eos_token
    print(
        f"load_model({args.model!r}): {results['load_s']:.1f} s -> {model.cfg.model_name}, "
        f"{model.cfg.n_layers} layers, d_model {model.cfg.d_model}, d_mlp {model.cfg.d_mlp}; "
        f"BOS {bos!r} (prepended: {model.cfg.default_prepend_bos}), EOS {eos!r}"
    )
    start = time.perf_counter()
    reference = reference_model(args.model)
    print(
        f"transformers reference ({type(reference).__name__}) loaded in {time.perf_counter() - start:.1f} s"
    )

    token_rows = TokenRows.for_model(model, 512)
    texts = split_texts(iter_texts(args.corpus), "eval")
    if args.running_text:
        texts = ["\n\n".join(texts)]
        token_rows.separator_token_id = None
    rows = torch.stack(list(itertools.islice(token_rows.rows(texts), args.windows)))
    print(
        f"text: {Path(args.corpus).name}, eval split"
        f"{' as running text' if args.running_text else ''}, {rows.shape[0]} rows x {rows.shape[1]} tokens "
        f"(first token {model.tokenizer.convert_ids_to_tokens(rows[0, 0].item())!r}); "
        f"row 0 starts {model.tokenizer.decode(rows[0, :12])!r}"
    )

    with torch.no_grad():
        ours = model(rows[:1]).log_softmax(-1)
        theirs = reference(rows[:1]).logits.log_softmax(-1)
        targets = rows[0, 1:]
        results["max_dlogprob"] = (ours - theirs).abs().max().item()
        results["max_dlogprob_targets"] = (
            (ours[0, :-1].gather(-1, targets[:, None]) - theirs[0, :-1].gather(-1, targets[:, None]))
            .abs()
            .max()
            .item()
        )
        folded = models.load_model(args.model, fold_ln=True)
        results["max_dlogprob_folded"] = (folded(rows[:1]).log_softmax(-1) - theirs).abs().max().item()
    print(
        f"parity on row 0 ({rows.shape[1]} positions x {ours.shape[-1]} vocabulary entries): "
        f"max |Δ log-prob| = {results['max_dlogprob']:.2e} (at the actual next tokens: "
        f"{results['max_dlogprob_targets']:.2e}); with fold_ln=True: {results['max_dlogprob_folded']:.2e}"
    )
    del reference, folded, ours, theirs

    n_targets = rows.shape[0] * (rows.shape[1] - 2)
    variants = {f"{bos} + 511 (as loaded)": rows}
    im_start = model.tokenizer.get_vocab().get("<|im_start|>")
    if im_start is not None:
        first = torch.full_like(rows[:, :1], im_start)
        variants["<|im_start|> + 511 (TL with the Instruct BOS)"] = torch.cat([first, rows[:, 1:]], 1)
    variants["no BOS: 511 text tokens"] = rows[:, 1:]
    print(f"next-token CE, nats/token, on the same {n_targets} targets (text tokens 2..511 of each row):")
    for name, variant in variants.items():
        losses = token_losses(model, variant, args.batch)
        shared = losses[:, 1:] if variant.shape[1] == rows.shape[1] else losses  # targets: text tokens 2..
        results[f"ce[{name}]"] = ce = shared.mean().item()
        print(f"  {name:<48} {ce:.4f}")
        if variant is rows:
            results["ce_all"] = losses.mean().item()
    print(
        f"  as loaded, over all {rows.shape[0] * (rows.shape[1] - 1)} text tokens "
        f"(the first predicted from BOS alone): {results['ce_all']:.4f}"
    )

    hook = "blocks.15.hook_resid_post"
    for name in (next(iter(variants)), "no BOS: 511 text tokens"):
        with torch.no_grad():
            _, cache = model.run_with_cache(variants[name][:1], stop_at_layer=16, names_filter=hook)
        norms = cache[hook][0].norm(dim=-1)
        results[f"sink[{name}]"] = ratio = (norms[0] / norms[1:].median()).item()
        print(f"  {hook} norm at position 0 / median of the others, {name}: {ratio:.0f}x")

    batch = rows[: args.batch]
    n_tokens = batch.numel()
    busy0, own0, wall0 = _machine_busy_s(), _own_cpu_s(), time.perf_counter()
    with torch.no_grad():
        results["tok_s_layer15"] = tokens_per_second(lambda: model(batch, stop_at_layer=16), n_tokens)
        results["tok_s_full"] = tokens_per_second(lambda: model(batch), n_tokens)
    busy1, own1, wall1 = _machine_busy_s(), _own_cpu_s(), time.perf_counter()
    print(
        f"TL forward, {batch.shape[0]} x {batch.shape[1]} tokens: {results['tok_s_layer15']:.0f} tokens/s "
        f"stopping after layer 15 (stop_at_layer=16), {results['tok_s_full']:.0f} tokens/s full"
    )
    if busy0 is not None and busy1 is not None:
        others = max(0.0, (busy1 - busy0) - (own1 - own0)) / ((wall1 - wall0) * (os.cpu_count() or 1))
        print(f"other processes used {others:.0%} of the machine's CPU time during the speed timing")
    return results


if __name__ == "__main__":
    run(sys.argv[1:])
