"""Stage 1: sources. Find files, tell them apart (identity), read their complete new lines."""

from .discover import Root, is_text_file, make_roots, rank_from_path, walk
from .records import Chunk, SourceRecord
from .tailer import Tracker

__all__ = [
    "Chunk",
    "Root",
    "SourceRecord",
    "Tracker",
    "is_text_file",
    "make_roots",
    "rank_from_path",
    "walk",
]
