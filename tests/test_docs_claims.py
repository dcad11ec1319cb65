"""No page and no error message calls a feature zeroshard has "not yet" without saying where it works.

`FEATURES`: each feature zeroshard implements, the words that name it, and the page that documents it.
Every line of docs/*.md and README.md that says "not yet" (or "not supported yet", "not implemented
yet"), and every message of the DeepSpeed key rules and of `zeroshard.deepspeed`'s refusals that does,
and names one of them must name its page too (or be on it: the page states the feature's limits): a "not
yet" is then about DeepSpeed's or FSDP's own API for something zeroshard does its own way, and the reader is
sent there. A page that called the feature itself
missing would name no page (the migration tables said "tensor parallelism: not yet" after the mesh landed).
"""

import re
from pathlib import Path

import pytest

from zeroshard.config.deepspeed_keys import RULES
from zeroshard.deepspeed.unsupported import NOT_PROVIDED, ZERO_NOT_PROVIDED

ROOT = Path(__file__).resolve().parent.parent
NOT_YET = re.compile(r"not (?:supported |implemented )?yet", re.IGNORECASE)
FEATURES = {  # name -> (the words that name it, the page that documents it)
    "offload": (r"\boffload\b|CPUOffloadPolicy", "offload.md"),
    "tensor parallelism": (r"tensor[- ]parallel", "parallel.md"),
    "pipeline parallelism": (r"pipeline[- ]parallel|pipelining", "parallel.md"),
    "ZeRO++": (r"ZeRO\+\+|\bqwZ\b|\bhpZ\b|\bqgZ\b", "zeropp.md"),
    "the Hugging Face Trainer": (r"\bTrainer\b", "hugging-face.md"),
    "asynchronous checkpoints": (r"async", "fault-tolerance.md"),
    "mixture-of-experts models": (r"\bMoE\b|mixture[- ]of[- ]experts", "stage-3.md"),
}


def _claims() -> list[tuple[str, str]]:
    """(where, text) of every "not yet" line of the docs and every "not yet" message."""
    pages = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
    lines = [(f"{p.name}:{n}", line) for p in pages for n, line in enumerate(p.read_text().splitlines(), 1)]
    messages = [(f"RULES[{key!r}]", rule.why) for key, rule in RULES.items()]
    messages += [(f"zeroshard.deepspeed.{name}", why) for name, why in {**NOT_PROVIDED, **ZERO_NOT_PROVIDED}.items()]
    return [(where, text) for where, text in lines + messages if NOT_YET.search(text)]


def test_the_feature_pages_exist_and_are_about_them():
    for name, (words, page) in FEATURES.items():
        text = (ROOT / "docs" / page).read_text()
        assert re.search(words, text, re.IGNORECASE), f"docs/{page} does not name {name}"


def test_claims_are_found():
    claims = _claims()
    assert any(where.startswith("RULES[") for where, _ in claims) and any(".md:" in where for where, _ in claims)


@pytest.mark.parametrize("name", sorted(FEATURES))
def test_no_not_yet_names_a_working_feature_without_its_page(name):
    words, page = FEATURES[name]
    wrong = [f"{where}: {text.strip()}" for where, text in _claims()  # the feature's own page states its limits
             if re.search(words, text, re.IGNORECASE) and page not in text and not where.startswith(f"{page}:")]
    assert not wrong, f"'not yet' beside {name}, which works (docs/{page}), without naming docs/{page}:\n" + \
        "\n".join(wrong)
