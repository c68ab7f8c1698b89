"""Open-QA: ORQA's losses, the span labels, fine-tuning (resume == uninterrupted), realm-eval
and realm-predict on a tiny world."""

from __future__ import annotations

import json
import logging
import os
import pathlib
import re
import shutil

import jax
import numpy as np
import pytest

from realm_jax.data.answers import exact_match, normalize_answer
from realm_jax.errors import ConfigError
from realm_jax.models import losses
from realm_jax.models.realm import span_candidates
from tests import helpers


def openqa_config(world_dir: str, **overrides):
  c = helpers.tiny_config("realm", data_dir=world_dir)
  c.task = "openqa"
  c.qa.train, c.qa.dev, c.qa.test = "prepared:train", "", "prepared:eval"
  c.model.span_hidden_size, c.model.max_span_width = 16, 4
  c.qa.searcher_beam, c.qa.reader_beam = 64, 3
  # A warm-up longer than the run keeps the learning rate independent of train.steps, so a
  # run stopped at step 3 and resumed must repeat the uninterrupted one exactly.
  c.train.lr, c.train.warmup_steps = 3e-3, 10
  c.train.steps, c.train.checkpoint_every = 6, 3
  c.train.async_checkpoints = False
  c.eval.batch_size = 64
  return helpers.apply_overrides(c, overrides)


def _logsumexp(x, axis=-1):
  m = x.max(axis=axis, keepdims=True)
  return (m + np.log(np.exp(x - m).sum(axis=axis, keepdims=True))).squeeze(axis)


def test_openqa_loss_matches_a_numpy_reference():
  rng = np.random.default_rng(0)
  b, n, k, s = 4, 12, 3, 7
  logits = rng.normal(size=(b, n)).astype(np.float32)
  spans = rng.normal(size=(b, k, s)).astype(np.float32)
  has = rng.random((b, n)) < 0.3
  has[0] = False                            # no answer-bearing block: retriever term 0
  correct = rng.random((b, k, s)) < 0.2
  correct[1] = False                        # no matching span: reader term 0
  loss, metrics = losses.openqa_loss(logits, has, spans, correct)
  expected = []
  for i in range(b):
    log_p = logits[i] - _logsumexp(logits[i])
    retriever = -_logsumexp(log_p[has[i]]) if has[i].any() else 0.0
    joint = (spans[i] + logits[i, :k, None]).ravel()
    flat = correct[i].ravel()
    reader = -(_logsumexp(joint[flat]) - _logsumexp(joint)) if flat.any() else 0.0
    expected.append(retriever + reader)
  np.testing.assert_allclose(float(loss), np.mean(expected), rtol=1e-5)
  np.testing.assert_allclose(float(metrics["answer_in_top_n"]), has.any(1).mean())
  grads = jax.grad(lambda l, sp: losses.openqa_loss(l, has, sp, correct)[0], (0, 1))(
      logits, spans)
  assert all(np.isfinite(np.asarray(g)).all() for g in grads)


def test_a_retriever_over_one_block_is_refused_for_training_unless_it_is_frozen():
  """Over one block (qa.searcher_beam 1, or a corpus of one) p(z|x) = 1: the retriever's loss
  is 0 and the reader's marginal cancels the block's logit, so the query tower gets no
  gradient and was only weight-decayed, unsaid (as ICT's batch of one, REALM's k of one
  block). Refused for training naming the option, unless train.retriever_lr_scale is 0 (the
  reader fine-tuned alone); realm-eval still reads such a config."""
  from realm_jax.config.validation import validate, validate_against_data, validate_training
  rng = np.random.default_rng(0)
  spans = rng.normal(size=(2, 1, 5)).astype(np.float32)
  grad = jax.grad(lambda l: losses.openqa_loss(l, np.ones((2, 1), bool), spans,
                                               spans > 0)[0])(np.ones((2, 1), np.float32))
  np.testing.assert_allclose(grad, 0.0, atol=1e-6)   # (rounding): all a retriever gets there
  config = openqa_config("", qa__searcher_beam=1, qa__reader_beam=1)
  validate(config)
  with pytest.raises(ConfigError) as refused:
    validate_training(config)
  assert refused.value.option == "qa.searcher_beam", str(refused.value)
  config = openqa_config("")
  validate_training(config)
  validate_against_data(config, num_blocks=2)
  with pytest.raises(ConfigError) as refused:
    validate_against_data(config, num_blocks=1)
  assert refused.value.option == "data.dir", str(refused.value)
  config.train.retriever_lr_scale = 0.0   # the reader alone: top-1 reading is its choice
  validate_against_data(config, num_blocks=1)
  validate_training(openqa_config("", qa__searcher_beam=1, qa__reader_beam=1,
                                  train__retriever_lr_scale=0.0))


def test_span_candidates_are_width_major_like_hf():
  starts, ends = span_candidates(5, 3)
  assert list(zip(starts, ends))[:7] == [(0, 0), (1, 1), (2, 2), (3, 3), (4, 4), (0, 1), (1, 2)]
  assert len(starts) == 5 + 4 + 3 and (ends - starts <= 2).all()


@pytest.fixture(scope="module")
def builder(world_dir, world_data):
  from realm_jax.data.qa import qa_split
  from realm_jax.retrieval.index import ExactIndex
  from realm_jax.train.openqa_inputs import FrozenIndex, QABatchBuilder
  config = openqa_config(world_dir)
  examples, _ = qa_split(config.qa, "train", world_dir)
  emb = np.random.default_rng(0).normal(size=(world_data.blocks.num_blocks, 32))
  frozen = FrozenIndex(version=0, step=0, embeddings=emb.astype(np.float32),
                       index=ExactIndex.from_embeddings(emb.astype(np.float32)))
  return QABatchBuilder(config, world_data, examples, frozen)


def test_span_labels_decode_to_the_answers(builder, world_data):
  """Every labelled span reads back as an answer; questions whose answer is in a top-K block
  get at least one label there."""
  rows = np.arange(24)
  every_block = np.arange(world_data.blocks.num_blocks)
  has = builder.has_answer(rows, np.broadcast_to(every_block, (len(rows), len(every_block))))
  assert has.any(axis=1).mean() > 0.8       # the world states almost every asked fact
  top = np.stack([np.concatenate([every_block[h], every_block[~h]])[:builder.k] for h in has])
  batch = builder.reader_batch(rows, top)
  labelled = 0
  for i, row in enumerate(rows):
    answers = builder.examples[row].answers
    found = np.argwhere(batch["span_correct"][i])
    for j, span in found:
      text, start, end = builder.span_text(batch["reader_ids"][i, j], int(span))
      assert batch["span_start_mask"][i, j, start] and batch["span_end_mask"][i, j, end]
      assert exact_match(text, builder.scored_answers(row)), (text, answers)
    if has[i].any():      # then top[i, 0] holds an answer
      assert len(found) > 0, builder.examples[row]
      labelled += 1
  assert labelled >= 18
  assert normalize_answer("The  Foto Bank!") == "foto bank"


def test_reader_inputs_cut_an_overlong_pair_as_hf_does(world_data):
  """The one Open-QA input builder: a pair longer than the reader keeps HF's longest-first cut
  and its final [SEP]; one that fits is the trainer's splice, untouched."""
  from realm_jax.train.openqa_inputs import reader_inputs, truncate_pair
  tok, blocks = world_data.tokenizer, world_data.blocks
  question = np.arange(10, 22, dtype=np.int32)              # 12 wordpieces
  q_ids = np.zeros((1, 16), np.int32)
  q_ids[0, :14] = [tok.cls_id, *question, tok.sep_id]
  q_len = np.asarray([14], np.int32)
  top = np.asarray([[0, 1]])
  body_len = blocks.lengths[top[0]] - blocks.body_start[top[0]] - 1
  reader_len = 20                                           # both pairs are too long
  _, out = reader_inputs(blocks, top, q_ids, q_len, reader_len, tok.cls_id, tok.sep_id)
  for j, row in enumerate(top[0]):
    nq, nb = truncate_pair(12, int(body_len[j]), reader_len - 3)
    start = int(blocks.body_start[row])
    expected = [tok.cls_id, *question[:nq], tok.sep_id,
                *np.asarray(blocks.tokens[row])[start:start + nb], tok.sep_id]
    assert list(out["reader_ids"][0, j]) == expected + [0] * (reader_len - len(expected))
    assert out["body_position"][0, j] == nq + 2 and out["body_kept"][0, j] == nb
    assert out["span_start_mask"][0, j].sum() == nb == out["reader_segments"][0, j].sum() - 1
  assert truncate_pair(3, 40, 17) == (3, 14) and truncate_pair(30, 40, 17) == (8, 9)
  fits = 16 + blocks.block_len - 2
  _, whole = reader_inputs(blocks, top, q_ids, q_len, fits, tok.cls_id, tok.sep_id)
  from realm_jax.data import pipeline
  cands = pipeline.candidate_inputs(blocks, top, tok.cls_id, tok.sep_id)
  ids, _ = pipeline.reader_inputs(q_ids, q_len, cands, fits)
  np.testing.assert_array_equal(whole["reader_ids"], ids)
  assert (whole["body_position"] == 14).all()


def _longest_first(n_first: int, n_second: int, budget: int) -> tuple[int, int]:
  """HF's `longest_first` cut, step by step: the last wordpiece of the longer goes until the
  pair fits; a tie drops from the one that was shorter at the start (the first if equal)."""
  tie_first = n_first <= n_second
  while n_first + n_second > budget:
    if n_first > n_second or (n_first == n_second and tie_first):
      n_first -= 1
    else:
      n_second -= 1
  return n_first, n_second


def _hf_longest_first(n_first: int, n_second: int, budget: int) -> tuple[int, int]:
  """The `tokenizers` library's own cut of a pair to `budget` + its 3 special tokens."""
  from tokenizers import Tokenizer, models, pre_tokenizers, processors
  tok = Tokenizer(models.WordLevel({"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "a": 3, "b": 4},
                                   unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.post_processor = processors.TemplateProcessing(
      single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
      special_tokens=[("[CLS]", 1), ("[SEP]", 2)])
  tok.enable_truncation(max_length=budget + 3, strategy="longest_first")
  ids = tok.encode(" ".join("a" * n_first), " ".join("b" * n_second)).ids
  return ids.count(3), ids.count(4)


@pytest.mark.parametrize("budget", [17, 18, 317])
def test_the_pair_cut_is_hfs_longest_first(budget):
  """`truncate_pair` against HF's `tokenizers` and a step-by-step reference: both short (no
  cut), the question long, the body long, both long (odd and even budgets, ties either way)."""
  from realm_jax.train.openqa_inputs import truncate_pair
  half = budget // 2
  pairs = [(3, 5), (0, budget), (budget, 0), (half, budget - half),       # both short
           (budget + 20, 4), (budget * 2, half), (budget, 1),            # question long
           (4, budget + 20), (half, budget * 2), (1, budget + 1),        # body long
           (budget, budget), (budget + 7, budget + 3), (budget + 3, budget + 7),  # both long
           (half + 1, half + 1), (half + 1, half + 2), (half + 2, half + 1), (94, 286)]
  for n_first, n_second in pairs:
    expected = _longest_first(n_first, n_second, budget)
    assert _hf_longest_first(n_first, n_second, budget) == expected, (n_first, n_second)
    assert truncate_pair(n_first, n_second, budget) == expected, (n_first, n_second)
    assert sum(expected) == min(n_first + n_second, budget)


def _short_builder(world_dir, world_data, reader_len):
  from realm_jax.data.qa import qa_split
  from realm_jax.retrieval.index import ExactIndex
  from realm_jax.train.openqa_inputs import FrozenIndex, QABatchBuilder
  config = openqa_config(world_dir, qa__reader_len=reader_len)
  examples, _ = qa_split(config.qa, "train", world_dir)
  emb = np.zeros((world_data.blocks.num_blocks, 4), np.float32)
  frozen = FrozenIndex(version=0, step=0, embeddings=emb, index=ExactIndex.from_embeddings(emb))
  return QABatchBuilder(config, world_data, examples, frozen)


def _answer_blocks(builder, rows):
  """[len(rows), K] block rows: each question's answer-bearing blocks first."""
  every = np.arange(builder.data.blocks.num_blocks)
  has = builder.has_answer(rows, np.broadcast_to(every, (len(rows), len(every))))
  return np.stack([np.concatenate([every[h], every[~h]])[:builder.k] for h in has])


def test_the_default_reader_length_cuts_nothing(builder, world_data):
  """qa.reader_len 0 is the trainer's length before it, query_len + block_len - 2: every pair
  whole, as the REALM reader's splice builds it, spans anywhere on the body's word bounds."""
  from realm_jax.data import pipeline
  assert builder.config.qa.reader_len == 0
  assert builder.reader_len == builder.config.data.query_len + world_data.blocks.block_len - 2
  rows = np.arange(40)
  top = _answer_blocks(builder, rows)
  batch = builder.reader_batch(rows, top)
  tok = world_data.tokenizer
  cands = pipeline.candidate_inputs(world_data.blocks, top, tok.cls_id, tok.sep_id)
  ids, segments = pipeline.reader_inputs(builder.question_ids[rows], builder.question_len[rows],
                                         cands, builder.reader_len)
  np.testing.assert_array_equal(batch["reader_ids"], ids)
  np.testing.assert_array_equal(batch["reader_segments"], segments)
  pieces = np.asarray([t.startswith("##") for t in tok.tokens(range(tok.vocab_size))])
  body = (segments > 0) & (ids != tok.sep_id)
  following = np.concatenate([ids[..., 1:], np.zeros_like(ids[..., :1])], -1)
  np.testing.assert_array_equal(batch["span_start_mask"], body & ~pieces[ids])
  np.testing.assert_array_equal(batch["span_end_mask"], body & ~pieces[following])


def test_a_short_reader_cuts_longest_first_and_labels_only_the_kept_body(builder, world_dir,
                                                                         world_data):
  """qa.reader_len 24 (the world's pairs are up to 16 + 37): each row is `[CLS] question
  [SEP] body [SEP]` cut longest first; spans start and end only in the kept body, on the full
  body's word bounds (a word cut in two ends no span); an answer is labelled at every
  occurrence wholly kept and nowhere else, so a question whose answer was cut off in every
  block it reads has no label, and adds nothing to the reader's loss."""
  from realm_jax.models.realm import span_candidates
  short = _short_builder(world_dir, world_data, 24)
  assert short.reader_len == 24
  tok, blocks = world_data.tokenizer, world_data.blocks
  pieces = np.asarray([t.startswith("##") for t in tok.tokens(range(tok.vocab_size))])
  rows = np.arange(40)
  top = _answer_blocks(short, rows)
  batch, whole = short.reader_batch(rows, top), builder.reader_batch(rows, top)
  starts, ends = span_candidates(24, short.max_width)
  column = {(int(a), int(b)): c for c, (a, b) in enumerate(zip(starts, ends))}
  cut = lost = 0
  for i, row in enumerate(rows):
    question = short.question_ids[row, 1:short.question_len[row] - 1]
    for j, block in enumerate(top[i]):
      begin, end = int(blocks.body_start[block]), int(blocks.lengths[block]) - 1
      body = np.asarray(blocks.tokens[block])[begin:end]
      nq, nb = _longest_first(len(question), len(body), 24 - 3)
      cut += nb < len(body)
      expected = [tok.cls_id, *question[:nq], tok.sep_id, *body[:nb], tok.sep_id]
      assert list(batch["reader_ids"][i, j]) == expected + [0] * (24 - len(expected))
      kept = np.zeros(24, bool)
      kept[nq + 2:nq + 2 + nb] = True
      after = np.append(body, 0)[1:nb + 1]       # the piece after each kept one, cut or not
      np.testing.assert_array_equal(batch["span_start_mask"][i, j][kept], ~pieces[body[:nb]])
      np.testing.assert_array_equal(batch["span_end_mask"][i, j][kept], ~pieces[after])
      assert not (batch["span_start_mask"][i, j][~kept].any() or
                  batch["span_end_mask"][i, j][~kept].any())
      labels = {column[(nq + 2 + a, nq + 2 + b)] for a, b in short.matcher(int(row)).spans(body)
                if b < nb and b - a < short.max_width}
      assert set(np.flatnonzero(batch["span_correct"][i, j])) == labels
      for c in labels:
        assert batch["span_start_mask"][i, j, starts[c]] and batch["span_end_mask"][i, j, ends[c]]
    lost += whole["span_correct"][i].any() and not batch["span_correct"][i].any()
  assert cut > 20 and lost > 0, (cut, lost)
  # the loss of a question with no label left: the retriever's term alone
  b, k, s = batch["span_correct"].shape
  none = ~batch["span_correct"].reshape(b, -1).any(-1)
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(b, 8)).astype(np.float32)
  has = np.zeros((b, 8), bool)
  spans = rng.normal(size=(b, k, s)).astype(np.float32)
  per_question = [float(losses.openqa_loss(logits[i:i + 1], has[i:i + 1], spans[i:i + 1],
                                           batch["span_correct"][i:i + 1])[0]) for i in range(b)]
  assert all(per_question[i] == 0 for i in np.flatnonzero(none))
  assert all(per_question[i] > 0 for i in np.flatnonzero(~none))


def test_a_body_cut_inside_a_word_ends_no_span_there(world_data):
  """A body cut before a `##` piece: its last kept piece is half a word, where no span may
  end (it may where the cut falls between words)."""
  from realm_jax.data.answers import vocab_pieces
  from realm_jax.train.openqa_inputs import reader_inputs
  tok, blocks = world_data.tokenizer, world_data.blocks
  continuation = vocab_pieces(tok).continuation
  block, p = next((r, p) for r in range(blocks.num_blocks)
                  for p, t in enumerate(np.asarray(blocks.tokens[r])[
                      blocks.body_start[r]:blocks.lengths[r] - 1]) if p >= 4 and continuation[t])
  q_ids = np.zeros((1, 8), np.int32)
  q_ids[0, :6] = [tok.cls_id, 10, 11, 12, 13, tok.sep_id]
  for kept, word_end in ((p, False), (p + 1, None)):   # cut before the `##` piece, after it
    reader_len = 4 + kept + 3                          # the 4 question pieces, `kept` body
    _, out = reader_inputs(blocks, np.asarray([[block]]), q_ids, np.asarray([6], np.int32),
                           reader_len, tok.cls_id, tok.sep_id, continuation)
    assert out["body_kept"][0, 0] == kept and out["body_position"][0, 0] == 6
    last = 6 + kept - 1
    if word_end is None:     # the next piece decides
      nxt = np.asarray(blocks.tokens[block])[blocks.body_start[block] + kept]
      word_end = not continuation[nxt]
    assert out["span_end_mask"][0, 0, last] == word_end
    assert out["span_end_mask"][0, 0, last + 1:].sum() == 0


@pytest.fixture(scope="module")
def openqa_run(world_dir, tmp_path_factory):
  from realm_jax.train.loop import train
  workdir = str(tmp_path_factory.mktemp("openqa"))
  summary = train(openqa_config(world_dir, qa__dev="prepared:eval"), workdir)
  return workdir, summary


@pytest.mark.slow
def test_openqa_fine_tuning_writes_its_frozen_index_and_metrics(openqa_run, world_dir):
  from realm_jax.retrieval import published
  workdir, summary = openqa_run
  with open(os.path.join(world_dir, "qa", "eval.jsonl")) as f:
    dev_questions = sum(1 for line in f if line.strip())
  assert summary["steps"] == 6 and summary["index_version"] == 1
  # the final evaluation on qa.dev (the world's held-out questions) is in the summary
  assert summary["eval_num_questions"] == dev_questions
  assert 0 <= summary["eval_exact_match"] <= 1
  assert published.complete_versions(published.index_root(workdir)) == [1]
  rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics", "train.jsonl"))]
  assert [r["step"] for r in rows] == list(range(1, 7))
  assert all(np.isfinite(r["loss"]) and r["loss"] > 0 for r in rows)
  assert {"retriever_loss", "reader_loss", "answer_in_top_k", "span_accuracy"} <= set(rows[0])


@pytest.mark.slow
def test_openqa_resume_matches_the_uninterrupted_run(openqa_run, world_dir, tmp_path, caplog):
  from realm_jax.train.loop import train
  workdir, _ = openqa_run
  resumed = str(tmp_path / "resumed")
  train(openqa_config(world_dir, train__steps=3, qa__dev="prepared:eval"), resumed)
  # the training questions moved elsewhere resume; one of them changed is refused (the
  # batches index into them), naming qa.train
  lines = open(os.path.join(world_dir, "qa", "train.jsonl")).read().splitlines(keepends=True)
  for name, text in (("changed", lines[0].replace('?"', ' now?"', 1)), ("moved", lines[0])):
    os.makedirs(tmp_path / name)
    (tmp_path / name / "train.jsonl").write_text(text + "".join(lines[1:]))
  recorded = (pathlib.Path(resumed) / "config.json").read_text()
  with pytest.raises(ConfigError, match=rf"^config.qa.train: its {len(lines)} training "
                     rf"questions .* are not the {len(lines)} that the checkpoints in .* "
                     "trained on"):
    train(openqa_config(world_dir, qa__dev="prepared:eval", train__lr=1e-3,
                        qa__train=f"nq_open:{tmp_path}/changed/train.jsonl"), resumed)
  assert (pathlib.Path(resumed) / "config.json").read_text() == recorded   # nothing written
  # its frozen index over other blocks (another data.dir): refused naming data.dir, before
  # anything is written; its frozen index gone: refused, not embedded by the fine-tuned tower
  from realm_jax.errors import CheckpointError
  other, gone = (shutil.copytree(resumed, tmp_path / name) for name in ("other", "gone"))
  _publish_other_blocks(str(other), 3, openqa_config(world_dir))
  with pytest.raises(ConfigError, match=r"^config\.data\.dir: .* embedded block store "
                     "another-block-store"):
    train(openqa_config(world_dir, qa__dev="prepared:eval", train__lr=1e-3), str(other))
  assert (other / "config.json").read_text() == recorded
  shutil.rmtree(gone / "index")
  with pytest.raises(CheckpointError, match="holds no published version, but the run resumes"):
    train(openqa_config(world_dir, qa__dev="prepared:eval"), str(gone))
  record = pathlib.Path(resumed) / "questions.json"
  fingerprint = json.loads(record.read_text())["fingerprint"]
  record.unlink()                        # a run from before the record: resumes, writes it
  summary = train(openqa_config(world_dir, qa__dev="prepared:eval",
                                qa__train=f"nq_open:{tmp_path}/moved/train.jsonl"), resumed)
  assert summary["steps"] == 6 and json.loads(record.read_text())["fingerprint"] == fingerprint
  assert "resuming %s under other values than it recorded (config.json now holds these): " \
      "qa.train: 'prepared:train' -> 'nq_open:%s/moved/train.jsonl'" % (resumed, tmp_path) \
      in caplog.text

  def losses_of(w):
    return [json.loads(line)["loss"] for line in open(os.path.join(w, "metrics", "train.jsonl"))]
  assert losses_of(resumed) == losses_of(workdir)


def test_an_openqa_workdir_resumes_only_under_its_held_out_split(tmp_path):
  """The split decides which questions an Open-QA run trained on: a resume under another
  `qa.heldout_articles` or `qa.heldout_unit` would test on some of them, and is refused naming
  the field. A record from before `qa.heldout_unit` reads as "article"; a REALM run, which
  trains on no question, resumes under any split."""
  from realm_jax.config.defaults import base_config
  from realm_jax.workdir import CHECKPOINTS, CONFIG, other_split, record_config
  config = base_config()
  config.task, config.qa.heldout_articles = "openqa", 0.2
  record_config(config, str(tmp_path))
  os.makedirs(tmp_path / CHECKPOINTS / "40")
  assert other_split(str(tmp_path), config) == []
  for field, value in (("heldout_articles", 0.3), ("heldout_unit", "paragraph")):
    other = config.copy_and_resolve_references()
    other.qa[field] = value
    with pytest.raises(ConfigError, match=rf"qa\.{field}: .* \(checkpoints\) != "
                       rf"{value!r} \(this run\)"):
      record_config(other, str(tmp_path))
    assert other_split(str(tmp_path), other) == [   # what realm-eval warns of
        f"qa.{field}: {config.qa[field]!r} (the run) != {value!r} (this config)"]
  saved = json.loads((tmp_path / CONFIG).read_text())
  del saved["qa"]["heldout_unit"]
  (tmp_path / CONFIG).write_text(json.dumps(saved))
  record_config(config, str(tmp_path))                     # an old record: "article"
  unsplit = config.copy_and_resolve_references()
  unsplit.qa.heldout_articles = 0.0                        # nothing held out: any unit
  record_config(unsplit, str(tmp_path / "unsplit"))
  os.makedirs(tmp_path / "unsplit" / CHECKPOINTS / "40")
  unsplit.qa.heldout_unit = "paragraph"
  record_config(unsplit, str(tmp_path / "unsplit"))
  config.task = "realm"
  record_config(config, str(tmp_path / "realm"))
  os.makedirs(tmp_path / "realm" / CHECKPOINTS / "40")
  config.qa.heldout_unit = "paragraph"
  record_config(config, str(tmp_path / "realm"))


@pytest.mark.slow
def test_realm_eval_scores_and_explains_every_question(openqa_run, world_dir, tmp_path,
                                                       caplog):
  from realm_jax.openqa_eval import evaluate_run
  workdir, _ = openqa_run
  metrics, out = evaluate_run(openqa_config(world_dir), workdir, split="test")
  assert out == os.path.join(workdir, "eval", "6", "test")
  saved = json.load(open(os.path.join(out, "metrics.json")))
  assert saved["step"] == 6 and saved["reader"] is True
  for key in ("exact_match", "f1", "recall_at_1", "recall_at_5", "recall_at_20",
              "recall_at_100"):
    assert 0.0 <= saved[key] <= 1.0, key
  assert saved["recall_at_1"] <= saved["recall_at_5"] <= saved["recall_at_100"]
  predictions = [json.loads(line) for line in open(os.path.join(out, "predictions.jsonl"))]
  assert len(predictions) == saved["num_questions"]
  assert np.mean([p["exact_match"] for p in predictions]) == pytest.approx(saved["exact_match"])
  for p in predictions:    # a prediction equal to a given answer always scores
    assert p["exact_match"] or not exact_match(p["prediction"], p["answers"])
  for p in predictions:    # spans keep to word boundaries
    assert not p["prediction"].startswith("##")
    assert all(not (e["span"] or "").startswith("##") for e in p["evidence"])
  first = predictions[0]
  assert len(first["evidence"]) == 3
  assert {"title", "text", "retrieval_score", "span_score"} <= set(first["evidence"][0])
  assert saved["no_answer_in_top_k"] == sum(not p["answer_in_top_k"] for p in predictions)
  # --retrieval_only on the fine-tuned run: the same frozen index (its block tower trained on
  # since), the same recall; both results kept
  with caplog.at_level(logging.INFO, logger="realm_jax.openqa_eval"):
    retrieved, out_retrieval = evaluate_run(openqa_config(world_dir), workdir, split="test",
                                            retrieval_only=True)
  said = re.search(r"\[eval\] index (\S+) \(blocks embedded at step \d+\)", caplog.text)
  assert said and os.path.isdir(said.group(1)), caplog.text   # the version's folder itself
  caplog.clear()
  assert out_retrieval == os.path.join(workdir, "eval", "6", "test-retrieval")
  for key in ("index_version", "index_step", "recall_at_1", "recall_at_5", "recall_at_20"):
    assert retrieved[key] == saved[key], key
  assert json.load(open(os.path.join(out, "metrics.json"))) == saved
  # its evidence scored as the reader's run scores it (query . block, the same index)
  alone = [json.loads(line) for line in open(os.path.join(out_retrieval, "predictions.jsonl"))]
  for p, q in zip(predictions, alone):
    assert [e["block"] for e in p["evidence"]] == [e["block"] for e in q["evidence"]]
    assert [e["retrieval_score"] for e in q["evidence"]] == pytest.approx(
        [e["retrieval_score"] for e in p["evidence"]], rel=1e-4, abs=1e-4)
  # evaluated under another held-out split: said before anything else (the world's questions
  # carry no article titles, so this split is then refused)
  with caplog.at_level(logging.WARNING, logger="realm_jax.openqa_eval"):
    with pytest.raises(ConfigError, match="qa.heldout_articles: 0.5 splits by article title"):
      evaluate_run(openqa_config(world_dir, qa__heldout_articles=0.5), workdir, split="test")
  assert "fine-tuned under another held-out split: qa.heldout_articles: 0.0 (the run) != 0.5 " \
      "(this config): some of its test questions may be ones it trained on" in caplog.text
  # evaluated with another data dir's blocks: one line naming the option
  copy = shutil.copytree(workdir, tmp_path / "copy")
  _publish_other_blocks(str(copy), 6, openqa_config(world_dir))
  with pytest.raises(ConfigError, match=r"config\.data\.dir: .* frozen index, embedded block "
                     r"store another-block-store; .* use the run's blocks \(the data\.dir"):
    evaluate_run(openqa_config(world_dir), str(copy), split="test")
  # another evaluation of the same step and split replaces it, saying what differed
  assert {"source", "data_dir", "config_sha256"} <= set(saved)
  caplog.clear()
  with caplog.at_level(logging.WARNING, logger="realm_jax.openqa_eval"):
    evaluate_run(openqa_config(world_dir, qa__reader_beam=2), workdir, split="test")
  assert f"{out} held an evaluation of another kind (config_sha256: " in caplog.text
  assert len(json.loads(open(os.path.join(out, "predictions.jsonl")).readline())[
      "evidence"]) == 2
  # its frozen index gone or damaged: one line naming the version, not a traceback
  from realm_jax.errors import CheckpointError
  from realm_jax.retrieval import published
  for damage in ("manifest.json", "embeddings.npy"):
    broken = shutil.copytree(workdir, tmp_path / f"broken-{damage}")
    root = published.index_root(str(broken))
    version = published.read_latest(root)
    target = published.version_dir(root, version) / damage
    if damage == "manifest.json":
      target.unlink()
    else:
      target.write_bytes(target.read_bytes()[:-8] + b"\0" * 8)
    with pytest.raises(CheckpointError, match=rf"{version:08d}, the Open-QA run's frozen index, "
                       r"is unusable: .*fine-tune again"):
      evaluate_run(openqa_config(world_dir), str(broken), split="test")
  # its checkpoint damaged (an item gone, files cut short): one line naming it
  for damage in ("gone", "cut"):
    hurt = shutil.copytree(workdir, tmp_path / f"params-{damage}")
    params = hurt / "checkpoints" / "6" / "params"
    if damage == "gone":
      shutil.rmtree(params)
    for file in [] if damage == "gone" else (params / "d").iterdir():
      file.write_bytes(file.read_bytes()[:10])
    with pytest.raises(CheckpointError, match=r"checkpoints/6 cannot be restored \(\w+: .*; "
                       r"restore it from a copy of the run, or read another of its steps "
                       r"\(\[3\]\)$"):
      evaluate_run(openqa_config(world_dir), str(hurt), split="test")
  # its frozen index gone altogether: refused as a resume is, not embedded anew
  gone = shutil.copytree(workdir, tmp_path / "gone")
  shutil.rmtree(published.index_root(str(gone)))
  with pytest.raises(CheckpointError, match=r"/index holds no published version, but .*"
                     r"checkpoints/6 was fine-tuned with it"):
    evaluate_run(openqa_config(world_dir), str(gone), split="test")


def test_realm_eval_checks_where_it_writes_before_it_evaluates(world_dir, tmp_path,
                                                                monkeypatch):
  """W/eval unusable (a file there): one OSError naming it before any checkpoint is read."""
  from unittest import mock
  import realm_jax.openqa_eval as openqa_eval
  from realm_jax.errors import CheckpointError
  (tmp_path / "eval").write_text("")
  monkeypatch.setattr(openqa_eval, "load_run", lambda *a: pytest.fail("evaluated first"))
  with pytest.raises(OSError) as refused:
    openqa_eval.evaluate_run(openqa_config(world_dir), str(tmp_path), split="test")
  assert refused.value.filename == str(tmp_path / "eval")
  # a writable W: the check makes nothing, so a W that then turns out to hold no checkpoint
  # is left as it was (it was left with an empty W/eval)
  (tmp_path / "eval").unlink()
  monkeypatch.setattr(openqa_eval, "load_run", mock.Mock(side_effect=CheckpointError("none")))
  with pytest.raises(CheckpointError):
    openqa_eval.evaluate_run(openqa_config(world_dir), str(tmp_path), split="test")
  assert not (tmp_path / "eval").exists()


def test_an_evaluation_killed_between_its_two_files_leaves_no_mixed_pair(tmp_path,
                                                                         monkeypatch):
  """Another evaluation of a step and split replaces the folder's files, predictions first;
  one killed before its metrics.json leaves no metrics.json of the evaluation before beside
  its own predictions (a reader took the pair as one evaluation's)."""
  from realm_jax import paths
  from realm_jax.openqa_eval import write_results
  out = str(tmp_path / "eval" / "6" / "test")
  write_results(out, {"source": "prepared:eval", "exact_match": 0.5}, [{"q": "old"}])
  write_json = paths.write_json

  def killed(*args, **kwargs):
    raise KeyboardInterrupt
  monkeypatch.setattr(paths, "write_json", killed)
  with pytest.raises(KeyboardInterrupt):
    write_results(out, {"source": "nq_open:other", "exact_match": 0.1}, [{"q": "new"}])
  monkeypatch.setattr(paths, "write_json", write_json)
  assert [json.loads(line) for line in open(os.path.join(out, "predictions.jsonl"))] == \
      [{"q": "new"}]
  assert not os.path.exists(os.path.join(out, "metrics.json"))   # not finished: no metrics
  write_results(out, {"source": "nq_open:other", "exact_match": 0.1}, [{"q": "new"}])
  assert json.load(open(os.path.join(out, "metrics.json")))["exact_match"] == 0.1


def test_the_index_of_a_step_is_found_among_later_versions(tmp_path):
  """realm-eval / realm-predict --step N of a pre-training run: the version its checkpoint N
  embedded, though later versions followed; none for a step that embedded none."""
  from realm_jax.retrieval import published
  from realm_jax.train.openqa_inputs import FrozenIndex
  root = published.index_root(str(tmp_path))
  for step in (2, 4, 6):
    rows = np.full((5, 8), step, np.float32)
    published.publish_arrays(root, rows, {}, step=step, fingerprint="blocks", keep=3)
  found = FrozenIndex.of_step(str(tmp_path), 4, "blocks", 8)
  assert (found.version, found.step, found.embeddings[0, 0]) == (2, 4, 4.0)
  assert FrozenIndex.of_step(str(tmp_path), 6, "blocks", 8).version == 3
  assert FrozenIndex.of_step(str(tmp_path), 3, "blocks", 8) is None
  assert FrozenIndex.of_step(str(tmp_path), 4, "other blocks", 8) is None
  # a fresh Open-QA start reads its source's latest version alone (as it always did)
  assert FrozenIndex.of_step(str(tmp_path), 4, "blocks", 8, latest_only=True) is None
  assert FrozenIndex.of_step(str(tmp_path), 6, "blocks", 8, latest_only=True).version == 3


def test_the_index_of_a_step_pruned_while_it_is_read_is_none(tmp_path, monkeypatch, caplog):
  """realm-eval of a pre-training run still training: the builder prunes the version of the
  evaluated step (manifest first, then its files) after its manifest was read and verified:
  none (the caller embeds the blocks itself, said), not a FileNotFoundError of its arrays."""
  from realm_jax.retrieval import published
  from realm_jax.train.openqa_inputs import FrozenIndex
  root = published.index_root(str(tmp_path))
  for step in (2, 4):
    published.publish_arrays(root, np.full((5, 8), step, np.float32), {}, step=step,
                             fingerprint="blocks", keep=3)
  verify = published.verify

  def verified_then_pruned(root, version, **kwargs):   # the builder's prune, at that moment
    manifest = verify(root, version, **kwargs)
    published._prune(root, keep=1)
    return manifest
  monkeypatch.setattr(published, "verify", verified_then_pruned)
  with caplog.at_level(logging.WARNING):
    assert FrozenIndex.of_step(str(tmp_path), 2, "blocks", 8) is None
  assert "00000001 not used" in caplog.text and "pruned" in caplog.text
  # pruned between the listing and the read of its manifest: none either
  monkeypatch.setattr(published, "verify", verify)
  published.publish_arrays(root, np.full((5, 8), 6, np.float32), {}, step=6,
                           fingerprint="blocks", keep=3)
  manifest = published.version_dir(root, 2) / published.MANIFEST
  read_text = type(manifest).read_text

  def pruned_first(self, *args, **kwargs):
    if self == manifest:
      published._prune(root, keep=1)
    return read_text(self, *args, **kwargs)
  monkeypatch.setattr(type(manifest), "read_text", pruned_first)
  assert FrozenIndex.of_step(str(tmp_path), 4, "blocks", 8) is None


def test_realm_eval_on_a_pretraining_checkpoint(world_dir, world_data, tmp_path, monkeypatch,
                                                caplog):
  """Open-QA eval of a checkpoint without the span reader: a clear error; --retrieval_only:
  the zero-shot retrieval evaluation."""
  from realm_jax.openqa_eval import evaluate_run
  workdir = str(tmp_path / "pretrained")
  pretraining, state = _pretraining_checkpoint(world_dir, world_data, workdir)
  config = openqa_config(world_dir)
  with pytest.raises(ConfigError, match="no span reader .*realm-eval --retrieval_only"):
    evaluate_run(config, workdir, split="test")
  # realm-predict told as an Open-QA run: the flag it was advised is realm-eval's alone
  from realm_jax import workdir as workdir_lib
  from realm_jax.config.overrides import split_run_overrides
  from realm_jax.predict import predict
  workdir_lib.write_config(workdir, pretraining)
  with pytest.raises(ConfigError, match="realm-predict without task=openqa shows the blocks"):
    predict(workdir, ["who?"], overrides=split_run_overrides(
        ["p", "--config.task=openqa", f"--config.data.dir={world_dir}"], False)[1])
  assert not pretraining.qa.test     # its own config names no questions: say how to
  with pytest.raises(ConfigError, match=r"config\.qa\.test: is empty: .* with "
                     r"--config\.qa\.test=SPEC"):
    evaluate_run(pretraining, workdir, split="test", retrieval_only=True)
  metrics, _ = evaluate_run(config, workdir, split="test", retrieval_only=True)
  assert "exact_match" not in metrics and 0 <= metrics["recall_at_5"] <= 1
  # an index of this step over other blocks (another data dir) is passed over, not fatal
  _publish_other_blocks(workdir, 0, pretraining, state)
  again, _ = evaluate_run(config, workdir, split="test", retrieval_only=True)
  assert again["recall_at_5"] == metrics["recall_at_5"]
  # one of this very step and these blocks whose arrays are damaged: embedded again, warned
  from realm_jax.retrieval import published
  root = published.index_root(workdir)
  rows = np.zeros((world_data.blocks.num_blocks, pretraining.model.retrieval_dim), np.float32)
  published.publish_arrays(root, rows, {}, step=0, fingerprint=world_data.blocks.fingerprint,
                           keep=3)
  target = published.version_dir(root, published.read_latest(root)) / "embeddings.npy"
  target.write_bytes(target.read_bytes()[:-8] + b"\1" * 8)
  with caplog.at_level(logging.WARNING):
    again, _ = evaluate_run(config, workdir, split="test", retrieval_only=True)
  assert again["recall_at_5"] == metrics["recall_at_5"] and "not used: " in caplog.text
  # another config's shapes, or a data dir prepared with other blocks: one error naming them
  other = openqa_config(world_dir, model__retrieval_dim=pretraining.model.retrieval_dim + 8)
  with pytest.raises(ConfigError, match=r"parameters do not fit this config and data dir "
                     r"\(retriever/.*in the checkpoint"):
    evaluate_run(other, workdir, split="test", retrieval_only=True)
  other = openqa_config(world_dir, data__block_len=world_data.blocks.block_len + 8)
  with pytest.raises(ConfigError, match=r"config\.data\.block_len: .* prepared with blocks"):
    evaluate_run(other, workdir, split="test", retrieval_only=True)
  # a data dir whose vocab lists other tokens, as many: the ids would mean other words
  with open(os.path.join(workdir, "config.json"), "w") as f:
    f.write(pretraining.to_json_best_effort())
  swapped = helpers.swapped_vocab_copy(world_dir, tmp_path / "swapped_vocab")
  with pytest.raises(ConfigError, match=r"config\.data\.dir: the data's .*swapped_vocab/"
                     r"vocab\.txt .* differs from"):
    evaluate_run(openqa_config(str(swapped)), workdir, split="test", retrieval_only=True)
  # options that keep the shapes and change what the parameters compute: refused, named
  act = pretraining.model.hidden_act
  other_act = {"gelu": "gelu_new", "gelu_new": "gelu"}[act]
  other = openqa_config(world_dir, model__hidden_act=other_act, model__retriever__pooling="mean")
  with pytest.raises(ConfigError, match=rf"config\.model: .* other model options than this "
                     rf"config's: model\.hidden_act: '{act}' \(the run\) != '{other_act}' "
                     r"\(this config\); model\.retriever\.hidden_act: .*model\.retriever\."
                     r"pooling: 'cls' \(the run\) != 'mean'"):
    evaluate_run(other, workdir, split="test", retrieval_only=True)
  # the same set on the run's own config (realm-eval without --config, realm-predict): the
  # remedy is the run's values, not leaving out a --config that was never given
  from realm_jax.openqa_eval import evaluation_config
  own = evaluation_config(workdir, [
      ("--config.qa.test", "qa.test", "prepared:eval", False),
      ("--config.model.hidden_act", "model.hidden_act", other_act, False)])
  with pytest.raises(ConfigError, match=rf"model\.hidden_act: '{act}' \(the run\) != "
                     rf"'{other_act}' .*give them the run's values \(its W/config\.json, "
                     r"which realm-eval without --config and realm-predict read\)$"):
    evaluate_run(own, workdir, split="test", retrieval_only=True)
  # recorded relative (to where the run ran, unknown here): not read against this cwd's
  relative = json.loads(pretraining.to_json_best_effort())
  relative["data"]["dir"] = "data"
  with open(os.path.join(workdir, "config.json"), "w") as f:
    json.dump(relative, f)
  shutil.copytree(swapped, tmp_path / "data")
  monkeypatch.chdir(tmp_path)
  assert evaluate_run(config, workdir, split="test", retrieval_only=True)[0][
      "recall_at_5"] == metrics["recall_at_5"]


def test_realm_eval_of_a_run_still_writing_reads_the_newest_when_its_latest_goes(
    world_dir, world_data, tmp_path, monkeypatch, caplog):
  """The run writing W deletes its checkpoints past train.keep_checkpoints: the latest one,
  listed when realm-eval started, is gone by the time it is read. Without --step the newest
  is read instead, said; a step deleted under its read is named as such, not as a damaged
  checkpoint to restore from a copy."""
  from realm_jax.openqa_eval import evaluate_run
  from realm_jax.runtime import checkpoints
  workdir = str(tmp_path / "live")
  _pretraining_checkpoint(world_dir, world_data, workdir)
  ckpt = pathlib.Path(workdir) / "checkpoints"
  shutil.copytree(ckpt / "0", ckpt / "1")
  restore_params = checkpoints.restore_params

  def trainer_moves_on(workdir, abstract, step=None, **kwargs):
    if step == 1:   # the run saved step 2 and deleted 1 (keep 2) since it was listed
      shutil.copytree(ckpt / "0", ckpt / "2")
      shutil.rmtree(ckpt / "1")
    return restore_params(workdir, abstract, step, **kwargs)
  monkeypatch.setattr(checkpoints, "restore_params", trainer_moves_on)
  with caplog.at_level(logging.INFO, logger="realm_jax.openqa_eval"):
    metrics, _ = evaluate_run(openqa_config(world_dir), workdir, split="test",
                              retrieval_only=True)
  assert metrics["step"] == 2, metrics
  assert f"checkpoint {workdir}/checkpoints/1 was deleted while it was read" in caplog.text
  # deleted in the middle of the read itself: named as such
  manager = checkpoints.read_only_manager(workdir)
  shutil.rmtree(ckpt / "2")
  try:
    gone = checkpoints._unreadable(manager, workdir, 2, ValueError("NOT_FOUND: Error reading"))
  finally:
    manager.close()
  assert str(gone) == (f"checkpoint {checkpoints.checkpoint_dir(workdir)}/2 was deleted while "
                       f"it was read (a run still writing {workdir} keeps only its newest "
                       "checkpoints); read one it has now ([0])"), str(gone)


def test_realm_eval_lists_again_a_step_deleted_while_it_is_listed(world_dir, world_data,
                                                                  tmp_path, monkeypatch):
  """Orbax reads each step's metadata as it lists W/checkpoints: a step the run still writing
  W deletes meanwhile fails the listing (FileNotFoundError or NotADirectoryError naming that
  step's folder), which is listed again, not realm-eval's error."""
  from realm_jax.openqa_eval import evaluate_run
  from realm_jax.runtime import checkpoints
  workdir = str(tmp_path / "live")
  _pretraining_checkpoint(world_dir, world_data, workdir)
  manager, calls = checkpoints.read_only_manager, []

  def listed_while_deleting(*args, **kwargs):
    calls.append(1)
    if len(calls) == 1:
      raise FileNotFoundError(f"[Errno 2] No such file or directory: '{workdir}/checkpoints/7'")
    if len(calls) == 2:   # the folder gone between Orbax's listing and its look at it
      raise NotADirectoryError(f"Path is not a directory: {workdir}/checkpoints/8")
    return manager(*args, **kwargs)
  monkeypatch.setattr(checkpoints, "read_only_manager", listed_while_deleting)
  metrics, _ = evaluate_run(openqa_config(world_dir), workdir, split="test",
                            retrieval_only=True)
  assert metrics["step"] == 0 and len(calls) > 3, (metrics, calls)


def _pretraining_checkpoint(world_dir, world_data, workdir):
  """A REALM pre-training run's step-0 checkpoint of drawn parameters: (config, state)."""
  from realm_jax.runtime import partitioning, state as state_lib
  from realm_jax.runtime.checkpoints import Checkpointer
  pretraining = helpers.tiny_config("realm", data_dir=world_dir)
  mesh = partitioning.make_mesh(pretraining.mesh.shape)
  model = state_lib.build_model(pretraining, world_data.tokenizer.vocab_size)
  state, _, _ = helpers.drawn_state(pretraining, model, mesh, world_data.blocks.block_len)
  checkpointer = Checkpointer(workdir, keep=1, async_saves=False)
  checkpointer.save(0, state, {"next_step": 0}, {"step": np.asarray(-1, np.int32)})
  checkpointer.close()
  return pretraining, state


def _publish_other_blocks(workdir, step, config, state=None):
  """An index of `workdir` at `step` that embedded another block store (random rows)."""
  from realm_jax.retrieval import published
  from realm_jax.runtime import embedders, partitioning
  rows = np.random.default_rng(0).normal(size=(50, config.model.retrieval_dim))
  query = {} if state is None else partitioning.host_copy(
      embedders.query_tower_params(state.params["retriever"]))
  published.publish_arrays(published.index_root(workdir), rows.astype(np.float32), query,
                           step=step, fingerprint="another-block-store", keep=2)


@pytest.mark.slow
def test_openqa_from_a_run_whose_index_covers_other_blocks_embeds_its_own(
    world_dir, world_data, tmp_path, capsys):
  """Fine-tuning on a data dir other than pre-training's: the starting run's index (the same
  step, other blocks) is not the frozen index; the blocks are embedded again."""
  from realm_jax.retrieval import published
  from realm_jax.train.loop import train
  origin = str(tmp_path / "pretrained")
  pretraining, state = _pretraining_checkpoint(world_dir, world_data, origin)
  _publish_other_blocks(origin, 0, pretraining, state)
  workdir = str(tmp_path / "openqa")
  # an earlier start's index, with no checkpoint saved after it, is not this start's
  _publish_other_blocks(workdir, 0, pretraining, state)
  summary = train(openqa_config(world_dir, train__steps=1, init__from_workdir=origin), workdir)
  assert summary["steps"] == 1
  root = published.index_root(workdir)
  assert published.read_latest(root) == 2
  manifest = published.read_manifest(root, 2)
  assert manifest["block_store_fingerprint"] == world_data.blocks.fingerprint
  assert manifest["num_blocks"] == world_data.blocks.num_blocks
  out = capsys.readouterr().out
  assert f"the block embeddings of {origin}/index" not in out
  assert f"a fresh start: {root} v1, of an earlier start that saved no checkpoint, is not " \
      "reused" in out


@pytest.mark.slow
def test_realm_predict_prints_the_answer_and_its_evidence(openqa_run, world_dir, tmp_path):
  from realm_jax.predict import _show, predict
  workdir, _ = openqa_run
  with open(os.path.join(world_dir, "qa", "eval.jsonl")) as f:
    question = json.loads(f.readline())["question"]
  item, = predict(workdir, [question])
  assert item["question"] == question and isinstance(item["answer"], str)
  assert len(item["evidence"]) == 3 and item["evidence"][0]["title"]
  shown = _show(item)
  assert shown.startswith(f"Q: {question}\nA: {item['answer']}") and "[3]" in shown
  # a run recorded with a mesh this machine cannot make (a pod's): restored on (-1, 1)
  pod = shutil.copytree(workdir, tmp_path / "pod")
  record = json.loads((pod / "config.json").read_text())
  record["mesh"]["shape"] = [-1, 16]
  (pod / "config.json").write_text(json.dumps(record))
  again, = predict(str(pod), [question])
  assert (again["answer"], again["evidence"]) == (item["answer"], item["evidence"])
  # a question over data.query_len is cut, and says so
  assert item["truncated"] is False
  long, = predict(workdir, [" ".join([question] * 40)])
  assert long["truncated"] is True and "(cut to data.query_len wordpieces)" in _show(long)
  # the checkpoint and the index version it answered with are named
  assert (item["step"], item["index_version"]) == (6, 1)
  assert f"checkpoint 6, index v1 (blocks embedded at step {item['index_step']})" in shown
  # a question of no wordpieces is refused as an empty one is
  with pytest.raises(ConfigError, match="question 2 is empty: it has no wordpieces"):
    predict(workdir, [question, "\u200b"])
  # a run whose data dir moved (copied off a pod): pointed at it by --config.data.dir
  record["mesh"]["shape"], record["data"]["dir"] = [-1, 1], str(tmp_path / "gone")
  (pod / "config.json").write_text(json.dumps(record))
  with pytest.raises(ConfigError, match="data.dir"):
    predict(str(pod), [question])
  moved, = predict(str(pod), [question],
                   overrides=[("--config.data.dir", "data.dir", world_dir, False)])
  assert (moved["answer"], moved["evidence"]) == (item["answer"], item["evidence"])


@pytest.mark.slow
def test_a_run_recorded_before_later_options_is_evaluated_as_one_recorded_now(openqa_run,
                                                                             tmp_path):
  """W/config.json of a run written before options added since (qa.heldout_unit on
  2026-12-06, retrieval.score_cache_gb and train.profile_* on 2026-12-07) reads them as its
  checkpoints were written under (ADDED_FIELDS) or at their defaults: realm-eval without
  --config and realm-predict answer as for the run recorded now, where they stopped with an
  AttributeError on qa.heldout_unit."""
  from realm_jax.openqa_eval import evaluate_run
  from realm_jax.predict import predict
  from realm_jax.openqa_eval import evaluation_config
  workdir, _ = openqa_run
  new = shutil.copytree(workdir, tmp_path / "new")
  old = shutil.copytree(workdir, tmp_path / "old")
  record = json.loads((old / "config.json").read_text())
  del record["qa"]["heldout_unit"], record["retrieval"]["score_cache_gb"]
  del record["train"]["profile_first_step"], record["train"]["profile_steps"]
  del record["qa"]["reader_len"]            # (2026-12-07) the reader's length as then
  (old / "config.json").write_text(json.dumps(record))
  (item,), (again,) = predict(str(new), ["who founded it"]), predict(str(old), ["who founded it"])
  assert again == item
  config = evaluation_config(str(old))
  assert config.to_dict() == evaluation_config(str(new)).to_dict()
  assert config.qa.heldout_unit == "article"
  from realm_jax.train.openqa_inputs import reader_length
  assert config.qa.reader_len == 0 and reader_length(config, 40) == 16 + 40 - 2

  def scores(w):
    metrics = evaluate_run(evaluation_config(str(w)), str(w), split="test")[0]
    return {k: v for k, v in metrics.items() if k != "seconds"}
  assert scores(old) == scores(new)


@pytest.mark.slow
def test_a_short_reader_trains_and_evaluates(world_dir, tmp_path, monkeypatch):
  """An Open-QA run with qa.reader_len 24 (pairs of up to 53 cut longest first) trains and
  evaluates on reader inputs of 24, and realm-eval of it reads them at the run's length."""
  from realm_jax.openqa_eval import evaluate_run
  from realm_jax.openqa_eval import evaluation_config
  from realm_jax.train import openqa_inputs
  from realm_jax.train.loop import train
  real, lengths = openqa_inputs.reader_inputs, []

  def recorded(*args, **kwargs):
    cands, out = real(*args, **kwargs)
    lengths.append(out["reader_ids"].shape[-1])
    return cands, out
  monkeypatch.setattr(openqa_inputs, "reader_inputs", recorded)
  workdir = str(tmp_path / "short")
  summary = train(openqa_config(world_dir, qa__reader_len=24, qa__dev="prepared:eval",
                                train__steps=2, train__checkpoint_every=2), workdir)
  assert summary["steps"] == 2 and 0 <= summary["eval_exact_match"] <= 1
  rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics", "train.jsonl"))]
  assert all(np.isfinite(r["loss"]) and r["loss"] > 0 for r in rows)
  assert len(lengths) > 2 and set(lengths) == {24}
  lengths.clear()
  metrics, _ = evaluate_run(evaluation_config(workdir), workdir, split="test")
  assert metrics["step"] == 2 and set(lengths) == {24}


def test_a_block_without_a_span_gives_none(openqa_run, monkeypatch):
  """Blocks whose every span is masked (an empty body): no span and no span score (null),
  and, where no block read has one, no answer; never the [CLS] of a masked span."""
  from realm_jax.predict import _show, predict
  from realm_jax.train import qa_eval
  real = qa_eval.steps.make_openqa_eval

  def masked(*args):
    run = real(*args)
    return lambda params, batch: {**run(params, batch), "block_span_scores": run(
        params, batch)["block_span_scores"] * 0 - 1e9}
  monkeypatch.setattr(qa_eval.steps, "make_openqa_eval", masked)
  item, = predict(openqa_run[0], ["who founded it"])
  assert (item["answer"], item["score"]) == ("", None)
  assert all(e["span"] is None and e["span_score"] is None for e in item["evidence"])
  shown = _show(item)
  assert "A: (none: no block read has a span)" in shown and "(no span)" in shown
  assert "[CLS]" not in shown


def test_realm_predict_writes_its_results_alone_to_stdout(openqa_run, tmp_path):
  """--json: JSON lines on stdout, the log on stderr; a reader that stops reading (`| head`)
  ends it without a traceback."""
  import subprocess
  import sys
  workdir, _ = openqa_run
  command = [sys.executable, "-m", "realm_jax.predict", "--workdir", workdir, "--json",
             "who founded it", "where was it"]
  result = subprocess.run(command, cwd=helpers.REPO, capture_output=True, text=True,
                          timeout=300)
  assert result.returncode == 0, result.stderr[-2000:]
  lines = result.stdout.splitlines()
  assert [json.loads(line)["question"] for line in lines] == command[-2:]
  assert "[eval] index" in result.stderr
  closed = subprocess.run(["bash", "-c", " ".join(f"'{a}'" for a in command) + " | true"],
                          cwd=helpers.REPO, capture_output=True, text=True, timeout=300)
  assert "Traceback" not in closed.stderr and "BrokenPipe" not in closed.stderr, closed.stderr


def test_the_trainer_reads_prepared_questions_where_it_reads_the_blocks(world_dir, tmp_path,
                                                                        monkeypatch):
  """A data.dir read from elsewhere than as given (a gcsfuse path not mounted here: its
  bucket's, `workdir.check_data_dir`) gave the trainer its blocks from there but its
  `prepared:` questions from the path as given: 'no such file .../qa/train.jsonl'."""
  from realm_jax import workdir as workdir_lib
  from realm_jax.train.openqa_loop import OpenQATrainer
  config = openqa_config(world_dir, data__dir=str(tmp_path / "mounted"))
  monkeypatch.setattr(workdir_lib, "check_data_dir", lambda config: world_dir)
  trainer = OpenQATrainer(config, str(tmp_path / "run"))
  assert trainer.train_qa and trainer.data.dir == world_dir
