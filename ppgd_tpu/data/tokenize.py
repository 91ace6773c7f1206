"""`ppgd-tpu tokenize`: documents -> token ids -> packed rows in a token store.

Inputs (`--input`, repeatable, local or gs:// globs, `**` recursive):
  * text files: one file is one document, encoded by `--tokenizer` (`byte`, or a
    Hugging Face tokenizer.json) and followed by the tokenizer's EOS id;
  * parquet files with an `input_ids` list column (already tokenized, as the Pile runs
    use): each row is one document, `--tokenizer` is ignored, a separator is added only
    with `--eos_id`, and the vocabulary is `--vocab_size` or the largest id + 1;
  * `stdlib`: this interpreter's standard-library .py sources, a corpus every machine
    with Python has (the demo LM corpus).
Files are read one at a time and rows streamed out, so memory stays bounded.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import json
import os
import sys
import sysconfig
from dataclasses import dataclass
from typing import Iterator

import numpy as np
from absl import logging
from tqdm import tqdm

from ppgd_tpu import cmdline, lockfile, signals, storage
from ppgd_tpu.data.tokens import (LOCK_FILE, StoreWriteError, TokenStoreWriter, foreign_files,
                                  fs_for)

BYTE_EOS = 256
# 256 bytes + EOS, padded to a multiple of 128 (the TPU lane width) so embedding and
# unembedding tiles are whole; ids 257..383 never occur.
BYTE_VOCAB_SIZE = 384
EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]", "<|eos|>")
SEQ_LEN_MAX = 2**24  # tokens per row: a bound on the writer's row buffer, not on LMs
ENCODE_GROUP = 64  # documents per tokenizer call (the Rust tokenizer encodes a group in parallel)


class TokenizeError(ValueError):
    """Bad input for the tokenize command: reported with exit status 2."""


@dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, EOS = 256: needs no files and round-trips any text."""

    name: str = "byte"
    vocab_size: int = BYTE_VOCAB_SIZE
    eos_id: int = BYTE_EOS
    id: str = "byte"

    def encode(self, docs: list[bytes]) -> list[np.ndarray]:
        return [np.frombuffer(d, np.uint8) for d in docs]

    def decode(self, ids: np.ndarray) -> str:
        ids = np.asarray(ids)
        return ids[ids < 256].astype(np.uint8).tobytes().decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer.json; its EOS is the first of EOS_NAMES it has."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        try:
            self._tok = Tokenizer.from_file(path)
        except Exception as e:  # the Rust side raises bare Exceptions
            raise TokenizeError(f"--tokenizer {path}: not a readable tokenizer.json ({e})")
        self.name = path
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        eos = [self._tok.token_to_id(t) for t in EOS_NAMES]
        eos = [i for i in eos if i is not None]
        if not eos:
            raise TokenizeError(f"--tokenizer {path}: has none of the end-of-document tokens "
                                f"{list(EOS_NAMES)}; add one to the tokenizer")
        self.eos_id = eos[0]
        # What the ids mean, wherever the file lives: a hash of the token -> id map.
        vocab = json.dumps(sorted(self._tok.get_vocab(with_added_tokens=True).items()))
        self.id = "vocab-sha256:" + hashlib.sha256(vocab.encode()).hexdigest()

    def encode(self, docs: list[bytes]) -> list[np.ndarray]:
        texts = [d.decode("utf-8", errors="replace") for d in docs]
        return [np.asarray(e.ids, np.int64)
                for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: np.ndarray) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)


def load_tokenizer(spec: str) -> ByteTokenizer | HFTokenizer:
    """`byte` or a path to a tokenizer.json."""
    return ByteTokenizer() if spec == "byte" else HFTokenizer(spec)


def stdlib_glob() -> str:
    return sysconfig.get_paths()["stdlib"] + "/**/*.py"


def expand_inputs(patterns: list[str]) -> list[str]:
    """Sorted files matching the globs (`stdlib` = the interpreter's stdlib sources)."""
    files = set()
    for pattern in patterns:
        if pattern == "stdlib":
            files.update(f for f in glob.glob(stdlib_glob(), recursive=True)
                         if "site-packages" not in f and "dist-packages" not in f)
        elif pattern.startswith("gs://"):
            fs, _ = fs_for(pattern)
            files.update("gs://" + f for f, info in fs.glob(pattern, detail=True).items()
                         if info["type"] == "file")
        else:
            files.update(f for f in glob.glob(pattern, recursive=True) if os.path.isfile(f))
    return sorted(files)


def _read_bytes(path: str) -> bytes:
    fs, p = fs_for(path)
    try:
        return fs.cat_file(p)
    except OSError as e:  # gone since the glob, no permission, not a regular file
        raise TokenizeError(f"--input: cannot read {path} ({e.strerror or e}); the store "
                            "stays incomplete: fix or exclude the file and re-run") from None


def _parquet_documents(path: str) -> Iterator[np.ndarray]:
    """Each row's `input_ids` of one parquet file, streamed by record batch."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    fs, p = fs_for(path)
    with fs.open(p, "rb") as f:
        try:
            pf = pq.ParquetFile(f)
        except pa.ArrowException as e:
            raise TokenizeError(f"{path}: not a readable parquet file ({e})") from e
        schema = pf.schema_arrow
        kind = schema.field("input_ids").type if "input_ids" in schema.names else None
        if not (kind is not None
                and (pa.types.is_list(kind) or pa.types.is_large_list(kind))
                and pa.types.is_integer(kind.value_type)):
            raise TokenizeError(f"{path}: parquet input needs an `input_ids` column of integer "
                                f"lists; columns are {schema}")
        for batch in pf.iter_batches(batch_size=1024, columns=["input_ids"]):
            col = batch.column(0)
            lengths = col.value_lengths().fill_null(0).to_numpy()
            values = col.flatten().to_numpy(zero_copy_only=False)
            yield from np.split(values, np.cumsum(lengths)[:-1])


def _text_documents(files: list[str], tok, bar: tqdm) -> Iterator[np.ndarray]:
    for i in range(0, len(files), ENCODE_GROUP):
        group = files[i:i + ENCODE_GROUP]
        yield from tok.encode([_read_bytes(f) for f in group])
        bar.update(len(group))


def _parquet_stream(files: list[str], bar: tqdm) -> Iterator[np.ndarray]:
    for f in files:
        yield from _parquet_documents(f)
        bar.update(1)


def _parquet_vocab_size(files: list[str]) -> int:
    logging.info("No --vocab_size: scanning %d parquet files for the largest id", len(files))
    top = -1
    for path in files:
        for ids in _parquet_documents(path):
            if ids.size:
                top = max(top, int(ids.max()))
    if top < 0:
        raise TokenizeError(f"the {len(files)} parquet files hold no tokens")
    return top + 1


def tokenize(inputs: list[str], output: str, *, tokenizer: str = "byte", seq_len: int,
             max_tokens: int | None = None, vocab_size: int | None = None,
             eos_id: int | None = None) -> dict:
    """Pack the documents of `inputs` into a token store at `output`; returns its meta.
    Every argument is checked before any input is read (`--output` too: a store that could
    not be created is refused up front, not after the first shard was tokenized)."""
    try:
        storage.check_creatable(output, directory=True)
    except ValueError as e:
        raise TokenizeError(f"--output: {e}; give a directory the token store can be "
                            "created in (a local path or gs://bucket/prefix)") from None
    foreign = foreign_files(output)
    if foreign:
        raise TokenizeError(
            f"--output: {output} holds files that are not a token store's ("
            f"{', '.join(foreign[:5])}{', ...' if len(foreign) > 5 else ''}), which writing a "
            "store there would delete; give a new or empty directory, or an existing store "
            "to rewrite")
    files = expand_inputs(inputs)
    if not files:
        dirs = [i for i in inputs if os.path.isdir(i)]
        hint = f" (to read the files in a directory, give a glob: '{dirs[0].rstrip('/')}/*')" \
            if dirs else ""
        raise TokenizeError(f"--input {' '.join(inputs)}: matches no files{hint}")
    if max_tokens is not None and max_tokens < 1:
        raise TokenizeError(f"--max_tokens must be >= 1, got {max_tokens}")
    if not 2 <= seq_len <= SEQ_LEN_MAX:
        raise TokenizeError(f"--seq_len must be 2..{SEQ_LEN_MAX} (a row needs an input and a "
                            f"next token; an LM's context is far shorter), got {seq_len}")
    if vocab_size is not None and vocab_size < 1:
        raise TokenizeError(f"--vocab_size must be >= 1, got {vocab_size}")
    if eos_id is not None and eos_id < 0:
        raise TokenizeError(f"--eos_id must be a token id (>= 0), got {eos_id}")
    parquet = [f.endswith(".parquet") for f in files]
    if any(parquet) and not all(parquet):
        raise TokenizeError("--input mixes parquet and text files; tokenize them separately")
    if all(parquet):
        tok_name, tok_id = "pretokenized", None  # which tokenizer made them is not known
        if tokenizer != "byte":
            raise TokenizeError(f"--tokenizer {tokenizer}: parquet input holds token ids "
                                "already (input_ids); --tokenizer applies to text input only")
        if vocab_size is not None and eos_id is not None and eos_id >= vocab_size:
            raise TokenizeError(f"--eos_id {eos_id}: not an id of --vocab_size {vocab_size} "
                                f"(0..{vocab_size - 1}); raise --vocab_size or fix --eos_id")
        vocab = vocab_size if vocab_size is not None else _parquet_vocab_size(files)
        if eos_id is not None:
            vocab = max(vocab, eos_id + 1)  # (a scanned vocabulary need not reach the EOS)
        eos = eos_id
        documents = functools.partial(_parquet_stream, files)
    else:
        tok = load_tokenizer(tokenizer)
        tok_name, vocab, eos, tok_id = tok.name, tok.vocab_size, tok.eos_id, tok.id
        if vocab_size is not None or eos_id is not None:
            raise TokenizeError("--vocab_size and --eos_id apply to parquet input only; "
                                "text input takes them from --tokenizer")
        documents = functools.partial(_text_documents, files, tok)
    def in_use(holder):
        return TokenizeError(
            f"--output: {output} is being written by another `ppgd-tpu tokenize` ({holder}, "
            f"per {storage.join(output, LOCK_FILE)}); wait for it to end, or give another "
            "--output")

    with lockfile.holding(storage.join(output, LOCK_FILE), in_use):
        try:
            writer = TokenStoreWriter(output, seq_len=seq_len, vocab_size=vocab, eos_id=eos,
                                      info={"tokenizer": tok_name, "tokenizer_id": tok_id,
                                            "source": list(inputs),
                                            "n_files": len(files)})
        except ValueError as e:
            raise TokenizeError(str(e)) from e

        bar = tqdm(total=len(files), unit="file", disable=not sys.stderr.isatty())
        for ids in documents(bar):
            signals.raise_if_seen()
            room = max_tokens - writer.n_tokens if max_tokens is not None else ids.size + 1
            if room <= 0:
                break
            try:
                writer.add_document(ids[:room], ended=ids.size < room)
            except ValueError as e:
                raise TokenizeError(str(e)) from e
            except StoreWriteError as e:
                raise TokenizeError(f"--output: {e}") from None
            rows = writer.n_tokens // seq_len  # packed so far (written: per shard)
            bar.set_postfix(tokens=writer.n_tokens, rows=rows, refresh=False)
            logging.log_every_n_seconds(logging.INFO, "tokenize: %d documents, %d tokens, %d "
                                        "rows", 30, writer.n_documents, writer.n_tokens, rows)
        bar.close()
        if writer.n_documents == 0:
            raise TokenizeError(f"--input {' '.join(inputs)}: the {len(files)} files hold no "
                                f"tokens")
        try:
            meta = writer.finish()
        except ValueError as e:
            more = f" or raise --max_tokens ({max_tokens})" if max_tokens is not None else ""
            raise TokenizeError(f"{e}{more}") from e
        except StoreWriteError as e:
            raise TokenizeError(f"--output: {e}") from None
    logging.info("tokenize: wrote %d rows x %d (%s) to %s from %d documents; %d tail tokens "
                 "dropped", meta["n_rows"], seq_len, meta["dtype"], output,
                 meta["n_documents"], meta["dropped_tokens"])
    return meta


def main(argv: list[str]) -> int:
    """`ppgd-tpu tokenize ARGS` (argv excludes the program and subcommand names)."""
    args, positional = cmdline.parse_flags(argv, {
        "input": cmdline.Flag(None, "text/parquet files (local or gs://, ** recursive) or "
                              "`stdlib` for this Python's standard-library sources",
                              repeated=True),
        "output": (None, "token store directory (local path or gs://bucket/prefix)"),
        "tokenizer": ("byte", "`byte` or a tokenizer.json (text input only)"),
        "seq_len": (None, "tokens per row", cmdline.integer()),
        "max_tokens": ("", "stop after N tokens (separators included; the document "
                       "crossing N is cut there, without a separator)",
                       cmdline.optional(cmdline.integer())),
        "vocab_size": ("", "parquet input: vocabulary size (default: largest id + 1)",
                       cmdline.optional(cmdline.integer())),
        "eos_id": ("", "parquet input: separator id appended after each document",
                   cmdline.optional(cmdline.integer()))},
        "usage: ppgd-tpu tokenize --input GLOB [--input GLOB ...] --output STORE --seq_len T "
        "[flags]\n\nPack documents into fixed-length rows of a token store.")
    if positional:
        raise cmdline.UsageError(f"unexpected arguments {positional}; give files with --input")
    try:
        tokenize(args["input"], args["output"], tokenizer=args["tokenizer"],
                 seq_len=args["seq_len"], max_tokens=args["max_tokens"],
                 vocab_size=args["vocab_size"], eos_id=args["eos_id"])
    except TokenizeError as e:
        raise cmdline.UsageError(str(e)) from None
    return 0
