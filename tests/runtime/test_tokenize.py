"""`oobleck tokenize` with a BPE trained here (no hub), uint16/uint32 token files, and their errors."""

from __future__ import annotations

import numpy as np
import pytest

from oobleck.cli import main
from oobleck.runtime.errors import DataError
from oobleck.runtime.train.data import TokenFile

TEXT = "the quick brown fox jumps over the lazy dog\n" * 50 + "pack my box with five dozen liquor jugs\n" * 50


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=60, special_tokens=["[UNK]"]))
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tokenizer.save(str(path))
    return tokenizer, path


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_tokenize_writes_the_ids_the_runtime_reads(tmp_path, tokenizer, dtype, capsys):
    bpe, path = tokenizer
    text = tmp_path / "corpus.txt"
    text.write_text(TEXT)
    out = tmp_path / f"train.{dtype}"
    assert main(["tokenize", str(text), "--tokenizer", str(path), "--out", str(out), "--dtype", dtype]) == 0
    expected = [i for line in TEXT.splitlines(keepends=True) for i in bpe.encode(line, add_special_tokens=False).ids]
    ids = np.fromfile(out, dtype=f"<{'u2' if dtype == 'uint16' else 'u4'}")
    assert ids.tolist() == expected and len(ids) > 100
    assert f"wrote {len(ids)} {dtype} token ids" in capsys.readouterr().out
    data = TokenFile(out, seq_len=8, microbatch_size=2, vocab=bpe.get_vocab_size(), dtype=dtype)
    inputs, targets = data.microbatch(0, 0)
    assert inputs.shape == (2, 8) and int(inputs.max()) < bpe.get_vocab_size()


def test_ids_outside_the_vocabulary_name_the_file_and_offset(tmp_path):
    path = tmp_path / "tokens.bin"
    ids = np.arange(100, dtype="<u4") % 70
    ids.tofile(path)
    with pytest.raises(DataError, match=rf"data.path: {path}: token id 69 at offset 69 .* vocabulary of 69"):
        TokenFile(path, seq_len=8, microbatch_size=2, vocab=69, dtype="uint32")
    ids[37] = 128_500  # beyond uint16: only a uint32 file holds it (Llama 3's vocabulary is 128256)
    ids.tofile(path)
    with pytest.raises(DataError, match="token id 128500 at offset 37 .* vocabulary of 128256"):
        TokenFile(path, seq_len=8, microbatch_size=2, vocab=128_256, dtype="uint32")
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x00" * 6)
    with pytest.raises(DataError, match=f"data.dtype: {odd}: size 6 is not a multiple of 4 bytes"):
        TokenFile(odd, seq_len=1, microbatch_size=1, dtype="uint32")


def test_a_tokenizer_that_does_not_load_is_named(tmp_path, capsys):
    text = tmp_path / "corpus.txt"
    text.write_text("hello\n")
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"model": "nope"}')
    out = tmp_path / "out.bin"
    assert main(["tokenize", str(text), "--tokenizer", str(bad), "--out", str(out)]) == 2
    assert f"oobleck tokenize: --tokenizer: {bad}: not a tokenizers JSON file" in capsys.readouterr().err
    assert not out.exists()
