"""Every relative link in the README and the results notes names a file or folder that is in the repository."""
import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_relative_links_resolve():
    notes = ["README.md"] + [os.path.relpath(p, ROOT) for pattern in ("bench/results/**/*.md", "eval/results/**/*.md")
                             for p in glob.glob(os.path.join(ROOT, pattern), recursive=True)]
    assert len(notes) > 20
    broken = []
    for note in notes:
        with open(os.path.join(ROOT, note), encoding="utf-8") as f:
            text = f.read()
        for link in re.findall(r"\]\(([^)\s]+)\)", text):
            if link.startswith(("http://", "https://", "#", "mailto:")):
                continue
            target = os.path.normpath(os.path.join(ROOT, os.path.dirname(note), link.split("#")[0]))
            if not os.path.exists(target):
                broken.append(f"{note}: {link}")
    assert broken == [], broken
