"""torchrec's module tree in shardkit (docs/names.md, "torchrec's module tree").

Every module path of torchrec that shardkit covers and that torchrec's examples, tutorials, tests or the
specification import from has a shardkit module whose path differs only in the top-level name
(``torchrec.distributed.embeddingbag`` -> ``shardkit.distributed.embeddingbag``), holding the names
torchrec holds there. The lists below are
written out here (the specification's qualified names plus the examples' imports), not read from
shardkit: a path or name that stops resolving fails the test.
"""

from __future__ import annotations

import importlib

import pytest

# torchrec module -> the names torchrec holds there that shardkit has (space separated)
TREE = {
    "torchrec": (
        "DataType DistributedModelParallel EmbeddingBagCollection EmbeddingBagConfig EmbeddingCollection "
        "EmbeddingConfig JaggedTensor KeyedJaggedTensor KeyedTensor PoolingType"
    ),
    "torchrec.datasets.criteo": (
        "BinaryCriteoUtils CAT_FEATURE_COUNT CriteoIterDataPipe DAYS DEFAULT_CAT_NAMES DEFAULT_INT_NAMES "
        "DEFAULT_LABEL_NAME INT_FEATURE_COUNT InMemoryBinaryCriteoIterDataPipe criteo_kaggle "
        "criteo_terabyte"
    ),
    "torchrec.datasets.random": "RandomRecDataset",
    "torchrec.datasets.utils": (
        "Batch Limit LoadFiles PATH_MANAGER_KEY ParallelReadConcat ReadLinesFromCSV idx_split_train_val "
        "rand_split_train_val safe_cast train_filter val_filter"
    ),
    "torchrec.distributed": (
        "Awaitable ComputeKernel DistributedModelParallel EmbeddingBagCollectionSharder "
        "EmbeddingModuleShardingPlan LazyAwaitable ModuleSharder ModuleShardingPlan NoWait "
        "ParameterSharding ShardedModule ShardingEnv ShardingPlan ShardingPlanner ShardingType "
        "TrainPipeline TrainPipelineBase TrainPipelineSparseDist get_group_rank get_local_rank "
        "get_local_size get_num_groups get_unsharded_module_names intra_and_cross_node_pg"
    ),
    "torchrec.distributed.collective_utils": "invoke_on_rank_and_broadcast_result is_leader run_on_leader",
    "torchrec.distributed.comm": (
        "get_group_rank get_local_rank get_local_size get_num_groups intra_and_cross_node_pg"
    ),
    "torchrec.distributed.comm_ops": (
        "All2AllPooledInfo All2AllSequenceInfo All2AllVInfo AllGatherBaseInfo ReduceScatterBaseInfo "
        "ReduceScatterInfo ReduceScatterVInfo Request VariableBatchAll2AllPooledInfo "
        "all_gather_base_pooled alltoall_pooled alltoall_sequence alltoallv get_gradient_division "
        "reduce_scatter_base_pooled reduce_scatter_pooled reduce_scatter_v_per_feature_pooled "
        "reduce_scatter_v_pooled set_gradient_division variable_batch_alltoall_pooled"
    ),
    "torchrec.distributed.dist_data": (
        "EmbeddingsAllToOne EmbeddingsAllToOneReduce JaggedTensorAllToAll KJTAllToAll "
        "KJTAllToAllSplitsAwaitable KJTAllToAllTensorsAwaitable KJTOneToAll PooledEmbeddingsAllGather "
        "PooledEmbeddingsAllToAll PooledEmbeddingsAwaitable PooledEmbeddingsReduceScatter "
        "SeqEmbeddingsAllToOne SequenceEmbeddingsAllToAll SequenceEmbeddingsAwaitable "
        "VariableBatchPooledEmbeddingsAllToAll VariableBatchPooledEmbeddingsReduceScatter"
    ),
    "torchrec.distributed.embedding": (
        "EmbeddingCollectionAwaitable EmbeddingCollectionContext EmbeddingCollectionSharder "
        "ShardedEmbeddingCollection create_embedding_sharding create_sharding_infos_by_sharding "
        "get_ec_index_dedup set_ec_index_dedup"
    ),
    "torchrec.distributed.embedding_lookup": (
        "CommOpGradientScaling embeddings_cat_empty_rank_handle fx_wrap_tensor_view2d"
    ),
    "torchrec.distributed.embedding_sharding": (
        "BaseEmbeddingDist BaseSparseFeaturesDist EmbeddingSharding EmbeddingShardingContext "
        "EmbeddingShardingInfo KJTListAwaitable KJTListSplitsAwaitable ListOfKJTListAwaitable "
        "ListOfKJTListSplitsAwaitable bucketize_kjt_before_all2all group_tables"
    ),
    "torchrec.distributed.embedding_types": (
        "BaseEmbeddingLookup BaseEmbeddingSharder BaseGroupedFeatureProcessor BaseQuantEmbeddingSharder "
        "EmbeddingAttributes EmbeddingComputeKernel FeatureShardingMixIn GroupedEmbeddingConfig KJTList "
        "ListOfKJTList "
        "ModuleShardingMixIn OptimType ShardedConfig ShardedEmbeddingModule ShardedEmbeddingTable "
        "ShardedMetaConfig compute_kernel_to_embedding_location"
    ),
    "torchrec.distributed.embeddingbag": (
        "EmbeddingAwaitable EmbeddingBagCollectionAwaitable EmbeddingBagCollectionContext "
        "EmbeddingBagCollectionSharder "
        "EmbeddingBagSharder ShardedEmbeddingBag ShardedEmbeddingBagCollection construct_output_kt "
        "create_embedding_bag_sharding create_sharding_infos_by_sharding replace_placement_with_meta_device"
    ),
    "torchrec.distributed.fbgemm_qcomm_codec": (
        "CommType QCommsConfig get_qcomm_codecs get_qcomm_codecs_registry"
    ),
    "torchrec.distributed.fp_embeddingbag": (
        "FeatureProcessedEmbeddingBagCollectionSharder ShardedFeatureProcessedEmbeddingBagCollection"
    ),
    "torchrec.distributed.mc_embedding": (
        "ManagedCollisionEmbeddingCollectionContext ManagedCollisionEmbeddingCollectionSharder "
        "ShardedManagedCollisionEmbeddingCollection"
    ),
    "torchrec.distributed.mc_embeddingbag": (
        "ManagedCollisionEmbeddingBagCollectionContext ManagedCollisionEmbeddingBagCollectionSharder "
        "ShardedManagedCollisionEmbeddingBagCollection"
    ),
    "torchrec.distributed.mc_modules": (
        "ManagedCollisionCollectionAwaitable ManagedCollisionCollectionContext "
        "ManagedCollisionCollectionSharder ShardedManagedCollisionCollection create_mc_sharding"
    ),
    "torchrec.distributed.model_parallel": (
        "DataParallelWrapper DefaultDataParallelWrapper DistributedModelParallel get_module "
        "get_unwrapped_module"
    ),
    "torchrec.distributed.planner": "EmbeddingShardingPlanner ParameterConstraints Topology",
    "torchrec.distributed.planner.enumerators": "EmbeddingEnumerator",
    "torchrec.distributed.planner.partitioners": "GreedyPerfPartitioner",
    "torchrec.distributed.planner.planners": "EmbeddingShardingPlanner",
    "torchrec.distributed.planner.shard_estimators": "EmbeddingPerfEstimator EmbeddingStorageEstimator",
    "torchrec.distributed.planner.storage_reservations": "HeuristicalStorageReservation",
    "torchrec.distributed.planner.types": "ParameterConstraints PlannerError ShardingOption Topology",
    "torchrec.distributed.quant_embedding": "QuantEmbeddingCollectionSharder ShardedQuantEmbeddingCollection",
    "torchrec.distributed.quant_embeddingbag": (
        "QuantEmbeddingBagCollectionSharder QuantFeatureProcessedEmbeddingBagCollectionSharder "
        "ShardedQuantEmbeddingBagCollection ShardedQuantFeatureProcessedEmbeddingBagCollection "
        "create_infer_embedding_bag_sharding flatten_feature_lengths"
    ),
    "torchrec.distributed.sharding.cw_sequence_sharding": "CwSequenceEmbeddingSharding",
    "torchrec.distributed.sharding.cw_sharding": "CwPooledEmbeddingSharding",
    "torchrec.distributed.sharding.dp_sequence_sharding": "DpSequenceEmbeddingSharding",
    "torchrec.distributed.sharding.dp_sharding": "DpPooledEmbeddingSharding",
    "torchrec.distributed.sharding.grid_sharding": "GridPooledEmbeddingSharding",
    "torchrec.distributed.sharding.rw_sequence_sharding": "RwSequenceEmbeddingSharding",
    "torchrec.distributed.sharding.rw_sharding": "RwPooledEmbeddingSharding",
    "torchrec.distributed.sharding.sequence_sharding": "SequenceShardingContext",
    "torchrec.distributed.sharding.tw_sequence_sharding": "TwSequenceEmbeddingSharding",
    "torchrec.distributed.sharding.tw_sharding": "TwPooledEmbeddingSharding",
    "torchrec.distributed.sharding.twcw_sharding": "TwCwPooledEmbeddingSharding",
    "torchrec.distributed.sharding.twrw_sharding": "TwRwPooledEmbeddingSharding",
    "torchrec.distributed.sharding_plan": (
        "ParameterShardingGenerator apply_to_all column_wise construct_module_sharding_plan data_parallel "
        "get_default_sharders get_module_to_default_sharders grid_shard placement row_wise "
        "table_column_wise table_row_wise table_wise"
    ),
    "torchrec.distributed.train_pipeline": (
        "ArgInfo BaseForward PipelinedForward PrefetchPipelinedForward PrefetchTrainPipelineContext "
        "PrefetchTrainPipelineSparseDist Tracer TrainPipeline TrainPipelineBase TrainPipelineContext "
        "TrainPipelineSparseDist"
    ),
    "torchrec.distributed.train_pipeline.train_pipelines": (
        "PrefetchTrainPipelineSparseDist TrainPipeline TrainPipelineBase TrainPipelineSparseDist"
    ),
    "torchrec.distributed.train_pipeline.utils": (
        "ArgInfo BaseForward PipelinedForward PrefetchPipelinedForward PrefetchTrainPipelineContext "
        "Tracer TrainPipelineContext"
    ),
    "torchrec.distributed.types": (
        "Awaitable CacheAlgorithm CacheParams CacheStatistics CommOp ComputeKernel "
        "EmbeddingModuleShardingPlan EnumerableShardingSpec "
        "GetItemLazyAwaitable LazyAwaitable LazyGetItemMixin LazyNoWait ModuleSharder ModuleShardingPlan "
        "NoOpQuantizedCommCodec NoWait NullShardedModuleContext NullShardingContext ParameterSharding "
        "ParameterStorage QuantizedCommCodec QuantizedCommCodecs ShardMetadata ShardedModule ShardingEnv "
        "ShardingPlan ShardingPlanner ShardingType get_tensor_size_bytes"
    ),
    "torchrec.distributed.utils": (
        "CopyableMixin PermutePooledEmbeddings add_params_from_parameter_sharding "
        "add_prefix_to_state_dict append_prefix copy_to_device filter_state_dict "
        "get_unsharded_module_names init_parameters merge_fused_params none_throws "
        "optimizer_type_to_emb_opt_type "
        "sharded_model_copy"
    ),
    "torchrec.inference.modules": (
        "BatchingMetadata DEFAULT_QUANTIZATION_DTYPE DEFAULT_QUANTIZATION_MAPPING PredictFactory "
        "PredictModule QualNameMetadata quantize_embeddings quantize_inference_model shard_quant_model"
    ),
    "torchrec.inference.state_dict_transform": (
        "state_dict_all_gather_keys state_dict_gather state_dict_to_device"
    ),
    "torchrec.models.dlrm": "DLRM DLRMTrain DenseArch InteractionArch OverArch SparseArch",
    "torchrec.modules.activation": "SwishLayerNorm",
    "torchrec.modules.embedding_configs": (
        "BaseEmbeddingConfig DataType EmbeddingBagConfig EmbeddingConfig EmbeddingTableConfig PoolingType"
    ),
    "torchrec.modules.embedding_modules": "EmbeddingBagCollection EmbeddingCollection",
    "torchrec.modules.feature_processor": (
        "BaseFeatureProcessor BaseGroupedFeatureProcessor PositionWeightedModule PositionWeightedProcessor"
    ),
    "torchrec.modules.feature_processor_": (
        "FeatureProcessor FeatureProcessorsCollection PositionWeightedModule PositionWeightedModuleCollection"
    ),
    "torchrec.modules.fp_embedding_modules": "FeatureProcessedEmbeddingBagCollection",
    "torchrec.modules.mc_embedding_modules": (
        "BaseManagedCollisionEmbeddingCollection ManagedCollisionEmbeddingBagCollection "
        "ManagedCollisionEmbeddingCollection"
    ),
    "torchrec.modules.mc_modules": (
        "DistanceLFU_EvictionPolicy LFU_EvictionPolicy LRU_EvictionPolicy MCHEvictionPolicy "
        "MCHEvictionPolicyMetadataInfo MCHManagedCollisionModule ManagedCollisionCollection "
        "ManagedCollisionModule average_threshold_filter dynamic_threshold_filter"
    ),
    "torchrec.modules.mlp": "MLP Perceptron",
    "torchrec.modules.regroup": "KTRegroupAsDict",
    "torchrec.optim": (
        "CombinedOptimizer GradientClipping GradientClippingOptimizer KeyedOptimizer "
        "KeyedOptimizerWrapper OptimizerWrapper RowWiseAdagrad WarmupOptimizer WarmupPolicy WarmupStage"
    ),
    "torchrec.optim.apply_optimizer_in_backward": "apply_optimizer_in_backward",
    "torchrec.optim.clipping": "GradientClipping GradientClippingOptimizer",
    "torchrec.optim.keyed": "CombinedOptimizer KeyedOptimizer KeyedOptimizerWrapper OptimizerWrapper",
    "torchrec.optim.optimizers": "in_backward_optimizer_filter",
    "torchrec.optim.rowwise_adagrad": "RowWiseAdagrad",
    "torchrec.optim.warmup": "WarmupOptimizer WarmupPolicy WarmupStage",
    "torchrec.quant.embedding_modules": (
        "EmbeddingBagCollection EmbeddingCollection FeatureProcessedEmbeddingBagCollection QuantConfig"
    ),
    "torchrec.sparse": "JaggedTensor KeyedJaggedTensor KeyedTensor",
    "torchrec.sparse.jagged_tensor": (
        "ComputeJTDictToKJT ComputeKJTToJTDict JaggedTensor KeyedJaggedTensor KeyedTensor jt_is_equal "
        "kjt_is_equal permute_multi_embedding regroup_kts"
    ),
    "torchrec.streamable": "Multistreamable",
    "torchrec.types": "DataType",
}

# torchrec's names that shardkit lacks: importing one is an ImportError naming it and docs/names.md.
# A name that starts to resolve must move to TREE (the test below says so).
ABSENT = {
    "torchrec.distributed.comm_ops": (
        "All2AllDenseInfo All2All_Pooled_Req All2All_Pooled_Wait All2All_Seq_Req All2All_Seq_Req_Wait "
        "All2Allv_Req All2Allv_Wait AllGatherBase_Req AllGatherBase_Wait ReduceScatterBase_Req "
        "ReduceScatterBase_Wait ReduceScatterV_Req ReduceScatterV_Wait ReduceScatter_Req "
        "ReduceScatter_Wait Variable_Batch_All2All_Pooled_Req Variable_Batch_All2All_Pooled_Wait"
    ),
    "torchrec.distributed.dist_data": "SplitsAllToAllAwaitable",
    "torchrec.distributed.embedding_lookup": (
        "GroupedEmbeddingsLookup GroupedPooledEmbeddingsLookup InferGroupedEmbeddingsLookup "
        "InferGroupedLookupMixin InferGroupedPooledEmbeddingsLookup MetaInferGroupedEmbeddingsLookup "
        "MetaInferGroupedPooledEmbeddingsLookup"
    ),
    "torchrec.distributed.embedding_sharding": "FusedKJTListSplitsAwaitable KJTSplitsAllToAllMeta",
    "torchrec.distributed.embeddingbag": "VariableBatchEmbeddingBagCollectionAwaitable",
    "torchrec.distributed.grouped_position_weighted": "GroupedPositionWeightedModule",
    "torchrec.distributed.planner.proposers": "GreedyProposer GridSearchProposer UniformProposer",
    "torchrec.distributed.planner.types": (
        "Enumerator Partitioner Perf Proposer Shard ShardEstimator Storage StorageReservation"
    ),
    "torchrec.distributed.shard": "shard shard_modules",
    "torchrec.distributed.sharding.cw_sharding": "BaseCwEmbeddingSharding",
    "torchrec.distributed.sharding.dp_sharding": (
        "BaseDpEmbeddingSharding DpPooledEmbeddingDist DpSparseFeaturesDist"
    ),
    "torchrec.distributed.sharding.rw_sharding": (
        "BaseRwEmbeddingSharding RwPooledEmbeddingDist RwSparseFeaturesDist"
    ),
    "torchrec.distributed.sharding.tw_sharding": (
        "BaseTwEmbeddingSharding TwPooledEmbeddingDist TwSparseFeaturesDist"
    ),
    "torchrec.distributed.sharding.twrw_sharding": (
        "BaseTwRwEmbeddingSharding TwRwPooledEmbeddingDist TwRwSparseFeaturesDist"
    ),
    "torchrec.distributed.train_pipeline": (
        "FusedKJTListSplitsAwaitable KJTAllToAllForward KJTSplitsAllToAllMeta SplitsAllToAllAwaitable"
    ),
    "torchrec.distributed.types": "GenericMeta ShardingEnv2D scope",
    "torchrec.distributed.utils": "convert_to_fbgemm_types",
    "torchrec.streamable": "Pipelineable",
}


def _shardkit_path(torchrec_module: str) -> str:
    return "shardkit" + torchrec_module[len("torchrec") :]


@pytest.mark.parametrize("torchrec_module", sorted(TREE))
def test_torchrec_module_path_holds_torchrecs_names(torchrec_module):
    module = importlib.import_module(_shardkit_path(torchrec_module))
    missing = [name for name in TREE[torchrec_module].split() if not hasattr(module, name)]
    assert not missing, f"{module.__name__} lacks torchrec's {missing}"
    # ``from <path> import <name>`` is how torchrec programs reach them
    for name in TREE[torchrec_module].split():
        namespace: dict = {}
        exec(f"from {module.__name__} import {name}", namespace)
        assert namespace[name] is getattr(module, name)


@pytest.mark.parametrize("torchrec_module", sorted(ABSENT))
def test_missing_torchrec_name_is_a_clear_import_error(torchrec_module):
    path = _shardkit_path(torchrec_module)
    importlib.import_module(path)
    for name in ABSENT[torchrec_module].split():
        with pytest.raises(ImportError) as raised:
            exec(f"from {path} import {name}", {})
        message = str(raised.value)
        assert f"{path}.{name}" in message and "docs/names.md" in message, (
            f"{path}.{name}: {message!r} (if it now resolves, move it from ABSENT to TREE)"
        )


def test_a_name_torchrec_does_not_have_there_stays_an_attribute_error():
    module = importlib.import_module("shardkit.distributed.embedding")
    assert not hasattr(module, "NotATorchrecName")
    with pytest.raises(ImportError, match="cannot import name 'NotATorchrecName'"):
        exec("from shardkit.distributed.embedding import NotATorchrecName", {})


def test_torchrec_paths_give_shardkits_objects_not_lookalikes():
    """A name resolving to the wrong object would be worse than a missing one."""
    import shardkit.modules as modules
    import shardkit.planner as planner
    import shardkit.quant as quant
    import shardkit.sharding as sharding
    from shardkit.distributed import embeddingbag, types
    from shardkit.distributed.planner import types as planner_types
    from shardkit.modules import mc_modules
    from shardkit.quant import embedding_modules as quant_modules
    from shardkit.sparse import jagged_tensor

    # torchrec.quant.embedding_modules.EmbeddingBagCollection is the quantized collection
    assert quant_modules.EmbeddingBagCollection is quant.QuantEmbeddingBagCollection
    assert quant_modules.EmbeddingCollection is quant.QuantEmbeddingCollection
    assert (
        quant_modules.FeatureProcessedEmbeddingBagCollection
        is quant.QuantFeatureProcessedEmbeddingBagCollection
    )
    assert jagged_tensor.KeyedJaggedTensor is importlib.import_module("shardkit.sparse").KeyedJaggedTensor
    assert planner_types.ParameterConstraints is planner.ParameterConstraints
    assert importlib.import_module("shardkit.planner.types").Topology is planner.Topology
    assert mc_modules.ManagedCollisionCollection is modules.ManagedCollisionCollection
    assert mc_modules.DistanceLFU_EvictionPolicy is modules.DistanceLFU_EvictionPolicy
    assert embeddingbag.EmbeddingBagCollectionSharder is sharding.EmbeddingBagCollectionSharder
    assert types.ShardingType is sharding.ShardingType
