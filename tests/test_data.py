import json

import numpy as np
import pytest
import torch

from fived.data.loader import (
    ByteTokenizer,
    GlobalBatchSampler,
    bundled_corpus_path,
    load_tokenizer,
    load_tokens,
)
from fived.data.prepare import prepare_data

TEXT_A = "Hello, world! The quick brown fox jumps over the lazy dog.\n" * 20
TEXT_B = "Second file: caf\u00e9, na\u00efve, \u65e5\u672c\u8a9e.\r\nwindows line end kept\n"


def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_bytes(text.encode("utf-8"))
    return p


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    assert tok.vocab_size == 256
    ids = tok.encode(TEXT_B)
    assert ids == list(TEXT_B.encode("utf-8"))
    assert tok.decode(ids) == TEXT_B
    assert tok.decode(torch.tensor(ids)) == TEXT_B
    assert tok.decode([0xFF]) == "\ufffd"  # invalid UTF-8 is replaced, not an error
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)


def test_bundled_corpus():
    path = bundled_corpus_path()
    assert path.is_file() and path.stat().st_size > 100_000
    tokens = load_tokens(None)
    assert tokens.ndim == 1 and len(tokens) == path.stat().st_size
    assert np.array_equal(load_tokens(""), tokens)


def test_prepare_data_round_trip(tmp_path):
    a, b = _write(tmp_path, "a.txt", TEXT_A), _write(tmp_path, "b.txt", TEXT_B)
    eot = [ByteTokenizer.eot_id]  # each file is a document, ended by the end-of-document token
    expected = np.array(ByteTokenizer().encode(TEXT_A) + eot + ByteTokenizer().encode(TEXT_B) + eot)
    out = prepare_data([a, b], tmp_path / "out" / "toks")
    assert out == tmp_path / "out" / "toks.bin"
    meta = json.loads((tmp_path / "out" / "toks.json").read_text())
    assert meta == {
        "format": "fived-tokens-v1",
        "dtype": "uint16",
        "num_tokens": len(expected),
        "vocab_size": 256,
        "tokenizer": "byte",
        "eot_id": 0,
        "documents": 2,
    }
    for name in ("toks", "toks.bin"):  # with or without the suffix
        tokens = load_tokens(str(tmp_path / "out" / name))
        assert isinstance(tokens, np.memmap) and tokens.dtype == np.uint16
        assert np.array_equal(tokens, expected)
    # ".bin" given to prepare_data too; a plain text path is tokenized in memory.
    assert prepare_data([a], tmp_path / "x.bin") == tmp_path / "x.bin"
    assert np.array_equal(load_tokens(tmp_path / "x.bin"), np.append(load_tokens(a), eot))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.txt", "out", "x.bin", "x.json"]


def test_prepare_data_failure_leaves_nothing(tmp_path):
    a = _write(tmp_path, "a.txt", TEXT_A)
    with pytest.raises(ValueError, match="not found"):
        prepare_data([a, tmp_path / "missing.txt"], tmp_path / "toks")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]
    # A failure mid-write (here: invalid UTF-8 in the second file) leaves nothing; an existing output
    # is never written over (issue 34), so it stays intact.
    prepare_data([a], tmp_path / "toks")
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe not utf-8")
    with pytest.raises(ValueError, match="bad.txt: not UTF-8 text"):
        prepare_data([a, bad], tmp_path / "toks2")
    with pytest.raises(ValueError, match="toks.bin: exists; fived does not write over"):
        prepare_data([a], tmp_path / "toks")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "bad.txt", "toks.bin", "toks.json"]
    assert np.array_equal(load_tokens(tmp_path / "toks")[:-1], load_tokens(a))


def test_load_tokens_errors(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        load_tokens(tmp_path / "nope.txt")
    with pytest.raises(ValueError, match="token file not found"):
        load_tokens(tmp_path / "nope.bin")


def _sampler(seed=0, n=5000, seq_len=16, batch=8):
    tokens = np.random.default_rng(123).integers(0, 256, size=n).astype(np.uint16)
    return GlobalBatchSampler(tokens, seq_len=seq_len, global_batch=batch, seed=seed)


def test_sampler_shapes_and_windows():
    s = _sampler()
    batch = s.global_batch_at(3)
    assert batch.dtype == torch.long and batch.shape == (8, 17)
    tokens = torch.from_numpy(s.tokens.astype(np.int64))
    for row in batch:  # every row is some window i*seq_len .. i*seq_len+seq_len
        assert any(torch.equal(row, tokens[i * 16 : i * 16 + 17]) for i in range(s.num_windows))


def test_sampler_determinism():
    a, b, c = _sampler(seed=1), _sampler(seed=1), _sampler(seed=2)
    for step in (0, 1, 7, 100):
        assert torch.equal(a.global_batch_at(step), b.global_batch_at(step))
    assert not torch.equal(a.global_batch_at(0), c.global_batch_at(0))
    assert not torch.equal(a.global_batch_at(0), a.global_batch_at(1))
    # Pure function of step: order of calls does not matter.
    late = a.global_batch_at(50)
    assert torch.equal(_sampler(seed=1).global_batch_at(50), late)


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_sampler_layout_invariance(dp):
    s = _sampler()
    for step in (0, 5, 39, 40):  # 312 windows / 8 per step: step 39 straddles two epochs
        local = [s.local_batch_at(step, r, dp) for r in range(dp)]
        assert all(x.shape == (8 // dp, 17) for x in local)
        assert torch.equal(torch.cat(local), s.global_batch_at(step))


def test_sampler_resume():
    s = _sampler(seed=5)
    it = iter(s)
    first = [next(it) for _ in range(3)]
    assert torch.equal(first[2], s.global_batch_at(2))
    state = s.state_dict()
    assert state["step"] == 3
    expected = [s.next_global_batch() for _ in range(4)]
    resumed = _sampler(seed=5)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # survives a JSON checkpoint
    assert all(torch.equal(x, resumed.next_global_batch()) for x in expected)
    with pytest.raises(ValueError, match="seed"):
        _sampler(seed=6).load_state_dict(state)


def test_sampler_epoch_rollover():
    tokens = np.arange(41, dtype=np.uint16)  # (41-1)//8 = 5 windows
    s = GlobalBatchSampler(tokens, seq_len=8, global_batch=2, seed=0)
    assert s.num_windows == 5
    seen = []
    for step in range(50):
        batch = s.global_batch_at(step)
        for row in batch:
            start = int(row[0])
            assert start % 8 == 0 and torch.equal(row, torch.arange(start, start + 9))
            seen.append(start // 8)
    # Each epoch (5 consecutive positions) visits every window exactly once.
    for e in range(20):
        assert sorted(seen[e * 5 : (e + 1) * 5]) == [0, 1, 2, 3, 4]


def test_sampler_errors():
    with pytest.raises(ValueError, match="fewer than global_batch"):
        GlobalBatchSampler(np.arange(30), seq_len=8, global_batch=4, seed=0)
    s = _sampler(batch=6)
    with pytest.raises(ValueError, match="divisible"):
        s.local_batch_at(0, 0, 4)
    with pytest.raises(ValueError, match="dp_rank"):
        s.local_batch_at(0, 3, 3)


def test_hf_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([TEXT_A], trainers.WordLevelTrainer(special_tokens=["[UNK]", "</s>"]))
    tok_path = str(tmp_path / "tokenizer.json")
    tok.save(tok_path)

    hf = load_tokenizer(tok_path)
    assert hf.vocab_size == tok.get_vocab_size()
    ids = hf.encode("the quick brown fox")
    assert "[UNK]" not in hf.decode(ids) and hf.decode(ids) == "the quick brown fox"

    src = _write(tmp_path, "a.txt", TEXT_A)
    out = prepare_data([src], tmp_path / "hf", tokenizer=tok_path)
    meta = json.loads((tmp_path / "hf.json").read_text())
    assert meta["tokenizer"] == tok_path and meta["vocab_size"] == hf.vocab_size
    assert hf.eot_id == 1 and meta["eot_id"] == 1  # "</s>"
    tokens = load_tokens(out, tokenizer=tok_path)
    assert np.array_equal(tokens, hf.encode(TEXT_A) + [hf.eot_id])
    assert np.array_equal(load_tokens(src, tokenizer=tok_path), tokens[:-1])
    with pytest.raises(ValueError, match="tokenizer"):
        load_tokens(out, tokenizer="byte")  # vocabularies differ


def test_hf_tokenizer_missing_package(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` fail
    with pytest.raises(ImportError, match="pip install tokenizers"):
        load_tokenizer(str(tmp_path / "tokenizer.json"))
