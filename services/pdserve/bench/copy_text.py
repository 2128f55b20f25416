"""Plain English prose drawn from a seed: the passages of the `copy` dataset.

Sentences are built from a fixed grammar and word lists, so a small instruct model reads them
as ordinary text and copies them (random token ids it would not). Nothing is downloaded.
"""
import numpy as np

from pdserve.bench.prompts import MAX_FIT_ROUNDS, RandomText
from pdserve.common.errors import ConfigError

TOKENS_PER_SENTENCE = 8  # fewer than any sentence has, so one paragraph usually suffices
FIT_MARGIN_TOKENS = 16

NAMES = ("Anna", "Ben", "Clara", "David", "Elena", "Frank", "Grace", "Henry", "Iris", "James", "Laura",
         "Martin", "Nora", "Oscar", "Paula", "Robert", "Sarah", "Thomas", "Vera", "William")
PEOPLE = ("teacher", "doctor", "farmer", "baker", "driver", "painter", "student", "neighbor", "fisherman",
          "gardener", "old man", "young woman", "little boy", "little girl", "shopkeeper")
THINGS = ("window", "table", "letter", "book", "lamp", "door", "painting", "clock", "basket", "chair", "box",
          "bicycle", "map", "coat", "bottle", "key", "blanket", "ladder", "bucket", "radio")
THING_ADJECTIVES = ("old", "small", "heavy", "wooden", "red", "blue", "new", "broken", "clean", "large",
                    "green", "yellow")
PLACES = ("garden", "river", "bridge", "village", "market", "station", "school", "kitchen", "forest", "hill",
          "harbor", "library", "church", "bakery", "square", "beach", "farm", "museum", "park", "street")
PLACE_ADJECTIVES = ("quiet", "busy", "cold", "warm", "empty", "crowded", "green", "dark", "bright", "peaceful")
VERBS = ("carried", "cleaned", "found", "repaired", "moved", "bought", "sold", "painted", "noticed", "opened",
         "checked", "borrowed", "dropped", "lifted", "wrapped")
PREPOSITIONS = ("near", "behind", "beside", "inside", "outside", "in front of", "across", "next to")
TIMES = ("In the morning", "After lunch", "Every summer", "On Monday", "Later that day", "Before dawn",
         "In the evening", "Last winter", "At noon", "During the storm", "On Sunday", "A week later")
ADVERBS = ("slowly", "quickly", "carefully", "quietly", "happily", "again", "together", "at once", "with care")
FEELINGS = ("happy", "tired", "surprised", "calm", "hungry", "proud", "worried", "cheerful")


class Prose:
    """Sentences drawn from `rng`; the same generator state gives the same sentences.

    People act on things in places, so the text reads as a plain (if dull) story: a small
    model copies such text far more faithfully than word salad."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng

    def _pick(self, words: tuple[str, ...]) -> str:
        return words[int(self.rng.integers(len(words)))]

    def _someone(self) -> str:
        return self._pick(NAMES) if self.rng.random() < 0.6 else f"the {self._pick(PEOPLE)}"

    def _thing(self) -> str:
        return f"the {self._pick(THING_ADJECTIVES)} {self._pick(THINGS)}"

    def sentence(self) -> str:
        kind = int(self.rng.integers(5))
        if kind == 0:
            text = f"{self._someone()} {self._pick(VERBS)} {self._thing()} {self._pick(PREPOSITIONS)} " \
                   f"the {self._pick(PLACES)}"
        elif kind == 1:
            text = f"{self._someone()} {self._pick(VERBS)} {self._thing()} {self._pick(ADVERBS)}"
        elif kind == 2:
            text = f"{self._pick(TIMES)}, {self._someone()} walked to the {self._pick(PLACES)} and " \
                   f"{self._pick(VERBS)} {self._thing()}"
        elif kind == 3:
            text = f"the {self._pick(PLACES)} was {self._pick(PLACE_ADJECTIVES)}, and {self._someone()} " \
                   f"felt {self._pick(FEELINGS)}"
        else:
            text = f"{self._someone()} gave {self._thing()} to {self._someone()}"
        return text[0].upper() + text[1:] + "."

    def paragraph(self, num_sentences: int) -> str:
        return " ".join(self.sentence() for _ in range(num_sentences))


class CopyPrompts:
    """Prompts asking the model to repeat a passage of prose: `HEAD + passage + TAIL`.

    The passage is cut at a token boundary so the whole prompt encodes to exactly the
    requested count; what the model is asked to write is the passage itself, which is what
    prompt-lookup (n-gram) speculation drafts from.
    """

    HEAD = "Repeat the following text exactly, word for word.\n\nText:\n"
    TAIL = "\n\nRepeated text:\n"

    def __init__(self, texts: RandomText) -> None:
        self.texts = texts
        self.prose = Prose(texts.rng)
        self.num_overhead_tokens = texts.num_tokens(self.HEAD) + texts.num_tokens(self.TAIL)

    def prompt(self, num_tokens: int) -> str:
        """Raises ConfigError when `num_tokens` leaves no room for a passage."""
        budget = num_tokens - self.num_overhead_tokens
        if budget < 1:
            raise ConfigError("--copy-input-len", num_tokens,
                              f"must exceed the instruction's {self.num_overhead_tokens} tokens")
        ids = self._passage_ids(budget)
        cut = budget
        for _ in range(MAX_FIT_ROUNDS):
            text = self.HEAD + self.texts.tokenizer.decode(ids[:cut]) + self.TAIL
            excess = self.texts.num_tokens(text) - num_tokens
            if excess == 0:
                return text
            cut -= excess
            if not 0 < cut <= len(ids):
                break
        raise ConfigError("--copy-input-len", num_tokens, "could not build a prompt of exactly this many tokens")

    def _passage_ids(self, num_tokens: int) -> list[int]:
        """Token ids of whole sentences, a margin past `num_tokens` for the fit to grow into."""
        ids: list[int] = []
        sentences: list[str] = []
        while len(ids) < num_tokens + FIT_MARGIN_TOKENS:
            sentences.append(self.prose.paragraph(num_tokens // TOKENS_PER_SENTENCE + 1))
            ids = self.texts.tokenizer.encode(" ".join(sentences), add_special_tokens=False)
        return ids
