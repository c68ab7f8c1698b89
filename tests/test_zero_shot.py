"""Zero-shot question retrieval: block rankings collapsed to paragraphs, recall@k for a trained
retriever and for BM25 on a small SQuAD-format file the test writes."""

import json
import logging
import os
import shutil

import numpy as np
import pytest

from realm_jax.data import prepare as prepare_lib
from realm_jax.data.prepared import PreparedData
from realm_jax.data.qa import is_heldout_article
from realm_jax.errors import ConfigError
from realm_jax.retrieval import zero_shot
from tests.helpers import load_config_module, swapped_vocab_copy

TOPICS = [
    ("Kelmar Observatory", "The Kelmar Observatory was founded by Ada Brisk in 1843. Its great "
     "refractor telescope was built in Munich. Astronomers there catalogued 400 comets."),
    ("Orvane River", "The Orvane River rises in the Tessel Mountains near Lake Varn. It flows "
     "for 312 kilometres to the Grey Sea. Salmon swim up the Orvane every October."),
    ("Pellow Bridge", "Pellow Bridge crosses the Ambry Canal in Dunmore. It was designed by "
     "Thomas Quill and opened in 1902. Its iron arches were painted green in 1950."),
    ("Sister Marta Voss", "Sister Marta Voss ran the Hollin Hospital in Carrow from 1890. She "
     "introduced carbolic disinfection to the wards. A statue of her stands in Carrow Square."),
]
QUESTIONS = ["who founded the kelmar observatory?", "where does the orvane river rise?",
             "who designed pellow bridge?", "which hospital did marta voss run?"]


def write_squad(path, topics=TOPICS) -> str:
  data = {"data": [{"title": t, "paragraphs": [{"context": c, "qas": [
      {"id": str(i), "question": q, "answers": [{"text": c.split()[1], "answer_start":
                                                  c.index(c.split()[1])}]}]}]}
      for i, ((t, c), q) in enumerate(zip(topics, QUESTIONS))]}
  path.write_text(json.dumps(data))
  return str(path)


def test_paragraph_recall_collapses_blocks_to_paragraphs():
  block_docs = np.array([0, 0, 1, 2, 2, 3])
  ranked = np.array([[0, 1, 3, 2, 5],      # paragraphs 0, 2, 1, 3: gold 2 is 2nd
                     [5, 4, 3, 0, 1],      # paragraphs 3, 2, 0: gold 1 absent
                     [2, 0, 1, 3, 4]])     # paragraphs 1, 0, 2: gold 1 is 1st
  recall = zero_shot.paragraph_recall(ranked, block_docs, np.array([2, 1, 1]), ks=(1, 2))
  assert recall == {"recall_at_1": pytest.approx(1 / 3), "recall_at_2": pytest.approx(2 / 3)}


def prepare_squad(tmp, topics=TOPICS, block_len: int = 32, eval_fraction: float = 0.0) -> str:
  """`topics` as a SQuAD file in `tmp`, prepared into tmp/data (a 300-entry vocab)."""
  config = prepare_lib.prepare_config()
  config.source = f"squad:{write_squad(tmp / 'squad.json', topics)}"
  config.out_dir = str(tmp / "data")
  config.block_len, config.max_sentence_len, config.vocab_size = block_len, 30, 300
  config.num_workers, config.eval_fraction, config.progress_every = 0, eval_fraction, 1e9
  prepare_lib.prepare(config)
  return config.out_dir


@pytest.fixture(scope="module")
def squad_data(tmp_path_factory):
  return prepare_squad(tmp_path_factory.mktemp("qa"))


def test_questions_point_at_their_paragraph(squad_data):
  questions = zero_shot.load_questions(squad_data)
  assert [q["question"] for q in questions] == QUESTIONS
  assert [q["doc_id"] for q in questions] == [0, 1, 2, 3]


def test_the_table_refuses_a_share_that_holds_out_no_article(squad_data):
  """Checked before any retriever embeds the corpus (the demos call it right after prepare)."""
  from realm_jax.errors import ConfigError
  data = PreparedData(squad_data)
  assert len(zero_shot.table_questions(data, squad_data, 0.0)) == len(QUESTIONS)
  none = 1e-6
  assert not any(is_heldout_article(title, none) for title, _ in TOPICS)
  with pytest.raises(ConfigError, match=r"config\.qa\.heldout_articles: 1e-06 holds out none "
                     "of the 4 articles"):
    zero_shot.table_questions(data, squad_data, none)
  some = next(f for f in (0.2, 0.3, 0.5, 0.7, 0.9)
              if any(is_heldout_article(title, f) for title, _ in TOPICS))
  held = zero_shot.table_questions(data, squad_data, some)   # one question per article
  assert [q["question"] for q in held] == [
      q for (title, _), q in zip(TOPICS, QUESTIONS) if is_heldout_article(title, some)]


def test_demo_real_checks_its_questions_before_training(squad_data, tmp_path, capsys):
  """`make demo-real` holds out articles where they split near its share, else paragraphs
  where those split nearer it (saying so), and on a file that holds out nothing either way
  stops right after preparing it, naming the option; otherwise it says what it will ask."""
  from realm_jax import demo_real
  from realm_jax.data.sources import paragraph_key
  source = f"squad:{os.path.join(os.path.dirname(squad_data), 'squad.json')}"
  assert demo_real.heldout_unit(squad_data) == "article"          # 1 of 4: 25% against 20%
  demo_real.check_questions(str(tmp_path), squad_data, source, 0, "cpu")
  assert [is_heldout_article(title, 0.2) for title, _ in TOPICS] == [False] * 3 + [True]
  assert ("1 of the held-out articles for the zero-shot table, Open-QA 3 to fine-tune on and 1 "
          "to test") in capsys.readouterr().out

  def prepared(name, topics):
    config = prepare_lib.prepare_config()
    config.source = f"squad:{write_squad(tmp_path / f'{name}.json', topics)}"
    config.out_dir = str(tmp_path / name)
    config.block_len, config.max_sentence_len, config.vocab_size = 32, 30, 300
    config.num_workers, config.eval_fraction, config.progress_every = 0, 0.0, 1e9
    prepare_lib.prepare(config)
    return config
  three = prepared("three", TOPICS[:3])          # no article held out: paragraphs instead
  held = [is_heldout_article(paragraph_key(c), 0.2) for _, c in TOPICS[:3]]
  assert demo_real.heldout_unit(three.out_dir) == "paragraph" and 0 < sum(held) < 3
  demo_real.check_questions(str(tmp_path), three.out_dir, three.source, 0, "cpu")
  out = capsys.readouterr().out
  assert "paragraphs are held out instead (qa.heldout_unit=paragraph)" in out
  assert (f"{sum(held)} of the held-out paragraphs for the zero-shot table, Open-QA "
          f"{3 - sum(held)} to fine-tune on and {sum(held)} to test") in out
  assert f"paragraphs are held out instead (qa.heldout_unit=paragraph), {sum(held) / 3:.0%}" in out
  assert ("warning" in out) == (not 0.1 <= sum(held) / 3 <= 0.4)
  two = prepared("two", [TOPICS[0], TOPICS[3]])  # 1 of 2 articles: 50%, paragraphs no nearer
  assert demo_real.heldout_unit(two.out_dir) == "article"
  demo_real.check_questions(str(tmp_path), two.out_dir, two.source, 0, "cpu")
  assert ("[demo-real] warning: the held-out articles hold 50% of the questions, far from the "
          "recipe's ~20% (qa.heldout_articles): few to fine-tune on") in capsys.readouterr().out
  kept = next(t for t in TOPICS if not is_heldout_article(paragraph_key(t[1]), 0.2))
  one = prepared("one", [kept])                  # one paragraph, trained on either way
  assert demo_real.heldout_unit(one.out_dir) == "article"
  with pytest.raises(ConfigError, match=r"config\.qa\.heldout_articles: 0\.2 holds out none of "
                     r"the 1 articles.*\(demo-real: give a file of more articles"):
    demo_real.check_questions(str(tmp_path), one.out_dir, one.source, 0, "cpu")


def test_a_recipe_run_refused_by_its_checks_adds_no_run_to_its_wall_record(
    squad_data, tmp_path, monkeypatch):
  """`W/wall.json` counts the runs that did work ("N min in R runs"): a run stopped by a
  missing file or by its questions' check adds none; a run that got as far as a stage does."""
  from realm_jax import demo_real, stages
  from realm_jax.data.sources import paragraph_key
  kept = next(t for t in TOPICS if not is_heldout_article(paragraph_key(t[1]), 0.2))
  (tmp_path / "one").mkdir()
  one = prepare_squad(tmp_path / "one", [kept])       # holds out nothing either way
  source = f"squad:{tmp_path}/one/squad.json"
  work = tmp_path / "w"
  with pytest.raises(FileNotFoundError, match="nowhere.json: no such file"):
    demo_real.run_demo_real(str(work), squad=str(tmp_path / "nowhere.json"))
  monkeypatch.setattr(demo_real, "prepare_data", lambda *a: (one, source, {}))
  with pytest.raises(ConfigError, match="holds out none"):
    demo_real.run_demo_real(str(work))
  assert not (work / "wall.json").exists()

  def failed_stage(*args, **kwargs):
    raise stages.StageFailed("ict: exit 1")
  good = f"squad:{os.path.dirname(squad_data)}/squad.json"
  monkeypatch.setattr(demo_real, "prepare_data", lambda *a: (squad_data, good, {}))
  monkeypatch.setattr(demo_real, "run_stage", failed_stage)
  with pytest.raises(stages.StageFailed):
    demo_real.run_demo_real(str(work))
  assert json.loads((work / "wall.json").read_text())["runs"] == 1


def test_questions_no_reader_can_answer_are_counted_and_warned_about(tmp_path, capsys):
  """A kept question whose answers the vocab spells only with [UNK], or whose answer is in
  no block of its paragraph, is counted by reason (stats.json, the `[prepare]` line); an
  unanswerable one is skipped and counted. `make demo-real` warns where they are many."""
  from realm_jax import demo_real
  path = write_squad(tmp_path / "squad.json")
  data = json.loads(open(path).read())
  qas = [article["paragraphs"][0]["qas"] for article in data["data"]]
  qas[0][0]["answers"] = [{"text": "Ada Brisk in 1843. Its great refractor telescope was "
                                     "built", "answer_start": 0}]      # 12 wordpieces: wide
  qas[1][0]["answers"] = [{"text": "東京", "answer_start": 0}]          # [UNK] in this vocab
  qas[2][0]["answers"] = [{"text": "Marta Voss", "answer_start": 0}]    # another paragraph's
  qas[3].append({"id": "v2", "question": "who?", "answers": [], "is_impossible": True})
  with open(path, "w") as f:
    json.dump(data, f)
  config = prepare_lib.prepare_config()
  config.source, config.out_dir = f"squad:{path}", str(tmp_path / "data")
  config.block_len, config.max_sentence_len, config.vocab_size = 32, 30, 300
  config.num_workers, config.eval_fraction, config.progress_every = 0, 0.0, 1e9
  stats = prepare_lib.prepare(config)
  assert stats["questions"] == 4
  assert stats["questions_skipped"] == {"unanswerable (SQuAD v2)": 1}
  assert stats["questions_unfound"] == {prepare_lib.ANSWER_UNSPELT: 1,
                                        prepare_lib.ANSWER_NOT_IN_BLOCKS: 1}
  assert PreparedData(config.out_dir).stats["questions_unfound"] == stats["questions_unfound"]
  out = capsys.readouterr().out
  assert ("[prepare] 4 questions kept, 2 of them (50%) with no answer span in their "
          "paragraph's blocks (") in out
  assert "; 1 skipped (unanswerable (SQuAD v2): 1)" in out
  demo_real.check_questions(str(tmp_path), config.out_dir, config.source, 0, "cpu")
  assert ("[demo-real] warning: 3 of the file's 4 questions have no answer span in their own "
          "paragraph's blocks (") in capsys.readouterr().out      # the reader's width: 10
  questions = zero_shot.load_questions(config.out_dir)
  tokenizer = PreparedData(config.out_dir).tokenizer
  assert prepare_lib.unfound_questions(config.out_dir, tokenizer, questions[:1], 12) == {}
  assert prepare_lib.unfound_questions(config.out_dir, tokenizer, questions[:1], 11) == {
      prepare_lib.ANSWER_TOO_WIDE: 1}
  (tmp_path / "clean").mkdir()
  clean = prepare_squad(tmp_path / "clean")          # every answer in its paragraph
  assert PreparedData(clean).stats["questions_unfound"] == {}
  demo_real.check_questions(str(tmp_path / "clean"), clean, f"squad:{tmp_path}/clean/squad.json",
                            0, "cpu")
  assert "warning" not in capsys.readouterr().out


def test_a_paragraph_split_holds_out_the_same_questions_for_both_tables(squad_data, tmp_path):
  """By paragraph, the zero-shot table (the prepared questions) and Open-QA (the file read
  again) hold out the same questions; data prepared before paragraph keys is named."""
  import ml_collections
  from realm_jax.data.qa import qa_split
  from realm_jax.data.sources import paragraph_key
  from realm_jax.errors import DataError
  source = f"squad:{os.path.join(os.path.dirname(squad_data), 'squad.json')}"
  keys = [paragraph_key(c) for _, c in TOPICS]
  share = next(f for f in (0.2, 0.3, 0.4, 0.5, 0.6, 0.7)
               if 0 < sum(is_heldout_article(k, f) for k in keys) < len(keys))
  config = ml_collections.ConfigDict({"train": source, "test": source, "heldout_articles": share,
                                      "heldout_unit": "paragraph"})
  held = zero_shot.table_questions(PreparedData(squad_data), squad_data, share, "paragraph")
  test, train = qa_split(config, "test")[0], qa_split(config, "train")[0]
  assert sorted(q["id"] for q in held) == sorted(ex.qid for ex in test)
  assert len(test) + len(train) == len(QUESTIONS) and test and train
  old = tmp_path / "old"
  shutil.copytree(squad_data, old)
  rows = [json.loads(line) for line in open(old / "qa" / "eval.jsonl")]
  with open(old / "qa" / "eval.jsonl", "w") as f:
    f.writelines(json.dumps({k: v for k, v in r.items() if k != "paragraph"}) + "\n"
                 for r in rows)
  with pytest.raises(DataError, match=r"old/qa/eval.jsonl: its questions carry no paragraph "
                     r"key .*remove .*/old and prepare it again"):
    zero_shot.table_questions(PreparedData(str(old)), str(old), share, "paragraph")


def test_demo_openqa_checks_its_questions_before_training(tmp_path, capsys, monkeypatch):
  from realm_jax import demo_squad
  from realm_jax.errors import ConfigError
  source = f"squad:{write_squad(tmp_path / 'squad.json')}"      # 1 of 4 articles held out
  demo_squad.check_openqa_questions(source)
  assert "3 to fine-tune on, 1 to test" in capsys.readouterr().out
  three = write_squad(tmp_path / 'three.json', TOPICS[:3])
  with pytest.raises(ConfigError, match=r"config\.qa\.test: .*holds out 0 of its 3 articles"):
    demo_squad.check_openqa_questions(f"squad:{three}")
  # and `make demo-openqa` checks before it pre-trains (prepare and the stages stand-ins here)
  from realm_jax.data import prepare as prepare_lib
  monkeypatch.setattr(prepare_lib, "prepare", lambda config: {})
  monkeypatch.setattr(demo_squad, "run_stages", lambda *a: pytest.fail("pre-trained first"))
  with pytest.raises(ConfigError, match="holds out 0 of its 3 articles"):
    demo_squad.run_demo_openqa(str(tmp_path / "w"), three)
  assert not (tmp_path / "w" / demo_squad.OPENQA_WALL).exists()   # a refused run adds none


def test_demo_real_reads_a_larger_file_up_to_its_paragraph_limit(tmp_path, capsys):
  """A file over `--max-paragraphs` is read as its first whole articles (the first one
  whole in any case), written once for every stage to read; a file within it as it is."""
  from realm_jax import demo_real
  from realm_jax.data.qa import read_qa
  sizes = (2, 2, 3)
  data = {"version": "1.1", "data": [
      {"title": f"Article {a}", "paragraphs": [
          {"context": f"Paragraph {p} of article {a}.", "qas": [
              {"id": f"{a}.{p}", "question": f"what is {a}.{p}?",
               "answers": [{"text": "Paragraph", "answer_start": 0}]}]} for p in range(n)]}
      for a, n in enumerate(sizes)]}
  path = str(tmp_path / "squad.json")
  with open(path, "w") as f:
    json.dump(data, f)
  for limit in (0, 7, 100):
    assert demo_real.fit_to_the_hour(path, str(tmp_path / "w"), limit) == path
  outs = set()
  for limit, articles in ((6, 2), (4, 2), (3, 1), (1, 1)):
    out = demo_real.fit_to_the_hour(path, str(tmp_path / "w"), limit)
    assert os.path.dirname(out) == str(tmp_path / "w") and out.endswith(".json")
    assert demo_real.fit_to_the_hour(path, str(tmp_path / "w"), limit) == out   # a rerun
    outs.add(out)
    examples, _ = read_qa(f"squad:{out}")
    assert [ex.qid for ex in examples] == [f"{a}.{p}" for a in range(articles)
                                           for p in range(sizes[a])]
    assert (f"3 articles, 7 paragraphs; the recipe reads the first {articles} articles "
            f"({sum(sizes[:articles])} paragraphs)") in capsys.readouterr().out
  assert len(outs) == 2      # another content, another name: W/data is not reused across them


@pytest.mark.slow
def test_bm25_and_a_trained_retriever_side_by_side(squad_data, tmp_path):
  from realm_jax.train.loop import train
  config = load_config_module("squad_realm").get_config("ict")
  config.data.dir = squad_data
  config.data.block_len, config.data.query_len = 32, 32
  m = config.model
  m.hidden_size, m.num_heads, m.intermediate_size, m.num_layers, m.retrieval_dim = 32, 4, 64, 1, 16
  m.max_position = 64
  config.train.batch_size, config.train.steps, config.train.log_every = 8, 2, 1
  config.train.checkpoint_every = 2
  config.eval.num_examples, config.eval.batch_size = 8, 8
  workdir = str(tmp_path / "ict")
  train(config, workdir)
  table = zero_shot.recall_table(squad_data, {"ict": (config, workdir)}, ks=(1, 2, 4))
  assert set(table) == {"ict", "bm25"}
  # The questions repeat rare words of their paragraph: BM25 finds every one first.
  assert table["bm25"]["recall_at_1"] == 1.0
  for row in table.values():
    assert row["questions"] == 4
    assert 0 <= row["recall_at_1"] <= row["recall_at_2"] <= row["recall_at_4"] == 1.0
  assert "R@1" in zero_shot.format_table(table, ks=(1, 2, 4))
  # Data whose vocab lists other tokens (as many): the run's ids would mean other words.
  swapped = swapped_vocab_copy(squad_data, tmp_path / "swapped_vocab")
  with pytest.raises(ConfigError, match=r"config\.data\.dir: the data's .*swapped_vocab/"
                     r"vocab\.txt .* differs from"):
    zero_shot.recall_table(str(swapped), {"ict": (config, workdir)}, ks=(1, 2, 4))
  # The held-out articles' questions only (by title hash: here the fourth article), and the
  # retriever as the config starts it (no workdir: the untrained reference).
  assert [is_heldout_article(t, 0.2) for t, _ in TOPICS] == [False, False, False, True]
  table = zero_shot.recall_table(squad_data, {"untrained": (config, "")}, ks=(1, 4),
                                       heldout_articles=0.2)
  assert table["untrained"]["questions"] == table["bm25"]["questions"] == 1
  assert table["bm25"]["recall_at_1"] == 1.0 and table["untrained"]["recall_at_4"] == 1.0


def test_bm25_logs_at_the_projects_verbosity(squad_data, caplog):
  """bm25s sets its own logger to DEBUG when imported ("Building index from IDs objects" on
  the demos' console); its records follow the project's verbosity: none below warnings at 0,
  its debug lines at 1."""
  from realm_jax import log
  data, questions = PreparedData(squad_data), zero_shot.load_questions(squad_data)
  caplog.set_level(logging.DEBUG)
  before, bm25_level = log.verbosity(), logging.getLogger("bm25s").level
  try:
    for verbosity, shown in ((0, False), (1, True)):
      caplog.clear()
      log.set_verbosity(verbosity)
      rows = zero_shot.bm25_ranking(data, questions, n=2)
      assert np.asarray(data.blocks.doc_ids)[rows[:, 0]].tolist() == [0, 1, 2, 3]
      debug = [r for r in caplog.records if r.name == "bm25s" and r.levelno < logging.WARNING]
      assert bool(debug) == shown, (verbosity, [r.getMessage() for r in debug])
  finally:
    log.set_verbosity(before)
    logging.getLogger("bm25s").setLevel(bm25_level)


def test_bm25_ranks_no_block_for_a_question_with_no_term_in_the_corpus(squad_data):
  """Every block scores 0 for it: BM25's first rows (0, 1, ...) are no ranking, and the first
  paragraph's question must not count as found there."""
  data = PreparedData(squad_data)
  questions = [{"question": "Where is zzyzx?", "doc_id": 0},
               {"question": QUESTIONS[1], "doc_id": 1}]
  rows = zero_shot.bm25_ranking(data, questions, n=3)
  assert rows[0].tolist() == [-1, -1, -1] and rows[1, 0] >= 0
  recall = zero_shot.paragraph_recall(rows, np.asarray(data.blocks.doc_ids),
                                      np.array([0, 1]), ks=(1, 3))
  assert recall == {"recall_at_1": 0.5, "recall_at_3": 0.5}


def test_bm25_reads_a_question_as_it_reads_the_blocks(squad_data):
  """The blocks' text is the tokenizer's (lower-cased, accents stripped); the questions were
  read raw, so an accented name matched no block: "Kelmár?" ranked nothing, where "Kelmar?"
  ranks its paragraph first."""
  data = PreparedData(squad_data)
  questions = [{"question": name, "doc_id": 0} for name in ("Kelmár?", "Kelmar?", "KELMAR?")]
  rows = zero_shot.bm25_ranking(data, questions, n=3)
  assert rows[0].tolist() == rows[1].tolist() == rows[2].tolist(), rows
  assert np.asarray(data.blocks.doc_ids)[rows[0, 0]] == 0


def test_bm25_reads_no_term_of_a_questions_unknown_wordpiece(squad_data):
  """A question's character the vocab lacks is [UNK], which the tokenizer writes back as
  "[UNK]", the word "unk" to BM25: the question matched every block holding an [UNK] on it
  alone (a question of such characters, "日本?", ranked those blocks). It is no term."""
  import types
  data = PreparedData(squad_data)
  tok = data.tokenizer
  ids = tok.encode_batch(["Kelmar", "the river"])
  rows = [[tok.cls_id, *ids[0][0], tok.unk_id, tok.sep_id], [tok.cls_id, *ids[1][0], tok.sep_id]]
  width = max(map(len, rows))
  blocks = types.SimpleNamespace(
      tokens=np.array([r + [tok.pad_id] * (width - len(r)) for r in rows]),
      lengths=np.array(list(map(len, rows))), num_blocks=2)
  unknown = "\u65e5\u672c?"
  assert tok.encode_batch([unknown])[0][0][0] == tok.unk_id
  ranked = zero_shot.bm25_ranking(types.SimpleNamespace(blocks=blocks, tokenizer=tok),
                                  [{"question": unknown}, {"question": f"Kelmar {unknown}"}],
                                  n=2)
  assert ranked[0].tolist() == [-1, -1] and ranked[1].tolist() == [0, -1], ranked
