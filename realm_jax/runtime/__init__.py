"""What the trainer (`train/`), the index builder and zero-shot retrieval (`retrieval/`) and the
evaluators share, below all of them: the mesh and sharding rules, processes of a multi-host job,
the train state and its checkpoints, where each part's parameters start, the block and query
embedders, metrics files and preemption. It imports neither `train/` nor `retrieval/`."""
