"""The generated knowledge world as a prepared data dir: `realm-prepare` with `world:ENTITIES`.

Sentences about held-out entities become `eval` examples only (their blocks are in the corpus,
their facts never in a training query); the rest are `train` examples. QA pairs go to
`qa/{train,eval}.jsonl` for Open-QA.
"""

from __future__ import annotations

from realm_jax.data.prepare import prepare, prepare_config


def prepare_world(out_dir: str, num_entities: int, seed: int = 0, *, block_len: int = 64,
                  max_sentence_len: int = 38, vocab_size: int = 4000, vocab_path: str = "",
                  num_workers: int = 0) -> dict:
  """Generates the world and writes it as a prepared data dir; returns its stats.

  Args:
    out_dir: the data dir to write.
    num_entities: entities in the world (about 4 blocks each).
    seed: world seed (different seeds, different worlds).
    block_len: wordpieces per block, `[CLS] title [SEP] body [SEP]` included.
    max_sentence_len: longest query sentence kept (query_len - 2).
    vocab_size: size of the WordPiece vocab trained on the world (when no vocab_path).
    vocab_path: an existing vocab.txt / HF tokenizer dir to use instead of training one.
    num_workers: packing processes (0: this process).
  """
  config = prepare_config()
  config.source = f"world:{num_entities}"
  config.world_seed = seed
  config.out_dir = out_dir
  config.block_len = block_len
  config.max_sentence_len = max_sentence_len
  config.vocab_size = vocab_size
  config.vocab = vocab_path
  config.num_workers = num_workers
  return prepare(config)
