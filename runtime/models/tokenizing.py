"""`oobleck tokenize TEXT --tokenizer tokenizer.json --out FILE`: a text file to a token file the runtime reads.

The tokenizer is a `tokenizers` JSON file (what `tokenizer.json` holds in a Hugging Face model
directory; nothing is downloaded). The output is the token ids of every line, back to back, as
little-endian uint16 or uint32 (`data.dtype`): uint16 holds vocabularies up to 65536, uint32 the rest
(Llama 3's 128k). The text is encoded in batches of lines, so it need not fit in memory.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

from oobleck.runtime.errors import DataError

BATCH_LINES = 4096


def load_tokenizer(path: str | Path):
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as error:  # tokenizers raises its own Exception subclasses for unreadable files
        raise DataError(f"not a tokenizers JSON file: {error}", field="--tokenizer", path=str(path)) from error


def tokenize_file(text: str | Path, tokenizer_path: str | Path, out: str | Path, dtype: str = "uint16") -> int:
    """Encode `text` into `out` (written to a temporary name, then renamed); returns the token count."""
    tokenizer = load_tokenizer(tokenizer_path)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    limit = np.iinfo(dtype).max + 1
    if vocab > limit:
        raise DataError(f"a vocabulary of {vocab} ids does not fit {dtype}; use uint32", field="--dtype")
    out = Path(out)
    temporary = out.with_name(f".{out.name}.tmp{os.getpid()}")
    count = 0
    try:
        with open(text, encoding="utf-8") as source, open(temporary, "wb") as sink:
            while lines := [line for _, line in zip(range(BATCH_LINES), source)]:
                for encoding in tokenizer.encode_batch(lines, add_special_tokens=False):
                    ids = np.asarray(encoding.ids, dtype=np.dtype(dtype).newbyteorder("<"))
                    sink.write(ids.tobytes())
                    count += len(ids)
        os.replace(temporary, out)
    except (OSError, UnicodeDecodeError) as error:
        temporary.unlink(missing_ok=True)
        raise DataError(str(error), field="TEXT", path=str(text)) from error
    return count


def add_tokenize_parser(subparsers) -> None:
    parser = subparsers.add_parser("tokenize", help="encode a text file into a token file (data.source tokenFile)")
    parser.add_argument("text", help="UTF-8 text file")
    parser.add_argument("--tokenizer", required=True, help="a tokenizers JSON file (tokenizer.json)")
    parser.add_argument("--out", required=True, help="token file to write")
    parser.add_argument("--dtype", choices=["uint16", "uint32"], default="uint16", help="id width (default uint16)")
    parser.set_defaults(func=run_tokenize)


def run_tokenize(args: argparse.Namespace) -> int:
    try:
        count = tokenize_file(args.text, args.tokenizer, args.out, args.dtype)
    except DataError as error:
        print(f"oobleck tokenize: {error}", file=sys.stderr)
        return 2
    print(f"wrote {count} {args.dtype} token ids to {args.out}")
    return 0


def register(subparsers) -> None:
    add_tokenize_parser(subparsers)
