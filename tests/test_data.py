import json

import pytest
import torch

from labs import data
from labs.errors import LabsError


def test_vocab_size_is_qwens():
    tok = data.tokenizer()
    assert tok.n_vocab == 151_643 + 208 == 151_851
    assert tok.eot_token == 151_643


def test_round_trip_mixed_text():
    text = "def f(x):\n    return x ** 2  # 平方\n\nZeRO-3 shards parameters."
    ids = data.encode(text)
    assert data.decode(ids) == text
    assert len(ids) < len(text)          # BPE merges: fewer ids than characters


def test_special_tokens():
    tok = data.tokenizer()
    assert tok.encode("<|im_start|>", allowed_special="all") == [151_644]
    assert tok.encode("<|extra_204|>", allowed_special="all") == [151_850]
    # In user text a special token's spelling stays text, never the control id.
    assert 151_643 not in data.encode("<|endoftext|>")


def test_known_ids_are_stable():
    # The first BPE ranks are single bytes: '!' is rank 0.
    assert data.encode("!") == [0]


def test_embedded_corpus():
    tokens = data.corpus_tokens()
    assert 100_000 < tokens.numel() < 120_000
    assert tokens.max() < 151_851 and tokens.dtype == torch.int64


def test_pack_drops_tail():
    rows = data.pack(torch.arange(10), 3)
    assert rows.tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    with pytest.raises(LabsError):
        data.pack(torch.arange(2), 3)


def test_rank_shards_are_disjoint_and_reproducible():
    rows = torch.arange(40).view(20, 2)
    first = [next(data.rank_batches(rows, 2, r, 2, seed=7)) for r in (0, 1)]
    again = [next(data.rank_batches(rows, 2, r, 2, seed=7)) for r in (0, 1)]
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    seen = [set(tuple(row.tolist()) for b in data_iter(rows, r) for row in b) for r in (0, 1)]
    assert not seen[0] & seen[1] and len(seen[0] | seen[1]) == 20
    other_seed = next(data.rank_batches(rows, 2, 0, 2, seed=8))
    assert not torch.equal(other_seed, first[0])


def data_iter(rows, rank):
    batches = data.rank_batches(rows, 2, rank, 2, seed=7)
    return [next(batches) for _ in range(5)]      # one epoch: 10 rows per rank, 2 per batch


def test_jsonl_and_txt(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "one"}) + "\n\n" + json.dumps({"text": "two"}) + "\n")
    assert data.read_documents(tmp_path / "a.jsonl") == ["one", "two"]
    (tmp_path / "b.txt").write_text("plain")
    assert data.read_documents(tmp_path / "b.txt") == ["plain"]


@pytest.mark.parametrize("content, message", [("{bad\n", "a.jsonl:1: not valid JSON"),
                                              ('{"txt": 1}\n', 'a.jsonl:1: needs a string field "text"')])
def test_jsonl_errors_name_the_line(tmp_path, content, message):
    (tmp_path / "a.jsonl").write_text(content)
    with pytest.raises(LabsError, match=message):
        data.read_documents(tmp_path / "a.jsonl")


def test_missing_data_file(tmp_path):
    with pytest.raises(LabsError, match="does not exist"):
        data.read_documents(tmp_path / "nope.jsonl")


def test_source_jsonl_writes_a_corpus_labs_reads_and_names_a_missing_package(tmp_path, capsys):
    """tools/source_jsonl.py (round 14's corpora): an installed package's .py files as JSONL, in path order, without
    test suites, read back by labs.data as documents; an unknown name stops with its name in the message."""
    import importlib.util

    from conftest import ROOT
    from labs import data

    spec = importlib.util.spec_from_file_location("source_jsonl", ROOT / "tools" / "source_jsonl.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    out = tmp_path / "json.jsonl"
    tool.main(str(out), "json")
    documents = data.read_documents(out)
    files = list(tool.source_files(tool.source_root("json")))
    assert len(documents) == len(files) >= 3 and "def dumps" in "".join(documents)
    tree = tmp_path / "pkg"
    for name in ("b.py", "a/c.py", "tests/t.py", "a/test/u.py", "notes.txt"):
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_text("x = 1\n")
    assert [p.relative_to(tree).as_posix() for p in tool.source_files(tree)] == ["a/c.py", "b.py"]
    with pytest.raises(SystemExit, match="no-such-package"):
        tool.main(str(tmp_path / "x.jsonl"), "no-such-package")
