"""The generated knowledge world: determinism, fact layout, held-out entities, streaming."""

import collections
import itertools

import pytest

from realm_jax.data.world import MAX_SECTION_WORDS, generate_world, iter_world_documents

NUM_ENTITIES = 600
SECTIONS = 4


@pytest.fixture(scope="module")
def world():
  return generate_world(NUM_ENTITIES, seed=0)


def test_same_seed_same_world_and_other_seed_other_world(world):
  assert generate_world(NUM_ENTITIES, seed=0) == world
  other = generate_world(NUM_ENTITIES, seed=1)
  assert other != world
  names = {e.name for e in world.entities}
  shared = names & {e.name for e in other.entities}
  assert len(shared) < 0.05 * len(names)


def test_sizes_kinds_and_unique_names(world):
  assert len(world.entities) == NUM_ENTITIES
  assert len(world.facts) == len(world.qa_pairs) == NUM_ENTITIES * SECTIONS
  assert len(world.documents) == NUM_ENTITIES * SECTIONS
  kinds = collections.Counter(e.kind for e in world.entities)
  assert kinds == {"person": 360, "place": 120, "organisation": 120}
  names = [e.name for e in world.entities]
  assert len(set(names)) == len(names)
  assert all(word[0].isupper() for name in names for word in name.split() if word != "of")
  words = collections.Counter(len(e.name.split()) for e in world.entities if e.kind == "person")
  assert set(words) == {2}
  place_words = collections.Counter(len(e.name.split()) for e in world.entities
                                    if e.kind == "place")
  assert place_words[1] > 0 and place_words[2] > 0


def test_every_entity_has_distinct_attributes(world):
  attributes = collections.defaultdict(list)
  for fact in world.facts:
    attributes[fact.entity].append(fact.attribute)
  assert len(attributes) == NUM_ENTITIES
  assert all(len(set(a)) == SECTIONS for a in attributes.values())
  by_kind = collections.defaultdict(set)
  for entity_id, a in attributes.items():
    by_kind[world.entities[entity_id].kind].update(a)
  assert all(len(a) == 4 for a in by_kind.values())


def test_each_fact_in_two_sections_and_each_section_two_facts(world):
  sections_per_fact = collections.defaultdict(list)
  texts_per_fact = collections.defaultdict(list)
  for doc_id, doc in enumerate(world.documents):
    assert doc.title == world.entities[doc.entity].name
    facts = [f for s in doc.sentences for f in s.facts]
    assert len(facts) == 2 and len(set(facts)) == 2
    assert sum(not s.facts for s in doc.sentences) <= 1
    for sentence in doc.sentences:
      assert sentence.entity == doc.entity
      for fact in sentence.facts:
        assert world.facts[fact].entity == doc.entity
        sections_per_fact[fact].append(doc_id)
        texts_per_fact[fact].append(sentence.text)
  assert len(sections_per_fact) == len(world.facts)
  assert all(len(set(docs)) == 2 for docs in sections_per_fact.values())
  # The two statements of a fact are worded with different templates.
  assert all(a != b for a, b in texts_per_fact.values())


def test_fact_sentences_name_the_entity_and_locate_the_value(world):
  for doc in world.documents:
    name = world.entities[doc.entity].name
    for sentence in doc.sentences:
      assert sentence.text.endswith(".") and sentence.text[0].isupper()
      assert len(sentence.facts) == len(sentence.value_spans)
      if sentence.facts:
        assert name in sentence.text
      for fact, (start, end) in zip(sentence.facts, sentence.value_spans):
        assert sentence.text[start:end] == world.facts[fact].value


def test_at_least_three_templates_per_attribute(world):
  wordings = collections.defaultdict(set)
  for doc in world.documents:
    name = world.entities[doc.entity].name
    for sentence in doc.sentences:
      for fact, (start, end) in zip(sentence.facts, sentence.value_spans):
        template = (sentence.text[:start] + "{v}" + sentence.text[end:]).replace(name, "{e}")
        key = (world.entities[doc.entity].kind, world.facts[fact].attribute)
        wordings[key].add(template)
  assert len(wordings) == 12
  assert all(len(w) >= 3 for w in wordings.values()), wordings


def test_values_are_spread_and_entity_values_name_world_entities(world):
  names_by_kind = collections.defaultdict(set)
  for entity in world.entities:
    names_by_kind[entity.kind].add(entity.name)
  values = collections.defaultdict(list)
  for fact in world.facts:
    values[fact.attribute].append(fact.value)
  assert len(set(values["birth_date"])) > 0.95 * len(values["birth_date"])
  assert len(set(values["population"])) > 0.9 * len(values["population"])
  for attribute, kind in (("birth_place", "place"), ("employer", "organisation"),
                          ("headquarters", "place"), ("founder", "person")):
    assert set(values[attribute]) <= names_by_kind[kind]
    # Drawn uniformly across the world: distinct values near the expectation of that draw.
    pool, draws = len(names_by_kind[kind]), len(values[attribute])
    expected_distinct = pool * (1 - (1 - 1 / pool) ** draws)
    assert len(set(values[attribute])) > 0.85 * expected_distinct


def test_held_out_fraction_per_kind(world):
  held_out = [e for e in world.entities if e.held_out]
  assert abs(len(held_out) / NUM_ENTITIES - 0.2) < 0.01
  assert {e.kind for e in held_out} == {"person", "place", "organisation"}
  # Held-out entities stay in the corpus; they are only kept out of training queries.
  held_out_ids = {i for i, e in enumerate(world.entities) if e.held_out}
  assert held_out_ids <= {d.entity for d in world.documents}
  none_held_out = generate_world(50, seed=3, held_out_fraction=0.0)
  assert not any(e.held_out for e in none_held_out.entities)


def test_sections_are_short(world):
  lengths = [len(doc.title.split()) + sum(len(s.text.split()) for s in doc.sentences)
             for doc in world.documents]
  assert max(lengths) <= MAX_SECTION_WORDS
  assert any(len(doc.sentences) == 3 for doc in world.documents)  # some carry a filler
  fillers = collections.defaultdict(list)
  for doc in world.documents:
    fillers[doc.entity] += [s.text for s in doc.sentences if not s.facts]
  assert all(len(set(f)) == len(f) for f in fillers.values())


def test_qa_pairs_ask_for_each_fact(world):
  for i, qa in enumerate(world.qa_pairs):
    fact = world.facts[i]
    assert (qa.fact, qa.entity, qa.answer) == (i, fact.entity, fact.value)
    assert qa.question.endswith("?")
    assert world.entities[qa.entity].name in qa.question


@pytest.mark.parametrize("num_entities, kwargs", [
    (40, {}), (7, {"sections_per_entity": 3, "held_out_fraction": 0.5}), (2, {})])
def test_streaming_yields_the_same_documents(num_entities, kwargs):
  streamed = tuple(iter_world_documents(num_entities, 5, **kwargs))
  assert streamed == generate_world(num_entities, 5, **kwargs).documents


def test_tiny_worlds_are_well_formed():
  tiny = generate_world(1, seed=0)
  assert len(tiny.documents) == SECTIONS and len(tiny.facts) == SECTIONS
  two_sections = generate_world(10, seed=0, sections_per_entity=2)
  for doc in two_sections.documents:
    assert len({f for s in doc.sentences for f in s.facts}) == 2


@pytest.mark.parametrize("args, kwargs", [
    ((0,), {}), ((10,), {"sections_per_entity": 1}), ((10,), {"sections_per_entity": 5}),
    ((10,), {"held_out_fraction": 1.5})])
def test_bad_arguments_raise(args, kwargs):
  with pytest.raises(ValueError):
    generate_world(*args, **kwargs)
  with pytest.raises(ValueError):
    iter_world_documents(*args, **kwargs)


def test_streaming_yields_sections_in_entity_order():
  documents = iter_world_documents(2_000, seed=0)
  first = list(itertools.islice(documents, 8))
  assert [d.entity for d in first] == [0] * SECTIONS + [1] * SECTIONS
