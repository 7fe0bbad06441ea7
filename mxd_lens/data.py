"""Text in, packed token rows out: what a trainer feeds the model to collect MLP inputs and outputs.

Three steps, each an iterator so nothing is loaded whole and a dataset can be streamed:

* ``iter_texts(source)`` yields documents from a local file or folder (``.txt`` paragraphs separated by
  blank lines, ``.jsonl`` objects, either ``.xz`` / ``.gz`` compressed) or a Hugging Face dataset;
* ``split_texts(texts, "train" | "eval")`` keeps one side of a split decided by a hash of each
  document, so train and eval never share a document whatever the order or the streaming;
* ``TokenRows(tokenizer, context_size).rows(texts)`` tokenizes, joins documents with a separator
  token and cuts the stream into rows of ``context_size`` tokens, each starting with BOS (the
  SAELens / TransformerLens convention, so the activations match what the model sees in practice).
"""

from __future__ import annotations

import codecs
import gzip
import hashlib
import json
import lzma
import os
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Literal

import torch

if TYPE_CHECKING:
    from transformer_lens import HookedTransformer

SUFFIXES = (".txt", ".jsonl", ".txt.xz", ".jsonl.xz", ".txt.gz", ".jsonl.gz")


def iter_texts(
    source: str | os.PathLike,
    *,
    text_field: str = "text",
    hf_split: str = "train",
    hf_config: str | None = None,
) -> Iterator[str]:
    """Yield the documents of ``source`` in a deterministic order.

    A local file (see ``SUFFIXES``), a local folder (every supported file below it, sorted by relative
    path) or, when ``source`` is not an existing path, a Hugging Face dataset streamed with
    ``datasets.load_dataset(source, hf_config, split=hf_split, streaming=True)``. ``text_field`` names
    the document in a ``.jsonl`` object or a dataset row; empty documents are skipped. A wrong source
    fails here, at the call, not at the first ``next``: a missing path that cannot be a dataset name
    (absolute, ``./``, a file suffix) is not tried as one, and with ``HF_HUB_OFFLINE`` set no dataset
    is tried (the error says what was tried). A file that is not UTF-8, a broken ``.xz`` / ``.gz`` or
    a ``.jsonl`` line that is not a JSON object raise a ValueError naming the file when it is read.
    """
    path = resolve_text(source)
    files = _local_files(path)
    if files is not None:
        return (text for file in files for text in _iter_file(file, text_field))
    if _looks_like_path(str(source)):
        raise ValueError(
            f"no such file or folder: {source} (a local path, so it was not tried as a Hugging Face dataset)"
        )
    return _iter_hf(str(source), text_field, hf_split, hf_config)


def source_digests(source: str | os.PathLike) -> dict[str, str]:
    """Content digests of a text source, so overlap checks compare what was read, not how it was named.

    A local file gives ``{name: "sha256:<hex of its bytes>"}``; a folder gives one entry per file that
    ``iter_texts`` reads, keyed by relative path; empty files, which hold no document, are left out.
    Anything else is taken for a Hugging Face dataset name: ``{name: "hf:<name>"}``. The same file
    under another name or spelling gives the same digest (an edited file does not: whole files are
    hashed, not documents). Raises the errors ``iter_texts`` would for a folder without supported
    files or a file of an unsupported type.
    """
    path = resolve_text(source)
    files = _local_files(path)
    if files is None:
        return {str(source): f"hf:{source}"}
    digests = {}
    for file in files:
        if file.stat().st_size:
            name = file.name if file == path else file.relative_to(path).as_posix()
            digests[name] = f"sha256:{_sha256(file)}"
    return digests


def _sha256(path: Path) -> str:
    from mxd_lens.fileio import file_digest

    return file_digest(path)


def _local_files(path: Path) -> list[Path] | None:
    """The supported files of a local file or folder in reading order; None when ``path`` does not exist."""
    if path.is_dir():
        files = sorted(
            (p for p in path.rglob("*") if p.is_file() and _suffix(p) is not None),
            key=lambda p: p.relative_to(path).as_posix(),
        )
        if not files:
            raise ValueError(f"folder {path} holds no file ending in one of {', '.join(SUFFIXES)}")
        return files
    if path.exists():
        if _suffix(path) is None:
            raise ValueError(
                f"{path}: unsupported file type; use a file ending in one of {', '.join(SUFFIXES)}"
            )
        return [path]
    return None


def _looks_like_path(source: str) -> bool:
    """Whether a missing ``source`` can only be meant as a local path: a Hugging Face dataset name is
    ``name`` or ``owner/name``, never absolute, relative to ``.``/``~``, or ending in a file suffix."""
    return (
        Path(source).is_absolute()
        or source.startswith((".", "~"))
        or "\\" in source
        or source.count("/") > 1
        or _suffix(Path(source)) is not None
    )


def _suffix(path: Path) -> str | None:
    name = path.name.lower()
    return next((s for s in SUFFIXES if name.endswith(s)), None)


def _open(path: Path) -> IO[str]:
    suffix = _suffix(path) or ""
    if suffix.endswith(".xz"):
        return lzma.open(path, "rt", encoding="utf-8")
    if suffix.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def _iter_file(path: Path, text_field: str) -> Iterator[str]:
    compressed = (_suffix(path) or "").endswith((".xz", ".gz"))
    try:
        with _open(path) as f:
            if ".jsonl" in (_suffix(path) or ""):
                yield from _iter_jsonl(f, path, text_field)
            else:
                yield from _iter_paragraphs(f)
    except UnicodeDecodeError as e:
        offset = _utf8_error_offset(path)
        where = "" if offset is None else f" at byte {offset}"
        if where and compressed:
            where += " of its decompressed text"
        raise ValueError(
            f"{path}: not UTF-8 text (invalid byte {e.object[e.start : e.start + 1]!r}{where}); "
            "convert it to UTF-8 (e.g. `iconv -f latin1 -t utf-8`) or remove it from the source"
        ) from e
    except (lzma.LZMAError, gzip.BadGzipFile, zlib.error, EOFError) as e:
        if not compressed:
            raise
        kind = ".xz" if path.name.lower().endswith(".xz") else ".gz"
        raise ValueError(
            f"{path}: not a valid {kind} archive ({type(e).__name__}: {e}); it is truncated, corrupt or "
            "not compressed: re-create it, or remove it from the source"
        ) from e


def _utf8_error_offset(path: Path) -> int | None:
    """The offset of the first byte of ``path`` (decompressed) that is not UTF-8, by a second read."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    try:
        with _open_bytes(path) as f:
            while True:
                chunk = f.read(1 << 20)
                pending = len(decoder.getstate()[0])
                try:
                    decoder.decode(chunk, final=not chunk)
                except UnicodeDecodeError as e:
                    return offset - pending + e.start
                if not chunk:
                    return None
                offset += len(chunk)
    except (OSError, EOFError, lzma.LZMAError, zlib.error):
        return None


def _open_bytes(path: Path) -> IO[bytes]:
    suffix = _suffix(path) or ""
    if suffix.endswith(".xz"):
        return lzma.open(path, "rb")
    if suffix.endswith(".gz"):
        return gzip.open(path, "rb")
    return open(path, "rb")


def _iter_paragraphs(lines: Iterable[str]) -> Iterator[str]:
    """Paragraphs: runs of lines separated by one or more blank lines, stripped."""
    paragraph: list[str] = []
    for line in lines:
        if line.strip():
            paragraph.append(line)
        elif paragraph:
            yield "".join(paragraph).strip()
            paragraph = []
    if paragraph:
        yield "".join(paragraph).strip()


def _iter_jsonl(lines: Iterable[str], path: Path, text_field: str) -> Iterator[str]:
    n_objects = n_yielded = 0
    first_keys: list[str] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}, line {number}: not valid JSON ({e.msg}, column {e.colno})") from e
        if not isinstance(obj, dict):
            raise ValueError(f"{path}, line {number}: expected a JSON object, got {type(obj).__name__}")
        if n_objects == 0:
            first_keys = sorted(obj)
        n_objects += 1
        text = obj.get(text_field)
        if text is None or text == "":
            continue
        if not isinstance(text, str):
            raise ValueError(
                f"{path}, line {number}: {text_field!r} is a {type(text).__name__}, not a string"
            )
        n_yielded += 1
        yield text
    # Skipping an odd object without the field is fine; a whole file without it is a wrong text_field.
    if n_objects and not n_yielded:
        raise ValueError(
            f"{path}: none of its {n_objects} objects has a non-empty {text_field!r} field "
            f"(the first has keys {first_keys}); pass text_field=<one of them>"
        )


def _iter_hf(name: str, text_field: str, split: str, config: str | None) -> Iterator[str]:
    tried = f"no such file or folder: {name}; as a Hugging Face dataset: "
    offline = _hub_offline()
    if offline:  # no network attempt: streaming a hub dataset cannot work offline
        raise ValueError(
            f"{tried}not tried, the hub is offline ({offline} is set); unset it to stream {name!r} from "
            "the hub, or pass an existing local file or folder"
        )
    import datasets

    try:
        dataset = datasets.load_dataset(name, config, split=split, streaming=True)
    except Exception as e:  # unreachable hub, unknown name, bad config/split: all the same to the user
        raise ValueError(f"{tried}{type(e).__name__}: {e}") from e
    columns = dataset.column_names
    if columns is not None and text_field not in columns:
        raise ValueError(f"dataset {name!r} has no column {text_field!r}; its columns are {columns}")
    return _iter_rows(dataset, name, text_field)


def _hub_offline() -> str | None:
    """The variable that puts the Hugging Face hub offline, if one does (read now, not at import)."""
    from huggingface_hub import constants

    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(var, "").strip().upper() in {"1", "ON", "YES", "TRUE"}:
            return var
    return "HF_HUB_OFFLINE" if constants.HF_HUB_OFFLINE else None


def _iter_rows(dataset: Iterable[dict[str, Any]], name: str, text_field: str) -> Iterator[str]:
    for row in dataset:
        if text_field not in row:
            raise ValueError(f"dataset {name!r} has no column {text_field!r}; its columns are {list(row)}")
        text = row[text_field]
        if text:
            yield text


def split_texts(
    texts: Iterable[str], split: Literal["train", "eval"], eval_fraction: float = 0.02, seed: int = 0
) -> Iterator[str]:
    """Keep the documents of one side of a train/eval split.

    A document goes to eval when a stable hash of (``seed``, its text) falls below ``eval_fraction``:
    the decision depends on nothing else, so the two sides never overlap (duplicates land on the same
    side) in any order, streamed or not, across runs and machines. ``hash()`` would not do: it is
    salted per process.
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split={split!r}: use 'train' or 'eval'")
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction={eval_fraction!r} must be strictly between 0 and 1, e.g. 0.02")
    return _keep(texts, split == "eval", eval_fraction, f"{int(seed)}\0".encode())


def _keep(texts: Iterable[str], want_eval: bool, eval_fraction: float, prefix: bytes) -> Iterator[str]:
    for text in texts:
        digest = hashlib.blake2b(prefix + text.encode("utf-8"), digest_size=8).digest()
        if (int.from_bytes(digest, "big") / 2**64 < eval_fraction) == want_eval:
            yield text


def check_context_size(model: HookedTransformer, context_size: int) -> None:
    """Raise a clear error unless rows of ``context_size`` tokens fit ``model``."""
    n_ctx = model.cfg.n_ctx
    if isinstance(context_size, bool) or not isinstance(context_size, int) or not 2 <= context_size <= n_ctx:
        raise ValueError(
            f"context_size={context_size!r} does not fit {model.cfg.model_name}, which takes 2..{n_ctx} "
            f"tokens per row (n_ctx={n_ctx}); pass a context_size in that range"
        )


@dataclass
class TokenRows:
    """How to turn documents into rows of ``context_size`` tokens for the model.

    Documents are tokenized without special tokens, joined with ``separator_token_id`` between them
    and cut into rows; with ``prepend_bos`` every row is ``[bos] + context_size - 1`` stream tokens.
    ``bos_token_id`` defaults to the tokenizer's BOS, else its EOS (GPT-2 style); ``separator_token_id``
    defaults to its EOS. Both are resolved when the object is built, so to pack without a separator
    set ``rows.separator_token_id = None`` afterwards.
    """

    tokenizer: Any
    context_size: int
    prepend_bos: bool = True
    bos_token_id: int | None = None
    separator_token_id: int | None = None
    tokenize_batch: int = 64

    def __post_init__(self) -> None:
        if (
            isinstance(self.context_size, bool)
            or not isinstance(self.context_size, int)
            or self.context_size < 2
        ):
            raise ValueError(f"context_size={self.context_size!r} must be an int >= 2")
        if self.tokenize_batch < 1:
            raise ValueError(f"tokenize_batch={self.tokenize_batch!r} must be >= 1")
        if self.bos_token_id is None:
            bos = self.tokenizer.bos_token_id
            self.bos_token_id = bos if bos is not None else self.tokenizer.eos_token_id
        if self.prepend_bos and self.bos_token_id is None:
            raise ValueError(
                f"prepend_bos=True but {type(self.tokenizer).__name__} has neither a BOS nor an EOS token: "
                "pass bos_token_id=<id> or prepend_bos=False"
            )
        if self.separator_token_id is None:
            self.separator_token_id = self.tokenizer.eos_token_id

    @classmethod
    def for_model(cls, model: HookedTransformer, context_size: int, **kw: Any) -> TokenRows:
        """Rows for ``model``: its tokenizer, its ``default_prepend_bos``, a context that fits it."""
        if getattr(model, "tokenizer", None) is None:
            raise ValueError(
                f"{model.cfg.model_name} has no tokenizer: call model.set_tokenizer(tokenizer) or build "
                "TokenRows(tokenizer, context_size) directly"
            )
        check_context_size(model, context_size)
        kw.setdefault("prepend_bos", model.cfg.default_prepend_bos)
        return cls(model.tokenizer, context_size, **kw)

    def rows(self, texts: Iterable[str], name: Any = None) -> Iterator[torch.Tensor]:
        """Yield rows of shape ``[context_size]`` (torch.long); a trailing partial row is dropped.

        Raises ValueError once ``texts`` is exhausted if it did not fill a single row (naming ``name``,
        the text's name, when given). Warns, naming the text and the tokenizer, when more than
        ``UNKNOWN_WARN`` of the tokens are the tokenizer's unknown token (a text this tokenizer does not
        cover), judged once on the first ``UNKNOWN_SAMPLE`` tokens (the whole text if shorter): the
        first rows are yielded after that, so even a reader of one row is warned, and not on a sample
        of one row.
        """
        head = [self.bos_token_id] if self.prepend_bos else []
        body = self.context_size - len(head)
        sep = [] if self.separator_token_id is None else [self.separator_token_id]
        stream: list[int] = []
        n_docs = n_tokens = n_rows = 0
        unk = getattr(self.tokenizer, "unk_token_id", None)
        # the rows are held back until the share of unknown tokens is judged on UNKNOWN_SAMPLE tokens
        judged, n_unk, held = unk is None, 0, []
        for batch in _batched(texts, self.tokenize_batch):
            for ids in self.tokenizer(batch, add_special_tokens=False)["input_ids"]:
                n_docs += 1
                if not ids:
                    continue
                if n_tokens:  # a document came before: separate them
                    stream.extend(sep)
                n_tokens += len(ids)
                n_unk += 0 if judged else ids.count(unk)
                stream.extend(ids)
                start = 0
                while len(stream) - start >= body:
                    row = torch.tensor(head + stream[start : start + body], dtype=torch.long)
                    start += body
                    n_rows += 1
                    if judged:
                        yield row
                    else:
                        held.append(row)
                del stream[:start]  # once per document, so a long document is cut in linear time
                if not judged and n_tokens >= self.UNKNOWN_SAMPLE:
                    judged = True
                    self._warn_unknown(n_unk, n_tokens, name)
                    yield from held
                    held = []
        if not judged and n_tokens:  # the whole text is shorter than the sample
            self._warn_unknown(n_unk, n_tokens, name)
        yield from held
        if not n_rows:
            raise ValueError(
                f"no usable text{'' if name is None else f' in {name}'}: {n_docs} documents gave {n_tokens} "
                f"tokens, fewer than the {body} needed for one row of context_size={self.context_size}"
                f"{' after its BOS' if head else ''}; check the source, the split and text_field"
            )

    UNKNOWN_WARN = 0.1
    """The fraction of a text's tokens that may be the tokenizer's unknown token without a warning."""
    UNKNOWN_SAMPLE = 4096
    """The tokens (at the text's start) on which that fraction is judged, before the first row is yielded."""

    def _warn_unknown(self, n_unk: int, n_tokens: int, name: Any) -> bool:
        """Warn when more than ``UNKNOWN_WARN`` of the first ``n_tokens`` tokens of the text ``name`` are
        unknown (``n_unk``); whether it warned."""
        if n_unk <= self.UNKNOWN_WARN * n_tokens:
            return False
        import warnings

        tokenizer = getattr(self.tokenizer, "name_or_path", None) or type(self.tokenizer).__name__
        warnings.warn(
            f"{'the text' if name is None else name}: {n_unk:,} of its first {n_tokens:,} tokens "
            f"({n_unk / n_tokens:.0%}) are the unknown token {self.tokenizer.unk_token!r} of the tokenizer "
            f"{tokenizer}, which does not cover this text (another language or script, or another model's "
            "tokenizer?): the model would mostly see that one token",
            stacklevel=2,
        )
        return True

    def batches(self, texts: Iterable[str], batch_size: int) -> Iterator[torch.Tensor]:
        """Yield ``[batch_size, context_size]`` batches of rows; a trailing partial batch is dropped.

        Raises ValueError if ``texts`` does not fill a single batch (a trainer would silently do nothing).
        """
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r} must be >= 1")
        pending: list[torch.Tensor] = []
        n_batches = 0
        for row in self.rows(texts):
            pending.append(row)
            if len(pending) == batch_size:
                yield torch.stack(pending)
                pending = []
                n_batches += 1
        if not n_batches:
            raise ValueError(
                f"no usable text for one batch: only {len(pending)} rows of context_size={self.context_size}, "
                f"fewer than batch_size={batch_size}; use more text or a smaller batch_size"
            )


def _batched(texts: Iterable[str], n: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for index, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"document {index} is a {type(text).__name__}, not a str")
        batch.append(text)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


PACKAGE_PREFIX = (
    "mxd_lens:"  # a text shipped with the package, by resource name: "mxd_lens:resources/x.txt.xz"
)


def text_name(source: str | os.PathLike) -> str:
    """How a training record names ``source``: a file shipped with mxd-lens by its package resource name
    (``mxd_lens:resources/...``, valid wherever the package is installed), a local path given relative to
    the working folder by its absolute path (the record then names it from any folder), anything else
    (an absolute path, a dataset name) as given."""
    from importlib.resources import files

    package = Path(str(files("mxd_lens"))).resolve()
    path = Path(source).expanduser()
    if path.exists() and path.resolve().is_relative_to(package):
        return PACKAGE_PREFIX + path.resolve().relative_to(package).as_posix()
    if path.exists() and not path.is_absolute():
        return str(path.resolve())
    return str(source)


def resolve_text(source: str | os.PathLike) -> Path:
    """The local path of ``source``: a package resource name (``text_name``) becomes the file in this
    installation; a path is expanded (``~``)."""
    from importlib.resources import files

    if isinstance(source, str) and source.startswith(PACKAGE_PREFIX):
        return Path(str(files("mxd_lens"))) / source.removeprefix(PACKAGE_PREFIX)
    return Path(source).expanduser()


def default_text() -> Path:
    """The bundled English text (Jane Austen's six novels, public domain, one paragraph per document;
    ~0.9M SmolLM2 tokens, from Debian's r-cran-janeaustenr), so a fresh install has real text offline."""
    from importlib.resources import files

    return Path(str(files("mxd_lens") / "resources" / "jane_austen_novels.txt.xz"))


MIX_SUFFIXES = (".txt.xz", ".txt.gz", ".txt")  # what mix_texts writes, by the name's suffix


def mix_texts(
    sources: Sequence[str | Path],
    out: str | Path,
    *,
    measure: Callable[[str], int] | None = None,
    per_source: int | None = None,
) -> tuple[int, list[int]]:
    """Interleave the documents of ``sources`` into the text file ``out``, balanced by volume: the next
    document always comes from the source that has given the least so far (while it has documents
    left), so any prefix holds about as much of each source whatever their document lengths.
    ``measure`` is how a document's volume counts (default: characters; a tokenizer's token count
    gives equal *token* shares). With ``per_source`` the mix stops taking from a source once it has given
    that much, and a source that runs out first is an error (the shares would not be equal).
    Documents are separated by blank lines, so ``iter_texts(out)`` reads back the same documents.
    ``out`` is written as its name says (``MIX_SUFFIXES``: .txt.xz, .txt.gz or plain .txt; another name
    is refused), atomically; refused before anything is written when it is one of the sources or lies
    inside a source folder, and so is a source given twice (by its resolved path). The temporaries a
    killed mix left for ``out`` are removed first. A source that gave nothing (an empty file) is named in a
    warning. Returns (documents, volume per source)."""
    from mxd_lens.fileio import atomic_write, remove_abandoned_temporaries

    measure = measure or len
    if per_source is not None and per_source <= 0:
        raise ValueError(f"per_source={per_source} must be positive")
    out = Path(out).expanduser()
    suffix = next((s for s in MIX_SUFFIXES if out.name.lower().endswith(s)), None)
    if suffix is None:
        raise ValueError(
            f"out {out}: the mix is written as its name's suffix says; end it in .txt.xz (xz), .txt.gz "
            "(gzip) or .txt (plain text)"
        )
    _check_mix_paths(sources, out)
    remove_abandoned_temporaries(out.parent, (out.name,))

    def write(tmp: str) -> None:
        streams = {i: iter_texts(source) for i, source in enumerate(sources)}
        with open(tmp, "wb") as raw, _text_writer(raw, suffix) as f:
            while streams:
                i = min(streams, key=lambda j: given[j])
                if per_source is not None and given[i] >= per_source:
                    del streams[i]
                    continue
                doc = next(streams[i], None)
                if doc is None:
                    if per_source is not None:
                        raise ValueError(
                            f"{sources[i]} holds {given[i]:,} of the {per_source:,} asked per source: lower per_source"
                        )
                    del streams[i]
                    continue
                f.write(("\n\n" if counts[0] else "") + doc)
                given[i] += measure(doc)
                counts[0] += 1

    given, counts = [0] * len(sources), [0]
    atomic_write(out, write)
    empty = [str(source) for source, volume in zip(sources, given, strict=True) if not volume]
    if empty:
        import warnings

        warnings.warn(
            f"{', '.join(empty)}: no document, so nothing of {'it' if len(empty) == 1 else 'them'} is in "
            f"the mix {out} (an empty file or folder?); check the source{'s' if len(empty) > 1 else ''}",
            stacklevel=2,
        )
    return counts[0], given


def _text_writer(raw: IO[bytes], suffix: str) -> IO[str]:
    """A UTF-8 text stream into ``raw``, compressed as ``suffix`` says (gzip without a name or time in
    its header, so the same mix gives the same bytes); closing it leaves ``raw`` open but for plain text."""
    import io

    if suffix.endswith(".xz"):
        return lzma.open(raw, "wt", encoding="utf-8")
    if suffix.endswith(".gz"):
        return io.TextIOWrapper(gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0), encoding="utf-8")
    return io.TextIOWrapper(raw, encoding="utf-8")


def _check_mix_paths(sources: Sequence[str | Path], out: Path) -> None:
    """Refuse (ValueError, before anything is written) a source given twice under two spellings (or a
    file inside a source folder), and an ``out`` that is a source or lies inside a source folder."""
    if not sources:
        raise ValueError("give at least one source to mix")
    if out.is_dir():
        raise ValueError(f"out {out} is a folder: give the file to write, e.g. {out / 'mixed.txt.xz'}")
    if not out.parent.is_dir():
        raise ValueError(f"out {out}: folder {out.parent} does not exist; make it first")
    target = out.resolve()
    seen: dict[Path | str, str | Path] = {}
    for source in sources:
        path = resolve_text(source)
        key: Path | str = path.resolve() if path.exists() else str(source)
        if key in seen:
            raise ValueError(f"sources {seen[key]} and {source} are the same ({key}): give each source once")
        if isinstance(key, Path):
            for other, given_as in seen.items():
                if isinstance(other, Path) and (key.is_relative_to(other) or other.is_relative_to(key)):
                    inner, outer = (source, given_as) if key.is_relative_to(other) else (given_as, source)
                    raise ValueError(
                        f"source {inner} lies inside source folder {outer}: its documents would be mixed "
                        "twice; give it once"
                    )
            same = target == key or (out.exists() and os.path.samefile(out, key))
            if same or (key.is_dir() and target.is_relative_to(key)):
                where = "is" if same else "lies inside"
                raise ValueError(
                    f"out {out} {where} source {source}: writing the mix there would replace or join what "
                    "it is made of; give another out (nothing was written)"
                )
        seen[key] = source
