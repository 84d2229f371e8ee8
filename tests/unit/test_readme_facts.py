"""What README.md states as fact and the code decides: the Python it needs, where the demo model is made, how
long `make test` takes (measured, not guessed), and that `up`'s banner says when a key is required."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from shared.demo_model import DEMO_VERSION

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
DOCS = [README, *(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))]


def test_the_python_it_needs_is_pyprojects():
    needs = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert needs.startswith(">=")
    stated = set(re.findall(r"Python (3\.\d+)\+", README))
    assert stated == {needs.removeprefix(">=")}, stated


def test_the_demo_models_folder_is_the_one_made_now():
    named = {int(v) for doc in DOCS for v in re.findall(r"demo-model-v(\d+)", doc)}
    assert named <= {DEMO_VERSION}, f"the docs name demo-model-v{named}; shared/demo_model.py makes v{DEMO_VERSION}"


def test_make_test_gives_a_measured_time():
    paragraph = README[README.index("`make run` installs"):README.index("While changing code")]
    assert "a few minutes" not in paragraph
    assert re.search(r"about \d+ minutes on 2 cores, [\d,]+ s in the last\s+CI run", paragraph), paragraph


def test_the_banner_says_when_a_key_is_required():
    line = "rsinfer: clients must send an API key (Authorization: Bearer <key>): "
    assert line.removeprefix("rsinfer: ").split(":")[0] in (ROOT / "rsinfer" / "up.py").read_text()
    assert re.search(r"`rsinfer: clients must send an API key\s+\(Authorization: Bearer <key>\): ", README)
