"""Memory of loading a host model in each dtype (issue 57): peak RSS of ``load_model(path, dtype=...)``
and of loading plus one forward pass, for a random-weight Llama of about 1B parameters, as a Hugging
Face folder and as a GGUF, in bfloat16 and float32; and the forward's speed in bfloat16 against float32.

    python benchmarks/load_memory.py DIR                        # build the models into DIR once, measure
    python benchmarks/load_memory.py DIR --before 2879497       # also load_model as of that commit
    python benchmarks/load_memory.py DIR --only folder --dtypes bfloat16
    python benchmarks/load_memory.py DIR --shape tiny           # seconds: a tiny model, the same steps

DIR (outside the repository) receives ``folder/`` (config.json, tokenizer, float32 safetensors shards and
their index, as ``save_pretrained`` writes them) and ``model.gguf`` (the same weights in F16, norms in F32,
written with gguf's ``GGUFWriter``, Q and K rows in llama.cpp's rotary order), and private
``MXD_LENS_CACHE`` folders (``cache/``, ``cache-COMMIT/``) for the GGUF's converted folder. The default
shape, ``1b``: d_model 2048, 20 layers, 32 heads / 4 KV heads, gated SiLU MLP of width 5632, vocabulary
32,000, untied unembedding: 1,011,959,808 parameters.

Every measurement runs in a fresh subprocess (``--child``), one at a time, and reads its own peak resident
set, ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` (resident pages of files it maps count too), after (a)
``load_model(path, dtype=...)``, then (b) one forward pass of 128 tokens. The GGUF's first load converts
it (to a float32 folder in the cache, once): its own row, before the loads that read the converted folder.
The table gives the weights' bytes in that dtype (W) and peak / (2 W + 1 GiB): the target is at most 1.
``--before COMMIT`` runs the same rows first with ``mxd_lens/models.py`` as of COMMIT (``git show``;
the rest of mxd_lens as checked out).

Speed: each forward child then times ``--repeats`` more forwards of the same 128 tokens (batch 1) in wall
and CPU time (``time.process_time``: less sensitive to other jobs); the last table puts bfloat16's median
beside float32's, over every forward row of this checkout in the run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

SHAPES = {
    "1b": dict(d_model=2048, n_layers=20, n_heads=32, n_kv_heads=4, d_mlp=5632, vocab=32000),
    "tiny": dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_mlp=160, vocab=512),
}
GIB = 1 << 30
SHARD_BYTES = 1 << 30  # per safetensors shard, as save_pretrained shards


# ---------------------------------------------------------------------------------------------- build


def _tokens(vocab: int) -> tuple[list[str], list[int], list[str]]:
    """A byte-level BPE vocabulary of ``vocab`` entries (GGUF's "gpt2" tokenizer model): 3 special tokens,
    GPT-2's 256 byte symbols, then filler words (never produced by the merges, there to fill the rows)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    merges = ["Ġ t", "h e", "Ġt he", "Ġ a", "a n", "i n", "e r"]
    tokens = special + list(bytes_to_unicode().values()) + ["".join(m.split(" ")) for m in merges]
    tokens += [f"Ġw{i}" for i in range(vocab - len(tokens))]
    types = [3] * len(special) + [1] * (len(tokens) - len(special))  # 3 = CONTROL, 1 = NORMAL
    return tokens, types, merges


def _hf_tensors(s: dict[str, int]) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor of a LlamaForCausalLM of shape ``s``, as save_pretrained names them."""
    d, head = s["d_model"], s["d_model"] // s["n_heads"]
    names = [("model.embed_tokens.weight", (s["vocab"], d))]
    for layer in range(s["n_layers"]):
        p = f"model.layers.{layer}."
        names += [
            (p + "input_layernorm.weight", (d,)),
            (p + "self_attn.q_proj.weight", (s["n_heads"] * head, d)),
            (p + "self_attn.k_proj.weight", (s["n_kv_heads"] * head, d)),
            (p + "self_attn.v_proj.weight", (s["n_kv_heads"] * head, d)),
            (p + "self_attn.o_proj.weight", (d, s["n_heads"] * head)),
            (p + "post_attention_layernorm.weight", (d,)),
            (p + "mlp.gate_proj.weight", (s["d_mlp"], d)),
            (p + "mlp.up_proj.weight", (s["d_mlp"], d)),
            (p + "mlp.down_proj.weight", (d, s["d_mlp"])),
        ]
    return names + [("model.norm.weight", (d,)), ("lm_head.weight", (s["vocab"], d))]


_GGUF_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}  # fmt: skip


def _gguf_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    layer, rest = hf_name.removeprefix("model.layers.").split(".", 1)
    return f"blk.{layer}.{_GGUF_NAMES[rest.removesuffix('.weight')]}.weight"


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Q/K rows in llama.cpp's rotary layout (its convert_hf_to_gguf's ``permute``), which transformers
    undoes when it reads a llama GGUF."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def build(out: Path, shape: str = "1b", seed: int = 0) -> tuple[Path, Path]:
    """``out/folder`` (a Hugging Face Llama folder, float32 safetensors shards + index) and
    ``out/model.gguf`` (the same weights, F16), each made once; their paths."""
    import gguf
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, LlamaConfig

    s = SHAPES[shape]
    folder, gguf_path = out / "folder", out / "model.gguf"
    tokens, types, merges = _tokens(s["vocab"])
    head = s["d_model"] // s["n_heads"]
    if not (folder / "config.json").is_file():
        tmp = out / "folder.partial"
        tmp.mkdir(parents=True, exist_ok=True)
        gen = torch.Generator().manual_seed(seed)
        # shards planned first, then written one by one
        groups: list[list[tuple[str, tuple[int, ...]]]] = [[]]
        for name, size in _hf_tensors(s):
            planned = sum(4 * int(np.prod(z)) for _, z in groups[-1])
            if groups[-1] and planned + 4 * int(np.prod(size)) > SHARD_BYTES:
                groups.append([])
            groups[-1].append((name, size))
        weight_map, total = {}, 0
        for i, group in enumerate(groups):
            shard = {}
            for name, size in group:
                if len(size) == 1:  # a norm's gain: near 1, not exactly
                    shard[name] = 1 + 0.1 * torch.randn(size, generator=gen)
                else:
                    shard[name] = torch.randn(size, generator=gen) * (1.0 if "embed" in name else 0.02)
            file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
            save_file(shard, str(tmp / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, file))
            total += sum(v.nbytes for v in shard.values())
            del shard
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        config = LlamaConfig(
            vocab_size=s["vocab"], hidden_size=s["d_model"], intermediate_size=s["d_mlp"],
            num_hidden_layers=s["n_layers"], num_attention_heads=s["n_heads"],
            num_key_value_heads=s["n_kv_heads"], max_position_embeddings=2048, rms_norm_eps=1e-5,
            rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
            architectures=["LlamaForCausalLM"], dtype="float32",
        )  # fmt: skip
        config.save_pretrained(tmp)
        os.replace(tmp, folder)
    if not gguf_path.is_file():
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        writer = gguf.GGUFWriter(str(gguf_path) + ".partial", "llama")
        writer.add_name("random llama for load_memory")
        writer.add_block_count(s["n_layers"])
        writer.add_context_length(2048)
        writer.add_embedding_length(s["d_model"])
        writer.add_feed_forward_length(s["d_mlp"])
        writer.add_head_count(s["n_heads"])
        writer.add_head_count_kv(s["n_kv_heads"])
        writer.add_rope_freq_base(10000.0)
        writer.add_rope_dimension_count(head)
        writer.add_layer_norm_rms_eps(1e-5)
        writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
        writer.add_vocab_size(len(tokens))
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("smollm")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
        writer.add_bos_token_id(0)
        writer.add_eos_token_id(0)
        writer.add_add_bos_token(False)
        names = _hf_tensors(s)
        for name, size in names:  # declared first, then streamed: one tensor in memory at a time
            f16 = np.dtype(np.float32 if len(size) == 1 else np.float16)  # norms stay F32, as llama.cpp
            writer.add_tensor_info(_gguf_name(name), size, f16, int(np.prod(size)) * f16.itemsize)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for name, size in names:
            with safe_open(str(folder / index["weight_map"][name]), "np") as f:
                w = f.get_tensor(name)
            if ".q_proj." in name:
                w = _llama_cpp_permute(w, s["n_heads"])
            elif ".k_proj." in name:
                w = _llama_cpp_permute(w, s["n_kv_heads"])
            writer.write_tensor_data(w.astype(np.float32 if len(size) == 1 else np.float16))
        writer.close()
        os.replace(str(gguf_path) + ".partial", gguf_path)
    if not (folder / "tokenizer.json").is_file():  # the GGUF's tokenizer, as transformers reads it
        AutoTokenizer.from_pretrained(str(out), gguf_file=gguf_path.name).save_pretrained(folder)
    return folder, gguf_path


# ---------------------------------------------------------------------------------------------- child


def _rss_kb() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


def _load_model_of(models_file: str | None):
    """``load_model`` of this checkout, or of ``models_file`` (an older ``mxd_lens/models.py``)."""
    if not models_file:
        from mxd_lens.models import load_model

        return load_model
    import importlib.util

    spec = importlib.util.spec_from_file_location("mxd_lens.models_before", models_file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.load_model


def child(path: str, dtype: str, mode: str, repeats: int, models_file: str | None = None) -> dict:
    """In this (fresh) process: load, note the peak; forward 128 tokens, note the peak; time more forwards
    (wall and this process's CPU time)."""
    load_model = _load_model_of(models_file)
    t0 = time.perf_counter()
    model = load_model(path, dtype=dtype)
    result = {"load_s": time.perf_counter() - t0, "peak_load_kb": _rss_kb()}
    result["param_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    result["n_params"] = sum(p.numel() for p in model.parameters())
    result["param_dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
    result["threads"] = torch.get_num_threads()
    if mode == "forward":
        tokens = torch.randint(0, model.cfg.d_vocab, (1, 128), generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            t0 = time.perf_counter()
            logits = model(tokens)
            result["first_forward_s"] = time.perf_counter() - t0
            result["peak_forward_kb"] = _rss_kb()
            result["finite"] = bool(torch.isfinite(logits).all())
            wall, cpu = [], []
            for _ in range(repeats):
                t0, c0 = time.perf_counter(), time.process_time()
                model(tokens)
                wall.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
        result["forward_s"], result["forward_cpu_s"] = wall, cpu
    return result


def _run_child(
    path: Path, dtype: str, mode: str, repeats: int, cache: Path, models_file: str | None = None
) -> dict:
    env = {**os.environ, "MXD_LENS_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, __file__, "--child", str(path), dtype, mode, str(repeats), models_file or ""]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _models_file_at(commit: str, out: Path) -> Path:
    """``mxd_lens/models.py`` as of ``commit`` (``git show``), saved under ``out``."""
    root = Path(__file__).resolve().parents[1]
    text = subprocess.run(
        ["git", "show", f"{commit}:mxd_lens/models.py"], cwd=root, check=True, capture_output=True, text=True
    ).stdout
    path = out / f"models_{commit}.py"
    path.write_text(text, encoding="utf-8")
    return path


# ---------------------------------------------------------------------------------------------- main


def _gib(kb_or_bytes: float, kb: bool = True) -> str:
    return f"{kb_or_bytes * (1024 if kb else 1) / GIB:.2f}"


def run(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path, help="where the models are built (once) and the cache lives")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    parser.add_argument("--only", choices=["folder", "gguf"], default=None)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=5, help="timed forwards after the measured one")
    parser.add_argument(
        "--before",
        metavar="COMMIT",
        default=None,
        help="also measure load_model as of COMMIT (its mxd_lens/models.py, with its own cache)",
    )
    args = parser.parse_args(argv)
    out = args.dir.expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    folder, gguf_path = build(out, args.shape)
    print(f"models in {out} ({time.perf_counter() - t0:.0f} s)", flush=True)
    codes = [("now", None, out / "cache")]
    if args.before:
        before = str(_models_file_at(args.before, out))
        codes.insert(0, (f"before ({args.before})", before, out / f"cache-{args.before}"))
    rows = []
    for code, models_file, cache in codes:
        for kind, path in (("folder", folder), ("gguf", gguf_path)):
            if args.only not in (None, kind):
                continue
            if kind == "gguf" and not any(cache.glob("hf/*/config.json")):
                r = _run_child(path, args.dtypes[0], "load", 0, cache, models_file)
                row = {"code": code, "source": "gguf, first load (converts)", "dtype": args.dtypes[0]}
                rows.append({**row, "mode": "load", **r})
                print(json.dumps(rows[-1]), flush=True)
            for dtype in args.dtypes:
                for mode in ("load", "forward"):
                    repeats = args.repeats if mode == "forward" else 0
                    r = _run_child(path, dtype, mode, repeats, cache, models_file)
                    rows.append({"code": code, "source": kind, "dtype": dtype, "mode": mode, **r})
                    print(json.dumps(rows[-1]), flush=True)

    print(
        "\n| code | source | dtype | measured | peak RSS (GiB) | W (GiB) | peak / (2W + 1 GiB) | wall (s) |"
    )
    print("|---|---|---|---|---:|---:|---:|---:|")
    for r in rows:
        peak = r["peak_forward_kb"] if r["mode"] == "forward" else r["peak_load_kb"]
        r["ratio"] = peak * 1024 / (2 * r["param_bytes"] + GIB)
        wall = r["load_s"] + r.get("first_forward_s", 0.0)
        what = "load + forward (128 tokens)" if r["mode"] == "forward" else "load_model"
        print(f"| {r['code']} | {r['source']} | {r['dtype']} | {what} | {_gib(peak)} "
              f"| {_gib(r['param_bytes'], kb=False)} | {r['ratio']:.2f} | {wall:.1f} |")  # fmt: skip
    speed: dict[str, dict[str, list[float]]] = {}
    for r in rows:
        if r["mode"] == "forward" and r["code"] == "now":
            by = speed.setdefault(r["dtype"], {"wall": [], "cpu": []})
            by["wall"] += r["forward_s"]
            by["cpu"] += r["forward_cpu_s"]
    if "float32" in speed and "bfloat16" in speed:
        med = {d: {k: statistics.median(v) for k, v in by.items()} for d, by in speed.items()}
        n = {d: len(by["cpu"]) for d, by in speed.items()}
        print("\n| forward of 128 tokens | float32 | bfloat16 | bfloat16 / float32 |")
        print("|---|---:|---:|---:|")
        for k, what in (("cpu", "CPU time (s, median)"), ("wall", "wall (s, median)")):
            print(f"| {what} | {med['float32'][k]:.3f} | {med['bfloat16'][k]:.3f} "
                  f"| {med['bfloat16'][k] / med['float32'][k]:.2f} |")  # fmt: skip
        print(f"({n['float32']} and {n['bfloat16']} forwards, {rows[-1]['threads']} torch thread(s))")
    print(f"\ntorch {torch.__version__}, {os.cpu_count()} CPUs")
    return {"rows": rows, "speed": speed}


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        path, dtype, mode, repeats = sys.argv[2:6]
        models_file = sys.argv[6] if len(sys.argv) > 6 else None
        print(json.dumps(child(path, dtype, mode, int(repeats), models_file or None)))
    else:
        run()
