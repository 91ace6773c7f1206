"""The LM token store: one zarr3 array `[n_rows, seq_len]` of packed token ids, written once
by `ppgd-tpu tokenize` and range-read by every host for its own rows only.

Layout under STORE (a local path or gs://bucket/prefix):

    tokens/       zarr3 array (tensorstore), sharded: one shard file per block of rows,
                  one inner chunk per row, so a random row costs one byte-range read;
                  or tokens-b/, as meta.json's `array_dir` says (see the rewrite below)
    meta.json     vocab_size, seq_len, n_rows, dtype, eos_id, tokenizer, source, counts,
                  `store_id` (a digest of the rows: run dirs record it), `tokenizer_id`
                  (what the ids mean: LM targets pretrained on it record it),
                  and `array_files`: the size of every file under tokens/ as written
    COMPLETE      written last; a store without it is refused ("re-run tokenize")

Opening a store checks it against what tokenize wrote, so a damaged store is refused by
file before any compute (DamagedStoreError): meta.json must parse, and every file under
tokens/ must still have its recorded size (one listing; a shard cut short or lost would
otherwise fail at some later read, or read as zeros). A store from before `array_files`
is checked for its shard files only. A read that still fails names the shard; a chunk
missing at read time (a store rewritten under a running command) fails too, never zeros.
A writer replaces the store at its path, so it refuses a path holding anything else.
It writes its rows beside a complete store's (into the other of ARRAY_DIRS) and switches
meta.json to them only once they are all written, then deletes the old ones: a rewrite that
fails or is stopped leaves the store as it was (its partial rows are cleared by the next).

The array goes through tensorstore's kvstores (`file` or `gcs`; the gcs driver honours
TENSORSTORE_GCS_HTTP_URL for an emulator); the two small files go through fsspec (gcsfs for
gs://, which honours STORAGE_EMULATOR_HOST). A gs:// store differs from a local one only in
the kvstore `storage.kvstore` makes and in the fsspec filesystem `fs_for` picks.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

import numpy as np
import tensorstore as ts

from ppgd_tpu import storage

FORMAT = "ppgd_tpu.token_store"
FORMAT_VERSION = 1
ARRAY_DIRS = ("tokens", "tokens-b")  # a rewrite writes into the one not in use
META_FILE = "meta.json"
MARKER_FILE = "COMPLETE"
LOCK_FILE = ".lock"  # held by the tokenize writing the store (local stores; lockfile)
# A shard (one storage object) holds about this many bytes of rows; the writer buffers one.
SHARD_BYTES = 32 * 2**20
# ... and at most this many rows: its index has 16 bytes per row slot, full or not, so short
# rows would make every shard, even a tiny store's, 16 B x 8M rows (seq_len 2)
SHARD_ROWS = 2**16


class IncompleteStoreError(FileNotFoundError):
    """The path holds no finished token store (missing, or a tokenize run that did not end)."""


class DamagedStoreError(IncompleteStoreError):
    """A store marked complete whose files are not what tokenize wrote (garbled meta.json, a
    shard cut short or missing); the message names the file. An IncompleteStoreError, so
    every caller that refuses an incomplete store refuses a damaged one the same way."""


class StoreWriteError(OSError):
    """The writer could not write the store (its path, permissions, space)."""


REWRITE = "re-run `ppgd-tpu tokenize` to rewrite the store"


def _file_sizes(fs, root: str) -> dict[str, int]:
    """{path relative to root: size} of every file below `root` (one listing)."""
    fs.invalidate_cache()
    base = fs._strip_protocol(root).rstrip("/") + "/"
    return {name[len(base):]: int(info["size"])
            for name, info in sorted(fs.find(root, detail=True).items())
            if info.get("type") == "file" and name.startswith(base)}


def _check_meta(meta, where: str) -> None:
    """Raises DamagedStoreError unless `meta` is a meta.json this version writes."""
    if not isinstance(meta, dict):
        raise DamagedStoreError(f"{where} is damaged (a JSON {type(meta).__name__}, not the "
                                f"mapping tokenize writes); {REWRITE}")
    if meta.get("format") != FORMAT or meta.get("version") != FORMAT_VERSION:
        raise DamagedStoreError(
            f"{where}: format {meta.get('format')!r} version {meta.get('version')!r}, "
            f"expected {FORMAT!r} version {FORMAT_VERSION}; {REWRITE}")
    whole = lambda v, lo: type(v) is int and v >= lo  # noqa: E731 (bool is not a count)
    wrong = [k for k, ok in (("n_rows", lambda v: whole(v, 1)),
                             ("seq_len", lambda v: whole(v, 2)),
                             ("vocab_size", lambda v: whole(v, 1)),
                             ("dtype", lambda v: v in ("uint16", "uint32")),
                             ("eos_id", lambda v: v is None or whole(v, 0)),
                             ("array_dir", lambda v: v is None or v in ARRAY_DIRS),
                             ("array_files", lambda v: v is None or (
                                 isinstance(v, dict)
                                 and all(type(n) is int for n in v.values()))))
             if not ok(meta.get(k))]
    if wrong:
        raise DamagedStoreError(f"{where} is damaged (bad or missing {', '.join(wrong)}); "
                                f"{REWRITE}")


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned integer dtype that holds ids in [0, vocab_size)."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    for dt in (np.uint16, np.uint32):
        if vocab_size - 1 <= np.iinfo(dt).max:
            return np.dtype(dt)
    raise ValueError(
        f"vocab_size {vocab_size} does not fit the token store (at most 2**32 ids, uint32)")


def _join(path: str, name: str) -> str:
    return path.rstrip("/") + "/" + name


def fs_for(path: str):
    """(fsspec filesystem, path inside it): small store files and tokenize inputs."""
    if path.startswith("gs://"):
        # gcsfs probes hierarchical-namespace buckets for ~60 s unless told not to.
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    import fsspec

    fs, inner = fsspec.core.url_to_fs(path)
    return fs, inner


def _write_small(path: str, text: str) -> None:
    fs, p = fs_for(path)
    fs.makedirs(p.rsplit("/", 1)[0], exist_ok=True)
    fs.pipe_file(p, text.encode())


def _array_spec(path: str, array_dir: str) -> dict:
    return {"driver": "zarr3", "kvstore": storage.kvstore(_join(path, array_dir))}


def _array_dir(meta: dict) -> str:
    return meta.get("array_dir", ARRAY_DIRS[0])  # (stores from before the rewrite beside)


@dataclass(frozen=True)
class TokenStore:
    """A finished token store, opened read-only. Rows are read by id, never iterated."""

    path: str
    meta: dict
    array: ts.TensorStore

    @classmethod
    def open(cls, path: str) -> "TokenStore":
        fs, p = fs_for(path)
        fs.invalidate_cache()  # gcsfs caches listings; a rewrite may have happened since
        if not fs.exists(_join(p, MARKER_FILE)):
            if fs.exists(_join(p, META_FILE)) or any(fs.exists(_join(p, d))
                                                     for d in ARRAY_DIRS):
                raise IncompleteStoreError(
                    f"incomplete token store at {path}: re-run tokenize")
            raise IncompleteStoreError(f"no token store at {path}: run `ppgd-tpu tokenize`")
        where = _join(path, META_FILE)
        try:
            meta = json.loads(fs.cat_file(_join(p, META_FILE)))
        except FileNotFoundError:
            raise DamagedStoreError(f"{where} is missing, though the store is marked "
                                    f"complete; {REWRITE}") from None
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
            raise DamagedStoreError(f"{where} is damaged (not valid JSON: {e}); "
                                    f"{REWRITE}") from None
        except OSError as e:
            raise IncompleteStoreError(f"cannot read {where} ({e})") from None
        _check_meta(meta, where)
        array_dir = _array_dir(meta)
        tokens_dir = _join(path, array_dir)
        written = meta.get("array_files")
        if written is not None:
            found = _file_sizes(fs, _join(p, array_dir))
            for name, size in written.items():
                if name not in found:
                    raise DamagedStoreError(f"{_join(tokens_dir, name)} is missing (tokenize "
                                            f"wrote {size} bytes); {REWRITE}")
                if found[name] != size:
                    raise DamagedStoreError(
                        f"{_join(tokens_dir, name)} has {found[name]} bytes, tokenize wrote "
                        f"{size} (cut short or changed); {REWRITE}")
        try:  # a chunk gone since this check (a tokenize rewriting the store) fails to read
            array = ts.open(_array_spec(path, array_dir) | {"fill_missing_data_reads": False},
                            open=True, read=True).result()
        except ValueError as e:
            raise DamagedStoreError(f"{_join(tokens_dir, 'zarr.json')}: the token array "
                                    f"cannot be opened ({storage.short_error(e)}); "
                                    f"{REWRITE}") from None
        want = (meta["n_rows"], meta["seq_len"])
        if tuple(array.shape) != want or array.dtype.numpy_dtype != np.dtype(meta["dtype"]):
            raise DamagedStoreError(
                f"token store at {path}: array is {tuple(array.shape)} "
                f"{array.dtype.numpy_dtype}, meta.json says {want} {meta['dtype']}; {REWRITE}")
        store = cls(path, meta, array)
        if written is None:  # a store from before array_files: its shards must all be there
            found = _file_sizes(fs, _join(p, array_dir))
            lost = [s for s in range(-(-store.n_rows // store.rows_per_shard))
                    if store._shard_key(s) not in found]
            if lost:
                raise DamagedStoreError(f"{_join(tokens_dir, store._shard_key(lost[0]))} is "
                                        f"missing ({len(lost)} shard file(s) lost); {REWRITE}")
        return store

    @property
    def tokens_dir(self) -> str:
        return _join(self.path, _array_dir(self.meta))

    @property
    def rows_per_shard(self) -> int:
        return int(self.array.chunk_layout.write_chunk.shape[0])

    @staticmethod
    def _shard_key(shard: int) -> str:
        """The shard's file under tokens/ (zarr3 default chunk keys, rows x 1 shard grid)."""
        return f"c/{shard}/0"

    @property
    def n_rows(self) -> int:
        return self.meta["n_rows"]

    @property
    def seq_len(self) -> int:
        return self.meta["seq_len"]

    @property
    def vocab_size(self) -> int:
        return self.meta["vocab_size"]

    @property
    def eos_id(self) -> int | None:
        return self.meta["eos_id"]

    @property
    def store_id(self) -> str | None:
        """A digest of the rows (random in stores from before it; None in older ones): a
        rewrite of other rows at the same path has another one, of the same rows the same."""
        return self.meta.get("store_id")

    @property
    def tokenizer_id(self) -> str | None:
        """What its ids mean: `byte`, or a hash of a tokenizer.json's vocabulary (None for
        pre-tokenized input and stores from before it)."""
        return self.meta.get("tokenizer_id")

    def read_rows(self, row_ids: np.ndarray) -> np.ndarray:
        """Rows `row_ids` (any order, repeats allowed) as `[len(row_ids), seq_len]`, in that
        order. One batched tensorstore read: the shards fetch only the rows asked for."""
        row_ids = np.asarray(row_ids, dtype=np.int64).reshape(-1)
        if row_ids.size and (row_ids.min() < 0 or row_ids.max() >= self.n_rows):
            raise IndexError(
                f"row ids must lie in [0, {self.n_rows}) for the store at {self.path}; "
                f"got min {row_ids.min()}, max {row_ids.max()}")
        unique, inverse = np.unique(row_ids, return_inverse=True)
        try:
            return self.array[unique].read().result()[inverse]
        except ValueError as e:
            raise self._damaged_read(unique, e) from None

    def _damaged_read(self, rows: np.ndarray, error: Exception) -> DamagedStoreError:
        """The shard files a failed read of `rows` touched that fail on their own; or, when
        another tokenize rewrote the store meanwhile (its rows moved), that."""
        try:
            now = json.loads(storage.read_bytes(_join(self.path, META_FILE)))
        except (OSError, ValueError):
            now = None
        if isinstance(now, dict) and (now.get("store_id"), now.get("array_dir")) != (
                self.meta.get("store_id"), self.meta.get("array_dir")):
            return DamagedStoreError(
                f"{self.path} was rewritten (by another `ppgd-tpu tokenize`) while this "
                "command read it; run this command again (a run resumes from its last "
                "checkpoint if the rows are the same, and is refused if they are not)")
        shards = np.unique(rows // self.rows_per_shard)
        bad = []
        for s in shards:
            try:
                self.array[rows[rows // self.rows_per_shard == s]].read().result()
            except ValueError:
                bad.append(_join(self.tokens_dir, self._shard_key(int(s))))
        where = ", ".join(bad) if bad else f"the shards of {self.tokens_dir}"
        return DamagedStoreError(f"{where}: cannot read token rows "
                                 f"({storage.short_error(error)}); {REWRITE}")


def foreign_files(path: str) -> list[str]:
    """What at `path` a tokenize run would destroy that is not a token store's: files
    other than ARRAY_DIRS (zarr.json, c/), meta.json of this format and COMPLETE. A writer
    replaces the store at its path, so it is refused anything else (a user's directory)."""
    names = storage.list_entries(path)
    arrays = [d + "/" for d in ARRAY_DIRS]
    foreign = [n for n in names if n not in (*arrays, META_FILE, MARKER_FILE, LOCK_FILE)]
    if META_FILE in names:
        try:
            ours = json.loads(storage.read_bytes(_join(path, META_FILE))).get("format") == FORMAT
        except (ValueError, AttributeError, OSError):
            ours = False
        if not ours:
            foreign.append(f"{META_FILE} (not a token store's)")
    for array in arrays:
        if array in names:
            foreign += [array + n for n in storage.list_entries(_join(path, array))
                        if n not in ("zarr.json", "c/")]
    return sorted(foreign)


class TokenStoreWriter:
    """Packs documents into rows of `seq_len` and streams them to a new store.

    Each document is followed by `eos_id` (when given) and the stream is cut into rows; the
    last partial row is dropped (`finish` reports how many tokens). Memory stays at one
    shard of rows: the array is created lazily on the first full shard, resized as shards
    are appended, and made the store's only by `finish`. A complete store at the path stays
    readable until then (its rows are in the other of ARRAY_DIRS); one that cannot be read
    is first made incomplete, so a crashed rewrite is never read as finished.
    """

    def __init__(self, path: str, *, seq_len: int, vocab_size: int, eos_id: int | None,
                 info: dict):
        if seq_len < 2:
            raise ValueError(f"--seq_len must be >= 2 (a row needs an input and a next "
                             f"token), got {seq_len}")
        self.dtype = token_dtype(vocab_size)
        if eos_id is not None and not 0 <= eos_id < vocab_size:
            raise ValueError(f"eos id {eos_id} outside the vocabulary [0, {vocab_size})")
        self.path, self.seq_len, self.vocab_size, self.eos_id = path, seq_len, vocab_size, eos_id
        self.info = dict(info)
        self.rows_per_shard = max(1, min(SHARD_ROWS,
                                         SHARD_BYTES // (seq_len * self.dtype.itemsize)))
        self._buf = np.empty(self.rows_per_shard * seq_len, self.dtype)
        self._fill = 0
        # store_id: the same rows (a tokenize run again on the same corpus) keep it, so what
        # was started on the store resumes; other rows get another
        self._rows_digest = hashlib.blake2b(f"{seq_len} {self.dtype.name}".encode(),
                                            digest_size=16)
        self._array: ts.TensorStore | None = None
        self.array_dir: str | None = None  # which of ARRAY_DIRS, chosen by _create
        self.n_rows = 0
        self.n_documents = 0
        self.n_tokens = 0  # consumed, separators included

    def add_document(self, ids: np.ndarray, *, ended: bool = True) -> None:
        """Append one document; `ended=False` (a document cut short) omits the separator."""
        ids = np.asarray(ids).reshape(-1)
        if ids.size == 0:
            return
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0:
            raise ValueError(f"token id {lo} is negative: not a token id")
        if hi >= self.vocab_size:
            raise ValueError(f"token id {hi} outside the vocabulary [0, {self.vocab_size}) "
                             "(set --vocab_size)")
        self.n_documents += 1
        self._append(ids.astype(self.dtype))
        if ended and self.eos_id is not None:
            self._append(np.array([self.eos_id], self.dtype))

    def _append(self, ids: np.ndarray) -> None:
        self.n_tokens += ids.size
        while ids.size:
            take = min(ids.size, self._buf.size - self._fill)
            self._buf[self._fill:self._fill + take] = ids[:take]
            self._fill += take
            ids = ids[take:]
            if self._fill == self._buf.size:
                self._flush_rows(self.rows_per_shard)

    def _flush_rows(self, n: int) -> None:
        if n == 0:
            return
        try:
            if self._array is None:
                self._array = self._create()
            rows = self._buf[:n * self.seq_len].reshape(n, self.seq_len)
            self._array = self._array.resize(exclusive_max=[self.n_rows + n, None],
                                             expand_only=True,
                                             resize_metadata_only=True).result()
            self._array[self.n_rows:self.n_rows + n].write(rows).result()
            self._rows_digest.update(rows.astype(self.dtype.newbyteorder("<")).tobytes())
        except (ValueError, OSError) as e:  # tensorstore reports I/O failures as ValueError
            raise StoreWriteError(f"cannot write the token store at {self.path}: "
                                  f"{storage.short_error(e)}") from None
        self.n_rows += n
        rest = self._fill - n * self.seq_len
        self._buf[:rest] = self._buf[n * self.seq_len:self._fill]
        self._fill = rest

    def _create(self) -> ts.TensorStore:
        fs, p = fs_for(self.path)
        try:
            in_use = _array_dir(TokenStore.open(self.path).meta)
        except IncompleteStoreError:  # none, or one that cannot be read: nothing to keep
            in_use = None
            if fs.exists(_join(p, MARKER_FILE)):
                fs.rm_file(_join(p, MARKER_FILE))
        self.array_dir = ARRAY_DIRS[1] if in_use == ARRAY_DIRS[0] else ARRAY_DIRS[0]
        inner = [{"name": "bytes", "configuration": {"endian": "little"}},
                 {"name": "zstd", "configuration": {"level": 3}}]
        index = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]
        spec = _array_spec(self.path, self.array_dir) | {
            "metadata": {
                "shape": [0, self.seq_len],
                "data_type": self.dtype.name,
                "dimension_names": ["row", "position"],
                "chunk_grid": {"name": "regular", "configuration": {
                    "chunk_shape": [self.rows_per_shard, self.seq_len]}},
                "codecs": [{"name": "sharding_indexed", "configuration": {
                    "chunk_shape": [1, self.seq_len], "codecs": inner,
                    "index_codecs": index, "index_location": "end"}}],
            },
            "create": True, "delete_existing": True,
        }
        return ts.open(spec).result()

    def finish(self) -> dict:
        """Write the last full rows, meta.json (the switch to them: one atomic write), the
        COMPLETE marker, then delete the rows the store had; returns the meta. Refuses a
        corpus shorter than one row."""
        full = self._fill // self.seq_len
        dropped = self._fill - full * self.seq_len
        if self.n_rows + full == 0:
            raise ValueError(
                f"the corpus has {self.n_tokens} tokens, fewer than one row of --seq_len "
                f"{self.seq_len}: lower --seq_len or add input")
        self._flush_rows(full)
        try:
            fs, p = fs_for(self.path)
            meta = {
                "format": FORMAT, "version": FORMAT_VERSION,
                "n_rows": self.n_rows, "seq_len": self.seq_len, "vocab_size": self.vocab_size,
                "dtype": self.dtype.name, "eos_id": self.eos_id,
                "n_documents": self.n_documents, "n_tokens": self.n_tokens,
                "dropped_tokens": dropped, "store_id": self._rows_digest.hexdigest(),
                "array_dir": self.array_dir,
            } | self.info | {"array_files": _file_sizes(fs, _join(p, self.array_dir))}
            storage.write_bytes(_join(self.path, META_FILE),
                                (json.dumps(meta, indent=1) + "\n").encode())
            _write_small(_join(self.path, MARKER_FILE), "")
        except OSError as e:
            raise StoreWriteError(f"cannot write the token store at {self.path}: {e}") from None
        fs.invalidate_cache()
        for old in ARRAY_DIRS:  # the replaced rows, or a failed rewrite's
            if old != self.array_dir and fs.exists(_join(p, old)):
                fs.rm(_join(p, old), recursive=True)
        return meta
