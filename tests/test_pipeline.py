"""The host batch builders: candidates, salient-span masking, splicing, ICT pairs — on random
data against Python references and on the prepared tiny world (the grain pipeline that feeds
them: tests/test_input_pipeline.py)."""

from types import SimpleNamespace

import numpy as np
import pytest

from realm_jax.data import pipeline
from realm_jax.train import batches
from tests.helpers import tiny_config

MASK_ID, CLS_ID, SEP_ID = 4, 2, 3


# -- candidate_rows ----------------------------------------------------------------------------

def reference_candidates(retrieved, query_block, uids, k):
  out = []
  for row, q in zip(retrieved, query_block):
    kept = [int(r) for r in row if uids[r] != uids[q]][:k - 1]
    out.append([pipeline.NULL_BLOCK] + kept)
  return np.asarray(out)


@pytest.mark.parametrize("k", [2, 4, 8])
def test_candidate_rows_drop_own_block_and_duplicates(k):
  rng = np.random.default_rng(k)
  num_blocks, n = 50, 64
  uids = rng.permutation(10_000)[:num_blocks].astype(np.uint64)
  # Blocks 7 and 31 are exact duplicates (same uid) of blocks 3 and 30.
  uids[7], uids[31] = uids[3], uids[30]
  retrieved = np.stack([rng.permutation(num_blocks)[:k + 1] for _ in range(n)])
  query_block = rng.integers(0, num_blocks, n)
  # Force the interesting cases: own block retrieved first, own block and its duplicate both
  # retrieved, the duplicate retrieved without the own block, the own block retrieved last.
  query_block[:4] = [3, 3, 30, 12]
  retrieved[0, 0] = 3
  retrieved[1, :2] = [7, 3]
  retrieved[2, -1] = 31
  retrieved[3, -1] = 12
  for i in range(4):     # keep rows free of repeats after the edits
    rest = [r for r in rng.permutation(num_blocks) if r not in retrieved[i]]
    seen = set()
    for j, r in enumerate(retrieved[i]):
      if r in seen:
        retrieved[i, j] = rest.pop()
      seen.add(retrieved[i, j])

  cands = pipeline.candidate_rows(retrieved, query_block, uids, k)
  assert cands.shape == (n, k)
  assert (cands[:, 0] == pipeline.NULL_BLOCK).all()
  body = cands[:, 1:]
  assert (body >= 0).all()
  assert not (uids[body] == uids[query_block][:, None]).any()
  assert not np.isin(3, body[:2]) and not np.isin(7, body[:2])
  assert not np.isin(31, body[2]) and not np.isin(30, body[2])
  np.testing.assert_array_equal(cands, reference_candidates(retrieved, query_block, uids, k))


def test_candidate_rows_keep_the_top_k_minus_1_when_nothing_is_trivial():
  uids = np.arange(20, dtype=np.uint64)
  retrieved = np.array([[5, 6, 7, 8], [9, 1, 2, 3]])
  cands = pipeline.candidate_rows(retrieved, np.array([0, 4]), uids, 3)
  np.testing.assert_array_equal(cands, [[-1, 5, 6], [-1, 9, 1]])


def test_candidate_rows_never_keep_a_trivial_block_even_with_many_duplicates():
  # Blocks 0..3 are all copies of the query's own block: more than the one spare slot.
  uids = np.array([9, 9, 9, 9, 1, 2, 3, 4], dtype=np.uint64)
  retrieved = np.array([[0, 1, 2, 4, 3]])
  cands = pipeline.candidate_rows(retrieved, np.array([0]), uids, 4)
  np.testing.assert_array_equal(cands, [[-1, 4, -1, -1]])


# -- salient-span masking ---------------------------------------------------------------------

def test_mask_salient_spans_masks_exactly_the_span():
  rng = np.random.default_rng(0)
  n, length, max_masks = 200, 40, 10
  ids = rng.integers(5, 500, size=(n, length)).astype(np.int32)
  starts = rng.integers(0, 20, n)
  widths = rng.integers(1, max_masks + 1, n)
  spans = np.stack([starts, starts + widths], 1)
  out = pipeline.mask_salient_spans(ids, spans, max_masks, MASK_ID)
  assert out["mask_positions"].shape == (n, max_masks)
  assert (ids >= 5).all(), "input is not modified in place"
  for i in range(n):
    s, e = spans[i]
    masked = np.flatnonzero(out["query_ids"][i] == MASK_ID)
    np.testing.assert_array_equal(masked, np.arange(1 + s, 1 + e))   # +1: [CLS]
    unmasked = np.ones(length, bool)
    unmasked[1 + s:1 + e] = False
    np.testing.assert_array_equal(out["query_ids"][i][unmasked], ids[i][unmasked])
    w = e - s
    np.testing.assert_array_equal(out["mask_weights"][i], np.arange(max_masks) < w)
    np.testing.assert_array_equal(out["mask_positions"][i, :w], np.arange(1 + s, 1 + e))
    np.testing.assert_array_equal(out["mask_labels"][i, :w], ids[i, 1 + s:1 + e])
    assert (out["mask_labels"][i, w:] == 0).all()


def test_mask_salient_spans_never_exceeds_max_masks():
  ids = np.arange(5, 45, dtype=np.int32)[None].repeat(2, 0)
  spans = np.array([[0, 15], [3, 4]])
  out = pipeline.mask_salient_spans(ids, spans, 10, MASK_ID)
  assert (out["query_ids"] == MASK_ID).sum(1).tolist() == [10, 1]
  assert out["mask_weights"].sum(1).tolist() == [10, 1]


def test_world_spans_fit_max_masks_and_mask_their_wordpieces(world_data):
  for split in ("train", "eval"):
    ex = world_data.examples(split)
    assert len(ex) > 0
    for i in range(len(ex)):
      n = ex.num_spans[i]
      assert 1 <= n
      spans = ex.spans[i, :n]
      widths = spans[:, 1] - spans[:, 0]
      assert ((widths >= 1) & (widths <= 10)).all(), (split, i, spans)
      assert (spans[:, 1] <= ex.lengths[i]).all()
      assert (ex.spans[i, n:] == -1).all()
    if split == "eval":
      widths = ex.target_span[:, 1] - ex.target_span[:, 0]
      assert ((widths >= 1) & (widths <= 10)).all()
  # Masked queries of real examples: labels are the sentence's wordpieces under the span.
  config = tiny_config("realm")
  ex = world_data.examples("train")
  rows = np.arange(len(ex))
  spans = ex.spans[rows, np.random.default_rng(0).integers(ex.num_spans[rows])]
  tok = world_data.tokenizer
  q = batches.masked_queries(ex, rows, spans, config, tok.cls_id, tok.sep_id, tok.mask_id)
  for i in rows:
    s, e = spans[i]
    w = int(q["mask_weights"][i].sum())
    assert w == e - s
    np.testing.assert_array_equal(q["mask_labels"][i, :w], ex.tokens[i, s:e])
    assert (q["query_ids"][i] == tok.mask_id).sum() == w
    assert q["query_ids"][i, 0] == tok.cls_id
    assert q["query_ids"][i, q["query_len"][i] - 1] == tok.sep_id


# -- queries longer than data.query_len -------------------------------------------------------

def long_sentences(n: int = 60, width: int = 20, seed: int = 5) -> SimpleNamespace:
  """Example rows (tokens 0-padded to `width`, lengths, source blocks) of random sentences of
  1-`width` wordpieces, ids 10-99 (none a [CLS], [SEP] or [MASK])."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, width + 1, n)
  lengths[:4] = (width, 8, 9, 1)   # the longest, one that just fits 8, one just past, one
  tokens = np.where(np.arange(width) < lengths[:, None], rng.integers(10, 100, (n, width)), 0)
  return SimpleNamespace(tokens=tokens.astype(np.int32), lengths=lengths.astype(np.int32),
                         block=np.arange(n, dtype=np.int32))


def test_query_ids_cut_a_long_sentence_to_its_first_wordpieces_with_sep_last():
  """ORQA's ICT query `[CLS] first query_len - 2 wordpieces [SEP]`: ids, lengths and the
  reader's segments against a direct construction; a sentence that fits is whole."""
  ex, query_len = long_sentences(), 10
  rows = np.arange(len(ex.lengths))[::-1]
  ids, lengths = pipeline.query_ids(ex, rows, query_len, CLS_ID, SEP_ID)
  assert ids.shape == (len(rows), query_len) and ids.dtype == np.int32
  for i, r in enumerate(rows):
    ref = [CLS_ID] + list(ex.tokens[r, :min(ex.lengths[r], query_len - 2)]) + [SEP_ID]
    np.testing.assert_array_equal(ids[i], ref + [0] * (query_len - len(ref)))
    assert lengths[i] == len(ref) == (ids[i] > 0).sum()
  assert (ex.lengths > query_len - 2).sum() > 1   # cut, and the one of 8 whole
  # [CLS] x [SEP] then a block's body [SEP]: segment 0 ends with the cut query's [SEP]
  block = np.array([CLS_ID, 50, SEP_ID, 60, 61, SEP_ID, 0, 0], np.int32)
  cands = {"candidate_ids": np.broadcast_to(block, (len(rows), 1, 8)),
           "body_start": np.full((len(rows), 1), 3), "lengths": np.full((len(rows), 1), 6)}
  reader_len = pipeline.reader_length(query_len, 8)
  reader_ids, segments = pipeline.reader_inputs(ids, lengths, cands, reader_len)
  for i in range(len(rows)):
    ref = list(ids[i, :lengths[i]]) + [60, 61, SEP_ID]
    np.testing.assert_array_equal(reader_ids[i, 0], ref + [0] * (reader_len - len(ref)))
    np.testing.assert_array_equal(segments[i, 0], [0] * lengths[i] + [1] * 3 +
                                  [0] * (reader_len - len(ref)))


def test_a_masked_query_past_the_cut_is_the_window_that_holds_its_span():
  """An evaluation query whose target span ends past the first query_len - 2 wordpieces is the
  query_len - 2 that end with the span, the span masked in it; any other is cut (or whole)
  from the sentence's start."""
  ex, query_len = long_sentences(), 10
  room, n = query_len - 2, len(ex.lengths)
  config = tiny_config("ict", data__query_len=query_len, data__max_masks=4,
                       data__long_queries="cut")
  rng = np.random.default_rng(6)
  widths = np.minimum(rng.integers(1, 5, n), ex.lengths)
  starts = rng.integers(0, ex.lengths - widths + 1)
  starts[0] = ex.lengths[0] - widths[0]   # the longest sentence's span at its very end
  spans = np.stack([starts, starts + widths], 1)
  rows = np.arange(n)
  q = batches.masked_queries(ex, rows, spans, config, CLS_ID, SEP_ID, MASK_ID)
  windowed = 0
  for i in rows:
    (s, e), length = spans[i], ex.lengths[i]
    first = max(0, e - room)
    windowed += first > 0
    x = list(ex.tokens[i, first:min(length, first + room)])
    x[s - first:e - first] = [MASK_ID] * (e - s)
    ref = [CLS_ID] + x + [SEP_ID]
    np.testing.assert_array_equal(q["query_ids"][i], ref + [0] * (query_len - len(ref)))
    assert q["query_len"][i] == len(ref)
    w = e - s
    np.testing.assert_array_equal(q["mask_labels"][i, :w], ex.tokens[i, s:e])
    np.testing.assert_array_equal(q["mask_positions"][i, :w], 1 + s - first + np.arange(w))
    assert q["mask_weights"][i].sum() == w
  assert windowed == (pipeline.span_windows(spans, query_len) > 0).sum() > 0
  assert ((ex.lengths > room) & (spans[:, 1] <= room)).any()   # cut from the start


# -- splice and reader inputs -----------------------------------------------------------------

def test_splice_matches_python_reference():
  rng = np.random.default_rng(1)
  shape, la, lb, out_len = (7, 3), 12, 20, 24
  a = rng.integers(1, 100, size=shape + (la,))
  b = rng.integers(1, 100, size=shape + (lb,))
  a_len = rng.integers(0, la + 1, size=shape)
  b_start = rng.integers(0, lb + 1, size=shape)
  b_end = np.minimum(b_start + rng.integers(0, lb + 1, size=shape), lb)
  got = pipeline.splice(a, a_len, b, b_start, b_end, out_len)
  assert got.shape == shape + (out_len,) and got.dtype == np.int32
  for idx in np.ndindex(*shape):
    ref = list(a[idx][:a_len[idx]]) + list(b[idx][b_start[idx]:b_end[idx]])
    ref = (ref + [0] * out_len)[:out_len]
    np.testing.assert_array_equal(got[idx], ref, err_msg=str(idx))


def test_reader_inputs_are_query_then_block_body(world_data):
  tok, blocks = world_data.tokenizer, world_data.blocks
  config = tiny_config("realm")
  ex = world_data.examples("train")
  rows = np.arange(0, len(ex), 37)
  spans = ex.spans[rows, 0]
  q = batches.masked_queries(ex, rows, spans, config, tok.cls_id, tok.sep_id, tok.mask_id)
  rng = np.random.default_rng(2)
  cand_rows = np.concatenate([np.full((len(rows), 1), pipeline.NULL_BLOCK),
                              rng.integers(0, blocks.num_blocks, (len(rows), 3))], 1)
  cands = pipeline.candidate_inputs(blocks, cand_rows, tok.cls_id, tok.sep_id)
  reader_len = config.data.query_len + blocks.block_len - 2
  ids, segments = pipeline.reader_inputs(q["query_ids"], q["query_len"], cands, reader_len)
  assert ids.shape == segments.shape == (len(rows), 4, reader_len)
  for i in range(len(rows)):
    query = list(q["query_ids"][i, :q["query_len"][i]])
    assert query[0] == tok.cls_id and query[-1] == tok.sep_id
    for j, row in enumerate(cand_rows[i]):
      if row == pipeline.NULL_BLOCK:
        body = [tok.sep_id]                                    # `[CLS] x [SEP] [SEP]`
        np.testing.assert_array_equal(cands["candidate_ids"][i, j, :3],
                                      [tok.cls_id, tok.sep_id, tok.sep_id])
        assert (cands["candidate_ids"][i, j, 3:] == 0).all()
      else:
        body = list(blocks.tokens[row][blocks.body_start[row]:blocks.lengths[row]])
        assert body[-1] == tok.sep_id
        np.testing.assert_array_equal(cands["candidate_ids"][i, j], blocks.tokens[row])
        np.testing.assert_array_equal(cands["candidate_segments"][i, j],
                                      blocks.segments(np.array([row]))[0])
      ref = query + body
      ref_ids = np.array(ref + [0] * (reader_len - len(ref)))
      np.testing.assert_array_equal(ids[i, j], ref_ids)
      ref_seg = np.zeros(reader_len, int)
      ref_seg[len(query):len(ref)] = 1
      np.testing.assert_array_equal(segments[i, j], ref_seg)


# -- ICT --------------------------------------------------------------------------------------

def test_ict_inputs_cut_the_query_sentence_out_of_its_block(world_data):
  tok, blocks = world_data.tokenizer, world_data.blocks
  ex = world_data.examples("train")
  rows = np.arange(len(ex))
  remove = np.random.default_rng(3).random(len(rows)) < 0.5
  query_len = tiny_config("ict").data.query_len
  out = pipeline.ict_inputs(ex, blocks, rows, query_len, remove, tok.cls_id, tok.sep_id)
  assert out["block_ids"].shape == (len(rows), blocks.block_len)
  for i in rows:
    sentence = list(ex.tokens[i, :ex.lengths[i]])
    np.testing.assert_array_equal(out["query_ids"][i, :len(sentence) + 2],
                                  [tok.cls_id] + sentence + [tok.sep_id])
    b = ex.block[i]
    original = list(blocks.tokens[b][:blocks.lengths[b]])
    s, e = ex.block_offsets[i]
    assert original[s:e] == sentence          # the offsets locate the sentence in its block
    expected = original[:s] + original[e:] if remove[i] else original
    row = out["block_ids"][i]
    np.testing.assert_array_equal(row, expected + [0] * (blocks.block_len - len(expected)))
    seg = np.zeros(blocks.block_len, int)
    seg[blocks.body_start[b]:len(expected)] = 1
    np.testing.assert_array_equal(out["block_segments"][i], seg)
  assert remove.any() and (~remove).any()


def test_recall_counts_no_padding_as_a_hit():
  """A query whose top blocks are its own block's copies keeps fewer blocks than it asked for
  (the rest -1); its answer blocks are -1 padded too: the two paddings are no hit."""
  from realm_jax.train.masked_eval import answer_in_top
  uids = np.array([7, 7, 7, 9, 5])              # blocks 0-2: one text three times
  top = np.array([[0, 1, 2, 3], [3, 0, 4, 1]])
  ranked = pipeline.candidate_rows(top, np.array([0, 0]), uids, 4)[:, 1:]
  assert ranked.tolist() == [[3, -1, -1], [3, 4, -1]]
  answers = np.array([[4, -1], [4, -1]])
  assert answer_in_top(ranked, answers, 1).tolist() == [False, False]
  assert answer_in_top(ranked, answers, 5).tolist() == [False, True]
