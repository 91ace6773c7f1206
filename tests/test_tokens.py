"""Token store and `ppgd-tpu tokenize`: round trips through real files, and refusals."""

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import bpe_tokenizer
from ppgd_tpu import cli
from ppgd_tpu.data import tokens
from ppgd_tpu.data.tokenize import BYTE_EOS, ByteTokenizer, HFTokenizer, expand_inputs, stdlib_glob
from ppgd_tpu.data.tokens import IncompleteStoreError, TokenStore, TokenStoreWriter

DOCS = ["def f(x):\n    return x + 1\n", "naïve café — ünïcödé ✓\n", "", "x" * 700,
        "# last document\nprint('done')\n"]



def main(argv: list[str]) -> int:
    """`ppgd-tpu tokenize ARGV`: its exit status; a refusal's message on stderr."""
    return cli.run(["tokenize", *argv])

def _write_docs(tmp_path, docs=DOCS):
    d = tmp_path / "corpus"
    d.mkdir()
    for i, text in enumerate(docs):  # names sort in document order
        (d / f"doc{i:02d}.txt").write_text(text, encoding="utf-8")
    return str(d / "*.txt")


def _all_ids(store):
    return store.read_rows(np.arange(store.n_rows)).reshape(-1)


def test_byte_tokenizer_round_trip(tmp_path):
    out = str(tmp_path / "store")
    assert main(["--input", _write_docs(tmp_path), "--output", out, "--seq_len", "64"]) == 0
    store = TokenStore.open(out)
    packed = b"".join(t.encode() + bytes([0]) for t in DOCS if t)  # 0 marks the EOS slot
    expect = np.frombuffer(packed, np.uint8).astype(np.int64)
    expect[np.cumsum([len(t.encode()) + 1 for t in DOCS if t]) - 1] = BYTE_EOS
    n_rows = len(expect) // 64
    assert (store.n_rows, store.seq_len, store.eos_id) == (n_rows, 64, BYTE_EOS)
    assert store.meta["dropped_tokens"] == len(expect) - n_rows * 64 > 0
    assert store.array.dtype.numpy_dtype == np.uint16
    ids = _all_ids(store)
    np.testing.assert_array_equal(ids, expect[:n_rows * 64])
    # decode: split at EOS, every whole document comes back as its text
    pieces = np.split(ids, np.flatnonzero(ids == BYTE_EOS) + 1)
    decoded = [ByteTokenizer().decode(p[:-1]) for p in pieces[:-1]]
    assert decoded == [t for t in DOCS if t][:len(decoded)] and len(decoded) == 3


def test_hf_tokenizer_json_round_trip(tmp_path):
    from tokenizers import Tokenizer

    path = bpe_tokenizer(str(tmp_path / "tokenizer.json"), DOCS * 20, vocab_size=400)
    tok = Tokenizer.from_file(path)
    out = str(tmp_path / "store")
    assert main(["--input", _write_docs(tmp_path), "--output", out, "--seq_len", "4",
                 "--tokenizer", path]) == 0
    store = TokenStore.open(out)
    eos = tok.token_to_id("<|endoftext|>")
    assert (store.eos_id, store.vocab_size) == (eos, tok.get_vocab_size())
    assert store.meta["tokenizer"] == path
    ids = _all_ids(store)
    pieces = np.split(ids, np.flatnonzero(ids == eos) + 1)
    hf = HFTokenizer(path)
    decoded = [hf.decode(p[:-1]) for p in pieces[:-1]]
    assert decoded == [t for t in DOCS if t][:len(decoded)] and len(decoded) >= 3


def _write_parquet(path, docs, column="input_ids"):
    pq.write_table(pa.table({column: pa.array(docs, pa.list_(pa.int64()))}), path)


def test_parquet_input_ids_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 70_000, n).tolist() for n in (5, 0, 40, 17, 33, 9)]
    _write_parquet(tmp_path / "a.parquet", docs[:3])
    _write_parquet(tmp_path / "b.parquet", docs[3:])
    out = str(tmp_path / "store")
    assert main(["--input", str(tmp_path / "*.parquet"), "--output", out,
                 "--seq_len", "8"]) == 0
    store = TokenStore.open(out)
    flat = np.concatenate([np.asarray(d, np.int64) for d in docs])
    assert store.vocab_size == flat.max() + 1 and store.eos_id is None
    assert store.array.dtype.numpy_dtype == np.uint32  # > 65536 ids
    assert store.n_rows == len(flat) // 8
    np.testing.assert_array_equal(_all_ids(store), flat[:store.n_rows * 8])
    # with a separator and an explicit vocabulary
    out2 = str(tmp_path / "store2")
    assert main(["--input", str(tmp_path / "*.parquet"), "--output", out2, "--seq_len", "8",
                 "--eos_id", "0", "--vocab_size", "70000"]) == 0
    with_eos = np.concatenate([np.append(d, 0) for d in docs if d])
    store2 = TokenStore.open(out2)
    assert store2.vocab_size == 70_000 and store2.meta["n_documents"] == 5
    np.testing.assert_array_equal(_all_ids(store2), with_eos[:store2.n_rows * 8])


def test_parquet_refusals(tmp_path, capsys):
    _write_parquet(tmp_path / "bad.parquet", [[1, 2, 3]], column="tokens")
    assert main(["--input", str(tmp_path / "bad.parquet"), "--output",
                 str(tmp_path / "s"), "--seq_len", "2"]) == 2
    assert "`input_ids` column" in capsys.readouterr().err
    _write_parquet(tmp_path / "big.parquet", [list(range(100))])
    assert main(["--input", str(tmp_path / "big.parquet"), "--output",
                 str(tmp_path / "s"), "--seq_len", "2", "--vocab_size", "50"]) == 2
    assert "outside the vocabulary [0, 50)" in capsys.readouterr().err
    # flags parquet input cannot honour: used to be overridden or ignored, exit 0
    _write_parquet(tmp_path / "ok.parquet", [list(range(10))])
    assert main(["--input", str(tmp_path / "ok.parquet"), "--output", str(tmp_path / "s"),
                 "--seq_len", "2", "--vocab_size", "10", "--eos_id", "20"]) == 2
    assert "--eos_id 20: not an id of --vocab_size 10 (0..9)" in capsys.readouterr().err
    assert main(["--input", str(tmp_path / "ok.parquet"), "--output", str(tmp_path / "s"),
                 "--seq_len", "2", "--tokenizer", str(tmp_path / "tok.json")]) == 2
    assert "--tokenizer applies to text input only" in capsys.readouterr().err
    ok = ["--input", str(tmp_path / "ok.parquet"), "--output", str(tmp_path / "s")]
    for flags, needle in [  # each named the wrong flag, or none
            (["--seq_len", "2", "--vocab_size", "0"], "--vocab_size must be >= 1, got 0"),
            (["--seq_len", "2", "--eos_id", "-1"], "--eos_id must be a token id (>= 0), got -1"),
            (["--seq_len", str(10**12)], "--seq_len must be 2..16777216"),  # was a MemoryError
            (["--seq_len", "8", "--max_tokens", "5"], "or raise --max_tokens (5)")]:
        assert main([*ok, *flags]) == 2, flags
        assert needle in capsys.readouterr().err, flags
    _write_parquet(tmp_path / "neg.parquet", [[1, -3, 2]])
    assert main(["--input", str(tmp_path / "neg.parquet"), "--output", str(tmp_path / "s"),
                 "--seq_len", "2"]) == 2
    assert "token id -3 is negative" in capsys.readouterr().err  # said: set --vocab_size
    with pytest.raises(IncompleteStoreError):
        TokenStore.open(str(tmp_path / "s"))


def test_empty_input_refused(tmp_path, capsys):
    out = str(tmp_path / "store")
    assert main(["--input", str(tmp_path / "nothing/*.txt"), "--output", out,
                 "--seq_len", "8"]) == 2
    assert "matches no files" in capsys.readouterr().err
    assert main(["--input", str(tmp_path), "--output", out, "--seq_len", "8"]) == 2
    assert f"give a glob: '{tmp_path}/*'" in capsys.readouterr().err
    (tmp_path / "empty.txt").write_text("")
    assert main(["--input", str(tmp_path / "*.txt"), "--output", out, "--seq_len", "8"]) == 2
    assert "hold no tokens" in capsys.readouterr().err
    with pytest.raises(IncompleteStoreError, match="no token store"):
        TokenStore.open(out)


def test_seq_len_the_store_cannot_hold_refused(tmp_path, capsys):
    glob_ = _write_docs(tmp_path)
    out = str(tmp_path / "store")
    assert main(["--input", glob_, "--output", out, "--seq_len", "1"]) == 2
    assert "--seq_len must be 2.." in capsys.readouterr().err
    total = sum(len(t.encode()) + 1 for t in DOCS if t)
    assert main(["--input", glob_, "--output", out, "--seq_len", str(total + 1)]) == 2
    err = capsys.readouterr().err
    assert f"has {total} tokens, fewer than one row of --seq_len {total + 1}" in err
    with pytest.raises(IncompleteStoreError, match="no token store"):
        TokenStore.open(out)  # nothing was written
    assert main(["--input", glob_, "--output", out, "--seq_len", str(total)]) == 0
    assert TokenStore.open(out).n_rows == 1  # exactly one row fits
    with pytest.raises(ValueError, match="does not fit the token store"):
        tokens.token_dtype(2**32 + 1)


def test_incomplete_store_refused_and_a_rewrite_keeps_the_store_until_it_ends(tmp_path,
                                                                              monkeypatch):
    out = str(tmp_path / "store")
    monkeypatch.setattr(tokens, "SHARD_BYTES", 4 * 32 * 2)  # 4 rows a shard: written early
    # a first write that dies after its first shard leaves an incomplete store, refused
    first = TokenStoreWriter(out, seq_len=32, vocab_size=300, eos_id=256, info={})
    first.add_document(np.arange(200))
    assert first.n_rows == 4  # one shard reached storage
    with pytest.raises(IncompleteStoreError, match=f"incomplete token store at {out}: re-run"):
        TokenStore.open(out)
    assert main(["--input", _write_docs(tmp_path), "--output", out, "--seq_len", "32"]) == 0
    before = _all_ids(TokenStore.open(out))
    # a rewrite that dies after its first shard leaves the store as it was (it was made
    # incomplete: a failed rewrite lost the store it was replacing)
    writer = TokenStoreWriter(out, seq_len=32, vocab_size=300, eos_id=256, info={})
    writer.add_document(np.arange(200))
    assert writer.n_rows == 4 and writer.array_dir == tokens.ARRAY_DIRS[1]
    np.testing.assert_array_equal(_all_ids(TokenStore.open(out)), before)
    # the same writer, finished, is a complete store of its own rows, the old rows gone
    meta = writer.finish()
    store = TokenStore.open(out)
    assert meta["n_rows"] == store.n_rows == 201 // 32
    np.testing.assert_array_equal(_all_ids(store),
                                  np.append(np.arange(200), 256)[:store.n_rows * 32])
    assert sorted(os.listdir(out)) == [tokens.LOCK_FILE, "COMPLETE", "meta.json",
                                       tokens.ARRAY_DIRS[1]]
    # a deleted marker is refused as well
    (tmp_path / "store" / tokens.MARKER_FILE).unlink()
    with pytest.raises(IncompleteStoreError, match="incomplete token store"):
        TokenStore.open(out)


def test_a_rewrite_that_fails_leaves_the_store_it_was_replacing(tmp_path, monkeypatch,
                                                                 capsys):
    """`tokenize` again at a store's path, with a bad id in its last file: refused (exit 2)
    after shards of new rows were written, and the store reads as before (it was lost: the
    rewrite had made it incomplete). The next rewrite that ends replaces it and leaves one
    array."""
    monkeypatch.setattr(tokens, "SHARD_BYTES", 4 * 8 * 2)  # 4 rows a shard
    _write_parquet(tmp_path / "a.parquet", [list(range(i, i + 50)) for i in range(20)])
    out = str(tmp_path / "store")
    args = ["--output", out, "--seq_len", "8", "--vocab_size", "100"]
    assert main(["--input", str(tmp_path / "a.parquet"), *args]) == 0
    before = TokenStore.open(out)
    ids = _all_ids(before)
    _write_parquet(tmp_path / "b.parquet", [list(range(60))] * 20)
    _write_parquet(tmp_path / "z.parquet", [[1, -3]])  # read last
    assert main(["--input", str(tmp_path / "*.parquet"), *args]) == 2
    assert "token id -3 is negative" in capsys.readouterr().err
    assert len(os.listdir(os.path.join(out, tokens.ARRAY_DIRS[1], "c"))) > 1  # shards written
    after = TokenStore.open(out)
    assert after.store_id == before.store_id
    np.testing.assert_array_equal(_all_ids(after), ids)
    os.remove(tmp_path / "z.parquet")
    assert main(["--input", str(tmp_path / "*.parquet"), *args]) == 0
    assert TokenStore.open(out).n_rows > before.n_rows
    assert sorted(os.listdir(out)) == [tokens.LOCK_FILE, "COMPLETE", "meta.json",
                                       tokens.ARRAY_DIRS[1]]


def test_short_rows_make_a_small_store(tmp_path):
    """A shard's index has a slot per row it could hold: capped at SHARD_ROWS rows, a tiny
    corpus at --seq_len 2 is a small store (uncapped: 8M slots, 129 MB)."""
    out = tmp_path / "store"
    assert main(["--input", _write_docs(tmp_path), "--output", str(out), "--seq_len", "2"]) == 0
    store = TokenStore.open(str(out))
    assert store.rows_per_shard == tokens.SHARD_ROWS
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    assert size < 16 * tokens.SHARD_ROWS + 2**16, size  # one shard: its index and the rest


def test_read_rows_any_order_with_repeats(tmp_path, monkeypatch):
    monkeypatch.setattr(tokens, "SHARD_BYTES", 3 * 8 * 2)  # 3 rows per shard: many shards
    out = str(tmp_path / "store")
    writer = TokenStoreWriter(out, seq_len=8, vocab_size=1000, eos_id=None, info={})
    writer.add_document(np.arange(8 * 20))
    writer.finish()
    store = TokenStore.open(out)
    ids = np.array([19, 0, 7, 7, 3, 19])
    np.testing.assert_array_equal(store.read_rows(ids),
                                  np.arange(8 * 20).reshape(20, 8)[ids])
    with pytest.raises(IndexError, match=r"\[0, 20\)"):
        store.read_rows(np.array([20]))
    meta = json.loads((tmp_path / "store" / tokens.META_FILE).read_text())
    assert meta["n_rows"] == 20 and meta["dropped_tokens"] == 0


def test_stdlib_corpus_shortcut(tmp_path):
    files = expand_inputs(["stdlib"])
    root = stdlib_glob().split("/**")[0]
    assert len(files) > 100 and all(f.startswith(root) and f.endswith(".py") for f in files)
    out = str(tmp_path / "store")
    assert main(["--input", "stdlib", "--output", out, "--seq_len", "128",
                 "--max_tokens", "5000"]) == 0
    store = TokenStore.open(out)
    assert store.n_rows == 5000 // 128 and store.meta["n_tokens"] == 5000
    first = open(files[0], "rb").read()[:128]
    assert bytes(store.read_rows(np.array([0]))[0, :len(first)].astype(np.uint8)) == first


def test_bad_flags_exit_2_naming_the_flag(tmp_path, capsys):
    glob_ = _write_docs(tmp_path)
    out = str(tmp_path / "store")
    assert main(["--input", glob_, "--output", out]) == 2
    assert "--seq_len" in capsys.readouterr().err
    assert main(["--input", glob_, "--output", out, "--seq_len", "8",
                 "--tokenizer", str(tmp_path / "missing.json")]) == 2
    assert "--tokenizer" in capsys.readouterr().err
    assert main(["--input", glob_, "--output", out, "--seq_len", "8", "--vocab_size", "9"]) == 2
    assert "parquet input only" in capsys.readouterr().err


def test_a_tokenize_into_a_store_another_one_is_writing_is_refused(tmp_path, capsys):
    """Two tokenize runs on one --output would write the same array dir: while another
    process holds the store's lock, tokenize exits 2 naming the output and that process,
    and writes nothing; the lock released, the same command writes the store."""
    import subprocess
    import sys

    from ppgd_tpu.data.tokens import LOCK_FILE

    (tmp_path / "a.txt").write_text("hello world " * 50)
    out = tmp_path / "store"
    out.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from ppgd_tpu import lockfile; "
         f"lockfile.acquire({str(out / LOCK_FILE)!r}); print('held', flush=True); "
         "sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    args = ["--input", str(tmp_path / "a.txt"), "--output", str(out), "--seq_len", "8"]
    try:
        assert holder.stdout.readline() == "held\n"
        assert main(args) == 2
        err = capsys.readouterr().err
        assert (f"--output: {out} is being written by another `ppgd-tpu tokenize` (pid "
                f"{holder.pid} on host") in err, err
        assert sorted(os.listdir(out)) == [LOCK_FILE]
    finally:
        holder.communicate("")
    assert main(args) == 0
    assert TokenStore.open(str(out)).n_rows == (600 + 1) // 8  # the bytes and an EOS
    (tmp_path / "empty.txt").write_text("")  # refused after the lock: it leaves nothing
    assert main(["--input", str(tmp_path / "empty.txt"), "--output", str(tmp_path / "s2"),
                 "--seq_len", "8"]) == 2
    assert not (tmp_path / "s2").exists()


def test_a_store_rewritten_while_it_is_read_is_said_so_not_called_damaged(tmp_path):
    """A `tokenize` run again on a store that a pretrain or train is reading moves its rows
    (the other array dir) and deletes the old ones: the reader's next read fails. It says
    the store was rewritten and to run again (the run resumes), not that it is damaged."""
    (tmp_path / "a.txt").write_text("hello world " * 50)
    out = str(tmp_path / "store")
    args = ["--input", str(tmp_path / "a.txt"), "--output", out, "--seq_len", "8"]
    assert main(args) == 0
    reader = TokenStore.open(out)
    reader.read_rows([0, 1])
    assert main(args) == 0  # the same rows, into the other array dir
    with pytest.raises(tokens.DamagedStoreError, match="was rewritten .* while this command "
                       "read it; run this command again") as e:
        reader.read_rows([0, 1])
    assert "re-run `ppgd-tpu tokenize`" not in str(e.value)
