"""A generated knowledge world: fictional entities written as short titled sections.

The world drives the demo in which a dense retriever must learn, from the masked-LM
signal alone, which block holds a needed fact. Every entity (person, place or
organisation) has ``sections_per_entity`` facts and is written as that many sections
(documents) titled with its name. Section ``i`` states facts ``i`` and ``(i + 1) mod n``,
so each fact is stated in exactly two sections: when a fact is masked in a query sentence
taken from one section, exactly one *other* section of the same entity can restore it, and
"any block about the entity" is not enough.

Everything is a deterministic function of ``(num_entities, seed)`` and the keyword
arguments. Documents are produced entity by entity from a per-entity RNG, so
``iter_world_documents`` streams exactly the documents of ``generate_world`` while holding
only the entity table (names and kinds) in memory.
"""

from __future__ import annotations

import dataclasses
import random
import re
from typing import Iterator

from realm_jax.data.spans import SENTENCE_START_WORDS

PERSON, PLACE, ORGANISATION = "person", "place", "organisation"
# Kind mix of the world (people dominate, as in an encyclopedia).
_KIND_SHARES = ((PERSON, 0.6), (PLACE, 0.2), (ORGANISATION, 0.2))
# Title + all sentences of a section stay within this many words (~45 wordpieces).
MAX_SECTION_WORDS = 30
_FILLER_PROBABILITY = 0.5


@dataclasses.dataclass(frozen=True)
class Fact:
  """One attribute of one entity; ``value`` is its exact surface string."""
  entity: int
  attribute: str
  value: str


@dataclasses.dataclass(frozen=True)
class Entity:
  """A fictional entity; ``held_out`` entities never supply a training query."""
  name: str
  kind: str
  held_out: bool


@dataclasses.dataclass(frozen=True)
class Sentence:
  """A sentence about ``entity``; ``value_spans[j]`` locates the value of ``facts[j]``."""
  text: str
  entity: int
  facts: tuple[int, ...]
  value_spans: tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True)
class Document:
  """One section of an entity's article, titled with the entity's name."""
  title: str
  entity: int
  sentences: tuple[Sentence, ...]


@dataclasses.dataclass(frozen=True)
class QAPair:
  """An open-QA question whose answer is the value of ``fact``."""
  question: str
  answer: str
  fact: int
  entity: int


@dataclasses.dataclass(frozen=True)
class World:
  """The whole generated world; ``facts[i]`` is answered by ``qa_pairs[i]``."""
  entities: tuple[Entity, ...]
  facts: tuple[Fact, ...]
  documents: tuple[Document, ...]
  qa_pairs: tuple[QAPair, ...]


# ----------------------------------------------------------------------------- templates

@dataclasses.dataclass(frozen=True)
class _Attribute:
  """How one attribute is sampled, stated (>= 3 templates) and asked about."""
  name: str
  value_kind: str
  templates: tuple[tuple[str, ...], ...]  # parsed templates; "{e}" / "{v}" are slots
  question: str


def _parse(template: str) -> tuple[str, ...]:
  return tuple(p for p in re.split(r"(\{[ev]\})", template) if p)


def _attribute(name: str, value_kind: str, question: str, *templates: str) -> _Attribute:
  return _Attribute(name, value_kind, tuple(_parse(t) for t in templates), question)


# Every template names the entity in full ("{e}") so a query sentence identifies it, and
# never puts "{e}" and "{v}" side by side, so a tagger keeps them as separate spans.
_ATTRIBUTES = {
    PERSON: (
        _attribute("birth_date", "full_date", "When was {e} born?",
                   "{e} was born on {v}.",
                   "On {v}, {e} was born.",
                   "The birth of {e} took place on {v}.",
                   "{e} came into the world on {v}."),
        _attribute("birth_place", "place", "Where was {e} born?",
                   "{e} was born in {v}.",
                   "{e} is a native of {v}.",
                   "The birthplace of {e} was {v}.",
                   "{v} is the hometown of {e}."),
        _attribute("employer", "organisation", "Which organisation employed {e}?",
                   "{e} worked for {v}.",
                   "{e} was employed by {v}.",
                   "{e} spent many years at {v}.",
                   "{v} employed {e}."),
        _attribute("books_written", "books", "How many books did {e} write?",
                   "{e} wrote {v} books.",
                   "{e} is the author of {v} books.",
                   "In total, {e} published {v} books.",
                   "The works of {e} include {v} books."),
    ),
    PLACE: (
        _attribute("founded", "year", "When was {e} founded?",
                   "{e} was founded in {v}.",
                   "In {v}, settlers founded {e}.",
                   "The settlement of {e} began in {v}.",
                   "{e} dates back to {v}."),
        _attribute("population", "population", "How many people live in {e}?",
                   "{e} has {v} inhabitants.",
                   "{e} is home to {v} people.",
                   "The population of {e} is {v}.",
                   "About {v} residents live in {e}."),
        _attribute("located_in", "other_place", "Where is {e} located?",
                   "{e} is located in {v}.",
                   "{e} lies within {v}.",
                   "{e} is part of {v}.",
                   "The district of {v} includes {e}."),
        _attribute("largest_employer", "organisation", "What is the largest employer in {e}?",
                   "The largest employer in {e} is {v}.",
                   "{v} is the main employer in {e}.",
                   "Most people in {e} work for {v}."),
    ),
    ORGANISATION: (
        _attribute("founded", "month_year", "When was {e} founded?",
                   "{e} was founded in {v}.",
                   "{e} was established in {v}.",
                   "In {v}, {e} opened its doors.",
                   "{e} has existed since {v}."),
        _attribute("headquarters", "place", "Where is the headquarters of {e}?",
                   "{e} has its headquarters in {v}.",
                   "{e} is based in {v}.",
                   "The head office of {e} is in {v}.",
                   "{v} is home to the head office of {e}."),
        _attribute("employees", "employees", "How many employees does {e} have?",
                   "{e} has {v} employees.",
                   "{e} employs {v} people.",
                   "The staff of {e} numbers {v}.",
                   "About {v} people work for {e}."),
        _attribute("founder", "person", "Who founded {e}?",
                   "{e} was founded by {v}.",
                   "{v} founded {e}.",
                   "The founder of {e} was {v}.",
                   "{v} established {e}."),
    ),
}

# Filler sentences state no fact and carry no name, so they hold no salient span.
_FILLERS = {
    "feminine": ("She was widely known in her field.",
                 "Her letters survive in several archives.",
                 "Little is known about her early years.",
                 "She travelled a great deal in later life."),
    "masculine": ("He was widely known in his field.",
                  "His letters survive in several archives.",
                  "Little is known about his early years.",
                  "He travelled a great deal in later life."),
    PLACE: ("The place is often mentioned in travel accounts.",
            "It is known for its quiet streets.",
            "Its climate is mild for most of the year.",
            "The old market square is still in use."),
    ORGANISATION: ("It has a long and varied history.",
                   "The organisation is well regarded.",
                   "Its records are kept in a private archive.",
                   "It remains active today."),
}

_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August",
           "September", "October", "November", "December")
_MONTH_DAYS = (31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)

# ----------------------------------------------------------------------------- names

_ONSETS = ("b", "br", "c", "d", "dr", "f", "g", "gr", "h", "k", "l", "m", "n", "p", "r",
           "s", "st", "t", "tr", "v", "z", "th", "sh", "w")
_VOWELS = ("a", "e", "i", "o", "u", "a", "e", "o", "ai", "ei", "ou")
_CODAS = ("", "", "", "", "n", "r", "l", "s", "m", "nd", "rn", "th")
_FEMININE_ENDINGS = ("a", "ia", "ine", "elle", "ra", "ena")
_MASCULINE_ENDINGS = ("o", "an", "en", "ric", "us", "ard")
_PLACE_PREFIXES = ("Port", "Lake", "Mount", "Fort", "North", "South", "New", "Upper")
_PLACE_SUFFIXES = ("Falls", "Bay", "Hill", "Ford", "Harbour")
_ORG_SUFFIXES = ("Institute", "Company", "Society", "Press", "Trust", "Works", "Foundation",
                 "Mills", "Guild", "Bank", "Observatory", "Library")
_ORG_PREFIXES = ("University of", "Bank of", "Academy of", "College of")
# Generated words must not be words the salient-span tagger treats as common or special.
_RESERVED_WORDS = SENTENCE_START_WORDS | frozenset(w.lower() for w in _MONTHS) | frozenset((
    "de", "da", "di", "du", "la", "le", "von", "van", "der", "del", "so", "do", "us", "or",
    "bank", "port", "lake", "mount", "fort", "new", "north", "south", "upper"))
_MAX_WORD_LETTERS = 8
_MAX_NAME_ATTEMPTS = 1000


def _word(rng: random.Random, syllables: int = 2) -> str:
  """A capitalised pronounceable word of at most ``_MAX_WORD_LETTERS`` letters."""
  while True:
    parts = []
    for k in range(syllables):
      # A vowel-initial first syllable now and then ("Orvane"), never mid-word clusters.
      onset = rng.choice(_ONSETS) if k > 0 or rng.random() < 0.8 else ""
      parts.append(onset + rng.choice(_VOWELS) + rng.choice(_CODAS))
    word = "".join(parts)
    if len(word) <= _MAX_WORD_LETTERS and word not in _RESERVED_WORDS:
      return word.capitalize()


def _person_name(rng: random.Random, feminine: bool) -> str:
  endings = _FEMININE_ENDINGS if feminine else _MASCULINE_ENDINGS
  while True:
    first = rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) + rng.choice(endings)
    if first not in _RESERVED_WORDS:
      return f"{first.capitalize()} {_word(rng)}"


def _place_name(rng: random.Random) -> str:
  roll = rng.random()
  if roll < 0.2:
    return f"{rng.choice(_PLACE_PREFIXES)} {_word(rng)}"
  if roll < 0.3:
    return f"{_word(rng)} {rng.choice(_PLACE_SUFFIXES)}"
  return _word(rng)


def _organisation_name(rng: random.Random) -> str:
  if rng.random() < 0.2:
    return f"{rng.choice(_ORG_PREFIXES)} {_word(rng)}"
  return f"{_word(rng)} {rng.choice(_ORG_SUFFIXES)}"


def _fresh_name(rng: random.Random, kind: str, taken: set[str],
                feminine: bool = False) -> str:
  """A name of ``kind`` not in ``taken`` (retries on collision), added to ``taken``."""
  for _ in range(_MAX_NAME_ATTEMPTS):
    if kind == PERSON:
      name = _person_name(rng, feminine)
    elif kind == PLACE:
      name = _place_name(rng)
    else:
      name = _organisation_name(rng)
    if name not in taken:
      taken.add(name)
      return name
  raise RuntimeError(f"could not find a fresh {kind} name; the name space is exhausted")


# ----------------------------------------------------------------------------- generation

_MASK64 = (1 << 64) - 1
_ENTITY_TABLE_STREAM, _ENTITY_STREAM = 1, 2


def _derive_seed(seed: int, stream: int, index: int) -> int:
  """A well-mixed 64-bit seed for one independent RNG stream (splitmix64 finaliser)."""
  x = (seed * 0x9E3779B97F4A7C15 + stream * 0xD1B54A32D192ED03 + index) & _MASK64
  x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
  x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
  return x ^ (x >> 31)


@dataclasses.dataclass(frozen=True)
class _EntityTable:
  """What every entity's sections need to know about the rest of the world."""
  entities: tuple[Entity, ...]
  feminine: tuple[bool, ...]  # picks the pronoun of a person's filler sentences
  ids_by_kind: dict[str, tuple[int, ...]]


def _check_arguments(num_entities: int, sections_per_entity: int,
                     held_out_fraction: float) -> None:
  if num_entities < 1:
    raise ValueError(f"num_entities must be >= 1, got {num_entities}")
  most = min(len(attributes) for attributes in _ATTRIBUTES.values())
  if not 2 <= sections_per_entity <= most:
    raise ValueError(f"sections_per_entity must be in [2, {most}], got {sections_per_entity}")
  if not 0.0 <= held_out_fraction <= 1.0:
    raise ValueError(f"held_out_fraction must be in [0, 1], got {held_out_fraction}")


def _build_entity_table(num_entities: int, seed: int, held_out_fraction: float) -> _EntityTable:
  """Kinds in exact shares, unique names, and held-out entities stratified by kind."""
  rng = random.Random(_derive_seed(seed, _ENTITY_TABLE_STREAM, 0))
  counts = [round(share * num_entities) for _, share in _KIND_SHARES[1:]]
  kinds = [PERSON] * (num_entities - sum(counts))
  for (kind, _), count in zip(_KIND_SHARES[1:], counts):
    kinds += [kind] * count
  rng.shuffle(kinds)
  taken: set[str] = set()
  names, feminine = [], []
  for kind in kinds:
    is_feminine = kind == PERSON and rng.random() < 0.5
    names.append(_fresh_name(rng, kind, taken, is_feminine))
    feminine.append(is_feminine)
  ids_by_kind = {kind: tuple(i for i, k in enumerate(kinds) if k == kind)
                 for kind, _ in _KIND_SHARES}
  # Stratified so every kind is evaluated on held-out entities in the asked proportion.
  held_out = set()
  for ids in ids_by_kind.values():
    held_out.update(rng.sample(ids, round(held_out_fraction * len(ids))))
  entities = tuple(Entity(name, kind, i in held_out)
                   for i, (name, kind) in enumerate(zip(names, kinds)))
  return _EntityTable(entities, tuple(feminine), ids_by_kind)


def _pick_entity_name(rng: random.Random, table: _EntityTable, kind: str, exclude: int) -> str:
  """A uniformly drawn name of another entity of ``kind``, invented if the world has none."""
  ids = table.ids_by_kind[kind]
  if len(ids) > 1 or (ids and ids[0] != exclude):
    while True:
      other = rng.choice(ids)
      if other != exclude:
        return table.entities[other].name
  # Only tiny worlds get here; an invented name keeps every attribute well defined.
  return _fresh_name(rng, kind, {e.name for e in table.entities}, rng.random() < 0.5)


def _log_uniform_int(rng: random.Random, low: int, high: int) -> int:
  return int(round(low * (high / low) ** rng.random()))


def _sample_value(rng: random.Random, value_kind: str, table: _EntityTable, entity: int) -> str:
  """A surface value spread widely enough that guessing it is poor."""
  if value_kind == "full_date":
    month = rng.randrange(12)
    return f"{rng.randint(1, _MONTH_DAYS[month])} {_MONTHS[month]} {rng.randint(1700, 1999)}"
  if value_kind == "month_year":
    return f"{rng.choice(_MONTHS)} {rng.randint(1750, 1999)}"
  if value_kind == "year":
    return str(rng.randint(1100, 1950))
  if value_kind in ("place", "other_place"):
    return _pick_entity_name(rng, table, PLACE, entity)
  if value_kind == "organisation":
    return _pick_entity_name(rng, table, ORGANISATION, entity)
  if value_kind == "person":
    return _pick_entity_name(rng, table, PERSON, entity)
  if value_kind == "books":
    return str(rng.randint(10, 199))  # >= 2 digits, so a number tagger always sees it
  if value_kind == "population":
    return f"{_log_uniform_int(rng, 200, 2_000_000):,}"
  if value_kind == "employees":
    return f"{_log_uniform_int(rng, 12, 90_000):,}"
  raise ValueError(f"unknown value kind {value_kind!r}")


def _render(template: tuple[str, ...], name: str, value: str) -> tuple[str, tuple[int, int]]:
  """Fills a template; returns the text and the char span of ``value`` in it."""
  pieces, position, span = [], 0, (0, 0)
  for part in template:
    if part == "{e}":
      part = name
    elif part == "{v}":
      part, span = value, (position, position + len(value))
    pieces.append(part)
    position += len(part)
  return "".join(pieces), span


def _write_entity(entity_id: int, table: _EntityTable, seed: int,
                  sections_per_entity: int) -> tuple[list[tuple[str, str]], list[Document]]:
  """Samples one entity's facts and writes its sections.

  Args:
    entity_id: index of the entity in ``table.entities``.
    table: the world's entity table.
    seed: the world seed.
    sections_per_entity: number of facts and of sections.

  Returns:
    ``(facts, documents)``: ``(attribute, value)`` pairs, the entity's fact ``j`` having id
    ``entity_id * sections_per_entity + j``, and the entity's sections in order.
  """
  rng = random.Random(_derive_seed(seed, _ENTITY_STREAM, entity_id))
  entity = table.entities[entity_id]
  n = sections_per_entity
  # A random subset and order of attributes varies which facts share a section.
  attributes = rng.sample(_ATTRIBUTES[entity.kind], n)
  values = [_sample_value(rng, a.value_kind, table, entity_id) for a in attributes]
  # Two distinct templates per fact: the two sections stating it word it differently.
  wordings = [rng.sample(a.templates, 2) for a in attributes]
  if entity.kind == PERSON:
    fillers = _FILLERS["feminine" if table.feminine[entity_id] else "masculine"]
  else:
    fillers = _FILLERS[entity.kind]
  fillers = rng.sample(fillers, len(fillers))  # an entity's sections never repeat a filler
  first_fact = entity_id * n
  documents = []
  for section in range(n):
    sentences = []
    for j, wording in ((section, 0), ((section + 1) % n, 1)):
      text, span = _render(wordings[j][wording], entity.name, values[j])
      sentences.append(Sentence(text, entity_id, (first_fact + j,), (span,)))
    if rng.random() < 0.5:
      sentences.reverse()
    if rng.random() < _FILLER_PROBABILITY:
      filler = fillers[section % len(fillers)]
      words = len(entity.name.split()) + sum(len(s.text.split()) for s in sentences)
      if words + len(filler.split()) <= MAX_SECTION_WORDS:
        # Never first: a pronoun should follow a sentence that names the entity.
        sentences.insert(rng.randint(1, 2), Sentence(filler, entity_id, (), ()))
    documents.append(Document(entity.name, entity_id, tuple(sentences)))
  return [(a.name, v) for a, v in zip(attributes, values)], documents


def generate_world(num_entities: int, seed: int = 0, *, sections_per_entity: int = 4,
                   held_out_fraction: float = 0.2) -> World:
  """Generates the whole knowledge world in memory.

  Args:
    num_entities: number of entities (about 60% people, 20% places, 20% organisations).
    seed: the world seed; the world is a deterministic function of all arguments.
    sections_per_entity: facts per entity, and sections (documents) per entity, in [2, 4].
    held_out_fraction: share of entities of each kind marked ``held_out`` (evaluation only).

  Returns:
    The ``World``; ``documents`` lists each entity's sections in entity order and
    ``qa_pairs[i]`` asks for ``facts[i]``.
  """
  _check_arguments(num_entities, sections_per_entity, held_out_fraction)
  table = _build_entity_table(num_entities, seed, held_out_fraction)
  facts, documents, qa_pairs = [], [], []
  for entity_id, entity in enumerate(table.entities):
    entity_facts, entity_documents = _write_entity(entity_id, table, seed, sections_per_entity)
    questions = {a.name: a.question for a in _ATTRIBUTES[entity.kind]}
    for attribute, value in entity_facts:
      qa_pairs.append(QAPair(questions[attribute].format(e=entity.name), value,
                             len(facts), entity_id))
      facts.append(Fact(entity_id, attribute, value))
    documents.extend(entity_documents)
  return World(table.entities, tuple(facts), tuple(documents), tuple(qa_pairs))


def iter_world_documents(num_entities: int, seed: int = 0, *, sections_per_entity: int = 4,
                         held_out_fraction: float = 0.2) -> Iterator[Document]:
  """Streams the documents of ``generate_world`` with the same arguments.

  Only the entity table (names, kinds) is held in memory, so a corpus of millions of
  blocks can be written without materialising every sentence.

  Args:
    num_entities: as in ``generate_world``.
    seed: as in ``generate_world``.
    sections_per_entity: as in ``generate_world``.
    held_out_fraction: as in ``generate_world``.

  Returns:
    An iterator over exactly ``generate_world(...).documents``, in the same order.
  """
  _check_arguments(num_entities, sections_per_entity, held_out_fraction)  # fail at call time
  table = _build_entity_table(num_entities, seed, held_out_fraction)
  return (document for entity_id in range(num_entities)
          for document in _write_entity(entity_id, table, seed, sections_per_entity)[1])
