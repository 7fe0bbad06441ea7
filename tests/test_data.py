"""Text sources, the train/eval split and row packing, checked against references built by hand."""

from __future__ import annotations

import gzip
import hashlib
import json
import lzma
import os
import random
import re
import sys
import time

import pytest
import torch
from conftest import make_tokenizer
from transformer_lens import HookedTransformer, HookedTransformerConfig

from mxd_lens.data import TokenRows, check_context_size, iter_texts, source_digests, split_texts

DOCS = [
    "The quick brown fox.\nIt jumps over the lazy dog.",
    "Ünïcödé wörds: café, naïve, 東京, emoji 🙂 too",
    "one",
    "A document\n  with an indented line\nand a third.",
]
BOS, EOS = 0, 1


def write_txt(path, docs, opener=open):
    # Messy but legal separators: several blank lines, whitespace-only lines, blank lines at both ends.
    with opener(path, "wt", encoding="utf-8") as f:
        f.write("\n  \n")
        f.write("\n\n \t\n\n".join(docs))
        f.write("\n\n\n")


def write_jsonl(path, docs, opener=open, field="text"):
    with opener(path, "wt", encoding="utf-8") as f:
        for i, doc in enumerate(docs):
            f.write(json.dumps({field: doc, "id": i}, ensure_ascii=i % 2 == 0) + "\n")


WRITERS = {
    ".txt": (write_txt, open),
    ".jsonl": (write_jsonl, open),
    ".txt.xz": (write_txt, lzma.open),
    ".jsonl.xz": (write_jsonl, lzma.open),
    ".txt.gz": (write_txt, gzip.open),
    ".jsonl.gz": (write_jsonl, gzip.open),
}


# --- sources -------------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", list(WRITERS))
def test_file_sources_yield_the_documents_written(tmp_path, suffix):
    write, opener = WRITERS[suffix]
    path = tmp_path / f"docs{suffix}"
    write(path, DOCS, opener)
    assert list(iter_texts(path)) == DOCS
    assert list(iter_texts(str(path))) == DOCS


def test_compressed_files_are_really_compressed(tmp_path):
    # Guards against the test writing plain text under a .xz / .gz name and the reader not noticing.
    write_txt(tmp_path / "a.txt.xz", DOCS, lzma.open)
    write_txt(tmp_path / "a.txt.gz", DOCS, gzip.open)
    assert (tmp_path / "a.txt.xz").read_bytes()[:6] == b"\xfd7zXZ\x00"
    assert (tmp_path / "a.txt.gz").read_bytes()[:2] == b"\x1f\x8b"


def test_jsonl_skips_empty_and_missing_fields_and_blank_lines(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(
        '{"text": "first"}\n\n{"other": "no text here"}\n{"text": ""}\n{"text": null}\n'
        '{"body": "x", "text": "sécond"}\n   \n',
        encoding="utf-8",
    )
    assert list(iter_texts(path)) == ["first", "sécond"]


def test_jsonl_custom_text_field(tmp_path):
    path = tmp_path / "d.jsonl"
    write_jsonl(path, DOCS, field="content")
    assert list(iter_texts(path, text_field="content")) == DOCS
    with pytest.raises(ValueError, match=r"'text'.*keys \['content', 'id'\].*text_field="):
        list(iter_texts(path))


def test_folder_is_read_recursively_in_relative_path_order(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z").mkdir()
    write_jsonl(tmp_path / "b" / "c.jsonl.gz", ["in b/c"], gzip.open)
    write_txt(tmp_path / "b.txt", ["in b.txt", "second of b.txt"])  # "b.txt" < "b/..." ('.' < '/')
    write_txt(tmp_path / "a.txt.xz", ["in a"], lzma.open)
    write_txt(tmp_path / "b" / "z" / "d.txt", ["in b/z/d"])
    (tmp_path / "README.md").write_text("not a source\n\nignored", encoding="utf-8")
    (tmp_path / "b" / "notes.csv").write_text("x,y", encoding="utf-8")
    expected = ["in a", "in b.txt", "second of b.txt", "in b/c", "in b/z/d"]
    assert list(iter_texts(tmp_path)) == expected


def test_empty_folder_and_unsupported_suffix(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"no file ending in one of .*\.jsonl\.xz"):
        iter_texts(tmp_path / "empty")
    (tmp_path / "data.csv").write_text("a,b\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"data\.csv: unsupported file type.*\.txt, \.jsonl"):
        iter_texts(tmp_path / "data.csv")  # fails at the call, before any next()


def test_bad_json_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n\n{"text": "broken"\n{"text": "never reached"}\n', encoding="utf-8")
    texts = iter_texts(path)
    assert next(texts) == "ok"
    with pytest.raises(ValueError, match=r"bad\.jsonl, line 3: not valid JSON"):
        next(texts)


def test_jsonl_non_object_or_non_string_text(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('["a", "list"]\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"line 1: expected a JSON object, got list"):
        list(iter_texts(path))
    path.write_text('{"text": "fine"}\n{"text": 3}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"line 2: 'text' is a int"):
        list(iter_texts(path))


def test_unknown_source_says_what_was_tried_and_stays_offline(tmp_path, monkeypatch):
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    monkeypatch.setitem(sys.modules, "datasets", None)  # importing datasets would now raise ImportError
    start = time.perf_counter()
    with pytest.raises(
        ValueError, match=r"no such file or folder: .*missing\.txt \(a local path, so it was not"
    ):
        iter_texts(tmp_path / "missing.txt")  # a path: never tried as a dataset name
    with pytest.raises(ValueError, match=r"no such file or folder: \./corpus \(a local path"):
        iter_texts("./corpus")
    with pytest.raises(
        ValueError,
        match=r"no such file or folder: no-such-user/no-such-dataset; as a Hugging Face dataset: not tried, "
        r"the hub is offline \(HF_HUB_OFFLINE is set\)",
    ):
        iter_texts("no-such-user/no-such-dataset")
    assert time.perf_counter() - start < 2


@pytest.fixture
def online(monkeypatch):
    """The hub counts as online (no request is made: the tests replace datasets.load_dataset)."""
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


def test_an_unloadable_dataset_says_what_was_tried(online, monkeypatch):
    import datasets

    def fake_load(name, config, split, streaming):
        raise FileNotFoundError(f"Dataset '{name}' doesn't exist on the Hub")

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    with pytest.raises(
        ValueError,
        match=r"no such file or folder: someone/nothing; as a Hugging Face dataset: FileNotFoundError: "
        r"Dataset 'someone/nothing' doesn't exist",
    ):
        iter_texts("someone/nothing")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # datasets' own switch counts too
    with pytest.raises(ValueError, match=r"not tried, the hub is offline \(HF_DATASETS_OFFLINE is set\)"):
        iter_texts("someone/nothing")


def test_hugging_face_rows_and_missing_column(online, monkeypatch):
    import datasets

    rows = {"text": ["alpha", "", "beta"], "meta": [1, 2, 3]}
    calls = []

    def fake_load(name, config, split, streaming):
        calls.append((name, config, split, streaming))
        return datasets.Dataset.from_dict(rows).to_iterable_dataset()

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    assert list(iter_texts("someone/corpus", hf_config="en", hf_split="validation")) == ["alpha", "beta"]
    assert calls == [("someone/corpus", "en", "validation", True)]
    with pytest.raises(ValueError, match=r"no column 'content'; its columns are \['text', 'meta'\]"):
        iter_texts("someone/corpus", text_field="content")


BAD_UTF8 = "caf\u00e9 ok\n\n".encode() + b"caf\xe9 latin-1\n"  # the bad byte is at offset 13


@pytest.mark.parametrize(
    "name, data",
    [
        ("latin1.txt", BAD_UTF8),
        ("latin1.txt.gz", gzip.compress(BAD_UTF8)),
        ("latin1.jsonl.xz", lzma.compress(b'{"text": "caf\xe9"}\n')),  # the bad byte is at offset 13
        (
            "random.txt",
            b"\n" * 13 + bytes([0x80]) + bytes(random.Random(0).randrange(256) for _ in range(500)),
        ),
    ],
    ids=["txt", "txt.gz", "jsonl.xz", "random-bytes"],
)
def test_text_that_is_not_utf8_names_the_file_and_the_byte(tmp_path, name, data):
    (tmp_path / name).write_bytes(data)
    with pytest.raises(
        ValueError, match=rf"{re.escape(name)}: not UTF-8 text \(invalid byte .* at byte 13\b"
    ):
        list(iter_texts(tmp_path))  # in a folder too, the file is named


@pytest.mark.parametrize(
    "name, data, error",
    [
        ("plain.txt.gz", b"plain text, never compressed\n", "BadGzipFile"),
        ("cut.txt.gz", gzip.compress(b"a document\n" * 1000)[:40], "EOFError"),
        ("random.jsonl.xz", bytes(random.Random(1).randrange(256) for _ in range(300)), "LZMAError"),
        ("cut.txt.xz", lzma.compress(b"a document\n" * 1000)[:60], "EOFError"),
    ],
    ids=["plain-as-gz", "truncated-gz", "random-as-xz", "truncated-xz"],
)
def test_broken_archives_name_the_file(tmp_path, name, data, error):
    (tmp_path / name).write_bytes(data)
    suffix = name[-3:]
    with pytest.raises(ValueError, match=rf"{re.escape(name)}: not a valid \{suffix} archive \({error}"):
        list(iter_texts(tmp_path / name))


def test_source_digests_follow_the_content(tmp_path, monkeypatch):
    write_txt(tmp_path / "a.txt", DOCS)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "copy.txt").write_bytes((tmp_path / "a.txt").read_bytes())
    write_jsonl(tmp_path / "sub" / "b.jsonl.gz", ["other"], gzip.open)
    (tmp_path / "empty.txt").write_bytes(b"")  # no document: no digest (all empty files would match)
    (tmp_path / "notes.md").write_text("not read")
    digest = source_digests(tmp_path / "a.txt")
    assert list(digest) == ["a.txt"] and digest["a.txt"].startswith("sha256:")
    assert (
        digest["a.txt"].removeprefix("sha256:")
        == hashlib.sha256((tmp_path / "a.txt").read_bytes()).hexdigest()
    )
    folder = source_digests(tmp_path)
    assert sorted(folder) == ["a.txt", "sub/b.jsonl.gz", "sub/copy.txt"]
    assert folder["sub/copy.txt"] == folder["a.txt"] != folder["sub/b.jsonl.gz"]
    monkeypatch.chdir(tmp_path)
    assert source_digests("a.txt") == source_digests(tmp_path / "a.txt")
    assert source_digests("someone/corpus") == {"someone/corpus": "hf:someone/corpus"}
    with pytest.raises(ValueError, match="unsupported file type"):
        source_digests("notes.md")


# --- split ---------------------------------------------------------------------------------------

SYNTHETIC = [f"document {i}: " + " ".join(f"w{(i * 7 + j) % 50}" for j in range(i % 9)) for i in range(2000)]


def test_split_partitions_the_documents():
    train = list(split_texts(SYNTHETIC, "train", eval_fraction=0.1))
    evals = list(split_texts(SYNTHETIC, "eval", eval_fraction=0.1))
    assert set(train) | set(evals) == set(SYNTHETIC)
    assert not set(train) & set(evals)
    assert len(train) + len(evals) == len(SYNTHETIC)
    # Binomial(2000, 0.1): mean 200, sd 13.4; the bounds are ~5 sd.
    assert 133 <= len(evals) <= 267
    small = list(split_texts(SYNTHETIC, "eval"))  # default 2%: mean 40, sd 6.3
    assert 10 <= len(small) <= 72
    assert set(small) <= set(evals)  # a smaller fraction keeps a subset: the cut is a threshold


def test_split_ignores_order_and_streaming():
    shuffled = SYNTHETIC[:]
    random.Random(3).shuffle(shuffled)
    evals = set(split_texts(SYNTHETIC, "eval", 0.1))
    assert set(split_texts(iter(shuffled), "eval", 0.1)) == evals
    assert set(split_texts(shuffled, "train", 0.1)) == set(SYNTHETIC) - evals
    # Order within a side is the input order.
    assert list(split_texts(shuffled, "eval", 0.1)) == [t for t in shuffled if t in evals]


def test_split_seed_changes_the_split_and_is_stable_across_processes():
    evals = set(split_texts(SYNTHETIC, "eval", 0.1, seed=0))
    assert set(split_texts(SYNTHETIC, "eval", 0.1, seed=1)) != evals
    assert set(split_texts(SYNTHETIC, "eval", 0.1, seed=0)) == evals
    # Pinned, so that a change of hash (which would silently move documents between train and eval of
    # an existing run) shows up here. Python's salted hash() would differ from process to process.
    first = [i for i, t in enumerate(SYNTHETIC[:100]) if t in evals]
    assert first == PINNED_EVAL_SEED0


PINNED_EVAL_SEED0 = [31, 32, 39, 48, 50, 55, 77, 81, 96, 97]


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1, 1.5])
def test_split_rejects_bad_fraction(fraction):
    with pytest.raises(ValueError, match=r"eval_fraction=.* strictly between 0 and 1"):
        split_texts(SYNTHETIC, "eval", fraction)


def test_split_rejects_bad_side():
    with pytest.raises(ValueError, match=r"split='test'"):
        split_texts(SYNTHETIC, "test")  # type: ignore[arg-type]


# --- packing -------------------------------------------------------------------------------------

PACK_DOCS = [
    " ".join(f"w{(i * 13 + j) % 40}" for j in range(1 + (i * 5) % 11)) + (" café 東京" if i % 4 == 0 else "")
    for i in range(30)
]


def reference_stream(tok, docs, sep=EOS):
    """Each document's ids looked up word by word (no batching, no pre-tokenizer), joined by ``sep``."""
    stream: list[int] = []
    for doc in docs:
        ids = tok.convert_tokens_to_ids(doc.split())
        if not ids:
            continue
        if stream and sep is not None:
            stream.append(sep)
        stream.extend(ids)
    return stream


@pytest.mark.parametrize("tokenize_batch", [1, 4, 64])
def test_rows_with_bos_match_the_hand_built_stream(tokenize_batch):
    tok = make_tokenizer(PACK_DOCS)
    rows = list(TokenRows(tok, context_size=7, tokenize_batch=tokenize_batch).rows(PACK_DOCS))
    stream = reference_stream(tok, PACK_DOCS)
    assert len(rows) == len(stream) // 6 > 10
    for row in rows:
        assert row.shape == (7,) and row.dtype == torch.long
        assert row[0].item() == BOS
    body = torch.cat([row[1:] for row in rows]).tolist()
    assert body == stream[: len(rows) * 6]
    assert BOS not in body  # BOS only at row starts; EOS between documents
    assert body.count(EOS) == stream[: len(rows) * 6].count(EOS) > 0


def test_rows_without_bos_and_other_separators():
    tok = make_tokenizer(PACK_DOCS)
    rows = list(TokenRows(tok, context_size=5, prepend_bos=False).rows(PACK_DOCS))
    stream = reference_stream(tok, PACK_DOCS)
    assert len(rows) == len(stream) // 5
    assert torch.stack(rows).flatten().tolist() == stream[: len(rows) * 5]

    sep = tok.convert_tokens_to_ids("w3")
    rows = list(TokenRows(tok, 6, separator_token_id=sep).rows(PACK_DOCS))
    stream = reference_stream(tok, PACK_DOCS, sep=sep)
    assert torch.cat([r[1:] for r in rows]).tolist() == stream[: len(rows) * 5]

    packer = TokenRows(tok, 6)
    packer.separator_token_id = None  # the documented way to pack without a separator
    rows = list(packer.rows(PACK_DOCS))
    stream = reference_stream(tok, PACK_DOCS, sep=None)
    assert torch.cat([r[1:] for r in rows]).tolist() == stream[: len(rows) * 5]


def test_empty_documents_add_no_separator():
    tok = make_tokenizer(["a b c d e f"])
    rows = list(TokenRows(tok, 4).rows(["a b", "", "   ", "c", "d e f"]))
    ids = tok.convert_tokens_to_ids
    assert torch.stack(rows).tolist() == [[BOS, *ids(["a", "b"]), EOS], [BOS, ids("c"), EOS, ids("d")]]


def test_rows_are_deterministic():
    tok = make_tokenizer(PACK_DOCS)
    packer = TokenRows(tok, 9)
    assert torch.equal(torch.stack(list(packer.rows(PACK_DOCS))), torch.stack(list(packer.rows(PACK_DOCS))))


def test_batches_stack_rows_and_drop_the_partial_one():
    tok = make_tokenizer(PACK_DOCS)
    packer = TokenRows(tok, 7)
    rows = torch.stack(list(packer.rows(PACK_DOCS)))
    batches = list(packer.batches(PACK_DOCS, batch_size=4))
    assert len(batches) == len(rows) // 4 and len(rows) % 4 != 0
    assert all(b.shape == (4, 7) and b.dtype == torch.long for b in batches)
    assert torch.equal(torch.cat(batches), rows[: len(batches) * 4])
    with pytest.raises(ValueError, match=rf"only {len(rows)} rows .* fewer than batch_size=1000"):
        list(packer.batches(PACK_DOCS, batch_size=1000))
    with pytest.raises(ValueError, match=r"batch_size=0"):
        list(packer.batches(PACK_DOCS, batch_size=0))


def test_no_usable_text_is_raised_lazily(tmp_path):
    tok = make_tokenizer(["a b c"])
    packer = TokenRows(tok, 16)
    (tmp_path / "empty.txt").write_text("", encoding="utf-8")
    (tmp_path / "blank.txt").write_text("\n \n\t\n\n", encoding="utf-8")
    for name in ("empty.txt", "blank.txt"):
        rows = packer.rows(iter_texts(tmp_path / name))  # nothing happens yet
        with pytest.raises(ValueError, match=r"no usable text: 0 documents gave 0 tokens"):
            next(rows)
    with pytest.raises(
        ValueError, match=r"no usable text: 2 documents gave 3 tokens.*15 needed.*context_size=16"
    ):
        list(packer.rows(["a b", "c"]))


def test_bos_defaults_and_errors():
    tok = make_tokenizer(["a b"])
    assert TokenRows(tok, 4).bos_token_id == BOS
    assert TokenRows(tok, 4, bos_token_id=5).bos_token_id == 5
    tok.bos_token = None  # GPT-2 style: EOS doubles as BOS
    assert tok.bos_token_id is None
    packer = TokenRows(tok, 4)
    assert packer.bos_token_id == EOS and packer.separator_token_id == EOS
    tok.eos_token = None
    with pytest.raises(ValueError, match=r"neither a BOS nor an EOS token: pass bos_token_id="):
        TokenRows(tok, 4)
    packer = TokenRows(tok, 2, prepend_bos=False)
    assert packer.separator_token_id is None
    assert torch.stack(list(packer.rows(["a b", "b a"]))).tolist() == [[3, 4], [4, 3]]
    for bad in (1, 0, True, 2.5):
        with pytest.raises(ValueError, match=r"context_size=.* must be an int >= 2"):
            TokenRows(tok, bad, prepend_bos=False)


# --- models --------------------------------------------------------------------------------------


def tiny_model(tok=None, n_ctx=16):
    cfg = HookedTransformerConfig(
        n_layers=1, d_model=8, n_ctx=n_ctx, d_head=4, n_heads=2, d_mlp=16, d_vocab=64, act_fn="relu"
    )
    return HookedTransformer(cfg, tokenizer=tok)


def test_check_context_size():
    model = tiny_model()
    check_context_size(model, 16)
    check_context_size(model, 2)
    with pytest.raises(ValueError, match=r"context_size=17 .* 2\.\.16 .*n_ctx=16"):
        check_context_size(model, 17)
    for bad in (1, 0, True, 8.0):
        with pytest.raises(ValueError, match=r"context_size="):
            check_context_size(model, bad)


def test_for_model_with_a_tokenizer_attached(tmp_path):
    tok = make_tokenizer(PACK_DOCS)
    # TransformerLens reloads the tokenizer from tok.name_or_path (to set add_bos_token=True); one
    # built from a tokenizers object has none, so go through a saved folder as a real one would.
    tok.save_pretrained(tmp_path)
    from transformers import AutoTokenizer

    model = tiny_model(AutoTokenizer.from_pretrained(tmp_path))
    packer = TokenRows.for_model(model, 8)
    assert packer.tokenizer is model.tokenizer
    assert packer.prepend_bos is model.cfg.default_prepend_bos is True
    assert (packer.bos_token_id, packer.separator_token_id) == (BOS, EOS)
    rows = torch.stack(list(packer.rows(PACK_DOCS)))
    stream = reference_stream(tok, PACK_DOCS)
    assert rows[:, 0].eq(BOS).all()
    assert rows[:, 1:].flatten().tolist() == stream[: rows.shape[0] * 7]
    assert model(rows[:3]).shape == (3, 8, 64)  # the rows fit the model

    assert TokenRows.for_model(model, 8, prepend_bos=False).prepend_bos is False
    with pytest.raises(ValueError, match=r"context_size=17"):
        TokenRows.for_model(model, 17)


def test_for_model_without_tokenizer():
    with pytest.raises(ValueError, match=r"has no tokenizer: call model\.set_tokenizer"):
        TokenRows.for_model(tiny_model(), 8)


def test_mix_texts_takes_the_source_with_fewest_characters_next(tmp_path):
    from mxd_lens.data import iter_texts, mix_texts

    (tmp_path / "a.txt").write_text("a a\n\nb\n\nc")
    (tmp_path / "b.txt").write_text("XXXXXXXXXX\n\nY")
    n, given = mix_texts([tmp_path / "a.txt", tmp_path / "b.txt"], tmp_path / "mixed.txt.xz")
    # by hand: a(0,0)->"a a"; b(3,0)->"XXXXXXXXXX"; a(3,10)->"b"; a(4,10)->"c"; a exhausted -> "Y"
    assert list(iter_texts(tmp_path / "mixed.txt.xz")) == ["a a", "XXXXXXXXXX", "b", "c", "Y"]
    assert (n, given) == (5, [5, 11])


def test_mix_refuses_an_out_that_is_a_source_before_writing_anything(tmp_path, monkeypatch, capsys):
    """`mxd-lens mix a.txt.xz b.txt --out a.txt.xz` returned 0 and replaced a source with the mix."""
    import lzma

    from mxd_lens.cli import main
    from mxd_lens.data import mix_texts

    with lzma.open(tmp_path / "a.txt.xz", "wt") as f:
        f.write("a1\n\na2")
    (tmp_path / "b.txt").write_text("b1")
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "c.txt").write_text("c1")
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        SystemExit, match=r"mxd-lens mix: out a.txt.xz is source a.txt.xz: .*nothing was written"
    ):
        main(["mix", "a.txt.xz", "b.txt", "--out", "a.txt.xz"])
    for out in ("./b.txt", str(tmp_path / "sub" / ".." / "b.txt")):
        (tmp_path / "sub").mkdir(exist_ok=True)
        with pytest.raises(ValueError, match="is source b.txt"):
            mix_texts(["a.txt.xz", "b.txt"], out)
    with pytest.raises(ValueError, match=r"out folder/m.txt.xz lies inside source folder"):
        mix_texts(["folder", "b.txt"], "folder/m.txt.xz")
    (tmp_path / "link.txt").symlink_to(tmp_path / "b.txt")
    with pytest.raises(ValueError, match="out link.txt is source b.txt"):
        mix_texts(["a.txt.xz", "b.txt"], "link.txt")
    after = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and p.name != "link.txt"}
    assert after == before and not list(tmp_path.glob(".*.tmp"))


def test_mix_refuses_a_source_given_twice_under_two_spellings(tmp_path, monkeypatch):
    from mxd_lens.data import mix_texts

    (tmp_path / "a.txt").write_text("a1")
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "c.txt").write_text("c1")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"sources a.txt and ./a.txt are the same .*give each source once"):
        mix_texts(["a.txt", "./a.txt"], "m.txt.xz")
    with pytest.raises(ValueError, match="source folder/c.txt lies inside source folder folder"):
        mix_texts(["folder", "folder/c.txt"], "m.txt.xz")
    assert not (tmp_path / "m.txt.xz").exists()


def test_mix_writes_as_the_out_suffix_says_and_refuses_another(tmp_path):
    """`mix --out m.txt` wrote xz bytes under a .txt name."""
    import gzip

    from mxd_lens.data import iter_texts, mix_texts

    (tmp_path / "a.txt").write_text("a1\n\na2")
    (tmp_path / "b.txt").write_text("b1")
    sources = [tmp_path / "a.txt", tmp_path / "b.txt"]
    for name in ("m.txt", "m.txt.gz", "m.txt.xz"):
        assert mix_texts(sources, tmp_path / name) == (3, [4, 2])
        assert list(iter_texts(tmp_path / name)) == ["a1", "b1", "a2"]
    assert (tmp_path / "m.txt").read_text() == "a1\n\nb1\n\na2"  # plain text
    assert gzip.decompress((tmp_path / "m.txt.gz").read_bytes()) == b"a1\n\nb1\n\na2"
    first = (tmp_path / "m.txt.gz").read_bytes()
    mix_texts(sources, tmp_path / "m.txt.gz")
    assert (tmp_path / "m.txt.gz").read_bytes() == first  # no name or time in the gzip header
    for name in ("m.json", "m.xz", "m.jsonl.xz"):
        with pytest.raises(
            ValueError, match=r"end it in .txt.xz \(xz\), .txt.gz \(gzip\) or .txt \(plain text\)"
        ):
            mix_texts(sources, tmp_path / name)
        assert not (tmp_path / name).exists()


def test_mix_removes_the_temporary_a_killed_mix_left_and_keeps_a_live_ones(tmp_path):
    """kill -9 of `mix` left its .tmp behind for good; SIGINT (KeyboardInterrupt) leaves none."""
    import fcntl
    import os
    import signal
    import subprocess
    import sys

    from mxd_lens.data import mix_texts

    (tmp_path / "a.txt").write_text("\n\n".join(f"doc {i}" for i in range(200)))
    out = tmp_path / "m.txt.xz"
    code = (
        "import os, signal, sys\n"
        "from mxd_lens.data import mix_texts\n"
        "def measure(doc):\n"
        "    if doc == 'doc 100':\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "    return len(doc)\n"
        f"mix_texts([{str(tmp_path / 'a.txt')!r}], {str(out)!r}, measure=measure)\n"
    )
    killed = subprocess.run([sys.executable, "-c", code], capture_output=True)
    assert killed.returncode == -signal.SIGKILL
    (left,) = tmp_path.glob(".m.txt.xz.*.tmp")  # what the killed mix left
    live = tmp_path / ".m.txt.xz.live.tmp"  # a concurrent writer's, locked as atomic_write locks it
    live.write_text("")
    fd = os.open(live, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        assert mix_texts([tmp_path / "a.txt"], out)[0] == 200
    finally:
        os.close(fd)
    assert not left.exists() and live.exists()
    live.unlink()

    def interrupt(doc: str) -> int:
        if doc == "doc 50":
            raise KeyboardInterrupt
        return len(doc)

    with pytest.raises(KeyboardInterrupt):
        mix_texts([tmp_path / "a.txt"], out, measure=interrupt)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "m.txt.xz"]
