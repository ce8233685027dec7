"""Predict modules: requests batched into a KeyedJaggedTensor, one forward, results split back
(torchrec.inference.modules' ``PredictModule``).

- :class:`PredictModule`: torchrec's interface. A subclass implements ``predict_forward(batch)``,
  ``batch`` a dict of tensors (torchrec's names: ``"float_features"`` ``[B, dense_in]``,
  ``"id_list_features.lengths"`` ``[F * B]`` feature-major, ``"id_list_features.values"``);
  ``forward(batch)`` runs it under ``torch.inference_mode`` (on the module's CUDA device if it has one).
- :class:`RequestBatcher`: checks each :class:`Request` (one sample: its ids per feature, its dense
  features) against the model's features and table sizes, and batches the good ones.
- :meth:`PredictModule.answer`: a list of requests -> one :class:`Answer` per request, in order: the
  result for a good request (its row of the batch's results), an error message for a bad one (unknown
  feature, id out of range, ids that are not integers, wrong dense features). A bad request never
  stops the others; the forward runs even when no request is good (a zero-sample batch), so that the
  ranks of a sharded model keep calling forward together.
- :class:`DLRMPredictModule`: the above for ``shardkit.models.DLRM`` (or its quantized / sharded form).
"""

from __future__ import annotations

import abc
import dataclasses
import json
import numbers
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from shardkit.sparse import KeyedJaggedTensor, KeyedTensor

Ids = Union[torch.Tensor, Sequence[int]]
FLOAT_FEATURES = "float_features"
LENGTHS = "id_list_features.lengths"
VALUES = "id_list_features.values"


@dataclasses.dataclass
class Request:
    """One sample: ``sparse`` feature -> its ids (a 1-D integer tensor or a list of ints; a feature left
    out is an empty bag), ``dense`` its dense features (``[dense_in]`` floats) when the model has some."""

    sparse: Mapping[str, Ids]
    dense: Optional[Union[torch.Tensor, Sequence[float]]] = None


@dataclasses.dataclass
class Answer:
    """The result for one request, or why it was refused (exactly one of the two is set)."""

    result: Any = None
    error: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.error is None


class RequestBatcher:
    """Checks requests and batches the good ones into torchrec's batch dict.

    Args:
        feature_rows: feature name -> the number of rows of its table (ids must lie in ``[0, rows)``),
            in the order of the batch's keys.
        dense_in_features: the width of the dense features, or None when the model takes none.
    """

    def __init__(self, feature_rows: Mapping[str, int], dense_in_features: Optional[int] = None) -> None:
        self.feature_rows = dict(feature_rows)
        self.keys = list(self.feature_rows)
        self.dense_in_features = dense_in_features

    def _ids(self, feature: str, ids: Ids) -> torch.Tensor:
        if isinstance(ids, torch.Tensor):
            if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
                raise ValueError(f"feature {feature!r}: ids must be integers, got a {ids.dtype} tensor")
            if ids.dim() != 1:
                raise ValueError(f"feature {feature!r}: ids must be 1-D, got shape {list(ids.shape)}")
            tensor = ids.to(torch.int64)
        else:
            if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
                raise ValueError(f"feature {feature!r}: ids must be a list of ints, got {type(ids).__name__}")
            for value in ids:
                if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                    raise ValueError(f"feature {feature!r}: ids must be integers, got {value!r}")
            tensor = torch.tensor([int(v) for v in ids], dtype=torch.int64)
        rows = self.feature_rows[feature]
        bad = tensor[(tensor < 0) | (tensor >= rows)]
        if bad.numel():
            raise ValueError(f"feature {feature!r}: id {int(bad[0])} is out of range [0, {rows})")
        return tensor

    def _dense(self, dense) -> Optional[torch.Tensor]:
        if self.dense_in_features is None:
            if dense is not None:
                raise ValueError("the model takes no dense features, the request has some")
            return None
        if dense is None:
            raise ValueError(f"the request has no dense features; the model takes {self.dense_in_features}")
        try:
            tensor = torch.as_tensor(dense)
        except (TypeError, ValueError, RuntimeError) as err:
            raise ValueError(f"dense features must be {self.dense_in_features} floats: {err}") from None
        if not tensor.is_floating_point():
            raise ValueError(f"dense features must be floats, got {tensor.dtype}")
        if tuple(tensor.shape) != (self.dense_in_features,):
            raise ValueError(
                f"dense features must have shape [{self.dense_in_features}], got {list(tensor.shape)}"
            )
        return tensor.to(torch.float32)

    def check(self, request: Request) -> Tuple[Dict[str, torch.Tensor], Optional[torch.Tensor]]:
        """The request's ids per feature (every key; missing ones empty) and dense features; ``ValueError``
        saying what is wrong with it."""
        if not isinstance(request, Request) or not isinstance(request.sparse, Mapping):
            raise ValueError(
                f"a request is a Request with a dict of ids per feature, got {type(request).__name__}"
            )
        unknown = sorted(set(request.sparse) - set(self.feature_rows), key=str)
        if unknown:
            raise ValueError(f"unknown feature(s) {unknown} (the model's features: {self.keys})")
        ids = {f: self._ids(f, request.sparse[f]) for f in self.keys if f in request.sparse}
        empty = torch.empty(0, dtype=torch.int64)
        return {f: ids.get(f, empty) for f in self.keys}, self._dense(request.dense)

    def batch(self, requests: Sequence[Request]) -> Tuple[Dict[str, torch.Tensor], List[int], Dict[int, str]]:
        """(batch dict of the good requests, their indices in ``requests``, index -> each bad one's error)."""
        good, checked, errors = [], [], {}
        for i, request in enumerate(requests):
            try:
                checked.append(self.check(request))
                good.append(i)
            except (TypeError, ValueError, RuntimeError) as err:  # torch's conversions raise all three
                errors[i] = f"request {i}: {err}"
        lengths = torch.tensor([len(ids[f]) for f in self.keys for ids, _ in checked], dtype=torch.int64)
        values = [ids[f] for f in self.keys for ids, _ in checked]
        batch = {
            LENGTHS: lengths,
            VALUES: torch.cat(values) if values else torch.empty(0, dtype=torch.int64),
        }
        if self.dense_in_features is not None:
            dense = [d for _, d in checked]
            batch[FLOAT_FEATURES] = (
                torch.stack(dense) if dense else torch.empty(0, self.dense_in_features, dtype=torch.float32)
            )
        return batch, good, errors

    def to_kjt(self, batch: Mapping[str, torch.Tensor]) -> KeyedJaggedTensor:
        """The batch's sparse features as a KeyedJaggedTensor of this batcher's keys."""
        return KeyedJaggedTensor(self.keys, batch[VALUES], lengths=batch[LENGTHS])


def split_results(result: Any, batch_size: int) -> List[Any]:
    """One entry per sample of a batch's ``result``: a tensor's rows, a KeyedTensor's ``{key: row}``,
    or a dict of such per key (``{name: row}``). ``TypeError`` for anything else."""
    if isinstance(result, KeyedTensor):
        result = result.to_dict()
    if isinstance(result, torch.Tensor):
        if result.dim() == 0 or result.size(0) != batch_size:
            raise ValueError(f"a result of shape {list(result.shape)} for a batch of {batch_size}")
        return list(result.unbind(0))
    if isinstance(result, Mapping):
        parts = {k: split_results(v, batch_size) for k, v in result.items()}
        return [{k: parts[k][i] for k in parts} for i in range(batch_size)]
    raise TypeError(f"cannot split a result of type {type(result).__name__} into samples")


class PredictModule(nn.Module):
    """torchrec's ``PredictModule``: wraps the model served; subclasses implement ``predict_forward``.

    Args:
        module: the model (put in eval mode).
        device: where its inputs go (default: the device of its first parameter or buffer, else CPU).
    """

    def __init__(self, module: nn.Module, device: Optional[torch.device] = None) -> None:
        super().__init__()
        self._module = module
        self._module.eval()
        if device is None:
            first = next(iter([*module.parameters(), *module.buffers()]), None)
            device = first.device if first is not None else torch.device("cpu")
        self._device = torch.device(device)

    @property
    def predict_module(self) -> nn.Module:
        return self._module

    @property
    def device(self) -> torch.device:
        return self._device

    @abc.abstractmethod
    def predict_forward(self, batch: Dict[str, torch.Tensor]) -> Any:
        """The model's answer to ``batch`` (a dict of tensors; see the module docstring)."""

    def forward(self, batch: Dict[str, torch.Tensor]) -> Any:
        batch = {k: v.to(self._device) for k, v in batch.items()}
        with torch.inference_mode():
            if self._device.type == "cuda":
                with torch.cuda.device(self._device):
                    return self.predict_forward(batch)
            return self.predict_forward(batch)

    def state_dict(self, destination=None, prefix: str = "", keep_vars: bool = False) -> Dict[str, Any]:
        return self._module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)

    def batcher(self) -> RequestBatcher:
        """How this module's requests are checked and batched; subclasses that take requests define it."""
        raise NotImplementedError(f"{type(self).__name__} does not take Requests: define batcher()")

    def answer(self, requests: Sequence[Request]) -> List[Answer]:
        """One :class:`Answer` per request, in order (see the module docstring)."""
        batcher = self.batcher()
        batch, good, errors = batcher.batch(requests)
        results = split_results(self(batch), len(good))
        answers = [Answer(error=errors[i]) if i in errors else None for i in range(len(requests))]
        for i, result in zip(good, results):
            answers[i] = Answer(result=result)
        return answers


@dataclasses.dataclass
class BatchingMetadata:
    """torchrec's ``BatchingMetadata``: how a server batches one input of the batch dict.

    ``type``: the input's kind (torchrec's servers know ``"dense"`` and ``"sparse"``), ``device``:
    ``"cpu"`` or ``"cuda"``, ``pinned``: suffixes of the inputs to put in pinned memory."""

    type: str
    device: str
    pinned: List[str]


@dataclasses.dataclass
class QualNameMetadata:
    """torchrec's ``QualNameMetadata``: whether a method of the predict module needs preprocessing."""

    need_preproc: bool


class PredictFactory(abc.ABC):
    """torchrec's ``PredictFactory``: makes the predict module a server runs, and says how to batch.

    Subclasses implement ``create_predict_module`` (the model with its weights, e.g. from
    ``load_package``), ``batching_metadata`` (input name -> :class:`BatchingMetadata`) and
    ``result_metadata`` (a name of the result's type); the two transformation hooks default to returning
    the module unchanged (torchrec's are abstract)."""

    @abc.abstractmethod
    def create_predict_module(self) -> nn.Module:
        """The predict module, with its learned weights."""

    @abc.abstractmethod
    def batching_metadata(self) -> Dict[str, BatchingMetadata]:
        """Input name -> how requests' values of that input are batched."""

    def batching_metadata_json(self) -> str:
        """:meth:`batching_metadata` as JSON (torchrec's format: ``{name: {type, device, pinned}}``)."""
        return json.dumps({k: dataclasses.asdict(v) for k, v in self.batching_metadata().items()})

    @abc.abstractmethod
    def result_metadata(self) -> str:
        """The result's type, by name (e.g. ``"dict_of_tensor"``)."""

    def run_weights_independent_tranformations(self, predict_module: nn.Module) -> nn.Module:
        """Transformations that do not depend on the weights (torchrec's spelling, typo included)."""
        return predict_module

    def run_weights_dependent_transformations(self, predict_module: nn.Module) -> nn.Module:
        """Transformations that depend on the weights."""
        return predict_module

    def qualname_metadata(self) -> Dict[str, QualNameMetadata]:
        return {}

    def qualname_metadata_json(self) -> str:
        return json.dumps({k: dataclasses.asdict(v) for k, v in self.qualname_metadata().items()})

    def model_inputs_data(self) -> Dict[str, Any]:
        return {}


class DLRMPredictModule(PredictModule):
    """Serves a ``shardkit.models.DLRM`` (float, quantized, or sharded by ``shard_quant_model``).

    ``predict_forward(batch)`` -> ``{"default": logits [B]}``; ``answer(requests)`` gives each good
    request ``{"default": its logit}`` (a 0-d tensor). ``feature_rows`` defaults to the model's tables
    (each feature -> its table's ``num_embeddings``).
    """

    def __init__(
        self,
        module: nn.Module,
        dense_in_features: int,
        feature_rows: Optional[Mapping[str, int]] = None,
        device: Optional[torch.device] = None,
    ) -> None:
        super().__init__(module, device)
        if feature_rows is None:
            configs = module.sparse_arch.embedding_bag_collection.embedding_bag_configs()
            feature_rows = {f: c.num_embeddings for c in configs for f in c.feature_names}
        self._batcher = RequestBatcher(feature_rows, dense_in_features)

    def batcher(self) -> RequestBatcher:
        return self._batcher

    def predict_forward(self, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        logits = self.predict_module(batch[FLOAT_FEATURES], self._batcher.to_kjt(batch))
        return {"default": logits.reshape(-1)}


__all__ = [
    "Answer",
    "BatchingMetadata",
    "PredictFactory",
    "QualNameMetadata",
    "DLRMPredictModule",
    "FLOAT_FEATURES",
    "LENGTHS",
    "PredictModule",
    "Request",
    "RequestBatcher",
    "VALUES",
    "split_results",
]
