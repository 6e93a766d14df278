"""Text in, token batches out: the real Qwen tokenizer (offline), corpora, packing and per-rank shards.

Qwen's tokenizer is a byte-level BPE stored as `qwen.tiktoken` (one `base64(token) rank` pair per line).
The PyPI package `dashscope` (Apache-2.0) ships that file, so we read it from there and never touch a hub.
"""
from __future__ import annotations

import binascii
import functools
import importlib.util
import json
import os
from pathlib import Path

import torch

from labs.errors import LabsError

# Qwen's pre-tokenizer split (from its published tokenizer): contractions, letters, single digits,
# punctuation runs, newlines and spaces. It is part of the format: other splits give other ids.
QWEN_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
ENDOFTEXT = "<|endoftext|>"
# 3 named specials + 205 reserved ones, numbered right after the 151,643 BPE ranks.
SPECIAL_NAMES = [ENDOFTEXT, "<|im_start|>", "<|im_end|>"] + [f"<|extra_{i}|>" for i in range(205)]


def qwen_tiktoken_path() -> Path:
    """Where `dashscope` keeps `qwen.tiktoken`. find_spec does not import dashscope (its import needs
    network-client packages we do not install)."""
    spec = importlib.util.find_spec("dashscope")
    if spec is None or not spec.submodule_search_locations:
        raise LabsError("the Qwen tokenizer file comes from the PyPI package 'dashscope': "
                        "run `pip install --no-deps dashscope==2.0.2` (or `make .venv`)")
    path = Path(list(spec.submodule_search_locations)[0]) / "resources" / "qwen.tiktoken"
    if not path.is_file():
        raise LabsError(f"'{path}' is missing: reinstall dashscope==2.0.2")
    return path


@functools.lru_cache(maxsize=1)
def tokenizer():
    """The Qwen tokenizer as a `tiktoken.Encoding` (151,643 BPE ranks + 208 special tokens)."""
    import tiktoken

    # `base64(token) rank` pairs, whitespace-separated: decoded in C (binascii), not line by line in Python (every rank
    # reads the file; 0.08 s instead of 0.19 s)
    words = qwen_tiktoken_path().read_bytes().split()
    ranks = dict(zip(map(binascii.a2b_base64, words[0::2]), map(int, words[1::2])))
    specials = {name: len(ranks) + i for i, name in enumerate(SPECIAL_NAMES)}
    return tiktoken.Encoding("qwen", pat_str=QWEN_PATTERN, mergeable_ranks=ranks, special_tokens=specials)


def encode(text: str) -> list[int]:
    """Plain text to ids. Special-token strings inside user text stay ordinary text (safe default)."""
    return tokenizer().encode(text, disallowed_special=())


def decode(ids) -> str:
    return tokenizer().decode(list(ids))


# ---------------------------------------------------------------------------------------------- corpora
def embedded_documents() -> list[str]:
    """CPython's own help topics (`pydoc_data.topics`): ~465 KB of English prose and code, on every machine."""
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)]


def check_path(path) -> Path:
    path = Path(path)
    if path.is_dir():
        raise LabsError(f"--data '{path}' is a directory; pass a .txt or .jsonl file")
    if not path.is_file():
        raise LabsError(f"--data '{path}' does not exist; pass a .txt or .jsonl file, or leave --data out "
                        "for the embedded corpus")
    if path.suffix not in (".txt", ".jsonl"):
        raise LabsError(f"--data '{path}' must end in .txt or .jsonl")
    return path


def read_documents(path: str | os.PathLike | None) -> list[str]:
    """Documents from the embedded corpus (path None), a .txt file (one document) or a .jsonl file
    (one {"text": ...} object per line)."""
    if path is None:
        return embedded_documents()
    return list(_documents(check_path(path)))


def _documents(path: Path):
    """The file's documents one by one, with errors that name the line (or byte) that is wrong."""
    try:
        if path.suffix == ".txt":
            yield path.read_text(encoding="utf-8")
            return
        with path.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise LabsError(f"{path}:{number}: not valid JSON ({exc.msg}); each line must be "
                                    '{"text": "..."}') from None
                if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                    raise LabsError(f'{path}:{number}: needs a string field "text"')
                yield record["text"]
    except UnicodeDecodeError as exc:
        raise LabsError(f"--data '{path}' is not UTF-8 text (byte {exc.start}: {exc.reason}); "
                        "convert it to UTF-8") from None


def check_enough_tokens(path, sequences: int, seq_len: int) -> int:
    """Fail early unless the corpus yields at least `sequences` rows of `seq_len` tokens (one micro-batch per
    rank). Every line of a .jsonl file is checked; tokenising stops once there is enough. Returns the tokens
    counted (a lower bound for a large file)."""
    needed, found = sequences * seq_len, 0
    eot = tokenizer().eot_token
    documents = embedded_documents() if path is None else _documents(check_path(path))
    for document in documents:
        if found < needed:
            found += len(encode(document)) + (eot is not None)
    if found < needed:
        where = "the embedded corpus" if path is None else f"--data '{path}'"
        raise LabsError(f"{where} has {found:,} tokens, fewer than {sequences} sequence(s) of {seq_len} "
                        f"({needed:,} tokens: one micro-batch per rank); bring more text or use a shorter --seq-len")
    return found


def corpus_tokens(path=None) -> torch.Tensor:
    """All documents encoded and joined, each followed by <|endoftext|>, as one int64 tensor."""
    eot = tokenizer().eot_token
    ids: list[int] = []
    for document in read_documents(path):
        ids.extend(encode(document))
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.int64)


# ---------------------------------------------------------------------------------------------- batches
def pack(tokens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Cut the token stream into [n, seq_len] rows; the short tail is dropped."""
    n_rows = tokens.numel() // seq_len
    if n_rows == 0:
        raise LabsError(f"the corpus has {tokens.numel()} tokens, fewer than one sequence of {seq_len}")
    return tokens[: n_rows * seq_len].view(n_rows, seq_len)


def rank_batches(rows: torch.Tensor, micro_batch: int, rank: int, world_size: int, seed: int, start: int = 0):
    """Endless micro-batches for one rank. Each epoch reshuffles all rows with `seed + epoch`
    (the same permutation on every rank) and deals row i to rank i % world_size, so ranks never
    overlap and a run is reproducible from its seed. Micro-batch k of every rank together are rows
    k*B ... (k+1)*B-1 of the permutation (B = micro_batch x world_size), so 2 ranks of 2 and 1 rank of 4 see the
    same rows. `start`: skip that many micro-batches (a resumed run continues where the checkpoint stopped)."""
    per_rank = rows.shape[0] // world_size
    batches_per_epoch = per_rank // micro_batch
    if batches_per_epoch == 0:
        raise LabsError(f"{rows.shape[0]} sequences cannot fill one micro-batch of {micro_batch} "
                        f"on each of {world_size} ranks: use more data or a shorter --seq-len")
    epoch, first = divmod(start, batches_per_epoch)
    while True:
        order = torch.randperm(rows.shape[0], generator=torch.Generator().manual_seed(seed + epoch))
        mine = order[rank::world_size][: batches_per_epoch * micro_batch]
        for i in range(first, batches_per_epoch):
            yield rows[mine[i * micro_batch:(i + 1) * micro_batch]]
        epoch, first = epoch + 1, 0
