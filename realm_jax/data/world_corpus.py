"""The generated knowledge world as a prepared data dir (vocab, blocks, train/eval examples).

Sentences about held-out entities become `eval` examples only (their blocks are in the corpus,
their facts never in a training query); the rest are `train` examples. QA pairs go to
`qa/{train,eval}.jsonl` for Open-QA.

  python -m realm_jax.data.world_corpus --out runs/demo/data --entities 600 --seed 0
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Iterator

from realm_jax.data.corpus import SourceDocument, SourceSentence, build_corpus
from realm_jax.data.tokenizer import load_tokenizer, train_tokenizer
from realm_jax.data.world import World, generate_world


def world_documents(world: World) -> Iterator[SourceDocument]:
  for doc in world.documents:
    split = "eval" if world.entities[doc.entity].held_out else "train"
    yield SourceDocument(doc.title, tuple(
        SourceSentence(s.text, split, s.facts, s.value_spans) for s in doc.sentences))


def prepare_world(out_dir: str, num_entities: int, seed: int = 0, *, block_len: int = 64,
                  max_sentence_len: int = 38, vocab_size: int = 4000,
                  vocab_path: str = "") -> dict:
  """Generates the world and writes it as a prepared data dir; returns its stats.

  Args:
    out_dir: the data dir to write.
    num_entities: entities in the world (about 4 blocks each).
    seed: world seed (different seeds, different worlds).
    block_len: wordpieces per block, `[CLS] title [SEP] body [SEP]` included.
    max_sentence_len: longest query sentence kept (query_len - 2).
    vocab_size: size of the WordPiece vocab trained on the world (when no vocab_path).
    vocab_path: an existing vocab.txt / HF tokenizer dir to use instead of training one.
  """
  t0 = time.time()
  if block_len < 8:
    raise ValueError(f"block_len {block_len} < 8")
  world = generate_world(num_entities, seed)
  os.makedirs(out_dir, exist_ok=True)
  if vocab_path:
    tokenizer = load_tokenizer(vocab_path)
    tokenizer.wordpiece.save_model(out_dir)
  else:
    texts = [d.title for d in world.documents] + [
        s.text for d in world.documents for s in d.sentences]
    tokenizer = train_tokenizer(texts, out_dir, vocab_size)
  stats = build_corpus(world_documents(world), tokenizer, out_dir, block_len=block_len,
                       max_sentence_len=max_sentence_len)
  os.makedirs(os.path.join(out_dir, "qa"), exist_ok=True)
  for split in ("train", "eval"):
    with open(os.path.join(out_dir, "qa", f"{split}.jsonl"), "w") as f:
      for qa in world.qa_pairs:
        if world.entities[qa.entity].held_out == (split == "eval"):
          f.write(json.dumps({"question": qa.question, "answer": [qa.answer]}) + "\n")
  stats.update(world_entities=num_entities, world_seed=seed,
               held_out_entities=sum(e.held_out for e in world.entities),
               seconds=round(time.time() - t0, 2))
  with open(os.path.join(out_dir, "stats.json"), "w") as f:
    json.dump(stats, f, indent=2)
  return stats


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True, help="data dir to write")
  parser.add_argument("--entities", type=int, default=600, help="entities in the world")
  parser.add_argument("--seed", type=int, default=0, help="world seed")
  parser.add_argument("--block_len", type=int, default=64, help="wordpieces per block")
  parser.add_argument("--vocab_size", type=int, default=4000, help="WordPiece vocab size")
  args = parser.parse_args()
  stats = prepare_world(args.out, args.entities, args.seed, block_len=args.block_len,
                        vocab_size=args.vocab_size)
  print(json.dumps(stats, indent=2))


if __name__ == "__main__":
  main()
