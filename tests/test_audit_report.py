"""audit.py's report.html (issue 60) on real digits files: one self-contained page that opens offline, its thumbnails
the right size, user data escaped, a bad file a placeholder, the limits said, and a user's own file never replaced."""

from __future__ import annotations

import base64
import io
import os
import shutil
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from assembly.audit_report import HEAD, AuditFindings, Limits, render_report, write_report
from core.errors import UserError
from data.digits import export_digits


class Page(HTMLParser):
    """Every tag with its attributes, and the page's text, as a browser's parser reads them."""

    def __init__(self, page: str) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str]]] = []
        self.texts: list[str] = []
        self.feed(page)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, {k: v or "" for k, v in attrs}))

    def handle_data(self, data: str) -> None:
        self.texts.append(data)

    def images(self) -> dict[str, str]:
        """Each <img>'s alt (the path shown) with its src."""
        return {attrs["alt"]: attrs["src"] for tag, attrs in self.tags if tag == "img"}


@pytest.fixture(scope="module")
def digits(tmp_path_factory) -> Path:
    return export_digits(tmp_path_factory.mktemp("audit") / "digits")


def pngs(root: Path, n: int) -> list[str]:
    """n of the digits' files, relative to the root."""
    return [str(p.relative_to(root)) for p in sorted(root.glob("*/*/*.png"))[:n]]


def findings(root: Path, issues: int = 4, **changes) -> AuditFindings:
    """Findings of every kind on real digits files (paths relative to `root`, one absolute)."""
    paths = pngs(root, issues + 10)
    val = str(sorted(root.glob("val/3/*.png"))[0].relative_to(root))
    values = dict(
        evidence="out-of-fold predictions of 5 folds",
        label_issues=[{"path": p, "given": p.split("/")[1], "suggested": "7", "score": 0.01 * i}
                      for i, p in enumerate(paths[:issues])],
        duplicates=[{"path_a": paths[-1], "path_b": paths[-2], "split_a": "train", "split_b": "train", "distance": 3},
                    {"path_a": str(root / paths[-3]), "path_b": val, "split_a": "train",
                     "split_b": "val", "distance": 0}],
        top_losses=[{"path": p, "given": "1", "predicted": "2", "loss": 4.5, "probability": 0.011}
                    for p in paths[-6:-3]],
        confused=[{"actual": "3", "predicted": "8", "count": 7}],
        files=[{"path": "val/9/0001.png", "kind": "greyscale", "detail": "1 channel", "remedy": "none needed"}],
        class_counts={"3": 30, "8": 120}, counts={"label issues": issues, "duplicate pairs": 2, "leaks": 1},
        folds={"folds": [{"fold": 0, "val_top1": 97.5, "val_loss": 0.081}, {"fold": 1, "val_top1": 96.1,
                                                                            "val_loss": 0.112}],
               "mean": {"val_top1": 96.8, "val_loss": 0.0965}, "std": {"val_top1": 0.7, "val_loss": 0.0155}},
        root=root)
    values.update(changes)
    return AuditFindings(**values)


def decode(src: str) -> Image.Image:
    """A data: URI's image, decoded back."""
    head, payload = src.split(",", 1)
    assert head.startswith("data:image/") and head.endswith(";base64")
    return Image.open(io.BytesIO(base64.b64decode(payload)))


def test_the_page_is_self_contained(digits, tmp_path):
    """Every image embedded, nothing to fetch: no link, no script, no src or href leaving the page."""
    write_report(tmp_path / "report.html", findings(digits))
    page = (tmp_path / "report.html").read_text()
    parsed = Page(page)
    tags = [tag for tag, _ in parsed.tags]
    assert "link" not in tags and "script" not in tags and "iframe" not in tags
    images = [attrs["src"] for tag, attrs in parsed.tags if tag == "img"]
    assert len(images) == 4 + 4 + 3 and all(src.startswith("data:image/") for src in images)
    outward = [(tag, k, v) for tag, attrs in parsed.tags for k, v in attrs.items()
               if k in ("src", "href", "action", "srcset", "poster") and not v.startswith(("data:image/", "#"))]
    assert outward == []
    assert "url(" not in page and "@import" not in page and "http:" not in page and "https:" not in page
    assert ("meta", {"http-equiv": "Content-Security-Policy",
                     "content": "default-src 'none'; img-src data:; style-src 'unsafe-inline'"}) in parsed.tags
    text = " ".join(parsed.texts)
    assert "out-of-fold predictions of 5 folds" in text and "LEAK train / val" in text
    assert "Imbalance ratio 4.0 (largest class 8: 120 images, smallest 3: 30)." in text


def test_thumbnails_decode_back_at_their_size(digits, tmp_path):
    """32 px digits keep their own pixels (PNG, CSS scales them up crisply); photos shrink to 128 px on their long
    side, aspect kept (JPEG)."""
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (200, 300, 3), np.uint8)).save(tmp_path / "wide.jpg")
    Image.fromarray(np.random.default_rng(1).integers(0, 256, (400, 90), np.uint8)).save(tmp_path / "tall.png")
    digit = pngs(digits, 1)[0]
    issues = [{"path": p, "given": "0", "suggested": "6", "score": 0.2}
              for p in (digit, str(tmp_path / "wide.jpg"), str(tmp_path / "tall.png"))]
    images = Page(render_report(findings(digits, label_issues=issues))).images()
    shown = {row["path"]: (decode(images[row["path"]]).format, decode(images[row["path"]]).size) for row in issues}
    assert shown == {digit: ("PNG", (32, 32)), str(tmp_path / "wide.jpg"): ("JPEG", (128, 85)),
                     str(tmp_path / "tall.png"): ("JPEG", (29, 128))}
    original = np.asarray(Image.open(digits / digit).convert("RGB"))
    assert np.array_equal(np.asarray(decode(images[digit]).convert("RGB")), original)  # its own pixels


def test_a_hostile_name_is_escaped(digits, tmp_path):
    """A file and a class named as markup stay text: no tag, no attribute, no script is injected."""
    hostile = tmp_path / "<img src=x onerror=alert(1)>'\".png"
    shutil.copy(digits / pngs(digits, 1)[0], hostile)
    issue = {"path": str(hostile), "given": "<script>alert(2)</script>", "suggested": "<b>7</b>", "score": 0.1}
    broken = {"path": "<svg onload=alert(3)>.png", "given": "1", "predicted": "2", "loss": 1.0, "probability": 0.5}
    parsed = Page(render_report(findings(digits, label_issues=[issue], top_losses=[broken],
                                         class_counts={"<i>a</i>": 1, "b": 2})))
    tags = [tag for tag, _ in parsed.tags]
    assert "script" not in tags and "svg" not in tags and "b" in tags  # the page's own <b>, never the class's
    assert all(not k.startswith("on") for _, attrs in parsed.tags for k in attrs)
    assert all(attrs["src"].startswith("data:image/") for tag, attrs in parsed.tags if tag == "img")
    assert str(hostile) in parsed.images()  # the alt text is the name, whole
    text = "".join(parsed.texts)
    assert "<script>alert(2)</script>" in text and "<b>7</b>" in text and "<svg onload=alert(3)>.png" in text
    assert "<i>a</i>" in text


def test_a_name_that_is_not_utf8_is_shown(digits, tmp_path):
    """A file name of bytes that are not UTF-8 (os.listdir gives it surrogates) is shown by its escapes and read."""
    odd = tmp_path / os.fsdecode(b"caf\xe9.png")
    shutil.copy(digits / pngs(digits, 1)[0], odd)
    write_report(tmp_path / "report.html", findings(digits, label_issues=[{"path": str(odd), "given": "1",
                                                                            "suggested": "7", "score": 0.1}]))
    images = Page((tmp_path / "report.html").read_text(encoding="utf-8")).images()
    assert decode(images[f"{tmp_path}/caf\\udce9.png"]).size == (32, 32)


def test_an_unreadable_image_is_a_placeholder(digits, tmp_path):
    """A corrupt file and a missing one each show a box naming the file; the rest of the page is whole."""
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    issues = [{"path": p, "given": "1", "suggested": "7", "score": 0.3}
              for p in (str(tmp_path / "broken.png"), "train/0/missing.png", pngs(digits, 1)[0])]
    write_report(tmp_path / "report.html", findings(digits, label_issues=issues))
    parsed = Page((tmp_path / "report.html").read_text())
    boxes = [attrs for tag, attrs in parsed.tags if tag == "div" and attrs.get("class") == "thumb missing"]
    assert len(boxes) == 2
    text = " ".join(parsed.texts)
    assert f"cannot read {tmp_path / 'broken.png'}" in text and "cannot read train/0/missing.png" in text
    assert pngs(digits, 1)[0] in parsed.images()


def test_the_limits_say_how_many_are_shown(digits):
    """At most N cards a section; the cut is said; a leak is never the pair cut."""
    page = render_report(findings(digits, issues=60))
    parsed = Page(page)
    assert "50 of 60 shown; the CSV has all." in " ".join(parsed.texts)
    assert len(parsed.images()) == 50 + 4 + 3
    pairs = findings(digits, issues=60).duplicates
    few = render_report(findings(digits, issues=60, limits=Limits(label_issues=3, duplicates=1)))
    text = " ".join(Page(few).texts)
    assert "3 of 60 shown; the CSV has all." in text and "1 of 2 shown; the CSV has all." in text
    assert "LEAK train / val" in text and pairs[0]["path_a"] not in text  # the same-split pair (listed first) cut


def test_the_report_replaces_only_an_earlier_report(digits, tmp_path):
    """Written atomically through core/files: over an earlier report of ours; a user's page is refused with one line
    and left as it is; a failed render leaves the earlier report whole and no temp file."""
    out = tmp_path / "report.html"
    write_report(out, findings(digits, issues=1))
    write_report(out, findings(digits, issues=2))
    assert out.read_text().startswith(HEAD) and "label issues</li>" in out.read_text()
    earlier = out.read_bytes()
    with pytest.raises(KeyError):
        write_report(out, findings(digits, label_issues=[{"path": pngs(digits, 1)[0]}]))
    assert out.read_bytes() == earlier and sorted(p.name for p in tmp_path.iterdir()) == ["report.html"]
    mine = tmp_path / "mine" / "report.html"
    mine.parent.mkdir()
    mine.write_text("<!DOCTYPE html>\n<html><body>my own notes</body></html>\n")
    with pytest.raises(UserError) as err:
        write_report(mine, findings(digits))
    assert str(err.value) == (f"{mine} is a file, not an earlier report.html of audit.py; it was left as it is: "
                              "move it away or choose another --output-dir")
    assert mine.read_text() == "<!DOCTYPE html>\n<html><body>my own notes</body></html>\n"
    with pytest.raises(UserError, match="does not exist"):
        write_report(tmp_path / "no" / "report.html", findings(digits))
