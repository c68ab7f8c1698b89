"""Open-QA (ORQA / REALM's fine-tuning) host side: the frozen block index, the question stream
and the batches the Open-QA step and evaluation read.

Per step (and per evaluation batch), on the main thread because the query tower changes every
step: the current query tower embeds the questions, exact search over the frozen block
embeddings returns the top N blocks (`qa.searcher_beam`, capped at the corpus), the host marks
which of them contain an answer string, and builds the reader inputs
`[CLS] question [SEP] body [SEP]` of the top K (`qa.reader_beam`) with every span that matches
an answer. The step then re-scores the N blocks with the same query tower (so gradients reach
it) against their frozen embeddings, carried in the batch.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from realm_jax import paths
from realm_jax.data import pipeline
from realm_jax.data.answers import AnswerMatcher, vocab_pieces
from realm_jax.data.qa import QAExample, question_inputs
from realm_jax.data.prepared import PreparedData
from realm_jax.errors import CheckpointError, ConfigError
from realm_jax.models.realm import span_candidates
from realm_jax.retrieval import published
from realm_jax.retrieval.index import ExactIndex, embed_blocks
from realm_jax.train import batches
from realm_jax.runtime import embedders

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class FrozenIndex:
  """Block embeddings frozen for a whole Open-QA run: the host table (the top-N candidates'
  embeddings travel in each batch) and an exact index over it on this process's devices."""

  version: int
  step: int                 # train step of the block tower that embedded the blocks
  embeddings: np.ndarray    # [num_blocks, dim]
  index: ExactIndex

  @classmethod
  def load(cls, workdir: str, fingerprint: str, dim: int,
           version: int | None = None) -> FrozenIndex | None:
    """The published version (latest if None) of `workdir`, verified; None if there is none.
    A version that fails its checks (gone, damaged, other blocks) is a CheckpointError: an
    Open-QA run's reader learnt with this index, so nothing else stands in for it."""
    root = published.index_root(workdir)
    version = published.read_latest(root) if version is None else version
    if version is None:
      return None
    try:
      return cls._read(root, version, fingerprint, dim)
    except published.RejectedVersion as e:
      raise CheckpointError(f"{published.version_dir(root, version)}, the Open-QA run's "
                            f"frozen index, is unusable: {e}. Its reader learnt with that "
                            "index: restore the version from a copy of the workdir, or "
                            "fine-tune again in a new one") from None

  @classmethod
  def load_required(cls, workdir: str, fingerprint: str, dim: int, why: str,
                    version: int | None = None) -> FrozenIndex:
    """`load`, where the run's checkpoints were trained with W/index (a resumed Open-QA run,
    `realm-eval` / `realm-predict` of its checkpoint): none published is a CheckpointError
    naming the index dir (`why`: what makes it required), since nothing stands in for it."""
    frozen = cls.load(workdir, fingerprint, dim, version)
    if frozen is None:
      raise CheckpointError(
          f"{published.index_root(workdir)} holds no published version, but {why}: its reader "
          "learnt with the frozen index published there at its start (blocks embedded now "
          "would come from the fine-tuned tower). Restore the index from a copy of the "
          "workdir, or fine-tune again in a new one")
    return frozen

  @staticmethod
  def check_blocks(workdir: str, fingerprint: str, data_dir: str) -> int | None:
    """W's latest version (None: none); a ConfigError naming `data.dir` when it embedded
    another block store than `data_dir`'s (`fingerprint`): checked before a resume or an
    evaluation writes anything. One without a readable manifest: `load` says so."""
    root = published.index_root(workdir)
    latest = published.read_latest(root)
    try:
      theirs = None if latest is None else (
          published.read_manifest(root, latest)["block_store_fingerprint"])
    except published.RejectedVersion:
      theirs = None
    if theirs not in (None, fingerprint):
      raise ConfigError("data.dir", f"{root} v{latest}, the Open-QA run's frozen index, "
                        f"embedded block store {theirs}; {data_dir} holds {fingerprint}: "
                        "use the run's blocks (the data.dir it was trained with)")
    return latest

  @classmethod
  def _read(cls, root, version: int, fingerprint: str, dim: int) -> FrozenIndex:
    """Version `version` of the index at `root`, verified (RejectedVersion otherwise)."""
    manifest = published.verify(root, version, fingerprint=fingerprint, dim=dim)
    embeddings = published.read_embeddings(root, version, manifest)
    return cls(version=version, step=int(manifest["step"]), embeddings=embeddings,
               index=ExactIndex.from_embeddings(embeddings))

  @classmethod
  def of_step(cls, workdir: str, step: int, fingerprint: str, dim: int,
              latest_only: bool = False) -> FrozenIndex | None:
    """The newest of `workdir`'s published versions (up to the latest; the latest alone with
    `latest_only`) that its block tower of `step` embedded over these blocks (`fingerprint`,
    `dim`): `realm-eval --step N` of a pre-training run reads the version its checkpoint N
    built, though later ones followed. None where there is none (other steps, other blocks,
    a damaged manifest: the caller embeds the blocks itself)."""
    root = published.index_root(workdir)
    latest = published.read_latest(root) if paths.isdir(root) else None
    if latest is None:
      return None
    older = [] if latest_only else published.complete_versions(root)
    for version in sorted({latest, *(v for v in older if v < latest)}, reverse=True):
      try:
        manifest = published.read_manifest(root, version)
      except (published.RejectedVersion, FileNotFoundError):   # (pruned since it was listed)
        continue
      if (manifest["step"], manifest["block_store_fingerprint"], manifest["dim"]) != (
          step, fingerprint, dim):
        continue
      try:
        return cls._read(root, version, fingerprint, dim)
      except published.RejectedVersion as e:     # damaged arrays: the caller embeds the blocks
        logger.warning(f"{published.version_dir(root, version)} not used: {e}")
        return None
      except (FileNotFoundError, NotADirectoryError) as e:   # pruned under the read (a
        # builder still publishing): the caller embeds the blocks
        logger.warning(f"{published.version_dir(root, version)} not used: pruned while it "
                       f"was read ({e})")
        return None
    return None

  @classmethod
  def embed(cls, model, mesh, config, data: PreparedData, retriever_params, step: int,
            log_prefix: str) -> FrozenIndex:
    """Embeds every block with the block tower of `retriever_params` (version -1: unpublished)."""
    embed_fn = embedders.block_embedder(model, mesh, config, retriever_params)
    embeddings, _ = embed_blocks(embed_fn, data.blocks, mesh, config.retrieval.embed_batch_size,
                                 log_prefix=log_prefix)
    return cls(version=-1, step=step, embeddings=embeddings,
               index=ExactIndex.from_embeddings(embeddings))

  @property
  def num_blocks(self) -> int:
    return len(self.embeddings)


def reader_length(config, block_len: int) -> int:
  """The Open-QA reader's input length (training, `realm-eval`, `realm-predict`):
  `qa.reader_len`, or where it is 0 (and in configs recorded before it) the whole pair's,
  query_len + block_len - 2 (`pipeline.reader_length`), at which no pair is cut. `block_len`:
  the block store's."""
  return config.qa.get("reader_len", 0) or pipeline.reader_length(config.data.query_len,
                                                                   block_len)


def reader_inputs(blocks, top: np.ndarray, question_ids: np.ndarray, question_len: np.ndarray,
                  reader_len: int, cls_id: int, sep_id: int,
                  continuation: np.ndarray | None = None) -> tuple[dict, dict]:
  """The Open-QA reader's inputs (training, `realm-eval`, and the HF parity check's forward).

  Args:
    blocks: the BlockStore; top: [b, K] block rows each question reads.
    question_ids, question_len: [b, query_len] `[CLS] question [SEP]` rows and their lengths.
    reader_len: the reader's input length. A pair longer than that is cut as HF's tokenizer
      cuts it (`longest_first`, `truncate_pair`), keeping the final [SEP]; with the trainer's
      default length (query_len + block_len - 2) no pair is.
    continuation: [vocab] bool, which wordpieces continue a word: spans then lie on word
      boundaries (a body cut inside a word ends none at its last kept piece); None: a span
      may start and end anywhere in the body (as HF's reader).
  Returns:
    (the candidates' block inputs, {"reader_ids", "reader_segments": [b, K, L]
    `[CLS] question [SEP] body [SEP]` and its segments, "span_start_mask", "span_end_mask":
    [b, K, L] where a span may start / end, "body_position", "body_kept": [b, K] where the
    body starts in the row and how many of its wordpieces it keeps}).
  """
  cands = pipeline.candidate_inputs(blocks, top, cls_id, sep_id)
  reader_ids, reader_segments = pipeline.reader_inputs(question_ids, question_len, cands,
                                                       reader_len)
  body_len = cands["lengths"] - cands["body_start"] - 1
  body_position = np.broadcast_to(question_len[:, None], top.shape).copy()
  body_kept = body_len.copy()
  dropped = np.zeros(top.shape, np.int64)   # a cut body's first dropped wordpiece (0: none)
  for i, j in zip(*np.nonzero(question_len[:, None] + body_len + 1 > reader_len)):
    nq, nb = truncate_pair(int(question_len[i]) - 2, int(body_len[i, j]), reader_len - 3)
    start = int(cands["body_start"][i, j])
    row = [cls_id, *question_ids[i, 1:1 + nq], sep_id,
           *cands["candidate_ids"][i, j, start:start + nb], sep_id]
    reader_ids[i, j] = 0
    reader_ids[i, j, :len(row)] = row
    reader_segments[i, j] = 0
    reader_segments[i, j, nq + 2:len(row)] = 1
    body_position[i, j], body_kept[i, j] = nq + 2, nb
    if 0 < nb < body_len[i, j]:
      dropped[i, j] = cands["candidate_ids"][i, j, start + nb]
  body = (reader_segments > 0) & (reader_ids != sep_id)
  starts = ends = body
  if continuation is not None:
    continues = continuation[reader_ids]
    next_continues = np.concatenate([continues[..., 1:], np.zeros_like(continues[..., :1])], -1)
    i, j = np.nonzero(dropped)   # the piece after a cut body's last one is the dropped one
    next_continues[i, j, body_position[i, j] + body_kept[i, j] - 1] = continuation[dropped[i, j]]
    starts, ends = body & ~continues, body & ~next_continues
  return cands, {"reader_ids": reader_ids, "reader_segments": reader_segments,
                 "span_start_mask": starts, "span_end_mask": ends,
                 "body_position": body_position, "body_kept": body_kept}


def truncate_pair(n_first: int, n_second: int, budget: int) -> tuple[int, int]:
  """Lengths a pair keeps under HF tokenizers' `longest_first` truncation to `budget`
  wordpieces (specials excluded; `tokenizers`' `truncate_encodings`, which HF's
  RealmRetriever's fast tokenizer runs): the shorter keeps up to half, the longer the rest.
  Step by step, the last wordpiece of the longer is dropped until the pair fits, a tie
  dropping from the one that was shorter at the start (the first where they were equal)."""
  if n_first + n_second <= budget:
    return n_first, n_second
  swap = n_first > n_second
  n1, n2 = (n_second, n_first) if swap else (n_first, n_second)
  n2 = n1 if n1 > budget else max(n1, budget - n1)
  if n1 + n2 > budget:
    n1, n2 = budget // 2, budget // 2 + budget % 2
  return (n2, n1) if swap else (n1, n2)


class QuestionBatches(batches.BatchStream):
  """This process's batches of training-question rows (shuffled every epoch, checkpointable)."""

  def __init__(self, config, num_questions: int, shards=(0,), count: int = 1):
    self.count = count
    batches.local_batch_size(config, shards, count)   # a clear error if it does not divide
    self.dataset = pipeline.process_batches(
        pipeline.example_stream(num_questions, config.seed), config.train.batch_size,
        shards, count, lambda rows: {"rows": np.asarray(rows, np.int64)})


class QABatchBuilder:
  """Questions -> retrieval -> answer labels -> the reader inputs of the top K blocks."""

  def __init__(self, config, data: PreparedData, examples: list[QAExample],
               frozen: FrozenIndex):
    tok = data.tokenizer
    self.config, self.data, self.examples, self.frozen = config, data, examples, frozen
    self.cls_id, self.sep_id = tok.cls_id, tok.sep_id
    self.question_ids, self.truncated = question_inputs(tok, examples, config.data.query_len)
    self.question_len = (self.question_ids > 0).sum(axis=1).astype(np.int32)
    self.n = min(config.qa.searcher_beam, frozen.num_blocks)
    self.k = min(config.qa.reader_beam, self.n)
    self.reader_len = reader_length(config, data.blocks.block_len)
    self.max_width = config.model.max_span_width
    starts, _ = span_candidates(self.reader_len, self.max_width)
    self.num_spans = len(starts)
    # index of span (start, width w) = width_offset[w] + start, HF's width-major order
    sizes = [self.reader_len - w + 1 for w in range(1, self.max_width + 1)]
    self.width_offset = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    self._matchers: dict[int, AnswerMatcher] = {}
    self._vocab = vocab_pieces(tok)

  def matcher(self, row: int) -> AnswerMatcher:
    if row not in self._matchers:
      ex = self.examples[row]
      self._matchers[row] = AnswerMatcher(self.data.tokenizer, ex.answers, ex.is_regex,
                                          vocab=self._vocab)
    return self._matchers[row]

  def scored_answers(self, row: int) -> tuple[str, ...]:
    """The answers a predicted span is scored against, as given: `exact_match` also compares
    them glued, which a span read back from wordpieces needs ("40, 449" for "40,449"). (Their
    own decoded wordpieces, compared before, spaced "A.I." as "a. i.", whose "a" normalises
    away as an article: "I" scored as right.)"""
    return self.examples[row].answers

  def body_tokens(self, block_rows: np.ndarray) -> np.ndarray:
    """Block token rows with everything but the body (title, [CLS]/[SEP], padding) zeroed."""
    blocks = self.data.blocks
    tokens = np.asarray(blocks.tokens[block_rows])
    pos = np.arange(tokens.shape[-1])
    body = ((pos >= blocks.body_start[block_rows][..., None])
            & (pos < blocks.lengths[block_rows][..., None] - 1))
    return np.where(body, tokens, 0)

  def has_answer(self, rows: np.ndarray, ranked: np.ndarray) -> np.ndarray:
    """[b, n] bool: block ranked[i, j] contains an answer of question rows[i]."""
    return np.stack([self.matcher(int(r)).contains_rows(self.body_tokens(blocks))
                     for r, blocks in zip(rows, ranked)])

  def reader_batch(self, rows: np.ndarray, top: np.ndarray, labels: bool = True) -> dict:
    """Reader inputs of the top-K blocks [b, K, L], the span mask, and (labels) which spans
    match an answer [b, K, S]."""
    q_ids, q_len = self.question_ids[rows], self.question_len[rows]
    # Spans lie on word boundaries: they neither start on a `##` piece nor end before one (the
    # answers they are trained towards do the same).
    cands, out = reader_inputs(self.data.blocks, top, q_ids, q_len, self.reader_len,
                               self.cls_id, self.sep_id, self._vocab.continuation)
    position, kept = out.pop("body_position"), out.pop("body_kept")
    out["question_ids"] = q_ids
    if labels:
      correct = np.zeros(top.shape + (self.num_spans,), bool)
      bodies = self.body_tokens(top)
      for i, row in enumerate(rows):
        matcher = self.matcher(int(row))
        for j in range(top.shape[1]):
          for start, end in matcher.spans(bodies[i, j]):
            width, in_body = end - start + 1, start - int(cands["body_start"][i, j])
            if width <= self.max_width and in_body + width <= kept[i, j]:
              correct[i, j, self.width_offset[width - 1] + in_body + position[i, j]] = True
      out["span_correct"] = correct
    return out

  def train_batch(self, rows: np.ndarray, ranked: np.ndarray) -> dict[str, np.ndarray]:
    """The Open-QA step's host batch for question `rows` and their top-N blocks `ranked`."""
    batch = self.reader_batch(rows, ranked[:, :self.k])
    batch["candidate_emb"] = self.frozen.embeddings[ranked]
    batch["has_answer"] = self.has_answer(rows, ranked)
    return batch

  def span_text(self, reader_ids: np.ndarray, span: int) -> tuple[str, int, int]:
    """(answer text, start, end) of span index `span` in one reader input."""
    width = int(np.searchsorted(self.width_offset, span, side="right"))
    start = span - int(self.width_offset[width - 1])
    end = start + width - 1
    return self.data.tokenizer.decode(reader_ids[start:end + 1]), start, end
