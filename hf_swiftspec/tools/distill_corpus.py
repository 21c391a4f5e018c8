"""What `swiftspec distill` reads: records from text files, folders of them, .jsonl files and `datasets`
datasets (a folder saved with save_to_disk, or `hf:ID` on the Hub), and the split into training and held-out.

A record is one piece of text to train on: plain text (a file, a jsonl "text" field, a dataset's text
column) is a document, cut at line ends into windows of at most `record_chars` characters, each a record
of its own (so that one file is many records, and some of them can be held out); a conversation (a jsonl
"prompt" with an optional "completion" or "response", a "turns" list, a dataset's messages column) is one
record, whole.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

RECORD_CHARS = 4000  # a plain document's window: about 1,000 tokens of English or code
HUB_PREFIX = "hf:"  # --data hf:owner/name: a dataset on the Hub, read through the `datasets` library
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "user": "user", "assistant": "assistant"}


class DistillError(ValueError):
    """Bad input to `swiftspec distill`: the message names the value and the fix."""


@dataclass(frozen=True)
class Record:
    """One piece of training text. messages: a conversation (role/content dicts) or None for plain text;
    document and part: the document it was cut from and its place there (pieces that follow each other in
    one document are packed with no end-of-sequence token between them)."""

    source: str  # "file:line", "file#part", "dataset[split]:row", for errors
    text: str | None
    messages: tuple[dict, ...] | None = None
    document: str = ""
    part: int = 0

    @property
    def open_ended(self) -> bool:
        return self.messages is not None and self.messages[-1]["role"] == "user"


@dataclass(frozen=True)
class DataOptions:
    """How --data is read: a dataset's split and column, the first records of each source, the window."""

    split: str = "train"  # a dataset's split (a saved DatasetDict, a Hub dataset)
    column: str | None = None  # a dataset's text or messages column; None: "text", "messages", "conversations", "prompt"
    limit: int | None = None  # the first N records of each source (a large Hub dataset); None: all
    record_chars: int = RECORD_CHARS


# ---------------------------------------------------------------- plain text: documents, then windows


def windows_of(text: str, size: int) -> list[str]:
    """`text` cut at line ends into pieces of at most `size` characters (a longer line cut where it must)."""
    pieces, current = [], ""
    for line in text.splitlines(keepends=True):
        while len(line) > size:
            if current:
                pieces.append(current)
                current = ""
            pieces.append(line[:size])
            line = line[size:]
        if len(current) + len(line) > size:
            pieces.append(current)
            current = ""
        current += line
    if current:
        pieces.append(current)
    return [p for p in pieces if p.strip()]


def document_records(text: str, where: str, size: int) -> list[Record]:
    pieces = windows_of(text, size)
    if len(pieces) == 1:
        return [Record(where, pieces[0], document=where)]
    return [Record(f"{where}#{i}", piece, document=where, part=i) for i, piece in enumerate(pieces)]


# ---------------------------------------------------------------- jsonl and dataset rows


def record_of(data, where: str, size: int, column: str | None = None) -> list[Record]:
    """The records of one jsonl line or dataset row (several for a long text)."""
    if not isinstance(data, dict):
        raise DistillError(f"{where}: a line must be a JSON object, got {type(data).__name__}.")
    if column is not None:
        if column not in data:
            raise DistillError(f"{where}: no column {column!r} (--data-column); its columns are {sorted(data)}.")
        value = data[column]
        if isinstance(value, str):
            return document_records(value, where, size)
        if isinstance(value, list) and value:
            return [conversation(value, where)]
        raise DistillError(f"{where}: column {column!r} holds {type(value).__name__}; give a column of text or of messages.")
    if isinstance(data.get("text"), str):
        return document_records(data["text"], where, size)
    if isinstance(data.get("prompt"), str):
        messages = [{"role": "user", "content": data["prompt"]}]
        answer = data.get("completion", data.get("response"))
        if isinstance(answer, str):
            messages.append({"role": "assistant", "content": answer})
        return [Record(where, None, tuple(messages), document=where)]
    for key in ("turns", "messages", "conversations"):
        if isinstance(data.get(key), list) and data[key]:
            return [conversation(data[key], where)]
    raise DistillError(
        f"{where}: no 'text' (a string), 'prompt' (a string) or 'turns' / 'messages' / 'conversations' (a non-empty "
        f"list) field; got keys {sorted(data)}. Name the field with --data-column."
    )


def conversation(turns: list, where: str) -> Record:
    return Record(where, None, tuple(message_of(turn, i, where) for i, turn in enumerate(turns)), document=where)


def message_of(turn, index: int, where: str) -> dict:
    """A turn as a {"role", "content"} dict: a string (user and assistant alternating), a role/content dict, or a
    ShareGPT from/value dict."""
    if isinstance(turn, str):
        return {"role": "user" if index % 2 == 0 else "assistant", "content": turn}
    if isinstance(turn, dict) and isinstance(turn.get("content"), str) and turn.get("role"):
        return {"role": turn["role"], "content": turn["content"]}
    if isinstance(turn, dict) and isinstance(turn.get("value"), str) and turn.get("from") in SHAREGPT_ROLES:
        return {"role": SHAREGPT_ROLES[turn["from"]], "content": turn["value"]}
    raise DistillError(f"{where}: turn {index} must be a string, a {{'role', 'content'}} or a {{'from', 'value'}} object, got {turn!r}.")


def jsonl_records(path: Path, options: DataOptions) -> list[Record]:
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            data = json.loads(line)
        except json.JSONDecodeError as err:
            raise DistillError(f"{where} is not valid JSON ({err}); each line of a .jsonl file is one JSON object.") from err
        records += record_of(data, where, options.record_chars, options.column)
        if options.limit is not None and len(records) >= options.limit:
            return records[: options.limit]
    return records


# ---------------------------------------------------------------- datasets


def is_saved_dataset(folder: Path) -> bool:
    """A folder `datasets`' save_to_disk wrote (a Dataset or a DatasetDict)."""
    return (folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file()


def import_datasets():
    try:
        import datasets
    except ImportError as err:
        raise DistillError(
            "reading a `datasets` dataset needs the datasets library: pip install 'hf_swiftspec[distill]' "
            "(or give text or .jsonl files)."
        ) from err
    return datasets


def dataset_rows(source: str, options: DataOptions):
    """(name, the rows of the split) of a saved dataset folder or of `hf:ID`."""
    datasets = import_datasets()
    if source.startswith(HUB_PREFIX):
        name = source[len(HUB_PREFIX):]
        try:  # with --data-limit, streamed: only the rows read are downloaded
            return name, datasets.load_dataset(name, split=options.split, streaming=options.limit is not None)
        except Exception as err:  # the Hub's and the builders' errors have no common base
            raise DistillError(f"--data {source}: cannot load split {options.split!r} ({str(err).splitlines()[0]}).") from err
    loaded = datasets.load_from_disk(source)
    if isinstance(loaded, datasets.DatasetDict):
        if options.split not in loaded:
            raise DistillError(f"--data {source}: no split {options.split!r} (--data-split); it has {sorted(loaded)}.")
        loaded = loaded[options.split]
    return source, loaded


def dataset_records(source: str, options: DataOptions) -> list[Record]:
    name, rows = dataset_rows(source, options)
    records = []
    for index, row in enumerate(rows):
        records += record_of(dict(row), f"{name}[{options.split}]:{index}", options.record_chars, options.column)
        if options.limit is not None and len(records) >= options.limit:
            return records[: options.limit]
    return records


# ---------------------------------------------------------------- every source


def text_files(folder: Path) -> list[Path]:
    """A folder's files, in a fixed order: hidden files and folders skipped."""
    return sorted(p for p in folder.rglob("*") if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts))


def file_records(path: Path, options: DataOptions) -> list[Record]:
    if path.suffix == ".jsonl":
        return jsonl_records(path, options)
    raw = path.read_bytes()
    if b"\0" in raw[:8192]:
        return []  # a binary file in a folder of text: not text to train on
    return document_records(raw.decode("utf-8", errors="replace"), str(path), options.record_chars)


def source_records(source: str, options: DataOptions) -> list[Record]:
    path = Path(source)
    if source.startswith(HUB_PREFIX) or (path.is_dir() and is_saved_dataset(path)):
        return dataset_records(source, options)
    if path.is_dir():
        records = []
        for file in text_files(path):
            records += file_records(file, options)
        return records[: options.limit] if options.limit is not None else records
    if path.is_file():
        records = file_records(path, options)
        return records[: options.limit] if options.limit is not None else records
    raise DistillError(
        f"--data {source}: no such file or folder; give text files, .jsonl files, folders of them, a dataset folder "
        f"saved with save_to_disk, or {HUB_PREFIX}ID for a dataset on the Hub."
    )


def read_records(sources, options: DataOptions = DataOptions()) -> list[Record]:
    """Every record of `sources`, in order; DistillError for a missing source, a bad line, or no records at all."""
    records = []
    for source in map(str, sources):
        records += source_records(source, options)
    if not records:
        listed = ", ".join(map(str, sources)) or "none given"
        raise DistillError(
            f"no training data: --data ({listed}) holds no text. Give text files, folders of them, .jsonl files with a "
            "'text', 'prompt' or 'turns' field per line, or a `datasets` dataset."
        )
    return records


# ---------------------------------------------------------------- held out


def is_heldout(record: Record, percent: int) -> bool:
    """A stable `percent`% of records, chosen by a hash of their content (not their order or their source)."""
    content = record.text if record.text is not None else json.dumps(record.messages)
    return int(hashlib.sha1(content.encode()).hexdigest(), 16) % 100 < percent


def split_records(records: list[Record], percent: int) -> tuple[list[Record], list[Record]]:
    """(training, held-out); with none in either, the last record is held out."""
    heldout = [r for r in records if is_heldout(r, percent)]
    train = [r for r in records if not is_heldout(r, percent)]
    if not heldout or not train:
        if len(records) < 2:
            raise DistillError(
                f"only {len(records)} record in the data: distill needs at least two, one to train on and one held out "
                "to measure agreement and tau on (a text shorter than one window is one record: give more text, or "
                "a smaller --record-chars)."
            )
        train, heldout = records[:-1], records[-1:]
    return train, heldout
