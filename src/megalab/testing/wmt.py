"""WMT'16 En-De fixture: the Hub's parquet layout of `wmt/wmt16` (training) and `wmt/wmt14`
(newstest2013/2014) for config `de-en`, one column `translation` ({"de": str, "en": str}, the
Hub's `Translation` feature), under `wmt/wmt16/de-en/` and `wmt/wmt14/de-en/`.

Sentences are built from a small English-German lexicon (so a model can learn something) and
include what preparation must handle: typographic quotes and non-printing characters to
normalise, hyphenated compounds, pairs that `clean-corpus-n` drops (too short, too long, a bad
length ratio), and words that appear only in the test split (unknown characters for the BPE).
"""

from __future__ import annotations

import random
from pathlib import Path

from megalab.testing.lra_text import to_parquet

LEXICON = [
    ("the house", "das Haus"),
    ("the old house", "das alte Haus"),
    ("a small dog", "ein kleiner Hund"),
    ("the government", "die Regierung"),
    ("the city council", "der Stadtrat"),
    ("the new school", "die neue Schule"),
    ("my friend", "mein Freund"),
    ("the e-mail", "die E-Mail"),
    ("the train station", "der Bahnhof"),
    ("the police", "die Polizei"),
]
VERBS = [
    ("is", "ist"),
    ("was", "war"),
    ("seems", "scheint"),
]
ADJECTIVES = [
    ("big", "groß"),
    ("new", "neu"),
    ("important", "wichtig"),
    ("very nice", "sehr schön"),
    ("closed today", "heute geschlossen"),
]
SIZES = {"train": 160, "validation": 24, "test": 24}


def _upper_first(text: str) -> str:
    return text[:1].upper() + text[1:]


def sentence(rng: random.Random) -> tuple[str, str]:
    (se, sd), (ve, vd), (ae, ad) = rng.choice(LEXICON), rng.choice(VERBS), rng.choice(ADJECTIVES)
    en, de = _upper_first(f"{se} {ve} {ae}."), _upper_first(f"{sd} {vd} {ad}.")
    style = rng.random()
    if style < 0.15:  # typographic quotes and a zero-width space for the normaliser
        en, de = f"“{en}”", f"„{de}\u200b“"
    elif style < 0.3:  # two clauses
        (s2e, s2d), (a2e, a2d) = rng.choice(LEXICON), rng.choice(ADJECTIVES)
        en = en[:-1] + f", and {s2e} is {a2e}."
        de = de[:-1] + f", und {s2d} ist {a2d}."
    return en, de


def pairs(split: str, n: int) -> list[dict[str, str]]:
    rng = random.Random(f"wmt-{split}")
    out = [dict(zip(("en", "de"), sentence(rng))) for _ in range(n)]
    if split == "train":
        out[0] = {"en": "Yes!", "de": "!"}  # one side below 3 subwords: cleaned away
        long_en = " ".join(sentence(rng)[0] for _ in range(40))
        out[1] = {"en": long_en, "de": long_en}  # > 150 tokens: cleaned away
        out[2] = {"en": "The house is big and old and new and small.", "de": "Haus."}  # ratio
    else:
        out[0] = {"en": "Zürich’s Œuvre is quite new.", "de": "Das Œuvre von Zürich ist neu."}
    return out


def write(root: Path) -> None:
    import datasets

    features = datasets.Features({"translation": datasets.Translation(languages=["de", "en"])})
    for repo, splits in (("wmt16", ("train",)), ("wmt14", ("validation", "test"))):
        out = root / "wmt" / repo / "de-en"
        out.mkdir(parents=True, exist_ok=True)
        for split in splits:
            ds = datasets.Dataset.from_dict(
                {"translation": pairs(split, SIZES[split])}, features=features
            )
            to_parquet(ds, out / f"{split}-00000-of-00001.parquet")
