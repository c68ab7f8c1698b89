"""Open-QA question sets: every format read from files (bad records counted, or fatal with
file:line in strict mode), the real NQ-open / WebQuestions / SQuADShifts files with their exact
counts, the held-out-articles split, TFDS through mock data, and query-tower inputs."""

import json
import os
import tempfile

import ml_collections
import numpy as np
import pytest

from realm_jax.data import qa
from realm_jax.data.qa import QAExample, qa_split, question_inputs, read_qa
from realm_jax.data.tokenizer import train_tokenizer
from realm_jax.errors import ConfigError, DataError
from tests.helpers import REPO

SHARED = os.path.join(REPO, "..", "shared", "data")
# is_heldout_article(f"Article {a}", 0.25) for a < 8: a change here reshuffles every split
GOLDEN_HELDOUT = [True, False, True, False, False, False, False, False]


def write(path, text: str | bytes) -> str:
  with open(path, "wb") as f:
    f.write(text if isinstance(text, bytes) else text.encode())
  return str(path)


def qa_config(**fields) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict({"train": "", "dev": "", "test": "", "heldout_articles": 0.0})
  c.update(fields)
  return c


def squad_json(n_articles: int = 20) -> dict:
  return {"version": "v2.0", "data": [
      {"title": f"Article {a}", "paragraphs": [{"context": "...", "qas": [
          {"id": f"q{a}-{k}", "question": f"question {k} of {a}?",
           "answers": [{"text": "Ans", "answer_start": 0}, {"text": "other", "answer_start": 0},
                       {"text": "Ans", "answer_start": 0}]} for k in range(3)]}]}
      for a in range(n_articles)]}


def test_nq_open_counts_bad_lines_and_strict_names_the_line(tmp_path):
  lines = [b'{"question": "who wrote it", "answer": ["Bob Scott", "Bob Scott", " B. Scott "]}',
           b"",
           b'{"question": "broken", "answer": [',
           b'{"answer": ["x"]}',
           '{"question": "\u200b\u200d\u00ad", "answer": ["x"]}'.encode(),   # nothing read
           b'{"question": "none", "answer": []}',
           b'{"question": "numbers", "answer": [1977]}',
           b'["not", "an", "object"]',
           b'{"question": "caf\xe9", "answer": ["x"]}',
           b'{"question": "  when   was it ", "answer": "1977", "id": "q7", "title": "T"}']
  path = write(tmp_path / "nq.jsonl", b"\n".join(lines) + b"\n")
  examples, skipped = read_qa(f"nq_open:{path}")
  assert examples == [
      QAExample("nq.jsonl:1", "who wrote it", ("Bob Scott", "B. Scott"), False),
      QAExample("q7", "when was it", ("1977",), False, "T")]
  assert skipped == {qa.MALFORMED_JSON: 1, qa.MISSING_QUESTION: 2, qa.NO_ANSWERS: 1,
                     qa.NON_STRING_ANSWERS: 1, qa.NOT_AN_OBJECT: 1, qa.INVALID_UTF8: 1}
  with pytest.raises(DataError, match=f"{path}:3: malformed JSON"):
    read_qa(f"nq_open:{path}", strict=True)
  write(tmp_path / "more.jsonl", '{"question": "q", "answer": ["a"]}\n')
  both, _ = read_qa(f"nq_open:{tmp_path}/*.jsonl")
  assert [ex.qid for ex in both] == ["more.jsonl:1", "nq.jsonl:1", "q7"]


def test_a_question_or_answer_that_is_no_utf8_text_is_skipped(tmp_path):
  """A JSON-escaped lone surrogate ("\\ud800") decodes to a str no tokenizer takes: the
  question is skipped as invalid UTF-8 (a corpus document is), by Open-QA and realm-prepare
  alike, not a TypeError from the tokenizer once the run has read every question."""
  from realm_jax.data import prepare as prepare_lib, sources
  lines = [b'{"question": "who is \\ud800 it", "answer": ["Bob"]}',
           b'{"question": "who wrote it", "answer": ["Bob \\udc00"]}',
           b'{"question": "who else", "answer": ["Ann"]}']
  path = write(tmp_path / "nq.jsonl", b"\n".join(lines) + b"\n")
  examples, skipped = read_qa(f"nq_open:{path}")
  assert [ex.question for ex in examples] == ["who else"]
  assert skipped == {qa.INVALID_UTF8: 2}
  with pytest.raises(DataError, match=f"{path}:1: invalid UTF-8"):
    read_qa(f"nq_open:{path}", strict=True)
  data = squad_json(1)
  first = data["data"][0]["paragraphs"][0]["qas"]
  first[0]["question"] = "who is \ud800 it"
  first[1]["answers"] = [{"text": "Ans \udc00", "answer_start": 0}]
  squad = write(tmp_path / "squad.json", json.dumps(data))
  examples, skipped = read_qa(f"squad:{squad}")
  assert [ex.qid for ex in examples] == ["q0-2"] and skipped == {qa.INVALID_UTF8: 2}
  config = prepare_lib.prepare_config()
  config.source = f"squad:{squad}"
  skips = sources.Skips(strict=False)
  docs = list(sources.read_documents(config, skips))
  assert [q["id"] for q in docs[0].qas] == ["q0-2"]
  assert skips.questions == {qa.INVALID_UTF8: 2}


def test_a_bom_alone_on_the_first_line_is_a_blank_line(tmp_path):
  """A BOM'd file whose first line is blank: no malformed record, also with strict (the
  corpus's JSONL reader and the question reader alike)."""
  from realm_jax.data import prepare as prepare_lib, sources
  path = write(tmp_path / "q.jsonl", b"\xef\xbb\xbf\n" + json.dumps(
      {"question": "who?", "answer": ["me"], "title": "T", "text": "Some text."}).encode() + b"\n")
  examples, skipped = read_qa(f"nq_open:{path}", strict=True)
  assert [ex.qid for ex in examples] == ["q.jsonl:2"] and not skipped
  config = prepare_lib.prepare_config()
  config.source = f"jsonl:{path}"
  skips = sources.Skips(strict=True)
  assert [doc.title for doc in sources.read_documents(config, skips)] == ["T"]
  assert skips.counts == {}


@pytest.mark.parametrize("kind", ["nq_open", "curated_trec"])
def test_a_glob_over_files_of_one_name_keeps_every_question(tmp_path, kind):
  """Questions without ids are named `<file>:<line>`, the file by its path below the glob's
  last folder without a wildcard: files of one name in several folders are not dropped as
  repeated ids, and a question keeps its id when the glob matches another folder."""
  for folder in ("a", "b"):
    os.makedirs(tmp_path / folder)
    with open(tmp_path / folder / "test.jsonl", "w") as f:
      f.write(json.dumps({"question": f"where is {folder}?", "answer": ["here"]}) + "\n")
    examples, skipped = read_qa(f"{kind}:{tmp_path}/*/test.jsonl")
    assert [e.qid for e in examples][0] == "a/test.jsonl:1" and not skipped
  assert [e.qid for e in examples] == ["a/test.jsonl:1", "b/test.jsonl:1"]
  examples, _ = read_qa(f"{kind}:{tmp_path}/a/test.jsonl")
  assert [e.qid for e in examples] == ["test.jsonl:1"]


def test_records_nested_too_deep_for_the_parser_are_malformed(tmp_path):
  """JSON nested deeper than Python's parser recurses, or with a number longer than Python
  converts, is a malformed record (or file), and a TSV list literal Python cannot build (a
  list inside a set) one regex: neither a traceback."""
  deep = b"[" * 100_000 + b"]" * 100_000
  long_id = b'{"question": "q", "answer": ["a"], "id": ' + b"1" * 5000 + b"}"   # past int()'s
  path = write(tmp_path / "nq.jsonl",                                        # 4,300 digits
               deep + b"\n" + long_id + b'\n{"question": "q", "answer": ["a"]}\n')
  examples, skipped = read_qa(f"nq_open:{path}")
  assert [ex.qid for ex in examples] == ["nq.jsonl:3"] and skipped == {qa.MALFORMED_JSON: 2}
  trec = write(tmp_path / "trec.txt", b'{"question": ' + deep + b'}\nwhich set\t[{[1]}]\n')
  examples, skipped = read_qa(f"curated_trec:{trec}")
  assert [ex.answers for ex in examples] == [("[{[1]}]",)] and skipped == {qa.MALFORMED_JSON: 1}
  for spec in ("webq", "squad"):
    with pytest.raises(DataError, match="RecursionError"):
      read_qa(f"{spec}:{write(tmp_path / 'deep.json', deep)}")


def test_a_file_at_the_filesystem_root_is_named_by_its_name(monkeypatch):
  monkeypatch.setattr(qa, "matching_files", lambda pattern: ["/test.jsonl"])
  assert qa._files("/test.jsonl") == {"/test.jsonl": "test.jsonl"}


def test_webquestions_skips_duplicates_and_empty_answers(tmp_path):
  rows = [{"qId": "wq1", "qText": "what is it?", "answers": ["It"]},
          {"qId": "wq2", "answers": ["x"]},
          {"qId": "wq1", "qText": "again?", "answers": ["y"]},
          {"qId": "wq4", "qText": "empty?", "answers": []},
          {"qText": "no id?", "answers": ["z"]}]
  path = write(tmp_path / "wq.json", json.dumps(rows))
  examples, skipped = read_qa(f"webq:{path}")
  assert [(ex.qid, ex.question, ex.answers) for ex in examples] == [
      ("wq1", "what is it?", ("It",)), ("wq.json[4]", "no id?", ("z",))]
  assert skipped == {qa.MISSING_QUESTION: 1, qa.DUPLICATE_ID: 1, qa.NO_ANSWERS: 1}
  with pytest.raises(DataError, match=r"wq\.json: \[1\]: missing question"):
    read_qa(f"webq:{path}", strict=True)
  with pytest.raises(DataError, match="not a JSON file"):
    read_qa(f"webq:{write(tmp_path / 'bad.json', '[{')}")


def test_curated_trec_tsv_and_jsonl_answers_are_regexes(tmp_path):
  tsv = write(tmp_path / "trec.tsv", "who was president in 1977\tJimmy Carter|James Earl Carter\n"
              "when did it happen\t1\\s*9\\s*7\\s*7\n"
              'dpr style\t["Paris", "paris, france"]\n'
              "a line without a tab\n"
              "bad pattern\t(unclosed\n")
  examples, skipped = read_qa(f"curated_trec:{tsv}")
  assert [(ex.question, ex.answers, ex.is_regex) for ex in examples] == [
      ("who was president in 1977", ("Jimmy Carter|James Earl Carter",), True),
      ("when did it happen", (r"1\s*9\s*7\s*7",), True),
      ("dpr style", ("Paris", "paris, france"), True)]
  assert skipped == {qa.MALFORMED_TSV: 1, qa.BAD_REGEX: 1}
  with pytest.raises(DataError, match=f"{tsv}:4: {qa.MALFORMED_TSV}"):
    read_qa(f"curated_trec:{tsv}", strict=True)
  bad = write(tmp_path / "bad.tsv", "q\tCarter\nbad pattern\t(unclosed\n")
  with pytest.raises(DataError, match=f"{bad}:2: {qa.BAD_REGEX}"):
    read_qa(f"curated_trec:{bad}", strict=True)
  jsonl = write(tmp_path / "CuratedTrec-test.txt",
                '{"question": "q", "answer": ["Carter|Ford"]}\n{"question": "r", "answer": [7]}\n')
  examples, skipped = read_qa(f"curated_trec:{jsonl}")
  assert examples == [QAExample("CuratedTrec-test.txt:1", "q", ("Carter|Ford",), True)]
  assert skipped == {qa.NON_STRING_ANSWERS: 1}


@pytest.mark.parametrize("kind, name, text", [
    ("nq_open", "nq.jsonl", '{"question": "who?", "answer": ["Ada"]}\n'
                            '{"question": "when?", "answer": ["1843"]}\n'),
    ("webq", "wq.json", json.dumps([{"qId": "wq1", "qText": "where?", "answers": ["Carrow"]}])),
    ("curated_trec", "trec.tsv", "who was it\tAda|Brisk\n")])
def test_a_gzipd_question_file_reads_as_the_plain_one(tmp_path, kind, name, text):
  """A question file gzip'd (as corpora and SQuAD files may be, read by their magic bytes):
  the same questions as the plain file (it was one line "gives no questions", its bytes
  counted as invalid UTF-8 or malformed JSON); one cut short is a DataError naming it."""
  import gzip
  plain = write(tmp_path / name, text)
  packed = tmp_path / f"{name}.gz"
  packed.write_bytes(gzip.compress(text.encode()))
  assert read_qa(f"{kind}:{packed}")[0] and \
      [(e.question, e.answers) for e in read_qa(f"{kind}:{packed}")[0]] == \
      [(e.question, e.answers) for e in read_qa(f"{kind}:{plain}")[0]]
  cut = tmp_path / f"cut-{name}.gz"
  cut.write_bytes(packed.read_bytes()[:-12])
  with pytest.raises(DataError, match=f"{cut}: a corrupt or truncated gzip file"):
    read_qa(f"{kind}:{cut}")


def test_squad_questions_keep_titles_and_skip_unanswerable(tmp_path):
  data = squad_json(2)
  data["data"][0]["paragraphs"][0]["qas"][1]["is_impossible"] = True
  data["data"][1]["paragraphs"][0]["qas"][2]["id"] = "q1-0"
  data["data"][1]["paragraphs"].append("not a paragraph")
  path = write(tmp_path / "squad.json", json.dumps(data))
  examples, skipped = read_qa(f"squad:{path}")
  assert [(ex.qid, ex.title) for ex in examples] == [
      ("q0-0", "Article 0"), ("q0-2", "Article 0"), ("q1-0", "Article 1"), ("q1-1", "Article 1")]
  assert examples[0].answers == ("Ans", "other") and not examples[0].is_regex
  assert skipped == {qa.UNANSWERABLE: 1, qa.DUPLICATE_ID: 1, qa.NOT_AN_OBJECT: 1}
  with pytest.raises(DataError, match=r"data\[0\]\.paragraphs\[0\]\.qas\[1\]: unanswerable"):
    read_qa(f"squad:{path}", strict=True)


def messy_squad() -> dict:
  """A SQuAD v2 file with every kind of question and paragraph a reader can meet."""
  data = squad_json(4)
  first = data["data"][0]["paragraphs"][0]["qas"]
  first[0]["is_impossible"], first[0]["answers"] = True, []          # v2 unanswerable
  first[1]["answers"] = None                                          # no answers
  first[2]["answers"] = [{"answer_start": 3}]                         # an answer without text
  second = data["data"][1]["paragraphs"][0]["qas"]
  second[0]["answers"] = "Ans"                                        # a bare string
  second[1]["answers"] = [{"text": "Ans"}]                            # no answer_start
  second[2]["question"] = "  "                                        # no question
  del data["data"][2]["title"]                                        # an untitled article
  data["data"][3]["paragraphs"].append({"context": " ", "qas": [     # an empty paragraph
      {"id": "e0", "question": "q?", "answers": [{"text": "x", "answer_start": 0}]}]})
  data["data"][3]["paragraphs"].append({"context": "...", "qas": [   # a repeated paragraph
      {"id": "d0", "question": "q?", "answers": [{"text": "x", "answer_start": 0}]}]})
  data["data"][3]["paragraphs"][0]["qas"].append(                     # a repeated id (and
      {"id": "q1-0", "question": "again?", "answers": ["x"]})          # one the repeat had)
  data["data"][3]["paragraphs"][0]["qas"].append(
      {"id": "d0", "question": "d?", "answers": ["y"]})
  del data["data"][3]["paragraphs"][0]["qas"][0]["id"]                # a question without id
  return data


def test_the_corpus_and_open_qa_read_the_same_squad_questions(tmp_path):
  """realm-prepare's questions (the zero-shot table's) and Open-QA's are the same ones, each
  skip counted by the same reason; a BOM or gzip changes nothing, a non-SQuAD file is named."""
  import gzip
  from realm_jax.data import prepare as prepare_lib, sources
  data = messy_squad()
  data["data"][3]["paragraphs"].append({"context": "x" * (sources.MAX_DOC_BYTES + 1), "qas": [
      {"id": "big0", "question": "q?", "answers": ["x"]}]})    # over max_doc_bytes: both skip
  data["data"][3]["paragraphs"] += [{"context": "Once.", "qas": "none"},   # a paragraph with
      {"context": "Once.", "qas": [{"id": "r0", "question": "q?", "answers": ["x"]}]}]  # no
  # question list is a block, so its repeat is a repeat for both
  data["data"][3]["paragraphs"][0]["qas"].append(   # nothing the tokenizer reads: no question
      {"id": "zw", "question": "\u200b\u00ad", "answers": ["y"]})
  text = json.dumps(data)
  files = [write(tmp_path / "squad.json", text),
           write(tmp_path / "bom.json", b"\xef\xbb\xbf" + text.encode()),
           write(tmp_path / "squad.json.gz", gzip.compress(text.encode()))]
  for path in files:
    examples, skipped = read_qa(f"squad:{path}")
    assert [ex.qid for ex in examples] == ["q1-0", "q1-1", f"{os.path.basename(path)}:3.0.0",
                                           "q3-1", "q3-2", "d0"]
    assert examples[0].answers == ("Ans",)
    assert skipped == {qa.UNANSWERABLE: 1, qa.NO_ANSWERS: 1, qa.NON_STRING_ANSWERS: 1,
                       qa.MISSING_QUESTION: 2, sources.MISSING_TITLE: 3, sources.EMPTY: 1,
                       sources.DUPLICATE: 2, sources.TOO_LARGE: 1, qa.DUPLICATE_ID: 1,
                       sources.NOT_AN_OBJECT: 1}
    config = prepare_lib.prepare_config()
    config.source = f"squad:{path}"
    skips = sources.Skips(strict=False)
    docs = list(sources.read_documents(config, skips))
    assert [q["id"] for doc in docs for q in doc.qas] == [ex.qid for ex in examples]
    assert [q["answer_start"] for q in docs[1].qas] == [[None], [None]]
    assert skips.counts == {sources.MISSING_TITLE: 1, sources.EMPTY: 1, sources.DUPLICATE: 2,
                            sources.TOO_LARGE: 1}
    assert skips.questions == {qa.UNANSWERABLE: 1, qa.NO_ANSWERS: 1, qa.NON_STRING_ANSWERS: 1,
                               qa.MISSING_QUESTION: 2, qa.DUPLICATE_ID: 1,
                               sources.NOT_AN_OBJECT: 1, sources.PARAGRAPH_SKIPPED: 7}
  for body, found in ((json.dumps(messy_squad()["data"]), "found an array"),
                      (json.dumps({"data": None}), "'data' is null"),
                      (json.dumps({"foo": 1}), "an object without 'data' \\(keys: 'foo'\\)"),
                      (text + "\n" + text, "JSONDecodeError: Extra data")):
    bad = write(tmp_path / "bad.json", body)
    for read in (lambda: read_qa(f"squad:{bad}"), lambda: sources.read_squad_articles(bad)):
      with pytest.raises(DataError, match=f"{bad}: not a SQuAD-format JSON file.*{found}"):
        read()
  with pytest.raises(DataError, match="corrupt or truncated gzip"):
    sources.read_squad_articles(write(tmp_path / "cut.json.gz", gzip.compress(b"{}")[:12]))


def test_a_split_without_questions_says_how_many_articles_are_held_out(tmp_path):
  path = write(tmp_path / "squad.json", json.dumps(squad_json(1)))   # held out at 0.25
  assert GOLDEN_HELDOUT[0]
  config = qa_config(train=f"squad:{path}", heldout_articles=0.25)
  with pytest.raises(ConfigError, match=r"config\.qa\.train: .* no questions for the train "
                     r"split.*heldout_articles=0\.25, which holds out 1 of its 1 articles"):
    qa_split(config, "train")


def test_prepared_split_and_spec_errors(tmp_path):
  os.makedirs(tmp_path / "data" / "qa")
  write(tmp_path / "data" / "qa" / "eval.jsonl",
        '{"question": "q?", "answer": ["a"], "id": "s1", "doc_id": 3, "answer_start": [0]}\n')
  examples, _ = read_qa("prepared:eval", data_dir=str(tmp_path / "data"))
  assert examples == [QAExample("s1", "q?", ("a",), False)]
  with pytest.raises(ConfigError, match="config.qa.dev: .*set data.dir"):
    qa_split(qa_config(dev="prepared:eval"), "dev")
  with pytest.raises(ConfigError, match="config.qa.test: .*no such file"):
    qa_split(qa_config(test="prepared:test"), "test", str(tmp_path / "data"))
  with pytest.raises(ConfigError, match="config.qa.train: is empty"):
    qa_split(qa_config(), "train")
  for spec in ("bogus:x", "nq_open:", f"nq_open:{tmp_path}/none*.jsonl", "squad:/no/such.json",
               "tfds:squad"):
    with pytest.raises(ConfigError, match="config.qa.dev"):
      qa_split(qa_config(dev=spec), "dev")
  only_bad = write(tmp_path / "bad.jsonl", '{"question": "q", "answer": []}\n')
  with pytest.raises(ConfigError, match="gives no questions .*no answers"):
    qa_split(qa_config(dev=f"nq_open:{only_bad}"), "dev")


def test_heldout_articles_split_is_disjoint_and_stable(tmp_path):
  path = write(tmp_path / "squad.json", json.dumps(squad_json(40)))
  config = qa_config(train=f"squad:{path}", dev=f"squad:{path}", test=f"squad:{path}",
                     heldout_articles=0.25)
  train, _ = qa_split(config, "train")
  dev, _ = qa_split(config, "dev")
  test, _ = qa_split(config, "test")
  train_titles, dev_titles = {ex.title for ex in train}, {ex.title for ex in dev}
  assert not train_titles & dev_titles and len(train_titles | dev_titles) == 40
  assert dev == test and 4 <= len(dev_titles) <= 16 and len(train) + len(dev) == 120
  assert qa_split(config, "dev")[0] == dev
  # the hash is blake2b of the title, not Python's salted hash(): the same on every machine
  assert sorted(dev_titles, key=lambda t: int(t.split()[1])) == [
      t for t in (f"Article {a}" for a in range(40)) if qa.is_heldout_article(t, 0.25)]
  assert [qa.is_heldout_article(f"Article {a}", 0.25) for a in range(8)] == GOLDEN_HELDOUT
  nq = write(tmp_path / "nq.jsonl", '{"question": "q", "answer": ["a"]}\n')
  with pytest.raises(ConfigError, match="config.qa.heldout_articles: .*have none"):
    qa_split(qa_config(train=f"nq_open:{nq}", heldout_articles=0.1), "train")
  assert len(qa_split(qa_config(train=f"nq_open:{nq}"), "train")[0]) == 1


def test_one_article_is_split_by_paragraph(tmp_path):
  """A file of one article (comments under one title): by title its questions are all held
  out or all trained on; qa.heldout_unit = "paragraph" splits it by a hash of each
  paragraph's text, disjoint and stable, a paragraph's questions on one side."""
  from realm_jax.data.sources import paragraph_key
  contexts = [f"Comment number {p} says the  ferry is late." for p in range(40)]
  path = write(tmp_path / "one.json", json.dumps({"data": [{"title": "Comments", "paragraphs": [
      {"context": c, "qas": [{"id": f"q{p}-{k}", "question": f"question {k} of {p}?",
                              "answers": [{"text": "Comment", "answer_start": 0}]}
                             for k in range(2)]} for p, c in enumerate(contexts)]}]}))
  spec = f"squad:{path}"
  by_title = qa_config(train=spec, test=spec, heldout_articles=0.25)
  side = "test" if qa.is_heldout_article("Comments", 0.25) else "train"
  other = "train" if side == "test" else "test"
  assert len(qa_split(by_title, side)[0]) == 80
  with pytest.raises(ConfigError, match=rf"gives no questions for the {other} split .*holds "
                     r"out [01] of its 1 articles by title hash"):
    qa_split(by_title, other)
  config = qa_config(train=spec, test=spec, heldout_articles=0.25, heldout_unit="paragraph")
  train, test = qa_split(config, "train")[0], qa_split(config, "test")[0]
  of = lambda examples: {ex.qid.split("-")[0] for ex in examples}
  assert not of(train) & of(test) and len(of(train) | of(test)) == 40
  assert 4 <= len(of(test)) <= 16 and len(train) + len(test) == 80
  assert sorted(of(test), key=lambda q: int(q[1:])) == [      # whitespace-normalised text
      f"q{p}" for p, c in enumerate(contexts)
      if qa.is_heldout_article(paragraph_key(" ".join(c.split())), 0.25)]
  assert qa_split(config, "test")[0] == test
  with pytest.raises(ConfigError, match="config.qa.heldout_unit: 'title' is not one of"):
    qa_split(qa_config(train=spec, heldout_articles=0.25, heldout_unit="title"), "train")
  nq = write(tmp_path / "nq.jsonl", '{"question": "q", "answer": ["a"]}\n')
  with pytest.raises(ConfigError, match=r"config.qa.heldout_articles: 0.1 splits by paragraph "
                     r"\(qa.heldout_unit\), but 1 of the 1 questions .* have none"):
    qa_split(qa_config(train=f"nq_open:{nq}", heldout_articles=0.1, heldout_unit="paragraph"),
             "train")


def test_real_question_files_are_read_whole():
  if not os.path.isdir(SHARED):
    pytest.skip(f"{SHARED} is absent (real data of ../shared/data)")
  nq, skipped = read_qa(f"nq_open:{SHARED}/NQ-open.dev.jsonl", strict=True)
  assert len(nq) == 3610 and not skipped
  assert nq[0] == QAExample("NQ-open.dev.jsonl:1", "when was the last time anyone was on the moon",
                            ("14 December 1972 UTC", "December 1972"), False)
  wq, skipped = read_qa(f"webq:{SHARED}/webquestions_test.json", strict=True)
  assert len(wq) == 2032 and not skipped and wq[0].qid == "wqs000000"
  assert wq[0].answers == ("Jamaican Creole English Language", "Jamaican English")
  squad, skipped = read_qa(f"squad:{SHARED}/squadshifts_new_wiki_v1.0.json", strict=True)
  assert len(squad) == 7938 and not skipped and len({ex.title for ex in squad}) == 48
  assert squad[0].answers[:2] == (
      "Each brotherhood elects two delegates who take part in the National Ecclesiastical "
      "Assembly", "two delegates")


def test_tfds_question_sets_through_mock_data(tmp_path, monkeypatch):
  tfds = pytest.importorskip("tensorflow_datasets")
  temp = tmp_path / "temp"            # TFDS's temp folders go here: none may be left
  temp.mkdir()
  monkeypatch.setattr(tempfile, "tempdir", str(temp))
  spec = "tfds:natural_questions_open:validation"
  with pytest.raises(ConfigError, match="config.qa.dev: .*not prepared.*tfds build "
                     "natural_questions_open"):
    qa_split(qa_config(dev=spec, tfds_data_dir=str(tmp_path / "tfds")), "dev")
  for name, n in (("natural_questions_open:validation", 9), ("web_questions:test", 6)):
    with tfds.testing.mock_data(num_examples=n):
      examples, skipped = read_qa(f"tfds:{name}", tfds_data_dir=str(tmp_path / "tfds"))
    assert len(examples) + sum(skipped.values()) == n
    assert set(skipped) <= {qa.NO_ANSWERS, qa.MISSING_QUESTION}
    assert all(isinstance(ex.question, str) and ex.answers and
               all(isinstance(a, str) for a in ex.answers) for ex in examples)
    assert len({ex.qid for ex in examples}) == len(examples)
  assert not os.listdir(temp)


def test_question_inputs_pad_and_flag_truncation(tmp_path):
  tok = train_tokenizer(["who wrote the song", "when was the moon landing"] * 5,
                        str(tmp_path / "vocab"), vocab_size=80)
  questions = [QAExample("a", "who wrote the song", ("x",), False),
               "when was the moon landing who wrote the song"]
  ids, truncated = question_inputs(tok, questions, query_len=10)
  assert ids.shape == (2, 10) and ids.dtype == np.int32
  assert truncated.tolist() == [len(tok.encode_batch(["who wrote the song"])[0][0]) > 8, True]
  first = [tok.cls_id] + tok.encode_batch(["who wrote the song"])[0][0][:8] + [tok.sep_id]
  assert ids[0, :len(first)].tolist() == first and not ids[0, len(first):].any()
  assert ids[1, 0] == tok.cls_id and ids[1, -1] == tok.sep_id
  assert question_inputs(tok, [], 10)[0].shape == (0, 10)
