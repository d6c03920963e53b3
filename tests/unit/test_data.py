"""The data pipeline on the CPU: corpus, tokenizers, Megatron-Core indexed dataset, GPT samples, batches, errors."""

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from fp8_recipes.megatron.data import (
    Tokenizer,
    batches,
    build_gpt_datasets,
    default_corpus_files,
    prepare_dataset,
)

ROOT = Path(__file__).resolve().parents[2]
DOCS = [
    "def add(a, b):\n    return a + b\n" * 3,
    "Unicode survives: héllo wörld ☃ — tabs\tand\nnewlines\n" * 2,
    "class Point:\n    def __init__(self, x, y):\n        self.x, self.y = x, y\n",
    "plain text document number four, a little longer than the others " * 4,
]


def write_corpus(dir: Path, docs=DOCS, key="text") -> list[Path]:
    """docs[:-1] as .jsonl lines, the last as a .txt file: both input kinds in one corpus."""
    dir.mkdir(parents=True, exist_ok=True)
    jsonl = dir / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({key: d, "id": i}) + "\n" for i, d in enumerate(docs[:-1])) + "\n")
    txt = dir / "z_last.txt"
    txt.write_text(docs[-1])
    return [jsonl, txt]


def read_indexed(out: Path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    with warnings.catch_warnings():  # without torch.distributed Megatron warns that it assumes rank 0
        warnings.filterwarnings("ignore", message="Could not determine rank")
        return IndexedDataset(str(out / "corpus"))


def test_default_corpus_is_deterministic_stdlib_code_without_tests():
    files = default_corpus_files()
    assert files == default_corpus_files()
    assert len(files) > 300 and all(f.suffix == ".py" for f in files)
    parts = {p for f in files for p in f.parts}
    assert not parts & {"test", "tests", "idle_test", "site-packages"}
    assert any(f.name == "json" or f.parent.name == "json" for f in files)  # real stdlib packages are in


def test_bpe_round_trips_and_two_trainings_are_identical():
    a = Tokenizer.train_bpe(DOCS * 5, vocab_size=300)
    b = Tokenizer.train_bpe(DOCS * 5, vocab_size=300)
    assert a.unique_identifiers == b.unique_identifiers  # includes a sha256 of the serialized tokenizer
    text = "unseen bytes too: ünïcödé ∑ 🙂\r\n\tdef f(): pass"
    ids = a.encode(text)
    assert ids == b.encode(text) and a.decode(ids) == text
    assert a.eod == 0 and a.eod not in ids and a.vocab_size <= 300


def test_bytes_tokenizer_has_vocab_257():
    tok = Tokenizer.plain_bytes()
    assert (tok.vocab_size, tok.eod) == (257, 256)
    assert tok.encode("é") == [0xC3, 0xA9] and tok.decode(tok.encode("x ☃")) == "x ☃"


def test_tokenizer_save_load(tmp_path):
    tok = Tokenizer.train_bpe(DOCS, vocab_size=280, data_hash="abc")
    tok.save(tmp_path / "t.json")
    back = Tokenizer.load(tmp_path / "t.json", data_hash="abc")
    assert back.unique_identifiers == tok.unique_identifiers and back.encode(DOCS[1]) == tok.encode(DOCS[1])


@pytest.mark.parametrize("kind", ["bpe", "bytes"])
def test_prepare_dataset_writes_megatron_dataset_with_eod_after_each_document(tmp_path, kind):
    out = prepare_dataset(write_corpus(tmp_path / "src"), tmp_path / "ds", kind, vocab_size=300)
    meta = json.loads((out / "meta.json").read_text())
    tok = Tokenizer.load(out / "tokenizer.json")
    ds = read_indexed(out)
    assert len(ds) == meta["num_documents"] == len(DOCS)
    assert sum(len(ds[i]) for i in range(len(ds))) == meta["num_tokens"]
    for i, doc in enumerate(DOCS):  # order kept, text exact, one EOD at each end
        assert ds[i][-1] == tok.eod == meta["eod"] and tok.eod not in ds[i][:-1]
        assert tok.decode(ds[i][:-1]) == doc
    assert meta["vocab_size"] == tok.vocab_size and meta["tokenizer"]["kind"] == kind
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left behind


def test_directory_and_json_key_inputs(tmp_path):
    write_corpus(tmp_path / "src", key="content")
    out = prepare_dataset([tmp_path / "src"], tmp_path / "ds", "bytes", json_key="content")
    assert json.loads((out / "meta.json").read_text())["num_documents"] == len(DOCS)
    with pytest.raises(ValueError, match=r"^data\.json_key: no text under 'text'"):
        prepare_dataset([tmp_path / "src"], tmp_path / "ds2", "bytes")


def test_same_data_is_reused_and_new_data_rebuilds(tmp_path):
    src = write_corpus(tmp_path / "src")
    out = prepare_dataset(src, tmp_path / "ds", "bytes")
    inode = (out / "corpus.bin").stat().st_ino
    assert prepare_dataset(src, tmp_path / "ds", "bytes") == out
    assert (out / "corpus.bin").stat().st_ino == inode  # fast path: nothing rewritten
    prepare_dataset(write_corpus(tmp_path / "src2", DOCS[::-1]), out, "bytes")
    assert (out / "corpus.bin").stat().st_ino != inode


def test_rebuilt_data_never_reuses_stale_megatron_index_cache(tmp_path):
    """docs/facts.md: Megatron's cache key ignores the data; a same-prefix rebuild would silently reuse old indices."""
    out = tmp_path / "ds"
    prepare_dataset(write_corpus(tmp_path / "a", [d[:20] for d in DOCS]), out, "bytes")
    small = build_gpt_datasets(out, seq_length=8, seed=1, num_samples=(None, None, None), split="2,1,1")[0]
    stale = {p.name: p.read_bytes() for p in (out / "cache").iterdir()}
    hash_a = json.loads((out / "meta.json").read_text())["data_hash"]

    prepare_dataset(write_corpus(tmp_path / "b", [d * 10 for d in DOCS]), out, "bytes")
    assert json.loads((out / "meta.json").read_text())["data_hash"] != hash_a
    (out / "cache").mkdir(exist_ok=True)  # even if the old cache survived the rebuild ...
    for name, data in stale.items():
        (out / "cache" / name).write_bytes(data)
    big = build_gpt_datasets(out, seq_length=8, seed=1, num_samples=(None, None, None), split="2,1,1")[0]
    assert big.unique_description_hash != small.unique_description_hash  # ... it is not looked up
    assert len(big) > 5 * len(small)  # one epoch of the new, 10x larger data, not the old index


def test_gpt_samples_and_batches(tmp_path):
    out = prepare_dataset(write_corpus(tmp_path / "src", DOCS * 3), tmp_path / "ds", "bpe", vocab_size=300)
    train, valid, test = build_gpt_datasets(out, seq_length=16, seed=7, num_samples=(40, 4, 4), split="6,3,3")
    assert len(train) >= 40 and valid is not None and test is not None
    sample = train[0]
    assert sample["tokens"].shape == sample["labels"].shape == (16,)
    assert torch.equal(sample["tokens"][1:], sample["labels"][:-1])  # drawn as seq_length + 1 tokens
    stream, again = batches(train, 4, seed=3), batches(train, 4, seed=3)
    for _ in range(len(train) // 4 + 3):  # past the end of an epoch: it cycles
        b, b2 = next(stream), next(again)
        assert sorted(b) == ["labels", "loss_mask", "position_ids", "tokens"]
        assert all(v.shape == (4, 16) for v in b.values())
        assert all(torch.equal(b[k], b2[k]) for k in b)  # same seed, same stream
    assert b["tokens"].dtype == torch.int64 and int(b["tokens"].max()) < 300


def test_fixed_batches_are_the_streams_first_ones_loaded_when_read(tmp_path):
    """Validation's batches (the same at every evaluation): rank r's share of the stream's first micro-batches, as
    data_parallel_batches deals them, held as sample indices (a list of loaded batches grew without bound with
    trainer.eval_iters). split_samples is one pass over the split, however many samples the dataset was built for."""
    from fp8_recipes.megatron.data import FixedBatches, data_parallel_batches, fixed_batches, split_samples

    out = prepare_dataset(write_corpus(tmp_path / "src", DOCS * 3), tmp_path / "ds", "bytes")
    _, one_pass, _ = build_gpt_datasets(out, seq_length=16, seed=7, num_samples=(1, None, None), split="6,3,3")
    _, repeated, _ = build_gpt_datasets(out, seq_length=16, seed=7, num_samples=(1, 10 * len(one_pass), None),
                                        split="6,3,3")
    assert split_samples(one_pass) == split_samples(repeated) == len(one_pass) and len(repeated) >= 10 * len(one_pass)
    for rank in (0, 1):
        fixed = fixed_batches(repeated, 4, 11, 7, rank, 2)
        assert isinstance(fixed, FixedBatches) and len(fixed) == (4 if rank == 0 else 3)
        assert not any(isinstance(v, torch.Tensor) for v in vars(fixed).values())  # indices only
        stream = data_parallel_batches(repeated, 4, 11, rank, 2)
        for got, want in zip(list(fixed) * 2, [next(stream) for _ in range(len(fixed))] * 2):  # (read twice)
            assert all(torch.equal(got[k], want[k]) for k in want)
    assert len(fixed_batches(None, 4, 11, 0)) == 0  # no validation: nothing to deal


@pytest.mark.parametrize(
    "call, key",
    [
        (lambda tmp: prepare_dataset(["no/such.jsonl"], tmp / "ds"), "data.inputs: path 'no/such.jsonl' does not"),
        (lambda tmp: prepare_dataset(None, tmp / "ds", "wordpiece"), "data.tokenizer: 'wordpiece'"),
        (lambda tmp: build_gpt_datasets(tmp / "none", 8, 1, (1, 1, 1)), "data.path: "),
    ],
)
def test_user_errors_are_one_line_value_errors_naming_the_key(tmp_path, call, key):
    with pytest.raises(ValueError) as err:
        call(tmp_path)
    assert str(err.value).startswith(key) and "\n" not in str(err.value)


def test_build_gpt_datasets_error_says_how_to_fix(tmp_path):
    with pytest.raises(ValueError, match="run `python scripts/prepare_data.py --out"):
        build_gpt_datasets(tmp_path / "missing", 8, 1, (1, 1, 1))


def test_refuses_to_replace_a_directory_that_is_not_a_dataset(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "precious.txt").write_text("keep me")
    with pytest.raises(ValueError, match="^data.path: .* is not a dataset"):
        prepare_dataset(write_corpus(tmp_path / "src"), tmp_path / "mine", "bytes")
    assert (tmp_path / "mine" / "precious.txt").read_text() == "keep me"


def test_script_bad_path_exits_2_with_one_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "plugins"), os.environ.get("PYTHONPATH", "")])}
    (tmp_path / "file").write_text("not a directory\n")
    for args, says in ((["--inputs", str(tmp_path / "nope"), "--out", str(tmp_path / "ds")], "data.inputs: path"),
                       (["--tokenizer", "bytes", "--out", str(tmp_path / "file")], "error: --out: ")):
        proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "prepare_data.py"), *args],
                              capture_output=True, text=True, env=env, timeout=60)
        assert proc.returncode == 2 and proc.stdout == ""
        assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr and proc.stderr.startswith("error: ")
        assert says in proc.stderr, proc.stderr
    assert not (tmp_path / "ds").exists()


def test_runs_sharing_a_dataset_build_its_index_cache_one_at_a_time(tmp_path):
    """Megatron-Core writes its index cache in place: a second run on the same prepared dataset that read a file
    still being written got a truncated one (seen as `EOFError: No data left in file` in two Slurm jobs at once).
    A run builds under an exclusive lock on the cache: while another process holds it, a build waits."""
    import fcntl
    import time

    out = prepare_dataset(write_corpus(tmp_path / "src", DOCS * 3), tmp_path / "ds", "bytes")
    code = (f"import sys; sys.path.insert(0, {str(ROOT / 'plugins')!r}); "
            "from fp8_recipes.megatron.data import build_gpt_datasets; "
            "import megatron.core.datasets.blended_megatron_dataset_builder, megatron.core.datasets.gpt_dataset; "
            "print('ready', flush=True); "
            f"build_gpt_datasets({str(out)!r}, seq_length=16, seed=7, num_samples=(40, 4, 4), split='6,3,3'); "
            "print('built')")
    (out / "cache").mkdir(exist_ok=True)
    with open(out / "cache" / ".lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another run building
        other = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True)
        assert other.stdout.readline().strip() == "ready"  # Megatron imported: the build is next
        time.sleep(3)  # unlocked, a build of this size takes ~10 ms
        assert other.poll() is None  # waiting for the lock, nothing read or written yet
        assert not list((out / "cache").glob("**/*.npy"))
    stdout, stderr = other.communicate(timeout=120)  # lock released: it builds
    assert other.returncode == 0 and "built" in stdout, stderr[-2000:]
    assert list((out / "cache").glob("**/*.npy"))


def test_a_file_system_without_locks_builds_with_a_warning(tmp_path, monkeypatch):
    import fcntl

    def refuse(fd, op):
        raise OSError(38, "Function not implemented")

    out = prepare_dataset(write_corpus(tmp_path / "src", DOCS * 3), tmp_path / "ds", "bytes")
    monkeypatch.setattr(fcntl, "flock", refuse)
    with pytest.warns(UserWarning, match="no lock on .*Function not implemented"):
        train, _, _ = build_gpt_datasets(out, seq_length=16, seed=7, num_samples=(40, 4, 4), split="6,3,3")
    assert len(train) >= 40


def test_truncated_corpus_is_named_and_prepared_again(tmp_path, caplog):
    """Issue 19: a truncated corpus.bin/.idx is one line naming data.path; prepare_dataset (every training start)
    sees the damage against meta.json's sizes and prepares the dataset again."""
    src = write_corpus(tmp_path / "src")
    out = prepare_dataset(src, tmp_path / "ds", "bytes")
    assert set(json.loads((out / "meta.json").read_text())["sizes"]) == {"corpus.bin", "corpus.idx"}
    for name in ("corpus.bin", "corpus.idx"):
        good = (out / name).read_bytes()
        (out / name).write_bytes(good[: len(good) // 2])
        with pytest.raises(ValueError) as e:
            build_gpt_datasets(out, 8, 1, (None, None, None), split="2,1,1")
        assert str(e.value).startswith(f"data.path: '{out}' is damaged ({name} has ") and "\n" not in str(e.value)
        assert "scripts/prepare_data.py" in str(e.value)
        with caplog.at_level("WARNING"):
            prepare_dataset(src, out, "bytes")
        assert f"data.path: {out} is damaged ({name} has" in caplog.text
        assert (out / name).read_bytes() == good
        build_gpt_datasets(out, 8, 1, (None, None, None), split="2,1,1")


def test_damaged_megatron_index_cache_is_rebuilt(tmp_path, caplog):
    """Issue 19: a truncated index .npy in Megatron-Core's cache is removed with one warning and built again."""
    out = prepare_dataset(write_corpus(tmp_path / "src", DOCS * 3), tmp_path / "ds", "bytes")
    first = build_gpt_datasets(out, seq_length=8, seed=1, num_samples=(None, None, None), split="2,1,1")[0]
    cached = {p.name: p.read_bytes() for p in (out / "cache").glob("*.npy")}
    damaged = min((out / "cache").glob("*-sample_index.npy"))
    damaged.write_bytes(cached[damaged.name][:-7])
    with caplog.at_level("WARNING"):
        again = build_gpt_datasets(out, seq_length=8, seed=1, num_samples=(None, None, None), split="2,1,1")[0]
    warned = [r for r in caplog.records if "index cache" in r.getMessage()]
    assert len(warned) == 1 and "rebuilding it" in warned[0].getMessage()
    assert {p.name: p.read_bytes() for p in (out / "cache").glob("*.npy")} == cached
    assert len(again) == len(first) and torch.equal(again[0]["tokens"], first[0]["tokens"])


def test_a_damaged_prepared_dataset_is_one_config_error(tmp_path, capsys):
    """What Megatron-Core or the tokenizer raise on a prepared dataset's own files (a corrupt corpus.idx of the
    right size, a garbled tokenizer.json, a full disk under the index cache) names data.path, not a traceback;
    a half-built object's failing __del__ prints nothing."""
    import json as json_

    from fp8_recipes.checks import ConfigError
    from fp8_recipes.megatron.data import _damage_as_config_error

    class HalfBuilt:
        def __init__(self):
            raise ValueError("buffer is smaller than requested size")

        def __del__(self):
            del self.index  # (Megatron-Core's IndexedDataset.__del__ on an unfinished object)

    for read, says in ((HalfBuilt, "is damaged (ValueError: buffer is smaller"),
                       (lambda: json_.loads("xx"), "is damaged (JSONDecodeError: "),
                       (lambda: (_ for _ in ()).throw(OSError(28, "No space left on device")),
                        "reading or caching '" + str(tmp_path) + "' failed (No space left on device)")):
        with pytest.raises(ConfigError) as e:
            _damage_as_config_error(tmp_path, read)
        assert str(e.value).startswith("data.path: ") and says in str(e.value) and "\n" not in str(e.value)
    assert "Exception ignored" not in capsys.readouterr().err


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:40])


DATASET_DAMAGE = {  # what was done to a prepared dataset, what the error line says of it
    "meta.json of wrong types": (lambda d: (d / "meta.json").write_text('{"format": 1, "vocab_size": "big"}'),
                                 "meta.json has no 'data_hash' of type str"),
    "meta.json not JSON": (lambda d: (d / "meta.json").write_text("{not json"), "meta.json cannot be read"),
    "meta.json a list": (lambda d: (d / "meta.json").write_text("[1]"), "meta.json is not a JSON object"),
    "tokenizer.json truncated": (lambda d: _truncate(d / "tokenizer.json"), "tokenizer.json does not load: "),
    "tokenizer.json missing": (lambda d: (d / "tokenizer.json").unlink(), "tokenizer.json is missing"),
    "corpus.idx header": (lambda d: (d / "corpus.idx").write_bytes(b"X" * 9 + (d / "corpus.idx").read_bytes()[9:]),
                          "AssertionError: bad header"),
}


@pytest.mark.parametrize("case", DATASET_DAMAGE)
def test_the_advice_for_a_damaged_dataset_prepares_it_again(case, tmp_path, caplog):
    """A damaged meta.json (a KeyError inside prepare_dataset: an internal error of the training start) or
    tokenizer.json (reused by prepare_data.py, whose advised run then changed nothing) is one data.path line whose
    command, run as given, prepares the dataset again from what it was made of; a training start's prepare_dataset
    does that itself, with one warning."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "plugins"), os.environ.get("PYTHONPATH", "")])}
    src = write_corpus(tmp_path / "src", DOCS * 3)
    out = prepare_dataset(src, tmp_path / "ds", "bpe", vocab_size=300)
    good = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    damage, says = DATASET_DAMAGE[case]
    for repair in ("advice", "training start"):
        damage(out)
        with pytest.raises(ValueError) as e:
            build_gpt_datasets(out, 16, 7, (4, 4, 4), split="6,3,3")
        line = str(e.value)
        assert line.startswith(f"data.path: '{out}' is damaged (") and says in line and "\n" not in line, line
        if repair == "advice":
            command = line.split("`")[1]
            if "with the --inputs and --tokenizer it was prepared from" in line:  # (meta.json no longer says them)
                command += f" --inputs {' '.join(map(str, src))} --vocab-size 300"
            args = command.split()
            assert args[:2] == ["python", "scripts/prepare_data.py"] and ("--rebuild" in args) == ("header" in case)
            proc = subprocess.run([sys.executable, *args[1:]], cwd=ROOT, env=env, capture_output=True, text=True,
                                  timeout=120)
            assert proc.returncode == 0, proc.stderr[-2000:]
        else:
            with caplog.at_level("WARNING"):
                prepare_dataset(src, out, "bpe", vocab_size=300)
            assert caplog.text.count(f"data.path: {out} is damaged (") == 1 or "header" in case, caplog.text
            if "header" in case:  # (seen only by reading: the training start's read names it, with --rebuild)
                prepare_dataset(src, out, "bpe", vocab_size=300, rebuild=True)
        assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != "meta.json"} == \
            {k: v for k, v in good.items() if k != "meta.json"}  # the same dataset again (build_seconds differ)
        build_gpt_datasets(out, 16, 7, (4, 4, 4), split="6,3,3")
