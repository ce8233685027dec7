"""fbgemm_gpu's Python names that torchrec programs use directly, at fbgemm's module paths.

In the run-as-torchrec mode (``shardkit run / launch --as-torchrec``, shardkit.cli.torchrec_mode)
``fbgemm_gpu.X`` is this package's ``X``:

- ``split_embedding_configs``: ``EmbOptimType`` (shardkit's ``OptimType``: ``EXACT_SGD`` /
  ``EXACT_ADAGRAD`` / ``EXACT_ROWWISE_ADAGRAD`` are its aliases), ``SparseType``;
- ``split_table_batched_embeddings_ops_common`` (also ``..._training`` and the older
  ``split_table_batched_embeddings_ops``): ``PoolingMode``, ``BoundsCheckMode``, ``CacheAlgorithm``
  (shardkit's, from ``shardkit.sharding.cache_params``);
- ``ops``: ``jagged_2d_to_dense``, ``dense_to_jagged``, ``asynchronous_complete_cumsum`` (and the
  inclusive / exclusive cumsums) as functions; the mode registers them as ``torch.ops.fbgemm.*``
  when a program imports ``torchrec`` or ``fbgemm_gpu``, and only then.

Importing this package registers nothing and loads no native library (shardkit has no fbgemm).
"""
