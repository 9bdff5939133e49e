"""Chat rows as ``transformers``' ``Trainer`` and TRL's ``SFTTrainer`` hand them to a collator.

A trainer gives the collator a list of dataset rows. Two trainer settings change those rows
before the collator sees them, and both would train on the wrong data or fail far from the
cause, so they are named here:

* ``remove_unused_columns=True`` (the default) drops the columns the model's forward does not
  take: all of them for ``Trainer`` (``messages``, ``images``, ...), and for ``SFTTrainer`` on a
  vision dataset everything but ``messages`` / ``images`` (so ``videos`` and ``id`` go);
* TRL's dataset preparation (on unless ``dataset_kwargs={"skip_prepare_dataset": True}``, and
  always off for datasets with ``images``) tokenises text rows with the tokenizer's chat
  template, so rows arrive as ``input_ids`` instead of conversations.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from energon_pack.formats.chat_rows import MEDIA_FIELDS
from energon_pack.formats.conversation import conversation_turns, placeholder_kinds
from energon_pack.media.errors import MediaError

__all__ = ["check_media_columns", "row_key", "unreadable_item"]

_KEEP_COLUMNS = "remove_unused_columns=False (TrainingArguments / SFTConfig)"


def row_key(row: Mapping[str, Any], index: int) -> str:
    """The key of a chat row at ``index`` of its micro-batch: its ``id``, else ``row[index]``."""
    return str(row["id"]) if row.get("id") is not None else f"row[{index}]"


def check_media_columns(key: str, row: Mapping[str, Any]) -> None:
    """Raise ValueError if the row's image / video / audio parts need a media column it does not
    have at all (a trainer removed it); a malformed conversation is left to the encoder."""
    field = "messages" if "messages" in row else "conversations"
    try:
        kinds = set(placeholder_kinds(conversation_turns(key, row[field], field)))
    except MediaError:
        return  # fails when it is encoded, under the collator's on_media_error
    for kind, fields in MEDIA_FIELDS.items():
        if kind in kinds and not any(name in row for name in fields):
            raise ValueError(
                f"chat row {key!r} has {kind} parts but no {fields[0]!r} column "
                f"(its columns: {sorted(row)}); the trainer removed it: pass {_KEEP_COLUMNS}"
            )


def unreadable_item(item: Any, index: int) -> str:
    """Why micro-batch item ``index`` is not something the collator reads, and the fix."""
    if isinstance(item, Mapping) and "input_ids" in item:
        return (
            f"micro-batch item #{index} holds input_ids but no 'messages' (columns: "
            f"{sorted(item)}): the trainer tokenised the rows before the collator (TRL's "
            "SFTTrainer prepares text datasets); pass SFTConfig(dataset_kwargs="
            "{'skip_prepare_dataset': True}) so the collator gets the chat rows, or give "
            "the collator a padded batch dict itself"
        )
    if isinstance(item, Mapping):
        return (
            f"micro-batch item #{index} is a dict with columns {sorted(item)} and no "
            "'messages' / 'conversations' / '__key__': if these are dataset rows, the trainer "
            f"removed their columns; pass {_KEEP_COLUMNS}"
        )
    return (
        f"micro-batch item #{index} is a {type(item).__name__}; the collator takes "
        "EncodedSample, a chat row (a dict with 'messages' or 'conversations'), a raw "
        "WebDataset sample dict with '__key__', or a (key, raw_sample) pair (pass a padded HF "
        "batch dict itself, not a list of them)"
    )
