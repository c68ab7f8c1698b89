"""Zero-shot question retrieval on a prepared SQuAD-format corpus.

For every question of `DATA/qa/eval.jsonl` (written by `realm-prepare` from a `squad:` source,
with the id of the paragraph that holds the answer), rank the blocks, collapse them to their
paragraphs (a paragraph ranks where its best block ranks) and report recall@k: the share of
questions whose answer paragraph is among the top k. The same ranking rule serves a trained
retriever (query tower on the question, exact search over block-tower embeddings) and BM25
(`bm25s`, on the text of the same blocks), so the figures are side by side.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np

from realm_jax import log, paths
from realm_jax.data.qa import checked_unit, is_heldout_article, question_inputs
from realm_jax.data.prepared import PreparedData
from realm_jax.errors import ConfigError, DataError
from realm_jax.retrieval.index import ExactIndex, IndexVersion, embed_blocks
from realm_jax.runtime import embedders
from realm_jax.runtime.checkpoints import abstract_run, restore_run

RECALL_AT = (1, 5, 20)
CANDIDATE_BLOCKS = 100      # blocks ranked per question before collapsing to paragraphs


def load_questions(data_dir: str) -> list[dict]:
  """The questions of `data_dir/qa/eval.jsonl` that point at a kept paragraph (`doc_id`)."""
  path = os.path.join(paths.local_dir(data_dir), "qa", "eval.jsonl")
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path}: no questions (prepare a squad: source to get them)")
  with open(path) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  return [r for r in rows if r.get("doc_id", -1) >= 0 and r.get("question")]


def paragraph_recall(ranked_blocks: np.ndarray, block_docs: np.ndarray, gold_docs: np.ndarray,
                     ks=RECALL_AT) -> dict[str, float]:
  """recall@k over paragraphs from block rankings [Q, N] (best first; -1: no block there)."""
  hits = {k: 0 for k in ks}
  for ranking, gold in zip(ranked_blocks, gold_docs):
    docs = list(dict.fromkeys(block_docs[ranking[ranking >= 0]].tolist()))
    rank = docs.index(int(gold)) if int(gold) in docs else len(block_docs)
    for k in ks:
      hits[k] += rank < k
  n = max(len(gold_docs), 1)
  return {f"recall_at_{k}": hits[k] / n for k in ks}


def dense_ranking(config, workdir: str, data: PreparedData, questions: list[dict],
                  n: int = CANDIDATE_BLOCKS, batch_size: int = 256) -> np.ndarray:
  """Top-n block rows per question with the retriever of `workdir`'s latest checkpoint (or,
  with workdir "", the retriever as `config.init` starts it: the untrained reference)."""
  if workdir:
    from realm_jax.runtime.initialization import check_run_vocab
    check_run_vocab(workdir, "data.dir", data.tokenizer.vocab_path)   # ids of the run's meaning
    run = restore_run(workdir, config=config, vocab_size=data.tokenizer.vocab_size,
                      block_len=data.blocks.block_len)
    mesh, model, params, step = run.mesh, run.model, run.params, run.step
  else:
    from realm_jax.runtime import initialization
    model, mesh, _ = abstract_run(config, data.tokenizer.vocab_size, data.blocks.block_len)
    params, step = initialization.initial_params(config, model, mesh, data), 0
  embeddings, _ = embed_blocks(embedders.block_embedder(model, mesh, config, params["retriever"]),
                               data.blocks, mesh, config.retrieval.embed_batch_size,
                               log_prefix=f"[recall] {os.path.basename(workdir) or 'start'} @ "
                               f"{step}: ")
  index = IndexVersion(version=0, step=step, index=ExactIndex.from_embeddings(embeddings),
                       encode_queries=embedders.QueryEncoder(
                           model, config, embedders.query_tower_params(params["retriever"])))
  ids, _ = question_inputs(data.tokenizer, [q["question"] for q in questions],
                           config.data.query_len)
  n = min(n, data.blocks.num_blocks)
  out = [index.retrieve(ids[start:start + batch_size], n)
         for start in range(0, len(ids), batch_size)]
  return np.concatenate(out)


def bm25_ranking(data: PreparedData, questions: list[dict],
                 n: int = CANDIDATE_BLOCKS) -> np.ndarray:
  """Top-n block rows per question by BM25 over each block's title + body text; -1 past a
  question's last block with a positive score (a question with no term in the corpus ranks
  nothing, not blocks 0..n-1). The questions are read as the blocks are, through the
  wordpiece tokenizer and back (lower-cased, accents stripped): "Kelmár" finds "Kelmar"; a
  character the vocab lacks is no term of it."""
  import bm25s
  log.follow_verbosity("bm25s")   # it sets its logger to DEBUG when imported
  blocks, tok = data.blocks, data.tokenizer
  texts = [tok.decode(blocks.tokens[row][1:blocks.lengths[row] - 1])
           for row in range(blocks.num_blocks)]
  retriever = bm25s.BM25()
  retriever.index(bm25s.tokenize(texts, stopwords="en", show_progress=False),
                  show_progress=False)
  encoded = tok.encode_batch([q["question"] for q in questions])
  # (an [UNK] is no term: written back, "[UNK]" would match every block holding one)
  query_tokens = bm25s.tokenize([tok.decode([i for i in ids if i != tok.unk_id])
                                 for ids, _ in encoded], stopwords="en", show_progress=False)
  rows, scores = retriever.retrieve(query_tokens, k=min(n, blocks.num_blocks),
                                   show_progress=False)
  return np.where(np.asarray(scores) > 0, np.asarray(rows), -1)


def heldout_questions(data: PreparedData, questions: list[dict], fraction: float,
                      unit: str = "article") -> list[dict]:
  """The questions of the held-out articles (`qa.heldout_articles`: by title hash, or by
  paragraph with `unit` "paragraph", as Open-QA fine-tuning splits them); all of them if
  `fraction` is 0."""
  checked_unit(unit)
  if fraction <= 0:
    return questions
  keys = _unit_keys(data, questions, unit)
  return [q for q, key in zip(questions, keys) if is_heldout_article(key, fraction)]


def _unit_keys(data: PreparedData, questions: list[dict], unit: str) -> list[str]:
  """What each question is held out by: its article's title, or its paragraph's key."""
  if unit == "article":
    titles = data.blocks.titles
    return [titles[int(q["doc_id"])] for q in questions]
  if not all(isinstance(q.get("paragraph"), str) for q in questions):
    raise DataError(f"{paths.join(data.dir, 'qa', 'eval.jsonl')}: its questions carry no "
                    "paragraph key for qa.heldout_unit='paragraph' (prepared before "
                    f"2026-12-06): remove {data.dir} and prepare it again (a finished data dir "
                    "is reused as it is)")
  return [q["paragraph"] for q in questions]


def table_questions(data: PreparedData, data_dir: str, heldout_articles: float,
                    unit: str = "article") -> list[dict]:
  """The questions `recall_table` scores; an error naming the file or the option when there
  are none (checked before any retriever embeds the corpus)."""
  questions = load_questions(data_dir)
  if not questions:
    raise DataError(f"{paths.join(data_dir, 'qa', 'eval.jsonl')}: no answerable question "
                    "points at a kept paragraph (stats.json's questions_skipped says why)")
  heldout = heldout_questions(data, questions, heldout_articles, unit)
  if not heldout:
    units = set(_unit_keys(data, questions, unit))
    raise ConfigError("qa.heldout_articles", f"{heldout_articles} holds out none of the "
                      f"{len(units)} {unit}s with questions in {data_dir} (by "
                      f"{'title' if unit == 'article' else 'text'} hash): no question to score; "
                      "a file of more articles, or a larger share")
  return heldout


def recall_table(data_dir: str, retrievers: dict[str, tuple[object, str]],
                 ks=RECALL_AT, heldout_articles: float = 0.0,
                 heldout_unit: str = "article") -> dict[str, dict[str, float]]:
  """{name: recall@k} for each (config, workdir) retriever and for BM25, on the questions of
  the held-out articles (or paragraphs: `heldout_unit`) when `heldout_articles` > 0 (else on
  every question)."""
  data = PreparedData(data_dir)
  questions = table_questions(data, data_dir, heldout_articles, heldout_unit)
  gold = np.asarray([q["doc_id"] for q in questions])
  block_docs = np.asarray(data.blocks.doc_ids)
  table = {}
  for name, (config, workdir) in retrievers.items():
    t0 = time.time()
    ranked = dense_ranking(config, workdir, data, questions)
    table[name] = {**paragraph_recall(ranked, block_docs, gold, ks),
                   "seconds": round(time.time() - t0, 1)}
  t0 = time.time()
  table["bm25"] = {**paragraph_recall(bm25_ranking(data, questions), block_docs, gold, ks),
                   "seconds": round(time.time() - t0, 1)}
  for row in table.values():
    row["questions"] = len(questions)
  return table


def format_table(table: dict[str, dict[str, float]], ks=RECALL_AT) -> str:
  header = f"{'retriever':<12}" + "".join(f"{'R@' + str(k):>8}" for k in ks)
  lines = [header, "-" * len(header)]
  for name, row in table.items():
    lines.append(f"{name:<12}" + "".join(f"{row[f'recall_at_{k}']:>8.3f}" for k in ks))
  return "\n".join(lines)
