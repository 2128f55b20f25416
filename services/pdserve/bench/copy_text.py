"""Plain English prose drawn from a seed: the passages of the `copy` dataset.

Sentences are built from a fixed grammar and word lists, so a small instruct model reads them
as ordinary text and copies them (random token ids it would not). Nothing is downloaded.
"""
import numpy as np

from pdserve.bench.prompts import MAX_FIT_ROUNDS, RandomText
from pdserve.common.errors import ConfigError

TOKENS_PER_SENTENCE = 8  # fewer than any sentence has, so one paragraph usually suffices
FIT_MARGIN_TOKENS = 16
LEAD_WORDS = 3  # of the passage, begun as the answer

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
ERRANDS = ("stayed at home", "made a pot of tea", "wrote a long letter", "called an old friend", "went to bed early",
           "baked some bread", "listened to the radio", "cleaned the whole house", "read a good book")
SAYINGS = ("was too expensive", "belonged to the museum", "had been lost for years", "needed a new coat of paint",
           "was a gift from the mayor", "would not fit in the car", "came from a distant country")


class Prose:
    """Sentences drawn from `rng`; the same generator state gives the same sentences.

    People act on things in places, in sentences of several shapes, so the text reads as a plain
    story: a small model copies such text far more faithfully than word salad, and loses its
    place less often than in text of one repeated shape."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self._shapes = (self._moved, self._handled, self._errand, self._gift, self._weather, self._return,
                        self._saying)

    def _pick(self, words: tuple[str, ...]) -> str:
        return words[int(self.rng.integers(len(words)))]

    def _someone(self) -> str:
        return self._pick(NAMES) if self.rng.random() < 0.6 else f"the {self._pick(PEOPLE)}"

    def _thing(self) -> str:
        return f"the {self._pick(THING_ADJECTIVES)} {self._pick(THINGS)}"

    def _moved(self) -> str:
        return f"{self._someone()} {self._pick(VERBS)} {self._thing()} {self._pick(PREPOSITIONS)} the {self._pick(PLACES)}"

    def _handled(self) -> str:
        return f"{self._someone()} {self._pick(VERBS)} {self._thing()} {self._pick(ADVERBS)}"

    def _errand(self) -> str:
        return f"{self._pick(TIMES)}, {self._someone()} walked to the {self._pick(PLACES)} and {self._pick(VERBS)} " \
               f"{self._thing()}"

    def _gift(self) -> str:
        return f"{self._someone()} gave {self._thing()} to {self._someone()}"

    def _weather(self) -> str:
        return f"the {self._pick(PLACES)} was {self._pick(PLACE_ADJECTIVES)}, so {self._someone()} {self._pick(ERRANDS)}"

    def _return(self) -> str:
        return f"when {self._someone()} came back from the {self._pick(PLACES)}, the {self._pick(THINGS)} was gone"

    def _saying(self) -> str:
        return f"{self._someone()} told {self._someone()} that {self._thing()} {self._pick(SAYINGS)}"

    def sentence(self) -> str:
        text = self._shapes[int(self.rng.integers(len(self._shapes)))]()
        return text[0].upper() + text[1:] + "."

    def paragraph(self, num_sentences: int) -> str:
        return " ".join(self.sentence() for _ in range(num_sentences))


class CopyPrompts:
    """Prompts asking the model to repeat a passage of prose: `HEAD + passage + TAIL + lead`,
    where `lead` is the passage's first words, begun as the answer.

    Without the lead, SmolLM2-135M-Instruct as a plain completion (`/v1/completions`) mostly
    starts a story of its own; with it, it goes on copying there as through its chat template.
    The passage is cut at a token boundary so the whole prompt encodes to exactly the requested
    count; what the model is asked to write is the passage itself, which is what prompt-lookup
    (n-gram) speculation drafts from.
    """

    HEAD = "Repeat the following text exactly, word for word.\n\nText:\n"
    TAIL = "\n\nRepeated text:\n"

    def __init__(self, texts: RandomText) -> None:
        self.texts = texts
        self.prose = Prose(texts.rng)
        self.num_instruction_tokens = texts.num_tokens(self.HEAD) + texts.num_tokens(self.TAIL)

    def prompt(self, num_tokens: int) -> str:
        """Raises ConfigError when `num_tokens` leaves no room for a passage."""
        opening = self.prose.sentence()
        lead = " ".join(opening.split()[:LEAD_WORDS])
        num_fixed = self.num_instruction_tokens + self.texts.num_tokens(lead)
        if num_tokens <= num_fixed:
            raise ConfigError("--copy-input-len", num_tokens,
                              f"must exceed the {num_fixed} tokens of the instruction and the answer's first words")
        ids = self._passage_ids(opening, num_tokens - num_fixed)
        cut = num_tokens - num_fixed
        for _ in range(MAX_FIT_ROUNDS):
            text = self.HEAD + self.texts.tokenizer.decode(ids[:cut]) + self.TAIL + lead
            excess = self.texts.num_tokens(text) - num_tokens
            if excess == 0:
                return text
            cut -= excess
            if not 0 < cut <= len(ids):
                break
        raise ConfigError("--copy-input-len", num_tokens, "could not build a prompt of exactly this many tokens")

    def _passage_ids(self, opening: str, num_tokens: int) -> list[int]:
        """Token ids of whole sentences from `opening` on, a margin past `num_tokens` for the fit
        to grow into."""
        sentences = [opening]
        ids = self.texts.tokenizer.encode(opening, add_special_tokens=False)
        while len(ids) < num_tokens + FIT_MARGIN_TOKENS:
            sentences.append(self.prose.paragraph(num_tokens // TOKENS_PER_SENTENCE + 1))
            ids = self.texts.tokenizer.encode(" ".join(sentences), add_special_tokens=False)
        return ids
