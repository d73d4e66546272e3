"""Which training images will reach the model with empty ground truth (COCO format).

mmdet's CocoDataset drops, per annotation: ``ignore`` ones, boxes whose intersection with the
image is empty, boxes with ``area <= 0`` or ``w < 1`` or ``h < 1``, and categories outside the
configured classes; crowd boxes are kept only as ignored instances. An image whose annotations
are all dropped yields a DetDataSample with an empty ``gt_instances.labels``.

The annotation file is streamed (files of hundreds of MB): top-level arrays are decoded element
by element, and categories may come after the annotations (they do in the official files).
"""

from __future__ import annotations

import codecs
import json
from array import array
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import field
from pathlib import Path
from typing import IO, Any

from .._dc import dataclass
from ..errors import NanwatchError

READ = 1 << 20

REASONS = {
    "none": "no annotations",
    "classes": "every category outside the classes",
    "degenerate": "only degenerate, crowd or ignored boxes",
    "mixed": "out-of-range categories and degenerate boxes",
}


class DatasetError(NanwatchError):
    """The annotation file cannot be read as COCO."""


class _Stream:
    """Incremental JSON: top-level object keys and the elements of its arrays, one at a time."""

    def __init__(self, f: IO[bytes], progress: Callable[[int], None] | None = None) -> None:
        self.f = f
        self.dec = codecs.getincrementaldecoder("utf-8")()
        self.buf = ""
        self.pos = 0
        self.eof = False
        self.json = json.JSONDecoder()
        self.progress = progress

    def _fill(self) -> bool:
        if self.eof:
            return False
        raw = self.f.read(READ)
        if self.progress is not None:
            self.progress(len(raw))
        if not raw:
            self.eof = True
            self.buf = self.buf[self.pos :] + self.dec.decode(b"", final=True)
            self.pos = 0
            return False
        self.buf = self.buf[self.pos :] + self.dec.decode(raw)
        self.pos = 0
        return True

    def _ws(self) -> str:
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in " \t\r\n":
                self.pos += 1
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self._fill():
                raise DatasetError("unexpected end of file")

    def _expect(self, c: str) -> None:
        if self._ws() != c:
            raise DatasetError(
                f"expected {c!r} at character {self.pos}, found {self.buf[self.pos]!r}"
            )
        self.pos += 1

    def value(self) -> Any:
        self._ws()
        while True:
            try:
                v, end = self.json.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError as e:
                if self._fill():
                    continue
                raise DatasetError(f"not valid JSON: {e.msg} near character {e.pos}") from None
            # a number cut by the buffer would decode as a shorter number: read on
            if end >= len(self.buf) and not self.eof and self._fill():
                continue
            self.pos = end
            return v

    def top_level(self, arrays: set[str]) -> Iterator[tuple[str, Any]]:
        """Yield (key, element) for elements of the wanted arrays, (key, value) for others."""
        self._expect("{")
        if self._ws() == "}":
            return
        while True:
            key = self.value()
            self._expect(":")
            if key in arrays and self._ws() == "[":
                self.pos += 1
                if self._ws() == "]":
                    self.pos += 1
                else:
                    while True:
                        yield key, self.value()
                        c = self._ws()
                        self.pos += 1
                        if c == "]":
                            break
                        if c != ",":
                            raise DatasetError(f"expected ',' or ']' in {key!r}, found {c!r}")
            else:
                yield key, self.value()
            c = self._ws()
            self.pos += 1
            if c == "}":
                return
            if c != ",":
                raise DatasetError(f"expected ',' or '}}' at top level, found {c!r}")


@dataclass
class Report:
    images_total: int = 0
    annotations_total: int = 0
    classes: list[str] = field(default_factory=list)
    empty_gt_images: list[dict[str, Any]] = field(default_factory=list)
    out_of_range: list[dict[str, Any]] = field(default_factory=list)
    unknown_classes: list[str] = field(default_factory=list)
    reasons: dict[str, int] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return {
            "images_total": self.images_total,
            "annotations_total": self.annotations_total,
            "classes": self.classes,
            "empty_gt_images": self.empty_gt_images,
            "reasons": self.reasons,
            "out_of_range": self.out_of_range,
            "unknown_classes": self.unknown_classes,
        }


def check(
    path: str | Path,
    classes: list[str] | None = None,
    progress: Callable[[int], None] | None = None,
) -> Report:
    """Stream a COCO annotation file and report the images whose ground truth will be empty."""
    p = Path(path)
    images: dict[int, tuple[str, float, float]] = {}
    # per annotation: image id, category id, flags (1 ignore, 2 crowd), and x, y, w, h, area
    ann_ids = array("q")
    ann_cats = array("q")
    ann_flags = array("b")
    ann_box = array("d")
    categories: dict[int, str] = {}
    try:
        f = p.open("rb")
    except OSError as e:
        raise DatasetError(f"{p}: cannot open the annotation file ({e.strerror})") from None
    with f:
        stream = _Stream(f, progress)
        try:
            for key, item in stream.top_level({"images", "annotations", "categories"}):
                if not isinstance(item, dict):
                    continue
                if key == "images":
                    images[int(item["id"])] = (
                        str(item.get("file_name", "")),
                        float(item.get("width") or 0),
                        float(item.get("height") or 0),
                    )
                elif key == "annotations":
                    bbox = item.get("bbox") or [0, 0, 0, 0]
                    x, y, w, h = (float(v) for v in [*list(bbox), 0, 0, 0, 0][:4])
                    ann_ids.append(int(item["image_id"]))
                    ann_cats.append(int(item.get("category_id", -1)))
                    ann_flags.append(
                        (1 if item.get("ignore") else 0) | (2 if item.get("iscrowd") else 0)
                    )
                    ann_box.extend((x, y, w, h, float(item.get("area", w * h))))
                elif key == "categories":
                    categories[int(item["id"])] = str(item.get("name", item["id"]))
        except (KeyError, TypeError, ValueError) as e:
            raise DatasetError(f"{p}: not a COCO annotation file ({e!r})") from None
        except DatasetError as e:
            raise DatasetError(f"{p}: {e}") from None
    report = Report(images_total=len(images), annotations_total=len(ann_ids))
    if classes:
        names = {n: cid for cid, n in categories.items()}
        allowed = {names[c] for c in classes if c in names}
        report.unknown_classes = [c for c in classes if c not in names]
        report.classes = list(classes)
    else:
        allowed = set(categories)
        report.classes = [categories[c] for c in sorted(categories)]
    usable: Counter[int] = Counter()
    out_range: Counter[int] = Counter()
    degenerate: Counter[int] = Counter()
    per_cat_out: Counter[int] = Counter()
    for i in range(len(ann_ids)):
        img = ann_ids[i]
        info = images.get(img)
        x, y, w, h, area = ann_box[5 * i : 5 * i + 5]
        flags = ann_flags[i]
        if flags & 1:
            degenerate[img] += 1
            continue
        if info is not None and info[1] > 0 and info[2] > 0:
            inter_w = max(0.0, min(x + w, info[1]) - max(x, 0.0))
            inter_h = max(0.0, min(y + h, info[2]) - max(y, 0.0))
            if inter_w * inter_h == 0:
                degenerate[img] += 1
                continue
        if area <= 0 or w < 1 or h < 1:
            degenerate[img] += 1
            continue
        cat = ann_cats[i]
        if cat not in allowed:
            out_range[img] += 1
            per_cat_out[cat] += 1
            continue
        if flags & 2:
            degenerate[img] += 1  # crowd: kept as an ignored instance, not a label
            continue
        usable[img] += 1
    reasons: Counter[str] = Counter()
    for img in sorted(images):
        if usable[img]:
            continue
        if out_range[img] and degenerate[img]:
            reason = "mixed"
        elif out_range[img]:
            reason = "classes"
        elif degenerate[img]:
            reason = "degenerate"
        else:
            reason = "none"
        reasons[reason] += 1
        report.empty_gt_images.append(
            {
                "image_id": img,
                "file_name": images[img][0],
                "reason": REASONS[reason],
                "out_of_range": out_range[img],
                "degenerate": degenerate[img],
            }
        )
    report.reasons = {REASONS[k]: v for k, v in sorted(reasons.items())}
    report.out_of_range = [
        {"category_id": c, "name": categories.get(c), "annotations": n}
        for c, n in sorted(per_cat_out.items(), key=lambda kv: (-kv[1], kv[0]))
    ]
    return report
