"""check-dataset on generated COCO files: exactly the images with empty ground truth."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import nanwatch.correlate.dataset as dataset
from nanwatch.cli import cli
from nanwatch.correlate.dataset import DatasetError, check


def coco(path: Path, *, seed: int = 0, n_images: int = 300) -> dict[int, str]:
    """A COCO file with known empty images; returns {image_id: reason}. Categories come last."""
    rng = random.Random(seed)
    cats = [{"id": i, "name": f"class{i}"} for i in range(1, 6)]  # 1..5 declared
    images, anns, expected = [], [], {}
    aid = 0

    def ann(img: int, cat: int, bbox: list[float], **extra: Any) -> None:
        nonlocal aid
        aid += 1
        anns.append(
            {
                "id": aid,
                "image_id": img,
                "category_id": cat,
                "bbox": bbox,
                "area": extra.pop("area", bbox[2] * bbox[3]),
                "iscrowd": 0,
                **extra,
            }
        )

    for img in range(1, n_images + 1):
        images.append({"id": img, "file_name": f"{img:012d}.jpg", "width": 640, "height": 480})
        kind = rng.choice(["ok", "ok", "ok", "none", "classes", "degenerate", "mixed", "partial"])
        if kind == "ok":
            for _ in range(rng.randint(1, 4)):
                ann(img, rng.randint(1, 5), [rng.uniform(0, 500), rng.uniform(0, 400), 30, 40])
        elif kind == "none":
            expected[img] = "no annotations"
        elif kind == "classes":
            for _ in range(rng.randint(1, 3)):
                ann(img, rng.choice([0, 6, 7, 91]), [10, 10, 50, 50])
            expected[img] = "every category outside the classes"
        elif kind == "degenerate":
            choice = rng.randint(0, 5)
            if choice == 0:
                ann(img, 2, [10, 10, 0.5, 50])
            elif choice == 1:
                ann(img, 2, [10, 10, 50, 0.4])
            elif choice == 2:
                ann(img, 2, [10, 10, 50, 50], area=0)
            elif choice == 3:
                ann(img, 2, [700, 500, 50, 50])  # entirely outside the image
            elif choice == 4:
                ann(img, 2, [10, 10, 50, 50], iscrowd=1)
            else:
                ann(img, 2, [10, 10, 50, 50], ignore=True)
            expected[img] = "only degenerate, crowd or ignored boxes"
        elif kind == "mixed":
            ann(img, 9, [10, 10, 50, 50])
            ann(img, 3, [10, 10, 0, 0])
            expected[img] = "out-of-range categories and degenerate boxes"
        else:  # one usable box among bad ones: not empty
            ann(img, 9, [10, 10, 50, 50])
            ann(img, 4, [10, 10, 50, 50])
    path.write_text(
        json.dumps(
            {
                "info": {"year": 2026},
                "licenses": [],
                "images": images,
                "annotations": anns,
                "categories": cats,
            },
            indent=1,
        )
    )
    return expected


def test_finds_exactly_the_empty_images(tmp_path: Path) -> None:
    f = tmp_path / "train.json"
    expected = coco(f)
    report = check(f)
    got = {i["image_id"]: i["reason"] for i in report.empty_gt_images}
    assert got == expected
    assert report.images_total == 300
    assert {r["category_id"] for r in report.out_of_range} == {0, 6, 7, 9, 91}
    assert set(expected.values()) == set(report.reasons)


def test_tiny_read_buffer_gives_the_same_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = tmp_path / "train.json"
    coco(f, seed=3, n_images=80)
    whole = check(f).as_json()
    monkeypatch.setattr(dataset, "READ", 7)
    assert check(f).as_json() == whole


def test_classes_subset(tmp_path: Path) -> None:
    f = tmp_path / "train.json"
    f.write_text(
        json.dumps(
            {
                "images": [
                    {"id": 1, "file_name": "a.jpg", "width": 100, "height": 100},
                    {"id": 2, "file_name": "b.jpg", "width": 100, "height": 100},
                ],
                "annotations": [
                    {
                        "id": 1,
                        "image_id": 1,
                        "category_id": 1,
                        "bbox": [1, 1, 10, 10],
                        "area": 100,
                        "iscrowd": 0,
                    },
                    {
                        "id": 2,
                        "image_id": 2,
                        "category_id": 2,
                        "bbox": [1, 1, 10, 10],
                        "area": 100,
                        "iscrowd": 0,
                    },
                ],
                "categories": [{"id": 1, "name": "cat"}, {"id": 2, "name": "dog"}],
            }
        )
    )
    assert check(f).empty_gt_images == []
    report = check(f, ["cat", "zebra"])
    assert [(i["image_id"], i["reason"]) for i in report.empty_gt_images] == [
        (2, "every category outside the classes")
    ]
    assert report.unknown_classes == ["zebra"]


def test_cli_json_and_table(tmp_path: Path) -> None:
    f = tmp_path / "train.json"
    expected = coco(f, seed=5, n_images=40)
    r = CliRunner().invoke(cli, ["check-dataset", str(f), "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["images_total"] == 40
    assert {i["image_id"] for i in out["empty_gt_images"]} == set(expected)
    assert set(out["empty_gt_images"][0]) >= {"image_id", "file_name", "reason"}
    r = CliRunner().invoke(cli, ["check-dataset", str(f)])
    assert r.exit_code == 0 and "will have empty ground truth" in r.output


@pytest.mark.parametrize("text", ["not json", '{"images": [1, 2', "[1, 2, 3]"])
def test_bad_files_give_a_clear_error(tmp_path: Path, text: str) -> None:
    f = tmp_path / "bad.json"
    f.write_text(text)
    with pytest.raises(DatasetError, match=r"bad\.json"):
        check(f)
    r = CliRunner().invoke(cli, ["check-dataset", str(f)])
    assert r.exit_code == 1 and "bad.json" in r.output
