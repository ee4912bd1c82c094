"""The GPT example's training text, made in-process so nothing is downloaded: a small probabilistic
grammar over English-like words, grouped by topic, tokenised by a fixed vocabulary."""

from __future__ import annotations

import random
from typing import Any, Sequence

import numpy as np


# Each topic: (nouns as (singular, plural)), (transitive verbs as (3rd-singular, plural)),
# adjectives. Documents draw mostly from their topic's words.
_TOPICS: tuple[tuple[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...],
                     tuple[str, ...]], ...] = (
    (  # farm
        (("cow", "cows"), ("horse", "horses"), ("farmer", "farmers"), ("barn", "barns"),
         ("field", "fields"), ("goat", "goats"), ("tractor", "tractors"), ("hen", "hens")),
        (("feeds", "feed"), ("milks", "milk"), ("plows", "plow"), ("herds", "herd"),
         ("fences", "fence")),
        ("muddy", "golden", "quiet", "hungry"),
    ),
    (  # sea
        (("ship", "ships"), ("sailor", "sailors"), ("wave", "waves"), ("whale", "whales"),
         ("harbor", "harbors"), ("anchor", "anchors"), ("gull", "gulls"), ("island", "islands")),
        (("sails", "sail"), ("steers", "steer"), ("anchors", "anchor"), ("crosses", "cross"),
         ("floods", "flood")),
        ("salty", "stormy", "blue", "distant"),
    ),
    (  # city
        (("taxi", "taxis"), ("tower", "towers"), ("banker", "bankers"), ("street", "streets"),
         ("train", "trains"), ("shop", "shops"), ("crowd", "crowds"), ("bridge", "bridges")),
        (("drives", "drive"), ("sells", "sell"), ("builds", "build"), ("rents", "rent"),
         ("crowds", "crowd")),
        ("busy", "tall", "noisy", "grey"),
    ),
    (  # forest
        (("wolf", "wolves"), ("tree", "trees"), ("hunter", "hunters"), ("fox", "foxes"),
         ("owl", "owls"), ("river", "rivers"), ("deer", "deers"), ("cabin", "cabins")),
        (("hunts", "hunt"), ("climbs", "climb"), ("chops", "chop"), ("tracks", "track"),
         ("shelters", "shelter")),
        ("dark", "wild", "green", "ancient"),
    ),
    (  # kitchen
        (("cook", "cooks"), ("pot", "pots"), ("knife", "knives"), ("onion", "onions"),
         ("oven", "ovens"), ("cake", "cakes"), ("spoon", "spoons"), ("table", "tables")),
        (("bakes", "bake"), ("stirs", "stir"), ("slices", "slice"), ("boils", "boil"),
         ("tastes", "taste")),
        ("hot", "sweet", "fresh", "crispy"),
    ),
    (  # space
        (("rocket", "rockets"), ("planet", "planets"), ("pilot", "pilots"), ("moon", "moons"),
         ("robot", "robots"), ("star", "stars"), ("comet", "comets"), ("station", "stations")),
        (("launches", "launch"), ("orbits", "orbit"), ("scans", "scan"), ("repairs", "repair"),
         ("signals", "signal")),
        ("bright", "frozen", "silent", "huge"),
    ),
    (  # school
        (("teacher", "teachers"), ("pupil", "pupils"), ("book", "books"), ("desk", "desks"),
         ("lesson", "lessons"), ("pen", "pens"), ("class", "classes"), ("map", "maps")),
        (("reads", "read"), ("writes", "write"), ("teaches", "teach"), ("grades", "grade"),
         ("studies", "study")),
        ("clever", "strict", "new", "dusty"),
    ),
    (  # castle
        (("king", "kings"), ("knight", "knights"), ("dragon", "dragons"), ("queen", "queens"),
         ("sword", "swords"), ("gate", "gates"), ("guard", "guards"), ("crown", "crowns")),
        (("guards", "guard"), ("rules", "rule"), ("fights", "fight"), ("crowns", "crown"),
         ("storms", "storm")),
        ("royal", "brave", "stone", "proud"),
    ),
)
_COMMON_TRANSITIVE = (("sees", "see"), ("likes", "like"), ("finds", "find"),
                      ("follows", "follow"), ("watches", "watch"), ("carries", "carry"))
_INTRANSITIVE = (("sleeps", "sleep"), ("waits", "wait"), ("rests", "rest"), ("falls", "fall"),
                 ("shines", "shine"), ("moves", "move"))
_COMMON_ADJECTIVES = ("old", "small", "big", "red", "happy", "strange")
_DETERMINERS_SINGULAR = ("a", "this", "every", "one", "the")
_DETERMINERS_PLURAL = ("these", "many", "some", "two", "the")
_PREPOSITIONS = ("near", "under", "behind", "with", "beside", "over")
_ADVERBS = ("slowly", "often", "quickly", "never", "always", "gladly")
_PUNCTUATION = (".", ",", "and", "that", "<doc>")


def vocabulary() -> list[str]:
  """The corpus's words, index = token id (deterministic, independent of the seed)."""
  words: list[str] = []
  for nouns, verbs, adjectives in _TOPICS:
    words += [w for pair in nouns for w in pair] + [w for pair in verbs for w in pair]
    words += list(adjectives)
  words += [w for pair in _COMMON_TRANSITIVE + _INTRANSITIVE for w in pair]
  words += list(_COMMON_ADJECTIVES + _DETERMINERS_SINGULAR + _DETERMINERS_PLURAL
                + _PREPOSITIONS + _ADVERBS + _PUNCTUATION)
  unique = list(dict.fromkeys(words))  # keeps first occurrence order
  return ["<pad>"] + unique


class _Grammar:
  """Samples documents word by word from a Python ``random.Random`` (deterministic per seed)."""

  def __init__(self, rng: random.Random):
    self.rng = rng
    self.all_nouns = [n for topic in _TOPICS for n in topic[0]]
    self.all_verbs = [v for topic in _TOPICS for v in topic[1]] + list(_COMMON_TRANSITIVE)
    self.all_adjectives = [a for topic in _TOPICS for a in topic[2]] + list(_COMMON_ADJECTIVES)

  def _pick(self, own: Sequence[Any], other: Sequence[Any], p_own: float) -> Any:
    return self.rng.choice(own if self.rng.random() < p_own else other)

  def noun_phrase(self, topic: int, plural: bool, out: list[str]) -> None:
    nouns, _, adjectives = _TOPICS[topic]
    r = self.rng
    out.append(r.choice(_DETERMINERS_PLURAL if plural else _DETERMINERS_SINGULAR))
    while r.random() < 0.35 and out[-1] not in adjectives:  # 0-2ish adjectives, no repeats
      out.append(self._pick(adjectives, self.all_adjectives, 0.7))
    out.append(self._pick(nouns, self.all_nouns, 0.8)[plural])

  def clause(self, topic: int, hero: tuple[str, str], out: list[str]) -> None:
    """subject [that VERB NP] [ADV] VERB (NP | -) [PREP NP], with number agreement."""
    r = self.rng
    verbs = _TOPICS[topic][1]
    if r.random() < 0.3:  # the document's recurring noun phrase
      plural = False
      out += ["the", hero[0], hero[1]]
    else:
      plural = r.random() < 0.4
      self.noun_phrase(topic, plural, out)
    if r.random() < 0.2:  # relative clause: the main verb below still agrees with the subject
      out += ["that", self._pick(verbs, self.all_verbs, 0.7)[plural]]
      self.noun_phrase(topic, r.random() < 0.4, out)
    if r.random() < 0.2:
      out.append(r.choice(_ADVERBS))
    if r.random() < 0.7:
      out.append(self._pick(verbs, self.all_verbs, 0.7)[plural])
      self.noun_phrase(topic, r.random() < 0.4, out)
    else:
      out.append(r.choice(_INTRANSITIVE)[plural])
    if r.random() < 0.3:
      out.append(r.choice(_PREPOSITIONS))
      self.noun_phrase(topic, r.random() < 0.4, out)

  def document(self, out: list[str]) -> None:
    r = self.rng
    topic = r.randrange(len(_TOPICS))
    nouns, _, adjectives = _TOPICS[topic]
    hero = (r.choice(adjectives), r.choice(nouns)[0])
    for _ in range(r.randint(4, 12)):
      self.clause(topic, hero, out)
      if r.random() < 0.15:
        out += [",", "and"]
        self.clause(topic, hero, out)
      out.append(".")
    out.append("<doc>")


def make_corpus(num_tokens: int, seed: int) -> np.ndarray:
  """At least ``num_tokens`` token ids (int32) of whole synthetic documents, from ``seed``."""
  index = {w: i for i, w in enumerate(vocabulary())}
  grammar = _Grammar(random.Random(seed))
  words: list[str] = []
  while len(words) < num_tokens:
    grammar.document(words)
  return np.fromiter((index[w] for w in words), dtype=np.int32, count=len(words))


def decode(tokens: Sequence[int]) -> str:
  """Token ids back to text."""
  words = vocabulary()
  return " ".join(words[int(t)] for t in tokens)


class Batches:
  """Random windows of ``seq + 1`` tokens from the corpus, deterministic from ``seed``."""

  def __init__(self, corpus: np.ndarray, batch: int, seq: int, seed: int):
    if len(corpus) <= seq + 1:
      raise ValueError(f"corpus of {len(corpus)} tokens is too short for seq {seq}")
    self.corpus, self.batch, self.seq = corpus, batch, seq
    self.rng = np.random.default_rng(seed)

  def next(self) -> np.ndarray:
    """[batch, seq + 1] int32: inputs are [:, :-1], targets [:, 1:]."""
    starts = self.rng.integers(0, len(self.corpus) - self.seq - 1, size=self.batch)
    return self.corpus[starts[:, None] + np.arange(self.seq + 1)]
