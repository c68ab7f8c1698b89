"""The project against its PyTorch peer (transformers' REALM) on the same work, same threads.

Runs in the interop env (`make bench-peer`, or `.venv-interop/bin/python bench/peer_hf.py`).

1. Knowledge-augmented encoder training step: B queries x k candidates x L tokens through the
   reader BERT, MLM at M masks per query, the marginal loss over the k candidates given their
   relevance scores (per-mask marginalisation: what HF's RealmKnowledgeAugEncoder computes),
   backward, global-norm clip 1.0 and an AdamW update (lr 1e-4, wd 0.01 not on LayerNorm and
   biases, eps 1e-6), dropout 0.1 in both, float32.
     ours: the reader's log p(label) at the masks (`REALM.read_labels`, what the train step
           reads) and `losses.realm_loss`, with `state.make_optimizer`, in one jitted step
           (donated state)
     peer: RealmKnowledgeAugEncoder(labels=..., relevance_score=..., mlm_mask=...) + backward
           + clip_grad_norm_ + torch.optim.AdamW
   Prints the median step time over the timed steps (warm-up steps excluded), reader
   sequences/s (B*k per step) of each, and ours / peer; and each step's matmul FLOPs
   (3 x forward) with the FLOP/s they make: HF's class runs its last layer and the vocabulary
   projection at every position, ours at the masked ones only, so much of the ratio is work
   not done.
2. Open-QA forward of one question: embed it, retrieve the top reader_beam blocks from a
   block_emb of N blocks, read them, pick the best span. A random RealmForOpenQA checkpoint of
   the same BERT is written by transformers and imported with `realm-import-hf` (so both sides
   hold the same weights and blocks); ours is `hf_realm_openqa.openqa_forward`, the peer
   `RealmForOpenQA.forward` (its RealmRetriever tokenises the question and the blocks). Prints
   the median latency of each over `--questions` questions after warm-up (one side after
   the other), and on how many questions the two predict the same answer.

Both use N threads: torch.set_num_threads(N) and XLA's CPU intra-op threads (set in XLA_FLAGS
before jax is imported). Defaults: BERT hidden 256, 4 layers, 4 heads, intermediate 1024,
vocab 30522; B 2, k 8, L 128, M 10; 10,000 blocks, top 5, reader length 320.

  python bench/peer_hf.py [--threads 2] [--steps 8] [--warmup 2] [--questions 10] [--out F]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

from realm_jax.errors import CommandParser   # (no jax: XLA_FLAGS is set below, before it)
from report import positive_int   # bench/ is this script's directory: sys.path[0]


def parse_args(argv):
  p = CommandParser(description=__doc__.split("\n")[0])
  p.add_argument("--threads", type=positive_int, default=2, help="threads of both frameworks")
  p.add_argument("--hidden", type=int, default=256)
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--intermediate", type=int, default=1024)
  p.add_argument("--vocab", type=int, default=30522)
  p.add_argument("--batch", type=int, default=2, help="queries per step")
  p.add_argument("--k", type=int, default=8, help="candidates per query")
  p.add_argument("--length", type=int, default=128, help="reader tokens per candidate")
  p.add_argument("--masks", type=int, default=10, help="masks per query")
  p.add_argument("--dropout", type=float, default=0.1)
  p.add_argument("--warmup", type=int, default=2, help="untimed steps (ours: + compile)")
  p.add_argument("--steps", type=positive_int, default=8, help="timed steps (>= 1)")
  p.add_argument("--blocks", type=int, default=10_000, help="Open-QA: blocks in block_emb")
  p.add_argument("--questions", type=positive_int, default=10,
                 help="Open-QA: timed questions (>= 1)")
  p.add_argument("--only", choices=("step", "openqa"), default=None)
  p.add_argument("--out", default=None, help="append the JSON record here")
  return p.parse_args(argv)


ARGS = parse_args(sys.argv[1:])
# Before jax is imported: XLA's CPU thread pool of the same size as torch's.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=true"
                           f" intra_op_parallelism_threads={ARGS.threads}").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from realm_jax.interop import hf_parity, hf_realm, hf_realm_openqa  # noqa: E402
from realm_jax.models import losses  # noqa: E402
from realm_jax.models.bert import BertConfig  # noqa: E402
from realm_jax.models.realm import REALM  # noqa: E402
from report import append_jsonl  # noqa: E402  (bench/ is this script's directory: sys.path[0])
from train_step import encoder_flops  # noqa: E402
from realm_jax.runtime import state as state_lib  # noqa: E402
from realm_jax.config.defaults import base_config  # noqa: E402
from realm_jax.config.reading import frozen_paths  # noqa: E402


def log(msg: str) -> None:
  print(f"[peer] {msg}", flush=True)


def reader_batch(args, rng):
  """`[CLS] query [SEP] block [SEP]` rows (query 1/4 of L), masks in the query part."""
  b, k, length, m = args.batch, args.k, args.length, args.masks
  q = length // 4
  ids = rng.integers(5, args.vocab, (b, k, length)).astype(np.int64)
  ids[..., 0], ids[..., q - 1], ids[..., -1] = 2, 3, 3
  types = np.broadcast_to(np.arange(length) >= q, (b, k, length)).astype(np.int64)
  positions = np.stack([np.sort(rng.choice(np.arange(1, q - 1), m, replace=False))
                        for _ in range(b)])
  labels = rng.integers(5, args.vocab, (b, m))
  for i in range(b):
    ids[i][:, positions[i]] = 4                                         # [MASK]
  relevance = rng.normal(0, 1, (b, k)).astype(np.float32)
  return ids, types, positions, labels, relevance


def our_step(args, batch):
  """Our jitted reader step; returns (fn, state) with fn(state, rng) -> (state, loss)."""
  ids, types, positions, labels, relevance = batch
  b, k, length = ids.shape
  config = base_config()
  config.train.lr, config.train.warmup_steps, config.train.steps = 1e-4, 0, 1000
  cfg = BertConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                   num_heads=args.heads, intermediate_size=args.intermediate,
                   max_position=max(512, length), dropout_rate=args.dropout)
  model = REALM(cfg, retrieval_dim=128)
  flat_pos = np.repeat(positions, k, axis=0).astype(np.int32)
  inputs = dict(reader_ids=jnp.asarray(ids.reshape(b * k, length), jnp.int32),
                reader_segments=jnp.asarray(types.reshape(b * k, length), jnp.int32),
                mask_positions=jnp.asarray(flat_pos))
  import flax.linen as nn
  ones = jnp.ones((1, 8), jnp.int32)
  params = nn.meta.unbox(model.init(jax.random.PRNGKey(0), ones, ones, ones * 0, ones, ones * 0,
                                    jnp.zeros((1, 1), jnp.int32))["params"])
  reader = {"reader": params["reader"]}      # the step trains the reader, as HF's does
  tx = state_lib.make_optimizer(config.train, frozen_paths(config))
  flat_labels = jnp.asarray(np.repeat(labels, k, axis=0), jnp.int32)   # rows as flat_pos
  weights = jnp.ones(labels.shape, jnp.float32)
  relevance_j = jnp.asarray(relevance)

  def loss_fn(p, rng):
    mask_lp = model.apply({"params": p}, inputs["reader_ids"], inputs["reader_segments"],
                          inputs["mask_positions"], flat_labels, args.dropout == 0,
                          rngs={"dropout": rng}, method=REALM.read_labels
                          ).reshape(b, k, labels.shape[1])
    return losses.realm_loss(relevance_j, mask_lp, weights, "per_mask")[0]

  def step(state, rng):
    p, opt = state
    loss, grads = jax.value_and_grad(loss_fn)(p, rng)
    updates, opt = tx.update(grads, opt, p)
    return (optax.apply_updates(p, updates), opt), loss

  n_params = sum(x.size for x in jax.tree_util.tree_leaves(reader))
  return jax.jit(step, donate_argnums=(0,)), (reader, tx.init(reader)), n_params


def peer_step(args, batch):
  ids, types, positions, labels, relevance = batch
  b, k, length = ids.shape
  config = transformers.RealmConfig(
      vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
      num_attention_heads=args.heads, intermediate_size=args.intermediate, hidden_act="gelu",
      hidden_dropout_prob=args.dropout, attention_probs_dropout_prob=args.dropout,
      num_candidates=k, max_position_embeddings=max(512, length), pad_token_id=0)
  model = transformers.RealmKnowledgeAugEncoder(config).train()
  no_decay = [p for n, p in model.named_parameters() if "LayerNorm" in n or n.endswith("bias")]
  decay = [p for n, p in model.named_parameters() if not ("LayerNorm" in n or n.endswith("bias"))]
  opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                           {"params": no_decay, "weight_decay": 0.0}], lr=1e-4, eps=1e-6)
  full_labels = np.full((b, length), -100, np.int64)
  np.put_along_axis(full_labels, positions, labels, axis=1)
  t = dict(input_ids=torch.tensor(ids), attention_mask=torch.ones(ids.shape, dtype=torch.long),
           token_type_ids=torch.tensor(types), relevance_score=torch.tensor(relevance),
           labels=torch.tensor(full_labels), mlm_mask=torch.tensor(full_labels != -100))

  def step():
    opt.zero_grad(set_to_none=True)
    loss = model(**t).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss.item()
  return step, sum(p.numel() for p in model.parameters())


def timed(fn, warmup: int, steps: int, name: str) -> list[float]:
  times = []
  for i in range(warmup + steps):
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    if i >= warmup:
      times.append(dt)
    log(f"{name} {'warm-up' if i < warmup else 'step'} {i + 1}: {dt * 1e3:.0f} ms")
  return times


def step_flops(args, positions_read: int) -> float:
  """3 x the forward matmul FLOPs of a step: the encoder over B*k sequences of L tokens whose
  last layer computes `positions_read` positions of each, and the MLM head (transform +
  vocabulary projection) at those positions."""
  d, sequences = args.hidden, args.batch * args.k
  encoder = encoder_flops(d, args.intermediate, args.layers, sequences, args.length,
                          positions_read)
  head = sequences * positions_read * 2 * (d * d + d * args.vocab)
  return 3.0 * (encoder + head)


def bench_step(args) -> dict:
  batch = reader_batch(args, np.random.default_rng(0))
  seqs = args.batch * args.k
  fn, state, n_ours = our_step(args, batch)
  box = {"state": state, "rng": jax.random.PRNGKey(1)}

  def run_ours():
    box["rng"], rng = jax.random.split(box["rng"])
    box["state"], loss = fn(box["state"], rng)
    jax.block_until_ready(loss)
  t0 = time.perf_counter()
  run_ours()
  log(f"ours: {n_ours / 1e6:.1f}M reader params, first step (compile) "
      f"{time.perf_counter() - t0:.1f}s")
  ours = timed(run_ours, max(args.warmup - 1, 0), args.steps, "ours")
  box.clear()      # our state freed before the peer runs
  step, n_peer = peer_step(args, batch)
  log(f"peer: {n_peer / 1e6:.1f}M params")
  peer = timed(step, args.warmup, args.steps, "peer")
  o, p = statistics.median(ours), statistics.median(peer)
  ours_flops = step_flops(args, args.masks)     # the last layer and head at the masks
  peer_flops = step_flops(args, args.length)    # HF's: every position
  return {"ours_step_s": o, "peer_step_s": p, "ours_seq_per_s": seqs / o,
          "peer_seq_per_s": seqs / p, "ratio": p / o, "sequences_per_step": seqs,
          "ours_flops": ours_flops, "peer_flops": peer_flops,
          "ours_flops_per_s": ours_flops / o, "peer_flops_per_s": peer_flops / p,
          "ours_step_s_all": ours, "peer_step_s_all": peer}


def _answer_each(questions: list[str], warmup: int, **runs) -> tuple[dict, dict]:
  """Each side's seconds and answers per question after `warmup` questions. One side after
  the other: torch's idle OpenMP threads spin for a while after each call and would slow down
  whatever runs next."""
  lat, answers = {}, {}
  for name, run in runs.items():
    lat[name], answers[name] = [], []
    for i, question in enumerate(questions):
      t0 = time.perf_counter()
      out = run(question)
      dt = time.perf_counter() - t0
      if i >= warmup:
        lat[name].append(dt)
        answers[name].append(out.answer_ids.tolist() if name == "ours"
                             else out.predicted_answer_ids.tolist())
      log(f"{name} question {i + 1}{' (warm-up)' if i < warmup else ''}: {dt * 1e3:.0f} ms")
  return lat, answers


def bench_openqa(args) -> dict:
  from realm_jax.data.prepared import BlockStore
  from realm_jax.data.tokenizer import load_tokenizer
  from realm_jax.retrieval import published
  from realm_jax.retrieval.index import ExactIndex
  from realm_jax.runtime.checkpoints import restore_run
  sizes = dict(hidden_size=args.hidden, num_hidden_layers=args.layers,
               num_attention_heads=args.heads, intermediate_size=args.intermediate,
               max_position_embeddings=512, reader_seq_len=320, reader_beam_size=5,
               retriever_proj_size=128, span_hidden_size=256, max_span_width=10,
               reader_layer_norm_eps=1e-3, num_candidates=8)
  with tempfile.TemporaryDirectory(prefix="realm_peer_") as tmp:
    hf_dir, work = os.path.join(tmp, "hf"), os.path.join(tmp, "w2")
    t0 = time.perf_counter()
    hf_parity.make_random_checkpoint(hf_dir, "RealmForOpenQA", num_words=args.vocab - 100,
                                     num_records=args.blocks, record_words=(20, 260), **sizes)
    log(f"random RealmForOpenQA ({args.blocks:,} blocks) written in "
        f"{time.perf_counter() - t0:.1f}s")
    t0 = time.perf_counter()
    report = hf_realm.import_checkpoint(hf_dir, work)
    log(f"imported in {time.perf_counter() - t0:.1f}s: {report.lines()[-3:]}")
    run = restore_run(work, mesh_shape=(-1, 1))
    config, model, params = run.config, run.model, run.params
    tokenizer = load_tokenizer(os.path.join(work, "data", "vocab.txt"))
    blocks = BlockStore(os.path.join(work, "data"))
    index_root = published.index_root(work)
    version = report.index["version"]
    block_emb = published.read_embeddings(index_root, version,
                                          published.read_manifest(index_root, version))
    index = ExactIndex.from_embeddings(block_emb)
    os.environ.setdefault("TRUST_REMOTE_CODE", "True")
    retriever = transformers.RealmRetriever.from_pretrained(hf_dir)
    peer = transformers.RealmForOpenQA.from_pretrained(hf_dir, retriever=retriever).eval()
    words = [w for w in tokenizer.wordpiece.get_vocab() if w.isalpha()]
    rng = np.random.default_rng(0)
    questions = [" ".join(rng.choice(words, 8)) for _ in range(args.questions + args.warmup)]

    def run_ours(question):
      ids = np.asarray(tokenizer.encode_batch([question])[0][0], np.int32)
      return hf_realm_openqa.openqa_forward(
          model, params, ids, index=index, block_emb=block_emb, blocks=blocks,
          cls_id=tokenizer.cls_id, sep_id=tokenizer.sep_id, reader_beam=config.qa.reader_beam,
          reader_len=320, query_len=config.data.query_len)

    def run_peer(question):
      with torch.no_grad():
        return peer(**retriever.tokenizer([question], return_tensors="pt"), return_dict=True)

    lat, answers = _answer_each(questions, args.warmup, ours=run_ours, peer=run_peer)
    agree = sum(a == b for a, b in zip(answers["ours"], answers["peer"]))
  o, p = statistics.median(lat["ours"]), statistics.median(lat["peer"])
  return {"openqa_blocks": args.blocks, "ours_openqa_s": o, "peer_openqa_s": p,
          "openqa_ratio": p / o, "openqa_same_answer": agree, "openqa_questions": args.questions,
          "ours_openqa_s_all": lat["ours"], "peer_openqa_s_all": lat["peer"]}


def main() -> None:
  args = ARGS
  torch.set_num_threads(args.threads)
  torch.manual_seed(0)
  log(f"jax {jax.__version__} ({jax.default_backend()}), torch {torch.__version__}, "
      f"transformers {transformers.__version__}; {args.threads} threads each; BERT "
      f"{args.layers} x {args.hidden} (heads {args.heads}, ff {args.intermediate}), vocab "
      f"{args.vocab}, fp32, dropout {args.dropout}")
  record = {"bench": "peer_hf", "threads": args.threads, "hidden": args.hidden,
            "layers": args.layers, "vocab": args.vocab, "batch": args.batch, "k": args.k,
            "length": args.length, "masks": args.masks, "dropout": args.dropout}
  if args.only in (None, "step"):
    record.update(bench_step(args))
    print(f"\nknowledge-augmented encoder step ({args.batch} x {args.k} x {args.length}, "
          f"{args.masks} masks): ours {record['ours_step_s'] * 1e3:.0f} ms = "
          f"{record['ours_seq_per_s']:.1f} seq/s | peer {record['peer_step_s'] * 1e3:.0f} ms = "
          f"{record['peer_seq_per_s']:.1f} seq/s | ours / peer = {record['ratio']:.2f}x\n"
          f"  matmul FLOPs/step (3 x fwd): ours {record['ours_flops'] / 1e9:.1f} G at "
          f"{record['ours_flops_per_s'] / 1e9:.0f} GFLOP/s | peer {record['peer_flops'] / 1e9:.1f}"
          f" G at {record['peer_flops_per_s'] / 1e9:.0f} GFLOP/s (vocabulary projection at "
          f"{args.masks} masks per query vs all {args.length} positions)", flush=True)
  if args.only in (None, "openqa"):
    record.update(bench_openqa(args))
    print(f"\nOpen-QA forward (1 question, {args.blocks:,} blocks, top 5, reader 320): ours "
          f"{record['ours_openqa_s'] * 1e3:.0f} ms | peer {record['peer_openqa_s'] * 1e3:.0f} "
          f"ms | peer / ours = {record['openqa_ratio']:.2f}x | same answer "
          f"{record['openqa_same_answer']}/{record['openqa_questions']}", flush=True)
  print(json.dumps(record), flush=True)
  append_jsonl(args.out, record)


if __name__ == "__main__":
  main()
