"""The data pipeline: text files -> offline tokenizer -> Megatron-Core indexed dataset -> GPT samples -> batches.

    prepare_dataset(inputs, out_dir)          writes out_dir/{corpus.bin, corpus.idx, tokenizer.json, meta.json}
    build_gpt_datasets(out_dir, seq, seed, n) Megatron-Core GPTDatasets (train, valid, test) over it
    batches(dataset, micro_batch_size, seed)  endless, deterministic dicts of [b, s] tensors
    data_parallel_batches(..., dp_rank, dp)   one data-parallel rank's round-robin share of that stream

With no inputs the corpus is the interpreter's own standard library: real code text, present offline on every
machine, PSF licence. Importing this module is cheap and needs neither a GPU nor Transformer Engine: megatron,
tokenizers and torch are imported inside the functions that use them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shlex
import shutil
import sys
import sysconfig
import struct
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from fp8_recipes.checks import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["Tokenizer", "default_corpus_files", "prepare_dataset", "prepared_meta", "prepare_command",
           "build_gpt_datasets", "batches", "data_parallel_batches", "FixedBatches", "fixed_batches", "split_samples",
           "repeated_batch"]

FORMAT = 1  # bump when the on-disk layout changes: older datasets are then rebuilt, never misread
PREFIX = "corpus"  # Megatron path prefix: corpus.bin + corpus.idx
EOD_TEXT = "<|endoftext|>"
# In a directory, only these are read (explicitly named files are read whatever their suffix).
TEXT_SUFFIXES = (".jsonl", ".txt", ".py", ".md", ".rst")
STDLIB_LICENCE = "Python standard library source, PSF License Agreement: https://docs.python.org/3/license.html"
_BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def default_corpus_files() -> list[Path]:
    """The standard library's ``.py`` files, sorted; test suites and installed packages left out."""
    root = Path(sysconfig.get_path("stdlib"))
    # site-/dist-packages differ per machine (the base interpreter may have packages installed) and the test
    # suites are mostly fixtures: neither belongs in a corpus that must be identical wherever it is built.
    skip = {"test", "tests", "idle_test", "site-packages", "dist-packages"}
    found = []  # (relative posix path, file): os.walk and strings, ten times faster than Path.glob + relative_to
    for top, dirs, names in os.walk(root):
        rel = os.path.relpath(top, root).replace(os.sep, "/")
        if rel != "." and skip.intersection(rel.split("/")):
            dirs.clear()
            continue
        prefix = "" if rel == "." else f"{rel}/"
        found += [(prefix + n, Path(top, n)) for n in names if n.endswith(".py")]
    return [f for _, f in sorted(found)]


def _expand_inputs(inputs: Sequence[str | os.PathLike]) -> list[Path]:
    files: list[Path] = []
    for raw in inputs:
        path = Path(raw).expanduser()
        if not path.exists():
            raise ConfigError(
                f"data.inputs: path {str(raw)!r} does not exist; point it at .jsonl/.txt files or a directory"
            )
        if not path.is_dir():
            files.append(path)
            continue
        found = sorted(
            (f for f in path.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES
             and not any(p.startswith(".") or p == "__pycache__" for p in f.relative_to(path).parts)),
            key=lambda f: f.relative_to(path).as_posix(),
        )
        if not found:
            raise ConfigError(f"data.inputs: directory {str(raw)!r} holds no {'/'.join(TEXT_SUFFIXES)} files; "
                             "point it at a directory of text files")
        files += found
    return files


def _read_documents(files: Sequence[Path], json_key: str) -> list[str]:
    """One document per line of a .jsonl file (``line[json_key]``), one per file otherwise; empty ones dropped."""
    docs: list[str] = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise ConfigError(f"data.inputs: {str(path)!r} is not UTF-8 text; convert it or leave it out") from None
        if path.suffix != ".jsonl":
            docs.append(text)
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                record = None
            if not isinstance(record, dict):
                raise ConfigError(f"data.inputs: {path}:{n} is not a JSON object; each .jsonl line must be one")
            if not isinstance(record.get(json_key), str):
                raise ConfigError(f"data.json_key: no text under {json_key!r} in {path}:{n}; "
                                 "set data.json_key (--json-key) to the field that holds the text")
            docs.append(record[json_key])
    return [d for d in docs if d]


def _hash_documents(docs: Sequence[str]) -> str:
    # Length-prefixed so that moving text across a document boundary changes the hash too.
    h = hashlib.sha256()
    for doc in docs:
        data = doc.encode("utf-8")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


class Tokenizer:
    """A byte-level BPE (HuggingFace ``tokenizers``) or plain-bytes tokenizer, as Megatron's GPTDataset wants it.

    GPTDataset reads ``vocab_size``, ``eod`` and ``unique_identifiers``; the last one goes into the key of
    Megatron's index cache, which otherwise ignores the data itself (docs/facts.md: a rebuilt .bin silently reuses stale
    indices). So it carries a hash of the tokenizer and of the data it is paired with.
    """

    def __init__(self, kind: str, hf: Any = None, data_hash: str = "") -> None:
        self.kind, self._hf, self.data_hash = kind, hf, data_hash
        if kind == "bytes":
            self.vocab_size, self.eod, serial = 257, 256, self._bytes_json()
        else:
            self.vocab_size, self.eod, serial = hf.get_vocab_size(), hf.token_to_id(EOD_TEXT), hf.to_str()
        self.unique_identifiers = {
            "class": "fp8_recipes.Tokenizer", "kind": kind, "vocab_size": self.vocab_size, "eod": self.eod,
            "tokenizer_sha256": hashlib.sha256(serial.encode()).hexdigest(), "data_hash": data_hash,
        }

    @staticmethod
    def _bytes_json() -> str:
        return json.dumps({"fp8_recipes_tokenizer": "bytes", "vocab_size": 257, "eod": 256})

    @classmethod
    def plain_bytes(cls, data_hash: str = "") -> Tokenizer:
        """UTF-8 bytes are the ids 0..255, EOD is 256: nothing to train, ~3.5x more tokens than BPE."""
        return cls("bytes", data_hash=data_hash)

    @classmethod
    def train_bpe(cls, docs: Sequence[str], vocab_size: int, data_hash: str = "") -> Tokenizer:
        """Byte-level BPE trained on ``docs``; the same docs give a byte-identical tokenizer (docs/facts.md)."""
        from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

        hf = HFTokenizer(models.BPE())
        # No normalizer and no prefix space, so that decode(encode(text)) == text exactly (code is whitespace).
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=[EOD_TEXT], show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable, even unseen ones
        )
        hf.train_from_iterator(docs, trainer)
        return cls("bpe", hf, data_hash)

    def encode(self, text: str) -> list[int]:
        if self.kind == "bytes":
            return list(text.encode("utf-8"))
        return self._hf.encode(text).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        if self.kind == "bytes":
            return [self.encode(t) for t in texts]
        return [e.ids for e in self._hf.encode_batch(list(texts))]  # parallel in Rust, same ids as encode()

    def decode(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        if self.kind == "bytes":
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        return self._hf.decode(ids, skip_special_tokens=True)

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(self._bytes_json() if self.kind == "bytes" else self._hf.to_str(), encoding="utf-8")

    @classmethod
    def load(cls, path: str | os.PathLike, data_hash: str = "") -> Tokenizer:
        """Read a ``tokenizer.json`` written by :meth:`save` (a plain HuggingFace file for BPE)."""
        text = Path(path).read_text(encoding="utf-8")
        if json.loads(text).get("fp8_recipes_tokenizer") == "bytes":
            return cls.plain_bytes(data_hash)
        from tokenizers import Tokenizer as HFTokenizer

        return cls("bpe", HFTokenizer.from_str(text), data_hash)


@contextlib.contextmanager
def _quiet_megatron() -> Iterator[None]:
    # Noise that is expected here: Transformer Engine is absent on CPU machines on purpose (import), and
    # without torch.distributed Megatron guesses rank 0 (build), which is right for a single-process build.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(Transformer Engine|absl|Could not determine rank).*")
        yield


_META_TYPES = {"data_hash": str, "tokenizer": dict, "vocab_size": int, "eod": int, "num_documents": int,
               "num_tokens": int}  # what the readers of meta.json take from it


def _dataset_state(data_dir: Path) -> tuple[dict | None, str | None]:
    """(meta.json, what is damaged) of the prepared dataset in ``data_dir``: (None, None) when there is none (no
    meta.json and corpus next to each other, or a dataset of another FORMAT); a damaged one's damage names the file:
    a meta.json that is not JSON or lacks what its readers take from it (its dict is still given, for its settings),
    a missing tokenizer.json, corpus sizes other than meta.json records, a tokenizer.json that does not load."""
    if not all((data_dir / name).is_file() for name in ("meta.json", f"{PREFIX}.bin", f"{PREFIX}.idx")):
        return None, None
    try:
        meta = json.loads((data_dir / "meta.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # (UnicodeDecodeError and JSONDecodeError are ValueErrors)
        return None, f"meta.json cannot be read: {type(e).__name__}"
    if not isinstance(meta, dict):
        return None, "meta.json is not a JSON object"
    if isinstance(meta.get("format"), int) and meta["format"] != FORMAT:
        return None, None  # an earlier layout: never misread
    wrong = [k for k, t in {"format": int, **_META_TYPES}.items() if not isinstance(meta.get(k), t)
             or isinstance(meta.get(k), bool)]
    if wrong:
        return meta, f"meta.json has no {wrong[0]!r} of type {({'format': int, **_META_TYPES})[wrong[0]].__name__}"
    if not (data_dir / "tokenizer.json").is_file():
        return meta, "tokenizer.json is missing"
    return meta, corpus_damage(data_dir, meta) or _tokenizer_damage(data_dir, meta)


def _tokenizer_damage(data_dir: Path, meta: dict) -> str | None:
    """Why tokenizer.json does not load (truncated, garbled), or None."""
    try:
        Tokenizer.load(data_dir / "tokenizer.json", meta["data_hash"])
    except Exception as e:  # noqa: BLE001 - json's ValueError, tokenizers' Exception, a KeyError: all damage
        return f"tokenizer.json does not load: {type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"
    return None


def corpus_damage(data_dir: Path, meta: dict) -> str | None:
    """What is wrong with a prepared dataset's corpus.bin / corpus.idx (a truncated copy, a disk that filled up),
    or None: their sizes against those meta.json recorded (datasets prepared before sizes were recorded: the
    .bin against num_tokens)."""
    sizes = meta.get("sizes")
    if not isinstance(sizes, dict) or not all(isinstance(v, int) for v in sizes.values()):
        itemsize = 2 if int(meta.get("vocab_size", 0)) < 65500 else 4  # Megatron's DType.optimal_dtype
        sizes = {f"{PREFIX}.bin": int(meta.get("num_tokens", -1)) * itemsize}
    for name, size in sizes.items():
        try:
            have = (data_dir / name).stat().st_size
        except OSError as e:
            return f"{name}: {e.strerror}"
        if have != size:
            return f"{name} has {have:,} bytes, meta.json says {size:,}"
    return None


def prepare_command(data_dir: str | os.PathLike, meta: dict | None, rebuild: bool = False) -> str:
    """The scripts/prepare_data.py command that prepares ``data_dir`` again as its meta.json says it was made (its
    sources, tokenizer, vocabulary and JSON key); what a damaged meta.json no longer says is asked for in words.
    ``rebuild``: for damage only reading the dataset finds (prepare_data.py would reuse it otherwise)."""
    args = ["python", "scripts/prepare_data.py", "--out", str(data_dir)]
    meta = meta or {}
    tok = meta.get("tokenizer") if isinstance(meta.get("tokenizer"), dict) else {}
    if meta.get("licence") != STDLIB_LICENCE and isinstance(meta.get("sources"), list):
        args += ["--inputs", *(str(x) for x in meta["sources"])]
    if tok.get("kind") == "bytes":
        args += ["--tokenizer", "bytes"]
    elif isinstance(tok.get("vocab_size"), int) and tok["vocab_size"] != 4096:
        args += ["--vocab-size", str(tok["vocab_size"])]
    if isinstance(meta.get("json_key"), str) and meta["json_key"] != "text":
        args += ["--json-key", meta["json_key"]]
    command = f"`{shlex.join(args + (['--rebuild'] if rebuild else []))}`"
    known = "sources" in meta and tok.get("kind") in ("bpe", "bytes")
    return command if known else f"{command} with the --inputs and --tokenizer it was prepared from"


def prepared_meta(data_dir: str | os.PathLike) -> dict:
    """meta.json of the intact prepared dataset in ``data_dir``; else a one-line ConfigError naming data.path: none
    there, or what is damaged and the command that prepares it again (a training start does that itself)."""
    data_dir = Path(data_dir)
    meta, damage = _dataset_state(data_dir)
    if damage is not None:
        raise ConfigError(f"data.path: {str(data_dir)!r} is damaged ({damage}); prepare it again with "
                          f"{prepare_command(data_dir, meta)} (a training start prepares it again from data.inputs)")
    if meta is None:
        raise ConfigError(f"data.path: {str(data_dir)!r} holds no complete prepared dataset; "
                          f"run `python scripts/prepare_data.py --out {data_dir}` first")
    return meta


def prepare_dataset(
    inputs: str | os.PathLike | Sequence[str | os.PathLike] | None,
    out_dir: str | os.PathLike,
    tokenizer_kind: str = "bpe",
    vocab_size: int = 4096,
    json_key: str = "text",
    rebuild: bool = False,
) -> Path:
    """Tokenize ``inputs`` (None: the standard library) into a Megatron-Core dataset in ``out_dir``.

    Reuses ``out_dir`` when it already holds this data with these tokenizer settings, intact (the check reads and
    hashes the inputs, ~0.2 s for the standard library, and checks meta.json, the corpus sizes and that the
    tokenizer loads); ``rebuild``: never. Otherwise builds next to it and renames into place, so a crash never
    leaves a half-written dataset (a damaged one is replaced with one warning). In a multi-rank job call it on one
    rank, then barrier.
    """
    if tokenizer_kind not in ("bpe", "bytes"):
        raise ConfigError(f"data.tokenizer: {tokenizer_kind!r} is not one of bpe, bytes")
    if tokenizer_kind == "bpe" and not (258 <= vocab_size <= 65500):  # 256 bytes + EOD + >=1 merge; uint16 ids
        raise ConfigError(f"data.vocab_size: {vocab_size} is out of range; use 258..65500 (e.g. 4096)")
    out_dir = Path(out_dir)
    default = inputs is None
    if default:
        files = default_corpus_files()
        sources = [sysconfig.get_path("stdlib")]
    else:
        sources = [str(inputs)] if isinstance(inputs, (str, os.PathLike)) else [str(i) for i in inputs]
        if not sources:
            raise ConfigError("data.inputs: the list is empty; give .jsonl/.txt files or a directory, or null")
        files = _expand_inputs(sources)
    docs = _read_documents(files, json_key)
    if not docs:
        raise ConfigError(f"data.inputs: no text found in {sources}; point it at non-empty .jsonl/.txt files")
    data_hash = _hash_documents(docs)
    settings = {"kind": tokenizer_kind, "vocab_size": vocab_size if tokenizer_kind == "bpe" else 257}

    old, damage = _dataset_state(out_dir)
    if damage is None and old and not rebuild and old["data_hash"] == data_hash and old["tokenizer"] == settings:
        return out_dir  # the fast path every training start takes
    if damage is not None:  # (whatever it held: what it was prepared from may be what meta.json lost)
        logger.warning("data.path: %s is damaged (%s); preparing it again from its inputs", out_dir, damage)
    elif out_dir.exists() and not old and any(out_dir.iterdir()):
        raise ConfigError(f"data.path: {str(out_dir)!r} exists and is not a dataset written by prepare_data.py; "
                         "point it at a new or empty directory")

    start = time.perf_counter()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private (0700); the dataset is meant to be shared like any directory
    try:
        tok = (Tokenizer.train_bpe(docs, vocab_size, data_hash) if tokenizer_kind == "bpe"
               else Tokenizer.plain_bytes(data_hash))
        tok.save(tmp / "tokenizer.json")
        num_tokens = _write_indexed_dataset(tmp / PREFIX, tok, docs)
        meta = {
            "format": FORMAT, "tokenizer": settings, "vocab_size": tok.vocab_size, "eod": tok.eod,
            "num_documents": len(docs), "num_tokens": num_tokens, "num_files": len(files),
            "data_hash": data_hash, "json_key": json_key, "sources": sources,
            "licence": STDLIB_LICENCE if default else "as given by the sources' owners",
            "python": sys.version.split()[0], "build_seconds": round(time.perf_counter() - start, 2),
            "sizes": {name: (tmp / name).stat().st_size for name in (f"{PREFIX}.bin", f"{PREFIX}.idx")},
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        _move_into_place(tmp, out_dir, data_hash, settings)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already unless something failed
    return out_dir


def _write_indexed_dataset(prefix: Path, tok: Tokenizer, docs: Sequence[str]) -> int:
    """One Megatron document per input document, each ending in EOD; returns the number of tokens."""
    with _quiet_megatron():
        from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

        builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=DType.optimal_dtype(tok.vocab_size))
        num_tokens = 0
        for ids in tok.encode_batch(docs):
            ids.append(tok.eod)  # GPTDataset never inserts EOD itself: without it documents run together
            builder.add_document(ids, [len(ids)])
            num_tokens += len(ids)
        builder.finalize(f"{prefix}.idx")
    return num_tokens


def _move_into_place(tmp: Path, out_dir: Path, data_hash: str, settings: dict) -> None:
    # Directories cannot be renamed over non-empty ones: move the old one aside first, then delete it (this also
    # drops its Megatron index cache). If another process got there first with the same data, keep theirs.
    aside = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
    try:
        if out_dir.exists():
            os.rename(out_dir, aside)
        os.rename(tmp, out_dir)
    except OSError:
        done, damage = _dataset_state(out_dir)
        if damage or not (done and done["data_hash"] == data_hash and done["tokenizer"] == settings):
            if aside.exists() and not out_dir.exists():
                os.rename(aside, out_dir)  # put the old dataset back rather than leave nothing
            raise
    shutil.rmtree(aside, ignore_errors=True)


def build_gpt_datasets(
    data_dir: str | os.PathLike,
    seq_length: int,
    seed: int,
    num_samples: Sequence[int | None],
    split: str = "98,1,1",
) -> tuple[Any, Any, Any]:
    """Megatron-Core GPTDatasets (train, valid, test) over a prepared ``data_dir``; a split may be None.

    ``num_samples`` is (train, valid, test) in sequences of ``seq_length``; None means one epoch of that split.
    Splits take contiguous runs of documents (Megatron's rule). Samples are packed across documents.
    """
    data_dir = Path(data_dir)
    meta = prepared_meta(data_dir)
    if len(num_samples) != 3:
        raise ValueError(f"num_samples: {tuple(num_samples)} must be (train, valid, test)")
    _check_split(split, int(meta["num_documents"]), num_samples)
    with _quiet_megatron():
        from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

        config = GPTDatasetConfig(
            random_seed=seed,
            sequence_length=seq_length,
            blend=([str(data_dir / PREFIX)], None),
            split=split,
            path_to_cache=str(data_dir / "cache"),  # replaced together with the dataset, never shared
            tokenizer=Tokenizer.load(data_dir / "tokenizer.json", meta["data_hash"]),  # (loads: prepared_meta)
            # Megatron asserts these three are set. Plain packed pretraining: documents attend across EOD and
            # positions run on, as in GPT-2; True would need per-sample masks and defeat Megatron's mask cache.
            reset_position_ids=False,
            reset_attention_mask=False,
            eod_mask_loss=False,
            create_attention_mask=False,  # the model builds the causal mask; a [1, s, s] per sample is waste
        )
        # lambda: True = "this rank builds the indices": fine without torch.distributed. Never compile_helpers():
        # the helpers ship compiled in the wheel, and that call exits the process.
        with _cache_lock(data_dir / "cache") as builder:
            if builder:
                _drop_damaged_index_cache(data_dir / "cache")
            train, valid, test = _damage_as_config_error(data_dir, BlendedMegatronDatasetBuilder(
                GPTDataset, list(num_samples), lambda: True, config).build, meta)
    return train, valid, test


def _damage_as_config_error(data_dir: Path, read: Callable[[], Any], meta: dict | None = None) -> Any:
    """``read()`` over a prepared dataset, whose failures on its own files (a corrupt corpus.idx of the right size:
    numpy's ValueError, or Megatron-Core's assertion on its header; a full disk under its index cache) are one
    ConfigError naming data.path. prepared_meta did not see that damage, so prepare_data.py would reuse the dataset:
    the advice adds --rebuild (``meta``: what the dataset was prepared from, for the command's settings)."""
    try:
        return read()
    except OSError as e:
        raise ConfigError(f"data.path: reading or caching {str(data_dir)!r} failed ({e.strerror or e}); free space "
                          f"or fix its permissions, or prepare it elsewhere (python scripts/prepare_data.py --out "
                          f"DIR, then data.path=DIR)") from None
    except (ValueError, struct.error, AssertionError) as e:
        if isinstance(e, AssertionError) and str(data_dir) not in str(e):  # (Megatron-Core's "bad header" names
            raise  # the file; any other assertion is not about the dataset's files)
        why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        _drop_half_built(e)
        raise ConfigError(f"data.path: {str(data_dir)!r} is damaged ({why}); prepare it again with "
                          f"{prepare_command(data_dir, meta, rebuild=True)}") from None


def _drop_half_built(e: BaseException) -> None:
    """Free what the failed read half-built, now and quietly: Megatron-Core's IndexedDataset.__del__ fails on an
    object its __init__ left unfinished, and would print 'Exception ignored' tracebacks at exit."""
    import gc

    hook, sys.unraisablehook = sys.unraisablehook, lambda unraisable: None
    try:
        e.__traceback__ = None
        gc.collect()
    finally:
        sys.unraisablehook = hook


@contextlib.contextmanager
def _cache_lock(cache_dir: Path) -> Iterator[bool]:
    """Runs that share a prepared dataset share its index cache, and Megatron-Core writes the cache files in place
    (no temporary name): a second run's builder that finds a file still being written reads a truncated one
    (``EOFError: No data left in file``). Within a run Megatron builds on rank 0 first and the other ranks read
    after a barrier, so rank 0 of each run (or a run without torch.distributed) holds an exclusive lock on the
    cache for its whole build; other ranks take none (they wait at that barrier, not here). Where ``fcntl`` does
    not exist (Windows) or the file system refuses locks, nothing is locked (with a warning for the latter).
    Yields whether this rank builds the cache (and may repair it)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not on Linux
        yield True
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        yield False
        return
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / ".lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        except OSError as e:  # a file system without locks (Lustre mounted without -o flock): build as before
            warnings.warn(f"data: no lock on {cache_dir} ({e.strerror}); runs that share this dataset should not "
                          "start at the same moment", stacklevel=2)
        yield True


def _drop_damaged_index_cache(cache_dir: Path) -> None:
    """Megatron-Core reuses its index files (``<hash>-GPTDataset-<split>-{document,sample,shuffle}_index.npy``)
    whenever they exist, and a truncated one ends in a reshape or EOF traceback. Each .npy's size is checked against
    its header; the files of a damaged set are removed (one warning line) so that the builder writes them again."""
    import numpy as np

    for path in sorted(cache_dir.glob("*.npy")) if cache_dir.is_dir() else []:
        if not path.exists():  # removed with a damaged file of its set
            continue
        try:
            with open(path, "rb") as f:
                version = np.lib.format.read_magic(f)
                read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
                    np.lib.format.read_array_header_2_0
                shape, _, dtype = read_header(f)
                expected = f.tell() + int(np.prod(shape)) * dtype.itemsize
            if path.stat().st_size == expected:
                continue
            damage = f"{path.stat().st_size:,} bytes of {expected:,}"
        except (OSError, ValueError, EOFError) as e:
            damage = str(e).splitlines()[0] if str(e) else type(e).__name__
        stem = path.name.split("-", 1)[0]  # the dataset description's hash: the set Megatron builds together
        for other in cache_dir.glob(f"{stem}-*"):
            other.unlink(missing_ok=True)
        logger.warning("data: Megatron's index cache %s is damaged (%s); rebuilding it", path, damage)


def _check_split(split: str, num_documents: int, num_samples: Sequence[int | None]) -> None:
    """A split that must yield samples needs at least one document: with none, Megatron-Core's GPTDataset
    loops forever looking for enough epochs. Documents are split as Megatron does (rounded cumulative shares)."""
    from megatron.core.datasets.blended_megatron_dataset_config import parse_and_normalize_split

    try:
        shares = parse_and_normalize_split(split)
    except Exception:  # noqa: BLE001 - Megatron asserts on malformed strings
        raise ConfigError(f"data.split: {split!r} is not three comma-separated weights, e.g. '98,1,1'") from None
    bounds = [0]
    for share in shares:
        bounds.append(bounds[-1] + int(round(share * float(num_documents))))
    bounds[1:] = [b - (bounds[-1] - num_documents) for b in bounds[1:]]
    for name, lo, hi, share, wanted in zip(("train", "valid", "test"), bounds, bounds[1:], shares, num_samples):
        if share == 0 and wanted:  # Megatron-Core builds no dataset for a split without a share
            raise ConfigError(f"data.split: {split!r} gives the {name} split no share, so it has none of the "
                             f"{wanted} samples asked for; give it one (e.g. '98,1,1')")
        if share > 0 and wanted != 0 and hi <= lo:  # (None = one epoch of the split: needs documents too)
            raise ConfigError(f"data.split: {split!r} gives the {name} split no document of the {num_documents} in "
                             f"this dataset; give it a larger share (e.g. '80,10,10') or add documents")


def _micro_batch_indices(n: int, micro_batch_size: int, seed: int, skip: int) -> Iterator[list[int]]:
    """The sample indices of :func:`batches`' micro-batches, endless (the stream without loading a sample)."""
    import torch

    if micro_batch_size < 1 or micro_batch_size > n:
        raise ValueError(f"micro_batch_size: {micro_batch_size} must be in 1..{n} (the dataset's sample count)")
    if skip < 0:
        raise ValueError(f"skip: {skip} must be >= 0")
    gen = torch.Generator().manual_seed(seed)
    per_epoch = n // micro_batch_size
    for _ in range(skip // per_epoch):  # whole epochs: advance the generator as they would have
        torch.randperm(n, generator=gen)
    first = (skip % per_epoch) * micro_batch_size
    while True:
        order = torch.randperm(n, generator=gen).tolist()
        for start in range(first, n - micro_batch_size + 1, micro_batch_size):
            yield order[start:start + micro_batch_size]
        first = 0


def _load_batch(dataset: Any, indices: list[int]) -> dict[str, Any]:
    import torch

    samples = [dataset[i] for i in indices]
    return {k: torch.stack([s[k] for s in samples]) for k in _BATCH_KEYS}


def batches(dataset: Any, micro_batch_size: int, seed: int, skip: int = 0) -> Iterator[dict[str, Any]]:
    """Endless micro-batches ``{tokens, labels, loss_mask, position_ids}``, each a [b, s] tensor.

    Each epoch visits the samples in a fresh permutation drawn from ``seed``, so the stream is the same on every
    run; the last partial batch of an epoch is dropped. ``skip``: start after that many micro-batches (a resumed
    run's data position), exactly where the full stream would be, without loading the skipped samples (only the
    skipped epochs' permutations are drawn). Plain indexing in this process: DataLoader workers were slower here
    (docs/facts.md).
    """
    for indices in _micro_batch_indices(len(dataset), micro_batch_size, seed, skip):
        yield _load_batch(dataset, indices)


def data_parallel_batches(dataset: Any, micro_batch_size: int, seed: int, dp_rank: int, dp_size: int,
                          skip: int = 0) -> Iterator[dict[str, Any]]:
    """Data-parallel rank ``dp_rank``'s share of one global stream: :func:`batches` (``seed``, the same on every
    rank) dealt out round robin, micro-batch i to rank i mod ``dp_size``; ``skip`` counts global micro-batches.
    A rank loads only its own samples.

    So a step's global batch (accumulation x ``dp_size`` consecutive micro-batches) holds the same samples at any
    data-parallel size with the same global and micro batch sizes: a checkpoint resumes exactly at another DP
    size (training/run.py: ``skip`` = samples consumed / micro_batch_size), and an epoch visits each sample once
    over all ranks (separate per-rank permutations would visit it once per rank).
    """
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank: {dp_rank} must be in 0..{dp_size - 1}")
    for i, indices in enumerate(_micro_batch_indices(len(dataset), micro_batch_size, seed, skip)):
        if i % dp_size == dp_rank:
            yield _load_batch(dataset, indices)


class FixedBatches(Sequence):
    """Micro-batches read again at every pass (validation evaluates the same ones each time): only their sample
    indices are held, and each batch is loaded from the dataset's memory-mapped files when it is read. A list of
    loaded batches grew with their number (~56 kB a micro-batch of 16 x 128 tokens: trainer.eval_iters=100000 took
    more than 5 GB before the first step)."""

    def __init__(self, dataset: Any, indices: list[list[int]]) -> None:
        self.dataset, self.indices = dataset, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> dict[str, Any]:  # (an index: what iterating a Sequence asks for)
        return _load_batch(self.dataset, self.indices[i])


def fixed_batches(dataset: Any, micro_batch_size: int, seed: int, count: int, dp_rank: int = 0,
                  dp_size: int = 1) -> FixedBatches:
    """Rank ``dp_rank``'s share of the first ``count`` micro-batches of :func:`batches`' stream, dealt out round
    robin as :func:`data_parallel_batches` deals it, loaded when read."""
    stream = _micro_batch_indices(len(dataset), micro_batch_size, seed, 0) if count else iter(())
    return FixedBatches(dataset, [idx for i, idx in zip(range(count), stream) if i % dp_size == dp_rank])


def split_samples(dataset: Any) -> int:
    """The samples one pass over a GPTDataset's split holds: Megatron-Core repeats the split (in epochs, each
    shuffled) until it holds the samples asked for, so ``len(dataset)`` says how many were asked for, not this."""
    tokens = int(dataset.dataset.sequence_lengths[dataset.indices].sum())
    return (tokens - int(dataset.config.add_extra_token_to_sequence)) // int(dataset.config.sequence_length)


def repeated_batch(batch_size: int, seq: int, vocab: int, seed: int = 0) -> Iterator[dict[str, Any]]:
    """One random batch (same keys and shapes as :func:`batches`) forever: a model can memorise it, so a smoke test
    or a throughput check needs no dataset and its loss must fall."""
    import torch

    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, vocab, (batch_size, seq + 1), generator=g)
    batch = dict(tokens=t[:, :-1], labels=t[:, 1:], loss_mask=torch.ones(batch_size, seq),
                 position_ids=torch.arange(seq).expand(batch_size, seq))
    while True:
        yield batch
