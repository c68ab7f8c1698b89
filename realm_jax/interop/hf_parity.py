"""Parity of an imported checkpoint with Hugging Face's own REALM classes (needs torch and
transformers 4.x: `make interop-env`, then `make interop-check HF_DIR=D`).

  python -m realm_jax.interop.hf_parity --hf-dir D [--hf-dir D2 ...] [--tol 1e-4] [--seed 0]

For each dir: load it with transformers' class for its layout, import it with
`realm-import-hf` into a temporary workdir and restore our params from that workdir's
checkpoint, feed both the same seeded random inputs (rows of different lengths, padding, both
token types) and print the max absolute difference of every output:

  RealmEmbedder             projected scores (block-style and query-style inputs)
  RealmKnowledgeAugEncoder  MLM log-probs at every real position, the marginal MLM loss
  RealmReader               span scores on the valid spans, with the retrieval logit added;
                            the predicted (block, start, end)
  RealmForOpenQA            question embedding, retrieved blocks and logits, reader inputs,
                            span scores, the predicted answer (block, start, end) and its score
  bert                      last hidden states, and MLM log-probs with an MLM head

Lines look like `[RealmReader] max_abs_diff span_logits 2.4e-07` and
`[RealmReader] match answer True`; the exit code is 1 when a difference exceeds --tol or a
match fails. `--make-random ARCH --out D [--bin]` writes a small random checkpoint of that
architecture in HF's own format: a REALM one with RealmConfig's default activation `gelu_new`
(tanh GELU), or `bert` (BertForMaskedLM, erf `gelu`); `--make-random all`: all four REALM ones
in both formats and bert (safetensors), what the tests use.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile

import numpy as np

from realm_jax import log
from realm_jax.errors import CommandParser

TOLERANCE = 1e-4
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
# Non-default sizes everywhere, so a field read from the wrong key shows up as a mismatch;
# HF RealmConfig's default activation (the released checkpoints' tanh GELU).
TINY = dict(hidden_size=48, num_hidden_layers=3, num_attention_heads=4, intermediate_size=80,
            retriever_proj_size=24, span_hidden_size=20, max_span_width=4,
            max_position_embeddings=128, reader_seq_len=64, reader_beam_size=3, num_candidates=4,
            reader_layer_norm_eps=2e-3, hidden_act="gelu_new", pad_token_id=0)
# The plain BERT checkpoint (`bert`: BertForMaskedLM): TINY's BERT fields with erf GELU.
TINY_BERT = dict({k: TINY[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                       "intermediate_size", "max_position_embeddings",
                                       "pad_token_id")}, hidden_act="gelu")
NUM_RECORDS = 60


class Results:
  """The printed differences and matches of one checkpoint."""

  def __init__(self, name: str, tol: float):
    self.name, self.tol, self.failed = name, tol, []

  def diff(self, what: str, ours, theirs, where=None) -> None:
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    if ours.shape != theirs.shape:
      self.failed.append(f"{what}: shapes {ours.shape} (ours) != {theirs.shape} (HF)")
      print(f"[{self.name}] shape_mismatch {what} {ours.shape} {theirs.shape}", flush=True)
      return
    d = np.abs(ours - theirs)
    value = float(d[where].max() if where is not None else d.max()) if d.size else 0.0
    print(f"[{self.name}] max_abs_diff {what} {value:.3g}", flush=True)
    if not value <= self.tol:
      self.failed.append(f"{what}: {value:.3g} > {self.tol:g}")

  def match(self, what: str, ours, theirs) -> None:
    same = bool(np.array_equal(np.asarray(ours), np.asarray(theirs)))
    print(f"[{self.name}] match {what} {same}", flush=True)
    if not same:
      self.failed.append(f"{what}: ours {np.asarray(ours).tolist()} != HF "
                         f"{np.asarray(theirs).tolist()}")


# -- random inputs ------------------------------------------------------------------------
def random_ids(rng, lengths, width, vocab_size, low=5):
  """Rows of random non-special ids with the given lengths, 0-padded to `width`."""
  ids = np.zeros((len(lengths), width), np.int64)
  for i, n in enumerate(lengths):
    ids[i, :n] = rng.integers(low, vocab_size, n)
  return ids


def pair_rows(rng, n, width, vocab_size, cls_id=2, sep_id=3):
  """`[CLS] a [SEP] b [SEP]` rows of varied lengths: (ids, token types, body mask)."""
  ids = np.zeros((n, width), np.int64)
  types = np.zeros((n, width), np.int64)
  body = np.zeros((n, width), bool)
  for i in range(n):
    qa = int(rng.integers(2, 8))
    nb = int(rng.integers(3, width - qa - 3 + 1)) if i else width - qa - 3   # row 0: full
    row = [cls_id, *rng.integers(5, vocab_size, qa), sep_id, *rng.integers(5, vocab_size, nb),
           sep_id]
    ids[i, :len(row)] = row
    types[i, qa + 2:len(row)] = 1
    body[i, qa + 2:len(row) - 1] = True
  return ids, types, body


def _log_softmax(x):
  x = np.asarray(x, np.float64)
  m = x.max(-1, keepdims=True)
  return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


# -- the two sides ------------------------------------------------------------------------
def load_ours(hf_dir: str, workdir: str):
  """Imports `hf_dir` into `workdir`, then restores the params from the written checkpoint."""
  from realm_jax.interop import hf_realm
  from realm_jax.runtime.checkpoints import restore_run
  report = hf_realm.import_checkpoint(hf_dir, workdir)
  print("\n".join(f"  {line}" for line in report.lines()), flush=True)
  run = restore_run(workdir, mesh_shape=(-1, 1))
  return run.config, run.model, run.params


def load_theirs(layout: str, hf_dir: str, hf: dict):
  import transformers
  if layout == "bert":
    archs = hf.get("architectures") or []
    cls = transformers.BertForMaskedLM if "BertForMaskedLM" in archs or "BertForPreTraining" \
        in archs else transformers.BertModel
    model = cls.from_pretrained(hf_dir)
  elif layout == "RealmForOpenQA":
    os.environ.setdefault("TRUST_REMOTE_CODE", "True")   # block_records.npy is a pickle
    retriever = transformers.RealmRetriever.from_pretrained(hf_dir)
    model = transformers.RealmForOpenQA.from_pretrained(hf_dir, retriever=retriever)
  else:
    model = getattr(transformers, layout).from_pretrained(hf_dir)
  return model.eval().float()


def _apply(model, params, method, *args):
  return np.asarray(model.apply({"params": params}, *args, method=method))


def check_embedder(res, model, params, hf_model, hf, rng):
  import torch
  from realm_jax.models.realm import REALM
  lengths = [24, 17, 9, 3]
  ids = random_ids(rng, lengths, 24, hf["vocab_size"])
  types = np.zeros_like(ids)
  for i, n in enumerate(lengths):
    types[i, n // 2:n] = 1
  with torch.no_grad():
    block = hf_model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(ids != 0),
                     token_type_ids=torch.tensor(types)).projected_score.numpy()
    query = hf_model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(ids != 0),
                     token_type_ids=torch.zeros_like(torch.tensor(ids))).projected_score.numpy()
  res.diff("projected_score_block_inputs",
           _apply(model, params, REALM.embed_blocks, ids.astype(np.int32), types.astype(np.int32)),
           block)
  res.diff("projected_score_query_inputs",
           _apply(model, params, REALM.embed_queries, ids.astype(np.int32)), query)


def check_encoder(res, model, params, hf_model, hf, rng):
  import jax.numpy as jnp
  import torch
  from realm_jax.models import losses
  from realm_jax.models.realm import REALM
  from realm_jax.train.steps import label_log_probs
  b, k, length, masks = 2, hf["num_candidates"], 32, 3
  ids, types, _ = pair_rows(rng, b * k, length, hf["vocab_size"])
  relevance = rng.normal(0, 2, (b, k)).astype(np.float32)
  positions = np.stack([rng.choice(np.arange(1, 6), masks, replace=False) for _ in range(b)])
  labels = np.full((b, length), -100, np.int64)
  for i in range(b):
    labels[i, positions[i]] = rng.integers(5, hf["vocab_size"], masks)
  with torch.no_grad():
    out = hf_model(input_ids=torch.tensor(ids.reshape(b, k, length)),
                   attention_mask=torch.tensor(ids.reshape(b, k, length) != 0),
                   token_type_ids=torch.tensor(types.reshape(b, k, length)),
                   relevance_score=torch.tensor(relevance), labels=torch.tensor(labels),
                   mlm_mask=torch.tensor(labels != -100))
  everywhere = np.broadcast_to(np.arange(length, dtype=np.int32), (b * k, length))
  ours = _apply(model, params, REALM.read, ids.astype(np.int32), types.astype(np.int32),
                everywhere)
  real = np.broadcast_to((ids != 0)[..., None], ours.shape)
  res.diff("mlm_log_probs", ours, _log_softmax(out.logits.numpy()), where=real)
  mask_positions = np.repeat(positions, k, axis=0).astype(np.int32)
  vocab_lp = _apply(model, params, REALM.read, ids.astype(np.int32), types.astype(np.int32),
                    mask_positions).reshape(b, k, masks, -1)
  mask_labels = np.take_along_axis(labels, positions, axis=1)
  mask_lp = label_log_probs(jnp.asarray(vocab_lp), jnp.asarray(mask_labels))
  loss, _ = losses.realm_loss(jnp.asarray(relevance), mask_lp, jnp.ones((b, masks)), "per_mask")
  res.diff("marginal_mlm_loss", float(loss), float(out.loss))


def _capture_spans(hf_reader):
  """A forward hook keeping a copy of qa_outputs' span logits (HF adds the retrieval logit
  to them in place afterwards)."""
  captured = {}

  def hook(_module, _inputs, output):
    captured["logits"], captured["starts"], captured["ends"] = (
        output[0].detach().clone().numpy(), output[1].numpy(), output[2].numpy())
  handle = hf_reader.qa_outputs.register_forward_hook(hook)
  return captured, handle


def _valid_span_columns(starts, ends, our_starts, our_ends):
  """For each HF span (start, end), the column of the same span among ours."""
  column = {(int(s), int(e)): j for j, (s, e) in enumerate(zip(our_starts, our_ends))}
  return np.asarray([column.get((int(s), int(e)), -1) for s, e in zip(starts, ends)])


def check_reader(res, model, params, hf_model, hf, rng):
  import torch
  from realm_jax.models.realm import REALM, span_candidates
  n, length = hf["reader_beam_size"], 40
  ids, types, body = pair_rows(rng, n, length, hf["vocab_size"])
  relevance = rng.normal(0, 2, n).astype(np.float32)
  captured, handle = _capture_spans(hf_model)
  with torch.no_grad():
    out = hf_model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(ids != 0),
                   token_type_ids=torch.tensor(types), relevance_score=torch.tensor(relevance),
                   block_mask=torch.tensor(body), return_dict=True)
  handle.remove()
  ours = _apply(model, params, REALM.read_spans, ids.astype(np.int32), types.astype(np.int32),
                body)
  our_starts, our_ends = span_candidates(length, model.max_span_width)
  cols = _valid_span_columns(captured["starts"], captured["ends"], our_starts, our_ends)
  valid = body[:, captured["starts"]] & body[:, captured["ends"]]
  res.diff("span_logits_valid_spans", ours[:, cols], captured["logits"], where=valid)
  joint = ours + relevance[:, None]
  block, span = np.unravel_index(int(np.argmax(joint)), joint.shape)
  res.diff("span_plus_retrieval_logits", joint[:, cols], captured["logits"] + relevance[:, None],
           where=valid)
  res.match("answer_block_start_end",
            [block, our_starts[span], our_ends[span]],
            [int(out.block_idx), int(out.start_pos[0]), int(out.end_pos[0])])


def check_openqa(res, model, params, hf_model, hf, rng, config, workdir):
  import torch
  from realm_jax.data.prepared import BlockStore
  from realm_jax.data.tokenizer import load_tokenizer
  from realm_jax.interop.hf_realm_openqa import openqa_forward
  from realm_jax.models.realm import REALM
  from realm_jax.retrieval.index import ExactIndex
  tokenizer = load_tokenizer(os.path.join(workdir, "data", "vocab.txt"))
  words = [t for t in _vocab(workdir) if t.isalpha() and t not in SPECIALS]
  question = " ".join(rng.choice(words, 6))
  hf_tok = hf_model.retriever.tokenizer
  q = hf_tok([question], return_tensors="pt")
  block_emb = hf_model.block_emb.numpy()
  captured, handle = _capture_spans(hf_model.reader)
  reader_in = {}
  pre = hf_model.reader.register_forward_pre_hook(
      lambda _m, _a, kwargs: reader_in.update(ids=kwargs["input_ids"].numpy(),
                                              relevance=kwargs["relevance_score"].numpy()),
      with_kwargs=True)
  with torch.no_grad():
    q_proj = hf_model.embedder(**q).projected_score.numpy()
    out = hf_model(**q, return_dict=True).reader_output
  handle.remove()
  pre.remove()
  hf_rows = np.argsort(-(block_emb @ q_proj[0]), kind="stable")[:hf["reader_beam_size"]]

  question_ids = np.asarray(tokenizer.encode_batch([question])[0][0], np.int32)
  res.match("question_wordpieces", question_ids, q["input_ids"][0, 1:-1].numpy())
  q_ids = np.zeros((1, config.data.query_len), np.int32)
  q_ids[0, :len(question_ids) + 2] = [tokenizer.cls_id, *question_ids, tokenizer.sep_id]
  res.diff("question_embedding", _apply(model, params, REALM.embed_queries, q_ids), q_proj)
  pred = openqa_forward(model, params, question_ids, index=ExactIndex.from_embeddings(block_emb),
                        block_emb=block_emb, blocks=BlockStore(os.path.join(workdir, "data")),
                        cls_id=tokenizer.cls_id, sep_id=tokenizer.sep_id,
                        reader_beam=hf["reader_beam_size"],
                        reader_len=min(hf["reader_seq_len"], hf["max_position_embeddings"]),
                        query_len=config.data.query_len)
  res.match("retrieved_blocks", pred.block_rows, hf_rows)
  res.diff("retrieval_logits", pred.retrieval_logits, reader_in["relevance"])
  hf_len = reader_in["ids"].shape[1]
  res.match("reader_input_ids", pred.reader_ids[:, :hf_len], reader_in["ids"])
  cols = _valid_span_columns(captured["starts"], captured["ends"], pred.starts, pred.ends)
  body = pred.span_mask[:, :hf_len]
  valid = body[:, captured["starts"]] & body[:, captured["ends"]]
  res.diff("span_logits_valid_spans", pred.span_logits[:, cols], captured["logits"], where=valid)
  hf_block, hf_start, hf_end = int(out.block_idx), int(out.start_pos[0]), int(out.end_pos[0])
  res.match("answer_block_row_start_end", [pred.block_rows[pred.block], pred.start, pred.end],
            [hf_rows[hf_block], hf_start, hf_end])
  hf_score = captured["logits"][hf_block, int(out.candidate)] + reader_in["relevance"][hf_block]
  res.diff("answer_score", pred.score, hf_score)
  print(f"[{res.name}] answer {tokenizer.decode(pred.answer_ids)!r} (block row "
        f"{pred.block_rows[pred.block]}, score {pred.score:.4f})", flush=True)


def check_bert(res, model, params, hf_model, hf, rng):
  import torch
  from realm_jax.models.realm import REALM
  ids, types, _ = pair_rows(rng, 4, 24, hf["vocab_size"])
  with torch.no_grad():
    out = hf_model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(ids != 0),
                   token_type_ids=torch.tensor(types), output_hidden_states=True)
  hidden = np.asarray(model.apply({"params": params}, ids.astype(np.int32),
                                  types.astype(np.int32),
                                  method=lambda m, i, s: m.reader.bert(i, s)[0]))
  real = np.broadcast_to((ids != 0)[..., None], hidden.shape)
  res.diff("last_hidden_state", hidden, out.hidden_states[-1].numpy(), where=real)
  if hasattr(out, "logits"):
    everywhere = np.broadcast_to(np.arange(24, dtype=np.int32), ids.shape)
    ours = _apply(model, params, REALM.read, ids.astype(np.int32), types.astype(np.int32),
                  everywhere)
    res.diff("mlm_log_probs", ours, _log_softmax(out.logits.numpy()),
             where=np.broadcast_to((ids != 0)[..., None], ours.shape))


def _vocab(workdir: str) -> list[str]:
  with open(os.path.join(workdir, "data", "vocab.txt"), encoding="utf-8") as f:
    return [line.rstrip("\n") for line in f]


def check_dir(hf_dir: str, tol: float, seed: int) -> list[str]:
  """Runs every comparison for one checkpoint dir; returns the failures."""
  from realm_jax.interop import hf_realm_weights
  layout, hf = hf_realm_weights.read_hf_config(hf_dir)
  print(f"hf_parity: {hf_dir} ({layout})", flush=True)
  rng = np.random.default_rng(seed)
  res = Results(layout, tol)
  with tempfile.TemporaryDirectory(prefix="realm_hf_parity_") as workdir:
    config, model, params = load_ours(hf_dir, workdir)
    hf_model = load_theirs(layout, hf_dir, hf)
    if layout == "RealmEmbedder":
      check_embedder(res, model, params, hf_model, hf, rng)
    elif layout == "RealmKnowledgeAugEncoder":
      check_encoder(res, model, params, hf_model, hf, rng)
    elif layout == "RealmReader":
      check_reader(res, model, params, hf_model, hf, rng)
    elif layout == "RealmForOpenQA":
      check_openqa(res, model, params, hf_model, hf, rng, config, workdir)
    else:
      check_bert(res, model, params, hf_model, hf, rng)
  print(f"[{layout}] {'PASS' if not res.failed else 'FAIL: ' + '; '.join(res.failed)}",
        flush=True)
  return res.failed


# -- random checkpoints in HF's format ----------------------------------------------------
def make_random_checkpoint(out_dir: str, architecture: str, safe_serialization: bool = True,
                           seed: int = 0, num_words: int = 150, num_records: int = NUM_RECORDS,
                           record_words: tuple[int, int] = (4, 90), **overrides) -> str:
  """A small random checkpoint of `architecture` (RealmEmbedder, RealmKnowledgeAugEncoder,
  RealmReader, RealmForOpenQA, or `bert`: BertForMaskedLM) saved by transformers itself, with
  its vocab.txt (and for RealmForOpenQA block_emb and block_records.npy). Weights are redrawn
  wider than HF's init (std 0.02 would make every output nearly constant and the comparison
  lax), though not so wide that float32 rounding alone reaches the tolerance (the tied MLM
  decoder multiplies the encoder's rounding by the embedding norm)."""
  import torch
  import transformers
  os.makedirs(out_dir, exist_ok=True)
  rng = np.random.default_rng(seed)
  torch.manual_seed(seed)
  letters = list("abcdefghijklmnopqrstuvwxyz")
  words: set[str] = set()
  while len(words) < num_words:
    words.add("".join(rng.choice(letters, int(rng.integers(2, 9)))))
  words = sorted(words)
  vocab = SPECIALS + words + [f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz"] + list(".,'")
  vocab_file = os.path.join(out_dir, "vocab.txt")
  with open(vocab_file, "w") as f:
    f.write("\n".join(vocab) + "\n")
  if architecture == "bert":
    config = transformers.BertConfig(vocab_size=len(vocab), architectures=["BertForMaskedLM"],
                                     **{**TINY_BERT, **overrides})
    model = transformers.BertForMaskedLM(config)
  else:
    config = transformers.RealmConfig(vocab_size=len(vocab), num_block_records=num_records,
                                      architectures=[architecture], **{**TINY, **overrides})
    model = getattr(transformers, architecture)(config)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "LayerNorm" in name or "layer_normalization" in name:
        p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.2 * torch.randn_like(p))
      elif "word_embeddings" in name:
        p.normal_(0, 0.5)
      else:
        p.normal_(0, 0.2 if name.endswith("weight") else 0.1)
  tokenizer = (transformers.BertTokenizerFast if architecture == "bert"
               else transformers.RealmTokenizerFast)(vocab_file)
  if architecture == "RealmForOpenQA":
    records = np.array([" ".join(rng.choice(words, int(rng.integers(*record_words)))).encode()
                        for _ in range(num_records)], dtype=object)
    model.block_emb = torch.tensor(rng.normal(0, 1, (num_records, config.retriever_proj_size)),
                                   dtype=torch.float32)
    transformers.RealmRetriever(records, tokenizer).save_pretrained(out_dir)
  if safe_serialization and architecture in ("RealmReader", "RealmForOpenQA"):
    # transformers 4.57 refuses to write these two as safetensors: their MLM heads share
    # decoder.bias with bias without declaring it tied. A copy of equal value is written.
    for module in model.modules():
      if isinstance(module, transformers.models.deprecated.realm.modeling_realm
                    .RealmLMPredictionHead) and module.decoder.bias is module.bias:
        module.decoder.bias = torch.nn.Parameter(module.bias.detach().clone())
  model.save_pretrained(out_dir, safe_serialization=safe_serialization)
  tokenizer.save_pretrained(out_dir)
  return out_dir


def main(argv: list[str] | None = None) -> int:
  parser = CommandParser(prog="hf_parity", description=__doc__.split("\n\n")[0])
  parser.add_argument("--hf-dir", action="append", default=[], help="checkpoint dir (repeat)")
  parser.add_argument("--tol", type=float, default=TOLERANCE, help="max abs difference allowed")
  parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
  parser.add_argument("--make-random", default=None, help="write a random checkpoint of this "
                      "architecture (a REALM one, or bert) to --out instead (`all`: each "
                      "REALM one in both formats and bert as safetensors, as "
                      "OUT/<architecture>-<safetensors|bin>)")
  parser.add_argument("--out", default=None, help="with --make-random: the dir to write")
  parser.add_argument("--bin", action="store_true", help="with --make-random: save "
                      "pytorch_model.bin instead of model.safetensors")
  log.add_verbosity_argument(parser)
  args = parser.parse_args(argv)
  log.set_verbosity(args.verbosity)
  if args.make_random and not args.out:
    parser.error("--make-random needs --out DIR: the dir to write the checkpoint to")
  missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
  if missing:   # checked before the import runs, not after it
    parser.exit(2, f"{parser.prog}: error: needs {' and '.join(missing)} (not installed here): "
                "`make interop-env` makes .venv-interop with them (then `make interop-check "
                "HF_DIR=D`)\n")
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  if args.make_random:
    if args.make_random != "all":
      print(make_random_checkpoint(args.out, args.make_random, not args.bin), flush=True)
      return 0
    from realm_jax.interop.hf_realm_weights import REALM_ARCHITECTURES
    for arch in REALM_ARCHITECTURES:
      for fmt in ("safetensors", "bin"):
        print(make_random_checkpoint(os.path.join(args.out, f"{arch}-{fmt}"), arch,
                                     fmt == "safetensors"), flush=True)
    print(make_random_checkpoint(os.path.join(args.out, "bert-safetensors"), "bert"), flush=True)
    return 0
  if not args.hf_dir:
    parser.error("--hf-dir is required")
  import jax
  jax.config.update("jax_default_matmul_precision", "highest")
  failed = {d: check_dir(d, args.tol, args.seed) for d in args.hf_dir}
  bad = [d for d, f in failed.items() if f]
  print(f"hf_parity: {len(failed) - len(bad)}/{len(failed)} checkpoints within {args.tol:g}"
        + (f"; failed: {', '.join(bad)}" if bad else ""), flush=True)
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
