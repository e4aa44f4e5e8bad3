"""audit.py's page (issue 60): every finding on one self-contained report.html that opens offline and can be mailed,
in the manner of fastai's plot_top_losses, most_confused and ImageClassifierCleaner, but as a static file.

Images are embedded as data: URIs (each shown image read once, as a thumbnail); every path and class name is user
data and is escaped; a Content-Security-Policy lets the page fetch nothing and run no script even if an escape were
missed. The page replaces only an earlier report of ours (its first line says so), never a user's own file.
"""

from __future__ import annotations

import base64
import html
import io
import numbers
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from PIL import Image

from core.config import DataConfig
from core.errors import UserError
from core.files import check_folder, check_replaceable, starts_with, write_output

HEAD = "<!DOCTYPE html>\n<!-- audit.py report: what is wrong with my data -->\n"  # our outputs' first bytes
OURS = starts_with(HEAD.encode())
EXPECTED = "an earlier report.html of audit.py"
THUMB = 128  # a thumbnail's longest side in pixels (smaller images are kept as they are; CSS scales them up)
JPEG_QUALITY = 85  # downscaled photos: a tenth of a PNG's bytes
CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"  # nothing fetched, no script, offline


@dataclass(frozen=True)
class Limits:
    """How many items each section shows: a page of thousands of images would not open; the CSVs hold every row."""

    label_issues: int = 50
    duplicates: int = 50
    top_losses: int = 36
    confused: int = 50
    files: int = 200


@dataclass
class AuditFindings:
    """What the audit found, as plain data (other modules compute it; this one only shows it)."""

    evidence: str  # what the label findings rest on, e.g. "out-of-fold predictions of 5 folds"
    label_issues: list[dict[str, Any]] = field(default_factory=list)  # {path, given, suggested, score}, worst first
    duplicates: list[dict[str, Any]] = field(default_factory=list)  # {path_a, path_b, split_a, split_b, distance}
    top_losses: list[dict[str, Any]] = field(default_factory=list)  # {path, given, predicted, loss, probability}
    confused: list[dict[str, Any]] = field(default_factory=list)  # {actual, predicted, count}
    files: list[dict[str, Any]] = field(default_factory=list)  # {path, kind, detail, remedy}
    class_counts: dict[str, int] = field(default_factory=dict)
    folds: dict[str, Any] | None = None  # {"folds": [{"fold": i, ...}], "mean": {...}, "std": {...}}
    counts: dict[str, int] = field(default_factory=dict)  # headline counts, shown first
    root: Path | None = None  # where relative paths resolve
    limits: Limits = field(default_factory=Limits)


# ---- writing ---------------------------------------------------------------------------------------------------

def check_report_path(path: Path, option: str = "--output-dir") -> None:
    """Refuse a report path that cannot be written or holds a user's own file, before any audit work is done."""
    check_folder(path, option)
    check_replaceable(path, OURS, EXPECTED, option)


def write_report(path: Path, findings: AuditFindings, option: str = "--output-dir") -> None:
    """The page at `path`, atomically, over nothing but an earlier report of ours; a failed write is one line."""
    path = Path(path)
    check_report_path(path, option)  # before reading the images
    page = render_report(findings).encode("utf-8")
    try:
        write_output(path, page, OURS, EXPECTED, option)
    except OSError as err:
        raise UserError(f"cannot write {path} ({err.strerror or err}); free disk space or make it writable, or "
                        f"choose another {option}") from None


# ---- the page --------------------------------------------------------------------------------------------------

def render_report(findings: AuditFindings) -> str:
    """The whole page as text: the headline first, then one section per kind of finding."""
    limits = findings.limits
    issues = findings.label_issues[:limits.label_issues]
    pairs = leaks_first(findings.duplicates)[:limits.duplicates]
    losses = findings.top_losses[:limits.top_losses]
    thumbs = thumbnails(shown_paths(issues, pairs, losses), findings.root)
    body = [headline(findings),
            section("label-issues", "Suspected label errors", label_issues_html(issues, thumbs),
                    len(issues), len(findings.label_issues),
                    "Most suspect first; score in [0, 1], lower is more suspect."),
            section("duplicates", "Near-duplicates and train/val leaks", pairs_html(pairs, thumbs),
                    len(pairs), len(findings.duplicates),
                    "Leaks (a pair across splits) first: the model is scored on images it trained on."),
            section("top-losses", "Top losses", top_losses_html(losses, thumbs),
                    len(losses), len(findings.top_losses), "The images the model gets most wrong."),
            section("confused", "Most confused", confused_html(findings.confused[:limits.confused]),
                    min(len(findings.confused), limits.confused), len(findings.confused),
                    "Pairs of classes the model mixes up, most often first."),
            section("files", "File problems", files_html(findings.files[:limits.files]),
                    min(len(findings.files), limits.files), len(findings.files),
                    "Files that cannot be read or that the model sees otherwise than a viewer shows them."),
            section("classes", "Images per class", classes_html(findings.class_counts),
                    len(findings.class_counts), len(findings.class_counts), imbalance(findings.class_counts))]
    if findings.folds:
        body.append(section("folds", "Cross-validation folds", folds_html(findings.folds), 0, 0,
                            "The models whose out-of-fold predictions the label findings rest on."))
    return page(body)


def page(body: list[str]) -> str:
    """The sections in a page of their own: our first line, UTF-8, inline CSS, a policy that fetches nothing."""
    return (f'{HEAD}<html lang="en">\n<head>\n<meta charset="utf-8">\n'
            f'<meta http-equiv="Content-Security-Policy" content="{CSP}">\n'
            f"<title>Data audit</title>\n<style>{CSS}</style>\n</head>\n<body>\n" + "\n".join(body)
            + "\n</body>\n</html>\n")


def shown_paths(issues: list[dict[str, Any]], pairs: list[dict[str, Any]], losses: list[dict[str, Any]]) -> list[str]:
    """The paths of every image the page shows, in page order."""
    return ([row["path"] for row in issues] + [row[key] for row in pairs for key in ("path_a", "path_b")]
            + [row["path"] for row in losses])


def headline(findings: AuditFindings) -> str:
    """What the label findings rest on and the headline counts: the page's first screen."""
    counts = "".join(f"<li><b>{text(n)}</b> {text(name)}</li>" for name, n in findings.counts.items())
    return (f'<header>\n<h1>Data audit</h1>\n<p class="evidence">Label findings rest on: '
            f'<b>{text(findings.evidence)}</b></p>\n<ul class="counts">{counts}</ul>\n</header>')


def section(anchor: str, title: str, body: str, shown: int, total: int, note: str) -> str:
    """One titled section; says how many items are shown when the limit cut some."""
    cut = f'<p class="cut">{shown} of {total} shown; the CSV has all.</p>' if shown < total else ""
    intro = f"<p>{text(note)}</p>" if note else ""
    return f'<section id="{anchor}">\n<h2>{text(title)}</h2>\n{intro}{cut}\n{body}\n</section>'


def leaks_first(pairs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Cross-split pairs before same-split ones (order otherwise kept), so the limit never hides a leak."""
    return sorted(pairs, key=lambda pair: not is_leak(pair))


def is_leak(pair: dict[str, Any]) -> bool:
    """A pair across splits: the same image both trained on and scored on."""
    return pair.get("split_a") != pair.get("split_b")


def label_issues_html(rows: list[dict[str, Any]], thumbs: dict[str, str]) -> str:
    """ImageClassifierCleaner's view as cards: the image, its given and suggested class, the score."""
    return grid([card(thumbs[row["path"]], row["path"], classes(row["given"], "&rarr;", row["suggested"]),
                      f'score {number(row["score"], 3)}') for row in rows])


def top_losses_html(rows: list[dict[str, Any]], thumbs: dict[str, str]) -> str:
    """fastai's plot_top_losses: given / predicted / loss / probability under each image."""
    return grid([card(thumbs[row["path"]], row["path"], classes(row["given"], "/", row["predicted"]),
                      f'loss {number(row["loss"], 3)}, probability {number(row["probability"], 3)}') for row in rows])


def classes(given: Any, between: str, other: Any) -> str:
    """A card's line of classes: the given one, then the model's."""
    return f'<span class="given">{text(given)}</span> {between} <span class="suggested">{text(other)}</span>'


def pairs_html(rows: list[dict[str, Any]], thumbs: dict[str, str]) -> str:
    """Each pair side by side, its distance between; a leak is marked in red."""
    out = []
    for row in rows:
        leak = is_leak(row)
        flag = (f'<b class="leak-flag">LEAK {text(row["split_a"])} / {text(row["split_b"])}</b>' if leak
                else f'<span>both {text(row["split_a"])}</span>')
        out.append(f'<div class="pair{" leak" if leak else ""}">'
                   f'{figure(thumbs[row["path_a"]], row["path_a"], text(row["split_a"]))}'
                   f'<div class="between">{flag}<br>distance {number(row["distance"], 4)}</div>'
                   f'{figure(thumbs[row["path_b"]], row["path_b"], text(row["split_b"]))}</div>')
    return "\n".join(out) or NONE


def confused_html(rows: list[dict[str, Any]]) -> str:
    """fastai's most_confused as a table."""
    return table(("actual", "predicted", "count"), [(r["actual"], r["predicted"], r["count"]) for r in rows])


def files_html(rows: list[dict[str, Any]]) -> str:
    """The file checks: what is wrong with each file and what to do."""
    return table(("path", "kind", "detail", "remedy"), [(r["path"], r["kind"], r["detail"], r["remedy"]) for r in rows])


def classes_html(counts: dict[str, int]) -> str:
    """Images per class, each with a bar against the largest class."""
    largest = max(counts.values(), default=0) or 1
    rows = [f'<tr><td>{text(name)}</td><td class="num">{n}</td><td class="bar">'
            f'<span style="width:{100 * n / largest:.1f}%"></span></td></tr>' for name, n in counts.items()]
    return f'<table>\n<tr><th>class</th><th>images</th><th></th></tr>\n{"".join(rows)}\n</table>' if rows else NONE


def imbalance(counts: dict[str, int]) -> str:
    """The largest class over the smallest: how far a plain accuracy can mislead."""
    if len(counts) < 2:
        return ""
    big, small = max(counts, key=counts.get), min(counts, key=counts.get)
    if counts[small] == 0:
        return f"Imbalance: class {small} has no images."
    return (f"Imbalance ratio {counts[big] / counts[small]:.1f} (largest class {big}: {counts[big]} images, "
            f"smallest {small}: {counts[small]}).")


def folds_html(folds: dict[str, Any]) -> str:
    """The k-fold summary: one row per fold, then the mean and the standard deviation."""
    rows = folds.get("folds", [])
    columns = list(dict.fromkeys(k for row in rows for k in row if k != "fold"))
    body = [[row.get("fold", "")] + [row.get(c) for c in columns] for row in rows]
    body += [[name] + [folds[name].get(c) for c in columns] for name in ("mean", "std") if folds.get(name)]
    return table(["fold", *columns], body)


# ---- pieces ----------------------------------------------------------------------------------------------------

NONE = '<p class="none">None found.</p>'


def text(value: Any) -> str:
    """User data (paths, class names) as safe HTML text; a name that is not UTF-8 shows its escapes."""
    return html.escape(str(value).encode("utf-8", "backslashreplace").decode("utf-8"))


def number(value: Any, digits: int = 4) -> str:
    """A float to `digits` significant digits, None as nothing, anything else as it is (escaped)."""
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, numbers.Real):  # numpy's float32 too
        return f"{value:.{digits}g}"
    return "" if value is None else text(value)


def table(columns: Iterable[str], rows: list[Iterable[Any]]) -> str:
    """A plain table of escaped cells (floats to 4 significant digits)."""
    head = "".join(f"<th>{text(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{number(cell)}</td>" for cell in row) + "</tr>\n" for row in rows)
    return f"<table>\n<tr>{head}</tr>\n{body}\n</table>" if rows else NONE


def card(thumb: str, path: str, classes: str, numbers: str) -> str:
    """One image card of a grid."""
    return (f'<div class="card">{thumb}<div class="path">{text(path)}</div>'
            f'<div>{classes}</div><div class="numbers">{numbers}</div></div>')


def figure(thumb: str, path: str, caption: str) -> str:
    """An image with its path and a caption under it."""
    return f'<figure>{thumb}<figcaption><span class="path">{text(path)}</span><br>{caption}</figcaption></figure>'


def grid(cards: list[str]) -> str:
    """Cards side by side, as many as the window holds."""
    return '<div class="grid">\n' + "\n".join(cards) + "\n</div>" if cards else NONE


# ---- images ----------------------------------------------------------------------------------------------------

def thumbnails(paths: list[str], root: Path | None) -> dict[str, str]:
    """Each distinct path's <img> (or placeholder) once, however many sections show it."""
    return {path: thumbnail_html(path, resolve(path, root)) for path in dict.fromkeys(paths)}


def resolve(path: str | Path, root: Path | None) -> Path:
    """A finding's path on disk: absolute as it is, relative under the audit's root."""
    path = Path(path)
    return path if path.is_absolute() or root is None else Path(root) / path


def thumbnail_html(name: str | Path, path: Path) -> str:
    """The image as an embedded thumbnail, or a placeholder naming the file: one bad file never stops the page."""
    try:
        uri = thumbnail_uri(path)
    except Exception as err:  # any decoder failure (OSError, DecompressionBombError, SyntaxError ...): a placeholder
        return f'<div class="thumb missing" title="{text(err)}">cannot read<br>{text(name)}</div>'
    return f'<img class="thumb" src="{uri}" alt="{text(name)}">'


def thumbnail_uri(path: Path) -> str:
    """A data: URI of the image as the model reads it (PIL, EXIF orientation ignored), longest side at most THUMB."""
    with warnings.catch_warnings(), Image.open(path) as image:
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # refused below, by the app's own limit
        width, height = image.size
        if width * height > DataConfig.max_image_pixels:
            raise ValueError(f"{width}x{height} pixels, more than data.max_image_pixels")
        image.draft("RGB", (THUMB, THUMB))  # a JPEG decoded at 1/2 to 1/8 scale: a fraction of the time
        image = image.convert("RGB")
    size = thumb_size(width, height)
    if size == (width, height):
        return data_uri(image, "PNG")  # small (digits): its own pixels, scaled up crisply by the page's CSS
    return data_uri(image.resize(size, Image.Resampling.LANCZOS), "JPEG")


def thumb_size(width: int, height: int) -> tuple[int, int]:
    """Longest side at most THUMB, aspect kept; a smaller image keeps its size (never upscaled into blur)."""
    scale = min(1.0, THUMB / max(width, height))
    return max(1, round(width * scale)), max(1, round(height * scale))


def data_uri(image: Image.Image, fmt: str) -> str:
    """The image encoded as `fmt` in a base64 data: URI."""
    buffer = io.BytesIO()
    image.save(buffer, fmt, **({"quality": JPEG_QUALITY} if fmt == "JPEG" else {"optimize": True}))
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(buffer.getvalue()).decode('ascii')}"


CSS = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; max-width: 1400px; }
h1 { margin-bottom: 0.2em; } h2 { border-bottom: 1px solid #ccc; padding-bottom: 0.2em; margin-top: 1.6em; }
.evidence { font-size: 1.05em; }
.counts { list-style: none; padding: 0; display: flex; flex-wrap: wrap; gap: 0.6em; }
.counts li { background: #f2f2f2; border-radius: 6px; padding: 0.4em 0.8em; }
.cut { color: #a15c00; }
.none { color: #777; }
.grid { display: flex; flex-wrap: wrap; gap: 0.8em; }
.card { width: 160px; border: 1px solid #ddd; border-radius: 6px; padding: 6px; font-size: 0.85em; }
.thumb { width: 128px; height: 128px; object-fit: contain; image-rendering: pixelated; background: #eee;
         display: block; margin: 0 auto 4px auto; }
.missing { display: flex; align-items: center; justify-content: center; text-align: center; overflow: hidden;
           border: 2px dashed #c00; color: #c00; font-size: 0.75em; word-break: break-all; box-sizing: border-box; }
.path { color: #555; font-size: 0.85em; word-break: break-all; }
.given { color: #c00; } .suggested { color: #070; font-weight: bold; }
.numbers { color: #555; }
.pair { display: flex; align-items: center; gap: 1em; border: 1px solid #ddd; border-radius: 6px; padding: 6px;
        margin-bottom: 0.6em; }
.pair figure { margin: 0; width: 200px; font-size: 0.85em; }
.pair.leak { border: 2px solid #c00; background: #fff4f4; }
.between { width: 160px; text-align: center; font-size: 0.9em; }
.leak-flag { color: #fff; background: #c00; padding: 2px 6px; border-radius: 4px; }
table { border-collapse: collapse; font-size: 0.9em; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f2f2f2; }
.num { text-align: right; }
.bar { width: 300px; } .bar span { display: block; height: 0.9em; background: #4a7ebb; }
"""
