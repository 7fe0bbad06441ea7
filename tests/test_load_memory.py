"""Memory that follows --dtype (issue 57): a model loaded in bfloat16 is read into bfloat16 tensor by tensor,
with no float32 copy of its weights and no weight file memory-mapped, and a GGUF is converted one tensor at
a time; the models still compute what transformers' own do. benchmarks/load_memory.py measures the peaks
on a 1B model; these tests guard the mechanism on tiny ones."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import make_hf_folder
from test_models import write_tiny_gguf
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from mxd_lens import models

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MXD_LENS_CACHE", str(tmp_path / "cache"))


class CopySpy(TorchDispatchMode):
    """Counts the bytes of every new ``dtype`` CPU storage an operation returns with as many elements as
    one of the weight matrices (``sizes``): copies of weights, not the activations of a forward (views and
    in-place results, which share an input's storage, are not new); and notes any weight file of
    ``folder`` memory-mapped in this process at any operation."""

    def __init__(self, folder: Path, sizes: set[int], dtype: torch.dtype = torch.float32):
        super().__init__()
        self.folder, self.sizes, self.dtype = str(folder.resolve()), sizes, dtype
        self.copied_bytes = 0
        self.mapped: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_leaves((args, kwargs or {}))
            if isinstance(t, torch.Tensor) and t.device.type == "cpu"
        }
        for t in tree_leaves(out):
            if (
                isinstance(t, torch.Tensor)
                and t.device.type == "cpu"
                and t.dtype == self.dtype
                and t.numel() in self.sizes
                and t.untyped_storage().data_ptr() not in inputs
            ):
                self.copied_bytes += t.numel() * t.element_size()
        with open("/proc/self/maps") as f:
            self.mapped |= {line.split()[-1] for line in f if self.folder in line and ".safetensors" in line}
        return out


def _bf16_tolerance(logits: torch.Tensor) -> float:
    """Two bfloat16 implementations round apart: 8 bfloat16 epsilons of the largest logit."""
    return 8 * torch.finfo(torch.bfloat16).eps * max(1.0, float(logits.abs().max()))


def _tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(1))


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps (Linux)")
def test_a_bfloat16_load_makes_no_float32_copy_and_maps_no_weight_file(tmp_path):
    from transformers import AutoModelForCausalLM

    folder, hf32, vocab = make_hf_folder(tmp_path, "llama")  # saved in float32
    matrices = [p for p in hf32.parameters() if p.dim() == 2]
    weights_fp32 = sum(p.numel() * 4 for p in matrices)
    spy = CopySpy(folder, {p.numel() for p in matrices})
    with spy:
        model = models.load_model(str(folder), dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    # Before issue 57: transformers kept the float32 files mapped while it cast them, and TL's
    # process_weights cast the whole state dict to float32 and back (copied_bytes >= the model's).
    assert spy.mapped == set()
    assert spy.copied_bytes < 0.2 * weights_fp32, (spy.copied_bytes, weights_fp32)
    # Still the model: transformers' own bfloat16 model of the folder, on the same tokens.
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    tokens = _tokens(vocab)
    # and a forward copies no weight: TL's Unembed multiplies by W_U.T.contiguous(), which copied the
    # whole unembedding (vocabulary x d_model) at every forward while W_U was stored [d_model, d_vocab]
    forward = CopySpy(folder, {model.unembed.W_U.numel()}, torch.bfloat16)
    with forward, torch.no_grad():
        model(tokens)
    assert forward.copied_bytes == 0
    with torch.no_grad():
        ours = model(tokens).float().log_softmax(-1)
        logits = reference(tokens).logits.float()
    assert (ours - logits.log_softmax(-1)).abs().max() < _bf16_tolerance(logits)


def test_a_gguf_is_converted_one_tensor_at_a_time_to_the_same_weights(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import GgufConfig

    from mxd_lens import weights

    gguf = write_tiny_gguf(tmp_path / "tiny-llama.gguf")
    original = AutoModelForCausalLM.from_pretrained
    pending: list[int] = []

    def no_whole_model(*args, **kwargs):
        assert "gguf_file" not in kwargs, "the whole GGUF model was built at once"
        return original(*args, **kwargs)

    add = weights._ShardWriter.add

    def watched(self, name, tensor):
        add(self, name, tensor)
        pending.append(self._pending_bytes())

    with monkeypatch.context() as patch:
        patch.setattr(AutoModelForCausalLM, "from_pretrained", no_whole_model)
        patch.setattr(weights._ShardWriter, "add", watched)
        patch.setattr(weights, "SHARD_BYTES", 20_000)  # several shards, as a large model gets
        model = models.load_model(str(gguf), dtype="bfloat16")

    folder = models.hf_folder(str(gguf))
    assert len(list(folder.glob("model-*-of-*.safetensors"))) > 1
    assert (folder / "model.safetensors.index.json").is_file()
    # the converted folder holds exactly what transformers dequantises from the GGUF itself
    reference = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent),
        gguf_file=gguf.name,
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
    ).eval()
    largest = max(t.nbytes for t in reference.state_dict().values())
    assert pending and max(pending) <= 20_000 + largest  # at most a shard in memory, never the model
    converted = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    expected = reference.state_dict()
    assert converted.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(converted[key], value), key
    # and the bfloat16 model computes what transformers' bfloat16 model of the GGUF does
    reference_bf16 = reference.to(torch.bfloat16)
    tokens = _tokens(model.cfg.d_vocab)
    with torch.no_grad():
        ours = model(tokens).float().log_softmax(-1)
        logits = reference_bf16(tokens).logits.float()
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert (ours - logits.log_softmax(-1)).abs().max() < _bf16_tolerance(logits)


def test_the_benchmarks_gguf_is_its_folders_model(tmp_path):
    """benchmarks/load_memory.py's GGUF (written with GGUFWriter, Q/K in llama.cpp's layout, F16) loads as
    the same model as its folder."""
    import load_memory

    folder, gguf = load_memory.build(tmp_path, "tiny")
    a, b = models.load_model(str(folder)), models.load_model(str(gguf))
    tokens = _tokens(a.cfg.d_vocab)
    with torch.no_grad():
        diff = (a(tokens).log_softmax(-1) - b(tokens).log_softmax(-1)).abs().max()
    assert diff < 1e-2  # F16 rounding of the GGUF's weights
